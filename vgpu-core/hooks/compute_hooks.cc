// Compute caps on every launch path: each launch is admitted by the limiter (the container's GPU-time budget in
// the region), the launching thread sleeps to the exact moment the budget allows, and CUDA events around the
// kernel measure what it really cost (docs/compute-limit.md).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <mutex>
#include <memory>
#include <utility>
#include <vector>

#include "gates.h"
#include "shim.h"
#include "turn.h"
#include "driver_memory.h"
#include "vgpu/policy/limiter.h"

namespace vgpu::hooks {
namespace {

static_assert(sizeof(policy::BudgetCell) <= sizeof(region::Device::compute), "the budget must fit the region");

// Where launches go (libvgpu-path-counters.so, built with VGPU_PATH_COUNTERS=1; docs/compute-limit.md, "Path
// counters"). Off in libvgpu.so: each count is an atomic add on the launch path. At exit the counts are written to
// stderr as one line, "vgpu-path-counters {...}".
#if VGPU_PATH_COUNTERS
#define VGPU_PATH_COUNTER_NAMES(X)                                                                                       \
  X(booked_drained) X(booked_window) X(book_refused_queued) X(book_refused_window) X(whole_path) X(waited_for_completion) \
  X(waited_for_budget) X(waited_for_budget_ns) X(planned_unmeasured) X(planned_pair) X(planned_gated_pair)            \
  X(planned_window) X(settled_early) X(books_opened) X(window_books_opened) X(book_launches_granted)                   \
  X(whole_path_charged_ns)
struct PathCounters {
  enum Name : int {
#define VGPU_PATH_COUNTER_ENUM(name) name,
    VGPU_PATH_COUNTER_NAMES(VGPU_PATH_COUNTER_ENUM)
#undef VGPU_PATH_COUNTER_ENUM
        count
  };
  std::atomic<std::uint64_t> value[count] = {};
  ~PathCounters() {
    static const char* const names[] = {
#define VGPU_PATH_COUNTER_STRING(name) #name,
        VGPU_PATH_COUNTER_NAMES(VGPU_PATH_COUNTER_STRING)
#undef VGPU_PATH_COUNTER_STRING
    };
    char line[2048];
    int at = std::snprintf(line, sizeof line, "vgpu-path-counters {");
    for (int i = 0; i < count && at > 0 && at < static_cast<int>(sizeof line); ++i) {
      at += std::snprintf(line + at, sizeof line - static_cast<std::size_t>(at), "%s\"%s\": %llu", i ? ", " : "",
                          names[i], static_cast<unsigned long long>(value[i].load(std::memory_order_relaxed)));
    }
    std::fprintf(stderr, "%s}\n", line);
  }
};
PathCounters g_path_counters;
#define VGPU_COUNT(name, n) g_path_counters.value[PathCounters::name].fetch_add((n), std::memory_order_relaxed)
#else
#define VGPU_COUNT(name, n) ((void)0)
#endif

constexpr std::uint64_t kBurstNs = 20'000'000;
constexpr std::uint32_t kAlwaysMeasureFirst = 32;   // then about one launch per kMeasureSpacingNs of its run time
constexpr std::uint64_t kMeasureSpacingNs = 250'000;
constexpr std::uint64_t kMeasureAtLeastOneIn = 64;
// A steady kernel (policy::Admission::steady) is measured about once per kSteadySpacingNs of its run time, at least one
// launch in kSteadyAtLeastOneIn: a measured launch costs the host ~4 us (a gate, two records) and the GPU a few us more
// that a synchronize waits for; one in 64 tiny launches was ~1 % of a launch + synchronize on the H100 (docs/results-gpu.md,
// "Ninth run").
constexpr std::uint64_t kSteadySpacingNs = 1'000'000;
constexpr std::uint64_t kSteadyAtLeastOneIn = 256;
// A measurement window (launches queued back to back on one stream, one event between windows) ends after this
// many launches or this much estimated GPU time, whichever comes first (docs/compute-limit.md): a quarter of what
// may be queued unmeasured (LimiterConfig::in_flight_max_ns), so that windows settle while more are queued.
constexpr std::size_t kWindowLaunches = 256;
constexpr std::uint64_t kWindowNs = 5'000'000;
constexpr std::uint64_t kObserveOthersEveryNs = 100'000'000;
// How often the launch path looks at the node monitor's verdict (read from its file at most every kVerdictReadNs).
constexpr std::uint64_t kVerdictCheckNs = 20'000'000;
constexpr std::uint64_t kCompletionPollNs = 200'000;
// A launch asks the driver about measured launches at most this often (each cuEventQuery is a driver call, ~0.3 us
// on an H100: a few percent of a small launch), or when this many wait to be settled, or while it waits for them.
constexpr std::uint64_t kSettleEveryNs = 50'000;
constexpr std::size_t kSettleBacklog = 16;
constexpr std::uint64_t kMaxCompletionWaitNs = 200'000'000;
// `default`: without a reading of the others' use for this long, the GPU is no longer known to be free.
constexpr std::uint64_t kStaleReadingNs = 1'000'000'000;
constexpr std::uint64_t kNvmlRetryNs = 1'000'000'000;  // `default`: NVML that failed to start is asked again
// NVML sample timestamps further ahead of the wall clock than this are not readings but garbage.
constexpr unsigned long long kFutureSampleUs = 1'000'000;

std::uint64_t NowNs() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

// Books of launches (see LaunchBook): each thread keeps kBooks; a book on a drained stream holds at most kBookLaunches,
// one into a window kWindowBookLaunches, and either at most kBookNs of GPU time.
constexpr int kBooks = 4;
constexpr std::uint32_t kBookLaunches = 128;
constexpr std::uint32_t kWindowBookLaunches = 256;
constexpr std::uint64_t kBookNs = 1'000'000;
constexpr std::uint32_t kBookWorthLaunches = 16;  // a book that served fewer before a queue ended it ...
constexpr std::uint32_t kBookBackoff = 64;       // ... keeps this many chances of a book off its stream

// A measured launch of a kernel shorter than this is gated (gates.h): its pair then times the GPU's part of the launch,
// not the host's launch call (~3 us on an H100: most of a tiny kernel's pair). A longer kernel's pair is left ungated:
// the call is a few percent of it at most, and each gate leaves the context with nothing to run until the host writes
// the word, which under time-slicing hands the GPU to another container (kernels of this length are measured at every
// launch unless they are steady: see MeasuredOneIn).
constexpr std::uint64_t kGateBelowNs = 250'000;

// A measurement waiting for its end event: a pair around one launch, or a window around several.
struct Pending {
  policy::KernelKey key;
  std::uint64_t charged_ns;
  CUevent start;
  CUevent end;
  CUcontext context;
  std::uint64_t launched_ns;  // just before the launch call: the kernel cannot have started earlier
  // A window: its launches (key/charged_ns unused), and for one closed only once its stream had drained (the
  // process stopped launching), the host time from its last launch to its end record (see SettleCompleted).
  std::vector<policy::WindowLaunch> window;
  bool is_window = false;
  std::uint64_t idle_tail_ns = 0;
  // A pair between whose events another thread launched onto the same stream: its kernel may lie between them, so
  // the pair says how long both ran, not this kernel. Settled at the kernel's usual cost, not learned from.
  bool shared = false;
  // The kernel's first launch in this process: the driver may load its module inside that launch call (lazily),
  // after the start was written, so the pair may time the loading (1.5-3.1 ms for PyTorch's first kernels on an H100).
  // Charged what it measured, not learned from: the kernel's usual cost would carry the loading for 64 measurements.
  bool first = false;
};

// A stream's open measurement window, and the event that ended the last one (the next one's start while the
// stream stays busy). `busy_until_ns` is the host's estimate of when the work queued on the stream ends.
struct StreamState {
  CUcontext context = nullptr;
  // (Atomic: a book's launches, made past the plan, move it too; see LaunchBook.)
  std::atomic<std::uint64_t> busy_until_ns{0};
  std::uint64_t last_launch_ns = 0;
  CUevent mark = nullptr;
  CUevent start = nullptr;  // the open window's start; null: no window open
  std::vector<policy::WindowLaunch> launches;
  std::uint64_t estimated_ns = 0;
  // Launches of the open window planned but not made yet (other threads may launch into the same stream): the window
  // ends only once they are made, or a kernel would run after its end event, in no window. A close asked for
  // meanwhile is left to the last of them. Read and written without d.mutex by the launching threads.
  std::atomic<std::uint32_t> launching{0};
  std::atomic<bool> close_when_done{false};
  std::uint64_t planned = 0;  // launches planned on this stream so far (a pair compares it before and after)
  // Books of launches open on this stream (any thread's; see LaunchBook). Their launches are made past the plan: while
  // any is open no window opens here, and a pair another thread's book may have launched into is not learned from.
  std::uint32_t books = 0;
  // The thread that planned the last launch here (its books' address), and whether two threads have launched here:
  // such a stream gets no books (a book's launches are made past the plan, between another thread's events).
  const void* thread = nullptr;
  bool many_threads = false;
  std::uint32_t books_skipped = 0;  // chances of a book left out (see CloseBookLocked)
  // Launches made through books into the open window (LaunchBook::window), counted without d.mutex by the launching
  // thread (a stream with books has one) in the place of its book, and added to `launches` when the book or the
  // window ends (FoldBooked). `window_seq` is raised whenever a window ends: the books into it end with it.
  struct Booked {
    policy::KernelKey key{};
    std::uint64_t charged_ns = 0;
    std::atomic<std::uint32_t> made{0};
  };
  Booked booked[kBooks];
  std::atomic<std::uint64_t> window_seq{0};
  std::uint32_t booked_reserved = 0;  // launches the books into the open window may still make: count toward its size
  std::atomic<std::uint64_t> booked_last_ns{0};  // when the last of them was made
};

// One per device ordinal this process launches on. What every limited launch reads comes first (a launch's cost on
// a real GPU's host is mostly the cache lines it reads: the driver's own launch has displaced them).
struct DeviceLimiter {
  std::atomic<bool> ready{false};    // `limiter` is set up: later launches need nothing else to find it
  bool lend = false;
  bool scheduled = false;  // time division holds the cap (turn.h): launches take turns; books only inside one
  int ordinal = -1;
  std::mutex mutex;  // process-local; never held while sleeping or while the driver waits
  std::unique_ptr<policy::Limiter> limiter;
  std::uint64_t next_settle_ns = 0;  // under `mutex`: see kSettleEveryNs
  // The stream launched on last and its state (under `mutex`; map nodes are erased only with their context).
  CUstream last_stream = nullptr;
  StreamState* last_state = nullptr;
  std::atomic<std::uint64_t> last_observed_ns{0};
  std::atomic<std::uint64_t> verdict_checked_ns{0};  // the launch path's last look at the node monitor's verdict
  std::uint64_t verdict_stamp_ns = 0;                // the last verdict acted on (guarded by mutex)
  std::deque<Pending> pending;
  std::deque<Pending> abandoned;  // settled at their estimate while still running: events held until done
  std::unordered_map<CUcontext, std::vector<CUevent>> free_events;
  // Events held by more than one owner (a window's end that is also its stream's mark): the owners beyond the first.
  std::unordered_map<CUevent, std::uint32_t> extra_owners;
  std::unordered_map<CUstream, StreamState> streams;
  std::atomic<std::uint64_t> last_reading_ns{0};  // `default`: the last time OthersBusy gave a reading
  std::atomic<std::uint64_t> held_blind_ns{0};    // `default`: when the container was last held for want of readings
};

DeviceLimiter g_devices[policy::kMaxDevices];
// Guards setting a device's limiter up (not std::call_once: an exception -- the host out of memory -- must not cross
// pthread_once, whose C frames the shim's own unwinder cannot pass; it aborted the process).
std::mutex g_device_setup_mutex;

// Stream captures the process may have in progress (docs/compute-limit.md, "The launch path"). While there are none,
// no stream is capturing and a launch needs no capture check (cuStreamIsCapturing: a driver call on every launch).
// Raised before a capture begins, so that a launch racing with the begin checks; lowered only once the driver says
// the stream it ended is no longer capturing. Too high is only slower; it never reads zero during a capture that
// began through the driver's exported capture entry points, every one of which the shim hooks.
std::atomic<std::int64_t> g_captures{0};

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

// The shim's own event queries and records run with the calling thread's stream capture mode relaxed, then put
// back. While another thread captures a graph in CU_STREAM_CAPTURE_MODE_GLOBAL (PyTorch's default), a "potentially
// unsafe" call from any thread in global mode fails and invalidates that capture: beside a thread launching under a
// compute cap, 24 of 40 PyTorch graph captures failed on the H100, none without the shim (tests/gpu/capture_probe.py).
class RelaxedCapture {
 public:
  RelaxedCapture() {
    if (Real::cuThreadExchangeStreamCaptureMode == nullptr) return;
    active_ = Real::cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
  }
  ~RelaxedCapture() {
    if (active_) Real::cuThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;  // after the first exchange: the mode to put back
  bool active_ = false;
};

// LIBCUDA_LOG_LEVEL=4: a measurement far above what was charged says that its span held waiting, not work (a
// collective kernel waiting for its peers, other contexts' time slices). The container is charged all of it and its
// next launches wait for the budget: with this line, a collapse like issue 20's DDP one explains itself.
void LogLongMeasurement(const void* function, std::uint64_t charged_ns, const std::optional<std::uint64_t>& measured) {
  if (!measured || *measured < 4 * charged_ns || *measured < charged_ns + 1'000'000) return;
  Log(4, "a launch of %p measured %llu us where %llu us were expected: its span held waiting (a collective's peers, "
      "other contexts' time slices), charged in full", function, static_cast<unsigned long long>(*measured / 1000),
      static_cast<unsigned long long>(charged_ns / 1000));
}

// Settles every measured launch that has completed (in order per device; a later one may wait for an earlier).
// Caller holds d.mutex.
void SettleCompleted(DeviceLimiter& d, std::uint64_t now) {
  if (d.pending.empty() && d.abandoned.empty()) return;
  RelaxedCapture relaxed;
  while (!d.abandoned.empty() && Real::cuEventQuery(d.abandoned.front().end) != CUDA_ERROR_NOT_READY) {
    ReturnEvent(d, d.abandoned.front().context, d.abandoned.front().start);
    ReturnEvent(d, d.abandoned.front().context, d.abandoned.front().end);
    d.abandoned.pop_front();
  }
  while (!d.pending.empty()) {
    Pending& p = d.pending.front();
    if (p.is_window) {
      const CUresult state = Real::cuEventQuery(p.end);
      if (state == CUDA_ERROR_NOT_READY) return;
      std::optional<std::uint64_t> measured;
      float ms = 0;
      if (state == CUDA_SUCCESS && Real::cuEventElapsedTime_v2(&ms, p.start, p.end) == CUDA_SUCCESS && ms >= 0) {
        const auto elapsed = static_cast<std::uint64_t>(static_cast<double>(ms) * 1e6);
        measured = elapsed;
        if (p.idle_tail_ns > 0) {
          // Closed after its stream had drained: the GPU time up to the last launch at least (the stream was busy
          // then), and no less than the launches' estimates, never more than the window's span.
          std::uint64_t estimated = 0;
          for (const auto& launch : p.window) estimated += launch.charged_ns;
          const std::uint64_t to_last = elapsed > p.idle_tail_ns ? elapsed - p.idle_tail_ns : 0;
          measured = std::min(elapsed, std::max(to_last, estimated));
        }
      }
      std::uint64_t charged = 0;
      for (const auto& launch : p.window) charged += launch.charged_ns;
      LogLongMeasurement(p.window.empty() ? nullptr : p.window.front().key.function, charged, measured);
      d.limiter->SettleWindow(p.window.data(), p.window.size(), measured, now);
      ReturnEvent(d, p.context, p.start);
      ReturnEvent(d, p.context, p.end);
      d.pending.pop_front();
      continue;
    }
    const bool known = d.limiter->Known(p.key);
    const CUresult state = Real::cuEventQuery(p.end);
    // Not ready; or the query failed and the kernel's cost is unknown: asked again later (a launch that waits too
    // long settles the oldest at its estimate). A known kernel whose query fails is settled at its estimate.
    if (state == CUDA_ERROR_NOT_READY || (state != CUDA_SUCCESS && !known)) return;
    if (p.shared && known) {
      d.limiter->SettleUnmeasured(p.key, p.charged_ns, now);  // (a kernel never measured takes the pair: an over-charge)
      ReturnEvent(d, p.context, p.start);
      ReturnEvent(d, p.context, p.end);
      d.pending.pop_front();
      continue;
    }
    std::optional<std::uint64_t> measured;
    float ms = 0;
    if (state == CUDA_SUCCESS && Real::cuEventElapsedTime_v2(&ms, p.start, p.end) == CUDA_SUCCESS && ms >= 0) {
      measured = static_cast<std::uint64_t>(static_cast<double>(ms) * 1e6);
    } else if (!known) {
      // Complete, never measured, and its events will not say how long it ran: from its launch to now is at least
      // that (an estimate of 100 us for a kernel of any length would let it run uncapped).
      const std::uint64_t seen = NowNs();
      measured = seen > p.launched_ns ? seen - p.launched_ns : 1;
    }
    LogLongMeasurement(p.key.function, p.charged_ns, measured);
    d.limiter->Settle(p.key, p.charged_ns, measured, now, !p.first);
    ReturnEvent(d, p.context, p.start);
    ReturnEvent(d, p.context, p.end);
    d.pending.pop_front();
  }
}

// NVML's utilization samples seen so far, per device ordinal (CPU timestamps in microseconds).
struct SampleCursor {
  std::mutex mutex;
  unsigned long long newest_us = 0;  // the newest sample's timestamp, 0 = none yet
  bool unsupported = false;          // nvmlDeviceGetSamples does not give utilization samples here
};
SampleCursor g_sample_cursors[policy::kMaxDevices];

std::uint64_t RealtimeNs() {
  struct timespec ts {};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

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
  const nvmlReturn_t r = Real::nvmlDeviceGetSamples(handle, NVML_GPU_UTILIZATION_SAMPLES, cursor.newest_us, &type,
                                                    &count, samples);
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
  const double own = policy::Limiter::BusyFraction(cell, static_cast<std::uint64_t>(from), static_cast<std::uint64_t>(to));
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
  if (Real::cuDeviceGet(&device, ordinal) != CUDA_SUCCESS || Real::cuDeviceGetUuid_v2(&uuid, device) != CUDA_SUCCESS) return -1;
  char text[96];
  const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
  std::snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  nvmlDevice_t handle = nullptr;
  if (Real::nvmlDeviceGetHandleByUUID(text, &handle) != NVML_SUCCESS) return -1;
  const int region_device = RegionDevice(ordinal);
  const auto& cell = *static_cast<const policy::BudgetCell*>(TheShim().region->ComputeArea(region_device));
  const double from_samples = OthersBusyOverNvmlSamples(ordinal, handle, cell, now, period_start);
  if (from_samples != -1) return from_samples;
  period_start = now > 1'000'000'000 ? now - 1'000'000'000 : 0;  // the published share covers the last second
  nvmlUtilization_t utilization{};
  if (Real::nvmlDeviceGetUtilizationRates(handle, &utilization) != NVML_SUCCESS || utilization.gpu > 100) {
    return -1;  // no reading (or garbage): keep the current rate rather than guess
  }
  return std::max(0.0, utilization.gpu / 100.0 - policy::Limiter::PublishedShare(cell, now));
}

// Adds the launches made through books into the open window (the place of book `only`, or all) to its launches.
// Caller holds d.mutex, and no launch into the window is being made (`launching` zero) or the places are the caller's.
void FoldBooked(DeviceLimiter& d, StreamState& state, int only = -1) noexcept {
  for (int i = 0; i < kBooks; ++i) {
    if (only >= 0 && i != only) continue;
    StreamState::Booked& place = state.booked[i];
    for (std::uint32_t n = place.made.exchange(0, std::memory_order_acq_rel); n > 0; --n) {
      const policy::WindowLaunch launch{place.key, place.charged_ns};
      if (!Recorded([&] { state.launches.push_back(launch); })) {
        d.limiter->SettleWindow(&launch, 1, std::nullopt, NowNs());  // out of host memory: settled unmeasured
      }
    }
  }
  state.last_launch_ns = std::max(state.last_launch_ns, state.booked_last_ns.load(std::memory_order_relaxed));
}

// Ends `state`'s open window with an event recorded now on `stream` (behind every launch of the window) and queues
// it to be settled; the end stays the stream's mark, the next window's start while the stream stays busy. `drained`:
// the host's estimate says the stream's work has ended; asked of the driver, since an estimate can be short. A
// window closed on a drained stream also timed the idle time since its last launch (see SettleCompleted). Caller
// holds d.mutex; the current context is `state.context`.
void CloseWindow(DeviceLimiter& d, CUstream stream, StreamState& state, std::uint64_t now, bool drained) {
  if (state.start == nullptr) return;
  // Books into this window end; and unless a launch into it is being made (the last one in flight closes it, see
  // EndLaunching), so does the window. Each side writes, then reads what the other wrote: one of them sees the other.
  state.window_seq.fetch_add(1, std::memory_order_seq_cst);
  state.close_when_done.store(true, std::memory_order_seq_cst);
  if (state.launching.load(std::memory_order_seq_cst) > 0) return;
  state.close_when_done.store(false, std::memory_order_relaxed);
  FoldBooked(d, state);
  state.booked_reserved = 0;
  RelaxedCapture relaxed;
  Pending p{};
  p.is_window = true;
  p.window = std::move(state.launches);
  p.start = state.start;
  p.context = state.context;
  state.start = nullptr;
  state.launches.clear();
  state.estimated_ns = 0;
  CUevent end = nullptr;
  CUresult r = TakeEvent(d, state.context, end);
  if (r == CUDA_SUCCESS) r = Real::cuEventRecord(end, stream);
  if (r != CUDA_SUCCESS) {  // not measured: each launch at what such a launch costs
    d.limiter->SettleWindow(p.window.data(), p.window.size(), std::nullopt, now);
    ReturnEvent(d, p.context, p.start);
    ReturnEvent(d, p.context, end);
    return;
  }
  p.end = end;
  if (drained && Real::cuStreamQuery != nullptr && Real::cuStreamQuery(stream) == CUDA_SUCCESS) {
    p.idle_tail_ns = std::max<std::uint64_t>(now > state.last_launch_ns ? now - state.last_launch_ns : 0, 1);
  }
  if (!Recorded([&] { d.pending.push_back(std::move(p)); })) {  // (push_back: unchanged if it throws)
    // Out of host memory: the window cannot wait for its end; settled as unmeasured launches now.
    d.limiter->SettleWindow(p.window.data(), p.window.size(), std::nullopt, now);
    ReturnEvent(d, p.context, p.start);
    ReturnEvent(d, p.context, end);
    return;
  }
  ReturnEvent(d, state.context, state.mark);
  // The end is also the next window's start while the stream stays busy (without memory to hold it twice: none).
  state.mark = HoldEvent(d, end) ? end : nullptr;
}

// Closes every open window of `context` (the process is about to wait: its streams will drain meanwhile).
void CloseWindowsOf(DeviceLimiter& d, CUcontext context, std::uint64_t now) {
  for (auto& [stream, state] : d.streams) {
    if (state.context == context && state.start != nullptr) CloseWindow(d, stream, state, now, false);
  }
}

// A stream's state, dropped: its open window settled as unmeasured, its events given back. Caller holds d.mutex.
void DropStreamState(DeviceLimiter& d, StreamState& state, std::uint64_t now, bool context_alive) {
  state.window_seq.fetch_add(1, std::memory_order_seq_cst);
  FoldBooked(d, state);
  state.booked_reserved = 0;
  if (!state.launches.empty()) d.limiter->SettleWindow(state.launches.data(), state.launches.size(), std::nullopt, now);
  if (context_alive) {
    ReturnEvent(d, state.context, state.start);
    ReturnEvent(d, state.context, state.mark);
  } else {
    d.extra_owners.erase(state.start);
    d.extra_owners.erase(state.mark);
  }
  state.context = nullptr;
  state.busy_until_ns.store(0, std::memory_order_relaxed);
  state.last_launch_ns = state.estimated_ns = 0;
  state.mark = state.start = nullptr;
  state.launches.clear();
  state.launching.store(0, std::memory_order_relaxed);
  state.close_when_done.store(false, std::memory_order_relaxed);
}

enum class How { unmeasured, pair, window };

// How one launch is measured, decided under d.mutex just before it is made.
struct Plan {
  How how = How::unmeasured;
  StreamState* stream = nullptr;  // a window's stream state (stable: map nodes are erased only with their context)
  CUevent start = nullptr, end = nullptr;  // a pair's events
  bool unknown_cost = false;
  bool close_after = false;  // the launch fills its window: the window ends right after it
  std::uint64_t sequence = 0;  // the stream's `planned` count with this launch
  bool gate = false;  // a pair to gate (gates.h)
};

bool SampleThisLaunch(std::uint32_t launches_before, std::uint64_t estimate_ns, bool steady);
const void* ThisThread();

// The state of `stream` (made on first use; the last one used is kept at hand). Caller holds d.mutex.
StreamState& StateOf(DeviceLimiter& d, CUstream stream) {
  if (d.last_state != nullptr && d.last_stream == stream) return *d.last_state;
  StreamState& state = d.streams[stream];
  d.last_stream = stream;
  d.last_state = &state;
  return state;
}

// docs/compute-limit.md, "Measurement windows": a kernel of known cost launched while at least half a launch of
// work is queued ahead of it on its stream (by the host's estimate) joins the stream's window: no event of its own,
// the next window boundary measures it with its neighbours, back to back. A window opens only on a stream the
// driver says is busy (the last mark not reached yet, or the stream not idle), so that it never starts on an idle
// GPU. Any other launch closes the stream's window, and gets a pair of its own if sampled; a kernel never measured
// gets a pair every time. Caller holds d.mutex; updates the stream's estimate of its queue.
Plan PlanLaunch(DeviceLimiter& d, const policy::KernelKey& key, std::uint32_t launches_before, bool steady, bool force_sample,
                CUstream stream, CUcontext context, CUresult& setup, std::uint64_t charged_ns, std::uint64_t at,
                bool unknown_cost) {
  Plan plan;
  plan.unknown_cost = unknown_cost;
  if (setup != CUDA_SUCCESS) return plan;
  // What this plan needs from the heap comes before it changes anything: if the host is out of memory, the caller
  // cancels the admission and refuses the launch. Past the lookups, nothing throws (TakeEvent only looks the pool up;
  // ReturnEvent and HoldEvent do without memory).
  StreamState& state = StateOf(d, stream);
  // (A window fills at kWindowLaunches, but threads planning into it together may pass that before it closes.)
  if (state.launches.size() + state.booked_reserved >= state.launches.capacity() ||
      state.launches.capacity() < kWindowLaunches) {
    state.launches.reserve(std::max(kWindowLaunches, 2 * (state.launches.size() + state.booked_reserved)));
  }
  if (state.context != context) {
    DropStreamState(d, state, at, true);  // a stream handle of another context, reused
    state.context = context;
  }
  if (state.thread != nullptr && state.thread != ThisThread()) state.many_threads = true;
  state.thread = ThisThread();
  std::uint64_t busy_until = state.busy_until_ns.load(std::memory_order_relaxed);
  bool queued = !plan.unknown_cost && state.books == 0 && busy_until > at + charged_ns / 2;
  if (queued && state.start == nullptr) {
    RelaxedCapture relaxed;
    CUevent& mark = state.mark;
    queued = mark != nullptr ? Real::cuEventQuery(mark) == CUDA_ERROR_NOT_READY
                             : Real::cuStreamQuery != nullptr && Real::cuStreamQuery(stream) == CUDA_ERROR_NOT_READY;
    // The driver says the stream has drained: the estimate ran ahead of it (kernels charged more than the host's
    // launch interval, such as launch-bound tiny ones whose pairs time the launch call): it starts again from now,
    // or every launch after this one would ask the driver too. (A mark reached says less: work launched after it may
    // be queued. It is dropped below, and the next launch the estimate calls queued asks about the stream.)
    if (!queued && mark == nullptr) busy_until = at;
    if (queued && mark != nullptr) {
      state.start = mark;  // the stream has been busy since the mark: the windows chain
      mark = nullptr;
    } else if (queued) {
      CUevent start = nullptr;
      if ((setup = TakeEvent(d, context, start)) == CUDA_SUCCESS &&
          (setup = Real::cuEventRecord(start, stream)) == CUDA_SUCCESS) {
        state.start = start;
      } else {
        ReturnEvent(d, context, start);
        setup = CUDA_SUCCESS;  // measured otherwise: as a launch on an idle stream
        queued = false;
      }
    }
  }
  const bool busy = busy_until > at;
  state.busy_until_ns.store(std::max(busy_until, at) + charged_ns, std::memory_order_relaxed);
  plan.sequence = ++state.planned;
  if (queued) {
    plan.how = How::window;
    state.launches.push_back({key, charged_ns});
    state.estimated_ns += charged_ns;
    state.last_launch_ns = at;
    plan.close_after =
        state.launches.size() + state.booked_reserved >= kWindowLaunches || state.estimated_ns >= kWindowNs;
    plan.stream = &state;
    state.launching.fetch_add(1, std::memory_order_acq_rel);
    return plan;
  }
  CloseWindow(d, stream, state, at, !busy);  // by the estimate, the process had stopped launching here a while
  ReturnEvent(d, context, state.mark);
  state.mark = nullptr;
  state.last_launch_ns = at;
  // A kernel never measured is measured every time; the others as sampled (the charge is the estimate).
  if (plan.unknown_cost || force_sample || SampleThisLaunch(launches_before, charged_ns, steady)) {
    RelaxedCapture relaxed;
    setup = TakeEvent(d, context, plan.start);
    if (setup == CUDA_SUCCESS) setup = TakeEvent(d, context, plan.end);
    if (plan.start != nullptr && plan.end != nullptr) plan.how = How::pair;
    // A known short kernel's pair is gated (kGateBelowNs), on a stream one thread launches into (there a gate holds
    // nobody else's kernels). A kernel's first launches are not: a launch call that loads its module may wait for the
    // GPU (the watchdog would open the gate, a millisecond later each time).
    plan.gate = plan.how == How::pair && !plan.unknown_cost && charged_ns < kGateBelowNs && !state.many_threads &&
                gates::Usable(at);
  }
  return plan;
}

// PlanLaunch, or, when the host is out of memory (planning a first launch on a stream or of a kernel needs the heap;
// PlanLaunch changes nothing before it has it), the admission cancelled: the launch is refused, nothing ran, nothing
// is owed. Caller holds d.mutex.
bool PlanOrCancel(DeviceLimiter& d, Plan& plan, const policy::KernelKey& key, std::uint32_t launches_before, bool steady,
                  bool force_sample, CUstream stream, CUcontext context, CUresult& setup, std::uint64_t charged_ns,
                  std::uint64_t at, bool unknown_cost) {
  try {
    plan = PlanLaunch(d, key, launches_before, steady, force_sample, stream, context, setup, charged_ns, at,
                      unknown_cost);
    return true;
  } catch (const std::bad_alloc&) {
    d.limiter->Cancel(key, charged_ns);
    return false;
  }
}

// Which launches are measured (two event records each, a few microseconds on a real GPU): the first ones of each
// kernel, then each launch with a probability that follows the kernel's usual run time: a kernel of 250 us or more
// every time (the events cost ~1 % of it or less, and the budget follows its real sizes launch by launch), a 5 us
// kernel one launch in fifty, never fewer than one in 64. A draw per launch, not a clock: measuring "the first
// launch after a pause" would pick the launches whose event pair also times the host's gap before an idle stream
// starts them (5 us kernels at a 30 % cap got 27 %). Random, so that a tenant cannot put its heavy work where
// nothing is measured; unmeasured launches are settled at the mean of the measured ones (Limiter::SettleUnmeasured).
// A launch of a kernel that usually runs `estimate_ns` is measured one time in this many (see SampleThisLaunch); a
// steady one less often (kSteadySpacingNs).
std::uint64_t MeasuredOneIn(std::uint64_t estimate_ns, bool steady) {
  const std::uint64_t estimate = std::max<std::uint64_t>(estimate_ns, 1);
  return steady ? std::clamp<std::uint64_t>(kSteadySpacingNs / estimate, 1, kSteadyAtLeastOneIn)
                : std::clamp<std::uint64_t>(kMeasureSpacingNs / estimate, 1, kMeasureAtLeastOneIn);
}

// One draw: is this launch, of a kernel measured one time in `one_in`, measured?
bool DrawMeasured(std::uint64_t one_in) {
  // (initial-exec: the shim is loaded with the process, so its thread-locals are read without __tls_get_addr.)
  static thread_local std::uint64_t state __attribute__((tls_model("initial-exec"))) = 0;
  if (state == 0) state = NowNs() | 1;
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return ((state >> 32) * one_in) >> 32 == 0;  // uniform in [0, one_in): a multiply, not a division
}

bool SampleThisLaunch(std::uint32_t launches_before, std::uint64_t estimate_ns, bool steady) {
  return launches_before < kAlwaysMeasureFirst || DrawMeasured(MeasuredOneIn(estimate_ns, steady));
}

std::uint64_t ShapeOf(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::uint64_t v : {gx, gy, gz, bx, by, bz, shared}) h = (h ^ v) * 1099511628211ull;
  return h;
}

// Books of launches: the launch path's fast path (docs/compute-limit.md, "The launch path"). Two kinds:
// - Onto a drained stream. A thread whose launch of a kernel measured before is made unmeasured on a stream with no
//   open window is given the launches of that kernel on that stream and context that the sampling would leave
//   unmeasured next (drawn now, one draw per launch as SampleThisLaunch makes them, at most kBookLaunches), admitted
//   and settled as unmeasured at once (Limiter::AdmitBook), as many as the budget holds without debt and no more than
//   kBookNs of GPU time together. Those launches check the book, the host's estimate that the stream has drained (a
//   launch that would queue takes the whole path: queues are measured by windows) and the context, and go. The launch
//   after a book's last goes through the whole path, measured where the draw that ended the book picked it.
// - Into a window. A thread whose launch of a known kernel joins its stream's open window (and does not fill it) is
//   given the launches of that kernel after it, into the same window, as many as the window has room for (at most
//   kWindowBookLaunches and kBookNs), charged now at the kernel's estimate (Limiter::AdmitWindowBook: no debt, within
//   the in-flight bound). Those launches check the book, that the window is still open and the stream still queued by
//   the host's estimate, count themselves in their book's place of the stream, and go; the window measures them with
//   its other launches. A window ends only while no launch into it is being made (`launching`, raised before the check
//   that it is open: see CloseWindow).
// Either way: no lock, no map. A thread keeps kBooks books (alternating kernels each keep theirs). What a book holds
// unused goes back when the thread takes the whole path for that kernel and stream, or evicts the book, or the book's
// context is destroyed (its stream states go: the book is returned without them); after fork the child drops what it
// inherited (its parent returns it). A thread that ends with a book open leaves it spent: at most kBooks x kBookNs of
// budget, once. (A booked launch reads and moves its stream's state: a thread that destroys a context while another
// launches into it -- undefined in CUDA -- could have it touch a stream state being freed.)
struct LaunchBook {
  const void* function;
  std::uint64_t shape;
  CUstream stream;
  CUcontext context;
  DeviceLimiter* device;    // null: no book here
  StreamState* state;       // valid while `generation` is current
  std::uint64_t generation;
  std::uint64_t fork_generation;
  std::uint64_t accounted_each_ns;
  std::uint64_t charged_ns;  // the kernel's estimate: the stream's queue grows by it per launch
  std::uint64_t last_ns;     // when the book's last launch was made
  std::uint32_t left;
  std::uint32_t granted;
  bool measure_next;        // the draw that ended the book picked the launch after it to be measured
  bool queued;              // closed because the stream had work queued (its launches then join windows)
  // A book into the stream's open window (its launches charged at the estimate, settled with the window), valid
  // while the stream's `window_seq` is this; otherwise a book onto a drained stream (settled as unmeasured).
  bool window;
  std::uint64_t window_seq;
  // Time division: the book's launches go only while they end inside the turn it was opened in (turn::Ticket).
  std::uint64_t turn_until_ns = UINT64_MAX;
};

struct ThreadBooks {
  LaunchBook book[kBooks];
  std::uint32_t next_evicted;
};

// (Constant-initialized, initial-exec: read with no call, as a launch's first thing.)
thread_local ThreadBooks t_books __attribute__((tls_model("initial-exec"))) = {};

// Raised when a context's stream states go (books on them lose `state`) and in a fork child (the books it inherited
// are its parent's). Read by every booked launch: kept beside nothing else that is written.
struct alignas(64) BookGenerations {
  std::atomic<std::uint64_t> streams{1};
  std::atomic<std::uint64_t> forks{1};
};
BookGenerations g_book_generations;

const void* ThisThread() { return &t_books; }

// The open book for a launch, or null. Checked before anything else on the launch path.
LaunchBook* OpenBookFor(const void* function, std::uint64_t shape, CUstream stream) {
  for (LaunchBook& book : t_books.book) {
    if (book.left > 0 && book.function == function && book.shape == shape && book.stream == stream) {
      if (g_captures.load(std::memory_order_relaxed) != 0 ||
          book.generation != g_book_generations.streams.load(std::memory_order_acquire) ||
          book.fork_generation != g_book_generations.forks.load(std::memory_order_relaxed)) {
        return nullptr;  // the whole path: it asks about captures, and closes the book
      }
      return &book;
    }
  }
  return nullptr;
}

// Time division: a book's launches were charged to the container's account when it opened; those never made go back.
void RefundTurn(const DeviceLimiter& d, std::uint64_t ns) {
  if (d.scheduled && ns > 0) turn::Refund(d.ordinal, ns);
}

// Gives a book's unused launches back and clears it. Caller holds book.device->mutex.
void CloseBookLocked(LaunchBook& book) {
  if (book.device == nullptr) return;
  const policy::KernelKey key{book.function, book.shape};
  const bool state_alive = book.generation == g_book_generations.streams.load(std::memory_order_acquire);
  if (book.fork_generation != g_book_generations.forks.load(std::memory_order_relaxed)) {
    // Inherited over fork: the parent's to give back.
  } else if (book.window) {
    if (book.left > 0) book.device->limiter->Cancel(key, std::uint64_t{book.left} * book.accounted_each_ns);
    RefundTurn(*book.device, std::uint64_t{book.left} * book.charged_ns);
    StreamState& state = *book.state;
    if (state_alive && state.window_seq.load(std::memory_order_seq_cst) == book.window_seq) {
      // Its window goes on: the launches it made join the window's own, its reservation ends. (Had the window ended,
      // its launches went with it.)
      FoldBooked(*book.device, state, static_cast<int>(&book - t_books.book));
      state.estimated_ns -= std::min(state.estimated_ns, std::uint64_t{book.left} * book.accounted_each_ns);
      state.booked_reserved -= std::min(state.booked_reserved, book.granted);
    }
  } else {
    book.device->limiter->Refund(key, book.left, book.accounted_each_ns);
    RefundTurn(*book.device, std::uint64_t{book.left} * book.charged_ns);
    if (state_alive) {
      if (book.state->books > 0) --book.state->books;
      book.state->last_launch_ns = std::max(book.state->last_launch_ns, book.last_ns);
      // A book the stream's queue ended after a few launches (bursts of launches queued back to back): the next
      // books on this stream would each cost a grant and a return for as little; none for a while.
      if (book.queued && book.granted - book.left < kBookWorthLaunches) book.state->books_skipped = kBookBackoff;
    }
  }
  book = LaunchBook{};
}

// The whole path for a launch of this kernel on this stream: the thread's book for them, if any, is closed first.
// Returns whether the book's last draw picked this launch to be measured.
bool CloseBookFor(const void* function, std::uint64_t shape, CUstream stream) {
  for (LaunchBook& book : t_books.book) {
    if (book.device != nullptr && book.function == function && book.shape == shape && book.stream == stream) {
      const bool measure = book.measure_next && book.left == 0;
      std::lock_guard<std::mutex> guard(book.device->mutex);
      CloseBookLocked(book);
      return measure;
    }
  }
  return false;
}

// How many of this thread's books are open on `state` (the others are other threads'). Caller holds d.mutex.
std::uint32_t OwnBooksOn(const DeviceLimiter& d, const StreamState* state) {
  std::uint32_t own = 0;
  for (const LaunchBook& book : t_books.book) {
    own += book.device == &d && !book.window && book.state == state &&
           book.generation == g_book_generations.streams.load(std::memory_order_relaxed);
  }
  return own;
}

// A free place for a book in this thread's, or null. Evicts a book of this device if there is none (one of another
// device is left alone: its mutex is not held). Caller holds d.mutex.
LaunchBook* FreeBookPlace(DeviceLimiter& d) {
  for (LaunchBook& book : t_books.book) {
    if (book.device == nullptr) return &book;
  }
  LaunchBook& victim = t_books.book[t_books.next_evicted++ % kBooks];
  if (victim.device != &d) return nullptr;
  CloseBookLocked(victim);
  return &victim;
}

// After a launch planned unmeasured on `stream` (no window open there): a book of the launches after it. Caller holds
// d.mutex. Evicts a book of this device if the thread has no free place (one of another device is left alone: its
// mutex is not held).
std::uint64_t OpenBook(DeviceLimiter& d, const policy::KernelKey& key, CUstream stream, CUcontext context,
                       std::uint64_t estimate_ns, bool steady, std::uint64_t now, std::uint64_t turn_until_ns) {
  StreamState& state = StateOf(d, stream);
  if (state.many_threads || state.start != nullptr || state.launching.load(std::memory_order_relaxed) > 0) return 0;
  if (state.books_skipped > 0) {
    --state.books_skipped;
    return 0;
  }
  LaunchBook* place = FreeBookPlace(d);
  if (place == nullptr) return 0;
  // The launches the sampling leaves unmeasured next, drawn now; the book ends before the first one it measures.
  std::uint32_t unmeasured = 0;
  bool measure_next = false;
  const std::uint64_t one_in = MeasuredOneIn(estimate_ns, steady);
  if (one_in <= 1) return 0;  // every launch measured: nothing to book
  while (unmeasured < kBookLaunches && !(measure_next = DrawMeasured(one_in))) ++unmeasured;
  std::uint64_t each = 0;
  const std::uint32_t granted = d.limiter->AdmitBook(key, now, unmeasured, kBookNs, each);
  if (granted == 0) return 0;
  *place = LaunchBook{key.function, key.shape, stream, context, &d, &state,
                      g_book_generations.streams.load(std::memory_order_acquire),
                      g_book_generations.forks.load(std::memory_order_relaxed), each, estimate_ns, now, granted,
                      granted, measure_next && granted == unmeasured, false, false, 0, turn_until_ns};
  ++state.books;
  VGPU_COUNT(books_opened, 1);
  VGPU_COUNT(book_launches_granted, granted);
  return std::uint64_t{granted} * estimate_ns;
}

// After a launch planned into `state`'s open window that does not fill it: a book of the launches of the same kernel
// after it, into the same window, as many as it has room for. Caller holds d.mutex.
std::uint64_t OpenWindowBook(DeviceLimiter& d, const policy::KernelKey& key, CUstream stream, CUcontext context,
                             StreamState& state, std::uint64_t now, std::uint64_t turn_until_ns) {
  // (A window another thread has asked to end, waiting for the launches into it, gets no book.)
  if (state.many_threads || state.start == nullptr || state.close_when_done.load(std::memory_order_relaxed)) return 0;
  const std::size_t used = state.launches.size() + state.booked_reserved;
  if (used >= kWindowLaunches || state.estimated_ns >= kWindowNs) return 0;
  LaunchBook* place = FreeBookPlace(d);
  if (place == nullptr) return 0;
  std::uint64_t each = 0;
  const std::uint32_t granted = d.limiter->AdmitWindowBook(
      key, now, std::min<std::uint32_t>(kWindowBookLaunches, static_cast<std::uint32_t>(kWindowLaunches - used)),
      std::min(kBookNs, kWindowNs - state.estimated_ns), each);
  if (granted == 0) return 0;
  StreamState::Booked& booked = state.booked[place - t_books.book];
  booked.key = key;
  booked.charged_ns = each;
  state.booked_reserved += granted;
  state.estimated_ns += std::uint64_t{granted} * each;
  *place = LaunchBook{key.function, key.shape, stream, context, &d, &state,
                      g_book_generations.streams.load(std::memory_order_acquire),
                      g_book_generations.forks.load(std::memory_order_relaxed), each, each, now, granted, granted,
                      false, false, true, state.window_seq.load(std::memory_order_seq_cst), turn_until_ns};
  VGPU_COUNT(window_books_opened, 1);
  VGPU_COUNT(book_launches_granted, granted);
  return std::uint64_t{granted} * each;
}

// Whether a booked launch goes where its book was given. A launch into an ordinary stream runs in that stream's
// context; the null and per-thread streams are the current context's, and where the process sees several devices a
// stream handle may have been reused in another device's context: then the current context is asked.
bool BookContextCurrent(const LaunchBook& book) {
  if (reinterpret_cast<std::uintptr_t>(book.stream) > reinterpret_cast<std::uintptr_t>(CU_STREAM_PER_THREAD) &&
      OneDevice()) {
    return true;
  }
  CUcontext current = nullptr;
  return Real::cuCtxGetCurrent != nullptr && Real::cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == book.context;
}

// A launch into a window is no longer being made (see CloseWindow): the last one closes the window if asked to.
void EndLaunching(DeviceLimiter& d, CUstream stream, StreamState& state) {
  if (state.launching.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
      state.close_when_done.load(std::memory_order_seq_cst)) {
    std::lock_guard<std::mutex> guard(d.mutex);
    if (state.close_when_done.load(std::memory_order_relaxed)) CloseWindow(d, stream, state, NowNs(), false);
  }
}

// A launch through a book into its stream's window, if that window is still open (true: made, `result` the
// driver's answer); false: the whole path.
template <typename Launch>
bool LaunchIntoWindow(LaunchBook& book, Launch& launch, CUresult& result) {
  StreamState& state = *book.state;
  state.launching.fetch_add(1, std::memory_order_seq_cst);
  if (state.window_seq.load(std::memory_order_seq_cst) != book.window_seq || !BookContextCurrent(book)) {
    EndLaunching(*book.device, book.stream, state);
    return false;
  }
  // As a planned launch: one onto a stream that has drained by the host's estimate does not join the window (the
  // window would time the idle GPU until it came); the whole path closes the window there, idle time left out.
  const std::uint64_t now = NowNs();
  const std::uint64_t busy_until = state.busy_until_ns.load(std::memory_order_relaxed);
  if (busy_until <= now + book.charged_ns / 2 || now + book.charged_ns > book.turn_until_ns) {
    EndLaunching(*book.device, book.stream, state);
    return false;
  }
  state.busy_until_ns.store(std::max(busy_until, now) + book.charged_ns, std::memory_order_relaxed);
  state.booked_last_ns.store(now, std::memory_order_relaxed);
  --book.left;
  std::atomic<std::uint32_t>& made = state.booked[&book - t_books.book].made;
  made.fetch_add(1, std::memory_order_relaxed);
  result = launch();
  if (result != CUDA_SUCCESS) {  // nothing ran: nothing is owed
    made.fetch_sub(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> guard(book.device->mutex);
    book.device->limiter->Cancel(policy::KernelKey{book.function, book.shape}, book.accounted_each_ns);
    RefundTurn(*book.device, book.charged_ns);
  }
  EndLaunching(*book.device, book.stream, state);
  return true;
}

// A launch through a book onto its drained stream, if the stream has drained by the host's estimate (true: made,
// `result` the driver's answer); false: the whole path. A launch that would queue is not made here: a queue is
// measured by windows (a pair in a queue also times its own events: tiny kernels over-charged).
template <typename Launch>
bool LaunchOntoDrained(LaunchBook& book, Launch& launch, CUresult& result) {
  StreamState& state = *book.state;
  const std::uint64_t now = NowNs();
  const std::uint64_t busy_until = state.busy_until_ns.load(std::memory_order_relaxed);
  book.queued = busy_until > now + book.charged_ns / 2;
  if (book.queued || now + book.charged_ns > book.turn_until_ns || !BookContextCurrent(book)) return false;
  state.busy_until_ns.store(std::max(busy_until, now) + book.charged_ns, std::memory_order_relaxed);
  book.last_ns = now;
  --book.left;
  result = launch();
  if (result != CUDA_SUCCESS) {  // nothing ran: nothing is owed
    std::lock_guard<std::mutex> guard(book.device->mutex);
    book.device->limiter->Refund(policy::KernelKey{book.function, book.shape}, 1, book.accounted_each_ns);
    RefundTurn(*book.device, book.charged_ns);
  }
  return true;
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
  Log(after < before ? 2 : 3, "device %d: the node monitor shows the container at %u.%u %% of the SM time against "
      "%u.%u %%: this process's rate scaled to %u.%u %% of its share", ordinal, used / 10, used % 10, limit / 10,
      limit % 10, after / 10, after % 10);
}

// Time division (turn.h): the launch waits for its container's turn on the GPU, before it is admitted, so that the
// measurement it is planned into starts after the wait. Before it waits, the context's open windows are closed:
// their queues drain meanwhile, and a window held open over the wait would time it. Nothing to do where the limiter
// holds the cap.
struct TurnCaller {
  DeviceLimiter& d;
  CUcontext context;  // null: no current context (nothing is measured)

  static std::uint64_t Longest(void* self) {
    auto& caller = *static_cast<TurnCaller*>(self);
    std::lock_guard<std::mutex> guard(caller.d.mutex);
    return caller.d.limiter->LongestEstimateNs();
  }
  static bool Drained(void* self) {
    auto& caller = *static_cast<TurnCaller*>(self);
    // (A stream being captured must not be queried: while any capture may be in progress, nothing is said drained.)
    if (caller.context == nullptr || Real::cuStreamQuery == nullptr || g_captures.load() != 0) return false;
    std::lock_guard<std::mutex> guard(caller.d.mutex);
    for (const auto& [stream, state] : caller.d.streams) {
      if (state.context == caller.context && Real::cuStreamQuery(stream) == CUDA_ERROR_NOT_READY) return false;
    }
    return true;
  }
  static void BeforeWait(void* self) {
    auto& caller = *static_cast<TurnCaller*>(self);
    if (caller.context == nullptr) return;
    std::lock_guard<std::mutex> guard(caller.d.mutex);
    CloseWindowsOf(caller.d, caller.context, NowNs());
  }
};

turn::Ticket TakeTurn(DeviceLimiter& d, int ordinal, const policy::KernelKey& key, CUcontext context,
                      const void* function) {
  if (!d.scheduled) return {};
  std::uint64_t estimate_ns = 0;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    estimate_ns = d.limiter->EstimateNs(key);
  }
  TurnCaller caller{d, context};
  return turn::Take(ordinal, estimate_ns, {&caller, TurnCaller::Longest, TurnCaller::BeforeWait, TurnCaller::Drained},
                    function);
}

// Admits, waits, launches, measures. `launch` performs the real launch on `stream`; `per_thread` says that a null
// stream means the per-thread default stream (the _ptsz entry points).
template <typename Launch>
CUresult LimitedCompute(const void* function, std::uint64_t shape, CUstream stream, bool per_thread, Launch&& launch) {
  Shim& shim = TheShim();
  if (CurrentMode() != Mode::limited || !shim.compute_limits) return launch();
  // (A _ptsz entry point's null stream is the per-thread stream: asked about and recorded on as such.)
  if (per_thread && stream == nullptr) stream = CU_STREAM_PER_THREAD;
  // A launch the thread's book admitted already: nothing else to do (no capture in progress, the book's context the
  // one the launch goes to).
  if (LaunchBook* book = OpenBookFor(function, shape, stream)) {
    CUresult result = CUDA_SUCCESS;
    if (book->window ? LaunchIntoWindow(*book, launch, result) : LaunchOntoDrained(*book, launch, result)) {
      if (book->window) VGPU_COUNT(booked_window, 1); else VGPU_COUNT(booked_drained, 1);
      return result;
    }
    if (book->window) VGPU_COUNT(book_refused_window, 1); else VGPU_COUNT(book_refused_queued, 1);
  }
  VGPU_COUNT(whole_path, 1);
  const bool force_sample = CloseBookFor(function, shape, stream);
  // A launch into a stream being captured records a graph node, it runs nothing now: it is admitted when the
  // graph is launched. Nothing may be queried or recorded meanwhile (that would invalidate the capture). Asked
  // only while some capture may be in progress (g_captures).
  if (g_captures.load(std::memory_order_acquire) != 0) {  // (below zero: a capture ended that began unseen)
    CUstreamCaptureStatus capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    if (Real::cuStreamIsCapturing != nullptr && Real::cuStreamIsCapturing(stream, &capturing) == CUDA_SUCCESS &&
        capturing != CU_STREAM_CAPTURE_STATUS_NONE) {
      return launch();
    }
  }
  // The events live in the current context (pooled per context, destroyed with it): without it, nothing is measured.
  CUcontext context = nullptr;
  CUresult setup = Real::cuCtxGetCurrent != nullptr ? Real::cuCtxGetCurrent(&context) : CUDA_ERROR_NOT_FOUND;
  if (setup == CUDA_SUCCESS && context == nullptr) setup = CUDA_ERROR_INVALID_CONTEXT;
  // A launch whose device cannot be told, or cannot be named in the region, is refused with the driver's error:
  // run unadmitted, it would escape the cap. (No current context at all: the driver refuses the launch itself.)
  CUresult unknown = CUDA_SUCCESS;
  const int ordinal = setup == CUDA_SUCCESS && OneDevice() ? 0 : CurrentOrdinal(unknown);
  if (ordinal < 0) return unknown != CUDA_SUCCESS ? unknown : launch();
  DeviceLimiter* d = LimiterFor(ordinal, unknown);
  if (d == nullptr) return unknown != CUDA_SUCCESS ? unknown : launch();
  const policy::KernelKey key{function, shape};
  std::uint64_t now = NowNs();
  if (now >= d->verdict_checked_ns.load(std::memory_order_relaxed) + kVerdictCheckNs) {
    d->verdict_checked_ns.store(now, std::memory_order_relaxed);  // a benign race: two threads may both look
    FollowVerdict(*d, ordinal, now);
  }
  if (d->lend && now >= d->last_observed_ns + kObserveOthersEveryNs) {
    d->last_observed_ns = now;  // a benign race: at worst two threads read NVML in the same period
    std::uint64_t period_start = 0;
    const double others = OthersBusy(ordinal, now, period_start);
    // A reading of a period that began before the container was held blind describes the free-running time before
    // it (the container's own busy time then, stretched by whoever arrived, hides them): not a reading of now.
    if (others >= 0 && period_start >= d->held_blind_ns) {
      d->last_reading_ns = now;
      std::lock_guard<std::mutex> guard(d->mutex);
      d->limiter->ObserveOthers(others, now);
    } else if (now >= d->last_reading_ns + kStaleReadingNs) {
      // No reading for a while (NVML failing, or answering what cannot be read): nobody can say the GPU is free, so
      // the container is held to its share until readings come back.
      if (d->held_blind_ns <= d->last_reading_ns) d->held_blind_ns = now;  // once per blind spell
      std::lock_guard<std::mutex> guard(d->mutex);
      d->limiter->ObserveOthers(1.0, now);
    }
  }
  const turn::Ticket ticket = TakeTurn(*d, ordinal, key, setup == CUDA_SUCCESS ? context : nullptr, function);
  if (ticket.waited_ns > 0) now = NowNs();
  // Under time division, books only inside the container's own window (their launches charged when they open).
  const bool may_book = !d->scheduled || ticket.turn_until_ns > now;
  std::uint64_t booked_ns = 0;
  policy::Admission admission;
  Plan plan;
  bool planned = false;
  bool unknown_cost = true;  // the kernel's events have never measured it
  bool settled_early = false;  // an unmeasured launch, settled in its admission's critical section
  std::uint64_t accounted_early = 0;
  std::uint64_t waited_ns = 0;
  for (;;) {
    std::unique_lock<std::mutex> guard(d->mutex);
    if (now >= d->next_settle_ns || d->pending.size() >= kSettleBacklog || waited_ns > 0) {
      SettleCompleted(*d, now);
      d->limiter->FlushBusy();
      d->next_settle_ns = now + kSettleEveryNs;
    }
    // Past the longest wait for completions (nothing measured is pending to settle), admit without the in-flight
    // bound rather than wait forever.
    const bool bound = !(d->pending.empty() && waited_ns >= kMaxCompletionWaitNs);
    // (A kernel its events have never measured runs one launch at a time: its runs are then timed from the host
    // closely, launch to completion, never across a queue of others. Admit sees to it.)
    admission = d->limiter->Admit(key, now, bound);
    if (!admission.wait_for_completion) {
      // (Measured kernels stay known: a launch planned later may read `unknown` from before a wait.)
      unknown_cost = !admission.known;
      if (admission.ready_at_ns <= now) {
        if (!PlanOrCancel(*d, plan, key, admission.launches, admission.steady, force_sample, stream, context, setup,
                          admission.charged_ns, now, unknown_cost)) {
          return CUDA_ERROR_OUT_OF_MEMORY;
        }
        planned = true;  // the common case
        if (plan.how == How::window && !plan.close_after && !plan.unknown_cost && setup == CUDA_SUCCESS &&
            may_book) {  // the launches after it, into its window
          booked_ns = OpenWindowBook(*d, key, stream, context, *plan.stream, now, ticket.turn_until_ns);
        }
        if (plan.how == How::unmeasured && !plan.unknown_cost && plan.start == nullptr && plan.end == nullptr) {
          // The common case on a drained stream: what such a launch costs does not depend on its run, so it is
          // settled now, in this critical section (given back below if the driver refuses the launch).
          accounted_early = d->limiter->SettleUnmeasured(key, admission.charged_ns, now);
          settled_early = true;
          if (setup == CUDA_SUCCESS && may_book) {
            booked_ns = OpenBook(*d, key, stream, context, admission.charged_ns, admission.steady, now,
                                 ticket.turn_until_ns);
          }
        }
      } else if (setup == CUDA_SUCCESS) {
        // Throttled: the queue each open window measures is complete until after the wait; it ends there, exactly.
        CloseWindowsOf(*d, context, now);
      }
      break;
    }
    // Too much queued unmeasured: wait, outside the lock, for completions, polling (never blocking on one
    // event: it may wait for work this very thread has yet to launch). Open windows are closed first (their
    // launches count as queued until measured). After kMaxCompletionWaitNs the oldest is settled at its estimate,
    // so a launch never waits forever.
    if (waited_ns == 0 && setup == CUDA_SUCCESS) CloseWindowsOf(*d, context, now);
    if (!d->pending.empty() && waited_ns >= kMaxCompletionWaitNs) {
      Pending oldest = std::move(d->pending.front());
      d->pending.pop_front();
      if (oldest.is_window) {
        d->limiter->SettleWindow(oldest.window.data(), oldest.window.size(), std::nullopt, now);
      } else {
        d->limiter->SettleUnmeasured(oldest.key, oldest.charged_ns, now);
      }
      // Its events are reused only once they have completed (out of host memory: never, they are left).
      (void)Recorded([&] { d->abandoned.push_back(std::move(oldest)); });
      waited_ns = 0;
      continue;
    }
    guard.unlock();
    VGPU_COUNT(waited_for_completion, 1);
    SleepUntilNs(now + kCompletionPollNs);
    waited_ns += kCompletionPollNs;
    now = NowNs();
  }
  // Why a launch waited, and how long (LIBCUDA_LOG_LEVEL=4): a collapse explains itself in the log.
  if (waited_ns > 0) {
    Log(4, "device %d: a launch of %p waited %llu us for completions: the container's unmeasured work in flight "
        "was past its bound", ordinal, function, static_cast<unsigned long long>(waited_ns / 1000));
  }
  const std::uint64_t at = std::max(now, admission.ready_at_ns);  // about now: one clock read per launch
  if (!planned) {
    VGPU_COUNT(waited_for_budget, 1);
    VGPU_COUNT(waited_for_budget_ns, admission.ready_at_ns > now ? admission.ready_at_ns - now : 0);
    const std::uint64_t wait_ns = admission.ready_at_ns > now ? admission.ready_at_ns - now : 0;
    Log(4, "device %d: a launch of %p waits %llu us for the budget: charged %llu us, the container is in debt at its "
        "cap", ordinal, function, static_cast<unsigned long long>(wait_ns / 1000),
        static_cast<unsigned long long>(admission.charged_ns / 1000));
    SleepUntilNs(admission.ready_at_ns);
    std::lock_guard<std::mutex> guard(d->mutex);
    if (!PlanOrCancel(*d, plan, key, admission.launches, admission.steady, force_sample, stream, context, setup, admission.charged_ns,
                      at, unknown_cost)) {
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }

  VGPU_COUNT(whole_path_charged_ns, admission.charged_ns);
  if (plan.how == How::window) VGPU_COUNT(planned_window, 1);
  else if (plan.how == How::unmeasured) VGPU_COUNT(planned_unmeasured, 1);
  else if (plan.gate) VGPU_COUNT(planned_gated_pair, 1);
  else VGPU_COUNT(planned_pair, 1);
  if (settled_early) VGPU_COUNT(settled_early, 1);
  std::uint64_t launched_ns = 0;
  gates::Gate gate;
  if (plan.how == How::pair) {
    RelaxedCapture relaxed;
    launched_ns = NowNs();
    if (plan.gate) (void)gates::Shut(stream, context, gate);
    setup = Real::cuEventRecord(plan.start, stream);
    if (setup != CUDA_SUCCESS) plan.how = How::unmeasured;
  }
  if (plan.unknown_cost && plan.how != How::pair) {
    // Its cost is unknown and this run could not be measured: settled at a guess, a kernel of any length would run
    // uncapped. Refused with the error that kept it from being measured; nothing ran, nothing is owed.
    std::lock_guard<std::mutex> guard(d->mutex);
    d->limiter->Cancel(key, admission.charged_ns);
    ReturnEvent(*d, context, plan.start);
    ReturnEvent(*d, context, plan.end);
    return setup != CUDA_SUCCESS ? setup : CUDA_ERROR_UNKNOWN;
  }
  const CUresult result = launch();
  // The launch call has returned: the stream may go on. (Whether it ran or not, a shut gate is opened.)
  (void)gates::Open(gate);
  // (A book opened for the launches after this one is charged whether or not this one ran: closing it refunds.)
  turn::Released(ordinal, ticket, (result == CUDA_SUCCESS ? admission.charged_ns : 0) + booked_ns);
  if (settled_early) {
    if (result != CUDA_SUCCESS) {  // nothing ran: nothing is owed, and the launches after it get no book
      {
        std::lock_guard<std::mutex> guard(d->mutex);
        d->limiter->Refund(key, 1, accounted_early);
      }
      (void)CloseBookFor(function, shape, stream);
    }
    return result;
  }
  // (A kernel of unknown cost gets a second try at its end event: unmeasured, it would be settled at a guess.)
  if (plan.how == How::pair && result == CUDA_SUCCESS) {
    RelaxedCapture relaxed;
    if (Real::cuEventRecord(plan.end, stream) != CUDA_SUCCESS &&
        (!plan.unknown_cost || Real::cuEventRecord(plan.end, stream) != CUDA_SUCCESS)) {
      plan.how = How::unmeasured;
    }
  }
  // A launch that joined a window, and does not fill it, is done: its charge is settled with the window (unless it
  // is the last of several in flight and a close waits for it).
  bool close_window = false;
  if (plan.how == How::window) {
    // (Sequentially consistent, as in EndLaunching: a close asked for meanwhile sees this launch, or it sees the close.)
    const bool last = plan.stream->launching.fetch_sub(1, std::memory_order_seq_cst) == 1;
    close_window = plan.close_after || (last && plan.stream->close_when_done.load(std::memory_order_seq_cst));
    if (result == CUDA_SUCCESS && !close_window) return result;
  }

  if (result == CUDA_SUCCESS && plan.how == How::unmeasured && plan.start == nullptr && plan.end == nullptr) {
    // Planned after a wait: settled at what such a launch costs, nothing else to do.
    std::lock_guard<std::mutex> guard(d->mutex);
    d->limiter->SettleUnmeasured(key, admission.charged_ns, at);
    return result;
  }
  std::lock_guard<std::mutex> guard(d->mutex);
  StreamState* state = nullptr;
  if (const auto it = d->streams.find(stream); it != d->streams.end() && it->second.context == context) {
    state = &it->second;
  }
  if (result != CUDA_SUCCESS) {
    // Nothing ran: nothing is owed. A window's launch is taken out of it, unless the window has been closed
    // meanwhile (another thread): it is then settled with the window, which timed no kernel for it.
    bool owed_nothing = plan.how != How::window;
    if (!owed_nothing && state != nullptr) {
      for (auto it = state->launches.rbegin(); it != state->launches.rend(); ++it) {
        if (it->key == key && it->charged_ns == admission.charged_ns) {
          state->estimated_ns -= it->charged_ns;
          state->launches.erase(std::next(it).base());
          owed_nothing = true;
          break;
        }
      }
    }
    if (owed_nothing) d->limiter->Cancel(key, admission.charged_ns);
    ReturnEvent(*d, context, plan.start);
    ReturnEvent(*d, context, plan.end);
    if (state != nullptr && close_window) CloseWindow(*d, stream, *state, at, false);
    return result;
  }
  if (plan.how == How::pair &&
      !Recorded([&] {
        d->pending.push_back({key, admission.charged_ns, plan.start, plan.end, context, launched_ns, {}, false, 0,
                              state == nullptr || state->planned != plan.sequence ||
                                  state->books > OwnBooksOn(*d, state)});
        d->pending.back().first = admission.launches == 0;
      })) {
    plan.how = How::unmeasured;  // out of host memory: the kernel ran, settled as one that was not measured
  }
  if (plan.how == How::pair) {
    if (state != nullptr) {
      ReturnEvent(*d, context, state->mark);
      // The next window starts here while the stream stays busy (without memory to hold the event twice: not).
      state->mark = HoldEvent(*d, plan.end) ? plan.end : nullptr;
    }
  } else if (plan.how == How::unmeasured) {
    d->limiter->SettleUnmeasured(key, admission.charged_ns, at);
    ReturnEvent(*d, context, plan.start);
    ReturnEvent(*d, context, plan.end);
  } else if (state != nullptr && close_window) {
    CloseWindow(*d, stream, *state, at, false);  // or leaves it to a launch still in flight
  }
  return result;
}

// Every launch hook's way in: the driver's own memory a first launch takes (driver_memory.h), then the compute limiter.
// `shape` 0 is a graph launch.
template <typename Launch>
CUresult Limited(const void* function, std::uint64_t shape, CUstream stream, bool per_thread, Launch&& launch) {
  if (!TheShim().memory_limits) return LimitedCompute(function, shape, stream, per_thread, launch);
  return LaunchCountingDriverMemory(function, shape == 0,
                                    [&] { return LimitedCompute(function, shape, stream, per_thread, launch); });
}

}  // namespace

void ForgetLaunchBooksAfterFork() {
  g_book_generations.forks.fetch_add(1, std::memory_order_relaxed);
  gates::ForgetAfterFork();
}

void ForgetComputeContext(CUcontext context) {
  gates::ForgetContext(context);  // a gate word in its pinned memory goes with it
  for (DeviceLimiter& d : g_devices) {
    if (!d.limiter) continue;
    std::lock_guard<std::mutex> guard(d.mutex);
    const std::uint64_t now = NowNs();
    // Its events went with the context: settle what was pending at its estimate, never touch those events again.
    for (auto* queue : {&d.pending, &d.abandoned}) {
      for (auto it = queue->begin(); it != queue->end();) {
        if (it->context == context) {
          if (queue == &d.pending && it->is_window) {
            d.limiter->SettleWindow(it->window.data(), it->window.size(), std::nullopt, now);
          } else if (queue == &d.pending) {
            d.limiter->SettleUnmeasured(it->key, it->charged_ns, now);
          }
          d.extra_owners.erase(it->start);
          d.extra_owners.erase(it->end);
          it = queue->erase(it);
        } else {
          ++it;
        }
      }
    }
    d.last_stream = nullptr;
    d.last_state = nullptr;
    g_book_generations.streams.fetch_add(1, std::memory_order_acq_rel);  // books lose their stream states
    for (auto it = d.streams.begin(); it != d.streams.end();) {
      if (it->second.context == context) {
        DropStreamState(d, it->second, now, false);
        it = d.streams.erase(it);
      } else {
        ++it;
      }
    }
    d.free_events.erase(context);
  }
}

}  // namespace vgpu::hooks

using namespace vgpu::hooks;

#define VGPU_LAUNCH_FUNCTION_CHECK(real)                    \
  do {                                                      \
    if (Real::real == nullptr) ResolveReal();               \
    if (Real::real == nullptr) return CUDA_ERROR_NOT_FOUND; \
    if (CurrentMode() == Mode::failed) return kFailedClosedCuda; \
  } while (0)

extern "C" VGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                              unsigned bz, unsigned shared, CUstream stream, void** params, void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernel);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, false,
                 [&] { return Real::cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                   unsigned by, unsigned bz, unsigned shared, CUstream stream, void** params,
                                                   void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernel_ptsz);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, true,
                 [&] { return Real::cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                                         unsigned by, unsigned bz, unsigned shared, CUstream stream,
                                                         void** params) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchCooperativeKernel);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, false,
                 [&] { return Real::cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                              unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                                              CUstream stream, void** params) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchCooperativeKernel_ptsz);
  return Limited(f, ShapeOf(gx, gy, gz, bx, by, bz, shared), stream, true,
                 [&] { return Real::cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shared, stream, params); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernelEx);
  if (config == nullptr) return Real::cuLaunchKernelEx(config, f, params, extra);
  return Limited(f,
                 ShapeOf(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                         config->blockDimZ, config->sharedMemBytes),
                 config->hStream, false, [&] { return Real::cuLaunchKernelEx(config, f, params, extra); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** params,
                                                     void** extra) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuLaunchKernelEx_ptsz);
  if (config == nullptr) return Real::cuLaunchKernelEx_ptsz(config, f, params, extra);
  return Limited(f,
                 ShapeOf(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                         config->blockDimZ, config->sharedMemBytes),
                 config->hStream, true, [&] { return Real::cuLaunchKernelEx_ptsz(config, f, params, extra); });
} VGPU_CUDA_CATCH

// A graph launch is admitted and measured as one unit: its key is the executable graph.
extern "C" VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec graph, CUstream stream) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuGraphLaunch);
  return Limited(graph, 0, stream, false, [&] { return Real::cuGraphLaunch(graph, stream); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec graph, CUstream stream) try {
  VGPU_LAUNCH_FUNCTION_CHECK(cuGraphLaunch_ptsz);
  return Limited(graph, 0, stream, true, [&] { return Real::cuGraphLaunch_ptsz(graph, stream); });
} VGPU_CUDA_CATCH

// ---- stream capture: counted, so that launches need no capture check while nothing is captured (g_captures) ----

namespace {

// Whether the driver says `stream` is capturing (an invalidated capture too: it still has to be ended). A query that
// fails counts as capturing: the count then stays up, which is only slower.
bool Capturing(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (Real::cuStreamIsCapturing == nullptr || Real::cuStreamIsCapturing(stream, &status) != CUDA_SUCCESS) return true;
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

template <typename Begin>
CUresult CountedBegin(Begin&& begin) {
  g_captures.fetch_add(1, std::memory_order_acq_rel);
  const CUresult result = begin();
  if (result != CUDA_SUCCESS) g_captures.fetch_sub(1, std::memory_order_acq_rel);
  return result;
}

// `stream` as the driver names it for the non-_ptsz query (a _ptsz call's null stream is the per-thread stream).
template <typename End>
CUresult CountedEnd(CUstream stream, End&& end) {
  const bool was = Capturing(stream);
  const CUresult result = end();
  if (was && !Capturing(stream)) g_captures.fetch_sub(1, std::memory_order_acq_rel);
  return result;
}

}  // namespace

#define VGPU_CAPTURE_FUNCTION_CHECK(real)                   \
  do {                                                      \
    if (Real::real == nullptr) ResolveReal();               \
    if (Real::real == nullptr) return CUDA_ERROR_NOT_FOUND; \
  } while (0)

// (The CUDA 10.0 entry points, without a mode: a global-mode capture.)
extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture(CUstream stream) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamBeginCapture);
  return CountedBegin([&] { return Real::cuStreamBeginCapture(stream); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream stream) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamBeginCapture_ptsz);
  return CountedBegin([&] { return Real::cuStreamBeginCapture_ptsz(stream); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamBeginCapture_v2);
  return CountedBegin([&] { return Real::cuStreamBeginCapture_v2(stream, mode); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream stream, CUstreamCaptureMode mode) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamBeginCapture_v2_ptsz);
  return CountedBegin([&] { return Real::cuStreamBeginCapture_v2_ptsz(stream, mode); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream stream, CUgraph graph, const CUgraphNode* dependencies,
                                                           const CUgraphEdgeData* edges, size_t count,
                                                           CUstreamCaptureMode mode) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamBeginCaptureToGraph);
  return CountedBegin([&] { return Real::cuStreamBeginCaptureToGraph(stream, graph, dependencies, edges, count, mode); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream stream, CUgraph graph,
                                                                const CUgraphNode* dependencies,
                                                                const CUgraphEdgeData* edges, size_t count,
                                                                CUstreamCaptureMode mode) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamBeginCaptureToGraph_ptsz);
  return CountedBegin(
      [&] { return Real::cuStreamBeginCaptureToGraph_ptsz(stream, graph, dependencies, edges, count, mode); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamEndCapture(CUstream stream, CUgraph* graph) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamEndCapture);
  return CountedEnd(stream, [&] { return Real::cuStreamEndCapture(stream, graph); });
} VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream stream, CUgraph* graph) try {
  VGPU_CAPTURE_FUNCTION_CHECK(cuStreamEndCapture_ptsz);
  return CountedEnd(stream == nullptr ? CU_STREAM_PER_THREAD : stream,
                    [&] { return Real::cuStreamEndCapture_ptsz(stream, graph); });
} VGPU_CUDA_CATCH
