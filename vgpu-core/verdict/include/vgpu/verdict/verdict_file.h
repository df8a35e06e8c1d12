// The OS side of verdicts: read whole by the shim (the monitor writes them whole and renames them into place:
// vgpu-core/monitor/monitor_main.cc).
#pragma once

#include <string>

namespace vgpu::verdict {

// Reads the file at `path` whole (at most kMaxBytes; a larger one is an error). False with `error` set when it is
// missing
// (`missing` true then) or cannot be read.
bool ReadWhole(const std::string& path, std::string& text, bool& missing, std::string& error);

}  // namespace vgpu::verdict
