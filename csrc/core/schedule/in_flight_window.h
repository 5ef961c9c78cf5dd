// A bound on the bytes that copies in flight may hold (Note [copy scheduler]).
//
// Each entry is a copy queued somewhere, its size, and the event after which
// it no longer holds its memory. admit(bytes) makes room before the next copy
// is queued: it settles every entry that has completed (oldest first, never
// blocking), then blocks on the oldest until `bytes` more fit. An empty
// window admits anything, so one copy larger than the bound still runs.
// Settling an entry runs its `settled` callback on the settling thread (the
// owner lets go of the memory there). A callback may withdraw other entries.
// Not thread-safe: one caller at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>

#include "csrc/core/schedule/stream.h"

namespace hipferry::schedule {

class InFlightWindow {
 public:
  explicit InFlightWindow(std::size_t max_bytes) : max_bytes_(max_bytes) {}
  virtual ~InFlightWindow() = default;

  // Makes room for `bytes` more (see above). An entry whose event reports an
  // error is settled all the same (its callback runs), then the error is
  // thrown; the window stays usable.
  virtual void admit(std::size_t bytes);
  // A copy of `bytes` was queued; `done` passes when it no longer holds them.
  // Returns the entry's id (for withdraw).
  std::uint64_t add(std::shared_ptr<Event> done, std::size_t bytes, std::function<void()> settled = {});
  // The owner takes entry `id` back before it settled (out of order: its
  // consumer needs the data where it is, or no one needs it any more): it no
  // longer counts, and its callback never runs. The copy itself is not
  // waited for: the owner keeps its memory until it completes. False when
  // `id` is not in the window (settled or withdrawn already).
  bool withdraw(std::uint64_t id);
  // Settles what has completed; never blocks. Returns how many were settled.
  std::size_t settle();
  // Blocks until every entry has completed and is settled; throws the first error.
  void drain();

  std::size_t bytes() const { return bytes_; }
  std::size_t peak_bytes() const { return peak_; }
  std::size_t entries() const { return entries_.size(); }
  std::size_t max_bytes() const { return max_bytes_; }
  std::size_t waits() const { return waits_; }  // admits that blocked the host

 protected:
  struct Entry {
    std::uint64_t id = 0;
    std::shared_ptr<Event> done;
    std::size_t bytes = 0;
    std::function<void()> settled;
  };
  void settle_front(bool block);  // pops the oldest entry, runs its callback; rethrows its error after
  std::size_t max_bytes_;
  std::deque<Entry> entries_;  // oldest first
  std::size_t bytes_ = 0;      // sum of entries_' bytes
  std::size_t peak_ = 0;
  std::size_t waits_ = 0;
  std::uint64_t next_id_ = 1;  // of the next add()
};

}  // namespace hipferry::schedule
