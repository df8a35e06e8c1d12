// Device presets and the parsing of FAKECUDA_DEVICES and byte sizes.
#include <charconv>
#include <cstdio>
#include <cstring>
#include <limits>

#include "fakecuda/model/model.h"

namespace fakecuda::model {
namespace {

constexpr std::uint64_t kMiB = 1024ull * 1024ull;

struct Preset {
  const char* preset;
  const char* name;
  std::uint32_t sm_count, cc_major, cc_minor, max_threads_per_sm, max_blocks_per_sm;
  std::uint32_t shared_bytes_per_block, shared_bytes_per_sm, clock_khz, memory_clock_khz, memory_bus_bits;
  std::uint32_t l2_bytes, power_limit_mw;
  std::uint64_t nvml_total_mib, cuda_total_mib, context_mib;
};

// H100 memory figures measured on an H100 80GB HBM3, driver 580 (DESIGN.md). T4 and A100 totals are the
// commonly reported board figures, not measured here; their context sizes are estimates.
constexpr Preset kPresets[] = {
    {"tesla-t4", "Tesla T4", 40, 7, 5, 1024, 16, 49152, 65536, 1590000, 5001000, 256, 4u << 20, 70000, 15360, 14930,
     300},
    {"a100-40gb", "NVIDIA A100-SXM4-40GB", 108, 8, 0, 2048, 32, 49152, 167936, 1410000, 1215000, 5120, 40u << 20,
     400000, 40960, 40337, 416},
    {"h100-80gb", "NVIDIA H100 80GB HBM3", 132, 9, 0, 2048, 32, 49152, 233472, 1980000, 2619000, 5120, 50u << 20,
     700000, 81559, 81079, 518},
};

DeviceSpec FromPreset(const Preset& p, std::uint32_t index) {
  DeviceSpec spec{};
  std::snprintf(spec.preset, sizeof spec.preset, "%s", p.preset);
  std::snprintf(spec.name, sizeof spec.name, "%s", p.name);
  spec.sm_count = p.sm_count;
  spec.cc_major = p.cc_major;
  spec.cc_minor = p.cc_minor;
  spec.max_threads_per_block = 1024;
  spec.max_threads_per_sm = p.max_threads_per_sm;
  spec.max_blocks_per_sm = p.max_blocks_per_sm;
  spec.warp_size = 32;
  spec.shared_bytes_per_block = p.shared_bytes_per_block;
  spec.shared_bytes_per_sm = p.shared_bytes_per_sm;
  spec.registers_per_sm = 65536;
  spec.clock_khz = p.clock_khz;
  spec.memory_clock_khz = p.memory_clock_khz;
  spec.memory_bus_bits = p.memory_bus_bits;
  spec.l2_bytes = p.l2_bytes;
  spec.pci_bus = 0x18 + index * 0x10;
  spec.power_limit_mw = p.power_limit_mw;
  spec.memory_bytes = p.nvml_total_mib * kMiB;
  spec.reserved_bytes = (p.nvml_total_mib - p.cuda_total_mib) * kMiB;
  spec.context_bytes = p.context_mib * kMiB;
  // A stable, per-index UUID (version-4 layout) so that handles by UUID are reproducible across runs.
  for (std::uint32_t i = 0; i < 16; ++i) {
    spec.uuid[i] = static_cast<std::uint8_t>(0xfa ^ (i * 37) ^ (index * 101) ^ p.sm_count);
  }
  spec.uuid[6] = static_cast<std::uint8_t>((spec.uuid[6] & 0x0f) | 0x40);
  spec.uuid[8] = static_cast<std::uint8_t>((spec.uuid[8] & 0x3f) | 0x80);
  return spec;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

bool ParseUnsigned(std::string_view text, std::uint64_t& value) {
  if (text.empty()) return false;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  return result.ec == std::errc() && result.ptr == text.data() + text.size();
}

// Applies "key=value" to a spec; returns an error message or empty.
std::string ApplyOverride(DeviceSpec& spec, std::string_view item) {
  const auto eq = item.find('=');
  if (eq == std::string_view::npos) return "expected key=value, got '" + std::string(item) + "'";
  const std::string_view key = item.substr(0, eq);
  const std::string_view value = item.substr(eq + 1);
  std::uint64_t number = 0;
  if (key == "memory") {
    if (!ParseBytes(value, number) || number < (64 * kMiB) + spec.reserved_bytes) {
      return "memory='" + std::string(value) +
             "' is not a size of at least 64Mi plus the reserved part "
             "(e.g. memory=16g)";
    }
    spec.memory_bytes = number;
    return {};
  }
  if (key == "sms") {
    if (!ParseUnsigned(value, number) || number == 0 || number > 1024) {
      return "sms='" + std::string(value) + "' is not a whole number of SMs in 1..1024 (e.g. sms=20)";
    }
    spec.sm_count = static_cast<std::uint32_t>(number);
    return {};
  }
  if (key == "context") {
    if (!ParseBytes(value, number) || number >= spec.memory_bytes) {
      return "context='" + std::string(value) + "' is not a size below the device memory (e.g. context=512Mi)";
    }
    spec.context_bytes = number;
    return {};
  }
  return "unknown key '" + std::string(key) + "' (accepted: memory, sms, context)";
}

}  // namespace

const char* PresetNames() { return "tesla-t4, a100-40gb, h100-80gb"; }

bool ParseBytes(std::string_view text, std::uint64_t& bytes) {
  text = Trim(text);
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0) return false;
  std::uint64_t value = 0;
  if (!ParseUnsigned(text.substr(0, digits), value)) return false;
  const std::string_view suffix = text.substr(digits);
  std::uint64_t multiplier = 1;
  if (suffix.empty() || suffix == "b" || suffix == "B") {
    multiplier = 1;
  } else {
    static constexpr struct {
      const char* text;
      std::uint64_t multiplier;
    } kSuffixes[] = {
        {"k", 1ull << 10},  {"K", 1ull << 10},  {"m", 1ull << 20},  {"M", 1ull << 20},
        {"g", 1ull << 30},  {"G", 1ull << 30},  {"t", 1ull << 40},  {"T", 1ull << 40},
        {"Ki", 1ull << 10}, {"Mi", 1ull << 20}, {"Gi", 1ull << 30}, {"Ti", 1ull << 40},
    };
    bool found = false;
    for (const auto& s : kSuffixes) {
      if (suffix == s.text) {
        multiplier = s.multiplier;
        found = true;
        break;
      }
    }
    if (!found) return false;
  }
  if (value > std::numeric_limits<std::uint64_t>::max() / multiplier) return false;
  bytes = value * multiplier;
  return true;
}

MachineConfig DefaultConfig() {
  MachineConfig config{};
  config.mode = SchedulingMode::timeslice;
  // Measured on an H100 (driver 580.159.04, tests/gpu/slice_probe.cu, docs/results-gpu.md "Calibration"): two
  // busy processes are switched out for 2.40-2.44 ms at a time, and a handover costs ~160 us (154-165 us from the
  // last instruction of one context to the first of the next): a 2.1 ms slice plus two switches.
  config.timeslice_ns = 2'100'000;
  config.switch_ns = 160'000;
  config.nvml_window_ns = 200'000'000;
  config.nvml_publish_lag_ns = 40'000'000;
  std::string error;
  ParseDevices("h100-80gb", config, error);
  return config;
}

bool ParseDevices(std::string_view spec, MachineConfig& config, std::string& error) {
  const std::string whole(spec);
  if (whole.size() >= sizeof config.devices_spec) {
    error = "FAKECUDA_DEVICES is " + std::to_string(whole.size()) + " characters long; at most " +
            std::to_string(sizeof config.devices_spec - 1) + " are accepted (use 'N*preset' to repeat a device)";
    return false;
  }
  std::uint32_t count = 0;
  std::string_view rest = Trim(spec);
  if (rest.empty()) {
    error = "FAKECUDA_DEVICES is empty; accepted: a comma list of presets (" + std::string(PresetNames()) +
            "), e.g. 'h100-80gb' or '2*a100-40gb'";
    return false;
  }
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    std::string_view item = Trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    std::uint64_t repeat = 1;
    if (const auto star = item.find('*'); star != std::string_view::npos) {
      if (!ParseUnsigned(Trim(item.substr(0, star)), repeat) || repeat == 0) {
        error = "FAKECUDA_DEVICES='" + whole + "': bad repeat count in '" + std::string(item) + "' (e.g. 2*h100-80gb)";
        return false;
      }
      item = Trim(item.substr(star + 1));
    }
    const auto colon = item.find(':');
    const std::string_view preset_name = item.substr(0, colon);
    const Preset* preset = nullptr;
    for (const auto& p : kPresets) {
      if (preset_name == p.preset) preset = &p;
    }
    if (preset == nullptr) {
      error = "FAKECUDA_DEVICES='" + whole + "': unknown preset '" + std::string(preset_name) +
              "' (accepted: " + PresetNames() + ")";
      return false;
    }
    for (std::uint64_t r = 0; r < repeat; ++r) {
      if (count >= kMaxDevices) {
        error = "FAKECUDA_DEVICES='" + whole + "': more than " + std::to_string(kMaxDevices) + " devices";
        return false;
      }
      DeviceSpec device = FromPreset(*preset, count);
      std::string_view overrides = colon == std::string_view::npos ? std::string_view{} : item.substr(colon + 1);
      while (!overrides.empty()) {
        const auto next = overrides.find(':');
        const std::string message = ApplyOverride(device, overrides.substr(0, next));
        if (!message.empty()) {
          error = "FAKECUDA_DEVICES='" + whole + "': " + message;
          return false;
        }
        overrides = next == std::string_view::npos ? std::string_view{} : overrides.substr(next + 1);
      }
      config.devices[count++] = device;
    }
  }
  config.device_count = count;
  std::snprintf(config.devices_spec, sizeof config.devices_spec, "%s", whole.c_str());
  return true;
}

}  // namespace fakecuda::model
