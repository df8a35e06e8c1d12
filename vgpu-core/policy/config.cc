// Configuration parsing with no OS calls: sizes, percents, the HAMi variable names and the config-file syntax.
#include "vgpu/policy/config.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <utility>
#include <vector>

namespace vgpu::policy {
namespace {

constexpr std::string_view kMemoryLimit = "CUDA_DEVICE_MEMORY_LIMIT";
constexpr std::string_view kSmLimit = "CUDA_DEVICE_SM_LIMIT";
constexpr std::string_view kSharedCache = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
constexpr std::string_view kPolicy = "GPU_CORE_UTILIZATION_POLICY";
constexpr std::string_view kLogLevel = "LIBCUDA_LOG_LEVEL";
constexpr std::string_view kVerdictFile = "VGPU_VERDICT_FILE";
constexpr std::string_view kDriverHeadroom = "VGPU_DRIVER_HEADROOM";
constexpr std::string_view kSharing = "VGPU_COMPUTE_SHARING";
constexpr std::string_view kScheduleFile = "VGPU_SCHEDULE_FILE";
constexpr std::string_view kTaskPriority = "CUDA_TASK_PRIORITY";
constexpr std::string_view kDisableControl = "CUDA_DISABLE_CONTROL";
constexpr std::string_view kOversubscribe = "CUDA_OVERSUBSCRIBE";

// The longest path open(2) takes (PATH_MAX counts the terminating NUL); spelled out to keep this file OS-free.
constexpr std::size_t kMaxPathBytes = 4095;
// Values are echoed in messages; a pasted blob must not turn one line into a screenful.
constexpr std::size_t kMaxQuotedBytes = 80;

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

bool IsBlank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsBlank(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsBlank(s.back())) s.remove_suffix(1);
  return s;
}

// Decimal only, so a leading zero never means octal and "0x10" is not a number. Non-empty, no sign, no spaces.
bool ParseDecimal(std::string_view text, std::uint64_t& value) {
  if (text.empty()) return false;
  std::uint64_t result = 0;
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  for (const char c : text) {
    if (!IsDigit(c)) return false;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (result > (kMax - digit) / 10) return false;
    result = result * 10 + digit;
  }
  value = result;
  return true;
}

}  // namespace

std::string Printable(std::string_view text) {
  std::string out;
  const std::size_t shown = std::min(text.size(), kMaxQuotedBytes);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte == '\n') {
      out += "\\n";
    } else if (byte == '\t') {
      out += "\\t";
    } else if (byte == '\r') {
      out += "\\r";
    } else if (byte == '\\' || byte == '\'') {
      out += '\\';
      out += static_cast<char>(byte);
    } else if (byte < 0x20 || byte >= 0x7f) {
      char escaped[5];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += static_cast<char>(byte);
    }
  }
  if (shown < text.size()) out += "...(" + std::to_string(text.size()) + " bytes)";
  return out;
}

namespace {

// "vgpu: <VARIABLE>='<value>' from <source> is not <what>; e.g. <example_key>=<example_value>"
std::string ValueError(std::string_view variable, std::string_view value, std::string_view source,
                       std::string_view what, std::string_view example_key, std::string_view example_value) {
  std::string message = "vgpu: ";
  message += Printable(variable);
  message += "='";
  message += Printable(value);
  message += "' from ";
  message += Printable(source);
  message += " is not ";
  message += what;
  message += "; e.g. ";
  message += Printable(example_key);
  message += '=';
  message += example_value;
  return message;
}

// The usual case: the example sets the very variable that was wrong.
std::string ValueError(std::string_view variable, std::string_view value, std::string_view source,
                       std::string_view what, std::string_view example_value) {
  return ValueError(variable, value, source, what, variable, example_value);
}

// "0".."15" exactly as HAMi writes them: no leading zeros, so that "_01" cannot silently alias "_1".
int ParseDeviceIndex(std::string_view suffix) {
  if (suffix.empty() || suffix.size() > 2) return -1;
  if (suffix.size() == 2 && suffix[0] == '0') return -1;
  std::uint64_t index = 0;
  if (!ParseDecimal(suffix, index) || index >= static_cast<std::uint64_t>(kMaxDevices)) return -1;
  return static_cast<int>(index);
}

bool StartsWith(std::string_view text, std::string_view prefix) {
  return text.size() >= prefix.size() && text.substr(0, prefix.size()) == prefix;
}

// The per-device key of `base` for `device`: "CUDA_DEVICE_MEMORY_LIMIT_3".
std::string DeviceKey(std::string_view base, int device) {
  std::string key(base);
  key += '_';
  key += std::to_string(device);
  return key;
}

constexpr std::string_view kSizeWhat =
    "a size (decimal digits with an optional b, k, m, g, t, Ki, Mi, Gi or Ti suffix, powers of 1024, below 2^64)";
constexpr std::string_view kPercentWhat = "a whole percent from 0 to 100 (0 and 100 both mean no limit)";

bool ParsePercent(std::string_view text, std::uint32_t& percent) {
  std::uint64_t value = 0;
  if (!ParseDecimal(text, value) || value > 100) return false;
  percent = static_cast<std::uint32_t>(value);
  return true;
}

// Reads the all-devices value and the per-device overrides of one limit. As in HAMi-core, a per-device value of 0
// (or unset) means "use the all-devices value", not "unlimited": a typo cannot lift a limit (fail closed).
template <typename Value, typename Parse>
bool ParseDeviceLimits(const Lookup& lookup, std::string_view source, std::string_view base, std::string_view what,
                       std::string_view example, Parse parse, std::array<Value, kMaxDevices>& limits,
                       std::string& error) {
  Value all_devices{};
  if (const auto text = lookup(base)) {
    if (!parse(*text, all_devices)) {
      error = ValueError(base, *text, source, what, example);
      return false;
    }
  }
  for (int device = 0; device < kMaxDevices; ++device) {
    const std::string key = DeviceKey(base, device);
    Value value{};
    if (const auto text = lookup(key)) {
      if (!parse(*text, value)) {
        error = ValueError(key, *text, source, what, example);
        return false;
      }
    }
    limits[static_cast<std::size_t>(device)] = value != Value{} ? value : all_devices;
  }
  return true;
}

bool ParsePolicy(std::string_view text, ComputePolicy& policy) {
  // HAMi-core compares against "force"/"FORCE" and "disable"/"DISABLE" and deployed manifests use both spellings;
  // accept exactly those two cases. Mixed case and anything else are errors (HAMi silently falls back to default).
  if (text == "default" || text == "DEFAULT") {
    policy = ComputePolicy::standard;
  } else if (text == "force" || text == "FORCE") {
    policy = ComputePolicy::force;
  } else if (text == "disable" || text == "DISABLE") {
    policy = ComputePolicy::disable;
  } else {
    return false;
  }
  return true;
}

bool IsAbsolutePath(std::string_view text) {
  return !text.empty() && text.front() == '/' && text.size() <= kMaxPathBytes &&
         text.find('\0') == std::string_view::npos;
}

}  // namespace

bool Config::AnyMemoryLimit() const {
  return std::any_of(memory_limit_bytes.begin(), memory_limit_bytes.end(), [](std::uint64_t b) { return b != 0; });
}

bool Config::AnyLimit() const {
  return AnyMemoryLimit() ||
         std::any_of(sm_limit_percent.begin(), sm_limit_percent.end(), [](std::uint32_t p) { return p != 0; });
}

bool ParseSize(std::string_view text, std::uint64_t& bytes) {
  std::size_t digits_end = 0;
  while (digits_end < text.size() && IsDigit(text[digits_end])) ++digits_end;
  const std::string_view suffix = text.substr(digits_end);
  int shift = 0;
  if (suffix.empty() || suffix == "b") {
    shift = 0;
  } else if (suffix == "k" || suffix == "K" || suffix == "Ki") {
    shift = 10;
  } else if (suffix == "m" || suffix == "M" || suffix == "Mi") {
    shift = 20;
  } else if (suffix == "g" || suffix == "G" || suffix == "Gi") {
    shift = 30;
  } else if (suffix == "t" || suffix == "T" || suffix == "Ti") {
    shift = 40;
  } else {
    return false;
  }
  std::uint64_t count = 0;
  if (!ParseDecimal(text.substr(0, digits_end), count)) return false;
  if (count > (std::numeric_limits<std::uint64_t>::max() >> shift)) return false;
  bytes = count << shift;
  return true;
}

bool ParseSwitch(std::string_view text, bool& value) {
  for (const std::string_view yes : {"1", "t", "T", "TRUE", "true", "True"}) {
    if (text == yes) {
      value = true;
      return true;
    }
  }
  for (const std::string_view no : {"0", "f", "F", "FALSE", "false", "False"}) {
    if (text == no) {
      value = false;
      return true;
    }
  }
  return false;
}

bool IsConfigKey(std::string_view key) {
  if (key == kMemoryLimit || key == kSmLimit || key == kSharedCache || key == kPolicy || key == kLogLevel ||
      key == kVerdictFile || key == kDriverHeadroom || key == kSharing || key == kScheduleFile ||
      key == kTaskPriority || key == kDisableControl || key == kOversubscribe) {
    return true;
  }
  for (const std::string_view base : {kMemoryLimit, kSmLimit}) {
    if (key.size() > base.size() + 1 && StartsWith(key, base) && key[base.size()] == '_') {
      return ParseDeviceIndex(key.substr(base.size() + 1)) >= 0;
    }
  }
  return false;
}

bool CheckDeviceKeys(const char* const* environment, std::string_view source, std::string& error) {
  if (environment == nullptr) return true;
  for (const char* const* entry = environment; *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const std::size_t equals = text.find('=');
    const std::string_view key = text.substr(0, equals);
    const std::string_view value = equals == std::string_view::npos ? std::string_view() : text.substr(equals + 1);
    for (const std::string_view base : {kMemoryLimit, kSmLimit}) {
      const bool per_device_form = key.size() > base.size() && StartsWith(key, base) && key[base.size()] == '_';
      if (per_device_form && !IsConfigKey(key)) {
        error = ValueError(key, value, source,
                           "a known variable (per-device names end in a device index 0 to 15 without leading zeros)",
                           DeviceKey(base, 0), base == kMemoryLimit ? "4Gi" : "50");
        return false;
      }
    }
  }
  return true;
}

namespace {

// The steps of ParseConfig. Each reads one group of variables into `config`; they run in the order the variables are
// checked, so that a refusal names the first wrong one (the config fuzzer's oracle holds the same order).
using ParseStep = bool (*)(const Lookup& lookup, std::string_view source, Config& config, std::string& error);

constexpr std::string_view kSwitchWhat = "true or false (also 1, t, T, TRUE, True, 0, f, F, FALSE, False)";

// CUDA_DISABLE_CONTROL: read before anything else, since when true nothing else is.
bool ParseControlSwitch(const Lookup& lookup, std::string_view source, Config& config, std::string& error) {
  if (const auto text = lookup(kDisableControl)) {
    if (!ParseSwitch(*text, config.control_disabled)) {
      error = ValueError(kDisableControl, *text, source, kSwitchWhat, "true");
      return false;
    }
  }
  return true;
}

bool ParseLimits(const Lookup& lookup, std::string_view source, Config& config, std::string& error) {
  if (!ParseDeviceLimits(lookup, source, kMemoryLimit, kSizeWhat, "4Gi", ParseSize, config.memory_limit_bytes, error)) {
    return false;
  }
  if (!ParseDeviceLimits(lookup, source, kSmLimit, kPercentWhat, "50", ParsePercent, config.sm_limit_percent, error)) {
    return false;
  }
  // HAMi writes 100 for "the whole GPU"; normalise it to the one spelling of "no limit" that Config promises, after
  // the per-device resolution so that an explicit _<i>=100 still overrides a smaller all-devices value.
  for (auto& percent : config.sm_limit_percent) {
    if (percent == 100) percent = 0;
  }
  return true;
}

bool ParseFilePaths(const Lookup& lookup, std::string_view source, Config& config, std::string& error) {
  if (const auto text = lookup(kSharedCache)) {
    // Empty means the default (a template that fills the variable in may leave it blank); a relative path would
    // depend on each process's working directory, so processes of one container could attach to different regions.
    if (!text->empty() && !IsAbsolutePath(*text)) {
      error =
          ValueError(kSharedCache, *text, source, "an absolute path (or empty for the default)", "/tmp/vgpu/region");
      return false;
    }
    config.region_path = *text;
  }
  if (const auto text = lookup(kVerdictFile)) {
    // Empty turns the node monitor's verdict off; a relative path would depend on the working directory.
    if (!text->empty() && !IsAbsolutePath(*text)) {
      error = ValueError(kVerdictFile, *text, source, "an absolute path (or empty: no verdict is read)",
                         kDefaultVerdictFile);
      return false;
    }
    config.verdict_path = *text;
  }
  return true;
}

bool ParseSharing(const Lookup& lookup, std::string_view source, Config& config, std::string& error) {
  if (const auto text = lookup(kSharing)) {
    if (*text == "limiter") {
      config.sharing = Sharing::limiter;
    } else if (*text == "time-division" || *text == "time_division") {
      config.sharing = Sharing::time_division;
    } else {
      error = ValueError(kSharing, *text, source, "limiter or time-division", "time-division");
      return false;
    }
  }
  if (const auto text = lookup(kScheduleFile)) {
    // One file for every container on the node: a relative path would depend on each process's working directory.
    if (text->empty() || !IsAbsolutePath(*text)) {
      error = ValueError(kScheduleFile, *text, source, "an absolute path", kDefaultScheduleFile);
      return false;
    }
    config.schedule_path = *text;
  }
  return true;
}

// After ParseLimits: it must leave something of every slice it applies to.
bool ParseDriverHeadroom(const Lookup& lookup, std::string_view source, Config& config, std::string& error) {
  const auto text = lookup(kDriverHeadroom);
  if (!text) return true;
  if (!ParseSize(*text, config.driver_headroom_bytes)) {
    error = ValueError(kDriverHeadroom, *text, source, kSizeWhat, "16Mi");
    return false;
  }
  for (std::size_t i = 0; i < config.memory_limit_bytes.size(); ++i) {
    const std::uint64_t limit = config.memory_limit_bytes[i];
    if (limit != 0 && config.driver_headroom_bytes >= limit) {
      error = ValueError(
          kDriverHeadroom, *text, source,
          "a size under every memory limit (device " + std::to_string(i) + "'s is " + std::to_string(limit) + " bytes)",
          "16Mi");
      return false;
    }
  }
  return true;
}

bool ParsePolicyPriorityAndLogLevel(const Lookup& lookup, std::string_view source, Config& config, std::string& error) {
  if (const auto text = lookup(kPolicy)) {
    if (!ParsePolicy(*text, config.policy)) {
      error =
          ValueError(kPolicy, *text, source, "one of default, force, disable (or DEFAULT, FORCE, DISABLE)", "force");
      return false;
    }
  }
  if (const auto text = lookup(kTaskPriority)) {
    std::uint64_t priority = 0;
    if (!ParseDecimal(*text, priority) || priority > static_cast<std::uint64_t>(kMaxTaskPriority)) {
      error = ValueError(kTaskPriority, *text, source,
                         "a priority from 0 (the highest) to " + std::to_string(kMaxTaskPriority), "0");
      return false;
    }
    config.task_priority = static_cast<int>(priority);
  }
  if (const auto text = lookup(kLogLevel)) {
    std::uint64_t level = 0;
    if (!ParseDecimal(*text, level) || level > 4) {
      error = ValueError(kLogLevel, *text, source, "a log level from 0 (silent) to 4 (debug)", "2");
      return false;
    }
    config.log_level = static_cast<int>(level);
  }
  return true;
}

// CUDA_OVERSUBSCRIBE changes no limit (config.h); it is parsed as strictly as the rest all the same.
bool ParseOversubscribe(const Lookup& lookup, std::string_view source, Config& config, std::string& error) {
  if (const auto text = lookup(kOversubscribe)) {
    if (!ParseSwitch(*text, config.oversubscribe)) {
      error = ValueError(kOversubscribe, *text, source, kSwitchWhat, "true");
      return false;
    }
  }
  return true;
}

}  // namespace

bool ParseConfig(const Lookup& lookup, std::string_view source, Config& out, std::string& error) {
  if (!lookup) {  // calling an empty std::function throws; a caller's slip must not take the process down
    error = "vgpu: configuration from " + Printable(source) + " is not readable (no lookup given)";
    return false;
  }
  Config config;
  config.source = std::string(source);
  if (!ParseControlSwitch(lookup, source, config, error)) return false;
  if (!config.control_disabled) {
    for (const ParseStep step : {ParseLimits, ParseFilePaths, ParseSharing, ParseDriverHeadroom,
                                 ParsePolicyPriorityAndLogLevel, ParseOversubscribe}) {
      if (!step(lookup, source, config, error)) return false;
    }
  }
  out = std::move(config);
  return true;
}

bool ParseConfigFile(std::string_view text, std::string_view path,
                     std::function<void(std::string_view key, std::string_view value)> on_entry, std::string& error) {
  return ParseConfigFile(text, path, std::move(on_entry), {}, error);
}

bool ParseConfigFile(std::string_view text, std::string_view path,
                     std::function<void(std::string_view key, std::string_view value)> on_entry,
                     const std::vector<std::string_view>& extra, std::string& error) {
  const std::string where = "vgpu: " + Printable(path) + ":";
  // At most one entry per known key (12 + 2 * 16), so a linear search stays cheap.
  std::vector<std::pair<std::string_view, std::size_t>> seen;
  std::size_t line_number = 0;
  std::size_t start = 0;
  while (start <= text.size()) {
    ++line_number;
    const std::size_t newline = text.find('\n', start);
    const std::size_t end = newline == std::string_view::npos ? text.size() : newline;
    const std::string_view line = Trim(text.substr(start, end - start));
    start = end + 1;  // past the end when this was the last line: ends the loop

    if (line.empty() || line.front() == '#') continue;
    const std::size_t equals = line.find('=');
    const std::string_view key = Trim(line.substr(0, std::min(equals, line.size())));
    if (equals == std::string_view::npos || key.empty()) {
      error = where + std::to_string(line_number) + ": '" + Printable(line) +
              "' is not KEY=VALUE; e.g. CUDA_DEVICE_MEMORY_LIMIT=4Gi";
      return false;
    }
    const std::string_view value = Trim(line.substr(equals + 1));
    if (!IsConfigKey(key) && std::find(extra.begin(), extra.end(), key) == extra.end()) {
      std::string also;
      for (const std::string_view name : extra) also += ", " + std::string(name);
      error =
          where + std::to_string(line_number) + ": '" + Printable(key) +
          "' is not a known variable (CUDA_DEVICE_MEMORY_LIMIT[_0.._15], CUDA_DEVICE_SM_LIMIT[_0.._15], "
          "CUDA_DEVICE_MEMORY_SHARED_CACHE, GPU_CORE_UTILIZATION_POLICY, LIBCUDA_LOG_LEVEL, VGPU_VERDICT_FILE, "
          "VGPU_DRIVER_HEADROOM, VGPU_COMPUTE_SHARING, VGPU_SCHEDULE_FILE, CUDA_TASK_PRIORITY, CUDA_DISABLE_CONTROL, "
          "CUDA_OVERSUBSCRIBE" +
          also +
          "); "
          "e.g. CUDA_DEVICE_MEMORY_LIMIT=4Gi";
      return false;
    }
    const auto previous = std::find_if(seen.begin(), seen.end(), [&](const auto& entry) { return entry.first == key; });
    if (previous != seen.end()) {
      error = where + std::to_string(line_number) + ": '" + Printable(key) + "' is set again (first on line " +
              std::to_string(previous->second) + "); e.g. keep one " + Printable(key) + "=... line";
      return false;
    }
    seen.emplace_back(key, line_number);
    if (on_entry) on_entry(key, value);
  }
  return true;
}

std::string DefaultRegionPath(std::uint32_t uid) { return "/tmp/vgpu/region." + std::to_string(uid); }

}  // namespace vgpu::policy
