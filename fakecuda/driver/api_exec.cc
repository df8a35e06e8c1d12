// Fake libcuda.so.1: modules and functions, streams, events, kernel launches, host functions and graphs,
// and the waits that synchronize with the shared timeline.
#include <dlfcn.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <span>
#include <sstream>
#include <thread>
#include <utility>

#include "internal.h"
#include "image.h"
#include "ptx.h"

namespace fakecuda::driver {
namespace {

constexpr std::uint64_t kMinSleepNs = 20'000;
constexpr std::uint64_t kMaxSleepNs = 50'000'000;
constexpr std::uint64_t kMaxBackoffNs = 10'000'000;

// The per-thread default stream of each context, created on first use.
struct PerThreadStreams {
  std::uint64_t epoch = 0;
  std::vector<std::pair<Context*, Stream*>> streams;
};
thread_local PerThreadStreams t_per_thread;

CUresult MachineGone() { return CUDA_ERROR_DEINITIALIZED; }

std::uint64_t SleepFor(std::uint64_t lower_bound_ns) {
  return std::clamp<std::uint64_t>(lower_bound_ns, kMinSleepNs, kMaxSleepNs);
}

Stream* PerThreadStream(Driver& d, Context* c) {
  if (t_per_thread.epoch != reinterpret_cast<std::uintptr_t>(&d)) {
    t_per_thread = PerThreadStreams{};
    t_per_thread.epoch = reinterpret_cast<std::uintptr_t>(&d);
  }
  for (auto& [context, stream] : t_per_thread.streams) {
    if (context == c && std::find(d.streams.begin(), d.streams.end(), stream) != d.streams.end()) return stream;
  }
  auto* s = new Stream();
  s->context = c;
  {
    state::MachineLock lock(*d.attachment);
    s->index = model::CreateStream(lock.machine(), d.attachment->slot, c->device, 0, 0);
    if (s->index == model::kNoSlot) {
      delete s;
      return nullptr;
    }
    s->generation = lock.machine().streams[s->index].generation;
  }
  d.streams.push_back(s);  // not a handle: the application names it CU_STREAM_PER_THREAD
  t_per_thread.streams.emplace_back(c, s);
  return s;
}

// ---- host functions: one worker thread runs callbacks in order, then opens their gates ------------------

struct HostCall {
  std::uint32_t device, stream;
  std::uint64_t generation, seq;
  CUhostFn function;
  void* data;
};

struct HostWorker {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<HostCall> queue;
  bool started = false;
};
HostWorker* g_host_worker = nullptr;

void RunHostWorker(HostWorker* worker) {
  for (;;) {
    HostCall call{};
    {
      std::unique_lock<std::mutex> lock(worker->mutex);
      worker->ready.wait(lock, [&] { return !worker->queue.empty(); });
      call = worker->queue.front();
      worker->queue.pop_front();
    }
    if (call.seq > 0) WaitForOp(call.device, call.stream, call.generation, call.seq - 1);
    call.function(call.data);
    Driver& d = TheDriver();
    state::MachineLock lock(*d.attachment);
    model::OpenGate(lock.machine(), call.stream, call.seq);
  }
}

CUresult SubmitHostCall(const HostCall& call) {
  if (g_host_worker == nullptr) g_host_worker = new HostWorker();  // lives as long as the process
  HostWorker* worker = g_host_worker;
  std::lock_guard<std::mutex> lock(worker->mutex);
  if (!worker->started) {
    try {
      std::thread(RunHostWorker, worker).detach();
    } catch (const std::exception&) {  // no thread can be made: say so, never throw into the caller
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    worker->started = true;
  }
  worker->queue.push_back(call);
  worker->ready.notify_one();
  return CUDA_SUCCESS;
}

// ---- stream waits on memory (cuStreamWaitValue32/64) ------------------------------------------------------------

// A wait on a word the host writes (pinned memory: how a stream is held until the host says so): a gate in the
// stream, opened by the first of this process's driver calls that finds the condition holds. Every call that brings
// a device up to now polls the words (launches, records, queries, and the loops of the waits), so a synchronize
// sees a write made while it waits. No other process can write this process's pinned memory.
struct ValueWait {
  std::uint32_t stream;
  std::uint64_t generation;
  std::uint64_t seq;  // the gate
  std::uintptr_t address;
  std::uint64_t value;
  unsigned int flags;
  bool wide;  // 64-bit
};
std::mutex g_value_mutex;                         // taken inside the machine lock, never around it
std::vector<ValueWait>* g_value_waits = nullptr;  // (made on first use, lives as long as the process)
std::atomic<std::size_t> g_value_wait_count{0};

bool ValueWaitHolds(const ValueWait& w) {
  std::uint64_t word = 0;
  if (w.wide) {
    word = __atomic_load_n(reinterpret_cast<const std::uint64_t*>(w.address), __ATOMIC_ACQUIRE);
  } else {
    word = __atomic_load_n(reinterpret_cast<const std::uint32_t*>(w.address), __ATOMIC_ACQUIRE);
  }
  const std::uint64_t mask = w.wide ? ~std::uint64_t{0} : 0xffffffffu;
  switch (w.flags & 0x3u) {
    case CU_STREAM_WAIT_VALUE_GEQ:  // cyclic: (int)(*addr - value) >= 0
      return w.wide ? static_cast<std::int64_t>(word - w.value) >= 0
                    : static_cast<std::int32_t>(static_cast<std::uint32_t>(word - w.value)) >= 0;
    case CU_STREAM_WAIT_VALUE_EQ:
      return (word & mask) == (w.value & mask);
    case CU_STREAM_WAIT_VALUE_AND:
      return (word & w.value & mask) != 0;
    default:
      return (~(word | w.value) & mask) != 0;  // CU_STREAM_WAIT_VALUE_NOR
  }
}

// Opens the gates whose words now hold. Caller holds the machine lock and has brought the device up to now (an
// opened gate completes at the device's next advance, from now).
void OpenSatisfiedValueWaits(model::Machine& m) {
  if (g_value_wait_count.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> guard(g_value_mutex);
  std::vector<ValueWait>& waits = *g_value_waits;
  for (auto it = waits.begin(); it != waits.end();) {
    const model::Stream& s = m.streams[it->stream];
    const bool gone = s.generation != it->generation || s.head > it->seq;  // the stream went with its context
    if (gone || ValueWaitHolds(*it)) {
      if (!gone) model::OpenGate(m, it->stream, it->seq);
      it = waits.erase(it);
    } else {
      ++it;
    }
  }
  g_value_wait_count.store(waits.size(), std::memory_order_release);
}

// state::AdvanceToNow, then the gates of satisfied waits opened. Caller holds the machine lock.
void AdvanceAndPoll(state::Attachment& a, model::Machine& m, std::uint32_t device, std::uint64_t now) {
  state::AdvanceToNow(a, device, now);
  OpenSatisfiedValueWaits(m);
}

// ---- launches ----------------------------------------------------------------------------------------------

struct LaunchRequest {
  const char* symbol;
  CUfunction function;
  std::uint32_t grid[3];
  std::uint32_t block[3];
  std::uint32_t shared_bytes;
  CUstream stream;
  void** params;
  void** extra;
  bool per_thread;
  bool cooperative;
};

// A 64-bit parameter of the spin or collective kernel, from kernelParams or the packed `extra` buffer.
bool ReadU64Param(const Function& f, std::size_t index, void** params, void** extra, std::uint64_t& value) {
  if (f.params.size() <= index || f.params[index].size != 8) return false;
  if (params != nullptr && params[index] != nullptr) {
    std::memcpy(&value, params[index], sizeof value);
    return true;
  }
  if (extra != nullptr) {
    const void* buffer = nullptr;
    std::size_t size = 0;
    for (std::size_t i = 0; i < 64 && extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
      if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buffer = extra[i + 1];
      if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1] != nullptr)
        size = *static_cast<std::size_t*>(extra[i + 1]);
    }
    if (buffer != nullptr && size >= f.params[index].offset + 8) {
      std::memcpy(&value, static_cast<const char*>(buffer) + f.params[index].offset, sizeof value);
      return true;
    }
  }
  return false;
}

// The arguments fakecuda models: vgpu_spin's time, and vgpu_collective's time, group and group size (a group of
// 0 or a size outside 2 .. the devices fakecuda can have is CUDA_ERROR_INVALID_VALUE, as any unreadable argument).
CUresult ReadModelledParams(const Function& f, void** params, void** extra, KernelNode& node) {
  if (!f.spin && !f.collective) return CUDA_SUCCESS;
  if (!ReadU64Param(f, 0, params, extra, node.per_wave_ns)) return CUDA_ERROR_INVALID_VALUE;
  if (!f.collective) return CUDA_SUCCESS;
  std::uint64_t size = 0;
  if (!ReadU64Param(f, 1, params, extra, node.group) || !ReadU64Param(f, 2, params, extra, size)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (node.group == 0 || size < 2 || size > model::kMaxDevices) return CUDA_ERROR_INVALID_VALUE;
  node.group_size = static_cast<std::uint32_t>(size);
  return CUDA_SUCCESS;
}

CUresult ValidateShape(const Driver& d, const Function& f, const Context& c, const LaunchRequest& r) {
  const model::DeviceSpec& spec = Spec(d, c.device);
  for (int i = 0; i < 3; ++i) {
    if (r.grid[i] == 0 || r.block[i] == 0) return CUDA_ERROR_INVALID_VALUE;
  }
  if (r.block[0] > 1024 || r.block[1] > 1024 || r.block[2] > 64 || r.grid[1] > 65535 || r.grid[2] > 65535 ||
      r.grid[0] > 2147483647u) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::uint64_t threads = static_cast<std::uint64_t>(r.block[0]) * r.block[1] * r.block[2];
  if (threads > spec.max_threads_per_block) return CUDA_ERROR_INVALID_VALUE;
  if (r.shared_bytes > static_cast<std::uint32_t>(f.max_dynamic_shared)) return CUDA_ERROR_INVALID_VALUE;
  if (!f.params.empty() && r.params == nullptr && r.extra == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (r.cooperative) {
    model::LaunchShape shape{{r.grid[0], r.grid[1], r.grid[2]}, {r.block[0], r.block[1], r.block[2]}, r.shared_bytes};
    const std::uint64_t blocks = static_cast<std::uint64_t>(r.grid[0]) * r.grid[1] * r.grid[2];
    if (blocks > static_cast<std::uint64_t>(spec.sm_count) * model::ResidentBlocksPerSm(spec, shape)) {
      return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    }
  }
  return CUDA_SUCCESS;
}

// Queues kernels on a stream, waiting (outside every lock) while its queue is full. Caller holds d.mutex via
// `guard`; the stream must stay valid: it is re-resolved after each wait.
CUresult EnqueueKernels(Driver& d, std::unique_lock<std::mutex>& guard, CUstream handle, bool per_thread,
                        const std::vector<KernelNode>& nodes) {
  std::size_t next = 0;
  while (next < nodes.size()) {
    ResolvedStream rs;
    if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
    std::uint64_t wait_ns = 0;
    {
      state::MachineLock lock(*d.attachment);
      model::Machine& m = lock.machine();
      const std::uint64_t now = state::MonotonicNs();
      AdvanceAndPoll(*d.attachment, m, rs.context->device, now);
      while (next < nodes.size()) {
        QueueImplicitSync(d, m, rs, now);
        const KernelNode& node = nodes[next];
        model::KernelLaunch launch{node.shape, node.per_wave_ns, node.name.c_str(), node.group, node.group_size};
        const model::EnqueueResult queued = model::EnqueueKernel(m, rs.index, launch, now, nullptr);
        // A group that cannot be joined (another process of the device in it, another size, no room) is the
        // caller's error; kernels queued before it in this call stay queued, as a partly launched graph's.
        if (queued == model::EnqueueResult::bad_group) return CUDA_ERROR_INVALID_VALUE;
        if (queued == model::EnqueueResult::no_group) return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
        if (queued != model::EnqueueResult::ok) {
          const model::Stream& s = m.streams[rs.index];
          wait_ns = model::LowerBoundRemainingNs(m, rs.index, s.head);
          break;
        }
        ++next;
      }
    }
    if (next < nodes.size()) {
      guard.unlock();
      state::SleepNs(SleepFor(wait_ns));
      guard.lock();
    }
  }
  return CUDA_SUCCESS;
}

// The host time a launch call takes before the GPU has the kernel (FAKECUDA_LAUNCH_CALL_NS): spent, not slept (a few
// microseconds; a sleep would take tens).
void SpendLaunchCall(std::uint64_t ns) {
  if (ns == 0) return;
  const std::uint64_t until = state::MonotonicNs() + ns;
  while (state::MonotonicNs() < until) {
  }
}

}  // namespace

// ---- the driver's own memory (docs/fakecuda.md, "Memory the driver takes by itself") --------------------------------

namespace {
constexpr std::uint64_t kPageBytes = 2ull << 20;        // the driver maps its own memory in 2 MiB pages
constexpr std::uint64_t kModuleCodeBytes = kPageBytes;  // a module's code: one page (PTX modules are small)
constexpr std::uint64_t kDefaultStackBytes = 1024;      // CU_LIMIT_STACK_SIZE's default: in the context's overhead
constexpr std::uint64_t kHeapSetUpBytes = kPageBytes;   // beside the heap itself (H100: 256 MiB heap took 258)

std::uint64_t RoundUpToPage(std::uint64_t bytes) { return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }

// Local memory is reserved for every thread the device can hold at once (H100: 132 SMs x 2048 threads).
std::uint64_t LocalBytesFor(const model::DeviceSpec& spec, std::uint64_t per_thread) {
  return std::max(per_thread, kDefaultStackBytes) * spec.sm_count * spec.max_threads_per_sm;
}
}  // namespace

CUresult LoadModuleFootprint(Driver& d, Module& module) {
  if (module.loaded) return CUDA_SUCCESS;
  if (!ChargeDevice(d, module.context->device, module.footprint_bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  module.loaded = true;
  return CUDA_SUCCESS;
}

CUresult ResizeLocalMemory(Driver& d, Context& c, std::uint64_t per_thread) {
  const model::DeviceSpec& spec = Spec(d, c.device);
  const std::uint64_t now = LocalBytesFor(spec, c.local_per_thread), wanted = LocalBytesFor(spec, per_thread);
  if (wanted > now) {
    if (!ChargeDevice(d, c.device, wanted - now)) return CUDA_ERROR_OUT_OF_MEMORY;
    c.charged_bytes += wanted - now;
  } else if (wanted < now) {
    UnchargeDevice(d, c.device, now - wanted);
    c.charged_bytes -= std::min(c.charged_bytes, now - wanted);
  }
  c.local_per_thread = per_thread;
  return CUDA_SUCCESS;
}

CUresult TakeLaunchMemory(Driver& d, Function& f, Context& c) {
  if (const CUresult r = LoadModuleFootprint(d, *f.module); r != CUDA_SUCCESS) return r;
  // A kernel needing more local memory a thread than reserved raises the reservation (and the stack limit) for good.
  if (f.local_bytes > std::max<std::uint64_t>(c.local_per_thread, kDefaultStackBytes)) {
    if (const CUresult r = ResizeLocalMemory(d, c, f.local_bytes); r != CUDA_SUCCESS) return r;
    c.limits[CU_LIMIT_STACK_SIZE] = f.local_bytes;
  }
  if (f.uses_malloc && !c.heap_taken) {
    const std::uint64_t heap =
        c.limits[CU_LIMIT_MALLOC_HEAP_SIZE] != 0 ? c.limits[CU_LIMIT_MALLOC_HEAP_SIZE] : 8ull << 20;
    if (!ChargeDevice(d, c.device, heap + kHeapSetUpBytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    c.charged_bytes += heap + kHeapSetUpBytes;
    c.heap_taken = true;
  }
  return CUDA_SUCCESS;
}

namespace {

CUresult Launch(const LaunchRequest& r) {
  FAKECUDA_ENTER(r.symbol);
  Driver& d = TheDriver();
  SpendLaunchCall(d.launch_call_ns);
  std::unique_lock<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, r.function);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (!std::exchange(f->launched, true) && d.lazy_load_ns > 0) {
    guard.unlock();  // loading it: host time inside the call, outside the lock
    SpendLaunchCall(d.lazy_load_ns);
    guard.lock();
    f = LookupFunction(d, r.function);  // (its module may have gone meanwhile)
    if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  }
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  if (const CUresult v = ValidateShape(d, *f, *c, r); v != CUDA_SUCCESS) return v;
  KernelNode node;
  node.function = f;
  node.name = f->name;
  node.shape =
      model::LaunchShape{{r.grid[0], r.grid[1], r.grid[2]}, {r.block[0], r.block[1], r.block[2]}, r.shared_bytes};
  node.per_wave_ns = f->per_wave_ns;
  if (const CUresult read = ReadModelledParams(*f, r.params, r.extra, node); read != CUDA_SUCCESS) return read;
  ResolvedStream rs;
  if (const CUresult s = ResolveStream(d, r.stream, r.per_thread, rs); s != CUDA_SUCCESS) return s;
  if (rs.stream != nullptr && rs.stream->capture != nullptr) {
    rs.stream->capture->nodes.push_back(node);
    return CUDA_SUCCESS;
  }
  if (const CUresult taken = TakeLaunchMemory(d, *f, *c); taken != CUDA_SUCCESS) return taken;
  if (d.launch_waits_for_stream) {
    // As a driver whose launch call waits for the work before it (outside the lock, as a synchronize does).
    guard.unlock();
    const CUresult waited = WaitStreamIdle(rs.context->device, rs.index, rs.generation);
    guard.lock();
    if (waited != CUDA_SUCCESS) return waited;
  }
  return EnqueueKernels(d, guard, r.stream, r.per_thread, {node});
}

CUresult LaunchEx(const char* symbol, const CUlaunchConfig* config, CUfunction f, void** params, void** extra,
                  bool per_thread) {
  if (config == nullptr) {
    FAKECUDA_ENTER(symbol);
    return CUDA_ERROR_INVALID_VALUE;
  }
  bool cooperative = false;
  if (config->numAttrs > 0 && config->attrs == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (unsigned int i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && config->attrs[i].value.cooperative != 0)
      cooperative = true;
  }
  return Launch({symbol,
                 f,
                 {config->gridDimX, config->gridDimY, config->gridDimZ},
                 {config->blockDimX, config->blockDimY, config->blockDimZ},
                 config->sharedMemBytes,
                 config->hStream,
                 params,
                 extra,
                 per_thread,
                 cooperative});
}

// ---- streams -----------------------------------------------------------------------------------------------

CUresult CreateStreamCommon(CUstream* out, unsigned int flags, int priority) {
  if (out == nullptr || (flags & ~static_cast<unsigned int>(CU_STREAM_NON_BLOCKING)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  auto* s = new Stream();
  s->context = c;
  s->flags = flags;
  s->priority = std::clamp(priority, -5, 0);
  {
    state::MachineLock lock(*d.attachment);
    s->index = model::CreateStream(lock.machine(), d.attachment->slot, c->device, flags, s->priority);
    if (s->index == model::kNoSlot) {
      delete s;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    s->generation = lock.machine().streams[s->index].generation;
  }
  d.streams.push_back(Register(d, s));
  *out = reinterpret_cast<CUstream>(s);
  return CUDA_SUCCESS;
}

}  // namespace

// The calling thread's stream capture interaction mode (cuThreadExchangeStreamCaptureMode): global by default.
static thread_local CUstreamCaptureMode t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

// A "potentially unsafe" call (here: cuStreamQuery, cuEventQuery) made while a capture in global mode is under way
// anywhere in the process, by a thread whose own mode is not relaxed: as the real driver does, the call fails and
// invalidates those captures (their cuStreamEndCapture then fails). Caller holds d.mutex.
static CUresult CheckUnsafeDuringCapture(Driver& d) {
  if (t_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  bool invalidated = false;
  for (Stream* stream : d.streams) {
    if (stream->capture != nullptr && stream->capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL) {
      stream->capture_invalidated = true;
      invalidated = true;
    }
  }
  return invalidated ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

namespace {

CUresult StreamQuery(CUstream handle, bool per_thread) {
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (const CUresult r = CheckUnsafeDuringCapture(d); r != CUDA_SUCCESS) return r;
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
  state::MachineLock lock(*d.attachment);
  AdvanceAndPoll(*d.attachment, lock.machine(), rs.context->device, state::MonotonicNs());
  const model::Stream& s = lock.machine().streams[rs.index];
  return s.head >= s.tail ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult StreamSynchronize(CUstream handle, bool per_thread) {
  Driver& d = TheDriver();
  ResolvedStream rs;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
    if (rs.stream != nullptr && rs.stream->capture != nullptr) {
      rs.stream->capture_invalidated = true;  // synchronizing a capturing stream ends the capture in error
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
  }
  CUresult r = CUDA_SUCCESS;
  if (rs.legacy) {
    r = WaitContextIdle(rs.context);  // the legacy stream waits for the context's blocking streams
  } else {
    r = WaitStreamIdle(rs.context->device, rs.index, rs.generation);
  }
  std::lock_guard<std::mutex> guard(d.mutex);
  TrimPoolsAtSync(d);
  return r;
}

CUresult StreamWaitEvent(CUstream handle, CUevent event_handle, unsigned int flags, bool per_thread) {
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Event* e = Lookup<Event>(d, event_handle, Kind::event);
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (flags != 0 && flags != CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
  if (!e->recorded || (rs.stream != nullptr && rs.stream->capture != nullptr)) return CUDA_SUCCESS;
  state::MachineLock lock(*d.attachment);
  const std::uint64_t now = state::MonotonicNs();
  KeepEventEnds(d, lock.machine(), rs.index);
  model::EnqueueWait(lock.machine(), rs.index, e->stream, e->generation, e->seq, now);
  return CUDA_SUCCESS;
}

CUresult EventRecord(CUevent event_handle, CUstream handle, bool per_thread) {
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  Event* e = Lookup<Event>(d, event_handle, Kind::event);
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  for (;;) {
    ResolvedStream rs;
    if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
    if (rs.stream != nullptr && rs.stream->capture != nullptr) return CUDA_SUCCESS;  // a capture dependency only
    std::uint64_t wait_ns = 0;
    {
      state::MachineLock lock(*d.attachment);
      model::Machine& m = lock.machine();
      const std::uint64_t now = state::MonotonicNs();
      AdvanceAndPoll(*d.attachment, m, rs.context->device, now);
      QueueImplicitSync(d, m, rs, now);
      std::uint64_t seq = 0;
      if (model::EnqueueMarker(m, rs.index, now, &seq) == model::EnqueueResult::ok) {
        const std::uint32_t listed_on = e->stream;
        e->recorded = true;
        e->stream = rs.index;
        e->generation = rs.generation;
        e->seq = seq;
        e->end_ns = 0;
        e->device = rs.context->device;
        // (Recorded again on another stream: listed there too; the entry for the old one is dropped when read.)
        if (!e->awaiting_end || listed_on != rs.index) d.events_awaiting_end.push_back({event_handle, rs.index});
        e->awaiting_end = true;
        return CUDA_SUCCESS;
      }
      wait_ns = model::LowerBoundRemainingNs(m, rs.index, m.streams[rs.index].head);
    }
    guard.unlock();
    state::SleepNs(SleepFor(wait_ns));
    guard.lock();
    if (Lookup<Event>(d, event_handle, Kind::event) == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  }
}

// Completion time of a recorded event if it has completed (caching it), else 0.
std::uint64_t EventEndNs(Driver& d, Event& e) {
  if (e.end_ns != 0) return e.end_ns;
  state::MachineLock lock(*d.attachment);
  model::Machine& m = lock.machine();
  const std::uint64_t now = state::MonotonicNs();
  AdvanceAndPoll(*d.attachment, m, m.streams[e.stream].device, now);
  if (!model::OpDone(m, e.stream, e.generation, e.seq)) return 0;
  std::uint64_t end = 0;
  if (m.streams[e.stream].generation == e.generation) end = model::OpEndNs(m, e.stream, e.seq);
  e.end_ns = end != 0 ? end : now;  // ring slot reused or stream gone: the time we saw it done
  return e.end_ns;
}

std::uint64_t CostOf(const Driver& d, const std::string& name) {
  const auto it = d.kernel_costs.find(name);
  return it != d.kernel_costs.end() ? it->second : d.default_kernel_ns;
}

// libzstd, loaded when a fatbin first needs it (zstd-compressed PTX); none: such an entry cannot be read.
bool InflateZstd(std::span<const std::uint8_t> frame, std::size_t bytes, std::vector<std::uint8_t>& out) {
  using Decompress = std::size_t (*)(void*, std::size_t, const void*, std::size_t);
  using IsError = unsigned (*)(std::size_t);
  static void* const library = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) return false;
  static const auto decompress = reinterpret_cast<Decompress>(dlsym(library, "ZSTD_decompress"));
  static const auto is_error = reinterpret_cast<IsError>(dlsym(library, "ZSTD_isError"));
  if (decompress == nullptr || is_error == nullptr) return false;
  out.resize(bytes);
  const std::size_t made = decompress(out.data(), out.size(), frame.data(), frame.size());
  if (is_error(made) != 0) return false;
  out.resize(made);
  return true;
}

// What a device of architecture `device_sm` runs from `image` (PTX text, a cubin or a fatbin: image.h), or the error
// the driver gives, logged under `symbol`.
CUresult DescribeImage(const void* image, int device_sm, const char* symbol, ptx::Module& parsed) {
  std::string error;
  bool from_ptx = false;
  if (!image::Describe(image, device_sm, InflateZstd, parsed, from_ptx, error)) {
    if (state::LogLevel() >= 1) state::LogError("%s: %s", symbol, error.c_str());
    if (image::Sniff(image) == image::Format::fatbin) return CUDA_ERROR_NO_BINARY_FOR_GPU;
    return from_ptx ? CUDA_ERROR_INVALID_PTX : CUDA_ERROR_INVALID_IMAGE;
  }
  if (parsed.target_sm > device_sm || (!from_ptx && parsed.target_sm / 10 != device_sm / 10)) {
    if (state::LogLevel() >= 1) {
      state::LogError("%s: %s targets sm_%d, the device is sm_%d", symbol, from_ptx ? "PTX" : "the cubin",
                      parsed.target_sm, device_sm);
    }
    return from_ptx ? CUDA_ERROR_INVALID_PTX : CUDA_ERROR_NO_BINARY_FOR_GPU;
  }
  return CUDA_SUCCESS;
}

int DeviceSm(const Driver& d, std::uint32_t physical) {
  const model::DeviceSpec& spec = Spec(d, physical);
  return static_cast<int>(spec.cc_major * 10 + spec.cc_minor);
}

// The module's variables, each 256-byte aligned in one mapping, their initial bytes copied in.
CUresult PlaceVariables(Driver& d, Context* c, const ptx::Module& parsed, Module& module) {
  constexpr std::uint64_t kAlign = 256;
  std::uint64_t total = 0;
  for (const ptx::Global& global : parsed.globals) total += (global.bytes + kAlign - 1) / kAlign * kAlign;
  if (total == 0) return CUDA_SUCCESS;
  if (const CUresult r = MapModuleData(d, c, total, module.data_base); r != CUDA_SUCCESS) return r;
  std::uint64_t offset = 0;
  for (const ptx::Global& global : parsed.globals) {
    auto* at = reinterpret_cast<std::uint8_t*>(module.data_base + offset);
    if (!global.initial.empty()) {
      std::memcpy(at, global.initial.data(), std::min<std::size_t>(global.initial.size(), global.bytes));
    }
    module.variables[global.name] = Module::Variable{reinterpret_cast<CUdeviceptr>(at), global.bytes};
    offset += (global.bytes + kAlign - 1) / kAlign * kAlign;
  }
  return CUDA_SUCCESS;
}

// The module of `parsed` in context `c`, its functions registered. Caller holds d.mutex.
CUresult MakeModule(Driver& d, Context* c, const ptx::Module& parsed, Module*& out) {
  auto module = std::make_unique<Module>();
  module->context = c;
  module->ptx_version = parsed.version;
  module->target_sm = parsed.target_sm;
  module->footprint_bytes = kModuleCodeBytes + RoundUpToPage(parsed.data_bytes);
  if (const CUresult r = PlaceVariables(d, c, parsed, *module); r != CUDA_SUCCESS) return r;
  if (d.eager_loading) {
    if (const CUresult r = LoadModuleFootprint(d, *module); r != CUDA_SUCCESS) {
      if (module->data_base != 0) UnmapModuleData(d, module->data_base);
      return r;
    }
  }
  for (const ptx::Entry& entry : parsed.entries) {
    auto* f = new Function();
    f->module = module.get();
    f->name = entry.name;
    f->local_bytes = entry.local_bytes;
    f->uses_malloc = entry.uses_malloc;
    for (const ptx::Param& p : entry.params) f->params.push_back({p.offset, p.size});
    f->param_bytes = entry.param_bytes;
    f->spin = entry.name == "vgpu_spin" && !entry.params.empty() && entry.params[0].size == 8;
    f->collective = entry.name == "vgpu_collective" && entry.params.size() == 3;
    f->per_wave_ns = CostOf(d, entry.name);
    module->functions[entry.name] = Register(d, f);
  }
  out = Register(d, module.release());
  return CUDA_SUCCESS;
}

// A module from PTX text, a cubin or a fatbin, in the current context. `symbol` names the entry point in the log
// line of a refusal.
CUresult LoadModule(CUmodule* out, const void* image, const char* symbol) {
  Driver& d = TheDriver();
  if (out == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  ptx::Module parsed;
  if (const CUresult r = DescribeImage(image, DeviceSm(d, c->device), symbol, parsed); r != CUDA_SUCCESS) return r;
  Module* module = nullptr;
  if (const CUresult r = MakeModule(d, c, parsed, module); r != CUDA_SUCCESS) return r;
  *out = reinterpret_cast<CUmodule>(module);
  return CUDA_SUCCESS;
}

// Frees the module's objects; its footprint is the caller's to give back (UnloadModule, or the context's teardown).
void DestroyModule(Driver& d, Module* module) {
  if (module->library != nullptr) module->library->modules.erase(module->context);
  if (module->data_base != 0) UnmapModuleData(d, module->data_base);
  for (auto& [name, f] : module->functions) {
    Unregister(d, f);
    delete f;
  }
  Unregister(d, module);
  delete module;
}

// Destroys a handle object that owns nothing else; `invalid` is what the real driver returns for a bad handle.
template <typename T>
CUresult DestroyObject(const void* handle, Kind kind, CUresult invalid) {
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  T* object = Lookup<T>(d, handle, kind);
  if (object == nullptr) return invalid;
  Unregister(d, object);
  delete object;
  return CUDA_SUCCESS;
}

std::vector<KernelNode> NodesOf(const std::vector<KernelNode>& nodes, Driver& d) {
  std::vector<KernelNode> live;
  for (const KernelNode& n : nodes) {
    if (Lookup<Function>(d, n.function, Kind::function) != nullptr) live.push_back(n);
  }
  return live;
}

}  // namespace

void ForgetHostWorkerAfterFork() { g_host_worker = nullptr; }  // the parent's stays the parent's

CUresult ResolveStream(Driver& d, CUstream handle, bool per_thread, ResolvedStream& out) {
  out = ResolvedStream{};
  Context* c = CurrentContext(d);
  Stream* s = nullptr;
  if (handle == nullptr || handle == CU_STREAM_LEGACY) {
    if (c == nullptr) return NoContextError(d);
    if (per_thread && handle == nullptr) {
      s = PerThreadStream(d, c);
      if (s == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      out.context = c;
      out.index = c->null_stream;
      out.generation = c->null_stream_generation;
      out.legacy = true;
      out.blocking = true;
      return CUDA_SUCCESS;
    }
  } else if (handle == CU_STREAM_PER_THREAD) {
    if (c == nullptr) return NoContextError(d);
    s = PerThreadStream(d, c);
    if (s == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    s = Lookup<Stream>(d, handle, Kind::stream);
    if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    out.stream = s;
  }
  out.context = s->context;
  out.index = s->index;
  out.generation = s->generation;
  out.blocking = (s->flags & CU_STREAM_NON_BLOCKING) == 0;
  return CUDA_SUCCESS;
}

void KeepEventEnds(Driver& d, const model::Machine& m, std::uint32_t index) {
  auto& awaiting = d.events_awaiting_end;
  for (std::size_t i = 0; i < awaiting.size();) {
    if (awaiting[i].stream != index) {
      ++i;
      continue;
    }
    Event* e = Lookup<Event>(d, awaiting[i].event, Kind::event);
    // (Not listed: destroyed, cached by a query, or recorded on another stream since.)
    const bool listed = e != nullptr && e->awaiting_end && e->stream == index && e->end_ns == 0;
    if (listed && !model::OpDone(m, index, e->generation, e->seq)) {
      ++i;
      continue;
    }
    if (listed && m.streams[index].generation == e->generation) e->end_ns = model::OpEndNs(m, index, e->seq);
    if (e != nullptr && e->stream == index) e->awaiting_end = false;
    awaiting[i] = awaiting.back();
    awaiting.pop_back();
  }
}

void QueueImplicitSync(Driver& d, model::Machine& m, const ResolvedStream& target, std::uint64_t now) {
  KeepEventEnds(d, m, target.index);
  if (!target.blocking) return;
  Context* c = target.context;
  if (target.legacy) {
    for (Stream* s : d.streams) {
      if (s->context != c || (s->flags & CU_STREAM_NON_BLOCKING) != 0) continue;
      const model::Stream& other = m.streams[s->index];
      if (other.generation == s->generation && other.tail > other.head) {
        model::EnqueueWait(m, target.index, s->index, s->generation, other.tail - 1, now);
      }
    }
  } else {
    const model::Stream& legacy = m.streams[c->null_stream];
    if (legacy.generation == c->null_stream_generation && legacy.tail > legacy.head) {
      model::EnqueueWait(m, target.index, c->null_stream, c->null_stream_generation, legacy.tail - 1, now);
    }
  }
}

CUresult WaitForOp(std::uint32_t device, std::uint32_t index, std::uint64_t generation, std::uint64_t seq) {
  Driver& d = TheDriver();
  state::Attachment* a = d.attachment;
  if (a == nullptr) return MachineGone();
  // When nothing bounds the wait (a host function, an event of another stream), back off exponentially so a
  // long wait costs no CPU; a known lower bound is slept exactly.
  std::uint64_t backoff_ns = kMinSleepNs;
  for (;;) {
    std::uint64_t lower_bound = 0;
    {
      state::MachineLock lock(*a);
      const std::uint64_t now = state::MonotonicNs();
      state::ReapDeadProcesses(*a, now, false);
      AdvanceAndPoll(*a, lock.machine(), device, now);
      if (model::OpDone(lock.machine(), index, generation, seq)) return CUDA_SUCCESS;
      lower_bound = model::LowerBoundRemainingNs(lock.machine(), index, seq);
    }
    // A wait on a word the host writes may be what holds the stream: look at the words again soon.
    if (g_value_wait_count.load(std::memory_order_acquire) != 0) backoff_ns = std::min(backoff_ns, kMinSleepNs);
    if (lower_bound >= kMinSleepNs) {
      state::SleepNs(SleepFor(lower_bound));
      backoff_ns = kMinSleepNs;
    } else {
      state::SleepNs(backoff_ns);
      backoff_ns = std::min<std::uint64_t>(backoff_ns * 2, kMaxBackoffNs);
    }
  }
}

CUresult WaitStreamIdle(std::uint32_t device, std::uint32_t index, std::uint64_t generation) {
  Driver& d = TheDriver();
  std::uint64_t last = 0;
  {
    state::MachineLock lock(*d.attachment);
    const model::Stream& s = lock.machine().streams[index];
    if (s.generation != generation || s.tail == 0 || s.head >= s.tail) return CUDA_SUCCESS;
    last = s.tail - 1;
  }
  return WaitForOp(device, index, generation, last);
}

CUresult WaitContextIdle(Context* c) {
  Driver& d = TheDriver();
  std::vector<std::pair<std::uint32_t, std::uint64_t>> streams;
  std::uint32_t device = 0;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    if (Lookup<Context>(d, c, Kind::context) == nullptr) return CUDA_SUCCESS;  // gone: nothing left to wait for
    device = c->device;
    streams.emplace_back(c->null_stream, c->null_stream_generation);
    for (Stream* s : d.streams) {
      if (s->context == c) streams.emplace_back(s->index, s->generation);
    }
  }
  for (const auto& [index, generation] : streams) {
    if (const CUresult r = WaitStreamIdle(device, index, generation); r != CUDA_SUCCESS) return r;
  }
  return CUDA_SUCCESS;
}

void TearDownContextStreamsAndModules(Driver& d, Context* c) {
  state::MachineLock lock(*d.attachment);
  model::Machine& m = lock.machine();
  for (auto it = d.streams.begin(); it != d.streams.end();) {
    if ((*it)->context == c) {
      model::DestroyStream(m, (*it)->index);
      Unregister(d, *it);
      delete *it;
      it = d.streams.erase(it);
    } else {
      ++it;
    }
  }
  model::DestroyStream(m, c->null_stream);
  std::vector<Module*> modules;
  for (const auto& [handle, kind] : d.handles) {
    if (kind == Kind::module && static_cast<const Module*>(handle)->context == c) {
      modules.push_back(static_cast<Module*>(const_cast<void*>(handle)));
    }
  }
  for (Module* module : modules) {
    if (module->loaded) c->charged_bytes += module->footprint_bytes;  // given back with the context's own memory
    DestroyModule(d, module);
  }
}

}  // namespace fakecuda::driver

using namespace fakecuda::driver;
namespace model = fakecuda::model;
namespace state = fakecuda::state;

// ---- modules and functions ---------------------------------------------------------------------------------

// As the real driver: lazy unless CUDA_MODULE_LOADING=EAGER (fakecuda charges a module's footprint at its first
// launch either way; FAKECUDA_LAZY_LOAD_NS).
FAKECUDA_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode* mode) {
  FAKECUDA_ENTER("cuModuleGetLoadingMode");
  if (mode == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const char* setting = std::getenv("CUDA_MODULE_LOADING");
  *mode = setting != nullptr && std::strcmp(setting, "EAGER") == 0 ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuModuleLoadData(CUmodule* module, const void* image) {
  FAKECUDA_ENTER("cuModuleLoadData");
  if (image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return LoadModule(module, image, "cuModuleLoadData");
}

FAKECUDA_EXPORT CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int count,
                                            CUjit_option* options, void** values) {
  FAKECUDA_ENTER("cuModuleLoadDataEx");
  if (image == nullptr || (count > 0 && (options == nullptr || values == nullptr))) return CUDA_ERROR_INVALID_VALUE;
  return LoadModule(module, image, "cuModuleLoadDataEx");  // JIT options do not change the cost model
}

FAKECUDA_EXPORT CUresult cuModuleLoad(CUmodule* module, const char* path) {
  FAKECUDA_ENTER("cuModuleLoad");
  if (path == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::ifstream file(path, std::ios::binary);
  if (!file) return CUDA_ERROR_FILE_NOT_FOUND;
  std::stringstream text;
  text << file.rdbuf();
  const std::string image = text.str();  // NUL-terminated: PTX text reads as a C string
  return LoadModule(module, image.c_str(), "cuModuleLoad");
}

FAKECUDA_EXPORT CUresult cuModuleLoadFatBinary(CUmodule* module, const void* fatbin) {
  FAKECUDA_ENTER("cuModuleLoadFatBinary");
  if (fatbin == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return LoadModule(module, fatbin, "cuModuleLoadFatBinary");
}

// ---- libraries (context-independent modules: what the CUDA runtime loads its kernels with) ----------------------

namespace {

// The library's module in the current context, made on first use. Caller holds d.mutex.
CUresult LibraryModule(Driver& d, Library& library, Module*& module) {
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  if (const auto it = library.modules.find(c); it != library.modules.end()) {
    module = it->second;
    return CUDA_SUCCESS;
  }
  const auto description = library.descriptions.find(DeviceSm(d, c->device));
  if (description == library.descriptions.end()) return CUDA_ERROR_NO_BINARY_FOR_GPU;
  if (const CUresult r = MakeModule(d, c, description->second, module); r != CUDA_SUCCESS) return r;
  module->library = &library;
  library.modules[c] = module;
  return CUDA_SUCCESS;
}

// The module of the library `handle` in the current context. Caller holds d.mutex.
CUresult LibraryModuleOf(Driver& d, CUlibrary handle, Module*& module) {
  Library* library = Lookup<Library>(d, handle, Kind::library);
  if (library == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return LibraryModule(d, *library, module);
}

}  // namespace

// What a CUfunction or a CUkernel handle stands for (the driver takes a CUkernel wherever it takes a CUfunction): the
// function itself, or a library kernel's function in the current context. Null if neither, or a kernel with no
// context current. Caller holds d.mutex.
Function* fakecuda::driver::LookupFunction(Driver& d, const void* handle) {
  if (Function* f = Lookup<Function>(d, handle, Kind::function)) return f;
  Kernel* kernel = Lookup<Kernel>(d, handle, Kind::kernel);
  if (kernel == nullptr) return nullptr;
  Module* module = nullptr;
  if (LibraryModule(d, *kernel->library, module) != CUDA_SUCCESS) return nullptr;
  const auto it = module->functions.find(kernel->name);
  return it == module->functions.end() ? nullptr : it->second;
}

// Reads the image for every device architecture of the machine (the image need not outlive the call). Library and
// JIT options change nothing fakecuda models.
FAKECUDA_EXPORT CUresult cuLibraryLoadData(CUlibrary* out, const void* code, CUjit_option* jit_options,
                                           void** jit_values, unsigned int jit_count, CUlibraryOption* options,
                                           void** values, unsigned int count) {
  FAKECUDA_ENTER("cuLibraryLoadData");
  if (out == nullptr || code == nullptr || (jit_count > 0 && (jit_options == nullptr || jit_values == nullptr)) ||
      (count > 0 && (options == nullptr || values == nullptr))) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto library = std::make_unique<Library>();
  for (const std::uint32_t physical : d.visible) {
    const int sm = DeviceSm(d, physical);
    if (library->descriptions.count(sm) != 0) continue;
    fakecuda::ptx::Module parsed;
    if (const CUresult r = DescribeImage(code, sm, "cuLibraryLoadData", parsed); r != CUDA_SUCCESS) return r;
    library->descriptions[sm] = std::move(parsed);
  }
  *out = reinterpret_cast<CUlibrary>(Register(d, library.release()));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuLibraryUnload(CUlibrary handle) {
  FAKECUDA_ENTER("cuLibraryUnload");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Library* library = Lookup<Library>(d, handle, Kind::library);
  if (library == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  while (!library->modules.empty()) {
    Module* module = library->modules.begin()->second;
    if (module->loaded) UnchargeDevice(d, module->context->device, module->footprint_bytes);
    DestroyModule(d, module);  // erases itself from library->modules
  }
  for (const auto& [name, kernel] : library->kernels) {
    Unregister(d, kernel);
    delete kernel;
  }
  Unregister(d, library);
  delete library;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuLibraryGetModule(CUmodule* out, CUlibrary handle) {
  FAKECUDA_ENTER("cuLibraryGetModule");
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Module* module = nullptr;
  if (const CUresult r = LibraryModuleOf(d, handle, module); r != CUDA_SUCCESS) return r;
  *out = reinterpret_cast<CUmodule>(module);
  return CUDA_SUCCESS;
}

// Needs no context (the runtime asks for a kernel on a thread before it makes a context current there): the handle
// is the library's, one per name.
FAKECUDA_EXPORT CUresult cuLibraryGetKernel(CUkernel* out, CUlibrary handle, const char* name) {
  FAKECUDA_ENTER("cuLibraryGetKernel");
  if (out == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Library* library = Lookup<Library>(d, handle, Kind::library);
  if (library == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const auto has_entry = [&](const auto& description) {
    const std::vector<fakecuda::ptx::Entry>& entries = description.second.entries;
    return std::any_of(entries.begin(), entries.end(),
                       [&](const fakecuda::ptx::Entry& entry) { return entry.name == name; });
  };
  if (std::none_of(library->descriptions.begin(), library->descriptions.end(), has_entry)) {
    return CUDA_ERROR_NOT_FOUND;
  }
  Kernel*& kernel = library->kernels[name];
  if (kernel == nullptr) {
    kernel = new Kernel();
    kernel->library = library;
    kernel->name = name;
    Register(d, kernel);
  }
  *out = reinterpret_cast<CUkernel>(kernel);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuLibraryGetKernelCount(unsigned int* count, CUlibrary handle) {
  FAKECUDA_ENTER("cuLibraryGetKernelCount");
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Library* library = Lookup<Library>(d, handle, Kind::library);
  if (library == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *count = library->descriptions.empty()
               ? 0
               : static_cast<unsigned int>(library->descriptions.begin()->second.entries.size());
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuKernelGetFunction(CUfunction* out, CUkernel kernel) {
  FAKECUDA_ENTER("cuKernelGetFunction");
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, kernel);
  if (f == nullptr && Lookup<Kernel>(d, kernel, Kind::kernel) != nullptr && CurrentContext(d) == nullptr) {
    return NoContextError(d);
  }
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *out = reinterpret_cast<CUfunction>(f);
  return CUDA_SUCCESS;
}

// A kernel's attributes are its function's (the kernel is the function of the current context's module); `device`
// must be a device of the machine.
FAKECUDA_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute attribute, int value, CUkernel kernel,
                                              CUdevice device) {
  FAKECUDA_ENTER("cuKernelSetAttribute");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  return cuFuncSetAttribute(reinterpret_cast<CUfunction>(kernel), attribute, value);
}

FAKECUDA_EXPORT CUresult cuKernelGetAttribute(int* value, CUfunction_attribute attribute, CUkernel kernel,
                                              CUdevice device) {
  FAKECUDA_ENTER("cuKernelGetAttribute");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  return cuFuncGetAttribute(value, attribute, reinterpret_cast<CUfunction>(kernel));
}

FAKECUDA_EXPORT CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice device) {
  FAKECUDA_ENTER("cuKernelSetCacheConfig");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  return cuFuncSetCacheConfig(reinterpret_cast<CUfunction>(kernel), config);
}

FAKECUDA_EXPORT CUresult cuKernelGetName(const char** name, CUkernel kernel) {
  FAKECUDA_ENTER("cuKernelGetName");
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (Kernel* k = Lookup<Kernel>(d, kernel, Kind::kernel)) {  // its name needs no context
    *name = k->name.c_str();
    return CUDA_SUCCESS;
  }
  Function* f = LookupFunction(d, kernel);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *name = f->name.c_str();
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuKernelGetParamInfo(CUkernel kernel, size_t index, size_t* offset, size_t* size) {
  FAKECUDA_ENTER("cuKernelGetParamInfo");
  if (offset == nullptr && size == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, kernel);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (index >= f->params.size()) return CUDA_ERROR_INVALID_VALUE;
  if (offset != nullptr) *offset = f->params[index].offset;
  if (size != nullptr) *size = f->params[index].size;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuModuleUnload(CUmodule handle) {
  FAKECUDA_ENTER("cuModuleUnload");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Module* module = Lookup<Module>(d, handle, Kind::module);
  if (module == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (module->loaded) UnchargeDevice(d, module->context->device, module->footprint_bytes);
  DestroyModule(d, module);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuModuleGetFunction(CUfunction* function, CUmodule handle, const char* name) {
  FAKECUDA_ENTER("cuModuleGetFunction");
  if (function == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Module* module = Lookup<Module>(d, handle, Kind::module);
  if (module == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const auto it = module->functions.find(name);
  if (it == module->functions.end()) return CUDA_ERROR_NOT_FOUND;
  *function = reinterpret_cast<CUfunction>(it->second);
  return CUDA_SUCCESS;
}

namespace {
// A module variable's address and size, either optional. Caller holds d.mutex.
CUresult FindVariable(const Module& module, const char* name, CUdeviceptr* address, size_t* bytes) {
  const auto it = module.variables.find(name);
  if (it == module.variables.end()) return CUDA_ERROR_NOT_FOUND;
  if (address != nullptr) *address = it->second.address;
  if (bytes != nullptr) *bytes = it->second.bytes;
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr* address, size_t* bytes, CUmodule handle, const char* name) {
  FAKECUDA_ENTER("cuModuleGetGlobal_v2");
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  const Module* module = Lookup<Module>(d, handle, Kind::module);
  if (module == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return FindVariable(*module, name, address, bytes);
}

FAKECUDA_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr* address, size_t* bytes, CUlibrary handle, const char* name) {
  FAKECUDA_ENTER("cuLibraryGetGlobal");
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Module* module = nullptr;
  if (const CUresult r = LibraryModuleOf(d, handle, module); r != CUDA_SUCCESS) return r;
  return FindVariable(*module, name, address, bytes);
}

FAKECUDA_EXPORT CUresult cuFuncGetAttribute(int* value, CUfunction_attribute attribute, CUfunction handle) {
  FAKECUDA_ENTER("cuFuncGetAttribute");
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, handle);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const model::DeviceSpec& spec = Spec(d, f->module->context->device);
  switch (attribute) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
      *value = static_cast<int>(spec.max_threads_per_block);
      break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES:
      *value = 0;
      break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES:
      *value = 0;
      break;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES:
      *value = static_cast<int>(std::min<std::uint64_t>(f->local_bytes, INT32_MAX));
      break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS:
      *value = 32;
      break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
      *value = f->module->ptx_version;
      break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION:
      *value = static_cast<int>(spec.cc_major * 10 + spec.cc_minor);
      break;
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA:
      *value = 0;
      break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
      *value = f->max_dynamic_shared;
      break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
      *value = f->carveout;
      break;
    default:
      if (static_cast<int>(attribute) < 0 || attribute >= CU_FUNC_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
      *value = 0;
  }
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuFuncSetAttribute(CUfunction handle, CUfunction_attribute attribute, int value) {
  FAKECUDA_ENTER("cuFuncSetAttribute");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, handle);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const model::DeviceSpec& spec = Spec(d, f->module->context->device);
  if (attribute == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (value < 0 || value > static_cast<int>(spec.shared_bytes_per_sm) - 1024) return CUDA_ERROR_INVALID_VALUE;
    f->max_dynamic_shared = value;
    return CUDA_SUCCESS;
  }
  if (attribute == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
    if (value < -1 || value > 100) return CUDA_ERROR_INVALID_VALUE;
    f->carveout = value;
    return CUDA_SUCCESS;
  }
  // Thread block clusters (sm_90 on): accepted within the driver's bounds; the model runs blocks, not clusters.
  const bool clusters = spec.cc_major >= 9;
  switch (attribute) {
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
      return clusters && value >= 0 && value <= 16 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
      return clusters && (value == 0 || value == 1) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
      return clusters && value >= 0 && value <= 2 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
}

FAKECUDA_EXPORT CUresult cuFuncSetCacheConfig(CUfunction handle, CUfunc_cache config) {
  FAKECUDA_ENTER("cuFuncSetCacheConfig");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (LookupFunction(d, handle) == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return static_cast<int>(config) < 0 || config > CU_FUNC_CACHE_PREFER_EQUAL ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuFuncGetName(const char** name, CUfunction handle) {
  FAKECUDA_ENTER("cuFuncGetName");
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, handle);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *name = f->name.c_str();
  return CUDA_SUCCESS;
}

namespace {
CUresult MaxActiveBlocks(int* blocks, CUfunction handle, int block_size, size_t dynamic_shared) {
  if (blocks == nullptr || block_size <= 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, handle);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  model::LaunchShape shape{
      {1, 1, 1}, {static_cast<std::uint32_t>(block_size), 1, 1}, static_cast<std::uint32_t>(dynamic_shared)};
  *blocks = static_cast<int>(model::ResidentBlocksPerSm(Spec(d, f->module->context->device), shape));
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, CUfunction handle, int block_size,
                                                                     size_t dynamic_shared) {
  FAKECUDA_ENTER("cuOccupancyMaxActiveBlocksPerMultiprocessor");
  return MaxActiveBlocks(blocks, handle, block_size, dynamic_shared);
}

// The flags (CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE) concern the L1 cache, which the model has not.
FAKECUDA_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, CUfunction handle,
                                                                              int block_size, size_t dynamic_shared,
                                                                              unsigned int flags) {
  FAKECUDA_ENTER("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags");
  if (flags > CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE) return CUDA_ERROR_INVALID_VALUE;
  return MaxActiveBlocks(blocks, handle, block_size, dynamic_shared);
}

// How many clusters of the launch's shape can be resident at once: the blocks the SMs hold together, in clusters of the
// launch's cluster dimension (1 without one). The model does not place clusters in GPCs.
FAKECUDA_EXPORT CUresult cuOccupancyMaxActiveClusters(int* clusters, CUfunction handle, const CUlaunchConfig* config) {
  FAKECUDA_ENTER("cuOccupancyMaxActiveClusters");
  if (clusters == nullptr || config == nullptr || (config->numAttrs > 0 && config->attrs == nullptr)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::uint64_t cluster_blocks = 1;
  for (unsigned int i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id != CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) continue;
    const auto& dim = config->attrs[i].value.clusterDim;
    cluster_blocks = std::uint64_t{dim.x} * dim.y * dim.z;
  }
  if (cluster_blocks == 0 || cluster_blocks > 16) return CUDA_ERROR_INVALID_CLUSTER_SIZE;
  int per_sm = 0;
  const int block = static_cast<int>(config->blockDimX * config->blockDimY * config->blockDimZ);
  if (const CUresult r = MaxActiveBlocks(&per_sm, handle, block, config->sharedMemBytes); r != CUDA_SUCCESS) return r;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, handle);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const std::uint64_t resident = std::uint64_t{Spec(d, f->module->context->device).sm_count} * per_sm;
  *clusters = static_cast<int>(resident / cluster_blocks);
  return CUDA_SUCCESS;
}

// The most dynamic shared memory a block may ask for with `blocks` of `block_size` threads resident on an SM: the SM's
// shared memory split among them, less the 1 KiB each block reserves, at most the function's maximum.
FAKECUDA_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* bytes, CUfunction handle, int blocks,
                                                                 int block_size) {
  FAKECUDA_ENTER("cuOccupancyAvailableDynamicSMemPerBlock");
  if (bytes == nullptr || blocks <= 0 || block_size <= 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, handle);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const model::DeviceSpec& spec = Spec(d, f->module->context->device);
  constexpr std::uint64_t kReservedPerBlock = 1024;
  const std::uint64_t share = spec.shared_bytes_per_sm / static_cast<std::uint64_t>(blocks);
  // At most what the function may ask for: 48 KiB unless CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES opted in.
  const auto per_block_max = static_cast<std::uint64_t>(f->max_dynamic_shared);
  *bytes = share > kReservedPerBlock ? std::min(share - kReservedPerBlock, per_block_max) : 0;
  return CUDA_SUCCESS;
}

// ---- launches --------------------------------------------------------------------------------------------

#define FAKECUDA_LAUNCH_KERNEL(symbol, per_thread, cooperative)                                                      \
  FAKECUDA_EXPORT CUresult symbol(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,  \
                                  unsigned int by, unsigned int bz, unsigned int shared, CUstream stream,            \
                                  void** params, void** extra) {                                                     \
    return Launch({#symbol, f, {gx, gy, gz}, {bx, by, bz}, shared, stream, params, extra, per_thread, cooperative}); \
  }
FAKECUDA_LAUNCH_KERNEL(cuLaunchKernel, false, false)
FAKECUDA_LAUNCH_KERNEL(cuLaunchKernel_ptsz, true, false)
#undef FAKECUDA_LAUNCH_KERNEL

FAKECUDA_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                   unsigned int bx, unsigned int by, unsigned int bz,
                                                   unsigned int shared, CUstream stream, void** params) {
  return Launch(
      {"cuLaunchCooperativeKernel", f, {gx, gy, gz}, {bx, by, bz}, shared, stream, params, nullptr, false, true});
}

extern "C" __attribute__((visibility("default"))) CUresult cuLaunchCooperativeKernel_ptsz(
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
    unsigned int shared, CUstream stream, void** params) {
  return Launch(
      {"cuLaunchCooperativeKernel_ptsz", f, {gx, gy, gz}, {bx, by, bz}, shared, stream, params, nullptr, true, true});
}

FAKECUDA_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra) {
  return LaunchEx("cuLaunchKernelEx", config, f, params, extra, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig* config,
                                                                                 CUfunction f, void** params,
                                                                                 void** extra) {
  return LaunchEx("cuLaunchKernelEx_ptsz", config, f, params, extra, true);
}

namespace {

CUresult LaunchHostFunc(const char* symbol, CUstream handle, CUhostFn function, void* data, bool per_thread) {
  FAKECUDA_ENTER(symbol);
  if (function == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  for (;;) {
    ResolvedStream rs;
    if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
    if (rs.stream != nullptr && rs.stream->capture != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    std::uint64_t seq = 0;
    std::uint64_t wait_ns = 0;
    bool queued = false;
    {
      state::MachineLock lock(*d.attachment);
      const std::uint64_t now = state::MonotonicNs();
      QueueImplicitSync(d, lock.machine(), rs, now);
      queued = model::EnqueueGate(lock.machine(), rs.index, now, &seq) == model::EnqueueResult::ok;
      if (!queued)
        wait_ns = model::LowerBoundRemainingNs(lock.machine(), rs.index, lock.machine().streams[rs.index].head);
    }
    if (queued) {
      const CUresult submitted = SubmitHostCall({rs.context->device, rs.index, rs.generation, seq, function, data});
      if (submitted != CUDA_SUCCESS) {  // never leave a gate that nothing will open
        state::MachineLock lock(*d.attachment);
        model::OpenGate(lock.machine(), rs.index, seq);
      }
      return submitted;
    }
    guard.unlock();  // the stream's queue is full: wait for room, as a launch does
    state::SleepNs(SleepFor(wait_ns));
    guard.lock();
  }
}

struct StreamCallbackData {
  CUstreamCallback callback;
  CUstream stream;
  void* user_data;
};

void RunStreamCallback(void* raw) {
  auto* data = static_cast<StreamCallbackData*>(raw);
  data->callback(data->stream, CUDA_SUCCESS, data->user_data);
  delete data;
}

}  // namespace

FAKECUDA_EXPORT CUresult cuLaunchHostFunc(CUstream stream, CUhostFn function, void* data) {
  return LaunchHostFunc("cuLaunchHostFunc", stream, function, data, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuLaunchHostFunc_ptsz(CUstream stream, CUhostFn function,
                                                                                 void* data) {
  return LaunchHostFunc("cuLaunchHostFunc_ptsz", stream, function, data, true);
}

FAKECUDA_EXPORT CUresult cuStreamAddCallback(CUstream stream, CUstreamCallback callback, void* data,
                                             unsigned int flags) {
  if (callback == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  auto* wrapped = new StreamCallbackData{callback, stream, data};
  const CUresult r = LaunchHostFunc("cuStreamAddCallback", stream, &RunStreamCallback, wrapped, false);
  if (r != CUDA_SUCCESS) delete wrapped;
  return r;
}

// ---- streams -----------------------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  FAKECUDA_ENTER("cuStreamCreate");
  return CreateStreamCommon(stream, flags, 0);
}

FAKECUDA_EXPORT CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned int flags, int priority) {
  FAKECUDA_ENTER("cuStreamCreateWithPriority");
  return CreateStreamCommon(stream, flags, priority);
}

namespace {
// cuStreamDestroy_v2 and cuStreamDestroy: one body, each entry point checked under its own name.
CUresult StreamDestroyEntry(const char* symbol, CUstream handle) {
  FAKECUDA_ENTER(symbol);
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Stream* s = Lookup<Stream>(d, handle, Kind::stream);
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  {
    state::MachineLock lock(*d.attachment);
    model::DestroyStream(lock.machine(), s->index);
  }
  d.streams.erase(std::remove(d.streams.begin(), d.streams.end(), s), d.streams.end());
  Unregister(d, s);
  delete s->capture;
  delete s;
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuStreamDestroy_v2(CUstream handle) {
  return StreamDestroyEntry("cuStreamDestroy_v2", handle);
}

#undef cuStreamDestroy  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuStreamDestroy(CUstream handle) { return StreamDestroyEntry("cuStreamDestroy", handle); }

FAKECUDA_EXPORT CUresult cuStreamQuery(CUstream stream) {
  FAKECUDA_ENTER("cuStreamQuery");
  return StreamQuery(stream, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuStreamQuery_ptsz(CUstream stream) {
  FAKECUDA_ENTER("cuStreamQuery_ptsz");
  return StreamQuery(stream, true);
}

FAKECUDA_EXPORT CUresult cuStreamSynchronize(CUstream stream) {
  FAKECUDA_ENTER("cuStreamSynchronize");
  return StreamSynchronize(stream, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuStreamSynchronize_ptsz(CUstream stream) {
  FAKECUDA_ENTER("cuStreamSynchronize_ptsz");
  return StreamSynchronize(stream, true);
}

FAKECUDA_EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  FAKECUDA_ENTER("cuStreamWaitEvent");
  return StreamWaitEvent(stream, event, flags, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuStreamWaitEvent_ptsz(CUstream stream, CUevent event,
                                                                                  unsigned int flags) {
  FAKECUDA_ENTER("cuStreamWaitEvent_ptsz");
  return StreamWaitEvent(stream, event, flags, true);
}

namespace {

CUresult StreamWaitValue(const char* symbol, CUstream handle, CUdeviceptr address, std::uint64_t value,
                         unsigned int flags, bool wide, bool per_thread) {
  FAKECUDA_ENTER(symbol);
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  // The condition is in the two low bits; CU_STREAM_WAIT_VALUE_FLUSH (1 << 30) is accepted and means nothing here.
  if ((flags & ~(0x3u | CU_STREAM_WAIT_VALUE_FLUSH)) != 0) return CUDA_ERROR_INVALID_VALUE;
  const std::size_t bytes = wide ? 8 : 4;
  if (address == 0 || address % bytes != 0 || !DeviceRangeValid(d, static_cast<std::uintptr_t>(address), bytes)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
  if (rs.stream != nullptr && rs.stream->capture != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  ValueWait wait{rs.index, rs.generation, 0, static_cast<std::uintptr_t>(address), value, flags, wide};
  state::MachineLock lock(*d.attachment);
  model::Machine& m = lock.machine();
  const std::uint64_t now = state::MonotonicNs();
  AdvanceAndPoll(*d.attachment, m, rs.context->device, now);
  QueueImplicitSync(d, m, rs, now);
  if (model::EnqueueGate(m, rs.index, now, &wait.seq) != model::EnqueueResult::ok) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ValueWaitHolds(wait)) {
    model::OpenGate(m, rs.index, wait.seq);
    return CUDA_SUCCESS;
  }
  std::lock_guard<std::mutex> waits(g_value_mutex);
  try {
    if (g_value_waits == nullptr) g_value_waits = new std::vector<ValueWait>();
    g_value_waits->push_back(wait);
  } catch (const std::bad_alloc&) {
    model::OpenGate(m, rs.index, wait.seq);  // never leave a gate that nothing will open
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  g_value_wait_count.store(g_value_waits->size(), std::memory_order_release);
  return CUDA_SUCCESS;
}

}  // namespace

namespace fakecuda::driver {

void ForgetValueWaitsIn(std::uintptr_t begin, std::uintptr_t end) {
  if (g_value_wait_count.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> guard(g_value_mutex);
  std::vector<ValueWait>& waits = *g_value_waits;
  // (Their gates stay shut, as a real GPU's would on memory nobody writes any more.)
  waits.erase(std::remove_if(waits.begin(), waits.end(),
                             [&](const ValueWait& w) { return w.address >= begin && w.address < end; }),
              waits.end());
  g_value_wait_count.store(waits.size(), std::memory_order_release);
}

}  // namespace fakecuda::driver

#define FAKECUDA_WAIT_VALUE(symbol, type, wide, per_thread)                                                           \
  extern "C" __attribute__((visibility("default"))) CUresult symbol(CUstream stream, CUdeviceptr address, type value, \
                                                                    unsigned int flags) {                             \
    return StreamWaitValue(#symbol, stream, address, value, flags, wide, per_thread);                                 \
  }
FAKECUDA_WAIT_VALUE(cuStreamWaitValue32_ptsz, cuuint32_t, false, true)
FAKECUDA_WAIT_VALUE(cuStreamWaitValue32_v2, cuuint32_t, false, false)
FAKECUDA_WAIT_VALUE(cuStreamWaitValue32_v2_ptsz, cuuint32_t, false, true)
FAKECUDA_WAIT_VALUE(cuStreamWaitValue64_v2, cuuint64_t, true, false)
FAKECUDA_WAIT_VALUE(cuStreamWaitValue64_v2_ptsz, cuuint64_t, true, true)
#undef cuStreamWaitValue32  // cuda.h maps the names to their newest versions; these define the older symbols
#undef cuStreamWaitValue64
FAKECUDA_WAIT_VALUE(cuStreamWaitValue32, cuuint32_t, false, false)
FAKECUDA_WAIT_VALUE(cuStreamWaitValue64, cuuint64_t, true, false)
FAKECUDA_WAIT_VALUE(cuStreamWaitValue64_ptsz, cuuint64_t, true, true)
#undef FAKECUDA_WAIT_VALUE

FAKECUDA_EXPORT CUresult cuStreamGetPriority(CUstream handle, int* priority) {
  FAKECUDA_ENTER("cuStreamGetPriority");
  if (priority == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, false, rs); r != CUDA_SUCCESS) return r;
  *priority = rs.stream != nullptr ? rs.stream->priority : 0;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuStreamGetFlags(CUstream handle, unsigned int* flags) {
  FAKECUDA_ENTER("cuStreamGetFlags");
  if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, false, rs); r != CUDA_SUCCESS) return r;
  *flags = rs.stream != nullptr ? rs.stream->flags : 0;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuStreamGetCtx(CUstream handle, CUcontext* context) {
  FAKECUDA_ENTER("cuStreamGetCtx");
  if (context == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, false, rs); r != CUDA_SUCCESS) return r;
  *context = reinterpret_cast<CUcontext>(rs.context);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuStreamGetId(CUstream handle, unsigned long long* id) {
  FAKECUDA_ENTER("cuStreamGetId");
  if (id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, false, rs); r != CUDA_SUCCESS) return r;
  *id = rs.generation;
  return CUDA_SUCCESS;
}

// ---- events ------------------------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  FAKECUDA_ENTER("cuEventCreate");
  constexpr unsigned int kValid = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (event == nullptr || (flags & ~kValid) != 0) return CUDA_ERROR_INVALID_VALUE;
  if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (CurrentContext(d) == nullptr) return NoContextError(d);
  auto* e = new Event();
  e->flags = flags;
  *event = reinterpret_cast<CUevent>(Register(d, e));
  return CUDA_SUCCESS;
}

namespace {
// cuEventDestroy_v2 and cuEventDestroy: one body, each entry point checked under its own name.
CUresult EventDestroyEntry(const char* symbol, CUevent handle) {
  FAKECUDA_ENTER(symbol);
  return DestroyObject<Event>(handle, Kind::event, CUDA_ERROR_INVALID_HANDLE);
}
}  // namespace

FAKECUDA_EXPORT CUresult cuEventDestroy_v2(CUevent handle) { return EventDestroyEntry("cuEventDestroy_v2", handle); }

#undef cuEventDestroy  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuEventDestroy(CUevent handle) { return EventDestroyEntry("cuEventDestroy", handle); }

FAKECUDA_EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
  FAKECUDA_ENTER("cuEventRecord");
  return EventRecord(event, stream, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuEventRecord_ptsz(CUevent event, CUstream stream) {
  FAKECUDA_ENTER("cuEventRecord_ptsz");
  return EventRecord(event, stream, true);
}

FAKECUDA_EXPORT CUresult cuEventRecordWithFlags(CUevent event, CUstream stream, unsigned int flags) {
  FAKECUDA_ENTER("cuEventRecordWithFlags");
  if ((flags & ~static_cast<unsigned int>(CU_EVENT_RECORD_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
  return EventRecord(event, stream, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuEventRecordWithFlags_ptsz(CUevent event, CUstream stream,
                                                                                       unsigned int flags) {
  FAKECUDA_ENTER("cuEventRecordWithFlags_ptsz");
  if ((flags & ~static_cast<unsigned int>(CU_EVENT_RECORD_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
  return EventRecord(event, stream, true);
}

FAKECUDA_EXPORT CUresult cuEventQuery(CUevent handle) {
  FAKECUDA_ENTER("cuEventQuery");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (const CUresult r = CheckUnsafeDuringCapture(d); r != CUDA_SUCCESS) return r;
  Event* e = Lookup<Event>(d, handle, Kind::event);
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (!e->recorded) return CUDA_SUCCESS;
  return EventEndNs(d, *e) != 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FAKECUDA_EXPORT CUresult cuEventSynchronize(CUevent handle) {
  FAKECUDA_ENTER("cuEventSynchronize");
  Driver& d = TheDriver();
  std::uint32_t device = 0, stream = 0;
  std::uint64_t generation = 0, seq = 0;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    Event* e = Lookup<Event>(d, handle, Kind::event);
    if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (!e->recorded) return CUDA_SUCCESS;
    device = e->device;
    stream = e->stream;
    generation = e->generation;
    seq = e->seq;
  }
  const CUresult r = WaitForOp(device, stream, generation, seq);
  std::lock_guard<std::mutex> guard(d.mutex);
  if (Event* e = Lookup<Event>(d, handle, Kind::event); e != nullptr && e->recorded) EventEndNs(d, *e);
  TrimPoolsAtSync(d);
  return r;
}

namespace {
// cuEventElapsedTime_v2 and cuEventElapsedTime: one body, each entry point checked under its own name.
CUresult EventElapsedTimeEntry(const char* symbol, float* milliseconds, CUevent start_handle, CUevent end_handle) {
  FAKECUDA_ENTER(symbol);
  if (milliseconds == nullptr) return CUDA_ERROR_INVALID_HANDLE;  // observed on an H100, driver 580.159.04
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Event* start = Lookup<Event>(d, start_handle, Kind::event);
  Event* end = Lookup<Event>(d, end_handle, Kind::event);
  if (start == nullptr || end == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if ((start->flags & CU_EVENT_DISABLE_TIMING) != 0 || (end->flags & CU_EVENT_DISABLE_TIMING) != 0) {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (!start->recorded || !end->recorded) return CUDA_ERROR_INVALID_HANDLE;
  const std::uint64_t t0 = EventEndNs(d, *start);
  const std::uint64_t t1 = EventEndNs(d, *end);
  if (t0 == 0 || t1 == 0) return CUDA_ERROR_NOT_READY;
  *milliseconds = static_cast<float>((static_cast<double>(t1) - static_cast<double>(t0)) / 1e6);
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuEventElapsedTime_v2(float* milliseconds, CUevent start_handle, CUevent end_handle) {
  return EventElapsedTimeEntry("cuEventElapsedTime_v2", milliseconds, start_handle, end_handle);
}

#undef cuEventElapsedTime  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuEventElapsedTime(float* milliseconds, CUevent start, CUevent end) {
  return EventElapsedTimeEntry("cuEventElapsedTime", milliseconds, start, end);
}

// ---- graphs ------------------------------------------------------------------------------------------------

namespace {

CUresult BeginCapture(CUstream handle, CUstreamCaptureMode mode, bool per_thread) {
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
  if (rs.stream == nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // legacy/per-thread default streams
  if (rs.stream->capture != nullptr) return CUDA_ERROR_ILLEGAL_STATE;
  if (static_cast<int>(mode) < 0 || mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
  rs.stream->capture = new Graph();
  rs.stream->capture_mode = mode;
  rs.stream->capture_id = d.next_capture_id++;
  return CUDA_SUCCESS;
}

CUresult EndCapture(CUstream handle, CUgraph* graph, bool per_thread) {
  if (graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
  if (rs.stream == nullptr || rs.stream->capture == nullptr) return CUDA_ERROR_ILLEGAL_STATE;
  if (rs.stream->capture_invalidated) {
    delete rs.stream->capture;
    rs.stream->capture = nullptr;
    rs.stream->capture_invalidated = false;
    *graph = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  Graph* g = Register(d, rs.stream->capture);
  rs.stream->capture = nullptr;
  for (std::size_t i = 0; i < g->nodes.size(); ++i) {
    g->node_tokens.push_back(std::make_unique<std::uint32_t>(static_cast<std::uint32_t>(i)));
    d.handles.emplace(g->node_tokens.back().get(), Kind::graph_node);
  }
  *graph = reinterpret_cast<CUgraph>(g);
  return CUDA_SUCCESS;
}

CUresult IsCapturing(CUstream handle, CUstreamCaptureStatus* status, bool per_thread) {
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
  *status = rs.stream != nullptr && rs.stream->capture != nullptr ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                                                  : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

// A stream's capture as cuStreamGetCaptureInfo (and its _v2, _v3) tells it: the status and capture id; from _v2 the
// graph being built and what the next node captured will depend on (the last node: a stream's capture is a chain);
// from _v3 that edge's data (the default). Each output but the status is optional.
struct CaptureInfoOut {
  CUstreamCaptureStatus* status = nullptr;
  cuuint64_t* id = nullptr;
  CUgraph* graph = nullptr;
  const CUgraphNode** dependencies = nullptr;
  const CUgraphEdgeData** edges = nullptr;
  size_t* count = nullptr;
};

CUresult CaptureInfo(CUstream handle, bool per_thread, const CaptureInfoOut& out) {
  if (out.status == nullptr || (out.edges != nullptr && out.count == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, per_thread, rs); r != CUDA_SUCCESS) return r;
  Stream* s = rs.stream;
  const bool active = s != nullptr && s->capture != nullptr;
  *out.status = active ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  if (!active) return CUDA_SUCCESS;  // the other outputs are undefined when nothing is captured
  if (out.id != nullptr) *out.id = s->capture_id;
  if (out.graph != nullptr) *out.graph = reinterpret_cast<CUgraph>(s->capture);
  const bool any = !s->capture->node_tokens.empty();
  s->capture_dependency = any ? reinterpret_cast<CUgraphNode>(s->capture->node_tokens.back().get()) : nullptr;
  s->capture_edge = CUgraphEdgeData{};
  if (out.dependencies != nullptr) *out.dependencies = any ? &s->capture_dependency : nullptr;
  if (out.edges != nullptr) *out.edges = any ? &s->capture_edge : nullptr;
  if (out.count != nullptr) *out.count = any ? 1 : 0;
  return CUDA_SUCCESS;
}

CUresult Instantiate(CUgraphExec* exec, CUgraph handle) {
  if (exec == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Graph* g = Lookup<Graph>(d, handle, Kind::graph);
  if (g == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto* e = new GraphExec();
  e->nodes = g->nodes;
  *exec = reinterpret_cast<CUgraphExec>(Register(d, e));
  return CUDA_SUCCESS;
}

CUresult GraphLaunch(CUgraphExec handle, CUstream stream, bool per_thread) {
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  GraphExec* e = Lookup<GraphExec>(d, handle, Kind::graph_exec);
  if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const std::vector<KernelNode> nodes = NodesOf(e->nodes, d);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, stream, per_thread, rs); r != CUDA_SUCCESS) return r;
  if (rs.stream != nullptr && rs.stream->capture != nullptr) {
    rs.stream->capture->nodes.insert(rs.stream->capture->nodes.end(), nodes.begin(), nodes.end());
    return CUDA_SUCCESS;
  }
  for (const KernelNode& node : nodes) {
    if (const CUresult taken = TakeLaunchMemory(d, *node.function, *rs.context); taken != CUDA_SUCCESS) return taken;
  }
  return EnqueueKernels(d, guard, stream, per_thread, nodes);
}

}  // namespace

// The CUDA 10.0 entry points (cuda.h no longer declares them; the driver still exports them): no mode, a global one.
#undef cuStreamBeginCapture  // cuda.h maps the name to its newest version; this defines the older symbol
extern "C" __attribute__((visibility("default"))) CUresult cuStreamBeginCapture(CUstream stream) {
  FAKECUDA_ENTER("cuStreamBeginCapture");
  return BeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuStreamBeginCapture_ptsz(CUstream stream) {
  FAKECUDA_ENTER("cuStreamBeginCapture_ptsz");
  return BeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL, true);
}

FAKECUDA_EXPORT CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode) {
  FAKECUDA_ENTER("cuStreamBeginCapture_v2");
  return BeginCapture(stream, mode, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuStreamBeginCapture_v2_ptsz(CUstream stream,
                                                                                        CUstreamCaptureMode mode) {
  FAKECUDA_ENTER("cuStreamBeginCapture_v2_ptsz");
  return BeginCapture(stream, mode, true);
}

FAKECUDA_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  FAKECUDA_ENTER("cuThreadExchangeStreamCaptureMode");
  if (mode == nullptr || static_cast<int>(*mode) < 0 || *mode > CU_STREAM_CAPTURE_MODE_RELAXED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::swap(*mode, t_capture_mode);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuStreamEndCapture(CUstream stream, CUgraph* graph) {
  FAKECUDA_ENTER("cuStreamEndCapture");
  return EndCapture(stream, graph, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuStreamEndCapture_ptsz(CUstream stream, CUgraph* graph) {
  FAKECUDA_ENTER("cuStreamEndCapture_ptsz");
  return EndCapture(stream, graph, true);
}

FAKECUDA_EXPORT CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  FAKECUDA_ENTER("cuStreamIsCapturing");
  return IsCapturing(stream, status, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuStreamIsCapturing_ptsz(CUstream stream,
                                                                                    CUstreamCaptureStatus* status) {
  FAKECUDA_ENTER("cuStreamIsCapturing_ptsz");
  return IsCapturing(stream, status, true);
}

#define FAKECUDA_CAPTURE_INFO(symbol, per_thread)                                                                   \
  extern "C" __attribute__((visibility("default"))) CUresult symbol(CUstream stream, CUstreamCaptureStatus* status, \
                                                                    cuuint64_t* id) {                               \
    FAKECUDA_ENTER(#symbol);                                                                                        \
    return CaptureInfo(stream, per_thread, {status, id});                                                           \
  }
#undef cuStreamGetCaptureInfo  // cuda.h maps the name to its newest version; this defines the oldest symbol
FAKECUDA_CAPTURE_INFO(cuStreamGetCaptureInfo, false)
FAKECUDA_CAPTURE_INFO(cuStreamGetCaptureInfo_ptsz, true)
#undef FAKECUDA_CAPTURE_INFO

#define FAKECUDA_CAPTURE_INFO_V2(symbol, per_thread)                                                                   \
  extern "C" __attribute__((visibility("default"))) CUresult symbol(CUstream stream, CUstreamCaptureStatus* status,    \
                                                                    cuuint64_t* id, CUgraph* graph,                    \
                                                                    const CUgraphNode** dependencies, size_t* count) { \
    FAKECUDA_ENTER(#symbol);                                                                                           \
    return CaptureInfo(stream, per_thread, {status, id, graph, dependencies, nullptr, count});                         \
  }
FAKECUDA_CAPTURE_INFO_V2(cuStreamGetCaptureInfo_v2, false)
FAKECUDA_CAPTURE_INFO_V2(cuStreamGetCaptureInfo_v2_ptsz, true)
#undef FAKECUDA_CAPTURE_INFO_V2

#define FAKECUDA_CAPTURE_INFO_V3(symbol, per_thread)                                         \
  extern "C" __attribute__((visibility("default"))) CUresult symbol(                         \
      CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,        \
      const CUgraphNode** dependencies, const CUgraphEdgeData** edges, size_t* count) {      \
    FAKECUDA_ENTER(#symbol);                                                                 \
    return CaptureInfo(stream, per_thread, {status, id, graph, dependencies, edges, count}); \
  }
FAKECUDA_CAPTURE_INFO_V3(cuStreamGetCaptureInfo_v3, false)
FAKECUDA_CAPTURE_INFO_V3(cuStreamGetCaptureInfo_v3_ptsz, true)
#undef FAKECUDA_CAPTURE_INFO_V3

FAKECUDA_EXPORT CUresult cuGraphCreate(CUgraph* graph, unsigned int flags) {
  FAKECUDA_ENTER("cuGraphCreate");
  if (graph == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  *graph = reinterpret_cast<CUgraph>(Register(d, new Graph()));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode* node, CUgraph handle, const CUgraphNode* dependencies,
                                                 size_t count, const CUDA_KERNEL_NODE_PARAMS* params) {
  FAKECUDA_ENTER("cuGraphAddKernelNode_v2");
  if (node == nullptr || params == nullptr || (count > 0 && dependencies == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Graph* g = Lookup<Graph>(d, handle, Kind::graph);
  if (g == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Function* f = LookupFunction(d, params->func);
  if (f == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const LaunchRequest shape_check{"cuGraphAddKernelNode_v2",
                                  params->func,
                                  {params->gridDimX, params->gridDimY, params->gridDimZ},
                                  {params->blockDimX, params->blockDimY, params->blockDimZ},
                                  params->sharedMemBytes,
                                  nullptr,
                                  params->kernelParams,
                                  params->extra,
                                  false,
                                  false};
  if (const CUresult v = ValidateShape(d, *f, *f->module->context, shape_check); v != CUDA_SUCCESS) return v;
  KernelNode kernel;
  kernel.function = f;
  kernel.name = f->name;
  kernel.shape = model::LaunchShape{{params->gridDimX, params->gridDimY, params->gridDimZ},
                                    {params->blockDimX, params->blockDimY, params->blockDimZ},
                                    params->sharedMemBytes};
  kernel.per_wave_ns = f->per_wave_ns;
  if (const CUresult read = ReadModelledParams(*f, params->kernelParams, params->extra, kernel); read != CUDA_SUCCESS) {
    return read;
  }
  g->nodes.push_back(kernel);
  g->node_tokens.push_back(std::make_unique<std::uint32_t>(static_cast<std::uint32_t>(g->nodes.size() - 1)));
  d.handles.emplace(g->node_tokens.back().get(), Kind::graph_node);
  *node = reinterpret_cast<CUgraphNode>(g->node_tokens.back().get());
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuGraphGetNodes(CUgraph handle, CUgraphNode* nodes, size_t* count) {
  FAKECUDA_ENTER("cuGraphGetNodes");
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Graph* g = Lookup<Graph>(d, handle, Kind::graph);
  if (g == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (nodes != nullptr) {
    for (std::size_t i = 0; i < std::min(*count, g->nodes.size()); ++i)
      nodes[i] = reinterpret_cast<CUgraphNode>(g->node_tokens[i].get());
  }
  *count = g->nodes.size();
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph, unsigned long long flags) {
  FAKECUDA_ENTER("cuGraphInstantiateWithFlags");
  (void)flags;
  return Instantiate(exec, graph);
}

FAKECUDA_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec* exec, CUgraph graph,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  FAKECUDA_ENTER("cuGraphInstantiateWithParams");
  const CUresult r = Instantiate(exec, graph);
  if (params != nullptr)
    params->result_out = r == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
  return r;
}

extern "C" __attribute__((visibility("default"))) CUresult cuGraphInstantiateWithParams_ptsz(
    CUgraphExec* exec, CUgraph graph, CUDA_GRAPH_INSTANTIATE_PARAMS* params) {
  return cuGraphInstantiateWithParams(exec, graph, params);
}

FAKECUDA_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream) {
  FAKECUDA_ENTER("cuGraphLaunch");
  return GraphLaunch(exec, stream, false);
}

extern "C" __attribute__((visibility("default"))) CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream) {
  FAKECUDA_ENTER("cuGraphLaunch_ptsz");
  return GraphLaunch(exec, stream, true);
}

FAKECUDA_EXPORT CUresult cuGraphDestroy(CUgraph handle) {
  FAKECUDA_ENTER("cuGraphDestroy");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Graph* g = Lookup<Graph>(d, handle, Kind::graph);
  if (g == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (const auto& token : g->node_tokens) Unregister(d, token.get());
  Unregister(d, g);
  delete g;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuGraphExecDestroy(CUgraphExec handle) {
  FAKECUDA_ENTER("cuGraphExecDestroy");
  return DestroyObject<GraphExec>(handle, Kind::graph_exec, CUDA_ERROR_INVALID_VALUE);
}

FAKECUDA_EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType* type) {
  FAKECUDA_ENTER("cuGraphNodeGetType");
  if (type == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (Lookup<void>(d, node, Kind::graph_node) == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *type = CU_GRAPH_NODE_TYPE_KERNEL;  // fakecuda graphs hold kernel nodes only
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuStreamGetCtx_v2(CUstream handle, CUcontext* context, CUgreenCtx* green_context) {
  FAKECUDA_ENTER("cuStreamGetCtx_v2");
  if (context == nullptr || green_context == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, handle, false, rs); r != CUDA_SUCCESS) return r;
  *context = reinterpret_cast<CUcontext>(rs.context);
  *green_context = nullptr;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuFuncGetParamInfo(CUfunction handle, size_t index, size_t* offset, size_t* size) {
  FAKECUDA_ENTER("cuFuncGetParamInfo");
  if (offset == nullptr && size == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Function* f = LookupFunction(d, handle);
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (index >= f->params.size()) return CUDA_ERROR_INVALID_VALUE;
  if (offset != nullptr) *offset = f->params[index].offset;
  if (size != nullptr) *size = f->params[index].size;
  return CUDA_SUCCESS;
}
