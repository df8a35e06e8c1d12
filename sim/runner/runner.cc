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

std::string Check(const scenario::Scenario& s, Mode mode) {
  if (mode == Mode::virtual_time) {
    if (s.real_gpu) return "gpu = 'real' runs live only; accepted in virtual mode: a fakecuda preset, e.g. h100-80gb";
    if (!s.virtual_mode) return "mode: the scenario is not meant for virtual mode (its mode list has no virtual)";
    if (!s.faults.empty()) {
      return "faults: " + std::to_string(s.faults.size()) +
             " rule(s), but faults are not modelled in virtual mode; run the scenario live";
    }
    for (const scenario::TenantSpec& tenant : s.tenants) {
      for (const scenario::ProcessSpec& process : tenant.processes) {
        if (!process.program.empty()) {
          return "tenant '" + tenant.name + "' runs the program '" + process.program[0] +
                 "', and a program runs as a real process; run the scenario live";
        }
      }
    }
  } else {
    if (!s.live_mode) return "mode: the scenario is not meant for live mode (its mode list has no live)";
    if (s.real_gpu && !s.faults.empty()) return "faults: fault rules need the fake GPU, and gpu = 'real'";
  }
  if (mode == Mode::live && s.sample_ns % scenario::kMillisecondNs != 0) {
    return "sample_ns = " + std::to_string(s.sample_ns) +
           "; accepted: whole milliseconds in live mode (vgpu-tenant --report-ms)";
  }
  return scenario::Check(s);
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
                    .Text("policy", scenario::PolicyName(tenant.policy))
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
