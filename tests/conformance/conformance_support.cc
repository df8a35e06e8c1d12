// The conformance suites' main (a fake machine of its own per test process) and the helpers they share.
#include "conformance_support.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace vgpu::conformance {

std::string DescribeCudaResult(CUresult result) {
  const char* name = nullptr;
  std::string text;
  if (cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) {
    text = name;
  } else {
    text = "unnamed result";
  }
  return text + " (" + std::to_string(static_cast<int>(result)) + ")";
}

testing::AssertionResult CudaResultIs(const char* expected_text, const char* call_text, CUresult expected,
                                      CUresult actual) {
  if (expected == actual) {
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure() << call_text << " returned " << DescribeCudaResult(actual) << ", expected "
                                     << expected_text << " = " << DescribeCudaResult(expected);
}

bool RunningOnFakecuda() { return std::getenv("FAKECUDA_STATE") != nullptr; }

bool RunningOnDefaultFakeH100() {
  const char* devices = std::getenv("FAKECUDA_DEVICES");
  return RunningOnFakecuda() && (devices == nullptr || std::string(devices).empty());
}

// Version 7.0 and target sm_70 on purpose: CU_FUNC_ATTRIBUTE_PTX_VERSION then reads 70 whether a driver reports the
// ISA version or the virtual architecture. Every thread spins, so the block's time does not depend on its size.
const char kSpinKernelPtx[] = R"(
.version 7.0
.target sm_70
.address_size 64

.visible .entry vgpu_spin(
    .param .u64 ns_per_block
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [ns_per_block];
    mov.u64 %rd2, %globaltimer;
$L_spin:
    mov.u64 %rd3, %globaltimer;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $L_spin;
    ret;
}
)";

double MillisecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

void PrimaryContextTest::SetUp() {
  ASSERT_CU_OK(cuInit(0));
  ASSERT_CU_OK(cuDeviceGet(&device_, 0));
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context_, device_));
  ASSERT_CU_OK(cuCtxSetCurrent(context_));
}

void PrimaryContextTest::TearDown() {
  if (context_ == nullptr) {
    return;
  }
  // Errors here belong to the test that just ran and were reported there; the release must happen regardless.
  cuCtxSynchronize();
  cuCtxSetCurrent(nullptr);
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(device_));
  context_ = nullptr;
}

int PrimaryContextTest::DeviceAttribute(CUdevice_attribute attribute) const {
  int value = -1;
  EXPECT_CU_OK(cuDeviceGetAttribute(&value, attribute, device_)) << "attribute " << static_cast<int>(attribute);
  return value;
}

void SpinKernelTest::SetUp() {
  PrimaryContextTest::SetUp();
  if (HasFatalFailure()) {
    return;
  }
  ASSERT_CU_OK(cuModuleLoadData(&module_, kSpinKernelPtx));
  ASSERT_CU_OK(cuModuleGetFunction(&spin_, module_, kSpinKernelName));
}

void SpinKernelTest::TearDown() {
  if (module_ != nullptr) {
    cuCtxSynchronize();
    EXPECT_CU_OK(cuModuleUnload(module_));
    module_ = nullptr;
  }
  PrimaryContextTest::TearDown();
}

CUresult SpinKernelTest::LaunchSpin(CUstream stream, std::uint64_t ns_per_block, unsigned int blocks,
                                    unsigned int threads_per_block) {
  void* parameters[] = {&ns_per_block};
  return cuLaunchKernel(spin_, blocks, 1, 1, threads_per_block, 1, 1, 0, stream, parameters, nullptr);
}

void FreshProcessReport::ExpectResult(const char* call_text, CUresult expected, CUresult actual) {
  if (expected != actual) {
    problems_ += std::string(call_text) + " returned " + DescribeCudaResult(actual) + ", expected " +
                 DescribeCudaResult(expected) + "\n";
  }
}

void FreshProcessReport::ExpectResultOneOf(const char* call_text, CUresult expected, CUresult also_accepted,
                                           CUresult actual) {
  if (actual != expected && actual != also_accepted) {
    problems_ += std::string(call_text) + " returned " + DescribeCudaResult(actual) + ", expected " +
                 DescribeCudaResult(expected) + " or " + DescribeCudaResult(also_accepted) + "\n";
  }
}

void FreshProcessReport::Expect(bool condition, const std::string& problem) {
  if (!condition) {
    problems_ += problem + "\n";
  }
}

void FreshProcessReport::Exit() {
  std::fputs(problems_.c_str(), stderr);
  std::fflush(stderr);
  // _Exit: no atexit handlers or static destructors of the test binary run in the child.
  std::_Exit(problems_.empty() ? 0 : 1);
}

namespace {

// Turns FAKECUDA_STATE=<folder> into a state file of this process's own, so that tests never share a fake
// machine. Any other value (a file, or unset on a real GPU) is left alone. Returns the file to remove at the end.
std::string GiveThisProcessItsOwnFakeMachine(const char* program_path) {
  const char* state = std::getenv("FAKECUDA_STATE");
  struct stat state_status {};
  if (state == nullptr || stat(state, &state_status) != 0 || !S_ISDIR(state_status.st_mode)) {
    return {};
  }
  const std::string file = (std::filesystem::path(state) / std::filesystem::path(program_path).filename()).string() +
                           "-" + std::to_string(getpid()) + ".state";
  std::filesystem::remove(file);
  setenv("FAKECUDA_STATE", file.c_str(), 1);
  return file;
}

}  // namespace
}  // namespace vgpu::conformance

int main(int argc, char** argv) {
  const std::string own_state_file = vgpu::conformance::GiveThisProcessItsOwnFakeMachine(argv[0]);
  testing::InitGoogleTest(&argc, argv);
  // Fresh-process checks re-execute the binary rather than fork: forking a process that holds a CUDA context is
  // not supported by the driver.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int status = RUN_ALL_TESTS();
  if (!own_state_file.empty()) {
    std::error_code ignored;
    std::filesystem::remove(own_state_file, ignored);
  }
  return status;
}
