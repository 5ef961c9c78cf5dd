// Faulting in a new segment's pages on several threads (the driver's own
// page-in is single-threaded; PyTorch's pinned_num_register_threads does the
// same), without ever aborting when threads cannot be made.
#pragma once

#include <cstddef>
#include <functional>
#include <thread>

namespace hipferry::pool {

// Makes a thread running `work`; throws std::system_error when none can be
// made (a ulimit, a container's pid limit). Replaceable so tests can refuse.
using SpawnThread = std::function<std::thread(std::function<void()> work)>;
std::thread spawn_std_thread(std::function<void()> work);

// Runs work(i) once for every i in [0, pieces): piece 0 on the caller, the
// others on threads from `spawn`; a piece whose thread could not be made runs
// on the caller too. Returns after every piece has run (all threads joined):
// a failed spawn never leaves a joinable std::thread to be destroyed, which
// would call std::terminate.
void run_pieces(std::size_t pieces, const std::function<void(std::size_t)>& work,
                const SpawnThread& spawn = spawn_std_thread);

// Writes one byte of each 4 KiB page of [p, p + bytes) on up to `threads` threads.
void touch_pages(char* p, std::size_t bytes, int threads, const SpawnThread& spawn = spawn_std_thread);

}  // namespace hipferry::pool
