// The runtime layer against whichever implementation this build links: the
// CPU-only one, or HIP/CUDA. Without a GPU, GPU builds must report "no device"
// through device_count() and clear errors, never crash. With a GPU, every
// kernel result is checked against the CPU reference.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "csrc/core/copy_cast_cpu.h"
#include "hip/copy_cast_kernel.h"
#include "hip/gpu_stream.h"
#include "hip/runtime.h"

namespace hipferry {
namespace {

bool have_gpu() { return rt::device_count() > 0; }

TEST(Runtime, BuildInfoNamesThePlatform) {
  const rt::BuildInfo b = rt::build_info();
  EXPECT_TRUE(b.platform == "cpu" || b.platform == "rocm" || b.platform == "cuda") << b.platform;
  if (b.platform == "cpu") {
    EXPECT_EQ(b.architectures, "");
  } else {
    EXPECT_FALSE(b.architectures.empty());
    EXPECT_GT(b.runtime_version, 0);
  }
}

TEST(Runtime, NoDeviceIsReportedNotFatal) {
  if (have_gpu()) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(rt::device_count(), 0);
  try {
    rt::Stream s(0);
    FAIL() << "creating a stream without a device must throw";
  } catch (const rt::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("device 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("hipferry"), std::string::npos) << msg;
  }
  EXPECT_THROW(rt::device_info(0), rt::Error);
  EXPECT_THROW(rt::device_alloc(16, 0), rt::Error);
}

TEST(Runtime, CpuBuildHostMemoryIsUsable) {
  if (rt::build_info().platform != "cpu") GTEST_SKIP() << "GPU build";
  void* p = rt::host_alloc(10000, rt::kHostMapped);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 4096, 0u);
  std::memset(p, 1, 10000);
  EXPECT_EQ(rt::host_device_pointer(p), p);
  EXPECT_EQ(rt::host_device_pointer_or_null(p), p);
  char back[16];
  rt::memcpy_async(back, p, 16, nullptr);
  EXPECT_EQ(back[15], 1);
  rt::host_free(p);
}

class GpuRuntime : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no GPU device";
    rt::set_device(0);
  }
};

TEST_F(GpuRuntime, DeviceInfoIsFilledIn) {
  const rt::DeviceInfo d = rt::device_info(0);
  EXPECT_FALSE(d.name.empty());
  EXPECT_FALSE(d.arch.empty());
  EXPECT_GT(d.total_memory, 0u);
  EXPECT_GT(d.multiprocessors, 0);
}

TEST_F(GpuRuntime, ErrorsNameTheCall) {
  try {
    rt::set_device(rt::device_count() + 5);
    FAIL();
  } catch (const rt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hipSetDevice"), std::string::npos) << e.what();
  }
  rt::set_device(0);
}

TEST_F(GpuRuntime, CopyCastKernelMatchesCpuReferenceOnDeviceAndMappedMemory) {
  const ElementType types[] = {ElementType::kFloat32, ElementType::kFloat16, ElementType::kBFloat16};
  const std::int64_t n = (1 << 20) + 3;
  std::mt19937 gen(1);
  std::vector<unsigned char> src(n * 4);
  for (auto& b : src) b = static_cast<unsigned char>(gen());
  rt::Stream stream(0);
  for (ElementType from : types) {
    for (ElementType to : types) {
      const std::size_t in_bytes = n * element_size(from), out_bytes = n * element_size(to);
      std::vector<unsigned char> want(out_bytes), got(out_bytes);
      copy_cast_cpu(src.data(), from, want.data(), to, 0, n);
      // device -> device
      void* d_src = rt::device_alloc(in_bytes, 0);
      void* d_dst = rt::device_alloc(out_bytes, 0);
      rt::memcpy_sync(d_src, src.data(), in_bytes);
      gpu::launch_copy_cast(d_src, from, d_dst, to, n, stream.handle(), 0);
      stream.synchronize();
      rt::memcpy_sync(got.data(), d_dst, out_bytes);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), out_bytes), 0)
          << element_type_name(from) << "->" << element_type_name(to) << " device->device";
      // mapped pinned host -> device, read where it lies
      void* h_src = rt::host_alloc(in_bytes, rt::kHostMapped | rt::kHostPortable);
      std::memcpy(h_src, src.data(), in_bytes);
      gpu::launch_copy_cast(rt::host_device_pointer(h_src), from, d_dst, to, n, stream.handle(), 0);
      stream.synchronize();
      rt::memcpy_sync(got.data(), d_dst, out_bytes);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), out_bytes), 0)
          << element_type_name(from) << "->" << element_type_name(to) << " mapped host->device";
      rt::host_free(h_src);
      rt::device_free(d_src, 0);
      rt::device_free(d_dst, 0);
    }
  }
}

TEST_F(GpuRuntime, EventsOrderAndTime) {
  rt::Stream stream(0);
  rt::Event start(0, true), end(0, true);
  const std::size_t bytes = 64 << 20;
  void* d = rt::device_alloc(bytes, 0);
  void* h = rt::host_alloc(bytes, rt::kHostMapped);
  start.record(stream.handle());
  rt::memcpy_async(d, h, bytes, stream.handle());
  end.record(stream.handle());
  end.synchronize();
  EXPECT_TRUE(end.query());
  EXPECT_TRUE(stream.query());
  EXPECT_GT(rt::Event::elapsed_ms(start, end), 0.f);
  rt::host_free(h);
  rt::device_free(d, 0);
}

TEST_F(GpuRuntime, RegisteredMemoryHasADevicePointer) {
  const std::size_t bytes = 1 << 20;
  void* p = std::aligned_alloc(4096, bytes);
  rt::host_register(p, bytes, rt::kHostMapped | rt::kHostPortable);
  EXPECT_NE(rt::host_device_pointer(p), nullptr);
  EXPECT_EQ(rt::host_device_pointer_or_null(p), rt::host_device_pointer(p));
  rt::host_unregister(p);
  std::free(p);
}

TEST_F(GpuRuntime, PageableMemoryHasNoDevicePointerAndLeavesNoError) {
  std::vector<char> pageable(1 << 16);
  EXPECT_EQ(rt::host_device_pointer_or_null(pageable.data()), nullptr);
  EXPECT_THROW(rt::host_device_pointer(pageable.data()), rt::Error);
  // The failed lookup must not poison the next call.
  rt::Stream stream(0);
  EXPECT_TRUE(stream.query());
}

}  // namespace
}  // namespace hipferry

namespace hipferry {
namespace {

TEST(Runtime, CpuBuildBatchedCopyCopiesInPlace) {
  if (rt::build_info().platform != "cpu") GTEST_SKIP() << "GPU build";
  std::vector<char> a(100, 1), b(7, 2), out_a(100, 0), out_b(7, 0);
  void* dsts[] = {out_a.data(), out_b.data()};
  const void* srcs[] = {a.data(), b.data()};
  const std::size_t sizes[] = {100, 7};
  EXPECT_TRUE(rt::memcpy_batch_async(dsts, srcs, sizes, 2, nullptr));
  EXPECT_EQ(out_a, a);
  EXPECT_EQ(out_b, b);
}

TEST(GpuRuntimeBatch, BatchedCopyMovesEveryBufferOrSaysItIsUnsupported) {
  if (rt::device_count() == 0) GTEST_SKIP() << "no GPU device";
  rt::set_device(0);
  constexpr int kCopies = 64;
  const std::size_t bytes = 16 << 10;
  auto* host = static_cast<unsigned char*>(rt::host_alloc(kCopies * bytes, rt::kHostPortable | rt::kHostMapped));
  auto* back = static_cast<unsigned char*>(rt::host_alloc(kCopies * bytes, rt::kHostPortable | rt::kHostMapped));
  auto* dev = static_cast<unsigned char*>(rt::device_alloc(kCopies * bytes, 0));
  for (std::size_t i = 0; i < kCopies * bytes; ++i) host[i] = static_cast<unsigned char>(i * 7 + 3);
  std::vector<void*> dsts, back_dsts;
  std::vector<const void*> srcs, back_srcs;
  std::vector<std::size_t> sizes(kCopies, bytes);
  for (int k = 0; k < kCopies; ++k) {  // scattered: the device side in reverse order
    dsts.push_back(dev + (kCopies - 1 - k) * bytes);
    srcs.push_back(host + k * bytes);
    back_dsts.push_back(back + k * bytes);
    back_srcs.push_back(dev + (kCopies - 1 - k) * bytes);
  }
  rt::Stream stream(0);
  if (!rt::memcpy_batch_async(dsts.data(), srcs.data(), sizes.data(), kCopies, stream.handle())) {
    rt::host_free(host);
    rt::host_free(back);
    rt::device_free(dev, 0);
    GTEST_SKIP() << "this runtime has no batched copy";
  }
  ASSERT_TRUE(rt::memcpy_batch_async(back_dsts.data(), back_srcs.data(), sizes.data(), kCopies, stream.handle()));
  stream.synchronize();
  EXPECT_EQ(std::memcmp(host, back, kCopies * bytes), 0);
  rt::host_free(host);
  rt::host_free(back);
  rt::device_free(dev, 0);
}

TEST(Runtime, CpuBuildDeviceGuardAndStreamSynchronizeAreNoOps) {
  if (rt::build_info().platform != "cpu") GTEST_SKIP() << "GPU build";
  rt::DeviceGuard guard(3);  // no device exists: nothing to switch, nothing to throw
  rt::stream_synchronize(nullptr, 3);
}

TEST(GpuRuntimeGuard, DeviceGuardSwitchesAndRestores) {
  if (rt::device_count() == 0) GTEST_SKIP() << "no GPU device";
  const int last = rt::device_count() - 1;
  rt::set_device(0);
  {
    rt::DeviceGuard guard(last);
    EXPECT_EQ(rt::current_device(), last);
    rt::Stream s(last);
    rt::stream_synchronize(s.handle(), last);
    rt::stream_synchronize(nullptr, last);  // the default stream of `last`
  }
  EXPECT_EQ(rt::current_device(), 0);
  EXPECT_THROW(rt::DeviceGuard bad(rt::device_count()), rt::Error);
  EXPECT_EQ(rt::current_device(), 0);
}

// The copy scheduler's GPU streams (hip/gpu_stream.h).
TEST(GpuStreamEvents, BorrowedStreamsOfADeviceShareOnePool) {
  // No GPU needed: nothing is created until an event is asked for.
  EXPECT_EQ(gpu::EventPool::of_device(0), gpu::EventPool::of_device(0));
  EXPECT_NE(gpu::EventPool::of_device(0), gpu::EventPool::of_device(1));
  EXPECT_THROW(gpu::EventPool::of_device(-1), std::invalid_argument);
}

TEST_F(GpuRuntime, WrappersMadePerCallReuseEventsAndOrderAnOwnedStream) {
  const rt::Event* first = nullptr;
  {
    gpu::GpuStream borrowed(0, nullptr, "");  // as LayerCopier wraps torch's current stream, per call
    auto e = borrowed.record();
    first = &static_cast<gpu::GpuEvent&>(*e).native();
  }
  gpu::GpuStream again(0, nullptr, "");
  auto e = again.record();
  EXPECT_EQ(&static_cast<gpu::GpuEvent&>(*e).native(), first) << "a wrapper per call created an event per call";

  // The owned stream's copy runs after the borrowed stream's work.
  const std::size_t bytes = 16 << 20;
  void* d = rt::device_alloc(bytes, 0);
  std::vector<unsigned char> host(bytes, 0);
  void* h = rt::host_alloc(bytes, rt::kHostMapped);
  std::memset(h, 5, bytes);
  gpu::GpuStream owned(0, "test stream");
  again.copy(d, h, bytes, schedule::Label{"in"});
  owned.wait(again.record());
  owned.copy(host.data(), d, bytes, schedule::Label{"out"});
  owned.record()->synchronize();
  EXPECT_EQ(host[bytes - 1], 5);
  rt::host_free(h);
  rt::device_free(d, 0);
}

}  // namespace
}  // namespace hipferry
