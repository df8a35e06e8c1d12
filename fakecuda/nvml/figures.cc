// Identifiers, clocks, temperature and power of a fake device, derived from its spec and utilization.
#include "figures.h"
#include "vgpu/base/random.h"
#include "vgpu/base/uuid.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>

namespace fakecuda::nvml {
namespace {

constexpr std::uint32_t kNvidiaVendorId = 0x10DE;

struct BoardFigures {
  const char* preset;
  std::uint16_t device_id;
  std::uint16_t subsystem_id;
  std::uint32_t min_power_limit_mw;
};

// PCI ids of the boards the presets model (H100 SXM5 80GB, A100 SXM4 40GB, T4) and the lowest power
// limit each accepts, as their nvidia-smi -q reports them.
constexpr BoardFigures kBoards[] = {
    {"h100-80gb", 0x2330, 0x16C1, 200'000},
    {"a100-40gb", 0x20B0, 0x134F, 100'000},
    {"tesla-t4", 0x1EB8, 0x12A2, 60'000},
};

const BoardFigures* BoardOf(const model::DeviceSpec& spec) {
  for (const BoardFigures& board : kBoards) {
    if (std::strncmp(spec.preset, board.preset, sizeof spec.preset) == 0) return &board;
  }
  return nullptr;
}

// An H100 SXM5 idles at 345 MHz of its 1980 MHz graphics clock, and its video clock tops out at 1755 MHz
// (765 MHz idle); other presets scale the same way from their own maximum clock.
constexpr double kIdleGraphicsFraction = 345.0 / 1980.0;
constexpr double kMaxVideoFraction = 1755.0 / 1980.0;
constexpr double kIdleVideoFraction = 765.0 / 1980.0;

constexpr double kIdleCelsius = 32.0;
constexpr double kFullLoadCelsius = 60.0;
constexpr double kHottestSpotExtraCelsius = 4.0;
constexpr double kIdlePowerFraction = 0.10;

// Weight of each newer window in the smoothed utilization: about a 4-window (800 ms) time constant.
constexpr double kSmoothingWeight = 0.25;

// Parses 1..`max_digits` hexadecimal digits into `value`, which must not exceed `limit`.
bool ParseHex(std::string_view text, std::size_t max_digits, std::uint32_t limit, std::uint32_t& value) {
  if (text.empty() || text.size() > max_digits) return false;
  std::uint64_t result = 0;
  for (const char c : text) {
    std::uint32_t digit = 0;
    if (c >= '0' && c <= '9')
      digit = static_cast<std::uint32_t>(c - '0');
    else if (c >= 'a' && c <= 'f')
      digit = static_cast<std::uint32_t>(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      digit = static_cast<std::uint32_t>(c - 'A' + 10);
    else
      return false;
    result = result * 16 + digit;
  }
  if (result > limit) return false;
  value = static_cast<std::uint32_t>(result);
  return true;
}

}  // namespace

std::string UuidString(const model::DeviceSpec& spec) { return vgpu::base::GpuUuidText(spec.uuid); }

std::string SerialString(const model::DeviceSpec& spec) {
  // FNV-1a over the UUID: stable, and distinct for distinct UUIDs in practice.
  std::uint64_t hash = vgpu::base::kFnvOffset;
  for (const std::uint8_t byte : spec.uuid) hash = vgpu::base::Fnv1aStep(hash, byte);
  char text[32];
  std::snprintf(text, sizeof text, "165%010" PRIu64, static_cast<std::uint64_t>(hash % 10'000'000'000ull));
  return text;
}

PciAddress AddressOf(const model::DeviceSpec& spec) {
  PciAddress address;
  address.bus = spec.pci_bus & 0xff;
  return address;
}

std::string BusIdString(const PciAddress& address, bool legacy) {
  char text[40];
  std::snprintf(text, sizeof text, legacy ? "%04X:%02X:%02X.%X" : "%08X:%02X:%02X.%X", address.domain, address.bus,
                address.device, address.function);
  return text;
}

bool ParseBusId(std::string_view text, PciAddress& address) {
  const std::size_t first = text.find(':');
  if (first == std::string_view::npos) return false;
  const std::size_t second = text.find(':', first + 1);
  std::string_view domain_text;
  std::string_view bus_text;
  std::string_view rest;
  if (second == std::string_view::npos) {
    bus_text = text.substr(0, first);  // bus:device.function
    rest = text.substr(first + 1);
    if (rest.find('.') == std::string_view::npos) return false;
  } else {
    domain_text = text.substr(0, first);
    bus_text = text.substr(first + 1, second - first - 1);
    rest = text.substr(second + 1);
  }
  std::string_view device_text = rest;
  std::string_view function_text;
  if (const std::size_t dot = rest.find('.'); dot != std::string_view::npos) {
    device_text = rest.substr(0, dot);
    function_text = rest.substr(dot + 1);
    if (function_text.empty()) return false;
  }
  PciAddress parsed;
  if (!domain_text.empty() && !ParseHex(domain_text, 8, 0xffffffffu, parsed.domain)) return false;
  if (!ParseHex(bus_text, 2, 0xff, parsed.bus)) return false;
  if (!ParseHex(device_text, 2, 0x1f, parsed.device)) return false;
  if (!function_text.empty() && !ParseHex(function_text, 1, 7, parsed.function)) return false;
  address = parsed;
  return true;
}

PciIds PciIdsOf(const model::DeviceSpec& spec) {
  const BoardFigures* board = BoardOf(spec);
  const std::uint32_t device_id = board != nullptr ? board->device_id : 0x2330;
  const std::uint32_t subsystem_id = board != nullptr ? board->subsystem_id : 0x0000;
  return {device_id << 16 | kNvidiaVendorId, subsystem_id << 16 | kNvidiaVendorId};
}

std::uint32_t ClockMhz(const model::DeviceSpec& spec, Clock clock, bool busy, bool max) {
  const double top_mhz = spec.clock_khz / 1000.0;
  const bool boosted = busy || max;
  switch (clock) {
    case Clock::graphics:
    case Clock::sm:
      return static_cast<std::uint32_t>(boosted ? top_mhz : top_mhz * kIdleGraphicsFraction + 0.5);
    case Clock::memory:
      return spec.memory_clock_khz / 1000;
    case Clock::video:
      return static_cast<std::uint32_t>(top_mhz * (boosted ? kMaxVideoFraction : kIdleVideoFraction) + 0.5);
  }
  return 0;
}

double SmoothedUtilizationPercent(const model::Machine& machine, std::uint32_t device, std::uint64_t now_ns) {
  if (device >= machine.config.device_count || device >= model::kMaxDevices) return 0.0;
  const model::DeviceTimeline& timeline = machine.devices[device];
  const std::uint32_t available = std::min<std::uint32_t>(timeline.window_count, model::kWindowHistory);
  double smoothed = 0.0;
  // Oldest first, so that the newest window weighs most.
  for (std::uint32_t back = available; back >= 1; --back) {
    const model::UtilWindow& window = timeline.windows[(timeline.window_count - back) % model::kWindowHistory];
    if (window.end_ns + machine.config.nvml_publish_lag_ns > now_ns) continue;
    smoothed += (std::min<std::uint32_t>(window.percent, 100) - smoothed) * kSmoothingWeight;
  }
  return smoothed;
}

std::uint32_t TemperatureCelsius(double smoothed_percent, bool hottest) {
  const double load = std::clamp(smoothed_percent, 0.0, 100.0) / 100.0;
  const double celsius =
      kIdleCelsius + (kFullLoadCelsius - kIdleCelsius) * load + (hottest ? kHottestSpotExtraCelsius : 0.0);
  return static_cast<std::uint32_t>(celsius + 0.5);
}

std::uint32_t PowerMilliwatts(const model::DeviceSpec& spec, std::uint32_t percent) {
  const double limit = spec.power_limit_mw;
  const double idle = limit * kIdlePowerFraction;
  const double load = std::min<std::uint32_t>(percent, 100) / 100.0;
  return static_cast<std::uint32_t>(idle + (limit - idle) * load + 0.5);
}

std::uint32_t MinPowerLimitMilliwatts(const model::DeviceSpec& spec) {
  const BoardFigures* board = BoardOf(spec);
  const std::uint32_t minimum = board != nullptr ? board->min_power_limit_mw : spec.power_limit_mw / 4;
  return std::min(minimum, spec.power_limit_mw);
}

}  // namespace fakecuda::nvml
