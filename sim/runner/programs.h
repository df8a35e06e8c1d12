// `program:` processes in live mode (docs/scenarios.md, "Programs"): where a program is found and runs, and its GPU
// time, read from vgpu-sampler --processes lines. Private to sim/runner.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vgpu::runner::internal {

// The folder a scenario's programs run in: its file's folder; "" (the runner's own) for a scenario with no file.
std::string ProgramFolder(const std::string& scenario_file);

// The file to execute for a program's first word: a word with a '/' as written (a relative one from `folder`),
// else the first executable of that name in `path` (PATH's value; null or "" searches nothing). "" with `error`
// set (naming the word and where it was looked for) if there is none.
std::string FindProgram(const std::string& word, const char* path, const std::string& folder, std::string& error);

struct ProcessBusy {
  std::uint32_t device = 0;  // NVML's index: the physical device
  std::uint32_t pid = 0;
  std::uint64_t busy_ns = 0;  // cumulative, to its end for one that has gone
};

// The "processes":[[device,pid,busy_ns],..] of a vgpu-sampler --processes line; false if the line has no such list
// or a malformed one.
bool ParseProcessBusy(std::string_view line, std::vector<ProcessBusy>& entries);

// The process group of a running process, from /proc/<pid>/stat; -1 if it has gone or cannot be read.
pid_t ProcessGroupOf(pid_t pid);

}  // namespace vgpu::runner::internal
