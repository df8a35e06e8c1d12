// The container region's shared layout: what every process of a container maps (docs/region.md).
//
// This header is an ABI between processes, possibly built at different commits. Bump kRegionVersion whenever
// any field changes meaning, size or position. Fixed-size, trivially copyable types only; no pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace vgpu::region {

inline constexpr std::uint64_t kRegionMagic = 0x4e47455255504756ULL;  // "VGPUREGN" little-endian
inline constexpr std::uint32_t kRegionVersion = 6;  // 2: the compute budget in Device::compute; 3: its busy
                                                    // time in 10 ms buckets (576 bytes); 4: time division's
                                                    // turn cell after the budget (the container's id, its account);
                                                    // 5: after HAMi-core's part, at kRegionOffset; 6: Device's
                                                    // held_ns and refused_allocations (monitoring counters)
// The file (docs/hami-cache.md): HAMi-core's v1 part first (hami_v1.h: what HAMi's monitor reads), the region at
// kRegionOffset (491 pages: HAMi's 2,008,952 bytes rounded up), and past both, never written, one liveness byte per
// slot at kLivenessBase + slot, the same in every version from 5 on.
inline constexpr std::size_t kRegionOffset = 2'011'136;
inline constexpr std::uint64_t kLivenessBase = 1ull << 40;
inline constexpr std::uint32_t kMaxDevices = 16;
inline constexpr std::uint32_t kMaxSlots = 1024;

enum class SlotState : std::uint32_t { free = 0, claiming = 1, live = 2 };

struct Device {
  std::uint8_t uuid[16];
  std::uint32_t in_use;  // 1 once a process named this device
  std::uint32_t reserved0;
  std::uint64_t used_bytes;     // derived: sum of the live slots' used_bytes (a cache, repaired)
  std::uint64_t context_bytes;  // measured context overhead on this device, 0 = not yet known
  std::uint64_t limit_bytes;    // as configured by the last process that attached; monitoring only
  // The compute limiter's shared budget (vgpu::policy::BudgetCell, docs/compute-limit.md), updated with atomics
  // only. Opaque here: the region does not depend on the policy code; the shim checks that it fits.
  alignas(8) std::uint8_t compute[576];
  // Version 6: monitoring only (docs/region.md, "Monitoring counters"), never read by enforcement. Each only grows, by
  // an 8-byte relaxed fetch_add without the lock; a container's processes can write them: only their own figures.
  std::uint64_t held_ns;              // time the container's launches waited for the compute limiter (budget, turn)
  std::uint64_t refused_allocations;  // allocations refused at the memory limit (Charge false), one per call
};

struct Slot {
  SlotState state;
  std::int32_t pid;          // in the container's pid namespace; -1: a holder we could not name
  std::uint64_t generation;  // unique per claim: a process notices if its slot was taken from it
  std::uint64_t started_ns;  // CLOCK_REALTIME at claim, for monitoring
  std::uint64_t used_bytes[kMaxDevices];
  std::uint64_t peak_bytes[kMaxDevices];
};

struct Region {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t region_bytes;
  std::uint64_t created_ns;  // CLOCK_REALTIME at creation, for monitoring
  std::uint64_t next_generation;
  std::uint64_t last_reap_ns;  // CLOCK_MONOTONIC (one clock per host: every process agrees)
  std::uint32_t device_count;  // entries of `devices` in use
  // How many times a locker inherited the lock from a dead owner (EOWNERDEAD) and repaired: each is a process that
  // died inside the lock. Monitoring only, counted under the lock (read with a 4-byte atomic load). Was `reserved0`
  // (always 0, never read): no version bump, since a build that does not count it only leaves it at 0.
  std::uint32_t lock_repairs;
  alignas(64) unsigned char lock_storage[64];  // robust, process-shared pthread mutex
  Device devices[kMaxDevices];
  Slot slots[kMaxSlots];
};

static_assert(std::is_trivially_copyable_v<Region>);
// Counters are read without the lock through 8-byte atomic loads: they must be naturally aligned.
static_assert(offsetof(Region, devices) % 8 == 0 && sizeof(Device) % 8 == 0);
static_assert(offsetof(Device, held_ns) % 8 == 0 && offsetof(Device, refused_allocations) % 8 == 0);
static_assert(sizeof(Device) == 640, "a Device field changed: bump kRegionVersion (docs/region.md)");
static_assert(offsetof(Region, slots) % 8 == 0 && sizeof(Slot) % 8 == 0 && offsetof(Slot, used_bytes) % 8 == 0);
static_assert(std::is_standard_layout_v<Region>);
inline constexpr std::size_t kFileBytes = kRegionOffset + sizeof(Region);

}  // namespace vgpu::region
