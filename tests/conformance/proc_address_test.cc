// Conformance: cuGetProcAddress_v2, the path cudart and frameworks use to reach driver entry points: base names map
// to the versioned symbol a CUDA version asks for, the per-thread flag to the _ptsz/_ptds variants, and unknown or
// too-new names report why they were not found.
#include <dlfcn.h>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

class ProcAddressTest : public testing::Test {
 protected:
  void SetUp() override { ASSERT_CU_OK(cuInit(0)); }

  // The exported symbol of the loaded driver library; cuInit is in every driver, so its library is the one to ask.
  static void* Exported(const char* symbol) {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&cuInit), &info) == 0) {
      return nullptr;
    }
    void* library = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) {
      return nullptr;
    }
    void* address = dlsym(library, symbol);
    dlclose(library);
    return address;
  }

  static void* Resolve(const char* symbol, int cuda_version, cuuint64_t flags,
                       CUdriverProcAddressQueryResult* status, CUresult* result) {
    void* function = reinterpret_cast<void*>(0x1);
    *result = cuGetProcAddress(symbol, &function, cuda_version, flags, status);
    return function;
  }
};

TEST_F(ProcAddressTest, BaseNameResolvesToTheVersionedExport) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult result = CUDA_ERROR_UNKNOWN;
  void* function = Resolve("cuMemAlloc", 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  ASSERT_CU_OK(result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS);
  ASSERT_NE(function, nullptr);
  // unverified on real driver: the pointer handed out is the library's exported cuMemAlloc_v2 itself.
  EXPECT_EQ(function, Exported("cuMemAlloc_v2"));
  EXPECT_EQ(function, dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"));
}

TEST_F(ProcAddressTest, ResolvedFunctionBehavesLikeTheExport) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult result = CUDA_ERROR_UNKNOWN;
  void* function = Resolve("cuDriverGetVersion", 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  ASSERT_CU_OK(result);
  ASSERT_NE(function, nullptr);
  int through_pointer = 0;
  int direct = 0;
  ASSERT_CU_OK(reinterpret_cast<CUresult (*)(int*)>(function)(&through_pointer));
  ASSERT_CU_OK(cuDriverGetVersion(&direct));
  EXPECT_EQ(through_pointer, direct);
}

TEST_F(ProcAddressTest, PerThreadFlagSelectsThePtszVariant) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult result = CUDA_ERROR_UNKNOWN;
  void* per_thread = Resolve("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status, &result);
  ASSERT_CU_OK(result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS);
  void* legacy = Resolve("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status, &result);
  ASSERT_CU_OK(result);
  EXPECT_NE(per_thread, legacy) << "the per-thread default stream variant is a different entry point";
  // unverified on real driver: the pointers handed out are the exported symbols.
  EXPECT_EQ(per_thread, Exported("cuLaunchKernel_ptsz"));
  EXPECT_EQ(legacy, Exported("cuLaunchKernel"));
  void* copy = Resolve("cuMemcpyHtoD", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status, &result);
  ASSERT_CU_OK(result);
  EXPECT_EQ(copy, Exported("cuMemcpyHtoD_v2_ptds"));
}

TEST_F(ProcAddressTest, UnknownSymbolIsNotFound) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  CUresult result = CUDA_ERROR_UNKNOWN;
  void* function = Resolve("cuNoSuchFunctionAnywhere", 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  // Documented: CUDA_ERROR_NOT_FOUND with the status CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND and a NULL pointer.
  EXPECT_CU(CUDA_ERROR_NOT_FOUND, result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  EXPECT_EQ(function, nullptr);
}

TEST_F(ProcAddressTest, TooOldAVersionIsVersionNotSufficient) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  CUresult result = CUDA_ERROR_UNKNOWN;
  // cuMemAllocAsync arrived in CUDA 11.2.
  void* function = Resolve("cuMemAllocAsync", 11000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  EXPECT_CU(CUDA_ERROR_NOT_FOUND, result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
  EXPECT_EQ(function, nullptr);
  function = Resolve("cuMemAllocAsync", 11020, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  EXPECT_CU_OK(result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_NE(function, nullptr);
}

TEST_F(ProcAddressTest, OlderVersionsGetTheOlderEntryPoint) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult result = CUDA_ERROR_UNKNOWN;
  // cuCtxCreate_v4 is CUDA 12.5's; 12.0 still gets cuCtxCreate_v2 (the v3 form takes affinity parameters).
  void* old_create = Resolve("cuCtxCreate", 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  ASSERT_CU_OK(result);
  void* new_create = Resolve("cuCtxCreate", 13000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  ASSERT_CU_OK(result);
  EXPECT_NE(old_create, new_create);
  // unverified on real driver: the pointers handed out are the exported symbols.
  EXPECT_EQ(old_create, Exported("cuCtxCreate_v2"));
  EXPECT_EQ(new_create, Exported("cuCtxCreate_v4"));
}

TEST_F(ProcAddressTest, NullArgumentsAreInvalidValue) {
  void* function = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetProcAddress(nullptr, &function, 12000, 0, &status));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetProcAddress("cuMemAlloc", nullptr, 12000, 0, &status));
  // The status output is optional.
  EXPECT_CU_OK(cuGetProcAddress("cuMemAlloc", &function, 12000, 0, nullptr));
}

}  // namespace
}  // namespace vgpu::conformance
