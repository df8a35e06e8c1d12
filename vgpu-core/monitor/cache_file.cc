// The OS side of reading a container's cache file (docs/metrics.md, "Finding the file"), as HAMi's monitor reads it
// and for our region's counters: a file or a folder's single *.cache, opened without following links or blocking,
// checked to be a regular file, read with bounded preads.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "vgpu/monitor/hami_cache.h"
#include "vgpu/monitor/region_counters.h"

namespace vgpu::monitor {
namespace {

constexpr std::size_t kMaxFolderEntries = 1024;

// The names of the *.cache entries of the open folder `dir_fd` (at most kMaxFolderEntries entries looked at).
std::vector<std::string> CacheNames(int dir_fd) {
  std::vector<std::string> names;
  const int listing_fd = ::dup(dir_fd);
  DIR* dir = listing_fd < 0 ? nullptr : ::fdopendir(listing_fd);
  if (dir == nullptr) {
    if (listing_fd >= 0) ::close(listing_fd);
    return names;
  }
  std::size_t seen = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (++seen > kMaxFolderEntries) break;
    const std::string name = entry->d_name;
    if (name.size() > 6 && name.compare(name.size() - 6, 6, ".cache") == 0) names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

// Opens the cache file at `path` (or the folder's single *.cache, named in `found`): a descriptor, or -1 with `state`
// and `error` set.
int OpenCache(const std::string& path, std::string& found, CacheState& state, std::string& error) {
  constexpr int kFlags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  const int fd = ::open(path.c_str(), kFlags);
  if (fd < 0) {
    state = errno == ENOENT ? CacheState::absent : CacheState::invalid;
    error = "cannot open: " + std::string(std::strerror(errno));
    return -1;
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISDIR(info.st_mode)) return fd;
  const std::vector<std::string> names = CacheNames(fd);
  int file_fd = -1;
  if (names.empty()) {
    state = CacheState::absent;
  } else if (names.size() > 1) {
    state = CacheState::invalid;
    error = "the folder holds " + std::to_string(names.size()) + " *.cache files (" + names[0] + ", " + names[1] +
            (names.size() > 2 ? ", ..." : "") + "); accepted: one";
  } else {
    found = names[0];
    file_fd = ::openat(fd, names[0].c_str(), kFlags);
    if (file_fd < 0) {
      state = errno == ENOENT ? CacheState::absent : CacheState::invalid;
      error = "cannot open " + names[0] + ": " + std::strerror(errno);
    }
  }
  ::close(fd);
  return file_fd;
}

using Parse = std::function<bool(std::uint64_t file_bytes, const ReadAt& read, std::string& error)>;

// One part of a cache file for ReadParts: its parser, and what came of it.
struct Part {
  Parse parse;
  CacheState state = CacheState::absent;
  std::string error;
};

// Bounded preads of the open file `fd`.
ReadAt PreadOf(int fd) {
  return [fd](std::uint64_t offset, std::size_t length, void* into) {
    std::size_t done = 0;
    while (done < length) {
      const ssize_t got =
          ::pread(fd, static_cast<char*>(into) + done, length - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      done += static_cast<std::size_t>(got);
    }
    return true;
  };
}

// Opens the file at `path` once (as OpenCache), checks that it is a regular file, and hands each part's parser its
// size and bounded preads; each part's state and error are set (an error names the folder's file when one was looked
// up; a file that cannot be opened or is not a regular file gives every part the same).
void ReadParts(const std::string& path, std::vector<Part>& parts) {
  const auto all = [&](CacheState state, const std::string& error) {
    for (Part& part : parts) part.state = state, part.error = error;
  };
  CacheState state = CacheState::invalid;
  std::string found, error;
  const int fd = OpenCache(path, found, state, error);
  if (fd < 0) return all(state, error);
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    return all(CacheState::invalid, (found.empty() ? std::string() : found + ": ") + "not a regular file");
  }
  const ReadAt read = PreadOf(fd);
  for (Part& part : parts) {
    const bool valid = part.parse(static_cast<std::uint64_t>(info.st_size), read, part.error);
    part.state = valid ? CacheState::read : CacheState::invalid;
    if (!valid && !found.empty()) part.error = found + ": " + part.error;
  }
  ::close(fd);
}

CacheState ReadWith(const std::string& path, Parse parse, std::string& error) {
  std::vector<Part> parts(1);
  parts[0].parse = std::move(parse);
  ReadParts(path, parts);
  error = parts[0].error;
  return parts[0].state;
}

}  // namespace

CacheState ReadCacheFile(const std::string& path, HamiCache& out, std::string& error) {
  return ReadWith(
      path,
      [&](std::uint64_t file_bytes, const ReadAt& read, std::string& why) {
        return ReadHamiCache(file_bytes, read, out, why);
      },
      error);
}

CacheState ReadRegionCountersFile(const std::string& path, std::vector<RegionCounters>& out, std::string& error) {
  return ReadWith(
      path,
      [&](std::uint64_t file_bytes, const ReadAt& read, std::string& why) {
        return ReadRegionCounters(file_bytes, read, out, why);
      },
      error);
}

ContainerFileRead ReadContainerFile(const std::string& path, HamiCache* hami, std::vector<RegionCounters>& counters) {
  std::vector<Part> parts(hami != nullptr ? 2 : 1);
  parts[0].parse = [&](std::uint64_t file_bytes, const ReadAt& read, std::string& why) {
    return ReadRegionCounters(file_bytes, read, counters, why);
  };
  if (hami != nullptr) {
    parts[1].parse = [hami](std::uint64_t file_bytes, const ReadAt& read, std::string& why) {
      return ReadHamiCache(file_bytes, read, *hami, why);
    };
  }
  ReadParts(path, parts);
  ContainerFileRead result;
  result.counters = parts[0].state;
  result.counters_error = parts[0].error;
  if (hami != nullptr) {
    result.hami = parts[1].state;
    result.hami_error = parts[1].error;
  }
  return result;
}

}  // namespace vgpu::monitor
