// The simulator's event loop: host-side processes calling the limiter and queueing kernels, fakecuda's timeline
// running them, both in virtual nanoseconds. The loop stops exactly at every kernel completion, host wake-up,
// NVML read and share window, so every process reacts at the instant it would in real life.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "random.h"
#include "vgpu/policy/limiter.h"
#include "vgpu/sim/sim.h"

namespace vgpu::sim {
namespace {

namespace model = fakecuda::model;

constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint32_t kDevice = 0;
constexpr std::int32_t kFirstPid = 1000;
constexpr std::uintptr_t kFirstFunction = 0x10000;  // kernel "functions" are addresses only the limiter sees

// Appends JSON-lines fields without allocation per field; integers only, so the bytes are the same everywhere.
class LineWriter {
 public:
  explicit LineWriter(std::string& out) : out_(out) {}
  LineWriter& Begin(const char* event) {
    out_ += "{\"ev\":\"";
    out_ += event;
    out_ += '"';
    return *this;
  }
  LineWriter& Text(const char* key, const std::string& value) {
    Key(key);
    out_ += '"';
    out_ += value;  // validated: plain characters only
    out_ += '"';
    return *this;
  }
  LineWriter& Number(const char* key, std::uint64_t value) {
    Key(key);
    char digits[24];
    const auto [end, ec] = std::to_chars(digits, digits + sizeof digits, value);
    out_.append(digits, end);
    return *this;
  }
  void End() { out_ += "}\n"; }

 private:
  void Key(const char* key) {
    out_ += ",\"";
    out_ += key;
    out_ += "\":";
  }
  std::string& out_;
};

std::uint64_t Fnv1a64(const std::string& bytes) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : bytes) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

struct KernelKind {
  policy::KernelKey key;
  std::uint64_t duration_ns;
  std::string name;
};

struct InFlight {
  std::uint64_t seq;
  std::uint32_t kind;
  std::uint64_t charged_ns;
};

// The kernels a process has queued and not yet seen complete, oldest first (one stream: they complete in order).
class InFlightQueue {
 public:
  std::uint32_t size() const { return count_; }
  bool Push(const InFlight& item) {
    if (count_ == model::kStreamDepth) return false;
    items_[(head_ + count_) % model::kStreamDepth] = item;
    ++count_;
    return true;
  }
  const InFlight& Front() const { return items_[head_]; }
  void Pop() {
    head_ = (head_ + 1) % model::kStreamDepth;
    --count_;
  }

 private:
  InFlight items_[model::kStreamDepth] = {};
  std::uint32_t head_ = 0;
  std::uint32_t count_ = 0;
};

enum class HostState {
  launch_due,              // the next launch call begins at the wake-up
  submitting,              // admitted: the call returns (the kernel is queued) at the wake-up
  waiting_for_completion,  // the queue is full or the limiter asked to settle first: woken by a completion
  stopped,
};

struct ProcessState {
  const Process* spec = nullptr;
  std::uint32_t tenant = 0;
  std::uint32_t index_in_tenant = 0;
  std::unique_ptr<policy::Limiter> limiter;
  SplitMix64 random{0};
  std::vector<KernelKind> kinds;
  std::uint32_t slot = model::kNoSlot;
  std::uint32_t stream = model::kNoSlot;
  HostState state = HostState::launch_due;
  bool has_pending = false;  // a kernel is chosen for the launch being made (kept across waits)
  std::uint32_t pending_kind = 0;
  std::uint64_t pending_duration_ns = 0;
  policy::Admission pending_admission;
  InFlightQueue in_flight;
  std::uint64_t launches = 0;
};

struct TenantState {
  const Tenant* spec = nullptr;
  policy::BudgetCell cell{};
  std::uint32_t share_permille = 1000;
  std::vector<std::uint32_t> processes;
  std::uint64_t busy_at_window_start_ns = 0;
  std::uint32_t reported_rate_permille = 0;
  TenantResult result;
};

struct Wake {
  std::uint64_t time_ns;
  std::uint32_t process;
  bool operator>(const Wake& other) const {
    return time_ns != other.time_ns ? time_ns > other.time_ns : process > other.process;
  }
};

class Engine final : public model::TimelineListener {
 public:
  explicit Engine(const Scenario& scenario) : scenario_(scenario) {}

  Result Run() {
    result_.seed = scenario_.seed;
    if (!Setup()) return std::move(result_);
    Loop();
    Finish();
    return std::move(result_);
  }

  void OnKernelComplete(const model::Machine& /*machine*/, std::uint32_t /*device*/, std::uint32_t stream,
                        const model::Op& op) override {
    if (stream >= process_by_stream_.size() || process_by_stream_[stream] == model::kNoSlot) {
      Fail("a kernel completed on stream " + std::to_string(stream) + ", which no process owns");
      return;
    }
    ProcessState& p = processes_[process_by_stream_[stream]];
    if (p.in_flight.size() == 0 || p.in_flight.Front().seq != op.seq) {
      Fail("stream " + std::to_string(stream) + " completed op " + std::to_string(op.seq) + " out of order");
      return;
    }
    const InFlight done = p.in_flight.Front();
    p.in_flight.Pop();
    // What CUDA events around the kernel measure: from its start to its end, time slices of others included.
    const std::uint64_t measured_ns = op.end_ns - op.start_ns;
    p.limiter->Settle(p.kinds[done.kind].key, done.charged_ns, measured_ns, op.end_ns);
    TenantState& tenant = tenants_[p.tenant];
    ++tenant.result.kernels;
    ++result_.kernels;
    if (op.end_ns != advancing_to_ns_) ++result_.late_completions;
    if (scenario_.record_trace) {
      LineWriter(result_.trace)
          .Begin("kernel")
          .Text("tenant", tenant.spec->name)
          .Number("process", p.index_in_tenant)
          .Number("pid", static_cast<std::uint64_t>(kFirstPid) + process_by_stream_[stream])
          .Number("device", kDevice)
          .Number("stream", stream)
          .Text("name", p.kinds[done.kind].name)
          .Number("queued_ns", op.queued_ns)
          .Number("start_ns", op.start_ns)
          .Number("end_ns", op.end_ns)
          .Number("charged_ns", done.charged_ns)
          .Number("measured_ns", measured_ns)
          .End();
    }
    if (p.state == HostState::waiting_for_completion) {
      p.state = HostState::launch_due;
      Schedule(process_by_stream_[stream], std::max(op.end_ns, now_ns_));
    }
  }

 private:
  bool Setup() {
    result_.error = Validate(scenario_);
    if (!result_.error.empty()) return false;
    model::MachineConfig config = model::DefaultConfig();
    std::string error;
    model::ParseDevices(scenario_.device, config, error);
    config.timeslice_ns = scenario_.timeslice_ns;
    config.mode = model::SchedulingMode::timeslice;
    machine_ = std::make_unique<model::Machine>();  // value-initialized: zeroed, as a fresh state file is
    model::InitMachine(*machine_, config, 0, 0);
    const model::DeviceSpec& spec = machine_->config.devices[kDevice];

    // Every kernel is one full wave of 256-thread blocks: it occupies the whole device for its duration, as a
    // persistent kernel does, and its duration is exactly the per-wave time.
    shape_ = model::LaunchShape{};
    shape_.block[0] = 256;
    shape_.block[1] = shape_.block[2] = 1;
    shape_.grid[0] = spec.sm_count * std::max<std::uint32_t>(1, model::ResidentBlocksPerSm(spec, shape_));
    shape_.grid[1] = shape_.grid[2] = 1;
    const std::uint64_t shape_key = (static_cast<std::uint64_t>(shape_.grid[0]) << 32) | shape_.block[0];

    tenants_.resize(scenario_.tenants.size());  // never resized again: limiters hold references to the cells
    for (std::uint32_t t = 0; t < scenario_.tenants.size(); ++t) {
      const Tenant& tenant = scenario_.tenants[t];
      TenantState& state = tenants_[t];
      state.spec = &tenant;
      state.share_permille = tenant.share_percent == 0 ? 1000 : tenant.share_percent * 10;
      policy::LimiterConfig defaults;
      policy::Limiter::InitCell(state.cell, state.share_permille, defaults.burst_ns, 0);
      state.reported_rate_permille = state.cell.rate_permille;
      state.result.name = tenant.name;
      state.result.cap = state.share_permille / 1000.0;
      for (std::uint32_t i = 0; i < tenant.processes.size(); ++i) {
        const auto index = static_cast<std::uint32_t>(processes_.size());
        processes_.emplace_back();
        ProcessState& p = processes_.back();
        p.spec = &tenant.processes[i];
        p.tenant = t;
        p.index_in_tenant = i;
        p.random = SplitMix64::Derive(scenario_.seed, index);
        policy::LimiterConfig limiter_config;
        limiter_config.share_permille = state.share_permille;
        limiter_config.throttle = tenant.policy != Policy::disable;
        limiter_config.lend_when_idle = tenant.policy == Policy::default_policy;
        p.limiter = std::make_unique<policy::Limiter>(state.cell, limiter_config);
        const Workload& w = p.spec->workload;
        const std::vector<std::uint64_t> sizes =
            w.kind == WorkloadKind::mixed ? w.sizes_ns : std::vector<std::uint64_t>{w.kernel_ns};
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          const bool one_function = w.kind != WorkloadKind::mixed || w.sizes_share_one_kernel;
          const std::uintptr_t function = kFirstFunction + (one_function ? 0 : k);
          p.kinds.push_back({policy::KernelKey{reinterpret_cast<const void*>(function), shape_key}, sizes[k],
                             one_function ? "sim_kernel" : "sim_kernel_" + std::to_string(k)});
        }
        p.slot = model::ClaimSlot(*machine_, kFirstPid + static_cast<std::int32_t>(index), 0);
        p.stream = p.slot == model::kNoSlot ? model::kNoSlot : model::CreateStream(*machine_, p.slot, kDevice, 0, 0);
        if (p.stream == model::kNoSlot) {
          result_.error = "the device model ran out of process slots or streams at process " + std::to_string(index);
          return false;
        }
        if (process_by_stream_.size() <= p.stream) process_by_stream_.resize(p.stream + 1, model::kNoSlot);
        process_by_stream_[p.stream] = index;
        state.processes.push_back(index);
      }
    }
    for (std::uint32_t i = 0; i < processes_.size(); ++i) {
      ProcessState& p = processes_[i];
      if (p.spec->workload.kind == WorkloadKind::rate) {
        // A seeded phase, so that tenants on the same schedule do not all launch at the same instant.
        const auto period_ns = static_cast<std::uint64_t>(1e9 / p.spec->workload.launches_per_second);
        rate_origin_ns_.push_back(p.spec->start_ns + (period_ns > 0 ? p.random.Below(period_ns) : 0));
      } else {
        rate_origin_ns_.push_back(p.spec->start_ns);
      }
      Schedule(i, rate_origin_ns_.back());
    }
    for (const Tenant& tenant : scenario_.tenants) lending_ = lending_ || tenant.policy == Policy::default_policy;
    next_observe_ns_ = lending_ ? 0 : kNever;
    next_window_ns_ = scenario_.window_ns;
    if (scenario_.record_trace) WriteHeader();
    return true;
  }

  void WriteHeader() {
    LineWriter(result_.trace)
        .Begin("sim")
        .Number("seed", scenario_.seed)
        .Text("device", scenario_.device)
        .Number("timeslice_ns", scenario_.timeslice_ns)
        .Number("duration_ns", scenario_.duration_ns)
        .Number("window_ns", scenario_.window_ns)
        .End();
    for (const TenantState& tenant : tenants_) {
      LineWriter(result_.trace)
          .Begin("tenant")
          .Text("tenant", tenant.spec->name)
          .Number("share_permille", tenant.share_permille)
          .Text("policy", PolicyName(tenant.spec->policy))
          .Number("processes", tenant.processes.size())
          .End();
    }
  }

  // The earliest time at which any queued kernel could complete: no completion can happen before it, so the
  // timeline may be advanced that far without a process missing the moment it should react.
  std::uint64_t EarliestPossibleCompletion() const {
    const model::DeviceTimeline& device = machine_->devices[kDevice];
    std::uint64_t active_ns = kNever;  // least work left at the head of the running process's stream
    std::uint64_t other_ns = kNever;   // ... of any other process's stream
    for (const ProcessState& p : processes_) {
      const model::Stream& s = machine_->streams[p.stream];
      if (s.head >= s.tail) continue;
      const model::Op& op = s.ring[s.head % model::kStreamDepth];
      // The model completes a kernel once less than half a nanosecond is left, running at most at full speed.
      const double left = std::ceil(op.remaining_ns - 0.5);
      const std::uint64_t need_ns = left < 1 ? 1 : static_cast<std::uint64_t>(left);
      std::uint64_t& least = p.slot == device.active_slot ? active_ns : other_ns;
      least = std::min(least, need_ns);
    }
    if (active_ns == kNever) return other_ns == kNever ? kNever : now_ns_ + other_ns;
    // Time-slicing: another process's kernel runs only after the running process's slice ends or its work does
    // (the latter is no earlier than its own first completion, already the first term).
    std::uint64_t earliest = now_ns_ + active_ns;
    if (other_ns != kNever) earliest = std::min(earliest, std::max(now_ns_, device.slice_end_ns) + other_ns);
    return earliest;
  }

  void Loop() {
    const std::uint64_t end_ns = scenario_.duration_ns;
    for (;;) {
      const std::uint64_t host_ns = wakes_.empty() ? kNever : wakes_.top().time_ns;
      const std::uint64_t next_ns =
          std::min({host_ns, next_observe_ns_, next_window_ns_, end_ns, EarliestPossibleCompletion()});
      ++result_.loop_steps;
      if (next_ns > now_ns_) {
        advancing_to_ns_ = next_ns;
        model::Advance(*machine_, kDevice, next_ns, this);
        now_ns_ = next_ns;
      } else if (next_ns < now_ns_) {
        Fail("the next event lies in the past: " + std::to_string(next_ns) + " < " + std::to_string(now_ns_));
      }
      if (!result_.error.empty()) return;
      if (now_ns_ == next_observe_ns_) Observe();
      if (now_ns_ == next_window_ns_) CloseWindow();
      if (now_ns_ >= end_ns) return;
      while (!wakes_.empty() && wakes_.top().time_ns == now_ns_) {
        const std::uint32_t index = wakes_.top().process;
        wakes_.pop();
        HostStep(index);
        if (!result_.error.empty()) return;
      }
    }
  }

  void Schedule(std::uint32_t process, std::uint64_t time_ns) { wakes_.push(Wake{time_ns, process}); }

  // One process's host side at `now_ns_`: what the shim and the application do between two waits.
  void HostStep(std::uint32_t index) {
    ProcessState& p = processes_[index];
    const Workload& w = p.spec->workload;
    for (;;) {
      if (p.state == HostState::submitting) {
        Submit(index);
        if (!result_.error.empty()) return;
        p.state = HostState::launch_due;  // the call returned: the next one begins now
        continue;
      }
      if (p.state != HostState::launch_due) return;
      if (now_ns_ >= p.spec->stop_ns) {
        p.state = HostState::stopped;
        return;
      }
      if (p.in_flight.size() >= w.queue_depth) {
        p.state = HostState::waiting_for_completion;
        return;
      }
      if (w.kind == WorkloadKind::rate) {
        const auto due_ns = rate_origin_ns_[index] +
                            static_cast<std::uint64_t>(static_cast<double>(p.launches) * 1e9 / w.launches_per_second);
        if (due_ns > now_ns_) {
          Schedule(index, due_ns);
          return;
        }
      }
      if (!p.has_pending) Choose(p);
      const policy::Admission admission = p.limiter->Admit(p.kinds[p.pending_kind].key, now_ns_);
      if (admission.wait_for_completion) {
        if (p.in_flight.size() == 0) {
          Fail("the limiter asked process " + std::to_string(index) + " to wait for a completion with none pending");
          return;
        }
        p.state = HostState::waiting_for_completion;
        return;
      }
      // The shim sleeps until ready_at, then launches; the call returns when the kernel is queued.
      p.pending_admission = admission;
      p.state = HostState::submitting;
      Schedule(index, std::max(now_ns_, admission.ready_at_ns) + p.spec->launch_overhead_ns);
      return;
    }
  }

  void Choose(ProcessState& p) {
    const Workload& w = p.spec->workload;
    p.pending_kind = p.kinds.size() == 1 ? 0 : static_cast<std::uint32_t>(p.random.Below(p.kinds.size()));
    std::uint64_t duration_ns = p.kinds[p.pending_kind].duration_ns;
    if (w.jitter_permille > 0) {
      const auto offset = static_cast<std::int64_t>(p.random.Below(2ull * w.jitter_permille + 1)) -
                          static_cast<std::int64_t>(w.jitter_permille);
      const auto delta = static_cast<std::int64_t>(duration_ns) * offset / 1000;
      duration_ns = static_cast<std::uint64_t>(std::max<std::int64_t>(1, static_cast<std::int64_t>(duration_ns) + delta));
    }
    p.pending_duration_ns = duration_ns;
    p.has_pending = true;
  }

  void Submit(std::uint32_t index) {
    ProcessState& p = processes_[index];
    model::KernelLaunch launch{};
    launch.shape = shape_;
    launch.per_wave_ns = p.pending_duration_ns;
    launch.name = p.kinds[p.pending_kind].name.c_str();
    std::uint64_t seq = 0;
    if (model::EnqueueKernel(*machine_, p.stream, launch, now_ns_, &seq) != model::EnqueueResult::ok ||
        !p.in_flight.Push(InFlight{seq, p.pending_kind, p.pending_admission.charged_ns})) {
      Fail("process " + std::to_string(index) + "'s stream queue is full");
      return;
    }
    p.has_pending = false;
    ++p.launches;
  }

  // `default` policy: what the shim learns from NVML, as fakecuda publishes it, minus the container's own share.
  void Observe() {
    const double device_busy = model::PublishedUtilizationPercent(*machine_, kDevice, now_ns_) / 100.0;
    for (TenantState& tenant : tenants_) {
      if (tenant.spec->policy != Policy::default_policy) continue;
      const double others = device_busy - policy::Limiter::PublishedShare(tenant.cell, now_ns_);
      for (const std::uint32_t index : tenant.processes) processes_[index].limiter->ObserveOthers(others, now_ns_);
      if (tenant.cell.rate_permille != tenant.reported_rate_permille) {
        tenant.reported_rate_permille = tenant.cell.rate_permille;
        if (scenario_.record_trace) {
          LineWriter(result_.trace)
              .Begin("rate")
              .Text("tenant", tenant.spec->name)
              .Number("t_ns", now_ns_)
              .Number("rate_permille", tenant.cell.rate_permille)
              .End();
        }
      }
    }
    next_observe_ns_ += scenario_.observe_period_ns;
  }

  // The share of a window is the time in which the tenant's kernels occupied the device: the model's exact
  // per-process busy time (a kernel's start..end would also count the slices of others that preempted it).
  void CloseWindow() {
    for (TenantState& tenant : tenants_) {
      std::uint64_t busy_ns = 0;
      for (const std::uint32_t index : tenant.processes) {
        busy_ns += machine_->slots[processes_[index].slot].busy_total_ns[kDevice];
      }
      const std::uint64_t window_busy_ns = busy_ns - tenant.busy_at_window_start_ns;
      tenant.busy_at_window_start_ns = busy_ns;
      tenant.result.window_shares.push_back(static_cast<double>(window_busy_ns) /
                                            static_cast<double>(scenario_.window_ns));
      if (scenario_.record_trace) {
        LineWriter(result_.trace)
            .Begin("window")
            .Text("tenant", tenant.spec->name)
            .Number("start_ns", now_ns_ - scenario_.window_ns)
            .Number("end_ns", now_ns_)
            .Number("busy_ns", window_busy_ns)
            .End();
      }
    }
    next_window_ns_ += scenario_.window_ns;
  }

  void Finish() {
    const std::size_t first = scenario_.settle_ns / scenario_.window_ns;
    for (TenantState& tenant : tenants_) {
      TenantResult& r = tenant.result;
      double sum = 0;
      for (std::size_t i = first; i < r.window_shares.size(); ++i) {
        sum += r.window_shares[i];
        r.worst_window_error = std::max(r.worst_window_error, std::fabs(r.window_shares[i] - r.cap));
      }
      r.mean_share = r.window_shares.size() > first ? sum / static_cast<double>(r.window_shares.size() - first) : 0;
      result_.tenants.push_back(std::move(r));
    }
    if (scenario_.record_trace) result_.trace_digest = Fnv1a64(result_.trace);
  }

  void Fail(const std::string& what) {
    if (result_.error.empty()) result_.error = "internal: " + what + " at " + std::to_string(now_ns_) + " ns";
  }

  const Scenario& scenario_;
  Result result_;
  std::unique_ptr<model::Machine> machine_;
  model::LaunchShape shape_{};
  std::vector<TenantState> tenants_;
  std::vector<ProcessState> processes_;
  std::vector<std::uint32_t> process_by_stream_;
  std::vector<std::uint64_t> rate_origin_ns_;
  std::priority_queue<Wake, std::vector<Wake>, std::greater<Wake>> wakes_;
  bool lending_ = false;
  std::uint64_t now_ns_ = 0;
  std::uint64_t advancing_to_ns_ = 0;
  std::uint64_t next_observe_ns_ = kNever;
  std::uint64_t next_window_ns_ = kNever;
};

}  // namespace

Result Run(const Scenario& scenario) { return Engine(scenario).Run(); }

}  // namespace vgpu::sim
