// Time division's failure story over fakecuda (docs/compute-sharing.md, "Failure story"; docs/threat-model.md,
// "Time division"): a container whose process is stopped (SIGSTOP) or killed (SIGKILL) while it holds the GPU, and
// a process without the shim on the same GPU. Each case starts vgpu-tenant processes itself (the runner has no
// SIGSTOP), each its own container (region), all sharing one schedule file, and reads their progress reports.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

const std::string kBuild = VGPU_TEST_INSTALL_DIR;
constexpr std::uint64_t kMs = 1'000'000;

std::uint64_t NowNs() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

// A vgpu-tenant process: its pid and the file its stdout goes to.
struct Tenant {
  pid_t pid = -1;
  std::string out;
};

class TimeDivisionFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* piece : {"/bin/vgpu-tenant", "/lib/libvgpu.so", "/lib/libcuda.so.1"}) {
      if (access((kBuild + piece).c_str(), F_OK) != 0) GTEST_SKIP() << kBuild + piece << " is not built";
    }
    folder_ =
        std::filesystem::temp_directory_path() / ("vgpu-td-faults-" + std::to_string(getpid()) + "-" +
                                                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(folder_);
    std::filesystem::create_directories(folder_);
  }
  void TearDown() override {
    for (Tenant& t : tenants_) {
      if (t.pid > 0) {
        kill(t.pid, SIGKILL);
        waitpid(t.pid, nullptr, 0);
      }
    }
    std::filesystem::remove_all(folder_);
  }

  // Starts a process running 1 ms kernels for `seconds`, capped at `cores` % under time division (0: no shim at
  // all), in a container of its own unless `container` names one (its region). `wrapper`: a command line
  // vgpu-tenant is run under (its path first).
  Tenant& Start(const std::string& name, int cores, int seconds, const std::vector<std::string>& extra = {},
                const std::vector<std::string>& wrapper = {}, const std::string& container = "") {
    std::vector<std::string> env = {
        "LD_LIBRARY_PATH=" + kBuild + "/lib",
        "FAKECUDA_STATE=" + (folder_ / "machine").string(),
        "FAKECUDA_DEVICES=h100-80gb",
        "FAKECUDA_TIMESLICE_US=2100",
        "FAKECUDA_SWITCH_US=160",
    };
    if (const char* preload = getenv("LD_PRELOAD"); preload != nullptr && *preload != '\0') {
      env.push_back(std::string("LD_PRELOAD=") + preload + (cores > 0 ? ":" + kBuild + "/lib/libvgpu.so" : ""));
    } else if (cores > 0) {
      env.push_back("LD_PRELOAD=" + kBuild + "/lib/libvgpu.so");
    }
    if (cores > 0) {
      env.push_back("CUDA_DEVICE_SM_LIMIT=" + std::to_string(cores));
      env.push_back("GPU_CORE_UTILIZATION_POLICY=force");
      env.push_back("VGPU_COMPUTE_SHARING=time-division");
      env.push_back("VGPU_SCHEDULE_FILE=" + (folder_ / "schedule").string());
      env.push_back("CUDA_DEVICE_MEMORY_SHARED_CACHE=" +
                    (folder_ / ((container.empty() ? name : container) + ".region")).string());
    }
    env.insert(env.end(), extra.begin(), extra.end());
    std::vector<std::string> argv = wrapper;
    for (const std::string& a :
         {kBuild + "/bin/vgpu-tenant", std::string("--kernel-us"), std::string("1000"), std::string("--seconds"),
          std::to_string(seconds), std::string("--report-ms"), std::string("100")}) {
      argv.push_back(a);
    }
    Tenant tenant;
    tenant.out = (folder_ / (name + ".out")).string();
    tenant.pid = fork();
    if (tenant.pid == 0) {
      const int fd = open(tenant.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      const int err = open((tenant.out + ".err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(err, 2);
      std::vector<char*> args, envp;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
      args.push_back(nullptr);
      envp.push_back(nullptr);
      execve(args[0], args.data(), envp.data());
      _exit(127);
    }
    tenants_.push_back(tenant);
    return tenants_.back();
  }

  // Waits for the tenant; `killed`: it was SIGKILLed, else it must end cleanly (status 0: no sanitizer report). One
  // that has not ended after 40 s (its runs are a few seconds; the test's own timeout is 60) is killed: a failure,
  // not a hung test.
  static void Wait(Tenant& t, bool killed = false) {
    int status = 0;
    const std::uint64_t deadline = NowNs() + 40'000 * kMs;
    while (waitpid(t.pid, &status, WNOHANG) == 0) {
      if (NowNs() > deadline) {
        ADD_FAILURE() << t.out << ": still running after 40 s; killed";
        kill(t.pid, SIGKILL);
        waitpid(t.pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    t.pid = -1;
    if (!killed) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << t.out << ": status " << status;
    }
  }

  // The tenant's busy share of [from_ns, to_ns) (its CLOCK_MONOTONIC), from its progress reports, in percent.
  static double Share(const Tenant& t, std::uint64_t from_ns, std::uint64_t to_ns) {
    std::ifstream in(t.out);
    std::string line;
    std::uint64_t busy_from = 0, busy_to = 0, at_from = 0, at_to = 0;
    while (std::getline(in, line)) {
      unsigned long long t_ns = 0, kernels = 0, busy_ns = 0;
      if (std::sscanf(line.c_str(), "{\"ev\":\"report\",\"t_ns\":%llu,\"kernels\":%llu,\"busy_ns\":%llu", &t_ns,
                      &kernels, &busy_ns) != 3) {
        continue;
      }
      if (t_ns <= from_ns) at_from = t_ns, busy_from = busy_ns;
      if (t_ns <= to_ns) at_to = t_ns, busy_to = busy_ns;
    }
    if (at_to <= at_from) return -1;
    return 100.0 * static_cast<double>(busy_to - busy_from) / static_cast<double>(at_to - at_from);
  }

  std::filesystem::path folder_;
  std::deque<Tenant> tenants_;  // (a deque: Start's references stay valid)
};

// Shares are judged in the default build; under a sanitizer the runs check that every process ends cleanly (the shim
// is several times slower on the host there: tests/runner/runner_test.cc, kJudgeShares).
constexpr bool kJudgeShares = !VGPU_TEST_SANITIZED;

void SleepUntil(std::uint64_t t_ns) {
  const std::uint64_t now = NowNs();
  if (t_ns > now) std::this_thread::sleep_for(std::chrono::nanoseconds(t_ns - now));
}

// A container stopped (SIGSTOP) in the middle of its work, holding the GPU or about to: the other keeps its windows
// (its own cap: `force` borrows nothing) while it is stopped, and the stopped one gets its share back once continued.
TEST_F(TimeDivisionFaults, AStoppedContainerCostsTheOtherNothingBeyondOneCycle) {
  Tenant& a = Start("a", 50, 6);
  Tenant& b = Start("b", 50, 6);
  const std::uint64_t t0 = NowNs();
  SleepUntil(t0 + 1500 * kMs);
  ASSERT_EQ(kill(b.pid, SIGSTOP), 0);
  SleepUntil(t0 + 3500 * kMs);
  ASSERT_EQ(kill(b.pid, SIGCONT), 0);
  Wait(a);
  Wait(b);
  const double a_stopped = Share(a, t0 + 1600 * kMs, t0 + 3400 * kMs);
  const double b_after = Share(b, t0 + 4500 * kMs, t0 + 5800 * kMs);
  const double a_after = Share(a, t0 + 4500 * kMs, t0 + 5800 * kMs);
  std::printf("a while b is stopped: %.1f %%; after: a %.1f %%, b %.1f %%\n", a_stopped, a_after, b_after);
  if (!kJudgeShares) return;
  EXPECT_NEAR(a_stopped, 50, 3);
  EXPECT_NEAR(a_after, 50, 3);
  EXPECT_NEAR(b_after, 50, 3);
}

// A container of two processes, one of them stopped (SIGSTOP), then continued, then killed (SIGKILL), holding the
// container's turn on the GPU or about to (they take turns inside its windows: policy::DecideSibling): the sibling
// waits for it at most one cycle per launch, and keeps the container's share; the other container keeps its own.
TEST_F(TimeDivisionFaults, AStoppedOrKilledProcessCostsItsSiblingNothingBeyondOneCycle) {
  Tenant& a = Start("a", 50, 6);
  Tenant& b1 = Start("b1", 50, 6, {}, {}, "b");
  Tenant& b2 = Start("b2", 50, 6, {}, {}, "b");
  const std::uint64_t t0 = NowNs();
  SleepUntil(t0 + 1500 * kMs);
  ASSERT_EQ(kill(b1.pid, SIGSTOP), 0);
  SleepUntil(t0 + 3000 * kMs);
  ASSERT_EQ(kill(b1.pid, SIGCONT), 0);
  SleepUntil(t0 + 3500 * kMs);
  ASSERT_EQ(kill(b1.pid, SIGKILL), 0);
  Wait(b1, true);
  Wait(a);
  Wait(b2);
  const double a_stopped = Share(a, t0 + 1600 * kMs, t0 + 2900 * kMs);
  const double b2_stopped = Share(b2, t0 + 1600 * kMs, t0 + 2900 * kMs);
  const double a_killed = Share(a, t0 + 3600 * kMs, t0 + 5800 * kMs);
  const double b2_killed = Share(b2, t0 + 3600 * kMs, t0 + 5800 * kMs);
  std::printf("while b1 is stopped: a %.1f %%, b2 %.1f %%; after b1 is killed: a %.1f %%, b2 %.1f %%\n", a_stopped,
              b2_stopped, a_killed, b2_killed);
  if (!kJudgeShares) return;
  EXPECT_NEAR(a_stopped, 50, 3);
  EXPECT_NEAR(b2_stopped, 50, 3);
  EXPECT_NEAR(a_killed, 50, 3);
  EXPECT_NEAR(b2_killed, 50, 3);
}

// A container killed (SIGKILL) mid-run: the other keeps its windows, never stalled.
TEST_F(TimeDivisionFaults, AKilledContainerCostsTheOtherNothingBeyondOneCycle) {
  Tenant& a = Start("a", 50, 5);
  Tenant& b = Start("b", 50, 5);
  const std::uint64_t t0 = NowNs();
  SleepUntil(t0 + 1500 * kMs);
  ASSERT_EQ(kill(b.pid, SIGKILL), 0);
  Wait(b, true);
  Wait(a);
  const double before = Share(a, t0 + 500 * kMs, t0 + 1400 * kMs);
  const double after = Share(a, t0 + 1600 * kMs, t0 + 4800 * kMs);
  std::printf("a before the kill: %.1f %%; after: %.1f %%\n", before, after);
  if (!kJudgeShares) return;
  EXPECT_NEAR(before, 50, 3);
  EXPECT_NEAR(after, 50, 3);
}

// A process without the shim, busy on the same GPU, launches outside every window: the driver time-slices it into
// the members' windows. The bound the threat model states: each member keeps about half its cap, less the handovers
// (a 2.1 ms slice each, 160 us per switch: 46 %) and less what its estimates then over-charge; asserted: 40 %.
// Observed: a (30 %) 18.7 %, b (70 %) 31.8 %, the process without the shim 42.0 %.
TEST_F(TimeDivisionFaults, AProcessWithoutTheShimTakesAboutHalfOfEachWindowAtMost) {
  Tenant& a = Start("a", 30, 5);
  Tenant& b = Start("b", 70, 5);
  Tenant& rogue = Start("rogue", 0, 5);
  const std::uint64_t t0 = NowNs();
  Wait(a);
  Wait(b);
  Wait(rogue);
  const double sa = Share(a, t0 + 1000 * kMs, t0 + 4800 * kMs);
  const double sb = Share(b, t0 + 1000 * kMs, t0 + 4800 * kMs);
  const double sr = Share(rogue, t0 + 1000 * kMs, t0 + 4800 * kMs);
  std::printf("a (30 %%) %.1f %%, b (70 %%) %.1f %%, the process without the shim %.1f %%\n", sa, sb, sr);
  if (!kJudgeShares) return;
  EXPECT_GE(sa, 0.4 * 30);
  EXPECT_GE(sb, 0.4 * 70);
}

// A schedule file of another kind at the path: the shim says so in one line naming it, and holds the cap with the
// limiter (never uncapped).
TEST_F(TimeDivisionFaults, AScheduleFileOfAnotherKindLeavesTheCapToTheLimiter) {
  { std::ofstream(folder_ / "schedule") << std::string(64 * 1024, 'x'); }
  Tenant& a = Start("a", 30, 3);
  const std::uint64_t t0 = NowNs();
  Wait(a);
  const double share = Share(a, t0 + 1000 * kMs, t0 + 2900 * kMs);
  std::ifstream err(a.out + ".err");
  const std::string said((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  std::printf("share %.1f %%; stderr: %s", share, said.c_str());
  if (kJudgeShares) {
    EXPECT_NEAR(share, 30, 3);
  }
  EXPECT_NE(said.find("time division is off"), std::string::npos) << said;
  EXPECT_NE(said.find((folder_ / "schedule").string()), std::string::npos) << said;
  EXPECT_NE(said.find("not a vgpu schedule file"), std::string::npos) << said;
}

// LIBCUDA_LOG_LEVEL=4: a launch that waited for its turn says how long and why (its window, the others' work,
// a launch that did not fit, a debt), with the container's balance then and the cycle.
TEST_F(TimeDivisionFaults, AWaitForATurnSaysWhyAndHowLongAtLogLevel4) {
  Tenant& a = Start("a", 50, 2, {"LIBCUDA_LOG_LEVEL=4"});
  Tenant& b = Start("b", 50, 2);
  Wait(a);
  Wait(b);
  std::ifstream err(a.out + ".err");
  const std::string said((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  const std::size_t at = said.find("for its turn (");
  ASSERT_NE(at, std::string::npos) << said.substr(0, 2000);
  const std::string line = said.substr(said.rfind('\n', at) + 1, said.find('\n', at) - said.rfind('\n', at) - 1);
  std::printf("%s\n", line.c_str());
  EXPECT_NE(line.find("expected to run"), std::string::npos) << line;
  EXPECT_NE(line.find(" waited "), std::string::npos) << line;
  EXPECT_NE(line.find("the container's balance "), std::string::npos) << line;
  EXPECT_NE(line.find("cycle 20000 us"), std::string::npos) << line;
}

// Whether this machine lets the test put a process in a time namespace of its own (Linux 5.6+, and the right to
// make one: root, or an unprivileged user namespace).
bool TimeNamespacesWork() {
  return std::system("/usr/bin/unshare --fork --time --monotonic 1 true >/dev/null 2>&1") == 0;
}

// A container whose runtime put it in a time namespace sees CLOCK_MONOTONIC moved by a fixed offset
// (/proc/self/timens_offsets): here one container's clock reads 10 000 s ahead of the other's. The schedule file's
// timestamps, each container's turn and the fake GPU's clock are the host's, the offset taken out, so both keep
// their shares. (With the offset left in, the one ahead published work in flight 10 000 s long and a heartbeat that
// never aged, the other saw its entry stale: measured 4.9 % for a 30 % cap and 93 % for a 70 % one.)
TEST_F(TimeDivisionFaults, AContainerInATimeNamespaceKeepsTheSchedule) {
  if (!TimeNamespacesWork()) GTEST_SKIP() << "unshare --time fails here (no time namespaces, or no right to make one)";
  constexpr std::uint64_t kAheadNs = 10'000ull * 1'000'000'000ull;
  Tenant& a = Start("a", 30, 5);
  Tenant& b =
      Start("b", 70, 5, {}, {"/usr/bin/unshare", "--fork", "--kill-child", "--time", "--monotonic", "10000", "--"});
  const std::uint64_t t0 = NowNs();
  Wait(a);
  Wait(b);
  const double sa = Share(a, t0 + 1000 * kMs, t0 + 4800 * kMs);
  const double sb = Share(b, t0 + kAheadNs + 1000 * kMs, t0 + kAheadNs + 4800 * kMs);
  std::printf("a (30 %%) %.1f %%, b (70 %%, its clock 10 000 s ahead) %.1f %%\n", sa, sb);
  ASSERT_GT(sb, 0) << "no reports from b in the window: its clock was not 10 000 s ahead";
  if (!kJudgeShares) return;
  EXPECT_NEAR(sa, 30, 3);
  EXPECT_NEAR(sb, 70, 3);
}

}  // namespace
