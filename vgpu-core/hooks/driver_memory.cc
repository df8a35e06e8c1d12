// The driver's own memory (docs/shim.md, "Memory the driver takes by itself"): what the driver takes for a process
// without an allocation call -- modules loaded at a function's first use, local memory a kernel or the stack limit
// needs, the device-side heap, graph memory, stream resources -- charged to the container like an allocation.
//
// Two mechanisms. Predicted growth (local memory: a kernel needing more per thread than the context reserves, or a
// larger stack limit) is charged against the limit *before* the driver is called, and the call is refused with
// CUDA_ERROR_OUT_OF_MEMORY when it does not fit, as the driver of a GPU that size would refuse it. Everything else is
// reconciled after the fact with the driver's own figure for this process (NVML's per-process list, the host's view):
// after the calls that can grow it (a function's first launch, module and library loads, limits), at most every
// 100 ms from the allocation path and the views. The process's charge for it ("growth") is what NVML counts beyond
// the shim's own charges; it only rises, except after the calls that give memory back (a smaller stack limit, module
// unloads, graph memory trims, a context destroyed).
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_set>

#include "driver_memory.h"

namespace vgpu::hooks {
namespace {

constexpr std::uint64_t kReconcileEveryNs = 100'000'000;  // from the allocation path and the views
constexpr unsigned int kMaxListed = 256;
constexpr std::uint64_t kViewReapEveryNs = 20'000'000;      // dead processes leave the views within this                   // processes read from NVML's list at once

std::uint64_t MonotonicNs() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(now.tv_nsec);
}

// A launched (function, context): its first launch is the one that may load its module and grow local memory.
struct LaunchKey {
  const void* function;
  CUcontext context;
  bool operator==(const LaunchKey& other) const { return function == other.function && context == other.context; }
};
struct LaunchKeyHash {
  std::size_t operator()(const LaunchKey& key) const {
    return std::hash<const void*>()(key.function) * 31 + std::hash<const void*>()(key.context);
  }
};

// Per process (rebuilt in a fork child: the child's driver state is its own).
struct DriverMemory {
  std::mutex mutex;  // serializes reconciliations and changes of `growth`; taken before shim.mutex and the region lock
  std::uint64_t growth[policy::kMaxDevices] = {};           // charged in the region for the driver's own memory
  std::atomic<std::uint64_t> next_reconcile_ns[policy::kMaxDevices] = {};
  nvmlDevice_t nvml[policy::kMaxDevices] = {};
  std::unordered_set<LaunchKey, LaunchKeyHash> launched;    // guarded by `mutex`
  bool unlisted_logged = false;
};

DriverMemory* g_driver_memory = nullptr;  // made at the first use, replaced in a fork child (the parent's leaks)
std::mutex g_driver_memory_made;

DriverMemory& TheDriverMemory() {
  std::lock_guard<std::mutex> guard(g_driver_memory_made);
  if (g_driver_memory == nullptr) g_driver_memory = new DriverMemory();
  return *g_driver_memory;
}

// The last few (function, context) pairs this thread launched: the launch path's check, without a lock.
struct RecentLaunches {
  std::array<LaunchKey, 64> keys{};
  std::uint64_t fork_generation = 0;
};
thread_local RecentLaunches t_recent;
std::atomic<std::uint64_t> g_fork_generation{1};

// Set while this thread holds DriverMemory::mutex around a Charge (which reconciles when due: not with the lock held).
thread_local bool t_charging = false;

std::size_t RecentSlot(const LaunchKey& key) { return LaunchKeyHash()(key) % t_recent.keys.size(); }

// NVML's figure for this process on `ordinal`'s device; false when it cannot be read or this process is not listed.
// The driver reports pids in the caller's pid namespace (driver 580, measured: pid 1 under unshare -pf --mount-proc).
bool ReadOwnBytes(DriverMemory& dm, int ordinal, std::uint64_t& bytes) {
  Shim& shim = TheShim();
  if (!ResolveRealNvml() || Real::nvmlDeviceGetComputeRunningProcesses_v3 == nullptr) return false;
  if (dm.nvml[ordinal] == nullptr) {
    char uuid[sizeof shim.device_uuid[0]];
    {
      std::lock_guard<std::mutex> guard(shim.mutex);
      std::memcpy(uuid, shim.device_uuid[ordinal], sizeof uuid);
    }
    if (uuid[0] == '\0' || Real::nvmlInit_v2 == nullptr || Real::nvmlDeviceGetHandleByUUID == nullptr ||
        Real::nvmlInit_v2() != NVML_SUCCESS || Real::nvmlDeviceGetHandleByUUID(uuid, &dm.nvml[ordinal]) != NVML_SUCCESS) {
      dm.nvml[ordinal] = nullptr;
      return false;
    }
  }
  static thread_local nvmlProcessInfo_t listed[kMaxListed];
  unsigned int count = kMaxListed;
  if (Real::nvmlDeviceGetComputeRunningProcesses_v3(dm.nvml[ordinal], &count, listed) != NVML_SUCCESS || count > kMaxListed) {
    return false;  // success with more entries than the buffer holds is not an answer
  }
  int found = 0;
  for (unsigned int i = 0; i < count; ++i) {
    if (static_cast<pid_t>(listed[i].pid) != getpid()) continue;
    bytes = listed[i].usedGpuMemory;
    ++found;
  }
  if (found == 0 && !dm.unlisted_logged) {
    dm.unlisted_logged = true;
    Log(2, "device %d: this process (pid %d) is not in NVML's process list: the driver's own memory is not counted",
        ordinal, static_cast<int>(getpid()));
  }
  return found == 1;
}

// Sets this process's charge for the driver's own memory on `ordinal` to `target`. A rise is charged whatever the
// limit (the memory exists already). Caller holds dm.mutex.
void SetGrowthLocked(DriverMemory& dm, int ordinal, std::uint64_t target) {
  Shim& shim = TheShim();
  const int device = RegionDevice(ordinal);
  std::uint64_t& growth = dm.growth[ordinal];
  if (device < 0 || target == growth) return;
  if (target > growth) {
    if (!shim.region->Reserve(device, target - growth, UINT64_MAX)) return;
  } else {
    shim.region->Release(device, growth - target);
  }
  Log(3, "device %d: the driver's own memory for this process: %llu -> %llu bytes", ordinal,
      static_cast<unsigned long long>(growth), static_cast<unsigned long long>(target));
  growth = target;
}

// Reconciles with NVML under dm.mutex: growth becomes max(what NVML counts beyond the shim's charges, floor).
void ReconcileLocked(DriverMemory& dm, int ordinal, std::uint64_t floor) {
  const int device = RegionDevice(ordinal);
  if (device < 0) return;
  std::uint64_t listed = 0;
  if (!ReadOwnBytes(dm, ordinal, listed)) return;
  const std::uint64_t explicit_bytes = TheShim().region->OwnUsed(device) - std::min(TheShim().region->OwnUsed(device), dm.growth[ordinal]);
  std::uint64_t target = std::max(listed > explicit_bytes ? listed - explicit_bytes : 0, floor);
  if (target != dm.growth[ordinal]) {
    // A change is taken only when a second read agrees (a driver answering garbage must not set the charge).
    std::uint64_t again = 0;
    if (!ReadOwnBytes(dm, ordinal, again) || again != listed) return;
  }
  dm.next_reconcile_ns[ordinal].store(MonotonicNs() + kReconcileEveryNs, std::memory_order_relaxed);
  SetGrowthLocked(dm, ordinal, target);
}

bool Tracked(int ordinal) {
  return ordinal >= 0 && ordinal < policy::kMaxDevices && MemoryLimit(ordinal) != 0 &&
         CurrentMode() == Mode::limited;
}

// Local memory a launch of `function` would add (bytes): a kernel needing more per thread than the stack limit the
// context reserves makes the driver reserve that much for every thread the device holds (H100: 4 KiB a thread took
// 792 MiB more, 16 KiB 3168 MiB more).
std::uint64_t PredictedLocalGrowth(const void* function, int ordinal) {
  if (Real::cuFuncGetAttribute == nullptr || Real::cuCtxGetLimit == nullptr) return 0;
  int local = 0;
  std::size_t stack = 0;
  if (Real::cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                               static_cast<CUfunction>(const_cast<void*>(function))) != CUDA_SUCCESS ||
      Real::cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE) != CUDA_SUCCESS || local <= 0 ||
      static_cast<std::size_t>(local) <= stack) {
    return 0;
  }
  return (static_cast<std::uint64_t>(local) - stack) * ThreadsResident(ordinal);
}

}  // namespace

std::uint64_t ThreadsResident(int ordinal) {
  if (Real::cuDeviceGetAttribute == nullptr) return 0;
  int sms = 0, threads = 0;
  if (Real::cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal) != CUDA_SUCCESS ||
      Real::cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, ordinal) != CUDA_SUCCESS ||
      sms <= 0 || threads <= 0) {
    return 0;
  }
  return static_cast<std::uint64_t>(sms) * static_cast<std::uint64_t>(threads);
}

void ReconcileDriverMemory(int ordinal, std::uint64_t floor_bytes) {
  if (!Tracked(ordinal)) return;
  DriverMemory& dm = TheDriverMemory();
  std::lock_guard<std::mutex> guard(dm.mutex);
  ReconcileLocked(dm, ordinal, floor_bytes == kRaiseOnly ? dm.growth[ordinal] : floor_bytes);
}

void ReconcileDriverMemoryIfDue(int ordinal) {
  if (t_charging || !Tracked(ordinal)) return;
  DriverMemory& dm = TheDriverMemory();
  if (MonotonicNs() < dm.next_reconcile_ns[ordinal].load(std::memory_order_relaxed)) return;
  std::unique_lock<std::mutex> guard(dm.mutex, std::try_to_lock);
  if (!guard.owns_lock()) return;  // another thread is reconciling now
  ReconcileLocked(dm, ordinal, dm.growth[ordinal]);
}

bool ChargeDriverGrowth(int ordinal, std::uint64_t bytes) {
  if (bytes == 0 || !Tracked(ordinal)) return true;
  DriverMemory& dm = TheDriverMemory();
  std::lock_guard<std::mutex> guard(dm.mutex);
  t_charging = true;
  const bool charged = Charge(ordinal, bytes);
  t_charging = false;
  if (charged) dm.growth[ordinal] += bytes;
  return charged;
}

std::uint64_t DriverGrowth(int ordinal) {
  if (ordinal < 0 || ordinal >= policy::kMaxDevices) return 0;
  DriverMemory& dm = TheDriverMemory();
  std::lock_guard<std::mutex> guard(dm.mutex);
  return dm.growth[ordinal];
}

void ForgetDriverGrowth(int ordinal) {
  if (ordinal < 0 || ordinal >= policy::kMaxDevices) return;
  DriverMemory& dm = TheDriverMemory();
  std::lock_guard<std::mutex> guard(dm.mutex);
  SetGrowthLocked(dm, ordinal, 0);
}

CUresult LaunchCountingDriverMemory(const void* function, bool graph, const std::function<CUresult()>& launch) {
  if (!TheShim().memory_limits || CurrentMode() != Mode::limited || Real::cuCtxGetCurrent == nullptr) return launch();
  CUcontext context = nullptr;
  if (Real::cuCtxGetCurrent(&context) != CUDA_SUCCESS || context == nullptr) return launch();
  const std::uint64_t forks = g_fork_generation.load(std::memory_order_relaxed);
  if (t_recent.fork_generation != forks) t_recent = RecentLaunches{{}, forks};
  const LaunchKey key{function, context};
  LaunchKey& recent = t_recent.keys[RecentSlot(key)];
  if (recent == key) return launch();  // the hot path: this thread launched it before
  DriverMemory& dm = TheDriverMemory();
  {
    std::lock_guard<std::mutex> guard(dm.mutex);
    if (dm.launched.count(key) != 0) {
      recent = key;
      return launch();
    }
  }
  const int ordinal = CurrentOrdinal();
  if (!Tracked(ordinal)) return launch();
  // The first launch of this function in this context: local memory it needs is charged before, the rest (its module
  // loaded lazily, the heap) reconciled after.
  std::uint64_t before = 0, predicted = graph ? 0 : PredictedLocalGrowth(function, ordinal);
  {
    std::lock_guard<std::mutex> guard(dm.mutex);
    before = dm.growth[ordinal];
  }
  if (predicted != 0 && !ChargeDriverGrowth(ordinal, predicted)) {
    Log(2, "device %d: a launch refused: its kernel needs %llu bytes more local memory than the slice has left", ordinal,
        static_cast<unsigned long long>(predicted));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult result = launch();
  {
    std::lock_guard<std::mutex> guard(dm.mutex);
    if (result == CUDA_SUCCESS) {
      Recorded([&] { dm.launched.insert(key); });
      recent = key;
    }
    // The prediction settles to what the driver took: the measurement, never below what was charged before.
    ReconcileLocked(dm, ordinal, before);
    if (dm.growth[ordinal] > before + predicted && predicted != 0) {
      Log(3, "device %d: a first launch took %llu bytes (predicted %llu)", ordinal,
          static_cast<unsigned long long>(dm.growth[ordinal] - before), static_cast<unsigned long long>(predicted));
    }
  }
  return result;
}

void RefreshView(int ordinal) {
  Shim& shim = TheShim();
  // Reaped at most every 20 ms from this process's views (a reap takes the region lock and probes each live slot).
  static std::atomic<std::uint64_t> next_reap_ns{0};
  const std::uint64_t now = MonotonicNs();
  std::uint64_t due = next_reap_ns.load(std::memory_order_relaxed);
  if (shim.region != nullptr && now >= due &&
      next_reap_ns.compare_exchange_strong(due, now + kViewReapEveryNs, std::memory_order_relaxed)) {
    shim.region->ReapDead(true);
  }
  ReconcileDriverMemoryIfDue(ordinal);
}

void ForgetDriverMemoryAfterFork() {
  g_driver_memory = nullptr;  // the parent's stays allocated: its mutex may be held by a thread that is not here
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace vgpu::hooks

using namespace vgpu::hooks;

// ---- the calls that grow or shrink the driver's own memory -------------------------------------------------------

namespace {

// The current context's device, when its memory is limited; -1 otherwise.
int TrackedOrdinal() {
  const int ordinal = CurrentOrdinal();
  return ordinal >= 0 && ordinal < vgpu::policy::kMaxDevices && MemoryLimit(ordinal) != 0 ? ordinal : -1;
}

// Runs a call that may grow the driver's memory on the current device, then reconciles (a rise only).
template <typename Call>
CUresult ThenReconcile(Call&& call) {
  const CUresult result = call();
  if (const int ordinal = TrackedOrdinal(); ordinal >= 0) ReconcileDriverMemory(ordinal, kRaiseOnly);
  return result;
}

// Runs a call that may give the driver's memory back, then reconciles to what NVML counts (it may fall).
template <typename Call>
CUresult ThenSettle(Call&& call) {
  const CUresult result = call();
  if (const int ordinal = TrackedOrdinal(); ordinal >= 0) ReconcileDriverMemory(ordinal, 0);
  return result;
}

}  // namespace


// The stack is local memory for every thread the device holds, resized at once (H100: 16 -> 32 KiB a thread took
// 4224 MiB more): a larger one is charged first and refused when it does not fit. The heap is taken at the first
// kernel using it (reconciled then); the printf FIFO is not device memory (H100: 64 MiB set, nothing taken).
extern "C" VGPU_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuCtxSetLimit, limit, value);
  const int ordinal = TrackedOrdinal();
  if (ordinal < 0 || limit != CU_LIMIT_STACK_SIZE || Real::cuCtxGetLimit == nullptr) {
    return ThenReconcile([&] { return Real::cuCtxSetLimit(limit, value); });
  }
  std::size_t stack = 0;
  if (const CUresult got = Real::cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE); got != CUDA_SUCCESS) return got;
  const std::uint64_t before = DriverGrowth(ordinal);
  const std::uint64_t predicted = value > stack ? (value - stack) * ThreadsResident(ordinal) : 0;
  if (!ChargeDriverGrowth(ordinal, predicted)) {
    Log(2, "device %d: a stack limit of %zu bytes refused: it needs %llu bytes more than the slice has left", ordinal,
        value, static_cast<unsigned long long>(predicted));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult result = Real::cuCtxSetLimit(limit, value);
  // Settled to the measurement: a smaller stack gives memory back; a failed call gives the prediction back.
  ReconcileDriverMemory(ordinal, 0);
  if (DriverGrowth(ordinal) > before + predicted) Log(3, "device %d: the stack limit took more than predicted", ordinal);
  return result;
} VGPU_CUDA_CATCH

// Module and library loads: with CUDA_MODULE_LOADING=EAGER the code and data load here (lazily, at the first use).
extern "C" VGPU_EXPORT CUresult cuModuleLoad(CUmodule* module, const char* path) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuModuleLoad, module, path);
  return ThenReconcile([&] { return Real::cuModuleLoad(module, path); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuModuleLoadData(CUmodule* module, const void* image) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuModuleLoadData, module, image);
  return ThenReconcile([&] { return Real::cuModuleLoadData(module, image); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int count,
                                                  CUjit_option* options, void** values) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuModuleLoadDataEx, module, image, count, options, values);
  return ThenReconcile([&] { return Real::cuModuleLoadDataEx(module, image, count, options, values); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule* module, const void* image) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuModuleLoadFatBinary, module, image);
  return ThenReconcile([&] { return Real::cuModuleLoadFatBinary(module, image); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary* library, const void* code, CUjit_option* jit_options,
                                                 void** jit_values, unsigned int jit_count, CUlibraryOption* options,
                                                 void** values, unsigned int count) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuLibraryLoadData, library, code, jit_options, jit_values, jit_count, options, values, count);
  return ThenReconcile([&] {
    return Real::cuLibraryLoadData(library, code, jit_options, jit_values, jit_count, options, values, count);
  });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary* library, const char* path, CUjit_option* jit_options,
                                                     void** jit_values, unsigned int jit_count, CUlibraryOption* options,
                                                     void** values, unsigned int count) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuLibraryLoadFromFile, library, path, jit_options, jit_values, jit_count, options, values,
                          count);
  return ThenReconcile([&] {
    return Real::cuLibraryLoadFromFile(library, path, jit_options, jit_values, jit_count, options, values, count);
  });
} VGPU_CUDA_CATCH

// The calls that give the driver's memory back.
extern "C" VGPU_EXPORT CUresult cuModuleUnload(CUmodule module) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuModuleUnload, module);
  return ThenSettle([&] { return Real::cuModuleUnload(module); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLibraryUnload(CUlibrary library) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuLibraryUnload, library);
  return ThenSettle([&] { return Real::cuLibraryUnload(library); });
} VGPU_CUDA_CATCH

// Graph memory nodes take their memory at the graph's launch and keep it until trimmed (H100: 128 MiB node, +128 at
// launch, -128 at the trim).
extern "C" VGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuDeviceGraphMemTrim, device);
  const CUresult result = Real::cuDeviceGraphMemTrim(device);
  ReconcileDriverMemory(device, 0);
  return result;
} VGPU_CUDA_CATCH
