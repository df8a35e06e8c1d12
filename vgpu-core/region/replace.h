// A file at the region's path that is not a region of this version, replaced once nobody uses it
// (docs/hami-cache.md, "Bad input"). Private to vgpu-core/region: Attachment::Open calls it.
#pragma once

#include <string>

#include "vgpu/region/shared_file.h"

namespace vgpu::region {

enum class Replaced {
  yes,     // replaced (or found replaced by another process meanwhile): open the path again
  in_use,  // left as it is for now: a process uses it (its users may end: worth another look)
  never,   // left as it is for good: a newer region of ours, a link or not a regular file, or it cannot be replaced
};

// `fd`: the file Validate refused, opened read-write from `path`. Replaceable are HAMi-core's own cache file (when no
// process its slots name lives), a region of an older version of ours (when none of its processes holds a liveness
// lock, wherever that version kept them) and anything else short or foreign (when nobody holds a liveness lock):
// then a fresh file made by `initialize` (`bytes` long) is renamed over it, and `note` says what was replaced.
// Otherwise `why_not` says why (one clause, for the caller's message). Holds the liveness locks of the old file while
// it decides and replaces, so that no process can start using it meanwhile; releases them before it returns.
Replaced ReplaceIfUnused(const std::string& path, int fd, std::size_t bytes, InitializeShared initialize,
                         std::string& note, std::string& why_not);

}  // namespace vgpu::region
