// Every route to an allocation function reaches the shim's hook, proved by behaviour in a process under the shim
// with a 1 GiB limit: an allocation through the route is counted, and one past the cap fails with OOM (the fake
// device has 80 GB, so only the hook can refuse it). Also: libvgpu.so shows nothing but the hooks and dlsym.
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <set>
#include <string>

#include "shim_support.h"

// cuda.h (CUDA 12+) turns cuGetProcAddress into cuGetProcAddress_v2; the CUDA 11 four-argument entry point is still
// exported under its own name, and older binaries call it.
#undef cuGetProcAddress
extern "C" CUresult CUDAAPI cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags);

namespace vgpu::shimtest {
namespace {

using MemAllocFunction = CUresult (*)(CUdeviceptr*, std::size_t);
using MemAllocAsyncFunction = CUresult (*)(CUdeviceptr*, std::size_t, CUstream);
using MemAllocFromPoolFunction = CUresult (*)(CUdeviceptr*, std::size_t, CUmemoryPool, CUstream);
using GetProcAddressV2Function = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

class Route : public testing::Test {
 protected:
  void SetUp() override {
    limit_ = ConfiguredLimit();
    ASSERT_GT(limit_, 0u);
    ASSERT_CU_OK(cuInit(0));
    ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context_, 0));
    ASSERT_CU_OK(cuCtxSetCurrent(context_));
  }
  void TearDown() override {
    if (context_ != nullptr) {
      cuCtxSynchronize();
      cuCtxSetCurrent(nullptr);
      EXPECT_CU_OK(cuDevicePrimaryCtxRelease(0));
    }
  }

  // An allocation through `allocate` is counted; one past what is left is refused with OOM; the free gives it back.
  void ProveAllocRoute(MemAllocFunction allocate, const std::string& route) {
    SCOPED_TRACE(route);
    ASSERT_NE(allocate, nullptr);
    const Views before = ReadViews();
    CUdeviceptr pointer = 0;
    ASSERT_CU_OK(allocate(&pointer, 32 * kMiB));
    const Views after = ReadViews();
    ExpectViewsAgree(after, limit_);
    EXPECT_EQ(after.used(), before.used() + 32 * kMiB) << "the allocation through this route is not counted";
    CUdeviceptr over = 0;
    EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, allocate(&over, after.cu_free + 512))
        << "the route passed the limit: it does not lead to the hook";
    if (over != 0) cuMemFree_v2(over);
    ASSERT_CU_OK(cuMemFree_v2(pointer));
    EXPECT_EQ(ReadViews().used(), before.used());
  }

  // The same for a stream-ordered allocation function on `stream` (nullptr: the default stream of its flavour).
  void ProveAsyncRoute(const std::function<CUresult(CUdeviceptr*, std::size_t)>& allocate, const std::string& route) {
    SCOPED_TRACE(route);
    const Views before = ReadViews();
    CUdeviceptr pointer = 0;
    ASSERT_CU_OK(allocate(&pointer, 32 * kMiB));
    const Views after = ReadViews();
    ExpectViewsAgree(after, limit_);
    EXPECT_EQ(after.used(), before.used() + 32 * kMiB) << "the allocation through this route is not counted";
    CUdeviceptr over = 0;
    EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, allocate(&over, after.cu_free + 512))
        << "the route passed the limit: it does not lead to the hook";
    if (over != 0) cuMemFreeAsync(over, CU_STREAM_PER_THREAD);
    ASSERT_CU_OK(cuMemFreeAsync(pointer, CU_STREAM_PER_THREAD));
    ASSERT_CU_OK(cuCtxSynchronize());  // the pools' release threshold is 0: their memory goes back to the device
    EXPECT_EQ(ReadViews().used(), before.used());
  }

  std::uint64_t limit_ = 0;
  CUcontext context_ = nullptr;
};

struct Lookup {
  int version;
  cuuint64_t flags;
  std::string Describe() const { return "cudaVersion " + std::to_string(version) + ", flags " + std::to_string(flags); }
};
constexpr Lookup kLookups[] = {
    {3020, CU_GET_PROC_ADDRESS_DEFAULT},
    {3020, CU_GET_PROC_ADDRESS_LEGACY_STREAM},
    {3020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
    {12000, CU_GET_PROC_ADDRESS_DEFAULT},
    {12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM},
    {12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
    {13000, CU_GET_PROC_ADDRESS_DEFAULT},
    {13000, CU_GET_PROC_ADDRESS_LEGACY_STREAM},
    {13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM},
};

// The file a loaded object came from, found by a part of its name.
std::string LoadedPath(const char* name_part) {
  struct Search {
    const char* part;
    std::string path;
  } search{name_part, {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, s->part) != nullptr) {
          s->path = info->dlpi_name;
          return 1;
        }
        return 0;
      },
      &search);
  return search.path;
}

// The names an ELF shared object defines in its dynamic symbol table (what the loader can bind to).
std::set<std::string> DefinedDynamicSymbols(const std::string& path, std::set<std::string>* objects = nullptr) {
  std::set<std::string> names;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    ADD_FAILURE() << "cannot open " << path;
    return names;
  }
  struct stat st {};
  fstat(fd, &st);
  void* map = mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    ADD_FAILURE() << "cannot map " << path;
    return names;
  }
  const auto* base = static_cast<const unsigned char*>(map);
  const auto* header = reinterpret_cast<const Elf64_Ehdr*>(base);
  const auto* sections = reinterpret_cast<const Elf64_Shdr*>(base + header->e_shoff);
  for (int i = 0; i < header->e_shnum; ++i) {
    if (sections[i].sh_type != SHT_DYNSYM) continue;
    const auto* symbols = reinterpret_cast<const Elf64_Sym*>(base + sections[i].sh_offset);
    const char* strings = reinterpret_cast<const char*>(base + sections[sections[i].sh_link].sh_offset);
    const std::size_t count = sections[i].sh_size / sizeof(Elf64_Sym);
    for (std::size_t s = 1; s < count; ++s) {
      const unsigned char binding = ELF64_ST_BIND(symbols[s].st_info);
      if (symbols[s].st_shndx == SHN_UNDEF ||
          (binding != STB_GLOBAL && binding != STB_WEAK && binding != STB_GNU_UNIQUE)) {
        continue;
      }
      if (ELF64_ST_TYPE(symbols[s].st_info) == STT_NOTYPE && symbols[s].st_shndx == SHN_ABS) continue;  // version nodes
      names.insert(strings + symbols[s].st_name);
      if (objects != nullptr && ELF64_ST_TYPE(symbols[s].st_info) == STT_OBJECT)
        objects->insert(strings + symbols[s].st_name);
    }
  }
  munmap(map, static_cast<std::size_t>(st.st_size));
  return names;
}

// ---- the routes -----------------------------------------------------------------------------------------------

#define SKIP_WITHOUT_DLSYM_ROUTE() \
  if (!ShimInterposesDlsym()) GTEST_SKIP() << "this build of libvgpu.so does not interpose dlsym (sanitizer build)"

TEST_F(Route, DirectCallReachesTheHook) { ProveAllocRoute(&cuMemAlloc_v2, "direct call"); }

TEST_F(Route, DlsymOnALibcudaHandleReachesTheHook) {
  SKIP_WITHOUT_DLSYM_ROUTE();
  void* library = dlopen("libcuda.so.1", RTLD_NOW);
  ASSERT_NE(library, nullptr) << dlerror();
  ProveAllocRoute(reinterpret_cast<MemAllocFunction>(dlsym(library, "cuMemAlloc_v2")), "dlsym(libcuda.so.1)");
  dlclose(library);
}

TEST_F(Route, DlsymOnAHandleOpenedByFullPathReachesTheHook) {
  SKIP_WITHOUT_DLSYM_ROUTE();
  // cuGetErrorName is not hooked: its address is in the driver library, whose file we then open by path.
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void*>(&cuGetErrorName), &info), 0);
  ASSERT_NE(info.dli_fname, nullptr);
  void* library = dlopen(info.dli_fname, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(library, nullptr) << dlerror();
  ProveAllocRoute(reinterpret_cast<MemAllocFunction>(dlsym(library, "cuMemAlloc_v2")),
                  std::string("dlsym(dlopen(\"") + info.dli_fname + "\"))");
  dlclose(library);
}

TEST_F(Route, DlsymRtldNextReachesTheHook) {
  SKIP_WITHOUT_DLSYM_ROUTE();
  ProveAllocRoute(reinterpret_cast<MemAllocFunction>(dlsym(RTLD_NEXT, "cuMemAlloc_v2")), "dlsym(RTLD_NEXT)");
}

TEST(Dlsym, RtldNextOfANameThatIsNotTheDriversIsGlibcsAnswer) {
  SKIP_WITHOUT_DLSYM_ROUTE();
  // Allocators, tracers and language runtimes call dlsym(RTLD_NEXT, ...) for their own interposition: under the shim
  // they must get what glibc gives them without it (the next definition after the caller: here libc's).
  void* next = dlsym(RTLD_NEXT, "getpid");
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next, dlsym(RTLD_DEFAULT, "getpid"));
  void* missing = dlsym(RTLD_NEXT, "vgpu_no_such_symbol");
  EXPECT_EQ(missing, nullptr);
}

TEST_F(Route, DlsymRtldDefaultReachesTheHook) {
  ProveAllocRoute(reinterpret_cast<MemAllocFunction>(dlsym(RTLD_DEFAULT, "cuMemAlloc_v2")), "dlsym(RTLD_DEFAULT)");
}

TEST_F(Route, GetProcAddressReachesTheHookAtEveryVersionAndFlag) {
  for (const Lookup& lookup : kLookups) {
    void* function = nullptr;
    ASSERT_CU_OK(cuGetProcAddress("cuMemAlloc", &function, lookup.version, lookup.flags)) << lookup.Describe();
    ProveAllocRoute(reinterpret_cast<MemAllocFunction>(function), "cuGetProcAddress, " + lookup.Describe());
  }
}

TEST_F(Route, GetProcAddressV2ReachesTheHookAtEveryVersionAndFlag) {
  for (const Lookup& lookup : kLookups) {
    void* function = nullptr;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    ASSERT_CU_OK(cuGetProcAddress_v2("cuMemAlloc", &function, lookup.version, lookup.flags, &status))
        << lookup.Describe();
    EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS) << lookup.Describe();
    ProveAllocRoute(reinterpret_cast<MemAllocFunction>(function), "cuGetProcAddress_v2, " + lookup.Describe());
  }
}

TEST_F(Route, GetProcAddressOfGetProcAddressReachesTheHook) {
  // cuda-python and the CUDA runtime look cuGetProcAddress itself up first, then everything through it.
  void* function = nullptr;
  CUdriverProcAddressQueryResult status{};
  ASSERT_CU_OK(cuGetProcAddress_v2("cuGetProcAddress", &function, 12000, 0, &status));
  ASSERT_NE(function, nullptr);
  auto lookup = reinterpret_cast<GetProcAddressV2Function>(function);
  void* allocate = nullptr;
  ASSERT_CU_OK(lookup("cuMemAlloc", &allocate, 12000, 0, &status));
  ProveAllocRoute(reinterpret_cast<MemAllocFunction>(allocate), "cuGetProcAddress_v2 found by cuGetProcAddress_v2");
}

TEST_F(Route, PerThreadFlagGivesThePtszHookOfMemAllocAsync) {
  for (const int version : {12000, 13000}) {
    void* per_thread = nullptr;
    void* legacy = nullptr;
    CUdriverProcAddressQueryResult status{};
    ASSERT_CU_OK(cuGetProcAddress_v2("cuMemAllocAsync", &per_thread, version,
                                     CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status));
    ASSERT_CU_OK(cuGetProcAddress_v2("cuMemAllocAsync", &legacy, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status));
    EXPECT_NE(per_thread, legacy) << "the per-thread lookup must give the _ptsz variant, a different entry point";
    // The exported names, looked up through the dlsym route, are the hooks themselves.
    EXPECT_EQ(per_thread, dlsym(RTLD_DEFAULT, "cuMemAllocAsync_ptsz"));
    EXPECT_EQ(legacy, dlsym(RTLD_DEFAULT, "cuMemAllocAsync"));
    auto ptsz = reinterpret_cast<MemAllocAsyncFunction>(per_thread);
    auto plain = reinterpret_cast<MemAllocAsyncFunction>(legacy);
    ASSERT_NE(ptsz, nullptr);
    ASSERT_NE(plain, nullptr);
    ProveAsyncRoute([&](CUdeviceptr* p, std::size_t bytes) { return ptsz(p, bytes, nullptr); },
                    "cuMemAllocAsync per-thread (_ptsz) at " + std::to_string(version));
    ProveAsyncRoute([&](CUdeviceptr* p, std::size_t bytes) { return plain(p, bytes, CU_STREAM_PER_THREAD); },
                    "cuMemAllocAsync legacy at " + std::to_string(version));
  }
}

TEST_F(Route, PerThreadFlagGivesThePtszHookOfMemAllocFromPoolAsync) {
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  CUmemoryPool pool = nullptr;
  ASSERT_CU_OK(cuMemPoolCreate(&pool, &props));
  void* per_thread = nullptr;
  CUdriverProcAddressQueryResult status{};
  ASSERT_CU_OK(cuGetProcAddress_v2("cuMemAllocFromPoolAsync", &per_thread, 12000,
                                   CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status));
  EXPECT_EQ(per_thread, dlsym(RTLD_DEFAULT, "cuMemAllocFromPoolAsync_ptsz"));
  auto ptsz = reinterpret_cast<MemAllocFromPoolFunction>(per_thread);
  ASSERT_NE(ptsz, nullptr);
  ProveAsyncRoute([&](CUdeviceptr* p, std::size_t bytes) { return ptsz(p, bytes, pool, nullptr); },
                  "cuMemAllocFromPoolAsync per-thread (_ptsz)");
  EXPECT_CU_OK(cuMemPoolDestroy(pool));
}

TEST_F(Route, OlderAbiIsNotHandedTheNewerHook) {
  // Asked for the ABI of an older CUDA, the caller gets that ABI: cuCtxDestroy (v1) before 4000, _v2 from 4000.
  void* v1 = nullptr;
  void* v2 = nullptr;
  CUdriverProcAddressQueryResult status{};
  ASSERT_CU_OK(cuGetProcAddress_v2("cuCtxDestroy", &v1, 3020, 0, &status));
  ASSERT_CU_OK(cuGetProcAddress_v2("cuCtxDestroy", &v2, 12000, 0, &status));
  EXPECT_EQ(v1, dlsym(RTLD_DEFAULT, "cuCtxDestroy"));
  EXPECT_EQ(v2, dlsym(RTLD_DEFAULT, "cuCtxDestroy_v2"));
  EXPECT_NE(v1, v2);
  // Before 3020 cuMemAlloc is the 32-bit v1 entry point: never the cuMemAlloc_v2 hook (another signature).
  void* old_alloc = nullptr;
  const CUresult r = cuGetProcAddress_v2("cuMemAlloc", &old_alloc, 3010, 0, &status);
  if (r == CUDA_SUCCESS && old_alloc != nullptr) {
    EXPECT_NE(old_alloc, dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));
  }
}

TEST_F(Route, LegacyV1MemAllocCannotPassTheLimit) {
  // The 32-bit cuMemAlloc of CUDA < 3.2 is still exported by the driver. The shim does not hook it; on fakecuda it is
  // an unimplemented stub, so this holds trivially there; on a real driver it would be a way around the cap.
  using V1Alloc = CUresult (*)(unsigned int*, unsigned int);
  auto v1 = reinterpret_cast<V1Alloc>(dlsym(RTLD_DEFAULT, "cuMemAlloc"));
  if (v1 == nullptr) GTEST_SKIP() << "the driver does not export cuMemAlloc (v1)";
  std::size_t free_bytes = 0, total = 0;
  ASSERT_CU_OK(cuMemGetInfo_v2(&free_bytes, &total));
  unsigned int pointer = 0;
  const CUresult r = v1(&pointer, static_cast<unsigned int>(free_bytes + 64 * kMiB));
  EXPECT_NE(r, CUDA_SUCCESS) << "cuMemAlloc (v1) allocated past the limit";
  if (r == CUDA_SUCCESS) cuMemFree_v2(pointer);
}

TEST_F(Route, UnhookedSymbolsPassStraightThrough) {
  void* exported = dlsym(RTLD_DEFAULT, "cuMemsetD8_v2");
  ASSERT_NE(exported, nullptr);
  Dl_info info{};
  ASSERT_NE(dladdr(exported, &info), 0);
  EXPECT_EQ(std::string(info.dli_fname).find("libvgpu"), std::string::npos)
      << "an unhooked symbol resolved into the shim: " << info.dli_fname;
  void* through_lookup = nullptr;
  CUdriverProcAddressQueryResult status{};
  ASSERT_CU_OK(cuGetProcAddress_v2("cuMemsetD8", &through_lookup, 12000, 0, &status));
  EXPECT_EQ(through_lookup, exported);
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc_v2(&pointer, 4096));
  EXPECT_CU_OK(reinterpret_cast<CUresult (*)(CUdeviceptr, unsigned char, std::size_t)>(exported)(pointer, 7, 4096));
  unsigned char byte = 0;
  ASSERT_CU_OK(cuMemcpyDtoH_v2(&byte, pointer + 100, 1));
  EXPECT_EQ(byte, 7);
  EXPECT_CU_OK(cuMemFree_v2(pointer));
  // Names that are not the driver's are glibc's answer.
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "getpid"), reinterpret_cast<void*>(&getpid));
}

TEST_F(Route, NvmlThroughDlsymShowsTheSlice) {
  SKIP_WITHOUT_DLSYM_ROUTE();
  void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  ASSERT_NE(library, nullptr) << dlerror();
  auto init = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(library, "nvmlInit_v2"));
  auto handle_by_index =
      reinterpret_cast<nvmlReturn_t (*)(unsigned int, nvmlDevice_t*)>(dlsym(library, "nvmlDeviceGetHandleByIndex_v2"));
  auto memory_v1 =
      reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*)>(dlsym(library, "nvmlDeviceGetMemoryInfo"));
  auto memory_v2 = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_v2_t*)>(
      dlsym(RTLD_DEFAULT, "nvmlDeviceGetMemoryInfo_v2"));
  ASSERT_TRUE(init != nullptr && handle_by_index != nullptr && memory_v1 != nullptr && memory_v2 != nullptr);
  ASSERT_EQ(init(), NVML_SUCCESS);
  nvmlDevice_t device = nullptr;
  ASSERT_EQ(handle_by_index(0, &device), NVML_SUCCESS);
  CUdeviceptr pointer = 0;
  ASSERT_CU_OK(cuMemAlloc_v2(&pointer, 40 * kMiB));
  std::size_t free_bytes = 0, total = 0;
  ASSERT_CU_OK(cuMemGetInfo_v2(&free_bytes, &total));
  nvmlMemory_t v1{};
  ASSERT_EQ(memory_v1(device, &v1), NVML_SUCCESS);
  EXPECT_EQ(v1.total, limit_);
  EXPECT_EQ(v1.used, total - free_bytes);
  EXPECT_EQ(v1.free, free_bytes);
  nvmlMemory_v2_t v2{};
  v2.version = nvmlMemory_v2;
  ASSERT_EQ(memory_v2(device, &v2), NVML_SUCCESS);
  EXPECT_EQ(v2.total, limit_);
  EXPECT_EQ(v2.used, total - free_bytes);
  EXPECT_EQ(v2.reserved, 0u);
  EXPECT_CU_OK(cuMemFree_v2(pointer));
  dlclose(library);
}

// ---- what libvgpu.so shows the application -----------------------------------------------------------------

TEST(Exports, OnlyDriverNamesAndDlsymAreExported) {
  const std::string shim = LoadedPath("libvgpu");
  ASSERT_FALSE(shim.empty()) << "libvgpu.so is not loaded: the registration preloads it";
  std::set<std::string> objects;
  const std::set<std::string> exported = DefinedDynamicSymbols(shim, &objects);
  ASSERT_FALSE(exported.empty());
  std::set<std::string> driver = DefinedDynamicSymbols(LoadedPath("libcuda.so"));
  const std::set<std::string> nvml = DefinedDynamicSymbols(LoadedPath("libnvidia-ml.so"));
  driver.insert(nvml.begin(), nvml.end());
  for (const std::string& name : exported) {
    if (name == "dlsym") continue;
    EXPECT_TRUE(driver.count(name) != 0) << "libvgpu.so exports " << name << ", which is no CUDA/NVML entry point";
  }
  EXPECT_EQ(exported.count("dlsym") != 0, ShimInterposesDlsym());
  EXPECT_TRUE(objects.empty()) << "libvgpu.so exports variables, e.g. " << *objects.begin();
}

TEST(Exports, InternalNamesAreNotVisible) {
  const std::string shim = LoadedPath("libvgpu");
  ASSERT_FALSE(shim.empty());
  for (const char* name :
       {"Charge", "Uncharge", "Initialize", "TheShim", "Used", "Log", "mutex", "ResolveReal", "HookFor", "LoadConfig",
        "ParseSize", "_ZN4vgpu5hooks6ChargeEim", "_ZN4vgpu5hooks7TheShimEv", "_ZN4vgpu5hooks10InitializeEv",
        "_ZN4vgpu6policy9ParseSizeESt17basic_string_viewIcSt11char_traitsIcEERm", "_ZSt4cout", "_Znwm"}) {
    void* found = dlsym(RTLD_DEFAULT, name);
    if (found == nullptr) continue;
    Dl_info info{};
    ASSERT_NE(dladdr(found, &info), 0);
    EXPECT_EQ(std::string(info.dli_fname).find("libvgpu"), std::string::npos)
        << "dlsym(RTLD_DEFAULT, \"" << name << "\") finds libvgpu.so's own symbol";
  }
}

}  // namespace
}  // namespace vgpu::shimtest
