// A container's libvgpu region (docs/region.md), read from its cache file for the metrics' throttling and refusal
// counters (docs/metrics.md): pure, bytes through a callback (hami_cache.h's ReadAt); ReadRegionCountersFile is the
// OS side, the same bounded, link-refusing reads as the HAMi reader's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "vgpu/monitor/hami_cache.h"

namespace vgpu::monitor {

// One device of the region: the container's monitoring counters there (the container's word: Device::held_ns and
// Device::refused_allocations, written by its processes).
struct RegionCounters {
  std::string uuid;                       // NVML's form of the device's UUID ("GPU-" and 32 hex digits)
  std::uint64_t held_ns = 0;              // launches' waits for the compute limiter, in all
  std::uint64_t refused_allocations = 0;  // allocations refused at the memory limit
};

// Reads the region of a file of `file_bytes` bytes through `read`: its header at region::kRegionOffset (our magic,
// this build's layout version and region size, a file long enough) and its device table (one read of 10 KiB). `out`:
// the devices in use, in the region's order. False with `error` set (one line: what was found, what is accepted).
bool ReadRegionCounters(std::uint64_t file_bytes, const ReadAt& read, std::vector<RegionCounters>& out,
                        std::string& error);

// The file at `path`, or the single *.cache of the folder at `path` (as ReadCacheFile finds it). `absent`: no such
// file yet; `invalid`: `error` says why.
CacheState ReadRegionCountersFile(const std::string& path, std::vector<RegionCounters>& out, std::string& error);

// Both of a container's file's parts from one open (the monitor reads every container's each period): the region's
// counters, and HAMi's part when `hami` is not null, each as the function above or ReadCacheFile reads it alone.
struct ContainerFileRead {
  CacheState counters = CacheState::absent;
  std::string counters_error;
  CacheState hami = CacheState::absent;  // (absent when not asked for)
  std::string hami_error;
};
ContainerFileRead ReadContainerFile(const std::string& path, HamiCache* hami, std::vector<RegionCounters>& counters);

}  // namespace vgpu::monitor
