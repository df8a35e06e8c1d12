// Replacing an unused file of another layout at the region's path (replace.h, docs/hami-cache.md "Bad input").
#include "replace.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "vgpu/region/hami_v1.h"
#include "vgpu/region/layout.h"

namespace vgpu::region {
namespace {

// What a refused file is, from its first bytes and its region's. Only a file recognisably a cache file (or an empty
// one) may be replaced: a path that names someone's data by mistake must never lose it.
struct Kind {
  enum What { hami_core, older_region, newer_region, damaged_region, empty, foreign } what = foreign;
  std::uint32_t version = 0;
  off_t old_liveness = -1;  // an older layout's first liveness byte (region_bytes + slot up to version 4), or -1
};

template <typename T>
T ReadAt(int fd, off_t offset) {
  T value{};
  if (pread(fd, &value, sizeof value, offset) != static_cast<ssize_t>(sizeof value)) return T{};
  return value;
}

Kind Classify(int fd, off_t size) {
  Kind kind;
  if (size == 0) {
    kind.what = Kind::empty;
    return kind;
  }
  if (ReadAt<std::uint64_t>(fd, 0) == kRegionMagic) {  // up to version 4: our region at offset 0
    kind.what = Kind::older_region;
    kind.version = ReadAt<std::uint32_t>(fd, offsetof(Region, version));
    const auto region_bytes = ReadAt<std::uint32_t>(fd, offsetof(Region, region_bytes));
    if (region_bytes > 0 && region_bytes < (1u << 30)) kind.old_liveness = region_bytes;
    return kind;
  }
  const bool hami = ReadAt<std::int32_t>(fd, offsetof(hami::SharedRegion, initialized_flag)) == hami::kMagic &&
                    ReadAt<std::uint32_t>(fd, offsetof(hami::SharedRegion, major_version)) == hami::kMajorVersion;
  if (!hami) return kind;  // foreign (HAMi-core's v0 layout too: its slots are elsewhere)
  const off_t region = static_cast<off_t>(kRegionOffset);
  if (ReadAt<std::uint64_t>(fd, region) != kRegionMagic) {
    // HAMi-core's own, or ours cut short before its region: the latter is no older than HAMi's part in it, and has
    // its liveness bytes where ours are (locked below either way).
    kind.what = size < static_cast<off_t>(sizeof(hami::SharedRegion)) ? Kind::damaged_region : Kind::hami_core;
    return kind;
  }
  kind.version = ReadAt<std::uint32_t>(fd, region + static_cast<off_t>(offsetof(Region, version)));
  kind.what = kind.version > kRegionVersion   ? Kind::newer_region
              : kind.version < kRegionVersion ? Kind::older_region     // from version 5: liveness at kLivenessBase
                                              : Kind::damaged_region;  // this version, short or of another size
  return kind;
}

// Write locks on [start, start + count) on fd's own description: false (nothing taken) if anyone holds one of them.
bool LockRange(int fd, off_t start, off_t count, short type) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = start;
  lock.l_len = count;
  return fcntl(fd, F_OFD_SETLK, &lock) == 0;
}

// The first process named by a counted slot of HAMi-core's part that still lives (this one aside: a slot naming our
// pid is a dead process's whose pid we got), or 0. Pids are the container's, as ours.
pid_t LiveHamiProcess(int fd) {
  const auto slots = std::clamp<std::int32_t>(ReadAt<std::int32_t>(fd, offsetof(hami::SharedRegion, proc_num)), 0,
                                              static_cast<std::int32_t>(hami::kMaxProcs));
  for (std::int32_t s = 0; s < slots; ++s) {
    const off_t slot = static_cast<off_t>(offsetof(hami::SharedRegion, procs) + s * sizeof(hami::ProcSlot));
    if (ReadAt<std::int32_t>(fd, slot + static_cast<off_t>(offsetof(hami::ProcSlot, status))) == 0) continue;
    const auto pid =
        static_cast<pid_t>(ReadAt<std::int32_t>(fd, slot + static_cast<off_t>(offsetof(hami::ProcSlot, pid))));
    if (pid <= 0 || pid == getpid()) continue;
    if (kill(pid, 0) == 0 || errno == EPERM) return pid;
  }
  return 0;
}

std::string Described(const Kind& kind, off_t size) {
  const std::string bytes = " (" + std::to_string(size) + " bytes)";
  switch (kind.what) {
    case Kind::hami_core:
      return "a HAMi-core cache file" + bytes;
    case Kind::older_region:
      return "a vgpu region of layout version " + std::to_string(kind.version) + bytes;
    case Kind::newer_region:
      return "a vgpu region of layout version " + std::to_string(kind.version) + bytes;
    case Kind::damaged_region:
      return "a vgpu region cut short or of another size" + bytes;
    case Kind::empty:
      return "an empty file";
    case Kind::foreign:
      break;
  }
  return "a file that is no cache file" + bytes;
}

// Whether `path` is still the plain regular file behind `fd` (not a link to it, not replaced meanwhile).
bool SameFileAtPath(const std::string& path, const struct stat& st) {
  struct stat at_path {};
  return lstat(path.c_str(), &at_path) == 0 && S_ISREG(at_path.st_mode) && at_path.st_dev == st.st_dev &&
         at_path.st_ino == st.st_ino;
}

// With the old file's liveness locks held: whether it is unused, and if so the replacement.
Replaced ReplaceLocked(const std::string& path, int fd, const struct stat& st, const Kind& kind, std::size_t bytes,
                       InitializeShared initialize, std::string& note, std::string& why_not) {
  if (kind.what == Kind::hami_core) {
    if (const pid_t pid = LiveHamiProcess(fd); pid != 0) {
      why_not = "not replaced: process " + std::to_string(pid) + " named in it lives";
      return Replaced::in_use;
    }
  }
  if (!SameFileAtPath(path, st)) return Replaced::yes;  // another process replaced it first
  std::string error;
  if (!ReplaceShared(path, bytes, initialize, nullptr, "region file", error)) {
    why_not = "not replaced: " + error;
    return Replaced::never;
  }
  note = "region file '" + path + "': replaced " + Described(kind, st.st_size) + " that no process used";
  return Replaced::yes;
}

}  // namespace

Replaced ReplaceIfUnused(const std::string& path, int fd, std::size_t bytes, InitializeShared initialize,
                         std::string& note, std::string& why_not) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !SameFileAtPath(path, st)) {
    why_not = "never replaced: the path is not a regular file of its own (a link, a folder, a pipe)";
    return Replaced::never;
  }
  const Kind kind = Classify(fd, st.st_size);
  if (kind.what == Kind::newer_region) {
    why_not = "never replaced: a newer libvgpu may be using it";
    return Replaced::never;
  }
  if (kind.what == Kind::foreign) {
    why_not = "never replaced: it is no cache file, and may be someone's data";
    return Replaced::never;
  }
  const auto slots = static_cast<off_t>(kMaxSlots);
  const off_t base = static_cast<off_t>(kLivenessBase);
  if (!LockRange(fd, base, slots, F_WRLCK)) {
    why_not = "not replaced: a process holds one of its liveness locks (it is in use)";
    return Replaced::in_use;
  }
  Replaced result = Replaced::in_use;
  if (kind.old_liveness >= 0 && !LockRange(fd, kind.old_liveness, slots, F_WRLCK)) {
    why_not = "not replaced: a process of that version holds one of its liveness locks (it is in use)";
  } else {
    result = ReplaceLocked(path, fd, st, kind, bytes, initialize, note, why_not);
    if (kind.old_liveness >= 0) LockRange(fd, kind.old_liveness, slots, F_UNLCK);
  }
  LockRange(fd, base, slots, F_UNLCK);
  return result;
}

}  // namespace vgpu::region
