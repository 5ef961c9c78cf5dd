// Transfer planning: every element of every item is moved exactly once,
// packed slots are aligned and disjoint, batches and chunks respect their
// limits, for hand-picked and random item lists.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "csrc/core/transfer/transfer_plan.h"

namespace hipferry::transfer {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

// Checks the plan against the items and options; returns how many items were packed.
std::size_t check_plan(const std::vector<TransferItem>& items, const PlanOptions& o, const TransferPlan& plan) {
  std::vector<std::size_t> covered(items.size(), 0);  // elements covered per item
  std::vector<int> packed(items.size(), 0);
  std::size_t packed_items = 0;
  for (const PackedBatch& b : plan.batches) {
    EXPECT_FALSE(b.slots.empty());
    EXPECT_LE(b.staging_bytes, o.pack_max_batch_bytes);
    std::size_t end = 0;
    for (const PackedSlot& s : b.slots) {
      const TransferItem& it = items.at(s.item);
      EXPECT_EQ(s.src_bytes, it.elements * it.src_element_bytes);
      EXPECT_LE(s.src_bytes, o.pack_max_item_bytes);
      EXPECT_EQ(s.staging_offset % o.alignment, 0u) << "slot of item " << s.item;
      EXPECT_GE(s.staging_offset, end) << "slots overlap";
      end = s.staging_offset + s.src_bytes;
      covered[s.item] += it.elements;
      ++packed[s.item];
      ++packed_items;
    }
    EXPECT_EQ(b.staging_bytes, end);
  }
  std::vector<std::size_t> next(items.size(), 0);  // next expected first_element
  for (const Chunk& c : plan.chunks) {
    const TransferItem& it = items.at(c.item);
    EXPECT_EQ(packed[c.item], 0) << "item " << c.item << " both packed and chunked";
    EXPECT_EQ(c.first_element, next[c.item]) << "chunks out of order or with a gap";
    EXPECT_GT(c.elements, 0u);
    if (o.chunk_bytes != 0 && o.chunk_bytes >= it.src_element_bytes) {
      EXPECT_LE(c.elements * it.src_element_bytes, o.chunk_bytes);
    }
    // Inner boundaries are aligned whenever a chunk can hold an aligned run of elements.
    const std::size_t aligned_run = o.alignment / std::gcd(o.alignment, it.src_element_bytes) * it.src_element_bytes;
    if (c.first_element + c.elements < it.elements && o.chunk_bytes >= aligned_run) {
      EXPECT_EQ(c.elements * it.src_element_bytes % o.alignment, 0u) << "inner chunk boundary not aligned";
    }
    next[c.item] += c.elements;
    covered[c.item] += c.elements;
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    EXPECT_EQ(covered[i], items[i].elements) << "item " << i << " not covered exactly once";
    EXPECT_LE(packed[i], 1);
  }
  return packed_items;
}

TEST(TransferPlan, SmallItemsShareOneBatchLargeOnesAreChunked) {
  const std::vector<TransferItem> items = {{1000, 4, 2}, {3, 2, 2}, {(64 * MiB) / 4 + 5, 4, 2}, {0, 4, 4}, {77, 1, 1}};
  PlanOptions o;
  const TransferPlan plan = plan_transfer(items, o);
  ASSERT_EQ(plan.batches.size(), 1u);
  ASSERT_EQ(plan.batches[0].slots.size(), 3u);                // items 0, 1 and 4; item 3 is empty
  EXPECT_EQ(plan.batches[0].slots[1].staging_offset, 4096u);  // 4000 bytes, then aligned
  EXPECT_EQ(plan.chunks.size(), 9u);                          // 64 MiB + 20 bytes in 8 MiB chunks
  EXPECT_EQ(plan.chunks.back().elements, 5u);
  EXPECT_EQ(check_plan(items, o, plan), 3u);
}

TEST(TransferPlan, ThousandSmallTensorsFillBatchesUpToTheLimit) {
  const std::vector<TransferItem> items(1000, TransferItem{4096, 4, 4});  // 16 KiB each
  PlanOptions o;
  o.pack_max_batch_bytes = 1 * MiB;
  const TransferPlan plan = plan_transfer(items, o);
  EXPECT_EQ(plan.batches.size(), 16u);  // 64 per MiB
  EXPECT_TRUE(plan.chunks.empty());
  EXPECT_EQ(check_plan(items, o, plan), 1000u);
}

TEST(TransferPlan, ChunkBoundariesStayAlignedForOddElementSizes) {
  PlanOptions o;
  o.chunk_bytes = 1000;  // not a multiple of the alignment
  o.pack_max_item_bytes = 0;
  for (std::size_t elem : {1u, 2u, 3u, 4u, 6u, 8u, 12u}) {
    SCOPED_TRACE(elem);
    const std::vector<TransferItem> items = {{12345, elem, elem}};
    check_plan(items, o, plan_transfer(items, o));
  }
  o.chunk_bytes = 2;  // smaller than an element: one element per chunk
  const std::vector<TransferItem> items = {{5, 4, 4}};
  const TransferPlan plan = plan_transfer(items, o);
  EXPECT_EQ(plan.chunks.size(), 5u);
  check_plan(items, o, plan);
}

TEST(TransferPlan, ChunkBytesZeroMeansOneChunkPerItem) {
  PlanOptions o;
  o.chunk_bytes = 0;
  const std::vector<TransferItem> items = {{(100 * MiB) / 2, 2, 4}};
  const TransferPlan plan = plan_transfer(items, o);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].elements, items[0].elements);
}

TEST(TransferPlan, RandomItemListsAreCoveredExactlyOnce) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 300; ++round) {
    SCOPED_TRACE(round);
    PlanOptions o;
    o.alignment = std::size_t{1} << (rng() % 10);
    o.pack_max_item_bytes = rng() % (64 * KiB);
    o.pack_max_batch_bytes = o.pack_max_item_bytes + rng() % (256 * KiB);
    o.chunk_bytes = rng() % 4 == 0 ? 0 : 1 + rng() % (512 * KiB);
    std::vector<TransferItem> items(rng() % 40);
    const std::size_t sizes[] = {1, 2, 4, 8, 3};
    for (auto& it : items) {
      it.src_element_bytes = sizes[rng() % 5];
      it.dst_element_bytes = sizes[rng() % 5];
      it.elements = rng() % 3 == 0 ? rng() % 64 : rng() % (300 * KiB);
    }
    check_plan(items, o, plan_transfer(items, o));
  }
}

TEST(TransferPlan, BadInputIsRejected) {
  EXPECT_THROW(plan_transfer({{10, 0, 4}}), std::invalid_argument);
  EXPECT_THROW(plan_transfer({{10, 4, 0}}), std::invalid_argument);
  PlanOptions o;
  o.alignment = 48;
  EXPECT_THROW(plan_transfer({{10, 4, 4}}, o), std::invalid_argument);
  o = PlanOptions{};
  o.pack_max_item_bytes = o.pack_max_batch_bytes + 1;
  EXPECT_THROW(plan_transfer({{10, 4, 4}}, o), std::invalid_argument);
  EXPECT_TRUE(plan_transfer({}).batches.empty());
}

}  // namespace
}  // namespace hipferry::transfer
