// vgpu-monitor's metrics (docs/metrics.md): the exposition text of made-up periods, label escaping, HAMi's v1 cache
// file read from made-up images and files (bad ones reported and skipped), and the HTTP answers.
#include "vgpu/monitor/metrics.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "vgpu/monitor/hami_cache.h"
#include "vgpu/monitor/metrics_server.h"
#include "vgpu/monitor/monitor.h"
#include "vgpu/monitor/region_counters.h"
#include "vgpu/region/hami_v1.h"
#include "vgpu/region/layout.h"
#include "vgpu/region/region.h"

namespace vgpu::monitor {
namespace {

namespace hami = vgpu::region::hami;

constexpr const char* kGpu0 = "GPU-00000000-3c4d-5e6f-7a8b-9c0d1e2f3a4b";
constexpr const char* kGpu1 = "GPU-11111111-3c4d-5e6f-7a8b-9c0d1e2f3a4b";
constexpr std::uint64_t kGiB = 1ull << 30;

Container Parsed(const std::string& name, const std::string& text) {
  Container c;
  std::string error;
  EXPECT_TRUE(ParseContainer(name, text, name + ".conf", c, error)) << error;
  return c;
}

Reading On(const char* device, std::uint32_t host_pid, const std::string& cgroup, std::uint64_t memory,
           std::uint32_t sm) {
  Reading r;
  r.host_pid = host_pid;
  r.pid = host_pid;
  r.cgroup = cgroup;
  r.device = device;
  r.memory_used = memory;
  r.sm_used = sm;
  return r;
}

// Two containers on two devices: `a` (4 GiB, 30 %, its pod named) alone on GPU 1, shares GPU 0 with `b` (no limits).
PeriodFigures TwoContainers() {
  PeriodFigures figures;
  figures.containers = {
      Parsed("a", std::string("VGPU_CGROUP=/pod/a\nVGPU_DEVICES=") + kGpu1 + "," + kGpu0 +
                      "\nCUDA_DEVICE_MEMORY_LIMIT=4Gi\nCUDA_DEVICE_SM_LIMIT=30\nVGPU_POD_NAMESPACE=ml\n"
                      "VGPU_POD_NAME=train-0\nVGPU_CONTAINER_NAME=main\nVGPU_CACHE=/x/a.cache\n"),
      Parsed("b", "VGPU_CGROUP=/pod/b\n")};
  const std::vector<Reading> readings = {On(kGpu1, 10, "/pod/a", kGiB, 250), On(kGpu0, 11, "/pod/a", 2 * kGiB, 400),
                                         On(kGpu0, 20, "/pod/b", kGiB, 300)};
  figures.judgements = Judge(figures.containers, {kGpu0, kGpu1}, readings, false);
  figures.devices = {{0, kGpu0, 3 * kGiB + 5, 80 * kGiB, 57}, {1, kGpu1, kGiB, 80 * kGiB, std::nullopt}};
  figures.periods = 42;
  figures.stamp_ns = 1'795'420'000'123'456'789ull;
  return figures;
}

// The samples of the text: "name{labels}" -> value. Also checks the families are well formed: one TYPE per name,
// before its samples, and each family's samples together.
std::map<std::string, std::string> Samples(const std::string& text) {
  std::map<std::string, std::string> samples;
  std::vector<std::string> typed;
  std::string line;
  std::istringstream in(text);
  while (std::getline(in, line)) {
    if (line.rfind("# HELP ", 0) == 0) continue;
    if (line.rfind("# TYPE ", 0) == 0) {
      const std::string name = line.substr(7, line.find(' ', 7) - 7);
      EXPECT_EQ(std::count(typed.begin(), typed.end(), name), 0) << "a second TYPE line for " << name;
      typed.push_back(name);
      continue;
    }
    const std::size_t space = line.rfind(' ');
    const std::string key = line.substr(0, space);
    EXPECT_FALSE(typed.empty()) << line;
    if (!typed.empty()) {
      EXPECT_EQ(key.rfind(typed.back(), 0), 0u) << "a sample outside its family: " << line;
    }
    EXPECT_EQ(samples.count(key), 0u) << "twice: " << line;
    samples[key] = line.substr(space + 1);
  }
  return samples;
}

std::string Find(const std::map<std::string, std::string>& samples, const std::string& key) {
  const auto found = samples.find(key);
  return found == samples.end() ? "(absent)" : found->second;
}

TEST(MetricsFormat, ContainersDevicesAndTheMonitorAreNamedLabelledAndInBaseUnits) {
  const std::string text = FormatMetrics(TwoContainers());
  const auto samples = Samples(text);
  const std::string a1 = std::string("{container=\"a\",vdevice_index=\"0\",device_uuid=\"") + kGpu1 + "\"}";
  const std::string a0 = std::string("{container=\"a\",vdevice_index=\"1\",device_uuid=\"") + kGpu0 + "\"}";
  const std::string b0 = std::string("{container=\"b\",vdevice_index=\"0\",device_uuid=\"") + kGpu0 + "\"}";
  EXPECT_EQ(Find(samples, "vgpu_container_memory_used_bytes" + a1), "1073741824") << text;
  EXPECT_EQ(Find(samples, "vgpu_container_memory_used_bytes" + a0), "2147483648");
  EXPECT_EQ(Find(samples, "vgpu_container_memory_used_bytes" + b0), "1073741824");
  EXPECT_EQ(Find(samples, "vgpu_container_memory_limit_bytes" + a1), "4294967296");
  EXPECT_EQ(Find(samples, "vgpu_container_sm_limit_ratio" + a0), "0.300");
  EXPECT_EQ(Find(samples, "vgpu_container_sm_used_ratio" + a1), "0.250");
  EXPECT_EQ(
      Find(samples, "vgpu_container_info{container=\"a\",namespace=\"ml\",pod=\"train-0\",container_name=\"main\"}"),
      "1");
  EXPECT_EQ(
      Find(samples, std::string("vgpu_device_memory_used_bytes{device_index=\"0\",device_uuid=\"") + kGpu0 + "\"}"),
      "3221225477");
  EXPECT_EQ(
      Find(samples, std::string("vgpu_device_memory_total_bytes{device_index=\"1\",device_uuid=\"") + kGpu1 + "\"}"),
      "85899345920");
  EXPECT_EQ(
      Find(samples, std::string("vgpu_device_utilization_ratio{device_index=\"0\",device_uuid=\"") + kGpu0 + "\"}"),
      "0.57");
  EXPECT_EQ(Find(samples, "vgpu_monitor_periods_total"), "42");
  EXPECT_EQ(Find(samples, "vgpu_monitor_last_period_timestamp_seconds"), "1795420000.123");
  EXPECT_NE(text.find("# TYPE vgpu_monitor_periods counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE vgpu_container_memory_used_bytes gauge\n"), std::string::npos) << text;
}

TEST(MetricsFormat, WhatIsNotKnownIsAbsentNotZero) {
  const auto samples = Samples(FormatMetrics(TwoContainers()));
  const std::string a0 = std::string("{container=\"a\",vdevice_index=\"1\",device_uuid=\"") + kGpu0 + "\"}";
  const std::string b0 = std::string("{container=\"b\",vdevice_index=\"0\",device_uuid=\"") + kGpu0 + "\"}";
  // GPU 0 is shared between a and b: NVML's samples cannot be split, so neither's SM use is told.
  EXPECT_EQ(Find(samples, "vgpu_container_sm_used_ratio" + a0), "(absent)");
  EXPECT_EQ(Find(samples, "vgpu_container_sm_used_ratio" + b0), "(absent)");
  // b sets no limits and names no pod; GPU 1's utilization NVML would not give.
  EXPECT_EQ(Find(samples, "vgpu_container_memory_limit_bytes" + b0), "(absent)");
  EXPECT_EQ(Find(samples, "vgpu_container_sm_limit_ratio" + b0), "(absent)");
  for (const auto& [key, value] : samples) {
    EXPECT_EQ(key.find("container=\"b\",namespace"), std::string::npos) << key;
    EXPECT_EQ(key.find("vgpu_device_utilization_ratio{device_index=\"1\""), std::string::npos) << key;
    EXPECT_EQ(key.rfind("hami_", 0), std::string::npos) << "without --hami-metrics: " << key;
    EXPECT_EQ(key.rfind("vgpu_container_hami_cache_valid", 0), std::string::npos) << key;
  }
}

TEST(MetricsFormat, JudgeGivesEachDevicesOrdinalAndWhereSmUseIsShared) {
  const PeriodFigures figures = TwoContainers();
  EXPECT_EQ(figures.judgements[0].ordinals, (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(figures.judgements[0].sm_shared, (std::vector<std::string>{kGpu0}));
  EXPECT_EQ(figures.judgements[1].ordinals, (std::vector<std::uint32_t>{0, 1}));
}

TEST(MetricsFormat, ThrottledSecondsAndRefusedAllocationsAreCountersPerContainerAndDevice) {
  PeriodFigures figures = TwoContainers();
  // Container a's region names GPU 1 (in upper case: matched as NVML's lower case) and a device the container is not
  // judged on; GPU 0 not at all (no process of a named it yet): nothing held or refused there.
  std::string upper = kGpu1;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  figures.counters = {{0, {{upper, 1'500'000'001, 3}, {"GPU-99999999-3c4d-5e6f-7a8b-9c0d1e2f3a4b", 7, 7}}}};
  const std::string text = FormatMetrics(figures);
  const auto samples = Samples(text);
  const std::string a1 = std::string("{container=\"a\",vdevice_index=\"0\",device_uuid=\"") + kGpu1 + "\"}";
  const std::string a0 = std::string("{container=\"a\",vdevice_index=\"1\",device_uuid=\"") + kGpu0 + "\"}";
  const std::string b0 = std::string("{container=\"b\",vdevice_index=\"0\",device_uuid=\"") + kGpu0 + "\"}";
  EXPECT_EQ(Find(samples, "vgpu_container_throttled_seconds_total" + a1), "1.500000001") << text;
  EXPECT_EQ(Find(samples, "vgpu_container_refused_allocations_total" + a1), "3");
  EXPECT_EQ(Find(samples, "vgpu_container_throttled_seconds_total" + a0), "0.000000000");
  EXPECT_EQ(Find(samples, "vgpu_container_refused_allocations_total" + a0), "0");
  EXPECT_EQ(Find(samples, "vgpu_container_throttled_seconds_total" + b0), "(absent)") << "b's region was not read";
  EXPECT_EQ(Find(samples, "vgpu_container_refused_allocations_total" + b0), "(absent)");
  EXPECT_NE(text.find("# TYPE vgpu_container_throttled_seconds counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE vgpu_container_refused_allocations counter\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("GPU-99999999"), std::string::npos) << "a device the container is not judged on: no series";
  // Without counters (no VGPU_CACHE, or its file not read) neither family is there at all.
  const std::string without = FormatMetrics(TwoContainers());
  EXPECT_EQ(without.find("vgpu_container_throttled_seconds"), std::string::npos) << without;
  EXPECT_EQ(without.find("vgpu_container_refused_allocations"), std::string::npos) << without;
}

HamiCache ACache(const std::string& uuid) {
  HamiCache cache;
  HamiDevice device;
  device.index = 0;
  device.uuid = uuid;
  device.memory_bytes = 3 * kGiB;
  device.context_bytes = 500;
  device.module_bytes = 7;
  device.data_bytes = 3 * kGiB - 507;
  device.limit_bytes = 4 * kGiB;
  device.sm_util_percent = 130;
  cache.devices.push_back(device);
  cache.last_kernel_time_s = 1'795'419'990;
  return cache;
}

TEST(MetricsFormat, HamisSeriesOnlyWithTheFlagAndOnlyForAValidCache) {
  PeriodFigures figures = TwoContainers();
  figures.caches.push_back({0, CacheState::read, ACache(kGpu0)});
  EXPECT_EQ(FormatMetrics(figures).find("hami_"), std::string::npos) << "without --hami-metrics";
  figures.hami = true;
  auto samples = Samples(FormatMetrics(figures));
  const std::string labels = std::string("{namespace=\"ml\",pod=\"train-0\",container=\"main\",vdevice_index=\"0\",") +
                             "device_uuid=\"" + kGpu0 + "\",zone=\"vGPU\"}";
  EXPECT_EQ(Find(samples, "hami_vgpu_memory_used_bytes" + labels), "3221225472");
  EXPECT_EQ(Find(samples, "hami_container_device_memory_bytes" + labels), "3221225472");
  EXPECT_EQ(Find(samples, "hami_vgpu_memory_limit_bytes" + labels), "4294967296");
  EXPECT_EQ(Find(samples, "hami_vgpu_memory_context_bytes" + labels), "500");
  EXPECT_EQ(Find(samples, "hami_vgpu_memory_module_bytes" + labels), "7");
  EXPECT_EQ(Find(samples, "hami_vgpu_memory_buffer_bytes" + labels), std::to_string(3 * kGiB - 507));
  EXPECT_EQ(Find(samples, "hami_container_device_utilization_ratio" + labels), "130");
  EXPECT_EQ(Find(samples, "hami_container_last_kernel_elapsed_seconds" + labels), "10");
  EXPECT_EQ(Find(samples, "vgpu_container_hami_cache_valid{container=\"a\"}"), "1");
  EXPECT_EQ(Find(samples, "vgpu_container_hami_cache_valid{container=\"b\"}"), "(absent)") << "b has no VGPU_CACHE";

  // A bad file: reported as not valid, no hami_* series, and the container's own series as before.
  figures.caches[0].state = CacheState::invalid;
  samples = Samples(FormatMetrics(figures));
  EXPECT_EQ(Find(samples, "vgpu_container_hami_cache_valid{container=\"a\"}"), "0");
  for (const auto& [key, value] : samples) EXPECT_EQ(key.rfind("hami_", 0), std::string::npos) << key;
  EXPECT_EQ(Find(samples, std::string("vgpu_container_memory_used_bytes{container=\"a\",vdevice_index=\"0\",") +
                              "device_uuid=\"" + kGpu1 + "\"}"),
            "1073741824");
}

TEST(MetricsFormat, ALastKernelNeverOrInTheFutureIsAbsentOrZero) {
  PeriodFigures figures = TwoContainers();
  figures.hami = true;
  figures.caches.push_back({0, CacheState::read, ACache(kGpu0)});
  figures.caches[0].cache.last_kernel_time_s = 0;
  EXPECT_EQ(FormatMetrics(figures).find("hami_container_last_kernel_elapsed_seconds"), std::string::npos);
  figures.caches[0].cache.last_kernel_time_s = 1'795'420'100;  // 100 s ahead: the container's word
  EXPECT_NE(FormatMetrics(figures).find("hami_container_last_kernel_elapsed_seconds{namespace=\"ml\""),
            std::string::npos);
  const auto samples = Samples(FormatMetrics(figures));
  for (const auto& [key, value] : samples) {
    if (key.rfind("hami_container_last_kernel_elapsed_seconds", 0) == 0) {
      EXPECT_EQ(value, "0");
    }
  }
}

TEST(MetricsEscaping, LabelValuesCannotEndTheirSampleOrForgeAnother) {
  EXPECT_EQ(EscapeLabelValue("plain-1.x"), "plain-1.x");
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(EscapeLabelValue(std::string("\x01\xff\xc3\xa9\r\t", 6)), "??????");
  // A UUID from a container's own cache file, written to forge a series.
  PeriodFigures figures = TwoContainers();
  figures.hami = true;
  figures.caches.push_back({0, CacheState::read, ACache("GPU-x\"} 1\nhami_vgpu_memory_limit_bytes{a=\"\\\xff")});
  const std::string text = FormatMetrics(figures);
  const auto samples = Samples(text);
  EXPECT_NE(text.find("device_uuid=\"GPU-x\\\"} 1\\nhami_vgpu_memory_limit_bytes{a=\\\"\\\\?\",zone=\"vGPU\"}"),
            std::string::npos)
      << text;
  for (const auto& [key, value] : samples)
    EXPECT_EQ(key.rfind("hami_vgpu_memory_limit_bytes{a=", 0), std::string::npos);
}

// ---- HAMi's v1 cache file --------------------------------------------------------------------------------------

// A v1 image as HAMi-core lays it out: two devices, slots 0..2 of which 0 and 2 live, slot 3 live but past procnum.
std::vector<unsigned char> Image() {
  auto region = std::make_unique<hami::SharedRegion>();
  region->initialized_flag = hami::kMagic;
  region->major_version = 1;
  region->minor_version = 2;
  region->device_num = 2;
  std::strcpy(region->uuids[0], kGpu0);
  std::strcpy(region->uuids[1], kGpu1);
  region->limit[0] = 4 * kGiB;
  region->limit[1] = 2 * kGiB;
  region->proc_num = 3;
  for (int s : {0, 2, 3}) {
    region->procs[s].status = 1;
    region->procs[s].used[0] = {100u + s, 10, 1000u * (s + 1), 0, 100u + s + 10 + 1000u * (s + 1), {}};
    region->procs[s].used[1].total = 7;
    region->procs[s].device_util[0].sm = 20u + s;
  }
  region->procs[1].used[0].total = 999'999;  // a free slot: not counted
  region->last_kernel_time = 1'795'419'990;
  std::vector<unsigned char> bytes(sizeof(hami::SharedRegion));
  std::memcpy(bytes.data(), region.get(), bytes.size());
  return bytes;
}

ReadAt Over(const std::vector<unsigned char>& bytes) {
  return [&bytes](std::uint64_t offset, std::size_t length, void* out) {
    if (offset > bytes.size() || length > bytes.size() - offset) return false;
    std::memcpy(out, bytes.data() + offset, length);
    return true;
  };
}

template <typename T>
void Put(std::vector<unsigned char>& bytes, std::size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
}

TEST(HamiCacheRead, SumsTheLiveSlotsBelowProcnumPerDeviceAsHamisMonitorDoes) {
  const std::vector<unsigned char> bytes = Image();
  HamiCache cache;
  std::string error;
  ASSERT_TRUE(ReadHamiCache(bytes.size(), Over(bytes), cache, error)) << error;
  ASSERT_EQ(cache.devices.size(), 2u);
  const HamiDevice& d0 = cache.devices[0];
  EXPECT_EQ(d0.uuid, kGpu0);
  EXPECT_EQ(d0.limit_bytes, 4 * kGiB);
  EXPECT_EQ(d0.context_bytes, 100u + 102u);
  EXPECT_EQ(d0.data_bytes, 1000u + 3000u);
  EXPECT_EQ(d0.module_bytes, 20u);
  EXPECT_EQ(d0.memory_bytes, (100u + 10 + 1000) + (102u + 10 + 3000));
  EXPECT_EQ(d0.sm_util_percent, 20u + 22u);
  EXPECT_EQ(cache.devices[1].index, 1u);
  EXPECT_EQ(cache.devices[1].memory_bytes, 14u);
  EXPECT_EQ(cache.last_kernel_time_s, 1'795'419'990);
  // A larger v1 file is read too (HAMi accepts it; ours has our region after HAMi's part).
  std::vector<unsigned char> larger = Image();
  larger.resize(larger.size() + 4096, 0xAB);
  ASSERT_TRUE(ReadHamiCache(larger.size(), Over(larger), cache, error)) << error;
  EXPECT_EQ(cache.devices[0].memory_bytes, (100u + 10 + 1000) + (102u + 10 + 3000));
}

TEST(HamiCacheRead, GarbageCountsAreClampedAndUnsetRowsSkipped) {
  std::vector<unsigned char> bytes = Image();
  Put<std::uint64_t>(bytes, offsetof(hami::SharedRegion, device_num), 1'000'000);
  Put<std::int32_t>(bytes, offsetof(hami::SharedRegion, proc_num), 1'000'000);
  HamiCache cache;
  std::string error;
  ASSERT_TRUE(ReadHamiCache(bytes.size(), Over(bytes), cache, error)) << error;
  ASSERT_EQ(cache.devices.size(), 2u) << "rows 2..15 have no UUID";
  EXPECT_EQ(cache.devices[0].sm_util_percent, 20u + 22u + 23u) << "slot 3 counts once procnum covers it";
  Put<std::int32_t>(bytes, offsetof(hami::SharedRegion, proc_num), -5);
  ASSERT_TRUE(ReadHamiCache(bytes.size(), Over(bytes), cache, error)) << error;
  EXPECT_EQ(cache.devices[0].memory_bytes, 0u);
  // Sums saturate rather than wrap.
  bytes = Image();
  Put<std::uint64_t>(bytes, offsetof(hami::SharedRegion, procs) + offsetof(hami::ProcSlot, used) + 32, ~0ull - 1);
  ASSERT_TRUE(ReadHamiCache(bytes.size(), Over(bytes), cache, error)) << error;
  EXPECT_EQ(cache.devices[0].memory_bytes, ~0ull);
}

TEST(HamiCacheRead, ABadFileIsRefusedSayingWhatWasFoundAndWhatIsAccepted) {
  HamiCache cache;
  cache.last_kernel_time_s = 77;
  std::string error;
  std::vector<unsigned char> bytes = Image();
  Put<std::int32_t>(bytes, 0, 0x4E474556);  // our own region's first bytes, say
  EXPECT_FALSE(ReadHamiCache(bytes.size(), Over(bytes), cache, error));
  EXPECT_NE(error.find("magic 1313293654 is not HAMi's 19920718"), std::string::npos) << error;
  bytes = Image();
  Put<std::uint32_t>(bytes, 4, 2);
  EXPECT_FALSE(ReadHamiCache(bytes.size(), Over(bytes), cache, error));
  EXPECT_NE(error.find("major version 2; accepted: major version 1 and at least 2008952 bytes"), std::string::npos)
      << error;
  bytes = Image();
  bytes.resize(1'197'897);  // HAMi's v0 size
  EXPECT_FALSE(ReadHamiCache(bytes.size(), Over(bytes), cache, error));
  EXPECT_NE(error.find("1197897 bytes"), std::string::npos) << error;
  bytes.resize(2);
  EXPECT_FALSE(ReadHamiCache(bytes.size(), Over(bytes), cache, error));
  EXPECT_NE(error.find("too short"), std::string::npos) << error;
  // The file shrank between its size and the read (the container truncated it): refused, not read past.
  bytes = Image();
  const std::vector<unsigned char> shrunk(bytes.begin(), bytes.begin() + 4096);
  EXPECT_FALSE(ReadHamiCache(bytes.size(), Over(shrunk), cache, error));
  EXPECT_NE(error.find("cannot read"), std::string::npos) << error;
  EXPECT_EQ(cache.last_kernel_time_s, 77) << "the output is left alone on failure";
}

// ---- our region's counters, from the same file ------------------------------------------------------------------

constexpr std::uint8_t kUuidBytes0[16] = {0x00, 0x00, 0x00, 0x00, 0x3c, 0x4d, 0x5e, 0x6f,
                                          0x7a, 0x8b, 0x9c, 0x0d, 0x1e, 0x2f, 0x3a, 0x4b};  // kGpu0

// A whole file of this build's layout: three devices in the table, the second not in use.
std::vector<unsigned char> RegionImage() {
  using region::Region;
  std::vector<unsigned char> bytes(region::kFileBytes);
  auto header = std::make_unique<Region>();
  header->magic = region::kRegionMagic;
  header->version = region::kRegionVersion;
  header->region_bytes = sizeof(Region);
  header->device_count = 3;
  std::memcpy(header->devices[0].uuid, kUuidBytes0, 16);
  header->devices[0].in_use = 1;
  header->devices[0].held_ns = 2'000'000'123;
  header->devices[0].refused_allocations = 5;
  header->devices[1].held_ns = 99;  // not in use: not reported
  std::memset(header->devices[2].uuid, 0xAB, 16);
  header->devices[2].in_use = 1;
  header->devices[2].refused_allocations = 1;
  std::memcpy(bytes.data() + region::kRegionOffset, header.get(), sizeof(Region));
  return bytes;
}

TEST(RegionCountersRead, EachDeviceInUseWithItsUuidInNvmlsForm) {
  const std::vector<unsigned char> bytes = RegionImage();
  std::vector<RegionCounters> counters;
  std::string error;
  ASSERT_TRUE(ReadRegionCounters(bytes.size(), Over(bytes), counters, error)) << error;
  ASSERT_EQ(counters.size(), 2u);
  EXPECT_EQ(counters[0].uuid, kGpu0);
  EXPECT_EQ(counters[0].held_ns, 2'000'000'123u);
  EXPECT_EQ(counters[0].refused_allocations, 5u);
  EXPECT_EQ(counters[1].uuid, "GPU-abababab-abab-abab-abab-abababababab");
  EXPECT_EQ(counters[1].held_ns, 0u);
  EXPECT_EQ(counters[1].refused_allocations, 1u);
  // A garbage device count is clamped to the table.
  std::vector<unsigned char> garbage = RegionImage();
  Put<std::uint32_t>(garbage, region::kRegionOffset + offsetof(region::Region, device_count), 1'000'000);
  ASSERT_TRUE(ReadRegionCounters(garbage.size(), Over(garbage), counters, error)) << error;
  EXPECT_EQ(counters.size(), 2u);
}

TEST(RegionCountersRead, AnotherLayoutOrAShortFileIsRefusedSayingWhatIsAccepted) {
  using region::Region;
  std::vector<RegionCounters> counters = {{"kept", 1, 1}};
  std::string error;
  const std::vector<unsigned char> hami_only = Image();  // HAMi-core's own file: no region after its part
  EXPECT_FALSE(ReadRegionCounters(hami_only.size(), Over(hami_only), counters, error));
  EXPECT_NE(error.find("too short to hold a libvgpu region (2008952 bytes"), std::string::npos) << error;
  std::vector<unsigned char> bytes = RegionImage();
  Put<std::uint64_t>(bytes, region::kRegionOffset, 0);
  EXPECT_FALSE(ReadRegionCounters(bytes.size(), Over(bytes), counters, error));
  EXPECT_NE(error.find("no libvgpu region (\"VGPUREGN\") at byte 2011136"), std::string::npos) << error;
  bytes = RegionImage();
  Put<std::uint32_t>(bytes, region::kRegionOffset + offsetof(Region, version), region::kRegionVersion - 1);
  EXPECT_FALSE(ReadRegionCounters(bytes.size(), Over(bytes), counters, error));
  EXPECT_NE(error.find("layout version " + std::to_string(region::kRegionVersion - 1)), std::string::npos) << error;
  EXPECT_NE(error.find("accepted: layout version " + std::to_string(region::kRegionVersion)), std::string::npos)
      << error;
  bytes = RegionImage();
  Put<std::uint32_t>(bytes, region::kRegionOffset + offsetof(Region, region_bytes), 64);
  EXPECT_FALSE(ReadRegionCounters(bytes.size(), Over(bytes), counters, error));
  EXPECT_NE(error.find("64 bytes of region"), std::string::npos) << error;
  bytes = RegionImage();
  bytes.resize(bytes.size() - 1);
  EXPECT_FALSE(ReadRegionCounters(bytes.size(), Over(bytes), counters, error));
  EXPECT_NE(error.find("in a file of " + std::to_string(bytes.size()) + " bytes"), std::string::npos) << error;
  // The file shrank between its size and the read of the device table: refused, not read past.
  bytes = RegionImage();
  const std::vector<unsigned char> shrunk(bytes.begin(), bytes.begin() + region::kRegionOffset + 256);
  EXPECT_FALSE(ReadRegionCounters(bytes.size(), Over(shrunk), counters, error));
  EXPECT_NE(error.find("cannot read its device table"), std::string::npos) << error;
  ASSERT_EQ(counters.size(), 1u);
  EXPECT_EQ(counters[0].uuid, "kept") << "the output is left alone on failure";
}

// ---- the file on disk ------------------------------------------------------------------------------------------

class CacheFile : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/vgpu-metrics-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::vector<unsigned char>& bytes) {
    std::ofstream(dir_ + "/" + name, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  std::string dir_;
};

TEST_F(CacheFile, AFileOrAFoldersSingleCacheIsRead) {
  HamiCache cache;
  std::string error;
  EXPECT_EQ(ReadCacheFile(dir_ + "/none.cache", cache, error), CacheState::absent);
  EXPECT_EQ(ReadCacheFile(dir_, cache, error), CacheState::absent) << "a folder without a *.cache: not made yet";
  Write("5f0c.cache", Image());
  Write("libvgpu.so", {1, 2, 3});
  ASSERT_EQ(ReadCacheFile(dir_ + "/5f0c.cache", cache, error), CacheState::read) << error;
  EXPECT_EQ(cache.devices.size(), 2u);
  HamiCache from_folder;
  ASSERT_EQ(ReadCacheFile(dir_, from_folder, error), CacheState::read) << error;
  EXPECT_EQ(from_folder.devices[0].memory_bytes, cache.devices[0].memory_bytes);
  Write("other.cache", Image());
  EXPECT_EQ(ReadCacheFile(dir_, cache, error), CacheState::invalid);
  EXPECT_NE(error.find("holds 2 *.cache files"), std::string::npos) << error;
}

TEST_F(CacheFile, ALinkAFifoOrBadContentsAreRefusedWithoutBlocking) {
  HamiCache cache;
  std::string error;
  Write("real.cache", Image());
  ASSERT_EQ(symlink((dir_ + "/real.cache").c_str(), (dir_ + "/link.cache").c_str()), 0);
  EXPECT_EQ(ReadCacheFile(dir_ + "/link.cache", cache, error), CacheState::invalid);
  EXPECT_NE(error.find("cannot open"), std::string::npos) << error;
  ASSERT_EQ(mkfifo((dir_ + "/fifo.cache").c_str(), 0600), 0);
  EXPECT_EQ(ReadCacheFile(dir_ + "/fifo.cache", cache, error), CacheState::invalid);
  EXPECT_EQ(error, "not a regular file");
  std::vector<unsigned char> bad = Image();
  bad[0] ^= 1;
  Write("bad.cache", bad);
  EXPECT_EQ(ReadCacheFile(dir_ + "/bad.cache", cache, error), CacheState::invalid);
  EXPECT_NE(error.find("is not HAMi's 19920718"), std::string::npos) << error;
}

TEST_F(CacheFile, ARegionTheShimWroteIsReadForItsCounters) {
  // The writer's side is the region library itself (what libvgpu.so links): the two agree on the layout.
  std::string error;
  std::vector<RegionCounters> counters;
  EXPECT_EQ(ReadRegionCountersFile(dir_, counters, error), CacheState::absent) << "no CUDA call yet: no file";
  {
    std::unique_ptr<region::Attachment> attachment(region::Attachment::Open(dir_ + "/5f0c.cache", error));
    ASSERT_NE(attachment, nullptr) << error;
    const int device = attachment->DeviceIndex(kUuidBytes0);
    ASSERT_EQ(device, 0);
    attachment->AddHeldNs(device, 1'250'000'000);
    attachment->AddHeldNs(device, 250'000'000);
    attachment->CountRefusedAllocation(device);
  }
  ASSERT_EQ(ReadRegionCountersFile(dir_, counters, error), CacheState::read) << error;
  ASSERT_EQ(counters.size(), 1u);
  EXPECT_EQ(counters[0].uuid, kGpu0);
  EXPECT_EQ(counters[0].held_ns, 1'500'000'000u);
  EXPECT_EQ(counters[0].refused_allocations, 1u);
  HamiCache cache;
  EXPECT_EQ(ReadCacheFile(dir_, cache, error), CacheState::read) << "the same file, read as HAMi's: " << error;
  Write("hami-only.cache", Image());
  EXPECT_EQ(ReadRegionCountersFile(dir_ + "/hami-only.cache", counters, error), CacheState::invalid);
  EXPECT_NE(error.find("too short to hold a libvgpu region"), std::string::npos) << error;
}

// The monitor reads both parts of each container's file from one open a period (it opened the file twice): each part
// as the reader of that part alone gives it, with its own state and error.
TEST_F(CacheFile, OneOpenGivesBothPartsAsTheirOwnReadersDo) {
  std::string error;
  std::vector<RegionCounters> counters;
  HamiCache hami;
  ContainerFileRead read = ReadContainerFile(dir_, &hami, counters);
  EXPECT_EQ(read.counters, CacheState::absent);
  EXPECT_EQ(read.hami, CacheState::absent);
  {
    std::unique_ptr<region::Attachment> attachment(region::Attachment::Open(dir_ + "/5f0c.cache", error));
    ASSERT_NE(attachment, nullptr) << error;
    const int device = attachment->DeviceIndex(kUuidBytes0);
    ASSERT_EQ(device, 0);
    attachment->AddHeldNs(device, 750'000'000);
    attachment->CountRefusedAllocation(device);
  }
  read = ReadContainerFile(dir_, &hami, counters);
  ASSERT_EQ(read.counters, CacheState::read) << read.counters_error;
  ASSERT_EQ(read.hami, CacheState::read) << read.hami_error;
  std::vector<RegionCounters> alone_counters;
  HamiCache alone_hami;
  ASSERT_EQ(ReadRegionCountersFile(dir_, alone_counters, error), CacheState::read) << error;
  ASSERT_EQ(ReadCacheFile(dir_, alone_hami, error), CacheState::read) << error;
  ASSERT_EQ(counters.size(), 1u);
  EXPECT_EQ(counters[0].uuid, alone_counters[0].uuid);
  EXPECT_EQ(counters[0].held_ns, 750'000'000u);
  EXPECT_EQ(counters[0].refused_allocations, 1u);
  ASSERT_EQ(hami.devices.size(), alone_hami.devices.size());
  EXPECT_EQ(hami.devices[0].uuid, alone_hami.devices[0].uuid);
  EXPECT_EQ(hami.devices[0].limit_bytes, alone_hami.devices[0].limit_bytes);
  // Without HAMi's part asked for, it is left alone.
  HamiCache untouched;
  read = ReadContainerFile(dir_, nullptr, counters);
  EXPECT_EQ(read.counters, CacheState::read);
  EXPECT_EQ(read.hami, CacheState::absent);
  // A HAMi-core file: HAMi's part reads, ours is invalid with the reason, named after the folder's file.
  Write("hami-only.cache", Image());
  read = ReadContainerFile(dir_ + "/hami-only.cache", &untouched, counters);
  EXPECT_EQ(read.hami, CacheState::read) << read.hami_error;
  EXPECT_EQ(read.counters, CacheState::invalid);
  EXPECT_NE(read.counters_error.find("too short to hold a libvgpu region"), std::string::npos) << read.counters_error;
}

// ---- HTTP --------------------------------------------------------------------------------------------------------

TEST(MetricsHttp, GetOrHeadMetricsElseTheRightRefusal) {
  const std::string text = "vgpu_monitor_periods_total 1\n";
  const std::string ok = HttpResponse("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &text);
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << ok;
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), std::string::npos) << ok;
  EXPECT_NE(ok.find("Content-Length: " + std::to_string(text.size()) + "\r\n"), std::string::npos) << ok;
  EXPECT_EQ(ok.substr(ok.size() - text.size()), text);
  const std::string head = HttpResponse("HEAD /metrics?x=1 HTTP/1.0\r\n\r\n", &text);
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK\r\n", 0), 0u);
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n") << "no body for HEAD";
  EXPECT_EQ(HttpResponse("GET /metrics HTTP/1.1\r\n\r\n", nullptr).rfind("HTTP/1.1 503 ", 0), 0u);
  EXPECT_EQ(HttpResponse("GET / HTTP/1.1\r\n\r\n", &text).rfind("HTTP/1.1 404 ", 0), 0u);
  EXPECT_EQ(HttpResponse("GET /etc/passwd HTTP/1.1\r\n\r\n", &text).rfind("HTTP/1.1 404 ", 0), 0u);
  EXPECT_EQ(HttpResponse("POST /metrics HTTP/1.1\r\n\r\n", &text).rfind("HTTP/1.1 405 ", 0), 0u);
  EXPECT_EQ(HttpResponse("hello\r\n\r\n", &text).rfind("HTTP/1.1 400 ", 0), 0u);
  EXPECT_EQ(HttpResponse("", &text).rfind("HTTP/1.1 400 ", 0), 0u);
}

}  // namespace
}  // namespace vgpu::monitor
