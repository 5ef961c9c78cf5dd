// GPU streams of the copy scheduler (see gpu_stream.h).
#include "hip/gpu_stream.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "hip/trace_session.h"

namespace hipferry::gpu {

std::shared_ptr<rt::Event> EventPool::get() {
  std::unique_ptr<rt::Event> e;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      e = std::move(free_.back());
      free_.pop_back();
    }
  }
  if (!e) e = std::make_unique<rt::Event>(device_);  // runtime call: outside the lock
  std::weak_ptr<EventPool> pool = weak_from_this();
  return std::shared_ptr<rt::Event>(e.release(), [pool](rt::Event* raw) {
    std::unique_ptr<rt::Event> back(raw);
    if (auto p = pool.lock()) {  // re-recording a pooled event is safe: waits already queued keep their point
      std::lock_guard<std::mutex> lock(p->mutex_);
      p->free_.push_back(std::move(back));
    }
  });
}

std::shared_ptr<EventPool> EventPool::of_device(int device) {
  static std::mutex mutex;  // guards pools
  // Never destroyed: pooled events may be let go of during static destruction.
  static auto* pools = new std::vector<std::shared_ptr<EventPool>>();
  std::lock_guard<std::mutex> lock(mutex);  // no runtime call under it: a pool creates events on get()
  if (device < 0) throw std::invalid_argument("EventPool::of_device: device " + std::to_string(device));
  if (static_cast<std::size_t>(device) >= pools->size()) pools->resize(static_cast<std::size_t>(device) + 1);
  auto& pool = (*pools)[static_cast<std::size_t>(device)];
  if (!pool) pool = std::make_shared<EventPool>(device);
  return pool;
}

GpuStream::GpuStream(int device, std::string track)
    : device_(device),
      owned_(std::make_unique<rt::Stream>(device)),
      handle_(owned_->handle()),
      track_(std::move(track)),
      events_(std::make_shared<EventPool>(device)) {}

GpuStream::GpuStream(int device, rt::StreamHandle borrowed, std::string track)
    : device_(device), handle_(borrowed), track_(std::move(track)), events_(EventPool::of_device(device)) {}

void GpuStream::copy(void* dst, const void* src, std::size_t bytes, const schedule::Label& label) {
  rt::DeviceGuard guard(device_);
  tracing::StreamSpan span(device_, handle_, track_, label.name, label.category, label.bytes);
  rt::memcpy_async(dst, src, bytes, handle_);
  span.end();
}

void GpuStream::enqueue(schedule::Work work) {
  if (!work.on_device) throw std::invalid_argument("GpuStream: work '" + work.label.name + "' has no device form");
  rt::DeviceGuard guard(device_);
  tracing::StreamSpan span(device_, handle_, track_, work.label.name, work.label.category, work.label.bytes);
  work.on_device(handle_);
  span.end();
}

std::shared_ptr<schedule::Event> GpuStream::record() {
  rt::DeviceGuard guard(device_);
  auto e = events_->get();
  e->record(handle_);
  return std::make_shared<GpuEvent>(std::move(e));
}

void GpuStream::wait(const std::shared_ptr<schedule::Event>& event) {
  if (!event) return;
  if (auto* gpu = dynamic_cast<GpuEvent*>(event.get())) {
    rt::DeviceGuard guard(device_);
    gpu->native().block_stream(handle_);
  } else {
    event->synchronize();  // a CPU stream's event: only the host can wait for it
  }
}

}  // namespace hipferry::gpu
