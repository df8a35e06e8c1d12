// Conformance: NVML as monitoring tools and the shim read it, cross-checked against the CUDA driver's view.
#include <dlfcn.h>
#include <nvml.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "conformance_support.h"
#include "fakecuda/process_busy.h"
#include "vgpu/base/uuid.h"

namespace vgpu::conformance {
namespace {

std::string DescribeNvmlResult(nvmlReturn_t result) {
  const char* text = nvmlErrorString(result);
  return std::string(text == nullptr ? "no text" : text) + " (" + std::to_string(static_cast<int>(result)) + ")";
}

testing::AssertionResult NvmlResultIs(const char* expected_text, const char* call_text, nvmlReturn_t expected,
                                      nvmlReturn_t actual) {
  if (expected == actual) {
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure() << call_text << " returned " << DescribeNvmlResult(actual) << ", expected "
                                     << expected_text << " = " << DescribeNvmlResult(expected);
}

#define EXPECT_NVML(expected, call) EXPECT_PRED_FORMAT2(NvmlResultIs, expected, call)
#define ASSERT_NVML(expected, call) ASSERT_PRED_FORMAT2(NvmlResultIs, expected, call)
#define EXPECT_NVML_OK(call) EXPECT_NVML(NVML_SUCCESS, call)
#define ASSERT_NVML_OK(call) ASSERT_NVML(NVML_SUCCESS, call)

// "GPU-" and the 16 UUID bytes as 8-4-4-4-12 lowercase hexadecimal digits, the form nvidia-smi prints.
std::string UuidText(const CUuuid& uuid) { return vgpu::base::GpuUuidText(uuid.bytes); }

class NvmlTest : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NVML_OK(nvmlInit_v2());
    initialized_ = true;
    ASSERT_NVML_OK(nvmlDeviceGetHandleByIndex_v2(0, &device_));
  }

  void TearDown() override {
    if (initialized_) {
      EXPECT_NVML_OK(nvmlShutdown());
    }
  }

  bool initialized_ = false;
  nvmlDevice_t device_ = nullptr;
};

// A CUDA context on device 0, current on this thread, with some memory allocated in it.
class NvmlWithContextTest : public NvmlTest {
 protected:
  void SetUp() override {
    NvmlTest::SetUp();
    if (HasFatalFailure()) {
      return;
    }
    ASSERT_CU_OK(cuInit(0));
    ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context_, 0));
    ASSERT_CU_OK(cuCtxSetCurrent(context_));
    ASSERT_CU_OK(cuMemAlloc(&allocation_, kAllocationBytes));
  }

  void TearDown() override {
    if (allocation_ != 0) {
      EXPECT_CU_OK(cuMemFree(allocation_));
    }
    if (context_ != nullptr) {
      cuCtxSynchronize();
      cuCtxSetCurrent(nullptr);
      EXPECT_CU_OK(cuDevicePrimaryCtxRelease(0));
    }
    NvmlTest::TearDown();
  }

  // The NVML device that CUDA calls device 0: CUDA and NVML may enumerate in different orders, the UUID is common.
  nvmlDevice_t NvmlDeviceOfCudaDeviceZero() {
    CUuuid uuid{};
    EXPECT_CU_OK(cuDeviceGetUuid(&uuid, 0));
    nvmlDevice_t device = nullptr;
    EXPECT_NVML_OK(nvmlDeviceGetHandleByUUID(UuidText(uuid).c_str(), &device));
    return device;
  }

  static constexpr std::size_t kAllocationBytes = 64 * kMebibyte;
  CUcontext context_ = nullptr;
  CUdeviceptr allocation_ = 0;
};

TEST(NvmlLifecycleTest, InitIsReferenceCountedAndShutdownEndsIt) {
  ASSERT_NVML_OK(nvmlInit_v2());
  ASSERT_NVML_OK(nvmlInitWithFlags(0));
  unsigned int count = 0;
  ASSERT_NVML_OK(nvmlShutdown());
  EXPECT_NVML_OK(nvmlDeviceGetCount_v2(&count)) << "one init is still outstanding";
  ASSERT_NVML_OK(nvmlShutdown());
  EXPECT_NVML(NVML_ERROR_UNINITIALIZED, nvmlDeviceGetCount_v2(&count));
  nvmlDevice_t device = nullptr;
  EXPECT_NVML(NVML_ERROR_UNINITIALIZED, nvmlDeviceGetHandleByIndex_v2(0, &device));
  char version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
  // Observed on an H100 with driver 580.159.04: system queries need an initialized library too.
  EXPECT_NVML(NVML_ERROR_UNINITIALIZED, nvmlSystemGetDriverVersion(version, sizeof(version)));
  // Observed on an H100 with driver 580.159.04: a shutdown without a matching init is NVML_ERROR_UNINITIALIZED.
  EXPECT_NVML(NVML_ERROR_UNINITIALIZED, nvmlShutdown());
  // The library can be initialized again afterwards.
  ASSERT_NVML_OK(nvmlInit_v2());
  EXPECT_NVML_OK(nvmlDeviceGetCount_v2(&count));
  EXPECT_NVML_OK(nvmlShutdown());
}

TEST(NvmlLifecycleTest, ErrorStringsNeedNoInit) {
  EXPECT_STREQ(nvmlErrorString(NVML_SUCCESS), "Success");
  EXPECT_STREQ(nvmlErrorString(NVML_ERROR_UNINITIALIZED), "Uninitialized");
  EXPECT_STREQ(nvmlErrorString(NVML_ERROR_INVALID_ARGUMENT), "Invalid Argument");
  EXPECT_STREQ(nvmlErrorString(NVML_ERROR_NOT_SUPPORTED), "Not Supported");
  EXPECT_STREQ(nvmlErrorString(NVML_ERROR_NOT_FOUND), "Not Found");
  EXPECT_STREQ(nvmlErrorString(NVML_ERROR_INSUFFICIENT_SIZE), "Insufficient Size");
  EXPECT_STREQ(nvmlErrorString(NVML_ERROR_UNKNOWN), "Unknown Error");
  const char* unknown = nvmlErrorString(static_cast<nvmlReturn_t>(12345));
  EXPECT_NE(unknown, nullptr) << "an unknown code still gets a printable string";
}

TEST_F(NvmlTest, SystemVersions) {
  char driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = {};
  ASSERT_NVML_OK(nvmlSystemGetDriverVersion(driver, sizeof(driver)));
  EXPECT_TRUE(std::regex_match(driver, std::regex("[0-9]+\\.[0-9]+(\\.[0-9]+)?"))) << driver;
  char library[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE] = {};
  ASSERT_NVML_OK(nvmlSystemGetNVMLVersion(library, sizeof(library)));
  // Observed on an H100 with driver 580.159.04: the NVML version is "<API major>.<driver version>", e.g.
  // "13.580.159.04".
  EXPECT_TRUE(std::string(library).find(driver) != std::string::npos) << library << " vs " << driver;

  int cuda_version = 0;
  ASSERT_NVML_OK(nvmlSystemGetCudaDriverVersion_v2(&cuda_version));
  EXPECT_GE(cuda_version, 12000);
  int cuda_version_v1 = 0;
  ASSERT_NVML_OK(nvmlSystemGetCudaDriverVersion(&cuda_version_v1));
  EXPECT_EQ(cuda_version_v1, cuda_version);
  int from_cuda = 0;
  ASSERT_CU_OK(cuDriverGetVersion(&from_cuda));
  EXPECT_EQ(cuda_version, from_cuda) << "NVML and libcuda report the same CUDA driver version";

  if (RunningOnFakecuda()) {
    EXPECT_STREQ(driver, "580.95.05");
  }
  // Observed on an H100 with driver 580.159.04: a too-short buffer is NVML_ERROR_INSUFFICIENT_SIZE.
  EXPECT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, nvmlSystemGetDriverVersion(driver, 2));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlSystemGetCudaDriverVersion_v2(nullptr));
}

TEST_F(NvmlTest, DeviceCountAndHandlesByIndex) {
  unsigned int count = 0;
  ASSERT_NVML_OK(nvmlDeviceGetCount_v2(&count));
  EXPECT_GE(count, 1u);
  for (unsigned int index = 0; index < count; ++index) {
    nvmlDevice_t device = nullptr;
    ASSERT_NVML_OK(nvmlDeviceGetHandleByIndex_v2(index, &device));
    unsigned int read_index = 999;
    ASSERT_NVML_OK(nvmlDeviceGetIndex(device, &read_index));
    EXPECT_EQ(read_index, index);
    unsigned int minor = 999;
    EXPECT_NVML_OK(nvmlDeviceGetMinorNumber(device, &minor));
    EXPECT_LT(minor, 256u);
  }
  nvmlDevice_t device = nullptr;
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetHandleByIndex_v2(count, &device));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetHandleByIndex_v2(0, nullptr));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetCount_v2(nullptr));
}

TEST_F(NvmlTest, NameIsNonEmpty) {
  char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
  ASSERT_NVML_OK(nvmlDeviceGetName(device_, name, sizeof(name)));
  EXPECT_GT(std::strlen(name), 0u);
  if (RunningOnDefaultFakeH100()) {
    EXPECT_STREQ(name, "NVIDIA H100 80GB HBM3");
  }
  EXPECT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetName(device_, name, 2));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetName(nullptr, name, sizeof(name)));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetName(device_, nullptr, sizeof(name)));
}

TEST_F(NvmlTest, UuidFormatAndRoundTrip) {
  char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
  ASSERT_NVML_OK(nvmlDeviceGetUUID(device_, uuid, sizeof(uuid)));
  EXPECT_TRUE(std::regex_match(uuid, std::regex("GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")))
      << uuid;
  nvmlDevice_t found = nullptr;
  ASSERT_NVML_OK(nvmlDeviceGetHandleByUUID(uuid, &found));
  EXPECT_EQ(found, device_) << "a device has one handle";
  EXPECT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetUUID(device_, uuid, 5));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetUUID(device_, nullptr, sizeof(uuid)));
}

TEST_F(NvmlTest, UnknownOrMalformedIdentitiesAreRejected) {
  nvmlDevice_t found = nullptr;
  // "NVML_ERROR_NOT_FOUND if uuid does not match a valid device on the system".
  EXPECT_NVML(NVML_ERROR_NOT_FOUND, nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000", &found));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetHandleByUUID(nullptr, &found));
  // "NVML_ERROR_NOT_FOUND if pciBusId does not match a valid device on the system".
  EXPECT_NVML(NVML_ERROR_NOT_FOUND, nvmlDeviceGetHandleByPciBusId_v2("0000FFFF:FF:1F.0", &found));
  // Observed on an H100 with driver 580.159.04: a string that is no bus id is NVML_ERROR_INVALID_ARGUMENT rather than
  // NOT_FOUND.
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetHandleByPciBusId_v2("not-a-bus-id", &found));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetHandleByPciBusId_v2(nullptr, &found));
}

TEST_F(NvmlTest, PciInfoFormatAndRoundTrip) {
  nvmlPciInfo_t pci{};
  ASSERT_NVML_OK(nvmlDeviceGetPciInfo_v3(device_, &pci));
  // "00000000:1B:00.0": an 8-digit domain.
  EXPECT_TRUE(std::regex_match(pci.busId, std::regex("[0-9a-fA-F]{8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\\.[0-9a-fA-F]")))
      << pci.busId;
  EXPECT_TRUE(
      std::regex_match(pci.busIdLegacy, std::regex("[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\\.[0-9a-fA-F]")))
      << pci.busIdLegacy;
  EXPECT_EQ(pci.pciDeviceId & 0xFFFFu, 0x10DEu) << "the low half is NVIDIA's vendor id";
  EXPECT_LE(pci.bus, 0xFFu);
  EXPECT_LE(pci.device, 31u);
  unsigned int parsed_domain = 0;
  unsigned int parsed_bus = 0;
  unsigned int parsed_device = 0;
  ASSERT_EQ(std::sscanf(pci.busId, "%x:%x:%x", &parsed_domain, &parsed_bus, &parsed_device), 3) << pci.busId;
  EXPECT_EQ(parsed_domain, pci.domain);
  EXPECT_EQ(parsed_bus, pci.bus);
  EXPECT_EQ(parsed_device, pci.device);

  nvmlDevice_t found = nullptr;
  ASSERT_NVML_OK(nvmlDeviceGetHandleByPciBusId_v2(pci.busId, &found));
  EXPECT_EQ(found, device_);
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetPciInfo_v3(device_, nullptr));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetPciInfo_v3(nullptr, &pci));
}

TEST_F(NvmlTest, MemoryInfoV1AndV2Agree) {
  nvmlMemory_t memory{};
  ASSERT_NVML_OK(nvmlDeviceGetMemoryInfo(device_, &memory));
  EXPECT_GT(memory.total, 1ull << 30);
  // v1: "The total amount is equal to the sum of the amounts of free and used memory"; used includes reserved.
  EXPECT_EQ(memory.total, memory.free + memory.used);

  nvmlMemory_v2_t memory_v2{};
  memory_v2.version = nvmlMemory_v2;
  ASSERT_NVML_OK(nvmlDeviceGetMemoryInfo_v2(device_, &memory_v2));
  EXPECT_EQ(memory_v2.total, memory.total);
  EXPECT_GT(memory_v2.reserved, 0u) << "the driver and firmware always set some memory aside";
  // Observed on an H100 with driver 580.159.04: v2 splits v1's used into reserved and used, so the four add up
  // (81559 MiB total, 480 MiB reserved).
  EXPECT_EQ(memory_v2.total, memory_v2.reserved + memory_v2.used + memory_v2.free);

  if (RunningOnDefaultFakeH100()) {
    EXPECT_EQ(memory.total, 81559ull * kMebibyte);
  }
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetMemoryInfo(device_, nullptr));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetMemoryInfo(nullptr, &memory));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetMemoryInfo_v2(device_, nullptr));
}

TEST_F(NvmlTest, MemoryInfoV2ChecksTheStructVersion) {
  nvmlMemory_v2_t memory_v2{};
  // Observed on an H100 with driver 580.159.04: any version other than nvmlMemory_v2 (0, 1, v1's size, v2's size
  // with version 1 or 3) is NVML_ERROR_FUNCTION_NOT_FOUND, not NVML_ERROR_ARGUMENT_VERSION_MISMATCH.
  for (const unsigned int version : {0u, 1u, static_cast<unsigned int>(sizeof(nvmlMemory_t) | (1u << 24)),
                                     static_cast<unsigned int>(sizeof(nvmlMemory_v2_t) | (3u << 24))}) {
    memory_v2.version = version;
    EXPECT_NVML(NVML_ERROR_FUNCTION_NOT_FOUND, nvmlDeviceGetMemoryInfo_v2(device_, &memory_v2)) << version;
  }
}

TEST_F(NvmlTest, UtilizationRatesArePercentages) {
  nvmlUtilization_t utilization{};
  ASSERT_NVML_OK(nvmlDeviceGetUtilizationRates(device_, &utilization));
  EXPECT_LE(utilization.gpu, 100u);
  EXPECT_LE(utilization.memory, 100u);
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetUtilizationRates(device_, nullptr));
}

// The buffer size the driver asks for: a NULL buffer is a size query. Observed on an H100 with driver 580.159.04:
// NVML_ERROR_INSUFFICIENT_SIZE with a count (72 there) that is the size of the driver's sample buffer, not the
// number of processes, even when a timestamp in the future would find nothing; a smaller buffer is refused the same.
unsigned int ProcessSampleCapacity(nvmlDevice_t device) {
  unsigned int capacity = 0;
  EXPECT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetProcessUtilization(device, nullptr, &capacity, 0));
  EXPECT_GT(capacity, 0u);
  return capacity;
}

unsigned long long MicrosecondsSinceEpoch() {
  return static_cast<unsigned long long>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

TEST_F(NvmlTest, ProcessUtilizationSizeQuery) {
  const unsigned int capacity = ProcessSampleCapacity(device_);
  if (capacity > 1) {
    std::vector<nvmlProcessUtilizationSample_t> too_small(1);
    unsigned int count = 1;
    EXPECT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetProcessUtilization(device_, too_small.data(), &count, 0));
    EXPECT_EQ(count, capacity);
  }
  // Observed on an H100 with driver 580.159.04: a NULL device handle here is dereferenced (SIGSEGV), unlike in the
  // other calls of this suite, so it is checked on fakecuda only.
  if (RunningOnFakecuda()) {
    unsigned int count = 0;
    EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetProcessUtilization(nullptr, nullptr, &count, 0));
  }
}

TEST_F(NvmlTest, ProcessUtilizationFromTheFutureIsNotFound) {
  const unsigned int capacity = ProcessSampleCapacity(device_);
  std::vector<nvmlProcessUtilizationSample_t> samples(capacity);
  unsigned int count = capacity;
  // "If no valid sample entries are found since the lastSeenTimeStamp, NVML_ERROR_NOT_FOUND is returned."
  EXPECT_NVML(NVML_ERROR_NOT_FOUND, nvmlDeviceGetProcessUtilization(device_, samples.data(), &count,
                                                                    MicrosecondsSinceEpoch() + 3'600'000'000ull));
}

TEST_F(NvmlTest, ComputeCapabilityMatchesCuda) {
  int major = 0;
  int minor = 0;
  ASSERT_NVML_OK(nvmlDeviceGetCudaComputeCapability(device_, &major, &minor));
  EXPECT_GE(major, 7);
  ASSERT_CU_OK(cuInit(0));
  // Device 0 of CUDA and of NVML are the same GPU on a one-GPU machine; with several, compare any matching pair.
  unsigned int count = 0;
  ASSERT_NVML_OK(nvmlDeviceGetCount_v2(&count));
  if (count == 1) {
    int cuda_major = 0;
    int cuda_minor = 0;
    ASSERT_CU_OK(cuDeviceGetAttribute(&cuda_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
    ASSERT_CU_OK(cuDeviceGetAttribute(&cuda_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0));
    EXPECT_EQ(major, cuda_major);
    EXPECT_EQ(minor, cuda_minor);
  }
}

TEST_F(NvmlTest, ClocksArePlausible) {
  unsigned int sm_mhz = 0;
  unsigned int sm_max_mhz = 0;
  ASSERT_NVML_OK(nvmlDeviceGetClockInfo(device_, NVML_CLOCK_SM, &sm_mhz));
  ASSERT_NVML_OK(nvmlDeviceGetMaxClockInfo(device_, NVML_CLOCK_SM, &sm_max_mhz));
  EXPECT_GT(sm_mhz, 0u);
  EXPECT_LE(sm_mhz, sm_max_mhz);
  EXPECT_GE(sm_max_mhz, 500u);
  EXPECT_LE(sm_max_mhz, 5000u);
  unsigned int memory_mhz = 0;
  ASSERT_NVML_OK(nvmlDeviceGetClockInfo(device_, NVML_CLOCK_MEM, &memory_mhz));
  EXPECT_GT(memory_mhz, 0u);
  unsigned int graphics_mhz = 0;
  ASSERT_NVML_OK(nvmlDeviceGetClockInfo(device_, NVML_CLOCK_GRAPHICS, &graphics_mhz));
  EXPECT_GT(graphics_mhz, 0u);
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetClockInfo(device_, NVML_CLOCK_SM, nullptr));
}

TEST_F(NvmlTest, TemperatureIsPlausible) {
  nvmlTemperature_t temperature{};
  temperature.version = nvmlTemperature_v1;
  temperature.sensorType = NVML_TEMPERATURE_GPU;
  ASSERT_NVML_OK(nvmlDeviceGetTemperatureV(device_, &temperature));
  EXPECT_GE(temperature.temperature, 5);
  EXPECT_LE(temperature.temperature, 110);
  // The older call is deprecated in NVML 13 but is what pynvml and nvidia-smi-like tools call.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  unsigned int celsius = 0;
  ASSERT_NVML_OK(nvmlDeviceGetTemperature(device_, NVML_TEMPERATURE_GPU, &celsius));
  EXPECT_GE(celsius, 5u);
  EXPECT_LE(celsius, 110u);
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetTemperature(device_, NVML_TEMPERATURE_GPU, nullptr));
#pragma GCC diagnostic pop
}

TEST_F(NvmlTest, PowerIsPlausible) {
  unsigned int limit_mw = 0;
  ASSERT_NVML_OK(nvmlDeviceGetEnforcedPowerLimit(device_, &limit_mw));
  EXPECT_GE(limit_mw, 50'000u);
  EXPECT_LE(limit_mw, 1'500'000u);
  unsigned int usage_mw = 0;
  ASSERT_NVML_OK(nvmlDeviceGetPowerUsage(device_, &usage_mw));
  EXPECT_GT(usage_mw, 0u);
  EXPECT_LE(usage_mw, 2 * limit_mw);
}

TEST_F(NvmlWithContextTest, IdentitiesMatchTheCudaDriver) {
  const nvmlDevice_t device = NvmlDeviceOfCudaDeviceZero();
  ASSERT_NE(device, nullptr) << "the UUID CUDA reports is unknown to NVML";
  nvmlPciInfo_t pci{};
  ASSERT_NVML_OK(nvmlDeviceGetPciInfo_v3(device, &pci));
  int bus = -1;
  int pci_device = -1;
  int domain = -1;
  ASSERT_CU_OK(cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
  ASSERT_CU_OK(cuDeviceGetAttribute(&pci_device, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 0));
  ASSERT_CU_OK(cuDeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 0));
  EXPECT_EQ(pci.bus, static_cast<unsigned int>(bus));
  EXPECT_EQ(pci.device, static_cast<unsigned int>(pci_device));
  EXPECT_EQ(pci.domain, static_cast<unsigned int>(domain));

  char nvml_name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
  char cuda_name[256] = {};
  ASSERT_NVML_OK(nvmlDeviceGetName(device, nvml_name, sizeof(nvml_name)));
  ASSERT_CU_OK(cuDeviceGetName(cuda_name, sizeof(cuda_name), 0));
  EXPECT_STREQ(nvml_name, cuda_name);
}

TEST_F(NvmlWithContextTest, MemoryAgreesWithTheCudaDriver) {
  const nvmlDevice_t device = NvmlDeviceOfCudaDeviceZero();
  ASSERT_NE(device, nullptr);
  nvmlMemory_v2_t memory{};
  memory.version = nvmlMemory_v2;
  ASSERT_NVML_OK(nvmlDeviceGetMemoryInfo_v2(device, &memory));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_CU_OK(cuMemGetInfo(&free_bytes, &total_bytes));
  // Observed on an H100 with driver 580.159.04: cuMemGetInfo's total is NVML's total less NVML's reserved memory
  // (81079 = 81559 - 480 MiB) and both report the same free bytes.
  EXPECT_EQ(total_bytes, memory.total - memory.reserved);
  // Another process may allocate between the two calls.
  const unsigned long long free_difference =
      free_bytes > memory.free ? free_bytes - memory.free : memory.free - free_bytes;
  EXPECT_LE(free_difference, 64ull * kMebibyte) << "cuMemGetInfo free " << free_bytes << ", NVML free " << memory.free;
  // This process's context and allocation are in NVML's used memory.
  EXPECT_GE(memory.used, kAllocationBytes);
  if (RunningOnDefaultFakeH100()) {
    EXPECT_EQ(total_bytes, 81079ull * kMebibyte);
    EXPECT_EQ(memory.total, 81559ull * kMebibyte);
  }
}

TEST_F(NvmlWithContextTest, ThisProcessIsListedWithItsMemory) {
  const nvmlDevice_t device = NvmlDeviceOfCudaDeviceZero();
  ASSERT_NE(device, nullptr);
  unsigned int count = 0;
  // "call this function with *infoCount = 0. The return code will be NVML_ERROR_INSUFFICIENT_SIZE ... For this call
  // infos is allowed to be NULL."
  ASSERT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetComputeRunningProcesses_v3(device, &count, nullptr));
  ASSERT_GE(count, 1u) << "the needed count comes back with NVML_ERROR_INSUFFICIENT_SIZE";

  std::vector<nvmlProcessInfo_t> processes(count + 8);
  unsigned int capacity = static_cast<unsigned int>(processes.size());
  ASSERT_NVML_OK(nvmlDeviceGetComputeRunningProcesses_v3(device, &capacity, processes.data()));
  processes.resize(capacity);
  const auto self = std::find_if(processes.begin(), processes.end(), [](const nvmlProcessInfo_t& process) {
    return process.pid == static_cast<unsigned int>(getpid());
  });
  ASSERT_NE(self, processes.end()) << "pid " << getpid() << " holds a context but is not listed";
  EXPECT_GE(self->usedGpuMemory, kAllocationBytes) << "its context and allocation count as its memory";
  EXPECT_NE(self->usedGpuMemory, static_cast<unsigned long long>(NVML_VALUE_NOT_AVAILABLE));

  if (processes.size() > 1 || count > 1) {
    unsigned int too_few = 1;
    nvmlProcessInfo_t one{};
    EXPECT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetComputeRunningProcesses_v3(device, &too_few, &one));
    EXPECT_GE(too_few, 2u);
  }
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetComputeRunningProcesses_v3(device, nullptr, nullptr));
}

// One block of the spin kernel running for 2 s on the current context: the device is busy throughout.
void LaunchTwoSecondSpin(CUmodule& module) {
  CUfunction spin = nullptr;
  ASSERT_CU_OK(cuModuleLoadData(&module, kSpinKernelPtx));
  ASSERT_CU_OK(cuModuleGetFunction(&spin, module, kSpinKernelName));
  std::uint64_t ns_per_block = 2000 * kNanosecondsPerMillisecond;
  void* parameters[] = {&ns_per_block};
  ASSERT_CU_OK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, nullptr, parameters, nullptr));
}

TEST_F(NvmlWithContextTest, BusyDeviceShowsUtilization) {
  const nvmlDevice_t device = NvmlDeviceOfCudaDeviceZero();
  ASSERT_NE(device, nullptr);
  // NVML's utilization is the fraction of time a kernel ran, so it reads near 100 % once a sample period (about
  // 200 ms) of the 2 s spin has passed.
  CUmodule module = nullptr;
  LaunchTwoSecondSpin(module);
  if (HasFatalFailure()) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  nvmlUtilization_t utilization{};
  ASSERT_NVML_OK(nvmlDeviceGetUtilizationRates(device, &utilization));
  EXPECT_GE(utilization.gpu, 50u);
  EXPECT_LE(utilization.gpu, 100u);

  const unsigned int capacity = ProcessSampleCapacity(device);
  std::vector<nvmlProcessUtilizationSample_t> samples(capacity);
  unsigned int sample_count = capacity;
  ASSERT_NVML_OK(nvmlDeviceGetProcessUtilization(device, samples.data(), &sample_count, 0));
  samples.resize(sample_count);
  const auto self = std::find_if(samples.begin(), samples.end(), [](const nvmlProcessUtilizationSample_t& sample) {
    return sample.pid == static_cast<unsigned int>(getpid());
  });
  ASSERT_NE(self, samples.end()) << "a sample names this process while its kernel runs";
  EXPECT_GT(self->smUtil, 0u);
  EXPECT_LE(self->smUtil, 100u);
  EXPECT_GT(self->timeStamp, 0u);
  EXPECT_LE(self->timeStamp, MicrosecondsSinceEpoch()) << "timestamps are CPU time in microseconds since the epoch";

  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_CU_OK(cuModuleUnload(module));
}

// fakecuda's one entry point beyond NVML (fakecuda/process_busy.h): this process's exact kernel time, found with
// dlsym as its callers find it. A real NVML has none: skipped there.
TEST_F(NvmlWithContextTest, FakecudaProcessBusyIsThisProcesssKernelTime) {
  const auto busy_of =
      reinterpret_cast<fakecudaDeviceGetProcessBusy_t>(dlsym(RTLD_DEFAULT, "fakecudaDeviceGetProcessBusy"));
  if (busy_of == nullptr) GTEST_SKIP() << "not fakecuda's NVML: no fakecudaDeviceGetProcessBusy";
  const nvmlDevice_t device = NvmlDeviceOfCudaDeviceZero();
  ASSERT_NE(device, nullptr);
  CUmodule module = nullptr;
  CUfunction spin = nullptr;
  ASSERT_CU_OK(cuModuleLoadData(&module, kSpinKernelPtx));
  ASSERT_CU_OK(cuModuleGetFunction(&spin, module, kSpinKernelName));
  std::uint64_t ns_per_block = 300 * kNanosecondsPerMillisecond;
  void* parameters[] = {&ns_per_block};
  ASSERT_CU_OK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, nullptr, parameters, nullptr));
  ASSERT_CU_OK(cuCtxSynchronize());

  unsigned int count = 0;
  ASSERT_NVML(NVML_ERROR_INSUFFICIENT_SIZE, busy_of(device, &count, nullptr));
  ASSERT_GE(count, 1u) << "the size query counts this process";
  std::vector<fakecudaProcessBusy_t> entries(count + 4);
  unsigned int capacity = static_cast<unsigned int>(entries.size());
  ASSERT_NVML_OK(busy_of(device, &capacity, entries.data()));
  entries.resize(capacity);
  const auto self = std::find_if(entries.begin(), entries.end(), [](const fakecudaProcessBusy_t& entry) {
    return entry.pid == static_cast<unsigned int>(getpid()) && entry.running == 1;
  });
  ASSERT_NE(self, entries.end()) << "pid " << getpid() << " is not listed as running";
  EXPECT_GE(self->busy_ns, 300 * kNanosecondsPerMillisecond);
  EXPECT_LT(self->busy_ns, 310 * kNanosecondsPerMillisecond) << "its kernel's time, no more";
  EXPECT_GT(self->started_ns, 0u);
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, busy_of(device, nullptr, nullptr));
  EXPECT_NVML(NVML_ERROR_INVALID_ARGUMENT, busy_of(nullptr, &capacity, entries.data()));
  EXPECT_CU_OK(cuModuleUnload(module));
}

// The device's utilization samples: what the shim's `default` policy compares with its own busy time over the same
// period. A NULL buffer asks for the buffer size; samples are percent busy, stamped with CPU time in microseconds;
// nothing newer than a given timestamp is NVML_ERROR_NOT_FOUND.
TEST_F(NvmlWithContextTest, BusyDeviceUtilizationSamplesArePercentWithCpuTimestamps) {
  const nvmlDevice_t device = NvmlDeviceOfCudaDeviceZero();
  ASSERT_NE(device, nullptr);
  CUmodule module = nullptr;
  LaunchTwoSecondSpin(module);
  if (HasFatalFailure()) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));

  nvmlValueType_t type{};
  unsigned int capacity = 0;
  ASSERT_NVML_OK(nvmlDeviceGetSamples(device, NVML_GPU_UTILIZATION_SAMPLES, 0, &type, &capacity, nullptr));
  ASSERT_GT(capacity, 1u);
  std::vector<nvmlSample_t> samples(capacity);
  unsigned int count = capacity;
  ASSERT_NVML_OK(nvmlDeviceGetSamples(device, NVML_GPU_UTILIZATION_SAMPLES, 0, &type, &count, samples.data()));
  ASSERT_GE(count, 2u);
  EXPECT_EQ(type, NVML_VALUE_TYPE_UNSIGNED_INT);
  samples.resize(count);
  const auto newest =
      std::max_element(samples.begin(), samples.end(),
                       [](const nvmlSample_t& a, const nvmlSample_t& b) { return a.timeStamp < b.timeStamp; });
  std::printf("%u utilization samples; newest %llu us, %u; the one before it %llu us\n", count, newest->timeStamp,
              newest->sampleValue.uiVal, count > 1 ? samples[count - 2].timeStamp : 0ull);
  EXPECT_GE(newest->sampleValue.uiVal, 50u) << "a kernel ran throughout the newest sample's period";
  EXPECT_LE(newest->sampleValue.uiVal, 100u);
  EXPECT_LE(newest->timeStamp, MicrosecondsSinceEpoch());
  EXPECT_GE(newest->timeStamp + 5'000'000ull, MicrosecondsSinceEpoch()) << "the newest sample is recent";
  unsigned int none = capacity;
  EXPECT_NVML(NVML_ERROR_NOT_FOUND,
              nvmlDeviceGetSamples(device, NVML_GPU_UTILIZATION_SAMPLES, MicrosecondsSinceEpoch() + 60'000'000ull,
                                   &type, &none, samples.data()));
  ASSERT_CU_OK(cuCtxSynchronize());
  EXPECT_CU_OK(cuModuleUnload(module));
}

}  // namespace
}  // namespace vgpu::conformance
