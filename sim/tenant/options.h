// Command line of vgpu-tenant: the options, their strict parsing, and the usage text.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vgpu::tenant {

// Kernel count when neither --kernels nor --seconds is given.
inline constexpr std::uint64_t kDefaultKernelCount = 1000;

// One --phase: kernels of the given sizes for a while, or nothing (idle).
struct Phase {
  bool idle = false;
  std::vector<std::uint64_t> sizes_ns;  // run: each kernel drawn uniformly from these
  std::optional<std::uint64_t> for_ns;  // absent: until --seconds ends (idle: always set)
  std::optional<std::uint32_t> depth;   // absent: --depth
  double rate_hz = 0;                   // 0: closed loop
  std::optional<std::uint32_t> blocks;  // absent: --blocks
  std::uint32_t jitter_permille = 0;    // each kernel's duration varies uniformly by +/- this much
  // collective=D: after every `every` kernels, one vgpu_collective of D (an all_reduce of a DDP step) in group
  // `group` of `ranks` members, one per device (on fakecuda it waits for the other ranks' kernels to start).
  std::uint64_t collective_ns = 0;
  std::uint32_t ranks = 0;
  std::uint64_t group = 1;
  std::uint32_t every = 1;
};

// --churn: threads that allocate and free device memory as fast as they can, beside the kernels.
struct Churn {
  std::uint32_t threads = 1;
  std::uint64_t min_bytes = 4096;  // each block a multiple of 4 KiB in [min_bytes, max_bytes]
  std::uint64_t max_bytes = 4ull << 20;
  std::uint32_t hold = 8;  // blocks one thread holds at most
};

struct Options {
  int device = 0;
  std::uint64_t alloc_bytes = 0;
  std::uint64_t kernel_us = 1000;
  // One block of one warp: the smallest launch that keeps a GPU busy, so a
  // tenant's share of the device is pure time, not SMs.
  std::uint32_t blocks = 1;
  std::uint32_t threads = 32;
  // At most one of these two is set; neither means kDefaultKernelCount kernels.
  std::optional<std::uint64_t> kernel_count;
  std::optional<double> seconds;
  // Open loop when set: launches at this fixed rate, whatever the GPU does.
  std::optional<double> rate_hz;
  std::uint32_t depth = 2;
  std::uint32_t streams = 1;
  std::optional<std::string> ptx_path;
  // --phase, in order; empty: one phase from --kernel-us, --blocks, --depth and --rate, as before phases.
  std::vector<Phase> phases;
  bool repeat = false;
  std::uint64_t seed = 1;                  // the size and jitter draws
  std::optional<std::uint64_t> report_ms;  // a progress line every this many milliseconds
  std::optional<Churn> churn;              // --churn; stdin then takes pause/resume/stop
};

struct CommandLine {
  Options options;
  bool help_requested = false;
  // Empty when the command line parsed; otherwise one line naming the flag,
  // the value and an accepted example (the caller prints it and exits 2).
  std::string error;
};

// args excludes the program name.
CommandLine ParseCommandLine(std::span<const char* const> args);

std::string UsageText();

// The value parsers, exposed for tests. Each returns the value, or nullopt and
// sets *problem to why the text was refused (e.g. "has trailing characters \"x\"").
std::optional<std::uint64_t> ParseWholeNumber(std::string_view text, std::string* problem);
// Bytes, or a whole number with a suffix k, m, g, t (either case) or Ki, Mi, Gi,
// Ti: all powers of 1024, as HAMi's CUDA_DEVICE_MEMORY_LIMIT reads them
// ("1g" = "1024m" = "1Gi" = 1073741824).
std::optional<std::uint64_t> ParseSizeBytes(std::string_view text, std::string* problem);
std::optional<double> ParseDecimal(std::string_view text, std::string* problem);
// A duration: a decimal number and a unit ns, us, ms or s ("5us", "1.5s"), in whole nanoseconds.
std::optional<std::uint64_t> ParseDurationNs(std::string_view text, std::string* problem);
// The value of --phase (see UsageText); "" or what is wrong with it.
std::string ParsePhase(std::string_view text, Phase* phase);
// The value of --churn (see UsageText); "" or what is wrong with it.
std::string ParseChurn(std::string_view text, Churn* churn);

}  // namespace vgpu::tenant
