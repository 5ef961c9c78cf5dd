// The copy scheduler's streams and events on a GPU (Note [copy scheduler] in
// csrc/core/schedule/stream.h): runtime streams and events, vendor-free C++
// over hip/runtime.h. Work shows on hipferry.trace() timelines as it runs
// (timing events around it, while a trace is active).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/core/schedule/stream.h"
#include "hip/runtime.h"

namespace hipferry::gpu {

// Runtime events handed out again once their last user lets go: a ring that
// records an event per chunk does not create one per chunk.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(int device) : device_(device) {}
  std::shared_ptr<rt::Event> get();  // throws rt::Error
  // The process's pool of `device`, shared by the wrappers of borrowed streams
  // (made per call around torch's current stream: they create no event of their own).
  static std::shared_ptr<EventPool> of_device(int device);

 private:
  int device_;
  std::mutex mutex_;  // guards free_; no runtime call under it
  std::vector<std::unique_ptr<rt::Event>> free_;
};

// An event recorded on a GpuStream.
class GpuEvent : public schedule::Event {
 public:
  explicit GpuEvent(std::shared_ptr<rt::Event> event) : event_(std::move(event)) {}
  bool query() override { return event_->query(); }
  void synchronize() override { event_->synchronize(); }  // rt::Error (a std::runtime_error) on a device error
  const rt::Event& native() const { return *event_; }

 private:
  std::shared_ptr<rt::Event> event_;
};

class GpuStream : public schedule::Stream {
 public:
  // A new non-blocking stream of hipferry's own on `device`.
  GpuStream(int device, std::string track);
  // Someone else's stream (torch's current stream; nullptr: the device's default
  // stream). Cheap: its events come from EventPool::of_device.
  GpuStream(int device, rt::StreamHandle borrowed, std::string track);
  void copy(void* dst, const void* src, std::size_t bytes, const schedule::Label& label) override;
  void enqueue(schedule::Work work) override;  // runs work.on_device on this stream's handle
  std::shared_ptr<schedule::Event> record() override;
  // GPU events: the stream waits, not the host. Other events (a CPU stream's) are host waits.
  void wait(const std::shared_ptr<schedule::Event>& event) override;
  std::string track() const override { return track_; }
  rt::StreamHandle handle() const { return handle_; }
  int device() const { return device_; }

 private:
  int device_;
  std::unique_ptr<rt::Stream> owned_;  // nullptr when borrowed
  rt::StreamHandle handle_;
  std::string track_;
  std::shared_ptr<EventPool> events_;
};

}  // namespace hipferry::gpu
