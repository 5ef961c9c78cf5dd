// A fake IoBackend over in-memory files (fd -> bytes) for the disk store's
// tests (io_queue.h, chunk_pipeline.h). Adversarial where configured: it
// completes requests in random order, only some per reap, short (part of the
// bytes), fails the k-th request with -EIO or writes with -ENOSPC, and a read
// past the end of a file returns what is there (0 at the end).
//
// The bytes move when a request completes (in reap), not when it is
// submitted, as with a kernel that works late: a buffer touched while its
// request is in flight shows up as wrong bytes. It also checks, as gtest
// failures: the depth is never exceeded, no request is empty, and no two
// requests in flight share buffer memory when one of them is a read. And it
// records every request, the deepest it was kept, and the requests submitted
// after a failure was handed back (Note [no I/O after a failure returns]).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "csrc/core/disk/io_backend.h"

namespace hipferry::disk::fake {

struct FakeIoConfig {
  std::uint64_t seed = 1;
  std::size_t depth = 4;
  bool shuffle = true;                 // complete in random order (else in submission order)
  double partial_reap = 0;             // chance that a reap returns a random count >= min_complete
  double short_fraction = 0;           // chance that a request moves only part of its bytes
  std::int64_t fail_request = -1;      // the k-th request submitted (from 0) fails with -EIO
  std::int64_t nospc_from_write = -1;  // write requests from the k-th (from 0) fail with -ENOSPC
};

struct RequestRecord {
  IoRequest request;
  std::size_t write_index = 0;  // among writes, when a write
  bool completed = false;
  std::int64_t result = 0;  // once completed
};

class FakeIoBackend final : public IoBackend {
 public:
  explicit FakeIoBackend(FakeIoConfig config) : config_(config), rng_(config.seed) {}

  std::map<int, std::vector<unsigned char>> files;

  const char* name() const override { return "fake"; }
  std::size_t depth() const override { return config_.depth; }

  void submit(const IoRequest& r) override {
    if (in_flight_.size() >= config_.depth) {
      ADD_FAILURE() << "submit with " << in_flight_.size() << " in flight, depth " << config_.depth;
    }
    if (r.bytes == 0) ADD_FAILURE() << "a request of 0 bytes at offset " << r.offset;
    if (failure_returned_) ++submits_after_failure_;
    for (std::size_t k : in_flight_) check_no_overlap(records_[k].request, r);
    RequestRecord rec;
    rec.request = r;
    if (r.op == IoOp::kWrite) rec.write_index = writes_++;
    in_flight_.push_back(records_.size());
    records_.push_back(rec);
    max_in_flight_ = std::max(max_in_flight_, in_flight_.size());
  }

  std::size_t reap(IoCompletion* out, std::size_t max, std::size_t min_complete) override {
    if (min_complete > in_flight_.size()) {
      ADD_FAILURE() << "reap waits for " << min_complete << " with " << in_flight_.size() << " in flight";
      min_complete = in_flight_.size();  // a real backend would hang
    }
    std::size_t n = std::min(max, in_flight_.size());
    if (n > min_complete && chance(config_.partial_reap)) {
      n = min_complete + static_cast<std::size_t>(rng_() % (n - min_complete + 1));
    }
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t pick = config_.shuffle ? static_cast<std::size_t>(rng_() % in_flight_.size()) : 0;
      const std::size_t k = in_flight_[pick];
      in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(pick));
      RequestRecord& rec = records_[k];
      rec.result = execute(k);
      rec.completed = true;
      if (rec.result < 0 || (rec.result == 0 && rec.request.op == IoOp::kRead)) failure_returned_ = true;
      if (rec.result >= 0 && static_cast<std::size_t>(rec.result) < rec.request.bytes) ++shorts_;
      out[i] = IoCompletion{rec.request.tag, rec.result};
    }
    return n;
  }

  std::size_t in_flight() const { return in_flight_.size(); }
  std::size_t max_in_flight() const { return max_in_flight_; }
  const std::vector<RequestRecord>& records() const { return records_; }
  std::size_t submits_after_failure() const { return submits_after_failure_; }
  std::size_t short_count() const { return shorts_; }

  // Requests in flight whose buffer overlaps [p, p + bytes).
  std::size_t in_flight_touching(const void* p, std::size_t bytes) const {
    std::size_t n = 0;
    for (std::size_t k : in_flight_) n += overlaps(records_[k].request, p, bytes);
    return n;
  }

 private:
  static bool overlaps(const IoRequest& r, const void* p, std::size_t bytes) {
    const auto* a = static_cast<const unsigned char*>(r.buffer);
    const auto* b = static_cast<const unsigned char*>(p);
    return a < b + bytes && b < a + r.bytes;
  }

  static void check_no_overlap(const IoRequest& old, const IoRequest& r) {
    if ((old.op == IoOp::kRead || r.op == IoOp::kRead) && overlaps(old, r.buffer, r.bytes)) {
      ADD_FAILURE() << "buffer overlap in flight: " << (old.op == IoOp::kRead ? "read" : "write") << " fd " << old.fd
                    << " @" << old.offset << " (" << old.bytes << ") and " << (r.op == IoOp::kRead ? "read" : "write")
                    << " fd " << r.fd << " @" << r.offset << " (" << r.bytes << ")";
    }
  }

  bool chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  // Moves the bytes of request k (or fails it); returns the completion's result.
  std::int64_t execute(std::size_t k) {
    const RequestRecord& rec = records_[k];
    const IoRequest& r = rec.request;
    if (config_.fail_request >= 0 && k == static_cast<std::size_t>(config_.fail_request)) return -EIO;
    const bool write = r.op == IoOp::kWrite;
    const auto nospc_from = static_cast<std::size_t>(config_.nospc_from_write);
    if (write && config_.nospc_from_write >= 0 && rec.write_index >= nospc_from) return -ENOSPC;
    std::size_t bytes = r.bytes;
    if (bytes > 1 && chance(config_.short_fraction)) bytes = 1 + static_cast<std::size_t>(rng_() % (bytes - 1));
    auto it = files.find(r.fd);
    if (it == files.end()) return -EBADF;
    std::vector<unsigned char>& file = it->second;
    if (write) {
      if (file.size() < r.offset + bytes) file.resize(r.offset + bytes);
      std::memcpy(file.data() + r.offset, r.buffer, bytes);
      return static_cast<std::int64_t>(bytes);
    }
    if (r.offset >= file.size()) return 0;
    bytes = std::min<std::size_t>(bytes, file.size() - r.offset);
    std::memcpy(r.buffer, file.data() + r.offset, bytes);
    return static_cast<std::int64_t>(bytes);
  }

  FakeIoConfig config_;
  std::mt19937_64 rng_;
  std::vector<RequestRecord> records_;  // every request, in submission order
  std::vector<std::size_t> in_flight_;  // indexes into records_
  std::size_t writes_ = 0;
  std::size_t max_in_flight_ = 0;
  std::size_t shorts_ = 0;
  bool failure_returned_ = false;  // a failed completion was handed to the caller
  std::size_t submits_after_failure_ = 0;
};

// A random adversarial configuration for `seed`: a depth of 1 to 8, completions in
// random order or not, partial reaps (with chance `partial_reap`) or none. Draws from
// rng in that order; short transfers are left to the caller.
inline FakeIoConfig random_config(std::uint64_t seed, std::mt19937_64& rng, double partial_reap) {
  FakeIoConfig c;
  c.seed = seed;
  c.depth = 1 + rng() % 8;
  c.shuffle = rng() % 2;
  c.partial_reap = (rng() % 2) ? partial_reap : 0;
  return c;
}

// `c` with one request failing (-EIO): the k-th submitted, k drawn from rng below `requests`.
inline FakeIoConfig failing_one_request(FakeIoConfig c, std::mt19937_64& rng, std::uint64_t requests) {
  c.fail_request = static_cast<std::int64_t>(rng() % requests);
  return c;
}

}  // namespace hipferry::disk::fake
