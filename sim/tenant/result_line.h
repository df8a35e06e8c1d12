// The one JSON line vgpu-tenant prints on stdout: what ran, how fast, and whether a CUDA call failed.
#pragma once

#include <cstdint>
#include <string>

namespace vgpu::tenant {

struct ResultLine {
  long long pid = 0;
  int device = 0;
  // Kernels launched; all of them had finished unless status is "error".
  std::uint64_t kernels = 0;
  std::uint64_t kernel_us = 0;
  std::uint32_t blocks = 0;
  // From the first launch until the last kernel finished (or the failure).
  double elapsed_s = 0;
  // Device memory held during the run: 0 when --alloc failed, except for an
  // out-of-memory (status "oom"): then the size asked for.
  std::uint64_t alloc_bytes = 0;
  // Sum of the durations of the kernels seen complete (each as its blocks spin: waves x ns per block).
  std::uint64_t busy_ns = 0;
  // --phase: busy_fraction is busy_ns / elapsed (kernel_us is then 0: the sizes vary).
  bool busy_from_busy_ns = false;
  // --alloc's cuMemAlloc_v2 returned CUDA_ERROR_OUT_OF_MEMORY: status "oom" (error and call are set too).
  bool out_of_memory = false;
  // Empty when every CUDA call succeeded; otherwise the CUresult's name
  // (CUDA_ERROR_OUT_OF_MEMORY) and the exported function that returned it.
  std::string error;
  std::string call;
};

// One line of JSON, without the newline. Fields in the documented order:
// pid, device, kernels, kernel_us, blocks, elapsed_s, kernels_per_s,
// busy_fraction, busy_ns, alloc_bytes, status, then error and call when status is
// "error" or "oom".
// kernels_per_s and busy_fraction are derived here (0 when nothing elapsed).
std::string FormatResultLine(const ResultLine& result);

}  // namespace vgpu::tenant
