// Conformance: allocations of every kind, cuMemGetInfo accounting, pointer queries, copies and memsets with real data.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

// Slack for what the driver rounds an allocation up to or allocates beside it (page tables, 2 MiB pages).
constexpr std::size_t kAccountingSlackBytes = 64 * kMebibyte;

std::vector<unsigned char> Pattern(std::size_t bytes, unsigned int seed) {
  std::vector<unsigned char> data(bytes);
  for (std::size_t index = 0; index < bytes; ++index) {
    data[index] = static_cast<unsigned char>((index * 131 + seed * 7 + (index >> 8)) & 0xFF);
  }
  return data;
}

class MemoryTest : public PrimaryContextTest {
 protected:
  std::size_t FreeBytes() {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    EXPECT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
    return free_bytes;
  }

  std::vector<unsigned char> CopyBack(CUdeviceptr pointer, std::size_t bytes) {
    std::vector<unsigned char> data(bytes, 0);
    EXPECT_CU_OK(cuMemcpyDtoH(data.data(), pointer, bytes));
    return data;
  }
};

TEST_F(MemoryTest, AllocAndFree) {
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, kMebibyte));
  EXPECT_NE(pointer, 0u);
  // Device allocations are aligned to at least 256 bytes.
  EXPECT_EQ(pointer % 256, 0u);
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, DistinctAllocationsDoNotOverlap) {
  CUdeviceptr first = 0;
  CUdeviceptr second = 0;
  ASSERT_CU_OK(cuMemAlloc(&first, kMebibyte));
  ASSERT_CU_OK(cuMemAlloc(&second, kMebibyte));
  EXPECT_TRUE(first + kMebibyte <= second || second + kMebibyte <= first) << first << " " << second;
  EXPECT_CU_OK(cuMemFree(first));
  EXPECT_CU_OK(cuMemFree(second));
}

TEST_F(MemoryTest, ZeroSizeIsInvalidValue) {
  CUdeviceptr pointer = 0;
  // "If bytesize is 0, cuMemAlloc() returns CUDA_ERROR_INVALID_VALUE".
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemAlloc(&pointer, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemAlloc(nullptr, kMebibyte));
}

TEST_F(MemoryTest, FreeOfNullSucceeds) {
  // The real driver has free(NULL) semantics (observed: cuMemFree(0) and cuMemFreeHost(NULL) return CUDA_SUCCESS,
  // driver 590, lupinemachines/lupine#858).
  EXPECT_CU_OK(cuMemFree(0));
  EXPECT_CU_OK(cuMemFreeHost(nullptr));
}

TEST_F(MemoryTest, FreeOfBadPointerIsInvalidValue) {
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, kMebibyte));
  // Observed on an H100 with driver 580.159.04: a pointer inside an allocation, a pointer no allocation holds and a
  // second free are all CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemFree(pointer + 256));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemFree(0x1000));
  ASSERT_CU_OK(cuMemFree(pointer));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemFree(pointer));
  // The context stays usable.
  ASSERT_CU_OK(cuMemAlloc(&pointer, kMebibyte));
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, GetInfoTracksAllocations) {
  // A first allocation may grow the context's own heaps; measure from after one.
  CUdeviceptr warm_up = 0;
  ASSERT_CU_OK(cuMemAlloc(&warm_up, kMebibyte));
  ASSERT_CU_OK(cuMemFree(warm_up));

  size_t free_before = 0;
  size_t total_before = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_before, &total_before));
  EXPECT_GT(total_before, 0u);
  EXPECT_LE(free_before, total_before);

  const std::size_t bytes = 256 * kMebibyte;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, bytes));
  size_t free_during = 0;
  size_t total_during = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_during, &total_during));
  EXPECT_EQ(total_during, total_before) << "the total does not move with allocations";
  ASSERT_LE(free_during, free_before);
  EXPECT_GE(free_before - free_during, bytes);
  EXPECT_LE(free_before - free_during, bytes + kAccountingSlackBytes);

  ASSERT_CU_OK(cuMemFree(pointer));
  size_t free_after = 0;
  size_t total_after = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_after, &total_after));
  EXPECT_EQ(total_after, total_before);
  EXPECT_LE(free_after > free_before ? free_after - free_before : free_before - free_after, kAccountingSlackBytes)
      << "free memory comes back after cuMemFree: before " << free_before << ", after " << free_after;
}

TEST_F(MemoryTest, GetInfoTotalMatchesDeviceTotalMem) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
  size_t device_total = 0;
  ASSERT_CU_OK(cuDeviceTotalMem(&device_total, device_));
  // Observed on an H100 with driver 580.159.04: cuDeviceTotalMem and cuMemGetInfo report the same total.
  EXPECT_EQ(total_bytes, device_total);
}

TEST_F(MemoryTest, GetInfoAcceptsOneNullOutput) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
  size_t only_total = 0;
  size_t only_free = 0;
  // Observed on an H100 with driver 580.159.04: a NULL output is skipped, not rejected. NVIDIA's OptiX relies on
  // it, calling cuMemGetInfo_v2(NULL, &total) (Project-HAMi/HAMi-core#321).
  EXPECT_CU_OK(cuMemGetInfo(nullptr, &only_total));
  EXPECT_EQ(only_total, total_bytes);
  EXPECT_CU_OK(cuMemGetInfo(&only_free, nullptr));
  EXPECT_GT(only_free, 0u);
}

TEST_F(MemoryTest, FakeH100Totals) {
  if (!RunningOnDefaultFakeH100()) {
    GTEST_SKIP() << "the figures of fakecuda's default h100-80gb preset";
  }
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
  EXPECT_EQ(total_bytes, std::size_t{81079} * kMebibyte);
  // About 518 MiB of context memory is already taken by this process's context.
  EXPECT_LE(free_bytes, total_bytes - 500 * kMebibyte);
}

TEST_F(MemoryTest, LargerThanTotalIsOutOfMemory) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
  CUdeviceptr pointer = 0;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&pointer, total_bytes + (std::size_t{1} << 30)));
  // Out of memory is not sticky: the context keeps working.
  ASSERT_CU_OK(cuMemAlloc(&pointer, kMebibyte));
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, PitchIsWideEnoughAndAligned) {
  CUdeviceptr pointer = 0;
  size_t pitch = 0;
  const std::size_t width_bytes = 1000;
  const std::size_t height = 16;
  ASSERT_CU_OK(cuMemAllocPitch(&pointer, &pitch, width_bytes, height, 4));
  EXPECT_GE(pitch, width_bytes);
  const int alignment = DeviceAttribute(CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT);
  ASSERT_GT(alignment, 0);
  EXPECT_EQ(pitch % static_cast<std::size_t>(alignment), 0u) << "pitch " << pitch;

  // A 2D round trip through the pitched rows.
  const std::vector<unsigned char> source = Pattern(width_bytes * height, 3);
  CUDA_MEMCPY2D to_device{};
  to_device.srcMemoryType = CU_MEMORYTYPE_HOST;
  to_device.srcHost = source.data();
  to_device.srcPitch = width_bytes;
  to_device.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  to_device.dstDevice = pointer;
  to_device.dstPitch = pitch;
  to_device.WidthInBytes = width_bytes;
  to_device.Height = height;
  ASSERT_CU_OK(cuMemcpy2D(&to_device));
  std::vector<unsigned char> back(width_bytes * height, 0);
  CUDA_MEMCPY2D to_host{};
  to_host.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  to_host.srcDevice = pointer;
  to_host.srcPitch = pitch;
  to_host.dstMemoryType = CU_MEMORYTYPE_HOST;
  to_host.dstHost = back.data();
  to_host.dstPitch = width_bytes;
  to_host.WidthInBytes = width_bytes;
  to_host.Height = height;
  ASSERT_CU_OK(cuMemcpy2D(&to_host));
  EXPECT_EQ(back, source);
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, PitchRejectsBadElementSize) {
  CUdeviceptr pointer = 0;
  size_t pitch = 0;
  // "ElementSizeBytes ... may be 4, 8 or 16".
  // Observed on an H100 with driver 580.159.04: other sizes are CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemAllocPitch(&pointer, &pitch, 1000, 16, 3));
}

TEST_F(MemoryTest, ManagedMemoryIsUsableFromHostAndDevice) {
  CUdeviceptr pointer = 0;
  const std::size_t bytes = kMebibyte;
  ASSERT_CU_OK(cuMemAllocManaged(&pointer, bytes, CU_MEM_ATTACH_GLOBAL));
  auto* host_view = reinterpret_cast<unsigned char*>(pointer);
  std::memset(host_view, 0x5A, bytes);
  EXPECT_EQ(CopyBack(pointer, bytes), std::vector<unsigned char>(bytes, 0x5A));
  ASSERT_CU_OK(cuMemsetD8(pointer, 0xC3, bytes));
  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_EQ(host_view[0], 0xC3);
  EXPECT_EQ(host_view[bytes - 1], 0xC3);
  unsigned int is_managed = 0;
  EXPECT_CU_OK(cuPointerGetAttribute(&is_managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, pointer));
  EXPECT_EQ(is_managed, 1u);
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, ManagedRejectsBadFlags) {
  CUdeviceptr pointer = 0;
  // "flags: Must be one of CU_MEM_ATTACH_GLOBAL or CU_MEM_ATTACH_HOST".
  // Observed on an H100 with driver 580.159.04: 0 is CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemAllocManaged(&pointer, kMebibyte, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemAllocManaged(&pointer, 0, CU_MEM_ATTACH_GLOBAL));
}

TEST_F(MemoryTest, HostAllocationsAreUsable) {
  void* pinned = nullptr;
  ASSERT_CU_OK(cuMemAllocHost(&pinned, kMebibyte));
  ASSERT_NE(pinned, nullptr);
  std::memset(pinned, 0x11, kMebibyte);
  CUdeviceptr device_pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&device_pointer, kMebibyte));
  ASSERT_CU_OK(cuMemcpyHtoD(device_pointer, pinned, kMebibyte));
  EXPECT_EQ(CopyBack(device_pointer, kMebibyte), std::vector<unsigned char>(kMebibyte, 0x11));
  EXPECT_CU_OK(cuMemFree(device_pointer));
  EXPECT_CU_OK(cuMemFreeHost(pinned));

  void* mapped = nullptr;
  ASSERT_CU_OK(cuMemHostAlloc(&mapped, kMebibyte, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  CUdeviceptr mapped_device = 0;
  EXPECT_CU_OK(cuMemHostGetDevicePointer(&mapped_device, mapped, 0));
  EXPECT_NE(mapped_device, 0u);
  unsigned int flags = 0;
  EXPECT_CU_OK(cuMemHostGetFlags(&flags, mapped));
  EXPECT_NE(flags & CU_MEMHOSTALLOC_DEVICEMAP, 0u) << flags;
  EXPECT_CU_OK(cuMemFreeHost(mapped));
}

TEST_F(MemoryTest, AddressRangeOfAnInnerPointer) {
  const std::size_t bytes = 3 * kMebibyte + 123;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, bytes));
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_CU_OK(cuMemGetAddressRange(&base, &size, pointer + 1000));
  EXPECT_EQ(base, pointer);
  // Observed on an H100 with driver 580.159.04: the size is the requested one, not the rounded-up one.
  EXPECT_EQ(size, bytes);
  // Either output may be NULL ("If one of them is NULL, it is ignored").
  EXPECT_CU_OK(cuMemGetAddressRange(&base, nullptr, pointer + bytes - 1));
  EXPECT_EQ(base, pointer);
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, AddressRangeOfUnknownPointerIsNotFound) {
  CUdeviceptr base = 0;
  size_t size = 0;
  // Observed on an H100 with driver 580.159.04, as documented: CUDA_ERROR_NOT_FOUND for a pointer no allocation
  // holds.
  EXPECT_CU(CUDA_ERROR_NOT_FOUND, cuMemGetAddressRange(&base, &size, 0x1000));
}

TEST_F(MemoryTest, PointerAttributesNameTheMemory) {
  CUdeviceptr device_pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&device_pointer, kMebibyte));
  unsigned int memory_type = 0;
  ASSERT_CU_OK(cuPointerGetAttribute(&memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, device_pointer + 64));
  EXPECT_EQ(memory_type, static_cast<unsigned int>(CU_MEMORYTYPE_DEVICE));
  CUcontext owner = nullptr;
  EXPECT_CU_OK(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, device_pointer));
  EXPECT_EQ(owner, context_);
  int ordinal = -1;
  EXPECT_CU_OK(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, device_pointer));
  EXPECT_EQ(ordinal, 0);

  void* host = nullptr;
  ASSERT_CU_OK(cuMemAllocHost(&host, kMebibyte));
  ASSERT_CU_OK(
      cuPointerGetAttribute(&memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(host)));
  EXPECT_EQ(memory_type, static_cast<unsigned int>(CU_MEMORYTYPE_HOST));
  EXPECT_CU_OK(cuMemFreeHost(host));
  EXPECT_CU_OK(cuMemFree(device_pointer));
}

TEST_F(MemoryTest, SynchronousCopiesRoundTrip) {
  const std::size_t bytes = 4 * kMebibyte + 17;
  const std::vector<unsigned char> source = Pattern(bytes, 1);
  CUdeviceptr first = 0;
  CUdeviceptr second = 0;
  ASSERT_CU_OK(cuMemAlloc(&first, bytes));
  ASSERT_CU_OK(cuMemAlloc(&second, bytes));
  ASSERT_CU_OK(cuMemcpyHtoD(first, source.data(), bytes));
  ASSERT_CU_OK(cuMemcpyDtoD(second, first, bytes));
  EXPECT_EQ(CopyBack(second, bytes), source);
  // The unified-addressing copy works out the direction from the pointers.
  std::vector<unsigned char> through_unified(bytes, 0);
  ASSERT_CU_OK(cuMemcpy(reinterpret_cast<CUdeviceptr>(through_unified.data()), second, bytes));
  EXPECT_EQ(through_unified, source);
  // A copy into the middle leaves the neighbours alone.
  const std::vector<unsigned char> patch(100, 0xEE);
  ASSERT_CU_OK(cuMemcpyHtoD(second + 1000, patch.data(), patch.size()));
  std::vector<unsigned char> expected = source;
  std::fill(expected.begin() + 1000, expected.begin() + 1100, 0xEE);
  EXPECT_EQ(CopyBack(second, bytes), expected);
  EXPECT_CU_OK(cuMemFree(first));
  EXPECT_CU_OK(cuMemFree(second));
}

TEST_F(MemoryTest, CopyPastTheEndOfAnAllocationIsInvalidValue) {
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, kMebibyte));
  std::vector<unsigned char> host(2 * kMebibyte, 0);
  // Observed on an H100 with driver 580.159.04: a synchronous copy that runs past its allocation is rejected up front.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemcpyDtoH(host.data(), pointer, 2 * kMebibyte));
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, AsynchronousCopiesRoundTrip) {
  const std::size_t bytes = 2 * kMebibyte;
  const std::vector<unsigned char> source = Pattern(bytes, 2);
  void* pinned_in = nullptr;
  void* pinned_out = nullptr;
  ASSERT_CU_OK(cuMemAllocHost(&pinned_in, bytes));
  ASSERT_CU_OK(cuMemAllocHost(&pinned_out, bytes));
  std::memcpy(pinned_in, source.data(), bytes);
  std::memset(pinned_out, 0, bytes);
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUdeviceptr first = 0;
  CUdeviceptr second = 0;
  ASSERT_CU_OK(cuMemAlloc(&first, bytes));
  ASSERT_CU_OK(cuMemAlloc(&second, bytes));
  ASSERT_CU_OK(cuMemcpyHtoDAsync(first, pinned_in, bytes, stream));
  ASSERT_CU_OK(cuMemcpyDtoDAsync(second, first, bytes, stream));
  ASSERT_CU_OK(cuMemcpyDtoHAsync(pinned_out, second, bytes, stream));
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  EXPECT_EQ(std::memcmp(pinned_out, source.data(), bytes), 0);

  // A 2D asynchronous copy of a 64 x 32 byte window.
  CUDA_MEMCPY2D window{};
  window.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  window.srcDevice = second;
  window.srcPitch = 256;
  window.dstMemoryType = CU_MEMORYTYPE_HOST;
  window.dstHost = pinned_out;
  window.dstPitch = 64;
  window.WidthInBytes = 64;
  window.Height = 32;
  std::memset(pinned_out, 0, bytes);
  ASSERT_CU_OK(cuMemcpy2DAsync(&window, stream));
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  const auto* out = static_cast<const unsigned char*>(pinned_out);
  for (std::size_t row = 0; row < 32; ++row) {
    ASSERT_EQ(std::memcmp(out + row * 64, source.data() + row * 256, 64), 0) << "row " << row;
  }

  EXPECT_CU_OK(cuStreamDestroy(stream));
  EXPECT_CU_OK(cuMemFree(first));
  EXPECT_CU_OK(cuMemFree(second));
  EXPECT_CU_OK(cuMemFreeHost(pinned_in));
  EXPECT_CU_OK(cuMemFreeHost(pinned_out));
}

TEST_F(MemoryTest, MemsetsWriteTheirElementSize) {
  const std::size_t bytes = 64 * 1024;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, bytes));

  ASSERT_CU_OK(cuMemsetD8(pointer, 0xAB, bytes));
  EXPECT_EQ(CopyBack(pointer, bytes), std::vector<unsigned char>(bytes, 0xAB));

  ASSERT_CU_OK(cuMemsetD16(pointer, 0xBEEF, bytes / 2));
  std::vector<unsigned char> back = CopyBack(pointer, bytes);
  std::vector<std::uint16_t> halves(bytes / 2);
  std::memcpy(halves.data(), back.data(), bytes);
  EXPECT_TRUE(std::all_of(halves.begin(), halves.end(), [](std::uint16_t v) { return v == 0xBEEF; }));

  ASSERT_CU_OK(cuMemsetD32(pointer, 0xDEADBEEFu, bytes / 4));
  back = CopyBack(pointer, bytes);
  std::vector<std::uint32_t> words(bytes / 4);
  std::memcpy(words.data(), back.data(), bytes);
  EXPECT_TRUE(std::all_of(words.begin(), words.end(), [](std::uint32_t v) { return v == 0xDEADBEEFu; }));

  // A memset of a middle part leaves the rest alone.
  ASSERT_CU_OK(cuMemsetD8(pointer, 0, bytes));
  ASSERT_CU_OK(cuMemsetD32(pointer + 400, 0x01020304u, 10));
  back = CopyBack(pointer, bytes);
  EXPECT_EQ(back[399], 0);
  EXPECT_EQ(back[400], 0x04);
  EXPECT_EQ(back[403], 0x01);
  EXPECT_EQ(back[439], 0x01);
  EXPECT_EQ(back[440], 0);
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, AsynchronousAnd2DMemsets) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_DEFAULT));
  const std::size_t bytes = 64 * 1024;
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, bytes));
  ASSERT_CU_OK(cuMemsetD8Async(pointer, 0x7E, bytes, stream));
  ASSERT_CU_OK(cuMemsetD16Async(pointer, 0x1234, 8, stream));
  ASSERT_CU_OK(cuMemsetD32Async(pointer + 16, 0xCAFEF00Du, 4, stream));
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  std::vector<unsigned char> back = CopyBack(pointer, bytes);
  EXPECT_EQ(back[0], 0x34);
  EXPECT_EQ(back[1], 0x12);
  EXPECT_EQ(back[16], 0x0D);
  EXPECT_EQ(back[31], 0xCA);
  EXPECT_EQ(back[32], 0x7E);
  EXPECT_EQ(back[bytes - 1], 0x7E);

  // 2D: 8 rows of 100 bytes with a pitch of 256 leave the bytes between the rows alone.
  ASSERT_CU_OK(cuMemsetD8(pointer, 0, bytes));
  ASSERT_CU_OK(cuMemsetD2D8(pointer, 256, 0x99, 100, 8));
  back = CopyBack(pointer, bytes);
  for (std::size_t row = 0; row < 8; ++row) {
    EXPECT_EQ(back[row * 256], 0x99) << "row " << row;
    EXPECT_EQ(back[row * 256 + 99], 0x99) << "row " << row;
    EXPECT_EQ(back[row * 256 + 100], 0) << "row " << row;
  }
  EXPECT_EQ(back[8 * 256], 0);
  EXPECT_CU_OK(cuStreamDestroy(stream));
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(MemoryTest, MemsetOfUnknownPointerIsInvalidValue) {
  // Observed on an H100 with driver 580.159.04: a pointer no allocation holds is CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemsetD8(0x1000, 0, 16));
}

}  // namespace
}  // namespace vgpu::conformance
