// The one table of entry points the shim hooks: each symbol is named once here.
//
// How to add a hook:
//   1. Add VGPU_CUDA_HOOK(symbol) or VGPU_NVML_HOOK(symbol) below, with the real exported name
//      (cuMemAlloc_v2, not cuMemAlloc). A _ptsz/_ptds symbol cuda.h does not declare needs its prototype in
//      extra_prototypes.h.
//   2. Define `extern "C" VGPU_EXPORT <type> symbol(...)` in the hooks file of its area; reach the driver through
//      vgpu::hooks::Real::symbol, never by name (the name resolves to the hook itself).
//   3. Add the name to libvgpu.map (the build checks that the map and this table agree).
//   4. Add its test: every route (direct, dlsym, cuGetProcAddress) must reach it.
//
// Everything the table drives — resolving the real functions, dlsym redirection, cuGetProcAddress
// redirection — comes from this list.
#pragma once

#include <cuda.h>
#include <nvml.h>

#include "extra_prototypes.h"

// clang-format off
#define VGPU_CUDA_HOOKS(X)                                                                    \
  X(cuInit)                                                                                   \
  X(cuGetProcAddress)                                                                         \
  X(cuGetProcAddress_v2)                                                                      \
  /* contexts: each costs device memory */                                                    \
  X(cuDevicePrimaryCtxRetain)                                                                 \
  X(cuDevicePrimaryCtxRelease)                                                                \
  X(cuDevicePrimaryCtxRelease_v2)                                                             \
  X(cuDevicePrimaryCtxReset)                                                                  \
  X(cuDevicePrimaryCtxReset_v2)                                                               \
  X(cuCtxCreate_v2)                                                                           \
  X(cuCtxCreate_v3)                                                                           \
  X(cuCtxCreate_v4)                                                                           \
  X(cuCtxDestroy)                                                                             \
  X(cuCtxDestroy_v2)                                                                          \
  /* allocation */                                                                            \
  X(cuMemAlloc_v2)                                                                            \
  X(cuMemAllocPitch_v2)                                                                       \
  X(cuMemAllocManaged)                                                                        \
  X(cuMemFree_v2)                                                                             \
  X(cuMemAllocAsync)                                                                          \
  X(cuMemAllocAsync_ptsz)                                                                     \
  X(cuMemAllocFromPoolAsync)                                                                  \
  X(cuMemAllocFromPoolAsync_ptsz)                                                             \
  X(cuMemFreeAsync)                                                                           \
  X(cuMemFreeAsync_ptsz)                                                                      \
  X(cuMemPoolTrimTo)                                                                          \
  X(cuMemPoolDestroy)                                                                         \
  X(cuMemCreate)                                                                              \
  X(cuMemRelease)                                                                             \
  X(cuMemMap)                                                                                 \
  X(cuMemUnmap)                                                                               \
  X(cuArrayCreate_v2)                                                                         \
  X(cuArray3DCreate_v2)                                                                       \
  X(cuArrayDestroy)                                                                           \
  X(cuMipmappedArrayCreate)                                                                   \
  X(cuMipmappedArrayDestroy)                                                                  \
  /* launches: admitted by the compute limiter */                                            \
  X(cuLaunchKernel)                                                                           \
  X(cuLaunchKernel_ptsz)                                                                      \
  X(cuLaunchKernelEx)                                                                         \
  X(cuLaunchKernelEx_ptsz)                                                                    \
  X(cuLaunchCooperativeKernel)                                                                \
  X(cuLaunchCooperativeKernel_ptsz)                                                           \
  X(cuGraphLaunch)                                                                            \
  X(cuGraphLaunch_ptsz)                                                                       \
  /* stream capture: counted, so that launches need no capture check while nothing is captured */\
  X(cuStreamBeginCapture)                                                                     \
  X(cuStreamBeginCapture_ptsz)                                                                \
  X(cuStreamBeginCapture_v2)                                                                  \
  X(cuStreamBeginCapture_v2_ptsz)                                                             \
  X(cuStreamBeginCaptureToGraph)                                                              \
  X(cuStreamBeginCaptureToGraph_ptsz)                                                         \
  X(cuStreamEndCapture)                                                                       \
  X(cuStreamEndCapture_ptsz)                                                                  \
  /* synchronize calls: time division keeps the process's work published while it waits */    \
  X(cuCtxSynchronize)                                                                         \
  X(cuCtxSynchronize_v2)                                                                      \
  X(cuStreamSynchronize)                                                                      \
  X(cuStreamSynchronize_ptsz)                                                                 \
  X(cuEventSynchronize)                                                                       \
  /* the driver's own memory (driver_memory.cc): a larger stack is charged first */         \
  X(cuCtxSetLimit)                                                                            \
  /* the view */                                                                              \
  X(cuMemGetInfo_v2)                                                                          \
  X(cuDeviceTotalMem_v2)                                                                      \
  X(cuMemRetainAllocationHandle)                                                              \
  /* the CUDA 2.x/3.0 ABI: refused while a limit applies (it would count nothing) */          \
  X(cuMemAlloc)                                                                               \
  X(cuMemAllocPitch)                                                                          \
  X(cuMemGetInfo)                                                                             \
  X(cuDeviceTotalMem)                                                                         \
  X(cuCtxCreate)

#define VGPU_NVML_HOOKS(X)                                                                    \
  X(nvmlInit_v2)                                                                              \
  X(nvmlInitWithFlags)                                                                        \
  X(nvmlDeviceGetMemoryInfo)                                                                  \
  X(nvmlDeviceGetMemoryInfo_v2)
// clang-format on

// Driver functions the shim calls itself but does not hook.
#define VGPU_CUDA_HELPERS(X)           \
  X(cuCtxGetDevice)                    \
  X(cuCtxGetCurrent)                   \
  X(cuDevicePrimaryCtxGetState)        \
  X(cuDeviceGetCount)                  \
  X(cuDeviceGet)                       \
  X(cuDeviceGetUuid_v2)                \
  X(cuDeviceGetMemPool)                \
  X(cuMemPoolGetAttribute)             \
  X(cuStreamGetCtx)                    \
  X(cuCtxPushCurrent_v2)               \
  X(cuCtxPopCurrent_v2)                \
  X(cuArrayGetMemoryRequirements)      \
  X(cuFuncGetAttribute)                \
  X(cuCtxGetLimit)                     \
  X(cuDeviceGetAttribute)              \
  X(cuEventCreate)                     \
  X(cuStreamIsCapturing)               \
  X(cuStreamQuery)                     \
  X(cuThreadExchangeStreamCaptureMode) \
  X(cuEventRecord)                     \
  X(cuEventQuery)                      \
  X(cuEventElapsedTime_v2)             \
  /* gated measurements (gates.h) */   \
  X(cuMemHostAlloc)                    \
  X(cuMemHostGetDevicePointer_v2)      \
  X(cuStreamWaitValue32_v2)

#define VGPU_NVML_HELPERS(X)       \
  X(nvmlDeviceGetUUID)             \
  X(nvmlDeviceGetIndex)            \
  X(nvmlDeviceGetHandleByUUID)     \
  X(nvmlDeviceGetUtilizationRates) \
  X(nvmlDeviceGetSamples)          \
  X(nvmlDeviceGetComputeRunningProcesses_v3)

namespace vgpu::hooks {

// The driver's own functions, resolved once (from the libcuda.so.1 / libnvidia-ml.so.1 the process would load).
// A null entry means the driver does not export it; hooks then return the "not found" error of their library.
struct Real {
#define VGPU_REAL_POINTER(name) static inline decltype(&::name) name = nullptr;
  VGPU_CUDA_HOOKS(VGPU_REAL_POINTER)
  VGPU_NVML_HOOKS(VGPU_REAL_POINTER)
  VGPU_CUDA_HELPERS(VGPU_REAL_POINTER)
  VGPU_NVML_HELPERS(VGPU_REAL_POINTER)
#undef VGPU_REAL_POINTER
};

// Resolves Real:: (idempotent, thread-safe). False if libcuda.so.1 cannot be loaded at all.
bool ResolveReal();
bool ResolveRealNvml();

// The shim's function for an exported CUDA/NVML name, or null if the name is not hooked.
void* HookFor(const char* symbol);
// The shim's function standing in for the driver function at `real_address`, or null.
void* HookForRealAddress(const void* real_address);

}  // namespace vgpu::hooks
