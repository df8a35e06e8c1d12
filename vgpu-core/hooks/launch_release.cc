// The launch path's "release" stage (launch.h) under time division: the launch waits for its container's turn on
// the GPU (turn.h), before it is admitted, so that the measurement it is planned into starts after the wait.
#include "launch.h"

namespace vgpu::hooks::launch {
namespace {

// Whether the streams of `context` (null: of any context) the process launched on have drained.
bool StreamsDrained(DeviceLimiter& d, CUcontext context) {
  // (A stream being captured must not be queried: while any capture may be in progress, nothing is said drained.)
  if (Real::cuStreamQuery == nullptr || g_captures.load() != 0) return false;
  std::lock_guard<std::mutex> guard(d.mutex);
  for (const auto& [stream, state] : d.streams) {
    if ((context == nullptr || state.context == context) && Real::cuStreamQuery(stream) == CUDA_ERROR_NOT_READY) {
      return false;
    }
  }
  return true;
}

// What the turn asks of the launch path (turn::Caller): the longest kernel measured, whether the context's streams
// have drained, and, before a launch waits, to close the context's open windows (their queues drain meanwhile, and
// a window held open over the wait would time it).
struct TurnCaller {
  DeviceLimiter& d;
  CUcontext context;  // null: no current context (nothing is measured)

  static std::uint64_t Longest(void* self) {
    auto& caller = *static_cast<TurnCaller*>(self);
    std::lock_guard<std::mutex> guard(caller.d.mutex);
    return caller.d.limiter->LongestRunNs();
  }
  static bool Drained(void* self) {
    auto& caller = *static_cast<TurnCaller*>(self);
    return caller.context != nullptr && StreamsDrained(caller.d, caller.context);
  }
  static void BeforeWait(void* self) {
    auto& caller = *static_cast<TurnCaller*>(self);
    if (caller.context == nullptr) return;
    std::lock_guard<std::mutex> guard(caller.d.mutex);
    CloseWindowsOf(caller.d, caller.context, NowNs());
  }
};

// A launch under time division that got no turn: the container is not in the schedule's plan (its entry taken and
// none free, a plan that could not be built from the file). It must not go uncapped: the limiter holds the cap until
// the container takes turns again (it fails closed; as under `force`: idle time is not lent meanwhile). Each switch
// is said at LIBCUDA_LOG_LEVEL=2. One atomic load per launch while nothing changes.
void HoldByLimiterWhileUnscheduled(DeviceLimiter& d, bool unscheduled) {
  if (d.limiter_holds.load(std::memory_order_relaxed) == unscheduled) return;
  std::lock_guard<std::mutex> guard(d.mutex);
  if (d.limiter->throttles() == unscheduled) return;
  d.limiter->SetThrottle(unscheduled);
  d.limiter_holds.store(unscheduled, std::memory_order_relaxed);
  if (unscheduled) {
    Log(2,
        "device %d: time division gives this container no turns (it is not in the schedule's plan): the limiter "
        "holds its compute cap until it takes turns again",
        d.ordinal);
  } else {
    Log(2, "device %d: the container takes turns again under time division: the limiter no longer throttles",
        d.ordinal);
  }
}

// turn::Take's waited_ns runs from its first clock read to the look that let the launch go: for a launch that went at
// its first look, two adjacent clock reads (tens of ns); one that waited slept at least once (a few us of system
// calls alone). Only a wait is the region's held_ns (docs/region.md), so that a launch that waits for nothing adds
// nothing to the container's shared counters.
constexpr std::uint64_t kTurnWaitCountedNs = 1'000;

void CountTurnWait(const Launching& l) {
  if (l.ticket.waited_ns < kTurnWaitCountedNs) return;
  if (const int device = RegionDevice(l.ordinal); device >= 0) TheShim().region->AddHeldNs(device, l.ticket.waited_ns);
}

}  // namespace

bool DeviceDrained(int ordinal) {
  DeviceLimiter& d = g_devices[ordinal];
  return d.ready.load(std::memory_order_acquire) && StreamsDrained(d, nullptr);
}

void Release(Launching& l) {
  DeviceLimiter& d = *l.d;
  if (!d.scheduled) return;
  std::uint64_t estimate_ns = 0;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    estimate_ns = d.limiter->EstimateNs(l.key);
  }
  TurnCaller caller{d, l.setup == CUDA_SUCCESS ? l.context : nullptr};
  l.ticket = turn::Take(l.ordinal, estimate_ns,
                        {&caller, TurnCaller::Longest, TurnCaller::BeforeWait, TurnCaller::Drained}, l.key.function);
  HoldByLimiterWhileUnscheduled(d, !l.ticket.scheduled);
  CountTurnWait(l);
  if (l.ticket.waited_ns > 0) l.now = NowNs();
}

}  // namespace vgpu::hooks::launch
