// Configuration as a process under the shim lives it, each case a child process with its own environment: a value
// that does not parse fails closed (no GPU, one line on stderr, the process keeps its own exit code), sizes mean what
// they say, no limit leaves the driver's numbers, a limit above the device is clamped, per-device limits follow
// CUDA_VISIBLE_DEVICES (indices and UUIDs) for CUDA and NVML alike.
#include <fstream>
#include <sstream>

#include "shim_support.h"

namespace vgpu::shimtest {
namespace {

using EnvMap = std::map<std::string, std::optional<std::string>>;

EnvMap With(EnvMap env, const EnvMap& more) {
  for (const auto& [key, value] : more) env[key] = value;
  return env;
}

std::vector<std::string> NonEmptyLines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

// Runs `failclosed` under the shim with `env` and checks that no route reaches the GPU, that one line on stderr names
// `variable` and `value`, and that the process ended with its own exit code.
void ExpectFailsClosed(const std::string& name, const EnvMap& overrides, const std::string& variable,
                       const std::string& value) {
  Child child = RunWorker({"failclosed"}, With(ShimEnv(name, ""), overrides));
  ASSERT_TRUE(child.exited()) << "the process did not exit by itself: " << child.Describe();
  EXPECT_EQ(child.exit_code(), 42) << "the shim ended the process instead of failing its calls\n" << child.Describe();
  const auto values = child.Values();
  for (const char* call : {"cuInit", "cuDevicePrimaryCtxRetain", "cuCtxCreate", "cuMemAlloc", "cuMemGetInfo",
                           "nvmlInit_v2", "nvmlInitWithFlags", "dlsym.cuInit", "procaddress.cuInit"}) {
    ASSERT_TRUE(values.count(call) != 0) << call << " not reported\n" << child.Describe();
    if (std::string(call) == "dlsym.cuInit" && !ShimInterposesDlsym()) continue;  // no dlsym route in this build
    EXPECT_NE(values.at(call), "0") << call << " succeeded in a process whose configuration is invalid";
  }
  const std::vector<std::string> lines = NonEmptyLines(child.Stderr());
  ASSERT_EQ(lines.size(), 1u) << "expected one line on stderr:\n" << child.Stderr();
  EXPECT_NE(lines[0].find(variable), std::string::npos) << "the message does not name " << variable << ": " << lines[0];
  EXPECT_NE(lines[0].find(value), std::string::npos)
      << "the message does not show the value " << value << ": " << lines[0];
}

TEST(FailClosed, LimitWithAnUnknownSuffixFailsClosed) {
  ExpectFailsClosed("m", {{"CUDA_DEVICE_MEMORY_LIMIT", "4x"}}, "CUDA_DEVICE_MEMORY_LIMIT", "4x");
}

TEST(FailClosed, NegativeLimitFailsClosed) {
  ExpectFailsClosed("m", {{"CUDA_DEVICE_MEMORY_LIMIT", "-1"}}, "CUDA_DEVICE_MEMORY_LIMIT", "-1");
}

TEST(FailClosed, LimitThatIsNotANumberFailsClosed) {
  ExpectFailsClosed("m", {{"CUDA_DEVICE_MEMORY_LIMIT", "abc"}}, "CUDA_DEVICE_MEMORY_LIMIT", "abc");
}

TEST(FailClosed, LimitOf2To64BytesOrMoreFailsClosed) {
  // 2^24 TiB = 2^64 bytes: an overflow, never a wrap to a small number.
  ExpectFailsClosed("m", {{"CUDA_DEVICE_MEMORY_LIMIT", "16777216T"}}, "CUDA_DEVICE_MEMORY_LIMIT", "16777216T");
}

TEST(FailClosed, PerDeviceLimitThatDoesNotParseFailsClosed) {
  ExpectFailsClosed("m", {{"CUDA_DEVICE_MEMORY_LIMIT_0", "1.5g"}}, "CUDA_DEVICE_MEMORY_LIMIT_0", "1.5g");
}

TEST(FailClosed, ConfigFileThatDoesNotParseFailsClosed) {
  const std::string file = TestFolder() + "/bad.conf";
  std::ofstream(file) << "CUDA_DEVICE_MEMORY_LIMIT=4x\n";
  ExpectFailsClosed("m", {{"VGPU_CONFIG_FILE", file}, {"CUDA_DEVICE_MEMORY_LIMIT", "1Gi"}}, "CUDA_DEVICE_MEMORY_LIMIT",
                    "4x");
}

TEST(FailClosed, RegionFileThatIsNotARegionFailsClosed) {
  const std::string region = TestFolder() + "/foreign.region";
  std::ofstream(region) << std::string(4096, 'x');
  Child child = RunWorker({"failclosed"}, With(ShimEnv("m", "1Gi"), {{"CUDA_DEVICE_MEMORY_SHARED_CACHE", region}}));
  ASSERT_TRUE(child.exited()) << child.Describe();
  EXPECT_EQ(child.exit_code(), 42) << child.Describe();
  const auto values = child.Values();
  EXPECT_NE(values.count("cuDevicePrimaryCtxRetain") ? values.at("cuDevicePrimaryCtxRetain") : "", "0")
      << "a process whose region is unusable got a context";
  const std::vector<std::string> lines = NonEmptyLines(child.Stderr());
  ASSERT_EQ(lines.size(), 1u) << child.Stderr();
  EXPECT_NE(lines[0].find(region), std::string::npos) << "the message does not name the region file: " << lines[0];
}

// ---- sizes --------------------------------------------------------------------------------------------------

// The slice a process sees with CUDA_DEVICE_MEMORY_LIMIT=`limit`: every total view, from a fresh machine of its own.
void ExpectTotal(const std::string& name, const std::string& limit, std::uint64_t expected) {
  SCOPED_TRACE("CUDA_DEVICE_MEMORY_LIMIT=" + limit);
  Child child = RunWorker({"views", "ctx=0"}, ShimEnv(name, limit));
  ASSERT_EQ(child.exit_code(), 0) << child.Describe();
  const auto values = child.Values();
  ASSERT_EQ(values.at("ctx.result"), "0") << child.Describe();
  EXPECT_EQ(Number(values, "cu.total"), expected);
  EXPECT_EQ(Number(values, "cuda.0.total_mem"), expected);
  EXPECT_EQ(Number(values, "nvml.0.v1.total"), expected);
  EXPECT_EQ(Number(values, "nvml.0.v2.total"), expected);
}

TEST(Config, SizeWrittenInOctalIsDecimal) { ExpectTotal("octal", "010g", 10 * kGiB); }

TEST(Config, SizesAreBytesOrPowersOf1024) {
  int n = 0;
  for (const char* limit :
       {"1073741824", "1048576k", "1048576K", "1048576Ki", "1024m", "1024M", "1024Mi", "1g", "1G", "1Gi"}) {
    ExpectTotal("sizes-" + std::to_string(n++), limit, kGiB);
  }
}

// The views of a fresh machine without the shim, and with it under `limit`: (driver, shim).
std::pair<std::map<std::string, std::string>, std::map<std::string, std::string>> DriverAndShim(
    const std::string& name, const std::string& limit, const std::vector<std::string>& args) {
  Child driver = RunWorker(args, NoShimEnv(name + "-driver"));
  EXPECT_EQ(driver.exit_code(), 0) << driver.Describe();
  Child shim = RunWorker(args, ShimEnv(name + "-shim", limit));
  EXPECT_EQ(shim.exit_code(), 0) << shim.Describe();
  return {driver.Values(), shim.Values()};
}

TEST(Config, NoLimitLeavesTheDriversNumbers) {
  for (const char* limit : {"", "0"}) {
    SCOPED_TRACE(std::string("CUDA_DEVICE_MEMORY_LIMIT=") + (*limit != '\0' ? limit : "(unset)"));
    const auto [driver, shim] =
        DriverAndShim(std::string("nolimit") + limit, limit, {"views", "ctx=0", "alloc=" + std::to_string(100 * kMiB)});
    for (const char* key : {"cu.free", "cu.total", "cu.free_after", "cuda.0.total_mem", "nvml.0.v1.total",
                            "nvml.0.v1.used", "nvml.0.v1.free", "nvml.0.v2.total", "nvml.0.v2.reserved",
                            "nvml.0.v2.used", "nvml.0.v2.free", "alloc.result"}) {
      ASSERT_TRUE(driver.count(key) != 0 && shim.count(key) != 0) << key;
      EXPECT_EQ(shim.at(key), driver.at(key)) << key << " differs from the driver's own number";
    }
    EXPECT_NE(Number(shim, "cuda.0.total_mem"), 0u) << "cuDeviceTotalMem without a limit must not be 0";
  }
}

TEST(Config, LimitAbovePhysicalIsClampedToPhysical) {
  for (const char* limit : {"100Gi", "4T"}) {  // 4T is four tebibytes, not four bytes
    SCOPED_TRACE(std::string("CUDA_DEVICE_MEMORY_LIMIT=") + limit);
    const auto [driver, shim] = DriverAndShim(std::string("above-") + limit, limit, {"views", "ctx=0"});
    ASSERT_EQ(shim.at("ctx.result"), "0");
    EXPECT_EQ(Number(shim, "cu.total"), Number(driver, "cu.total")) << "cuMemGetInfo total larger than the device's";
    EXPECT_EQ(Number(shim, "cuda.0.total_mem"), Number(driver, "cuda.0.total_mem"));
    EXPECT_EQ(Number(shim, "nvml.0.v1.total"), Number(driver, "nvml.0.v1.total"));
    EXPECT_EQ(Number(shim, "nvml.0.v2.total"), Number(driver, "nvml.0.v2.total"));
    EXPECT_LE(Number(shim, "cu.free"), Number(driver, "cu.free"));
    if (RunningOnFakecuda()) {
      EXPECT_EQ(Number(shim, "cu.total"), kH100CudaTotal);
      EXPECT_EQ(Number(shim, "nvml.0.v1.total"), kH100NvmlTotal);
    }
  }
}

TEST(Config, NvmlFreeNeverExceedsWhatTheDeviceHasWhenTheLimitIsAboveIt) {
  // With a limit above the device, NVML's total is the device's; its free must not exceed the device's free either
  // (the driver reserves 480 MiB of an H100 that no process can have), as cuMemGetInfo's free does not.
  const auto [driver, shim] = DriverAndShim("above-free", "100Gi", {"views", "ctx=0"});
  EXPECT_LE(Number(shim, "nvml.0.v1.free"), Number(driver, "nvml.0.v1.free"))
      << "nvmlDeviceGetMemoryInfo reports more free memory than the device has";
  EXPECT_LE(Number(shim, "nvml.0.v2.free"), Number(driver, "nvml.0.v2.free"))
      << "nvmlDeviceGetMemoryInfo_v2 reports more free memory than the device has";
}

// ---- per-device limits and CUDA_VISIBLE_DEVICES -------------------------------------------------------------

class PerDevice : public testing::Test {
 protected:
  static constexpr const char* kDevices = "2*h100-80gb";
  void SetUp() override {
    Child host = RunWorker({"views"}, With(NoShimEnv("two"), {{"FAKECUDA_DEVICES", kDevices}}));
    ASSERT_EQ(host.exit_code(), 0) << host.Describe();
    host_ = host.Values();
    ASSERT_EQ(host_.at("nvml.count"), "2") << host.Describe();
  }
  EnvMap ShimOnTwo(const EnvMap& more) {
    EnvMap env = With(ShimEnv("two", ""), {{"FAKECUDA_DEVICES", kDevices}});
    return With(env, more);
  }
  std::map<std::string, std::string> host_;
};

TEST_F(PerDevice, PerDeviceLimitFollowsCudaVisibleDevices) {
  const EnvMap env = ShimOnTwo({{"CUDA_VISIBLE_DEVICES", "1"}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1Gi"}});
  Child child = RunWorker({"views", "ctx=0", "alloc=" + std::to_string(600 * kMiB)}, env);
  ASSERT_EQ(child.exit_code(), 0) << child.Describe();
  const auto v = child.Values();
  ASSERT_EQ(v.at("cuda.count"), "1");
  EXPECT_EQ(v.at("cuda.0.uuid"), host_.at("nvml.1.uuid")) << "CUDA ordinal 0 is physical device 1";
  EXPECT_EQ(Number(v, "cuda.0.total_mem"), kGiB);
  EXPECT_EQ(Number(v, "cu.total"), kGiB);
  EXPECT_EQ(v.at("alloc.result"), std::to_string(CUDA_ERROR_OUT_OF_MEMORY)) << "600 MiB next to a context in 1 GiB";
  // NVML numbers devices on the host: its device 1 is the limited one; its device 0 is not this process's.
  EXPECT_EQ(Number(v, "nvml.1.v1.total"), kGiB) << "NVML's view of physical device 1 does not show the slice";
  EXPECT_EQ(Number(v, "nvml.1.v2.total"), kGiB);
  EXPECT_EQ(v.at("nvml.0.v1.total"), host_.at("nvml.0.v1.total")) << "physical device 0 must be unaffected";
  EXPECT_EQ(v.at("nvml.0.v1.used"), host_.at("nvml.0.v1.used"));
  EXPECT_EQ(v.at("nvml.0.v2.total"), host_.at("nvml.0.v2.total"));
}

TEST_F(PerDevice, ChargesLandOnThePhysicalDeviceAsTheHostSeesIt) {
  Pipe done, go;
  const EnvMap env = ShimOnTwo({{"CUDA_VISIBLE_DEVICES", "1"}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1Gi"}});
  Child holder = Child::Worker({"views", "ctx=0", "alloc=" + std::to_string(256 * kMiB), "hold=1"}, env,
                               {{done.write_fd, kDoneFd}, {go.read_fd, kGoFd}});
  done.CloseWrite();
  go.CloseRead();
  ASSERT_TRUE(done.ReadBytes(1, std::chrono::steady_clock::now() + std::chrono::seconds(20))) << holder.Describe();
  Child host = RunWorker({"views"}, With(NoShimEnv("two"), {{"FAKECUDA_DEVICES", kDevices}}));
  const auto h = host.Values();
  EXPECT_GE(Number(h, "nvml.1.v2.used"), 256 * kMiB) << "the allocation is not on physical device 1";
  EXPECT_EQ(Number(h, "nvml.0.v2.used"), 0u) << "physical device 0 holds memory of a process that cannot see it";
  go.CloseWrite();
  ASSERT_TRUE(holder.Wait(std::chrono::seconds(10))) << holder.Describe();
  EXPECT_EQ(holder.exit_code(), 0) << holder.Describe();
  const auto v = holder.Values();
  EXPECT_EQ(v.at("alloc.result"), "0");
  EXPECT_EQ(Number(v, "nvml.1.v1.used"), Number(h, "nvml.1.v2.used")) << "the slice and the host disagree on usage";
}

TEST_F(PerDevice, PerDeviceLimitFollowsAUuidInCudaVisibleDevices) {
  const EnvMap env =
      ShimOnTwo({{"CUDA_VISIBLE_DEVICES", host_.at("nvml.1.uuid")}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1Gi"}});
  Child child = RunWorker({"views", "ctx=0"}, env);
  ASSERT_EQ(child.exit_code(), 0) << child.Describe();
  const auto v = child.Values();
  ASSERT_EQ(v.at("cuda.count"), "1");
  EXPECT_EQ(v.at("cuda.0.uuid"), host_.at("nvml.1.uuid"));
  EXPECT_EQ(Number(v, "cu.total"), kGiB);
  EXPECT_EQ(Number(v, "nvml.1.v1.total"), kGiB);
  EXPECT_EQ(v.at("nvml.0.v1.total"), host_.at("nvml.0.v1.total"));
}

TEST_F(PerDevice, PerDeviceLimitsFollowAReorderedCudaVisibleDevices) {
  // CUDA ordinal 0 is physical 1 and ordinal 1 is physical 0 (HAMi-core#318: indices of CUDA and NVML mixed up).
  const EnvMap env = ShimOnTwo(
      {{"CUDA_VISIBLE_DEVICES", "1,0"}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1Gi"}, {"CUDA_DEVICE_MEMORY_LIMIT_1", "3Gi"}});
  Child child = RunWorker({"views", "ctx=1"}, env);
  ASSERT_EQ(child.exit_code(), 0) << child.Describe();
  const auto v = child.Values();
  ASSERT_EQ(v.at("cuda.count"), "2");
  EXPECT_EQ(Number(v, "cuda.0.total_mem"), kGiB);
  EXPECT_EQ(Number(v, "cuda.1.total_mem"), 3 * kGiB);
  EXPECT_EQ(Number(v, "cu.total"), 3 * kGiB) << "cuMemGetInfo in a context of ordinal 1";
  EXPECT_EQ(Number(v, "nvml.1.v1.total"), kGiB) << "physical 1 is CUDA ordinal 0";
  EXPECT_EQ(Number(v, "nvml.0.v1.total"), 3 * kGiB) << "physical 0 is CUDA ordinal 1";
}

TEST_F(PerDevice, PerDeviceLimitOverridesTheBaseLimit) {
  const EnvMap env = ShimOnTwo({{"CUDA_DEVICE_MEMORY_LIMIT", "2Gi"}, {"CUDA_DEVICE_MEMORY_LIMIT_1", "1Gi"}});
  Child child = RunWorker({"views"}, env);
  ASSERT_EQ(child.exit_code(), 0) << child.Describe();
  const auto v = child.Values();
  EXPECT_EQ(Number(v, "cuda.0.total_mem"), 2 * kGiB);
  EXPECT_EQ(Number(v, "cuda.1.total_mem"), kGiB);
  EXPECT_EQ(Number(v, "nvml.0.v1.total"), 2 * kGiB);
  EXPECT_EQ(Number(v, "nvml.1.v1.total"), kGiB);
}

}  // namespace
}  // namespace vgpu::shimtest
