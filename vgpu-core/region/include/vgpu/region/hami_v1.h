// HAMi-core's shared region, version 1.2: the first part of the file at CUDA_DEVICE_MEMORY_SHARED_CACHE, which
// HAMi's vGPU monitor reads (its memory and utilization series) and writes (its feedback). docs/hami-cache.md says
// who writes which field and when; the offsets are HAMi's (../shared/HAMI-CONTRACT.md, HAMi's
// pkg/monitor/nvidia/v1/spec.go), asserted below. An ABI with another project: never change a field here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace vgpu::region::hami {

inline constexpr std::int32_t kMagic = 19920718;  // initialized_flag
inline constexpr std::uint32_t kMajorVersion = 1;
inline constexpr std::uint32_t kMinorVersion = 2;
inline constexpr std::uint32_t kMaxDevices = 16;
inline constexpr std::uint32_t kMaxProcs = 1024;
inline constexpr std::size_t kUuidBytes = 96;

struct DeviceMemory {
  std::uint64_t context;
  std::uint64_t module;
  std::uint64_t data;
  std::uint64_t offset;
  std::uint64_t total;
  std::uint64_t unused[3];
};

struct DeviceUtil {
  std::uint64_t dec;
  std::uint64_t enc;
  std::uint64_t sm;
  std::uint64_t unused[3];
};

struct ProcSlot {
  std::int32_t pid;
  std::int32_t hostpid;
  DeviceMemory used[kMaxDevices];
  std::uint64_t monitor_used[kMaxDevices];
  DeviceUtil device_util[kMaxDevices];
  std::int32_t status;  // != 0: the slot counts
  std::uint32_t padding;
  std::uint64_t seqlock;
  std::uint64_t unused[2];
};

struct SharedRegion {
  std::int32_t initialized_flag;
  std::uint32_t major_version;
  std::uint32_t minor_version;
  std::int32_t sm_init_flag;
  std::uint64_t owner_pid;
  unsigned char sem[32];
  std::uint64_t device_num;
  char uuids[kMaxDevices][kUuidBytes];
  std::uint64_t limit[kMaxDevices];
  std::uint64_t sm_limit[kMaxDevices];
  ProcSlot procs[kMaxProcs];
  std::int32_t proc_num;
  std::int32_t utilization_switch;
  std::int32_t recent_kernel;
  std::int32_t priority;
  std::int64_t last_kernel_time;  // unix seconds
  unsigned char sem_postinit[32];
};

static_assert(std::is_standard_layout_v<SharedRegion> && std::is_trivially_copyable_v<SharedRegion>);
static_assert(sizeof(ProcSlot) == 1960 && offsetof(ProcSlot, used) == 8 && sizeof(DeviceMemory) == 64 &&
              offsetof(ProcSlot, monitor_used) == 1032 && offsetof(ProcSlot, device_util) == 1160 &&
              sizeof(DeviceUtil) == 48 && offsetof(ProcSlot, status) == 1928);
static_assert(offsetof(SharedRegion, owner_pid) == 16 && offsetof(SharedRegion, sem) == 24 &&
              offsetof(SharedRegion, device_num) == 56 && offsetof(SharedRegion, uuids) == 64 &&
              offsetof(SharedRegion, limit) == 1600 && offsetof(SharedRegion, sm_limit) == 1728 &&
              offsetof(SharedRegion, procs) == 1856 && offsetof(SharedRegion, proc_num) == 2008896 &&
              offsetof(SharedRegion, utilization_switch) == 2008900 &&
              offsetof(SharedRegion, recent_kernel) == 2008904 && offsetof(SharedRegion, priority) == 2008908 &&
              offsetof(SharedRegion, last_kernel_time) == 2008912 && sizeof(SharedRegion) == 2008952);

// The mirror: what the region writes into HAMi's part as its own state changes (docs/hami-cache.md). Fields go in
// with atomic stores, since HAMi's monitor reads them without a lock; the region calls these under its own lock.
void Initialize(SharedRegion& hami);
// Device `index` has this 16-byte UUID and the table now holds `count` devices (the UUID first, the count after).
void MirrorDevice(SharedRegion& hami, std::uint32_t index, const std::uint8_t uuid[16], std::uint32_t count);
void MirrorLimit(SharedRegion& hami, std::uint32_t device, std::uint64_t bytes);
void MirrorSmLimit(SharedRegion& hami, std::uint32_t device, std::uint32_t percent);
// Slot `slot` is live for `pid` (its usage zero first, `status` last), or free (`status` first, then zeroed).
void MirrorSlotLive(SharedRegion& hami, std::uint32_t slot, std::int32_t pid);
void MirrorSlotFree(SharedRegion& hami, std::uint32_t slot);
// What process slot `slot` holds on `device` in total; `data` (its allocations) is the total less the slot's
// `context` and `module` (MirrorBreakdown).
void MirrorUsed(SharedRegion& hami, std::uint32_t slot, std::uint32_t device, std::uint64_t bytes);
// Of that, its contexts' memory (`context`) and the driver's own memory for it (`module`: modules, local memory).
void MirrorBreakdown(SharedRegion& hami, std::uint32_t slot, std::uint32_t device, std::uint64_t context,
                     std::uint64_t module);
// A launch at unix second `unix_s`: recent_kernel := 2 (HAMi's monitor decrements it every 5 s: the container
// counts as active while it is above 0), unless the monitor set it to -1 (held for a higher priority) or it reads 2
// already; last_kernel_time := unix_s.
void MirrorLaunch(SharedRegion& hami, std::int64_t unix_s);
void MirrorPriority(SharedRegion& hami, std::int32_t priority);
// Process slot `slot`'s share of `device`'s time over the last second, in percent (HAMi sums them per container).
void MirrorUtilization(SharedRegion& hami, std::uint32_t slot, std::uint32_t device, std::uint32_t percent);
// HAMi's monitor's feedback, as it last wrote it: `recent_kernel` (-1: hold launches, a container of a higher
// priority is active) and `utilization_switch` (1: another container is active on one of our GPUs).
std::int32_t RecentKernel(const SharedRegion& hami);
std::int32_t UtilizationSwitch(const SharedRegion& hami);

}  // namespace vgpu::region::hami
