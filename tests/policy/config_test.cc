// Tests of the configuration contract: sizes, HAMi variable names, per-device overrides, config files, precedence.
#include "vgpu/policy/config.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

extern "C" char** environ;

namespace vgpu::policy {
namespace {

constexpr std::uint64_t kKiB = 1024;
constexpr std::uint64_t kMiB = kKiB * 1024;
constexpr std::uint64_t kGiB = kMiB * 1024;
constexpr std::uint64_t kTiB = kGiB * 1024;
constexpr std::uint64_t kMaxU64 = ~std::uint64_t{0};

using Values = std::map<std::string, std::string, std::less<>>;

Lookup FromMap(Values values) {
  return [values = std::move(values)](std::string_view key) -> std::optional<std::string> {
    const auto found = values.find(key);
    if (found == values.end()) return std::nullopt;
    return found->second;
  };
}

// An error must be exactly one printable line: it lands on the stderr of somebody else's program.
bool IsOnePrintableLine(const std::string& text) {
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte >= 0x7f) return false;
  }
  return true;
}

void ExpectNamesVariableAndValue(const std::string& error, const std::string& variable, const std::string& value) {
  EXPECT_EQ(error.rfind("vgpu: ", 0), 0u) << error;
  EXPECT_NE(error.find(variable + "='" + value + "'"), std::string::npos) << error;
  EXPECT_NE(error.find(" is not "), std::string::npos) << error;
  EXPECT_NE(error.find("; e.g. "), std::string::npos) << error;
  EXPECT_TRUE(IsOnePrintableLine(error)) << error;
}

std::string ParseConfigError(const Values& values) {
  Config config;
  std::string error;
  EXPECT_FALSE(ParseConfig(FromMap(values), "test", config, error));
  return error;
}

Config ParseConfigOk(const Values& values) {
  Config config;
  std::string error;
  EXPECT_TRUE(ParseConfig(FromMap(values), "test", config, error)) << error;
  return config;
}

// ---------------------------------------------------------------------------------------------------------------
// ParseSize

TEST(ParseSize, AcceptsDigitsWithPowerOf1024Suffixes) {
  const std::vector<std::pair<std::string, std::uint64_t>> cases = {
      {"0", 0},
      {"1", 1},
      {"1b", 1},
      {"4096", 4096},
      {"1k", kKiB},
      {"1K", kKiB},
      {"1Ki", kKiB},
      {"3m", 3 * kMiB},
      {"3M", 3 * kMiB},
      {"3Mi", 3 * kMiB},
      {"3000m", 3000 * kMiB},  // what the HAMi device plugin writes
      {"4g", 4 * kGiB},
      {"4G", 4 * kGiB},
      {"4Gi", 4 * kGiB},
      {"2t", 2 * kTiB},
      {"2Ti", 2 * kTiB},
      {"18446744073709551615", kMaxU64},
      {"16777215T", 16777215 * kTiB},  // the largest whole number of TiB below 2^64
      {"17179869183g", 17179869183 * kGiB},
      {"0000000000000000000000000000001k", kKiB},  // leading zeros never overflow
  };
  for (const auto& [text, expected] : cases) {
    std::uint64_t bytes = 12345;
    EXPECT_TRUE(ParseSize(text, bytes)) << text;
    EXPECT_EQ(bytes, expected) << text;
  }
}

TEST(ParseSize, FieldNotesCases) {
  std::uint64_t bytes = 0;
  ASSERT_TRUE(ParseSize("010g", bytes));  // HAMi-core's strtoul(…, 0) read this as octal: 8 GiB
  EXPECT_EQ(bytes, 10 * kGiB);
  ASSERT_TRUE(ParseSize("4T", bytes));  // read as 4 bytes when 't' was not a suffix
  EXPECT_EQ(bytes, 4 * kTiB);
  EXPECT_FALSE(ParseSize("-1", bytes));   // read as 2^64-1
  EXPECT_FALSE(ParseSize("abc", bytes));  // read as unlimited
  ASSERT_TRUE(ParseSize("0m", bytes));    // crashed later; here simply 0 = no limit
  EXPECT_EQ(bytes, 0u);
}

TEST(ParseSize, RejectsEverythingElse) {
  const std::vector<std::string> rejected = {
      "",    "-1",  "+1",  "4x", "4 g", " 4g", "4g ", "4\n", "1.5g",  "0x10", "abc", "4KiB", "4kb",  "4ki",
      "4KI", "4gi", "4gg", "4B", "g",   "Ki",  "b",   "4e3", "1,000", "１",   "4_g", "\t4",  "4Ti4",
  };
  for (const auto& text : rejected) {
    std::uint64_t bytes = 777;
    EXPECT_FALSE(ParseSize(text, bytes)) << "'" << text << "'";
    EXPECT_EQ(bytes, 777u) << "written on failure: '" << text << "'";
  }
  std::uint64_t bytes = 0;
  EXPECT_FALSE(ParseSize(std::string_view("4\0g", 3), bytes));
}

TEST(ParseSize, RejectsOverflow) {
  std::uint64_t bytes = 0;
  EXPECT_FALSE(ParseSize("18446744073709551616", bytes));
  EXPECT_FALSE(ParseSize("99999999999999999999999", bytes));
  EXPECT_FALSE(ParseSize("16777216T", bytes));  // exactly 2^64
  EXPECT_FALSE(ParseSize("17179869184g", bytes));
  EXPECT_FALSE(ParseSize("18014398509481984k", bytes));
  EXPECT_FALSE(ParseSize("18446744073709551615k", bytes));
}

// ---------------------------------------------------------------------------------------------------------------
// ParseConfig

TEST(ParseConfig, UnsetMeansNoLimitAndDefaults) {
  const Config config = ParseConfigOk({});
  for (int device = 0; device < kMaxDevices; ++device) {
    EXPECT_EQ(config.memory_limit_bytes[device], 0u);
    EXPECT_EQ(config.sm_limit_percent[device], 0u);
  }
  EXPECT_FALSE(config.AnyMemoryLimit());
  EXPECT_FALSE(config.AnyLimit());
  EXPECT_EQ(config.policy, ComputePolicy::standard);
  EXPECT_EQ(config.log_level, 1);
  EXPECT_EQ(config.region_path, "");  // LoadConfig fills in the default
  EXPECT_EQ(config.source, "test");
}

TEST(ParseConfig, ZeroMeansNoLimit) {
  const Config config = ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT", "0m"}, {"CUDA_DEVICE_SM_LIMIT", "0"}});
  EXPECT_FALSE(config.AnyLimit());
}

TEST(ParseConfig, FieldNotesSizes) {
  EXPECT_EQ(ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT", "010g"}}).memory_limit_bytes[0], 10 * kGiB);
  EXPECT_EQ(ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT", "4T"}}).memory_limit_bytes[15], 4 * kTiB);
  ExpectNamesVariableAndValue(ParseConfigError({{"CUDA_DEVICE_MEMORY_LIMIT", "-1"}}), "CUDA_DEVICE_MEMORY_LIMIT", "-1");
  ExpectNamesVariableAndValue(ParseConfigError({{"CUDA_DEVICE_MEMORY_LIMIT", "abc"}}), "CUDA_DEVICE_MEMORY_LIMIT",
                              "abc");
}

TEST(ParseConfig, AllDevicesValueAppliesToEveryDevice) {
  const Config config = ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT", "4Gi"}, {"CUDA_DEVICE_SM_LIMIT", "30"}});
  for (int device = 0; device < kMaxDevices; ++device) {
    EXPECT_EQ(config.memory_limit_bytes[device], 4 * kGiB);
    EXPECT_EQ(config.sm_limit_percent[device], 30u);
  }
  EXPECT_TRUE(config.AnyMemoryLimit());
}

TEST(ParseConfig, PerDeviceValueOverridesAllDevicesValue) {
  const Config config = ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT", "4g"},
                                       {"CUDA_DEVICE_MEMORY_LIMIT_2", "8g"},
                                       {"CUDA_DEVICE_MEMORY_LIMIT_15", "1g"},
                                       {"CUDA_DEVICE_SM_LIMIT", "30"},
                                       {"CUDA_DEVICE_SM_LIMIT_1", "70"}});
  for (int device = 0; device < kMaxDevices; ++device) {
    const std::uint64_t expected_bytes = device == 2 ? 8 * kGiB : device == 15 ? kGiB : 4 * kGiB;
    EXPECT_EQ(config.memory_limit_bytes[device], expected_bytes) << device;
    EXPECT_EQ(config.sm_limit_percent[device], device == 1 ? 70u : 30u) << device;
  }
}

TEST(ParseConfig, PerDeviceValueWithoutAllDevicesValueLimitsOnlyThatDevice) {
  const Config config = ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT_5", "1Gi"}, {"CUDA_DEVICE_SM_LIMIT_3", "25"}});
  for (int device = 0; device < kMaxDevices; ++device) {
    EXPECT_EQ(config.memory_limit_bytes[device], device == 5 ? kGiB : 0u) << device;
    EXPECT_EQ(config.sm_limit_percent[device], device == 3 ? 25u : 0u) << device;
  }
}

// As HAMi-core reads it: a per-device 0 falls back to the all-devices value, so it cannot lift a limit.
TEST(ParseConfig, PerDeviceZeroFallsBackToAllDevicesValue) {
  const Config config = ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT", "4g"},
                                       {"CUDA_DEVICE_MEMORY_LIMIT_3", "0"},
                                       {"CUDA_DEVICE_SM_LIMIT", "30"},
                                       {"CUDA_DEVICE_SM_LIMIT_3", "0"}});
  EXPECT_EQ(config.memory_limit_bytes[3], 4 * kGiB);
  EXPECT_EQ(config.sm_limit_percent[3], 30u);
}

TEST(ParseConfig, SmLimitOf100MeansNoLimit) {
  EXPECT_FALSE(ParseConfigOk({{"CUDA_DEVICE_SM_LIMIT", "100"}}).AnyLimit());
  // An explicit per-device 100 is a real override: that device gets the whole GPU.
  const Config config = ParseConfigOk({{"CUDA_DEVICE_SM_LIMIT", "30"}, {"CUDA_DEVICE_SM_LIMIT_1", "100"}});
  EXPECT_EQ(config.sm_limit_percent[0], 30u);
  EXPECT_EQ(config.sm_limit_percent[1], 0u);
  // And the reverse: all devices whole, one device capped.
  const Config capped = ParseConfigOk({{"CUDA_DEVICE_SM_LIMIT", "100"}, {"CUDA_DEVICE_SM_LIMIT_0", "40"}});
  EXPECT_EQ(capped.sm_limit_percent[0], 40u);
  EXPECT_EQ(capped.sm_limit_percent[1], 0u);
}

TEST(ParseConfig, SmLimitIsAWholePercent) {
  EXPECT_EQ(ParseConfigOk({{"CUDA_DEVICE_SM_LIMIT", "050"}}).sm_limit_percent[0], 50u);  // decimal, not octal
  EXPECT_EQ(ParseConfigOk({{"CUDA_DEVICE_SM_LIMIT", "1"}}).sm_limit_percent[0], 1u);
  EXPECT_EQ(ParseConfigOk({{"CUDA_DEVICE_SM_LIMIT", "99"}}).sm_limit_percent[0], 99u);
  for (const std::string bad :
       {"101", "-5", "+5", "50%", "5.5", "", " 50", "0x10", "5k", "abc", "99999999999999999999999"}) {
    ExpectNamesVariableAndValue(ParseConfigError({{"CUDA_DEVICE_SM_LIMIT", bad}}), "CUDA_DEVICE_SM_LIMIT", bad);
  }
}

TEST(ParseConfig, SharedCacheIsAnAbsolutePathOrEmpty) {
  EXPECT_EQ(ParseConfigOk({{"CUDA_DEVICE_MEMORY_SHARED_CACHE", ""}}).region_path, "");
  EXPECT_EQ(ParseConfigOk({{"CUDA_DEVICE_MEMORY_SHARED_CACHE", "/usr/local/vgpu/pod.cache"}}).region_path,
            "/usr/local/vgpu/pod.cache");
  for (const std::string bad : {"relative.cache", "./x", " /x", "~/x"}) {
    ExpectNamesVariableAndValue(ParseConfigError({{"CUDA_DEVICE_MEMORY_SHARED_CACHE", bad}}),
                                "CUDA_DEVICE_MEMORY_SHARED_CACHE", bad);
  }
  ParseConfigError({{"CUDA_DEVICE_MEMORY_SHARED_CACHE", "/" + std::string(5000, 'a')}});
}

// VGPU_DRIVER_HEADROOM: a size (as the limits are written) that leaves something of every limited slice.
TEST(ParseConfig, DriverHeadroomIsASizeUnderEveryLimit) {
  EXPECT_EQ(ParseConfigOk({}).driver_headroom_bytes, 0u);
  EXPECT_EQ(
      ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT", "4Gi"}, {"VGPU_DRIVER_HEADROOM", "16Mi"}}).driver_headroom_bytes,
      16u << 20);
  EXPECT_EQ(ParseConfigOk({{"VGPU_DRIVER_HEADROOM", "010m"}}).driver_headroom_bytes, 10u << 20) << "never octal";
  for (const std::string bad : {"-1", "16MiB", "1.5m", "abc", "", "99999999999999999999t"}) {
    ExpectNamesVariableAndValue(ParseConfigError({{"VGPU_DRIVER_HEADROOM", bad}}), "VGPU_DRIVER_HEADROOM", bad);
  }
  const std::string error = ParseConfigError(
      {{"CUDA_DEVICE_MEMORY_LIMIT", "4Gi"}, {"CUDA_DEVICE_MEMORY_LIMIT_1", "64m"}, {"VGPU_DRIVER_HEADROOM", "64m"}});
  EXPECT_NE(error.find("device 1"), std::string::npos) << "the slice it would leave nothing of: " << error;
}

// VGPU_COMPUTE_SHARING: how a cap is held (docs/compute-sharing.md); VGPU_SCHEDULE_FILE: where the node's
// schedule file lives (one for every container: an absolute path).
TEST(ParseConfig, SharingIsLimiterOrTimeDivisionAndTheScheduleFileAnAbsolutePath) {
  EXPECT_EQ(ParseConfigOk({}).sharing, Sharing::limiter);
  EXPECT_EQ(ParseConfigOk({{"VGPU_COMPUTE_SHARING", "time-division"}}).sharing, Sharing::time_division);
  EXPECT_EQ(ParseConfigOk({{"VGPU_COMPUTE_SHARING", "time_division"}}).sharing, Sharing::time_division);
  EXPECT_EQ(ParseConfigOk({{"VGPU_COMPUTE_SHARING", "limiter"}}).sharing, Sharing::limiter);
  for (const std::string bad : {"", "TIME-DIVISION", "mps", "time division"}) {
    const std::string error = ParseConfigError({{"VGPU_COMPUTE_SHARING", bad}});
    ExpectNamesVariableAndValue(error, "VGPU_COMPUTE_SHARING", bad);
    EXPECT_NE(error.find("limiter or time-division"), std::string::npos) << error;
  }
  EXPECT_FALSE(ParseConfigOk({}).schedule_path.has_value());
  EXPECT_EQ(ParseConfigOk({{"VGPU_SCHEDULE_FILE", "/run/vgpu/schedule"}}).schedule_path, "/run/vgpu/schedule");
  for (const std::string bad : {"", "schedule", "./x"}) {
    ExpectNamesVariableAndValue(ParseConfigError({{"VGPU_SCHEDULE_FILE", bad}}), "VGPU_SCHEDULE_FILE", bad);
  }
}

TEST(ParseConfig, PolicyNamesInLowerOrUpperCase) {
  const std::vector<std::pair<std::string, ComputePolicy>> accepted = {
      {"default", ComputePolicy::standard}, {"DEFAULT", ComputePolicy::standard}, {"force", ComputePolicy::force},
      {"FORCE", ComputePolicy::force},      {"disable", ComputePolicy::disable},  {"DISABLE", ComputePolicy::disable},
  };
  for (const auto& [text, policy] : accepted) {
    EXPECT_EQ(ParseConfigOk({{"GPU_CORE_UTILIZATION_POLICY", text}}).policy, policy) << text;
  }
  for (const std::string bad : {"Force", "", "none", " force", "force ", "forced", "0"}) {
    ExpectNamesVariableAndValue(ParseConfigError({{"GPU_CORE_UTILIZATION_POLICY", bad}}), "GPU_CORE_UTILIZATION_POLICY",
                                bad);
  }
}

TEST(ParseConfig, LogLevelFrom0To4) {
  for (int level = 0; level <= 4; ++level) {
    EXPECT_EQ(ParseConfigOk({{"LIBCUDA_LOG_LEVEL", std::to_string(level)}}).log_level, level);
  }
  for (const std::string bad : {"5", "-1", "", "x", "2.0", "40"}) {
    ExpectNamesVariableAndValue(ParseConfigError({{"LIBCUDA_LOG_LEVEL", bad}}), "LIBCUDA_LOG_LEVEL", bad);
  }
}

// HAMi's device plugin sets CUDA_TASK_PRIORITY from the pod's nvidia.com/priority (0 high, 1 low); the shim writes it
// where HAMi's monitor reads it (docs/hami-cache.md). Unset: 1, as HAMi-core.
TEST(ParseConfig, TaskPriorityIsADecimalFrom0To1000DefaultingTo1) {
  EXPECT_EQ(ParseConfigOk({}).task_priority, 1);
  for (const int priority : {0, 1, 7, 1000}) {
    EXPECT_EQ(ParseConfigOk({{"CUDA_TASK_PRIORITY", std::to_string(priority)}}).task_priority, priority);
  }
  for (const std::string bad : {"1001", "-1", "", "high", "1.0", " 0", "18446744073709551616"}) {
    ExpectNamesVariableAndValue(ParseConfigError({{"CUDA_TASK_PRIORITY", bad}}), "CUDA_TASK_PRIORITY", bad);
  }
  EXPECT_NE(ParseConfigError({{"CUDA_TASK_PRIORITY", "9999"}}).find("from 0 (the highest) to 1000"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------------
// The switches HAMi's device plugin deals in (docs/hami-env.md): CUDA_DISABLE_CONTROL, CUDA_OVERSUBSCRIBE

// The device plugin decides whether to mount /etc/ld.so.preload with Go's strconv.ParseBool on CUDA_DISABLE_CONTROL:
// a value it reads as true must be true for the shim too, or the two would disagree about the same container.
TEST(ParseSwitch, AcceptsExactlyGosParseBoolSpellings) {
  for (const std::string yes : {"1", "t", "T", "TRUE", "true", "True"}) {
    bool value = false;
    EXPECT_TRUE(ParseSwitch(yes, value)) << yes;
    EXPECT_TRUE(value) << yes;
  }
  for (const std::string no : {"0", "f", "F", "FALSE", "false", "False"}) {
    bool value = true;
    EXPECT_TRUE(ParseSwitch(no, value)) << no;
    EXPECT_FALSE(value) << no;
  }
  for (const std::string& bad :
       std::vector<std::string>{"", "yes", "no", "on", "off", "tRUE", "TRue", " true", "true ", "true\n", "2", "-1",
                                "01", "truefalse", std::string("true\0", 5)}) {
    bool value = true;
    EXPECT_FALSE(ParseSwitch(bad, value)) << Printable(bad);
    EXPECT_TRUE(value) << "written on failure: " << Printable(bad);
  }
}

// What HAMi's device plugin writes for a container given two devices (server.go, Allocate): MiB with an "m" suffix per
// device in allocation order, one SM limit (the first device's cores) for every device, a cache file per container.
TEST(ParseConfig, HamisDevicePluginEnvironmentGivesMiBLimitsAndOneSmLimitForEveryDevice) {
  const Config config = ParseConfigOk({{"CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"},
                                       {"CUDA_DEVICE_MEMORY_LIMIT_1", "3000m"},
                                       {"CUDA_DEVICE_SM_LIMIT", "30"},
                                       {"CUDA_DEVICE_MEMORY_SHARED_CACHE", "/usr/local/vgpu/3f0c0b2e.cache"},
                                       {"CUDA_OVERSUBSCRIBE", "true"},
                                       {"LIBCUDA_LOG_LEVEL", "1"},
                                       {"GPU_CORE_UTILIZATION_POLICY", "disable"},
                                       {"CUDA_TASK_PRIORITY", "0"}});
  EXPECT_EQ(config.memory_limit_bytes[0], 1024 * kMiB);
  EXPECT_EQ(config.memory_limit_bytes[1], 3000 * kMiB);
  EXPECT_EQ(config.memory_limit_bytes[2], 0u) << "a device HAMi gave no limit has none";
  for (int device = 0; device < kMaxDevices; ++device) EXPECT_EQ(config.sm_limit_percent[device], 30u) << device;
  EXPECT_EQ(config.region_path, "/usr/local/vgpu/3f0c0b2e.cache");
  EXPECT_TRUE(config.oversubscribe);
  EXPECT_FALSE(config.control_disabled);
  EXPECT_EQ(config.policy, ComputePolicy::disable);
  EXPECT_EQ(config.task_priority, 0);
  EXPECT_EQ(config.log_level, 1);
}

// CUDA_DISABLE_CONTROL=true: the shim, if loaded at all, must behave as if it were not: no limit, and no variable
// read (not even a broken one: it would not have been read without the shim either).
TEST(ParseConfig, DisableControlTrueLeavesNoLimitAndReadsNothingElse) {
  for (const std::string yes : {"true", "1", "TRUE"}) {
    std::vector<std::string> asked;
    const Values values = {{"CUDA_DISABLE_CONTROL", yes},
                           {"CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"},
                           {"CUDA_DEVICE_SM_LIMIT", "30"},
                           {"LIBCUDA_LOG_LEVEL", "broken"},
                           {"CUDA_OVERSUBSCRIBE", "broken"}};
    Config config;
    std::string error;
    ASSERT_TRUE(ParseConfig(
        [&](std::string_view key) -> std::optional<std::string> {
          asked.emplace_back(key);
          return FromMap(values)(key);
        },
        "test", config, error))
        << error;
    EXPECT_TRUE(config.control_disabled) << yes;
    EXPECT_FALSE(config.AnyLimit()) << yes;
    EXPECT_EQ(asked, std::vector<std::string>{"CUDA_DISABLE_CONTROL"}) << yes;
    EXPECT_EQ(config.source, "test");
  }
}

TEST(ParseConfig, DisableControlFalseOrUnsetKeepsEveryLimit) {
  for (const Values& values :
       {Values{}, Values{{"CUDA_DISABLE_CONTROL", "false"}}, Values{{"CUDA_DISABLE_CONTROL", "0"}}}) {
    Values with_limits = values;
    with_limits["CUDA_DEVICE_MEMORY_LIMIT_0"] = "1024m";
    with_limits["CUDA_DEVICE_SM_LIMIT"] = "30";
    const Config config = ParseConfigOk(with_limits);
    EXPECT_FALSE(config.control_disabled);
    EXPECT_EQ(config.memory_limit_bytes[0], 1024 * kMiB);
    EXPECT_EQ(config.sm_limit_percent[1], 30u);
  }
  // And the other variables are read, so a broken one is still an error.
  ParseConfigError({{"CUDA_DISABLE_CONTROL", "false"}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1024x"}});
}

// A value outside the switch's spellings fails closed (no GPU rather than a guess either way), with one line that
// names the variable, the value and what is accepted.
TEST(ParseConfig, DisableControlOtherThanTrueOrFalseIsAnErrorNamingWhatIsAccepted) {
  for (const std::string bad : {"", "yes", "on", "enabled", " true", "TRue", "2"}) {
    const std::string error =
        ParseConfigError({{"CUDA_DISABLE_CONTROL", bad}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"}});
    ExpectNamesVariableAndValue(error, "CUDA_DISABLE_CONTROL", bad);
    EXPECT_NE(error.find("is not true or false"), std::string::npos) << error;
    EXPECT_NE(error.find("e.g. CUDA_DISABLE_CONTROL=true"), std::string::npos) << error;
  }
}

// CUDA_OVERSUBSCRIBE=true (HAMi: memory scaling above 1) is accepted and recorded; the limits stay exactly as given.
TEST(ParseConfig, OversubscribeIsASwitchThatLeavesTheMemoryLimitsAsGiven) {
  EXPECT_FALSE(ParseConfigOk({}).oversubscribe);
  for (const std::string yes : {"true", "True", "1"}) {
    const Config config = ParseConfigOk({{"CUDA_OVERSUBSCRIBE", yes}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"}});
    EXPECT_TRUE(config.oversubscribe) << yes;
    EXPECT_EQ(config.memory_limit_bytes[0], 1024 * kMiB) << yes;
    EXPECT_EQ(config.memory_limit_bytes[1], 0u) << yes;
  }
  EXPECT_FALSE(ParseConfigOk({{"CUDA_OVERSUBSCRIBE", "false"}}).oversubscribe);
  for (const std::string bad : {"", "yes", "2", "true "}) {
    const std::string error = ParseConfigError({{"CUDA_OVERSUBSCRIBE", bad}});
    ExpectNamesVariableAndValue(error, "CUDA_OVERSUBSCRIBE", bad);
    EXPECT_NE(error.find("e.g. CUDA_OVERSUBSCRIBE=true"), std::string::npos) << error;
  }
}

TEST(ParseConfig, EveryErrorNamesVariableValueSourceAndExample) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"CUDA_DEVICE_MEMORY_LIMIT", "4x"},      {"CUDA_DEVICE_MEMORY_LIMIT", ""},
      {"CUDA_DEVICE_MEMORY_LIMIT", "1.5g"},    {"CUDA_DEVICE_MEMORY_LIMIT", "0x10"},
      {"CUDA_DEVICE_MEMORY_LIMIT", "4 g"},     {"CUDA_DEVICE_MEMORY_LIMIT", "4KiB"},
      {"CUDA_DEVICE_MEMORY_LIMIT", "+1"},      {"CUDA_DEVICE_MEMORY_LIMIT", "18446744073709551616"},
      {"CUDA_DEVICE_MEMORY_LIMIT_0", "-1"},    {"CUDA_DEVICE_MEMORY_LIMIT_7", "abc"},
      {"CUDA_DEVICE_MEMORY_LIMIT_15", "4x"},   {"CUDA_DEVICE_SM_LIMIT", "101"},
      {"CUDA_DEVICE_SM_LIMIT_9", "-5"},        {"CUDA_DEVICE_MEMORY_SHARED_CACHE", "rel"},
      {"GPU_CORE_UTILIZATION_POLICY", "hard"}, {"LIBCUDA_LOG_LEVEL", "9"},
  };
  for (const auto& [variable, value] : cases) {
    const std::string error = ParseConfigError({{variable, value}});
    ExpectNamesVariableAndValue(error, variable, value);
    EXPECT_NE(error.find(" from test "), std::string::npos) << error;
    EXPECT_NE(error.find("; e.g. " + variable + "="), std::string::npos) << error;
  }
  EXPECT_NE(ParseConfigError({{"CUDA_DEVICE_MEMORY_LIMIT", "4x"}}).find("e.g. CUDA_DEVICE_MEMORY_LIMIT=4Gi"),
            std::string::npos);
}

TEST(ParseConfig, ErrorStaysOneLineWhateverTheValue) {
  const std::string error = ParseConfigError({{"CUDA_DEVICE_MEMORY_LIMIT", "4\ng\x01\xff'\\"}});
  EXPECT_TRUE(IsOnePrintableLine(error)) << error;
  EXPECT_NE(error.find("CUDA_DEVICE_MEMORY_LIMIT='4\\ng\\x01\\xff\\'\\\\'"), std::string::npos) << error;
  const std::string long_error = ParseConfigError({{"CUDA_DEVICE_MEMORY_LIMIT", std::string(100000, '7') + "x"}});
  EXPECT_LT(long_error.size(), 600u);
  EXPECT_NE(long_error.find("(100001 bytes)"), std::string::npos) << long_error;
}

TEST(ParseConfig, LeavesOutputUntouchedOnError) {
  Config config;
  config.source = "before";
  config.memory_limit_bytes[0] = 42;
  std::string error;
  EXPECT_FALSE(
      ParseConfig(FromMap({{"CUDA_DEVICE_MEMORY_LIMIT", "1g"}, {"LIBCUDA_LOG_LEVEL", "7"}}), "test", config, error));
  EXPECT_EQ(config.source, "before");
  EXPECT_EQ(config.memory_limit_bytes[0], 42u);
}

TEST(ParseConfig, AsksOnlyForKnownKeys) {
  std::vector<std::string> asked;
  Config config;
  std::string error;
  ASSERT_TRUE(ParseConfig(
      [&asked](std::string_view key) -> std::optional<std::string> {
        asked.emplace_back(key);
        return std::nullopt;
      },
      "test", config, error));
  EXPECT_EQ(asked.size(), 12u + 2u * kMaxDevices);
  for (const auto& key : asked) EXPECT_TRUE(IsConfigKey(key)) << key;
}

TEST(ParseConfig, EmptyLookupIsAnErrorNotAnException) {
  Config config;
  std::string error;
  EXPECT_FALSE(ParseConfig(Lookup(), "nowhere", config, error));
  EXPECT_EQ(error.rfind("vgpu: ", 0), 0u) << error;
}

// ---------------------------------------------------------------------------------------------------------------
// Key names

TEST(IsConfigKey, KnowsTheContractNames) {
  for (const std::string key :
       {"CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE",
        "GPU_CORE_UTILIZATION_POLICY", "LIBCUDA_LOG_LEVEL", "VGPU_DRIVER_HEADROOM", "CUDA_TASK_PRIORITY",
        "CUDA_DISABLE_CONTROL", "CUDA_OVERSUBSCRIBE", "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT_15",
        "CUDA_DEVICE_SM_LIMIT_0", "CUDA_DEVICE_SM_LIMIT_10"}) {
    EXPECT_TRUE(IsConfigKey(key)) << key;
  }
  for (const std::string key : {"CUDA_DEVICE_MEMORY_LIMIT_16", "CUDA_DEVICE_MEMORY_LIMIT_20",
                                "CUDA_DEVICE_MEMORY_LIMIT_01", "CUDA_DEVICE_MEMORY_LIMIT_", "CUDA_DEVICE_SM_LIMIT_x",
                                "CUDA_DEVICE_SM_LIMIT_-1", "CUDA_DEVICE_SM_LIMIT_+1", "cuda_device_memory_limit",
                                "CUDA_DEVICE_MEMORY_LIMIT_1 ", "", "VGPU_CONFIG_FILE", "CUDA_DEVICE_SM_LIMIT_100"}) {
    EXPECT_FALSE(IsConfigKey(key)) << key;
  }
}

TEST(CheckDeviceKeys, RejectsUnknownDeviceIndices) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"CUDA_DEVICE_MEMORY_LIMIT_20", "4g"}, {"CUDA_DEVICE_MEMORY_LIMIT_16", "1g"},
      {"CUDA_DEVICE_MEMORY_LIMIT_01", "1g"}, {"CUDA_DEVICE_SM_LIMIT_x", "5"},
      {"CUDA_DEVICE_MEMORY_LIMIT_", "1g"},   {"CUDA_DEVICE_SM_LIMIT_1_", "5"},
  };
  for (const auto& [key, value] : bad) {
    const std::string entry = key + "=" + value;
    const char* environment[] = {"PATH=/bin", "CUDA_DEVICE_MEMORY_LIMIT_3=1g", entry.c_str(), nullptr};
    std::string error;
    EXPECT_FALSE(CheckDeviceKeys(environment, "environment", error)) << key;
    ExpectNamesVariableAndValue(error, key, value);
    EXPECT_NE(error.find(" from environment "), std::string::npos) << error;
  }
}

TEST(CheckDeviceKeys, AcceptsKnownKeysAndIgnoresOthers) {
  const char* environment[] = {"PATH=/bin",
                               "CUDA_DEVICE_MEMORY_LIMIT=4g",
                               "CUDA_DEVICE_MEMORY_LIMIT_0=1g",
                               "CUDA_DEVICE_MEMORY_LIMIT_15=garbage",  // the value is ParseConfig's business
                               "CUDA_DEVICE_SM_LIMIT_9=5",
                               "CUDA_DEVICE_MEMORY_SHARED_CACHE=/x",
                               "CUDA_DEVICE_MEMORY_LIMITS=1",
                               "NO_EQUALS_SIGN",
                               nullptr};
  std::string error;
  EXPECT_TRUE(CheckDeviceKeys(environment, "environment", error)) << error;
  EXPECT_TRUE(CheckDeviceKeys(nullptr, "environment", error));
}

// ---------------------------------------------------------------------------------------------------------------
// ParseConfigFile

using Entries = std::vector<std::pair<std::string, std::string>>;

bool ParseFile(std::string_view text, Entries& entries, std::string& error) {
  return ParseConfigFile(
      text, "/etc/vgpu/vgpu.conf",
      [&entries](std::string_view key, std::string_view value) { entries.emplace_back(key, value); }, error);
}

TEST(ParseConfigFile, ReadsKeyValueLinesCommentsAndBlankLines) {
  const std::string text =
      "# written by the node agent\n"
      "\n"
      "CUDA_DEVICE_MEMORY_LIMIT=4Gi\n"
      "   CUDA_DEVICE_MEMORY_LIMIT_1 \t=  8g  \n"
      "\t# indented comment\n"
      "CUDA_DEVICE_SM_LIMIT=30\r\n"  // a file edited on Windows
      "CUDA_DEVICE_MEMORY_SHARED_CACHE=/run/vgpu/pod#1.cache\n"
      "GPU_CORE_UTILIZATION_POLICY=\n"
      "LIBCUDA_LOG_LEVEL=2";  // no final newline
  Entries entries;
  std::string error;
  ASSERT_TRUE(ParseFile(text, entries, error)) << error;
  const Entries expected = {
      {"CUDA_DEVICE_MEMORY_LIMIT", "4Gi"}, {"CUDA_DEVICE_MEMORY_LIMIT_1", "8g"},
      {"CUDA_DEVICE_SM_LIMIT", "30"},      {"CUDA_DEVICE_MEMORY_SHARED_CACHE", "/run/vgpu/pod#1.cache"},
      {"GPU_CORE_UTILIZATION_POLICY", ""}, {"LIBCUDA_LOG_LEVEL", "2"}};
  EXPECT_EQ(entries, expected);
}

TEST(ParseConfigFile, EmptyFileHasNoEntries) {
  for (const std::string text : {"", "\n", "# nothing\n\n   \n"}) {
    Entries entries;
    std::string error;
    EXPECT_TRUE(ParseFile(text, entries, error)) << error;
    EXPECT_TRUE(entries.empty());
  }
}

TEST(ParseConfigFile, ErrorsNameThePathAndLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"CUDA_DEVICE_SM_LIMIT=30\n\ngarbage\n", "/etc/vgpu/vgpu.conf:3: 'garbage' is not KEY=VALUE"},
      {"=4g\n", "/etc/vgpu/vgpu.conf:1: '=4g' is not KEY=VALUE"},
      {"# c\nFOO=1\n", "/etc/vgpu/vgpu.conf:2: 'FOO' is not a known variable"},
      {"CUDA_DEVICE_MEMORY_LIMIT_20=4g\n", "/etc/vgpu/vgpu.conf:1: 'CUDA_DEVICE_MEMORY_LIMIT_20' is not a known"},
      {"CUDA_DEVICE_MEMORY_LIMIT_01=4g\n", "/etc/vgpu/vgpu.conf:1: 'CUDA_DEVICE_MEMORY_LIMIT_01' is not a known"},
      {"CUDA_DEVICE_SM_LIMIT_x=4\n", "/etc/vgpu/vgpu.conf:1: 'CUDA_DEVICE_SM_LIMIT_x' is not a known"},
      {"export CUDA_DEVICE_SM_LIMIT=4\n", "/etc/vgpu/vgpu.conf:1: 'export CUDA_DEVICE_SM_LIMIT' is not a known"},
      {"cuda_device_sm_limit=4\n", "/etc/vgpu/vgpu.conf:1: 'cuda_device_sm_limit' is not a known"},
      {"CUDA_DEVICE_SM_LIMIT=4\n#\nCUDA_DEVICE_SM_LIMIT = 5\n",
       "/etc/vgpu/vgpu.conf:3: 'CUDA_DEVICE_SM_LIMIT' is set again (first on line 1)"},
      {"a\nb\nc\nd\ne\n", "/etc/vgpu/vgpu.conf:1: 'a' is not KEY=VALUE"},
      {"\n\n\n\n\n\n\n\n\n\nX\n", "/etc/vgpu/vgpu.conf:11: 'X' is not KEY=VALUE"},
  };
  for (const auto& [text, expected] : cases) {
    Entries entries;
    std::string error;
    EXPECT_FALSE(ParseFile(text, entries, error)) << text;
    EXPECT_EQ(error.rfind("vgpu: " + expected, 0), 0u) << "got: " << error;
    EXPECT_NE(error.find("e.g. "), std::string::npos) << error;
    EXPECT_TRUE(IsOnePrintableLine(error)) << error;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// LoadConfig: which source wins

bool IsContractOrSelectorKey(std::string_view key) {
  return IsConfigKey(key) || key == "VGPU_CONFIG_FILE" || key.rfind("CUDA_DEVICE_MEMORY_LIMIT_", 0) == 0 ||
         key.rfind("CUDA_DEVICE_SM_LIMIT_", 0) == 0;
}

class LoadConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "vgpu-config-test-XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    directory_ = pattern;
    // The machine's own environment must not leak into these tests (a CI runner could well set HAMi names).
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string text(*entry);
      const std::size_t equals = text.find('=');
      const std::string key = text.substr(0, equals);
      if (equals != std::string::npos && IsContractOrSelectorKey(key)) {
        saved_.emplace_back(key, text.substr(equals + 1));
      }
    }
    for (const auto& [key, value] : saved_) ::unsetenv(key.c_str());
  }

  void TearDown() override {
    for (const auto& key : set_) ::unsetenv(key.c_str());
    for (const auto& [key, value] : saved_) ::setenv(key.c_str(), value.c_str(), 1);
    std::error_code ignored;
    std::filesystem::permissions(directory_ + "/unreadable.conf", std::filesystem::perms::owner_all, ignored);
    std::filesystem::remove_all(directory_, ignored);
  }

  void SetEnv(const std::string& key, const std::string& value) {
    ::setenv(key.c_str(), value.c_str(), 1);
    set_.push_back(key);
  }

  std::string Write(const std::string& name, const std::string& content) {
    const std::string path = directory_ + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }

  std::string Absent() const { return directory_ + "/absent.conf"; }

  std::string directory_;
  std::vector<std::pair<std::string, std::string>> saved_;
  std::vector<std::string> set_;
};

TEST_F(LoadConfigTest, EnvironmentWhenNoFile) {
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT_1", "2g");
  SetEnv("CUDA_DEVICE_SM_LIMIT", "40");
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, Absent().c_str())) << error;
  EXPECT_EQ(config.source, "environment");
  EXPECT_EQ(config.memory_limit_bytes[0], kGiB);
  EXPECT_EQ(config.memory_limit_bytes[1], 2 * kGiB);
  EXPECT_EQ(config.sm_limit_percent[7], 40u);
  EXPECT_EQ(config.region_path, DefaultRegionPath(static_cast<std::uint32_t>(::getuid())));
}

TEST_F(LoadConfigTest, NothingConfiguredMeansNoLimits) {
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, Absent().c_str())) << error;
  EXPECT_FALSE(config.AnyLimit());
  EXPECT_EQ(config.region_path, "/tmp/vgpu/region." + std::to_string(::getuid()));
}

TEST_F(LoadConfigTest, EnvironmentSharedCacheIsKept) {
  SetEnv("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/run/vgpu/pod.cache");
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, Absent().c_str())) << error;
  EXPECT_EQ(config.region_path, "/run/vgpu/pod.cache");
}

TEST_F(LoadConfigTest, SystemFileWinsOverEnvironment) {
  const std::string system = Write("system.conf", "CUDA_DEVICE_MEMORY_LIMIT=2g\n");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
  SetEnv("CUDA_DEVICE_SM_LIMIT", "abc");        // ignored entirely, even though broken
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT_20", "1g");  // ignored too: the environment is not consulted
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, system.c_str())) << error;
  EXPECT_EQ(config.source, system);
  EXPECT_EQ(config.memory_limit_bytes[0], 2 * kGiB);
  EXPECT_EQ(config.sm_limit_percent[0], 0u);
}

TEST_F(LoadConfigTest, EmptySystemFileIsTheWholeConfiguration) {
  const std::string system = Write("system.conf", "# no limits on this node\n");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, system.c_str())) << error;
  EXPECT_FALSE(config.AnyLimit());
}

TEST_F(LoadConfigTest, SystemFileWinsOverConfigFileVariable) {
  const std::string system = Write("system.conf", "CUDA_DEVICE_MEMORY_LIMIT=2g\n");
  const std::string named = Write("named.conf", "CUDA_DEVICE_MEMORY_LIMIT=3g\n");
  SetEnv("VGPU_CONFIG_FILE", named);
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, system.c_str())) << error;
  EXPECT_EQ(config.source, system);
  EXPECT_EQ(config.memory_limit_bytes[0], 2 * kGiB);
}

TEST_F(LoadConfigTest, ConfigFileVariableWinsOverEnvironment) {
  const std::string named = Write("named.conf", "CUDA_DEVICE_MEMORY_LIMIT=3g\nGPU_CORE_UTILIZATION_POLICY=force\n");
  SetEnv("VGPU_CONFIG_FILE", named);
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, Absent().c_str())) << error;
  EXPECT_EQ(config.source, named);
  EXPECT_EQ(config.memory_limit_bytes[0], 3 * kGiB);
  EXPECT_EQ(config.policy, ComputePolicy::force);
}

TEST_F(LoadConfigTest, BrokenSystemFileFailsClosed) {
  const std::string system = Write("system.conf", "CUDA_DEVICE_MEMORY_LIMIT=2g\nthis line is broken\n");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");  // valid, and must not be used instead
  Config config;
  config.source = "untouched";
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, system.c_str()));
  EXPECT_EQ(error.rfind("vgpu: " + system + ":2: ", 0), 0u) << error;
  EXPECT_EQ(config.source, "untouched");
}

TEST_F(LoadConfigTest, BadValueInSystemFileFailsClosed) {
  const std::string system = Write("system.conf", "CUDA_DEVICE_MEMORY_LIMIT=010x\n");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, system.c_str()));
  ExpectNamesVariableAndValue(error, "CUDA_DEVICE_MEMORY_LIMIT", "010x");
  EXPECT_NE(error.find(" from " + system + " "), std::string::npos) << error;
}

TEST_F(LoadConfigTest, UnknownDeviceIndexInSystemFileFailsClosed) {
  const std::string system = Write("system.conf", "CUDA_DEVICE_MEMORY_LIMIT_20=4g\n");
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, system.c_str()));
  EXPECT_EQ(error.rfind("vgpu: " + system + ":1: 'CUDA_DEVICE_MEMORY_LIMIT_20'", 0), 0u) << error;
}

TEST_F(LoadConfigTest, SystemPathThatIsADirectoryFailsClosed) {
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, directory_.c_str()));
  EXPECT_NE(error.find("is not a regular file"), std::string::npos) << error;
  EXPECT_TRUE(IsOnePrintableLine(error)) << error;
}

TEST_F(LoadConfigTest, DanglingSymlinkAsSystemFileFailsClosed) {
  const std::string link = directory_ + "/dangling.conf";
  ASSERT_EQ(::symlink((directory_ + "/nowhere").c_str(), link.c_str()), 0);
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, link.c_str()));
  EXPECT_NE(error.find("cannot be opened"), std::string::npos) << error;
}

TEST_F(LoadConfigTest, FifoAsSystemFileFailsClosedWithoutHanging) {
  const std::string fifo = directory_ + "/fifo.conf";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, fifo.c_str()));
  EXPECT_NE(error.find("is not a regular file"), std::string::npos) << error;
}

TEST_F(LoadConfigTest, UnreadableSystemFileFailsClosed) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files whatever their mode";
  const std::string system = Write("unreadable.conf", "CUDA_DEVICE_MEMORY_LIMIT=2g\n");
  ASSERT_EQ(::chmod(system.c_str(), 0), 0);
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, system.c_str()));
  EXPECT_NE(error.find("cannot be opened"), std::string::npos) << error;
}

TEST_F(LoadConfigTest, OversizedSystemFileFailsClosed) {
  const std::string system = Write("big.conf", std::string(kMaxConfigFileBytes + 1, '\n'));
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, system.c_str()));
  EXPECT_NE(error.find("is larger than"), std::string::npos) << error;
  const std::string fits = Write("fits.conf", std::string(kMaxConfigFileBytes, '\n'));
  EXPECT_TRUE(LoadConfig(config, error, fits.c_str())) << error;
}

TEST_F(LoadConfigTest, ConfigFileVariableMustNameAnExistingAbsoluteFile) {
  for (const std::string& bad : {Absent(), std::string("relative.conf"), std::string("")}) {
    SetEnv("VGPU_CONFIG_FILE", bad);
    SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
    Config config;
    std::string error;
    EXPECT_FALSE(LoadConfig(config, error, Absent().c_str())) << bad;
    ExpectNamesVariableAndValue(error, "VGPU_CONFIG_FILE", bad);
  }
}

TEST_F(LoadConfigTest, BrokenConfigFileVariableFileFailsClosed) {
  const std::string named = Write("named.conf", "CUDA_DEVICE_MEMORY_LIMIT=1g\nCUDA_DEVICE_MEMORY_LIMIT=2g\n");
  SetEnv("VGPU_CONFIG_FILE", named);
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, Absent().c_str()));
  EXPECT_EQ(error.rfind("vgpu: " + named + ":2: ", 0), 0u) << error;
}

TEST_F(LoadConfigTest, UnknownDeviceIndexInEnvironmentIsAnError) {
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT", "1g");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT_20", "4g");
  Config config;
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, Absent().c_str()));
  ExpectNamesVariableAndValue(error, "CUDA_DEVICE_MEMORY_LIMIT_20", "4g");
}

TEST_F(LoadConfigTest, DisableControlInEnvironmentLiftsEveryLimitEvenBesideAMisspeltDeviceKey) {
  SetEnv("CUDA_DISABLE_CONTROL", "true");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT_0", "1024m");
  SetEnv("CUDA_DEVICE_MEMORY_LIMIT_20", "4g");  // an error where the variables are read; they are not
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, Absent().c_str())) << error;
  EXPECT_TRUE(config.control_disabled);
  EXPECT_FALSE(config.AnyLimit());
  // Without the switch the same environment is refused.
  SetEnv("CUDA_DISABLE_CONTROL", "false");
  EXPECT_FALSE(LoadConfig(config, error, Absent().c_str()));
  ExpectNamesVariableAndValue(error, "CUDA_DEVICE_MEMORY_LIMIT_20", "4g");
}

// Where the node's config file exists the container's environment is not read: a user cannot switch control off.
TEST_F(LoadConfigTest, DisableControlInEnvironmentIsIgnoredWhenTheSystemFileExists) {
  const std::string system = Write("system.conf", "CUDA_DEVICE_MEMORY_LIMIT_0=1024m\n");
  SetEnv("CUDA_DISABLE_CONTROL", "true");
  Config config;
  std::string error;
  ASSERT_TRUE(LoadConfig(config, error, system.c_str())) << error;
  EXPECT_FALSE(config.control_disabled);
  EXPECT_EQ(config.memory_limit_bytes[0], 1024 * kMiB);
  // The node may switch it off in the file itself.
  const std::string off = Write("off.conf", "CUDA_DISABLE_CONTROL=true\nCUDA_DEVICE_MEMORY_LIMIT_0=1024m\n");
  ASSERT_TRUE(LoadConfig(config, error, off.c_str())) << error;
  EXPECT_TRUE(config.control_disabled);
  EXPECT_FALSE(config.AnyLimit());
}

TEST_F(LoadConfigTest, BadEnvironmentValueIsAnErrorAndLeavesOutputUntouched) {
  SetEnv("CUDA_DEVICE_SM_LIMIT_2", "150");
  Config config;
  config.source = "untouched";
  std::string error;
  EXPECT_FALSE(LoadConfig(config, error, Absent().c_str()));
  ExpectNamesVariableAndValue(error, "CUDA_DEVICE_SM_LIMIT_2", "150");
  EXPECT_NE(error.find(" from environment "), std::string::npos) << error;
  EXPECT_EQ(config.source, "untouched");
}

// ---------------------------------------------------------------------------------------------------------------
// Randomized: the parsers are total (no crash, no UB under the sanitizer builds) and agree with a second statement
// of the grammar. One printed seed; VGPU_TEST_SEED=<n> repeats a run.

// SplitMix64: portable, so that a seed means the same inputs with every standard library.
struct Random {
  std::uint64_t state;
  std::uint64_t Next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::size_t Below(std::size_t bound) { return static_cast<std::size_t>(Next() % bound); }
};

std::uint64_t TestSeed() {
  std::uint64_t seed = 20240601;
  if (const char* text = std::getenv("VGPU_TEST_SEED"); text != nullptr && *text != '\0') {
    seed = std::strtoull(text, nullptr, 10);
  }
  std::printf("config_test: VGPU_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

const std::vector<std::string>& Pieces() {
  static const std::vector<std::string> pieces = {"0",
                                                  "1",
                                                  "7",
                                                  "9",
                                                  "00",
                                                  "010",
                                                  "100",
                                                  "101",
                                                  "b",
                                                  "k",
                                                  "K",
                                                  "Ki",
                                                  "m",
                                                  "M",
                                                  "Mi",
                                                  "g",
                                                  "G",
                                                  "Gi",
                                                  "t",
                                                  "T",
                                                  "Ti",
                                                  "B",
                                                  "i",
                                                  "x",
                                                  "-",
                                                  "+",
                                                  ".",
                                                  " ",
                                                  "\t",
                                                  "\r",
                                                  "\n",
                                                  "#",
                                                  "=",
                                                  "_",
                                                  "/",
                                                  "'",
                                                  "\\",
                                                  "CUDA_DEVICE_MEMORY_LIMIT",
                                                  "CUDA_DEVICE_SM_LIMIT",
                                                  "_0",
                                                  "_15",
                                                  "_16",
                                                  "_20",
                                                  "_01",
                                                  "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                                                  "GPU_CORE_UTILIZATION_POLICY",
                                                  "LIBCUDA_LOG_LEVEL",
                                                  "force",
                                                  "default",
                                                  "disable",
                                                  "18446744073709551615",
                                                  "18446744073709551616",
                                                  "16777215",
                                                  "16777216"};
  return pieces;
}

std::string RandomText(Random& random) {
  std::size_t count = random.Below(6);
  if (random.Below(16) == 0) count = random.Below(64);
  std::string text;
  for (std::size_t i = 0; i < count; ++i) {
    if (random.Below(8) == 0) {
      text += static_cast<char>(random.Below(256));  // any byte, NUL and non-ASCII included
    } else {
      text += Pieces()[random.Below(Pieces().size())];
    }
  }
  return text;
}

// The size grammar stated a second way: a table of suffixes tried from the end of the text, and 128-bit
// arithmetic instead of an overflow check. (Not std::regex: GCC 12 warns inside it under the sanitizer presets.)
bool OracleSize(const std::string& text, std::uint64_t& bytes) {
  static const std::vector<std::pair<std::string, int>> suffixes = {
      {"Ki", 10}, {"Mi", 20}, {"Gi", 30}, {"Ti", 40}, {"k", 10}, {"K", 10}, {"m", 20},
      {"M", 20},  {"g", 30},  {"G", 30},  {"t", 40},  {"T", 40}, {"b", 0},  {"", 0}};
  for (const auto& [suffix, shift] : suffixes) {
    if (text.size() < suffix.size() || text.compare(text.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    std::string digits = text.substr(0, text.size() - suffix.size());
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return false;
    digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));
    if (digits.size() > 20) return false;
    unsigned __int128 value = 0;
    for (const char c : digits) value = value * 10 + static_cast<unsigned>(c - '0');
    value <<= shift;
    if (value > kMaxU64) return false;
    bytes = static_cast<std::uint64_t>(value);
    return true;
  }
  return false;
}

const std::vector<std::string>& AllKeys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> result = {"CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT",
                                       "CUDA_DEVICE_MEMORY_SHARED_CACHE", "GPU_CORE_UTILIZATION_POLICY",
                                       "LIBCUDA_LOG_LEVEL"};
    for (int device = 0; device < kMaxDevices; ++device) {
      result.push_back("CUDA_DEVICE_MEMORY_LIMIT_" + std::to_string(device));
      result.push_back("CUDA_DEVICE_SM_LIMIT_" + std::to_string(device));
    }
    return result;
  }();
  return keys;
}

const std::vector<std::string>& PlausibleValues() {
  static const std::vector<std::string> values = {"0",     "1",       "4g",      "4Gi",    "010g", "100", "50", "force",
                                                  "FORCE", "default", "disable", "/tmp/x", "",     "2",   "4"};
  return values;
}

std::string RandomValue(Random& random) {
  return random.Below(2) == 0 ? PlausibleValues()[random.Below(PlausibleValues().size())] : RandomText(random);
}

constexpr int kRandomIterations = 100000;

TEST(Randomized, ParseSizeMatchesTheGrammar) {
  Random random{TestSeed()};
  int accepted = 0;
  for (int iteration = 0; iteration < kRandomIterations; ++iteration) {
    const std::string text = RandomText(random);
    std::uint64_t bytes = 0xdead;
    std::uint64_t expected = 0xdead;
    const bool ok = ParseSize(text, bytes);
    const bool expected_ok = OracleSize(text, expected);
    ASSERT_EQ(ok, expected_ok) << "iteration " << iteration << " text '" << Printable(text) << "'";
    ASSERT_EQ(bytes, expected) << "iteration " << iteration << " text '" << Printable(text) << "'";
    accepted += ok ? 1 : 0;
  }
  // Guards against a generator that only ever produces garbage, which would make the comparison vacuous.
  EXPECT_GT(accepted, kRandomIterations / 100) << "accepted " << accepted;
}

TEST(Randomized, ParseConfigIsTotal) {
  Random random{TestSeed() + 1};
  int accepted = 0;
  for (int iteration = 0; iteration < kRandomIterations; ++iteration) {
    // A few keys at a time: with many set, nearly every draw would fail on its first bad value.
    Values values;
    for (std::size_t i = random.Below(5); i > 0; --i) {
      values[AllKeys()[random.Below(AllKeys().size())]] = RandomValue(random);
    }
    Config config;
    config.source = "sentinel";
    std::string error;
    const std::string where = "iteration " + std::to_string(iteration);
    const bool ok = ParseConfig(FromMap(values), "random", config, error);
    accepted += ok ? 1 : 0;
    if (ok) {
      ASSERT_EQ(config.source, "random") << where;
      for (int device = 0; device < kMaxDevices; ++device) ASSERT_LT(config.sm_limit_percent[device], 100u) << where;
      ASSERT_TRUE(config.log_level >= 0 && config.log_level <= 4) << where;
      ASSERT_TRUE(config.region_path.empty() || config.region_path[0] == '/') << where;
    } else {
      ASSERT_EQ(config.source, "sentinel") << where;
      ASSERT_EQ(error.rfind("vgpu: ", 0), 0u) << where << ": " << error;
      ASSERT_NE(error.find(" from random is not "), std::string::npos) << where << ": " << error;
      ASSERT_TRUE(IsOnePrintableLine(error)) << where << ": " << error;
    }
  }
  EXPECT_GT(accepted, kRandomIterations / 100) << "accepted " << accepted;
}

TEST(Randomized, ParseConfigFileIsTotal) {
  Random random{TestSeed() + 2};
  for (int iteration = 0; iteration < kRandomIterations; ++iteration) {
    std::string text;
    const std::size_t lines = random.Below(6);
    for (std::size_t line = 0; line < lines; ++line) {
      switch (random.Below(4)) {
        case 0:
          text += RandomText(random);
          break;
        case 1:
          text += "# " + RandomText(random);
          break;
        default:
          text += AllKeys()[random.Below(AllKeys().size())] + " = " + RandomValue(random);
          break;
      }
      text += random.Below(8) == 0 ? "\r\n" : "\n";
    }
    Entries entries;
    std::string error;
    const std::string where = "iteration " + std::to_string(iteration);
    if (ParseConfigFile(
            text, "random.conf",
            [&entries](std::string_view key, std::string_view value) { entries.emplace_back(key, value); }, error)) {
      for (const auto& [key, value] : entries) ASSERT_TRUE(IsConfigKey(key)) << where << ": " << key;
      // And on through ParseConfig, as LoadConfig does with a file.
      Values values(entries.begin(), entries.end());
      ASSERT_EQ(values.size(), entries.size()) << where << ": a duplicate key got through";
      Config config;
      if (!ParseConfig(FromMap(values), "random.conf", config, error)) {
        ASSERT_TRUE(IsOnePrintableLine(error)) << where << ": " << error;
      }
    } else {
      ASSERT_EQ(error.rfind("vgpu: random.conf:", 0), 0u) << where << ": " << error;
      ASSERT_TRUE(IsOnePrintableLine(error)) << where << ": " << error;
    }
  }
}

TEST(Randomized, CheckDeviceKeysIsTotal) {
  Random random{TestSeed() + 3};
  for (int iteration = 0; iteration < kRandomIterations; ++iteration) {
    std::vector<std::string> entries;
    for (std::size_t i = random.Below(4); i > 0; --i) entries.push_back(RandomText(random) + "=" + RandomText(random));
    std::vector<const char*> environment;
    for (const auto& entry : entries) environment.push_back(entry.c_str());
    environment.push_back(nullptr);
    std::string error;
    if (!CheckDeviceKeys(environment.data(), "environment", error)) {
      ASSERT_EQ(error.rfind("vgpu: CUDA_DEVICE_", 0), 0u) << "iteration " << iteration << ": " << error;
      ASSERT_TRUE(IsOnePrintableLine(error)) << "iteration " << iteration << ": " << error;
    }
  }
}

}  // namespace
}  // namespace vgpu::policy
