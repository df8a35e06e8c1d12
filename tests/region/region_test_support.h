// Helpers for the region tests: temporary folders, child processes with bounded waits, shared memory between
// them, a seeded portable generator, and the peer that reaches the region's test hook.
#pragma once

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <thread>

#include "vgpu/region/region.h"

namespace vgpu::region {

// Reaches Attachment's private test hook: a process can be stopped (or slowed) at a named point while it holds
// the region lock, so that a test can SIGKILL it exactly there.
struct AttachmentTestPeer {
  using Point = Attachment::TestPoint;
  static constexpr int kClaiming = static_cast<int>(Point::claiming);
  static constexpr int kReserveBetweenWrites = static_cast<int>(Point::reserve_between_writes);
  static constexpr int kReleaseBetweenWrites = static_cast<int>(Point::release_between_writes);
  static constexpr int kReapBetweenWrites = static_cast<int>(Point::reap_between_writes);

  // Stop for good at `point`: write one byte to `signal_fd` (the test learns the lock is held) and wait to die.
  static void StopAt(int point, int signal_fd) {
    stop_point = point;
    stop_signal_fd = signal_fd;
    Attachment::test_hook_ = &StopHook;
  }
  // At every point, with probability percent/100, flag `stalled` and sleep up to `max_us` holding the lock, so
  // that random kills often land inside it. Single-threaded processes only (the generator is not shared).
  static void StallRandomly(std::uint64_t seed, int percent, int max_us, std::atomic<int>* stalled) {
    stall_state = seed;
    stall_percent = percent;
    stall_max_us = max_us;
    stall_flag = stalled;
    Attachment::test_hook_ = &StallHook;
  }
  static void Clear() { Attachment::test_hook_ = nullptr; }

 private:
  static inline int stop_point = -1;
  static inline int stop_signal_fd = -1;
  static inline std::uint64_t stall_state = 0;
  static inline int stall_percent = 0;
  static inline int stall_max_us = 0;
  static inline std::atomic<int>* stall_flag = nullptr;

  static void StopHook(Point point) {
    if (static_cast<int>(point) != stop_point) return;
    const ssize_t written = write(stop_signal_fd, "x", 1);
    (void)written;
    for (;;) pause();
  }
  static std::uint64_t NextStall() {
    std::uint64_t z = (stall_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  static void StallHook(Point) {
    if (static_cast<int>(NextStall() % 100) >= stall_percent) return;
    stall_flag->store(1);
    struct timespec pause_time {
      0, static_cast<long>(NextStall() % static_cast<std::uint64_t>(stall_max_us)) * 1000
    };
    nanosleep(&pause_time, nullptr);
    stall_flag->store(0);
  }
};

namespace test {

inline constexpr std::uint8_t kUuid[16] = {0x47, 0x50, 0x55, 0x2d, 0x76, 0x67, 0x70, 0x75,
                                           0x2d, 0x74, 0x65, 0x73, 0x74, 0x2d, 0x30, 0x31};
inline constexpr std::uint64_t kNoLimit = UINT64_MAX;

// SplitMix64: portable (same numbers from every standard library), so a printed seed repeats a run.
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t Next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::uint64_t Below(std::uint64_t bound) { return Next() % bound; }

 private:
  std::uint64_t state_;
};

// VGPU_TEST_SEED repeats a run; otherwise a fresh seed, printed so that a failure can be repeated.
inline std::uint64_t Seed(const char* test_name) {
  std::uint64_t seed = 0;
  if (const char* text = std::getenv("VGPU_TEST_SEED"); text != nullptr && *text != '\0') {
    seed = std::strtoull(text, nullptr, 0);
  } else {
    seed = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
           (static_cast<std::uint64_t>(getpid()) << 32);
  }
  std::printf("[ seed     ] %s: VGPU_TEST_SEED=%llu repeats this run\n", test_name,
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  return seed;
}

// A folder of its own for each test, removed at the end.
class TempFolder {
 public:
  TempFolder() {
    char pattern[] = "/tmp/vgpu-region-test.XXXXXX";
    const char* made = mkdtemp(pattern);
    if (made != nullptr) path_ = made;
  }
  ~TempFolder() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Runs `body` in a forked child and exits with what it returns; never returns into the test framework.
template <class Body>
pid_t Spawn(Body body) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid != 0) return pid;
  int code = 97;
  try {
    code = body();
  } catch (...) {
    code = 98;
  }
  std::fflush(nullptr);
  _exit(code);
}

inline constexpr int kTimedOut = -1;
inline constexpr int kNoChild = -2;

// SIGKILL to one child of ours. Never kill() a pid <= 0 (a failed fork's -1 would signal every process we may).
inline void KillChild(pid_t pid) {
  if (pid > 0) kill(pid, SIGKILL);
}

// The child's exit code, 128 + signal if a signal ended it, or kTimedOut (after killing it) if it did not end
// within `timeout`: a stuck child is a deadlock, and the test must say so rather than hang.
inline int WaitExit(pid_t pid, std::chrono::milliseconds timeout) {
  if (pid <= 0) return kNoChild;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (done < 0 && errno != EINTR) return kTimedOut;
    if (std::chrono::steady_clock::now() > deadline) {
      KillChild(pid);
      waitpid(pid, &status, 0);
      return kTimedOut;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// One object of `T` in memory shared with every child forked afterwards.
template <class T>
class Shared {
 public:
  Shared() {
    void* memory = mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (memory != MAP_FAILED) object_ = new (memory) T();
  }
  ~Shared() {
    if (object_ != nullptr) {
      object_->~T();
      munmap(object_, sizeof(T));
    }
  }
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;
  T* operator->() const { return object_; }
  T& operator*() const { return *object_; }
  bool ok() const { return object_ != nullptr; }

 private:
  T* object_ = nullptr;
};

struct Pipe {
  int read_end = -1;
  int write_end = -1;
  Pipe() {
    int ends[2];
    if (pipe(ends) == 0) {
      read_end = ends[0];
      write_end = ends[1];
    }
  }
  ~Pipe() {
    CloseRead();
    CloseWrite();
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  void CloseRead() {
    if (read_end >= 0) close(read_end);
    read_end = -1;
  }
  void CloseWrite() {
    if (write_end >= 0) close(write_end);
    write_end = -1;
  }
  // Blocks until the write end is closed everywhere: a start barrier for many children at once.
  void WaitForClose() const {
    char byte;
    while (read(read_end, &byte, 1) != 0 && errno == EINTR) {
    }
  }
  // Reads `count` bytes within `timeout`; false on timeout or end of file.
  bool ReadBytes(std::size_t count, std::chrono::milliseconds timeout) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (count > 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      struct pollfd ready {
        read_end, POLLIN, 0
      };
      if (poll(&ready, 1, static_cast<int>(left.count())) <= 0) continue;
      char buffer[64];
      const ssize_t got = read(read_end, buffer, count < sizeof buffer ? count : sizeof buffer);
      if (got == 0) return false;
      if (got > 0) count -= static_cast<std::size_t>(got);
    }
    return true;
  }
};

inline Attachment* OpenOrNull(const std::string& path) {
  std::string error;
  Attachment* attachment = Attachment::Open(path, error);
  if (attachment == nullptr)
    std::fprintf(stderr, "child %d: Open('%s') failed: %s\n", getpid(), path.c_str(), error.c_str());
  return attachment;
}

// In children: report what failed and return its code (gtest assertions do not cross fork).
#define CHILD_CHECK(condition, code)                                                                         \
  do {                                                                                                       \
    if (!(condition)) {                                                                                      \
      std::fprintf(stderr, "child %d: %s:%d: check failed: %s\n", getpid(), __FILE__, __LINE__, #condition); \
      return (code);                                                                                         \
    }                                                                                                        \
  } while (0)

// The sum of the live slots' usage on `device`: what the device total must equal whenever the lock is free.
inline std::uint64_t LiveSlotSum(const Region& region, int device) {
  std::uint64_t sum = 0;
  for (const Slot& slot : region.slots) {
    if (slot.state == SlotState::live) sum += slot.used_bytes[device];
  }
  return sum;
}

// For a failure message: the robust mutex's futex word (owner tid and flag bits) as glibc lays it out on Linux.
inline std::string DescribeLock(const Region& region) {
  unsigned word = 0;
  int owner = 0;
  std::memcpy(&word, region.lock_storage, sizeof word);        // __lock
  std::memcpy(&owner, region.lock_storage + 8, sizeof owner);  // __owner
  char text[160];
  std::snprintf(text, sizeof text, "lock word 0x%08x (tid %u%s%s), __owner %d", word, word & 0x3fffffffu,
                (word & 0x80000000u) != 0 ? ", waiters" : "", (word & 0x40000000u) != 0 ? ", owner died" : "", owner);
  return text;
}

// For a failure message: each thread of `pid` with its state and where it waits in the kernel.
inline std::string DescribeThreads(pid_t pid) {
  std::string text = "process " + std::to_string(pid) + ":";
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", error)) {
    std::string stat, wchan, syscall;
    {
      std::ifstream in(task.path() / "stat");
      std::getline(in, stat);
    }
    {
      std::ifstream in(task.path() / "wchan");
      std::getline(in, wchan);
    }
    {
      std::ifstream in(task.path() / "syscall");
      std::getline(in, syscall);
    }
    const std::size_t state = stat.rfind(')');
    text += " [tid " + task.path().filename().string() + " state " +
            (state != std::string::npos && state + 2 < stat.size() ? stat.substr(state + 2, 1) : "?") + " wchan " +
            wchan + " syscall " + syscall.substr(0, 40) + "]";
  }
  return text;
}

// True if a creator's temporary file was left behind in `folder`.
inline bool AnyTemporaryLeft(const std::string& folder) {
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    if (entry.path().filename().string().find(".tmp.") != std::string::npos) return true;
  }
  return false;
}

inline int LiveSlots(const Region& region) {
  int live = 0;
  for (const Slot& slot : region.slots) live += slot.state == SlotState::live ? 1 : 0;
  return live;
}

}  // namespace test
}  // namespace vgpu::region
