// The GPU suite's fallback when the Python module vgpu._native could not be built on the GPU machine (no pybind11
// or no Python headers there): runs one scenario with the same runner library `vgpu run` uses and writes its
// trace; tests/gpu/suite.py then computes the shares from the trace. Built by tests/gpu/run.sh with the compiler
// alone, against the static libraries of the build tree (no CMake target: tests/gpu is not part of the build).
//
// usage: run_scenario FILE live|virtual TRACE INSTALL_DIR
// exit: 0 the run finished (its expectations are judged by the caller), 2 refused or could not run
#include <cstdio>
#include <string>

#include "vgpu/runner/runner.h"
#include "vgpu/scenario/scenario.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: run_scenario FILE live|virtual TRACE INSTALL_DIR\n");
    return 2;
  }
  const std::string mode = argv[2];
  if (mode != "live" && mode != "virtual") {
    std::fprintf(stderr, "run_scenario: mode '%s' is not live or virtual\n", argv[2]);
    return 2;
  }
  const vgpu::scenario::Loaded loaded = vgpu::scenario::LoadFile(argv[1]);
  if (!loaded.scenario) {
    for (const vgpu::scenario::Problem& problem : loaded.problems) {
      std::fprintf(stderr, "%s\n", problem.ToString().c_str());
    }
    return 2;
  }
  vgpu::runner::Options options;
  options.mode = mode == "live" ? vgpu::runner::Mode::live : vgpu::runner::Mode::virtual_time;
  options.trace_path = argv[3];
  options.install_dir = argv[4];
  const vgpu::runner::Outcome outcome = vgpu::runner::Run(*loaded.scenario, options);
  if (!outcome.ok) {
    std::fprintf(stderr, "run_scenario: %s\n", outcome.error.c_str());
    return 2;
  }
  std::printf("{\"ok\":true,\"wall_seconds\":%.3f}\n", outcome.wall_seconds);
  return 0;
}
