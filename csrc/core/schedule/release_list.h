// Memory that queued copies may still touch, let go of only once the host has
// seen those copies complete (Note [copy scheduler]).
//
// A holding is an owner of anything (tensors, device scratch, pool blocks),
// type-erased: the list never looks inside, it only drops it. The list asks
// `done()` -- never blocking -- whether the copies that use the holding have
// finished; a holding is never dropped on a guess from stream order.
// Invariants:
//   * a holding dies only after its done() returned true, on the thread that
//     asked (release_after or poll), with no lock held: a dying holding may
//     take locks (the GIL), call back into the list, or queue more work;
//   * a done() that throws means "the runtime cannot say": the holding is kept
//     (a leak, never a use after free) and asked again at the next poll;
//   * every holding is dropped exactly once; pending() counts the kept ones.
// Thread-safe: any thread may add or poll. `mutex_` guards `held_` only, and
// is never held while done() runs or a holding dies.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace hipferry::schedule {

class ReleaseList {
 public:
  // Never blocks; true once the copies that use the holding have finished.
  using Done = std::function<bool()>;

  // Drops `holding` now if done() says so, else keeps it for a later poll().
  void release_after(Done done, std::shared_ptr<void> holding);
  // Drops every kept holding whose done() now says so; returns how many.
  std::size_t poll();
  // Holdings kept, waiting for their copies.
  std::size_t pending() const;

 private:
  struct Held {
    Done done;
    std::shared_ptr<void> holding;
  };
  static bool finished(const Done& done);  // done(), false when it throws

  mutable std::mutex mutex_;  // guards held_
  std::vector<Held> held_;    // kept holdings, oldest first
};

}  // namespace hipferry::schedule
