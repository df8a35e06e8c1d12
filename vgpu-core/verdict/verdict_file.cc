#include "vgpu/verdict/verdict_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "vgpu/verdict/verdict.h"

namespace vgpu::verdict {
namespace {

std::string Why(const std::string& what, const std::string& path, int error_number) {
  return what + " " + path + ": " + std::strerror(error_number);
}

}  // namespace

bool ReadWhole(const std::string& path, std::string& text, bool& missing, std::string& error) {
  missing = false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    missing = errno == ENOENT;
    error = Why("cannot open", path, errno);
    return false;
  }
  std::string data;
  char buffer[8192];
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      error = Why("cannot read", path, errno);
      ::close(fd);
      return false;
    }
    if (got == 0) break;
    if (data.size() + static_cast<std::size_t>(got) > kMaxBytes) {
      error = path + ": larger than a verdict (" + std::to_string(kMaxBytes) + " bytes)";
      ::close(fd);
      return false;
    }
    data.append(buffer, static_cast<std::size_t>(got));
  }
  ::close(fd);
  text = std::move(data);
  return true;
}

}  // namespace vgpu::verdict
