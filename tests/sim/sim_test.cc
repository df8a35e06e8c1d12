// The compute limiter on fakecuda's device model under a virtual clock (issue 4, "What must be shown"): caps of one
// tenant for four kernel shapes, tenants side by side, the `default` and `disable` policies, determinism, and the
// KnownGap tests that pin what the limiter and the model still get wrong (sim/core/README.md, "Findings"; each runs as
// a strict expected failure: tests/CMakeLists.txt, vgpu_discover_known_gaps).
// Each run prints its summary, seed first: a failure is repeated from that seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "random.h"
#include "vgpu/sim/sim.h"

namespace vgpu::sim {
namespace {

constexpr double kMeanTolerance = 0.02;    // the share over all windows after settling: within 2 points
constexpr double kWindowTolerance = 0.05;  // no single 1 s window off by more than 5 points

Tenant OneProcess(const std::string& name, std::uint32_t share_percent, const Workload& workload,
                  Policy policy = Policy::force, std::uint64_t start_ns = 0) {
  Tenant tenant;
  tenant.name = name;
  tenant.share_percent = share_percent;
  tenant.policy = policy;
  Process process;
  process.workload = workload;
  process.start_ns = start_ns;
  tenant.processes.push_back(process);
  return tenant;
}

Scenario Of(std::vector<Tenant> tenants, std::uint64_t seed = 1) {
  Scenario scenario;  // h100-80gb, 2 ms time slices, 6 s with 1 s of settling, 1 s windows
  scenario.seed = seed;
  scenario.tenants = std::move(tenants);
  return scenario;
}

Result RunAndPrint(const Scenario& scenario) {
  Result result = sim::Run(scenario);
  std::fputs(Summary(result).c_str(), stdout);
  EXPECT_EQ(result.error, "");
  EXPECT_EQ(result.late_reactions, 0u) << "the event loop let a process act later than it should have";
  return result;
}

// Every tenant's share is its cap: the mean after settling within 2 points, every window within 5.
void ExpectCapsHeld(const Result& result) {
  for (const TenantResult& tenant : result.tenants) {
    EXPECT_NEAR(tenant.mean_share, tenant.cap, kMeanTolerance) << "tenant " << tenant.name << ", seed " << result.seed;
    EXPECT_LE(tenant.worst_window_error, kWindowTolerance) << "tenant " << tenant.name << ", seed " << result.seed;
  }
}

// ---- one tenant, each cap, each kernel shape ------------------------------------------------------------------

enum class Shape { persistent_20ms, back_to_back_5us, mixed, sync_loop };

Workload WorkloadOf(Shape shape) {
  switch (shape) {
    case Shape::persistent_20ms:
      return Persistent(20 * kMillisecondNs);
    case Shape::back_to_back_5us:
      return BackToBack(5 * kMicrosecondNs);
    case Shape::mixed:
      return Mixed();
    case Shape::sync_loop:
      return SyncLoop(500 * kMicrosecondNs);
  }
  return {};
}

class OneTenant : public ::testing::TestWithParam<std::tuple<Shape, std::uint32_t>> {};

TEST_P(OneTenant, HoldsItsCapInEveryWindow) {
  const auto [shape, cap] = GetParam();
  const Result result = RunAndPrint(Of({OneProcess("a", cap, WorkloadOf(shape))}));
  ASSERT_EQ(result.tenants.size(), 1u);
  EXPECT_GT(result.tenants[0].kernels, 0u);
  ExpectCapsHeld(result);
}

std::string OneTenantName(const ::testing::TestParamInfo<OneTenant::ParamType>& info) {
  static const char* const kNames[] = {"Persistent20ms", "BackToBack5us", "Mixed5usTo20ms", "SyncLoop500us"};
  return std::string(kNames[static_cast<int>(std::get<0>(info.param))]) + "_Cap" +
         std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Caps, OneTenant,
                         ::testing::Combine(::testing::Values(Shape::persistent_20ms, Shape::back_to_back_5us,
                                                              Shape::mixed, Shape::sync_loop),
                                            ::testing::Values(10u, 30u, 50u, 70u, 90u)),
                         OneTenantName);

// ---- tenants side by side under `force` ------------------------------------------------------------------------

TEST(Force, ThirtySeventyWithOneMillisecondKernels) {
  ExpectCapsHeld(RunAndPrint(
      Of({OneProcess("a", 30, Persistent(kMillisecondNs, 4)), OneProcess("b", 70, Persistent(kMillisecondNs, 4))})));
}

TEST(Force, ThirtySeventyWithFiveMicrosecondKernels) {
  ExpectCapsHeld(RunAndPrint(
      Of({OneProcess("a", 30, BackToBack(5 * kMicrosecondNs)), OneProcess("b", 70, BackToBack(5 * kMicrosecondNs))})));
}

TEST(Force, TenTwentyThirtyFortyWithOneMillisecondKernels) {
  ExpectCapsHeld(RunAndPrint(
      Of({OneProcess("a", 10, Persistent(kMillisecondNs, 4)), OneProcess("b", 20, Persistent(kMillisecondNs, 4)),
          OneProcess("c", 30, Persistent(kMillisecondNs, 4)), OneProcess("d", 40, Persistent(kMillisecondNs, 4))})));
}

TEST(Force, ProcessesOfOneTenantShareItsBudget) {
  Tenant a = OneProcess("a", 30, Persistent(kMillisecondNs, 4));
  a.processes.push_back(a.processes[0]);
  Tenant b = OneProcess("b", 50, BackToBack(5 * kMicrosecondNs));
  b.processes.push_back(b.processes[0]);
  b.processes.push_back(b.processes[0]);
  ExpectCapsHeld(RunAndPrint(Of({a, b})));
}

// Known gap (finding 1 in sim/core/README.md; finding 2 is fixed): kernels longer than a time slice are measured with
// the other tenant's slices inside them. Observed: a 21.0 %, b 62.0 % (seed 1).
TEST(Force, KnownGapThirtySeventyWithMixedKernels) {
  ExpectCapsHeld(RunAndPrint(Of({OneProcess("a", 30, Mixed()), OneProcess("b", 70, Mixed())})));
}

// Known gap, as above. Observed: a 4.4 %, b 15.7 %, c 25.6 %, d 35.3 % (seed 1).
TEST(Force, KnownGapTenTwentyThirtyFortyWithMixedKernels) {
  ExpectCapsHeld(RunAndPrint(Of({OneProcess("a", 10, Mixed()), OneProcess("b", 20, Mixed()),
                                 OneProcess("c", 30, Mixed()), OneProcess("d", 40, Mixed())})));
}

// Known gap, as above. Observed: a 17.2 % (its 20 ms kernels measure 30-38 ms), b 61.6 % (seed 1).
TEST(Force, KnownGapThirtySeventyWithPersistentTwentyMillisecondKernels) {
  ExpectCapsHeld(RunAndPrint(Of(
      {OneProcess("a", 30, Persistent(20 * kMillisecondNs)), OneProcess("b", 70, Persistent(20 * kMillisecondNs))})));
}

// Finding 7, fixed: measured as the shim's event pair does (from when the stream reached the start event), 1 ms
// kernels that queued behind other tenants' slices were inflated too, though they fit in a slice, while fakecuda
// completed a marker before its process's turn; b was charged up to 4 ms per 1 ms kernel: 10.0, 15.7, 30.0, 40.1 %
// (seed 1). Markers now wait for the turn, as the real GPU writes the timestamp when the context runs.
TEST(Force, TenTwentyThirtyFortyWithOneMillisecondKernelsMeasuredByAnEventPair) {
  Scenario scenario =
      Of({OneProcess("a", 10, Persistent(kMillisecondNs, 4)), OneProcess("b", 20, Persistent(kMillisecondNs, 4)),
          OneProcess("c", 30, Persistent(kMillisecondNs, 4)), OneProcess("d", 40, Persistent(kMillisecondNs, 4))});
  scenario.measurement = Measurement::event_pair;
  ExpectCapsHeld(RunAndPrint(scenario));
}

// One tenant alone is not affected by how its kernels are measured: nothing preempts them.
TEST(Force, OneTenantHoldsItsCapMeasuredByAnEventPair) {
  for (const Shape shape : {Shape::persistent_20ms, Shape::back_to_back_5us, Shape::mixed, Shape::sync_loop}) {
    for (const std::uint32_t cap : {10u, 50u, 90u}) {
      Scenario scenario = Of({OneProcess("a", cap, WorkloadOf(shape))});
      scenario.measurement = Measurement::event_pair;
      ExpectCapsHeld(RunAndPrint(scenario));
    }
  }
}

// The two mechanisms above are the whole story: told each kernel's own GPU time and given a budget that holds a
// whole 20 ms kernel, the same limiter holds mixed and persistent tenants side by side.
TEST(Force, MixedTenantsHoldTheirCapsWhenMeasuredWithoutPreemptionAndWithARoomierBudget) {
  for (const Workload& workload : {Mixed(), Persistent(20 * kMillisecondNs)}) {
    Scenario scenario = Of({OneProcess("a", 30, workload), OneProcess("b", 70, workload)});
    scenario.measurement = Measurement::run_time;
    for (Tenant& tenant : scenario.tenants) tenant.burst_ns = 100 * kMillisecondNs;
    ExpectCapsHeld(RunAndPrint(scenario));
  }
  Scenario four = Of({OneProcess("a", 10, Mixed()), OneProcess("b", 20, Mixed()), OneProcess("c", 30, Mixed()),
                      OneProcess("d", 40, Mixed())});
  four.measurement = Measurement::run_time;
  for (Tenant& tenant : four.tenants) tenant.burst_ns = 100 * kMillisecondNs;
  ExpectCapsHeld(RunAndPrint(four));
}

// A tenant launching on a schedule gets what it asks for below its cap, and its cap above it.
TEST(Force, ARateBelowTheCapIsServedAndOneAboveItIsCapped) {
  const Result result = RunAndPrint(Of({OneProcess("asks-10", 50, Rate(1000, 100 * kMicrosecondNs)),
                                        OneProcess("asks-40", 20, Rate(2000, 200 * kMicrosecondNs))}));
  ASSERT_EQ(result.tenants.size(), 2u);
  EXPECT_NEAR(result.tenants[0].mean_share, 0.10, 0.005);
  EXPECT_NEAR(result.tenants[1].mean_share, 0.20, kMeanTolerance);
  EXPECT_LE(result.tenants[1].worst_window_error, kWindowTolerance);
}

// ---- `default` and `disable` -----------------------------------------------------------------------------------

// A tenant capped at 30 % under `default` runs alone for 3 s, then one capped at 70 % (`force`) arrives.
Scenario LoneThenArrival(OthersEstimate estimate) {
  Scenario scenario = Of({OneProcess("a", 30, Persistent(kMillisecondNs, 4), Policy::default_policy),
                          OneProcess("b", 70, Persistent(kMillisecondNs, 4), Policy::force, 3 * kSecondNs)});
  scenario.duration_ns = 7 * kSecondNs;
  scenario.others_estimate = estimate;
  return scenario;
}

void ExpectFreeAloneThenShare(const Result& result) {
  ASSERT_EQ(result.tenants.size(), 2u);
  const TenantResult& a = result.tenants[0];
  const TenantResult& b = result.tenants[1];
  ASSERT_EQ(a.window_shares.size(), 7u);
  for (std::size_t w = 1; w < 3; ++w) {
    EXPECT_GE(a.window_shares[w], 0.90) << "alone, window " << w << ", seed " << result.seed;
  }
  // Within a second of b's arrival at 3 s, a is back at its share and b has its own.
  for (std::size_t w = 4; w < 7; ++w) {
    EXPECT_NEAR(a.window_shares[w], 0.30, kMeanTolerance) << "window " << w << ", seed " << result.seed;
    EXPECT_NEAR(b.window_shares[w], 0.70, kMeanTolerance) << "window " << w << ", seed " << result.seed;
  }
}

TEST(DefaultPolicy, ALoneTenantRunsFreeAndFallsToItsShareWithinASecondOfAnArrival) {
  ExpectFreeAloneThenShare(RunAndPrint(LoneThenArrival(OthersEstimate::nvml_minus_same_window)));
}

// What the shim computes: NVML's sample minus the container's busy time over the same period, read from the shared
// cell's 10 ms buckets (Limiter::BusyFraction).
TEST(DefaultPolicy, TheShimsSamePeriodEstimateLendsAloneAndFallsToTheShareOnArrival) {
  ExpectFreeAloneThenShare(RunAndPrint(LoneThenArrival(OthersEstimate::nvml_minus_cell_busy)));
}

// The old shim's input (finding 3). NVML's 200 ms sample minus the limiter's PublishedShare over the last 750 ms in
// 250 ms buckets compared two different intervals: alone, the tenant flipped between 30 % and 100 % every 200-400 ms
// (72-79 % per window). PublishedShare now reads the last whole second of 10 ms buckets, and this input holds too
// (found when the known gaps began to run, 2026-11-29); the shim keeps the same-period estimate above.
TEST(DefaultPolicy, ALoneTenantRunsFreeWhenOthersAreNvmlMinusPublishedShare) {
  ExpectFreeAloneThenShare(RunAndPrint(LoneThenArrival(OthersEstimate::nvml_minus_published_share)));
}

TEST(DisablePolicy, MeasuresButNeverThrottles) {
  const Result result = RunAndPrint(Of({OneProcess("a", 30, Persistent(kMillisecondNs, 4), Policy::disable)}));
  ASSERT_EQ(result.tenants.size(), 1u);
  EXPECT_GE(result.tenants[0].mean_share, 0.99);
}

// ---- findings in the limiter and the model (KnownGap where they still fail) --------------------------------------

// FAILS (finding 4): a kernel is accounted at min(measured, least of its last 16 measurements), so a kernel whose
// duration varies is undercharged by the spread. 1 ms kernels varying +/-10 %: observed 32.9 % at a cap of 30,
// 98.9 % at a cap of 90 (seed 1).
TEST(LimiterFindings, KernelsWhoseDurationVariesAreChargedWhatTheyRan) {
  for (const std::uint32_t cap : {30u, 90u}) {
    Workload workload = Persistent(kMillisecondNs, 4);
    workload.jitter_permille = 100;
    ExpectCapsHeld(RunAndPrint(Of({OneProcess("a", cap, workload)})));
  }
}

// FAILS (finding 5): sizes launched as one function with one shape (vgpu-tenant's spin kernel takes its duration as
// an argument) are all accounted as the smallest. Observed: 100 % at a cap of 30 (seed 1).
TEST(LimiterFindings, SizesOfOneFunctionAndShapeAreChargedWhatTheyRan) {
  Workload workload = Mixed();
  workload.sizes_share_one_kernel = true;
  ExpectCapsHeld(RunAndPrint(Of({OneProcess("a", 30, workload)})));
}

// FAILS (finding 6): under time-slicing, when a second process arrives, how long the running one keeps the device
// depends on when the model was last advanced (slice_end is renewed only at steps of an uncontended device), so
// the same calls give different timelines. Observed: advanced once, b preempts a at once (b ends at 10 ms, a at
// 11 ms); advanced every 1 ms, a runs on to 10 ms and b ends at 11 ms.
TEST(ModelFindings, WhoRunsDoesNotDependOnHowOftenTheModelIsAdvanced) {
  namespace model = fakecuda::model;
  struct Recorder final : model::TimelineListener {
    void OnKernelComplete(const model::Machine& machine, std::uint32_t, std::uint32_t stream,
                          const model::Op& op) override {
      ends.push_back({machine.streams[stream].slot, op.end_ns});
    }
    std::vector<std::pair<std::uint32_t, std::uint64_t>> ends;
  };
  std::vector<std::pair<std::uint32_t, std::uint64_t>> by_granularity[2];
  for (int every_millisecond = 0; every_millisecond < 2; ++every_millisecond) {
    auto machine = std::make_unique<model::Machine>();
    model::InitMachine(*machine, model::DefaultConfig(), 0, 0);
    const std::uint32_t a = model::CreateStream(*machine, model::ClaimSlot(*machine, 1, 0), 0, 0, 0);
    const std::uint32_t b = model::CreateStream(*machine, model::ClaimSlot(*machine, 2, 0), 0, 0, 0);
    model::KernelLaunch launch{};
    launch.shape.grid[0] = launch.shape.grid[1] = launch.shape.grid[2] = 1;
    launch.shape.block[0] = 32;
    launch.shape.block[1] = launch.shape.block[2] = 1;
    launch.name = "k";
    launch.per_wave_ns = 10 * kMillisecondNs;
    Recorder recorder;
    ASSERT_EQ(model::EnqueueKernel(*machine, a, launch, 0, nullptr), model::EnqueueResult::ok);
    if (every_millisecond != 0) {
      for (std::uint64_t t = kMillisecondNs; t <= 9 * kMillisecondNs; t += kMillisecondNs) {
        model::Advance(*machine, 0, t, &recorder);
      }
    }
    model::Advance(*machine, 0, 9 * kMillisecondNs, &recorder);
    launch.per_wave_ns = kMillisecondNs;
    ASSERT_EQ(model::EnqueueKernel(*machine, b, launch, 9 * kMillisecondNs, nullptr), model::EnqueueResult::ok);
    model::Advance(*machine, 0, 30 * kMillisecondNs, &recorder);
    by_granularity[every_millisecond] = recorder.ends;
  }
  EXPECT_EQ(by_granularity[0], by_granularity[1]);
}

// ---- determinism -------------------------------------------------------------------------------------------------

Scenario MixedPair(std::uint64_t seed) {
  Scenario scenario = Of({OneProcess("a", 30, Mixed()), OneProcess("b", 50, Mixed())}, seed);
  scenario.duration_ns = 3 * kSecondNs;
  scenario.record_trace = true;
  for (Tenant& tenant : scenario.tenants) tenant.processes[0].workload.jitter_permille = 50;
  return scenario;
}

TEST(Determinism, TheSameScenarioAndSeedGiveTheSameTraceByteForByte) {
  const Result first = RunAndPrint(MixedPair(42));
  const Result second = RunAndPrint(MixedPair(42));
  ASSERT_GT(first.kernels, 500u);
  EXPECT_EQ(first.trace.size(), second.trace.size());
  EXPECT_TRUE(first.trace == second.trace) << "seed 42: the traces differ";
  EXPECT_EQ(first.trace_digest, second.trace_digest);
  EXPECT_NE(first.trace_digest, 0u);
}

TEST(Determinism, ADifferentSeedGivesADifferentTraceForTheMixedWorkload) {
  const Result first = RunAndPrint(MixedPair(42));
  const Result other = RunAndPrint(MixedPair(43));
  EXPECT_NE(first.trace_digest, other.trace_digest);
  EXPECT_NE(first.trace, other.trace);
}

TEST(Determinism, TheTraceIsJsonLinesThatStartWithTheSeed) {
  const Result result = RunAndPrint(MixedPair(7));
  ASSERT_FALSE(result.trace.empty());
  EXPECT_EQ(result.trace.rfind("{\"ev\":\"sim\",\"seed\":7,", 0), 0u) << result.trace.substr(0, 200);
  std::size_t kernel_lines = 0;
  std::size_t line_start = 0;
  while (line_start < result.trace.size()) {
    const std::size_t line_end = result.trace.find('\n', line_start);
    ASSERT_NE(line_end, std::string::npos) << "the trace ends without a newline";
    const std::string line = result.trace.substr(line_start, line_end - line_start);
    ASSERT_EQ(line.front(), '{') << line;
    ASSERT_EQ(line.back(), '}') << line;
    if (line.rfind("{\"ev\":\"kernel\",", 0) == 0) {
      ++kernel_lines;
      for (const char* field :
           {"\"tenant\":", "\"process\":", "\"start_ns\":", "\"end_ns\":", "\"charged_ns\":", "\"measured_ns\":"}) {
        EXPECT_NE(line.find(field), std::string::npos) << line;
      }
    }
    line_start = line_end + 1;
  }
  EXPECT_EQ(kernel_lines, result.kernels);
}

// The generator is SplitMix64 as published (Steele, Lea, Flood 2014): the same draws on every platform.
TEST(Determinism, SplitMix64DrawsThePublishedSequence) {
  SplitMix64 random(0);
  EXPECT_EQ(random.Next(), 0xe220a8397b1dcdafull);
  EXPECT_EQ(random.Next(), 0x6e789e6aa1b965f4ull);
  EXPECT_EQ(random.Next(), 0x06c45d188009454full);
  SplitMix64 bounded(1);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(bounded.Below(7), 7u);
}

// ---- schedules, crashes and samples (docs/scenarios.md: what the runner's virtual mode needs) -----------------------

Segment SegmentOf(std::uint64_t start_ns, std::uint64_t stop_ns, const Workload& workload) {
  Segment segment;
  segment.start_ns = start_ns;
  segment.stop_ns = stop_ns;
  segment.workload = workload;
  return segment;
}

// Busy time of window i from the window shares (busy / window_ns, so this is exact for whole nanoseconds).
std::uint64_t WindowBusyNs(const TenantResult& tenant, std::size_t i, std::uint64_t window_ns) {
  return static_cast<std::uint64_t>(std::llround(tenant.window_shares[i] * static_cast<double>(window_ns)));
}

// One process whose schedule runs 1 ms kernels for 2 s, idles for 1 s, then 2 ms kernels to the end, next to a
// busy tenant, is the same as two processes of the tenant, one for each stretch: neither has kernels in flight when
// the other runs, and closed loops of one size draw nothing from the generator.
TEST(Segments, RunAsSeparateProcessesOfTheTenantWould) {
  const Tenant busy = OneProcess("busy", 50, Persistent(kMillisecondNs));
  Tenant segmented;
  segmented.name = "x";
  segmented.share_percent = 30;
  Process schedule;
  schedule.segments = {SegmentOf(0, 2 * kSecondNs, Persistent(kMillisecondNs)),
                       SegmentOf(3 * kSecondNs, UINT64_MAX, Persistent(2 * kMillisecondNs))};
  segmented.processes = {schedule};
  Tenant separate = segmented;
  Process first;
  first.workload = Persistent(kMillisecondNs);
  first.stop_ns = 2 * kSecondNs;
  Process second;
  second.workload = Persistent(2 * kMillisecondNs);
  second.start_ns = 3 * kSecondNs;
  separate.processes = {first, second};

  Scenario one = Of({busy, segmented});
  one.sample_ns = 100 * kMillisecondNs;
  Scenario two = Of({busy, separate});
  two.sample_ns = 100 * kMillisecondNs;
  const Result a = RunAndPrint(one);
  const Result b = RunAndPrint(two);
  ASSERT_EQ(a.tenants.size(), 2u);
  ASSERT_EQ(b.tenants.size(), 2u);
  for (std::size_t t = 0; t < 2; ++t) {
    EXPECT_EQ(a.tenants[t].window_shares, b.tenants[t].window_shares) << a.tenants[t].name;
    EXPECT_EQ(a.tenants[t].busy_samples_ns, b.tenants[t].busy_samples_ns) << a.tenants[t].name;
    EXPECT_EQ(a.tenants[t].kernels, b.tenants[t].kernels) << a.tenants[t].name;
  }
  // Both stretches ran, at the cap while the other tenant is busy.
  EXPECT_NEAR(a.tenants[1].window_shares[1], 0.30, kMeanTolerance);
  EXPECT_NEAR(a.tenants[1].window_shares[4], 0.30, kMeanTolerance);
}

// The idle gap of a schedule shows as no busy growth in the samples (once the last kernels have drained), and the
// next segment starts on time.
TEST(Segments, AnIdleGapShowsAsNoBusyInTheSamples) {
  Tenant tenant;
  tenant.name = "a";
  tenant.share_percent = 0;
  Process process;
  process.segments = {SegmentOf(0, 2 * kSecondNs, Mixed()),
                      SegmentOf(3 * kSecondNs, 4500 * kMillisecondNs, BackToBack(5 * kMicrosecondNs)),
                      SegmentOf(5 * kSecondNs, 6 * kSecondNs, SyncLoop(kMillisecondNs))};
  tenant.processes = {process};
  Scenario scenario = Of({tenant});
  scenario.sample_ns = 50 * kMillisecondNs;
  const Result result = RunAndPrint(scenario);
  ASSERT_EQ(result.tenants.size(), 1u);
  const std::vector<std::uint64_t>& samples = result.tenants[0].busy_samples_ns;
  ASSERT_EQ(samples.size(), 120u);
  const auto at = [&](std::uint64_t t_ms) { return samples[t_ms / 50 - 1]; };
  // Alone and uncapped, a segment keeps the device busy (Mixed's largest kernels are 20 ms; 5 us ones lose a little
  // to the launch overhead), then nothing grows until the next segment starts.
  EXPECT_GT(at(2000) - at(1000), 900 * kMillisecondNs);
  for (std::uint64_t t = 2100; t <= 3000; t += 50) EXPECT_EQ(at(t), at(2050)) << "at " << t << " ms";
  EXPECT_GT(at(3050), at(3000));
  EXPECT_GT(at(4500) - at(3500), 500 * kMillisecondNs);
  for (std::uint64_t t = 4550; t <= 5000; t += 50) EXPECT_EQ(at(t), at(4550)) << "at " << t << " ms";
  EXPECT_GT(at(5050), at(5000));
  EXPECT_GT(at(6000) - at(5000), 950 * kMillisecondNs);  // a sync loop of 1 ms kernels: 3 us of launch each
  // 2 .. 3 s: only the kernels queued before 2 s (at most 4 of Mixed's, up to 20 ms each) ran, all before 2.1 s.
  EXPECT_EQ(WindowBusyNs(result.tenants[0], 2, scenario.window_ns), at(2100) - at(2000));
  EXPECT_LT(at(2100) - at(2000), 80 * kMillisecondNs);
}

// ---- measured as the shim measures (Measurement::shim, the default; vgpu/policy/measure.h) -----------------------

// How many of the trace's kernels were measured `how` ("pair", "window", "unmeasured").
std::size_t KernelsMeasuredBy(const Result& result, const std::string& how) {
  const std::string field = "\"measured_by\":\"" + how + "\"";
  std::size_t count = 0;
  for (std::size_t at = result.trace.find(field); at != std::string::npos; at = result.trace.find(field, at + 1)) {
    ++count;
  }
  return count;
}

// Launches queued back to back share windows (one event between windows); a loop that waits for each kernel never
// queues one behind another, so its launches get pairs (a 1 ms kernel: every one, MeasuredOneIn) and no window.
TEST(ShimMeasurement, LaunchesQueuedBackToBackShareWindowsAndASyncLoopGetsAPairEach) {
  Scenario queued = Of({OneProcess("a", 30, BackToBack(5 * kMicrosecondNs))});
  queued.duration_ns = 2 * kSecondNs;
  queued.record_trace = true;
  const Result many = RunAndPrint(queued);
  ExpectCapsHeld(many);
  EXPECT_GE(KernelsMeasuredBy(many, "pair"), 1u);  // its first launch: a kernel of unknown cost gets a pair
  EXPECT_GT(KernelsMeasuredBy(many, "window"), many.kernels * 9 / 10);
  EXPECT_EQ(KernelsMeasuredBy(many, "pair") + KernelsMeasuredBy(many, "window") + KernelsMeasuredBy(many, "unmeasured"),
            many.kernels);

  Scenario loop = Of({OneProcess("a", 30, SyncLoop(kMillisecondNs))});
  loop.duration_ns = 2 * kSecondNs;
  loop.record_trace = true;
  const Result each = RunAndPrint(loop);
  ExpectCapsHeld(each);
  EXPECT_EQ(KernelsMeasuredBy(each, "window"), 0u);
  EXPECT_EQ(KernelsMeasuredBy(each, "pair"), each.kernels);
}

// A window left open when its process stopped launching ends at the next launch, half a second later: it is charged
// the work it timed, not the idle gap (policy::WindowMeasuredNs; its idle tail runs from its own last launch). Charged
// the gap, the uncapped tenant's 1 ms kernels after it waited ~480 ms.
TEST(ShimMeasurement, AWindowLeftOpenOverAnIdleGapIsChargedItsWorkNotTheGap) {
  Tenant tenant;
  tenant.name = "a";
  tenant.share_percent = 0;
  Process process;
  process.segments = {SegmentOf(0, 1 * kSecondNs, BackToBack(5 * kMicrosecondNs)),
                      SegmentOf(1500 * kMillisecondNs, 3 * kSecondNs, SyncLoop(kMillisecondNs))};
  tenant.processes = {process};
  Scenario scenario = Of({tenant});
  scenario.duration_ns = 3 * kSecondNs;
  const Result result = RunAndPrint(scenario);
  ASSERT_EQ(result.tenants.size(), 1u);
  ASSERT_EQ(result.tenants[0].window_shares.size(), 3u);
  EXPECT_GT(result.tenants[0].window_shares[1], 0.49);  // busy from 1.5 s on
  EXPECT_GT(result.tenants[0].window_shares[2], 0.99);
}

// ---- time division (issue 20, docs/compute-sharing.md) ------------------------------------------------------

// The H100-calibrated device (2.09 ms slices, 160 us handovers, kernels measured by the shim's event pair), the
// tenants sharing it by time division on a 20 ms cycle that doubles (to 640 ms at most) until every window holds its
// tenant's longest kernel.
Scenario Divided(std::vector<Tenant> tenants, std::uint64_t seconds = 6) {
  Scenario scenario = Of(std::move(tenants));
  scenario.timeslice_ns = 2'090 * kMicrosecondNs;
  scenario.switch_ns = 160 * kMicrosecondNs;
  scenario.measurement = Measurement::event_pair;
  scenario.sharing = Sharing::time_division;
  scenario.cycle_ns = 20 * kMillisecondNs;
  scenario.cycle_max_ns = 640 * kMillisecondNs;
  scenario.duration_ns = seconds * kSecondNs;
  return scenario;
}

// Each tenant's mean share within 2 points of its cap, and the tenants together at least `together` of the GPU.
void ExpectSharesHeldTogether(const Result& result, double together) {
  double sum = 0;
  for (const TenantResult& tenant : result.tenants) {
    EXPECT_NEAR(tenant.mean_share, tenant.cap, kMeanTolerance) << "tenant " << tenant.name << ", seed " << result.seed;
    sum += tenant.mean_share;
  }
  EXPECT_GE(sum, together) << "seed " << result.seed;
}

// The kernels of a pair: one-wave 20 ms (queue 2), 1 ms (queue 4) or 5 us back to back (queue 8).
Workload PairWorkload(std::uint64_t kernel_ns) {
  if (kernel_ns < 100 * kMicrosecondNs) return BackToBack(kernel_ns);
  return kernel_ns >= 20 * kMillisecondNs ? Persistent(kernel_ns) : Persistent(kernel_ns, 4);
}

// The `q`-quantile of `values` (nearest rank).
std::uint64_t Quantile(std::vector<std::uint64_t> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
}

// Prompt service (docs/compute-sharing.md): a light service under a 30 % cap (a 1 ms kernel 47 times a second) beside
// a busy 70 % one with 64 launches queued waits for the busy one's queue (kept 2 ms ahead while the light one is
// idle), not for its own window: from its call to its kernel's end p99 4.1 ms, 15.0 without. The busy one keeps 70
// within 1 point.
TEST(TimeDivision, ALightServiceBesideABusyMemberWaitsForTheBusyOnesQueueNotItsWindow) {
  for (const bool prompt : {true, false}) {
    Scenario scenario =
        Divided({OneProcess("a", 30, Rate(47, kMillisecondNs)), OneProcess("b", 70, Persistent(kMillisecondNs, 64))});
    scenario.measurement = Measurement::shim;
    scenario.record_waits = true;
    scenario.prompt_service = prompt;
    const Result result = RunAndPrint(scenario);
    ASSERT_EQ(result.tenants.size(), 2u);
    const double p99_ms = static_cast<double>(Quantile(result.tenants[0].responses_ns, 0.99)) / 1e6;
    std::printf("prompt service %s: the light one's p99 %.2f ms\n", prompt ? "on" : "off", p99_ms);
    EXPECT_NEAR(result.tenants[1].mean_share, 0.70, 0.01) << "prompt service " << prompt;
    if (prompt)
      EXPECT_LT(p99_ms, 6.0);
    else
      EXPECT_GT(p99_ms, 12.0) << "the case no longer shows what prompt service is for";
  }
}

class TimeDivisionPair : public ::testing::TestWithParam<std::tuple<std::uint64_t, std::uint32_t>> {};

// Issue 20, "What must be shown" 1 (a) and (b) in virtual time: 30/70 and 50/50 with 1 ms, 5 us and one-wave 20 ms
// kernels, each within 2 points, together at least 95 % (under the event-pair limiter the same pairs get e.g.
// 30.0 / 53.9 and 24.5 / 24.5: bench/sharing_compare).
TEST_P(TimeDivisionPair, HoldsBothSharesAndBooksTheGpu) {
  const auto [kernel_ns, a_share] = GetParam();
  const Result result = RunAndPrint(Divided(
      {OneProcess("a", a_share, PairWorkload(kernel_ns)), OneProcess("b", 100 - a_share, PairWorkload(kernel_ns))},
      11));
  ExpectSharesHeldTogether(result, 0.95);
}

std::string PairName(const ::testing::TestParamInfo<TimeDivisionPair::ParamType>& info) {
  const std::uint64_t kernel_ns = std::get<0>(info.param);
  const std::uint32_t a = std::get<1>(info.param);
  const std::string size = kernel_ns >= kMillisecondNs ? std::to_string(kernel_ns / kMillisecondNs) + "ms"
                                                       : std::to_string(kernel_ns / kMicrosecondNs) + "us";
  return "Kernels" + size + "_" + std::to_string(a) + "_" + std::to_string(100 - a);
}

INSTANTIATE_TEST_SUITE_P(Caps, TimeDivisionPair,
                         ::testing::Combine(::testing::Values(20 * kMillisecondNs, kMillisecondNs, 5 * kMicrosecondNs),
                                            ::testing::Values(30u, 50u)),
                         PairName);

// A loop that synchronizes every few launches (tests/gpu/repro/mm_loop.py: four bf16 8192 matmuls, then
// torch.cuda.synchronize, 1.67 ms each on an H200) keeps its share beside another: in virtual time, where each kernel is
// charged what it ran, 29.2 / 69.2 and 49.2 / 49.2. (The shim over fakecuda and on an H200 gives the 30 % one
// 26.7-28 %: docs/compute-sharing.md, "Loops that synchronize"; the simulator does not run the shim's charges.)
TEST(TimeDivision, LoopsThatSynchronizeEveryFourLaunchesHoldTheirShares) {
  const Workload matmuls = Bursts(1'669 * kMicrosecondNs, 4);
  const Workload varied = MatmulLikeBursts();  // the first matmul after a handover runs slower
  for (const auto& [a_share, workload] : {std::pair{30u, matmuls}, std::pair{50u, matmuls}, std::pair{30u, varied}}) {
    const Result result =
        RunAndPrint(Divided({OneProcess("a", a_share, workload), OneProcess("b", 100 - a_share, workload)}, 11));
    ExpectSharesHeldTogether(result, 0.95);
  }
}

// A draining loop launches its burst at once and the next burst only when the last kernel of the one before has
// completed.
TEST(Workloads, ABurstWaitsForThePreviousBurstToComplete) {
  Scenario scenario = Of({OneProcess("a", 30, Bursts(kMillisecondNs, 4), Policy::disable)});  // measured, not held
  scenario.duration_ns = 2 * kSecondNs;  // (after the first second, which the samples leave out)
  scenario.record_trace = true;
  const Result result = vgpu::sim::Run(scenario);
  ASSERT_TRUE(result.error.empty()) << result.error;
  const auto number = [](const std::string& line, const std::string& key) {
    const std::size_t at = line.find("\"" + key + "\":");
    return at == std::string::npos ? UINT64_MAX : std::stoull(line.substr(at + key.size() + 3));
  };
  std::istringstream lines(result.trace);
  std::uint64_t kernels = 0, previous_end = 0, previous_queued = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("\"ev\":\"kernel\"") == std::string::npos) continue;
    const std::uint64_t queued = number(line, "queued_ns"), end = number(line, "end_ns");
    if (kernels % 4 == 0 && kernels > 0) {
      EXPECT_GE(queued, previous_end) << "kernel " << kernels << " began a burst before the last one completed";
    } else if (kernels > 4) {  // (the first burst: the limiter measures a kernel's first launch alone)
      EXPECT_LT(queued - previous_queued, 100 * kMicrosecondNs)
          << "kernel " << kernels << " was not launched with its burst";
    }
    previous_end = end;
    previous_queued = queued;
    ++kernels;
  }
  EXPECT_GE(kernels, 1800u);  // two seconds of 1 ms kernels, four at a time
}

// A lone tenant keeps its cap under time division, as under the limiter (issue 20, item 5, no regression).
TEST(TimeDivision, ALoneTenantHoldsItsCapWithOneKernelSize) {
  for (const std::uint32_t cap : {10u, 30u, 50u, 70u, 90u}) {
    for (const std::uint64_t kernel_ns : {20 * kMillisecondNs, kMillisecondNs, 5 * kMicrosecondNs}) {
      const Result result = RunAndPrint(Divided({OneProcess("a", cap, PairWorkload(kernel_ns))}, 11));
      ASSERT_EQ(result.tenants.size(), 1u);
      EXPECT_NEAR(result.tenants[0].mean_share, cap / 100.0, kMeanTolerance) << "cap " << cap << ", " << kernel_ns;
    }
  }
}

// With sizes from 5 us to 20 ms a launch's estimate is often far from what runs; window ends left unfilled become
// credit, spent past later windows' ends (credit holds policy::kCreditCycles cycles' window time: one was not enough at
// 50 %, 47.7 %).
TEST(TimeDivision, ALoneTenantHoldsItsCapWithMixedKernels) {
  for (const std::uint32_t cap : {10u, 30u, 50u, 70u, 90u}) {
    const Result result = RunAndPrint(Divided({OneProcess("a", cap, Mixed())}, 11));
    EXPECT_NEAR(result.tenants[0].mean_share, cap / 100.0, kMeanTolerance) << "cap " << cap;
  }
}

// A launch-bound tenant alone (2 us kernels, 5 us of host time per launch: 40 % of the GPU uncapped) fills only a
// fraction of its windows; the credit that leaves is spent in time nobody owns, so that it still gets its cap (issue
// 20, item 5: x.add_ at 10 % read 2.0 % by NVML on an H100 while it could launch only in its windows).
TEST(TimeDivision, ALaunchBoundTenantAloneGetsItsCap) {
  for (const std::uint32_t cap : {10u, 30u}) {
    Tenant a = OneProcess("a", cap, BackToBack(2 * kMicrosecondNs));
    a.processes[0].launch_overhead_ns = 5 * kMicrosecondNs;
    const Result result = RunAndPrint(Divided({a}, 11));
    EXPECT_NEAR(result.tenants[0].mean_share, cap / 100.0, kMeanTolerance) << "cap " << cap;
  }
}

// A tenant killed mid-run: the other keeps its share. It may spend its credit in the killed one's windows while
// their debt is repaid: at most two cycles of its window time (2 x 14 ms), 2.8 points of one second, once.
TEST(TimeDivision, AKilledTenantLeavesTheOtherItsShareAndAtMostItsCreditMore) {
  Tenant a = OneProcess("a", 30, Persistent(kMillisecondNs, 4));
  a.processes[0].crash_ns = 3050 * kMillisecondNs + 123;
  const Result result = RunAndPrint(Divided({a, OneProcess("b", 70, Persistent(kMillisecondNs, 4))}));
  ASSERT_EQ(result.tenants.size(), 2u);
  EXPECT_EQ(result.tenants[0].window_shares[4], 0.0);
  for (std::size_t w = 1; w < 6; ++w) {
    const double share = result.tenants[1].window_shares[w];
    EXPECT_GE(share, 0.70 - kMeanTolerance) << "window " << w;
    EXPECT_LE(share, 0.70 + 0.028 + 0.005) << "window " << w;
    if (w != 3) {
      EXPECT_NEAR(share, 0.70, kMeanTolerance) << "window " << w << " (3 holds the kill)";
    }
  }
}

// Issue 20, item 2, with handovers that cost nothing: each of the four within 2 points, the tenant of two
// processes too (its account is charged the union of its processes' kernels, which slice each other).
TEST(TimeDivision, TenTwentyThirtyFortyWithMixedKernelsHoldWhenHandoversCostNothing) {
  Tenant d = OneProcess("d", 40, Mixed());
  d.processes.push_back(d.processes[0]);
  Scenario scenario =
      Divided({OneProcess("a", 10, Mixed()), OneProcess("b", 20, Mixed()), OneProcess("c", 30, Mixed()), d}, 11);
  scenario.switch_ns = 0;
  ExpectSharesHeldTogether(RunAndPrint(scenario), 0.95);
}

// Issue 20, item 2, with the H100's 160 us handovers: the tenant of two processes would lose a handover inside its
// own windows every time slice its processes trade (~7 % of its share, which NVML does not count as busy), unless
// they take turns (policy::DecideSibling). Without the turns: 9.5, 19.5, 29.0, 38.1 % (seed 1), d 36.9 .. 37.2 with
// seeds 2 .. 4.
TEST(TimeDivision, TenTwentyThirtyFortyWithMixedKernelsAndATenantOfTwoProcesses) {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    Tenant d = OneProcess("d", 40, Mixed());
    d.processes.push_back(d.processes[0]);
    Scenario scenario =
        Divided({OneProcess("a", 10, Mixed()), OneProcess("b", 20, Mixed()), OneProcess("c", 30, Mixed()), d}, 11);
    scenario.seed = seed;
    ExpectSharesHeldTogether(RunAndPrint(scenario), 0.95);
  }
}

// Issue 20, item 2, with the sizes under one function, as vgpu-tenant's spin kernel told its duration by an argument
// (or a kernel whose run depends on its data): each launch is estimated at the function's median (~0.4 ms), so the
// turn a process of d publishes to its sibling ends long before a 20 ms launch does. A holder waiting for room in its
// queue (in the shim: inside a synchronize call, turn::BeginBlocking) keeps its sibling waiting until its work is
// done, instead of the two time-slicing each other inside d's windows. Without: d 37.5 .. 37.8 % (seeds 1 .. 3).
TEST(TimeDivision, TenTwentyThirtyFortyWithMixedSizesOfOneFunctionAndATenantOfTwoProcesses) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    Workload mixed = Mixed();
    mixed.sizes_share_one_kernel = true;
    Tenant d = OneProcess("d", 40, mixed);
    d.processes.push_back(d.processes[0]);
    Scenario scenario =
        Divided({OneProcess("a", 10, mixed), OneProcess("b", 20, mixed), OneProcess("c", 30, mixed), d}, 16);
    scenario.seed = seed;
    ExpectSharesHeldTogether(RunAndPrint(scenario), 0.95);
  }
}

// Issue 20, item 2, with one kernel size (the H100's case: bf16 matmuls of 1.64 ms): four tenants booking the whole
// GPU, the 40 % one of two processes. The cycle's four handovers (640 us of 20 ms) cannot all be had; each tenant
// pays its own (policy::HandoverCharge). Without the charge the 10 % one paid for all of them: 7.4 % (1 ms kernels)
// beside 20.0 / 30.0 / 40.0; on the H100 6.5-7.0 % in four runs of five.
TEST(TimeDivision, TenTwentyThirtyFortyWithOneKernelSizeEachPayItsOwnHandovers) {
  for (const std::uint64_t kernel_ns : {kMillisecondNs, 1'640 * kMicrosecondNs}) {
    Tenant d = OneProcess("d", 40, Persistent(kernel_ns, 4));
    d.processes.push_back(d.processes[0]);
    const Result result = RunAndPrint(
        Divided({OneProcess("a", 10, Persistent(kernel_ns, 4)), OneProcess("b", 20, Persistent(kernel_ns, 4)),
                 OneProcess("c", 30, Persistent(kernel_ns, 4)), d}));
    ExpectSharesHeldTogether(result, 0.95);
  }
}

// ... and where the shares leave time nobody owns (90 % booked), it absorbs the handovers: nobody is charged them.
TEST(TimeDivision, TimeNobodyOwnsAbsorbsTheHandovers) {
  const Result result = RunAndPrint(Divided(
      {OneProcess("a", 10, Persistent(kMillisecondNs, 4)), OneProcess("b", 20, Persistent(kMillisecondNs, 4)),
       OneProcess("c", 30, Persistent(kMillisecondNs, 4)), OneProcess("d", 30, Persistent(kMillisecondNs, 4))}));
  for (const TenantResult& tenant : result.tenants) {
    EXPECT_NEAR(tenant.mean_share, tenant.cap, 0.005) << "tenant " << tenant.name;
  }
}

// A job on two GPUs, a rank on each (the second starting `offset_ns` later, as ranks never start together): 1 ms
// kernels, an all_reduce of 1 ms after every 4, capped at `cap` (0: none), maybe beside a 50 % neighbour on GPU 0.
Scenario TwoGpuJob(std::uint32_t cap, std::uint64_t offset_ns, bool neighbour, Sharing sharing) {
  Workload step = Persistent(kMillisecondNs, 8);
  step.collective_ns = kMillisecondNs;
  step.collective_ranks = 2;
  step.collective_every = 4;
  Tenant job = OneProcess("ddp", cap, step);
  job.processes.push_back(job.processes[0]);
  job.processes[1].device = 1;
  job.processes[1].start_ns = offset_ns;
  std::vector<Tenant> tenants = {job};
  if (neighbour) tenants.push_back(OneProcess("other", 50, Persistent(kMillisecondNs, 4)));
  Scenario scenario = Divided(tenants);
  scenario.device = "h100-80gb,h100-80gb";
  scenario.sharing = sharing;
  return scenario;
}

// Issue 20, item 4 in virtual time: the job at half its GPUs keeps a step within 2.2 x uncapped, alone and beside a
// neighbour on one of its GPUs, who keeps its share. The job's ranks share one account, so they are in and out of
// debt together and their windows stay aligned (with an account per GPU: 0.07 of uncapped).
TEST(TimeDivision, ATwoGpuJobAtHalfItsGpusKeepsItsStepTime) {
  for (const std::uint64_t offset_ns : {300 * kMicrosecondNs, 2'500 * kMicrosecondNs}) {
    const Result uncapped = RunAndPrint(TwoGpuJob(0, offset_ns, false, Sharing::time_division));
    ASSERT_EQ(uncapped.tenants.size(), 1u);
    for (const bool neighbour : {false, true}) {
      const Result capped = RunAndPrint(TwoGpuJob(50, offset_ns, neighbour, Sharing::time_division));
      const double ratio = static_cast<double>(capped.tenants[0].kernels) / uncapped.tenants[0].kernels;
      EXPECT_GE(ratio, 1 / 2.2) << "offset " << offset_ns << ", neighbour " << neighbour;
      EXPECT_LE(ratio, 0.5 + 0.02) << "offset " << offset_ns << ", neighbour " << neighbour;
      if (neighbour) {
        EXPECT_NEAR(capped.tenants[1].mean_share, 0.50, kMeanTolerance) << "offset " << offset_ns;
      }
    }
  }
}

// Known gap (issue 20, item 4; the DDP collapse of ../shared/FIELD-NOTES.md, in virtual time): under the event-pair
// limiter a rank's all_reduce is charged its wait for the other rank, which the limiter holds back. Observed: 0.09 of
// uncapped alone, 0.04 beside a neighbour (offset 300 us).
TEST(Force, KnownGapATwoGpuJobAtHalfItsGpusKeepsItsStepTime) {
  const Result uncapped = RunAndPrint(TwoGpuJob(0, 300 * kMicrosecondNs, false, Sharing::budget));
  const Result capped = RunAndPrint(TwoGpuJob(50, 300 * kMicrosecondNs, false, Sharing::budget));
  EXPECT_GE(static_cast<double>(capped.tenants[0].kernels) / uncapped.tenants[0].kernels, 1 / 2.2);
}

// Issue 20, item 6: a `default` tenant alone has the GPU; a neighbour arriving has its share in the next second.
TEST(TimeDivision, DefaultGivesTheGpuBackWithinASecondOfAnArrival) {
  const Tenant a = OneProcess("a", 30, Persistent(kMillisecondNs, 4), Policy::default_policy);
  const Tenant b = OneProcess("b", 70, Persistent(kMillisecondNs, 4), Policy::force, 3 * kSecondNs);
  const Result result = RunAndPrint(Divided({a, b}));
  ASSERT_EQ(result.tenants.size(), 2u);
  for (std::size_t w = 0; w < 3; ++w) EXPECT_GE(result.tenants[0].window_shares[w], 0.97) << "window " << w;
  for (std::size_t w = 3; w < 6; ++w) {
    EXPECT_NEAR(result.tenants[0].window_shares[w], 0.30, kMeanTolerance) << "window " << w;
    EXPECT_NEAR(result.tenants[1].window_shares[w], 0.70, kMeanTolerance) << "window " << w;
  }
}

// Issue 20, item 6: `default` alone borrows the whole GPU (2 ms ahead at a time, a longer kernel on an empty queue).
TEST(TimeDivision, DefaultAloneGetsAtLeast97Percent) {
  for (const Workload& workload : {Persistent(kMillisecondNs, 4), Mixed()}) {
    const Result result = RunAndPrint(Divided({OneProcess("a", 30, workload, Policy::default_policy)}));
    EXPECT_GE(result.tenants[0].mean_share, 0.97);
  }
}

// A crash stops the tenant's busy time at the crash instant exactly; its queued kernels never run, and the other
// tenant takes the freed time up to its own cap.
TEST(Crash, StopsBusyAtTheCrashAndTheOtherTenantTakesTheFreedTimeUnderItsCap) {
  Tenant a = OneProcess("a", 50, Persistent(kMillisecondNs, 4));
  a.processes[0].crash_ns = 3050 * kMillisecondNs + 123;  // inside a kernel, three more queued
  const Tenant b = OneProcess("b", 70, Persistent(kMillisecondNs));
  Scenario scenario = Of({a, b});
  scenario.sample_ns = 10 * kMillisecondNs;
  scenario.record_trace = true;
  const Result result = RunAndPrint(scenario);
  ASSERT_EQ(result.tenants.size(), 2u);
  const std::vector<std::uint64_t>& samples = result.tenants[0].busy_samples_ns;
  ASSERT_EQ(samples.size(), 600u);
  // Sample i is at (i + 1) x 10 ms: 304 is 3.05 s (before the crash), 305 is 3.06 s (after it).
  EXPECT_LT(samples[303], samples[304]);
  EXPECT_LT(samples[304], samples[305]) << "a's busy grows until the crash, 123 ns past 3.05 s";
  for (std::size_t i = 305; i < samples.size(); ++i) EXPECT_EQ(samples[i], samples[305]) << "sample " << i;
  EXPECT_LE(samples[305] - samples[304], 123u) << "nothing after the crash instant counts";
  // Before the crash the device is shared 50/50 (both want more than half); after it b runs at its cap.
  EXPECT_NEAR(result.tenants[0].window_shares[2], 0.50, kMeanTolerance);
  EXPECT_NEAR(result.tenants[1].window_shares[2], 0.50, kMeanTolerance);
  for (std::size_t w = 4; w < 6; ++w) {
    EXPECT_EQ(result.tenants[0].window_shares[w], 0.0);
    EXPECT_NEAR(result.tenants[1].window_shares[w], 0.70, kMeanTolerance) << "window " << w;
  }
  EXPECT_NE(result.trace.find("{\"ev\":\"crash\",\"tenant\":\"a\",\"process\":0,\"pid\":1000,\"t_ns\":3050000123,"),
            std::string::npos);
  // The same scenario and seed: the same trace.
  EXPECT_EQ(sim::Run(scenario).trace_digest, result.trace_digest);
}

// A crashed process of a tenant leaves the tenant's other process running under the tenant's one budget.
TEST(Crash, TheTenantsOtherProcessKeepsTheWholeShare) {
  Tenant a = OneProcess("a", 30, Persistent(kMillisecondNs));
  a.processes.push_back(a.processes[0]);
  a.processes[0].crash_ns = 2 * kSecondNs;
  const Tenant b = OneProcess("b", 0, Persistent(kMillisecondNs));
  const Result result = RunAndPrint(Of({a, b}));
  ASSERT_EQ(result.tenants.size(), 2u);
  for (std::size_t w = 1; w < 6; ++w) {
    EXPECT_NEAR(result.tenants[0].window_shares[w], 0.30, kMeanTolerance) << "window " << w;
  }
}

// The samples: monotonic, the last is the sum of the window busy times, and sampling once a window gives the window
// shares exactly. Sampling changes nothing else: the trace is the same byte for byte.
TEST(Samples, AreMonotonicSumToTheWindowsAndReproduceTheWindowShares) {
  Scenario scenario = MixedPair(3);
  scenario.duration_ns = 6 * kSecondNs;
  scenario.tenants[1].processes[0].start_ns = 1500 * kMillisecondNs;
  scenario.tenants[1].processes[0].stop_ns = 4200 * kMillisecondNs;
  const Result plain = RunAndPrint(scenario);
  scenario.sample_ns = scenario.window_ns;
  const Result per_window = RunAndPrint(scenario);
  scenario.sample_ns = 10 * kMillisecondNs;
  const Result fine = RunAndPrint(scenario);
  EXPECT_EQ(plain.trace, per_window.trace);
  EXPECT_EQ(plain.trace, fine.trace);
  ASSERT_EQ(fine.tenants.size(), 2u);
  for (std::size_t t = 0; t < 2; ++t) {
    const TenantResult& tenant = fine.tenants[t];
    EXPECT_TRUE(plain.tenants[t].busy_samples_ns.empty());
    ASSERT_EQ(tenant.busy_samples_ns.size(), 600u);
    for (std::size_t i = 1; i < tenant.busy_samples_ns.size(); ++i) {
      ASSERT_LE(tenant.busy_samples_ns[i - 1], tenant.busy_samples_ns[i]) << tenant.name << ", sample " << i;
    }
    std::uint64_t windows_busy_ns = 0;
    for (std::size_t w = 0; w < tenant.window_shares.size(); ++w) {
      windows_busy_ns += WindowBusyNs(tenant, w, scenario.window_ns);
    }
    EXPECT_EQ(tenant.busy_samples_ns.back(), windows_busy_ns) << tenant.name;
    const TenantResult& coarse = per_window.tenants[t];
    ASSERT_EQ(coarse.busy_samples_ns.size(), coarse.window_shares.size());
    std::uint64_t previous_ns = 0;
    for (std::size_t w = 0; w < coarse.window_shares.size(); ++w) {
      const std::uint64_t busy_ns = coarse.busy_samples_ns[w] - previous_ns;
      previous_ns = coarse.busy_samples_ns[w];
      EXPECT_EQ(static_cast<double>(busy_ns) / static_cast<double>(scenario.window_ns), coarse.window_shares[w])
          << tenant.name << ", window " << w;
      EXPECT_EQ(coarse.busy_samples_ns[w], tenant.busy_samples_ns[(w + 1) * 100 - 1]) << tenant.name;
    }
    EXPECT_EQ(coarse.window_shares, plain.tenants[t].window_shares);
  }
  // b arrives at 1.5 s: nothing before.
  EXPECT_EQ(fine.tenants[1].busy_samples_ns[149], 0u);
  EXPECT_GT(fine.tenants[1].busy_samples_ns[150], 0u);
}

// ---- scenarios that cannot run --------------------------------------------------------------------------------------

TEST(Validate, EachRefusalNamesTheFieldTheValueAndWhatIsAccepted) {
  struct Case {
    const char* what;
    Scenario scenario;
    std::vector<const char*> parts;
  };
  const Scenario good = Of({OneProcess("a", 30, Persistent(kMillisecondNs))});
  EXPECT_EQ(Validate(good), "");
  std::vector<Case> cases;
  cases.push_back({"no tenants", Of({}), {"tenants is empty"}});
  Scenario share = good;
  share.tenants[0].share_percent = 130;
  cases.push_back({"share", share, {"tenants[0].share_percent = 130", "0 .. 100"}});
  Scenario depth = good;
  depth.tenants[0].processes[0].workload.queue_depth = 0;
  cases.push_back({"depth", depth, {"tenants[0].processes[0].workload.queue_depth = 0", "1 .. 128"}});
  Scenario drain = good;
  drain.tenants[0].processes[0].workload = Rate(100, kMillisecondNs);
  drain.tenants[0].processes[0].workload.drain = true;
  cases.push_back({"drain", drain, {"tenants[0].processes[0].workload.drain = true with kind rate", "closed loop"}});
  Scenario cycle = good;
  cycle.sharing = Sharing::time_division;
  cycle.cycle_ns = 50 * kMicrosecondNs;
  cases.push_back({"cycle", cycle, {"cycle_ns = 50000", "100 us .. 10 s"}});
  Scenario cycle_max = good;
  cycle_max.sharing = Sharing::time_division;
  cycle_max.cycle_max_ns = kMillisecondNs;
  cases.push_back({"cycle_max", cycle_max, {"cycle_max_ns = 1000000", "cycle_ns .. 10 s"}});
  Scenario ordinal = good;
  ordinal.tenants[0].processes[0].device = 1;
  cases.push_back({"ordinal", ordinal, {"tenants[0].processes[0].device = 1", "0 .. 0 (the devices of 'h100-80gb')"}});
  Scenario lending = good;
  lending.device = "h100-80gb,h100-80gb";
  lending.tenants[0].policy = Policy::default_policy;
  lending.tenants[0].processes[0].device = 1;
  cases.push_back({"lending", lending, {"tenants[0].processes[0].device = 1", "0 for a `default` tenant"}});
  Scenario collective = good;
  collective.tenants[0].processes[0].workload.collective_ns = kMillisecondNs;
  collective.tenants[0].processes[0].workload.collective_ranks = 1;
  cases.push_back({"collective", collective, {"workload.collective_ranks = 1", "2 .. 8"}});
  Scenario device = good;
  device.device = "h200";
  cases.push_back({"device", device, {"device: ", "unknown preset 'h200'"}});
  Scenario duration = good;
  duration.duration_ns = 1500 * kMillisecondNs;
  cases.push_back({"duration", duration, {"duration_ns = 1500000000", "a whole number of windows"}});
  Scenario name = good;
  name.tenants[0].name = "a\"b";
  cases.push_back({"name", name, {"tenants[0].name = 'a\"b'", "letters, digits"}});
  // The scenario file's limits (vgpu/scenario/limits.h): the simulator took 100 h and "..", a file neither.
  Scenario dots = good;
  dots.tenants[0].name = "..";
  cases.push_back({"dots", dots, {"tenants[0].name = '..'"}});
  Scenario hours = good;
  hours.duration_ns = 2 * 3600 * kSecondNs;
  cases.push_back({"hours", hours, {"duration_ns = 7200000000000", "up to 1 h"}});
  Scenario twice = Of({OneProcess("a", 30, Persistent(kMillisecondNs)), OneProcess("a", 30, Mixed())});
  cases.push_back({"twice", twice, {"tenants[1].name = 'a' is used twice"}});
  Scenario sizes = good;
  sizes.tenants[0].processes[0].workload = Mixed();
  sizes.tenants[0].processes[0].workload.sizes_ns.clear();
  cases.push_back({"sizes", sizes, {"workload.sizes_ns is empty"}});
  for (const Case& c : cases) {
    const std::string error = Validate(c.scenario);
    for (const char* part : c.parts) {
      EXPECT_NE(error.find(part), std::string::npos) << c.what << ": '" << error << "' lacks '" << part << "'";
    }
    const Result result = sim::Run(c.scenario);
    EXPECT_EQ(result.error, error) << c.what;
    EXPECT_EQ(result.kernels, 0u) << c.what;
  }
}

TEST(Validate, SchedulesCrashesAndSamplesAreRefusedWithWhatIsAccepted) {
  struct Case {
    const char* what;
    Scenario scenario;
    std::vector<const char*> parts;
  };
  Scenario good = Of({OneProcess("a", 30, Persistent(kMillisecondNs))});
  good.tenants[0].processes[0].segments = {SegmentOf(0, kSecondNs, Mixed()),
                                           SegmentOf(2 * kSecondNs, 3 * kSecondNs, SyncLoop(kMillisecondNs))};
  good.tenants[0].processes[0].crash_ns = 2500 * kMillisecondNs;
  good.sample_ns = 100 * kMillisecondNs;
  EXPECT_EQ(Validate(good), "");
  std::vector<Case> cases;
  Scenario overlap = good;
  overlap.tenants[0].processes[0].segments[1].start_ns = 900 * kMillisecondNs;
  cases.push_back({"overlap",
                   overlap,
                   {"tenants[0].processes[0].segments[1].start_ns = 900000000",
                    "at or after segments[0].stop_ns = 1000000000", "not overlapping"}});
  Scenario unsorted = good;
  std::swap(unsorted.tenants[0].processes[0].segments[0], unsorted.tenants[0].processes[0].segments[1]);
  cases.push_back({"unsorted", unsorted, {"segments[1].start_ns = 0", "in time order"}});
  Scenario empty = good;
  empty.tenants[0].processes[0].segments[0].stop_ns = 0;
  cases.push_back({"empty", empty, {"segments[0].start_ns = 0", "below its stop_ns"}});
  Scenario segment_workload = good;
  segment_workload.tenants[0].processes[0].segments[1].workload.queue_depth = 500;
  cases.push_back({"segment workload", segment_workload, {"segments[1].workload.queue_depth = 500", "1 .. 128"}});
  Scenario crash_late = good;
  crash_late.tenants[0].processes[0].crash_ns = 3 * kSecondNs;
  cases.push_back({"crash at stop",
                   crash_late,
                   {"tenants[0].processes[0].crash_ns = 3000000000", "lifetime [0, 3000000000)", "UINT64_MAX"}});
  Scenario crash_early = Of({OneProcess("a", 30, Persistent(kMillisecondNs), Policy::force, kSecondNs)});
  crash_early.tenants[0].processes[0].crash_ns = 10;
  cases.push_back({"crash before start", crash_early, {"crash_ns = 10", "lifetime [1000000000, 6000000000)"}});
  Scenario crash_after_end = Of({OneProcess("a", 30, Persistent(kMillisecondNs))});
  crash_after_end.tenants[0].processes[0].crash_ns = 6 * kSecondNs;
  cases.push_back({"crash at the end", crash_after_end, {"crash_ns = 6000000000", "[0, 6000000000)"}});
  Scenario sample = good;
  sample.sample_ns = 700 * kMillisecondNs;
  cases.push_back({"sample", sample, {"sample_ns = 700000000", "dividing duration_ns"}});
  Scenario tiny_sample = good;
  tiny_sample.sample_ns = 1000;
  cases.push_back({"tiny sample", tiny_sample, {"sample_ns = 1000", "1 ms .. duration_ns"}});
  for (const Case& c : cases) {
    const std::string error = Validate(c.scenario);
    for (const char* part : c.parts) {
      EXPECT_NE(error.find(part), std::string::npos) << c.what << ": '" << error << "' lacks '" << part << "'";
    }
    const Result result = sim::Run(c.scenario);
    EXPECT_EQ(result.error, error) << c.what;
    EXPECT_EQ(result.kernels, 0u) << c.what;
  }
}

}  // namespace
}  // namespace vgpu::sim

namespace vgpu::sim {
namespace {

// Long runs show progress and can be stopped: the callback sees simulated time grow, at every window end and
// sample, without changing the run; returning false stops it with an error that says so.
TEST(Progress, IsReportedWithoutChangingTheRunAndCanStopIt) {
  Scenario scenario;
  Tenant a;
  a.name = "a";
  a.share_percent = 30;
  a.processes.push_back(Process{.workload = Persistent(kMillisecondNs, 4)});
  scenario.tenants = {a};
  scenario.sample_ns = 100 * kMillisecondNs;
  scenario.record_trace = true;
  const Result quiet = vgpu::sim::Run(scenario);
  std::vector<std::uint64_t> seen;
  scenario.progress = [&](std::uint64_t now_ns) {
    seen.push_back(now_ns);
    return true;
  };
  const Result reported = vgpu::sim::Run(scenario);
  ASSERT_TRUE(reported.error.empty()) << reported.error;
  EXPECT_EQ(reported.trace_digest, quiet.trace_digest);
  ASSERT_EQ(seen.size(), scenario.duration_ns / scenario.sample_ns);
  for (std::size_t i = 1; i < seen.size(); ++i) EXPECT_GT(seen[i], seen[i - 1]);
  scenario.progress = [](std::uint64_t now_ns) { return now_ns < 2 * kSecondNs; };
  const Result stopped = vgpu::sim::Run(scenario);
  EXPECT_NE(stopped.error.find("cancelled at 2000000000 ns"), std::string::npos) << stopped.error;
}

}  // namespace
}  // namespace vgpu::sim
