// Conformance: streams (flags, priorities, busy queries, cross-stream waits) and events (timing and their errors).
#include <chrono>
#include <thread>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

constexpr std::uint64_t kShortKernelMilliseconds = 20;
constexpr std::uint64_t kLongKernelMilliseconds = 50;

class StreamEventTest : public SpinKernelTest {
 protected:
  void SetUp() override {
    SpinKernelTest::SetUp();
    if (HasFatalFailure()) {
      return;
    }
    ASSERT_CU_OK(cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING));
  }

  void TearDown() override {
    if (stream_ != nullptr) {
      cuStreamSynchronize(stream_);
      EXPECT_CU_OK(cuStreamDestroy(stream_));
    }
    SpinKernelTest::TearDown();
  }

  CUstream stream_ = nullptr;
};

TEST_F(StreamEventTest, StreamFlagsAreKept) {
  unsigned int flags = 99;
  ASSERT_CU_OK(cuStreamGetFlags(stream_, &flags));
  EXPECT_EQ(flags, static_cast<unsigned int>(CU_STREAM_NON_BLOCKING));
  CUstream blocking = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
  ASSERT_CU_OK(cuStreamGetFlags(blocking, &flags));
  EXPECT_EQ(flags, static_cast<unsigned int>(CU_STREAM_DEFAULT));
  CUcontext owner = nullptr;
  EXPECT_CU_OK(cuStreamGetCtx(blocking, &owner));
  EXPECT_EQ(owner, context_);
  EXPECT_CU_OK(cuStreamDestroy(blocking));
}

TEST_F(StreamEventTest, StreamCreateRejectsBadArguments) {
  CUstream stream = nullptr;
  // Observed on an H100 with driver 580.159.04: flags other than CU_STREAM_DEFAULT and CU_STREAM_NON_BLOCKING are
  // rejected.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuStreamCreate(&stream, 0x100));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuStreamCreate(nullptr, CU_STREAM_DEFAULT));
}

TEST_F(StreamEventTest, PrioritiesStayInTheReportedRange) {
  int least = 99;
  int greatest = 99;
  ASSERT_CU_OK(cuCtxGetStreamPriorityRange(&least, &greatest));
  // Lower numbers are greater priorities; [0, -5] on recent GPUs.
  EXPECT_LE(greatest, least);
  CUstream urgent = nullptr;
  ASSERT_CU_OK(cuStreamCreateWithPriority(&urgent, CU_STREAM_NON_BLOCKING, greatest));
  int priority = 99;
  ASSERT_CU_OK(cuStreamGetPriority(urgent, &priority));
  EXPECT_EQ(priority, greatest);
  EXPECT_CU_OK(cuStreamDestroy(urgent));

  // "priorities that are outside the range ... will automatically be clamped".
  CUstream clamped = nullptr;
  ASSERT_CU_OK(cuStreamCreateWithPriority(&clamped, CU_STREAM_NON_BLOCKING, greatest - 100));
  ASSERT_CU_OK(cuStreamGetPriority(clamped, &priority));
  EXPECT_EQ(priority, greatest);
  EXPECT_CU_OK(cuStreamDestroy(clamped));
  ASSERT_CU_OK(cuStreamCreateWithPriority(&clamped, CU_STREAM_NON_BLOCKING, least + 100));
  ASSERT_CU_OK(cuStreamGetPriority(clamped, &priority));
  EXPECT_EQ(priority, least);
  EXPECT_CU_OK(cuStreamDestroy(clamped));

  // Either output may be NULL.
  EXPECT_CU_OK(cuCtxGetStreamPriorityRange(nullptr, &greatest));
  EXPECT_CU_OK(cuCtxGetStreamPriorityRange(&least, nullptr));
}

TEST_F(StreamEventTest, QueryIsNotReadyWhileAKernelRuns) {
  EXPECT_CU_OK(cuStreamQuery(stream_)) << "an empty stream is complete";
  ASSERT_CU_OK(LaunchSpin(stream_, kLongKernelMilliseconds * kNanosecondsPerMillisecond));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cuStreamQuery(stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  EXPECT_CU_OK(cuStreamQuery(stream_));
}

TEST_F(StreamEventTest, EventQueryFollowsTheWork) {
  CUevent event = nullptr;
  ASSERT_CU_OK(cuEventCreate(&event, CU_EVENT_DEFAULT));
  // "If cuEventRecord() has not been called on this event, the function returns CUDA_SUCCESS".
  EXPECT_CU_OK(cuEventQuery(event));
  ASSERT_CU_OK(LaunchSpin(stream_, kLongKernelMilliseconds * kNanosecondsPerMillisecond));
  ASSERT_CU_OK(cuEventRecord(event, stream_));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cuEventQuery(event));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(cuEventSynchronize(event));
  EXPECT_GT(MillisecondsSince(start), 0.0);
  EXPECT_CU_OK(cuEventQuery(event));
  EXPECT_CU_OK(cuEventDestroy(event));
}

TEST_F(StreamEventTest, WaitEventOrdersAnotherStream) {
  CUstream other = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
  CUevent producer_done = nullptr;
  CUevent consumer_done = nullptr;
  ASSERT_CU_OK(cuEventCreate(&producer_done, CU_EVENT_DISABLE_TIMING));
  ASSERT_CU_OK(cuEventCreate(&consumer_done, CU_EVENT_DISABLE_TIMING));

  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(LaunchSpin(stream_, kLongKernelMilliseconds * kNanosecondsPerMillisecond));
  ASSERT_CU_OK(cuEventRecord(producer_done, stream_));
  ASSERT_CU_OK(cuStreamWaitEvent(other, producer_done, 0));
  ASSERT_CU_OK(cuEventRecord(consumer_done, other));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cuEventQuery(consumer_done)) << "the other stream waits for the kernel";
  EXPECT_CU(CUDA_ERROR_NOT_READY, cuStreamQuery(other));
  ASSERT_CU_OK(cuEventSynchronize(consumer_done));
  EXPECT_GE(MillisecondsSince(start), kLongKernelMilliseconds - 5.0);
  EXPECT_CU_OK(cuEventQuery(producer_done));

  EXPECT_CU_OK(cuEventDestroy(producer_done));
  EXPECT_CU_OK(cuEventDestroy(consumer_done));
  EXPECT_CU_OK(cuStreamDestroy(other));
}

TEST_F(StreamEventTest, ElapsedTimeMeasuresTheKernel) {
  CUevent before = nullptr;
  CUevent after = nullptr;
  ASSERT_CU_OK(cuEventCreate(&before, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuEventCreate(&after, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuEventRecord(before, stream_));
  ASSERT_CU_OK(LaunchSpin(stream_, kShortKernelMilliseconds * kNanosecondsPerMillisecond));
  ASSERT_CU_OK(cuEventRecord(after, stream_));
  float milliseconds = -1.0f;
  // Observed on an H100 with driver 580.159.04: asking before the end event completed is CUDA_ERROR_NOT_READY
  // (documented).
  EXPECT_CU(CUDA_ERROR_NOT_READY, cuEventElapsedTime(&milliseconds, before, after));
  ASSERT_CU_OK(cuEventSynchronize(after));
  ASSERT_CU_OK(cuEventElapsedTime(&milliseconds, before, after));
  // Device time between the events, so the box's load does not stretch it much; 40 ms leaves room for a late start.
  EXPECT_GE(milliseconds, 18.0f);
  EXPECT_LE(milliseconds, 40.0f);
  float reversed = 0.0f;
  ASSERT_CU_OK(cuEventElapsedTime(&reversed, after, before));
  EXPECT_LT(reversed, 0.0f) << "end before start gives a negative time";
  EXPECT_CU_OK(cuEventDestroy(before));
  EXPECT_CU_OK(cuEventDestroy(after));
}

// An event keeps its time however much is queued after it, and however late it is first read. fakecuda kept an
// event's time in its stream's queue slot, reused 128 operations later: a measurement's start read only after its end
// completed, 300 launches on, read as completing when first looked at (the shim's measurement windows over fakecuda
// then read negative or short spans: 8 % of them negative under ThreadSanitizer, the cap exceeded by the rest).
TEST_F(StreamEventTest, AnEventKeepsItsTimeHoweverMuchIsQueuedAfterItAndHoweverLateItIsRead) {
  constexpr int kLaunches = 300;  // past fakecuda's 128 queued operations a stream
  constexpr std::uint64_t kKernelNs = 100'000;
  CUevent before = nullptr;
  CUevent after = nullptr;
  ASSERT_CU_OK(cuEventCreate(&before, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuEventCreate(&after, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuEventRecord(before, stream_));
  for (int i = 0; i < kLaunches; ++i) ASSERT_CU_OK(LaunchSpin(stream_, kKernelNs));
  ASSERT_CU_OK(cuEventRecord(after, stream_));
  ASSERT_CU_OK(cuEventSynchronize(after));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // `before` is first read well after it completed
  float milliseconds = -1.0f;
  ASSERT_CU_OK(cuEventElapsedTime(&milliseconds, before, after));
  const float least = static_cast<float>(kLaunches * kKernelNs) / 1e6f;
  EXPECT_GE(milliseconds, 0.95f * least) << "the kernels between the events ran " << least << " ms at least";
  EXPECT_LE(milliseconds, 1000.0f);
  EXPECT_CU_OK(cuEventDestroy(before));
  EXPECT_CU_OK(cuEventDestroy(after));
}

TEST_F(StreamEventTest, ElapsedTimeOfUnrecordedEventIsInvalidHandle) {
  CUevent recorded = nullptr;
  CUevent unrecorded = nullptr;
  ASSERT_CU_OK(cuEventCreate(&recorded, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuEventCreate(&unrecorded, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuEventRecord(recorded, stream_));
  ASSERT_CU_OK(cuEventSynchronize(recorded));
  float milliseconds = 0.0f;
  // "If cuEventRecord() has not been called on either event then CUDA_ERROR_INVALID_HANDLE is returned."
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cuEventElapsedTime(&milliseconds, recorded, unrecorded));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cuEventElapsedTime(&milliseconds, unrecorded, recorded));
  EXPECT_CU_OK(cuEventDestroy(recorded));
  EXPECT_CU_OK(cuEventDestroy(unrecorded));
}

TEST_F(StreamEventTest, ElapsedTimeOfUntimedEventIsInvalidHandle) {
  CUevent timed = nullptr;
  CUevent untimed = nullptr;
  ASSERT_CU_OK(cuEventCreate(&timed, CU_EVENT_DEFAULT));
  ASSERT_CU_OK(cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));
  ASSERT_CU_OK(cuEventRecord(timed, stream_));
  ASSERT_CU_OK(cuEventRecord(untimed, stream_));
  ASSERT_CU_OK(cuStreamSynchronize(stream_));
  float milliseconds = 0.0f;
  // "If either event was created with the CU_EVENT_DISABLE_TIMING flag, then this function will return
  // CUDA_ERROR_INVALID_HANDLE."
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cuEventElapsedTime(&milliseconds, timed, untimed));
  // Observed on an H100 with driver 580.159.04: a NULL output is CUDA_ERROR_INVALID_HANDLE, not INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cuEventElapsedTime(nullptr, timed, timed));
  EXPECT_CU_OK(cuEventDestroy(timed));
  EXPECT_CU_OK(cuEventDestroy(untimed));
}

TEST_F(StreamEventTest, EventCreateRejectsUnknownFlags) {
  CUevent event = nullptr;
  // Observed on an H100 with driver 580.159.04: unknown flag bits are CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuEventCreate(&event, 0x100));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuEventCreate(nullptr, CU_EVENT_DEFAULT));
}

TEST_F(StreamEventTest, DestroyingABusyStreamIsAllowed) {
  CUstream busy = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&busy, CU_STREAM_NON_BLOCKING));
  ASSERT_CU_OK(LaunchSpin(busy, kShortKernelMilliseconds * kNanosecondsPerMillisecond));
  // "In case the device is still doing work in the stream hStream when cuStreamDestroy() is called, the function
  // will return immediately and the resources associated with hStream will be released automatically once the
  // device has completed all work in hStream."
  EXPECT_CU_OK(cuStreamDestroy(busy));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_CU_OK(cuCtxSynchronize());
  EXPECT_GE(MillisecondsSince(start), 0.0);
}

TEST_F(StreamEventTest, LegacyDefaultStreamWaitsForBlockingStreams) {
  CUstream blocking = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CU_OK(LaunchSpin(blocking, kShortKernelMilliseconds * kNanosecondsPerMillisecond));
  // Work on the legacy default stream (NULL) starts only after work on blocking streams finishes.
  ASSERT_CU_OK(LaunchSpin(nullptr, kShortKernelMilliseconds * kNanosecondsPerMillisecond));
  ASSERT_CU_OK(cuStreamSynchronize(nullptr));
  EXPECT_GE(MillisecondsSince(start), 2 * (kShortKernelMilliseconds - 2.0));
  EXPECT_CU_OK(cuStreamDestroy(blocking));
}

}  // namespace
}  // namespace vgpu::conformance
