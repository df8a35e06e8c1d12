// The shim's measure and settle stages over one simulated stream (shim_measure.h).
#include "shim_measure.h"

#include <algorithm>

namespace vgpu::sim {

MeasuredBy ShimMeasure::Plan(policy::Limiter& limiter, const policy::KernelKey& key, const policy::Admission& admission,
                             std::uint64_t now_ns, bool in_flight, std::uint64_t last_queued_seq) {
  std::uint64_t busy_until = busy_until_ns_;
  bool queued = policy::QueuedByEstimate(busy_until, now_ns, admission.charged_ns, !admission.known, false);
  if (queued && !WindowOpen()) {
    // Asked of the driver: the mark not reached yet, or (no mark) the stream not idle.
    if (has_mark_) {
      queued = !Done(mark_seq_);
    } else {
      queued = in_flight;
      if (!queued) busy_until = now_ns;  // the estimate ran ahead of the stream: it starts again from now
    }
    if (queued) {
      windows_.push_back(Window{});
      windows_.back().start_after_seq = has_mark_ ? mark_seq_ : last_queued_seq;
      has_mark_ = false;
    }
  }
  const bool busy = busy_until > now_ns;
  busy_until_ns_ = policy::QueueEndAfter(busy_until, now_ns, admission.charged_ns);
  if (queued) {
    Window& window = windows_.back();
    window.launches.push_back({key, admission.charged_ns});
    window.estimated_ns += admission.charged_ns;
    last_launch_ns_ = now_ns;
    return MeasuredBy::window;
  }
  CloseWindow(limiter, now_ns, !busy, !in_flight);  // (its idle tail runs from its last launch: before this one)
  has_mark_ = false;
  last_launch_ns_ = now_ns;
  const bool pair =
      !admission.known || policy::PairThisLaunch(admission.launches, admission.charged_ns, admission.steady, sampler_);
  return pair ? MeasuredBy::pair : MeasuredBy::unmeasured;
}

void ShimMeasure::Queued(policy::Limiter& limiter, const policy::KernelKey& key, const policy::Admission& admission,
                         MeasuredBy how, std::uint64_t seq, std::uint64_t now_ns) {
  switch (how) {
    case MeasuredBy::unmeasured:
      limiter.SettleUnmeasured(key, admission.charged_ns, now_ns);
      break;
    case MeasuredBy::pair:
      has_mark_ = true;
      mark_seq_ = seq;
      break;
    case MeasuredBy::window: {
      Window& window = windows_.back();
      window.last_seq = seq;
      if (policy::WindowFull(window.launches.size(), window.estimated_ns)) CloseWindow(limiter, now_ns, false, false);
      break;
    }
  }
}

void ShimMeasure::CloseWindow(policy::Limiter& limiter, std::uint64_t now_ns, bool drained, bool stream_idle) {
  if (!WindowOpen()) return;
  Window& window = windows_.back();
  window.closed = true;
  if (stream_idle) {  // its end is written at once: the time since its last launch is in its span
    window.end_ns = now_ns;
    if (drained) window.idle_tail_ns = std::max<std::uint64_t>(now_ns - std::min(now_ns, last_launch_ns_), 1);
  }
  has_mark_ = true;  // its end: the next window's start while the stream stays busy
  mark_seq_ = window.last_seq;
  SettleReady(limiter, now_ns);
}

void ShimMeasure::Completed(policy::Limiter& limiter, std::uint64_t seq, std::uint64_t end_ns, std::uint64_t now_ns) {
  any_completed_ = true;
  completed_seq_ = seq;
  for (Window& window : windows_) {
    if (window.start_ns == kUnknown && window.start_after_seq == seq) window.start_ns = end_ns;
    if (window.closed && window.end_ns == kUnknown && window.last_seq == seq) window.end_ns = end_ns;
  }
  SettleReady(limiter, now_ns);
}

void ShimMeasure::SettleReady(policy::Limiter& limiter, std::uint64_t now_ns) {
  while (!windows_.empty() && windows_.front().closed && windows_.front().start_ns != kUnknown &&
         windows_.front().end_ns != kUnknown) {
    const Window& window = windows_.front();
    std::uint64_t charged_ns = 0;
    for (const policy::WindowLaunch& launch : window.launches) charged_ns += launch.charged_ns;
    const std::uint64_t elapsed_ns = window.end_ns > window.start_ns ? window.end_ns - window.start_ns : 0;
    limiter.SettleWindow(window.launches.data(), window.launches.size(),
                         policy::WindowMeasuredNs(elapsed_ns, window.idle_tail_ns, charged_ns), now_ns);
    windows_.pop_front();
  }
}

}  // namespace vgpu::sim
