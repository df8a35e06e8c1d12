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
#include "fakecuda/state/faults.h"
#include "fakecuda/state/state.h"
#include "figures.h"

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
#define FAKECUDA_NVML_RETURN_CODES(X)                                                                        \
  X(NVML_SUCCESS, "Success")                                                                                 \
  X(NVML_ERROR_UNINITIALIZED, "Uninitialized")                                                               \
  X(NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument")                                                         \
  X(NVML_ERROR_NOT_SUPPORTED, "Not Supported")                                                               \
  X(NVML_ERROR_NO_PERMISSION, "Insufficient Permissions")                                                    \
  X(NVML_ERROR_ALREADY_INITIALIZED, "Already Initialized")                                                   \
  X(NVML_ERROR_NOT_FOUND, "Not Found")                                                                       \
  X(NVML_ERROR_INSUFFICIENT_SIZE, "Insufficient Size")                                                       \
  X(NVML_ERROR_INSUFFICIENT_POWER, "Insufficient External Power")                                            \
  X(NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")                                                       \
  X(NVML_ERROR_TIMEOUT, "Timeout")                                                                           \
  X(NVML_ERROR_IRQ_ISSUE, "Interrupt Request Issue")                                                         \
  X(NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found")                                           \
  X(NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found")                                                     \
  X(NVML_ERROR_CORRUPTED_INFOROM, "Corrupted infoROM")                                                       \
  X(NVML_ERROR_GPU_IS_LOST, "GPU is lost")                                                                   \
  X(NVML_ERROR_RESET_REQUIRED, "GPU requires restart")                                                       \
  X(NVML_ERROR_OPERATING_SYSTEM, "The operating system has blocked the request.")                            \
  X(NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch.")                      \
  X(NVML_ERROR_IN_USE, "In use by another client")                                                           \
  X(NVML_ERROR_MEMORY, "Insufficient Memory")                                                                \
  X(NVML_ERROR_NO_DATA, "No data")                                                                           \
  X(NVML_ERROR_VGPU_ECC_NOT_SUPPORTED,                                                                       \
    "The requested vgpu operation is not available on target device, becasue ECC is enabled")               \
  X(NVML_ERROR_INSUFFICIENT_RESOURCES, "Ran out of critical resources, other than memory")                   \
  X(NVML_ERROR_FREQ_NOT_SUPPORTED, "The requested frequency is not supported")                               \
  X(NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "The provided version is invalid/unsupported")                     \
  X(NVML_ERROR_DEPRECATED, "The requested functionality has been deprecated")                                \
  X(NVML_ERROR_NOT_READY, "The system is not ready for the request")                                         \
  X(NVML_ERROR_GPU_NOT_FOUND, "The GPU was not found")                                                       \
  X(NVML_ERROR_INVALID_STATE, "The requested operation is in invalid state")                                 \
  X(NVML_ERROR_RESET_TYPE_NOT_SUPPORTED, "Reset not supported for given device/parameters")                  \
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

// Whether this library exports `symbol`: asks the dynamic linker, so that nvml.map stays the one list.
bool ExportsSymbol(std::string_view symbol) {
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&ErrorCodeOf), &self) == 0 || self.dli_fname == nullptr) return true;
  void* library = dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (library == nullptr) return true;  // cannot tell: let the rule stand rather than refuse a valid one
  const std::string name(symbol);
  void* address = dlsym(library, name.c_str());
  Dl_info found{};
  const bool ours = address != nullptr && dladdr(address, &found) != 0 && found.dli_fbase == self.dli_fbase;
  dlclose(library);
  return ours;
}

constexpr fakecuda::faults::Library kLibrary = {"libnvidia-ml.so.1", "nvml", "NVML_ERROR_", ErrorCodeOf,
                                                ExportsSymbol};

// FAKECUDA_FAULTS: the first thing every exported function does, so that an injected error has no effect.
nvmlReturn_t InjectedFault(const char* function) {
  return static_cast<nvmlReturn_t>(fakecuda::faults::Check(function, kLibrary));
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
      state::LogError("%s: flags %#x include unknown bits %#x; accepted: NVML_INIT_FLAG_NO_GPUS (1), "
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
nvmlReturn_t ComputeProcesses(const char* function, nvmlDevice_t device, unsigned int* count, Info* infos) {
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

nvmlReturn_t HandleByIndex(const char* function, unsigned int index, nvmlDevice_t* device) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(function, attachment); r != NVML_SUCCESS) return r;
  if (device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (index >= DeviceCount(*attachment)) {
    if (state::LogLevel() >= 2) {
      state::LogError("%s: index %u is out of range: this machine has %u device(s) (FAKECUDA_DEVICES)", function,
                      index, DeviceCount(*attachment));
    }
    return NVML_ERROR_INVALID_ARGUMENT;
  }
  *device = &g_devices[index];
  return NVML_SUCCESS;
}

nvmlReturn_t HandleByPciBusId(const char* function, const char* bus_id, nvmlDevice_t* device) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(function, attachment); r != NVML_SUCCESS) return r;
  if (bus_id == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  figures::PciAddress wanted;
  if (!figures::ParseBusId(bus_id, wanted)) {
    if (state::LogLevel() >= 2) {
      state::LogError("%s: '%.64s' is not a PCI bus id; accepted (hex): domain:bus:device.function, "
                      "domain:bus:device, bus:device.function", function, bus_id);
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

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* device_count) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  if (device_count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *device_count = DeviceCount(*attachment);
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int* device_count) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  if (device_count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *device_count = DeviceCount(*attachment);
  return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  return HandleByIndex(__func__, index, device);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t* device) {
  return HandleByIndex(__func__, index, device);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device) {
  state::Attachment* attachment = nullptr;
  if (const nvmlReturn_t r = Enter(__func__, attachment); r != NVML_SUCCESS) return r;
  if (uuid == nullptr || device == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (std::uint32_t index = 0; index < DeviceCount(*attachment); ++index) {
    if (strcasecmp(uuid, figures::UuidString(SpecOf(*attachment, index)).c_str()) == 0) {
      *device = &g_devices[index];
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
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

NVML_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  return CopyString(figures::UuidString(SpecOf(*attachment, index)), uuid, length);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char* serial, unsigned int length) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  return CopyString(figures::SerialString(SpecOf(*attachment, index)), serial, length);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int* index_out) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (index_out == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  *index_out = index;
  return NVML_SUCCESS;
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

// v1: used = reserved + every process's allocations and contexts; free = total - used.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
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

// v2: reserved on its own, used = allocations and contexts only; free is the same as v1's.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (memory == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (memory->version != nvmlMemory_v2) {
    if (state::LogLevel() >= 2) {
      state::LogError("%s: memory->version is %#x; accepted: nvmlMemory_v2 (%#x)", __func__, memory->version,
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

// ---- utilization -------------------------------------------------------------------------------------

NVML_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t* utilization) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
  if (utilization == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  LiveDevice live(*attachment, index);
  utilization->gpu = live.utilization_percent();
  utilization->memory = 0;  // the model has no memory traffic
  return NVML_SUCCESS;
}

// The device's utilization samples (NVML_GPU_UTILIZATION_SAMPLES only): one per closed window, percent busy over
// the window that ends at its timestamp (CPU time, microseconds), visible once published, oldest first. The other
// sampling types are not modelled.
NVML_EXPORT nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t device, nvmlSamplingType_t type,
                                              unsigned long long last_seen_timestamp, nvmlValueType_t* value_type,
                                              unsigned int* sample_count, nvmlSample_t* samples) {
  state::Attachment* attachment = nullptr;
  std::uint32_t index = 0;
  if (const nvmlReturn_t r = EnterDevice(__func__, device, attachment, index); r != NVML_SUCCESS) return r;
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
    case NVML_CLOCK_GRAPHICS: clock = figures::Clock::graphics; return true;
    case NVML_CLOCK_SM: clock = figures::Clock::sm; return true;
    case NVML_CLOCK_MEM: clock = figures::Clock::memory; return true;
    case NVML_CLOCK_VIDEO: clock = figures::Clock::video; return true;
    case NVML_CLOCK_COUNT: break;
  }
  return false;
}

nvmlReturn_t ClockInfo(const char* function, nvmlDevice_t device, nvmlClockType_t type, unsigned int* mhz,
                       bool max) {
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
