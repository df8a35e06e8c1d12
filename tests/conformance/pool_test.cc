// Conformance: stream-ordered allocation, the default memory pool, and explicit pools with their attributes.
#include <cstdint>
#include <vector>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

class PoolTest : public PrimaryContextTest {
 protected:
  void SetUp() override {
    PrimaryContextTest::SetUp();
    if (HasFatalFailure()) {
      return;
    }
    ASSERT_CU_OK(cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING));
  }

  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_CU_OK(cuStreamDestroy(stream_));
    }
    PrimaryContextTest::TearDown();
  }

  std::uint64_t PoolAttribute(CUmemoryPool pool, CUmemPool_attribute attribute) {
    std::uint64_t value = 0;
    EXPECT_CU_OK(cuMemPoolGetAttribute(pool, attribute, &value)) << "attribute " << static_cast<int>(attribute);
    return value;
  }

  CUstream stream_ = nullptr;
};

TEST_F(PoolTest, DefaultPoolIsTheCurrentPool) {
  CUmemoryPool default_pool = nullptr;
  ASSERT_CU_OK(cuDeviceGetDefaultMemPool(&default_pool, device_));
  ASSERT_NE(default_pool, nullptr);
  CUmemoryPool current_pool = nullptr;
  ASSERT_CU_OK(cuDeviceGetMemPool(&current_pool, device_));
  EXPECT_EQ(current_pool, default_pool);
}

TEST_F(PoolTest, AllocAsyncUseAndFreeAsync) {
  const std::size_t bytes = 4 * kMebibyte;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAllocAsync(&pointer, bytes, stream_));
  ASSERT_NE(pointer, 0u);
  ASSERT_CU_OK(cuMemsetD32Async(pointer, 0xA5A5A5A5u, bytes / 4, stream_));
  std::vector<std::uint32_t> back(bytes / 4, 0);
  ASSERT_CU_OK(cuMemcpyDtoHAsync(back.data(), pointer, bytes, stream_));
  ASSERT_CU_OK(cuMemFreeAsync(pointer, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_EQ(back, std::vector<std::uint32_t>(bytes / 4, 0xA5A5A5A5u));
}

TEST_F(PoolTest, AllocAsyncOfZeroBytesGivesNull) {
  CUdeviceptr pointer = 12345;
  // Observed on an H100 with driver 580.159.04: unlike cuMemAlloc, a zero size succeeds with a NULL pointer, and
  // freeing that is fine.
  EXPECT_CU_OK(cuMemAllocAsync(&pointer, 0, stream_));
  EXPECT_EQ(pointer, 0u);
  EXPECT_CU_OK(cuMemFreeAsync(pointer, stream_));
  EXPECT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemAllocAsync(nullptr, 16, stream_));
}

TEST_F(PoolTest, DefaultPoolCountsItsUse) {
  CUmemoryPool pool = nullptr;
  ASSERT_CU_OK(cuDeviceGetDefaultMemPool(&pool, device_));
  const std::uint64_t used_before = PoolAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
  const std::size_t bytes = 8 * kMebibyte;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAllocAsync(&pointer, bytes, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_GE(PoolAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), used_before + bytes);
  EXPECT_GE(PoolAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            PoolAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT));
  ASSERT_CU_OK(cuMemFreeAsync(pointer, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_EQ(PoolAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), used_before);
}

TEST_F(PoolTest, ExplicitPoolLifecycle) {
  CUmemPoolProps properties{};
  properties.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = device_;
  CUmemoryPool pool = nullptr;
  ASSERT_CU_OK(cuMemPoolCreate(&pool, &properties));
  ASSERT_NE(pool, nullptr);

  std::uint64_t threshold = UINT64_MAX;
  ASSERT_CU_OK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  EXPECT_EQ(PoolAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), UINT64_MAX);

  const std::size_t bytes = 16 * kMebibyte;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAllocFromPoolAsync(&pointer, bytes, pool, stream_));
  ASSERT_CU_OK(cuMemsetD8Async(pointer, 0x3C, bytes, stream_));
  unsigned char last = 0;
  ASSERT_CU_OK(cuMemcpyDtoHAsync(&last, pointer + bytes - 1, 1, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_EQ(last, 0x3C);
  EXPECT_GE(PoolAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), bytes);
  EXPECT_GE(PoolAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), bytes);
  EXPECT_GE(PoolAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH), bytes);

  ASSERT_CU_OK(cuMemFreeAsync(pointer, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_EQ(PoolAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 0u);
  // With the release threshold at its maximum the freed memory stays reserved in the pool until trimmed.
  EXPECT_GE(PoolAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), bytes);
  ASSERT_CU_OK(cuMemPoolTrimTo(pool, 0));
  EXPECT_EQ(PoolAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 0u);

  EXPECT_CU_OK(cuMemPoolDestroy(pool));
}

TEST_F(PoolTest, PoolMemoryShowsInGetInfo) {
  CUmemPoolProps properties{};
  properties.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = device_;
  CUmemoryPool pool = nullptr;
  ASSERT_CU_OK(cuMemPoolCreate(&pool, &properties));
  size_t free_before = 0;
  size_t total = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_before, &total));
  const std::size_t bytes = 64 * kMebibyte;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAllocFromPoolAsync(&pointer, bytes, pool, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  size_t free_during = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_during, &total));
  ASSERT_LE(free_during, free_before);
  EXPECT_GE(free_before - free_during, bytes) << "pool memory is device memory taken from the free amount";
  ASSERT_CU_OK(cuMemFreeAsync(pointer, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_CU_OK(cuMemPoolDestroy(pool));
}

TEST_F(PoolTest, CreateRejectsNullArguments) {
  CUmemPoolProps properties{};
  properties.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = device_;
  CUmemoryPool pool = nullptr;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemPoolCreate(nullptr, &properties));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemPoolCreate(&pool, nullptr));
}

}  // namespace
}  // namespace vgpu::conformance
