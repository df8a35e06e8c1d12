// Fault injection for the fake libraries: FAKECUDA_FAULTS rules that make exported calls fail, slow down, or (NVML
// getters) succeed with garbage in their outputs, drawn from a seeded generator so that a run repeats exactly
// (docs/fakecuda.md, "Fault injection").
//
// How a library uses it:
//   1. Define one `Library` (its name, symbol and error prefixes, a lookup from error names to codes, and which of
//      its symbols can return garbage).
//   2. At the entry of every exported function: `if (int code = faults::Check("cuMemAlloc_v2", kLibrary)) return
//      static_cast<CUresult>(code);` -- before doing anything else, so a failed call has no effect. A library with
//      garbage-capable getters calls `faults::Evaluate` instead and, when `garbage` is set, overwrites the getter's
//      outputs after it has run.
//   3. In cuInit/nvmlInit: `if (!faults::Configured(kLibrary, error)) return <not initialized>;`.
//
// Rules (separated by ';'): CALL:error=NAME[:prob=P][:after=N][:count=N][:delay_us=U], CALL:delay_us=U for a slow
// call that still succeeds, or CALL:garbage[:prob=P][:after=N][:count=N][:delay_us=U] for an NVML getter that
// succeeds with absurd outputs. CALL is an exported symbol or '*'. Per rule, counting only the calls it matches:
// the first `after` calls are left alone; each later call is hit with probability `prob` (default 1); at most
// `count` calls are hit (default: no limit). A hit sleeps `delay_us`, then, if the rule names an error, makes the
// call return it; a garbage hit lets the call run and then replaces what it wrote. Rules are tried in order; the
// first one that injects an error ends the check, so later rules do not see that call.
//
// Determinism: rule r's k-th matching call draws the k-th output of a SplitMix64 generator started at
// FAKECUDA_SEED (default 1) XOR the FNV-1a hash of the rule's CALL text (the second rule with the same CALL
// hashes "CALL#2", the third "CALL#3", ...; '*' hashes "*"). The call number comes from an atomic counter, so
// which calls are hit does not depend on thread timing, only which thread makes the k-th call does. A garbage
// hit's values come from the same generator (GarbageSeed), so they repeat too.
//
// Scope: each fake library links its own copy of this layer, so rules, counters and InjectedCount are per
// library per process. A rule belongs to the library whose symbol prefix its CALL starts with; a '*' rule
// belongs to the library whose errors it names (a delay-only '*' rule to every library, a garbage '*' rule to the
// libraries with garbage-capable symbols, and it matches only those symbols).
//
// Record: with FAKECUDA_FAULT_LOG=PATH, every hit appends one JSON line to PATH (pid, library, call, rule, the
// call's number, error, delay, garbage), so that a test counts the faults that really happened.
//
// fork: the child inherits the configuration and the counters as they were at the fork and continues from
// there, so parent and child then draw the same sequence. The environment is read once per process (the
// child does not re-read it).
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/base/random.h"

namespace fakecuda::faults {

inline constexpr std::size_t kMaxRules = 32;
inline constexpr std::size_t kMaxSymbolBytes = 128;  // including the terminating NUL
inline constexpr std::size_t kMaxErrorNameBytes = 64;
inline constexpr std::size_t kMaxFaultsTextBytes = 4096;                   // longest FAKECUDA_FAULTS accepted
inline constexpr std::uint64_t kMaxCallNumber = 1'000'000'000'000'000ull;  // bound of `after` and `count`
inline constexpr std::uint64_t kMaxDelayUs = 10'000'000;                   // 10 s
inline constexpr std::uint64_t kUnlimited = std::numeric_limits<std::uint64_t>::max();
inline constexpr std::uint64_t kDefaultSeed = 1;

// One parsed rule, as written.
struct Rule {
  std::string text;                  // the rule as written, for messages
  std::string symbol;                // exported symbol name, or "*" for every symbol
  std::string error;                 // e.g. "CUDA_ERROR_OUT_OF_MEMORY"; empty for a delay-only rule
  double probability = 1.0;          // in [0, 1]
  std::uint64_t after = 0;           // matching calls left alone before the rule may hit
  std::uint64_t count = kUnlimited;  // most hits
  std::uint64_t delay_us = 0;        // sleep on a hit
  bool garbage = false;              // an NVML getter succeeds with absurd outputs
};

// Parses FAKECUDA_FAULTS text into `rules` (appending). Pure. Empty text and empty rules (";;") are
// allowed. On failure returns false and sets `error` to one line naming the rule, the field, the value and
// what is accepted; `rules` is then unspecified.
bool ParseRules(std::string_view text, std::vector<Rule>& rules, std::string& error);

// Parses FAKECUDA_SEED: decimal digits, 0..2^64-1.
bool ParseSeed(std::string_view text, std::uint64_t& seed, std::string& error);

// The generator (vgpu/base/random.h), named here so that tests and tools can reproduce a run's draws.
using vgpu::base::Fnv1a64;
using vgpu::base::SplitMix64At;

// What a fake library tells this layer about itself.
struct Library {
  const char* name;                             // "libcuda.so.1", for messages
  const char* symbol_prefix;                    // "cu" / "nvml": rules for such CALLs belong to it
  const char* error_prefix;                     // "CUDA_ERROR_" / "NVML_ERROR_"
  int (*error_code_of)(std::string_view name);  // the code (> 0) of an error name, or <= 0 if unknown
  bool (*exports)(std::string_view symbol);     // optional (may be null): is `symbol` exported
  // Optional (null: none): can `symbol` return garbage (a getter whose outputs the library knows how to spoil).
  bool (*garbage_capable)(std::string_view symbol) = nullptr;
};

// What a check decided for one call.
struct Outcome {
  int error = 0;                   // 0 or the error code the call must return
  bool garbage = false;            // the call runs, then its outputs are replaced (only when error is 0)
  std::uint64_t garbage_seed = 0;  // where the garbage values come from (SplitMix64At(garbage_seed, 1, 2, ...))
};

// One hit, as the record (FAKECUDA_FAULT_LOG) writes it.
struct Hit {
  const char* symbol;
  std::size_t rule;    // 1-based position of the rule in FAKECUDA_FAULTS
  std::uint64_t call;  // the rule's matching-call number that was hit (1-based)
  const char* error;   // the error's name, or "" for a delay or garbage rule
  std::uint64_t delay_us;
  bool garbage;
};

// The rules of one library with their counters. Constant-initializable (no allocation after Configure),
// so that the process-wide injector needs no constructor to run before the library's first call.
class Injector {
 public:
  constexpr Injector() = default;
  Injector(const Injector&) = delete;
  Injector& operator=(const Injector&) = delete;

  // Keeps the rules that belong to `library`, resolving their error names. Not thread-safe: call before
  // any Check. On failure (an unknown error name or symbol, an error of the other library) returns false,
  // sets `error`, and keeps no rule.
  bool Configure(const std::vector<Rule>& rules, std::uint64_t seed, const Library& library, std::string& error);

  // Thread-safe. Returns 0 (no fault) or the error code to return, after sleeping if a delay rule hit.
  int Check(const char* symbol) { return Evaluate(symbol).error; }
  // The same, with garbage: Outcome::garbage says a garbage rule hit and no rule injected an error.
  Outcome Evaluate(const char* symbol);
  // Called on every hit (before its delay), e.g. to record it; null: nothing. Set before any Check.
  void set_on_hit(void (*on_hit)(const Hit& hit)) { on_hit_ = on_hit; }

  std::size_t rule_count() const { return rule_count_; }
  std::uint64_t injected() const { return injected_.load(std::memory_order_relaxed); }

 private:
  struct Active {
    char symbol[kMaxSymbolBytes] = {};
    char error_name[kMaxErrorNameBytes] = {};
    std::size_t number = 0;  // 1-based position in the rules as given
    bool wildcard = false;
    bool garbage = false;
    int error_code = 0;  // 0: delay or garbage only
    double probability = 1.0;
    std::uint64_t after = 0;
    std::uint64_t count = kUnlimited;
    std::uint64_t delay_us = 0;
    std::uint64_t generator_start = 0;
    std::atomic<std::uint64_t> calls{0};  // matching calls so far
    std::atomic<std::uint64_t> hits{0};   // hits so far, never above `count`
  };
  Active rules_[kMaxRules] = {};
  std::size_t rule_count_ = 0;
  bool (*garbage_capable_)(std::string_view symbol) = nullptr;
  void (*on_hit_)(const Hit& hit) = nullptr;
  std::atomic<std::uint64_t> injected_{0};
};

// ---- the process-wide injector, configured from the environment ----------------------------------------

// Reads FAKECUDA_FAULTS and FAKECUDA_SEED on the first call (of these two functions), thread-safe. A bad
// value is printed on stderr once, at that moment; when rules are active, one line with the seed is printed
// so the run can be repeated. Returns false and sets `error` to the same message if the environment does
// not parse: the library's init function then fails.
bool Configured(const Library& library, std::string& error);

// Called at the entry of every exported function. With no rules this is one relaxed atomic load.
int Check(const char* symbol, const Library& library);
// The same for a function that can return garbage: the whole outcome.
Outcome Evaluate(const char* symbol, const Library& library);

// The `index`-th (1-based) garbage value of a hit: SplitMix64At(outcome.garbage_seed, index).
inline std::uint64_t GarbageValue(const Outcome& outcome, std::uint64_t index) {
  return SplitMix64At(outcome.garbage_seed, index);
}

// Faults (errors, delays, garbage) injected so far by this library's process-wide injector.
std::uint64_t InjectedCount();

}  // namespace fakecuda::faults
