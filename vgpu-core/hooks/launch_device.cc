// The launch path's "find" stage (launch.h): which device a launch goes to and its limiter, set up on the first
// launch; and what every stage shares: the pool of events, the streams' states.
#include <algorithm>
#include <cstdio>

#include "compute_area.h"
#include "launch.h"

namespace vgpu::hooks::launch {

#if VGPU_PATH_COUNTERS
PathCounters g_path_counters;
#endif

namespace {

constexpr std::uint64_t kBurstNs = 20'000'000;

// Guards setting a device's limiter up (not std::call_once: an exception -- the host out of memory -- must not cross
// pthread_once, whose C frames the shim's own unwinder cannot pass; it aborted the process).
std::mutex g_device_setup_mutex;

}  // namespace

DeviceLimiter g_devices[policy::kMaxDevices];
std::atomic<std::int64_t> g_captures{0};

bool Find(Launching& l, CUresult& refused) {
  refused = CUDA_SUCCESS;
  // The events live in the current context (pooled per context, destroyed with it): without it, nothing is measured.
  l.setup = Real::cuCtxGetCurrent != nullptr ? Real::cuCtxGetCurrent(&l.context) : CUDA_ERROR_NOT_FOUND;
  if (l.setup == CUDA_SUCCESS && l.context == nullptr) l.setup = CUDA_ERROR_INVALID_CONTEXT;
  // (No current context at all: the driver refuses the launch itself.)
  l.ordinal = l.setup == CUDA_SUCCESS && OneDevice() ? 0 : CurrentOrdinal(refused);
  if (l.ordinal < 0) return false;
  l.d = LimiterFor(l.ordinal, refused);
  return l.d != nullptr;
}

// Whether the process sees one device (then a current context is on ordinal 0, with no cuCtxGetDevice per launch).
// The count is fixed for the life of the process (CUDA_VISIBLE_DEVICES is read when the driver starts).
bool OneDevice() {
  static std::atomic<int> count{-1};
  int known = count.load(std::memory_order_relaxed);
  if (known < 0) {
    int n = 0;
    if (Real::cuDeviceGetCount == nullptr || Real::cuDeviceGetCount(&n) != CUDA_SUCCESS) return false;  // asked again
    count.store(n, std::memory_order_relaxed);
    known = n;
  }
  return known == 1;
}

// The limiter of a device; null where the device has no compute limit (`error` CUDA_SUCCESS) or where it has one
// but cannot be named in the region (`error` the driver's error: the launch must then not run unadmitted).
DeviceLimiter* LimiterFor(int ordinal, CUresult& error) {
  error = CUDA_SUCCESS;
  if (ordinal < 0 || ordinal >= policy::kMaxDevices) return nullptr;
  // Set up once, on the first launch (the configuration does not change after start): every later launch takes
  // this path, with no lock (RegionDevice takes the shim's).
  if (g_devices[ordinal].ready.load(std::memory_order_acquire)) return &g_devices[ordinal];
  Shim& shim = TheShim();
  const std::uint32_t percent = shim.config.sm_limit_percent[static_cast<std::size_t>(ordinal)];
  const bool disabled = shim.config.policy == policy::ComputePolicy::disable;
  if (percent == 0 && !disabled) return nullptr;  // no compute limit on this device
  const int device = RegionDevice(ordinal, &error);
  if (device < 0) return nullptr;
  error = CUDA_SUCCESS;
  DeviceLimiter& d = g_devices[ordinal];
  std::lock_guard<std::mutex> setup(g_device_setup_mutex);
  if (!d.ready.load(std::memory_order_acquire)) {
    policy::BudgetCell* cell = &ComputeAreaOf(*shim.region, device).budget;
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
    // Under time division the windows hold the share (turn.h): the limiter measures and estimates only.
    d.scheduled = !disabled && percent != 0 && turn::Scheduled(ordinal);
    d.ordinal = ordinal;
    config.throttle = !disabled && percent != 0 && !d.scheduled;
    config.lend_when_idle = shim.config.policy == policy::ComputePolicy::standard && !d.scheduled;
    config.defer_busy = true;  // flushed with the settlements, every kSettleEveryNs
    d.lend = config.lend_when_idle;
    d.limiter = std::make_unique<policy::Limiter>(*cell, config);  // (out of host memory: nothing set, asked again)
    d.ready.store(true, std::memory_order_release);
  }
  return &d;
}

CUresult TakeEvent(DeviceLimiter& d, CUcontext context, CUevent& event) {
  event = nullptr;
  if (const auto it = d.free_events.find(context); it != d.free_events.end() && !it->second.empty()) {
    event = it->second.back();
    it->second.pop_back();
    return CUDA_SUCCESS;
  }
  if (Real::cuEventCreate == nullptr) return CUDA_ERROR_NOT_FOUND;
  const CUresult result = Real::cuEventCreate(&event, CU_EVENT_DEFAULT);
  if (result != CUDA_SUCCESS) event = nullptr;
  return result;
}

// Gives up one owner's hold on an event: back to the pool once nobody holds it. Nothing on the launch path may
// throw once a launch is made: when the host has no memory to pool it, the event is left to its context (destroyed
// with it).
void ReturnEvent(DeviceLimiter& d, CUcontext context, CUevent event) noexcept {
  if (event == nullptr) return;
  if (const auto it = d.extra_owners.find(event); it != d.extra_owners.end()) {
    if (--it->second == 0) d.extra_owners.erase(it);
    return;
  }
  (void)Recorded([&] { d.free_events[context].push_back(event); });
}

// One more owner of `event`; false (nothing held) when the host is out of memory.
bool HoldEvent(DeviceLimiter& d, CUevent event) noexcept {
  return Recorded([&] { ++d.extra_owners[event]; });
}

// The state of `stream` (made on first use; the last one used is kept at hand). Caller holds d.mutex.
StreamState& StateOf(DeviceLimiter& d, CUstream stream) {
  if (d.last_state != nullptr && d.last_stream == stream) return *d.last_state;
  StreamState& state = d.streams[stream];
  d.last_stream = stream;
  d.last_state = &state;
  return state;
}

}  // namespace vgpu::hooks::launch
