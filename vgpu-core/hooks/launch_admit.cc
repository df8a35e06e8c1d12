// The launch path's "admit" stage (launch.h): the limiter admits the launch against the container's budget
// (policy::Limiter::Admit) and it is planned (launch_measure.cc) in the same critical section. Two waits, each said
// with LIBCUDA_LOG_LEVEL=4: for completions, while too much of the container's work is in flight unmeasured; and for
// the budget, while the container is in debt at its cap (only this one is the region's held_ns: docs/region.md).
#include <algorithm>

#include "launch.h"

namespace vgpu::hooks::launch {
namespace {

constexpr std::uint64_t kCompletionPollNs = 200'000;
// A launch asks the driver about measured launches at most this often (each cuEventQuery is a driver call, ~0.3 us
// on an H100: a few percent of a small launch), or when this many wait to be settled, or while it waits for them.
constexpr std::uint64_t kSettleEveryNs = 50'000;
constexpr std::size_t kSettleBacklog = 16;
constexpr std::uint64_t kMaxCompletionWaitNs = 200'000'000;
// A launch onto a stream whose window is closing waits for the launches still being made into it this long at most,
// looking every kClosePollNs (see WaitForClosingWindow).
constexpr std::uint64_t kMaxCloseWaitNs = 2'000'000;
constexpr std::uint64_t kClosePollNs = 20'000;

// Settles what completed, at most every kSettleEveryNs unless `due`. Caller holds d.mutex.
void SettleIfDue(DeviceLimiter& d, std::uint64_t now, bool due) {
  if (!due && now < d.next_settle_ns && d.pending.size() < kSettleBacklog) return;
  SettleCompleted(d, now);
  d.limiter->FlushBusy();
  d.next_settle_ns = now + kSettleEveryNs;
}

// Admitted and ready now (the common case): planned in the admission's critical section, and where the plan allows
// a book of the launches after it. Caller holds d.mutex. False: out of host memory (the admission cancelled).
bool PlanNow(Launching& l) {
  DeviceLimiter& d = *l.d;
  const policy::Admission& a = l.admission;
  if (!PlanOrCancel(d, l.plan, l.key, a.launches, a.steady, l.force_sample, l.stream, l.context, l.setup, a.charged_ns,
                    l.now, l.unknown_cost)) {
    return false;
  }
  l.planned = true;
  // Under time division, books only inside the container's own window (their launches charged when they open).
  const bool may_book = l.setup == CUDA_SUCCESS && (!d.scheduled || l.ticket.turn_until_ns > l.now);
  const Plan& plan = l.plan;
  if (plan.how == How::window && !plan.close_after && !plan.unknown_cost && may_book) {
    l.booked_ns = OpenWindowBook(d, l.key, l.stream, l.context, *plan.stream, l.now, l.ticket.turn_until_ns);
  }
  if (plan.how == How::unmeasured && !plan.unknown_cost && plan.start == nullptr && plan.end == nullptr) {
    // The common case on a drained stream: what such a launch costs does not depend on its run, so it is settled
    // now, in this critical section (given back in the settle stage if the driver refuses the launch).
    l.accounted_early = d.limiter->SettleUnmeasured(l.key, a.charged_ns, l.now);
    l.settled_early = true;
    if (may_book) {
      l.booked_ns = OpenBook(d, l.key, l.stream, l.context, a.charged_ns, a.steady, l.now, l.ticket.turn_until_ns);
    }
  }
  return true;
}

// After kMaxCompletionWaitNs of waiting for completions: the oldest measurement is settled at its estimate, so that
// a launch never waits forever. Its events are reused only once they have completed (out of host memory: never,
// they are left). Caller holds d.mutex.
void AbandonOldest(DeviceLimiter& d, std::uint64_t now) {
  Pending oldest = std::move(d.pending.front());
  d.pending.pop_front();
  if (oldest.is_window) {
    d.limiter->SettleWindow(oldest.window.data(), oldest.window.size(), std::nullopt, now);
  } else {
    d.limiter->SettleUnmeasured(oldest.key, oldest.charged_ns, now);
  }
  (void)Recorded([&] { d.abandoned.push_back(std::move(oldest)); });
}

// Whether `stream`'s open window is closing (full, or ended by a launch that does not join it) while launches into
// it are still being made: the last of them ends it (Settle, or EndLaunching for a book). Caller holds d.mutex.
bool WindowClosing(DeviceLimiter& d, CUstream stream) {
  const auto it = d.streams.find(stream);
  if (it == d.streams.end()) return false;
  const StreamState& state = it->second;
  return state.start != nullptr && state.close_when_done.load(std::memory_order_seq_cst) &&
         state.launching.load(std::memory_order_seq_cst) > 0;
}

// A launch onto a stream whose window is closing waits, outside the lock, for the launches still being made into
// it: joining would put the close off again. With threads launching back to back into one stream on a busy host,
// the count of launches being made never fell to zero: one window held 11,839 launches and 4.2 s of runs, settled
// at once, and time division dropped what lay past its bound (a lone 30 % container took 42.8 % of the GPU in CI).
// At most kMaxCloseWaitNs (a launch call the driver blocks keeps the count up): then it goes as before. Caller holds
// `guard` (d.mutex); `l.now` is refreshed after a wait.
void WaitForClosingWindow(Launching& l, std::unique_lock<std::mutex>& guard) {
  for (std::uint64_t waited_ns = 0; waited_ns < kMaxCloseWaitNs && WindowClosing(*l.d, l.stream);
       waited_ns += kClosePollNs) {
    guard.unlock();
    VGPU_COUNT(waited_for_close, 1);
    SleepUntilNs(NowNs() + kClosePollNs);
    guard.lock();
    l.now = NowNs();
  }
}

// The limiter's admission, planned at once when it is ready now. While too much is queued unmeasured it waits,
// outside the lock, for completions, polling (never blocking on one event: it may wait for work this very thread
// has yet to launch); open windows are closed first (their launches count as queued until measured). `waited_ns`:
// how long it waited. False: out of host memory.
bool AdmitWaitingForCompletions(Launching& l, std::uint64_t& waited_ns) {
  DeviceLimiter& d = *l.d;
  for (;;) {
    std::unique_lock<std::mutex> guard(d.mutex);
    WaitForClosingWindow(l, guard);
    SettleIfDue(d, l.now, waited_ns > 0);
    // Past the longest wait for completions (nothing measured is pending to settle), admit without the in-flight
    // bound rather than wait forever. (A kernel its events have never measured runs one launch at a time: its runs
    // are then timed from the host closely, launch to completion, never across a queue of others. Admit sees to it.)
    const bool bound = !(d.pending.empty() && waited_ns >= kMaxCompletionWaitNs);
    l.admission = d.limiter->Admit(l.key, l.now, bound);
    if (!l.admission.wait_for_completion) {
      // (Measured kernels stay known: a launch planned later may read `unknown` from before a wait.)
      l.unknown_cost = !l.admission.known;
      if (l.admission.ready_at_ns <= l.now) return PlanNow(l);
      // Throttled: the queue each open window measures is complete until after the wait; it ends there, exactly.
      if (l.setup == CUDA_SUCCESS) CloseWindowsOf(d, l.context, l.now);
      return true;
    }
    if (waited_ns == 0 && l.setup == CUDA_SUCCESS) CloseWindowsOf(d, l.context, l.now);
    if (!d.pending.empty() && waited_ns >= kMaxCompletionWaitNs) {
      AbandonOldest(d, l.now);
      waited_ns = 0;
      continue;
    }
    guard.unlock();
    VGPU_COUNT(waited_for_completion, 1);
    SleepUntilNs(l.now + kCompletionPollNs);
    waited_ns += kCompletionPollNs;
    l.now = NowNs();
  }
}

// The container is in debt at its cap: the launch sleeps to the moment the budget allows, then is planned. The wait
// the limiter set is added to the region's held_ns for the node monitor (docs/metrics.md).
bool WaitForBudget(Launching& l) {
  const policy::Admission& a = l.admission;
  const std::uint64_t wait_ns = a.ready_at_ns > l.now ? a.ready_at_ns - l.now : 0;
  VGPU_COUNT(waited_for_budget, 1);
  VGPU_COUNT(waited_for_budget_ns, wait_ns);
  if (const int device = RegionDevice(l.ordinal); device >= 0 && wait_ns > 0) {
    TheShim().region->AddHeldNs(device, wait_ns);
  }
  Log(4,
      "device %d: a launch of %p waits %llu us for the budget: charged %llu us, the container is in debt at its "
      "cap",
      l.ordinal, l.key.function, static_cast<unsigned long long>(wait_ns / 1000),
      static_cast<unsigned long long>(a.charged_ns / 1000));
  SleepUntilNs(a.ready_at_ns);
  std::lock_guard<std::mutex> guard(l.d->mutex);
  return PlanOrCancel(*l.d, l.plan, l.key, a.launches, a.steady, l.force_sample, l.stream, l.context, l.setup,
                      a.charged_ns, l.at, l.unknown_cost);
}

}  // namespace

bool Admit(Launching& l) {
  std::uint64_t waited_ns = 0;
  if (!AdmitWaitingForCompletions(l, waited_ns)) return false;
  // Why a launch waited, and how long: a collapse explains itself in the log.
  if (waited_ns > 0) {
    Log(4,
        "device %d: a launch of %p waited %llu us for completions: the container's unmeasured work in flight "
        "was past its bound",
        l.ordinal, l.key.function, static_cast<unsigned long long>(waited_ns / 1000));
  }
  l.at = std::max(l.now, l.admission.ready_at_ns);  // about now: one clock read per launch
  return l.planned || WaitForBudget(l);
}

}  // namespace vgpu::hooks::launch
