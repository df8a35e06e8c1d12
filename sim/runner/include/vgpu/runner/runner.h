// Runs a scenario (docs/scenarios.md) live (real vgpu-tenant processes under libvgpu.so, over fakecuda or the real
// driver) or in virtual time (sim/core), writing one trace in the same format for both.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "vgpu/scenario/scenario.h"

namespace vgpu::runner {

enum class Mode { virtual_time, live };

struct Options {
  Mode mode = Mode::virtual_time;
  std::string trace_path;  // JSON lines written here as the run goes; "" = kept in Outcome::trace only
  // Where the built pieces are: lib/libvgpu.so, lib/libcuda.so.1 and lib/libnvidia-ml.so.1 (fakecuda), and
  // bin/vgpu-tenant, bin/vgpu-sampler (live mode). "" = VGPU_INSTALL_DIR from the environment.
  std::string install_dir;
  std::string work_dir;  // temporary files (regions, the fake machine); "" = a new directory under TMPDIR
  // Called from the running thread at least once per second of scenario time (and at the end with 1.0).
  std::function<void(double fraction_done, const std::string& what)> progress;
  const std::atomic<bool>* cancel = nullptr;  // set to stop early: processes are killed, the trace is closed
  // The environment the run reads (VGPU_INSTALL_DIR, TMPDIR) and passes on to its processes, as NAME=VALUE
  // entries; empty = this process's environ, read when the run starts. A host that runs this off its main thread
  // while other threads may call setenv (Python with the GIL released) passes a copy taken beforehand.
  std::vector<std::string> environment;
};

struct Outcome {
  bool ok = false;  // false: `error` says why (nothing ran, or the run was cut short)
  std::string error;
  std::string trace;  // the whole trace when Options::trace_path is "" (else empty)
  double wall_seconds = 0;
};

// Runs `scenario` in `options.mode`. Live mode needs the scenario's live_mode, virtual its virtual_mode.
// The trace (docs/scenarios.md, "The trace"), as both modes write it:
// - "device" in process, sample and gpu lines is the physical device (a tenant's devices[process.device]);
//   a tenant has sample lines for each of its own devices, every sample instant 0, sample, 2 x sample, .. duration.
// - Events at one instant come before that instant's samples; lines are in time order.
// - virtual: pid 0; "seconds_wall" 0 (the trace repeats byte for byte). live: an "exit" with status "error" also
//   carries "message" (the exit status and the process's last lines on stderr).
// Never throws and never exits; a live run cut short (cancel, a failure) still ends its trace with an "end" line.
Outcome Run(const scenario::Scenario& scenario, const Options& options);

}  // namespace vgpu::runner
