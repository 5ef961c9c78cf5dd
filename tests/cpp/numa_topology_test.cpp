// NUMA topology from fake sysfs trees (this machine has one node).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <unistd.h>

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

}  // namespace
}  // namespace hipferry::pool
