// The shim lives inside other people's processes: it never ends one and never changes its process-wide state
// (docs/threat-model.md). The static half is `shim.imports_nothing_that_changes_the_process` (vgpu-core/hooks); this
// is the live half: the worker reads its umask, signal dispositions and mask, resource limits, working folder and
// environment, makes a round of CUDA and NVML calls under the shim, and reads them again.
#include <gtest/gtest.h>

#include <string>

#include "shim_support.h"

namespace vgpu::shimtest {
namespace {

void ExpectStateLeftAlone(const Child& worker) {
  ASSERT_TRUE(worker.exited() && worker.exit_code() == 0) << worker.Describe();
  const auto values = worker.Values();
  EXPECT_EQ(Number(values, "reached_end"), 1u) << "the process did not reach its own end";
  EXPECT_EQ(Number(values, "changed"), 0u) << worker.Stdout();
}

TEST(Process, TheShimLeavesTheProcessStateAloneUnderLimits) {
  const std::uint64_t limit = ConfiguredLimit();
  auto env = ShimEnv("limits", std::to_string(limit));
  env["CUDA_DEVICE_SM_LIMIT"] = "50";
  env["GPU_CORE_UTILIZATION_POLICY"] = "force";
  Child worker = RunWorker({"process", "limit=" + std::to_string(limit)}, env);
  ExpectStateLeftAlone(worker);
  const auto values = worker.Values();
  EXPECT_EQ(Number(values, "alloc"), static_cast<std::uint64_t>(CUDA_SUCCESS));
  EXPECT_EQ(Number(values, "alloc_past_limit"), static_cast<std::uint64_t>(CUDA_ERROR_OUT_OF_MEMORY));
  EXPECT_EQ(Number(values, "launched"), 100u);
}

// A configuration that does not parse: every call is refused (fail closed), and the process goes on to its own end.
TEST(Process, TheShimLeavesTheProcessStateAloneWhenItFailsClosed) {
  auto env = ShimEnv("failed", "12 parsecs");
  Child worker = RunWorker({"process", "limit=" + std::to_string(ConfiguredLimit())}, env);
  ExpectStateLeftAlone(worker);
  EXPECT_EQ(Number(worker.Values(), "init"), static_cast<std::uint64_t>(CUDA_ERROR_NO_DEVICE));
}

}  // namespace
}  // namespace vgpu::shimtest
