// The pinned host pool; the design and its invariants are in Note [hipferry
// pinned pool] in host_pool.h. Growing it (allocate's escalation, new segments, giving them
// back) is in host_pool_growth.cpp, its reports in host_pool_checks.cpp.
#include "csrc/core/host_pool/host_pool.h"

#include <algorithm>
#include <chrono>

#include "csrc/core/host_pool/format_bytes.h"
#include "csrc/core/host_pool/size_classes.h"

namespace hipferry::pool {

HostPool::HostPool(std::unique_ptr<HostMemoryProvider> provider, std::unique_ptr<UseEventSource> events,
                   PoolOptions options)
    : options_(options), provider_(std::move(provider)), event_source_(std::move(events)) {
  if (!provider_ || !event_source_) throw PoolError("hipferry pinned pool: provider and event source are required");
  const auto require = [](bool ok, const char* what) {
    if (!ok) throw PoolError(std::string("hipferry pinned pool: invalid options: expected ") + what);
  };
  require(options_.capacity >= kAlignment, "capacity >= 256 bytes");
  require(options_.small_max % kAlignment == 0 && options_.small_max >= kAlignment,
          "small_max a positive multiple of 256");
  require(options_.small_segment_bytes >= options_.small_max, "small_segment_bytes >= small_max");
  require(options_.own_segment_threshold > options_.small_max, "own_segment_threshold > small_max");
  require(options_.large_segment_bytes >= options_.own_segment_threshold,
          "large_segment_bytes >= own_segment_threshold");
  require(options_.small_segment_bytes % kAlignment == 0 && options_.large_segment_bytes % kAlignment == 0,
          "segment sizes that are multiples of 256");
  stats_.capacity = options_.capacity;
  require(options_.numa_node >= kNoNumaNode, "numa_node >= -1 (-1: no node)");
  for (int node : options_.device_nodes) require(node >= kNoNumaNode, "device_nodes >= -1 (-1: no node)");
  require(size_class(options_.own_segment_threshold, SIZE_MAX) == options_.own_segment_threshold,
          "own_segment_threshold to be a size class (e.g. a power of two), so that sizes stay monotonic");
  if (options_.reserve_bytes > 0) {
    // Compared before rounding: rounding a value near SIZE_MAX would wrap to 0.
    if (options_.reserve_bytes > options_.capacity / kOwnSegmentGranule * kOwnSegmentGranule) {
      throw PoolCapacityError("hipferry pinned pool: reserve of " + format_bytes(options_.reserve_bytes) +
                              " exceeds the capacity of " + format_bytes(options_.capacity) +
                              "; expected reserve <= capacity");
    }
    const std::size_t bytes = round_up(options_.reserve_bytes, kOwnSegmentGranule);
    const auto t0 = std::chrono::steady_clock::now();
    const HostSegment memory = provider_->allocate(bytes, options_.numa_node);
    require_page_aligned(memory, bytes);
    const auto t1 = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.system_allocs;
    stats_.system_alloc_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
    add_segment(memory, bytes, SegmentKind::kReserve, options_.numa_node);
  }
}

HostPool::~HostPool() {
  // Nothing may still be transferring into memory that goes back to the system.
  for (Waiting& w : waiting_) {
    for (auto& e : w.events) {
      try {
        e->synchronize();
      } catch (...) {
      }
    }
  }
  waiting_.clear();
  for (auto& s : segments_) {
    for (Block* b = s->first; b != nullptr;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    provider_->release(s->memory, s->size);
  }
}

HostPool::FreeSet& HostPool::free_set(SegmentKind kind) {
  switch (kind) {
    case SegmentKind::kSmall: return free_small_;
    case SegmentKind::kReserve: return free_reserve_;
    default: return free_large_;
  }
}

int HostPool::node_of_device(int device) const {
  if (device >= 0 && static_cast<std::size_t>(device) < options_.device_nodes.size() &&
      options_.device_nodes[device] != kNoNumaNode)
    return options_.device_nodes[device];
  return options_.numa_node;
}

HostPool::LiveMap::const_iterator HostPool::live_block(const void* host, const char* not_live) const {
  auto it = live_.find(const_cast<void*>(host));
  if (it == live_.end()) throw PoolError(not_live);
  return it;
}

int HostPool::node_of_block(const void* host) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_block(host,
                    "hipferry pinned pool: node_of_block of an address that is not a live block of this pool; "
                    "expected memory allocated by this pool and not yet freed")
      ->second->segment->node;
}

std::size_t HostPool::head_bytes(const Block* b, std::size_t alignment) {
  const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(b->host) % alignment;
  return misalignment == 0 ? 0 : alignment - misalignment;
}

HostPool::Block* HostPool::first_fit(FreeSet& set, const Request& r, int node) const {
  if (set.empty()) return nullptr;
  Block key{};
  key.node = node;
  key.size = r.size;
  key.host = nullptr;
  auto it = set.lower_bound(&key);
  // A block fits when its size covers its unaligned head too (never one with
  // 256-byte alignment). Best fit among the first few candidates; past them,
  // the smallest block that fits wherever it starts (its head is at most
  // alignment - 256), so that a run of misfits costs no linear scan.
  for (int tries = 0; it != set.end() && (*it)->node == node; ++it) {
    if ((*it)->size >= head_bytes(*it, r.alignment) + r.size) return *it;
    if (++tries == kAlignedFitTries) {
      key.size = r.size + r.alignment - kAlignment;
      it = set.lower_bound(&key);
      return it == set.end() || (*it)->node != node ? nullptr : *it;
    }
  }
  return nullptr;
}

HostPool::Block* HostPool::find_free(const Request& r) {
  // The reserve (on numa_node) serves every size class and every node; small
  // requests take it only when their own segments have no room (small blocks
  // would pin large free space).
  Block* reserve = first_fit(free_reserve_, r, options_.numa_node);
  if (r.small) {
    Block* b = first_fit(free_small_, r, r.node);
    return b != nullptr ? b : reserve;
  }
  Block* large = first_fit(free_large_, r, r.node);
  if (large == nullptr) return reserve;
  return reserve != nullptr && reserve->size <= large->size ? reserve : large;
}

HostPool::Block* HostPool::split(Block* b, std::size_t offset) {
  Block* rest =
      new Block{b->host + offset, b->size - offset, 0, b->segment, b, b->next, BlockState::kFree, b->node, {}};
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  b->size = offset;
  return rest;
}

HostPool::Allocation HostPool::hand_out(Block* b, const Request& r) {
  Segment* s = b->segment;
  FreeSet& set = free_set(s->kind);
  set.erase(b);  // (out of the set: its key, the size, may change)
  free_bytes_ -= b->size;
  if (b->size == s->size && s->kind != SegmentKind::kReserve) fully_free_bytes_ -= s->size;
  if (const std::size_t head = head_bytes(b, r.alignment); head > 0) {
    Block* aligned = split(b, head);  // b stays free: the head, before a live block
    set.insert(b);
    free_bytes_ += head;
    b = aligned;
  }
  const std::size_t rest = b->size - r.size;
  if (rest >= kAlignment) {  // (an own segment too: its rest serves smaller requests)
    set.insert(split(b, r.size));
    free_bytes_ += rest;
  }
  b->state = BlockState::kLive;
  b->requested = r.bytes;
  live_.emplace(b->host, b);
  stats_.requested_bytes += r.bytes;
  stats_.allocated_bytes += b->size;
  ++stats_.live_blocks;
  stats_.peak_requested_bytes = std::max(stats_.peak_requested_bytes, stats_.requested_bytes);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  void* device = s->memory.device == nullptr
                     ? nullptr
                     : static_cast<char*>(s->memory.device) + (b->host - static_cast<char*>(s->memory.host));
  return {b->host, device, b->size};
}

HostPool::Request HostPool::make_request(std::size_t bytes, int device, std::size_t alignment) const {
  if (bytes == 0 || bytes > kMaxRequestBytes) {
    throw PoolError("hipferry pinned pool: cannot allocate " + std::to_string(bytes) +
                    " bytes; expected a size from 1 byte to 2^48 bytes");
  }
  if (alignment != kAlignment && alignment != kPageAlignment) {
    throw PoolError("hipferry pinned pool: cannot allocate with alignment " + std::to_string(alignment) +
                    "; expected alignment 256 (the default) or 4096 (a page, as O_DIRECT needs)");
  }
  // Whole pages for a page-aligned request (Note [hipferry pinned pool]):
  // every size class of a multiple of 4096 is one too.
  const std::size_t size = size_class(round_up(bytes, alignment), options_.own_segment_threshold);
  return {bytes, size, alignment, node_of_device(device), size <= options_.small_max};
}

void HostPool::record_use(void* host, StreamUse use) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& uses = live_block(host,
                          "hipferry pinned pool: record_use on an address that is not a live block of this pool; "
                          "expected memory allocated by this pool and not yet freed")
                   ->second->uses;
  for (const StreamUse& u : uses) {
    if (u == use) return;
  }
  uses.push_back(use);
}

void HostPool::deallocate(void* host) {
  SegmentList to_release;
  std::vector<StreamUse> uses;
  Block* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_block(host,
                               "hipferry pinned pool: deallocate of an address that is not a live block of this pool "
                               "(freed twice, or not from this pool)");
    b = it->second;
    live_.erase(it);
    stats_.requested_bytes -= b->requested;
    b->requested = 0;
    --stats_.live_blocks;
    if (b->uses.empty()) {
      stats_.allocated_bytes -= b->size;
      free_block(b, to_release);
    } else {
      uses.swap(b->uses);
      b->state = BlockState::kWaiting;
      ++stats_.waiting_blocks;
      stats_.waiting_bytes += b->size;
      ++waiting_in_flight_;
    }
  }
  if (!uses.empty()) {
    Waiting w{b, {}};
    try {
      for (const StreamUse& u : uses) w.events.push_back(event_source_->record(u));
    } catch (const std::exception& e) {
      // Without an event nobody can tell when the stream is done with the
      // block: it stays out of use (counted as waiting) rather than risk reuse.
      std::lock_guard<std::mutex> lock(mutex_);
      --waiting_in_flight_;
      throw PoolError(std::string("hipferry pinned pool: could not record a stream event for a freed block; "
                                  "the block is kept out of use: ") +
                      e.what());
    }
    bool closed = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --waiting_in_flight_;
      waiting_.push_back(std::move(w));
      closed = closed_;
    }
    if (closed) poll_events(to_release, /*wait=*/false);  // nobody else polls a closed pool
  }
  release_segments(to_release);
}

void HostPool::merge_with_next(Block* b) {
  Block* n = b->next;
  auto& set = free_set(b->segment->kind);
  set.erase(b);  // the key (size) changes: out of the set first
  set.erase(n);
  b->size += n->size;
  b->next = n->next;
  if (n->next != nullptr) n->next->prev = b;
  delete n;
  set.insert(b);
}

void HostPool::free_block(Block* b, SegmentList& to_release) {
  Segment* s = b->segment;
  b->state = BlockState::kFree;
  b->requested = 0;
  b->uses.clear();
  free_set(s->kind).insert(b);
  free_bytes_ += b->size;
  if (b->next != nullptr && b->next->state == BlockState::kFree) merge_with_next(b);
  if (b->prev != nullptr && b->prev->state == BlockState::kFree) {
    b = b->prev;
    merge_with_next(b);
  }
  if (b->size != s->size) return;
  if (s->kind != SegmentKind::kReserve) fully_free_bytes_ += s->size;
  if (closed_) {
    collect_free_segments(0, true, to_release);
  } else if (fully_free_bytes_ > options_.max_cached_bytes) {
    collect_free_segments(options_.max_cached_bytes, false, to_release);
  }
}

std::size_t HostPool::process_events() {
  SegmentList to_release;
  const std::size_t freed = poll_events(to_release, /*wait=*/false).freed;
  release_segments(to_release);
  return freed;
}

HostPool::PollResult HostPool::poll_events(SegmentList& to_release, bool wait) {
  std::vector<Waiting> polling;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (waiting_.empty()) return {0, 0};
    polling.swap(waiting_);
    waiting_in_flight_ += polling.size();
  }
  const std::size_t polled = polling.size();
  std::vector<Block*> done;
  std::vector<Waiting> pending;
  for (Waiting& w : polling) {
    bool complete = true;
    for (auto& e : w.events) {
      try {
        if (wait) e->synchronize();
        complete = e->query();
      } catch (...) {
        complete = false;  // an error is not completion: keep the block parked
      }
      if (!complete) break;
    }
    if (complete) {
      w.events.clear();  // event destruction may call the runtime: outside the lock
      done.push_back(w.block);
    } else {
      pending.push_back(std::move(w));
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_in_flight_ -= polled;
  completions_ += done.size();
  for (Block* b : done) {
    --stats_.waiting_blocks;
    stats_.waiting_bytes -= b->size;
    stats_.allocated_bytes -= b->size;
    free_block(b, to_release);
  }
  for (Waiting& w : pending) waiting_.push_back(std::move(w));
  return {polled, done.size()};
}

bool HostPool::wait_for_waiting_blocks() {
  SegmentList to_release;
  const PollResult r = poll_events(to_release, /*wait=*/true);
  release_segments(to_release);
  return r.polled > 0;
}

void HostPool::set_reclaimer(std::function<std::size_t()> reclaim) {
  std::lock_guard<std::mutex> lock(mutex_);
  reclaimer_ = std::move(reclaim);
}

std::size_t HostPool::trim() {
  SegmentList freed;
  poll_events(freed, /*wait=*/false);  // may already release segments (max_cached): they count too
  {
    std::lock_guard<std::mutex> lock(mutex_);
    collect_free_segments(0, false, freed);
  }
  release_segments(freed);
  std::size_t bytes = 0;
  for (const auto& s : freed) bytes += s->size;
  return bytes;
}

void HostPool::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  process_events();
  SegmentList freed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    collect_free_segments(0, true, freed);
  }
  release_segments(freed);
}

bool HostPool::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

bool HostPool::owns(const void* host) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.count(const_cast<void*>(host)) != 0;
}

}  // namespace hipferry::pool
