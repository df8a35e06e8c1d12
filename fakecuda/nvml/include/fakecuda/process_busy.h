// fakecuda's one entry point beyond NVML, exported by its libnvidia-ml.so.1: each process's exact GPU time on a
// device, from the device model. A real NVML has no such figure (its per-process samples name one process per
// period under time-slicing), so a caller looks it up with dlsym and treats its absence as "not the fake GPU".
// The scenario runner's sampler reads it for `program:` processes (docs/scenarios.md, "Programs").
#pragma once

#include "nvml.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  unsigned int pid;
  unsigned int running;           // 1: the process still holds its place on the fake machine; 0: it has gone
  unsigned long long started_ns;  // CLOCK_MONOTONIC when it first used the fake GPU
  unsigned long long busy_ns;     // its kernels' time on the device so far (to its end, once gone)
} fakecudaProcessBusy_t;

// Fills `entries` with the processes that have used `device`: those with a place on the machine now (running,
// or dead and not yet reaped) and the latest 256 to have gone. `*count` is the capacity in; the number written out.
// NVML_ERROR_INSUFFICIENT_SIZE with `*count` set to the number needed when `entries` is null or too small;
// NVML_ERROR_INVALID_ARGUMENT for a null `count`; NVML_ERROR_UNINITIALIZED / INVALID_ARGUMENT for the device as
// every NVML call.
nvmlReturn_t fakecudaDeviceGetProcessBusy(nvmlDevice_t device, unsigned int* count, fakecudaProcessBusy_t* entries);
typedef nvmlReturn_t (*fakecudaDeviceGetProcessBusy_t)(nvmlDevice_t, unsigned int*, fakecudaProcessBusy_t*);

#ifdef __cplusplus
}
#endif
