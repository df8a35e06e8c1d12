// How a launch is measured (measure.h).
#include "vgpu/policy/measure.h"

#include <algorithm>

namespace vgpu::policy {

bool QueuedByEstimate(std::uint64_t busy_until_ns, std::uint64_t at_ns, std::uint64_t charged_ns, bool unknown_cost,
                      bool books_open) {
  return !unknown_cost && !books_open && busy_until_ns > at_ns + charged_ns / 2;
}

bool PairThisLaunch(std::uint32_t launches_before, std::uint64_t estimate_ns, bool steady, Sampler& sampler) {
  return launches_before < kAlwaysMeasureFirst || sampler.Draw(MeasuredOneIn(estimate_ns, steady));
}

std::uint64_t WindowMeasuredNs(std::uint64_t elapsed_ns, std::uint64_t idle_tail_ns, std::uint64_t charged_ns) {
  if (idle_tail_ns == 0) return elapsed_ns;
  const std::uint64_t to_last = elapsed_ns > idle_tail_ns ? elapsed_ns - idle_tail_ns : 0;
  return std::min(elapsed_ns, std::max(to_last, charged_ns));
}

}  // namespace vgpu::policy
