#include "csrc/core/host_pool/numa_binding.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>

namespace hipferry::pool {
namespace {

constexpr int kMpolBind = 2;        // <linux/mempolicy.h> MPOL_BIND
constexpr unsigned kMpolFNode = 1;  // MPOL_F_NODE
constexpr unsigned kMpolFAddr = 2;  // MPOL_F_ADDR
constexpr unsigned long kMaxNodes = 1024;

}  // namespace

void bind_to_node(void* p, std::size_t bytes, int node) {
  if (node < 0 || static_cast<unsigned long>(node) >= kMaxNodes) {
    throw std::system_error(EINVAL, std::generic_category(), "bind_to_node: node " + std::to_string(node));
  }
  unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
  if (syscall(SYS_mbind, p, bytes, kMpolBind, mask, kMaxNodes + 1, 0) != 0) {
    throw std::system_error(errno, std::generic_category(), "mbind to NUMA node " + std::to_string(node));
  }
}

ScopedThreadNodePolicy::ScopedThreadNodePolicy(int node) {
  if (node < 0 || static_cast<unsigned long>(node) >= kMaxNodes) {
    throw std::system_error(EINVAL, std::generic_category(), "thread NUMA policy: node " + std::to_string(node));
  }
  if (syscall(SYS_get_mempolicy, &old_mode_, old_mask_, kMaxNodes, nullptr, 0) != 0) {
    throw std::system_error(errno, std::generic_category(), "get_mempolicy");
  }
  unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
  if (syscall(SYS_set_mempolicy, kMpolBind, mask, kMaxNodes + 1) != 0) {
    throw std::system_error(errno, std::generic_category(), "set_mempolicy to NUMA node " + std::to_string(node));
  }
}

ScopedThreadNodePolicy::~ScopedThreadNodePolicy() {
  syscall(SYS_set_mempolicy, old_mode_, old_mode_ == 0 ? nullptr : old_mask_, kMaxNodes + 1);
}

int node_of_address(const void* p) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0, const_cast<void*>(p), kMpolFNode | kMpolFAddr) != 0) return -1;
  return node;
}

}  // namespace hipferry::pool
