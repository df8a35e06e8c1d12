// The compute launch path under concurrency, in a child process under the shim (so that the sanitizer presets run
// it): threads launching into one stream, whose measurement windows one thread plans and another ends.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shim_support.h"
#include "vgpu/schedule/schedule.h"

namespace vgpu::shimtest {
namespace {

// The `launch` worker under a compute cap of `cap` %: the share of its run its kernels held the device (their run
// times over the wall time), checked to lie in [low, high], and printed with `what`.
// `time_division`: the cap held by time division (VGPU_COMPUTE_SHARING), on a schedule file of the test's own.
void ExpectLaunchingHeldTo(const char* name, const char* cap, std::vector<std::string> args, double low, double high,
                           const char* what, bool time_division = false) {
  auto env = ShimEnv(name, "");
  env["CUDA_DEVICE_SM_LIMIT"] = cap;
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  if (time_division) {
    env["VGPU_COMPUTE_SHARING"] = "time-division";
    env["VGPU_SCHEDULE_FILE"] = TestFolder() + "/" + name + ".schedule";
  }
  args.insert(args.begin(), "launch");
  Child worker = RunWorker(args, env, std::chrono::seconds(60));
  ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  const auto values = worker.Values();
  const double share =
      static_cast<double>(Number(values, "busy_ns")) / static_cast<double>(Number(values, "elapsed_ns"));
  std::printf("%s at a %s %% cap: %llu launches, %.1f %% of the time\n", what, cap,
              static_cast<unsigned long long>(Number(values, "launched")), 100 * share);
  EXPECT_GT(Number(values, "launched"), 100u);
  EXPECT_LE(share, high) << what << ": the kernels held the device " << 100 * share << " % of the time";
  EXPECT_GE(share, low) << what << ": the kernels held the device " << 100 * share << " % of the time";
}

// Four threads launch kernels whose run time depends on their data (30 us, 2 ms one launch in eight) into the legacy
// default stream under a 30 % cap. The process is held to its cap: launches onto an idle stream are measured at
// random, the others settled at the mean of those (right on average, not launch by launch), so a short run is noisy.
// Over 3 s, 12 runs gave 24.3-37.1 % (mean 32.0; 35.7 % under TSan, 35.8 % once on the H100), and CI once read over
// 40 %; over 6 s, 8 runs gave 29.8-32.8 % (mean 31.2): the early estimates settle. So the run is 6 s, the bound above
// 40 % (the shim before the measurement windows gave 100 %) and, below, what a slow machine explains (sanitizers slow
// the host).
TEST(Compute, ThreadsLaunchingIntoOneStreamAreHeldToTheCap) {
  ExpectLaunchingHeldTo("threads", "30", {"threads=4", "seconds=6", "short_us=30", "long_us=2000", "long_every=8"},
                        0.15, 0.40, "four threads into one stream");
}

// The same under time division, alone on the GPU. Time division charged each launch its kernel's median run (30 us
// here), whatever its long runs (2 ms one launch in eight: a mean of 276 us): the container took 74.7 % of the time at
// a 30 % cap (81-99 % in back-to-back runs on the same region). A container alone on its one GPU is now charged what
// its launches ran, by the limiter's accounting (policy::ChargesWhatRan, WhatRanChargeNs). CI still read over 40 %
// under ASan and 99.9 % once under TSan (2026-11-27); three causes were found and mended (2026-11-28): fakecuda lost
// an event's time once 128 operations were queued after it (measurement windows then read short or negative), what
// lay past a charge's bound was dropped, and a container that fell out of the schedule's plan went uncapped. Since:
// 27.2-30.1 % with two to four such runs at once on two cores, under TSan and not.
TEST(Compute, AKernelWhoseRunTimeDependsOnItsDataIsHeldToTheCapUnderTimeDivision) {
  ExpectLaunchingHeldTo("threads_td", "30", {"threads=4", "seconds=12", "short_us=30", "long_us=2000", "long_every=8"},
                        0.15, 0.40, "four threads into one stream, time division", true);
}

// The same with the worker's threads held off their CPU a millisecond at a time, wherever they are (one of them every
// 250 us, in turn: a loaded host's scheduler preempting them). A window of launches ends once the launches being
// made into it are made; threads joining it meanwhile put that off, and with threads preempted in the middle of a
// launch the count never fell to zero: in CI a window held 11,839 launches and 4.2 s of runs, settled at once, and
// time division charged two cycles of it, carried four and dropped the rest (42.8 % in CI; 46-88 % here). Launches now
// wait for a closing window (launch_admit.cc, WaitForClosingWindow): 30.0-30.4 %. Stalled this often, a slow host
// cannot launch its share (6.7-7.9 % under TSan, the host's launch rate the limit): the bound below only says the
// launches went on; the tests above, unstalled, hold the lower side.
TEST(Compute, ThreadsPreemptedInTheirLaunchesAreHeldToTheCapUnderTimeDivision) {
  ExpectLaunchingHeldTo(
      "threads_td_preempted", "30",
      {"threads=4", "seconds=8", "short_us=30", "long_us=2000", "long_every=8", "stall_us=1000", "stall_every_us=250"},
      0.02, 0.36, "four threads into one stream, preempted, time division", true);
}

// Time division can leave a capped container without turns: its entry in the node's schedule file taken by another
// container while it was stopped or idle, and no entry free (64 live members). Its launches then got no turn and, time
// division having turned the limiter's throttle off, went uncapped: 91 % of the time at a 30 % cap here. The limiter
// now holds the cap while the container takes no turns (it fails closed), and says so at LIBCUDA_LOG_LEVEL=2.
// Here 63 entries are held by containers of no GPU (live: their heartbeats lie ahead, but no members), the worker
// joins the last free one, half a second into its run another container takes that entry, and 1.5 s later it frees.
TEST(Compute, AContainerThatLosesItsTurnsToAFullScheduleIsHeldByTheLimiter) {
  auto env = ShimEnv("no_turns", "");
  const std::string schedule_path = TestFolder() + "/no_turns.schedule";
  env["CUDA_DEVICE_SM_LIMIT"] = "30";
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  env["VGPU_COMPUTE_SHARING"] = "time-division";
  env["VGPU_SCHEDULE_FILE"] = schedule_path;
  env["LIBCUDA_LOG_LEVEL"] = "2";
  std::string error;
  std::unique_ptr<schedule::Board> board = schedule::Board::Open(schedule_path, 20'000'000, 640'000'000, error);
  ASSERT_NE(board, nullptr) << error;
  const auto far_ahead =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch() + std::chrono::hours(1))
                                     .count());
  const auto squat = [&](int e, std::uint64_t id) {  // a live entry of no GPU: it holds the entry, it is no member
    schedule::Entry& entry = board->entry(e);
    schedule::Store(entry.heartbeat_ns, far_ahead);
    schedule::Store(entry.id, id);
  };
  constexpr int kLeftFree = 17;
  for (int e = 0; e < static_cast<int>(schedule::kMaxEntries); ++e) {
    if (e != kLeftFree) squat(e, 1000 + static_cast<std::uint64_t>(e));
  }
  Child worker = Child::Worker({"launch", "threads=1", "seconds=4", "short_us=500", "long_us=500"}, env);
  const auto joined_by = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (schedule::Load(board->entry(kLeftFree).id) == 0 && std::chrono::steady_clock::now() < joined_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_NE(schedule::Load(board->entry(kLeftFree).id), 0u) << "the worker never joined the schedule";
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  squat(kLeftFree, 999);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  schedule::Store(board->entry(kLeftFree).id, 0);  // the entry frees: the worker takes turns again
  ASSERT_TRUE(worker.Wait(std::chrono::seconds(60)) && worker.exited() && worker.exit_code() == 0) << worker.Describe();
  const auto values = worker.Values();
  const double share =
      static_cast<double>(Number(values, "busy_ns")) / static_cast<double>(Number(values, "elapsed_ns"));
  std::printf("a 30 %% container that lost its turns: %.1f %% of the time\n", 100 * share);
  EXPECT_NE(worker.Stderr().find("the limiter holds its compute cap"), std::string::npos) << worker.Stderr();
  EXPECT_NE(worker.Stderr().find("takes turns again"), std::string::npos) << worker.Stderr();
  EXPECT_LE(share, 0.40) << "the kernels held the device " << 100 * share << " % of the time";
  EXPECT_GE(share, 0.15) << "the kernels held the device " << 100 * share << " % of the time";
}

// A worker of container `name` capped at `cap` % (`force`) under time division, on the fake machine and the
// schedule file of `node` (the containers of one test share both).
Child TimeDivisionWorker(const std::string& name, const char* cap, const std::string& node,
                         const std::vector<std::string>& args) {
  auto env = ShimEnv(name, "");
  env["FAKECUDA_STATE"] = TestFolder() + "/" + node + ".state";
  env["CUDA_DEVICE_SM_LIMIT"] = cap;
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  env["VGPU_COMPUTE_SHARING"] = "time-division";
  env["VGPU_SCHEDULE_FILE"] = TestFolder() + "/" + node + ".schedule";
  return Child::Worker(args, env);
}

// The timer slack of each of `pid`'s threads now (tid -> ns); a thread that ended meanwhile is left out.
std::map<int, long> TimerSlacks(pid_t pid) {
  std::map<int, long> slacks;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
    std::ifstream file("/proc/" + task.path().filename().string() + "/timerslack_ns");  // (not under task/)
    long slack = 0;
    if (file >> slack) slacks[std::stoi(task.path().filename().string())] = slack;
  }
  return slacks;
}

// The shim sleeps in the application's threads (waiting for budget, for a turn): with the thread's default timer slack
// (50 us) each short poll overshot by up to that much, and on an H200 the GPU sat idle 0.29-0.31 ms (p50) at each
// handover between two containers under time division; sleeping at 1 us, 0.25 ms (tests/gpu/handovers.py). The
// thread's own slack is put back after: it rules the application's own sleeps. A lone container at 10 % with a
// light service's pauses (the worker's own sleeps) between its 1 ms launches: its launching thread is seen at the
// shim's slack while the limiter holds it back, and at its own between requests.
TEST(Compute, TheShimSleepsWithATightTimerSlackAndGivesTheThreadItsOwnBack) {
  auto env = ShimEnv("slack", "");
  env["CUDA_DEVICE_SM_LIMIT"] = "10";
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  Child worker = Child::Worker({"launch", "threads=1", "seconds=3", "short_us=1000", "long_us=1000", "long_every=1",
                                "sync_every=1", "pause_us=3000"},
                               env);
  std::map<int, std::vector<long>> seen;  // each thread's slack at each look, where it changed
  while (!worker.Poll()) {
    for (const auto& [tid, slack] : TimerSlacks(worker.pid())) {
      if (seen[tid].empty() || seen[tid].back() != slack) seen[tid].push_back(slack);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  bool tight_and_own = false;  // a thread seen at 1000 ns and later at its own again
  std::string described;
  for (const auto& [tid, slacks] : seen) {
    described += ' ';
    described += std::to_string(tid);
    described += ':';
    bool tight = false;
    for (long slack : slacks) {
      described += ' ';
      described += std::to_string(slack);
      tight_and_own = tight_and_own || (tight && slack > 1000);
      tight = tight || slack == 1000;
    }
  }
  EXPECT_TRUE(tight_and_own) << "no thread seen at the shim's slack (1000 ns) and then at its own again:"
                             << described.substr(0, 2000);
}

// Two containers on one GPU under time division at 30 and 70 %, each a loop of four launches and a synchronize, as
// tests/gpu/repro/mm_loop.py (four bf16 8192 matmuls, then torch.cuda.synchronize): 1.5 ms kernels, one in four
// 1.95 ms (a matmul after a handover ran ~0.3 ms longer on an H200). The 70 % one, holding tens of ms of credit,
// queued whole bursts at its window's end into the 30 % one's window, several cycles running, and the 30 % one's
// credit could not win them back: one loop in ten of the 30 % one took two to four 20 ms cycles, and it got 27.2-27.8 %
// of the time (over 12 s, the start included; 26.7 % of an H200's). Now credit carries only the launch that
// straddles a window's end while the next owner waits, and a window's rest that its owner cannot use goes to the
// other: 28.8-29.2 / 67.6-68.2 (28.4 / 66.8 under TSan; the loops' own synchronize gaps, ~1.5 %, included). What
// is judged is the 30 % loop's time at the 90th percentile, which the host's load moves little: within one cycle
// and a half.
TEST(Compute, LoopsThatSynchronizeEveryFourLaunchesKeepTheirSharesBesideEachOtherUnderTimeDivision) {
  const auto container = [](const char* name, const char* cap) {
    return TimeDivisionWorker(
        name, cap, "sync_loops",
        {"launch", "threads=1", "seconds=12", "short_us=1500", "long_us=1950", "long_every=4", "sync_every=4"});
  };
  Child a = container("sync_loops_a", "30");
  Child b = container("sync_loops_b", "70");
  std::map<std::string, std::string> values[2];
  double shares[2] = {};
  Child* workers[2] = {&a, &b};
  for (int i = 0; i < 2; ++i) {
    Child& worker = *workers[i];
    ASSERT_TRUE(worker.Wait(std::chrono::seconds(90)) && worker.exited() && worker.exit_code() == 0)
        << worker.Describe();
    values[i] = worker.Values();
    shares[i] =
        static_cast<double>(Number(values[i], "busy_ns")) / static_cast<double>(Number(values[i], "elapsed_ns"));
  }
  const auto ms = [&](const char* key) { return static_cast<double>(Number(values[0], key)) / 1e6; };
  std::printf(
      "loops of four and a synchronize at 30 / 70 %%: %.1f / %.1f %% of the time; the 30 %% loop's p90 / p99 / "
      "longest %.1f / %.1f / %.1f ms\n",
      100 * shares[0], 100 * shares[1], ms("sync_loop_p90_ns"), ms("sync_loop_p99_ns"), ms("sync_loop_max_ns"));
  EXPECT_LE(ms("sync_loop_p99_ns"), 50.0) << "the 30 % loop lost whole windows to the other's queued work";
  EXPECT_GE(shares[0], 0.26) << "the 30 % container";
  EXPECT_LE(shares[0], 0.32) << "the 30 % container";
  EXPECT_GE(shares[1], 0.62) << "the 70 % container";
  EXPECT_LE(shares[1], 0.72) << "the 70 % container";
}

// Prompt service (docs/compute-sharing.md): a light service under a 30 % cap (a 1 ms kernel, a synchronize, then a
// pause of 10 .. 30 ms) beside a busy 70 % container cuts in at the next boundary of the busy one's queued work (at
// most 2 ms ahead of now while the light one is idle) instead of waiting for its own window. Without it (the rule
// off), its request took up to a cycle's other windows: p99 14-15 ms in the simulator. The busy one keeps its 70:
// it wins the time back in the light one's idle windows.
TEST(Compute, ALightServiceBesideABusyOneUnderTimeDivisionWaitsForTheBusyOnesQueueNotItsWindow) {
  Child light = TimeDivisionWorker("light_a", "30", "light",
                                   {"launch", "threads=1", "seconds=8", "short_us=1000", "long_us=1000", "long_every=1",
                                    "sync_every=1", "pause_us=20000"});
  Child busy = TimeDivisionWorker(
      "light_b", "70", "light", {"launch", "threads=1", "seconds=8", "short_us=1000", "long_us=1000", "long_every=1"});
  std::map<std::string, std::string> values[2];
  Child* workers[2] = {&light, &busy};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(workers[i]->Wait(std::chrono::seconds(90)) && workers[i]->exited() && workers[i]->exit_code() == 0)
        << workers[i]->Describe();
    values[i] = workers[i]->Values();
  }
  const auto share = [&](int i) {
    return static_cast<double>(Number(values[i], "busy_ns")) / static_cast<double>(Number(values[i], "elapsed_ns"));
  };
  const auto ms = [&](const char* key) { return static_cast<double>(Number(values[0], key)) / 1e6; };
  std::printf(
      "a light 30 %% service beside a busy 70 %%: %.1f / %.1f %% of the time; its requests p90 / p99 / longest "
      "%.1f / %.1f / %.1f ms (%llu)\n",
      100 * share(0), 100 * share(1), ms("sync_loop_p90_ns"), ms("sync_loop_p99_ns"), ms("sync_loop_max_ns"),
      static_cast<unsigned long long>(Number(values[0], "sync_loops")));
  EXPECT_GE(Number(values[0], "sync_loops"), 200u);
  EXPECT_LE(ms("sync_loop_p90_ns"), 6.0) << "the light service waited for its own window";
  EXPECT_GE(share(1), 0.64) << "the busy container";
  EXPECT_LE(share(1), 0.72) << "the busy container";
}

// Four threads each launch 30 us kernels into a stream of their own, in one context, under a 70 % cap: their queues are
// measured by windows, most launches made through books into them (over fakecuda ~27,000 of ~47,000 in 2 s:
// docs/compute-limit.md, "The launch path"), and whenever one thread waits for the budget it ends every open window
// of the context, those the other threads are launching into through their books included (a window then ends only
// once no launch into it is being made). The process is held to its cap: 70.0-70.2 % of the time here; the bounds
// leave room for a slow host (sanitizers), where the threads may not keep the device that busy.
TEST(Compute, ThreadsLaunchingThroughBooksIntoTheirOwnStreamsAreHeldToTheCap) {
  ExpectLaunchingHeldTo("own_streams", "70", {"threads=4", "seconds=3", "short_us=30", "long_us=30", "own_streams=1"},
                        0.40, 0.75, "four threads into four streams");
}

// One second of one thread's launches of kernels of `short_us` and `long_us` under a `force` cap of `cap`, at
// LIBCUDA_LOG_LEVEL `level` (empty: not set); what the shim wrote on stderr.
std::string LaunchLog(const std::string& name, const char* cap, const char* long_us, const char* level) {
  auto env = ShimEnv(name, "");
  env["CUDA_DEVICE_SM_LIMIT"] = cap;
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  if (*level != '\0') env["LIBCUDA_LOG_LEVEL"] = level;
  Child worker = RunWorker({"launch", "threads=1", "seconds=1", "short_us=500", std::string("long_us=") + long_us}, env,
                           std::chrono::seconds(60));
  EXPECT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  return worker.Stderr();
}

// LIBCUDA_LOG_LEVEL=4 says, for a launch that waited, why and how long (issue 20: a collapse must explain itself).
TEST(Compute, AWaitingLaunchSaysWhyAtLogLevel4) {
  const std::string log = LaunchLog("why", "30", "500", "4");
  EXPECT_NE(log.find("us for the budget: charged"), std::string::npos) << log.substr(0, 2000);
  EXPECT_EQ(LaunchLog("quiet", "30", "500", "").find("for the budget"), std::string::npos) << "only at level 4";
}

// LIBCUDA_LOG_LEVEL=4 also says when a launch measured far more than it was charged: its span held waiting (the DDP
// collapse of issue 20: an all_reduce measuring 35-189 ms where 3-6 ms were expected). Here the same kernel runs
// 500 us and 20 ms: the long runs measure 40 x the charge.
TEST(Compute, ALaunchMeasuredFarOverItsChargeIsSaidAtLogLevel4) {
  const std::string log = LaunchLog("long", "50", "20000", "4");
  EXPECT_NE(log.find("us were expected: its span held waiting"), std::string::npos) << log.substr(0, 2000);
}

// The shim asks the driver whether a launch's stream is capturing only while a capture may be in progress (it counts
// the captures begun and ended: docs/compute-limit.md, "The launch path"). A capture begun through any of the driver's
// entry points must be seen. Over fakecuda its cuEventRecord fails here, so a launch the shim admitted would be
// refused (a kernel of unknown cost that cannot be measured is not run), while a launch into a capturing stream is the
// graph's and succeeds; and once the captures have ended, launches no longer ask (fakecuda's cuStreamIsCapturing
// takes 5 ms here: 40 launches that each asked would take 200 ms). On a real driver (tests/gpu/shim_suites.sh) the
// faults do not exist: the captures must still hold their three kernels.
TEST(Compute, CapturesBegunThroughEveryEntryPointAreSeenByLaunches) {
  auto env = ShimEnv("capture", "");
  env["CUDA_DEVICE_SM_LIMIT"] = "50";
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  env["FAKECUDA_FAULTS"] = "cuEventRecord:error=CUDA_ERROR_LAUNCH_FAILED;cuStreamIsCapturing:delay_us=5000";
  Child worker = RunWorker({"capture", "after=40"}, env, std::chrono::seconds(60));
  ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  const auto values = worker.Values();
  const bool fake = RunningOnFakecuda();
  std::vector<std::string> ways = {"v1", "v1_ptsz", "v2", "v2_ptsz"};
  if (fake) {
    // fakecuda does not capture into an existing graph: the begin fails, and the count must come down again.
    EXPECT_EQ(Number(values, "to_graph.begin"), static_cast<std::uint64_t>(CUDA_ERROR_NOT_SUPPORTED));
    EXPECT_EQ(Number(values, "to_graph_ptsz.begin"), static_cast<std::uint64_t>(CUDA_ERROR_NOT_SUPPORTED));
  } else {
    ways.insert(ways.end(), {"to_graph", "to_graph_ptsz"});
  }
  for (const std::string& name : ways) {
    EXPECT_EQ(Number(values, name + ".begin"), 0u) << name;
    EXPECT_EQ(Number(values, name + ".launched"), 3u)
        << name << ": launches into the capturing stream were admitted (error "
        << Number(values, name + ".launch_error") << ")";
    EXPECT_EQ(Number(values, name + ".end"), 0u) << name;
    EXPECT_EQ(Number(values, name + ".nodes"), 3u) << name;
  }
  if (!fake) return;
  // Outside a capture the shim admits and cannot measure: refused (the test can see an admitted launch).
  EXPECT_EQ(Number(values, "outside.result"), static_cast<std::uint64_t>(CUDA_ERROR_LAUNCH_FAILED));
  const double outside_ms = static_cast<double>(Number(values, "outside_ns")) / 1e6;
  std::printf("40 launches after the captures ended: %.1f ms\n", outside_ms);
  EXPECT_LT(outside_ms, 100.0) << "launches still ask whether their stream is capturing";
}

}  // namespace
}  // namespace vgpu::shimtest
