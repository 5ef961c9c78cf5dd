// The batched copy kernel (many small copies and conversions in one launch)
// against the CPU reference: on the CPU-only build in place, on a GPU with
// sources in device memory and in mapped pinned host memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "csrc/core/copy_cast_cpu.h"
#include "hip/batched_copy_kernel.h"
#include "hip/runtime.h"

namespace hipferry {
namespace {

// Jobs of every kind: byte copies (16-byte aligned and not), all 9
// conversions, empty jobs, sizes that straddle the kernel's tiles.
struct Case {
  std::vector<std::vector<unsigned char>> src;  // host source bytes per job
  std::vector<gpu::CopyJobSpec> jobs;           // src/dst filled in by the test
  std::vector<std::size_t> dst_bytes;
  std::vector<std::size_t> src_offset;  // misalignment of the job's source
};

Case make_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Case c;
  const ElementType types[] = {ElementType::kFloat32, ElementType::kFloat16, ElementType::kBFloat16};
  const std::int64_t sizes[] = {0, 1, 15, 16, 4095, 4096, 4097, 70001};
  for (std::int64_t n : sizes) {
    for (int kind = 0; kind < 11; ++kind) {
      gpu::CopyJobSpec j;
      std::size_t src_bytes;
      if (kind < 2) {  // bytes; kind 1 is deliberately misaligned by 3
        j.count = n;
        src_bytes = static_cast<std::size_t>(n);
        c.src_offset.push_back(kind == 1 ? 3 : 0);
        c.dst_bytes.push_back(static_cast<std::size_t>(n));
      } else {
        j.convert = true;
        j.src_type = types[(kind - 2) / 3];
        j.dst_type = types[(kind - 2) % 3];
        j.count = n;
        src_bytes = static_cast<std::size_t>(n) * element_size(j.src_type);
        c.src_offset.push_back(0);
        c.dst_bytes.push_back(static_cast<std::size_t>(n) * element_size(j.dst_type));
      }
      std::vector<unsigned char> bytes(src_bytes + 3);
      for (auto& b : bytes) b = static_cast<unsigned char>(rng());
      c.src.push_back(std::move(bytes));
      c.jobs.push_back(j);
    }
  }
  return c;
}

std::vector<unsigned char> reference(const Case& c, std::size_t k) {
  std::vector<unsigned char> out(c.dst_bytes[k]);
  const gpu::CopyJobSpec& j = c.jobs[k];
  const unsigned char* src = c.src[k].data() + c.src_offset[k];
  if (j.convert) {
    copy_cast_cpu(src, j.src_type, out.data(), j.dst_type, 0, j.count);
  } else if (!out.empty()) {
    std::memcpy(out.data(), src, out.size());
  }
  return out;
}

TEST(BatchedCopy, CpuBuildRunsEveryJobInPlace) {
  if (rt::build_info().platform != "cpu") GTEST_SKIP() << "GPU build: see BatchedCopyGpu";
  Case c = make_case(1);
  std::vector<std::vector<unsigned char>> dst(c.jobs.size());
  for (std::size_t k = 0; k < c.jobs.size(); ++k) {
    dst[k].assign(c.dst_bytes[k] + 1, 0xAB);  // one sentinel byte after the end
    c.jobs[k].src = c.src[k].data() + c.src_offset[k];
    c.jobs[k].dst = dst[k].data();
  }
  gpu::launch_batched_copy(c.jobs.data(), c.jobs.size(), nullptr, nullptr, nullptr, 0);
  for (std::size_t k = 0; k < c.jobs.size(); ++k) {
    const auto want = reference(c, k);
    ASSERT_TRUE(std::equal(want.begin(), want.end(), dst[k].begin())) << "job " << k;
    ASSERT_EQ(dst[k].back(), 0xAB) << "job " << k << " wrote past its end";
  }
}

TEST(BatchedCopy, NegativeCountIsRejectedBeforeAnyJobRuns) {
  if (rt::build_info().platform != "cpu" && rt::device_count() == 0) GTEST_SKIP() << "GPU build without a GPU";
  unsigned char src[4] = {1, 2, 3, 4}, dst[4] = {0, 0, 0, 0};
  std::vector<unsigned char> table(gpu::batched_copy_table_bytes(2));
  gpu::CopyJobSpec jobs[2];
  jobs[0].src = src;
  jobs[0].dst = dst;
  jobs[0].count = 4;
  jobs[1] = jobs[0];
  jobs[1].count = -1;
  EXPECT_THROW(gpu::launch_batched_copy(jobs, 2, table.data(), table.data(), nullptr, 0), std::invalid_argument);
  EXPECT_EQ(dst[0], 0);
}

TEST(BatchedCopyGpu, OneLaunchMatchesTheCpuReference) {
  if (rt::device_count() == 0) GTEST_SKIP() << "no GPU device";
  rt::set_device(0);
  Case c = make_case(2);
  // Sources: even jobs in device memory, odd jobs read from mapped pinned host memory.
  std::vector<void*> device_buffers, host_buffers;
  std::vector<void*> dst(c.jobs.size());
  for (std::size_t k = 0; k < c.jobs.size(); ++k) {
    const std::size_t n = c.src[k].size();
    if (k % 2 == 0) {
      void* d = rt::device_alloc(n, 0);
      rt::memcpy_sync(d, c.src[k].data(), n);
      device_buffers.push_back(d);
      c.jobs[k].src = static_cast<unsigned char*>(d) + c.src_offset[k];
    } else {
      void* h = rt::host_alloc(n, rt::kHostPortable | rt::kHostMapped);
      std::memcpy(h, c.src[k].data(), n);
      host_buffers.push_back(h);
      c.jobs[k].src = static_cast<unsigned char*>(rt::host_device_pointer(h)) + c.src_offset[k];
    }
    dst[k] = rt::device_alloc(c.dst_bytes[k] + 1, 0);
    device_buffers.push_back(dst[k]);
    c.jobs[k].dst = dst[k];
  }
  void* table = rt::host_alloc(gpu::batched_copy_table_bytes(c.jobs.size()), rt::kHostPortable | rt::kHostMapped);
  rt::Stream stream(0);
  gpu::launch_batched_copy(c.jobs.data(), c.jobs.size(), table, rt::host_device_pointer(table), stream.handle(), 0);
  stream.synchronize();
  for (std::size_t k = 0; k < c.jobs.size(); ++k) {
    const auto want = reference(c, k);
    std::vector<unsigned char> got(want.size());
    if (!got.empty()) rt::memcpy_sync(got.data(), dst[k], got.size());
    ASSERT_EQ(got, want) << "job " << k;
  }
  rt::host_free(table);
  for (void* p : host_buffers) rt::host_free(p);
  for (void* p : device_buffers) rt::device_free(p, 0);
}

}  // namespace
}  // namespace hipferry
