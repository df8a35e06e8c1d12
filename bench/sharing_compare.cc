// sharing_compare: issue 20's comparison in virtual time (docs/compute-sharing.md, "Choice"). Each case runs under
// the event-pair limiter (`budget`) and under time division, on the H100-calibrated device (2.09 ms time slices,
// 160 us handovers, kernels measured as the shim's event pair reads them), and prints every tenant's share of the
// GPU's time (the model's exact busy time, NVML's measure) against its cap, and the tenants' sum.
//
//   build/default/bin/sharing_compare [--cycle-ms N] [--cycle-max-ms N] [--seconds N] [--seed N] [--case NAME]
//                                     [--trace FILE] [--measurement event-pair|shim] [--no-prompt-service]
// --measurement shim: kernels measured as the shim measures them (windows, sampled pairs, unmeasured launches at
// their kernel's mean: sim::Measurement::shim) instead of an event pair around every kernel. --no-prompt-service: time
// division without policy::TurnConfig::prompt_service (docs/compute-sharing.md, "Prompt service").
// --cycle-max-ms: the cycle doubles from --cycle-ms up to this until every window holds its tenant's longest kernel.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "vgpu/sim/sim.h"

namespace {

using namespace vgpu::sim;

struct Case {
  std::string name;
  std::vector<Tenant> tenants;
};

Tenant Of(const std::string& name, std::uint32_t share, const Workload& workload, std::uint32_t processes = 1,
          Policy policy = Policy::force) {
  Tenant tenant;
  tenant.name = name;
  tenant.share_percent = share;
  tenant.policy = policy;
  for (std::uint32_t i = 0; i < processes; ++i) tenant.processes.push_back(Process{.workload = workload});
  return tenant;
}

std::vector<Case> Cases() {
  const Workload ms1 = Persistent(kMillisecondNs, 4);
  const Workload ms20 = Persistent(20 * kMillisecondNs);
  const Workload us5 = BackToBack(5 * kMicrosecondNs);
  const Workload bf16 = Bursts(1'669 * kMicrosecondNs, 4);  // an H200's bf16 8192 matmul, four, then a synchronize
  const Workload bf16_mixed = MatmulLikeBursts();  // 1.5 ms, one launch in four 1.95 ms (a matmul after a handover)
  std::vector<Case> cases;
  cases.push_back({"30/70, 1 ms kernels", {Of("a", 30, ms1), Of("b", 70, ms1)}});
  cases.push_back({"50/50, 1 ms kernels", {Of("a", 50, ms1), Of("b", 50, ms1)}});
  cases.push_back({"30/70, one-wave 20 ms kernels", {Of("a", 30, ms20), Of("b", 70, ms20)}});
  cases.push_back({"50/50, one-wave 20 ms kernels", {Of("a", 50, ms20), Of("b", 50, ms20)}});
  cases.push_back({"30/70, 5 us kernels", {Of("a", 30, us5), Of("b", 70, us5)}});
  cases.push_back({"30/70, bf16 loops (1.67 ms, four, then a synchronize)", {Of("a", 30, bf16), Of("b", 70, bf16)}});
  cases.push_back({"50/50, bf16 loops (1.67 ms, four, then a synchronize)", {Of("a", 50, bf16), Of("b", 50, bf16)}});
  cases.push_back({"30/70, bf16-like loops (1.5 ms or 1.95 ms, four, then a synchronize)",
                   {Of("a", 30, bf16_mixed), Of("b", 70, bf16_mixed)}});
  // A light service (a 1 ms kernel 47 times a second, out of step with any cycle: 4.7 % of the GPU, well under its
  // 30 %) beside a busy 70 %: how long its launches wait (issue 20, item 7).
  cases.push_back({"light 30 (a 1 ms kernel 47 times a second) beside a busy 70, 1 ms kernels",
                   {Of("a", 30, Rate(47, kMillisecondNs)), Of("b", 70, ms1)}});
  cases.push_back({"light 30 (a 1 ms kernel 47 times a second) beside a busy 70, 1 ms kernels 64 deep",
                   {Of("a", 30, Rate(47, kMillisecondNs)), Of("b", 70, Persistent(kMillisecondNs, 64))}});
  cases.push_back({"10/20/30/40, mixed 5 us .. 20 ms, d of two processes",
                   {Of("a", 10, Mixed()), Of("b", 20, Mixed()), Of("c", 30, Mixed()), Of("d", 40, Mixed(), 2)}});
  for (const std::uint32_t cap : {10u, 30u, 50u, 70u, 90u}) {
    cases.push_back({"alone at " + std::to_string(cap) + " %, 1 ms kernels", {Of("a", cap, ms1)}});
    cases.push_back({"alone at " + std::to_string(cap) + " %, one-wave 20 ms kernels", {Of("a", cap, ms20)}});
    cases.push_back({"alone at " + std::to_string(cap) + " %, 5 us kernels", {Of("a", cap, us5)}});
    cases.push_back({"alone at " + std::to_string(cap) + " %, mixed", {Of("a", cap, Mixed())}});
  }
  cases.push_back({"default alone at 30 %, 1 ms kernels", {Of("a", 30, ms1, 1, Policy::default_policy)}});
  cases.push_back({"default alone at 30 %, mixed", {Of("a", 30, Mixed(), 1, Policy::default_policy)}});
  cases.push_back(
      {"default 30 beside force 70, 1 ms kernels", {Of("a", 30, ms1, 1, Policy::default_policy), Of("b", 70, ms1)}});
  return cases;
}

// p50 / p99 / max of a tenant's launch waits (under the limiter: its sleeps for the budget).
std::string WaitPercentiles(std::vector<std::uint64_t> waits) {
  if (waits.empty()) return "-";
  std::sort(waits.begin(), waits.end());
  const auto at = [&](double q) { return waits[static_cast<std::size_t>(q * static_cast<double>(waits.size() - 1))]; };
  char text[96];
  std::snprintf(text, sizeof text, "%.2f / %.2f / %.2f", at(0.5) / 1e6, at(0.99) / 1e6, waits.back() / 1e6);
  return text;
}

// A job on two GPUs, a rank on each (the second starting 300 us later): 1 ms kernels, an all_reduce of 1 ms after every
// 4 (depth 8), capped at `cap`
// % (0: no limit), alone or beside a 1-GPU neighbour at 50 % on GPU 0 with 1 ms kernels.
Scenario DdpScenario(std::uint32_t cap, bool neighbour, Sharing sharing, const Scenario& base) {
  Scenario scenario = base;
  scenario.device = "h100-80gb,h100-80gb";
  scenario.sharing = sharing;
  Workload step = Persistent(kMillisecondNs, 8);
  step.collective_ns = kMillisecondNs;
  step.collective_ranks = 2;
  step.collective_every = 4;
  Tenant job = Of("ddp", cap, step, 2);
  job.processes[1].device = 1;
  job.processes[1].start_ns = 300 * kMicrosecondNs;  // ranks never start together
  scenario.tenants = {job};
  if (neighbour) scenario.tenants.push_back(Of("other", 50, Persistent(kMillisecondNs, 4)));
  return scenario;
}

// Issue 20, item 4 in virtual time: kernels the job completes in the run, against uncapped.
int PrintDdp(const Scenario& base) {
  std::printf(
      "\n| 2-GPU job (1 ms kernels, all_reduce of 1 ms after every 4) | kernels | of uncapped | busy per GPU, %% "
      "| neighbour |\n|---|---|---|---|---|\n");
  const Result uncapped = Run(DdpScenario(0, false, Sharing::budget, base));
  if (!uncapped.error.empty()) {
    std::fprintf(stderr, "sharing_compare: ddp uncapped: %s\n", uncapped.error.c_str());
    return 1;
  }
  const double reference = static_cast<double>(uncapped.tenants[0].kernels);
  for (const bool neighbour : {false, true}) {
    for (const Sharing sharing : {Sharing::budget, Sharing::time_division}) {
      const Result result = Run(DdpScenario(50, neighbour, sharing, base));
      if (!result.error.empty()) {
        std::fprintf(stderr, "sharing_compare: ddp: %s\n", result.error.c_str());
        return 1;
      }
      char other[64] = "-";
      if (neighbour) std::snprintf(other, sizeof other, "%.1f %%", result.tenants[1].mean_share * 100);
      std::printf("| at 50 %%%s, %s | %llu | %.2f | %.1f | %s |\n",
                  neighbour ? " beside a 50 % neighbour on GPU 0" : "", SharingName(sharing),
                  static_cast<unsigned long long>(result.tenants[0].kernels),
                  static_cast<double>(result.tenants[0].kernels) / reference, result.tenants[0].mean_share * 50, other);
    }
  }
  std::printf("| uncapped | %llu | 1.00 | %.1f | - |\n", static_cast<unsigned long long>(uncapped.tenants[0].kernels),
              uncapped.tenants[0].mean_share * 50);
  return 0;
}

// The H100-calibrated device and the run's settings.
Scenario Calibrated(std::uint64_t seconds, std::uint64_t seed, std::uint64_t cycle_ms, std::uint64_t cycle_max_ms,
                    Measurement measurement) {
  Scenario scenario;
  scenario.timeslice_ns = 2'090 * kMicrosecondNs;
  scenario.switch_ns = 160 * kMicrosecondNs;
  scenario.measurement = measurement;
  scenario.duration_ns = seconds * kSecondNs;
  scenario.seed = seed;
  scenario.cycle_ns = cycle_ms * kMillisecondNs;
  scenario.cycle_max_ns = cycle_max_ms * kMillisecondNs;
  scenario.record_waits = true;
  return scenario;
}

bool ParseNumber(const char* text, std::uint64_t& value) {
  char* end = nullptr;
  value = std::strtoull(text, &end, 10);
  return end != text && *end == '\0';
}

struct Arguments {
  std::uint64_t cycle_ms = 20;
  std::uint64_t cycle_max_ms = 0;
  std::uint64_t seconds = 6;
  std::uint64_t seed = 1;
  std::string only;   // --case: only the cases whose name holds this
  std::string trace;  // --trace: the time-division runs' traces, appended to this file (JSON lines)
  Measurement measurement = Measurement::event_pair;
  bool prompt_service = true;  // --no-prompt-service: time division without policy::TurnConfig::prompt_service
};

// The command line, strictly: false (after one line on stderr) for anything else.
bool ParseArguments(int argc, char** argv, Arguments& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    bool ok = has_value;
    if (arg == "--cycle-ms" && has_value) {
      ok = ParseNumber(argv[++i], a.cycle_ms) && a.cycle_ms >= 1 && a.cycle_ms <= 1000;
    } else if (arg == "--cycle-max-ms" && has_value) {
      ok = ParseNumber(argv[++i], a.cycle_max_ms) && a.cycle_max_ms <= 10000;
    } else if (arg == "--seconds" && has_value) {
      ok = ParseNumber(argv[++i], a.seconds) && a.seconds >= 2 && a.seconds <= 3600;
    } else if (arg == "--seed" && has_value) {
      ok = ParseNumber(argv[++i], a.seed);
    } else if (arg == "--case" && has_value) {
      a.only = argv[++i];
    } else if (arg == "--trace" && has_value) {
      a.trace = argv[++i];
    } else if (arg == "--no-prompt-service") {
      a.prompt_service = false;
      ok = true;
    } else if (arg == "--measurement" && has_value) {
      const std::string how = argv[++i];
      ok = how == "event-pair" || how == "shim";
      a.measurement = how == "shim" ? Measurement::shim : Measurement::event_pair;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "sharing_compare: bad argument '%s'; accepted: --cycle-ms 1..1000, --cycle-max-ms 0..10000, "
                   "--seconds 2..3600, --seed N, --case <text in a case's name>, --trace FILE, --measurement "
                   "event-pair|shim, --no-prompt-service\n",
                   arg.c_str());
      return false;
    }
  }
  return true;
}

// One row: each tenant's cap and mean share, their sum, the worst second, the first tenant's waits.
void PrintRow(const std::string& name, Sharing sharing, const Result& result) {
  std::string shares;
  double sum = 0;
  double worst = 0;
  for (const TenantResult& t : result.tenants) {
    char cell[64];
    std::snprintf(cell, sizeof cell, "%s%s %.0f: %.1f", shares.empty() ? "" : ", ", t.name.c_str(), t.cap * 100,
                  t.mean_share * 100);
    shares += cell;
    sum += t.mean_share;
    worst = std::max(worst, t.worst_window_error);
  }
  std::printf("| %s | %s | %s | %.1f | %.1f | %s | %s |\n", name.c_str(), SharingName(sharing), shares.c_str(),
              sum * 100, worst * 100, WaitPercentiles(result.tenants.front().launch_waits_ns).c_str(),
              WaitPercentiles(result.tenants.front().responses_ns).c_str());
  std::fflush(stdout);
}

// Appends `text` to the file at `path`; false (after one line on stderr) where it cannot.
bool AppendTo(const std::string& path, const std::string& text) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  const bool ok = file != nullptr && std::fwrite(text.data(), 1, text.size(), file) == text.size();
  if (file != nullptr && std::fclose(file) != 0) return false;
  if (!ok) std::fprintf(stderr, "sharing_compare: --trace %s: cannot append: %s\n", path.c_str(), std::strerror(errno));
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  Arguments a;
  if (!ParseArguments(argc, argv, a)) return 2;
  Scenario base = Calibrated(a.seconds, a.seed, a.cycle_ms, a.cycle_max_ms, a.measurement);
  base.prompt_service = a.prompt_service;
  std::printf(
      "| case | sharing | shares (cap: got, %%) | sum %% | worst 1 s window, points | first tenant's launch "
      "wait p50 / p99 / max, ms | its call to its kernel's end, p50 / p99 / max, ms |\n"
      "|---|---|---|---|---|---|---|\n");
  for (const Case& c : Cases()) {
    if (!a.only.empty() && c.name.find(a.only) == std::string::npos) continue;
    for (const Sharing sharing : {Sharing::budget, Sharing::time_division}) {
      Scenario scenario = base;
      scenario.sharing = sharing;
      scenario.tenants = c.tenants;
      scenario.record_trace = !a.trace.empty() && sharing == Sharing::time_division;
      const Result result = Run(scenario);
      if (!result.error.empty()) {
        std::fprintf(stderr, "sharing_compare: %s (%s): %s\n", c.name.c_str(), SharingName(sharing),
                     result.error.c_str());
        return 1;
      }
      PrintRow(c.name, sharing, result);
      if (scenario.record_trace && !AppendTo(a.trace, result.trace)) return 1;
    }
  }
  if (a.only.empty() || std::string("ddp").find(a.only) != std::string::npos) return PrintDdp(base);
  return 0;
}
