// Fault injection: parsing FAKECUDA_FAULTS/FAKECUDA_SEED, the seeded generator, and the per-call check.
#include "fakecuda/state/faults.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "fakecuda/state/state.h"

namespace fakecuda::faults {
namespace {

constexpr std::uint64_t kGarbageSalt = 0x6761726261676521ull;  // "garbage!": garbage values draw apart from hits

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

bool IsIdentifier(std::string_view s) {
  if (s.empty()) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!letter && !(digit && i > 0)) return false;
  }
  return true;
}

bool IsErrorName(std::string_view s) {
  if (s.empty() || s.front() < 'A' || s.front() > 'Z') return false;
  for (const char c : s) {
    if (!((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.substr(0, prefix.size()) == prefix;
}

// Whole decimal numbers only: no sign, no spaces, no hex.
bool ParseWhole(std::string_view text, std::uint64_t& value) {
  if (text.empty()) return false;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  return result.ec == std::errc() && result.ptr == text.data() + text.size();
}

// "0", "1", "0.25", "1.0", ".5": a plain decimal fraction in [0, 1].
bool ParseProbability(std::string_view text, double& value) {
  if (text.empty()) return false;
  for (const char c : text) {
    if (!((c >= '0' && c <= '9') || c == '.')) return false;  // rejects signs, exponents, inf, nan
  }
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value, std::chars_format::fixed);
  return result.ec == std::errc() && result.ptr == text.data() + text.size() && value >= 0.0 && value <= 1.0;
}

// Message prefix naming the rule: "FAKECUDA_FAULTS rule 2 'cuMemAlloc_v2:prob=2'".
std::string RuleName(std::size_t number, std::string_view text) {
  return "FAKECUDA_FAULTS rule " + std::to_string(number) + " '" + std::string(text) + "'";
}

constexpr const char* kFormat =
    "accepted: CALL:error=NAME[:prob=P][:after=N][:count=N][:delay_us=U], CALL:delay_us=U or "
    "CALL:garbage[:prob=P][:after=N][:count=N][:delay_us=U], rules separated by ';'";
constexpr const char* kKeys = "accepted keys: error, prob, after, count, delay_us, and the flag garbage";

// Parses one non-empty rule; `number` is 1-based among the non-empty rules.
bool ParseRule(std::string_view text, std::size_t number, Rule& rule, std::string& error) {
  const std::string name = RuleName(number, text);
  rule = Rule{};
  rule.text = std::string(text);
  const auto first_colon = text.find(':');
  const std::string_view call = Trim(text.substr(0, first_colon));
  if (call != "*" && !IsIdentifier(call)) {
    error = name + ": CALL='" + std::string(call) + "' is not an exported symbol name or '*' (" + kFormat + ")";
    return false;
  }
  if (call.size() >= kMaxSymbolBytes) {
    error = name + ": CALL='" + std::string(call) + "' is longer than " + std::to_string(kMaxSymbolBytes - 1) +
            " characters";
    return false;
  }
  rule.symbol = std::string(call);
  bool seen_error = false, seen_prob = false, seen_after = false, seen_count = false, seen_delay = false;
  bool seen_garbage = false;
  std::string_view rest = first_colon == std::string_view::npos ? std::string_view{} : text.substr(first_colon + 1);
  while (first_colon != std::string_view::npos) {
    const auto colon = rest.find(':');
    const std::string_view field = Trim(rest.substr(0, colon));
    const auto equals = field.find('=');
    if (equals == std::string_view::npos && field == "garbage") {
      if (seen_garbage) {
        error = name + ": key 'garbage' is given twice (each key at most once per rule)";
        return false;
      }
      seen_garbage = true;
      rule.garbage = true;
      if (colon == std::string_view::npos) break;
      rest = rest.substr(colon + 1);
      continue;
    }
    if (equals == std::string_view::npos) {
      error = name + ": field '" + std::string(field) + "' is not key=value (" + kKeys + ")";
      return false;
    }
    const std::string_view key = Trim(field.substr(0, equals));
    const std::string_view value = Trim(field.substr(equals + 1));
    const std::string shown = std::string(key) + "='" + std::string(value) + "'";
    bool* seen = nullptr;
    if (key == "error") {
      seen = &seen_error;
      if (!IsErrorName(value) || !(StartsWith(value, "CUDA_ERROR_") || StartsWith(value, "NVML_ERROR_")) ||
          value.size() == std::string_view("CUDA_ERROR_").size()) {
        error = name + ": " + shown + " is not an error name (accepted: CUDA_ERROR_* or NVML_ERROR_*, " +
                "e.g. error=CUDA_ERROR_OUT_OF_MEMORY)";
        return false;
      }
      if (value.size() >= kMaxErrorNameBytes) {
        error = name + ": " + shown + " is longer than " + std::to_string(kMaxErrorNameBytes - 1) + " characters";
        return false;
      }
      rule.error = std::string(value);
    } else if (key == "prob") {
      seen = &seen_prob;
      if (!ParseProbability(value, rule.probability)) {
        error = name + ": " + shown + " is not a probability (accepted: a decimal in 0..1, e.g. prob=0.25)";
        return false;
      }
    } else if (key == "after" || key == "count") {
      const bool is_after = key == "after";
      seen = is_after ? &seen_after : &seen_count;
      std::uint64_t number_value = 0;
      const std::uint64_t lowest = is_after ? 0 : 1;
      if (!ParseWhole(value, number_value) || number_value < lowest || number_value > kMaxCallNumber) {
        error = name + ": " + shown + " is not a whole number of calls (accepted: " + std::to_string(lowest) + ".." +
                std::to_string(kMaxCallNumber) + ", e.g. " + std::string(key) + "=3)";
        return false;
      }
      (is_after ? rule.after : rule.count) = number_value;
    } else if (key == "delay_us") {
      seen = &seen_delay;
      if (!ParseWhole(value, rule.delay_us) || rule.delay_us > kMaxDelayUs) {
        error = name + ": " + shown + " is not a delay in microseconds (accepted: 0.." + std::to_string(kMaxDelayUs) +
                ", e.g. delay_us=5000)";
        return false;
      }
    } else {
      error = name + ": unknown key '" + std::string(key) + "' (" + kKeys + ")";
      return false;
    }
    if (*seen) {
      error = name + ": key '" + std::string(key) + "' is given twice (each key at most once per rule)";
      return false;
    }
    *seen = true;
    if (colon == std::string_view::npos) break;
    rest = rest.substr(colon + 1);
  }
  if (rule.garbage && !rule.error.empty()) {
    error = name + ": garbage and error=" + rule.error + " contradict each other (garbage makes the call succeed " +
            "with absurd outputs; error makes it fail): give one of them";
    return false;
  }
  if (rule.error.empty() && rule.delay_us == 0 && !rule.garbage) {
    error = name + ": the rule does nothing; give error=NAME, garbage, and/or delay_us=U above 0 (" + kFormat + ")";
    return false;
  }
  return true;
}

using vgpu::base::Mix64;

// A uniform draw in [0, 1) from the top 53 bits: exact for every double, and the same on every platform.
double UnitInterval(std::uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

}  // namespace

bool ParseRules(std::string_view text, std::vector<Rule>& rules, std::string& error) {
  if (text.size() > kMaxFaultsTextBytes) {
    error = "FAKECUDA_FAULTS is " + std::to_string(text.size()) + " characters long; at most " +
            std::to_string(kMaxFaultsTextBytes) + " are accepted";
    return false;
  }
  std::size_t number = 0;
  while (!text.empty()) {
    const auto semicolon = text.find(';');
    const std::string_view piece = Trim(text.substr(0, semicolon));
    text = semicolon == std::string_view::npos ? std::string_view{} : text.substr(semicolon + 1);
    if (piece.empty()) continue;
    ++number;
    if (rules.size() >= kMaxRules) {
      error = RuleName(number, piece) + ": more than " + std::to_string(kMaxRules) + " rules (at most " +
              std::to_string(kMaxRules) + " are accepted)";
      return false;
    }
    Rule rule;
    if (!ParseRule(piece, number, rule, error)) return false;
    rules.push_back(std::move(rule));
  }
  return true;
}

bool ParseSeed(std::string_view text, std::uint64_t& seed, std::string& error) {
  const std::string_view trimmed = Trim(text);
  if (!ParseWhole(trimmed, seed)) {
    error = "FAKECUDA_SEED='" + std::string(text) + "' is not a whole number (accepted: decimal 0.." +
            std::to_string(std::numeric_limits<std::uint64_t>::max()) + ", e.g. FAKECUDA_SEED=42)";
    return false;
  }
  return true;
}

bool Injector::Configure(const std::vector<Rule>& rules, std::uint64_t seed, const Library& library,
                         std::string& error) {
  rule_count_ = 0;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < rules.size() && i < kMaxRules; ++i) {
    const Rule& rule = rules[i];
    const std::string name = RuleName(i + 1, rule.text);
    const bool wildcard = rule.symbol == "*";
    const bool ours_by_symbol = !wildcard && StartsWith(rule.symbol, library.symbol_prefix);
    const bool ours_by_error = StartsWith(rule.error, library.error_prefix);
    if (wildcard && rule.garbage && library.garbage_capable == nullptr) continue;       // no getter here to spoil
    if (wildcard ? !(rule.error.empty() || ours_by_error) : !ours_by_symbol) continue;  // the other library's
    int code = 0;
    if (!rule.error.empty()) {
      if (!ours_by_error) {
        error = name + ": error='" + rule.error + "' is not an error of " + library.name +
                " (accepted: " + library.error_prefix + "* names for " + library.symbol_prefix + "* calls)";
        return false;
      }
      code = library.error_code_of != nullptr ? library.error_code_of(rule.error) : 0;
      if (code <= 0) {
        error = name + ": error='" + rule.error + "' is not an error " + library.name + " knows (accepted: the " +
                library.error_prefix + "* names of its header, e.g. " + library.error_prefix + "UNKNOWN)";
        return false;
      }
    }
    if (!wildcard && library.exports != nullptr && !library.exports(rule.symbol)) {
      error = name + ": CALL='" + rule.symbol + "' is not a function " + library.name +
              " exports (accepted: an exported symbol name, e.g. " + library.symbol_prefix + "Init, or '*')";
      return false;
    }
    if (rule.garbage && !wildcard && (library.garbage_capable == nullptr || !library.garbage_capable(rule.symbol))) {
      error = name + ": CALL='" + rule.symbol + "' cannot return garbage: " +
              (library.garbage_capable == nullptr
                   ? std::string(library.name) + " has no getter that does"
                   : "it is not one of " + std::string(library.name) + "'s getters that do") +
              " (accepted: the NVML getters listed in docs/fakecuda.md, 'Fault injection', or '*')";
      return false;
    }
    // The n-th rule with the same CALL hashes "CALL#n", so that duplicate rules draw independently.
    std::size_t same_call = 1;
    for (std::size_t j = 0; j < i; ++j) same_call += rules[j].symbol == rule.symbol ? 1 : 0;
    const std::string hashed = same_call == 1 ? rule.symbol : rule.symbol + "#" + std::to_string(same_call);

    Active& active = rules_[kept++];
    std::memset(active.symbol, 0, sizeof active.symbol);
    std::memcpy(active.symbol, rule.symbol.data(), std::min(rule.symbol.size(), kMaxSymbolBytes - 1));
    std::memset(active.error_name, 0, sizeof active.error_name);
    std::memcpy(active.error_name, rule.error.data(), std::min(rule.error.size(), kMaxErrorNameBytes - 1));
    active.number = i + 1;
    active.wildcard = wildcard;
    active.garbage = rule.garbage;
    active.error_code = code;
    active.probability = rule.probability;
    active.after = rule.after;
    active.count = rule.count;
    active.delay_us = rule.delay_us;
    active.generator_start = seed ^ Fnv1a64(hashed);
    active.calls.store(0, std::memory_order_relaxed);
    active.hits.store(0, std::memory_order_relaxed);
  }
  rule_count_ = kept;
  garbage_capable_ = library.garbage_capable;
  injected_.store(0, std::memory_order_relaxed);
  return true;
}

Outcome Injector::Evaluate(const char* symbol) {
  Outcome outcome;
  if (symbol == nullptr) return outcome;
  for (std::size_t i = 0; i < rule_count_; ++i) {
    Active& rule = rules_[i];
    if (!rule.wildcard && std::strcmp(rule.symbol, symbol) != 0) continue;
    // A '*' garbage rule matches only the calls that can return garbage (the others do not count).
    if (rule.wildcard && rule.garbage && (garbage_capable_ == nullptr || !garbage_capable_(symbol))) continue;
    const std::uint64_t call = rule.calls.fetch_add(1, std::memory_order_relaxed) + 1;
    if (call <= rule.after) continue;
    if (UnitInterval(SplitMix64At(rule.generator_start, call)) >= rule.probability) continue;
    // Claim one of the `count` hits; a lost race re-reads, so the limit holds exactly under threads.
    std::uint64_t hits = rule.hits.load(std::memory_order_relaxed);
    do {
      if (hits >= rule.count) break;
    } while (!rule.hits.compare_exchange_weak(hits, hits + 1, std::memory_order_relaxed));
    if (hits >= rule.count) continue;
    injected_.fetch_add(1, std::memory_order_relaxed);
    if (on_hit_ != nullptr) on_hit_(Hit{symbol, rule.number, call, rule.error_name, rule.delay_us, rule.garbage});
    if (rule.delay_us > 0) state::SleepNs(rule.delay_us * 1000);
    if (rule.error_code != 0) {
      outcome.error = rule.error_code;
      outcome.garbage = false;
      return outcome;
    }
    if (rule.garbage) {
      outcome.garbage = true;
      outcome.garbage_seed = Mix64(rule.generator_start ^ kGarbageSalt) ^ call;
    }
  }
  return outcome;
}

// ---- the process-wide injector -------------------------------------------------------------------------

namespace {

enum Status : std::uint32_t { kUnread = 0, kNoRules = 1, kRules = 2, kBad = 3 };

constinit Injector g_injector;
constinit std::atomic<std::uint32_t> g_status{kUnread};
constinit std::once_flag g_once;
constinit char g_error[1024] = {};
constinit char g_log_path[4096] = {};
constinit const char* g_library_name = "";

// Appends one JSON line per hit to FAKECUDA_FAULT_LOG (O_APPEND: lines of concurrent processes do not mix).
void RecordHit(const Hit& hit) {
  char line[512];
  const int length = std::snprintf(
      line, sizeof line,
      "{\"pid\":%d,\"library\":\"%s\",\"call\":\"%s\",\"rule\":%zu,\"n\":%llu,\"error\":\"%s\",\"delay_us\":%llu,"
      "\"garbage\":%s}\n",
      static_cast<int>(getpid()), g_library_name, hit.symbol, hit.rule, static_cast<unsigned long long>(hit.call),
      hit.error, static_cast<unsigned long long>(hit.delay_us), hit.garbage ? "true" : "false");
  if (length <= 0 || static_cast<std::size_t>(length) >= sizeof line) return;
  const int fd = open(g_log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t written = 0;
  do {
    written = write(fd, line, static_cast<std::size_t>(length));
  } while (written < 0 && errno == EINTR);
  close(fd);
}

void ReadEnvironment(const Library& library) {
  std::string error;
  std::vector<Rule> rules;
  std::uint64_t seed = kDefaultSeed;
  const char* faults = std::getenv("FAKECUDA_FAULTS");
  const char* seed_text = std::getenv("FAKECUDA_SEED");
  bool ok = faults == nullptr || ParseRules(faults, rules, error);
  if (ok && seed_text != nullptr && *seed_text != '\0') ok = ParseSeed(seed_text, seed, error);
  if (ok) ok = g_injector.Configure(rules, seed, library, error);
  const char* log_path = std::getenv("FAKECUDA_FAULT_LOG");
  if (ok && log_path != nullptr && *log_path != '\0') {
    if (std::strlen(log_path) >= sizeof g_log_path) {
      error = "FAKECUDA_FAULT_LOG is longer than " + std::to_string(sizeof g_log_path - 1) + " characters";
      ok = false;
    } else {
      std::snprintf(g_log_path, sizeof g_log_path, "%s", log_path);
      g_library_name = library.name;
      g_injector.set_on_hit(&RecordHit);
    }
  }
  if (!ok) {
    std::snprintf(g_error, sizeof g_error, "%s", error.c_str());
    state::LogError("%s: %s; %s will not initialize", library.name, g_error, library.name);
    g_status.store(kBad, std::memory_order_release);
    return;
  }
  if (g_injector.rule_count() > 0) {
    // One printed seed: this line is what repeats (or varies) the run.
    state::LogError("%s: fault injection on: %zu rule(s), FAKECUDA_SEED=%llu", library.name, g_injector.rule_count(),
                    static_cast<unsigned long long>(seed));
  }
  g_status.store(g_injector.rule_count() > 0 ? kRules : kNoRules, std::memory_order_release);
}

std::uint32_t EnsureRead(const Library& library) {
  std::uint32_t status = g_status.load(std::memory_order_acquire);
  if (status == kUnread) {
    std::call_once(g_once, ReadEnvironment, library);
    status = g_status.load(std::memory_order_acquire);
  }
  return status;
}

}  // namespace

bool Configured(const Library& library, std::string& error) {
  if (EnsureRead(library) != kBad) return true;
  error = g_error;
  return false;
}

int Check(const char* symbol, const Library& library) {
  if (g_status.load(std::memory_order_relaxed) == kNoRules) return 0;  // the common case: one load
  if (EnsureRead(library) != kRules) return 0;
  return g_injector.Check(symbol);
}

Outcome Evaluate(const char* symbol, const Library& library) {
  if (g_status.load(std::memory_order_relaxed) == kNoRules) return Outcome{};
  if (EnsureRead(library) != kRules) return Outcome{};
  return g_injector.Evaluate(symbol);
}

std::uint64_t InjectedCount() { return g_injector.injected(); }

}  // namespace fakecuda::faults
