// Scenario files (docs/scenarios.md): a full file resolved field by field, each rule of the validator with the exact
// file, line and key it names, the units, the YAML subset and what it refuses, and inputs that must never crash the
// reader (every prefix of a valid file, seeded random mutations).
#include "vgpu/scenario/scenario.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "values.h"
#include "vgpu/scenario/check.h"
#include "yaml.h"

namespace vgpu::scenario {
namespace {

constexpr std::uint64_t kMs = kMillisecondNs;
constexpr std::uint64_t kUs = kMicrosecondNs;
constexpr std::uint64_t kS = kSecondNs;
constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::uint64_t kGiB = 1ull << 30;

// Every key of the format, none at its default (line numbers below refer to this text).
const char* const kFull = R"(---
# every key, none at its default
name: full-example_1.0
description: "Every key, \"quoted\" and all \u00e9"   # a comment
gpu: 2xa100-40gb
timeslice: 500us
mode: [live]
duration: 8s
settle: 2s
window: 500ms
sample: 50ms
seed: 42
tenants:
  - name: a
    limits:
      nvidia.com/gpu: 2
      nvidia.com/gpumem: 4096
      nvidia.com/gpucores: 30%
      nvidia.com/priority: 0
    policy: default
    devices: [1, 0]
    processes:
      - replicas: 3
        start: 500ms
        stop: 7s
        crash_at: 6.5s
        device: 1
        alloc: 2Gi
        work:
          - kernels: 1ms
            for: 2s
            depth: 8
            rate: 200.5
            blocks: 132
            jitter: 2.5%
          - idle: 1.5s
          - {kernels: [5us, 50us, 500us, 5ms], for: 1s}
        repeat: true
    expect:
      - share: 30
        tolerance: 2.5
        from: 1s
        to: 7s
      - worst_window: 5
      - min_share: 20
      - max_share: 35
        from: 3s
      - oom: true
  - name: b
    limits: {nvidia.com/gpumem: 8Gi, nvidia.com/gpucores: 70}
    policy: disable
    processes:
    - work:
      - kernels: 20ms
    - program: [python3, train.py, "--steps", '100']
    expect:
    - share: 70
expect:
  leaked_bytes: 1Mi
faults:
  - 'cuLaunchKernel:error=CUDA_ERROR_LAUNCH_FAILED:prob=0.001'
  - cuMemAlloc_v2:delay_us=100
)";

// The smallest valid scenario; rule tests add one mistake to it.
const char* const kMinimal = R"(duration: 6s
tenants:
  - name: a
    processes:
      - work:
          - kernels: 1ms
)";

std::string Dump(const Loaded& loaded) {
  std::string text;
  for (const Problem& problem : loaded.problems) text += problem.ToString() + "\n";
  return text;
}

Scenario Valid(const std::string& text, const std::string& file = "test.yaml") {
  Loaded loaded = LoadText(text, file);
  EXPECT_TRUE(loaded.problems.empty()) << Dump(loaded);
  EXPECT_TRUE(loaded.scenario.has_value());
  if (loaded.scenario) {
    EXPECT_EQ(Check(*loaded.scenario), "") << "the loader accepted what check.h refuses";
  }
  return loaded.scenario.value_or(Scenario{});
}

// The one problem `text` has; fails the test if it has none or several.
Problem One(const std::string& text) {
  Loaded loaded = LoadText(text, "s.yaml");
  EXPECT_FALSE(loaded.scenario.has_value());
  EXPECT_EQ(loaded.problems.size(), 1u) << Dump(loaded);
  return loaded.problems.empty() ? Problem{} : loaded.problems[0];
}

// Asserts the one problem: its file, line, key, and a fragment of its message.
#define EXPECT_PROBLEM(text, line_, key_, fragment)                                       \
  do {                                                                                    \
    const Problem problem_ = One(text);                                                   \
    EXPECT_EQ(problem_.file, "s.yaml");                                                   \
    EXPECT_EQ(problem_.line, static_cast<std::uint32_t>(line_)) << problem_.ToString();   \
    EXPECT_EQ(problem_.key, key_) << problem_.ToString();                                 \
    EXPECT_NE(problem_.message.find(fragment), std::string::npos) << problem_.ToString(); \
  } while (0)

// kMinimal with `line` put after line `after` (1-based; 0 = first).
std::string With(const std::string& line, int after) {
  std::string text = kMinimal;
  std::size_t at = 0;
  for (int i = 0; i < after; ++i) at = text.find('\n', at) + 1;
  return text.insert(at, line + "\n");
}

// kMinimal with another duration, after `before` (whole lines).
std::string Duration(const std::string& duration, const std::string& before = "") {
  return before + "duration: " + duration + std::string(kMinimal).substr(std::string(kMinimal).find('\n'));
}

// ---- a full file --------------------------------------------------------------------------------------------------

TEST(ScenarioFile, FullFileResolvesEveryField) {
  const Scenario s = Valid(kFull, "scenarios/full.yaml");
  EXPECT_EQ(s.file, "scenarios/full.yaml");
  EXPECT_EQ(s.name, "full-example_1.0");
  EXPECT_EQ(s.description, "Every key, \"quoted\" and all \xc3\xa9");
  EXPECT_EQ(s.gpu, "2*a100-40gb");
  EXPECT_FALSE(s.real_gpu);
  EXPECT_EQ(s.device_count, 2u);
  EXPECT_EQ(s.context_bytes, 416 * kMiB);
  EXPECT_EQ(s.timeslice_ns, 500'000u);
  EXPECT_FALSE(s.virtual_mode);
  EXPECT_TRUE(s.live_mode);
  EXPECT_EQ(s.duration_ns, 8 * kS);
  EXPECT_EQ(s.settle_ns, 2 * kS);
  EXPECT_EQ(s.window_ns, 500 * kMs);
  EXPECT_EQ(s.sample_ns, 50 * kMs);
  EXPECT_EQ(s.seed, 42u);
  EXPECT_EQ(s.expect_leaked_bytes, kMiB);
  EXPECT_EQ(s.faults, (std::vector<std::string>{"cuLaunchKernel:error=CUDA_ERROR_LAUNCH_FAILED:prob=0.001",
                                                "cuMemAlloc_v2:delay_us=100"}));
  ASSERT_EQ(s.tenants.size(), 2u);

  const TenantSpec& a = s.tenants[0];
  EXPECT_EQ(a.name, "a");
  EXPECT_EQ(a.line, 14u);
  EXPECT_EQ(a.gpu_count, 2u);
  EXPECT_EQ(a.memory_limit_bytes, 4096 * kMiB);
  EXPECT_EQ(a.cores_percent, 30u);
  EXPECT_EQ(a.priority, 0u);
  EXPECT_EQ(a.policy, Policy::default_policy);
  EXPECT_EQ(a.devices, (std::vector<std::uint32_t>{1, 0}));
  ASSERT_EQ(a.processes.size(), 1u);
  const ProcessSpec& p = a.processes[0];
  EXPECT_EQ(p.line, 23u);
  EXPECT_EQ(p.replicas, 3u);
  EXPECT_EQ(p.start_ns, 500 * kMs);
  EXPECT_EQ(p.stop_ns, 7 * kS);
  EXPECT_EQ(p.crash_at_ns, std::optional<std::uint64_t>(6500 * kMs));
  EXPECT_EQ(p.device, 1u);
  EXPECT_EQ(p.alloc_bytes, 2 * kGiB);
  EXPECT_TRUE(p.repeat);
  ASSERT_EQ(p.work.size(), 3u);
  EXPECT_EQ(p.work[0].kind, Phase::Kind::kernels);
  EXPECT_EQ(p.work[0].sizes_ns, (std::vector<std::uint64_t>{kMs}));
  EXPECT_EQ(p.work[0].for_ns, 2 * kS);
  EXPECT_EQ(p.work[0].depth, 8u);
  EXPECT_DOUBLE_EQ(p.work[0].rate, 200.5);
  EXPECT_EQ(p.work[0].blocks, 132u);
  EXPECT_EQ(p.work[0].jitter_permille, 25u);
  EXPECT_EQ(p.work[0].line, 30u);
  EXPECT_EQ(p.work[1].kind, Phase::Kind::idle);
  EXPECT_EQ(p.work[1].for_ns, 1500 * kMs);
  EXPECT_TRUE(p.work[1].sizes_ns.empty());
  EXPECT_EQ(p.work[1].line, 36u);
  EXPECT_EQ(p.work[2].kind, Phase::Kind::kernels);
  EXPECT_EQ(p.work[2].sizes_ns, (std::vector<std::uint64_t>{5'000, 50'000, 500'000, 5'000'000}));
  EXPECT_EQ(p.work[2].for_ns, kS);
  EXPECT_EQ(p.work[2].depth, 4u);
  EXPECT_EQ(p.work[2].rate, 0);
  EXPECT_EQ(p.work[2].blocks, 1u);
  EXPECT_EQ(p.work[2].jitter_permille, 0u);
  EXPECT_EQ(p.work[2].line, 37u);

  ASSERT_EQ(a.expect.size(), 4u);  // worst_window joined the share before it
  EXPECT_EQ(a.expect[0].kind, Expectation::Kind::share);
  EXPECT_DOUBLE_EQ(a.expect[0].percent, 30);
  EXPECT_EQ(a.expect[0].tolerance_points, std::optional<double>(2.5));
  EXPECT_EQ(a.expect[0].worst_window_points, std::optional<double>(5));
  EXPECT_EQ(a.expect[0].from_ns, 2 * kS);  // max(settle, from)
  EXPECT_EQ(a.expect[0].to_ns, 7 * kS);
  EXPECT_EQ(a.expect[0].line, 40u);
  EXPECT_EQ(a.expect[1].kind, Expectation::Kind::min_share);
  EXPECT_DOUBLE_EQ(a.expect[1].percent, 20);
  EXPECT_EQ(a.expect[1].from_ns, 2 * kS);
  EXPECT_EQ(a.expect[1].to_ns, 8 * kS);
  EXPECT_FALSE(a.expect[1].tolerance_points.has_value());
  EXPECT_EQ(a.expect[1].line, 45u);
  EXPECT_EQ(a.expect[2].kind, Expectation::Kind::max_share);
  EXPECT_DOUBLE_EQ(a.expect[2].percent, 35);
  EXPECT_EQ(a.expect[2].from_ns, 3 * kS);
  EXPECT_EQ(a.expect[2].to_ns, 8 * kS);
  EXPECT_EQ(a.expect[3].kind, Expectation::Kind::oom);
  EXPECT_TRUE(a.expect[3].oom);
  EXPECT_EQ(a.expect[3].line, 48u);

  const TenantSpec& b = s.tenants[1];
  EXPECT_EQ(b.name, "b");
  EXPECT_EQ(b.line, 49u);
  EXPECT_EQ(b.gpu_count, 1u);
  EXPECT_EQ(b.memory_limit_bytes, 8 * kGiB);
  EXPECT_EQ(b.cores_percent, 70u);
  EXPECT_EQ(b.priority, 1u);
  EXPECT_EQ(b.policy, Policy::disable);
  EXPECT_EQ(b.devices, (std::vector<std::uint32_t>{0}));
  ASSERT_EQ(b.processes.size(), 2u);
  const ProcessSpec& q = b.processes[0];
  EXPECT_EQ(q.line, 53u);
  EXPECT_EQ(q.replicas, 1u);
  EXPECT_EQ(q.start_ns, 0u);
  EXPECT_EQ(q.stop_ns, 8 * kS);  // the scenario's end
  EXPECT_FALSE(q.crash_at_ns.has_value());
  EXPECT_EQ(q.device, 0u);
  EXPECT_EQ(q.alloc_bytes, 0u);
  EXPECT_FALSE(q.repeat);
  ASSERT_EQ(q.work.size(), 1u);
  EXPECT_EQ(q.work[0].sizes_ns, (std::vector<std::uint64_t>{20 * kMs}));
  EXPECT_EQ(q.work[0].for_ns, 0u);
  EXPECT_EQ(q.work[0].line, 54u);
  EXPECT_TRUE(q.program.empty());
  EXPECT_EQ(b.processes[1].program, (std::vector<std::string>{"python3", "train.py", "--steps", "100"}));
  EXPECT_TRUE(b.processes[1].work.empty());
  EXPECT_EQ(b.processes[1].line, 55u);
  ASSERT_EQ(b.expect.size(), 1u);
  EXPECT_EQ(b.expect[0].kind, Expectation::Kind::share);
  EXPECT_DOUBLE_EQ(b.expect[0].percent, 70);
  EXPECT_FALSE(b.expect[0].tolerance_points.has_value());
  EXPECT_FALSE(b.expect[0].worst_window_points.has_value());
  EXPECT_EQ(b.expect[0].from_ns, 2 * kS);
  EXPECT_EQ(b.expect[0].to_ns, 8 * kS);
  EXPECT_EQ(b.expect[0].line, 57u);
}

TEST(ScenarioFile, MinimalFileTakesTheDefaults) {
  const Scenario s = Valid(kMinimal, "dir/thirty-seventy.yaml");
  EXPECT_EQ(s.name, "thirty-seventy");  // the file's name without .yaml
  EXPECT_EQ(s.description, "");
  EXPECT_EQ(s.gpu, "h100-80gb");
  EXPECT_EQ(s.device_count, 1u);
  EXPECT_EQ(s.context_bytes, 518 * kMiB);
  EXPECT_EQ(s.timeslice_ns, 2100 * kUs);  // an H100's, measured (docs/results-gpu.md)
  EXPECT_EQ(s.switch_ns, 160 * kUs);
  EXPECT_TRUE(s.virtual_mode);
  EXPECT_TRUE(s.live_mode);
  EXPECT_EQ(s.duration_ns, 6 * kS);
  EXPECT_EQ(s.settle_ns, kS);
  EXPECT_EQ(s.window_ns, kS);
  EXPECT_EQ(s.sample_ns, 100 * kMs);
  EXPECT_EQ(s.seed, 1u);
  EXPECT_EQ(s.sharing, Sharing::limiter);
  EXPECT_EQ(s.expect_leaked_bytes, 0u);
  EXPECT_TRUE(s.faults.empty());
  ASSERT_EQ(s.tenants.size(), 1u);
  const TenantSpec& t = s.tenants[0];
  EXPECT_EQ(t.gpu_count, 1u);
  EXPECT_EQ(t.memory_limit_bytes, 0u);
  EXPECT_EQ(t.cores_percent, 0u);
  EXPECT_EQ(t.priority, 1u);
  EXPECT_EQ(t.policy, Policy::force);
  EXPECT_EQ(t.devices, (std::vector<std::uint32_t>{0}));
  EXPECT_TRUE(t.expect.empty());
  ASSERT_EQ(t.processes.size(), 1u);
  EXPECT_EQ(t.processes[0].stop_ns, 6 * kS);
  EXPECT_EQ(t.processes[0].work[0].depth, 4u);
  EXPECT_EQ(Valid(kMinimal, "").name, "scenario");
  EXPECT_EQ(Valid(kMinimal, "x.yml").name, "x");
}

TEST(ScenarioFile, DefaultsThatDependOnOtherKeys) {
  // gpu: real runs live only, and has as many devices as the tenants use.
  Scenario s = Valid(With("gpu: real", 0) +
                     "  - name: b\n    devices: [2]\n    processes:\n      - work:\n"
                     "          - idle: 1s\n");
  EXPECT_TRUE(s.real_gpu);
  EXPECT_EQ(s.gpu, "real");
  EXPECT_FALSE(s.virtual_mode);
  EXPECT_TRUE(s.live_mode);
  EXPECT_EQ(s.context_bytes, 0u);
  EXPECT_EQ(s.device_count, 3u);
  // Faults are not modelled in virtual time: a scenario with faults defaults to live.
  s = Valid(std::string(kMinimal) + "faults: [\"cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:count=1\"]\n");
  EXPECT_FALSE(s.virtual_mode);
  EXPECT_TRUE(s.live_mode);
  // devices without nvidia.com/gpu: as many as listed; the 2-device spec spelled as FAKECUDA_DEVICES has it.
  s = Valid("gpu: 2*h100-80gb\n" + With("    devices: [1, 0]", 3));
  EXPECT_EQ(s.tenants[0].gpu_count, 2u);
  // An expectation's period starts at settle unless `from` is later.
  s = Valid(std::string(kMinimal) + "    expect:\n      - max_share: 50\n");
  EXPECT_EQ(s.tenants[0].expect[0].from_ns, kS);
  EXPECT_EQ(s.tenants[0].expect[0].to_ns, 6 * kS);
  // A scalar mode is a list of one.
  s = Valid("mode: virtual\n" + std::string(kMinimal));
  EXPECT_TRUE(s.virtual_mode);
  EXPECT_FALSE(s.live_mode);
}

TEST(ScenarioFile, ProblemToString) {
  EXPECT_EQ((Problem{"a.yaml", 3, "tenants[0].name", "missing"}).ToString(), "a.yaml:3: tenants[0].name: missing");
  EXPECT_EQ((Problem{"a.yaml", 0, "", "cannot read"}).ToString(), "a.yaml:0: cannot read");
  EXPECT_STREQ(PolicyName(Policy::force), "force");
  EXPECT_STREQ(PolicyName(Policy::default_policy), "default");
  EXPECT_STREQ(PolicyName(Policy::disable), "disable");
}

// ---- the rules ----------------------------------------------------------------------------------------------------

// sharing: how the caps are held, limiter (the default) or time-division (docs/compute-sharing.md).
TEST(ScenarioRules, SharingIsLimiterOrTimeDivision) {
  EXPECT_EQ(Valid(With("sharing: time-division", 0)).sharing, Sharing::time_division);
  EXPECT_EQ(Valid(With("sharing: limiter", 0)).sharing, Sharing::limiter);
  EXPECT_PROBLEM(With("sharing: mps", 0), 1, "sharing",
                 "mps is not a way of sharing; expected limiter or time-division");
}

TEST(ScenarioRules, UnknownKeysSuggestAndList) {
  const Problem problem = One(With("tenats: []", 0));
  EXPECT_EQ(problem.ToString(),
            "s.yaml:1: tenats: unknown key 'tenats'; did you mean 'tenants'? (accepted here: name, "
            "description, gpu, timeslice, switch, mode, duration, settle, window, sample, seed, sharing, "
            "tenants, expect, faults)");
  EXPECT_PROBLEM(With("          - kernels: 1ms\n            deph: 2", 6), 8, "tenants[0].processes[0].work[1].deph",
                 "did you mean 'depth'?");
  EXPECT_PROBLEM(With("        kernels: 1ms", 6), 7, "tenants[0].processes[0].kernels",
                 "it belongs in a phase (an item of a process's work:)");
}

TEST(ScenarioRules, UnknownKeyInLimits) {
  const std::string text =
      "duration: 6s\ntenants:\n  - name: a\n    limits:\n      nvidia.com/gpucore: 30\n"
      "    processes:\n      - work:\n          - kernels: 1ms\n";
  EXPECT_PROBLEM(text, 5, "tenants[0].limits.nvidia.com/gpucore", "did you mean 'nvidia.com/gpucores'?");
  EXPECT_PROBLEM(With("    nvidia.com/gpucores: 30", 3), 4, "tenants[0].nvidia.com/gpucores",
                 "it belongs under a tenant's limits:");
}

TEST(ScenarioRules, MissingRequiredKeys) {
  EXPECT_PROBLEM("tenants:\n  - name: a\n    processes:\n      - work:\n          - kernels: 1ms\n", 1, "duration",
                 "missing; a scenario needs its duration");
  EXPECT_PROBLEM("# nothing yet\nduration: 6s\n", 2, "tenants", "missing; a scenario needs 1 .. 16 tenants");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - processes:\n      - work:\n          - kernels: 1ms\n", 3,
                 "tenants[0].name", "missing; every tenant needs a name");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n    processes:\n      - replicas: 2\n", 5,
                 "tenants[0].processes[0].work", "missing; a process needs its work");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n", 3, "tenants[0].processes", "missing");
  EXPECT_PROBLEM("# only a comment\n", 1, "", "holds no scenario");
}

TEST(ScenarioRules, WrongTypes) {
  EXPECT_PROBLEM(With("    limits: [1, 2]", 3), 4, "tenants[0].limits",
                 "found a list; expected the container's limits");
  EXPECT_PROBLEM("duration: 6s\ntenants: {name: a}\n", 2, "tenants",
                 "found a mapping; expected a list of 1 .. 16 tenants");
  EXPECT_PROBLEM("- a\n- b\n", 1, "", "found a list; expected a mapping of keys");
  EXPECT_PROBLEM(With("seed: [1]", 0), 1, "seed", "found a list; expected a whole number");
  EXPECT_PROBLEM(With("description:\n  a: b", 0), 2, "description", "found a mapping; expected one line of text");
  EXPECT_PROBLEM(With("        repeat: yes", 6), 7, "tenants[0].processes[0].repeat",
                 "yes is not a boolean; expected true or false");
  EXPECT_PROBLEM(With("    policy: strict", 3), 4, "tenants[0].policy",
                 "strict is not accepted; expected one of force, default, disable");
}

TEST(ScenarioRules, DuplicateKeysAndTenantNames) {
  EXPECT_PROBLEM("duration: 6s\n" + std::string(kMinimal), 2, "duration",
                 "duplicate key 'duration' (first on line 1); each key may appear once");
  EXPECT_PROBLEM(With("    name: b", 3), 4, "tenants[0].name", "duplicate key 'name' (first on line 3)");
  EXPECT_PROBLEM(With("    limits: {nvidia.com/gpu: 1, nvidia.com/gpu: 1}", 3), 4, "tenants[0].limits.nvidia.com/gpu",
                 "duplicate key");
  EXPECT_PROBLEM(std::string(kMinimal) + "  - name: a\n    processes:\n      - work:\n          - idle: 1s\n", 7,
                 "tenants[1].name", "a is the name of another tenant (line 3); expected a name used once");
  EXPECT_PROBLEM(With("name: two words", 0), 1, "name", "\"two words\" is not a scenario name");
  const Loaded loaded = LoadText(kMinimal, "my scenario.yaml");
  ASSERT_EQ(loaded.problems.size(), 1u);
  EXPECT_EQ(loaded.problems[0].line, 1u);
  EXPECT_NE(loaded.problems[0].message.find("add name: to the file"), std::string::npos);
  std::string text = kMinimal;
  text.replace(text.find("name: a"), 7, "name: a/b");
  EXPECT_PROBLEM(text, 3, "tenants[0].name", "a/b is not a tenant name; expected 1 .. 64 letters, digits");
  // As the runner and the simulator refuse it (one rule: vgpu/scenario/limits.h): a live run makes a folder of it.
  text = kMinimal;
  text.replace(text.find("name: a"), 7, "name: '..'");
  EXPECT_PROBLEM(text, 3, "tenants[0].name",
                 "\"..\" is not a tenant name; expected 1 .. 64 letters, digits, '-', '_', '.', not . or ..");
}

TEST(ScenarioRules, ValuesOutOfRange) {
  const std::string limits = "duration: 6s\ntenants:\n  - name: a\n    limits:\n      ";
  const std::string rest = "\n    processes:\n      - work:\n          - kernels: 1ms\n";
  const Problem problem = One(limits + "nvidia.com/gpucores: -5" + rest);
  EXPECT_EQ(problem.ToString(),
            "s.yaml:5: tenants[0].limits.nvidia.com/gpucores: -5 is not a percentage; expected an integer 1..100 "
            "(0 or absent: no compute limit)");
  EXPECT_PROBLEM(limits + "nvidia.com/gpucores: 150" + rest, 5, "tenants[0].limits.nvidia.com/gpucores",
                 "150 is out of range; expected an integer 1..100");
  EXPECT_PROBLEM(limits + "nvidia.com/gpucores: 30.5" + rest, 5, "tenants[0].limits.nvidia.com/gpucores",
                 "30.5 is not a whole percentage");
  EXPECT_PROBLEM(limits + "nvidia.com/priority: 2" + rest, 5, "tenants[0].limits.nvidia.com/priority",
                 "2 is out of range; expected 0 (high) or 1 (low, the default)");
  EXPECT_PROBLEM(limits + "nvidia.com/gpu: 2" + rest, 5, "tenants[0].limits.nvidia.com/gpu",
                 "2 is out of range; expected 1 .. 1 devices (gpu: h100-80gb has 1 device)");
  EXPECT_PROBLEM(limits + "nvidia.com/gpu: 0" + rest, 5, "tenants[0].limits.nvidia.com/gpu", "0 is out of range");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - share: 120\n", 8, "tenants[0].expect[0].share",
                 "120 is out of range; expected a percentage of the GPU's time, 0 .. 100");
  EXPECT_PROBLEM(With("            jitter: 60%", 6), 7, "tenants[0].processes[0].work[0].jitter",
                 "60% is out of range; expected a percentage 0 .. 50");
  EXPECT_PROBLEM(With("            depth: 0", 6), 7, "tenants[0].processes[0].work[0].depth",
                 "0 is out of range; expected 1 .. 128");
  EXPECT_PROBLEM(With("            rate: 0", 6), 7, "tenants[0].processes[0].work[0].rate", "0 is out of range");
  EXPECT_PROBLEM(With("            blocks: 70000", 6), 7, "tenants[0].processes[0].work[0].blocks",
                 "70000 is out of range; expected 1 .. 65535");
  EXPECT_PROBLEM(With("        replicas: 65", 6), 7, "tenants[0].processes[0].replicas", "65 is out of range");
}

TEST(ScenarioRules, DurationBounds) {
  EXPECT_PROBLEM(Duration("50ms"), 1, "duration", "50ms is too short; expected 100ms .. 3600s");
  EXPECT_PROBLEM(Duration("2h"), 1, "duration", "2h is not a duration; expected a number with ns, us, ms or s");
  EXPECT_PROBLEM(Duration("3601s"), 1, "duration", "3601s is too long; expected 100ms .. 3600s");
  EXPECT_PROBLEM(Duration("0s"), 1, "duration", "0s is zero; expected 100ms .. 3600s");
  EXPECT_PROBLEM(With("          - idle: 0s", 6), 7, "tenants[0].processes[0].work[1].idle", "0s is zero");
  EXPECT_PROBLEM(With("timeslice: 1500ns", 0), 1, "timeslice", "not a whole number of microseconds");
}

TEST(ScenarioRules, ProcessTimes) {
  EXPECT_PROBLEM(With("        start: 3s\n        stop: 2s", 6), 8, "tenants[0].processes[0].stop",
                 "2s is not after start (3s); expected start < stop <= duration (6s)");
  EXPECT_PROBLEM(With("        stop: 7s", 6), 7, "tenants[0].processes[0].stop", "7s is after the end of the scenario");
  EXPECT_PROBLEM(With("        start: 6s", 6), 7, "tenants[0].processes[0].start",
                 "6s is not before the end of the scenario");
  EXPECT_PROBLEM(With("        start: 1s\n        crash_at: 500ms", 6), 8, "tenants[0].processes[0].crash_at",
                 "500ms is outside the process's life [start, stop) = [1s, 6s)");
  EXPECT_PROBLEM(With("        crash_at: 6s", 6), 7, "tenants[0].processes[0].crash_at", "[0s, 6s)");
  Valid(With("        start: 1s\n        crash_at: 1s", 6));  // [start, stop) includes start
}

TEST(ScenarioRules, Devices) {
  EXPECT_PROBLEM(With("        device: 1", 6), 7, "tenants[0].processes[0].device",
                 "1 is not one of the container's devices; expected 0 (the container has one device)");
  EXPECT_PROBLEM("gpu: 2xh100-80gb\n" + With("    devices: [0, 2]", 3), 5, "tenants[0].devices[1]",
                 "2 is out of range; expected a device index, 0 .. 1 (the devices of gpu: 2*h100-80gb)");
  EXPECT_PROBLEM("gpu: 2xh100-80gb\n" + With("    devices: [1, 1]", 3), 5, "tenants[0].devices[1]",
                 "1 is listed twice");
  EXPECT_PROBLEM("gpu: 2xh100-80gb\n" + With("    limits: {nvidia.com/gpu: 1}\n    devices: [0, 1]", 3), 6,
                 "tenants[0].devices", "2 devices listed, but nvidia.com/gpu is 1");
  EXPECT_PROBLEM("gpu: 2xh100-80gb\n" + With("    limits: {nvidia.com/gpu: 2}", 3) + "        device: 2\n", 9,
                 "tenants[0].processes[0].device",
                 "2 is not one of the container's devices; expected 0 .. 1 (the container's 2 devices)");
  EXPECT_PROBLEM(With("gpu: h200", 0), 1, "gpu", "h200 is not a GPU: unknown preset 'h200'");
}

TEST(ScenarioRules, TimelineMultiples) {
  EXPECT_PROBLEM(Duration("5s", "window: 400ms\nsettle: 800ms\n"), 3, "duration",
                 "5s is not a whole number of windows; expected a multiple of window (400ms)");
  EXPECT_PROBLEM(With("settle: 1500ms", 0), 1, "settle",
                 "1500ms is not a whole number of windows; expected a multiple of window (1s, the default)");
  EXPECT_PROBLEM(Duration("1500ms"), 1, "duration",
                 "1500ms is not a whole number of windows; expected a multiple of window (1s, the default)");
  EXPECT_PROBLEM(Duration("1s"), 1, "duration", "1s leaves no window to judge after settle (1s, the default)");
  Valid(Duration("1s", "settle: 0s\n"));
  EXPECT_PROBLEM(With("window: 2s", 0), 1, "window", "2s does not divide settle (1s, the default)");
  EXPECT_PROBLEM(With("window: 500ms\nsample: 300ms", 0), 1, "window",
                 "500ms is not a whole number of samples; expected a multiple of sample (300ms)");
  EXPECT_PROBLEM(With("sample: 300ms", 0), 1, "sample", "300ms does not divide window (1s, the default)");
  EXPECT_PROBLEM(With("settle: 6s", 0), 1, "settle", "6s leaves no window to judge");
}

TEST(ScenarioRules, BadUnitsListTheAcceptedSuffixes) {
  const std::string limits = "duration: 6s\ntenants:\n  - name: a\n    limits:\n      ";
  const std::string rest = "\n    processes:\n      - work:\n          - kernels: 1ms\n";
  EXPECT_PROBLEM(limits + "nvidia.com/gpumem: 4Gb" + rest, 5, "tenants[0].limits.nvidia.com/gpumem",
                 "4Gb is not a size; expected MiB per device as a whole number (e.g. 4096), or a size with Ki, Mi, Gi, "
                 "Ti or k, m, g, t");
  EXPECT_PROBLEM(Duration("10 sec"), 1, "duration",
                 "\"10 sec\" is not a duration; expected a number with ns, us, ms or s (e.g. 1.5s, 200ms, 5us)");
  EXPECT_PROBLEM(Duration("6"), 1, "duration",
                 "6 has no unit; expected a number with ns, us, ms or s (e.g. 6s or 6ms)");
  EXPECT_PROBLEM(limits + "nvidia.com/gpucores: 30 %%" + rest, 5, "tenants[0].limits.nvidia.com/gpucores",
                 "\"30 %%\" is not a percentage; expected an integer 1..100");
  EXPECT_PROBLEM(With("        alloc: 1.5Gi", 6), 7, "tenants[0].processes[0].alloc",
                 "1.5Gi is not a size; expected bytes: a whole number of bytes with Ki, Mi, Gi, Ti or k, m, g, t");
  EXPECT_PROBLEM(With("          - kernels: [1ms, 2 ms]", 6), 7, "tenants[0].processes[0].work[1].kernels[1]",
                 "\"2 ms\" is not a duration");
}

TEST(ScenarioRules, ShareOnATenantThatDoesNotRunThen) {
  const std::string text = With("        stop: 2s", 6) + "    expect:\n      - share: 30\n        from: 3s\n";
  EXPECT_PROBLEM(text, 9, "tenants[0].expect[0].share",
                 "30 cannot be met: no process of tenant 'a' runs during the judged period [3s, 6s)");
  EXPECT_PROBLEM(With("        crash_at: 500ms", 6) + "    expect:\n      - min_share: 10\n", 9,
                 "tenants[0].expect[0].min_share", "runs during the judged period [1s, 6s)");
  // A share of 0 or a max_share is consistent with a tenant that does not run.
  Valid(With("        stop: 1s", 6) + "    expect:\n      - share: 0\n      - max_share: 5\n");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - share: 30\n        from: 5500ms\n", 9,
                 "tenants[0].expect[0].from", "the judged period [5.5s, 6s)");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - share: 30\n        to: 7s\n", 9,
                 "tenants[0].expect[0].to", "7s is after the end of the scenario");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - share: 30\n        tolerance: 0\n", 9,
                 "tenants[0].expect[0].tolerance", "0 is zero");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - min_share: 30\n        tolerance: 2\n", 9,
                 "tenants[0].expect[0].tolerance",
                 "tolerance does not go with min_share; accepted with min_share: min_share, from, to");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - share: 30\n        max_share: 40\n", 8,
                 "tenants[0].expect[0]", "one expectation has share and max_share");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - worst_window: 5\n", 8,
                 "tenants[0].expect[0].worst_window", "no share expectation before it");
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - max_share: 30\n        bogus: 1\n", 9,
                 "tenants[0].expect[0].bogus", "unknown key 'bogus'");  // reported once, as unknown
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - from: 1s\n", 8, "tenants[0].expect[0]",
                 "an expectation needs one of share");
}

TEST(ScenarioRules, OomWithoutAMemoryLimit) {
  EXPECT_PROBLEM(std::string(kMinimal) + "    expect:\n      - oom: true\n", 8, "tenants[0].expect[0].oom",
                 "true, but the tenant has no memory limit");
  Valid(std::string(kMinimal) + "    expect:\n      - oom: false\n");
  Valid(With("    limits:\n      nvidia.com/gpumem: 1Gi", 3) + "    expect:\n      - oom: true\n");
}

TEST(ScenarioRules, RealGpu) {
  EXPECT_PROBLEM(With("gpu: real\nmode: [virtual]", 0), 2, "mode[0]",
                 "virtual with gpu: real; a real GPU runs live only");
  EXPECT_PROBLEM(With("gpu: real\nmode: virtual", 0), 2, "mode", "virtual with gpu: real");
  EXPECT_PROBLEM(With("gpu: real", 0) + "faults:\n  - cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY\n", 8, "faults",
                 "faults are injected by fakecuda, so they cannot be with gpu: real");
  Valid(With("gpu: real\nmode: [live]", 0));
}

// A program: instead of work: (docs/scenarios.md, "Programs"): its words as written, live only, nothing of
// vgpu-tenant's work beside it.
const char* const kProgram = R"(duration: 6s
tenants:
  - name: a
    processes:
      - program: [python3, programs/loop.py, --steps, "100", 'a b']
        stop: 5s
)";

TEST(ScenarioRules, ProgramsAreRunLiveAsWritten) {
  const Scenario s = Valid(kProgram);
  const ProcessSpec& process = s.tenants[0].processes[0];
  EXPECT_EQ(process.program, (std::vector<std::string>{"python3", "programs/loop.py", "--steps", "100", "a b"}));
  EXPECT_TRUE(process.work.empty());
  EXPECT_EQ(process.stop_ns, 5 * kS);
  EXPECT_TRUE(s.live_mode);
  EXPECT_FALSE(s.virtual_mode) << "a program runs as a real process: live only";
  Valid(std::string(kProgram) + "mode: live\n");
  const Scenario block = Valid(
      "duration: 6s\ntenants:\n  - name: a\n    processes:\n      - program:\n"
      "          - /bin/true\n      - work: [{kernels: 1ms}]\n");
  EXPECT_EQ(block.tenants[0].processes[0].program, std::vector<std::string>{"/bin/true"});
  EXPECT_TRUE(block.tenants[0].processes[1].program.empty());
}

TEST(ScenarioRules, ProgramsRefuseWhatTheyCannotDo) {
  EXPECT_PROBLEM(std::string(kProgram) + "mode: [virtual, live]\n", 7, "mode[0]",
                 "virtual with program: processes; a program runs as a real process, live only");
  EXPECT_PROBLEM("gpu: real\n" + std::string(kProgram), 6, "tenants[0].processes[0].program",
                 "cannot run with gpu: real");
  EXPECT_PROBLEM(With("        program: [/bin/true]", 6), 5, "tenants[0].processes[0].work",
                 "given with program:; work: belongs to a vgpu-tenant process");
  EXPECT_PROBLEM(std::string(kProgram) + "        alloc: 1Gi\n", 7, "tenants[0].processes[0].alloc",
                 "given with program:");
  EXPECT_PROBLEM(std::string(kProgram) + "        repeat: true\n", 7, "tenants[0].processes[0].repeat",
                 "given with program:");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n    processes:\n      - program: []\n", 5,
                 "tenants[0].processes[0].program", "no words; expected 1 .. 64");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n    processes:\n      - program: [python3, '']\n", 5,
                 "tenants[0].processes[0].program[1]", "is 0 bytes; expected 1 .. 4096");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n    processes:\n      - program: [\"py\\0thon\"]\n", 5,
                 "tenants[0].processes[0].program[0]", "holds a NUL byte");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n    processes:\n      - program: python3 x.py\n", 5,
                 "tenants[0].processes[0].program", "expected a list of the program and its arguments");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n    processes:\n      - program: [[a]]\n", 5,
                 "tenants[0].processes[0].program[0]", "a word of the command line");
  EXPECT_PROBLEM("duration: 6s\ntenants:\n  - name: a\n    processes:\n      - {}\n", 5, "tenants[0].processes[0].work",
                 "or a program: to run");
  // A program's out-of-memory errors are its own: the tenant's oom expectation counts vgpu-tenant's only.
  const std::string limited =
      "duration: 6s\ntenants:\n  - name: a\n    limits: {nvidia.com/gpumem: 2Gi}\n"
      "    processes:\n      - program: [/bin/true]\n";
  EXPECT_PROBLEM(limited + "    expect:\n      - oom: true\n", 8, "tenants[0].expect[0].oom",
                 "every process of the tenant is a program");
  Valid(limited + "    expect:\n      - oom: false\n");
  Valid(limited + "      - alloc: 3Gi\n        work: [{kernels: 1ms}]\n    expect:\n      - oom: true\n");
}

TEST(ScenarioRules, Phases) {
  EXPECT_PROBLEM(With("          - idle:", 6), 7, "tenants[0].processes[0].work[1].idle",
                 "no time given; an idle phase needs how long");
  EXPECT_PROBLEM(With("          - idle: 1s\n            depth: 2", 6), 8, "tenants[0].processes[0].work[1].depth",
                 "depth applies to kernels phases only");
  EXPECT_PROBLEM(With("          - idle: 1s\n            kernels: 1ms", 6), 7, "tenants[0].processes[0].work[1]",
                 "not both");
  EXPECT_PROBLEM(With("          - for: 1s", 6), 7, "tenants[0].processes[0].work[1]", "a phase needs kernels:");
  EXPECT_PROBLEM(With("          - kernels: []", 6), 7, "tenants[0].processes[0].work[1].kernels",
                 "no sizes; expected");
  EXPECT_PROBLEM(With("            jitter: 2.55%", 6), 7, "tenants[0].processes[0].work[0].jitter", "finer than 0.1%");
  EXPECT_PROBLEM(With("          - kernels: 500ns", 6), 7, "tenants[0].processes[0].work[1].kernels",
                 "500ns is too short; expected 1us .. 3600s");
}

TEST(ScenarioRules, Collectives) {
  const Scenario s = Valid(With("            collective: 1ms\n            ranks: 2\n            every: 4", 6));
  const Phase& phase = s.tenants[0].processes[0].work[0];
  EXPECT_EQ(phase.collective_ns, kMillisecondNs);
  EXPECT_EQ(phase.ranks, 2u);
  EXPECT_EQ(phase.every, 4u);
  EXPECT_EQ(Valid(kMinimal).tenants[0].processes[0].work[0].collective_ns, 0u);
  EXPECT_PROBLEM(With("            collective: 1ms", 6), 6, "tenants[0].processes[0].work[0]",
                 "a collective needs both collective: (its kernel's duration) and ranks:");
  EXPECT_PROBLEM(With("            every: 4", 6), 6, "tenants[0].processes[0].work[0]", "a collective needs both");
  EXPECT_PROBLEM(With("            collective: 1ms\n            ranks: 9", 6), 8,
                 "tenants[0].processes[0].work[0].ranks", "expected 2 .. 8 processes of the tenant, one per device");
  EXPECT_PROBLEM(With("          - idle: 1s\n            ranks: 2", 6), 8, "tenants[0].processes[0].work[1].ranks",
                 "ranks applies to kernels phases only");
}

TEST(ScenarioRules, Faults) {
  EXPECT_PROBLEM(std::string(kMinimal) + "faults:\n  - \"cuLaunchKernel:CUDA_ERROR_LAUNCH_FAILED:p=0.001\"\n", 8,
                 "faults[0]", "is not a fault rule: field 'CUDA_ERROR_LAUNCH_FAILED' is not key=value");
  EXPECT_PROBLEM(std::string(kMinimal) + "faults:\n  - \"a:delay_us=1;b:delay_us=1\"\n", 8, "faults[0]",
                 "holds more than one rule");
  // A control character made by an escape never reaches the rule parser, whose messages echo the rule: a problem is
  // one line (found by tests/fuzz/fuzz_scenario).
  const std::string broken = std::string(kMinimal) + "faults:\n  - \"cuLaun\\nchKernel:delay_us=100\"\n";
  EXPECT_PROBLEM(broken, 8, "faults[0]", "\"cuLaun\\nchKernel:delay_us=100\" holds a control character");
  EXPECT_EQ(One(broken).ToString().find('\n'), std::string::npos);
  Valid(std::string(kMinimal) + "faults:\n");  // an empty list, its items commented out
}

TEST(ScenarioRules, TenantAndProcessCounts) {
  std::string many = "duration: 6s\ntenants:\n";
  for (int i = 0; i < 17; ++i) {
    many += "  - name: t" + std::to_string(i) + "\n    processes:\n      - work: [{kernels: 1ms}]\n";
  }
  EXPECT_PROBLEM(many, 2, "tenants", "17 tenants; expected 1 .. 16");
  EXPECT_PROBLEM("duration: 6s\ntenants: []\n", 2, "tenants", "no tenants; expected 1 .. 16");
  std::string crowd = "duration: 6s\ntenants:\n";
  for (int i = 0; i < 5; ++i) {
    crowd += "  - name: t" + std::to_string(i) + "\n    processes:\n      - replicas: 64\n        work: [{idle: 1s}]\n";
  }
  EXPECT_PROBLEM(crowd, 2, "tenants", "the tenants start 320 processes (replicas counted); expected at most 255");
}

TEST(ScenarioRules, AllProblemsInFileOrder) {
  const std::string text =
      "duration: 6\n"                    // 1
      "window: 1x\n"                     // 2
      "tenants:\n"                       // 3
      "  - name: a\n"                    // 4
      "    limits:\n"                    // 5
      "      nvidia.com/gpucores: -5\n"  // 6
      "    bogus: 1\n"                   // 7
      "    processes:\n"                 // 8
      "      - work:\n"                  // 9
      "          - kernels: 4Gb\n"       // 10
      "name: a b\n";                     // 11
  const Loaded loaded = LoadText(text, "s.yaml");
  ASSERT_EQ(loaded.problems.size(), 6u) << Dump(loaded);
  const std::vector<std::uint32_t> lines = {1, 2, 6, 7, 10, 11};
  for (std::size_t i = 0; i < lines.size(); ++i) EXPECT_EQ(loaded.problems[i].line, lines[i]) << Dump(loaded);
  EXPECT_FALSE(loaded.scenario.has_value());
}

TEST(ScenarioRules, AtMostFiftyProblems) {
  std::string text = kMinimal;
  for (int i = 0; i < 80; ++i) text += "unknown" + std::to_string(i) + ": 1\n";
  const Loaded loaded = LoadText(text, "s.yaml");
  EXPECT_EQ(loaded.problems.size(), 50u);
  EXPECT_EQ(loaded.problems[0].line, 7u);
}

// ---- units --------------------------------------------------------------------------------------------------------

TEST(ScenarioUnits, Durations) {
  using values::DurationStatus;
  std::uint64_t ns = 0;
  const struct {
    const char* text;
    std::uint64_t ns;
  } good[] = {{"1.5s", 1'500'000'000}, {"200ms", 200'000'000}, {"5us", 5'000},           {"100ns", 100},      {"0s", 0},
              {"0.000000001s", 1},     {"1.25ms", 1'250'000},  {"2.50s", 2'500'000'000}, {"3600s", 3600 * kS}};
  for (const auto& g : good) {
    EXPECT_EQ(values::ParseDuration(g.text, ns), DurationStatus::ok) << g.text;
    EXPECT_EQ(ns, g.ns) << g.text;
  }
  EXPECT_EQ(values::ParseDuration("10 sec", ns), DurationStatus::malformed);
  EXPECT_EQ(values::ParseDuration("1m", ns), DurationStatus::malformed);
  EXPECT_EQ(values::ParseDuration("-1s", ns), DurationStatus::malformed);
  EXPECT_EQ(values::ParseDuration(".5s", ns), DurationStatus::malformed);
  EXPECT_EQ(values::ParseDuration("1.s", ns), DurationStatus::malformed);
  EXPECT_EQ(values::ParseDuration("1e3ms", ns), DurationStatus::malformed);
  EXPECT_EQ(values::ParseDuration("", ns), DurationStatus::malformed);
  EXPECT_EQ(values::ParseDuration("30", ns), DurationStatus::no_unit);
  EXPECT_EQ(values::ParseDuration("1.5ns", ns), DurationStatus::finer_than_ns);
  EXPECT_EQ(values::ParseDuration("1.0000000001s", ns), DurationStatus::finer_than_ns);
  EXPECT_EQ(values::ParseDuration("99999999999999999999s", ns), DurationStatus::too_large);
  EXPECT_EQ(values::ParseDuration("18446744074s", ns), DurationStatus::too_large);
  EXPECT_EQ(values::FormatDuration(1'500'000'000), "1.5s");
  EXPECT_EQ(values::FormatDuration(200'000'000), "200ms");
  EXPECT_EQ(values::FormatDuration(1'234'567), "1.234567ms");
  EXPECT_EQ(values::FormatDuration(0), "0s");
  EXPECT_EQ(values::FormatDuration(7), "7ns");
}

TEST(ScenarioUnits, SizesAndPercentages) {
  std::uint64_t bytes = 0;
  EXPECT_TRUE(values::ParseSize("2Gi", bytes));
  EXPECT_EQ(bytes, 2 * kGiB);
  EXPECT_TRUE(values::ParseSize("4g", bytes));
  EXPECT_EQ(bytes, 4 * kGiB);
  EXPECT_TRUE(values::ParseSize("512Mi", bytes));
  EXPECT_EQ(bytes, 512 * kMiB);
  EXPECT_TRUE(values::ParseSize("1k", bytes));
  EXPECT_EQ(bytes, 1024u);
  EXPECT_TRUE(values::ParseSize("1Ti", bytes));
  EXPECT_EQ(bytes, 1ull << 40);
  EXPECT_TRUE(values::ParseSize("1000", bytes));
  EXPECT_EQ(bytes, 1000u);
  for (const char* bad : {"4Gb", "4 Gi", "-1", "1.5Gi", "Gi", "", "99999999999Ti", "4GiB"}) {
    EXPECT_FALSE(values::ParseSize(bad, bytes)) << bad;
  }
  double percent = 0;
  EXPECT_TRUE(values::ParsePercent("30", percent));
  EXPECT_EQ(percent, 30);
  EXPECT_TRUE(values::ParsePercent("30%", percent));
  EXPECT_EQ(percent, 30);
  EXPECT_TRUE(values::ParsePercent("2.5%", percent));
  EXPECT_EQ(percent, 2.5);
  for (const char* bad : {"30 %", "30%%", "%", "-5", "1e2", "inf", "nan", "30 %%"}) {
    EXPECT_FALSE(values::ParsePercent(bad, percent)) << bad;
  }
  EXPECT_EQ(values::FormatBytes(518 * kMiB), "518Mi");
  EXPECT_EQ(values::FormatBytes(1000), "1000 bytes");
}

TEST(ScenarioUnits, MemoryLimitIsMiBWhenBare) {
  const auto limit = [](const std::string& value) {
    return Valid(With("    limits:\n      nvidia.com/gpumem: " + value, 3)).tenants[0].memory_limit_bytes;
  };
  EXPECT_EQ(limit("4096"), 4096 * kMiB);
  EXPECT_EQ(limit("\"4096\""), 4096 * kMiB);
  EXPECT_EQ(limit("4Gi"), 4 * kGiB);
  EXPECT_EQ(limit("4g"), 4 * kGiB);
  EXPECT_EQ(limit("0"), 0u);
  EXPECT_EQ(Valid(With("        alloc: 4096", 6)).tenants[0].processes[0].alloc_bytes, 4096u);  // bytes elsewhere
  EXPECT_EQ(Valid(With("    limits: {nvidia.com/gpucores: 30%}", 3)).tenants[0].cores_percent, 30u);
  EXPECT_EQ(Valid(With("            jitter: 10", 6)).tenants[0].processes[0].work[0].jitter_permille, 100u);
}

// ---- the YAML subset ----------------------------------------------------------------------------------------------

yaml::Document ReadYaml(const std::string& text) { return yaml::Read(text, "y.yaml"); }

// The root of a document read without a problem (a copy: the document is often a temporary).
yaml::Node Root(const yaml::Document& document) {
  EXPECT_TRUE(document.complete);
  EXPECT_TRUE(document.problems.empty()) << (document.problems.empty() ? "" : document.problems[0].ToString());
  return document.root;
}

TEST(ScenarioYaml, CommentsAndQuotes) {
  const yaml::Document document = ReadYaml(
      "# leading comment\n"
      "a: value # trailing\n"
      "b: 'it''s # not a comment'\n"
      "c: \"tab\\there \\\"q\\\" \\u00e9 \\x41 # kept\"   # comment\n"
      "d: a#b\n"
      "   # an indented comment\n"
      "e: http://x:80/y\n"
      "'quoted key': 1\n"
      "f: ''\n");
  const yaml::Node& root = Root(document);
  ASSERT_EQ(root.kind, yaml::Node::Kind::mapping);
  ASSERT_EQ(root.children.size(), 7u);
  EXPECT_EQ(root.Find("a")->text, "value");
  EXPECT_EQ(root.Find("a")->line, 2u);
  EXPECT_EQ(root.Find("b")->text, "it's # not a comment");
  EXPECT_EQ(root.Find("b")->style, yaml::Node::Style::single_quoted);
  EXPECT_EQ(root.Find("c")->text, "tab\there \"q\" \xc3\xa9 A # kept");
  EXPECT_EQ(root.Find("d")->text, "a#b");
  EXPECT_EQ(root.Find("e")->text, "http://x:80/y");
  EXPECT_EQ(root.Find("quoted key")->text, "1");
  EXPECT_EQ(root.Find("f")->kind, yaml::Node::Kind::scalar);
  EXPECT_EQ(root.Find("f")->text, "");
}

TEST(ScenarioYaml, FlowCollections) {
  const yaml::Node& root =
      Root(ReadYaml("a: [0, 1 , 'two', \"3\"]\nb: {kernels: 1ms, for: 2s}\nc: []\nd: {}\n"
                    "e: [x, [y, z], {k: v}]\nf: [1, 2,]\ng: {k: }\n"));
  const yaml::Node* a = root.Find("a");
  ASSERT_EQ(a->kind, yaml::Node::Kind::sequence);
  ASSERT_EQ(a->children.size(), 4u);
  EXPECT_EQ(a->children[1].text, "1");
  EXPECT_EQ(a->children[2].text, "two");
  EXPECT_EQ(a->children[3].text, "3");
  const yaml::Node* b = root.Find("b");
  ASSERT_EQ(b->kind, yaml::Node::Kind::mapping);
  EXPECT_EQ(b->Find("kernels")->text, "1ms");
  EXPECT_EQ(b->Find("for")->text, "2s");
  EXPECT_TRUE(root.Find("c")->children.empty());
  EXPECT_EQ(root.Find("c")->kind, yaml::Node::Kind::sequence);
  EXPECT_EQ(root.Find("d")->kind, yaml::Node::Kind::mapping);
  EXPECT_EQ(root.Find("e")->children[1].children[1].text, "z");
  EXPECT_EQ(root.Find("e")->children[2].Find("k")->text, "v");
  EXPECT_EQ(root.Find("f")->children.size(), 2u);
  EXPECT_EQ(root.Find("g")->Find("k")->kind, yaml::Node::Kind::null);
}

TEST(ScenarioYaml, NestedSequencesOfMappings) {
  const yaml::Node& root =
      Root(ReadYaml("list:\n"
                    "- a: 1\n"  // a list at its key's indentation
                    "  b: 2\n"
                    "-   c: 3\n"  // more spaces after the dash: the mapping's column moves with them
                    "    d:\n"
                    "      - - x\n"  // a list in a list
                    "        - y\n"
                    "      - z\n"
                    "-\n"  // an item on the lines below its dash
                    "  e: 5\n"
                    "- \n"  // an empty item
                    "after: 6\n"));
  const yaml::Node* list = root.Find("list");
  ASSERT_EQ(list->children.size(), 4u);
  EXPECT_EQ(list->children[0].Find("b")->text, "2");
  EXPECT_EQ(list->children[0].Find("b")->key_line, 3u);
  EXPECT_EQ(list->children[1].Find("c")->text, "3");
  const yaml::Node* d = list->children[1].Find("d");
  ASSERT_EQ(d->children.size(), 2u);
  EXPECT_EQ(d->children[0].children[1].text, "y");
  EXPECT_EQ(d->children[1].text, "z");
  EXPECT_EQ(list->children[2].Find("e")->text, "5");
  EXPECT_EQ(list->children[3].kind, yaml::Node::Kind::null);
  EXPECT_EQ(list->children[3].line, 11u);
  EXPECT_EQ(root.Find("after")->text, "6");
}

TEST(ScenarioYaml, EmptyValuesAndNulls) {
  const yaml::Node& root = Root(ReadYaml("a:\nb: ~\nc: null\nd: # only a comment\ne: [null]\n"));
  for (const char* key : {"a", "b", "c", "d"}) {
    EXPECT_EQ(root.Find(key)->kind, yaml::Node::Kind::null) << key;
  }
  EXPECT_EQ(root.Find("a")->line, 1u);
  EXPECT_EQ(root.Find("d")->line, 4u);
  EXPECT_EQ(root.Find("e")->children[0].kind, yaml::Node::Kind::null);
}

TEST(ScenarioYaml, MarkersLineEndingsAndBom) {
  EXPECT_EQ(Root(ReadYaml("---\na: 1\n")).Find("a")->line, 2u);
  EXPECT_EQ(Root(ReadYaml("# c\n--- # start\na: 1\n...\n")).Find("a")->text, "1");
  EXPECT_EQ(Root(ReadYaml("a: 1\r\nb: 2\r\n")).Find("b")->text, "2");
  EXPECT_EQ(Root(ReadYaml("\xef\xbb\xbf"
                          "a: 1"))
                .Find("a")
                ->text,
            "1");  // a BOM, no final newline
  EXPECT_EQ(Root(ReadYaml("")).kind, yaml::Node::Kind::null);
  EXPECT_EQ(Root(ReadYaml("a:\tx\n")).Find("a")->text, "x");  // a tab inside a line is a blank
}

// The one problem of a refused text: its line and a fragment of its message.
void ExpectRefused(const std::string& text, std::uint32_t line, const std::string& fragment) {
  const yaml::Document document = ReadYaml(text);
  EXPECT_FALSE(document.complete) << text;
  ASSERT_EQ(document.problems.size(), 1u) << text;
  EXPECT_EQ(document.problems[0].line, line) << document.problems[0].ToString();
  EXPECT_NE(document.problems[0].message.find(fragment), std::string::npos) << document.problems[0].ToString();
  // Through the public entry point too: the same single problem, no scenario.
  const Loaded loaded = LoadText(text, "y.yaml");
  EXPECT_FALSE(loaded.scenario.has_value());
  ASSERT_EQ(loaded.problems.size(), 1u);
}

TEST(ScenarioYaml, Refusals) {
  ExpectRefused("a:\n\tb: 1\n", 2, "a tab in the indentation at column 1; indent with spaces only");
  ExpectRefused("a:\n  \tb: 1\n", 2, "a tab in the indentation at column 3");
  ExpectRefused("a: &x 1\n", 1, "anchors (&name) and aliases (*name) are not supported");
  ExpectRefused("a: 1\nb: *x\n", 2, "anchors (&name) and aliases (*name)");
  ExpectRefused("&x a: 1\n", 1, "anchors");
  ExpectRefused("a: !!str 1\n", 1, "tags (!name) are not supported");
  ExpectRefused("a: [!x 1]\n", 1, "tags");
  ExpectRefused("a: |\n  text\n", 1, "block scalars ('|') are not supported");
  ExpectRefused("a: >\n  text\n", 1, "block scalars ('>')");
  ExpectRefused("a: 1\n---\nb: 2\n", 2, "a second document ('---')");
  ExpectRefused("a: 1\n...\nb: 2\n", 3, "text after the end of the document");
  ExpectRefused("--- a: 1\n", 1, "put the document on the lines after '---'");
  ExpectRefused("%YAML 1.2\n---\na: 1\n", 1, "directives");
  ExpectRefused("? a\n: 1\n", 1, "complex keys ('? ') are not supported");
  ExpectRefused("[a, b]: 1\n", 1, "a key must be a plain or quoted name, not a flow collection");
  ExpectRefused("a: {[x]: 1}\n", 1, "a key must be a plain or quoted name");
  ExpectRefused("a: 1\n  b: 2\n", 2, "unexpected indentation: 'a' on line 1 already has a value");
  ExpectRefused("a:\n    b: 1\n  c: 2\n", 3, "unexpected indentation");
  ExpectRefused("a:\n  - 1\n   - 2\n", 3, "unexpected indentation");
  ExpectRefused("a:\n  - 1\n  b: 2\n", 3, "expected a list item ('- ...') like line 2");
  ExpectRefused("a: 1\n- 2\n", 2, "a list item ('- ') where 'key: value' was expected");
  ExpectRefused("a: 1\njust text\n", 2, "expected 'key: value'");
  ExpectRefused("a: [1, 2\n", 1, "the '[' at column 4 is not closed on this line");
  ExpectRefused("a: {b: 1\n", 1, "is not closed on this line");
  ExpectRefused("a: \"open\n", 1, "does not end on this line");
  ExpectRefused("a: 'open\n", 1, "does not end on this line");
  ExpectRefused("a: \"\\q\"\n", 1, "unknown escape '\\q'");
  ExpectRefused("a: \"\\u12\"\n", 1, "needs 4 hexadecimal digits");
  ExpectRefused("a: \"\\ud800\"\n", 1, "is not a Unicode character");
  // The whole character after the backslash, not its first byte: the message stays UTF-8 (`vgpu check` raised
  // UnicodeDecodeError; found by tests/fuzz/fuzz_scenario).
  ExpectRefused("a: \"\\\xc3\xa9\"\n", 1, "unknown escape '\\\xc3\xa9' at column 5");
  ExpectRefused("a: \"x\\\xf0\x9f\x98\x80\"\n", 1, "unknown escape '\\\xf0\x9f\x98\x80' at column 6;");
  ExpectRefused("a: b: c\n", 1, "': ' inside a plain value");
  ExpectRefused("a: - b\n", 1, "a list cannot start on its key's line");
  ExpectRefused("a: [1, , 2]\n", 1, "an empty item");
  ExpectRefused("a: [1 2] x\n", 1, "unexpected text after ']'");
  ExpectRefused("a: 'x' y\n", 1, "unexpected text after the closing quote");
  ExpectRefused("a: [k: v]\n", 1, "'key: value' inside a flow list");
  ExpectRefused("a: {k}\n", 1, "expected ':' after the key 'k'");
  ExpectRefused(": 1\n", 1, "a key is missing before ':'");
  ExpectRefused("a: @x\n", 1, "a value cannot start with '@'");
  ExpectRefused("a: 1\x01\n", 1, "control character 0x01 at column 5");
  ExpectRefused("a: \xff\n", 1, "byte 0xff at column 4 is not UTF-8");
  ExpectRefused("a: \xc0\x80\n", 1, "is not UTF-8");  // an overlong NUL
  ExpectRefused("a:\t|\n", 1, "block scalars");
  ExpectRefused("-\tx\n", 1, "a tab after '-'");
  ExpectRefused("a: {" + std::string(300, 'k') + ": 1}\n", 1, "a key of 300 bytes");
  ExpectRefused(std::string(257, 'k') + ": 1\n", 1, "keys are at most 256 bytes");
  // Escapes cannot put a line break (or another control character) into a key, which every problem echoes: a problem
  // is one line (found by tests/fuzz/fuzz_scenario).
  ExpectRefused("\"tenats\\nfake.yaml:1: ok\": 1\n", 1,
                "control character 0x0a in the key \"tenats\\nfake.yaml:1: ok\"");
  ExpectRefused("a: {\"x\\0\": 1}\n", 1, "control character 0x00 in the key");
  ExpectRefused("a:\n  - 'x': 1\n    \"\\e\": 2\n", 3, "control character 0x1b");
}

TEST(ScenarioYaml, DuplicateKeysAreReportedAndReadingGoesOn) {
  const yaml::Document document = ReadYaml("a: 1\nb: 2\na: 3\nc: {x: 1, x: 2}\n");
  EXPECT_TRUE(document.complete);
  ASSERT_EQ(document.problems.size(), 2u);
  EXPECT_EQ(document.problems[0].ToString(),
            "y.yaml:3: a: duplicate key 'a' (first on line 1); each key may appear once");
  EXPECT_EQ(document.problems[1].key, "c.x");
  EXPECT_EQ(document.root.Find("a")->text, "1");  // the first one is kept
}

TEST(ScenarioYaml, NestingIsBounded) {
  std::string dashes;
  for (int i = 0; i < 10000; ++i) dashes += "- ";
  ExpectRefused(dashes + "x\n", 1, "nested more than 64 levels deep");
  ExpectRefused("a: " + std::string(10000, '[') + "\n", 1, "nested more than 64 levels deep");
  std::string stairs;
  for (int i = 0; i < 200; ++i) stairs += std::string(i, ' ') + "k:\n";
  ExpectRefused(stairs, 66, "nested more than 64 levels deep");
  std::string fine;
  for (int i = 0; i < 30; ++i) fine += std::string(i, ' ') + "k:\n";
  EXPECT_TRUE(ReadYaml(fine).complete);
}

TEST(ScenarioYaml, ShownValues) {
  yaml::Node node;
  node.kind = yaml::Node::Kind::scalar;
  node.text = "4Gb";
  EXPECT_EQ(yaml::Shown(node), "4Gb");
  node.text = "10 sec";
  EXPECT_EQ(yaml::Shown(node), "\"10 sec\"");
  node.text = "a\"b\n";
  EXPECT_EQ(yaml::Shown(node), "\"a\\\"b\\n\"");
  node.text = std::string(100, 'x');
  EXPECT_EQ(yaml::Shown(node), "\"" + std::string(60, 'x') + "...\"");
  node.kind = yaml::Node::Kind::null;
  node.text = "";
  EXPECT_EQ(yaml::Shown(node), "an empty value");
}

// ---- robustness ---------------------------------------------------------------------------------------------------

bool IsUtf8(const std::string& text) {
  for (std::size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const std::size_t length = lead < 0x80         ? 1
                               : (lead >> 5) == 6  ? 2
                               : (lead >> 4) == 14 ? 3
                               : (lead >> 3) == 30 ? 4
                                                   : 0;
    if (length == 0 || i + length > text.size()) return false;
    for (std::size_t k = 1; k < length; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xc0) != 0x80) return false;
    }
    i += length;
  }
  return true;
}

// What every answer must be: a scenario and no problem, or problems (at most 50) and no scenario, each naming the
// file, a line of the text, and a message that is valid UTF-8 (it goes into Python strings).
void ExpectWellFormed(const std::string& text, const std::string& what) {
  const Loaded loaded = LoadText(text, "f.yaml");
  ASSERT_NE(loaded.scenario.has_value(), !loaded.problems.empty()) << what;
  ASSERT_LE(loaded.problems.size(), 50u) << what;
  const auto lines = static_cast<std::uint32_t>(std::count(text.begin(), text.end(), '\n') + 1);
  for (const Problem& problem : loaded.problems) {
    ASSERT_EQ(problem.file, "f.yaml") << what;
    ASSERT_LE(problem.line, lines) << what << "\n" << problem.ToString();
    ASSERT_FALSE(problem.message.empty()) << what;
    ASSERT_TRUE(IsUtf8(problem.ToString())) << what << "\n" << problem.ToString();
  }
  // What the loader accepts keeps the rules the runner applies (check.h): one set of rules, two ways in.
  if (loaded.scenario) {
    ASSERT_EQ(Check(*loaded.scenario), "") << what << "\n" << text;
  }
}

TEST(ScenarioRobustness, EveryPrefixOfAValidFile) {
  const std::string full = kFull;
  for (std::size_t length = 0; length <= full.size(); ++length) {
    ExpectWellFormed(full.substr(0, length), "prefix of " + std::to_string(length) + " bytes");
    if (HasFatalFailure()) return;
  }
}

TEST(ScenarioRobustness, SeededRandomMutations) {
  const std::string full = kFull;
  std::mt19937_64 random(20240605);
  const std::string alphabet = " \t\n\r:-#[]{},'\"&*!|>?%@`\\0123456789aZ.~";
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(random() % n); };
  for (int round = 0; round < 4000; ++round) {
    std::string text = full;
    const int edits = 1 + static_cast<int>(pick(8));
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = text.empty() ? 0 : pick(text.size());
      switch (pick(6)) {
        case 0:
          if (!text.empty()) text[at] = alphabet[pick(alphabet.size())];
          break;
        case 1:
          text.insert(at, 1, alphabet[pick(alphabet.size())]);
          break;
        case 2:
          if (!text.empty()) text.erase(at, 1 + pick(20));
          break;
        case 3:
          text.insert(at, 1, static_cast<char>(pick(256)));
          break;   // any byte
        case 4: {  // copy a slice elsewhere (lines moved, indentation shifted)
          const std::size_t from = pick(full.size());
          text.insert(at, full.substr(from, pick(80)));
          break;
        }
        default:
          text.insert(at, std::string(pick(6), ' '));
          break;
      }
    }
    ExpectWellFormed(text, "round " + std::to_string(round));
    if (HasFatalFailure()) return;
  }
}

TEST(ScenarioRobustness, RandomGarbage) {
  std::mt19937_64 random(7);
  for (int round = 0; round < 1000; ++round) {
    std::string text(static_cast<std::size_t>(random() % 400), '\0');
    for (char& c : text) c = static_cast<char>(random() % 256);
    ExpectWellFormed(text, "garbage " + std::to_string(round));
    if (HasFatalFailure()) return;
  }
  // Too large a text is refused before it is read.
  const Loaded loaded = LoadText(std::string((1 << 20) + 1, 'a'), "big.yaml");
  ASSERT_EQ(loaded.problems.size(), 1u);
  EXPECT_EQ(loaded.problems[0].line, 0u);
  EXPECT_NE(loaded.problems[0].message.find("at most 1048576 bytes"), std::string::npos);
}

// Large inputs cost time in proportion to their size (a quadratic path would take minutes here, not milliseconds).
TEST(ScenarioRobustness, LargeInputsStayLinear) {
  const auto started = std::chrono::steady_clock::now();
  std::string deep;  // 60 levels of long keys, then many entries under them: paths are built only for problems
  for (int i = 0; i < 60; ++i) deep += std::string(static_cast<std::size_t>(i), ' ') + std::string(250, 'k') + ":\n";
  while (deep.size() < 900'000) deep += std::string(60, ' ') + "x" + std::to_string(deep.size()) + ": 1\n";
  ExpectWellFormed(deep, "deep");
  std::string wide = "a: [";
  while (wide.size() < 1'000'000) wide += "1,";
  ExpectRefused(wide + "]\n", 1, "more than 100000 values");
  std::string keys;
  while (keys.size() < 1'000'000) keys += "unknown" + std::to_string(keys.size()) + ": 1\n";
  ExpectWellFormed(keys, "many keys");
  std::string duplicates;
  while (duplicates.size() < 1'000'000) duplicates += "d: 1\n";
  EXPECT_EQ(LoadText(duplicates, "f.yaml").problems.size(), 50u);
  ExpectWellFormed("a: " + std::string(1'000'000, 'x') + "\n", "a long value");
  ExpectWellFormed(std::string(1'000'000, '\n'), "blank lines");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_LT(seconds, 20.0);
}

// ---- the rules of a struct built in code (check.h) ----------------------------------------------------------------

// A struct a file could have given, then one field broken at a time the way code can break it. Each was taken by
// the runner's own check before the rules were one (rate 1e7, 65 phases, 17 entries, a tenant with no process,
// priority 2, settle equal to duration, a 1 ns duration), or is a bound a file states in other words.
TEST(ScenarioCheck, RefusesWhatAFileCouldNotSayNamingTheField) {
  const Scenario base = Valid("duration: 2s\ntenants:\n  - name: a\n    processes:\n      - work: [{kernels: 1ms}]\n");
  ASSERT_EQ(Check(base), "");
  struct Case {
    const char* expected;
    void (*change)(Scenario&);
  };
  const Case cases[] = {
      {"work[0].rate = 10000000.000000; accepted: 0 (a closed loop) or 0.001 .. 1e6",
       [](Scenario& s) { s.tenants[0].processes[0].work[0].rate = 1e7; }},
      {"work[0].rate = 0.000100", [](Scenario& s) { s.tenants[0].processes[0].work[0].rate = 1e-4; }},
      {"work.size() = 65; accepted: 1 .. 64",
       [](Scenario& s) { s.tenants[0].processes[0].work.resize(65, s.tenants[0].processes[0].work[0]); }},
      {"tenants[0].processes.size() = 17",
       [](Scenario& s) { s.tenants[0].processes.resize(17, s.tenants[0].processes[0]); }},
      {"tenants[0].processes.size() = 0", [](Scenario& s) { s.tenants[0].processes.clear(); }},
      {"tenants[0].priority = 2", [](Scenario& s) { s.tenants[0].priority = 2; }},
      {"settle_ns = 2000000000", [](Scenario& s) { s.settle_ns = s.duration_ns; }},
      {"duration_ns = 1; accepted: 100 ms .. 1 h", [](Scenario& s) { s.duration_ns = 1; }},
      {"sample_ns = 120000000000", [](Scenario& s) { s.sample_ns = s.window_ns = 120 * kS, s.duration_ns = 240 * kS; }},
      {"switch_ns = 200000000", [](Scenario& s) { s.switch_ns = 200 * kMs; }},
      {"work[0].jitter_permille = 501", [](Scenario& s) { s.tenants[0].processes[0].work[0].jitter_permille = 501; }},
      {"work[0].ranks = 1",
       [](Scenario& s) {
         s.tenants[0].processes[0].work[0].collective_ns = kMs;
         s.tenants[0].processes[0].work[0].ranks = 1;
       }},
      {"work[0].for_ns = 3600000000001", [](Scenario& s) { s.tenants[0].processes[0].work[0].for_ns = 3600 * kS + 1; }},
      {"tenants[0].expect[0].to_ns = 3000000000",
       [](Scenario& s) {
         Expectation e;
         e.percent = 30, e.from_ns = kS, e.to_ns = 3 * kS;
         s.tenants[0].expect.push_back(e);
       }},
      {"tenants[0].expect[0].tolerance_points = 0.000000",
       [](Scenario& s) {
         Expectation e;
         e.percent = 30, e.from_ns = kS, e.to_ns = 2 * kS, e.tolerance_points = 0;
         s.tenants[0].expect.push_back(e);
       }},
      {"gpu = '9*h100-80gb': the repeat count", [](Scenario& s) { s.gpu = "9*h100-80gb"; }},
      {"gpu = '8*h100-80gb,h100-80gb' names 9 devices", [](Scenario& s) { s.gpu = "8*h100-80gb,h100-80gb"; }},
      {"device_count = 17", [](Scenario& s) { s.gpu = "real", s.real_gpu = true, s.device_count = 17; }},
      {"program is set with gpu = 'real'",
       [](Scenario& s) {
         s.gpu = "real", s.real_gpu = true, s.device_count = 1;
         s.tenants[0].processes[0].work.clear();
         s.tenants[0].processes[0].program = {"/bin/true"};
       }},
      {"work.size() = 1; accepted: 0 with a program",
       [](Scenario& s) { s.tenants[0].processes[0].program = {"/bin/true"}; }},
      {"alloc_bytes = 1; accepted: 0 with a program",
       [](Scenario& s) {
         s.tenants[0].processes[0].work.clear();
         s.tenants[0].processes[0].program = {"/bin/true"};
         s.tenants[0].processes[0].alloc_bytes = 1;
       }},
      {"repeat = true with a program",
       [](Scenario& s) {
         s.tenants[0].processes[0].work.clear();
         s.tenants[0].processes[0].program = {"/bin/true"};
         s.tenants[0].processes[0].repeat = true;
       }},
      {"program.size() = 65",
       [](Scenario& s) {
         s.tenants[0].processes[0].work.clear();
         s.tenants[0].processes[0].program.assign(65, "x");
       }},
      {"program[1].size() = 0",
       [](Scenario& s) {
         s.tenants[0].processes[0].work.clear();
         s.tenants[0].processes[0].program = {"/bin/true", ""};
       }},
  };
  for (const Case& c : cases) {
    Scenario s = base;
    c.change(s);
    const std::string problem = Check(s);
    EXPECT_NE(problem.find(c.expected), std::string::npos) << "expected: " << c.expected << "\ngot: " << problem;
    EXPECT_EQ(problem.find('\n'), std::string::npos) << problem;
  }
}

// The rules' edges are the file's: what a file may say at its bounds, a struct may hold.
TEST(ScenarioCheck, AcceptsTheFilesBounds) {
  const Scenario s = Valid(
      "gpu: 8xh100-80gb\nduration: 100ms\nsettle: 0s\nwindow: 100ms\nsample: 1ms\nswitch: 100ms\ntimeslice: 1s\n"
      "tenants:\n  - name: a\n    processes:\n      - replicas: 64\n        work:\n          - kernels: 1us\n"
      "            depth: 128\n            rate: 1000000\n            jitter: 50%\n            blocks: 65535\n");
  EXPECT_EQ(Check(s), "");
}

// ---- files --------------------------------------------------------------------------------------------------------

// The scenario library in scenarios/ is the format's first user: every file in it loads without a problem.
TEST(ScenarioLoadFile, TheScenarioLibraryLoads) {
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(VGPU_SCENARIOS_DIR)) {
    if (entry.path().extension() != ".yaml") continue;
    ++files;
    const Loaded loaded = LoadFile(entry.path().string());
    EXPECT_TRUE(loaded.scenario.has_value()) << Dump(loaded);
    if (loaded.scenario) {
      EXPECT_EQ(loaded.scenario->name, entry.path().stem().string());
      EXPECT_EQ(Check(*loaded.scenario), "") << entry.path();
    }
  }
  EXPECT_GT(files, 0u);
}

TEST(ScenarioLoadFile, MissingFileIsOneProblemAtLineZero) {
  const std::string path = "/nonexistent-dir/none.yaml";
  const Loaded loaded = LoadFile(path);
  EXPECT_FALSE(loaded.scenario.has_value());
  ASSERT_EQ(loaded.problems.size(), 1u);
  EXPECT_EQ(loaded.problems[0].file, path);
  EXPECT_EQ(loaded.problems[0].line, 0u);
  EXPECT_NE(loaded.problems[0].message.find(path), std::string::npos);
  EXPECT_NE(loaded.problems[0].message.find(std::strerror(ENOENT)), std::string::npos);
  EXPECT_EQ(loaded.problems[0].ToString(), path + ":0: cannot read " + path + ": " + std::strerror(ENOENT));
}

TEST(ScenarioLoadFile, ReadsAFileAndNamesTheScenarioAfterIt) {
  char directory[] = "/tmp/scenario_test.XXXXXX";
  ASSERT_NE(mkdtemp(directory), nullptr);
  const std::string path = std::string(directory) + "/two-tenants.yaml";
  std::FILE* file = std::fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fputs(kMinimal, file);
  std::fclose(file);
  const Loaded loaded = LoadFile(path);
  ASSERT_TRUE(loaded.scenario.has_value()) << Dump(loaded);
  EXPECT_EQ(loaded.scenario->name, "two-tenants");
  EXPECT_EQ(loaded.scenario->file, path);
  const Loaded directory_loaded = LoadFile(directory);  // a directory cannot be read as a file
  ASSERT_EQ(directory_loaded.problems.size(), 1u);
  EXPECT_EQ(directory_loaded.problems[0].line, 0u);
  EXPECT_NE(directory_loaded.problems[0].message.find(std::strerror(EISDIR)), std::string::npos);
  std::remove(path.c_str());
  rmdir(directory);
}

}  // namespace
}  // namespace vgpu::scenario
