// Fake libcuda.so.1: device, pitch, managed, host, stream-ordered (pool), VMM and array memory; copies and
// memsets. Device memory is host memory mapped lazily (MAP_NORESERVE), charged to the shared machine.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <vector>

#include "internal.h"

namespace fakecuda::driver {
namespace {

constexpr std::size_t kChargeGranularity = 512;
constexpr std::size_t kVmmGranularity = 2u << 20;

std::size_t PageRound(std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

std::uint64_t ChargeFor(std::size_t bytes) {
  return (bytes + kChargeGranularity - 1) / kChargeGranularity * kChargeGranularity;
}

void* MapAnonymous(std::size_t bytes) {
  void* p = mmap(nullptr, PageRound(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// Allocates host-backed device memory of `bytes`, charged to the current context's device.
CUresult AllocateDevice(Driver& d, const char* api, CUdeviceptr* out, std::size_t bytes, AllocationKind kind,
                        std::size_t charged_size) {
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  const std::uint64_t charge = ChargeFor(charged_size);
  if (!ChargeDevice(d, c->device, charge)) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = MapAnonymous(bytes);
  if (p == nullptr) {
    UnchargeDevice(d, c->device, charge);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Allocation a;
  a.bytes = bytes;
  a.mapped_bytes = PageRound(bytes);
  a.charged_bytes = charge;
  a.device = c->device;
  a.kind = kind;
  a.context = c;
  d.allocations[reinterpret_cast<std::uintptr_t>(p)] = a;
  *out = reinterpret_cast<CUdeviceptr>(p);
  TraceAllocation("alloc", api, c->device, charge, reinterpret_cast<std::uintptr_t>(p));
  return CUDA_SUCCESS;
}

void ReleaseAllocation(Driver& d, std::map<std::uintptr_t, Allocation>::iterator it) {
  const Allocation& a = it->second;
  if (!a.registered) munmap(reinterpret_cast<void*>(it->first), a.mapped_bytes);
  if (a.kind != AllocationKind::host) {
    UnchargeDevice(d, a.device, a.charged_bytes);
    TraceAllocation("free", "", a.device, a.charged_bytes, it->first);
  }
  d.allocations.erase(it);
}

// The allocation containing `address`, or end().
std::map<std::uintptr_t, Allocation>::iterator Containing(Driver& d, std::uintptr_t address) {
  auto it = d.allocations.upper_bound(address);
  if (it == d.allocations.begin()) return d.allocations.end();
  --it;
  return address < it->first + std::max<std::size_t>(it->second.bytes, 1) ? it : d.allocations.end();
}

// ---- stream-ordered pools -----------------------------------------------------------------------------------

Pool* DefaultPool(Driver& d, std::uint32_t device) {
  if (d.default_pool[device] == nullptr) {
    auto* p = new Pool();
    p->device = device;
    p->is_default = true;
    d.default_pool[device] = Register(d, p);
  }
  return d.default_pool[device];
}

Pool* CurrentPool(Driver& d, std::uint32_t device) {
  return d.current_pool[device] != nullptr ? d.current_pool[device] : DefaultPool(d, device);
}

void TrimPool(Driver& d, Pool& pool, std::uint64_t keep_bytes) {
  for (auto it = pool.cached.begin(); it != pool.cached.end() && pool.reserved_bytes > keep_bytes;) {
    auto allocation = d.allocations.find(it->second);
    if (allocation != d.allocations.end()) {
      pool.reserved_bytes -= std::min(pool.reserved_bytes, allocation->second.charged_bytes);
      ReleaseAllocation(d, allocation);
    }
    it = pool.cached.erase(it);
  }
}

CUresult AllocateFromPool(Driver& d, const char* api, CUdeviceptr* out, std::size_t bytes, Pool& pool, CUstream stream,
                          bool per_thread) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (bytes == 0) {  // observed on an H100, driver 580.159.04: success with a NULL pointer
    *out = 0;
    return CUDA_SUCCESS;
  }
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, stream, per_thread, rs); r != CUDA_SUCCESS) return r;
  const std::uint64_t charge = ChargeFor(bytes);
  // Reuse a cached block of the same charge (the real pool reuses freed memory in stream order).
  if (pool.reuse_opportunistic != 0 || pool.reuse_follow_event != 0) {
    const auto it = pool.cached.lower_bound(bytes);
    if (it != pool.cached.end() && it->first <= bytes * 2) {
      const std::uintptr_t address = it->second;
      pool.cached.erase(it);
      Allocation& a = d.allocations.at(address);
      a.cached = false;
      pool.used_bytes += a.charged_bytes;
      pool.used_high = std::max(pool.used_high, pool.used_bytes);
      *out = address;
      return CUDA_SUCCESS;
    }
  }
  if (!ChargeDevice(d, pool.device, charge)) {
    TrimPool(d, pool, 0);  // give cached blocks back and try once more, as the real pool does under pressure
    if (!ChargeDevice(d, pool.device, charge)) return CUDA_ERROR_OUT_OF_MEMORY;
  }
  void* p = MapAnonymous(bytes);
  if (p == nullptr) {
    UnchargeDevice(d, pool.device, charge);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Allocation a;
  a.bytes = bytes;
  a.mapped_bytes = PageRound(bytes);
  a.charged_bytes = charge;
  a.device = pool.device;
  a.kind = AllocationKind::pool;
  a.context = rs.context;
  a.pool = &pool;
  d.allocations[reinterpret_cast<std::uintptr_t>(p)] = a;
  pool.reserved_bytes += charge;
  pool.reserved_high = std::max(pool.reserved_high, pool.reserved_bytes);
  pool.used_bytes += charge;
  pool.used_high = std::max(pool.used_high, pool.used_bytes);
  *out = reinterpret_cast<CUdeviceptr>(p);
  TraceAllocation("alloc", api, pool.device, charge, reinterpret_cast<std::uintptr_t>(p));
  return CUDA_SUCCESS;
}

CUresult FreeAsync(CUdeviceptr pointer, CUstream stream, bool per_thread) {
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, stream, per_thread, rs); r != CUDA_SUCCESS) return r;
  if (pointer == 0) return CUDA_SUCCESS;  // what a zero-byte cuMemAllocAsync handed out
  const auto address = static_cast<std::uintptr_t>(pointer);
  auto it = d.allocations.find(address);
  if (it == d.allocations.end() || it->second.kind == AllocationKind::host || it->second.cached) {
    return CUDA_ERROR_INVALID_VALUE;  // unknown, host, or already freed back to its pool
  }
  Allocation& a = it->second;
  if (a.kind != AllocationKind::pool || a.pool == nullptr) {
    // cuMemFreeAsync of ordinary memory frees it once the stream reaches this point: wait outside the lock.
    guard.unlock();
    WaitStreamIdle(rs.context->device, rs.index, rs.generation);
    guard.lock();
    it = d.allocations.find(address);
    if (it == d.allocations.end() || it->second.cached) return CUDA_ERROR_INVALID_VALUE;  // freed meanwhile
    ReleaseAllocation(d, it);
    return CUDA_SUCCESS;
  }
  Pool& pool = *a.pool;
  pool.used_bytes -= std::min(pool.used_bytes, a.charged_bytes);
  a.cached = true;
  pool.cached.emplace(a.bytes, it->first);
  return CUDA_SUCCESS;
}

// ---- copies -------------------------------------------------------------------------------------------------

// Orders a copy after the work queued before it: the legacy stream (synchronous copies) waits for the whole
// context; other streams for themselves.
CUresult OrderCopy(Driver& d, std::unique_lock<std::mutex>& guard, CUstream stream, bool per_thread, bool synchronous) {
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, stream, per_thread, rs); r != CUDA_SUCCESS) return r;
  if (rs.stream != nullptr && rs.stream->capture != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  guard.unlock();
  CUresult r = CUDA_SUCCESS;
  if (synchronous || rs.legacy)
    r = WaitContextIdle(rs.context);
  else
    r = WaitStreamIdle(rs.context->device, rs.index, rs.generation);
  guard.lock();
  return r;
}

enum class Side { device, host, any };

bool RangeOk(Driver& d, std::uintptr_t address, std::size_t bytes, Side side) {
  if (address == 0) return false;
  if (side == Side::host) return true;  // host memory cannot be checked; the caller vouches for it
  const bool on_device = DeviceRangeValid(d, address, bytes);
  if (side == Side::device) return on_device;
  return true;
}

CUresult Copy(const char* api, std::uintptr_t destination, Side destination_side, std::uintptr_t source,
              Side source_side, std::size_t bytes, CUstream stream, bool per_thread, bool synchronous) {
  FAKECUDA_ENTER(api);
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  if (CurrentContext(d) == nullptr) return NoContextError(d);
  if (bytes == 0) return CUDA_SUCCESS;
  if (!RangeOk(d, destination, bytes, destination_side) || !RangeOk(d, source, bytes, source_side)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (const CUresult r = OrderCopy(d, guard, stream, per_thread, synchronous); r != CUDA_SUCCESS) return r;
  std::memmove(reinterpret_cast<void*>(destination), reinterpret_cast<const void*>(source), bytes);
  return CUDA_SUCCESS;
}

// Zeroes a range of a private anonymous allocation by discarding its whole pages (they read back as zero and
// cost no RAM again) and clearing the partial pages at the ends. False if the range is not such memory.
bool ZeroByDiscarding(Driver& d, std::uintptr_t address, std::size_t bytes) {
  auto it = Containing(d, address);
  if (it == d.allocations.end() || it->second.kind == AllocationKind::host) return false;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t first_page = (address + page - 1) / page * page;
  const std::uintptr_t end = address + bytes;
  const std::uintptr_t last_page = end / page * page;
  if (last_page <= first_page) return false;
  if (madvise(reinterpret_cast<void*>(first_page), last_page - first_page, MADV_DONTNEED) != 0) return false;
  std::memset(reinterpret_cast<void*>(address), 0, first_page - address);
  std::memset(reinterpret_cast<void*>(last_page), 0, end - last_page);
  return true;
}

template <typename T>
CUresult Memset(const char* api, CUdeviceptr destination, std::size_t pitch, T value, std::size_t width,
                std::size_t height, CUstream stream, bool per_thread, bool synchronous) {
  FAKECUDA_ENTER(api);
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  if (CurrentContext(d) == nullptr) return NoContextError(d);
  if (width == 0 || height == 0) return CUDA_SUCCESS;
  if (destination % sizeof(T) != 0) return CUDA_ERROR_INVALID_VALUE;
  std::size_t row_bytes = 0, rows_span = 0, span = 0;
  if (__builtin_mul_overflow(width, sizeof(T), &row_bytes) || __builtin_mul_overflow(pitch, height - 1, &rows_span) ||
      __builtin_add_overflow(height == 1 ? 0 : rows_span, row_bytes, &span)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (height > 1 && pitch < row_bytes) return CUDA_ERROR_INVALID_VALUE;
  if (!DeviceRangeValid(d, destination, span)) return CUDA_ERROR_INVALID_VALUE;
  if (const CUresult r = OrderCopy(d, guard, stream, per_thread, synchronous); r != CUDA_SUCCESS) return r;
  if (value == T{0} && height == 1 && ZeroByDiscarding(d, destination, row_bytes)) return CUDA_SUCCESS;
  for (std::size_t row = 0; row < height; ++row) {
    T* p = reinterpret_cast<T*>(destination + row * pitch);
    std::fill(p, p + width, value);
  }
  return CUDA_SUCCESS;
}

std::uintptr_t Memcpy2DAddress(CUmemorytype type, const void* host, CUdeviceptr device, bool& ok) {
  ok = true;
  switch (type) {
    case CU_MEMORYTYPE_HOST:
      return reinterpret_cast<std::uintptr_t>(host);
    case CU_MEMORYTYPE_DEVICE:
      return static_cast<std::uintptr_t>(device);
    case CU_MEMORYTYPE_UNIFIED:
      return static_cast<std::uintptr_t>(device);
    default:
      ok = false;
      return 0;  // arrays are accounted, not backed: copies to them are not supported
  }
}

CUresult Copy2D(const char* api, const CUDA_MEMCPY2D* p, CUstream stream, bool per_thread, bool synchronous) {
  FAKECUDA_ENTER(api);
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::unique_lock<std::mutex> guard(d.mutex);
  if (CurrentContext(d) == nullptr) return NoContextError(d);
  bool src_ok = false, dst_ok = false;
  const std::uintptr_t src = Memcpy2DAddress(p->srcMemoryType, p->srcHost, p->srcDevice, src_ok);
  const std::uintptr_t dst = Memcpy2DAddress(p->dstMemoryType, p->dstHost, p->dstDevice, dst_ok);
  if (!src_ok || !dst_ok) {
    return p->srcMemoryType == CU_MEMORYTYPE_ARRAY || p->dstMemoryType == CU_MEMORYTYPE_ARRAY
               ? CUDA_ERROR_NOT_SUPPORTED
               : CUDA_ERROR_INVALID_VALUE;
  }
  if (p->WidthInBytes == 0 || p->Height == 0) return CUDA_SUCCESS;
  if ((p->Height > 1 &&
       (p->srcPitch < p->WidthInBytes + p->srcXInBytes || p->dstPitch < p->WidthInBytes + p->dstXInBytes))) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // Every product and sum checked: offsets from huge coordinates must not wrap into valid memory.
  std::size_t src_offset = 0, dst_offset = 0, src_span = 0, dst_span = 0, t = 0;
  std::uintptr_t src_start = 0, dst_start = 0;
  if (__builtin_mul_overflow(p->srcY, p->srcPitch, &t) || __builtin_add_overflow(t, p->srcXInBytes, &src_offset) ||
      __builtin_add_overflow(src, src_offset, &src_start) || __builtin_mul_overflow(p->dstY, p->dstPitch, &t) ||
      __builtin_add_overflow(t, p->dstXInBytes, &dst_offset) || __builtin_add_overflow(dst, dst_offset, &dst_start) ||
      __builtin_mul_overflow(p->Height - 1, p->srcPitch, &t) || __builtin_add_overflow(t, p->WidthInBytes, &src_span) ||
      __builtin_mul_overflow(p->Height - 1, p->dstPitch, &t) || __builtin_add_overflow(t, p->WidthInBytes, &dst_span)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const Side src_side = p->srcMemoryType == CU_MEMORYTYPE_DEVICE ? Side::device : Side::host;
  const Side dst_side = p->dstMemoryType == CU_MEMORYTYPE_DEVICE ? Side::device : Side::host;
  if (!RangeOk(d, src_start, src_span, src_side) || !RangeOk(d, dst_start, dst_span, dst_side))
    return CUDA_ERROR_INVALID_VALUE;
  if (const CUresult r = OrderCopy(d, guard, stream, per_thread, synchronous); r != CUDA_SUCCESS) return r;
  for (std::size_t row = 0; row < p->Height; ++row) {
    std::memmove(reinterpret_cast<void*>(dst_start + row * p->dstPitch),
                 reinterpret_cast<const void*>(src_start + row * p->srcPitch), p->WidthInBytes);
  }
  return CUDA_SUCCESS;
}

// ---- arrays -------------------------------------------------------------------------------------------------

std::size_t FormatBytes(CUarray_format format) {
  switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
      return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
      return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
      return 4;
    default:
      return 0;
  }
}

CUresult CreateArray(const char* api, Kind kind, void** out, const CUDA_ARRAY3D_DESCRIPTOR& desc, unsigned int levels) {
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  const std::size_t element = FormatBytes(desc.Format);
  if (element == 0 || (desc.NumChannels != 1 && desc.NumChannels != 2 && desc.NumChannels != 4) || desc.Width == 0 ||
      (desc.Height == 0 && desc.Depth != 0) || levels == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::uint64_t bytes = 0;
  std::size_t w = desc.Width, h = std::max<std::size_t>(desc.Height, 1), z = std::max<std::size_t>(desc.Depth, 1);
  for (unsigned int level = 0; level < levels; ++level) {
    bytes += ChargeFor(w * h * z * element * desc.NumChannels);
    w = std::max<std::size_t>(w / 2, 1);
    h = std::max<std::size_t>(h / 2, 1);
    z = std::max<std::size_t>(z / 2, 1);
  }
  if (!ChargeDevice(d, c->device, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
  auto* array = new Array(kind);
  array->context = c;
  array->device = c->device;
  array->charged_bytes = bytes;
  array->descriptor = desc;
  array->levels = levels;
  TraceAllocation("alloc", api, c->device, bytes, reinterpret_cast<std::uintptr_t>(array));
  *out = Register(d, array);
  return CUDA_SUCCESS;
}

CUresult DestroyArray(CUarray_st* handle, Kind kind) {
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Array* array = Lookup<Array>(d, handle, kind);
  if (array == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  UnchargeDevice(d, array->device, array->charged_bytes);
  TraceAllocation("free", "", array->device, array->charged_bytes, reinterpret_cast<std::uintptr_t>(array));
  Unregister(d, array);
  delete array;
  return CUDA_SUCCESS;
}

// ---- VMM ----------------------------------------------------------------------------------------------------

bool DeviceLocation(const Driver& d, const CUmemLocation& location, std::uint32_t& physical) {
  if (location.type != CU_MEM_LOCATION_TYPE_DEVICE) return false;
  return PhysicalDevice(d, location.id, physical);
}

CUresult CheckProp(const Driver& d, const CUmemAllocationProp* prop) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  std::uint32_t physical = 0;
  switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      return PhysicalDevice(d, prop->location.id, physical) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
}

void ReleaseVmmIfUnused(Driver& d, CUmemGenericAllocationHandle handle) {
  auto it = d.vmm_handles.find(handle);
  if (it == d.vmm_handles.end() || !it->second.released || it->second.mappings > 0 || it->second.retains > 0) return;
  if (it->second.charged_bytes > 0) {
    UnchargeDevice(d, it->second.device, it->second.charged_bytes);
    TraceAllocation("free", "", it->second.device, it->second.charged_bytes, static_cast<std::uintptr_t>(handle));
  }
  close(it->second.memfd);
  d.vmm_handles.erase(it);
}

bool InsideReservation(const Driver& d, std::uintptr_t address, std::size_t bytes) {
  auto it = d.reservations.upper_bound(address);
  if (it == d.reservations.begin()) return false;
  --it;
  return address >= it->first && address + bytes <= it->first + it->second;
}

}  // namespace

// ---- helpers shared with the other api files ------------------------------------------------------------------

bool ChargeDevice(Driver& d, std::uint32_t device, std::uint64_t bytes) {
  state::EnsureOwnSlot(*d.attachment);
  state::MachineLock lock(*d.attachment);
  model::Machine& m = lock.machine();
  if (model::Charge(m, device, d.attachment->slot, bytes)) return true;
  // Memory of processes that died may still be counted: reap and retry once before saying no.
  if (state::ReapDeadProcesses(*d.attachment, state::MonotonicNs(), true) == 0) return false;
  return model::Charge(m, device, d.attachment->slot, bytes);
}

void UnchargeDevice(Driver& d, std::uint32_t device, std::uint64_t bytes) {
  state::EnsureOwnSlot(*d.attachment);
  state::MachineLock lock(*d.attachment);
  model::Uncharge(lock.machine(), device, d.attachment->slot, bytes);
}

bool DeviceRangeValid(Driver& d, std::uintptr_t address, std::size_t bytes) {
  // Written so that no sum can wrap: a huge `bytes` is simply out of range.
  auto it = Containing(d, address);
  if (it != d.allocations.end()) {
    const std::size_t offset = address - it->first;
    return bytes <= it->second.bytes && offset <= it->second.bytes - bytes;
  }
  auto m = d.mappings.upper_bound(address);
  if (m == d.mappings.begin()) return false;
  --m;
  const std::size_t offset = address - m->first;
  return m->second.accessible && offset < m->second.bytes && bytes <= m->second.bytes - offset;
}

void TraceAllocation(const char* event, const char* api, std::uint32_t device, std::uint64_t bytes,
                     std::uintptr_t address) {
  if (!state::TraceEnabled()) return;
  char line[320];
  std::snprintf(line, sizeof line,
                "{\"ev\":\"%s\",\"pid\":%d,\"device\":%u,\"api\":\"%s\",\"bytes\":%" PRIu64 ",\"ptr\":\"0x%" PRIxPTR
                "\",\"t_ns\":%" PRIu64 "}",
                event, static_cast<int>(getpid()), device, api, bytes, address, state::MonotonicNs());
  state::TraceLine(line);
}

void TrimPoolsAtSync(Driver& d) {
  for (std::uint32_t dev = 0; dev < model::kMaxDevices; ++dev) {
    for (Pool* pool : {d.default_pool[dev], d.current_pool[dev]}) {
      if (pool != nullptr && pool->reserved_bytes > pool->release_threshold)
        TrimPool(d, *pool, pool->release_threshold);
    }
  }
  for (const auto& [handle, kind] : d.handles) {
    if (kind != Kind::pool) continue;
    Pool* pool = static_cast<Pool*>(const_cast<void*>(handle));
    if (pool->reserved_bytes > pool->release_threshold) TrimPool(d, *pool, pool->release_threshold);
  }
}

void TearDownContextStreamsAndModules(Driver& d, Context* c);

void TearDownContext(Driver& d, Context* c) {
  d.destroyed_contexts.insert(c);
  ForgetContextStorage(reinterpret_cast<CUcontext>(c));
  for (auto it = d.allocations.begin(); it != d.allocations.end();) {
    auto next = std::next(it);
    if (it->second.context == c && it->second.kind != AllocationKind::host) {
      if (it->second.pool != nullptr) {
        Pool& pool = *it->second.pool;
        pool.reserved_bytes -= std::min(pool.reserved_bytes, it->second.charged_bytes);
        if (!it->second.cached) pool.used_bytes -= std::min(pool.used_bytes, it->second.charged_bytes);
        for (auto cached = pool.cached.begin(); cached != pool.cached.end(); ++cached) {
          if (cached->second == it->first) {
            pool.cached.erase(cached);
            break;
          }
        }
      }
      ReleaseAllocation(d, it);
    }
    it = next;
  }
  std::vector<Array*> arrays;  // arrays live in a context and go with it
  for (const auto& [handle, kind] : d.handles) {
    if (kind != Kind::array && kind != Kind::mipmapped_array) continue;
    auto* array = static_cast<Array*>(const_cast<void*>(handle));
    if (array->context == c) arrays.push_back(array);
  }
  for (Array* array : arrays) {
    UnchargeDevice(d, array->device, array->charged_bytes);
    Unregister(d, array);
    delete array;
  }
  TearDownContextStreamsAndModules(d, c);
  UnchargeDevice(d, c->device, c->charged_bytes);
  {
    state::MachineLock lock(*d.attachment);
    std::uint32_t& contexts = lock.machine().slots[d.attachment->slot].contexts[c->device];
    if (contexts > 0) --contexts;
  }
  Unregister(d, c);
  delete c;
}

CUresult MapModuleData(Driver& d, Context* c, std::size_t bytes, std::uintptr_t& base) {
  void* p = MapAnonymous(bytes);
  if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  Allocation a;
  a.bytes = bytes;
  a.mapped_bytes = PageRound(bytes);
  a.device = c->device;
  a.kind = AllocationKind::module_data;
  a.context = c;
  base = reinterpret_cast<std::uintptr_t>(p);
  d.allocations[base] = a;
  return CUDA_SUCCESS;
}

void UnmapModuleData(Driver& d, std::uintptr_t base) {
  const auto it = d.allocations.find(base);
  if (it != d.allocations.end() && it->second.kind == AllocationKind::module_data) ReleaseAllocation(d, it);
}

}  // namespace fakecuda::driver

using namespace fakecuda::driver;
namespace model = fakecuda::model;
namespace state = fakecuda::state;

// ---- allocation -------------------------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* pointer, size_t bytes) {
  FAKECUDA_ENTER("cuMemAlloc_v2");
  if (pointer == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  return AllocateDevice(d, "cuMemAlloc_v2", pointer, bytes, AllocationKind::device, bytes);
}

// ---- the private export table ------------------------------------------------------------------------------------
// A stand-in for the driver's private interfaces (docs/fakecuda.md, "A private export table"): allocation and free
// through functions no exported symbol names, so that an interposer (the shim) never sees them -- as with the real
// driver's export tables, which the CUDA runtime uses. Bypass tests take it through cuGetExportTable.

namespace {

CUresult PrivateAlloc(CUdeviceptr* pointer, size_t bytes) {
  FAKECUDA_ENTER("cuGetExportTable");
  if (pointer == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  return AllocateDevice(d, "private alloc", pointer, bytes, AllocationKind::device, bytes);
}

CUresult PrivateFree(CUdeviceptr pointer);

struct PrivateTable {
  std::size_t size;
  CUresult (*alloc)(CUdeviceptr*, size_t);
  CUresult (*free)(CUdeviceptr);
};
const PrivateTable kPrivateTable{sizeof(PrivateTable), &PrivateAlloc, &PrivateFree};

}  // namespace

namespace fakecuda::driver {
const void* PrivateExportTable() { return &kPrivateTable; }
}  // namespace fakecuda::driver

FAKECUDA_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr* pointer, size_t* pitch, size_t width, size_t height,
                                            unsigned int element_bytes) {
  FAKECUDA_ENTER("cuMemAllocPitch_v2");
  if (pointer == nullptr || pitch == nullptr || width == 0 || height == 0) return CUDA_ERROR_INVALID_VALUE;
  if (element_bytes != 4 && element_bytes != 8 && element_bytes != 16) return CUDA_ERROR_INVALID_VALUE;
  const std::size_t aligned = (width + 511) / 512 * 512;  // rows aligned to 512 bytes
  std::size_t bytes = 0;
  if (aligned < width || __builtin_mul_overflow(aligned, height, &bytes)) return CUDA_ERROR_OUT_OF_MEMORY;  // > any GPU
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  const CUresult r = AllocateDevice(d, "cuMemAllocPitch_v2", pointer, bytes, AllocationKind::pitch, bytes);
  if (r == CUDA_SUCCESS) *pitch = aligned;
  return r;
}

FAKECUDA_EXPORT CUresult cuMemAllocManaged(CUdeviceptr* pointer, size_t bytes, unsigned int flags) {
  FAKECUDA_ENTER("cuMemAllocManaged");
  if (pointer == nullptr || bytes == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  return AllocateDevice(d, "cuMemAllocManaged", pointer, bytes, AllocationKind::managed, bytes);
}

namespace {

CUresult FreeDevice(CUdeviceptr pointer) {
  if (pointer == 0) return CUDA_SUCCESS;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = d.allocations.find(static_cast<std::uintptr_t>(pointer));
  if (it == d.allocations.end() || it->second.kind == AllocationKind::host ||
      it->second.kind == AllocationKind::module_data || it->second.cached) {
    return CUDA_ERROR_INVALID_VALUE;  // unknown, host, a module's variables, or a stream-ordered block already freed
  }
  if (it->second.pool != nullptr) {
    Pool& pool = *it->second.pool;
    pool.used_bytes -= std::min(pool.used_bytes, it->second.charged_bytes);
    pool.reserved_bytes -= std::min(pool.reserved_bytes, it->second.charged_bytes);
  }
  ReleaseAllocation(d, it);
  return CUDA_SUCCESS;
}

CUresult PrivateFree(CUdeviceptr pointer) {
  FAKECUDA_ENTER("cuGetExportTable");
  return FreeDevice(pointer);
}

}  // namespace

FAKECUDA_EXPORT CUresult cuMemFree_v2(CUdeviceptr pointer) {
  FAKECUDA_ENTER("cuMemFree_v2");
  return FreeDevice(pointer);
}

FAKECUDA_EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  FAKECUDA_ENTER("cuMemGetInfo_v2");
  if (free_bytes == nullptr && total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  state::MachineLock lock(*d.attachment);
  state::ReapDeadProcesses(*d.attachment, state::MonotonicNs(), false);
  // One NULL output is skipped, not rejected: OptiX asks for the total alone (HAMi-core#321, #333).
  if (total_bytes != nullptr) *total_bytes = model::CudaTotalBytes(lock.machine().config.devices[c->device]);
  if (free_bytes != nullptr) *free_bytes = model::CudaFreeBytes(lock.machine(), c->device);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* bytes, CUdeviceptr pointer) {
  FAKECUDA_ENTER("cuMemGetAddressRange_v2");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = Containing(d, static_cast<std::uintptr_t>(pointer));
  if (it != d.allocations.end() && it->second.kind != AllocationKind::host) {
    if (base != nullptr) *base = it->first;
    if (bytes != nullptr) *bytes = it->second.bytes;
    return CUDA_SUCCESS;
  }
  // VMM: the mapping the address falls in (NCCL finds the base of its buffers this way).
  auto m = d.mappings.upper_bound(static_cast<std::uintptr_t>(pointer));
  if (m == d.mappings.begin()) return CUDA_ERROR_NOT_FOUND;
  --m;
  if (static_cast<std::uintptr_t>(pointer) - m->first >= m->second.bytes) return CUDA_ERROR_NOT_FOUND;
  if (base != nullptr) *base = m->first;
  if (bytes != nullptr) *bytes = m->second.bytes;
  return CUDA_SUCCESS;
}

namespace {

CUresult AllocateHost(void** pointer, size_t bytes, unsigned int flags) {
  if (pointer == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (CurrentContext(d) == nullptr) return NoContextError(d);
  void* p = MapAnonymous(bytes);
  if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  Allocation a;
  a.bytes = bytes;
  a.mapped_bytes = PageRound(bytes);
  a.kind = AllocationKind::host;
  a.host_flags = flags;
  a.context = CurrentContext(d);
  d.allocations[reinterpret_cast<std::uintptr_t>(p)] = a;
  *pointer = p;
  return CUDA_SUCCESS;
}

}  // namespace

FAKECUDA_EXPORT CUresult cuMemAllocHost_v2(void** pointer, size_t bytes) {
  FAKECUDA_ENTER("cuMemAllocHost_v2");
  return AllocateHost(pointer, bytes, 0);
}

FAKECUDA_EXPORT CUresult cuMemHostAlloc(void** pointer, size_t bytes, unsigned int flags) {
  FAKECUDA_ENTER("cuMemHostAlloc");
  constexpr unsigned int kValid = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
  if ((flags & ~kValid) != 0) return CUDA_ERROR_INVALID_VALUE;
  return AllocateHost(pointer, bytes, flags);
}

FAKECUDA_EXPORT CUresult cuMemHostGetFlags(unsigned int* flags, void* pointer) {
  FAKECUDA_ENTER("cuMemHostGetFlags");
  if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = Containing(d, reinterpret_cast<std::uintptr_t>(pointer));
  if (it == d.allocations.end() || it->second.kind != AllocationKind::host) return CUDA_ERROR_INVALID_VALUE;
  // Unified addressing: every pinned allocation is mapped and portable.
  *flags = it->second.host_flags | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr pointer) {
  FAKECUDA_ENTER("cuPointerGetAttribute");
  if (data == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = Containing(d, static_cast<std::uintptr_t>(pointer));
  if (it == d.allocations.end()) return CUDA_ERROR_INVALID_VALUE;  // not memory the driver knows
  const Allocation& a = it->second;
  const bool host = a.kind == AllocationKind::host;
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      *static_cast<CUcontext*>(data) = reinterpret_cast<CUcontext>(a.context);
      break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      *static_cast<unsigned int*>(data) = host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      *static_cast<CUdeviceptr*>(data) = pointer;
      break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      if (!host && a.kind != AllocationKind::managed) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<void**>(data) = reinterpret_cast<void*>(pointer);
      break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      *static_cast<unsigned int*>(data) = a.kind == AllocationKind::managed ? 1 : 0;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      *static_cast<int*>(data) = a.context != nullptr ? static_cast<int>(a.context->ordinal) : 0;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      *static_cast<CUdeviceptr*>(data) = it->first;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      *static_cast<size_t*>(data) = a.bytes;
      break;
    case CU_POINTER_ATTRIBUTE_MAPPED:
      *static_cast<unsigned int*>(data) = 1;
      break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      *static_cast<unsigned long long*>(data) = it->first;
      break;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
      *static_cast<unsigned int*>(data) = 1;
      break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
      *static_cast<unsigned int*>(data) = host ? 0 : 1;
      break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
      *static_cast<unsigned int*>(data) = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE;
      break;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
      if (a.pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<CUmemoryPool*>(data) = reinterpret_cast<CUmemoryPool>(a.pool);
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuPointerGetAttributes(unsigned int count, CUpointer_attribute* attributes, void** data,
                                                CUdeviceptr pointer) {
  FAKECUDA_ENTER("cuPointerGetAttributes");
  if (count == 0 || attributes == nullptr || data == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (unsigned int i = 0; i < count; ++i) {
    // Unlike the single query, an unknown pointer is not an error here: attributes read as zero/NULL.
    if (cuPointerGetAttribute(data[i], attributes[i], pointer) != CUDA_SUCCESS && data[i] != nullptr) {
      if (attributes[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
        *static_cast<unsigned int*>(data[i]) = 0;
      else if (attributes[i] == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
        *static_cast<int*>(data[i]) = -2;
      else
        *static_cast<void**>(data[i]) = nullptr;
    }
  }
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemFreeHost(void* pointer) {
  FAKECUDA_ENTER("cuMemFreeHost");
  if (pointer == nullptr) return CUDA_SUCCESS;  // free(NULL) semantics, as the real driver
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = d.allocations.find(reinterpret_cast<std::uintptr_t>(pointer));
  if (it == d.allocations.end() || it->second.kind != AllocationKind::host || it->second.registered) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  ForgetValueWaitsIn(it->first, it->first + it->second.bytes);
  ReleaseAllocation(d, it);
  return CUDA_SUCCESS;
}

// Page-locks the application's own memory: no device memory is taken (H100: 256 MiB registered, NVML's figure for the
// process did not move). Kernels do not run, so nothing but the bookkeeping changes: the range becomes pinned host
// memory that copies, cuMemHostGetDevicePointer and cuPointerGetAttribute know.
FAKECUDA_EXPORT CUresult cuMemHostRegister_v2(void* pointer, size_t bytes, unsigned int flags) {
  FAKECUDA_ENTER("cuMemHostRegister_v2");
  constexpr unsigned int kValid = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                                  CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY;
  if (pointer == nullptr || bytes == 0 || (flags & ~kValid) != 0) return CUDA_ERROR_INVALID_VALUE;
  const auto begin = reinterpret_cast<std::uintptr_t>(pointer);
  if (bytes > UINTPTR_MAX - begin) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Context* c = CurrentContext(d);
  if (c == nullptr) return NoContextError(d);
  // Any overlap with memory the driver already knows (pinned, registered or device) is refused.
  const auto next = d.allocations.lower_bound(begin);
  if (Containing(d, begin) != d.allocations.end() || (next != d.allocations.end() && next->first < begin + bytes)) {
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  }
  Allocation a;
  a.bytes = bytes;
  a.kind = AllocationKind::host;
  a.host_flags = flags;
  a.registered = true;
  a.context = c;
  d.allocations[begin] = a;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemHostUnregister(void* pointer) {
  FAKECUDA_ENTER("cuMemHostUnregister");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  if (CurrentContext(d) == nullptr) return NoContextError(d);
  auto it = d.allocations.find(reinterpret_cast<std::uintptr_t>(pointer));
  if (it == d.allocations.end() || !it->second.registered) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  ForgetValueWaitsIn(it->first, it->first + it->second.bytes);
  ReleaseAllocation(d, it);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* device_pointer, void* host, unsigned int flags) {
  FAKECUDA_ENTER("cuMemHostGetDevicePointer_v2");
  if (device_pointer == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = Containing(d, reinterpret_cast<std::uintptr_t>(host));
  if (it == d.allocations.end() || it->second.kind != AllocationKind::host) return CUDA_ERROR_INVALID_VALUE;
  *device_pointer = reinterpret_cast<CUdeviceptr>(host);  // unified addressing: the same address
  return CUDA_SUCCESS;
}

// ---- copies and memsets -------------------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) {
  return Copy("cuMemcpyHtoD_v2", dst, Side::device, reinterpret_cast<std::uintptr_t>(src), Side::host, bytes, nullptr,
              false, true);
}
FAKECUDA_EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) {
  return Copy("cuMemcpyDtoH_v2", reinterpret_cast<std::uintptr_t>(dst), Side::host, src, Side::device, bytes, nullptr,
              false, true);
}
FAKECUDA_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  return Copy("cuMemcpyDtoD_v2", dst, Side::device, src, Side::device, bytes, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  return Copy("cuMemcpy", dst, Side::any, src, Side::any, bytes, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  return Copy("cuMemcpyHtoDAsync_v2", dst, Side::device, reinterpret_cast<std::uintptr_t>(src), Side::host, bytes,
              stream, false, false);
}
FAKECUDA_EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return Copy("cuMemcpyDtoHAsync_v2", reinterpret_cast<std::uintptr_t>(dst), Side::host, src, Side::device, bytes,
              stream, false, false);
}
FAKECUDA_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return Copy("cuMemcpyDtoDAsync_v2", dst, Side::device, src, Side::device, bytes, stream, false, false);
}
FAKECUDA_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return Copy("cuMemcpyAsync", dst, Side::any, src, Side::any, bytes, stream, false, false);
}
// Per-thread default stream variants of the copies (the _ptds/_ptsz symbols).
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void* src,
                                                                                size_t bytes) {
  return Copy("cuMemcpyHtoD_v2_ptds", dst, Side::device, reinterpret_cast<std::uintptr_t>(src), Side::host, bytes,
              nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpyDtoH_v2_ptds(void* dst, CUdeviceptr src,
                                                                                size_t bytes) {
  return Copy("cuMemcpyDtoH_v2_ptds", reinterpret_cast<std::uintptr_t>(dst), Side::host, src, Side::device, bytes,
              nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src,
                                                                                size_t bytes) {
  return Copy("cuMemcpyDtoD_v2_ptds", dst, Side::device, src, Side::device, bytes, nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src,
                                                                         size_t bytes) {
  return Copy("cuMemcpy_ptds", dst, Side::any, src, Side::any, bytes, nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void* src,
                                                                                     size_t bytes, CUstream stream) {
  return Copy("cuMemcpyHtoDAsync_v2_ptsz", dst, Side::device, reinterpret_cast<std::uintptr_t>(src), Side::host, bytes,
              stream, true, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpyDtoHAsync_v2_ptsz(void* dst, CUdeviceptr src,
                                                                                     size_t bytes, CUstream stream) {
  return Copy("cuMemcpyDtoHAsync_v2_ptsz", reinterpret_cast<std::uintptr_t>(dst), Side::host, src, Side::device, bytes,
              stream, true, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src,
                                                                                     size_t bytes, CUstream stream) {
  return Copy("cuMemcpyDtoDAsync_v2_ptsz", dst, Side::device, src, Side::device, bytes, stream, true, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src,
                                                                              size_t bytes, CUstream stream) {
  return Copy("cuMemcpyAsync_ptsz", dst, Side::any, src, Side::any, bytes, stream, true, false);
}

FAKECUDA_EXPORT CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D* copy) {
  return Copy2D("cuMemcpy2D_v2", copy, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D* copy) {
  return Copy2D("cuMemcpy2DUnaligned_v2", copy, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D* copy, CUstream stream) {
  return Copy2D("cuMemcpy2DAsync_v2", copy, stream, false, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D* copy) {
  return Copy2D("cuMemcpy2D_v2_ptds", copy, nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D* copy,
                                                                                   CUstream stream) {
  return Copy2D("cuMemcpy2DAsync_v2_ptsz", copy, stream, true, false);
}

FAKECUDA_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t count) {
  return Memset<unsigned char>("cuMemsetD8_v2", dst, count, value, count, 1, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr dst, unsigned short value, size_t count) {
  return Memset<unsigned short>("cuMemsetD16_v2", dst, count * 2, value, count, 1, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int value, size_t count) {
  return Memset<unsigned int>("cuMemsetD32_v2", dst, count * 4, value, count, 1, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, CUstream stream) {
  return Memset<unsigned char>("cuMemsetD8Async", dst, count, value, count, 1, stream, false, false);
}
FAKECUDA_EXPORT CUresult cuMemsetD16Async(CUdeviceptr dst, unsigned short value, size_t count, CUstream stream) {
  return Memset<unsigned short>("cuMemsetD16Async", dst, count * 2, value, count, 1, stream, false, false);
}
FAKECUDA_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream) {
  return Memset<unsigned int>("cuMemsetD32Async", dst, count * 4, value, count, 1, stream, false, false);
}
FAKECUDA_EXPORT CUresult cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, unsigned char value, size_t width,
                                         size_t height) {
  return Memset<unsigned char>("cuMemsetD2D8_v2", dst, pitch, value, width, height, nullptr, false, true);
}
FAKECUDA_EXPORT CUresult cuMemsetD2D32_v2(CUdeviceptr dst, size_t pitch, unsigned int value, size_t width,
                                          size_t height) {
  return Memset<unsigned int>("cuMemsetD2D32_v2", dst, pitch, value, width, height, nullptr, false, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char value,
                                                                              size_t count) {
  return Memset<unsigned char>("cuMemsetD8_v2_ptds", dst, count, value, count, 1, nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemsetD16_v2_ptds(CUdeviceptr dst, unsigned short value,
                                                                               size_t count) {
  return Memset<unsigned short>("cuMemsetD16_v2_ptds", dst, count * 2, value, count, 1, nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemsetD32_v2_ptds(CUdeviceptr dst, unsigned int value,
                                                                               size_t count) {
  return Memset<unsigned int>("cuMemsetD32_v2_ptds", dst, count * 4, value, count, 1, nullptr, true, true);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemsetD8Async_ptsz(CUdeviceptr dst, unsigned char value,
                                                                                size_t count, CUstream stream) {
  return Memset<unsigned char>("cuMemsetD8Async_ptsz", dst, count, value, count, 1, stream, true, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemsetD16Async_ptsz(CUdeviceptr dst, unsigned short value,
                                                                                 size_t count, CUstream stream) {
  return Memset<unsigned short>("cuMemsetD16Async_ptsz", dst, count * 2, value, count, 1, stream, true, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemsetD32Async_ptsz(CUdeviceptr dst, unsigned int value,
                                                                                 size_t count, CUstream stream) {
  return Memset<unsigned int>("cuMemsetD32Async_ptsz", dst, count * 4, value, count, 1, stream, true, false);
}

// ---- stream-ordered allocation ---------------------------------------------------------------------------------------

namespace {

CUresult AllocAsync(const char* api, CUdeviceptr* pointer, size_t bytes, CUstream stream, bool per_thread) {
  FAKECUDA_ENTER(api);
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  ResolvedStream rs;
  if (const CUresult r = ResolveStream(d, stream, per_thread, rs); r != CUDA_SUCCESS) return r;
  return AllocateFromPool(d, api, pointer, bytes, *CurrentPool(d, rs.context->device), stream, per_thread);
}

CUresult AllocFromPoolAsync(const char* api, CUdeviceptr* pointer, size_t bytes, CUmemoryPool pool_handle,
                            CUstream stream, bool per_thread) {
  FAKECUDA_ENTER(api);
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Pool* pool = Lookup<Pool>(d, pool_handle, Kind::pool);
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return AllocateFromPool(d, api, pointer, bytes, *pool, stream, per_thread);
}

}  // namespace

FAKECUDA_EXPORT CUresult cuMemAllocAsync(CUdeviceptr* pointer, size_t bytes, CUstream stream) {
  return AllocAsync("cuMemAllocAsync", pointer, bytes, stream, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemAllocAsync_ptsz(CUdeviceptr* pointer, size_t bytes,
                                                                                CUstream stream) {
  return AllocAsync("cuMemAllocAsync_ptsz", pointer, bytes, stream, true);
}
FAKECUDA_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* pointer, size_t bytes, CUmemoryPool pool,
                                                 CUstream stream) {
  return AllocFromPoolAsync("cuMemAllocFromPoolAsync", pointer, bytes, pool, stream, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* pointer,
                                                                                        size_t bytes, CUmemoryPool pool,
                                                                                        CUstream stream) {
  return AllocFromPoolAsync("cuMemAllocFromPoolAsync_ptsz", pointer, bytes, pool, stream, true);
}
FAKECUDA_EXPORT CUresult cuMemFreeAsync(CUdeviceptr pointer, CUstream stream) {
  FAKECUDA_ENTER("cuMemFreeAsync");
  return FreeAsync(pointer, stream, false);
}
extern "C" __attribute__((visibility("default"))) CUresult cuMemFreeAsync_ptsz(CUdeviceptr pointer, CUstream stream) {
  FAKECUDA_ENTER("cuMemFreeAsync_ptsz");
  return FreeAsync(pointer, stream, true);
}

FAKECUDA_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceGetDefaultMemPool");
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> guard(d.mutex);
  *pool = reinterpret_cast<CUmemoryPool>(DefaultPool(d, physical));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice device) {
  FAKECUDA_ENTER("cuDeviceGetMemPool");
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> guard(d.mutex);
  *pool = reinterpret_cast<CUmemoryPool>(CurrentPool(d, physical));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuDeviceSetMemPool(CUdevice device, CUmemoryPool handle) {
  FAKECUDA_ENTER("cuDeviceSetMemPool");
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!PhysicalDevice(d, device, physical)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> guard(d.mutex);
  Pool* pool = Lookup<Pool>(d, handle, Kind::pool);
  if (pool == nullptr || pool->device != physical) return CUDA_ERROR_INVALID_VALUE;
  d.current_pool[physical] = pool;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) {
  FAKECUDA_ENTER("cuMemPoolCreate");
  if (pool == nullptr || props == nullptr || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED)
    return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::uint32_t physical = 0;
  if (!DeviceLocation(d, props->location, physical)) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> guard(d.mutex);
  auto* p = new Pool();
  p->device = physical;
  *pool = reinterpret_cast<CUmemoryPool>(Register(d, p));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool handle) {
  FAKECUDA_ENTER("cuMemPoolDestroy");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Pool* pool = Lookup<Pool>(d, handle, Kind::pool);
  if (pool == nullptr || pool->is_default) return CUDA_ERROR_INVALID_VALUE;
  TrimPool(d, *pool, 0);
  // Blocks still in use keep their memory until freed; they no longer belong to a pool.
  for (auto& [address, allocation] : d.allocations) {
    if (allocation.pool == pool) allocation.pool = nullptr;
  }
  for (Pool*& current : d.current_pool) {
    if (current == pool) current = nullptr;
  }
  Unregister(d, pool);
  delete pool;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool handle, size_t keep_bytes) {
  FAKECUDA_ENTER("cuMemPoolTrimTo");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Pool* pool = Lookup<Pool>(d, handle, Kind::pool);
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  TrimPool(d, *pool, std::max<std::uint64_t>(keep_bytes, pool->used_bytes));
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool handle, CUmemPool_attribute attribute, void* value) {
  FAKECUDA_ENTER("cuMemPoolSetAttribute");
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Pool* pool = Lookup<Pool>(d, handle, Kind::pool);
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (attribute) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
      pool->reuse_follow_event = *static_cast<int*>(value);
      break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
      pool->reuse_opportunistic = *static_cast<int*>(value);
      break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
      pool->reuse_internal = *static_cast<int*>(value);
      break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
      pool->release_threshold = *static_cast<cuuint64_t*>(value);
      break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;  // may only be reset to 0
      pool->reserved_high = pool->reserved_bytes;
      break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
      pool->used_high = pool->used_bytes;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool handle, CUmemPool_attribute attribute, void* value) {
  FAKECUDA_ENTER("cuMemPoolGetAttribute");
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Pool* pool = Lookup<Pool>(d, handle, Kind::pool);
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (attribute) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
      *static_cast<int*>(value) = pool->reuse_follow_event;
      break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
      *static_cast<int*>(value) = pool->reuse_opportunistic;
      break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
      *static_cast<int*>(value) = pool->reuse_internal;
      break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
      *static_cast<cuuint64_t*>(value) = pool->release_threshold;
      break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
      *static_cast<cuuint64_t*>(value) = pool->reserved_bytes;
      break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
      *static_cast<cuuint64_t*>(value) = pool->reserved_high;
      break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
      *static_cast<cuuint64_t*>(value) = pool->used_bytes;
      break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
      *static_cast<cuuint64_t*>(value) = pool->used_high;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

// ---- arrays ----------------------------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuArrayCreate_v2(CUarray* array, const CUDA_ARRAY_DESCRIPTOR* desc) {
  FAKECUDA_ENTER("cuArrayCreate_v2");
  if (array == nullptr || desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUDA_ARRAY3D_DESCRIPTOR d3{};
  d3.Width = desc->Width;
  d3.Height = desc->Height;
  d3.Format = desc->Format;
  d3.NumChannels = desc->NumChannels;
  void* out = nullptr;
  const CUresult r = CreateArray("cuArrayCreate_v2", Kind::array, &out, d3, 1);
  if (r == CUDA_SUCCESS) *array = static_cast<CUarray>(out);
  return r;
}

FAKECUDA_EXPORT CUresult cuArray3DCreate_v2(CUarray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc) {
  FAKECUDA_ENTER("cuArray3DCreate_v2");
  if (array == nullptr || desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  void* out = nullptr;
  const CUresult r = CreateArray("cuArray3DCreate_v2", Kind::array, &out, *desc, 1);
  if (r == CUDA_SUCCESS) *array = static_cast<CUarray>(out);
  return r;
}

FAKECUDA_EXPORT CUresult cuArrayDestroy(CUarray array) {
  FAKECUDA_ENTER("cuArrayDestroy");
  return DestroyArray(array, Kind::array);
}

FAKECUDA_EXPORT CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR* desc, CUarray handle) {
  FAKECUDA_ENTER("cuArrayGetDescriptor_v2");
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Array* array = Lookup<Array>(d, handle, Kind::array);
  if (array == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  desc->Width = array->descriptor.Width;
  desc->Height = array->descriptor.Height;
  desc->Format = array->descriptor.Format;
  desc->NumChannels = array->descriptor.NumChannels;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuArray3DGetDescriptor_v2(CUDA_ARRAY3D_DESCRIPTOR* desc, CUarray handle) {
  FAKECUDA_ENTER("cuArray3DGetDescriptor_v2");
  if (desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  Array* array = Lookup<Array>(d, handle, Kind::array);
  if (array == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *desc = array->descriptor;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc,
                                                unsigned int levels) {
  FAKECUDA_ENTER("cuMipmappedArrayCreate");
  if (array == nullptr || desc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  void* out = nullptr;
  const CUresult r = CreateArray("cuMipmappedArrayCreate", Kind::mipmapped_array, &out, *desc, levels);
  if (r == CUDA_SUCCESS) *array = static_cast<CUmipmappedArray>(out);
  return r;
}

FAKECUDA_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray array) {
  FAKECUDA_ENTER("cuMipmappedArrayDestroy");
  return DestroyArray(reinterpret_cast<CUarray_st*>(array), Kind::mipmapped_array);
}

// ---- VMM -------------------------------------------------------------------------------------------------------

FAKECUDA_EXPORT CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                       CUmemAllocationGranularity_flags option) {
  FAKECUDA_ENTER("cuMemGetAllocationGranularity");
  if (granularity == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  if (const CUresult r = CheckProp(d, prop); r != CUDA_SUCCESS) return r;
  *granularity = kVmmGranularity;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t bytes,
                                     const CUmemAllocationProp* prop, unsigned long long flags) {
  FAKECUDA_ENTER("cuMemCreate");
  Driver& d = TheDriver();
  if (handle == nullptr || flags != 0 || bytes == 0 || bytes % kVmmGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (const CUresult r = CheckProp(d, prop); r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> guard(d.mutex);
  VmmHandle h;
  h.bytes = bytes;
  h.prop = *prop;
  std::uint32_t physical = 0;
  if (DeviceLocation(d, prop->location, physical)) {
    if (!ChargeDevice(d, physical, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    h.device = physical;
    h.charged_bytes = bytes;
  }
  h.memfd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
  if (h.memfd < 0 || ftruncate(h.memfd, static_cast<off_t>(bytes)) != 0) {
    if (h.memfd >= 0) close(h.memfd);
    if (h.charged_bytes > 0) UnchargeDevice(d, h.device, h.charged_bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUmemGenericAllocationHandle id = d.next_vmm_handle++;
  d.vmm_handles[id] = h;
  if (h.charged_bytes > 0)
    TraceAllocation("alloc", "cuMemCreate", h.device, h.charged_bytes, static_cast<std::uintptr_t>(id));
  *handle = id;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  FAKECUDA_ENTER("cuMemRelease");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = d.vmm_handles.find(handle);
  if (it == d.vmm_handles.end() || (it->second.released && it->second.retains == 0)) return CUDA_ERROR_INVALID_VALUE;
  if (it->second.retains > 0)
    --it->second.retains;
  else
    it->second.released = true;
  ReleaseVmmIfUnused(d, handle);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop,
                                                                CUmemGenericAllocationHandle handle) {
  FAKECUDA_ENTER("cuMemGetAllocationPropertiesFromHandle");
  if (prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = d.vmm_handles.find(handle);
  if (it == d.vmm_handles.end()) return CUDA_ERROR_INVALID_VALUE;
  *prop = it->second.prop;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemAddressReserve(CUdeviceptr* pointer, size_t bytes, size_t alignment, CUdeviceptr address,
                                             unsigned long long flags) {
  FAKECUDA_ENTER("cuMemAddressReserve");
  if (pointer == nullptr || bytes == 0 || bytes % kVmmGranularity != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (alignment != 0 && (alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  const std::size_t align = std::max(alignment, kVmmGranularity);
  // Reserve extra to align, then trim the ends: PROT_NONE costs no memory.
  void* hint = reinterpret_cast<void*>(address);
  void* raw = mmap(hint, bytes + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + align - 1) / align * align;
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t end = start + bytes + align;
  if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - (aligned + bytes));
  d.reservations[aligned] = bytes;
  *pointer = aligned;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemAddressFree(CUdeviceptr pointer, size_t bytes) {
  FAKECUDA_ENTER("cuMemAddressFree");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = d.reservations.find(static_cast<std::uintptr_t>(pointer));
  if (it == d.reservations.end() || it->second != bytes) return CUDA_ERROR_INVALID_VALUE;
  auto mapped = d.mappings.lower_bound(it->first);
  if (mapped != d.mappings.end() && mapped->first < it->first + it->second)
    return CUDA_ERROR_INVALID_VALUE;  // unmap first
  munmap(reinterpret_cast<void*>(it->first), it->second);
  d.reservations.erase(it);
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemMap(CUdeviceptr pointer, size_t bytes, size_t offset, CUmemGenericAllocationHandle handle,
                                  unsigned long long flags) {
  FAKECUDA_ENTER("cuMemMap");
  if (flags != 0 || bytes == 0 || bytes % kVmmGranularity != 0 || offset % kVmmGranularity != 0)
    return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto h = d.vmm_handles.find(handle);
  if (h == d.vmm_handles.end() || h->second.released) return CUDA_ERROR_INVALID_VALUE;
  if (offset + bytes > h->second.bytes) return CUDA_ERROR_INVALID_VALUE;
  const auto address = static_cast<std::uintptr_t>(pointer);
  if (!InsideReservation(d, address, bytes)) return CUDA_ERROR_INVALID_VALUE;
  auto overlap = d.mappings.lower_bound(address);
  if (overlap != d.mappings.end() && overlap->first < address + bytes) return CUDA_ERROR_INVALID_VALUE;
  if (overlap != d.mappings.begin() && std::prev(overlap)->first + std::prev(overlap)->second.bytes > address) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  void* p = mmap(reinterpret_cast<void*>(address), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second.memfd,
                 static_cast<off_t>(offset));
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  d.mappings[address] = VmmMapping{bytes, handle, false};
  ++h->second.mappings;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemUnmap(CUdeviceptr pointer, size_t bytes) {
  FAKECUDA_ENTER("cuMemUnmap");
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = d.mappings.find(static_cast<std::uintptr_t>(pointer));
  if (it == d.mappings.end() || it->second.bytes != bytes) return CUDA_ERROR_INVALID_VALUE;
  // Back to a PROT_NONE reservation.
  mmap(reinterpret_cast<void*>(it->first), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
       -1, 0);
  const CUmemGenericAllocationHandle handle = it->second.handle;
  d.mappings.erase(it);
  auto h = d.vmm_handles.find(handle);
  if (h != d.vmm_handles.end()) {
    --h->second.mappings;
    ReleaseVmmIfUnused(d, handle);
  }
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemSetAccess(CUdeviceptr pointer, size_t bytes, const CUmemAccessDesc* desc, size_t count) {
  FAKECUDA_ENTER("cuMemSetAccess");
  if (desc == nullptr || count == 0) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  bool writable = false, readable = false;
  for (std::size_t i = 0; i < count; ++i) {
    std::uint32_t physical = 0;
    if (!DeviceLocation(d, desc[i].location, physical)) return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      writable = readable = true;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ)
      readable = true;
    else if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE)
      return CUDA_ERROR_INVALID_VALUE;
  }
  const auto start = static_cast<std::uintptr_t>(pointer);
  // Every byte of the range must be mapped.
  std::uintptr_t cursor = start;
  for (auto it = d.mappings.upper_bound(start) == d.mappings.begin() ? d.mappings.begin()
                                                                     : std::prev(d.mappings.upper_bound(start));
       it != d.mappings.end() && it->first < start + bytes; ++it) {
    if (it->first > cursor) return CUDA_ERROR_INVALID_VALUE;
    cursor = std::max(cursor, it->first + it->second.bytes);
  }
  if (cursor < start + bytes) return CUDA_ERROR_INVALID_VALUE;
  const int protection = writable ? PROT_READ | PROT_WRITE : (readable ? PROT_READ : PROT_NONE);
  if (mprotect(reinterpret_cast<void*>(start), bytes, protection) != 0) return CUDA_ERROR_INVALID_VALUE;
  for (auto it = d.mappings.lower_bound(start); it != d.mappings.end() && it->first < start + bytes; ++it) {
    it->second.accessible = readable;
  }
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr pointer) {
  FAKECUDA_ENTER("cuMemGetAccess");
  if (flags == nullptr || location == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  std::uint32_t physical = 0;
  if (!DeviceLocation(d, *location, physical)) return CUDA_ERROR_INVALID_DEVICE;
  auto it = d.mappings.upper_bound(static_cast<std::uintptr_t>(pointer));
  if (it == d.mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (static_cast<std::uintptr_t>(pointer) >= it->first + it->second.bytes) return CUDA_ERROR_INVALID_VALUE;
  *flags = it->second.accessible ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  return CUDA_SUCCESS;
}

FAKECUDA_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* address) {
  FAKECUDA_ENTER("cuMemRetainAllocationHandle");
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Driver& d = TheDriver();
  std::lock_guard<std::mutex> guard(d.mutex);
  auto it = d.mappings.upper_bound(reinterpret_cast<std::uintptr_t>(address));
  if (it == d.mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (reinterpret_cast<std::uintptr_t>(address) >= it->first + it->second.bytes) return CUDA_ERROR_INVALID_VALUE;
  auto h = d.vmm_handles.find(it->second.handle);
  if (h == d.vmm_handles.end()) return CUDA_ERROR_INVALID_VALUE;
  // A retained handle needs its own cuMemRelease: one more reference, whatever was released before.
  ++h->second.retains;
  *handle = it->second.handle;
  return CUDA_SUCCESS;
}
