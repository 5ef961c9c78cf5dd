// IoQueue (csrc/core/disk/io_queue.h) against adversarial fake backends:
// every byte lands, the depth holds, requests are request_bytes pieces,
// short transfers finish, failures name the file and offset and come back
// only once nothing is in flight (Note [no I/O after a failure returns]).
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "csrc/core/disk/io_queue.h"
#include "tests/cpp/fake_io_backend.h"
#include "tests/cpp/seeds.h"

namespace hipferry::disk {
namespace {

using fake::FakeIoBackend;
using fake::FakeIoConfig;
using Bytes = std::vector<unsigned char>;

constexpr std::size_t kFileBytes = 1 << 16;

Bytes random_bytes(std::size_t n, std::mt19937_64& rng) {
  Bytes b(n);
  for (auto& x : b) x = static_cast<unsigned char>(rng());
  return b;
}

FakeIoConfig random_config(std::uint64_t seed, std::mt19937_64& rng) {
  FakeIoConfig c = fake::random_config(seed, rng, 0.5);
  c.short_fraction = (seed % 3 == 0) ? 0 : 0.3;
  return c;
}

struct Transfer {
  bool write = false;
  std::uint64_t offset = 0;
  Bytes buffer;  // a read's destination or a write's source
};

// Random reads of `src` and writes to disjoint places of `dst` (fds 3 and 4).
struct Scenario {
  FileRef src{3, "/fake/src"};
  FileRef dst{4, "/fake/dst"};
  Bytes src_bytes;
  std::vector<Transfer> transfers;

  Scenario(FakeIoBackend& fake, std::mt19937_64& rng) : src_bytes(random_bytes(kFileBytes, rng)) {
    fake.files[src.fd] = src_bytes;
    fake.files[dst.fd] = Bytes(kFileBytes, 0);
    const std::size_t n = 1 + rng() % 12;
    for (std::size_t t = 0; t < n; ++t) {
      Transfer x;
      x.write = rng() % 2;
      const std::size_t bytes = (rng() % 8 == 0) ? 0 : 1 + rng() % 4000;
      x.offset = x.write ? t * 4096 + rng() % 96 : rng() % (kFileBytes - bytes);
      x.buffer = x.write ? random_bytes(bytes, rng) : Bytes(bytes, 0);
      transfers.push_back(std::move(x));
    }
  }

  void enqueue(IoQueue& q, std::mt19937_64& rng, std::vector<std::uint64_t>* done) {
    for (std::size_t t = 0; t < transfers.size(); ++t) {
      Transfer& x = transfers[t];
      if (x.write)
        q.write(dst, x.offset, x.buffer.data(), x.buffer.size(), t);
      else
        q.read(src, x.offset, x.buffer.data(), x.buffer.size(), t);
      if (rng() % 3 == 0) q.poll(false, done);
    }
  }

  void expect_bytes_landed(FakeIoBackend& fake) const {
    Bytes expected_dst(kFileBytes, 0);
    for (const Transfer& x : transfers) {
      if (x.write) {
        std::copy(x.buffer.begin(), x.buffer.end(), expected_dst.begin() + x.offset);
      } else {
        EXPECT_TRUE(std::equal(x.buffer.begin(), x.buffer.end(), src_bytes.begin() + x.offset));
      }
    }
    EXPECT_EQ(fake.files[dst.fd], expected_dst);
    EXPECT_EQ(fake.files[src.fd], src_bytes);
  }

  // The requests of transfer x: those whose buffer lies in x's, by offset.
  std::vector<IoRequest> requests_of(const FakeIoBackend& fake, const Transfer& x) const {
    std::vector<IoRequest> out;
    for (const auto& rec : fake.records()) {
      const auto* p = static_cast<const unsigned char*>(rec.request.buffer);
      const bool inside = p >= x.buffer.data() && p < x.buffer.data() + x.buffer.size();
      if (!x.buffer.empty() && inside) out.push_back(rec.request);
    }
    std::sort(out.begin(), out.end(), [](const IoRequest& a, const IoRequest& b) { return a.offset < b.offset; });
    return out;
  }
};

void poll_until_idle(IoQueue& q, std::vector<std::uint64_t>* done) {
  for (int i = 0; i < 1000000 && q.pending() > 0; ++i) q.poll(true, done);
  ASSERT_EQ(q.pending(), 0u);
}

// The IoFailure that polling `q` until idle throws; nullopt when it throws none.
std::optional<IoFailure> failure_of(IoQueue& q, std::vector<std::uint64_t>* done) {
  try {
    poll_until_idle(q, done);
  } catch (const IoFailure& e) {
    return e;
  }
  return std::nullopt;
}

TEST(IoQueue, EveryByteLandsUnderAdversarialBackends) {
  for_each_seed(300, [&](std::uint64_t seed, std::mt19937_64& rng) {
    const FakeIoConfig config = random_config(seed, rng);
    FakeIoBackend fake(config);
    Scenario s(fake, rng);
    const std::size_t sizes[] = {1, 3, 512, 1000, 4096};
    const std::size_t request_bytes = sizes[rng() % 5];
    IoQueue q(fake, request_bytes);
    std::vector<std::uint64_t> done;
    s.enqueue(q, rng, &done);
    poll_until_idle(q, &done);

    std::multiset<std::uint64_t> tokens(done.begin(), done.end());
    for (std::size_t t = 0; t < s.transfers.size(); ++t) EXPECT_EQ(tokens.count(t), 1u) << "token " << t;
    EXPECT_EQ(done.size(), s.transfers.size());
    s.expect_bytes_landed(fake);

    std::uint64_t read = 0, written = 0;
    for (const Transfer& x : s.transfers) (x.write ? written : read) += x.buffer.size();
    const IoCounters& c = q.counters();
    EXPECT_EQ(c.bytes_read, read);
    EXPECT_EQ(c.bytes_written, written);
    EXPECT_EQ(c.requests, fake.records().size());
    EXPECT_EQ(c.short_transfers, fake.short_count());
    EXPECT_EQ(c.max_in_flight, fake.max_in_flight());
    EXPECT_LE(c.max_in_flight, config.depth);
    if (config.short_fraction > 0) EXPECT_GE(c.requests, c.short_transfers);
    for (const auto& rec : fake.records()) EXPECT_LE(rec.request.bytes, request_bytes);
  });
}

// Without short transfers, each transfer is cut into request_bytes pieces,
// the last one shorter, covering it exactly once.
TEST(IoQueue, TransfersSplitIntoRequestBytesPieces) {
  for_each_seed(200, [&](std::uint64_t seed, std::mt19937_64& rng) {
    FakeIoConfig config = random_config(seed, rng);
    config.short_fraction = 0;
    FakeIoBackend fake(config);
    Scenario s(fake, rng);
    const std::size_t request_bytes = 1 + rng() % 1500;
    IoQueue q(fake, request_bytes);
    std::vector<std::uint64_t> done;
    s.enqueue(q, rng, &done);
    poll_until_idle(q, &done);
    for (const Transfer& x : s.transfers) {
      const std::vector<IoRequest> pieces = s.requests_of(fake, x);
      std::uint64_t at = x.offset;
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        EXPECT_EQ(pieces[i].offset, at);
        if (i + 1 < pieces.size())
          EXPECT_EQ(pieces[i].bytes, request_bytes);
        else
          EXPECT_LE(pieces[i].bytes, request_bytes);
        at += pieces[i].bytes;
      }
      EXPECT_EQ(at, x.offset + x.buffer.size());
    }
  });
}

// The k-th request fails: the error names the operation, the file, the
// failed request's offset and size, and arrives with nothing in flight and
// nothing submitted after it; the queue stays dead.
TEST(IoQueue, FailureNamesFileAndOffsetAndDrainsFirst) {
  int failures = 0;
  for_each_seed(200, [&](std::uint64_t seed, std::mt19937_64& rng) {
    const FakeIoConfig config = fake::failing_one_request(random_config(seed, rng), rng, 6);
    FakeIoBackend fake(config);
    Scenario s(fake, rng);
    IoQueue q(fake, 512);
    std::vector<std::uint64_t> done;
    std::string message;
    try {
      s.enqueue(q, rng, &done);
      poll_until_idle(q, &done);
    } catch (const IoFailure& e) {
      EXPECT_EQ(fake.in_flight(), 0u);
      message = e.what();
      const IoRequest& r = fake.records().at(static_cast<std::size_t>(config.fail_request)).request;
      const std::string path = r.fd == s.src.fd ? s.src.path : s.dst.path;
      EXPECT_EQ(message, std::string(r.op == IoOp::kRead ? "read" : "write") + " of " + path + " at offset " +
                             std::to_string(r.offset) + " (" + std::to_string(r.bytes) +
                             " bytes): " + std::strerror(EIO));
      EXPECT_EQ(e.path, path);
      EXPECT_EQ(e.offset, r.offset);
      EXPECT_EQ(e.error, EIO);
    }
    if (fake.records().size() <= static_cast<std::size_t>(config.fail_request)) return;  // too few requests
    ASSERT_FALSE(message.empty()) << "the failure was not reported";
    ++failures;
    EXPECT_EQ(fake.submits_after_failure(), 0u);
    EXPECT_EQ(q.pending(), 0u);
    const std::size_t submitted = fake.records().size();
    try {
      q.poll(true, &done);
      ADD_FAILURE() << "a dead queue polled without throwing";
    } catch (const IoFailure& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
    Bytes b(10);
    EXPECT_THROW(q.read(s.src, 0, b.data(), b.size(), 99), IoFailure);
    EXPECT_EQ(fake.records().size(), submitted);
  });
  EXPECT_GT(failures, 100);  // most seeds have more than 6 requests
}

TEST(IoQueue, ReadOfATruncatedFileFails) {
  FakeIoConfig config;
  config.depth = 1;
  config.shuffle = false;
  config.short_fraction = 0;
  FakeIoBackend fake(config);
  FileRef f{3, "/fake/short"};
  fake.files[f.fd] = Bytes(10000, 7);
  IoQueue q(fake, 1024);
  Bytes b(4096);
  std::vector<std::uint64_t> done;
  q.read(f, 8192, b.data(), b.size(), 1);
  const std::optional<IoFailure> e = failure_of(q, &done);
  ASSERT_TRUE(e) << "a read past the end succeeded";
  // 9216 moves 784 bytes (short); the rest, at 10000, finds the end.
  EXPECT_STREQ(e->what(), "read of /fake/short at offset 10000 (240 bytes): the file ends early (truncated?)");
  EXPECT_EQ(e->error, 0);
  EXPECT_EQ(e->offset, 10000u);
  EXPECT_EQ(q.counters().short_transfers, 2u);  // 784 of 1024, then 0 of 240
  EXPECT_TRUE(done.empty());
}

TEST(IoQueue, WriteToAFullDiskFails) {
  FakeIoConfig config;
  config.depth = 1;
  config.nospc_from_write = 2;
  FakeIoBackend fake(config);
  FileRef f{4, "/fake/full"};
  fake.files[f.fd] = Bytes();
  IoQueue q(fake, 100);
  Bytes b(1000, 9);
  std::vector<std::uint64_t> done;
  q.write(f, 0, b.data(), b.size(), 1);
  const std::optional<IoFailure> e = failure_of(q, &done);
  ASSERT_TRUE(e) << "a write to a full disk succeeded";
  EXPECT_EQ(std::string(e->what()),
            "write of /fake/full at offset 200 (100 bytes): " + std::string(std::strerror(ENOSPC)));
  EXPECT_EQ(e->error, ENOSPC);
  EXPECT_EQ(e->path, "/fake/full");
  EXPECT_EQ(fake.files[f.fd], Bytes(200, 9));
}

// A file of `bytes` bytes (each 1) on `fake`, at fd 3.
FileRef one_file(FakeIoBackend& fake, std::size_t bytes) {
  FileRef f{3, "/fake/f"};
  fake.files[f.fd] = Bytes(bytes, 1);
  return f;
}

TEST(IoQueue, DestructorWaitsForRequestsInFlight) {
  FakeIoConfig config;
  config.depth = 4;
  config.partial_reap = 1;
  FakeIoBackend fake(config);
  const FileRef f = one_file(fake, 4096);
  Bytes b(4096);
  {
    IoQueue q(fake, 256);
    q.read(f, 0, b.data(), b.size(), 1);
    std::vector<std::uint64_t> done;
    q.poll(false, &done);
    ASSERT_GT(fake.in_flight(), 0u);
  }
  EXPECT_EQ(fake.in_flight(), 0u);
  EXPECT_LE(fake.records().size(), 4u + 4u);  // nothing queued was submitted by the destructor
}

// cancel(): drops what is queued, waits for what is in flight, reports the
// transfers that finished, and leaves the queue usable.
TEST(IoQueue, CancelDropsQueuedWorkAndKeepsTheQueue) {
  FakeIoConfig config;
  config.depth = 2;
  config.shuffle = false;
  FakeIoBackend fake(config);
  FileRef f{4, "/fake/f"};
  fake.files[f.fd] = Bytes(1000, 0);
  IoQueue q(fake, 100);
  Bytes big(1000, 5), small(100, 6);
  std::vector<std::uint64_t> done;
  q.write(f, 0, small.data(), small.size(), 1);  // one piece
  q.write(f, 100, big.data(), 900, 2);           // nine pieces
  q.poll(false, &done);                          // submits 2, reaps both, submits 2 more
  ASSERT_EQ(done, std::vector<std::uint64_t>{1});
  ASSERT_EQ(fake.in_flight(), 2u);
  q.cancel(&done);
  EXPECT_EQ(done, std::vector<std::uint64_t>{1});  // transfer 2 never finished
  EXPECT_EQ(fake.in_flight(), 0u);
  EXPECT_EQ(fake.records().size(), 4u);
  EXPECT_EQ(q.pending(), 0u);
  Bytes back(100);
  q.read(f, 0, back.data(), back.size(), 3);
  poll_until_idle(q, &done);
  EXPECT_EQ(done.back(), 3u);
  EXPECT_EQ(back, small);
}

TEST(IoQueue, EmptyTransfersAreReportedWithoutRequests) {
  FakeIoBackend fake(FakeIoConfig{});
  const FileRef f = one_file(fake, 0);
  IoQueue q(fake);
  q.read(f, 123, nullptr, 0, 7);
  EXPECT_EQ(q.pending(), 1u);
  std::vector<std::uint64_t> done;
  q.poll(true, &done);
  EXPECT_EQ(done, std::vector<std::uint64_t>{7});
  EXPECT_EQ(q.pending(), 0u);
  EXPECT_TRUE(fake.records().empty());
}

// A backend whose submit() throws (a broken ring) fails the transfer like
// an I/O error: named, after the requests in flight finished.
struct BrokenBackend final : IoBackend {
  FakeIoBackend& inner;
  std::size_t submits_left;
  BrokenBackend(FakeIoBackend& inner, std::size_t submits) : inner(inner), submits_left(submits) {}
  const char* name() const override { return "broken"; }
  std::size_t depth() const override { return inner.depth(); }
  void submit(const IoRequest& r) override {
    if (submits_left-- == 0) throw std::runtime_error("ring gone");
    inner.submit(r);
  }
  std::size_t reap(IoCompletion* out, std::size_t max, std::size_t min) override { return inner.reap(out, max, min); }
};

TEST(IoQueue, ABrokenBackendFailsTheTransfer) {
  FakeIoConfig config;
  config.depth = 3;
  FakeIoBackend fake(config);
  BrokenBackend broken(fake, 5);
  const FileRef f = one_file(fake, 1000);
  Bytes b(1000);
  IoQueue q(broken, 100);
  q.read(f, 0, b.data(), b.size(), 1);
  std::vector<std::uint64_t> done;
  const std::optional<IoFailure> e = failure_of(q, &done);
  ASSERT_TRUE(e) << "the broken backend went unnoticed";
  EXPECT_STREQ(e->what(), "read of /fake/f at offset 500 (100 bytes): broken backend: ring gone");
  EXPECT_EQ(e->error, EIO);
  EXPECT_EQ(fake.in_flight(), 0u);
}

TEST(IoQueue, RejectsBadInput) {
  FakeIoBackend fake(FakeIoConfig{});
  EXPECT_THROW(IoQueue(fake, 0), std::invalid_argument);
  IoQueue q(fake, 4096);
  Bytes b(10);
  FileRef closed{-1, "/fake/closed"};
  FileRef f{3, "/fake/f"};
  EXPECT_THROW(q.read(closed, 0, b.data(), b.size(), 1), std::invalid_argument);
  EXPECT_THROW(q.write(f, 0, nullptr, 10, 1), std::invalid_argument);
  EXPECT_THROW(q.read(f, ~std::uint64_t{0}, b.data(), b.size(), 1), std::invalid_argument);
  EXPECT_THROW(q.poll(false, nullptr), std::invalid_argument);
  EXPECT_EQ(q.pending(), 0u);
}

}  // namespace
}  // namespace hipferry::disk
