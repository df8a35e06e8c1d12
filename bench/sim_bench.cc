// sim_bench (Google Benchmark): the virtual-time simulator's speed, in simulated seconds per CPU second, for eight
// tenants each launching one kernel per millisecond (issue 4's target: a simulated hour in under 5 s of CPU).
// Run: <build>/bin/sim_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include "vgpu/sim/sim.h"

namespace vgpu::sim {
namespace {

// Eight tenants capped at 12 % each, each one process launching a 100 us kernel every millisecond (10 % of the
// device), with a seeded phase: the device is 80 % busy and time-sliced between whoever has work. Kernels are measured
// as the shim measures them (the simulator's default), or, `every_kernel`, each one by its start and end.
Scenario EightTenants(bool record_trace, std::uint64_t seconds, bool every_kernel) {
  Scenario scenario;
  scenario.measurement = every_kernel ? Measurement::events : Measurement::shim;
  scenario.duration_ns = seconds * kSecondNs;
  scenario.settle_ns = 0;
  scenario.seed = 8;
  scenario.record_trace = record_trace;
  for (int i = 0; i < 8; ++i) {
    Tenant tenant;
    tenant.name = 't';
    tenant.name += std::to_string(i);
    tenant.share_percent = 12;
    Process process;
    process.workload = Rate(1000, 100 * kMicrosecondNs);
    tenant.processes.push_back(process);
    scenario.tenants.push_back(tenant);
  }
  return scenario;
}

void SimEightTenantsOneKernelPerMs(benchmark::State& state) {
  const auto seconds = static_cast<std::uint64_t>(state.range(1));
  const Scenario scenario = EightTenants(state.range(0) != 0, seconds, state.range(2) != 0);
  std::uint64_t kernels = 0;
  for (auto _ : state) {
    const Result result = Run(scenario);
    if (!result.error.empty()) {
      state.SkipWithError(result.error.c_str());
      return;
    }
    kernels += result.kernels;
    benchmark::DoNotOptimize(result.trace_digest);
  }
  const auto simulated_seconds = static_cast<double>(state.iterations() * seconds);
  // Rates are per second of the benchmark's (CPU) time.
  state.counters["sim_s_per_cpu_s"] = benchmark::Counter(simulated_seconds, benchmark::Counter::kIsRate);
  state.counters["cpu_s_per_sim_hour"] =
      benchmark::Counter(simulated_seconds / 3600.0, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["kernels_per_cpu_s"] = benchmark::Counter(static_cast<double>(kernels), benchmark::Counter::kIsRate);
}
// A simulated minute (the figure to extrapolate from), with and without the trace; a second, which is mostly the
// fixed cost of a run (zeroing the 27 MB machine); and a whole simulated hour, once, to check the extrapolation.
// every_kernel:1, the minute with every kernel measured alone (what the simulator did before it ran the shim's
// measurement decisions).
BENCHMARK(SimEightTenantsOneKernelPerMs)
    ->ArgNames({"trace", "seconds", "every_kernel"})
    ->Args({0, 60, 0})
    ->Args({1, 60, 0})
    ->Args({0, 1, 0})
    ->Args({0, 60, 1})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(SimEightTenantsOneKernelPerMs)
    ->ArgNames({"trace", "seconds", "every_kernel"})
    ->Args({0, 3600, 0})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace vgpu::sim

BENCHMARK_MAIN();
