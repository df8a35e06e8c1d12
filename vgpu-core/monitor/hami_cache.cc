// HAMi-core's v1 cache file read as HAMi's vGPU monitor reads it (docs/metrics.md): pure, bytes through a callback.
#include "vgpu/monitor/hami_cache.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "vgpu/region/hami_v1.h"

namespace vgpu::monitor {
namespace {

namespace hami = vgpu::region::hami;
using hami::SharedRegion;

// The header up to the slots, and the fields after them: the parts besides the slots that the monitor reads.
constexpr std::size_t kHeadBytes = offsetof(SharedRegion, procs);
constexpr std::size_t kTailOffset = offsetof(SharedRegion, proc_num);
constexpr std::size_t kTailBytes = offsetof(SharedRegion, sem_postinit) - kTailOffset;
constexpr std::uint64_t kV1Bytes = sizeof(SharedRegion);
constexpr std::size_t kSlotsPerRead = 32;  // 61 KiB a read

template <typename T>
T At(const unsigned char* bytes, std::size_t offset) {
  T value;
  std::memcpy(&value, bytes + offset, sizeof value);
  return value;
}

std::uint64_t SaturatingAdd(std::uint64_t a, std::uint64_t b) {
  return a > std::numeric_limits<std::uint64_t>::max() - b ? std::numeric_limits<std::uint64_t>::max() : a + b;
}

// Adds a live slot's figures on each of `devices` (indexed by row).
void AddSlot(const hami::ProcSlot& slot, std::vector<HamiDevice>& devices) {
  for (HamiDevice& device : devices) {
    const hami::DeviceMemory& used = slot.used[device.index];
    device.memory_bytes = SaturatingAdd(device.memory_bytes, used.total);
    device.context_bytes = SaturatingAdd(device.context_bytes, used.context);
    device.module_bytes = SaturatingAdd(device.module_bytes, used.module);
    device.data_bytes = SaturatingAdd(device.data_bytes, used.data);
    device.sm_util_percent = SaturatingAdd(device.sm_util_percent, slot.device_util[device.index].sm);
  }
}

// The header's checks: HAMi's magic, then major version 1 and v1's size. False with `error` set.
bool CheckHeader(std::uint64_t file_bytes, const ReadAt& read, unsigned char* head, std::string& error) {
  if (file_bytes < sizeof(std::int32_t) || !read(0, sizeof(std::int32_t), head)) {
    error = "too short to hold HAMi's magic (" + std::to_string(file_bytes) + " bytes)";
    return false;
  }
  const std::int32_t magic = At<std::int32_t>(head, offsetof(SharedRegion, initialized_flag));
  if (magic != hami::kMagic) {
    error = "magic " + std::to_string(magic) + " is not HAMi's " + std::to_string(hami::kMagic);
    return false;
  }
  const bool head_read = file_bytes >= kHeadBytes && read(0, kHeadBytes, head);
  const std::uint32_t major = head_read ? At<std::uint32_t>(head, offsetof(SharedRegion, major_version)) : 0;
  if (!head_read || major != hami::kMajorVersion || file_bytes < kV1Bytes) {
    error = "not HAMi-core's v1 layout (" + std::to_string(file_bytes) + " bytes, major version " +
            std::to_string(major) + "; accepted: major version 1 and at least " + std::to_string(kV1Bytes) + " bytes)";
    return false;
  }
  return true;
}

}  // namespace

bool ReadHamiCache(std::uint64_t file_bytes, const ReadAt& read, HamiCache& out, std::string& error) {
  std::vector<unsigned char> head(kHeadBytes);
  unsigned char tail[kTailBytes];
  if (!CheckHeader(file_bytes, read, head.data(), error)) return false;
  if (!read(kTailOffset, kTailBytes, tail)) {
    error = "cannot read its fields at offset " + std::to_string(kTailOffset);
    return false;
  }
  HamiCache cache;
  cache.last_kernel_time_s = At<std::int64_t>(tail, offsetof(SharedRegion, last_kernel_time) - kTailOffset);
  const std::uint64_t rows =
      std::min<std::uint64_t>(At<std::uint64_t>(head.data(), offsetof(SharedRegion, device_num)), hami::kMaxDevices);
  for (std::uint32_t i = 0; i < rows; ++i) {
    const char* uuid =
        reinterpret_cast<const char*>(head.data()) + offsetof(SharedRegion, uuids) + hami::kUuidBytes * i;
    if (uuid[0] == '\0') continue;  // HAMi: "UUID not yet initialised", skipped
    HamiDevice device;
    device.index = i;
    device.uuid.assign(uuid, strnlen(uuid, 40));
    device.limit_bytes = At<std::uint64_t>(head.data(), offsetof(SharedRegion, limit) + sizeof(std::uint64_t) * i);
    cache.devices.push_back(std::move(device));
  }
  const std::int32_t proc_num = At<std::int32_t>(tail, 0);
  const std::size_t slots =
      proc_num < 0 ? 0 : std::min<std::size_t>(static_cast<std::size_t>(proc_num), hami::kMaxProcs);
  std::vector<hami::ProcSlot> chunk(std::min(slots, kSlotsPerRead));
  for (std::size_t first = 0; first < slots; first += chunk.size()) {
    const std::size_t count = std::min(chunk.size(), slots - first);
    if (!read(kHeadBytes + first * sizeof(hami::ProcSlot), count * sizeof(hami::ProcSlot), chunk.data())) {
      error = "cannot read its process slots " + std::to_string(first) + ".." + std::to_string(first + count - 1);
      return false;
    }
    for (std::size_t s = 0; s < count; ++s) {
      if (chunk[s].status != 0) AddSlot(chunk[s], cache.devices);
    }
  }
  out = std::move(cache);
  return true;
}

}  // namespace vgpu::monitor
