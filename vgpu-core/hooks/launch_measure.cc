// The launch path's "measure" stage (launch.h): how each launch is measured, decided under d.mutex just before it is
// made (docs/compute-limit.md, "Measurement windows"): unmeasured (settled at what such a launch costs), an event
// pair of its own, or a window of launches queued back to back on one stream; and the start of its measurement.
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "launch.h"
#include "vgpu/policy/measure.h"

namespace vgpu::hooks::launch {
namespace {

// A measured launch of a kernel shorter than this is gated (gates.h): its pair then times the GPU's part of the launch,
// not the host's launch call (~3 us on an H100: most of a tiny kernel's pair). A longer kernel's pair is left ungated:
// the call is a few percent of it at most, and each gate leaves the context with nothing to run until the host writes
// the word, which under time-slicing hands the GPU to another container (kernels of this length are measured at every
// launch unless they are steady: see MeasuredOneIn).
constexpr std::uint64_t kGateBelowNs = 250'000;

}  // namespace

// Adds the launches made through books into the open window (the place of book `only`, or all) to its launches.
// Caller holds d.mutex, and no launch into the window is being made (`launching` zero) or the places are the caller's.
void FoldBooked(DeviceLimiter& d, StreamState& state, int only) noexcept {
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

namespace {

// The process's sampling seed: drawn once (getrandom; the pid where that fails).
std::uint64_t ProcessSeed() {
  static const std::uint64_t seed = [] {
    std::uint64_t drawn = 0;
    if (getrandom(&drawn, sizeof drawn, 0) != static_cast<ssize_t>(sizeof drawn)) {
      drawn = static_cast<std::uint64_t>(getpid());
    }
    return drawn;
  }();
  return seed;
}

// This thread's draws of which launches are measured (two event records each, a few microseconds on a real GPU).
// Random, so that a tenant cannot put its heavy work where nothing is measured; unmeasured launches are settled at
// the mean of the measured ones (Limiter::SettleUnmeasured). A draw per launch, not a clock: measuring "the first
// launch after a pause" would pick the launches whose event pair also times the host's gap before an idle stream
// starts them (5 us kernels at a 30 % cap got 27 %). Seeded per thread from a seed the process draws once (getrandom:
// a tenant cannot tell from outside which of its launches will be measured) and the thread's order of arrival
// (policy/sampling.h). (initial-exec: the shim is loaded with the process, so its thread-locals are read without
// __tls_get_addr.)
policy::Sampler& ThreadSampler() {
  static std::atomic<std::uint64_t> threads{0};
  static thread_local policy::Sampler sampler __attribute__((tls_model("initial-exec")));
  if (!sampler.seeded()) {
    const std::uint64_t thread = threads.fetch_add(1, std::memory_order_relaxed);
    sampler.Seed(policy::SamplerSeed(ProcessSeed(), thread));
  }
  return sampler;
}

}  // namespace

bool DrawMeasured(std::uint64_t one_in) { return ThreadSampler().Draw(one_in); }

namespace {

// The state of `stream` made ready for a launch in `context` (a stream handle of another context, reused: the old
// state dropped). What this needs from the heap comes before it changes anything: if the host is out of memory, the
// caller cancels the admission and refuses the launch. Caller holds d.mutex.
StreamState& ReadyState(DeviceLimiter& d, CUstream stream, CUcontext context, std::uint64_t at) {
  StreamState& state = StateOf(d, stream);
  // (A window fills at kWindowLaunches, but threads planning into it together may pass that before it closes.)
  if (state.launches.size() + state.booked_reserved >= state.launches.capacity() ||
      state.launches.capacity() < kWindowLaunches) {
    state.launches.reserve(std::max(kWindowLaunches, 2 * (state.launches.size() + state.booked_reserved)));
  }
  if (state.context != context) {
    DropStreamState(d, state, at, true);
    state.context = context;
  }
  if (state.thread != nullptr && state.thread != ThisThread()) state.many_threads = true;
  state.thread = ThisThread();
  return state;
}

// A launch the host's estimate calls queued, on a stream with no open window: whether the driver says the stream is
// busy (its last mark not reached yet, or the stream not idle), and if so a window opens there (at the mark, or at
// a new start event). Returns whether the launch joins that window. Caller holds d.mutex.
bool OpenWindowIfBusy(DeviceLimiter& d, StreamState& state, CUstream stream, CUcontext context, CUresult& setup,
                      std::uint64_t at, std::uint64_t& busy_until) {
  RelaxedCapture relaxed;
  CUevent& mark = state.mark;
  bool queued = mark != nullptr ? Real::cuEventQuery(mark) == CUDA_ERROR_NOT_READY
                                : Real::cuStreamQuery != nullptr && Real::cuStreamQuery(stream) == CUDA_ERROR_NOT_READY;
  // The driver says the stream has drained: the estimate ran ahead of it (kernels charged more than the host's
  // launch interval, such as launch-bound tiny ones whose pairs time the launch call): it starts again from now,
  // or every launch after this one would ask the driver too. (A mark reached says less: work launched after it may
  // be queued. It is dropped by the caller, and the next launch the estimate calls queued asks about the stream.)
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
  return queued;
}

// The launch joins its stream's open window: no event of its own. Caller holds d.mutex.
Plan JoinWindow(StreamState& state, const policy::KernelKey& key, std::uint64_t charged_ns, std::uint64_t at,
                Plan plan) {
  plan.how = How::window;
  state.launches.push_back({key, charged_ns});
  state.estimated_ns += charged_ns;
  state.last_launch_ns = at;
  plan.close_after = policy::WindowFull(state.launches.size() + state.booked_reserved, state.estimated_ns);
  plan.stream = &state;
  state.launching.fetch_add(1, std::memory_order_acq_rel);
  return plan;
}

// A pair of events for a sampled launch. A kernel never measured is measured every time; the others as
// sampled (the charge is the estimate). A known short kernel's pair is gated (kGateBelowNs), on a stream one thread
// launches into (there a gate holds nobody else's kernels). A kernel's first launches are not: a launch call that
// loads its module may wait for the GPU (the watchdog would open the gate, a millisecond later each time). Caller
// holds d.mutex.
void PlanPair(DeviceLimiter& d, const StreamState& state, CUcontext context, CUresult& setup, std::uint64_t charged_ns,
              std::uint64_t at, Plan& plan) {
  RelaxedCapture relaxed;
  setup = TakeEvent(d, context, plan.start);
  if (setup == CUDA_SUCCESS) setup = TakeEvent(d, context, plan.end);
  if (plan.start != nullptr && plan.end != nullptr) plan.how = How::pair;
  plan.gate = plan.how == How::pair && !plan.unknown_cost && charged_ns < kGateBelowNs && !state.many_threads &&
              gates::Usable(at);
}

// docs/compute-limit.md, "Measurement windows": a kernel of known cost launched while at least half a launch of
// work is queued ahead of it on its stream (by the host's estimate) joins the stream's window: no event of its own,
// the next window boundary measures it with its neighbours, back to back. A window opens only on a stream the
// driver says is busy, so that it never starts on an idle GPU. Any other launch closes the stream's window, and gets
// a pair of its own if sampled; a kernel never measured gets a pair every time. Caller holds d.mutex; updates the
// stream's estimate of its queue. Past ReadyState, nothing throws (TakeEvent only looks the pool up; ReturnEvent and
// HoldEvent do without memory).
Plan PlanLaunch(DeviceLimiter& d, const policy::KernelKey& key, std::uint32_t launches_before, bool steady,
                bool force_sample, CUstream stream, CUcontext context, CUresult& setup, std::uint64_t charged_ns,
                std::uint64_t at, bool unknown_cost) {
  Plan plan;
  plan.unknown_cost = unknown_cost;
  if (setup != CUDA_SUCCESS) return plan;
  StreamState& state = ReadyState(d, stream, context, at);
  std::uint64_t busy_until = state.busy_until_ns.load(std::memory_order_relaxed);
  bool queued = policy::QueuedByEstimate(busy_until, at, charged_ns, plan.unknown_cost, state.books > 0);
  if (queued && state.start == nullptr) queued = OpenWindowIfBusy(d, state, stream, context, setup, at, busy_until);
  const bool busy = busy_until > at;
  state.busy_until_ns.store(policy::QueueEndAfter(busy_until, at, charged_ns), std::memory_order_relaxed);
  plan.sequence = ++state.planned;
  if (queued) return JoinWindow(state, key, charged_ns, at, plan);
  CloseWindow(d, stream, state, at, !busy);  // by the estimate, the process had stopped launching here a while
  ReturnEvent(d, context, state.mark);
  state.mark = nullptr;
  state.last_launch_ns = at;
  const bool sampled =
      plan.unknown_cost || force_sample || policy::PairThisLaunch(launches_before, charged_ns, steady, ThreadSampler());
  if (sampled) PlanPair(d, state, context, setup, charged_ns, at, plan);
  return plan;
}

}  // namespace

// PlanLaunch, or, when the host is out of memory (planning a first launch on a stream or of a kernel needs the heap;
// PlanLaunch changes nothing before it has it), the admission cancelled: the launch is refused, nothing ran, nothing
// is owed. Caller holds d.mutex.
bool PlanOrCancel(DeviceLimiter& d, Plan& plan, const policy::KernelKey& key, std::uint32_t launches_before,
                  bool steady, bool force_sample, CUstream stream, CUcontext context, CUresult& setup,
                  std::uint64_t charged_ns, std::uint64_t at, bool unknown_cost) {
  try {
    plan =
        PlanLaunch(d, key, launches_before, steady, force_sample, stream, context, setup, charged_ns, at, unknown_cost);
    return true;
  } catch (const std::bad_alloc&) {
    d.limiter->Cancel(key, charged_ns);
    return false;
  }
}

CUresult BeginMeasure(Launching& l) {
  VGPU_COUNT(whole_path_charged_ns, l.admission.charged_ns);
  if (l.plan.how == How::window)
    VGPU_COUNT(planned_window, 1);
  else if (l.plan.how == How::unmeasured)
    VGPU_COUNT(planned_unmeasured, 1);
  else if (l.plan.gate)
    VGPU_COUNT(planned_gated_pair, 1);
  else
    VGPU_COUNT(planned_pair, 1);
  if (l.settled_early) VGPU_COUNT(settled_early, 1);
  if (l.plan.how == How::pair) {
    RelaxedCapture relaxed;
    l.launched_ns = NowNs();
    if (l.plan.gate) (void)gates::Shut(l.stream, l.context, l.gate);
    l.setup = Real::cuEventRecord(l.plan.start, l.stream);
    if (l.setup != CUDA_SUCCESS) l.plan.how = How::unmeasured;
  }
  if (l.plan.unknown_cost && l.plan.how != How::pair) {
    // Its cost is unknown and this run could not be measured: settled at a guess, a kernel of any length would run
    // uncapped. Refused with the error that kept it from being measured; nothing ran, nothing is owed.
    std::lock_guard<std::mutex> guard(l.d->mutex);
    l.d->limiter->Cancel(l.key, l.admission.charged_ns);
    ReturnEvent(*l.d, l.context, l.plan.start);
    ReturnEvent(*l.d, l.context, l.plan.end);
    return l.setup != CUDA_SUCCESS ? l.setup : CUDA_ERROR_UNKNOWN;
  }
  return CUDA_SUCCESS;
}

}  // namespace vgpu::hooks::launch
