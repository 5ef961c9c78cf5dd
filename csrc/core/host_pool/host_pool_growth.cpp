// The pinned host pool's growth: allocate's escalation when no cached block fits (the growth
// bound, giving back cached segments, shrinking the segment, the reclaimer, waiting for parked
// blocks; Note [hipferry pinned pool] in host_pool.h), new segments from the provider, and the
// bookkeeping of segments as they are added and given back.
#include <algorithm>
#include <chrono>
#include <thread>

#include "csrc/core/host_pool/format_bytes.h"
#include "csrc/core/host_pool/host_pool.h"

namespace hipferry::pool {
namespace {

PoolError closed_error() { return PoolError("hipferry pinned pool: allocate on a closed pool; expected an open pool"); }

}  // namespace

HostPool::Segment* HostPool::add_segment(const HostSegment& memory, std::size_t size, SegmentKind kind, int node) {
  auto s = std::make_unique<Segment>(Segment{memory, size, kind, node, nullptr});
  s->first =
      new Block{static_cast<char*>(memory.host), size, 0, s.get(), nullptr, nullptr, BlockState::kFree, node, {}};
  free_set(kind).insert(s->first);
  free_bytes_ += size;
  if (kind != SegmentKind::kReserve) fully_free_bytes_ += size;
  count_segment(*s, /*added=*/true);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  segments_.push_back(std::move(s));
  return segments_.back().get();
}

void HostPool::count_segment(const Segment& s, bool added) {
  if (added) {
    stats_.reserved_bytes += s.size;
    stats_.reserved_by_node[s.node] += s.size;
    return;
  }
  stats_.reserved_bytes -= s.size;
  auto it = stats_.reserved_by_node.find(s.node);
  it->second -= s.size;
  if (it->second == 0) stats_.reserved_by_node.erase(it);
}

std::size_t HostPool::segment_bytes_for(const Request& r) const {
  if (r.small) return options_.small_segment_bytes;
  return r.size > options_.own_segment_threshold ? r.size : options_.large_segment_bytes;
}

HostPool::Allocation HostPool::allocate(std::size_t bytes, int device, std::size_t alignment) {
  const Request r = make_request(bytes, device, alignment);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) throw closed_error();
    if (Block* b = find_free(r)) {
      ++stats_.cache_hits;
      return hand_out(b, r);
    }
  }
  process_events();  // blocks whose work has completed may serve it
  std::size_t segment_bytes = segment_bytes_for(r);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (Block* b = make_room(lock, r, segment_bytes)) {
      ++stats_.cache_hits;
      return hand_out(b, r);
    }
  }
  return allocate_segment(r, segment_bytes);
}

HostPool::Block* HostPool::make_room(std::unique_lock<std::mutex>& lock, const Request& r, std::size_t& segment_bytes) {
  bool reclaimed = false;       // the reclaimer is asked once per allocation
  bool growth_checked = false;  // the growth bound is applied once per allocation
  for (;;) {
    if (closed_) throw closed_error();
    if (Block* b = find_free(r)) return b;
    if (!growth_checked) {
      growth_checked = true;
      SegmentList cached;
      collect_for_growth(r.bytes, segment_bytes, cached);
      if (release_unlocked(lock, cached)) continue;
    }
    if (segment_bytes <= options_.capacity - stats_.reserved_bytes - pending_bytes_) break;
    // Over the cap: first give back cached free segments...
    SegmentList cached;
    collect_free_segments(0, false, cached);
    if (release_unlocked(lock, cached)) continue;
    // ...then take no more than the block needs (a segment starts on a page:
    // the block fits at its start whatever its alignment)...
    if (segment_bytes > r.size) {
      segment_bytes = r.size;
      continue;
    }
    // ...then have those who hold blocks for completed work let go...
    if (!reclaimed && reclaimer_) {
      reclaimed = true;
      std::function<std::size_t()> reclaim = reclaimer_;
      lock.unlock();
      const std::size_t released = reclaim();  // may deallocate blocks of this pool
      lock.lock();
      if (released > 0) {
        ++stats_.reclaims;
        continue;
      }
    }
    // ...then wait for blocks parked on asynchronous work.
    if (!waiting_.empty() || waiting_in_flight_ > 0) {
      const std::uint64_t completions = completions_;
      lock.unlock();
      const bool waited = wait_for_waiting_blocks();
      if (!waited) std::this_thread::yield();  // another thread is polling them
      lock.lock();
      // Waited, and still no block came free anywhere: their events fail
      // (a runtime error); do not spin on them.
      if (waited && completions_ == completions) throw_capacity(r.bytes, segment_bytes);
      continue;
    }
    throw_capacity(r.bytes, segment_bytes);
  }
  ++stats_.cache_misses;
  pending_bytes_ += segment_bytes;
  return nullptr;
}

bool HostPool::release_unlocked(std::unique_lock<std::mutex>& lock, const SegmentList& segments) {
  if (segments.empty()) return false;
  lock.unlock();
  release_segments(segments);
  lock.lock();
  return true;
}

void HostPool::require_page_aligned(const HostSegment& memory, std::size_t bytes) {
  if (reinterpret_cast<std::uintptr_t>(memory.host) % kPageAlignment == 0) return;
  provider_->release(memory, bytes);
  throw PoolError("hipferry pinned pool: " + provider_->describe() + " handed out a segment at " +
                  std::to_string(reinterpret_cast<std::uintptr_t>(memory.host)) +
                  ", not on a page; expected segments aligned to 4096 bytes");
}

HostPool::Allocation HostPool::allocate_segment(const Request& r, std::size_t segment_bytes) {
  const SegmentKind kind = r.small                                   ? SegmentKind::kSmall
                           : r.size > options_.own_segment_threshold ? SegmentKind::kOwn
                                                                     : SegmentKind::kLarge;
  HostSegment memory;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    memory = provider_->allocate(segment_bytes, r.node);
    require_page_aligned(memory, segment_bytes);
  } catch (const PoolError&) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_bytes_ -= segment_bytes;
    throw;
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_bytes_ -= segment_bytes;
    throw PoolError("hipferry pinned pool: " + provider_->describe() + " could not allocate " +
                    format_bytes(segment_bytes) + ": " + e.what());
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_bytes_ -= segment_bytes;
    throw;
  }
  const auto t1 = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  pending_bytes_ -= segment_bytes;
  ++stats_.system_allocs;
  stats_.system_alloc_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
  Segment* s = add_segment(memory, segment_bytes, kind, r.node);
  return hand_out(s->first, r);
}

void HostPool::take_free_segment(std::size_t index, SegmentList& out) {
  Segment* s = segments_[index].get();
  free_set(s->kind).erase(s->first);
  free_bytes_ -= s->size;
  if (s->kind != SegmentKind::kReserve) fully_free_bytes_ -= s->size;
  count_segment(*s, /*added=*/false);
  ++stats_.system_frees;
  delete s->first;
  s->first = nullptr;
  out.push_back(std::move(segments_[index]));
  segments_[index] = std::move(segments_.back());
  segments_.pop_back();
}

void HostPool::collect_free_segments(std::size_t keep_cached, bool include_reserve, SegmentList& out) {
  for (std::size_t i = 0; i < segments_.size();) {
    const Segment& s = *segments_[i];
    const bool reserve = s.kind == SegmentKind::kReserve;
    if (fully_free(s) && (reserve ? include_reserve : fully_free_bytes_ > keep_cached)) {
      take_free_segment(i, out);
    } else {
      ++i;
    }
  }
}

void HostPool::collect_for_growth(std::size_t bytes, std::size_t segment_bytes, SegmentList& out) {
  if (options_.growth_limit <= 0 || fully_free_bytes_ == 0) return;
  if (fully_free_bytes_ <= options_.growth_keep_bytes) return;
  const double bound = options_.growth_limit * static_cast<double>(stats_.requested_bytes + bytes);
  const double after = static_cast<double>(stats_.reserved_bytes + pending_bytes_ + segment_bytes);
  if (after <= bound) return;
  // Give back just enough (whole segments, the largest first: fewest provider
  // calls), down to growth_keep_bytes of cached free segments.
  std::size_t excess = static_cast<std::size_t>(after - bound);
  std::size_t cached = fully_free_bytes_;
  std::vector<Segment*> candidates;
  for (const auto& s : segments_) {
    if (s->kind != SegmentKind::kReserve && fully_free(*s)) candidates.push_back(s.get());
  }
  std::sort(candidates.begin(), candidates.end(), [](const Segment* a, const Segment* b) { return a->size > b->size; });
  std::vector<Segment*> chosen;
  for (Segment* c : candidates) {
    if (excess == 0 || cached <= options_.growth_keep_bytes) break;
    chosen.push_back(c);
    excess = c->size >= excess ? 0 : excess - c->size;
    cached -= c->size;
  }
  for (Segment* c : chosen) {
    const auto it = std::find_if(segments_.begin(), segments_.end(), [c](const auto& p) { return p.get() == c; });
    take_free_segment(static_cast<std::size_t>(it - segments_.begin()), out);
    ++stats_.growth_releases;
  }
}

void HostPool::release_segments(const SegmentList& segments) {
  for (const auto& s : segments) provider_->release(s->memory, s->size);
}

}  // namespace hipferry::pool
