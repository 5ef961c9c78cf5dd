// hipferry.trace(): while a session is active, the transfer engine reports
// each copy and kernel it runs. Stream work is timed with runtime timing
// events (converted to host time through one anchor event per device);
// worker and user work with the steady clock. Nothing is recorded, and no
// event is created, while no session is active.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/core/schedule/stream.h"
#include "csrc/core/trace/trace_recorder.h"
#include "hip/runtime.h"

namespace hipferry::tracing {

bool active();
std::int64_t now_ns();  // steady clock, the trace's time base

// Throws std::logic_error when a session is already active.
void start();
struct TraceResult {
  std::vector<trace::TraceEvent> events;  // in the order recorded
  std::string chrome_json;                // TraceRecorder::chrome_json() of them
};
// Ends the session: waits for the timed stream work, returns every event.
// Throws std::logic_error when no session is active.
TraceResult stop();

// A host-timed span (worker tasks, user regions). No-op when not active.
void add_host_span(std::string name, std::string category, std::string track, std::int64_t start_ns,
                   std::int64_t end_ns, std::size_t bytes);

// A span of work enqueued on a GPU stream: construct before enqueueing (it
// records a timing event when a session is active), call end() after.
class StreamSpan {
 public:
  StreamSpan(int device, rt::StreamHandle stream, std::string track, std::string name, std::string category,
             std::size_t bytes);
  void end();

 private:
  int device_;
  rt::StreamHandle stream_;
  std::string track_, name_, category_;
  std::size_t bytes_;
  std::uint64_t session_ = 0;         // the session the span began in
  std::shared_ptr<rt::Event> begin_;  // nullptr when not tracing
};

// "gpu:0 host->device stream" and friends: one place for track names.
enum class CopyStream { kToDevice, kToHost, kStaging };
std::string stream_track(int device, CopyStream stream);
inline const char* worker_track() { return "cpu transfer worker"; }

// The trace as the CPU streams of the copy scheduler see it (add_host_span).
schedule::SpanSink* host_spans();

}  // namespace hipferry::tracing
