// gated_pair_probe: can a CUDA event pair around a launch on an idle stream time the kernel alone? (issue 6, the
// launch-bound case; docs/compute-limit.md, "Launches on an idle stream".)
//
// On an idle stream the start event is written as soon as the GPU sees it, while the kernel cannot start before the
// host's launch call has submitted it: an ungated pair also counts that call (~3 us on an H100). A gated pair puts a
// stream wait on a flag in host memory before the start event (cuStreamWaitValue32, GEQ), and the host writes the flag
// after the launch call returns: the start is then written once the kernel has been submitted. This probe measures,
// per kernel, what each pair says minus what the kernel ran (its own %globaltimer span), and the host time each way
// costs, with a synchronize after every kernel (an idle stream each time). Nothing here is used by the shim.
//
//   gated_pair_probe [--launches N] [--spin-ns NS ...]
//
// Output: a JSON line per (mode, spin): medians and p10/p90 of pair minus span (ns) and of the host time of the record,
// [wait,] launch, [flag,] record calls (ns). Build: nvcc -O2 -arch=sm_90 -o gated_pair_probe gated_pair_probe.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "spread.h"

namespace {

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins `spin_ns` of %globaltimer time; writes its first and last readings.
__global__ void Spin(unsigned long long* span, unsigned long long spin_ns) {
  const unsigned long long t0 = GlobalTimer();
  unsigned long long t = t0;
  while (t - t0 < spin_ns) t = GlobalTimer();
  if (threadIdx.x == 0) {
    span[0] = t0;
    span[1] = t;
  }
}

double NowNs() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

#define CHECK(call)                                                                                \
  do {                                                                                             \
    const auto status_ = (call);                                                                   \
    if (static_cast<int>(status_) != 0) {                                                          \
      std::fprintf(stderr, "gated_pair_probe: %s failed: %d\n", #call, static_cast<int>(status_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  int launches = 2000;
  std::vector<unsigned long long> spins;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--launches") == 0 && i + 1 < argc) {
      launches = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--spin-ns") == 0 && i + 1 < argc) {
      spins.push_back(std::strtoull(argv[++i], nullptr, 10));
    } else {
      std::fprintf(stderr, "usage: gated_pair_probe [--launches N] [--spin-ns NS ...]\n");
      return 2;
    }
  }
  if (spins.empty()) spins = {0, 2000, 5000, 20000};
  if (launches < 10) launches = 10;

  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(nullptr));  // the primary context, current
  CUdevice device = 0;
  CHECK(cuCtxGetDevice(&device));
  int mem_ops = 0;
  CHECK(cuDeviceGetAttribute(&mem_ops, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, device));
  std::printf("{\"stream_mem_ops_v1\":%d}\n", mem_ops);

  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  unsigned long long* span = nullptr;
  CHECK(cudaMalloc(&span, 4 * sizeof(unsigned long long)));
  // The flag: pinned host memory the GPU reads.
  unsigned int* flag = nullptr;
  CHECK(cuMemHostAlloc(reinterpret_cast<void**>(&flag), sizeof(unsigned int), CU_MEMHOSTALLOC_DEVICEMAP));
  *flag = 0;
  CUdeviceptr flag_device = 0;
  CHECK(cuMemHostGetDevicePointer(&flag_device, flag, 0));
  cudaEvent_t start = nullptr, end = nullptr;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  unsigned int sequence = 0;

  // Modes: ungated / gated pairs around one kernel; gated around two kernels back to back (is the excess per pair or
  // per kernel?); gated and ungated pairs around no kernel (the events' own latency: what a shim could take out).
  const char* const modes[] = {"ungated", "gated", "gated_two", "gated_empty", "ungated_empty"};
  for (const unsigned long long spin_ns : spins) {
    for (const char* mode : modes) {
      const bool gated = std::strncmp(mode, "gated", 5) == 0;
      const int kernels = std::strcmp(mode, "gated_two") == 0 ? 2 : std::strstr(mode, "empty") != nullptr ? 0 : 1;
      if (kernels == 0 && spin_ns != spins.front()) continue;  // no kernel: once is enough
      std::vector<double> excess, host;
      for (int i = 0; i < launches + 10; ++i) {  // (the first 10: warm-up, not kept)
        const double t0 = NowNs();
        if (gated)
          CHECK(cuStreamWaitValue32(reinterpret_cast<CUstream>(stream), flag_device, ++sequence,
                                    CU_STREAM_WAIT_VALUE_GEQ));
        CHECK(cudaEventRecord(start, stream));
        for (int k = 0; k < kernels; ++k) Spin<<<1, 32, 0, stream>>>(span + 2 * k, spin_ns);
        if (gated) __atomic_store_n(flag, sequence, __ATOMIC_RELEASE);
        CHECK(cudaEventRecord(end, stream));
        const double t1 = NowNs();
        CHECK(cudaStreamSynchronize(stream));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, end));
        unsigned long long ran[4] = {};
        CHECK(cudaMemcpy(ran, span, sizeof ran, cudaMemcpyDeviceToHost));
        if (i < 10) continue;
        double spans = 0;
        for (int k = 0; k < kernels; ++k) spans += static_cast<double>(ran[2 * k + 1] - ran[2 * k]);
        excess.push_back(static_cast<double>(ms) * 1e6 - spans);
        host.push_back(t1 - t0);
      }
      const Spread e = Of(excess), h = Of(host);
      std::printf(
          "{\"mode\":\"%s\",\"spin_ns\":%llu,\"launches\":%d,\"pair_minus_span_ns\":[%.0f,%.0f,%.0f],"
          "\"host_ns\":[%.0f,%.0f,%.0f]}\n",
          mode, kernels == 0 ? 0ull : spin_ns, launches, e.p10, e.median, e.p90, h.p10, h.median, h.p90);
      std::fflush(stdout);
    }
  }
  return 0;
}
