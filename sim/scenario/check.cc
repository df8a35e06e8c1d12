// The rules of a Scenario struct (check.h): one function per level (run, tenant, process, phase), each returning ""
// or the first broken rule.
#include "vgpu/scenario/check.h"

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

#include "vgpu/scenario/limits.h"

namespace vgpu::scenario {
namespace {

using namespace limits;

std::string Field(const std::string& where, const std::string& name, std::uint64_t value, const std::string& accepted) {
  return where + name + " = " + std::to_string(value) + "; accepted: " + accepted;
}

std::string Real(const std::string& where, const std::string& name, double value, const std::string& accepted) {
  return where + name + " = " + std::to_string(value) + "; accepted: " + accepted;
}

std::string Index(const std::string& name, std::size_t i) { return name + "[" + std::to_string(i) + "]"; }

std::string CheckCollective(const Phase& phase, const std::string& where) {
  if (phase.collective_ns == 0 && phase.ranks == 0) return {};
  if (phase.collective_ns < kMicrosecondNs || phase.collective_ns > kMaxDurationNs) {
    return Field(where, "collective_ns", phase.collective_ns, "1 us .. 1 h with ranks, e.g. 1000000");
  }
  if (phase.ranks < 2 || phase.ranks > kMaxFakeDevices) {
    return Field(where, "ranks", phase.ranks, "2 .. 8 processes of the tenant, one per device");
  }
  if (phase.every < 1 || phase.every > kMaxDepth) return Field(where, "every", phase.every, "1 .. 128 kernels");
  return {};
}

std::string CheckPhase(const Phase& phase, const std::string& where) {
  if (phase.for_ns > kMaxDurationNs) return Field(where, "for_ns", phase.for_ns, "0 .. 1 h");
  if (phase.kind == Phase::Kind::idle) {
    if (phase.for_ns == 0) return Field(where, "for_ns", 0, "an idle phase needs a time above 0, e.g. 1s");
    return {};
  }
  if (phase.sizes_ns.empty()) return where + "sizes_ns is empty; accepted: one or more kernel sizes, e.g. [1ms]";
  if (phase.sizes_ns.size() > kMaxMixedSizes)
    return Field(where, "sizes_ns.size()", phase.sizes_ns.size(), "1 .. 1024");
  for (const std::uint64_t size : phase.sizes_ns) {
    if (size < 1 || size > kMaxKernelNs) return Field(where, "sizes_ns[]", size, "1 ns .. 1 h, e.g. 1000000");
  }
  if (phase.depth < 1 || phase.depth > kMaxDepth) return Field(where, "depth", phase.depth, "1 .. 128, e.g. 4");
  if (phase.blocks < 1 || phase.blocks > kMaxBlocks) return Field(where, "blocks", phase.blocks, "1 .. 65535");
  if (phase.jitter_permille > kMaxJitterPermille) {
    return Field(where, "jitter_permille", phase.jitter_permille, "0 .. 500");
  }
  if (!(phase.rate == 0 || (phase.rate >= kMinRate && phase.rate <= kMaxRate))) {
    return Real(where, "rate", phase.rate, "0 (a closed loop) or 0.001 .. 1e6 launches per second");
  }
  return CheckCollective(phase, where);
}

// A `program:` process: live over fakecuda, its words within bounds, nothing of vgpu-tenant's work beside it.
std::string CheckProgram(const Scenario& s, const ProcessSpec& process, const std::string& at) {
  if (s.real_gpu) {
    return at +
           "program is set with gpu = 'real'; accepted: a program on the fake GPU only (a real NVML does not "
           "tell a process's GPU time)";
  }
  if (process.program.size() > kMaxProgramWords) {
    return Field(at, "program.size()", process.program.size(), "1 .. 64 words: the program and its arguments");
  }
  for (std::size_t i = 0; i < process.program.size(); ++i) {
    const std::string& word = process.program[i];
    if (word.empty() || word.size() > kMaxProgramWordBytes || word.find('\0') != std::string::npos) {
      return Field(at, Index("program", i) + ".size()", word.size(), "1 .. 4096 bytes, no NUL");
    }
  }
  if (!process.work.empty()) return Field(at, "work.size()", process.work.size(), "0 with a program");
  if (process.alloc_bytes != 0) {
    return Field(at, "alloc_bytes", process.alloc_bytes, "0 with a program (it allocates its own memory)");
  }
  if (process.repeat) return at + "repeat = true with a program; accepted: false (a program runs once)";
  return {};
}

std::string CheckProcess(const Scenario& s, const TenantSpec& tenant, const ProcessSpec& process,
                         const std::string& at) {
  if (process.replicas < 1 || process.replicas > kMaxReplicas)
    return Field(at, "replicas", process.replicas, "1 .. 64");
  if (process.stop_ns > s.duration_ns || process.start_ns >= process.stop_ns) {
    return Field(at, "stop_ns", process.stop_ns,
                 "above start_ns (" + std::to_string(process.start_ns) + ") and at most duration_ns (" +
                     std::to_string(s.duration_ns) + ")");
  }
  if (process.crash_at_ns && (*process.crash_at_ns < process.start_ns || *process.crash_at_ns >= process.stop_ns)) {
    return Field(
        at, "crash_at_ns", *process.crash_at_ns,
        "in [start_ns, stop_ns) = [" + std::to_string(process.start_ns) + ", " + std::to_string(process.stop_ns) + ")");
  }
  if (process.device >= tenant.devices.size()) {
    return Field(at, "device", process.device,
                 "a CUDA ordinal of the tenant's devices, 0 .. " + std::to_string(tenant.devices.size() - 1));
  }
  if (!process.program.empty()) return CheckProgram(s, process, at);
  if (process.work.empty() || process.work.size() > kMaxPhases) {
    return Field(at, "work.size()", process.work.size(), "1 .. 64 phases, e.g. [{kernels: 1ms}], or a program");
  }
  for (std::size_t w = 0; w < process.work.size(); ++w) {
    if (std::string error = CheckPhase(process.work[w], at + Index("work", w) + "."); !error.empty()) return error;
  }
  return {};
}

std::string CheckExpectation(const Scenario& s, const Expectation& e, const std::string& at) {
  if (e.kind == Expectation::Kind::oom) return {};
  if (!(e.percent >= 0 && e.percent <= 100)) return Real(at, "percent", e.percent, "0 .. 100");
  if (e.to_ns > s.duration_ns || e.from_ns >= e.to_ns) {
    return Field(at, "to_ns", e.to_ns,
                 "above from_ns (" + std::to_string(e.from_ns) + ") and at most duration_ns (" +
                     std::to_string(s.duration_ns) + ")");
  }
  for (const auto& [name, points] :
       {std::pair{"tolerance_points", e.tolerance_points}, std::pair{"worst_window_points", e.worst_window_points}}) {
    if (points && !(*points > 0 && *points <= 100)) return Real(at, name, *points, "above 0, up to 100 points");
  }
  return {};
}

// The tenant's devices: at least one, each on the GPU and named once.
std::string CheckDevices(const Scenario& s, const TenantSpec& tenant, std::uint32_t device_count,
                         const std::string& where) {
  if (tenant.devices.empty()) return where + "devices is empty; accepted: one or more device indices, e.g. [0]";
  for (std::size_t d = 0; d < tenant.devices.size(); ++d) {
    if (tenant.devices[d] >= device_count) {
      return Field(where, Index("devices", d), tenant.devices[d],
                   "0 .. " + std::to_string(device_count - 1) + " (gpu = '" + s.gpu + "')");
    }
    for (std::size_t e = 0; e < d; ++e) {
      if (tenant.devices[e] == tenant.devices[d]) {
        return Field(where, Index("devices", d), tenant.devices[d], "each device once per tenant");
      }
    }
  }
  return {};
}

std::string CheckTenant(const Scenario& s, std::size_t t, std::uint32_t device_count) {
  const TenantSpec& tenant = s.tenants[t];
  const std::string where = Index("tenants", t) + ".";
  if (!IsPlainName(tenant.name)) {
    return where + "name = '" + tenant.name + "'; accepted: 1 .. 64 letters, digits, '-', '_', '.', e.g. a";
  }
  for (std::size_t other = 0; other < t; ++other) {
    if (s.tenants[other].name == tenant.name) return where + "name = '" + tenant.name + "' is used twice";
  }
  if (tenant.cores_percent > 100) return Field(where, "cores_percent", tenant.cores_percent, "0 .. 100");
  if (tenant.priority > 1) return Field(where, "priority", tenant.priority, "0 (high) or 1 (low)");
  if (std::string error = CheckDevices(s, tenant, device_count, where); !error.empty()) return error;
  if (tenant.processes.empty() || tenant.processes.size() > kMaxProcessEntries) {
    return Field(where, "processes.size()", tenant.processes.size(), "1 .. 16 entries (replicas aside)");
  }
  for (std::size_t p = 0; p < tenant.processes.size(); ++p) {
    const std::string at = where + Index("processes", p) + ".";
    if (std::string error = CheckProcess(s, tenant, tenant.processes[p], at); !error.empty()) return error;
  }
  for (std::size_t e = 0; e < tenant.expect.size(); ++e) {
    const std::string at = where + Index("expect", e) + ".";
    if (std::string error = CheckExpectation(s, tenant.expect[e], at); !error.empty()) return error;
  }
  return {};
}

// The run's clock: duration, its windows and samples, settling, the fake GPU's time slice and handover.
std::string CheckTimeline(const Scenario& s) {
  if (s.duration_ns < kMinDurationNs || s.duration_ns > kMaxDurationNs) {
    return Field("", "duration_ns", s.duration_ns, "100 ms .. 1 h, e.g. 6000000000");
  }
  if (s.window_ns < kMillisecondNs || s.window_ns > kMaxDurationNs || s.duration_ns % s.window_ns != 0) {
    return Field("", "window_ns", s.window_ns,
                 "1 ms .. 1 h, dividing duration_ns (" + std::to_string(s.duration_ns) + "), e.g. 1000000000");
  }
  if (s.sample_ns < kMillisecondNs || s.sample_ns > 60 * kSecondNs || s.window_ns % s.sample_ns != 0) {
    return Field("", "sample_ns", s.sample_ns,
                 "1 ms .. 60 s, dividing window_ns (" + std::to_string(s.window_ns) + "), e.g. 100000000");
  }
  if (s.settle_ns % s.window_ns != 0 || s.settle_ns >= s.duration_ns) {
    return Field("", "settle_ns", s.settle_ns,
                 "a multiple of window_ns (" + std::to_string(s.window_ns) + ") below duration_ns");
  }
  if (s.timeslice_ns < kMinTimesliceNs || s.timeslice_ns > kMaxTimesliceNs) {
    return Field("", "timeslice_ns", s.timeslice_ns, "1 us .. 1 s, e.g. 2000000");
  }
  if (s.switch_ns > kMaxSwitchNs) return Field("", "switch_ns", s.switch_ns, "0 .. 100 ms, e.g. 160000");
  return {};
}

// How many devices the scenario's GPU has: a fake spec's, or device_count for gpu: real.
std::string CountDevices(const Scenario& s, std::uint32_t& device_count) {
  if (s.real_gpu) {
    device_count = s.device_count;
    if (device_count < 1 || device_count > kMaxRealDevices) {
      return Field("", "device_count", device_count, "1 .. 16 for gpu = 'real'");
    }
    return {};
  }
  std::vector<std::string> items;
  std::string error;
  if (!DeviceItems(s.gpu, items, error)) return error;
  device_count = static_cast<std::uint32_t>(items.size());
  return {};
}

std::string_view Trim(std::string_view text) {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  return text;
}

}  // namespace

std::string Check(const Scenario& s) {
  std::uint32_t device_count = 0;
  if (std::string error = CountDevices(s, device_count); !error.empty()) return error;
  if (std::string error = CheckTimeline(s); !error.empty()) return error;
  if (s.tenants.empty() || s.tenants.size() > kMaxTenants) {
    return Field("", "tenants.size()", s.tenants.size(), "1 .. 16 tenants");
  }
  std::uint64_t processes = 0;
  for (std::size_t t = 0; t < s.tenants.size(); ++t) {
    if (std::string error = CheckTenant(s, t, device_count); !error.empty()) return error;
    for (const ProcessSpec& process : s.tenants[t].processes) processes += process.replicas;
  }
  if (processes > kMaxProcessesInAll) {
    return Field("", "processes (replicas of every tenant)", processes, "1 .. 255 (the fake machine's slots)");
  }
  return {};
}

bool DeviceItems(const std::string& gpu, std::vector<std::string>& items, std::string& error) {
  items.clear();
  std::string_view rest = gpu;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    std::string_view item = Trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    std::uint64_t repeat = 1;
    // "2*h100-80gb" (FAKECUDA_DEVICES) or "2xh100-80gb" (the scenario file): digits, then '*' or 'x'.
    std::size_t digits = 0;
    while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9') ++digits;
    if (digits > 0 && digits < item.size() && (item[digits] == '*' || item[digits] == 'x')) {
      const auto [end, ec] = std::from_chars(item.data(), item.data() + digits, repeat);
      if (ec != std::errc() || repeat == 0 || repeat > kMaxFakeDevices) {
        error = "gpu = '" + gpu + "': the repeat count in '" + std::string(item) +
                "' is not 1 .. 8; accepted: e.g. h100-80gb or 2xh100-80gb";
        return false;
      }
      item = Trim(item.substr(digits + 1));
    }
    if (item.empty()) {
      error = "gpu = '" + gpu + "' has an empty device; accepted: e.g. h100-80gb or 2xh100-80gb";
      return false;
    }
    for (std::uint64_t r = 0; r < repeat; ++r) items.emplace_back(item);
  }
  if (items.empty() || items.size() > kMaxFakeDevices) {
    error = "gpu = '" + gpu + "' names " + std::to_string(items.size()) +
            " devices; accepted: 1 .. 8, e.g. h100-80gb or 2xh100-80gb";
    return false;
  }
  return true;
}

}  // namespace vgpu::scenario
