// Clock readings as one integer of nanoseconds: the tree's one helper. Allocation-free (the shim and fakecuda run
// inside other processes).
#pragma once

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace vgpu::base {

inline std::uint64_t ClockNs(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}
inline std::uint64_t MonotonicNs() { return ClockNs(CLOCK_MONOTONIC); }
inline std::uint64_t RealtimeNs() { return ClockNs(CLOCK_REALTIME); }

// How far this process's CLOCK_MONOTONIC is from the host's: a time namespace's offset (/proc/self/timens_offsets,
// Linux 5.6+; a container runtime may put a container in one), fixed before the namespace's first process started and
// read once. 0 where there is no such namespace or its offsets cannot be read.
inline std::int64_t MonotonicOffsetNs() {
  static const std::int64_t offset = [] {
    const int fd = open("/proc/self/timens_offsets", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0LL;
    char text[256] = {};
    const ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    const char* line = n > 0 ? std::strstr(text, "monotonic") : nullptr;
    long long seconds = 0, nanoseconds = 0;
    if (line == nullptr || std::sscanf(line, "monotonic %lld %lld", &seconds, &nanoseconds) != 2) return 0LL;
    return seconds * 1'000'000'000LL + nanoseconds;
  }();
  return offset;
}

// The host's CLOCK_MONOTONIC: one clock for every container of the host (shared files' times, the node monitor's).
inline std::uint64_t HostMonotonicNs() {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(MonotonicNs()) - MonotonicOffsetNs());
}

}  // namespace vgpu::base
