// Conformance: cuInit and its flags, cuDriverGetVersion, and the driver's answers before cuInit or with no context.
#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

[[noreturn]] void CheckCallsBeforeInit() {
  FreshProcessReport report;
  int count = -1;
  CUdevice device = -1;
  CUcontext context = nullptr;
  CUdeviceptr pointer = 0;
  // Documented for every call but cuDriverGetVersion and the error-name calls.
  REPORT_CU(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGetCount(&count));
  REPORT_CU(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGet(&device, 0));
  REPORT_CU(CUDA_ERROR_NOT_INITIALIZED, cuCtxGetCurrent(&context));
  REPORT_CU(CUDA_ERROR_NOT_INITIALIZED, cuCtxSynchronize());
  REPORT_CU(CUDA_ERROR_NOT_INITIALIZED, cuMemAlloc(&pointer, 1024));
  REPORT_CU(CUDA_ERROR_NOT_INITIALIZED, cuDevicePrimaryCtxRetain(&context, 0));
  report.Exit();
}

TEST(DriverInitTest, CallsBeforeInitReturnNotInitialized) { EXPECT_IN_FRESH_PROCESS(CheckCallsBeforeInit); }

[[noreturn]] void CheckVersionErrorNamesAndProcAddressBeforeInit() {
  FreshProcessReport report;
  int version = 0;
  // The documentation of cuDriverGetVersion and cuGetErrorName lists no CUDA_ERROR_NOT_INITIALIZED: both are meant to
  // work before cuInit (cudart calls cuDriverGetVersion first to check the driver is recent enough).
  REPORT_CU(CUDA_SUCCESS, cuDriverGetVersion(&version));
  report.Expect(version >= 12000, "cuDriverGetVersion before cuInit gave " + std::to_string(version));
  const char* name = nullptr;
  // Observed on an H100 with driver 580.159.04: cuGetErrorName works before cuInit.
  REPORT_CU(CUDA_SUCCESS, cuGetErrorName(CUDA_ERROR_INVALID_VALUE, &name));
  // Observed on an H100 with driver 580.159.04: cuGetProcAddress answers before cuInit too.
  void* function = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  REPORT_CU(CUDA_SUCCESS, cuGetProcAddress("cuInit", &function, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status));
  report.Expect(function != nullptr && status == CU_GET_PROC_ADDRESS_SUCCESS, "cuGetProcAddress(cuInit) before cuInit");
  report.Exit();
}

TEST(DriverInitTest, VersionErrorNamesAndProcAddressWorkBeforeInit) {
  EXPECT_IN_FRESH_PROCESS(CheckVersionErrorNamesAndProcAddressBeforeInit);
}

[[noreturn]] void CheckNonZeroFlagsRejectedBeforeInit() {
  FreshProcessReport report;
  int count = -1;
  // "Flags: Initialization flag for CUDA", currently must be 0.
  REPORT_CU(CUDA_ERROR_INVALID_VALUE, cuInit(1));
  // Observed on an H100 with driver 580.159.04: a rejected cuInit leaves the driver uninitialized.
  REPORT_CU(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGetCount(&count));
  REPORT_CU(CUDA_SUCCESS, cuInit(0));
  REPORT_CU(CUDA_SUCCESS, cuDeviceGetCount(&count));
  report.Exit();
}

TEST(DriverInitTest, NonZeroFlagsRejectedBeforeInit) { EXPECT_IN_FRESH_PROCESS(CheckNonZeroFlagsRejectedBeforeInit); }

TEST(DriverInitTest, InitIsIdempotent) {
  ASSERT_CU_OK(cuInit(0));
  EXPECT_CU_OK(cuInit(0));
}

TEST(DriverInitTest, NonZeroFlagsRejectedAfterInit) {
  ASSERT_CU_OK(cuInit(0));
  // Observed on an H100 with driver 580.159.04: the flag check happens even when the driver is already initialized.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuInit(1));
  int count = 0;
  EXPECT_CU_OK(cuDeviceGetCount(&count));
}

TEST(DriverInitTest, DriverGetVersionRejectsNull) { EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDriverGetVersion(nullptr)); }

TEST(DriverInitTest, DriverVersionIsCuda12OrLater) {
  int version = 0;
  ASSERT_CU_OK(cuDriverGetVersion(&version));
  EXPECT_GE(version, 12000);
  EXPECT_EQ(version % 10, 0) << "versions are 1000 * major + 10 * minor, got " << version;
  if (RunningOnFakecuda()) {
    EXPECT_EQ(version, 13000) << "fakecuda reports the CUDA 13.0 driver";
  }
}

[[noreturn]] void CheckCallsWithoutContext() {
  FreshProcessReport report;
  REPORT_CU(CUDA_SUCCESS, cuInit(0));
  CUcontext context = reinterpret_cast<CUcontext>(0x1);
  REPORT_CU(CUDA_SUCCESS, cuCtxGetCurrent(&context));
  report.Expect(context == nullptr, "cuCtxGetCurrent without a context did not give NULL");
  CUdevice device = -1;
  CUdeviceptr pointer = 0;
  REPORT_CU(CUDA_ERROR_INVALID_CONTEXT, cuCtxGetDevice(&device));
  REPORT_CU(CUDA_ERROR_INVALID_CONTEXT, cuCtxSynchronize());
  REPORT_CU(CUDA_ERROR_INVALID_CONTEXT, cuMemAlloc(&pointer, 1024));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  REPORT_CU(CUDA_ERROR_INVALID_CONTEXT, cuMemGetInfo(&free_bytes, &total_bytes));
  // Device queries need no context.
  int count = 0;
  REPORT_CU(CUDA_SUCCESS, cuDeviceGetCount(&count));
  report.Exit();
}

TEST(DriverInitTest, CallsWithoutContextReturnInvalidContext) { EXPECT_IN_FRESH_PROCESS(CheckCallsWithoutContext); }

}  // namespace
}  // namespace vgpu::conformance
