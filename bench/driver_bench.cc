// Benchmark of a kernel launch through the fake libcuda.so.1 (whichever one LD_LIBRARY_PATH finds): the
// embedded vgpu_spin PTX kernel, 1 block, 1 us, on one stream. Run with LD_LIBRARY_PATH=<build>/lib.
#include <benchmark/benchmark.h>
#include <cuda.h>

#include <cstdint>
#include <string>

#include "bench_support.h"
#include "vgpu_tenant/spin_ptx.h"

namespace fakecuda::bench {
namespace {

// The stream ring holds 128 operations: synchronizing every 64 launches keeps well clear of a full queue,
// whose wait would otherwise be measured as launch time.
constexpr std::int64_t kLaunchesPerSynchronize = 64;

std::string Describe(const char* call, CUresult result) {
  const char* name = nullptr;
  if (cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) name = "an unknown CUresult";
  return std::string(call) + " returned " + name + " (" + std::to_string(static_cast<int>(result)) + ")";
}

#define BENCH_CUDA(state, call)                                \
  do {                                                         \
    const CUresult result_ = (call);                           \
    if (result_ != CUDA_SUCCESS) {                             \
      (state).SkipWithError(Describe(#call, result_).c_str()); \
      return;                                                  \
    }                                                          \
  } while (0)

// cuInit, device 0, its primary context made current: what every benchmark here starts from.
CUresult SetUpPrimaryContext(CUdevice& device) {
  CUcontext context = nullptr;
  CUresult result = cuInit(0);
  if (result == CUDA_SUCCESS) result = cuDeviceGet(&device, 0);
  if (result == CUDA_SUCCESS) result = cuDevicePrimaryCtxRetain(&context, device);
  if (result == CUDA_SUCCESS) result = cuCtxSetCurrent(context);
  return result;
}

void DriverLaunchKernel(benchmark::State& state) {
  UseFreshState("driver");
  CUdevice device = 0;
  BENCH_CUDA(state, SetUpPrimaryContext(device));
  CUmodule module = nullptr;
  BENCH_CUDA(state, cuModuleLoadData(&module, vgpu::tenant::kSpinPtx));
  CUfunction function = nullptr;
  BENCH_CUDA(state, cuModuleGetFunction(&function, module, "vgpu_spin"));
  CUstream stream = nullptr;
  BENCH_CUDA(state, cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

  unsigned long long ns_per_block = 1000;  // one 1 us wave
  void* params[] = {&ns_per_block};
  std::int64_t launches = 0;
  for (auto _ : state) {
    const CUresult result = cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, params, nullptr);
    if (result != CUDA_SUCCESS) {
      state.SkipWithError(Describe("cuLaunchKernel", result).c_str());
      break;
    }
    if (++launches % kLaunchesPerSynchronize == 0) {
      state.PauseTiming();
      const CUresult synchronized = cuStreamSynchronize(stream);
      state.ResumeTiming();
      if (synchronized != CUDA_SUCCESS) {
        state.SkipWithError(Describe("cuStreamSynchronize", synchronized).c_str());
        break;
      }
    }
  }
  state.SetItemsProcessed(launches);
  cuStreamSynchronize(stream);
  cuStreamDestroy(stream);
  cuModuleUnload(module);
  cuDevicePrimaryCtxRelease(device);
}
BENCHMARK(DriverLaunchKernel)->Unit(benchmark::kNanosecond);

// An allocation and its free: the path the shim's memory ledger sits on (bench/shim_overhead.py compares it
// with and without libvgpu.so).
void DriverMemAllocFree(benchmark::State& state) {
  UseFreshState("alloc");
  CUdevice device = 0;
  BENCH_CUDA(state, SetUpPrimaryContext(device));
  for (auto _ : state) {
    CUdeviceptr pointer = 0;
    const CUresult allocated = cuMemAlloc(&pointer, 1 << 20);
    const CUresult freed = allocated == CUDA_SUCCESS ? cuMemFree(pointer) : allocated;
    if (freed != CUDA_SUCCESS) {
      state.SkipWithError(Describe("cuMemAlloc/cuMemFree", freed).c_str());
      break;
    }
  }
  cuDevicePrimaryCtxRelease(device);
}
BENCHMARK(DriverMemAllocFree)->Unit(benchmark::kNanosecond);

// cuMemGetInfo: what frameworks poll, and what the shim rewrites into the slice's view.
void DriverMemGetInfo(benchmark::State& state) {
  UseFreshState("meminfo");
  CUdevice device = 0;
  BENCH_CUDA(state, SetUpPrimaryContext(device));
  for (auto _ : state) {
    size_t free_bytes = 0, total_bytes = 0;
    const CUresult result = cuMemGetInfo(&free_bytes, &total_bytes);
    if (result != CUDA_SUCCESS) {
      state.SkipWithError(Describe("cuMemGetInfo", result).c_str());
      break;
    }
    benchmark::DoNotOptimize(free_bytes);
  }
  cuDevicePrimaryCtxRelease(device);
}
BENCHMARK(DriverMemGetInfo)->Unit(benchmark::kNanosecond);

}  // namespace
}  // namespace fakecuda::bench
