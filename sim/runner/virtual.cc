// Virtual mode: each physical device is one run of the simulator (sim/core) with the tenants that use it (the
// limiter's budgets are per device, so devices are independent); memory is the shim's ledger, replayed in time
// order. The trace is written afterwards in time order, in the same format as a live run's.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "internal.h"
#include "vgpu/sim/sim.h"

namespace vgpu::runner::internal {
namespace {

// A phase list with short phases and `repeat` over an hour becomes this many segments; beyond it the simulator
// would spend its time on the schedule, not the kernels.
constexpr std::size_t kMaxSegments = 1'000'000;

// What vgpu-tenant does for a kernels phase, as the simulator's workload.
bool ToWorkload(const scenario::Phase& phase, sim::Workload& workload, std::string& error) {
  workload = sim::Workload{};
  if (phase.collective_ns != 0) {
    error =
        "collective: the simulator runs each device alone, so a collective among devices runs live only; "
        "accepted in virtual mode: phases without collective:";
    return false;
  }
  workload.queue_depth = phase.depth;
  workload.jitter_permille = phase.jitter_permille;
  if (phase.sizes_ns.size() > 1) {
    if (phase.rate > 0) {
      error = "rate = " + std::to_string(phase.rate) + " with " + std::to_string(phase.sizes_ns.size()) +
              " kernel sizes: the simulator runs mixed sizes in a closed loop only; accepted in virtual mode: one "
              "size with a rate, or mixed sizes without one";
      return false;
    }
    workload.kind = sim::WorkloadKind::mixed;
    workload.sizes_ns = phase.sizes_ns;
    // vgpu-tenant launches every size as the one spin kernel with one shape: the limiter cannot tell them apart.
    workload.sizes_share_one_kernel = true;
  } else {
    workload.kernel_ns = phase.sizes_ns.front();
    if (phase.rate > 0) {
      workload.kind = sim::WorkloadKind::rate;
      workload.launches_per_second = phase.rate;
    } else {
      workload.kind = sim::WorkloadKind::closed_loop;
    }
  }
  return true;
}

// The phases from start to stop, in order, looped if `repeat`: the kernels phases become segments, the idle
// phases the gaps between them.
bool ToSegments(const scenario::ProcessSpec& spec, std::vector<sim::Segment>& segments, std::string& error) {
  segments.clear();
  std::uint64_t now = spec.start_ns;
  for (;;) {
    const std::uint64_t cycle_start = now;
    const std::size_t segments_before = segments.size();
    for (std::size_t w = 0; w < spec.work.size() && now < spec.stop_ns; ++w) {
      const scenario::Phase& phase = spec.work[w];
      const std::uint64_t left = spec.stop_ns - now;
      if (phase.kind == scenario::Phase::Kind::idle) {
        now += std::min(phase.for_ns, left);
        continue;
      }
      sim::Segment segment;
      segment.start_ns = now;
      segment.stop_ns = phase.for_ns == 0 ? spec.stop_ns : now + std::min(phase.for_ns, left);
      if (!ToWorkload(phase, segment.workload, error)) {
        error = "work[" + std::to_string(w) + "]." + error;
        return false;
      }
      now = segment.stop_ns;
      segments.push_back(std::move(segment));
      if (segments.size() > kMaxSegments) {
        error = "work: " + std::to_string(segments.size()) +
                "+ phases between start and stop (repeat: true); "
                "accepted in virtual mode: at most " +
                std::to_string(kMaxSegments) + "; use longer phases";
        return false;
      }
    }
    // A cycle that ran nothing (only idle phases) would run nothing again: the rest is idle, however many cycles.
    if (!spec.repeat || now >= spec.stop_ns || now == cycle_start || segments.size() == segments_before) break;
  }
  return true;
}

// What the shim's ledger makes of a process: it reserves its context and allocation at its start against its
// tenant's limit on that device, or fails (OOM) and runs nothing; it holds them until it ends.
struct Ledger {
  bool oom = false;
  std::uint64_t oom_bytes = 0;  // what was refused: the allocation, or the context if even that did not fit
  std::uint64_t held_bytes = 0;
};

enum class EventKind { exit = 0, start = 1, oom = 2, oom_exit = 3 };  // the order of events at one instant

struct Event {
  std::uint64_t t_ns;
  EventKind kind;
  std::uint32_t process;  // index into the expanded runs
};

// A tenant on one device: its row in that device's simulation (or none) and its memory now.
struct TenantDevice {
  int sim_index = -1;
  std::uint64_t memory_bytes = 0;
};

// At one instant, what ends gives its memory back before what starts takes any; then by process.
bool ByTime(const Event& a, const Event& b) {
  if (a.t_ns != b.t_ns) return a.t_ns < b.t_ns;
  if (a.kind != b.kind) return a.kind < b.kind;
  return a.process < b.process;
}

// Each device item's spec (`gpu`, split into items): false, with `error`, for one fakecuda does not know.
bool DeviceSpecs(const scenario::Scenario& s, const std::vector<std::string>& items,
                 std::vector<fakecuda::model::DeviceSpec>& specs, std::string& error) {
  specs.resize(items.size());
  for (std::size_t d = 0; d < items.size(); ++d) {
    fakecuda::model::MachineConfig config = fakecuda::model::DefaultConfig();
    std::string why;
    if (!fakecuda::model::ParseDevices(items[d], config, why)) {
      error = "gpu = '" + s.gpu + "', device " + std::to_string(d) + ": " + why;
      return false;
    }
    specs[d] = config.devices[0];
  }
  return true;
}

// Every process's schedule as the simulator's segments: a phase the simulator cannot run is refused (false, with
// `error` naming it) before anything runs.
bool Schedules(const scenario::Scenario& s, const std::vector<ProcessRun>& runs,
               std::vector<std::vector<sim::Segment>>& segments, std::string& error) {
  segments.assign(runs.size(), {});
  for (std::size_t i = 0; i < runs.size(); ++i) {
    std::string why;
    if (ToSegments(*runs[i].spec, segments[i], why)) continue;
    const scenario::ProcessSpec& spec = *runs[i].spec;
    const scenario::TenantSpec& tenant = s.tenants[runs[i].tenant];
    const auto entry = static_cast<std::size_t>(&spec - tenant.processes.data());
    error = "scenario '" + s.name + "': tenants[" + std::to_string(runs[i].tenant) + "].processes[" +
            std::to_string(entry) + "]." + why;
    return false;
  }
  return true;
}

// The shim's ledger in time order: each process reserves its context and allocation at its start against its
// tenant's limit on its device (or is refused: OOM), and gives them back at its end. `leaked_bytes`: what is still
// held after every end (0 unless the ledger is wrong).
std::vector<Ledger> RunLedger(const scenario::Scenario& s, const std::vector<ProcessRun>& runs,
                              std::uint64_t& leaked_bytes) {
  std::vector<Event> events;
  for (std::uint32_t i = 0; i < runs.size(); ++i) {
    events.push_back({runs[i].spec->start_ns, EventKind::start, i});
    events.push_back({runs[i].end_ns, EventKind::exit, i});
  }
  std::sort(events.begin(), events.end(), ByTime);
  std::vector<Ledger> ledger(runs.size());
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::uint64_t> used;  // (tenant, device) -> bytes
  for (const Event& event : events) {
    const ProcessRun& run = runs[event.process];
    Ledger& entry = ledger[event.process];
    std::uint64_t& tenant_used = used[{run.tenant, run.device}];
    if (event.kind == EventKind::exit) {
      tenant_used -= std::min(tenant_used, entry.held_bytes);
      continue;
    }
    const std::uint64_t limit = s.tenants[run.tenant].memory_limit_bytes;
    const std::uint64_t context = s.context_bytes;
    const std::uint64_t alloc = run.spec->alloc_bytes;
    const auto fits = [&](std::uint64_t bytes) {
      return limit == 0 || (bytes <= limit && tenant_used <= limit - bytes);  // never `used + bytes`: no wrap
    };
    if (!fits(context)) {
      entry.oom = true;
      entry.oom_bytes = context;
    } else if (!fits(context + alloc) || alloc > UINT64_MAX - context) {
      entry.oom = true;
      entry.oom_bytes = alloc;
    } else {
      entry.held_bytes = context + alloc;
      tenant_used += entry.held_bytes;
    }
  }
  leaked_bytes = 0;
  for (const auto& [key, bytes] : used) leaked_bytes += bytes;
  return ledger;
}

// The simulator's settings for device `item`, as the shim runs (without its tenants).
sim::Scenario DeviceScenario(const scenario::Scenario& s, const std::string& item) {
  sim::Scenario simulation;
  simulation.device = item;
  simulation.timeslice_ns = s.timeslice_ns;
  simulation.switch_ns = s.switch_ns;
  simulation.duration_ns = s.duration_ns;
  simulation.settle_ns = 0;  // the trace's reader judges windows; the simulator's own summary is unused
  simulation.window_ns = s.window_ns;
  simulation.seed = s.seed;
  simulation.sample_ns = s.sample_ns;
  // As the shim measures (the simulator's default, sim::Measurement::shim): windows, sampled pairs, unmeasured
  // launches, decided by the shim's own code (vgpu/policy/measure.h). (Measured each by an event pair, a `default`
  // tenant did not give the GPU back when a neighbour arrived: scenarios/noisy-neighbour-default.yaml.)
  simulation.measurement = sim::Measurement::shim;
  if (s.sharing == scenario::Sharing::time_division) {
    // As the shim runs it (vgpu-core/hooks/turn.cc): a 20 ms cycle, doubled up to 640 ms until every window holds
    // its container's longest kernel.
    simulation.sharing = sim::Sharing::time_division;
    simulation.cycle_ns = 20 * scenario::kMillisecondNs;
    simulation.cycle_max_ns = 640 * scenario::kMillisecondNs;
  }
  return simulation;
}

// The tenants that run something on device `d` (no OOM, a schedule), each with its processes there; `rows[t]` says
// where tenant t went in the simulation.
void AddTenants(const scenario::Scenario& s, std::uint32_t d, const std::vector<ProcessRun>& runs,
                const std::vector<std::vector<sim::Segment>>& segments, const std::vector<Ledger>& ledger,
                sim::Scenario& simulation, std::vector<TenantDevice>& rows) {
  for (std::uint32_t t = 0; t < s.tenants.size(); ++t) {
    sim::Tenant tenant;
    tenant.name = s.tenants[t].name;
    tenant.share_percent = s.tenants[t].cores_percent;
    tenant.policy = s.tenants[t].policy;
    for (std::uint32_t i = 0; i < runs.size(); ++i) {
      if (runs[i].tenant != t || runs[i].device != d || ledger[i].oom || segments[i].empty()) continue;
      sim::Process process;
      process.segments = segments[i];
      // Also the single-workload fields, consistent with the segments, for whatever reads them.
      process.workload = process.segments.front().workload;
      process.start_ns = process.segments.front().start_ns;
      process.stop_ns = process.segments.back().stop_ns;
      if (runs[i].spec->crash_at_ns) process.crash_ns = *runs[i].spec->crash_at_ns;
      tenant.processes.push_back(std::move(process));
    }
    if (tenant.processes.empty()) continue;
    rows[t].sim_index = static_cast<int>(simulation.tenants.size());
    simulation.tenants.push_back(std::move(tenant));
  }
}

// Runs device `d`'s simulation (nothing if no tenant runs there) into `result`, reporting progress as the share
// `d / device_count` onwards; false, with `error`, when cancelled or refused.
bool SimulateDevice(const scenario::Scenario& s, std::uint32_t d, std::uint32_t device_count, sim::Scenario& simulation,
                    const Options& options, sim::Result& result, std::string& error) {
  std::uint64_t next_report_ns = scenario::kSecondNs;
  simulation.progress = [&](std::uint64_t now_ns) {
    if (options.cancel != nullptr && options.cancel->load()) return false;
    if (options.progress && now_ns >= next_report_ns) {
      next_report_ns = now_ns + scenario::kSecondNs;
      const double within = static_cast<double>(now_ns) / static_cast<double>(s.duration_ns);
      options.progress(0.9 * (d + within) / device_count, "simulating device " + std::to_string(d));
    }
    return true;
  };
  if (!simulation.tenants.empty()) {
    result = sim::Run(simulation);
    if (options.cancel != nullptr && options.cancel->load()) {
      error = "cancelled while device " + std::to_string(d) + " was simulated";
      return false;
    }
    if (!result.error.empty()) {
      error = "scenario '" + s.name + "', device " + std::to_string(d) + ": the simulator refused it: " + result.error;
      return false;
    }
    const std::uint64_t samples = s.duration_ns / s.sample_ns;
    for (const sim::TenantResult& tenant : result.tenants) {
      if (tenant.busy_samples_ns.size() != samples) {
        error = "internal: the simulator gave " + std::to_string(tenant.busy_samples_ns.size()) +
                " busy samples for tenant '" + tenant.name + "' on device " + std::to_string(d) + ", expected " +
                std::to_string(samples);
        return false;
      }
    }
  }
  if (options.progress) options.progress(0.9 * (d + 1) / device_count, "simulated device " + std::to_string(d));
  return true;
}

// What the trace says of the processes: starts, OOMs and exits, in time order.
std::vector<Event> ProcessEvents(const std::vector<ProcessRun>& runs, const std::vector<Ledger>& ledger) {
  std::vector<Event> events;
  for (std::uint32_t i = 0; i < runs.size(); ++i) {
    events.push_back({runs[i].spec->start_ns, EventKind::start, i});
    if (ledger[i].oom) {
      events.push_back({runs[i].spec->start_ns, EventKind::oom, i});
      events.push_back({runs[i].spec->start_ns, EventKind::oom_exit, i});
    } else {
      events.push_back({runs[i].end_ns, EventKind::exit, i});
    }
  }
  std::sort(events.begin(), events.end(), ByTime);
  return events;
}

// One process event's trace line; the tenant's memory on the device follows it.
void WriteEvent(const scenario::Scenario& s, const Event& event, const std::vector<ProcessRun>& runs,
                const std::vector<Ledger>& ledger, std::vector<std::vector<TenantDevice>>& rows, TraceSink& trace) {
  const ProcessRun& run = runs[event.process];
  const std::string& name = s.tenants[run.tenant].name;
  TenantDevice& memory = rows[run.device][run.tenant];
  switch (event.kind) {
    case EventKind::start:
      memory.memory_bytes += ledger[event.process].held_bytes;
      trace.Write(Line("process")
                      .Text("tenant", name)
                      .Number("process", run.index)
                      .Number("pid", 0)
                      .Number("device", run.device)
                      .Number("t_ns", event.t_ns)
                      .Done());
      break;
    case EventKind::oom:
      trace.Write(Line("oom")
                      .Number("t_ns", event.t_ns)
                      .Text("tenant", name)
                      .Number("process", run.index)
                      .Number("bytes", ledger[event.process].oom_bytes)
                      .Done());
      break;
    case EventKind::oom_exit:
    case EventKind::exit: {
      memory.memory_bytes -= std::min(memory.memory_bytes, ledger[event.process].held_bytes);
      const bool killed = event.kind == EventKind::exit && run.spec->crash_at_ns.has_value();
      const char* status = event.kind == EventKind::oom_exit ? "oom" : killed ? "killed" : "ok";
      const int code = event.kind == EventKind::oom_exit ? kOomCode : killed ? kKilledCode : 0;
      trace.Write(Line("exit")
                      .Number("t_ns", event.t_ns)
                      .Text("tenant", name)
                      .Number("process", run.index)
                      .Text("status", status)
                      .Number("code", static_cast<std::uint64_t>(code))
                      .Done());
      break;
    }
  }
}

// The samples at sample instant k: each tenant's busy time and memory per device, then each device as NVML sees
// it (busy time of any tenant over the last sample period; memory with the driver's reserve).
void WriteSamples(const scenario::Scenario& s, std::uint64_t k, const std::vector<fakecuda::model::DeviceSpec>& specs,
                  const std::vector<std::vector<TenantDevice>>& rows, const std::vector<sim::Result>& results,
                  std::vector<std::uint64_t>& device_busy_before, TraceSink& trace) {
  const std::uint64_t t_ns = k * s.sample_ns;
  const std::size_t device_count = specs.size();
  std::vector<std::uint64_t> device_busy(device_count, 0);
  std::vector<std::uint64_t> device_memory(device_count, 0);
  for (std::uint32_t t = 0; t < s.tenants.size(); ++t) {
    for (const std::uint32_t d : s.tenants[t].devices) {
      const int row = rows[d][t].sim_index;
      const std::uint64_t busy =
          k == 0 || row < 0 ? 0 : results[d].tenants[static_cast<std::size_t>(row)].busy_samples_ns[k - 1];
      device_busy[d] += busy;
      device_memory[d] += rows[d][t].memory_bytes;
      trace.Write(Line("sample")
                      .Number("t_ns", t_ns)
                      .Text("tenant", s.tenants[t].name)
                      .Number("device", d)
                      .Number("busy_ns", busy)
                      .Number("memory_bytes", rows[d][t].memory_bytes)
                      .Done());
    }
  }
  for (std::uint32_t d = 0; d < device_count; ++d) {
    const std::uint64_t period_busy = k == 0 ? 0 : device_busy[d] - std::min(device_busy[d], device_busy_before[d]);
    const std::uint64_t util = std::min<std::uint64_t>(100, (period_busy * 100 + s.sample_ns / 2) / s.sample_ns);
    device_busy_before[d] = device_busy[d];
    trace.Write(Line("gpu")
                    .Number("t_ns", t_ns)
                    .Number("device", d)
                    .Number("util_percent", util)
                    .Number("memory_used_bytes", specs[d].reserved_bytes + device_memory[d])
                    .Done());
  }
}

}  // namespace

Outcome RunVirtual(const scenario::Scenario& s, const Options& options, TraceSink& trace) {
  Outcome outcome;
  std::vector<std::string> items;
  std::vector<fakecuda::model::DeviceSpec> specs;
  if (!scenario::DeviceItems(s.gpu, items, outcome.error) || !DeviceSpecs(s, items, specs, outcome.error))
    return outcome;
  const auto device_count = static_cast<std::uint32_t>(items.size());
  const std::vector<ProcessRun> runs = Expand(s);
  std::vector<std::vector<sim::Segment>> segments;
  if (!Schedules(s, runs, segments, outcome.error)) return outcome;
  std::uint64_t leaked_bytes = 0;
  const std::vector<Ledger> ledger = RunLedger(s, runs, leaked_bytes);

  // One simulation per device, with the tenants that run something there.
  std::vector<std::vector<TenantDevice>> rows(device_count, std::vector<TenantDevice>(s.tenants.size()));
  std::vector<sim::Result> results(device_count);
  for (std::uint32_t d = 0; d < device_count; ++d) {
    if (options.cancel != nullptr && options.cancel->load()) {
      outcome.error = "cancelled before device " + std::to_string(d) + " was simulated";
      return outcome;
    }
    sim::Scenario simulation = DeviceScenario(s, items[d]);
    AddTenants(s, d, runs, segments, ledger, simulation, rows[d]);
    if (!SimulateDevice(s, d, device_count, simulation, options, results[d], outcome.error)) return outcome;
  }

  // The trace, in time order: at each sample instant first the events up to it, then the samples.
  WriteHeader(s, Mode::virtual_time, device_count, trace);
  const std::vector<Event> events = ProcessEvents(runs, ledger);
  std::size_t next_event = 0;
  std::vector<std::uint64_t> device_busy_before(device_count, 0);
  std::uint64_t next_progress_ns = scenario::kSecondNs;
  const std::uint64_t samples = s.duration_ns / s.sample_ns;
  for (std::uint64_t k = 0; k <= samples; ++k) {
    const std::uint64_t t_ns = k * s.sample_ns;
    for (; next_event < events.size() && events[next_event].t_ns <= t_ns; ++next_event) {
      WriteEvent(s, events[next_event], runs, ledger, rows, trace);
    }
    WriteSamples(s, k, specs, rows, results, device_busy_before, trace);
    if (options.progress && t_ns >= next_progress_ns) {
      options.progress(0.9 + 0.1 * static_cast<double>(t_ns) / static_cast<double>(s.duration_ns),
                       "writing the trace at " + std::to_string(t_ns / scenario::kMillisecondNs) + " ms");
      next_progress_ns += scenario::kSecondNs;
    }
  }
  // Wall time is the one thing a virtual run cannot repeat: 0 keeps its trace the same, byte for byte.
  trace.Write(
      Line("end").Number("t_ns", s.duration_ns).Number("leaked_bytes", leaked_bytes).Number("seconds_wall", 0).Done());
  outcome.ok = true;
  return outcome;
}

}  // namespace vgpu::runner::internal
