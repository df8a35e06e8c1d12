// A scenario's limits, one set for every reader of one: the scenario file's loader (scenario.h), the rules of a
// Scenario struct however it was built (check.h, which the runner applies), and the simulator's check of its own
// input (sim/core). What one accepts the others accept too; their messages quote these figures.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace vgpu::scenario::limits {

inline constexpr std::uint64_t kMinDurationNs = 100'000'000;        // a scenario file's shortest run: 100 ms
inline constexpr std::uint64_t kMaxDurationNs = 3'600'000'000'000;  // an hour: a run, a phase, a window
inline constexpr std::uint64_t kMaxKernelNs = 3'600'000'000'000;    // an hour: far above any kernel, far from overflow
inline constexpr std::size_t kMaxTenants = 16;
inline constexpr std::uint64_t kMaxReplicas = 64;  // identical processes of one entry
// The fake machine's 256 process slots (fakecuda/model/layout.h), less the one the live runner's sampler takes.
inline constexpr std::uint64_t kMaxProcessesInAll = 255;
inline constexpr std::size_t kMaxMixedSizes = 1024;  // kernel sizes of one mixed workload
inline constexpr std::size_t kMaxNameChars = 64;
inline constexpr std::size_t kMaxProcessEntries = 16;  // `processes:` entries of one tenant (replicas aside)
inline constexpr std::size_t kMaxPhases = 64;          // phases of one process's `work:`
inline constexpr std::uint64_t kMaxRealDevices = 16;   // device indices with gpu: real
inline constexpr std::uint64_t kMaxFakeDevices = 8;    // devices of a fake `gpu:` spec (fakecuda's kMaxDevices)
inline constexpr std::uint64_t kMaxDepth = 128;        // launched and not complete (fakecuda's kStreamDepth)
inline constexpr std::uint64_t kMaxBlocks = 65535;
inline constexpr std::uint64_t kMaxJitterPermille = 500;  // +/- 50 %
inline constexpr double kMinRate = 0.001;                 // launches per second (0: a closed loop)
inline constexpr double kMaxRate = 1e6;
inline constexpr std::uint64_t kMinTimesliceNs = 1'000;          // 1 us
inline constexpr std::uint64_t kMaxTimesliceNs = 1'000'000'000;  // 1 s
inline constexpr std::uint64_t kMaxSwitchNs = 100'000'000;       // 100 ms
inline constexpr std::size_t kMaxProgramWords = 64;              // a `program:` list: the program and its arguments
inline constexpr std::size_t kMaxProgramWordBytes = 4096;        // one of them

inline bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
}

// A tenant's name: 1 .. kMaxNameChars letters, digits, '-', '_' and '.', not "." or ".." (a live run makes a folder
// of each tenant's name).
inline bool IsPlainName(std::string_view name) {
  return !name.empty() && name.size() <= kMaxNameChars && name != "." && name != ".." &&
         std::all_of(name.begin(), name.end(), IsNameChar);
}

}  // namespace vgpu::scenario::limits
