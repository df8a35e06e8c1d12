// The launch path under a compute cap (docs/compute-limit.md, "The launch path"), shared by its units. A launch that
// no book admitted passes these stages, in this order, each in its own file:
//
//   find     launch_device.cc   the current context, the device's ordinal and its limiter (none: no cap, it just goes)
//   observe  launch_observe.cc  the node monitor's verdict; under `default`, the others' use of the GPU (NVML)
//   release  launch_release.cc  time division: the container's turn on the GPU (turn.h)
//   admit    launch_admit.cc    the limiter's budget: settle what completed, wait for completions or the budget
//   measure  launch_measure.cc  how this launch is measured (unmeasured, an event pair, a window), its start recorded
//   (the driver's launch)
//   settle   launch_settle.cc   its end recorded, its charge settled now or queued until its events complete
//
// Books of launches (launch_books.cc) are the fast path beside them: a thread's next launches of one kernel,
// admitted together by the whole path and made with no lock. compute_hooks.cc holds the entry points.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "gates.h"
#include "shim.h"
#include "turn.h"
#include "vgpu/policy/limiter.h"
#include "vgpu/policy/measure.h"

namespace vgpu::hooks::launch {

// Where launches go (libvgpu-path-counters.so, built with VGPU_PATH_COUNTERS=1; docs/compute-limit.md, "Path
// counters"). Off in libvgpu.so: each count is an atomic add on the launch path. At exit the counts are written to
// stderr as one line, "vgpu-path-counters {...}".
#if VGPU_PATH_COUNTERS
// (Left as written: clang-format 14 rewraps this list differently on every run.)
// clang-format off
#define VGPU_PATH_COUNTER_NAMES(X)                                                                                  \
  X(booked_drained) X(booked_window) X(book_refused_queued) X(book_refused_window) X(whole_path)                    \
  X(waited_for_completion) X(waited_for_budget) X(waited_for_budget_ns) X(planned_unmeasured) X(planned_pair)       \
  X(planned_gated_pair) X(planned_window) X(settled_early) X(books_opened) X(window_books_opened)                   \
  X(book_launches_granted) X(whole_path_charged_ns) X(waited_for_close)
// clang-format on
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
extern PathCounters g_path_counters;
#define VGPU_COUNT(name, n) g_path_counters.value[PathCounters::name].fetch_add((n), std::memory_order_relaxed)
#else
#define VGPU_COUNT(name, n) ((void)0)
#endif

// The launch path's clock: the host's CLOCK_MONOTONIC (shim.h), the clock of time division's turns.
inline std::uint64_t NowNs() { return MonotonicNs(); }

// A measurement window (launches queued back to back on one stream, one event between windows) ends after this
// many launches or this much estimated GPU time (policy/measure.h).
using policy::kWindowLaunches;
using policy::kWindowNs;

// Each thread keeps kBooks books of launches (launch_books.cc).
constexpr int kBooks = 4;

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
  std::atomic<bool> ready{false};  // `limiter` is set up: later launches need nothing else to find it
  bool lend = false;
  bool scheduled = false;  // time division holds the cap (turn.h): launches take turns; books only inside one
  // Under time division, the container is out of the schedule's plan (no turns to be had): the limiter holds the cap
  // meanwhile (launch_release.cc). Written under `mutex`, read without it.
  std::atomic<bool> limiter_holds{false};
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
  bool hami_shared = false;  // `default`: HAMi's monitor's utilization_switch as last read (under `mutex`)
};

extern DeviceLimiter g_devices[policy::kMaxDevices];
// Stream captures the process may have in progress (docs/compute-limit.md, "The launch path"). While there are none,
// no stream is capturing and a launch needs no capture check (cuStreamIsCapturing: a driver call on every launch).
// Raised before a capture begins, so that a launch racing with the begin checks; lowered only once the driver says
// the stream it ended is no longer capturing. Too high is only slower; it never reads zero during a capture that
// began through the driver's exported capture entry points, every one of which the shim hooks.
extern std::atomic<std::int64_t> g_captures;

enum class How { unmeasured, pair, window };

// How one launch is measured, decided under d.mutex just before it is made.
struct Plan {
  How how = How::unmeasured;
  StreamState* stream = nullptr;  // a window's stream state (stable: map nodes are erased only with their context)
  CUevent start = nullptr, end = nullptr;  // a pair's events
  bool unknown_cost = false;
  bool close_after = false;    // the launch fills its window: the window ends right after it
  std::uint64_t sequence = 0;  // the stream's `planned` count with this launch
  bool gate = false;           // a pair to gate (gates.h)
};

// One launch on the whole path, carried through the stages.
struct Launching {
  policy::KernelKey key;
  CUstream stream = nullptr;  // (a _ptsz entry point's null stream: CU_STREAM_PER_THREAD)
  bool force_sample = false;  // the book this launch ended had drawn it to be measured
  // find
  CUcontext context = nullptr;
  CUresult setup = CUDA_SUCCESS;  // not CUDA_SUCCESS: no current context, nothing is measured
  int ordinal = -1;
  DeviceLimiter* d = nullptr;
  // release
  turn::Ticket ticket;
  // admit
  std::uint64_t now = 0;  // the last clock read
  policy::Admission admission;
  bool unknown_cost = true;           // the kernel's events have never measured it
  bool planned = false;               // planned under the admission's lock (not after a wait for the budget)
  bool settled_early = false;         // an unmeasured launch, settled in its admission's critical section ...
  std::uint64_t accounted_early = 0;  // ... at this
  std::uint64_t booked_ns = 0;        // a book opened for the launches after this one: their estimate
  std::uint64_t at = 0;               // when the launch is made, about (one clock read per launch)
  // measure
  Plan plan;
  std::uint64_t launched_ns = 0;  // a pair: just before the launch call
  gates::Gate gate;
};

// find (launch_device.cc). Whether the launch is limited: `l.context`, `l.setup`, `l.ordinal` and `l.d` set. False:
// it goes as it is where `refused` is CUDA_SUCCESS (no cap on its device), or is refused with `refused` (its device
// cannot be told or named in the region: run unadmitted, it would escape the cap).
bool Find(Launching& l, CUresult& refused);
DeviceLimiter* LimiterFor(int ordinal, CUresult& error);
// Whether the process sees one device (then a current context is on ordinal 0, with no cuCtxGetDevice per launch).
bool OneDevice();
// Events, pooled per context. Caller holds d.mutex.
CUresult TakeEvent(DeviceLimiter& d, CUcontext context, CUevent& event);
void ReturnEvent(DeviceLimiter& d, CUcontext context, CUevent event) noexcept;
bool HoldEvent(DeviceLimiter& d, CUevent event) noexcept;
// The state of `stream` (made on first use; the last one used is kept at hand). Caller holds d.mutex.
StreamState& StateOf(DeviceLimiter& d, CUstream stream);

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

// observe (launch_observe.cc): the node monitor's verdict, at most every 20 ms; under `default`, the others' use of
// the GPU, every 100 ms. Updates the limiter; no lock held.
void Observe(DeviceLimiter& d, int ordinal, std::uint64_t now);

// release (launch_release.cc): time division's turn (turn::Take); nothing where the limiter holds the cap.
void Release(Launching& l);
// Whether the process's streams on the device have drained (no stream capture in progress, every stream it launched
// on idle).
bool DeviceDrained(int ordinal);
// A synchronize call (compute_hooks.cc), `wait` the driver's: under time division the container's turn on the
// devices where the process has work is held while it waits (turn::BeginBlocking), and its end set from what the
// process's streams say when it returns.
template <typename Wait>
CUresult Synchronizing(Wait&& wait) {
  const std::uint64_t devices = turn::BeginBlocking();
  const CUresult result = wait();
  if (devices != 0) turn::EndBlocking(devices, &DeviceDrained);
  return result;
}

// admit (launch_admit.cc): admitted by the limiter and planned (`l.plan`), after waiting for completions or for the
// budget as told. False: the host is out of memory, the admission cancelled (the launch is refused).
bool Admit(Launching& l);

// measure (launch_measure.cc). Planning, under d.mutex: PlanOrCancel (false: out of host memory, the admission
// cancelled). Then, without it, BeginMeasure just before the launch: CUDA_SUCCESS to launch, otherwise the launch is
// refused with that error (a kernel of unknown cost that cannot be measured; nothing owed).
bool PlanOrCancel(DeviceLimiter& d, Plan& plan, const policy::KernelKey& key, std::uint32_t launches_before,
                  bool steady, bool force_sample, CUstream stream, CUcontext context, CUresult& setup,
                  std::uint64_t charged_ns, std::uint64_t at, bool unknown_cost);
CUresult BeginMeasure(Launching& l);
// Windows (under d.mutex): the launches of book `only` (or all) into `state`'s open window joined to it; the window
// ended (queued to settle); every window of a context ended; a stream's state dropped.
void FoldBooked(DeviceLimiter& d, StreamState& state, int only = -1) noexcept;
void CloseWindow(DeviceLimiter& d, CUstream stream, StreamState& state, std::uint64_t now, bool drained);
void CloseWindowsOf(DeviceLimiter& d, CUcontext context, std::uint64_t now);
void DropStreamState(DeviceLimiter& d, StreamState& state, std::uint64_t now, bool context_alive);
// Sampling: a kernel that usually runs `estimate_ns` is measured one launch in policy::MeasuredOneIn; one draw of
// this thread's policy::Sampler.
bool DrawMeasured(std::uint64_t one_in);

// settle (launch_settle.cc): after the driver's launch call returned `result`; returns what the launch returns.
CUresult Settle(Launching& l, CUresult result);
// Settles every measured launch that has completed. Caller holds d.mutex.
void SettleCompleted(DeviceLimiter& d, std::uint64_t now);
// A context about to be destroyed: what it had pending settled at its estimate, its stream states dropped.
void ForgetContextOn(DeviceLimiter& d, CUcontext context);

// books (launch_books.cc): the fast path.
struct LaunchBook;
// The thread's open book for a launch, or null. Checked before anything else on the launch path.
LaunchBook* OpenBookFor(const void* function, std::uint64_t shape, CUstream stream);
// A launch through `book`: true if it may be made now (then Booked after the driver's call); false: the whole path.
bool BeginBooked(LaunchBook& book);
void Booked(LaunchBook& book, CUresult result);
// The whole path for a launch of this kernel on this stream: the thread's book for them, if any, is closed first.
// Returns whether the book's last draw picked this launch to be measured.
bool CloseBookFor(const void* function, std::uint64_t shape, CUstream stream);
// After a launch planned unmeasured on a stream with no open window, or into a window it does not fill: a book of
// the launches of the same kernel after it; their estimate (0: none). Caller holds d.mutex.
std::uint64_t OpenBook(DeviceLimiter& d, const policy::KernelKey& key, CUstream stream, CUcontext context,
                       std::uint64_t estimate_ns, bool steady, std::uint64_t now, std::uint64_t turn_until_ns);
std::uint64_t OpenWindowBook(DeviceLimiter& d, const policy::KernelKey& key, CUstream stream, CUcontext context,
                             StreamState& state, std::uint64_t now, std::uint64_t turn_until_ns);
// How many of this thread's books are open on `state`. Caller holds d.mutex.
std::uint32_t OwnBooksOn(const DeviceLimiter& d, const StreamState* state);
// The calling thread, as books know it.
const void* ThisThread();
// Books lose their stream states (a context's went) / the books a fork child inherited are its parent's.
void ForgetBookStates();
void ForgetBooksAfterFork();
// Time division: launches of `book` charged to the container's account that were never made go back.
void RefundTurn(const LaunchBook& book, std::uint64_t ns);

}  // namespace vgpu::hooks::launch
