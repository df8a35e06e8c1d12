// The driver's own memory (docs/shim.md, "Memory the driver takes by itself"): what the driver takes for a process
// without an allocation call -- modules loaded at a function's first use, local memory a kernel or the stack limit
// needs, the device-side heap, graph memory, stream resources -- charged to the container like an allocation.
//
// Two mechanisms. Predicted growth (local memory: a kernel needing more per thread than the context reserves, or a
// larger stack limit) is charged against the limit *before* the driver is called, and the call is refused with
// CUDA_ERROR_OUT_OF_MEMORY when it does not fit, as the driver of a GPU that size would refuse it. Everything else is
// reconciled after the fact with the driver's own figure for this process (NVML's per-process list, the host's view):
// after the calls that can grow it (a function's first launch in a context, cuCtxSetLimit), at most every 100 ms from
// the allocation path and the views (module loads and unloads, graph memory, streams), and when a context goes. The
// process's charge for it ("growth") is what NVML counts beyond the shim's own charges, taken only while no other
// thread of the process is inside an allocation or a free (MemoryOperation), so that both describe the same moment.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_set>

#include "driver_memory.h"

namespace vgpu::hooks {
namespace {

constexpr std::uint64_t kReconcileEveryNs = 100'000'000;  // from the allocation path and the views
constexpr std::uint64_t kViewReapEveryNs = 20'000'000;    // dead processes leave the views within this
constexpr unsigned int kMaxListed = 256;                  // processes read from NVML's list at once
constexpr std::uint64_t kMaxPlausibleBytes = 1ull << 40;  // a process figure above it is NVML answering garbage

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
  std::uint64_t growth[policy::kMaxDevices] = {};  // charged in the region for the driver's own memory
  std::atomic<std::uint64_t> next_reconcile_ns[policy::kMaxDevices] = {};  // 0: due now (one was put off)
  nvmlDevice_t nvml[policy::kMaxDevices] = {};
  std::unordered_set<LaunchKey, LaunchKeyHash> launched;  // guarded by `mutex`
  nvmlProcessInfo_t listed[kMaxListed] = {};              // NVML's answer, read under `mutex`
  bool unlisted_logged = false;
};

// Made at the first use without a lock (a fork child may start where a parent's thread held one), replaced in a
// fork child (the parent's leaks: its mutex may be held by a thread that is not there).
std::atomic<DriverMemory*> g_driver_memory{nullptr};

DriverMemory& TheDriverMemory() {
  DriverMemory* made = g_driver_memory.load(std::memory_order_acquire);
  if (made != nullptr) return *made;
  auto* fresh = new DriverMemory();
  if (g_driver_memory.compare_exchange_strong(made, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;  // another thread made it first
  return *made;
}

// The last few (function, context) pairs this thread launched: the launch path's check, without a lock.
struct RecentLaunches {
  std::array<LaunchKey, 64> keys{};
  std::uint64_t fork_generation = 0;
};
thread_local RecentLaunches t_recent;
std::atomic<std::uint64_t> g_fork_generation{1};

// Memory operations (MemoryOperation): in flight now in the process, completed so far, and this thread's own nesting.
std::atomic<std::uint64_t> g_operations_in_flight{0};
std::atomic<std::uint64_t> g_operations_done{0};
thread_local std::uint64_t t_operations = 0;

// Set while this thread holds DriverMemory::mutex around a Charge (which reconciles when due: not with the lock held).
thread_local bool t_charging = false;

std::size_t RecentSlot(const LaunchKey& key) { return LaunchKeyHash()(key) % t_recent.keys.size(); }

// NVML's figure for this process on `ordinal`'s device; false when it cannot be read or this process is not listed
// (`holds`: the shim charges this process memory there, so it should be listed). The driver reports pids in the
// caller's pid namespace (driver 580, measured: pid 1 under unshare -pf --mount-proc).
bool ReadOwnBytes(DriverMemory& dm, int ordinal, bool holds, std::uint64_t& bytes) {
  Shim& shim = TheShim();
  if (!ResolveRealNvml() || Real::nvmlDeviceGetComputeRunningProcesses_v3 == nullptr) return false;
  if (dm.nvml[ordinal] == nullptr) {
    char uuid[sizeof shim.device_uuid[0]];
    {
      std::lock_guard<std::mutex> guard(shim.mutex);
      std::memcpy(uuid, shim.device_uuid[ordinal], sizeof uuid);
    }
    if (uuid[0] == '\0' || Real::nvmlInit_v2 == nullptr || Real::nvmlDeviceGetHandleByUUID == nullptr ||
        Real::nvmlInit_v2() != NVML_SUCCESS ||
        Real::nvmlDeviceGetHandleByUUID(uuid, &dm.nvml[ordinal]) != NVML_SUCCESS) {
      dm.nvml[ordinal] = nullptr;
      return false;
    }
  }
  nvmlProcessInfo_t* listed = dm.listed;
  unsigned int count = kMaxListed;
  if (Real::nvmlDeviceGetComputeRunningProcesses_v3(dm.nvml[ordinal], &count, listed) != NVML_SUCCESS ||
      count > kMaxListed) {
    return false;  // success with more entries than the buffer holds is not an answer
  }
  int found = 0;
  for (unsigned int i = 0; i < count; ++i) {
    if (static_cast<pid_t>(listed[i].pid) != getpid()) continue;
    if (listed[i].usedGpuMemory > kMaxPlausibleBytes) return false;  // garbage (no device holds a TiB)
    bytes = listed[i].usedGpuMemory;
    ++found;
  }
  if (found == 0 && holds && !dm.unlisted_logged) {
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

// Reconciles with NVML under dm.mutex: growth becomes what NVML counts beyond the shim's charges. Put off
// (due again at once) while another thread's allocation or free is in flight: its charge and the driver's figure
// would not describe the same moment (a pool grown by more than its upfront charge, a free done but not yet uncharged).
void ReconcileLocked(DriverMemory& dm, int ordinal) {
  Shim& shim = TheShim();
  const int device = RegionDevice(ordinal);
  if (device < 0) return;
  const std::uint64_t quiet = MemoryOperation::QuietStamp();
  const std::uint64_t own = shim.region->OwnUsed(device);
  std::uint64_t listed = 0, again = 0;
  if (quiet == 0) {
    dm.next_reconcile_ns[ordinal].store(0, std::memory_order_relaxed);  // due at the next chance
    return;
  }
  // Unreadable or unlisted: tried again in 100 ms, not at every allocation.
  dm.next_reconcile_ns[ordinal].store(MonotonicNs() + kReconcileEveryNs, std::memory_order_relaxed);
  if (!ReadOwnBytes(dm, ordinal, own != 0, listed)) return;
  const std::uint64_t explicit_bytes = own - std::min(own, dm.growth[ordinal]);
  const std::uint64_t target = listed > explicit_bytes ? listed - explicit_bytes : 0;
  // A change is taken only when a second read agrees (a driver answering garbage must not set the charge) and nothing
  // ran meanwhile.
  if (target != dm.growth[ordinal] && (!ReadOwnBytes(dm, ordinal, true, again) || again != listed)) return;
  if (MemoryOperation::QuietStamp() != quiet) {
    dm.next_reconcile_ns[ordinal].store(0, std::memory_order_relaxed);
    return;
  }
  SetGrowthLocked(dm, ordinal, target);
}

bool Tracked(int ordinal) {
  return ordinal >= 0 && ordinal < policy::kMaxDevices && MemoryLimit(ordinal) != 0 && CurrentMode() == Mode::limited;
}

// Local memory a launch of `function` would add (bytes): a kernel needing more per thread than the stack limit the
// context reserves makes the driver reserve that much for every thread the device holds (H100: 4 KiB a thread took
// 792 MiB more, 16 KiB 3168 MiB more). 0 when it cannot be told (a handle whose attributes the driver will not give):
// the launch is then reconciled after, as for a module loaded lazily.
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
  std::uint64_t threads = 0;
  if (ThreadsResident(ordinal, threads) != CUDA_SUCCESS) return 0;  // reconciled after the launch instead
  return (static_cast<std::uint64_t>(local) - stack) * threads;
}

}  // namespace

MemoryOperation::MemoryOperation() noexcept {
  g_operations_in_flight.fetch_add(1, std::memory_order_acq_rel);
  ++t_operations;
}

MemoryOperation::~MemoryOperation() {
  --t_operations;
  g_operations_done.fetch_add(1, std::memory_order_acq_rel);
  g_operations_in_flight.fetch_sub(1, std::memory_order_acq_rel);
}

std::uint64_t MemoryOperation::QuietStamp() noexcept {
  // Others in flight: all in flight less this thread's own (a hook reconciling from inside itself).
  if (g_operations_in_flight.load(std::memory_order_acquire) != t_operations) return 0;
  return g_operations_done.load(std::memory_order_acquire) + 1;  // never 0
}

CUresult ThreadsResident(int ordinal, std::uint64_t& threads) {
  threads = 0;
  if (Real::cuDeviceGetAttribute == nullptr) return CUDA_ERROR_NOT_FOUND;
  int sms = 0, per_sm = 0;
  if (const CUresult r = Real::cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal);
      r != CUDA_SUCCESS) {
    return r;
  }
  const CUresult r = Real::cuDeviceGetAttribute(&per_sm, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, ordinal);
  if (r != CUDA_SUCCESS) return r;
  threads = static_cast<std::uint64_t>(std::max(sms, 0)) * static_cast<std::uint64_t>(std::max(per_sm, 0));
  return CUDA_SUCCESS;
}

void ReconcileDriverMemory(int ordinal) {
  if (!Tracked(ordinal)) return;
  DriverMemory& dm = TheDriverMemory();
  std::lock_guard<std::mutex> guard(dm.mutex);
  ReconcileLocked(dm, ordinal);
}

void ReconcileDriverMemoryIfDue(int ordinal) {
  if (t_charging || !Tracked(ordinal)) return;
  DriverMemory& dm = TheDriverMemory();
  if (MonotonicNs() < dm.next_reconcile_ns[ordinal].load(std::memory_order_relaxed)) return;
  std::unique_lock<std::mutex> guard(dm.mutex, std::try_to_lock);
  if (!guard.owns_lock()) return;  // another thread is reconciling now
  ReconcileLocked(dm, ordinal);
}

bool ChargeDriverGrowth(int ordinal, std::uint64_t bytes) {
  if (bytes == 0 || !Tracked(ordinal)) return true;
  DriverMemory& dm = TheDriverMemory();
  std::lock_guard<std::mutex> guard(dm.mutex);
  t_charging = true;
  const bool charged = Charge(ordinal, bytes, true);
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

bool LaunchedBefore(const void* function, CUcontext& context) {
  context = nullptr;
  if (CurrentMode() != Mode::limited || Real::cuCtxGetCurrent == nullptr) return true;
  if (Real::cuCtxGetCurrent(&context) != CUDA_SUCCESS || context == nullptr) return true;  // the driver refuses it
  const std::uint64_t forks = g_fork_generation.load(std::memory_order_relaxed);
  if (t_recent.fork_generation != forks) t_recent = RecentLaunches{{}, forks};
  const LaunchKey key{function, context};
  return t_recent.keys[RecentSlot(key)] == key;
}

CUresult FirstLaunch(const void* function, CUcontext context, bool graph, LaunchRef launch) {
  const LaunchKey key{function, context};
  LaunchKey& recent = t_recent.keys[RecentSlot(key)];
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
  const std::uint64_t before = DriverGrowth(ordinal), predicted = graph ? 0 : PredictedLocalGrowth(function, ordinal);
  if (predicted != 0 && !ChargeDriverGrowth(ordinal, predicted)) {
    Log(2, "device %d: a launch refused: its kernel needs %llu bytes more local memory than the slice has left",
        ordinal, static_cast<unsigned long long>(predicted));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult result = launch();
  std::lock_guard<std::mutex> guard(dm.mutex);
  if (result == CUDA_SUCCESS) {
    Recorded([&] { dm.launched.insert(key); });
    recent = key;
  }
  // The prediction settles to what the driver took (kept as it is if the reconciliation is put off).
  ReconcileLocked(dm, ordinal);
  if (predicted != 0 && dm.growth[ordinal] > before + predicted) {
    Log(3, "device %d: a first launch took %llu bytes (predicted %llu)", ordinal,
        static_cast<unsigned long long>(dm.growth[ordinal] - before), static_cast<unsigned long long>(predicted));
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
  g_driver_memory.store(nullptr, std::memory_order_release);  // the parent's stays allocated (see above)
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
  // The parent's other threads, inside a memory hook at the fork, are not here: only this thread's nesting is.
  g_operations_in_flight.store(t_operations, std::memory_order_release);
}

}  // namespace vgpu::hooks

using namespace vgpu::hooks;

// ---- the calls that grow or shrink the driver's own memory -------------------------------------------------------

namespace {

// The current context's device, when its memory is limited; -1 otherwise (`error`: the driver's, when it could not
// tell the device of a current context).
int TrackedOrdinal(CUresult& error) {
  const int ordinal = CurrentOrdinal(error);
  return ordinal >= 0 && ordinal < vgpu::policy::kMaxDevices && MemoryLimit(ordinal) != 0 ? ordinal : -1;
}

}  // namespace

// The stack is local memory for every thread the device holds, resized at once (H100: 16 -> 32 KiB a thread took
// 4224 MiB more): a larger one is charged first and refused when it does not fit. The heap is taken at the first
// kernel using it (reconciled then); the printf FIFO is not device memory (H100: 64 MiB set, nothing taken).
extern "C" VGPU_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuCtxSetLimit, limit, value);
  CUresult unknown = CUDA_SUCCESS;
  const int ordinal = TrackedOrdinal(unknown);
  if (unknown != CUDA_SUCCESS) return unknown;  // a device that cannot be told: refused, never grown uncounted
  if (ordinal < 0) return Real::cuCtxSetLimit(limit, value);
  if (limit != CU_LIMIT_STACK_SIZE) {
    const CUresult result = Real::cuCtxSetLimit(limit, value);
    ReconcileDriverMemory(ordinal);
    return result;
  }
  // What the stack takes now and would take: a call needed to tell is refused with its error when it fails.
  std::size_t stack = 0;
  if (Real::cuCtxGetLimit == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (const CUresult got = Real::cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE); got != CUDA_SUCCESS) return got;
  std::uint64_t threads = 0;
  if (value > stack) {
    if (const CUresult got = ThreadsResident(ordinal, threads); got != CUDA_SUCCESS) return got;
  }
  const std::uint64_t predicted = value > stack ? (value - stack) * threads : 0;
  if (!ChargeDriverGrowth(ordinal, predicted)) {
    Log(2, "device %d: a stack limit of %zu bytes refused: it needs %llu bytes more than the slice has left", ordinal,
        value, static_cast<unsigned long long>(predicted));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult result = Real::cuCtxSetLimit(limit, value);
  // Settled to the measurement: a smaller stack gives memory back, a refused call its prediction.
  ReconcileDriverMemory(ordinal);
  return result;
}
VGPU_CUDA_CATCH
