// Which launches are measured (sampling.h).
#include "vgpu/policy/sampling.h"

#include "vgpu/base/random.h"

#include <algorithm>

namespace vgpu::policy {
namespace {

constexpr std::uint64_t kMeasureSpacingNs = 250'000;
constexpr std::uint64_t kMeasureAtLeastOneIn = 64;
// A steady kernel is measured about once per kSteadySpacingNs of its run time, at least one launch in
// kSteadyAtLeastOneIn: a measured launch costs the host ~4 us (a gate, two records) and the GPU a few us more that a
// synchronize waits for; one in 64 tiny launches was ~1 % of a launch + synchronize on the H100 (docs/results-gpu.md,
// "Ninth run").
constexpr std::uint64_t kSteadySpacingNs = 1'000'000;
constexpr std::uint64_t kSteadyAtLeastOneIn = 256;

}  // namespace

std::uint64_t MeasuredOneIn(std::uint64_t estimate_ns, bool steady) {
  const std::uint64_t estimate = std::max<std::uint64_t>(estimate_ns, 1);
  return steady ? std::clamp<std::uint64_t>(kSteadySpacingNs / estimate, 1, kSteadyAtLeastOneIn)
                : std::clamp<std::uint64_t>(kMeasureSpacingNs / estimate, 1, kMeasureAtLeastOneIn);
}

std::uint64_t SamplerSeed(std::uint64_t process_seed, std::uint64_t thread_index) {
  return base::SplitMix64At(process_seed, thread_index + 1);
}

}  // namespace vgpu::policy
