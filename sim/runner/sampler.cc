// vgpu-sampler: NVML's view of the devices for the scenario runner, a JSON line per period. It loads
// libnvidia-ml.so.1 with dlopen, so LD_LIBRARY_PATH picks fakecuda's or the driver's, and it runs without the
// shim: what it prints is the machine's view, not a container's.
//
//   vgpu-sampler [--devices K] [--every-ms N | --once] [--processes]
//   {"ev":"gpu","t_ns":<CLOCK_MONOTONIC>,"devices":[{"util_percent":..,"memory_used_bytes":..,"uuid":"GPU-.."},..]}
//
// --processes (fakecuda only) adds "processes":[[device,pid,busy_ns],..]: each process's exact GPU time
// on each device, running or gone, from fakecuda's fakecudaDeviceGetProcessBusy (fakecuda/process_busy.h); the
// runner measures its `program:` processes with it. With a real NVML, which has no such figure, it refuses.
//
// Prints until its standard input closes (the runner holds a pipe) or it is killed; --once prints one line and
// exits. Errors: one line on stderr, exit status 1 (2 for a bad command line).
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "fakecuda/process_busy.h"
#include "nvml.h"
#include "vgpu/base/clock.h"

namespace {

constexpr std::uint64_t kMaxDevices = 64;
constexpr std::uint64_t kMaxEveryMs = 3'600'000;

struct Nvml {
  decltype(&nvmlInit_v2) init = nullptr;
  decltype(&nvmlErrorString) error_string = nullptr;
  decltype(&nvmlDeviceGetCount_v2) count = nullptr;
  decltype(&nvmlDeviceGetHandleByIndex_v2) handle = nullptr;
  decltype(&nvmlDeviceGetUtilizationRates) utilization = nullptr;
  decltype(&nvmlDeviceGetMemoryInfo) memory = nullptr;
  decltype(&nvmlDeviceGetUUID) uuid = nullptr;
  fakecudaDeviceGetProcessBusy_t process_busy = nullptr;  // --processes only
};

struct Device {
  nvmlDevice_t handle = nullptr;
  std::string uuid;
};

[[noreturn]] void Fail(int status, const std::string& message) {
  std::fprintf(stderr, "vgpu-sampler: %s\n", message.c_str());
  std::fflush(stderr);
  _exit(status);
}

std::string NvmlError(const Nvml& nvml, const char* call, nvmlReturn_t result, const std::string& what) {
  const char* text = nvml.error_string != nullptr ? nvml.error_string(result) : nullptr;
  return std::string(call) + what + " failed: " + (text != nullptr ? text : "unknown error") + " (" +
         std::to_string(static_cast<int>(result)) + ")";
}

template <typename Function>
void Resolve(void* library, const char* name, Function& function) {
  function = reinterpret_cast<Function>(dlsym(library, name));
  if (function == nullptr) {
    Fail(1, std::string("libnvidia-ml.so.1 has no ") + name + "; an NVML of driver 450 or later is needed");
  }
}

std::uint64_t WholeNumber(const char* flag, const char* text, std::uint64_t low, std::uint64_t high) {
  const std::string_view view(text);
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(view.data(), view.data() + view.size(), value);
  if (view.empty() || ec != std::errc() || end != view.data() + view.size() || value < low || value > high) {
    Fail(2, std::string(flag) + " '" + text + "' is not a whole number from " + std::to_string(low) + " to " +
                std::to_string(high) + "; e.g. " + flag + " " + std::to_string(low == 0 ? 1 : low));
  }
  return value;
}

using vgpu::base::MonotonicNs;

// "[device,pid,busy_ns],.." for every process fakecuda knows on each device.
std::string ProcessBusy(const Nvml& nvml, const std::vector<Device>& devices) {
  std::string text;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    std::vector<fakecudaProcessBusy_t> entries;
    unsigned int count = 0;
    nvmlReturn_t result = NVML_ERROR_INSUFFICIENT_SIZE;
    // Processes may come between the size query and the read: ask again with the new size.
    for (int attempt = 0; attempt < 8 && result == NVML_ERROR_INSUFFICIENT_SIZE; ++attempt) {
      entries.resize(count + 8);
      count = static_cast<unsigned int>(entries.size());
      result = nvml.process_busy(devices[i].handle, &count, entries.data());
    }
    if (result != NVML_SUCCESS) {
      Fail(1, NvmlError(nvml, "fakecudaDeviceGetProcessBusy", result, " (device " + std::to_string(i) + ")"));
    }
    for (unsigned int k = 0; k < count; ++k) {
      if (!text.empty()) text += ',';
      text += "[" + std::to_string(i) + "," + std::to_string(entries[k].pid) + "," +
              std::to_string(entries[k].busy_ns) + "]";
    }
  }
  return text;
}

std::string Line(const Nvml& nvml, const std::vector<Device>& devices) {
  std::string line = "{\"ev\":\"gpu\",\"t_ns\":" + std::to_string(MonotonicNs()) + ",\"devices\":[";
  for (std::size_t i = 0; i < devices.size(); ++i) {
    nvmlUtilization_t utilization{};
    nvmlReturn_t result = nvml.utilization(devices[i].handle, &utilization);
    if (result != NVML_SUCCESS) {
      Fail(1, NvmlError(nvml, "nvmlDeviceGetUtilizationRates", result, " (device " + std::to_string(i) + ")"));
    }
    nvmlMemory_t memory{};
    result = nvml.memory(devices[i].handle, &memory);
    if (result != NVML_SUCCESS) {
      Fail(1, NvmlError(nvml, "nvmlDeviceGetMemoryInfo", result, " (device " + std::to_string(i) + ")"));
    }
    if (i > 0) line += ',';
    line += "{\"util_percent\":" + std::to_string(utilization.gpu) +
            ",\"memory_used_bytes\":" + std::to_string(memory.used) + ",\"uuid\":\"" + devices[i].uuid + "\"}";
  }
  line += ']';
  if (nvml.process_busy != nullptr) line += ",\"processes\":[" + ProcessBusy(nvml, devices) + "]";
  return line + "}\n";
}

void Print(const std::string& line) {
  if (std::fputs(line.c_str(), stdout) == EOF || std::fflush(stdout) != 0) {
    // The reader went away (EPIPE with SIGPIPE ignored): nobody is listening any more.
    Fail(1, std::string("cannot write to standard output: ") + std::strerror(errno));
  }
}

// Waits until `deadline_ns`, or returns false early when standard input is closed (the runner is done with us).
bool WaitUntil(std::uint64_t deadline_ns) {
  for (;;) {
    const std::uint64_t now = MonotonicNs();
    if (now >= deadline_ns) return true;
    struct pollfd input {
      STDIN_FILENO, POLLIN, 0
    };
    const int timeout_ms = static_cast<int>((deadline_ns - now + 999'999) / 1'000'000);
    const int ready = poll(&input, 1, timeout_ms);
    if (ready < 0 && errno != EINTR) return true;  // cannot watch stdin: keep sampling until killed
    if (ready > 0) {
      if ((input.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0 && (input.revents & POLLIN) == 0) return false;
      char buffer[256];
      const ssize_t got = read(STDIN_FILENO, buffer, sizeof buffer);  // anything written is ignored
      if (got == 0) return false;
      if (got < 0 && errno != EINTR && errno != EAGAIN) return false;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool once = false;
  bool processes = false;
  std::uint64_t every_ms = 100;
  std::uint64_t wanted = 0;  // 0 = every device NVML has
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--once") {
      once = true;
    } else if (flag == "--processes") {
      processes = true;
    } else if (flag == "--every-ms" || flag == "--devices") {
      if (i + 1 >= argc) Fail(2, flag + " needs a value; e.g. " + flag + " 100");
      if (flag == "--every-ms") {
        every_ms = WholeNumber("--every-ms", argv[++i], 1, kMaxEveryMs);
      } else {
        wanted = WholeNumber("--devices", argv[++i], 1, kMaxDevices);
      }
    } else if (flag == "--help" || flag == "-h") {
      std::puts(
          "usage: vgpu-sampler [--devices K] [--every-ms N | --once] [--processes]\n"
          "Prints NVML's utilization and used memory of devices 0 .. K-1 as a JSON line every N ms (default\n"
          "100) until standard input closes, or once with --once. Loads libnvidia-ml.so.1 (LD_LIBRARY_PATH).\n"
          "--processes adds each process's exact GPU time per device (fakecuda's NVML only).");
      return 0;
    } else {
      Fail(2, "unknown argument '" + flag + "'; accepted: --devices K, --every-ms N, --once, --processes, --help");
    }
  }

  void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    Fail(1, std::string("cannot load libnvidia-ml.so.1: ") + (why != nullptr ? why : "unknown error") +
                "; set LD_LIBRARY_PATH to fakecuda's lib folder or install the NVIDIA driver");
  }
  Nvml nvml;
  Resolve(library, "nvmlErrorString", nvml.error_string);
  Resolve(library, "nvmlInit_v2", nvml.init);
  Resolve(library, "nvmlDeviceGetCount_v2", nvml.count);
  Resolve(library, "nvmlDeviceGetHandleByIndex_v2", nvml.handle);
  Resolve(library, "nvmlDeviceGetUtilizationRates", nvml.utilization);
  Resolve(library, "nvmlDeviceGetMemoryInfo", nvml.memory);
  Resolve(library, "nvmlDeviceGetUUID", nvml.uuid);
  if (processes) {
    nvml.process_busy =
        reinterpret_cast<fakecudaDeviceGetProcessBusy_t>(dlsym(library, "fakecudaDeviceGetProcessBusy"));
    if (nvml.process_busy == nullptr) {
      Fail(1,
           "--processes needs fakecuda's libnvidia-ml.so.1 (fakecudaDeviceGetProcessBusy): a real NVML does not tell "
           "a process's GPU time");
    }
  }
  if (const nvmlReturn_t result = nvml.init(); result != NVML_SUCCESS) {
    Fail(1, NvmlError(nvml, "nvmlInit_v2", result, ""));
  }
  unsigned int count = 0;
  if (const nvmlReturn_t result = nvml.count(&count); result != NVML_SUCCESS) {
    Fail(1, NvmlError(nvml, "nvmlDeviceGetCount_v2", result, ""));
  }
  if (wanted == 0) wanted = count;
  if (wanted > count) {
    Fail(1, "--devices " + std::to_string(wanted) + " but NVML has " + std::to_string(count) + " device(s)");
  }
  std::vector<Device> devices(wanted);
  for (unsigned int i = 0; i < wanted; ++i) {
    if (const nvmlReturn_t result = nvml.handle(i, &devices[i].handle); result != NVML_SUCCESS) {
      Fail(1, NvmlError(nvml, "nvmlDeviceGetHandleByIndex_v2", result, " (device " + std::to_string(i) + ")"));
    }
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
    if (const nvmlReturn_t result = nvml.uuid(devices[i].handle, uuid, sizeof uuid); result != NVML_SUCCESS) {
      Fail(1, NvmlError(nvml, "nvmlDeviceGetUUID", result, " (device " + std::to_string(i) + ")"));
    }
    for (const char c : std::string_view(uuid)) {
      // Printed inside a JSON string: keep to what a UUID holds.
      const bool plain = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-';
      devices[i].uuid += plain ? c : '?';
    }
  }
  if (once) {
    Print(Line(nvml, devices));
    return 0;
  }
  // On a fixed schedule from the first line, so that a slow call does not shift every later sample.
  const std::uint64_t period_ns = every_ms * 1'000'000;
  std::uint64_t next_ns = MonotonicNs();
  for (;;) {
    Print(Line(nvml, devices));
    next_ns += period_ns;
    const std::uint64_t now = MonotonicNs();
    if (next_ns < now) next_ns = now;  // stalled for more than a period: go on from now, do not burst
    if (!WaitUntil(next_ns)) return 0;
  }
}
