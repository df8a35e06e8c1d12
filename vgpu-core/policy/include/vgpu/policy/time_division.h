// Time division of a GPU between containers (docs/compute-sharing.md, option A): on each GPU one container's work
// runs at a time, in windows cut from a cycle by the containers' shares. Pure: the time is passed in, nothing here
// sleeps, reads a clock or touches shared memory. The shim and the simulator give it what the containers publish
// (`Published`) and act on the `Release` it returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace vgpu::policy {

inline constexpr std::size_t kMaxMembers = 64;  // containers sharing the GPUs of one node
inline constexpr std::uint32_t kMaxGpus = 64;   // bit i of Member::gpus: the node's GPU i
inline constexpr std::uint64_t kNoTime = UINT64_MAX;
// The cycles a plan accepts (WindowPlan::Build): 100 us .. 10 s.
inline constexpr std::uint64_t kCycleLeastNs = 100'000;
inline constexpr std::uint64_t kCycleMostNs = 10'000'000'000ull;

// A container with a compute limit, as every shim on the node sees it.
struct Member {
  std::uint64_t id = 0;              // orders the members: the same on every shim
  std::uint32_t share_permille = 0;  // 1 .. 1000 of each GPU it spans
  std::uint64_t gpus = 0;            // bit i: the member runs on the node's GPU i
};

// A stretch of time [start_ns, end_ns).
struct Interval {
  std::uint64_t start_ns = 0;
  std::uint64_t end_ns = 0;
  std::uint64_t length() const { return end_ns - start_ns; }
  bool contains(std::uint64_t t) const { return t >= start_ns && t < end_ns; }
};

// The windows of one cycle. A member has the same pieces on every GPU it spans (aligned in wall-clock time, so the
// kernels of a job that spans GPUs run at the same moments everywhere). Time counts from an epoch shared by all
// shims (the caller subtracts it); cycle k covers [k * cycle, (k + 1) * cycle).
class WindowPlan {
 public:
  // Members are placed in order of how many GPUs they span (most first), then by id; each at the earliest offset
  // where a piece of its length is free on all its GPUs, else in several pieces from what is free on all of them.
  // Where the shares on a GPU sum past 1000, every member there is scaled down by the same factor (a member's
  // scale is the smallest over its GPUs). "" on success, else a one-line error naming the input.
  std::string Build(std::span<const Member> members, std::uint64_t cycle_ns);

  std::uint64_t cycle_ns() const { return cycle_ns_; }
  std::size_t size() const { return members_.size(); }
  const Member& member(std::size_t m) const { return members_[m]; }
  // The member's index, or -1.
  int IndexOf(std::uint64_t id) const;
  // The member's pieces within one cycle, offsets from the cycle's start, in order.
  std::span<const Interval> pieces(std::size_t m) const { return pieces_[m]; }
  // What the member was given, permille of the cycle (its share, unless scaled down or fragmented).
  std::uint32_t granted_permille(std::size_t m) const;

  // The member's window (a maximal stretch of its pieces) that contains `t_ns`, or the next one after it.
  // A member with no piece has none: {kNoTime, kNoTime}.
  Interval WindowAt(std::size_t m, std::uint64_t t_ns) const;
  // The member's window time in [from_ns, to_ns).
  std::uint64_t OwnTimeIn(std::size_t m, std::uint64_t from_ns, std::uint64_t to_ns) const;
  // The instant at which `amount_ns` of the member's window time has passed from `from_ns` on.
  std::uint64_t AfterOwnTime(std::size_t m, std::uint64_t from_ns, std::uint64_t amount_ns) const;
  // Which member's window holds `t_ns` on `gpu` (-1: nobody's), and the owner's window or the free stretch around it.
  int OwnerAt(std::uint32_t gpu, std::uint64_t t_ns, Interval* stretch = nullptr) const;

 private:
  std::uint64_t cycle_ns_ = 0;
  std::vector<Member> members_;
  std::vector<std::vector<Interval>> pieces_;  // per member, merged, in cycle order
};

// The cycle in which every member's window holds its longest kernel (`longest_ns[m]`, as it publishes it) and which
// is at least half `base_ns` per member on the GPU most members share (each handover between members costs the GPU
// ~160 us and the next member's start some more: on an H100 four busy members at 20 ms got 92 % of it together):
// the shortest `base_ns` x 2^k that does, at most `most_ns`. Doubling only: members that see the same longest kernels
// agree on it, and it changes seldom.
std::uint64_t CycleFor(std::span<const Member> members, std::span<const std::uint64_t> longest_ns,
                       std::uint64_t base_ns, std::uint64_t most_ns);

// What each member publishes about itself on one GPU, read by the others (docs/compute-sharing.md, "Shared
// state"). Written only by the member's own processes.
struct Published {
  std::uint32_t in_flight = 0;          // kernels released and not yet seen complete
  std::uint32_t waiting = 0;            // launches waiting for a window
  std::uint64_t repaid_until_ns = 0;    // in debt: its window time before this instant is lent to the others
  std::uint64_t released_until_ns = 0;  // the end of the window (its own or lent) its latest work was released into
  std::uint64_t declined_until_ns = 0;  // the rest of its window up to here is declined (DeclinedUntil); 0: none
  // Prompt service (TurnConfig::prompt_service): a launch of this member waits to cut in at the next boundary of the
  // work of the window's owner, which releases nothing more until here (kCutInAskNs ahead, renewed while it waits).
  std::uint64_t cut_in_until_ns = 0;
  // When its work last ended, as it published it (0: never): idle since then, once nothing is in flight or waiting.
  std::uint64_t work_end_ns = 0;
};

// What a member keeps of itself on one GPU (shared by its container's processes, not read by others): its window
// time so far minus the GPU time it ran. Credit (> 0, at most kCreditCycles cycles' window time) comes from window time it
// could not use (another's overrun held it, its next kernel did not fit); it lets it run past its window's end or
// in another's window lent while that one repays. Debt (< 0) comes from running past its windows; it is repaid by
// its next windows' time, which is lent to the others meanwhile. The balance of all members together changes only
// by idle time, so members with work each get their windows' time in the long run.
struct Account {
  std::int64_t balance_ns = 0;
  std::uint64_t as_of_ns = 0;  // the balance counts window time up to here
};

// Brings the account up to `now_ns`: adds the window time since, credit capped at kCreditCycles cycles' window time.
// One cycle was too little for mixed kernel sizes (window ends left unfilled are repaid in later windows' overruns).
// Two were too little once members on one GPU keep the others off while their work runs (KeepsOthersOffWhileUndrained):
// a 10 % member waits out the others' 20 ms overruns inside its own windows and needs the credit to take their lent
// windows later (10/20/30/40 of 5 us .. 20 ms over fakecuda: the 10 % one 8.0-9.4 with two, 9.5-9.6 with four).
inline constexpr std::int64_t kCreditCycles = 4;
void Accrue(const WindowPlan& plan, std::size_t me, Account& account, std::uint64_t now_ns);
// Charges `ran_ns` of GPU time the member's kernel ran (not counting time in an idle window it borrowed for free),
// found at `now_ns`. Returns what to publish as repaid_until_ns: the instant its window time repays the debt, or 0.
std::uint64_t Charge(const WindowPlan& plan, std::size_t me, Account& account, std::uint64_t ran_ns,
                     std::uint64_t now_ns);

// What a container's processes share for time division, in its region (after the limiter's budget): its id on the
// node (drawn once, when the region is new) and its one account, which every process updates lock-free.
struct TurnCell {
  std::uint64_t member_id = 0;
  Account account;
};
// Accrue and Charge on an account that several processes update at once (atomically, field by field): each span of
// window time is added once, by the process that moved `as_of_ns` over it. Both return the account as it stands.
Account AccrueShared(const WindowPlan& plan, std::size_t me, Account& shared, std::uint64_t now_ns);
Account ChargeShared(const WindowPlan& plan, std::size_t me, Account& shared, std::uint64_t ran_ns,
                     std::uint64_t now_ns);
// What to publish as repaid_until_ns for a balance at `now_ns`: the instant its window time repays the debt, or 0.
std::uint64_t RepaidUntil(const WindowPlan& plan, std::size_t me, std::int64_t balance_ns, std::uint64_t now_ns);

// Why a launch waits (LIBCUDA_LOG_LEVEL=4, the simulator's trace).
enum class WaitReason { none, window, debt, others_work, fit, sibling, cut_in, lead };
const char* WaitReasonName(WaitReason reason);

// The decision for one launch.
struct Release {
  std::uint64_t at_ns = 0;  // go at this time (<= now: at once); kNoTime with others_work: at a completion
  WaitReason reason = WaitReason::none;
  Interval window;                    // the window it goes into (or would), its own or lent
  bool free = false;                  // an idle window borrowed (`default`): what runs there is not charged
  std::uint64_t cut_in_until_ns = 0;  // prompt service: what to publish as Published::cut_in_until_ns (0: none)
  // Prompt service: another member may cut in (OtherMayCutIn): a caller that lets later launches go without asking
  // (the shim's lease of its turn) asks again within kPromptLeadNs, so that it sees an ask and keeps to the lead.
  bool ask_again_soon = false;
};

struct TurnConfig {
  // What a handover between members costs the GPU (HandoverCharge): an H100's, measured (../shared/FIELD-NOTES.md).
  std::uint64_t handover_ns = 160'000;
  // `default`: may use windows whose owner has no work, and time nobody owns, free of charge.
  bool borrow_idle = false;
  // Most of an idle owner's window a borrower may fill ahead: the owner, when work comes, waits at most this.
  std::uint64_t borrow_ahead_ns = 2'000'000;
  // Prompt service (docs/compute-sharing.md, "Prompt service"): a member on one GPU, idle for kCutInIdleNs when a
  // launch comes, with credit for it, cuts in at the next boundary of the work of the other member on one GPU whose
  // window it finds, charged; and credit may be spent in a window whose owner has no work, up to borrow_ahead_ns
  // ahead, charged. A light service beside a busy member then waits for the busy one's queued work, not for its own
  // next window; the busy one wins the time back in the light one's idle windows.
  bool prompt_service = true;
};

// Prompt service: how far ahead a cut-in's ask holds the others (renewed at each look while it waits), and how soon
// a launch held by it looks again. And how long a member must have been idle when a launch comes for that launch to
// cut in: a light service (a kernel now and then) does, a loop that synchronizes (its next burst follows its last at
// once) does not, since its cut-ins cost the busy member handovers (30/70 bf16 loops in the simulator: b 69.3 with
// the rule, 67.8 with cut-ins at any launch).
inline constexpr std::uint64_t kCutInAskNs = 2'000'000;
inline constexpr std::uint64_t kCutInLookNs = 250'000;
inline constexpr std::uint64_t kCutInIdleNs = 2'000'000;
// Prompt service: beside a member on one GPU idle for kCutInIdleNs (one whose next launch may cut in), a member on one
// GPU queues at most this much work ahead of now (a longer kernel goes alone): a cut-in waits for the queue to drain,
// and a busy member with 64 launches queued kept the light one waiting as long as without prompt service (p99 15 ms
// in the simulator). Not beside a member idle for less: a loop that synchronizes is idle between its bursts, and
// the busy member queueing 2 ms at a time beside it lost about a point of its share on an H200.
inline constexpr std::uint64_t kPromptLeadNs = 2'000'000;

// Decides a launch of member `me` on `gpu` expected to take `estimate_ns`, with the member's own released work
// expected to be done at `queued_end_ns` (<= now: none), given its account (brought up to now) and every member's
// published state on that GPU (`published[m]` for plan member m). Rules (docs/compute-sharing.md):
// - it goes only inside one of its windows when not in debt, inside another's window while that one repays or in
//   time nobody owns (both on credit, charged), or, with borrow_idle, in a window whose owner has no work or in time
//   nobody owns (free);
// - only when no other member's work is in flight there, unless that work outlived the window it was released into
//   by a whole cycle (a dead or stopped holder stalls the others one cycle; one of the waiter's windows was too
//   little: a holder with credit may queue long kernels past its window's end), nor,
//   for a member that spans GPUs, on its other GPUs (`peers_held`: the caller asks OthersHold there), so that its
//   ranks start their windows together and their collective kernels meet; the rest of a window its owner declined
//   (DeclinedUntil) is taken too, charged, by a member on one GPU;
// - only if, after it, the account is expected to be at least minus half the launch (what runs past a window is
//   then repaid, and on average windows are neither overrun nor left unfilled), or nothing of the member's is
//   queued and the launch could not fit even a whole window (it overruns into debt). A free launch must fit. Credit
//   carries a member on one GPU past its window's end only with the launch that straddles it, while the member
//   whose window comes next waits: work queued behind would keep that one out of its window, and its own credit
//   could not win the time back while this member stays in credit (docs/compute-sharing.md, "Loops that
//   synchronize");
// - with prompt service (config.prompt_service; docs/compute-sharing.md, "Prompt service"), between members on one
//   GPU: a launch that came (`arrived_ns`) after its member had been idle kCutInIdleNs cuts in at the next boundary of
//   the window owner's work (asking: Release::cut_in_until_ns), the others yield to an ask (WaitReason::cut_in), a
//   member beside one that may cut in queues at most kPromptLeadNs ahead (WaitReason::lead), and credit is spent in
//   the window of a member with no work.
// `arrived_ns`: when the launch first asked (prompt service: a member cuts in only with a launch that came after it
// had been idle for kCutInIdleNs; kNoTime: never).
Release Decide(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
               const Account& account, const TurnConfig& config, std::uint64_t queued_end_ns, std::uint64_t estimate_ns,
               std::uint64_t now_ns, bool peers_held = false, std::uint64_t arrived_ns = kNoTime);

// A launch refused because it does not fit what is left of the member's own window (WaitReason::fit), with nothing
// of the member's in flight (`queue_empty`), cannot go before that window ends: its balance gains the time it leaves
// as fast as the window's rest shrinks. The member then declines the rest, published as declined_until_ns: another
// member on one GPU takes it, charged, where it can afford it (with credit, or running on into its own window: its
// debt, if any, lends its windows back), where the GPU would be idle. A loop
// that synchronizes every few launches (four bf16 matmuls, then torch.cuda.synchronize) leaves such a rest in most
// windows: the 30 % one beside a 70 % one read 26.7 % of the GPU's time on an H200 before (docs/compute-sharing.md,
// "Loops that synchronize"). Returns the window's end, or 0 where the launch does not decline it. Members spanning
// GPUs do not decline (their windows are aligned across GPUs for their collectives).
std::uint64_t DeclinedUntil(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, const Release& release,
                            bool queue_empty, std::uint64_t now_ns);
// How soon a launch of a member on one GPU, waiting in another member's window while that one waits too, looks again:
// the other may decline its rest when its work drains. (A member spanning GPUs looking that often caught the
// windows its neighbour lent while in debt sooner, and the DDP job's neighbour over fakecuda fell to 32-39 % of its
// 50 in a second, from 40-47.)
inline constexpr std::uint64_t kDeclineLookNs = 250'000;

// Whether another member's work is in flight on `gpu` and has not outlived the window it was released into by more
// than `bound_ns` (Decide: the cycle).
bool OthersHold(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
                std::uint64_t bound_ns, std::uint64_t now_ns);

// The GPU's handover to a member (an H100 loses ~160 us in which nobody runs each time it goes from one context's
// work to another's: docs/results-gpu.md) is charged to that member, once per window of its own, as far as the time
// nobody owns cannot absorb the cycle's handovers: with the shares on a GPU booked in full each member then gets its
// window less one handover, instead of the member whose credit saturates first paying for all of them (10/20/30/40
// with 1 ms kernels in the simulator: 7.4 / 20 / 30 / 40 % uncharged, 9.3 / 19.5 / 29.2 / 39.2 charged). Returns
// the charge if a launch released into its own window now (`release`) is the first of that window
// (`charged_window_ns`, the start of the last window charged, is another: set to this one's when it is charged) and
// another member released work into a window ending at or after its start (the GPU goes from that work to this);
// else 0.
std::uint64_t HandoverCharge(const WindowPlan& plan, std::size_t me, std::uint32_t gpu,
                             std::span<const Published> published, const Release& release,
                             std::uint64_t& charged_window_ns, std::uint64_t handover_ns, std::uint64_t now_ns);

// ---- Turns inside a container (docs/compute-sharing.md, "Turns inside a container") ------------------------------
// The processes of one container on one GPU take turns, as containers take windows, so that they never time-slice
// each other (each handover of the driver's time-slicing costs the GPU ~160 us that nobody runs and NVML does not
// count, and each process's kernel times would hold its siblings' slices). One 64-bit word per container and GPU,
// in the container's region, written only by its processes, by compare-and-swap.
struct SiblingTurn {
  std::uint32_t holder = 0;  // the process holding the turn, as the caller names it (1 .. 2047; 0: nobody)
  bool waiting = false;      // another process of the container waits for the turn
  bool handed = false;       // the holder gave it up: it takes it back only if nobody has by end_ns + kHandBackNs
  std::uint64_t end_ns = 0;  // the holder's released work is expected done by here
};
inline constexpr std::uint32_t kMaxSiblingHolder = 2047;  // (the region's slot + 1)
inline constexpr std::uint64_t kSiblingGrainNs =
    1'000;  // end_ns is kept in these units, rounded up (51 bits: 71 years)
inline constexpr std::uint64_t kHandBackNs = 1'000'000;
std::uint64_t PackSiblingTurn(const SiblingTurn& turn);
SiblingTurn UnpackSiblingTurn(std::uint64_t word);

// What a process does with the word it read.
struct SiblingStep {
  bool go = false;            // it may release its launch now (after writing `write`)
  std::uint64_t look_ns = 0;  // otherwise: look again by then (a holder's work may end sooner: poll too)
  SiblingTurn write;          // what to swap in for what was read (equal to it: nothing to write)
  bool took = false;          // go, having taken the turn from another (or nobody): its sub-turn starts now
};

// A launch of process `self` whose container may release it now (Decide said so): may it go? Its work would then
// be expected done by `end_after_ns`; it took the turn at `held_since_ns` (meaningful while it holds it).
// - The holder goes and keeps the turn, unless a sibling waits and it has held the turn for `subturn_ns`: then it
//   hands it over (stops releasing; its queue drains; the waiter takes the turn when the holder's work ends).
// - Another takes the turn once the holder's work has ended (or nobody holds it), or when `past_bound` (it has
//   waited a whole cycle: a holder dead, stopped or lying costs its siblings one cycle at most); else it waits and
//   says so (`waiting`).
// - A holder that handed the turn over takes it back only if nobody has by end_ns + kHandBackNs.
SiblingStep DecideSibling(const SiblingTurn& seen, std::uint32_t self, std::uint64_t held_since_ns,
                          std::uint64_t subturn_ns, std::uint64_t end_after_ns, std::uint64_t now_ns, bool past_bound);

// When a process's released work, expected done at `queued_end_ns`, is published as done (to the other members as
// its busy_until, to its siblings as the turn's end): with a margin of max(200 us, a tenth of what is queued), so
// that a short estimate costs an overlap the driver time-slices rather than a stall.
std::uint64_t WorkEndWithMarginNs(std::uint64_t queued_end_ns, std::uint64_t now_ns);

// A process waiting for its turn sees its released work not yet drained at `now_ns`, with `published_end_ns` the
// end it published (to the other members, to its siblings): the end to publish now. An estimate is a kernel's
// typical run, and one function given different sizes runs far past it (a 20 ms launch of a key whose median is
// 0.4 ms): the end is kept kUndrainedLeadNs ahead while the work runs, so that nobody releases beside it and the
// driver does not time-slice the two. Raised only when less than half the lead is left (each raise is a write
// others read); a holder stopped or lying still holds the others a cycle at most (Decide, DecideSibling).
inline constexpr std::uint64_t kUndrainedLeadNs = 1'000'000;
std::uint64_t UndrainedWorkEndNs(std::uint64_t published_end_ns, std::uint64_t now_ns);

// Where the end of a holder's turn goes when its wait inside the driver (a synchronize call, during which the turn was
// held) returns at `now_ns`, its released work projected to end at `queued_end_ns`: back to the projection (with its
// margin), not to now even if its streams have drained, since it launches again at once and a sibling taking the turn
// in between made the two alternate at every synchronize (a bf16 loop's four matmuls: the two-process container got
// 37.3 % of its 40 on the H100, 38.9 without the hold); at least kUndrainedLeadNs ahead while work still runs.
std::uint64_t EndAfterBlockingNs(std::uint64_t queued_end_ns, bool drained, std::uint64_t now_ns);

// Whether the member is charged what its launches ran (as its shims measure and settle them: the limiter's
// accounting, Limiter::spent_ns) rather than each launch's estimate when it is released: a member on one GPU, alone
// there or not. The estimate is a kernel's median run, which under-charges a kernel whose run time depends on its
// data (30 us launches with a 2 ms one in eight took 74.7 % of the GPU at a 30 % cap over fakecuda alone; 5 us .. 20 ms
// beside a steady 70 % neighbour 38.9 %, the neighbour 59.1). Beside others a measured span holds no other member's
// time only if nobody releases beside the member's work while it runs, so such a member keeps the end the others see
// ahead while its work has not drained (KeepsOthersOffWhileUndrained): charged what ran without that, the same case
// read 21.8 / 62.4. Not a member spanning GPUs: a collective's measured runs hold its wait for the other ranks, and
// charging them brought a 2-GPU job's collapse back; nor may it keep the others off while a collective waits.
bool ChargesWhatRan(const WindowPlan& plan, std::size_t me);
// Whether the member, while its released work has not drained, keeps the end of its work that the other members on
// its GPU see ahead of now (as it keeps its own processes' turn ahead): a member charged what ran with another member
// on its GPU. A stopped or lying member still holds the others a cycle per launch at most (Decide).
bool KeepsOthersOffWhileUndrained(const WindowPlan& plan, std::size_t me);

// What one charge of a member charged what ran takes from its account: `spent_since_ns`, what the limiter's
// accounting of the process's launches grew by since its last charge (negative where settlements gave back more than
// was charged meanwhile), plus what earlier charges carried (`carried_ns`, updated: owed and not yet charged when
// positive, given back and not yet taken off when negative). One charge takes at most kWhatRanChargeCycles cycles;
// what is owed past that is carried to the next charges, up to kWhatRanCarryCycles cycles more, and a give-back up to
// kWhatRanChargeCycles. Why bounded: corrections arrive in lumps as measurement windows end, and one window settled
// unmeasured at an inflated mean (6 ms for a 31 us kernel, from its first measurements) charged 1.4 s at once, a
// 4.8 s stall; bounded, one bad settlement costs the container six cycles at most. Why carried: a lump past two cycles
// is an ordinary window on a loaded host (a window of 5 ms of estimates held 46 ms of 2 ms runs), and dropping what lay
// past the bound gave a lone 30 % container 44-52 % of the GPU under host load (1-15 % of its runs never charged).
inline constexpr std::int64_t kWhatRanChargeCycles = 2;
inline constexpr std::int64_t kWhatRanCarryCycles = 4;
std::uint64_t WhatRanChargeNs(const WindowPlan& plan, std::int64_t spent_since_ns, std::int64_t& carried_ns);

// The sub-turn of a member's processes on a GPU: its window in the cycle, at least 2 ms (handovers then fall mostly
// at window boundaries, where the GPU changes hands anyway).
std::uint64_t SubturnNs(const WindowPlan& plan, std::size_t me);

}  // namespace vgpu::policy
