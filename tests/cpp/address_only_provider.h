// A host-memory provider for the pinned pool's tests that hands out addresses
// without memory, in an order the test picks. The pool never touches the
// memory it hands out (page touching is the provider's job), so workloads of
// gigabytes cost nothing; and the order of the addresses, which decides the
// pool's ties between equal free blocks (Note [hipferry pinned pool]), is
// fixed by the test instead of by the system allocator (glibc's mmap hands
// out descending addresses, its heap ascending ones).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "csrc/core/host_pool/host_memory_provider.h"

namespace hipferry::pool::testing {

enum class AddressOrder {
  kAscending,   // each segment above the one before (glibc's heap)
  kDescending,  // each segment below the one before (glibc's mmap)
  kShuffled,    // a random order, the same for the same seed
};

inline const char* to_string(AddressOrder order) {
  switch (order) {
    case AddressOrder::kAscending: return "ascending";
    case AddressOrder::kDescending: return "descending";
    default: return "shuffled";
  }
}

// Segment n (counted from 0) starts at 2^44 + slot(n) * 2^40: each on its own
// 1 TiB boundary, so blocks of two segments never look adjacent. The slot is
// n + 1 ascending, kSlots - 1 - n descending, and a random slot not used
// before when shuffled. Checks that every segment comes back once, with its
// size; a segment the pool never returns is reported when the provider (owned
// by the pool) is destroyed.
class AddressOnlyProvider : public HostMemoryProvider {
 public:
  explicit AddressOnlyProvider(AddressOrder order = AddressOrder::kAscending, std::uint64_t seed = 0)
      : order_(order), rng_(seed) {}
  ~AddressOnlyProvider() override {
    for (const auto& [host, bytes] : live_)
      ADD_FAILURE() << "AddressOnlyProvider: segment " << host << " of " << bytes << " bytes was never released";
  }

  HostSegment allocate(std::size_t bytes, int) override {
    if (bytes > kSlotBytes) throw std::runtime_error("AddressOnlyProvider: segment larger than 1 TiB");
    if (allocated_ + 1 >= kSlots) throw std::runtime_error("AddressOnlyProvider: out of slots");
    std::uint64_t slot = 0;
    switch (order_) {
      case AddressOrder::kAscending: slot = allocated_ + 1; break;
      case AddressOrder::kDescending: slot = kSlots - 1 - allocated_; break;
      case AddressOrder::kShuffled:
        do slot = rng_() % kSlots;
        while (!used_slots_.insert(slot).second);
        break;
    }
    ++allocated_;
    const std::uintptr_t host = kBase + slot * kSlotBytes;
    live_.emplace(host, bytes);
    return {reinterpret_cast<void*>(host), nullptr};
  }

  void release(const HostSegment& segment, std::size_t bytes) noexcept override {
    const auto it = live_.find(reinterpret_cast<std::uintptr_t>(segment.host));
    if (it == live_.end()) {
      ADD_FAILURE() << "AddressOnlyProvider: release of " << segment.host << ", not a live segment";
      return;
    }
    EXPECT_EQ(it->second, bytes) << "AddressOnlyProvider: segment " << segment.host << " released with another size";
    live_.erase(it);
  }

  std::string describe() const override { return std::string("address-only provider, ") + to_string(order_); }

  // The live segment holding `address` as {host, bytes}; {0, 0} if none.
  std::pair<std::uintptr_t, std::size_t> segment_of(std::uintptr_t address) const {
    auto it = live_.upper_bound(address);
    if (it == live_.begin()) return {0, 0};
    --it;
    if (address >= it->first + it->second) return {0, 0};
    return {it->first, it->second};
  }
  std::size_t live_bytes() const {
    std::size_t bytes = 0;
    for (const auto& [host, n] : live_) bytes += n;
    return bytes;
  }

 private:
  static constexpr std::uintptr_t kBase = std::uintptr_t{1} << 44;
  static constexpr std::uint64_t kSlotBytes = std::uint64_t{1} << 40;
  static constexpr std::uint64_t kSlots = std::uint64_t{1} << 16;
  const AddressOrder order_;
  std::mt19937_64 rng_;
  std::uint64_t allocated_ = 0;
  std::set<std::uint64_t> used_slots_;
  std::map<std::uintptr_t, std::size_t> live_;  // host -> bytes
};

}  // namespace hipferry::pool::testing
