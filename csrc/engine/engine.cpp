#include "csrc/engine/engine.h"

#include <pthread.h>

#include <utility>

namespace hipferry::engine {
namespace {

std::atomic<std::uint64_t> forks{0};  // forks since the engine was first used
std::atomic<Engine*> instance{nullptr};
std::mutex creation_mutex;

}  // namespace

Engine& Engine::get() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, [] {
      instance = nullptr;  // the parent's engine (and its worker thread) is not the child's
      forks.fetch_add(1);
    });
  });
  Engine* e = instance.load(std::memory_order_acquire);
  if (e != nullptr) return *e;
  std::lock_guard<std::mutex> lock(creation_mutex);
  e = instance.load(std::memory_order_acquire);
  if (e == nullptr) {
    e = new Engine();
    instance.store(e, std::memory_order_release);
  }
  return *e;
}

std::uint64_t Engine::fork_generation() { return forks.load(); }

bool Completion::done() const {
  if (ticket != 0 && !Engine::get().worker().reached(ticket)) return false;
  return !event || event->query();
}

PathContext Engine::context(std::shared_ptr<pool::HostPool> pool, ParallelFor parallel_for) {
  return PathContext{
      worker_, counters_, std::move(pool), batched_.load(), &runtime_batch_works_, std::move(parallel_for)};
}

std::string Engine::batched_copy() const {
  if (batched_.load() == BatchedCopy::kKernel) return "kernel";
  return runtime_batch_works_.load() ? "runtime" : "kernel (the runtime has no batched copy)";
}

rt::StreamHandle Engine::stream(int device, tracing::CopyStream kind) {
  const std::size_t at = static_cast<std::size_t>(device) * 3 + static_cast<std::size_t>(kind);
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    if (at < streams_.size() && streams_[at]) return streams_[at]->handle();
  }
  auto created = std::make_unique<rt::Stream>(device);  // runtime call: outside the lock
  std::lock_guard<std::mutex> lock(streams_mutex_);
  if (at >= streams_.size()) streams_.resize(at + 1);
  if (!streams_[at]) streams_[at] = std::move(created);  // else a racing thread's stream wins
  return streams_[at]->handle();
}

void Engine::release_after(const Completion& completion, std::shared_ptr<void> holding) {
  releases_.release_after([completion] { return completion.done(); }, std::move(holding));
}

void Engine::drain_worker() { worker_.wait(worker_.last_submitted()); }

}  // namespace hipferry::engine
