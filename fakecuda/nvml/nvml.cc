// fakecuda's libnvidia-ml.so.1: the NVML entry points, answered from the shared fake machine.
//
// NVML only observes: it never claims a process slot. Indices are the machine's device indices
// (NVML ignores CUDA_VISIBLE_DEVICES, as the real one does). Every exported function is listed in
// nvml.map; the legacy names (nvmlInit, nvmlDeviceGetPciInfo, ...) are exported next to the versioned
// ones with the struct layouts of their time, because clients look functions up by name.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>

// Declares the legacy unversioned names with their own signatures instead of #defining them away.
#define NVML_NO_UNVERSIONED_FUNC_DEFS
// The library is built with hidden visibility; the NVML API itself is what it exports (nvml.map picks
// which of these functions actually are).
#pragma GCC visibility push(default)
#include <nvml.h>
#pragma GCC visibility pop

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "fakecuda/process_busy.h"
#include "fakecuda/state/faults.h"
#include "fakecuda/state/state.h"
#include "figures.h"
#include "vgpu/base/clock.h"

#define NVML_EXPORT extern "C" __attribute__((visibility("default")))

// A device handle points at one of these; anything else is a bad handle.
struct nvmlDevice_st {
  std::uint32_t index;
};

namespace {

namespace model = fakecuda::model;
namespace state = fakecuda::state;
namespace figures = fakecuda::nvml;

constexpr char kDriverVersion[] = "580.95.05";
constexpr char kNvmlVersion[] = "13.580.95.05";
constexpr int kCudaDriverVersion = 13000;
// Names newer nvml.h headers have (the nvidia-nvml-dev 13.4 wheel) and CUDA 13.0's toolkit header lacks: the values
// are the driver's, so the library is the same whichever header it is built against.
#ifndef NVML_INIT_FLAG_FORCE_INIT
#define NVML_INIT_FLAG_FORCE_INIT (1 << 2)
#endif
constexpr auto kTemperatureGpuMax = static_cast<nvmlTemperatureSensors_t>(1);  // NVML_TEMPERATURE_GPU_MAX

constexpr unsigned int kKnownInitFlags = NVML_INIT_FLAG_NO_GPUS | NVML_INIT_FLAG_NO_ATTACH | NVML_INIT_FLAG_FORCE_INIT;
// nvmlProcessInfo_v2_t: gpuInstanceId and computeInstanceId when MIG is off.
constexpr unsigned int kNoMigInstance = 0xFFFFFFFFu;

// Every nvmlReturn_t with its nvmlErrorString text, so that messages read the same on fakecuda and on a GPU:
// the real library's wording where pynvml records it (codes 0-18, 20, 999), the header's descriptions for
// the rest. Also the error names FAKECUDA_FAULTS rules may use.
#define FAKECUDA_NVML_RETURN_CODES(X)                                                         \
  X(NVML_SUCCESS, "Success")                                                                  \
  X(NVML_ERROR_UNINITIALIZED, "Uninitialized")                                                \
  X(NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument")                                          \
  X(NVML_ERROR_NOT_SUPPORTED, "Not Supported")                                                \
  X(NVML_ERROR_NO_PERMISSION, "Insufficient Permissions")                                     \
  X(NVML_ERROR_ALREADY_INITIALIZED, "Already Initialized")                                    \
  X(NVML_ERROR_NOT_FOUND, "Not Found")                                                        \
  X(NVML_ERROR_INSUFFICIENT_SIZE, "Insufficient Size")                                        \
  X(NVML_ERROR_INSUFFICIENT_POWER, "Insufficient External Power")                             \
  X(NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")                                        \
  X(NVML_ERROR_TIMEOUT, "Timeout")                                                            \
  X(NVML_ERROR_IRQ_ISSUE, "Interrupt Request Issue")                                          \
  X(NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found")                            \
  X(NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found")                                      \
  X(NVML_ERROR_CORRUPTED_INFOROM, "Corrupted infoROM")                                        \
  X(NVML_ERROR_GPU_IS_LOST, "GPU is lost")                                                    \
  X(NVML_ERROR_RESET_REQUIRED, "GPU requires restart")                                        \
  X(NVML_ERROR_OPERATING_SYSTEM, "The operating system has blocked the request.")             \
  X(NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch.")       \
  X(NVML_ERROR_IN_USE, "In use by another client")                                            \
  X(NVML_ERROR_MEMORY, "Insufficient Memory")                                                 \
  X(NVML_ERROR_NO_DATA, "No data")                                                            \
  X(NVML_ERROR_VGPU_ECC_NOT_SUPPORTED,                                                        \
    "The requested vgpu operation is not available on target device, becasue ECC is enabled") \
  X(NVML_ERROR_INSUFFICIENT_RESOURCES, "Ran out of critical resources, other than memory")    \
  X(NVML_ERROR_FREQ_NOT_SUPPORTED, "The requested frequency is not supported")                \
  X(NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "The provided version is invalid/unsupported")      \
  X(NVML_ERROR_DEPRECATED, "The requested functionality has been deprecated")                 \
  X(NVML_ERROR_NOT_READY, "The system is not ready for the request")                          \
  X(NVML_ERROR_GPU_NOT_FOUND, "The GPU was not found")                                        \
  X(NVML_ERROR_INVALID_STATE, "The requested operation is in invalid state")                  \
  X(NVML_ERROR_RESET_TYPE_NOT_SUPPORTED, "Reset not supported for given device/parameters")   \
  X(NVML_ERROR_UNKNOWN, "Unknown Error")

struct ReturnCode {
  nvmlReturn_t code;
  std::string_view name;
  const char* message;
};

#define FAKECUDA_NVML_RETURN_CODE_ENTRY(code, message) {code, #code, message},
constexpr ReturnCode kReturnCodes[] = {FAKECUDA_NVML_RETURN_CODES(FAKECUDA_NVML_RETURN_CODE_ENTRY)};
#undef FAKECUDA_NVML_RETURN_CODE_ENTRY

int ErrorCodeOf(std::string_view name) {
  for (const ReturnCode& entry : kReturnCodes) {
    if (entry.name == name) return static_cast<int>(entry.code);
  }
  return -1;
}

// glibc's own dlsym: a preloaded library may export a dlsym of its own (the vgpu shim does, and answers its hooks for
// NVML names), which would make this library's own exports look like someone else's.
using DlsymFunction = void* (*)(void*, const char*);
DlsymFunction GlibcDlsym() {
  auto found = reinterpret_cast<DlsymFunction>(dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34"));
  if (found == nullptr) found = reinterpret_cast<DlsymFunction>(dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.2.5"));
  return found != nullptr ? found : &dlsym;
}

// Whether this library exports `symbol`: asks the dynamic linker, so that nvml.map stays the one list.
bool ExportsSymbol(std::string_view symbol) {
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&ErrorCodeOf), &self) == 0 || self.dli_fname == nullptr) return true;
  void* library = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (library == nullptr) return true;  // cannot tell: let the rule stand rather than refuse a valid one
  const std::string name(symbol);
  void* address = GlibcDlsym()(library, name.c_str());
  Dl_info found{};
  const bool ours = address != nullptr && dladdr(address, &found) != 0 && found.dli_fbase == self.dli_fbase;
  dlclose(library);
  return ours;
}

// The getters a FAKECUDA_FAULTS `garbage` rule may spoil: each runs as usual, then its outputs are replaced with
// absurd values drawn from the rule's generator and it returns NVML_SUCCESS (the Spoil* functions below).
constexpr std::string_view kGarbageGetters[] = {"nvmlDeviceGetCount",
                                                "nvmlDeviceGetCount_v2",
                                                "nvmlDeviceGetHandleByIndex",
                                                "nvmlDeviceGetHandleByIndex_v2",
                                                "nvmlDeviceGetHandleByUUID",
                                                "nvmlDeviceGetUUID",
                                                "nvmlDeviceGetIndex",
                                                "nvmlDeviceGetMemoryInfo",
                                                "nvmlDeviceGetMemoryInfo_v2",
                                                "nvmlDeviceGetUtilizationRates",
                                                "nvmlDeviceGetSamples",
                                                "nvmlDeviceGetComputeRunningProcesses",
                                                "nvmlDeviceGetComputeRunningProcesses_v2",
                                                "nvmlDeviceGetComputeRunningProcesses_v3"};

bool GarbageCapable(std::string_view symbol) {
  return std::find(std::begin(kGarbageGetters), std::end(kGarbageGetters), symbol) != std::end(kGarbageGetters);
}

constexpr fakecuda::faults::Library kLibrary = {"libnvidia-ml.so.1", "nvml",        "NVML_ERROR_",
                                                ErrorCodeOf,         ExportsSymbol, GarbageCapable};

// A garbage hit on this thread's current call, taken by the getter once it has run. g_garbage_armed keeps the
// thread-local out of every call of a process that never had a garbage hit.
std::atomic<bool> g_garbage_armed{false};
thread_local const char* t_garbage_function = nullptr;
thread_local fakecuda::faults::Outcome t_garbage_outcome{};

// FAKECUDA_FAULTS: the first thing every exported function does, so that an injected error has no effect.
nvmlReturn_t InjectedFault(const char* function) {
  const fakecuda::faults::Outcome outcome = fakecuda::faults::Evaluate(function, kLibrary);
  if (outcome.garbage) g_garbage_armed.store(true, std::memory_order_relaxed);
  if (outcome.garbage || g_garbage_armed.load(std::memory_order_relaxed)) {
    t_garbage_function = outcome.garbage ? function : nullptr;
    t_garbage_outcome = outcome;
  }
  return static_cast<nvmlReturn_t>(outcome.error);
}

// The garbage of the current call of `function`, if a garbage rule hit it; Next() draws its values.
class Garbage {
 public:
  explicit Garbage(const char* function) {
    if (!g_garbage_armed.load(std::memory_order_relaxed) || t_garbage_function == nullptr ||
        std::strcmp(t_garbage_function, function) != 0) {
      return;
    }
    on_ = true;
    outcome_ = t_garbage_outcome;
    t_garbage_function = nullptr;
  }
  explicit operator bool() const { return on_; }
  std::uint64_t Next() { return fakecuda::faults::GarbageValue(outcome_, ++drawn_); }
  // Any magnitude: every bit length about equally likely (0, a few, billions, 2^63...).
  std::uint64_t AnySize() {
    const std::uint64_t value = Next();
    return value >> (Next() % 64);
  }
  std::uint32_t Word() { return static_cast<std::uint32_t>(Next() >> 32); }

 private:
  bool on_ = false;
  fakecuda::faults::Outcome outcome_{};
  std::uint64_t drawn_ = 0;
};

// The "now" of NVML timestamps (wall clock, microseconds), for garbage that runs ahead of or behind it.
unsigned long long WallClockUs() { return vgpu::base::RealtimeNs() / 1000; }

// ---- garbage: what each getter's outputs become on a hit (docs/fakecuda.md, "Fault injection") ----------

nvmlReturn_t SpoilWord(const char* function, nvmlReturn_t result, unsigned int* out) {
  Garbage garbage(function);
  if (!garbage || out == nullptr) return result;
  *out = garbage.Word();
  return NVML_SUCCESS;
}

// A handle of any of the 8 slots: possibly another device, possibly one this machine does not have.
nvmlReturn_t SpoilHandle(const char* function, nvmlReturn_t result, nvmlDevice_t* out);

// Printable noise over the whole buffer, NUL-terminated at a random place, or (one hit in four) not at all.
nvmlReturn_t SpoilString(const char* function, nvmlReturn_t result, char* out, unsigned int length) {
  Garbage garbage(function);
  if (!garbage || out == nullptr || length == 0) return result;
  for (unsigned int i = 0; i < length; ++i) out[i] = static_cast<char>(0x21 + garbage.Next() % 94);
  if (garbage.Next() % 4 != 0) out[garbage.Next() % length] = '\0';
  return NVML_SUCCESS;
}

// used > total always; free and total of any size.
template <typename Memory>
nvmlReturn_t SpoilMemory(const char* function, nvmlReturn_t result, Memory* memory) {
  Garbage garbage(function);
  if (!garbage || memory == nullptr) return result;
  const std::uint64_t total = garbage.AnySize() >> 1;
  std::uint64_t used = total + 1 + (garbage.AnySize() >> 1);
  memory->total = total;
  memory->used = used;
  memory->free = garbage.AnySize();
  if constexpr (requires { memory->reserved; }) memory->reserved = garbage.AnySize();
  return NVML_SUCCESS;
}

// Percentages far above 100 (up to 4.29e9).
nvmlReturn_t SpoilUtilization(const char* function, nvmlReturn_t result, nvmlUtilization_t* utilization) {
  Garbage garbage(function);
  if (!garbage || utilization == nullptr) return result;
  utilization->gpu = 101 + garbage.Word() % (0xFFFFFFFFu - 101);
  utilization->memory = garbage.Word();
  return NVML_SUCCESS;
}

// One of four kinds, drawn per hit: more samples than the buffer holds; timestamps from the future, newest first;
// timestamps going back to before the caller's last one (or zero); a wrong value type. Values above 100 %. Never
// writes past the `capacity` entries the caller gave.
nvmlReturn_t SpoilSamples(const char* function, nvmlReturn_t result, unsigned long long last_seen,
                          nvmlValueType_t* value_type, unsigned int* sample_count, nvmlSample_t* samples,
                          unsigned int capacity) {
  Garbage garbage(function);
  if (!garbage || value_type == nullptr || sample_count == nullptr) return result;
  *value_type = NVML_VALUE_TYPE_UNSIGNED_INT;
  if (samples == nullptr) {
    *sample_count = garbage.Word();
    return NVML_SUCCESS;
  }
  const std::uint64_t kind = garbage.Next() % 4;
  const unsigned int written = capacity == 0 ? 0 : 1 + static_cast<unsigned int>(garbage.Next() % capacity);
  const unsigned long long now = WallClockUs();
  for (unsigned int i = 0; i < written; ++i) {
    unsigned long long timestamp = garbage.Next();
    if (kind == 1) timestamp = now + 1 + (garbage.Next() >> 8) - i;  // the future, backwards
    if (kind == 2) timestamp = last_seen > i ? last_seen - 1 - i - garbage.Next() % (last_seen - i) : 0;  // the past
    samples[i].timeStamp = timestamp;
    samples[i].sampleValue.ullVal = 0;
    samples[i].sampleValue.uiVal = 101 + garbage.Word() % (0xFFFFFFFFu - 101);
  }
  *sample_count = kind == 0 ? capacity + 1 + static_cast<unsigned int>(garbage.Next() % 100000) : written;
  if (kind == 3) *value_type = static_cast<nvmlValueType_t>(1 + garbage.Next() % (NVML_VALUE_TYPE_COUNT - 1));
  return NVML_SUCCESS;
}

// One of three kinds, drawn per hit: a count above the buffer's size; a few entries of the caller's own pid with
// memory of any size; every byte noise. A size query (no array) gets any count. Never writes past `capacity`.
template <typename Info>
nvmlReturn_t SpoilProcesses(const char* function, nvmlReturn_t result, unsigned int* count, Info* infos,
                            unsigned int capacity) {
  Garbage garbage(function);
  if (!garbage || count == nullptr) return result;
  if (infos == nullptr || capacity == 0) {
    *count = garbage.Word();
    return NVML_SUCCESS;
  }
  const std::uint64_t kind = garbage.Next() % 3;
  const unsigned int written =
      kind == 2 ? capacity : 1 + static_cast<unsigned int>(garbage.Next() % std::min(capacity, 4u));
  for (unsigned int i = 0; i < written; ++i) {
    Info info{};
    if (kind == 2) {
      auto* bytes = reinterpret_cast<unsigned char*>(&info);
      for (std::size_t b = 0; b < sizeof info; ++b) bytes[b] = static_cast<unsigned char>(garbage.Next());
    } else {
      info.pid = garbage.Next() % 2 == 0 ? static_cast<unsigned int>(getpid()) : garbage.Word();
      info.usedGpuMemory = garbage.AnySize();
      if constexpr (!std::is_same_v<Info, nvmlProcessInfo_v1_t>) {
        info.gpuInstanceId = garbage.Word();
        info.computeInstanceId = garbage.Word();
      }
    }
    infos[i] = info;
  }
  *count = kind == 0 ? capacity + 1 + static_cast<unsigned int>(garbage.Next() % 100000) : written;
  return NVML_SUCCESS;
}

// The nvmlPciInfo_t of nvmlDeviceGetPciInfo (v1) and _v2: four reserved words where v3 has the 32-byte
// busId. Writing the v3 struct into a caller's v1 struct would overrun it by 16 bytes.
struct LegacyPciInfo {
  char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  unsigned int reserved[4];
};
static_assert(sizeof(LegacyPciInfo) == 52);
static_assert(offsetof(nvmlPciInfo_t, busId) == sizeof(LegacyPciInfo) - sizeof(LegacyPciInfo::reserved));

nvmlDevice_st g_devices[model::kMaxDevices] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static_assert(model::kMaxDevices == 8, "g_devices lists one handle per device");

nvmlReturn_t SpoilHandle(const char* function, nvmlReturn_t result, nvmlDevice_t* out) {
  Garbage garbage(function);
  if (!garbage || out == nullptr) return result;
  *out = &g_devices[garbage.Next() % model::kMaxDevices];
  return NVML_SUCCESS;
}

// nvmlInit/nvmlShutdown reference count. The attachment outlives a shutdown (the state layer keeps
// one per process), so a call racing a shutdown still reads valid memory; it may just answer
// NVML_ERROR_UNINITIALIZED.
std::atomic<int> g_init_count{0};
std::atomic<state::Attachment*> g_attachment{nullptr};
std::mutex g_init_mutex;  // serializes init, shutdown and re-attaching after fork
std::atomic<bool> g_attach_error_logged{false};
bool g_fork_handler_registered = false;  // guarded by g_init_mutex

// In a forked child the parent's attachment is the parent's (its file description, its mapping):
// forget it and attach afresh on the next call. NVML stays initialised in the child, as the real NVML
// does (its handles are plain process memory that fork copies).
void ForgetAttachmentInChild() {
  new (&g_init_mutex) std::mutex();
  state::ForgetAfterFork();
  g_attachment.store(nullptr, std::memory_order_release);
}

// Attaches if this process is not attached (first init, or first call in a forked child).
// Caller holds g_init_mutex.
nvmlReturn_t AttachLocked(state::Attachment*& attachment) {
  attachment = g_attachment.load(std::memory_order_acquire);
  if (attachment != nullptr) return NVML_SUCCESS;
  std::string error;
  attachment = state::Attach(/*claim_slot=*/false, error);
  if (attachment == nullptr) {
    // Real NVML answers a missing kernel driver with NVML_ERROR_DRIVER_NOT_LOADED; a machine we cannot
    // map is the same situation for its clients.
    if (!g_attach_error_logged.exchange(true)) state::LogError("nvmlInit: %s", error.c_str());
    return NVML_ERROR_DRIVER_NOT_LOADED;
  }
  g_attachment.store(attachment, std::memory_order_release);
  return NVML_SUCCESS;
}

// The gate every entry point but nvmlInit*/nvmlShutdown/nvmlErrorString passes: faults, then NVML must be
// initialised.
nvmlReturn_t Enter(const char* function, state::Attachment*& attachment) {
  if (const nvmlReturn_t injected = InjectedFault(function); injected != NVML_SUCCESS) return injected;
  if (state::LogLevel() >= 3) state::LogError("%s", function);
  if (g_init_count.load(std::memory_order_acquire) <= 0) return NVML_ERROR_UNINITIALIZED;
  attachment = g_attachment.load(std::memory_order_acquire);
  if (attachment != nullptr) return NVML_SUCCESS;
  std::lock_guard<std::mutex> guard(g_init_mutex);
  return AttachLocked(attachment);
}

std::uint32_t DeviceCount(const state::Attachment& attachment) {
  return std::min(attachment.machine->config.device_count, model::kMaxDevices);
}

// Validates a handle: it must point at one of g_devices and name a device this machine has.
bool IndexOf(const state::Attachment& attachment, nvmlDevice_t device, std::uint32_t& index) {
  const auto address = reinterpret_cast<std::uintptr_t>(device);
  const auto first = reinterpret_cast<std::uintptr_t>(&g_devices[0]);
  if (address < first || address >= first + sizeof g_devices) return false;
  if ((address - first) % sizeof(nvmlDevice_st) != 0) return false;
  index = static_cast<std::uint32_t>((address - first) / sizeof(nvmlDevice_st));
  return index < DeviceCount(attachment);
}

// Enter() plus a valid device handle. The spec is immutable once the machine exists, so callers that
// read only the spec need no lock.
nvmlReturn_t EnterDevice(const char* function, nvmlDevice_t device, state::Attachment*& attachment,
                         std::uint32_t& index) {
  const nvmlReturn_t entered = Enter(function, attachment);
  if (entered != NVML_SUCCESS) return entered;
  if (!IndexOf(*attachment, device, index)) {
    if (state::LogLevel() >= 2) {
      state::LogError("%s: device handle %p is not one nvmlDeviceGetHandleBy* returned (%u device(s))", function,
                      static_cast<void*>(device), DeviceCount(*attachment));
    }
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  return NVML_SUCCESS;
}

const model::DeviceSpec& SpecOf(const state::Attachment& attachment, std::uint32_t index) {
  return attachment.machine->config.devices[index];
}

// Holds the machine's lock with the dead reaped and the device's timeline brought up to now, so that
// what is read next is the present.
class LiveDevice {
 public:
  LiveDevice(state::Attachment& attachment, std::uint32_t index)
      : lock_(attachment), now_ns_(state::MonotonicNs()), index_(index) {
    state::ReapDeadProcesses(attachment, now_ns_, /*force=*/false);
    state::AdvanceToNow(attachment, index_, now_ns_);
  }
  const model::Machine& machine() { return lock_.machine(); }
  const model::DeviceTimeline& timeline() { return lock_.machine().devices[index_]; }
  std::uint64_t now_ns() const { return now_ns_; }
  std::uint32_t utilization_percent() {
    return std::min<std::uint32_t>(100, model::PublishedUtilizationPercent(lock_.machine(), index_, now_ns_));
  }

 private:
  state::MachineLock lock_;
  std::uint64_t now_ns_;
  std::uint32_t index_;
};

nvmlReturn_t CopyString(std::string_view text, char* out, unsigned int length) {
  if (out == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (length < text.size() + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
  std::memcpy(out, text.data(), text.size());
  out[text.size()] = '\0';
  return NVML_SUCCESS;
}

nvmlReturn_t Init(const char* function, unsigned int flags) {
  if (const nvmlReturn_t injected = InjectedFault(function); injected != NVML_SUCCESS) return injected;
  if (state::LogLevel() >= 3) state::LogError("%s(flags=%#x)", function, flags);
  // A FAKECUDA_FAULTS that does not parse has been reported on stderr; like a machine that cannot be
  // mapped, it leaves NVML without a driver.
  if (std::string error; !fakecuda::faults::Configured(kLibrary, error)) return NVML_ERROR_DRIVER_NOT_LOADED;
  if ((flags & ~kKnownInitFlags) != 0) {
    if (state::LogLevel() >= 1) {
      state::LogError(
          "%s: flags %#x include unknown bits %#x; accepted: NVML_INIT_FLAG_NO_GPUS (1), "
          "NVML_INIT_FLAG_NO_ATTACH (2), NVML_INIT_FLAG_FORCE_INIT (4)",
          function, flags, flags & ~kKnownInitFlags);
    }
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  std::lock_guard<std::mutex> guard(g_init_mutex);
  if (!g_fork_handler_registered) {
    if (pthread_atfork(nullptr, nullptr, ForgetAttachmentInChild) != 0) return NVML_ERROR_MEMORY;
    g_fork_handler_registered = true;
  }
  state::Attachment* attachment = nullptr;
  const nvmlReturn_t attached = AttachLocked(attachment);
  if (attached != NVML_SUCCESS) return attached;
  g_init_count.fetch_add(1, std::memory_order_acq_rel);
  return NVML_SUCCESS;
}

// The live processes that use `index`: a context on it or memory charged to it (what the real NVML
// lists as compute processes). Visits each with its slot.
template <typename Visit>
void ForEachComputeProcess(const model::Machine& machine, std::uint32_t index, Visit visit) {
  for (const model::ProcessSlot& slot : machine.slots) {
    if (slot.state != model::SlotState::live || slot.pid <= 0) continue;
    if (slot.contexts[index] == 0 && slot.memory_bytes[index] == 0) continue;
    visit(slot);
  }
}

// The size-query protocol of nvmlDeviceGet*RunningProcesses: with no array, or too small a one,
// report the count needed and NVML_ERROR_INSUFFICIENT_SIZE; no processes is success with count 0.
template <typename Info>
nvmlReturn_t ComputeProcessesAsIs(const char* function, nvmlDevice_t device, unsigned int* count, Info* infos) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  LiveDevice live(*attachment, index);
  unsigned int needed = 0;
  ForEachComputeProcess(live.machine(), index, [&](const model::ProcessSlot&) { ++needed; });
  if (needed == 0) {
    *count = 0;
    return NVML_SUCCESS;
  }
  if (infos == nullptr || *count < needed) {
    *count = needed;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  unsigned int written = 0;
  ForEachComputeProcess(live.machine(), index, [&](const model::ProcessSlot& slot) {
    Info info{};
    info.pid = static_cast<unsigned int>(slot.pid);
    info.usedGpuMemory = slot.memory_bytes[index];
    if constexpr (!std::is_same_v<Info, nvmlProcessInfo_v1_t>) {
      info.gpuInstanceId = kNoMigInstance;
      info.computeInstanceId = kNoMigInstance;
    }
    infos[written++] = info;
  });
  *count = written;
  return NVML_SUCCESS;
}

template <typename Info>
nvmlReturn_t ComputeProcesses(const char* function, nvmlDevice_t device, unsigned int* count, Info* infos) {
  const unsigned int capacity = count != nullptr ? *count : 0;
  const nvmlReturn_t result = ComputeProcessesAsIs(function, device, count, infos);
  return SpoilProcesses(function, result, count, infos, capacity);
}

// fakecuda models compute only: the graphics list is always empty.
nvmlReturn_t GraphicsProcesses(const char* function, nvmlDevice_t device, unsigned int* count) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *count = 0;
  return NVML_SUCCESS;
}

// Each live process's latest per-process sample on `index`, if newer than `last_seen_us`.
template <typename Visit>
void ForEachSampleSince(const model::Machine& machine, std::uint32_t index, unsigned long long last_seen_us,
                        Visit visit) {
  for (const model::ProcessSlot& slot : machine.slots) {
    if (slot.state != model::SlotState::live || slot.pid <= 0) continue;
    const model::NvmlSample& sample = slot.latest_sample[index];
    if (sample.valid == 0 || sample.timestamp_us <= last_seen_us) continue;
    visit(slot, sample);
  }
}

nvmlReturn_t PciInfoLegacy(const char* function, nvmlDevice_t device, LegacyPciInfo* pci) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (pci == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  const figures::PciAddress address = figures::AddressOf(spec);
  const figures::PciIds ids = figures::PciIdsOf(spec);
  LegacyPciInfo info{};
  std::snprintf(info.busId, sizeof info.busId, "%s", figures::BusIdString(address, /*legacy=*/true).c_str());
  info.domain = address.domain;
  info.bus = address.bus;
  info.device = address.device;
  info.pciDeviceId = ids.device_id;
  info.pciSubSystemId = ids.subsystem_id;
  std::memcpy(pci, &info, sizeof info);
  return NVML_SUCCESS;
}

nvmlReturn_t HandleByIndexAsIs(const char* function, unsigned int index, nvmlDevice_t* device) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(function, attachment); r != NVML_SUCCESS) return r;
  if (device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (index >= DeviceCount(*attachment)) {
    if (state::LogLevel() >= 2) {
      state::LogError("%s: index %u is out of range: this machine has %u device(s) (FAKECUDA_DEVICES)", function, index,
                      DeviceCount(*attachment));
    }
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  *device = &g_devices[index];
  return NVML_SUCCESS;
}

nvmlReturn_t HandleByIndex(const char* function, unsigned int index, nvmlDevice_t* device) {
  return SpoilHandle(function, HandleByIndexAsIs(function, index, device), device);
}

nvmlReturn_t HandleByPciBusId(const char* function, const char* bus_id, nvmlDevice_t* device) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(function, attachment); r != NVML_SUCCESS) return r;
  if (bus_id == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  figures::PciAddress wanted;
  if (!figures::ParseBusId(bus_id, wanted)) {
    if (state::LogLevel() >= 2) {
      state::LogError(
          "%s: '%.64s' is not a PCI bus id; accepted (hex): domain:bus:device.function, "
          "domain:bus:device, bus:device.function",
          function, bus_id);
    }
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  for (std::uint32_t index = 0; index < DeviceCount(*attachment); ++index) {
    const figures::PciAddress address = figures::AddressOf(SpecOf(*attachment, index));
    if (address.domain == wanted.domain && address.bus == wanted.bus && address.device == wanted.device &&
        address.function == wanted.function) {
      *device = &g_devices[index];
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

// Reads the name /proc/PID/cmdline starts with (what nvidia-smi shows for a process), or
// /proc/PID/comm where the command line is empty (a kernel thread, a zombie).
nvmlReturn_t ReadProcessName(unsigned int pid, std::string& name) {
  char path[64];
  char buffer[4096];
  for (const char* file : {"cmdline", "comm"}) {
    std::snprintf(path, sizeof path, "/proc/%u/%s", pid, file);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT || errno == ESRCH) return NVML_ERROR_NOT_FOUND;
      if (errno == EACCES || errno == EPERM) return NVML_ERROR_NO_PERMISSION;
      return NVML_ERROR_UNKNOWN;
    }
    ssize_t got = 0;
    do {
      got = read(fd, buffer, sizeof buffer - 1);
    } while (got < 0 && errno == EINTR);
    close(fd);
    if (got <= 0) continue;
    buffer[got] = '\0';
    name.assign(buffer, std::strlen(buffer));
    while (!name.empty() && name.back() == '\n') name.pop_back();
    if (!name.empty()) return NVML_SUCCESS;
  }
  return NVML_ERROR_NOT_FOUND;
}

}  // namespace

// ---- initialisation ----------------------------------------------------------------------------------

NVML_EXPORT nvmlReturn_t nvmlInit_v2(void) { return Init(__func__, 0); }
NVML_EXPORT nvmlReturn_t nvmlInit(void) { return Init(__func__, 0); }
NVML_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { return Init(__func__, flags); }

NVML_EXPORT nvmlReturn_t nvmlShutdown(void) {
  if (const nvmlReturn_t injected = InjectedFault(__func__); injected != NVML_SUCCESS) return injected;
  if (state::LogLevel() >= 3) state::LogError("%s", __func__);
  std::lock_guard<std::mutex> guard(g_init_mutex);
  if (g_init_count.load(std::memory_order_acquire) <= 0) return NVML_ERROR_UNINITIALIZED;
  g_init_count.fetch_sub(1, std::memory_order_acq_rel);
  return NVML_SUCCESS;
}

NVML_EXPORT const char* nvmlErrorString(nvmlReturn_t result) {
  for (const ReturnCode& entry : kReturnCodes) {
    if (entry.code == result) return entry.message;
  }
  return "Unknown Error";
}

// ---- system ------------------------------------------------------------------------------------------

NVML_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  return CopyString(kDriverVersion, version, length);
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char* version, unsigned int length) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  return CopyString(kNvmlVersion, version, length);
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int* cuda_driver_version) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  if (cuda_driver_version == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *cuda_driver_version = kCudaDriverVersion;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int* cuda_driver_version) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  if (cuda_driver_version == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *cuda_driver_version = kCudaDriverVersion;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char* name, unsigned int length) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  if (name == nullptr || length == 0) return NVML_ERROR_INVALID_ARGUMENT;
  std::string text;
  if (const nvmlReturn_t r = ReadProcessName(pid, text); r != NVML_SUCCESS) return r;
  // Cropped to the caller's length, as documented.
  const std::size_t kept = std::min<std::size_t>(text.size(), length - 1);
  std::memcpy(name, text.data(), kept);
  name[kept] = '\0';
  return NVML_SUCCESS;
}

// ---- device enumeration ------------------------------------------------------------------------------

namespace {
nvmlReturn_t DeviceGetCount(const char* function, unsigned int* device_count) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(function, attachment); r != NVML_SUCCESS) return r;
  if (device_count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *device_count = DeviceCount(*attachment);
  return NVML_SUCCESS;
}
}  // namespace

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* device_count) {
  return SpoilWord(__func__, DeviceGetCount(__func__, device_count), device_count);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int* device_count) {
  return SpoilWord(__func__, DeviceGetCount(__func__, device_count), device_count);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  return HandleByIndex(__func__, index, device);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t* device) {
  return HandleByIndex(__func__, index, device);
}

namespace {
nvmlReturn_t HandleByUuid(const char* function, const char* uuid, nvmlDevice_t* device) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(function, attachment); r != NVML_SUCCESS) return r;
  if (uuid == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (std::uint32_t index = 0; index < DeviceCount(*attachment); ++index) {
    if (strcasecmp(uuid, figures::UuidString(SpecOf(*attachment, index)).c_str()) == 0) {
      *device = &g_devices[index];
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}
}  // namespace

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device) {
  return SpoilHandle(__func__, HandleByUuid(__func__, uuid, device), device);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* pci_bus_id, nvmlDevice_t* device) {
  return HandleByPciBusId(__func__, pci_bus_id, device);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char* pci_bus_id, nvmlDevice_t* device) {
  return HandleByPciBusId(__func__, pci_bus_id, device);
}

// ---- identity ----------------------------------------------------------------------------------------

NVML_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  return CopyString(std::string_view(spec.name, strnlen(spec.name, sizeof spec.name)), name, length);
}

namespace {
nvmlReturn_t DeviceUuid(const char* function, nvmlDevice_t device, char* uuid, unsigned int length) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  return CopyString(figures::UuidString(SpecOf(*attachment, index)), uuid, length);
}
}  // namespace

NVML_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  return SpoilString(__func__, DeviceUuid(__func__, device, uuid, length), uuid, length);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char* serial, unsigned int length) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  return CopyString(figures::SerialString(SpecOf(*attachment, index)), serial, length);
}

namespace {
nvmlReturn_t DeviceIndex(const char* function, nvmlDevice_t device, unsigned int* index_out) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (index_out == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *index_out = index;
  return NVML_SUCCESS;
}
}  // namespace

NVML_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int* index_out) {
  return SpoilWord(__func__, DeviceIndex(__func__, device, index_out), index_out);
}

// /dev/nvidiaN: the minor number is the device's index on a machine without hidden GPUs.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int* minor_number) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (minor_number == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *minor_number = index;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t* pci) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (pci == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  const figures::PciAddress address = figures::AddressOf(spec);
  const figures::PciIds ids = figures::PciIdsOf(spec);
  nvmlPciInfo_t info{};
  std::snprintf(info.busIdLegacy, sizeof info.busIdLegacy, "%s", figures::BusIdString(address, true).c_str());
  std::snprintf(info.busId, sizeof info.busId, "%s", figures::BusIdString(address, false).c_str());
  info.domain = address.domain;
  info.bus = address.bus;
  info.device = address.device;
  info.pciDeviceId = ids.device_id;
  info.pciSubSystemId = ids.subsystem_id;
  *pci = info;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t* pci) {
  return PciInfoLegacy(__func__, device, reinterpret_cast<LegacyPciInfo*>(pci));
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t* pci) {
  return PciInfoLegacy(__func__, device, reinterpret_cast<LegacyPciInfo*>(pci));
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int* major, int* minor) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (major == nullptr || minor == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  *major = static_cast<int>(spec.cc_major);
  *minor = static_cast<int>(spec.cc_minor);
  return NVML_SUCCESS;
}

// Data-centre boards of these generations report the plain NVIDIA brand.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t* type) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (type == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *type = NVML_BRAND_NVIDIA;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t* mode) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (mode == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *mode = NVML_FEATURE_ENABLED;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t* mode) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (mode == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *mode = NVML_COMPUTEMODE_DEFAULT;
  return NVML_SUCCESS;
}

// The model has no NVLink: its devices talk over PCIe, as boards without NVLink report (PyTorch asks at start-up,
// with expandable segments, whether a peer sits behind NVSwitch).
NVML_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t* active) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  (void)link;
  if (active == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                             nvmlIntNvLinkDeviceType_t* type) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  (void)link;
  if (type == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                             nvmlPciInfo_t* pci) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  (void)link;
  if (pci == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

// No NVSwitch fabric either, as on a machine without one.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t* info) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (info == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

// Two devices of the machine reach each other over PCIe (cuDeviceCanAccessPeer says the same), not over NVLink.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t first, nvmlDevice_t second, nvmlGpuP2PCapsIndex_t what,
                                                nvmlGpuP2PStatus_t* status) {
  state::Attachment* attachment = nullptr;
  std::uint32_t one = 0, other = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, first, attachment, one); r != NVML_SUCCESS) return r;
  if (const nvmlReturn_t r = EnterDevice(__func__, second, attachment, other); r != NVML_SUCCESS) return r;
  if (status == nullptr || static_cast<int>(what) < 0 || what > NVML_P2P_CAPS_INDEX_PCI) {
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  *status = what == NVML_P2P_CAPS_INDEX_NVLINK ? NVML_P2P_STATUS_NOT_SUPPORTED : NVML_P2P_STATUS_OK;
  return NVML_SUCCESS;
}

// MIG exists from Ampere data-centre boards on (A100, H100) and is off; a T4 does not have it.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int* current_mode,
                                              unsigned int* pending_mode) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (current_mode == nullptr || pending_mode == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (SpecOf(*attachment, index).cc_major < 8) return NVML_ERROR_NOT_SUPPORTED;
  *current_mode = NVML_DEVICE_MIG_DISABLE;
  *pending_mode = NVML_DEVICE_MIG_DISABLE;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device,
                                                         nvmlGpuVirtualizationMode_t* virtualization_mode) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (virtualization_mode == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *virtualization_mode = NVML_GPU_VIRTUALIZATION_MODE_NONE;
  return NVML_SUCCESS;
}

// vGPU licensing does not exist on a bare-metal board; pynvml's example.py asks and prints N/A.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetGridLicensableFeatures_v4(nvmlDevice_t device,
                                                                nvmlGridLicensableFeatures_t* features) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (features == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

// ---- memory ------------------------------------------------------------------------------------------

namespace {
nvmlReturn_t MemoryInfoV1(const char* function, nvmlDevice_t device, nvmlMemory_t* memory) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (memory == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  LiveDevice live(*attachment, index);
  const std::uint64_t total = spec.memory_bytes;
  const std::uint64_t used = std::min(total, spec.reserved_bytes + live.timeline().memory_used_bytes);
  memory->total = total;
  memory->used = used;
  memory->free = total - used;
  return NVML_SUCCESS;
}

nvmlReturn_t MemoryInfoV2(const char* function, nvmlDevice_t device, nvmlMemory_v2_t* memory) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (memory == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (memory->version != nvmlMemory_v2) {
    if (state::LogLevel() >= 2) {
      state::LogError("%s: memory->version is %#x; accepted: nvmlMemory_v2 (%#x)", function, memory->version,
                      static_cast<unsigned int>(nvmlMemory_v2));
    }
    // Observed on an H100, driver 580.159.04: not ARGUMENT_VERSION_MISMATCH as documented.
    return NVML_ERROR_FUNCTION_NOT_FOUND;
  }
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  LiveDevice live(*attachment, index);
  const std::uint64_t total = spec.memory_bytes;
  const std::uint64_t reserved = std::min(total, spec.reserved_bytes);
  const std::uint64_t used = std::min(total - reserved, live.timeline().memory_used_bytes);
  memory->total = total;
  memory->reserved = reserved;
  memory->used = used;
  memory->free = total - reserved - used;
  return NVML_SUCCESS;
}
}  // namespace

// v1: used = reserved + every process's allocations and contexts; free = total - used.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) {
  return SpoilMemory(__func__, MemoryInfoV1(__func__, device, memory), memory);
}

// v2: reserved on its own, used = allocations and contexts only; free is the same as v1's.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) {
  return SpoilMemory(__func__, MemoryInfoV2(__func__, device, memory), memory);
}

// ---- utilization -------------------------------------------------------------------------------------

namespace {
nvmlReturn_t UtilizationRates(const char* function, nvmlDevice_t device, nvmlUtilization_t* utilization) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (utilization == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  LiveDevice live(*attachment, index);
  utilization->gpu = live.utilization_percent();
  utilization->memory = 0;  // the model has no memory traffic
  return NVML_SUCCESS;
}
}  // namespace

NVML_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t* utilization) {
  return SpoilUtilization(__func__, UtilizationRates(__func__, device, utilization), utilization);
}

// The device's utilization samples (NVML_GPU_UTILIZATION_SAMPLES only): one per closed window, percent busy over
// the window that ends at its timestamp (CPU time, microseconds), visible once published, oldest first. The other
// sampling types are not modelled.
namespace {
nvmlReturn_t Samples(const char* function, nvmlDevice_t device, nvmlSamplingType_t type,
                     unsigned long long last_seen_timestamp, nvmlValueType_t* value_type, unsigned int* sample_count,
                     nvmlSample_t* samples) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (value_type == nullptr || sample_count == nullptr || type >= NVML_SAMPLINGTYPE_COUNT) {
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  if (type != NVML_GPU_UTILIZATION_SAMPLES) return NVML_ERROR_NOT_SUPPORTED;
  *value_type = NVML_VALUE_TYPE_UNSIGNED_INT;
  if (samples == nullptr) {
    *sample_count = model::kWindowHistory;  // what the buffer can hold
    return NVML_SUCCESS;
  }
  LiveDevice live(*attachment, index);
  const model::Machine& machine = live.machine();
  const model::DeviceTimeline& d = live.timeline();
  const std::uint32_t available = std::min<std::uint32_t>(d.window_count, model::kWindowHistory);
  unsigned int written = 0;
  for (std::uint32_t back = available; back >= 1 && written < *sample_count; --back) {
    const model::UtilWindow& w = d.windows[(d.window_count - back) % model::kWindowHistory];
    if (w.end_ns + machine.config.nvml_publish_lag_ns > live.now_ns()) continue;
    const auto timestamp_us =
        static_cast<unsigned long long>(static_cast<std::int64_t>(w.end_ns / 1000) + machine.realtime_offset_us);
    if (timestamp_us <= last_seen_timestamp) continue;
    samples[written].timeStamp = timestamp_us;
    samples[written].sampleValue.uiVal = std::min<std::uint32_t>(100, w.percent);
    ++written;
  }
  *sample_count = written;
  return written == 0 ? NVML_ERROR_NOT_FOUND : NVML_SUCCESS;
}
}  // namespace

NVML_EXPORT nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, nvmlSamplingType_t type,
                                              unsigned long long last_seen_timestamp, nvmlValueType_t* value_type,
                                              unsigned int* sample_count, nvmlSample_t* samples) {
  const unsigned int capacity = sample_count != nullptr ? *sample_count : 0;
  const nvmlReturn_t result = Samples(__func__, device, type, last_seen_timestamp, value_type, sample_count, samples);
  return SpoilSamples(__func__, result, last_seen_timestamp, value_type, sample_count, samples, capacity);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                         nvmlProcessUtilizationSample_t* utilization,
                                                         unsigned int* process_samples_count,
                                                         unsigned long long last_seen_timestamp) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (process_samples_count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  // Observed on an H100, driver 580.159.04: the size query answers the size of the driver's sample buffer (72),
  // not the number of processes, and any smaller buffer is refused before samples are looked at.
  constexpr unsigned int kSampleBufferEntries = 72;
  if (utilization == nullptr || *process_samples_count < kSampleBufferEntries) {
    *process_samples_count = kSampleBufferEntries;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  LiveDevice live(*attachment, index);
  unsigned int needed = 0;
  ForEachSampleSince(live.machine(), index, last_seen_timestamp,
                     [&](const model::ProcessSlot&, const model::NvmlSample&) { ++needed; });
  if (needed == 0) return NVML_ERROR_NOT_FOUND;
  unsigned int written = 0;
  ForEachSampleSince(live.machine(), index, last_seen_timestamp,
                     [&](const model::ProcessSlot& slot, const model::NvmlSample& sample) {
                       nvmlProcessUtilizationSample_t out{};
                       out.pid = static_cast<unsigned int>(slot.pid);
                       out.timeStamp = sample.timestamp_us;
                       out.smUtil = std::min<std::uint32_t>(sample.sm_percent, 100);
                       utilization[written++] = out;
                     });
  *process_samples_count = written;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                               nvmlProcessesUtilizationInfo_t* info) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (info == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (info->version != nvmlProcessesUtilizationInfo_v1) {
    if (state::LogLevel() >= 2) {
      state::LogError("%s: info->version is %#x; accepted: nvmlProcessesUtilizationInfo_v1 (%#x)", __func__,
                      info->version, static_cast<unsigned int>(nvmlProcessesUtilizationInfo_v1));
    }
    return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  }
  LiveDevice live(*attachment, index);
  unsigned int needed = 0;
  ForEachSampleSince(live.machine(), index, info->lastSeenTimeStamp,
                     [&](const model::ProcessSlot&, const model::NvmlSample&) { ++needed; });
  if (needed == 0) return NVML_ERROR_NOT_FOUND;
  if (info->procUtilArray == nullptr || info->processSamplesCount < needed) {
    info->processSamplesCount = needed;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  unsigned int written = 0;
  ForEachSampleSince(live.machine(), index, info->lastSeenTimeStamp,
                     [&](const model::ProcessSlot& slot, const model::NvmlSample& sample) {
                       nvmlProcessUtilizationInfo_v1_t out{};
                       out.timeStamp = sample.timestamp_us;
                       out.pid = static_cast<unsigned int>(slot.pid);
                       out.smUtil = std::min<std::uint32_t>(sample.sm_percent, 100);
                       info->procUtilArray[written++] = out;
                     });
  info->processSamplesCount = written;
  return NVML_SUCCESS;
}

namespace {
// Every process that has used device `index`: the slots (running, or dead and not yet reaped), then the departed.
template <typename Visit>
void ForEachProcessBusy(const model::Machine& machine, std::uint32_t index, Visit visit) {
  for (const model::ProcessSlot& slot : machine.slots) {
    if (slot.state != model::SlotState::live || slot.pid <= 0) continue;
    visit(fakecudaProcessBusy_t{static_cast<unsigned int>(slot.pid), 1, slot.started_ns, slot.busy_total_ns[index]});
  }
  const std::uint64_t kept = std::min<std::uint64_t>(machine.departed_count, model::kDepartedHistory);
  for (std::uint64_t k = machine.departed_count - kept; k < machine.departed_count; ++k) {
    const model::DepartedProcess& record = machine.departed[k % model::kDepartedHistory];
    if (record.pid <= 0) continue;
    visit(fakecudaProcessBusy_t{static_cast<unsigned int>(record.pid), 0, record.started_ns,
                                record.busy_total_ns[index]});
  }
}
}  // namespace

NVML_EXPORT nvmlReturn_t fakecudaDeviceGetProcessBusy(nvmlDevice_t device, unsigned int* count,
                                                      fakecudaProcessBusy_t* entries) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  LiveDevice live(*attachment, index);
  unsigned int needed = 0;
  ForEachProcessBusy(live.machine(), index, [&](const fakecudaProcessBusy_t&) { ++needed; });
  if (entries == nullptr || *count < needed) {
    *count = needed;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  unsigned int written = 0;
  ForEachProcessBusy(live.machine(), index, [&](const fakecudaProcessBusy_t& entry) { entries[written++] = entry; });
  *count = written;
  return NVML_SUCCESS;
}

// ---- processes ---------------------------------------------------------------------------------------

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int* info_count,
                                                                 nvmlProcessInfo_t* infos) {
  return ComputeProcesses(__func__, device, info_count, infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int* info_count,
                                                                 nvmlProcessInfo_v2_t* infos) {
  return ComputeProcesses(__func__, device, info_count, infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int* info_count,
                                                              nvmlProcessInfo_v1_t* infos) {
  return ComputeProcesses(__func__, device, info_count, infos);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int* info_count,
                                                                  nvmlProcessInfo_t* /*infos*/) {
  return GraphicsProcesses(__func__, device, info_count);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int* info_count,
                                                                  nvmlProcessInfo_v2_t* /*infos*/) {
  return GraphicsProcesses(__func__, device, info_count);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int* info_count,
                                                               nvmlProcessInfo_v1_t* /*infos*/) {
  return GraphicsProcesses(__func__, device, info_count);
}

// ---- clocks, temperature, power ----------------------------------------------------------------------

namespace {

bool ClockOf(nvmlClockType_t type, figures::Clock& clock) {
  switch (type) {
    case NVML_CLOCK_GRAPHICS:
      clock = figures::Clock::graphics;
      return true;
    case NVML_CLOCK_SM:
      clock = figures::Clock::sm;
      return true;
    case NVML_CLOCK_MEM:
      clock = figures::Clock::memory;
      return true;
    case NVML_CLOCK_VIDEO:
      clock = figures::Clock::video;
      return true;
    case NVML_CLOCK_COUNT:
      break;
  }
  return false;
}

nvmlReturn_t ClockInfo(const char* function, nvmlDevice_t device, nvmlClockType_t type, unsigned int* mhz, bool max) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  figures::Clock clock{};
  if (mhz == nullptr || !ClockOf(type, clock)) return NVML_ERROR_INVALID_ARGUMENT;
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  if (max) {
    *mhz = figures::ClockMhz(spec, clock, /*busy=*/true, /*max=*/true);
    return NVML_SUCCESS;
  }
  LiveDevice live(*attachment, index);
  *mhz = figures::ClockMhz(spec, clock, live.utilization_percent() > 0, /*max=*/false);
  return NVML_SUCCESS;
}

nvmlReturn_t ReadTemperature(state::Attachment& attachment, std::uint32_t index, nvmlTemperatureSensors_t sensor,
                             unsigned int& celsius) {
  if (sensor != NVML_TEMPERATURE_GPU && sensor != kTemperatureGpuMax) return NVML_ERROR_INVALID_ARGUMENT;
  LiveDevice live(attachment, index);
  const double smoothed = figures::SmoothedUtilizationPercent(live.machine(), index, live.now_ns());
  celsius = figures::TemperatureCelsius(smoothed, sensor == kTemperatureGpuMax);
  return NVML_SUCCESS;
}

// The limits never change: nothing here implements nvmlDeviceSetPowerManagementLimit.
nvmlReturn_t PowerLimit(const char* function, nvmlDevice_t device, unsigned int* milliwatts) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(function, device, attachment, index); r != NVML_SUCCESS) return r;
  if (milliwatts == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *milliwatts = SpecOf(*attachment, index).power_limit_mw;
  return NVML_SUCCESS;
}

}  // namespace

NVML_EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int* clock) {
  return ClockInfo(__func__, device, type, clock, /*max=*/false);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int* clock) {
  return ClockInfo(__func__, device, type, clock, /*max=*/true);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensor_type,
                                                  unsigned int* temp) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (temp == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  return ReadTemperature(*attachment, index, sensor_type, *temp);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t* temperature) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (temperature == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (temperature->version != nvmlTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  unsigned int celsius = 0;
  const nvmlReturn_t r = ReadTemperature(*attachment, index, temperature->sensorType, celsius);
  if (r == NVML_SUCCESS) temperature->temperature = static_cast<int>(celsius);
  return r;
}

// Boards without a fan of their own (SXM modules, the passively cooled T4) answer NOT_SUPPORTED.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int* speed) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (speed == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

// A data-centre board in persistence mode stays in P0.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, nvmlPstates_t* performance_state) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (performance_state == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *performance_state = NVML_PSTATE_0;
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int* power) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (power == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  LiveDevice live(*attachment, index);
  *power = figures::PowerMilliwatts(SpecOf(*attachment, index), live.utilization_percent());
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int* limit) {
  return PowerLimit(__func__, device, limit);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int* default_limit) {
  return PowerLimit(__func__, device, default_limit);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int* limit) {
  return PowerLimit(__func__, device, limit);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int* min_limit,
                                                                      unsigned int* max_limit) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (min_limit == nullptr || max_limit == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  const model::DeviceSpec& spec = SpecOf(*attachment, index);
  *min_limit = figures::MinPowerLimitMilliwatts(spec);
  *max_limit = spec.power_limit_mw;
  return NVML_SUCCESS;
}
