// Processes under the shim SIGKILLed at random moments — while starting, attaching, creating their context,
// allocating and freeing, possibly inside the region's lock — hundreds of times: nobody deadlocks (survivors and
// newcomers complete alloc/free cycles within a deadline), no quota leaks (afterwards a newcomer gets the whole slice
// but its context), and the survivors keep working throughout.
#include <signal.h>

#include <memory>
#include <random>
#include <thread>

#include "shim_support.h"

namespace vgpu::shimtest {
namespace {

using EnvMap = std::map<std::string, std::optional<std::string>>;
using std::chrono::milliseconds;
using std::chrono::seconds;
using std::chrono::steady_clock;

EnvMap With(EnvMap env, const EnvMap& more) {
  for (const auto& [key, value] : more) env[key] = value;
  return env;
}

constexpr const char* kDevices = "h100-80gb:context=128Mi";
constexpr std::uint64_t kContextBytes = 128 * kMiB;

std::vector<std::string> ChurnArgs(std::uint64_t seed, std::uint64_t max_bytes) {
  return {"churn",  "threads=2",    "min=1048576", "max=" + std::to_string(max_bytes),
          "hold=2", "until_stop=1", "pipes=1",     "seed=" + std::to_string(seed)};
}

TEST(Kill, SigkilledProcessesNeitherDeadlockNorLeakQuota) {
  const std::uint64_t seed = Seed(7);
  std::mt19937_64 random(seed);
  const std::uint64_t limit = 2 * kGiB;
  const EnvMap env = With(ShimEnv("kill", "2Gi"), {{"FAKECUDA_DEVICES", kDevices}});
  const auto start = steady_clock::now();

  Child warm = RunWorker({"cycle", "bytes=1048576"}, env);
  ASSERT_EQ(warm.exit_code(), 0) << warm.Describe();

  // Two survivors churn for the whole test.
  Pipe survivors_started, survivors_done, survivors_go;
  std::vector<Child> survivors;
  for (int i = 0; i < 2; ++i) {
    survivors.push_back(Child::Worker(
        ChurnArgs(seed * 100 + static_cast<std::uint64_t>(i), 128 * kMiB), env,
        {{survivors_started.write_fd, kStartedFd}, {survivors_done.write_fd, kDoneFd}, {survivors_go.read_fd, kGoFd}}));
  }
  survivors_started.CloseWrite();
  survivors_done.CloseWrite();
  survivors_go.CloseRead();
  ASSERT_TRUE(survivors_started.ReadBytes(2, steady_clock::now() + seconds(10)));

  // Victims: four a round, each killed either at a random moment after its start (startup, attach, context) or at a
  // random moment after its threads began allocating.
  constexpr int kRounds = 100, kVictimsPerRound = 4, kNewcomerEvery = 10;
  int kills = 0, killed_while_churning = 0, newcomers = 0;
  Pipe victims_go;  // never written: a victim whose parent died stops at its EOF
  for (int round = 0; round < kRounds; ++round) {
    std::vector<Child> victims;
    std::vector<std::unique_ptr<Pipe>> started;
    Pipe victims_done;
    for (int v = 0; v < kVictimsPerRound; ++v) {
      started.push_back(std::make_unique<Pipe>());
      victims.push_back(Child::Worker(
          ChurnArgs(seed * 100000 + static_cast<std::uint64_t>(round * kVictimsPerRound + v) + 1000, 192 * kMiB), env,
          {{started.back()->write_fd, kStartedFd}, {victims_done.write_fd, kDoneFd}, {victims_go.read_fd, kGoFd}}));
      started.back()->CloseWrite();
    }
    for (int v = 0; v < kVictimsPerRound; ++v) {
      if (random() % 2 == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(random() % 30000));
      } else {
        const bool churning = started[v]->ReadBytes(1, steady_clock::now() + seconds(10));
        EXPECT_TRUE(churning) << "victim " << v << " of round " << round << " never started\n" << victims[v].Describe();
        std::this_thread::sleep_for(std::chrono::microseconds(random() % 20000));
        if (churning) ++killed_while_churning;
      }
      victims[v].Kill(SIGKILL);
      ++kills;
    }
    for (Child& victim : victims) {
      ASSERT_TRUE(victim.Wait(seconds(10)));
      // A victim must have been running until the kill: one that exited by itself met an error (exit 3: its context
      // waited out its deadline; 4: an error other than OOM).
      EXPECT_EQ(victim.term_signal(), SIGKILL) << victim.Describe();
    }
    if ((round + 1) % kNewcomerEvery == 0) {
      // A newcomer completes a cycle in bounded time while the survivors churn and the dead lie around.
      const auto begin = steady_clock::now();
      Child newcomer = RunWorker({"cycle", "bytes=1048576", "timeout_ms=10000"}, env, seconds(15));
      EXPECT_EQ(newcomer.exit_code(), 0) << "a newcomer could not complete a cycle after round " << round << "\n"
                                         << newcomer.Describe();
      std::printf("round %d: newcomer cycle in %.0f ms\n", round, MillisecondsSince(begin));
      ++newcomers;
    }
    for (Child& survivor : survivors) {
      ASSERT_FALSE(survivor.Poll()) << "a survivor died\n" << survivor.Describe();
    }
  }
  std::printf("%d kills (%d while allocating) in %.0f ms, %d newcomers\n", kills, killed_while_churning,
              MillisecondsSince(start), newcomers);
  EXPECT_GE(kills, 400);

  // The survivors stop, free what they hold and report: they kept working and no call of theirs hung.
  survivors_go.CloseWrite();
  for (Child& survivor : survivors) {
    ASSERT_TRUE(survivor.Wait(seconds(15))) << "a survivor did not stop: deadlocked?\n" << survivor.Describe();
    EXPECT_EQ(survivor.exit_code(), 0) << survivor.Describe();
    const auto values = survivor.Values();
    EXPECT_GT(Number(values, "ok"), 100u) << "a survivor hardly allocated\n" << survivor.Describe();
    EXPECT_EQ(Number(values, "errors"), 0u) << survivor.Describe();
    EXPECT_LT(Number(values, "max_call_us"), 5'000'000u) << "a call of a survivor took seconds";
  }

  // Everyone is dead: a newcomer gets the whole slice but its own context, to the byte, and no more.
  Child fill = RunWorker({"fill"}, env);
  ASSERT_EQ(fill.exit_code(), 0) << fill.Describe();
  const auto f = fill.Values();
  EXPECT_EQ(Number(f, "cu.total"), limit);
  EXPECT_EQ(Number(f, "cu.free"), limit - kContextBytes) << "quota leaked by the killed processes";
  EXPECT_EQ(f.at("fill.result"), "0") << fill.Describe();
  EXPECT_EQ(Number(f, "cu.free_after"), 0u);
  EXPECT_EQ(f.at("over.result"), std::to_string(CUDA_ERROR_OUT_OF_MEMORY));

  Child region = RunWorker({"views"}, env);
  EXPECT_EQ(Number(region.Values(), "nvml.0.v1.used"), 0u) << "the region still holds usage of dead processes";
  std::printf("total %.0f ms\n", MillisecondsSince(start));
}

}  // namespace
}  // namespace vgpu::shimtest
