// The child program of the shim tests: one command a run (views, failclosed, cycle, fill, churn, observe), results
// as key=value lines on stdout; the test that started it decides the environment (with or without the shim).
//
//   views     [ctx=ORDINAL] [alloc=BYTES] [hold=1]  every memory view, CUDA and NVML; hold: wait for EOF on fd 5
//   failclosed                                     every way to reach the GPU, each result; exits 42 (its own code)
//   cycle     bytes= [timeout_ms=] [device=]       context + alloc + free, retrying OOM until the deadline
//   fill                                           context, allocate all that cuMemGetInfo says is free, then 512 more
//   churn     threads= rounds= seed= min= max= hold= [until_stop=1] [wait_go=1] [pipes=1] [barrier=1]
//                                                  random alloc/free in threads; fd 3 started, fd 4 done, fd 5 go;
//                                                  barrier: after fd 3, wait for EOF on fd 6 before the rounds
//   observe   limit= [device=]                     (run without the shim) poll NVML until EOF on fd 5
//   launch    threads= seconds= short_us= long_us= long_every= [own_streams=1] [sync_every=N] [pause_us=N]
//             [stall_us=N [stall_every_us=N]]
//                                                  threads launching one-block spin kernels into the legacy default
//                                                  stream, long_us one launch in long_every (drawn), short_us else;
//                                                  sync_every: a thread synchronizes the context after every N (a
//                                                  training loop's few steps, then torch.cuda.synchronize), and
//                                                  the times from one synchronize's return to the next are printed
//                                                  as sync_loops=, sync_loop_p90_ns=, _p99_ns=, _max_ns=;
//                                                  pause_us: after each synchronize the thread sleeps a drawn
//                                                  pause_us/2 .. 3*pause_us/2 (a light service's requests), and a
//                                                  loop's time runs from the end of its pause;
//                                                  stall_us (with stall_every_us, default 1000): every
//                                                  stall_every_us one thread in turn is held that long wherever
//                                                  it is (SIGUSR1, sleeping in the handler: preempted);
//                                                  prints launched=, busy_ns= (their run times), elapsed_ns=
//   hostoom_start  limit=                          the shim's first call (cuInit) with every allocation of the shim
//                                                  failing; then none failing: a context, and two allocations of
//                                                  half of `limit` and 1 MiB (the second must be refused)
//   process   limit=                           every piece of process-wide state the shim must leave alone
//                                                  (umask, signal dispositions and mask, resource limits, working
//                                                  folder, environment), read before and after a round of CUDA and
//                                                  NVML calls (allocations, an over-limit one, launches); prints
//                                                  each that changed, and reaches its own end (exit code 0)
//   mixed     threads= rounds= seed= limit= [oom_percent=0] [actions=0123456789ab]
//                                                  threads allocating (cuMemAlloc, cuMemAllocAsync, arrays, VMM,
//                                                  pitch, contexts), reading NVML, freeing
//                                                  and launching, while oom_percent % of the shim's own allocations
//                                                  fail (host_oom.h); then everything freed; prints every result that
//                                                  was neither success nor out of memory, and the counts before/after
//
// Exit codes: 0 done, 2 bad arguments, 3 deadline passed, 4 unexpected CUDA/NVML error, 42 failclosed's own code.
#include <cuda.h>
#include <dlfcn.h>
#include <nvml.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "host_oom.h"
#include "vgpu/base/uuid.h"
#include "vgpu_tenant/spin_ptx.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kStartedFd = 3;
constexpr int kDoneFd = 4;
constexpr int kGoFd = 5;
constexpr int kBeginFd = 6;

std::map<std::string, std::string> g_args;
std::mutex g_print_mutex;

std::uint64_t Arg(const std::string& key, std::uint64_t fallback) {
  const auto it = g_args.find(key);
  return it == g_args.end() ? fallback : std::strtoull(it->second.c_str(), nullptr, 10);
}
bool Has(const std::string& key) { return g_args.count(key) != 0; }

template <typename T>
void Print(const std::string& key, T value) {
  std::lock_guard<std::mutex> guard(g_print_mutex);
  if constexpr (std::is_same_v<T, std::string>) {
    std::printf("%s=%s\n", key.c_str(), value.c_str());
  } else if constexpr (std::is_signed_v<T>) {
    std::printf("%s=%lld\n", key.c_str(), static_cast<long long>(value));
  } else {
    std::printf("%s=%llu\n", key.c_str(), static_cast<unsigned long long>(value));
  }
}

void WriteByte(int fd) {
  const char byte = 1;
  while (write(fd, &byte, 1) < 0 && errno == EINTR) {
  }
}

// Blocks until the parent closes its end of the pipe on `fd` (or it dies).
void WaitForEof(int fd) {
  char buffer[16];
  for (;;) {
    const ssize_t n = read(fd, buffer, sizeof buffer);
    if (n == 0 || (n < 0 && errno != EINTR)) return;
  }
}
void WaitForGo() { WaitForEof(kGoFd); }

bool GoClosed() {
  pollfd p{kGoFd, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

std::uint64_t SplitMix(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Retains and makes current the primary context of `ordinal`, retrying CUDA_ERROR_OUT_OF_MEMORY until `deadline`.
CUresult RetainContext(int ordinal, Clock::time_point deadline, CUcontext& context, std::uint64_t* retries = nullptr) {
  CUdevice device = 0;
  CUresult r = cuDeviceGet(&device, ordinal);
  if (r != CUDA_SUCCESS) return r;
  for (;;) {
    r = cuDevicePrimaryCtxRetain(&context, device);
    if (r != CUDA_ERROR_OUT_OF_MEMORY || Clock::now() >= deadline) break;
    if (retries != nullptr) ++*retries;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (r != CUDA_SUCCESS) return r;
  return cuCtxSetCurrent(context);
}

int Views() {
  const CUresult init = cuInit(0);
  Print("cuInit", static_cast<int>(init));
  if (init == CUDA_SUCCESS) {
    int count = 0;
    Print("cuda.count.result", static_cast<int>(cuDeviceGetCount(&count)));
    Print("cuda.count", count);
    for (int i = 0; i < count; ++i) {
      CUdevice device = 0;
      cuDeviceGet(&device, i);
      std::size_t total = 0;
      const std::string prefix = "cuda." + std::to_string(i);
      Print(prefix + ".total_mem.result", static_cast<int>(cuDeviceTotalMem_v2(&total, device)));
      Print(prefix + ".total_mem", total);
      CUuuid uuid{};
      if (cuDeviceGetUuid_v2(&uuid, device) == CUDA_SUCCESS)
        Print(prefix + ".uuid", vgpu::base::GpuUuidText(uuid.bytes));
    }
    if (Has("ctx")) {
      CUcontext context = nullptr;
      const CUresult r =
          RetainContext(static_cast<int>(Arg("ctx", 0)), Clock::now(), context);  // no retry: the view is the point
      Print("ctx.result", static_cast<int>(r));
      if (r == CUDA_SUCCESS) {
        std::size_t free_bytes = 0, total = 0;
        Print("cu.result", static_cast<int>(cuMemGetInfo_v2(&free_bytes, &total)));
        Print("cu.free", free_bytes);
        Print("cu.total", total);
        if (Has("alloc")) {
          CUdeviceptr pointer = 0;
          Print("alloc.result", static_cast<int>(cuMemAlloc_v2(&pointer, Arg("alloc", 0))));
          cuMemGetInfo_v2(&free_bytes, &total);
          Print("cu.free_after", free_bytes);
        }
      }
    }
  }
  const nvmlReturn_t nvml = nvmlInit_v2();
  Print("nvmlInit", static_cast<int>(nvml));
  if (nvml == NVML_SUCCESS) {
    unsigned int count = 0;
    nvmlDeviceGetCount_v2(&count);
    Print("nvml.count", count);
    for (unsigned int i = 0; i < count; ++i) {
      const std::string prefix = "nvml." + std::to_string(i);
      nvmlDevice_t device = nullptr;
      if (nvmlDeviceGetHandleByIndex_v2(i, &device) != NVML_SUCCESS) continue;
      char uuid[96] = {};
      if (nvmlDeviceGetUUID(device, uuid, sizeof uuid) == NVML_SUCCESS) Print(prefix + ".uuid", std::string(uuid));
      nvmlMemory_t v1{};
      Print(prefix + ".v1.result", static_cast<int>(nvmlDeviceGetMemoryInfo(device, &v1)));
      Print(prefix + ".v1.total", v1.total);
      Print(prefix + ".v1.used", v1.used);
      Print(prefix + ".v1.free", v1.free);
      nvmlMemory_v2_t v2{};
      v2.version = nvmlMemory_v2;
      Print(prefix + ".v2.result", static_cast<int>(nvmlDeviceGetMemoryInfo_v2(device, &v2)));
      Print(prefix + ".v2.total", v2.total);
      Print(prefix + ".v2.reserved", v2.reserved);
      Print(prefix + ".v2.used", v2.used);
      Print(prefix + ".v2.free", v2.free);
      nvmlProcessInfo_t processes[64];
      unsigned int listed = 64;
      std::uint64_t sum = 0, own = 0;
      if (nvmlDeviceGetComputeRunningProcesses_v3(device, &listed, processes) == NVML_SUCCESS) {
        for (unsigned int p = 0; p < listed; ++p) {
          sum += processes[p].usedGpuMemory;
          if (static_cast<pid_t>(processes[p].pid) == getpid()) own = processes[p].usedGpuMemory;
        }
      }
      Print(prefix + ".processes", listed);
      Print(prefix + ".process_sum", sum);
      Print(prefix + ".own", own);
    }
  }
  std::fflush(stdout);
  if (Arg("hold", 0) != 0) {
    WriteByte(kDoneFd);
    WaitForGo();
  }
  return 0;
}

int FailClosed() {
  Print("cuInit", static_cast<int>(cuInit(0)));
  int count = -1;
  Print("cuDeviceGetCount", static_cast<int>(cuDeviceGetCount(&count)));
  CUcontext context = nullptr;
  Print("cuDevicePrimaryCtxRetain", static_cast<int>(cuDevicePrimaryCtxRetain(&context, 0)));
  CUcontext created = nullptr;
  Print("cuCtxCreate", static_cast<int>(cuCtxCreate(&created, nullptr, 0, 0)));
  CUdeviceptr pointer = 0;
  Print("cuMemAlloc", static_cast<int>(cuMemAlloc_v2(&pointer, 1 << 20)));
  std::size_t free_bytes = 0, total = 0;
  Print("cuMemGetInfo", static_cast<int>(cuMemGetInfo_v2(&free_bytes, &total)));
  Print("nvmlInit_v2", static_cast<int>(nvmlInit_v2()));
  Print("nvmlInitWithFlags", static_cast<int>(nvmlInitWithFlags(0)));
  // Other routes to the driver's own cuInit: dlsym on the library and cuGetProcAddress.
  using InitFunction = CUresult (*)(unsigned int);
  void* library = dlopen("libcuda.so.1", RTLD_NOW);
  auto dlsym_init = library != nullptr ? reinterpret_cast<InitFunction>(dlsym(library, "cuInit")) : nullptr;
  Print("dlsym.cuInit", dlsym_init != nullptr ? static_cast<int>(dlsym_init(0)) : -1);
  void* function = nullptr;
  CUdriverProcAddressQueryResult status{};
  const CUresult proc = cuGetProcAddress_v2("cuInit", &function, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  Print("cuGetProcAddress", static_cast<int>(proc));
  Print("procaddress.cuInit", function != nullptr && proc == CUDA_SUCCESS
                                  ? static_cast<int>(reinterpret_cast<InitFunction>(function)(0))
                                  : -1);
  std::fflush(stdout);
  std::exit(42);  // an ordinary exit with the program's own code: the shim must not have ended the process
}

int Cycle() {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(Arg("timeout_ms", 10000));
  if (const CUresult r = cuInit(0); r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuInit: %d\n", r);
    return 4;
  }
  CUcontext context = nullptr;
  std::uint64_t ctx_retries = 0, alloc_retries = 0;
  CUresult r = RetainContext(static_cast<int>(Arg("device", 0)), deadline, context, &ctx_retries);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "context: %d after %" PRIu64 " retries\n", r, ctx_retries);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? 3 : 4;
  }
  CUdeviceptr pointer = 0;
  for (;;) {
    r = cuMemAlloc_v2(&pointer, Arg("bytes", 1 << 20));
    if (r != CUDA_ERROR_OUT_OF_MEMORY || Clock::now() >= deadline) break;
    ++alloc_retries;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuMemAlloc_v2: %d after %" PRIu64 " retries\n", r, alloc_retries);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? 3 : 4;
  }
  if ((r = cuMemFree_v2(pointer)) != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuMemFree_v2: %d\n", r);
    return 4;
  }
  Print("cycle", std::string("ok"));
  Print("ctx.retries", ctx_retries);
  Print("alloc.retries", alloc_retries);
  Print("cycle.ms", static_cast<std::uint64_t>(
                        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()));
  return Clock::now() <= deadline ? 0 : 3;
}

// Holds a context and `bytes` of memory, says so on kStartedFd, and waits to be killed (or for its go pipe to close).
int Hold() {
  if (cuInit(0) != CUDA_SUCCESS) return 4;
  CUcontext context = nullptr;
  if (RetainContext(static_cast<int>(Arg("device", 0)), Clock::now(), context) != CUDA_SUCCESS) return 4;
  CUdeviceptr held = 0;
  if (cuMemAlloc_v2(&held, Arg("bytes", 256 << 20)) != CUDA_SUCCESS) return 3;
  WriteByte(kStartedFd);
  WaitForGo();
  return 0;
}

int Fill() {
  if (cuInit(0) != CUDA_SUCCESS) return 4;
  CUcontext context = nullptr;
  const CUresult r = RetainContext(static_cast<int>(Arg("device", 0)), Clock::now(), context);
  Print("ctx.result", static_cast<int>(r));
  if (r != CUDA_SUCCESS) return 4;
  std::size_t free_bytes = 0, total = 0;
  Print("cu.result", static_cast<int>(cuMemGetInfo_v2(&free_bytes, &total)));
  Print("cu.free", free_bytes);
  Print("cu.total", total);
  CUdeviceptr all = 0, more = 0;
  Print("fill.result", static_cast<int>(cuMemAlloc_v2(&all, free_bytes)));
  std::size_t free_after = 0;
  cuMemGetInfo_v2(&free_after, &total);
  Print("cu.free_after", free_after);
  Print("over.result", static_cast<int>(cuMemAlloc_v2(&more, 512)));
  if (all != 0) Print("free.result", static_cast<int>(cuMemFree_v2(all)));
  return 0;
}

struct ChurnCounts {
  std::atomic<std::uint64_t> ok{0}, oom{0}, errors{0}, frees{0}, max_call_us{0};
};

void ChurnThread(int index, CUcontext context, std::atomic<bool>& stop, ChurnCounts& counts) {
  if (cuCtxSetCurrent(context) != CUDA_SUCCESS) {
    counts.errors.fetch_add(1);
    return;
  }
  std::uint64_t rng = Arg("seed", 1) * 1000003 + static_cast<std::uint64_t>(index);
  const std::uint64_t rounds = Arg("rounds", 1000);
  const std::uint64_t low = Arg("min", 1 << 20), high = std::max(Arg("max", 64 << 20), low);
  const std::size_t hold = static_cast<std::size_t>(Arg("hold", 2));
  const bool until_stop = Arg("until_stop", 0) != 0;
  std::vector<CUdeviceptr> held;
  auto timed = [&](auto&& call) {
    const auto start = Clock::now();
    const CUresult r = call();
    const auto us =
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count());
    std::uint64_t seen = counts.max_call_us.load();
    while (us > seen && !counts.max_call_us.compare_exchange_weak(seen, us)) {
    }
    return r;
  };
  for (std::uint64_t round = 0; until_stop ? !stop.load(std::memory_order_relaxed) : round < rounds; ++round) {
    const std::uint64_t draw = SplitMix(rng);
    if (held.size() < hold && (held.empty() || (draw & 1) != 0)) {
      const std::uint64_t bytes = low + (draw >> 1) % (high - low + 1);
      CUdeviceptr pointer = 0;
      const CUresult r = timed([&] { return cuMemAlloc_v2(&pointer, bytes); });
      if (r == CUDA_SUCCESS) {
        held.push_back(pointer);
        counts.ok.fetch_add(1);
      } else if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        counts.oom.fetch_add(1);
      } else {
        if (counts.errors.fetch_add(1) == 0) std::fprintf(stderr, "cuMemAlloc_v2(%" PRIu64 "): %d\n", bytes, r);
      }
    } else {
      const std::size_t victim = static_cast<std::size_t>((draw >> 1) % held.size());
      const CUdeviceptr pointer = held[victim];
      held[victim] = held.back();
      held.pop_back();
      const CUresult r = timed([&] { return cuMemFree_v2(pointer); });
      if (r == CUDA_SUCCESS) {
        counts.frees.fetch_add(1);
      } else if (counts.errors.fetch_add(1) == 0) {
        std::fprintf(stderr, "cuMemFree_v2: %d\n", r);
      }
    }
  }
  for (CUdeviceptr pointer : held) {
    if (cuMemFree_v2(pointer) != CUDA_SUCCESS) counts.errors.fetch_add(1);
  }
}

int Churn() {
  const bool pipes = Arg("pipes", 0) != 0;
  if (const CUresult r = cuInit(0); r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuInit: %d\n", r);
    return 4;
  }
  CUcontext context = nullptr;
  std::uint64_t ctx_retries = 0;
  const CUresult r =
      RetainContext(static_cast<int>(Arg("device", 0)), Clock::now() + std::chrono::seconds(10), context, &ctx_retries);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "context: %d after %" PRIu64 " retries\n", r, ctx_retries);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? 3 : 4;
  }
  std::atomic<bool> stop{false};
  ChurnCounts counts;
  std::vector<std::thread> threads;
  const int thread_count = static_cast<int>(std::max<std::uint64_t>(Arg("threads", 1), 1));
  const bool barrier = Arg("barrier", 0) != 0;
  if (barrier) {
    // Every process of the race has its context: they start their rounds together when the parent says so.
    WriteByte(kStartedFd);
    WaitForEof(kBeginFd);
  }
  for (int i = 0; i < thread_count; ++i)
    threads.emplace_back(ChurnThread, i, context, std::ref(stop), std::ref(counts));
  if (pipes && !barrier) WriteByte(kStartedFd);
  std::thread stopper;
  if (Arg("until_stop", 0) != 0) {
    stopper = std::thread([&] {
      WaitForGo();
      stop.store(true);
    });
  }
  for (std::thread& t : threads) t.join();
  Print("ok", counts.ok.load());
  Print("oom", counts.oom.load());
  Print("frees", counts.frees.load());
  Print("errors", counts.errors.load());
  Print("max_call_us", counts.max_call_us.load());
  Print("ctx.retries", ctx_retries);
  std::fflush(stdout);
  if (pipes) WriteByte(kDoneFd);
  if (stopper.joinable()) stopper.join();
  if (Arg("wait_go", 0) != 0) WaitForGo();
  return counts.errors.load() == 0 ? 0 : 4;
}

int Observe() {
  const std::uint64_t limit = Arg("limit", 0);
  if (nvmlInit_v2() != NVML_SUCCESS) return 4;
  nvmlDevice_t device = nullptr;
  if (nvmlDeviceGetHandleByIndex_v2(static_cast<unsigned int>(Arg("device", 0)), &device) != NVML_SUCCESS) return 4;
  WriteByte(kStartedFd);
  std::uint64_t polls = 0, max_used = 0, max_sum = 0, violations = 0, errors = 0, last_used = 0;
  std::string first_violation;
  while (!GoClosed()) {
    nvmlMemory_v2_t v2{};
    v2.version = nvmlMemory_v2;
    if (nvmlDeviceGetMemoryInfo_v2(device, &v2) != NVML_SUCCESS) {
      ++errors;
      continue;
    }
    nvmlProcessInfo_t processes[64];
    unsigned int listed = 64;
    std::uint64_t sum = 0;
    if (nvmlDeviceGetComputeRunningProcesses_v3(device, &listed, processes) == NVML_SUCCESS) {
      for (unsigned int p = 0; p < listed; ++p) sum += processes[p].usedGpuMemory;
    } else {
      ++errors;
    }
    ++polls;
    last_used = v2.used;
    max_used = std::max<std::uint64_t>(max_used, v2.used);
    max_sum = std::max(max_sum, sum);
    if (v2.used > limit || sum > limit) {
      if (violations++ == 0) {
        first_violation = "poll " + std::to_string(polls) + ": used " + std::to_string(v2.used) + ", process sum " +
                          std::to_string(sum) + ", " + std::to_string(listed) + " processes";
      }
    }
  }
  Print("polls", polls);
  Print("max_used", max_used);
  Print("max_process_sum", max_sum);
  Print("violations", violations);
  Print("first_violation", first_violation);
  Print("last_used", last_used);
  Print("errors", errors);
  return 0;
}

}  // namespace

// cuInit, device 0's primary context current, vgpu-tenant's spin kernel loaded; false (said on stderr) if not.
bool SetUpSpinKernel(CUcontext& context, CUfunction& function) {
  if (const CUresult r = cuInit(0); r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuInit: %d\n", r);
    return false;
  }
  CUmodule module = nullptr;
  CUresult r = RetainContext(0, Clock::now() + std::chrono::seconds(10), context);
  if (r == CUDA_SUCCESS) r = cuModuleLoadData(&module, vgpu::tenant::kSpinPtx);
  if (r == CUDA_SUCCESS) r = cuModuleGetFunction(&function, module, "vgpu_spin");
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "setup: %d\n", r);
    return false;
  }
  return true;
}

// What the `launch` command's threads share: their arguments and what they count.
struct LaunchRun {
  CUcontext context = nullptr;
  CUfunction function = nullptr;
  std::uint64_t short_ns = 0, long_ns = 0, long_every = 1, sync_every = 0, pause_ns = 0;
  bool own_streams = false;
  Clock::time_point deadline;
  std::atomic<std::uint64_t> launched{0}, busy_ns{0};
  std::atomic<int> failure{CUDA_SUCCESS};
  std::mutex loops_mutex;
  std::vector<std::uint64_t> loops_ns;  // from one synchronize's return to the next, every thread's
};

// `launch`'s stalls (stall_us=): a thread held off its CPU for a while, wherever it is, as a loaded host's scheduler
// holds a preempted thread. The stalled thread sleeps in this handler (nanosleep is async-signal-safe).
std::atomic<std::uint64_t> g_stall_ns{0};
void StallHere(int) {
  const std::uint64_t ns = g_stall_ns.load(std::memory_order_relaxed);
  timespec stall{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  while (nanosleep(&stall, &stall) != 0 && errno == EINTR) {
  }
}

// Every `every` until the deadline, one of `threads` in turn is stalled (SIGUSR1: StallHere).
void StallThreads(const LaunchRun& run, std::vector<std::thread>& threads, std::chrono::microseconds every) {
  for (std::size_t next = 0; Clock::now() < run.deadline; next = (next + 1) % threads.size()) {
    std::this_thread::sleep_for(every);
    (void)pthread_kill(threads[next].native_handle(), SIGUSR1);
  }
}

// One thread of `launch`: kernels of short_ns, long_ns one in long_every (drawn from the thread's own sequence), until
// the deadline; with sync_every, a context synchronize after every sync_every launches, each loop's time kept.
void LaunchThread(LaunchRun& run, std::uint64_t t) {
  if (const CUresult set = cuCtxSetCurrent(run.context); set != CUDA_SUCCESS) {
    run.failure = set;
    return;
  }
  CUstream stream = nullptr;
  if (run.own_streams) {
    if (const CUresult made = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING); made != CUDA_SUCCESS) {
      run.failure = made;
      return;
    }
  }
  std::uint64_t draw = 0x9e3779b97f4a7c15ull * (t + 1);
  std::uint64_t since_sync = 0;
  auto loop_start = Clock::now();
  while (Clock::now() < run.deadline && run.failure.load() == CUDA_SUCCESS) {
    draw ^= draw << 13;
    draw ^= draw >> 7;
    draw ^= draw << 17;
    unsigned long long ns = draw % run.long_every == 0 ? run.long_ns : run.short_ns;
    void* params[] = {&ns};
    if (const CUresult launch = cuLaunchKernel(run.function, 1, 1, 1, 32, 1, 1, 0, stream, params, nullptr);
        launch != CUDA_SUCCESS) {
      run.failure = launch;
      return;
    }
    ++run.launched;
    run.busy_ns += ns;
    if (run.sync_every == 0 || ++since_sync < run.sync_every) continue;
    since_sync = 0;
    if (const CUresult synced = cuCtxSynchronize(); synced != CUDA_SUCCESS) {
      run.failure = synced;
      return;
    }
    const auto now = Clock::now();
    {
      const std::lock_guard<std::mutex> guard(run.loops_mutex);
      run.loops_ns.push_back(
          static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now - loop_start).count()));
    }
    loop_start = now;
    if (run.pause_ns != 0) {
      const std::uint64_t pause_ns = run.pause_ns / 2 + (draw >> 11) % (run.pause_ns + 1);
      std::this_thread::sleep_for(std::chrono::nanoseconds(pause_ns));
      loop_start = Clock::now();
    }
  }
  if (stream != nullptr && cuStreamSynchronize(stream) == CUDA_SUCCESS) cuStreamDestroy(stream);
}

// Threads launching into one stream (the legacy default one) at once, or each into a stream of its own (own_streams=1):
// the shim's launch path under concurrency.
int Launch() {
  LaunchRun run;
  if (!SetUpSpinKernel(run.context, run.function)) return 4;
  run.short_ns = Arg("short_us", 30) * 1000;
  run.long_ns = Arg("long_us", 2000) * 1000;
  run.long_every = std::max<std::uint64_t>(Arg("long_every", 8), 1);
  run.sync_every = Arg("sync_every", 0);
  run.pause_ns = Arg("pause_us", 0) * 1000;
  run.own_streams = Arg("own_streams", 0) != 0;
  const auto start = Clock::now();
  run.deadline = start + std::chrono::milliseconds(Arg("seconds", 2) * 1000);
  std::vector<std::thread> threads;
  g_stall_ns = Arg("stall_us", 0) * 1000;
  if (g_stall_ns != 0) {
    struct sigaction stall {};
    stall.sa_handler = &StallHere;
    sigemptyset(&stall.sa_mask);
    (void)sigaction(SIGUSR1, &stall, nullptr);
  }
  for (std::uint64_t t = 0; t < Arg("threads", 4); ++t) threads.emplace_back([&run, t] { LaunchThread(run, t); });
  if (g_stall_ns != 0) StallThreads(run, threads, std::chrono::microseconds(Arg("stall_every_us", 1000)));
  for (auto& thread : threads) thread.join();
  CUresult r = CUDA_SUCCESS;
  if (run.failure.load() != CUDA_SUCCESS || (r = cuCtxSynchronize()) != CUDA_SUCCESS) {
    std::fprintf(stderr, "launch: %d\n", run.failure.load() != CUDA_SUCCESS ? run.failure.load() : static_cast<int>(r));
    return 4;
  }
  Print("launched", run.launched.load());
  Print("busy_ns", run.busy_ns.load());
  if (run.sync_every != 0) {
    std::vector<std::uint64_t>& loops = run.loops_ns;
    std::sort(loops.begin(), loops.end());
    Print("sync_loops", loops.size());
    Print("sync_loop_p90_ns", loops.empty() ? 0 : loops[loops.size() * 9 / 10]);
    Print("sync_loop_p99_ns", loops.empty() ? 0 : loops[loops.size() * 99 / 100]);
    Print("sync_loop_max_ns", loops.empty() ? 0 : loops.back());
  }
  Print("elapsed_ns",
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()));
  return 0;
}

// Stream captures begun through each of the driver's capture entry points (shim.Compute.CapturesBegunThroughEveryEntryPointAreSeenByLaunches).
// Per way: the begin's result, how many of three launches into the capturing stream succeeded and the error of one
// that did not, the end's result and the captured graph's node count. Then `after` launches into a stream no capture
// involves: their last result and how long they took.
int Capture() {
  CUcontext context = nullptr;
  CUfunction function = nullptr;
  if (!SetUpSpinKernel(context, function)) return 4;
  struct Way {
    std::string name;
    std::function<CUresult(CUstream)> begin;
    std::function<CUresult(CUstream, CUgraph*)> end;
  };
  using BeginV1 = CUresult (*)(CUstream);
  using BeginV2 = CUresult (*)(CUstream, CUstreamCaptureMode);
  using BeginToGraph =
      CUresult (*)(CUstream, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t, CUstreamCaptureMode);
  using End = CUresult (*)(CUstream, CUgraph*);
  // The older and per-thread entry points are not declared by cuda.h under their own names: found as exported.
  const auto find = [](const char* name) { return dlsym(RTLD_DEFAULT, name); };
  const auto end = reinterpret_cast<End>(find("cuStreamEndCapture"));
  const auto end_ptsz = reinterpret_cast<End>(find("cuStreamEndCapture_ptsz"));
  const auto to_graph = [&](const char* name) {
    return [begin = reinterpret_cast<BeginToGraph>(find(name))](CUstream stream) {
      CUgraph graph = nullptr;
      if (cuGraphCreate(&graph, 0) != CUDA_SUCCESS) return CUDA_ERROR_UNKNOWN;
      return begin(stream, graph, nullptr, nullptr, 0, CU_STREAM_CAPTURE_MODE_GLOBAL);
    };
  };
  const std::vector<Way> ways = {
      {"v1", [b = reinterpret_cast<BeginV1>(find("cuStreamBeginCapture"))](CUstream s) { return b(s); }, end},
      {"v1_ptsz", [b = reinterpret_cast<BeginV1>(find("cuStreamBeginCapture_ptsz"))](CUstream s) { return b(s); },
       end_ptsz},
      {"v2",
       [b = reinterpret_cast<BeginV2>(find("cuStreamBeginCapture_v2"))](CUstream s) {
         return b(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
       },
       end},
      {"v2_ptsz",
       [b = reinterpret_cast<BeginV2>(find("cuStreamBeginCapture_v2_ptsz"))](CUstream s) {
         return b(s, CU_STREAM_CAPTURE_MODE_RELAXED);
       },
       end_ptsz},
      {"to_graph", to_graph("cuStreamBeginCaptureToGraph"), end},
      {"to_graph_ptsz", to_graph("cuStreamBeginCaptureToGraph_ptsz"), end_ptsz},
  };
  unsigned long long ns = 1'000'000;
  void* params[] = {&ns};
  for (const Way& way : ways) {
    CUstream stream = nullptr;
    if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return 4;
    const CUresult begun = way.begin(stream);
    Print(way.name + ".begin", static_cast<int>(begun));
    if (begun == CUDA_SUCCESS) {
      int succeeded = 0;
      CUresult error = CUDA_SUCCESS;
      for (int i = 0; i < 3; ++i) {
        const CUresult r = cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, params, nullptr);
        if (r == CUDA_SUCCESS)
          ++succeeded;
        else
          error = r;
      }
      Print(way.name + ".launched", succeeded);
      Print(way.name + ".launch_error", static_cast<int>(error));
      CUgraph graph = nullptr;
      Print(way.name + ".end", static_cast<int>(way.end(stream, &graph)));
      std::size_t nodes = 0;
      if (graph != nullptr && cuGraphGetNodes(graph, nullptr, &nodes) == CUDA_SUCCESS)
        Print(way.name + ".nodes", nodes);
      if (graph != nullptr) cuGraphDestroy(graph);
    }
    cuStreamDestroy(stream);
  }
  CUstream plain = nullptr;
  if (cuStreamCreate(&plain, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return 4;
  const auto start = Clock::now();
  CUresult outside = CUDA_SUCCESS;
  for (std::uint64_t i = 0; i < Arg("after", 20); ++i) {
    outside = cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, plain, params, nullptr);
  }
  Print("outside.result", static_cast<int>(outside));
  Print("outside_ns",
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()));
  return 0;
}

// A call that may throw out of the shim (the shim before it caught its own exceptions): `threw` says it did.
template <typename Call>
CUresult Guarded(Call&& call, bool& threw) {
  try {
    return call();
  } catch (...) {
    threw = true;
    return CUDA_ERROR_UNKNOWN;
  }
}

// This process's memory on device 0 as the host's NVML lists it (the real NVML view, not the shim's).
std::uint64_t DriverOwnBytes() {
  nvmlDevice_t device = nullptr;
  if (nvmlInit_v2() != NVML_SUCCESS || nvmlDeviceGetHandleByIndex_v2(0, &device) != NVML_SUCCESS) return 0;
  nvmlProcessInfo_t processes[64];
  unsigned int listed = 64;
  if (nvmlDeviceGetComputeRunningProcesses_v3(device, &listed, processes) != NVML_SUCCESS) return 0;
  for (unsigned int p = 0; p < listed && p < 64; ++p) {
    if (static_cast<pid_t>(processes[p].pid) == getpid()) return processes[p].usedGpuMemory;
  }
  return 0;
}

int HostOomStart() {
  using vgpu::shimtest::ArmHostOom;
  if (!ArmHostOom(100, 1)) {
    std::fprintf(stderr, "hostoom_start: libvgpu.so is not loaded\n");
    return 2;
  }
  bool threw = false;
  const CUresult first = Guarded([] { return cuInit(0); }, threw);
  vgpu::shimtest::DisarmHostOom();
  Print("start.threw", static_cast<int>(threw));
  Print("start.result", static_cast<int>(first));
  Print("start.injected", vgpu::shimtest::HostOomInjected());
  Print("init", static_cast<int>(cuInit(0)));
  CUcontext context = nullptr;
  const CUresult ctx = RetainContext(0, Clock::now(), context);
  Print("ctx", static_cast<int>(ctx));
  if (ctx != CUDA_SUCCESS) return 4;
  const std::uint64_t bytes = Arg("limit", 0) / 2 + (1u << 20);  // one fits beside the context, two do not
  CUdeviceptr a = 0, b = 0;
  Print("alloc1", static_cast<int>(cuMemAlloc_v2(&a, bytes)));
  Print("alloc2", static_cast<int>(cuMemAlloc_v2(&b, bytes)));
  return 0;
}

// The process-wide state a library inside the process must not change.
struct ProcessState {
  mode_t umask_bits = 0;
  struct sigaction actions[NSIG] = {};
  sigset_t blocked{};
  rlimit limits[RLIM_NLIMITS] = {};
  std::string cwd;
  std::vector<std::string> environment;
};

ProcessState ReadProcessState() {
  ProcessState state;
  state.umask_bits = umask(022);
  umask(state.umask_bits);
  for (int signal_number = 1; signal_number < NSIG; ++signal_number)
    sigaction(signal_number, nullptr, &state.actions[signal_number]);
  pthread_sigmask(SIG_SETMASK, nullptr, &state.blocked);
  for (int resource = 0; resource < RLIM_NLIMITS; ++resource)
    getrlimit(static_cast<__rlimit_resource>(resource), &state.limits[resource]);
  char buffer[4096];
  if (getcwd(buffer, sizeof buffer) != nullptr) state.cwd = buffer;
  for (char** entry = environ; *entry != nullptr; ++entry) state.environment.emplace_back(*entry);
  return state;
}

// Signal sets compared signal by signal (glibc's sigaction leaves the bytes past the kernel's mask undefined).
bool SameSignals(const sigset_t& a, const sigset_t& b) {
  for (int signal_number = 1; signal_number < NSIG; ++signal_number) {
    if (sigismember(&a, signal_number) != sigismember(&b, signal_number)) return false;
  }
  return true;
}

std::vector<std::string> Differences(const ProcessState& before, const ProcessState& after) {
  std::vector<std::string> changed;
  if (before.umask_bits != after.umask_bits) changed.push_back("umask");
  for (int signal_number = 1; signal_number < NSIG; ++signal_number) {
    const struct sigaction& a = before.actions[signal_number];
    const struct sigaction& b = after.actions[signal_number];
    if (reinterpret_cast<void*>(a.sa_handler) != reinterpret_cast<void*>(b.sa_handler) || a.sa_flags != b.sa_flags ||
        !SameSignals(a.sa_mask, b.sa_mask)) {
      changed.push_back("signal " + std::to_string(signal_number));
    }
  }
  if (!SameSignals(before.blocked, after.blocked)) changed.push_back("signal mask");
  for (int resource = 0; resource < RLIM_NLIMITS; ++resource) {
    if (before.limits[resource].rlim_cur != after.limits[resource].rlim_cur ||
        before.limits[resource].rlim_max != after.limits[resource].rlim_max) {
      changed.push_back("rlimit " + std::to_string(resource));
    }
  }
  if (before.cwd != after.cwd) changed.push_back("working folder");
  if (before.environment != after.environment) changed.push_back("environment");
  return changed;
}

int Process() {
  const ProcessState before = ReadProcessState();
  // A round of everything the shim hooks: start-up, memory (one allocation past the limit), launches, NVML.
  const CUresult init = cuInit(0);
  Print("init", static_cast<int>(init));
  CUcontext context = nullptr;
  if (init == CUDA_SUCCESS && RetainContext(0, Clock::now(), context) == CUDA_SUCCESS) {
    CUdeviceptr small = 0, past = 0;
    Print("alloc", static_cast<int>(cuMemAlloc_v2(&small, 1 << 20)));
    Print("alloc_past_limit", static_cast<int>(cuMemAlloc_v2(&past, Arg("limit", 1u << 30) + (1u << 20))));
    cuMemFree_v2(small);
    CUmodule module = nullptr;
    CUfunction function = nullptr;
    if (cuModuleLoadData(&module, vgpu::tenant::kSpinPtx) == CUDA_SUCCESS &&
        cuModuleGetFunction(&function, module, "vgpu_spin") == CUDA_SUCCESS) {
      unsigned long long ns = 50'000;
      void* params[] = {&ns};
      std::uint64_t launched = 0;
      for (int i = 0; i < 100; ++i)
        launched += cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr) == CUDA_SUCCESS;
      Print("launched", launched);
    }
    cuCtxSynchronize();
  }
  if (nvmlInit_v2() == NVML_SUCCESS) {
    nvmlDevice_t device = nullptr;
    nvmlMemory_t memory{};
    if (nvmlDeviceGetHandleByIndex_v2(0, &device) == NVML_SUCCESS) nvmlDeviceGetMemoryInfo(device, &memory);
  }
  const std::vector<std::string> changed = Differences(before, ReadProcessState());
  Print("changed", static_cast<std::uint64_t>(changed.size()));
  for (const auto& what : changed) Print("changed.what", what);
  Print("reached_end", 1);
  return 0;
}

// What one churn thread holds: device memory of each kind it allocates.
struct Held {
  std::vector<CUdeviceptr> plain, pooled;
  std::vector<CUarray> arrays;
};

int Mixed() {
  CUcontext context = nullptr;
  CUfunction function = nullptr;
  if (!SetUpSpinKernel(context, function)) return 4;
  const std::uint64_t threads_n = Arg("threads", 4), rounds = Arg("rounds", 2000);
  std::vector<CUstream> streams(threads_n);
  for (auto& stream : streams) cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
  // The pool used once on each stream before the baseline: a real driver keeps ~2 MiB for a pool that has served
  // allocations on several streams, after every block is freed and the pool trimmed (H100, driver 580).
  CUmemoryPool pool = nullptr;
  if (cuDeviceGetMemPool(&pool, 0) == CUDA_SUCCESS) {
    for (CUstream stream : streams) {
      CUdeviceptr warm = 0;
      if (cuMemAllocAsync(&warm, 1 << 20, stream) == CUDA_SUCCESS) cuMemFreeAsync(warm, stream);
    }
    cuCtxSynchronize();
    cuMemPoolTrimTo(pool, 0);
  }
  // The kernel launched once before the baseline too: its module loads at the first launch and stays (a driver's
  // own memory, counted by the shim: docs/shim.md, "Memory the driver takes by itself").
  std::uint64_t no_time = 0;
  void* warm_params[] = {&no_time};
  cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, nullptr, warm_params, nullptr);
  cuCtxSynchronize();
  std::size_t free_bytes = 0, total = 0;
  cuMemGetInfo_v2(&free_bytes, &total);
  const std::uint64_t used_before = total - free_bytes, own_before = DriverOwnBytes();
  const std::uint64_t max_bytes = std::max<std::uint64_t>(Arg("limit", 1u << 30) / (4 * threads_n), 1 << 20);
  // Which of the actions (0 alloc, 1 pool alloc, 2 array, 3-5 launch, 6 free, 7 pool free, 8 VMM round trip, 9 pitch
  // alloc, a context round trip, b NVML memory view) run: all by default.
  const std::string actions = Has("actions") ? g_args["actions"] : "0123456789ab";
  std::vector<Held> held(threads_n);
  std::atomic<std::uint64_t> oom{0}, ok{0}, unexpected{0}, threw{0};
  std::mutex unexpected_mutex;
  std::vector<std::string> unexpected_text;
  const auto check = [&](const char* what, CUresult result, bool did_throw) {
    if (did_throw) ++threw;
    if (result == CUDA_SUCCESS)
      ++ok;
    else if (result == CUDA_ERROR_OUT_OF_MEMORY)
      ++oom;
    else {
      ++unexpected;
      std::lock_guard<std::mutex> guard(unexpected_mutex);
      if (unexpected_text.size() < 20) unexpected_text.push_back(std::string(what) + "=" + std::to_string(result));
    }
    return result == CUDA_SUCCESS;
  };
  if (!vgpu::shimtest::ArmHostOom(static_cast<unsigned>(Arg("oom_percent", 0)), Arg("seed", 1))) return 2;
  std::vector<std::thread> threads;
  for (std::uint64_t t = 0; t < threads_n; ++t) {
    threads.emplace_back([&, t] {
      cuCtxSetCurrent(context);
      std::uint64_t draw = Arg("seed", 1) * 0x9e3779b97f4a7c15ull + t;
      Held& mine = held[t];
      for (std::uint64_t round = 0; round < rounds; ++round) {
        const std::uint64_t action = SplitMix(draw) % 12;
        const std::uint64_t bytes = 1 + SplitMix(draw) % max_bytes;
        if (actions.find("0123456789ab"[action]) == std::string::npos) continue;
        bool did_throw = false;
        if (action == 0) {
          CUdeviceptr pointer = 0;
          if (check("cuMemAlloc_v2", Guarded([&] { return cuMemAlloc_v2(&pointer, bytes); }, did_throw), did_throw)) {
            mine.plain.push_back(pointer);
          }
        } else if (action == 1) {
          CUdeviceptr pointer = 0;
          if (check("cuMemAllocAsync", Guarded([&] { return cuMemAllocAsync(&pointer, bytes, streams[t]); }, did_throw),
                    did_throw)) {
            mine.pooled.push_back(pointer);
          }
        } else if (action == 2) {
          CUDA_ARRAY_DESCRIPTOR desc{};
          desc.Width = 1 + bytes % 4096;
          desc.Height = 64;
          desc.Format = CU_AD_FORMAT_FLOAT;
          desc.NumChannels = 1;
          CUarray array = nullptr;
          if (check("cuArrayCreate_v2", Guarded([&] { return cuArrayCreate_v2(&array, &desc); }, did_throw),
                    did_throw)) {
            mine.arrays.push_back(array);
          }
        } else if (action <= 5) {
          unsigned long long ns = 20'000;
          void* params[] = {&ns};
          // On the thread's own stream, or (one in three) the legacy default stream the threads share.
          CUstream stream = action == 5 ? nullptr : streams[t];
          check("cuLaunchKernel",
                Guarded([&] { return cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, params, nullptr); },
                        did_throw),
                did_throw);
        } else if (action == 6 && !mine.plain.empty()) {
          const CUdeviceptr pointer = mine.plain.back();
          mine.plain.pop_back();
          check("cuMemFree_v2", Guarded([&] { return cuMemFree_v2(pointer); }, did_throw), did_throw);
        } else if (action == 7 && !mine.pooled.empty()) {
          const CUdeviceptr pointer = mine.pooled.back();
          mine.pooled.pop_back();
          check("cuMemFreeAsync", Guarded([&] { return cuMemFreeAsync(pointer, streams[t]); }, did_throw), did_throw);
        } else if (action == 8) {
          // VMM, one round trip: physical memory created, mapped into reserved addresses, unmapped, released.
          CUmemAllocationProp prop{};
          prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
          prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
          prop.location.id = 0;
          std::size_t granularity = 0;
          if (cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
              granularity == 0) {
            continue;
          }
          const std::size_t size = (bytes + granularity - 1) / granularity * granularity;
          CUmemGenericAllocationHandle handle = 0;
          if (check("cuMemCreate", Guarded([&] { return cuMemCreate(&handle, size, &prop, 0); }, did_throw),
                    did_throw)) {
            CUdeviceptr address = 0;
            if (cuMemAddressReserve(&address, size, 0, 0, 0) == CUDA_SUCCESS) {
              if (check("cuMemMap", Guarded([&] { return cuMemMap(address, size, 0, handle, 0); }, did_throw),
                        did_throw)) {
                check("cuMemUnmap", Guarded([&] { return cuMemUnmap(address, size); }, did_throw), did_throw);
              }
              cuMemAddressFree(address, size);
            }
            check("cuMemRelease", Guarded([&] { return cuMemRelease(handle); }, did_throw), did_throw);
          }
        } else if (action == 10) {
          // An explicit context, one round trip (created current on this thread; destroying it pops it).
          CUcontext created = nullptr;
          if (check("cuCtxCreate", Guarded([&] { return cuCtxCreate(&created, nullptr, 0, 0); }, did_throw),
                    did_throw)) {
            check("cuCtxDestroy", Guarded([&] { return cuCtxDestroy(created); }, did_throw), did_throw);
            cuCtxSetCurrent(context);
          }
        } else if (action == 11) {
          // NVML's views through the shim (they change nothing, and must not throw either).
          nvmlDevice_t device = nullptr;
          if (nvmlInit_v2() == NVML_SUCCESS && nvmlDeviceGetHandleByIndex_v2(0, &device) == NVML_SUCCESS) {
            nvmlMemory_t memory{};
            const nvmlReturn_t r = nvmlDeviceGetMemoryInfo(device, &memory);
            check("nvmlDeviceGetMemoryInfo",
                  r == NVML_SUCCESS        ? CUDA_SUCCESS
                  : r == NVML_ERROR_MEMORY ? CUDA_ERROR_OUT_OF_MEMORY
                                           : CUDA_ERROR_UNKNOWN,
                  false);
          }
        } else if (action == 9) {
          CUdeviceptr pointer = 0;
          std::size_t pitch = 0;
          if (check(
                  "cuMemAllocPitch_v2",
                  Guarded(
                      [&] { return cuMemAllocPitch_v2(&pointer, &pitch, 1 + bytes % 8192, 1 + bytes / 8192 % 256, 4); },
                      did_throw),
                  did_throw)) {
            mine.plain.push_back(pointer);
          }
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  vgpu::shimtest::DisarmHostOom();
  // Everything back, with nothing failing any more.
  std::uint64_t cleanup_failures = 0;
  for (std::uint64_t t = 0; t < threads_n; ++t) {
    for (CUdeviceptr pointer : held[t].plain) cleanup_failures += cuMemFree_v2(pointer) != CUDA_SUCCESS;
    for (CUdeviceptr pointer : held[t].pooled) cleanup_failures += cuMemFreeAsync(pointer, streams[t]) != CUDA_SUCCESS;
    for (CUarray array : held[t].arrays) cleanup_failures += cuArrayDestroy(array) != CUDA_SUCCESS;
    cleanup_failures += cuStreamSynchronize(streams[t]) != CUDA_SUCCESS;
  }
  cleanup_failures += cuCtxSynchronize() != CUDA_SUCCESS;
  if (pool != nullptr) cleanup_failures += cuMemPoolTrimTo(pool, 0) != CUDA_SUCCESS;
  cuuint64_t reserved_after = 0;
  if (pool != nullptr) cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved_after);
  cuMemGetInfo_v2(&free_bytes, &total);
  Print("ok", ok.load());
  Print("oom", oom.load());
  Print("threw", threw.load());
  Print("unexpected", unexpected.load());
  for (const auto& text : unexpected_text) Print("unexpected.call", text);
  Print("injected", vgpu::shimtest::HostOomInjected());
  Print("seen", vgpu::shimtest::HostOomSeen());
  Print("cleanup_failures", cleanup_failures);
  Print("used_before", used_before);
  Print("used_after", static_cast<std::uint64_t>(total - free_bytes));
  Print("own_before", own_before);
  Print("own_after", DriverOwnBytes());
  Print("pool_reserved_after", static_cast<std::uint64_t>(reserved_after));
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: shim_worker views|failclosed|cycle|fill|churn|observe|launch|hostoom_start|mixed|process "
                 "[key=value ...]\n");
    return 2;
  }
  for (int i = 2; i < argc; ++i) {
    const char* equals = std::strchr(argv[i], '=');
    if (equals == nullptr) {
      std::fprintf(stderr, "shim_worker: '%s' is not key=value\n", argv[i]);
      return 2;
    }
    g_args[std::string(argv[i], static_cast<std::size_t>(equals - argv[i]))] = equals + 1;
  }
  const std::string command = argv[1];
  int status = 2;
  if (command == "views")
    status = Views();
  else if (command == "failclosed")
    status = FailClosed();
  else if (command == "cycle")
    status = Cycle();
  else if (command == "fill")
    status = Fill();
  else if (command == "hold")
    status = Hold();
  else if (command == "churn")
    status = Churn();
  else if (command == "observe")
    status = Observe();
  else if (command == "launch")
    status = Launch();
  else if (command == "hostoom_start")
    status = HostOomStart();
  else if (command == "mixed")
    status = Mixed();
  else if (command == "process")
    status = Process();
  else if (command == "capture")
    status = Capture();
  else
    std::fprintf(stderr, "shim_worker: unknown command %s\n", command.c_str());
  std::fflush(stdout);
  return status;
}
