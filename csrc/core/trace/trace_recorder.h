// Records what hipferry's copies and kernels did, and when, per track (a
// stream or a worker), plus the user's marked regions; writes the Chrome /
// Perfetto trace-event JSON (chrome://tracing, ui.perfetto.dev).
//
// Times come from whoever measured them (runtime events on a GPU, the steady
// clock on the CPU), in nanoseconds on one common origin.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace hipferry::trace {

struct TraceEvent {
  std::string name;      // "h2d copy_cast float32->bfloat16"
  std::string category;  // "copy", "kernel", "user", ...
  std::string track;     // "cuda:0 h2d stream", "cpu worker", "user"
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;  // >= start_ns
  std::size_t bytes = 0;    // bytes moved, 0 when not a copy
};

class TraceRecorder {
 public:
  // Thread-safe. Throws std::invalid_argument when end_ns < start_ns.
  void add(TraceEvent event);
  std::vector<TraceEvent> events() const;  // in the order added
  void clear();
  // {"traceEvents": [...], "displayTimeUnit": "ns"}: one complete ("X")
  // event per TraceEvent with args {bytes, GBps}, times in microseconds
  // relative to the earliest start, tracks as named threads of one process.
  std::string chrome_json() const;

 private:
  mutable std::mutex mutex_;  // guards events_
  std::vector<TraceEvent> events_;
};

// `text` as a JSON string literal, quotes included.
std::string json_string(const std::string& text);

}  // namespace hipferry::trace
