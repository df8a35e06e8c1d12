// Creating shared files complete or not at all (shared_file.h).
#include "vgpu/base/clock.h"
#include "vgpu/region/shared_file.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace vgpu::region {
namespace {

std::string Named(std::string_view what, const std::string& path) { return std::string(what) + " '" + path + "'"; }

using base::MonotonicNs;

// Sizes, maps and fills the new file behind `fd` (not yet visible under its final name).
bool Fill(int fd, std::size_t bytes, InitializeShared initialize, const void* context, const std::string& named,
          std::string& error) {
  if (const int r = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); r != 0) {
    error = "cannot size " + named + " to " + std::to_string(bytes) + " bytes: " + std::strerror(r);
    return false;
  }
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) {
    error = "cannot map " + named + ": " + std::strerror(errno);
    return false;
  }
  std::string why;
  const bool filled = initialize(mapped, context, why);
  munmap(mapped, bytes);
  if (!filled) error = "cannot initialise " + named + ": " + why;
  return filled;
}

}  // namespace

int InitRobustMutex(void* storage) {
  pthread_mutexattr_t attributes;
  pthread_mutexattr_init(&attributes);
  pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST);
  const int r = pthread_mutex_init(static_cast<pthread_mutex_t*>(storage), &attributes);
  pthread_mutexattr_destroy(&attributes);
  return r;
}

namespace {

// A name beside `path` for a file being made: pid, clock and a counter, unique across pid namespaces.
std::string TemporaryBeside(const std::string& path) {
  static std::atomic<unsigned> temporaries{0};
  return path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(MonotonicNs()) + "." +
         std::to_string(temporaries++);
}

// Creates the temporary file `temporary`, mode 0666 whatever the umask (every process attaches, whatever its user),
// sized and filled. Returns its fd; -2 when the name is taken already (by a file of another process); or -1 with
// `error` (the file removed again).
int MakeFilled(const std::string& temporary, std::size_t bytes, InitializeShared initialize, const void* context,
               const std::string& named, std::string& error) {
  const int fd = open(temporary.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0666);
  if (fd < 0) {
    if (errno == EEXIST) return -2;
    error = "cannot create " + named + " (as '" + temporary + "'): " + std::strerror(errno);
    return -1;
  }
  fchmod(fd, 0666);
  if (!Fill(fd, bytes, initialize, context, named, error)) {
    close(fd);
    unlink(temporary.c_str());
    return -1;
  }
  return fd;
}

}  // namespace

bool ReplaceShared(const std::string& path, std::size_t bytes, InitializeShared initialize, const void* context,
                   std::string_view what, std::string& error) {
  const std::string named = Named(what, path);
  const std::string temporary = TemporaryBeside(path);
  const int fd = MakeFilled(temporary, bytes, initialize, context, named, error);
  if (fd == -2) error = "cannot replace " + named + ": its temporary name '" + temporary + "' is taken";
  if (fd < 0) return false;
  close(fd);
  if (rename(temporary.c_str(), path.c_str()) != 0) {
    error = "cannot replace " + named + " (rename from '" + temporary + "'): " + std::strerror(errno);
    unlink(temporary.c_str());
    return false;
  }
  return true;
}

int CreateOrOpenShared(const std::string& path, std::size_t bytes, InitializeShared initialize, const void* context,
                       std::string_view what, std::string_view variable, std::string& error) {
  const std::string named = Named(what, path);
  const std::string elsewhere = "; set " + std::string(variable) + " to a file in a writable folder";
  for (int attempt = 0; attempt < 16; ++attempt) {
    int fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY);
    if (fd >= 0) return fd;
    if (errno != ENOENT) {
      error = "cannot open " + named + ": " + std::strerror(errno) + "; check its permissions, or set " +
              std::string(variable) + " to another path";
      return -1;
    }
    const std::string temporary = TemporaryBeside(path);
    fd = MakeFilled(temporary, bytes, initialize, context, named, error);
    if (fd == -2) continue;
    if (fd < 0) {
      error += elsewhere;
      return -1;
    }
    const int linked = link(temporary.c_str(), path.c_str());
    const int link_errno = errno;
    unlink(temporary.c_str());
    if (linked == 0) return fd;
    close(fd);
    if (link_errno != EEXIST) {
      error = "cannot publish " + named + " (link from '" + temporary + "'): " + std::strerror(link_errno) +
              "; the folder's file system must support hard links";
      return -1;
    }
    // Another process won the race: loop and open its file.
  }
  error = named + " keeps appearing and disappearing while being opened; is something deleting it?";
  return -1;
}

}  // namespace vgpu::region
