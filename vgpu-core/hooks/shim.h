// The shim's process state: configuration, the region, the device map, and the memory ledger the hooks use.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>

#include "hook_table.h"
#include "vgpu/policy/config.h"
#include "vgpu/region/region.h"
#include "vgpu/verdict/verdict.h"

#define VGPU_EXPORT __attribute__((visibility("default")))

namespace vgpu::hooks {

enum class Mode : int {
  uninitialized = 0,
  passthrough = 1,  // no limit configured: hooks forward at once
  limited = 2,      // limits apply
  failed = 3,       // configuration or region unusable: fail closed (no GPU rather than the whole GPU)
};

// The node monitor's verdict on this container as last read (docs/node-monitor.md). Guarded by its own mutex.
struct MonitorVerdict {
  std::mutex mutex;
  std::uint64_t read_ns = 0;  // CLOCK_MONOTONIC of the last read (0: never): read again after kVerdictReadNs
  bool usable = false;        // `verdict` parsed, fresh when read, and its seq did not go back
  verdict::Verdict verdict;
  std::uint64_t seq = 0;  // the highest seq used
  int reported = -1;      // the last state logged (one line per change)
};
inline constexpr std::uint64_t kVerdictReadNs = 10'000'000;

// One per process; rebuilt in a fork child.
struct Shim {
  std::atomic<Mode> mode{Mode::uninitialized};
  std::mutex init_mutex;
  policy::Config config;
  region::Attachment* region = nullptr;
  bool compute_limits = false;  // any CUDA_DEVICE_SM_LIMIT, or the disable policy: launches go through the limiter
  bool memory_limits = false;   // any CUDA_DEVICE_MEMORY_LIMIT: first launches are checked for the driver's own memory

  // Everything below is guarded by `mutex` (never held while calling into the driver for long operations).
  std::mutex mutex;
  std::mutex primary_mutex;  // serializes primary-context retain/release/reset: check-and-charge is one step
  // CUDA ordinal -> region device index; -1 until looked up (needs the device's UUID).
  int region_device[policy::kMaxDevices];
  // NVML's form of each looked-up device's UUID (for the verdict; "" until then). Not std::string: the allocation path
  // reads it, and must not need the heap for that.
  char device_uuid[policy::kMaxDevices][48] = {};
  struct Allocation {
    int ordinal;
    std::uint64_t bytes;
    CUcontext context;  // freed with it when the context goes
  };
  std::unordered_map<CUdeviceptr, Allocation> allocations;  // cuMemAlloc*, managed, pitch
  std::unordered_map<CUarray, Allocation> arrays;           // arrays and mipmapped arrays
  struct Vmm {
    int ordinal;  // -1: not device memory (host locations)
    std::uint64_t bytes;
    int references;  // the handle itself + each mapping
  };
  std::unordered_map<CUmemGenericAllocationHandle, Vmm> vmm;
  std::map<CUdeviceptr, std::pair<CUmemGenericAllocationHandle, std::size_t>> vmm_mappings;
  struct PoolCharge {
    int ordinal;
    CUcontext context;
    std::uint64_t charged;  // what the ledger holds for this pool
    // Destroyed while blocks were still allocated from it: the driver keeps its memory until they are freed, so
    // the charge stays, under a key of its own (never a real handle), until the last of them goes.
    bool destroyed = false;
  };
  std::unordered_map<CUmemoryPool, PoolCharge> pools;
  std::uint64_t retired_pools = 0;                            // destroyed pools so far: their keys
  std::unordered_map<CUdeviceptr, CUmemoryPool> pool_blocks;  // stream-ordered allocations -> their pool
  struct Context {
    int ordinal;
    std::uint64_t bytes;
  };
  std::unordered_map<CUcontext, Context> contexts;        // explicit contexts
  std::uint64_t primary_bytes[policy::kMaxDevices] = {};  // the primary context's charge, per ordinal
  CUcontext primary_context[policy::kMaxDevices] = {};    // its handle, to forget its allocations with it

  MonitorVerdict monitor;  // (its own mutex)
};

Shim& TheShim();

// The host's CLOCK_MONOTONIC in nanoseconds: one clock for every container of the host and for the node monitor (the
// schedule file's times, the verdict's stamps). A container in a time namespace reads its own clock moved by the
// namespace's offset; the offset is taken out (/proc/self/timens_offsets).
std::uint64_t MonotonicNs();
// HAMi's monitor's side of a launch (hami_feedback.cc, docs/hami-cache.md). Held first while HAMi's monitor says a
// container of a higher priority is active (recent_kernel -1), looking again every 10 ms; then, once a second (each
// launch reads the coarse clock), marked (recent_kernel 2, last_kernel_time) and this process's share of each device
// published (device_util[].sm). The other launches read one shared word and the coarse clock.
void BeforeLaunch();
// HAMi's breakdown of this process's memory on `ordinal` (its contexts', the driver's own, the rest its allocations),
// written again: after a context is made or goes, and with each launch's publication.
void PublishMemoryBreakdown(int ordinal);
void ForgetHamiFeedbackAfterFork();
// The shim if it was made already (no side effects), else null.
Shim* TheShimIfMade();
// Sleeps until the host's CLOCK_MONOTONIC (MonotonicNs) reads `deadline` (ns), through signals, with the thread's
// timer slack at most kSleepSlackNs meanwhile (its own put back after).
void SleepUntilNs(std::uint64_t deadline);
inline constexpr unsigned long kSleepSlackNs = 1'000;

// Initializes on first use (configuration, region, real functions). Returns the mode.
Mode Initialize();
// Mode check for the hot path: returns the mode without initializing twice.
inline Mode CurrentMode() {
  const Mode mode = TheShim().mode.load(std::memory_order_acquire);
  return mode != Mode::uninitialized ? mode : Initialize();
}

// The compute side forgets a destroyed context's pooled and pending events (memory_hooks calls it on destroy/reset).
void ForgetComputeContext(CUcontext context);
// In a fork child: the books of launches the child's threads inherited are its parent's (launch_books.cc).
void ForgetLaunchBooksAfterFork();

// A memory hook at work in this process (from its start to its return): the driver's own memory is reconciled only
// while no other thread is inside one, when the shim's charges and the driver's figure describe the same moment
// (driver_memory.cc). Counted process-wide; a thread's own nesting is known to it.
class MemoryOperation {
 public:
  MemoryOperation() noexcept;
  ~MemoryOperation();
  MemoryOperation(const MemoryOperation&) = delete;
  MemoryOperation& operator=(const MemoryOperation&) = delete;
  // A stamp of the other threads' memory operations: equal stamps, each with none in flight, mean none ran between.
  // 0: some are in flight now.
  static std::uint64_t QuietStamp() noexcept;
};

// A hook's start: the real function must exist; failed closed: the error; no limit configured: straight through.
// Limited: the rest of the hook is a MemoryOperation.
#define VGPU_PASSTHROUGH_UNLESS_LIMITED(real, ...)              \
  do {                                                          \
    if (Real::real == nullptr) ResolveReal();                   \
    if (Real::real == nullptr) return CUDA_ERROR_NOT_FOUND;     \
    const Mode mode_ = CurrentMode();                           \
    if (mode_ == Mode::failed) return kFailedClosedCuda;        \
    if (mode_ != Mode::limited) return Real::real(__VA_ARGS__); \
  } while (0);                                                  \
  const ::vgpu::hooks::MemoryOperation memory_operation_

// The CUDA error a failed-closed process sees from every hooked call.
inline constexpr CUresult kFailedClosedCuda = CUDA_ERROR_NO_DEVICE;
inline constexpr nvmlReturn_t kFailedClosedNvml = NVML_ERROR_DRIVER_NOT_LOADED;

// The limit for a CUDA ordinal (0 = none).
std::uint64_t MemoryLimit(int ordinal);
// The region's device index for a CUDA ordinal (-1 if unknown: the device cannot be named; then `error`, if given,
// holds the driver's error that kept it from being named, or CUDA_ERROR_NO_DEVICE).
int RegionDevice(int ordinal, CUresult* error = nullptr);
// The same for an ordinal whose UUID the caller already knows: an NVML-only process (nvidia-smi) never starts
// CUDA, so it names the device from NVML's UUID instead.
int RegionDeviceOfUuid(int ordinal, const std::uint8_t uuid[16]);
// The ordinal of the calling thread's current context, or -1.
int CurrentOrdinal();
// The same, telling "no context" (-1, `error` CUDA_SUCCESS: the driver refuses what needs one by itself) from "the
// device could not be told" (-1, `error` the driver's error): a call that would be counted must then be refused with
// that error, never let through uncounted.
int CurrentOrdinal(CUresult& error);

// What the node monitor's verdict says of one device (docs/node-monitor.md).
struct DeviceVerdict {
  std::uint64_t memory_limit = 0, memory_used = 0;  // bytes
  std::uint32_t sm_limit = 0, sm_used = 0;          // permille
  std::uint64_t stamp_ns = 0;                       // the verdict's
  bool MemoryOver() const { return memory_limit != 0 && memory_used > memory_limit; }
};
// The device `ordinal`'s line of the node monitor's verdict, if a verdict is usable now (read at most once per
// kVerdictReadNs, fresh, seq not gone back) and names the device (by its UUID, known once RegionDevice has looked
// it up). False otherwise. Allocates nothing between reads of the file.
bool VerdictOf(int ordinal, DeviceVerdict& out);
// This process's SM use of device `ordinal` in the node monitor's verdict (permille: its NVML samples on the host,
// named to the pid this process has in its container), if a usable verdict lists it.
bool VerdictOwnSm(int ordinal, std::uint32_t& permille);

// Charges `bytes` to `ordinal` if it fits under its limit; always true without a limit. Allocations stop
// VGPU_DRIVER_HEADROOM short of the limit; memory the driver takes by itself (`for_the_driver`) may use it.
bool Charge(int ordinal, std::uint64_t bytes, bool for_the_driver = false);
// What the views show free of a slice of `total` bytes of which the container uses `used`: the headroom kept for the
// driver's own memory is not free to allocate. Never below zero.
std::uint64_t FreeOfSlice(std::uint64_t total, std::uint64_t used);
void Uncharge(int ordinal, std::uint64_t bytes);
// The container's usage on `ordinal`; UsedOnRegionDevice for a region device index.
std::uint64_t Used(int ordinal);
std::uint64_t UsedOnRegionDevice(int device);

// Reconciles every stream-ordered pool's charge with the pool's reserved memory (pools grow and are trimmed
// inside the driver). Returns true if anything was given back.
bool ReconcilePools();
bool ReconcilePoolsLocked();  // the same, the caller holding shim.mutex

void Log(int level, const char* format, ...) __attribute__((format(printf, 2, 3)));

// The host ran out of memory (or something else threw) inside a hook: no exception may leave the shim into its C
// caller. Every exported hook is a function-try-block ending in VGPU_CUDA_CATCH / VGPU_NVML_CATCH, which turns the
// exception into an error for this call (out of memory: CUDA_ERROR_OUT_OF_MEMORY, NVML_ERROR_MEMORY; anything else:
// the UNKNOWN error) and logs the first one. The hooks themselves undo what the driver did before the failure (an
// allocation made but not recorded is freed), so that the error means "nothing happened" (docs/shim.md, "Out of host
// memory").
CUresult CudaErrorOfException() noexcept;
nvmlReturn_t NvmlErrorOfException() noexcept;
#define VGPU_CUDA_CATCH                           \
  catch (...) {                                   \
    return ::vgpu::hooks::CudaErrorOfException(); \
  }
#define VGPU_NVML_CATCH                           \
  catch (...) {                                   \
    return ::vgpu::hooks::NvmlErrorOfException(); \
  }

// Runs `record` (which inserts into the shim's maps); false if the host is out of memory, nothing inserted.
template <typename Record>
bool Recorded(Record&& record) noexcept {
  try {
    record();
    return true;
  } catch (const std::bad_alloc&) {
    return false;
  }
}

}  // namespace vgpu::hooks
