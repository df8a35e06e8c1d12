// The node monitor's verdict on one container (docs/node-monitor.md): what the driver says the container's processes
// hold and use, per device, written by vgpu-monitor on the host and read, never written, by the shims inside the
// container. Pure: text in, text out (the OS side, reading and writing files, is verdict_file.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vgpu::verdict {

inline constexpr int kVersion = 1;
// A verdict names at most this many devices and processes; a file with more is refused (a bug or not ours).
inline constexpr std::size_t kMaxDevices = 64;
inline constexpr std::size_t kMaxProcesses = 4096;
// Anything larger than this is not a verdict: refused rather than read.
inline constexpr std::size_t kMaxBytes = 1 << 20;
// How old a verdict may be (and how far ahead of the reader's clock) to be used: docs/node-monitor.md.
inline constexpr std::uint64_t kFreshNs = 1'000'000'000;
// The SM figures (sm_used) are NVML's samples of the last kSmWindowNs (a few samples: NVML's windows are ~100-200 ms);
// a shim acts on them at most once per window, so that one excess is not corrected twice.
inline constexpr std::uint64_t kSmWindowNs = 1'000'000'000;

struct Device {
  std::string uuid;                // NVML's form: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
  std::uint64_t memory_limit = 0;  // bytes; 0: no limit
  std::uint64_t memory_used = 0;   // bytes, the driver's count over the container's processes
  std::uint32_t sm_limit = 0;      // permille of the device; 0: no limit
  std::uint32_t sm_used = 0;       // permille, over the last kSmWindowNs, summed over the container's processes

  bool MemoryOver() const { return memory_limit != 0 && memory_used > memory_limit; }
};

struct Process {
  std::uint32_t pid = 0;  // as the container sees it (the last NSpid)
  std::string device;     // a Device's uuid
  std::uint64_t memory_used = 0;
  std::uint32_t sm_used = 0;  // permille
};

struct Verdict {
  std::uint64_t seq = 0;
  std::uint64_t stamp_ns = 0;  // CLOCK_REALTIME when it was written
  std::vector<Device> devices;
  std::vector<Process> processes;

  const Device* FindDevice(std::string_view uuid) const;
  const Process* FindProcess(std::uint32_t pid, std::string_view device) const;
};

// The text of a verdict (docs/node-monitor.md, "The verdict").
std::string Format(const Verdict& verdict);

// Parses `text`. Strict: the header line first, each of seq and stamp_ns once, devices by a UUID of NVML's form,
// numbers in decimal without signs or spaces inside, every key of a line once, processes naming a listed device.
// On failure returns false and sets `error` to one line naming the line number, what is wrong and an accepted example;
// `out` is then left untouched.
bool Parse(std::string_view text, Verdict& out, std::string& error);

// Whether a verdict stamped `stamp_ns` may be used at `now_ns` (both CLOCK_REALTIME): no older than kFreshNs, no
// further ahead than kFreshNs.
bool IsFresh(std::uint64_t stamp_ns, std::uint64_t now_ns);

// Whether `uuid` has NVML's form (GPU- and 32 hex digits in groups of 8-4-4-4-12, or MIG- the same way).
bool IsDeviceUuid(std::string_view uuid);

// NVML's form of a 16-byte CUDA UUID ("GPU-" and its bytes in hex, grouped 8-4-4-4-12).
std::string UuidText(const unsigned char bytes[16]);

}  // namespace vgpu::verdict
