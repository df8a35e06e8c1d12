// vgpu._native: scenario files (sim/scenario), the runner (sim/runner) and a read-only view of a container region
// (vgpu-core/region) for Python. The Python package (python/vgpu) wraps it; python/vgpu/_native.pyi documents it.
//
// Errors are the package's own Python classes (vgpu/_errors.py), imported when raised: ScenarioError carrying
// Problem objects, RegionError for a region that cannot be read.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vgpu/base/clock.h"
#include "vgpu/base/uuid.h"
#include "vgpu/policy/limiter.h"
#include "vgpu/region/region.h"
#include "vgpu/runner/runner.h"
#include "vgpu/scenario/scenario.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

namespace sc = vgpu::scenario;
namespace rn = vgpu::runner;

py::object ErrorsModule() { return py::module_::import("vgpu._errors"); }

py::list ProblemList(const std::vector<sc::Problem>& problems) {
  py::object problem_class = ErrorsModule().attr("Problem");
  py::list out;
  for (const sc::Problem& problem : problems) {
    out.append(problem_class(problem.file, problem.line, problem.key, problem.message));
  }
  return out;
}

[[noreturn]] void RaiseScenarioError(const std::vector<sc::Problem>& problems) {
  py::object error = ErrorsModule().attr("ScenarioError")(ProblemList(problems));
  PyErr_SetObject(py::type::handle_of(error).ptr(), error.ptr());
  throw py::error_already_set();
}

sc::Scenario Unpack(sc::Loaded&& loaded) {
  if (!loaded.problems.empty() || !loaded.scenario) {
    if (loaded.problems.empty()) {
      loaded.problems.push_back({"", 0, "", "the scenario loader returned neither a scenario nor a problem"});
    }
    RaiseScenarioError(loaded.problems);
  }
  return std::move(*loaded.scenario);
}

std::string PathText(const py::handle& value) {
  return py::module_::import("os").attr("fspath")(value).cast<std::string>();
}

std::string OptionalPath(const py::object& value) { return value.is_none() ? std::string() : PathText(value); }

py::object Optional(const std::optional<std::uint64_t>& value) {
  return value ? py::object(py::int_(*value)) : py::object(py::none());
}
py::object Optional(const std::optional<double>& value) {
  return value ? py::object(py::float_(*value)) : py::object(py::none());
}

const char* PhaseKind(sc::Phase::Kind kind) { return kind == sc::Phase::Kind::idle ? "idle" : "kernels"; }

const char* ExpectationKind(sc::Expectation::Kind kind) {
  switch (kind) {
    case sc::Expectation::Kind::share:
      return "share";
    case sc::Expectation::Kind::min_share:
      return "min_share";
    case sc::Expectation::Kind::max_share:
      return "max_share";
    case sc::Expectation::Kind::oom:
      return "oom";
  }
  return "?";
}

py::list Modes(const sc::Scenario& s) {
  py::list modes;
  if (s.virtual_mode) modes.append("virtual");
  if (s.live_mode) modes.append("live");
  return modes;
}

py::dict PhaseDict(const sc::Phase& p) {
  return py::dict("kind"_a = PhaseKind(p.kind), "sizes_ns"_a = p.sizes_ns, "for_ns"_a = p.for_ns, "depth"_a = p.depth,
                  "rate"_a = p.rate, "blocks"_a = p.blocks, "jitter_permille"_a = p.jitter_permille, "line"_a = p.line);
}

py::dict ProcessDict(const sc::ProcessSpec& p) {
  py::list work;
  for (const sc::Phase& phase : p.work) work.append(PhaseDict(phase));
  return py::dict("replicas"_a = p.replicas, "start_ns"_a = p.start_ns, "stop_ns"_a = p.stop_ns,
                  "crash_at_ns"_a = Optional(p.crash_at_ns), "device"_a = p.device, "alloc_bytes"_a = p.alloc_bytes,
                  "work"_a = work, "repeat"_a = p.repeat, "program"_a = p.program, "line"_a = p.line);
}

py::dict ExpectationDict(const sc::Expectation& e) {
  return py::dict("kind"_a = ExpectationKind(e.kind), "percent"_a = e.percent,
                  "tolerance_points"_a = Optional(e.tolerance_points),
                  "worst_window_points"_a = Optional(e.worst_window_points), "from_ns"_a = e.from_ns,
                  "to_ns"_a = e.to_ns, "oom"_a = e.oom, "line"_a = e.line);
}

py::dict TenantDict(const sc::TenantSpec& t) {
  py::list processes, expect;
  for (const sc::ProcessSpec& p : t.processes) processes.append(ProcessDict(p));
  for (const sc::Expectation& e : t.expect) expect.append(ExpectationDict(e));
  return py::dict("name"_a = t.name, "gpu_count"_a = t.gpu_count, "memory_limit_bytes"_a = t.memory_limit_bytes,
                  "cores_percent"_a = t.cores_percent, "priority"_a = t.priority, "policy"_a = sc::PolicyName(t.policy),
                  "devices"_a = t.devices, "processes"_a = processes, "expect"_a = expect, "line"_a = t.line);
}

py::dict ScenarioDict(const sc::Scenario& s) {
  py::list tenants;
  for (const sc::TenantSpec& t : s.tenants) tenants.append(TenantDict(t));
  return py::dict("file"_a = s.file, "name"_a = s.name, "description"_a = s.description, "gpu"_a = s.gpu,
                  "real_gpu"_a = s.real_gpu, "device_count"_a = s.device_count, "context_bytes"_a = s.context_bytes,
                  "timeslice_ns"_a = s.timeslice_ns, "switch_ns"_a = s.switch_ns, "modes"_a = Modes(s),
                  "duration_ns"_a = s.duration_ns, "settle_ns"_a = s.settle_ns, "window_ns"_a = s.window_ns,
                  "sample_ns"_a = s.sample_ns, "seed"_a = s.seed, "tenants"_a = tenants,
                  "expect_leaked_bytes"_a = s.expect_leaked_bytes, "faults"_a = s.faults);
}

using vgpu::base::MonotonicNs;

template <typename Bytes>
py::dict ComputeDict(const Bytes& compute, std::uint64_t now_ns) {
  // The raw bytes of the device's vgpu::policy::BudgetCell, copied into an aligned cell of our own.
  vgpu::policy::BudgetCell cell{};
  const std::size_t have = std::size(compute) * sizeof(*std::data(compute));
  if (have < sizeof cell) {
    return py::dict("share_percent"_a = py::none(), "cap_percent"_a = py::none(), "rate_percent"_a = py::none(),
                    "budget_ns"_a = py::none());
  }
  std::memcpy(&cell, std::data(compute), sizeof cell);
  const double share = vgpu::policy::Limiter::PublishedShare(cell, now_ns);
  py::object cap =
      cell.share_permille == 0 ? py::object(py::none()) : py::object(py::float_(cell.share_permille / 10.0));
  return py::dict("share_percent"_a = share * 100.0, "cap_percent"_a = cap,
                  "rate_percent"_a = cell.rate_permille / 10.0, "budget_ns"_a = cell.budget_ns);
}

py::dict ReadRegion(const py::object& path_object) {
  const std::string path = PathText(path_object);
  vgpu::region::Snapshot snapshot;
  std::string error;
  bool ok = false;
  std::uint64_t now_ns = 0;
  {
    py::gil_scoped_release release;
    ok = vgpu::region::ReadSnapshot(path, snapshot, error);
    now_ns = MonotonicNs();
  }
  if (!ok) {
    py::object exception = ErrorsModule().attr("RegionError")(error.empty() ? path + ": cannot be read" : error);
    PyErr_SetObject(py::type::handle_of(exception).ptr(), exception.ptr());
    throw py::error_already_set();
  }
  py::list devices;
  std::size_t index = 0;
  for (const auto& device : snapshot.devices) {
    py::dict entry("index"_a = index++, "uuid"_a = vgpu::base::GpuUuidText(std::data(device.uuid)),
                   "used_bytes"_a = device.used_bytes, "cached_used_bytes"_a = device.cached_used_bytes,
                   "limit_bytes"_a = device.limit_bytes, "context_bytes"_a = device.context_bytes);
    for (auto item : ComputeDict(device.compute, now_ns)) entry[item.first] = item.second;
    devices.append(entry);
  }
  py::list live;
  for (const auto& process : snapshot.live) {
    py::list used;
    for (std::size_t d = 0; d < index && d < std::size(process.used_bytes); ++d) used.append(process.used_bytes[d]);
    live.append(py::dict("pid"_a = process.pid, "generation"_a = process.generation, "used_bytes"_a = used));
  }
  return py::dict("path"_a = path, "version"_a = snapshot.version, "lock_repairs"_a = snapshot.lock_repairs,
                  "lock_holder_tid"_a = snapshot.lock_holder_tid, "monotonic_ns"_a = now_ns, "devices"_a = devices,
                  "live"_a = live);
}

rn::Outcome RunScenario(const sc::Scenario& scenario, const std::string& mode, const py::object& trace_path,
                        const py::object& install_dir, const py::object& work_dir, const py::object& progress) {
  rn::Options options;
  if (mode == "virtual") {
    options.mode = rn::Mode::virtual_time;
  } else if (mode == "live") {
    options.mode = rn::Mode::live;
  } else {
    throw py::value_error("mode must be \"virtual\" or \"live\", not \"" + mode + "\"");
  }
  if (!progress.is_none() && !PyCallable_Check(progress.ptr())) {
    throw py::type_error("progress must be a callable (fraction_done: float, what: str) or None");
  }
  options.trace_path = OptionalPath(trace_path);
  options.install_dir = OptionalPath(install_dir);
  options.work_dir = OptionalPath(work_dir);

  // The run goes without the GIL. The runner calls `progress` from this thread at least once per second of scenario
  // time: there we take the GIL, run Python's signal handlers (Ctrl-C raises KeyboardInterrupt in them) and the
  // caller's callback. Any exception stops the run through the cancel flag and is raised once Run returns.
  std::atomic<bool> cancel{false};
  std::optional<py::error_already_set> failure;
  options.cancel = &cancel;
  options.progress = [&progress, &cancel, &failure](double fraction, const std::string& what) {
    if (cancel.load(std::memory_order_relaxed)) return;
    py::gil_scoped_acquire gil;
    try {
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (!progress.is_none()) progress(fraction, what);
    } catch (py::error_already_set& error) {
      failure.emplace(std::move(error));
      cancel.store(true, std::memory_order_relaxed);
    }
  };

  // The environment is copied now, with the GIL held: another Python thread may call setenv (os.environ[...] = ...)
  // while the run goes, which can free the environ array under a reader.
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) options.environment.emplace_back(*entry);

  const sc::Scenario copy = scenario;
  rn::Outcome outcome;
  {
    py::gil_scoped_release release;
    outcome = rn::Run(copy, options);
  }
  if (failure) throw std::move(*failure);
  // A signal that arrived after the last progress call.
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  return outcome;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "vgpu's native parts: scenario files, the runner, container regions (see _native.pyi)";

  py::class_<sc::Phase>(m, "Phase", "One step of a process's work (read-only).")
      .def_property_readonly("kind", [](const sc::Phase& p) { return PhaseKind(p.kind); })
      .def_readonly("sizes_ns", &sc::Phase::sizes_ns)
      .def_readonly("for_ns", &sc::Phase::for_ns)
      .def_readonly("depth", &sc::Phase::depth)
      .def_readonly("rate", &sc::Phase::rate)
      .def_readonly("blocks", &sc::Phase::blocks)
      .def_readonly("jitter_permille", &sc::Phase::jitter_permille)
      .def_readonly("line", &sc::Phase::line)
      .def("to_dict", &PhaseDict)
      .def("__repr__", [](const sc::Phase& p) { return py::repr(PhaseDict(p)).cast<std::string>(); });

  py::class_<sc::ProcessSpec>(m, "Process", "One process entry of a tenant (read-only).")
      .def_readonly("replicas", &sc::ProcessSpec::replicas)
      .def_readonly("start_ns", &sc::ProcessSpec::start_ns)
      .def_readonly("stop_ns", &sc::ProcessSpec::stop_ns)
      .def_property_readonly("crash_at_ns", [](const sc::ProcessSpec& p) { return Optional(p.crash_at_ns); })
      .def_readonly("device", &sc::ProcessSpec::device)
      .def_readonly("alloc_bytes", &sc::ProcessSpec::alloc_bytes)
      .def_readonly("work", &sc::ProcessSpec::work)
      .def_readonly("repeat", &sc::ProcessSpec::repeat)
      .def_readonly("program", &sc::ProcessSpec::program)
      .def_readonly("line", &sc::ProcessSpec::line)
      .def("to_dict", &ProcessDict);

  py::class_<sc::Expectation>(m, "Expectation", "A promise about one tenant (read-only).")
      .def_property_readonly("kind", [](const sc::Expectation& e) { return ExpectationKind(e.kind); })
      .def_readonly("percent", &sc::Expectation::percent)
      .def_property_readonly("tolerance_points", [](const sc::Expectation& e) { return Optional(e.tolerance_points); })
      .def_property_readonly("worst_window_points",
                             [](const sc::Expectation& e) { return Optional(e.worst_window_points); })
      .def_readonly("from_ns", &sc::Expectation::from_ns)
      .def_readonly("to_ns", &sc::Expectation::to_ns)
      .def_readonly("oom", &sc::Expectation::oom)
      .def_readonly("line", &sc::Expectation::line)
      .def("to_dict", &ExpectationDict)
      .def("__repr__", [](const sc::Expectation& e) { return py::repr(ExpectationDict(e)).cast<std::string>(); });

  py::class_<sc::TenantSpec>(m, "Tenant", "One container (read-only).")
      .def_readonly("name", &sc::TenantSpec::name)
      .def_readonly("gpu_count", &sc::TenantSpec::gpu_count)
      .def_readonly("memory_limit_bytes", &sc::TenantSpec::memory_limit_bytes)
      .def_readonly("cores_percent", &sc::TenantSpec::cores_percent)
      .def_readonly("priority", &sc::TenantSpec::priority)
      .def_property_readonly("policy", [](const sc::TenantSpec& t) { return sc::PolicyName(t.policy); })
      .def_readonly("devices", &sc::TenantSpec::devices)
      .def_readonly("processes", &sc::TenantSpec::processes)
      .def_readonly("expect", &sc::TenantSpec::expect)
      .def_readonly("line", &sc::TenantSpec::line)
      .def("to_dict", &TenantDict)
      .def("__repr__", [](const sc::TenantSpec& t) { return "<vgpu Tenant " + t.name + ">"; });

  py::class_<sc::Scenario>(m, "Scenario", "A validated scenario file (read-only); to_dict() gives a plain tree.")
      .def_readonly("file", &sc::Scenario::file)
      .def_readonly("name", &sc::Scenario::name)
      .def_readonly("description", &sc::Scenario::description)
      .def_readonly("gpu", &sc::Scenario::gpu)
      .def_readonly("real_gpu", &sc::Scenario::real_gpu)
      .def_readonly("device_count", &sc::Scenario::device_count)
      .def_readonly("context_bytes", &sc::Scenario::context_bytes)
      .def_readonly("timeslice_ns", &sc::Scenario::timeslice_ns)
      .def_readonly("switch_ns", &sc::Scenario::switch_ns)
      .def_property_readonly("modes", &Modes)
      .def_readonly("duration_ns", &sc::Scenario::duration_ns)
      .def_readonly("settle_ns", &sc::Scenario::settle_ns)
      .def_readonly("window_ns", &sc::Scenario::window_ns)
      .def_readonly("sample_ns", &sc::Scenario::sample_ns)
      .def_readonly("seed", &sc::Scenario::seed)
      .def_readonly("tenants", &sc::Scenario::tenants)
      .def_readonly("expect_leaked_bytes", &sc::Scenario::expect_leaked_bytes)
      .def_readonly("faults", &sc::Scenario::faults)
      .def("to_dict", &ScenarioDict)
      .def("__repr__", [](const sc::Scenario& s) {
        return "<vgpu Scenario " + s.name + " (" + s.file + "): " + std::to_string(s.tenants.size()) + " tenants, " +
               std::to_string(s.duration_ns / 1'000'000) + " ms>";
      });

  py::class_<rn::Outcome>(m, "Outcome", "What a run gave: ok, or the error; the trace when no trace_path was given.")
      .def_readonly("ok", &rn::Outcome::ok)
      .def_readonly("error", &rn::Outcome::error)
      .def_readonly("trace", &rn::Outcome::trace)
      .def_readonly("wall_seconds", &rn::Outcome::wall_seconds)
      .def("__repr__", [](const rn::Outcome& o) {
        return std::string("<vgpu Outcome ok=") + (o.ok ? "True" : "False") +
               (o.error.empty() ? "" : " error=" + o.error) + ">";
      });

  m.def(
      "load_scenario",
      [](const py::object& path) {
        const std::string text = PathText(path);
        sc::Loaded loaded;
        {
          py::gil_scoped_release release;
          loaded = sc::LoadFile(text);
        }
        return Unpack(std::move(loaded));
      },
      "path"_a, "Reads and validates a scenario file; raises vgpu.ScenarioError with every problem found.");
  m.def(
      "load_scenario_text",
      [](const std::string& text, const std::string& file) { return Unpack(sc::LoadText(text, file)); }, "text"_a,
      "file"_a = "<text>", "The same from text; `file` names it in problems.");
  m.def("run", &RunScenario, "scenario"_a, "mode"_a = "virtual", "trace_path"_a = py::none(),
        "install_dir"_a = py::none(), "work_dir"_a = py::none(), "progress"_a = py::none(),
        "Runs a scenario (the GIL is released while it runs). Ctrl-C stops it and raises KeyboardInterrupt.");
  m.def("read_region", &ReadRegion, "path"_a,
        "A container region's state: per device used/limit/context bytes and the measured compute share; live "
        "processes. Raises vgpu.RegionError if the file is not a readable region.");
}
