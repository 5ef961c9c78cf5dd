// How one transfer call moves its tensors: small ones packed into shared
// staging buffers (one copy for many tensors, then a scatter), large ones cut
// into chunks (the first chunk's consumer can start early, and pageable
// sources stream through a bounded amount of pinned memory).
//
// Pure planning, no memory and no runtime: the transfer engine executes a
// plan; tests check that every element is moved exactly once.
#pragma once

#include <cstddef>
#include <vector>

namespace hipferry::transfer {

// One tensor to move: `elements` of `src_element_bytes` each, arriving as
// elements of `dst_element_bytes` (differs when the copy converts).
struct TransferItem {
  std::size_t elements = 0;
  std::size_t src_element_bytes = 0;
  std::size_t dst_element_bytes = 0;
};

struct PlanOptions {
  // Items whose source is at most this many bytes are packed together.
  std::size_t pack_max_item_bytes = std::size_t{256} << 10;
  // A packed batch holds at most this many source bytes (one item may exceed
  // it only if it is packable on its own, which pack_max_item_bytes prevents).
  std::size_t pack_max_batch_bytes = std::size_t{16} << 20;
  // Larger items are cut into chunks of at most this many source bytes
  // (0: never cut).
  std::size_t chunk_bytes = std::size_t{8} << 20;
  // Offsets in a staging buffer and chunk boundaries are multiples of this
  // many bytes (DMA and vector-load friendly) where element sizes allow.
  std::size_t alignment = 256;
};

// A packed item's place in its batch's staging buffer.
struct PackedSlot {
  std::size_t item = 0;            // index into the items
  std::size_t staging_offset = 0;  // bytes from the buffer start, a multiple of `alignment`
  std::size_t src_bytes = 0;
};

struct PackedBatch {
  std::vector<PackedSlot> slots;  // in item order
  std::size_t staging_bytes = 0;  // buffer size needed: the last slot's end
};

// A contiguous run of one unpacked item's elements.
struct Chunk {
  std::size_t item = 0;
  std::size_t first_element = 0;
  std::size_t elements = 0;
};

struct TransferPlan {
  std::vector<PackedBatch> batches;  // packed small items
  std::vector<Chunk> chunks;         // unpacked items, each item's chunks in order
};

// Throws std::invalid_argument for element sizes of 0 or options that are
// not usable (alignment not a power of two, batch smaller than an item).
// Items with 0 elements appear nowhere.
TransferPlan plan_transfer(const std::vector<TransferItem>& items, const PlanOptions& options = {});

}  // namespace hipferry::transfer
