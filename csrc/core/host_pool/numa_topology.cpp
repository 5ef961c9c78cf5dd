#include "csrc/core/host_pool/numa_topology.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace hipferry::pool {
namespace {

bool read_line(const std::string& path, std::string& out) {
  std::ifstream f(path);
  if (!f) return false;
  std::getline(f, out);
  while (!out.empty() && std::isspace(static_cast<unsigned char>(out.back()))) out.pop_back();
  return true;
}

int parse_int(const std::string& s) {
  if (s.empty() || s.size() > 6 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
    throw std::invalid_argument("not a node number: '" + s + "'");
  return std::stoi(s);
}

}  // namespace

std::vector<int> parse_node_list(const std::string& text) {
  std::vector<int> nodes;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    const auto dash = part.find('-');
    if (dash == std::string::npos) {
      nodes.push_back(parse_int(part));
      continue;
    }
    const int lo = parse_int(part.substr(0, dash)), hi = parse_int(part.substr(dash + 1));
    if (hi < lo || hi - lo > 4096) throw std::invalid_argument("bad node range: '" + part + "'");
    for (int n = lo; n <= hi; ++n) nodes.push_back(n);
  }
  if (nodes.empty()) throw std::invalid_argument("empty node list");
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  return nodes;
}

NumaTopology NumaTopology::read(const std::string& sysfs_root) {
  NumaTopology t;
  std::string line;
  if (read_line(sysfs_root + "/devices/system/node/online", line)) {
    try {
      t.nodes = parse_node_list(line);
    } catch (const std::invalid_argument&) {  // unreadable: as if the kernel had no NUMA
    }
  }
  if (t.nodes.empty()) t.nodes = {0};
  return t;
}

int NumaTopology::node_of_pci_device(const std::string& pci_bus_id, const std::string& sysfs_root) {
  std::string id = pci_bus_id;
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return std::tolower(c); });
  if (id.empty() || id.find('/') != std::string::npos) return -1;
  std::string line;
  if (!read_line(sysfs_root + "/bus/pci/devices/" + id + "/numa_node", line)) return -1;
  try {
    return line == "-1" ? -1 : parse_int(line);
  } catch (const std::invalid_argument&) {
    return -1;
  }
}

std::vector<int> NumaTopology::device_nodes(const std::vector<std::string>& pci_bus_ids,
                                            const std::string& sysfs_root) const {
  std::vector<int> out(pci_bus_ids.size(), -1);
  if (!multi_node()) return out;  // nothing to choose between
  for (std::size_t d = 0; d < pci_bus_ids.size(); ++d) {
    const int node = node_of_pci_device(pci_bus_ids[d], sysfs_root);
    if (std::binary_search(nodes.begin(), nodes.end(), node)) out[d] = node;
  }
  return out;
}

}  // namespace hipferry::pool
