// The memory cap per allocation API, run in a process under the shim (LD_PRELOAD) with a 1 GiB limit: the cap holds,
// the error is CUDA_ERROR_OUT_OF_MEMORY, nothing leaks, frees give the memory back, and every view agrees.
#include <dlfcn.h>

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "shim_support.h"

namespace vgpu::shimtest {
namespace {

// One allocation API driven by size: `allocate` keeps what it made, `free_all` gives all of it back.
struct Allocator {
  std::uint64_t granularity = 512;  // sizes asked for are multiples of it
  std::function<CUresult(std::uint64_t bytes)> allocate;
  std::function<CUresult()> free_all;
};

class Slice : public testing::Test {
 protected:
  void SetUp() override {
    limit_ = ConfiguredLimit();
    ASSERT_GT(limit_, 0u) << "the registration sets SHIM_LIMIT_BYTES with CUDA_DEVICE_MEMORY_LIMIT";
    ASSERT_CU_OK(cuInit(0));
    ASSERT_CU_OK(cuDeviceGet(&device_, 0));
    ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context_, device_));
    ASSERT_CU_OK(cuCtxSetCurrent(context_));
    base_ = ReadViews();
    ExpectViewsAgree(base_, limit_);
  }

  void TearDown() override {
    if (context_ != nullptr) {
      cuCtxSynchronize();
      cuCtxSetCurrent(nullptr);
      EXPECT_CU_OK(cuDevicePrimaryCtxRelease(device_));
    }
  }

  // Allocates 64 MiB and checks that it is counted; asks for one granule more than is left (OOM, nothing leaked in
  // the slice or in the driver); fills what is left to the granule; frees everything: back to the baseline.
  void CheckCap(const Allocator& api) {
    const std::uint64_t first = 64 * kMiB;
    ASSERT_CU_OK(api.allocate(first));
    const Views one = ReadViews();
    ExpectViewsAgree(one, limit_);
    EXPECT_EQ(one.used(), base_.used() + first) << "the allocation is not counted as what it costs";

    const std::uint64_t left = one.cu_free;
    EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, api.allocate(left + api.granularity)) << "one granule past the limit";
    const Views refused = ReadViews();
    EXPECT_EQ(refused.used(), one.used()) << "a refused allocation left a charge behind";
    EXPECT_EQ(refused.driver_own, one.driver_own) << "a refused allocation left driver memory behind";

    const std::uint64_t fill = left / api.granularity * api.granularity;
    ASSERT_CU_OK(api.allocate(fill)) << "all that cuMemGetInfo says is free must be allocatable";
    const Views full = ReadViews();
    ExpectViewsAgree(full, limit_);
    EXPECT_EQ(full.cu_free, left - fill);
    EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, api.allocate(api.granularity + (left - fill))) << "past a full slice";

    ASSERT_CU_OK(api.free_all());
    const Views end = ReadViews();
    ExpectViewsAgree(end, limit_);
    EXPECT_EQ(end.used(), base_.used()) << "frees did not give everything back";
  }

  std::uint64_t limit_ = 0;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  Views base_;
};

// ---- contexts ---------------------------------------------------------------------------------------------

TEST_F(Slice, PrimaryContextCostsItsOverhead) {
  EXPECT_GT(base_.used(), 0u) << "the context's own memory is not counted";
  if (RunningOnFakecuda()) {
    EXPECT_EQ(base_.used(), kH100ContextBytes) << "fakecuda's H100 context is 518 MiB";
  }
}

TEST_F(Slice, ContextPastTheLimitIsOutOfMemory) {
  // 518 MiB are taken by the primary context; a second one does not fit in 1 GiB.
  ASSERT_GT(2 * base_.used(), limit_);
  CUcontext second = nullptr;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cuCtxCreate(&second, nullptr, 0, device_));
  ASSERT_CU_OK(cuCtxSetCurrent(context_));
  const Views after = ReadViews();
  ExpectViewsAgree(after, limit_);
  EXPECT_EQ(after.used(), base_.used());
  EXPECT_EQ(after.driver_own, base_.driver_own) << "the refused context exists in the driver";
}

TEST_F(Slice, ContextPastTheLimitIsOutOfMemoryThroughCtxCreateV2) {
  // cuCtxCreate_v2 is what binaries built with CUDA 12 headers call (cuda.h 13 maps cuCtxCreate to _v4).
  using CtxCreateV2 = CUresult (*)(CUcontext*, unsigned int, CUdevice);
  auto create = reinterpret_cast<CtxCreateV2>(dlsym(RTLD_DEFAULT, "cuCtxCreate_v2"));
  ASSERT_NE(create, nullptr);
  CUcontext second = nullptr;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, create(&second, 0, device_));
  ASSERT_CU_OK(cuCtxSetCurrent(context_));
  EXPECT_EQ(ReadViews().driver_own, base_.driver_own) << "the refused context exists in the driver";
}

TEST(Context, CreatedContextsAreChargedAndDestroyGivesBackTheirMemory) {
  const std::uint64_t limit = ConfiguredLimit();
  ASSERT_CU_OK(cuInit(0));
  CUdevice device = 0;
  ASSERT_CU_OK(cuDeviceGet(&device, 0));
  Views none = ReadViews();  // no context: cuMemGetInfo fails, NVML still shows the slice
  EXPECT_EQ(none.v1.total, limit);
  EXPECT_EQ(none.v1.used, 0u);
  EXPECT_EQ(none.v2.used, 0u);

  using CtxCreateV2 = CUresult (*)(CUcontext*, unsigned int, CUdevice);
  auto create_v2 = reinterpret_cast<CtxCreateV2>(dlsym(RTLD_DEFAULT, "cuCtxCreate_v2"));
  ASSERT_NE(create_v2, nullptr);
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE(variant == 0 ? "cuCtxCreate_v4" : "cuCtxCreate_v2");
    CUcontext context = nullptr;
    ASSERT_CU_OK(variant == 0 ? cuCtxCreate(&context, nullptr, 0, device) : create_v2(&context, 0, device));
    const Views with_context = ReadViews();
    ExpectViewsAgree(with_context, limit);
    EXPECT_GT(with_context.used(), 0u);
    if (RunningOnFakecuda()) {
      EXPECT_EQ(with_context.used(), kH100ContextBytes);
    }
    CUdeviceptr pointer = 0;
    ASSERT_CU_OK(cuMemAlloc_v2(&pointer, 100 * kMiB));
    EXPECT_EQ(ReadViews().used(), with_context.used() + 100 * kMiB);
    // Destroying the context frees its allocations with it: all of it comes back.
    ASSERT_CU_OK(cuCtxDestroy(context));
    const Views gone = ReadViews();
    EXPECT_EQ(gone.v1.used, 0u) << "the context or its allocation is still charged after cuCtxDestroy";
    EXPECT_EQ(gone.v2.used, 0u);
    EXPECT_EQ(gone.driver_own, 0u);
  }
}

TEST(Context, HooksOnAThreadWithoutAContextReturnTheDriversError) {
  // HAMi-core#169/#187: hooks that assumed a current context crashed on worker threads.
  ASSERT_CU_OK(cuInit(0));
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context, 0));  // a context exists, but not on the worker thread
  std::vector<std::pair<const char*, CUresult>> results;
  std::thread([&] {
    CUdeviceptr pointer = 0;
    std::size_t pitch = 0, free_bytes = 0, total = 0;
    results.emplace_back("cuMemAlloc_v2", cuMemAlloc_v2(&pointer, kMiB));
    results.emplace_back("cuMemAllocManaged", cuMemAllocManaged(&pointer, kMiB, CU_MEM_ATTACH_GLOBAL));
    results.emplace_back("cuMemAllocPitch_v2", cuMemAllocPitch_v2(&pointer, &pitch, 512, 512, 4));
    results.emplace_back("cuMemAllocAsync", cuMemAllocAsync(&pointer, kMiB, nullptr));
    results.emplace_back("cuMemGetInfo_v2", cuMemGetInfo_v2(&free_bytes, &total));
    CUDA_ARRAY_DESCRIPTOR desc{};
    desc.Width = 64;
    desc.Height = 64;
    desc.Format = CU_AD_FORMAT_FLOAT;
    desc.NumChannels = 1;
    CUarray array = nullptr;
    results.emplace_back("cuArrayCreate_v2", cuArrayCreate_v2(&array, &desc));
  }).join();
  for (const auto& [call, result] : results) EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT, result) << call;
  const Views views = ReadViews();
  EXPECT_EQ(views.v1.used, views.driver_own) << "a refused call on a thread without a context left a charge";
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(0));
}

TEST(Context, ReleasingThePrimaryContextGivesBackItsMemory) {
  ASSERT_CU_OK(cuInit(0));
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context, 0));
  ASSERT_CU_OK(cuCtxSetCurrent(context));
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc_v2(&pointer, 32 * kMiB));
  EXPECT_GT(ReadViews().v1.used, 32 * kMiB);
  ASSERT_CU_OK(cuCtxSetCurrent(nullptr));
  ASSERT_CU_OK(cuDevicePrimaryCtxRelease(0));
  const Views gone = ReadViews();
  EXPECT_EQ(gone.v1.used, 0u) << "the primary context or its allocation is still charged";
  EXPECT_EQ(gone.driver_own, 0u);
  // The slice is whole again: a new primary context and an allocation of everything else fit.
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context, 0));
  ASSERT_CU_OK(cuCtxSetCurrent(context));
  std::size_t free_bytes = 0, total = 0;
  ASSERT_CU_OK(cuMemGetInfo_v2(&free_bytes, &total));
  EXPECT_CU_OK(cuMemAlloc_v2(&pointer, free_bytes));
  ASSERT_CU_OK(cuDevicePrimaryCtxRelease(0));
}

// ---- allocation APIs --------------------------------------------------------------------------------------

TEST_F(Slice, MemAllocCapHolds) {
  std::vector<CUdeviceptr> pointers;
  CheckCap({512,
            [&](std::uint64_t bytes) {
              CUdeviceptr p = 0;
              const CUresult r = cuMemAlloc_v2(&p, bytes);
              if (r == CUDA_SUCCESS) pointers.push_back(p);
              return r;
            },
            [&] {
              for (CUdeviceptr p : pointers) {
                if (const CUresult r = cuMemFree_v2(p); r != CUDA_SUCCESS) return r;
              }
              pointers.clear();
              return CUDA_SUCCESS;
            }});
}

TEST_F(Slice, MemAllocManagedCapHolds) {
  std::vector<CUdeviceptr> pointers;
  CheckCap({512,
            [&](std::uint64_t bytes) {
              CUdeviceptr p = 0;
              const CUresult r = cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL);
              if (r == CUDA_SUCCESS) pointers.push_back(p);
              return r;
            },
            [&] {
              for (CUdeviceptr p : pointers) {
                if (const CUresult r = cuMemFree_v2(p); r != CUDA_SUCCESS) return r;
              }
              pointers.clear();
              return CUDA_SUCCESS;
            }});
}

TEST_F(Slice, MemAllocPitchCapHolds) {
  // Rows of 512 bytes: the pitch the driver picks is the width itself.
  std::vector<CUdeviceptr> pointers;
  CheckCap({512,
            [&](std::uint64_t bytes) {
              CUdeviceptr p = 0;
              std::size_t pitch = 0;
              const CUresult r = cuMemAllocPitch_v2(&p, &pitch, 512, bytes / 512, 4);
              if (r == CUDA_SUCCESS) {
                pointers.push_back(p);
                EXPECT_EQ(pitch, 512u);
              }
              return r;
            },
            [&] {
              for (CUdeviceptr p : pointers) {
                if (const CUresult r = cuMemFree_v2(p); r != CUDA_SUCCESS) return r;
              }
              pointers.clear();
              return CUDA_SUCCESS;
            }});
}

TEST_F(Slice, ThePitchTheDriverReturnsIsWhatCounts) {
  // 513-byte rows: the driver pads each to its pitch (1024 on fakecuda); the padding is device memory.
  CUdeviceptr pointer = 0;
  std::size_t pitch = 0;
  const std::size_t width = 513, height = 1000;
  ASSERT_CU_OK(cuMemAllocPitch_v2(&pointer, &pitch, width, height, 4));
  ASSERT_GT(pitch, width);
  const Views after = ReadViews();
  ExpectViewsAgree(after, limit_);
  EXPECT_EQ(after.used() - base_.used(), (pitch * height + 511) / 512 * 512) << "pitch " << pitch;
  ASSERT_CU_OK(cuMemFree_v2(pointer));
  EXPECT_EQ(ReadViews().used(), base_.used());
}

TEST_F(Slice, PitchedRequestThatFitsOnlyWithoutPaddingIsOutOfMemory) {
  const std::uint64_t left = base_.cu_free;
  const std::size_t width = 513, height = left / 1000;  // width * height fits, pitch * height does not
  ASSERT_LE(width * height, left);
  CUdeviceptr pointer = 0;
  std::size_t pitch = 0;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cuMemAllocPitch_v2(&pointer, &pitch, width, height, 4));
  const Views after = ReadViews();
  EXPECT_EQ(after.used(), base_.used());
  EXPECT_EQ(after.driver_own, base_.driver_own) << "the refused pitched allocation is still held by the driver";
}

TEST_F(Slice, MemAllocAsyncCapHolds) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  std::vector<CUdeviceptr> pointers;
  CheckCap({512,
            [&](std::uint64_t bytes) {
              CUdeviceptr p = 0;
              const CUresult r = cuMemAllocAsync(&p, bytes, stream);
              if (r == CUDA_SUCCESS) pointers.push_back(p);
              return r;
            },
            [&] {
              for (CUdeviceptr p : pointers) {
                if (const CUresult r = cuMemFreeAsync(p, stream); r != CUDA_SUCCESS) return r;
              }
              pointers.clear();
              // The default pool's release threshold is 0: the synchronization gives its memory back to the device.
              return cuStreamSynchronize(stream);
            }});
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

CUmemoryPool CreatePool(CUdevice device, std::uint64_t release_threshold) {
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = device;
  CUmemoryPool pool = nullptr;
  EXPECT_CU_OK(cuMemPoolCreate(&pool, &props));
  cuuint64_t threshold = release_threshold;
  EXPECT_CU_OK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  return pool;
}

std::uint64_t PoolReserved(CUmemoryPool pool) {
  cuuint64_t reserved = 0;
  EXPECT_CU_OK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved));
  return reserved;
}

TEST_F(Slice, MemAllocFromPoolAsyncCapHolds) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUmemoryPool pool = CreatePool(device_, 0);
  std::vector<CUdeviceptr> pointers;
  CheckCap({512,
            [&](std::uint64_t bytes) {
              CUdeviceptr p = 0;
              const CUresult r = cuMemAllocFromPoolAsync(&p, bytes, pool, stream);
              if (r == CUDA_SUCCESS) pointers.push_back(p);
              return r;
            },
            [&] {
              for (CUdeviceptr p : pointers) {
                if (const CUresult r = cuMemFreeAsync(p, stream); r != CUDA_SUCCESS) return r;
              }
              pointers.clear();
              return cuStreamSynchronize(stream);
            }});
  EXPECT_CU_OK(cuMemPoolDestroy(pool));
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

TEST_F(Slice, FreedPoolBlocksCountUntilThePoolIsTrimmed) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUmemoryPool pool = CreatePool(device_, UINT64_MAX);  // keeps freed blocks until trimmed
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAllocFromPoolAsync(&pointer, 100 * kMiB, pool, stream));
  ASSERT_CU_OK(cuMemFreeAsync(pointer, stream));
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  ASSERT_EQ(PoolReserved(pool), 100 * kMiB) << "the pool no longer holds the freed block";
  const Views held = ReadViews();
  ExpectViewsAgree(held, limit_);
  EXPECT_EQ(held.used(), base_.used() + 100 * kMiB) << "a freed block the pool still holds is device memory";
  // The slice is full as far as the pool's cache goes: asking for the rest plus anything is refused.
  CUdeviceptr other = 0;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc_v2(&other, held.cu_free + 512));

  ASSERT_CU_OK(cuMemPoolTrimTo(pool, 0));
  EXPECT_EQ(PoolReserved(pool), 0u);
  const Views trimmed = ReadViews();
  ExpectViewsAgree(trimmed, limit_);
  EXPECT_EQ(trimmed.used(), base_.used()) << "trimmed pool memory is still counted";
  EXPECT_CU_OK(cuMemPoolDestroy(pool));
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

TEST_F(Slice, DestroyingAPoolGivesBackItsMemory) {
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUmemoryPool pool = CreatePool(device_, UINT64_MAX);
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAllocFromPoolAsync(&pointer, 64 * kMiB, pool, stream));
  ASSERT_CU_OK(cuMemFreeAsync(pointer, stream));
  ASSERT_CU_OK(cuStreamSynchronize(stream));
  EXPECT_EQ(ReadViews().used(), base_.used() + 64 * kMiB);
  ASSERT_CU_OK(cuMemPoolDestroy(pool));
  const Views gone = ReadViews();
  ExpectViewsAgree(gone, limit_);
  EXPECT_EQ(gone.used(), base_.used());
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

TEST_F(Slice, PoolReusesItsCachedBlockAtTheLimit) {
  // Memory a pool already holds is reused without new device memory: refusing it would be a false OOM.
  CUstream stream = nullptr;
  ASSERT_CU_OK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUmemoryPool pool = CreatePool(device_, UINT64_MAX);
  const std::uint64_t bytes = base_.cu_free / 2 / 512 * 512;
  CUdeviceptr first = 0, filler = 0, again = 0;
  ASSERT_CU_OK(cuMemAllocFromPoolAsync(&first, bytes, pool, stream));
  ASSERT_CU_OK(cuMemAllocFromPoolAsync(&filler, ReadViews().cu_free, pool, stream));  // the slice is now full
  EXPECT_EQ(ReadViews().cu_free, 0u);
  ASSERT_CU_OK(cuMemFreeAsync(first, stream));  // back to the pool, which keeps it (threshold: never release)
  const std::uint64_t reserved = PoolReserved(pool);
  EXPECT_CU_OK(cuMemAllocFromPoolAsync(&again, bytes, pool, stream))
      << "a cached block reused at the limit was refused";
  EXPECT_EQ(PoolReserved(pool), reserved) << "the pool grew instead of reusing its block";
  const Views full = ReadViews();
  ExpectViewsAgree(full, limit_);
  EXPECT_EQ(full.cu_free, 0u);
  if (again != 0) {
    EXPECT_CU_OK(cuMemFreeAsync(again, stream));
  }
  EXPECT_CU_OK(cuMemFreeAsync(filler, stream));
  EXPECT_CU_OK(cuStreamSynchronize(stream));
  EXPECT_CU_OK(cuMemPoolDestroy(pool));
  EXPECT_EQ(ReadViews().used(), base_.used());
  EXPECT_CU_OK(cuStreamDestroy(stream));
}

// ---- VMM ----------------------------------------------------------------------------------------------------

CUmemAllocationProp VmmProp(CUmemLocationType type, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  return prop;
}

TEST_F(Slice, MemCreateOnTheDeviceCapHolds) {
  const CUmemAllocationProp prop = VmmProp(CU_MEM_LOCATION_TYPE_DEVICE, device_);
  std::size_t granularity = 0;
  ASSERT_CU_OK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  std::vector<CUmemGenericAllocationHandle> handles;
  CheckCap({granularity,
            [&](std::uint64_t bytes) {
              CUmemGenericAllocationHandle h = 0;
              const CUresult r = cuMemCreate(&h, bytes, &prop, 0);
              if (r == CUDA_SUCCESS) handles.push_back(h);
              return r;
            },
            [&] {
              for (CUmemGenericAllocationHandle h : handles) {
                if (const CUresult r = cuMemRelease(h); r != CUDA_SUCCESS) return r;
              }
              handles.clear();
              return CUDA_SUCCESS;
            }});
}

TEST_F(Slice, MemCreateOnTheHostIsNotCharged) {
  const CUmemAllocationProp prop = VmmProp(CU_MEM_LOCATION_TYPE_HOST, 0);
  CUmemGenericAllocationHandle handle = 0;
  // More than the whole slice: host memory is not the GPU's.
  ASSERT_CU_OK(cuMemCreate(&handle, 2 * kGiB, &prop, 0));
  const Views after = ReadViews();
  ExpectViewsAgree(after, limit_);
  EXPECT_EQ(after.used(), base_.used()) << "host-located VMM memory was charged to the GPU slice";
  ASSERT_CU_OK(cuMemRelease(handle));
  EXPECT_EQ(ReadViews().used(), base_.used());
}

class VmmMapping : public Slice {
 protected:
  void MapOne(std::uint64_t bytes) {
    const CUmemAllocationProp prop = VmmProp(CU_MEM_LOCATION_TYPE_DEVICE, device_);
    ASSERT_CU_OK(cuMemCreate(&handle_, bytes, &prop, 0));
    ASSERT_CU_OK(cuMemAddressReserve(&address_, bytes, 0, 0, 0));
    ASSERT_CU_OK(cuMemMap(address_, bytes, 0, handle_, 0));
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ASSERT_CU_OK(cuMemSetAccess(address_, bytes, &access, 1));
    bytes_ = bytes;
  }
  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr address_ = 0;
  std::uint64_t bytes_ = 0;
};

TEST_F(VmmMapping, MappedMemoryCountsUntilUnmapped) {
  MapOne(64 * kMiB);
  ASSERT_CU_OK(cuMemRelease(handle_));  // the mapping keeps the memory alive
  const Views mapped = ReadViews();
  ExpectViewsAgree(mapped, limit_);
  EXPECT_EQ(mapped.used(), base_.used() + 64 * kMiB) << "released but still mapped memory must still count";
  ASSERT_CU_OK(cuMemUnmap(address_, bytes_));
  const Views unmapped = ReadViews();
  ExpectViewsAgree(unmapped, limit_);
  EXPECT_EQ(unmapped.used(), base_.used());
  EXPECT_CU_OK(cuMemAddressFree(address_, bytes_));
}

TEST_F(VmmMapping, RetainedHandleCountsUntilItsLastReferenceGoes) {
  MapOne(64 * kMiB);
  CUmemGenericAllocationHandle retained = 0;
  ASSERT_CU_OK(cuMemRetainAllocationHandle(&retained, reinterpret_cast<void*>(address_)));
  ASSERT_CU_OK(cuMemRelease(handle_));
  ASSERT_CU_OK(cuMemRelease(retained));  // the two references are gone; the mapping still holds the memory
  const Views mapped = ReadViews();
  ExpectViewsAgree(mapped, limit_);
  EXPECT_EQ(mapped.used(), base_.used() + 64 * kMiB) << "mapped memory stopped counting after a retain/release pair";
  ASSERT_CU_OK(cuMemUnmap(address_, bytes_));
  const Views unmapped = ReadViews();
  ExpectViewsAgree(unmapped, limit_);
  EXPECT_EQ(unmapped.used(), base_.used());
  EXPECT_CU_OK(cuMemAddressFree(address_, bytes_));
}

// ---- arrays -------------------------------------------------------------------------------------------------

TEST_F(Slice, ArrayCreateCapHolds) {
  // 1024 texels of 4 floats a row: 16 KiB rows.
  std::vector<CUarray> arrays;
  CheckCap({16 * 1024,
            [&](std::uint64_t bytes) {
              CUDA_ARRAY_DESCRIPTOR desc{};
              desc.Width = 1024;
              desc.Height = bytes / (16 * 1024);
              desc.Format = CU_AD_FORMAT_FLOAT;
              desc.NumChannels = 4;
              CUarray array = nullptr;
              const CUresult r = cuArrayCreate_v2(&array, &desc);
              if (r == CUDA_SUCCESS) arrays.push_back(array);
              return r;
            },
            [&] {
              for (CUarray a : arrays) {
                if (const CUresult r = cuArrayDestroy(a); r != CUDA_SUCCESS) return r;
              }
              arrays.clear();
              return CUDA_SUCCESS;
            }});
}

TEST_F(Slice, Array3DCreateCapHolds) {
  // 256 x 16 texels of 4 floats a slice: 64 KiB slices.
  std::vector<CUarray> arrays;
  CheckCap({64 * 1024,
            [&](std::uint64_t bytes) {
              CUDA_ARRAY3D_DESCRIPTOR desc{};
              desc.Width = 256;
              desc.Height = 16;
              desc.Depth = bytes / (64 * 1024);
              desc.Format = CU_AD_FORMAT_FLOAT;
              desc.NumChannels = 4;
              CUarray array = nullptr;
              const CUresult r = cuArray3DCreate_v2(&array, &desc);
              if (r == CUDA_SUCCESS) arrays.push_back(array);
              return r;
            },
            [&] {
              for (CUarray a : arrays) {
                if (const CUresult r = cuArrayDestroy(a); r != CUDA_SUCCESS) return r;
              }
              arrays.clear();
              return CUDA_SUCCESS;
            }});
}

TEST_F(Slice, MipmappedArrayIsChargedAndCapped) {
  CUDA_ARRAY3D_DESCRIPTOR desc{};
  desc.Width = 1024;
  desc.Height = 1024;
  desc.Format = CU_AD_FORMAT_FLOAT;
  desc.NumChannels = 1;
  CUmipmappedArray array = nullptr;
  ASSERT_CU_OK(cuMipmappedArrayCreate(&array, &desc, 4));
  const Views after = ReadViews();
  ExpectViewsAgree(after, limit_);
  // Every level is device memory: 4 MiB + 1 MiB + 256 KiB + 64 KiB.
  EXPECT_GE(after.used() - base_.used(), (4096 + 1024 + 256 + 64) * 1024u);

  CUDA_ARRAY3D_DESCRIPTOR big = desc;
  big.Height = after.cu_free / (1024 * 4) + 1;  // level 0 alone is past the limit
  CUmipmappedArray refused = nullptr;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cuMipmappedArrayCreate(&refused, &big, 2));
  const Views after_refusal = ReadViews();
  EXPECT_EQ(after_refusal.used(), after.used());
  EXPECT_EQ(after_refusal.driver_own, after.driver_own);

  ASSERT_CU_OK(cuMipmappedArrayDestroy(array));
  const Views end = ReadViews();
  ExpectViewsAgree(end, limit_);
  EXPECT_EQ(end.used(), base_.used());
}

// ---- frees --------------------------------------------------------------------------------------------------

TEST_F(Slice, FreeOfUnknownPointerIsPassedToTheDriver) {
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc_v2(&pointer, 16 * kMiB));
  const Views before = ReadViews();
  // Never allocated, and the inside of a live allocation: the driver's answer, untouched (HAMi-core#321: -1).
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemFree_v2(static_cast<CUdeviceptr>(0x1000)));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemFree_v2(pointer + 4096));
  const Views after = ReadViews();
  EXPECT_EQ(after.used(), before.used()) << "a failed free changed the charge";
  ASSERT_CU_OK(cuMemFree_v2(pointer));
  EXPECT_EQ(ReadViews().used(), base_.used());
}

TEST_F(Slice, DoubleFreeIsGivenBackOnce) {
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU_OK(cuMemAlloc_v2(&a, 16 * kMiB));
  ASSERT_CU_OK(cuMemAlloc_v2(&b, 32 * kMiB));
  ASSERT_CU_OK(cuMemFree_v2(a));
  EXPECT_NE(cuMemFree_v2(a), CUDA_SUCCESS);
  const Views after = ReadViews();
  ExpectViewsAgree(after, limit_);
  EXPECT_EQ(after.used(), base_.used() + 32 * kMiB) << "the second free of one pointer was given back again";
  ASSERT_CU_OK(cuMemFree_v2(b));
}

TEST_F(Slice, FreeAsyncOfOrdinaryMemoryGivesItBack) {
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc_v2(&pointer, 64 * kMiB));
  ASSERT_CU_OK(cuMemFreeAsync(pointer, nullptr));
  ASSERT_CU_OK(cuCtxSynchronize());
  const Views after = ReadViews();
  ExpectViewsAgree(after, limit_);
  EXPECT_EQ(after.used(), base_.used());
}

// ---- the views ----------------------------------------------------------------------------------------------

TEST_F(Slice, EveryViewShowsTheLimitAsTotal) {
  EXPECT_EQ(base_.cu_total, limit_);
  EXPECT_EQ(base_.device_total, limit_);
  EXPECT_EQ(base_.v1.total, limit_);
  EXPECT_EQ(base_.v2.total, limit_);
  EXPECT_EQ(base_.v1.used + base_.v1.free, limit_);
  EXPECT_EQ(base_.v2.used + base_.v2.free + base_.v2.reserved, limit_);
}

TEST_F(Slice, MemGetInfoWithNullFreeDoesNotCrash) {
  std::size_t total = 0;
  const CUresult r = cuMemGetInfo_v2(nullptr, &total);
  // fakecuda answers as the real driver does: the NULL output is skipped (HAMi-core#333 crashed here).
  if (r == CUDA_SUCCESS) {
    EXPECT_EQ(total, limit_);
  } else {
    EXPECT_CU(CUDA_ERROR_INVALID_VALUE, r);
  }
}

TEST_F(Slice, MemGetInfoWithNullTotalDoesNotCrash) {
  std::size_t free_bytes = 0;
  const CUresult r = cuMemGetInfo_v2(&free_bytes, nullptr);
  if (r == CUDA_SUCCESS) {
    EXPECT_EQ(free_bytes, base_.cu_free);
  } else {
    EXPECT_CU(CUDA_ERROR_INVALID_VALUE, r);
  }
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuMemGetInfo_v2(nullptr, nullptr));
}

TEST_F(Slice, ConcurrentAllocAndFreeKeepTheLedgerExact) {
  // Threads allocate and free at once; the driver hands an address just freed by one thread to the next allocation
  // of another (mmap reuses the hole), so the ledger must not match frees and allocations by address carelessly.
  const std::uint64_t seed = Seed(3);
  constexpr int kThreads = 4, kRounds = 5000;
  std::atomic<std::uint64_t> errors{0}, granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (cuCtxSetCurrent(context_) != CUDA_SUCCESS) {
        errors.fetch_add(1);
        return;
      }
      std::uint64_t state = seed * 7919 + static_cast<std::uint64_t>(t);
      for (int i = 0; i < kRounds; ++i) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        CUdeviceptr pointer = 0;
        if (cuMemAlloc_v2(&pointer, kMiB + ((state >> 33) % 8) * 64 * 1024) != CUDA_SUCCESS) {
          errors.fetch_add(1);
          continue;
        }
        granted.fetch_add(1);
        if (cuMemFree_v2(pointer) != CUDA_SUCCESS) errors.fetch_add(1);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(errors.load(), 0u);
  EXPECT_EQ(granted.load(), static_cast<std::uint64_t>(kThreads) * kRounds);
  const Views end = ReadViews();
  ExpectViewsAgree(end, limit_);
  EXPECT_EQ(end.used(), base_.used()) << "every allocation was freed, yet the slice still counts "
                                      << (end.used() - base_.used()) << " bytes";
}

TEST_F(Slice, ViewsFollowAnAllocationOnAnotherThread) {
  // A thread with no current context of its own allocates in the primary context: counted in the one slice.
  CUresult result = CUDA_ERROR_UNKNOWN;
  CUdeviceptr pointer = 0;
  std::thread([&] {
    if (cuCtxSetCurrent(context_) == CUDA_SUCCESS) result = cuMemAlloc_v2(&pointer, 48 * kMiB);
  }).join();
  ASSERT_CU_OK(result);
  const Views after = ReadViews();
  ExpectViewsAgree(after, limit_);
  EXPECT_EQ(after.used(), base_.used() + 48 * kMiB);
  ASSERT_CU_OK(cuMemFree_v2(pointer));
}

}  // namespace
}  // namespace vgpu::shimtest
