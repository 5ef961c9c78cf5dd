// Test doubles for the pinned pool (host_pool/host_pool.h): a provider that
// hands out real, page-aligned memory and audits every segment, and streams
// whose progress the test controls. HostPool owns its provider and event
// source, so both are thin handles on shared state the test keeps
// (FakeMemory, FakeStreams) and can inspect after the pool is gone.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "csrc/core/host_pool/host_memory_provider.h"
#include "csrc/core/host_pool/size_classes.h"

namespace hipferry::pool::testing {

// Segments from std::aligned_alloc. Each segment gets a device address of its
// own, far from its host address and unrelated to other segments, so a pool
// that derives Allocation::device from anything but that segment's device base
// (e.g. assumes device == host, or one global offset) is caught.
class FakeMemory : public std::enable_shared_from_this<FakeMemory> {
  template <class F>
  auto locked(F f) const -> decltype(f()) {
    std::lock_guard<std::mutex> lock(mu_);
    return f();
  }

 public:
  struct Segment {
    std::uintptr_t host = 0;
    std::size_t bytes = 0;
    std::uintptr_t device = 0;    // 0 when unmapped
    int numa_node = kNoNumaNode;  // the node the pool asked for (a fake topology: nothing is bound)
  };

  static std::shared_ptr<FakeMemory> make(bool mapped = true) {
    return std::shared_ptr<FakeMemory>(new FakeMemory(mapped));
  }

  // Every segment handed out must have come back exactly once, with its size.
  ~FakeMemory() {
    for (const auto& [host, s] : live_) {
      ADD_FAILURE() << "FakeMemory: segment " << reinterpret_cast<void*>(host) << " of " << s.bytes
                    << " bytes was never released";
      std::free(reinterpret_cast<void*>(host));
    }
    for (const auto& v : violations_) ADD_FAILURE() << "FakeMemory: " << v;
  }

  std::unique_ptr<HostMemoryProvider> provider();

  // The next allocate() throws std::runtime_error(message).
  void fail_next_allocate(std::string message) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_ = std::move(message);
  }
  // Called (without FakeMemory's lock) at the start of allocate(bytes).
  void on_allocate(std::function<void(std::size_t)> hook) {
    std::lock_guard<std::mutex> lock(mu_);
    allocate_hook_ = std::move(hook);
  }
  // Called (without FakeMemory's lock) just before a segment is freed.
  void on_release(std::function<void(const Segment&)> hook) {
    std::lock_guard<std::mutex> lock(mu_);
    release_hook_ = std::move(hook);
  }

  std::uint64_t allocs() const {
    return locked([&] { return allocs_; });
  }
  std::uint64_t releases() const {
    return locked([&] { return releases_; });
  }
  std::size_t live_segments() const {
    return locked([&] { return live_.size(); });
  }
  std::size_t live_bytes() const {
    return locked([&] { return live_bytes_; });
  }
  std::vector<std::string> violations() const {
    return locked([&] { return violations_; });
  }

  // Host addresses of the live segments, ascending.
  std::vector<std::uintptr_t> segment_hosts() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::uintptr_t> out;
    for (const auto& [host, s] : live_) out.push_back(host);
    return out;
  }

  // The live segment that contains `p`, if any.
  std::optional<Segment> segment_of(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = live_.upper_bound(a);
    if (it == live_.begin()) return std::nullopt;
    --it;
    if (a >= it->second.host + it->second.bytes) return std::nullopt;
    return it->second;
  }

  // Empty when every segment went back exactly once with its size; else what went wrong.
  ::testing::AssertionResult all_released() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.empty() && violations_.empty() && allocs_ == releases_) return ::testing::AssertionSuccess();
    auto r = ::testing::AssertionFailure();
    r << live_.size() << " segments live (" << live_bytes_ << " bytes), " << allocs_ << " allocs, " << releases_
      << " releases";
    for (const auto& v : violations_) r << "; " << v;
    return r;
  }

 private:
  friend class FakeProvider;
  explicit FakeMemory(bool mapped) : mapped_(mapped) {}

  HostSegment allocate(std::size_t bytes, int numa_node) {
    if (auto hook = locked([&] { return allocate_hook_; })) hook(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fail_next_) {
        const std::string m = *fail_next_;
        fail_next_.reset();
        throw std::runtime_error(m);
      }
      // The pool only asks for whole blocks; anything else is a pool bug.
      if (bytes == 0 || bytes % kAlignment != 0) {
        violations_.push_back("allocate(" + std::to_string(bytes) + "): not a positive multiple of 256");
        throw std::runtime_error("FakeMemory: bad segment size " + std::to_string(bytes));
      }
      // Sanitizers abort on absurd sizes rather than returning null.
      if (bytes > kMaxSegmentBytes) {
        throw std::runtime_error("FakeMemory: refusing a segment of " + std::to_string(bytes) + " bytes");
      }
    }
    void* p = std::aligned_alloc(4096, round_up(bytes, 4096));
    if (p == nullptr) throw std::runtime_error("FakeMemory: aligned_alloc failed");
    std::lock_guard<std::mutex> lock(mu_);
    Segment s{reinterpret_cast<std::uintptr_t>(p), bytes, 0, numa_node};
    // 2^46 + n * 2^36: never the host address, different for every segment.
    if (mapped_) s.device = (std::uintptr_t{1} << 46) + (allocs_ + 1) * (std::uintptr_t{1} << 36);
    ++allocs_;
    live_bytes_ += bytes;
    live_.emplace(s.host, s);
    return {p, reinterpret_cast<void*>(s.device)};
  }

  void release(const HostSegment& segment, std::size_t bytes) noexcept {
    std::function<void(const Segment&)> hook;
    Segment s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++releases_;
      auto it = live_.find(reinterpret_cast<std::uintptr_t>(segment.host));
      if (it == live_.end()) {
        std::ostringstream m;
        m << "release of " << segment.host << " which is not a live segment (released twice?)";
        violations_.push_back(m.str());
        return;
      }
      s = it->second;
      if (s.bytes != bytes || s.device != reinterpret_cast<std::uintptr_t>(segment.device)) {
        std::ostringstream m;
        m << "release of " << segment.host << " with " << bytes << " bytes / device " << segment.device
          << "; allocated " << s.bytes << " bytes / device " << reinterpret_cast<void*>(s.device);
        violations_.push_back(m.str());
      }
      live_bytes_ -= s.bytes;
      live_.erase(it);
      hook = release_hook_;
    }
    if (hook) hook(s);
    std::free(segment.host);
  }

  static constexpr std::size_t kMaxSegmentBytes = std::size_t{1} << 30;
  const bool mapped_;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Segment> live_;
  std::size_t live_bytes_ = 0;
  std::uint64_t allocs_ = 0, releases_ = 0;
  std::optional<std::string> fail_next_;
  std::vector<std::string> violations_;
  std::function<void(std::size_t)> allocate_hook_;
  std::function<void(const Segment&)> release_hook_;
};

class FakeProvider : public HostMemoryProvider {
 public:
  explicit FakeProvider(std::shared_ptr<FakeMemory> m) : m_(std::move(m)) {}
  HostSegment allocate(std::size_t bytes, int numa_node) override { return m_->allocate(bytes, numa_node); }
  void release(const HostSegment& segment, std::size_t bytes) noexcept override { m_->release(segment, bytes); }
  std::string describe() const override { return "fake host memory"; }

 private:
  std::shared_ptr<FakeMemory> m_;
};

inline std::unique_ptr<HostMemoryProvider> FakeMemory::provider() {
  return std::make_unique<FakeProvider>(shared_from_this());
}

// Streams as two counters: work queued and work completed. An event recorded
// on a stream completes once the stream has completed everything queued when
// it was recorded, like a runtime event. synchronize() completes the stream up
// to the event (the host waited for it). The test queues work (enqueue) and
// lets the "device" finish it (complete, advance).
class FakeStreams : public std::enable_shared_from_this<FakeStreams> {
  template <class F>
  auto locked(F f) const -> decltype(f()) {
    std::lock_guard<std::mutex> lock(mu_);
    return f();
  }

 public:
  static std::shared_ptr<FakeStreams> make() { return std::shared_ptr<FakeStreams>(new FakeStreams()); }

  ~FakeStreams() {
    for (const auto& v : violations_) ADD_FAILURE() << "FakeStreams: " << v;
  }

  // Distinct fake stream handles; `device` distinguishes same-numbered streams on two devices.
  static StreamUse stream(int i, int device = 0) {
    return StreamUse{device, reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x5000 + 0x10 * i))};
  }

  std::unique_ptr<UseEventSource> source();

  void enqueue(const StreamUse& s, std::uint64_t n = 1) {
    std::lock_guard<std::mutex> lock(mu_);
    streams_[key(s)].queued += n;
  }
  // Finishes up to `n` queued items (all when n is 0).
  void advance(const StreamUse& s, std::uint64_t n = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& st = streams_[key(s)];
    st.completed = n == 0 ? st.queued : std::min(st.queued, st.completed + n);
  }
  void complete(const StreamUse& s) { advance(s, 0); }
  void complete_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [k, st] : streams_) st.completed = st.queued;
  }
  std::uint64_t queued(const StreamUse& s) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(key(s));
    return it == streams_.end() ? 0 : it->second.queued;
  }
  std::uint64_t completed(const StreamUse& s) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(key(s));
    return it == streams_.end() ? 0 : it->second.completed;
  }
  bool idle(const StreamUse& s) const { return completed(s) == queued(s); }

  // The next record() throws std::runtime_error(message).
  void fail_next_record(std::string message) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_record_ = std::move(message);
  }
  // The next `n` query() calls throw (a runtime error, not completion).
  void fail_queries(std::uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    failing_queries_ = n;
  }
  // After `n` more query() calls every stream completes: a pool that spins
  // on events ends its loop (and the test can fail) instead of hanging.
  void complete_all_after_queries(std::uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    complete_all_at_query_ = queries_ + n;
  }

  // Called (without FakeStreams' lock) at the start of record ("record"),
  // query ("query") and synchronize ("synchronize").
  void on_call(std::function<void(const char*)> hook) {
    std::lock_guard<std::mutex> lock(mu_);
    call_hook_ = std::move(hook);
  }

  std::uint64_t records() const {
    return locked([&] { return records_; });
  }
  std::uint64_t queries() const {
    return locked([&] { return queries_; });
  }
  std::uint64_t synchronizes() const {
    return locked([&] { return synchronizes_; });
  }
  std::uint64_t live_events() const {
    return locked([&] { return live_events_; });
  }

 private:
  friend class FakeEventSource;
  friend class FakeEvent;
  using Key = std::pair<int, void*>;
  struct Stream {
    std::uint64_t queued = 0, completed = 0;
  };
  FakeStreams() = default;
  static Key key(const StreamUse& s) { return {s.device, s.stream}; }
  void notify(const char* what) {
    if (auto hook = locked([&] { return call_hook_; })) hook(what);
  }

  mutable std::mutex mu_;
  std::map<Key, Stream> streams_;
  std::uint64_t records_ = 0, queries_ = 0, synchronizes_ = 0, live_events_ = 0;
  std::uint64_t failing_queries_ = 0;
  std::uint64_t complete_all_at_query_ = UINT64_MAX;
  std::optional<std::string> fail_next_record_;
  bool source_alive_ = false;
  std::vector<std::string> violations_;
  std::function<void(const char*)> call_hook_;
};

class FakeEvent : public UseEvent {
 public:
  FakeEvent(std::shared_ptr<FakeStreams> s, FakeStreams::Key key, std::uint64_t target)
      : s_(std::move(s)), key_(key), target_(target) {}
  ~FakeEvent() override {
    std::lock_guard<std::mutex> lock(s_->mu_);
    --s_->live_events_;
    // A runtime event must not outlive the source that recycles it (RuntimeEventSource).
    if (!s_->source_alive_) s_->violations_.push_back("an event was destroyed after its event source");
  }
  bool query() override {
    s_->notify("query");
    std::lock_guard<std::mutex> lock(s_->mu_);
    if (++s_->queries_ >= s_->complete_all_at_query_)
      for (auto& [k, st] : s_->streams_) st.completed = st.queued;
    if (s_->failing_queries_ > 0) {
      --s_->failing_queries_;
      throw std::runtime_error("FakeEvent: injected query failure");
    }
    return s_->streams_[key_].completed >= target_;
  }
  void synchronize() override {
    s_->notify("synchronize");
    std::lock_guard<std::mutex> lock(s_->mu_);
    ++s_->synchronizes_;
    auto& st = s_->streams_[key_];
    st.completed = std::max(st.completed, target_);
  }

 private:
  std::shared_ptr<FakeStreams> s_;
  FakeStreams::Key key_;
  std::uint64_t target_;
};

class FakeEventSource : public UseEventSource {
 public:
  explicit FakeEventSource(std::shared_ptr<FakeStreams> s) : s_(std::move(s)) {
    std::lock_guard<std::mutex> lock(s_->mu_);
    s_->source_alive_ = true;
  }
  ~FakeEventSource() override {
    std::lock_guard<std::mutex> lock(s_->mu_);
    s_->source_alive_ = false;
  }
  std::unique_ptr<UseEvent> record(const StreamUse& use) override {
    s_->notify("record");
    std::lock_guard<std::mutex> lock(s_->mu_);
    if (s_->fail_next_record_) {
      const std::string m = *s_->fail_next_record_;
      s_->fail_next_record_.reset();
      throw std::runtime_error(m);
    }
    ++s_->records_;
    ++s_->live_events_;
    const auto k = FakeStreams::key(use);
    return std::make_unique<FakeEvent>(s_, k, s_->streams_[k].queued);
  }

 private:
  std::shared_ptr<FakeStreams> s_;
};

inline std::unique_ptr<UseEventSource> FakeStreams::source() {
  return std::make_unique<FakeEventSource>(shared_from_this());
}

// Patterns that tell blocks apart: the 8-byte word at each multiple of
// `stride` (8: every word) and the last whole word hold `tag * K + offset`;
// the bytes past the last whole word hold `tag + offset`. A block handed out
// twice, or overlapping another, ends up with wrong words.
inline std::uint64_t pattern_word(std::uint64_t tag, std::size_t offset) {
  return tag * 0x9E3779B97F4A7C15ull + offset;
}

template <class Visit>
void for_each_pattern_word(std::size_t n, std::size_t stride, Visit visit) {
  const std::size_t words_end = n / 8 * 8;
  std::size_t off = 0;
  for (; off + 8 <= words_end; off += stride) visit(off);
  if (words_end >= 8 && off - stride != words_end - 8) visit(words_end - 8);
}

inline void write_pattern(void* p, std::size_t n, std::uint64_t tag, std::size_t stride = 8) {
  auto* c = static_cast<unsigned char*>(p);
  for_each_pattern_word(n, stride, [&](std::size_t off) {
    const std::uint64_t w = pattern_word(tag, off);
    std::memcpy(c + off, &w, 8);
  });
  for (std::size_t i = n / 8 * 8; i < n; ++i) c[i] = static_cast<unsigned char>(tag + i);
}

// Offset of the first wrong byte or word, or -1 when the pattern is intact.
inline std::ptrdiff_t find_pattern_damage(const void* p, std::size_t n, std::uint64_t tag, std::size_t stride = 8) {
  const auto* c = static_cast<const unsigned char*>(p);
  std::ptrdiff_t first_bad = -1;
  for_each_pattern_word(n, stride, [&](std::size_t off) {
    std::uint64_t w;
    std::memcpy(&w, c + off, 8);
    if (first_bad < 0 && w != pattern_word(tag, off)) first_bad = static_cast<std::ptrdiff_t>(off);
  });
  if (first_bad >= 0) return first_bad;
  for (std::size_t i = n / 8 * 8; i < n; ++i)
    if (c[i] != static_cast<unsigned char>(tag + i)) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

// A stride that visits about 32 words of an `n`-byte block: cheap for huge blocks.
inline std::size_t sparse_stride(std::size_t n) { return std::max<std::size_t>(8, n / 32 / 8 * 8); }

}  // namespace hipferry::pool::testing
