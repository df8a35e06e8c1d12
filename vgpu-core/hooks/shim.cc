// The shim's process state: one-time initialization (configuration, region, real functions), fork handling,
// the device map (CUDA ordinal -> region device by UUID) and the charge/uncharge primitives of the ledger.
#include "shim.h"

#include "driver_memory.h"

#include <time.h>

#include <fcntl.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>

#include "vgpu/base/clock.h"
#include "vgpu/verdict/verdict_file.h"

namespace vgpu::hooks {
namespace {

alignas(Shim) unsigned char g_shim_storage[sizeof(Shim)];
std::atomic<Shim*> g_shim{nullptr};
std::atomic<int> g_create_lock{0};
thread_local bool t_initializing = false;

// At the process's exit (a library destructor, run by exit() or a return from main; not at a kill): its slot in
// HAMi-core's part of the region file stops counting for HAMi's monitor, as HAMi-core's exit handler frees its own
// (docs/hami-cache.md). The region's slot waits for the reaper, as before.
__attribute__((destructor)) void LeaveHamiMirrorAtExit() {
  Shim* shim = g_shim.load(std::memory_order_acquire);
  if (shim != nullptr && shim->region != nullptr) shim->region->LeaveMirror();
}

void AfterForkInChild() {
  // The child runs one thread. Its CUDA state is its own: the parent's allocations and contexts stay the
  // parent's, and the child takes its own region slot at its next charge.
  Shim* old = g_shim.load(std::memory_order_relaxed);
  if (old == nullptr) return;
  region::Attachment* attachment = old->region;
  policy::Config config = old->config;
  const Mode mode = old->mode.load(std::memory_order_relaxed);
  const bool compute_limits = old->compute_limits, memory_limits = old->memory_limits;
  // Rebuild in place (the parent's mutexes may have been held by threads that do not exist here); the
  // parent's maps are leaked on purpose: their destructors could touch locked heap state.
  Shim* fresh = new (g_shim_storage) Shim();
  fresh->config = std::move(config);
  fresh->region = attachment;
  fresh->compute_limits = compute_limits;
  fresh->memory_limits = memory_limits;
  for (int& device : fresh->region_device) device = -1;
  if (attachment != nullptr) attachment->ForgetAfterFork();
  ForgetLaunchBooksAfterFork();
  ForgetDriverMemoryAfterFork();
  ForgetHamiFeedbackAfterFork();
  fresh->mode.store(mode, std::memory_order_release);
}

}  // namespace

namespace {}  // namespace

std::uint64_t MonotonicNs() { return base::HostMonotonicNs(); }

Shim& TheShim() {
  Shim* shim = g_shim.load(std::memory_order_acquire);
  if (shim != nullptr) return *shim;
  // A spin lock: this runs before anything else of ours exists, possibly inside a dlsym call.
  while (g_create_lock.exchange(1, std::memory_order_acquire) != 0) {
  }
  shim = g_shim.load(std::memory_order_relaxed);
  if (shim == nullptr) {
    shim = new (g_shim_storage) Shim();
    for (int& device : shim->region_device) device = -1;
    pthread_atfork(nullptr, nullptr, &AfterForkInChild);
    g_shim.store(shim, std::memory_order_release);
  }
  g_create_lock.store(0, std::memory_order_release);
  return *shim;
}

Shim* TheShimIfMade() { return g_shim.load(std::memory_order_acquire); }

void SleepUntilNs(std::uint64_t deadline) {
  const auto own = static_cast<std::uint64_t>(static_cast<std::int64_t>(deadline) + base::MonotonicOffsetNs());
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(own / 1'000'000'000ull);
  ts.tv_nsec = static_cast<long>(own % 1'000'000'000ull);
  // The thread is the application's: its timer slack (50 us by default) would let each of the shim's short sleeps
  // (polls of 10-20 us while another container's work drains) overshoot by that much, and the GPU idles meanwhile.
  // The shim sleeps with a slack of 1 us and gives the thread its own back.
  const int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  const bool tightened =
      slack > static_cast<int>(kSleepSlackNs) && prctl(PR_SET_TIMERSLACK, kSleepSlackNs, 0, 0, 0) == 0;
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
  if (tightened) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack), 0, 0, 0);
}

void Log(int level, const char* format, ...) {
  Shim& shim = TheShim();
  if (level > shim.config.log_level) return;
  char message[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof message, format, args);
  va_end(args);
  std::fprintf(stderr, "vgpu[%d]: %s\n", static_cast<int>(getpid()), message);
}

namespace {

std::atomic<bool> g_exception_logged{false};

// Which exception is in flight: out of memory or anything else (caller is inside a catch block).
bool OutOfMemoryInFlight() noexcept {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return true;
  } catch (...) {
    return false;
  }
}

void LogFirstException(bool out_of_memory) noexcept {
  if (g_exception_logged.exchange(true, std::memory_order_relaxed)) return;
  // No Log(): it could be what failed. fprintf on a constant string allocates nothing of ours.
  std::fprintf(stderr,
               "vgpu[%d]: %s inside a CUDA/NVML call: the call failed with an error, the process goes on "
               "(further ones are not logged)\n",
               static_cast<int>(getpid()), out_of_memory ? "out of host memory" : "an internal error");
}

}  // namespace

CUresult CudaErrorOfException() noexcept {
  const bool out_of_memory = OutOfMemoryInFlight();
  LogFirstException(out_of_memory);
  return out_of_memory ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;
}

nvmlReturn_t NvmlErrorOfException() noexcept {
  const bool out_of_memory = OutOfMemoryInFlight();
  LogFirstException(out_of_memory);
  return out_of_memory ? NVML_ERROR_MEMORY : NVML_ERROR_UNKNOWN;
}

namespace {

// The configuration as it was when the process started: read in a constructor, before the program's own code runs,
// so that a program cannot raise its limits by changing its environment before its first CUDA call (a setenv of
// CUDA_DEVICE_MEMORY_LIMIT in Python before cuInit did exactly that: tests/python/test_bypass.py). Only the
// environment and the configuration file are read here (no CUDA, no region); an error is kept and reported when the
// process first uses the GPU, so processes that never do (a shell) print nothing.
struct CapturedConfig {
  bool captured = false;
  bool ok = false;
  policy::Config config;
  std::string error;
};
CapturedConfig& Captured() {
  static CapturedConfig captured;
  return captured;
}

__attribute__((constructor)) void CaptureConfigurationAtStart() {
  CapturedConfig& captured = Captured();
  try {
    captured.ok = policy::LoadConfig(captured.config, captured.error);
  } catch (...) {
    // Out of memory before main: no limit could be read, so none is known to be absent. The process fails closed
    // at its first GPU call (a throw here would end the process while the loader runs us).
    captured.ok = false;
    captured.error.clear();
  }
  captured.captured = true;
}

// The captured configuration, or a fresh read where the constructor did not run.
bool StartConfig(policy::Config& config, std::string& error) {
  const CapturedConfig& captured = Captured();
  if (!captured.captured) return policy::LoadConfig(config, error);
  config = captured.config;
  error = captured.error;
  return captured.ok;
}

// The mode the process starts in: configuration, region, real functions (may throw std::bad_alloc).
Mode StartMode(Shim& shim);

}  // namespace

Mode Initialize() {
  Shim& shim = TheShim();
  if (t_initializing) return Mode::passthrough;  // re-entered from inside initialization: reach the driver
  std::lock_guard<std::mutex> guard(shim.init_mutex);
  Mode mode = shim.mode.load(std::memory_order_acquire);
  if (mode != Mode::uninitialized) return mode;
  // Reset however this ends: a thread left "initializing" would reach the driver with no limit from then on.
  struct Initializing {
    Initializing() { t_initializing = true; }
    ~Initializing() { t_initializing = false; }
  };
  try {
    Initializing initializing;
    mode = StartMode(shim);
  } catch (...) {
    // Out of host memory while starting: this call is refused (fail closed), and the next one starts again.
    (void)CudaErrorOfException();
    return Mode::failed;
  }
  shim.mode.store(mode, std::memory_order_release);
  if (mode == Mode::limited)
    Log(3, "limits from %s, region %s", shim.config.source.c_str(), shim.config.region_path.c_str());
  if (mode == Mode::limited && shim.config.oversubscribe) {
    Log(2,
        "CUDA_OVERSUBSCRIBE=true: memory oversubscription (spilling to host memory) is not supported; the memory "
        "limits hold as given (docs/hami-env.md)");
  }
  return mode;
}

namespace {

Mode StartMode(Shim& shim) {
  Mode mode = Mode::uninitialized;
  std::string error;
  if (!ResolveReal()) {
    // No driver at all: nothing to protect; hooks report what the missing driver would.
    mode = Mode::passthrough;
  } else if (!StartConfig(shim.config, error)) {
    if (error.empty())
      error = "vgpu: the configuration could not be read (out of host memory when the process started)";
    std::fprintf(stderr, "%s (pid %d); GPU access is refused (fail closed)\n", error.c_str(),
                 static_cast<int>(getpid()));
    mode = Mode::failed;
  } else if (!shim.config.AnyLimit()) {
    mode = Mode::passthrough;
  } else {
    std::string replaced;
    shim.region = region::Attachment::Open(shim.config.region_path, error, &replaced);
    if (!replaced.empty()) Log(1, "%s", replaced.c_str());
    if (shim.region == nullptr) {
      std::fprintf(stderr, "vgpu[%d]: %s; GPU access is refused (fail closed)\n", static_cast<int>(getpid()),
                   error.c_str());
      mode = Mode::failed;
    } else {
      mode = Mode::limited;
      shim.region->SetPriorityForMonitoring(shim.config.task_priority);
      shim.memory_limits = std::any_of(shim.config.memory_limit_bytes.begin(), shim.config.memory_limit_bytes.end(),
                                       [](std::uint64_t bytes) { return bytes != 0; });
      shim.compute_limits = shim.config.policy == policy::ComputePolicy::disable ||
                            std::any_of(shim.config.sm_limit_percent.begin(), shim.config.sm_limit_percent.end(),
                                        [](std::uint32_t percent) { return percent != 0; });
    }
  }
  return mode;
}

}  // namespace

std::uint64_t MemoryLimit(int ordinal) {
  if (ordinal < 0 || ordinal >= policy::kMaxDevices) return 0;
  return TheShim().config.memory_limit_bytes[static_cast<std::size_t>(ordinal)];
}

int RegionDevice(int ordinal, CUresult* error) {
  Shim& shim = TheShim();
  if (error != nullptr) *error = CUDA_ERROR_NO_DEVICE;
  if (ordinal < 0 || ordinal >= policy::kMaxDevices || shim.region == nullptr) return -1;
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (shim.region_device[ordinal] >= 0) return shim.region_device[ordinal];
  }
  CUdevice device = 0;
  CUuuid uuid{};
  if (Real::cuDeviceGet == nullptr || Real::cuDeviceGetUuid_v2 == nullptr) return -1;
  CUresult result = Real::cuDeviceGet(&device, ordinal);
  if (result == CUDA_SUCCESS) result = Real::cuDeviceGetUuid_v2(&uuid, device);
  if (result != CUDA_SUCCESS) {
    if (error != nullptr) *error = result;
    return -1;
  }
  return RegionDeviceOfUuid(ordinal, reinterpret_cast<const std::uint8_t*>(uuid.bytes));
}

int RegionDeviceOfUuid(int ordinal, const std::uint8_t uuid[16]) {
  Shim& shim = TheShim();
  if (ordinal < 0 || ordinal >= policy::kMaxDevices || shim.region == nullptr) return -1;
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (shim.region_device[ordinal] >= 0) return shim.region_device[ordinal];
  }
  const int index = shim.region->DeviceIndex(uuid);
  if (index >= 0) {
    const std::uint64_t limit = MemoryLimit(ordinal);
    if (limit != 0) shim.region->SetLimitForMonitoring(index, limit);
    shim.region->SetSmLimitForMonitoring(index, shim.config.sm_limit_percent[static_cast<std::size_t>(ordinal)]);
    const std::string text = verdict::UuidText(uuid);
    std::lock_guard<std::mutex> guard(shim.mutex);
    shim.region_device[ordinal] = index;
    std::snprintf(shim.device_uuid[ordinal], sizeof shim.device_uuid[ordinal], "%s", text.c_str());
  }
  return index;
}

int CurrentOrdinal() {
  CUresult error = CUDA_SUCCESS;
  return CurrentOrdinal(error);
}

int CurrentOrdinal(CUresult& error) {
  error = CUDA_SUCCESS;
  CUdevice device = -1;
  if (Real::cuCtxGetDevice == nullptr) return -1;
  const CUresult result = Real::cuCtxGetDevice(&device);
  if (result == CUDA_SUCCESS && device >= 0) return device;
  // No current context is the caller's mistake, for the driver to report. Anything else (a failing driver, a
  // context the driver says exists but whose device it will not tell) leaves the device unknown.
  CUcontext context = nullptr;
  if (Real::cuCtxGetCurrent != nullptr && Real::cuCtxGetCurrent(&context) == CUDA_SUCCESS && context == nullptr) {
    return -1;
  }
  error = result != CUDA_SUCCESS ? result : CUDA_ERROR_INVALID_DEVICE;
  return -1;
}

namespace {

using base::RealtimeNs;

// What the shim last said about the verdict (one log line per change).
enum VerdictState { kVerdictUsed, kVerdictMissing, kVerdictUnreadable, kVerdictMalformed, kVerdictStale, kVerdictBack };

// Reads the verdict again if kVerdictReadNs have passed (nothing is allocated until then). Caller holds
// monitor.mutex.
void RefreshVerdict(const char* path, MonitorVerdict& monitor) {
  const std::uint64_t now = MonotonicNs();
  if (monitor.read_ns != 0 && now - monitor.read_ns < kVerdictReadNs) return;
  monitor.read_ns = now;
  monitor.usable = false;
  std::string text, error;
  bool missing = false;
  VerdictState state = kVerdictUsed;
  verdict::Verdict read;
  if (!verdict::ReadWhole(path, text, missing, error)) {
    state = missing ? kVerdictMissing : kVerdictUnreadable;
  } else if (!verdict::Parse(text, read, error)) {
    state = kVerdictMalformed;
  } else if (!verdict::IsFresh(read.stamp_ns, RealtimeNs())) {
    state = kVerdictStale;
  } else if (read.seq < monitor.seq) {
    state = kVerdictBack;
  }
  if (state != monitor.reported) {
    static const char* const kSaid[] = {"in use",
                                        "missing",
                                        "unreadable",
                                        "malformed",
                                        "stale (older than 1 s, or "
                                        "stamped ahead of this host's clock)",
                                        "going back (its seq is lower than one "
                                        "already used)"};
    // A missing verdict is the usual case without a monitor: said only at level 3; the others at 2.
    Log(state == kVerdictMissing || state == kVerdictUsed ? 3 : 2, "the node monitor's verdict %s is %s%s%s", path,
        kSaid[state], error.empty() || state == kVerdictMissing ? "" : ": ",
        state == kVerdictMissing ? "" : error.c_str());
    monitor.reported = state;
  }
  if (state != kVerdictUsed) return;
  monitor.seq = read.seq;
  monitor.verdict = std::move(read);
  monitor.usable = true;
}

}  // namespace

namespace {

// Runs `f(verdict, uuid)` on the node monitor's verdict if one is usable now, for device `ordinal` once RegionDevice
// has named it; false otherwise (f's result else).
template <typename F>
bool WithVerdict(int ordinal, F&& f) {
  Shim& shim = TheShim();
  const std::optional<std::string>& configured = shim.config.verdict_path;
  if ((configured && configured->empty()) || ordinal < 0 || ordinal >= policy::kMaxDevices) return false;
  char uuid[sizeof shim.device_uuid[0]];
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    std::memcpy(uuid, shim.device_uuid[ordinal], sizeof uuid);
  }
  if (uuid[0] == '\0') return false;
  std::lock_guard<std::mutex> guard(shim.monitor.mutex);
  RefreshVerdict(configured ? configured->c_str() : policy::kDefaultVerdictFile, shim.monitor);
  return shim.monitor.usable && f(shim.monitor.verdict, static_cast<const char*>(uuid));
}

}  // namespace

bool VerdictOf(int ordinal, DeviceVerdict& out) {
  return WithVerdict(ordinal, [&](const verdict::Verdict& said, const char* uuid) {
    const verdict::Device* line = said.FindDevice(uuid);
    if (line == nullptr) return false;
    out = DeviceVerdict{line->memory_limit, line->memory_used, line->sm_limit, line->sm_used, said.stamp_ns};
    return true;
  });
}

bool VerdictOwnSm(int ordinal, std::uint32_t& permille) {
  return WithVerdict(ordinal, [&](const verdict::Verdict& said, const char* uuid) {
    const verdict::Process* line = said.FindProcess(static_cast<std::uint32_t>(getpid()), uuid);
    if (line == nullptr) return false;
    permille = line->sm_used;
    return true;
  });
}

std::uint64_t FreeOfSlice(std::uint64_t total, std::uint64_t used) {
  const std::uint64_t usable = total - std::min(total, TheShim().config.driver_headroom_bytes);
  return used >= usable ? 0 : usable - used;
}

bool Charge(int ordinal, std::uint64_t bytes, bool for_the_driver) {
  Shim& shim = TheShim();
  if (bytes == 0) return true;
  const int device = RegionDevice(ordinal);
  if (device < 0) {
    // A device we cannot name is one no limit can be enforced on: refuse rather than let it through uncounted.
    return MemoryLimit(ordinal) == 0;
  }
  // The driver's figures for the whole container, from the node monitor: over its limit there (colluding processes,
  // private entry points), nothing more is allocated through the hooks, whatever the region says.
  if (DeviceVerdict said; VerdictOf(ordinal, said) && said.MemoryOver()) {
    Log(2, "device %d: %llu bytes refused: the node monitor shows the container holding %llu of %llu bytes", ordinal,
        static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(said.memory_used),
        static_cast<unsigned long long>(said.memory_limit));
    shim.region->CountRefusedAllocation(device);  // (for the node monitor's metrics: docs/metrics.md)
    return false;
  }
  std::uint64_t limit = MemoryLimit(ordinal);
  if (limit == 0)
    limit = UINT64_MAX;  // counted, not limited: another device of the process has a limit
  else if (!for_the_driver)
    limit -= std::min(limit, shim.config.driver_headroom_bytes);
  ReconcileDriverMemoryIfDue(ordinal);  // the driver's own memory: at most every 100 ms
  if (shim.region->Reserve(device, bytes, limit)) return true;
  // Pools may hold memory the driver has since trimmed: give it back and try once more.
  if (ReconcilePools() && shim.region->Reserve(device, bytes, limit)) return true;
  Log(2, "device %d: %llu bytes refused: the container uses %llu of %llu", ordinal,
      static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(shim.region->Used(device)),
      static_cast<unsigned long long>(limit));
  shim.region->CountRefusedAllocation(device);
  return false;
}

void Uncharge(int ordinal, std::uint64_t bytes) {
  Shim& shim = TheShim();
  const int device = RegionDevice(ordinal);
  if (device >= 0 && bytes > 0) shim.region->Release(device, bytes);
}

std::uint64_t Used(int ordinal) { return UsedOnRegionDevice(RegionDevice(ordinal)); }

std::uint64_t UsedOnRegionDevice(int device) {
  Shim& shim = TheShim();
  return device >= 0 && shim.region != nullptr ? shim.region->Used(device) : 0;
}

bool ReconcilePools() {
  std::lock_guard<std::mutex> guard(TheShim().mutex);
  return ReconcilePoolsLocked();
}

bool ReconcilePoolsLocked() {
  Shim& shim = TheShim();
  if (Real::cuMemPoolGetAttribute == nullptr) return false;
  bool gave_back = false;
  for (auto& [pool, charge] : shim.pools) {
    if (charge.destroyed) continue;  // not a handle any more
    cuuint64_t reserved = 0;
    if (Real::cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS) continue;
    if (reserved < charge.charged) {
      Log(4, "pool %p: reconciled, charged %llu -> %llu", static_cast<void*>(pool),
          static_cast<unsigned long long>(charge.charged), static_cast<unsigned long long>(reserved));
      const int device = shim.region_device[charge.ordinal];
      if (device >= 0) shim.region->Release(device, charge.charged - reserved);
      charge.charged = reserved;
      gave_back = true;
    }
  }
  return gave_back;
}

}  // namespace vgpu::hooks
