// Time division on the launch path (turn.h; docs/compute-sharing.md, "Shared state"). Every decision is
// policy::Decide's; this file reads what it needs from the schedule file, sleeps as told and publishes the result.
#include "turn.h"

#include <errno.h>
#include <sys/random.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "compute_area.h"
#include "shim.h"
#include "vgpu/schedule/schedule.h"

namespace vgpu::hooks::turn {
namespace {

constexpr std::uint64_t kBaseCycleNs = 20'000'000;  // docs/compute-sharing.md: the base cycle and its bound
constexpr std::uint64_t kCycleMaxNs = 640'000'000;
constexpr std::uint64_t kRefreshNs = 100'000'000;  // the members are read again, and the heartbeat written
// A launch waiting on another member's work looks again at least this often (the holder lowers its expected end
// when it sees its work complete); one waiting with its own work in flight asks the driver this often whether it
// completed.
constexpr std::uint64_t kPollMostNs = 20'000;
constexpr std::uint64_t kPollLeastNs = 10'000;
constexpr std::uint64_t kDrainPollNs = 20'000;
// A waiting launch is published as waiting until its next look and this much more: a sleep overshoots by tens of
// microseconds, and a waiter that looks idle in between has its window borrowed (`default`).
constexpr std::uint64_t kWaitingMarginNs = 2'000'000;
// The launch path writes shared memory sparingly (each write is a cache line others read): a process publishes the
// window it released into only when it changes, and charges the container's account once this much has gathered
// (or at a decision that needs the balance, or outside its own window).
constexpr std::uint64_t kFlushNs = 200'000;

// This process's view of the schedule: set up once, refreshed every kRefreshNs, under `mutex` (never held while
// sleeping).
struct State {
  std::mutex mutex;
  std::atomic<bool> set_up{false};  // (read without the mutex once true: `on` and `gpu_of` no longer change)
  bool on = false;
  std::unique_ptr<schedule::Board> board;
  policy::TurnCell* cell = nullptr;  // in the region
  std::uint64_t id = 0;
  int entry = -1;
  std::uint32_t share_permille = 0;
  std::uint64_t gpus = 0;
  int gpu_of[policy::kMaxDevices];  // CUDA ordinal -> the schedule's GPU index (-1: not scheduled)
  policy::TurnConfig turn;
  // Refreshed (next_refresh_ns also read without the mutex, to ask the caller for its longest kernel first):
  std::atomic<std::uint64_t> next_refresh_ns{0};
  policy::WindowPlan plan;
  std::vector<std::uint32_t> entries;  // per plan member: its entry in the file
  int me = -1;                         // this container in the plan
  std::atomic<bool> in_plan{false};    // me >= 0 (read without the mutex, to ask for the longest kernel first)
  bool said_unplanned = false;         // a plan that could not be built was said
  std::uint64_t queued_end_ns[policy::kMaxDevices] = {};        // this process's released work, expected done by here
  std::uint64_t published_end_ns[policy::kMaxDevices] = {};     // what it last published as busy_until_ns
  std::uint64_t published_window_ns[policy::kMaxDevices] = {};  // ... and as released_until_ns
  std::uint64_t unflushed_ns = 0;  // charged by Released, not yet taken from the shared account
  // Charging what ran (policy::ChargesWhatRan), per CUDA ordinal: the limiter's spent_ns at the last charge (-1: not
  // charging what ran then), and what is carried to the next charges (policy::WhatRanChargeNs).
  std::int64_t spent_seen_ns[policy::kMaxDevices];
  std::int64_t carried_ns[policy::kMaxDevices] = {};
  std::atomic<bool> charges_what_ran{false};  // (as the plan says; read by Refund without the mutex)
  std::int64_t decided_balance_ns = 0;        // the balance the last decision saw (LIBCUDA_LOG_LEVEL=4 says it)
  // The end of the container's own window the last decision released into (0: none): launches that end inside it
  // go without another decision (others wait for the container's work in its window; the plan has not changed).
  std::uint64_t lease_until_ns[policy::kMaxDevices] = {};
  // Turns inside the container (policy::DecideSibling): per CUDA ordinal, the word in the region (null: the device
  // has none there), and when this process last took the turn.
  std::uint64_t* sibling_word[policy::kMaxDevices] = {};
  std::uint64_t turn_held_since_ns[policy::kMaxDevices] = {};
  // Per CUDA ordinal: the start of the own window whose handover this process charged last (policy::HandoverCharge).
  std::uint64_t handover_window_ns[policy::kMaxDevices] = {};
  // Per CUDA ordinal: its threads inside a synchronize call (BeginBlocking).
  std::uint32_t blocked[policy::kMaxDevices] = {};
  std::vector<policy::Published> published;  // scratch, per plan member: this GPU
  std::vector<policy::Published> there;      // scratch, per plan member: another GPU of the container's
};

// Bit i: work the process released on CUDA ordinal i and has not yet seen complete (set by Released, cleared when
// its streams are found drained; written under the turn's mutex, read without it); and whether the process has met
// a sibling in the container's turn there (another holder, or one waiting), ever. A synchronize call does nothing more than
// load these and g_beside unless work is undrained where there is somebody to keep off: a container of one process
// alone on its GPU has nobody to keep out of its turn.
std::atomic<std::uint64_t> g_undrained{0};
std::atomic<std::uint64_t> g_siblings{0};
// Bit i: the container keeps the end the other members see on CUDA ordinal i ahead while its work there runs
// (policy::KeepsOthersOffWhileUndrained), as the plan last said. A synchronize call then has them to keep off too.
std::atomic<std::uint64_t> g_beside{0};

State& TheState() {
  static State* state = new State();  // never destroyed: launches may come from threads running past exit
  return *state;
}

std::string SchedulePath(const policy::Config& config) {
  if (config.schedule_path) return *config.schedule_path;
  // HAMi mounts /tmp/vgpulock into every GPU container; elsewhere the first shim makes it, open to all (sticky).
  const std::string path = policy::kDefaultScheduleFile;
  const std::string folder = path.substr(0, path.rfind('/'));
  if (mkdir(folder.c_str(), 0777) == 0) chmod(folder.c_str(), 01777);
  return path;
}

// The container's id, drawn by the first of its processes to need it (nonzero).
std::uint64_t ContainerId(policy::TurnCell& cell) {
  std::atomic_ref<std::uint64_t> id(cell.member_id);
  std::uint64_t known = id.load();
  if (known != 0) return known;
  std::uint64_t drawn = 0;
  if (getrandom(&drawn, sizeof drawn, 0) != static_cast<ssize_t>(sizeof drawn)) drawn = MonotonicNs() ^ getpid();
  drawn |= 1;
  return id.compare_exchange_strong(known, drawn) ? drawn : known;
}

// The schedule's GPU index of each capped device the process sees; false if one cannot be named.
bool NameGpus(State& s, const policy::Config& config) {
  int count = 0;
  if (Real::cuDeviceGetCount == nullptr || Real::cuDeviceGet == nullptr || Real::cuDeviceGetUuid_v2 == nullptr ||
      Real::cuDeviceGetCount(&count) != CUDA_SUCCESS) {
    return false;
  }
  for (int ordinal = 0; ordinal < std::min(count, policy::kMaxDevices); ++ordinal) {
    const std::uint32_t percent = config.sm_limit_percent[static_cast<std::size_t>(ordinal)];
    if (percent == 0) continue;
    CUdevice device = 0;
    CUuuid uuid{};
    if (Real::cuDeviceGet(&device, ordinal) != CUDA_SUCCESS ||
        Real::cuDeviceGetUuid_v2(&uuid, device) != CUDA_SUCCESS) {
      return false;
    }
    const int g = s.board->GpuIndex(reinterpret_cast<const std::uint8_t*>(uuid.bytes));
    if (g < 0) return false;
    s.gpu_of[ordinal] = g;
    s.gpus |= 1ull << g;
    const int in_region = RegionDevice(ordinal);
    if (in_region >= 0) s.sibling_word[ordinal] = &ComputeAreaOf(*TheShim().region, in_region).sibling_turn;
    // One share for all its GPUs (HAMi sets one SM limit for all): the largest, where they differ.
    s.share_permille = std::max(s.share_permille, percent * 10);
  }
  return s.gpus != 0;
}

// Opens the schedule and joins it. Caller holds s.mutex. False (said once): the limiter holds the caps.
bool SetUp(State& s) {
  Shim& shim = TheShim();
  std::fill(std::begin(s.gpu_of), std::end(s.gpu_of), -1);
  std::fill(std::begin(s.spent_seen_ns), std::end(s.spent_seen_ns), -1);
  if (shim.config.sharing != policy::Sharing::time_division || shim.config.policy == policy::ComputePolicy::disable ||
      shim.region == nullptr) {
    return false;
  }
  std::string error;
  s.board = schedule::Board::Open(SchedulePath(shim.config), kBaseCycleNs, kCycleMaxNs, error);
  const int device0 = s.board != nullptr ? RegionDevice(0) : -1;
  if (s.board != nullptr && device0 < 0) error = "the container's first device cannot be named in its region";
  if (s.board != nullptr && device0 >= 0 && !NameGpus(s, shim.config)) {
    error = "its GPUs cannot be named in " + s.board->path() + " (more than 8 on the node, or the driver refused)";
  }
  if (error.empty()) {
    s.cell = &ComputeAreaOf(*shim.region, device0).turn;  // (the first device's area: compute_area.h)
    s.id = ContainerId(*s.cell);
    s.entry = s.board->Join(s.id, s.share_permille, s.gpus, MonotonicNs(), error);
  }
  if (!error.empty()) {
    Log(1,
        "time division is off (VGPU_COMPUTE_SHARING=time-division): %s; the compute cap is held by the "
        "limiter",
        error.c_str());
    return false;
  }
  s.turn.borrow_idle = shim.config.policy == policy::ComputePolicy::standard;
  return true;
}

void FlushCharges(State& s, int ordinal, std::uint64_t now);

// Whether the schedule is to be read again (Refresh): then the caller's longest kernel is asked first, without
// s.mutex (the caller takes its own lock for it, which it may hold while it calls Refund).
// This container's place in the plan just built (-1: none), and what follows from it.
void SetMe(State& s, int me) {
  s.me = me;
  s.in_plan.store(me >= 0, std::memory_order_relaxed);
  std::uint64_t beside = 0;
  if (me >= 0 && policy::KeepsOthersOffWhileUndrained(s.plan, static_cast<std::size_t>(me))) {
    for (int ordinal = 0; ordinal < policy::kMaxDevices; ++ordinal)
      beside |= s.gpu_of[ordinal] >= 0 ? 1ull << ordinal : 0;
  }
  g_beside.store(beside, std::memory_order_release);
  s.charges_what_ran.store(me >= 0 && policy::ChargesWhatRan(s.plan, static_cast<std::size_t>(me)),
                           std::memory_order_relaxed);
}

bool RefreshDue(const State& s, std::uint64_t now) { return now >= s.next_refresh_ns.load(std::memory_order_relaxed); }

// Every kRefreshNs: the heartbeat, the entry still ours (else joined again), the members and the plan. Caller
// holds s.mutex. `longest_ns`: the caller's longest kernel, asked because the refresh was due (else kNoTime).
void Refresh(State& s, int ordinal, std::uint64_t now, std::uint64_t longest_ns) {
  if (!RefreshDue(s, now) && s.me >= 0) return;
  s.next_refresh_ns.store(now + kRefreshNs, std::memory_order_relaxed);
  FlushCharges(s, ordinal, now);  // on the plan they were made under
  schedule::Entry* own = &s.board->entry(s.entry);
  if (schedule::Load(own->id) != s.id) {  // aged out (the process was stopped, or idle for a second) and reused
    std::string error;
    const int entry = s.board->Join(s.id, s.share_permille, s.gpus, now, error);
    if (entry < 0) {
      Log(2, "time division: %s; the limiter holds the cap until an entry frees", error.c_str());
      SetMe(s, -1);
      return;
    }
    s.entry = entry;
    own = &s.board->entry(entry);
  }
  if (longest_ns != policy::kNoTime) schedule::RaiseTo(own->longest_ns, longest_ns);
  schedule::RaiseTo(own->heartbeat_ns, now);
  const schedule::Members members = schedule::ReadMembers(s.board->header(), now);
  const std::uint64_t cycle = policy::CycleFor(members.members, members.longest_ns, s.board->header().base_cycle_ns,
                                               s.board->header().cycle_max_ns);
  SetMe(s, -1);
  std::fill(std::begin(s.lease_until_ns), std::end(s.lease_until_ns), 0);  // decided on the old plan
  // (Entries are checked as read, and the file's cycle bounds when it is opened: not expected. Said once; the
  // launch path's limiter holds the cap meanwhile.)
  if (const std::string error = s.plan.Build(members.members, cycle); !error.empty()) {
    if (!s.said_unplanned) Log(1, "time division: no plan from %s: %s", s.board->path().c_str(), error.c_str());
    s.said_unplanned = true;
    return;
  }
  s.entries = members.entries;
  SetMe(s, s.plan.IndexOf(s.id));
  s.published.resize(s.plan.size());
  s.there.resize(s.plan.size());
}

// Every plan member's published state on GPU `g`. Caller holds s.mutex.
void ReadPublished(State& s, std::uint32_t g, std::uint64_t now) {
  for (std::size_t m = 0; m < s.plan.size(); ++m) {
    s.published[m] = schedule::PublishedOf(s.board->entry(static_cast<int>(s.entries[m])), g, now);
  }
}

// A member spanning GPUs waits while another member's work holds any of its other GPUs (policy::OthersHold).
bool PeersHeld(State& s, std::uint32_t g, std::uint64_t now) {
  if (std::popcount(s.gpus) < 2) return false;
  const auto me = static_cast<std::size_t>(s.me);
  const std::uint64_t bound = s.plan.cycle_ns();
  for (std::uint32_t other = 0; other < schedule::kMaxGpus; ++other) {
    if (other == g || ((s.gpus >> other) & 1) == 0) continue;
    for (std::size_t m = 0; m < s.plan.size(); ++m) {
      s.there[m] = schedule::PublishedOf(s.board->entry(static_cast<int>(s.entries[m])).gpu[other], now);
    }
    if (policy::OthersHold(s.plan, me, other, s.there, bound, now)) return true;
  }
  return false;
}

// When a launch held by another member's work looks again: when the first holder's expected end or its bound
// passes, within [kPollLeastNs, kPollMostNs].
std::uint64_t NextLook(State& s, std::uint32_t g, std::uint64_t now) {
  std::uint64_t next = now + kPollMostNs;
  const std::uint64_t bound = s.plan.cycle_ns();
  for (std::size_t m = 0; m < s.plan.size(); ++m) {
    if (static_cast<int>(m) == s.me || s.published[m].in_flight == 0) continue;
    const schedule::GpuState& held = s.board->entry(static_cast<int>(s.entries[m])).gpu[g];
    const std::uint64_t until = s.published[m].released_until_ns;
    next = std::min({next, schedule::Load(held.busy_until_ns), until > policy::kNoTime - bound ? next : until + bound});
  }
  return std::max(next, now + kPollLeastNs);
}

// The balance as the policy means it, which charges work when it completes: the shim charges a launch when it is
// released, so this process's work still queued is given back.
std::int64_t Effective(const State& s, int ordinal, std::int64_t balance_ns, std::uint64_t now) {
  const std::uint64_t queued_end = s.queued_end_ns[ordinal];
  return queued_end > now ? balance_ns + static_cast<std::int64_t>(queued_end - now) : balance_ns;
}

// Publishes the instant the container's debt is repaid (0: none) on every GPU it spans.
void PublishRepaid(State& s, std::uint64_t repaid_until) {
  schedule::Entry& own = s.board->entry(s.entry);
  for (std::uint32_t g = 0; g < schedule::kMaxGpus; ++g) {
    if ((s.gpus >> g) & 1) schedule::Store(own.gpu[g].repaid_until_ns, repaid_until);
  }
}

// Takes what Released gathered from the shared account and publishes the debt as it then stands (as the policy
// means it: Effective). Caller holds s.mutex.
void FlushCharges(State& s, int ordinal, std::uint64_t now) {
  if (s.unflushed_ns == 0 || s.me < 0) return;
  const auto me = static_cast<std::size_t>(s.me);
  const policy::Account after = policy::ChargeShared(s.plan, me, s.cell->account, s.unflushed_ns, now);
  s.unflushed_ns = 0;
  PublishRepaid(s, policy::RepaidUntil(s.plan, me, Effective(s, ordinal, after.balance_ns, now), now));
}

// One decision for a launch on schedule GPU `g`. Caller holds s.mutex. The account Decide sees has this process's
// queued work given back: the shim charges a launch when it is released, the policy when it completes.
// `past_holders`: the launch has waited a whole cycle for other members' work; what they publish in flight is no
// longer waited for (a stopped holder, or a liar, stalls the others one cycle per launch at most).
policy::Release DecideNow(State& s, int ordinal, std::uint32_t g, std::uint64_t estimate_ns, std::uint64_t now,
                          bool past_holders, std::uint64_t arrived, bool undrained_at_arrival) {
  const auto me = static_cast<std::size_t>(s.me);
  ReadPublished(s, g, now);
  if (past_holders) {
    for (std::size_t m = 0; m < s.published.size(); ++m) {
      if (m != me) s.published[m].in_flight = 0;
    }
  }
  FlushCharges(s, ordinal, now);
  policy::Account account = policy::AccrueShared(s.plan, me, s.cell->account, now);
  // (Work not seen drained when the launch came may run past its projection, a rogue process time-slicing it: the
  // launch did not come to an idle process, and must not cut in. Only that reads the projection before `now`.)
  const std::uint64_t queued_end =
      undrained_at_arrival ? std::max(s.queued_end_ns[ordinal], arrived) : s.queued_end_ns[ordinal];
  account.balance_ns = Effective(s, ordinal, account.balance_ns, now);
  s.decided_balance_ns = account.balance_ns;
  // The debt the others see is the one this decision sees: repaid already, the windows are no longer lent.
  if (account.balance_ns >= 0) {
    schedule::GpuState& own = s.board->entry(s.entry).gpu[g];
    if (schedule::Load(own.repaid_until_ns) > now) PublishRepaid(s, 0);
  }
  return policy::Decide(s.plan, me, g, s.published, account, s.turn, queued_end, estimate_ns, now,
                        !past_holders && PeersHeld(s, g, now), arrived);
}

// ---- turns inside the container (policy::DecideSibling; docs/compute-sharing.md, "Turns inside a container") ----

// This process's name in the turn word: its region slot + 1 (0: it has no slot, and takes no turns).
std::uint32_t SelfInTurn() {
  Shim& shim = TheShim();
  const int slot = shim.region != nullptr ? shim.region->slot() : -1;
  return slot >= 0 ? static_cast<std::uint32_t>(slot) + 1 : 0;
}

// A launch its container may release now (`release`) goes only with the container's turn on the device; else it
// waits for the sibling holding it (`past_bound`: it has waited a whole cycle, and takes it). Caller holds s.mutex.
policy::Release SiblingRelease(State& s, int ordinal, std::uint64_t estimate_ns, std::uint64_t now, bool past_bound,
                               const policy::Release& release) {
  const std::uint32_t self = SelfInTurn();
  if (s.sibling_word[ordinal] == nullptr || self == 0) return release;
  std::atomic_ref<std::uint64_t> word(*s.sibling_word[ordinal]);
  const std::uint64_t end_after =
      policy::WorkEndWithMarginNs(std::max(now, s.queued_end_ns[ordinal]) + estimate_ns, now);
  const std::uint64_t subturn = policy::SubturnNs(s.plan, static_cast<std::size_t>(s.me));
  policy::SiblingStep step;
  policy::SiblingTurn turn;
  for (std::uint64_t seen = word.load();;) {
    turn = policy::UnpackSiblingTurn(seen);
    step = policy::DecideSibling(turn, self, s.turn_held_since_ns[ordinal], subturn, end_after, now, past_bound);
    const std::uint64_t write = policy::PackSiblingTurn(step.write);
    if (write == seen || word.compare_exchange_weak(seen, write)) break;
  }
  const std::uint64_t bit = 1ull << ordinal;
  if ((turn.waiting || (turn.holder != 0 && turn.holder != self)) && (g_siblings.load() & bit) == 0) {
    g_siblings.fetch_or(bit, std::memory_order_acq_rel);
  }
  if (step.took) s.turn_held_since_ns[ordinal] = now;
  if (step.go) return release;
  return {step.look_ns, policy::WaitReason::sibling, release.window, release.free};
}

// Moves the end of the container's turn on the device, if this process holds it: raised to `end_ns` (it released
// more), or lowered to it (its work seen complete). Caller holds s.mutex.
void MoveSiblingEnd(State& s, int ordinal, std::uint64_t end_ns, bool lower) {
  const std::uint32_t self = SelfInTurn();
  if (s.sibling_word[ordinal] == nullptr || self == 0) return;
  std::atomic_ref<std::uint64_t> word(*s.sibling_word[ordinal]);
  for (std::uint64_t seen = word.load();;) {
    policy::SiblingTurn turn = policy::UnpackSiblingTurn(seen);
    if (turn.holder != self || (lower ? turn.end_ns <= end_ns : turn.end_ns >= end_ns)) return;
    turn.end_ns = end_ns;
    if (word.compare_exchange_weak(seen, policy::PackSiblingTurn(turn))) return;
  }
}

// Raises the end the process published on the device, to the other members (busy_until_ns) and, if it holds the
// container's turn there, to its siblings. Caller holds s.mutex.
void RaiseEnd(State& s, int ordinal, std::uint32_t g, std::uint64_t end_ns) {
  if (end_ns > s.published_end_ns[ordinal]) {
    s.published_end_ns[ordinal] = end_ns;
    schedule::RaiseTo(s.board->entry(s.entry).gpu[g].busy_until_ns, end_ns);
  }
  MoveSiblingEnd(s, ordinal, end_ns, false);  // (a turn taken since may hold a nearer end)
}

// Lowers it, unless another of the container's processes has published a later one since. Caller holds s.mutex.
void LowerEnd(State& s, int ordinal, std::uint32_t g, std::uint64_t end_ns) {
  std::uint64_t& published = s.published_end_ns[ordinal];
  std::atomic_ref<std::uint64_t> busy_until(s.board->entry(s.entry).gpu[g].busy_until_ns);
  std::uint64_t expected = published;
  if (published > end_ns) busy_until.compare_exchange_strong(expected, end_ns);
  published = std::min(published, end_ns);
  MoveSiblingEnd(s, ordinal, end_ns, true);
}

bool Undrained(int ordinal) { return ((g_undrained.load(std::memory_order_acquire) >> ordinal) & 1) != 0; }

// Caller holds s.mutex (the only writer).
void SetUndrained(int ordinal, bool undrained) {
  if (Undrained(ordinal) == undrained) return;
  const std::uint64_t bit = 1ull << ordinal;
  if (undrained)
    g_undrained.fetch_or(bit, std::memory_order_acq_rel);
  else
    g_undrained.fetch_and(~bit, std::memory_order_acq_rel);
}

// The process's work on the device completed (seen at `now`): its published expected end drops to now. Caller holds
// s.mutex.
void EndPublishedWork(State& s, int ordinal, std::uint32_t g, std::uint64_t now) {
  LowerEnd(s, ordinal, g, now);
  s.queued_end_ns[ordinal] = std::min(s.queued_end_ns[ordinal], now);
  SetUndrained(ordinal, false);
}

bool KeepsOthersOff(int ordinal) { return ((g_beside.load(std::memory_order_acquire) >> ordinal) & 1) != 0; }

// Its work has not completed at `now`: the end of the container's turn on the device, if it holds it, is kept ahead
// of now (policy::UndrainedWorkEndNs), so that its siblings do not release beside work still running; and so is the
// end the other containers see where it keeps them off (policy::KeepsOthersOffWhileUndrained: a member on one GPU,
// charged what ran). Not for a member spanning GPUs: a DDP rank waiting for its turn while its collective waits for
// its peers would hold a neighbour off (over fakecuda the neighbour's worst second fell from 42 to 36 % of its 50).
// Caller holds s.mutex.
void KeepTurnAhead(State& s, int ordinal, std::uint32_t g, std::uint64_t now) {
  if (KeepsOthersOff(ordinal)) RaiseEnd(s, ordinal, g, policy::UndrainedWorkEndNs(s.published_end_ns[ordinal], now));
  if (s.sibling_word[ordinal] == nullptr) return;
  const policy::SiblingTurn turn =
      policy::UnpackSiblingTurn(std::atomic_ref<std::uint64_t>(*s.sibling_word[ordinal]).load());
  if (turn.holder != 0 && turn.holder == SelfInTurn()) {
    MoveSiblingEnd(s, ordinal, policy::UndrainedWorkEndNs(turn.end_ns, now), false);
  }
}

// LIBCUDA_LOG_LEVEL=4: a launch that waited a whole cycle for other members' work goes beside it; which member
// held it, and what it had published, say whether it was dead, stopped or lying. Caller holds s.mutex.
void LogGoingBeside(State& s, int ordinal, std::uint32_t g, const void* function, std::uint64_t now) {
  for (std::size_t m = 0; m < s.plan.size(); ++m) {
    if (static_cast<int>(m) == s.me) continue;
    const schedule::GpuState& held = s.board->entry(static_cast<int>(s.entries[m])).gpu[g];
    const auto ahead = [now](std::uint64_t t) {
      return (static_cast<long long>(t) - static_cast<long long>(now)) / 1000;
    };
    Log(4,
        "device %d: a launch of %p waited a whole cycle (%llu us) for other containers' work: it goes beside it "
        "(member %016llx: work expected until %+lld us, released into a window ending %+lld us)",
        ordinal, function, static_cast<unsigned long long>(s.plan.cycle_ns() / 1000),
        static_cast<unsigned long long>(s.plan.member(m).id), ahead(schedule::Load(held.busy_until_ns)),
        ahead(schedule::Load(held.released_until_ns)));
  }
}

// How a launch's wait for its turn has gone so far (Take).
struct Wait {
  std::uint64_t started = 0;
  std::uint64_t last = 0;                               // the previous look
  policy::WaitReason first = policy::WaitReason::none;  // why it first waited
  policy::WaitReason previous = policy::WaitReason::none;
  std::uint64_t others_ns = 0;   // waited for other members' work so far: past a cycle, no longer waited for
  std::uint64_t sibling_ns = 0;  // ... and for a sibling holding the container's turn: the same
  std::uint64_t cycle_ns = 0;
  std::int64_t first_balance_ns = 0;  // the account's balance when it first waited
  bool first_wait = true;
  bool undrained = false;  // the process's work on the device had not been seen drained when the launch came

  // A look at `now` found it must wait for `reason`: the time since the previous look is counted against what that
  // one waited for.
  void Count(std::uint64_t now, policy::WaitReason reason, std::int64_t balance_ns) {
    if (previous == policy::WaitReason::others_work) others_ns += now - last;
    if (previous == policy::WaitReason::sibling) sibling_ns += now - last;
    previous = reason;
    last = now;
    if (first == policy::WaitReason::none) first = reason, first_balance_ns = balance_ns;
  }
};

// Prompt service: a launch waiting to cut in at the next boundary of the window owner's work asks the others on the
// GPU to release nothing meanwhile (renewed at each look); any other outcome takes the ask back.
void PublishCutIn(State& s, const policy::Release& release, std::uint64_t now) {
  std::uint64_t& cut_in = s.board->entry(s.entry).cut_in_until_ns;
  if (release.cut_in_until_ns > now)
    schedule::RaiseTo(cut_in, release.cut_in_until_ns);
  else if (schedule::Load(cut_in) > now)
    schedule::Store(cut_in, 0);
}

// One look at whether the launch may go now: inside the turn already decided (the lease), else by Decide; then only
// with the container's turn on the device (SiblingRelease). Going: `ticket` is set (and the lease), and the release
// returned is at `now`. Caller holds s.mutex.
policy::Release Look(State& s, int ordinal, std::uint32_t g, std::uint64_t estimate_ns, std::uint64_t now, Wait& w,
                     Ticket& ticket) {
  w.cycle_ns = s.plan.cycle_ns();
  const std::uint64_t lease = s.lease_until_ns[ordinal];
  const bool leased = std::max(now, s.queued_end_ns[ordinal]) + estimate_ns <= lease;
  policy::Release release{now, policy::WaitReason::none, {now, lease}, false};
  if (!leased) release = DecideNow(s, ordinal, g, estimate_ns, now, w.others_ns >= w.cycle_ns, w.started, w.undrained);
  if (release.at_ns <= now) release = SiblingRelease(s, ordinal, estimate_ns, now, w.sibling_ns >= w.cycle_ns, release);
  PublishCutIn(s, release, now);
  // A launch that cannot fit the rest of its own window with nothing of the container's in flight declines that rest
  // to the others (policy::DeclinedUntil); a launch that goes takes it back.
  std::uint64_t& declined = s.board->entry(s.entry).declined_until_ns;
  if (release.at_ns > now) {
    s.lease_until_ns[ordinal] = 0;
    const bool queue_empty = !Undrained(ordinal) && s.published[static_cast<std::size_t>(s.me)].in_flight == 0;
    const std::uint64_t until =
        policy::DeclinedUntil(s.plan, static_cast<std::size_t>(s.me), g, release, queue_empty, now);
    if (until > now) schedule::RaiseTo(declined, until);
    return release;
  }
  if (schedule::Load(declined) > now) schedule::Store(declined, 0);
  const bool own = leased || (!release.free && s.plan.OwnerAt(g, now) == s.me);
  if (!leased) {  // (the handover into its window was charged with the decision that set the lease)
    const std::uint64_t handover_ns =
        policy::HandoverCharge(s.plan, static_cast<std::size_t>(s.me), g, s.published, release,
                               s.handover_window_ns[ordinal], s.turn.handover_ns, now);
    s.unflushed_ns += handover_ns / static_cast<std::uint64_t>(std::popcount(s.gpus));
  }
  std::uint64_t turn_until = own ? release.window.end_ns : 0;
  if (release.ask_again_soon) turn_until = std::min(turn_until, now + policy::kPromptLeadNs);  // (prompt service)
  ticket = {true, release.window, release.free, now - w.started, turn_until};
  s.lease_until_ns[ordinal] = ticket.turn_until_ns;
  return release;
}

// When a launch that must wait (`release`) looks again, published as the container's launch waiting until then
// (and a margin). A sibling's turn may end sooner than expected (its holder sees its work complete): polled.
std::uint64_t WakeFor(State& s, int ordinal, std::uint32_t g, const policy::Release& release, std::uint64_t now) {
  std::uint64_t wake = release.at_ns != policy::kNoTime ? release.at_ns : NextLook(s, g, now);
  if (release.reason == policy::WaitReason::sibling) wake = std::min(wake, now + kPollMostNs);
  s.lease_until_ns[ordinal] = 0;
  schedule::RaiseTo(s.board->entry(s.entry).gpu[g].waiting_until_ns, wake + kWaitingMarginNs);
  return std::max(wake, now + (release.reason == policy::WaitReason::sibling ? kPollLeastNs : 0));
}

}  // namespace

bool Scheduled(int ordinal) {
  if (ordinal < 0 || ordinal >= policy::kMaxDevices) return false;
  State& s = TheState();
  if (!s.set_up.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> guard(s.mutex);
    if (!s.set_up.load(std::memory_order_relaxed)) {
      s.on = SetUp(s);
      s.set_up.store(true, std::memory_order_release);
    }
  }
  return s.on && s.gpu_of[ordinal] >= 0;
}

Ticket Take(int ordinal, std::uint64_t estimate_ns, const Caller& caller, const void* function) {
  if (!Scheduled(ordinal)) return {};
  State& s = TheState();
  const auto g = static_cast<std::uint32_t>(s.gpu_of[ordinal]);
  Wait w;
  w.started = w.last = MonotonicNs();
  w.undrained = Undrained(ordinal);
  Ticket ticket;
  std::unique_lock<std::mutex> guard(s.mutex, std::defer_lock);
  for (;;) {
    const std::uint64_t now = MonotonicNs();
    const bool ask = caller.longest_ns != nullptr && (RefreshDue(s, now) || !s.in_plan.load(std::memory_order_relaxed));
    const std::uint64_t longest_ns = ask ? caller.longest_ns(caller.self) : policy::kNoTime;
    guard.lock();
    Refresh(s, ordinal, now, longest_ns);
    if (s.me < 0) return {};  // not in the plan (no entry to be had): the caller's limiter holds the cap
    const policy::Release release = Look(s, ordinal, g, estimate_ns, now, w, ticket);
    if (release.at_ns <= now) break;
    w.Count(now, release.reason, s.decided_balance_ns);
    std::uint64_t wake = WakeFor(s, ordinal, g, release, now);
    const bool own_pending = Undrained(ordinal);
    guard.unlock();
    if (w.first_wait && caller.before_wait != nullptr) caller.before_wait(caller.self);
    w.first_wait = false;
    if (own_pending && caller.drained != nullptr) {
      const bool drained = caller.drained(caller.self);
      guard.lock();
      if (drained)
        EndPublishedWork(s, ordinal, g, now);
      else
        KeepTurnAhead(s, ordinal, g, now);
      guard.unlock();
      if (drained) continue;
      wake = std::min(wake, now + kDrainPollNs);
    }
    SleepUntilNs(wake);
  }
  const bool waited = w.first != policy::WaitReason::none;  // (not a launch that went at its first look)
  if (waited && w.others_ns >= w.cycle_ns) LogGoingBeside(s, ordinal, g, function, MonotonicNs());
  guard.unlock();
  if (waited) {
    Log(4,
        "device %d: a launch of %p expected to run %llu us waited %llu us for its turn (%s, the container's "
        "balance %+lld us): time division, cycle %llu us",
        ordinal, function, static_cast<unsigned long long>(estimate_ns / 1000),
        static_cast<unsigned long long>(ticket.waited_ns / 1000), policy::WaitReasonName(w.first),
        static_cast<long long>(w.first_balance_ns / 1000), static_cast<unsigned long long>(w.cycle_ns / 1000));
  }
  return ticket;
}

// What Released charges the account for a launch estimated at `estimate_ns`, the limiter's accounting of the
// process's launches standing at `spent_ns` (policy::ChargesWhatRan). Caller holds s.mutex.
std::uint64_t ChargeFor(State& s, int ordinal, std::uint64_t estimate_ns, std::int64_t spent_ns) {
  const bool what_ran = s.charges_what_ran.load(std::memory_order_relaxed);
  std::int64_t& seen = s.spent_seen_ns[ordinal];
  std::int64_t& carried = s.carried_ns[ordinal];
  if (!what_ran || seen < 0) {  // (from the first charge on: this launch at its estimate)
    seen = what_ran ? spent_ns : -1;
    carried = 0;
    return estimate_ns;
  }
  const std::int64_t since = spent_ns - seen;
  seen = spent_ns;
  return policy::WhatRanChargeNs(s.plan, since, carried);
}

void Released(int ordinal, const Ticket& ticket, std::uint64_t estimate_ns, std::int64_t spent_ns) {
  if (!ticket.scheduled || estimate_ns == 0) return;
  State& s = TheState();
  const auto g = static_cast<std::uint32_t>(s.gpu_of[ordinal]);
  std::lock_guard<std::mutex> guard(s.mutex);
  if (s.me < 0) return;
  const std::uint64_t now = MonotonicNs();
  std::uint64_t& queued_end = s.queued_end_ns[ordinal];
  queued_end = std::max(queued_end, now) + estimate_ns;
  RaiseEnd(s, ordinal, g, policy::WorkEndWithMarginNs(queued_end, now));
  SetUndrained(ordinal, true);
  schedule::Entry& own = s.board->entry(s.entry);
  if (ticket.window.end_ns != policy::kNoTime && ticket.window.end_ns != s.published_window_ns[ordinal]) {
    s.published_window_ns[ordinal] = ticket.window.end_ns;
    schedule::RaiseTo(own.gpu[g].released_until_ns, ticket.window.end_ns);
  }
  const std::uint64_t charge = ChargeFor(s, ordinal, estimate_ns, spent_ns);
  if (ticket.free) return;
  s.unflushed_ns += charge / static_cast<std::uint64_t>(std::popcount(s.gpus));
  if (s.unflushed_ns >= kFlushNs || ticket.turn_until_ns == 0) FlushCharges(s, ordinal, now);
}

std::uint64_t BeginBlocking() {
  const std::uint64_t undrained =
      g_undrained.load(std::memory_order_acquire) &
      (g_siblings.load(std::memory_order_acquire) | g_beside.load(std::memory_order_acquire));
  if (undrained == 0) return 0;
  State& s = TheState();
  std::lock_guard<std::mutex> guard(s.mutex);
  if (s.me < 0) return 0;
  const std::uint64_t now = MonotonicNs();
  std::uint64_t devices = 0;
  for (int ordinal = 0; ordinal < policy::kMaxDevices; ++ordinal) {
    if (((undrained >> ordinal) & 1) == 0 || !Undrained(ordinal) || s.gpu_of[ordinal] < 0) continue;
    ++s.blocked[ordinal];
    devices |= 1ull << ordinal;
    // Its siblings wait until it returns (a waiter takes the turn after a cycle anyway), and so do the other members
    // where it keeps them off (KeepTurnAhead). Not where it spans GPUs: holding a neighbour off while a DDP rank
    // waited here for its collective's peers took 10 to 25 points of the neighbour's 50 % over fakecuda.
    const std::uint64_t until = now + s.plan.cycle_ns();
    if (KeepsOthersOff(ordinal))
      RaiseEnd(s, ordinal, static_cast<std::uint32_t>(s.gpu_of[ordinal]), until);
    else
      MoveSiblingEnd(s, ordinal, until, false);
  }
  return devices;
}

void EndBlocking(std::uint64_t devices, bool (*drained)(int ordinal)) {
  State& s = TheState();
  for (int ordinal = 0; devices != 0 && ordinal < policy::kMaxDevices; ++ordinal) {
    if (((devices >> ordinal) & 1) == 0) continue;
    const bool done = drained(ordinal);  // (outside s.mutex: it takes the launch path's lock and asks the driver)
    std::lock_guard<std::mutex> guard(s.mutex);
    if (--s.blocked[ordinal] > 0 || s.me < 0) continue;
    const auto g = static_cast<std::uint32_t>(s.gpu_of[ordinal]);
    const std::uint64_t now = MonotonicNs();
    LowerEnd(s, ordinal, g, policy::EndAfterBlockingNs(s.queued_end_ns[ordinal], done, now));
    if (!done) continue;
    s.queued_end_ns[ordinal] = std::min(s.queued_end_ns[ordinal], now);  // (the next launch's projection starts now)
    SetUndrained(ordinal, false);
  }
}

void Refund(int ordinal, std::uint64_t estimate_ns) {
  State& s = TheState();
  if (!Scheduled(ordinal) || estimate_ns == 0 || s.charges_what_ran.load(std::memory_order_relaxed)) return;
  // (The cell is set before set_up is, and never changes: no mutex needed. Not spread over GPUs: Released charged
  // a member spanning n GPUs a launch's estimate divided by n.)
  const auto spanned = static_cast<std::int64_t>(std::popcount(s.gpus));
  std::atomic_ref<std::int64_t>(s.cell->account.balance_ns)
      .fetch_add(static_cast<std::int64_t>(estimate_ns) / std::max<std::int64_t>(spanned, 1));
}

}  // namespace vgpu::hooks::turn
