// Memory caps: every allocation API reserves in the container region before the driver is called and gives the
// reservation back if the driver fails; frees are matched; contexts are charged their overhead; the views
// (cuMemGetInfo, cuDeviceTotalMem) show the slice.
#include <algorithm>
#include <iterator>
#include <type_traits>
#include <vector>

#include "shim.h"
#include "driver_memory.h"
#include "vgpu/base/uuid.h"

namespace vgpu::hooks {
namespace {

// Until measured on this device (from NVML's view of this process): above what an H100 context costs
// (518-527 MiB measured), so an unmeasured context is never under-counted.
constexpr std::uint64_t kDefaultContextBytes = 600ull << 20;
constexpr std::uint64_t kChargeGranularity = 512;  // what the driver rounds small allocations to

std::uint64_t Rounded(std::uint64_t bytes) {
  return (bytes + kChargeGranularity - 1) / kChargeGranularity * kChargeGranularity;
}

CUcontext CurrentContext() {
  CUcontext context = nullptr;
  if (Real::cuCtxGetCurrent != nullptr) Real::cuCtxGetCurrent(&context);
  return context;
}

std::uint64_t ContextBytes(int ordinal) {
  Shim& shim = TheShim();
  const int device = RegionDevice(ordinal);
  const std::uint64_t measured = device >= 0 ? shim.region->ContextBytes(device) : 0;
  return measured != 0 ? measured : kDefaultContextBytes;
}

// Charges `bytes`, calls the driver, and keeps the charge only if the driver succeeded.
template <typename Call>
CUresult ChargedCall(int ordinal, std::uint64_t bytes, Call&& call) {
  if (!Charge(ordinal, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  const CUresult result = call();
  if (result != CUDA_SUCCESS) Uncharge(ordinal, bytes);
  return result;
}

// A context of this process on `ordinal` is gone: the driver's own memory for it went too. With no context left there,
// none is charged; otherwise NVML says what is left.
void SettleDriverMemoryAfterContextGone(int ordinal) {
  Shim& shim = TheShim();
  bool any_left = false;
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    any_left = ordinal >= 0 && ordinal < policy::kMaxDevices && shim.primary_bytes[ordinal] != 0;
    for (const auto& entry : shim.contexts) any_left = any_left || entry.second.ordinal == ordinal;
  }
  if (any_left) {
    ReconcileDriverMemory(ordinal);
  } else {
    ForgetDriverGrowth(ordinal);
  }
}

// Drops everything the ledger holds for a context the driver has destroyed (its memory went with it).
void ForgetContext(CUcontext context) {
  Shim& shim = TheShim();
  std::uint64_t released[policy::kMaxDevices] = {};  // per ordinal; nothing allocated (this runs out of memory too)
  const auto release = [&](int ordinal, std::uint64_t bytes) {
    if (ordinal >= 0 && ordinal < policy::kMaxDevices) released[ordinal] += bytes;
  };
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    for (auto it = shim.allocations.begin(); it != shim.allocations.end();) {
      if (it->second.context == context) {
        release(it->second.ordinal, it->second.bytes);
        it = shim.allocations.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = shim.arrays.begin(); it != shim.arrays.end();) {
      if (it->second.context == context) {
        release(it->second.ordinal, it->second.bytes);
        it = shim.arrays.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = shim.pools.begin(); it != shim.pools.end();) {
      if (it->second.context == context) {
        release(it->second.ordinal, it->second.charged);
        it = shim.pools.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (int ordinal = 0; ordinal < policy::kMaxDevices; ++ordinal) Uncharge(ordinal, released[ordinal]);
}

// Remembers an allocation the driver made; false if the host is out of memory (then nothing is remembered).
bool RecordAllocation(CUdeviceptr pointer, const Shim::Allocation& allocation) {
  Shim& shim = TheShim();
  std::lock_guard<std::mutex> guard(shim.mutex);
  return Recorded([&] { shim.allocations[pointer] = allocation; });
}

// An allocation the driver made that the shim could not remember (out of host memory): freed again, so that the
// caller's error means nothing happened; memory left unrecorded would stay charged, or be freed uncounted.
CUresult UndoAllocation(CUdeviceptr* pointer, int ordinal, std::uint64_t charged) {
  if (Real::cuMemFree_v2 != nullptr) Real::cuMemFree_v2(*pointer);
  Uncharge(ordinal, charged);
  *pointer = 0;
  return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult AllocateTracked(CUdeviceptr* pointer, std::uint64_t charge, const std::function<CUresult()>& call) {
  CUresult unknown = CUDA_SUCCESS;
  const int ordinal = CurrentOrdinal(unknown);
  // No context: the driver says what is wrong. A device that cannot be told: refused, never allocated uncounted.
  if (ordinal < 0) return unknown != CUDA_SUCCESS ? unknown : call();
  const CUresult result = ChargedCall(ordinal, charge, call);
  if (result == CUDA_SUCCESS && pointer != nullptr &&
      !RecordAllocation(*pointer, {ordinal, charge, CurrentContext()})) {
    return UndoAllocation(pointer, ordinal, charge);
  }
  return result;
}

// Measures what the context just created on `ordinal` costs, from the host's view of this process (NVML), and
// records it in the region for the container's other processes. Falls back to the estimate already charged.
void MeasureContext(int ordinal, std::uint64_t charged_estimate, std::uint64_t& charged) {
  charged = charged_estimate;
  Shim& shim = TheShim();
  const int device = RegionDevice(ordinal);
  if (device < 0 || shim.region->ContextBytes(device) != 0) return;
  if (!ResolveRealNvml() || Real::nvmlDeviceGetHandleByUUID == nullptr ||
      Real::nvmlDeviceGetComputeRunningProcesses_v3 == nullptr || Real::nvmlInit_v2 == nullptr) {
    return;
  }
  {
    // NVML reports the process's whole use of the device: the new context is what is left after its allocations only
    // while no other context of this process is on the device (another one, charged at an estimate, would make the
    // "measurement" that estimate's error: an under-count when the estimate is above the real size).
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (shim.primary_bytes[ordinal] != 0) return;
    for (const auto& entry : shim.contexts) {
      if (entry.second.ordinal == ordinal) return;
    }
  }
  CUdevice cu_device = 0;
  CUuuid uuid{};
  if (Real::cuDeviceGet(&cu_device, ordinal) != CUDA_SUCCESS ||
      Real::cuDeviceGetUuid_v2(&uuid, cu_device) != CUDA_SUCCESS) {
    return;
  }
  char text[base::kGpuUuidChars + 1];
  base::FormatGpuUuid(uuid.bytes, text);
  nvmlDevice_t handle = nullptr;
  if (Real::nvmlInit_v2() != NVML_SUCCESS || Real::nvmlDeviceGetHandleByUUID(text, &handle) != NVML_SUCCESS) return;
  // This process's use of the device as NVML reports it, read twice: a value is taken only when both reads agree (a
  // driver answering garbage -- counts past the buffer, absurd sizes -- would otherwise set every future context's
  // charge, too low or absurdly high).
  const auto own_use = [&](std::uint64_t& used) {
    nvmlProcessInfo_t processes[64];
    unsigned int count = 64;
    if (Real::nvmlDeviceGetComputeRunningProcesses_v3(handle, &count, processes) != NVML_SUCCESS || count > 64) {
      return false;  // success with more entries than the buffer holds is not an answer
    }
    int found = 0;
    for (unsigned int i = 0; i < count; ++i) {
      if (static_cast<pid_t>(processes[i].pid) != getpid()) continue;
      used = processes[i].usedGpuMemory;
      ++found;
    }
    return found == 1;
  };
  std::uint64_t first = 0, second = 0;
  if (!own_use(first) || !own_use(second) || first != second) return;
  const std::uint64_t own_allocations = shim.region->OwnUsed(device) - charged_estimate;
  if (first <= own_allocations) return;
  const std::uint64_t measured = first - own_allocations;
  shim.region->SetContextBytes(device, measured);
  // Adjust the charge from the estimate to the measurement (it is this process's own context: it exists).
  if (measured > charged_estimate) {
    if (!shim.region->Reserve(device, measured - charged_estimate, UINT64_MAX)) return;
  } else {
    shim.region->Release(device, charged_estimate - measured);
  }
  charged = measured;
  Log(3, "device %d: a context costs %llu bytes (measured)", ordinal, static_cast<unsigned long long>(measured));
}

CUresult CreateContextCharged(CUcontext* context, CUdevice device, const std::function<CUresult()>& call) {
  const std::uint64_t estimate = ContextBytes(device);
  const CUresult result = ChargedCall(device, estimate, call);
  if (result == CUDA_SUCCESS && context != nullptr) {
    std::uint64_t charged = estimate;
    MeasureContext(device, estimate, charged);
    Shim& shim = TheShim();
    std::unique_lock<std::mutex> guard(shim.mutex);
    if (!Recorded([&] { shim.contexts[*context] = {device, charged}; })) {
      guard.unlock();
      // Out of host memory: destroyed again (see UndoAllocation); cuCtxDestroy also pops it from this thread.
      if (Real::cuCtxDestroy_v2 != nullptr) Real::cuCtxDestroy_v2(*context);
      Uncharge(device, charged);
      *context = nullptr;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    guard.unlock();
    PublishMemoryBreakdown(device);
  }
  return result;
}

CUresult DestroyContext(CUcontext context, CUresult (*real)(CUcontext)) {
  if (real == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (CurrentMode() != Mode::limited) return real(context);
  const MemoryOperation operation;  // its charges change
  // The compute side's events live in the context: forget them before it goes (never used again after).
  ForgetComputeContext(context);
  const CUresult result = real(context);
  if (result != CUDA_SUCCESS) return result;
  ForgetContext(context);
  Shim& shim = TheShim();
  Shim::Context charged{-1, 0};
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (auto it = shim.contexts.find(context); it != shim.contexts.end()) {
      charged = it->second;
      shim.contexts.erase(it);
    }
  }
  if (charged.ordinal >= 0) {
    Uncharge(charged.ordinal, charged.bytes);
    SettleDriverMemoryAfterContextGone(charged.ordinal);
    PublishMemoryBreakdown(charged.ordinal);
  }
  return result;
}

// After a primary context release or reset: if the driver has destroyed it, give its charges back.
void PrimaryMayHaveGone(CUdevice device, CUcontext primary) {
  unsigned int flags = 0;
  int active = 1;
  if (Real::cuDevicePrimaryCtxGetState == nullptr ||
      Real::cuDevicePrimaryCtxGetState(device, &flags, &active) != CUDA_SUCCESS || active != 0) {
    return;
  }
  if (primary != nullptr) {
    ForgetContext(primary);
    ForgetComputeContext(primary);
  }
  Shim& shim = TheShim();
  std::uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (device >= 0 && device < policy::kMaxDevices) {
      std::swap(bytes, shim.primary_bytes[device]);
      shim.primary_context[device] = nullptr;
    }
  }
  Uncharge(device, bytes);
  SettleDriverMemoryAfterContextGone(device);
  PublishMemoryBreakdown(device);
}

CUcontext PrimaryContextOf(CUdevice device) {
  Shim& shim = TheShim();
  std::lock_guard<std::mutex> guard(shim.mutex);
  return device >= 0 && device < policy::kMaxDevices ? shim.primary_context[device] : nullptr;
}

CUresult ReleasePrimary(CUdevice device, CUresult (*real)(CUdevice)) {
  if (real == nullptr) return CUDA_ERROR_NOT_FOUND;
  const Mode mode = CurrentMode();
  if (mode == Mode::failed) return kFailedClosedCuda;
  if (mode != Mode::limited) return real(device);
  const MemoryOperation operation;  // its charges change
  std::lock_guard<std::mutex> serial(TheShim().primary_mutex);
  const CUcontext primary = PrimaryContextOf(device);
  if (primary != nullptr) ForgetComputeContext(primary);  // a reset or last release destroys its events
  const CUresult result = real(device);
  if (result == CUDA_SUCCESS && mode == Mode::limited) PrimaryMayHaveGone(device, primary);
  return result;
}

// The ordinal of a stream's device (of the current context for the built-in streams); -1 as CurrentOrdinal(error).
int OrdinalOfStream(CUstream stream, CUresult& error) {
  error = CUDA_SUCCESS;
  if (stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD ||
      Real::cuStreamGetCtx == nullptr || Real::cuCtxPushCurrent_v2 == nullptr || Real::cuCtxPopCurrent_v2 == nullptr) {
    return CurrentOrdinal(error);
  }
  // A stream of another device's context is charged to that device: its context is asked, not the current one's.
  CUcontext context = nullptr;
  error = Real::cuStreamGetCtx(stream, &context);
  if (error != CUDA_SUCCESS) return -1;
  if (context == nullptr) return CurrentOrdinal(error);
  error = Real::cuCtxPushCurrent_v2(context);
  if (error != CUDA_SUCCESS) return -1;
  const int ordinal = CurrentOrdinal(error);
  CUcontext popped = nullptr;
  // The application's context stack must come back as it was: a failed pop is tried once more.
  if (Real::cuCtxPopCurrent_v2(&popped) != CUDA_SUCCESS) Real::cuCtxPopCurrent_v2(&popped);
  return ordinal;
}

// Stream-ordered allocation: the pool's reserved memory is what the device really holds for it, so the ledger
// follows the pool's RESERVED_MEM_CURRENT, not the sizes asked for (freed blocks stay in the pool).
CUresult AllocateFromPool(CUdeviceptr* pointer, std::size_t bytes, CUmemoryPool pool, CUstream stream,
                          const std::function<CUresult()>& call) {
  CUresult unknown = CUDA_SUCCESS;
  const int ordinal = OrdinalOfStream(stream, unknown);
  if (ordinal < 0) return unknown != CUDA_SUCCESS ? unknown : call();  // no context: the driver says what is wrong
  if (Real::cuMemPoolGetAttribute == nullptr || Real::cuDeviceGetMemPool == nullptr) return call();
  if (pool == nullptr) {
    // The device's current pool: without it the allocation cannot be followed, so it is not made.
    if (const CUresult got = Real::cuDeviceGetMemPool(&pool, ordinal); got != CUDA_SUCCESS) return got;
  }
  Shim& shim = TheShim();
  // Reserve the request up front (a pool may have to grow by it), then settle to the pool's real size. At the
  // limit, a request the pool can serve from memory it already holds (reserved - used) grows nothing and needs
  // no reservation.
  std::uint64_t upfront = Rounded(bytes);
  if (!Charge(ordinal, upfront)) {
    cuuint64_t reserved_now = 0, used_now = 0;
    if (Real::cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved_now) != CUDA_SUCCESS ||
        Real::cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used_now) != CUDA_SUCCESS ||
        reserved_now < used_now || reserved_now - used_now < bytes) {
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    upfront = 0;
  }
  bool pool_recorded = false;
  {
    // The pool's record exists before the driver is asked (out of host memory: nothing happened yet).
    std::lock_guard<std::mutex> guard(shim.mutex);
    pool_recorded = Recorded([&] { shim.pools.try_emplace(pool, Shim::PoolCharge{ordinal, nullptr, 0}); });
  }
  if (!pool_recorded) {
    Uncharge(ordinal, upfront);  // (Uncharge takes shim.mutex)
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  CUresult result = call();
  const bool made = result == CUDA_SUCCESS && pointer != nullptr;  // the driver handed a block out
  // Settled in one step with the pool's record, under shim.mutex (RegionDevice takes it: asked first). Invariant:
  // the ledger holds, for a pool, its record's `charged` plus the upfront of each allocation from it still being
  // made. Settling in several steps let another thread's settlement or ReconcilePools act on a `charged` not yet
  // paid for (or overwrite one), and the ledger lost count: four threads allocating from one pool ended with the
  // container counted below what it held (tests/shim/hostoom_test.cc).
  const int device = RegionDevice(ordinal);
  std::uint64_t limit = MemoryLimit(ordinal);
  if (limit == 0) limit = UINT64_MAX;  // counted, not limited (as Charge)
  bool over_cap = false, block_recorded = true;
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    auto& charge = shim.pools[pool];  // there (made above): a lookup
    charge.ordinal = ordinal;
    if (charge.context == nullptr) charge.context = CurrentContext();
    for (bool reconciled = false;;) {
      cuuint64_t reserved = 0;
      const bool known =
          Real::cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) == CUDA_SUCCESS;
      const std::uint64_t held = charge.charged + upfront;  // what the ledger holds for the pool, this upfront in it
      // The pool's size; without it, the request itself (never less than what was handed out).
      std::uint64_t target = known ? reserved : made ? held : charge.charged;
      if (target < held) {
        if (device >= 0) shim.region->Release(device, held - target);
      } else if (target > held && device >= 0 && !shim.region->Reserve(device, target - held, limit)) {
        // The pool grew by more than was reserved (its granularity, or other threads' blocks served from this
        // growth), past the cap. Memory pools hold but the driver has trimmed goes back first, and then everything
        // is read again: the reconciliation changes this pool's charge, and a trim since the size was read (another
        // thread's, outside the lock) changes its size. (Settling on the old figures after a reconciliation charged
        // the pool for memory it no longer held, and the ledger fell below what the container held: H100, four
        // threads, 3 runs in 8.)
        if (!reconciled && ReconcilePoolsLocked()) {
          reconciled = true;
          continue;
        }
        over_cap = true;
        target = held;  // settled below, once the block is undone and the pool trimmed
      }
      if (shim.config.log_level >= 4) {  // (the container's figure is read only for the log)
        Log(4, "pool %p: %s %zu bytes, upfront %llu, charged %llu -> %llu (pool reserved %llu%s)%s; container %llu",
            static_cast<void*>(pool), made ? "allocated" : "refused", bytes, static_cast<unsigned long long>(upfront),
            static_cast<unsigned long long>(charge.charged), static_cast<unsigned long long>(target),
            static_cast<unsigned long long>(reserved), known ? "" : ", unknown", over_cap ? ", past the cap" : "",
            static_cast<unsigned long long>(device >= 0 ? shim.region->Used(device) : 0));
      }
      charge.charged = target;
      break;
    }
    if (made && !over_cap) block_recorded = Recorded([&] { shim.pool_blocks[*pointer] = pool; });
  }
  if (over_cap || !block_recorded) {
    // Past the cap: the allocation is undone rather than the limit exceeded. Out of host memory: the block cannot be
    // followed, so it goes back too. Its memory returns to the pool, trimmed (past the cap) and reconciled.
    if (made && Real::cuMemFreeAsync != nullptr) Real::cuMemFreeAsync(*pointer, stream);
    if (over_cap && Real::cuMemPoolTrimTo != nullptr) Real::cuMemPoolTrimTo(pool, 0);
    if (made) *pointer = 0;
    ReconcilePools();
    return made ? CUDA_ERROR_OUT_OF_MEMORY : result;  // (the driver refused it anyway: its error)
  }
  return result;
}

// After a block of `pool` was freed: a destroyed pool whose last block it was gives its memory back.
void BlockFreed(CUmemoryPool pool) {
  Shim& shim = TheShim();
  Shim::PoolCharge gone{-1, nullptr, 0};
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    const auto it = shim.pools.find(pool);
    if (it == shim.pools.end() || !it->second.destroyed) return;
    for (const auto& entry : shim.pool_blocks) {
      if (entry.second == pool) return;  // more blocks to go
    }
    gone = it->second;
    shim.pools.erase(it);
  }
  if (gone.ordinal >= 0) Uncharge(gone.ordinal, gone.charged);
}

CUresult FreeToPool(CUdeviceptr pointer, CUstream stream, CUresult (*real)(CUdeviceptr, CUstream)) {
  if (real == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (CurrentMode() != Mode::limited) return real(pointer, stream);
  // As in cuMemFree: forget the record before the driver can hand the address to someone else.
  Shim& shim = TheShim();
  decltype(shim.pool_blocks)::node_type block;
  decltype(shim.allocations)::node_type allocation;  // cuMemFreeAsync of cuMemAlloc'ed memory frees it too
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    block = shim.pool_blocks.extract(pointer);
    allocation = shim.allocations.extract(pointer);
  }
  const CUresult result = real(pointer, stream);
  if (result != CUDA_SUCCESS) {
    std::lock_guard<std::mutex> guard(shim.mutex);  // put back as nodes: nothing allocated
    if (!block.empty()) shim.pool_blocks.insert(std::move(block));
    if (!allocation.empty()) shim.allocations.insert(std::move(allocation));
    return result;
  }
  if (!allocation.empty()) Uncharge(allocation.mapped().ordinal, allocation.mapped().bytes);
  // A pool block went back to its pool, which keeps it until trimmed: reconciled when memory is needed.
  if (!block.empty()) BlockFreed(block.mapped());
  return result;
}

std::uint64_t ArrayBytes(const CUDA_ARRAY3D_DESCRIPTOR& d, unsigned int levels) {
  std::uint64_t element = 0;
  switch (d.Format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
      element = 1;
      break;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
      element = 2;
      break;
    default:
      element = 4;
      break;  // 32-bit formats; wider/compressed formats are charged at least this
  }
  std::uint64_t total = 0;
  std::uint64_t w = d.Width, h = std::max<std::uint64_t>(d.Height, 1), z = std::max<std::uint64_t>(d.Depth, 1);
  for (unsigned int level = 0; level < std::max(levels, 1u); ++level) {
    total += Rounded(w * h * z * element * std::max<unsigned int>(d.NumChannels, 1));
    w = std::max<std::uint64_t>(w / 2, 1);
    h = std::max<std::uint64_t>(h / 2, 1);
    z = std::max<std::uint64_t>(z / 2, 1);
  }
  return total;
}

template <typename Handle>
CUresult CreateArrayCharged(Handle* out, std::uint64_t bytes, const std::function<CUresult()>& call) {
  CUresult unknown = CUDA_SUCCESS;
  const int ordinal = CurrentOrdinal(unknown);
  if (ordinal < 0) return unknown != CUDA_SUCCESS ? unknown : call();
  const CUresult result = ChargedCall(ordinal, bytes, call);
  if (result == CUDA_SUCCESS && out != nullptr) {
    Shim& shim = TheShim();
    std::unique_lock<std::mutex> guard(shim.mutex);
    if (!Recorded([&] { shim.arrays[reinterpret_cast<CUarray>(*out)] = {ordinal, bytes, CurrentContext()}; })) {
      guard.unlock();
      // Out of host memory: destroyed again (see UndoAllocation).
      if constexpr (std::is_same_v<Handle, CUmipmappedArray>) {
        if (Real::cuMipmappedArrayDestroy != nullptr) Real::cuMipmappedArrayDestroy(*out);
      } else {
        if (Real::cuArrayDestroy != nullptr) Real::cuArrayDestroy(*out);
      }
      Uncharge(ordinal, bytes);
      *out = nullptr;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  return result;
}

CUresult DestroyArrayCharged(CUarray array, const std::function<CUresult()>& call) {
  Shim& shim = TheShim();
  // Forget first: the handle may be reused once destroyed. Taken out as a node, so that putting it back (the driver
  // refused) allocates nothing.
  decltype(shim.arrays)::node_type record;
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    record = shim.arrays.extract(array);
  }
  const CUresult result = call();
  if (result != CUDA_SUCCESS) {
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (!record.empty()) shim.arrays.insert(std::move(record));
    return result;
  }
  if (!record.empty()) Uncharge(record.mapped().ordinal, record.mapped().bytes);
  return result;
}

void DropVmmReference(CUmemGenericAllocationHandle handle) {
  Shim& shim = TheShim();
  Shim::Vmm gone{-1, 0, 0};
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    auto it = shim.vmm.find(handle);
    if (it == shim.vmm.end()) return;
    if (--it->second.references > 0) return;
    gone = it->second;
    shim.vmm.erase(it);
  }
  // The physical memory is gone once the handle is released and every mapping of it is unmapped.
  if (gone.ordinal >= 0) Uncharge(gone.ordinal, gone.bytes);
}

}  // namespace
}  // namespace vgpu::hooks

using namespace vgpu::hooks;

extern "C" VGPU_EXPORT CUresult cuInit(unsigned int flags) try {
  if (!ResolveReal()) return CUDA_ERROR_NOT_INITIALIZED;
  if (CurrentMode() == Mode::failed) return kFailedClosedCuda;
  return Real::cuInit(flags);
}
VGPU_CUDA_CATCH

// ---- contexts -------------------------------------------------------------------------------------------

extern "C" VGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuDevicePrimaryCtxRetain, context, device);
  // Whether this retain creates the context, and its charge, must be one step against other retains/releases.
  std::lock_guard<std::mutex> serial(TheShim().primary_mutex);
  // An existing context was charged when it was created. When the driver cannot say whether it exists, the retain
  // is charged as one that creates it: counted twice at worst (until it goes), never not at all.
  unsigned int flags = 0;
  int active = 0;
  const bool known = Real::cuDevicePrimaryCtxGetState != nullptr &&
                     Real::cuDevicePrimaryCtxGetState(device, &flags, &active) == CUDA_SUCCESS;
  if ((known && active != 0) || context == nullptr) return Real::cuDevicePrimaryCtxRetain(context, device);
  const std::uint64_t estimate = ContextBytes(device);
  const CUresult result =
      ChargedCall(device, estimate, [&] { return Real::cuDevicePrimaryCtxRetain(context, device); });
  if (result == CUDA_SUCCESS) {
    std::uint64_t charged = estimate;
    MeasureContext(device, estimate, charged);
    Shim& shim = TheShim();
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (device >= 0 && device < vgpu::policy::kMaxDevices) {
      shim.primary_bytes[device] += charged;
      shim.primary_context[device] = *context;
    }
  }
  if (result == CUDA_SUCCESS) PublishMemoryBreakdown(device);
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) try {
  return ReleasePrimary(device, Real::cuDevicePrimaryCtxRelease_v2);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice device) try {
  return ReleasePrimary(device, Real::cuDevicePrimaryCtxRelease);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice device) try {
  return ReleasePrimary(device, Real::cuDevicePrimaryCtxReset_v2);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice device) try {
  return ReleasePrimary(device, Real::cuDevicePrimaryCtxReset);
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext* context, unsigned int flags, CUdevice device) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuCtxCreate_v2, context, flags, device);
  return CreateContextCharged(context, device, [&] { return Real::cuCtxCreate_v2(context, flags, device); });
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext* context, CUexecAffinityParam* params, int count,
                                               unsigned int flags, CUdevice device) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuCtxCreate_v3, context, params, count, flags, device);
  return CreateContextCharged(context, device,
                              [&] { return Real::cuCtxCreate_v3(context, params, count, flags, device); });
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext* context, CUctxCreateParams* params, unsigned int flags,
                                               CUdevice device) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuCtxCreate_v4, context, params, flags, device);
  return CreateContextCharged(context, device, [&] { return Real::cuCtxCreate_v4(context, params, flags, device); });
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuCtxDestroy_v2(CUcontext context) try {
  if (CurrentMode() == Mode::failed) return kFailedClosedCuda;
  return DestroyContext(context, Real::cuCtxDestroy_v2);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuCtxDestroy(CUcontext context) try {
  if (CurrentMode() == Mode::failed) return kFailedClosedCuda;
  return DestroyContext(context, Real::cuCtxDestroy);
}
VGPU_CUDA_CATCH

// ---- allocation -----------------------------------------------------------------------------------------

extern "C" VGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* pointer, size_t bytes) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemAlloc_v2, pointer, bytes);
  if (pointer == nullptr || bytes == 0) return Real::cuMemAlloc_v2(pointer, bytes);
  return AllocateTracked(pointer, Rounded(bytes), [&] { return Real::cuMemAlloc_v2(pointer, bytes); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr* pointer, size_t bytes, unsigned int flags) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemAllocManaged, pointer, bytes, flags);
  if (pointer == nullptr || bytes == 0) return Real::cuMemAllocManaged(pointer, bytes, flags);
  return AllocateTracked(pointer, Rounded(bytes), [&] { return Real::cuMemAllocManaged(pointer, bytes, flags); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr* pointer, size_t* pitch, size_t width, size_t height,
                                                   unsigned int element_bytes) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemAllocPitch_v2, pointer, pitch, width, height, element_bytes);
  if (pointer == nullptr || pitch == nullptr || width == 0 || height == 0) {
    return Real::cuMemAllocPitch_v2(pointer, pitch, width, height, element_bytes);
  }
  // The pitch is the driver's choice: reserve the widest it picks (512-byte rows), then settle to its answer.
  const std::uint64_t estimate = Rounded((width + 511) / 512 * 512 * height);
  CUresult unknown = CUDA_SUCCESS;
  const int ordinal = CurrentOrdinal(unknown);
  if (ordinal < 0) {
    return unknown != CUDA_SUCCESS ? unknown : Real::cuMemAllocPitch_v2(pointer, pitch, width, height, element_bytes);
  }
  const CUresult result = ChargedCall(
      ordinal, estimate, [&] { return Real::cuMemAllocPitch_v2(pointer, pitch, width, height, element_bytes); });
  if (result != CUDA_SUCCESS) return result;
  const std::uint64_t actual = Rounded(static_cast<std::uint64_t>(*pitch) * height);
  std::uint64_t charged = estimate;
  if (actual < estimate) {
    Uncharge(ordinal, estimate - actual);
    charged = actual;
  } else if (actual > estimate) {
    if (!Charge(ordinal, actual - estimate)) {
      // Real::cuMemFree_v2 exists whenever cuMemAllocPitch_v2 does.
      if (Real::cuMemFree_v2 != nullptr) Real::cuMemFree_v2(*pointer);
      Uncharge(ordinal, estimate);
      *pointer = 0;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    charged = actual;
  }
  if (!RecordAllocation(*pointer, {ordinal, charged, CurrentContext()}))
    return UndoAllocation(pointer, ordinal, charged);
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr pointer) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemFree_v2, pointer);
  // The record goes first, the memory second: once the driver has freed it, another thread's allocation may be
  // given the same address, and its record must not be the one erased. An unknown pointer is the driver's
  // business: passed on untouched (HAMi-core#321).
  // Records are taken out as nodes, so that putting one back (the driver refused) allocates nothing.
  Shim& shim = TheShim();
  decltype(shim.allocations)::node_type allocation;
  decltype(shim.pool_blocks)::node_type block;
  {
    std::lock_guard<std::mutex> guard(shim.mutex);
    allocation = shim.allocations.extract(pointer);
    // A stream-ordered block: back to its pool, reconciled with the pool's size.
    if (allocation.empty()) block = shim.pool_blocks.extract(pointer);
  }
  const CUresult result = Real::cuMemFree_v2(pointer);
  if (result != CUDA_SUCCESS) {
    std::lock_guard<std::mutex> guard(shim.mutex);
    if (!allocation.empty()) shim.allocations.insert(std::move(allocation));
    if (!block.empty()) shim.pool_blocks.insert(std::move(block));
    return result;
  }
  if (!allocation.empty()) Uncharge(allocation.mapped().ordinal, allocation.mapped().bytes);
  if (!block.empty()) BlockFreed(block.mapped());
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr* pointer, size_t bytes, CUstream stream) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemAllocAsync, pointer, bytes, stream);
  if (pointer == nullptr || bytes == 0) return Real::cuMemAllocAsync(pointer, bytes, stream);
  return AllocateFromPool(pointer, bytes, nullptr, stream,
                          [&] { return Real::cuMemAllocAsync(pointer, bytes, stream); });
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr* pointer, size_t bytes, CUstream stream) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemAllocAsync_ptsz, pointer, bytes, stream);
  if (pointer == nullptr || bytes == 0) return Real::cuMemAllocAsync_ptsz(pointer, bytes, stream);
  return AllocateFromPool(pointer, bytes, nullptr, stream,
                          [&] { return Real::cuMemAllocAsync_ptsz(pointer, bytes, stream); });
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* pointer, size_t bytes, CUmemoryPool pool,
                                                        CUstream stream) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemAllocFromPoolAsync, pointer, bytes, pool, stream);
  if (pointer == nullptr || bytes == 0 || pool == nullptr)
    return Real::cuMemAllocFromPoolAsync(pointer, bytes, pool, stream);
  return AllocateFromPool(pointer, bytes, pool, stream,
                          [&] { return Real::cuMemAllocFromPoolAsync(pointer, bytes, pool, stream); });
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* pointer, size_t bytes, CUmemoryPool pool,
                                                             CUstream stream) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemAllocFromPoolAsync_ptsz, pointer, bytes, pool, stream);
  if (pointer == nullptr || bytes == 0 || pool == nullptr) {
    return Real::cuMemAllocFromPoolAsync_ptsz(pointer, bytes, pool, stream);
  }
  return AllocateFromPool(pointer, bytes, pool, stream,
                          [&] { return Real::cuMemAllocFromPoolAsync_ptsz(pointer, bytes, pool, stream); });
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr pointer, CUstream stream) try {
  if (CurrentMode() == Mode::failed) return kFailedClosedCuda;
  return FreeToPool(pointer, stream, Real::cuMemFreeAsync);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr pointer, CUstream stream) try {
  if (CurrentMode() == Mode::failed) return kFailedClosedCuda;
  return FreeToPool(pointer, stream, Real::cuMemFreeAsync_ptsz);
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep_bytes) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemPoolTrimTo, pool, keep_bytes);
  const CUresult result = Real::cuMemPoolTrimTo(pool, keep_bytes);
  ReconcilePools();
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemPoolDestroy, pool);
  const CUresult result = Real::cuMemPoolDestroy(pool);
  if (result == CUDA_SUCCESS) {
    Shim& shim = TheShim();
    Shim::PoolCharge charge{-1, nullptr, 0};
    {
      std::lock_guard<std::mutex> guard(shim.mutex);
      if (auto node = shim.pools.extract(pool); !node.empty()) {
        charge = node.mapped();
        // Blocks still allocated from it keep the pool's memory in the driver until they are freed ("released
        // automatically once there are no more outstanding allocations"): the charge stays until then, under a
        // key no real handle can take (a non-canonical address), so that a new pool given the same handle is its own.
        // The record is moved to that key as a node: nothing allocated.
        const auto retired =
            reinterpret_cast<CUmemoryPool>((std::uintptr_t{1} << 63) | (++shim.retired_pools << 1) | 1);
        bool outstanding = false;
        for (auto& [block, owner] : shim.pool_blocks) {
          if (owner != pool) continue;
          owner = retired;
          outstanding = true;
        }
        if (outstanding) {
          node.key() = retired;
          node.mapped().destroyed = true;
          shim.pools.insert(std::move(node));
          charge.ordinal = -1;  // nothing given back now
        }
      }
    }
    if (charge.ordinal >= 0) Uncharge(charge.ordinal, charge.charged);
  }
  return result;
}
VGPU_CUDA_CATCH

// ---- VMM: charged to the device in the allocation's location; freed when released and unmapped -----------

extern "C" VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t bytes,
                                            const CUmemAllocationProp* prop, unsigned long long flags) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemCreate, handle, bytes, prop, flags);
  if (handle == nullptr || prop == nullptr || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return Real::cuMemCreate(handle, bytes, prop, flags);  // host memory is not device memory: not charged
  }
  const int ordinal = prop->location.id;
  const CUresult result = ChargedCall(ordinal, bytes, [&] { return Real::cuMemCreate(handle, bytes, prop, flags); });
  if (result == CUDA_SUCCESS) {
    Shim& shim = TheShim();
    std::unique_lock<std::mutex> guard(shim.mutex);
    if (!Recorded([&] { shim.vmm[*handle] = {ordinal, bytes, 1}; })) {
      guard.unlock();
      if (Real::cuMemRelease != nullptr) Real::cuMemRelease(*handle);  // out of host memory: see UndoAllocation
      Uncharge(ordinal, bytes);
      *handle = 0;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemRelease, handle);
  const CUresult result = Real::cuMemRelease(handle);
  if (result == CUDA_SUCCESS) DropVmmReference(handle);
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemMap(CUdeviceptr pointer, size_t bytes, size_t offset,
                                         CUmemGenericAllocationHandle handle, unsigned long long flags) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemMap, pointer, bytes, offset, handle, flags);
  const CUresult result = Real::cuMemMap(pointer, bytes, offset, handle, flags);
  if (result == CUDA_SUCCESS) {
    Shim& shim = TheShim();
    std::unique_lock<std::mutex> guard(shim.mutex);
    if (auto it = shim.vmm.find(handle); it != shim.vmm.end()) {
      if (!Recorded([&] { shim.vmm_mappings[pointer] = {handle, bytes}; })) {
        guard.unlock();
        // Out of host memory: unmapped again, so that the mapping never outlives its charge uncounted.
        if (Real::cuMemUnmap != nullptr) Real::cuMemUnmap(pointer, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
      }
      ++it->second.references;
    }
  }
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr pointer, size_t bytes) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemUnmap, pointer, bytes);
  const CUresult result = Real::cuMemUnmap(pointer, bytes);
  if (result == CUDA_SUCCESS) {
    // The mappings go, and with each a reference to its handle (the memory is given back with the last one). Nothing
    // here allocates: an unmap the driver made must be followed even with the host out of memory (collecting the
    // handles in a vector first lost their references when it could not grow: the memory stayed charged).
    Shim& shim = TheShim();
    std::uint64_t released[vgpu::policy::kMaxDevices] = {};
    {
      std::lock_guard<std::mutex> guard(shim.mutex);
      for (auto it = shim.vmm_mappings.lower_bound(pointer);
           it != shim.vmm_mappings.end() && it->first < pointer + bytes;) {
        if (auto vmm = shim.vmm.find(it->second.first); vmm != shim.vmm.end() && --vmm->second.references <= 0) {
          const int ordinal = vmm->second.ordinal;  // -1: host memory, never charged
          if (ordinal >= 0 && ordinal < vgpu::policy::kMaxDevices) released[ordinal] += vmm->second.bytes;
          shim.vmm.erase(vmm);
        }
        it = shim.vmm_mappings.erase(it);
      }
    }
    for (int ordinal = 0; ordinal < vgpu::policy::kMaxDevices; ++ordinal) Uncharge(ordinal, released[ordinal]);
  }
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* address) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemRetainAllocationHandle, handle, address);
  const CUresult result = Real::cuMemRetainAllocationHandle(handle, address);
  if (result == CUDA_SUCCESS && handle != nullptr) {
    Shim& shim = TheShim();
    std::lock_guard<std::mutex> guard(shim.mutex);
    // One more reference: the memory stays until this handle is released too.
    if (auto it = shim.vmm.find(*handle); it != shim.vmm.end()) ++it->second.references;
  }
  return result;
}
VGPU_CUDA_CATCH

// ---- arrays ---------------------------------------------------------------------------------------------

extern "C" VGPU_EXPORT CUresult cuArrayCreate_v2(CUarray* array, const CUDA_ARRAY_DESCRIPTOR* desc) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuArrayCreate_v2, array, desc);
  if (array == nullptr || desc == nullptr) return Real::cuArrayCreate_v2(array, desc);
  CUDA_ARRAY3D_DESCRIPTOR d3{};
  d3.Width = desc->Width;
  d3.Height = desc->Height;
  d3.Format = desc->Format;
  d3.NumChannels = desc->NumChannels;
  return CreateArrayCharged(array, ArrayBytes(d3, 1), [&] { return Real::cuArrayCreate_v2(array, desc); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuArray3DCreate_v2, array, desc);
  if (array == nullptr || desc == nullptr) return Real::cuArray3DCreate_v2(array, desc);
  return CreateArrayCharged(array, ArrayBytes(*desc, 1), [&] { return Real::cuArray3DCreate_v2(array, desc); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuArrayDestroy(CUarray array) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuArrayDestroy, array);
  return DestroyArrayCharged(array, [&] { return Real::cuArrayDestroy(array); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc,
                                                       unsigned int levels) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMipmappedArrayCreate, array, desc, levels);
  if (array == nullptr || desc == nullptr) return Real::cuMipmappedArrayCreate(array, desc, levels);
  return CreateArrayCharged(array, ArrayBytes(*desc, levels),
                            [&] { return Real::cuMipmappedArrayCreate(array, desc, levels); });
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray array) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMipmappedArrayDestroy, array);
  return DestroyArrayCharged(reinterpret_cast<CUarray>(array), [&] { return Real::cuMipmappedArrayDestroy(array); });
}
VGPU_CUDA_CATCH

// ---- the view -------------------------------------------------------------------------------------------

extern "C" VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuMemGetInfo_v2, free_bytes, total_bytes);
  // The driver decides what a missing context or two NULL outputs mean; one NULL output is skipped
  // (HAMi-core#333).
  if (free_bytes == nullptr && total_bytes == nullptr) return Real::cuMemGetInfo_v2(free_bytes, total_bytes);
  std::size_t physical_total = 0, physical_free = 0;
  const CUresult result = Real::cuMemGetInfo_v2(&physical_free, &physical_total);
  if (result != CUDA_SUCCESS) return result;
  CUresult unknown = CUDA_SUCCESS;
  const int ordinal = CurrentOrdinal(unknown);
  if (ordinal < 0 && unknown != CUDA_SUCCESS) return unknown;  // which slice to show is unknown: not the whole GPU
  const std::uint64_t limit = MemoryLimit(ordinal);
  if (limit == 0) {
    if (total_bytes != nullptr) *total_bytes = physical_total;
    if (free_bytes != nullptr) *free_bytes = physical_free;
    return result;
  }
  ReconcilePools();
  RefreshView(ordinal);
  const std::uint64_t total = std::min<std::uint64_t>(limit, physical_total);
  const std::uint64_t used = Used(ordinal);
  // Never wraps (HAMi#1181), never more than the device really has free.
  const std::uint64_t free_view = std::min<std::uint64_t>(FreeOfSlice(total, used), physical_free);
  if (total_bytes != nullptr) *total_bytes = total;
  if (free_bytes != nullptr) *free_bytes = free_view;
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice device) try {
  VGPU_PASSTHROUGH_UNLESS_LIMITED(cuDeviceTotalMem_v2, bytes, device);
  const CUresult result = Real::cuDeviceTotalMem_v2(bytes, device);
  if (result != CUDA_SUCCESS || bytes == nullptr) return result;
  const std::uint64_t limit = MemoryLimit(device);
  if (limit != 0) *bytes = std::min<std::uint64_t>(limit, *bytes);  // a limit above the device is not a bigger GPU
  return result;
}
VGPU_CUDA_CATCH

// ---- the CUDA 2.x/3.0 ABI -------------------------------------------------------------------------------
// 32-bit sizes, kept by the driver for ancient binaries. Under a limit it is refused rather than left as a way
// around the cap; without one it is passed through.

#define VGPU_LEGACY_REFUSED_UNDER_A_LIMIT(real, ...)             \
  do {                                                           \
    if (Real::real == nullptr) ResolveReal();                    \
    if (Real::real == nullptr) return CUDA_ERROR_NOT_FOUND;      \
    const Mode mode_ = CurrentMode();                            \
    if (mode_ == Mode::failed) return kFailedClosedCuda;         \
    if (mode_ == Mode::limited) return CUDA_ERROR_NOT_SUPPORTED; \
    return Real::real(__VA_ARGS__);                              \
  } while (0)

extern "C" VGPU_EXPORT CUresult cuMemAlloc(unsigned int* pointer, unsigned int bytes) try {
  VGPU_LEGACY_REFUSED_UNDER_A_LIMIT(cuMemAlloc, pointer, bytes);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuMemAllocPitch(unsigned int* pointer, unsigned int* pitch, unsigned int width,
                                                unsigned int height, unsigned int element_bytes) try {
  VGPU_LEGACY_REFUSED_UNDER_A_LIMIT(cuMemAllocPitch, pointer, pitch, width, height, element_bytes);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuMemGetInfo(unsigned int* free_bytes, unsigned int* total_bytes) try {
  VGPU_LEGACY_REFUSED_UNDER_A_LIMIT(cuMemGetInfo, free_bytes, total_bytes);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuDeviceTotalMem(unsigned int* bytes, CUdevice device) try {
  VGPU_LEGACY_REFUSED_UNDER_A_LIMIT(cuDeviceTotalMem, bytes, device);
}
VGPU_CUDA_CATCH
extern "C" VGPU_EXPORT CUresult cuCtxCreate(CUcontext* context, unsigned int flags, CUdevice device) try {
  VGPU_LEGACY_REFUSED_UNDER_A_LIMIT(cuCtxCreate, context, flags, device);
}
VGPU_CUDA_CATCH
