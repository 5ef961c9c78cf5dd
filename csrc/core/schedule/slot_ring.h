// A ring of buffers reused in stream order (Note [copy scheduler]).
//
// A slot's life: acquire(k, first) -- the first stage (a copy in, a host
// pack) waits until the slot's previous occupant was released; pass(k, a, b)
// -- each next stage (the consumer, a copy out) waits for what the stage
// before it queued; release(k, last) -- the slot is free once `last` passes
// what it has queued so far. So:
//   * a slot is never refilled before its previous occupant's last stage
//     (the consumer, or the copy out after it) has finished;
//   * a consumer never runs before the copy that filled its slot;
// and no stage ever blocks the host, except where a stage is the host itself
// (an ImmediateStream waits by synchronizing).
// Not thread-safe: one caller drives one ring. The methods are virtual only
// so that the tests can prove the property test catches broken rings.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "csrc/core/schedule/stream.h"

namespace hipferry::schedule {

class SlotRing {
 public:
  explicit SlotRing(std::size_t slots);  // throws std::invalid_argument for 0
  virtual ~SlotRing() = default;
  SlotRing(const SlotRing&) = delete;
  SlotRing& operator=(const SlotRing&) = delete;

  std::size_t size() const { return released_.size(); }
  // Slots in round-robin order: 0, 1, ..., size()-1, 0, ...
  std::size_t next_slot() { return turn_++ % size(); }

  // Orders `first` (the stream of the slot's first stage) after the release
  // of slot k's previous occupant.
  virtual void acquire(std::size_t k, Stream& first);
  // The next stage of slot k runs on `to`, after what `from` has queued (no-op when they are one stream).
  virtual void pass(std::size_t k, Stream& from, Stream& to);
  // Slot k's last stage has been queued on `last`: it is free once `last` passes this point.
  virtual void release(std::size_t k, Stream& last);

  // True when every release has passed. Never blocks.
  bool idle();
  // Blocks until every release has passed; then throws the first error any
  // of them reported (all are waited for first, so nothing is still running).
  void synchronize();

 protected:
  std::vector<std::shared_ptr<Event>> released_;  // per slot: its last release (nullptr: never used)
  std::size_t turn_ = 0;                          // next_slot()'s counter
};

}  // namespace hipferry::schedule
