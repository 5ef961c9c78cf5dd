// The pinned host pool's reports: its statistics, the capacity error, and
// the invariant check the tests run (Note [hipferry pinned pool] in
// host_pool.h). Kept apart from the allocator's paths in host_pool.cpp.
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>

#include "csrc/core/host_pool/format_bytes.h"
#include "csrc/core/host_pool/host_pool.h"

namespace hipferry::pool {

std::string format_bytes(std::size_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= (std::size_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%zu bytes (%.2f GiB)", bytes, b / (1 << 30));
  } else if (bytes >= (std::size_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%zu bytes (%.2f MiB)", bytes, b / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  }
  return buf;
}

PoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PoolStats s = stats_;
  s.cached_free_bytes = free_bytes_;
  s.segments = segments_.size();
  return s;
}

void HostPool::throw_capacity(std::size_t bytes, std::size_t segment_bytes) const {
  throw PoolCapacityError("hipferry pinned pool: cannot allocate " + format_bytes(bytes) + ": capacity is " +
                          format_bytes(options_.capacity) + ", " + format_bytes(stats_.requested_bytes) + " in use (" +
                          format_bytes(stats_.allocated_bytes) + " in blocks), " + format_bytes(free_bytes_) +
                          " cached but too fragmented to serve it, " + format_bytes(pending_bytes_) +
                          " being allocated by other threads; a new segment of " + format_bytes(segment_bytes) +
                          " would exceed the capacity. " +
                          (options_.capacity_origin.empty()
                               ? std::string("Free tensors from this pool or create it with a larger capacity")
                               : "The capacity is " + options_.capacity_origin));
}

void HostPool::check_invariants() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto fail = [](const std::string& what) { throw std::logic_error("hipferry pinned pool invariant: " + what); };
  std::size_t reserved = 0, allocated = 0, free_bytes = 0, fully_free = 0, live = 0, waiting = 0;
  std::size_t free_small = 0, free_large = 0, free_reserve = 0, requested = 0;
  for (const auto& s : segments_) {
    reserved += s->size;
    const char* expect = static_cast<const char*>(s->memory.host);
    if (reinterpret_cast<std::uintptr_t>(expect) % kPageAlignment != 0) fail("segment not on a page");
    const Block* prev = nullptr;
    for (const Block* b = s->first; b != nullptr; prev = b, b = b->next) {
      if (b->segment != s.get()) fail("block points at another segment");
      if (b->node != s->node) fail("block's node is not its segment's");
      if (b->prev != prev) fail("broken prev link");
      if (b->host != expect) fail("blocks do not tile their segment (gap or overlap)");
      if (b->size == 0 || b->size % kAlignment != 0) fail("block size not a positive multiple of 256");
      expect += b->size;
      if (b->state == BlockState::kFree) {
        free_bytes += b->size;
        if (prev != nullptr && prev->state == BlockState::kFree) fail("two free neighbours not coalesced");
        const auto& set = s->kind == SegmentKind::kSmall     ? free_small_
                          : s->kind == SegmentKind::kReserve ? free_reserve_
                                                             : free_large_;
        if (set.count(const_cast<Block*>(b)) == 0) fail("free block missing from its free set");
        (s->kind == SegmentKind::kSmall     ? free_small
         : s->kind == SegmentKind::kReserve ? free_reserve
                                            : free_large) += 1;
        if (b->size == s->size && s->kind != SegmentKind::kReserve) fully_free += s->size;
      } else {
        allocated += b->size;
        if (b->state == BlockState::kLive) {
          ++live;
          requested += b->requested;
          auto it = live_.find(b->host);
          if (it == live_.end() || it->second != b) fail("live block missing from the live map");
        } else {
          ++waiting;
        }
      }
    }
    if (expect != static_cast<const char*>(s->memory.host) + s->size) fail("blocks do not cover their segment");
  }
  if (free_small != free_small_.size() || free_large != free_large_.size() || free_reserve != free_reserve_.size())
    fail("free sets hold non-free blocks");
  if (reserved != stats_.reserved_bytes) fail("reserved_bytes != sum of segment sizes");
  std::map<int, std::size_t> by_node;
  for (const auto& s : segments_) by_node[s->node] += s->size;
  if (by_node != stats_.reserved_by_node) fail("reserved_by_node != segment sizes by node");
  if (allocated != stats_.allocated_bytes) fail("allocated_bytes != live + waiting blocks");
  if (free_bytes != free_bytes_) fail("free byte count drifted");
  if (reserved != allocated + free_bytes) fail("reserved != allocated + free");
  if (fully_free != fully_free_bytes_) fail("fully free segment bytes drifted");
  if (live != live_.size() || live != stats_.live_blocks) fail("live block count drifted");
  if (requested != stats_.requested_bytes) fail("requested_bytes drifted");
  if (waiting != stats_.waiting_blocks || waiting < waiting_.size() + waiting_in_flight_)
    fail("waiting block count drifted");
  for (const Waiting& w : waiting_) {
    if (w.block->state != BlockState::kWaiting) fail("a parked block is not waiting");
  }
  if (stats_.reserved_bytes + pending_bytes_ > options_.capacity) fail("capacity exceeded");
}

}  // namespace hipferry::pool
