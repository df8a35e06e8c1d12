// The simulator's event loop: host-side processes calling the limiter and queueing kernels, fakecuda's timeline
// running them, both in virtual nanoseconds. The loop stops at every host wake-up, NVML read and share window, and
// wherever a kernel completion makes a process act, so every process acts at the instant it would in real life.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "random.h"
#include "shim_measure.h"
#include "vgpu/base/json_line.h"
#include "vgpu/policy/limiter.h"
#include "vgpu/policy/time_division.h"
#include "vgpu/sim/sim.h"

namespace vgpu::sim {
namespace {

namespace model = fakecuda::model;

constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint32_t kNvmlDevice = 0;  // `default` observes NVML here (Validate keeps such tenants on it)
constexpr std::int32_t kFirstPid = 1000;
constexpr std::uintptr_t kFirstFunction = 0x10000;  // kernel "functions" are addresses only the limiter sees

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
  bool collective = false;  // the segment's collective kernel (Workload::collective_ns)
};

struct InFlight {
  std::uint64_t seq;
  std::uint32_t kind;
  std::uint64_t charged_ns;
  MeasuredBy how = MeasuredBy::pair;  // Measurement::shim: how the shim measures it (else: every kernel, alone)
  bool first = false;                 // its kernel's first launch: charged what it measured, not learned from
  std::uint64_t called_ns = 0;        // its launch call reached the shim (TenantResult::responses_ns)
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

// A launch call: the host's own work (launch_overhead_ns), then the limiter's Admit, then (after the shim's sleep
// until ready_at, if any) the kernel is queued and the call returns; the next call begins at once.
enum class HostState {
  calling,              // in a launch call: Admit at the wake-up
  sleeping,             // admitted: the kernel is queued at the wake-up (ready_at)
  waiting_for_queue,    // queue_depth kernels in flight: the next call begins at a completion
  waiting_for_limiter,  // in a launch call, the limiter asked to settle first: Admit again at a completion
  waiting_for_turn,     // time division: admitted, no window yet; Decide again at the wake-up or, waiting for
                        // another tenant's work, at a completion
  stopped,
};

// One stretch of a process's schedule (Process::segments, or its workload/start/stop as the only one): launches from
// start_ns, none from stop_ns on. Its kernels are kinds[first_kind, first_kind + kind_count).
struct SegmentPlan {
  std::uint64_t start_ns = 0;
  std::uint64_t stop_ns = kNever;
  const Workload* workload = nullptr;
  std::uint32_t first_kind = 0;
  std::uint32_t kind_count = 0;
  std::uint32_t collective_kind = 0;  // Workload::collective_ns: its kind (after the others), else unused
  std::uint64_t rate_origin_ns = 0;   // rate: the schedule's first launch (a seeded phase after start_ns)
};

struct ProcessState {
  const Process* spec = nullptr;
  std::uint32_t device = 0;            // spec->device
  std::uint32_t since_collective = 0;  // kernels launched since its last collective
  std::vector<SegmentPlan> plans;
  std::uint32_t segment = 0;           // the plan BeginCall last launched from
  std::uint64_t segment_launches = 0;  // launches in it so far (the rate schedule's count)
  bool crashed = false;
  std::uint64_t crash_busy_ns = 0;  // its device time up to the crash (its slot is released then)
  std::uint32_t tenant = 0;
  std::uint32_t index_in_tenant = 0;
  std::unique_ptr<policy::Limiter> limiter;
  SplitMix64 random{0};
  std::vector<KernelKind> kinds;
  std::uint32_t slot = model::kNoSlot;
  std::uint32_t stream = model::kNoSlot;
  HostState state = HostState::calling;
  bool has_pending = false;  // a kernel is chosen for the launch being made (kept across waits)
  std::uint32_t pending_kind = 0;
  std::uint64_t pending_duration_ns = 0;
  policy::Admission pending_admission;
  policy::Release pending_release;  // time division: the window the pending launch goes into
  std::uint64_t turn_wait_since_ns = 0;
  bool undrained_at_arrival = false;  // time division: its kernels were in flight when the pending launch came
  // Time division: per kernel in flight (by seq), the idle window it borrowed for free (empty: none).
  std::vector<policy::Interval> free_windows;
  // Time division: when its released work is expected to be done. Per process: a tenant's processes slice each
  // other, so each one's estimates already hold the others' time, and its own queue's end is the tenant's.
  std::uint64_t queued_end_ns = 0;
  // Time division, turns inside its tenant (policy::DecideSibling): when it took the turn, and since when it waits
  // for a sibling's (kNever: it does not).
  std::uint64_t turn_held_since_ns = 0;
  std::uint64_t sibling_wait_since_ns = kNever;
  std::uint64_t handover_window_ns = policy::kNoTime;  // the own window whose handover it was charged last
  std::uint64_t last_end_ns = 0;                       // of the stream's previous kernel
  InFlightQueue in_flight;
  std::uint64_t last_queued_seq = 0;  // the stream's newest kernel (while in_flight holds any)
  std::uint64_t called_ns = 0;        // the pending launch's call reached the shim
  ShimMeasure measure;                // Measurement::shim: the shim's measure and settle stages on its stream
  MeasuredBy pending_measured_by = MeasuredBy::pair;
};

// A tenant's busy time at the end of an NVML sample window.
struct BusyAt {
  std::uint64_t end_ns = kNever;
  std::uint64_t busy_ns = 0;
};

struct TenantState {
  const Tenant* spec = nullptr;
  // Its budget per device (the shim's region has one per device); `cell` is device 0's, the one `default` observes.
  policy::BudgetCell cells[model::kMaxDevices]{};
  const policy::BudgetCell& cell() const { return cells[kNvmlDevice]; }
  std::uint64_t gpus = 0;  // bit d: one of its processes runs on device d
  std::uint32_t share_permille = 1000;
  std::vector<std::uint32_t> processes;
  std::uint64_t busy_at_window_start_ns = 0;
  std::uint32_t reported_rate_permille = 0;
  BusyAt busy_at_nvml_end[model::kWindowHistory];  // ring by window index
  TenantResult result;
  // Time division: the tenant's member in the plan (-1: not scheduled, left to the driver's time-slicing), and
  // whether it borrows idle windows (`default`).
  int member = -1;
  policy::TurnConfig turn;
  // Per device: its account, and up to when its GPU time is charged (its processes' kernels overlap). A tenant
  // that spans devices keeps one account for all of them (`accounts[0]`), charged its time on each divided by
  // their number: its ranks then see the same balance, and go into (and out of) debt together.
  policy::Account accounts[model::kMaxDevices];
  policy::Account& AccountOn(std::uint32_t device) { return accounts[std::popcount(gpus) > 1 ? 0 : device]; }
  std::uint64_t charged_until_ns[model::kMaxDevices] = {};
  // Per device: the turn its processes take there (policy::PackSiblingTurn), as the shim keeps it in the region.
  std::uint64_t sibling_turn[model::kMaxDevices] = {};
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
    --in_flight_count_[process_by_stream_[stream]];
    // Under time-slicing a running kernel has the device to itself, so its own GPU time is alone_ns.
    std::uint64_t measured_ns = op.alone_ns;
    if (scenario_.measurement == Measurement::events) {
      measured_ns = op.end_ns - op.start_ns;
    } else if (scenario_.measurement == Measurement::event_pair || scenario_.measurement == Measurement::shim) {
      // The shim's start event is queued just before the kernel. Queued behind the previous kernel, it is
      // written when that one ends (its process still holds the device then); queued on an empty stream, it
      // waits for its process's turn (fakecuda and the real GPU write it then), and the kernel starts at once.
      measured_ns = op.end_ns - (op.queued_ns < p.last_end_ns ? p.last_end_ns : op.start_ns);
    }
    p.last_end_ns = op.end_ns;
    if (scenario_.measurement != Measurement::shim) {
      p.limiter->Settle(p.kinds[done.kind].key, done.charged_ns, measured_ns, op.end_ns);
    } else {
      if (done.how == MeasuredBy::pair) {
        p.limiter->Settle(p.kinds[done.kind].key, done.charged_ns, measured_ns, op.end_ns, !done.first);
      }
      p.measure.Completed(*p.limiter, op.seq, op.end_ns, op.end_ns);
    }
    TenantState& tenant = tenants_[p.tenant];
    if (tenant.member >= 0) {
      SettleTurn(tenant, p, op, p.free_windows[done.seq % model::kStreamDepth]);
      if (p.in_flight.size() == 0) EndSiblingTurnAtDrain(process_by_stream_[stream], op.end_ns);
    }
    ++tenant.result.kernels;
    ++result_.kernels;
    if (scenario_.record_waits) tenant.result.responses_ns.push_back(op.end_ns - std::min(op.end_ns, done.called_ns));
    if (scenario_.record_trace) {
      base::JsonLine line(result_.trace);
      line.Begin("kernel")
          .Text("tenant", tenant.spec->name)
          .Number("process", p.index_in_tenant)
          .Number("pid", static_cast<std::uint64_t>(kFirstPid) + process_by_stream_[stream])
          .Number("device", p.device)
          .Number("stream", stream)
          .Text("name", p.kinds[done.kind].name)
          .Number("queued_ns", op.queued_ns)
          .Number("start_ns", op.start_ns)
          .Number("end_ns", op.end_ns)
          .Number("charged_ns", done.charged_ns)
          .Number("measured_ns", measured_ns);
      if (scenario_.measurement == Measurement::shim) line.Text("measured_by", MeasuredByName(done.how));
      line.End();
    }
    if (p.state == HostState::waiting_for_queue) {
      if (tenant.member >= 0) ReturnFromBlocking(process_by_stream_[stream], op.end_ns);
      BeginCall(process_by_stream_[stream], op.end_ns);
    } else if (p.state == HostState::waiting_for_limiter) {
      SetState(process_by_stream_[stream], HostState::calling);
      Schedule(process_by_stream_[stream], op.end_ns);
    }
    if (time_division_) WakeTurnWaiters(op.end_ns);
  }

 private:
  bool Setup() {
    result_.error = Validate(scenario_);
    if (!result_.error.empty()) return false;
    model::MachineConfig config = model::DefaultConfig();
    std::string error;
    model::ParseDevices(scenario_.device, config, error);
    config.timeslice_ns = scenario_.timeslice_ns;
    config.switch_ns = scenario_.switch_ns;
    config.mode = model::SchedulingMode::timeslice;
    machine_ = std::make_unique<model::Machine>();  // value-initialized: zeroed, as a fresh state file is
    model::InitMachine(*machine_, config, 0, 0);
    device_count_ = machine_->config.device_count;
    // Kernels are shaped for device 0; the devices of one scenario are of one preset in practice.
    const model::DeviceSpec& spec = machine_->config.devices[0];

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
      if (!SetupTenant(t, shape_key)) return false;
    }
    if (!PlanWindows()) return false;
    wake_ns_.assign(processes_.size(), kNever);
    in_flight_count_.assign(processes_.size(), 0);
    reacts_.assign(processes_.size(), 0);
    for (std::uint32_t i = 0; i < processes_.size(); ++i) {
      ProcessState& p = processes_[i];
      for (SegmentPlan& plan : p.plans) {
        plan.rate_origin_ns = plan.start_ns;
        if (plan.workload->kind == WorkloadKind::rate) {
          // A seeded phase, so that tenants on the same schedule do not all launch at the same instant.
          const auto period_ns = static_cast<std::uint64_t>(1e9 / plan.workload->launches_per_second);
          plan.rate_origin_ns += period_ns > 0 ? p.random.Below(period_ns) : 0;
        }
      }
      SetState(i, HostState::calling);
      Schedule(i, p.plans.front().rate_origin_ns + p.spec->launch_overhead_ns);
      if (p.spec->crash_ns != kNever) next_crash_ns_ = std::min(next_crash_ns_, p.spec->crash_ns);
    }
    for (const Tenant& tenant : scenario_.tenants) lending_ = lending_ || tenant.policy == Policy::default_policy;
    next_observe_ns_ = lending_ ? 0 : kNever;
    nvml_window_ns_ = machine_->config.nvml_window_ns;
    next_nvml_end_ns_ =
        lending_ && scenario_.others_estimate == OthersEstimate::nvml_minus_same_window ? nvml_window_ns_ : kNever;
    next_window_ns_ = scenario_.window_ns;
    next_sample_ns_ = scenario_.sample_ns != 0 ? scenario_.sample_ns : kNever;
    if (scenario_.sample_ns != 0) {
      const std::uint64_t samples = scenario_.duration_ns / scenario_.sample_ns;
      for (TenantState& tenant : tenants_) tenant.result.busy_samples_ns.reserve(samples);
    }
    if (scenario_.record_trace) WriteHeader();
    return true;
  }

  // A tenant's state, its limiters (measuring only where time division holds its share) and its processes' slots
  // and streams on their devices.
  bool SetupTenant(std::uint32_t t, std::uint64_t shape_key) {
    const Tenant& tenant = scenario_.tenants[t];
    TenantState& state = tenants_[t];
    state.spec = &tenant;
    state.share_permille = tenant.share_percent == 0 ? 1000 : tenant.share_percent * 10;
    policy::LimiterConfig limiter_config;
    limiter_config.share_permille = state.share_permille;
    const bool scheduled =
        scenario_.sharing == Sharing::time_division && tenant.policy != Policy::disable && state.share_permille < 1000;
    // Scheduled, the windows hold the share: the limiter measures and estimates only.
    limiter_config.throttle = tenant.policy != Policy::disable && !scheduled;
    limiter_config.lend_when_idle = tenant.policy == Policy::default_policy && !scheduled;
    if (scheduled) state.member = static_cast<int>(t);  // renumbered below
    state.turn.borrow_idle = tenant.policy == Policy::default_policy;
    state.turn.handover_ns = scenario_.switch_ns;
    state.turn.prompt_service = scenario_.prompt_service;
    if (tenant.burst_ns != 0) limiter_config.burst_ns = tenant.burst_ns;
    if (tenant.in_flight_max_ns != 0) limiter_config.in_flight_max_ns = tenant.in_flight_max_ns;
    for (policy::BudgetCell& cell : state.cells) {
      policy::Limiter::InitCell(cell, state.share_permille, limiter_config.burst_ns, 0);
    }
    state.reported_rate_permille = state.cell().rate_permille;
    state.result.name = tenant.name;
    std::uint64_t devices = 0;
    for (const Process& process : tenant.processes) devices |= 1ull << process.device;
    state.gpus = devices;
    state.result.cap = state.share_permille / 1000.0 * std::popcount(devices);
    for (std::uint32_t i = 0; i < tenant.processes.size(); ++i) {
      const auto index = static_cast<std::uint32_t>(processes_.size());
      processes_.emplace_back();
      ProcessState& p = processes_.back();
      p.spec = &tenant.processes[i];
      p.device = p.spec->device;
      p.tenant = t;
      p.index_in_tenant = i;
      p.random = SplitMix64::Derive(scenario_.seed, index);
      p.measure.Seed(policy::SamplerSeed(scenario_.seed, index));
      p.limiter = std::make_unique<policy::Limiter>(state.cells[p.device], limiter_config);
      PlanSegments(p, shape_key);
      p.slot = model::ClaimSlot(*machine_, kFirstPid + static_cast<std::int32_t>(index), 0);
      p.stream = p.slot == model::kNoSlot ? model::kNoSlot : model::CreateStream(*machine_, p.slot, p.device, 0, 0);
      if (p.stream == model::kNoSlot) {
        result_.error = "the device model ran out of process slots or streams at process " + std::to_string(index);
        return false;
      }
      if (process_by_stream_.size() <= p.stream) process_by_stream_.resize(p.stream + 1, model::kNoSlot);
      process_by_stream_[p.stream] = index;
      state.processes.push_back(index);
    }
    return true;
  }

  // Time division: the plan of the tenants with a limit (members numbered in tenant order, id = tenant index + 1).
  bool PlanWindows() {
    time_division_ = scenario_.sharing == Sharing::time_division;
    if (!time_division_) return true;
    std::vector<policy::Member> members;
    for (std::uint32_t t = 0; t < tenants_.size(); ++t) {
      TenantState& tenant = tenants_[t];
      if (tenant.member < 0) continue;
      tenant.member = static_cast<int>(members.size());
      members.push_back({t + 1ull, tenant.share_permille, tenant.gpus});
    }
    members_ = members;
    const std::string error = plan_.Build(members, scenario_.cycle_ns);
    if (!error.empty()) {
      result_.error = "time division: " + error;
      return false;
    }
    published_.assign(device_count_, std::vector<policy::Published>(members.size()));
    longest_ns_.assign(members.size(), 0);
    for (ProcessState& p : processes_) {
      if (tenants_[p.tenant].member >= 0) p.free_windows.assign(model::kStreamDepth, policy::Interval{});
    }
    return true;
  }

  // Scenario::cycle_max_ns: a tenant measured a kernel longer than its window; the plan is rebuilt on a longer
  // cycle (every tenant's account keeps its balance).
  void GrowCycle(const TenantState& tenant) {
    if (scenario_.cycle_max_ns == 0) return;
    std::uint64_t longest = 0;
    for (const std::uint32_t index : tenant.processes) {
      longest = std::max(longest, processes_[index].limiter->LongestRunNs());  // (as the shim: launch_release.cc)
    }
    std::uint64_t& published = longest_ns_[static_cast<std::size_t>(tenant.member)];
    if (longest <= published) return;
    published = longest;
    const std::uint64_t cycle = policy::CycleFor(members_, longest_ns_, scenario_.cycle_ns, scenario_.cycle_max_ns);
    if (cycle == plan_.cycle_ns()) return;
    const std::string error = plan_.Build(members_, cycle);
    if (!error.empty()) Fail("time division: " + error);
  }

  // The process's schedule and its kernels. Without segments: one plan from workload/start/stop, its kernels named
  // and keyed as they always were. With segments: each segment's kernels are functions of their own
  // ("sim_kernel_s<segment>[_<size>]"), so the limiter learns their costs apart.
  void PlanSegments(ProcessState& p, std::uint64_t shape_key) {
    const bool segmented = !p.spec->segments.empty();
    const std::size_t count = segmented ? p.spec->segments.size() : 1;
    p.plans.reserve(count);
    std::uintptr_t next_function = kFirstFunction;
    for (std::size_t s = 0; s < count; ++s) {
      SegmentPlan plan;
      if (segmented) {
        const Segment& segment = p.spec->segments[s];
        plan.start_ns = segment.start_ns;
        plan.stop_ns = segment.stop_ns;
        plan.workload = &segment.workload;
      } else {
        plan.start_ns = p.spec->start_ns;
        plan.stop_ns = p.spec->stop_ns;
        plan.workload = &p.spec->workload;
      }
      const Workload& w = *plan.workload;
      const std::vector<std::uint64_t> sizes =
          w.kind == WorkloadKind::mixed ? w.sizes_ns : std::vector<std::uint64_t>{w.kernel_ns};
      const bool one_function = w.kind != WorkloadKind::mixed || w.sizes_share_one_kernel;
      const std::string base = segmented ? "sim_kernel_s" + std::to_string(s) : "sim_kernel";
      plan.first_kind = static_cast<std::uint32_t>(p.kinds.size());
      plan.kind_count = static_cast<std::uint32_t>(sizes.size());
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::uintptr_t function = next_function + (one_function ? 0 : k);
        p.kinds.push_back({policy::KernelKey{reinterpret_cast<const void*>(function), shape_key}, sizes[k],
                           one_function ? base : base + "_" + std::to_string(k)});
      }
      next_function += one_function ? 1 : sizes.size();
      if (w.collective_ns != 0) {  // its own function: the limiter learns its cost apart
        plan.collective_kind = static_cast<std::uint32_t>(p.kinds.size());
        p.kinds.push_back({policy::KernelKey{reinterpret_cast<const void*>(next_function++), shape_key},
                           w.collective_ns, segmented ? "sim_collective_s" + std::to_string(s) : "sim_collective",
                           true});
      }
      p.plans.push_back(plan);
    }
  }

  void WriteHeader() {
    base::JsonLine(result_.trace)
        .Begin("sim")
        .Number("seed", scenario_.seed)
        .Text("device", scenario_.device)
        .Number("timeslice_ns", scenario_.timeslice_ns)
        .Number("switch_ns", scenario_.switch_ns)
        .Number("duration_ns", scenario_.duration_ns)
        .Number("window_ns", scenario_.window_ns)
        .End();
    for (const TenantState& tenant : tenants_) {
      base::JsonLine(result_.trace)
          .Begin("tenant")
          .Text("tenant", tenant.spec->name)
          .Number("share_permille", tenant.share_permille)
          .Text("policy", scenario::PolicyName(tenant.spec->policy))
          .Number("processes", tenant.processes.size())
          .End();
    }
  }

  // How long after its kernel completes a process acts on it, or kNever if it does not: then the completion only
  // settles the budget, which the process's own next step (it advances the model first) will see in time. With
  // other processes in the tenant, any completion may change what they are admitted, so it is acted on at once.
  std::uint64_t ReactionDelayNs(const ProcessState& p) const {
    // Under time division any completion may let a launch of another tenant go: every one is acted on.
    if (tenants_[p.tenant].processes.size() > 1 || time_division_) return 0;
    switch (p.state) {
      case HostState::waiting_for_limiter:
        return 0;  // Admit again at once
      case HostState::waiting_for_queue:
        return p.spec->launch_overhead_ns;  // the next call's Admit
      default:
        return kNever;
    }
  }

  // Work left in the head kernel of process `i`'s stream, as the least time it needs to complete, or kNever.
  std::uint64_t HeadNeedNs(std::uint32_t i) const {
    const model::Stream& s = machine_->streams[processes_[i].stream];
    if (s.head >= s.tail) return kNever;
    const model::Op& op = s.ring[s.head % model::kStreamDepth];
    // The model completes a kernel once less than half a nanosecond is left, running at most at full speed.
    const double left = std::ceil(op.remaining_ns - 0.5);
    return left < 1 ? 1 : static_cast<std::uint64_t>(left);
  }

  // The first instant at which a kernel's completion may need a process to act: the loop must stop there. Each
  // kernel completes no earlier than its work left at full speed after it can first run; under time-slicing a
  // process other than the running one on its device runs only after the running one's slice ends or its work does.
  // (A collective kernel waiting for its peers completes later than that: the loop then stops early, which is safe.)
  std::uint64_t NextCompletionStop() const {
    bool any_reaction = false;
    for (std::uint32_t i = 0; i < processes_.size() && !any_reaction; ++i) {
      // in_flight_count_ and reacts_ are compact copies: most processes have nothing queued or do not react.
      any_reaction = in_flight_count_[i] != 0 && reacts_[i] != 0;
    }
    if (!any_reaction) return kNever;
    std::uint64_t active_need_ns[model::kMaxDevices];
    std::fill(std::begin(active_need_ns), std::end(active_need_ns), kNever);
    for (std::uint32_t i = 0; i < processes_.size(); ++i) {
      const ProcessState& p = processes_[i];
      if (in_flight_count_[i] != 0 && p.slot == machine_->devices[p.device].active_slot) {
        active_need_ns[p.device] = std::min(active_need_ns[p.device], HeadNeedNs(i));
      }
    }
    std::uint64_t stop_ns = kNever;
    for (std::uint32_t i = 0; i < processes_.size(); ++i) {
      if (in_flight_count_[i] == 0) continue;
      const std::uint64_t delay_ns = ReactionDelayNs(processes_[i]);
      if (delay_ns == kNever) continue;
      const std::uint64_t need_ns = HeadNeedNs(i);
      if (need_ns == kNever) continue;
      const model::DeviceTimeline& device = machine_->devices[processes_[i].device];
      const std::uint64_t model_ns = device.advanced_to_ns;
      const std::uint64_t slice_end_ns = std::max(model_ns, device.slice_end_ns);
      const std::uint64_t active_ns = active_need_ns[processes_[i].device];
      const std::uint64_t others_start_ns =
          active_ns == kNever ? model_ns : std::min(model_ns + active_ns, slice_end_ns);
      const std::uint64_t start_ns = processes_[i].slot == device.active_slot ? model_ns : others_start_ns;
      stop_ns = std::min(stop_ns, start_ns + need_ns + delay_ns);
    }
    return stop_ns;
  }

  // Brings the device model up to now, every device in use. The model is advanced lazily: only where a kernel may
  // complete, before a kernel is queued, and where its state is read; host events in between leave it behind.
  void AdvanceModel() {
    for (std::uint32_t d = 0; d < device_count_; ++d) {
      if (machine_->devices[d].advanced_to_ns < now_ns_) model::Advance(*machine_, d, now_ns_, this);
    }
  }

  void Loop() {
    const std::uint64_t end_ns = scenario_.duration_ns;
    for (;;) {
      const std::uint64_t host_ns = NextWakeNs();
      const std::uint64_t completion_ns = NextCompletionStop();
      const std::uint64_t next_ns = std::min({host_ns, next_observe_ns_, next_window_ns_, next_nvml_end_ns_, end_ns,
                                              completion_ns, next_sample_ns_, next_crash_ns_});
      ++result_.loop_steps;
      if (next_ns < now_ns_) {
        Fail("the next event lies in the past: " + std::to_string(next_ns) + " < " + std::to_string(now_ns_));
        return;
      }
      // Completions up to next_ns come first: whoever waits for them acts at that instant, before other host events.
      now_ns_ = next_ns;
      if (completion_ns <= next_ns) AdvanceModel();
      if (!result_.error.empty()) return;
      // A crash comes before anything else at its instant: the process launches nothing from then on.
      if (now_ns_ == next_crash_ns_) CrashDue();
      if (now_ns_ == next_nvml_end_ns_) RecordNvmlWindowEnd();
      if (now_ns_ == next_observe_ns_) Observe();
      const bool report = now_ns_ == next_window_ns_ || now_ns_ == next_sample_ns_;
      if (now_ns_ == next_window_ns_) CloseWindow();
      if (now_ns_ == next_sample_ns_) RecordSample();
      if (report && scenario_.progress && !scenario_.progress(now_ns_)) {
        Fail("cancelled at " + std::to_string(now_ns_) + " ns of simulated time");
        return;
      }
      if (now_ns_ >= end_ns) return;
      // In process order. A step schedules its own process strictly later, and no other at this instant (its
      // completions up to now were all settled before the first step here).
      if (host_ns != now_ns_) continue;
      for (std::uint32_t index = 0; index < wake_ns_.size(); ++index) {
        if (wake_ns_[index] != now_ns_) continue;
        wake_ns_[index] = kNever;
        HostStep(index);
        if (!result_.error.empty()) return;
      }
    }
  }

  // Measurement::shim: the process is about to wait (for completions, the budget or its turn), and the shim ends its
  // open window first (the queue it measures is complete until after the wait). Returns whether a window ended.
  bool CloseShimWindow(ProcessState& p) {
    if (scenario_.measurement != Measurement::shim) return false;
    const std::size_t before = p.measure.windows_pending();
    p.measure.CloseWindow(*p.limiter, now_ns_, false, p.in_flight.size() == 0);
    return p.measure.windows_pending() < before;
  }

  // Every change of a process's host state goes through here, to keep reacts_ with it.
  void SetState(std::uint32_t index, HostState state) {
    ProcessState& p = processes_[index];
    p.state = state;
    reacts_[index] = ReactionDelayNs(p) != kNever ? 1 : 0;
  }

  // Each process has at most one wake-up pending: the host side of a process is one thread of control.
  void Schedule(std::uint32_t process, std::uint64_t time_ns) {
    if (wake_ns_[process] != kNever) Fail("process " + std::to_string(process) + " scheduled twice");
    if (time_ns < now_ns_) {
      ++result_.late_reactions;  // a reaction found too late to happen when it should: a bug in the loop
      time_ns = now_ns_;
    }
    wake_ns_[process] = time_ns;
  }

  // The earliest wake-up, or kNever. A scan: the simulator runs tens of processes, for which it beats a heap.
  std::uint64_t NextWakeNs() const {
    std::uint64_t earliest_ns = kNever;
    for (const std::uint64_t wake_ns : wake_ns_) earliest_ns = std::min(earliest_ns, wake_ns);
    return earliest_ns;
  }

  // The application begins its next launch call at `at_ns`: it reaches the shim's Admit after its own overhead.
  // Past a segment's stop it goes on with the next segment that has not ended by `at_ns` (idle until its start),
  // with the kernels still in flight counted against that segment's queue_depth.
  void BeginCall(std::uint32_t index, std::uint64_t at_ns) {
    ProcessState& p = processes_[index];
    const SegmentPlan* plan = &p.plans[p.segment];
    if (at_ns >= plan->stop_ns) {
      std::uint32_t next = p.segment + 1;
      while (next < p.plans.size() && at_ns >= p.plans[next].stop_ns) ++next;
      if (next == p.plans.size()) {
        SetState(index, HostState::stopped);
        return;
      }
      p.segment = next;
      p.segment_launches = 0;
      plan = &p.plans[next];
    }
    const Workload& w = *plan->workload;
    const bool draining = w.drain && p.in_flight.size() > 0 && p.segment_launches % w.queue_depth == 0;
    if (p.in_flight.size() >= w.queue_depth || draining) {
      SetState(index, HostState::waiting_for_queue);
      return;
    }
    std::uint64_t begin_ns = std::max(at_ns, plan->start_ns);
    if (w.kind == WorkloadKind::rate) {
      const auto due_ns = plan->rate_origin_ns + static_cast<std::uint64_t>(static_cast<double>(p.segment_launches) *
                                                                            1e9 / w.launches_per_second);
      begin_ns = std::max(begin_ns, due_ns);  // a late launch goes at once
    }
    SetState(index, HostState::calling);
    Schedule(index, begin_ns + p.spec->launch_overhead_ns);
  }

  // One process's host side at its wake-up: the shim's Admit, or the end of its sleep until ready_at.
  void HostStep(std::uint32_t index) {
    ProcessState& p = processes_[index];
    AdvanceModel();  // its own completions up to now are settled before it asks the limiter anything
    if (p.state == HostState::calling) {
      if (!p.has_pending) {
        Choose(p);
        p.called_ns = now_ns_;
      }
      policy::Admission admission = p.limiter->Admit(p.kinds[p.pending_kind].key, now_ns_);
      if (admission.wait_for_completion && CloseShimWindow(p)) {
        admission = p.limiter->Admit(p.kinds[p.pending_kind].key, now_ns_);  // what its window settled counts
      }
      if (admission.wait_for_completion) {
        if (p.in_flight.size() == 0) {
          Fail("the limiter asked process " + std::to_string(index) + " to wait for a completion with none pending");
          return;
        }
        SetState(index, HostState::waiting_for_limiter);
        return;
      }
      p.pending_admission = admission;
      if (scenario_.record_waits && tenants_[p.tenant].member < 0) {
        const std::uint64_t sleep_ns = admission.ready_at_ns > now_ns_ ? admission.ready_at_ns - now_ns_ : 0;
        tenants_[p.tenant].result.launch_waits_ns.push_back(sleep_ns);
      }
      if (admission.ready_at_ns > now_ns_) {
        // The shim sleeps until ready_at, precisely, then launches (its open windows end first).
        CloseShimWindow(p);
        SetState(index, HostState::sleeping);
        Schedule(index, admission.ready_at_ns);
        return;
      }
      if (tenants_[p.tenant].member >= 0 && !TakeTurn(index)) return;
    } else if (p.state == HostState::waiting_for_turn) {
      if (!TakeTurn(index)) return;
    } else if (p.state != HostState::sleeping) {
      return;
    }
    Submit(index);
    if (!result_.error.empty()) return;
    BeginCall(index, now_ns_);
  }

  // Time division: may the pending launch go now? If not, the process waits for its turn: until Decide's time, or
  // a completion when another tenant's work holds the device.
  bool TakeTurn(std::uint32_t index) {
    ProcessState& p = processes_[index];
    TenantState& tenant = tenants_[p.tenant];
    const auto member = static_cast<std::size_t>(tenant.member);
    policy::Account& account = tenant.AccountOn(p.device);
    std::vector<policy::Published>& published = published_[p.device];
    policy::Accrue(plan_, member, account, now_ns_);
    const bool waiting = p.state == HostState::waiting_for_turn;
    if (!waiting) p.undrained_at_arrival = p.in_flight.size() > 0;
    const std::uint64_t arrived_ns = waiting ? p.turn_wait_since_ns : now_ns_;
    // (As the shim: work in flight when the launch came may run past its projection; it did not come to an idle
    // process.)
    const std::uint64_t queued_end_ns =
        p.undrained_at_arrival ? std::max(p.queued_end_ns, arrived_ns) : p.queued_end_ns;
    policy::Release release =
        policy::Decide(plan_, member, p.device, published, account, tenant.turn, queued_end_ns,
                       p.pending_admission.charged_ns, now_ns_, PeersHeld(tenant, member, p.device), arrived_ns);
    if (release.at_ns <= now_ns_) release = TakeSiblingTurn(index, release);
    // A launch that cannot fit the rest of its own window, nothing of the tenant's in flight, declines that rest
    // (policy::DeclinedUntil, as the shim's turn::Look); a launch that goes takes the declining back.
    published[member].cut_in_until_ns = release.cut_in_until_ns;
    published[member].declined_until_ns =
        release.at_ns <= now_ns_
            ? 0
            : policy::DeclinedUntil(plan_, member, p.device, release, published[member].in_flight == 0, now_ns_);
    if (release.at_ns <= now_ns_) {
      const std::uint64_t waited_ns = waiting ? now_ns_ - p.turn_wait_since_ns : 0;
      if (waiting) {
        --published[member].waiting;
        result_.wait_total_ns += waited_ns;
        result_.wait_longest_ns = std::max(result_.wait_longest_ns, waited_ns);
      }
      if (scenario_.record_waits) tenant.result.launch_waits_ns.push_back(waited_ns);
      p.pending_release = release;
      const std::uint64_t handover_ns = policy::HandoverCharge(plan_, member, p.device, published, release,
                                                               p.handover_window_ns, tenant.turn.handover_ns, now_ns_);
      if (handover_ns > 0) ChargeTurn(tenant, p.device, handover_ns, now_ns_);
      return true;
    }
    if (!waiting) {
      ++published[member].waiting;
      ++result_.waits[static_cast<int>(release.reason)];
      p.turn_wait_since_ns = now_ns_;
      CloseShimWindow(p);
      SetState(index, HostState::waiting_for_turn);
    }
    if (release.at_ns != policy::kNoTime) Schedule(index, release.at_ns);
    return false;
  }

  // The tenant may release the launch (`release`); the process still waits while a sibling holds the tenant's turn
  // on the device (policy::DecideSibling, as the shim: turn.cc). Returns `release`, or a wait for the sibling.
  policy::Release TakeSiblingTurn(std::uint32_t index, const policy::Release& release) {
    ProcessState& p = processes_[index];
    const TenantState& tenant = tenants_[p.tenant];
    std::uint64_t& word = tenants_[p.tenant].sibling_turn[p.device];
    const bool past_bound = p.sibling_wait_since_ns != kNever && now_ns_ - p.sibling_wait_since_ns >= plan_.cycle_ns();
    const std::uint64_t end_after_ns =
        policy::WorkEndWithMarginNs(std::max(now_ns_, p.queued_end_ns) + p.pending_admission.charged_ns, now_ns_);
    const policy::SiblingStep step = policy::DecideSibling(
        HolderPolled(tenant, p.device, policy::UnpackSiblingTurn(word)), index + 1, p.turn_held_since_ns,
        policy::SubturnNs(plan_, static_cast<std::size_t>(tenant.member)), end_after_ns, now_ns_, past_bound);
    word = policy::PackSiblingTurn(step.write);
    if (step.took) p.turn_held_since_ns = now_ns_;
    if (step.go) {
      p.sibling_wait_since_ns = kNever;
      return release;
    }
    if (p.sibling_wait_since_ns == kNever) p.sibling_wait_since_ns = now_ns_;
    return {step.look_ns, policy::WaitReason::sibling, release.window, release.free};
  }

  // The turn as its holder keeps it while it waits with work in flight, for its turn (the shim polls its streams
  // about every 20 us) or for room in its queue (in the shim, inside a synchronize call): its end ahead of now until
  // its work drains (policy::UndrainedWorkEndNs), as if it had looked just before.
  policy::SiblingTurn HolderPolled(const TenantState& tenant, std::uint32_t device, policy::SiblingTurn turn) const {
    if (turn.holder == 0 || turn.holder > processes_.size()) return turn;
    const ProcessState& holder = processes_[turn.holder - 1];
    const bool waits = holder.state == HostState::waiting_for_turn || holder.state == HostState::waiting_for_queue;
    if (&tenants_[holder.tenant] != &tenant || holder.device != device || !waits || holder.in_flight.size() == 0) {
      return turn;
    }
    turn.end_ns = policy::UndrainedWorkEndNs(turn.end_ns, now_ns_);
    return turn;
  }

  // A process that waited for room in its queue (in the shim, inside a synchronize call, the turn held meanwhile)
  // goes on at `at_ns`: if it holds its tenant's turn, the end drops back to its projection
  // (policy::EndAfterBlockingNs, as the shim's turn::EndBlocking).
  void ReturnFromBlocking(std::uint32_t index, std::uint64_t at_ns) {
    ProcessState& p = processes_[index];
    std::uint64_t& word = tenants_[p.tenant].sibling_turn[p.device];
    policy::SiblingTurn turn = policy::UnpackSiblingTurn(word);
    const std::uint64_t end_ns = policy::EndAfterBlockingNs(p.queued_end_ns, p.in_flight.size() == 0, at_ns);
    if (turn.holder != index + 1 || turn.end_ns <= end_ns) return;
    turn.end_ns = end_ns;
    word = policy::PackSiblingTurn(turn);
  }

  // The holder of its tenant's turn, waiting for a launch of its own, sees its work drained (the shim asks the driver
  // while it waits): the turn's end drops to now, and the siblings waiting for it look again.
  void EndSiblingTurnAtDrain(std::uint32_t index, std::uint64_t at_ns) {
    ProcessState& p = processes_[index];
    TenantState& tenant = tenants_[p.tenant];
    policy::SiblingTurn turn = policy::UnpackSiblingTurn(tenant.sibling_turn[p.device]);
    if (turn.holder != index + 1 || turn.end_ns <= at_ns || p.state != HostState::waiting_for_turn) return;
    turn.end_ns = at_ns;
    tenant.sibling_turn[p.device] = policy::PackSiblingTurn(turn);
    for (const std::uint32_t sibling : tenant.processes) {
      const ProcessState& s = processes_[sibling];
      if (sibling != index && s.device == p.device && s.state == HostState::waiting_for_turn) {
        wake_ns_[sibling] = std::min(wake_ns_[sibling], std::max(at_ns, now_ns_));  // (a look already due stays)
      }
    }
  }

  // A tenant that spans devices: another tenant's work holds one of its other devices (its window there).
  bool PeersHeld(const TenantState& tenant, std::size_t member, std::uint32_t device) const {
    if (std::popcount(tenant.gpus) < 2) return false;
    const std::uint64_t bound_ns = plan_.cycle_ns();
    for (std::uint32_t d = 0; d < device_count_; ++d) {
      if (d == device || ((tenant.gpus >> d) & 1) == 0) continue;
      if (policy::OthersHold(plan_, member, d, published_[d], bound_ns, now_ns_)) return true;
    }
    return false;
  }

  // A completion, a crash: every launch waiting for another tenant's work looks again.
  void WakeTurnWaiters(std::uint64_t at_ns) {
    for (std::uint32_t i = 0; i < processes_.size(); ++i) {
      if (processes_[i].state == HostState::waiting_for_turn && wake_ns_[i] == kNever) Schedule(i, at_ns);
    }
  }

  // Time division: a kernel of the tenant completed. Its run time is charged to the tenant's account (but not the
  // part in an idle window it borrowed for free); a debt is published, for the others to borrow its windows.
  // The tenant is charged the time in which it had work on the device, not the sum of its kernels' spans: its
  // processes' kernels time-slice each other, and each span holds the others' slices.
  void SettleTurn(TenantState& tenant, ProcessState& p, const model::Op& op, policy::Interval free) {
    const auto member = static_cast<std::size_t>(tenant.member);
    policy::Published& own = published_[p.device][member];
    --own.in_flight;
    own.work_end_ns = op.end_ns;
    std::uint64_t& charged_until_ns = tenant.charged_until_ns[p.device];
    const std::uint64_t from = std::max(TenantBusySince(tenant, p.device, op.start_ns), charged_until_ns);
    charged_until_ns = std::max(charged_until_ns, op.end_ns);
    const std::uint64_t span_ns = op.end_ns > from ? op.end_ns - from : 0;
    const std::uint64_t free_start = std::max(from, free.start_ns);
    const std::uint64_t free_end = std::min(op.end_ns, free.end_ns);
    const std::uint64_t ran_ns = span_ns - (free_end > free_start ? std::min(span_ns, free_end - free_start) : 0);
    ChargeTurn(tenant, p.device, ran_ns, op.end_ns);
    if (p.in_flight.size() == 0) p.queued_end_ns = op.end_ns;
    GrowCycle(tenant);
  }

  // Charges the tenant `ran_ns` of GPU time on `device` at `at_ns` (a tenant spanning devices: divided by their
  // number), and publishes its debt.
  void ChargeTurn(TenantState& tenant, std::uint32_t device, std::uint64_t ran_ns, std::uint64_t at_ns) {
    const auto member = static_cast<std::size_t>(tenant.member);
    const auto spanned = static_cast<std::uint64_t>(std::popcount(tenant.gpus));
    const std::uint64_t repaid_until_ns =
        policy::Charge(plan_, member, tenant.AccountOn(device), ran_ns / spanned, at_ns);
    for (std::uint32_t d = 0; d < device_count_; ++d) {
      if ((tenant.gpus >> d) & 1) published_[d][member].repaid_until_ns = repaid_until_ns;
    }
  }

  // The earliest start among the tenant's kernels on `device` that have started and not completed, and `start_ns`.
  std::uint64_t TenantBusySince(const TenantState& tenant, std::uint32_t device, std::uint64_t start_ns) const {
    for (const std::uint32_t index : tenant.processes) {
      const ProcessState& p = processes_[index];
      if (p.crashed || p.device != device) continue;
      const model::Stream& stream = machine_->streams[p.stream];
      for (std::uint64_t seq = stream.head; seq < stream.tail; ++seq) {
        const model::Op& queued = stream.ring[seq % model::kStreamDepth];
        if (queued.started != 0) start_ns = std::min(start_ns, queued.start_ns);
      }
    }
    return start_ns;
  }

  void Choose(ProcessState& p) {
    const SegmentPlan& plan = p.plans[p.segment];
    const Workload& w = *plan.workload;
    if (w.collective_ns != 0 && p.since_collective >= w.collective_every) {
      // A step's all_reduce after its kernels (no draw: runs without collectives draw as before).
      p.since_collective = 0;
      p.pending_kind = plan.collective_kind;
      p.pending_duration_ns = w.collective_ns;
      p.has_pending = true;
      return;
    }
    ++p.since_collective;
    p.pending_kind =
        plan.first_kind + (plan.kind_count == 1 ? 0 : static_cast<std::uint32_t>(p.random.Below(plan.kind_count)));
    std::uint64_t duration_ns = p.kinds[p.pending_kind].duration_ns;
    if (w.jitter_permille > 0) {
      const auto offset = static_cast<std::int64_t>(p.random.Below(2ull * w.jitter_permille + 1)) -
                          static_cast<std::int64_t>(w.jitter_permille);
      const auto delta = static_cast<std::int64_t>(duration_ns) * offset / 1000;
      const std::int64_t varied_ns = static_cast<std::int64_t>(duration_ns) + delta;
      duration_ns = static_cast<std::uint64_t>(std::max<std::int64_t>(1, varied_ns));
    }
    p.pending_duration_ns = duration_ns;
    p.has_pending = true;
  }

  void Submit(std::uint32_t index) {
    ProcessState& p = processes_[index];
    AdvanceModel();  // the kernel must not run in the past
    model::KernelLaunch launch{};
    launch.shape = shape_;
    launch.per_wave_ns = p.pending_duration_ns;
    launch.name = p.kinds[p.pending_kind].name.c_str();
    if (p.kinds[p.pending_kind].collective) {
      const Workload& w = *p.plans[p.segment].workload;
      launch.group = w.collective_group != 0 ? w.collective_group : p.tenant + 1ull;
      launch.group_size = w.collective_ranks;
    }
    std::uint64_t seq = 0;
    TenantState& tenant = tenants_[p.tenant];

    const policy::KernelKey& key = p.kinds[p.pending_kind].key;
    const bool shim_measures = scenario_.measurement == Measurement::shim;
    if (shim_measures) {
      p.pending_measured_by =
          p.measure.Plan(*p.limiter, key, p.pending_admission, now_ns_, p.in_flight.size() > 0, p.last_queued_seq);
    }
    const model::EnqueueResult queued = model::EnqueueKernel(*machine_, p.stream, launch, now_ns_, &seq);
    if (queued == model::EnqueueResult::bad_group || queued == model::EnqueueResult::no_group) {
      Fail("process " + std::to_string(index) + "'s collective cannot join group " + std::to_string(launch.group) +
           " (ranks " + std::to_string(launch.group_size) + "): one process per device, one size per group");
      return;
    }
    const InFlight item{seq,
                        p.pending_kind,
                        p.pending_admission.charged_ns,
                        p.pending_measured_by,
                        p.pending_admission.launches == 0,
                        p.called_ns};
    if (queued != model::EnqueueResult::ok || !p.in_flight.Push(item)) {
      Fail("process " + std::to_string(index) + "'s stream queue is full");
      return;
    }
    p.last_queued_seq = seq;
    if (shim_measures) p.measure.Queued(*p.limiter, key, p.pending_admission, p.pending_measured_by, seq, now_ns_);
    if (tenant.member >= 0) {
      p.free_windows[seq % model::kStreamDepth] =
          p.pending_release.free ? p.pending_release.window : policy::Interval{};
      policy::Published& own = published_[p.device][static_cast<std::size_t>(tenant.member)];
      ++own.in_flight;
      own.released_until_ns = p.pending_release.window.end_ns;
      p.queued_end_ns = std::max(now_ns_, p.queued_end_ns) + p.pending_admission.charged_ns;
    }
    p.has_pending = false;
    ++p.segment_launches;
    ++in_flight_count_[index];
  }

  std::uint64_t TenantBusyNs(const TenantState& tenant) const {
    std::uint64_t busy_ns = 0;
    for (const std::uint32_t index : tenant.processes) {
      const ProcessState& p = processes_[index];
      busy_ns += p.crashed ? p.crash_busy_ns : machine_->slots[p.slot].busy_total_ns[p.device];
    }
    return busy_ns;
  }

  // Every process whose crash_ns is now dies, in process order.
  void CrashDue() {
    next_crash_ns_ = kNever;
    for (std::uint32_t index = 0; index < processes_.size(); ++index) {
      ProcessState& p = processes_[index];
      if (p.crashed || p.spec->crash_ns == kNever) continue;
      if (p.spec->crash_ns == now_ns_)
        Crash(index);
      else
        next_crash_ns_ = std::min(next_crash_ns_, p.spec->crash_ns);
    }
  }

  // SIGKILL at now: the host side stops, the context goes with its queued and running kernels (fakecuda's
  // ReleaseSlot, as when it reaps a dead process), its device time so far stays the tenant's. The limiter's
  // charges for what never ran go back to the tenant's budget (Cancel); the kernel that was running is settled at
  // the device time it had (so the budget pays for exactly what ran). The real shim, killed, settles nothing: its
  // charges stay taken, at most its in-flight bound (in_flight_max_ns) once per crash.
  void Crash(std::uint32_t index) {
    AdvanceModel();  // completions up to the crash are the process's own; what is still queued is dropped
    ProcessState& p = processes_[index];
    const model::Stream& stream = machine_->streams[p.stream];
    std::uint64_t dropped = 0;
    while (p.in_flight.size() > 0) {
      const InFlight item = p.in_flight.Front();
      p.in_flight.Pop();
      ++dropped;
      if (item.how == MeasuredBy::unmeasured && scenario_.measurement == Measurement::shim) continue;  // settled
      const model::Op& op = stream.ring[item.seq % model::kStreamDepth];
      const policy::KernelKey& key = p.kinds[item.kind].key;
      const double left = std::max(0.0, op.remaining_ns);
      const auto ran_ns = op.started != 0 && left < static_cast<double>(op.alone_ns)
                              ? op.alone_ns - static_cast<std::uint64_t>(std::ceil(left))
                              : 0;
      if (ran_ns > 0)
        p.limiter->Settle(key, item.charged_ns, ran_ns, now_ns_);
      else
        p.limiter->Cancel(key, item.charged_ns);
    }
    p.measure.Drop();
    const bool sleeping = p.state == HostState::sleeping || p.state == HostState::waiting_for_turn;
    if (sleeping) p.limiter->Cancel(p.kinds[p.pending_kind].key, p.pending_admission.charged_ns);
    TenantState& owner = tenants_[p.tenant];
    if (owner.member >= 0) {
      policy::Published& own = published_[p.device][static_cast<std::size_t>(owner.member)];
      own.in_flight -= static_cast<std::uint32_t>(dropped);
      if (p.state == HostState::waiting_for_turn) --own.waiting;
    }
    p.has_pending = false;
    p.crash_busy_ns = machine_->slots[p.slot].busy_total_ns[p.device];
    p.crashed = true;
    model::ReleaseSlot(*machine_, p.slot, nullptr);
    process_by_stream_[p.stream] = model::kNoSlot;
    in_flight_count_[index] = 0;
    wake_ns_[index] = kNever;
    SetState(index, HostState::stopped);
    if (time_division_) WakeTurnWaiters(now_ns_);
    if (scenario_.record_trace) {
      const TenantState& tenant = tenants_[p.tenant];
      base::JsonLine(result_.trace)
          .Begin("crash")
          .Text("tenant", tenant.spec->name)
          .Number("process", p.index_in_tenant)
          .Number("pid", static_cast<std::uint64_t>(kFirstPid) + index)
          .Number("t_ns", now_ns_)
          .Number("dropped", dropped)
          .End();
    }
  }

  // Scenario::sample_ns: each tenant's cumulative busy time, exact at the instant (the model is brought up to it).
  void RecordSample() {
    AdvanceModel();
    for (TenantState& tenant : tenants_) tenant.result.busy_samples_ns.push_back(TenantBusyNs(tenant));
    next_sample_ns_ += scenario_.sample_ns;
  }

  // NVML's sample windows end every nvml_window_ns from the machine's creation (time 0).
  void RecordNvmlWindowEnd() {
    AdvanceModel();
    const std::uint64_t index = now_ns_ / nvml_window_ns_;
    for (TenantState& tenant : tenants_) {
      tenant.busy_at_nvml_end[index % model::kWindowHistory] = BusyAt{now_ns_, TenantBusyNs(tenant)};
    }
    next_nvml_end_ns_ += nvml_window_ns_;
  }

  // The tenant's busy fraction in the NVML window ending at `end_ns`, if both of its ends were recorded.
  static double BusyInNvmlWindow(const TenantState& tenant, std::uint64_t end_ns, std::uint64_t window_ns) {
    if (end_ns < window_ns) return 0;
    const BusyAt& end = tenant.busy_at_nvml_end[(end_ns / window_ns) % model::kWindowHistory];
    const std::uint64_t start_ns = end_ns - window_ns;
    const BusyAt& start = tenant.busy_at_nvml_end[(start_ns / window_ns) % model::kWindowHistory];
    const std::uint64_t busy_at_start = start_ns == 0 ? 0 : (start.end_ns == start_ns ? start.busy_ns : kNever);
    if (end.end_ns != end_ns || busy_at_start == kNever) return 0;
    return static_cast<double>(end.busy_ns - busy_at_start) / static_cast<double>(window_ns);
  }

  // The end of the NVML window whose utilization is published at `now_ns_` (as PublishedUtilizationPercent
  // finds it), or 0 if none is.
  std::uint64_t PublishedNvmlWindowEnd() const {
    const model::DeviceTimeline& d = machine_->devices[kNvmlDevice];
    const std::uint32_t available = std::min<std::uint32_t>(d.window_count, model::kWindowHistory);
    for (std::uint32_t back = 1; back <= available; ++back) {
      const model::UtilWindow& w = d.windows[(d.window_count - back) % model::kWindowHistory];
      if (w.end_ns + machine_->config.nvml_publish_lag_ns <= now_ns_) return w.end_ns;
    }
    return 0;
  }

  // `default` policy: what the shim learns from NVML, as fakecuda publishes it, minus the container's own share.
  void Observe() {
    AdvanceModel();
    const double device_busy = model::PublishedUtilizationPercent(*machine_, kNvmlDevice, now_ns_) / 100.0;
    const std::uint64_t nvml_end_ns = PublishedNvmlWindowEnd();
    for (TenantState& tenant : tenants_) {
      if (tenant.spec->policy != Policy::default_policy) continue;
      double own = 0;
      switch (scenario_.others_estimate) {
        case OthersEstimate::nvml_minus_published_share:
          own = policy::Limiter::PublishedShare(tenant.cell(), now_ns_);
          break;
        case OthersEstimate::nvml_minus_same_window:
          own = BusyInNvmlWindow(tenant, nvml_end_ns, nvml_window_ns_);
          break;
        case OthersEstimate::nvml_minus_cell_busy:
          own = nvml_end_ns >= nvml_window_ns_
                    ? policy::Limiter::BusyFraction(tenant.cell(), nvml_end_ns - nvml_window_ns_, nvml_end_ns)
                    : 0;
          break;
      }
      const double others = device_busy - own;
      for (const std::uint32_t index : tenant.processes) {
        if (!processes_[index].crashed) processes_[index].limiter->ObserveOthers(others, now_ns_);
      }
      if (tenant.cell().rate_permille != tenant.reported_rate_permille) {
        tenant.reported_rate_permille = tenant.cell().rate_permille;
        if (scenario_.record_trace) {
          base::JsonLine(result_.trace)
              .Begin("rate")
              .Text("tenant", tenant.spec->name)
              .Number("t_ns", now_ns_)
              .Number("rate_permille", tenant.cell().rate_permille)
              .End();
        }
      }
    }
    next_observe_ns_ += scenario_.observe_period_ns;
  }

  // The share of a window is the time in which the tenant's kernels occupied the device: the model's exact
  // per-process busy time (a kernel's start..end would also count the slices of others that preempted it).
  void CloseWindow() {
    AdvanceModel();
    for (TenantState& tenant : tenants_) {
      const std::uint64_t busy_ns = TenantBusyNs(tenant);
      const std::uint64_t window_busy_ns = busy_ns - tenant.busy_at_window_start_ns;
      tenant.busy_at_window_start_ns = busy_ns;
      tenant.result.window_shares.push_back(static_cast<double>(window_busy_ns) /
                                            static_cast<double>(scenario_.window_ns));
      if (scenario_.record_trace) {
        base::JsonLine(result_.trace)
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
  std::vector<std::uint64_t> wake_ns_;          // per process; kNever = none pending
  std::vector<std::uint32_t> in_flight_count_;  // per process: kernels queued and not seen complete
  std::vector<std::uint8_t> reacts_;            // per process: ReactionDelayNs(its state) != kNever
  bool lending_ = false;
  std::uint32_t device_count_ = 1;
  bool time_division_ = false;  // Scenario::sharing
  policy::WindowPlan plan_;     // time division: the windows of the tenants with a limit
  std::vector<policy::Member> members_;
  std::vector<std::uint64_t> longest_ns_;  // per member: its longest kernel, as its processes publish it
  // Per device, per member: what its processes publish (the shim: the schedule file).
  std::vector<std::vector<policy::Published>> published_;
  std::uint64_t now_ns_ = 0;
  std::uint64_t next_observe_ns_ = kNever;
  std::uint64_t next_window_ns_ = kNever;
  std::uint64_t next_sample_ns_ = kNever;  // Scenario::sample_ns
  std::uint64_t next_crash_ns_ = kNever;   // the earliest Process::crash_ns not yet reached
  std::uint64_t nvml_window_ns_ = 0;
  std::uint64_t next_nvml_end_ns_ = kNever;
};

}  // namespace

Result Run(const Scenario& scenario) { return Engine(scenario).Run(); }

}  // namespace vgpu::sim
