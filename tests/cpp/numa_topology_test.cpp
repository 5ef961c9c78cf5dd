// NUMA topology from fake sysfs trees (this machine has one node).
#include <gtest/gtest.h>

#include <unistd.h>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include "csrc/core/host_pool/numa_binding.h"
#include "csrc/core/host_pool/numa_topology.h"

namespace hipferry::pool {
namespace {

namespace fs = std::filesystem;

class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("hipferry-sysfs-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string root() const { return root_.string(); }
  fs::path root_;
};

TEST(NumaNodeList, ParsesKernelLists) {
  EXPECT_EQ(parse_node_list("0"), (std::vector<int>{0}));
  EXPECT_EQ(parse_node_list("0-1"), (std::vector<int>{0, 1}));
  EXPECT_EQ(parse_node_list("0,2-3"), (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(parse_node_list("3,1,1"), (std::vector<int>{1, 3}));
  for (const char* bad : {"", "a", "1-", "-1", "3-1", "0,,1", "0-99999"}) {
    EXPECT_THROW(parse_node_list(bad), std::invalid_argument) << bad;
  }
}

TEST_F(FakeSysfs, TwoSocketMachine) {
  write("devices/system/node/online", "0-1\n");
  write("bus/pci/devices/0000:17:00.0/numa_node", "0\n");
  write("bus/pci/devices/0000:ca:00.0/numa_node", "1\n");
  const NumaTopology t = NumaTopology::read(root());
  EXPECT_EQ(t.nodes, (std::vector<int>{0, 1}));
  EXPECT_TRUE(t.multi_node());
  EXPECT_EQ(NumaTopology::node_of_pci_device("0000:17:00.0", root()), 0);
  EXPECT_EQ(NumaTopology::node_of_pci_device("0000:CA:00.0", root()), 1) << "runtimes print upper case";
}

TEST_F(FakeSysfs, EachDeviceGetsItsOwnNodeOnlyWhereThereIsAChoice) {
  write("devices/system/node/online", "0-1\n");
  write("bus/pci/devices/0000:17:00.0/numa_node", "0\n");
  write("bus/pci/devices/0000:ca:00.0/numa_node", "1\n");
  write("bus/pci/devices/0000:cb:00.0/numa_node", "-1\n");
  write("bus/pci/devices/0000:cc:00.0/numa_node", "3\n");  // a node that is not online
  const NumaTopology two = NumaTopology::read(root());
  EXPECT_EQ(two.device_nodes({"0000:CA:00.0", "0000:17:00.0", "0000:cb:00.0", "0000:cc:00.0", ""}, root()),
            (std::vector<int>{1, 0, -1, -1, -1}));
  write("devices/system/node/online", "0\n");  // one node: nothing to bind
  const NumaTopology one = NumaTopology::read(root());
  EXPECT_EQ(one.device_nodes({"0000:17:00.0", "0000:ca:00.0"}, root()), (std::vector<int>{-1, -1}));
}

TEST_F(FakeSysfs, UnknownOrUnreadableIsMinusOneOrOneNode) {
  write("bus/pci/devices/0000:01:00.0/numa_node", "-1\n");  // firmware does not say
  write("bus/pci/devices/0000:02:00.0/numa_node", "garbage\n");
  EXPECT_EQ(NumaTopology::node_of_pci_device("0000:01:00.0", root()), -1);
  EXPECT_EQ(NumaTopology::node_of_pci_device("0000:02:00.0", root()), -1);
  EXPECT_EQ(NumaTopology::node_of_pci_device("0000:03:00.0", root()), -1);  // no such device
  EXPECT_EQ(NumaTopology::node_of_pci_device("../../etc", root()), -1);
  const NumaTopology t = NumaTopology::read(root());  // no node directory at all
  EXPECT_EQ(t.nodes, (std::vector<int>{0}));
  EXPECT_FALSE(t.multi_node());
}

TEST(NumaTopologyHere, ThisMachineReadsWithoutError) {
  const NumaTopology t = NumaTopology::read();
  EXPECT_FALSE(t.nodes.empty());
}

// Binding works here on the one node this machine has, and a node that does
// not exist is refused with the kernel's reason.
TEST(NumaBinding, PagesLandOnTheBoundNodeAndABadNodeIsRefused) {
  const std::size_t bytes = std::size_t{4} << 20;
  void* p = std::aligned_alloc(4096, bytes);
  ASSERT_NE(p, nullptr);
  const NumaTopology t = NumaTopology::read();
  try {
    bind_to_node(p, bytes, t.nodes.front());
  } catch (const std::system_error& e) {
    std::free(p);
    GTEST_SKIP() << "mbind not permitted here: " << e.what();  // (seccomp in some containers)
  }
  static_cast<char*>(p)[0] = 1;  // first touch: placed now
  static_cast<char*>(p)[bytes - 1] = 1;
  const int node = node_of_address(p);
  if (node >= 0) EXPECT_EQ(node, t.nodes.front());
  EXPECT_THROW(bind_to_node(p, bytes, t.nodes.back() + 7), std::system_error);
  EXPECT_THROW(bind_to_node(p, bytes, -1), std::system_error);
  std::free(p);
}

TEST(NumaBinding, AThreadPolicyPlacesWhatTheThreadTouchesAndIsUndoneAfter) {
  const NumaTopology t = NumaTopology::read();
  const std::size_t bytes = std::size_t{2} << 20;
  void* p = std::aligned_alloc(4096, bytes);
  ASSERT_NE(p, nullptr);
  try {
    ScopedThreadNodePolicy on_node(t.nodes.front());
    static_cast<char*>(p)[0] = 1;
    const int node = node_of_address(p);
    if (node >= 0) EXPECT_EQ(node, t.nodes.front());
  } catch (const std::system_error& e) {
    std::free(p);
    GTEST_SKIP() << "set_mempolicy not permitted here: " << e.what();
  }
  EXPECT_THROW(ScopedThreadNodePolicy(-3), std::system_error);
  std::free(p);
}

}  // namespace
}  // namespace hipferry::pool
