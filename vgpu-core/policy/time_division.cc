// Time division (time_division.h, docs/compute-sharing.md): building a cycle's windows, and the release decision.
#include "vgpu/policy/time_division.h"

#include <algorithm>
#include <atomic>
#include <bit>

namespace vgpu::policy {
namespace {

bool Spans(const Member& member, std::uint32_t gpu) { return gpu < kMaxGpus && ((member.gpus >> gpu) & 1) != 0; }

// The stretches of `free` that are also in `other`, both sorted and disjoint.
std::vector<Interval> Intersect(const std::vector<Interval>& free, const std::vector<Interval>& other) {
  std::vector<Interval> out;
  std::size_t i = 0;
  std::size_t j = 0;
  while (i < free.size() && j < other.size()) {
    const std::uint64_t start = std::max(free[i].start_ns, other[j].start_ns);
    const std::uint64_t end = std::min(free[i].end_ns, other[j].end_ns);
    if (start < end) out.push_back({start, end});
    if (free[i].end_ns < other[j].end_ns)
      ++i;
    else
      ++j;
  }
  return out;
}

void Remove(std::vector<Interval>& free, Interval taken) {
  std::vector<Interval> out;
  for (const Interval& f : free) {
    if (f.end_ns <= taken.start_ns || f.start_ns >= taken.end_ns) {
      out.push_back(f);
      continue;
    }
    if (f.start_ns < taken.start_ns) out.push_back({f.start_ns, taken.start_ns});
    if (f.end_ns > taken.end_ns) out.push_back({taken.end_ns, f.end_ns});
  }
  free = std::move(out);
}

// `length_ns` from `common` (what is free on all the member's GPUs): one piece where one is long enough, else
// pieces in cycle order until the length is placed or nothing is left.
std::vector<Interval> Place(const std::vector<Interval>& common, std::uint64_t length_ns) {
  for (const Interval& c : common) {
    if (c.length() >= length_ns) return {{c.start_ns, c.start_ns + length_ns}};
  }
  std::vector<Interval> pieces;
  for (const Interval& c : common) {
    if (length_ns == 0) break;
    const std::uint64_t take = std::min(length_ns, c.length());
    pieces.push_back({c.start_ns, c.start_ns + take});
    length_ns -= take;
  }
  return pieces;
}

std::vector<Interval> Merged(std::vector<Interval> pieces) {
  std::sort(pieces.begin(), pieces.end(), [](const Interval& a, const Interval& b) { return a.start_ns < b.start_ns; });
  std::vector<Interval> out;
  for (const Interval& p : pieces) {
    if (!out.empty() && out.back().end_ns == p.start_ns)
      out.back().end_ns = p.end_ns;
    else
      out.push_back(p);
  }
  return out;
}

std::string CheckMembers(std::span<const Member> members, std::uint64_t cycle_ns) {
  if (cycle_ns < kCycleLeastNs || cycle_ns > kCycleMostNs) {
    return "cycle = " + std::to_string(cycle_ns) + " ns; accepted: 100000 .. 10000000000 (100 us .. 10 s)";
  }
  if (members.size() > kMaxMembers) {
    return std::to_string(members.size()) + " members; accepted: at most " + std::to_string(kMaxMembers);
  }
  for (std::size_t m = 0; m < members.size(); ++m) {
    const std::string name = "member " + std::to_string(m) + " (id " + std::to_string(members[m].id) + ")";
    if (members[m].share_permille == 0 || members[m].share_permille > 1000) {
      return name + ": share = " + std::to_string(members[m].share_permille) + " permille; accepted: 1 .. 1000";
    }
    if (members[m].gpus == 0) return name + ": gpus = 0; accepted: at least one GPU bit set";
    for (std::size_t n = 0; n < m; ++n) {
      if (members[n].id == members[m].id) return name + ": the same id as member " + std::to_string(n);
    }
  }
  return "";
}

}  // namespace

std::string WindowPlan::Build(std::span<const Member> members, std::uint64_t cycle_ns) {
  std::string error = CheckMembers(members, cycle_ns);
  if (!error.empty()) return error;
  cycle_ns_ = cycle_ns;
  members_.assign(members.begin(), members.end());
  pieces_.assign(members.size(), {});
  std::uint64_t sum[kMaxGpus] = {};  // shares per GPU, permille
  for (const Member& member : members_) {
    for (std::uint32_t g = 0; g < kMaxGpus; ++g) sum[g] += Spans(member, g) ? member.share_permille : 0;
  }
  std::vector<std::size_t> order(members_.size());
  for (std::size_t m = 0; m < order.size(); ++m) order[m] = m;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const int spans_a = std::popcount(members_[a].gpus);
    const int spans_b = std::popcount(members_[b].gpus);
    return spans_a != spans_b ? spans_a > spans_b : members_[a].id < members_[b].id;
  });
  std::vector<std::vector<Interval>> free(kMaxGpus, std::vector<Interval>{{0, cycle_ns}});
  for (const std::size_t m : order) {
    const Member& member = members_[m];
    std::uint64_t denominator = 1000;
    std::vector<Interval> common{{0, cycle_ns}};
    for (std::uint32_t g = 0; g < kMaxGpus; ++g) {
      if (!Spans(member, g)) continue;
      denominator = std::max(denominator, sum[g]);
      common = Intersect(common, free[g]);
    }
    const std::uint64_t length_ns = cycle_ns * member.share_permille / denominator;
    pieces_[m] = Merged(Place(common, length_ns));
    for (std::uint32_t g = 0; g < kMaxGpus; ++g) {
      if (!Spans(member, g)) continue;
      for (const Interval& piece : pieces_[m]) Remove(free[g], piece);
    }
  }
  return "";
}

int WindowPlan::IndexOf(std::uint64_t id) const {
  for (std::size_t m = 0; m < members_.size(); ++m) {
    if (members_[m].id == id) return static_cast<int>(m);
  }
  return -1;
}

std::uint32_t WindowPlan::granted_permille(std::size_t m) const {
  std::uint64_t total = 0;
  for (const Interval& piece : pieces_[m]) total += piece.length();
  return static_cast<std::uint32_t>(total * 1000 / cycle_ns_);
}

Interval WindowPlan::WindowAt(std::size_t m, std::uint64_t t_ns) const {
  const std::vector<Interval>& pieces = pieces_[m];
  if (pieces.empty()) return {kNoTime, kNoTime};
  const std::uint64_t base = t_ns / cycle_ns_ * cycle_ns_;
  const std::uint64_t phase = t_ns - base;
  // A piece that ends at the cycle's end and one that starts at its beginning are one window across the boundary.
  const bool wraps = pieces.back().end_ns == cycle_ns_ && pieces.front().start_ns == 0 && pieces.size() > 1;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (phase >= pieces[i].end_ns) continue;
    Interval window{base + pieces[i].start_ns, base + pieces[i].end_ns};
    if (wraps && i == 0 && base >= cycle_ns_) window.start_ns = base - (cycle_ns_ - pieces.back().start_ns);
    if (wraps && i + 1 == pieces.size()) window.end_ns = base + cycle_ns_ + pieces.front().end_ns;
    return window;
  }
  const std::uint64_t next = base + cycle_ns_;
  Interval window{next + pieces.front().start_ns, next + pieces.front().end_ns};
  if (wraps) window.start_ns = next - (cycle_ns_ - pieces.back().start_ns);
  return window;
}

// The member's window time in [0, t_ns).
static std::uint64_t OwnTimeBefore(std::span<const Interval> pieces, std::uint64_t cycle_ns, std::uint64_t t_ns) {
  std::uint64_t per_cycle = 0;
  std::uint64_t in_phase = 0;
  const std::uint64_t phase = t_ns % cycle_ns;
  for (const Interval& piece : pieces) {
    per_cycle += piece.length();
    if (phase > piece.start_ns) in_phase += std::min(phase, piece.end_ns) - piece.start_ns;
  }
  return t_ns / cycle_ns * per_cycle + in_phase;
}

std::uint64_t WindowPlan::OwnTimeIn(std::size_t m, std::uint64_t from_ns, std::uint64_t to_ns) const {
  if (to_ns <= from_ns) return 0;
  return OwnTimeBefore(pieces_[m], cycle_ns_, to_ns) - OwnTimeBefore(pieces_[m], cycle_ns_, from_ns);
}

std::uint64_t WindowPlan::AfterOwnTime(std::size_t m, std::uint64_t from_ns, std::uint64_t amount_ns) const {
  if (amount_ns == 0) return from_ns;
  const std::vector<Interval>& pieces = pieces_[m];
  std::uint64_t per_cycle = 0;
  for (const Interval& piece : pieces) per_cycle += piece.length();
  if (per_cycle == 0) return kNoTime;
  // The first instant t with OwnTimeBefore(t) = OwnTimeBefore(from) + amount: in cycle `target / per_cycle`, at
  // `target % per_cycle` into its pieces (0 into them: the end of the previous cycle's last piece).
  const std::uint64_t target = OwnTimeBefore(pieces, cycle_ns_, from_ns) + amount_ns;
  const std::uint64_t cycle = target / per_cycle;
  std::uint64_t left = target % per_cycle;
  if (left == 0) return (cycle - 1) * cycle_ns_ + pieces.back().end_ns;
  for (const Interval& piece : pieces) {
    if (left <= piece.length()) return cycle * cycle_ns_ + piece.start_ns + left;
    left -= piece.length();
  }
  return kNoTime;  // unreachable: left < per_cycle
}

int WindowPlan::OwnerAt(std::uint32_t gpu, std::uint64_t t_ns, Interval* stretch) const {
  const std::uint64_t base = t_ns / cycle_ns_ * cycle_ns_;
  const std::uint64_t phase = t_ns - base;
  // The stretch of the cycle around `phase`: a member's piece, or the free time between pieces.
  std::uint64_t free_start = 0;
  std::uint64_t free_end = cycle_ns_;
  for (std::size_t m = 0; m < members_.size(); ++m) {
    if (!Spans(members_[m], gpu)) continue;
    for (const Interval& piece : pieces_[m]) {
      if (piece.contains(phase)) {
        if (stretch != nullptr) *stretch = {base + piece.start_ns, base + piece.end_ns};
        return static_cast<int>(m);
      }
      if (piece.end_ns <= phase) free_start = std::max(free_start, piece.end_ns);
      if (piece.start_ns > phase) free_end = std::min(free_end, piece.start_ns);
    }
  }
  if (stretch != nullptr) *stretch = {base + free_start, base + free_end};
  return -1;
}

const char* WaitReasonName(WaitReason reason) {
  switch (reason) {
    case WaitReason::none:
      return "none";
    case WaitReason::window:
      return "window";
    case WaitReason::debt:
      return "debt";
    case WaitReason::others_work:
      return "others_work";
    case WaitReason::fit:
      return "fit";
    case WaitReason::sibling:
      return "sibling";
    case WaitReason::cut_in:
      return "cut_in";
    case WaitReason::lead:
      return "lead";
  }
  return "?";
}

// The most members that share one GPU.
static std::uint64_t MostMembersOnOneGpu(std::span<const Member> members) {
  std::uint64_t most = 0;
  for (std::uint32_t gpu = 0; gpu < kMaxGpus; ++gpu) {
    std::uint64_t on = 0;
    for (const Member& member : members) on += Spans(member, gpu) ? 1 : 0;
    most = std::max(most, on);
  }
  return most;
}

std::uint64_t CycleFor(std::span<const Member> members, std::span<const std::uint64_t> longest_ns,
                       std::uint64_t base_ns, std::uint64_t most_ns) {
  std::uint64_t cycle = base_ns;
  // Half a base cycle per member on the GPU most members share: their handovers cost the same part of it however
  // many they are (two members: the base cycle; four: twice it).
  const std::uint64_t least_ns = base_ns / 2 * MostMembersOnOneGpu(members);
  while (cycle < most_ns && cycle < least_ns) cycle *= 2;
  for (std::size_t m = 0; m < members.size() && m < longest_ns.size(); ++m) {
    const std::uint32_t share = std::max<std::uint32_t>(members[m].share_permille, 1);
    while (cycle < most_ns && cycle / 1000 * share < longest_ns[m]) cycle *= 2;
  }
  return std::min(cycle, std::max(base_ns, most_ns));
}

static std::uint64_t PerCycleOwnTime(const WindowPlan& plan, std::size_t me) {
  std::uint64_t total = 0;
  for (const Interval& piece : plan.pieces(me)) total += piece.length();
  return total;
}

// What the window time of [from_ns, to_ns) adds to a balance: credit capped at kCreditCycles cycles' window time (a
// balance already above the cap is not lowered).
struct Accrual {
  std::int64_t gained_ns;
  std::int64_t cap_ns;
  std::int64_t Applied(std::int64_t balance) const { return std::max(balance, std::min(balance + gained_ns, cap_ns)); }
};
static Accrual AccrualOf(const WindowPlan& plan, std::size_t me, std::uint64_t from_ns, std::uint64_t to_ns) {
  return {static_cast<std::int64_t>(plan.OwnTimeIn(me, from_ns, to_ns)),
          kCreditCycles * static_cast<std::int64_t>(PerCycleOwnTime(plan, me))};
}

void Accrue(const WindowPlan& plan, std::size_t me, Account& account, std::uint64_t now_ns) {
  if (now_ns <= account.as_of_ns) return;
  account.balance_ns = AccrualOf(plan, me, account.as_of_ns, now_ns).Applied(account.balance_ns);
  account.as_of_ns = now_ns;
}

std::uint64_t Charge(const WindowPlan& plan, std::size_t me, Account& account, std::uint64_t ran_ns,
                     std::uint64_t now_ns) {
  Accrue(plan, me, account, now_ns);
  account.balance_ns -= static_cast<std::int64_t>(ran_ns);
  return RepaidUntil(plan, me, account.balance_ns, now_ns);
}

Account AccrueShared(const WindowPlan& plan, std::size_t me, Account& shared, std::uint64_t now_ns) {
  std::atomic_ref<std::uint64_t> as_of(shared.as_of_ns);
  std::atomic_ref<std::int64_t> balance(shared.balance_ns);
  std::uint64_t from = as_of.load();
  while (from < now_ns && !as_of.compare_exchange_weak(from, now_ns)) {
  }
  if (from < now_ns) {  // this process moved as_of over [from, now): it adds that span's window time
    const Accrual accrual = AccrualOf(plan, me, from, now_ns);  // (once: the loop only retries the exchange)
    std::int64_t seen = balance.load();
    while (!balance.compare_exchange_weak(seen, accrual.Applied(seen))) {
    }
  }
  return {balance.load(), std::max(now_ns, as_of.load())};
}

Account ChargeShared(const WindowPlan& plan, std::size_t me, Account& shared, std::uint64_t ran_ns,
                     std::uint64_t now_ns) {
  const Account before = AccrueShared(plan, me, shared, now_ns);
  std::atomic_ref<std::int64_t> balance(shared.balance_ns);
  const auto ran = static_cast<std::int64_t>(ran_ns);
  return {balance.fetch_sub(ran) - ran, before.as_of_ns};
}

std::uint64_t RepaidUntil(const WindowPlan& plan, std::size_t me, std::int64_t balance_ns, std::uint64_t now_ns) {
  if (balance_ns >= 0) return 0;
  return plan.AfterOwnTime(me, now_ns, static_cast<std::uint64_t>(-balance_ns));
}

bool OthersHold(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
                std::uint64_t bound_ns, std::uint64_t now_ns) {
  for (std::size_t o = 0; o < plan.size() && o < published.size(); ++o) {
    if (o == me || !Spans(plan.member(o), gpu) || published[o].in_flight == 0) continue;
    // (Saturating: a released_until near the clock's end, a liar's, must not wrap round to "long ago".)
    const std::uint64_t until = published[o].released_until_ns;
    if (now_ns < (until > kNoTime - bound_ns ? kNoTime : until + bound_ns)) return true;
  }
  return false;
}

namespace {

// The window a launch of `me` may go into at `now_ns`, if any. `whole` is the window's full length, for the rule
// that a kernel longer than any window goes at an empty queue.
struct Candidate {
  bool found = false;
  Interval window;
  std::uint64_t whole_ns = 0;
  bool free = false;
  bool lent = false;       // another member's window, charged: lent while it repays, declined, idle, or cut into
  bool cut_in = false;     // prompt service: another's window, at the next boundary of its owner's work
  Interval owner_stretch;  // the stretch of the GPU's cycle around now (whoever owns it)
};

bool Idle(const Published& p) { return p.in_flight == 0 && p.waiting == 0; }

// Whether time at `t_ns` on the GPU may be borrowed for free: nobody owns it, its owner has no work, or it is the
// borrower's own window while it is in debt and no other member has work.
bool Borrowable(std::size_t me, std::span<const Published> published, int owner, bool others_idle) {
  if (owner < 0) return true;
  return owner == static_cast<int>(me) ? others_idle : Idle(published[owner]);
}

// The end of a free borrow from `now_ns`: `ahead_ns` on, or sooner where a stretch that may not be borrowed begins.
// The borrower's own window, when it is not in debt, is its own anyway: a borrow may run on into it.
std::uint64_t BorrowEnd(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
                        bool in_debt, bool others_idle, std::uint64_t now_ns, std::uint64_t ahead_ns) {
  const std::uint64_t end_ns = now_ns + ahead_ns;
  for (std::uint64_t t = now_ns; t < end_ns;) {
    Interval stretch;
    const int owner = plan.OwnerAt(gpu, t, &stretch);
    const bool own = owner == static_cast<int>(me) && !in_debt;
    if (!own && !Borrowable(me, published, owner, others_idle)) return t;
    t = stretch.end_ns;
  }
  return end_ns;
}

bool OthersIdle(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published) {
  for (std::size_t o = 0; o < plan.size(); ++o) {
    if (o != me && Spans(plan.member(o), gpu) && !Idle(published[o])) return false;
  }
  return true;
}

// Prompt service (TurnConfig::prompt_service), for a member on one GPU in the window of another member on one GPU:
// credit spent in that window while its owner has no work (up to borrow_ahead_ns ahead: the owner, when work comes,
// waits at most that), or, with credit for the whole launch and nothing of its own in flight, a cut-in at the next
// boundary of the owner's work, for a launch that `woke` it (it had been idle kCutInIdleNs). Either is charged: the
// owner, kept out, gains the credit to win the time back.
bool FindPromptWindow(const WindowPlan& plan, std::size_t me, std::span<const Published> published,
                      const Account& account, const TurnConfig& config, int owner, std::uint64_t estimate_ns, bool woke,
                      std::uint64_t now_ns, Candidate& c) {
  if (owner < 0 || owner == static_cast<int>(me) || !ChargesWhatRan(plan, me) ||
      !ChargesWhatRan(plan, static_cast<std::size_t>(owner)) || account.balance_ns <= 0) {
    return false;
  }
  const Interval stretch = c.owner_stretch;
  if (Idle(published[owner])) {
    if (config.borrow_idle) return false;  // (`default` borrows that window for free: FindWindow, below)
    c.found = c.lent = true;
    c.window = {now_ns, std::min(stretch.end_ns, now_ns + config.borrow_ahead_ns)};
    c.whole_ns = c.window.length();
    return true;
  }
  if (!woke || published[me].in_flight > 0 || account.balance_ns < static_cast<std::int64_t>(estimate_ns)) {
    return false;
  }
  for (std::size_t o = 0; o < plan.size(); ++o) {  // one cut-in at a time: the lowest member asking goes first
    if (o < me && o != static_cast<std::size_t>(owner) && published[o].cut_in_until_ns > now_ns) return false;
  }
  c.found = c.lent = c.cut_in = true;
  c.window = {now_ns, std::max(stretch.end_ns, now_ns + estimate_ns)};
  c.whole_ns = c.window.length();
  return true;
}

// Prompt service: whether another member on one GPU has been idle on `gpu` for kCutInIdleNs (its next launch may cut
// in).
bool OtherMayCutIn(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
                   std::uint64_t now_ns) {
  for (std::size_t o = 0; o < plan.size(); ++o) {
    if (o == me || !Spans(plan.member(o), gpu) || !ChargesWhatRan(plan, o) || !Idle(published[o])) continue;
    if (published[o].work_end_ns <= now_ns && now_ns - published[o].work_end_ns >= kCutInIdleNs) return true;
  }
  return false;
}

// Prompt service: whether a launch of `me` (on one GPU) that first asked at `arrived_ns` waits because another member
// on `gpu` asks to cut in. At most a cycle per launch: a member that asks and never launches (lying, or stopped)
// holds the others as one that publishes work it does not have does (docs/threat-model.md).
bool YieldsToACutIn(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
                    std::uint64_t now_ns, std::uint64_t arrived_ns) {
  if (arrived_ns == kNoTime || now_ns >= arrived_ns + plan.cycle_ns() || !ChargesWhatRan(plan, me)) return false;
  for (std::size_t o = 0; o < plan.size(); ++o) {
    if (o != me && Spans(plan.member(o), gpu) && published[o].cut_in_until_ns > now_ns) return true;
  }
  return false;
}

Candidate FindWindow(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
                     const Account& account, const TurnConfig& config, std::uint64_t estimate_ns, bool woke,
                     std::uint64_t now_ns) {
  Candidate c;
  const int owner = plan.OwnerAt(gpu, now_ns, &c.owner_stretch);
  const Interval stretch = c.owner_stretch;
  const bool others_idle = OthersIdle(plan, me, gpu, published);
  if (config.borrow_idle && others_idle) {  // nobody else wants the GPU: all of it is free to borrow
    c.found = true;
    c.free = true;
    c.window = {now_ns, now_ns + config.borrow_ahead_ns};
    c.whole_ns = c.window.length();
    return c;
  }
  if (owner == static_cast<int>(me) && account.balance_ns >= 0) {
    const Interval own = plan.WindowAt(me, now_ns);
    c.found = true;
    c.window = {now_ns, own.end_ns};
    c.whole_ns = own.length();
    return c;
  }
  if (owner >= 0 && owner != static_cast<int>(me) && now_ns < published[owner].repaid_until_ns &&
      account.balance_ns > 0) {
    c.found = true;  // on credit
    c.lent = true;
    c.window = {now_ns, std::min(stretch.end_ns, published[owner].repaid_until_ns)};
    c.whole_ns = c.window.length();
    return c;
  }
  if (owner >= 0 && owner != static_cast<int>(me) && published[owner].declined_until_ns > now_ns &&
      published[owner].in_flight == 0 && ChargesWhatRan(plan, me)) {  // (not a member spanning GPUs: not aligned)
    c.found = true;  // the rest of a window its owner declined, charged (in debt, it lends its windows back)
    c.lent = true;
    c.window = {now_ns, std::min(stretch.end_ns, published[owner].declined_until_ns)};
    c.whole_ns = c.window.length();
    return c;
  }
  if (config.prompt_service &&
      FindPromptWindow(plan, me, published, account, config, owner, estimate_ns, woke, now_ns, c)) {
    return c;
  }
  if (owner < 0 && account.balance_ns > 0 && !config.borrow_idle) {
    // Time nobody owns (the shares on the GPU sum to less than all of it), on credit: what its windows held but it
    // could not use (a launch-bound process fills a fraction of each) is spent here, charged, up to its share.
    c.found = true;
    c.window = {now_ns, stretch.end_ns};
    c.whole_ns = c.window.length();
    return c;
  }
  if (!config.borrow_idle) return c;  // in debt in its own window: lent to the others
  if (!Borrowable(me, published, owner, others_idle)) return c;
  c.found = true;
  c.free = true;
  c.window = {now_ns,
              BorrowEnd(plan, me, gpu, published, account.balance_ns < 0, others_idle, now_ns, config.borrow_ahead_ns)};
  c.whole_ns = c.window.length();
  return c;
}

// When a launch that finds no window now should look again: its own next window (after its debt), or the next
// change of owner on the GPU (a window there may be lent); for a member on one GPU in the window of an owner that
// waits too, soon (the owner may decline its rest: DeclinedUntil).
std::uint64_t NextChance(const WindowPlan& plan, std::size_t me, std::span<const Published> published,
                         const Candidate& c, int owner, std::uint64_t now_ns) {
  const std::uint64_t from = std::max(now_ns + 1, published[me].repaid_until_ns);
  const Interval next = plan.WindowAt(me, from);
  const std::uint64_t own_start = next.start_ns == kNoTime ? kNoTime : std::max(next.start_ns, from);
  std::uint64_t again_ns = std::min(own_start, std::max(now_ns + 1, c.owner_stretch.end_ns));
  if (owner >= 0 && owner != static_cast<int>(me) && published[owner].waiting > 0 && ChargesWhatRan(plan, me)) {
    again_ns = std::min(again_ns, now_ns + kDeclineLookNs);  // (only a member on one GPU takes a declined rest)
  }
  return again_ns;
}

// Whether the member whose window begins at `t_ns` on `gpu` is on that GPU only and has a launch waiting.
bool NextOnOneGpuWaits(const WindowPlan& plan, std::uint32_t gpu, std::span<const Published> published,
                       std::uint64_t t_ns) {
  const int next = plan.OwnerAt(gpu, t_ns);
  return next >= 0 && static_cast<std::size_t>(next) < published.size() && published[next].waiting > 0 &&
         ChargesWhatRan(plan, static_cast<std::size_t>(next));
}

// Whether the launch may go into the candidate window, by the account (free windows: it must fit).
bool Affordable(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
                const Candidate& c, const Account& account, std::uint64_t queued_end_ns, std::uint64_t estimate_ns,
                std::uint64_t now_ns) {
  const bool queue_empty = queued_end_ns <= now_ns;
  const std::uint64_t end_ns = std::max(now_ns, queued_end_ns) + estimate_ns;
  if (queue_empty && estimate_ns > c.whole_ns) return true;  // longer than the window: it can only overrun
  if (c.free) return end_ns <= c.window.end_ns;
  // The balance when it ends: window time gained by then, minus its queued work and itself.
  const std::int64_t least = -static_cast<std::int64_t>(estimate_ns / 2);
  const auto own_after =
      static_cast<std::int64_t>(plan.OwnTimeIn(me, now_ns, end_ns)) - static_cast<std::int64_t>(end_ns - now_ns);
  if (account.balance_ns + own_after < least) return false;
  // Credit carries the launch that straddles its window's end, not work queued behind it while the member whose
  // window comes next waits: that one would be kept out of its window by work its own credit cannot win back while
  // this member stays in credit (a 70 % loop of four matmuls and a synchronize, holding 50 ms of credit, queued a
  // whole burst at its window's end into the 30 % one's window, three cycles running, over fakecuda).
  // Between members on one GPU only: a member spanning GPUs keeps its ranks together with a step's work queued at
  // its window's end (the DDP job beside a neighbour fell to 0.41 of its step rate in the simulator with the rule),
  // and its neighbour then needs its credit's reach to win back what that work takes (over fakecuda it fell to 37 %
  // of its 50 in a second without it).
  const bool by_credit = std::min<std::int64_t>(account.balance_ns, 0) + own_after < least;
  return !(by_credit && !c.lent && queued_end_ns >= c.window.end_ns && ChargesWhatRan(plan, me) &&
           NextOnOneGpuWaits(plan, gpu, published, c.window.end_ns));
}

// What of one handover on `gpu` its members pay: the cycle's handovers (one per member spanning it) less the time
// nobody owns, which absorbs them, shared out per handover.
std::uint64_t UnabsorbedHandoverNs(const WindowPlan& plan, std::uint32_t gpu, std::uint64_t handover_ns) {
  std::uint64_t booked_ns = 0;
  std::uint64_t members = 0;
  for (std::size_t m = 0; m < plan.size(); ++m) {
    if (!Spans(plan.member(m), gpu)) continue;
    ++members;
    for (const Interval& piece : plan.pieces(m)) booked_ns += piece.length();
  }
  const std::uint64_t handovers_ns = members * handover_ns;
  const std::uint64_t unbooked_ns = plan.cycle_ns() > booked_ns ? plan.cycle_ns() - booked_ns : 0;
  if (unbooked_ns >= handovers_ns) return 0;
  return handover_ns * (handovers_ns - unbooked_ns) / handovers_ns;
}

}  // namespace

Release Decide(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, std::span<const Published> published,
               const Account& account, const TurnConfig& config, std::uint64_t queued_end_ns, std::uint64_t estimate_ns,
               std::uint64_t now_ns, bool peers_held, std::uint64_t arrived_ns) {
  if (me >= plan.size() || !Spans(plan.member(me), gpu) || published.size() < plan.size()) {
    return {now_ns, WaitReason::none, {now_ns, kNoTime}, false};  // not scheduled here: the driver's time-slicing
  }
  if (config.prompt_service && YieldsToACutIn(plan, me, gpu, published, now_ns, arrived_ns)) {
    // (It looks again at the cutter's completion too.)
    return {std::min(now_ns + kCutInLookNs, arrived_ns + plan.cycle_ns()), WaitReason::cut_in, {now_ns, now_ns}, false};
  }
  const bool woke = arrived_ns != kNoTime && queued_end_ns <= arrived_ns && arrived_ns - queued_end_ns >= kCutInIdleNs;
  const Candidate c = FindWindow(plan, me, gpu, published, account, config, estimate_ns, woke, now_ns);
  if (!c.found) {
    const int owner = plan.OwnerAt(gpu, now_ns);
    const bool in_debt = owner == static_cast<int>(me);
    return {NextChance(plan, me, published, c, owner, now_ns), in_debt ? WaitReason::debt : WaitReason::window,
            c.window, false};
  }
  if (peers_held || OthersHold(plan, me, gpu, published, plan.cycle_ns(), now_ns)) {
    return {kNoTime, WaitReason::others_work, c.window, c.free, c.cut_in ? now_ns + kCutInAskNs : 0};
  }
  if (c.cut_in) return {now_ns, WaitReason::none, c.window, false};  // (credit for all of it: FindPromptWindow)
  const bool may_be_cut =
      config.prompt_service && ChargesWhatRan(plan, me) && OtherMayCutIn(plan, me, gpu, published, now_ns);
  if (may_be_cut && queued_end_ns > now_ns + kPromptLeadNs) {
    return {queued_end_ns - kPromptLeadNs, WaitReason::lead, c.window, c.free};
  }
  if (Affordable(plan, me, gpu, published, c, account, queued_end_ns, estimate_ns, now_ns)) {
    return {now_ns, WaitReason::none, c.window, c.free, 0, may_be_cut};
  }
  // It looks again when the window it would have gone into is over. A free borrow slides with the time: it looks
  // again as soon as the borrow would reach the launch's expected end, or, for a launch longer than a borrow, when
  // its queue is expected to be empty.
  std::uint64_t again_ns = c.window.end_ns;
  if (c.free) {
    const std::uint64_t end_ns = std::max(now_ns, queued_end_ns) + estimate_ns;
    const std::uint64_t reach_ns = end_ns - std::min(end_ns, config.borrow_ahead_ns);
    again_ns = std::min(again_ns, std::max(now_ns + 1, std::min(reach_ns, queued_end_ns)));
  }
  return {again_ns, WaitReason::fit, c.window, c.free};
}

std::uint64_t DeclinedUntil(const WindowPlan& plan, std::size_t me, std::uint32_t gpu, const Release& release,
                            bool queue_empty, std::uint64_t now_ns) {
  if (release.reason != WaitReason::fit || release.free || !queue_empty || !ChargesWhatRan(plan, me)) return 0;
  if (plan.OwnerAt(gpu, now_ns) != static_cast<int>(me)) return 0;  // (another's window lent on credit: not its own)
  const std::uint64_t end_ns = plan.WindowAt(me, now_ns).end_ns;
  return end_ns > now_ns && end_ns != kNoTime ? end_ns : 0;
}

std::uint64_t HandoverCharge(const WindowPlan& plan, std::size_t me, std::uint32_t gpu,
                             std::span<const Published> published, const Release& release,
                             std::uint64_t& charged_window_ns, std::uint64_t handover_ns, std::uint64_t now_ns) {
  if (me >= plan.size() || release.free || release.at_ns > now_ns ||
      plan.OwnerAt(gpu, now_ns) != static_cast<int>(me)) {
    return 0;
  }
  const std::uint64_t start = plan.WindowAt(me, now_ns).start_ns;
  const std::uint64_t unabsorbed_ns = UnabsorbedHandoverNs(plan, gpu, handover_ns);
  if (start == charged_window_ns || unabsorbed_ns == 0) return 0;
  for (std::size_t m = 0; m < plan.size() && m < published.size(); ++m) {
    const std::uint64_t until = published[m].released_until_ns;
    if (m != me && until >= start && until != kNoTime) {
      charged_window_ns = start;
      return unabsorbed_ns;
    }
  }
  return 0;
}

std::uint64_t PackSiblingTurn(const SiblingTurn& turn) {
  const std::uint64_t end = (turn.end_ns + kSiblingGrainNs - 1) / kSiblingGrainNs;
  return (end << 13) | (static_cast<std::uint64_t>(turn.handed) << 12) |
         (static_cast<std::uint64_t>(turn.waiting) << 11) | std::min(turn.holder, kMaxSiblingHolder);
}

SiblingTurn UnpackSiblingTurn(std::uint64_t word) {
  return {static_cast<std::uint32_t>(word & kMaxSiblingHolder), ((word >> 11) & 1) != 0, ((word >> 12) & 1) != 0,
          (word >> 13) * kSiblingGrainNs};
}

SiblingStep DecideSibling(const SiblingTurn& seen, std::uint32_t self, std::uint64_t held_since_ns,
                          std::uint64_t subturn_ns, std::uint64_t end_after_ns, std::uint64_t now_ns, bool past_bound) {
  const SiblingTurn taken{self, false, false, std::max(end_after_ns, now_ns)};
  const bool mine = seen.holder == self;
  if (mine && !seen.handed) {
    if (seen.waiting && now_ns - std::min(now_ns, held_since_ns) >= subturn_ns && !past_bound) {
      SiblingTurn handed = seen;
      handed.waiting = false;
      handed.handed = true;
      return {false, std::max(seen.end_ns, now_ns) + kHandBackNs, handed, false};
    }
    SiblingTurn kept = seen;
    kept.end_ns = std::max(seen.end_ns, taken.end_ns);
    return {true, now_ns, kept, false};
  }
  const std::uint64_t free_at = mine ? seen.end_ns + kHandBackNs : seen.end_ns;
  if (seen.holder == 0 || now_ns >= free_at || past_bound) return {true, now_ns, taken, true};
  SiblingTurn waiting = seen;
  waiting.waiting = waiting.waiting || !mine;
  return {false, free_at, waiting, false};
}

std::uint64_t WorkEndWithMarginNs(std::uint64_t queued_end_ns, std::uint64_t now_ns) {
  constexpr std::uint64_t kMarginNs = 200'000;
  if (queued_end_ns <= now_ns) return queued_end_ns;
  return queued_end_ns + std::max(kMarginNs, (queued_end_ns - now_ns) / 10);
}

std::uint64_t UndrainedWorkEndNs(std::uint64_t published_end_ns, std::uint64_t now_ns) {
  if (published_end_ns >= now_ns + kUndrainedLeadNs / 2) return published_end_ns;
  return now_ns + kUndrainedLeadNs;
}

std::uint64_t EndAfterBlockingNs(std::uint64_t queued_end_ns, bool drained, std::uint64_t now_ns) {
  const std::uint64_t projected = WorkEndWithMarginNs(queued_end_ns, now_ns);
  return drained ? projected : UndrainedWorkEndNs(projected, now_ns);
}

bool ChargesWhatRan(const WindowPlan& plan, std::size_t me) {
  return me < plan.size() && std::popcount(plan.member(me).gpus) == 1;
}

bool KeepsOthersOffWhileUndrained(const WindowPlan& plan, std::size_t me) {
  if (!ChargesWhatRan(plan, me)) return false;
  for (std::size_t m = 0; m < plan.size(); ++m) {
    if (m != me && (plan.member(m).gpus & plan.member(me).gpus) != 0) return true;
  }
  return false;
}

std::uint64_t WhatRanChargeNs(const WindowPlan& plan, std::int64_t spent_since_ns, std::int64_t& carried_ns) {
  const auto cycle = static_cast<std::int64_t>(plan.cycle_ns());
  const std::int64_t charge_most = kWhatRanChargeCycles * cycle;
  const std::int64_t owed =
      std::clamp<std::int64_t>(spent_since_ns + carried_ns, -charge_most, charge_most + kWhatRanCarryCycles * cycle);
  const std::int64_t charge = std::clamp<std::int64_t>(owed, 0, charge_most);
  carried_ns = owed - charge;
  return static_cast<std::uint64_t>(charge);
}

std::uint64_t SubturnNs(const WindowPlan& plan, std::size_t me) {
  constexpr std::uint64_t kLeastNs = 2'000'000;
  if (me >= plan.size()) return kLeastNs;
  return std::max(kLeastNs, plan.cycle_ns() * plan.granted_permille(me) / 1000);
}

}  // namespace vgpu::policy
