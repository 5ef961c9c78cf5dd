#include "csrc/core/schedule/release_list.h"

#include <utility>

namespace hipferry::schedule {

bool ReleaseList::finished(const Done& done) {
  try {
    return done();
  } catch (...) {  // the runtime cannot say: keep holding (a leak, never a use after free)
    return false;
  }
}

void ReleaseList::release_after(Done done, std::shared_ptr<void> holding) {
  if (!holding) return;
  if (finished(done)) return;  // `holding` dies here, unlocked
  std::lock_guard<std::mutex> lock(mutex_);
  held_.push_back(Held{std::move(done), std::move(holding)});
}

std::size_t ReleaseList::poll() {
  std::vector<Held> asked;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    asked.swap(held_);
  }
  std::vector<Held> kept;
  std::size_t released = 0;
  for (Held& h : asked) {  // done() outside the lock: it may query the runtime
    if (finished(h.done)) {
      ++released;
    } else {
      kept.push_back(std::move(h));
    }
  }
  asked.clear();  // the finished holdings die here, unlocked
  if (!kept.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Added meanwhile (by another thread, or by a dying holding) stays after the older ones.
    held_.insert(held_.begin(), std::make_move_iterator(kept.begin()), std::make_move_iterator(kept.end()));
  }
  return released;
}

std::size_t ReleaseList::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_.size();
}

}  // namespace hipferry::schedule
