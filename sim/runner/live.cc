// Live mode: every process replica is a real vgpu-tenant, or a scenario's own program, under the real shim
// (LD_PRELOAD=libvgpu.so), over a private fake machine or the machine's driver. One thread runs the schedule: it
// starts and kills processes on time, reads every pipe without ever blocking on one, and samples each tenant's busy
// time (from its processes' reports; a program's from the fake GPU, through vgpu-sampler), memory (from its region)
// and NVML's view (from vgpu-sampler) every sample period.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "internal.h"
#include "programs.h"
#include "vgpu/base/clock.h"
#include "vgpu/base/duration.h"
#include "vgpu/base/uuid.h"
#include "vgpu/policy/config.h"
#include "vgpu/region/region.h"

extern char** environ;

namespace vgpu::runner::internal {
namespace {

constexpr std::uint64_t kMillisecondNs = scenario::kMillisecondNs;
constexpr std::uint64_t kSecondNs = scenario::kSecondNs;
// A process still running this long after its stop time is hung: killed and reported as an error.
constexpr std::uint64_t kGraceNs = 10 * kSecondNs;
// The sampler's first line (NVML initialised, devices found) must come within this.
constexpr std::uint64_t kSamplerStartNs = 10 * kSecondNs;
// The loop wakes at least this often to look for exited children (waitpid is polled: no signal handler is
// installed in a library that may live in someone else's process).
constexpr std::uint64_t kLoopMaxWaitNs = 20 * kMillisecondNs;
// fakecuda reaps a dead process's memory at the next NVML query 100 ms or more after the previous reap.
constexpr std::uint64_t kReapPeriodNs = 110 * kMillisecondNs;
constexpr std::uint64_t kLeakSettleNs = 1 * kSecondNs;
constexpr std::size_t kMaxLineBytes = 64 * 1024;
constexpr std::size_t kStderrLinesKept = 4;

using vgpu::base::MonotonicNs;

using vgpu::base::FormatDuration;  // "1.5s", "2s", "5us": vgpu-tenant reads them with the same grammar

// Seconds as a decimal with no more digits than needed: "3", "2.5", "0.000001".
std::string FormatSeconds(std::uint64_t ns) {
  std::string text = std::to_string(ns / kSecondNs);
  std::uint64_t fraction = ns % kSecondNs;
  if (fraction == 0) return text;
  char digits[16];
  std::snprintf(digits, sizeof digits, "%09llu", static_cast<unsigned long long>(fraction));
  std::string decimals = digits;
  while (!decimals.empty() && decimals.back() == '0') decimals.pop_back();
  return text + "." + decimals;
}

std::string FormatDecimal(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", value);
  return text;
}

// One --phase value: "kernels=1ms,for=2s,depth=4,blocks=1", "kernels=5us|50us,rate=200,jitter=10", "idle=1s",
// "kernels=1ms,depth=8,blocks=1,collective=1ms,ranks=2,every=4,group=1001". `group`: the collective's group, the
// same for the tenant's processes (ranks) that run this phase.
std::string PhaseArgument(const scenario::Phase& phase, std::uint64_t group) {
  if (phase.kind == scenario::Phase::Kind::idle) return "idle=" + FormatDuration(phase.for_ns);
  std::string text = "kernels=";
  for (std::size_t i = 0; i < phase.sizes_ns.size(); ++i) {
    if (i > 0) text += '|';
    text += FormatDuration(phase.sizes_ns[i]);
  }
  if (phase.for_ns != 0) text += ",for=" + FormatDuration(phase.for_ns);
  text += ",depth=" + std::to_string(phase.depth);
  text += ",blocks=" + std::to_string(phase.blocks);
  if (phase.rate > 0) text += ",rate=" + FormatDecimal(phase.rate);
  if (phase.jitter_permille != 0) text += ",jitter=" + FormatDecimal(phase.jitter_permille / 10.0);
  if (phase.collective_ns != 0) {
    text += ",collective=" + FormatDuration(phase.collective_ns) + ",ranks=" + std::to_string(phase.ranks) +
            ",every=" + std::to_string(phase.every) + ",group=" + std::to_string(group);
  }
  return text;
}

bool SameText(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

// Whole lines from a non-blocking pipe. A line longer than kMaxLineBytes is cut there (our programs print short
// lines; a runaway one must not grow without bound).
class LineReader {
 public:
  LineReader() = default;
  ~LineReader() { Close(); }
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  void Adopt(int fd) {
    Close();
    fd_ = fd;
    eof_ = false;
    fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
  }
  int fd() const { return fd_; }
  bool open() const { return fd_ >= 0; }

  // Reads what is there now; calls `on_line` for every complete line. Closes the pipe at its end.
  template <typename OnLine>
  void Drain(OnLine on_line) {
    while (fd_ >= 0) {
      char buffer[8192];
      const ssize_t got = read(fd_, buffer, sizeof buffer);
      if (got > 0) {
        partial_.append(buffer, static_cast<std::size_t>(got));
        std::size_t start = 0;
        for (std::size_t newline; (newline = partial_.find('\n', start)) != std::string::npos; start = newline + 1) {
          on_line(std::string_view(partial_).substr(start, newline - start));
        }
        partial_.erase(0, start);
        if (partial_.size() > kMaxLineBytes) {
          on_line(std::string_view(partial_).substr(0, kMaxLineBytes));
          partial_.clear();
        }
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (!partial_.empty()) on_line(partial_);  // the last line without its newline
      partial_.clear();
      eof_ = true;
      Close();
    }
  }

 private:
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
  bool eof_ = false;
  std::string partial_;
};

struct Spawned {
  pid_t pid = -1;
  int out = -1;  // the child's stdout, read end
  int err = -1;  // its stderr, read end
  int in = -1;   // its stdin, write end (only if asked for)
};

void CloseBoth(int fds[2]) {
  for (int i = 0; i < 2; ++i) {
    if (fds[i] >= 0) close(fds[i]);
    fds[i] = -1;
  }
}

// Starts `argv` with exactly `environment`, stdout and stderr on pipes, stdin on a pipe or /dev/null, in `folder`
// ("" = the runner's). The child gets a process group of its own (a terminal's Ctrl-C goes to the runner, which kills
// its children itself) and dies with the runner's thread (PR_SET_PDEATHSIG), so no tenant outlives a runner that was
// killed. fork + exec rather than posix_spawn for those two; between them the child makes async-signal-safe calls
// only.
bool Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& environment, bool with_stdin,
           Spawned& child, std::string& error, const std::string& folder = {}) {
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  std::vector<char*> env;
  for (const std::string& entry : environment) env.push_back(const_cast<char*>(entry.c_str()));
  env.push_back(nullptr);
  int out[2] = {-1, -1}, err[2] = {-1, -1}, in[2] = {-1, -1}, status[2] = {-1, -1};
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0 || (with_stdin && pipe2(in, O_CLOEXEC) != 0) ||
      pipe2(status, O_CLOEXEC) != 0) {
    error = "cannot start " + argv[0] + ": pipe: " + std::strerror(errno);
    CloseBoth(out), CloseBoth(err), CloseBoth(in), CloseBoth(status);
    return false;
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    error = "cannot start " + argv[0] + ": fork: " + std::strerror(errno);
    CloseBoth(out), CloseBoth(err), CloseBoth(in), CloseBoth(status);
    return false;
  }
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);  // a Python host ignores SIGPIPE, and exec keeps an ignored signal ignored
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the runner died before the line above
    const int input = with_stdin ? in[0] : open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (input < 0 || (!folder.empty() && chdir(folder.c_str()) != 0) || dup2(input, STDIN_FILENO) < 0 ||
        dup2(out[1], STDOUT_FILENO) < 0 || dup2(err[1], STDERR_FILENO) < 0) {
      const int e = errno;
      [[maybe_unused]] const ssize_t w = write(status[1], &e, sizeof e);
      _exit(127);
    }
    // Descriptors the host process left inheritable (a test harness's, a Python program's) stay out of tenants;
    // the status pipe stays open (O_CLOEXEC closes it on a successful exec) so a failed exec can still report.
    if (status[1] > 3) close_range(3, static_cast<unsigned>(status[1]) - 1, 0);
    close_range(static_cast<unsigned>(status[1]) + 1, ~0U, 0);
    execve(args[0], args.data(), env.data());
    const int e = errno;
    [[maybe_unused]] const ssize_t w = write(status[1], &e, sizeof e);
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  if (with_stdin) close(in[0]);
  close(status[1]);
  int exec_errno = 0;
  ssize_t got;
  do {
    got = read(status[0], &exec_errno, sizeof exec_errno);
  } while (got < 0 && errno == EINTR);
  close(status[0]);
  if (got == static_cast<ssize_t>(sizeof exec_errno)) {
    waitpid(pid, nullptr, 0);
    error = "cannot start " + argv[0] + ": " + std::strerror(exec_errno);
    close(out[0]);
    close(err[0]);
    if (with_stdin) close(in[1]);
    return false;
  }
  child.pid = pid;
  child.out = out[0];
  child.err = err[0];
  child.in = with_stdin ? in[1] : -1;
  return true;
}

bool Executable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }
bool Readable(const std::string& path) { return access(path.c_str(), R_OK) == 0; }

std::string ExitText(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return std::string("signal ") + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "status " + std::to_string(status);
}

struct Report {
  std::uint64_t t_ns;  // CLOCK_MONOTONIC, absolute
  std::uint64_t busy_ns;
};

struct Child {
  const ProcessRun* run = nullptr;
  pid_t pid = -1;
  LineReader out;
  LineReader err;
  std::deque<std::string> err_tail;
  bool started = false;
  bool exited = false;
  bool killed_at_crash = false;
  bool killed_late = false;
  bool killed_on_cancel = false;
  // A `program:`: its busy time comes from the sampler's lines, and it gets SIGTERM (its process group) at its stop.
  bool program = false;
  bool terminated_at_stop = false;
  bool final_known = false;  // program: a sampler line read after its exit gave its busy time to its end
  std::uint64_t start_abs = 0;
  std::uint64_t kill_abs = 0;  // when we sent SIGKILL, if we did
  std::uint64_t exit_abs = 0;
  // The last point of its busy time: when it ended and what it had done by then (ReapChildren).
  Report last{0, 0};
  std::vector<Report> reports;  // oldest first; pruned behind the oldest sample still waiting
  std::uint64_t busy_ns = 0;    // the latest report's
  std::string result_status;    // the result line's "status"
  int wait_status = 0;
  bool reaped_elsewhere = false;  // waitpid said ECHILD: another part of the host process reaped it
};

// A program is signalled with its process group (what it started goes too); vgpu-tenant alone.
void Signal(const Child& child, int signal_number) { kill(child.program ? -child.pid : child.pid, signal_number); }

struct GpuView {
  std::uint64_t util_percent = 0;
  std::uint64_t memory_used_bytes = 0;
};

struct PendingSample {
  std::uint64_t k = 0;
  std::uint64_t t_abs = 0;
  std::vector<std::vector<std::uint64_t>> memory;  // [tenant][position in its devices]
  std::vector<GpuView> gpu;                        // per physical device
};

struct TimedLine {
  std::uint64_t t_abs;
  std::string text;
};

class LiveRun {
 public:
  LiveRun(const scenario::Scenario& scenario, const Options& options, TraceSink& trace)
      : s_(scenario), options_(options), trace_(trace) {}

  ~LiveRun() {
    // Whatever happened (an exception included), no child outlives the run and none is left a zombie.
    for (Child& child : children_) {
      if (child.pid > 0 && !child.exited) {
        Signal(child, SIGKILL);
        waitpid(child.pid, nullptr, 0);
      }
    }
    StopSampler();
    if (created_work_ && remove_work_) {
      std::error_code ignored;
      std::filesystem::remove_all(work_, ignored);
    }
  }

  Outcome Run() {
    Outcome outcome;
    if (!Prepare(outcome.error) || !StartSampler(outcome.error)) return outcome;
    WriteHeader(s_, Mode::live, device_count_, trace_);
    try {
      Loop();
    } catch (const std::exception& exception) {
      // The caller's progress callback (or host memory) failed: the processes are stopped and the trace still
      // ends with its end line.
      error_ = std::string("the run stopped: ") + exception.what();
      stopping_ = true;
    } catch (...) {
      error_ = "the run stopped: the progress callback failed";
      stopping_ = true;
    }
    Finish();
    if (error_.empty()) error_ = late_errors_;
    outcome.ok = error_.empty();
    outcome.error = error_;
    if (!outcome.ok && created_work_) {
      remove_work_ = false;
      outcome.error += " (files kept in " + work_ + ")";
    }
    return outcome;
  }

 private:
  // ---- setup -------------------------------------------------------------------------------------------

  // The value of NAME in the run's environment (Options::environment, or environ), null if unset.
  const char* Env(std::string_view name) const {
    for (const std::string& entry : environment_) {
      if (entry.size() > name.size() && entry.compare(0, name.size(), name) == 0 && entry[name.size()] == '=') {
        return entry.c_str() + name.size() + 1;
      }
    }
    return nullptr;
  }

  bool Prepare(std::string& error) {
    environment_ = options_.environment;
    if (environment_.empty()) {
      for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) environment_.emplace_back(*entry);
    }
    install_ = options_.install_dir;
    if (install_.empty()) {
      const char* from_environment = Env("VGPU_INSTALL_DIR");
      install_ = from_environment != nullptr ? from_environment : "";
    }
    if (install_.empty()) {
      error =
          "live mode needs the built pieces: set Options::install_dir or VGPU_INSTALL_DIR to the build folder "
          "(the one with bin/vgpu-tenant and lib/libvgpu.so)";
      return false;
    }
    tenant_binary_ = install_ + "/bin/vgpu-tenant";
    sampler_binary_ = install_ + "/bin/vgpu-sampler";
    shim_ = install_ + "/lib/libvgpu.so";
    for (const std::string& program : {tenant_binary_, sampler_binary_}) {
      if (!Executable(program)) {
        error = "live mode: '" + program + "' is not an executable program (" + std::strerror(errno) +
                "); build it (cmake --build <build> --target vgpu-tenant vgpu-sampler) or fix the install folder";
        return false;
      }
    }
    std::vector<std::string> libraries = {shim_};
    if (!s_.real_gpu) {
      libraries.push_back(install_ + "/lib/libcuda.so.1");
      libraries.push_back(install_ + "/lib/libnvidia-ml.so.1");
    }
    for (const std::string& library : libraries) {
      if (!Readable(library)) {
        error = "live mode: '" + library + "' cannot be read (" + std::strerror(errno) +
                "); build it (targets vgpu, fakecuda_cuda, fakecuda_nvml) or fix the install folder";
        return false;
      }
    }
    if (access(policy::SystemConfigPath(), F_OK) == 0) {
      error = std::string("live mode: ") + policy::SystemConfigPath() +
              " exists, and the shim then ignores the environment: the "
              "scenario's limits would not apply; run on a machine without it";
      return false;
    }
    if (s_.real_gpu) {
      device_count_ = s_.device_count;
      reserved_bytes_.assign(device_count_, 0);
    } else {
      std::vector<std::string> items;
      if (!scenario::DeviceItems(s_.gpu, items, error)) return false;
      device_count_ = static_cast<std::uint32_t>(items.size());
      for (const std::string& item : items) {
        fakecuda::model::MachineConfig config = fakecuda::model::DefaultConfig();
        if (!fakecuda::model::ParseDevices(item, config, error)) {
          error = "gpu = '" + s_.gpu + "': " + error;
          return false;
        }
        reserved_bytes_.push_back(config.devices[0].reserved_bytes);
        if (!devices_spec_.empty()) devices_spec_ += ',';
        devices_spec_ += item;
      }
    }
    if (!MakeWorkDir(error)) return false;
    runs_ = Expand(s_);
    children_ = std::vector<Child>(runs_.size());
    for (std::size_t i = 0; i < runs_.size(); ++i) children_[i].run = &runs_[i];
    start_order_.resize(runs_.size());
    for (std::size_t i = 0; i < runs_.size(); ++i) start_order_[i] = i;
    std::stable_sort(start_order_.begin(), start_order_.end(),
                     [&](std::size_t a, std::size_t b) { return runs_[a].spec->start_ns < runs_[b].spec->start_ns; });
    BuildEnvironments();
    return FindPrograms(error);
  }

  // Every program's file, found before anything starts: a missing one refuses the run.
  bool FindPrograms(std::string& error) {
    program_folder_ = ProgramFolder(s_.file);
    const bool any =
        std::any_of(runs_.begin(), runs_.end(), [](const ProcessRun& run) { return !run.spec->program.empty(); });
    if (!any) return true;
    program_paths_.assign(runs_.size(), std::string());
    for (const ProcessRun& run : runs_) {
      if (run.spec->program.empty()) continue;
      program_paths_[run.global] = FindProgram(run.spec->program[0], Env("PATH"), program_folder_, error);
      if (program_paths_[run.global].empty()) {
        error =
            "tenant '" + s_.tenants[run.tenant].name + "' process " + std::to_string(run.index) + ": program " + error;
        return false;
      }
    }
    return true;
  }

  bool MakeWorkDir(std::string& error) {
    if (!options_.work_dir.empty()) {
      work_ = options_.work_dir;
      std::error_code failed;
      std::filesystem::create_directories(work_, failed);
      if (failed) {
        error = "cannot create the work folder '" + work_ + "': " + failed.message();
        return false;
      }
    } else {
      const char* tmp = Env("TMPDIR");
      std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/vgpu-run.XXXXXX";
      if (mkdtemp(pattern.data()) == nullptr) {
        error = "cannot create a work folder '" + pattern + "': " + std::strerror(errno) +
                "; set TMPDIR or "
                "Options::work_dir to a writable folder";
        return false;
      }
      work_ = pattern;
      created_work_ = true;
    }
    // A fresh machine and fresh regions: what an earlier run in a given folder left must not count in this one.
    std::error_code ignored;
    std::filesystem::remove(work_ + "/machine", ignored);
    for (const scenario::TenantSpec& tenant : s_.tenants) std::filesystem::remove(RegionPath(tenant), ignored);
    return true;
  }

  // The entries of an inherited LD_PRELOAD (separated by spaces or colons) other than a libvgpu.so, each followed
  // by a space: the shim is added once, after them.
  static std::string KeptPreloads(std::string_view list) {
    std::string kept;
    while (!list.empty()) {
      const std::size_t end = list.find_first_of(" :");
      const std::string_view item = list.substr(0, end);
      list = end == std::string_view::npos ? std::string_view() : list.substr(end + 1);
      const std::size_t slash = item.rfind('/');
      const std::string_view base = slash == std::string_view::npos ? item : item.substr(slash + 1);
      if (item.empty() || base.substr(0, 10) == "libvgpu.so") continue;
      kept += item;
      kept += ' ';
    }
    return kept;
  }

  std::string RegionPath(const scenario::TenantSpec& tenant) const { return work_ + "/" + tenant.name + ".region"; }

  // The runner's environment without anything that would change what the shim or the fake GPU do, then ours.
  void BuildEnvironments() {
    static constexpr std::string_view kDropped[] = {"LD_PRELOAD",
                                                    "CUDA_VISIBLE_DEVICES",
                                                    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                                                    "CUDA_DEVICE_MEMORY_LIMIT",
                                                    "CUDA_DEVICE_SM_LIMIT",
                                                    "GPU_CORE_UTILIZATION_POLICY",
                                                    "CUDA_TASK_PRIORITY",
                                                    "VGPU_CONFIG_FILE",
                                                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                                    "CUDA_DEVICE_ORDER",
                                                    "VGPU_COMPUTE_SHARING",
                                                    "VGPU_SCHEDULE_FILE"};
    // Over fakecuda, the machine is ours; FAKECUDA_TRACE and FAKECUDA_LOG stay (they only observe).
    static constexpr std::string_view kDroppedFake[] = {"LD_LIBRARY_PATH=",       "FAKECUDA_STATE=",
                                                        "FAKECUDA_DEVICES=",      "FAKECUDA_TIMESLICE_US=",
                                                        "FAKECUDA_SWITCH_US=",    "FAKECUDA_FAULTS=",
                                                        "FAKECUDA_SEED=",         "FAKECUDA_MODE=",
                                                        "FAKECUDA_KERNEL_COSTS=", "FAKECUDA_DEFAULT_KERNEL_NS="};
    std::string library_path;
    std::string inherited_preload;  // the host's own preloads (a sanitizer runtime, a profiler) stay, ahead of the shim
    for (const std::string& entry : environment_) {
      const std::string_view text(entry);
      if (text.substr(0, 11) == "LD_PRELOAD=") inherited_preload = KeptPreloads(text.substr(11));
      // Prefixes: CUDA_DEVICE_MEMORY_LIMIT covers its _<i> forms too.
      bool drop = std::any_of(std::begin(kDropped), std::end(kDropped),
                              [&](std::string_view key) { return text.substr(0, key.size()) == key; });
      if (!s_.real_gpu) {
        if (text.substr(0, 16) == "LD_LIBRARY_PATH=") library_path = std::string(text.substr(16));
        drop = drop || std::any_of(std::begin(kDroppedFake), std::end(kDroppedFake),
                                   [&](std::string_view key) { return text.substr(0, key.size()) == key; });
      }
      if (!drop) base_environment_.emplace_back(text);
    }
    if (!s_.real_gpu) {
      base_environment_.push_back("LD_LIBRARY_PATH=" + install_ + "/lib" +
                                  (library_path.empty() ? "" : ":" + library_path));
      base_environment_.push_back("FAKECUDA_STATE=" + work_ + "/machine");
      base_environment_.push_back("FAKECUDA_DEVICES=" + devices_spec_);
      base_environment_.push_back("FAKECUDA_TIMESLICE_US=" +
                                  std::to_string(std::max<std::uint64_t>(1, s_.timeslice_ns / 1000)));
      base_environment_.push_back("FAKECUDA_SWITCH_US=" + std::to_string(s_.switch_ns / 1000));
    }
    tenant_environments_.clear();
    for (const scenario::TenantSpec& tenant : s_.tenants) {
      std::vector<std::string> environment = base_environment_;
      if (!s_.real_gpu && !s_.faults.empty()) {
        // The workloads' faults only: the sampler must keep seeing the machine.
        std::string rules;
        for (const std::string& rule : s_.faults) rules += (rules.empty() ? "" : ";") + rule;
        environment.push_back("FAKECUDA_FAULTS=" + rules);
        environment.push_back("FAKECUDA_SEED=" + std::to_string(s_.seed));
      }
      environment.push_back("LD_PRELOAD=" + inherited_preload + shim_);
      environment.push_back("CUDA_DEVICE_MEMORY_SHARED_CACHE=" + RegionPath(tenant));
      std::string visible;
      for (std::size_t i = 0; i < tenant.devices.size(); ++i) {
        if (i > 0) visible += ',';
        visible += std::to_string(tenant.devices[i]);
        // Per CUDA ordinal, as the HAMi device plugin writes them; memory in bytes.
        if (tenant.memory_limit_bytes != 0) {
          environment.push_back("CUDA_DEVICE_MEMORY_LIMIT_" + std::to_string(i) + "=" +
                                std::to_string(tenant.memory_limit_bytes));
        }
        if (tenant.cores_percent != 0) {
          environment.push_back("CUDA_DEVICE_SM_LIMIT_" + std::to_string(i) + "=" +
                                std::to_string(tenant.cores_percent));
        }
      }
      environment.push_back("CUDA_VISIBLE_DEVICES=" + visible);
      // NVML (the sampler, the device numbers in the trace) counts devices in PCI order; CUDA's default is fastest
      // first. On a machine of mixed GPUs they differ: make CUDA count as NVML does.
      environment.push_back("CUDA_DEVICE_ORDER=PCI_BUS_ID");
      environment.push_back(std::string("GPU_CORE_UTILIZATION_POLICY=") + scenario::PolicyName(tenant.policy));
      environment.push_back("CUDA_TASK_PRIORITY=" + std::to_string(tenant.priority));
      if (s_.sharing == scenario::Sharing::time_division) {
        environment.push_back("VGPU_COMPUTE_SHARING=time-division");
        environment.push_back("VGPU_SCHEDULE_FILE=" + work_ + "/vgpu-schedule");
      }
      tenant_environments_.push_back(std::move(environment));
    }
  }

  // ---- the sampler -------------------------------------------------------------------------------------

  bool StartSampler(std::string& error) {
    Spawned spawned;
    std::vector<std::string> argv = {sampler_binary_, "--devices", std::to_string(device_count_), "--every-ms",
                                     std::to_string(s_.sample_ns / kMillisecondNs)};
    if (!program_paths_.empty()) argv.push_back("--processes");  // programs' busy time (fakecuda)
    if (!Spawn(argv, base_environment_, true, spawned, error)) return false;
    sampler_pid_ = spawned.pid;
    sampler_in_ = spawned.in;
    sampler_out_.Adopt(spawned.out);
    sampler_err_.Adopt(spawned.err);
    gpu_.assign(device_count_, GpuView{});
    // Its first line says NVML works and names the devices (their UUIDs key the regions' device tables).
    const std::uint64_t deadline = MonotonicNs() + kSamplerStartNs;
    while (!sampler_ready_) {
      struct pollfd fds[2] = {{sampler_out_.fd(), POLLIN, 0}, {sampler_err_.fd(), POLLIN, 0}};
      poll(fds, 2, 50);
      ReadSampler();
      if (sampler_ready_) break;
      int status = 0;
      if (waitpid(sampler_pid_, &status, WNOHANG) == sampler_pid_) {
        sampler_pid_ = -1;
        ReadSampler();
        error = "vgpu-sampler stopped before its first sample (" + ExitText(status) + ")" + SamplerStderr() +
                "; over fakecuda check FAKECUDA_* and " + install_ + "/lib, on a real GPU the NVIDIA driver";
        return false;
      }
      if (MonotonicNs() > deadline) {
        error = "vgpu-sampler printed no sample within " + std::to_string(kSamplerStartNs / kSecondNs) + " s" +
                SamplerStderr();
        return false;
      }
    }
    return true;
  }

  std::string SamplerStderr() const { return sampler_stderr_.empty() ? std::string() : ": " + sampler_stderr_; }

  void ReadSampler() {
    sampler_out_.Drain([&](std::string_view line) {
      ParseSamplerLine(line, gpu_, &uuids_, &sampler_ready_);
      if (!program_paths_.empty()) TakeProgramReports(line);
    });
    sampler_err_.Drain([&](std::string_view line) {
      if (!line.empty()) sampler_stderr_ = std::string(line);
    });
  }

  void ParseSamplerLine(std::string_view line, std::vector<GpuView>& views, std::vector<std::string>* uuids,
                        bool* ready) const {
    const std::size_t list = line.find("\"devices\":[");
    if (list == std::string_view::npos) return;
    std::vector<GpuView> parsed;
    std::vector<std::string> names;
    std::string_view rest = line.substr(list);
    for (std::size_t open = rest.find('{'); open != std::string_view::npos; open = rest.find('{')) {
      const std::size_t close = rest.find('}', open);
      if (close == std::string_view::npos) break;
      const std::string_view object = rest.substr(open, close - open + 1);
      GpuView view;
      std::string uuid;
      if (!FindNumber(object, "util_percent", view.util_percent) ||
          !FindNumber(object, "memory_used_bytes", view.memory_used_bytes)) {
        return;
      }
      FindText(object, "uuid", uuid);
      parsed.push_back(view);
      names.push_back(uuid);
      rest = rest.substr(close + 1);
    }
    if (parsed.size() != device_count_) return;
    views = parsed;
    if (uuids != nullptr) *uuids = names;
    if (ready != nullptr) *ready = true;
  }

  void StopSampler() {
    if (sampler_in_ >= 0) close(sampler_in_);  // its cue to exit
    sampler_in_ = -1;
    if (sampler_pid_ <= 0) return;
    const std::uint64_t deadline = MonotonicNs() + 2 * kSecondNs;
    int status = 0;
    while (waitpid(sampler_pid_, &status, WNOHANG) == 0) {
      if (MonotonicNs() > deadline) {
        kill(sampler_pid_, SIGKILL);
        waitpid(sampler_pid_, &status, 0);
        break;
      }
      sampler_out_.Drain([](std::string_view) {});
      usleep(5000);
    }
    sampler_pid_ = -1;
  }

  // NVML's used memory once every tenant has gone, from a fresh sampler (NVML queries reap the fake machine's
  // dead processes first). False with `error_` set if it cannot be had.
  bool FinalNvml(std::vector<GpuView>& views) {
    Spawned spawned;
    std::string error;
    const std::vector<std::string> argv = {sampler_binary_, "--devices", std::to_string(device_count_), "--once"};
    if (!Spawn(argv, base_environment_, false, spawned, error)) {
      Fail("the final NVML reading: " + error);
      return false;
    }
    LineReader out, err;
    out.Adopt(spawned.out);
    err.Adopt(spawned.err);
    std::string last_error;
    bool got = false;
    const std::uint64_t deadline = MonotonicNs() + kSamplerStartNs;
    while ((out.open() || err.open()) && MonotonicNs() < deadline) {
      struct pollfd fds[2] = {{out.fd(), POLLIN, 0}, {err.fd(), POLLIN, 0}};
      poll(fds, 2, 50);
      out.Drain([&](std::string_view line) {
        if (!got) {
          std::vector<GpuView> parsed = views;
          bool ready = false;
          ParseSamplerLine(line, parsed, nullptr, &ready);
          if (ready) views = parsed;
          got = ready;
        }
      });
      err.Drain([&](std::string_view line) {
        if (!line.empty()) last_error = std::string(line);
      });
    }
    int status = 0;
    if (waitpid(spawned.pid, &status, WNOHANG) == 0) {
      kill(spawned.pid, SIGKILL);
      waitpid(spawned.pid, &status, 0);
    }
    if (!got) {
      Fail("the final NVML reading (vgpu-sampler --once) gave no sample (" + ExitText(status) + ")" +
           (last_error.empty() ? "" : ": " + last_error));
    }
    return got;
  }

  // ---- programs' busy time ------------------------------------------------------------------------------

  // A sampler line's figures as a report of each program running (or just ended): the GPU time on its device of
  // every process that is it or in its process group. The first line read after its exit gives its final figure.
  void TakeProgramReports(std::string_view line) {
    std::vector<ProcessBusy> entries;
    std::uint64_t t_abs = 0;
    if (!FindNumber(line, "t_ns", t_abs) || !ParseProcessBusy(line, entries)) return;
    for (std::size_t c = 0; c < children_.size(); ++c) {
      Child& child = children_[c];
      if (!child.program || !child.started || child.final_known) continue;
      std::uint64_t busy = 0;
      for (const ProcessBusy& entry : entries) {
        if (entry.device == child.run->device && OwnerOf(static_cast<pid_t>(entry.pid)) == c) busy += entry.busy_ns;
      }
      child.busy_ns = std::max(child.busy_ns, busy);  // cumulative: never goes back (a departed entry can age out)
      if (child.reports.empty() || t_abs > child.reports.back().t_ns) child.reports.push_back({t_abs, child.busy_ns});
      if (child.exited && t_abs >= child.exit_abs) {
        child.final_known = true;
        child.last = {child.exit_abs, child.busy_ns};
      }
    }
  }

  // The child a GPU process belongs to: the one it is, or the program whose process group it is in, looked up in
  // /proc when first seen (one gone before it was seen is nobody's). SIZE_MAX: none.
  std::size_t OwnerOf(pid_t pid) {
    for (const auto& [known, owner] : owners_) {
      if (known == pid) return owner;
    }
    std::size_t owner = SIZE_MAX;
    for (std::size_t c = 0; c < children_.size() && owner == SIZE_MAX; ++c) {
      if (children_[c].started && children_[c].pid == pid) owner = c;
    }
    if (owner == SIZE_MAX) {
      const pid_t group = ProcessGroupOf(pid);
      for (std::size_t c = 0; c < children_.size() && owner == SIZE_MAX && group > 0; ++c) {
        if (children_[c].program && children_[c].started && children_[c].pid == group) owner = c;
      }
    }
    owners_.emplace_back(pid, owner);
    return owner;
  }

  // ---- the schedule -----------------------------------------------------------------------------------

  void Loop() {
    t0_ = MonotonicNs();
    const std::uint64_t samples = s_.duration_ns / s_.sample_ns;
    const std::uint64_t report_ns = s_.sample_ns;
    // A sample waits for a report after its instant from every process, at most this long (a process stuck in
    // a long kernel or a shim sleep reports late; its last report then stands).
    const std::uint64_t sample_wait_ns = 3 * report_ns + 100 * kMillisecondNs;
    std::size_t next_start = 0;
    std::uint64_t next_sample = 0;
    std::uint64_t next_progress = t0_ + kSecondNs;
    for (;;) {
      std::uint64_t now = MonotonicNs();
      if (!stopping_ && options_.cancel != nullptr && options_.cancel->load()) {
        Fail("cancelled at " + std::to_string((now - t0_) / kMillisecondNs) + " ms of " +
             std::to_string(s_.duration_ns / kMillisecondNs) + " ms");
      }
      if (stopping_) {
        for (Child& child : children_) {
          if (child.started && !child.exited && !child.killed_on_cancel && !child.killed_at_crash) {
            child.killed_on_cancel = true;
            child.kill_abs = now;
            Signal(child, SIGKILL);
          }
        }
      }
      // Starts due now, in schedule order.
      while (!stopping_ && next_start < start_order_.size() &&
             t0_ + runs_[start_order_[next_start]].spec->start_ns <= now) {
        StartProcess(children_[start_order_[next_start]], now);
        ++next_start;
        now = MonotonicNs();
      }
      // Crashes and hung processes.
      for (Child& child : children_) {
        if (!child.started || child.exited) continue;
        const scenario::ProcessSpec& spec = *child.run->spec;
        if (spec.crash_at_ns && !child.killed_at_crash && t0_ + *spec.crash_at_ns <= now) {
          child.killed_at_crash = true;
          child.kill_abs = now;
          Signal(child, SIGKILL);
        }
        if (child.program && !child.terminated_at_stop && t0_ + spec.stop_ns <= now) {
          child.terminated_at_stop = true;  // asked to end at its stop: vgpu-tenant ends there by itself
          Signal(child, SIGTERM);
        }
        if (!child.killed_late && t0_ + spec.stop_ns + kGraceNs <= now) {
          child.killed_late = true;
          child.kill_abs = now;
          Signal(child, SIGKILL);
        }
      }
      ReadChildren();
      ReapChildren();
      ReadSampler();
      if (!stopping_ && sampler_pid_ > 0) {
        int status = 0;
        if (waitpid(sampler_pid_, &status, WNOHANG) == sampler_pid_) {
          sampler_pid_ = -1;
          ReadSampler();
          Fail("vgpu-sampler stopped during the run (" + ExitText(status) + ")" + SamplerStderr());
        }
      }
      // Samples due now: memory and NVML as they are now; busy time once the processes have reported past it.
      now = MonotonicNs();
      while (!stopping_ && next_sample <= samples && t0_ + next_sample * s_.sample_ns <= now) {
        TakeSample(next_sample, t0_ + next_sample * s_.sample_ns);
        ++next_sample;
      }
      FlushTrace(now, sample_wait_ns);
      if (options_.progress && now >= next_progress) {
        std::size_t running = 0;
        for (const Child& child : children_) running += child.started && !child.exited ? 1 : 0;
        const double fraction = std::min(0.99, static_cast<double>(now - t0_) / static_cast<double>(s_.duration_ns));
        try {
          options_.progress(fraction, "t = " + std::to_string((now - t0_) / kMillisecondNs) + " ms, " +
                                          std::to_string(running) + " process(es) running");
        } catch (const std::exception& exception) {
          // Stopped like a cancel: the processes are killed and waited for, the trace gets its end line.
          if (!stopping_) Fail(std::string("the progress callback failed: ") + exception.what());
        } catch (...) {
          if (!stopping_) Fail("the progress callback failed");
        }
        next_progress += kSecondNs;
      }
      const bool all_ended = std::all_of(children_.begin(), children_.end(), [&](const Child& child) {
        return child.exited || (!child.started && (stopping_ || next_start >= start_order_.size()));
      });
      if (all_ended && (stopping_ || next_sample > samples) && pending_.empty()) break;

      // Sleep until the next thing to do, and no longer than kLoopMaxWaitNs; wake early for pipe data.
      std::uint64_t wake = now + kLoopMaxWaitNs;
      if (!stopping_ && next_start < start_order_.size()) {
        wake = std::min(wake, t0_ + runs_[start_order_[next_start]].spec->start_ns);
      }
      if (!stopping_ && next_sample <= samples) wake = std::min(wake, t0_ + next_sample * s_.sample_ns);
      for (const Child& child : children_) {
        if (child.started && !child.exited && child.run->spec->crash_at_ns && !child.killed_at_crash) {
          wake = std::min(wake, t0_ + *child.run->spec->crash_at_ns);
        }
        if (child.started && !child.exited && child.program && !child.terminated_at_stop) {
          wake = std::min(wake, t0_ + child.run->spec->stop_ns);
        }
      }
      WaitForInput(wake);
    }
  }

  void WaitForInput(std::uint64_t wake_abs) {
    std::vector<struct pollfd> fds;
    for (const Child& child : children_) {
      if (child.out.open()) fds.push_back({child.out.fd(), POLLIN, 0});
      if (child.err.open()) fds.push_back({child.err.fd(), POLLIN, 0});
    }
    if (sampler_out_.open()) fds.push_back({sampler_out_.fd(), POLLIN, 0});
    if (sampler_err_.open()) fds.push_back({sampler_err_.fd(), POLLIN, 0});
    const std::uint64_t now = MonotonicNs();
    const std::uint64_t wait = wake_abs > now ? wake_abs - now : 0;
    struct timespec timeout {};
    timeout.tv_sec = static_cast<time_t>(wait / kSecondNs);
    timeout.tv_nsec = static_cast<long>(wait % kSecondNs);
    ppoll(fds.data(), fds.size(), &timeout, nullptr);
  }

  void StartProcess(Child& child, std::uint64_t now) {
    const ProcessRun& run = *child.run;
    const scenario::ProcessSpec& spec = *run.spec;
    child.program = !spec.program.empty();
    Spawned spawned;
    std::string error;
    const bool spawned_ok =
        child.program
            ? Spawn(ProgramArgv(run), tenant_environments_[run.tenant], false, spawned, error, program_folder_)
            : Spawn(TenantArgv(run), tenant_environments_[run.tenant], false, spawned, error);
    if (!spawned_ok) {
      Fail("tenant '" + s_.tenants[run.tenant].name + "' process " + std::to_string(run.index) + ": " + error);
      return;
    }
    child.pid = spawned.pid;
    child.out.Adopt(spawned.out);
    child.err.Adopt(spawned.err);
    child.started = true;
    child.start_abs = now;
    Emit(now, Line("process")
                  .Text("tenant", s_.tenants[run.tenant].name)
                  .Number("process", run.index)
                  .Number("pid", static_cast<std::uint64_t>(child.pid))
                  .Number("device", run.device)
                  .Number("t_ns", now - t0_)
                  .Done());
  }

  // The program's words, its first resolved when the run was prepared (program_paths_).
  std::vector<std::string> ProgramArgv(const ProcessRun& run) const {
    std::vector<std::string> argv = run.spec->program;
    argv[0] = program_paths_[run.global];
    return argv;
  }

  std::vector<std::string> TenantArgv(const ProcessRun& run) const {
    const scenario::ProcessSpec& spec = *run.spec;
    std::vector<std::string> argv = {tenant_binary_, "--device", std::to_string(spec.device)};
    if (spec.alloc_bytes != 0) argv.insert(argv.end(), {"--alloc", std::to_string(spec.alloc_bytes)});
    argv.insert(argv.end(), {"--seconds", FormatSeconds(spec.stop_ns - spec.start_ns)});
    for (std::size_t w = 0; w < spec.work.size(); ++w) {
      // The tenant's ranks that run this phase form one group: the same id in each of them.
      const std::uint64_t group = (run.tenant + 1ull) * 1000 + w + 1;
      argv.insert(argv.end(), {"--phase", PhaseArgument(spec.work[w], group)});
    }
    if (spec.repeat) argv.push_back("--repeat");
    argv.insert(argv.end(), {"--seed", std::to_string(s_.seed + run.global), "--report-ms",
                             std::to_string(s_.sample_ns / kMillisecondNs)});
    return argv;
  }

  void ReadChildren() {
    for (Child& child : children_) ReadChild(child);
  }

  void ReadChild(Child& child) {
    child.out.Drain([&](std::string_view line) {
      if (child.program) return;  // a program's output is its own; its busy time comes from the sampler
      std::string event;
      if (FindText(line, "ev", event)) {
        Report report{};
        if (event == "report" && FindNumber(line, "t_ns", report.t_ns) && FindNumber(line, "busy_ns", report.busy_ns)) {
          child.busy_ns = std::max(child.busy_ns, report.busy_ns);
          report.busy_ns = child.busy_ns;  // cumulative: never goes back
          child.reports.push_back(report);
        }
        return;
      }
      std::string status;
      if (FindText(line, "status", status)) child.result_status = status;
      std::uint64_t busy = 0;
      if (FindNumber(line, "busy_ns", busy)) child.busy_ns = std::max(child.busy_ns, busy);
    });
    child.err.Drain([&](std::string_view line) {
      if (line.empty()) return;
      child.err_tail.emplace_back(line);
      if (child.err_tail.size() > kStderrLinesKept) child.err_tail.pop_front();
    });
  }

  void ReapChildren() {
    for (Child& child : children_) {
      if (!child.started || child.exited) continue;
      int status = 0;
      const pid_t done = waitpid(child.pid, &status, WNOHANG);
      if (done == -1 && errno == ECHILD) {
        // Someone else reaped it (a host that ignores SIGCHLD, or waits for any child): it has ended, how is
        // unknown. Reported as an error rather than waited for forever.
        status = W_EXITCODE(255, 0);
        child.reaped_elsewhere = true;
      } else if (done != child.pid) {
        continue;
      }
      child.exited = true;
      child.exit_abs = MonotonicNs();
      child.wait_status = status;
      ReadChild(child);                                   // what it wrote before it ended
      if (!child.program) child.last = LastPoint(child);  // a program's comes with the next sampler line
      // What a program leaves behind in its process group ends with it, as a container's processes end with its
      // main one (else they would outlive the run: only the program itself dies with the runner).
      if (child.program) kill(-child.pid, SIGKILL);
      WriteExit(child);
    }
  }

  void WriteExit(const Child& child) {  // and its oom line, if it ran out of memory
    const ProcessRun& run = *child.run;
    const std::string& name = s_.tenants[run.tenant].name;
    const int status = child.wait_status;
    const bool by_sigkill = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    const std::uint64_t t = child.exit_abs - t0_;
    std::string text_status = "error";
    std::int64_t code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
    std::string message;
    if (child.reaped_elsewhere) {
      message =
          "its exit status was taken by someone else in this process (SIGCHLD ignored, or a wait for any "
          "child): how it ended is unknown";
      code = -1;
    } else if (by_sigkill && child.killed_late) {
      // Hung: an error of the run, but not one that stops the others.
      message = "still running " + std::to_string(kGraceNs / kSecondNs) + " s after its stop time: killed";
      late_errors_ +=
          (late_errors_.empty() ? "" : "; ") + ("tenant '" + name + "' process " + std::to_string(run.index) +
                                                " (pid " + std::to_string(child.pid) + ") " + message);
    } else if (by_sigkill && (child.killed_at_crash || child.killed_on_cancel)) {
      text_status = "killed";
      code = kKilledCode;
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      text_status = "ok";
    } else if (child.program && child.terminated_at_stop) {
      text_status = "ok";  // it ran until its stop, and ended when asked to (the code says how)
    } else if (child.result_status == "oom") {
      text_status = "oom";
      Emit(child.exit_abs, Line("oom")
                               .Number("t_ns", t)
                               .Text("tenant", name)
                               .Number("process", run.index)
                               .Number("bytes", run.spec->alloc_bytes)
                               .Done());
    } else {
      message = ExitText(status);
      for (const std::string& line : child.err_tail) message += "; " + line;
    }
    base::JsonLine line = Line("exit");
    line.Number("t_ns", t)
        .Text("tenant", name)
        .Number("process", run.index)
        .Text("status", text_status)
        .Signed("code", code);
    if (!message.empty()) line.Text("message", message);
    Emit(child.exit_abs, line.Done());
  }

  // ---- samples ----------------------------------------------------------------------------------------

  void TakeSample(std::uint64_t k, std::uint64_t t_abs) {
    PendingSample sample;
    sample.k = k;
    sample.t_abs = t_abs;
    sample.gpu = gpu_;
    for (const scenario::TenantSpec& tenant : s_.tenants) {
      std::vector<std::uint64_t> memory(tenant.devices.size(), 0);
      const std::string path = RegionPath(tenant);
      if (access(path.c_str(), F_OK) == 0) {  // the shim creates it when the tenant's first process starts
        region::Snapshot snapshot;
        std::string error;
        if (!region::ReadSnapshot(path, snapshot, error)) {
          Fail("tenant '" + tenant.name + "': " + error);
        } else {
          for (const region::DeviceSnapshot& device : snapshot.devices) {
            const int physical = PhysicalDevice(device.uuid);
            for (std::size_t i = 0; i < tenant.devices.size(); ++i) {
              if (physical >= 0 && tenant.devices[i] == static_cast<std::uint32_t>(physical)) {
                memory[i] += device.used_bytes;
              }
            }
          }
        }
      }
      sample.memory.push_back(std::move(memory));
    }
    pending_.push_back(std::move(sample));
  }

  int PhysicalDevice(const std::uint8_t uuid[16]) const {
    const std::string text = vgpu::base::GpuUuidText(uuid);
    for (std::size_t i = 0; i < uuids_.size(); ++i) {
      if (SameText(uuids_[i], text)) return static_cast<int>(i);
    }
    return -1;
  }

  // A process that exits by itself reports once more after its last kernel: its busy time is known to its end.
  // One killed with SIGKILL ran on after its last report, up to a period, and never says what it did: its busy
  // time at the kill is estimated at the rate of its last report period (never above the time elapsed), rather
  // than counted as nothing, which would take up to a period's worth from the window of the kill.
  static Report LastPoint(const Child& child) {
    if (child.kill_abs == 0 || child.reports.size() < 2) return {child.exit_abs, child.busy_ns};
    const Report& newest = child.reports.back();
    const Report& before = child.reports[child.reports.size() - 2];
    if (child.kill_abs <= newest.t_ns || newest.t_ns <= before.t_ns) return {child.exit_abs, child.busy_ns};
    const double rate =
        static_cast<double>(newest.busy_ns - before.busy_ns) / static_cast<double>(newest.t_ns - before.t_ns);
    const std::uint64_t since = child.kill_abs - newest.t_ns;
    const auto more = static_cast<std::uint64_t>(std::llround(std::min(1.0, rate) * static_cast<double>(since)));
    return {child.kill_abs, child.busy_ns + std::min(more, since)};
  }

  // Whether every process has told what it had done by `t_abs`: it reported at or after it, it has ended (a
  // program: and a sampler line since gave its busy time to its end), it had not started, or we have waited long
  // enough.
  bool Reported(const Child& child, std::uint64_t t_abs) const {
    if (!child.started || child.start_abs > t_abs) return true;
    if (child.exited && (!child.program || child.final_known)) return true;
    return !child.reports.empty() && child.reports.back().t_ns >= t_abs;
  }

  // The process's busy time at `t_abs`, interpolated between its reports around it: reports come every period
  // from the process's own start, not at the runner's sample instants.
  static std::uint64_t BusyAt(const Child& child, std::uint64_t t_abs) {
    if (!child.started || child.start_abs > t_abs) return 0;
    Report before{child.start_abs, 0};
    const Report* after = nullptr;
    for (const Report& report : child.reports) {
      if (report.t_ns <= t_abs) {
        before = report;
      } else {
        after = &report;
        break;
      }
    }
    if (after == nullptr && child.exited && child.last.t_ns > t_abs) after = &child.last;
    if (after == nullptr && child.exited) return std::max(before.busy_ns, child.last.busy_ns);
    if (after == nullptr) return before.busy_ns;
    if (after->t_ns <= before.t_ns) return after->busy_ns;
    const double fraction = static_cast<double>(t_abs - before.t_ns) / static_cast<double>(after->t_ns - before.t_ns);
    return before.busy_ns +
           static_cast<std::uint64_t>(std::llround(fraction * static_cast<double>(after->busy_ns - before.busy_ns)));
  }

  void WriteSample(const PendingSample& sample) {
    const std::uint64_t t = sample.t_abs - t0_;
    for (std::uint32_t tn = 0; tn < s_.tenants.size(); ++tn) {
      const scenario::TenantSpec& tenant = s_.tenants[tn];
      for (std::size_t i = 0; i < tenant.devices.size(); ++i) {
        std::uint64_t busy = 0;
        for (const Child& child : children_) {
          if (child.run->tenant == tn && child.run->device == tenant.devices[i]) busy += BusyAt(child, sample.t_abs);
        }
        trace_.Write(Line("sample")
                         .Number("t_ns", t)
                         .Text("tenant", tenant.name)
                         .Number("device", tenant.devices[i])
                         .Number("busy_ns", busy)
                         .Number("memory_bytes", sample.memory[tn][i])
                         .Done());
      }
    }
    for (std::uint32_t d = 0; d < device_count_; ++d) {
      trace_.Write(Line("gpu")
                       .Number("t_ns", t)
                       .Number("device", d)
                       .Number("util_percent", sample.gpu[d].util_percent)
                       .Number("memory_used_bytes", sample.gpu[d].memory_used_bytes)
                       .Done());
    }
  }

  // Events go out in time order around the samples: an event waits while a sample at or before it still waits
  // for reports.
  void Emit(std::uint64_t t_abs, std::string text) { events_.push_back({t_abs, std::move(text)}); }

  void FlushTrace(std::uint64_t now, std::uint64_t sample_wait_ns) {
    std::size_t written = 0;
    const auto write_events_until = [&](std::uint64_t limit_abs, bool inclusive) {
      while (written < events_.size() &&
             (inclusive ? events_[written].t_abs <= limit_abs : events_[written].t_abs < limit_abs)) {
        trace_.Write(events_[written++].text);
      }
    };
    while (!pending_.empty()) {
      const PendingSample& sample = pending_.front();
      const bool ready = stopping_ || now >= sample.t_abs + sample_wait_ns ||
                         std::all_of(children_.begin(), children_.end(),
                                     [&](const Child& child) { return Reported(child, sample.t_abs); });
      if (!ready) break;
      write_events_until(sample.t_abs, true);
      WriteSample(sample);
      pending_.pop_front();
    }
    if (pending_.empty()) {
      write_events_until(UINT64_MAX, true);
    } else {
      write_events_until(pending_.front().t_abs, true);
    }
    events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(written));
    // Reports behind the oldest sample still to write are needed no more, but the last of them.
    const std::uint64_t keep_from = pending_.empty() ? now : pending_.front().t_abs;
    for (Child& child : children_) {
      std::size_t drop = 0;
      while (drop + 1 < child.reports.size() && child.reports[drop + 1].t_ns <= keep_from) ++drop;
      if (drop > 64) {
        child.reports.erase(child.reports.begin(), child.reports.begin() + static_cast<std::ptrdiff_t>(drop));
      }
    }
  }

  // ---- the end ----------------------------------------------------------------------------------------

  void Finish() {
    const std::uint64_t end_abs = MonotonicNs();
    StopSampler();
    // What is still held once every process has ended: in the regions (live slots only), and over fakecuda what
    // NVML reports used beyond the driver's reserve.
    std::uint64_t leaked = 0;
    for (const scenario::TenantSpec& tenant : s_.tenants) {
      const std::string path = RegionPath(tenant);
      if (access(path.c_str(), F_OK) != 0) continue;
      region::Snapshot snapshot;
      std::string error;
      if (!region::ReadSnapshot(path, snapshot, error)) {
        Fail("tenant '" + tenant.name + "' at the end: " + error);
        continue;
      }
      for (const region::DeviceSnapshot& device : snapshot.devices) leaked += device.used_bytes;
    }
    if (!s_.real_gpu) {
      // fakecuda's NVML reaps dead processes at most every 100 ms (its queries share one clock in the machine),
      // so a process killed a moment ago may still be counted: look again a little later before calling it a
      // leak, for up to kLeakSettleNs.
      const std::uint64_t give_up = MonotonicNs() + kLeakSettleNs;
      std::uint64_t excess = 0;
      for (;;) {
        std::vector<GpuView> views(device_count_);
        if (!FinalNvml(views)) break;
        excess = 0;
        for (std::uint32_t d = 0; d < device_count_; ++d) {
          excess += views[d].memory_used_bytes - std::min(views[d].memory_used_bytes, reserved_bytes_[d]);
        }
        if (excess == 0 || MonotonicNs() >= give_up) break;
        usleep(static_cast<useconds_t>(kReapPeriodNs / 1000));
      }
      leaked += excess;
    }
    const double wall = static_cast<double>(MonotonicNs() - t0_) / static_cast<double>(kSecondNs);
    trace_.Write(Line("end")
                     .Number("t_ns", end_abs - t0_)
                     .Number("leaked_bytes", leaked)
                     .Number("seconds_wall", static_cast<std::uint64_t>(std::llround(wall)))
                     .Done());
  }

  // The first failure is the run's error; it also stops the run: every process is killed, the trace closed.
  void Fail(const std::string& error) {
    if (error_.empty()) error_ = error;
    stopping_ = true;
  }

  const scenario::Scenario& s_;
  const Options& options_;
  std::vector<std::string> environment_;  // the run's environment (Prepare)
  TraceSink& trace_;
  std::string install_, tenant_binary_, sampler_binary_, shim_;
  std::string work_;
  bool created_work_ = false;
  bool remove_work_ = true;
  std::uint32_t device_count_ = 0;
  std::string devices_spec_;  // FAKECUDA_DEVICES
  std::vector<std::uint64_t> reserved_bytes_;
  std::vector<std::string> base_environment_;
  std::vector<std::vector<std::string>> tenant_environments_;
  std::vector<ProcessRun> runs_;
  std::vector<Child> children_;
  std::vector<std::size_t> start_order_;
  std::vector<std::string> program_paths_;  // by ProcessRun::global: a program's file ("" for vgpu-tenant); empty
                                            // when the scenario has no program
  std::string program_folder_;              // where programs run: the scenario file's folder
  std::vector<std::pair<pid_t, std::size_t>> owners_;  // OwnerOf's answers
  pid_t sampler_pid_ = -1;
  int sampler_in_ = -1;
  LineReader sampler_out_, sampler_err_;
  std::string sampler_stderr_;
  bool sampler_ready_ = false;
  std::vector<GpuView> gpu_;
  std::vector<std::string> uuids_;
  std::uint64_t t0_ = 0;
  std::deque<PendingSample> pending_;
  std::vector<TimedLine> events_;
  bool stopping_ = false;
  std::string error_;
  std::string late_errors_;
};

}  // namespace

Outcome RunLive(const scenario::Scenario& scenario, const Options& options, TraceSink& trace) {
  LiveRun run(scenario, options, trace);
  return run.Run();
}

}  // namespace vgpu::runner::internal
