// The real I/O backends (io_uring and threads) against files on this
// machine's disk: O_DIRECT round trips with many requests in flight,
// completions matched by tag, short reads at the end of a file, errors in
// the completion; and make_backend's choice (asked for, auto, environment).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "csrc/core/disk/io_backend.h"
#include "csrc/core/disk/state_file.h"
#include "tests/cpp/disk_temp_files.h"

namespace hipferry::disk {
namespace {

using testing::aligned_bytes;
using testing::TempDir;

std::unique_ptr<IoBackend> make_named(const std::string& name, std::size_t depth, std::string* refused) {
  if (name == "threads") return make_thread_backend(depth);
  return make_uring_backend(depth, refused);
}

class RealBackend : public ::testing::TestWithParam<std::string> {
 protected:
  // The backend, or nullptr after GTEST_SKIP where this machine refuses it.
  std::unique_ptr<IoBackend> backend(std::size_t depth) {
    std::string refused;
    auto b = make_named(GetParam(), depth, &refused);
    if (!b) ADD_FAILURE() << "refused: " << refused;  // replaced by a skip in SetUp when refused
    return b;
  }
  void SetUp() override {
    std::string refused;
    if (!make_named(GetParam(), 1, &refused)) GTEST_SKIP() << GetParam() << " refused here: " << refused;
  }

  // Submits every request, keeping at most depth() in flight, and returns
  // each tag's result. Fails the test on a tag seen twice or never.
  static std::map<std::uint64_t, std::int64_t> run_all(IoBackend& b, const std::vector<IoRequest>& requests) {
    std::map<std::uint64_t, std::int64_t> results;
    std::vector<IoCompletion> out(b.depth());
    std::size_t next = 0, in_flight = 0;
    while (next < requests.size() || in_flight > 0) {
      while (next < requests.size() && in_flight < b.depth()) {
        b.submit(requests[next++]);
        ++in_flight;
      }
      const std::size_t n = b.reap(out.data(), out.size(), 1);
      EXPECT_GE(n, 1u);
      for (std::size_t i = 0; i < n; ++i) {
        EXPECT_TRUE(results.emplace(out[i].tag, out[i].result).second) << "tag " << out[i].tag << " twice";
      }
      in_flight -= n;
    }
    EXPECT_EQ(results.size(), requests.size());
    return results;
  }
};

// Request i moves a different size (1 to 4 pages) at a scattered offset under
// a random tag: a completion credited to the wrong tag shows as a wrong size
// or wrong bytes.
TEST_P(RealBackend, DirectRoundTripManyInFlightMatchedByTag) {
  TempDir dir;
  OpenedFile f = open_state_file(dir.file("state.bin"), true, true);
  SCOPED_TRACE(f.direct ? "O_DIRECT" : f.note);
  constexpr std::size_t kPage = 4096, kSlot = 4 * kPage, kRequests = 512;  // 8 MiB of slots
  reserve(f.file, kSlot * kRequests);
  auto source = aligned_bytes(kSlot * kRequests), back = aligned_bytes(kSlot * kRequests);
  std::mt19937_64 rng(7);
  for (std::size_t i = 0; i < kSlot * kRequests; ++i) source[i] = static_cast<unsigned char>(rng());
  std::memset(back.get(), 0xAB, kSlot * kRequests);

  std::vector<std::size_t> order(kRequests);
  for (std::size_t i = 0; i < kRequests; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<IoRequest> writes, reads;
  std::map<std::uint64_t, std::size_t> size_of;
  for (std::size_t i : order) {
    const std::size_t bytes = kPage * (1 + i % 4);
    const std::uint64_t tag = rng();
    size_of[tag] = bytes;
    writes.push_back({IoOp::kWrite, f.file.fd, i * kSlot, source.get() + i * kSlot, bytes, tag});
    reads.push_back({IoOp::kRead, f.file.fd, i * kSlot, back.get() + i * kSlot, bytes, tag});
  }
  auto b = backend(32);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->depth(), 32u);
  for (const auto& [tag, result] : run_all(*b, writes)) EXPECT_EQ(result, std::int64_t(size_of[tag])) << tag;
  std::reverse(reads.begin(), reads.end());
  for (const auto& [tag, result] : run_all(*b, reads)) EXPECT_EQ(result, std::int64_t(size_of[tag])) << tag;
  for (std::size_t i = 0; i < kRequests; ++i) {
    const std::size_t bytes = kPage * (1 + i % 4);
    ASSERT_EQ(std::memcmp(back.get() + i * kSlot, source.get() + i * kSlot, bytes), 0) << "slot " << i;
    // Past each request's size nothing was read: the fill is intact.
    if (bytes < kSlot) ASSERT_EQ(back[i * kSlot + bytes], 0xAB) << "slot " << i;
  }
  close_file(&f.file);
}

TEST_P(RealBackend, ReadPastTheEndIsShortThenZero) {
  TempDir dir;
  OpenedFile f = open_state_file(dir.file("short.bin"), true, true);
  auto data = aligned_bytes(16384);
  std::memset(data.get(), 0x5A, 16384);
  ASSERT_EQ(::pwrite(f.file.fd, data.get(), 8192, 0), 8192);
  auto b = backend(4);
  ASSERT_TRUE(b);
  b->submit({IoOp::kRead, f.file.fd, 4096, data.get(), 16384, 1});    // 4096 of 16384 exist
  b->submit({IoOp::kRead, f.file.fd, 8192, data.get(), 4096, 2});     // at the end
  b->submit({IoOp::kRead, f.file.fd, 1 << 20, data.get(), 4096, 3});  // beyond it
  std::map<std::uint64_t, std::int64_t> got;
  IoCompletion out[4];
  while (got.size() < 3) {
    const std::size_t n = b->reap(out, 4, 1);
    for (std::size_t i = 0; i < n; ++i) got[out[i].tag] = out[i].result;
  }
  EXPECT_EQ(got[1], 4096);
  EXPECT_EQ(got[2], 0);
  EXPECT_EQ(got[3], 0);
  close_file(&f.file);
}

TEST_P(RealBackend, BadDescriptorFailsInTheCompletion) {
  auto b = backend(2);
  ASSERT_TRUE(b);
  auto data = aligned_bytes(4096);
  b->submit({IoOp::kRead, -1, 0, data.get(), 4096, 11});
  b->submit({IoOp::kWrite, -1, 0, data.get(), 4096, 12});
  IoCompletion out[2];
  std::size_t n = b->reap(out, 2, 2);
  ASSERT_EQ(n, 2u);
  for (const IoCompletion& c : out) {
    EXPECT_TRUE(c.tag == 11 || c.tag == 12) << c.tag;
    EXPECT_EQ(c.result, -EBADF) << "tag " << c.tag;
  }
}

TEST_P(RealBackend, ReapRefusesToWaitForMoreThanIsInFlight) {
  auto b = backend(2);
  ASSERT_TRUE(b);
  IoCompletion out[2];
  EXPECT_EQ(b->reap(out, 2, 0), 0u);  // nothing in flight, nothing to wait for
  EXPECT_THROW(b->reap(out, 2, 1), std::logic_error);
}

// Destroying the backend waits for requests in flight: the kernel holds no
// buffer afterwards, and what was read is there.
TEST_P(RealBackend, DestructionWaitsForRequestsInFlight) {
  TempDir dir;
  OpenedFile f = open_state_file(dir.file("wait.bin"), true, true);
  constexpr std::size_t kBytes = 1 << 20;
  auto data = aligned_bytes(kBytes), back = aligned_bytes(kBytes);
  for (std::size_t i = 0; i < kBytes; ++i) data[i] = static_cast<unsigned char>(i * 13 + 1);
  ASSERT_EQ(::pwrite(f.file.fd, data.get(), kBytes, 0), std::int64_t(kBytes));
  std::memset(back.get(), 0, kBytes);
  {
    auto b = backend(8);
    ASSERT_TRUE(b);
    for (std::size_t i = 0; i < 8; ++i) {
      b->submit({IoOp::kRead, f.file.fd, i * (kBytes / 8), back.get() + i * (kBytes / 8), kBytes / 8, i});
    }
  }
  EXPECT_EQ(std::memcmp(back.get(), data.get(), kBytes), 0);
  close_file(&f.file);
}

INSTANTIATE_TEST_SUITE_P(Backends, RealBackend, ::testing::Values("io_uring", "threads"),
                         [](const auto& info) { return info.param == "io_uring" ? "IoUring" : "Threads"; });

// Sets (or with nullptr unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

bool uring_allowed(std::string* refused) { return make_uring_backend(4, refused) != nullptr; }

TEST(MakeBackend, ThreadsWhenAskedFor) {
  ScopedEnv env("HIPFERRY_IO_BACKEND", "io_uring");  // only stands in for "auto"
  std::string note;
  auto b = make_backend("threads", 3, &note);
  EXPECT_STREQ(b->name(), "threads");
  EXPECT_EQ(b->depth(), 3u);
  EXPECT_EQ(note, "threads (asked for)");
}

TEST(MakeBackend, AutoTakesIoUringWhereAllowedElseThreads) {
  ScopedEnv env("HIPFERRY_IO_BACKEND", nullptr);
  std::string refused, note;
  const bool allowed = uring_allowed(&refused);
  auto b = make_backend("auto", 4, &note);
  if (allowed) {
    EXPECT_STREQ(b->name(), "io_uring");
    EXPECT_EQ(note, "io_uring");
  } else {
    EXPECT_STREQ(b->name(), "threads");
    EXPECT_EQ(note, "io_uring refused: " + refused + "; threads take over");
  }
}

TEST(MakeBackend, EnvironmentPicksForAuto) {
  ScopedEnv env("HIPFERRY_IO_BACKEND", "threads");
  std::string note;
  auto b = make_backend("auto", 2, &note);
  EXPECT_STREQ(b->name(), "threads");
  EXPECT_EQ(note, "threads (HIPFERRY_IO_BACKEND=threads)");
}

TEST(MakeBackend, IoUringWhenAskedForOrTheReason) {
  ScopedEnv env("HIPFERRY_IO_BACKEND", "threads");  // ignored: not "auto"
  std::string refused, note;
  if (uring_allowed(&refused)) {
    EXPECT_STREQ(make_backend("io_uring", 2, &note)->name(), "io_uring");
    EXPECT_EQ(note, "io_uring (asked for)");
  } else {
    try {
      make_backend("io_uring", 2, &note);
      ADD_FAILURE() << "io_uring was refused, yet make_backend returned a backend";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(refused), std::string::npos) << e.what();
    }
  }
}

TEST(MakeBackend, RejectsBadArgumentsNamingThem) {
  std::string note = "untouched";
  try {
    make_backend("uring", 2, &note);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'uring'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_backend("threads", 0, &note), std::invalid_argument);
  ScopedEnv env("HIPFERRY_IO_BACKEND", "fast");
  try {
    make_backend("auto", 2, &note);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("HIPFERRY_IO_BACKEND"), std::string::npos) << e.what();
  }
  EXPECT_EQ(note, "untouched");
}

// More entries than the kernel's ring limit (32768): the refusal carries
// io_uring_queue_init's errno.
TEST(MakeUringBackend, RefusalNamesTheCause) {
  std::string refused;
  auto b = make_uring_backend(std::size_t{1} << 16, &refused);
  EXPECT_EQ(b, nullptr);
  if (refused == "built without liburing") GTEST_SKIP() << refused;
  EXPECT_NE(refused.find("io_uring_queue_init: "), std::string::npos) << refused;
  EXPECT_NE(refused.find("Invalid argument"), std::string::npos) << refused;
}

}  // namespace
}  // namespace hipferry::disk
