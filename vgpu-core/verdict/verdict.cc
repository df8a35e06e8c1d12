// The verdict's text format: docs/node-monitor.md, "The verdict".
#include "vgpu/verdict/verdict.h"
#include "vgpu/base/uuid.h"

#include <algorithm>
#include <array>
#include <cstdio>

namespace vgpu::verdict {
namespace {

constexpr std::string_view kHeader = "vgpu-verdict";
constexpr std::string_view kDeviceExample =
    "device GPU-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b memory_limit=4294967296 memory_used=1048576 sm_limit=300 "
    "sm_used=120";
constexpr std::string_view kProcessExample =
    "process 7 device=GPU-5f0c1a2b-3c4d-5e6f-7a8b-9c0d1e2f3a4b memory_used=1048576 sm_used=120";

bool IsHex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Decimal digits only, no sign, no leading zero unless "0", below 2^64.
bool ParseNumber(std::string_view text, std::uint64_t& value) {
  if (text.empty() || text.size() > 20 || (text.size() > 1 && text.front() == '0')) return false;
  std::uint64_t result = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (result > (UINT64_MAX - digit) / 10) return false;
    result = result * 10 + digit;
  }
  value = result;
  return true;
}

// One line's words, separated by single spaces (at most `max` of them; more: false).
bool Words(std::string_view line, std::vector<std::string_view>& words, std::size_t max) {
  words.clear();
  std::size_t start = 0;
  while (start <= line.size()) {
    const std::size_t space = line.find(' ', start);
    const std::size_t end = space == std::string_view::npos ? line.size() : space;
    if (end == start || words.size() == max) return false;  // an empty word: two spaces, or one at an end
    words.push_back(line.substr(start, end - start));
    start = end + 1;
  }
  return true;
}

// Printable, one-line, cut, in single quotes: for messages naming what a file said.
// Quoting here rather than with `"'" + ... + "'"` at each call also keeps GCC 12 quiet: a one-character literal
// prepended to a temporary std::string (basic_string::insert) makes it report a false -Wrestrict inside libstdc++
// at -O3 (GCC bugs 105329, 105651), which stopped the plain Release build under -Werror.
std::string Quoted(std::string_view text) {
  std::string out(1, '\'');
  for (const char c : text.substr(0, 80)) {
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out += c;
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", static_cast<unsigned char>(c));
      out += escaped;
    }
  }
  if (text.size() > 80) out += "...";
  out += '\'';
  return out;
}

// KEY=VALUE words after a line's head: each key of `keys` exactly once, numbers except `device`.
struct Fields {
  std::array<std::uint64_t, 4> numbers{};
  std::string_view device;
};

bool ParseFields(const std::vector<std::string_view>& words, std::size_t first,
                 const std::vector<std::string_view>& keys, Fields& fields, std::string& problem) {
  std::array<bool, 4> seen{};
  if (words.size() - first != keys.size()) {
    problem = "has " + std::to_string(words.size() - first) + " KEY=VALUE fields, needs " + std::to_string(keys.size());
    return false;
  }
  for (std::size_t i = first; i < words.size(); ++i) {
    const std::size_t equals = words[i].find('=');
    const std::string_view key = words[i].substr(0, equals);
    const auto known = std::find(keys.begin(), keys.end(), key);
    if (equals == std::string_view::npos || known == keys.end()) {
      problem = Quoted(words[i]) + " is not one of its KEY=VALUE fields";
      return false;
    }
    const auto k = static_cast<std::size_t>(known - keys.begin());
    if (seen[k]) {
      problem = "sets " + std::string(key) + " twice";
      return false;
    }
    seen[k] = true;
    const std::string_view value = words[i].substr(equals + 1);
    if (key == "device") {
      if (!IsDeviceUuid(value)) {
        problem = "device " + Quoted(value) + " is not a device UUID";
        return false;
      }
      fields.device = value;
    } else if (!ParseNumber(value, fields.numbers[k])) {
      problem = std::string(key) + " " + Quoted(value) + " is not a decimal number below 2^64";
      return false;
    } else if ((key == "sm_limit" || key == "sm_used") && fields.numbers[k] > 1000) {
      problem = std::string(key) + " " + std::string(value) + " is not a permille (0..1000)";
      return false;
    }
  }
  return true;
}

}  // namespace

const Device* Verdict::FindDevice(std::string_view uuid) const {
  for (const Device& device : devices) {
    if (device.uuid == uuid) return &device;
  }
  return nullptr;
}

const Process* Verdict::FindProcess(std::uint32_t pid, std::string_view device) const {
  for (const Process& process : processes) {
    if (process.pid == pid && process.device == device) return &process;
  }
  return nullptr;
}

bool IsDeviceUuid(std::string_view uuid) {
  std::string_view rest;
  if (uuid.substr(0, 4) == "GPU-" || uuid.substr(0, 4) == "MIG-") {
    rest = uuid.substr(4);
  } else {
    return false;
  }
  static constexpr std::array<std::size_t, 5> kGroups{8, 4, 4, 4, 12};
  std::size_t at = 0;
  for (std::size_t g = 0; g < kGroups.size(); ++g) {
    for (std::size_t i = 0; i < kGroups[g]; ++i, ++at) {
      if (at >= rest.size() || !IsHex(rest[at])) return false;
    }
    if (g + 1 < kGroups.size()) {
      if (at >= rest.size() || rest[at] != '-') return false;
      ++at;
    }
  }
  return at == rest.size();
}

std::string UuidText(const unsigned char bytes[16]) { return base::GpuUuidText(bytes); }

std::string Format(const Verdict& verdict) {
  std::string text = std::string(kHeader) + " " + std::to_string(kVersion) + "\n";
  text += "seq " + std::to_string(verdict.seq) + "\n";
  text += "stamp_ns " + std::to_string(verdict.stamp_ns) + "\n";
  for (const Device& d : verdict.devices) {
    text += "device " + d.uuid + " memory_limit=" + std::to_string(d.memory_limit) +
            " memory_used=" + std::to_string(d.memory_used) + " sm_limit=" + std::to_string(d.sm_limit) +
            " sm_used=" + std::to_string(d.sm_used) + "\n";
  }
  for (const Process& p : verdict.processes) {
    text += "process " + std::to_string(p.pid) + " device=" + p.device +
            " memory_used=" + std::to_string(p.memory_used) + " sm_used=" + std::to_string(p.sm_used) + "\n";
  }
  return text;
}

bool Parse(std::string_view text, Verdict& out, std::string& error) {
  const auto fail = [&](std::size_t line, const std::string& what, std::string_view example) {
    error = "verdict line " + std::to_string(line) + ": " + what + "; e.g. '" + std::string(example) + "'";
    return false;
  };
  if (text.size() > kMaxBytes) {
    error = "verdict: " + std::to_string(text.size()) + " bytes, more than a verdict holds (at most " +
            std::to_string(kMaxBytes) + ")";
    return false;
  }
  if (text.empty() || text.back() != '\n') {
    error = "verdict: does not end with a newline (cut short while written?); a verdict's every line ends with one";
    return false;
  }
  Verdict verdict;
  bool have_seq = false, have_stamp = false;
  std::vector<std::string_view> words;
  std::size_t line_number = 0;
  for (std::size_t start = 0; start < text.size();) {
    const std::size_t end = text.find('\n', start);
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    ++line_number;
    if (!Words(line, words, 6)) {
      return fail(line_number, Quoted(line) + " is not words separated by single spaces", "seq 42");
    }
    const std::string_view head = words[0];
    if (line_number == 1) {
      if (head != kHeader || words.size() != 2 || words[1] != std::to_string(kVersion)) {
        return fail(line_number,
                    Quoted(line) + " is not this reader's header (version " + std::to_string(kVersion) + ")",
                    "vgpu-verdict 1");
      }
      continue;
    }
    if (head == "seq" || head == "stamp_ns") {
      bool& have = head == "seq" ? have_seq : have_stamp;
      std::uint64_t& value = head == "seq" ? verdict.seq : verdict.stamp_ns;
      if (have) return fail(line_number, std::string(head) + " is given twice", "seq 42");
      if (words.size() != 2 || !ParseNumber(words[1], value)) {
        return fail(line_number, Quoted(line) + " is not " + std::string(head) + " and a decimal number",
                    head == "seq" ? "seq 42" : "stamp_ns 1795420000123456789");
      }
      have = true;
    } else if (head == "device") {
      if (words.size() < 2 || !IsDeviceUuid(words[1])) {
        return fail(line_number, "a device line must name a device UUID after 'device'", kDeviceExample);
      }
      if (verdict.FindDevice(words[1]) != nullptr) {
        return fail(line_number, "device " + std::string(words[1]) + " is listed twice", kDeviceExample);
      }
      if (verdict.devices.size() == kMaxDevices) {
        return fail(line_number, "more than " + std::to_string(kMaxDevices) + " devices", kDeviceExample);
      }
      Fields fields;
      std::string problem;
      if (!ParseFields(words, 2, {"memory_limit", "memory_used", "sm_limit", "sm_used"}, fields, problem)) {
        return fail(line_number, "the device line " + problem, kDeviceExample);
      }
      verdict.devices.push_back({std::string(words[1]), fields.numbers[0], fields.numbers[1],
                                 static_cast<std::uint32_t>(fields.numbers[2]),
                                 static_cast<std::uint32_t>(fields.numbers[3])});
    } else if (head == "process") {
      std::uint64_t pid = 0;
      if (words.size() < 2 || !ParseNumber(words[1], pid) || pid == 0 || pid > UINT32_MAX) {
        return fail(line_number, "a process line must name a pid (1 .. 4294967295) after 'process'", kProcessExample);
      }
      if (verdict.processes.size() == kMaxProcesses) {
        return fail(line_number, "more than " + std::to_string(kMaxProcesses) + " processes", kProcessExample);
      }
      Fields fields;
      std::string problem;
      if (!ParseFields(words, 2, {"device", "memory_used", "sm_used"}, fields, problem)) {
        return fail(line_number, "the process line " + problem, kProcessExample);
      }
      if (verdict.FindDevice(fields.device) == nullptr) {
        return fail(line_number,
                    "process " + std::to_string(pid) + " names device " + std::string(fields.device) +
                        ", which no device line above lists",
                    kProcessExample);
      }
      if (verdict.FindProcess(static_cast<std::uint32_t>(pid), fields.device) != nullptr) {
        return fail(line_number, "process " + std::to_string(pid) + " is listed twice on " + std::string(fields.device),
                    kProcessExample);
      }
      verdict.processes.push_back({static_cast<std::uint32_t>(pid), std::string(fields.device), fields.numbers[1],
                                   static_cast<std::uint32_t>(fields.numbers[2])});
    } else {
      return fail(line_number, Quoted(head) + " is not a verdict line (seq, stamp_ns, device, process)",
                  kDeviceExample);
    }
  }
  if (!have_seq || !have_stamp) {
    error = std::string("verdict: no ") + (have_seq ? "stamp_ns" : "seq") +
            " line; e.g. 'seq 42' and 'stamp_ns 1795420000123456789'";
    return false;
  }
  out = std::move(verdict);
  return true;
}

bool IsFresh(std::uint64_t stamp_ns, std::uint64_t now_ns) {
  return stamp_ns <= now_ns ? now_ns - stamp_ns <= kFreshNs : stamp_ns - now_ns <= kFreshNs;
}

}  // namespace vgpu::verdict
