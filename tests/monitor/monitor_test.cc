// The node monitor's judgement (docs/node-monitor.md) from made-up NVML figures and cgroups: whose process is
// whose, what a container holds and uses per device, when it is over, and whom --action kill ends.
#include "vgpu/monitor/monitor.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace vgpu::monitor {
namespace {

constexpr const char* kGpu0 = "GPU-00000000-3c4d-5e6f-7a8b-9c0d1e2f3a4b";
constexpr const char* kGpu1 = "GPU-11111111-3c4d-5e6f-7a8b-9c0d1e2f3a4b";
constexpr std::uint64_t kGiB = 1ull << 30;

Container MustParse(const std::string& name, const std::string& text) {
  Container c;
  std::string error;
  EXPECT_TRUE(ParseContainer(name, text, name + ".conf", c, error)) << error;
  return c;
}

std::string ParseError(const std::string& name, const std::string& text) {
  Container c;
  std::string error;
  EXPECT_FALSE(ParseContainer(name, text, "/etc/vgpu/containers/" + name + ".conf", c, error)) << text;
  return error;
}

Reading On(const char* device, std::uint32_t host_pid, const std::string& cgroup, std::uint64_t memory,
           std::uint32_t sm = 0) {
  Reading r;
  r.host_pid = host_pid;
  r.pid = host_pid + 1000;
  r.cgroup = cgroup;
  r.device = device;
  r.memory_used = memory;
  r.sm_used = sm;
  return r;
}

TEST(MonitorContainer, IsACgroupDevicesAndTheShimsLimits) {
  const Container c = MustParse("team-a", std::string("VGPU_CGROUP=/kubepods/pod1\nVGPU_DEVICES=") + kGpu1 + "," +
                                              kGpu0 + "\nCUDA_DEVICE_MEMORY_LIMIT=4Gi\nCUDA_DEVICE_SM_LIMIT_1=30\n");
  EXPECT_EQ(c.name, "team-a");
  EXPECT_EQ(c.cgroup, "/kubepods/pod1");
  EXPECT_EQ(c.devices, (std::vector<std::string>{kGpu1, kGpu0}));
  EXPECT_EQ(c.limits.memory_limit_bytes[0], 4 * kGiB);
  EXPECT_EQ(c.limits.memory_limit_bytes[1], 4 * kGiB);
  EXPECT_EQ(c.limits.sm_limit_percent[0], 0u);
  EXPECT_EQ(c.limits.sm_limit_percent[1], 30u);
}

TEST(MonitorContainer, BadFilesAreRefusedNamingTheKeyTheValueAndAnExample) {
  const std::string no_cgroup = ParseError("a", "CUDA_DEVICE_MEMORY_LIMIT=4Gi\n");
  EXPECT_NE(no_cgroup.find("VGPU_CGROUP is not set"), std::string::npos) << no_cgroup;
  EXPECT_NE(no_cgroup.find("e.g."), std::string::npos) << no_cgroup;
  for (const char* cgroup : {"kubepods", "/a//b", "/a/", ""}) {
    const std::string error = ParseError("a", std::string("VGPU_CGROUP=") + cgroup + "\n");
    EXPECT_NE(error.find("not an absolute cgroup path"), std::string::npos) << cgroup << ": " << error;
  }
  EXPECT_NE(ParseError("a", "VGPU_CGROUP=/a\nVGPU_DEVICES=gpu0\n").find("'gpu0' is not a device UUID"),
            std::string::npos);
  EXPECT_NE(
      ParseError("a", std::string("VGPU_CGROUP=/a\nVGPU_DEVICES=") + kGpu0 + "," + kGpu0 + "\n").find("listed twice"),
      std::string::npos);
  EXPECT_NE(ParseError("a", "VGPU_CGROUP=/a\nCUDA_DEVICE_MEMORY_LIMIT=lots\n").find("CUDA_DEVICE_MEMORY_LIMIT"),
            std::string::npos);
  const std::string unknown = ParseError("a", "VGPU_CGROUP=/a\nVGPU_COLOUR=red\n");
  EXPECT_NE(unknown.find("VGPU_COLOUR"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("VGPU_CGROUP, VGPU_DEVICES"), std::string::npos)
      << "the accepted keys are listed: " << unknown;
  EXPECT_NE(ParseError("../etc", "VGPU_CGROUP=/a\n").find("cannot name a container"), std::string::npos);
  EXPECT_NE(ParseError(".hidden", "VGPU_CGROUP=/a\n").find("cannot name a container"), std::string::npos);
}

TEST(MonitorContainer, TheMetricsKeysNameItsCacheFileAndItsPod) {
  const Container c = MustParse("team-a",
                                "VGPU_CGROUP=/kubepods/pod1\nVGPU_CACHE=/usr/local/vgpu/containers/uid_main\n"
                                "VGPU_POD_NAMESPACE=ml\nVGPU_POD_NAME=train-0\nVGPU_CONTAINER_NAME=main\n");
  EXPECT_EQ(c.cache_path, "/usr/local/vgpu/containers/uid_main");
  EXPECT_EQ(c.pod_namespace, "ml");
  EXPECT_EQ(c.pod_name, "train-0");
  EXPECT_EQ(c.container_name, "main");
  const Container bare = MustParse("b", "VGPU_CGROUP=/a\n");
  EXPECT_TRUE(bare.cache_path.empty() && bare.pod_namespace.empty() && bare.pod_name.empty());
}

TEST(MonitorContainer, BadMetricsKeysAreRefusedNamingTheKeyAndTheValue) {
  const std::string relative = ParseError("a", "VGPU_CGROUP=/a\nVGPU_CACHE=x.cache\n");
  EXPECT_NE(relative.find("VGPU_CACHE 'x.cache' is not an absolute path; e.g."), std::string::npos) << relative;
  const std::string quoted = ParseError("a", "VGPU_CGROUP=/a\nVGPU_POD_NAME=a\"b\n");
  EXPECT_NE(quoted.find("VGPU_POD_NAME 'a\"b' is not a Kubernetes name"), std::string::npos) << quoted;
  const std::string spaced = ParseError("a", "VGPU_CGROUP=/a\nVGPU_CONTAINER_NAME=a b\n");
  EXPECT_NE(spaced.find("VGPU_CONTAINER_NAME"), std::string::npos) << spaced;
  EXPECT_NE(
      ParseError("a", "VGPU_CGROUP=/a\nVGPU_POD_NAMESPACE=" + std::string(254, 'n') + "\n").find("VGPU_POD_NAMESPACE"),
      std::string::npos);
  EXPECT_NE(ParseError("a", "VGPU_CGROUP=/a\nVGPU_POD_NAME=\n").find("VGPU_POD_NAME ''"), std::string::npos);
}

TEST(MonitorContainer, NamesAreSafeFolderNames) {
  EXPECT_TRUE(IsContainerName("team-a_1.gpu"));
  for (const char* bad : {"", ".", "..", "a/b", "a b", ".a"}) EXPECT_FALSE(IsContainerName(bad)) << bad;
  EXPECT_FALSE(IsContainerName(std::string(65, 'a')));
}

TEST(MonitorCgroups, AProcessBelongsToTheNearestAncestorByWholeComponents) {
  std::vector<Container> cs{MustParse("pod", "VGPU_CGROUP=/kubepods/pod1\n"),
                            MustParse("ctr", "VGPU_CGROUP=/kubepods/pod1/ctr-a\n"),
                            MustParse("other", "VGPU_CGROUP=/kubepods/pod12\n")};
  EXPECT_EQ(ContainerOf(cs, "/kubepods/pod1/ctr-a"), 1);
  EXPECT_EQ(ContainerOf(cs, "/kubepods/pod1/ctr-a/sub"), 1);
  EXPECT_EQ(ContainerOf(cs, "/kubepods/pod1/ctr-b"), 0);
  EXPECT_EQ(ContainerOf(cs, "/kubepods/pod12"), 2);
  EXPECT_EQ(ContainerOf(cs, "/kubepods/pod123"), -1) << "pod12 is not an ancestor of pod123";
  EXPECT_EQ(ContainerOf(cs, "/system.slice"), -1);
  cs.push_back(MustParse("root", "VGPU_CGROUP=/\n"));
  EXPECT_EQ(ContainerOf(cs, "/system.slice"), 3);
}

TEST(MonitorCgroups, TheUnifiedHierarchyWinsElseTheMemoryController) {
  std::string path;
  EXPECT_TRUE(CgroupPath("0::/kubepods.slice/cri-containerd-abc.scope\n", path));
  EXPECT_EQ(path, "/kubepods.slice/cri-containerd-abc.scope");
  EXPECT_TRUE(CgroupPath("12:pids:/x\n4:cpu,memory:/kubepods/pod1/ctr\n1:name=systemd:/y\n", path));
  EXPECT_EQ(path, "/kubepods/pod1/ctr");
  EXPECT_TRUE(CgroupPath("4:memory:/m\n0::/u\n", path));
  EXPECT_EQ(path, "/u");
  EXPECT_FALSE(CgroupPath("12:pids:/x\n", path));
  EXPECT_FALSE(CgroupPath("", path));
  EXPECT_FALSE(CgroupPath("garbage\n0::relative\n", path));
}

TEST(MonitorCgroups, TheContainersPidIsTheLastNsPid) {
  EXPECT_EQ(NamespacePid("Name:\tpython\nNSpid:\t81234\t7\nNSpgid:\t81234\t7\n"), 7u);
  EXPECT_EQ(NamespacePid("NSpid:\t81234\n"), 81234u);
  EXPECT_EQ(NamespacePid("Name:\tx\n"), 0u);
  EXPECT_EQ(NamespacePid("NSpid:\t\n"), 0u);
}

TEST(MonitorJudge, SumsEachContainersProcessesPerDevice) {
  const std::vector<Container> cs{
      MustParse("a", "VGPU_CGROUP=/a\nCUDA_DEVICE_MEMORY_LIMIT=4Gi\nCUDA_DEVICE_SM_LIMIT=30\n"),
      MustParse("b", "VGPU_CGROUP=/b\n")};
  const std::vector<Reading> readings{On(kGpu0, 1, "/a/x", kGiB, 200),      On(kGpu0, 2, "/a/y", kGiB, 150),
                                      On(kGpu1, 1, "/a/x", kGiB / 2),       On(kGpu0, 3, "/b", 3 * kGiB, 500),
                                      On(kGpu0, 4, "/elsewhere", 9 * kGiB), On(kGpu0, 5, "", 9 * kGiB)};
  const auto judged = Judge(cs, {kGpu0, kGpu1}, readings, false);
  ASSERT_EQ(judged.size(), 2u);
  const verdict::Verdict& a = judged[0].verdict;
  ASSERT_EQ(a.devices.size(), 2u);
  EXPECT_EQ(a.devices[0].uuid, kGpu0);
  EXPECT_EQ(a.devices[0].memory_used, 2 * kGiB);
  EXPECT_EQ(a.devices[0].memory_limit, 4 * kGiB);
  EXPECT_EQ(a.devices[0].sm_used, 0u) << "shared with b's process: SM use not judged (below)";
  EXPECT_EQ(a.devices[0].sm_limit, 300u);
  EXPECT_EQ(a.devices[1].memory_used, kGiB / 2);
  ASSERT_EQ(a.processes.size(), 3u);
  EXPECT_EQ(a.FindProcess(1001, kGpu0)->sm_used, 200u) << "processes are named by their pid in the container";
  EXPECT_EQ(a.FindProcess(1002, kGpu0)->sm_used, 150u);
  EXPECT_TRUE(judged[0].memory_over.empty());
  EXPECT_EQ(judged[1].verdict.devices[0].memory_used, 3 * kGiB);
  EXPECT_EQ(judged[1].verdict.devices[0].memory_limit, 0u);
}

TEST(MonitorJudge, SmUseIsJudgedOnlyWhereTheContainerIsAloneOnTheDevice) {
  // NVML names one process per window at the device's utilization: beside another container, the container
  // holding the device longest would be given all of it.
  const std::vector<Container> cs{MustParse("a", "VGPU_CGROUP=/a\nCUDA_DEVICE_SM_LIMIT=70\n"),
                                  MustParse("b", "VGPU_CGROUP=/b\nCUDA_DEVICE_SM_LIMIT=30\n")};
  const auto shared = Judge(cs, {kGpu0, kGpu1},
                            {On(kGpu0, 1, "/a", kGiB, 950), On(kGpu0, 2, "/b", kGiB, 50), On(kGpu1, 3, "/a", kGiB, 600),
                             On(kGpu1, 4, "/a", kGiB, 300)},
                            false);
  EXPECT_EQ(shared[0].verdict.FindDevice(kGpu0)->sm_used, 0u) << "shared with b: not judged";
  EXPECT_EQ(shared[1].verdict.FindDevice(kGpu0)->sm_used, 0u);
  EXPECT_EQ(shared[0].verdict.FindDevice(kGpu1)->sm_used, 900u) << "alone (two processes of its own): judged";
  const auto unknown = Judge(cs, {kGpu0}, {On(kGpu0, 1, "/a", kGiB, 950), On(kGpu0, 9, "/system", kGiB, 50)}, false);
  EXPECT_EQ(unknown[0].verdict.FindDevice(kGpu0)->sm_used, 0u) << "beside a process of no container: not judged";
}

TEST(MonitorJudge, ADeviceNvmlDidNotAnswerForIsNotJudged) {
  const std::vector<Container> cs{MustParse("a", "VGPU_CGROUP=/a\nCUDA_DEVICE_MEMORY_LIMIT=1Gi\n")};
  const auto judged = Judge(cs, {kGpu1}, {On(kGpu1, 1, "/a", 2 * kGiB)}, true);
  ASSERT_EQ(judged[0].verdict.devices.size(), 1u);
  EXPECT_EQ(judged[0].verdict.devices[0].uuid, kGpu1)
      << "the container's ordinal 0 is NVML's first device answered: here the only one";
  const std::vector<Container> listed{
      MustParse("a", std::string("VGPU_CGROUP=/a\nVGPU_DEVICES=") + kGpu0 + "\nCUDA_DEVICE_MEMORY_LIMIT=1Gi\n")};
  const auto unanswered = Judge(listed, {kGpu1}, {On(kGpu1, 1, "/a", 2 * kGiB)}, true);
  EXPECT_TRUE(unanswered[0].verdict.devices.empty()) << "its device did not answer: no line, no kill";
  EXPECT_EQ(unanswered[0].kill_host_pid, 0u);
}

TEST(MonitorJudge, LimitsFollowTheContainersOwnDeviceOrder) {
  const std::vector<Container> cs{
      MustParse("a", std::string("VGPU_CGROUP=/a\nVGPU_DEVICES=") + kGpu1 + "," + kGpu0 +
                         "\nCUDA_DEVICE_MEMORY_LIMIT_0=1Gi\nCUDA_DEVICE_MEMORY_LIMIT_1=2Gi\n")};
  const auto judged = Judge(cs, {kGpu0, kGpu1}, {}, false);
  ASSERT_EQ(judged[0].verdict.devices.size(), 2u);
  EXPECT_EQ(judged[0].verdict.FindDevice(kGpu1)->memory_limit, kGiB) << "its ordinal 0";
  EXPECT_EQ(judged[0].verdict.FindDevice(kGpu0)->memory_limit, 2 * kGiB) << "its ordinal 1";
}

TEST(MonitorJudge, OverItsMemoryLimitTheLargestProcessOnThatDeviceIsNamedToKill) {
  const std::vector<Container> cs{MustParse("a", "VGPU_CGROUP=/a\nCUDA_DEVICE_MEMORY_LIMIT=2Gi\n")};
  const std::vector<Reading> readings{On(kGpu0, 1, "/a", kGiB), On(kGpu0, 2, "/a", kGiB + 1),
                                      On(kGpu1, 3, "/a", 2 * kGiB)};
  const auto reported = Judge(cs, {kGpu0, kGpu1}, readings, false);
  EXPECT_EQ(reported[0].memory_over, std::vector<std::string>{kGpu0});
  EXPECT_EQ(reported[0].kill_host_pid, 0u) << "report names no one";
  const auto killing = Judge(cs, {kGpu0, kGpu1}, readings, true);
  EXPECT_EQ(killing[0].kill_host_pid, 2u)
      << "the largest on the device it is over on (pid 3 holds more, on a device within its limit)";
  const auto within = Judge(cs, {kGpu0, kGpu1}, {On(kGpu0, 1, "/a", 2 * kGiB)}, true);
  EXPECT_TRUE(within[0].memory_over.empty()) << "at the limit is not over";
  EXPECT_EQ(within[0].kill_host_pid, 0u);
}

TEST(MonitorJudge, ANeighboursProcessIsNeverNamedToKill) {
  const std::vector<Container> cs{MustParse("a", "VGPU_CGROUP=/a\nCUDA_DEVICE_MEMORY_LIMIT=1Gi\n"),
                                  MustParse("b", "VGPU_CGROUP=/b\n")};
  const auto judged = Judge(cs, {kGpu0}, {On(kGpu0, 1, "/a", 2 * kGiB), On(kGpu0, 2, "/b", 9 * kGiB)}, true);
  EXPECT_EQ(judged[0].kill_host_pid, 1u);
  EXPECT_EQ(judged[1].kill_host_pid, 0u);
}

TEST(MonitorJudge, TwoHostProcessesSharingAContainerPidAreOneLine) {
  const std::vector<Container> cs{MustParse("a", "VGPU_CGROUP=/a\n")};
  Reading first = On(kGpu0, 1, "/a", kGiB, 600), second = On(kGpu0, 2, "/a", kGiB, 600);
  second.pid = first.pid;
  const auto judged = Judge(cs, {kGpu0}, {first, second}, false);
  ASSERT_EQ(judged[0].verdict.processes.size(), 1u);
  EXPECT_EQ(judged[0].verdict.processes[0].memory_used, 2 * kGiB);
  EXPECT_EQ(judged[0].verdict.processes[0].sm_used, 1000u) << "permille, clamped";
  EXPECT_EQ(judged[0].verdict.devices[0].sm_used, 1000u);
  // ... and the verdict it makes parses.
  verdict::Verdict v = judged[0].verdict;
  v.seq = 1;
  v.stamp_ns = 1;
  verdict::Verdict read;
  std::string error;
  EXPECT_TRUE(verdict::Parse(verdict::Format(v), read, error)) << error;
}

}  // namespace
}  // namespace vgpu::monitor
