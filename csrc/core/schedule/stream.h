// The copy scheduler's view of asynchronous work: streams that run work in
// order, and events that mark a point in a stream's work.
//
// Note [copy scheduler]
// ~~~~~~~~~~~~~~~~~~~~~
// Every ring in hipferry (the transfer engine's staging ring, the streamed
// AdamW step, the layer ring's copies) decides "who waits for what" with the
// pieces in this folder, written once against these interfaces:
//   * Stream / Event (this file): the GPU implementation wraps runtime
//     streams and events (hip/gpu_stream.h); CPU streams run work on the
//     calling thread or on a worker thread (host_streams.h); the tests plug in
//     fake streams whose completion is adversarial (tests/cpp/fake_device.h).
//   * SlotRing (slot_ring.h): stream-ordered reuse of a ring of buffers;
//   * InFlightWindow (in_flight_window.h): a bound on bytes in flight;
//   * ReleaseList (release_list.h): memory let go of only once the host has
//     seen the copies that use it complete;
//   * Outcome (outcome.h): the first error of a job, seen by every waiter.
// Rules every implementation keeps:
//   * work queued on one stream runs in queue order; an event completes when
//     everything queued before its record() has finished;
//   * Stream::wait orders later work after an event without blocking the host;
//   * a failure is sticky: work queued after a failed piece on the same
//     stream does not run, and every event recorded after it -- on that stream
//     or on a stream that waited for it -- reports the error from
//     synchronize() (query() just says "finished");
//   * no implementation holds a lock while it runs queued work or calls the
//     runtime, so work may queue more work.
// Work declares the memory it reads and writes (`reads`, `writes`). Real
// streams ignore that; the fakes use it to catch any two accesses to the same
// bytes that run in another order than they were queued.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hipferry::schedule {

// Bytes a piece of work reads or writes.
struct Range {
  const void* begin = nullptr;
  std::size_t bytes = 0;
};

// What a piece of work is, for the trace: "copy in", "copy" or "kernel", bytes moved.
struct Label {
  std::string name;
  std::string category = "copy";
  std::size_t bytes = 0;
};

// A GPU stream's native handle (hipStream_t / cudaStream_t); nullptr on CPU streams.
using NativeStream = void*;

// Work queued on a stream: how a CPU stream runs it, and how a GPU stream
// queues it. A stream uses the one it needs; both may be given.
struct Work {
  Label label;
  std::function<void()> on_host;
  std::function<void(NativeStream)> on_device;
  std::vector<Range> reads, writes;
};

class Event {
 public:
  virtual ~Event() = default;
  // True once the work queued before the record has finished (or failed).
  // Never blocks.
  virtual bool query() = 0;
  // Blocks the host until then; throws std::runtime_error when that work (or
  // work it waited for) failed. Every caller gets the error, not only the first.
  virtual void synchronize() = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;
  // Queues a byte copy between two addresses this stream can reach. Throws,
  // having queued nothing, when it cannot be queued.
  virtual void copy(void* dst, const void* src, std::size_t bytes, const Label& label) = 0;
  // Queues `work`. Throws, having queued nothing, when it cannot be queued.
  virtual void enqueue(Work work) = 0;
  // An event after everything queued on this stream so far.
  virtual std::shared_ptr<Event> record() = 0;
  // Work queued on this stream from now on runs after `event`; the host
  // does not wait. A failed event fails this stream.
  virtual void wait(const std::shared_ptr<Event>& event) = 0;
  // The trace track: "gpu:0 host->device stream", "cpu transfer worker".
  virtual std::string track() const = 0;
};

// Where CPU streams report the spans of the work they run (the trace; see
// hipferry.trace()). nullptr: nothing is reported.
class SpanSink {
 public:
  virtual ~SpanSink() = default;
  virtual bool active() const = 0;  // a trace is being recorded: measure
  virtual std::int64_t now_ns() const = 0;
  virtual void add(const Label& label, const std::string& track, std::int64_t start_ns, std::int64_t end_ns) = 0;
};

}  // namespace hipferry::schedule
