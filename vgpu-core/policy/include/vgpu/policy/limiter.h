// The compute limiter (docs/compute-limit.md): a container-wide budget of GPU time per device, charged before each
// launch with the kernel's expected GPU time and corrected with its measured time. Pure: the time is passed in,
// nothing here sleeps or reads a clock; the shim and the simulator pass in the time and each launch's measured run.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>

namespace vgpu::policy {

// The shared part: lives in the container region (one per device) or in the simulator's memory. Every field is
// read and written with atomics: no lock, safe under SIGKILL (a process that dies mid-update loses at most one
// refill interval).
inline constexpr std::uint64_t kBucketNs = 10'000'000;  // measured busy time is kept per 10 ms
inline constexpr std::uint32_t kBuckets = 128;          // 1.28 s of history

struct BudgetCell {
  std::int64_t budget_ns;           // GPU time the container may still start; negative = debt being repaid
  std::uint64_t refilled_at_ns;     // the budget includes refills up to this time
  std::uint32_t rate_permille;      // refill rate now: the share, or 1000 while `default` lets the container run free
  std::uint32_t share_permille;     // the configured share (monitoring)
  std::uint64_t bucket_epoch;       // index (time / kBucketNs) of the newest bucket written
  std::uint32_t busy_ns[kBuckets];  // measured GPU time per 10 ms bucket, a ring indexed by epoch % kBuckets
};

// The node monitor's verdict shows the container's SM use (NVML's, summed over its processes) against its limit,
// both permille of the device (docs/node-monitor.md). Each process scales its own rate by the same factor: down by
// limit / used while the container is more than kMonitorMarginPermille over (processes that rewrite the cell
// together, or launch past the hooks, are then held together), back up the same way once it is as far under; never
// below kMonitorLeastScalePermille. Returns the next scale from the current one.
inline constexpr std::uint32_t kMonitorMarginPermille = 50;  // NVML's samples move by a few points
inline constexpr std::uint32_t kMonitorLeastScalePermille = 50;
std::uint32_t NextMonitorScale(std::uint32_t scale_permille, std::uint32_t used_permille, std::uint32_t limit_permille);

// What identifies a kernel for cost learning: the function and the launch shape.
struct KernelKey {
  const void* function;
  std::uint64_t shape;  // grid and block sizes hashed together
  bool operator==(const KernelKey& other) const { return function == other.function && shape == other.shape; }
};

struct LimiterConfig {
  std::uint32_t share_permille = 1000;  // 300 = 30 %
  bool throttle = true;                 // false for `disable`: measure and publish only
  bool lend_when_idle = false;          // `default`: run free while nobody else wants the GPU
  std::uint64_t burst_ns = 20'000'000;  // the most the budget holds, times the share (see docs)
  std::uint64_t default_cost_ns = 100'000;
  std::uint64_t in_flight_max_ns = 20'000'000;        // expected-but-unmeasured GPU time one process may have queued
  std::uint64_t settle_after_ns = 60'000'000'000ull;  // a launch never measured is settled at its estimate
  // A launch that finds the budget in debt waits until it is repaid and this much more (at most a quarter of the
  // burst), so that a throttled process runs its kernels in bursts, back to back, instead of one launch per refill
  // onto an idle stream: a run of queued kernels is measured exactly, a lone launch on an idle stream with the launch
  // latency in it (docs/compute-limit.md, "Pacing"). Changes when kernels run, never how much.
  std::uint64_t pace_ns = 500'000;
  // Busy time of launches settled as unmeasured is added to the cell once per 10 ms bucket, or at FlushBusy, not per
  // launch (two writes to the region per launch otherwise). The shim flushes every 50 us; the simulator reads the
  // cell at any moment and leaves it off.
  bool defer_busy = false;
};

// One launch of a measurement window: what it was charged.
struct WindowLaunch {
  KernelKey key;
  std::uint64_t charged_ns;
};

// The decision for one launch.
struct Admission {
  bool wait_for_completion = false;  // too much unmeasured work queued: settle completions first, then ask again
  std::uint64_t ready_at_ns = 0;     // the launch may go at this time (<= now: at once)
  std::uint64_t charged_ns = 0;      // what was taken from the budget; Settle gives back the difference
  bool known = false;                // the kernel has been measured at least once
  std::uint32_t launches = 0;        // launches of the kernel admitted before this one (for the caller's sampling)
  // Its recent measurements are steady: their mean is within twice their median (the charge). The caller may measure
  // such a kernel less often: what an unmeasured launch is settled at barely moves.
  bool steady = false;
};

class Limiter {
 public:
  Limiter(BudgetCell& cell, const LimiterConfig& config);

  // Charges a launch of `key` at `now_ns` and says when it may start. A kernel never measured yet may have only
  // one launch in flight: its cost is unknown, so a queue of them could overrun the cap whatever the default.
  // This holds whether or not the limiter throttles (a `disable` container measures too). `bound_in_flight` false
  // skips the in-flight checks (a caller that waited long enough for completions).
  Admission Admit(const KernelKey& key, std::uint64_t now_ns, bool bound_in_flight = true);

  // The launch's GPU time is known (`measured_ns`), or will never be (nullopt: settled at the estimate). Corrects
  // the budget, learns the cost (unless `learn` is false: the measurement is charged, but says nothing of the
  // kernel's usual cost, such as a first launch that also loaded its module), publishes utilization.
  void Settle(const KernelKey& key, std::uint64_t charged_ns, std::optional<std::uint64_t> measured_ns,
              std::uint64_t now_ns, bool learn = true);

  // The launch did not happen (the driver refused it): everything it was charged goes back. (Launches of one kernel
  // may be cancelled together: `charged_ns` their charges' sum.)
  void Cancel(const KernelKey& key, std::uint64_t charged_ns);
  // A launch the caller chose not to measure (sampling): settled at the mean of the kernel's recent measurements
  // (the unbiased guess of its cost), or at its charge if it was never measured.
  // Returns what it was accounted at. May be called before the launch is made (its cost does not depend on the run);
  // if the driver then refuses it, Refund gives back what was accounted.
  std::uint64_t SettleUnmeasured(const KernelKey& key, std::uint64_t charged_ns, std::uint64_t now_ns);
  // Gives back `launches` settled as unmeasured at `accounted_each_ns` that were never made (refused by the driver,
  // or a book's unused launches).
  void Refund(const KernelKey& key, std::uint32_t launches, std::uint64_t accounted_each_ns);
  // Adds the busy time held back by `defer_busy` to the cell.
  void FlushBusy();
  // A book of launches (the shim's fast path, docs/compute-limit.md "The launch path"): up to `most` further launches
  // of a kernel measured at least once, admitted and settled as unmeasured now, all at once, as many as the budget
  // (the cell's and this process's own) covers without debt and no more than `most_ns` of accounted time together.
  // Returns how many (0: none) and what each was accounted at. Launches of the book that are never made go back
  // with Refund.
  std::uint32_t AdmitBook(const KernelKey& key, std::uint64_t now_ns, std::uint32_t most, std::uint64_t most_ns,
                          std::uint64_t& accounted_each_ns);
  // A book of launches into a measurement window (docs/compute-limit.md "The launch path"): up to `most` further
  // launches of a kernel measured at least once, charged now at its estimate as Admit charges one, all at once, as
  // many as the budget holds without debt, the in-flight bound allows, and `most_ns` covers. Returns how many (0:
  // none) and what each was charged. Those made are settled with their window (SettleWindow, each at its charge);
  // those never made go back with Cancel (of their charges together).
  std::uint32_t AdmitWindowBook(const KernelKey& key, std::uint64_t now_ns, std::uint32_t most, std::uint64_t most_ns,
                                std::uint64_t& charged_each_ns);
  // Launches queued back to back on one stream, measured together by one pair of events (a window): their total GPU
  // time is `measured_ns` (nullopt: not known, each settled as unmeasured). The budget is corrected by the total;
  // each kernel learns its part, apportioned by the charges (docs/compute-limit.md, "Measurement windows").
  void SettleWindow(const WindowLaunch* launches, std::size_t count, std::optional<std::uint64_t> measured_ns,
                    std::uint64_t now_ns);

  // `default` policy: the fraction of a recent period in which others' kernels ran (the device's utilization over
  // an NVML sample period minus our own BusyFraction over the same period). Below 5 % the container runs free;
  // above, it is held to its share.
  void ObserveOthers(double others_busy_fraction, std::uint64_t now_ns);

  // The node monitor's correction of this process's own rate (docs/node-monitor.md): its own count refills at its
  // rate times `scale_permille` / 1000 (1..1000; 1000: none). Colluding processes rewrite the cell, not this.
  void ScaleOwn(std::uint32_t scale_permille, std::uint64_t now_ns);
  std::uint32_t own_scale_permille() const { return own_scale_permille_; }

  // The container's measured share over the last second (the 100 whole buckets before `now_ns`).
  static double PublishedShare(const BudgetCell& cell, std::uint64_t now_ns);
  // The container's measured busy time in [from_ns, to_ns) as a fraction of it (partial buckets pro rata). A run is
  // recorded over the interval it measured, ending when it was settled. Periods older than the ring read as idle.
  static double BusyFraction(const BudgetCell& cell, std::uint64_t from_ns, std::uint64_t to_ns);

  std::uint64_t EstimateNs(const KernelKey& key) const;
  bool Known(const KernelKey& key) const;  // measured at least once
  std::uint64_t in_flight_ns() const { return in_flight_ns_; }
  // Whether it holds the share (LimiterConfig::throttle), switched by a caller whose other means of holding it failed
  // (time division, when the container cannot take turns: the limiter then holds its cap). Switched on, the budget
  // starts from what the cell holds, refilled as usual.
  bool throttles() const { return config_.throttle; }
  void SetThrottle(bool throttle) { config_.throttle = throttle; }
  // What this process's launches have cost so far, as the limiter accounts them whether or not it throttles: each
  // launch's charge when admitted, corrected when settled to what it measured (unmeasured: its kernel's recent mean),
  // what never ran given back. Time division charges a container alone on its GPU by it (turn::Released). Written
  // under the caller's lock; may be read without it.
  std::int64_t spent_ns() const { return spent_ns_.load(std::memory_order_relaxed); }
  // The longest any kernel was estimated or measured to run (time division sizes its cycle by it).
  std::uint64_t largest_estimate_ns() const { return largest_estimate_ns_; }
  // The second longest run among the last 64 measurements of the kernels measured at least 3 times (a first launch,
  // which may have loaded its module, is never learned from; the second, so that one measurement stretched by
  // another context's time slices does not count). Time division publishes it for the cycle, whose windows are to
  // hold it: one function launched at mixed sizes has a usual run (median) far below its longest (5 us .. 20 ms:
  // 0.5 ms), and sizing the cycle by the median left every 20 ms launch of a 10 % container overrunning five windows.
  // A scan of every kernel.
  std::uint64_t LongestRunNs() const;
  std::uint64_t ignored_measurements() const { return ignored_measurements_; }

  // Initializes a fresh cell (by whoever creates the region or the simulator).
  static void InitCell(BudgetCell& cell, std::uint32_t share_permille, std::uint64_t burst_ns, std::uint64_t now_ns);

 private:
  void Refill(std::uint64_t now_ns);
  std::uint32_t TakeWithoutDebt(std::uint64_t now_ns, std::uint32_t n, std::uint64_t each_ns);
  void RefillOwn(std::uint64_t now_ns);
  void AdjustOwn(std::int64_t delta_ns);
  void Spend(std::int64_t ns);
  void Forget(const KernelKey& key, std::uint64_t charged_ns);
  void Learn(const KernelKey& key, std::uint64_t measured_ns);
  std::uint64_t UnmeasuredCost(const KernelKey& key, std::uint64_t charged_ns) const;
  std::uint64_t PaceNs() const;
  std::uint64_t BurstNs() const;

  // noexcept: the map then keeps no copy of the hash in its nodes (it sits after the Cost, a cache line away).
  struct KeyHash {
    std::size_t operator()(const KernelKey& key) const noexcept {
      return std::hash<const void*>()(key.function) ^ (key.shape * 0x9e3779b97f4a7c15ull);
    }
  };
  // What a launch reads (count .. launches) comes first: with the map node's link and key, one cache line.
  struct Cost {
    std::uint32_t count = 0;
    std::uint32_t unknown_in_flight = 0;  // launches admitted before the first measurement, not yet settled
    std::uint64_t estimate_ns = 0;        // the median of `recent`: the launch charge
    std::uint64_t longer_sum = 0;         // of `longer`
    std::uint32_t launches = 0;           // admitted so far (Admission::launches)
    std::uint64_t upper_quartile_ns = 0;  // of `recent`: tells one size with stray outliers from a mix of sizes
    std::uint64_t longer_second_ns = 0;   // the second largest of `longer`
    std::uint64_t recent[16] = {};
    std::uint64_t longer[64] = {};  // the last 64 measurements, for the mean
  };

  std::uint64_t BusyOf(const KernelKey& key, std::uint64_t accounted_ns) const;
  // The same, from a kernel's record (null: never seen), for callers that have looked it up already.
  static std::uint64_t MeanOf(const Cost* cost, std::uint64_t charged_ns);
  static std::uint64_t BusyOf(const Cost* cost, std::uint64_t accounted_ns);

  BudgetCell& cell_;
  LimiterConfig config_;
  std::unordered_map<KernelKey, Cost, KeyHash> costs_;
  std::uint64_t in_flight_ns_ = 0;
  std::uint64_t ignored_measurements_ = 0;
  std::uint64_t largest_estimate_ns_ = 0;
  // This process's own copy of the budget, in its own memory: the cell lives in the region, which every process of
  // the container can write (docs/threat-model.md). A process is also held to the share by its own count, so that
  // writing the cell (a budget, a lending rate) cannot give it more. Never binds where the cell is honest: it refills
  // at the container's rate and this process's launches are a part of the container's.
  std::int64_t own_budget_ns_ = 0;
  std::atomic<std::int64_t> spent_ns_{0};    // (one writer at a time: the caller's lock)
  std::uint64_t own_refilled_at_ns_ = 0;     // 0: not started (the first Admit starts it full)
  std::uint32_t own_rate_permille_ = 0;      // what this process decided: the share, or 1000 while it lends
  std::uint32_t own_scale_permille_ = 1000;  // the node monitor's correction (ScaleOwn)
  std::uint32_t OwnRate() const;             // own_rate_permille_ scaled, at least 1
  // `defer_busy`: busy time not yet added to the cell, all in bucket `busy_epoch_`.
  std::uint64_t busy_epoch_ = 0;
  std::uint64_t busy_held_ns_ = 0;
};

}  // namespace vgpu::policy
