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

}  // namespace hipferry::pool
