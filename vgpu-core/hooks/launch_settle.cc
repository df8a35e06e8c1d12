// The launch path's "settle" stage (launch.h): after the driver's launch call, the launch's end is recorded and its
// charge settled: at once where it was not measured, with its window, or once its pair's events have completed
// (SettleCompleted, called by later launches).
#include <algorithm>

#include "launch.h"

namespace vgpu::hooks::launch {
namespace {

// LIBCUDA_LOG_LEVEL=4: a measurement far above what was charged says that its span held waiting, not work (a
// collective kernel waiting for its peers, other contexts' time slices). The container is charged all of it and its
// next launches wait for the budget: with this line, a collapse like issue 20's DDP one explains itself.
void LogLongMeasurement(const void* function, std::uint64_t charged_ns, const std::optional<std::uint64_t>& measured) {
  if (!measured || *measured < 4 * charged_ns || *measured < charged_ns + 1'000'000) return;
  Log(4,
      "a launch of %p measured %llu us where %llu us were expected: its span held waiting (a collective's peers, "
      "other contexts' time slices), charged in full",
      function, static_cast<unsigned long long>(*measured / 1000), static_cast<unsigned long long>(charged_ns / 1000));
}

// A window whose end event has completed (or failed): its launches settled at what it measured (policy::WindowMeasuredNs:
// a window closed once its stream had drained also timed the idle host time after its last launch).
void SettleWindowDone(DeviceLimiter& d, const Pending& p, CUresult state, std::uint64_t now) {
  std::uint64_t charged = 0;
  for (const auto& launch : p.window) charged += launch.charged_ns;
  std::optional<std::uint64_t> measured;
  float ms = 0;
  if (state == CUDA_SUCCESS && Real::cuEventElapsedTime_v2(&ms, p.start, p.end) == CUDA_SUCCESS && ms >= 0) {
    measured =
        policy::WindowMeasuredNs(static_cast<std::uint64_t>(static_cast<double>(ms) * 1e6), p.idle_tail_ns, charged);
  }
  LogLongMeasurement(p.window.empty() ? nullptr : p.window.front().key.function, charged, measured);
  d.limiter->SettleWindow(p.window.data(), p.window.size(), measured, now);
}

// A pair whose end event has completed (or failed) settled. Returns false, settling nothing, while it must be asked
// again: not ready, or the query failed and the kernel's cost is unknown (a launch that waits too long settles the
// oldest at its estimate). A known kernel whose query fails is settled at its estimate.
bool SettlePairIfDone(DeviceLimiter& d, const Pending& p, std::uint64_t now) {
  const bool known = d.limiter->Known(p.key);
  const CUresult state = Real::cuEventQuery(p.end);
  if (state == CUDA_ERROR_NOT_READY || (state != CUDA_SUCCESS && !known)) return false;
  if (p.shared && known) {
    d.limiter->SettleUnmeasured(p.key, p.charged_ns, now);  // (a kernel never measured takes the pair: an over-charge)
    return true;
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
  return true;
}

// A launch settled in its admission's critical section (launch_admit.cc) that the driver refused: nothing ran,
// nothing is owed, and the launches after it get no book.
CUresult SettleEarly(Launching& l, CUresult result) {
  if (result == CUDA_SUCCESS) return result;
  {
    std::lock_guard<std::mutex> guard(l.d->mutex);
    l.d->limiter->Refund(l.key, 1, l.accounted_early);
  }
  (void)CloseBookFor(l.key.function, l.key.shape, l.stream);
  return result;
}

// A pair's end event, after a launch that was made. (A kernel of unknown cost gets a second try: unmeasured, it
// would be settled at a guess.)
void RecordEnd(Launching& l) {
  RelaxedCapture relaxed;
  if (Real::cuEventRecord(l.plan.end, l.stream) != CUDA_SUCCESS &&
      (!l.plan.unknown_cost || Real::cuEventRecord(l.plan.end, l.stream) != CUDA_SUCCESS)) {
    l.plan.how = How::unmeasured;
  }
}

// The driver refused the launch: nothing ran, nothing is owed. A window's launch is taken out of it, unless the
// window has been closed meanwhile (another thread): it is then settled with the window, which timed no kernel for
// it. Caller holds d.mutex.
void SettleRefused(Launching& l, StreamState* state, bool close_window) {
  DeviceLimiter& d = *l.d;
  const std::uint64_t charged = l.admission.charged_ns;
  bool owed_nothing = l.plan.how != How::window;
  if (!owed_nothing && state != nullptr) {
    for (auto it = state->launches.rbegin(); it != state->launches.rend(); ++it) {
      if (it->key == l.key && it->charged_ns == charged) {
        state->estimated_ns -= it->charged_ns;
        state->launches.erase(std::next(it).base());
        owed_nothing = true;
        break;
      }
    }
  }
  if (owed_nothing) d.limiter->Cancel(l.key, charged);
  ReturnEvent(d, l.context, l.plan.start);
  ReturnEvent(d, l.context, l.plan.end);
  if (state != nullptr && close_window) CloseWindow(d, l.stream, *state, l.at, false);
}

// The launch was made: a pair waits for its events (its end the stream's mark: the next window starts there while
// the stream stays busy); an unmeasured launch is settled now; a window's last launch ends it. Caller holds d.mutex.
void SettleMade(Launching& l, StreamState* state, bool close_window) {
  DeviceLimiter& d = *l.d;
  Plan& plan = l.plan;
  if (plan.how == How::pair && !Recorded([&] {
        // (Shared: another thread launched onto the stream between its events; see Pending.)
        d.pending.push_back(
            {l.key,
             l.admission.charged_ns,
             plan.start,
             plan.end,
             l.context,
             l.launched_ns,
             {},
             false,
             0,
             state == nullptr || state->planned != plan.sequence || state->books > OwnBooksOn(d, state)});
        d.pending.back().first = l.admission.launches == 0;
      })) {
    plan.how = How::unmeasured;  // out of host memory: the kernel ran, settled as one that was not measured
  }
  if (plan.how == How::pair) {
    if (state != nullptr) {
      ReturnEvent(d, l.context, state->mark);
      // (Without memory to hold the event twice: no mark.)
      state->mark = HoldEvent(d, plan.end) ? plan.end : nullptr;
    }
  } else if (plan.how == How::unmeasured) {
    d.limiter->SettleUnmeasured(l.key, l.admission.charged_ns, l.at);
    ReturnEvent(d, l.context, plan.start);
    ReturnEvent(d, l.context, plan.end);
  } else if (state != nullptr && close_window) {
    CloseWindow(d, l.stream, *state, l.at, false);  // or leaves it to a launch still in flight
  }
}

}  // namespace

CUresult Settle(Launching& l, CUresult result) {
  // The launch call has returned: the stream may go on. (Whether it ran or not, a shut gate is opened.)
  (void)gates::Open(l.gate);
  // (A book opened for the launches after this one is charged whether or not this one ran: closing it refunds.)
  turn::Released(l.ordinal, l.ticket, (result == CUDA_SUCCESS ? l.admission.charged_ns : 0) + l.booked_ns,
                 l.d->limiter->spent_ns());
  if (l.settled_early) return SettleEarly(l, result);
  const Plan& plan = l.plan;
  if (plan.how == How::pair && result == CUDA_SUCCESS) RecordEnd(l);
  // A launch that joined a window, and does not fill it, is done: its charge is settled with the window (unless it
  // is the last of several in flight and a close waits for it).
  bool close_window = false;
  if (plan.how == How::window) {
    // (Sequentially consistent, as in EndLaunching: a close asked for meanwhile sees this launch, or it sees the close.)
    const bool last = plan.stream->launching.fetch_sub(1, std::memory_order_seq_cst) == 1;
    close_window = plan.close_after || (last && plan.stream->close_when_done.load(std::memory_order_seq_cst));
    if (result == CUDA_SUCCESS && !close_window) return result;
  }
  std::lock_guard<std::mutex> guard(l.d->mutex);
  if (result == CUDA_SUCCESS && plan.how == How::unmeasured && plan.start == nullptr && plan.end == nullptr) {
    // Planned after a wait: settled at what such a launch costs, nothing else to do.
    l.d->limiter->SettleUnmeasured(l.key, l.admission.charged_ns, l.at);
    return result;
  }
  StreamState* state = nullptr;
  if (const auto it = l.d->streams.find(l.stream); it != l.d->streams.end() && it->second.context == l.context) {
    state = &it->second;
  }
  if (result != CUDA_SUCCESS) {
    SettleRefused(l, state, close_window);
  } else {
    SettleMade(l, state, close_window);
  }
  return result;
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
    const Pending& p = d.pending.front();
    if (p.is_window) {
      const CUresult state = Real::cuEventQuery(p.end);
      if (state == CUDA_ERROR_NOT_READY) return;
      SettleWindowDone(d, p, state, now);
    } else if (!SettlePairIfDone(d, p, now)) {
      return;
    }
    ReturnEvent(d, p.context, p.start);
    ReturnEvent(d, p.context, p.end);
    d.pending.pop_front();
  }
}

void ForgetContextOn(DeviceLimiter& d, CUcontext context) {
  std::lock_guard<std::mutex> guard(d.mutex);
  const std::uint64_t now = NowNs();
  // Its events went with the context: settle what was pending at its estimate, never touch those events again.
  for (auto* queue : {&d.pending, &d.abandoned}) {
    for (auto it = queue->begin(); it != queue->end();) {
      if (it->context != context) {
        ++it;
        continue;
      }
      if (queue == &d.pending && it->is_window) {
        d.limiter->SettleWindow(it->window.data(), it->window.size(), std::nullopt, now);
      } else if (queue == &d.pending) {
        d.limiter->SettleUnmeasured(it->key, it->charged_ns, now);
      }
      d.extra_owners.erase(it->start);
      d.extra_owners.erase(it->end);
      it = queue->erase(it);
    }
  }
  d.last_stream = nullptr;
  d.last_state = nullptr;
  ForgetBookStates();  // books lose their stream states
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

}  // namespace vgpu::hooks::launch
