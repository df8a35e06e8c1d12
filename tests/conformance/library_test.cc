// Conformance: context-independent libraries (cuLibraryLoadData, what the CUDA runtime loads its kernels with), their
// kernels and variables, module variables, the loading mode and the occupancy queries libraries make. PTX images,
// so the same test runs on a real driver.
#include <cstring>
#include <string>
#include <thread>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

// One kernel (u64, u32) and two module variables, one with an initial value.
constexpr char kLibraryPtx[] = R"(
.version 7.0
.target sm_70
.address_size 64

.global .align 4 .b8 vgpu_counter[16] = {7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0, 10};
.const .align 4 .b8 vgpu_coefficients[32];

.visible .entry vgpu_library_kernel(
    .param .u64 vgpu_library_kernel_param_0,
    .param .u32 vgpu_library_kernel_param_1
)
{
    ret;
}
)";

using LibraryTest = PrimaryContextTest;

TEST_F(LibraryTest, AKernelFromALibraryIsAFunctionThatLaunches) {
  CUlibrary library = nullptr;
  ASSERT_CU_OK(cuLibraryLoadData(&library, kLibraryPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
  unsigned int count = 0;
  EXPECT_CU_OK(cuLibraryGetKernelCount(&count, library));
  EXPECT_EQ(count, 1u);
  CUkernel kernel = nullptr;
  ASSERT_CU_OK(cuLibraryGetKernel(&kernel, library, "vgpu_library_kernel"));
  const char* name = nullptr;
  EXPECT_CU_OK(cuKernelGetName(&name, kernel));
  EXPECT_STREQ(name, "vgpu_library_kernel");
  size_t offset = 0, size = 0;
  EXPECT_CU_OK(cuKernelGetParamInfo(kernel, 1, &offset, &size));
  EXPECT_EQ(offset, 8u);
  EXPECT_EQ(size, 4u);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuKernelGetParamInfo(kernel, 2, &offset, &size));
  CUfunction function = nullptr;
  ASSERT_CU_OK(cuKernelGetFunction(&function, kernel));
  CUdeviceptr out = 0;
  ASSERT_CU_OK(cuMemAlloc(&out, 64));
  unsigned int n = 16;
  void* params[] = {&out, &n};
  EXPECT_CU_OK(cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
  EXPECT_CU_OK(cuCtxSynchronize());
  EXPECT_CU_OK(cuMemFree(out));
  CUkernel missing = nullptr;
  EXPECT_CU(CUDA_ERROR_NOT_FOUND, cuLibraryGetKernel(&missing, library, "vgpu_no_such_kernel"));
  EXPECT_CU_OK(cuLibraryUnload(library));  // (a second unload crashes the real driver: not tried)
}

// The runtime asks for a library's kernel on a thread before it makes a context current there (PyTorch's autograd
// thread; fakecuda answered CUDA_ERROR_INVALID_CONTEXT, which PyTorch showed as "invalid device context"): a CUkernel
// needs no context, and once one is current it launches there, passed where a CUfunction goes.
TEST_F(LibraryTest, AKernelNeedsNoContextAndLaunchesInTheOneCurrentWhenUsed) {
  CUlibrary library = nullptr;
  ASSERT_CU_OK(cuLibraryLoadData(&library, kLibraryPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuCtxGetCurrent(&context));
  std::thread worker([&] {
    CUcontext none = context;
    EXPECT_CU_OK(cuCtxGetCurrent(&none));
    EXPECT_EQ(none, nullptr) << "a new thread has no current context";
    CUkernel kernel = nullptr;
    ASSERT_CU_OK(cuLibraryGetKernel(&kernel, library, "vgpu_library_kernel"));
    const char* name = nullptr;
    EXPECT_CU_OK(cuKernelGetName(&name, kernel));
    EXPECT_STREQ(name, "vgpu_library_kernel");
    ASSERT_CU_OK(cuCtxSetCurrent(context));
    CUdeviceptr out = 0;
    ASSERT_CU_OK(cuMemAlloc(&out, 64));
    unsigned int n = 16;
    void* params[] = {&out, &n};
    EXPECT_CU_OK(cuLaunchKernel(reinterpret_cast<CUfunction>(kernel), 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
    EXPECT_CU_OK(cuCtxSynchronize());
    EXPECT_CU_OK(cuMemFree(out));
    CUfunction function = nullptr;
    EXPECT_CU_OK(cuKernelGetFunction(&function, kernel));
    EXPECT_NE(function, nullptr);
  });
  worker.join();
  EXPECT_CU_OK(cuLibraryUnload(library));
}

TEST_F(LibraryTest, KernelAttributesAreTheFunctions) {
  CUlibrary library = nullptr;
  ASSERT_CU_OK(cuLibraryLoadData(&library, kLibraryPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel kernel = nullptr;
  ASSERT_CU_OK(cuLibraryGetKernel(&kernel, library, "vgpu_library_kernel"));
  EXPECT_CU_OK(cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 * 1024, kernel, 0));
  int value = 0;
  EXPECT_CU_OK(cuKernelGetAttribute(&value, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kernel, 0));
  EXPECT_EQ(value, 64 * 1024);
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuKernelGetAttribute(&value, CU_FUNC_ATTRIBUTE_NUM_REGS, kernel, 99));
  EXPECT_CU_OK(cuKernelSetCacheConfig(kernel, CU_FUNC_CACHE_PREFER_SHARED, 0));
  EXPECT_CU_OK(cuLibraryUnload(library));
}

TEST_F(LibraryTest, ModuleVariablesHaveTheirInitialValuesAndTakeCopies) {
  CUlibrary library = nullptr;
  ASSERT_CU_OK(cuLibraryLoadData(&library, kLibraryPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUdeviceptr counter = 0;
  size_t bytes = 0;
  ASSERT_CU_OK(cuLibraryGetGlobal(&counter, &bytes, library, "vgpu_counter"));
  EXPECT_EQ(bytes, 16u);
  int initial[4] = {};
  ASSERT_CU_OK(cuMemcpyDtoH(initial, counter, sizeof initial));
  EXPECT_EQ(initial[0], 7);
  EXPECT_EQ(initial[3], 10);
  CUmodule module = nullptr;
  ASSERT_CU_OK(cuLibraryGetModule(&module, library));
  CUdeviceptr coefficients = 0;
  ASSERT_CU_OK(cuModuleGetGlobal(&coefficients, &bytes, module, "vgpu_coefficients"));
  EXPECT_EQ(bytes, 32u);
  const float written[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  float read[8] = {};
  ASSERT_CU_OK(cuMemcpyHtoD(coefficients, written, sizeof written));
  ASSERT_CU_OK(cuMemcpyDtoH(read, coefficients, sizeof read));
  EXPECT_EQ(std::memcmp(read, written, sizeof read), 0);
  CUdeviceptr missing = 0;
  EXPECT_CU(CUDA_ERROR_NOT_FOUND, cuModuleGetGlobal(&missing, &bytes, module, "vgpu_no_such_variable"));
  EXPECT_CU_OK(cuLibraryUnload(library));
}

TEST_F(LibraryTest, TheLoadingModeIsLazyOrEager) {
  CUmoduleLoadingMode mode{};
  ASSERT_CU_OK(cuModuleGetLoadingMode(&mode));
  EXPECT_TRUE(mode == CU_MODULE_LAZY_LOADING || mode == CU_MODULE_EAGER_LOADING);
}

TEST_F(LibraryTest, OccupancyQueriesAgree) {
  CUlibrary library = nullptr;
  ASSERT_CU_OK(cuLibraryLoadData(&library, kLibraryPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel kernel = nullptr;
  ASSERT_CU_OK(cuLibraryGetKernel(&kernel, library, "vgpu_library_kernel"));
  CUfunction function = nullptr;
  ASSERT_CU_OK(cuKernelGetFunction(&function, kernel));
  int blocks = 0, with_flags = 0;
  ASSERT_CU_OK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, function, 128, 0));
  ASSERT_CU_OK(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&with_flags, function, 128, 0,
                                                                    CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE));
  EXPECT_GT(blocks, 0);
  EXPECT_EQ(with_flags, blocks);
  // Without opting in, a block may have the default 48 KiB whatever shares the SM (an H200: 49152 for one block
  // and for two). Opted in to the device's most, two resident blocks split the SM's shared memory.
  size_t shared = 0, shared_for_two = 0;
  ASSERT_CU_OK(cuOccupancyAvailableDynamicSMemPerBlock(&shared, function, 1, 128));
  ASSERT_CU_OK(cuOccupancyAvailableDynamicSMemPerBlock(&shared_for_two, function, 2, 128));
  EXPECT_EQ(shared, 48u * 1024);
  EXPECT_EQ(shared_for_two, 48u * 1024);
  int most = 0;
  ASSERT_CU_OK(cuDeviceGetAttribute(&most, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 0));
  ASSERT_CU_OK(cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, most));
  ASSERT_CU_OK(cuOccupancyAvailableDynamicSMemPerBlock(&shared, function, 1, 128));
  ASSERT_CU_OK(cuOccupancyAvailableDynamicSMemPerBlock(&shared_for_two, function, 2, 128));
  EXPECT_GT(shared, 48u * 1024);
  EXPECT_LE(shared, static_cast<size_t>(most));
  EXPECT_LT(shared_for_two, shared) << "two resident blocks share the SM's shared memory";
  EXPECT_CU_OK(cuLibraryUnload(library));
}

}  // namespace
}  // namespace vgpu::conformance
