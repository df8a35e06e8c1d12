// Benchmarks of the fault check that opens every exported call: with no rules (the production case: one
// relaxed atomic load) and with rules that are scanned, counted and drawn.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fakecuda/state/faults.h"

namespace fakecuda::bench {
namespace {

int BenchErrorCode(std::string_view name) { return name == "CUDA_ERROR_UNKNOWN" ? 999 : -1; }

constexpr faults::Library kBenchLibrary{"fakecuda_bench", "cu", "CUDA_ERROR_", BenchErrorCode, nullptr};

// The process-wide injector, as libcuda's entry points call it, with FAKECUDA_FAULTS unset.
void FaultsCheckNoRules(benchmark::State& state) {
  if (const char* faults = std::getenv("FAKECUDA_FAULTS"); faults != nullptr && *faults != '\0') {
    state.SkipWithError("FAKECUDA_FAULTS is set; unset it to measure the no-rule path");
    return;
  }
  std::string error;
  if (!faults::Configured(kBenchLibrary, error)) {
    state.SkipWithError(error.c_str());
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(faults::Check("cuLaunchKernel", kBenchLibrary));
}
BENCHMARK(FaultsCheckNoRules);

// An injector holding `text`'s rules, checked with `symbol`.
void InjectorCheck(benchmark::State& state, const char* text, const char* symbol) {
  std::vector<faults::Rule> rules;
  std::string error;
  if (!faults::ParseRules(text, rules, error)) {
    state.SkipWithError(error.c_str());
    return;
  }
  static faults::Injector injector;  // shared by the threads of a multi-threaded run
  if (state.thread_index() == 0 && !injector.Configure(rules, 1, kBenchLibrary, error)) {
    state.SkipWithError(error.c_str());
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(injector.Check(symbol));
}

// Four rules for other calls: four string comparisons, nothing counted.
BENCHMARK_CAPTURE(InjectorCheck, four_rules_none_match,
                  "cuMemAlloc_v2:error=CUDA_ERROR_UNKNOWN;cuMemFree_v2:error=CUDA_ERROR_UNKNOWN;"
                  "cuStreamSynchronize:error=CUDA_ERROR_UNKNOWN;cuCtxSynchronize:error=CUDA_ERROR_UNKNOWN",
                  "cuLaunchKernel");
// One matching rule that never hits: an atomic increment and one SplitMix64 draw per call.
BENCHMARK_CAPTURE(InjectorCheck, one_rule_matches_prob_0, "cuLaunchKernel:error=CUDA_ERROR_UNKNOWN:prob=0",
                  "cuLaunchKernel")
    ->Threads(1)
    ->Threads(2);

}  // namespace
}  // namespace fakecuda::bench
