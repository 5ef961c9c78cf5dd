// Bytes in flight, bounded (see in_flight_window.h).
#include "csrc/core/schedule/in_flight_window.h"

#include <algorithm>
#include <exception>
#include <utility>

namespace hipferry::schedule {

void InFlightWindow::settle_front(bool block) {
  Entry e = std::move(entries_.front());
  entries_.pop_front();
  bytes_ -= e.bytes;
  std::exception_ptr error;
  if (block && e.done) {
    try {
      e.done->synchronize();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (e.settled) e.settled();
  if (error) std::rethrow_exception(error);
}

std::size_t InFlightWindow::settle() {
  std::size_t n = 0;
  while (!entries_.empty() && (!entries_.front().done || entries_.front().done->query())) {
    settle_front(/*block=*/true);  // completed: synchronize only collects its error
    ++n;
  }
  return n;
}

void InFlightWindow::admit(std::size_t bytes) {
  settle();
  while (!entries_.empty() && bytes_ + bytes > max_bytes_) {
    ++waits_;
    settle_front(/*block=*/true);
  }
}

std::uint64_t InFlightWindow::add(std::shared_ptr<Event> done, std::size_t bytes, std::function<void()> settled) {
  const std::uint64_t id = next_id_++;
  entries_.push_back(Entry{id, std::move(done), bytes, std::move(settled)});
  bytes_ += bytes;
  peak_ = std::max(peak_, bytes_);
  return id;
}

bool InFlightWindow::withdraw(std::uint64_t id) {
  // Ids grow from front to back: a binary search over a deque.
  auto it =
      std::lower_bound(entries_.begin(), entries_.end(), id, [](const Entry& e, std::uint64_t v) { return e.id < v; });
  if (it == entries_.end() || it->id != id) return false;
  Entry taken = std::move(*it);
  entries_.erase(it);
  bytes_ -= taken.bytes;
  return true;  // `taken` dies here: its event and callback, never run
}

void InFlightWindow::drain() {
  std::exception_ptr first;
  while (!entries_.empty()) {
    try {
      settle_front(/*block=*/true);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace hipferry::schedule
