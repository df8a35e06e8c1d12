// Conformance: primary and explicit contexts, the per-thread context stack, and misuse of stale handles.
#include <thread>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

class ContextTest : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CU_OK(cuInit(0));
    ASSERT_CU_OK(cuDeviceGet(&device_, 0));
    ASSERT_CU_OK(cuDeviceGetCount(&count_));
    EmptyTheContextStack();
  }

  void TearDown() override { EmptyTheContextStack(); }

  // Tests start and end with no context current on this thread, whatever an earlier test left behind.
  static void EmptyTheContextStack() {
    CUcontext current = nullptr;
    for (int bounded = 0; bounded < 64 && cuCtxGetCurrent(&current) == CUDA_SUCCESS && current != nullptr; ++bounded) {
      cuCtxPopCurrent(&current);
    }
  }

  static CUcontext Current() {
    CUcontext current = reinterpret_cast<CUcontext>(0x1);
    EXPECT_CU_OK(cuCtxGetCurrent(&current));
    return current;
  }

  CUdevice device_ = 0;
  int count_ = 0;
};

TEST_F(ContextTest, PrimaryRetainReleaseAndState) {
  unsigned int flags = 0;
  int active = -1;
  ASSERT_CU_OK(cuDevicePrimaryCtxGetState(device_, &flags, &active));
  ASSERT_EQ(active, 0) << "an earlier test left the primary context retained";

  CUcontext first = nullptr;
  CUcontext second = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&first, device_));
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(Current(), nullptr) << "retaining does not make the primary context current";
  ASSERT_CU_OK(cuDevicePrimaryCtxGetState(device_, &flags, &active));
  EXPECT_EQ(active, 1);
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&second, device_));
  EXPECT_EQ(first, second) << "one primary context per device and process";

  ASSERT_CU_OK(cuDevicePrimaryCtxRelease(device_));
  ASSERT_CU_OK(cuDevicePrimaryCtxGetState(device_, &flags, &active));
  EXPECT_EQ(active, 1) << "still retained once";
  ASSERT_CU_OK(cuDevicePrimaryCtxRelease(device_));
  ASSERT_CU_OK(cuDevicePrimaryCtxGetState(device_, &flags, &active));
  EXPECT_EQ(active, 0) << "the last release makes it inactive";
}

TEST_F(ContextTest, PrimaryContextWorksOnceCurrent) {
  CUcontext primary = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&primary, device_));
  ASSERT_CU_OK(cuCtxSetCurrent(primary));
  EXPECT_EQ(Current(), primary);
  CUdevice device = -1;
  EXPECT_CU_OK(cuCtxGetDevice(&device));
  EXPECT_EQ(device, device_);
  EXPECT_CU_OK(cuCtxSynchronize());
  ASSERT_CU_OK(cuCtxSetCurrent(nullptr));
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(device_));
}

TEST_F(ContextTest, PrimaryFlagsAreKeptAndReported) {
  ASSERT_CU_OK(cuDevicePrimaryCtxSetFlags(device_, CU_CTX_SCHED_BLOCKING_SYNC));
  unsigned int flags = 0;
  int active = -1;
  ASSERT_CU_OK(cuDevicePrimaryCtxGetState(device_, &flags, &active));
  EXPECT_EQ(flags & CU_CTX_SCHED_MASK, static_cast<unsigned int>(CU_CTX_SCHED_BLOCKING_SYNC)) << flags;

  CUcontext primary = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&primary, device_));
  ASSERT_CU_OK(cuCtxSetCurrent(primary));
  unsigned int context_flags = 0;
  EXPECT_CU_OK(cuCtxGetFlags(&context_flags));
  EXPECT_EQ(context_flags & CU_CTX_SCHED_MASK, static_cast<unsigned int>(CU_CTX_SCHED_BLOCKING_SYNC)) << context_flags;
  // Since CUDA 11.0 the flags of an active primary context can be changed.
  EXPECT_CU_OK(cuDevicePrimaryCtxSetFlags(device_, CU_CTX_SCHED_AUTO));
  ASSERT_CU_OK(cuCtxSetCurrent(nullptr));
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(device_));
}

TEST_F(ContextTest, PrimarySetFlagsRejectsUnknownFlags) {
  // Observed on an H100 with driver 580.159.04: bits outside the documented flags are CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDevicePrimaryCtxSetFlags(device_, 0xFFFF0000u));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDevicePrimaryCtxSetFlags(count_, 0));
  unsigned int flags = 0;
  int active = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDevicePrimaryCtxGetState(device_, nullptr, &active));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDevicePrimaryCtxGetState(device_, &flags, nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDevicePrimaryCtxGetState(count_, &flags, &active));
}

TEST_F(ContextTest, PrimaryResetFreesAllocationsAndKeepsTheRetain) {
  CUcontext primary = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&primary, device_));
  ASSERT_CU_OK(cuCtxSetCurrent(primary));
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc(&pointer, 64 * kMebibyte));
  ASSERT_CU_OK(cuDevicePrimaryCtxReset(device_));

  // "Resetting the primary context does not release it": the application retains again and works on.
  CUcontext again = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&again, device_));
  ASSERT_CU_OK(cuCtxSetCurrent(again));
  CUdeviceptr fresh = 0;
  EXPECT_CU_OK(cuMemAlloc(&fresh, kMebibyte));
  EXPECT_CU_OK(cuMemFree(fresh));
  ASSERT_CU_OK(cuCtxSetCurrent(nullptr));
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(device_));
  // "it is safe for other modules to call cuDevicePrimaryCtxRelease() even after resetting the device".
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(device_));
}

TEST_F(ContextTest, CreateMakesCurrentAndDestroyPops) {
  CUcontext context = nullptr;
  // CUDA 13's cuda.h maps cuCtxCreate to cuCtxCreate_v4(context, CUctxCreateParams*, flags, device).
  ASSERT_CU_OK(cuCtxCreate(&context, nullptr, 0, device_));
  ASSERT_NE(context, nullptr);
  EXPECT_EQ(Current(), context);
  CUdevice device = -1;
  EXPECT_CU_OK(cuCtxGetDevice(&device));
  EXPECT_EQ(device, device_);
  unsigned int version = 0;
  EXPECT_CU_OK(cuCtxGetApiVersion(context, &version));
  EXPECT_GE(version, 3020u);
  EXPECT_CU_OK(cuCtxSynchronize());
  ASSERT_CU_OK(cuCtxDestroy(context));
  EXPECT_EQ(Current(), nullptr);
}

TEST_F(ContextTest, CreateRejectsBadArguments) {
  CUcontext context = nullptr;
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuCtxCreate(&context, nullptr, 0, count_));
  // Observed on an H100 with driver 580.159.04: unknown flag bits are CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuCtxCreate(&context, nullptr, 0xFFFF0000u, device_));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuCtxCreate(nullptr, nullptr, 0, device_));
  EXPECT_EQ(Current(), nullptr);
}

TEST_F(ContextTest, PushAndPopFollowAStack) {
  CUcontext first = nullptr;
  CUcontext second = nullptr;
  ASSERT_CU_OK(cuCtxCreate(&first, nullptr, 0, device_));
  ASSERT_CU_OK(cuCtxCreate(&second, nullptr, 0, device_));
  EXPECT_EQ(Current(), second);

  CUcontext popped = nullptr;
  ASSERT_CU_OK(cuCtxPopCurrent(&popped));
  EXPECT_EQ(popped, second);
  EXPECT_EQ(Current(), first);
  ASSERT_CU_OK(cuCtxPushCurrent(second));
  EXPECT_EQ(Current(), second);
  // cuCtxSetCurrent replaces the top of the stack.
  ASSERT_CU_OK(cuCtxSetCurrent(first));
  ASSERT_CU_OK(cuCtxPopCurrent(&popped));
  EXPECT_EQ(popped, first);
  EXPECT_EQ(Current(), first) << "the bottom entry, pushed by the first cuCtxCreate";

  EmptyTheContextStack();
  EXPECT_CU_OK(cuCtxDestroy(second));
  EXPECT_CU_OK(cuCtxDestroy(first));
}

TEST_F(ContextTest, PopWithEmptyStackIsInvalidContext) {
  ASSERT_EQ(Current(), nullptr);
  CUcontext popped = reinterpret_cast<CUcontext>(0x1);
  EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT, cuCtxPopCurrent(&popped));
}

TEST_F(ContextTest, ContextsAreCurrentPerThread) {
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuCtxCreate(&context, nullptr, 0, device_));
  CUcontext seen_by_other_thread = reinterpret_cast<CUcontext>(0x1);
  CUresult other_thread_result = CUDA_ERROR_UNKNOWN;
  CUresult other_thread_push = CUDA_ERROR_UNKNOWN;
  CUdevice other_thread_device = -1;
  std::thread other([&] {
    other_thread_result = cuCtxGetCurrent(&seen_by_other_thread);
    other_thread_push = cuCtxPushCurrent(context);
    cuCtxGetDevice(&other_thread_device);
    CUcontext popped = nullptr;
    cuCtxPopCurrent(&popped);
  });
  other.join();
  EXPECT_CU_OK(other_thread_result);
  EXPECT_EQ(seen_by_other_thread, nullptr) << "a new thread starts with no current context";
  EXPECT_CU_OK(other_thread_push) << "a context can be current to several threads";
  EXPECT_EQ(other_thread_device, device_);
  EXPECT_EQ(Current(), context);
  EXPECT_CU_OK(cuCtxDestroy(context));
}

[[noreturn]] void CheckLookupsOfDestroyedHandle() {
  FreshProcessReport report;
  REPORT_CU(CUDA_SUCCESS, cuInit(0));
  CUcontext context = nullptr;
  REPORT_CU(CUDA_SUCCESS, cuCtxCreate(&context, nullptr, 0, 0));
  REPORT_CU(CUDA_SUCCESS, cuCtxDestroy(context));
  // Observed on an H100 with driver 580.159.04: calls that look the handle up answer CUDA_ERROR_INVALID_CONTEXT or
  // CUDA_ERROR_CONTEXT_IS_DESTROYED, depending on the driver's state (a second cuCtxDestroy gave the first with the
  // primary context current and the second with no context current).
  unsigned int version = 0;
  REPORT_CU_ONE_OF(CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_CONTEXT_IS_DESTROYED, cuCtxGetApiVersion(context, &version));
  REPORT_CU_ONE_OF(CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_CONTEXT_IS_DESTROYED, cuCtxDestroy(context));
  // The driver still works afterwards.
  CUcontext fresh = nullptr;
  CUdeviceptr pointer = 0;
  REPORT_CU(CUDA_SUCCESS, cuCtxCreate(&fresh, nullptr, 0, 0));
  REPORT_CU(CUDA_SUCCESS, cuMemAlloc(&pointer, 1024));
  REPORT_CU(CUDA_SUCCESS, cuMemFree(pointer));
  REPORT_CU(CUDA_SUCCESS, cuCtxDestroy(fresh));
  report.Exit();
}

// In fresh processes: if the library under test crashes on a stale handle, that is one failed test, not a lost run.
TEST(DestroyedContextTest, LookupsOfADestroyedHandleAreInvalidContext) {
  EXPECT_IN_FRESH_PROCESS(CheckLookupsOfDestroyedHandle);
}

[[noreturn]] void CheckWorkInDestroyedCurrentContext() {
  FreshProcessReport report;
  REPORT_CU(CUDA_SUCCESS, cuInit(0));
  CUcontext context = nullptr;
  REPORT_CU(CUDA_SUCCESS, cuCtxCreate(&context, nullptr, 0, 0));
  REPORT_CU(CUDA_SUCCESS, cuCtxDestroy(context));
  // Observed on an H100 with driver 580.159.04: making the destroyed handle current is accepted, and work in it is
  // CUDA_ERROR_CONTEXT_IS_DESTROYED. Going on from there (cuCtxSetCurrent(NULL), then cuCtxCreate) aborted the real
  // driver with "free(): invalid pointer", so this process stops here.
  REPORT_CU(CUDA_SUCCESS, cuCtxSetCurrent(context));
  REPORT_CU(CUDA_ERROR_CONTEXT_IS_DESTROYED, cuCtxSynchronize());
  CUdeviceptr pointer = 0;
  REPORT_CU(CUDA_ERROR_CONTEXT_IS_DESTROYED, cuMemAlloc(&pointer, 1024));
  report.Exit();
}

TEST(DestroyedContextTest, WorkInADestroyedCurrentContextIsContextIsDestroyed) {
  EXPECT_IN_FRESH_PROCESS(CheckWorkInDestroyedCurrentContext);
}

}  // namespace
}  // namespace vgpu::conformance
