// The mirror of the region into HAMi-core's v1 part (hami_v1.h, docs/hami-cache.md).
#include "vgpu/region/hami_v1.h"
#include "vgpu/base/uuid.h"

#include <atomic>
#include <cstdio>

namespace vgpu::region::hami {
namespace {

template <typename T>
void Store(T& field, T value) {
  std::atomic_ref<T>(field).store(value, std::memory_order_release);
}

}  // namespace

void Initialize(SharedRegion& hami) {
  hami.major_version = kMajorVersion;
  hami.minor_version = kMinorVersion;
  hami.priority = 1;  // HAMi-core's default (CUDA_TASK_PRIORITY unset)
  Store(hami.initialized_flag, kMagic);
}

void MirrorDevice(SharedRegion& hami, std::uint32_t index, const std::uint8_t uuid[16], std::uint32_t count) {
  if (index >= kMaxDevices || count > kMaxDevices) return;
  char text[base::kGpuUuidChars + 1];
  base::FormatGpuUuid(uuid, text);
  char* row = hami.uuids[index];
  for (std::size_t i = 0; i < kUuidBytes; ++i) row[i] = i < sizeof text ? text[i] : '\0';
  Store(hami.device_num, static_cast<std::uint64_t>(count));
}

void MirrorLimit(SharedRegion& hami, std::uint32_t device, std::uint64_t bytes) {
  if (device < kMaxDevices) Store(hami.limit[device], bytes == UINT64_MAX ? 0 : bytes);
}

void MirrorLaunch(SharedRegion& hami, std::int64_t unix_s) {
  std::atomic_ref<std::int32_t> recent(hami.recent_kernel);
  std::int32_t seen = recent.load(std::memory_order_relaxed);
  while (seen != 2 && seen != -1 && !recent.compare_exchange_weak(seen, 2, std::memory_order_release)) {
  }
  Store(hami.last_kernel_time, unix_s);
}

void MirrorPriority(SharedRegion& hami, std::int32_t priority) { Store(hami.priority, priority); }

void MirrorSmLimit(SharedRegion& hami, std::uint32_t device, std::uint32_t percent) {
  if (device < kMaxDevices) Store(hami.sm_limit[device], static_cast<std::uint64_t>(percent));
}

void MirrorUtilization(SharedRegion& hami, std::uint32_t slot, std::uint32_t device, std::uint32_t percent) {
  if (slot < kMaxProcs && device < kMaxDevices) Store(hami.procs[slot].device_util[device].sm, std::uint64_t{percent});
}

std::int32_t RecentKernel(const SharedRegion& hami) {
  return std::atomic_ref<std::int32_t>(const_cast<std::int32_t&>(hami.recent_kernel)).load(std::memory_order_relaxed);
}

std::int32_t UtilizationSwitch(const SharedRegion& hami) {
  return std::atomic_ref<std::int32_t>(const_cast<std::int32_t&>(hami.utilization_switch))
      .load(std::memory_order_relaxed);
}

namespace {

template <typename T>
T Load(const T& field) {
  return std::atomic_ref<T>(const_cast<T&>(field)).load(std::memory_order_relaxed);
}

// `data`: what the slot holds on the device less its contexts and the driver's own memory (never below 0).
void StoreData(DeviceMemory& used, std::uint64_t total) {
  const std::uint64_t other = Load(used.context) + Load(used.module);
  Store(used.data, total > other ? total - other : 0);
}

}  // namespace

void MirrorUsed(SharedRegion& hami, std::uint32_t slot, std::uint32_t device, std::uint64_t bytes) {
  if (slot >= kMaxProcs || device >= kMaxDevices) return;
  DeviceMemory& used = hami.procs[slot].used[device];
  Store(used.total, bytes);
  StoreData(used, bytes);
}

void MirrorBreakdown(SharedRegion& hami, std::uint32_t slot, std::uint32_t device, std::uint64_t context,
                     std::uint64_t module) {
  if (slot >= kMaxProcs || device >= kMaxDevices) return;
  DeviceMemory& used = hami.procs[slot].used[device];
  Store(used.context, context);
  Store(used.module, module);
  StoreData(used, Load(used.total));
}

namespace {

// A slot's figures (memory, utilization) back to zero, for a new or a freed slot.
void ZeroFigures(SharedRegion& hami, std::uint32_t slot) {
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    MirrorBreakdown(hami, slot, d, 0, 0);
    MirrorUsed(hami, slot, d, 0);
    MirrorUtilization(hami, slot, d, 0);
  }
}

}  // namespace

void MirrorSlotLive(SharedRegion& hami, std::uint32_t slot, std::int32_t pid) {
  if (slot >= kMaxProcs) return;
  ProcSlot& proc = hami.procs[slot];
  Store(proc.status, 0);
  ZeroFigures(hami, slot);
  Store(proc.pid, pid);
  Store(proc.hostpid, 0);
  Store(proc.status, 1);
  std::atomic_ref<std::int32_t> count(hami.proc_num);
  if (count.load(std::memory_order_relaxed) < static_cast<std::int32_t>(slot) + 1) {
    count.store(static_cast<std::int32_t>(slot) + 1, std::memory_order_release);
  }
}

void MirrorSlotFree(SharedRegion& hami, std::uint32_t slot) {
  if (slot >= kMaxProcs) return;
  ProcSlot& proc = hami.procs[slot];
  Store(proc.status, 0);
  ZeroFigures(hami, slot);
  Store(proc.pid, 0);
}

}  // namespace vgpu::region::hami
