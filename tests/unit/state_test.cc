// The fake machine's crash story, forced deterministically: a process SIGKILLed while it holds the machine's lock
// in the middle of a mutation; the next process gets the lock at once, repairs, and the dead one's memory returns.
#include "fakecuda/state/state.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace fakecuda::state {
namespace {

constexpr std::uint64_t kGiB = 1ull << 30;

// Runs `body` in a child process; returns its exit status (or -signal), failing the test if it takes > 10 s.
template <typename Body>
int InChild(Body body) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(10);  // a wedged lock would hang the child: let the alarm kill it instead
    _exit(body());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

TEST(MachineLock, ADeathInsideTheLockIsRepairedAndItsMemoryReturns) {
  const std::string path = "/tmp/fakecuda-state-test-" + std::to_string(getpid()) + ".state";
  const std::string log = path + ".stderr";
  unlink(path.c_str());
  setenv("FAKECUDA_STATE", path.c_str(), 1);
  setenv("FAKECUDA_LOG", "1", 1);

  // The victim: takes a slot, charges 2 GiB properly, then dies half way through charging 8 GiB more (the slot
  // is written, the device total is not) while holding the lock.
  const int victim = InChild([] {
    std::string error;
    Attachment* a = Attach(/*claim_slot=*/true, error);
    if (a == nullptr) return 10;
    MachineLock lock(*a);
    model::Machine& m = lock.machine();
    if (!model::Charge(m, 0, a->slot, 2 * kGiB)) return 11;
    m.slots[a->slot].memory_bytes[0] += 8 * kGiB;
    raise(SIGKILL);
    return 12;
  });
  ASSERT_EQ(victim, -SIGKILL);

  // The next process: must get the lock (not hang), see a repaired machine, and get all 10 GiB back by reaping.
  const int next = InChild([&log] {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    std::string error;
    Attachment* a = Attach(/*claim_slot=*/false, error);
    if (a == nullptr) return 20;
    std::uint64_t used_after_repair = 0;
    {
      MachineLock lock(*a);
      used_after_repair = lock.machine().devices[0].memory_used_bytes;
    }
    if (used_after_repair != 10 * kGiB) return 21;  // the total was recomputed from the slot
    MachineLock lock(*a);
    if (ReapDeadProcesses(*a, MonotonicNs(), true) != 1) return 22;
    if (lock.machine().devices[0].memory_used_bytes != 0) return 23;
    return 0;
  });
  EXPECT_EQ(next, 0) << "10: attach failed, 21: total not repaired, 22: no reap, 23: memory not returned";
  std::ifstream stderr_file(log);
  std::stringstream text;
  text << stderr_file.rdbuf();
  EXPECT_NE(text.str().find("died holding the fake machine's lock; repaired 1 field(s)"), std::string::npos)
      << text.str();
  unlink(path.c_str());
  unlink(log.c_str());
}

}  // namespace
}  // namespace fakecuda::state
