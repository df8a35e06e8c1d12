// Conformance: PTX modules, functions by entry name, function attributes and parameter layout, rejected images.
#include <cstring>
#include <string>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

// Two entries with different parameter layouts: (u64) and (u32, u64, f32), where the u64 is aligned to 8.
constexpr char kTwoEntryPtx[] = R"(
.version 7.0
.target sm_70
.address_size 64

.visible .entry vgpu_first(
    .param .u64 vgpu_first_param_0
)
{
    ret;
}

.visible .entry vgpu_second(
    .param .u32 vgpu_second_param_0,
    .param .u64 vgpu_second_param_1,
    .param .f32 vgpu_second_param_2
)
{
    ret;
}
)";

using ModuleTest = PrimaryContextTest;

TEST_F(ModuleTest, LoadSpinKernelAndFindItsEntry) {
  CUmodule module = nullptr;
  ASSERT_CU_OK(cuModuleLoadData(&module, kSpinKernelPtx));
  ASSERT_NE(module, nullptr);
  CUfunction function = nullptr;
  ASSERT_CU_OK(cuModuleGetFunction(&function, module, kSpinKernelName));
  EXPECT_NE(function, nullptr);
  const char* name = nullptr;
  EXPECT_CU_OK(cuFuncGetName(&name, function));
  EXPECT_STREQ(name, kSpinKernelName);
  EXPECT_CU_OK(cuModuleUnload(module));
}

TEST_F(ModuleTest, LoadDataExWithoutOptions) {
  CUmodule module = nullptr;
  ASSERT_CU_OK(cuModuleLoadDataEx(&module, kSpinKernelPtx, 0, nullptr, nullptr));
  CUfunction function = nullptr;
  EXPECT_CU_OK(cuModuleGetFunction(&function, module, kSpinKernelName));
  EXPECT_CU_OK(cuModuleUnload(module));
}

TEST_F(ModuleTest, EveryEntryIsFoundAndMissingNamesAreNotFound) {
  CUmodule module = nullptr;
  ASSERT_CU_OK(cuModuleLoadData(&module, kTwoEntryPtx));
  CUfunction first = nullptr;
  CUfunction second = nullptr;
  EXPECT_CU_OK(cuModuleGetFunction(&first, module, "vgpu_first"));
  EXPECT_CU_OK(cuModuleGetFunction(&second, module, "vgpu_second"));
  EXPECT_NE(first, second);
  CUfunction missing = nullptr;
  // "CUDA_ERROR_NOT_FOUND ... if no function with name name exists".
  EXPECT_CU(CUDA_ERROR_NOT_FOUND, cuModuleGetFunction(&missing, module, "vgpu_absent"));
  EXPECT_CU(CUDA_ERROR_NOT_FOUND, cuModuleGetFunction(&missing, module, "vgpu_firs"));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuModuleGetFunction(&missing, module, nullptr));
  EXPECT_CU_OK(cuModuleUnload(module));
}

TEST_F(ModuleTest, ParameterLayoutFollowsThePtx) {
  CUmodule module = nullptr;
  ASSERT_CU_OK(cuModuleLoadData(&module, kTwoEntryPtx));
  CUfunction second = nullptr;
  ASSERT_CU_OK(cuModuleGetFunction(&second, module, "vgpu_second"));
  size_t offset = 99;
  size_t size = 99;
  ASSERT_CU_OK(cuFuncGetParamInfo(second, 0, &offset, &size));
  EXPECT_EQ(offset, 0u);
  EXPECT_EQ(size, 4u);
  ASSERT_CU_OK(cuFuncGetParamInfo(second, 1, &offset, &size));
  EXPECT_EQ(offset, 8u) << "a u64 parameter is aligned to 8 bytes";
  EXPECT_EQ(size, 8u);
  ASSERT_CU_OK(cuFuncGetParamInfo(second, 2, &offset, &size));
  EXPECT_EQ(offset, 16u);
  EXPECT_EQ(size, 4u);
  // "CUDA_ERROR_INVALID_VALUE ... if paramIndex is out of range".
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuFuncGetParamInfo(second, 3, &offset, &size));
  EXPECT_CU_OK(cuModuleUnload(module));
}

TEST_F(ModuleTest, FunctionAttributes) {
  CUmodule module = nullptr;
  ASSERT_CU_OK(cuModuleLoadData(&module, kSpinKernelPtx));
  CUfunction spin = nullptr;
  ASSERT_CU_OK(cuModuleGetFunction(&spin, module, kSpinKernelName));
  int value = -1;
  ASSERT_CU_OK(cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, spin));
  EXPECT_GE(value, 1);
  EXPECT_LE(value, 1024);
  ASSERT_CU_OK(cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_NUM_REGS, spin));
  EXPECT_GE(value, 0);
  EXPECT_LE(value, 255);
  ASSERT_CU_OK(cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, spin));
  EXPECT_EQ(value, 0) << "the spin kernel declares no shared memory";
  ASSERT_CU_OK(cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, spin));
  EXPECT_EQ(value, 0);
  ASSERT_CU_OK(cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_PTX_VERSION, spin));
  EXPECT_EQ(value, 70) << "the PTX says .version 7.0 and .target sm_70";
  ASSERT_CU_OK(cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_BINARY_VERSION, spin));
  const int major = DeviceAttribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  const int minor = DeviceAttribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  // Observed on an H100 with driver 580.159.04: PTX is compiled for the device, so the binary version is its compute
  // capability.
  EXPECT_EQ(value, major * 10 + minor);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuFuncGetAttribute(&value, CU_FUNC_ATTRIBUTE_MAX, spin));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuFuncGetAttribute(nullptr, CU_FUNC_ATTRIBUTE_NUM_REGS, spin));
  EXPECT_CU_OK(cuModuleUnload(module));
}

TEST_F(ModuleTest, GarbageImageIsInvalidImage) {
  // Neither ELF, nor fatbinary, nor PTX. Observed on the real driver: CUDA_ERROR_INVALID_IMAGE (200)
  // (lupinemachines/lupine#440).
  const char garbage[] = "\x13\x37garbage that is no module at all\xfe\xff";
  CUmodule module = nullptr;
  EXPECT_CU(CUDA_ERROR_INVALID_IMAGE, cuModuleLoadData(&module, garbage));
}

TEST_F(ModuleTest, BrokenPtxIsInvalidPtx) {
  // Starts as PTX, so it goes to the PTX compiler, which fails on it.
  const char broken[] = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry broken( { this is not ptx }\n";
  CUmodule module = nullptr;
  // Observed on an H100 with driver 580.159.04: a PTX compile failure is CUDA_ERROR_INVALID_PTX ("a PTX JIT compilation
  // failed").
  EXPECT_CU(CUDA_ERROR_INVALID_PTX, cuModuleLoadData(&module, broken));
}

TEST_F(ModuleTest, NullArgumentsAreInvalidValue) {
  CUmodule module = nullptr;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuModuleLoadData(&module, nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuModuleLoadData(nullptr, kSpinKernelPtx));
}

TEST_F(ModuleTest, LoadingTwiceGivesTwoModules) {
  CUmodule first = nullptr;
  CUmodule second = nullptr;
  ASSERT_CU_OK(cuModuleLoadData(&first, kSpinKernelPtx));
  ASSERT_CU_OK(cuModuleLoadData(&second, kSpinKernelPtx));
  EXPECT_NE(first, second);
  EXPECT_CU_OK(cuModuleUnload(first));
  // The second module is independent of the first.
  CUfunction function = nullptr;
  EXPECT_CU_OK(cuModuleGetFunction(&function, second, kSpinKernelName));
  EXPECT_CU_OK(cuModuleUnload(second));
}

}  // namespace
}  // namespace vgpu::conformance
