// The CUDA runtime's integrity check (docs/fakecuda-runtime.md, "The integrity table"): before it trusts a driver,
// libcudart asks it for an HMAC-MD2 (RFC 2104 over RFC 1319's MD2) of what both sides can see -- the driver's version,
// the process and thread, the addresses of two export tables, the time, and each device's UUID and PCI address -- and
// recomputes it. Pure: the caller gathers the inputs.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace fakecuda::driver::integrity {

using Digest = std::array<std::uint8_t, 16>;

// RFC 1319.
Digest Md2(std::span<const std::uint8_t> message);
// RFC 2104 with MD2 (a 16-byte block): the key is exactly one block.
Digest HmacMd2(const Digest& key, std::span<const std::uint8_t> message);

struct Device {
  std::array<std::uint8_t, 16> uuid{};
  std::int32_t pci_domain = 0;
  std::int32_t pci_bus = 0;
  std::int32_t pci_device = 0;
};

// What the runtime hashes, in its order (48 bytes, then 28 a device, little endian).
struct Inputs {
  std::uint32_t driver_version = 0;  // what cuDriverGetVersion gives
  std::uint32_t version = 0;         // the call's argument: the runtime's version (+0, +1, +2 on its three calls)
  std::uint32_t pid = 0;
  std::uint32_t thread = 0;              // (uint32_t)pthread_self()
  std::uint64_t runtime_table = 0;       // the address of the runtime interface table handed out
  std::uint64_t integrity_table = 0;     // the address of the integrity table handed out
  std::uint64_t integrity_function = 0;  // its entry 1, the function being called
  std::uint64_t unix_seconds = 0;        // the call's argument
  std::vector<Device> devices;           // every device cuDeviceGetCount counts, in ordinal order
};

std::vector<std::uint8_t> Message(const Inputs& inputs);

// The answer for `inputs.version`: fixed bytes when version % 10 is 0 or 1, else HMAC-MD2 of Message(inputs).
Digest Answer(const Inputs& inputs);

}  // namespace fakecuda::driver::integrity
