// What every fakecuda benchmark shares: a fresh fake machine (state file) per benchmark, removed at exit.
#pragma once

namespace fakecuda::bench {

// Points FAKECUDA_STATE at a new file, /tmp/fakecuda-bench-<pid>-<name>.state, unless this process already
// did so for `name`; the file is removed when the benchmarks end. Call it before the benchmark's first call
// into a fake library: each library reads FAKECUDA_STATE once, at its first use, so a later change has no
// effect on a library already attached. Returns the path.
const char* UseFreshState(const char* name);

// Removes every state file UseFreshState named (called by the benchmark main after the run).
void RemoveStateFiles();

}  // namespace fakecuda::bench
