// Launches `burn` (one block: one wave; its run time is FAKECUDA_KERNEL_COSTS' on fakecuda) back to back, at most
// argv[2] in flight, for argv[1] seconds; prints how many ran.
#include <chrono>
#include <cstdlib>

#include "check.h"

extern "C" __global__ void burn(float* x) { x[threadIdx.x] += 1.0f; }

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 2.0;
  const int depth = argc > 2 ? std::atoi(argv[2]) : 4;
  float* x = nullptr;
  CHECK(cudaMalloc(&x, 1024 * sizeof(float)));
  cudaEvent_t marks[64];
  for (cudaEvent_t& mark : marks) CHECK(cudaEventCreateWithFlags(&mark, cudaEventDisableTiming));
  const auto start = std::chrono::steady_clock::now();
  long kernels = 0;
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
    cudaEvent_t& mark = marks[kernels % depth];
    if (kernels >= depth) CHECK(cudaEventSynchronize(mark));
    burn<<<1, 32>>>(x);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(mark));
    ++kernels;
  }
  CHECK(cudaDeviceSynchronize());
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("{\"kernels\": %ld, \"seconds\": %.3f}\n", kernels, elapsed);
  return 0;
}
