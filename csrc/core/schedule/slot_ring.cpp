// Stream-ordered slot reuse (see slot_ring.h).
#include "csrc/core/schedule/slot_ring.h"

#include <exception>
#include <stdexcept>
#include <string>

namespace hipferry::schedule {

SlotRing::SlotRing(std::size_t slots) : released_(slots) {
  if (slots == 0) throw std::invalid_argument("SlotRing: slots must be >= 1, got 0");
}

void SlotRing::acquire(std::size_t k, Stream& first) {
  if (k >= size())
    throw std::out_of_range("SlotRing::acquire: slot " + std::to_string(k) + " of " + std::to_string(size()));
  if (released_[k]) first.wait(released_[k]);
}

void SlotRing::pass(std::size_t, Stream& from, Stream& to) {
  if (&from == &to) return;
  to.wait(from.record());
}

void SlotRing::release(std::size_t k, Stream& last) {
  if (k >= size())
    throw std::out_of_range("SlotRing::release: slot " + std::to_string(k) + " of " + std::to_string(size()));
  released_[k] = last.record();
}

bool SlotRing::idle() {
  for (const auto& e : released_) {
    if (e && !e->query()) return false;
  }
  return true;
}

void SlotRing::synchronize() {
  std::exception_ptr first;
  for (const auto& e : released_) {
    if (!e) continue;
    try {
      e->synchronize();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace hipferry::schedule
