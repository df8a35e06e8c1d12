// Fake libcuda.so.1: initialisation, versions, devices and attributes, contexts, errors, proc addresses.
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "fakecuda/state/faults.h"
#include "internal.h"
#include "proc_address.h"
#include "vgpu/base/uuid.h"

namespace fakecuda::driver {
namespace {

constexpr int kDriverVersion = 13000;

struct ErrorEntry {
  CUresult code;
  const char* name;
  const char* description;
};

constexpr ErrorEntry kErrors[] = {
#include "errors.inc"
};

int ErrorCodeForFaults(std::string_view name) { return ErrorCodeOf(name); }

const faults::Library kFaultLibrary{"libcuda.so.1", "cu", "CUDA_ERROR_", &ErrorCodeForFaults, nullptr};

// Constant-initialised storage: the driver object is built on first use and rebuilt in a fork child.
alignas(Driver) unsigned char g_driver_storage[sizeof(Driver)];
std::atomic<Driver*> g_driver{nullptr};
std::mutex g_driver_create_mutex;

// The thread's context stack; freed with the thread.
thread_local std::vector<Context*> t_context_stack;
thread_local std::uint64_t t_stack_epoch = 0;
std::atomic<std::uint64_t> g_fork_epoch{1};

void AfterForkInChild() {
  // The child has one thread and the parent's objects; CUDA starts afresh here (docs/fakecuda.md).
  state::ForgetAfterFork();
  ForgetHostWorkerAfterFork();
  new (&g_driver_create_mutex) std::mutex();
  g_driver.store(nullptr);  // leak the parent's objects: their memory belongs to the parent's accounting
  g_fork_epoch.fetch_add(1);
}

void LoadKernelCosts(Driver& d) {
  if (const char* costs = std::getenv("FAKECUDA_KERNEL_COSTS"); costs != nullptr) {
    std::string_view rest(costs);
    while (!rest.empty()) {
      const auto comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
      const auto eq = item.find('=');
      std::uint64_t ns = 0;
      if (eq == std::string_view::npos ||
          std::from_chars(item.data() + eq + 1, item.data() + item.size(), ns).ptr != item.data() + item.size()) {
        state::LogError("FAKECUDA_KERNEL_COSTS: '%.*s' is not name=nanoseconds (e.g. gemm=250000); ignored",
                        static_cast<int>(item.size()), item.data());
        continue;
      }
      d.kernel_costs[std::string(item.substr(0, eq))] = ns;
    }
  }
  if (const char* fallback = std::getenv("FAKECUDA_DEFAULT_KERNEL_NS"); fallback != nullptr && *fallback != '\0') {
    std::uint64_t ns = 0;
    const std::string_view text(fallback);
    if (std::from_chars(text.data(), text.data() + text.size(), ns).ptr == text.data() + text.size() && ns > 0) {
      d.default_kernel_ns = ns;
    } else {
      state::LogError("FAKECUDA_DEFAULT_KERNEL_NS='%s' is not a positive number of nanoseconds; using 5000", fallback);
    }
  }
  if (const char* call = std::getenv("FAKECUDA_LAUNCH_CALL_NS"); call != nullptr && *call != '\0') {
    std::uint64_t ns = 0;
    const std::string_view text(call);
    if (std::from_chars(text.data(), text.data() + text.size(), ns).ptr == text.data() + text.size() &&
        ns <= 1'000'000) {
      d.launch_call_ns = ns;
    } else {
      state::LogError("FAKECUDA_LAUNCH_CALL_NS='%s' is not a number of nanoseconds in 0..1000000 (e.g. 3000); using 0",
                      call);
    }
  }
  if (const char* load = std::getenv("FAKECUDA_LAZY_LOAD_NS"); load != nullptr && *load != '\0') {
    std::uint64_t ns = 0;
    const std::string_view text(load);
    if (std::from_chars(text.data(), text.data() + text.size(), ns).ptr == text.data() + text.size() &&
        ns <= 1'000'000'000) {
      d.lazy_load_ns = ns;
    } else {
      state::LogError(
          "FAKECUDA_LAZY_LOAD_NS='%s' is not a number of nanoseconds in 0..1000000000 (e.g. 3000000); "
          "using 0",
          load);
    }
  }
  if (const char* loading = std::getenv("CUDA_MODULE_LOADING"); loading != nullptr && *loading != '\0') {
    if (std::strcmp(loading, "EAGER") == 0 || std::strcmp(loading, "LAZY") == 0) {
      d.eager_loading = loading[0] == 'E';
    } else {
      state::LogError("CUDA_MODULE_LOADING='%s' is not EAGER or LAZY; using LAZY", loading);
    }
  }
  if (const char* waits = std::getenv("FAKECUDA_LAUNCH_WAITS_FOR_STREAM"); waits != nullptr && *waits != '\0') {
    if (std::strcmp(waits, "1") == 0 || std::strcmp(waits, "0") == 0) {
      d.launch_waits_for_stream = waits[0] == '1';
    } else {
      state::LogError("FAKECUDA_LAUNCH_WAITS_FOR_STREAM='%s' is not 0 or 1; using 0", waits);
    }
  }
}

// CUDA_VISIBLE_DEVICES: indices or UUID prefixes ("GPU-3f2a..."), comma separated. As the real driver
// does, the list stops at the first entry that names no device; unset means all.
std::vector<std::uint32_t> VisibleDevices(const model::Machine& m) {
  std::vector<std::uint32_t> visible;
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  if (env == nullptr) {
    for (std::uint32_t i = 0; i < m.config.device_count; ++i) visible.push_back(i);
    return visible;
  }
  std::string_view rest(env);
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    std::uint32_t found = model::kNoSlot;
    std::uint32_t index = 0;
    if (!item.empty() &&
        std::from_chars(item.data(), item.data() + item.size(), index).ptr == item.data() + item.size()) {
      if (index < m.config.device_count) found = index;
    } else if (item.size() > 4 && item.substr(0, 4) == "GPU-") {
      for (std::uint32_t i = 0; i < m.config.device_count; ++i) {
        char uuid[vgpu::base::kGpuUuidChars + 1];
        vgpu::base::FormatGpuUuid(m.config.devices[i].uuid, uuid);
        if (std::string_view(uuid).substr(0, item.size()) == item) found = i;
      }
    }
    if (found == model::kNoSlot || std::find(visible.begin(), visible.end(), found) != visible.end()) break;
    visible.push_back(found);
  }
  return visible;
}

CUresult InitializeLocked(Driver& d) {
  if (d.initialized) return CUDA_SUCCESS;
  if (d.init_error != CUDA_SUCCESS) return d.init_error;
  std::string error;
  if (!faults::Configured(kFaultLibrary, error)) {  // it has printed the message itself
    d.init_error = CUDA_ERROR_NOT_INITIALIZED;
    return d.init_error;
  }
  d.attachment = state::Attach(/*claim_slot=*/true, error);
  if (d.attachment == nullptr) {
    state::LogError("%s", error.c_str());
    d.init_error = CUDA_ERROR_NOT_INITIALIZED;
    return d.init_error;
  }
  d.visible = VisibleDevices(*d.attachment->machine);
  if (d.visible.empty()) {
    d.init_error = CUDA_ERROR_NO_DEVICE;
    return d.init_error;
  }
  if (const char* pct = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"); pct != nullptr && *pct != '\0') {
    unsigned value = 0;
    const std::string_view text(pct);
    if (std::from_chars(text.data(), text.data() + text.size(), value).ptr != text.data() + text.size() || value == 0 ||
        value > 100) {
      state::LogError("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='%s' is not a whole percentage in 1..100 (e.g. 50)", pct);
      d.init_error = CUDA_ERROR_NOT_INITIALIZED;
      return d.init_error;
    }
    state::MachineLock lock(*d.attachment);
    model::Machine& m = lock.machine();
    for (std::uint32_t dev = 0; dev < m.config.device_count; ++dev) {
      const std::uint32_t sms = m.config.devices[dev].sm_count;
      // TPC granularity: SMs come in pairs.
      const std::uint32_t granted = std::max<std::uint32_t>(2, sms * value / 100 / 2 * 2);
      m.slots[d.attachment->slot].mps_sm_count[dev] = std::min(granted, sms);
    }
  }
  LoadKernelCosts(d);
  d.initialized = true;
  return CUDA_SUCCESS;
}

bool ValidContext(Driver& d, Context* c) { return Lookup<Context>(d, c, Kind::context) != nullptr; }

}  // namespace

Driver& TheDriver() {
  Driver* d = g_driver.load(std::memory_order_acquire);
  if (d != nullptr) return *d;
  std::lock_guard<std::mutex> guard(g_driver_create_mutex);
  d = g_driver.load(std::memory_order_relaxed);
  if (d == nullptr) {
    static std::once_flag atfork_once;
    std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, &AfterForkInChild); });
    d = new (g_driver_storage) Driver();
    g_driver.store(d, std::memory_order_release);
  }
  return *d;
}

int ErrorCodeOf(std::string_view name) {
  for (const ErrorEntry& e : kErrors) {
    if (name == e.name) return static_cast<int>(e.code);
  }
  return -1;
}

// FAKECUDA_LOG_CALLS=1: each entry point's name, as it is entered, on stderr (what a program new to fakecuda asks
// for, and where it stops: docs/fakecuda-runtime.md). Read once.
bool LoggingCalls() {
  static const bool on = [] {
    const char* setting = std::getenv("FAKECUDA_LOG_CALLS");
    return setting != nullptr && std::strcmp(setting, "1") == 0;
  }();
  return on;
}

CUresult EnterCall(const char* symbol) {
  if (LoggingCalls()) std::fprintf(stderr, "fakecuda: call %s\n", symbol);
  const int injected = faults::Check(symbol, kFaultLibrary);
  return static_cast<CUresult>(injected);
}

}  // namespace fakecuda::driver

// The generated stubs (unimplemented_stubs.cc) ask here first, so that rules apply to every exported symbol.
extern "C" __attribute__((visibility("hidden"))) int fakecuda_stub_fault(const char* symbol) {
  return static_cast<int>(fakecuda::driver::EnterCall(symbol));
}

namespace fakecuda::driver {

CUresult EnterInitialized(const char* symbol) {
  if (const CUresult fault = EnterCall(symbol); fault != CUDA_SUCCESS) return fault;
  Driver& d = TheDriver();
  if (__atomic_load_n(&d.initialized, __ATOMIC_ACQUIRE)) return CUDA_SUCCESS;
  std::lock_guard<std::mutex> guard(d.mutex);
  if (d.initialized) return CUDA_SUCCESS;
  return d.init_error != CUDA_SUCCESS ? d.init_error : CUDA_ERROR_NOT_INITIALIZED;
}

void Unregister(Driver& d, const void* handle) { d.handles.erase(handle); }

bool PhysicalDevice(const Driver& d, CUdevice ordinal, std::uint32_t& physical) {
  if (ordinal < 0 || static_cast<std::size_t>(ordinal) >= d.visible.size()) return false;
  physical = d.visible[static_cast<std::size_t>(ordinal)];
  return true;
}

const model::DeviceSpec& Spec(const Driver& d, std::uint32_t physical) {
  return d.attachment->machine->config.devices[physical];
}

std::vector<Context*>& ContextStack() {
  // Per-thread, rebuilt after fork (the epoch changes) because the parent's contexts are gone.
  if (t_stack_epoch != g_fork_epoch.load(std::memory_order_relaxed)) {
    t_context_stack.clear();
    t_stack_epoch = g_fork_epoch.load(std::memory_order_relaxed);
  }
  return t_context_stack;
}

CUresult NoContextError(Driver& d) {
  const auto& stack = ContextStack();
  if (!stack.empty() && d.destroyed_contexts.count(stack.back()) != 0) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  return CUDA_ERROR_INVALID_CONTEXT;
}

Context* CurrentContext(Driver& d) {
  auto& stack = ContextStack();
  if (stack.empty()) return nullptr;
  Context* c = stack.back();
  return ValidContext(d, c) ? c : nullptr;
}

CUresult SetUpContext(Driver& d, Context* c) {
  const model::DeviceSpec& spec = Spec(d, c->device);
  if (!ChargeDevice(d, c->device, spec.context_bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  c->charged_bytes = spec.context_bytes;
  state::MachineLock lock(*d.attachment);
  const std::uint32_t index = model::CreateStream(lock.machine(), d.attachment->slot, c->device, 0, 0);
  if (index == model::kNoSlot) {
    UnchargeDevice(d, c->device, c->charged_bytes);
    c->charged_bytes = 0;
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  c->null_stream = index;
  c->null_stream_generation = lock.machine().streams[index].generation;
  ++lock.machine().slots[d.attachment->slot].contexts[c->device];
  c->id = d.next_context_id++;
  return CUDA_SUCCESS;
}

}  // namespace fakecuda::driver

using namespace fakecuda::driver;
namespace model = fakecuda::model;

// ---- init and versions -----------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuInit(unsigned int flags) {
  if (const CUresult fault = EnterCall("cuInit"); fault != CUDA_SUCCESS) return fault;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  return InitializeLocked(d);
}

FAKECUDA_EXPORT CUresult cuDriverGetVersion(int* version) {
  if (const CUresult fault = EnterCall("cuDriverGetVersion"); fault != CUDA_SUCCESS) return fault;
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = kDriverVersion;
  return CUDA_SUCCESS;
}

namespace {
// The table's entry for `error`, or null. A caller may pass any number as a CUresult: it is compared as its bits,
// never loaded as the enum (UBSan's enum check would refuse 12345).
const ErrorEntry* FindError(CUresult error) {
  int code = 0;
  static_assert(sizeof code == sizeof error);
  std::memcpy(&code, &error, sizeof code);
  for (const ErrorEntry& e : kErrors) {
    if (static_cast<int>(e.code) == code) return &e;
  }
  return nullptr;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuGetErrorName(CUresult error, const char** name) {
  if (const CUresult fault = EnterCall("cuGetErrorName"); fault != CUDA_SUCCESS) return fault;  // works uninitialized
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorEntry* e = FindError(error);
  *name = e != nullptr ? e->name : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKECUDA_EXPORT CUresult cuGetErrorString(CUresult error, const char** text) {
  if (const CUresult fault = EnterCall("cuGetErrorString"); fault != CUDA_SUCCESS) return fault;  // works uninitialized
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorEntry* e = FindError(error);
  *text = e != nullptr ? e->description : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// The export tables: private interfaces between the driver and the CUDA runtime (export_tables.cc;
// docs/fakecuda-runtime.md), and fakecuda's own table, standing in for what a private table can do past an
// interposer: allocation and free that no exported symbol names (kPrivateTableId; docs/fakecuda.md). Any other id
// is refused with the table null, as the runtime tolerates for the tables it can do without.
FAKECUDA_EXPORT CUresult cuGetExportTable(const void** table, const CUuuid* id) {
  if (const CUresult fault = EnterCall("cuGetExportTable"); fault != CUDA_SUCCESS) return fault;  // works uninitialized
  if (table == nullptr || id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (std::memcmp(id->bytes, kPrivateTableId, sizeof kPrivateTableId) == 0) {
    *table = PrivateExportTable();
    return CUDA_SUCCESS;
  }
  *table = RuntimeExportTable(*id);
  if (LoggingCalls()) {
    char text[33];
    for (int i = 0; i < 16; ++i) std::snprintf(text + 2 * i, 3, "%02x", static_cast<unsigned char>(id->bytes[i]));
    std::fprintf(stderr, "fakecuda: export table %s %s\n", text, *table != nullptr ? "given" : "refused");
  }
  return *table != nullptr ? CUDA_SUCCESS : CUDA_ERROR_NOT_SUPPORTED;
}

FAKECUDA_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                                             CUdriverProcAddressQueryResult* status) {
  if (const CUresult fault = EnterCall("cuGetProcAddress_v2"); fault != CUDA_SUCCESS) return fault;
  return fakecuda::GetProcAddressV2(symbol, pfn, cuda_version, flags, status, kDriverVersion,
                                    fakecuda::GeneratedProcTable());
}

#undef cuGetProcAddress  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags) {
  if (const CUresult fault = EnterCall("cuGetProcAddress"); fault != CUDA_SUCCESS) return fault;
  return fakecuda::GetProcAddressV1(symbol, pfn, cuda_version, flags, kDriverVersion, fakecuda::GeneratedProcTable());
}

// ---- devices -----------------------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuDeviceGetCount(int* count) {
  FAKECUDA_ENTER("cuDeviceGetCount");
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = static_cast<int>(TheDriver().visible.size());
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  FAKECUDA_ENTER("cuDeviceGet");
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), ordinal, physical)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceGetName(char* name, int length, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceGetName");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (name == nullptr || length <= 0) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(name, static_cast<std::size_t>(length), "%s", Spec(TheDriver(), physical).name);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceTotalMem_v2");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *bytes = model::CudaTotalBytes(Spec(TheDriver(), physical));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceComputeCapability(int* major, int* minor, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceComputeCapability");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (major == nullptr || minor == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *major = static_cast<int>(Spec(TheDriver(), physical).cc_major);
  *minor = static_cast<int>(Spec(TheDriver(), physical).cc_minor);
  return CUDA_SUCCESS;
}

namespace {
// cuDeviceGetUuid_v2 and cuDeviceGetUuid: one body, each entry point checked under its own name.
CUresult DeviceGetUuidEntry(const char* symbol, CUuuid* uuid, CUdevice device) {
  FAKECUDA_ENTER(symbol);
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::memcpy(uuid->bytes, Spec(TheDriver(), physical).uuid, sizeof uuid->bytes);
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice device) {
  return DeviceGetUuidEntry("cuDeviceGetUuid_v2", uuid, device);
}

#undef cuDeviceGetUuid  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice device) {
  return DeviceGetUuidEntry("cuDeviceGetUuid", uuid, device);
}

FAKECUDA_EXPORT CUresult cuDeviceGetPCIBusId(char* bus_id, int length, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceGetPCIBusId");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (bus_id == nullptr || length <= 0) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(bus_id, static_cast<std::size_t>(length), "0000:%02x:00.0", Spec(TheDriver(), physical).pci_bus);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice* device, const char* bus_id) {
  FAKECUDA_ENTER("cuDeviceGetByPCIBusId");
  if (device == nullptr || bus_id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  unsigned domain = 0, bus = 0, dev = 0, function = 0;
  // Accepts "domain:bus:device.function" and "bus:device.function", domain of 4 or 8 digits.
  if (std::sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &function) != 4) {
    domain = 0;
    if (std::sscanf(bus_id, "%x:%x.%x", &bus, &dev, &function) != 3) return CUDA_ERROR_INVALID_VALUE;
  }
  Driver& d = TheDriver();
  for (std::size_t ordinal = 0; ordinal < d.visible.size(); ++ordinal) {
    if (domain == 0 && dev == 0 && function == 0 && Spec(d, d.visible[ordinal]).pci_bus == bus) {
      *device = static_cast<CUdevice>(ordinal);
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_INVALID_DEVICE;
}

namespace {

// Attributes with one value on every GPU fakecuda models.
struct FixedAttribute {
  CUdevice_attribute attribute;
  int value;
};
constexpr FixedAttribute kFixedAttributes[] = {
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024},
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024},
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64},
    {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, 2147483647},
    {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535},
    {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535},
    {CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY, 65536},
    {CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2147483647},
    {CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, 65536},
    {CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, 512},
    {CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT, 32},
    {CU_DEVICE_ATTRIBUTE_GPU_OVERLAP, 1},
    {CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT, 0},
    {CU_DEVICE_ATTRIBUTE_INTEGRATED, 0},
    {CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1},
    {CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, CU_COMPUTEMODE_DEFAULT},
    {CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT, 512},
    {CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS, 1},
    {CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 0},
    {CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 0},
    {CU_DEVICE_ATTRIBUTE_TCC_DRIVER, 0},
    {CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, 2},
    {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
    {CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1},
    {CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD, 0},
    {CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, 1},
    {CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, 0},
    {CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, 1},
    {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1},
    {CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK, 1024},
    {CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, 0},
    {CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED, 0},
    {CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO, 2},
    {CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_WIDTH, 131072},
    {CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_WIDTH, 131072},
    {CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_HEIGHT, 65536},
    {CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH, 16384},
    {CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT, 16384},
    {CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH, 16384},
};

// Attributes the device's preset (model::DeviceSpec) decides; `physical` is the device's index on the machine.
struct PresetAttribute {
  CUdevice_attribute attribute;
  int (*value)(const model::DeviceSpec& s, std::uint32_t physical);
};
constexpr int ComputeCapability(const model::DeviceSpec& s) { return static_cast<int>(s.cc_major * 10 + s.cc_minor); }
constexpr PresetAttribute kPresetAttributes[] = {
    {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.max_threads_per_block); }},
    {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.shared_bytes_per_block); }},
    {CU_DEVICE_ATTRIBUTE_WARP_SIZE,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.warp_size); }},
    {CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.clock_khz); }},
    {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.sm_count); }},
    {CU_DEVICE_ATTRIBUTE_ECC_ENABLED,
     [](const model::DeviceSpec& s, std::uint32_t) { return s.cc_major >= 8 ? 1 : 0; }},
    {CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.pci_bus); }},
    {CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.memory_clock_khz); }},
    {CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.memory_bus_bits); }},
    {CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.l2_bytes); }},
    {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.max_threads_per_sm); }},
    {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.cc_major); }},
    {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.cc_minor); }},
    {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.shared_bytes_per_sm); }},
    {CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.registers_per_sm); }},
    {CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID,
     [](const model::DeviceSpec&, std::uint32_t physical) { return static_cast<int>(physical); }},
    {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.shared_bytes_per_sm) - 1024; }},
    {CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.max_blocks_per_sm); }},
    {CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
     [](const model::DeviceSpec& s, std::uint32_t) { return static_cast<int>(s.l2_bytes / 4 * 3); }},
    {CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH,
     [](const model::DeviceSpec& s, std::uint32_t) { return ComputeCapability(s) >= 90 ? 1 : 0; }},
};

}  // namespace

// The fixed values, then the preset's; any other valid attribute reads 0 (unsupported), as the driver reports an
// attribute a GPU lacks.
FAKECUDA_EXPORT CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceGetAttribute");
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (static_cast<int>(attribute) <= 0 || attribute >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
  for (const FixedAttribute& fixed : kFixedAttributes) {
    if (fixed.attribute == attribute) {
      *value = fixed.value;
      return CUDA_SUCCESS;
    }
  }
  for (const PresetAttribute& preset : kPresetAttributes) {
    if (preset.attribute == attribute) {
      *value = preset.value(Spec(TheDriver(), physical), physical);
      return CUDA_SUCCESS;
    }
  }
  *value = 0;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceGetProperties(CUdevprop* prop, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceGetProperties");
  std::uint32_t physical = 0;
  if (!PhysicalDevice(TheDriver(), device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const model::DeviceSpec& s = Spec(TheDriver(), physical);
  *prop = CUdevprop{};
  prop->maxThreadsPerBlock = static_cast<int>(s.max_threads_per_block);
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->sharedMemPerBlock = static_cast<int>(s.shared_bytes_per_block);
  prop->totalConstantMemory = 65536;
  prop->SIMDWidth = 32;
  prop->memPitch = 2147483647;
  prop->regsPerBlock = 65536;
  prop->clockRate = static_cast<int>(s.clock_khz);
  prop->textureAlign = 512;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceCanAccessPeer(int* can_access, CUdevice device, CUdevice peer) {
  FAKECUDA_ENTER("cuDeviceCanAccessPeer");
  std::uint32_t a = 0, b = 0;
  if (!PhysicalDevice(TheDriver(), device, a) || !PhysicalDevice(TheDriver(), peer, b))
    return CUDA_ERROR_INVALID_DEVICE;
  if (can_access == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *can_access = a != b ? 1 : 0;
  return CUDA_SUCCESS;
}

// ---- primary contexts ------------------------------------------------------------------------------------

namespace fakecuda::driver {

// The device's primary context made, at the address reserved for it if the runtime was given one (not retained).
// Caller holds d.mutex; p.context is null.
CUresult MakePrimary(Driver& d, std::uint32_t physical, CUdevice ordinal) {
  Driver::Primary& p = d.primary[physical];
  auto* c = p.reserved != nullptr ? std::exchange(p.reserved, nullptr) : new Context();
  c->device = physical;
  c->ordinal = static_cast<std::uint32_t>(ordinal);
  c->primary = true;
  c->flags = p.flags;
  if (const CUresult r = SetUpContext(d, c); r != CUDA_SUCCESS) {
    delete c;
    return r;
  }
  Register(d, c);
  p.context = c;
  return CUDA_SUCCESS;
}

}  // namespace fakecuda::driver

FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  FAKECUDA_ENTER("cuDevicePrimaryCtxRetain");
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (context == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> guard(d.mutex);
  Driver::Primary& p = d.primary[physical];
  if (p.context == nullptr) {
    if (const CUresult r = MakePrimary(d, physical, device); r != CUDA_SUCCESS) return r;
  }
  ++p.retains;
  *context = reinterpret_cast<CUcontext>(p.context);
  return CUDA_SUCCESS;
}

namespace fakecuda::driver {

CUresult PrimaryContextHandle(CUdevice device, CUcontext& context) {
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> guard(d.mutex);
  Driver::Primary& p = d.primary[physical];
  if (p.context == nullptr && p.reserved == nullptr) p.reserved = new Context();
  context = reinterpret_cast<CUcontext>(p.context != nullptr ? p.context : p.reserved);
  return CUDA_SUCCESS;
}

}  // namespace fakecuda::driver

namespace {
// cuDevicePrimaryCtxRelease_v2 and cuDevicePrimaryCtxRelease: one body, each entry point checked under its own name.
CUresult DevicePrimaryCtxReleaseEntry(const char* symbol, CUdevice device) {
  FAKECUDA_ENTER(symbol);
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  std::unique_lock<std::mutex> guard(d.mutex);
  Driver::Primary& p = d.primary[physical];
  if (p.retains == 0) return CUDA_ERROR_INVALID_CONTEXT;
  // After a reset the context may be gone while retains remain: releasing them is still allowed.
  if (--p.retains == 0 && p.context != nullptr) {
    Context* c = p.context;
    p.context = nullptr;
    guard.unlock();
    WaitContextIdle(c);
    guard.lock();
    TearDownContext(d, c);
  }
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
  return DevicePrimaryCtxReleaseEntry("cuDevicePrimaryCtxRelease_v2", device);
}

#undef cuDevicePrimaryCtxRelease  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice device) {
  return DevicePrimaryCtxReleaseEntry("cuDevicePrimaryCtxRelease", device);
}

FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned int* flags, int* active) {
  FAKECUDA_ENTER("cuDevicePrimaryCtxGetState");
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (flags == nullptr || active == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> guard(d.mutex);
  *flags = d.primary[physical].flags;
  *active = d.primary[physical].context != nullptr ? 1 : 0;
  return CUDA_SUCCESS;
}

namespace {
// cuDevicePrimaryCtxSetFlags_v2 and cuDevicePrimaryCtxSetFlags: one body, each entry point checked under its own name.
CUresult DevicePrimaryCtxSetFlagsEntry(const char* symbol, CUdevice device, unsigned int flags) {
  FAKECUDA_ENTER(symbol);
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  constexpr unsigned int kValid = CU_CTX_SCHED_MASK | CU_CTX_MAP_HOST | CU_CTX_LMEM_RESIZE_TO_MAX |
                                  CU_CTX_COREDUMP_ENABLE | CU_CTX_USER_COREDUMP_ENABLE | CU_CTX_SYNC_MEMOPS;
  if ((flags & ~kValid) != 0 || (flags & CU_CTX_SCHED_MASK) == CU_CTX_SCHED_MASK) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> guard(d.mutex);
  d.primary[physical].flags = flags;
  if (d.primary[physical].context != nullptr) d.primary[physical].context->flags = flags;
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice device, unsigned int flags) {
  return DevicePrimaryCtxSetFlagsEntry("cuDevicePrimaryCtxSetFlags_v2", device, flags);
}

#undef cuDevicePrimaryCtxSetFlags  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice device, unsigned int flags) {
  return DevicePrimaryCtxSetFlagsEntry("cuDevicePrimaryCtxSetFlags", device, flags);
}

namespace {
// cuDevicePrimaryCtxReset_v2 and cuDevicePrimaryCtxReset: one body, each entry point checked under its own name.
CUresult DevicePrimaryCtxResetEntry(const char* symbol, CUdevice device) {
  FAKECUDA_ENTER(symbol);
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  std::unique_lock<std::mutex> guard(d.mutex);
  Driver::Primary& p = d.primary[physical];
  if (p.context != nullptr) {
    Context* c = p.context;
    p.context = nullptr;  // retains stay: "resetting the primary context does not release it"
    guard.unlock();
    WaitContextIdle(c);
    guard.lock();
    TearDownContext(d, c);
  }
  p.flags = 0;
  return CUDA_SUCCESS;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) {
  return DevicePrimaryCtxResetEntry("cuDevicePrimaryCtxReset_v2", device);
}

#undef cuDevicePrimaryCtxReset  // cuda.h maps the name to its newest version; this defines the older symbol
FAKECUDA_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice device) {
  return DevicePrimaryCtxResetEntry("cuDevicePrimaryCtxReset", device);
}

// ---- explicit contexts and the context stack ------------------------------------------------------------

namespace {

constexpr unsigned int kContextFlags = CU_CTX_SCHED_MASK | CU_CTX_MAP_HOST | CU_CTX_LMEM_RESIZE_TO_MAX |
                                       CU_CTX_COREDUMP_ENABLE | CU_CTX_USER_COREDUMP_ENABLE | CU_CTX_SYNC_MEMOPS;

CUresult CreateContext(CUcontext* out, unsigned int flags, CUdevice device) {
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (out == nullptr || (flags & ~kContextFlags) != 0 || (flags & CU_CTX_SCHED_MASK) == CU_CTX_SCHED_MASK) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> guard(d.mutex);
  auto* c = new Context();
  c->device = physical;
  c->ordinal = static_cast<std::uint32_t>(device);
  c->flags = flags;
  if (const CUresult r = SetUpContext(d, c); r != CUDA_SUCCESS) {
    delete c;
    return r;
  }
  Register(d, c);
  ContextStack().push_back(c);
  *out = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}

}  // namespace

FAKECUDA_EXPORT CUresult cuCtxCreate_v2(CUcontext* context, unsigned int flags, CUdevice device) {
  FAKECUDA_ENTER("cuCtxCreate_v2");
  return CreateContext(context, flags, device);
}

FAKECUDA_EXPORT CUresult cuCtxCreate_v3(CUcontext* context, CUexecAffinityParam* params, int count, unsigned int flags,
                                        CUdevice device) {
  FAKECUDA_ENTER("cuCtxCreate_v3");
  if (count < 0 || (count > 0 && params == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  return CreateContext(context, flags, device);
}

FAKECUDA_EXPORT CUresult cuCtxCreate_v4(CUcontext* context, CUctxCreateParams* params, unsigned int flags,
                                        CUdevice device) {
  FAKECUDA_ENTER("cuCtxCreate_v4");
  (void)params;  // execution affinity and CIG parameters are accepted and ignored
  return CreateContext(context, flags, device);
}

FAKECUDA_EXPORT CUresult cuCtxDestroy_v2(CUcontext handle) {
  FAKECUDA_ENTER("cuCtxDestroy_v2");
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  Context* c = Lookup<Context>(d, handle, Kind::context);
  if (c == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (c->primary) return CUDA_ERROR_INVALID_CONTEXT;
  guard.unlock();
  WaitContextIdle(c);
  guard.lock();
  if (Lookup<Context>(d, handle, Kind::context) == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  auto& stack = ContextStack();
  if (!stack.empty() && stack.back() == c) stack.pop_back();
  TearDownContext(d, c);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext handle) {
  FAKECUDA_ENTER("cuCtxPushCurrent_v2");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = Lookup<Context>(d, handle, Kind::context);
  if (c == nullptr && d.destroyed_contexts.count(handle) != 0) c = reinterpret_cast<Context*>(handle);
  if (c == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  ContextStack().push_back(c);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* popped) {
  FAKECUDA_ENTER("cuCtxPopCurrent_v2");
  auto& stack = ContextStack();
  if (stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (popped != nullptr) *popped = reinterpret_cast<CUcontext>(stack.back());
  stack.pop_back();
  return CUDA_SUCCESS;
}

namespace {
// A primary context the runtime was given the handle of (PrimaryContextHandle) is made when it is first made current,
// as the runtime does before it retains it; null if `handle` is no such reservation or the context cannot be made.
// Caller holds d.mutex.
Context* MakeReservedPrimary(Driver& d, CUcontext handle) {
  for (std::uint32_t ordinal = 0; ordinal < d.visible.size(); ++ordinal) {
    const std::uint32_t physical = d.visible[ordinal];
    if (d.primary[physical].reserved != reinterpret_cast<Context*>(handle)) continue;
    if (MakePrimary(d, physical, static_cast<CUdevice>(ordinal)) != CUDA_SUCCESS) return nullptr;
    return d.primary[physical].context;
  }
  return nullptr;
}
}  // namespace

FAKECUDA_EXPORT CUresult cuCtxSetCurrent(CUcontext handle) {
  FAKECUDA_ENTER("cuCtxSetCurrent");
  Driver& d = TheDriver();
  auto& stack = ContextStack();
  if (handle == nullptr) {
    if (!stack.empty()) stack.pop_back();
    return CUDA_SUCCESS;
  }
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = Lookup<Context>(d, handle, Kind::context);
  // A destroyed context can be made current (observed on an H100, driver 580.159.04): work in it then fails
  // with CUDA_ERROR_CONTEXT_IS_DESTROYED.
  if (c == nullptr && d.destroyed_contexts.count(handle) != 0) c = reinterpret_cast<Context*>(handle);
  if (c == nullptr) c = MakeReservedPrimary(d, handle);
  if (c == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (stack.empty())
    stack.push_back(c);
  else
    stack.back() = c;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetCurrent(CUcontext* out) {
  FAKECUDA_ENTER("cuCtxGetCurrent");
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  *out = reinterpret_cast<CUcontext>(CurrentContext(d));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetDevice(CUdevice* device) {
  FAKECUDA_ENTER("cuCtxGetDevice");
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  *device = static_cast<CUdevice>(c->ordinal);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetDevice_v2(CUdevice* device, CUcontext handle) {
  FAKECUDA_ENTER("cuCtxGetDevice_v2");
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = handle == nullptr ? CurrentContext(d) : Lookup<Context>(d, handle, Kind::context);
  if (c == nullptr) return NoContextError(d);
  *device = static_cast<CUdevice>(c->ordinal);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetFlags(unsigned int* flags) {
  FAKECUDA_ENTER("cuCtxGetFlags");
  if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  *flags = c->flags;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetId(CUcontext handle, unsigned long long* id) {
  FAKECUDA_ENTER("cuCtxGetId");
  if (id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = handle == nullptr ? CurrentContext(d) : Lookup<Context>(d, handle, Kind::context);
  if (c == nullptr) return NoContextError(d);
  *id = c->id;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetApiVersion(CUcontext handle, unsigned int* version) {
  FAKECUDA_ENTER("cuCtxGetApiVersion");
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = handle == nullptr ? CurrentContext(d) : Lookup<Context>(d, handle, Kind::context);
  if (c == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *version = 3020;  // the context API version every context since CUDA 3.2 reports
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxSynchronize() {
  FAKECUDA_ENTER("cuCtxSynchronize");
  Driver& d = TheDriver();
  Context* c = nullptr;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    c = CurrentContext(d);
    if (c == nullptr) return NoContextError(d);
  }
  const CUresult r = WaitContextIdle(c);
  std::lock_guard<std::mutex> guard(d.mutex);
  TrimPoolsAtSync(d);
  return r;
}

FAKECUDA_EXPORT CUresult cuCtxSynchronize_v2(CUcontext handle) {
  FAKECUDA_ENTER("cuCtxSynchronize_v2");
  Driver& d = TheDriver();
  Context* c = nullptr;
  {
    std::lock_guard<std::mutex> guard(d.mutex);
    c = handle == nullptr ? CurrentContext(d) : Lookup<Context>(d, handle, Kind::context);
  }
  if (c == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  const CUresult r = WaitContextIdle(c);
  std::lock_guard<std::mutex> guard(d.mutex);
  TrimPoolsAtSync(d);
  return r;
}

FAKECUDA_EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  FAKECUDA_ENTER("cuCtxGetStreamPriorityRange");
  if (least != nullptr) *least = 0;
  if (greatest != nullptr) *greatest = -5;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetLimit(size_t* value, CUlimit limit) {
  FAKECUDA_ENTER("cuCtxGetLimit");
  if (value == nullptr || static_cast<int>(limit) < 0 || limit >= CU_LIMIT_MAX || limit >= 16)
    return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  static constexpr size_t kDefaults[16] = {1024, 1048576, 8388608, 2, 2048, 0, 32, 0};
  *value = c->limits[limit] != 0 ? c->limits[limit] : kDefaults[limit];
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
  FAKECUDA_ENTER("cuCtxSetLimit");
  if (static_cast<int>(limit) < 0 || limit >= CU_LIMIT_MAX || limit >= 16) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  // The stack is local memory for every thread the device holds: resized at once, up or down (H100: 16 -> 32 KiB a
  // thread took 4224 MiB more). The heap and the printf FIFO are taken later, or not in device memory.
  if (limit == CU_LIMIT_STACK_SIZE) {
    if (const CUresult r = ResizeLocalMemory(d, *c, value); r != CUDA_SUCCESS) return r;
  }
  c->limits[limit] = value;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache* config) {
  FAKECUDA_ENTER("cuCtxGetCacheConfig");
  if (config == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *config = CU_FUNC_CACHE_PREFER_NONE;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache config) {
  FAKECUDA_ENTER("cuCtxSetCacheConfig");
  return static_cast<int>(config) < 0 || config > CU_FUNC_CACHE_PREFER_EQUAL ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
