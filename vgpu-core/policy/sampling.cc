// Which launches are measured (sampling.h).
#include "vgpu/policy/sampling.h"

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
  std::uint64_t z = process_seed + 0x9e3779b97f4a7c15ull * (thread_index + 1);  // SplitMix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace vgpu::policy
