// Launches vgpu_spin through the CUDA Driver API, closed loop or at a fixed rate, and measures the run.
#include "workload.h"
#include "vgpu/base/clock.h"
#include "vgpu/base/random.h"

#include <poll.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace vgpu::tenant {
namespace {

void Check(CUresult result, const char* call) {
  if (result != CUDA_SUCCESS) {
    throw CudaFailure{result, call};
  }
}

// Names the function once: it is both called and reported. Write the exported,
// versioned symbol (cuMemAlloc_v2, not the cuda.h macro cuMemAlloc), since the
// report must name what a shim or fakecuda's fault rules see.
#define VGPU_TENANT_CUDA(function, ...) Check(function(__VA_ARGS__), #function)

// Owns one driver object and gives it back exactly once.
template <typename Handle>
class DriverObject {
 public:
  using ReleaseFunction = CUresult (*)(Handle);

  DriverObject() = default;
  DriverObject(Handle handle, ReleaseFunction release, const char* release_name)
      : handle_(handle), release_(release), release_name_(release_name), held_(true) {}
  DriverObject(const DriverObject&) = delete;
  DriverObject& operator=(const DriverObject&) = delete;
  DriverObject(DriverObject&& other) noexcept
      : handle_(other.handle_),
        release_(other.release_),
        release_name_(other.release_name_),
        held_(std::exchange(other.held_, false)) {}
  DriverObject& operator=(DriverObject&& other) noexcept {
    if (this != &other) {
      Abandon();
      handle_ = other.handle_;
      release_ = other.release_;
      release_name_ = other.release_name_;
      held_ = std::exchange(other.held_, false);
    }
    return *this;
  }
  ~DriverObject() { Abandon(); }

  Handle get() const { return handle_; }

  // The normal end: a failure to release is a failure of the run, so it is
  // reported rather than assumed away.
  void Release() {
    if (held_) {
      held_ = false;
      Check(release_(handle_), release_name_);
    }
  }

 private:
  // Unwinding after a failure: that first failure is what gets reported, and
  // a second one while tearing down (a sticky launch error, say) adds nothing.
  void Abandon() noexcept {
    if (held_) {
      held_ = false;
      static_cast<void>(release_(handle_));
    }
  }

  Handle handle_{};
  ReleaseFunction release_ = nullptr;
  const char* release_name_ = "";
  bool held_ = false;
};

std::int64_t MonotonicNs() { return static_cast<std::int64_t>(vgpu::base::MonotonicNs()); }

// Sleeps to an absolute time, so that a schedule of deadlines never drifts
// however late each wake-up is.
void SleepUntilNs(std::int64_t deadline_ns) {
  const timespec deadline{static_cast<time_t>(deadline_ns / 1'000'000'000),
                          static_cast<long>(deadline_ns % 1'000'000'000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, nullptr) == EINTR) {
  }
}

// The kernels seen complete, over all streams: what --report-ms and the result line's busy_ns report. The mutex
// also guards every StreamQueue's ring positions, since the reporter thread credits completions too.
struct Completions {
  std::mutex mutex;
  std::uint64_t kernels = 0;
  std::uint64_t busy_ns = 0;
};

// One stream and a ring of events, one per kernel in flight: the oldest event
// is the one to wait for when the stream is full. The events are recorded
// after each kernel whether or not anyone reports; they are also how a kernel
// is seen complete (cuEventSynchronize when waiting for room, cuEventQuery
// from the reporter, cuStreamSynchronize at the end).
class StreamQueue {
 public:
  StreamQueue(std::uint32_t capacity, Completions* completions) : completions_(completions) {
    CUstream stream = nullptr;
    // Non-blocking: the tenant's streams never wait for work on the legacy default stream.
    VGPU_TENANT_CUDA(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
    stream_ = DriverObject<CUstream>(stream, cuStreamDestroy_v2, "cuStreamDestroy_v2");
    events_.reserve(capacity);
    busy_ns_.assign(capacity, 0);
    for (std::uint32_t index = 0; index < capacity; ++index) {
      CUevent event = nullptr;
      // Waiting follows the context's scheduling policy (spin while the host
      // has idle CPUs, else yield), as in the CUDA runtime and PyTorch, so a
      // synchronous loop leaves the GPU idle no longer than theirs would.
      // Timing off: the events only mark completion.
      VGPU_TENANT_CUDA(cuEventCreate, &event, CU_EVENT_DISABLE_TIMING);
      events_.emplace_back(event, cuEventDestroy_v2, "cuEventDestroy_v2");
    }
  }

  // Returns once fewer than depth (<= capacity) kernels are in flight on this stream.
  void WaitForRoom(std::uint64_t depth) {
    for (;;) {
      CUevent oldest = nullptr;
      std::uint64_t head = 0;
      {
        std::lock_guard<std::mutex> guard(completions_->mutex);
        if (tail_ - head_ < depth) {
          return;
        }
        head = head_;
        oldest = events_[head % events_.size()].get();
      }
      // Not re-recorded while waited on: only Launch records, and only past the in-flight range.
      VGPU_TENANT_CUDA(cuEventSynchronize, oldest);
      std::lock_guard<std::mutex> guard(completions_->mutex);
      if (head_ == head) {
        CreditOldest();  // else the reporter saw it complete first
      }
    }
  }

  // busy_ns: the kernel's duration, credited when it is seen complete. `parameters`: the kernel's arguments
  // (vgpu_spin's ns_per_block; vgpu_collective's, then its group and ranks).
  void Launch(CUfunction function, std::uint32_t blocks, std::uint32_t threads, void** parameters,
              std::uint64_t busy_ns) {
    VGPU_TENANT_CUDA(cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, stream_.get(), parameters, nullptr);
    // tail_ is written by this thread only; the slot at tail_ is outside what the reporter queries.
    const std::size_t newest = tail_ % events_.size();
    VGPU_TENANT_CUDA(cuEventRecord, events_[newest].get(), stream_.get());
    std::lock_guard<std::mutex> guard(completions_->mutex);
    busy_ns_[newest] = busy_ns;
    ++tail_;
  }

  // The reporter, holding completions_->mutex: credits the kernels whose events have completed, oldest first,
  // up to the first that has not (or whose query fails: the launch loop reports that failure).
  void PollLocked() {
    while (head_ < tail_ && cuEventQuery(events_[head_ % events_.size()].get()) == CUDA_SUCCESS) {
      CreditOldest();
    }
  }

  void Drain() {
    VGPU_TENANT_CUDA(cuStreamSynchronize, stream_.get());
    std::lock_guard<std::mutex> guard(completions_->mutex);
    while (head_ < tail_) {
      CreditOldest();
    }
  }

  void Release() {
    for (DriverObject<CUevent>& event : events_) {
      event.Release();
    }
    stream_.Release();
  }

 private:
  // Caller holds completions_->mutex.
  void CreditOldest() {
    completions_->busy_ns += busy_ns_[head_ % events_.size()];
    ++completions_->kernels;
    ++head_;
  }

  Completions* completions_;
  DriverObject<CUstream> stream_;
  std::vector<DriverObject<CUevent>> events_;
  std::vector<std::uint64_t> busy_ns_;  // per ring slot: the duration of the kernel recorded there
  std::uint64_t head_ = 0;              // kernels [head_, tail_) are in flight; slot = index % capacity
  std::uint64_t tail_ = 0;
};

// --report-ms: a thread that, every period from the first launch, credits the completions the events show and
// prints {"ev":"report",...}. It only queries events (cuEventQuery waits for nothing), so the launch loop runs as
// it would without it.
class Reporter {
 public:
  Reporter(CUcontext context, std::vector<StreamQueue>* streams, Completions* completions, std::int64_t start_ns,
           std::uint64_t period_ms)
      : context_(context),
        streams_(streams),
        completions_(completions),
        start_ns_(start_ns),
        period_ns_(static_cast<std::int64_t>(period_ms) * 1'000'000) {
    thread_ = std::thread([this] { Run(); });
  }
  Reporter(const Reporter&) = delete;
  Reporter& operator=(const Reporter&) = delete;
  ~Reporter() { Stop(); }

  void Stop() {
    {
      std::lock_guard<std::mutex> guard(stop_mutex_);
      stop_ = true;
    }
    stop_changed_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  // One line now, from what has been credited (the launch loop's own waits included).
  static void Print(Completions* completions, std::int64_t now_ns) {
    std::uint64_t kernels = 0;
    std::uint64_t busy_ns = 0;
    {
      std::lock_guard<std::mutex> guard(completions->mutex);
      kernels = completions->kernels;
      busy_ns = completions->busy_ns;
    }
    std::printf("{\"ev\":\"report\",\"t_ns\":%" PRId64 ",\"kernels\":%" PRIu64 ",\"busy_ns\":%" PRIu64 "}\n", now_ns,
                kernels, busy_ns);
    std::fflush(stdout);
  }

 private:
  void Run() {
    // Events need no current context to be queried on the real driver, but set it as the launching thread has it.
    static_cast<void>(cuCtxSetCurrent(context_));
    std::int64_t deadline_ns = start_ns_ + period_ns_;
    for (;;) {
      {
        std::unique_lock<std::mutex> guard(stop_mutex_);
        // steady_clock is CLOCK_MONOTONIC, the clock of the launch loop and of t_ns.
        const std::chrono::steady_clock::time_point deadline{std::chrono::nanoseconds(deadline_ns)};
        if (stop_changed_.wait_until(guard, deadline, [this] { return stop_; })) {
          return;
        }
      }
      {
        std::lock_guard<std::mutex> guard(completions_->mutex);
        for (StreamQueue& stream : *streams_) {
          stream.PollLocked();
        }
      }
      const std::int64_t now_ns = MonotonicNs();
      Print(completions_, now_ns);
      // The next multiple of the period after now: a late report does not bunch the next ones.
      deadline_ns = start_ns_ + ((now_ns - start_ns_) / period_ns_ + 1) * period_ns_;
    }
  }

  CUcontext context_;
  std::vector<StreamQueue>* streams_;
  Completions* completions_;
  std::int64_t start_ns_;
  std::int64_t period_ns_;
  std::mutex stop_mutex_;
  std::condition_variable stop_changed_;
  bool stop_ = false;
  std::thread thread_;
};

// The simulator's generator (vgpu/base/random.h): the same draws from the same seed everywhere.
using vgpu::base::SplitMix64;

// --churn: threads that allocate and free device memory in a tight loop beside the kernels (every call goes through
// a shim's accounting, and so through its region lock), paused, resumed and stopped from stdin by Control below.
class Churner {
 public:
  Churner(CUcontext context, const Churn& churn, std::uint64_t seed) : context_(context), churn_(churn) {
    workers_.reserve(churn.threads);
    for (std::uint32_t index = 0; index < churn.threads; ++index) {
      workers_.emplace_back(seed ^ (0x9e3779b97f4a7c15ull * (index + 1)));
    }
    for (Worker& worker : workers_) {
      worker.thread = std::thread([this, &worker] { Run(worker); });
    }
  }
  Churner(const Churner&) = delete;
  Churner& operator=(const Churner&) = delete;
  ~Churner() { Stop(); }

  // Every thread frees what it holds and ends; then the "stopped" line. Idempotent.
  void Stop() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (stopped_) {
        return;
      }
      stopped_ = true;
      stop_flag_.store(true, std::memory_order_relaxed);
    }
    changed_.notify_all();
    for (Worker& worker : workers_) {
      if (worker.thread.joinable()) {
        worker.thread.join();
      }
    }
    std::lock_guard<std::mutex> guard(mutex_);
    PrintLocked("stopped");
  }

  // Returns once every thread waits between two calls (or has ended), having printed the "paused" line.
  void Pause() {
    std::unique_lock<std::mutex> guard(mutex_);
    if (stopped_) {
      return;
    }
    pause_flag_.store(true, std::memory_order_relaxed);
    changed_.wait(guard, [this] { return parked_ + ended_ == workers_.size(); });
    PrintLocked("paused");
  }

  void Resume() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (stopped_) {
        return;
      }
      pause_flag_.store(false, std::memory_order_relaxed);
      PrintLocked("running");
    }
    changed_.notify_all();
  }

  // The first failure of a churn thread other than an out-of-memory refusal: the run reports it.
  std::optional<CudaFailure> Failure() {
    if (!failed_.load(std::memory_order_acquire)) {
      return std::nullopt;
    }
    std::lock_guard<std::mutex> guard(mutex_);
    return failure_;
  }

 private:
  struct Worker {
    explicit Worker(std::uint64_t seed) : random(seed) {}
    SplitMix64 random;
    std::vector<std::pair<CUdeviceptr, std::uint64_t>> blocks;
    // Written by the worker only; read by others under mutex_ once it is parked or ended.
    std::uint64_t held_bytes = 0;
    std::uint64_t allocs = 0;
    std::uint64_t frees = 0;
    std::uint64_t oom = 0;
    std::int64_t max_call_ns = 0;
    std::thread thread;
  };

  void Run(Worker& worker) {
    const CUresult current = cuCtxSetCurrent(context_);
    const bool ok = current == CUDA_SUCCESS || Fail({current, "cuCtxSetCurrent"});
    while (ok) {
      if (pause_flag_.load(std::memory_order_relaxed) || stop_flag_.load(std::memory_order_relaxed)) {
        std::unique_lock<std::mutex> guard(mutex_);
        if (pause_flag_.load(std::memory_order_relaxed) && !stopped_) {
          ++parked_;
          changed_.notify_all();
          changed_.wait(guard, [this] { return !pause_flag_.load(std::memory_order_relaxed) || stopped_; });
          --parked_;
        }
        if (stopped_) {
          break;
        }
      }
      if (!Step(worker)) {
        break;
      }
    }
    while (!worker.blocks.empty() && Free(worker, worker.blocks.size() - 1)) {
    }
    std::lock_guard<std::mutex> guard(mutex_);
    ++ended_;
    changed_.notify_all();
  }

  // One allocation or one free; false after a failure.
  bool Step(Worker& worker) {
    if (!worker.blocks.empty() && (worker.blocks.size() >= churn_.hold || worker.random.Below(2) == 0)) {
      return Free(worker, worker.random.Below(worker.blocks.size()));
    }
    constexpr std::uint64_t kStep = 4096;
    const std::uint64_t lowest = (churn_.min_bytes + kStep - 1) / kStep;
    const std::uint64_t highest = std::max(lowest, churn_.max_bytes / kStep);
    const std::uint64_t bytes = (lowest + worker.random.Below(highest - lowest + 1)) * kStep;
    CUdeviceptr address = 0;
    const std::int64_t started = MonotonicNs();
    const CUresult result = cuMemAlloc_v2(&address, bytes);
    worker.max_call_ns = std::max(worker.max_call_ns, MonotonicNs() - started);
    if (result == CUDA_ERROR_OUT_OF_MEMORY) {
      ++worker.oom;
      return true;
    }
    if (result != CUDA_SUCCESS) {
      return Fail({result, "cuMemAlloc_v2"});
    }
    worker.blocks.emplace_back(address, bytes);
    worker.held_bytes += bytes;
    ++worker.allocs;
    return true;
  }

  bool Free(Worker& worker, std::size_t index) {
    const auto [address, bytes] = worker.blocks[index];
    const std::int64_t started = MonotonicNs();
    const CUresult result = cuMemFree_v2(address);
    worker.max_call_ns = std::max(worker.max_call_ns, MonotonicNs() - started);
    if (result != CUDA_SUCCESS) {
      return Fail({result, "cuMemFree_v2"});
    }
    worker.blocks[index] = worker.blocks.back();
    worker.blocks.pop_back();
    worker.held_bytes -= bytes;
    ++worker.frees;
    return true;
  }

  bool Fail(CudaFailure failure) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (!failed_.load(std::memory_order_relaxed)) {
      failure_ = failure;
      failed_.store(true, std::memory_order_release);
    }
    return false;
  }

  // Caller holds mutex_, and every worker is parked or ended (or stopped and joined).
  void PrintLocked(const char* state) {
    std::uint64_t held = 0, blocks = 0, allocs = 0, frees = 0, oom = 0;
    std::int64_t max_call_ns = 0;
    for (const Worker& worker : workers_) {
      held += worker.held_bytes;
      blocks += worker.blocks.size();
      allocs += worker.allocs;
      frees += worker.frees;
      oom += worker.oom;
      max_call_ns = std::max(max_call_ns, worker.max_call_ns);
    }
    std::printf("{\"ev\":\"churn\",\"state\":\"%s\",\"held_bytes\":%" PRIu64 ",\"blocks\":%" PRIu64
                ",\"allocs\":%" PRIu64 ",\"frees\":%" PRIu64 ",\"oom\":%" PRIu64 ",\"max_call_us\":%" PRId64 "}\n",
                state, held, blocks, allocs, frees, oom, max_call_ns / 1000);
    std::fflush(stdout);
  }

  CUcontext context_;
  Churn churn_;
  std::vector<Worker> workers_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::atomic<bool> pause_flag_{false};
  std::atomic<bool> stop_flag_{false};
  std::atomic<bool> failed_{false};
  bool stopped_ = false;
  std::size_t parked_ = 0;
  std::size_t ended_ = 0;
  CudaFailure failure_{CUDA_SUCCESS, ""};
};

// With --churn: reads stdin, one word a line (pause, resume, stop), until end of input or the end of the run.
class Control {
 public:
  Control(Churner* churner, std::atomic<bool>* stop_requested) : churner_(churner), stop_requested_(stop_requested) {
    thread_ = std::thread([this] { Run(); });
  }
  Control(const Control&) = delete;
  Control& operator=(const Control&) = delete;
  ~Control() {
    finished_.store(true, std::memory_order_relaxed);
    thread_.join();
  }

 private:
  void Run() {
    std::string pending;
    while (!finished_.load(std::memory_order_relaxed)) {
      pollfd input{STDIN_FILENO, POLLIN, 0};
      const int ready = poll(&input, 1, 50);  // a short timeout: the run's end is noticed promptly
      if (ready < 0 && errno == EINTR) {
        continue;
      }
      if (ready < 0 || (input.revents & POLLNVAL) != 0) {
        return;
      }
      if (ready == 0) {
        continue;
      }
      char buffer[256];
      const ssize_t count = read(STDIN_FILENO, buffer, sizeof buffer);
      if (count < 0 && errno == EINTR) {
        continue;
      }
      if (count <= 0) {
        return;  // end of input: the run goes on as it was
      }
      pending.append(buffer, static_cast<std::size_t>(count));
      for (std::size_t end = pending.find('\n'); end != std::string::npos; end = pending.find('\n')) {
        std::string word = pending.substr(0, end);
        pending.erase(0, end + 1);
        while (!word.empty() && (word.back() == '\r' || word.back() == ' ')) {
          word.pop_back();
        }
        if (word == "pause") {
          churner_->Pause();
        } else if (word == "resume") {
          churner_->Resume();
        } else if (word == "stop") {
          stop_requested_->store(true, std::memory_order_relaxed);
        } else if (!word.empty()) {
          std::fprintf(stderr, "vgpu-tenant: unknown command \"%s\" on stdin; expected pause, resume or stop\n",
                       word.c_str());
        }
      }
    }
  }

  Churner* churner_;
  std::atomic<bool>* stop_requested_;
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// A kernel's duration: one of the phase's sizes, drawn uniformly, varied by +/- jitter (as the simulator draws).
// A DDP step's all_reduce: after its kernels, on the same stream, one per rank and round.
void LaunchCollective(StreamQueue& stream, CUfunction collective, const Phase& phase, std::uint32_t threads,
                      std::uint64_t waves) {
  stream.WaitForRoom(*phase.depth);
  unsigned long long collective_ns = phase.collective_ns / waves;
  unsigned long long group = phase.group;
  unsigned long long ranks = phase.ranks;
  void* parameters[] = {&collective_ns, &group, &ranks};
  stream.Launch(collective, *phase.blocks, threads, parameters, collective_ns * waves);
}

std::uint64_t DrawDurationNs(const Phase& phase, SplitMix64& random) {
  std::uint64_t duration_ns =
      phase.sizes_ns.size() == 1 ? phase.sizes_ns[0] : phase.sizes_ns[random.Below(phase.sizes_ns.size())];
  if (phase.jitter_permille > 0) {
    const auto offset = static_cast<std::int64_t>(random.Below(2ull * phase.jitter_permille + 1)) -
                        static_cast<std::int64_t>(phase.jitter_permille);
    const std::int64_t varied_ns =
        static_cast<std::int64_t>(duration_ns) + static_cast<std::int64_t>(duration_ns) * offset / 1000;
    duration_ns = static_cast<std::uint64_t>(std::max<std::int64_t>(1, varied_ns));
  }
  return duration_ns;
}

int DeviceAttribute(CUdevice_attribute attribute, CUdevice device) {
  int value = 0;
  VGPU_TENANT_CUDA(cuDeviceGetAttribute, &value, attribute, device);
  return value;
}

}  // namespace

std::uint64_t WavesFor(std::uint64_t blocks, std::uint64_t threads_per_block, int sm_count, int max_threads_per_sm,
                       int max_blocks_per_sm) {
  std::uint64_t resident_per_sm =
      threads_per_block > 0 ? static_cast<std::uint64_t>(std::max(max_threads_per_sm, 0)) / threads_per_block : 0;
  if (max_blocks_per_sm > 0) {
    resident_per_sm = std::min(resident_per_sm, static_cast<std::uint64_t>(max_blocks_per_sm));
  }
  // A block larger than an SM's thread limit does not launch at all; the
  // launch reports that, so count one block per SM rather than divide by 0.
  resident_per_sm = std::max<std::uint64_t>(resident_per_sm, 1);
  const std::uint64_t blocks_per_wave = static_cast<std::uint64_t>(std::max(sm_count, 1)) * resident_per_sm;
  return std::max<std::uint64_t>((blocks + blocks_per_wave - 1) / blocks_per_wave, 1);
}

std::string ErrorName(CUresult result) {
  const char* name = nullptr;
  if (cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) {
    return name;
  }
  // The toolkit's stub libcuda answers every call, cuGetErrorName included,
  // with this code: name it, since it is the one that says "no driver here".
  if (result == CUDA_ERROR_STUB_LIBRARY) {
    return "CUDA_ERROR_STUB_LIBRARY";
  }
  return "CUresult " + std::to_string(static_cast<int>(result));
}

std::string ErrorDescription(CUresult result) {
  const char* description = nullptr;
  if (cuGetErrorString(result, &description) == CUDA_SUCCESS && description != nullptr) {
    return description;
  }
  if (result == CUDA_ERROR_STUB_LIBRARY) {
    return "the CUDA toolkit's stub libcuda.so.1 was loaded instead of a driver";
  }
  return "no description from the driver";
}

void RunWorkload(const Options& options, const char* ptx, ResultLine* result) {
  VGPU_TENANT_CUDA(cuInit, 0);
  CUdevice device = 0;
  VGPU_TENANT_CUDA(cuDeviceGet, &device, options.device);

  // The primary context, as the CUDA runtime and PyTorch use it, so the
  // tenant looks to a shim like the applications it stands for.
  CUcontext context = nullptr;
  VGPU_TENANT_CUDA(cuDevicePrimaryCtxRetain, &context, device);
  DriverObject<CUdevice> primary_context(device, cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease_v2");
  VGPU_TENANT_CUDA(cuCtxSetCurrent, context);

  CUmodule module_handle = nullptr;
  VGPU_TENANT_CUDA(cuModuleLoadData, &module_handle, ptx);
  DriverObject<CUmodule> module(module_handle, cuModuleUnload, "cuModuleUnload");
  CUfunction spin = nullptr;
  VGPU_TENANT_CUDA(cuModuleGetFunction, &spin, module.get(), "vgpu_spin");
  CUfunction collective = nullptr;
  const bool collectives = std::ranges::any_of(options.phases, [](const Phase& p) { return p.collective_ns > 0; });
  if (collectives) {
    VGPU_TENANT_CUDA(cuModuleGetFunction, &collective, module.get(), "vgpu_collective");
  }

  const int sm_count = DeviceAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device);
  const int max_threads_per_sm = DeviceAttribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, device);
  const int max_blocks_per_sm = DeviceAttribute(CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, device);

  // Without --phase, the flags make the one phase the tenant always ran: D for ever (until --seconds or
  // --kernels), closed loop or at --rate.
  std::vector<Phase> phases = options.phases;
  if (phases.empty()) {
    Phase phase;
    phase.sizes_ns = {options.kernel_us * 1000};
    phase.rate_hz = options.rate_hz.value_or(0);
    phases.push_back(phase);
  }
  std::uint32_t capacity = options.depth;
  for (Phase& phase : phases) {
    phase.depth = phase.depth.value_or(options.depth);
    phase.blocks = phase.blocks.value_or(options.blocks);
    capacity = std::max(capacity, *phase.depth);
  }

  DriverObject<CUdeviceptr> memory;
  if (options.alloc_bytes > 0) {
    CUdeviceptr address = 0;
    const CUresult allocated = cuMemAlloc_v2(&address, options.alloc_bytes);
    if (allocated == CUDA_ERROR_OUT_OF_MEMORY) {
      result->out_of_memory = true;
      result->alloc_bytes = options.alloc_bytes;  // what was asked for
    }
    Check(allocated, "cuMemAlloc_v2");
    memory = DriverObject<CUdeviceptr>(address, cuMemFree_v2, "cuMemFree_v2");
    result->alloc_bytes = options.alloc_bytes;
    // Touch every byte, so that the memory is really in use (a driver may
    // back pages lazily), and finish before the clock starts.
    VGPU_TENANT_CUDA(cuMemsetD8_v2, address, 0, options.alloc_bytes);
    VGPU_TENANT_CUDA(cuCtxSynchronize);
  }

  Completions completions;
  std::vector<StreamQueue> streams;
  streams.reserve(options.streams);
  for (std::uint32_t index = 0; index < options.streams; ++index) {
    streams.emplace_back(capacity, &completions);
  }

  // With --phase and no --kernels there is no count: the phases and --seconds say when to stop.
  const std::uint64_t kernel_limit = options.seconds || (!options.phases.empty() && !options.kernel_count)
                                         ? std::numeric_limits<std::uint64_t>::max()
                                         : options.kernel_count.value_or(kDefaultKernelCount);
  const std::int64_t start_ns = MonotonicNs();
  // Bounded by the option parser (at most 10^6 s), so this cannot overflow.
  const std::int64_t stop_ns = options.seconds
                                   ? start_ns + static_cast<std::int64_t>(std::llround(*options.seconds * 1e9))
                                   : std::numeric_limits<std::int64_t>::max();
  // A deadline past this is centuries away: the schedule is over in practice.
  constexpr double kLatestDeadlineOffsetNs = 1e18;
  SplitMix64 random(options.seed);

  std::optional<Reporter> reporter;
  if (options.report_ms) {
    reporter.emplace(context, &streams, &completions, start_ns, *options.report_ms);
  }
  // --churn: its threads, and stdin's pause/resume/stop (stop ends the launch loop as --seconds would).
  std::atomic<bool> stop_requested{false};
  std::optional<Churner> churner;
  std::optional<Control> control;
  if (options.churn) {
    churner.emplace(context, *options.churn, options.seed);
    control.emplace(&*churner, &stop_requested);
  }
  const auto stopping = [&] {
    if (churner) {
      if (const std::optional<CudaFailure> failure = churner->Failure()) {
        throw *failure;
      }
    }
    return stop_requested.load(std::memory_order_relaxed);
  };

  // The elapsed time so far is kept in the result, so a failure part way
  // still reports how long the tenant ran.
  const auto note_progress = [&](std::uint64_t launched) {
    result->kernels = launched;
    result->elapsed_s = static_cast<double>(MonotonicNs() - start_ns) * 1e-9;
    std::lock_guard<std::mutex> guard(completions.mutex);
    result->busy_ns = completions.busy_ns;
  };
  std::uint64_t launched = 0;
  try {
    // Phases on an absolute schedule: each begins where the previous one was due to end, however late its
    // last launch was, so a schedule of phases never drifts.
    std::int64_t phase_start_ns = start_ns;
    std::size_t next_phase = 0;
    while (launched < kernel_limit && phase_start_ns < stop_ns && !stopping()) {
      if (next_phase == phases.size()) {
        if (!options.repeat) {
          break;
        }
        next_phase = 0;
      }
      const Phase& phase = phases[next_phase++];
      const std::int64_t phase_end_ns =
          phase.for_ns && static_cast<std::int64_t>(*phase.for_ns) < stop_ns - phase_start_ns
              ? phase_start_ns + static_cast<std::int64_t>(*phase.for_ns)
              : stop_ns;
      if (phase.idle) {
        SleepUntilNs(phase_end_ns);
        phase_start_ns = phase_end_ns;
        continue;
      }
      const std::uint64_t waves =
          WavesFor(*phase.blocks, options.threads, sm_count, max_threads_per_sm, max_blocks_per_sm);
      const double period_ns = phase.rate_hz > 0 ? 1e9 / phase.rate_hz : 0;
      std::uint64_t launched_in_phase = 0;
      while (launched < kernel_limit) {
        StreamQueue& stream = streams[launched % streams.size()];
        if (phase.rate_hz > 0) {
          // Each deadline from the launch index, not from the last one, so
          // no error accumulates: launch i is due at start + i / rate.
          const double offset_ns = static_cast<double>(launched_in_phase) * period_ns;
          if (offset_ns >= kLatestDeadlineOffsetNs) {
            break;
          }
          const std::int64_t deadline_ns = phase_start_ns + static_cast<std::int64_t>(offset_ns);
          if (deadline_ns >= phase_end_ns) {
            break;
          }
          SleepUntilNs(deadline_ns);
          stream.WaitForRoom(*phase.depth);
          if (stopping()) {
            break;
          }
        } else {
          stream.WaitForRoom(*phase.depth);
          if (MonotonicNs() >= phase_end_ns || stopping()) {
            break;
          }
        }
        unsigned long long ns_per_block = DrawDurationNs(phase, random) / waves;
        void* spin_parameters[] = {&ns_per_block};
        stream.Launch(spin, *phase.blocks, options.threads, spin_parameters, ns_per_block * waves);
        ++launched;
        ++launched_in_phase;
        if (phase.collective_ns > 0 && launched_in_phase % phase.every == 0) {
          LaunchCollective(stream, collective, phase, options.threads, waves);
        }
      }
      phase_start_ns = phase_end_ns;
    }
    // Phases that end before --seconds does leave the tenant idle until then (still holding its memory).
    if (!options.phases.empty() && options.seconds && launched < kernel_limit && phase_start_ns < stop_ns &&
        !stopping()) {
      SleepUntilNs(stop_ns);
    }
    for (StreamQueue& stream : streams) {
      stream.Drain();
    }
    if (churner) {
      control.reset();
      churner->Stop();  // frees every block it holds
      stopping();       // throws a churn thread's failure
    }
  } catch (const CudaFailure&) {
    if (reporter) {
      reporter->Stop();
    }
    note_progress(launched);
    throw;
  }
  note_progress(launched);
  if (reporter) {
    reporter->Stop();
    Reporter::Print(&completions, MonotonicNs());  // the end: everything launched is complete
  }

  for (StreamQueue& stream : streams) {
    stream.Release();
  }
  memory.Release();
  module.Release();
  primary_context.Release();
}

}  // namespace vgpu::tenant
