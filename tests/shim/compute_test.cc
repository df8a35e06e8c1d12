// The compute launch path under concurrency, in a child process under the shim (so that the sanitizer presets run
// it): threads launching into one stream, whose measurement windows one thread plans and another ends.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "shim_support.h"

namespace vgpu::shimtest {
namespace {

// Four threads launch kernels whose run time depends on their data (30 us, 2 ms one launch in eight) into the legacy
// default stream under a 30 % cap. The process is held to its cap: over 3 s the share varies by about 3 points (one
// standard deviation) from run to run (launches onto an idle stream are measured at random, the others settled at the
// mean of those: right on average, not launch by launch; 12 runs here gave 26.3-36.8 %, mean 30.1; 35.7 % under TSan in
// CI, 35.8 % once on the H100), so the bound above is 40 % (over three deviations; the shim before the measurement
// windows gave 100 %) and, below, what a slow machine explains (sanitizers slow the host).
TEST(Compute, ThreadsLaunchingIntoOneStreamAreHeldToTheCap) {
  auto env = ShimEnv("threads", "");
  env["CUDA_DEVICE_SM_LIMIT"] = "30";
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  Child worker = RunWorker({"launch", "threads=4", "seconds=3", "short_us=30", "long_us=2000", "long_every=8"}, env,
                           std::chrono::seconds(60));
  ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  const auto values = worker.Values();
  const double share = static_cast<double>(Number(values, "busy_ns")) / static_cast<double>(Number(values, "elapsed_ns"));
  std::printf("four threads into one stream at a 30 %% cap: %llu launches, %.1f %% of the time\n",
              static_cast<unsigned long long>(Number(values, "launched")), 100 * share);
  EXPECT_GT(Number(values, "launched"), 100u);
  EXPECT_LE(share, 0.40) << "the threads' kernels held the device " << 100 * share << " % of the time";
  EXPECT_GE(share, 0.15) << "the threads' kernels held the device " << 100 * share << " % of the time";
}

}  // namespace
}  // namespace vgpu::shimtest
