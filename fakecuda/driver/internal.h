// Process-local state of the fake libcuda.so.1 shared by its api_*.cc files: checked handles, contexts,
// allocations, streams, and the helpers every entry point uses. Nothing here is exported.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "fakecuda/model/model.h"
#include "fakecuda/state/state.h"
#include "ptx.h"

#define FAKECUDA_EXPORT extern "C" __attribute__((visibility("default")))

namespace fakecuda::driver {

// ---- every entry point starts here -------------------------------------------------------------------

// Fault injection for `symbol`: returns CUDA_SUCCESS or the injected error.
CUresult EnterCall(const char* symbol);
// EnterCall plus: the driver must be initialised (cuInit succeeded).
CUresult EnterInitialized(const char* symbol);

#define FAKECUDA_ENTER(symbol)                                                   \
  do {                                                                           \
    const CUresult entry_status_ = ::fakecuda::driver::EnterInitialized(symbol); \
    if (entry_status_ != CUDA_SUCCESS) return entry_status_;                     \
  } while (0)

// ---- checked handles ------------------------------------------------------------------------------------

enum class Kind : std::uint32_t {
  context,
  stream,
  event,
  module,
  function,
  graph,
  graph_exec,
  graph_node,
  pool,
  array,
  mipmapped_array,
  library,
  kernel
};

struct Context;
struct Stream;

// Every object a handle points to starts with this header; a handle is accepted only if it is registered
// (so a stale or forged pointer is never dereferenced).
struct Object {
  explicit Object(Kind k) : kind(k) {}
  Kind kind;
};

struct Context : Object {
  Context() : Object(Kind::context) {}
  std::uint32_t device = 0;   // physical (machine) index
  std::uint32_t ordinal = 0;  // as the application numbers devices (after CUDA_VISIBLE_DEVICES)
  unsigned int flags = 0;
  bool primary = false;
  std::uint64_t id = 0;
  std::uint32_t null_stream = model::kNoSlot;  // shared index of the legacy default stream
  std::uint64_t null_stream_generation = 0;
  std::uint64_t charged_bytes = 0;  // the context's own overhead, local memory and heap included
  std::size_t limits[16] = {};
  // The driver's own memory that grows after creation (docs/fakecuda.md, "Memory the driver takes by itself"):
  std::uint64_t local_per_thread = 0;  // local memory reserved per thread (0: the stack limit's default)
  bool heap_taken = false;             // the device-side malloc heap, set up at the first kernel using it
};

struct Stream : Object {
  Stream() : Object(Kind::stream) {}
  Context* context = nullptr;
  std::uint32_t index = model::kNoSlot;  // in the machine's stream table
  std::uint64_t generation = 0;
  unsigned int flags = 0;
  int priority = 0;
  struct Graph* capture = nullptr;  // non-null while capturing
  CUstreamCaptureMode capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  bool capture_invalidated = false;  // an illegal call during capture: EndCapture fails
  std::uint64_t capture_id = 0;
  CUgraphNode capture_dependency = nullptr;  // what cuStreamGetCaptureInfo_v2/_v3 hand out: the last node captured
  CUgraphEdgeData capture_edge{};            // its edge: the default (full dependency)
};

struct Event : Object {
  Event() : Object(Kind::event) {}
  unsigned int flags = 0;
  bool recorded = false;
  std::uint32_t stream = model::kNoSlot;
  std::uint64_t generation = 0;
  std::uint64_t seq = 0;
  std::uint64_t end_ns = 0;   // cached once observed
  bool awaiting_end = false;  // listed in Driver::events_awaiting_end
  std::uint32_t device = 0;   // physical; not a Context*: the context may go first
};

struct ParamInfo {
  std::uint32_t offset;
  std::uint32_t size;
};

struct Module;

struct Function : Object {
  Function() : Object(Kind::function) {}
  Module* module = nullptr;
  std::string name;
  std::vector<ParamInfo> params;
  std::uint32_t param_bytes = 0;
  bool spin = false;                 // the built-in vgpu_spin(ns_per_block) cost model
  bool collective = false;           // vgpu_collective(ns_per_block, group, size): a modelled collective
  std::uint64_t per_wave_ns = 5000;  // for other kernels
  int max_dynamic_shared = 48 * 1024;
  int carveout = -1;
  bool launched = false;          // launched before (FAKECUDA_LAZY_LOAD_NS is spent on the first launch)
  std::uint64_t local_bytes = 0;  // per thread, from the PTX (.local arrays in its body)
  bool uses_malloc = false;       // its PTX calls the device-side malloc
};

struct Library;

struct Module : Object {
  Module() : Object(Kind::module) {}
  Context* context = nullptr;
  Library* library = nullptr;  // the library it is that library's module in `context` (cuLibraryLoadData), or null
  int ptx_version = 0;         // e.g. 88 for .version 8.8
  int target_sm = 0;           // e.g. 75 for .target sm_75
  std::map<std::string, Function*> functions;
  std::uint64_t footprint_bytes = 0;  // what the driver takes when it loads the module (code and data)
  std::uintptr_t data_base = 0;       // its variables' memory (an Allocation of kind module_data), or 0
  struct Variable {
    CUdeviceptr address;
    std::size_t bytes;
  };
  std::map<std::string, Variable> variables;  // cuModuleGetGlobal
  bool loaded = false;                        // footprint charged: at load (eager) or a function's first launch (lazy)
};

// A context-independent library (cuLibraryLoadData): what each device architecture of the machine runs from it,
// read at load, and its module in each context that has used it (made on first use). A CUkernel is the Function of
// that module in the calling thread's context.
struct Kernel;

struct Library : Object {
  Library() : Object(Kind::library) {}
  std::map<int, ptx::Module> descriptions;  // by device architecture (90: sm_90)
  std::map<Context*, Module*> modules;
  std::map<std::string, Kernel*> kernels;  // handed out by cuLibraryGetKernel, owned here
};

// A library's kernel (cuLibraryGetKernel): context-independent, as the driver's CUkernel. Used (launched, asked
// about), it is the function of its name in the library's module of the current context, made there on first use.
struct Kernel : Object {
  Kernel() : Object(Kind::kernel) {}
  Library* library = nullptr;
  std::string name;
};

struct KernelNode {
  Function* function = nullptr;  // checked before use; the name is copied for after it is gone
  std::string name;
  model::LaunchShape shape{};
  std::uint64_t per_wave_ns = 0;
  std::uint64_t group = 0;  // vgpu_collective: its group and the group's size (0: not one)
  std::uint32_t group_size = 0;
};

struct Graph : Object {
  Graph() : Object(Kind::graph) {}
  std::vector<KernelNode> nodes;
  std::vector<std::unique_ptr<std::uint32_t>> node_tokens;  // CUgraphNode handles point at these
};

struct GraphExec : Object {
  GraphExec() : Object(Kind::graph_exec) {}
  std::vector<KernelNode> nodes;
};

struct PoolBlock {
  std::uintptr_t address;
  std::size_t bytes;
};

struct Pool : Object {
  Pool() : Object(Kind::pool) {}
  std::uint32_t device = 0;  // physical
  bool is_default = false;
  std::uint64_t release_threshold = 0;
  std::uint64_t reserved_bytes = 0;  // charged to the device: live + cached
  std::uint64_t reserved_high = 0;
  std::uint64_t used_bytes = 0;  // handed out to the application
  std::uint64_t used_high = 0;
  int reuse_follow_event = 1, reuse_opportunistic = 1, reuse_internal = 1;
  std::multimap<std::size_t, std::uintptr_t> cached;  // freed blocks by size, still charged
};

struct Array : Object {
  explicit Array(Kind k = Kind::array) : Object(k) {}
  Context* context = nullptr;  // destroyed with it
  std::uint32_t device = 0;
  std::uint64_t charged_bytes = 0;
  CUDA_ARRAY3D_DESCRIPTOR descriptor{};
  unsigned int levels = 1;
};

// module_data: a module's variables (__device__, __constant__), mapped when the module is made, charged with its
// footprint, not freeable.
enum class AllocationKind : std::uint32_t { device, pitch, managed, pool, host, module_data };

struct Allocation {
  std::size_t bytes = 0;         // what the caller asked for (pitch * height for pitch)
  std::size_t mapped_bytes = 0;  // what was mmap'ed
  std::uint64_t charged_bytes = 0;
  std::uint32_t device = 0;
  AllocationKind kind = AllocationKind::device;
  Context* context = nullptr;
  Pool* pool = nullptr;
  bool cached = false;          // a stream-ordered block freed back to its pool
  unsigned int host_flags = 0;  // cuMemHostAlloc / cuMemHostRegister flags
  bool registered = false;      // host: the application's own memory (cuMemHostRegister), never unmapped
};

struct VmmHandle {
  int memfd = -1;
  std::size_t bytes = 0;
  std::uint32_t device = 0;
  std::uint64_t charged_bytes = 0;
  bool released = false;  // cuMemRelease called; freed when the last mapping goes
  std::uint32_t mappings = 0;
  std::uint32_t retains = 0;  // cuMemRetainAllocationHandle calls not yet released
  CUmemAllocationProp prop{};
};

struct VmmMapping {
  std::size_t bytes = 0;
  CUmemGenericAllocationHandle handle = 0;
  bool accessible = false;
};

// All process-local driver state. One instance; rebuilt in a fork child.
struct Driver {
  std::mutex mutex;  // guards everything below; taken before the machine lock
  bool initialized = false;
  CUresult init_error = CUDA_SUCCESS;
  state::Attachment* attachment = nullptr;
  std::vector<std::uint32_t> visible;  // ordinal -> physical device
  std::unordered_map<const void*, Kind> handles;
  std::unordered_set<const void*> destroyed_contexts;  // may still be current somewhere: CONTEXT_IS_DESTROYED
  struct Primary {
    Context* context = nullptr;
    // The handle the runtime was given for a primary context not yet retained (export_tables.cc): the retain that
    // makes the context makes it at this address.
    Context* reserved = nullptr;
    unsigned int retains = 0;
    unsigned int flags = 0;
  } primary[model::kMaxDevices];
  Pool* default_pool[model::kMaxDevices] = {};
  Pool* current_pool[model::kMaxDevices] = {};
  std::vector<Stream*> streams;                        // all live application streams (for ctx synchronize)
  std::map<std::uintptr_t, Allocation> allocations;    // device, pitch, managed, pool blocks, host
  std::map<std::uintptr_t, std::size_t> reservations;  // VMM address ranges
  std::map<std::uintptr_t, VmmMapping> mappings;       // VMM mapped ranges
  std::unordered_map<CUmemGenericAllocationHandle, VmmHandle> vmm_handles;
  CUmemGenericAllocationHandle next_vmm_handle = 0x1000;
  std::uint64_t next_context_id = 1;
  std::uint64_t next_capture_id = 1;
  std::unordered_map<std::string, std::uint64_t> kernel_costs;  // FAKECUDA_KERNEL_COSTS
  // Events recorded whose completion time is not cached yet, with their stream's index: KeepEventEnds caches it
  // before the stream's ring slot that holds it is reused.
  struct AwaitingEnd {
    CUevent event;
    std::uint32_t stream;
  };
  std::vector<AwaitingEnd> events_awaiting_end;
  std::uint64_t default_kernel_ns = 5000;
  // FAKECUDA_LAUNCH_CALL_NS: host time a launch call takes before the GPU has the kernel (a real driver's launch
  // call, ~3 us on an H100: an event recorded before it on an idle stream is written that much before the kernel
  // can start). 0: the kernel is queued at once.
  std::uint64_t launch_call_ns = 0;
  // FAKECUDA_LAUNCH_WAITS_FOR_STREAM=1: a launch call first waits for the work queued before it on its stream, as a
  // real driver's may (room in a push buffer shared with a stalled stream; lazy module loading).
  bool launch_waits_for_stream = false;
  // FAKECUDA_LAZY_LOAD_NS: host time a function's first launch spends loading it, inside the launch call, before the
  // GPU has the kernel (a real driver loads modules lazily: 1.5-3.1 ms for PyTorch's first kernels on an H100).
  std::uint64_t lazy_load_ns = 0;
  // CUDA_MODULE_LOADING=EAGER: a module's footprint is taken when it is loaded, not at its first launch (the real
  // driver's default since CUDA 11.7 is LAZY).
  bool eager_loading = false;
};

Driver& TheDriver();

template <typename T>
T* Lookup(Driver& d, const void* handle, Kind kind) {
  if (handle == nullptr) return nullptr;
  const auto it = d.handles.find(handle);
  if (it == d.handles.end() || it->second != kind) return nullptr;
  return static_cast<T*>(const_cast<void*>(handle));
}

template <typename T>
T* Register(Driver& d, T* object) {
  if (object->kind == Kind::context) d.destroyed_contexts.erase(object);  // the address is reused
  d.handles.emplace(object, object->kind);
  return object;
}

void Unregister(Driver& d, const void* handle);

// ---- contexts and streams ---------------------------------------------------------------------------------

// The calling thread's current context, or null.
Context* CurrentContext(Driver& d);
// What a call needing a context returns when CurrentContext is null: CUDA_ERROR_CONTEXT_IS_DESTROYED if the
// thread's current context was destroyed, else CUDA_ERROR_INVALID_CONTEXT (as the real driver).
CUresult NoContextError(Driver& d);
// What a CUfunction or CUkernel handle stands for (api_exec.cc): the function, or a library kernel's function in the
// current context; null if neither. Caller holds d.mutex.
Function* LookupFunction(Driver& d, const void* handle);

// A module's variables' memory, `bytes` long, in context `c` (uncharged: the module's footprint counts it), and its
// release. Caller holds d.mutex.
CUresult MapModuleData(Driver& d, Context* c, std::size_t bytes, std::uintptr_t& base);
void UnmapModuleData(Driver& d, std::uintptr_t base);

// FAKECUDA_LOG_CALLS=1 (api_core.cc): entry points and export tables logged on stderr as they are asked for.
bool LoggingCalls();

// The CUDA runtime's export tables (export_tables.cc; docs/fakecuda-runtime.md): the table with this id, or null.
const void* RuntimeExportTable(const CUuuid& id);
// The context-local storage of a context that goes (its values are the runtime's; their destructors are not run).
void ForgetContextStorage(CUcontext context);
// The device's primary context, retained or not: the handle cuDevicePrimaryCtxRetain gives (reserved if need be).
CUresult PrimaryContextHandle(CUdevice device, CUcontext& context);

// The private export table (api_memory.cc; docs/fakecuda.md): what cuGetExportTable gives for kPrivateTableId.
const void* PrivateExportTable();
// Its id: the 16 bytes of "fakecuda-private".
inline constexpr char kPrivateTableId[16] = {'f', 'a', 'k', 'e', 'c', 'u', 'd', 'a',
                                             '-', 'p', 'r', 'i', 'v', 'a', 't', 'e'};
// The thread's context stack (top = current). Entries may have been destroyed: checked on use.
std::vector<Context*>& ContextStack();

// Resolves a CUstream handle (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or an application stream) to the
// shared stream index for the current context. `per_thread` is true for _ptsz/_ptds entry points.
struct ResolvedStream {
  Context* context = nullptr;
  Stream* stream = nullptr;  // null for the built-in streams
  std::uint32_t index = model::kNoSlot;
  std::uint64_t generation = 0;
  bool legacy = false;
  bool blocking = true;
};
CUresult ResolveStream(Driver& d, CUstream handle, bool per_thread, ResolvedStream& out);

// Before an operation is queued on stream `index`: the completion time of each event recorded there whose marker has
// completed is cached. An event's time lives in its stream's ring slot, reused kStreamDepth operations later, and a
// real GPU keeps an event's timestamp however much is queued after it: an event read only late (a measurement's
// start, read once its end completes 200 launches on) read as completing when first looked at, hundreds of ms late.
// Caller holds d.mutex and the machine lock (the machine does not advance meanwhile: events not done now keep their
// slots until the next advance, so once before the operations queued under one lock is enough).
void KeepEventEnds(Driver& d, const model::Machine& m, std::uint32_t index);
// KeepEventEnds for `target`, then the implicit waits of the legacy default stream (it waits for the context's
// blocking streams and they wait for it): called before every operation queued on a stream. Caller holds the
// machine lock.
void QueueImplicitSync(Driver& d, model::Machine& m, const ResolvedStream& target, std::uint64_t now);

// Blocks until op `seq` of shared stream `index` (generation) completes, sleeping outside every lock.
// Returns CUDA_SUCCESS, or an error if the machine went away.
CUresult WaitForOp(std::uint32_t device, std::uint32_t index, std::uint64_t generation, std::uint64_t seq);
// Waits until everything queued so far on the stream has completed.
CUresult WaitStreamIdle(std::uint32_t device, std::uint32_t index, std::uint64_t generation);
// Waits for every stream of the context (for cuCtxSynchronize and synchronous copies on the legacy stream).
CUresult WaitContextIdle(Context* context);
// Trims stream-ordered pools to their release thresholds (at synchronization points).
void TrimPoolsAtSync(Driver& d);

// The driver's own memory a launch of `f` in `c` needs first (docs/fakecuda.md, "Memory the driver takes by itself"):
// its module's footprint if not loaded yet, more local memory per thread if it needs more than `c` reserves, the
// malloc heap at the first kernel using it. CUDA_ERROR_OUT_OF_MEMORY (nothing taken) if it does not fit. Caller holds
// d.mutex.
CUresult TakeLaunchMemory(Driver& d, Function& f, Context& c);
// Sets `c`'s local memory to `per_thread` bytes a thread (the stack limit): the difference is charged or given back.
CUresult ResizeLocalMemory(Driver& d, Context& c, std::uint64_t per_thread);
// A module's footprint is charged (the module loads); CUDA_ERROR_OUT_OF_MEMORY if it does not fit.
CUresult LoadModuleFootprint(Driver& d, Module& module);

// Frees everything the context owns and returns its memory (context destroy, primary release/reset).
void TearDownContext(Driver& d, Context* context);
// Creates the shared state of a new context (charging its overhead). Caller holds d.mutex.
CUresult SetUpContext(Driver& d, Context* context);

// ---- memory ---------------------------------------------------------------------------------------------

// Charges `bytes` on physical `device` for this process; false if out of memory (after reaping the dead).
bool ChargeDevice(Driver& d, std::uint32_t device, std::uint64_t bytes);
void UnchargeDevice(Driver& d, std::uint32_t device, std::uint64_t bytes);
// True if [address, address + bytes) lies inside memory the device can address (allocations and VMM
// mappings with access).
bool DeviceRangeValid(Driver& d, std::uintptr_t address, std::size_t bytes);
void TraceAllocation(const char* event, const char* api, std::uint32_t device, std::uint64_t bytes,
                     std::uintptr_t address);

// In a fork child: forget the parent's host-function worker (its thread does not exist here).
void ForgetHostWorkerAfterFork();

// Stream waits on memory (cuStreamWaitValue32/64): forgets those on [begin, end) (the memory is being freed: nothing
// will write it any more, and it must not be read).
void ForgetValueWaitsIn(std::uintptr_t begin, std::uintptr_t end);

// ---- misc -----------------------------------------------------------------------------------------------

// Physical device for an application ordinal, or false.
bool PhysicalDevice(const Driver& d, CUdevice ordinal, std::uint32_t& physical);
const model::DeviceSpec& Spec(const Driver& d, std::uint32_t physical);

// Error codes by name (for fault injection) and the name/description tables.
int ErrorCodeOf(std::string_view name);

}  // namespace fakecuda::driver
