// Conformance: CUDA arrays (2D, 3D, descriptors, destroy), the device memory they take, their argument checks.
#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

using ArrayTest = PrimaryContextTest;

TEST_F(ArrayTest, Create2DAndReadDescriptorBack) {
  CUDA_ARRAY_DESCRIPTOR descriptor{};
  descriptor.Width = 64;
  descriptor.Height = 32;
  descriptor.Format = CU_AD_FORMAT_FLOAT;
  descriptor.NumChannels = 1;
  CUarray array = nullptr;
  ASSERT_CU_OK(cuArrayCreate(&array, &descriptor));
  ASSERT_NE(array, nullptr);
  CUDA_ARRAY_DESCRIPTOR read_back{};
  ASSERT_CU_OK(cuArrayGetDescriptor(&read_back, array));
  EXPECT_EQ(read_back.Width, 64u);
  EXPECT_EQ(read_back.Height, 32u);
  EXPECT_EQ(read_back.Format, CU_AD_FORMAT_FLOAT);
  EXPECT_EQ(read_back.NumChannels, 1u);
  EXPECT_CU_OK(cuArrayDestroy(array));
}

TEST_F(ArrayTest, Create1DWithZeroHeight) {
  CUDA_ARRAY_DESCRIPTOR descriptor{};
  descriptor.Width = 1024;
  descriptor.Height = 0;
  descriptor.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  descriptor.NumChannels = 4;
  CUarray array = nullptr;
  ASSERT_CU_OK(cuArrayCreate(&array, &descriptor));
  EXPECT_CU_OK(cuArrayDestroy(array));
}

TEST_F(ArrayTest, Create3DAndReadDescriptorBack) {
  CUDA_ARRAY3D_DESCRIPTOR descriptor{};
  descriptor.Width = 32;
  descriptor.Height = 16;
  descriptor.Depth = 8;
  descriptor.Format = CU_AD_FORMAT_HALF;
  descriptor.NumChannels = 2;
  descriptor.Flags = 0;
  CUarray array = nullptr;
  ASSERT_CU_OK(cuArray3DCreate(&array, &descriptor));
  CUDA_ARRAY3D_DESCRIPTOR read_back{};
  ASSERT_CU_OK(cuArray3DGetDescriptor(&read_back, array));
  EXPECT_EQ(read_back.Width, 32u);
  EXPECT_EQ(read_back.Height, 16u);
  EXPECT_EQ(read_back.Depth, 8u);
  EXPECT_EQ(read_back.Format, CU_AD_FORMAT_HALF);
  EXPECT_EQ(read_back.NumChannels, 2u);
  EXPECT_CU_OK(cuArrayDestroy(array));
}

TEST_F(ArrayTest, ArraysTakeDeviceMemory) {
  // A first allocation may grow the context's own heaps; measure from after one.
  CUdeviceptr warm_up = 0;
  ASSERT_CU_OK(cuMemAlloc(&warm_up, kMebibyte));
  ASSERT_CU_OK(cuMemFree(warm_up));
  size_t free_before = 0;
  size_t total = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_before, &total));
  CUDA_ARRAY_DESCRIPTOR descriptor{};
  descriptor.Width = 4096;
  descriptor.Height = 4096;
  descriptor.Format = CU_AD_FORMAT_FLOAT;
  descriptor.NumChannels = 1;
  CUarray array = nullptr;
  ASSERT_CU_OK(cuArrayCreate(&array, &descriptor));
  size_t free_during = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_during, &total));
  const std::size_t array_bytes = 4096u * 4096u * 4u;
  ASSERT_LE(free_during, free_before);
  EXPECT_GE(free_before - free_during, array_bytes) << "a 64 MiB array is taken from the free device memory";
  EXPECT_CU_OK(cuArrayDestroy(array));
}

TEST_F(ArrayTest, BadDescriptorsAreInvalidValue) {
  CUDA_ARRAY_DESCRIPTOR descriptor{};
  descriptor.Width = 64;
  descriptor.Height = 64;
  descriptor.Format = static_cast<CUarray_format>(0x7777);
  descriptor.NumChannels = 1;
  CUarray array = nullptr;
  // Observed on an H100 with driver 580.159.04: an unknown format, a channel count other than 1, 2 or 4, a zero width.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuArrayCreate(&array, &descriptor));
  descriptor.Format = CU_AD_FORMAT_FLOAT;
  descriptor.NumChannels = 3;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuArrayCreate(&array, &descriptor));
  descriptor.NumChannels = 1;
  descriptor.Width = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuArrayCreate(&array, &descriptor));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuArrayCreate(&array, nullptr));

  CUDA_ARRAY3D_DESCRIPTOR descriptor3d{};
  descriptor3d.Width = 16;
  descriptor3d.Height = 16;
  descriptor3d.Depth = 16;
  descriptor3d.Format = static_cast<CUarray_format>(0x7777);
  descriptor3d.NumChannels = 1;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuArray3DCreate(&array, &descriptor3d));
}

TEST_F(ArrayTest, DestroyNullIsInvalidHandle) {
  // Observed on an H100 with driver 580.159.04 (documented: INVALID_HANDLE or ARRAY_IS_MAPPED).
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cuArrayDestroy(nullptr));
}

}  // namespace
}  // namespace vgpu::conformance
