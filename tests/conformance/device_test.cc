// Conformance: device enumeration, the attributes frameworks query, name, UUID, total memory and PCI bus id.
#include <cstring>
#include <regex>
#include <string>

#include "conformance_support.h"

namespace vgpu::conformance {
namespace {

class DeviceTest : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_CU_OK(cuInit(0));
    ASSERT_CU_OK(cuDeviceGetCount(&count_));
    ASSERT_GT(count_, 0) << "the conformance suites need at least one device";
    ASSERT_CU_OK(cuDeviceGet(&device_, 0));
  }

  int Attribute(CUdevice_attribute attribute) const {
    int value = -1;
    EXPECT_CU_OK(cuDeviceGetAttribute(&value, attribute, device_)) << "attribute " << static_cast<int>(attribute);
    return value;
  }

  int count_ = 0;
  CUdevice device_ = 0;
};

TEST_F(DeviceTest, GetCountRejectsNull) { EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetCount(nullptr)); }

TEST_F(DeviceTest, GetOutOfRangeOrdinalIsInvalidDevice) {
  CUdevice device = -1;
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet(&device, count_));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet(&device, -1));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGet(nullptr, 0));
}

TEST_F(DeviceTest, EveryOrdinalInRangeIsAvailable) {
  for (int ordinal = 0; ordinal < count_; ++ordinal) {
    CUdevice device = -1;
    EXPECT_CU_OK(cuDeviceGet(&device, ordinal));
    EXPECT_EQ(device, ordinal);
  }
}

TEST_F(DeviceTest, ExecutionAttributesFrameworksQuery) {
  EXPECT_GT(Attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT), 0);
  EXPECT_GE(Attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), 7);
  const int minor = Attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  EXPECT_GE(minor, 0);
  EXPECT_LE(minor, 9);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK), 1024);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_WARP_SIZE), 32);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X), 1024);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y), 1024);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z), 64);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X), 2147483647);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y), 65535);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z), 65535);
  // 1024 on Turing (T4), 2048 on Volta, Ampere A100 and Hopper.
  const int threads_per_multiprocessor = Attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
  EXPECT_GE(threads_per_multiprocessor, 1024);
  EXPECT_LE(threads_per_multiprocessor, 2048);
  EXPECT_EQ(threads_per_multiprocessor % 32, 0);
  const int blocks_per_multiprocessor = Attribute(CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR);
  EXPECT_GE(blocks_per_multiprocessor, 16);
  EXPECT_LE(blocks_per_multiprocessor, 32);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK), 65536);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR), 65536);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS), 1);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH), 1);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED), 1);
  EXPECT_GE(Attribute(CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT), 1);
}

TEST_F(DeviceTest, MemoryAttributesFrameworksQuery) {
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK), 48 * 1024);
  EXPECT_GE(Attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), 48 * 1024);
  // 64 KiB on Turing, up to 228 KiB on Hopper.
  const int shared_per_multiprocessor = Attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
  EXPECT_GE(shared_per_multiprocessor, 64 * 1024);
  EXPECT_LE(shared_per_multiprocessor, 256 * 1024);
  const int bus_width_bits = Attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
  EXPECT_GT(bus_width_bits, 0);
  EXPECT_EQ(bus_width_bits % 32, 0) << bus_width_bits;
  EXPECT_GE(Attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE), 1 << 20);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING), 1);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY), 1);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY), 1);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_INTEGRATED), 0);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED), 1);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED), 1);
  const int pitch_alignment = Attribute(CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT);
  EXPECT_GT(pitch_alignment, 0);
  EXPECT_EQ(pitch_alignment & (pitch_alignment - 1), 0) << "not a power of two: " << pitch_alignment;
}

TEST_F(DeviceTest, ClockAttributesArePlausible) {
  // Kilohertz: between 100 MHz and 5 GHz.
  const int clock_khz = Attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE);
  EXPECT_GE(clock_khz, 100'000);
  EXPECT_LE(clock_khz, 5'000'000);
  const int memory_clock_khz = Attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
  EXPECT_GE(memory_clock_khz, 100'000);
  EXPECT_LE(memory_clock_khz, 50'000'000);
}

TEST_F(DeviceTest, PciAttributesAreInRange) {
  const int bus = Attribute(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
  EXPECT_GE(bus, 0);
  EXPECT_LE(bus, 255);
  const int device = Attribute(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID);
  EXPECT_GE(device, 0);
  EXPECT_LE(device, 31);
  EXPECT_GE(Attribute(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID), 0);
}

TEST_F(DeviceTest, InvalidAttributeIsInvalidValue) {
  int value = -1;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_MAX, device_));
  // Observed on an H100 with driver 580.159.04: 0 is below the first attribute (1) and is rejected the same way.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetAttribute(&value, static_cast<CUdevice_attribute>(0), device_));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetAttribute(nullptr, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_));
}

TEST_F(DeviceTest, AttributeOfOutOfRangeDeviceIsInvalidDevice) {
  int value = -1;
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_WARP_SIZE, count_));
}

TEST_F(DeviceTest, TotalMemoryIsPlausible) {
  size_t total_bytes = 0;
  ASSERT_CU_OK(cuDeviceTotalMem(&total_bytes, device_));
  EXPECT_GE(total_bytes, std::size_t{1} << 30);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceTotalMem(nullptr, device_));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceTotalMem(&total_bytes, count_));
}

TEST_F(DeviceTest, NameIsNonEmptyAndTerminated) {
  char name[256];
  std::memset(name, 'x', sizeof(name));
  ASSERT_CU_OK(cuDeviceGetName(name, sizeof(name), device_));
  const std::size_t length = strnlen(name, sizeof(name));
  EXPECT_GT(length, 0u);
  EXPECT_LT(length, sizeof(name));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetName(nullptr, sizeof(name), device_));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetName(name, sizeof(name), count_));
}

TEST_F(DeviceTest, NameIsTruncatedToTheBuffer) {
  char full[256] = {};
  ASSERT_CU_OK(cuDeviceGetName(full, sizeof(full), device_));
  char small[8];
  std::memset(small, 'x', sizeof(small));
  // Observed on an H100 with driver 580.159.04: a short buffer gets the first len-1 characters and a terminator.
  ASSERT_CU_OK(cuDeviceGetName(small, sizeof(small), device_));
  EXPECT_LT(strnlen(small, sizeof(small)), sizeof(small)) << "no terminator within the buffer";
  EXPECT_EQ(std::string(full).substr(0, strnlen(small, sizeof(small))), std::string(small));
}

TEST_F(DeviceTest, FakeH100PresetFigures) {
  if (!RunningOnDefaultFakeH100()) {
    GTEST_SKIP() << "the figures of fakecuda's default h100-80gb preset";
  }
  char name[256] = {};
  ASSERT_CU_OK(cuDeviceGetName(name, sizeof(name), device_));
  EXPECT_STREQ(name, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT), 132);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), 9);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR), 0);
  EXPECT_EQ(Attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR), 2048);
  size_t total_bytes = 0;
  ASSERT_CU_OK(cuDeviceTotalMem(&total_bytes, device_));
  EXPECT_EQ(total_bytes, std::size_t{81079} * kMebibyte);
}

TEST_F(DeviceTest, UuidIsNonZeroAndDistinctPerDevice) {
  std::string previous;
  for (int ordinal = 0; ordinal < count_; ++ordinal) {
    CUuuid uuid{};
    ASSERT_CU_OK(cuDeviceGetUuid(&uuid, ordinal));
    const std::string bytes(uuid.bytes, sizeof(uuid.bytes));
    EXPECT_NE(bytes, std::string(sizeof(uuid.bytes), '\0')) << "device " << ordinal;
    EXPECT_NE(bytes, previous) << "devices " << ordinal - 1 << " and " << ordinal << " share a UUID";
    previous = bytes;
  }
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetUuid(nullptr, device_));
  CUuuid uuid{};
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetUuid(&uuid, count_));
}

TEST_F(DeviceTest, PciBusIdFormatAndRoundTrip) {
  for (int ordinal = 0; ordinal < count_; ++ordinal) {
    char bus_id[64] = {};
    ASSERT_CU_OK(cuDeviceGetPCIBusId(bus_id, sizeof(bus_id), ordinal));
    // domain:bus:device.function in hexadecimal, e.g. "0000:1b:00.0".
    EXPECT_TRUE(std::regex_match(bus_id, std::regex("[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\\.[0-9a-fA-F]")))
        << bus_id;
    CUdevice found = -1;
    ASSERT_CU_OK(cuDeviceGetByPCIBusId(&found, bus_id));
    EXPECT_EQ(found, ordinal) << bus_id;

    int bus = -1;
    int device = -1;
    int domain = -1;
    ASSERT_CU_OK(cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, ordinal));
    ASSERT_CU_OK(cuDeviceGetAttribute(&device, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, ordinal));
    ASSERT_CU_OK(cuDeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, ordinal));
    unsigned int parsed_domain = 0;
    unsigned int parsed_bus = 0;
    unsigned int parsed_device = 0;
    unsigned int parsed_function = 0;
    ASSERT_EQ(std::sscanf(bus_id, "%x:%x:%x.%x", &parsed_domain, &parsed_bus, &parsed_device, &parsed_function), 4);
    EXPECT_EQ(parsed_domain, static_cast<unsigned int>(domain)) << bus_id;
    EXPECT_EQ(parsed_bus, static_cast<unsigned int>(bus)) << bus_id;
    EXPECT_EQ(parsed_device, static_cast<unsigned int>(device)) << bus_id;
  }
}

TEST_F(DeviceTest, ByPciBusIdAcceptsTheLongDomainForm) {
  char bus_id[64] = {};
  ASSERT_CU_OK(cuDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_));
  // NVML writes an 8-digit domain ("00000000:1B:00.0"); tools pass that form to CUDA too.
  const std::string long_form = "0000" + std::string(bus_id);
  CUdevice found = -1;
  // Observed on an H100 with driver 580.159.04: the 8-digit domain form is accepted.
  ASSERT_CU_OK(cuDeviceGetByPCIBusId(&found, long_form.c_str())) << long_form;
  EXPECT_EQ(found, device_);
}

TEST_F(DeviceTest, ByPciBusIdRejectsGarbageAndAbsentDevices) {
  CUdevice found = -1;
  // Observed on an H100 with driver 580.159.04: a string that does not parse is CUDA_ERROR_INVALID_VALUE.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetByPCIBusId(&found, "not-a-bus-id"));
  // Observed on an H100 with driver 580.159.04: a well-formed id of no device here is CUDA_ERROR_INVALID_DEVICE.
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetByPCIBusId(&found, "ffff:ff:1f.7"));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cuDeviceGetByPCIBusId(&found, nullptr));
}

}  // namespace
}  // namespace vgpu::conformance
