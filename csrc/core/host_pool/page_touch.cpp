#include "csrc/core/host_pool/page_touch.h"

#include <system_error>
#include <vector>

namespace hipferry::pool {

std::thread spawn_std_thread(std::function<void()> work) { return std::thread(std::move(work)); }

void run_pieces(std::size_t pieces, const std::function<void(std::size_t)>& work, const SpawnThread& spawn) {
  std::vector<std::thread> workers;
  std::vector<std::size_t> on_caller;  // pieces without a thread of their own
  for (std::size_t i = 1; i < pieces; ++i) {
    try {
      workers.push_back(spawn([&work, i] { work(i); }));
    } catch (const std::system_error&) {  // no more threads: the caller does the rest
      for (std::size_t j = i; j < pieces; ++j) on_caller.push_back(j);
      break;
    }
  }
  if (pieces > 0) work(0);
  for (std::size_t i : on_caller) work(i);
  for (auto& w : workers) w.join();
}

void touch_pages(char* p, std::size_t bytes, int threads, const SpawnThread& spawn) {
  constexpr std::size_t kPage = 4096;
  const std::size_t pages = bytes / kPage;
  const std::size_t n = threads > 1 ? static_cast<std::size_t>(threads) : 1;
  run_pieces(
      n,
      [&](std::size_t i) {
        for (std::size_t page = pages * i / n; page < pages * (i + 1) / n; ++page) p[page * kPage] = 0;
      },
      spawn);
}

}  // namespace hipferry::pool
