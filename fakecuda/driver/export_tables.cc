// The driver's export tables (docs/fakecuda-runtime.md): the private interfaces the CUDA runtime (libcudart) asks
// cuGetExportTable for before it runs anything, and fakecuda's own private table. Each table is a static array of
// pointer-sized words, its first word its size in bytes (the context-local storage table has no size word and ends
// with a null one), at the same address for the life of the process (the integrity check hashes the addresses).
#include <cuda.h>
#include <pthread.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "integrity.h"
#include "internal.h"

namespace fakecuda::driver {
namespace {

using Word = const void*;

Word Size(std::size_t words) { return reinterpret_cast<Word>(words * sizeof(Word)); }

template <typename Function>
Word Entry(Function* function) {
  return reinterpret_cast<Word>(function);
}

// ---- 6bd5fb6c: the runtime's interface ---------------------------------------------------------------------------

// The device's primary context, neither retained nor made current: the handle cuDevicePrimaryCtxRetain gives later.
CUresult RuntimePrimaryContext(CUcontext* context, CUdevice device) {
  FAKECUDA_ENTER("cuGetExportTable");
  if (context == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return PrimaryContextHandle(device, *context);
}

// Modules from a fatbin by the runtime's own routes (not its usual one, which is cuLibraryLoadData).
CUresult RuntimeModuleFromFatbin(CUmodule* module, const void* wrapper) {
  FAKECUDA_ENTER("cuGetExportTable");
  return cuModuleLoadFatBinary(module, wrapper);
}
CUresult RuntimeModuleFromFatbinExt1(CUmodule* module, const void* wrapper, const void* a, const void* b,
                                     std::uint32_t n) {
  if (a != nullptr || b != nullptr || n != 0) return CUDA_ERROR_NOT_SUPPORTED;
  return RuntimeModuleFromFatbin(module, wrapper);
}
CUresult RuntimeModuleFromFatbinExt2(const void* header, CUmodule* module, const void* a, const void* b,
                                     std::uint32_t n) {
  if (a != nullptr || b != nullptr || n != 0) return CUDA_ERROR_NOT_SUPPORTED;
  return RuntimeModuleFromFatbin(module, header);
}
void RuntimeIgnoreSize(std::size_t) {}
CUresult RuntimeLoadCompilers() { return CUDA_SUCCESS; }  // the real driver loads its PTX compilers here

constexpr std::size_t kRuntimeWords = 13;
const Word kRuntimeTable[kRuntimeWords] = {
    Size(kRuntimeWords),
    Entry(&RuntimeModuleFromFatbin),
    Entry(&RuntimePrimaryContext),
    nullptr,
    nullptr,
    nullptr,
    Entry(&RuntimeModuleFromFatbinExt1),
    Entry(&RuntimeIgnoreSize),
    Entry(&RuntimeModuleFromFatbinExt2),
    nullptr,
    nullptr,
    nullptr,
    Entry(&RuntimeLoadCompilers),
};

// ---- a094798c: tools' callback hooks: no tool subscribed -----------------------------------------------------------

alignas(16) std::uint32_t g_hooks_buffer1[2048];  // zeroed: no callback is on
alignas(16) std::uint32_t g_hooks_buffer2[16];
void HooksEvent(std::uint32_t, void*) {}
void HooksBuffer1(void** buffer, std::size_t* size) {
  if (buffer != nullptr) *buffer = g_hooks_buffer1;
  if (size != nullptr) *size = 1024;
}
void HooksSpan(void*, void*) {}
void HooksBuffer2(void** buffer, std::size_t* size) {
  if (buffer != nullptr) *buffer = g_hooks_buffer2;
  if (size != nullptr) *size = 14;
}

constexpr std::size_t kHooksWords = 7;
const Word kHooksTable[kHooksWords] = {
    Size(kHooksWords), Entry(&HooksEvent),  Entry(&HooksBuffer1), nullptr, Entry(&HooksSpan),
    nullptr,           Entry(&HooksBuffer2)};

// ---- 42d85a81: tools' thread-local storage ------------------------------------------------------------------------

// Entry 2, which cuBLASLt calls while it picks a matmul: the calling thread's current context.
CUresult ToolsTlsCurrentContext(CUcontext* context) {
  if (context == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return cuCtxGetCurrent(context);
}
CUresult ToolsTlsNothing() { return CUDA_SUCCESS; }  // entries 1 and 3: not seen called

constexpr std::size_t kToolsTlsWords = 4;
const Word kToolsTlsTable[kToolsTlsWords] = {Size(kToolsTlsWords), Entry(&ToolsTlsNothing),
                                             Entry(&ToolsTlsCurrentContext), Entry(&ToolsTlsNothing)};

// ---- c693336e: context-local storage ------------------------------------------------------------------------------

using StorageDestructor = void (*)(CUcontext, void*, void*);
struct Stored {
  void* value = nullptr;
  StorageDestructor destructor = nullptr;
};

struct ContextStorage {
  std::mutex mutex;  // taken with nothing else held
  std::map<std::pair<CUcontext, void*>, Stored> entries;
};
ContextStorage& Storage() {
  static ContextStorage* storage = new ContextStorage();  // never destroyed: used from atexit handlers
  return *storage;
}

// A null context is the calling thread's current one.
CUresult StorageContext(CUcontext& context) {
  if (context != nullptr) return CUDA_SUCCESS;
  return cuCtxGetCurrent(&context) == CUDA_SUCCESS && context != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult StoragePut(CUcontext context, void* key, void* value, StorageDestructor destructor) {
  FAKECUDA_ENTER("cuGetExportTable");
  if (const CUresult r = StorageContext(context); r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> guard(Storage().mutex);
  Storage().entries[{context, key}] = Stored{value, destructor};
  return CUDA_SUCCESS;
}

CUresult StorageDelete(CUcontext context, void* key) {
  FAKECUDA_ENTER("cuGetExportTable");
  if (const CUresult r = StorageContext(context); r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> guard(Storage().mutex);
  return Storage().entries.erase({context, key}) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// Not found is an error: the runtime then makes its per-context state and puts it.
CUresult StorageGet(void** value, CUcontext context, void* key) {
  FAKECUDA_ENTER("cuGetExportTable");
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (const CUresult r = StorageContext(context); r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> guard(Storage().mutex);
  const auto it = Storage().entries.find({context, key});
  if (it == Storage().entries.end()) return CUDA_ERROR_INVALID_HANDLE;
  *value = it->second.value;
  return CUDA_SUCCESS;
}

const Word kStorageTable[] = {Entry(&StoragePut), Entry(&StorageDelete), Entry(&StorageGet), nullptr};

// ---- 263e8860: context checks ---------------------------------------------------------------------------------------

CUresult ContextCheck(CUcontext, std::uint32_t* wrapped, const void** inner) {
  if (wrapped != nullptr) *wrapped = 0;  // no context wraps another here
  if (inner != nullptr) *inner = nullptr;
  return CUDA_SUCCESS;
}
std::uint32_t ContextCheckFlags() { return 0; }

constexpr std::size_t kContextChecksWords = 4;
const Word kContextChecksTable[kContextChecksWords] = {Size(kContextChecksWords), nullptr, Entry(&ContextCheck),
                                                       Entry(&ContextCheckFlags)};

// ---- d4082055: the integrity check ------------------------------------------------------------------------------

CUresult IntegrityCheck(std::uint32_t version, std::uint64_t unix_seconds, std::uint64_t* result);

constexpr std::size_t kIntegrityWords = 3;
const Word kIntegrityTable[kIntegrityWords] = {Size(kIntegrityWords), Entry(&IntegrityCheck), nullptr};

// The answer the runtime recomputes from its own view: this driver's version, this thread, the two tables' addresses
// as handed out, and every visible device as cuDeviceGetUuid and cuDeviceGetAttribute describe it.
CUresult IntegrityCheck(std::uint32_t version, std::uint64_t unix_seconds, std::uint64_t* result) {
  FAKECUDA_ENTER("cuGetExportTable");
  if (result == nullptr) return CUDA_ERROR_INVALID_VALUE;
  integrity::Inputs in;
  int driver_version = 0;
  cuDriverGetVersion(&driver_version);
  in.driver_version = static_cast<std::uint32_t>(driver_version);
  in.version = version;
  in.pid = static_cast<std::uint32_t>(getpid());
  in.thread = static_cast<std::uint32_t>(pthread_self());
  in.runtime_table = reinterpret_cast<std::uintptr_t>(kRuntimeTable);
  in.integrity_table = reinterpret_cast<std::uintptr_t>(kIntegrityTable);
  in.integrity_function = reinterpret_cast<std::uintptr_t>(kIntegrityTable[1]);
  in.unix_seconds = unix_seconds;
  int count = 0;
  cuDeviceGetCount(&count);
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    integrity::Device device;
    CUuuid uuid{};
    cuDeviceGetUuid_v2(&uuid, ordinal);
    std::memcpy(device.uuid.data(), uuid.bytes, device.uuid.size());
    cuDeviceGetAttribute(&device.pci_domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, ordinal);
    cuDeviceGetAttribute(&device.pci_bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, ordinal);
    cuDeviceGetAttribute(&device.pci_device, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, ordinal);
    in.devices.push_back(device);
  }
  const integrity::Digest answer = integrity::Answer(in);
  std::memcpy(result, answer.data(), answer.size());
  return CUDA_SUCCESS;
}

// ---- 21318c60: cuBLASLt's table (context identity and more) ---------------------------------------------------------

// Entry 4: the context's unique id (as cuCtxGetId). Every other entry is unknown: it logs its index under
// FAKECUDA_LOG_CALLS and succeeds without writing anything.
CUresult ContextIdentity(CUcontext context, unsigned long long* id) {
  if (id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return cuCtxGetId(context, id);
}

template <std::size_t Index>
CUresult UnknownEntry() {
  if (LoggingCalls()) std::fprintf(stderr, "fakecuda: export table 21318c60 entry %zu (not modelled)\n", Index);
  return CUDA_SUCCESS;
}

constexpr std::size_t kLtWords = 95;
template <std::size_t... Index>
constexpr std::array<Word, kLtWords> MakeLtTable(std::index_sequence<Index...>) {
  return {(Index == 0 ? Size(kLtWords) : Index == 4 ? Entry(&ContextIdentity) : Entry(&UnknownEntry<Index>))...};
}
const std::array<Word, kLtWords> kLtTable = MakeLtTable(std::make_index_sequence<kLtWords>{});

// ---- the tables by id --------------------------------------------------------------------------------------------

struct Table {
  std::uint8_t id[16];
  const Word* words;
};

const Table kTables[] = {
    {{0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9}, kRuntimeTable},
    {{0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66}, kHooksTable},
    {{0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc}, kToolsTlsTable},
    {{0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93}, kStorageTable},
    {{0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e},
     kContextChecksTable},
    {{0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2}, kIntegrityTable},
    {{0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2}, kLtTable.data()},
};

}  // namespace

const void* RuntimeExportTable(const CUuuid& id) {
  for (const Table& table : kTables) {
    if (std::memcmp(table.id, id.bytes, sizeof table.id) == 0) return table.words;
  }
  return nullptr;
}

void ForgetContextStorage(CUcontext context) {
  std::lock_guard<std::mutex> guard(Storage().mutex);
  auto& entries = Storage().entries;
  entries.erase(entries.lower_bound({context, nullptr}), entries.upper_bound({context, reinterpret_cast<void*>(-1)}));
}

}  // namespace fakecuda::driver
