// The driver's own memory, charged to the container (driver_memory.cc; docs/shim.md, "Memory the driver takes by
// itself"): what NVML counts for this process beyond the shim's own charges, and local memory charged before it grows.
#pragma once

#include <cstdint>
#include <functional>

#include "shim.h"

namespace vgpu::hooks {

// Reads NVML's figure for this process on `ordinal` and sets the process's charge for the driver's own memory to what
// it counts beyond the shim's charges. Nothing happens without a memory limit on `ordinal` or when NVML cannot say;
// put off while another thread's allocation or free is in flight (then due again at the next chance).
void ReconcileDriverMemory(int ordinal);
// The same when 100 ms have passed since the last reconciliation, or one was put off (the allocation path, views).
void ReconcileDriverMemoryIfDue(int ordinal);
// Charges `bytes` of driver memory about to be taken (against the limit); false: it does not fit.
bool ChargeDriverGrowth(int ordinal, std::uint64_t bytes);
// This process's charge for the driver's own memory on `ordinal`.
std::uint64_t DriverGrowth(int ordinal);
// Gives it all back (the process has no context left on the device).
void ForgetDriverGrowth(int ordinal);
// Threads the device holds at once (SMs x threads per SM): what local memory is reserved for; 0 if unknown.
std::uint64_t ThreadsResident(int ordinal);

// A launch (`graph`: of an executable graph) through the driver-memory check: the first launch of a function in a
// context charges the local memory it will add before it runs (CUDA_ERROR_OUT_OF_MEMORY, not launched, when that does
// not fit) and reconciles after it (its module loaded lazily, the heap). Later launches: a thread-local lookup.
CUresult LaunchCountingDriverMemory(const void* function, bool graph, const std::function<CUresult()>& launch);

// Before a view of `ordinal` is read (cuMemGetInfo, NVML's memory info): dead processes of the container are reaped
// (at most every 100 ms: a process that exited drops out of every view within that) and the driver's own memory
// reconciled when due (`ordinal` -1: reaping only, for a process that has not started CUDA).
void RefreshView(int ordinal);

// In a fork child: the parent's records are not the child's.
void ForgetDriverMemoryAfterFork();

}  // namespace vgpu::hooks
