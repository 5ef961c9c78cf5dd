// The pinned host memory pool: every hipferry capability allocates host
// memory here.
//
// Note [hipferry pinned pool]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Segments come from a HostMemoryProvider (hipHostMalloc, hipHostRegister,
// or ordinary memory) and are carved into blocks:
//   - small requests (<= small_max) are rounded to their size class and carved
//     from small segments, or from the reserve when no small segment has
//     room; medium requests (<= own_segment_threshold) likewise from large
//     segments, own segments and the reserve. A free block is split when the
//     rest is worth keeping, and a freed block merges with free address
//     neighbours, so a segment whose blocks are all free is one free block.
//   - a larger request is served from the same free space when some fits;
//     otherwise it gets a new segment of its own, which, once cached, is
//     split like any other for later requests (never handed out whole to a
//     request it does not cover: pytorch#192722).
//   - lookup is best fit: the smallest free block (then the lowest address)
//     that is large enough, O(log n) in one std::set per kind of segment.
//   - address order: that tie-break spans segments, so where blocks land
//     depends on the order of the addresses the provider hands out (glibc
//     serves a 2 MiB segment from mmap, descending, until a free raises its
//     mmap threshold, then from the heap, ascending), and so can the number
//     of segments a workload needs. Kept, because the cost is bounded and
//     paid once: a workload repeated with everything freed between rounds
//     fills its cached segments in address order from the second round on,
//     and each such round replays the last; only the first round, which met
//     its segments in the order they came, ties differently. Its second
//     round may need a segment or two more (at most 2 over 11,000 runs of
//     500 workloads in 22 orders), none after that
//     (tests/cpp/host_pool_address_order_test.cpp).
//   - bounded growth: before a new segment would take reserved bytes past
//     growth_limit x requested, cached fully free segments (which cannot
//     serve the request) go back to the provider, down to growth_keep_bytes.
//     Under churn (sizes that change, round after round) reserved then stays
//     within 1.25x of peak requested (tests/cpp/host_pool_growth_test.cpp).
//   - alignment: a request asks for blocks that start at a multiple of 256
//     (kAlignment, the default) or of a page (kPageAlignment: O_DIRECT reads
//     and writes straight into the block). A page-aligned request is rounded
//     to whole pages before its size class, so its block is a whole number
//     of pages (a read of whole pages stays inside it) and the free rest
//     after it starts on a page. Segments start on a page (the provider's
//     contract, checked when one arrives). Any free block serves it whose
//     size covers the request after the block's unaligned head: the head
//     (< 4 KiB, a multiple of 256) is split off as a free block of its own,
//     which merges back when either neighbour is freed, so a free segment
//     still ends as one block. Chosen over keeping page-aligned requests to
//     aligned blocks or segments of their own: no free space is off limits
//     to them, and the head serves small requests meanwhile. Lookup stays
//     O(log n): the best-fit candidates below size + 3840 are tried a few
//     at a time (kAlignedFitTries), then the smallest block that fits
//     wherever it starts.
//   - NUMA: every segment lives on one node (or on none: the system's
//     default placement), and its free blocks serve only requests for that
//     node: the free sets are ordered by (node, size, address), so each node
//     has a free list of its own. A request names the device its memory is
//     for; device_nodes maps it to a node (a GPU's memory comes from the
//     GPU's node), numa_node covers requests that name no device. Pages of
//     the wrong node cost ~30% of copy bandwidth (pytorch#197868). The
//     reserve is one segment on numa_node and serves every request.
// Stream-ordered reuse: record_use() notes each stream that used a live
// block; deallocate() of such a block records one event per stream and parks
// the block as "waiting"; it becomes free only once all its events completed.
// Waiting blocks are polled on a cache miss, by process_events() and by
// trim(); when the capacity would be exceeded the pool also blocks on them.
//
// Invariants (check_invariants() verifies them all):
//   - the blocks of a segment tile it exactly, in address order; no two
//     live or waiting blocks overlap; no two free neighbours exist;
//   - reserved_bytes == sum of segment sizes == allocated_bytes (live and
//     waiting blocks) + free bytes (free blocks);
//   - reserved_bytes + bytes being allocated from the provider <= capacity,
//     at every moment: the pool never grows past its cap;
//   - a waiting block is never handed out.
//
// Locking: one mutex (`mutex_`) guards every field below it. It is never held
// across a call into the provider or the event source (runtime calls can take
// milliseconds and driver-wide locks); such calls happen between two critical
// sections, with the affected blocks and segments removed from every shared
// structure (or capacity set aside in `pending_bytes_`) in the first one. A
// cached allocation therefore makes no runtime call at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/core/host_pool/host_memory_provider.h"
#include "csrc/core/host_pool/size_classes.h"

namespace hipferry::pool {

// Misuse of the pool: zero or absurd sizes, foreign pointers, a closed pool.
class PoolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The capacity would be exceeded even after reclaiming what could be.
class PoolCapacityError : public PoolError {
 public:
  using PoolError::PoolError;
};

struct PoolOptions {
  std::size_t capacity = SIZE_MAX;  // hard cap on reserved bytes
  // Where the cap came from and how to raise it, for the capacity error
  // ("the default budget: 50% of ..."); empty: the caller's own capacity.
  std::string capacity_origin;
  std::size_t max_cached_bytes = SIZE_MAX;                    // fully free segments beyond this go back at once
  std::size_t reserve_bytes = 0;                              // pre-allocated at construction, kept by trim()
  std::size_t small_max = std::size_t{1} << 20;               // small requests: <= this
  std::size_t small_segment_bytes = std::size_t{2} << 20;     // segment size for small blocks
  std::size_t large_segment_bytes = std::size_t{32} << 20;    // segment size for medium blocks
  std::size_t own_segment_threshold = std::size_t{16} << 20;  // above: a segment of its own
  // Growth bound: before the pool takes a new segment that would make it
  // reserve more than growth_limit x (bytes requested, this request included),
  // it gives cached fully free segments back to the provider (they cannot
  // serve the request, or it would not need a new one) -- but keeps up to
  // growth_keep_bytes of them, so that a loop alternating two kinds of
  // request does not trade segments with the provider on every turn.
  // growth_limit 0: no bound.
  double growth_limit = 1.1;
  std::size_t growth_keep_bytes = std::size_t{32} << 20;
  // NUMA placement: requests for device d take pages from device_nodes[d];
  // requests for no device (or a device beyond device_nodes, or one mapped
  // to kNoNumaNode) from numa_node, as does the reserve. kNoNumaNode: the
  // system's default placement.
  int numa_node = kNoNumaNode;
  std::vector<int> device_nodes;
};

struct PoolStats {
  std::size_t requested_bytes = 0;  // sum of live requests as asked
  std::size_t allocated_bytes = 0;  // blocks live or waiting on events (rounded sizes)
  std::size_t reserved_bytes = 0;   // segments held from the provider
  std::size_t peak_requested_bytes = 0;
  std::size_t peak_allocated_bytes = 0;
  std::size_t peak_reserved_bytes = 0;
  std::size_t cached_free_bytes = 0;  // free blocks, ready for reuse
  std::size_t live_blocks = 0;
  std::size_t waiting_blocks = 0;  // freed, parked until their events complete
  std::size_t waiting_bytes = 0;
  std::size_t segments = 0;
  std::uint64_t cache_hits = 0;       // allocations served without the provider
  std::uint64_t cache_misses = 0;     // allocations that needed a new segment
  std::uint64_t reclaims = 0;         // over-capacity allocations the reclaimer let go of memory for
  std::uint64_t growth_releases = 0;  // cached segments given back to stay within growth_limit
  std::uint64_t system_allocs = 0;
  std::uint64_t system_frees = 0;
  std::uint64_t system_alloc_ns = 0;  // time spent inside provider allocate()
  std::size_t capacity = 0;
  std::map<int, std::size_t> reserved_by_node;  // segment bytes by NUMA node (kNoNumaNode: unbound)
};

class HostPool {
 public:
  struct Allocation {
    void* host = nullptr;
    void* device = nullptr;  // nullptr when the provider's memory is not mapped
    std::size_t size = 0;    // block size, >= the request
  };

  // Throws PoolError for inconsistent options, PoolCapacityError when the
  // reserve exceeds the capacity, and the provider's error if it fails.
  HostPool(std::unique_ptr<HostMemoryProvider> provider, std::unique_ptr<UseEventSource> events,
           PoolOptions options = {});
  // Waits for the events of waiting blocks, then releases every segment.
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A block of at least `bytes` (1 <= bytes <= kMaxRequestBytes) starting
  // at a multiple of `alignment`, for `device` (-1: none), on
  // node_of_device(device). `alignment`: kAlignment (256) or kPageAlignment
  // (4096; the block's size is then a multiple of 4096 too). Throws PoolError
  // for any other size or alignment before anything changes.
  Allocation allocate(std::size_t bytes, int device = -1, std::size_t alignment = kAlignment);
  // The NUMA node whose pages serve requests for `device` (-1: none).
  int node_of_device(int device) const;
  // The NUMA node of the segment holding the live block at `host`; throws
  // PoolError for a pointer that is not a live block of this pool.
  int node_of_block(const void* host) const;
  // Notes that asynchronous work on `use` reads or writes the live block at
  // `host`; deallocate() then parks the block until that work is done.
  void record_use(void* host, StreamUse use);
  // Returns the live block at `host` (as returned by allocate). Throws
  // PoolError for a pointer that is not a live block of this pool.
  void deallocate(void* host);

  // Frees waiting blocks whose events have completed; returns how many.
  std::size_t process_events();
  // Who else may hold this pool's blocks for work that has completed (the
  // transfer engine's release list): an allocation that would fail for
  // capacity first calls `reclaim` (no lock held; it may free blocks of this
  // pool) and tries again if it let go of anything. `reclaim` returns how
  // many holdings it let go of. nullptr: none.
  void set_reclaimer(std::function<std::size_t()> reclaim);
  // Returns cached fully free segments (not the reserve) to the provider; returns bytes released.
  std::size_t trim();
  // No more allocations; cached memory and the reserve go back now, the rest
  // as it is freed. Idempotent.
  void close();
  bool closed() const;

  PoolStats stats() const;
  const PoolOptions& options() const { return options_; }
  std::string provider_name() const { return provider_->describe(); }
  // True when `host` is the start of a live block of this pool.
  bool owns(const void* host) const;
  // Throws std::logic_error naming the first violated invariant.
  void check_invariants() const;

 private:
  enum class SegmentKind : std::uint8_t { kSmall, kLarge, kOwn, kReserve };
  enum class BlockState : std::uint8_t { kFree, kLive, kWaiting };
  struct Segment;
  struct Block {
    char* host;             // start address
    std::size_t size;       // bytes, a multiple of kAlignment
    std::size_t requested;  // bytes asked for while live, 0 otherwise
    Segment* segment;
    Block* prev;  // address neighbours inside the segment
    Block* next;
    BlockState state;
    int node;                     // segment->node, kept here: the free sets compare it on every lookup
    std::vector<StreamUse> uses;  // streams recorded while live
  };
  struct Segment {
    HostSegment memory;
    std::size_t size;
    SegmentKind kind;
    int node;  // NUMA node of its pages (kNoNumaNode: unbound)
    Block* first;
  };
  // Per-node free lists in one set: node, then best fit, then lowest address.
  struct BySizeThenAddress {
    bool operator()(const Block* a, const Block* b) const {
      if (a->node != b->node) return a->node < b->node;
      return a->size != b->size ? a->size < b->size : a->host < b->host;
    }
  };
  struct Waiting {
    Block* block;
    std::vector<std::unique_ptr<UseEvent>> events;
  };
  using SegmentList = std::vector<std::unique_ptr<Segment>>;

  using FreeSet = std::set<Block*, BySizeThenAddress>;
  // One allocate() call, its arguments checked.
  struct Request {
    std::size_t bytes;      // as asked
    std::size_t size;       // the block's size: the request's size class
    std::size_t alignment;  // kAlignment or kPageAlignment
    int node;               // node_of_device(device)
    bool small;             // served from small segments
  };
  // Throws PoolError for a bad size or alignment. No lock needed.
  Request make_request(std::size_t bytes, int device, std::size_t alignment) const;
  // The size of a new segment for `r` (before any capacity squeeze).
  std::size_t segment_bytes_for(const Request& r) const;
  // Below a block of this many candidates too small for their unaligned head,
  // an aligned lookup takes the smallest block that surely fits.
  static constexpr int kAlignedFitTries = 8;
  // Bytes from `b`'s start to the first multiple of `alignment`.
  static std::size_t head_bytes(const Block* b, std::size_t alignment);

  // All below: mutex_ held.
  FreeSet& free_set(SegmentKind kind);
  Block* find_free(const Request& r);
  // The best-fitting free block of `set` on `node` for `r`, or nullptr.
  Block* first_fit(FreeSet& set, const Request& r, int node) const;
  Allocation hand_out(Block* block, const Request& r);
  // Cuts the block (out of its free set) at `offset`; returns the new block
  // after the cut, free and in no set.
  Block* split(Block* block, std::size_t offset);
  // Between the cache miss and the provider call: applies the growth bound
  // and the capacity (shrinking `segment_bytes`, reclaiming, waiting; `lock`
  // is dropped around those calls). Returns a free block that came to fit
  // meanwhile, or nullptr with `segment_bytes` set aside in pending_bytes_.
  // Throws for a closed pool or when the capacity leaves no way.
  Block* make_room(std::unique_lock<std::mutex>& lock, const Request& r, std::size_t& segment_bytes);
  void free_block(Block* block, SegmentList& to_release);
  void merge_with_next(Block* block);  // both free and in their set
  static bool fully_free(const Segment& s) { return s.first->state == BlockState::kFree && s.first->size == s.size; }
  // Moves the fully free segment segments_[index] out to `out`, its block
  // and bytes out of every count (the provider is called later, unlocked).
  void take_free_segment(std::size_t index, SegmentList& out);
  void collect_free_segments(std::size_t keep_cached, bool include_reserve, SegmentList& out);
  // Takes out the cached fully free segments a new segment of `segment_bytes`
  // (for a request of `bytes`) must give back to stay within growth_limit.
  void collect_for_growth(std::size_t bytes, std::size_t segment_bytes, SegmentList& out);
  Segment* add_segment(const HostSegment& memory, std::size_t size, SegmentKind kind, int node);
  [[noreturn]] void throw_capacity(std::size_t bytes, std::size_t segment_bytes) const;  // host_pool_checks.cpp
  // Gives `segments` back to the provider with `lock` dropped meanwhile;
  // false (the lock kept) when there are none.
  bool release_unlocked(std::unique_lock<std::mutex>& lock, const SegmentList& segments);
  void count_segment(const Segment& s, bool added);  // reserved bytes and reserved_by_node

  // No lock held.
  void release_segments(const SegmentList& segments);
  // A new segment of `segment_bytes` (set aside by make_room) from the
  // provider, and `r`'s block at its start.
  Allocation allocate_segment(const Request& r, std::size_t segment_bytes);
  // Gives a segment that does not start on a page back to the provider and
  // throws PoolError (page-aligned requests rely on segments that do).
  void require_page_aligned(const HostSegment& memory, std::size_t bytes);
  // Frees waiting blocks whose events completed (with `wait`, after blocking
  // on each event); segments that become releasable are appended to
  // `to_release`. Reports how many blocks were taken to poll and freed.
  struct PollResult {
    std::size_t polled;
    std::size_t freed;
  };
  PollResult poll_events(SegmentList& to_release, bool wait);
  // poll_events(wait=true); false when there was nothing to wait for.
  bool wait_for_waiting_blocks();
  using LiveMap = std::unordered_map<void*, Block*>;
  // The live block at `host`, else PoolError(not_live). mutex_ held.
  LiveMap::const_iterator live_block(const void* host, const char* not_live) const;

  // Fixed at construction; no lock needed.
  const PoolOptions options_;
  const std::unique_ptr<HostMemoryProvider> provider_;
  const std::unique_ptr<UseEventSource> event_source_;  // outlives every event below

  mutable std::mutex mutex_;
  // --- guarded by mutex_ ---
  FreeSet free_small_;                 // free blocks of small segments, per node
  FreeSet free_large_;                 // free blocks of large and own segments, per node
  FreeSet free_reserve_;               // free blocks of the reserve (every size class)
  LiveMap live_;                       // live blocks by host address
  std::vector<Waiting> waiting_;       // parked blocks with their events
  std::size_t waiting_in_flight_ = 0;  // waiting blocks taken out of waiting_ to be polled
  std::uint64_t completions_ = 0;      // waiting blocks freed so far (lets allocate see progress)
  std::vector<std::unique_ptr<Segment>> segments_;
  std::size_t pending_bytes_ = 0;     // capacity set aside for provider allocations in progress
  std::size_t fully_free_bytes_ = 0;  // bytes in non-reserve segments that are one free block
  bool closed_ = false;
  std::function<std::size_t()> reclaimer_;  // see set_reclaimer (called with no lock held)
  PoolStats stats_;                         // counters; cached_free_bytes etc. derived in stats()
  std::size_t free_bytes_ = 0;              // sum of free block sizes
};

}  // namespace hipferry::pool
