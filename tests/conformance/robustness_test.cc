// fakecuda robustness: arguments that would wrap an address range, double frees into a pool, objects that outlive
// their context, VMM reference sequences. Regression tests of review findings; the expectations that the real
// driver was not asked about run on fakecuda only.
#include <cstring>
#include <vector>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

class RobustnessTest : public SpinKernelTest {
 protected:
  void SetUp() override {
    SpinKernelTest::SetUp();
    if (!RunningOnFakecuda()) GTEST_SKIP() << "fakecuda's answers to these inputs were not checked on a real driver";
  }
  std::size_t FreeBytes() {
    size_t free_bytes = 0, total_bytes = 0;
    EXPECT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
    return free_bytes;
  }
};

TEST_F(RobustnessTest, SizesThatWouldWrapAreInvalidNotACrash) {
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, kMebibyte));
  std::vector<unsigned char> buffer(64);
  // pointer + size wraps to just past the pointer: must not pass the range check.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemcpyDtoH(buffer.data(), pointer, static_cast<size_t>(0) - pointer + 16));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemsetD16(pointer, 7, (size_t{1} << 63) + 8));
  CUDA_MEMCPY2D copy{};
  copy.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  copy.srcDevice = pointer;
  copy.srcPitch = 512;
  copy.srcY = size_t{1} << 58;
  copy.dstMemoryType = CU_MEMORYTYPE_HOST;
  copy.dstHost = buffer.data();
  copy.dstPitch = 64;
  copy.WidthInBytes = 16;
  copy.Height = 2;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemcpy2D(&copy));
  CUdeviceptr pitched = 0;
  size_t pitch = 0;
  // 2^33 bytes per row x (2^31 + 1) rows is 2^64 + 2^33 bytes: more than any device, not 8 GiB.
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cuMemAllocPitch(&pitched, &pitch, size_t{1} << 33, (size_t{1} << 31) + 1, 4));
  EXPECT_CU_OK(cuMemFree(pointer));
}

TEST_F(RobustnessTest, FreeingAStreamOrderedBlockTwiceIsRejected) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUdeviceptr block = 0;
  ASSERT_CU_OK(cuMemAllocAsync(&block, kMebibyte, stream));
  ASSERT_CU_OK(cuMemFreeAsync(block, stream));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemFreeAsync(block, stream));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemFree(block));
  CUdeviceptr first = 0, second = 0;
  ASSERT_CU_OK(cuMemAllocAsync(&first, kMebibyte, stream));
  ASSERT_CU_OK(cuMemAllocAsync(&second, kMebibyte, stream));
  EXPECT_NE(first, second) << "one freed block was handed out twice";
  EXPECT_CU_OK(cuMemFreeAsync(first, stream));
  EXPECT_CU_OK(cuMemFreeAsync(second, stream));
  EXPECT_CU_OK(cuStreamSynchronize(stream));
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

TEST_F(RobustnessTest, RetainingAReleasedVmmHandleStillFreesItAtUnmap) {
  const std::size_t before = FreeBytes();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t granularity = 0;
  ASSERT_CU_OK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_CU_OK(cuMemCreate(&handle, granularity, &prop, 0));
  CUdeviceptr address = 0;
  ASSERT_CU_OK(cuMemAddressReserve(&address, granularity, 0, 0, 0));
  ASSERT_CU_OK(cuMemMap(address, granularity, 0, handle, 0));
  ASSERT_CU_OK(cuMemRelease(handle));  // still mapped: the memory lives on
  CUmemGenericAllocationHandle retained = 0;
  ASSERT_CU_OK(cuMemRetainAllocationHandle(&retained, reinterpret_cast<void*>(address)));
  ASSERT_CU_OK(cuMemRelease(retained));
  CUdeviceptr base = 0;
  size_t size = 0;
  EXPECT_CU_OK(cuMemGetAddressRange(&base, &size, address + 100));  // NCCL finds VMM buffers this way
  EXPECT_EQ(base, address);
  EXPECT_EQ(size, granularity);
  ASSERT_CU_OK(cuMemUnmap(address, granularity));
  ASSERT_CU_OK(cuMemAddressFree(address, granularity));
  EXPECT_EQ(FreeBytes(), before) << "the handle's memory was not returned";
}

TEST_F(RobustnessTest, ArraysAreFreedWithTheirContext) {
  const std::size_t before = FreeBytes();
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuCtxCreate(&context, nullptr, 0, device_));
  CUDA_ARRAY3D_DESCRIPTOR descriptor{};
  descriptor.Width = 8192;
  descriptor.Height = 8192;
  descriptor.Format = CU_AD_FORMAT_FLOAT;
  descriptor.NumChannels = 1;
  CUarray array = nullptr;
  ASSERT_CU_OK(cuArray3DCreate(&array, &descriptor));
  ASSERT_CU_OK(cuCtxDestroy(context));
  ASSERT_CU_OK(cuCtxSetCurrent(context_));
  EXPECT_EQ(FreeBytes(), before) << "the array (256 MiB) or the context stayed charged";
}

TEST_F(RobustnessTest, AnEventOutlivingItsContextIsSafeToUse) {
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuCtxCreate(&context, nullptr, 0, device_));
  CUevent event = nullptr;
  ASSERT_CU_OK(cuEventCreate(&event, 0));
  ASSERT_CU_OK(cuEventRecord(event, nullptr));
  ASSERT_CU_OK(cuCtxDestroy(context));
  ASSERT_CU_OK(cuCtxSetCurrent(context_));
  // Under ASan this was a heap-use-after-free (the event kept a pointer to its context).
  EXPECT_CU_OK(cuEventSynchronize(event));
  EXPECT_CU_OK(cuEventDestroy(event));
}

TEST_F(RobustnessTest, GraphKernelNodesAreValidatedLikeLaunches) {
  CUgraph graph = nullptr;
  ASSERT_CU_OK(cuGraphCreate(&graph, 0));
  std::uint64_t ns = 1000;
  void* params[] = {&ns};
  CUDA_KERNEL_NODE_PARAMS node{};
  node.func = spin_;
  node.gridDimX = node.gridDimY = node.gridDimZ = 1;
  node.blockDimX = 0;  // no threads
  node.blockDimY = node.blockDimZ = 1;
  node.kernelParams = params;
  CUgraphNode added = nullptr;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGraphAddKernelNode(&added, graph, nullptr, 0, &node));
  node.blockDimX = 2048;  // more than a block may hold
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGraphAddKernelNode(&added, graph, nullptr, 0, &node));
  EXPECT_CU_OK(cuGraphDestroy(graph));
}

}  // namespace
}  // namespace vgpu::conformance
