// The virtual-time simulator: the shim's compute limiter and fakecuda's device model driven by a virtual clock and
// seeded workloads. Deterministic: one scenario and seed give one trace, byte for byte (sim/core/README.md).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "vgpu/scenario/scenario.h"

namespace vgpu::sim {

inline constexpr std::uint64_t kMicrosecondNs = 1'000;
inline constexpr std::uint64_t kMillisecondNs = 1'000'000;
inline constexpr std::uint64_t kSecondNs = 1'000'000'000;

// GPU_CORE_UTILIZATION_POLICY: `force` caps hard, `default` lends the GPU while nobody else wants it, `disable`
// measures and never throttles. The scenario file's enum, named by scenario::PolicyName.
using Policy = scenario::Policy;

enum class WorkloadKind {
  closed_loop,  // kernels back to back, at most `queue_depth` launched and not complete; depth 1 = launch-sync-launch
  mixed,        // the same loop, each kernel drawn from `sizes_ns`
  rate,         // `launches_per_second` on a fixed schedule (a late launch goes at once), `queue_depth` at most
};

struct Workload {
  WorkloadKind kind = WorkloadKind::closed_loop;
  std::uint64_t kernel_ns = kMillisecondNs;  // closed_loop, rate: each kernel's duration alone on the device
  std::vector<std::uint64_t> sizes_ns;       // mixed: the sizes, each drawn with equal probability
  // mixed: every size is one function with one launch shape (a spin kernel told its duration by an argument, as
  // vgpu-tenant's is), so the limiter cannot tell them apart. false: each size is its own kernel.
  bool sizes_share_one_kernel = false;
  std::uint32_t jitter_permille = 0;  // each kernel's duration varies uniformly by +/- this much
  std::uint32_t queue_depth = 4;      // 1 .. 128 (the model's stream queue)
  // closed_loop, mixed: launch `queue_depth` kernels, then wait until all of them complete (a synchronize), then the
  // next `queue_depth`: a training loop that synchronizes every few steps (tests/gpu/repro/mm_loop.py: four bf16
  // matmuls, then torch.cuda.synchronize). false: keep `queue_depth` in flight.
  bool drain = false;
  double launches_per_second = 1000;  // rate
  // A job spanning GPUs (a DDP step's all_reduce): after every `collective_every` kernels, one collective kernel of
  // `collective_ns` among `collective_ranks` processes, one per device, of group `collective_group` (0: the
  // tenant's index + 1). fakecuda makes it wait for the other ranks' to start. 0: none.
  std::uint64_t collective_ns = 0;
  std::uint32_t collective_ranks = 0;
  std::uint32_t collective_every = 1;
  std::uint64_t collective_group = 0;
};

// Workloads named as docs/compute-limit.md names them.
Workload Persistent(std::uint64_t kernel_ns, std::uint32_t queue_depth = 2);  // one-wave kernels, closed loop
Workload BackToBack(std::uint64_t kernel_ns, std::uint32_t queue_depth = 8);  // e.g. 5 us kernels
Workload SyncLoop(std::uint64_t kernel_ns);                                   // launch, wait for it, launch
Workload Bursts(std::uint64_t kernel_ns, std::uint32_t burst);  // `burst` launches, wait for all of them (drain)
// Bursts of four launches of one kernel, 1.5 ms each, one in four drawn at 1.95 ms (an H200's bf16 8192 matmul, slower
// when it is the first after a handover), then a synchronize: the loop whose lost windows fakecuda reproduced.
Workload MatmulLikeBursts();
Workload Mixed(std::uint32_t queue_depth = 4);  // 5 us .. 20 ms in 1-2-5 steps: 12 sizes, log-uniform
Workload Rate(double launches_per_second, std::uint64_t kernel_ns, std::uint32_t queue_depth = 8);

// A stretch of a process's life with one workload: launches from start_ns, none from stop_ns on.
struct Segment {
  std::uint64_t start_ns = 0;
  std::uint64_t stop_ns = UINT64_MAX;
  Workload workload;
};

struct Process {
  Workload workload;
  std::uint64_t start_ns = 0;          // first launch (idle before: a tenant that arrives later)
  std::uint64_t stop_ns = UINT64_MAX;  // no launch from here on
  // If not empty: the process's schedule instead of workload/start/stop, in time order, not overlapping (the gaps
  // are idle). Each segment's kernels are distinct kernels from the other segments' (their own cost entries).
  std::vector<Segment> segments;
  // Killed at this time (SIGKILL): no launch from then on, its queued and running kernels are dropped, as a
  // context destroyed with its process. UINT64_MAX = never.
  std::uint64_t crash_ns = UINT64_MAX;
  // The device it launches on (an index into the scenario's `device` spec: "h100-80gb,h100-80gb" has two).
  std::uint32_t device = 0;
  // Host time of a launch call before the shim's Admit. The kernel is queued at the Admit (or at ready_at, after
  // the shim's sleep), and the application's next call begins then.
  std::uint64_t launch_overhead_ns = 3 * kMicrosecondNs;
};

struct Tenant {
  std::string name;                   // letters, digits, '-', '_', '.'
  std::uint32_t share_percent = 100;  // CUDA_DEVICE_SM_LIMIT: 1 .. 100; 0 = no limit, as 100
  Policy policy = Policy::force;
  std::vector<Process> processes;  // each its own limiter over the tenant's one budget cell
  // The limiter's own settings, for experiments; 0 = the limiter's default.
  std::uint64_t burst_ns = 0;
  std::uint64_t in_flight_max_ns = 0;
};

// What the limiter is told a kernel cost (Settle's `measured_ns`).
enum class Measurement {
  events,      // end - start of the kernel as it ran: other processes' time slices inside it included
  event_pair,  // what the shim's cuEventRecord pair around the launch reads: from the start event's timestamp (the
               // previous kernel's end if queued behind it, else the process's next turn on the device) to the end
  run_time,    // the GPU time the kernel itself ran: what no CUDA API measures, to tell the limiter's part apart
  shim,        // as the shim measures, by its own decisions (vgpu/policy/measure.h): a launch queued behind at least
               // half its charge shares its stream's window (from the end of the work before it to the end of its
               // last launch); another gets an event pair (event_pair's reading) when drawn, or is settled unmeasured
               // at its kernel's mean
};

// What the `default` policy is told others' share of the device is (ObserveOthers), every observe_period_ns.
enum class OthersEstimate {
  // NVML's latest published utilization minus the tenant's busy time in that very 200 ms sample window: what a
  // shim that keeps its own busy time finer than the NVML window can compute (sim/core/README.md).
  nvml_minus_same_window,
  // NVML's latest published utilization minus Limiter::PublishedShare (the last whole second in 10 ms buckets): the
  // first shim's input, which flipped a lone tenant between its share and 100 % while PublishedShare averaged 750 ms
  // in 250 ms buckets (sim/core/README.md, finding 3).
  nvml_minus_published_share,
  // NVML's latest published utilization minus Limiter::BusyFraction over that sample's period: the container's
  // measured busy time from the shared cell's 10 ms buckets, what the shim computes from nvmlDeviceGetSamples.
  nvml_minus_cell_busy,
};

// How the tenants with a limit share the device.
enum class Sharing {
  budget,         // the event-pair limiter (vgpu-core/policy/limiter.h): each tenant charged its kernels' measured
                  // time; the driver time-slices whoever has work
  time_division,  // docs/compute-sharing.md, option A (vgpu-core/policy/time_division.h): one tenant's kernels at a
                  // time, in windows cut from a cycle by the shares; the limiter only measures and estimates
};

struct Scenario {
  std::string device = "h100-80gb";  // a FAKECUDA_DEVICES spec; processes say which device they use
  std::uint64_t timeslice_ns = 2 * kMillisecondNs;
  std::uint64_t switch_ns = 0;  // a handover between processes (an H100: ~160 us; scenarios pass it)
  std::uint64_t duration_ns = 6 * kSecondNs;
  std::uint64_t settle_ns = kSecondNs;  // windows starting before this are not judged
  std::uint64_t window_ns = kSecondNs;  // the share is measured per window; duration and settle are multiples
  std::uint64_t observe_period_ns = 100 * kMillisecondNs;  // `default` policy: how often NVML is read
  std::uint64_t seed = 1;
  Measurement measurement = Measurement::shim;
  OthersEstimate others_estimate = OthersEstimate::nvml_minus_cell_busy;
  Sharing sharing = Sharing::budget;
  std::uint64_t cycle_ns = 20 * kMillisecondNs;  // time_division: the cycle the windows are cut from
  // time_division: if not 0, the cycle doubles (up to this) until every tenant's window holds its longest kernel
  // (policy::CycleFor, from what the tenants' limiters have measured).
  std::uint64_t cycle_max_ns = 0;
  // time_division: policy::TurnConfig::prompt_service (as the shim runs it): a light tenant cuts in at the next
  // boundary of a busy one's work instead of waiting for its own window. False: for comparisons.
  bool prompt_service = true;
  std::vector<Tenant> tenants;
  bool record_trace = false;  // fills Result::trace (a line per kernel: big for short kernels)
  bool record_waits = false;  // fills TenantResult::launch_waits_ns
  // If not 0: every sample_ns, each tenant's cumulative busy time is recorded (TenantResult::busy_samples_ns);
  // duration_ns must be a multiple.
  std::uint64_t sample_ns = 0;
  // If set: called with the simulated time at every window end and every sample (long runs show progress); false
  // stops the run (Result::error says it was cancelled). Reads nothing of the run, so the trace is unchanged.
  std::function<bool(std::uint64_t now_ns)> progress;
};

// A tenant's shares are its busy time summed over its devices: a job on two GPUs at 50 % is held to 1.0 (cap x
// devices; TenantResult::cap says so).
struct TenantResult {
  std::string name;
  double cap = 1.0;                   // the share as a fraction, times the devices its processes use
  std::vector<double> window_shares;  // every whole window from time 0: busy fraction of the window
  double mean_share = 0;              // over the windows from settle_ns on
  double worst_window_error = 0;      // largest |window share - cap| over those windows
  std::uint64_t kernels = 0;          // completed
  // Scenario::sample_ns: the tenant's cumulative busy time (the model's exact per-process device time, summed over
  // its processes) at sample_ns, 2 x sample_ns, ..., duration_ns.
  std::vector<std::uint64_t> busy_samples_ns;
  // Scenario::record_waits: how long each launch of the tenant waited, in launch order (0: it went at once): for its
  // turn under time division, for the budget under the limiter (not counting waits for completions).
  std::vector<std::uint64_t> launch_waits_ns;
  // Scenario::record_waits: for each completed kernel, from the launch call's start (after the application's own
  // overhead) to the kernel's end: what a caller that waits for its result sees (time-slicing included).
  std::vector<std::uint64_t> responses_ns;
};

struct Result {
  std::string error;  // not empty: the scenario was refused, nothing ran
  std::uint64_t seed = 0;
  std::vector<TenantResult> tenants;
  std::string trace;               // JSON lines (sim/core/README.md), when Scenario::record_trace
  std::uint64_t trace_digest = 0;  // FNV-1a 64 of `trace`
  std::uint64_t kernels = 0;
  std::uint64_t loop_steps = 0;      // iterations of the event loop
  std::uint64_t late_reactions = 0;  // a process acting later than it should have: must be 0
  // time_division: launches that waited, by reason (policy::WaitReason: window, debt, others_work, fit, sibling,
  // cut_in, lead),
  // and the waits' total and longest time.
  std::uint64_t waits[8] = {};
  std::uint64_t wait_total_ns = 0;
  std::uint64_t wait_longest_ns = 0;
};

// Runs a scenario to its end in virtual time. No wall clock is read.
Result Run(const Scenario& scenario);

// "" if the scenario can run, else a one-line message naming the field, its value and what is accepted. The
// simulator's own input, finer than a scenario file (segments, launch overheads, jitter to 999 permille): the runner
// builds it from a scenario that passed scenario::Check; the bounds both have are limits.h's.
std::string Validate(const Scenario& scenario);

// A few lines: the seed, then per tenant its cap, mean share after settling, worst window and window shares.
std::string Summary(const Result& result);

const char* SharingName(Sharing sharing);

}  // namespace vgpu::sim
