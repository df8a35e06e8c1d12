// Conformance: cuGetErrorName and cuGetErrorString, whose texts tools and frameworks print and sometimes match.
#include <string>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

struct ErrorText {
  CUresult result;
  const char* name;
  const char* description;
};

// The real driver's texts (they are the same in every CUDA release since they were introduced).
constexpr ErrorText kKnownErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

TEST(ErrorsTest, NamesOfKnownResults) {
  for (const ErrorText& known : kKnownErrors) {
    const char* name = nullptr;
    ASSERT_CU_OK(cuGetErrorName(known.result, &name)) << known.name;
    ASSERT_NE(name, nullptr) << known.name;
    EXPECT_STREQ(name, known.name);
  }
}

TEST(ErrorsTest, DescriptionsOfKnownResults) {
  for (const ErrorText& known : kKnownErrors) {
    const char* description = nullptr;
    ASSERT_CU_OK(cuGetErrorString(known.result, &description)) << known.name;
    ASSERT_NE(description, nullptr) << known.name;
    EXPECT_STREQ(description, known.description) << known.name;
  }
}

TEST(ErrorsTest, EveryNamedResultHasAName) {
  // Every code of the CUresult enumeration that cuda.h defines between these bounds must have a name.
  const CUresult defined[] = {CUDA_ERROR_PROFILER_DISABLED,
                              CUDA_ERROR_STUB_LIBRARY,
                              CUDA_ERROR_DEVICE_UNAVAILABLE,
                              CUDA_ERROR_ARRAY_IS_MAPPED,
                              CUDA_ERROR_ECC_UNCORRECTABLE,
                              CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
                              CUDA_ERROR_FILE_NOT_FOUND,
                              CUDA_ERROR_ILLEGAL_STATE,
                              CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                              CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
                              CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                              CUDA_ERROR_STREAM_CAPTURE_INVALIDATED};
  for (CUresult result : defined) {
    const char* name = nullptr;
    EXPECT_CU_OK(cuGetErrorName(result, &name)) << static_cast<int>(result);
    EXPECT_NE(name, nullptr);
    if (name != nullptr) {
      EXPECT_EQ(std::string(name).rfind("CUDA_ERROR_", 0), 0u) << name;
    }
  }
}

TEST(ErrorsTest, UnknownCodeIsInvalidValueAndNull) {
  const char* name = "untouched";
  const char* description = "untouched";
  // "CUDA_ERROR_INVALID_VALUE ... *pStr will be set to the NULL" for a code that is not recognized.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetErrorName(static_cast<CUresult>(12345), &name));
  EXPECT_EQ(name, nullptr);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetErrorString(static_cast<CUresult>(12345), &description));
  EXPECT_EQ(description, nullptr);
}

TEST(ErrorsTest, NullOutputIsInvalidValue) {
  if (!RunningOnFakecuda()) {
    // Observed on an H100 with driver 580.159.04: both calls dereference the NULL output (SIGSEGV).
    GTEST_SKIP() << "the real driver crashes on a NULL output; fakecuda answers CUDA_ERROR_INVALID_VALUE";
  }
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetErrorName(CUDA_SUCCESS, nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuGetErrorString(CUDA_SUCCESS, nullptr));
}

}  // namespace
}  // namespace vgpu::conformance
