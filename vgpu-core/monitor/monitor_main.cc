// vgpu-monitor: the node side of the limits (docs/node-monitor.md). Every period it reads NVML's per-process figures
// and /proc, judges each container (monitor.h) and writes its verdict; with --action kill it ends the largest process
// of a container the driver shows over its memory limit.
//
//   vgpu-monitor --containers /etc/vgpu/containers --verdicts /run/vgpu/verdicts [--period-ms 100]
//                [--action report|kill] [--periods N] [--log-level 0..4]
//                [--metrics-port PORT [--metrics-address ADDR] [--hami-metrics]]   (docs/metrics.md)
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <nvml.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "vgpu/base/clock.h"
#include "vgpu/monitor/metrics.h"
#include "vgpu/monitor/metrics_server.h"
#include "vgpu/monitor/monitor.h"
#include "vgpu/verdict/verdict.h"
#include "vgpu/verdict/verdict_file.h"

namespace {

using vgpu::monitor::Container;
using vgpu::monitor::Reading;

volatile sig_atomic_t g_stop = 0;
int g_log_level = 1;

void Log(int level, const char* format, ...) __attribute__((format(printf, 2, 3)));
void Log(int level, const char* format, ...) {
  if (level > g_log_level) return;
  std::fprintf(stderr, "vgpu-monitor: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
}

std::uint64_t Now(clockid_t clock) { return vgpu::base::ClockNs(clock); }

struct Options {
  std::string containers;
  std::string verdicts;
  std::uint64_t period_ms = 100;
  bool kill = false;
  std::uint64_t periods = 0;  // 0: until SIGTERM or SIGINT
  int metrics_port = -1;      // -1: no metrics served
  std::string metrics_address = "0.0.0.0";
  bool hami_metrics = false;
};

const char* const kUsage =
    "usage: vgpu-monitor --containers DIR --verdicts DIR [--period-ms 10..60000] [--action report|kill] "
    "[--periods N] [--log-level 0..4] [--metrics-port PORT [--metrics-address ADDR] [--hami-metrics]]\n"
    "  --containers DIR  one <name>.conf per container: VGPU_CGROUP=..., VGPU_DEVICES=... (optional) and its limits\n"
    "                    (CUDA_DEVICE_MEMORY_LIMIT, CUDA_DEVICE_SM_LIMIT, ...): docs/node-monitor.md\n"
    "  --verdicts DIR    where <name>/verdict is written for each container (mounted read-only into it)\n"
    "  --action kill     also SIGKILL the largest process of a container over its memory limit, one per period\n"
    "  --periods N       stop after N periods (default: run until SIGTERM or SIGINT)\n"
    "  --metrics-port PORT     serve Prometheus' text at http://ADDR:PORT/metrics (0: a free port, logged):\n"
    "                          docs/metrics.md\n"
    "  --metrics-address ADDR  the IPv4 address to serve on (default 0.0.0.0)\n"
    "  --hami-metrics          also HAMi's hami_* series, from each container's VGPU_CACHE file\n"
    "  --cgroup-of PID   print the cgroup path the monitor sees for a process (what VGPU_CGROUP names), and exit\n";

bool ParseCount(const char* text, std::uint64_t low, std::uint64_t high, std::uint64_t& value) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long parsed = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || parsed < low || parsed > high) return false;
  value = parsed;
  return true;
}

bool ReadSmall(const std::string& path, std::string& text) {
  bool missing = false;
  std::string error;
  return vgpu::verdict::ReadWhole(path, text, missing, error);
}

// False (and a message on stderr naming the option, the value and what is accepted) on bad input.
bool ParseOptions(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--help" || name == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (name == "--cgroup-of") {
      // What the monitor takes a process's cgroup to be (for writing VGPU_CGROUP): printed, then exit.
      std::uint64_t pid = 0;
      std::string text, path;
      if (i + 1 >= argc || !ParseCount(argv[i + 1], 1, UINT32_MAX, pid)) {
        std::fprintf(stderr, "vgpu-monitor: --cgroup-of needs a pid (a whole number from 1); e.g. --cgroup-of 1\n");
        std::exit(2);
      }
      if (!ReadSmall("/proc/" + std::to_string(pid) + "/cgroup", text) || !vgpu::monitor::CgroupPath(text, path)) {
        std::fprintf(stderr,
                     "vgpu-monitor: no cgroup path for process %llu (gone, or /proc/%llu/cgroup has neither a "
                     "unified nor a memory line)\n",
                     static_cast<unsigned long long>(pid), static_cast<unsigned long long>(pid));
        std::exit(1);
      }
      std::printf("%s\n", path.c_str());
      std::exit(0);
    }
    if (name == "--hami-metrics") {
      options.hami_metrics = true;
      continue;
    }
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    if (value == nullptr) {
      std::fprintf(stderr, "vgpu-monitor: %s needs a value\n%s", name.c_str(), kUsage);
      return false;
    }
    ++i;
    std::uint64_t number = 0;
    if (name == "--containers") {
      options.containers = value;
    } else if (name == "--verdicts") {
      options.verdicts = value;
    } else if (name == "--period-ms") {
      if (!ParseCount(value, 10, 60000, number)) {
        std::fprintf(stderr, "vgpu-monitor: --period-ms '%s' is not a whole number of ms from 10 to 60000; e.g. 100\n",
                     value);
        return false;
      }
      options.period_ms = number;
    } else if (name == "--action") {
      if (std::strcmp(value, "report") != 0 && std::strcmp(value, "kill") != 0) {
        std::fprintf(stderr, "vgpu-monitor: --action '%s' is not report or kill\n", value);
        return false;
      }
      options.kill = std::strcmp(value, "kill") == 0;
    } else if (name == "--periods") {
      if (!ParseCount(value, 1, UINT32_MAX, number)) {
        std::fprintf(stderr, "vgpu-monitor: --periods '%s' is not a whole number from 1; e.g. 10\n", value);
        return false;
      }
      options.periods = number;
    } else if (name == "--metrics-port") {
      if (!ParseCount(value, 0, 65535, number)) {
        std::fprintf(stderr, "vgpu-monitor: --metrics-port '%s' is not a port number from 0 to 65535; e.g. 9394\n",
                     value);
        return false;
      }
      options.metrics_port = static_cast<int>(number);
    } else if (name == "--metrics-address") {
      in_addr parsed{};
      if (inet_pton(AF_INET, value, &parsed) != 1) {
        std::fprintf(stderr, "vgpu-monitor: --metrics-address '%s' is not an IPv4 address; e.g. 0.0.0.0 or 127.0.0.1\n",
                     value);
        return false;
      }
      options.metrics_address = value;
    } else if (name == "--log-level") {
      if (!ParseCount(value, 0, 4, number)) {
        std::fprintf(stderr, "vgpu-monitor: --log-level '%s' is not 0, 1, 2, 3 or 4\n", value);
        return false;
      }
      g_log_level = static_cast<int>(number);
    } else {
      std::fprintf(stderr, "vgpu-monitor: unknown option '%s'\n%s", name.c_str(), kUsage);
      return false;
    }
  }
  if (options.containers.empty() || options.verdicts.empty()) {
    std::fprintf(stderr, "vgpu-monitor: --containers and --verdicts are required\n%s", kUsage);
    return false;
  }
  if (options.hami_metrics && options.metrics_port < 0) {
    std::fprintf(stderr, "vgpu-monitor: --hami-metrics needs --metrics-port (the series are served there)\n");
    return false;
  }
  return true;
}

// The containers folder, read again every period. A file that does not parse is reported once per content.
class ContainerFiles {
 public:
  explicit ContainerFiles(std::string folder) : folder_(std::move(folder)) {}

  std::vector<Container> Load() {
    std::vector<Container> containers;
    DIR* dir = opendir(folder_.c_str());
    if (dir == nullptr) {
      if (!folder_reported_) Log(1, "cannot read the containers folder %s: %s", folder_.c_str(), std::strerror(errno));
      folder_reported_ = true;
      return containers;
    }
    folder_reported_ = false;
    std::vector<std::string> names;
    while (const dirent* entry = readdir(dir)) {
      const std::string file = entry->d_name;
      if (file.size() > 5 && file.compare(file.size() - 5, 5, ".conf") == 0 && file.front() != '.')
        names.push_back(file);
    }
    closedir(dir);
    std::sort(names.begin(), names.end());
    for (const std::string& file : names) {
      const std::string path = folder_ + "/" + file;
      std::string text;
      if (!ReadSmall(path, text)) continue;
      Container container;
      std::string error;
      if (!vgpu::monitor::ParseContainer(file.substr(0, file.size() - 5), text, path, container, error)) {
        if (reported_[path] != text) {
          Log(1, "container file %s: %s (its container is not judged until the file is fixed)", path.c_str(),
              error.c_str());
        }
        reported_[path] = text;
        continue;
      }
      reported_.erase(path);
      containers.push_back(std::move(container));
    }
    return containers;
  }

 private:
  std::string folder_;
  bool folder_reported_ = false;
  std::map<std::string, std::string> reported_;
};

// NVML, loaded at run time (the node's driver, or fakecuda's under test).
struct Nvml {
  decltype(&nvmlInit_v2) init = nullptr;
  decltype(&nvmlDeviceGetCount_v2) count = nullptr;
  decltype(&nvmlDeviceGetHandleByIndex_v2) handle = nullptr;
  decltype(&nvmlDeviceGetUUID) uuid = nullptr;
  decltype(&nvmlDeviceGetComputeRunningProcesses_v3) processes = nullptr;
  decltype(&nvmlDeviceGetProcessUtilization) utilization = nullptr;
  decltype(&nvmlDeviceGetMemoryInfo) memory = nullptr;
  decltype(&nvmlDeviceGetUtilizationRates) utilization_rates = nullptr;
  decltype(&nvmlErrorString) error_string = nullptr;

  bool Load(std::string& error) {
    void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      error = std::string("cannot load libnvidia-ml.so.1: ") + (why != nullptr ? why : "unknown");
      return false;
    }
    const auto get = [&](auto& function, const char* name) {
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(library, name));
      if (function == nullptr) error = std::string("libnvidia-ml.so.1 has no ") + name;
      return function != nullptr;
    };
    return get(init, "nvmlInit_v2") && get(count, "nvmlDeviceGetCount_v2") &&
           get(handle, "nvmlDeviceGetHandleByIndex_v2") && get(uuid, "nvmlDeviceGetUUID") &&
           get(processes, "nvmlDeviceGetComputeRunningProcesses_v3") &&
           get(utilization, "nvmlDeviceGetProcessUtilization") && get(memory, "nvmlDeviceGetMemoryInfo") &&
           get(utilization_rates, "nvmlDeviceGetUtilizationRates") && get(error_string, "nvmlErrorString");
  }
  const char* Why(nvmlReturn_t r) const { return error_string != nullptr ? error_string(r) : "?"; }
};

// One device's figures this period, or false (reported at log level 2) when NVML would not give them.
// The device's process list (false: NVML would not give it, or gave more entries than room).
bool ReadProcesses(const Nvml& nvml, nvmlDevice_t device, std::vector<nvmlProcessInfo_t>& processes) {
  processes.assign(64, nvmlProcessInfo_t{});
  for (int attempt = 0;; ++attempt) {
    unsigned count = static_cast<unsigned>(processes.size());
    const nvmlReturn_t r = nvml.processes(device, &count, processes.data());
    if (r == NVML_ERROR_INSUFFICIENT_SIZE && attempt < 3 && count > processes.size() && count <= 65536) {
      processes.resize(count + 16);
      continue;
    }
    if (r != NVML_SUCCESS || count > processes.size()) return false;
    processes.resize(count);
    std::sort(processes.begin(), processes.end(),
              [](const nvmlProcessInfo_t& a, const nvmlProcessInfo_t& b) { return a.pid < b.pid; });
    return true;
  }
}

bool SameProcesses(const std::vector<nvmlProcessInfo_t>& a, const std::vector<nvmlProcessInfo_t>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const nvmlProcessInfo_t& x, const nvmlProcessInfo_t& y) {
    return x.pid == y.pid && x.usedGpuMemory == y.usedGpuMemory;
  });
}

struct Sample {
  unsigned long long timestamp_us;
  unsigned pid;
  unsigned percent;
};

// A device's NVML samples of the last verdict::kSmWindowNs, and the newest one's time (the next read asks after it).
struct SampleHistory {
  unsigned long long newest_us = 0;
  std::deque<Sample> samples;
};

// `figures`, when given (metrics served), gets the device's memory and utilization.
bool ReadDevice(const Nvml& nvml, unsigned index, std::string& uuid, std::vector<Reading>& readings,
                std::map<std::string, SampleHistory>& histories, vgpu::monitor::DeviceFigures* figures) {
  nvmlDevice_t device = nullptr;
  char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
  nvmlReturn_t r = nvml.handle(index, &device);
  if (r == NVML_SUCCESS) r = nvml.uuid(device, text, sizeof text);
  if (r != NVML_SUCCESS || !vgpu::verdict::IsDeviceUuid(text)) {
    Log(2, "device %u: no handle or UUID (%s)", index, nvml.Why(r));
    return false;
  }
  uuid = text;
  // The process list, read twice: taken only when both reads agree (a driver answering garbage -- a list cut short,
  // absurd figures -- would otherwise judge a container on it; the real driver's two reads differ only when a
  // process allocates or ends between them, and the device is then judged next period).
  std::vector<nvmlProcessInfo_t> processes, again;
  if (!ReadProcesses(nvml, device, processes) || !ReadProcesses(nvml, device, again) ||
      !SameProcesses(processes, again)) {
    Log(2, "%s: no process list this period (an NVML error, or two reads that disagree)", uuid.c_str());
    return false;
  }
  // SM use per process over the last verdict::kSmWindowNs. NVML's samples are the device's utilization over one
  // sampling window each, named to the process that held the device longest in it (one process per window under
  // time-slicing: docs/h100-notes.md): a process's use is the sum of its samples over the number of windows.
  SampleHistory& history = histories[uuid];
  const unsigned long long now_us = Now(CLOCK_REALTIME) / 1000;
  unsigned count = 0;
  r = nvml.utilization(device, nullptr, &count, history.newest_us);
  if (r == NVML_ERROR_INSUFFICIENT_SIZE && count > 0 && count <= 65536) {
    std::vector<nvmlProcessUtilizationSample_t> samples(count);
    r = nvml.utilization(device, samples.data(), &count, history.newest_us);
    if (r == NVML_SUCCESS && count <= samples.size()) {
      const unsigned long long after = history.newest_us;
      for (unsigned i = 0; i < count; ++i) {
        // (A sample from the future -- garbage -- would hold every later one back: left out.)
        if (samples[i].timeStamp <= after || samples[i].timeStamp > now_us + 5'000'000 || samples[i].smUtil > 100) {
          continue;
        }
        history.samples.push_back({samples[i].timeStamp, samples[i].pid, samples[i].smUtil});
        history.newest_us = std::max(history.newest_us, samples[i].timeStamp);
      }
    }
  }
  const unsigned long long window_us = vgpu::verdict::kSmWindowNs / 1000;
  while (!history.samples.empty() && history.samples.front().timestamp_us + window_us < now_us) {
    history.samples.pop_front();
  }
  std::map<unsigned, std::uint64_t> sm;  // pid -> sum of its samples' percents
  std::set<unsigned long long> windows;  // the samples' timestamps
  for (const Sample& sample : history.samples) {
    sm[sample.pid] += sample.percent;
    windows.insert(sample.timestamp_us);
  }
  // Figures that cannot be (a driver answering garbage: a process holding more than the device, a pid 0) leave the
  // device unjudged this period rather than judge a container on them.
  nvmlMemory_t memory{};
  r = nvml.memory(device, &memory);
  if (r != NVML_SUCCESS || memory.total == 0) {
    Log(2, "%s: no memory total (%s): the device is not judged this period", uuid.c_str(), nvml.Why(r));
    return false;
  }
  unsigned long long sum = 0;
  for (const nvmlProcessInfo_t& process : processes) {
    if (process.usedGpuMemory == static_cast<unsigned long long>(NVML_VALUE_NOT_AVAILABLE)) {
      Log(2, "%s: process %u's memory is not available: the device is not judged this period", uuid.c_str(),
          process.pid);
      return false;
    }
    sum += std::min<unsigned long long>(process.usedGpuMemory, memory.total + 1);
    if (process.pid == 0 || process.usedGpuMemory > memory.total || sum > memory.total) {
      Log(2, "%s: process %u holding %llu of the device's %llu bytes cannot be: the device is not judged this period",
          uuid.c_str(), process.pid, process.usedGpuMemory, memory.total);
      return false;
    }
  }
  if (figures != nullptr) {
    *figures = {index, uuid, memory.used, memory.total, std::nullopt};
    nvmlUtilization_t rates{};
    if (nvml.utilization_rates(device, &rates) == NVML_SUCCESS) figures->utilization_percent = rates.gpu;
  }
  for (const nvmlProcessInfo_t& process : processes) {
    Reading reading;
    reading.host_pid = process.pid;
    reading.device = uuid;
    reading.memory_used = process.usedGpuMemory;
    if (const auto found = sm.find(process.pid); found != sm.end() && !windows.empty()) {
      reading.sm_used = static_cast<std::uint32_t>(std::min<std::uint64_t>(found->second * 10 / windows.size(), 1000));
    }
    const std::string proc = "/proc/" + std::to_string(process.pid);
    std::string cgroup_text, status_text;
    if (ReadSmall(proc + "/cgroup", cgroup_text)) vgpu::monitor::CgroupPath(cgroup_text, reading.cgroup);
    if (ReadSmall(proc + "/status", status_text)) reading.pid = vgpu::monitor::NamespacePid(status_text);
    readings.push_back(std::move(reading));
  }
  return true;
}

// The seq a container's next verdict carries: above the last one written (read back from the file at first sight,
// so that a restarted monitor never goes back), and at least the realtime clock in ns.
std::uint64_t NextSeq(std::map<std::string, std::uint64_t>& seqs, const std::string& name, const std::string& path,
                      std::uint64_t now_ns) {
  auto found = seqs.find(name);
  if (found == seqs.end()) {
    std::uint64_t previous = 0;
    std::string text, error;
    vgpu::verdict::Verdict old;
    if (ReadSmall(path, text) && vgpu::verdict::Parse(text, old, error)) previous = old.seq;
    found = seqs.emplace(name, previous).first;
  }
  found->second = std::max(found->second + 1, now_ns);
  return found->second;
}

std::string WhyNot(const std::string& what, const std::string& path, int error_number) {
  return what + " " + path + ": " + std::strerror(error_number);
}

// Writes `text` to `path` so that a reader sees either the old file or the whole new one: to `path`.tmp in the same
// folder, then renamed over `path` (mode 0644). On failure returns false and sets `error` (naming the path and errno).
bool WriteWhole(const std::string& path, const std::string& text, std::string& error) {
  const std::string temporary = path + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    error = WhyNot("cannot create", temporary, errno);
    return false;
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t wrote = ::write(fd, text.data() + done, text.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      error = WhyNot("cannot write", temporary, wrote < 0 ? errno : ENOSPC);
      ::close(fd);
      ::unlink(temporary.c_str());
      return false;
    }
    done += static_cast<std::size_t>(wrote);
  }
  // (A file created with O_CREAT takes the umask; readers in the container need to read it.)
  if (::fchmod(fd, 0644) != 0 || ::close(fd) != 0) {
    error = WhyNot("cannot finish", temporary, errno);
    ::unlink(temporary.c_str());
    return false;
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    error = WhyNot("cannot rename into place", path, errno);
    ::unlink(temporary.c_str());
    return false;
  }
  return true;
}

void OnSignal(int) { g_stop = 1; }

// Whether `error` is a new reason for `key` to be left out (said once per reason); a read that succeeds forgets it.
bool NewReason(std::map<std::string, std::string>& reported, const std::string& key, bool failed,
               const std::string& error) {
  if (!failed) {
    reported.erase(key);
    return false;
  }
  if (reported[key] == error) return false;
  reported[key] = error;
  return true;
}

// Each container's cache file, opened once: our region's counters (time held by its compute limit, allocations
// refused), and with --hami-metrics its part as HAMi's monitor reads it. A new reason a part is not read is logged.
void ReadContainerFiles(vgpu::monitor::PeriodFigures& figures, std::map<std::string, std::string>& reported) {
  for (std::size_t c = 0; c < figures.containers.size(); ++c) {
    const Container& container = figures.containers[c];
    if (container.cache_path.empty()) continue;
    vgpu::monitor::CounterFigures counters;
    counters.container = c;
    vgpu::monitor::CacheFigures cache;
    cache.container = c;
    const vgpu::monitor::ContainerFileRead read =
        vgpu::monitor::ReadContainerFile(container.cache_path, figures.hami ? &cache.cache : nullptr, counters.devices);
    if (NewReason(reported, "region " + container.name + " " + container.cache_path,
                  read.counters == vgpu::monitor::CacheState::invalid, read.counters_error)) {
      Log(1, "%s: cache file %s: %s: its throttled and refused counters are left out", container.name.c_str(),
          container.cache_path.c_str(), read.counters_error.c_str());
    }
    if (read.counters == vgpu::monitor::CacheState::read) figures.counters.push_back(std::move(counters));
    if (!figures.hami) continue;
    if (NewReason(reported, "hami " + container.name + " " + container.cache_path,
                  read.hami == vgpu::monitor::CacheState::invalid, read.hami_error)) {
      Log(1, "%s: cache file %s: %s: its hami_* series are left out", container.name.c_str(),
          container.cache_path.c_str(), read.hami_error.c_str());
    }
    cache.state = read.hami;
    figures.caches.push_back(std::move(cache));
  }
}

// With --metrics-port: this period's figures as Prometheus' text, handed to the server (docs/metrics.md), with each
// container's cache file read (ReadContainerFiles).
void PublishMetrics(vgpu::monitor::MetricsServer& server, const Options& options, vgpu::monitor::PeriodFigures figures,
                    std::map<std::string, std::string>& cache_reported) {
  figures.hami = options.hami_metrics;
  ReadContainerFiles(figures, cache_reported);
  figures.stamp_ns = Now(CLOCK_REALTIME);
  server.Publish(vgpu::monitor::FormatMetrics(figures));
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!ParseOptions(argc, argv, options)) return 2;
  Nvml nvml;
  std::string error;
  if (!nvml.Load(error)) {
    Log(0, "%s", error.c_str());
    return 1;
  }
  if (const nvmlReturn_t r = nvml.init(); r != NVML_SUCCESS) {
    Log(0, "nvmlInit_v2 failed: %s", nvml.Why(r));
    return 1;
  }
  if (mkdir(options.verdicts.c_str(), 0755) != 0 && errno != EEXIST) {
    Log(0, "cannot create the verdicts folder %s: %s", options.verdicts.c_str(), std::strerror(errno));
    return 1;
  }
  vgpu::monitor::MetricsServer server;
  if (options.metrics_port >= 0) {
    if (!server.Start(options.metrics_address, static_cast<std::uint16_t>(options.metrics_port), error)) {
      Log(0, "%s (--metrics-address, --metrics-port)", error.c_str());
      return 1;
    }
    Log(1, "serving metrics on http://%s:%u/metrics", options.metrics_address.c_str(), server.port());
  }
  std::map<std::string, std::string> cache_reported;
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  ContainerFiles files(options.containers);
  std::map<std::string, SampleHistory> histories;
  std::map<std::string, std::uint64_t> seqs;
  std::set<std::string> over;  // container/device pairs over their memory limit at the last period
  std::set<std::string> write_failed;
  const std::uint64_t period_ns = options.period_ms * 1'000'000;
  std::uint64_t next = Now(CLOCK_MONOTONIC);
  Log(2, "judging every %llu ms, action %s", static_cast<unsigned long long>(options.period_ms),
      options.kill ? "kill" : "report");
  for (std::uint64_t period = 0; g_stop == 0 && (options.periods == 0 || period < options.periods); ++period) {
    const std::vector<Container> containers = files.Load();
    std::vector<std::string> devices;
    std::vector<Reading> readings;
    vgpu::monitor::PeriodFigures figures;
    unsigned device_count = 0;
    if (const nvmlReturn_t r = nvml.count(&device_count); r != NVML_SUCCESS) {
      Log(2, "nvmlDeviceGetCount_v2 failed: %s", nvml.Why(r));
      device_count = 0;
    }
    for (unsigned index = 0; index < device_count && index < 64; ++index) {
      std::string uuid;
      std::vector<Reading> found;
      vgpu::monitor::DeviceFigures device;
      if (ReadDevice(nvml, index, uuid, found, histories, options.metrics_port >= 0 ? &device : nullptr)) {
        if (options.metrics_port >= 0) figures.devices.push_back(std::move(device));
        devices.push_back(uuid);
        readings.insert(readings.end(), found.begin(), found.end());
      }
    }
    const auto judgements = vgpu::monitor::Judge(containers, devices, readings, options.kill);
    for (const auto& judgement : judgements) {
      const Container& container = containers[judgement.container];
      const std::string folder = options.verdicts + "/" + container.name;
      const std::string path = folder + "/verdict";
      vgpu::verdict::Verdict verdict = judgement.verdict;
      verdict.stamp_ns = Now(CLOCK_REALTIME);
      verdict.seq = NextSeq(seqs, container.name, path, verdict.stamp_ns);
      bool written = mkdir(folder.c_str(), 0755) == 0 || errno == EEXIST;
      if (!written) error = WhyNot("cannot create", folder, errno);
      written = written && WriteWhole(path, vgpu::verdict::Format(verdict), error);
      if (!written) {
        if (write_failed.insert(container.name).second) {
          Log(1, "%s: cannot write its verdict: %s", container.name.c_str(), error.c_str());
        }
      } else {
        write_failed.erase(container.name);
      }
      for (const auto& device : verdict.devices) {
        const std::string key = container.name + " " + device.uuid;
        const bool is_over = device.MemoryOver();
        if (is_over && over.insert(key).second) {
          Log(1, "%s: over its memory limit on %s: the driver shows %llu of %llu bytes", container.name.c_str(),
              device.uuid.c_str(), static_cast<unsigned long long>(device.memory_used),
              static_cast<unsigned long long>(device.memory_limit));
        } else if (!is_over && over.erase(key) > 0) {
          Log(1, "%s: back under its memory limit on %s", container.name.c_str(), device.uuid.c_str());
        }
      }
      if (judgement.kill_host_pid != 0) {
        // The pid is this period's: a process that ended meanwhile could have left it to another. Still the
        // container's (its cgroup read again), or left alone.
        std::string text, cgroup;
        const bool still = ReadSmall("/proc/" + std::to_string(judgement.kill_host_pid) + "/cgroup", text) &&
                           vgpu::monitor::CgroupPath(text, cgroup) &&
                           vgpu::monitor::ContainerOf(containers, cgroup) == static_cast<int>(judgement.container);
        if (!still) {
          Log(2, "%s: process %u is gone (or no longer the container's): not killed", container.name.c_str(),
              judgement.kill_host_pid);
        } else if (kill(static_cast<pid_t>(judgement.kill_host_pid), SIGKILL) == 0) {
          Log(1, "%s: killed process %u (host pid), the largest of a container over its memory limit",
              container.name.c_str(), judgement.kill_host_pid);
        } else {
          Log(1, "%s: cannot kill process %u: %s", container.name.c_str(), judgement.kill_host_pid,
              std::strerror(errno));
        }
      }
    }
    if (options.metrics_port >= 0) {
      figures.containers = containers;
      figures.judgements = judgements;
      figures.periods = period + 1;
      PublishMetrics(server, options, std::move(figures), cache_reported);
    }
    next += period_ns;
    const std::uint64_t now = Now(CLOCK_MONOTONIC);
    if (next <= now) {
      next = now;  // a slow period: the next one starts now, none is run twice to catch up
      continue;
    }
    const timespec wait{static_cast<time_t>((next - now) / 1'000'000'000),
                        static_cast<long>((next - now) % 1'000'000'000)};
    nanosleep(&wait, nullptr);
  }
  return 0;
}
