// Benchmark of nvmlDeviceGetUtilizationRates through the fake libnvidia-ml.so.1 (whichever one
// LD_LIBRARY_PATH finds). Run with LD_LIBRARY_PATH=<build>/lib.
#include <benchmark/benchmark.h>
#include <nvml.h>

#include <string>

#include "bench_support.h"

namespace fakecuda::bench {
namespace {

std::string Describe(const char* call, nvmlReturn_t result) {
  return std::string(call) + " returned " + nvmlErrorString(result) + " (" + std::to_string(static_cast<int>(result)) +
         ")";
}

void NvmlGetUtilizationRates(benchmark::State& state) {
  UseFreshState("nvml");
  nvmlReturn_t result = nvmlInit_v2();
  if (result != NVML_SUCCESS) {
    state.SkipWithError(Describe("nvmlInit_v2", result).c_str());
    return;
  }
  nvmlDevice_t device = nullptr;
  result = nvmlDeviceGetHandleByIndex_v2(0, &device);
  if (result != NVML_SUCCESS) {
    state.SkipWithError(Describe("nvmlDeviceGetHandleByIndex_v2", result).c_str());
    nvmlShutdown();
    return;
  }
  nvmlUtilization_t utilization{};
  for (auto _ : state) {
    result = nvmlDeviceGetUtilizationRates(device, &utilization);
    if (result != NVML_SUCCESS) {
      state.SkipWithError(Describe("nvmlDeviceGetUtilizationRates", result).c_str());
      break;
    }
    benchmark::DoNotOptimize(utilization);
  }
  state.SetItemsProcessed(state.iterations());
  nvmlShutdown();
}
BENCHMARK(NvmlGetUtilizationRates)->Unit(benchmark::kNanosecond);

}  // namespace
}  // namespace fakecuda::bench
