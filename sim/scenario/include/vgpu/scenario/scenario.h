// Scenario files (docs/scenarios.md): one YAML schema for a multi-tenant situation on a GPU machine, parsed and
// validated here, used by the runner (sim/runner) and, through the Python binding, by `vgpu check`.
// Pure: no CUDA, no OS calls besides reading the file in LoadFile.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "vgpu/scenario/limits.h"

namespace vgpu::scenario {

inline constexpr std::uint64_t kMicrosecondNs = 1000;
inline constexpr std::uint64_t kMillisecondNs = 1'000'000;
inline constexpr std::uint64_t kSecondNs = 1'000'000'000;

// One step of a process's work: run kernels, or launch nothing for a while.
struct Phase {
  enum class Kind { kernels, idle };
  Kind kind = Kind::kernels;
  std::vector<std::uint64_t> sizes_ns;  // kernels: one size, or several drawn uniformly (mixed)
  std::uint64_t for_ns = 0;             // how long; 0 = until the process stops (kernels only; idle needs a time)
  std::uint32_t depth = 4;              // at most this many launched and not complete, 1 .. 128
  double rate = 0;                      // launches per second on a fixed schedule; 0 = closed loop
  std::uint32_t blocks = 1;             // blocks per kernel, 1 .. 65535
  std::uint32_t jitter_permille = 0;    // each kernel's duration varies by +/- this much, 0 .. 500
  // A job spanning GPUs (a DDP step's all_reduce): after every `every` kernels, one collective kernel of
  // `collective_ns` among `ranks` processes of the tenant, one per device (fakecuda makes it wait for the other
  // ranks' to start). 0: none. Runs live only.
  std::uint64_t collective_ns = 0;
  std::uint32_t ranks = 0;
  std::uint32_t every = 1;
  std::uint32_t line = 0;
};

struct ProcessSpec {
  std::uint32_t replicas = 1;  // 1 .. 64
  std::uint64_t start_ns = 0;
  std::uint64_t stop_ns = 0;                 // resolved: the scenario's duration when absent
  std::optional<std::uint64_t> crash_at_ns;  // SIGKILL (live) / stop dead (virtual), in [start, stop)
  std::uint32_t device = 0;                  // CUDA ordinal inside the container (index into TenantSpec::devices)
  std::uint64_t alloc_bytes = 0;             // allocated at start and held until exit
  std::vector<Phase> work;                   // at least one phase, unless `program` is set
  bool repeat = false;                       // loop the phases until stop
  // A program run as this process instead of vgpu-tenant: its path and arguments, no shell (docs/scenarios.md,
  // "Programs"). Live over fakecuda only; with it, `work` is empty, `alloc_bytes` 0 and `repeat` false.
  std::vector<std::string> program;
  std::uint32_t line = 0;
};

enum class Policy { force, default_policy, disable };
// How the tenants' compute caps are held (VGPU_COMPUTE_SHARING; docs/compute-sharing.md).
enum class Sharing { limiter, time_division };

// A promise about one tenant, judged from the trace over the windows in [from_ns, to_ns).
struct Expectation {
  enum class Kind { share, min_share, max_share, oom };
  Kind kind = Kind::share;
  double percent = 0;                         // share: the target; min_share / max_share: the bound
  std::optional<double> tolerance_points;     // share: default 2 (virtual) / 3 (live)
  std::optional<double> worst_window_points;  // share: no judged window further than this from the target
                                              // (`- worst_window: N` as an item of its own sets the share before it)
  std::uint64_t from_ns = 0;                  // resolved: max(settle, from)
  std::uint64_t to_ns = 0;                    // resolved: the duration when absent
  bool oom = false;                           // oom: whether an out-of-memory error is expected
  std::uint32_t line = 0;
};

struct TenantSpec {
  std::string name;                      // letters, digits, '-', '_', '.'; unique
  std::uint32_t gpu_count = 1;           // nvidia.com/gpu; absent: as many as `devices` lists, else 1
  std::uint64_t memory_limit_bytes = 0;  // nvidia.com/gpumem (MiB if a bare integer); 0 = none
  std::uint32_t cores_percent = 0;       // nvidia.com/gpucores; 0 = none (100 is also none)
  std::uint32_t priority = 1;            // nvidia.com/priority, 0 or 1 (passed through, not acted upon)
  Policy policy = Policy::force;
  std::vector<std::uint32_t> devices;  // physical devices, CUDA_VISIBLE_DEVICES order; resolved: gpu_count
  std::vector<ProcessSpec> processes;
  std::vector<Expectation> expect;
  std::uint32_t line = 0;
};

struct Scenario {
  std::string file;  // the path as given ("" for LoadText without a name)
  std::string name;  // default: the file name without .yaml
  std::string description;
  std::string gpu = "h100-80gb";  // a FAKECUDA_DEVICES spec, or "real" ("2xh100-80gb" becomes "2*h100-80gb")
  bool real_gpu = false;
  std::uint32_t device_count = 1;   // from the spec (fake); for "real", the largest device index used + 1
  std::uint64_t context_bytes = 0;  // per-context overhead of the preset (fake; 0 for real; device 0's if
                                    // the spec mixes presets)
  // The fake GPU's time slice and the cost of a handover between processes, as measured on an H100 (driver 580,
  // docs/results-gpu.md "Calibration"); FAKECUDA_TIMESLICE_US / FAKECUDA_SWITCH_US live.
  std::uint64_t timeslice_ns = 2100 * kMicrosecondNs;
  std::uint64_t switch_ns = 160 * kMicrosecondNs;
  bool virtual_mode = true;  // `mode:` lists virtual (absent: both, but live only for gpu: real or
                             // with faults, which are not modelled in virtual time)
  bool live_mode = true;     // `mode:` lists live
  std::uint64_t duration_ns = 0;
  std::uint64_t settle_ns = kSecondNs;
  std::uint64_t window_ns = kSecondNs;
  std::uint64_t sample_ns = 100 * kMillisecondNs;
  std::uint64_t seed = 1;
  Sharing sharing = Sharing::limiter;  // `sharing: limiter | time-division`
  std::vector<TenantSpec> tenants;
  std::uint64_t expect_leaked_bytes = 0;  // expect.leaked_bytes
  std::vector<std::string> faults;        // FAKECUDA_FAULTS rules, joined with ';' when passed on
};

// "FILE:LINE: KEY: MESSAGE", KEY the dotted path of the offending key (tenants[0].limits.nvidia.com/gpucores).
struct Problem {
  std::string file;
  std::uint32_t line = 0;
  std::string key;
  std::string message;
  std::string ToString() const;
};

struct Loaded {
  std::optional<Scenario> scenario;  // set when there is no problem
  std::vector<Problem> problems;     // every problem found (at most 50), in file order
};

// Reads and validates a scenario file. A file that cannot be read is one problem at line 0.
Loaded LoadFile(const std::string& path);
// The same from text; `file` names it in problems.
Loaded LoadText(const std::string& text, const std::string& file);

const char* PolicyName(Policy policy);  // "force", "default", "disable"

}  // namespace vgpu::scenario
