// Which NUMA node a GPU sits on, and which nodes the host has, from sysfs.
//
// Pinned pages on the wrong node cost: reusing them cost about 30% in
// PyTorch's pinned cache (pytorch#197868), and a GB200 link reached about
// 350 GB/s with NUMA binding and about 120 GB/s without (torchtitan#3489).
// The pool asks this where a device's memory should come from. The sysfs root
// is an argument, so tests read fake trees (this machine has one node).
#pragma once

#include <string>
#include <vector>

namespace hipferry::pool {

struct NumaTopology {
  std::vector<int> nodes;  // online nodes, ascending ({0} when sysfs says nothing)

  // Reads <sysfs_root>/devices/system/node/online ("0", "0-1", "0,2-3").
  static NumaTopology read(const std::string& sysfs_root = "/sys");

  bool multi_node() const { return nodes.size() > 1; }
  // The node of the PCI device `pci_bus_id` ("0000:65:00.0", any case), from
  // <sysfs_root>/bus/pci/devices/<id>/numa_node; -1 when unknown (no such
  // device, or the firmware does not say).
  static int node_of_pci_device(const std::string& pci_bus_id, const std::string& sysfs_root = "/sys");

  // The node whose pages a pinned pool should give each device (by its PCI
  // address): its own node on a machine of several nodes; -1 (no binding)
  // on one node, for a device whose node is unknown, or one on a node that
  // is not online.
  std::vector<int> device_nodes(const std::vector<std::string>& pci_bus_ids,
                                const std::string& sysfs_root = "/sys") const;
};

// "0,2-3" -> {0, 2, 3}. Throws std::invalid_argument on anything else.
std::vector<int> parse_node_list(const std::string& text);

}  // namespace hipferry::pool
