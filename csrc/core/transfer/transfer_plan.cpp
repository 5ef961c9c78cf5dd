// Transfer planning (see transfer_plan.h).
#include "csrc/core/transfer/transfer_plan.h"

#include <stdexcept>
#include <string>

namespace hipferry::transfer {
namespace {

std::size_t round_up(std::size_t n, std::size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

std::size_t gcd(std::size_t a, std::size_t b) {
  while (b != 0) {
    const std::size_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Elements per chunk: as many as fit in chunk_bytes, a multiple of the
// smallest element count whose byte size is a multiple of `alignment` (so
// every chunk but the last starts aligned), and at least one element.
std::size_t chunk_elements(const TransferItem& item, const PlanOptions& o) {
  const std::size_t fit = o.chunk_bytes / item.src_element_bytes;
  const std::size_t step = o.alignment / gcd(o.alignment, item.src_element_bytes);
  if (fit >= step) return fit / step * step;
  return fit > 0 ? fit : 1;
}

}  // namespace

TransferPlan plan_transfer(const std::vector<TransferItem>& items, const PlanOptions& o) {
  if (o.alignment == 0 || (o.alignment & (o.alignment - 1)) != 0) {
    throw std::invalid_argument("plan_transfer: alignment must be a power of two, got " + std::to_string(o.alignment));
  }
  if (o.pack_max_item_bytes > o.pack_max_batch_bytes) {
    throw std::invalid_argument("plan_transfer: pack_max_item_bytes must not exceed pack_max_batch_bytes");
  }
  TransferPlan plan;
  PackedBatch batch;
  const auto close_batch = [&] {
    if (!batch.slots.empty()) plan.batches.push_back(std::move(batch));
    batch = PackedBatch{};
  };
  for (std::size_t i = 0; i < items.size(); ++i) {
    const TransferItem& item = items[i];
    if (item.src_element_bytes == 0 || item.dst_element_bytes == 0) {
      throw std::invalid_argument("plan_transfer: item " + std::to_string(i) + " has an element size of 0 bytes");
    }
    if (item.elements == 0) continue;
    const std::size_t bytes = item.elements * item.src_element_bytes;
    if (bytes <= o.pack_max_item_bytes) {
      const std::size_t offset = round_up(batch.staging_bytes, o.alignment);
      if (!batch.slots.empty() && offset + bytes > o.pack_max_batch_bytes) close_batch();
      const std::size_t at = round_up(batch.staging_bytes, o.alignment);
      batch.slots.push_back({i, at, bytes});
      batch.staging_bytes = at + bytes;
      continue;
    }
    const std::size_t per_chunk = o.chunk_bytes == 0 ? item.elements : chunk_elements(item, o);
    for (std::size_t first = 0; first < item.elements; first += per_chunk) {
      const std::size_t n = item.elements - first < per_chunk ? item.elements - first : per_chunk;
      plan.chunks.push_back({i, first, n});
    }
  }
  close_batch();
  return plan;
}

}  // namespace hipferry::transfer
