// The pinned pool's NUMA placement (Note [hipferry pinned pool]) on a fake
// topology: the provider records the node each segment was asked for (this
// machine has one node), so a pool that hands one node's pages to another
// node's device, or shares free lists across nodes, is caught.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/core/host_pool/host_pool.h"
#include "csrc/core/host_pool/numa_binding.h"
#include "tests/cpp/fake_host_memory.h"
#include "tests/cpp/host_pool_fixture.h"

namespace hipferry::pool {
namespace {

using testing::Fixture;
using testing::KiB;
using testing::MiB;
using testing::small_options;

// Two GPUs on two sockets (device 0 on node 1, device 1 on node 0, as on
// machines whose GPUs are not numbered by socket); host-only requests from node 0.
PoolOptions two_socket_options() {
  PoolOptions o = small_options();
  o.numa_node = 0;
  o.device_nodes = {1, 0};
  return o;
}

int node_of(const Fixture& f, const HostPool::Allocation& a) { return f.mem->segment_of(a.host)->numa_node; }

TEST(HostPoolNuma, EachDevicesMemoryComesFromItsNode) {
  Fixture f(two_socket_options());
  EXPECT_EQ(f.pool->node_of_device(0), 1);
  EXPECT_EQ(f.pool->node_of_device(1), 0);
  EXPECT_EQ(f.pool->node_of_device(-1), 0);
  EXPECT_EQ(f.pool->node_of_device(7), 0) << "a device beyond device_nodes falls back to numa_node";
  for (std::size_t bytes : {std::size_t{100}, 100 * KiB, 3 * MiB}) {  // small, medium, own segment
    SCOPED_TRACE(bytes);
    const auto d0 = f.pool->allocate(bytes, 0);
    const auto d1 = f.pool->allocate(bytes, 1);
    const auto host = f.pool->allocate(bytes);
    EXPECT_EQ(node_of(f, d0), 1);
    EXPECT_EQ(node_of(f, d1), 0);
    EXPECT_EQ(node_of(f, host), 0);
    EXPECT_EQ(f.pool->node_of_block(d0.host), 1);
    EXPECT_EQ(f.pool->node_of_block(d1.host), 0);
    for (const auto& a : {d0, d1, host}) f.pool->deallocate(a.host);
  }
  f.pool->check_invariants();
}

TEST(HostPoolNuma, FreeListsArePerNode) {
  Fixture f(two_socket_options());
  const auto first = f.pool->allocate(1000, 0);  // node 1
  f.pool->deallocate(first.host);
  const std::uint64_t allocs = f.mem->allocs();
  // Node 1's cached block does not serve node 0, however well it fits.
  const auto other = f.pool->allocate(1000, 1);
  EXPECT_NE(other.host, first.host);
  EXPECT_EQ(node_of(f, other), 0);
  EXPECT_EQ(f.mem->allocs(), allocs + 1) << "node 0 needed a segment of its own";
  // ...and still serves node 1.
  const auto again = f.pool->allocate(1000, 0);
  EXPECT_EQ(again.host, first.host);
  EXPECT_EQ(f.mem->allocs(), allocs + 1);
  const PoolStats s = f.stats();
  EXPECT_EQ(s.reserved_by_node, (std::map<int, std::size_t>{{0, 64 * KiB}, {1, 64 * KiB}}));
  f.pool->deallocate(other.host);
  f.pool->deallocate(again.host);
  f.pool->trim();
  EXPECT_TRUE(f.stats().reserved_by_node.empty());
  f.pool->check_invariants();
}

TEST(HostPoolNuma, TheReserveLivesOnTheHostNodeAndServesEveryNode) {
  PoolOptions o = two_socket_options();
  o.reserve_bytes = 4 * MiB;
  Fixture f(o);
  ASSERT_EQ(f.mem->allocs(), 1u);
  const std::uintptr_t reserve = f.mem->segment_hosts().at(0);
  EXPECT_EQ(f.mem->segment_of(reinterpret_cast<void*>(reserve))->numa_node, 0);
  // Medium requests for device 0 (node 1): the reserve serves them before the pool grows.
  const auto a = f.pool->allocate(100 * KiB, 0);
  const auto b = f.pool->allocate(1000, 0);
  EXPECT_EQ(f.mem->segment_of(a.host)->host, reserve);
  EXPECT_EQ(f.mem->segment_of(b.host)->host, reserve);
  EXPECT_EQ(f.mem->allocs(), 1u);
  f.pool->deallocate(a.host);
  f.pool->deallocate(b.host);
  f.pool->check_invariants();
}

TEST(HostPoolNuma, TheGrowthBoundGivesBackOtherNodesCachedSegments) {
  // Churn that moves from one device to the other: what one node cached
  // cannot serve the other, so without giving it back the pool would double.
  PoolOptions o = two_socket_options();
  o.growth_keep_bytes = 0;
  Fixture f(o);
  for (int round = 0; round < 6; ++round) {
    std::vector<HostPool::Allocation> live;
    for (int i = 0; i < 8; ++i) live.push_back(f.pool->allocate(3 * MiB, round % 2));
    for (const auto& a : live) EXPECT_EQ(node_of(f, a), round % 2 == 0 ? 1 : 0);
    for (const auto& a : live) f.pool->deallocate(a.host);
    const PoolStats s = f.stats();
    EXPECT_LE(s.peak_reserved_bytes, 1.25 * s.peak_requested_bytes) << "round " << round;
  }
  EXPECT_GT(f.stats().growth_releases, 0u);
  f.pool->check_invariants();
}

TEST(HostPoolNuma, BadNodesAndForeignPointersAreRefused) {
  PoolOptions bad_default = small_options();
  bad_default.numa_node = -2;
  EXPECT_THROW(Fixture{bad_default}, PoolError);
  PoolOptions bad_device = small_options();
  bad_device.device_nodes = {0, -5};
  try {
    Fixture f(bad_device);
    FAIL() << "device_nodes of -5 accepted";
  } catch (const PoolError& e) {
    EXPECT_NE(std::string(e.what()).find("device_nodes"), std::string::npos) << e.what();
  }
  Fixture f(two_socket_options());
  int x = 0;
  EXPECT_THROW(f.pool->node_of_block(&x), PoolError);
  const auto a = f.pool->allocate(1000, 0);
  f.pool->deallocate(a.host);
  EXPECT_THROW(f.pool->node_of_block(a.host), PoolError) << "a freed block has no node to report";
}

// The real provider and the real kernel: pages of a pool bound to this
// machine's node 0 land there when first touched.
TEST(HostPoolNuma, AlignedMemoryOnNodeZeroLandsThere) {
  PoolOptions o;
  o.numa_node = 0;
  HostPool pool(std::make_unique<AlignedHostMemoryProvider>(), std::make_unique<CompletedEventSource>(), o);
  HostPool::Allocation a;
  try {
    a = pool.allocate(4 * MiB);
  } catch (const PoolError& e) {
    GTEST_SKIP() << "mbind not permitted here: " << e.what();  // (seccomp in some containers)
  }
  static_cast<volatile char*>(a.host)[0] = 1;
  const int node = node_of_address(a.host);
  if (node < 0) GTEST_SKIP() << "the kernel cannot say which node a page is on";
  EXPECT_EQ(node, 0);
  EXPECT_EQ(pool.node_of_block(a.host), 0);
  pool.deallocate(a.host);
}

}  // namespace
}  // namespace hipferry::pool
