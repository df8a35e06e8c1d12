// How a launch is measured (vgpu-core/policy/measure.h): the decisions the shim's measure stage and the simulator's
// Measurement::shim make alike.
#include "vgpu/policy/measure.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace vgpu::policy {
namespace {

TEST(QueuedByEstimate, OnlyBehindAtLeastHalfTheLaunchsChargeOfKnownWorkWithNoBookOpen) {
  // Queued behind 600 us of a 1 ms launch: joins a window. Behind 500 us or less: it is nearly alone, measured by a
  // pair (its span would be mostly its own start).
  EXPECT_TRUE(QueuedByEstimate(1'600'000, 1'000'000, 1'000'000, false, false));
  EXPECT_FALSE(QueuedByEstimate(1'500'000, 1'000'000, 1'000'000, false, false));
  EXPECT_FALSE(QueuedByEstimate(500'000, 1'000'000, 1'000'000, false, false));   // the stream drained by the estimate
  EXPECT_FALSE(QueuedByEstimate(9'000'000, 1'000'000, 1'000'000, true, false));  // unknown cost: a pair, always
  EXPECT_FALSE(QueuedByEstimate(9'000'000, 1'000'000, 1'000'000, false, true));  // a book is open on the stream
}

TEST(QueueEndAfter, AddsTheChargeToTheQueuesEndOrToNowIfItHasEnded) {
  EXPECT_EQ(QueueEndAfter(5'000, 1'000, 100), 5'100u);
  EXPECT_EQ(QueueEndAfter(500, 1'000, 100), 1'100u);
}

TEST(WindowFull, AtItsLaunchesOrItsEstimatedTime) {
  EXPECT_FALSE(WindowFull(kWindowLaunches - 1, kWindowNs - 1));
  EXPECT_TRUE(WindowFull(kWindowLaunches, 0));
  EXPECT_TRUE(WindowFull(1, kWindowNs));
}

TEST(PairThisLaunch, EveryOneOfTheFirstLaunchesThenOneInMeasuredOneIn) {
  Sampler sampler(SamplerSeed(7, 0));
  for (std::uint32_t i = 0; i < kAlwaysMeasureFirst; ++i) EXPECT_TRUE(PairThisLaunch(i, 5'000, false, sampler));
  int pairs = 0;
  constexpr int kLaunches = 64'000;
  for (int i = 0; i < kLaunches; ++i) pairs += PairThisLaunch(kAlwaysMeasureFirst + i, 5'000, false, sampler) ? 1 : 0;
  const double expected = kLaunches / static_cast<double>(MeasuredOneIn(5'000, false));  // one in 50
  EXPECT_NEAR(pairs, expected, expected * 0.1);
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(PairThisLaunch(1'000, 1'000'000, false, sampler));  // 1 ms: every one
}

TEST(WindowMeasuredNs, AnIdleTailIsTakenOutButNeverBelowTheChargesNorAboveTheSpan) {
  EXPECT_EQ(WindowMeasuredNs(3'000'000, 0, 1'000'000), 3'000'000u);  // closed on a busy stream: its span
  // 2 ms of work, then 500 ms idle before the launch that closed it: charged the 2 ms.
  EXPECT_EQ(WindowMeasuredNs(502'000'000, 500'000'000, 1'000'000), 2'000'000u);
  EXPECT_EQ(WindowMeasuredNs(502'000'000, 501'900'000, 1'000'000), 1'000'000u);  // no less than its charges
  EXPECT_EQ(WindowMeasuredNs(800'000, 900'000, 1'000'000), 800'000u);            // never more than its span
}

}  // namespace
}  // namespace vgpu::policy
