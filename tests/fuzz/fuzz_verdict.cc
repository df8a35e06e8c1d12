// libFuzzer target: the node monitor's verdict (vgpu-core/verdict, docs/node-monitor.md), which the shim parses inside
// every container process from a file the platform mounts; a malformed one must be refused, never crash a process.
//
// Invariants:
//   - Parse either accepts, or refuses with a one-line message of printable ASCII starting "verdict" and leaves its
//     output untouched;
//   - an accepted verdict is within the format's bounds (devices, processes, permille figures, UUIDs of NVML's form,
//     every process naming a listed device, no device or process twice) and formats to a text that parses back to
//     the same verdict, and formats again to the same text (a fixed point);
//   - IsFresh is symmetric about its stamp and monotonic in the distance.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "vgpu/verdict/verdict.h"

namespace {

namespace v = vgpu::verdict;

[[noreturn]] void Fail(const char* what, std::string_view detail = {}) {
  std::fprintf(stderr, "fuzz_verdict: invariant broken: %s [", what);
  for (const char c : detail.substr(0, 400)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      std::fputc(byte, stderr);
    } else {
      std::fprintf(stderr, "\\x%02x", byte);
    }
  }
  std::fprintf(stderr, "]\n");
  std::abort();
}

#define CHECK(condition, ...)                          \
  do {                                                 \
    if (!(condition)) Fail(#condition, ##__VA_ARGS__); \
  } while (false)

bool Same(const v::Verdict& a, const v::Verdict& b) {
  if (a.seq != b.seq || a.stamp_ns != b.stamp_ns || a.devices.size() != b.devices.size() ||
      a.processes.size() != b.processes.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.devices.size(); ++i) {
    const v::Device &x = a.devices[i], &y = b.devices[i];
    if (x.uuid != y.uuid || x.memory_limit != y.memory_limit || x.memory_used != y.memory_used ||
        x.sm_limit != y.sm_limit || x.sm_used != y.sm_used) {
      return false;
    }
  }
  for (std::size_t i = 0; i < a.processes.size(); ++i) {
    const v::Process &x = a.processes[i], &y = b.processes[i];
    if (x.pid != y.pid || x.device != y.device || x.memory_used != y.memory_used || x.sm_used != y.sm_used)
      return false;
  }
  return true;
}

void CheckBounds(const v::Verdict& verdict, std::string_view text) {
  CHECK(verdict.devices.size() <= v::kMaxDevices, text);
  CHECK(verdict.processes.size() <= v::kMaxProcesses, text);
  for (std::size_t i = 0; i < verdict.devices.size(); ++i) {
    const v::Device& d = verdict.devices[i];
    CHECK(v::IsDeviceUuid(d.uuid), text);
    CHECK(d.sm_limit <= 1000 && d.sm_used <= 1000, text);
    CHECK(verdict.FindDevice(d.uuid) == &d, text);  // listed once
  }
  for (const v::Process& p : verdict.processes) {
    CHECK(p.pid != 0 && p.sm_used <= 1000, text);
    CHECK(verdict.FindDevice(p.device) != nullptr, text);
    CHECK(verdict.FindProcess(p.pid, p.device) == &p, text);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  v::Verdict parsed;
  parsed.seq = 12345;
  std::string error;
  if (!v::Parse(text, parsed, error)) {
    CHECK(parsed.seq == 12345 && parsed.devices.empty() && parsed.processes.empty(), text);
    CHECK(error.rfind("verdict", 0) == 0, error);
    CHECK(error.size() < 1024, error);
    for (const char c : error) CHECK(c >= 0x20 && c < 0x7f, error);
  } else {
    CheckBounds(parsed, text);
    const std::string formatted = v::Format(parsed);
    v::Verdict again;
    std::string again_error;
    CHECK(v::Parse(formatted, again, again_error), again_error);
    CHECK(Same(parsed, again), formatted);
    CHECK(v::Format(again) == formatted, formatted);
  }
  // IsFresh, with the first 16 bytes as two clock readings.
  if (size >= 16) {
    std::uint64_t stamp = 0, now = 0;
    for (int i = 0; i < 8; ++i) {
      stamp = stamp << 8 | data[i];
      now = now << 8 | data[8 + i];
    }
    const std::uint64_t distance = stamp > now ? stamp - now : now - stamp;
    CHECK(v::IsFresh(stamp, now) == (distance <= v::kFreshNs));
    CHECK(v::IsFresh(stamp, now) == v::IsFresh(now, stamp));
  }
  return 0;
}
