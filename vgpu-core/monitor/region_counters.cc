// A container's libvgpu region read for its monitoring counters (docs/metrics.md): pure, bytes through a callback.
#include "vgpu/monitor/region_counters.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "vgpu/region/layout.h"
#include "vgpu/verdict/verdict.h"

namespace vgpu::monitor {
namespace {

using region::Device;
using region::Region;

// The header, up to the device table: magic, version, region_bytes and device_count are read from it.
constexpr std::size_t kHeadBytes = offsetof(Region, devices);
constexpr std::size_t kDeviceTableBytes = sizeof(Region::devices);

template <typename T>
T At(const unsigned char* bytes, std::size_t offset) {
  T value;
  std::memcpy(&value, bytes + offset, sizeof value);
  return value;
}

// The header's checks: our magic, this build's version and region size, the whole file there. False with `error`.
bool CheckHeader(std::uint64_t file_bytes, const unsigned char* head, std::string& error) {
  const std::string accepted = "; accepted: layout version " + std::to_string(region::kRegionVersion) + ", " +
                               std::to_string(sizeof(Region)) + " bytes of region, a file of at least " +
                               std::to_string(region::kFileBytes) + " bytes";
  if (At<std::uint64_t>(head, offsetof(Region, magic)) != region::kRegionMagic) {
    error = "no libvgpu region (\"VGPUREGN\") at byte " + std::to_string(region::kRegionOffset) +
            " (HAMi-core's own cache file, or an older libvgpu's)";
    return false;
  }
  const auto version = At<std::uint32_t>(head, offsetof(Region, version));
  const auto region_bytes = At<std::uint32_t>(head, offsetof(Region, region_bytes));
  if (version != region::kRegionVersion || region_bytes != sizeof(Region) || file_bytes < region::kFileBytes) {
    error = "a libvgpu region of layout version " + std::to_string(version) + ", " + std::to_string(region_bytes) +
            " bytes of region in a file of " + std::to_string(file_bytes) + " bytes" + accepted;
    return false;
  }
  return true;
}

}  // namespace

bool ReadRegionCounters(std::uint64_t file_bytes, const ReadAt& read, std::vector<RegionCounters>& out,
                        std::string& error) {
  unsigned char head[kHeadBytes];
  if (file_bytes < region::kRegionOffset + kHeadBytes || !read(region::kRegionOffset, kHeadBytes, head)) {
    error = "too short to hold a libvgpu region (" + std::to_string(file_bytes) + " bytes; one is " +
            std::to_string(region::kFileBytes) + ")";
    return false;
  }
  if (!CheckHeader(file_bytes, head, error)) return false;
  const auto devices = std::make_unique<Device[]>(region::kMaxDevices);
  if (!read(region::kRegionOffset + offsetof(Region, devices), kDeviceTableBytes, devices.get())) {
    error = "cannot read its device table at offset " + std::to_string(region::kRegionOffset + kHeadBytes);
    return false;
  }
  const std::uint32_t count = std::min(At<std::uint32_t>(head, offsetof(Region, device_count)), region::kMaxDevices);
  std::vector<RegionCounters> found;
  for (std::uint32_t d = 0; d < count; ++d) {
    const Device& device = devices[d];
    if (device.in_use == 0) continue;
    found.push_back({verdict::UuidText(device.uuid), device.held_ns, device.refused_allocations});
  }
  out = std::move(found);
  return true;
}

}  // namespace vgpu::monitor
