// Shared pieces of the shim's integration tests: result assertions, the memory views, child processes, seeds.
#pragma once

#include <cuda.h>
#include <gtest/gtest.h>
#include <nvml.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace vgpu::shimtest {

inline constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
inline constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;
// fakecuda's h100-80gb preset (docs/fakecuda.md): the figures a test may rely on when running on fakecuda.
inline constexpr std::uint64_t kH100ContextBytes = 518 * kMiB;
inline constexpr std::uint64_t kH100NvmlTotal = 81559 * kMiB;
inline constexpr std::uint64_t kH100CudaTotal = 81079 * kMiB;

std::string DescribeCudaResult(CUresult result);
testing::AssertionResult CudaResultIs(const char* expected_text, const char* call_text, CUresult expected,
                                      CUresult actual);

// True when the process runs on fakecuda (the registration sets FAKECUDA_STATE).
bool RunningOnFakecuda();

// A variable of the test's environment, or `fallback`.
std::string Env(const char* name, const std::string& fallback = {});
// The limit the registration configured for this test process (SHIM_LIMIT_BYTES), 0 if none.
std::uint64_t ConfiguredLimit();
// A folder of this test's own (SHIM_TMP), emptied by the test main at start.
std::string TestFolder();
// The worker program (SHIM_WORKER).
std::string WorkerPath();
// True if the preloaded libvgpu.so interposes dlsym (sanitizer builds leave the dlsym route out, see
// vgpu-core/hooks/CMakeLists.txt; tests of that route skip there).
bool ShimInterposesDlsym();

// The shim (SHIM_LIBRARY): what LD_PRELOAD names.
std::string ShimPath();

// A seed for this test: SHIM_SEED if set, else `fallback`; printed and recorded so a failure can be repeated.
std::uint64_t Seed(std::uint64_t fallback);

// Every figure of the memory views, read in the calling process (under the shim when it is preloaded).
struct Views {
  CUresult info_result = CUDA_ERROR_UNKNOWN;
  std::size_t cu_free = 0, cu_total = 0;  // cuMemGetInfo_v2 (current context)
  std::size_t device_total = 0;           // cuDeviceTotalMem_v2
  nvmlMemory_t v1{};                      // nvmlDeviceGetMemoryInfo
  nvmlMemory_v2_t v2{};                   // nvmlDeviceGetMemoryInfo_v2
  std::uint64_t driver_own = 0;           // this process's memory as the host's NVML lists it (not hooked)
  std::uint64_t used() const { return cu_total - cu_free; }
};
// Reads the views of CUDA ordinal `ordinal` and NVML device `nvml_index` (the same GPU in the default machine).
Views ReadViews(int ordinal = 0, unsigned int nvml_index = 0);
// NVML (v1 and v2) and cuDeviceTotalMem agree with cuMemGetInfo: same total, same used, free = total - used,
// v2 reserved = 0; the shim never counts less than the driver holds for this process.
void ExpectViewsAgree(const Views& views, std::uint64_t expected_total);
// This process's memory on NVML device `nvml_index` as the host's NVML lists it (0 when not listed).
std::uint64_t DriverOwnBytes(unsigned int nvml_index = 0);

// A child process: a program run with a modified environment, its output captured in files.
struct SpawnOptions {
  std::vector<std::string> args;                          // after argv[0]
  std::map<std::string, std::optional<std::string>> env;  // overrides; nullopt removes the variable
  std::vector<std::pair<int, int>> fds;                   // (parent's fd, child's fd number) to hand down
};

class Child {
 public:
  Child() = default;
  Child(Child&& other) noexcept;
  Child& operator=(Child&& other) noexcept;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child();  // kills (SIGKILL) and reaps a child still running

  static Child Spawn(const std::string& program, const SpawnOptions& options);
  // A worker command: WorkerPath() with `args`.
  static Child Worker(const std::vector<std::string>& args,
                      const std::map<std::string, std::optional<std::string>>& env,
                      const std::vector<std::pair<int, int>>& fds = {});

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !reaped_; }
  // Waits until the child ends or `timeout` passes; true if it ended (then status is known).
  bool Wait(std::chrono::milliseconds timeout);
  // Non-blocking: true if it has ended.
  bool Poll();
  void Kill(int signal_number);
  bool exited() const { return reaped_ && WIFEXITED(status_); }
  int exit_code() const { return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1; }
  int term_signal() const { return WIFSIGNALED(status_) ? WTERMSIG(status_) : 0; }
  std::string Stdout() const;
  std::string Stderr() const;
  // key=value lines of stdout.
  std::map<std::string, std::string> Values() const;
  // "exit 3" / "signal 9" / "running", and the captured stderr: for failure messages.
  std::string Describe() const;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string out_path_, err_path_;
};

// The environment of a child that runs under the shim with its own fake machine and region (files in the test
// folder named after `name`), and the given limit ("" leaves CUDA_DEVICE_MEMORY_LIMIT unset).
std::map<std::string, std::optional<std::string>> ShimEnv(const std::string& name, const std::string& limit);
// The same machine seen by a process without the shim.
std::map<std::string, std::optional<std::string>> NoShimEnv(const std::string& name);

// Runs a worker to completion (or kills it after `timeout`) and returns it.
Child RunWorker(const std::vector<std::string>& args, const std::map<std::string, std::optional<std::string>>& env,
                std::chrono::milliseconds timeout = std::chrono::seconds(20));

// A value of a worker's output as a number (the test fails, returning 0, if missing or not a number).
std::uint64_t Number(const std::map<std::string, std::string>& values, const std::string& key);

// A pipe whose ends are closed on exec (a child gets an end only through SpawnOptions::fds).
struct Pipe {
  Pipe();
  ~Pipe();
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  void CloseRead();
  void CloseWrite();
  // Reads `count` bytes from the read end before `deadline`; false on timeout or EOF.
  bool ReadBytes(std::size_t count, std::chrono::steady_clock::time_point deadline);
  int read_fd = -1, write_fd = -1;
};

// Child fd numbers the worker uses: it writes a byte on kStartedFd when its loop runs, one on kDoneFd when its work
// is done, and waits for EOF on kGoFd (the parent closing its end) before exiting or to stop a loop.
inline constexpr int kStartedFd = 3;
inline constexpr int kDoneFd = 4;
inline constexpr int kGoFd = 5;
// With barrier=1 a churn worker writes on kStartedFd once its context exists, then waits for EOF on kBeginFd.
inline constexpr int kBeginFd = 6;

double MillisecondsSince(std::chrono::steady_clock::time_point start);

}  // namespace vgpu::shimtest

#define EXPECT_CU(expected, call) EXPECT_PRED_FORMAT2(::vgpu::shimtest::CudaResultIs, expected, call)
#define ASSERT_CU(expected, call) ASSERT_PRED_FORMAT2(::vgpu::shimtest::CudaResultIs, expected, call)
#define EXPECT_CU_OK(call) EXPECT_CU(CUDA_SUCCESS, call)
#define ASSERT_CU_OK(call) ASSERT_CU(CUDA_SUCCESS, call)
