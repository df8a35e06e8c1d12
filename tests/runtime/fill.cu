// Allocates chunks of argv[2] MiB (argv[1]: device, managed or pooled) until the runtime refuses one; prints how
// much it got and the error that stopped it.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.h"

int main(int argc, char** argv) {
  const char* kind = argc > 1 ? argv[1] : "device";
  const size_t chunk = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 256) << 20;
  CHECK(cudaSetDevice(0));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  std::vector<void*> held;
  cudaError_t stopped = cudaSuccess;
  for (int i = 0; i < 4096 && stopped == cudaSuccess; ++i) {
    void* p = nullptr;
    if (std::strcmp(kind, "managed") == 0) {
      stopped = cudaMallocManaged(&p, chunk);
    } else if (std::strcmp(kind, "pooled") == 0) {
      stopped = cudaMallocAsync(&p, chunk, stream);
      if (stopped == cudaSuccess) stopped = cudaStreamSynchronize(stream);
    } else {
      stopped = cudaMalloc(&p, chunk);
    }
    if (stopped == cudaSuccess) held.push_back(p);
  }
  (void)cudaGetLastError();  // the refusal is the expected end, not a sticky error
  size_t free_bytes = 0, total_bytes = 0;
  CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::printf("{\"kind\": \"%s\", \"allocated_mib\": %zu, \"stopped_by\": \"%s\", \"total_mib\": %zu}\n", kind,
              held.size() * (chunk >> 20), cudaGetErrorName(stopped), total_bytes >> 20);
  for (void* p : held) CHECK(std::strcmp(kind, "pooled") == 0 ? cudaFreeAsync(p, stream) : cudaFree(p));
  CHECK(cudaStreamSynchronize(stream));
  return 0;
}
