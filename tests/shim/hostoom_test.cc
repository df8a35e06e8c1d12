// The host runs out of memory inside the shim (docs/shim.md, "Out of host memory"): a hook whose own bookkeeping
// cannot allocate fails that one call with an error, undoes what the driver did for it, and never lets an exception
// out into its C caller, never ends up without limits, never loses count. The worker's operator new fails the
// shim's allocations on purpose (tests/shim/host_oom.h).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "shim_support.h"

namespace vgpu::shimtest {
namespace {

// In the sanitizer builds libvgpu.so takes operator new from the sanitizer's runtime: a failure injected there would
// throw through another C++ runtime's unwinder into the shim's own (static) one, which aborts -- a fault of the
// harness, not of the shim, whose own allocations throw with its own runtime. The injection tests run in the default
// build; the pool test (nothing injected) runs everywhere.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kInjectionWorks = false;
#else
constexpr bool kInjectionWorks = true;
#endif
#define SKIP_UNLESS_INJECTION_WORKS() \
  if (!kInjectionWorks) GTEST_SKIP() << "sanitizer build: the shim's operator new is the sanitizer's (see above)"

// The shim's first call runs its start-up (configuration, region), which needs the heap. Before: std::bad_alloc
// left cuInit into the program (a crash for a C caller), and the thread stayed marked as starting, so that each of
// its later calls went to the driver with no limit: a process that made its first CUDA call with little memory left
// (ulimit -v, or a container close to its memory limit) had no memory cap at all.
TEST(HostOom, AnAllocationFailureWhileTheShimStartsLeavesItClosedNotOpen) {
  SKIP_UNLESS_INJECTION_WORKS();
  const std::uint64_t limit = ConfiguredLimit();
  Child worker =
      RunWorker({"hostoom_start", "limit=" + std::to_string(limit)}, ShimEnv("start", std::to_string(limit)));
  ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  const auto values = worker.Values();
  EXPECT_EQ(Number(values, "start.threw"), 0u) << "an exception left the shim's cuInit";
  EXPECT_GT(Number(values, "start.injected"), 0u) << "the shim's start-up allocated nothing: the test tested nothing";
  EXPECT_NE(Number(values, "start.result"), static_cast<std::uint64_t>(CUDA_SUCCESS));
  EXPECT_EQ(Number(values, "init"), static_cast<std::uint64_t>(CUDA_SUCCESS)) << "the shim did not start again";
  EXPECT_EQ(Number(values, "alloc1"), static_cast<std::uint64_t>(CUDA_SUCCESS));
  EXPECT_EQ(Number(values, "alloc2"), static_cast<std::uint64_t>(CUDA_ERROR_OUT_OF_MEMORY))
      << "two allocations of half the limit (and 1 MiB) both went through: the process runs without its memory cap";
}

// Four threads allocate (cuMemAlloc, cuMemAllocAsync, arrays, pitched, VMM create/map/unmap/release, contexts), read
// NVML, free and launch under a memory and a compute cap while one in five of the shim's own allocations fails. Every
// call answers success or out of memory; none throws; and once everything is freed, the container's count and the driver's view of the
// process are back where they started: an allocation the shim could not record was given back, never left charged
// or uncounted. (It found cuMemUnmap collecting the unmapped handles in a vector after the driver had unmapped: when
// the vector could not grow, their references were lost and the memory stayed charged, 0.3-1.5 GB per run.)
TEST(HostOom, CallsThatRunOutOfHostMemoryFailCleanlyAndLoseNothing) {
  SKIP_UNLESS_INJECTION_WORKS();
  const std::uint64_t limit = ConfiguredLimit();
  const std::uint64_t seed = Seed(11);
  auto env = ShimEnv("churn", std::to_string(limit));
  env["CUDA_DEVICE_SM_LIMIT"] = "50";
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  Child worker = RunWorker({"mixed", "threads=4", "rounds=1500", "oom_percent=20", "seed=" + std::to_string(seed),
                            "limit=" + std::to_string(limit)},
                           env, std::chrono::seconds(80));
  ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  const auto values = worker.Values();
  std::printf(
      "host out of memory in 20 %% of the shim's allocations: %llu calls succeeded, %llu out of memory, "
      "%llu of %llu allocations failed on purpose\n",
      static_cast<unsigned long long>(Number(values, "ok")), static_cast<unsigned long long>(Number(values, "oom")),
      static_cast<unsigned long long>(Number(values, "injected")),
      static_cast<unsigned long long>(Number(values, "seen")));
  EXPECT_EQ(Number(values, "threw"), 0u) << "exceptions left the shim";
  EXPECT_EQ(Number(values, "unexpected"), 0u) << worker.Stdout();
  EXPECT_GT(Number(values, "injected"), 100u) << "too few failures were injected to test anything";
  EXPECT_GT(Number(values, "ok"), 1000u);
  EXPECT_GT(Number(values, "oom"), 0u);
  EXPECT_EQ(Number(values, "cleanup_failures"), 0u);
  EXPECT_EQ(Number(values, "used_after"), Number(values, "used_before")) << "the container's count lost track";
  EXPECT_EQ(Number(values, "own_after"), Number(values, "own_before")) << "device memory was left allocated";
}

// Found by the test above, with nothing failing: threads allocating from one stream-ordered pool (cuMemAllocAsync,
// each on its own stream) settled the pool's charge in several steps, and another thread's settlement in between
// acted on a charge not yet paid for: the container ended counted below what it held (0 of 518 MiB in some runs; a
// way past the memory cap). Now each settlement is one step (memory_hooks.cc, AllocateFromPool). Then found on the
// H100 (3 runs in 8): a settlement that reconciled the pools (at the cap) went on with the pool's size and charge
// read before the reconciliation, while another thread had trimmed the pool; slowing the pool calls down (the
// delayed runs) widens that window enough for fakecuda to show it in every run. Now it reads both again.
TEST(HostOom, ThreadsAllocatingFromOnePoolKeepTheContainersCount) {
  const std::uint64_t limit = ConfiguredLimit();
  for (const std::uint64_t seed : {1, 4, 7, 8, 9}) {
    auto env = ShimEnv("pool" + std::to_string(seed), std::to_string(limit));
    if (seed % 2 == 0) env["FAKECUDA_FAULTS"] = "cuMemPoolGetAttribute:delay_us=50;cuMemPoolTrimTo:delay_us=50";
    Child worker = RunWorker({"mixed", "threads=4", "rounds=3000", "actions=17", "seed=" + std::to_string(seed),
                              "limit=" + std::to_string(limit)},
                             env, std::chrono::seconds(30));
    ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
    const auto values = worker.Values();
    // (Of ~1,200 pool calls many are refused at the cap; on the H100 360 of 600 once, 294 once: the bound only says the
    // run did something. The counts below are what it checks.)
    EXPECT_GT(Number(values, "ok"), 200u);
    EXPECT_EQ(Number(values, "unexpected"), 0u) << worker.Stdout();
    EXPECT_EQ(Number(values, "used_after"), Number(values, "used_before")) << "seed " << seed;
    EXPECT_EQ(Number(values, "own_after"), Number(values, "own_before")) << "seed " << seed;
  }
}

}  // namespace
}  // namespace vgpu::shimtest
