// Compute caps on every launch path: each launch is admitted by the limiter (the container's GPU-time budget in
// the region), the launching thread sleeps to the exact moment the budget allows, and CUDA events around the
// kernel measure what it really cost (docs/compute-limit.md).
#include <time.h>

#include <deque>
#include <memory>
#include <vector>

#include "shim.h"
#include "vgpu/policy/limiter.h"

namespace vgpu::hooks {
namespace {

static_assert(sizeof(policy::BudgetCell) <= sizeof(region::Device::compute), "the budget must fit the region");

constexpr std::uint64_t kBurstNs = 20'000'000;
constexpr std::uint32_t kAlwaysMeasureFirst = 32;   // then one launch in kMeasureEvery per kernel
constexpr std::uint32_t kMeasureEvery = 8;
constexpr std::uint64_t kObserveOthersEveryNs = 100'000'000;

std::uint64_t NowNs() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

void SleepUntilNs(std::uint64_t deadline) {
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(deadline / 1'000'000'000ull);
  ts.tv_nsec = static_cast<long>(deadline % 1'000'000'000ull);
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

struct Pending {
  policy::KernelKey key;
  std::uint64_t charged_ns;
  CUevent start;
  CUevent end;
  CUcontext context;
};

// One per device ordinal this process launches on.
struct DeviceLimiter {
  std::mutex mutex;  // process-local; never held while sleeping or while the driver waits
  std::unique_ptr<policy::Limiter> limiter;
  std::deque<Pending> pending;
  std::unordered_map<CUcontext, std::vector<CUevent>> free_events;
  std::unordered_map<const void*, std::uint32_t> launches;  // per function, for measurement sampling
  std::uint64_t last_observed_ns = 0;
  bool lend = false;
};

DeviceLimiter g_devices[policy::kMaxDevices];
std::once_flag g_device_once[policy::kMaxDevices];

DeviceLimiter* LimiterFor(int ordinal) {
  if (ordinal < 0 || ordinal >= policy::kMaxDevices) return nullptr;
  Shim& shim = TheShim();
  const std::uint32_t percent = shim.config.sm_limit_percent[static_cast<std::size_t>(ordinal)];
  const bool disabled = shim.config.policy == policy::ComputePolicy::disable;
  if (percent == 0 && !disabled) return nullptr;  // no compute limit on this device
  const int device = RegionDevice(ordinal);
  if (device < 0) return nullptr;
  DeviceLimiter& d = g_devices[ordinal];
  std::call_once(g_device_once[ordinal], [&] {
    auto* cell = static_cast<policy::BudgetCell*>(shim.region->ComputeArea(device));
    const std::uint32_t share = percent == 0 ? 1000 : percent * 10;
    // The first process of the container to limit this device initializes the shared cell.
    std::atomic_ref<std::uint64_t> refilled(cell->refilled_at_ns);
    std::uint64_t expected = 0;
    if (refilled.load() == 0 && refilled.compare_exchange_strong(expected, 1)) {
      policy::Limiter::InitCell(*cell, share, kBurstNs, NowNs());
    }
    policy::LimiterConfig config;
    config.share_permille = share;
    config.burst_ns = kBurstNs;
    config.throttle = !disabled && percent != 0;
    config.lend_when_idle = shim.config.policy == policy::ComputePolicy::standard;
    d.lend = config.lend_when_idle;
    d.limiter = std::make_unique<policy::Limiter>(*cell, config);
  });
  return d.limiter ? &d : nullptr;
}

CUevent TakeEvent(DeviceLimiter& d, CUcontext context) {
  auto& pool = d.free_events[context];
  if (!pool.empty()) {
    CUevent event = pool.back();
    pool.pop_back();
    return event;
  }
  CUevent event = nullptr;
  if (Real::cuEventCreate == nullptr || Real::cuEventCreate(&event, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return nullptr;
  return event;
}

void ReturnEvent(DeviceLimiter& d, CUcontext context, CUevent event) {
  if (event != nullptr) d.free_events[context].push_back(event);
}

// Settles every measured launch that has completed (in order per device; a later one may wait for an earlier).
// Caller holds d.mutex.
void SettleCompleted(DeviceLimiter& d, std::uint64_t now) {
  while (!d.pending.empty()) {
    Pending& p = d.pending.front();
    const CUresult state = Real::cuEventQuery(p.end);
    if (state == CUDA_ERROR_NOT_READY) return;
    std::optional<std::uint64_t> measured;
    float ms = 0;
    if (state == CUDA_SUCCESS && Real::cuEventElapsedTime_v2(&ms, p.start, p.end) == CUDA_SUCCESS && ms >= 0) {
      measured = static_cast<std::uint64_t>(static_cast<double>(ms) * 1e6);
    }
    d.limiter->Settle(p.key, p.charged_ns, measured, now);
    ReturnEvent(d, p.context, p.start);
    ReturnEvent(d, p.context, p.end);
    d.pending.pop_front();
  }
}

// `default` policy: every 100 ms, tell the limiter how busy the GPU is with other containers' work.
void ObserveOthers(DeviceLimiter& d, int ordinal, std::uint64_t now) {
  if (!d.lend || now < d.last_observed_ns + kObserveOthersEveryNs) return;
  d.last_observed_ns = now;
  if (!ResolveRealNvml() || Real::nvmlDeviceGetHandleByUUID == nullptr || Real::nvmlDeviceGetUtilizationRates == nullptr) {
    return;
  }
  CUdevice device = 0;
  CUuuid uuid{};
  if (Real::cuDeviceGet(&device, ordinal) != CUDA_SUCCESS || Real::cuDeviceGetUuid_v2(&uuid, device) != CUDA_SUCCESS) return;
  char text[96];
  const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
  std::snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  nvmlDevice_t handle = nullptr;
  nvmlUtilization_t utilization{};
  if (Real::nvmlInit_v2() != NVML_SUCCESS || Real::nvmlDeviceGetHandleByUUID(text, &handle) != NVML_SUCCESS ||
      Real::nvmlDeviceGetUtilizationRates(handle, &utilization) != NVML_SUCCESS || utilization.gpu > 100) {
    return;  // no reading (or garbage): keep the current rate rather than guess
  }
  const int region_device = RegionDevice(ordinal);
  const double own = policy::Limiter::PublishedShare(
      *static_cast<const policy::BudgetCell*>(TheShim().region->ComputeArea(region_device)), now);
  d.limiter->ObserveOthers(std::max(0.0, utilization.gpu / 100.0 - own), now);
}

std::uint64_t ShapeOf(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::uint64_t v : {gx, gy, gz, bx, by, bz, shared}) h = (h ^ v) * 1099511628211ull;
  return h;
}

// Admits, waits, launches, measures. `launch` performs the real launch on `stream`.
template <typename Launch>
CUresult Limited(const void* function, std::uint64_t shape, CUstream stream, Launch&& launch) {
  if (CurrentMode() != Mode::limited) return launch();
  const int ordinal = CurrentOrdinal();
  DeviceLimiter* d = LimiterFor(ordinal);
  if (d == nullptr) return launch();
  const policy::KernelKey key{function, shape};
  std::uint64_t now = NowNs();
  policy::Admission admission;
  for (;;) {
    std::unique_lock<std::mutex> guard(d->mutex);
    SettleCompleted(*d, now);
    ObserveOthers(*d, ordinal, now);
    admission = d->limiter->Admit(key, now);
    if (!admission.wait_for_completion) break;
    // Too much queued unmeasured: wait (outside the lock) for the oldest measured launch to finish.
    CUevent oldest = d->pending.empty() ? nullptr : d->pending.front().end;
    guard.unlock();
    if (oldest != nullptr) Real::cuEventSynchronize(oldest);
    now = NowNs();
  }
  if (admission.ready_at_ns > now) SleepUntilNs(admission.ready_at_ns);

  CUcontext context = nullptr;
  Real::cuCtxGetCurrent(&context);
  CUevent start = nullptr, end = nullptr;
  bool measure = false;
  {
    std::lock_guard<std::mutex> guard(d->mutex);
    const std::uint32_t n = d->launches[function]++;
    if (n < kAlwaysMeasureFirst || n % kMeasureEvery == 0) {
      start = TakeEvent(*d, context);
      end = TakeEvent(*d, context);
      measure = start != nullptr && end != nullptr;
    }
  }
  if (measure && Real::cuEventRecord(start, stream) != CUDA_SUCCESS) measure = false;
  const CUresult result = launch();
  if (measure && result == CUDA_SUCCESS && Real::cuEventRecord(end, stream) != CUDA_SUCCESS) measure = false;
  std::lock_guard<std::mutex> guard(d->mutex);
  if (result != CUDA_SUCCESS) {
    d->limiter->Cancel(admission.charged_ns);  // nothing ran: nothing is owed
  } else if (measure) {
    d->pending.push_back({key, admission.charged_ns, start, end, context});
    return result;
  } else {
    d->limiter->SettleUnmeasured(admission.charged_ns, NowNs());
  }
  ReturnEvent(*d, context, start);
  ReturnEvent(*d, context, end);
  return result;
}

}  // namespace
}  // namespace vgpu::hooks

using namespace vgpu::hooks;

#define VGPU_LAUNCH_FUNCTION_CHECK(real)                    \
  do {                                                      \
    if (Real::real == nullptr) ResolveReal();               \
    if (Real::real == nullptr) return CUDA_ERROR_NOT_FOUND; \
    if (CurrentMode() == Mode::failed) return kFailedClosedCuda; \
  } while (0)

extern "C" VGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                              unsigned bz, unsigned shared, CUstream stream, void** params, void** extra) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernel);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream,
                 [&] { return Real::cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra); });
}

extern "C" VGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                   unsigned by, unsigned bz, unsigned shared, CUstream stream, void** params,
                                                   void** extra) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernel_ptsz);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream,
                 [&] { return Real::cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra); });
}

extern "C" VGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                         unsigned by, unsigned bz, unsigned shared, CUstream stream,
                                                         void** params) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchCooperativeKernel);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream,
                 [&] { return Real::cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params); });
}

extern "C" VGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                              unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                                              CUstream stream, void** params) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchCooperativeKernel_ptsz);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream,
                 [&] { return Real::cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params); });
}

extern "C" VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernelEx);
  if (config == nullptr) return Real::cuLaunchKernelEx(config, f, params, extra);
  return Limited(f,
                 ShapeOf(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                         config->blockDimZ, config->sharedMemBytes),
                 config->hStream, [&] { return Real::cuLaunchKernelEx(config, f, params, extra); });
}

extern "C" VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** params,
                                                     void** extra) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernelEx_ptsz);
  if (config == nullptr) return Real::cuLaunchKernelEx_ptsz(config, f, params, extra);
  return Limited(f,
                 ShapeOf(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                         config->blockDimZ, config->sharedMemBytes),
                 config->hStream, [&] { return Real::cuLaunchKernelEx_ptsz(config, f, params, extra); });
}

// A graph launch is admitted and measured as one unit: its key is the executable graph.
extern "C" VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec graph, CUstream stream) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuGraphLaunch);
  return Limited(graph, 0, stream, [&] { return Real::cuGraphLaunch(graph, stream); });
}

extern "C" VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec graph, CUstream stream) {
  VGPU_LAUNCH_FUNCTION_CHECK(cuGraphLaunch_ptsz);
  return Limited(graph, 0, stream, [&] { return Real::cuGraphLaunch_ptsz(graph, stream); });
}
