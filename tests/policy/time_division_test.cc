// Time division (vgpu-core/policy/time_division.h): the windows of a cycle (placement, scaling, GPUs spanned), the
// time arithmetic over windows, and the release decision with its reasons, overruns, repayment and lending.
#include "vgpu/policy/time_division.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace vgpu::policy {
namespace {

constexpr std::uint64_t kMs = 1'000'000;
constexpr std::uint64_t kUs = 1'000;
constexpr std::uint64_t kCycle = 20 * kMs;

WindowPlan Plan(const std::vector<Member>& members, std::uint64_t cycle_ns = kCycle) {
  WindowPlan plan;
  EXPECT_EQ(plan.Build(members, cycle_ns), "");
  return plan;
}

void ExpectPieces(const WindowPlan& plan, std::size_t m, const std::vector<Interval>& expected) {
  const auto pieces = plan.pieces(m);
  ASSERT_EQ(pieces.size(), expected.size()) << "member " << m;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(pieces[i].start_ns, expected[i].start_ns) << "member " << m << " piece " << i;
    EXPECT_EQ(pieces[i].end_ns, expected[i].end_ns) << "member " << m << " piece " << i;
  }
}

// ---- the windows of a cycle ----------------------------------------------------------------------------------

TEST(WindowPlan, SharesOfOneGpuAreConsecutiveWindowsInIdOrder) {
  const WindowPlan plan =
      Plan({{.id = 2, .share_permille = 700, .gpus = 1}, {.id = 1, .share_permille = 300, .gpus = 1}});
  ExpectPieces(plan, 1, {{0, 6 * kMs}});  // id 1 first
  ExpectPieces(plan, 0, {{6 * kMs, 20 * kMs}});
  EXPECT_EQ(plan.granted_permille(0), 700u);
  EXPECT_EQ(plan.granted_permille(1), 300u);
  EXPECT_EQ(plan.IndexOf(1), 1);
  EXPECT_EQ(plan.IndexOf(3), -1);
}

TEST(WindowPlan, SharesThatSumPastTheGpuAreScaledDownTogether) {
  const WindowPlan plan =
      Plan({{.id = 1, .share_permille = 600, .gpus = 1}, {.id = 2, .share_permille = 600, .gpus = 1}});
  EXPECT_EQ(plan.granted_permille(0), 500u);
  EXPECT_EQ(plan.granted_permille(1), 500u);
}

TEST(WindowPlan, AJobSpanningGpusHasTheSameWindowsOnEachAndIsPlacedFirst) {
  const WindowPlan plan = Plan({{.id = 1, .share_permille = 400, .gpus = 0b01},
                                {.id = 2, .share_permille = 400, .gpus = 0b10},
                                {.id = 3, .share_permille = 600, .gpus = 0b11}});
  ExpectPieces(plan, 2, {{0, 12 * kMs}});
  ExpectPieces(plan, 0, {{12 * kMs, 20 * kMs}});
  ExpectPieces(plan, 1, {{12 * kMs, 20 * kMs}});
  EXPECT_EQ(plan.OwnerAt(0, 5 * kMs), 2);
  EXPECT_EQ(plan.OwnerAt(1, 5 * kMs), 2);
  EXPECT_EQ(plan.OwnerAt(1, 13 * kMs), 1);
}

TEST(WindowPlan, AMemberThatFitsNoFreeStretchWholeIsSplitIntoPiecesAlignedOnItsGpus) {
  // Spans of two GPUs each, placed by id: a [0, 4) on GPUs 0, 1; b [4, 8) on 1, 3; c [8, 12) on 0, 1. d spans 0
  // and 2 at 60 % (12 ms): free on GPU 0 is [4, 8) and [12, 20), on GPU 2 everything: no stretch holds 12 ms, so d
  // gets [4, 8) and [12, 20) on both of its GPUs.
  const WindowPlan plan = Plan({{.id = 1, .share_permille = 200, .gpus = 0b0011},
                                {.id = 2, .share_permille = 200, .gpus = 0b1010},
                                {.id = 3, .share_permille = 200, .gpus = 0b0011},
                                {.id = 4, .share_permille = 600, .gpus = 0b0101}});
  ExpectPieces(plan, 0, {{0, 4 * kMs}});
  ExpectPieces(plan, 1, {{4 * kMs, 8 * kMs}});
  ExpectPieces(plan, 2, {{8 * kMs, 12 * kMs}});
  ExpectPieces(plan, 3, {{4 * kMs, 8 * kMs}, {12 * kMs, 20 * kMs}});
  EXPECT_EQ(plan.OwnerAt(2, 5 * kMs), 3);
  EXPECT_EQ(plan.OwnerAt(2, 9 * kMs), -1);  // free on GPU 2
  EXPECT_EQ(plan.granted_permille(3), 600u);
}

TEST(WindowPlan, WhatIsFreeOnAllItsGpusBoundsWhatAMemberIsGranted) {
  // a [0, 6) on GPUs 0, 1; b [6, 12) on 1, 2; c on 0, 2 at 60 % finds only [12, 20) free on both: 8 ms, 40 %.
  const WindowPlan plan = Plan({{.id = 1, .share_permille = 300, .gpus = 0b011},
                                {.id = 2, .share_permille = 300, .gpus = 0b110},
                                {.id = 3, .share_permille = 600, .gpus = 0b101}});
  ExpectPieces(plan, 2, {{12 * kMs, 20 * kMs}});
  EXPECT_EQ(plan.granted_permille(2), 400u);
}

TEST(WindowPlan, BadInputIsRefusedNamingTheMemberTheValueAndWhatIsAccepted) {
  WindowPlan plan;
  EXPECT_EQ(plan.Build(std::vector<Member>{{.id = 7, .share_permille = 0, .gpus = 1}}, kCycle),
            "member 0 (id 7): share = 0 permille; accepted: 1 .. 1000");
  EXPECT_EQ(plan.Build(std::vector<Member>{{.id = 7, .share_permille = 1001, .gpus = 1}}, kCycle),
            "member 0 (id 7): share = 1001 permille; accepted: 1 .. 1000");
  EXPECT_EQ(plan.Build(std::vector<Member>{{.id = 7, .share_permille = 10, .gpus = 0}}, kCycle),
            "member 0 (id 7): gpus = 0; accepted: at least one GPU bit set");
  EXPECT_EQ(plan.Build(std::vector<Member>{{.id = 7, .share_permille = 10, .gpus = 1},
                                           {.id = 7, .share_permille = 10, .gpus = 1}},
                       kCycle),
            "member 1 (id 7): the same id as member 0");
  EXPECT_EQ(plan.Build(std::vector<Member>{}, 10), "cycle = 10 ns; accepted: 100000 .. 10000000000 (100 us .. 10 s)");
  std::vector<Member> many(kMaxMembers + 1);
  EXPECT_EQ(plan.Build(many, kCycle), "65 members; accepted: at most 64");
}

// ---- time over windows -----------------------------------------------------------------------------------------

TEST(WindowPlan, WindowAtFindsTheWindowHoldingATimeOrTheNextAndJoinsPiecesAcrossTheCycleEnd) {
  const WindowPlan plan =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 700, .gpus = 1}});
  Interval w = plan.WindowAt(0, 3 * kMs);
  EXPECT_EQ(w.start_ns, 0u);
  EXPECT_EQ(w.end_ns, 6 * kMs);
  w = plan.WindowAt(0, 6 * kMs);  // just past: the next cycle's
  EXPECT_EQ(w.start_ns, 20 * kMs);
  EXPECT_EQ(w.end_ns, 26 * kMs);
  w = plan.WindowAt(1, 41 * kMs);
  EXPECT_EQ(w.start_ns, 46 * kMs);
  EXPECT_EQ(w.end_ns, 60 * kMs);
  // Pieces [4, 8) and [12, 20) (the split member above): the one at the cycle's end is not joined to [4, 8).
  const WindowPlan split = Plan({{.id = 1, .share_permille = 200, .gpus = 0b0011},
                                 {.id = 2, .share_permille = 200, .gpus = 0b1010},
                                 {.id = 3, .share_permille = 200, .gpus = 0b0011},
                                 {.id = 4, .share_permille = 600, .gpus = 0b0101}});
  w = split.WindowAt(3, 9 * kMs);
  EXPECT_EQ(w.start_ns, 12 * kMs);
  EXPECT_EQ(w.end_ns, 20 * kMs);
  // Pieces [0, 4) and [16, 20): one window across each cycle's end. x [0, 4) on GPUs 1, 2; y [4, 16) on 0, 1; z on
  // 0, 3 finds [0, 4) and [16, 20) free on both.
  const WindowPlan wrap = Plan({{.id = 1, .share_permille = 200, .gpus = 0b0110},
                                {.id = 2, .share_permille = 600, .gpus = 0b0011},
                                {.id = 3, .share_permille = 400, .gpus = 0b1001}});
  ExpectPieces(wrap, 2, {{0, 4 * kMs}, {16 * kMs, 20 * kMs}});
  w = wrap.WindowAt(2, 18 * kMs);
  EXPECT_EQ(w.start_ns, 16 * kMs);
  EXPECT_EQ(w.end_ns, 24 * kMs);
  w = wrap.WindowAt(2, 21 * kMs);
  EXPECT_EQ(w.start_ns, 16 * kMs);
  EXPECT_EQ(w.end_ns, 24 * kMs);
  w = wrap.WindowAt(2, 10 * kMs);
  EXPECT_EQ(w.start_ns, 16 * kMs);
  EXPECT_EQ(wrap.OwnTimeIn(2, 10 * kMs, 30 * kMs), 8 * kMs);
  // A member alone at 100 %: its window holds any time, across cycle ends.
  const WindowPlan alone = Plan({{.id = 1, .share_permille = 1000, .gpus = 1}});
  w = alone.WindowAt(0, 25 * kMs);
  EXPECT_TRUE(w.contains(25 * kMs));
}

TEST(WindowPlan, AfterOwnTimeIsTheInverseOfOwnTimeIn) {
  const WindowPlan plan =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 700, .gpus = 1}});
  EXPECT_EQ(plan.OwnTimeIn(0, 0, 20 * kMs), 6 * kMs);
  EXPECT_EQ(plan.OwnTimeIn(0, 4 * kMs, 22 * kMs), 4 * kMs);
  EXPECT_EQ(plan.OwnTimeIn(1, 4 * kMs, 22 * kMs), 14 * kMs);
  EXPECT_EQ(plan.AfterOwnTime(0, 4 * kMs, 2 * kMs), 6 * kMs);  // exactly the window's end
  EXPECT_EQ(plan.AfterOwnTime(0, 4 * kMs, 3 * kMs), 21 * kMs);
  std::uint64_t seed = 12345;
  for (int i = 0; i < 2000; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    const std::uint64_t from = (seed >> 20) % (200 * kMs);
    const std::uint64_t amount = (seed >> 5) % (30 * kMs) + 1;
    for (std::size_t m = 0; m < 2; ++m) {
      const std::uint64_t t = plan.AfterOwnTime(m, from, amount);
      ASSERT_EQ(plan.OwnTimeIn(m, from, t), amount) << "member " << m << " from " << from << " amount " << amount;
      ASSERT_LT(plan.OwnTimeIn(m, from, t - 1), amount) << "not the first such instant";
    }
  }
}

// ---- the account ---------------------------------------------------------------------------------------------

TEST(Account, WindowTimeIsCreditRunTimeSpendsItAndCreditIsCappedAtFourCyclesWindows) {
  const WindowPlan plan =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 700, .gpus = 1}});
  Account account;
  Accrue(plan, 0, account, 4 * kMs);
  EXPECT_EQ(account.balance_ns, 4 * static_cast<std::int64_t>(kMs));
  EXPECT_EQ(Charge(plan, 0, account, 3 * kMs, 5 * kMs), 0u);  // 5 ms of window, 3 ran: 2 ms credit, no debt
  EXPECT_EQ(account.balance_ns, 2 * static_cast<std::int64_t>(kMs));
  Accrue(plan, 0, account, 200 * kMs);  // idle for ten cycles: credit stops at 4 x 6 ms
  EXPECT_EQ(account.balance_ns, 24 * static_cast<std::int64_t>(kMs));
  // A 38 ms kernel: 14 ms of debt, repaid by its windows' time: [200, 206) 6, [220, 226) 6, [240, 242) 2.
  EXPECT_EQ(Charge(plan, 0, account, 38 * kMs, 200 * kMs), 242 * kMs);
  EXPECT_EQ(account.balance_ns, -14 * static_cast<std::int64_t>(kMs));
  Accrue(plan, 0, account, 242 * kMs);
  EXPECT_EQ(account.balance_ns, 0);
}

TEST(CycleFor, DoublesUntilEveryWindowHoldsItsMembersLongestKernel) {
  const std::vector<Member> members{{.id = 1, .share_permille = 300, .gpus = 1},
                                    {.id = 2, .share_permille = 700, .gpus = 1}};
  EXPECT_EQ(CycleFor(members, std::vector<std::uint64_t>{kMs, kMs}, kCycle, 640 * kMs), kCycle);
  // 20 ms at 30 % needs 66.7 ms: 80.
  EXPECT_EQ(CycleFor(members, std::vector<std::uint64_t>{20 * kMs, 20 * kMs}, kCycle, 640 * kMs), 80 * kMs);
  EXPECT_EQ(CycleFor(members, std::vector<std::uint64_t>{900 * kMs, 0}, kCycle, 640 * kMs), 640 * kMs);
}

// Four busy containers on an H100 at 20 ms got 92 % of it together (a handover and the next one's start each time):
// the cycle is at least half the base per member on the GPU most members share.
TEST(CycleFor, GrowsWithTheMembersSharingOneGpu) {
  const std::vector<std::uint64_t> short_kernels(5, kMs);
  std::vector<Member> members;
  for (std::uint64_t id = 1; id <= 4; ++id) members.push_back({.id = id, .share_permille = 250, .gpus = 1});
  EXPECT_EQ(CycleFor(members, short_kernels, kCycle, 640 * kMs), 2 * kCycle) << "four on one GPU";
  members.push_back({.id = 5, .share_permille = 100, .gpus = 3});
  EXPECT_EQ(CycleFor(members, short_kernels, kCycle, 640 * kMs), 4 * kCycle) << "five: 50 ms, doubled to 80";
  EXPECT_EQ(CycleFor(members, short_kernels, kCycle, 30 * kMs), 30 * kMs) << "never past the bound";
  members.resize(2);
  EXPECT_EQ(CycleFor(members, short_kernels, kCycle, 640 * kMs), kCycle) << "two";
  std::vector<Member> spread;
  for (std::uint64_t id = 1; id <= 4; ++id)
    spread.push_back({.id = id, .share_permille = 500, .gpus = 1ull << (id % 2)});
  EXPECT_EQ(CycleFor(spread, short_kernels, kCycle, 640 * kMs), kCycle) << "two on each of two GPUs";
}

// ---- the release decision --------------------------------------------------------------------------------------

struct Pair {
  WindowPlan plan = Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 700, .gpus = 1}});
  std::vector<Published> published = std::vector<Published>(2);
  Account accounts[2];
  TurnConfig config;
  Release Decide(std::size_t me, std::uint64_t queued_end_ns, std::uint64_t estimate_ns, std::uint64_t now_ns) {
    Accrue(plan, me, accounts[me], now_ns);
    return policy::Decide(plan, me, 0, published, accounts[me], config, queued_end_ns, estimate_ns, now_ns);
  }
};

TEST(Decide, ALaunchGoesIfAtLeastHalfOfItIsExpectedInsideItsWindowElseAtTheNext) {
  Pair p;
  Release r = p.Decide(0, 0, kMs, kMs);
  EXPECT_EQ(r.at_ns, kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_FALSE(r.free);
  EXPECT_EQ(r.window.end_ns, 6 * kMs);
  // At 0, with queued work until 5.4 ms: a 1 ms kernel ends at 6.4, 0.4 ms past the window: it goes (repaid later).
  // (With prompt service, beside the idle b it would queue 2 ms ahead at most: PromptService tests.)
  Pair fresh;
  fresh.config.prompt_service = false;
  r = fresh.Decide(0, 5'400 * kUs, kMs, 0);
  EXPECT_EQ(r.reason, WaitReason::none);
  // Until 5.6 ms: 0.6 ms past, more than half of it: it waits, and looks again when the window is over.
  r = fresh.Decide(0, 5'600 * kUs, kMs, 0);
  EXPECT_EQ(r.reason, WaitReason::fit);
  EXPECT_EQ(r.at_ns, 6 * kMs);
  // Outside its window it waits for the next. (With prompt service, credit goes into an idle owner's window:
  // PromptService.CreditIsSpentInTheWindowOfAnOwnerWithNoWorkCharged.)
  p.config.prompt_service = false;
  r = p.Decide(0, 0, kMs, 7 * kMs);
  EXPECT_EQ(r.reason, WaitReason::window);
  EXPECT_EQ(r.at_ns, 20 * kMs);
}

TEST(Decide, CreditLetsAMemberRunPastItsWindowsEnd) {
  // At 2 ms, 2 ms of its own work queued and a 5 ms kernel: it would end at 9, 3 ms past its window.
  Pair p;
  p.accounts[0].as_of_ns = 2 * kMs;
  EXPECT_EQ(p.Decide(0, 4 * kMs, 5 * kMs, 2 * kMs).reason, WaitReason::fit);
  // With 3 ms of credit (it was held out of 3 ms of its windows before) it goes.
  p.accounts[0].balance_ns = 3 * static_cast<std::int64_t>(kMs);
  EXPECT_EQ(p.Decide(0, 4 * kMs, 5 * kMs, 2 * kMs).reason, WaitReason::none);
}

// Credit carries the launch that straddles the window's end, not work queued behind it while the next owner waits:
// a 70 % loop of four matmuls and a synchronize, holding 50 ms of credit, queued whole bursts at its window's end into
// the 30 % one's window, several cycles running, and the 30 % one got 27.4-27.8 % over fakecuda (26.7 % of an H200's
// time; docs/compute-sharing.md, "Loops that synchronize").
TEST(Decide, CreditDoesNotQueueWorkPastTheWindowsEndWhileTheNextOwnerWaits) {
  Pair p;  // b's window is [6, 20) ms, a's [0, 6) and [20, 26)
  p.accounts[1] = Account{50 * static_cast<std::int64_t>(kMs), 19 * kMs};
  // At 19 ms, 1.5 ms of b's work queued until 20.5 ms: a 1.5 ms kernel would start past its window's end.
  EXPECT_EQ(p.Decide(1, 20'500 * kUs, 1'500 * kUs, 19 * kMs).reason, WaitReason::none) << "nobody waits next";
  p.published[0].waiting = 1;
  const Release r = p.Decide(1, 20'500 * kUs, 1'500 * kUs, 19 * kMs);
  EXPECT_EQ(r.reason, WaitReason::fit) << "a waits for its window";
  EXPECT_EQ(r.at_ns, 20 * kMs);
  // The launch that straddles the end still goes on credit (it starts inside the window) ...
  EXPECT_EQ(p.Decide(1, 19'500 * kUs, 1'500 * kUs, 19 * kMs).reason, WaitReason::none);
  // ... and without credit what half a launch past the end allows, as before.
  p.accounts[1] = Account{0, 19 * kMs};
  EXPECT_EQ(p.Decide(1, 20'100 * kUs, 1'500 * kUs, 19 * kMs).reason, WaitReason::fit);
  // A member spanning GPUs keeps its credit's reach (its ranks' windows are aligned for their collectives), and so
  // does a member whose next neighbour spans GPUs (it wins back what that one's queued work takes).
  const WindowPlan spanning =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 700, .gpus = 3}});
  const std::size_t one = 0, two = 1;  // on GPU 0 only; on GPUs 0 and 1
  const auto at_end_of = [&](std::size_t me, std::size_t waiter) {
    std::vector<Published> published(2);
    published[waiter].waiting = 1;
    const Interval w = spanning.WindowAt(me, 0);
    EXPECT_EQ(spanning.OwnerAt(0, w.end_ns), static_cast<int>(waiter));
    const Account credit{50 * static_cast<std::int64_t>(kMs), w.end_ns - kMs};
    return policy::Decide(spanning, me, 0, published, credit, p.config, w.end_ns + 500 * kUs, 1'500 * kUs,
                          w.end_ns - kMs)
        .reason;
  };
  EXPECT_EQ(at_end_of(two, one), WaitReason::none) << "the member spanning GPUs";
  EXPECT_EQ(at_end_of(one, two), WaitReason::none) << "the member whose next neighbour spans GPUs";
}

// A launch that cannot fit what is left of its own window, nothing of its member's in flight, declines the rest
// (DeclinedUntil); the other member takes it, charged, instead of leaving the GPU idle.
TEST(Decide, TheRestOfAWindowItsOwnerDeclinesIsTakenByAnotherCharged) {
  Pair p;
  p.accounts[1] = Account{0, 18 * kMs};
  const Release refused = p.Decide(1, 0, 5 * kMs, 18 * kMs);  // 2 ms left of b's window, a 5 ms kernel, no credit
  ASSERT_EQ(refused.reason, WaitReason::fit);
  EXPECT_EQ(DeclinedUntil(p.plan, 1, 0, refused, true, 18 * kMs), 20 * kMs);
  EXPECT_EQ(DeclinedUntil(p.plan, 1, 0, refused, false, 18 * kMs), 0u) << "its work in flight may still use it";
  EXPECT_EQ(DeclinedUntil(p.plan, 1, 0, p.Decide(1, 0, kMs, 18 * kMs), true, 18 * kMs), 0u) << "a launch that goes";
  // a, waiting in b's window, looks again soon while b waits, and takes the declined rest, charged.
  p.accounts[0] = Account{0, 18 * kMs};
  Release r = p.Decide(0, 0, kMs, 18 * kMs);
  EXPECT_EQ(r.reason, WaitReason::window);
  EXPECT_EQ(r.at_ns, 20 * kMs);
  p.published[1].waiting = 1;
  r = p.Decide(0, 0, kMs, 18 * kMs);
  EXPECT_EQ(r.at_ns, 18 * kMs + kDeclineLookNs) << "b may decline";
  p.published[1].declined_until_ns = 20 * kMs;
  EXPECT_EQ(p.Decide(0, 0, kMs, 18 * kMs).reason, WaitReason::fit) << "charged: without credit, a 1 ms kernel there "
                                                                      "would leave a 1 ms in debt";
  EXPECT_EQ(p.Decide(0, 0, kMs, 19'500 * kUs).reason, WaitReason::none) << "half of it in a's own window";
  p.accounts[0] = Account{static_cast<std::int64_t>(kMs), 18 * kMs};
  r = p.Decide(0, 0, kMs, 18 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none) << "on credit";
  EXPECT_FALSE(r.free);
  EXPECT_EQ(r.window.end_ns, 20 * kMs);
  p.published[1].in_flight = 1;
  EXPECT_NE(p.Decide(0, 0, kMs, 18 * kMs).reason, WaitReason::none) << "not beside b's work";
  // Members spanning GPUs neither decline nor take declined rests.
  const WindowPlan spanning =
      Plan({{.id = 1, .share_permille = 300, .gpus = 3}, {.id = 2, .share_permille = 700, .gpus = 1}});
  EXPECT_EQ(DeclinedUntil(spanning, 0, 0, {kNoTime, WaitReason::fit, {0, 6 * kMs}, false}, true, 5 * kMs), 0u);
}

// A member alone at 30 %: 14 ms of each 20 ms cycle are nobody's. Under `force` it goes there only on credit (window
// time it held but did not use: a launch-bound process fills a fraction of its windows), charged, as far as the
// credit lasts; without credit it waits for its window. (Before: never, and x.add_ at 10 % got 2.0 % by NVML on an
// H100.)
TEST(Decide, CreditIsSpentInTimeNobodyOwns) {
  const WindowPlan plan = Plan({{.id = 1, .share_permille = 300, .gpus = 1}});
  const std::vector<Published> one(1);
  const TurnConfig force;
  Release r = policy::Decide(plan, 0, 0, one, Account{0, 10 * kMs}, force, 0, kMs, 10 * kMs);
  EXPECT_EQ(r.reason, WaitReason::window);
  EXPECT_EQ(r.at_ns, 20 * kMs);
  const Account credit{2 * static_cast<std::int64_t>(kMs), 10 * kMs};
  r = policy::Decide(plan, 0, 0, one, credit, force, 0, kMs, 10 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_FALSE(r.free);  // charged
  EXPECT_EQ(r.window.end_ns, 20 * kMs);
  // 2 ms of credit and 2 ms queued: a 1 ms kernel would leave -1 ms, more than half of it: it waits.
  r = policy::Decide(plan, 0, 0, one, credit, force, 12 * kMs, kMs, 10 * kMs);
  EXPECT_EQ(r.reason, WaitReason::fit);
}

TEST(Decide, AKernelLongerThanItsWindowGoesOnAnEmptyQueueIntoDebtAndItsWindowsAreLentMeanwhile) {
  Pair p;
  Release r = p.Decide(0, 0, 20 * kMs, kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  // Queued behind its own work it waits.
  r = p.Decide(0, 2 * kMs, 20 * kMs, kMs);
  EXPECT_EQ(r.reason, WaitReason::fit);
  // It ran [1, 21): charged 20 ms against its window time up to 21 ms (6 + 1 ms): 13 ms of debt.
  p.published[0].repaid_until_ns = Charge(p.plan, 0, p.accounts[0], 20 * kMs, 21 * kMs);
  EXPECT_EQ(p.published[0].repaid_until_ns, 62 * kMs);  // 5 ms of [21, 26), 6 of [40, 46), 2 of [60, 66)
  r = p.Decide(0, 0, kMs, 22 * kMs);
  EXPECT_EQ(r.reason, WaitReason::debt);
  EXPECT_EQ(r.at_ns, 26 * kMs);  // when the owner changes; its own window is usable again from 62 ms
  r = p.Decide(0, 0, kMs, 62 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_EQ(r.window.end_ns, 66 * kMs);
  // b, held out of [6, 20) by a's kernel, has 14 ms of credit to spend in a's lent windows.
  p.accounts[1].as_of_ns = 6 * kMs;
  r = p.Decide(1, 0, 2 * kMs, 41 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_FALSE(r.free);
  EXPECT_EQ(r.window.end_ns, 46 * kMs);
  // Without credit it may not.
  p.accounts[1] = Account{0, 46 * kMs};
  p.accounts[1].balance_ns = -1;
  r = policy::Decide(p.plan, 1, 0, p.published, p.accounts[1], p.config, 0, 2 * kMs, 41 * kMs);
  EXPECT_EQ(r.reason, WaitReason::window);
}

// The bound is one cycle after the end of the window the holder released into, not one of the waiter's windows: a
// holder with credit legitimately queues work past its window's end (a queue of long kernels), and a waiter that went
// beside it after its own window would time-slice with it (live over fakecuda, 30/70 with 20 ms kernels two deep:
// 24.8 / 65.2 % with the window bound, the estimates of both inflated by the overlaps).
TEST(Decide, OthersWorkInFlightHoldsALaunchForAtMostOneCycle) {
  Pair p;
  p.published[1].in_flight = 1;
  p.published[1].released_until_ns = 20 * kMs;  // b released into its window [6, 20) and its work is still running
  Release r = p.Decide(0, 0, kMs, 21 * kMs);
  EXPECT_EQ(r.reason, WaitReason::others_work);
  EXPECT_EQ(r.at_ns, kNoTime);
  r = p.Decide(0, 0, kMs, 26 * kMs - 1);
  EXPECT_EQ(r.reason, WaitReason::others_work);
  // b's work outlived its window by a whole cycle (20 ms): dead, stopped or lying; a goes.
  r = p.Decide(0, 0, kMs, 40 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_TRUE(OthersHold(p.plan, 0, 0, p.published, 6 * kMs, 21 * kMs));
  EXPECT_FALSE(OthersHold(p.plan, 0, 0, p.published, 6 * kMs, 40 * kMs));
  EXPECT_FALSE(OthersHold(p.plan, 1, 0, p.published, 6 * kMs, 21 * kMs)) << "its own work holds nothing";
  // b's work released into a window that ended at 14 ms: a's whole window [20, 26) later it still holds a (it is
  // within the cycle: a long queue of b's may still run), not beyond 34 ms.
  p.published[1].released_until_ns = 14 * kMs;
  EXPECT_EQ(p.Decide(0, 0, kMs, 21 * kMs).reason, WaitReason::others_work);
  EXPECT_EQ(p.Decide(0, 0, kMs, 41 * kMs).reason, WaitReason::none);
}

TEST(Decide, AMemberSpanningGpusWaitsWhileAnotherHoldsOneOfItsOtherGpus) {
  Pair p;
  // a's window on this GPU is free, but the caller found another member's work on a's other GPU (its rank there
  // could not start): a waits too, so that its ranks start together.
  Accrue(p.plan, 0, p.accounts[0], kMs);
  const Release r = policy::Decide(p.plan, 0, 0, p.published, p.accounts[0], p.config, 0, kMs, kMs, true);
  EXPECT_EQ(r.reason, WaitReason::others_work);
  EXPECT_EQ(r.at_ns, kNoTime);
}

TEST(Decide, DefaultBorrowsAnIdleOwnersWindowAFewMillisecondsAheadForFreeAndForceDoesNot) {
  Pair p;
  p.config.prompt_service = false;  // (with it, `force` spends credit there, charged: PromptService tests)
  Release r = p.Decide(0, 0, kMs, 10 * kMs);
  EXPECT_EQ(r.reason, WaitReason::window);
  p.config.borrow_idle = true;
  r = p.Decide(0, 0, kMs, 10 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_TRUE(r.free);
  EXPECT_EQ(r.window.end_ns, 12 * kMs);  // borrow_ahead_ns from now
  r = p.Decide(0, 12'500 * kUs, kMs, 11 * kMs);
  EXPECT_EQ(r.reason, WaitReason::fit);
  // The owner has work waiting: its window is not lent.
  p.published[1].waiting = 1;
  r = p.Decide(0, 0, kMs, 10 * kMs);
  EXPECT_EQ(r.reason, WaitReason::window);
  // Time nobody owns is lent too.
  const WindowPlan partial = Plan({{.id = 1, .share_permille = 300, .gpus = 1}});
  std::vector<Published> one(1);
  r = policy::Decide(partial, 0, 0, one, Account{}, p.config, 0, kMs, 10 * kMs);
  EXPECT_TRUE(r.free);
  EXPECT_EQ(r.reason, WaitReason::none);
}

// ---- prompt service (TurnConfig::prompt_service; docs/compute-sharing.md, "Prompt service") -------------------

// A light member (a 30 % one whose launches come now and then) whose launch arrives in the busy 70 % one's window,
// having been idle, asks to cut in: it waits for b's work in flight, publishing the ask, and goes as soon as b's
// work is done, charged. Without prompt service it waited for its own window, up to 14 ms of each 20.
TEST(PromptService, ALightMemberCutsInAtTheNextBoundaryOfTheOwnersWork) {
  Pair p;
  p.accounts[0] = Account{static_cast<std::int64_t>(6 * kMs), 7 * kMs};  // its last window unused: credit
  p.published[1].in_flight = 1;
  const auto decide = [&](std::uint64_t queued_end, std::uint64_t now, std::uint64_t arrived) {
    return policy::Decide(p.plan, 0, 0, p.published, p.accounts[0], p.config, queued_end, kMs, now, false, arrived);
  };
  Release r = decide(0, 7 * kMs, 7 * kMs);
  EXPECT_EQ(r.reason, WaitReason::others_work);
  EXPECT_EQ(r.cut_in_until_ns, 7 * kMs + kCutInAskNs);
  p.published[1].in_flight = 0;
  p.published[1].waiting = 1;  // b's next launch is held by the ask: its queue has drained
  r = decide(0, 8 * kMs, 7 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_FALSE(r.free) << "charged";
  EXPECT_EQ(r.cut_in_until_ns, 0u) << "going takes the ask back";
  // Not a launch that follows its own work at once (a loop that synchronizes), nor one without credit for it.
  p.published[1].in_flight = 1;
  EXPECT_EQ(decide(6'500 * kUs, 7 * kMs, 7 * kMs).cut_in_until_ns, 0u);
  EXPECT_EQ(decide(6'500 * kUs, 7 * kMs, 7 * kMs).reason, WaitReason::window);
  p.accounts[0].balance_ns = static_cast<std::int64_t>(kMs / 2);
  EXPECT_EQ(decide(0, 7 * kMs, 7 * kMs).reason, WaitReason::window);
  // Nor a member spanning GPUs (its windows are aligned for its collectives).
  const WindowPlan spanning =
      Plan({{.id = 1, .share_permille = 300, .gpus = 3}, {.id = 2, .share_permille = 700, .gpus = 1}});
  EXPECT_EQ(policy::Decide(spanning, 0, 0, p.published, Account{static_cast<std::int64_t>(6 * kMs), 7 * kMs}, p.config,
                           0, kMs, 7 * kMs, false, 7 * kMs)
                .cut_in_until_ns,
            0u);
}

// The owner of the window sees the ask and releases nothing while it lasts, looking again soon; for one cycle of a
// launch's wait at most, so that a member that asks and never launches (lying, or stopped) holds it as one that
// publishes work it does not have does.
TEST(PromptService, AnOwnerReleasesNothingWhileAnotherAsksToCutInForOneCycleOfALaunchAtMost) {
  Pair p;
  p.accounts[1] = Account{0, 7 * kMs};
  p.published[0].cut_in_until_ns = 9 * kMs;
  const auto decide = [&](std::uint64_t now, std::uint64_t arrived) {
    return policy::Decide(p.plan, 1, 0, p.published, p.accounts[1], p.config, 0, kMs, now, false, arrived);
  };
  Release r = decide(7 * kMs, 7 * kMs);
  EXPECT_EQ(r.reason, WaitReason::cut_in);
  EXPECT_EQ(r.at_ns, 7 * kMs + kCutInLookNs);
  EXPECT_EQ(decide(9 * kMs, 7 * kMs).reason, WaitReason::none) << "the ask ran out";
  p.published[0].cut_in_until_ns = 40 * kMs;  // renewed and renewed: a liar
  EXPECT_EQ(decide(26'900 * kUs, 7 * kMs).reason, WaitReason::cut_in);
  EXPECT_EQ(decide(27 * kMs, 7 * kMs).reason, WaitReason::none) << "a cycle of this launch's wait";
  p.config.prompt_service = false;
  EXPECT_EQ(decide(7 * kMs, 7 * kMs).reason, WaitReason::none);
}

// Beside a member that may cut in (on one GPU, idle), a member on one GPU queues at most kPromptLeadNs ahead of now,
// and asks again within that (the shim's lease), so that it sees an ask: with 64 launches queued the busy one kept a
// light one waiting as long as without prompt service (p99 15 ms in the simulator).
TEST(PromptService, BesideAnIdleMemberAMemberQueuesAtMostTheLeadAhead) {
  Pair p;
  p.accounts[1] = Account{0, 6 * kMs};
  Release r = p.Decide(1, 9 * kMs, kMs, 6 * kMs);  // 3 ms queued in its own window, a idle
  EXPECT_EQ(r.reason, WaitReason::lead);
  EXPECT_EQ(r.at_ns, 9 * kMs - kPromptLeadNs);
  r = p.Decide(1, 7'500 * kUs, kMs, 6 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_TRUE(r.ask_again_soon);
  p.published[0].work_end_ns = 5 * kMs;  // a's work ended 1 ms ago: a loop that synchronizes, between its bursts
  r = p.Decide(1, 9 * kMs, kMs, 6 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_FALSE(r.ask_again_soon);
  p.published[0].work_end_ns = 4 * kMs;  // 2 ms ago
  EXPECT_EQ(p.Decide(1, 9 * kMs, kMs, 6 * kMs).reason, WaitReason::lead);
  p.published[0].waiting = 1;  // a has work: it waits for its own window, it does not cut in
  r = p.Decide(1, 9 * kMs, kMs, 6 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_FALSE(r.ask_again_soon);
}

// Under `force` a member's credit (its window time it could not use) is spent in the window of an owner with no work,
// charged, up to borrow_ahead_ns ahead: the busy member whose window a light one cut into wins that time back in the
// light one's idle windows, and nobody runs past its share.
TEST(PromptService, CreditIsSpentInTheWindowOfAnOwnerWithNoWorkCharged) {
  Pair p;
  p.accounts[1] = Account{static_cast<std::int64_t>(kMs), 0};  // b, kept out 1 ms by a cut-in
  Release r = policy::Decide(p.plan, 1, 0, p.published, p.accounts[1], p.config, 0, kMs, 2 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_FALSE(r.free);
  EXPECT_EQ(r.window.end_ns, 2 * kMs + p.config.borrow_ahead_ns);
  p.published[0].waiting = 1;
  EXPECT_EQ(policy::Decide(p.plan, 1, 0, p.published, p.accounts[1], p.config, 0, kMs, 2 * kMs).reason,
            WaitReason::window)
      << "a's work came";
  p.published[0].waiting = 0;
  p.config.borrow_idle = true;  // `default`: that window is borrowed for free, its credit kept
  r = policy::Decide(p.plan, 1, 0, p.published, p.accounts[1], p.config, 0, kMs, 2 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_TRUE(r.free);
  p.config.borrow_idle = false;
  p.accounts[1].balance_ns = 0;
  EXPECT_EQ(policy::Decide(p.plan, 1, 0, p.published, p.accounts[1], p.config, 0, kMs, 2 * kMs).reason,
            WaitReason::window)
      << "no credit";
}

TEST(Decide, DefaultWithNobodyElseWantingTheGpuBorrowsAllOfItEvenItsOwnWindowInDebt) {
  Pair p;
  p.config.borrow_idle = true;
  p.accounts[0].balance_ns = -3 * static_cast<std::int64_t>(kMs);  // in debt, in its own window at 2 ms
  p.accounts[0].as_of_ns = 2 * kMs;
  Release r = policy::Decide(p.plan, 0, 0, p.published, p.accounts[0], p.config, 0, kMs, 2 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_TRUE(r.free);
  EXPECT_EQ(r.window.end_ns, 4 * kMs);
  // A free borrow slides: a launch that would end past it looks again when the borrow reaches its end...
  r = policy::Decide(p.plan, 0, 0, p.published, p.accounts[0], p.config, 3'500 * kUs, kMs, 2 * kMs);
  EXPECT_EQ(r.reason, WaitReason::fit);
  EXPECT_EQ(r.at_ns, 2'500 * kUs);
  // ... and one longer than a borrow when its queue is expected to be empty.
  r = policy::Decide(p.plan, 0, 0, p.published, p.accounts[0], p.config, 3'500 * kUs, 10 * kMs, 2 * kMs);
  EXPECT_EQ(r.reason, WaitReason::fit);
  EXPECT_EQ(r.at_ns, 3'500 * kUs);
  // Once b has work, a's window in debt is b's to borrow on credit, not a's; and a's free borrow in time nobody
  // owns stops where b's window begins.
  p.published[1].waiting = 1;
  r = policy::Decide(p.plan, 0, 0, p.published, p.accounts[0], p.config, 0, kMs, 2 * kMs);
  EXPECT_EQ(r.reason, WaitReason::debt);
  const WindowPlan gap =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 600, .gpus = 1}});
  // a [0, 6), b [6, 18), free [18, 20): a borrows at 19 up to 20 and on into its own window (not in debt).
  r = policy::Decide(gap, 0, 0, p.published, Account{}, p.config, 0, 1'500 * kUs, 19 * kMs);
  EXPECT_TRUE(r.free);
  EXPECT_EQ(r.window.end_ns, 21 * kMs);
  // At 17.5 (b's window, b waiting): nothing to borrow.
  r = policy::Decide(gap, 0, 0, p.published, Account{}, p.config, 0, kMs, 17'500 * kUs);
  EXPECT_EQ(r.reason, WaitReason::window);
}

TEST(Decide, AMemberNotScheduledOnTheGpuIsLeftToTheDriver) {
  Pair p;
  const Release r = policy::Decide(p.plan, 0, 5, p.published, Account{}, p.config, 0, kMs, 10 * kMs);
  EXPECT_EQ(r.reason, WaitReason::none);
  EXPECT_EQ(r.at_ns, 10 * kMs);
}

// ---- who pays for handovers ------------------------------------------------------------------------------------

TEST(HandoverCharge, AMemberPaysOneHandoverPerWindowWhenTheGpuComesFromAnothersWork) {
  // 30 / 70 books the whole cycle: two handovers of 160 us a cycle, nothing absorbs them.
  const WindowPlan plan =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 700, .gpus = 1}});
  std::vector<Published> published(2);
  published[1].released_until_ns = kCycle;  // member 1 released into its window ending where member 0's next begins
  const Release go{kCycle + 100 * kUs, WaitReason::none, {kCycle + 100 * kUs, kCycle + 6 * kMs}, false};
  std::uint64_t charged = kNoTime;
  EXPECT_EQ(HandoverCharge(plan, 0, 0, published, go, charged, 160 * kUs, kCycle + 100 * kUs), 160 * kUs);
  EXPECT_EQ(charged, kCycle);
  const Release later{kCycle + 2 * kMs, WaitReason::none, {kCycle + 2 * kMs, kCycle + 6 * kMs}, false};
  EXPECT_EQ(HandoverCharge(plan, 0, 0, published, later, charged, 160 * kUs, kCycle + 2 * kMs), 0u)
      << "once per window";
}

TEST(HandoverCharge, NothingIsChargedAfterAnIdleNeighbourOrOutsideTheMembersOwnWindow) {
  const WindowPlan plan =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 700, .gpus = 1}});
  std::vector<Published> published(2);
  published[1].released_until_ns = 6 * kMs;  // its latest work went into a window a whole cycle before
  std::uint64_t charged = kNoTime;
  const Release go{kCycle, WaitReason::none, {kCycle, kCycle + 6 * kMs}, false};
  EXPECT_EQ(HandoverCharge(plan, 0, 0, published, go, charged, 160 * kUs, kCycle), 0u);
  published[1].released_until_ns = kCycle;
  const Release lent{kCycle + 7 * kMs, WaitReason::none, {kCycle + 7 * kMs, kCycle + 8 * kMs}, false};
  EXPECT_EQ(HandoverCharge(plan, 0, 0, published, lent, charged, 160 * kUs, kCycle + 7 * kMs), 0u)
      << "a lent window is not the member's own";
  const Release free{kCycle, WaitReason::none, {kCycle, kCycle + 2 * kMs}, true};
  EXPECT_EQ(HandoverCharge(plan, 0, 0, published, free, charged, 160 * kUs, kCycle), 0u);
}

TEST(HandoverCharge, TimeNobodyOwnsAbsorbsHandoversFirst) {
  std::vector<Published> published(2);
  published[1].released_until_ns = kCycle;
  const Release go{kCycle, WaitReason::none, {kCycle, kCycle + 6 * kMs}, false};
  std::uint64_t charged = kNoTime;
  // 30 / 60: 2 ms nobody owns, more than the two handovers.
  const WindowPlan slack =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 600, .gpus = 1}});
  EXPECT_EQ(HandoverCharge(slack, 0, 0, published, go, charged, 160 * kUs, kCycle), 0u);
  // 30 / 69.8: 40 us nobody owns of the 320 us of handovers: each member pays 7/8 of one.
  const WindowPlan tight =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 698, .gpus = 1}});
  EXPECT_EQ(HandoverCharge(tight, 0, 0, published, go, charged, 160 * kUs, kCycle), 140 * kUs);
}

// ---- turns inside a container ----------------------------------------------------------------------------------

TEST(SiblingTurn, TheWordKeepsHolderBitsAndEndRoundedUpToItsGrain) {
  const SiblingTurn turn{.holder = 37, .waiting = true, .handed = false, .end_ns = 123 * kMs + 1};
  const SiblingTurn back = UnpackSiblingTurn(PackSiblingTurn(turn));
  EXPECT_EQ(back.holder, 37u);
  EXPECT_TRUE(back.waiting);
  EXPECT_FALSE(back.handed);
  EXPECT_EQ(back.end_ns, 123 * kMs + kSiblingGrainNs);  // never earlier than what was written
  EXPECT_EQ(UnpackSiblingTurn(0).holder, 0u);
  // An end half a century after boot still fits, and the largest holder.
  const std::uint64_t century = 50ull * 365 * 24 * 3600 * 1'000'000'000ull;
  const SiblingTurn last = UnpackSiblingTurn(PackSiblingTurn({.holder = kMaxSiblingHolder, .end_ns = century}));
  EXPECT_EQ(last.end_ns, century);
  EXPECT_EQ(last.holder, kMaxSiblingHolder);
  EXPECT_FALSE(last.waiting);
}

TEST(SiblingTurn, NobodyHoldingOrTheHoldersWorkDoneLetsAProcessTakeTheTurn) {
  const SiblingStep free = DecideSibling({}, 2, 0, 8 * kMs, 5 * kMs, 1 * kMs, false);
  EXPECT_TRUE(free.go);
  EXPECT_TRUE(free.took);
  EXPECT_EQ(free.write.holder, 2u);
  EXPECT_EQ(free.write.end_ns, 5 * kMs);
  const SiblingStep done = DecideSibling({.holder = 1, .end_ns = 3 * kMs}, 2, 0, 8 * kMs, 5 * kMs, 3 * kMs, false);
  EXPECT_TRUE(done.go);
  EXPECT_EQ(done.write.holder, 2u);
  EXPECT_FALSE(done.write.waiting);
}

TEST(SiblingTurn, ASiblingsWorkInFlightHoldsALaunchUntilItEndsAndTheWaitIsPublished) {
  const SiblingStep step = DecideSibling({.holder = 1, .end_ns = 4 * kMs}, 2, 0, 8 * kMs, 5 * kMs, 3 * kMs, false);
  EXPECT_FALSE(step.go);
  EXPECT_EQ(step.look_ns, 4 * kMs);
  EXPECT_EQ(step.write.holder, 1u);
  EXPECT_TRUE(step.write.waiting);
  EXPECT_EQ(step.write.end_ns, 4 * kMs);
  // Past the bound (a whole cycle waited: the holder dead, stopped or lying) it takes the turn anyway.
  EXPECT_TRUE(DecideSibling({.holder = 1, .end_ns = 900 * kMs}, 2, 0, 8 * kMs, 5 * kMs, 3 * kMs, true).go);
}

TEST(SiblingTurn, TheHolderKeepsTheTurnUntilASiblingWaitsAndItsSubturnIsOver) {
  const SiblingTurn held{.holder = 1, .end_ns = 4 * kMs};
  const SiblingStep alone = DecideSibling(held, 1, 0, 8 * kMs, 6 * kMs, 3 * kMs, false);
  EXPECT_TRUE(alone.go);
  EXPECT_FALSE(alone.took);
  EXPECT_EQ(alone.write.end_ns, 6 * kMs);  // its end moves with its queue
  SiblingTurn wanted = held;
  wanted.waiting = true;
  const SiblingStep early = DecideSibling(wanted, 1, 1 * kMs, 8 * kMs, 6 * kMs, 5 * kMs, false);
  EXPECT_TRUE(early.go) << "4 ms held of an 8 ms sub-turn";
  EXPECT_TRUE(early.write.waiting);
  const SiblingStep over = DecideSibling(wanted, 1, 1 * kMs, 8 * kMs, 6 * kMs, 9 * kMs, false);
  EXPECT_FALSE(over.go);
  EXPECT_TRUE(over.write.handed);
  EXPECT_FALSE(over.write.waiting);
  EXPECT_EQ(over.write.end_ns, 4 * kMs) << "what it released before still ends where it did";
}

TEST(SiblingTurn, AHolderThatHandedTheTurnOverTakesItBackOnlyIfNobodyDid) {
  const SiblingTurn handed{.holder = 1, .waiting = false, .handed = true, .end_ns = 10 * kMs};
  // The waiter takes it as soon as the work ends; the one that handed it over does not.
  EXPECT_TRUE(DecideSibling(handed, 2, 0, 8 * kMs, 12 * kMs, 10 * kMs, false).go);
  const SiblingStep self = DecideSibling(handed, 1, 0, 8 * kMs, 12 * kMs, 10 * kMs, false);
  EXPECT_FALSE(self.go);
  EXPECT_EQ(self.look_ns, 10 * kMs + kHandBackNs);
  EXPECT_FALSE(self.write.waiting) << "it does not wait for itself";
  EXPECT_TRUE(DecideSibling(handed, 1, 0, 8 * kMs, 12 * kMs, 10 * kMs + kHandBackNs, false).go);
}

// A process that sees its work still running (it waits for its turn and polls its streams, or sits in a
// synchronize call) keeps the end it published ahead of now, raising it only when less than half the lead is left.
TEST(SiblingTurn, WorkNotYetDrainedKeepsItsEndAheadOfNow) {
  constexpr std::uint64_t kNow = 50 * kMs;
  EXPECT_EQ(UndrainedWorkEndNs(kNow + 3 * kMs, kNow), kNow + 3 * kMs) << "the projection is ahead: kept";
  EXPECT_EQ(UndrainedWorkEndNs(kNow + kUndrainedLeadNs / 2, kNow), kNow + kUndrainedLeadNs / 2);
  EXPECT_EQ(UndrainedWorkEndNs(kNow + kUndrainedLeadNs / 2 - 1, kNow), kNow + kUndrainedLeadNs);
  EXPECT_EQ(UndrainedWorkEndNs(kNow - 7 * kMs, kNow), kNow + kUndrainedLeadNs) << "the projection passed";
  EXPECT_EQ(UndrainedWorkEndNs(0, kNow), kNow + kUndrainedLeadNs);
}

// When a synchronize call returns, the turn's end goes back to the projection (with its margin), not to now, even
// with the streams drained: the holder launches again at once (dropped to now, a sibling took the turn in between at
// every synchronize: 36.9-37.3 % of 40 for a two-process container on the H100). Work still running: 1 ms ahead.
TEST(SiblingTurn, AfterASynchronizeTheTurnsEndGoesBackToTheProjection) {
  constexpr std::uint64_t kNow = 50 * kMs;
  EXPECT_EQ(EndAfterBlockingNs(kNow + 3 * kMs, true, kNow), kNow + 3 * kMs + 300'000) << "the margin: a tenth";
  EXPECT_EQ(EndAfterBlockingNs(kNow + kMs, true, kNow), kNow + kMs + 200'000) << "the margin: at least 200 us";
  EXPECT_EQ(EndAfterBlockingNs(kNow - kMs, true, kNow), kNow - kMs) << "past: a sibling may take the turn";
  EXPECT_EQ(EndAfterBlockingNs(kNow - kMs, false, kNow), kNow + kUndrainedLeadNs) << "still running";
  EXPECT_EQ(EndAfterBlockingNs(kNow + 3 * kMs, false, kNow), kNow + 3 * kMs + 300'000);
}

// A member on one GPU is charged what ran, alone there or not; one spanning GPUs is not (a collective's measured runs
// hold its wait for the other ranks). Beside others it keeps them off while its work runs, so that its measured spans
// hold none of their time; alone there, or spanning GPUs, it does not.
TEST(WhatRan, AMemberOnOneGpuIsChargedWhatRanAndBesideOthersKeepsThemOffWhileItsWorkRuns) {
  const WindowPlan alone = Plan({{.id = 1, .share_permille = 300, .gpus = 1}});
  EXPECT_TRUE(ChargesWhatRan(alone, 0));
  EXPECT_FALSE(KeepsOthersOffWhileUndrained(alone, 0)) << "nobody to keep off";
  const WindowPlan apart =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 500, .gpus = 2}});
  for (std::size_t m = 0; m < 2; ++m) {
    EXPECT_TRUE(ChargesWhatRan(apart, m));
    EXPECT_FALSE(KeepsOthersOffWhileUndrained(apart, m)) << "a neighbour on another GPU does not count";
  }
  const WindowPlan beside =
      Plan({{.id = 1, .share_permille = 300, .gpus = 1}, {.id = 2, .share_permille = 500, .gpus = 1}});
  for (std::size_t m = 0; m < 2; ++m) {
    EXPECT_TRUE(ChargesWhatRan(beside, m));
    EXPECT_TRUE(KeepsOthersOffWhileUndrained(beside, m));
  }
  const WindowPlan job =
      Plan({{.id = 1, .share_permille = 500, .gpus = 3}, {.id = 2, .share_permille = 500, .gpus = 1}});
  EXPECT_FALSE(ChargesWhatRan(job, 0)) << "a job spanning two GPUs";
  EXPECT_FALSE(KeepsOthersOffWhileUndrained(job, 0)) << "a DDP rank waiting for its peers would hold its neighbour off";
  EXPECT_TRUE(KeepsOthersOffWhileUndrained(job, 1));
  EXPECT_FALSE(ChargesWhatRan(beside, 2)) << "not in the plan";
  EXPECT_FALSE(KeepsOthersOffWhileUndrained(beside, 2));
}

// A charge of what ran: what the accounting grew by, with what earlier charges carried; a give-back is carried to the
// next charges, and so is what one charge could not take: no more than two cycles at once (one settlement at an
// inflated mean charged 1.4 s at once over fakecuda and stalled the container 4.8 s), no more than four cycles more
// carried, and a give-back of two cycles at most.
TEST(WhatRan, AChargeOfWhatRanCarriesGiveBacksAndIsBoundedByTwoCycles) {
  const WindowPlan plan = Plan({{.id = 1, .share_permille = 300, .gpus = 1}});
  const auto cycle = static_cast<std::int64_t>(kCycle);
  std::int64_t carried = 0;
  EXPECT_EQ(WhatRanChargeNs(plan, 3 * kMs, carried), 3 * kMs);
  EXPECT_EQ(WhatRanChargeNs(plan, -2 * static_cast<std::int64_t>(kMs), carried), 0u);
  EXPECT_EQ(carried, -2 * static_cast<std::int64_t>(kMs));
  EXPECT_EQ(WhatRanChargeNs(plan, 500'000, carried), 0u) << "still owed back";
  EXPECT_EQ(carried, -1'500'000);
  EXPECT_EQ(WhatRanChargeNs(plan, 4 * kMs, carried), 2'500'000u);
  EXPECT_EQ(carried, 0);
  EXPECT_EQ(WhatRanChargeNs(plan, 1400 * kMs, carried), 2 * kCycle) << "bounded";
  EXPECT_EQ(carried, 4 * cycle) << "what lies past the bound is carried, up to four cycles";
  EXPECT_EQ(WhatRanChargeNs(plan, 0, carried), 2 * kCycle) << "and charged with the next charges";
  EXPECT_EQ(WhatRanChargeNs(plan, 0, carried), 2 * kCycle);
  EXPECT_EQ(carried, 0);
  EXPECT_EQ(WhatRanChargeNs(plan, 0, carried), 0u) << "nothing more than what ran";
  EXPECT_EQ(WhatRanChargeNs(plan, -1400 * static_cast<std::int64_t>(kMs), carried), 0u);
  EXPECT_EQ(carried, -2 * cycle) << "a give-back of two cycles at most";
}

// The loss that carrying mends: lumps of corrections a little over two cycles each (a window of 5 ms of estimates
// holding 46 ms of 2 ms runs, on a loaded host) are charged in full over the charges that follow, not cut at the bound.
TEST(WhatRan, LumpsPastTheBoundAreChargedInFullOverTheNextCharges) {
  const WindowPlan plan = Plan({{.id = 1, .share_permille = 300, .gpus = 1}});
  std::int64_t carried = 0;
  std::uint64_t charged = 0;
  std::int64_t spent = 0;
  for (int lump = 0; lump < 50; ++lump) {
    const std::int64_t grown = static_cast<std::int64_t>(2 * kCycle + 6 * kMs);  // the lump
    spent += grown;
    charged += WhatRanChargeNs(plan, grown, carried);
    for (int launch = 0; launch < 3; ++launch) {  // launches after it, charged what they ran (30 us each)
      spent += 30'000;
      charged += WhatRanChargeNs(plan, 30'000, carried);
    }
  }
  EXPECT_EQ(static_cast<std::int64_t>(charged) + carried, spent);
  EXPECT_EQ(carried, 0);
}

TEST(SiblingTurn, TheSubturnIsTheMembersWindowAndAtLeastTwoMilliseconds) {
  const WindowPlan plan =
      Plan({{.id = 1, .share_permille = 400, .gpus = 1}, {.id = 2, .share_permille = 50, .gpus = 1}});
  EXPECT_EQ(SubturnNs(plan, 0), 8 * kMs);
  EXPECT_EQ(SubturnNs(plan, 1), 2 * kMs);
}

}  // namespace
}  // namespace vgpu::policy
