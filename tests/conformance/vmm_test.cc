// Conformance: the virtual memory management API (PyTorch expandable segments, NCCL): create, reserve, map, access.
#include <cstring>
#include <vector>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

class VirtualMemoryTest : public PrimaryContextTest {
 protected:
  void SetUp() override {
    PrimaryContextTest::SetUp();
    if (HasFatalFailure()) {
      return;
    }
    properties_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    properties_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    properties_.location.id = device_;
    ASSERT_CU_OK(cuMemGetAllocationGranularity(&granularity_, &properties_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    ASSERT_GT(granularity_, 0u);
  }

  std::size_t FreeBytes() {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    EXPECT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
    return free_bytes;
  }

  CUmemAllocationProp properties_{};
  size_t granularity_ = 0;
};

TEST_F(VirtualMemoryTest, GranularityIsAPowerOfTwo) {
  EXPECT_EQ(granularity_ & (granularity_ - 1), 0u) << granularity_;
  size_t recommended = 0;
  ASSERT_CU_OK(cuMemGetAllocationGranularity(&recommended, &properties_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  EXPECT_GE(recommended, granularity_);
  EXPECT_EQ(recommended % granularity_, 0u);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cuMemGetAllocationGranularity(nullptr, &properties_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
}

TEST_F(VirtualMemoryTest, CreateRejectsSizeNotMultipleOfGranularity) {
  CUmemGenericAllocationHandle handle = 0;
  // "size must be a multiple of the granularity" (cuMemGetAllocationGranularity).
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&handle, granularity_ + 1, &properties_, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&handle, 0, &properties_, 0));
}

TEST_F(VirtualMemoryTest, CreateTakesPhysicalMemory) {
  // A first allocation may grow the context's own heaps; measure from after one.
  CUdeviceptr warm_up = 0;
  ASSERT_CU_OK(cuMemAlloc(&warm_up, kMebibyte));
  ASSERT_CU_OK(cuMemFree(warm_up));
  const std::size_t bytes = 32 * granularity_;
  const std::size_t free_before = FreeBytes();
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_CU_OK(cuMemCreate(&handle, bytes, &properties_, 0));
  const std::size_t free_during = FreeBytes();
  ASSERT_LE(free_during, free_before);
  EXPECT_GE(free_before - free_during, bytes) << "cuMemCreate commits physical memory before any mapping";
  ASSERT_CU_OK(cuMemRelease(handle));
  const std::size_t free_after = FreeBytes();
  EXPECT_GE(free_after + 64 * kMebibyte, free_before) << "released physical memory comes back";
}

TEST_F(VirtualMemoryTest, ReserveMapAccessUseAndTearDown) {
  const std::size_t bytes = 2 * granularity_;
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_CU_OK(cuMemCreate(&handle, bytes, &properties_, 0));

  CUmemAllocationProp read_back{};
  ASSERT_CU_OK(cuMemGetAllocationPropertiesFromHandle(&read_back, handle));
  EXPECT_EQ(read_back.type, CU_MEM_ALLOCATION_TYPE_PINNED);
  EXPECT_EQ(read_back.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
  EXPECT_EQ(read_back.location.id, device_);

  CUdeviceptr address = 0;
  ASSERT_CU_OK(cuMemAddressReserve(&address, bytes, granularity_, 0, 0));
  ASSERT_NE(address, 0u);
  EXPECT_EQ(address % granularity_, 0u);
  ASSERT_CU_OK(cuMemMap(address, bytes, 0, handle, 0));

  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_CU_OK(cuMemSetAccess(address, bytes, &access, 1));
  unsigned long long access_flags = 0;
  EXPECT_CU_OK(cuMemGetAccess(&access_flags, &access.location, address));
  EXPECT_EQ(access_flags, static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READWRITE));

  std::vector<unsigned char> source(bytes);
  for (std::size_t index = 0; index < bytes; ++index) {
    source[index] = static_cast<unsigned char>(index * 31 + 7);
  }
  ASSERT_CU_OK(cuMemcpyHtoD(address, source.data(), bytes));
  ASSERT_CU_OK(cuMemsetD32(address + granularity_, 0x01010101u, 4));
  std::vector<unsigned char> back(bytes, 0);
  ASSERT_CU_OK(cuMemcpyDtoH(back.data(), address, bytes));
  std::memset(source.data() + granularity_, 0x01, 16);
  EXPECT_EQ(back, source);

  // The handle of the memory mapped at an address can be retained back (and must be released again).
  CUmemGenericAllocationHandle retained = 0;
  ASSERT_CU_OK(cuMemRetainAllocationHandle(&retained, reinterpret_cast<void*>(address + 100)));
  EXPECT_EQ(retained, handle);
  EXPECT_CU_OK(cuMemRelease(retained));

  EXPECT_CU_OK(cuMemUnmap(address, bytes));
  EXPECT_CU_OK(cuMemRelease(handle));
  EXPECT_CU_OK(cuMemAddressFree(address, bytes));
}

TEST_F(VirtualMemoryTest, OneHandleMappedAtTwoAddressesSharesData) {
  const std::size_t bytes = granularity_;
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_CU_OK(cuMemCreate(&handle, bytes, &properties_, 0));
  CUdeviceptr first = 0;
  CUdeviceptr second = 0;
  ASSERT_CU_OK(cuMemAddressReserve(&first, bytes, 0, 0, 0));
  ASSERT_CU_OK(cuMemAddressReserve(&second, bytes, 0, 0, 0));
  ASSERT_CU_OK(cuMemMap(first, bytes, 0, handle, 0));
  ASSERT_CU_OK(cuMemMap(second, bytes, 0, handle, 0));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_CU_OK(cuMemSetAccess(first, bytes, &access, 1));
  ASSERT_CU_OK(cuMemSetAccess(second, bytes, &access, 1));
  ASSERT_CU_OK(cuMemsetD8(first, 0x42, bytes));
  ASSERT_CU_OK(cuCtxSynchronize());
  unsigned char seen = 0;
  ASSERT_CU_OK(cuMemcpyDtoH(&seen, second + bytes - 1, 1));
  EXPECT_EQ(seen, 0x42) << "both mappings reach the same physical memory";
  EXPECT_CU_OK(cuMemUnmap(first, bytes));
  EXPECT_CU_OK(cuMemUnmap(second, bytes));
  EXPECT_CU_OK(cuMemRelease(handle));
  EXPECT_CU_OK(cuMemAddressFree(first, bytes));
  EXPECT_CU_OK(cuMemAddressFree(second, bytes));
}

}  // namespace
}  // namespace vgpu::conformance
