// The runtime's everyday calls, one after the other, each checked: devices and their properties, memory and copies
// (contents are real on fakecuda; kernels do not compute), a launch with parameters of several sizes, streams and
// events, stream-ordered allocation, a captured graph. Prints one JSON line of what it saw.
#include <cstring>
#include <vector>

#include "check.h"

__device__ int counter[4] = {7, 8, 9, 10};
__device__ float scale_factor = 1.5f;
__constant__ float coefficients[8];

struct Wide {
  double a[3];
};

__global__ void scale(float* out, const float* in, float factor, int n, char tag, Wide wide) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    out[i] = in[i] * factor * scale_factor + tag + static_cast<float>(wide.a[2]) + coefficients[i % 8] + counter[0];
}

int main() {
  int count = 0;
  CHECK(cudaGetDeviceCount(&count));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  CHECK(cudaSetDevice(0));
  size_t free_bytes = 0, total_bytes = 0;
  CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));

  const int n = 1 << 20;
  std::vector<float> host(n), back(n);
  for (int i = 0; i < n; ++i) host[i] = static_cast<float>(i);
  float *in = nullptr, *out = nullptr;
  CHECK(cudaMalloc(&in, n * sizeof(float)));
  CHECK(cudaMalloc(&out, n * sizeof(float)));
  size_t free_after = 0;
  CHECK(cudaMemGetInfo(&free_after, &total_bytes));
  CHECK(cudaMemcpy(in, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(out, 0, n * sizeof(float)));
  CHECK(cudaMemcpy(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice));
  CHECK(cudaMemcpy(back.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost));
  const bool contents_kept = std::memcmp(back.data(), host.data(), n * sizeof(float)) == 0;  // before a kernel runs

  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start, stream));
  scale<<<n / 256, 256, 0, stream>>>(out, in, 2.0f, n, 'x', Wide{{1, 2, 3}});
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  float kernel_ms = 0;
  CHECK(cudaEventElapsedTime(&kernel_ms, start, stop));
  CHECK(cudaMemcpyAsync(back.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));

  void* pooled = nullptr;
  CHECK(cudaMallocAsync(&pooled, 64 << 20, stream));
  CHECK(cudaMemsetAsync(pooled, 1, 64 << 20, stream));
  CHECK(cudaFreeAsync(pooled, stream));

  // Module variables: initial values as compiled, and a round trip through a __constant__.
  int initial[4] = {};
  float scale_read = 0;
  CHECK(cudaMemcpyFromSymbol(initial, counter, sizeof initial));
  CHECK(cudaMemcpyFromSymbol(&scale_read, scale_factor, sizeof scale_read));
  const float written[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  float read[8] = {};
  CHECK(cudaMemcpyToSymbol(coefficients, written, sizeof written));
  CHECK(cudaMemcpyFromSymbol(read, coefficients, sizeof read));
  const bool variables_ok =
      initial[0] == 7 && initial[3] == 10 && scale_read == 1.5f && std::memcmp(read, written, sizeof read) == 0;

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < 4; ++k) scale<<<n / 256, 256, 0, stream>>>(out, in, 1.0f, n, 'y', Wide{{0, 0, 0}});
  CHECK(cudaStreamEndCapture(stream, &graph));
  size_t nodes = 0;
  CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int k = 0; k < 3; ++k) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));

  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaStreamDestroy(stream));
  CHECK(cudaFree(in));
  CHECK(cudaFree(out));
  CHECK(cudaDeviceSynchronize());
  std::printf(
      "{\"devices\": %d, \"name\": \"%s\", \"sm\": %d, \"total_mib\": %zu, \"free_mib\": %zu, "
      "\"free_after_alloc_mib\": %zu, \"kernel_ms\": %.3f, \"contents_kept\": %s, \"graph_nodes\": %zu, "
      "\"variables_ok\": %s}\n",
      count, prop.name, prop.major * 10 + prop.minor, total_bytes >> 20, free_bytes >> 20, free_after >> 20, kernel_ms,
      contents_kept ? "true" : "false", nodes, variables_ok ? "true" : "false");
  return 0;
}
