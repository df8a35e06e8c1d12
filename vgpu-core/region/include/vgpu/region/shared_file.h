// Files that several processes map, possibly from different containers (the region, the node's schedule file):
// created complete or not at all, and guarded by a robust process-shared mutex. Never calls exit().
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace vgpu::region {

// Opens the file at `path` read-write, creating it if absent: built under a temporary name beside it (pid, clock
// and a counter: unique across pid namespaces), sized with every block allocated (a full tmpfs fails here, not
// later with SIGBUS), mapped zeroed and filled by `initialize`, mode 0666 whatever the umask, then linked into place,
// so that nobody ever maps a half-made file; a creation race is lost gracefully (the winner's file is opened).
// `initialize` is given `context` as it was passed.
// Returns the fd, or -1 with `error` one line naming the file (`what`: "region file") and, as the remedy, the
// variable that moves it.
using InitializeShared = bool (*)(void* mapped, const void* context, std::string& error);
int CreateOrOpenShared(const std::string& path, std::size_t bytes, InitializeShared initialize, const void* context,
                       std::string_view what, std::string_view variable, std::string& error);

// Puts a fresh file, made as CreateOrOpenShared makes one, in the place of whatever is at `path` (rename: a process
// that opens the path sees the old file or the new one, whole). For a file found unused (region/replace.h); the
// caller opens the path again. False with `error` (naming the file) when it cannot.
bool ReplaceShared(const std::string& path, std::size_t bytes, InitializeShared initialize, const void* context,
                   std::string_view what, std::string& error);

// Initialises a robust, process-shared pthread mutex in `storage` (at least sizeof(pthread_mutex_t), aligned).
// Returns 0 or the error number.
int InitRobustMutex(void* storage);

}  // namespace vgpu::region
