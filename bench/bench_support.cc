// A fresh fake machine per benchmark, and the benchmark main that removes the state files afterwards.
#include "bench_support.h"

#include <benchmark/benchmark.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace fakecuda::bench {
namespace {

// Bounded: one file per benchmark family that touches a fake library.
constexpr int kMaxStateFiles = 16;
char g_paths[kMaxStateFiles][128];
char g_names[kMaxStateFiles][32];
int g_count = 0;

}  // namespace

const char* UseFreshState(const char* name) {
  for (int i = 0; i < g_count; ++i) {
    if (std::strcmp(g_names[i], name) == 0) return g_paths[i];
  }
  if (g_count == kMaxStateFiles) {
    std::fprintf(stderr, "fakecuda_bench: more than %d state files requested (last: '%s')\n", kMaxStateFiles, name);
    std::abort();
  }
  char* path = g_paths[g_count];
  std::snprintf(g_names[g_count], sizeof g_names[g_count], "%s", name);
  std::snprintf(path, sizeof g_paths[g_count], "/tmp/fakecuda-bench-%d-%s.state", static_cast<int>(getpid()), name);
  ++g_count;
  unlink(path);  // a leftover of a crashed run with a reused pid would not be fresh
  setenv("FAKECUDA_STATE", path, 1);
  return path;
}

void RemoveStateFiles() {
  for (int i = 0; i < g_count; ++i) unlink(g_paths[i]);
  g_count = 0;
}

}  // namespace fakecuda::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  fakecuda::bench::RemoveStateFiles();
  return 0;
}
