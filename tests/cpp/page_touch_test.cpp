// Page touching on several threads when threads cannot be made: every piece
// runs exactly once, and nothing aborts (a joinable std::thread destroyed by
// a throwing emplace_back used to call std::terminate).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <system_error>
#include <vector>

#include "csrc/core/host_pool/page_touch.h"

namespace hipferry::pool {
namespace {

// Makes `allowed` real threads, then refuses as a pid limit would.
SpawnThread refusing_after(int allowed, std::atomic<int>& made) {
  return [allowed, &made](std::function<void()> work) {
    if (made.fetch_add(1) >= allowed) throw std::system_error(EAGAIN, std::generic_category(), "no threads");
    return std::thread(std::move(work));
  };
}

TEST(PageTouch, EveryPieceRunsOnceWhateverThreadsCanBeMade) {
  for (int allowed : {0, 1, 3, 100}) {
    SCOPED_TRACE(allowed);
    std::atomic<int> made{0};
    std::vector<std::atomic<int>> runs(16);
    run_pieces(
        runs.size(), [&](std::size_t i) { runs[i].fetch_add(1); }, refusing_after(allowed, made));
    for (std::size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << "piece " << i;
  }
}

TEST(PageTouch, TouchesEveryPageWhenNoThreadCanBeMade) {
  const std::size_t bytes = 64 * 4096 + 100;  // a partial page at the end is not a page
  char* p = static_cast<char*>(std::aligned_alloc(4096, 65 * 4096));
  for (std::size_t i = 0; i < 65 * 4096; ++i) p[i] = 1;
  std::atomic<int> made{0};
  touch_pages(p, bytes, 64, refusing_after(2, made));
  for (std::size_t page = 0; page < 64; ++page) EXPECT_EQ(p[page * 4096], 0) << "page " << page;
  EXPECT_EQ(p[64 * 4096], 1);
  EXPECT_EQ(made.load(), 3) << "two threads made, the third refused, no more asked";
  std::free(p);
}

TEST(PageTouch, RealThreads) {
  std::vector<char> buf(37 * 4096, 1);
  touch_pages(buf.data(), buf.size(), 8);
  for (std::size_t page = 0; page < 37; ++page) EXPECT_EQ(buf[page * 4096], 0) << "page " << page;
}

}  // namespace
}  // namespace hipferry::pool
