// The figures fakecuda's NVML reports beyond what the model stores: identifiers, clocks, temperature, power.
// Pure functions of the device spec and the utilization history, so they can be tested without a machine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fakecuda/model/layout.h"

namespace fakecuda::nvml {

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower-case hex, as NVML prints it.
std::string UuidString(const model::DeviceSpec& spec);

// A board serial number in the form NVIDIA prints (13 decimal digits), stable per UUID.
std::string SerialString(const model::DeviceSpec& spec);

// Every device is function 0 of device 0 on its own bus of PCI domain 0, as on a typical HGX board.
struct PciAddress {
  std::uint32_t domain = 0;
  std::uint32_t bus = 0;
  std::uint32_t device = 0;
  std::uint32_t function = 0;
};

PciAddress AddressOf(const model::DeviceSpec& spec);

// "00000000:18:00.0" (NVML's busId) or, with `legacy`, "0000:18:00.0" (busIdLegacy and the v1/v2 busId).
std::string BusIdString(const PciAddress& address, bool legacy);

// Parses the forms nvmlDeviceGetHandleByPciBusId accepts, all hexadecimal: domain:bus:device.function,
// domain:bus:device, bus:device.function. False if `text` is none of them.
bool ParseBusId(std::string_view text, PciAddress& address);

struct PciIds {
  std::uint32_t device_id;     // 16-bit device id << 16 | 16-bit vendor id (0x10DE)
  std::uint32_t subsystem_id;  // 16-bit subsystem id << 16 | 16-bit subsystem vendor id
};

// The ids of the real board the preset models; a generic NVIDIA id for anything else.
PciIds PciIdsOf(const model::DeviceSpec& spec);

enum class Clock { graphics, sm, memory, video };

// MHz. `busy`: the device ran kernels in the latest published window (a real GPU boosts as soon as it has
// work and drops to its idle clock when it has none). `max` ignores `busy`.
std::uint32_t ClockMhz(const model::DeviceSpec& spec, Clock clock, bool busy, bool max);

// The device utilization, smoothed over the published windows kept in the history: the slow signal
// that temperature follows (a die heats up over seconds, not within one 200 ms window).
double SmoothedUtilizationPercent(const model::Machine& machine, std::uint32_t device, std::uint64_t now_ns);

// Degrees Celsius: 32 idle, rising toward 60 at full load. `hottest`: the hottest spot of the die
// (NVML_TEMPERATURE_GPU_MAX), a few degrees above the average sensor.
std::uint32_t TemperatureCelsius(double smoothed_percent, bool hottest);

// Milliwatts drawn at `percent` device utilization: a tenth of the limit idle, the limit at 100 %.
std::uint32_t PowerMilliwatts(const model::DeviceSpec& spec, std::uint32_t percent);

// The lowest power limit an administrator may set (NVML's constraint minimum).
std::uint32_t MinPowerLimitMilliwatts(const model::DeviceSpec& spec);

}  // namespace fakecuda::nvml
