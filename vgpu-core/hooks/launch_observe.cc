// The launch path's "observe" stage (launch.h): what others say about the container's use of the GPU. The node
// monitor's verdict scales the process's rate; under `default`, NVML's reading of the others' use lets the limiter
// lend the GPU's idle time.
#include <time.h>

#include <algorithm>
#include <cstdio>

#include "compute_area.h"
#include "launch.h"
#include "vgpu/base/clock.h"
#include "vgpu/base/uuid.h"
#include "vgpu/verdict/verdict.h"

namespace vgpu::hooks::launch {
namespace {

constexpr std::uint64_t kObserveOthersEveryNs = 100'000'000;
// How often the launch path looks at the node monitor's verdict (read from its file at most every kVerdictReadNs).
constexpr std::uint64_t kVerdictCheckNs = 20'000'000;
// `default`: without a reading of the others' use for this long, the GPU is no longer known to be free.
constexpr std::uint64_t kStaleReadingNs = 1'000'000'000;
constexpr std::uint64_t kNvmlRetryNs = 1'000'000'000;  // `default`: NVML that failed to start is asked again
// NVML sample timestamps further ahead of the wall clock than this are not readings but garbage.
constexpr unsigned long long kFutureSampleUs = 1'000'000;

// NVML's utilization samples seen so far, per device ordinal (CPU timestamps in microseconds).
struct SampleCursor {
  std::mutex mutex;
  unsigned long long newest_us = 0;  // the newest sample's timestamp, 0 = none yet
  bool unsupported = false;          // nvmlDeviceGetSamples does not give utilization samples here
};
SampleCursor g_sample_cursors[policy::kMaxDevices];

using base::RealtimeNs;

// Others' busy fraction over NVML's newest utilization sample period: the device's busy percent over that period
// minus the container's own measured busy time over the same period (BusyFraction; docs/compute-limit.md,
// "default"). Comparing periods that do not match makes a lone container flip between free and held (sim finding
// 3). -2: no new sample since the last call (keep the rate); -1: samples are not available.
double OthersBusyOverNvmlSamples(int ordinal, nvmlDevice_t handle, const policy::BudgetCell& cell, std::uint64_t now,
                                 std::uint64_t& period_start) {
  SampleCursor& cursor = g_sample_cursors[ordinal];
  std::lock_guard<std::mutex> guard(cursor.mutex);
  if (cursor.unsupported || Real::nvmlDeviceGetSamples == nullptr) return -1;
  nvmlSample_t samples[64];
  unsigned int count = 64;
  nvmlValueType_t type = NVML_VALUE_TYPE_UNSIGNED_INT;
  const nvmlReturn_t r =
      Real::nvmlDeviceGetSamples(handle, NVML_GPU_UTILIZATION_SAMPLES, cursor.newest_us, &type, &count, samples);
  if (r == NVML_ERROR_NOT_FOUND) return -2;
  if (r != NVML_SUCCESS || type != NVML_VALUE_TYPE_UNSIGNED_INT || count == 0 || count > 64) {
    cursor.unsupported = r == NVML_ERROR_NOT_SUPPORTED || r == NVML_ERROR_FUNCTION_NOT_FOUND;
    return -1;
  }
  // The newest sample covers the time since the one before it (returned with it, or seen last time). Samples from
  // the future (garbage: they would hold the cursor past every real sample to come) or not newer than the cursor
  // (time going backwards) are not readings.
  const unsigned long long now_us = RealtimeNs() / 1000;
  unsigned long long newest = 0, before = cursor.newest_us;
  unsigned int value = 0;
  for (unsigned int i = 0; i < count; ++i) {
    const unsigned long long stamp = samples[i].timeStamp;
    if (stamp <= cursor.newest_us || stamp > now_us + kFutureSampleUs) continue;
    if (stamp > newest) {
      before = std::max(before, newest);
      newest = stamp;
      value = samples[i].sampleValue.uiVal;
    } else {
      before = std::max(before, stamp);
    }
  }
  if (newest == 0) return -2;  // nothing new that can be read
  cursor.newest_us = newest;
  if (before == 0 || before >= newest || value > 100) return -2;  // no period yet, or a value we cannot read
  // CPU timestamps are wall-clock time; the buckets are on the monotonic clock.
  const std::int64_t offset_ns = static_cast<std::int64_t>(RealtimeNs()) - static_cast<std::int64_t>(now);
  const std::int64_t from = static_cast<std::int64_t>(before * 1000) - offset_ns;
  const std::int64_t to = static_cast<std::int64_t>(newest * 1000) - offset_ns;
  if (from <= 0 || to <= from) return -2;
  const double own =
      policy::Limiter::BusyFraction(cell, static_cast<std::uint64_t>(from), static_cast<std::uint64_t>(to));
  period_start = static_cast<std::uint64_t>(from);
  return std::max(0.0, value / 100.0 - own);
}

// `default` policy: every 100 ms, the fraction of the GPU others are using, or a negative value when there is no
// new reading. From NVML's samples where the driver gives them; otherwise NVML's current utilization minus the
// container's published share (which lags: a lone container then runs free only part of the time). Called
// without d.mutex: NVML may take its time, and launching threads must not wait on it.
// `period_start`: where the period the reading describes begins (monotonic ns).
double OthersBusy(int ordinal, std::uint64_t now, std::uint64_t& period_start) {
  // NVML may fail to start at first (a driver still loading): asked again at most once a second, so that one failed
  // nvmlInit does not end lending for the life of the process (until NVML answers, the container is held to its share).
  static std::atomic<bool> nvml_ready{false};
  if (!nvml_ready.load(std::memory_order_acquire)) {
    static std::mutex nvml_mutex;
    static std::uint64_t nvml_tried_ns = 0;
    std::lock_guard<std::mutex> guard(nvml_mutex);
    if (nvml_tried_ns != 0 && now < nvml_tried_ns + kNvmlRetryNs) return -1;
    nvml_tried_ns = now;
    if (!ResolveRealNvml() || Real::nvmlDeviceGetHandleByUUID == nullptr ||
        Real::nvmlDeviceGetUtilizationRates == nullptr || Real::nvmlInit_v2() != NVML_SUCCESS) {
      return -1;
    }
    nvml_ready.store(true, std::memory_order_release);
  }
  CUdevice device = 0;
  CUuuid uuid{};
  if (Real::cuDeviceGet(&device, ordinal) != CUDA_SUCCESS || Real::cuDeviceGetUuid_v2(&uuid, device) != CUDA_SUCCESS)
    return -1;
  char text[base::kGpuUuidChars + 1];
  base::FormatGpuUuid(uuid.bytes, text);
  nvmlDevice_t handle = nullptr;
  if (Real::nvmlDeviceGetHandleByUUID(text, &handle) != NVML_SUCCESS) return -1;
  const int region_device = RegionDevice(ordinal);
  const policy::BudgetCell& cell = ComputeAreaOf(*TheShim().region, region_device).budget;
  const double from_samples = OthersBusyOverNvmlSamples(ordinal, handle, cell, now, period_start);
  if (from_samples != -1) return from_samples;
  period_start = now > 1'000'000'000 ? now - 1'000'000'000 : 0;  // the published share covers the last second
  nvmlUtilization_t utilization{};
  if (Real::nvmlDeviceGetUtilizationRates(handle, &utilization) != NVML_SUCCESS || utilization.gpu > 100) {
    return -1;  // no reading (or garbage): keep the current rate rather than guess
  }
  return std::max(0.0, utilization.gpu / 100.0 - policy::Limiter::PublishedShare(cell, now));
}

// The node monitor's verdict on the container's SM use (docs/node-monitor.md): at most once per window of its SM
// figures, it scales this process's own rate (policy::NextMonitorScale), so that processes that rewrite the region's
// cell together, or launch past the hooks, are held to the container's share together. No usable verdict: nothing
// changes.
void FollowVerdict(DeviceLimiter& d, int ordinal, std::uint64_t now) {
  DeviceVerdict said;
  if (!VerdictOf(ordinal, said)) return;
  const std::uint32_t used = said.sm_used, limit = said.sm_limit;
  const std::uint64_t stamp = said.stamp_ns;
  std::lock_guard<std::mutex> guard(d.mutex);
  // Once per window of the SM figures: the next verdicts still average in the use before this correction.
  if (d.verdict_stamp_ns != 0 && stamp < d.verdict_stamp_ns + verdict::kSmWindowNs) return;
  d.verdict_stamp_ns = stamp;
  const std::uint32_t before = d.limiter->own_scale_permille();
  const std::uint32_t after = policy::NextMonitorScale(before, used, limit);
  if (after == before) return;
  d.limiter->ScaleOwn(after, now);
  Log(after < before ? 2 : 3,
      "device %d: the node monitor shows the container at %u.%u %% of the SM time against "
      "%u.%u %%: this process's rate scaled to %u.%u %% of its share",
      ordinal, used / 10, used % 10, limit / 10, limit % 10, after / 10, after % 10);
}

// HAMi's monitor says another container is active on the container's GPUs (utilization_switch 1, where HAMi-core's
// `default` holds the cap): the container is held to its share whatever NVML reads, until it says 0. Its 0 lends
// nothing by itself (a file nobody's monitor writes reads 0): NVML's reading decides then, as without HAMi.
bool HamiSaysShared(DeviceLimiter& d, int ordinal, std::uint64_t now) {
  const bool shared = TheShim().region->HamiSaysShared();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (shared != d.hami_shared) {
    Log(2, "device %d: HAMi's monitor says %s (utilization_switch %d)", ordinal,
        shared ? "another container is active: held to the share" : "no other container is active", shared ? 1 : 0);
    d.hami_shared = shared;
  }
  if (shared) {
    d.last_reading_ns = now;
    d.limiter->ObserveOthers(1.0, now);
  }
  return shared;
}

// Under `default`, every kObserveOthersEveryNs: the others' use of the GPU, read from NVML, tells the limiter how
// much it may lend.
void ObserveOthers(DeviceLimiter& d, int ordinal, std::uint64_t now) {
  d.last_observed_ns = now;  // a benign race: at worst two threads read NVML in the same period
  if (HamiSaysShared(d, ordinal, now)) return;
  std::uint64_t period_start = 0;
  const double others = OthersBusy(ordinal, now, period_start);
  // A reading of a period that began before the container was held blind describes the free-running time before
  // it (the container's own busy time then, stretched by whoever arrived, hides them): not a reading of now.
  if (others >= 0 && period_start >= d.held_blind_ns) {
    d.last_reading_ns = now;
    std::lock_guard<std::mutex> guard(d.mutex);
    d.limiter->ObserveOthers(others, now);
  } else if (now >= d.last_reading_ns + kStaleReadingNs) {
    // No reading for a while (NVML failing, or answering what cannot be read): nobody can say the GPU is free, so
    // the container is held to its share until readings come back.
    if (d.held_blind_ns <= d.last_reading_ns) d.held_blind_ns = now;  // once per blind spell
    std::lock_guard<std::mutex> guard(d.mutex);
    d.limiter->ObserveOthers(1.0, now);
  }
}

}  // namespace

void Observe(DeviceLimiter& d, int ordinal, std::uint64_t now) {
  if (now >= d.verdict_checked_ns.load(std::memory_order_relaxed) + kVerdictCheckNs) {
    d.verdict_checked_ns.store(now, std::memory_order_relaxed);  // a benign race: two threads may both look
    FollowVerdict(d, ordinal, now);
  }
  if (d.lend && now >= d.last_observed_ns + kObserveOthersEveryNs) ObserveOthers(d, ordinal, now);
}

}  // namespace vgpu::hooks::launch
