// The shared timeline: kernel cost, stream queues, time-slicing/MPS scheduling, NVML windows, memory
// charges and crash repair. Everything here runs under the machine's lock with the time passed in.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "fakecuda/model/model.h"

namespace fakecuda::model {
namespace {

constexpr double kDoneEpsilonNs = 0.5;

// Streams of `device` that want the device: their head is a kernel, or (under time-slicing) an event marker
// waiting for its context's turn. Markers take no time; they only make their process contend for the device.
// Each entry's owning slot and head op are kept beside its stream index: a step reads them several times.
struct Runnable {
  std::uint32_t count = 0;
  std::uint32_t kernels = 0;
  std::uint32_t streams[kMaxStreams];
  std::uint32_t slots[kMaxStreams];
  Op* ops[kMaxStreams];
  bool marker[kMaxStreams];
};

bool StreamInUse(const Stream& s) { return s.state == StreamState::live || s.state == StreamState::draining; }

bool TargetPassed(const Machine& m, const Op& op) {
  if (op.wait_stream >= kMaxStreams) return true;
  const Stream& target = m.streams[op.wait_stream];
  if (!StreamInUse(target) || target.generation != op.wait_generation) return true;
  return target.head > op.wait_seq;
}

void PopHead(Stream& s, std::uint64_t t) {
  Op& op = s.ring[s.head % kStreamDepth];
  op.end_ns = t;
  s.last_end_ns = t;
  ++s.head;
}

void FreeStream(Stream& s) {
  s.state = StreamState::free;
  ++s.generation;
  s.head = s.tail = 0;
}

// True when the process in `slot` has a kernel at the head of one of its streams on `device`.
bool SlotHasKernelAtHead(const Machine& m, std::uint32_t device, std::uint32_t slot) {
  const std::uint32_t high = m.devices[device].stream_high_water;
  for (std::uint32_t i = 0; i < high; ++i) {
    const Stream& s = m.streams[i];
    if (StreamInUse(s) && s.device == device && s.slot == slot && s.head < s.tail &&
        s.ring[s.head % kStreamDepth].kind == OpKind::kernel) {
      return true;
    }
  }
  return false;
}

// An event marker is written by its context's channel, which the GPU serves only while the context holds the
// device: under time-slicing, a marker of a process that is not running waits for that process's turn (the real
// GPU timestamps it then). A device that nobody is running kernels on is anyone's at once.
// During a handover between processes no channel is served: markers wait for its end. Where handovers cost time, a
// marker of another process than the one holding the device waits for the handover to its process, even while the
// holder has no kernel at its head (the H100's event pairs never include a handover: docs/results-gpu.md).
bool MarkerMayComplete(const Machine& m, std::uint32_t device, std::uint32_t slot, bool active_busy, std::uint64_t t) {
  const DeviceTimeline& d = m.devices[device];
  if (m.config.mode == SchedulingMode::mps) return true;
  if (t < d.switch_until_ns) return false;
  return d.active_slot == kNoSlot || d.active_slot == slot || (!active_busy && m.config.switch_ns == 0);
}

// Completes zero-time operations at stream heads (markers that may complete, open gates, satisfied waits) and
// frees drained streams, until nothing changes.
void ResolveInstantOps(Machine& m, std::uint32_t device, std::uint64_t t) {
  const DeviceTimeline& d = m.devices[device];
  const std::uint32_t high = d.stream_high_water;
  for (std::uint32_t pass = 0; pass < kMaxStreams; ++pass) {
    bool changed = false;
    const bool active_busy = d.active_slot != kNoSlot && SlotHasKernelAtHead(m, device, d.active_slot);
    for (std::uint32_t i = 0; i < high; ++i) {
      Stream& s = m.streams[i];
      if (!StreamInUse(s) || s.device != device) continue;
      while (s.head < s.tail) {
        const Op& op = s.ring[s.head % kStreamDepth];
        const bool done = (op.kind == OpKind::marker && MarkerMayComplete(m, device, s.slot, active_busy, t)) ||
                          (op.kind == OpKind::gate && op.gate_open != 0) ||
                          (op.kind == OpKind::wait && TargetPassed(m, op));
        if (!done) break;
        PopHead(s, t);
        changed = true;
      }
      if (s.state == StreamState::draining && s.head >= s.tail) {
        FreeStream(s);
        changed = true;
      }
    }
    if (!changed) return;
  }
}

void GatherRunnable(Machine& m, std::uint32_t device, Runnable& out) {
  out.count = 0;
  out.kernels = 0;
  const std::uint32_t high = m.devices[device].stream_high_water;
  for (std::uint32_t i = 0; i < high; ++i) {
    Stream& s = m.streams[i];
    if (!StreamInUse(s) || s.device != device || s.head >= s.tail) continue;
    Op& op = s.ring[s.head % kStreamDepth];
    const OpKind kind = op.kind;
    if (kind != OpKind::kernel && kind != OpKind::marker) continue;
    out.marker[out.count] = kind == OpKind::marker;
    out.kernels += kind == OpKind::kernel ? 1 : 0;
    out.slots[out.count] = s.slot;
    out.ops[out.count] = &op;
    out.streams[out.count++] = i;
  }
}

// True when ResolveInstantOps would change something, or might: a stream of `device` has a zero-time op at its
// head, or is drained and waits to be freed. Otherwise every head is a kernel and ResolveInstantOps is a no-op.
bool MayHaveInstantOps(const Machine& m, std::uint32_t device) {
  const std::uint32_t high = m.devices[device].stream_high_water;
  for (std::uint32_t i = 0; i < high; ++i) {
    const Stream& s = m.streams[i];
    if (!StreamInUse(s) || s.device != device) continue;
    if (s.head >= s.tail) {
      if (s.state == StreamState::draining) return true;
      continue;
    }
    if (s.ring[s.head % kStreamDepth].kind != OpKind::kernel) return true;
  }
  return false;
}

// ResolveInstantOps then GatherRunnable, in one scan while every head is a kernel (the common case: then
// ResolveInstantOps has nothing to do); the two in full otherwise. True when it took the one scan: then every
// stream of `device` has a kernel or nothing at its head, and none is drained and waiting to be freed.
bool ResolveAndGather(Machine& m, std::uint32_t device, std::uint64_t t, Runnable& out) {
  out.count = 0;
  const std::uint32_t high = m.devices[device].stream_high_water;
  for (std::uint32_t i = 0; i < high; ++i) {
    Stream& s = m.streams[i];
    if (!StreamInUse(s) || s.device != device) continue;
    if (s.head >= s.tail) {
      if (s.state == StreamState::draining) goto full;
      continue;
    }
    Op& op = s.ring[s.head % kStreamDepth];
    if (op.kind != OpKind::kernel) goto full;
    out.marker[out.count] = false;
    out.slots[out.count] = s.slot;
    out.ops[out.count] = &op;
    out.streams[out.count++] = i;
  }
  out.kernels = out.count;
  return true;
full:
  ResolveInstantOps(m, device, t);
  GatherRunnable(m, device, out);
  return false;
}

// std::ceil of a non-negative time in nanoseconds, as an integer, without the library call: below 2^64 the
// truncation is exact, and one more when it fell short. (Larger values go the old way.)
std::uint64_t CeilToNs(double ns) {
  if (!(ns < 18446744073709551616.0)) return static_cast<std::uint64_t>(std::ceil(ns));
  const auto whole = static_cast<std::uint64_t>(ns);
  return static_cast<double>(whole) < ns ? whole + 1 : whole;
}

void CloseWindow(Machine& m, std::uint32_t device) {
  DeviceTimeline& d = m.devices[device];
  const std::uint64_t window = m.config.nvml_window_ns;
  const std::uint64_t end = d.window_start_ns + window;
  const auto percent =
      static_cast<std::uint32_t>(std::min<std::uint64_t>(100, (d.window_busy_ns * 100 + window / 2) / window));
  UtilWindow& w = d.windows[d.window_count % kWindowHistory];
  w.end_ns = end;
  w.percent = percent;
  ++d.window_count;
  // Under time-slicing NVML names one process per sample: the one that held the device longest.
  // Ties (two processes sharing a window evenly) go to the next process after the last one named, so equal
  // tenants alternate, as the H100's samples did, instead of one of them never being named.
  std::uint32_t best = kNoSlot;
  std::uint64_t best_busy = 0;
  const std::uint32_t start = d.last_sample_slot == kNoSlot ? 0 : (d.last_sample_slot + 1) % kMaxProcesses;
  for (std::uint32_t k = 0; k < kMaxProcesses; ++k) {
    const std::uint32_t i = (start + k) % kMaxProcesses;
    ProcessSlot& slot = m.slots[i];
    if (slot.window_busy_ns[device] > best_busy) {
      best_busy = slot.window_busy_ns[device];
      best = i;
    }
    slot.window_busy_ns[device] = 0;
  }
  if (best != kNoSlot) {
    d.last_sample_slot = best;
    NvmlSample& sample = m.slots[best].latest_sample[device];
    sample.timestamp_us = static_cast<std::uint64_t>(static_cast<std::int64_t>(end / 1000) + m.realtime_offset_us);
    sample.sm_percent = percent;
    sample.valid = 1;
  }
  d.window_busy_ns = 0;
  d.window_start_ns = end;
}

// Skips whole idle windows quickly: records at most kWindowHistory of them.
void SkipIdleWindows(Machine& m, std::uint32_t device, std::uint64_t now_ns) {
  DeviceTimeline& d = m.devices[device];
  const std::uint64_t window = m.config.nvml_window_ns;
  if (now_ns < d.window_start_ns + window) return;
  const std::uint64_t whole = (now_ns - d.window_start_ns) / window;
  if (whole > kWindowHistory) {
    d.window_start_ns += (whole - kWindowHistory) * window;
    d.window_count += static_cast<std::uint32_t>(whole - kWindowHistory);
  }
}

}  // namespace

std::uint32_t ResidentBlocksPerSm(const DeviceSpec& spec, const LaunchShape& shape) {
  const std::uint64_t threads = static_cast<std::uint64_t>(shape.block[0]) * shape.block[1] * shape.block[2];
  if (threads == 0 || threads > spec.max_threads_per_block) return 0;
  if (shape.shared_bytes > spec.shared_bytes_per_sm) return 0;
  // Threads are allocated per warp.
  const std::uint64_t warp = spec.warp_size;
  const std::uint64_t warps_threads = warp != 0 && (warp & (warp - 1)) == 0
                                          ? (threads + warp - 1) & ~(warp - 1)  // the same, without a division
                                          : (threads + warp - 1) / warp * warp;
  std::uint64_t resident = std::min<std::uint64_t>(spec.max_blocks_per_sm, spec.max_threads_per_sm / warps_threads);
  if (shape.shared_bytes > 0)
    resident = std::min<std::uint64_t>(resident, spec.shared_bytes_per_sm / shape.shared_bytes);
  return static_cast<std::uint32_t>(std::max<std::uint64_t>(resident, 1));
}

KernelCost CostKernel(const DeviceSpec& spec, std::uint32_t sm_count, const LaunchShape& shape,
                      std::uint64_t per_wave_ns) {
  KernelCost cost{};
  const std::uint64_t blocks = static_cast<std::uint64_t>(shape.grid[0]) * shape.grid[1] * shape.grid[2];
  const std::uint32_t resident = ResidentBlocksPerSm(spec, shape);
  if (sm_count == 0 || sm_count > spec.sm_count) sm_count = spec.sm_count;
  if (blocks == 0 || resident == 0) return cost;
  const std::uint64_t slots = static_cast<std::uint64_t>(sm_count) * resident;
  // The common shape, one full wave on the whole device, without the divisions (the results are the same).
  const std::uint64_t waves = blocks <= slots && slots <= (1ull << 63) ? 1 : (blocks + slots - 1) / slots;
  cost.alone_ns = std::max<std::uint64_t>(1, waves * per_wave_ns);
  if (blocks >= slots && sm_count == spec.sm_count) {
    cost.sm_fraction = 1.0;  // min(1, blocks / slots) is 1, and 1 x n / n is 1
    return cost;
  }
  const double own_fraction = std::min(1.0, static_cast<double>(blocks) / static_cast<double>(slots));
  cost.sm_fraction = own_fraction * static_cast<double>(sm_count) / static_cast<double>(spec.sm_count);
  return cost;
}

void InitMachine(Machine& m, const MachineConfig& config, std::uint64_t now_ns, std::int64_t realtime_offset_us) {
  m.magic = kMagic;
  m.layout_version = kLayoutVersion;
  m.machine_bytes = sizeof(Machine);
  m.created_ns = now_ns;
  m.realtime_offset_us = realtime_offset_us;
  m.next_generation = 1;
  m.config = config;
  for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
    DeviceTimeline& d = m.devices[i];
    d.advanced_to_ns = now_ns;
    d.window_start_ns = now_ns;
    d.active_slot = kNoSlot;
    d.last_sample_slot = kNoSlot;
  }
}

// ---- collective kernels ---------------------------------------------------------------------------------------

namespace {

CollectiveGroup* FindGroup(Machine& m, std::uint64_t id) {
  for (CollectiveGroup& g : m.groups) {
    if (g.id == id) return &g;
  }
  return nullptr;
}

bool AnyGroup(const Machine& m) { return m.groups_in_use != 0; }

// The round of a collective op started at `t`: one more member there.
void Arrive(Machine& m, const Op& op, std::uint64_t t) {
  CollectiveGroup& g = m.groups[op.group_entry - 1];
  GroupRound& r = g.rounds[op.round % kGroupRounds];
  if (r.round != op.round) return;
  ++r.started;
  r.last_start_ns = std::max(r.last_start_ns, t);
}

// When the round of a collective op is released (every member started or left), or kNever while it is not. An
// op whose group is gone (every member left) is released at once.
constexpr std::uint64_t kNotReleased = ~0ull;
std::uint64_t ReleasedAt(Machine& m, const Op& op) {
  const CollectiveGroup& g = m.groups[op.group_entry - 1];
  if (g.id == 0) return 0;
  const GroupRound& r = g.rounds[op.round % kGroupRounds];
  if (r.round != op.round || r.started + g.left < g.size) return kNotReleased;
  return g.left > 0 ? std::max(r.last_start_ns, g.left_at_ns) : r.last_start_ns;
}

// A collective kernel that runs at `t`: it starts (and holds the device) now if it had not; it works only from its
// round's release on. Returns the release (kNotReleased: none yet). Released in the past (a peer's start was learnt
// up to kLockstepNs late), it first does the work it would have done since, holding its device as it did.
std::uint64_t HoldCollective(Machine& m, Op& op, std::uint64_t t) {
  if (op.started == 0) {
    op.start_ns = t;
    op.started = 1;
    Arrive(m, op, t);
  }
  const std::uint64_t released = ReleasedAt(m, op);
  if (released <= t && op.started != kStartedCaughtUp) {
    op.started = kStartedCaughtUp;
    const std::uint64_t from = std::max(released, op.start_ns);
    if (from < t) op.remaining_ns -= static_cast<double>(t - from);
  }
  return released;
}

// Collectives: all devices are advanced together, this far at a time, so that each learns within it when the
// members on the others started (a device running ahead would spin through a release it did not know of yet).
constexpr std::uint64_t kLockstepNs = 10'000;

void AdvanceOne(Machine& m, std::uint32_t device, std::uint64_t now_ns, TimelineListener* listener);

}  // namespace

void Advance(Machine& m, std::uint32_t device, std::uint64_t now_ns, TimelineListener* listener) {
  if (device >= m.config.device_count || now_ns <= m.devices[device].advanced_to_ns) return;
  if (!AnyGroup(m)) {
    AdvanceOne(m, device, now_ns, listener);
    return;
  }
  std::uint64_t from = now_ns;
  for (std::uint32_t d = 0; d < m.config.device_count; ++d) from = std::min(from, m.devices[d].advanced_to_ns);
  for (std::uint64_t t = from; t < now_ns;) {
    t = std::min(now_ns, t + kLockstepNs);
    for (std::uint32_t d = 0; d < m.config.device_count; ++d) AdvanceOne(m, d, t, listener);
  }
}

namespace {

void AdvanceOne(Machine& m, std::uint32_t device, std::uint64_t now_ns, TimelineListener* listener) {
  DeviceTimeline& d = m.devices[device];
  if (now_ns <= d.advanced_to_ns) return;
  const bool mps = m.config.mode == SchedulingMode::mps;
  static thread_local std::uint64_t released_at[kMaxStreams];
  const std::uint64_t window = m.config.nvml_window_ns;
  std::uint64_t t = d.advanced_to_ns;
  static thread_local Runnable runnable;
  static thread_local double rates[kMaxStreams];

  // True while every stream head of the device is known to be a kernel or nothing (no drained stream either):
  // from a one-scan gather until an operation completes. Then the last ResolveInstantOps would do nothing.
  bool heads_are_kernels = false;
  while (t < now_ns) {
    heads_are_kernels = ResolveAndGather(m, device, t, runnable);

    if (runnable.kernels == 0 && runnable.count > 0 && (m.config.switch_ns == 0 || d.active_slot == kNoSlot)) {
      // Only markers wait, and nobody runs kernels: the device is free, they complete now. (Where handovers cost
      // time and the device was last another process's, the markers' process takes it over first, below.)
      d.active_slot = kNoSlot;
      d.switch_until_ns = 0;
      ResolveInstantOps(m, device, t);
      GatherRunnable(m, device, runnable);
    }
    if (runnable.count == 0) {
      // Idle until `now_ns`: close the current window (it may hold busy time) at its own end, skip whole idle
      // windows, close the rest.
      if (d.window_start_ns + window <= now_ns) CloseWindow(m, device);
      SkipIdleWindows(m, device, now_ns);
      while (d.window_start_ns + window <= now_ns) {
        t = d.window_start_ns + window;
        CloseWindow(m, device);
      }
      t = now_ns;
      d.active_slot = kNoSlot;
      d.switch_until_ns = 0;
      break;
    }

    // Which process(es) run now.
    bool contended = false;
    if (!mps) {
      // Slices are periods of `timeslice_ns` from when a process got the device; while nobody else wants it they
      // roll on. Contended steps always stop at the slice end, so `t` past it means the device was uncontended
      // since: the period containing `t` is the running one, however often the timeline was advanced.
      if (d.active_slot != kNoSlot && t > d.slice_end_ns) {
        const std::uint64_t slice = m.config.timeslice_ns;
        d.slice_end_ns += ((t - d.slice_end_ns) / slice + 1) * slice;
      }
      bool active_has_work = false;
      for (std::uint32_t k = 0; k < runnable.count; ++k) {
        const std::uint32_t slot = runnable.slots[k];
        if (slot == d.active_slot)
          active_has_work = true;
        else
          contended = true;
      }
      if (!active_has_work || (t >= d.slice_end_ns && contended)) {
        // Round robin: the next slot after the active one that has work.
        std::uint32_t next = kNoSlot;
        std::uint32_t best_distance = kMaxProcesses + 1;
        const std::uint32_t from = d.active_slot == kNoSlot ? kMaxProcesses - 1 : d.active_slot;
        for (std::uint32_t k = 0; k < runnable.count; ++k) {
          const std::uint32_t slot = runnable.slots[k];
          const std::uint32_t distance = (slot + kMaxProcesses - from - 1) % kMaxProcesses;
          if (distance < best_distance && !(slot == d.active_slot && contended)) {
            best_distance = distance;
            next = slot;
          }
        }
        // A handover from one process to another costs the device `switch_ns` in which nobody runs (saving and
        // restoring contexts); the new holder's slice starts after it. From an idle device it is free.
        const std::uint32_t previous = d.active_slot;
        d.active_slot = next;
        const bool handover = previous != kNoSlot && next != kNoSlot && next != previous && m.config.switch_ns > 0;
        d.switch_until_ns = handover ? t + m.config.switch_ns : 0;
        d.slice_end_ns = (handover ? d.switch_until_ns : t) + m.config.timeslice_ns;
        contended = false;
        bool next_waits_on_marker = false;
        for (std::uint32_t k = 0; k < runnable.count; ++k) {
          if (runnable.slots[k] != next)
            contended = true;
          else if (runnable.marker[k])
            next_waits_on_marker = true;
        }
        // Its markers complete the moment it holds the device; then look again at what it has.
        if (next_waits_on_marker) continue;
      } else if (t >= d.slice_end_ns) {
        d.slice_end_ns = t + m.config.timeslice_ns;
      }
    }

    // Speeds: kernels of one process share its SMs; under MPS all processes share the device, each process
    // held to its own SM share first.
    double demand = 0;
    const bool switching = !mps && t < d.switch_until_ns;
    for (std::uint32_t k = 0; k < runnable.count; ++k) {
      rates[k] = !runnable.marker[k] && !switching && (mps || runnable.slots[k] == d.active_slot) ? 1.0 : 0.0;
      // Time-slicing: the same sum as below, in the same order, while the rates are at hand.
      if (!mps) demand += rates[k] * runnable.ops[k]->sm_fraction;
    }
    if (mps) {
      for (std::uint32_t k = 0; k < runnable.count; ++k) {
        const std::uint32_t slot = runnable.slots[k];
        const std::uint32_t limit = m.slots[slot].mps_sm_count[device];
        if (limit == 0) continue;
        double own = 0;
        for (std::uint32_t j = 0; j < runnable.count; ++j) {
          if (runnable.slots[j] == slot) own += runnable.ops[j]->sm_fraction;
        }
        const double cap = static_cast<double>(limit) / m.config.devices[device].sm_count;
        if (own > cap + 1e-12) rates[k] *= cap / own;
      }
    }
    if (mps) {
      for (std::uint32_t k = 0; k < runnable.count; ++k) demand += rates[k] * runnable.ops[k]->sm_fraction;
    }
    if (demand > 1.0) {
      for (std::uint32_t k = 0; k < runnable.count; ++k) rates[k] /= demand;
    }

    // The next event: a completion, a slice end (if someone waits), a window end, or now.
    std::uint64_t next_t = std::min(now_ns, d.window_start_ns + window);
    if (!mps && contended) next_t = std::min(next_t, std::max(d.slice_end_ns, t + 1));
    if (switching) next_t = std::min(next_t, d.switch_until_ns);
    for (std::uint32_t k = 0; k < runnable.count; ++k) {
      if (rates[k] <= 0) continue;
      Op& head = *runnable.ops[k];
      if (head.group_entry != 0) {
        released_at[k] = HoldCollective(m, head, t);
        if (released_at[k] == kNotReleased) continue;
        if (released_at[k] > t) {
          next_t = std::min(next_t, released_at[k]);
          continue;
        }
      }
      const double left = std::max(0.0, runnable.ops[k]->remaining_ns);
      // At full speed (always, under time-slicing) the division is exact: skip it.
      const std::uint64_t until = CeilToNs(rates[k] == 1.0 ? left : left / rates[k]);
      next_t = std::min<std::uint64_t>(next_t, t + std::max<std::uint64_t>(1, until));
    }
    const std::uint64_t dt = next_t - t;

    bool any_running = false;
    std::uint32_t last_slot_charged = kNoSlot;
    for (std::uint32_t k = 0; k < runnable.count; ++k) {
      if (rates[k] <= 0) continue;
      Op& op = *runnable.ops[k];
      if (op.started == 0) {
        op.start_ns = t;
        op.started = 1;
      }
      if (op.group_entry == 0 || released_at[k] <= t) op.remaining_ns -= static_cast<double>(dt) * rates[k];
      op.ran_ns += dt;
      any_running = true;
      const std::uint32_t slot = runnable.slots[k];
      if (slot != last_slot_charged) {
        // Charge each running process once per step (its streams are usually adjacent).
        bool seen = false;
        for (std::uint32_t j = 0; j < k; ++j) {
          if (rates[j] > 0 && runnable.slots[j] == slot) seen = true;
        }
        if (!seen) {
          m.slots[slot].window_busy_ns[device] += dt;
          m.slots[slot].busy_total_ns[device] += dt;
        }
        last_slot_charged = slot;
      }
    }
    if (any_running) {
      d.window_busy_ns += dt;
      d.busy_total_ns += dt;
    }
    t = next_t;

    for (std::uint32_t k = 0; k < runnable.count; ++k) {
      if (rates[k] <= 0) continue;
      Stream& s = m.streams[runnable.streams[k]];
      Op& op = s.ring[s.head % kStreamDepth];  // read again: a listener has been called since the gather
      if (op.remaining_ns > kDoneEpsilonNs) continue;
      op.remaining_ns = 0;
      PopHead(s, t);
      heads_are_kernels = false;
      ++d.kernels_completed;
      if (listener != nullptr) listener->OnKernelComplete(m, device, runnable.streams[k], op);
    }
    if (t >= d.window_start_ns + window) CloseWindow(m, device);
  }
  if (!heads_are_kernels && MayHaveInstantOps(m, device)) ResolveInstantOps(m, device, t);
  d.advanced_to_ns = now_ns;
}

}  // namespace

std::uint32_t ClaimSlot(Machine& m, std::int32_t pid, std::uint64_t now_ns) {
  for (std::uint32_t i = 0; i < kMaxProcesses; ++i) {
    ProcessSlot& slot = m.slots[i];
    if (slot.state != SlotState::free) continue;
    std::memset(&slot, 0, sizeof slot);
    slot.state = SlotState::claiming;  // a crash from here on is undone by RepairMachine
    slot.pid = pid;
    slot.generation = m.next_generation++;
    slot.started_ns = now_ns;
    slot.state = SlotState::live;
    return i;
  }
  return kNoSlot;
}

namespace {
// Keeps what the slot's process did on the GPU past its slot (Machine::departed).
void RecordDeparture(Machine& m, const ProcessSlot& slot) {
  if (slot.pid <= 0) return;
  DepartedProcess& record = m.departed[m.departed_count % kDepartedHistory];
  ++m.departed_count;
  record = DepartedProcess{};
  record.pid = slot.pid;
  record.started_ns = slot.started_ns;
  for (const DeviceTimeline& d : m.devices) record.ended_ns = std::max(record.ended_ns, d.advanced_to_ns);
  std::copy(std::begin(slot.busy_total_ns), std::end(slot.busy_total_ns), std::begin(record.busy_total_ns));
}
}  // namespace

void ReleaseSlot(Machine& m, std::uint32_t slot_index, std::uint64_t returned_bytes[kMaxDevices]) {
  if (slot_index >= kMaxProcesses) return;
  ProcessSlot& slot = m.slots[slot_index];
  for (std::uint32_t dev = 0; dev < kMaxDevices; ++dev) {
    const std::uint64_t bytes = slot.memory_bytes[dev];
    if (returned_bytes != nullptr) returned_bytes[dev] = bytes;
    DeviceTimeline& d = m.devices[dev];
    d.memory_used_bytes -= std::min(d.memory_used_bytes, bytes);
    if (d.active_slot == slot_index) d.active_slot = kNoSlot;
  }
  for (Stream& s : m.streams) {
    if (StreamInUse(s) && s.slot == slot_index) FreeStream(s);
  }
  // Its collective groups lose a member: their rounds no longer wait for it; a group nobody is left in is freed.
  for (CollectiveGroup& g : m.groups) {
    if (g.id == 0) continue;
    bool present = false;
    bool others = false;
    for (std::uint32_t& member : g.member_slots) {
      if (member == slot_index) {
        present = true;
        member = kNoSlot;
      } else if (member != kNoSlot) {
        others = true;
      }
    }
    if (!present) continue;
    ++g.left;
    // When it left: the latest time any device was advanced to (the caller's clock is not passed in).
    for (const DeviceTimeline& d : m.devices) g.left_at_ns = std::max(g.left_at_ns, d.advanced_to_ns);
    if (!others) {
      g = CollectiveGroup{};
      --m.groups_in_use;
    }
  }
  RecordDeparture(m, slot);
  std::memset(&slot, 0, sizeof slot);
  slot.state = SlotState::free;
}

std::uint32_t CreateStream(Machine& m, std::uint32_t slot, std::uint32_t device, std::uint32_t flags,
                           std::int32_t priority) {
  for (std::uint32_t i = 0; i < kMaxStreams; ++i) {
    Stream& s = m.streams[i];
    if (s.state != StreamState::free) continue;
    s.slot = slot;
    s.device = device;
    s.flags = flags;
    s.priority = priority;
    s.head = s.tail = 0;
    s.last_end_ns = 0;
    s.generation = m.next_generation++;
    s.state = StreamState::live;
    DeviceTimeline& d = m.devices[device];
    d.stream_high_water = std::max(d.stream_high_water, i + 1);
    return i;
  }
  return kNoSlot;
}

void DestroyStream(Machine& m, std::uint32_t stream) {
  if (stream >= kMaxStreams) return;
  Stream& s = m.streams[stream];
  if (s.state != StreamState::live) return;
  if (s.head >= s.tail)
    FreeStream(s);
  else
    s.state = StreamState::draining;
}

namespace {

// A collective launch on stream `s`: finds or makes its group, makes the stream's process the group's member on its
// device, and takes the device's next round (whose ring entry it resets if it is the round's first launch).
EnqueueResult JoinGroup(Machine& m, const Stream& s, const KernelLaunch& launch, std::uint32_t& entry,
                        std::uint32_t& round) {
  if (launch.group_size < 2 || launch.group_size > kMaxDevices) return EnqueueResult::bad_group;
  CollectiveGroup* g = FindGroup(m, launch.group);
  if (g == nullptr) {
    g = FindGroup(m, 0);
    if (g == nullptr) return EnqueueResult::no_group;
    *g = CollectiveGroup{};
    g->id = launch.group;
    g->size = launch.group_size;
    ++m.groups_in_use;
    for (std::uint32_t& member : g->member_slots) member = kNoSlot;
  }
  if (g->size != launch.group_size) return EnqueueResult::bad_group;
  std::uint32_t& member = g->member_slots[s.device];
  if (member != kNoSlot && member != s.slot) return EnqueueResult::bad_group;
  member = s.slot;
  round = static_cast<std::uint32_t>(g->next_round[s.device]++);
  entry = static_cast<std::uint32_t>(g - m.groups) + 1;
  GroupRound& r = g->rounds[round % kGroupRounds];
  if (r.round != round) r = GroupRound{round, 0, 0, 0};  // the ring entry held round - kGroupRounds, long done
  return EnqueueResult::ok;
}

EnqueueResult Push(Machine& m, std::uint32_t stream, const Op& op, std::uint64_t* seq_out) {
  Stream& s = m.streams[stream];
  if (s.tail - s.head >= kStreamDepth) return EnqueueResult::queue_full;
  Op& slot = s.ring[s.tail % kStreamDepth];
  slot = op;
  slot.seq = s.tail;
  if (seq_out != nullptr) *seq_out = s.tail;
  ++s.tail;  // published last: a crash before this leaves the op invisible
  return EnqueueResult::ok;
}

}  // namespace

EnqueueResult EnqueueKernel(Machine& m, std::uint32_t stream, const KernelLaunch& launch, std::uint64_t now_ns,
                            std::uint64_t* seq_out) {
  Stream& s = m.streams[stream];
  if (s.tail - s.head >= kStreamDepth) return EnqueueResult::queue_full;
  const DeviceSpec& spec = m.config.devices[s.device];
  // A process's MPS share limits its SMs only in MPS mode.
  const std::uint32_t sm_count = m.config.mode == SchedulingMode::mps ? m.slots[s.slot].mps_sm_count[s.device] : 0;
  const KernelCost cost = CostKernel(spec, sm_count, launch.shape, launch.per_wave_ns);
  std::uint32_t entry = 0;
  std::uint32_t round = 0;
  if (launch.group != 0) {
    const EnqueueResult joined = JoinGroup(m, s, launch, entry, round);
    if (joined != EnqueueResult::ok) return joined;
  }
  // Written in place, past the tail (invisible until the tail is bumped), as Push would copy it there.
  Op& op = s.ring[s.tail % kStreamDepth];
  op = Op{};
  op.group_entry = entry;
  op.round = round;
  op.kind = OpKind::kernel;
  op.alone_ns = cost.alone_ns;
  op.remaining_ns = static_cast<double>(cost.alone_ns);
  op.sm_fraction = cost.sm_fraction > 0 ? cost.sm_fraction : 1.0 / spec.sm_count;
  op.queued_ns = now_ns;
  std::memcpy(op.grid, launch.shape.grid, sizeof op.grid);
  std::memcpy(op.block, launch.shape.block, sizeof op.block);
  // A bounded copy, not snprintf: this runs on every launch (and the simulator's hot loop).
  if (launch.name != nullptr) {
    const std::size_t length = strnlen(launch.name, sizeof op.name - 1);
    std::memcpy(op.name, launch.name, length);
    op.name[length] = '\0';
  }
  op.seq = s.tail;
  if (seq_out != nullptr) *seq_out = s.tail;
  ++s.tail;  // published last: a crash before this leaves the op invisible
  return EnqueueResult::ok;
}

EnqueueResult EnqueueMarker(Machine& m, std::uint32_t stream, std::uint64_t now_ns, std::uint64_t* seq_out) {
  Op op{};
  op.kind = OpKind::marker;
  op.queued_ns = now_ns;
  return Push(m, stream, op, seq_out);
}

EnqueueResult EnqueueGate(Machine& m, std::uint32_t stream, std::uint64_t now_ns, std::uint64_t* seq_out) {
  Op op{};
  op.kind = OpKind::gate;
  op.queued_ns = now_ns;
  return Push(m, stream, op, seq_out);
}

EnqueueResult EnqueueWait(Machine& m, std::uint32_t stream, std::uint32_t target_stream,
                          std::uint64_t target_generation, std::uint64_t target_seq, std::uint64_t now_ns) {
  Op op{};
  op.kind = OpKind::wait;
  op.queued_ns = now_ns;
  op.wait_stream = target_stream;
  op.wait_generation = target_generation;
  op.wait_seq = target_seq;
  return Push(m, stream, op, nullptr);
}

void OpenGate(Machine& m, std::uint32_t stream, std::uint64_t seq) {
  if (stream >= kMaxStreams) return;
  Stream& s = m.streams[stream];
  if (!StreamInUse(s) || seq < s.head || seq >= s.tail) return;
  Op& op = s.ring[seq % kStreamDepth];
  if (op.kind == OpKind::gate && op.seq == seq) op.gate_open = 1;
}

bool OpDone(const Machine& m, std::uint32_t stream, std::uint64_t generation, std::uint64_t seq) {
  if (stream >= kMaxStreams) return true;
  const Stream& s = m.streams[stream];
  if (!StreamInUse(s) || s.generation != generation) return true;
  return s.head > seq;
}

std::uint64_t OpEndNs(const Machine& m, std::uint32_t stream, std::uint64_t seq) {
  if (stream >= kMaxStreams) return 0;
  const Stream& s = m.streams[stream];
  const Op& op = s.ring[seq % kStreamDepth];
  return op.seq == seq && s.head > seq ? op.end_ns : 0;
}

std::uint64_t LowerBoundRemainingNs(const Machine& m, std::uint32_t stream, std::uint64_t seq) {
  if (stream >= kMaxStreams) return 0;
  const Stream& s = m.streams[stream];
  double total = 0;
  for (std::uint64_t i = s.head; i < s.tail && i <= seq; ++i) {
    const Op& op = s.ring[i % kStreamDepth];
    if (op.kind == OpKind::kernel) total += std::max(0.0, op.remaining_ns);
  }
  return static_cast<std::uint64_t>(total);
}

std::uint64_t CudaTotalBytes(const DeviceSpec& spec) { return spec.memory_bytes - spec.reserved_bytes; }

std::uint64_t CudaFreeBytes(const Machine& m, std::uint32_t device) {
  const std::uint64_t total = CudaTotalBytes(m.config.devices[device]);
  const std::uint64_t used = m.devices[device].memory_used_bytes;
  return used >= total ? 0 : total - used;
}

bool Charge(Machine& m, std::uint32_t device, std::uint32_t slot, std::uint64_t bytes) {
  if (device >= m.config.device_count || slot >= kMaxProcesses) return false;
  if (bytes > CudaFreeBytes(m, device)) return false;
  m.slots[slot].memory_bytes[device] += bytes;
  m.devices[device].memory_used_bytes += bytes;
  return true;
}

void Uncharge(Machine& m, std::uint32_t device, std::uint32_t slot, std::uint64_t bytes) {
  if (device >= m.config.device_count || slot >= kMaxProcesses) return;
  std::uint64_t& own = m.slots[slot].memory_bytes[device];
  bytes = std::min(bytes, own);
  own -= bytes;
  DeviceTimeline& d = m.devices[device];
  d.memory_used_bytes -= std::min(d.memory_used_bytes, bytes);
}

std::uint32_t PublishedUtilizationPercent(const Machine& m, std::uint32_t device, std::uint64_t now_ns) {
  if (device >= m.config.device_count) return 0;
  const DeviceTimeline& d = m.devices[device];
  const std::uint32_t available = std::min<std::uint32_t>(d.window_count, kWindowHistory);
  for (std::uint32_t back = 1; back <= available; ++back) {
    const UtilWindow& w = d.windows[(d.window_count - back) % kWindowHistory];
    if (w.end_ns + m.config.nvml_publish_lag_ns <= now_ns) return w.percent;
  }
  return 0;
}

std::uint32_t RepairMachine(Machine& m) {
  std::uint32_t fixes = 0;
  if (m.config.device_count > kMaxDevices) {
    m.config.device_count = kMaxDevices;
    ++fixes;
  }
  for (ProcessSlot& slot : m.slots) {
    if (slot.state == SlotState::claiming || static_cast<std::uint32_t>(slot.state) > 2) {
      std::memset(&slot, 0, sizeof slot);
      ++fixes;
    }
  }
  for (std::uint32_t i = 0; i < kMaxStreams; ++i) {
    Stream& s = m.streams[i];
    if (s.state == StreamState::free) continue;
    const bool bad_state = static_cast<std::uint32_t>(s.state) > 2;
    const bool bad_owner =
        s.slot >= kMaxProcesses || m.slots[s.slot].state != SlotState::live || s.device >= m.config.device_count;
    if (bad_state || bad_owner) {
      FreeStream(s);
      ++fixes;
      continue;
    }
    if (s.tail < s.head || s.tail - s.head > kStreamDepth) {
      s.tail = s.head;
      ++fixes;
    }
    DeviceTimeline& d = m.devices[s.device];
    if (d.stream_high_water < i + 1) {
      d.stream_high_water = i + 1;
      ++fixes;
    }
  }
  for (std::uint32_t dev = 0; dev < kMaxDevices; ++dev) {
    std::uint64_t used = 0;
    for (const ProcessSlot& slot : m.slots) {
      if (slot.state == SlotState::live) used += slot.memory_bytes[dev];
    }
    DeviceTimeline& d = m.devices[dev];
    if (d.memory_used_bytes != used) {
      d.memory_used_bytes = used;
      ++fixes;
    }
    if (d.active_slot != kNoSlot && d.active_slot >= kMaxProcesses) {
      d.active_slot = kNoSlot;
      ++fixes;
    }
    if (d.last_sample_slot != kNoSlot && d.last_sample_slot >= kMaxProcesses) {
      d.last_sample_slot = kNoSlot;
      ++fixes;
    }
    if (d.stream_high_water > kMaxStreams) {
      d.stream_high_water = kMaxStreams;
      ++fixes;
    }
  }
  // Collective groups: a size out of range frees the entry (its rounds could never be released right); the count
  // of entries in use is derived.
  std::uint32_t in_use = 0;
  for (CollectiveGroup& g : m.groups) {
    if (g.id != 0 && (g.size < 2 || g.size > kMaxDevices)) {
      g = CollectiveGroup{};
      ++fixes;
    }
    in_use += g.id != 0 ? 1 : 0;
  }
  if (m.groups_in_use != in_use) {
    m.groups_in_use = in_use;
    ++fixes;
  }
  return fixes;
}

}  // namespace fakecuda::model
