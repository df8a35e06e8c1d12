// The memory the driver takes for a process without an allocation call (issue 19; docs/fakecuda.md, "Memory the
// driver takes by itself"): a module's code and data when it loads, local memory when a kernel needs more per thread
// than the context reserves or the stack limit grows, pinned host memory (none). Seen as cuMemGetInfo's free, which
// both drivers take from the whole device; exact figures are fakecuda's model (calibrated on the H100, driver 580),
// a real driver must take at least the data and local memory asked for.
#include <cstdlib>
#include <string>
#include <vector>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

constexpr std::size_t kModuleData = 92 * kMebibyte;  // with the code page: PyTorch's first-launch 94 MiB on the H100

// A module with 92 MiB of device globals and a kernel that reads them; a kernel with 16 KiB of local memory a thread
// (volatile accesses at both ends keep the whole array); a kernel calling the device-side malloc.
std::string ModulePtx() {
  return R"(.version 8.0
.target sm_75
.address_size 64
.global .align 4 .b8 module_data[)" +
         std::to_string(kModuleData) + R"(];
.extern .func (.param .b64 func_retval0) malloc
(
  .param .b64 malloc_param_0
)
;
.visible .entry touch(
  .param .u64 touch_out
)
{
  .reg .b32 %r<2>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [touch_out];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u64 %rd3, module_data;
  ld.global.u32 %r1, [%rd3];
  st.global.u32 [%rd2], %r1;
  ret;
}
.visible .entry deep(
  .param .u64 deep_out
)
{
  .local .align 4 .b8 __local_depot0[16384];
  .reg .b32 %r<4>;
  .reg .b64 %rd<7>;
  ld.param.u64 %rd1, [deep_out];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u64 %rd3, __local_depot0;
  mov.u32 %r1, %tid.x;
  mul.wide.u32 %rd4, %r1, 508;
  add.s64 %rd5, %rd3, %rd4;
  st.local.u32 [%rd5], %r1;
  ld.global.u32 %r2, [%rd2];
  and.b32 %r3, %r2, 4095;
  mul.wide.u32 %rd6, %r3, 4;
  add.s64 %rd6, %rd3, %rd6;
  ld.local.u32 %r2, [%rd6];
  st.global.u32 [%rd2], %r2;
  ret;
}
.visible .entry heap(
  .param .u64 heap_out
)
{
  .reg .b64 %rd<5>;
  ld.param.u64 %rd1, [heap_out];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u64 %rd4, 64;
  {
  .param .b64 param0;
  st.param.b64 [param0], %rd4;
  .param .b64 retval0;
  call.uni (retval0), malloc, (param0);
  ld.param.b64 %rd3, [retval0];
  }
  st.global.u64 [%rd2], %rd3;
  ret;
}
)";
}

class DriverMemory : public PrimaryContextTest {
 protected:
  std::size_t Free() {
    std::size_t free_bytes = 0, total = 0;
    EXPECT_CU_OK(cuMemGetInfo(&free_bytes, &total));
    return free_bytes;
  }
  CUresult LaunchOne(CUfunction function) {
    void* params[] = {&out_};
    const CUresult result = cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr);
    return result == CUDA_SUCCESS ? cuCtxSynchronize() : result;
  }
  void SetUp() override {
    PrimaryContextTest::SetUp();
    ASSERT_CU_OK(cuMemAlloc(&out_, 4096));
  }
  void TearDown() override {
    if (module_ != nullptr) cuModuleUnload(module_);
    cuMemFree(out_);
    PrimaryContextTest::TearDown();
  }
  CUdeviceptr out_ = 0;
  CUmodule module_ = nullptr;
  std::string ptx_ = ModulePtx();
};

TEST_F(DriverMemory, AModuleTakesItsDataWhenItLoadsAndGivesItBackWhenUnloaded) {
  const std::size_t before = Free();
  ASSERT_CU_OK(cuModuleLoadData(&module_, ptx_.c_str()));
  CUfunction touch = nullptr;
  ASSERT_CU_OK(cuModuleGetFunction(&touch, module_, "touch"));
  const std::size_t loaded = Free();
  ASSERT_CU_OK(LaunchOne(touch));
  const std::size_t launched = Free();
  EXPECT_GE(before - launched, kModuleData) << "the module's data is device memory";
  if (RunningOnDefaultFakeH100()) {
    EXPECT_EQ(loaded, before) << "lazy loading (the default): nothing is taken before the first launch";
    EXPECT_EQ(before - launched, kModuleData + 2 * kMebibyte) << "data and a 2 MiB code page";
  }
  ASSERT_CU_OK(cuModuleUnload(module_));
  module_ = nullptr;
  EXPECT_GE(Free(), launched + kModuleData) << "an unloaded module gives its memory back";
}

TEST_F(DriverMemory, AKernelNeedingMoreLocalMemoryRaisesTheReservationForEveryThread) {
  ASSERT_CU_OK(cuModuleLoadData(&module_, ptx_.c_str()));
  CUfunction deep = nullptr;
  ASSERT_CU_OK(cuModuleGetFunction(&deep, module_, "deep"));
  int local = 0;
  ASSERT_CU_OK(cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, deep));
  EXPECT_GE(local, 16384);
  std::size_t stack = 0;
  ASSERT_CU_OK(cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE));
  const std::uint64_t threads = static_cast<std::uint64_t>(DeviceAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)) *
                                DeviceAttribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
  ASSERT_CU_OK(LaunchOne(deep));  // its module loads too: measured from here
  const std::size_t first = Free();
  ASSERT_CU_OK(LaunchOne(deep));
  EXPECT_EQ(Free(), first) << "a second launch takes nothing more";
  std::size_t raised = 0;
  ASSERT_CU_OK(cuCtxGetLimit(&raised, CU_LIMIT_STACK_SIZE));
  EXPECT_GE(raised, static_cast<std::size_t>(local)) << "observed on the H100: the stack limit follows the kernel";
  // Back to the default stack: the reservation shrinks at once (H100: 32 KiB -> 1 KiB gave back 8184 MiB).
  ASSERT_CU_OK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, stack));
  const std::size_t shrunk = Free();
  EXPECT_GE(shrunk - first, (static_cast<std::uint64_t>(local) - stack) * threads * 9 / 10);
  if (RunningOnDefaultFakeH100()) {
    EXPECT_EQ(shrunk - first, (static_cast<std::uint64_t>(local) - stack) * threads);
  }
}

TEST_F(DriverMemory, ALargerStackLimitIsTakenAtOnceForEveryThread) {
  std::size_t stack = 0;
  ASSERT_CU_OK(cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE));
  const std::uint64_t threads = static_cast<std::uint64_t>(DeviceAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)) *
                                DeviceAttribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
  const std::size_t before = Free();
  ASSERT_CU_OK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, stack + 4096));
  const std::size_t after = Free();
  EXPECT_GE(before - after, 4096 * threads * 9 / 10);
  if (RunningOnDefaultFakeH100()) {
    EXPECT_EQ(before - after, 4096 * threads);
  }
  ASSERT_CU_OK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, stack));
  EXPECT_EQ(Free(), before);
}

TEST_F(DriverMemory, TheDeviceHeapIsTakenAtTheFirstKernelUsingMalloc) {
  ASSERT_CU_OK(cuModuleLoadData(&module_, ptx_.c_str()));
  CUfunction heap = nullptr, touch = nullptr;
  ASSERT_CU_OK(cuModuleGetFunction(&heap, module_, "heap"));
  ASSERT_CU_OK(cuModuleGetFunction(&touch, module_, "touch"));
  ASSERT_CU_OK(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 64 * kMebibyte));
  ASSERT_CU_OK(LaunchOne(touch));  // the module is loaded: what follows is the heap alone
  const std::size_t before = Free();
  ASSERT_CU_OK(LaunchOne(heap));
  EXPECT_GE(before - Free(), 64 * kMebibyte);
  if (RunningOnDefaultFakeH100()) {
    EXPECT_EQ(before - Free(), 66 * kMebibyte) << "H100: a 256 MiB heap took 258 MiB";
  }
}

// CUDA_MODULE_LOADING is read at cuInit: this test sets it first, in its own process (one CTest test a process).
TEST(DriverMemoryEager, EagerLoadingTakesTheModuleAtLoad) {
  if (!RunningOnFakecuda()) GTEST_SKIP() << "what a real driver takes at a PTX module's load (JIT) is its own";
  ASSERT_EQ(setenv("CUDA_MODULE_LOADING", "EAGER", 1), 0);
  ASSERT_CU_OK(cuInit(0));
  CUdevice device = 0;
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuDeviceGet(&device, 0));
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context, device));
  ASSERT_CU_OK(cuCtxSetCurrent(context));
  std::size_t before = 0, after = 0, total = 0;
  ASSERT_CU_OK(cuMemGetInfo(&before, &total));
  CUmodule module = nullptr;
  const std::string ptx = ModulePtx();
  ASSERT_CU_OK(cuModuleLoadData(&module, ptx.c_str()));
  ASSERT_CU_OK(cuMemGetInfo(&after, &total));
  EXPECT_EQ(before - after, kModuleData + 2 * kMebibyte) << "eager: the whole module at its load";
  ASSERT_CU_OK(cuModuleUnload(module));
  ASSERT_CU_OK(cuMemGetInfo(&after, &total));
  EXPECT_EQ(after, before);
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(device));
}

TEST_F(DriverMemory, PinnedHostMemoryTakesNoDeviceMemory) {
  const std::size_t before = Free();
  std::vector<char> host(64 * kMebibyte);
  ASSERT_CU_OK(cuMemHostRegister(host.data(), host.size(), CU_MEMHOSTREGISTER_DEVICEMAP));
  EXPECT_EQ(Free(), before) << "H100: 256 MiB registered, nothing taken";
  CUdeviceptr mapped = 0;
  EXPECT_CU_OK(cuMemHostGetDevicePointer(&mapped, host.data(), 0));
  EXPECT_NE(mapped, 0u);
  unsigned int flags = 0;
  EXPECT_CU_OK(cuMemHostGetFlags(&flags, host.data()));
  EXPECT_NE(flags & CU_MEMHOSTREGISTER_DEVICEMAP, 0u);
  // Copies to and from registered memory work as to pinned memory.
  host[0] = 42;
  ASSERT_CU_OK(cuMemcpyHtoD(out_, host.data(), 4));
  ASSERT_CU_OK(cuMemcpyDtoH(host.data() + 8, out_, 4));
  EXPECT_EQ(host[8], 42);
  EXPECT_CU(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, cuMemHostRegister(host.data(), 4096, 0)) << "registered twice";
  ASSERT_CU_OK(cuMemHostUnregister(host.data()));
  EXPECT_CU(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, cuMemHostUnregister(host.data())) << "unregistered twice";
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemHostRegister(host.data(), 0, 0)) << "zero bytes";
}

}  // namespace
}  // namespace vgpu::conformance
