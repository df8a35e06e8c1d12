// vgpu-monitor's metrics in Prometheus' text format: docs/metrics.md names every series, its unit and its source.
#include "vgpu/monitor/metrics.h"

#include <algorithm>
#include <array>
#include <cctype>

namespace vgpu::monitor {
namespace {

enum Family : std::size_t {
  kContainerInfo,
  kContainerMemoryUsed,
  kContainerMemoryLimit,
  kContainerSmUsed,
  kContainerSmLimit,
  kContainerThrottled,
  kContainerRefused,
  kContainerCacheValid,
  kDeviceMemoryUsed,
  kDeviceMemoryTotal,
  kDeviceUtilization,
  kPeriods,
  kLastPeriod,
  kHamiMemoryUsed,
  kHamiMemoryLimit,
  kHamiDeviceMemory,
  kHamiContext,
  kHamiModule,
  kHamiBuffer,
  kHamiUtilization,
  kHamiLastKernel,
  kFamilies
};

struct FamilyName {
  std::string_view name;
  std::string_view type;
  std::string_view help;
};

// In Family's order. A counter's samples are named with "_total" after the family's name.
constexpr std::array<FamilyName, kFamilies> kNames{{
    {"vgpu_container_info", "gauge", "The container's Kubernetes names (1), from its container file."},
    {"vgpu_container_memory_used_bytes", "gauge", "Device memory the driver shows for the container's processes."},
    {"vgpu_container_memory_limit_bytes", "gauge", "The container's memory limit on the device."},
    {"vgpu_container_sm_used_ratio", "gauge",
     "The container's share of the device over the last second, from NVML's samples (absent: shared device)."},
    {"vgpu_container_sm_limit_ratio", "gauge", "The container's compute cap on the device."},
    {"vgpu_container_throttled_seconds", "counter",
     "Time the container's launches waited for its compute limit on the device (its region file)."},
    {"vgpu_container_refused_allocations", "counter",
     "Allocations refused at the container's memory limit on the device (its region file)."},
    {"vgpu_container_hami_cache_valid", "gauge", "1 if the container's HAMi cache file was read and valid."},
    {"vgpu_device_memory_used_bytes", "gauge", "Device memory in use, NVML's figure."},
    {"vgpu_device_memory_total_bytes", "gauge", "Device memory in all, NVML's figure."},
    {"vgpu_device_utilization_ratio", "gauge", "Device utilization over NVML's last sampling window."},
    {"vgpu_monitor_periods", "counter", "Periods judged since the monitor started."},
    {"vgpu_monitor_last_period_timestamp_seconds", "gauge", "When the period these figures come from ended."},
    {"hami_vgpu_memory_used_bytes", "gauge", "vGPU device memory usage in bytes (the container's cache file)."},
    {"hami_vgpu_memory_limit_bytes", "gauge", "vGPU device memory limit in bytes (the container's cache file)."},
    {"hami_container_device_memory_bytes", "gauge", "Container device memory usage in bytes (the cache file)."},
    {"hami_vgpu_memory_context_bytes", "gauge", "Container device memory context size in bytes (the cache file)."},
    {"hami_vgpu_memory_module_bytes", "gauge", "Container device memory module size in bytes (the cache file)."},
    {"hami_vgpu_memory_buffer_bytes", "gauge", "Container device memory buffer size in bytes (the cache file)."},
    {"hami_container_device_utilization_ratio", "gauge", "Container device SM utilization, percent (the cache file)."},
    {"hami_container_last_kernel_elapsed_seconds", "gauge", "Seconds since the container's last kernel launch."},
}};

// `value` / 10^digits in decimal, e.g. (300, 3) -> "0.300".
std::string Scaled(std::uint64_t value, int digits) {
  std::uint64_t unit = 1;
  for (int i = 0; i < digits; ++i) unit *= 10;
  std::string fraction = std::to_string(value % unit);
  fraction.insert(0, static_cast<std::size_t>(digits) - fraction.size(), '0');
  return std::to_string(value / unit) + "." + fraction;
}

std::string Label(std::string_view name, std::string_view value) {
  return std::string(name) + "=\"" + EscapeLabelValue(value) + "\"";
}

class Exposition {
 public:
  void Add(Family family, const std::string& labels, const std::string& value) {
    std::string& text = samples_[family];
    text += kNames[family].name;
    if (kNames[family].type == "counter") text += "_total";
    text += labels.empty() ? " " + value + "\n" : "{" + labels + "} " + value + "\n";
  }

  std::string Text() const {
    std::string text;
    for (std::size_t f = 0; f < kFamilies; ++f) {
      if (samples_[f].empty()) continue;
      text += "# HELP " + std::string(kNames[f].name) + " " + std::string(kNames[f].help) + "\n";
      text += "# TYPE " + std::string(kNames[f].name) + " " + std::string(kNames[f].type) + "\n";
      text += samples_[f];
    }
    return text;
  }

 private:
  std::array<std::string, kFamilies> samples_;
};

// The entry of `counters` for the device NVML calls `uuid` (NVML writes hex in lower case; any case matches), or null.
const RegionCounters* CountersOf(const CounterFigures* counters, std::string_view uuid) {
  if (counters == nullptr) return nullptr;
  const auto same_letter = [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
  };
  for (const RegionCounters& device : counters->devices) {
    if (std::equal(uuid.begin(), uuid.end(), device.uuid.begin(), device.uuid.end(), same_letter)) return &device;
  }
  return nullptr;
}

// `counters`: the container's region counters this period, or null (no file named, or not read). A device the region
// does not name yet has had nothing held or refused: 0.
void AddContainer(const Container& container, const Judgement& judgement, const CounterFigures* counters,
                  Exposition& out) {
  if (!container.pod_namespace.empty() || !container.pod_name.empty() || !container.container_name.empty()) {
    out.Add(kContainerInfo,
            Label("container", container.name) + "," + Label("namespace", container.pod_namespace) + "," +
                Label("pod", container.pod_name) + "," + Label("container_name", container.container_name),
            "1");
  }
  const auto& devices = judgement.verdict.devices;
  for (std::size_t d = 0; d < devices.size() && d < judgement.ordinals.size(); ++d) {
    const verdict::Device& device = devices[d];
    const std::string labels = Label("container", container.name) + "," +
                               Label("vdevice_index", std::to_string(judgement.ordinals[d])) + "," +
                               Label("device_uuid", device.uuid);
    out.Add(kContainerMemoryUsed, labels, std::to_string(device.memory_used));
    if (device.memory_limit != 0) out.Add(kContainerMemoryLimit, labels, std::to_string(device.memory_limit));
    const auto& shared = judgement.sm_shared;
    if (std::find(shared.begin(), shared.end(), device.uuid) == shared.end()) {
      out.Add(kContainerSmUsed, labels, Scaled(device.sm_used, 3));
    }
    if (device.sm_limit != 0) out.Add(kContainerSmLimit, labels, Scaled(device.sm_limit, 3));
    if (counters != nullptr) {
      const RegionCounters* found = CountersOf(counters, device.uuid);
      out.Add(kContainerThrottled, labels, Scaled(found != nullptr ? found->held_ns : 0, 9));
      out.Add(kContainerRefused, labels, std::to_string(found != nullptr ? found->refused_allocations : 0));
    }
  }
}

void AddDevice(const DeviceFigures& device, Exposition& out) {
  const std::string labels =
      Label("device_index", std::to_string(device.index)) + "," + Label("device_uuid", device.uuid);
  out.Add(kDeviceMemoryUsed, labels, std::to_string(device.memory_used_bytes));
  out.Add(kDeviceMemoryTotal, labels, std::to_string(device.memory_total_bytes));
  if (device.utilization_percent && *device.utilization_percent <= 100) {
    out.Add(kDeviceUtilization, labels, Scaled(*device.utilization_percent, 2));
  }
}

// HAMi's series for one container's cache file, named and labelled as HAMi's vGPU monitor exports them.
void AddHami(const Container& container, const HamiCache& cache, std::int64_t now_s, Exposition& out) {
  for (const HamiDevice& device : cache.devices) {
    const std::string labels = Label("namespace", container.pod_namespace) + "," + Label("pod", container.pod_name) +
                               "," + Label("container", container.container_name) + "," +
                               Label("vdevice_index", std::to_string(device.index)) + "," +
                               Label("device_uuid", device.uuid) + "," + Label("zone", "vGPU");
    out.Add(kHamiMemoryUsed, labels, std::to_string(device.memory_bytes));
    out.Add(kHamiMemoryLimit, labels, std::to_string(device.limit_bytes));
    out.Add(kHamiDeviceMemory, labels, std::to_string(device.memory_bytes));
    out.Add(kHamiContext, labels, std::to_string(device.context_bytes));
    out.Add(kHamiModule, labels, std::to_string(device.module_bytes));
    out.Add(kHamiBuffer, labels, std::to_string(device.data_bytes));
    out.Add(kHamiUtilization, labels, std::to_string(device.sm_util_percent));
    if (cache.last_kernel_time_s > 0) {
      const std::int64_t elapsed = std::max<std::int64_t>(now_s - cache.last_kernel_time_s, 0);
      out.Add(kHamiLastKernel, labels, std::to_string(elapsed));
    }
  }
}

}  // namespace

std::string EscapeLabelValue(std::string_view value) {
  std::string escaped;
  escaped.reserve(value.size());
  for (const char c : value) {
    if (c == '\\') {
      escaped += "\\\\";
    } else if (c == '"') {
      escaped += "\\\"";
    } else if (c == '\n') {
      escaped += "\\n";
    } else {
      escaped += c >= 0x20 && c < 0x7f ? c : '?';
    }
  }
  return escaped;
}

std::string FormatMetrics(const PeriodFigures& figures) {
  Exposition out;
  for (const Judgement& judgement : figures.judgements) {
    if (judgement.container >= figures.containers.size()) continue;
    const auto counters = std::find_if(figures.counters.begin(), figures.counters.end(),
                                       [&](const CounterFigures& c) { return c.container == judgement.container; });
    AddContainer(figures.containers[judgement.container], judgement,
                 counters != figures.counters.end() ? &*counters : nullptr, out);
  }
  for (const DeviceFigures& device : figures.devices) AddDevice(device, out);
  out.Add(kPeriods, "", std::to_string(figures.periods));
  out.Add(kLastPeriod, "", Scaled(figures.stamp_ns / 1'000'000, 3));
  if (figures.hami) {
    const auto now_s = static_cast<std::int64_t>(figures.stamp_ns / 1'000'000'000);
    for (const CacheFigures& cache : figures.caches) {
      if (cache.container >= figures.containers.size()) continue;
      const Container& container = figures.containers[cache.container];
      const bool valid = cache.state == CacheState::read;
      out.Add(kContainerCacheValid, Label("container", container.name), valid ? "1" : "0");
      if (valid) AddHami(container, cache.cache, now_s, out);
    }
  }
  return out.Text();
}

}  // namespace vgpu::monitor
