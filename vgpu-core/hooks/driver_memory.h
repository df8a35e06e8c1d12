// The driver's own memory, charged to the container (driver_memory.cc; docs/shim.md, "Memory the driver takes by
// itself"): what NVML counts for this process beyond the shim's own charges, and local memory charged before it grows.
#pragma once

#include <cstdint>

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
// Threads the device holds at once (SMs x threads per SM): what local memory is reserved for; the driver's error when
// it will not say.
CUresult ThreadsResident(int ordinal, std::uint64_t& threads);

// A launch to make, passed down without copying or allocating (the launch path's lambda, by reference).
class LaunchRef {
 public:
  template <typename Launch>
  explicit LaunchRef(Launch& launch)
      : object_(&launch), call_([](void* object) { return (*static_cast<Launch*>(object))(); }) {}
  CUresult operator()() const { return call_(object_); }

 private:
  void* object_;
  CUresult (*call_)(void*);
};

// The launch path's check (no lock, no allocation): true when this thread launched `function` in the current context
// before (or nothing is to be checked); `context` receives the current context.
bool LaunchedBefore(const void* function, CUcontext& context);
// A first launch of `function` in `context` (`graph`: an executable graph): the local memory it will add is charged
// before it runs (CUDA_ERROR_OUT_OF_MEMORY, not launched, when that does not fit), the rest reconciled after (its
// module loaded lazily, the heap).
CUresult FirstLaunch(const void* function, CUcontext context, bool graph, LaunchRef launch);

// A launch through the driver-memory check.
template <typename Launch>
CUresult LaunchCountingDriverMemory(const void* function, bool graph, Launch&& launch) {
  CUcontext context = nullptr;
  if (LaunchedBefore(function, context)) return launch();
  return FirstLaunch(function, context, graph, LaunchRef(launch));
}

// Before a view of `ordinal` is read (cuMemGetInfo, NVML's memory info): dead processes of the container are reaped
// (at most every 100 ms: a process that exited drops out of every view within that) and the driver's own memory
// reconciled when due (`ordinal` -1: reaping only, for a process that has not started CUDA).
void RefreshView(int ordinal);

// In a fork child: the parent's records are not the child's.
void ForgetDriverMemoryAfterFork();

}  // namespace vgpu::hooks
