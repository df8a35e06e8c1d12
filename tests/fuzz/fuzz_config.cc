// libFuzzer target: the shim's configuration (vgpu-core/policy/config.cc, config_os.cc), through the entry points
// libvgpu.so really uses. One input is read three ways:
//   1. as the config file (/etc/vgpu/vgpu.conf, VGPU_CONFIG_FILE): ParseConfigFile, then ParseConfig over its
//      entries (what config_os.cc's ParseFileText does);
//   2. the same bytes written to a file and loaded by LoadConfig(system_path = that file), the shim's real entry
//      point: it must agree exactly with (1);
//   3. as an environment: one KEY=VALUE string per line, checked by CheckDeviceKeys and parsed by ParseConfig with a
//      getenv-like lookup (the first entry of a name wins).
// Invariants, each against an oracle written here independently of config.cc:
//   - sizes, percents, log levels, policies, switches and paths are accepted exactly when the contract says
//     (config.h), and a config that parses holds exactly the oracle's limits: memory limits are the stated bytes (the
//     per-device value when non-zero, else the all-devices one), SM limits 0..99 (100 stored as 0), log level 0..4;
//     CUDA_DISABLE_CONTROL=true (Go's ParseBool spellings) gives a config with no limit, whatever else is set;
//   - a refused config names the first wrong variable in the parser's order, leaves `out` untouched, and its message
//     is one line of printable ASCII starting "vgpu: ";
//   - ParseConfig asks its lookup for the contract's names only; IsConfigKey agrees with the list of 42 names;
//   - the config file grammar (trimmed KEY=VALUE lines, '#' comments, no duplicates, no unknown keys) matches an
//     oracle line by line, and a refusal names a line that exists.
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vgpu/policy/config.h"

namespace {

using vgpu::policy::ComputePolicy;
using vgpu::policy::Config;
using vgpu::policy::kMaxDevices;

[[noreturn]] void Fail(const char* what, std::string_view detail = {}) {
  std::fprintf(stderr, "fuzz_config: invariant broken: %s", what);
  if (!detail.empty()) {
    std::fprintf(stderr, " [");
    for (const char c : detail) {  // whole, with control and non-ASCII bytes escaped
      const auto byte = static_cast<unsigned char>(c);
      if (byte >= 0x20 && byte < 0x7f) {
        std::fputc(byte, stderr);
      } else {
        std::fprintf(stderr, "\\x%02x", byte);
      }
    }
    std::fprintf(stderr, "]");
  }
  std::fprintf(stderr, "\n");
  std::abort();
}

#define CHECK(condition, ...)                          \
  do {                                                 \
    if (!(condition)) Fail(#condition, ##__VA_ARGS__); \
  } while (false)

constexpr const char* kMemory = "CUDA_DEVICE_MEMORY_LIMIT";
constexpr const char* kSm = "CUDA_DEVICE_SM_LIMIT";
constexpr const char* kCache = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
constexpr const char* kPolicy = "GPU_CORE_UTILIZATION_POLICY";
constexpr const char* kLog = "LIBCUDA_LOG_LEVEL";
constexpr const char* kVerdict = "VGPU_VERDICT_FILE";
constexpr const char* kHeadroom = "VGPU_DRIVER_HEADROOM";
constexpr const char* kSharing = "VGPU_COMPUTE_SHARING";
constexpr const char* kSchedule = "VGPU_SCHEDULE_FILE";
constexpr const char* kPriority = "CUDA_TASK_PRIORITY";
constexpr const char* kDisableControl = "CUDA_DISABLE_CONTROL";
constexpr const char* kOversubscribe = "CUDA_OVERSUBSCRIBE";

const std::set<std::string>& ContractNames() {
  static const std::set<std::string> names = [] {
    std::set<std::string> all{kMemory,  kSm,       kCache,    kPolicy,         kLog,          kVerdict, kHeadroom,
                              kSharing, kSchedule, kPriority, kDisableControl, kOversubscribe};
    for (int i = 0; i < kMaxDevices; ++i) {
      all.insert(std::string(kMemory) + "_" + std::to_string(i));
      all.insert(std::string(kSm) + "_" + std::to_string(i));
    }
    return all;
  }();
  return names;
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// ---- oracles of the values (config.h's contract, written again) -----------------------------------------------------

std::optional<std::uint64_t> OracleSize(std::string_view text) {
  std::size_t digits = 0;
  while (digits < text.size() && IsDigit(text[digits])) ++digits;
  if (digits == 0) return std::nullopt;
  static const std::pair<std::string_view, int> kSuffixes[] = {{"", 0},    {"b", 0},  {"k", 10},  {"K", 10}, {"Ki", 10},
                                                               {"m", 20},  {"M", 20}, {"Mi", 20}, {"g", 30}, {"G", 30},
                                                               {"Gi", 30}, {"t", 40}, {"T", 40},  {"Ti", 40}};
  int shift = -1;
  for (const auto& [suffix, bits] : kSuffixes) {
    if (text.substr(digits) == suffix) shift = bits;
  }
  if (shift < 0) return std::nullopt;
  unsigned __int128 value = 0;
  const unsigned __int128 kTooBig = static_cast<unsigned __int128>(1) << 70;
  for (std::size_t i = 0; i < digits; ++i) {
    value = value * 10 + static_cast<unsigned>(text[i] - '0');
    if (value > kTooBig) return std::nullopt;
  }
  value <<= shift;
  if (value >> 64 != 0) return std::nullopt;
  return static_cast<std::uint64_t>(value);
}

std::optional<std::uint64_t> OracleWhole(std::string_view text, std::uint64_t max) {
  if (text.empty()) return std::nullopt;
  std::uint64_t value = 0;
  for (const char c : text) {
    if (!IsDigit(c)) return std::nullopt;
    value = value * 10 + static_cast<std::uint64_t>(c - '0');
    if (value > max) return std::nullopt;
  }
  return value;
}

std::optional<ComputePolicy> OraclePolicy(std::string_view text) {
  if (text == "default" || text == "DEFAULT") return ComputePolicy::standard;
  if (text == "force" || text == "FORCE") return ComputePolicy::force;
  if (text == "disable" || text == "DISABLE") return ComputePolicy::disable;
  return std::nullopt;
}

// Go's strconv.ParseBool, the way HAMi's device plugin reads CUDA_DISABLE_CONTROL.
std::optional<bool> OracleSwitch(std::string_view text) {
  static const std::set<std::string, std::less<>> kTrue{"1", "t", "T", "TRUE", "true", "True"};
  static const std::set<std::string, std::less<>> kFalse{"0", "f", "F", "FALSE", "false", "False"};
  if (kTrue.count(text) != 0) return true;
  if (kFalse.count(text) != 0) return false;
  return std::nullopt;
}

using Entries = std::vector<std::pair<std::string, std::string>>;

std::optional<std::string> Find(const Entries& entries, std::string_view key) {
  for (const auto& [entry_key, value] : entries) {
    if (entry_key == key) return value;
  }
  return std::nullopt;
}

// What ParseConfig must make of `entries`: the config, or the variable it must name in its refusal.
struct Expected {
  std::optional<Config> config;
  std::string wrong_variable;
};

Expected OracleConfig(const Entries& entries, std::string_view source) {
  Expected expected;
  Config config;
  config.source = std::string(source);
  const auto refuse = [&](std::string variable) {
    expected.wrong_variable = std::move(variable);
    return expected;
  };
  // Read first: when true, nothing else is, and there is no limit.
  if (const auto text = Find(entries, kDisableControl)) {
    const auto disabled = OracleSwitch(*text);
    if (!disabled) return refuse(kDisableControl);
    if (*disabled) {
      config.control_disabled = true;
      expected.config = std::move(config);
      return expected;
    }
  }
  for (const bool memory : {true, false}) {
    const std::string base = memory ? kMemory : kSm;
    std::uint64_t all = 0;
    if (const auto text = Find(entries, base)) {
      const auto value = memory ? OracleSize(*text) : OracleWhole(*text, 100);
      if (!value) return refuse(base);
      all = *value;
    }
    for (int device = 0; device < kMaxDevices; ++device) {
      const std::string key = base + "_" + std::to_string(device);
      std::uint64_t value = 0;
      if (const auto text = Find(entries, key)) {
        const auto parsed = memory ? OracleSize(*text) : OracleWhole(*text, 100);
        if (!parsed) return refuse(key);
        value = *parsed;
      }
      const std::uint64_t resolved = value != 0 ? value : all;
      if (memory) {
        config.memory_limit_bytes[static_cast<std::size_t>(device)] = resolved;
      } else {
        config.sm_limit_percent[static_cast<std::size_t>(device)] =
            resolved == 100 ? 0 : static_cast<std::uint32_t>(resolved);
      }
    }
  }
  if (const auto text = Find(entries, kCache)) {
    const bool absolute =
        !text->empty() && text->front() == '/' && text->size() <= 4095 && text->find('\0') == std::string::npos;
    if (!text->empty() && !absolute) return refuse(kCache);
    config.region_path = *text;
  }
  if (const auto text = Find(entries, kVerdict)) {
    const bool absolute =
        !text->empty() && text->front() == '/' && text->size() <= 4095 && text->find('\0') == std::string::npos;
    if (!text->empty() && !absolute) return refuse(kVerdict);
    config.verdict_path = *text;
  }
  if (const auto text = Find(entries, kSharing)) {
    if (*text == "limiter") {
      config.sharing = vgpu::policy::Sharing::limiter;
    } else if (*text == "time-division" || *text == "time_division") {
      config.sharing = vgpu::policy::Sharing::time_division;
    } else {
      return refuse(kSharing);
    }
  }
  if (const auto text = Find(entries, kSchedule)) {
    const bool absolute =
        !text->empty() && text->front() == '/' && text->size() <= 4095 && text->find('\0') == std::string::npos;
    if (!absolute) return refuse(kSchedule);
    config.schedule_path = *text;
  }
  if (const auto text = Find(entries, kHeadroom)) {
    const auto value = OracleSize(*text);
    if (!value) return refuse(kHeadroom);
    for (const std::uint64_t limit : config.memory_limit_bytes) {
      if (limit != 0 && *value >= limit) return refuse(kHeadroom);  // it must leave something of every slice
    }
    config.driver_headroom_bytes = *value;
  }
  if (const auto text = Find(entries, kPolicy)) {
    const auto policy = OraclePolicy(*text);
    if (!policy) return refuse(kPolicy);
    config.policy = *policy;
  }
  if (const auto text = Find(entries, kPriority)) {
    const auto priority = OracleWhole(*text, 1000);
    if (!priority) return refuse(kPriority);
    config.task_priority = static_cast<int>(*priority);
  }
  if (const auto text = Find(entries, kLog)) {
    const auto level = OracleWhole(*text, 4);
    if (!level) return refuse(kLog);
    config.log_level = static_cast<int>(*level);
  }
  if (const auto text = Find(entries, kOversubscribe)) {
    const auto oversubscribe = OracleSwitch(*text);
    if (!oversubscribe) return refuse(kOversubscribe);
    config.oversubscribe = *oversubscribe;
  }
  expected.config = std::move(config);
  return expected;
}

bool SameConfig(const Config& a, const Config& b) {
  return a.memory_limit_bytes == b.memory_limit_bytes && a.sm_limit_percent == b.sm_limit_percent &&
         a.region_path == b.region_path && a.verdict_path == b.verdict_path && a.sharing == b.sharing &&
         a.schedule_path == b.schedule_path && a.driver_headroom_bytes == b.driver_headroom_bytes &&
         a.policy == b.policy && a.log_level == b.log_level && a.task_priority == b.task_priority &&
         a.control_disabled == b.control_disabled && a.oversubscribe == b.oversubscribe && a.source == b.source;
}

// A message the shim prints once on stderr: one line, printable ASCII, bounded, starting "vgpu: ".
void CheckMessage(const std::string& error) {
  CHECK(error.rfind("vgpu: ", 0) == 0, error);
  CHECK(error.size() < 2048, error);
  for (const char c : error) CHECK(c >= 0x20 && c <= 0x7e, error);
}

// A config, whoever made it, holds values in range.
void CheckRanges(const Config& config) {
  for (std::size_t i = 0; i < kMaxDevices; ++i) CHECK(config.sm_limit_percent[i] <= 99);
  CHECK(config.log_level >= 0 && config.log_level <= 4);
  CHECK(config.task_priority >= 0 && config.task_priority <= 1000);
  CHECK(config.policy == ComputePolicy::standard || config.policy == ComputePolicy::force ||
        config.policy == ComputePolicy::disable);
  CHECK(config.region_path.empty() || (config.region_path.front() == '/' && config.region_path.size() <= 4095));
  CHECK(!config.verdict_path || config.verdict_path->empty() ||
        (config.verdict_path->front() == '/' && config.verdict_path->size() <= 4095));
  bool any_memory = false, any = false;
  for (std::size_t i = 0; i < kMaxDevices; ++i) {
    any_memory = any_memory || config.memory_limit_bytes[i] != 0;
    any = any || config.memory_limit_bytes[i] != 0 || config.sm_limit_percent[i] != 0;
  }
  CHECK(config.AnyMemoryLimit() == any_memory);
  CHECK(config.AnyLimit() == any);
  CHECK(!config.control_disabled || !any, "CUDA_DISABLE_CONTROL=true left a limit");
}

// ParseConfig over `entries` against the oracle. Returns the parsed config, if any.
std::optional<Config> ParseAndCheck(const Entries& entries, std::string_view source, std::string* error_out) {
  const vgpu::policy::Lookup lookup = [&entries](std::string_view key) -> std::optional<std::string> {
    if (ContractNames().count(std::string(key)) == 0) Fail("ParseConfig asked for a name outside the contract", key);
    return Find(entries, key);
  };
  Config out;
  out.source = "sentinel";
  out.log_level = 3;
  out.memory_limit_bytes[5] = 12345;
  const Config before = out;
  std::string error;
  const bool parsed = vgpu::policy::ParseConfig(lookup, source, out, error);
  const Expected expected = OracleConfig(entries, source);
  if (error_out != nullptr) *error_out = error;
  if (!parsed) {
    CHECK(!expected.config.has_value(), "refused a config the oracle accepts: " + error);
    CHECK(SameConfig(out, before), "a refused config changed `out`");
    CheckMessage(error);
    // The message names the first wrong variable, as the parser reads them: "vgpu: NAME='...".
    CHECK(error.rfind("vgpu: " + expected.wrong_variable + "='", 0) == 0, error + " / " + expected.wrong_variable);
    return std::nullopt;
  }
  CHECK(expected.config.has_value(), "accepted a config the oracle refuses (" + expected.wrong_variable + ")");
  CHECK(SameConfig(out, *expected.config), "the parsed config differs from the oracle's");
  CheckRanges(out);
  // Deterministic: a second parse gives the same.
  Config again;
  std::string again_error;
  CHECK(vgpu::policy::ParseConfig(lookup, source, again, again_error) && SameConfig(again, out));
  return out;
}

// ---- the config file ------------------------------------------------------------------------------------------------

bool IsBlank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsBlank(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsBlank(s.back())) s.remove_suffix(1);
  return s;
}

// The file grammar of config.h, written again: the entries, or the line that is wrong.
struct FileOracle {
  Entries entries;
  std::size_t bad_line = 0;  // 0: the file is well formed
};

FileOracle OracleFile(std::string_view text) {
  FileOracle result;
  std::size_t number = 0;
  std::size_t start = 0;
  for (;;) {
    ++number;
    const std::size_t newline = text.find('\n', start);
    const std::string_view line =
        Trim(text.substr(start, newline == std::string_view::npos ? std::string_view::npos : newline - start));
    if (!line.empty() && line.front() != '#') {
      const std::size_t equals = line.find('=');
      const std::string_view key = Trim(line.substr(0, equals));
      if (equals == std::string_view::npos || key.empty() || ContractNames().count(std::string(key)) == 0 ||
          Find(result.entries, key)) {
        result.bad_line = number;
        return result;
      }
      result.entries.emplace_back(std::string(key), std::string(Trim(line.substr(equals + 1))));
    }
    if (newline == std::string_view::npos) return result;
    start = newline + 1;
  }
}

// Where the targets write their files: $TMPDIR, else /dev/shm (a file rewritten per input on a disk file system
// makes the run wait for the disk), else /tmp.
std::string ScratchBase() {
  const char* base = std::getenv("TMPDIR");
  if (base != nullptr && base[0] == '/') return base;
  return access("/dev/shm", W_OK | X_OK) == 0 ? "/dev/shm" : "/tmp";
}

// A private folder for the config file LoadConfig reads, removed at exit. Never destroyed itself: the exit handler
// runs after static destructors would have run.
const std::string& TemporaryFolder() {
  static const std::string* const folder = [] {
    std::string pattern = ScratchBase() + "/vgpu-fuzz-config.XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) Fail("mkdtemp failed");
    auto* made = new std::string(pattern);
    std::atexit([] {
      unlink((TemporaryFolder() + "/vgpu.conf").c_str());
      rmdir(TemporaryFolder().c_str());
    });
    return made;
  }();
  return *folder;
}

void WriteFile(const std::string& path, std::string_view text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) Fail("cannot write the temporary config file", path);
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t wrote = write(fd, text.data() + done, text.size() - done);
    if (wrote <= 0) Fail("short write of the temporary config file", path);
    done += static_cast<std::size_t>(wrote);
  }
  close(fd);
}

void FuzzConfigFile(std::string_view text) {
  const std::string path = "/etc/vgpu/vgpu.conf";  // the name only appears in messages
  Entries entries;
  std::string error;
  const bool well_formed = vgpu::policy::ParseConfigFile(
      text, path,
      [&](std::string_view key, std::string_view value) { entries.emplace_back(std::string(key), std::string(value)); },
      error);
  const FileOracle oracle = OracleFile(text);
  std::optional<Config> config;
  std::string config_error;
  if (well_formed) {
    CHECK(oracle.bad_line == 0, "accepted a file the oracle refuses at line " + std::to_string(oracle.bad_line));
    CHECK(entries == oracle.entries, "the file's entries differ from the oracle's");
    for (const auto& [key, value] : entries) {
      CHECK(vgpu::policy::IsConfigKey(key), key);
      CHECK(value.find('\n') == std::string::npos && Trim(value) == value, value);
    }
    config = ParseAndCheck(entries, path, &config_error);
    if (!config) config_error = config_error.empty() ? "?" : config_error;
  } else {
    CHECK(oracle.bad_line != 0, "refused a file the oracle accepts: " + error);
    CheckMessage(error);
    CHECK(error.rfind("vgpu: " + path + ":" + std::to_string(oracle.bad_line) + ": ", 0) == 0,
          error + " / line " + std::to_string(oracle.bad_line));
    // The entries before the bad line were delivered, in order, and nothing after it.
    CHECK(entries.size() == oracle.entries.size());
  }

  // The shim's own entry point over the same bytes, as the system config file: must agree exactly.
  const std::string file = TemporaryFolder() + "/vgpu.conf";
  WriteFile(file, text);
  Config loaded;
  std::string load_error;
  const bool load_ok = vgpu::policy::LoadConfig(loaded, load_error, file.c_str());
  if (text.size() > vgpu::policy::kMaxConfigFileBytes) {
    CHECK(!load_ok, "LoadConfig took a file over kMaxConfigFileBytes");
    return;
  }
  if (well_formed && config) {
    CHECK(load_ok, "LoadConfig refused what the pure parser accepts: " + load_error);
    Config expected = *config;
    expected.source = file;
    if (expected.region_path.empty()) {
      expected.region_path = vgpu::policy::DefaultRegionPath(static_cast<std::uint32_t>(getuid()));
    }
    CHECK(SameConfig(loaded, expected), "LoadConfig's config differs from ParseConfigFile + ParseConfig");
  } else {
    CHECK(!load_ok, "LoadConfig accepted what the pure parser refuses");
    CheckMessage(load_error);
  }
}

// ---- the environment ------------------------------------------------------------------------------------------------

void FuzzEnvironment(std::string_view text) {
  // environ's strings: one per line, cut at a NUL (a C string cannot hold one).
  std::vector<std::string> strings;
  std::size_t start = 0;
  for (;;) {
    const std::size_t newline = text.find('\n', start);
    std::string entry(text.substr(start, newline == std::string_view::npos ? std::string_view::npos : newline - start));
    entry.resize(std::string_view(entry.c_str()).size());
    strings.push_back(std::move(entry));
    if (newline == std::string_view::npos) break;
    start = newline + 1;
  }
  std::vector<const char*> environment;
  Entries entries;  // getenv: the first entry of a name wins
  bool bad_device_key = false;
  for (const std::string& entry : strings) {
    environment.push_back(entry.c_str());
    const std::size_t equals = entry.find('=');
    const std::string key = entry.substr(0, equals);
    const std::string value = equals == std::string::npos ? std::string() : entry.substr(equals + 1);
    CHECK(vgpu::policy::IsConfigKey(key) == (ContractNames().count(key) != 0), key);
    for (const std::string base : {kMemory, kSm}) {
      if (key.size() > base.size() && key.compare(0, base.size(), base) == 0 && key[base.size()] == '_' &&
          ContractNames().count(key) == 0) {
        bad_device_key = true;
      }
    }
    if (equals != std::string::npos && !Find(entries, key)) entries.emplace_back(key, value);
  }
  environment.push_back(nullptr);
  std::string error;
  const bool keys_ok = vgpu::policy::CheckDeviceKeys(environment.data(), "environment", error);
  CHECK(keys_ok == !bad_device_key, error);
  if (!keys_ok) CheckMessage(error);
  ParseAndCheck(entries, "environment", nullptr);
}

void FuzzValues(std::string_view text) {
  // The size parser alone, and Printable, on the raw bytes.
  std::uint64_t bytes = 0xdeadbeef;
  const bool parsed = vgpu::policy::ParseSize(text, bytes);
  const auto expected = OracleSize(text);
  CHECK(parsed == expected.has_value(), text);
  CHECK(parsed ? bytes == *expected : bytes == 0xdeadbeef, text);
  const std::string shown = vgpu::policy::Printable(text);
  CHECK(shown.size() <= 80 * 4 + 32);
  for (const char c : shown) CHECK(c >= 0x20 && c <= 0x7e, shown);
  CHECK(vgpu::policy::IsConfigKey(text) == (ContractNames().count(std::string(text)) != 0), text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  FuzzValues(text);
  FuzzConfigFile(text);
  FuzzEnvironment(text);
  return 0;
}
