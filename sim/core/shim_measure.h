// The shim's measure and settle stages over one simulated stream (Measurement::shim): which launches share a window,
// which get an event pair, which go unmeasured, decided by the shim's own pure code (vgpu/policy/measure.h), and
// what each measurement reads, from the times of the model's operations. What differs from the shim: books of
// launches are not modelled (every launch takes the whole path), a window's events are read at the completion that
// ends it (the shim reads them at its next launch), and an end event written on an idle stream reads "now".
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "vgpu/policy/limiter.h"
#include "vgpu/policy/measure.h"

namespace vgpu::sim {

enum class MeasuredBy : std::uint8_t { pair, window, unmeasured };

inline const char* MeasuredByName(MeasuredBy how) {
  return how == MeasuredBy::pair ? "pair" : how == MeasuredBy::window ? "window" : "unmeasured";
}

class ShimMeasure {
 public:
  // Which launches outside windows get pairs is drawn from `seed` (as the shim draws from its thread's seed).
  void Seed(std::uint64_t seed) { sampler_.Seed(seed); }

  // How a launch of `key`, admitted as `admission`, is measured if it is queued at `now_ns` (shim: PlanLaunch).
  // `last_queued_seq`: the stream's newest operation, if `in_flight` (the driver's answer: work not yet complete).
  MeasuredBy Plan(policy::Limiter& limiter, const policy::KernelKey& key, const policy::Admission& admission,
                  std::uint64_t now_ns, bool in_flight, std::uint64_t last_queued_seq);
  // The planned launch is queued as operation `seq` (shim: SettleMade): an unmeasured one is settled now, a pair's
  // end becomes the stream's mark, a window that is full ends.
  void Queued(policy::Limiter& limiter, const policy::KernelKey& key, const policy::Admission& admission,
              MeasuredBy how, std::uint64_t seq, std::uint64_t now_ns);
  // The open window ends at `now_ns` (shim: CloseWindow): `drained`, the host's estimate says its work has ended;
  // `stream_idle`, the model says so (its end event is then written at once).
  void CloseWindow(policy::Limiter& limiter, std::uint64_t now_ns, bool drained, bool stream_idle);
  // Operation `seq` completed at `end_ns`: the windows whose start or end it writes, settled once both are known.
  void Completed(policy::Limiter& limiter, std::uint64_t seq, std::uint64_t end_ns, std::uint64_t now_ns);
  // The process is gone: nothing more is settled (its in-flight launches are the caller's).
  void Drop() { windows_.clear(); }

  std::size_t windows_pending() const { return windows_.size(); }

 private:
  static constexpr std::uint64_t kUnknown = ~std::uint64_t{0};
  struct Window {
    std::vector<policy::WindowLaunch> launches;
    std::uint64_t estimated_ns = 0;
    std::uint64_t start_after_seq = 0;  // its start event is written when this operation completes
    std::uint64_t last_seq = 0;         // its last launch's operation
    std::uint64_t start_ns = kUnknown;
    std::uint64_t end_ns = kUnknown;
    std::uint64_t idle_tail_ns = 0;
    bool closed = false;
  };

  bool Done(std::uint64_t seq) const { return any_completed_ && seq <= completed_seq_; }
  bool WindowOpen() const { return !windows_.empty() && !windows_.back().closed; }
  void SettleReady(policy::Limiter& limiter, std::uint64_t now_ns);

  policy::Sampler sampler_;
  std::uint64_t busy_until_ns_ = 0;  // the host's estimate of when the stream's queued work ends
  std::uint64_t last_launch_ns_ = 0;
  bool has_mark_ = false;  // the end of the last pair or window: the next window's start while busy
  std::uint64_t mark_seq_ = 0;
  bool any_completed_ = false;
  std::uint64_t completed_seq_ = 0;
  std::deque<Window> windows_;  // oldest first; the open one (if any) last
};

}  // namespace vgpu::sim
