// vgpu-tenant: a GPU workload for scenarios; launches the spin kernel and prints one JSON line (see --help).
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <span>
#include <string>

#include "options.h"
#include "result_line.h"
#include "vgpu_tenant/spin_ptx.h"
#include "workload.h"

namespace {

// Far above any real PTX module, far below a mistake such as --ptx /dev/zero.
constexpr std::size_t kMaxPtxBytes = 64 << 20;

// Reads a PTX file for --ptx; "" or the problem, phrased like the option parser's messages.
std::string ReadPtxFile(const std::string& path, std::string* text) {
  const auto problem = [&path](const std::string& what) {
    return "--ptx \"" + path + "\" " + what + "; expected a PTX text file, e.g. --ptx spin.ptx";
  };
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return problem(std::string("cannot be opened: ") + std::strerror(errno));
  }
  char buffer[65536];
  std::size_t count = 0;
  while ((count = std::fread(buffer, 1, sizeof buffer, file)) > 0) {
    text->append(buffer, count);
    if (text->size() > kMaxPtxBytes) {
      std::fclose(file);
      return problem("is larger than 64 MiB");
    }
  }
  const bool read_failed = std::ferror(file) != 0;
  std::fclose(file);
  if (read_failed) {
    return problem("cannot be read");
  }
  if (text->empty()) {
    return problem("is empty");
  }
  // cuModuleLoadData reads PTX up to its first NUL: anything after would be silently lost.
  if (text->find('\0') != std::string::npos) {
    return problem("contains a NUL byte, so it is not PTX text");
  }
  return {};
}

int Main(int argc, char** argv) {
  using namespace vgpu::tenant;
  const CommandLine command_line =
      ParseCommandLine(std::span<const char* const>(argv + 1, static_cast<std::size_t>(argc > 0 ? argc - 1 : 0)));
  if (command_line.help_requested) {
    std::fputs(UsageText().c_str(), stdout);
    return 0;
  }
  if (!command_line.error.empty()) {
    std::fprintf(stderr, "vgpu-tenant: %s (see vgpu-tenant --help)\n", command_line.error.c_str());
    return 2;
  }
  const Options& options = command_line.options;

  std::string ptx_from_file;
  if (options.ptx_path) {
    const std::string problem = ReadPtxFile(*options.ptx_path, &ptx_from_file);
    if (!problem.empty()) {
      std::fprintf(stderr, "vgpu-tenant: %s\n", problem.c_str());
      return 2;
    }
  }

  ResultLine result;
  result.pid = static_cast<long long>(getpid());
  result.device = options.device;
  // With --phase the sizes vary: kernel_us is 0 and busy_fraction comes from busy_ns.
  result.kernel_us = options.phases.empty() ? options.kernel_us : 0;
  result.blocks = options.blocks;
  result.busy_from_busy_ns = !options.phases.empty();
  int exit_status = 0;
  try {
    RunWorkload(options, options.ptx_path ? ptx_from_file.c_str() : kSpinPtx, &result);
  } catch (const CudaFailure& failure) {
    result.error = ErrorName(failure.result);
    result.call = failure.call;
    std::fprintf(stderr, "vgpu-tenant: %s failed: %s (%s)\n", failure.call, result.error.c_str(),
                 ErrorDescription(failure.result).c_str());
    exit_status = 3;  // also for "status":"oom": every failed CUDA call exits 3, the status tells them apart
  }
  std::printf("%s\n", FormatResultLine(result).c_str());
  std::fflush(stdout);
  return exit_status;
}

}  // namespace

int main(int argc, char** argv) {
  // Never a crash or an uncaught exception: an out-of-memory on the host is
  // reported like any other failure, on stderr with a distinct status.
  try {
    return Main(argc, argv);
  } catch (const std::exception& exception) {
    std::fprintf(stderr, "vgpu-tenant: internal error: %s\n", exception.what());
  } catch (...) {
    std::fprintf(stderr, "vgpu-tenant: internal error: unknown exception\n");
  }
  return 1;
}
