// What the shim's launch path costs, measured inside one process (issue 6, overhead). Between processes and rounds
// the GPU machine's host drifts by more than the cost sought (docs/results-gpu.md, "Sixth run"); here batches of
// launches through the shim's hook and straight into the driver's own cuLaunchKernel alternate in one process, so
// the drift mostly cancels in each pair of batches. The driver's function is found past the hooks the way a raw
// driver user would (docs/threat-model.md): libcuda.so.1's load address plus the symbol's value in its .dynsym.
//
//   g++ -O2 -std=c++20 -I/usr/local/cuda/include tests/gpu/launch_ab.cc -o launch_ab -lcuda
//   LD_PRELOAD=libvgpu.so CUDA_DEVICE_SM_LIMIT=99 GPU_CORE_UTILIZATION_POLICY=force ./launch_ab sim/tenant/spin.ptx
//
// Prints one JSON line per pattern: the median host ns per launch through each path, and the median over pairs of
// batches of (hooked / driver - 1), with p10 and p90. Patterns: "16 deep" (16 launches timed one by one, then a
// synchronize, untimed) and "launch+sync" (a launch and a synchronize, timed together; each path synchronizes through
// its own entry point, the hook's or the driver's). Then one line per kind of single call ("calls"): p50, p90, p99
// and mean ns through each path -- the 16-deep launches by their position after the synchronize, and launch+sync's
// launch call and synchronize apart. Runs over fakecuda too.
#include <cuda.h>
#include <elf.h>
#include <link.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "spread.h"

namespace {

using LaunchFunction = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);

double NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

using SyncFunction = CUresult (*)(CUstream);

// The driver's own function `name`, or null (with a line on stderr saying why).
void* DriverSymbol(const char* name) {
  struct Loaded {
    std::string path;
    ElfW(Addr) base = 0;
  } loaded;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* found = static_cast<Loaded*>(data);
        if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, "/libcuda.so") == nullptr) return 0;
        found->path = info->dlpi_name;
        found->base = info->dlpi_addr;
        return 1;
      },
      &loaded);
  if (loaded.path.empty()) {
    std::fprintf(stderr, "launch_ab: libcuda.so.1 is not loaded\n");
    return nullptr;
  }
  std::ifstream file(loaded.path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (bytes.size() < sizeof(ElfW(Ehdr))) {
    std::fprintf(stderr, "launch_ab: cannot read %s\n", loaded.path.c_str());
    return nullptr;
  }
  const auto* header = reinterpret_cast<const ElfW(Ehdr)*>(bytes.data());
  const auto* sections = reinterpret_cast<const ElfW(Shdr)*>(bytes.data() + header->e_shoff);
  for (int i = 0; i < header->e_shnum; ++i) {
    if (sections[i].sh_type != SHT_DYNSYM) continue;
    const auto* symbols = reinterpret_cast<const ElfW(Sym)*>(bytes.data() + sections[i].sh_offset);
    const char* names = bytes.data() + sections[sections[i].sh_link].sh_offset;
    for (std::size_t k = 0; k < sections[i].sh_size / sizeof(ElfW(Sym)); ++k) {
      if (symbols[k].st_value != 0 && std::strcmp(names + symbols[k].st_name, name) == 0) {
        return reinterpret_cast<void*>(loaded.base + symbols[k].st_value);
      }
    }
  }
  std::fprintf(stderr, "launch_ab: no %s in %s's .dynsym\n", name, loaded.path.c_str());
  return nullptr;
}

// Single calls, kept per path for their distribution (where the added time goes: on every launch, or on a few).
struct Calls {
  std::vector<double> at[16];        // 16 deep: by position after the synchronize
  std::vector<double> launch, sync;  // launch+sync: the launch call and the synchronize, each timed
};

// p50, p90, p99 and mean of `values`, as a JSON array ("null" if empty).
std::string Quantiles(std::vector<double> values) {
  if (values.empty()) return "null";
  std::sort(values.begin(), values.end());
  double sum = 0;
  for (double v : values) sum += v;
  const auto at = [&](double q) {
    return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
  };
  char text[160];
  std::snprintf(text, sizeof text, "[%.1f,%.1f,%.1f,%.1f]", at(0.5), at(0.9), at(0.99),
                sum / static_cast<double>(values.size()));
  return text;
}

// The spin kernel on one stream, launched through either path, and the batches the patterns time.
class Bench {
 public:
  Bench(CUfunction function, CUstream stream, LaunchFunction driver, SyncFunction driver_sync, std::size_t evict_bytes,
        unsigned long long spin_ns)
      : function_(function),
        stream_(stream),
        driver_(driver),
        driver_sync_(driver_sync),
        evict_(evict_bytes),
        ns_(spin_ns) {}

  LaunchFunction hooked() const { return &cuLaunchKernel; }  // through the PLT: the shim's hook under LD_PRELOAD
  LaunchFunction driver() const { return driver_; }
  CUresult failed() const { return failed_; }

  // One batch of "16 deep" (`f` a path, or a stand-in for the first): host ns per launch.
  double SixteenDeep(LaunchFunction f, Calls& calls) {
    double total = 0;
    for (int round = 0; round < 64; ++round) {
      for (int i = 0; i < 16; ++i) {
        Displace();
        const double t0 = NowNs();
        Launch(f);
        const double took = NowNs() - t0;
        total += took;
        calls.at[i].push_back(took);
      }
      SyncOf(f)(stream_);
    }
    return total / (64 * 16);
  }

  // One batch of "launch+sync": host ns per launch and its synchronize.
  double LaunchSync(LaunchFunction f, Calls& calls) {
    const double t0 = NowNs();
    double displacing = 0;
    for (int i = 0; i < 512; ++i) {
      const double d0 = NowNs();
      Displace();
      displacing += NowNs() - d0;
      const double a = NowNs();
      Launch(f);
      const double b = NowNs();
      SyncOf(f)(stream_);
      calls.launch.push_back(b - a);
      calls.sync.push_back(NowNs() - b);
    }
    return (NowNs() - t0 - displacing) / 512;
  }

  // 41 pairs of batches (`batch(path, calls)`), the order alternating, after a warm-up of each path: prints one JSON
  // line. The single calls of the pairs are left in `through_hook` and `into_driver`.
  template <typename Batch>
  void Measure(const char* name, Batch&& batch) {
    batch(hooked(), through_hook);  // warm-up: the shim's first launches of a kernel are each measured
    batch(driver_, into_driver);
    through_hook = Calls{};
    into_driver = Calls{};
    std::vector<double> through_shim, straight, ratios;
    for (int pair = 0; pair < 41; ++pair) {
      double a = 0, b = 0;
      if (pair % 2 == 0) {
        a = batch(hooked(), through_hook);
        b = batch(driver_, into_driver);
      } else {
        b = batch(driver_, into_driver);
        a = batch(hooked(), through_hook);
      }
      through_shim.push_back(a);
      straight.push_back(b);
      ratios.push_back(a / b - 1);
    }
    const Spread added = Of(ratios);
    std::printf(
        "{\"pattern\":\"%s\",\"hooked_ns\":%.1f,\"driver_ns\":%.1f,\"added\":%.4f,\"added_p10\":%.4f,"
        "\"added_p90\":%.4f,\"pairs\":%zu}\n",
        name, Of(through_shim).median, Of(straight).median, added.median, added.p10, added.p90, ratios.size());
  }

  // One line per kind of single call: p50 / p90 / p99 / mean per path (a median that moves is a cost on every call; a
  // mean that moves alone, a cost on a few).
  template <typename Pick>
  void PrintCalls(const char* name, const char* part, Pick&& pick) {
    std::printf("{\"pattern\":\"%s\",\"calls\":\"%s\",\"hooked\":%s,\"driver\":%s}\n", name, part,
                Quantiles(pick(through_hook)).c_str(), Quantiles(pick(into_driver)).c_str());
  }

  Calls through_hook, into_driver;  // (by the path's role: without the shim both paths are the same function)

 private:
  // Over fakecuda a launch touches little memory, so whatever the shim's launch path reads stays in the nearest
  // caches; a real driver's launch (~3 us) displaces it. Writing a buffer between launches stands in for that.
  void Displace() {
    ++evict_seed_;
    for (std::size_t i = 0; i < evict_.size(); i += 64) evict_[i] = static_cast<unsigned char>(evict_seed_ + i);
  }
  void Launch(LaunchFunction f) {
    if (const CUresult result = f(function_, 1, 1, 1, 32, 1, 1, 0, stream_, params_, nullptr); result != CUDA_SUCCESS) {
      failed_ = result;
    }
  }
  // Each path synchronizes through its own kind of entry point (the shim hooks cuStreamSynchronize too).
  SyncFunction SyncOf(LaunchFunction f) const { return f == driver_ ? driver_sync_ : &cuStreamSynchronize; }

  CUfunction function_;
  CUstream stream_;
  LaunchFunction driver_;
  SyncFunction driver_sync_;
  std::vector<unsigned char> evict_;
  unsigned char evict_seed_ = 0;
  unsigned long long ns_;  // 0: the spin kernel returns at once; longer than a launch call, kernels queue
  void* params_[1] = {&ns_};
  CUresult failed_ = CUDA_SUCCESS;
};

// LAUNCH_AB_TOUCH="K ...": what reading K cache lines costs right after a driver launch, K lines each on a page of its
// own ("pages K") and K lines of one page ("lines K"), against the driver's launch alone (16 deep). A shim's booked
// launch reads a few lines of its own, on a few pages; the driver's launch in between may have displaced them
// (caches, TLB). Run without the shim: both paths are the driver's, the difference is the reads.
void MeasureTouches(Bench& bench, const char* touch) {
  static std::vector<unsigned char> pages(64 * 4096 + 4096);
  static unsigned sink = 0;
  static long k = 0;
  static std::size_t stride = 0;
  static LaunchFunction driver = nullptr;
  driver = bench.driver();
  const LaunchFunction through_touch = [](CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                          unsigned bz, unsigned shared, CUstream s, void** p, void** e) {
    for (long i = 0; i < k; ++i) sink += pages[static_cast<std::size_t>(i) * stride];
    return driver(f, gx, gy, gz, bx, by, bz, shared, s, p, e);  // (driver: never the hook)
  };
  for (char* next = nullptr;; touch = next) {
    k = std::strtol(touch, &next, 10);
    if (next == touch || k <= 0 || k > 64) break;
    for (const bool spread : {true, false}) {
      stride = spread ? 4096 : 64;
      const std::string name = std::string(spread ? "pages " : "lines ") + std::to_string(k);
      bench.Measure(name.c_str(), [&](LaunchFunction f, Calls& calls) {
        // The first path: touch, then the driver.
        return bench.SixteenDeep(&calls == &bench.through_hook ? through_touch : f, calls);
      });
    }
  }
  if (sink == 1) std::printf("{}\n");
}

// The primary context of device 0 made current, the spin kernel loaded from `ptx` and a stream; false (said) if not.
bool SetUp(const std::string& ptx, CUfunction& function, CUstream& stream) {
  CUdevice device = 0;
  CUcontext context = nullptr;
  CUmodule module = nullptr;
  CUresult r = cuInit(0);
  if (r == CUDA_SUCCESS) r = cuDeviceGet(&device, 0);
  if (r == CUDA_SUCCESS) r = cuDevicePrimaryCtxRetain(&context, device);
  if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(context);
  if (r == CUDA_SUCCESS) r = cuModuleLoadData(&module, ptx.c_str());
  if (r == CUDA_SUCCESS) r = cuModuleGetFunction(&function, module, "vgpu_spin");
  if (r == CUDA_SUCCESS) r = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) std::fprintf(stderr, "launch_ab: set-up failed: %d\n", static_cast<int>(r));
  return r == CUDA_SUCCESS;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::fprintf(stderr,
                 "usage: launch_ab SPIN_PTX [EVICT_KIB [SPIN_NS]] (the vgpu_spin kernel, e.g. sim/tenant/spin.ptx; "
                 "EVICT_KIB: before each timed launch, untimed, write this many KiB, as a real driver's launch "
                 "does; SPIN_NS: how long each kernel spins, 0 by default: it returns at once)\n");
    return 2;
  }
  std::ifstream ptx_file(argv[1]);
  const std::string ptx((std::istreambuf_iterator<char>(ptx_file)), std::istreambuf_iterator<char>());
  if (ptx.empty()) {
    std::fprintf(stderr, "launch_ab: cannot read the PTX file %s\n", argv[1]);
    return 2;
  }
  CUfunction function = nullptr;
  CUstream stream = nullptr;
  if (!SetUp(ptx, function, stream)) return 1;
  const auto driver = reinterpret_cast<LaunchFunction>(DriverSymbol("cuLaunchKernel"));
  const auto driver_sync = reinterpret_cast<SyncFunction>(DriverSymbol("cuStreamSynchronize"));
  if (driver == nullptr || driver_sync == nullptr) return 1;
  Bench bench(function, stream, driver, driver_sync, argc >= 3 ? std::strtoul(argv[2], nullptr, 10) * 1024 : 0,
              argc == 4 ? std::strtoull(argv[3], nullptr, 10) : 0);
  bench.Measure("16 deep", [&](LaunchFunction f, Calls& calls) { return bench.SixteenDeep(f, calls); });
  for (int i = 0; i < 16; ++i) {
    const std::string part = "launch " + std::to_string(i + 1) + " of 16";
    bench.PrintCalls("16 deep", part.c_str(), [&](Calls& c) { return c.at[i]; });
  }
  bench.Measure("launch+sync", [&](LaunchFunction f, Calls& calls) { return bench.LaunchSync(f, calls); });
  // (Measured after launch+sync, printed before its calls: the calls are launch+sync's.)
  Calls launch_sync_hook = bench.through_hook, launch_sync_driver = bench.into_driver;
  if (const char* touch = std::getenv("LAUNCH_AB_TOUCH")) MeasureTouches(bench, touch);
  bench.through_hook = launch_sync_hook;
  bench.into_driver = launch_sync_driver;
  bench.PrintCalls("launch+sync", "launch", [](Calls& c) { return c.launch; });
  bench.PrintCalls("launch+sync", "synchronize", [](Calls& c) { return c.sync; });
  if (bench.failed() != CUDA_SUCCESS) {
    std::fprintf(stderr, "launch_ab: a launch failed: %d\n", static_cast<int>(bench.failed()));
    return 1;
  }
  return 0;
}
