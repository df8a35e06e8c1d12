// The shim's configuration: HAMi-compatible names, strict parsing, the read-only config file that wins over
// the environment. Pure: values come through a lookup function; the OS side reads the file and environment.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vgpu::policy {

inline constexpr int kMaxDevices = 16;
// Where the platform mounts the node monitor's verdict for the container (docs/node-monitor.md).
inline constexpr const char* kDefaultVerdictFile = "/etc/vgpu/monitor/verdict";

enum class ComputePolicy { standard, force, disable };  // GPU_CORE_UTILIZATION_POLICY: default | force | disable
// VGPU_COMPUTE_SHARING: how a compute cap is held (docs/compute-sharing.md). `limiter`: each container alone, by
// its kernels' event time; `time_division`: containers on a GPU take turns in windows, published in the schedule file.
enum class Sharing { limiter, time_division };
// Where the schedule file lives when VGPU_SCHEDULE_FILE is unset: the folder HAMi mounts into every GPU container.
inline constexpr const char* kDefaultScheduleFile = "/tmp/vgpulock/vgpu-schedule";
// The largest CUDA_TASK_PRIORITY accepted (HAMi uses 0 and 1).
inline constexpr int kMaxTaskPriority = 1000;

// A switch (CUDA_DISABLE_CONTROL, CUDA_OVERSUBSCRIBE): exactly the spellings Go's strconv.ParseBool accepts, since
// that is how HAMi's device plugin reads CUDA_DISABLE_CONTROL: 1 t T TRUE true True, 0 f F FALSE false False.
// Anything else (empty, "yes", " true") is rejected; `value` is written only on success.
bool ParseSwitch(std::string_view text, bool& value);

struct Config {
  // 0 = no limit (an SM limit of 100, HAMi's "whole GPU", is stored as 0). Index = the CUDA device ordinal as the
  // process sees it (after CUDA_VISIBLE_DEVICES), as HAMi numbers CUDA_DEVICE_MEMORY_LIMIT_<i>.
  std::array<std::uint64_t, kMaxDevices> memory_limit_bytes{};
  std::array<std::uint32_t, kMaxDevices> sm_limit_percent{};
  // CUDA_DEVICE_MEMORY_SHARED_CACHE. ParseConfig leaves it empty when unset or empty (it cannot know the uid);
  // LoadConfig then fills in DefaultRegionPath(getuid()).
  std::string region_path;
  // VGPU_VERDICT_FILE: the node monitor's verdict on this container (docs/node-monitor.md). Unset (nullopt):
  // kDefaultVerdictFile; empty: none is read. (Not the default string itself: a Config is built where the heap may
  // fail, and must not allocate.)
  std::optional<std::string> verdict_path;
  // VGPU_DRIVER_HEADROOM: the last bytes of every memory-limited device's slice are kept for the memory the driver
  // takes by itself (docs/shim.md, "Memory the driver takes by itself"): allocations stop this much short of the
  // limit, so that a module loaded lazily at a full slice still fits. 0 (the default): none. Ours, not HAMi's.
  std::uint64_t driver_headroom_bytes = 0;
  ComputePolicy policy = ComputePolicy::standard;
  Sharing sharing = Sharing::limiter;
  // VGPU_SCHEDULE_FILE: the node's schedule file (docs/compute-sharing.md, "Shared state"). Unset: the default.
  std::optional<std::string> schedule_path;
  // CUDA_TASK_PRIORITY (HAMi's device plugin sets it from the pod's nvidia.com/priority: a lower number is a higher
  // priority), written where HAMi's monitor reads it (docs/hami-cache.md). 1 when unset, as HAMi-core.
  int task_priority = 1;
  int log_level = 1;  // LIBCUDA_LOG_LEVEL: 0 silent .. 4 debug
  // CUDA_DISABLE_CONTROL=true: the container asked to be left alone (HAMi's device plugin then mounts no
  // /etc/ld.so.preload). If the shim is loaded all the same it controls nothing: no limit, no region, every hook
  // forwards; the other variables are not read, as they would not be without the shim (docs/hami-env.md).
  bool control_disabled = false;
  // CUDA_OVERSUBSCRIBE=true: HAMi's device plugin sets it when the node's memory scaling is above 1. Spilling device
  // memory to host memory is not implemented (HAMi-core does not read the variable either): the memory limits hold as
  // given, and the shim says so once at LIBCUDA_LOG_LEVEL 2.
  bool oversubscribe = false;
  std::string source;  // "environment" or the config file's path, for messages

  bool AnyMemoryLimit() const;
  bool AnyLimit() const;
};

// Looks a key up: returns the value or nullopt when unset.
using Lookup = std::function<std::optional<std::string>(std::string_view key)>;

// Parses every variable of the contract from `lookup`. `source` names where values came from, for messages.
// On failure returns false and sets `error` to one line naming the variable, the value and an accepted example;
// `out` is then left untouched. Asks `lookup` only for the known names (per-device ones for i = 0..15), so a
// caller whose source can list its keys must reject the others itself (ParseConfigFile, CheckDeviceKeys).
// CUDA_DISABLE_CONTROL is read first: when true, nothing else is asked for and the result has no limit.
bool ParseConfig(const Lookup& lookup, std::string_view source, Config& out, std::string& error);

// A size: ASCII decimal digits with an optional suffix b, k K Ki, m M Mi, g G Gi, t T Ti (powers of 1024, as
// HAMi reads them). "010g" is ten GiB (never octal); signs, spaces, fractions, hex, other suffixes ("4KiB",
// "4B") and values of 2^64 or more are rejected. `bytes` is written only on success.
bool ParseSize(std::string_view text, std::uint64_t& bytes);

// The config file: KEY=VALUE lines with the variables' names, '#' comments, blank lines. Unknown keys and
// malformed lines are errors (naming the line number). Whitespace around key and value is trimmed; '#' starts a
// comment only as a line's first non-blank character (a value may contain '#'); a key set twice is an error.
bool ParseConfigFile(std::string_view text, std::string_view path,
                     std::function<void(std::string_view key, std::string_view value)> on_entry, std::string& error);
// The same syntax with more keys: `extra` names the keys accepted besides the contract's (vgpu-monitor's container
// files: VGPU_CGROUP, VGPU_DEVICES), listed in the error for an unknown key.
bool ParseConfigFile(std::string_view text, std::string_view path,
                     std::function<void(std::string_view key, std::string_view value)> on_entry,
                     const std::vector<std::string_view>& extra, std::string& error);

// The OS side: if the file at `system_path` (default VGPU_SYSTEM_CONFIG, /etc/vgpu/vgpu.conf) exists it is the
// configuration and the environment is ignored; else the file named by VGPU_CONFIG_FILE if set; else the
// environment. A system file that exists but cannot be read or parsed is an error (fail closed), never a fall
// back to the environment. Read once per process: the caller calls it once at init; it caches nothing itself.
bool LoadConfig(Config& out, std::string& error, const char* system_path = nullptr);
// The system file's path this build uses (VGPU_SYSTEM_CONFIG): tools that set limits through the environment
// check it first, since where it exists the environment is ignored.
const char* SystemConfigPath();

// True for the names of the contract: the twelve base names, and CUDA_DEVICE_MEMORY_LIMIT_<i> and
// CUDA_DEVICE_SM_LIMIT_<i> for i = 0..15 written without leading zeros.
bool IsConfigKey(std::string_view key);

// The environment cannot be enumerated through Lookup, so the OS side passes `environ` here: a key starting
// with CUDA_DEVICE_MEMORY_LIMIT_ or CUDA_DEVICE_SM_LIMIT_ that IsConfigKey rejects ("_20", "_01", "_x") would
// otherwise be silently ignored. `environment` is a null-terminated array of "KEY=VALUE" strings.
bool CheckDeviceKeys(const char* const* environment, std::string_view source, std::string& error);

// Makes any bytes safe inside a one-line message: control characters, quotes, backslashes and non-ASCII bytes
// are escaped and long text is cut, so that an error stays one line whatever a value or path contains.
std::string Printable(std::string_view text);

// Where the region lives when CUDA_DEVICE_MEMORY_SHARED_CACHE is unset or empty (docs/region.md).
std::string DefaultRegionPath(std::uint32_t uid);

// A config file is a handful of lines; anything larger is a mistake, refused rather than read.
inline constexpr std::size_t kMaxConfigFileBytes = 64 * 1024;

}  // namespace vgpu::policy
