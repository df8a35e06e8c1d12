// The runner's door: the checks both modes need, the trace's lines and sink, and the dispatch to virtual or live.
#include "vgpu/runner/runner.h"

#include <errno.h>
#include <time.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "internal.h"

namespace vgpu::runner {
namespace internal {
namespace {

using scenario::limits::kMaxDurationNs;
using scenario::limits::kMaxKernelNs;
using scenario::limits::kMaxReplicas;
using scenario::limits::kMaxTenants;
constexpr std::uint64_t kMaxProcesses = scenario::limits::kMaxProcessesInAll;

std::string Field(const std::string& where, const char* name, std::uint64_t value, const std::string& accepted) {
  return where + name + " = " + std::to_string(value) + "; accepted: " + accepted;
}

std::string CheckPhase(const scenario::Phase& phase, const std::string& where) {
  if (phase.kind == scenario::Phase::Kind::idle) {
    if (phase.for_ns == 0) return Field(where, "for_ns", 0, "an idle phase needs a time above 0, e.g. 1s");
    return {};
  }
  if (phase.sizes_ns.empty()) return where + "sizes_ns is empty; accepted: one or more kernel sizes, e.g. [1ms]";
  if (phase.sizes_ns.size() > scenario::limits::kMaxMixedSizes)
    return Field(where, "sizes_ns.size()", phase.sizes_ns.size(), "1 .. 1024");
  for (const std::uint64_t size : phase.sizes_ns) {
    if (size < 1 || size > kMaxKernelNs) return Field(where, "sizes_ns[]", size, "1 ns .. 1 h, e.g. 1000000");
  }
  if (phase.depth < 1 || phase.depth > 128) return Field(where, "depth", phase.depth, "1 .. 128, e.g. 4");
  if (phase.blocks < 1 || phase.blocks > 65535) return Field(where, "blocks", phase.blocks, "1 .. 65535");
  if (phase.jitter_permille > 500) return Field(where, "jitter_permille", phase.jitter_permille, "0 .. 500");
  if (!(phase.rate >= 0 && phase.rate <= 1e9)) {
    return where + "rate = " + std::to_string(phase.rate) + "; accepted: 0 (closed loop) .. 1e9 launches per second";
  }
  if (phase.rate > 0 && phase.rate < 0.001) {
    return where + "rate = " + std::to_string(phase.rate) + "; accepted: 0 (closed loop) or at least 0.001";
  }
  return {};
}

}  // namespace

const char* PolicyText(scenario::Policy policy) {
  switch (policy) {
    case scenario::Policy::force:
      return "force";
    case scenario::Policy::default_policy:
      return "default";
    case scenario::Policy::disable:
      return "disable";
  }
  return "force";
}

bool DeviceItems(const std::string& gpu, std::vector<std::string>& items, std::string& error) {
  items.clear();
  std::string_view rest = gpu;
  const auto trim = [](std::string_view text) {
    while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
    while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
    return text;
  };
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    std::string_view item = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    std::uint64_t repeat = 1;
    // "2*h100-80gb" (FAKECUDA_DEVICES) or "2xh100-80gb" (the scenario file): digits, then '*' or 'x'.
    std::size_t digits = 0;
    while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9') ++digits;
    if (digits > 0 && digits < item.size() && (item[digits] == '*' || item[digits] == 'x')) {
      const auto [end, ec] = std::from_chars(item.data(), item.data() + digits, repeat);
      if (ec != std::errc() || repeat == 0 || repeat > 8) {
        error = "gpu = '" + gpu + "': the repeat count in '" + std::string(item) +
                "' is not 1 .. 8; accepted: e.g. h100-80gb or 2xh100-80gb";
        return false;
      }
      item = trim(item.substr(digits + 1));
    }
    if (item.empty()) {
      error = "gpu = '" + gpu + "' has an empty device; accepted: e.g. h100-80gb or 2xh100-80gb";
      return false;
    }
    for (std::uint64_t r = 0; r < repeat; ++r) items.emplace_back(item);
  }
  if (items.empty() || items.size() > 8) {
    error = "gpu = '" + gpu + "' names " + std::to_string(items.size()) +
            " devices; accepted: 1 .. 8, e.g. h100-80gb or 2xh100-80gb";
    return false;
  }
  return true;
}

std::string Check(const scenario::Scenario& s, Mode mode) {
  if (mode == Mode::virtual_time) {
    if (s.real_gpu) return "gpu = 'real' runs live only; accepted in virtual mode: a fakecuda preset, e.g. h100-80gb";
    if (!s.virtual_mode) return "mode: the scenario is not meant for virtual mode (its mode list has no virtual)";
    if (!s.faults.empty()) {
      return "faults: " + std::to_string(s.faults.size()) +
             " rule(s), but faults are not modelled in virtual mode; run the scenario live";
    }
  } else {
    if (!s.live_mode) return "mode: the scenario is not meant for live mode (its mode list has no live)";
    if (s.real_gpu && !s.faults.empty()) return "faults: fault rules need the fake GPU, and gpu = 'real'";
  }
  std::uint32_t device_count = s.device_count;
  if (!s.real_gpu) {
    std::vector<std::string> items;
    std::string error;
    if (!DeviceItems(s.gpu, items, error)) return error;
    device_count = static_cast<std::uint32_t>(items.size());
  } else if (device_count < 1 || device_count > 16) {
    return Field("", "device_count", device_count, "1 .. 16 for gpu = 'real'");
  }
  if (s.duration_ns == 0 || s.duration_ns > kMaxDurationNs) {
    return Field("", "duration_ns", s.duration_ns, "1 ns .. 1 h, e.g. 6000000000");
  }
  if (s.sample_ns == 0 || s.duration_ns % s.sample_ns != 0) {
    return Field("", "sample_ns", s.sample_ns,
                 "above 0 and dividing duration_ns (" + std::to_string(s.duration_ns) + "), e.g. 100000000");
  }
  if (s.window_ns == 0 || s.window_ns % s.sample_ns != 0 || s.duration_ns % s.window_ns != 0) {
    return Field("", "window_ns", s.window_ns,
                 "a multiple of sample_ns (" + std::to_string(s.sample_ns) + ") dividing duration_ns (" +
                     std::to_string(s.duration_ns) + ")");
  }
  if (s.settle_ns % s.window_ns != 0 || s.settle_ns > s.duration_ns) {
    return Field("", "settle_ns", s.settle_ns,
                 "a multiple of window_ns (" + std::to_string(s.window_ns) + ") up to duration_ns");
  }
  if (s.timeslice_ns < 1000 || s.timeslice_ns > scenario::kSecondNs) {
    return Field("", "timeslice_ns", s.timeslice_ns, "1 us .. 1 s, e.g. 2000000");
  }
  if (mode == Mode::live && s.sample_ns % scenario::kMillisecondNs != 0) {
    return Field("", "sample_ns", s.sample_ns, "whole milliseconds in live mode (vgpu-tenant --report-ms)");
  }
  if (s.tenants.empty() || s.tenants.size() > kMaxTenants) {
    return Field("", "tenants.size()", s.tenants.size(), "1 .. 16 tenants");
  }
  std::uint64_t processes = 0;
  for (std::size_t t = 0; t < s.tenants.size(); ++t) {
    const scenario::TenantSpec& tenant = s.tenants[t];
    const std::string where = "tenants[" + std::to_string(t) + "].";
    if (!scenario::limits::IsPlainName(tenant.name)) {
      return where + "name = '" + tenant.name + "'; accepted: 1 .. 64 letters, digits, '-', '_', '.', e.g. a";
    }
    for (std::size_t other = 0; other < t; ++other) {
      if (s.tenants[other].name == tenant.name) return where + "name = '" + tenant.name + "' is used twice";
    }
    if (tenant.cores_percent > 100) return Field(where, "cores_percent", tenant.cores_percent, "0 .. 100");
    if (tenant.devices.empty()) return where + "devices is empty; accepted: one or more device indices, e.g. [0]";
    for (std::size_t d = 0; d < tenant.devices.size(); ++d) {
      if (tenant.devices[d] >= device_count) {
        return Field(where, ("devices[" + std::to_string(d) + "]").c_str(), tenant.devices[d],
                     "0 .. " + std::to_string(device_count - 1) + " (gpu = '" + s.gpu + "')");
      }
      for (std::size_t e = 0; e < d; ++e) {
        if (tenant.devices[e] == tenant.devices[d]) {
          return Field(where, ("devices[" + std::to_string(d) + "]").c_str(), tenant.devices[d],
                       "each device once per tenant");
        }
      }
    }
    for (std::size_t p = 0; p < tenant.processes.size(); ++p) {
      const scenario::ProcessSpec& process = tenant.processes[p];
      const std::string at = where + "processes[" + std::to_string(p) + "].";
      if (process.replicas < 1 || process.replicas > kMaxReplicas) {
        return Field(at, "replicas", process.replicas, "1 .. 64");
      }
      if (process.stop_ns > s.duration_ns || process.start_ns >= process.stop_ns) {
        return Field(at, "stop_ns", process.stop_ns,
                     "above start_ns (" + std::to_string(process.start_ns) + ") and at most duration_ns (" +
                         std::to_string(s.duration_ns) + ")");
      }
      if (process.crash_at_ns && (*process.crash_at_ns < process.start_ns || *process.crash_at_ns >= process.stop_ns)) {
        return Field(at, "crash_at_ns", *process.crash_at_ns,
                     "in [start_ns, stop_ns) = [" + std::to_string(process.start_ns) + ", " +
                         std::to_string(process.stop_ns) + ")");
      }
      if (process.device >= tenant.devices.size()) {
        return Field(at, "device", process.device,
                     "a CUDA ordinal of the tenant's devices, 0 .. " + std::to_string(tenant.devices.size() - 1));
      }
      if (process.work.empty()) return at + "work is empty; accepted: one or more phases, e.g. [{kernels: 1ms}]";
      for (std::size_t w = 0; w < process.work.size(); ++w) {
        const std::string phase_error = CheckPhase(process.work[w], at + "work[" + std::to_string(w) + "].");
        if (!phase_error.empty()) return phase_error;
      }
      processes += process.replicas;
    }
  }
  if (processes > kMaxProcesses) {
    return Field("", "processes (replicas of every tenant)", processes, "1 .. 255 (the fake machine's slots)");
  }
  return {};
}

std::vector<ProcessRun> Expand(const scenario::Scenario& s) {
  std::vector<ProcessRun> runs;
  std::uint32_t global = 0;
  for (std::uint32_t t = 0; t < s.tenants.size(); ++t) {
    const scenario::TenantSpec& tenant = s.tenants[t];
    std::uint32_t index = 0;
    for (const scenario::ProcessSpec& spec : tenant.processes) {
      for (std::uint32_t r = 0; r < spec.replicas; ++r) {
        ProcessRun run;
        run.tenant = t;
        run.index = index++;
        run.global = global++;
        run.spec = &spec;
        run.device = tenant.devices[spec.device];
        run.end_ns = spec.crash_at_ns ? *spec.crash_at_ns : spec.stop_ns;
        runs.push_back(run);
      }
    }
  }
  return runs;
}

TraceSink::~TraceSink() {
  if (file_ != nullptr) std::fclose(file_);
}

bool TraceSink::Open(const std::string& path, std::string& error) {
  path_ = path;
  if (path.empty()) return true;
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) {
    error = "cannot write the trace to '" + path + "': " + std::strerror(errno);
    return false;
  }
  return true;
}

void TraceSink::Write(const std::string& line) {
  if (file_ == nullptr) {
    text_ += line;
    return;
  }
  // A line at a time and flushed: a reader following the file (or a run cut short) sees whole lines.
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    if (write_errno_ == 0) write_errno_ = errno != 0 ? errno : EIO;
  }
}

bool TraceSink::Close(std::string& error) {
  if (file_ != nullptr) {
    if (std::fclose(file_) != 0 && write_errno_ == 0) write_errno_ = errno != 0 ? errno : EIO;
    file_ = nullptr;
  }
  if (write_errno_ != 0) {
    error = "cannot write the trace to '" + path_ + "': " + std::strerror(write_errno_);
    return false;
  }
  return true;
}

void WriteHeader(const scenario::Scenario& s, Mode mode, std::uint32_t device_count, TraceSink& trace) {
  trace.Write(Line("run")
                  .Text("scenario", s.name)
                  .Text("file", s.file)
                  .Text("mode", mode == Mode::live ? "live" : "virtual")
                  .Text("gpu", s.gpu)
                  .Number("devices", device_count)
                  .Number("seed", s.seed)
                  .Number("duration_ns", s.duration_ns)
                  .Number("settle_ns", s.settle_ns)
                  .Number("window_ns", s.window_ns)
                  .Number("sample_ns", s.sample_ns)
                  .Number("version", kTraceVersion)
                  .Done());
  for (std::uint32_t t = 0; t < s.tenants.size(); ++t) {
    const scenario::TenantSpec& tenant = s.tenants[t];
    std::uint64_t processes = 0;
    for (const scenario::ProcessSpec& process : tenant.processes) processes += process.replicas;
    trace.Write(Line("tenant")
                    .Text("tenant", tenant.name)
                    .Number("index", t)
                    .Numbers("devices", tenant.devices)
                    .Number("cores_percent", tenant.cores_percent)
                    .Number("memory_limit_bytes", tenant.memory_limit_bytes)
                    .Text("policy", PolicyText(tenant.policy))
                    .Number("priority", tenant.priority)
                    .Number("processes", processes)
                    .Done());
  }
}

namespace {

// Where the value of "key": starts, or npos.
std::size_t ValueAt(std::string_view line, std::string_view key) {
  // Built with +=: GCC 12 at -O3 warns (-Wrestrict, a false positive) on "..." + std::string(...).
  std::string pattern = "\"";
  pattern += key;
  pattern += "\":";
  const std::size_t at = line.find(pattern);
  return at == std::string_view::npos ? at : at + pattern.size();
}

}  // namespace

bool FindNumber(std::string_view line, std::string_view key, std::uint64_t& value) {
  std::size_t at = ValueAt(line, key);
  if (at == std::string_view::npos) return false;
  while (at < line.size() && line[at] == ' ') ++at;
  const auto [end, ec] = std::from_chars(line.data() + at, line.data() + line.size(), value);
  return ec == std::errc() && end != line.data() + at;
}

bool FindText(std::string_view line, std::string_view key, std::string& value) {
  std::size_t at = ValueAt(line, key);
  if (at == std::string_view::npos) return false;
  while (at < line.size() && line[at] == ' ') ++at;
  if (at >= line.size() || line[at] != '"') return false;
  std::string text;
  for (std::size_t i = at + 1; i < line.size(); ++i) {
    if (line[i] == '\\' && i + 1 < line.size()) {
      text += line[++i];
    } else if (line[i] == '"') {
      value = std::move(text);
      return true;
    } else {
      text += line[i];
    }
  }
  return false;
}

}  // namespace internal

Outcome Run(const scenario::Scenario& scenario, const Options& options) {
  struct timespec started {};
  clock_gettime(CLOCK_MONOTONIC, &started);
  Outcome outcome;
  internal::TraceSink trace;
  try {
    if (const std::string problem = internal::Check(scenario, options.mode); !problem.empty()) {
      outcome.error = "scenario '" + scenario.name + "': " + problem;
      return outcome;
    }
    if (!trace.Open(options.trace_path, outcome.error)) return outcome;
    outcome = options.mode == Mode::live ? internal::RunLive(scenario, options, trace)
                                         : internal::RunVirtual(scenario, options, trace);
  } catch (const std::exception& exception) {
    // Out of host memory (or a library's throw) ends the run with a message, never the caller's process.
    outcome.ok = false;
    outcome.error = std::string("internal error: ") + exception.what();
  }
  std::string close_error;
  if (!trace.Close(close_error) && outcome.ok) {
    outcome.ok = false;
    outcome.error = close_error;
  }
  if (options.trace_path.empty()) outcome.trace = trace.TakeText();
  struct timespec ended {};
  clock_gettime(CLOCK_MONOTONIC, &ended);
  outcome.wall_seconds =
      static_cast<double>(ended.tv_sec - started.tv_sec) + static_cast<double>(ended.tv_nsec - started.tv_nsec) * 1e-9;
  if (options.progress && outcome.ok) {
    try {
      options.progress(1.0, "done");
    } catch (const std::exception& exception) {  // Run never throws, whatever the caller's callback does
      outcome.ok = false;
      outcome.error = std::string("the progress callback failed: ") + exception.what();
    } catch (...) {
      outcome.ok = false;
      outcome.error = "the progress callback failed";
    }
  }
  return outcome;
}

}  // namespace vgpu::runner
