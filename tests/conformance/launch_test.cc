// Conformance: every launch path a compute limit must see, kernels taking their time, rejected launch configurations.
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

// Lower bounds only: a kernel never finishes early, but a shared 2-core CI box may finish late.
constexpr std::uint64_t kKernelMilliseconds = 20;
constexpr double kAtLeastMilliseconds = 18.0;

using LaunchTest = SpinKernelTest;

TEST_F(LaunchTest, LaunchKernelTakesTheKernelsTime) {
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(LaunchSpin(nullptr, kKernelMilliseconds * kNanosecondsPerMillisecond));
  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_GE(MillisecondsSince(start), kAtLeastMilliseconds);
}

TEST_F(LaunchTest, LaunchKernelWithArgumentBuffer) {
  std::uint64_t ns_per_block = kKernelMilliseconds * kNanosecondsPerMillisecond;
  size_t buffer_size = sizeof(ns_per_block);
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &ns_per_block, CU_LAUNCH_PARAM_BUFFER_SIZE, &buffer_size,
                   CU_LAUNCH_PARAM_END};
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(cuLaunchKernel(spin_, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, extra));
  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_GE(MillisecondsSince(start), kAtLeastMilliseconds);
}

TEST_F(LaunchTest, LaunchKernelExTakesTheKernelsTime) {
  CUlaunchConfig config{};
  config.gridDimX = 1;
  config.gridDimY = 1;
  config.gridDimZ = 1;
  config.blockDimX = 32;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.hStream = nullptr;
  std::uint64_t ns_per_block = kKernelMilliseconds * kNanosecondsPerMillisecond;
  void* parameters[] = {&ns_per_block};
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(cuLaunchKernelEx(&config, spin_, parameters, nullptr));
  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_GE(MillisecondsSince(start), kAtLeastMilliseconds);
}

TEST_F(LaunchTest, LaunchKernelExWithCooperativeAttribute) {
  CUlaunchAttribute attribute{};
  attribute.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
  attribute.value.cooperative = 1;
  CUlaunchConfig config{};
  config.gridDimX = 2;
  config.gridDimY = 1;
  config.gridDimZ = 1;
  config.blockDimX = 1;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  std::uint64_t ns_per_block = kKernelMilliseconds * kNanosecondsPerMillisecond;
  void* parameters[] = {&ns_per_block};
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(cuLaunchKernelEx(&config, spin_, parameters, nullptr));
  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_GE(MillisecondsSince(start), kAtLeastMilliseconds);
}

TEST_F(LaunchTest, CooperativeLaunchTakesTheKernelsTime) {
  std::uint64_t ns_per_block = kKernelMilliseconds * kNanosecondsPerMillisecond;
  void* parameters[] = {&ns_per_block};
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(cuLaunchCooperativeKernel(spin_, 4, 1, 1, 32, 1, 1, 0, nullptr, parameters));
  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_GE(MillisecondsSince(start), kAtLeastMilliseconds);
}

TEST_F(LaunchTest, CooperativeGridLargerThanTheDeviceIsRejected) {
  // No occupancy lets more blocks than SMs x the per-SM block limit be resident at once.
  const int multiprocessors = DeviceAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  const int blocks_per_multiprocessor = DeviceAttribute(CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR);
  const auto blocks = static_cast<unsigned int>(multiprocessors * blocks_per_multiprocessor + 1);
  std::uint64_t ns_per_block = 0;
  void* parameters[] = {&ns_per_block};
  EXPECT_CU(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
            cuLaunchCooperativeKernel(spin_, blocks, 1, 1, 1, 1, 1, 0, nullptr, parameters));
}

TEST_F(LaunchTest, KernelsOnOneStreamRunOneAfterAnother) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  const auto start = std::chrono::steady_clock::now();
  for (int launch = 0; launch < 3; ++launch) {
    ASSERT_CU_OK(LaunchSpin(stream, kKernelMilliseconds * kNanosecondsPerMillisecond));
  }
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  EXPECT_GE(MillisecondsSince(start), 3 * kAtLeastMilliseconds);
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

TEST_F(LaunchTest, HostFunctionsRunInStreamOrder) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  struct Record {
    std::mutex mutex;
    std::vector<int> order;
    std::vector<double> milliseconds;
    std::chrono::steady_clock::time_point start;
  } record;
  struct Call {
    Record* record;
    int number;
  };
  const CUhostFn note = [](void* argument) {
    auto* call = static_cast<Call*>(argument);
    std::lock_guard<std::mutex> lock(call->record->mutex);
    call->record->order.push_back(call->number);
    call->record->milliseconds.push_back(MillisecondsSince(call->record->start));
  };
  Call first{&record, 1};
  Call second{&record, 2};
  record.start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(LaunchSpin(stream, kKernelMilliseconds * kNanosecondsPerMillisecond));
  ASSERT_CU_OK(cuLaunchHostFunc(stream, note, &first));
  ASSERT_CU_OK(LaunchSpin(stream, kKernelMilliseconds * kNanosecondsPerMillisecond));
  ASSERT_CU_OK(cuLaunchHostFunc(stream, note, &second));
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  std::lock_guard<std::mutex> lock(record.mutex);
  ASSERT_EQ(record.order, (std::vector<int>{1, 2}));
  EXPECT_GE(record.milliseconds[0], kAtLeastMilliseconds) << "the first host function waits for the first kernel";
  EXPECT_GE(record.milliseconds[1], 2 * kAtLeastMilliseconds) << "the second waits for both kernels";
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

// A stream waiting on a word in pinned host memory (the shim's gated measurement, docs/compute-limit.md) runs nothing
// behind the wait until the host writes the word, then runs it; the cyclic ">=" and the 64-bit form as well.
TEST_F(LaunchTest, StreamWaitValueHoldsTheStreamUntilTheHostWritesTheWord) {
  void* pinned = nullptr;
  ASSERT_CU_OK(cuMemHostAlloc(&pinned, 64, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  auto* word = static_cast<std::uint32_t*>(pinned);
  auto* wide = reinterpret_cast<std::uint64_t*>(static_cast<char*>(pinned) + 8);
  *word = 0xfffffffeu;  // the ">=" is cyclic: 1 is past 0xfffffffe
  *wide = 5;
  CUdeviceptr device_word = 0;
  ASSERT_CU_OK(cuMemHostGetDevicePointer(&device_word, pinned, 0));
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUevent behind = nullptr;
  ASSERT_CU_OK(cuEventCreate(&behind, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuStreamWaitValue32(stream, device_word, 1, CU_STREAM_WAIT_VALUE_GEQ));
  ASSERT_CU_OK(cuStreamWaitValue64(stream, device_word + 8, 7, CU_STREAM_WAIT_VALUE_EQ));
  ASSERT_CU_OK(LaunchSpin(stream, 1'000'000));
  ASSERT_CU_OK(cuEventRecord(behind, stream));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(cuEventQuery(behind), CUDA_ERROR_NOT_READY) << "nothing runs behind an unmet wait";
  __atomic_store_n(word, 1u, __ATOMIC_RELEASE);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(cuEventQuery(behind), CUDA_ERROR_NOT_READY) << "the second wait is not met yet";
  EXPECT_EQ(cuStreamQuery(stream), CUDA_ERROR_NOT_READY);
  __atomic_store_n(wide, std::uint64_t{7}, __ATOMIC_RELEASE);
  ASSERT_CU_OK(cuStreamSynchronize(stream));  // a write made before the wait began is seen while it waits
  EXPECT_CU_OK(cuEventQuery(behind));
  EXPECT_CU_OK(cuEventDestroy(behind));
  EXPECT_CU_OK(cuStreamDestroy(stream));
  EXPECT_CU_OK(cuMemFreeHost(pinned));
}

TEST_F(LaunchTest, TooManyThreadsPerBlockIsInvalidValue) {
  std::uint64_t ns_per_block = 0;
  void* parameters[] = {&ns_per_block};
  // Observed on an H100 with driver 580.159.04: more than 1024 threads per block, in one dimension or in all together,
  // is CUDA_ERROR_INVALID_VALUE (the runtime API's cudaErrorInvalidConfiguration has no driver equivalent).
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(spin_, 1, 1, 1, 1025, 1, 1, 0, nullptr, parameters, nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(spin_, 1, 1, 1, 64, 32, 1, 0, nullptr, parameters, nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(spin_, 1, 1, 1, 1, 1, 65, 0, nullptr, parameters, nullptr));
  // A rejected launch leaves the context usable.
  EXPECT_CU_OK(LaunchSpin(nullptr, 0));
  EXPECT_CU_OK(cuCtxSynchronize());
}

TEST_F(LaunchTest, ZeroGridOrBlockIsInvalidValue) {
  std::uint64_t ns_per_block = 0;
  void* parameters[] = {&ns_per_block};
  // Observed on an H100 with driver 580.159.04: a zero dimension is CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(spin_, 0, 1, 1, 1, 1, 1, 0, nullptr, parameters, nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(spin_, 1, 1, 1, 0, 1, 1, 0, nullptr, parameters, nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(spin_, 1, 65536, 1, 1, 1, 1, 0, nullptr, parameters, nullptr));
}

TEST_F(LaunchTest, TooMuchDynamicSharedMemoryIsInvalidValue) {
  std::uint64_t ns_per_block = 0;
  void* parameters[] = {&ns_per_block};
  // Observed on an H100 with driver 580.159.04: more dynamic shared memory than a block may have (without opting in) is
  // CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cuLaunchKernel(spin_, 1, 1, 1, 1, 1, 1, 1024 * 1024, nullptr, parameters, nullptr));
}

TEST_F(LaunchTest, NullFunctionIsInvalidHandle) {
  std::uint64_t ns_per_block = 0;
  void* parameters[] = {&ns_per_block};
  // Observed on an H100 with driver 580.159.04: a NULL function is CUDA_ERROR_INVALID_HANDLE.
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cuLaunchKernel(nullptr, 1, 1, 1, 1, 1, 1, 0, nullptr, parameters, nullptr));
}

}  // namespace
}  // namespace vgpu::conformance
