// Scenario files: the YAML tree (yaml.h) checked against the schema of docs/scenarios.md and resolved into the
// structs of scenario.h. Every problem names the file, the line, the dotted key and the value given, and says what
// is accepted. Checking goes on after a bad value (all problems in one run of `vgpu check`), but a check that
// needs a value that did not parse is skipped, so one mistake is reported once.
#include "vgpu/scenario/scenario.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <new>
#include <string_view>
#include <utility>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"
#include "fakecuda/state/faults.h"
#include "values.h"
#include "yaml.h"

namespace vgpu::scenario {
namespace {

using yaml::Node;
using yaml::Shown;

constexpr std::size_t kMaxProblems = 50;
constexpr std::size_t kMaxCollected = 1000;  // before sorting into file order; a bound on memory, not a limit
using limits::kMaxDurationNs;
using limits::kMaxMixedSizes;
using limits::kMaxProcessesInAll;
using limits::kMaxReplicas;
using limits::kMaxTenants;
using limits::kMinDurationNs;
static_assert(kMaxProcessesInAll == fakecuda::model::kMaxProcesses - 1, "limits.h: the fake machine's slots changed");
using limits::kMaxBlocks;
using limits::kMaxPhases;
using limits::kMaxProcessEntries;
using limits::kMaxProgramWordBytes;
using limits::kMaxProgramWords;
using limits::kMaxRate;
using limits::kMaxRealDevices;
constexpr std::uint64_t kMaxInFlight = limits::kMaxDepth;
static_assert(kMaxInFlight == fakecuda::model::kStreamDepth, "limits.h: the fake GPU's stream depth changed");
static_assert(limits::kMaxFakeDevices == fakecuda::model::kMaxDevices, "limits.h: the fake machine's devices changed");
constexpr double kMaxJitterPercent = limits::kMaxJitterPermille / 10.0;
constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::size_t kMaxReadBytes = 1 << 20;

std::string Join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string Index(const std::string& path, std::size_t index) { return path + "[" + std::to_string(index) + "]"; }

bool IsName(std::string_view name) { return limits::IsPlainName(name); }

// Edit distance, for "did you mean". Keys are short; longer text is not compared at all.
std::size_t Distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "no tenants", "1 tenant", "17 tenants".
std::string Count(std::size_t count, std::string_view one, std::string_view many) {
  if (count == 0) return "no " + std::string(many);
  return std::to_string(count) + " " + std::string(count == 1 ? one : many);
}

// Where to report something about a whole value (its count): its key's line, as a list's own line is its first
// item's.
std::uint32_t KeyLine(const Node& node) { return node.key_line != 0 ? node.key_line : node.line; }

std::string List(std::initializer_list<std::string_view> names) {
  std::string text;
  for (const std::string_view name : names) text += (text.empty() ? "" : ", ") + std::string(name);
  return text;
}

// A key that is valid one level elsewhere: where it belongs.
struct Misplaced {
  std::string_view prefix;  // the key, or a prefix of it ("nvidia.com/")
  std::string_view where;
};

constexpr Misplaced kMisplaced[] = {
    {"nvidia.com/", "under a tenant's limits:"},
    {"limits", "in a tenant (an item of tenants:)"},
    {"processes", "in a tenant (an item of tenants:)"},
    {"policy", "in a tenant (an item of tenants:)"},
    {"devices", "in a tenant (an item of tenants:)"},
    {"kernels", "in a phase (an item of a process's work:)"},
    {"idle", "in a phase (an item of a process's work:)"},
    {"depth", "in a phase (an item of a process's work:)"},
    {"rate", "in a phase (an item of a process's work:)"},
    {"blocks", "in a phase (an item of a process's work:)"},
    {"jitter", "in a phase (an item of a process's work:)"},
    {"collective", "in a phase (an item of a process's work:)"},
    {"ranks", "in a phase (an item of a process's work:)"},
    {"every", "in a phase (an item of a process's work:)"},
    {"replicas", "in a process (an item of a tenant's processes:)"},
    {"alloc", "in a process (an item of a tenant's processes:)"},
    {"crash_at", "in a process (an item of a tenant's processes:)"},
    {"program", "in a process (an item of a tenant's processes:)"},
    {"share", "in an expectation (an item of a tenant's expect:)"},
    {"min_share", "in an expectation (an item of a tenant's expect:)"},
    {"max_share", "in an expectation (an item of a tenant's expect:)"},
    {"tolerance", "in an expectation (an item of a tenant's expect:)"},
    {"oom", "in an expectation (an item of a tenant's expect:)"},
    {"leaked_bytes", "in the scenario's expect: (at the top level)"},
};

std::string UnknownKeyMessage(const std::string& key, std::initializer_list<std::string_view> accepted) {
  std::string message = "unknown key '" + key + "'";
  std::string_view best;
  std::size_t best_distance = 3;
  if (key.size() <= 40) {
    for (const std::string_view name : accepted) {
      const std::size_t distance = Distance(key, name);
      if (distance < best_distance && distance < name.size() / 2 + 1) best = name, best_distance = distance;
    }
  }
  if (!best.empty()) {
    message += "; did you mean '" + std::string(best) + "'?";
  } else {
    for (const Misplaced& m : kMisplaced) {
      if (key.compare(0, m.prefix.size(), m.prefix) == 0 && (m.prefix.back() == '/' || key == m.prefix)) {
        message += "; it belongs " + std::string(m.where);
        break;
      }
    }
  }
  return message + " (accepted here: " + List(accepted) + ")";
}

// Every key an expectation may have, in one place: as the braced list CheckMapping takes and as an array.
#define VGPU_EXPECTATION_KEYS "share", "tolerance", "worst_window", "from", "to", "min_share", "max_share", "oom"
constexpr std::string_view kExpectationKeys[] = {VGPU_EXPECTATION_KEYS};

// What later checks of a tenant may rely on: the parts that parsed. A check that needs a part that did not is
// skipped (its problem is reported already).
struct Known {
  bool gpu_count = true;   // limits' nvidia.com/gpu
  bool memory = true;      // limits' nvidia.com/gpumem
  bool devices = false;    // devices (and so the container's device count)
  bool processes = false;  // every process, with its start, stop and crash
};

class Checker {
 public:
  explicit Checker(const std::string& file) : file_(file) { scenario_.file = file; }

  Loaded Check(const yaml::Document& document) {
    problems_ = document.problems;
    if (document.complete) CheckDocument(document.root);
    std::stable_sort(problems_.begin(), problems_.end(),
                     [](const Problem& a, const Problem& b) { return a.line < b.line; });
    if (problems_.size() > kMaxProblems) problems_.resize(kMaxProblems);
    Loaded loaded;
    loaded.problems = std::move(problems_);
    if (loaded.problems.empty()) loaded.scenario = std::move(scenario_);
    return loaded;
  }

 private:
  void Add(std::uint32_t line, const std::string& key, std::string message) {
    if (problems_.size() < kMaxCollected) problems_.push_back(Problem{file_, line, key, std::move(message)});
  }

  // ---- readers: a value of a type, or a problem naming the value and what is accepted -----------------------------

  // Refuses keys a mapping does not take. False if `node` is not a mapping at all.
  bool CheckMapping(const Node& node, const std::string& path, std::initializer_list<std::string_view> accepted,
                    const std::string& what) {
    if (node.kind != Node::Kind::mapping) {
      Add(node.line, path,
          (node.kind == Node::Kind::null ? std::string("no value given") : "found " + Shown(node)) + "; expected " +
              what);
      return false;
    }
    for (const Node& entry : node.children) {
      const bool known = std::find(accepted.begin(), accepted.end(), entry.key) != accepted.end();
      if (!known) Add(entry.key_line, Join(path, entry.key), UnknownKeyMessage(entry.key, accepted));
    }
    return true;
  }

  // The items of a list (a null value is an empty list: `faults:` with its items commented out).
  const std::vector<Node>* Items(const Node& node, const std::string& path, const std::string& what) {
    static const std::vector<Node> kNone;
    if (node.kind == Node::Kind::sequence) return &node.children;
    if (node.kind == Node::Kind::null) return &kNone;
    Add(node.line, path, "found " + Shown(node) + "; expected " + what);
    return nullptr;
  }

  const std::string* Text(const Node& node, const std::string& path, const std::string& expected) {
    if (node.kind == Node::Kind::scalar) return &node.text;
    Add(node.line, path,
        (node.kind == Node::Kind::null ? std::string("no value given") : "found " + Shown(node)) + "; expected " +
            expected);
    return nullptr;
  }

  std::optional<std::uint64_t> Whole(const Node& node, const std::string& path, std::uint64_t min, std::uint64_t max,
                                     const std::string& accepted) {
    const std::string* text = Text(node, path, accepted);
    if (text == nullptr) return std::nullopt;
    std::uint64_t value = 0;
    if (!values::ParseWhole(*text, value)) {
      Add(node.line, path, Shown(node) + " is not a whole number; expected " + accepted);
      return std::nullopt;
    }
    if (value < min || value > max) {
      Add(node.line, path, Shown(node) + " is out of range; expected " + accepted);
      return std::nullopt;
    }
    return value;
  }

  // A percentage (30 or 30%), `min` .. 100.
  std::optional<double> Percent(const Node& node, const std::string& path, double min, double max,
                                const std::string& accepted) {
    const std::string* text = Text(node, path, accepted);
    if (text == nullptr) return std::nullopt;
    double value = 0;
    if (!values::ParsePercent(*text, value)) {
      Add(node.line, path, Shown(node) + " is not a percentage; expected " + accepted);
      return std::nullopt;
    }
    if (value < min || value > max) {
      Add(node.line, path, Shown(node) + " is out of range; expected " + accepted);
      return std::nullopt;
    }
    return value;
  }

  std::optional<std::uint64_t> Duration(const Node& node, const std::string& path, std::uint64_t min, std::uint64_t max,
                                        const std::string& example) {
    const std::string range = values::FormatDuration(min) + " .. " + values::FormatDuration(max);
    const std::string* text = Text(node, path, "a duration, " + range + " (e.g. " + example + ")");
    if (text == nullptr) return std::nullopt;
    std::uint64_t ns = 0;
    switch (values::ParseDuration(*text, ns)) {
      case values::DurationStatus::ok:
        break;
      case values::DurationStatus::malformed:
        Add(node.line, path, Shown(node) + " is not a duration; expected " + values::kDurationForms);
        return std::nullopt;
      case values::DurationStatus::no_unit:
        Add(node.line, path,
            Shown(node) + " has no unit; expected a number with ns, us, ms or s (e.g. " + *text + "s or " + *text +
                "ms)");
        return std::nullopt;
      case values::DurationStatus::finer_than_ns:
        Add(node.line, path, Shown(node) + " is not a whole number of nanoseconds; expected " + range);
        return std::nullopt;
      case values::DurationStatus::too_large:
        Add(node.line, path, Shown(node) + " is too long; expected " + range);
        return std::nullopt;
    }
    if (ns < min || ns > max) {
      const char* what = ns == 0 ? " is zero" : ns < min ? " is too short" : " is too long";
      Add(node.line, path, Shown(node) + what + "; expected " + range);
      return std::nullopt;
    }
    return ns;
  }

  // A size: bytes with a suffix, or a bare number of `bare_unit` bytes (MiB for nvidia.com/gpumem, as HAMi).
  std::optional<std::uint64_t> Size(const Node& node, const std::string& path, std::uint64_t bare_unit,
                                    const std::string& accepted) {
    const std::string* text = Text(node, path, accepted);
    if (text == nullptr) return std::nullopt;
    std::uint64_t value = 0;
    if (values::ParseWhole(*text, value)) {
      if (value > UINT64_MAX / bare_unit) {
        Add(node.line, path, Shown(node) + " is too large; expected " + accepted);
        return std::nullopt;
      }
      return value * bare_unit;
    }
    if (!values::ParseSize(*text, value)) {
      Add(node.line, path, Shown(node) + " is not a size; expected " + accepted);
      return std::nullopt;
    }
    return value;
  }

  std::optional<bool> Bool(const Node& node, const std::string& path) {
    const std::string* text = Text(node, path, "true or false");
    if (text == nullptr) return std::nullopt;
    if (*text == "true" || *text == "True" || *text == "TRUE") return true;
    if (*text == "false" || *text == "False" || *text == "FALSE") return false;
    Add(node.line, path, Shown(node) + " is not a boolean; expected true or false");
    return std::nullopt;
  }

  // The index of the value among `choices`.
  std::optional<std::size_t> Choice(const Node& node, const std::string& path,
                                    std::initializer_list<std::string_view> choices) {
    const std::string accepted = "one of " + List(choices);
    const std::string* text = Text(node, path, accepted);
    if (text == nullptr) return std::nullopt;
    const auto it = std::find(choices.begin(), choices.end(), *text);
    if (it == choices.end()) {
      Add(node.line, path, Shown(node) + " is not accepted; expected " + accepted);
      return std::nullopt;
    }
    return static_cast<std::size_t>(it - choices.begin());
  }

  // ---- the document -----------------------------------------------------------------------------------------------

  void CheckDocument(const Node& root) {
    if (root.kind == Node::Kind::null) {
      Add(1, "",
          "the file holds no scenario; expected a mapping with at least duration and tenants (docs/scenarios.md)");
      return;
    }
    if (!CheckMapping(root, "",
                      {"name", "description", "gpu", "timeslice", "switch", "mode", "duration", "settle", "window",
                       "sample", "seed", "sharing", "tenants", "expect", "faults"},
                      "a mapping of keys (name, gpu, duration, tenants, ...)")) {
      return;
    }
    root_line_ = root.line;
    CheckName(root.Find("name"));
    if (const Node* node = root.Find("description")) {
      if (node->kind != Node::Kind::null) {
        if (const std::string* text = Text(*node, "description", "one line of text")) scenario_.description = *text;
      }
    }
    CheckGpu(root.Find("gpu"));
    if (const Node* node = root.Find("timeslice")) CheckTimeslice(*node);
    if (const Node* node = root.Find("switch")) CheckSwitch(*node);
    CheckTimeline(root);
    if (const Node* node = root.Find("seed")) {
      if (auto seed = Whole(*node, "seed", 0, UINT64_MAX, "a whole number, 0 .. 2^64-1 (e.g. 1)")) {
        scenario_.seed = *seed;
      }
    }
    if (const Node* node = root.Find("sharing")) CheckSharing(*node);
    const Node* faults = root.Find("faults");
    CheckMode(root.Find("mode"),
              faults != nullptr && !(faults->kind == Node::Kind::null ||
                                     (faults->kind == Node::Kind::sequence && faults->children.empty())),
              HasPrograms(root.Find("tenants")));
    if (const Node* tenants = root.Find("tenants")) {
      CheckTenants(*tenants);
    } else {
      Add(root.line, "tenants", "missing; a scenario needs 1 .. 16 tenants (the containers)");
    }
    if (const Node* expect = root.Find("expect")) CheckRunExpectations(*expect);
    if (faults != nullptr) CheckFaults(*faults);
    if (scenario_.real_gpu) ResolveRealDevices();
  }

  void CheckName(const Node* node) {
    if (node != nullptr) {
      const std::string* text = Text(*node, "name", "letters, digits, '-', '_', '.' (e.g. thirty-seventy)");
      if (text == nullptr) return;
      if (!IsName(*text)) {
        Add(node->line, "name",
            Shown(*node) +
                " is not a scenario name; expected 1 .. 64 letters, digits, '-', '_', '.', not . or .. (e.g. "
                "thirty-seventy)");
        return;
      }
      scenario_.name = *text;
      return;
    }
    // The file's name without its directory and .yaml.
    std::string stem = file_.substr(file_.find_last_of('/') == std::string::npos ? 0 : file_.find_last_of('/') + 1);
    for (const std::string_view extension : {".yaml", ".yml"}) {
      if (stem.size() > extension.size() &&
          stem.compare(stem.size() - extension.size(), extension.size(), extension) == 0) {
        stem.resize(stem.size() - extension.size());
        break;
      }
    }
    if (stem.empty()) stem = "scenario";
    if (!IsName(stem)) {
      yaml::Node shown;
      shown.kind = Node::Kind::scalar;
      shown.text = stem;
      Add(root_line_, "name",
          "missing, and the file's name " + Shown(shown) +
              " is not a scenario name (letters, digits, '-', '_', '.'); add name: to the file");
      return;
    }
    scenario_.name = stem;
  }

  void CheckGpu(const Node* node) {
    if (node == nullptr) {
      ApplyFakeGpu(scenario_.gpu);
      return;
    }
    const std::string accepted = std::string("a fakecuda preset (") + fakecuda::model::PresetNames() +
                                 "), \"2xh100-80gb\" for two devices, or real (the machine's GPUs)";
    const std::string* text = Text(*node, "gpu", accepted);
    if (text == nullptr) return;
    if (*text == "real") {
      scenario_.gpu = "real";
      scenario_.real_gpu = true;
      scenario_.context_bytes = 0;
      device_count_known_ = false;
      return;
    }
    const std::string spec = DevicesSpec(*text);
    std::string error;
    if (!ApplyFakeGpu(spec, &error)) {
      // The model's message starts "FAKECUDA_DEVICES='...': "; the value is shown in ours already.
      const std::string prefix = "FAKECUDA_DEVICES='" + spec + "': ";
      if (error.compare(0, prefix.size(), prefix) == 0) error.erase(0, prefix.size());
      Add(node->line, "gpu", Shown(*node) + " is not a GPU: " + error + "; expected " + accepted);
      return;
    }
  }

  // "2xh100-80gb" as FAKECUDA_DEVICES spells it ("2*h100-80gb"); anything else unchanged.
  static std::string DevicesSpec(const std::string& text) {
    std::string spec;
    std::size_t start = 0;
    while (start <= text.size()) {
      const std::size_t comma = std::min(text.find(',', start), text.size());
      std::string item = text.substr(start, comma - start);
      std::size_t digits = 0;
      while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9') ++digits;
      if (digits > 0 && digits + 1 < item.size() && item[digits] == 'x') item[digits] = '*';
      spec += (start == 0 ? "" : ",") + item;
      start = comma + 1;
    }
    return spec;
  }

  bool ApplyFakeGpu(const std::string& spec, std::string* error = nullptr) {
    fakecuda::model::MachineConfig config{};
    std::string message;
    if (!fakecuda::model::ParseDevices(spec, config, message)) {
      if (error != nullptr) *error = message;
      device_count_known_ = false;
      return false;
    }
    scenario_.gpu = spec;
    scenario_.device_count = config.device_count;
    // One figure for the machine: device 0's. A mixed machine ("h100-80gb,tesla-t4") is rare in scenarios; the
    // runner can read each device's from the spec if it needs to.
    scenario_.context_bytes = config.devices[0].context_bytes;
    device_count_known_ = true;
    return true;
  }

  void CheckTimeslice(const Node& node) {
    auto ns = Duration(node, "timeslice", limits::kMinTimesliceNs, limits::kMaxTimesliceNs, "2100us");
    if (!ns) return;
    if (*ns % kMicrosecondNs != 0) {  // passed on as FAKECUDA_TIMESLICE_US
      Add(node.line, "timeslice", Shown(node) + " is not a whole number of microseconds; expected 1us .. 1s");
      return;
    }
    scenario_.timeslice_ns = *ns;
  }

  void CheckSharing(const Node& node) {
    const std::string* text = Text(node, "sharing", "limiter or time-division");
    if (text == nullptr) return;
    if (*text == "limiter") {
      scenario_.sharing = Sharing::limiter;
    } else if (*text == "time-division") {
      scenario_.sharing = Sharing::time_division;
    } else {
      Add(node.line, "sharing", Shown(node) + " is not a way of sharing; expected limiter or time-division");
    }
  }

  void CheckSwitch(const Node& node) {
    auto ns = Duration(node, "switch", 0, limits::kMaxSwitchNs, "160us");
    if (!ns) return;
    if (*ns % kMicrosecondNs != 0) {  // passed on as FAKECUDA_SWITCH_US
      Add(node.line, "switch", Shown(node) + " is not a whole number of microseconds; expected 0us .. 100ms");
      return;
    }
    scenario_.switch_ns = *ns;
  }

  // duration, settle, window, sample: each on its own, then how they fit together (the problem at the key the
  // user wrote; a default is named as such).
  void CheckTimeline(const Node& root) {
    const Node* duration = root.Find("duration");
    const Node* settle = root.Find("settle");
    const Node* window = root.Find("window");
    const Node* sample = root.Find("sample");
    std::optional<std::uint64_t> duration_ns, settle_ns = kSecondNs, window_ns = kSecondNs;
    std::optional<std::uint64_t> sample_ns = 100 * kMillisecondNs;
    if (duration == nullptr) {
      Add(root.line, "duration", "missing; a scenario needs its duration, 100ms .. 1h (e.g. duration: 6s)");
    } else {
      duration_ns = Duration(*duration, "duration", kMinDurationNs, kMaxDurationNs, "6s");
    }
    if (settle != nullptr) settle_ns = Duration(*settle, "settle", 0, kMaxDurationNs, "1s");
    if (window != nullptr) window_ns = Duration(*window, "window", kMillisecondNs, kMaxDurationNs, "1s");
    if (sample != nullptr) sample_ns = Duration(*sample, "sample", kMillisecondNs, 60 * kSecondNs, "100ms");
    if (settle_ns) scenario_.settle_ns = *settle_ns;
    if (window_ns) scenario_.window_ns = *window_ns;
    if (sample_ns) scenario_.sample_ns = *sample_ns;
    if (duration_ns) scenario_.duration_ns = *duration_ns;
    if (!duration_ns || !settle_ns || !window_ns || !sample_ns) return;
    const std::string window_text = values::FormatDuration(*window_ns) + (window ? "" : ", the default");
    bool fits = true;
    if (*duration_ns % *window_ns != 0) {
      fits = false;
      Add(duration->line, "duration",
          Shown(*duration) + " is not a whole number of windows; expected a multiple of window (" + window_text + ")");
    }
    if (*settle_ns % *window_ns != 0) {
      fits = false;
      if (settle != nullptr) {
        Add(settle->line, "settle",
            Shown(*settle) + " is not a whole number of windows; expected a multiple of window (" + window_text + ")");
      } else {
        Add(window->line, "window",
            Shown(*window) +
                " does not divide settle (1s, the default); expected a window that divides 1s, or set settle");
      }
    }
    if (*settle_ns >= *duration_ns) {
      fits = false;
      if (settle != nullptr) {
        Add(settle->line, "settle",
            Shown(*settle) + " leaves no window to judge; expected less than duration (" +
                values::FormatDuration(*duration_ns) + ")");
      } else {
        Add(duration->line, "duration",
            Shown(*duration) +
                " leaves no window to judge after settle (1s, the default); expected more than 1s, or set settle (e.g. "
                "settle: 0s)");
      }
    }
    if (*window_ns % *sample_ns != 0) {
      fits = false;
      if (window != nullptr) {
        Add(window->line, "window",
            Shown(*window) + " is not a whole number of samples; expected a multiple of sample (" +
                values::FormatDuration(*sample_ns) + (sample ? "" : ", the default") + ")");
      } else {
        Add(sample->line, "sample",
            Shown(*sample) +
                " does not divide window (1s, the default); expected a sample period that divides 1s, or set window");
      }
    }
    timeline_ok_ = fits;
  }

  // Whether some process of some tenant has a program: (looked at before the tenants are checked: it sets the modes).
  static bool HasPrograms(const Node* tenants) {
    if (tenants == nullptr || tenants->kind != Node::Kind::sequence) return false;
    for (const Node& tenant : tenants->children) {
      const Node* processes = tenant.kind == Node::Kind::mapping ? tenant.Find("processes") : nullptr;
      if (processes == nullptr || processes->kind != Node::Kind::sequence) continue;
      for (const Node& process : processes->children) {
        if (process.kind == Node::Kind::mapping && process.Find("program") != nullptr) return true;
      }
    }
    return false;
  }

  // Which modes the scenario is meant for. gpu: real exists only live; faults are not modelled in virtual time, so
  // a scenario with faults defaults to live (listing virtual anyway runs it there without them). A program runs as
  // a real process: live only, and virtual is refused.
  void CheckMode(const Node* node, bool has_faults, bool has_programs) {
    const bool live_only = scenario_.real_gpu || has_faults || has_programs;
    scenario_.virtual_mode = !live_only;
    scenario_.live_mode = true;
    if (node == nullptr) return;
    std::vector<const Node*> items;
    if (node->kind == Node::Kind::scalar) {
      items.push_back(node);
    } else if (const std::vector<Node>* list = Items(*node, "mode", "a list of virtual and/or live")) {
      for (const Node& item : *list) items.push_back(&item);
    } else {
      return;
    }
    if (items.empty()) {
      Add(KeyLine(*node), "mode", "the list is empty; expected [virtual], [live] or [virtual, live]");
      return;
    }
    bool virtual_mode = false, live_mode = false, ok = true;
    for (std::size_t i = 0; i < items.size(); ++i) {
      const std::string path = node->kind == Node::Kind::scalar ? "mode" : Index("mode", i);
      const auto choice = Choice(*items[i], path, {"virtual", "live"});
      if (!choice) {
        ok = false;
        continue;
      }
      bool& chosen = *choice == 0 ? virtual_mode : live_mode;
      if (chosen) Add(items[i]->line, path, Shown(*items[i]) + " is listed twice; expected each mode once");
      chosen = true;
      if (*choice == 0 && scenario_.real_gpu) {
        ok = false;
        Add(items[i]->line, path, "virtual with gpu: real; a real GPU runs live only (expected mode: [live])");
      } else if (*choice == 0 && has_programs) {
        ok = false;
        Add(items[i]->line, path,
            "virtual with program: processes; a program runs as a real process, live only (expected mode: [live])");
      }
    }
    if (!ok) return;
    scenario_.virtual_mode = virtual_mode;
    scenario_.live_mode = live_mode;
  }

  // ---- tenants ----------------------------------------------------------------------------------------------------

  void CheckTenants(const Node& node) {
    const std::vector<Node>* items = Items(node, "tenants", "a list of 1 .. 16 tenants ('- name: ...' items)");
    if (items == nullptr) return;
    if (items->empty() || items->size() > kMaxTenants) {
      Add(KeyLine(node), "tenants", Count(items->size(), "tenant", "tenants") + "; expected 1 .. 16 (the containers)");
      if (items->empty()) return;
    }
    std::uint64_t processes = 0;
    const std::size_t count = std::min(items->size(), kMaxTenants);
    for (std::size_t i = 0; i < count; ++i) {
      TenantSpec tenant;
      if (CheckTenant((*items)[i], Index("tenants", i), tenant)) {
        for (const ProcessSpec& process : tenant.processes) processes += process.replicas;
        scenario_.tenants.push_back(std::move(tenant));
      }
    }
    if (processes > kMaxProcessesInAll) {
      Add(node.key_line, "tenants",
          "the tenants start " + std::to_string(processes) + " processes (replicas counted); expected at most " +
              std::to_string(kMaxProcessesInAll) +
              " (the fake machine's process slots, one kept for the live runner's sampler)");
    }
  }

  // True if the tenant is whole (all its parts checked out).
  bool CheckTenant(const Node& node, const std::string& path, TenantSpec& tenant) {
    if (!CheckMapping(node, path, {"name", "limits", "policy", "devices", "processes", "expect"},
                      "a tenant (name:, limits:, processes:, ...)")) {
      return false;
    }
    const std::size_t problems_before = problems_.size();
    tenant.line = node.line;
    CheckTenantName(node, path, tenant);
    Known known;
    const Node* limits = node.Find("limits");
    if (limits != nullptr && limits->kind != Node::Kind::null) {
      known = CheckLimits(*limits, Join(path, "limits"), tenant);
    }
    if (const Node* policy = node.Find("policy")) {
      if (auto choice = Choice(*policy, Join(path, "policy"), {"force", "default", "disable"})) {
        tenant.policy = static_cast<Policy>(*choice);
      }
    }
    const bool gpu_given =
        limits != nullptr && limits->kind == Node::Kind::mapping && limits->Find("nvidia.com/gpu") != nullptr;
    known.devices = known.gpu_count && CheckDevices(node.Find("devices"), Join(path, "devices"), gpu_given, tenant);
    if (const Node* processes = node.Find("processes")) {
      known.processes = CheckProcesses(*processes, Join(path, "processes"), known.devices, tenant);
    } else {
      Add(node.line, Join(path, "processes"), "missing; a tenant needs 1 .. 16 processes ('- work: ...' items)");
    }
    if (const Node* expect = node.Find("expect")) CheckExpectations(*expect, Join(path, "expect"), known, tenant);
    return problems_.size() == problems_before;
  }

  void CheckTenantName(const Node& node, const std::string& path, TenantSpec& tenant) {
    const Node* name = node.Find("name");
    const std::string name_path = Join(path, "name");
    if (name == nullptr) {
      Add(node.line, name_path, "missing; every tenant needs a name (letters, digits, '-', '_', '.')");
      return;
    }
    const std::string* text = Text(*name, name_path, "letters, digits, '-', '_', '.' (e.g. a)");
    if (text == nullptr) return;
    if (!IsName(*text)) {
      Add(name->line, name_path,
          Shown(*name) +
              " is not a tenant name; expected 1 .. 64 letters, digits, '-', '_', '.', not . or .. (e.g. a)");
      return;
    }
    for (const auto& [other, line] : tenant_names_) {
      if (other == *text) {
        Add(name->line, name_path,
            Shown(*name) + " is the name of another tenant (line " + std::to_string(line) +
                "); expected a name used once");
        return;
      }
    }
    tenant_names_.emplace_back(*text, name->line);
    tenant.name = *text;
  }

  Known CheckLimits(const Node& node, const std::string& path, TenantSpec& tenant) {
    Known known;
    if (!CheckMapping(node, path, {"nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/priority"},
                      "the container's limits (nvidia.com/gpu:, nvidia.com/gpumem:, nvidia.com/gpucores:, ...)")) {
      known.gpu_count = known.memory = false;
      return known;
    }
    if (const Node* gpu = node.Find("nvidia.com/gpu")) {
      const std::uint64_t max = device_count_known_ ? scenario_.device_count : kMaxRealDevices;
      const std::string accepted = "1 .. " + std::to_string(max) + " devices" +
                                   (device_count_known_ ? " (gpu: " + scenario_.gpu + " has " + std::to_string(max) +
                                                              (max == 1 ? " device)" : " devices)")
                                                        : std::string());
      if (auto count = Whole(*gpu, Join(path, "nvidia.com/gpu"), 1, max, accepted)) {
        tenant.gpu_count = static_cast<std::uint32_t>(*count);
      } else {
        known.gpu_count = false;
      }
    }
    if (const Node* memory = node.Find("nvidia.com/gpumem")) {
      if (auto bytes = Size(*memory, Join(path, "nvidia.com/gpumem"), kMiB,
                            "MiB per device as a whole number (e.g. 4096), or a size with Ki, Mi, Gi, Ti or k, m, g, t "
                            "(e.g. 4Gi); 0 or absent: no memory limit")) {
        tenant.memory_limit_bytes = *bytes;
      } else {
        known.memory = false;
      }
    }
    if (const Node* cores = node.Find("nvidia.com/gpucores")) {
      const std::string cores_path = Join(path, "nvidia.com/gpucores");
      const std::string accepted = "an integer 1..100 (0 or absent: no compute limit)";
      if (auto percent = Percent(*cores, cores_path, 0, 100, accepted)) {
        if (*percent != static_cast<double>(static_cast<std::uint32_t>(*percent))) {
          Add(cores->line, cores_path, Shown(*cores) + " is not a whole percentage; expected " + accepted);
        } else {
          tenant.cores_percent = static_cast<std::uint32_t>(*percent);
        }
      }
    }
    if (const Node* priority = node.Find("nvidia.com/priority")) {
      if (auto value = Whole(*priority, Join(path, "nvidia.com/priority"), 0, 1, "0 (high) or 1 (low, the default)")) {
        tenant.priority = static_cast<std::uint32_t>(*value);
      }
    }
    return known;
  }

  // The physical devices; nvidia.com/gpu of them when both are given, else as many as listed. True if the tenant's
  // device count can be trusted (to check processes' devices against).
  bool CheckDevices(const Node* node, const std::string& path, bool gpu_given, TenantSpec& tenant) {
    if (node == nullptr || node->kind == Node::Kind::null) {
      for (std::uint32_t i = 0; i < tenant.gpu_count; ++i) tenant.devices.push_back(i);
      return true;
    }
    const std::uint64_t count = device_count_known_ ? scenario_.device_count : kMaxRealDevices;
    const std::string accepted = "a device index, 0 .. " + std::to_string(count - 1) +
                                 (device_count_known_ ? " (the devices of gpu: " + scenario_.gpu + ")" : "");
    std::vector<const Node*> items;
    if (node->kind == Node::Kind::scalar) {
      items.push_back(node);
    } else if (const std::vector<Node>* list = Items(*node, path, "a list of device indexes (e.g. [0, 1])")) {
      for (const Node& item : *list) items.push_back(&item);
    } else {
      return false;
    }
    if (items.empty() || items.size() > count) {
      Add(KeyLine(*node), path,
          Count(items.size(), "device", "devices") + " listed; expected 1 .. " + std::to_string(count));
      return false;
    }
    bool ok = true;
    for (std::size_t i = 0; i < items.size(); ++i) {
      const std::string item_path = node->kind == Node::Kind::scalar ? path : Index(path, i);
      auto index = Whole(*items[i], item_path, 0, count - 1, accepted);
      if (!index) {
        ok = false;
        continue;
      }
      if (std::find(tenant.devices.begin(), tenant.devices.end(), *index) != tenant.devices.end()) {
        Add(items[i]->line, item_path, Shown(*items[i]) + " is listed twice; expected each device once");
        ok = false;
        continue;
      }
      tenant.devices.push_back(static_cast<std::uint32_t>(*index));
    }
    if (!ok) return false;
    if (gpu_given && tenant.devices.size() != tenant.gpu_count) {
      Add(KeyLine(*node), path,
          std::to_string(tenant.devices.size()) + " devices listed, but nvidia.com/gpu is " +
              std::to_string(tenant.gpu_count) + "; expected as many devices as nvidia.com/gpu");
      return false;
    }
    tenant.gpu_count = static_cast<std::uint32_t>(tenant.devices.size());
    return true;
  }

  // ---- processes --------------------------------------------------------------------------------------------------

  // True if every process checked out.
  bool CheckProcesses(const Node& node, const std::string& path, bool devices_ok, TenantSpec& tenant) {
    const std::vector<Node>* items = Items(node, path, "a list of 1 .. 16 processes ('- work: ...' items)");
    if (items == nullptr) return false;
    if (items->empty() || items->size() > kMaxProcessEntries) {
      Add(KeyLine(node), path,
          Count(items->size(), "process", "processes") + "; expected 1 .. 16 (each may have replicas:)");
      if (items->empty()) return false;
    }
    const std::size_t count = std::min(items->size(), kMaxProcessEntries);
    bool whole = count == items->size();
    for (std::size_t i = 0; i < count; ++i) {
      ProcessSpec process;
      if (CheckProcess((*items)[i], Index(path, i), devices_ok, tenant, process)) {
        tenant.processes.push_back(std::move(process));
      } else {
        whole = false;
      }
    }
    return whole;
  }

  bool CheckProcess(const Node& node, const std::string& path, bool devices_ok, const TenantSpec& tenant,
                    ProcessSpec& process) {
    if (!CheckMapping(node, path,
                      {"replicas", "start", "stop", "crash_at", "device", "alloc", "work", "repeat", "program"},
                      "a process (work: or program:, start:, stop:, ...)")) {
      return false;
    }
    const std::size_t problems_before = problems_.size();
    process.line = node.line;
    if (const Node* replicas = node.Find("replicas")) {
      if (auto value = Whole(*replicas, Join(path, "replicas"), 1, kMaxReplicas, "1 .. 64 identical processes")) {
        process.replicas = static_cast<std::uint32_t>(*value);
      }
    }
    CheckProcessTimes(node, path, process);
    if (const Node* device = node.Find("device")) {
      const std::uint32_t count = tenant.gpu_count;
      const std::string accepted =
          count == 1 ? "0 (the container has one device)"
                     : "0 .. " + std::to_string(count - 1) + " (the container's " + std::to_string(count) + " devices)";
      const std::string device_path = Join(path, "device");
      if (devices_ok) {
        if (auto value = Whole(*device, device_path, 0, UINT32_MAX, accepted)) {
          if (*value >= count) {
            Add(device->line, device_path,
                Shown(*device) + " is not one of the container's devices; expected " + accepted);
          } else {
            process.device = static_cast<std::uint32_t>(*value);
          }
        }
      }
    }
    if (const Node* alloc = node.Find("alloc")) {
      if (auto bytes = Size(*alloc, Join(path, "alloc"), 1, std::string("bytes: ") + values::kSizeForms)) {
        process.alloc_bytes = *bytes;
      }
    }
    if (const Node* program = node.Find("program")) {
      CheckProgram(node, *program, path, process);
    } else if (const Node* work = node.Find("work")) {
      CheckWork(*work, Join(path, "work"), process);
    } else {
      Add(node.line, Join(path, "work"),
          "missing; a process needs its work: a list of phases (e.g. - kernels: 1ms), or a program: to run");
    }
    if (const Node* repeat = node.Find("repeat")) {
      if (auto value = Bool(*repeat, Join(path, "repeat"))) process.repeat = *value;
    }
    return problems_.size() == problems_before;
  }

  // program: [python3, train.py, --steps, "100"]: run instead of vgpu-tenant; alone, with none of work:'s keys.
  void CheckProgram(const Node& process_node, const Node& node, const std::string& process_path, ProcessSpec& process) {
    const std::string path = Join(process_path, "program");
    for (const char* other : {"work", "alloc", "repeat"}) {
      if (const Node* found = process_node.Find(other)) {
        Add(found->key_line, Join(process_path, other),
            std::string("given with program:; ") + other +
                ": belongs to a vgpu-tenant process (expected program: alone; a program allocates and loops as it "
                "does itself)");
      }
    }
    if (scenario_.real_gpu) {
      Add(node.key_line, path,
          "a program's GPU time is measured by the fake GPU, so it cannot run with gpu: real; expected work: phases, "
          "or a fakecuda gpu");
      return;
    }
    const std::vector<Node>* items =
        Items(node, path, "a list of the program and its arguments (e.g. [python3, train.py, --steps, \"100\"])");
    if (items == nullptr) return;
    if (items->empty() || items->size() > kMaxProgramWords) {
      Add(KeyLine(node), path,
          Count(items->size(), "word", "words") + "; expected 1 .. " + std::to_string(kMaxProgramWords) +
              " (the program, then its arguments)");
      if (items->empty()) return;
    }
    for (std::size_t i = 0; i < std::min(items->size(), kMaxProgramWords); ++i) {
      const std::string word_path = Index(path, i);
      const std::string* word = Text((*items)[i], word_path, "a word of the command line (quote it if need be)");
      if (word == nullptr) continue;
      if (word->empty() || word->size() > kMaxProgramWordBytes) {
        Add((*items)[i].line, word_path,
            Shown((*items)[i]) + " is " + std::to_string(word->size()) + " bytes; expected 1 .. " +
                std::to_string(kMaxProgramWordBytes));
        continue;
      }
      if (word->find('\0') != std::string::npos) {  // a command line's words are C strings
        Add((*items)[i].line, word_path, Shown((*items)[i]) + " holds a NUL byte; expected a word without one");
        continue;
      }
      process.program.push_back(*word);
    }
  }

  // start < stop <= duration, crash_at in [start, stop).
  void CheckProcessTimes(const Node& node, const std::string& path, ProcessSpec& process) {
    const Node* start = node.Find("start");
    const Node* stop = node.Find("stop");
    const Node* crash = node.Find("crash_at");
    const std::uint64_t end = scenario_.duration_ns != 0 ? scenario_.duration_ns : kMaxDurationNs;
    std::optional<std::uint64_t> start_ns = 0, stop_ns = end, crash_ns;
    if (start != nullptr) start_ns = Duration(*start, Join(path, "start"), 0, kMaxDurationNs, "0s");
    if (stop != nullptr) stop_ns = Duration(*stop, Join(path, "stop"), 1, kMaxDurationNs, "6s");
    if (crash != nullptr) crash_ns = Duration(*crash, Join(path, "crash_at"), 0, kMaxDurationNs, "3s");
    if (!start_ns || !stop_ns || (crash != nullptr && !crash_ns)) return;
    process.start_ns = *start_ns;
    process.stop_ns = *stop_ns;
    process.crash_at_ns = crash_ns;
    if (scenario_.duration_ns == 0) return;  // the duration did not parse: nothing to compare with
    const std::string duration_text = values::FormatDuration(scenario_.duration_ns);
    if (start != nullptr && *start_ns >= scenario_.duration_ns) {
      Add(start->line, Join(path, "start"),
          Shown(*start) + " is not before the end of the scenario; expected 0s .. less than duration (" +
              duration_text + ")");
      return;
    }
    if (stop != nullptr && (*stop_ns <= *start_ns || *stop_ns > scenario_.duration_ns)) {
      Add(stop->line, Join(path, "stop"),
          Shown(*stop) +
              (*stop_ns <= *start_ns ? " is not after start (" : " is after the end of the scenario (start ") +
              values::FormatDuration(*start_ns) + "); expected start < stop <= duration (" + duration_text + ")");
      return;
    }
    if (crash_ns && (*crash_ns < *start_ns || *crash_ns >= *stop_ns)) {
      Add(crash->line, Join(path, "crash_at"),
          Shown(*crash) + " is outside the process's life [start, stop) = [" + values::FormatDuration(*start_ns) +
              ", " + values::FormatDuration(*stop_ns) + "); expected a time in it");
    }
  }

  // ---- phases -----------------------------------------------------------------------------------------------------

  void CheckWork(const Node& node, const std::string& path, ProcessSpec& process) {
    const std::vector<Node>* items = Items(node, path, "a list of phases ('- kernels: 1ms' or '- idle: 1s' items)");
    if (items == nullptr) return;
    if (items->empty() || items->size() > kMaxPhases) {
      Add(KeyLine(node), path,
          Count(items->size(), "phase", "phases") + "; expected 1 .. " + std::to_string(kMaxPhases) +
              " (e.g. - kernels: 1ms)");
      if (items->empty()) return;
    }
    const std::size_t count = std::min(items->size(), kMaxPhases);
    for (std::size_t i = 0; i < count; ++i) {
      Phase phase;
      if (CheckPhase((*items)[i], Index(path, i), phase)) process.work.push_back(std::move(phase));
    }
  }

  bool CheckPhase(const Node& node, const std::string& path, Phase& phase) {
    if (!CheckMapping(node, path,
                      {"kernels", "idle", "for", "depth", "rate", "blocks", "jitter", "collective", "ranks", "every"},
                      "a phase (kernels: 1ms or idle: 1s, with for:, depth:, ...)")) {
      return false;
    }
    const std::size_t problems_before = problems_.size();
    phase.line = node.line;
    const Node* kernels = node.Find("kernels");
    const Node* idle = node.Find("idle");
    if ((kernels == nullptr) == (idle == nullptr)) {
      Add(node.line, path,
          kernels == nullptr ? "a phase needs kernels: (run kernels) or idle: (launch nothing)"
                             : "a phase has kernels: or idle:, not both; make them two phases");
      return false;
    }
    if (idle != nullptr) {
      phase.kind = Phase::Kind::idle;
      if (idle->kind == Node::Kind::null) {
        Add(idle->line, Join(path, "idle"),
            "no time given; an idle phase needs how long to launch nothing (e.g. idle: 1s)");
      } else if (auto ns = Duration(*idle, Join(path, "idle"), 1, kMaxDurationNs, "1s")) {
        phase.for_ns = *ns;
      }
      for (const Node& entry : node.children) {
        if (entry.key != "idle") {
          Add(entry.key_line, Join(path, entry.key),
              entry.key + " applies to kernels phases only; an idle phase is just its time (idle: 1s)");
        }
      }
      return problems_.size() == problems_before;
    }
    phase.kind = Phase::Kind::kernels;
    CheckKernelSizes(*kernels, Join(path, "kernels"), phase);
    CheckPhaseOptions(node, path, phase);
    return problems_.size() == problems_before;
  }

  void CheckKernelSizes(const Node& node, const std::string& path, Phase& phase) {
    const std::uint64_t min = kMicrosecondNs;
    if (node.kind != Node::Kind::sequence) {
      if (auto ns = Duration(node, path, min, kMaxDurationNs, "1ms")) phase.sizes_ns.push_back(*ns);
      return;
    }
    if (node.children.empty() || node.children.size() > kMaxMixedSizes) {
      Add(KeyLine(node), path,
          Count(node.children.size(), "size", "sizes") + "; expected 1 .. " + std::to_string(kMaxMixedSizes) +
              " kernel durations (e.g. [5us, 50us, 5ms])");
      return;
    }
    for (std::size_t i = 0; i < node.children.size(); ++i) {
      if (auto ns = Duration(node.children[i], Index(path, i), min, kMaxDurationNs, "50us")) {
        phase.sizes_ns.push_back(*ns);
      }
    }
  }

  void CheckPhaseOptions(const Node& node, const std::string& path, Phase& phase) {
    if (const Node* for_node = node.Find("for")) {
      if (auto ns = Duration(*for_node, Join(path, "for"), 1, kMaxDurationNs, "2s")) phase.for_ns = *ns;
    }
    if (const Node* depth = node.Find("depth")) {
      if (auto value = Whole(*depth, Join(path, "depth"), 1, kMaxInFlight,
                             "1 .. 128 kernels in flight (1 = launch, sync, launch)")) {
        phase.depth = static_cast<std::uint32_t>(*value);
      }
    }
    if (const Node* rate = node.Find("rate")) {
      const std::string accepted = "launches per second, 0.001 up to 1000000 (absent: a closed loop)";
      if (const std::string* text = Text(*rate, Join(path, "rate"), accepted)) {
        double value = 0;
        if (!values::ParseDecimal(*text, value)) {
          Add(rate->line, Join(path, "rate"), Shown(*rate) + " is not a number; expected " + accepted);
        } else if (value < limits::kMinRate || value > kMaxRate) {  // vgpu-tenant's and the runner's least rate
          Add(rate->line, Join(path, "rate"), Shown(*rate) + " is out of range; expected " + accepted);
        } else {
          phase.rate = value;
        }
      }
    }
    if (const Node* blocks = node.Find("blocks")) {
      if (auto value = Whole(*blocks, Join(path, "blocks"), 1, kMaxBlocks,
                             "1 .. 65535 blocks per kernel (132 on an H100 = one full wave)")) {
        phase.blocks = static_cast<std::uint32_t>(*value);
      }
    }
    CheckCollective(node, path, phase);
    if (const Node* jitter = node.Find("jitter")) {
      const std::string accepted = "a percentage 0 .. 50 in steps of 0.1 (e.g. 10%)";
      if (auto percent = Percent(*jitter, Join(path, "jitter"), 0, kMaxJitterPercent, accepted)) {
        const double permille = *percent * 10;
        const auto rounded = static_cast<std::uint32_t>(permille + 0.5);
        if (permille - rounded > 1e-9 || rounded - permille > 1e-9) {
          Add(jitter->line, Join(path, "jitter"), Shown(*jitter) + " is finer than 0.1%; expected " + accepted);
        } else {
          phase.jitter_permille = rounded;
        }
      }
    }
  }

  // collective: D with ranks: N (and every: K): a collective kernel among the tenant's ranks (Phase::collective_ns).
  void CheckCollective(const Node& node, const std::string& path, Phase& phase) {
    const Node* collective = node.Find("collective");
    const Node* ranks = node.Find("ranks");
    const Node* every = node.Find("every");
    if (collective == nullptr && ranks == nullptr && every == nullptr) return;
    if (collective == nullptr || ranks == nullptr) {
      Add(node.line, path,
          "a collective needs both collective: (its kernel's duration) and ranks: (how many "
          "processes, one per device), e.g. collective: 1ms, ranks: 2");
      return;
    }
    if (auto ns = Duration(*collective, Join(path, "collective"), kMicrosecondNs, kMaxDurationNs, "1ms")) {
      phase.collective_ns = *ns;
    }
    if (auto value = Whole(*ranks, Join(path, "ranks"), 2, fakecuda::model::kMaxDevices,
                           "2 .. 8 processes of the tenant, one per device")) {
      phase.ranks = static_cast<std::uint32_t>(*value);
    }
    if (every == nullptr) return;
    if (auto value = Whole(*every, Join(path, "every"), 1, kMaxInFlight, "1 .. 128 kernels between two collectives")) {
      phase.every = static_cast<std::uint32_t>(*value);
    }
  }

  // ---- expectations -----------------------------------------------------------------------------------------------

  void CheckExpectations(const Node& node, const std::string& path, const Known& known, TenantSpec& tenant) {
    const std::vector<Node>* items =
        Items(node, path, "a list of expectations ('- share: 30', '- max_share: 35', '- oom: true', ...)");
    if (items == nullptr) return;
    for (std::size_t i = 0; i < items->size(); ++i) {
      CheckExpectation((*items)[i], Index(path, i), known, tenant);
    }
  }

  void CheckExpectation(const Node& node, const std::string& path, const Known& known, TenantSpec& tenant) {
    if (!CheckMapping(node, path, {VGPU_EXPECTATION_KEYS},
                      "an expectation (share: 30, min_share: 90, max_share: 35, oom: true, ...)")) {
      return;
    }
    static constexpr std::string_view kKinds[] = {"share", "min_share", "max_share", "oom"};
    std::vector<std::string_view> kinds;
    for (const std::string_view kind : kKinds) {
      if (node.Find(kind) != nullptr) kinds.push_back(kind);
    }
    if (kinds.size() > 1) {
      Add(node.line, path,
          "one expectation has " + std::string(kinds[0]) + " and " + std::string(kinds[1]) +
              "; expected one of share, min_share, max_share, oom per '- ' item");
      return;
    }
    if (kinds.empty()) {
      if (node.Find("worst_window") != nullptr) {
        CheckStandaloneWorstWindow(node, path, tenant);
      } else {
        Add(node.line, path, "an expectation needs one of share, min_share, max_share, worst_window, oom");
      }
      return;
    }
    Expectation expectation;
    expectation.line = node.line;
    const std::string_view kind = kinds[0];
    if (kind == "oom") {
      CheckOomExpectation(node, path, known, tenant, expectation);
      return;
    }
    expectation.kind = kind == "share"       ? Expectation::Kind::share
                       : kind == "min_share" ? Expectation::Kind::min_share
                                             : Expectation::Kind::max_share;
    bool ok = kind == "share" ? RefuseOthers(node, path, kind, {"share", "tolerance", "worst_window", "from", "to"})
                              : RefuseOthers(node, path, kind, {kind, "from", "to"});
    const Node& target = *node.Find(kind);
    auto percent = Percent(target, Join(path, kind), 0, 100, "a percentage of the GPU's time, 0 .. 100 (e.g. 30)");
    ok = ok && percent.has_value();
    if (percent) expectation.percent = *percent;
    if (const Node* tolerance = node.Find("tolerance")) {
      auto points =
          Percent(*tolerance, Join(path, "tolerance"), 0, 100, "percentage points above 0, up to 100 (e.g. 2)");
      if (points && *points == 0) {
        Add(tolerance->line, Join(path, "tolerance"),
            Shown(*tolerance) + " is zero; expected percentage points above 0, up to 100 (e.g. 2)");
        points.reset();
      }
      ok = ok && points.has_value();
      expectation.tolerance_points = points;
    }
    if (const Node* worst = node.Find("worst_window")) {
      auto points = WorstWindow(*worst, Join(path, "worst_window"));
      ok = ok && points.has_value();
      expectation.worst_window_points = points;
    }
    ok = CheckPeriod(node, path, expectation) && ok;
    if (!ok) return;
    if (expectation.percent > 0 && kind != "max_share" && known.processes) {
      CheckRunsInPeriod(target, Join(path, kind), tenant, expectation);
    }
    tenant.expect.push_back(expectation);
  }

  // Keys of another kind of expectation in this one (unknown keys are reported by CheckMapping already).
  bool RefuseOthers(const Node& node, const std::string& path, std::string_view kind,
                    std::initializer_list<std::string_view> allowed) {
    bool ok = true;
    for (const Node& entry : node.children) {
      if (std::find(allowed.begin(), allowed.end(), entry.key) != allowed.end()) continue;
      if (std::find(std::begin(kExpectationKeys), std::end(kExpectationKeys), entry.key) ==
          std::end(kExpectationKeys)) {
        ok = false;
        continue;
      }
      Add(entry.key_line, Join(path, entry.key),
          entry.key + " does not go with " + std::string(kind) + "; accepted with " + std::string(kind) + ": " +
              List(allowed));
      ok = false;
    }
    return ok;
  }

  std::optional<double> WorstWindow(const Node& node, const std::string& path) {
    const std::string accepted = "percentage points above 0, up to 100 (e.g. 5)";
    auto points = Percent(node, path, 0, 100, accepted);
    if (points && *points == 0) {
      Add(node.line, path, Shown(node) + " is zero; expected " + accepted);
      return std::nullopt;
    }
    return points;
  }

  // `- worst_window: 5` as an item of its own bounds the share expectation before it (docs/scenarios.md).
  void CheckStandaloneWorstWindow(const Node& node, const std::string& path, TenantSpec& tenant) {
    if (!RefuseOthers(node, path, "worst_window", {"worst_window"})) return;
    const Node& worst = *node.Find("worst_window");
    auto points = WorstWindow(worst, Join(path, "worst_window"));
    if (!points) return;
    for (auto it = tenant.expect.rbegin(); it != tenant.expect.rend(); ++it) {
      if (it->kind == Expectation::Kind::share) {
        it->worst_window_points = points;
        return;
      }
    }
    Add(worst.key_line, Join(path, "worst_window"),
        "no share expectation before it in this list; worst_window bounds each window's distance from a share (put it "
        "after '- share: ...', or inside that item)");
  }

  void CheckOomExpectation(const Node& node, const std::string& path, const Known& known, TenantSpec& tenant,
                           Expectation& expectation) {
    if (!RefuseOthers(node, path, "oom", {"oom"})) return;
    const Node& oom = *node.Find("oom");
    auto value = Bool(oom, Join(path, "oom"));
    if (!value) return;
    const bool only_programs =
        known.processes && std::all_of(tenant.processes.begin(), tenant.processes.end(),
                                       [](const ProcessSpec& process) { return !process.program.empty(); });
    if (*value && only_programs) {
      Add(oom.line, Join(path, "oom"),
          "true, but every process of the tenant is a program, and a program's out-of-memory errors are its own "
          "(its exit status is checked instead); expected oom: false, or a work: process with alloc:");
      return;
    }
    if (*value && known.memory && tenant.memory_limit_bytes == 0) {
      Add(oom.line, Join(path, "oom"),
          "true, but the tenant has no memory limit, so nothing can run out of it; expected nvidia.com/gpumem under "
          "limits: (or oom: false)");
      return;
    }
    expectation.kind = Expectation::Kind::oom;
    expectation.oom = *value;
    expectation.from_ns = 0;
    expectation.to_ns = scenario_.duration_ns;
    tenant.expect.push_back(expectation);
  }

  // from/to: the judged windows start at or after max(settle, from) and end by `to`; at least one must fit.
  bool CheckPeriod(const Node& node, const std::string& path, Expectation& expectation) {
    const Node* from = node.Find("from");
    const Node* to = node.Find("to");
    std::optional<std::uint64_t> from_ns = 0, to_ns = scenario_.duration_ns;
    if (from != nullptr) from_ns = Duration(*from, Join(path, "from"), 0, kMaxDurationNs, "1s");
    if (to != nullptr) to_ns = Duration(*to, Join(path, "to"), 1, kMaxDurationNs, "6s");
    if (!from_ns || !to_ns) return false;
    expectation.from_ns = std::max(scenario_.settle_ns, *from_ns);
    expectation.to_ns = *to_ns;
    if (!timeline_ok_) return true;  // nothing reliable to compare with; the timeline's problem is reported
    const std::uint64_t window = scenario_.window_ns;
    if (to != nullptr && *to_ns > scenario_.duration_ns) {
      Add(to->line, Join(path, "to"),
          Shown(*to) + " is after the end of the scenario; expected at most duration (" +
              values::FormatDuration(scenario_.duration_ns) + ")");
      return false;
    }
    const std::uint64_t first = (expectation.from_ns + window - 1) / window * window;
    if (first + window > expectation.to_ns) {
      const Node* at = to != nullptr ? to : from != nullptr ? from : &node;
      const std::string key = to != nullptr ? Join(path, "to") : from != nullptr ? Join(path, "from") : path;
      Add(at == &node ? node.line : at->line, key,
          "the judged period [" + values::FormatDuration(expectation.from_ns) + ", " +
              values::FormatDuration(expectation.to_ns) +
              ") (from max(settle, from) to `to`) holds no whole window of " + values::FormatDuration(window) +
              "; expected a period of at least one window");
      return false;
    }
    return true;
  }

  // A share above 0 of a tenant none of whose processes runs in the judged period cannot be met.
  void CheckRunsInPeriod(const Node& target, const std::string& path, const TenantSpec& tenant,
                         const Expectation& expectation) {
    if (!timeline_ok_) return;
    for (const ProcessSpec& process : tenant.processes) {
      const std::uint64_t end = process.crash_at_ns.value_or(process.stop_ns);
      if (process.start_ns < expectation.to_ns && end > expectation.from_ns) return;
    }
    Add(target.line, path,
        Shown(target) + " cannot be met: no process of tenant '" + tenant.name + "' runs during the judged period [" +
            values::FormatDuration(expectation.from_ns) + ", " + values::FormatDuration(expectation.to_ns) +
            "); expected processes that run then (start:, stop:), or from:/to: around them");
  }

  // ---- the run as a whole -----------------------------------------------------------------------------------------

  void CheckRunExpectations(const Node& node) {
    if (node.kind == Node::Kind::null) return;
    if (!CheckMapping(node, "expect", {"leaked_bytes"}, "a mapping (leaked_bytes: 0)")) return;
    if (const Node* leaked = node.Find("leaked_bytes")) {
      if (auto bytes = Size(*leaked, "expect.leaked_bytes", 1, std::string("bytes: ") + values::kSizeForms)) {
        scenario_.expect_leaked_bytes = *bytes;
      }
    }
  }

  void CheckFaults(const Node& node) {
    const std::vector<Node>* items = Items(node, "faults", "a list of FAKECUDA_FAULTS rules, one per '- ' item");
    if (items == nullptr || items->empty()) return;
    if (scenario_.real_gpu) {
      Add(node.key_line, "faults",
          "faults are injected by fakecuda, so they cannot be with gpu: real; expected no faults, or a fakecuda gpu");
      return;
    }
    if (items->size() > fakecuda::faults::kMaxRules) {
      Add(KeyLine(node), "faults",
          std::to_string(items->size()) + " rules; expected at most " + std::to_string(fakecuda::faults::kMaxRules));
      return;
    }
    const std::string accepted =
        "a rule CALL:error=NAME[:prob=P][:after=N][:count=N][:delay_us=U] or CALL:delay_us=U (docs/fakecuda.md)";
    std::size_t total = 0;
    for (std::size_t i = 0; i < items->size(); ++i) {
      const Node& item = (*items)[i];
      const std::string path = Index("faults", i);
      const std::string* text = Text(item, path, accepted);
      if (text == nullptr) continue;
      total += text->size() + 1;
      if (text->find(';') != std::string::npos) {
        Add(item.line, path, Shown(item) + " holds more than one rule; expected one rule per '- ' item");
        continue;
      }
      // The rule parser's messages echo the rule as it is: an escaped line break ("cu\nInit") must not split the
      // problem into two lines (found by tests/fuzz/fuzz_scenario).
      if (std::any_of(text->begin(), text->end(),
                      [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
        Add(item.line, path, Shown(item) + " holds a control character; expected a rule of plain text");
        continue;
      }
      std::vector<fakecuda::faults::Rule> rules;
      std::string error;
      if (!fakecuda::faults::ParseRules(*text, rules, error) || rules.empty()) {
        // The parser names FAKECUDA_FAULTS and the rule; here the value is shown already.
        const std::size_t colon = error.find("': ");
        if (error.compare(0, 15, "FAKECUDA_FAULTS") == 0 && colon != std::string::npos) error.erase(0, colon + 3);
        Add(item.line, path,
            Shown(item) + " is not a fault rule: " + (error.empty() ? "it is empty" : error) + "; expected " +
                accepted);
        continue;
      }
      scenario_.faults.push_back(*text);
    }
    if (total > fakecuda::faults::kMaxFaultsTextBytes) {
      Add(node.key_line, "faults",
          "the rules take " + std::to_string(total) + " characters; expected at most " +
              std::to_string(fakecuda::faults::kMaxFaultsTextBytes) + " in all");
    }
  }

  // gpu: real has as many devices as the tenants use.
  void ResolveRealDevices() {
    std::uint32_t count = 1;
    for (const TenantSpec& tenant : scenario_.tenants) {
      for (const std::uint32_t device : tenant.devices) count = std::max(count, device + 1);
    }
    scenario_.device_count = count;
  }

  const std::string& file_;
  Scenario scenario_;
  std::vector<Problem> problems_;
  std::vector<std::pair<std::string, std::uint32_t>> tenant_names_;
  std::uint32_t root_line_ = 1;
  bool device_count_known_ = true;  // a fake GPU that parsed
  bool timeline_ok_ = false;        // duration, settle, window and sample parsed and fit together
};

Loaded OneProblem(const std::string& file, std::string message) {
  Loaded loaded;
  loaded.problems.push_back(Problem{file, 0, "", std::move(message)});
  return loaded;
}

}  // namespace

std::string Problem::ToString() const {
  return (file.empty() ? std::string("<scenario>") : file) + ":" + std::to_string(line) + ": " +
         (key.empty() ? "" : key + ": ") + message;
}

Loaded LoadText(const std::string& text, const std::string& file) {
  try {
    const yaml::Document document = yaml::Read(text, file);
    return Checker(file).Check(document);
  } catch (const std::bad_alloc&) {
    return OneProblem(file, "out of memory while checking the scenario");
  } catch (const std::exception& error) {
    return OneProblem(file, std::string("internal error while checking the scenario: ") + error.what());
  } catch (...) {
    return OneProblem(file, "internal error while checking the scenario");
  }
}

Loaded LoadFile(const std::string& path) {
  try {
    std::FILE* stream = std::fopen(path.c_str(), "rb");
    if (stream == nullptr) return OneProblem(path, "cannot read " + path + ": " + std::strerror(errno));
    std::string text;
    char buffer[65536];
    int error = 0;
    while (text.size() <= kMaxReadBytes) {
      const std::size_t got = std::fread(buffer, 1, sizeof buffer, stream);
      text.append(buffer, got);
      if (got < sizeof buffer) {
        if (std::ferror(stream)) error = errno;
        break;
      }
    }
    std::fclose(stream);
    if (error != 0) return OneProblem(path, "cannot read " + path + ": " + std::strerror(error));
    if (text.size() > kMaxReadBytes) {
      return OneProblem(
          path, "the file is larger than " + std::to_string(kMaxReadBytes) + " bytes; a scenario file is a few KiB");
    }
    return LoadText(text, path);
  } catch (const std::bad_alloc&) {
    return OneProblem(path, "out of memory while reading the scenario");
  } catch (...) {
    return OneProblem(path, "internal error while reading the scenario");
  }
}

const char* PolicyName(Policy policy) {
  switch (policy) {
    case Policy::force:
      return "force";
    case Policy::default_policy:
      return "default";
    case Policy::disable:
      return "disable";
  }
  return "?";
}

}  // namespace vgpu::scenario
