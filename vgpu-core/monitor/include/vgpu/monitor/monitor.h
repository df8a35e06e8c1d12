// The node monitor's judgement (docs/node-monitor.md), pure: containers as the platform describes them, processes as
// the node sees them (NVML, /proc) in, verdicts and the processes to end out. No NVML, no files: vgpu-monitor's main
// reads and writes those; tests give made-up figures.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/policy/config.h"
#include "vgpu/verdict/verdict.h"

namespace vgpu::monitor {

// One container, from its file in the containers folder.
struct Container {
  std::string name;                  // the file's name less ".conf"; names its verdict folder
  std::string cgroup;                // VGPU_CGROUP: its processes' cgroup, or an ancestor of theirs
  std::vector<std::string> devices;  // VGPU_DEVICES: its devices in its CUDA order; empty: every GPU, NVML's order
  policy::Config limits;             // its limits, by the container's CUDA ordinals
  // For the metrics (docs/metrics.md), all optional: VGPU_CACHE, the host path of its HAMi cache file or of the folder
  // holding it; VGPU_POD_NAMESPACE, VGPU_POD_NAME, VGPU_CONTAINER_NAME, its names in Kubernetes.
  std::string cache_path;
  std::string pod_namespace;
  std::string pod_name;
  std::string container_name;
};

// Whether `name` may name a container (and its verdict folder): 1..64 of [A-Za-z0-9._-], not starting with '.'.
bool IsContainerName(std::string_view name);

// Parses a container file: KEY=VALUE lines (the shim's config file syntax), VGPU_CGROUP (required, an absolute
// path), VGPU_DEVICES (optional, comma-separated device UUIDs), the shim's limit names, and the metrics' optional
// VGPU_CACHE (an absolute path) and VGPU_POD_NAMESPACE, VGPU_POD_NAME, VGPU_CONTAINER_NAME (1..253 of
// [A-Za-z0-9._-]). On failure returns false
// and sets `error` to one line naming the line or key, the value and an accepted example (the caller names the file).
bool ParseContainer(std::string_view name, std::string_view text, std::string_view path, Container& out,
                    std::string& error);

// The container a cgroup path belongs to: the one whose VGPU_CGROUP is the path or its nearest ancestor (whole path
// components: /a/b is an ancestor of /a/b/c, not of /a/bc). -1: none.
int ContainerOf(const std::vector<Container>& containers, std::string_view cgroup);

// A process's cgroup path from /proc/<pid>/cgroup: the unified hierarchy's ("0::/path"), or on a cgroup v1 host
// the memory controller's. False when the text has neither.
bool CgroupPath(std::string_view proc_cgroup, std::string& path);

// A process's pid in its own pid namespace (the last NSpid of /proc/<pid>/status); 0 when the text has none.
std::uint32_t NamespacePid(std::string_view proc_status);

// One process on one device, as the node sees it this period.
struct Reading {
  std::uint32_t host_pid = 0;
  std::uint32_t pid = 0;  // as its container sees it (NamespacePid; the host pid when unknown)
  std::string cgroup;     // empty: unknown (the process is gone, or /proc would not say)
  std::string device;     // UUID
  std::uint64_t memory_used = 0;
  std::uint32_t sm_used = 0;  // permille of the device over the last second (its NVML samples over the windows)
};

struct Judgement {
  std::size_t container = 0;             // index into the containers given
  verdict::Verdict verdict;              // devices and processes (seq and stamp are the writer's)
  std::vector<std::uint32_t> ordinals;   // the container's CUDA ordinal of each of verdict.devices
  std::vector<std::string> sm_shared;    // devices another container's processes also run on: SM use not judged
  std::vector<std::string> memory_over;  // devices the container holds more of than its limit
  std::uint32_t kill_host_pid = 0;       // with `kill`: the process to end this period (0: none)
};

// Judges every container for one period. `devices`: the GPUs NVML answered for this period, in NVML's order (a
// device it failed on is left out: no container is judged on it). `kill`: whether to name, per container over its
// memory limit, the process holding the most of a device it is over on.
std::vector<Judgement> Judge(const std::vector<Container>& containers, const std::vector<std::string>& devices,
                             const std::vector<Reading>& readings, bool kill);

}  // namespace vgpu::monitor
