// What each driver call on the shim's launch path costs the host, on this GPU (issue 6, overhead). Every figure is
// the median over 21 batches of the mean time of one call in a batch of 2000, after a warm-up batch. Printed as
// one JSON line per call, name and nanoseconds. Build: nvcc -O2 -arch=sm_90 -o call_costs call_costs.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

__global__ void empty_kernel() {}

namespace {

double NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

// The median over batches of the mean cost of one call; `after_batch` runs untimed between batches (a drain).
double Cost(
    const std::function<void()>& call, const std::function<void()>& after_batch = [] {}) {
  constexpr int kBatch = 2000, kBatches = 21;
  std::vector<double> means;
  for (int b = -1; b < kBatches; ++b) {
    const double t0 = NowNs();
    for (int i = 0; i < kBatch; ++i) call();
    const double t1 = NowNs();
    after_batch();
    if (b >= 0) means.push_back((t1 - t0) / kBatch);
  }
  std::nth_element(means.begin(), means.begin() + kBatches / 2, means.end());
  return means[kBatches / 2];
}

void Report(const char* name, double ns) { std::printf("{\"call\":\"%s\",\"ns\":%.1f}\n", name, ns); }

bool Check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  std::fprintf(stderr, "call_costs: %s failed: %d\n", what, static_cast<int>(r));
  return false;
}

}  // namespace

int main() {
  if (cudaFree(nullptr) != cudaSuccess) {
    std::fprintf(stderr, "call_costs: no CUDA device\n");
    return 1;
  }
  CUcontext context = nullptr;
  if (!Check(cuCtxGetCurrent(&context), "cuCtxGetCurrent")) return 1;
  CUstream stream = nullptr;
  if (!Check(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate")) return 1;
  CUevent done = nullptr, a = nullptr, b = nullptr;
  cuEventCreate(&done, CU_EVENT_DEFAULT);
  cuEventCreate(&a, CU_EVENT_DEFAULT);
  cuEventCreate(&b, CU_EVENT_DEFAULT);
  const auto drain = [&] { cuStreamSynchronize(stream); };

  Report("clock_gettime", Cost([] { NowNs(); }));
  Report("cuCtxGetCurrent", Cost([] {
           CUcontext c;
           cuCtxGetCurrent(&c);
         }));
  Report("cuCtxGetDevice", Cost([] {
           CUdevice d;
           cuCtxGetDevice(&d);
         }));
  Report("cuStreamIsCapturing", Cost([&] {
           CUstreamCaptureStatus s;
           cuStreamIsCapturing(stream, &s);
         }));
  cuEventRecord(done, stream);
  drain();
  Report("cuEventQuery(complete)", Cost([&] { cuEventQuery(done); }));
  Report("cuEventElapsedTime", Cost([&] {
           float ms;
           cuEventElapsedTime(&ms, done, done);
         }));
  Report("cuEventRecord(idle stream)", Cost([&] { cuEventRecord(a, stream); }, drain));
  // Queued launches of an empty kernel, with and without an event recorded after each one and after every 32nd.
  int n = 0;
  Report("launch(queued)", Cost([&] { empty_kernel<<<1, 1, 0, stream>>>(); }, drain));
  Report("launch+cuEventRecord(queued)", Cost(
                                             [&] {
                                               empty_kernel<<<1, 1, 0, stream>>>();
                                               cuEventRecord(a, stream);
                                             },
                                             drain));
  Report("launch+cuEventRecord/32(queued)", Cost(
                                                [&] {
                                                  empty_kernel<<<1, 1, 0, stream>>>();
                                                  if (++n % 32 == 0) cuEventRecord(a, stream);
                                                },
                                                drain));
  Report("launch+sync", Cost([&] {
           empty_kernel<<<1, 1, 0, stream>>>();
           cuStreamSynchronize(stream);
         }));
  Report("record+launch+record+sync", Cost([&] {
           cuEventRecord(a, stream);
           empty_kernel<<<1, 1, 0, stream>>>();
           cuEventRecord(b, stream);
           cuStreamSynchronize(stream);
         }));
  // The host's time inside one launch call while the queue stays short (16 launches, then drained, untimed): what the
  // launch path costs the caller, whether or not the GPU keeps up. Each call is timed on its own (two clock reads,
  // the same with and without the shim).
  {
    std::vector<double> means;
    for (int b = -1; b < 21; ++b) {
      double total = 0;
      int calls = 0;
      for (int r = 0; r < 125; ++r) {
        for (int i = 0; i < 16; ++i) {
          const double t0 = NowNs();
          empty_kernel<<<1, 1, 0, stream>>>();
          total += NowNs() - t0;
          ++calls;
        }
        drain();
      }
      if (b >= 0) means.push_back(total / calls);
    }
    std::nth_element(means.begin(), means.begin() + 10, means.end());
    Report("launch call(16 deep, host)", means[10]);
  }
  // GPU side: an event pair around one empty kernel on an idle stream, and around 32 queued back to back.
  std::vector<float> alone, queued;
  for (int i = 0; i < 200; ++i) {
    float ms = 0;
    cuEventRecord(a, stream);
    empty_kernel<<<1, 1, 0, stream>>>();
    cuEventRecord(b, stream);
    cuEventSynchronize(b);
    cuEventElapsedTime(&ms, a, b);
    alone.push_back(ms * 1e6f);
    cuEventRecord(a, stream);
    for (int k = 0; k < 32; ++k) empty_kernel<<<1, 1, 0, stream>>>();
    cuEventRecord(b, stream);
    cuEventSynchronize(b);
    cuEventElapsedTime(&ms, a, b);
    queued.push_back(ms * 1e6f / 32);
  }
  std::nth_element(alone.begin(), alone.begin() + 100, alone.end());
  std::nth_element(queued.begin(), queued.begin() + 100, queued.end());
  Report("gpu:pair-around-one-empty-kernel", alone[100]);
  Report("gpu:per-kernel-in-32-queued", queued[100]);
  return 0;
}
