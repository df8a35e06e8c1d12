// The OS side of the configuration: which source wins (system file, VGPU_CONFIG_FILE, environment) and reading it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "vgpu/policy/config.h"

extern "C" char** environ;  // not declared by <unistd.h> in strict C++ modes

#ifndef VGPU_SYSTEM_CONFIG
#define VGPU_SYSTEM_CONFIG "/etc/vgpu/vgpu.conf"
#endif

namespace vgpu::policy {
namespace {

constexpr const char* kConfigFileVariable = "VGPU_CONFIG_FILE";

enum class FileRead { missing, read, failed };

// Thread-safe, unlike strerror: the shim may load while the application's threads are running.
std::string Describe(int error_number) { return std::generic_category().message(error_number); }

std::string FileError(const char* path, const std::string& what) {
  return "vgpu: config file " + Printable(path) + " " + what +
         "; fix or remove it (while it exists the environment is not used)";
}

// Reads a whole config file. `missing` only when nothing at all is at `path`: a dangling symlink, a directory or
// an unreadable file means someone meant to configure us, so those are failures (fail closed).
FileRead ReadWholeFile(const char* path, std::string& text, std::string& error) {
  // O_NONBLOCK: a FIFO planted at the path must not hang every process of the container in open().
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    const int open_error = errno;
    struct stat link_status {};
    if ((open_error == ENOENT || open_error == ENOTDIR) && ::lstat(path, &link_status) != 0) {
      return FileRead::missing;
    }
    error = FileError(path, "exists but cannot be opened (" + Describe(open_error) + ")");
    return FileRead::failed;
  }
  struct stat status {};
  if (::fstat(fd, &status) != 0 || !S_ISREG(status.st_mode)) {
    ::close(fd);
    error = FileError(path, "is not a regular file");
    return FileRead::failed;
  }
  std::string content;
  // One byte more than allowed so that an over-long file is noticed even if it grew after fstat.
  content.resize(kMaxConfigFileBytes + 1);
  std::size_t length = 0;
  while (length < content.size()) {
    const ssize_t got = ::read(fd, content.data() + length, content.size() - length);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int read_error = errno;
      ::close(fd);
      error = FileError(path, "cannot be read (" + Describe(read_error) + ")");
      return FileRead::failed;
    }
    if (got == 0) break;
    length += static_cast<std::size_t>(got);
  }
  ::close(fd);
  if (length > kMaxConfigFileBytes) {
    error = FileError(path, "is larger than " + std::to_string(kMaxConfigFileBytes) + " bytes");
    return FileRead::failed;
  }
  content.resize(length);
  text = std::move(content);
  return FileRead::read;
}

// A parsed file becomes a Lookup over its entries, so that files and the environment share one parser.
bool ParseFileText(const std::string& text, const char* path, Config& config, std::string& error) {
  std::vector<std::pair<std::string, std::string>> entries;
  if (!ParseConfigFile(
          text, path, [&](std::string_view key, std::string_view value) { entries.emplace_back(key, value); }, error)) {
    return false;
  }
  const Lookup lookup = [&entries](std::string_view key) -> std::optional<std::string> {
    for (const auto& [entry_key, value] : entries) {
      if (entry_key == key) return value;
    }
    return std::nullopt;
  };
  return ParseConfig(lookup, path, config, error);
}

}  // namespace

bool LoadConfig(Config& out, std::string& error, const char* system_path) {
  const char* system_file = system_path != nullptr ? system_path : VGPU_SYSTEM_CONFIG;
  Config config;

  std::string text;
  switch (ReadWholeFile(system_file, text, error)) {
    case FileRead::failed:
      return false;
    case FileRead::read:
      if (!ParseFileText(text, system_file, config, error)) return false;
      break;
    case FileRead::missing: {
      const char* named_file = std::getenv(kConfigFileVariable);
      if (named_file != nullptr) {
        // An explicit request for a file that is not there must not quietly become "use the environment".
        if (named_file[0] != '/') {
          error = "vgpu: VGPU_CONFIG_FILE='" + Printable(named_file) +
                  "' from environment is not an absolute path; e.g. VGPU_CONFIG_FILE=/etc/vgpu/test.conf";
          return false;
        }
        std::string named_text;
        const FileRead named = ReadWholeFile(named_file, named_text, error);
        if (named == FileRead::missing) {
          error = "vgpu: VGPU_CONFIG_FILE='" + Printable(named_file) +
                  "' from environment is not an existing file; e.g. VGPU_CONFIG_FILE=/etc/vgpu/test.conf";
          return false;
        }
        if (named == FileRead::failed || !ParseFileText(named_text, named_file, config, error)) return false;
        break;
      }
      const Lookup from_environment = [](std::string_view key) -> std::optional<std::string> {
        const std::string name(key);
        const char* value = std::getenv(name.c_str());
        if (value == nullptr) return std::nullopt;
        return std::string(value);
      };
      // A misspelt device key is an error only where the variables are read: not under CUDA_DISABLE_CONTROL=true.
      Config parsed;
      std::string parse_error;
      const bool parsed_ok = ParseConfig(from_environment, "environment", parsed, parse_error);
      if (!(parsed_ok && parsed.control_disabled) && !CheckDeviceKeys(environ, "environment", error)) return false;
      if (!parsed_ok) {
        error = std::move(parse_error);
        return false;
      }
      config = std::move(parsed);
      break;
    }
  }

  if (config.region_path.empty()) config.region_path = DefaultRegionPath(static_cast<std::uint32_t>(::getuid()));
  out = std::move(config);
  return true;
}

const char* SystemConfigPath() { return VGPU_SYSTEM_CONFIG; }

}  // namespace vgpu::policy
