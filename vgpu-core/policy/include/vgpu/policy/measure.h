// How a launch is measured (docs/compute-limit.md, "Measurement windows"): unmeasured (settled at the mean of its
// kernel's measured launches), by an event pair of its own, or in a window of launches queued back to back on one
// stream (one event between windows). Pure: the shim's measure stage (vgpu-core/hooks/launch_measure.cc) decides
// with these, and so does the simulator measuring as the shim does (sim::Measurement::shim).
#pragma once

#include <cstddef>
#include <cstdint>

#include "vgpu/policy/sampling.h"

namespace vgpu::policy {

// A window ends after this many launches or this much estimated GPU time, whichever comes first: a quarter of what
// may be queued unmeasured (LimiterConfig::in_flight_max_ns), so that windows settle while more are queued.
inline constexpr std::size_t kWindowLaunches = 256;
inline constexpr std::uint64_t kWindowNs = 5'000'000;

// A kernel's first launches in a process are all measured; then as MeasuredOneIn says.
inline constexpr std::uint32_t kAlwaysMeasureFirst = 32;

// Whether a launch charged `charged_ns` at `at_ns` is queued, by the host's estimate of when its stream's work ends
// (`busy_until_ns`), behind at least half its charge of work: such a launch joins the stream's window (a window
// opens only where the driver also says the stream is busy, so that it never starts on an idle GPU). A kernel of
// unknown cost never does (it gets a pair), nor does any launch while a book of launches is open on the stream.
bool QueuedByEstimate(std::uint64_t busy_until_ns, std::uint64_t at_ns, std::uint64_t charged_ns, bool unknown_cost,
                      bool books_open);

// When the stream's work ends by the estimate once a launch charged `charged_ns` is queued at `at_ns`.
inline std::uint64_t QueueEndAfter(std::uint64_t busy_until_ns, std::uint64_t at_ns, std::uint64_t charged_ns) {
  return (busy_until_ns > at_ns ? busy_until_ns : at_ns) + charged_ns;
}

// Whether a window of `launches` launches (those its books may still make included) estimated at `estimated_ns` is
// full: it ends right after the launch that filled it.
inline bool WindowFull(std::size_t launches, std::uint64_t estimated_ns) {
  return launches >= kWindowLaunches || estimated_ns >= kWindowNs;
}

// Whether a launch outside any window gets a pair of its own: its kernel's first kAlwaysMeasureFirst launches
// (`launches_before`: its launches so far), then one launch in MeasuredOneIn(estimate_ns, steady), drawn from
// `sampler` (a draw only past the first ones).
bool PairThisLaunch(std::uint32_t launches_before, std::uint64_t estimate_ns, bool steady, Sampler& sampler);

// What a window settles at, from its events' `elapsed_ns`. A window closed only once its stream had drained also
// timed the idle host time after its last launch (`idle_tail_ns`, 0 otherwise): it is charged the GPU time up to
// that launch at least (the stream was busy then), no less than its launches' charges (`charged_ns`), never more
// than its span.
std::uint64_t WindowMeasuredNs(std::uint64_t elapsed_ns, std::uint64_t idle_tail_ns, std::uint64_t charged_ns);

}  // namespace vgpu::policy
