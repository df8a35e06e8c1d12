// libFuzzer target: scenario files (sim/scenario: the YAML-subset reader and the validator), through LoadText, the
// entry point of LoadFile, the runner and `vgpu check`. The input is the file's text.
// Invariants:
//   - a scenario comes back exactly when there is no problem; at most 50 problems, in line order, each naming this
//     file, a line of the text (or 0), a non-empty message, all valid UTF-8 (they become Python strings) and one
//     line of text (`vgpu check` prints one problem per line);
//   - a scenario that validates keeps every rule of docs/scenarios.md: ranges, the timeline's multiples, start < stop
//     <= duration, crash_at in [start, stop), devices unique and on the GPU, processes' devices within the
//     container's, at most 255 processes, expectations' periods holding a whole window, oom: true only with a memory
//     limit, gpu: real live only and without faults, every string valid UTF-8;
//   - it keeps check.h's rules, which the runner applies to a scenario however it was built;
//   - it round-trips: written back out as YAML (every value explicit, times in ns, sizes in bytes, strings quoted
//     with escapes) and loaded again, it validates and gives the same scenario, field by field, line numbers aside.
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>

#include "fakecuda/model/layout.h"
#include "vgpu/scenario/check.h"
#include "vgpu/scenario/scenario.h"

namespace {

using namespace vgpu::scenario;

[[noreturn]] void Fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz_scenario: invariant broken: %s%s%s\n", what, detail.empty() ? "" : "\n  ", detail.c_str());
  std::abort();
}

#define CHECK(condition, ...)                          \
  do {                                                 \
    if (!(condition)) Fail(#condition, ##__VA_ARGS__); \
  } while (false)

constexpr std::uint64_t kMs = kMillisecondNs;
constexpr std::uint64_t kHour = 3600 * kSecondNs;

bool ValidUtf8(std::string_view text) {
  for (std::size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    std::size_t length = 0;
    std::uint32_t code = 0, low = 0;
    if (lead < 0x80) {
      ++i;
      continue;
    }
    if (lead >= 0xc2 && lead <= 0xdf)
      length = 2, low = 0x80, code = lead & 0x1fu;
    else if (lead >= 0xe0 && lead <= 0xef)
      length = 3, low = 0x800, code = lead & 0x0fu;
    else if (lead >= 0xf0 && lead <= 0xf4)
      length = 4, low = 0x10000, code = lead & 0x07u;
    else
      return false;
    if (i + length > text.size()) return false;
    for (std::size_t k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xc0) != 0x80) return false;
      code = (code << 6) | (next & 0x3fu);
    }
    if (code < low || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return false;
    i += length;
  }
  return true;
}

bool IsName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (const char c : name) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
    if (!ok) return false;
  }
  return true;
}

// ---- the rules a validated scenario keeps ---------------------------------------------------------------------------

void CheckScenario(const Scenario& s) {
  CHECK(IsName(s.name), s.name);
  CHECK(ValidUtf8(s.description) && ValidUtf8(s.gpu));
  CHECK(s.duration_ns >= 100 * kMs && s.duration_ns <= kHour);
  CHECK(s.window_ns >= kMs && s.window_ns <= kHour);
  CHECK(s.sample_ns >= kMs && s.sample_ns <= 60 * kSecondNs);
  CHECK(s.settle_ns < s.duration_ns);
  CHECK(s.duration_ns % s.window_ns == 0 && s.settle_ns % s.window_ns == 0 && s.window_ns % s.sample_ns == 0);
  CHECK(s.timeslice_ns >= 1000 && s.timeslice_ns <= kSecondNs && s.timeslice_ns % 1000 == 0);
  CHECK(s.switch_ns <= 100 * kMs && s.switch_ns % 1000 == 0);
  CHECK(s.virtual_mode || s.live_mode);
  if (s.real_gpu) {
    CHECK(s.gpu == "real" && !s.virtual_mode && s.faults.empty() && s.context_bytes == 0);
  } else {
    CHECK(s.device_count >= 1 && s.gpu != "real");
  }
  CHECK(s.device_count >= 1 && s.device_count <= 64);
  CHECK(!s.tenants.empty() && s.tenants.size() <= 16);
  std::set<std::string> names;
  std::uint64_t processes = 0;
  for (const TenantSpec& t : s.tenants) {
    CHECK(IsName(t.name) && names.insert(t.name).second, t.name);
    CHECK(t.gpu_count >= 1 && t.gpu_count == t.devices.size());
    std::set<std::uint32_t> devices(t.devices.begin(), t.devices.end());
    CHECK(devices.size() == t.devices.size());
    for (const std::uint32_t d : t.devices) CHECK(d < s.device_count);
    CHECK(t.cores_percent <= 100 && t.priority <= 1);
    CHECK(t.policy == Policy::force || t.policy == Policy::default_policy || t.policy == Policy::disable);
    CHECK(!t.processes.empty() && t.processes.size() <= 16);
    for (const ProcessSpec& p : t.processes) {
      CHECK(p.replicas >= 1 && p.replicas <= 64);
      processes += p.replicas;
      CHECK(p.start_ns < p.stop_ns && p.stop_ns <= s.duration_ns);
      if (p.crash_at_ns) CHECK(*p.crash_at_ns >= p.start_ns && *p.crash_at_ns < p.stop_ns);
      CHECK(p.device < t.gpu_count);
      CHECK(!p.work.empty() && p.work.size() <= 64);
      for (const Phase& phase : p.work) {
        if (phase.kind == Phase::Kind::idle) {
          CHECK(phase.sizes_ns.empty() && phase.for_ns >= 1 && phase.for_ns <= kHour);
          continue;
        }
        CHECK(!phase.sizes_ns.empty() && phase.sizes_ns.size() <= 1024);
        for (const std::uint64_t size : phase.sizes_ns) CHECK(size >= 1000 && size <= kHour);
        CHECK(phase.for_ns <= kHour);
        CHECK(phase.depth >= 1 && phase.depth <= fakecuda::model::kStreamDepth);
        CHECK(phase.blocks >= 1 && phase.blocks <= 65535);
        CHECK(phase.jitter_permille <= 500);
        CHECK(phase.rate == 0 || (phase.rate >= 0.001 && phase.rate <= 1e6));
      }
    }
    for (const Expectation& e : t.expect) {
      if (e.kind == Expectation::Kind::oom) {
        CHECK(!e.oom || t.memory_limit_bytes != 0);
        continue;
      }
      CHECK(e.percent >= 0 && e.percent <= 100);
      if (e.tolerance_points) CHECK(*e.tolerance_points > 0 && *e.tolerance_points <= 100);
      if (e.worst_window_points) {
        CHECK(e.kind == Expectation::Kind::share && *e.worst_window_points > 0 && *e.worst_window_points <= 100);
      }
      if (e.kind != Expectation::Kind::share) CHECK(!e.tolerance_points);
      CHECK(e.from_ns >= s.settle_ns && e.to_ns <= s.duration_ns);
      // At least one whole judged window in [from, to).
      const std::uint64_t first = (e.from_ns + s.window_ns - 1) / s.window_ns * s.window_ns;
      CHECK(first + s.window_ns <= e.to_ns);
    }
  }
  CHECK(processes <= fakecuda::model::kMaxProcesses - 1);
  for (const std::string& rule : s.faults) {
    CHECK(!rule.empty() && rule.find(';') == std::string::npos && ValidUtf8(rule));
  }
}

// ---- writing a scenario back out ------------------------------------------------------------------------------------

std::string Quoted(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte < 0x20 || byte == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string Ns(std::uint64_t ns) { return std::to_string(ns) + "ns"; }

// The shortest decimal that reads back as the same double (no exponent: the format has none).
std::string Number(double value) {
  char text[400];
  const auto result = std::to_chars(text, text + sizeof text, value, std::chars_format::fixed);
  if (result.ec != std::errc()) Fail("to_chars failed");
  return std::string(text, result.ptr);
}

std::string Write(const Scenario& s) {
  std::string y;
  y += "name: " + Quoted(s.name) + "\n";
  if (!s.description.empty()) y += "description: " + Quoted(s.description) + "\n";
  y += "gpu: " + Quoted(s.gpu) + "\n";
  y += "timeslice: " + Ns(s.timeslice_ns) + "\nswitch: " + Ns(s.switch_ns) + "\n";
  y += std::string("mode: [") + (s.virtual_mode ? "virtual" : "") + (s.virtual_mode && s.live_mode ? ", " : "") +
       (s.live_mode ? "live" : "") + "]\n";
  y += "duration: " + Ns(s.duration_ns) + "\nsettle: " + Ns(s.settle_ns) + "\nwindow: " + Ns(s.window_ns) +
       "\nsample: " + Ns(s.sample_ns) + "\nseed: " + std::to_string(s.seed) + "\n";
  y += "tenants:\n";
  for (const TenantSpec& t : s.tenants) {
    y += "  - name: " + Quoted(t.name) + "\n";
    y += "    limits:\n";
    y += "      nvidia.com/gpu: " + std::to_string(t.gpu_count) + "\n";
    y += "      nvidia.com/gpumem: " + std::to_string(t.memory_limit_bytes) + "b\n";
    y += "      nvidia.com/gpucores: " + std::to_string(t.cores_percent) + "\n";
    y += "      nvidia.com/priority: " + std::to_string(t.priority) + "\n";
    y += std::string("    policy: ") + PolicyName(t.policy) + "\n";
    y += "    devices: [";
    for (std::size_t i = 0; i < t.devices.size(); ++i) y += (i ? ", " : "") + std::to_string(t.devices[i]);
    y += "]\n    processes:\n";
    for (const ProcessSpec& p : t.processes) {
      y += "      - replicas: " + std::to_string(p.replicas) + "\n";
      y += "        start: " + Ns(p.start_ns) + "\n        stop: " + Ns(p.stop_ns) + "\n";
      if (p.crash_at_ns) y += "        crash_at: " + Ns(*p.crash_at_ns) + "\n";
      y += "        device: " + std::to_string(p.device) + "\n";
      y += "        alloc: " + std::to_string(p.alloc_bytes) + "\n";
      y += std::string("        repeat: ") + (p.repeat ? "true" : "false") + "\n";
      y += "        work:\n";
      for (const Phase& phase : p.work) {
        if (phase.kind == Phase::Kind::idle) {
          y += "          - idle: " + Ns(phase.for_ns) + "\n";
          continue;
        }
        y += "          - {kernels: [";
        for (std::size_t i = 0; i < phase.sizes_ns.size(); ++i) y += (i ? ", " : "") + Ns(phase.sizes_ns[i]);
        y += "]";
        if (phase.for_ns != 0) y += ", for: " + Ns(phase.for_ns);
        y += ", depth: " + std::to_string(phase.depth);
        if (phase.rate != 0) y += ", rate: " + Number(phase.rate);
        y += ", blocks: " + std::to_string(phase.blocks);
        y += ", jitter: " + std::to_string(phase.jitter_permille / 10) + "." +
             std::to_string(phase.jitter_permille % 10) + "%}\n";
      }
    }
    if (!t.expect.empty()) y += "    expect:\n";
    for (const Expectation& e : t.expect) {
      switch (e.kind) {
        case Expectation::Kind::oom:
          y += std::string("      - oom: ") + (e.oom ? "true" : "false") + "\n";
          continue;
        case Expectation::Kind::share:
          y += "      - share: " + Number(e.percent) + "\n";
          break;
        case Expectation::Kind::min_share:
          y += "      - min_share: " + Number(e.percent) + "\n";
          break;
        case Expectation::Kind::max_share:
          y += "      - max_share: " + Number(e.percent) + "%\n";
          break;
      }
      if (e.tolerance_points) y += "        tolerance: " + Number(*e.tolerance_points) + "\n";
      if (e.worst_window_points) y += "        worst_window: " + Number(*e.worst_window_points) + "\n";
      y += "        from: " + Ns(e.from_ns) + "\n        to: " + Ns(e.to_ns) + "\n";
    }
  }
  y += "expect:\n  leaked_bytes: " + std::to_string(s.expect_leaked_bytes) + "\n";
  if (!s.faults.empty()) {
    y += "faults:\n";
    for (const std::string& rule : s.faults) y += "  - " + Quoted(rule) + "\n";
  }
  return y;
}

// Field by field, line numbers and the file's name aside. Returns the first difference, or "".
std::string Difference(const Scenario& a, const Scenario& b) {
#define SAME(field) \
  if (!(a.field == b.field)) return #field
  SAME(name);
  SAME(description);
  SAME(gpu);
  SAME(real_gpu);
  SAME(device_count);
  SAME(context_bytes);
  SAME(timeslice_ns);
  SAME(switch_ns);
  SAME(virtual_mode);
  SAME(live_mode);
  SAME(duration_ns);
  SAME(settle_ns);
  SAME(window_ns);
  SAME(sample_ns);
  SAME(seed);
  SAME(expect_leaked_bytes);
  SAME(faults);
  SAME(tenants.size());
#undef SAME
  for (std::size_t i = 0; i < a.tenants.size(); ++i) {
    const TenantSpec& x = a.tenants[i];
    const TenantSpec& y = b.tenants[i];
    const std::string at = "tenants[" + std::to_string(i) + "].";
#define SAME(field) \
  if (!(x.field == y.field)) return at + #field
    SAME(name);
    SAME(gpu_count);
    SAME(memory_limit_bytes);
    SAME(cores_percent);
    SAME(priority);
    SAME(policy);
    SAME(devices);
    SAME(processes.size());
    SAME(expect.size());
#undef SAME
    for (std::size_t j = 0; j < x.processes.size(); ++j) {
      const ProcessSpec& p = x.processes[j];
      const ProcessSpec& q = y.processes[j];
      const std::string pat = at + "processes[" + std::to_string(j) + "].";
#define SAME(field) \
  if (!(p.field == q.field)) return pat + #field
      SAME(replicas);
      SAME(start_ns);
      SAME(stop_ns);
      SAME(crash_at_ns);
      SAME(device);
      SAME(alloc_bytes);
      SAME(repeat);
      SAME(work.size());
#undef SAME
      for (std::size_t k = 0; k < p.work.size(); ++k) {
        const Phase& f = p.work[k];
        const Phase& g = q.work[k];
        const std::string fat = pat + "work[" + std::to_string(k) + "].";
#define SAME(field) \
  if (!(f.field == g.field)) return fat + #field
        SAME(kind);
        SAME(sizes_ns);
        SAME(for_ns);
        SAME(depth);
        SAME(rate);
        SAME(blocks);
        SAME(jitter_permille);
#undef SAME
      }
    }
    for (std::size_t j = 0; j < x.expect.size(); ++j) {
      const Expectation& e = x.expect[j];
      const Expectation& f = y.expect[j];
      const std::string eat = at + "expect[" + std::to_string(j) + "].";
#define SAME(field) \
  if (!(e.field == f.field)) return eat + #field
      SAME(kind);
      SAME(percent);
      SAME(tolerance_points);
      SAME(worst_window_points);
      SAME(from_ns);
      SAME(to_ns);
      SAME(oom);
#undef SAME
    }
  }
  return "";
}

std::size_t LineCount(std::string_view text) {
  std::size_t lines = 1;
  for (const char c : text) lines += c == '\n';
  return lines;
}

void CheckProblems(const Loaded& loaded, const std::string& file, std::size_t lines) {
  CHECK(loaded.scenario.has_value() == loaded.problems.empty());
  CHECK(loaded.problems.size() <= 50);
  std::uint32_t previous = 0;
  for (const Problem& problem : loaded.problems) {
    CHECK(problem.file == file);
    CHECK(problem.line >= previous, "problems out of line order");
    previous = problem.line;
    CHECK(problem.line <= lines, problem.ToString());
    CHECK(!problem.message.empty());
    const std::string text = problem.ToString();
    CHECK(ValidUtf8(text), text);
    for (const char c : text) {  // a tab is text (a plain key may hold one); other control characters are not
      CHECK(c == '\t' || (static_cast<unsigned char>(c) >= 0x20 && c != 0x7f),
            "a problem that is not one line of text: " + text);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string file = "fuzz.yaml";
  const Loaded loaded = LoadText(text, file);
  CheckProblems(loaded, file, LineCount(text));
  if (!loaded.scenario) return 0;
  const Scenario& scenario = *loaded.scenario;
  CHECK(scenario.file == file);
  CheckScenario(scenario);
  const std::string broken = Check(scenario);  // the rules the runner applies (check.h)
  CHECK(broken.empty(), "the loader accepted a scenario check.h refuses: " + broken);

  const std::string written = Write(scenario);
  const Loaded again = LoadText(written, "again.yaml");
  if (!again.scenario) {
    std::string problems;
    for (const Problem& problem : again.problems) problems += problem.ToString() + "\n  ";
    Fail("a validated scenario, written back out, does not validate", problems + "written:\n" + written);
  }
  const std::string difference = Difference(scenario, *again.scenario);
  CHECK(difference.empty(), difference + " differs after a round trip; written:\n" + written);
  return 0;
}
