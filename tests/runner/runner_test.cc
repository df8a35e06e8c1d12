// The scenario runner (sim/runner): virtual mode's trace (shares per window, the memory ledger and OOM, crashes,
// devices with budgets of their own, determinism, JSON lines, refusals), and live mode over fakecuda with real
// vgpu-tenant processes under the shim (a capped tenant, an OOM, a SIGKILL whose memory comes back).
// Scenarios are built as structs here, as the parser (sim/scenario) would resolve them.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/runner/runner.h"
#include "vgpu/scenario/scenario.h"

namespace vgpu::runner {
namespace {

using scenario::kMicrosecondNs;
using scenario::kMillisecondNs;
using scenario::kSecondNs;
constexpr std::uint64_t kUs = kMicrosecondNs;
constexpr std::uint64_t kMs = kMillisecondNs;
constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::uint64_t kGiB = 1ull << 30;
constexpr std::uint64_t kH100ContextBytes = 518 * kMiB;
constexpr std::uint64_t kH100ReservedBytes = 480 * kMiB;  // NVML's total minus cuMemGetInfo's (81559 - 81079 MiB)

// ---- building scenarios -------------------------------------------------------------------------------------

scenario::Phase Kernels(std::uint64_t kernel_ns, std::uint64_t for_ns = 0) {
  scenario::Phase phase;
  phase.kind = scenario::Phase::Kind::kernels;
  phase.sizes_ns = {kernel_ns};
  phase.for_ns = for_ns;
  return phase;
}

scenario::Phase Idle(std::uint64_t for_ns) {
  scenario::Phase phase;
  phase.kind = scenario::Phase::Kind::idle;
  phase.for_ns = for_ns;
  return phase;
}

scenario::ProcessSpec Process(std::uint64_t stop_ns, std::vector<scenario::Phase> work) {
  scenario::ProcessSpec process;
  process.stop_ns = stop_ns;
  process.work = std::move(work);
  return process;
}

scenario::TenantSpec Tenant(const std::string& name, std::uint32_t cores, std::vector<std::uint32_t> devices = {0}) {
  scenario::TenantSpec tenant;
  tenant.name = name;
  tenant.cores_percent = cores;
  tenant.gpu_count = static_cast<std::uint32_t>(devices.size());
  tenant.devices = std::move(devices);
  return tenant;
}

scenario::Scenario Base(const std::string& name, std::uint64_t duration_ns) {
  scenario::Scenario s;
  s.name = name;
  s.gpu = "h100-80gb";
  s.device_count = 1;
  s.context_bytes = kH100ContextBytes;
  s.duration_ns = duration_ns;
  s.settle_ns = kSecondNs;
  s.window_ns = kSecondNs;
  s.sample_ns = 100 * kMillisecondNs;
  return s;
}

// One tenant process of 1 ms kernels, closed loop, from 0 to the end.
scenario::TenantSpec Busy(const std::string& name, std::uint32_t cores, std::uint64_t duration_ns,
                          std::vector<std::uint32_t> devices = {0}) {
  scenario::TenantSpec tenant = Tenant(name, cores, std::move(devices));
  tenant.processes.push_back(Process(duration_ns, {Kernels(kMillisecondNs)}));
  return tenant;
}

// ---- reading traces ------------------------------------------------------------------------------------------

// One trace line: a flat JSON object of strings, integers and arrays of integers (all the trace holds). Parse()
// is strict: anything else, or trailing bytes, is not a trace line.
struct TraceLine {
  std::map<std::string, std::string> text;
  std::map<std::string, std::int64_t> number;
  std::map<std::string, std::vector<std::int64_t>> numbers;

  std::string Text(const std::string& key) const { return text.count(key) != 0 ? text.at(key) : "<missing>"; }
  std::int64_t Number(const std::string& key) const { return number.count(key) != 0 ? number.at(key) : -999; }

  static bool Parse(std::string_view line, TraceLine& out);
};

// A strict reader of one trace line (TraceLine::Parse), one piece of JSON a method.
class TraceLineReader {
 public:
  explicit TraceLineReader(std::string_view line) : line_(line) {}

  // The whole line: one object, nothing after it.
  bool Object(TraceLine& out) {
    if (!Take('{')) return false;
    Skip();
    if (Take('}')) return at_ == line_.size();
    for (;;) {
      std::string key;
      Skip();
      if (!String(key)) return false;
      Skip();
      if (!Take(':')) return false;
      Skip();
      if (!Member(key, out)) return false;
      Skip();
      if (Take(',')) continue;
      return Take('}') && at_ == line_.size();
    }
  }

 private:
  bool At(char c) const { return at_ < line_.size() && line_[at_] == c; }
  bool Take(char c) {
    if (!At(c)) return false;
    ++at_;
    return true;
  }
  void Skip() {
    while (At(' ')) ++at_;
  }

  // A member's value: a string, an array of integers or an integer.
  bool Member(const std::string& key, TraceLine& out) {
    if (At('"')) {
      std::string value;
      if (!String(value)) return false;
      out.text[key] = value;
      return true;
    }
    if (At('[')) return Integers(out.numbers[key]);
    std::int64_t value = 0;
    if (!Integer(value)) return false;
    out.number[key] = value;
    return true;
  }

  // A string with JSON's escapes (a \u escape read as '?').
  bool String(std::string& value) {
    if (!Take('"')) return false;
    for (; at_ < line_.size(); ++at_) {
      const char c = line_[at_];
      if (c == '"') {
        ++at_;
        return true;
      }
      if (c == '\\') {
        if (++at_ >= line_.size()) return false;
        if (line_[at_] == 'u') {
          if (at_ + 4 >= line_.size()) return false;
          value += '?';
          at_ += 4;
          continue;
        }
        if (std::string_view("\"\\/bfnrt").find(line_[at_]) == std::string_view::npos) return false;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        return false;
      }
      value += line_[at_];
    }
    return false;
  }

  bool Integer(std::int64_t& value) {
    const std::size_t start = at_;
    Take('-');
    const std::size_t digits = at_;
    while (at_ < line_.size() && line_[at_] >= '0' && line_[at_] <= '9') ++at_;
    if (at_ == digits) return false;
    value = std::stoll(std::string(line_.substr(start, at_ - start)));
    return true;
  }

  // [i, j, ...] or [].
  bool Integers(std::vector<std::int64_t>& values) {
    values.clear();
    if (!Take('[')) return false;
    Skip();
    if (Take(']')) return true;
    for (;;) {
      std::int64_t value = 0;
      Skip();
      if (!Integer(value)) return false;
      values.push_back(value);
      Skip();
      if (Take(',')) continue;
      return Take(']');
    }
  }

  std::string_view line_;
  std::size_t at_ = 0;
};

bool TraceLine::Parse(std::string_view line, TraceLine& out) { return TraceLineReader(line).Object(out); }

struct Trace {
  std::vector<TraceLine> lines;

  std::vector<TraceLine> Of(const std::string& event) const {
    std::vector<TraceLine> found;
    for (const TraceLine& line : lines) {
      if (line.Text("ev") == event) found.push_back(line);
    }
    return found;
  }
  std::vector<TraceLine> Of(const std::string& event, const std::string& tenant) const {
    std::vector<TraceLine> found;
    for (const TraceLine& line : Of(event)) {
      if (line.Text("tenant") == tenant) found.push_back(line);
    }
    return found;
  }
  // t_ns -> busy_ns of a tenant on a physical device.
  std::map<std::int64_t, std::int64_t> Busy(const std::string& tenant, std::int64_t device) const {
    std::map<std::int64_t, std::int64_t> busy;
    for (const TraceLine& line : Of("sample", tenant)) {
      if (line.Number("device") == device) busy[line.Number("t_ns")] = line.Number("busy_ns");
    }
    return busy;
  }
  std::map<std::int64_t, std::int64_t> Memory(const std::string& tenant, std::int64_t device) const {
    std::map<std::int64_t, std::int64_t> memory;
    for (const TraceLine& line : Of("sample", tenant)) {
      if (line.Number("device") == device) memory[line.Number("t_ns")] = line.Number("memory_bytes");
    }
    return memory;
  }
  // The tenant's share (percent) in each whole window [w x window, (w + 1) x window) with both ends sampled.
  std::vector<double> Shares(const std::string& tenant, std::int64_t device, std::uint64_t window_ns) const {
    const auto busy = Busy(tenant, device);
    std::vector<double> shares;
    for (std::uint64_t start = 0;; start += window_ns) {
      const auto from = busy.find(static_cast<std::int64_t>(start));
      const auto to = busy.find(static_cast<std::int64_t>(start + window_ns));
      if (from == busy.end() || to == busy.end()) break;
      shares.push_back(100.0 * static_cast<double>(to->second - from->second) / static_cast<double>(window_ns));
    }
    return shares;
  }
};

// Parses every line; a line that is not a trace line fails the test, naming it.
Trace Parse(const std::string& text) {
  Trace trace;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    TraceLine parsed;
    EXPECT_TRUE(TraceLine::Parse(line, parsed)) << "line " << number << " is not a JSON trace line: " << line;
    EXPECT_EQ(parsed.Text("ev") != "<missing>", true) << "line " << number << " has no ev: " << line;
    trace.lines.push_back(parsed);
  }
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "the trace does not end with a newline";
  return trace;
}

std::string Head(const std::string& text, int lines) {
  std::string head;
  std::istringstream in(text);
  std::string line;
  for (int i = 0; i < lines && std::getline(in, line); ++i) head += line + "\n";
  return head;
}

Outcome MustRun(const scenario::Scenario& s, Options options = {}) {
  const Outcome outcome = runner::Run(s, options);
  EXPECT_TRUE(outcome.ok) << outcome.error;
  EXPECT_EQ(outcome.error, "");
  return outcome;
}

// Every judged window (from settle on) within `tolerance` points of `target`; prints them all.
void ExpectShares(const Trace& trace, const std::string& tenant, std::int64_t device, double target, double tolerance,
                  std::uint64_t settle_ns = kSecondNs, std::uint64_t window_ns = kSecondNs) {
  const std::vector<double> shares = trace.Shares(tenant, device, window_ns);
  std::string text;
  for (const double share : shares) {
    text += ' ';
    text += std::to_string(share);
  }
  std::printf("tenant %s device %lld windows (%%):%s\n", tenant.c_str(), static_cast<long long>(device), text.c_str());
  ASSERT_GT(shares.size(), settle_ns / window_ns) << "no judged window for " << tenant;
  for (std::size_t w = settle_ns / window_ns; w < shares.size(); ++w) {
    EXPECT_NEAR(shares[w], target, tolerance) << "tenant " << tenant << " device " << device << " window " << w;
  }
}

// The tenant's mean share of `device` (%) over the 1 s windows after the first (the first settles); -1 without them.
double MeanShareAfterTheFirstSecond(const Trace& trace, const std::string& tenant, std::int64_t device = 0) {
  const std::vector<double> shares = trace.Shares(tenant, device, kSecondNs);
  if (shares.size() < 2) return -1;
  double sum = 0;
  for (std::size_t w = 1; w < shares.size(); ++w) sum += shares[w];
  return sum / static_cast<double>(shares.size() - 1);
}

// ---- virtual mode ------------------------------------------------------------------------------------------

// The device as calibrated on an H100 (2.1 ms slices, 160 us handovers: the scenario defaults). Caps that leave the
// handovers room hold; 30/70, which books the whole GPU, does not (below).
TEST(RunnerVirtual, ThirtySixtySharesHoldInEveryWindowAfterSettling) {
  scenario::Scenario s = Base("thirty-sixty", 6 * kSecondNs);
  ASSERT_EQ(s.switch_ns, 160 * kUs);
  s.tenants = {Busy("thirty", 30, s.duration_ns), Busy("sixty", 60, s.duration_ns)};
  const Outcome outcome = MustRun(s);
  const Trace trace = Parse(outcome.trace);
  ExpectShares(trace, "thirty", 0, 30, 2);
  ExpectShares(trace, "sixty", 0, 60, 2);
  // The header, one sample per tenant and a gpu line per sample instant, and the end.
  ASSERT_FALSE(trace.lines.empty());
  EXPECT_EQ(trace.lines.front().Text("ev"), "run");
  EXPECT_EQ(trace.lines.front().Text("mode"), "virtual");
  EXPECT_EQ(trace.lines.front().Number("version"), 1);
  EXPECT_EQ(trace.lines.back().Text("ev"), "end");
  EXPECT_EQ(trace.lines.back().Number("leaked_bytes"), 0);
  EXPECT_EQ(trace.Of("sample", "thirty").size(), 61u);
  EXPECT_EQ(trace.Of("gpu").size(), 61u);
  // NVML's utilization: the two together keep the device 90 % busy.
  for (const TraceLine& gpu : trace.Of("gpu")) {
    if (gpu.Number("t_ns") >= static_cast<std::int64_t>(kSecondNs)) {
      EXPECT_GE(gpu.Number("util_percent"), 85);
    }
    EXPECT_LE(gpu.Number("util_percent"), 100);
  }
  std::printf("trace head:\n%s", Head(outcome.trace, 15).c_str());
}

// On an ideal device (free handovers, 2 ms slices) the limiter holds caps that book the whole GPU.
TEST(RunnerVirtual, ThirtySeventyHoldsOnAnIdealDevice) {
  scenario::Scenario s = Base("thirty-seventy-ideal", 6 * kSecondNs);
  s.timeslice_ns = 2 * kMs;
  s.switch_ns = 0;
  s.tenants = {Busy("thirty", 30, s.duration_ns), Busy("seventy", 70, s.duration_ns)};
  const Trace trace = Parse(MustRun(s).trace);
  ExpectShares(trace, "thirty", 0, 30, 2);
  ExpectShares(trace, "seventy", 0, 70, 2);
}

// Not held (docs/compute-limit.md, "What is not held"): on the calibrated device 30/70 leaves no room for the
// handovers (~5 % of the GPU when a 30 % container's work is spread over the second), and each container's event
// pairs count the other's slices: 30.0 / 53.9 here, 29.9 / 50.6 on the H100. Enable when the limiter holds it.
TEST(RunnerVirtual, KnownGapThirtySeventyHoldsOnTheCalibratedDevice) {
  scenario::Scenario s = Base("thirty-seventy", 6 * kSecondNs);
  s.tenants = {Busy("thirty", 30, s.duration_ns), Busy("seventy", 70, s.duration_ns)};
  const Trace trace = Parse(MustRun(s).trace);
  ExpectShares(trace, "thirty", 0, 30, 2);
  ExpectShares(trace, "seventy", 0, 65, 2);  // the most a time-sliced H100 can give beside 30 %
}

TEST(RunnerVirtual, TheTraceIsInTimeOrderAndTenantLinesDescribeTheContainers) {
  scenario::Scenario s = Base("order", 2 * kSecondNs);
  s.tenants = {Busy("a", 30, s.duration_ns)};
  s.tenants[0].memory_limit_bytes = 4 * kGiB;
  s.tenants[0].priority = 0;
  s.tenants[0].policy = scenario::Policy::disable;
  s.tenants[0].processes[0].replicas = 2;
  const Trace trace = Parse(MustRun(s).trace);
  const std::vector<TraceLine> tenants = trace.Of("tenant");
  ASSERT_EQ(tenants.size(), 1u);
  EXPECT_EQ(tenants[0].Text("tenant"), "a");
  EXPECT_EQ(tenants[0].Number("index"), 0);
  EXPECT_EQ(tenants[0].numbers.at("devices"), std::vector<std::int64_t>{0});
  EXPECT_EQ(tenants[0].Number("cores_percent"), 30);
  EXPECT_EQ(tenants[0].Number("memory_limit_bytes"), static_cast<std::int64_t>(4 * kGiB));
  EXPECT_EQ(tenants[0].Text("policy"), "disable");
  EXPECT_EQ(tenants[0].Number("priority"), 0);
  EXPECT_EQ(tenants[0].Number("processes"), 2);
  const std::vector<TraceLine> processes = trace.Of("process");
  ASSERT_EQ(processes.size(), 2u);
  EXPECT_EQ(processes[0].Number("process"), 0);
  EXPECT_EQ(processes[1].Number("process"), 1);
  EXPECT_EQ(processes[0].Number("pid"), 0);
  std::int64_t last = -1;
  for (const TraceLine& line : trace.lines) {
    if (line.number.count("t_ns") == 0) continue;
    EXPECT_GE(line.Number("t_ns"), last) << "out of time order at " << line.Text("ev");
    last = line.Number("t_ns");
  }
  const std::vector<TraceLine> exits = trace.Of("exit");
  ASSERT_EQ(exits.size(), 2u);
  EXPECT_EQ(exits[0].Text("status"), "ok");
  EXPECT_EQ(exits[0].Number("code"), 0);
  EXPECT_EQ(exits[0].Number("t_ns"), static_cast<std::int64_t>(s.duration_ns));
}

TEST(RunnerVirtual, MemoryIsTheShimsLedgerContextPlusAllocation) {
  scenario::Scenario s = Base("memory", 2 * kSecondNs);
  s.tenants = {Busy("a", 0, s.duration_ns)};
  s.tenants[0].memory_limit_bytes = 4 * kGiB;
  s.tenants[0].processes[0].alloc_bytes = kGiB;
  s.tenants[0].processes[0].start_ns = 500 * kMillisecondNs;
  const Trace trace = Parse(MustRun(s).trace);
  const auto memory = trace.Memory("a", 0);
  EXPECT_EQ(memory.at(0), 0);
  EXPECT_EQ(memory.at(400 * kMillisecondNs), 0);
  EXPECT_EQ(memory.at(500 * kMillisecondNs), static_cast<std::int64_t>(kH100ContextBytes + kGiB));
  EXPECT_EQ(memory.at(1900 * kMillisecondNs), static_cast<std::int64_t>(kH100ContextBytes + kGiB));
  EXPECT_EQ(memory.at(2000 * kMillisecondNs), 0) << "released when the process stops";
  for (const TraceLine& gpu : trace.Of("gpu")) {
    if (gpu.Number("t_ns") == static_cast<std::int64_t>(kSecondNs)) {
      EXPECT_EQ(gpu.Number("memory_used_bytes"),
                static_cast<std::int64_t>(kH100ReservedBytes + kH100ContextBytes + kGiB));
    }
  }
  EXPECT_EQ(trace.Of("end").at(0).Number("leaked_bytes"), 0);
}

TEST(RunnerVirtual, AnAllocationOverTheLimitIsAnOomAndRunsNothing) {
  scenario::Scenario s = Base("oom", 3 * kSecondNs);
  s.tenants = {Busy("greedy", 50, s.duration_ns), Busy("context-only", 50, s.duration_ns),
               Busy("fine", 50, s.duration_ns)};
  s.tenants[0].memory_limit_bytes = kGiB;
  s.tenants[0].processes[0].alloc_bytes = 2 * kGiB;
  s.tenants[1].memory_limit_bytes = 256 * kMiB;  // not even the context fits
  s.tenants[2].memory_limit_bytes = kGiB;
  s.tenants[2].processes[0].alloc_bytes = 256 * kMiB;
  const Trace trace = Parse(MustRun(s).trace);
  const std::vector<TraceLine> ooms = trace.Of("oom", "greedy");
  ASSERT_EQ(ooms.size(), 1u);
  EXPECT_EQ(ooms[0].Number("t_ns"), 0);
  EXPECT_EQ(ooms[0].Number("process"), 0);
  EXPECT_EQ(ooms[0].Number("bytes"), static_cast<std::int64_t>(2 * kGiB));
  ASSERT_EQ(trace.Of("oom", "context-only").size(), 1u);
  EXPECT_EQ(trace.Of("oom", "context-only")[0].Number("bytes"), static_cast<std::int64_t>(kH100ContextBytes));
  EXPECT_TRUE(trace.Of("oom", "fine").empty());
  const std::vector<TraceLine> exits = trace.Of("exit", "greedy");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "oom");
  EXPECT_EQ(exits[0].Number("code"), 3);
  EXPECT_EQ(exits[0].Number("t_ns"), 0);
  for (const auto& [t, busy] : trace.Busy("greedy", 0)) EXPECT_EQ(busy, 0) << "at " << t;
  for (const auto& [t, bytes] : trace.Memory("greedy", 0)) EXPECT_EQ(bytes, 0) << "at " << t;
  // The one that fits runs alone at its cap.
  ExpectShares(trace, "fine", 0, 50, 2);
}

TEST(RunnerVirtual, ALaterProcessOfTheSameTenantOomsWhileTheFirstHoldsItsMemory) {
  scenario::Scenario s = Base("second-oom", 2 * kSecondNs);
  s.tenants = {Tenant("a", 0)};
  s.tenants[0].memory_limit_bytes = 2 * kGiB;
  scenario::ProcessSpec first = Process(kSecondNs, {Kernels(kMillisecondNs)});
  first.alloc_bytes = kGiB;
  scenario::ProcessSpec second = Process(2 * kSecondNs, {Kernels(kMillisecondNs)});
  second.start_ns = 500 * kMillisecondNs;
  second.alloc_bytes = kGiB;
  scenario::ProcessSpec third = second;
  third.start_ns = kSecondNs;  // the first has just given its memory back
  s.tenants[0].processes = {first, second, third};
  const Trace trace = Parse(MustRun(s).trace);
  const std::vector<TraceLine> ooms = trace.Of("oom", "a");
  ASSERT_EQ(ooms.size(), 1u);
  EXPECT_EQ(ooms[0].Number("process"), 1);
  EXPECT_EQ(ooms[0].Number("t_ns"), static_cast<std::int64_t>(500 * kMillisecondNs));
}

TEST(RunnerVirtual, ACrashStopsBusyGrowthAndFreesTheMemory) {
  scenario::Scenario s = Base("crash", 6 * kSecondNs);
  s.tenants = {Busy("victim", 40, s.duration_ns)};
  s.tenants[0].processes[0].crash_at_ns = 3 * kSecondNs;
  s.tenants[0].processes[0].alloc_bytes = kGiB;
  const Trace trace = Parse(MustRun(s).trace);
  const auto busy = trace.Busy("victim", 0);
  const std::int64_t at_crash = busy.at(3 * kSecondNs);
  EXPECT_NEAR(static_cast<double>(at_crash), 0.4 * 3e9, 0.03 * 3e9);
  for (const auto& [t, value] : busy) {
    if (t >= static_cast<std::int64_t>(3 * kSecondNs)) {
      EXPECT_EQ(value, at_crash) << "busy grew after the crash, at " << t;
    }
  }
  const std::vector<TraceLine> exits = trace.Of("exit", "victim");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "killed");
  EXPECT_EQ(exits[0].Number("code"), 9);
  EXPECT_EQ(exits[0].Number("t_ns"), static_cast<std::int64_t>(3 * kSecondNs));
  const auto memory = trace.Memory("victim", 0);
  EXPECT_EQ(memory.at(2900 * kMillisecondNs), static_cast<std::int64_t>(kH100ContextBytes + kGiB));
  EXPECT_EQ(memory.at(3 * kSecondNs), 0);
  EXPECT_EQ(trace.Of("end").at(0).Number("leaked_bytes"), 0);
}

TEST(RunnerVirtual, TwoDevicesWithRemappedOrdinalsHaveBudgetsOfTheirOwn) {
  scenario::Scenario s = Base("two-devices", 4 * kSecondNs);
  s.gpu = "2xh100-80gb";
  s.device_count = 2;
  // "swapped" sees [1, 0]: its CUDA device 0 is physical 1, its CUDA device 1 physical 0. At 30 % it may use
  // 30 % of each device: were its budget one for both, it would get 15 % on each.
  scenario::TenantSpec swapped = Tenant("swapped", 30, {1, 0});
  swapped.processes = {Process(s.duration_ns, {Kernels(kMillisecondNs)}),
                       Process(s.duration_ns, {Kernels(kMillisecondNs)})};
  swapped.processes[1].device = 1;
  scenario::TenantSpec zero = Busy("on-zero", 50, s.duration_ns, {0});
  s.tenants = {swapped, zero};
  const Trace trace = Parse(MustRun(s).trace);
  ExpectShares(trace, "swapped", 0, 30, 2);
  ExpectShares(trace, "swapped", 1, 30, 2);
  ExpectShares(trace, "on-zero", 0, 50, 2);
  const std::vector<TraceLine> processes = trace.Of("process", "swapped");
  ASSERT_EQ(processes.size(), 2u);
  EXPECT_EQ(processes[0].Number("device"), 1) << "CUDA ordinal 0 of [1, 0] is physical device 1";
  EXPECT_EQ(processes[1].Number("device"), 0);
  EXPECT_TRUE(trace.Busy("on-zero", 1).empty()) << "a tenant has samples for its own devices only";
  EXPECT_EQ(trace.Of("gpu").size(), 2u * 41u);
}

TEST(RunnerVirtual, RepeatedPhasesAlternateBusyAndIdle) {
  scenario::Scenario s = Base("repeat", 4 * kSecondNs);
  scenario::TenantSpec tenant = Tenant("bursty", 0);
  tenant.processes = {
      Process(s.duration_ns, {Kernels(kMillisecondNs, 200 * kMillisecondNs), Idle(300 * kMillisecondNs)})};
  tenant.processes[0].repeat = true;
  s.tenants = {tenant};
  const Trace trace = Parse(MustRun(s).trace);
  ExpectShares(trace, "bursty", 0, 40, 1, 0);
  // Every 500 ms: 200 ms busy (and what is in flight at the phase's end), then nothing.
  const auto busy = trace.Busy("bursty", 0);
  EXPECT_NEAR(static_cast<double>(busy.at(300 * kMillisecondNs) - busy.at(200 * kMillisecondNs)), 0, 5e6);
  EXPECT_NEAR(static_cast<double>(busy.at(700 * kMillisecondNs) - busy.at(500 * kMillisecondNs)), 200e6, 5e6);
}

TEST(RunnerVirtual, TheSameSeedGivesTheSameTraceByteForByte) {
  scenario::Scenario s = Base("seeded", 3 * kSecondNs);
  scenario::TenantSpec mixed = Tenant("mixed", 30);
  scenario::Phase phase = Kernels(5000);
  phase.sizes_ns = {5000, 50'000, 500'000, 5'000'000};
  phase.jitter_permille = 100;
  mixed.processes = {Process(s.duration_ns, {phase})};
  s.tenants = {mixed, Busy("steady", 60, s.duration_ns)};
  s.seed = 42;
  const std::string first = MustRun(s).trace;
  const std::string second = MustRun(s).trace;
  EXPECT_EQ(first, second);
  s.seed = 43;
  const std::string other = MustRun(s).trace;
  EXPECT_NE(first, other) << "another seed draws other kernels";
  Parse(first);
}

TEST(RunnerVirtual, TheTraceGoesToAFileLineByLine) {
  scenario::Scenario s = Base("to-a-file", 2 * kSecondNs);
  s.tenants = {Busy("a", 30, s.duration_ns)};
  const std::string in_memory = MustRun(s).trace;
  char folder[] = "/tmp/vgpu-runner-test.XXXXXX";
  ASSERT_NE(mkdtemp(folder), nullptr);
  Options options;
  options.trace_path = std::string(folder) + "/trace.jsonl";
  std::vector<double> fractions;
  options.progress = [&](double fraction, const std::string&) { fractions.push_back(fraction); };
  const Outcome outcome = MustRun(s, options);
  EXPECT_EQ(outcome.trace, "") << "kept in the file only";
  std::ifstream in(options.trace_path);
  const std::string from_file((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(from_file, in_memory);
  std::filesystem::remove_all(folder);
  // At least once per second of scenario time, rising, ending at 1.
  ASSERT_GE(fractions.size(), 2u);
  for (std::size_t i = 1; i < fractions.size(); ++i) EXPECT_GE(fractions[i], fractions[i - 1]);
  EXPECT_EQ(fractions.back(), 1.0);
}

TEST(RunnerVirtual, ACancelledRunSaysSo) {
  scenario::Scenario s = Base("cancelled", 2 * kSecondNs);
  s.tenants = {Busy("a", 30, s.duration_ns)};
  std::atomic<bool> cancel{true};
  Options options;
  options.cancel = &cancel;
  const Outcome outcome = runner::Run(s, options);
  EXPECT_FALSE(outcome.ok);
  EXPECT_NE(outcome.error.find("cancelled"), std::string::npos) << outcome.error;
}

struct Refusal {
  const char* what;
  void (*change)(scenario::Scenario&);
  const char* expected;  // in the message
};

// Names the case in test listings (ctest shows GetParam()), instead of the struct's bytes.
void PrintTo(const Refusal& refusal, std::ostream* out) { *out << refusal.what; }

class RunnerRefusal : public ::testing::TestWithParam<Refusal> {};

TEST_P(RunnerRefusal, ComesBackAsAnOutcomeErrorNamingTheField) {
  scenario::Scenario s = Base("refused", 2 * kSecondNs);
  s.tenants = {Busy("a", 30, s.duration_ns)};
  GetParam().change(s);
  const Outcome outcome = runner::Run(s, Options{});
  EXPECT_FALSE(outcome.ok);
  EXPECT_NE(outcome.error.find(GetParam().expected), std::string::npos) << outcome.error;
  EXPECT_EQ(outcome.error.find('\n'), std::string::npos) << "not one line: " << outcome.error;
  EXPECT_EQ(outcome.trace, "") << "nothing ran";
}

INSTANTIATE_TEST_SUITE_P(
    RunnerVirtual, RunnerRefusal,
    ::testing::Values(
        Refusal{"real_gpu", [](scenario::Scenario& s) { s.gpu = "real", s.real_gpu = true; }, "live only"},
        Refusal{"faults", [](scenario::Scenario& s) { s.faults = {"cuLaunchKernel:error=CUDA_ERROR_LAUNCH_FAILED"}; },
                "not modelled in virtual mode"},
        Refusal{"mode", [](scenario::Scenario& s) { s.virtual_mode = false; }, "not meant for virtual mode"},
        Refusal{"stop", [](scenario::Scenario& s) { s.tenants[0].processes[0].stop_ns = 3 * kSecondNs; },
                "tenants[0].processes[0].stop_ns = 3000000000"},
        Refusal{"crash", [](scenario::Scenario& s) { s.tenants[0].processes[0].crash_at_ns = 2 * kSecondNs; },
                "crash_at_ns = 2000000000"},
        Refusal{"device", [](scenario::Scenario& s) { s.tenants[0].devices = {1}; }, "tenants[0].devices[0] = 1"},
        Refusal{"ordinal", [](scenario::Scenario& s) { s.tenants[0].processes[0].device = 1; },
                "tenants[0].processes[0].device = 1"},
        Refusal{"sample", [](scenario::Scenario& s) { s.sample_ns = 300 * kMillisecondNs; }, "sample_ns = 300000000"},
        Refusal{"gpu", [](scenario::Scenario& s) { s.gpu = "h200-141gb"; }, "h200-141gb"},
        Refusal{"depth", [](scenario::Scenario& s) { s.tenants[0].processes[0].work[0].depth = 0; },
                "work[0].depth = 0"},
        Refusal{"names", [](scenario::Scenario& s) { s.tenants.push_back(s.tenants[0]); }, "is used twice"},
        // The scenario file's limits (vgpu/scenario/limits.h): the runner took 100 h where a file took 1 h.
        Refusal{"duration", [](scenario::Scenario& s) { s.duration_ns = 2 * 3600 * kSecondNs; },
                "duration_ns = 7200000000000; accepted: 100 ms .. 1 h"},
        Refusal{"dot_name", [](scenario::Scenario& s) { s.tenants[0].name = ".."; }, "tenants[0].name = '..'"},
        Refusal{"no_tenant", [](scenario::Scenario& s) { s.tenants.clear(); }, "tenants.size() = 0"},
        Refusal{"mixed_rate",
                [](scenario::Scenario& s) {
                  s.tenants[0].processes[0].work[0].sizes_ns = {5000, 50000};
                  s.tenants[0].processes[0].work[0].rate = 100;
                },
                "mixed sizes in a closed loop only"},
        Refusal{"collective",
                [](scenario::Scenario& s) {
                  s.tenants[0].processes[0].work[0].collective_ns = kMs;
                  s.tenants[0].processes[0].work[0].ranks = 2;
                },
                "work[0].collective: the simulator runs each device alone"}),
    [](const ::testing::TestParamInfo<Refusal>& param) { return std::string(param.param.what); });

// Every scenario shipped in scenarios/ that is meant for virtual mode runs, and its trace reads back. Each tenant's
// share expectations are printed next to what the trace gives (judging them is the Python side's job).
TEST(RunnerVirtual, EveryShippedScenarioRuns) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(VGPU_TEST_SCENARIO_DIR)) {
    if (entry.path().extension() == ".yaml") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  ASSERT_FALSE(files.empty()) << "no scenario in " << VGPU_TEST_SCENARIO_DIR;
  for (const std::filesystem::path& file : files) {
    const scenario::Loaded loaded = scenario::LoadFile(file.string());
    ASSERT_TRUE(loaded.scenario.has_value())
        << file << ": " << (loaded.problems.empty() ? "" : loaded.problems[0].ToString());
    const scenario::Scenario& s = *loaded.scenario;
    if (!s.virtual_mode) continue;
    const Outcome outcome = MustRun(s);
    const Trace trace = Parse(outcome.trace);
    for (const scenario::TenantSpec& tenant : s.tenants) {
      for (const scenario::Expectation& expect : tenant.expect) {
        if (expect.kind == scenario::Expectation::Kind::oom) {
          std::printf("%s: %s oom expected %d, got %zu\n", s.name.c_str(), tenant.name.c_str(), expect.oom ? 1 : 0,
                      trace.Of("oom", tenant.name).size());
          continue;
        }
        for (const std::uint32_t device : tenant.devices) {
          const std::vector<double> shares = trace.Shares(tenant.name, device, s.window_ns);
          double sum = 0;
          int count = 0;
          for (std::size_t w = 0; w < shares.size(); ++w) {
            if (w * s.window_ns >= expect.from_ns && (w + 1) * s.window_ns <= expect.to_ns) {
              sum += shares[w];
              ++count;
            }
          }
          std::printf("%s: %s expects %s %.1f, on device %u the mean over %d window(s) is %.2f\n", s.name.c_str(),
                      tenant.name.c_str(),
                      expect.kind == scenario::Expectation::Kind::share       ? "share"
                      : expect.kind == scenario::Expectation::Kind::min_share ? "min_share"
                                                                              : "max_share",
                      expect.percent, device, count, count > 0 ? sum / count : 0.0);
        }
      }
    }
  }
}

// ---- live mode over fakecuda ---------------------------------------------------------------------------------

const std::string kInstall = VGPU_TEST_INSTALL_DIR;

bool LivePiecesBuilt(std::string& missing) {
  for (const char* piece :
       {"/bin/vgpu-tenant", "/bin/vgpu-sampler", "/lib/libvgpu.so", "/lib/libcuda.so.1", "/lib/libnvidia-ml.so.1"}) {
    if (access((kInstall + piece).c_str(), F_OK) != 0) {
      missing = kInstall + piece;
      return false;
    }
  }
  return true;
}

#define SKIP_WITHOUT_LIVE_PIECES()                                             \
  do {                                                                         \
    std::string missing;                                                       \
    if (!LivePiecesBuilt(missing)) GTEST_SKIP() << missing << " is not built"; \
  } while (0)

Outcome MustRunLive(const scenario::Scenario& s) {
  Options options;
  options.mode = Mode::live;
  options.install_dir = kInstall;
  const Outcome outcome = runner::Run(s, options);
  EXPECT_TRUE(outcome.ok) << outcome.error;
  std::printf("wall %.2f s; trace head:\n%s", outcome.wall_seconds, Head(outcome.trace, 12).c_str());
  return outcome;
}

TEST(RunnerLive, ALoneTenantAtThirtyPercentGetsThirty) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = Base("live-thirty", 3 * kSecondNs);
  s.tenants = {Busy("a", 30, s.duration_ns)};
  const Outcome outcome = MustRunLive(s);
  const Trace trace = Parse(outcome.trace);
  ExpectShares(trace, "a", 0, 30, 3);
  EXPECT_EQ(trace.lines.front().Text("mode"), "live");
  const std::vector<TraceLine> processes = trace.Of("process", "a");
  ASSERT_EQ(processes.size(), 1u);
  EXPECT_GT(processes[0].Number("pid"), 0);
  const std::vector<TraceLine> exits = trace.Of("exit", "a");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "ok") << exits[0].Text("message");
  // NVML's view over the judged windows: the device is busy about as long as the tenant (200 ms windows).
  double util = 0;
  int count = 0;
  for (const TraceLine& gpu : trace.Of("gpu")) {
    if (gpu.Number("t_ns") >= static_cast<std::int64_t>(1500 * kMillisecondNs) &&
        gpu.Number("t_ns") <= static_cast<std::int64_t>(2900 * kMillisecondNs)) {
      util += static_cast<double>(gpu.Number("util_percent"));
      ++count;
    }
  }
  ASSERT_GT(count, 0);
  EXPECT_NEAR(util / count, 30, 8);
  EXPECT_EQ(trace.Of("end").at(0).Number("leaked_bytes"), 0);
}

TEST(RunnerLive, AnAllocationOverTheLimitIsAnOom) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = Base("live-oom", kSecondNs);
  s.settle_ns = 0;
  s.tenants = {Busy("greedy", 0, s.duration_ns)};
  s.tenants[0].memory_limit_bytes = kGiB;
  s.tenants[0].processes[0].alloc_bytes = 2 * kGiB;
  const Trace trace = Parse(MustRunLive(s).trace);
  const std::vector<TraceLine> ooms = trace.Of("oom", "greedy");
  ASSERT_EQ(ooms.size(), 1u);
  EXPECT_EQ(ooms[0].Number("bytes"), static_cast<std::int64_t>(2 * kGiB));
  const std::vector<TraceLine> exits = trace.Of("exit", "greedy");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "oom") << exits[0].Text("message");
  EXPECT_EQ(exits[0].Number("code"), 3);
  for (const auto& [t, busy] : trace.Busy("greedy", 0)) EXPECT_EQ(busy, 0) << "at " << t;
  EXPECT_EQ(trace.Of("end").at(0).Number("leaked_bytes"), 0);
}

TEST(RunnerLive, ACrashIsASigkillAtItsTimeAndItsMemoryComesBack) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = Base("live-crash", 3 * kSecondNs);
  s.tenants = {Busy("victim", 50, s.duration_ns)};
  s.tenants[0].memory_limit_bytes = 2 * kGiB;
  s.tenants[0].processes[0].alloc_bytes = 256 * kMiB;
  s.tenants[0].processes[0].crash_at_ns = 1500 * kMillisecondNs;
  const Trace trace = Parse(MustRunLive(s).trace);
  const std::vector<TraceLine> exits = trace.Of("exit", "victim");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "killed");
  EXPECT_EQ(exits[0].Number("code"), 9);
  EXPECT_GE(exits[0].Number("t_ns"), static_cast<std::int64_t>(1500 * kMillisecondNs));
  EXPECT_LE(exits[0].Number("t_ns"), static_cast<std::int64_t>(1700 * kMillisecondNs));
  const auto busy = trace.Busy("victim", 0);
  EXPECT_GT(busy.at(kSecondNs), 0);
  EXPECT_EQ(busy.at(2 * kSecondNs), busy.at(3 * kSecondNs)) << "busy grew after the SIGKILL";
  const auto memory = trace.Memory("victim", 0);
  EXPECT_GE(memory.at(kSecondNs), static_cast<std::int64_t>(256 * kMiB)) << "the allocation, and the context";
  EXPECT_EQ(memory.at(2 * kSecondNs), 0) << "a killed process holds nothing, reaped or not";
  EXPECT_EQ(trace.Of("end").at(0).Number("leaked_bytes"), 0);
}

// ---- programs (`program:`, docs/scenarios.md "Programs") ----------------------------------------------------------

// A tenant whose one process is a program: these words, from 0 to `stop_ns`.
scenario::TenantSpec ProgramTenant(const std::string& name, std::uint32_t cores, std::uint64_t stop_ns,
                                   std::vector<std::string> program) {
  scenario::TenantSpec tenant = Tenant(name, cores);
  scenario::ProcessSpec process;
  process.stop_ns = stop_ns;
  process.program = std::move(program);
  tenant.processes.push_back(std::move(process));
  return tenant;
}

scenario::Scenario LiveOnly(scenario::Scenario s) {
  s.virtual_mode = false;
  return s;
}

// vgpu-tenant run as a program knows nothing of the runner: its busy time is read from the fake GPU. Asked for 10 s,
// it is still running at its stop, gets SIGTERM there, and that end is `ok`.
TEST(RunnerLive, AProgramsShareIsMeasuredOnTheFakeGpuAndItIsStoppedAtItsStop) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = LiveOnly(Base("live-program", 3 * kSecondNs));
  s.tenants = {ProgramTenant("program", 40, s.duration_ns,
                             {kInstall + "/bin/vgpu-tenant", "--seconds", "10", "--phase", "kernels=1ms"}),
               Busy("tenant", 30, s.duration_ns)};
  const Trace trace = Parse(MustRunLive(s).trace);
  ExpectShares(trace, "program", 0, 40, 4);
  ExpectShares(trace, "tenant", 0, 30, 4);
  const std::vector<TraceLine> exits = trace.Of("exit", "program");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "ok") << exits[0].Text("message");
  EXPECT_EQ(exits[0].Number("code"), 128 + SIGTERM);
  EXPECT_GE(exits[0].Number("t_ns"), static_cast<std::int64_t>(s.duration_ns));
  EXPECT_GT(trace.Memory("program", 0).at(2 * kSecondNs), 0) << "its context, from the tenant's region";
  EXPECT_EQ(trace.Of("end").at(0).Number("leaked_bytes"), 0);
}

// A program that starts the GPU process as a child of its own (a shell, a launcher): the child is in the program's
// process group and its GPU time counts for the program. It ends by itself before its stop: `ok`, code 0, and its
// busy time stops growing there.
TEST(RunnerLive, AProgramsChildProcessesCountForItAndItsOwnEndIsOk) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = LiveOnly(Base("live-program-child", 4 * kSecondNs));
  s.tenants = {ProgramTenant(
      "launcher", 50, s.duration_ns,
      {"/bin/sh", "-c", "\"$0\" --seconds 2 --phase kernels=1ms; exit 0", kInstall + "/bin/vgpu-tenant"})};
  const Trace trace = Parse(MustRunLive(s).trace);
  const std::vector<double> shares = trace.Shares("launcher", 0, kSecondNs);
  ASSERT_EQ(shares.size(), 4u);
  EXPECT_NEAR(shares[1], 50, 4) << "the child's GPU time is the program's";
  EXPECT_LT(shares[3], 10) << "nothing runs after the program's own end, 2 s after its start (later under TSan)";
  const std::vector<TraceLine> exits = trace.Of("exit", "launcher");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "ok") << exits[0].Text("message");
  EXPECT_EQ(exits[0].Number("code"), 0);
  EXPECT_LT(exits[0].Number("t_ns"), static_cast<std::int64_t>(3800 * kMillisecondNs)) << "it was not stopped";
}

// A program that fails is an error with its exit code and its last words on stderr; the run goes on.
TEST(RunnerLive, AProgramThatFailsIsAnErrorNamingItsCodeAndItsLastWords) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = LiveOnly(Base("live-program-fails", 2 * kSecondNs));
  s.tenants = {ProgramTenant("broken", 0, s.duration_ns, {"/bin/sh", "-c", "echo 'no model file' >&2; exit 4"})};
  const Trace trace = Parse(MustRunLive(s).trace);
  const std::vector<TraceLine> exits = trace.Of("exit", "broken");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "error");
  EXPECT_EQ(exits[0].Number("code"), 4);
  EXPECT_NE(exits[0].Text("message").find("no model file"), std::string::npos) << exits[0].Text("message");
}

// What a program leaves running in its process group when it ends is killed with it, as a container's processes
// end with its main one: nothing of the run outlives it.
TEST(RunnerLive, WhatAProgramLeavesBehindEndsWithIt) {
  SKIP_WITHOUT_LIVE_PIECES();
  const std::string pid_file = ::testing::TempDir() + "/vgpu-leftover.pid";
  std::remove(pid_file.c_str());
  scenario::Scenario s = LiveOnly(Base("live-program-leftover", 2 * kSecondNs));
  s.tenants = {ProgramTenant("parent", 0, s.duration_ns, {"/bin/sh", "-c", "sleep 60 & echo $! > \"$0\"", pid_file})};
  const Trace trace = Parse(MustRunLive(s).trace);
  ASSERT_EQ(trace.Of("exit", "parent").at(0).Text("status"), "ok");
  std::ifstream file(pid_file);
  pid_t leftover = 0;
  ASSERT_TRUE(file >> leftover) << pid_file;
  // Gone, or a zombie waiting for init to reap it.
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {
    std::ifstream stat("/proc/" + std::to_string(leftover) + "/stat");
    std::string text;
    gone = !std::getline(stat, text) || text.find(") Z ") != std::string::npos;
    if (!gone) usleep(20'000);
  }
  EXPECT_TRUE(gone) << "sleep (pid " << leftover << ") outlived its program";
  if (!gone) kill(leftover, SIGKILL);
}

// A program that is not there refuses the run before anything starts, naming it and where it was looked for.
TEST(RunnerLive, AMissingProgramRefusesTheRunNamingIt) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = LiveOnly(Base("live-program-missing", 2 * kSecondNs));
  s.tenants = {ProgramTenant("ghost", 0, s.duration_ns, {"no-such-program-vgpu"})};
  Options options;
  options.mode = Mode::live;
  options.install_dir = kInstall;
  options.environment = {"PATH=/usr/bin:/bin", "TMPDIR=" + ::testing::TempDir()};
  const Outcome outcome = runner::Run(s, options);
  EXPECT_FALSE(outcome.ok);
  EXPECT_NE(outcome.error.find("tenant 'ghost' process 0: program 'no-such-program-vgpu' is not found on PATH "
                               "(/usr/bin:/bin)"),
            std::string::npos)
      << outcome.error;
  s.tenants[0].processes[0].program = {"./not-here.sh"};
  s.file = "/nonexistent-folder/s.yaml";
  const Outcome relative = runner::Run(s, options);
  EXPECT_NE(relative.error.find("'./not-here.sh' (/nonexistent-folder/./not-here.sh) is not an executable file"),
            std::string::npos)
      << relative.error;
}

TEST(RunnerLive, CancellingKillsEveryProcessAndClosesTheTrace) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = Base("live-cancel", 4 * kSecondNs);
  s.tenants = {Busy("a", 30, s.duration_ns), Busy("b", 30, s.duration_ns)};
  s.tenants[1].processes[0].start_ns = 3 * kSecondNs;  // never started: cancelled before
  std::atomic<bool> cancel{false};
  Options options;
  options.mode = Mode::live;
  options.install_dir = kInstall;
  options.cancel = &cancel;
  int calls = 0;
  options.progress = [&](double, const std::string&) {
    if (++calls == 1) cancel = true;  // about one second in
  };
  const Outcome outcome = runner::Run(s, options);
  EXPECT_FALSE(outcome.ok);
  EXPECT_NE(outcome.error.find("cancelled at"), std::string::npos) << outcome.error;
  EXPECT_LT(outcome.wall_seconds, 3.0);
  const Trace trace = Parse(outcome.trace);
  const std::vector<TraceLine> exits = trace.Of("exit", "a");
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].Text("status"), "killed");
  EXPECT_TRUE(trace.Of("process", "b").empty());
  ASSERT_FALSE(trace.lines.empty());
  EXPECT_EQ(trace.lines.back().Text("ev"), "end");
  EXPECT_LT(trace.lines.back().Number("t_ns"), static_cast<std::int64_t>(2 * kSecondNs));
  EXPECT_EQ(trace.lines.back().Number("leaked_bytes"), 0);
}

}  // namespace
}  // namespace vgpu::runner

// ---- regressions from the review of the first version ---------------------------------------------------------

namespace vgpu::runner {
namespace {

// A repeating work list of idle phases only ran nothing forever, one cycle at a time (an hour of 1 ns idles was
// 3.6e12 iterations, before any cancel check): a cycle that runs nothing ends the schedule.
// ---- containers sharing a GPU under time division (issue 20) ------------------------------------------------------

// Time division's shares are judged in the default build. Under a sanitizer the shim is several times slower on the
// host, and beside another test on a 2-core machine two containers of 1 ms kernels got 44.1 / 42.1 % of 50 (alone
// under ASan they pass): there the runs check that every process ends cleanly (no sanitizer report, no hang).
constexpr bool kJudgeShares = !VGPU_TEST_SANITIZED;

void ExpectCleanExits(const Trace& trace, const std::string& tenant) {
  const std::vector<TraceLine> exits = trace.Of("exit", tenant);
  EXPECT_FALSE(exits.empty()) << tenant;
  for (const TraceLine& exit : exits) EXPECT_EQ(exit.Text("status"), "ok") << tenant << ": " << exit.Text("message");
}

// Two containers at `a` and `b` % of one GPU, each a process of one-wave kernels of `kernel_ns`, held by time
// division: each within 2 points of its cap over the judged windows, the two together at least 95 %.
void ExpectPairHeldByTimeDivision(std::uint32_t a, std::uint32_t b, std::uint64_t kernel_ns) {
  scenario::Scenario s = Base("pair", 5 * kSecondNs);
  s.sharing = scenario::Sharing::time_division;
  scenario::Phase phase = Kernels(kernel_ns);
  phase.blocks = 132;  // one wave on an H100: every SM busy for the kernel's whole run
  s.tenants = {Tenant("a", a), Tenant("b", b)};
  for (scenario::TenantSpec& tenant : s.tenants) tenant.processes.push_back(Process(s.duration_ns, {phase}));
  const Trace trace = Parse(MustRunLive(s).trace);
  ExpectCleanExits(trace, "a");
  ExpectCleanExits(trace, "b");
  if (!kJudgeShares) return;
  double together = 0;
  for (const auto& [name, cap] : {std::pair<std::string, std::uint32_t>{"a", a}, {"b", b}}) {
    const double mean = MeanShareAfterTheFirstSecond(trace, name);
    ASSERT_GE(mean, 0) << name;
    std::printf("%u/%u, %llu us kernels: %s %.1f %%\n", a, b, static_cast<unsigned long long>(kernel_ns / 1000),
                name.c_str(), mean);
    EXPECT_NEAR(mean, cap, 2) << name;
    together += mean;
  }
  EXPECT_GE(together, 95);
}

TEST(RunnerLive, TimeDivisionHoldsThirtySeventyWithOneWaveTwentyMillisecondKernels) {
  SKIP_WITHOUT_LIVE_PIECES();
  ExpectPairHeldByTimeDivision(30, 70, 20 * kMillisecondNs);
}

TEST(RunnerLive, TimeDivisionHoldsFiftyFiftyWithOneWaveTwentyMillisecondKernels) {
  SKIP_WITHOUT_LIVE_PIECES();
  ExpectPairHeldByTimeDivision(50, 50, 20 * kMillisecondNs);
}

TEST(RunnerLive, TimeDivisionHoldsFiftyFiftyWithOneMillisecondKernels) {
  SKIP_WITHOUT_LIVE_PIECES();
  ExpectPairHeldByTimeDivision(50, 50, kMillisecondNs);
}

// A container of two processes beside a one-process one, 60/40 (issue 20, item 2): each within 2 points. Its
// processes take turns inside its windows (policy::DecideSibling); without them they time-slice each other, each
// one's kernel estimates hold part of the other's slices, and it read 36.3-36.9 % of 40 here (29.2 of 40 on an
// H100 beside 10/20/30 ones). Charging it the union of what its processes release (tried) gave it 41.7-42.1 and
// took the neighbour to 52.8-53.2.
TEST(RunnerLive, TimeDivisionAContainerOfTwoProcessesHoldsItsShareAndItsNeighbours) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = Base("two-processes", 5 * kSecondNs);
  s.sharing = scenario::Sharing::time_division;
  scenario::Phase phase = Kernels(kMillisecondNs);
  phase.blocks = 132;
  s.tenants = {Tenant("a", 60), Tenant("b", 40)};
  s.tenants[0].processes.push_back(Process(s.duration_ns, {phase}));
  s.tenants[1].processes = {Process(s.duration_ns, {phase}), Process(s.duration_ns, {phase})};
  const Trace trace = Parse(MustRunLive(s).trace);
  ExpectCleanExits(trace, "a");
  ExpectCleanExits(trace, "b");
  if (!kJudgeShares) return;
  std::map<std::string, double> mean;
  for (const std::string name : {"a", "b"}) {
    mean[name] = MeanShareAfterTheFirstSecond(trace, name);
    ASSERT_GE(mean[name], 0) << name;
  }
  std::printf("60 / 40 (two processes): a %.1f %%, b %.1f %%\n", mean["a"], mean["b"]);
  EXPECT_NEAR(mean["a"], 60, 2);
  EXPECT_NEAR(mean["b"], 40, 2);
  EXPECT_GE(mean["a"] + mean["b"], 95);
}

// Four containers a/b/c/d at 10/20/30/40 % under time division, d of two processes, each running `phase` for
// `seconds`: every one within 2 points of its cap (the mean of the windows after the first), 95 % together.
void ExpectTenTwentyThirtyFortyHeld(const std::string& label, const scenario::Phase& phase, std::uint64_t seconds) {
  scenario::Scenario s = Base(label, seconds * kSecondNs);
  s.sharing = scenario::Sharing::time_division;
  s.tenants = {Tenant("a", 10), Tenant("b", 20), Tenant("c", 30), Tenant("d", 40)};
  for (auto& tenant : s.tenants) tenant.processes.push_back(Process(s.duration_ns, {phase}));
  s.tenants[3].processes.push_back(Process(s.duration_ns, {phase}));
  const Trace trace = Parse(MustRunLive(s).trace);
  for (const std::string name : {"a", "b", "c", "d"}) ExpectCleanExits(trace, name);
  if (!kJudgeShares) return;
  double together = 0;
  for (const auto& [name, cap] :
       std::vector<std::pair<std::string, double>>{{"a", 10}, {"b", 20}, {"c", 30}, {"d", 40}}) {
    const double mean = MeanShareAfterTheFirstSecond(trace, name);
    ASSERT_GE(mean, 0) << name;
    std::printf("10/20/30/40 %s (d of two processes): %s %.1f %%\n", label.c_str(), name.c_str(), mean);
    EXPECT_NEAR(mean, cap, 2) << name;
    together += mean;
  }
  EXPECT_GE(together, 95);
}

// Issue 20, item 2, live: four containers at 10/20/30/40 % book the whole GPU, the 40 % one of two processes, all
// running one-wave 1.64 ms kernels (the H100's bf16 matmul). Each within 2 points: the processes of the 40 % one take
// turns (policy::DecideSibling), and each container pays its own handovers (policy::HandoverCharge). Over fakecuda
// a launch released after its predecessor's work was seen complete finds the device idle and costs no handover, so
// this holds without the charge too (a 10.0 %); the simulator, which releases at the completion itself, and the
// H100 showed the 10 % one paying for all of them without it (7.4 %; 6.5-7.0 in four runs of five):
// TimeDivision.TenTwentyThirtyFortyWithOneKernelSizeEachPayItsOwnHandovers guards that.
TEST(RunnerLive, TimeDivisionTenTwentyThirtyFortyWithATwoProcessContainer) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Phase phase = Kernels(1'640 * kMicrosecondNs);
  phase.blocks = 132;
  ExpectTenTwentyThirtyFortyHeld("four", phase, 6);
}

// Issue 20, item 2, live, with mixed sizes (5 us .. 20 ms) under one function: vgpu-tenant's spin kernel, told its
// duration by an argument, is one limiter key whose median (~0.5 ms) is what every launch is expected to run. A
// process of d waiting for room in its queue sits in cuEventSynchronize while its 20 ms launch runs on; without the
// synchronize hooks (turn::BeginBlocking) its sibling took d's turn at the projected end and the two time-sliced each
// other, and with the cycle sized by the key's median a 10 % container's 20 ms launch overran five of its windows:
// 8.2 / 17.7 / 29.1 / 40.0 and 8.5 / 21.1 / 26.7 / 43.0 % before (two 8 s and 30 s runs).
TEST(RunnerLive, TimeDivisionTenTwentyThirtyFortyWithMixedSizesOfOneFunction) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Phase phase = Kernels(5 * kMicrosecondNs);
  phase.sizes_ns = {5'000, 50'000, 500'000, 5'000'000, 20'000'000};
  ExpectTenTwentyThirtyFortyHeld("four-mixed", phase, 24);
}

// Issue 20: a container whose kernel's run time depends on its data (5 us .. 20 ms under one function: a median of
// 0.5 ms, a mean of 5.1 ms) at 30 % beside a steady 70 % one (1 ms kernels). Charged each launch's median when
// released, a took 38.9 % and b 59.1; charged what its launches measured, a 21.8 and 21.4 / b 62.4 and 61.4 (its
// 20 ms launches, projected at 0.5 ms, ran into b's windows, the driver time-sliced the two, and a's spans held b's
// time). Charged what ran while keeping the end b sees ahead as long as its work runs
// (policy::KeepsOthersOffWhileUndrained): a 29.4-29.5, b 66.3-69.0 in three runs. a is held within 2 points; b is
// asserted within 5 (the goal is 2: it waits out a's work past a's projection, kept at least 1 ms ahead, and a's
// windows lent back while a repays do not make all of it up).
TEST(RunnerLive, TimeDivisionThirtySeventyWithADataDependentKernelBesideSteadyOnes) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = Base("td-data-dependent", 12 * kSecondNs);
  s.sharing = scenario::Sharing::time_division;
  scenario::Phase mixed = Kernels(5 * kMicrosecondNs);
  mixed.sizes_ns = {5'000, 50'000, 500'000, 5'000'000, 20'000'000};
  s.tenants = {Tenant("a", 30), Tenant("b", 70)};
  s.tenants[0].processes.push_back(Process(s.duration_ns, {mixed}));
  s.tenants[1].processes.push_back(Process(s.duration_ns, {Kernels(kMillisecondNs)}));
  const Trace trace = Parse(MustRunLive(s).trace);
  ExpectCleanExits(trace, "a");
  ExpectCleanExits(trace, "b");
  if (!kJudgeShares) return;
  const double a = MeanShareAfterTheFirstSecond(trace, "a");
  const double b = MeanShareAfterTheFirstSecond(trace, "b");
  std::printf("30/70, a of 5 us .. 20 ms under one function, b of 1 ms: a %.1f %%, b %.1f %%\n", a, b);
  EXPECT_NEAR(a, 30, 2);
  EXPECT_NEAR(b, 70, 5);
  EXPECT_GE(a + b, 95);
}

// `default` under time division: a lone container runs free (at least 97 %); a neighbour that arrives has its share
// within a second, and the `default` one keeps its own plus the time no member owns (work-conserving: 40 + 50 books
// 90 %, the rest is idle capacity; the limiter's `default` held it to 40).
TEST(RunnerLive, TimeDivisionDefaultRunsFreeAloneAndGivesBackWithinASecond) {
  SKIP_WITHOUT_LIVE_PIECES();
  scenario::Scenario s = Base("td-default", 5 * kSecondNs);
  s.sharing = scenario::Sharing::time_division;
  s.tenants = {Busy("steady", 40, s.duration_ns), Busy("neighbour", 50, s.duration_ns)};
  s.tenants[0].policy = scenario::Policy::default_policy;
  s.tenants[1].processes[0].start_ns = 2 * kSecondNs;
  const Trace trace = Parse(MustRunLive(s).trace);
  ExpectCleanExits(trace, "steady");
  ExpectCleanExits(trace, "neighbour");
  if (!kJudgeShares) return;
  const std::vector<double> steady = trace.Shares("steady", 0, kSecondNs);
  const std::vector<double> neighbour = trace.Shares("neighbour", 0, kSecondNs);
  ASSERT_EQ(steady.size(), 5u);
  ASSERT_EQ(neighbour.size(), 5u);
  EXPECT_GE(steady[1], 97) << "alone";
  for (std::size_t w = 3; w < 5; ++w) {
    EXPECT_NEAR(neighbour[w], 50, 3) << "window " << w << ", the arrival at 2 s";
    EXPECT_GE(steady[w], 38) << "window " << w;
    EXPECT_LE(steady[w], 52) << "window " << w;
  }
}

// ---- a job spanning GPUs (issue 20) --------------------------------------------------------------------------------

// One container on two GPUs, a rank on each (as torchrun starts them): 1 ms kernels, after every 4 an all_reduce of
// 1 ms that waits on fakecuda for the other rank's to start. Its busy time on each device over the judged windows.
scenario::Scenario DdpJob(std::uint32_t cores) {
  scenario::Scenario s = Base("ddp", 4 * kSecondNs);
  s.gpu = "2xh100-80gb";
  s.device_count = 2;
  scenario::TenantSpec job = Tenant("ddp", cores, {0, 1});
  scenario::Phase step = Kernels(kMs);
  step.depth = 8;
  step.collective_ns = kMs;
  step.ranks = 2;
  step.every = 4;
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    job.processes.push_back(Process(s.duration_ns, {step}));
    job.processes.back().device = rank;
  }
  s.tenants = {job};
  return s;
}

// Runs the job live at `cores` % and returns each GPU's busy share over the judged windows (printed), and the trace.
// `neighbour`: a second container at 50 % on the job's first GPU, 1 ms kernels.
std::vector<double> RunDdpJob(std::uint32_t cores, Trace& trace, scenario::Sharing sharing = scenario::Sharing::limiter,
                              bool neighbour = false) {
  scenario::Scenario s = DdpJob(cores);
  s.sharing = sharing;
  if (neighbour) s.tenants.push_back(Busy("neighbour", 50, s.duration_ns));
  trace = Parse(MustRunLive(s).trace);
  std::vector<double> busy;
  for (std::int64_t device = 0; device < 2; ++device) {
    busy.push_back(std::max(MeanShareAfterTheFirstSecond(trace, "ddp", device), 0.0));
    std::printf("cap %u %%: device %lld busy %.1f %%\n", cores, static_cast<long long>(device), busy.back());
  }
  return busy;
}

// Uncapped, the ranks' collectives pair up and the job keeps both GPUs busy: nothing in the model holds it back.
TEST(RunnerLive, ATwoGpuJobWithCollectivesKeepsBothGpusBusyUncapped) {
  SKIP_WITHOUT_LIVE_PIECES();
  Trace trace;
  for (const double busy : RunDdpJob(0, trace)) EXPECT_GT(busy, 90);
  for (const TraceLine& exit : trace.Of("exit", "ddp")) EXPECT_EQ(exit.Text("status"), "ok") << exit.Text("message");
}

// FAILS (issue 20, item 4; ../shared/FIELD-NOTES.md: DDP on two H100s at 50 % took 420–1198 ms a step for 15–19 ms
// uncapped): the limiter charges each rank its all_reduce's wait for the other rank, which it is itself holding back.
// Goal: each GPU busy at least 45 % (a step at most 2.2 x uncapped). Observed: 4.0 to 4.4 % busy on each GPU
// (uncapped: 100.0, the test above), a step ~23 x slower.
TEST(RunnerLive, KnownGapATwoGpuJobAtHalfItsGpusKeepsItsStepTime) {
  SKIP_WITHOUT_LIVE_PIECES();
  Trace trace;
  for (const double busy : RunDdpJob(50, trace)) EXPECT_GE(busy, 45);
}

// Held by time division (docs/compute-sharing.md): the job's windows are aligned on its two GPUs, one account for
// both, and a rank waits while another member holds either GPU, so its all_reduces meet and are not charged waiting.
TEST(RunnerLive, ATwoGpuJobAtHalfItsGpusKeepsItsStepTimeUnderTimeDivision) {
  SKIP_WITHOUT_LIVE_PIECES();
  Trace trace;
  const std::vector<double> busy = RunDdpJob(50, trace, scenario::Sharing::time_division);
  ExpectCleanExits(trace, "ddp");
  if (!kJudgeShares) return;
  for (const double b : busy) {
    EXPECT_GE(b, 45);
    EXPECT_LE(b, 52);
  }
}

// The same beside a second container at 50 % on one of its GPUs: the job keeps its step time. The neighbour is short
// of its share by 3 to 8 points on average (observed: the job 46.4 to 49.7 % on each GPU, the neighbour 42.2 to 47.7 %
// a window): the handovers on the shared GPU, and the job's all_reduces waiting there for its other rank, come out of
// the neighbour's time. Single seconds spread wider: on 2026-11-28 (this 2-core machine), 16 runs with the shim of
// b7b3a06 had judged seconds of 37.5 to 48.1 and 12 with the declined rests 33.9 to 50.0, the runs' means 42-45 with
// either; the per-second bound of 10 points failed about one run in eight with either, and CI once. Asserted: the
// mean of the judged seconds within 10 points, and no second under 30, so that a collapse shows (the limiter gives
// it 4 %; issue 20 stays open for the gap).
TEST(RunnerLive, ATwoGpuJobBesideANeighbourKeepsItsStepTimeUnderTimeDivision) {
  SKIP_WITHOUT_LIVE_PIECES();
  Trace trace;
  const std::vector<double> busy = RunDdpJob(50, trace, scenario::Sharing::time_division, true);
  ExpectCleanExits(trace, "ddp");
  ExpectCleanExits(trace, "neighbour");
  if (!kJudgeShares) return;
  for (const double b : busy) EXPECT_GE(b, 45);
  ExpectShares(trace, "neighbour", 0, 40, 10);  // every judged second in [30, 50]
  EXPECT_NEAR(MeanShareAfterTheFirstSecond(trace, "neighbour"), 50, 10);
}

TEST(RunnerRegression, AnAllIdleRepeatingProcessDoesNotLoopOverEveryCycle) {
  scenario::Scenario s = Base("idle-forever", 3600 * kSecondNs);
  s.sample_ns = kSecondNs;
  scenario::TenantSpec idle = Tenant("idle", 30);
  idle.processes = {Process(s.duration_ns, {Idle(1)})};
  idle.processes[0].repeat = true;
  s.tenants = {idle, Busy("busy", 30, s.duration_ns)};
  const Outcome outcome = MustRun(s);
  EXPECT_LT(outcome.wall_seconds, 30.0);
  for (const auto& [t, busy] : Parse(outcome.trace).Busy("idle", 0)) EXPECT_EQ(busy, 0) << "at " << t;
}

// A progress callback that throws ends the run with an error that says so; Run itself never throws.
TEST(RunnerRegression, AThrowingProgressCallbackIsAnOutcomeErrorNotAnException) {
  scenario::Scenario s = Base("throwing-progress", 2 * kSecondNs);
  s.tenants = {Busy("a", 30, s.duration_ns)};
  Options options;
  options.progress = [](double fraction, const std::string&) {
    if (fraction >= 1.0) throw std::runtime_error("the caller's display broke");
  };
  Outcome outcome;
  EXPECT_NO_THROW(outcome = runner::Run(s, options));
  EXPECT_FALSE(outcome.ok);
  EXPECT_NE(outcome.error.find("the caller's display broke"), std::string::npos) << outcome.error;
}

// An exec that fails (here: a vgpu-tenant that is not executable) is reported with its reason, not as a process that
// exited with status 127: the exec status pipe stays open across the descriptor clean-up before exec.
TEST(RunnerRegression, AFailedExecIsReportedWithItsReason) {
  SKIP_WITHOUT_LIVE_PIECES();
  char folder[] = "/tmp/vgpu-runner-exec.XXXXXX";
  ASSERT_NE(mkdtemp(folder), nullptr);
  const std::filesystem::path install(folder);
  std::filesystem::create_directories(install / "bin");
  std::filesystem::create_symlink(std::filesystem::path(kInstall) / "lib", install / "lib");
  std::filesystem::copy_file(std::filesystem::path(kInstall) / "bin" / "vgpu-sampler",
                             install / "bin" / "vgpu-sampler");
  { std::ofstream(install / "bin" / "vgpu-tenant") << "not a program\n"; }
  std::filesystem::permissions(install / "bin" / "vgpu-tenant", std::filesystem::perms::owner_all);
  scenario::Scenario s = Base("exec-fails", kSecondNs);
  s.settle_ns = 0;
  s.tenants = {Busy("a", 30, s.duration_ns)};
  Options options;
  options.mode = Mode::live;
  options.install_dir = install.string();
  const Outcome outcome = runner::Run(s, options);
  EXPECT_FALSE(outcome.ok);
  EXPECT_NE(outcome.error.find("Exec format error"), std::string::npos) << outcome.error;
  std::filesystem::remove_all(install);
}

}  // namespace
}  // namespace vgpu::runner
