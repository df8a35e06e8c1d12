// A container's cache file read as HAMi's vGPU monitor reads it (HAMi-core's v1 layout, docs/metrics.md): what its
// hami_* series show per device. The layout reading is pure (bytes come through a callback); ReadCacheFile is the
// OS side (a file or a folder, opened without following links, bounded preads).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace vgpu::monitor {

// One device row of the file, summed over its live slots as HAMi's monitor sums them.
struct HamiDevice {
  std::uint32_t index = 0;         // the row i: HAMi's vdevice_index
  std::string uuid;                // the row's first 40 bytes, up to a NUL (the container's word: escape before use)
  std::uint64_t memory_bytes = 0;  // sum of used[i].total
  std::uint64_t context_bytes = 0;
  std::uint64_t module_bytes = 0;
  std::uint64_t data_bytes = 0;
  std::uint64_t limit_bytes = 0;      // limit[i]
  std::uint64_t sm_util_percent = 0;  // sum of deviceUtil[i].sm
};

struct HamiCache {
  std::vector<HamiDevice> devices;      // rows i < min(num, 16) whose UUID does not start with a NUL
  std::int64_t last_kernel_time_s = 0;  // unix seconds; <= 0: never
};

// Copies `length` bytes at `offset` of the file into `out`; false if they cannot all be read.
using ReadAt = std::function<bool(std::uint64_t offset, std::size_t length, void* out)>;

// Reads a v1 file of `file_bytes` bytes through `read`. False with `error` set (one line: what was found, what is
// accepted) for a bad magic, another major version, a short file or a failed read.
bool ReadHamiCache(std::uint64_t file_bytes, const ReadAt& read, HamiCache& out, std::string& error);

enum class CacheState { read, absent, invalid };

// The file at `path`, or the single *.cache of the folder at `path`. `absent`: no such file yet (nothing to report);
// `invalid`: `error` says why (not a regular file, two caches, bad contents).
CacheState ReadCacheFile(const std::string& path, HamiCache& out, std::string& error);

}  // namespace vgpu::monitor
