// Conformance: cuGetProcAddress_v2 maps base names, CUDA versions and per-thread flags to the driver's entry points.
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

  static void* Resolve(const char* symbol, int cuda_version, cuuint64_t flags, CUdriverProcAddressQueryResult* status,
                       CUresult* result) {
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
  // Observed on an H100 with driver 580.159.04: the pointer handed out is the library's exported cuMemAlloc_v2 itself.
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
  // Observed on an H100 with driver 580.159.04: the pointers handed out are the exported symbols.
  EXPECT_EQ(per_thread, Exported("cuLaunchKernel_ptsz"));
  EXPECT_EQ(legacy, Exported("cuLaunchKernel"));
  void* copy = Resolve("cuMemcpyHtoD", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status, &result);
  ASSERT_CU_OK(result);
  EXPECT_EQ(copy, Exported("cuMemcpyHtoD_v2_ptds"));
}

TEST_F(ProcAddressTest, UnknownSymbolSucceedsWithNotFoundStatus) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  CUresult result = CUDA_ERROR_UNKNOWN;
  void* function = Resolve("cuNoSuchFunctionAnywhere", 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  // "The API will return CUDA_SUCCESS and set the returned pfn to NULL if ... the driver symbol is invalid"; the
  // reason is in the status (observed so on an H100 with driver 580.159.04).
  EXPECT_CU_OK(result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  EXPECT_EQ(function, nullptr);
}

TEST_F(ProcAddressTest, TooOldAVersionSucceedsWithVersionNotSufficient) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  CUresult result = CUDA_ERROR_UNKNOWN;
  // cuMemAllocAsync arrived in CUDA 11.2.
  void* function = Resolve("cuMemAllocAsync", 11000, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  EXPECT_CU_OK(result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
  EXPECT_EQ(function, nullptr);
  function = Resolve("cuMemAllocAsync", 11020, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  EXPECT_CU_OK(result);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(function, Exported("cuMemAllocAsync"));
  function = Resolve("cuMemAllocAsync", 11020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status, &result);
  EXPECT_CU_OK(result);
  EXPECT_EQ(function, Exported("cuMemAllocAsync_ptsz"));
}

TEST_F(ProcAddressTest, VersionNewerThanTheDriverIsInvalidValue) {
  int driver_version = 0;
  ASSERT_CU_OK(cuDriverGetVersion(&driver_version));
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  CUresult result = CUDA_ERROR_UNKNOWN;
  // "If the specified CUDA version is greater than the driver version, the API will return
  // CUDA_ERROR_INVALID_VALUE" (observed so on an H100 with driver 580.159.04, for 13010 on a 13000 driver).
  Resolve("cuMemAlloc", driver_version + 10, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, result);
}

TEST_F(ProcAddressTest, EachVersionGetsItsEntryPoint) {
  // Observed on an H100 with driver 580.159.04: cuCtxCreate_v3 (affinity parameters) from 11.4, cuCtxCreate_v4
  // (CUctxCreateParams) from 12.5; cuEventElapsedTime_v2 from 13.0; the base name cuGraphInstantiate still gives
  // cuGraphInstantiate_v2 (cuda.h maps the macro to cuGraphInstantiateWithFlags instead).
  struct Expectation {
    const char* symbol;
    int cuda_version;
    const char* exported;
  };
  const Expectation expectations[] = {
      {"cuCtxCreate", 11000, "cuCtxCreate_v2"},
      {"cuCtxCreate", 12000, "cuCtxCreate_v3"},
      {"cuCtxCreate", 13000, "cuCtxCreate_v4"},
      {"cuEventElapsedTime", 12000, "cuEventElapsedTime"},
      {"cuEventElapsedTime", 13000, "cuEventElapsedTime_v2"},
      {"cuGraphInstantiate", 12000, "cuGraphInstantiate_v2"},
      {"cuStreamBeginCapture", 12000, "cuStreamBeginCapture_v2"},
      {"cuGetProcAddress", 12000, "cuGetProcAddress_v2"},
  };
  for (const Expectation& expectation : expectations) {
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult result = CUDA_ERROR_UNKNOWN;
    void* function =
        Resolve(expectation.symbol, expectation.cuda_version, CU_GET_PROC_ADDRESS_DEFAULT, &status, &result);
    EXPECT_CU_OK(result) << expectation.symbol << " at " << expectation.cuda_version;
    EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS) << expectation.symbol << " at " << expectation.cuda_version;
    EXPECT_EQ(function, Exported(expectation.exported))
        << expectation.symbol << " at " << expectation.cuda_version << " should be " << expectation.exported;
  }
}

TEST_F(ProcAddressTest, StatusOutputIsOptional) {
  void* function = nullptr;
  EXPECT_CU_OK(cuGetProcAddress("cuMemAlloc", &function, 12000, 0, nullptr));
  EXPECT_EQ(function, Exported("cuMemAlloc_v2"));
}

TEST_F(ProcAddressTest, NullArgumentsAreInvalidValue) {
  if (!RunningOnFakecuda()) {
    // Observed on an H100 with driver 580.159.04: a NULL symbol or a NULL pfn is dereferenced (SIGSEGV).
    GTEST_SKIP() << "the real driver crashes on NULL arguments; fakecuda answers CUDA_ERROR_INVALID_VALUE";
  }
  void* function = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetProcAddress(nullptr, &function, 12000, 0, &status));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetProcAddress("cuMemAlloc", nullptr, 12000, 0, &status));
}

}  // namespace
}  // namespace vgpu::conformance
