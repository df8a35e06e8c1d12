// Shared pieces of the conformance suites: CUresult assertions, the PTX spin kernel, fixtures, fresh-process checks.
#pragma once

#include <cuda.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace vgpu::conformance {

inline constexpr std::size_t kMebibyte = std::size_t{1} << 20;

// "CUDA_ERROR_INVALID_VALUE (1)". The number is always there so that a wrong name table in the library under test
// cannot hide a wrong code.
std::string DescribeCudaResult(CUresult result);

// Predicate-formatter behind EXPECT_CU/ASSERT_CU.
testing::AssertionResult CudaResultIs(const char* expected_text, const char* call_text, CUresult expected,
                                      CUresult actual);

// True when the process runs on fakecuda (the test registration sets FAKECUDA_STATE). Assertions on values that
// only the fake's presets define (a name, an exact total) are guarded by this; on a real GPU they are skipped.
bool RunningOnFakecuda();

// True on fakecuda with the default device list (one h100-80gb), where the preset's exact figures hold.
bool RunningOnDefaultFakeH100();

// PTX of `vgpu_spin(.param .u64 ns_per_block)`: every thread spins on %globaltimer until ns_per_block nanoseconds
// have passed, so one block of it occupies the GPU for a known time. The same kernel runs on a real GPU.
extern const char kSpinKernelPtx[];
inline constexpr char kSpinKernelName[] = "vgpu_spin";

inline constexpr std::uint64_t kNanosecondsPerMillisecond = 1'000'000;

double MillisecondsSince(std::chrono::steady_clock::time_point start);

// The primary context of device 0 retained and current on the calling thread for the duration of a test.
class PrimaryContextTest : public testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  int DeviceAttribute(CUdevice_attribute attribute) const;

  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
};

// PrimaryContextTest with the spin kernel's module loaded.
class SpinKernelTest : public PrimaryContextTest {
 protected:
  void SetUp() override;
  void TearDown() override;

  // Launches `blocks` blocks of `threads_per_block` threads that each spin `ns_per_block` nanoseconds.
  CUresult LaunchSpin(CUstream stream, std::uint64_t ns_per_block, unsigned int blocks = 1,
                      unsigned int threads_per_block = 1);

  CUmodule module_ = nullptr;
  CUfunction spin_ = nullptr;
};

// Collects problems found in a fresh process and turns them into its exit status, which the parent's
// EXPECT_EXIT checks; the problems are printed on stderr, which GoogleTest shows when the status is wrong.
class FreshProcessReport {
 public:
  void ExpectResult(const char* call_text, CUresult expected, CUresult actual);
  // For calls where the real driver answers one of two codes depending on its state.
  void ExpectResultOneOf(const char* call_text, CUresult expected, CUresult also_accepted, CUresult actual);
  void Expect(bool condition, const std::string& problem);
  [[noreturn]] void Exit();

 private:
  std::string problems_;
};

}  // namespace vgpu::conformance

#define EXPECT_CU(expected, call) EXPECT_PRED_FORMAT2(::vgpu::conformance::CudaResultIs, expected, call)
#define ASSERT_CU(expected, call) ASSERT_PRED_FORMAT2(::vgpu::conformance::CudaResultIs, expected, call)
#define EXPECT_CU_OK(call) EXPECT_CU(CUDA_SUCCESS, call)
#define ASSERT_CU_OK(call) ASSERT_CU(CUDA_SUCCESS, call)

// In a FreshProcessReport named `report`: records the call's result against the expected one.
#define REPORT_CU(expected, call) report.ExpectResult(#call, expected, call)
#define REPORT_CU_ONE_OF(expected, also_accepted, call) report.ExpectResultOneOf(#call, expected, also_accepted, call)

// Runs `body` (a function taking no argument that ends with report.Exit()) in a child process that re-executes this
// test binary, so the driver in it is untouched by earlier tests: no cuInit, no current context.
#define EXPECT_IN_FRESH_PROCESS(body) EXPECT_EXIT(body(), ::testing::ExitedWithCode(0), "")
