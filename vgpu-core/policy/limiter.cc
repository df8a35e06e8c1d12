// The compute limiter: a token bucket in GPU time shared through atomics, charged at launch with a learned
// estimate and settled with the measured time (docs/compute-limit.md).
#include "vgpu/policy/limiter.h"

#include <algorithm>
#include <limits>

namespace vgpu::policy {
namespace {

constexpr std::uint64_t kAbsurdNs = 60'000'000'000ull;  // a "measurement" over a minute is garbage
constexpr std::uint64_t kMaxRefillGapNs = 3'600'000'000'000ull;
// How often launches that find budget refill the shared cell (Admit).
constexpr std::uint64_t kRefillEveryNs = 50'000;

template <typename T>
std::atomic_ref<T> Atomic(T& field) {
  return std::atomic_ref<T>(field);
}

// Records `busy_ns` of measured GPU time over the interval (end_ns - busy_ns, end_ns].
void AddBusy(BudgetCell& cell, std::uint64_t end_ns, std::uint64_t busy_ns) {
  const std::uint64_t epoch = end_ns / kBucketNs;
  auto stored = Atomic(cell.bucket_epoch);
  std::uint64_t current = stored.load(std::memory_order_acquire);
  while (epoch > current) {
    // Moving to a newer bucket: whoever wins the exchange clears the buckets skipped over.
    if (stored.compare_exchange_weak(current, epoch, std::memory_order_acq_rel)) {
      for (std::uint64_t e = std::max(current + 1, epoch >= kBuckets ? epoch - kBuckets + 1 : 0); e <= epoch; ++e) {
        Atomic(cell.busy_ns[e % kBuckets]).store(0, std::memory_order_relaxed);
      }
      current = epoch;
    }
  }
  const std::uint64_t span = std::min<std::uint64_t>(busy_ns, kBuckets * kBucketNs);
  const std::uint64_t start_ns = end_ns > span ? end_ns - span : 0;
  for (std::uint64_t e = start_ns / kBucketNs; e <= epoch; ++e) {
    if (e + kBuckets <= current) continue;  // too old to count anywhere
    const std::uint64_t from = std::max(start_ns, e * kBucketNs);
    const std::uint64_t to = std::min(end_ns, (e + 1) * kBucketNs);
    if (to <= from) continue;
    Atomic(cell.busy_ns[e % kBuckets]).fetch_add(static_cast<std::uint32_t>(to - from), std::memory_order_relaxed);
  }
}

// Adds `busy_ns` to bucket `epoch` (moving the ring on to it if it is newer); nothing if the ring has passed it.
void AddBusyInBucket(BudgetCell& cell, std::uint64_t epoch, std::uint64_t busy_ns) {
  const std::uint64_t end_ns = epoch * kBucketNs + (kBucketNs - 1);
  AddBusy(cell, end_ns, std::min<std::uint64_t>(busy_ns, kBucketNs - 1));
}

}  // namespace

void Limiter::InitCell(BudgetCell& cell, std::uint32_t share_permille, std::uint64_t burst_ns, std::uint64_t now_ns) {
  cell = BudgetCell{};
  cell.share_permille = share_permille;
  cell.rate_permille = share_permille;
  cell.budget_ns = static_cast<std::int64_t>(burst_ns * share_permille / 1000);
  cell.refilled_at_ns = now_ns;
  cell.bucket_epoch = now_ns / kBucketNs;
}

Limiter::Limiter(BudgetCell& cell, const LimiterConfig& config) : cell_(cell), config_(config) {
  config_.share_permille = std::clamp<std::uint32_t>(config_.share_permille, 1, 1000);
  own_rate_permille_ = config_.share_permille;
}

void Limiter::RefillOwn(std::uint64_t now_ns) {
  const auto burst =
      static_cast<std::int64_t>(std::max<std::uint64_t>(BurstNs(), config_.burst_ns * own_rate_permille_ / 1000));
  if (own_refilled_at_ns_ == 0) {
    own_budget_ns_ = static_cast<std::int64_t>(config_.burst_ns * config_.share_permille / 1000);
    own_refilled_at_ns_ = std::max<std::uint64_t>(now_ns, 1);
    return;
  }
  if (now_ns <= own_refilled_at_ns_) return;
  const std::uint64_t gap = std::min(now_ns - own_refilled_at_ns_, kMaxRefillGapNs);
  own_refilled_at_ns_ = now_ns;
  if (own_budget_ns_ >= burst) return;
  own_budget_ns_ = std::min(own_budget_ns_ + static_cast<std::int64_t>(gap * OwnRate() / 1000), burst);
}

std::uint32_t Limiter::OwnRate() const {
  return std::max<std::uint32_t>(
      static_cast<std::uint32_t>(std::uint64_t{own_rate_permille_} * own_scale_permille_ / 1000), 1);
}

void Limiter::ScaleOwn(std::uint32_t scale_permille, std::uint64_t now_ns) {
  scale_permille = std::clamp<std::uint32_t>(scale_permille, 1, 1000);
  if (scale_permille == own_scale_permille_) return;
  if (own_refilled_at_ns_ != 0) RefillOwn(now_ns);  // the time so far refills at the old rate
  own_scale_permille_ = scale_permille;
}

std::uint32_t NextMonitorScale(std::uint32_t scale_permille, std::uint32_t used_permille,
                               std::uint32_t limit_permille) {
  if (limit_permille == 0) return 1000;
  const auto scaled = [&](std::uint32_t used) {
    return static_cast<std::uint32_t>(std::uint64_t{scale_permille} * limit_permille /
                                      std::max<std::uint32_t>(used, 1));
  };
  if (used_permille > limit_permille + kMonitorMarginPermille) {
    return std::max(kMonitorLeastScalePermille, scaled(used_permille));
  }
  if (scale_permille < 1000 && used_permille + kMonitorMarginPermille < limit_permille) {
    return std::min<std::uint32_t>(1000, std::max(scale_permille, scaled(used_permille)));
  }
  return scale_permille;
}

// A settlement gives back `delta_ns` of what was charged (negative: takes more).
void Limiter::AdjustOwn(std::int64_t delta_ns) {
  Spend(-delta_ns);
  if (config_.throttle && own_refilled_at_ns_ != 0) own_budget_ns_ += delta_ns;
}

void Limiter::Spend(std::int64_t ns) {
  spent_ns_.store(spent_ns_.load(std::memory_order_relaxed) + ns, std::memory_order_relaxed);
}

// The budget holds the share of the burst, and never less than one of the longest kernels seen: a tenant whose
// kernels are longer than share x burst must still be able to save up for one while others run.
std::uint64_t Limiter::BurstNs() const {
  return std::max(config_.burst_ns * config_.share_permille / 1000, largest_estimate_ns_);
}

void Limiter::Refill(std::uint64_t now_ns) {
  auto refilled_at = Atomic(cell_.refilled_at_ns);
  std::uint64_t last = refilled_at.load(std::memory_order_acquire);
  while (now_ns > last) {
    // The exchange gives one caller the interval (last, now]: nobody refills a moment twice.
    if (!refilled_at.compare_exchange_weak(last, now_ns, std::memory_order_acq_rel)) continue;
    const std::uint64_t gap = std::min(now_ns - last, kMaxRefillGapNs);
    const std::uint32_t rate = std::max<std::uint32_t>(Atomic(cell_.rate_permille).load(std::memory_order_relaxed), 1);
    const auto add = static_cast<std::int64_t>(gap * rate / 1000);
    const auto burst = static_cast<std::int64_t>(std::max<std::uint64_t>(BurstNs(), config_.burst_ns * rate / 1000));
    auto budget = Atomic(cell_.budget_ns);
    std::int64_t current = budget.load(std::memory_order_relaxed);
    for (;;) {
      const std::int64_t next = current >= burst ? current : std::min(current + add, burst);
      if (budget.compare_exchange_weak(current, next, std::memory_order_acq_rel)) break;
    }
    return;
  }
}

std::uint64_t Limiter::EstimateNs(const KernelKey& key) const {
  const auto it = costs_.find(key);
  return it != costs_.end() && it->second.count > 0 ? it->second.estimate_ns : config_.default_cost_ns;
}

bool Limiter::Known(const KernelKey& key) const {
  const auto it = costs_.find(key);
  return it != costs_.end() && it->second.count > 0;
}

Admission Limiter::Admit(const KernelKey& key, std::uint64_t now_ns, bool bound_in_flight) {
  Admission admission;
  Cost& cost = costs_[key];
  const std::uint64_t estimate =
      std::max<std::uint64_t>(cost.count > 0 ? cost.estimate_ns : config_.default_cost_ns, 1);
  // Bound what may be queued unmeasured: queued kernels cannot overrun the cap however wrong their estimates. A
  // kernel of unknown cost runs one launch at a time, throttled or not: its runs are then each timed alone.
  if (bound_in_flight &&
      ((cost.count == 0 && cost.unknown_in_flight > 0) ||
       (config_.throttle && in_flight_ns_ > 0 && in_flight_ns_ + estimate > config_.in_flight_max_ns))) {
    admission.wait_for_completion = true;
    return admission;
  }
  admission.known = cost.count > 0;
  admission.steady = cost.count > 0 && cost.longer_sum <= 2 * estimate * std::min<std::uint32_t>(cost.count, 64);
  admission.launches = cost.launches;
  if (cost.launches != std::numeric_limits<std::uint32_t>::max()) ++cost.launches;
  if (cost.count == 0) ++cost.unknown_in_flight;
  in_flight_ns_ += estimate;
  Spend(static_cast<std::int64_t>(estimate));
  admission.charged_ns = estimate;
  admission.ready_at_ns = now_ns;
  if (!config_.throttle) return admission;
  // The shared refill (two exchanges on the region) is made at most every kRefillEveryNs by launches that find
  // budget; a launch that finds none refills first, so the debt it waits for is exact. Deferred, the refill meets
  // the burst's cap later: the budget may then hold up to kRefillEveryNs x share more than the burst, no more.
  const bool refill_due = now_ns >= Atomic(cell_.refilled_at_ns).load(std::memory_order_relaxed) + kRefillEveryNs;
  if (refill_due) Refill(now_ns);
  std::int64_t after =
      Atomic(cell_.budget_ns).fetch_sub(static_cast<std::int64_t>(estimate), std::memory_order_acq_rel) -
      static_cast<std::int64_t>(estimate);
  if (after < 0 && !refill_due) {
    Refill(now_ns);
    after = Atomic(cell_.budget_ns).load(std::memory_order_acquire);
  }
  if (after < 0) {
    // In debt: wait until the refill has paid it back, and the pace more (the launches after this one then go back
    // to back). Precise: a deadline, not a nap.
    const std::uint32_t rate = std::max<std::uint32_t>(Atomic(cell_.rate_permille).load(std::memory_order_relaxed), 1);
    const auto debt = static_cast<std::uint64_t>(-after) + PaceNs();
    admission.ready_at_ns = now_ns + (debt * 1000 + rate - 1) / rate;
  }
  // And by this process's own count, whatever the cell says.
  RefillOwn(now_ns);
  own_budget_ns_ -= static_cast<std::int64_t>(estimate);
  if (own_budget_ns_ < 0) {
    const std::uint32_t rate = OwnRate();
    const auto debt = static_cast<std::uint64_t>(-own_budget_ns_) + PaceNs();
    admission.ready_at_ns = std::max(admission.ready_at_ns, now_ns + (debt * 1000 + rate - 1) / rate);
  }
  return admission;
}

// The pace never exceeds a quarter of what the budget can hold: a small share still saves up for its bursts.
std::uint64_t Limiter::PaceNs() const { return std::min(config_.pace_ns, BurstNs() / 4); }

void Limiter::Forget(const KernelKey& key, std::uint64_t charged_ns) {
  in_flight_ns_ -= std::min(in_flight_ns_, charged_ns);
  if (auto it = costs_.find(key); it != costs_.end() && it->second.unknown_in_flight > 0)
    --it->second.unknown_in_flight;
}

static std::uint64_t SecondLargest(const std::uint64_t* values, std::uint32_t n) {
  std::uint64_t first = 0;
  std::uint64_t second = 0;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (values[i] > first) {
      second = first;
      first = values[i];
    } else if (values[i] > second) {
      second = values[i];
    }
  }
  return second;
}

// The launch charge is the median of the recent runs. Events count the time slices of other containers that preempt
// a kernel inside it: a kernel longer than a slice next to a busy container is over-charged, never under
// (docs/compute-limit.md, "What is not held").
void Limiter::Learn(const KernelKey& key, std::uint64_t measured_ns) {
  Cost& cost = costs_[key];
  std::uint64_t& replaced = cost.recent[cost.count % 16];
  // A full window whose replaced run measured the same holds the same values: its median and quartile stand (a
  // kernel that runs alike every time, as the simulator's do: the two selections were 19 % of sim_bench).
  const bool unchanged = cost.count >= 16 && replaced == measured_ns;
  replaced = measured_ns;
  ++cost.count;
  if (!unchanged) {
    const std::uint32_t n = std::min<std::uint32_t>(cost.count, 16);
    std::uint64_t sorted[16]{};  // (zeroed: GCC 12 at -O3 cannot see that nth_element reads only the n copied)
    std::copy(cost.recent, cost.recent + n, sorted);
    std::nth_element(sorted, sorted + n / 2, sorted + n);
    cost.estimate_ns = sorted[n / 2];
    std::nth_element(sorted + n / 2, sorted + (3 * n) / 4, sorted + n);  // the upper half only: all >= the median
    cost.upper_quartile_ns = sorted[(3 * n) / 4];
  }
  std::uint64_t& oldest = cost.longer[(cost.count - 1) % 64];
  const bool same_longer = cost.count > 64 && oldest == measured_ns;  // (as above: the two largest stand)
  cost.longer_sum += measured_ns - oldest;  // modular arithmetic: exact while the true sum fits
  oldest = measured_ns;
  if (!same_longer) cost.longer_second_ns = SecondLargest(cost.longer, std::min<std::uint32_t>(cost.count, 64));
  largest_estimate_ns_ = std::max({largest_estimate_ns_, cost.estimate_ns, measured_ns});
}

std::uint64_t Limiter::LongestRunNs() const {
  std::uint64_t longest = 0;
  for (const auto& [key, cost] : costs_) {
    if (cost.count >= 3) longest = std::max(longest, cost.longer_second_ns);
  }
  return longest;
}

void Limiter::Settle(const KernelKey& key, std::uint64_t charged_ns, std::optional<std::uint64_t> measured_ns,
                     std::uint64_t now_ns, bool learn) {
  Forget(key, charged_ns);
  std::uint64_t accounted = charged_ns;
  if (measured_ns.has_value() && *measured_ns > 0 && *measured_ns < kAbsurdNs) {
    // The run is accounted at what it measured, so the long-run budget is exact for a lone container whatever its
    // kernels do (jitter, one function given different sizes).
    if (learn) Learn(key, *measured_ns);
    accounted = *measured_ns;
  } else {
    ++ignored_measurements_;  // missing or garbage: the estimate stands, nothing blocks on it
  }
  if (config_.throttle) {
    Atomic(cell_.budget_ns)
        .fetch_add(static_cast<std::int64_t>(charged_ns) - static_cast<std::int64_t>(accounted),
                   std::memory_order_acq_rel);
  }
  AdjustOwn(static_cast<std::int64_t>(charged_ns) - static_cast<std::int64_t>(accounted));
  AddBusy(cell_, now_ns, BusyOf(key, accounted));
}

// The busy time recorded for utilization and the `default` policy: no more than the kernel's usual run (the median
// of its recent runs). The budget is charged the measurement (never less than the kernel occupied the GPU); but a
// run stretched by another container's time slices would count that container's time as ours, and "nobody else
// wants the GPU" would then read true exactly when someone does (a lender that never gave the GPU back, live).
std::uint64_t Limiter::BusyOf(const KernelKey& key, std::uint64_t accounted_ns) const {
  const auto it = costs_.find(key);
  return BusyOf(it != costs_.end() ? &it->second : nullptr, accounted_ns);
}

std::uint64_t Limiter::BusyOf(const Cost* cost, std::uint64_t accounted_ns) {
  return cost != nullptr && cost->count > 0 ? std::min(accounted_ns, cost->estimate_ns) : accounted_ns;
}

void Limiter::Cancel(const KernelKey& key, std::uint64_t charged_ns) {
  Forget(key, charged_ns);
  if (config_.throttle)
    Atomic(cell_.budget_ns).fetch_add(static_cast<std::int64_t>(charged_ns), std::memory_order_acq_rel);
  AdjustOwn(static_cast<std::int64_t>(charged_ns));
}

// What a launch that was not measured costs: the mean of the kernel's last 64 measurements (its charge if it was
// never measured). The mean, not the median: the launches measured are drawn at random, so their mean is what a
// launch costs on average, whatever the kernel's run times do. The median of a skewed mix is far below it: one
// function launched at 5 us .. 5 ms got 62 % at a 30 % cap; a kernel whose run time depends on its data (long one
// launch in eight) got several times its cap (docs/threat-model.md). The median's one merit, ignoring a stray pair
// that timed a host pause before an idle stream started the kernel, is kept by the shim: such a pair no longer
// counts the host's time (docs/compute-limit.md, "Measurement windows").
std::uint64_t Limiter::UnmeasuredCost(const KernelKey& key, std::uint64_t charged_ns) const {
  const auto it = costs_.find(key);
  return MeanOf(it != costs_.end() ? &it->second : nullptr, charged_ns);
}

std::uint64_t Limiter::MeanOf(const Cost* cost, std::uint64_t charged_ns) {
  if (cost == nullptr || cost->count == 0) return charged_ns;
  return cost->longer_sum / std::min<std::uint32_t>(cost->count, 64);
}

// (On every launch that is not measured: what Forget, UnmeasuredCost and BusyOf do, with one lookup of the record.)
std::uint64_t Limiter::SettleUnmeasured(const KernelKey& key, std::uint64_t charged_ns, std::uint64_t now_ns) {
  in_flight_ns_ -= std::min(in_flight_ns_, charged_ns);
  Cost* cost = nullptr;
  if (const auto it = costs_.find(key); it != costs_.end()) {
    cost = &it->second;
    if (cost->unknown_in_flight > 0) --cost->unknown_in_flight;
  }
  const std::uint64_t accounted = MeanOf(cost, charged_ns);
  const std::uint64_t busy = BusyOf(cost, accounted);
  const auto delta = static_cast<std::int64_t>(charged_ns) - static_cast<std::int64_t>(accounted);
  if (config_.throttle && delta != 0) Atomic(cell_.budget_ns).fetch_add(delta, std::memory_order_acq_rel);
  AdjustOwn(delta);
  if (!config_.defer_busy) {
    AddBusy(cell_, now_ns, busy);
    return accounted;
  }
  if (const std::uint64_t epoch = now_ns / kBucketNs; epoch != busy_epoch_) {
    FlushBusy();
    busy_epoch_ = epoch;
  }
  busy_held_ns_ += busy;
  return accounted;
}

// Of `n` launches at `each_ns`, as many as the budget (the cell's and this process's own) holds now without debt,
// taken from both: a book never waits, and never makes a debt another launch would wait for. 0: none taken.
std::uint32_t Limiter::TakeWithoutDebt(std::uint64_t now_ns, std::uint32_t n, std::uint64_t each_ns) {
  if (!config_.throttle || n == 0) {
    Spend(static_cast<std::int64_t>(std::uint64_t{n} * each_ns));
    return n;
  }
  if (now_ns >= Atomic(cell_.refilled_at_ns).load(std::memory_order_relaxed) + kRefillEveryNs) Refill(now_ns);
  const std::int64_t shared = Atomic(cell_.budget_ns).load(std::memory_order_acquire);
  RefillOwn(now_ns);
  const std::int64_t have = std::min(shared, own_budget_ns_);
  n = have <= 0 ? 0
                : static_cast<std::uint32_t>(std::min<std::uint64_t>(n, static_cast<std::uint64_t>(have) / each_ns));
  if (n == 0) return 0;
  const auto total = static_cast<std::int64_t>(n * each_ns);
  if (Atomic(cell_.budget_ns).fetch_sub(total, std::memory_order_acq_rel) < total) {
    // Another process took the budget meanwhile: none (its debt would not be waited for).
    Atomic(cell_.budget_ns).fetch_add(total, std::memory_order_acq_rel);
    return 0;
  }
  own_budget_ns_ -= total;
  Spend(total);
  return n;
}

std::uint32_t Limiter::AdmitBook(const KernelKey& key, std::uint64_t now_ns, std::uint32_t most, std::uint64_t most_ns,
                                 std::uint64_t& accounted_each_ns) {
  const auto it = costs_.find(key);
  if (it == costs_.end() || it->second.count == 0 || most == 0) return 0;
  Cost& cost = it->second;
  const std::uint64_t each = std::max<std::uint64_t>(MeanOf(&cost, 0), 1);
  const std::uint32_t n =
      TakeWithoutDebt(now_ns, static_cast<std::uint32_t>(std::min<std::uint64_t>(most, most_ns / each)), each);
  if (n == 0) return 0;
  cost.launches = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(std::uint64_t{cost.launches} + n, std::numeric_limits<std::uint32_t>::max()));
  const std::uint64_t busy = BusyOf(&cost, each) * n;
  if (config_.defer_busy) {
    if (const std::uint64_t epoch = now_ns / kBucketNs; epoch != busy_epoch_) {
      FlushBusy();
      busy_epoch_ = epoch;
    }
    busy_held_ns_ += busy;
  } else {
    AddBusy(cell_, now_ns, busy);
  }
  accounted_each_ns = each;
  return n;
}

std::uint32_t Limiter::AdmitWindowBook(const KernelKey& key, std::uint64_t now_ns, std::uint32_t most,
                                       std::uint64_t most_ns, std::uint64_t& charged_each_ns) {
  const auto it = costs_.find(key);
  if (it == costs_.end() || it->second.count == 0 || most == 0) return 0;
  Cost& cost = it->second;
  const std::uint64_t each = std::max<std::uint64_t>(cost.estimate_ns, 1);
  std::uint64_t n = std::min<std::uint64_t>(most, most_ns / each);
  if (config_.throttle) {  // within what may be queued unmeasured, as Admit holds each launch
    n = in_flight_ns_ >= config_.in_flight_max_ns ? 0 : std::min(n, (config_.in_flight_max_ns - in_flight_ns_) / each);
  }
  const std::uint32_t granted = TakeWithoutDebt(now_ns, static_cast<std::uint32_t>(n), each);
  if (granted == 0) return 0;
  in_flight_ns_ += granted * each;
  cost.launches = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(std::uint64_t{cost.launches} + granted, std::numeric_limits<std::uint32_t>::max()));
  charged_each_ns = each;
  return granted;
}

// Launches settled as unmeasured (SettleUnmeasured, AdmitBook) that were never made: a book's unused launches, or a
// launch the driver refused. Nothing ran, nothing is owed.
void Limiter::Refund(const KernelKey& key, std::uint32_t launches, std::uint64_t accounted_each_ns) {
  if (launches == 0) return;
  const std::uint64_t total = std::uint64_t{launches} * accounted_each_ns;
  if (config_.throttle) Atomic(cell_.budget_ns).fetch_add(static_cast<std::int64_t>(total), std::memory_order_acq_rel);
  AdjustOwn(static_cast<std::int64_t>(total));
  // (Busy time already flushed stays: at most one flush interval's launches.)
  busy_held_ns_ -= std::min(busy_held_ns_, std::uint64_t{launches} * BusyOf(key, accounted_each_ns));
}

void Limiter::FlushBusy() {
  if (busy_held_ns_ == 0) return;
  AddBusyInBucket(cell_, busy_epoch_, busy_held_ns_);
  busy_held_ns_ = 0;
}

void Limiter::SettleWindow(const WindowLaunch* launches, std::size_t count, std::optional<std::uint64_t> measured_ns,
                           std::uint64_t now_ns) {
  std::uint64_t charged = 0, estimated = 0;
  for (std::size_t i = 0; i < count; ++i) {
    Forget(launches[i].key, launches[i].charged_ns);
    charged += launches[i].charged_ns;
  }
  const bool known = measured_ns.has_value() && *measured_ns > 0 && *measured_ns < kAbsurdNs && charged > 0;
  std::uint64_t accounted = 0;
  if (known) {
    accounted = *measured_ns;
    // Each kernel of the window learns once per window: its part of the total (apportioned by the charges), per
    // launch. A window of one kernel's launches teaches that kernel exactly its mean run time in the window.
    for (std::size_t i = 0; i < count; ++i) {
      bool seen = false;
      for (std::size_t j = 0; j < i && !seen; ++j) seen = launches[j].key == launches[i].key;
      if (seen) continue;
      std::uint64_t own = 0, launches_of_key = 0;
      for (std::size_t j = i; j < count; ++j) {
        if (launches[j].key == launches[i].key) {
          own += launches[j].charged_ns;
          ++launches_of_key;
        }
      }
      const auto part = static_cast<std::uint64_t>(static_cast<double>(accounted) * static_cast<double>(own) /
                                                   static_cast<double>(charged));
      Learn(launches[i].key, std::max<std::uint64_t>(part / launches_of_key, 1));
      estimated += launches_of_key * EstimateNs(launches[i].key);
    }
  } else {
    ++ignored_measurements_;
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t cost = UnmeasuredCost(launches[i].key, launches[i].charged_ns);
      accounted += cost;
      estimated += cost;
    }
  }
  if (config_.throttle) {
    Atomic(cell_.budget_ns)
        .fetch_add(static_cast<std::int64_t>(charged) - static_cast<std::int64_t>(accounted),
                   std::memory_order_acq_rel);
  }
  AdjustOwn(static_cast<std::int64_t>(charged) - static_cast<std::int64_t>(accounted));
  AddBusy(cell_, now_ns, std::min(accounted, estimated));  // see BusyOf
}

void Limiter::ObserveOthers(double others_busy_fraction, std::uint64_t now_ns) {
  if (!config_.lend_when_idle) return;
  const std::uint32_t wanted = others_busy_fraction < 0.05 ? 1000 : config_.share_permille;
  if (own_rate_permille_ != wanted) {
    if (own_refilled_at_ns_ != 0) RefillOwn(now_ns);  // the time so far refills at the old rate
    own_rate_permille_ = wanted;
    if (wanted == config_.share_permille) {
      own_budget_ns_ = std::min(own_budget_ns_, static_cast<std::int64_t>(BurstNs()));
    }
  }
  auto rate = Atomic(cell_.rate_permille);
  if (rate.load(std::memory_order_relaxed) == wanted) return;
  Refill(now_ns);  // the time so far refills at the old rate
  rate.store(wanted, std::memory_order_relaxed);
  if (wanted == config_.share_permille) {
    // Handing the GPU back: no hoard from the free-running period survives the switch.
    auto budget = Atomic(cell_.budget_ns);
    std::int64_t current = budget.load(std::memory_order_relaxed);
    const auto burst = static_cast<std::int64_t>(BurstNs());
    while (current > burst && !budget.compare_exchange_weak(current, burst, std::memory_order_acq_rel)) {
    }
  }
}

double Limiter::PublishedShare(const BudgetCell& cell, std::uint64_t now_ns) {
  constexpr std::uint64_t kSecondNs = 1'000'000'000;
  const std::uint64_t end = now_ns / kBucketNs * kBucketNs;
  return end >= kSecondNs ? BusyFraction(cell, end - kSecondNs, end) : BusyFraction(cell, 0, end);
}

double Limiter::BusyFraction(const BudgetCell& cell, std::uint64_t from_ns, std::uint64_t to_ns) {
  if (to_ns <= from_ns) return 0;
  auto& mutable_cell = const_cast<BudgetCell&>(cell);
  const std::uint64_t newest = Atomic(mutable_cell.bucket_epoch).load(std::memory_order_acquire);
  double busy = 0;
  // Only the ring's buckets can hold anything: a period reaching further back starts where the ring does.
  const std::uint64_t oldest = newest >= kBuckets ? newest - kBuckets + 1 : 0;
  for (std::uint64_t e = std::max(from_ns / kBucketNs, oldest); e * kBucketNs < to_ns; ++e) {
    if (e > newest || e + kBuckets <= newest) continue;  // not recorded, or overwritten
    const std::uint64_t from = std::max(from_ns, e * kBucketNs);
    const std::uint64_t to = std::min(to_ns, (e + 1) * kBucketNs);
    const double recorded = Atomic(mutable_cell.busy_ns[e % kBuckets]).load(std::memory_order_relaxed);
    busy += recorded * static_cast<double>(to - from) / static_cast<double>(kBucketNs);
  }
  return busy / static_cast<double>(to_ns - from_ns);
}

}  // namespace vgpu::policy
