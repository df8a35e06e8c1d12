// The compute limiter under a fake clock: budget, debt waits, refill cap, settlement, cost learning, in-flight
// bound, garbage measurements, the default policy's lending, and the achieved share of a simple serial GPU.
#include "vgpu/policy/limiter.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <deque>
#include <vector>

namespace vgpu::policy {
namespace {

constexpr std::uint64_t kMs = 1'000'000;
constexpr std::uint64_t kUs = 1'000;
const KernelKey kKernel{reinterpret_cast<const void*>(0x1000), 42};

LimiterConfig Share(std::uint32_t permille) {
  LimiterConfig config;
  config.share_permille = permille;
  return config;
}

TEST(Limiter, AFullBudgetAdmitsAtOnceAndDebtWaitsExactlyForTheRefill) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 250, 20 * kMs, 0);  // 25 %: the burst holds 5 ms
  LimiterConfig config = Share(250);
  config.pace_ns = 0;  // the wait is then exactly the debt's (pacing: the next test)
  Limiter limiter(cell, config);
  // Learn a 4 ms kernel.
  Admission first = limiter.Admit(kKernel, 0);
  limiter.Settle(kKernel, first.charged_ns, 4 * kMs, 0);
  EXPECT_EQ(limiter.EstimateNs(kKernel), 4 * kMs);
  // The learning run cost 4 ms of the 5 ms burst: 1 ms left. The next 4 ms kernel leaves 3 ms of debt, repaid at
  // 25 % in 12 ms of wall time; the one after adds 4 ms more: 7 ms of debt, 28 ms.
  Admission second = limiter.Admit(kKernel, 0);
  EXPECT_EQ(second.ready_at_ns, 12 * kMs);
  Admission third = limiter.Admit(kKernel, 0);
  EXPECT_EQ(third.ready_at_ns, 28 * kMs);
  EXPECT_FALSE(third.wait_for_completion);
}

// A launch that finds the budget in debt waits for the debt and the pace more (500 us of GPU time, at most a quarter
// of the burst): the launches after it find budget and go at once, so a throttled stream of short kernels runs in
// bursts of back-to-back kernels (measured exactly) instead of one kernel per refill on an idle stream (measured
// with the launch latency in it: 5 us kernels got 19 % of their throughput at a 30 % cap on the H100).
TEST(Limiter, AThrottledProcessRunsInBurstsOfThePace) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);  // 30 %: the burst holds 6 ms
  Limiter limiter(cell, Share(300));
  std::uint64_t now = 0, waits = 0, launches = 0, busy = 0;
  std::uint64_t last_ready = 0;
  while (now < 2000 * kMs) {
    const Admission a = limiter.Admit(kKernel, now);
    if (a.ready_at_ns > now) {
      ++waits;
      // Each wait repays the debt and 500 us more: about 100 launches of 5 us follow it at once.
      if (waits > 1) {
        EXPECT_GE(a.ready_at_ns - last_ready, 500 * kUs * 1000 / 300) << "at launch " << launches;
      }
      last_ready = a.ready_at_ns;
      now = a.ready_at_ns;
    }
    limiter.Settle(kKernel, a.charged_ns, 5 * kUs, now);
    now += 5 * kUs;  // back to back
    busy += 5 * kUs;
    ++launches;
  }
  // 100 launches repay the pace; the refill while they run (30 % of their 500 us) pays for 43 more.
  EXPECT_NEAR(static_cast<double>(launches) / static_cast<double>(waits), 100.0 / 0.7, 3.0);
  EXPECT_NEAR(static_cast<double>(busy) / static_cast<double>(now), 0.30, 0.01) << "the pace moves no share";
  // A small share paces at a quarter of its burst: 2 % holds 400 us of the 20 ms burst, and never less than its
  // longest kernel (500 us here), so its bursts are 125 us.
  BudgetCell small{};
  Limiter::InitCell(small, 20, 20 * kMs, 0);
  Limiter two_percent(small, Share(20));
  const Admission first = two_percent.Admit(kKernel, 0);
  two_percent.Settle(kKernel, first.charged_ns, 500 * kUs, 0);  // 100 us of debt after this one
  const Admission second = two_percent.Admit(kKernel, 0);       // and 500 us more
  EXPECT_EQ(second.ready_at_ns, (600 * kUs + 125 * kUs) * 1000 / 20);
}

// Launches that find budget refill the shared cell at most every 50 us (two exchanges on the region fewer per launch);
// a launch that finds none refills first, so that its wait is what a refill at every launch would give; and the
// deferred refill lets the budget hold at most 50 us x share more than the burst.
TEST(Limiter, TheSharedRefillIsDeferredOnlyWhileTheBudgetLasts) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 500, 20 * kMs, 0);  // 50 %: the burst holds 10 ms
  LimiterConfig config = Share(500);
  config.pace_ns = 0;
  Limiter limiter(cell, config);
  const Admission learn = limiter.Admit(kKernel, 0);
  limiter.Settle(kKernel, learn.charged_ns, 2 * kMs, 0);  // a 2 ms kernel: 8 ms left
  for (std::uint64_t t = 1 * kUs; t < 50 * kUs; t += 10 * kUs) {
    const Admission a = limiter.Admit(kKernel, t);  // 2 ms each: 6, 4, 2, 0, -2 ms
    if (t < 40 * kUs) {
      EXPECT_EQ(a.ready_at_ns, t) << "at " << t;
      EXPECT_EQ(cell.refilled_at_ns, 0u) << "a launch that finds budget refilled at " << t;
    } else {
      // In debt: refilled first (41 us at 50 % pays 20.5 us of the 2 ms), then waits for the rest at 50 %.
      EXPECT_EQ(cell.refilled_at_ns, t);
      // (The process's own count starts 1 ns later than the cell: 2 ns more of wait.)
      EXPECT_NEAR(static_cast<double>(a.ready_at_ns), static_cast<double>(t + (2 * kMs - t / 2) * 2), 2.0);
    }
  }
  // Past 50 us a launch with budget refills too; after an hour idle the budget is at most 25 us over the burst.
  BudgetCell full{};
  Limiter::InitCell(full, 500, 20 * kMs, 0);
  Limiter idle(full, Share(500));
  for (std::uint64_t t = 3600'000 * kMs; t < 3600'000 * kMs + 49 * kUs; t += kUs) idle.Admit(kKernel, t);
  EXPECT_EQ(full.refilled_at_ns, 3600'000 * kMs);
  EXPECT_LE(full.budget_ns, static_cast<std::int64_t>(10 * kMs + 25 * kUs));
}

TEST(Limiter, TheBudgetNeverHoldsMoreThanTheBurst) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 500, 20 * kMs, 0);
  Limiter limiter(cell, Share(500));
  limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 1 * kMs, 0);
  // An hour idle refills to the burst (10 ms at 50 %), not to 30 minutes of GPU time.
  limiter.Admit(kKernel, 3600'000 * kMs);
  EXPECT_LE(cell.budget_ns, static_cast<std::int64_t>(10 * kMs));
}

TEST(Limiter, SettlementGivesBackWhatTheEstimateOvercharged) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 1000, 20 * kMs, 0);
  Limiter limiter(cell, Share(1000));
  const Admission a = limiter.Admit(kKernel, 0);  // charged the 100 us default
  const std::int64_t before = cell.budget_ns;
  limiter.Settle(kKernel, a.charged_ns, 30 * kUs, 0);
  EXPECT_EQ(cell.budget_ns - before, static_cast<std::int64_t>(70 * kUs));
  EXPECT_EQ(limiter.in_flight_ns(), 0u);
}

// A run is accounted at what it measured, not at a statistic of the past: a kernel whose work varies (jitter, or
// one function given different sizes) is charged what it ran (sim findings 4 and 5).
TEST(Limiter, ARunIsChargedWhatItMeasured) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  for (const std::uint64_t measured : {1 * kMs, 900 * kUs, 1100 * kUs, 5 * kMs, 7 * kUs}) {
    const std::int64_t before = cell.budget_ns;
    const Admission a = limiter.Admit(kKernel, 0);
    limiter.Settle(kKernel, a.charged_ns, measured, 0);
    EXPECT_EQ(before - cell.budget_ns, static_cast<std::int64_t>(measured)) << measured;
  }
}

// A kernel's recent measurements are steady while their mean stays within twice their median (Admission::steady: the
// shim then measures it less often). One launch in eight running 40 times longer makes it unsteady at once.
TEST(Limiter, AKernelIsSteadyWhileItsMeanStaysWithinTwiceItsMedian) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 1000, 20 * kMs, 0);
  Limiter limiter(cell, Share(1000));
  EXPECT_FALSE(limiter.Admit(kKernel, 0).steady) << "a kernel never measured is not steady";
  limiter.Cancel(kKernel, 100 * kUs);
  for (int i = 0; i < 16; ++i) {
    const Admission a = limiter.Admit(kKernel, 0);
    limiter.Settle(kKernel, a.charged_ns, (i % 2 == 0 ? 40 : 60) * kUs, 0);
  }
  Admission a = limiter.Admit(kKernel, 0);
  EXPECT_TRUE(a.steady) << "40 and 60 us runs: mean 50, median 60";
  limiter.Settle(kKernel, a.charged_ns, 50 * kUs, 0);
  for (int i = 0; i < 8; ++i) {
    a = limiter.Admit(kKernel, 0);
    limiter.Settle(kKernel, a.charged_ns, (i == 7 ? 2000 : 50) * kUs, 0);
  }
  a = limiter.Admit(kKernel, 0);
  EXPECT_FALSE(a.steady) << "a 2 ms run among 50 us ones: the mean is past twice the median";
  limiter.Cancel(kKernel, a.charged_ns);
}

// Time division's cycle is to hold the longest kernel (CycleFor): the second longest of the last 64 runs of kernels
// measured at least 3 times, not their median. One function launched at 5 us .. 20 ms has a median of 0.5 ms here;
// sized by it, the cycle left a 10 % container's 20 ms launches overrunning five windows each (live over fakecuda,
// 8.2 %). A first launch, settled without learning (it may have loaded its module), a lone run stretched by another
// context's slices, and a kernel measured twice do not count.
TEST(Limiter, TheLongestRunIsTheSecondLongestOfTheLast64OfKernelsMeasuredThreeTimes) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 1000, 20 * kMs, 0);
  Limiter limiter(cell, Share(1000));
  limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 90 * kMs, 0, false);  // a first launch: not learned
  for (const std::uint64_t run : {5 * kUs, 50 * kUs, 500 * kUs, 20 * kMs, 5 * kMs, 500 * kUs, 5 * kUs, 20 * kMs}) {
    limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, run, 0);
  }
  EXPECT_EQ(limiter.EstimateNs(kKernel), 500 * kUs);
  EXPECT_EQ(limiter.LongestRunNs(), 20 * kMs);
  limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 70 * kMs, 0);
  EXPECT_EQ(limiter.LongestRunNs(), 20 * kMs) << "one run stretched to 70 ms";
  const KernelKey other{reinterpret_cast<const void*>(0x2000), 42};
  for (int i = 0; i < 2; ++i) limiter.Settle(other, limiter.Admit(other, 0).charged_ns, 40 * kMs, 0);
  EXPECT_EQ(limiter.LongestRunNs(), 20 * kMs) << "a kernel measured twice";
  limiter.Settle(other, limiter.Admit(other, 0).charged_ns, 30 * kMs, 0);
  EXPECT_EQ(limiter.LongestRunNs(), 40 * kMs);
  // 64 more runs of 1 ms of each push the long ones out.
  for (int i = 0; i < 64; ++i) limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, kMs, 0);
  for (int i = 0; i < 64; ++i) limiter.Settle(other, limiter.Admit(other, 0).charged_ns, kMs, 0);
  EXPECT_EQ(limiter.LongestRunNs(), kMs);
}

// What the process's launches have cost, as the limiter accounts them, whether or not it throttles (time division
// charges a container alone on its GPU by it): each launch at its charge when admitted, then at what it measured, or
// at the kernel's mean unmeasured; a book's launches at that mean, those never made given back; a launch the driver
// refused, nothing.
TEST(Limiter, WhatLaunchesCostIsTheirChargeCorrectedToWhatTheyRanWhetherOrNotItThrottles) {
  for (const bool throttle : {true, false}) {
    BudgetCell cell{};
    Limiter::InitCell(cell, 1000, 20 * kMs, 0);
    LimiterConfig config = Share(1000);
    config.throttle = throttle;
    Limiter limiter(cell, config);
    auto spent = [&] { return static_cast<std::uint64_t>(limiter.spent_ns()); };
    const std::uint64_t first = limiter.Admit(kKernel, 0).charged_ns;
    EXPECT_EQ(spent(), first) << "admitted, at the default charge";
    limiter.Settle(kKernel, first, 30 * kUs, 0);
    EXPECT_EQ(spent(), 30 * kUs) << "then what it measured";
    for (const std::uint64_t run : {30 * kUs, 30 * kUs, 2 * kMs})
      limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, run, 0);
    const std::uint64_t measured = 30 * kUs * 3 + 2 * kMs;  // the kernel's mean: a quarter of it
    ASSERT_EQ(spent(), measured);
    const policy::Admission unmeasured = limiter.Admit(kKernel, 0);
    EXPECT_EQ(unmeasured.charged_ns, 30 * kUs) << "charged at its median";
    limiter.SettleUnmeasured(kKernel, unmeasured.charged_ns, 0);
    EXPECT_EQ(spent(), measured + measured / 4) << "settled at its mean";
    std::uint64_t each = 0;
    ASSERT_EQ(limiter.AdmitBook(kKernel, 0, 4, 100 * kMs, each), 4u);
    EXPECT_EQ(each, measured / 4);
    EXPECT_EQ(spent(), measured + 5 * (measured / 4)) << "a book's launches, at the mean";
    limiter.Refund(kKernel, 3, each);
    EXPECT_EQ(spent(), measured + 2 * (measured / 4)) << "three never made";
    const policy::Admission refused = limiter.Admit(kKernel, 0);
    limiter.Cancel(kKernel, refused.charged_ns);
    EXPECT_EQ(spent(), measured + 2 * (measured / 4)) << "refused by the driver: nothing";
  }
}

// A measurement settled without learning (the shim's first launch of a kernel, which may have loaded its module inside
// the launch call) is charged in full but leaves the kernel unknown, and what unmeasured launches are settled at is
// learned from the measurements after it only. (Learned, a 5 ms first launch of a 10 us kernel set every unmeasured
// launch at ~80 us until 64 more measurements had come: x.add_ at 1.7 % of a 10 % cap on the H100.)
TEST(Limiter, AMeasurementNotLearnedFromIsChargedButSetsNoCost) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 1000, 20 * kMs, 0);
  Limiter limiter(cell, Share(1000));
  std::int64_t before = cell.budget_ns;
  const Admission first = limiter.Admit(kKernel, 0);
  limiter.Settle(kKernel, first.charged_ns, 5 * kMs, 0, /*learn=*/false);
  EXPECT_EQ(before - cell.budget_ns, static_cast<std::int64_t>(5 * kMs)) << "charged what it measured";
  EXPECT_FALSE(limiter.Known(kKernel)) << "a measurement not learned from made the kernel known";
  for (int i = 0; i < 8; ++i) {
    const Admission a = limiter.Admit(kKernel, 0);
    limiter.Settle(kKernel, a.charged_ns, 10 * kUs, 0);
  }
  EXPECT_TRUE(limiter.Known(kKernel));
  EXPECT_EQ(limiter.EstimateNs(kKernel), 10 * kUs);
  const Admission unmeasured = limiter.Admit(kKernel, 0);
  before = cell.budget_ns + static_cast<std::int64_t>(unmeasured.charged_ns);
  EXPECT_EQ(limiter.SettleUnmeasured(kKernel, unmeasured.charged_ns, 0), 10 * kUs)
      << "an unmeasured launch is settled at the mean of what was learned, without the first launch";
  EXPECT_EQ(before - cell.budget_ns, static_cast<std::int64_t>(10 * kUs));
  EXPECT_EQ(limiter.in_flight_ns(), 0u);
}

// A launch that was not measured is settled at what such a launch costs: the mean of its kernel's last 64
// measurements. For one function launched at widely spread sizes (live over fakecuda: 62 % at a 30 % cap when
// unmeasured launches kept their median charge), and for a kernel whose run time depends on its data, long one
// launch in sixteen: at the median it was charged 1 ms for what costs 7.2 ms on average (docs/threat-model.md).
TEST(Limiter, AnUnmeasuredLaunchIsSettledAtWhatSuchALaunchCosts) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  const KernelKey mixed{reinterpret_cast<const void*>(0x1000), 1};
  for (int round = 0; round < 4; ++round) {
    for (const std::uint64_t measured : {100 * kUs, 100 * kUs, 1 * kMs, 10 * kMs}) {
      limiter.Settle(mixed, limiter.Admit(mixed, 0).charged_ns, measured, 0);
    }
  }
  std::int64_t before = cell.budget_ns;
  Admission a = limiter.Admit(mixed, 0);
  EXPECT_EQ(a.charged_ns, 1 * kMs) << "the launch charge is the median";
  limiter.SettleUnmeasured(mixed, a.charged_ns, 0);
  const std::int64_t settled = before - cell.budget_ns;
  EXPECT_EQ(settled, static_cast<std::int64_t>(2800 * kUs)) << "the mean";

  const KernelKey single{reinterpret_cast<const void*>(0x2000), 1};
  for (int i = 0; i < 15; ++i) limiter.Settle(single, limiter.Admit(single, 0).charged_ns, 1 * kMs, 0);
  limiter.Settle(single, limiter.Admit(single, 0).charged_ns, 100 * kMs, 0);
  before = cell.budget_ns;
  a = limiter.Admit(single, 0);
  limiter.SettleUnmeasured(single, a.charged_ns, 0);
  EXPECT_EQ(before - cell.budget_ns, static_cast<std::int64_t>((15 * kMs + 100 * kMs) / 16))
      << "the mean: the long run is not hidden under the median";
}

// A window: launches queued back to back on one stream, measured by one pair of events around them all. The budget
// pays exactly the total; each kernel learns its part, apportioned by its charges; without a measurement each
// launch is settled as an unmeasured one.
TEST(Limiter, AWindowIsChargedItsTotalAndEachKernelLearnsItsPart) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 1000, 20 * kMs, 0);
  LimiterConfig config = Share(1000);
  Limiter limiter(cell, config);
  const KernelKey small{reinterpret_cast<const void*>(0x1000), 1};
  const KernelKey large{reinterpret_cast<const void*>(0x2000), 1};
  limiter.Settle(small, limiter.Admit(small, 0).charged_ns, 10 * kUs, 0);
  limiter.Settle(large, limiter.Admit(large, 0).charged_ns, 100 * kUs, 0);
  std::vector<WindowLaunch> window;
  for (int i = 0; i < 6; ++i) window.push_back({small, limiter.Admit(small, 0).charged_ns});
  for (int i = 0; i < 2; ++i) window.push_back({large, limiter.Admit(large, 0).charged_ns});
  EXPECT_EQ(limiter.in_flight_ns(), 260 * kUs);
  const std::int64_t before = cell.budget_ns;  // the 260 us charged are already out
  // The kernels ran 1.5 times as long as estimated: 390 us in all.
  limiter.SettleWindow(window.data(), window.size(), 390 * kUs, 1 * kMs);
  EXPECT_EQ(before - cell.budget_ns, static_cast<std::int64_t>(130 * kUs)) << "the total, less what was charged";
  EXPECT_EQ(limiter.in_flight_ns(), 0u);
  // Each learned 1.5 times its estimate (the median of its two measurements is the later one).
  EXPECT_EQ(limiter.EstimateNs(small), 15 * kUs);
  EXPECT_EQ(limiter.EstimateNs(large), 150 * kUs);
  // Not measured (the events failed): each launch at the mean of its kernel's measurements.
  window.clear();
  window.push_back({small, limiter.Admit(small, 0).charged_ns});
  const std::int64_t unmeasured_before = cell.budget_ns;
  limiter.SettleWindow(window.data(), window.size(), std::nullopt, 2 * kMs);
  EXPECT_EQ(unmeasured_before - cell.budget_ns,
            static_cast<std::int64_t>((10 * kUs + 15 * kUs) / 2) - static_cast<std::int64_t>(15 * kUs));
  EXPECT_EQ(limiter.ignored_measurements(), 1u);
}

// The charge at launch is the median of the recent runs: one outlier moves it nowhere, a kernel that really became
// longer moves it within 8 runs.
TEST(Limiter, TheLaunchChargeIsTheMedianOfTheRecentRuns) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  for (const std::uint64_t measured : {1 * kMs, 2 * kMs, 3 * kMs, 4 * kMs, 100 * kMs}) {
    limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, measured, 0);
  }
  EXPECT_EQ(limiter.EstimateNs(kKernel), 3 * kMs);
  for (int i = 0; i < 16; ++i) limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 5 * kMs, 0);
  EXPECT_EQ(limiter.EstimateNs(kKernel), 5 * kMs);
}

TEST(Limiter, TheBudgetCanSaveUpForOneOfTheLongestKernels) {
  // 20 ms kernels at a 30 % share: share x burst is 6 ms, less than one kernel; the budget must still reach 20 ms
  // while others run, or refill earned meanwhile is lost (sim finding 2).
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 20 * kMs, 0);
  limiter.Admit(kKernel, 10'000 * kMs);  // long idle: refill to the cap
  limiter.Cancel(kKernel, limiter.EstimateNs(kKernel));
  EXPECT_GE(cell.budget_ns, static_cast<std::int64_t>(20 * kMs));
}

TEST(Limiter, QueuedUnmeasuredWorkIsBounded) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 1000, 20 * kMs, 0);
  LimiterConfig config = Share(1000);
  config.in_flight_max_ns = 10 * kMs;
  Limiter limiter(cell, config);
  const Admission learn = limiter.Admit(kKernel, 0);
  limiter.Settle(kKernel, learn.charged_ns, 4 * kMs, 0);
  EXPECT_FALSE(limiter.Admit(kKernel, 0).wait_for_completion);  // 4 ms queued
  EXPECT_FALSE(limiter.Admit(kKernel, 0).wait_for_completion);  // 8 ms
  EXPECT_TRUE(limiter.Admit(kKernel, 0).wait_for_completion);   // 12 ms > 10: settle something first
  limiter.Settle(kKernel, 4 * kMs, 4 * kMs, 5 * kMs);
  EXPECT_FALSE(limiter.Admit(kKernel, 5 * kMs).wait_for_completion);
}

TEST(Limiter, GarbageMeasurementsAreIgnoredAndNeverBlock) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  const Admission learn = limiter.Admit(kKernel, 0);
  limiter.Settle(kKernel, learn.charged_ns, 2 * kMs, 0);
  for (std::optional<std::uint64_t> garbage : {std::optional<std::uint64_t>{}, std::optional<std::uint64_t>{0},
                                               std::optional<std::uint64_t>{3'600'000 * kMs}}) {
    const Admission a = limiter.Admit(kKernel, 0);
    limiter.Settle(kKernel, a.charged_ns, garbage, 0);
  }
  EXPECT_EQ(limiter.ignored_measurements(), 3u);
  EXPECT_EQ(limiter.EstimateNs(kKernel), 2 * kMs);
  // The wait for the next launch is finite: the debt divided by the rate.
  const Admission next = limiter.Admit(kKernel, 0);
  EXPECT_LT(next.ready_at_ns, 100 * kMs);
}

TEST(Limiter, DisableMeasuresAndPublishesButNeverWaits) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 100, 20 * kMs, 0);
  LimiterConfig config = Share(100);
  config.throttle = false;
  Limiter limiter(cell, config);
  std::uint64_t now = 0;
  for (int i = 0; i < 1000; ++i, now += kMs) {
    const Admission a = limiter.Admit(kKernel, now);
    EXPECT_EQ(a.ready_at_ns, now);
    limiter.Settle(kKernel, a.charged_ns, kMs, now + kMs);
  }
  EXPECT_NEAR(Limiter::PublishedShare(cell, now), 1.0, 0.01);
}

// Busy time is recorded over the interval each run measured, in 10 ms buckets, so it can be compared with NVML's
// sample periods (the `default` policy): read back over any period, partial buckets pro rata.
TEST(Limiter, BusyTimeIsRecordedOverTheIntervalARunMeasured) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 1000, 20 * kMs, 0);
  LimiterConfig config = Share(1000);
  config.throttle = false;
  Limiter limiter(cell, config);
  // A 30 ms run settled at 1050 ms ran over [1020, 1050).
  limiter.Settle(kKernel, limiter.Admit(kKernel, 1000 * kMs).charged_ns, 30 * kMs, 1050 * kMs);
  EXPECT_NEAR(Limiter::BusyFraction(cell, 1020 * kMs, 1050 * kMs), 1.0, 1e-9);
  EXPECT_NEAR(Limiter::BusyFraction(cell, 1000 * kMs, 1020 * kMs), 0.0, 1e-9);
  EXPECT_NEAR(Limiter::BusyFraction(cell, 1040 * kMs, 1080 * kMs), 10.0 / 40.0, 1e-9);
  EXPECT_NEAR(Limiter::BusyFraction(cell, 1045 * kMs, 1055 * kMs), 0.5, 1e-9);  // half of a full bucket
  EXPECT_NEAR(Limiter::BusyFraction(cell, 1000 * kMs, 1200 * kMs), 30.0 / 200.0, 1e-9);
  // A run that straddles buckets is split between them: 10 ms settled at 1075 ms, [1065, 1075).
  limiter.Settle(kKernel, limiter.Admit(kKernel, 1060 * kMs).charged_ns, 10 * kMs, 1075 * kMs);
  EXPECT_NEAR(Limiter::BusyFraction(cell, 1060 * kMs, 1070 * kMs), 0.5, 1e-9);
  EXPECT_NEAR(Limiter::BusyFraction(cell, 1070 * kMs, 1080 * kMs), 0.5, 1e-9);
  // Periods the ring no longer holds (over 1.28 s old) read as idle, not as stale numbers.
  limiter.Settle(kKernel, limiter.Admit(kKernel, 3000 * kMs).charged_ns, kMs, 3000 * kMs);
  EXPECT_EQ(Limiter::BusyFraction(cell, 1000 * kMs, 1200 * kMs), 0.0);
  EXPECT_EQ(Limiter::BusyFraction(cell, 5 * kMs, 5 * kMs), 0.0);
}

// A serial GPU fed by one closed-loop tenant: each kernel starts when admitted and the GPU is free.
double AchievedShare(std::uint32_t permille, std::uint64_t kernel_ns, std::uint64_t seconds) {
  BudgetCell cell{};
  Limiter::InitCell(cell, permille, 20 * kMs, 0);
  Limiter limiter(cell, Share(permille));
  std::uint64_t now = 0, busy_after_settling = 0;
  const std::uint64_t settle = 1000 * kMs, end = seconds * 1000 * kMs;
  while (now < end) {
    const Admission a = limiter.Admit(kKernel, now);
    const std::uint64_t start = std::max(now, a.ready_at_ns);
    const std::uint64_t finish = start + kernel_ns;
    limiter.Settle(kKernel, a.charged_ns, kernel_ns, finish);
    if (start >= settle && finish <= end) busy_after_settling += kernel_ns;
    now = finish;
  }
  return static_cast<double>(busy_after_settling) / static_cast<double>(end - settle);
}

TEST(Limiter, ASerialTenantGetsItsShareForLongAndShortKernels) {
  for (std::uint32_t permille : {100u, 300u, 500u, 700u, 900u}) {
    for (std::uint64_t kernel : {20 * kMs, 5 * kUs, 1 * kMs}) {
      EXPECT_NEAR(AchievedShare(permille, kernel, 5), permille / 1000.0, 0.02)
          << permille / 10 << " % with kernels of " << kernel << " ns";
    }
  }
}

// The cell lives in the region, which every process of the container can write (docs/threat-model.md). A process
// that keeps writing itself a full budget and a lending rate before every launch still gets its share: it is also
// held by its own count, kept in its own memory. Without that count it got the whole GPU (~100 %).
TEST(Limiter, AProcessThatRewritesTheCellIsStillHeldToItsShare) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  std::uint64_t now = 0, busy = 0;
  constexpr std::uint64_t kSeconds = 5;
  while (now < kSeconds * 1000 * kMs) {
    cell.budget_ns = std::int64_t{1} << 50;  // the hostile writes
    cell.rate_permille = 1000;
    const Admission admission = limiter.Admit(kKernel, now);
    now = std::max(now, admission.ready_at_ns);
    now += kMs;  // a serial GPU: the kernel runs 1 ms, then the next launch
    limiter.Settle(kKernel, admission.charged_ns, kMs, now);
    busy += kMs;
  }
  EXPECT_NEAR(static_cast<double>(busy) / static_cast<double>(now), 0.30, 0.01);
}

TEST(Limiter, AProcessScaledByTheNodeMonitorGetsThatPartOfItsShareWhateverTheCellSays) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  limiter.ScaleOwn(500, 0);
  EXPECT_EQ(limiter.own_scale_permille(), 500u);
  std::uint64_t now = 0, busy = 0;
  while (now < 5000 * kMs) {
    cell.budget_ns = std::int64_t{1} << 50;  // colluders' writes: only the process's own count holds it
    cell.rate_permille = 1000;
    const Admission admission = limiter.Admit(kKernel, now);
    now = std::max(now, admission.ready_at_ns);
    now += kMs;
    limiter.Settle(kKernel, admission.charged_ns, kMs, now);
    busy += kMs;
  }
  EXPECT_NEAR(static_cast<double>(busy) / static_cast<double>(now), 0.15, 0.01);
  limiter.ScaleOwn(0, now);
  EXPECT_EQ(limiter.own_scale_permille(), 1u) << "never zero: the process still runs";
  limiter.ScaleOwn(5000, now);
  EXPECT_EQ(limiter.own_scale_permille(), 1000u);
}

TEST(Limiter, TheMonitorsScaleFollowsTheContainersUseOutsideAMargin) {
  EXPECT_EQ(NextMonitorScale(1000, 600, 300), 500u) << "two colluders at 30 % each: each to half";
  EXPECT_EQ(NextMonitorScale(500, 300, 300), 500u) << "held: kept";
  EXPECT_EQ(NextMonitorScale(500, 340, 300), 500u) << "within the margin: kept";
  EXPECT_EQ(NextMonitorScale(1000, 340, 300), 1000u) << "an honest container a few points over in NVML: untouched";
  EXPECT_EQ(NextMonitorScale(500, 150, 300), 1000u) << "one colluder left: back up";
  EXPECT_EQ(NextMonitorScale(500, 200, 300), 750u);
  EXPECT_EQ(NextMonitorScale(500, 0, 300), 1000u) << "idle: back to the share";
  EXPECT_EQ(NextMonitorScale(1000, 1000, 10), kMonitorLeastScalePermille) << "never below the least scale";
  EXPECT_EQ(NextMonitorScale(200, 1000, 0), 1000u) << "no limit: no scale";
}

TEST(Limiter, DefaultPolicyLendsTheIdleGpuAndTakesItBack) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  LimiterConfig config = Share(300);
  config.lend_when_idle = true;
  Limiter limiter(cell, config);
  limiter.ObserveOthers(0.0, 0);
  EXPECT_EQ(cell.rate_permille, 1000u);
  limiter.ObserveOthers(0.5, 10 * kMs);
  EXPECT_EQ(cell.rate_permille, 300u);
  EXPECT_LE(cell.budget_ns, static_cast<std::int64_t>(6 * kMs)) << "no hoard survives handing the GPU back";
}

}  // namespace
}  // namespace vgpu::policy

namespace vgpu::policy {
namespace {

TEST(Limiter, AKernelNeverMeasuredHasOneLaunchInFlight) {
  // Its cost is unknown (the 100 us default may be 300 times too low): a queue of them could overrun the cap.
  BudgetCell cell{};
  Limiter::InitCell(cell, 500, 20 * kMs, 0);
  Limiter limiter(cell, Share(500));
  const Admission first = limiter.Admit(kKernel, 0);
  EXPECT_FALSE(first.wait_for_completion);
  EXPECT_TRUE(limiter.Admit(kKernel, 0).wait_for_completion);
  const Admission forced = limiter.Admit(kKernel, 0, /*bound_in_flight=*/false);
  EXPECT_FALSE(forced.wait_for_completion) << "a caller that waited long enough";
  limiter.Settle(kKernel, first.charged_ns, 30 * kMs, 30 * kMs);
  limiter.Settle(kKernel, forced.charged_ns, 30 * kMs, 60 * kMs);
  EXPECT_EQ(limiter.in_flight_ns(), 0u);
  EXPECT_FALSE(limiter.Admit(kKernel, 60 * kMs).wait_for_completion) << "measured now: the usual bound applies";
}

TEST(Limiter, AKernelNeverMeasuredHasOneLaunchInFlightEvenUnthrottled) {
  // `disable` measures too: a second launch of a kernel of unknown cost would be timed across the first.
  BudgetCell cell{};
  Limiter::InitCell(cell, 500, 20 * kMs, 0);
  LimiterConfig config = Share(500);
  config.throttle = false;
  Limiter limiter(cell, config);
  const Admission first = limiter.Admit(kKernel, 0);
  EXPECT_FALSE(first.wait_for_completion);
  EXPECT_FALSE(first.known);
  EXPECT_TRUE(limiter.Admit(kKernel, 0).wait_for_completion);
  limiter.Settle(kKernel, first.charged_ns, 30 * kMs, 30 * kMs);
  const Admission next = limiter.Admit(kKernel, 30 * kMs);
  EXPECT_FALSE(next.wait_for_completion);
  EXPECT_TRUE(next.known);
  EXPECT_TRUE(limiter.Known(kKernel));
}

TEST(Limiter, AdmissionsCountTheKernelsLaunchesForTheCallersSampling) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 500, 20 * kMs, 0);
  Limiter limiter(cell, Share(500));
  const KernelKey other{reinterpret_cast<const void*>(0x1000), 43};  // same function, another shape
  for (std::uint32_t i = 0; i < 5; ++i) {
    const Admission a = limiter.Admit(kKernel, 0);
    EXPECT_EQ(a.launches, i);
    limiter.Settle(kKernel, a.charged_ns, 10 * kUs, 0);
  }
  EXPECT_EQ(limiter.Admit(other, 0).launches, 0u) << "counted per function and shape";
  EXPECT_EQ(limiter.Admit(kKernel, 0).launches, 5u);
}

// The shim settles an unmeasured launch in its admission's critical section, before the driver has the launch; when
// the driver refuses it, Refund must leave the budget as if it had never been admitted.
TEST(Limiter, AnUnmeasuredLaunchSettledBeforeItRunsIsRefundedWhenRefused) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  LimiterConfig config = Share(300);
  config.defer_busy = true;
  Limiter limiter(cell, config);
  for (int i = 0; i < 16; ++i) limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 200 * kUs, 0);
  limiter.FlushBusy();
  const std::int64_t budget = cell.budget_ns;
  const std::uint32_t busy = cell.busy_ns[0];
  const Admission a = limiter.Admit(kKernel, 0);
  const std::uint64_t accounted = limiter.SettleUnmeasured(kKernel, a.charged_ns, 0);
  EXPECT_EQ(accounted, 200 * kUs);
  EXPECT_EQ(budget - cell.budget_ns, static_cast<std::int64_t>(accounted));
  limiter.Refund(kKernel, 1, accounted);
  limiter.FlushBusy();
  EXPECT_EQ(cell.budget_ns, budget) << "nothing ran, nothing is owed";
  EXPECT_EQ(cell.busy_ns[0], busy) << "and no busy time is published for it";
  EXPECT_EQ(limiter.in_flight_ns(), 0u);
}

// Deferred busy time (the shim's unmeasured launches): held per 10 ms bucket and added when the next bucket begins or
// at a flush, into the bucket it belongs to.
TEST(Limiter, DeferredBusyTimeReachesItsBucketAtTheNextBucketOrAFlush) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 500, 20 * kMs, 0);
  LimiterConfig config = Share(500);
  config.defer_busy = true;
  Limiter limiter(cell, config);
  for (int i = 0; i < 16; ++i) limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 100 * kUs, 1 * kMs);
  const std::uint32_t measured = cell.busy_ns[0];
  EXPECT_EQ(measured, 1600 * kUs) << "measured runs are published at once";
  for (int i = 0; i < 10; ++i) limiter.SettleUnmeasured(kKernel, limiter.Admit(kKernel, 2 * kMs).charged_ns, 2 * kMs);
  EXPECT_EQ(cell.busy_ns[0], measured) << "held";
  limiter.SettleUnmeasured(kKernel, limiter.Admit(kKernel, 12 * kMs).charged_ns, 12 * kMs);
  EXPECT_EQ(cell.busy_ns[0], measured + 1000 * kUs) << "the next bucket began: the first one's share is added to it";
  EXPECT_EQ(cell.busy_ns[1], 0u);
  limiter.FlushBusy();
  EXPECT_EQ(cell.busy_ns[1], 100 * kUs);
  EXPECT_EQ(cell.busy_ns[0], measured + 1000 * kUs);
  limiter.FlushBusy();
  EXPECT_EQ(cell.busy_ns[1], 100 * kUs) << "a flush adds nothing twice";
}

// A book (the shim's fast path): further unmeasured launches admitted and settled at once, only from the budget there
// is (a book never waits and leaves no debt), no more than its GPU time allows; what goes unused comes back.
TEST(Limiter, ABookTakesOnlyTheBudgetThereIsAndGivesBackWhatGoesUnused) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  LimiterConfig config = Share(300);
  config.defer_busy = true;
  Limiter limiter(cell, config);
  std::uint64_t each = 0;
  EXPECT_EQ(limiter.AdmitBook(kKernel, 0, 32, 200 * kUs, each), 0u) << "a kernel never measured gets no book";
  for (int i = 0; i < 16; ++i) limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 5 * kUs, 0);
  limiter.FlushBusy();
  const std::int64_t full = cell.budget_ns;
  const std::uint32_t busy = cell.busy_ns[0];
  EXPECT_EQ(limiter.AdmitBook(kKernel, 0, 32, 200 * kUs, each), 32u);
  EXPECT_EQ(each, 5 * kUs) << "each launch at what such a launch costs";
  EXPECT_EQ(full - cell.budget_ns, static_cast<std::int64_t>(32 * 5 * kUs));
  EXPECT_EQ(limiter.AdmitBook(kKernel, 0, 32, 100 * kUs, each), 20u) << "no more than the book's GPU time";
  limiter.Refund(kKernel, 12, each);
  limiter.FlushBusy();
  EXPECT_EQ(full - cell.budget_ns, static_cast<std::int64_t>(40 * 5 * kUs)) << "40 launches made";
  EXPECT_EQ(cell.busy_ns[0] - busy, 40 * 5 * kUs);
  EXPECT_EQ(limiter.in_flight_ns(), 0u);

  // Near the end of the budget: only what it holds; none once it is spent (the whole path then waits exactly).
  cell.budget_ns = static_cast<std::int64_t>(12 * kUs);
  EXPECT_EQ(limiter.AdmitBook(kKernel, 0, 32, 200 * kUs, each), 2u);
  EXPECT_EQ(cell.budget_ns, static_cast<std::int64_t>(2 * kUs));
  EXPECT_EQ(limiter.AdmitBook(kKernel, 0, 32, 200 * kUs, each), 0u);
  EXPECT_GE(cell.budget_ns, 0) << "a book leaves no debt";
}

// The process's own count binds books too: a process that rewrites the shared cell gets no book past its share.
TEST(Limiter, ABookIsHeldToThisProcesssOwnCount) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  Limiter limiter(cell, Share(300));
  for (int i = 0; i < 16; ++i) limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 100 * kUs, 0);
  std::uint64_t each = 0;
  std::uint64_t admitted = 0;
  for (int round = 0; round < 1000; ++round) {
    cell.budget_ns = static_cast<std::int64_t>(1'000 * kMs);  // rewritten: "plenty"
    admitted += limiter.AdmitBook(kKernel, 0, 32, 10 * kMs, each);
  }
  EXPECT_LE(admitted * each, 6 * kMs + 16 * 100 * kUs) << "no more than the burst this process's own count holds";
}

// A book into a measurement window: launches charged now at the kernel's estimate (as Admit charges each), held by
// the budget there is and the in-flight bound, settled with the window (the ones made) or cancelled (the rest).
TEST(Limiter, AWindowBookIsChargedNowAndSettledWithItsWindowOrCancelled) {
  BudgetCell cell{};
  Limiter::InitCell(cell, 300, 20 * kMs, 0);
  LimiterConfig config = Share(300);
  config.in_flight_max_ns = 400 * kUs;
  Limiter limiter(cell, config);
  std::uint64_t each = 0;
  EXPECT_EQ(limiter.AdmitWindowBook(kKernel, 0, 64, 200 * kUs, each), 0u) << "a kernel never measured gets no book";
  for (int i = 0; i < 16; ++i) limiter.Settle(kKernel, limiter.Admit(kKernel, 0).charged_ns, 5 * kUs, 0);
  const std::int64_t full = cell.budget_ns;
  EXPECT_EQ(limiter.AdmitWindowBook(kKernel, 0, 64, 200 * kUs, each), 40u) << "no more than the book's GPU time";
  EXPECT_EQ(each, 5 * kUs) << "charged at the estimate";
  EXPECT_EQ(full - cell.budget_ns, static_cast<std::int64_t>(40 * 5 * kUs));
  EXPECT_EQ(limiter.in_flight_ns(), 40 * 5 * kUs) << "queued, not settled";
  EXPECT_EQ(limiter.AdmitWindowBook(kKernel, 0, 64, 1 * kMs, each), 40u) << "the in-flight bound: 400 us in all";
  EXPECT_EQ(limiter.AdmitWindowBook(kKernel, 0, 64, 1 * kMs, each), 0u);

  // 30 of the first book's launches made, measured by their window at 3 us each; the other 50 never made.
  std::vector<WindowLaunch> window(30, WindowLaunch{kKernel, each});
  limiter.SettleWindow(window.data(), window.size(), 30 * 3 * kUs, 0);
  limiter.Cancel(kKernel, 50 * each);
  EXPECT_EQ(full - cell.budget_ns, static_cast<std::int64_t>(30 * 3 * kUs)) << "what the window measured, no more";
  EXPECT_EQ(limiter.in_flight_ns(), 0u);
  EXPECT_EQ(limiter.EstimateNs(kKernel), 5 * kUs) << "one window: one measurement among the 16 (the median stands)";

  // Near the end of the budget: only what it holds, and no debt.
  cell.budget_ns = static_cast<std::int64_t>(12 * kUs);
  EXPECT_EQ(limiter.AdmitWindowBook(kKernel, 0, 64, 200 * kUs, each), 2u);
  EXPECT_EQ(limiter.AdmitWindowBook(kKernel, 0, 64, 200 * kUs, each), 0u);
  EXPECT_GE(cell.budget_ns, 0) << "a book leaves no debt";
}

}  // namespace
}  // namespace vgpu::policy
