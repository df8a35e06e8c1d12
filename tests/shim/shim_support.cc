// Helpers of the shim's integration tests: CUresult assertions, the memory views, child processes and pipes.
#include "shim_support.h"

#include <dlfcn.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace vgpu::shimtest {

std::string DescribeCudaResult(CUresult result) {
  const char* name = nullptr;
  std::string text = cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr ? name : "unnamed result";
  return text + " (" + std::to_string(static_cast<int>(result)) + ")";
}

testing::AssertionResult CudaResultIs(const char* expected_text, const char* call_text, CUresult expected,
                                      CUresult actual) {
  if (expected == actual) return testing::AssertionSuccess();
  return testing::AssertionFailure() << call_text << " returned " << DescribeCudaResult(actual) << ", expected "
                                     << expected_text << " = " << DescribeCudaResult(expected);
}

bool RunningOnFakecuda() { return std::getenv("FAKECUDA_STATE") != nullptr; }

std::string Env(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : fallback;
}

std::uint64_t ConfiguredLimit() { return std::strtoull(Env("SHIM_LIMIT_BYTES", "0").c_str(), nullptr, 10); }
std::string TestFolder() { return Env("SHIM_TMP", "/tmp/vgpu-shimtest"); }
std::string WorkerPath() { return Env("SHIM_WORKER"); }
std::string ShimPath() { return Env("SHIM_LIBRARY"); }

bool ShimInterposesDlsym() {
  Dl_info info{};
  void* found = dlsym(RTLD_DEFAULT, "dlsym");
  return found != nullptr && dladdr(found, &info) != 0 && info.dli_fname != nullptr &&
         std::string(info.dli_fname).find("libvgpu") != std::string::npos;
}

std::uint64_t Seed(std::uint64_t fallback) {
  const std::string text = Env("SHIM_SEED");
  const std::uint64_t seed = text.empty() ? fallback : std::strtoull(text.c_str(), nullptr, 10);
  std::printf("seed=%llu (set SHIM_SEED=%llu to repeat this run)\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(seed));
  testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

std::uint64_t DriverOwnBytes(unsigned int nvml_index) {
  nvmlDevice_t device = nullptr;
  if (nvmlDeviceGetHandleByIndex_v2(nvml_index, &device) != NVML_SUCCESS) return 0;
  nvmlProcessInfo_t processes[64];
  unsigned int count = 64;
  if (nvmlDeviceGetComputeRunningProcesses_v3(device, &count, processes) != NVML_SUCCESS) return 0;
  for (unsigned int i = 0; i < count; ++i) {
    if (static_cast<pid_t>(processes[i].pid) == getpid()) return processes[i].usedGpuMemory;
  }
  return 0;
}

Views ReadViews(int ordinal, unsigned int nvml_index) {
  static const nvmlReturn_t nvml_init = nvmlInit_v2();
  EXPECT_EQ(nvml_init, NVML_SUCCESS) << "nvmlInit_v2";
  Views v;
  v.info_result = cuMemGetInfo_v2(&v.cu_free, &v.cu_total);
  CUdevice device = 0;
  EXPECT_CU_OK(cuDeviceGet(&device, ordinal));
  EXPECT_CU_OK(cuDeviceTotalMem_v2(&v.device_total, device));
  nvmlDevice_t handle = nullptr;
  EXPECT_EQ(nvmlDeviceGetHandleByIndex_v2(nvml_index, &handle), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetMemoryInfo(handle, &v.v1), NVML_SUCCESS);
  v.v2.version = nvmlMemory_v2;
  EXPECT_EQ(nvmlDeviceGetMemoryInfo_v2(handle, &v.v2), NVML_SUCCESS);
  v.driver_own = DriverOwnBytes(nvml_index);
  return v;
}

void ExpectViewsAgree(const Views& v, std::uint64_t expected_total) {
  ASSERT_CU_OK(v.info_result) << "cuMemGetInfo_v2";
  EXPECT_EQ(v.cu_total, expected_total) << "cuMemGetInfo_v2 total";
  EXPECT_LE(v.cu_free, v.cu_total) << "cuMemGetInfo_v2 free wrapped";
  EXPECT_EQ(v.device_total, expected_total) << "cuDeviceTotalMem_v2";
  EXPECT_EQ(v.v1.total, v.cu_total) << "nvmlDeviceGetMemoryInfo total";
  EXPECT_EQ(v.v1.used, v.used()) << "nvmlDeviceGetMemoryInfo used";
  EXPECT_EQ(v.v1.free, v.cu_free) << "nvmlDeviceGetMemoryInfo free";
  EXPECT_EQ(v.v2.total, v.cu_total) << "nvmlDeviceGetMemoryInfo_v2 total";
  EXPECT_EQ(v.v2.reserved, 0u) << "nvmlDeviceGetMemoryInfo_v2 reserved";
  EXPECT_EQ(v.v2.used, v.used()) << "nvmlDeviceGetMemoryInfo_v2 used";
  EXPECT_EQ(v.v2.free, v.cu_free) << "nvmlDeviceGetMemoryInfo_v2 free";
  // The promise seen from the host: the shim never counts less than the driver holds for this process.
  EXPECT_GE(v.used(), v.driver_own) << "the slice counts less than the host's NVML shows for this process";
  if (RunningOnFakecuda()) {
    // fakecuda charges what the shim charges (512-byte rounding, the measured context): exactly equal.
    EXPECT_EQ(v.used(), v.driver_own) << "the slice's usage differs from the host's view of this process";
  }
}

// ---- child processes ---------------------------------------------------------------------------------------

namespace {

std::atomic<int> g_child_counter{0};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

Child::Child(Child&& other) noexcept { *this = std::move(other); }

Child& Child::operator=(Child&& other) noexcept {
  if (this != &other) {
    if (running()) {
      Kill(SIGKILL);
      Wait(std::chrono::seconds(10));
    }
    pid_ = other.pid_;
    reaped_ = other.reaped_;
    status_ = other.status_;
    out_path_ = std::move(other.out_path_);
    err_path_ = std::move(other.err_path_);
    other.pid_ = -1;
    other.reaped_ = false;
  }
  return *this;
}

Child::~Child() {
  if (running()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

Child Child::Spawn(const std::string& program, const SpawnOptions& options) {
  Child child;
  const int n = g_child_counter.fetch_add(1);
  const std::string base = TestFolder() + "/child-" + std::to_string(getpid()) + "-" + std::to_string(n);
  child.out_path_ = base + ".out";
  child.err_path_ = base + ".err";

  // Everything the child needs is built before fork: after it only async-signal-safe calls are made.
  std::vector<std::string> arg_storage{program};
  arg_storage.insert(arg_storage.end(), options.args.begin(), options.args.end());
  std::vector<char*> argv;
  for (std::string& a : arg_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::map<std::string, std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const auto equals = text.find('=');
    if (equals != std::string::npos) environment[text.substr(0, equals)] = text.substr(equals + 1);
  }
  for (const auto& [key, value] : options.env) {
    if (value.has_value()) {
      environment[key] = *value;
    } else {
      environment.erase(key);
    }
  }
  std::vector<std::string> env_storage;
  for (const auto& [key, value] : environment) env_storage.push_back(key + "=" + value);
  std::vector<char*> envp;
  for (std::string& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);

  const int out = open(child.out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = open(child.err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0 || err < 0) {
    ADD_FAILURE() << "cannot create " << base << ".out/.err: " << std::strerror(errno);
    if (out >= 0) close(out);
    if (err >= 0) close(err);
    return child;
  }
  const std::vector<std::pair<int, int>> fds = options.fds;
  const pid_t pid = fork();
  if (pid == 0) {
    // Move every source out of the way first: a source may sit on another's target number.
    int moved[16];
    const std::size_t count = fds.size() < 16 ? fds.size() : 16;
    for (std::size_t i = 0; i < count; ++i) moved[i] = fcntl(fds[i].first, F_DUPFD_CLOEXEC, 64);
    const int moved_out = fcntl(out, F_DUPFD_CLOEXEC, 64);
    const int moved_err = fcntl(err, F_DUPFD_CLOEXEC, 64);
    if (dup2(moved_out, 1) < 0 || dup2(moved_err, 2) < 0) _exit(126);
    for (std::size_t i = 0; i < count; ++i) {
      if (moved[i] < 0 || dup2(moved[i], fds[i].second) < 0) _exit(126);
    }
    int keep_below = 3;
    for (std::size_t i = 0; i < count; ++i)
      keep_below = fds[i].second + 1 > keep_below ? fds[i].second + 1 : keep_below;
    close_range(static_cast<unsigned int>(keep_below), ~0u, 0);
    execve(program.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  close(out);
  close(err);
  if (pid < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    return child;
  }
  child.pid_ = pid;
  return child;
}

Child Child::Worker(const std::vector<std::string>& args, const std::map<std::string, std::optional<std::string>>& env,
                    const std::vector<std::pair<int, int>>& fds) {
  SpawnOptions options;
  options.args = args;
  options.env = env;
  options.fds = fds;
  return Spawn(WorkerPath(), options);
}

bool Child::Poll() {
  if (pid_ <= 0) return true;
  if (reaped_) return true;
  const pid_t r = waitpid(pid_, &status_, WNOHANG);
  if (r == pid_) reaped_ = true;
  return reaped_;
}

bool Child::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(200);
  while (!Poll()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    if (pause < std::chrono::milliseconds(5)) pause *= 2;
  }
  return true;
}

void Child::Kill(int signal_number) {
  if (running()) kill(pid_, signal_number);
}

std::string Child::Stdout() const { return ReadFile(out_path_); }
std::string Child::Stderr() const { return ReadFile(err_path_); }

std::map<std::string, std::string> Child::Values() const {
  std::map<std::string, std::string> values;
  std::istringstream lines(Stdout());
  std::string line;
  while (std::getline(lines, line)) {
    const auto equals = line.find('=');
    if (equals != std::string::npos) values[line.substr(0, equals)] = line.substr(equals + 1);
  }
  return values;
}

std::string Child::Describe() const {
  std::string state;
  if (!reaped_) {
    state = "still running";
  } else if (WIFEXITED(status_)) {
    state = "exit " + std::to_string(WEXITSTATUS(status_));
  } else if (WIFSIGNALED(status_)) {
    state = "signal " + std::to_string(WTERMSIG(status_));
  }
  return "pid " + std::to_string(pid_) + " " + state + "\n--- stdout\n" + Stdout() + "--- stderr\n" + Stderr();
}

std::map<std::string, std::optional<std::string>> ShimEnv(const std::string& name, const std::string& limit) {
  std::map<std::string, std::optional<std::string>> env;
  env["LD_PRELOAD"] = ShimPath();
  env["FAKECUDA_STATE"] = TestFolder() + "/" + name + ".state";
  env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = TestFolder() + "/" + name + ".region";
  env["CUDA_DEVICE_MEMORY_LIMIT"] = limit.empty() ? std::nullopt : std::optional<std::string>(limit);
  return env;
}

std::map<std::string, std::optional<std::string>> NoShimEnv(const std::string& name) {
  std::map<std::string, std::optional<std::string>> env;
  env["LD_PRELOAD"] = std::nullopt;
  env["FAKECUDA_STATE"] = TestFolder() + "/" + name + ".state";
  env["CUDA_DEVICE_MEMORY_LIMIT"] = std::nullopt;
  return env;
}

Child RunWorker(const std::vector<std::string>& args, const std::map<std::string, std::optional<std::string>>& env,
                std::chrono::milliseconds timeout) {
  Child child = Child::Worker(args, env);
  if (!child.Wait(timeout)) {
    ADD_FAILURE() << "worker did not end within " << timeout.count() << " ms: " << args.front() << "\n"
                  << child.Describe();
    child.Kill(SIGKILL);
    child.Wait(std::chrono::seconds(10));
  }
  return child;
}

std::uint64_t Number(const std::map<std::string, std::string>& values, const std::string& key) {
  const auto it = values.find(key);
  if (it == values.end()) {
    ADD_FAILURE() << "the worker did not report " << key;
    return 0;
  }
  char* end = nullptr;
  const long long value = std::strtoll(it->second.c_str(), &end, 10);
  if (end == it->second.c_str() || *end != '\0') {
    ADD_FAILURE() << key << "=" << it->second << " is not a number";
    return 0;
  }
  return static_cast<std::uint64_t>(value);
}

Pipe::Pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe2: " << std::strerror(errno);
    return;
  }
  read_fd = fds[0];
  write_fd = fds[1];
}

Pipe::~Pipe() {
  CloseRead();
  CloseWrite();
}

void Pipe::CloseRead() {
  if (read_fd >= 0) close(read_fd);
  read_fd = -1;
}

void Pipe::CloseWrite() {
  if (write_fd >= 0) close(write_fd);
  write_fd = -1;
}

bool Pipe::ReadBytes(std::size_t count, std::chrono::steady_clock::time_point deadline) {
  char buffer[256];
  while (count > 0) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    pollfd p{read_fd, POLLIN, 0};
    const int wait_ms =
        static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count()) + 1;
    const int r = poll(&p, 1, wait_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    const ssize_t n = read(read_fd, buffer, count < sizeof buffer ? count : sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    count -= static_cast<std::size_t>(n);
  }
  return true;
}

double MillisecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace vgpu::shimtest
