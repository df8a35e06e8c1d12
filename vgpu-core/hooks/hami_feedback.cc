// HAMi's monitor's side of a launch (docs/hami-cache.md): HAMi-core's part of the region file says that the
// container launches, when, and how much of each GPU this process used; and HAMi's monitor's feedback is obeyed
// (recent_kernel -1 holds launches). The region keeps the fields (region/hami_v1.h); this file decides when to write
// and read them.
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "driver_memory.h"
#include "launch.h"
#include "shim.h"

namespace vgpu::hooks {
namespace {

constexpr std::uint64_t kHoldPollNs = 10'000'000;  // a held launch looks at recent_kernel again every 10 ms
constexpr std::int64_t kIdleAfterS = 2;            // no share published for this long: the process reads as idle

// The second of the last publication (CLOCK_REALTIME_COARSE), claimed by one launching thread per second.
std::atomic<std::int64_t> g_published_s{0};
std::atomic<bool> g_watcher_started{false};
// What each device's limiter had spent at the last publication, and when (monotonic ns). Only the thread that
// claimed the second touches them (the claim's exchange orders one publication after the one before).
std::int64_t g_spent_at[policy::kMaxDevices] = {};
std::uint64_t g_published_ns = 0;

// The region's device index of `ordinal`, or -1 if this process never named it (never looked up here: naming a
// device adds it to the region).
int NamedDevice(Shim& shim, int ordinal) {
  std::lock_guard<std::mutex> guard(shim.mutex);
  return shim.region_device[ordinal];
}

// This process's share of `ordinal` in percent since the last publication (`elapsed_ns` ago): what its limiter
// accounted its launches where a compute cap is set; else what the node monitor's verdict says it used (NVML's
// per-process samples, read on the host); else nothing known (-1).
int ShareOf(int ordinal, std::uint64_t elapsed_ns) {
  launch::DeviceLimiter& d = launch::g_devices[ordinal];
  if (d.ready.load(std::memory_order_acquire) && d.limiter) {
    const std::int64_t spent = d.limiter->spent_ns();
    const std::int64_t used = spent - std::exchange(g_spent_at[ordinal], spent);
    if (elapsed_ns == 0) return -1;  // the first publication: a baseline only
    return static_cast<int>(std::clamp<std::int64_t>(used * 100 / static_cast<std::int64_t>(elapsed_ns), 0, 100));
  }
  std::uint32_t permille = 0;
  if (VerdictOwnSm(ordinal, permille)) return static_cast<int>(std::min<std::uint32_t>((permille + 5) / 10, 100));
  return -1;
}

// What `ordinal`'s contexts of this process hold (the primary and explicit ones), under the shim's mutex.
std::uint64_t ContextBytesOn(Shim& shim, int ordinal) {
  std::lock_guard<std::mutex> guard(shim.mutex);
  std::uint64_t bytes = shim.primary_bytes[ordinal];
  for (const auto& [handle, context] : shim.contexts) {
    if (context.ordinal == ordinal) bytes += context.bytes;
  }
  return bytes;
}

void PublishShares(Shim& shim) {
  const std::uint64_t now = MonotonicNs();
  const std::uint64_t elapsed = g_published_ns == 0 ? 0 : now - g_published_ns;
  g_published_ns = now;
  for (int ordinal = 0; ordinal < policy::kMaxDevices; ++ordinal) {
    const int device = NamedDevice(shim, ordinal);
    if (device < 0) continue;
    const int percent = ShareOf(ordinal, elapsed);
    if (percent >= 0) shim.region->SetUtilizationForMonitoring(device, static_cast<std::uint32_t>(percent));
    shim.region->SetBreakdownForMonitoring(device, ContextBytesOn(shim, ordinal), DriverGrowth(ordinal));
  }
}

// A process that stops launching publishes nothing more: this thread sets its shares to 0 once no launch has
// published one for kIdleAfterS (HAMi's monitor would otherwise show the last busy second for ever; a process that
// launches less often than that reads 0 between its launches). It touches only
// the region's mapping (kept for the life of the process) and static atomics, so it is safe to run through exit.
void* WatchIdle(void*) {
  for (;;) {
    const timespec second{1, 0};
    nanosleep(&second, nullptr);
    timespec ts{};
    clock_gettime(CLOCK_REALTIME_COARSE, &ts);
    const std::int64_t published = g_published_s.load(std::memory_order_acquire);
    if (published == 0 || ts.tv_sec - published < kIdleAfterS) continue;
    Shim* shim = TheShimIfMade();
    if (shim == nullptr || shim->region == nullptr) continue;
    for (int device = 0; device < static_cast<int>(region::kMaxDevices); ++device) {
      shim->region->SetUtilizationForMonitoring(device, 0);
    }
  }
  return nullptr;
}

// The idle watcher, started once per process (again in a fork child), with every signal blocked: it must never run
// the application's handlers.
void StartIdleWatcher() {
  if (g_watcher_started.exchange(true, std::memory_order_acq_rel)) return;
  pthread_attr_t attributes;
  if (pthread_attr_init(&attributes) != 0) return;
  sigset_t blocked;
  sigfillset(&blocked);
  for (const int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT}) sigdelset(&blocked, fault);
  pthread_t thread;
  if (pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED) != 0 ||
      pthread_attr_setsigmask_np(&attributes, &blocked) != 0 ||
      pthread_create(&thread, &attributes, &WatchIdle, nullptr) != 0) {
    Log(2, "no idle watcher (pthread_create failed): HAMi's monitor keeps the last published share of an idle process");
  }
  pthread_attr_destroy(&attributes);
}

// recent_kernel is -1: HAMi's monitor holds the container for a container of a higher priority. Waits until it is
// not (HAMi-core waits the same, unbounded: the monitor sets it back once the other is idle).
void HoldWhileHamiHolds(Shim& shim) {
  const std::uint64_t from = MonotonicNs();
  Log(2, "launches held: HAMi's monitor says a container of a higher priority is active (recent_kernel -1 in %s)",
      shim.region->path().c_str());
  while (shim.region->HamiHoldsLaunches()) SleepUntilNs(MonotonicNs() + kHoldPollNs);
  Log(2, "launches go on: HAMi's monitor held them %llu ms", (MonotonicNs() - from) / 1'000'000ull);
}

}  // namespace

void BeforeLaunch() {
  Shim* shim = TheShimIfMade();
  if (shim == nullptr || shim->region == nullptr) return;
  if (shim->region->HamiHoldsLaunches()) HoldWhileHamiHolds(*shim);
  // The coarse clock (the kernel's last tick, read from the vDSO's page: a few ns) on every launch: a thread that
  // launches seldom still publishes every second it launches in, so that a busy process never reads as idle.
  timespec ts{};
  clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  const std::int64_t now_s = static_cast<std::int64_t>(ts.tv_sec);
  std::int64_t last = g_published_s.load(std::memory_order_acquire);
  if (last == now_s || !g_published_s.compare_exchange_strong(last, now_s, std::memory_order_acq_rel)) return;
  shim->region->MarkLaunch(now_s);
  PublishShares(*shim);
  StartIdleWatcher();
}

void PublishMemoryBreakdown(int ordinal) {
  Shim* shim = TheShimIfMade();
  if (shim == nullptr || shim->region == nullptr || ordinal < 0 || ordinal >= policy::kMaxDevices) return;
  const int device = NamedDevice(*shim, ordinal);
  if (device >= 0)
    shim->region->SetBreakdownForMonitoring(device, ContextBytesOn(*shim, ordinal), DriverGrowth(ordinal));
}

void ForgetHamiFeedbackAfterFork() {
  g_published_s.store(0, std::memory_order_relaxed);
  g_watcher_started.store(false, std::memory_order_relaxed);
  g_published_ns = 0;
  for (std::int64_t& spent : g_spent_at) spent = 0;
}

}  // namespace vgpu::hooks
