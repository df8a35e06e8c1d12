#include "programs.h"

#include <unistd.h>

#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace vgpu::runner::internal {

std::string ProgramFolder(const std::string& scenario_file) {
  if (scenario_file.empty()) return {};
  const std::filesystem::path folder = std::filesystem::path(scenario_file).parent_path();
  return folder.empty() ? std::string(".") : folder.string();
}

std::string FindProgram(const std::string& word, const char* path, const std::string& folder, std::string& error) {
  if (word.find('/') != std::string::npos) {
    const std::string file = word.front() == '/' || folder.empty() ? word : folder + "/" + word;
    std::error_code ignored;
    if (access(file.c_str(), X_OK) == 0 && !std::filesystem::is_directory(file, ignored)) return file;
    error = "'" + word + "' (" + file + ") is not an executable file";
    return {};
  }
  const std::string_view list = path != nullptr ? path : "";
  for (std::size_t start = 0; start <= list.size();) {
    std::size_t end = list.find(':', start);
    if (end == std::string_view::npos) end = list.size();
    const std::string_view dir = list.substr(start, end - start);
    start = end + 1;
    if (dir.empty()) continue;  // an empty entry (the current folder) is not searched: too easy to pick by accident
    const std::string file = std::string(dir) + "/" + word;
    std::error_code ignored;
    if (access(file.c_str(), X_OK) == 0 && !std::filesystem::is_directory(file, ignored)) return file;
  }
  error = "'" + word + "' is not found on PATH (" + std::string(list.empty() ? "empty" : list) +
          "); give its path (with a '/'), relative to the scenario file's folder or absolute";
  return {};
}

namespace {

bool TakeNumber(std::string_view& text, std::uint64_t& value) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc()) return false;
  text.remove_prefix(static_cast<std::size_t>(end - text.data()));
  return true;
}

bool TakeChar(std::string_view& text, char c) {
  if (text.empty() || text.front() != c) return false;
  text.remove_prefix(1);
  return true;
}

}  // namespace

bool ParseProcessBusy(std::string_view line, std::vector<ProcessBusy>& entries) {
  entries.clear();
  constexpr std::string_view kKey = "\"processes\":[";
  const std::size_t at = line.find(kKey);
  if (at == std::string_view::npos) return false;
  std::string_view rest = line.substr(at + kKey.size());
  if (TakeChar(rest, ']')) return true;
  for (;;) {
    std::uint64_t device = 0, pid = 0, busy = 0;
    if (!TakeChar(rest, '[') || !TakeNumber(rest, device) || !TakeChar(rest, ',') || !TakeNumber(rest, pid) ||
        !TakeChar(rest, ',') || !TakeNumber(rest, busy) || !TakeChar(rest, ']') || device > UINT32_MAX ||
        pid > UINT32_MAX) {
      entries.clear();
      return false;
    }
    entries.push_back({static_cast<std::uint32_t>(device), static_cast<std::uint32_t>(pid), busy});
    if (TakeChar(rest, ']')) return true;
    if (!TakeChar(rest, ',')) {
      entries.clear();
      return false;
    }
  }
}

pid_t ProcessGroupOf(pid_t pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!file || !std::getline(file, text)) return -1;
  // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so read from the last ')'.
  const std::size_t close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(text.substr(close + 1));
  std::string state;
  long ppid = 0, pgrp = -1;
  if (!(fields >> state >> ppid >> pgrp)) return -1;
  return static_cast<pid_t>(pgrp);
}

}  // namespace vgpu::runner::internal
