// The node monitor's judgement: docs/node-monitor.md.
#include "vgpu/monitor/monitor.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <utility>

namespace vgpu::monitor {
namespace {

constexpr std::string_view kCgroupKey = "VGPU_CGROUP";
constexpr std::string_view kDevicesKey = "VGPU_DEVICES";
constexpr std::string_view kCacheKey = "VGPU_CACHE";
constexpr std::string_view kPodNamespaceKey = "VGPU_POD_NAMESPACE";
constexpr std::string_view kPodNameKey = "VGPU_POD_NAME";
constexpr std::string_view kContainerNameKey = "VGPU_CONTAINER_NAME";

std::string_view NextLine(std::string_view& text) {
  const std::size_t newline = text.find('\n');
  const std::string_view line = text.substr(0, newline);
  text = newline == std::string_view::npos ? std::string_view{} : text.substr(newline + 1);
  return line;
}

// Whether `ancestor` is `path` or a whole-component prefix of it.
bool Covers(std::string_view ancestor, std::string_view path) {
  if (ancestor == "/") return !path.empty() && path.front() == '/';
  return path.substr(0, ancestor.size()) == ancestor &&
         (path.size() == ancestor.size() || path[ancestor.size()] == '/');
}

// A Kubernetes name as a label value: 1..253 of [A-Za-z0-9._-] (namespaces, pods and containers are narrower still).
bool IsKubernetesName(std::string_view name) {
  if (name.empty() || name.size() > 253) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

using Find = std::function<std::optional<std::string>(std::string_view key)>;

// The metrics' optional keys (docs/metrics.md) into `container`; false with `error` naming the key and value.
bool ParseMetricsKeys(const Find& find, Container& container, std::string& error) {
  if (const std::optional<std::string> cache = find(kCacheKey)) {
    if (cache->empty() || cache->front() != '/' || cache->find('\0') != std::string::npos) {
      error = "VGPU_CACHE '" + policy::Printable(*cache) +
              "' is not an absolute path; e.g. VGPU_CACHE=/usr/local/vgpu/containers/pod1234_main (the host path of "
              "the container's CUDA_DEVICE_MEMORY_SHARED_CACHE file, or of the folder holding it)";
      return false;
    }
    container.cache_path = *cache;
  }
  const std::pair<std::string_view, std::string*> names[] = {{kPodNamespaceKey, &container.pod_namespace},
                                                             {kPodNameKey, &container.pod_name},
                                                             {kContainerNameKey, &container.container_name}};
  for (const auto& [key, field] : names) {
    const std::optional<std::string> value = find(key);
    if (!value) continue;
    if (!IsKubernetesName(*value)) {
      error = std::string(key) + " '" + policy::Printable(*value) +
              "' is not a Kubernetes name (1 to 253 of A-Z a-z 0-9 . _ -); e.g. " + std::string(key) + "=team-a";
      return false;
    }
    *field = *value;
  }
  return true;
}

}  // namespace

bool IsContainerName(std::string_view name) {
  if (name.empty() || name.size() > 64 || name.front() == '.') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

bool ParseContainer(std::string_view name, std::string_view text, std::string_view path, Container& out,
                    std::string& error) {
  if (!IsContainerName(name)) {
    // (Appended piece by piece: GCC 12 at -O3 warns falsely of overlapping copies in "'" + std::string, bug 105329.)
    error.assign(1, '\'');
    error += policy::Printable(name);
    error += "' cannot name a container (1 to 64 of A-Z a-z 0-9 . _ -, not starting with '.'); e.g. team-a.conf";
    return false;
  }
  std::vector<std::pair<std::string, std::string>> entries;
  if (!policy::ParseConfigFile(
          text, path, [&](std::string_view key, std::string_view value) { entries.emplace_back(key, value); },
          {kCgroupKey, kDevicesKey, kCacheKey, kPodNamespaceKey, kPodNameKey, kContainerNameKey}, error)) {
    return false;
  }
  const auto find = [&entries](std::string_view key) -> std::optional<std::string> {
    for (const auto& [entry_key, value] : entries) {
      if (entry_key == key) return value;
    }
    return std::nullopt;
  };
  Container container;
  container.name = std::string(name);
  const std::optional<std::string> cgroup = find(kCgroupKey);
  if (!cgroup || cgroup->empty() || cgroup->front() != '/' || cgroup->find("//") != std::string::npos ||
      (cgroup->size() > 1 && cgroup->back() == '/')) {
    error = "VGPU_CGROUP ";
    if (cgroup) {
      error += '\'';
      error += policy::Printable(*cgroup);
      error += "' is not an absolute cgroup path";
    } else {
      error += "is not set";
    }
    error +=
        "; e.g. VGPU_CGROUP=/kubepods.slice/kubepods-pod1234.slice (the container's cgroup, as /proc/<pid>/cgroup "
        "shows it)";
    return false;
  }
  container.cgroup = *cgroup;
  if (const std::optional<std::string> devices = find(kDevicesKey)) {
    std::string_view rest = *devices;
    while (true) {
      const std::size_t comma = rest.find(',');
      const std::string_view uuid = rest.substr(0, comma);
      if (!verdict::IsDeviceUuid(uuid) ||
          std::find(container.devices.begin(), container.devices.end(), uuid) != container.devices.end()) {
        error = "VGPU_DEVICES '" + policy::Printable(*devices) + "': '" + policy::Printable(uuid) +
                "' is not a device UUID, or is listed twice; e.g. "
                "VGPU_DEVICES=GPU-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b,GPU-77aa1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b";
        return false;
      }
      container.devices.emplace_back(uuid);
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
    if (container.devices.size() > static_cast<std::size_t>(policy::kMaxDevices)) {
      error = "VGPU_DEVICES lists " + std::to_string(container.devices.size()) + " devices; at most " +
              std::to_string(policy::kMaxDevices);
      return false;
    }
  }
  if (!ParseMetricsKeys(find, container, error)) return false;
  const policy::Lookup lookup = [&find](std::string_view key) { return find(key); };
  if (!policy::ParseConfig(lookup, path, container.limits, error)) return false;
  out = std::move(container);
  return true;
}

int ContainerOf(const std::vector<Container>& containers, std::string_view cgroup) {
  int best = -1;
  for (std::size_t i = 0; i < containers.size(); ++i) {
    if (!Covers(containers[i].cgroup, cgroup)) continue;
    if (best < 0 || containers[i].cgroup.size() > containers[static_cast<std::size_t>(best)].cgroup.size()) {
      best = static_cast<int>(i);
    }
  }
  return best;
}

bool CgroupPath(std::string_view proc_cgroup, std::string& path) {
  std::optional<std::string_view> memory;
  while (!proc_cgroup.empty()) {
    const std::string_view line = NextLine(proc_cgroup);
    // hierarchy-ID:controller-list:path
    const std::size_t first = line.find(':');
    const std::size_t second = first == std::string_view::npos ? first : line.find(':', first + 1);
    if (second == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, first);
    const std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string_view where = line.substr(second + 1);
    if (where.empty() || where.front() != '/') continue;
    if (id == "0" && controllers.empty()) {
      path = std::string(where);
      return true;
    }
    std::string_view list = controllers;
    while (!list.empty()) {
      const std::size_t comma = list.find(',');
      if (list.substr(0, comma) == "memory") memory = where;
      list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
    }
  }
  if (!memory) return false;
  path = std::string(*memory);
  return true;
}

std::uint32_t NamespacePid(std::string_view proc_status) {
  while (!proc_status.empty()) {
    std::string_view line = NextLine(proc_status);
    if (line.substr(0, 6) != "NSpid:") continue;
    line.remove_prefix(6);
    std::uint32_t last = 0;
    while (!line.empty()) {
      while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
      std::uint64_t value = 0;
      std::size_t digits = 0;
      while (digits < line.size() && line[digits] >= '0' && line[digits] <= '9' && digits < 10) {
        value = value * 10 + static_cast<std::uint64_t>(line[digits] - '0');
        ++digits;
      }
      if (digits == 0) break;
      if (value > 0 && value <= UINT32_MAX) last = static_cast<std::uint32_t>(value);
      line.remove_prefix(digits);
    }
    return last;
  }
  return 0;
}

std::vector<Judgement> Judge(const std::vector<Container>& containers, const std::vector<std::string>& devices,
                             const std::vector<Reading>& readings, bool kill) {
  std::vector<Judgement> judgements(containers.size());
  std::vector<int> owner(readings.size());
  for (std::size_t r = 0; r < readings.size(); ++r) {
    owner[r] = readings[r].cgroup.empty() ? -1 : ContainerOf(containers, readings[r].cgroup);
  }
  for (std::size_t c = 0; c < containers.size(); ++c) {
    const Container& container = containers[c];
    Judgement& judgement = judgements[c];
    judgement.container = c;
    // The container's devices, by its own ordinals.
    const std::vector<std::string>& its = container.devices.empty() ? devices : container.devices;
    std::uint64_t kill_bytes = 0;
    for (std::size_t ordinal = 0; ordinal < its.size() && ordinal < static_cast<std::size_t>(policy::kMaxDevices);
         ++ordinal) {
      const std::string& uuid = its[ordinal];
      if (std::find(devices.begin(), devices.end(), uuid) == devices.end()) continue;  // not answered this period
      verdict::Device device;
      device.uuid = uuid;
      device.memory_limit = container.limits.memory_limit_bytes[ordinal];
      device.sm_limit = container.limits.sm_limit_percent[ordinal] * 10;
      std::uint64_t sm = 0;
      for (std::size_t r = 0; r < readings.size(); ++r) {
        const Reading& reading = readings[r];
        if (owner[r] != static_cast<int>(c) || reading.device != uuid) continue;
        device.memory_used += reading.memory_used;
        sm += reading.sm_used;
        // (Two host processes may share a pid in the container's view -- nested pid namespaces: one line for both.)
        const std::uint32_t pid = reading.pid != 0 ? reading.pid : reading.host_pid;
        auto& processes = judgement.verdict.processes;
        const auto same = std::find_if(processes.begin(), processes.end(),
                                       [&](const verdict::Process& p) { return p.pid == pid && p.device == uuid; });
        if (same != processes.end()) {
          same->memory_used += reading.memory_used;
          same->sm_used = std::min<std::uint32_t>(same->sm_used + reading.sm_used, 1000);
        } else {
          processes.push_back({pid, uuid, reading.memory_used, std::min<std::uint32_t>(reading.sm_used, 1000)});
        }
      }
      // NVML names one process per sampling window at the device's utilization (docs/node-monitor.md): the figures
      // are the container's own only while it is alone on the device. Beside another container's processes, the
      // one holding the device longest would be given all of it (an honest 70 % container beside a 30 % one would
      // read ~100 %): its SM use is then not judged (0).
      bool alone = true;
      for (std::size_t r = 0; r < readings.size(); ++r) {
        if (readings[r].device == uuid && owner[r] != static_cast<int>(c)) alone = false;
      }
      device.sm_used = alone ? static_cast<std::uint32_t>(std::min<std::uint64_t>(sm, 1000)) : 0;
      if (!alone) judgement.sm_shared.push_back(uuid);
      if (device.MemoryOver()) {
        judgement.memory_over.push_back(uuid);
        if (kill) {
          for (std::size_t r = 0; r < readings.size(); ++r) {
            const Reading& reading = readings[r];
            if (owner[r] == static_cast<int>(c) && reading.device == uuid && reading.memory_used > kill_bytes) {
              kill_bytes = reading.memory_used;
              judgement.kill_host_pid = reading.host_pid;
            }
          }
        }
      }
      judgement.verdict.devices.push_back(std::move(device));
      judgement.ordinals.push_back(static_cast<std::uint32_t>(ordinal));
    }
  }
  return judgements;
}

}  // namespace vgpu::monitor
