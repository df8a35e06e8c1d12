// Region tests across many processes: racing creators, processes and threads hammering one limit under a
// watcher, SIGKILL at chosen and at random moments (inside the lock included), and fork while a thread reserves.
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "region_test_support.h"
#include "vgpu/region/region.h"

// Under ThreadSanitizer: stop at the first report. Children end with _exit, which skips the exit-time failure
// status, so a race seen in a child would otherwise only be printed. Unused in other builds.
extern "C" const char* __tsan_default_options() { return "halt_on_error=1"; }

namespace vgpu::region {
namespace {

using namespace std::chrono_literals;
using test::kNoLimit;
using test::kUuid;

constexpr int kKilled = 128 + SIGKILL;

std::unique_ptr<Attachment> MustOpen(const std::string& path) {
  std::string error;
  std::unique_ptr<Attachment> attachment(Attachment::Open(path, error));
  EXPECT_NE(attachment, nullptr) << error;
  return attachment;
}

// One random step of a workload near the limit: reserve a random size (up to `max_held` at once) or give one
// back. `held` is what this thread holds.
void RandomStep(Attachment& attachment, test::Random& random, std::vector<std::uint64_t>& held, std::size_t max_held,
                std::uint64_t max_bytes, std::uint64_t limit_bytes, std::atomic<std::uint64_t>* granted = nullptr,
                std::atomic<std::uint64_t>* refused = nullptr) {
  if (held.size() < max_held && (held.empty() || random.Below(2) == 0)) {
    const std::uint64_t bytes = 1 + random.Below(max_bytes);
    if (attachment.Reserve(0, bytes, limit_bytes)) {
      held.push_back(bytes);
      if (granted != nullptr) granted->fetch_add(1, std::memory_order_relaxed);
    } else if (refused != nullptr) {
      refused->fetch_add(1, std::memory_order_relaxed);
    }
  } else if (!held.empty()) {
    const std::size_t index = random.Below(held.size());
    attachment.Release(0, held[index]);
    held[index] = held.back();
    held.pop_back();
  }
}

// ---- creation race ---------------------------------------------------------------------------------------

struct RaceShared {
  std::atomic<int> slots[16];
};

TEST(RegionCreation, ProcessesRacingToCreateAllAttachToOneValidRegion) {
  constexpr int kProcesses = 16;
  constexpr int kRounds = 4;
  test::TempFolder folder;
  for (int round = 0; round < kRounds; ++round) {
    const std::string path = folder.File("region." + std::to_string(round));
    test::Shared<RaceShared> shared;
    ASSERT_TRUE(shared.ok());
    test::Pipe start, ready, finish;
    std::vector<pid_t> children;
    for (int k = 0; k < kProcesses; ++k) {
      children.push_back(test::Spawn([&, k] {
        start.CloseWrite();
        finish.CloseWrite();
        start.WaitForClose();  // all at once
        Attachment* attachment = test::OpenOrNull(path);
        CHILD_CHECK(attachment != nullptr, 1);
        const Region& region = attachment->region();
        CHILD_CHECK(region.magic == kRegionMagic && region.version == kRegionVersion, 2);
        CHILD_CHECK(region.region_bytes == sizeof(Region), 3);
        CHILD_CHECK(attachment->DeviceIndex(kUuid) == 0, 4);
        CHILD_CHECK(attachment->Reserve(0, 1, kNoLimit), 5);
        shared->slots[k].store(attachment->slot());
        CHILD_CHECK(write(ready.write_end, "r", 1) == 1, 6);
        finish.WaitForClose();
        return 0;  // exits holding its byte: the reaper returns it
      }));
    }
    start.CloseWrite();
    ASSERT_TRUE(ready.ReadBytes(kProcesses, 20s)) << "round " << round << ": not every racer attached";
    auto observer = MustOpen(path);
    ASSERT_NE(observer, nullptr);
    EXPECT_EQ(observer->Used(0), static_cast<std::uint64_t>(kProcesses)) << "all racers must share one file";
    EXPECT_EQ(observer->region().device_count, 1u);
    std::set<int> slots;
    for (int k = 0; k < kProcesses; ++k) slots.insert(shared->slots[k].load());
    EXPECT_EQ(slots.size(), static_cast<std::size_t>(kProcesses)) << "every racer has a slot of its own";
    finish.CloseWrite();
    for (pid_t child : children) EXPECT_EQ(test::WaitExit(child, 10s), 0);
    EXPECT_EQ(observer->ReapDead(true), static_cast<std::uint32_t>(kProcesses));
    EXPECT_EQ(observer->Used(0), 0u);
  }
  EXPECT_FALSE(test::AnyTemporaryLeft(folder.path()));
}

struct StormTimes {
  std::atomic<std::uint64_t> attach_ns[100];
};

TEST(RegionCreation, AStartupStormDoesNotSerializeOnAnythingSlow) {
  constexpr int kProcesses = 100;
  test::TempFolder folder;
  const std::string path = folder.File("region");
  test::Shared<StormTimes> times;
  ASSERT_TRUE(times.ok());
  test::Pipe start;
  std::vector<pid_t> children;
  for (int k = 0; k < kProcesses; ++k) {
    children.push_back(test::Spawn([&, k] {
      start.CloseWrite();
      start.WaitForClose();
      const auto begun = std::chrono::steady_clock::now();
      Attachment* attachment = test::OpenOrNull(path);
      const auto ended = std::chrono::steady_clock::now();
      CHILD_CHECK(attachment != nullptr, 1);
      CHILD_CHECK(attachment->Reserve(0, 1, kNoLimit), 2);
      times->attach_ns[k].store(
          static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(ended - begun).count()));
      return 0;
    }));
  }
  start.CloseWrite();
  for (pid_t child : children) EXPECT_EQ(test::WaitExit(child, 20s), 0);
  std::vector<std::uint64_t> attach_ns;
  for (int k = 0; k < kProcesses; ++k) attach_ns.push_back(times->attach_ns[k].load());
  std::sort(attach_ns.begin(), attach_ns.end());
  std::printf("[ figures  ] %d processes attaching at once: median %.0f us, slowest %.0f us\n", kProcesses,
              static_cast<double>(attach_ns[kProcesses / 2]) / 1e3, static_cast<double>(attach_ns.back()) / 1e3);
  // HAMi#1662 measured 0.3 s per process there; here the slowest of all should be far below that.
  EXPECT_LT(attach_ns.back(), 1'000'000'000u);
  auto observer = MustOpen(path);
  EXPECT_EQ(observer->Used(0), 0u) << "every racer exited; attach reaped them all";
}

// ---- concurrency -----------------------------------------------------------------------------------------

struct HammerShared {
  std::atomic<int> stop_watcher{0};
  std::atomic<std::uint64_t> samples{0};
  std::atomic<std::uint64_t> max_seen{0};
  std::atomic<std::uint64_t> above_limit{0};
  std::atomic<std::uint64_t> granted{0};
  std::atomic<std::uint64_t> refused{0};
};

TEST(RegionConcurrency, ProcessesAndThreadsHammeringOneLimitNeverPassIt) {
  constexpr int kProcesses = 8;
  constexpr int kThreads = 4;
  constexpr int kStepsPerThread = 20000;
  constexpr std::uint64_t kLimit = 64ull << 20;
  const std::uint64_t seed = test::Seed("ProcessesAndThreadsHammeringOneLimitNeverPassIt");
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto observer = MustOpen(path);
  ASSERT_NE(observer, nullptr);
  test::Shared<HammerShared> shared;
  ASSERT_TRUE(shared.ok());
  test::Pipe start;

  const pid_t watcher = test::Spawn([&] {
    start.CloseWrite();
    Attachment* attachment = test::OpenOrNull(path);
    CHILD_CHECK(attachment != nullptr, 1);
    start.WaitForClose();
    while (shared->stop_watcher.load() == 0) {
      const std::uint64_t used = attachment->Used(0);
      shared->samples.fetch_add(1, std::memory_order_relaxed);
      if (used > shared->max_seen.load(std::memory_order_relaxed)) shared->max_seen.store(used);
      if (used > kLimit) shared->above_limit.fetch_add(1);
    }
    return 0;
  });
  std::vector<pid_t> workers;
  for (int p = 0; p < kProcesses; ++p) {
    workers.push_back(test::Spawn([&, p] {
      start.CloseWrite();
      Attachment* attachment = test::OpenOrNull(path);
      CHILD_CHECK(attachment != nullptr, 1);
      start.WaitForClose();
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          test::Random random(seed + static_cast<std::uint64_t>(p * kThreads + t) * 0x9e3779b97f4a7c15ull);
          std::vector<std::uint64_t> held;
          for (int step = 0; step < kStepsPerThread; ++step) {
            // One process alone asks for about twice the limit (4 threads x 8 x kLimit/16 on average), so the
            // limit is pressed even when the scheduler runs the processes one after another.
            RandomStep(*attachment, random, held, 8, kLimit / 8, kLimit, &shared->granted, &shared->refused);
          }
          for (std::uint64_t bytes : held) attachment->Release(0, bytes);
        });
      }
      for (std::thread& thread : threads) thread.join();
      CHILD_CHECK(attachment->OwnUsed(0) == 0, 2);
      CHILD_CHECK(attachment->region().slots[attachment->slot()].peak_bytes[0] <= kLimit, 3);
      return 0;
    }));
  }
  start.CloseWrite();
  const auto started = std::chrono::steady_clock::now();
  for (pid_t worker : workers) EXPECT_EQ(test::WaitExit(worker, 60s), 0) << "a worker failed or hung";
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  shared->stop_watcher.store(1);
  EXPECT_EQ(test::WaitExit(watcher, 10s), 0);

  const std::uint64_t steps = static_cast<std::uint64_t>(kProcesses) * kThreads * kStepsPerThread;
  std::printf(
      "[ figures  ] %llu steps in %.2f s (%.2f us each); granted %llu, refused %llu; watcher: %llu samples, "
      "max %.1f%% of the limit\n",
      static_cast<unsigned long long>(steps), seconds, seconds * 1e6 / static_cast<double>(steps),
      static_cast<unsigned long long>(shared->granted.load()), static_cast<unsigned long long>(shared->refused.load()),
      static_cast<unsigned long long>(shared->samples.load()),
      100.0 * static_cast<double>(shared->max_seen.load()) / static_cast<double>(kLimit));
  EXPECT_EQ(shared->above_limit.load(), 0u) << "the watcher saw usage above the limit";
  EXPECT_LE(shared->max_seen.load(), kLimit);
  EXPECT_GT(shared->samples.load(), 100u);
  EXPECT_GT(shared->max_seen.load(), kLimit / 2) << "the workload should have pressed against the limit";
  EXPECT_GT(shared->refused.load(), 0u) << "the workload should have been refused at times";
  EXPECT_EQ(observer->Used(0), 0u);
  EXPECT_EQ(test::LiveSlotSum(observer->region(), 0), 0u);
}

// ---- death holding the lock, at every point where it matters ----------------------------------------------

class RegionOwnerDeath : public ::testing::TestWithParam<int> {};

TEST_P(RegionOwnerDeath, TheNextLockerRepairsAtOnceAndUsageIsExact) {
  using Peer = AttachmentTestPeer;
  constexpr std::uint64_t kLimit = 1000;
  const int point = GetParam();
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto survivor = MustOpen(path);
  ASSERT_NE(survivor, nullptr);
  ASSERT_TRUE(survivor->Reserve(0, 50, kLimit));
  if (point == Peer::kReapBetweenWrites) {
    // Someone for the victim to reap: exits holding 200.
    const pid_t dead = test::Spawn([&] {
      Attachment* attachment = test::OpenOrNull(path);
      CHILD_CHECK(attachment != nullptr, 1);
      CHILD_CHECK(attachment->Reserve(0, 200, kLimit), 2);
      return 0;
    });
    ASSERT_EQ(test::WaitExit(dead, 10s), 0);
  }
  test::Pipe stopped;
  const pid_t victim = test::Spawn([&] {
    if (point == Peer::kClaiming || point == Peer::kReapBetweenWrites) Peer::StopAt(point, stopped.write_end);
    Attachment* attachment = test::OpenOrNull(path);  // stops inside when claiming or reaping
    CHILD_CHECK(attachment != nullptr, 1);
    if (point == Peer::kReserveBetweenWrites) Peer::StopAt(point, stopped.write_end);
    CHILD_CHECK(attachment->Reserve(0, 300, kLimit), 2);
    if (point == Peer::kReleaseBetweenWrites) Peer::StopAt(point, stopped.write_end);
    attachment->Release(0, 100);
    return 3;  // should have stopped before this
  });
  ASSERT_TRUE(stopped.ReadBytes(1, 10s)) << "the victim never reached the point";
  ASSERT_GT(victim, 0);
  {
    // A monitor sees who holds the lock (the victim has one thread: its tid is its pid).
    Snapshot snapshot;
    std::string error;
    ASSERT_TRUE(ReadSnapshot(path, snapshot, error)) << error;
    EXPECT_EQ(snapshot.lock_holder_tid, victim);
    EXPECT_EQ(snapshot.lock_repairs, 0u);
  }
  test::KillChild(victim);
  ASSERT_EQ(test::WaitExit(victim, 10s), kKilled);

  // The lock's owner is dead. The next locker must get it at once, repair, and see exactly the living usage.
  const auto started = std::chrono::steady_clock::now();
  const pid_t checker = test::Spawn([&] {
    Attachment* attachment = test::OpenOrNull(path);
    CHILD_CHECK(attachment != nullptr, 1);
    CHILD_CHECK(attachment->Used(0) == 50, 2);
    CHILD_CHECK(test::LiveSlotSum(attachment->region(), 0) == 50, 3);
    for (const Slot& slot : attachment->region().slots) CHILD_CHECK(slot.state != SlotState::claiming, 4);
    CHILD_CHECK(test::LiveSlots(attachment->region()) == 2, 5);
    CHILD_CHECK(attachment->Reserve(0, kLimit - 50, kLimit), 6);
    CHILD_CHECK(!attachment->Reserve(0, 1, kLimit), 7);
    attachment->Release(0, kLimit - 50);
    return 0;
  });
  EXPECT_EQ(test::WaitExit(checker, 5s), 0) << "after the owner's death the lock was not recovered (deadlock?)";
  {
    // The repair is counted in the header, once: monitors (and the crash campaign) tell deaths inside the lock apart.
    Snapshot snapshot;
    std::string error;
    ASSERT_TRUE(ReadSnapshot(path, snapshot, error)) << error;
    EXPECT_EQ(snapshot.lock_repairs, 1u);
    EXPECT_EQ(snapshot.lock_holder_tid, 0) << "the lock is free again";
  }
  const double recovery_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
  std::printf("[ figures  ] attach + repair + checks after the owner's death: %.1f ms\n", recovery_ms);

  // The survivor keeps working.
  EXPECT_EQ(survivor->OwnUsed(0), 50u);
  EXPECT_TRUE(survivor->Reserve(0, kLimit - 50, kLimit));
  EXPECT_FALSE(survivor->Reserve(0, 1, kLimit));
  survivor->Release(0, kLimit - 50);
  survivor->ReapDead(true);
  EXPECT_EQ(survivor->Used(0), 50u);
  EXPECT_EQ(test::LiveSlots(survivor->region()), 1);
  EXPECT_EQ(test::LiveSlotSum(survivor->region(), 0), 50u);
}

INSTANTIATE_TEST_SUITE_P(EveryPoint, RegionOwnerDeath,
                         ::testing::Values(AttachmentTestPeer::kClaiming, AttachmentTestPeer::kReserveBetweenWrites,
                                           AttachmentTestPeer::kReleaseBetweenWrites,
                                           AttachmentTestPeer::kReapBetweenWrites),
                         [](const ::testing::TestParamInfo<int>& point_info) {
                           switch (point_info.param) {
                             case AttachmentTestPeer::kClaiming:
                               return std::string("Claiming");
                             case AttachmentTestPeer::kReserveBetweenWrites:
                               return std::string("ReserveBetweenWrites");
                             case AttachmentTestPeer::kReleaseBetweenWrites:
                               return std::string("ReleaseBetweenWrites");
                             default:
                               return std::string("ReapBetweenWrites");
                           }
                         });

// ---- hundreds of random kills ----------------------------------------------------------------------------

constexpr int kSurvivors = 2;
constexpr int kLanes = 4;

struct StormShared {
  std::atomic<int> stop{0};    // survivors: stop changing usage and report it
  std::atomic<int> resume{0};  // survivors: carry on, then give everything back and exit
  std::atomic<int> reported{0};
  std::atomic<std::uint64_t> own[kSurvivors];
  std::atomic<std::uint64_t> survivor_grants{0};
  std::atomic<int> stalled[kLanes];  // a victim is sleeping inside the lock
};

bool WaitUntil(const std::atomic<int>& flag, int value, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (flag.load() < value) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(200us);
  }
  return true;
}

constexpr std::uint64_t kStormLimit = 16ull << 20;

int Survivor(const std::string& path, std::uint64_t seed, int index, StormShared& shared) {
  Attachment* attachment = test::OpenOrNull(path);
  CHILD_CHECK(attachment != nullptr, 1);
  std::atomic<int> paused{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      test::Random random(seed + static_cast<std::uint64_t>(index * 2 + t + 1) * 0xbf58476d1ce4e5b9ull);
      std::vector<std::uint64_t> held;
      while (shared.stop.load() == 0) {
        RandomStep(*attachment, random, held, 4, kStormLimit / 16, kStormLimit, &shared.survivor_grants);
      }
      paused.fetch_add(1);
      if (!WaitUntil(shared.resume, 1, 30s)) failures.fetch_add(1);
      for (int step = 0; step < 300; ++step) {
        RandomStep(*attachment, random, held, 4, kStormLimit / 16, kStormLimit, &shared.survivor_grants);
      }
      for (std::uint64_t bytes : held) attachment->Release(0, bytes);
    });
  }
  const bool both_paused = WaitUntil(paused, 2, 30s);
  if (both_paused) {
    shared.own[index].store(attachment->OwnUsed(0));
    shared.reported.fetch_add(1);
  }
  for (std::thread& thread : threads) thread.join();
  CHILD_CHECK(both_paused, 2);
  CHILD_CHECK(failures.load() == 0, 3);
  CHILD_CHECK(attachment->OwnUsed(0) == 0, 4);
  return 0;
}

int Victim(const std::string& path, std::uint64_t seed, int lane, StormShared& shared) {
  test::Random random(seed);
  // Sleep inside the lock now and then, so that many kills land there.
  AttachmentTestPeer::StallRandomly(random.Next(), 25, 300, &shared.stalled[lane]);
  Attachment* attachment = test::OpenOrNull(path);
  CHILD_CHECK(attachment != nullptr, 1);
  std::vector<std::uint64_t> held;
  for (std::uint64_t step = 0;; ++step) {
    RandomStep(*attachment, random, held, 6, kStormLimit / 16, kStormLimit);
    if (step % 64 == 63) attachment->ReapDead(random.Below(2) == 0);
  }
}

TEST(RegionKill, HundredsOfRandomKillsLeaveExactUsageAndNoDeadlock) {
  constexpr int kKills = 300;
  const std::uint64_t seed = test::Seed("HundredsOfRandomKillsLeaveExactUsageAndNoDeadlock");
  test::Random random(seed);
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto observer = MustOpen(path);  // the test's own view: lock-free reads only until the checks below
  ASSERT_NE(observer, nullptr);
  test::Shared<StormShared> shared;
  ASSERT_TRUE(shared.ok());

  std::vector<pid_t> survivors;
  for (int s = 0; s < kSurvivors; ++s) {
    survivors.push_back(test::Spawn([&, s] { return Survivor(path, seed, s, *shared); }));
  }
  pid_t victims[kLanes];
  const auto spawn_victim = [&](int lane) {
    const std::uint64_t victim_seed = random.Next();
    victims[lane] = test::Spawn([&, lane, victim_seed] { return Victim(path, victim_seed, lane, *shared); });
  };
  for (int lane = 0; lane < kLanes; ++lane) spawn_victim(lane);

  int kills = 0;
  int kills_inside_lock = 0;
  std::uint64_t max_seen = 0;
  std::uint64_t above_limit = 0;
  int bad_exits = 0;
  const auto started = std::chrono::steady_clock::now();
  // Kill and replace until the last kLanes kills, which only kill.
  while (kills < kKills - kLanes) {
    const int lane = static_cast<int>(random.Below(kLanes));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(random.Below(3000));
    do {
      const std::uint64_t used = observer->Used(0);
      max_seen = std::max(max_seen, used);
      above_limit += used > kStormLimit ? 1 : 0;
      std::this_thread::sleep_for(50us);
    } while (std::chrono::steady_clock::now() < deadline);
    const bool inside_lock = shared->stalled[lane].load() != 0;
    test::KillChild(victims[lane]);
    const int status = test::WaitExit(victims[lane], 5s);
    if (status != kKilled) {
      ++bad_exits;
      ADD_FAILURE() << "victim " << victims[lane] << " ended with " << status << " instead of being killed";
    }
    shared->stalled[lane].store(0);
    ++kills;
    kills_inside_lock += inside_lock ? 1 : 0;
    spawn_victim(lane);
    if (bad_exits > 3) break;
  }
  for (int lane = 0; lane < kLanes; ++lane) {
    test::KillChild(victims[lane]);
    EXPECT_EQ(test::WaitExit(victims[lane], 5s), kKilled);
    ++kills;
  }
  const double storm_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  // Quiesce the survivors and compare the region with what they say they hold.
  shared->stop.store(1);
  ASSERT_TRUE(WaitUntil(shared->reported, kSurvivors, 20s))
      << "survivors did not pause: deadlock? " << test::DescribeLock(observer->region()) << "; "
      << test::DescribeThreads(survivors[0]) << "; " << test::DescribeThreads(survivors[1]);
  std::uint64_t survivors_hold = 0;
  for (int s = 0; s < kSurvivors; ++s) survivors_hold += shared->own[s].load();
  const pid_t checker = test::Spawn([&] {
    Attachment* attachment = test::OpenOrNull(path);  // reaps every dead victim
    CHILD_CHECK(attachment != nullptr, 1);
    CHILD_CHECK(attachment->Used(0) == survivors_hold, 2);
    CHILD_CHECK(test::LiveSlotSum(attachment->region(), 0) == survivors_hold, 3);
    CHILD_CHECK(test::LiveSlots(attachment->region()) == kSurvivors + 2, 4);  // + the observer, + us
    return 0;
  });
  EXPECT_EQ(test::WaitExit(checker, 5s), 0) << "usage after the storm is not what the survivors hold, or deadlock";
  EXPECT_EQ(observer->Used(0), survivors_hold);

  // The survivors carry on, then give everything back.
  shared->resume.store(1);
  for (pid_t survivor : survivors) EXPECT_EQ(test::WaitExit(survivor, 20s), 0) << "a survivor failed or hung";
  EXPECT_EQ(observer->Used(0), 0u);
  observer->ReapDead(true);
  EXPECT_EQ(test::LiveSlots(observer->region()), 1);
  EXPECT_EQ(observer->Used(0), 0u);

  std::printf(
      "[ figures  ] %d kills in %.2f s, %d inside the lock; survivors got %llu grants; max usage seen "
      "%.1f%% of the limit\n",
      kills, storm_s, kills_inside_lock, static_cast<unsigned long long>(shared->survivor_grants.load()),
      100.0 * static_cast<double>(max_seen) / static_cast<double>(kStormLimit));
  EXPECT_EQ(above_limit, 0u);
  EXPECT_GE(kills, kKills);
  EXPECT_GT(kills_inside_lock, 0) << "no kill landed inside the lock: the test lost its point";
  EXPECT_GT(shared->survivor_grants.load(), 0u);
  // Every kill seen inside the lock was repaired, and counted, by the next locker (more kills may have landed there
  // outside the stalls).
  Snapshot snapshot;
  std::string error;
  ASSERT_TRUE(ReadSnapshot(path, snapshot, error)) << error;
  EXPECT_GE(snapshot.lock_repairs, static_cast<std::uint32_t>(kills_inside_lock));
  EXPECT_LE(snapshot.lock_repairs, static_cast<std::uint32_t>(kills));
  std::printf("[ figures  ] lock repairs counted in the region: %u\n", snapshot.lock_repairs);
}

// ---- fork ------------------------------------------------------------------------------------------------

// What the shim's pthread_atfork child handler does.
std::atomic<Attachment*> g_fork_attachment{nullptr};
void ForgetInForkChild() {
  if (Attachment* attachment = g_fork_attachment.load(); attachment != nullptr) attachment->ForgetAfterFork();
}

TEST(RegionFork, ChildrenGetSlotsOfTheirOwnWhileAParentThreadKeepsReserving) {
  constexpr int kForks = 30;
  constexpr std::uint64_t kLimit = 1 << 20;
  static std::once_flag registered;
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, &ForgetInForkChild); });
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto parent = MustOpen(path);
  ASSERT_NE(parent, nullptr);
  ASSERT_TRUE(parent->Reserve(0, 100, kLimit));
  const int parent_slot = parent->slot();
  g_fork_attachment.store(parent.get());

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> pairs{0};
  std::thread reserver([&] {
    while (!stop.load()) {
      if (parent->Reserve(0, 1, kLimit)) {
        parent->Release(0, 1);
        pairs.fetch_add(1);
      }
    }
  });
  for (int i = 0; i < kForks; ++i) {
    const pid_t child = test::Spawn([&, i] {
      // The atfork handler ran: the parent's slot is not ours.
      CHILD_CHECK(parent->slot() == -1, 1);
      CHILD_CHECK(parent->OwnUsed(0) == 0, 2);
      CHILD_CHECK(parent->Reserve(0, 50, kLimit), 3);
      CHILD_CHECK(parent->slot() >= 0 && parent->slot() != parent_slot, 4);
      CHILD_CHECK(parent->OwnUsed(0) == 50, 5);
      parent->ReapDead(true);  // earlier children that exited holding 50
      const std::uint64_t used = parent->Used(0);
      CHILD_CHECK(used == 150 || used == 151, 6);  // the parent's 100 (+1 in flight) and our 50
      if (i % 2 == 0) {
        parent->Release(0, 50);
        CHILD_CHECK(parent->OwnUsed(0) == 0, 7);
      }
      return 0;
    });
    EXPECT_EQ(test::WaitExit(child, 10s), 0) << "fork child " << i;
  }
  stop.store(true);
  reserver.join();
  g_fork_attachment.store(nullptr);
  EXPECT_GT(pairs.load(), 0u);
  EXPECT_EQ(parent->slot(), parent_slot);
  EXPECT_EQ(parent->OwnUsed(0), 100u);
  parent->ReapDead(true);
  EXPECT_EQ(parent->Used(0), 100u);
  EXPECT_EQ(test::LiveSlots(parent->region()), 1);
}

TEST(RegionFork, AChildThatForgetsDoesNotKeepTheParentAlive) {
  test::TempFolder folder;
  const std::string path = folder.File("region");
  auto observer = MustOpen(path);
  ASSERT_NE(observer, nullptr);
  for (const bool forget : {true, false}) {
    test::Pipe ready, release;
    const pid_t parent = test::Spawn([&] {
      release.CloseWrite();
      Attachment* attachment = test::OpenOrNull(path);
      CHILD_CHECK(attachment != nullptr, 1);
      CHILD_CHECK(attachment->Reserve(0, 300, kNoLimit), 2);
      std::fflush(nullptr);
      if (fork() == 0) {
        if (forget) attachment->ForgetAfterFork();
        const bool written = write(ready.write_end, "g", 1) == 1;
        release.WaitForClose();
        _exit(written ? 0 : 1);
      }
      return 0;  // the parent dies holding 300; its child lives on
    });
    release.CloseRead();
    ASSERT_EQ(test::WaitExit(parent, 10s), 0);
    ASSERT_TRUE(ready.ReadBytes(1, 10s));
    observer->ReapDead(true);
    if (forget) {
      EXPECT_EQ(observer->Used(0), 0u) << "the child closed the parent's description: the parent is reaped";
    } else {
      EXPECT_EQ(observer->Used(0), 300u) << "without ForgetAfterFork the child keeps the parent's lock alive";
    }
    release.CloseWrite();  // the grandchild exits; it is not ours to wait for, so poll
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (observer->Used(0) != 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
      observer->ReapDead(true);
    }
    EXPECT_EQ(observer->Used(0), 0u);
  }
}

}  // namespace
}  // namespace vgpu::region
