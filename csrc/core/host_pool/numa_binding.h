// Placing host pages on a NUMA node (Linux mbind / get_mempolicy, through
// raw system calls: no libnuma needed at build or run time).
//
// bind_to_node() must run before the pages are first touched (pinning
// touches them): a page is placed when it is first faulted in.
#pragma once

#include <cstddef>

namespace hipferry::pool {

// Places the pages of [p, p + bytes) on `node` (MPOL_BIND). `p` must be page
// aligned. Throws std::system_error (with the reason) when the kernel refuses,
// e.g. for a node that does not exist.
void bind_to_node(void* p, std::size_t bytes, int node);

// The node holding the (touched) page at `p`; -1 when the kernel cannot say.
int node_of_address(const void* p);

// For its lifetime, memory the calling thread faults in comes from `node`
// (set_mempolicy MPOL_BIND); the thread's previous policy comes back after.
// For allocators that touch pages themselves (hipHostMalloc with its NUMA-user
// flag follows the caller's policy). Throws std::system_error like bind_to_node.
class ScopedThreadNodePolicy {
 public:
  explicit ScopedThreadNodePolicy(int node);
  ~ScopedThreadNodePolicy();
  ScopedThreadNodePolicy(const ScopedThreadNodePolicy&) = delete;
  ScopedThreadNodePolicy& operator=(const ScopedThreadNodePolicy&) = delete;

 private:
  int old_mode_ = 0;
  unsigned long old_mask_[16] = {};  // 1024 nodes
};

}  // namespace hipferry::pool
