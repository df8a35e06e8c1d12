// Command line of vgpu-tenant: the options, their strict parsing, and the usage text.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace vgpu::tenant {

// Kernel count when neither --kernels nor --seconds is given.
inline constexpr std::uint64_t kDefaultKernelCount = 1000;

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

}  // namespace vgpu::tenant
