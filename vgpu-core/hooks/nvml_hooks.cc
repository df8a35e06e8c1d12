// NVML's view of the slice: nvmlDeviceGetMemoryInfo and _v2 agree with cuMemGetInfo (total = the limit, used =
// the container's usage); a process whose configuration is invalid sees no NVML either (fail closed).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "shim.h"
#include "driver_memory.h"
#include "vgpu/base/uuid.h"

namespace vgpu::hooks {
namespace {

// The CUDA ordinal of an NVML device, by UUID (NVML numbers devices on the host; CUDA after
// CUDA_VISIBLE_DEVICES), or -1 if this process's CUDA does not see it.
// Without CUDA initialized in this process (an NVML-only tool, or a parent about to fork workers, must not have
// CUDA started behind its back), the ordinal comes from CUDA_VISIBLE_DEVICES, read once: the position of the
// entry naming this device by index or UUID prefix; unset means the NVML index.
// The ordinal of an NVML device: >= 0; kNotVisible when this process's CUDA does not see the device (its own view is
// then shown); kUnknown when it could not be told (NVML or the driver failed, or answered what cannot be true): the
// view is then refused with `error` rather than shown whole.
constexpr int kNotVisible = -1;
constexpr int kUnknown = -2;

int OrdinalFromVisibleDevices(nvmlDevice_t device, const char* uuid, nvmlReturn_t& error) {
  static const std::string visible = [] {
    const char* value = std::getenv("CUDA_VISIBLE_DEVICES");
    return value == nullptr ? std::string("\x01unset") : std::string(value);
  }();
  unsigned int index = 0;
  if (Real::nvmlDeviceGetIndex == nullptr) return kNotVisible;
  error = Real::nvmlDeviceGetIndex(device, &index);
  if (error != NVML_SUCCESS) return kUnknown;
  if (index >= static_cast<unsigned int>(policy::kMaxDevices)) {
    error = NVML_ERROR_UNKNOWN;  // no machine has that many devices: not an index
    return kUnknown;
  }
  if (visible == "\x01unset") return static_cast<int>(index);
  int position = 0;
  std::size_t start = 0;
  while (start <= visible.size()) {
    const std::size_t comma = visible.find(',', start);
    std::string entry = visible.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    entry.erase(0, entry.find_first_not_of(' '));
    entry.erase(entry.find_last_not_of(' ') + 1);
    if (!entry.empty() && entry == std::to_string(index)) return position;
    if (entry.size() > 4 && strncasecmp(entry.c_str(), uuid, entry.size()) == 0) return position;
    if (comma == std::string::npos) break;
    start = comma + 1;
    ++position;
  }
  return -1;
}

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (NVML's spelling of cuDeviceGetUuid's bytes) to the 16 bytes.
bool UuidFromText(const char* text, std::uint8_t out[16]) {
  if (strncasecmp(text, "GPU-", 4) != 0) return false;
  int have = 0;
  int high = -1;
  for (const char* c = text + 4; *c != '\0' && have < 16; ++c) {
    if (*c == '-') continue;
    int value = -1;
    if (*c >= '0' && *c <= '9')
      value = *c - '0';
    else if (*c >= 'a' && *c <= 'f')
      value = *c - 'a' + 10;
    else if (*c >= 'A' && *c <= 'F')
      value = *c - 'A' + 10;
    if (value < 0) return false;
    if (high < 0) {
      high = value;
    } else {
      out[have++] = static_cast<std::uint8_t>(high * 16 + value);
      high = -1;
    }
  }
  return have == 16;
}

// The device's UUID from NVML, checked: "GPU-" and 32 hex digits, NUL-terminated inside the buffer.
nvmlReturn_t UuidOf(nvmlDevice_t device, char (&text)[NVML_DEVICE_UUID_V2_BUFFER_SIZE], std::uint8_t bytes[16]) {
  std::memset(text, 0, sizeof text);
  if (Real::nvmlDeviceGetUUID == nullptr) return NVML_ERROR_FUNCTION_NOT_FOUND;
  // One byte short of the buffer: an answer that fills it unterminated still ends in a NUL.
  const nvmlReturn_t result = Real::nvmlDeviceGetUUID(device, text, sizeof text - 1);
  if (result != NVML_SUCCESS) return result;
  return UuidFromText(text, bytes) ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

int OrdinalOf(nvmlDevice_t device, nvmlReturn_t& error) {
  error = NVML_SUCCESS;
  char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
  std::uint8_t nvml_uuid[16];
  if (Real::nvmlDeviceGetUUID == nullptr) return kNotVisible;
  error = UuidOf(device, text, nvml_uuid);
  if (error != NVML_SUCCESS) return kUnknown;
  if (!ResolveReal() || Real::cuDeviceGetCount == nullptr) return kNotVisible;
  int count = 0;
  const CUresult counted = Real::cuDeviceGetCount(&count);
  if (counted == CUDA_ERROR_NOT_INITIALIZED) return OrdinalFromVisibleDevices(device, text, error);
  if (counted != CUDA_SUCCESS) {
    error = NVML_ERROR_UNKNOWN;
    return kUnknown;
  }
  for (int ordinal = 0; ordinal < std::min(count, policy::kMaxDevices); ++ordinal) {
    CUdevice cu_device = 0;
    CUuuid uuid{};
    if (Real::cuDeviceGet(&cu_device, ordinal) != CUDA_SUCCESS ||
        Real::cuDeviceGetUuid_v2(&uuid, cu_device) != CUDA_SUCCESS) {
      error = NVML_ERROR_UNKNOWN;  // this one might be it
      return kUnknown;
    }
    char mine[base::kGpuUuidChars + 1];
    base::FormatGpuUuid(uuid.bytes, mine);
    if (strcasecmp(mine, text) == 0) return ordinal;
  }
  return kNotVisible;
}

// total = min(limit, physical), used = the container's usage, free = total - used (never below zero). Returns
// NVML_SUCCESS with `sliced` false where no limit applies (the driver's view stands), or the error that kept the
// device from being told (the caller refuses the view rather than show the whole GPU).
nvmlReturn_t SliceView(nvmlDevice_t device, unsigned long long physical_total, unsigned long long physical_free,
                       unsigned long long& total, unsigned long long& used, unsigned long long& free_bytes,
                       bool& sliced) {
  sliced = false;
  const MemoryOperation operation;  // it reconciles pools: a change of the shim's charges (driver_memory.cc)
  nvmlReturn_t error = NVML_SUCCESS;
  const int ordinal = OrdinalOf(device, error);
  if (ordinal == kUnknown) return error != NVML_SUCCESS ? error : NVML_ERROR_UNKNOWN;
  const std::uint64_t limit = MemoryLimit(ordinal);
  if (ordinal < 0 || limit == 0) return NVML_SUCCESS;
  ReconcilePools();
  int region_device = RegionDevice(ordinal);
  const bool cuda_started = region_device >= 0;  // then this process may hold memory of its own there
  if (region_device < 0) {
    // CUDA not started in this process (nvidia-smi, a monitoring agent): name the device by NVML's UUID.
    std::uint8_t uuid[16];
    char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    if (UuidOf(device, text, uuid) == NVML_SUCCESS) region_device = RegionDeviceOfUuid(ordinal, uuid);
  }
  RefreshView(cuda_started ? ordinal : -1);
  total = std::min<unsigned long long>(limit, physical_total);
  // Used as cuMemGetInfo shows it: what the container holds, and the headroom kept for the driver's own memory.
  used = total - FreeOfSlice(total, std::min<unsigned long long>(UsedOnRegionDevice(region_device), total));
  free_bytes = std::min(total - used, physical_free);  // never more than the device really has free
  sliced = true;
  return NVML_SUCCESS;
}

nvmlReturn_t InitCommon() {
  if (CurrentMode() == Mode::failed) return kFailedClosedNvml;
  ResolveRealNvml();
  return NVML_SUCCESS;
}

}  // namespace
}  // namespace vgpu::hooks

using namespace vgpu::hooks;

extern "C" VGPU_EXPORT nvmlReturn_t nvmlInit_v2() try {
  if (const nvmlReturn_t r = InitCommon(); r != NVML_SUCCESS) return r;
  return Real::nvmlInit_v2 != nullptr ? Real::nvmlInit_v2() : NVML_ERROR_LIBRARY_NOT_FOUND;
}
VGPU_NVML_CATCH

extern "C" VGPU_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) try {
  if (const nvmlReturn_t r = InitCommon(); r != NVML_SUCCESS) return r;
  return Real::nvmlInitWithFlags != nullptr ? Real::nvmlInitWithFlags(flags) : NVML_ERROR_LIBRARY_NOT_FOUND;
}
VGPU_NVML_CATCH

namespace {

// nvmlDeviceGetMemoryInfo and its _v2, one body: the real call's figures, then the slice's in a limited container.
// On a failed slice nothing of the whole device's figures is left behind (a _v2's version is kept).
// `real` is Real::'s pointer itself (a reference), read after ResolveRealNvml() has set it.
template <typename Memory, typename RealPointer>
nvmlReturn_t MemoryInfo(const RealPointer& real, nvmlDevice_t device, Memory* memory) {
  if (!ResolveRealNvml() || real == nullptr) return NVML_ERROR_FUNCTION_NOT_FOUND;
  const Mode mode = CurrentMode();
  if (mode == Mode::failed) return kFailedClosedNvml;
  const nvmlReturn_t result = real(device, memory);
  if (result != NVML_SUCCESS || mode != Mode::limited) return result;
  unsigned long long total = 0, used = 0, free_bytes = 0;
  bool sliced = false;
  if (const nvmlReturn_t r = SliceView(device, memory->total, memory->free, total, used, free_bytes, sliced);
      r != NVML_SUCCESS) {
    Memory empty{};
    if constexpr (std::is_same_v<Memory, nvmlMemory_v2_t>) empty.version = memory->version;
    *memory = empty;
    return r;
  }
  if (sliced) {
    memory->total = total;
    if constexpr (std::is_same_v<Memory, nvmlMemory_v2_t>) {
      memory->reserved = 0;  // the slice has no driver reserve: total = used + free, as cuMemGetInfo shows it
    }
    memory->used = used;
    memory->free = free_bytes;
  }
  return result;
}

}  // namespace

extern "C" VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) try {
  return MemoryInfo(Real::nvmlDeviceGetMemoryInfo, device, memory);
}
VGPU_NVML_CATCH

extern "C" VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) try {
  return MemoryInfo(Real::nvmlDeviceGetMemoryInfo_v2, device, memory);
}
VGPU_NVML_CATCH
