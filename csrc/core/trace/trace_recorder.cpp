// Trace recording and Chrome trace-event JSON (see trace_recorder.h).
#include "csrc/core/trace/trace_recorder.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>

namespace hipferry::trace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);  // UTF-8 passes through unchanged
        }
    }
  }
  return out + "\"";
}

void TraceRecorder::add(TraceEvent event) {
  if (event.end_ns < event.start_ns) {
    throw std::invalid_argument("TraceRecorder::add: event '" + event.name + "' ends before it starts");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(std::move(event));
}

std::vector<TraceEvent> TraceRecorder::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

void TraceRecorder::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
}

std::string TraceRecorder::chrome_json() const {
  const std::vector<TraceEvent> events = this->events();
  std::int64_t origin = 0;
  if (!events.empty()) {
    origin = std::min_element(events.begin(), events.end(), [](const TraceEvent& a, const TraceEvent& b) {
               return a.start_ns < b.start_ns;
             })->start_ns;
  }
  std::map<std::string, int> track_ids;  // track name -> thread id, numbered in name order
  for (const TraceEvent& e : events) track_ids.emplace(e.track, 0);
  int next = 1;
  for (auto& [track, id] : track_ids) id = next++;

  std::string out = "{\"displayTimeUnit\": \"ns\", \"traceEvents\": [\n";
  bool first = true;
  const auto emit = [&](const std::string& item) {
    out += first ? "  " : ",\n  ";
    out += item;
    first = false;
  };
  emit("{\"ph\": \"M\", \"pid\": 1, \"name\": \"process_name\", \"args\": {\"name\": \"hipferry\"}}");
  for (const auto& [track, id] : track_ids) {
    emit("{\"ph\": \"M\", \"pid\": 1, \"tid\": " + std::to_string(id) +
         ", \"name\": \"thread_name\", \"args\": {\"name\": " + json_string(track) + "}}");
  }
  char buf[160];
  for (const TraceEvent& e : events) {
    const double ts_us = static_cast<double>(e.start_ns - origin) / 1e3;
    const double dur_us = static_cast<double>(e.end_ns - e.start_ns) / 1e3;
    const double gbps =
        e.end_ns > e.start_ns ? static_cast<double>(e.bytes) / static_cast<double>(e.end_ns - e.start_ns) : 0.0;
    std::snprintf(buf, sizeof buf, ", \"ts\": %.3f, \"dur\": %.3f, \"args\": {\"bytes\": %zu, \"GBps\": %.3f}}", ts_us,
                  dur_us, e.bytes, gbps);
    emit("{\"ph\": \"X\", \"pid\": 1, \"tid\": " + std::to_string(track_ids[e.track]) +
         ", \"name\": " + json_string(e.name) + ", \"cat\": " + json_string(e.category) + buf);
  }
  out += "\n]}\n";
  return out;
}

}  // namespace hipferry::trace
