#include "hip/trace_session.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

namespace hipferry::tracing {
namespace {

struct PendingSpan {
  trace::TraceEvent event;  // times filled in by stop()
  int device;
  std::shared_ptr<rt::Event> begin, end;
};

// Host time of one completed timing event per device: stream times are
// host_ns + elapsed(anchor, event).
struct Anchor {
  std::shared_ptr<rt::Event> event;
  std::int64_t host_ns = 0;
};

std::atomic<bool> session_active{false};
std::atomic<std::uint64_t> session_number{0};  // spans begun in one session are dropped by another
std::mutex mutex;                              // guards the three below; never held across a runtime call
trace::TraceRecorder recorder;
std::vector<PendingSpan> pending;
std::map<int, Anchor> anchors;

Anchor anchor_for(int device) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = anchors.find(device);
    if (it != anchors.end()) return it->second;
  }
  // An idle stream of its own: the event passes as soon as it is recorded.
  rt::Stream stream(device);
  Anchor a{std::make_shared<rt::Event>(device, /*timing=*/true), 0};
  a.host_ns = now_ns();  // the idle stream passes the event as it is recorded
  a.event->record(stream.handle());
  a.event->synchronize();
  std::lock_guard<std::mutex> lock(mutex);
  return anchors.emplace(device, a).first->second;  // a racing thread's anchor wins
}

}  // namespace

bool active() { return session_active.load(std::memory_order_acquire); }

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start() {
  std::lock_guard<std::mutex> lock(mutex);
  if (session_active.load()) {
    throw std::logic_error(
        "hipferry.trace: a trace is already active; expected one trace at a time (nesting "
        "is not supported)");
  }
  recorder.clear();
  pending.clear();
  anchors.clear();
  session_number.fetch_add(1);
  session_active.store(true, std::memory_order_release);
}

TraceResult stop() {
  std::vector<PendingSpan> spans;
  std::map<int, Anchor> anchor_copy;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!session_active.load()) throw std::logic_error("hipferry.trace: no trace is active");
    session_active.store(false, std::memory_order_release);
    spans.swap(pending);
    anchor_copy = anchors;
  }
  for (PendingSpan& s : spans) {  // runtime calls: outside the lock
    auto a = anchor_copy.find(s.device);
    if (a == anchor_copy.end()) continue;  // no anchor: cannot be placed in time
    s.end->synchronize();
    // Offsets from one anchor, durations from the span's own events (float
    // milliseconds lose resolution as the offset grows; the duration does not).
    const double offset_ms = rt::Event::elapsed_ms(*a->second.event, *s.begin);
    const double duration_ms = rt::Event::elapsed_ms(*s.begin, *s.end);
    s.event.start_ns = a->second.host_ns + static_cast<std::int64_t>(offset_ms * 1e6);
    s.event.end_ns = s.event.start_ns + std::max<std::int64_t>(0, static_cast<std::int64_t>(duration_ms * 1e6));
    recorder.add(std::move(s.event));
  }
  TraceResult result{recorder.events(), recorder.chrome_json()};
  recorder.clear();
  std::lock_guard<std::mutex> lock(mutex);
  anchors.clear();
  return result;
}

void add_host_span(std::string name, std::string category, std::string track, std::int64_t start_ns,
                   std::int64_t end_ns, std::size_t bytes) {
  if (!active()) return;
  recorder.add(trace::TraceEvent{std::move(name), std::move(category), std::move(track), start_ns,
                                 end_ns < start_ns ? start_ns : end_ns, bytes});
}

StreamSpan::StreamSpan(int device, rt::StreamHandle stream, std::string track, std::string name, std::string category,
                       std::size_t bytes)
    : device_(device),
      stream_(stream),
      track_(std::move(track)),
      name_(std::move(name)),
      category_(std::move(category)),
      bytes_(bytes) {
  if (!active()) return;
  session_ = session_number.load();
  anchor_for(device);  // before begin_, so elapsed times are never negative
  begin_ = std::make_shared<rt::Event>(device, /*timing=*/true);
  begin_->record(stream);
}

void StreamSpan::end() {
  if (!begin_) return;
  auto end = std::make_shared<rt::Event>(device_, /*timing=*/true);
  end->record(stream_);
  std::lock_guard<std::mutex> lock(mutex);
  if (!session_active.load() || session_number.load() != session_) return;  // its session ended meanwhile
  trace::TraceEvent e{name_, category_, track_, 0, 0, bytes_};
  pending.push_back(PendingSpan{std::move(e), device_, std::move(begin_), std::move(end)});
}

namespace {
class HostSpans : public schedule::SpanSink {
 public:
  bool active() const override { return tracing::active(); }
  std::int64_t now_ns() const override { return tracing::now_ns(); }
  void add(const schedule::Label& label, const std::string& track, std::int64_t start_ns,
           std::int64_t end_ns) override {
    add_host_span(label.name, label.category, track, start_ns, end_ns, label.bytes);
  }
};
}  // namespace

schedule::SpanSink* host_spans() {
  static HostSpans sink;  // stateless
  return &sink;
}

std::string stream_track(int device, CopyStream stream) {
  const char* kind = stream == CopyStream::kToDevice ? " host->device stream"
                     : stream == CopyStream::kToHost ? " device->host stream"
                                                     : " staging stream";
  return "gpu:" + std::to_string(device) + kind;
}

}  // namespace hipferry::tracing
