// The scenario's side of the simulator: named workloads, validation with messages that say what is accepted, and
// the human summary of a result.
#include <algorithm>
#include <cstdio>
#include <string>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "vgpu/scenario/limits.h"
#include "vgpu/sim/sim.h"

namespace vgpu::sim {
namespace {

using scenario::limits::kMaxDurationNs;
using scenario::limits::kMaxKernelNs;
constexpr std::size_t kMaxSegments = 100'000;  // per process: each has its own kernels (cost entries)

std::string Field(const std::string& where, const char* name, std::uint64_t value, const char* accepted) {
  return where + name + " = " + std::to_string(value) + "; accepted: " + accepted;
}

std::string ValidateWorkload(const Workload& w, const std::string& where) {
  if (w.queue_depth < 1 || w.queue_depth > fakecuda::model::kStreamDepth) {
    return Field(where, "queue_depth", w.queue_depth, "1 .. 128, e.g. 4");
  }
  if (w.jitter_permille > 999) return Field(where, "jitter_permille", w.jitter_permille, "0 .. 999, e.g. 50");
  if (w.drain && w.kind == WorkloadKind::rate) {
    return where +
           "drain = true with kind rate; accepted: drain with a closed loop or mixed sizes (a rate loop does not "
           "synchronize)";
  }
  if (w.kind == WorkloadKind::mixed) {
    if (w.sizes_ns.empty()) return where + "sizes_ns is empty; accepted: one or more sizes, e.g. {5000, 20000000}";
    if (w.sizes_ns.size() > scenario::limits::kMaxMixedSizes) {
      return Field(where, "sizes_ns.size()", w.sizes_ns.size(), "1 .. 1024 sizes");
    }
    for (const std::uint64_t size : w.sizes_ns) {
      if (size < 1 || size > kMaxKernelNs) return Field(where, "sizes_ns[]", size, "1 ns .. 1 hour, e.g. 5000");
    }
  } else if (w.kernel_ns < 1 || w.kernel_ns > kMaxKernelNs) {
    return Field(where, "kernel_ns", w.kernel_ns, "1 ns .. 1 hour, e.g. 1000000");
  }
  if (w.kind == WorkloadKind::rate && !(w.launches_per_second >= 0.001 && w.launches_per_second <= 1e9)) {
    return where + "launches_per_second = " + std::to_string(w.launches_per_second) +
           "; accepted: 0.001 .. 1e9, e.g. 1000";
  }
  if (w.collective_ns != 0 || w.collective_ranks != 0) {
    if (w.collective_ns < 1 || w.collective_ns > kMaxKernelNs) {
      return Field(where, "collective_ns", w.collective_ns, "1 ns .. 1 hour with collective_ranks, e.g. 1000000");
    }
    if (w.collective_ranks < 2 || w.collective_ranks > fakecuda::model::kMaxDevices) {
      return Field(where, "collective_ranks", w.collective_ranks, "2 .. 8 (one process per device)");
    }
    if (w.collective_every < 1 || w.collective_every > 1024) {
      return Field(where, "collective_every", w.collective_every, "1 .. 1024 kernels between collectives");
    }
  }
  return {};
}

// Time division's cycle: its base and the bound it may double to.
std::string ValidateSharing(const Scenario& s) {
  if (s.sharing != Sharing::time_division) return {};
  if (s.cycle_ns < 100 * kMicrosecondNs || s.cycle_ns > 10 * kSecondNs) {
    return Field("", "cycle_ns", s.cycle_ns, "100 us .. 10 s, e.g. 20000000");
  }
  if (s.cycle_max_ns != 0 && (s.cycle_max_ns < s.cycle_ns || s.cycle_max_ns > 10 * kSecondNs)) {
    return Field("", "cycle_max_ns", s.cycle_max_ns, "0 (a fixed cycle) or cycle_ns .. 10 s, e.g. 640000000");
  }
  return {};
}

// The processes' devices: each within the spec; `default` (which observes NVML on device 0) only there.
std::string ValidateDevices(const Scenario& s, std::uint32_t device_count) {
  for (std::size_t t = 0; t < s.tenants.size(); ++t) {
    const Tenant& tenant = s.tenants[t];
    for (std::size_t p = 0; p < tenant.processes.size(); ++p) {
      const std::string at = "tenants[" + std::to_string(t) + "].processes[" + std::to_string(p) + "].";
      const std::uint32_t device = tenant.processes[p].device;
      if (device >= device_count) {
        return Field(at, "device", device,
                     ("0 .. " + std::to_string(device_count - 1) + " (the devices of '" + s.device + "')").c_str());
      }
      if (device != 0 && tenant.policy == Policy::default_policy) {
        return Field(at, "device", device, "0 for a `default` tenant (the simulator reads NVML on device 0 only)");
      }
    }
  }
  return {};
}

}  // namespace

Workload Persistent(std::uint64_t kernel_ns, std::uint32_t queue_depth) {
  Workload w;
  w.kind = WorkloadKind::closed_loop;
  w.kernel_ns = kernel_ns;
  w.queue_depth = queue_depth;
  return w;
}

Workload BackToBack(std::uint64_t kernel_ns, std::uint32_t queue_depth) { return Persistent(kernel_ns, queue_depth); }

Workload SyncLoop(std::uint64_t kernel_ns) { return Persistent(kernel_ns, 1); }

Workload Bursts(std::uint64_t kernel_ns, std::uint32_t burst) {
  Workload w = Persistent(kernel_ns, burst);
  w.drain = true;
  return w;
}

Workload MatmulLikeBursts() {
  Workload w = Bursts(1'500 * kMicrosecondNs, 4);
  w.kind = WorkloadKind::mixed;
  w.sizes_ns = {1'500 * kMicrosecondNs, 1'500 * kMicrosecondNs, 1'500 * kMicrosecondNs, 1'950 * kMicrosecondNs};
  w.sizes_share_one_kernel = true;
  return w;
}

Workload Mixed(std::uint32_t queue_depth) {
  Workload w;
  w.kind = WorkloadKind::mixed;
  w.queue_depth = queue_depth;
  for (std::uint64_t decade = kMicrosecondNs; decade <= 10 * kMillisecondNs; decade *= 10) {
    for (const std::uint64_t step : {1u, 2u, 5u}) {
      const std::uint64_t size = decade * step;
      if (size >= 5 * kMicrosecondNs && size <= 20 * kMillisecondNs) w.sizes_ns.push_back(size);
    }
  }
  return w;
}

Workload Rate(double launches_per_second, std::uint64_t kernel_ns, std::uint32_t queue_depth) {
  Workload w;
  w.kind = WorkloadKind::rate;
  w.launches_per_second = launches_per_second;
  w.kernel_ns = kernel_ns;
  w.queue_depth = queue_depth;
  return w;
}

const char* SharingName(Sharing sharing) {
  switch (sharing) {
    case Sharing::budget:
      return "budget";
    case Sharing::time_division:
      return "time_division";
  }
  return "?";
}

namespace {

// The run's clock and its windows: time slices, handovers, windows, duration, settling, NVML period, samples.
std::string ValidateTimes(const Scenario& s) {
  if (s.timeslice_ns < scenario::limits::kMinTimesliceNs || s.timeslice_ns > scenario::limits::kMaxTimesliceNs) {
    return Field("", "timeslice_ns", s.timeslice_ns, "1 us .. 1 s, e.g. 2000000");
  }
  if (s.switch_ns > scenario::limits::kMaxSwitchNs)
    return Field("", "switch_ns", s.switch_ns, "0 .. 100 ms, e.g. 160000");
  if (s.window_ns < kMillisecondNs || s.window_ns > kMaxDurationNs) {
    return Field("", "window_ns", s.window_ns, "1 ms .. 1 h, e.g. 1000000000");
  }
  if (s.duration_ns < s.window_ns || s.duration_ns > kMaxDurationNs || s.duration_ns % s.window_ns != 0) {
    return Field("", "duration_ns", s.duration_ns, "a whole number of windows up to 1 h, e.g. 6000000000");
  }
  if (s.settle_ns >= s.duration_ns || s.settle_ns % s.window_ns != 0) {
    return Field("", "settle_ns", s.settle_ns, "a whole number of windows below duration_ns, e.g. 1000000000");
  }
  if (s.observe_period_ns < kMillisecondNs || s.observe_period_ns > kSecondNs * 60) {
    return Field("", "observe_period_ns", s.observe_period_ns, "1 ms .. 60 s, e.g. 100000000");
  }
  if (s.sample_ns != 0 &&
      (s.sample_ns < kMillisecondNs || s.sample_ns > s.duration_ns || s.duration_ns % s.sample_ns != 0)) {
    return Field("", "sample_ns", s.sample_ns,
                 "0 (no samples) or 1 ms .. duration_ns, dividing duration_ns, e.g. 100000000");
  }
  return {};
}

// A process's segments (its schedule, replacing workload/start/stop): each a valid workload, in time order.
std::string ValidateSegments(const Process& process, const std::string& at) {
  if (process.segments.size() > kMaxSegments) {
    return Field(at, "segments.size()", process.segments.size(), "0 .. 100000 segments");
  }
  for (std::size_t i = 0; i < process.segments.size(); ++i) {
    const Segment& segment = process.segments[i];
    const std::string in = at + "segments[" + std::to_string(i) + "].";
    if (segment.start_ns >= segment.stop_ns) return Field(in, "start_ns", segment.start_ns, "below its stop_ns");
    if (i > 0 && segment.start_ns < process.segments[i - 1].stop_ns) {
      return Field(in, "start_ns", segment.start_ns,
                   ("at or after segments[" + std::to_string(i - 1) + "].stop_ns = " +
                    std::to_string(process.segments[i - 1].stop_ns) + " (in time order, not overlapping)")
                       .c_str());
    }
    if (std::string error = ValidateWorkload(segment.workload, in + "workload."); !error.empty()) return error;
  }
  return {};
}

// One process: its launch overhead, its schedule, and a crash inside its lifetime.
std::string ValidateProcess(const Process& process, const std::string& at, std::uint64_t duration_ns) {
  if (process.launch_overhead_ns < 1 || process.launch_overhead_ns > kSecondNs) {
    return Field(at, "launch_overhead_ns", process.launch_overhead_ns, "1 ns .. 1 s, e.g. 3000");
  }
  // The process's lifetime: its first launch .. its last stop (segments replace workload/start/stop).
  std::uint64_t first_ns = process.start_ns;
  std::uint64_t last_ns = process.stop_ns;
  if (process.segments.empty()) {
    if (process.start_ns >= process.stop_ns) return Field(at, "start_ns", process.start_ns, "below stop_ns");
    if (std::string error = ValidateWorkload(process.workload, at + "workload."); !error.empty()) return error;
  } else {
    if (std::string error = ValidateSegments(process, at); !error.empty()) return error;
    first_ns = process.segments.front().start_ns;
    last_ns = process.segments.back().stop_ns;
  }
  const std::uint64_t end_ns = std::min(last_ns, duration_ns);
  if (process.crash_ns != UINT64_MAX && (process.crash_ns < first_ns || process.crash_ns >= end_ns)) {
    return Field(at, "crash_ns", process.crash_ns,
                 ("in the process's lifetime [" + std::to_string(first_ns) + ", " + std::to_string(end_ns) +
                  ") (its start .. its stop and duration_ns), or UINT64_MAX (never)")
                     .c_str());
  }
  return {};
}

// Tenant `t`: a plain name used once, its share and bounds, and its processes.
std::string ValidateTenant(const Scenario& s, std::size_t t) {
  const Tenant& tenant = s.tenants[t];
  const std::string where = "tenants[" + std::to_string(t) + "].";
  if (!scenario::limits::IsPlainName(tenant.name)) {
    return where + "name = '" + tenant.name + "'; accepted: 1 .. 64 letters, digits, '-', '_', '.', e.g. a";
  }
  for (std::size_t other = 0; other < t; ++other) {
    if (s.tenants[other].name == tenant.name) return where + "name = '" + tenant.name + "' is used twice";
  }
  if (tenant.share_percent > 100) return Field(where, "share_percent", tenant.share_percent, "0 .. 100, e.g. 30");
  if (tenant.burst_ns > 60 * kSecondNs) return Field(where, "burst_ns", tenant.burst_ns, "0 (default) .. 60 s");
  if (tenant.in_flight_max_ns > 60 * kSecondNs) {
    return Field(where, "in_flight_max_ns", tenant.in_flight_max_ns, "0 (default) .. 60 s");
  }
  if (tenant.processes.empty()) return where + "processes is empty; accepted: one or more processes";
  for (std::size_t p = 0; p < tenant.processes.size(); ++p) {
    const std::string at = where + "processes[" + std::to_string(p) + "].";
    if (std::string error = ValidateProcess(tenant.processes[p], at, s.duration_ns); !error.empty()) return error;
  }
  return {};
}

}  // namespace

std::string Validate(const Scenario& s) {
  fakecuda::model::MachineConfig config = fakecuda::model::DefaultConfig();
  std::string error;
  if (!fakecuda::model::ParseDevices(s.device, config, error)) return "device: " + error;
  if (error = ValidateTimes(s); !error.empty()) return error;
  if (error = ValidateSharing(s); !error.empty()) return error;
  if (s.tenants.empty()) return "tenants is empty; accepted: one or more tenants";
  if (error = ValidateDevices(s, config.device_count); !error.empty()) return error;
  std::uint64_t processes = 0;
  for (std::size_t t = 0; t < s.tenants.size(); ++t) {
    if (error = ValidateTenant(s, t); !error.empty()) return error;
    processes += s.tenants[t].processes.size();
  }
  if (processes > fakecuda::model::kMaxProcesses) {
    return Field("", "processes in all tenants", processes, "1 .. 256 (the model's process slots)");
  }
  return {};
}

std::string Summary(const Result& result) {
  std::string text = "seed " + std::to_string(result.seed) + "\n";
  if (!result.error.empty()) return text + "error: " + result.error + "\n";
  char line[256];
  for (const TenantResult& tenant : result.tenants) {
    std::snprintf(line, sizeof line,
                  "tenant %s: cap %.1f %%, mean %.2f %%, worst window %.2f points off, %llu kernels;"
                  " windows (%%):",
                  tenant.name.c_str(), tenant.cap * 100, tenant.mean_share * 100, tenant.worst_window_error * 100,
                  static_cast<unsigned long long>(tenant.kernels));
    text += line;
    for (const double share : tenant.window_shares) {
      std::snprintf(line, sizeof line, " %.1f", share * 100);
      text += line;
    }
    text += "\n";
  }
  std::uint64_t waits = 0;
  for (const std::uint64_t n : result.waits) waits += n;
  if (waits > 0) {
    std::snprintf(line, sizeof line,
                  "time division: %llu waits (window %llu, debt %llu, others' work %llu, fit %llu, sibling %llu, "
                  "cut-in %llu, lead %llu), %.1f ms in all, longest %.3f ms\n",
                  static_cast<unsigned long long>(waits), static_cast<unsigned long long>(result.waits[1]),
                  static_cast<unsigned long long>(result.waits[2]), static_cast<unsigned long long>(result.waits[3]),
                  static_cast<unsigned long long>(result.waits[4]), static_cast<unsigned long long>(result.waits[5]),
                  static_cast<unsigned long long>(result.waits[6]), static_cast<unsigned long long>(result.waits[7]),
                  result.wait_total_ns / 1e6, result.wait_longest_ns / 1e6);
    text += line;
  }
  return text;
}

}  // namespace vgpu::sim
