// The Driver API side of vgpu-tenant: set up a context, launch the spin kernel as the options say, tear down.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string_view>

#include "options.h"
#include "result_line.h"

namespace vgpu::tenant {

// A CUDA call that failed: its result and the exported name of the function
// (the versioned one, cuMemAlloc_v2, as a trace or a shim sees it).
struct CudaFailure {
  CUresult result;
  const char* call;
};

// Blocks per SM that can be resident at once, and so how many waves B blocks
// take: the same formula fakecuda's cost model uses, from device attributes
// alone (the spin kernel needs no shared memory and few registers).
std::uint64_t WavesFor(std::uint64_t blocks, std::uint64_t threads_per_block, int sm_count, int max_threads_per_sm,
                       int max_blocks_per_sm);

// Runs the workload. Fills *result as it goes (kernels launched, elapsed time,
// bytes allocated), so that on a CudaFailure the caller still reports how far
// it got. Every driver object is released before this returns or throws.
// ptx must be NUL-terminated PTX text holding the entry vgpu_spin(.u64).
void RunWorkload(const Options& options, const char* ptx, ResultLine* result);

// "CUDA_ERROR_OUT_OF_MEMORY", or "CUresult 12345" for a code this driver cannot name.
std::string ErrorName(CUresult result);
std::string ErrorDescription(CUresult result);

}  // namespace vgpu::tenant
