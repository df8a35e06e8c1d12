// Unit tests of fault injection (fakecuda/state/faults.h): rule parsing, the seeded generator, the per-call
// check (probability, after/count, delay, garbage, '*'), the record of hits, and the process-wide injector read from
// the environment.
//
// CMake for tests/unit/CMakeLists.txt:
//   add_executable(faults_test faults_test.cc)
//   target_link_libraries(faults_test PRIVATE fakecuda_state GTest::gtest_main vgpu_warnings)
//   gtest_discover_tests(faults_test DISCOVERY_MODE PRE_TEST PROPERTIES LABELS unit)
#include "fakecuda/state/faults.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <cstdio>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace fakecuda::faults {
namespace {

int CudaErrorCode(std::string_view name) {
  if (name == "CUDA_ERROR_OUT_OF_MEMORY") return 2;
  if (name == "CUDA_ERROR_NOT_INITIALIZED") return 3;
  if (name == "CUDA_ERROR_UNKNOWN") return 999;
  return -1;
}

int NvmlErrorCode(std::string_view name) {
  if (name == "NVML_ERROR_TIMEOUT") return 10;
  if (name == "NVML_ERROR_UNKNOWN") return 999;
  return -1;
}

bool CudaExports(std::string_view symbol) {
  return symbol == "cuInit" || symbol == "cuMemAlloc_v2" || symbol == "cuLaunchKernel";
}

bool NvmlGarbageCapable(std::string_view symbol) {
  return symbol == "nvmlDeviceGetIndex" || symbol == "nvmlDeviceGetMemoryInfo";
}

constexpr Library kCuda{"libcuda.so.1", "cu", "CUDA_ERROR_", CudaErrorCode, CudaExports, nullptr};
constexpr Library kNvml{"libnvidia-ml.so.1", "nvml", "NVML_ERROR_", NvmlErrorCode, nullptr, NvmlGarbageCapable};

std::vector<Rule> Parse(std::string_view text) {
  std::vector<Rule> rules;
  std::string error;
  EXPECT_TRUE(ParseRules(text, rules, error)) << text << ": " << error;
  return rules;
}

std::string ParseError(std::string_view text) {
  std::vector<Rule> rules;
  std::string error;
  EXPECT_FALSE(ParseRules(text, rules, error)) << "accepted: " << text;
  return error;
}

// Configures `injector` (which must outlive the call) or fails the test.
void Configure(Injector& injector, std::string_view text, std::uint64_t seed, const Library& library = kCuda) {
  std::string error;
  ASSERT_TRUE(injector.Configure(Parse(text), seed, library, error)) << error;
}

std::vector<bool> HitSequence(std::string_view text, std::uint64_t seed, const char* symbol, int calls) {
  Injector injector;
  Configure(injector, text, seed);
  std::vector<bool> hits;
  hits.reserve(static_cast<std::size_t>(calls));
  for (int i = 0; i < calls; ++i) hits.push_back(injector.Check(symbol) != 0);
  return hits;
}

// ---- parsing ---------------------------------------------------------------------------------------------

TEST(ParseRules, TheDocumentedExample) {
  const auto rules =
      Parse("cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:prob=0.25;nvmlDeviceGetUtilizationRates:delay_us=5000");
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_EQ(rules[0].symbol, "cuMemAlloc_v2");
  EXPECT_EQ(rules[0].error, "CUDA_ERROR_OUT_OF_MEMORY");
  EXPECT_DOUBLE_EQ(rules[0].probability, 0.25);
  EXPECT_EQ(rules[0].after, 0u);
  EXPECT_EQ(rules[0].count, kUnlimited);
  EXPECT_EQ(rules[0].delay_us, 0u);
  EXPECT_EQ(rules[1].symbol, "nvmlDeviceGetUtilizationRates");
  EXPECT_EQ(rules[1].error, "");
  EXPECT_DOUBLE_EQ(rules[1].probability, 1.0);
  EXPECT_EQ(rules[1].delay_us, 5000u);
}

TEST(ParseRules, EveryFieldInAnyOrderWithSpaces) {
  const auto rules = Parse("  * : count=7 : delay_us=10 : after=3 : prob=1 : error=NVML_ERROR_UNKNOWN ;\n");
  ASSERT_EQ(rules.size(), 1u);
  EXPECT_EQ(rules[0].symbol, "*");
  EXPECT_EQ(rules[0].error, "NVML_ERROR_UNKNOWN");
  EXPECT_EQ(rules[0].count, 7u);
  EXPECT_EQ(rules[0].after, 3u);
  EXPECT_EQ(rules[0].delay_us, 10u);
  EXPECT_DOUBLE_EQ(rules[0].probability, 1.0);
}

TEST(ParseRules, ProbabilitySpellings) {
  EXPECT_DOUBLE_EQ(Parse("cuInit:error=CUDA_ERROR_UNKNOWN:prob=0")[0].probability, 0.0);
  EXPECT_DOUBLE_EQ(Parse("cuInit:error=CUDA_ERROR_UNKNOWN:prob=1.0")[0].probability, 1.0);
  EXPECT_DOUBLE_EQ(Parse("cuInit:error=CUDA_ERROR_UNKNOWN:prob=.5")[0].probability, 0.5);
  EXPECT_DOUBLE_EQ(Parse("cuInit:error=CUDA_ERROR_UNKNOWN:prob=0.125")[0].probability, 0.125);
}

TEST(ParseRules, EmptyTextAndEmptyRulesAreNoRules) {
  EXPECT_TRUE(Parse("").empty());
  EXPECT_TRUE(Parse(" ; ;\n").empty());
  EXPECT_EQ(Parse(";cuInit:error=CUDA_ERROR_UNKNOWN;;").size(), 1u);
}

TEST(ParseRules, GarbageIsAFlagThatCombinesWithEveryKeyButError) {
  const auto rules =
      Parse("nvmlDeviceGetSamples:garbage:prob=0.5:after=2:count=3:delay_us=7; nvmlDeviceGetIndex : garbage ");
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_TRUE(rules[0].garbage);
  EXPECT_EQ(rules[0].error, "");
  EXPECT_DOUBLE_EQ(rules[0].probability, 0.5);
  EXPECT_EQ(rules[0].after, 2u);
  EXPECT_EQ(rules[0].count, 3u);
  EXPECT_EQ(rules[0].delay_us, 7u);
  EXPECT_TRUE(rules[1].garbage);
  EXPECT_EQ(rules[1].symbol, "nvmlDeviceGetIndex");
  EXPECT_FALSE(Parse("cuInit:error=CUDA_ERROR_UNKNOWN")[0].garbage);
}

TEST(ParseRules, LimitsAreAccepted) {
  const auto rules = Parse(
      "cuInit:error=CUDA_ERROR_UNKNOWN:after=1000000000000000:count=1000000000000000:"
      "delay_us=10000000");
  ASSERT_EQ(rules.size(), 1u);
  EXPECT_EQ(rules[0].after, kMaxCallNumber);
  EXPECT_EQ(rules[0].count, kMaxCallNumber);
  EXPECT_EQ(rules[0].delay_us, kMaxDelayUs);
}

// Every message names the rule (number and text), the field and its value, and what is accepted.
struct BadRule {
  const char* text;
  std::vector<const char*> message_parts;
};

class ParseRulesRejects : public ::testing::TestWithParam<BadRule> {};

TEST_P(ParseRulesRejects, WithAMessageNamingRuleFieldValueAndWhatIsAccepted) {
  const std::string error = ParseError(GetParam().text);
  for (const char* part : GetParam().message_parts) {
    EXPECT_NE(error.find(part), std::string::npos) << "message '" << error << "' lacks '" << part << "'";
  }
}

INSTANTIATE_TEST_SUITE_P(
    EachKindOfBadRule, ParseRulesRejects,
    ::testing::Values(
        BadRule{"cu-Init:error=CUDA_ERROR_UNKNOWN",
                {"rule 1 'cu-Init:error=CUDA_ERROR_UNKNOWN'", "CALL='cu-Init'", "exported symbol name or '*'"}},
        BadRule{":error=CUDA_ERROR_UNKNOWN", {"rule 1", "CALL=''", "accepted"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN;cuInit:prob", {"rule 2 'cuInit:prob'", "field 'prob'", "key=value"}},
        BadRule{"cuInit:", {"rule 1 'cuInit:'", "field ''", "key=value"}},
        BadRule{"cuInit:errno=CUDA_ERROR_UNKNOWN",
                {"rule 1", "unknown key 'errno'",
                 "accepted keys: error, prob, after, count, delay_us, and the flag garbage"}},
        BadRule{"nvmlDeviceGetIndex:garbage=1", {"rule 1", "unknown key 'garbage'", "the flag garbage"}},
        BadRule{"nvmlDeviceGetIndex:garbage:garbage", {"key 'garbage' is given twice"}},
        BadRule{"nvmlDeviceGetIndex:garbage:error=NVML_ERROR_UNKNOWN",
                {"rule 1", "garbage and error=NVML_ERROR_UNKNOWN contradict each other"}},
        BadRule{"nvmlDeviceGetIndex:prob=0.5:count=2", {"does nothing", "garbage"}},
        BadRule{"cuInit:error=cuda_error_unknown",
                {"rule 1", "error='cuda_error_unknown'", "CUDA_ERROR_* or NVML_ERROR_*"}},
        BadRule{"cuInit:error=ENOMEM", {"error='ENOMEM'", "CUDA_ERROR_* or NVML_ERROR_*"}},
        BadRule{"cuInit:error=CUDA_ERROR_", {"error='CUDA_ERROR_'", "accepted"}},
        BadRule{"cuInit:error=CUDA_SUCCESS", {"error='CUDA_SUCCESS'", "accepted"}},
        BadRule{"cuInit:error=", {"error=''", "accepted"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:prob=1.5", {"rule 1", "prob='1.5'", "a decimal in 0..1"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:prob=-0.1", {"prob='-0.1'", "0..1"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:prob=1e-1", {"prob='1e-1'", "0..1"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:prob=nan", {"prob='nan'", "0..1"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:prob=0.2.5", {"prob='0.2.5'", "0..1"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:after=-1", {"after='-1'", "0..1000000000000000"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:after=3x", {"after='3x'", "whole number of calls"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:after=1000000000000001", {"after='1000000000000001'", "0.."}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:count=0", {"count='0'", "1..1000000000000000"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:count=99999999999999999999", {"count='99999999999999999999'", "1.."}},
        BadRule{"cuInit:delay_us=10000001", {"delay_us='10000001'", "0..10000000"}},
        BadRule{"cuInit:delay_us=0x10", {"delay_us='0x10'", "microseconds"}},
        BadRule{"cuInit:error=CUDA_ERROR_UNKNOWN:prob=0.5:prob=0.5", {"key 'prob' is given twice"}},
        BadRule{"cuInit", {"rule 1 'cuInit'", "does nothing", "error=NAME", "delay_us"}},
        BadRule{"cuInit:delay_us=0", {"does nothing"}}, BadRule{"cuInit:prob=0.5", {"does nothing"}}));

TEST(ParseRules, RejectsMoreThanTheMostRules) {
  std::string text;
  for (std::size_t i = 0; i <= kMaxRules; ++i) text += "cuInit:delay_us=1;";
  const std::string error = ParseError(text);
  EXPECT_NE(error.find("rule 33"), std::string::npos) << error;
  EXPECT_NE(error.find("at most 32"), std::string::npos) << error;
}

TEST(ParseRules, RejectsTooLongText) {
  const std::string text(kMaxFaultsTextBytes + 1, ';');
  const std::string error = ParseError(text);
  EXPECT_NE(error.find("4097 characters"), std::string::npos) << error;
  EXPECT_NE(error.find("at most 4096"), std::string::npos) << error;
}

TEST(ParseSeed, AcceptsDecimalAndRejectsTheRest) {
  std::uint64_t seed = 0;
  std::string error;
  ASSERT_TRUE(ParseSeed("18446744073709551615", seed, error)) << error;
  EXPECT_EQ(seed, 18446744073709551615ull);
  ASSERT_TRUE(ParseSeed("0", seed, error)) << error;
  EXPECT_EQ(seed, 0u);
  for (const char* bad : {"", "-1", "abc", "0x10", "18446744073709551616", "1 2"}) {
    error.clear();
    EXPECT_FALSE(ParseSeed(bad, seed, error)) << bad;
    EXPECT_NE(error.find(std::string("FAKECUDA_SEED='") + bad + "'"), std::string::npos) << error;
    EXPECT_NE(error.find("accepted: decimal 0..18446744073709551615"), std::string::npos) << error;
  }
}

// ---- configuring for one library ---------------------------------------------------------------------------

TEST(Configure, RejectsAnErrorNameTheLibraryDoesNotKnow) {
  Injector injector;
  std::string error;
  EXPECT_FALSE(injector.Configure(Parse("cuInit:error=CUDA_ERROR_NO_SUCH_THING"), 1, kCuda, error));
  EXPECT_NE(error.find("rule 1 'cuInit:error=CUDA_ERROR_NO_SUCH_THING'"), std::string::npos) << error;
  EXPECT_NE(error.find("not an error libcuda.so.1 knows"), std::string::npos) << error;
  EXPECT_EQ(injector.rule_count(), 0u);
}

TEST(Configure, RejectsTheOtherLibrarysErrorOnOwnSymbol) {
  Injector injector;
  std::string error;
  EXPECT_FALSE(injector.Configure(Parse("cuMemAlloc_v2:error=NVML_ERROR_UNKNOWN"), 1, kCuda, error));
  EXPECT_NE(error.find("error='NVML_ERROR_UNKNOWN' is not an error of libcuda.so.1"), std::string::npos) << error;
  EXPECT_NE(error.find("CUDA_ERROR_*"), std::string::npos) << error;
}

TEST(Configure, RejectsASymbolTheLibraryDoesNotExport) {
  Injector injector;
  std::string error;
  EXPECT_FALSE(injector.Configure(Parse("cuMemAloc_v2:error=CUDA_ERROR_UNKNOWN"), 1, kCuda, error));
  EXPECT_NE(error.find("CALL='cuMemAloc_v2' is not a function libcuda.so.1 exports"), std::string::npos) << error;
}

TEST(Configure, KeepsOnlyTheRulesOfItsLibrary) {
  const auto rules = Parse(
      "cuInit:error=CUDA_ERROR_UNKNOWN;nvmlInit_v2:error=NVML_ERROR_UNKNOWN;*:error=CUDA_ERROR_UNKNOWN;"
      "*:error=NVML_ERROR_TIMEOUT;*:delay_us=1");
  Injector cuda, nvml;
  std::string error;
  ASSERT_TRUE(cuda.Configure(rules, 1, kCuda, error)) << error;
  ASSERT_TRUE(nvml.Configure(rules, 1, kNvml, error)) << error;
  EXPECT_EQ(cuda.rule_count(), 3u);  // cuInit, * with a CUDA error, * delay
  EXPECT_EQ(nvml.rule_count(), 3u);  // nvmlInit_v2, * with an NVML error, * delay
  EXPECT_EQ(nvml.Check("nvmlDeviceGetCount_v2"), 10);
  EXPECT_EQ(cuda.Check("cuDeviceGet"), 999);
}

TEST(Configure, GarbageOnlyOnTheGettersThatCanReturnIt) {
  Injector injector;
  std::string error;
  EXPECT_FALSE(injector.Configure(Parse("nvmlDeviceGetName:garbage"), 1, kNvml, error));
  EXPECT_NE(error.find("CALL='nvmlDeviceGetName' cannot return garbage"), std::string::npos) << error;
  EXPECT_NE(error.find("not one of libnvidia-ml.so.1's getters"), std::string::npos) << error;
  error.clear();
  EXPECT_FALSE(injector.Configure(Parse("cuMemAlloc_v2:garbage"), 1, kCuda, error));
  EXPECT_NE(error.find("CALL='cuMemAlloc_v2' cannot return garbage: libcuda.so.1 has no getter that does"),
            std::string::npos)
      << error;
  error.clear();
  EXPECT_TRUE(injector.Configure(Parse("nvmlDeviceGetIndex:garbage"), 1, kNvml, error)) << error;
  EXPECT_EQ(injector.rule_count(), 1u);
}

TEST(Configure, AWildcardGarbageRuleBelongsToTheLibraryWithGetters) {
  const auto rules = Parse("*:garbage");
  Injector cuda, nvml;
  std::string error;
  ASSERT_TRUE(cuda.Configure(rules, 1, kCuda, error)) << error;
  ASSERT_TRUE(nvml.Configure(rules, 1, kNvml, error)) << error;
  EXPECT_EQ(cuda.rule_count(), 0u);
  EXPECT_EQ(nvml.rule_count(), 1u);
}

// ---- the generator -------------------------------------------------------------------------------------------

TEST(Generator, MatchesPublishedReferenceValues) {
  // SplitMix64 (Steele, Lea, Flood 2014) from state 0; FNV-1a 64 test vectors.
  EXPECT_EQ(SplitMix64At(0, 1), 0xe220a8397b1dcdafull);
  EXPECT_EQ(SplitMix64At(0, 2), 0x6e789e6aa1b965f4ull);
  EXPECT_EQ(SplitMix64At(0, 3), 0x06c45d188009454full);
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(Fnv1a64("foobar"), 0x85944171f73967e8ull);
}

TEST(Generator, HitsAreTheDocumentedDraws) {
  // Rule r's k-th call is hit when the k-th SplitMix64 output from seed ^ FNV-1a(CALL) is below prob.
  const std::uint64_t seed = 12345;
  const auto hits = HitSequence("cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:prob=0.3", seed, "cuMemAlloc_v2", 1000);
  const std::uint64_t start = seed ^ Fnv1a64("cuMemAlloc_v2");
  for (std::uint64_t k = 1; k <= hits.size(); ++k) {
    const double draw = static_cast<double>(SplitMix64At(start, k) >> 11) * 0x1.0p-53;
    ASSERT_EQ(hits[k - 1], draw < 0.3) << "call " << k;
  }
}

// ---- checks --------------------------------------------------------------------------------------------------

constexpr const char* kHalf = "cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:prob=0.5";

TEST(Check, SameSeedRepeatsTheSequence) {
  const auto first = HitSequence(kHalf, 42, "cuMemAlloc_v2", 10000);
  const auto second = HitSequence(kHalf, 42, "cuMemAlloc_v2", 10000);
  EXPECT_EQ(first, second);
}

TEST(Check, DifferentSeedGivesADifferentSequence) {
  const auto first = HitSequence(kHalf, 42, "cuMemAlloc_v2", 10000);
  const auto second = HitSequence(kHalf, 43, "cuMemAlloc_v2", 10000);
  EXPECT_NE(first, second);
}

TEST(Check, DuplicateRulesDrawIndependently) {
  Injector injector;
  Configure(injector, "cuInit:delay_us=1:prob=0.5;cuInit:error=CUDA_ERROR_UNKNOWN:prob=0.5", 1);
  // Were both rules drawn from the same stream, every delayed call would also fail and vice versa.
  int delayed_only = 0;
  for (int i = 0; i < 2000; ++i) {
    const std::uint64_t before = injector.injected();
    const int code = injector.Check("cuInit");
    if (code == 0 && injector.injected() > before) ++delayed_only;
  }
  EXPECT_GT(delayed_only, 300);
}

TEST(Check, QuarterProbabilityHitsAQuarterOfCalls) {
  const auto hits = HitSequence("cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:prob=0.25", 1, "cuMemAlloc_v2", 10000);
  const auto count = std::count(hits.begin(), hits.end(), true);
  EXPECT_GE(count, 2000);
  EXPECT_LE(count, 3000);
}

TEST(Check, ReturnsTheResolvedCode) {
  Injector injector;
  Configure(injector, "cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY", 1);
  EXPECT_EQ(injector.Check("cuMemAlloc_v2"), 2);
  EXPECT_EQ(injector.Check("cuInit"), 0);
  EXPECT_EQ(injector.Check("cuMemAlloc"), 0);  // exact names only: the _v2 suffix matters
  EXPECT_EQ(injector.Check(nullptr), 0);
  EXPECT_EQ(injector.injected(), 1u);
}

TEST(Check, AfterSkipsTheFirstCallsAndCountLimitsTheHits) {
  Injector injector;
  Configure(injector, "cuInit:error=CUDA_ERROR_UNKNOWN:after=3:count=2", 1);
  std::vector<int> codes;
  for (int i = 0; i < 8; ++i) codes.push_back(injector.Check("cuInit"));
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 999, 999, 0, 0, 0}));
  EXPECT_EQ(injector.injected(), 2u);
}

TEST(Check, CountsOnlyTheCallsARuleMatches) {
  Injector injector;
  Configure(injector, "cuInit:error=CUDA_ERROR_UNKNOWN:after=1", 1);
  EXPECT_EQ(injector.Check("cuMemAlloc_v2"), 0);
  EXPECT_EQ(injector.Check("cuMemAlloc_v2"), 0);
  EXPECT_EQ(injector.Check("cuInit"), 0);  // the first cuInit is still left alone
  EXPECT_EQ(injector.Check("cuInit"), 999);
}

TEST(Check, CountHoldsExactlyUnderThreads) {
  Injector injector;
  Configure(injector, "cuLaunchKernel:error=CUDA_ERROR_UNKNOWN:prob=0.5:count=100", 7);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 5000; ++i) {
        if (injector.Check("cuLaunchKernel") != 0) failures.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 100);
  EXPECT_EQ(injector.injected(), 100u);
}

TEST(Check, DelaySleepsAtLeastThatLongAndStillSucceeds) {
  Injector injector;
  Configure(injector, "cuInit:delay_us=2000", 1);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(injector.Check("cuInit"), 0);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(2000));
  EXPECT_EQ(injector.injected(), 1u);
}

TEST(Check, DelayThenError) {
  Injector injector;
  Configure(injector, "cuInit:error=CUDA_ERROR_UNKNOWN:delay_us=2000", 1);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(injector.Check("cuInit"), 999);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(2000));
}

TEST(Check, WildcardMatchesEverySymbol) {
  Injector injector;
  Configure(injector, "*:error=CUDA_ERROR_UNKNOWN:after=2", 1);
  EXPECT_EQ(injector.Check("cuInit"), 0);
  EXPECT_EQ(injector.Check("cuMemAlloc_v2"), 0);
  EXPECT_EQ(injector.Check("cuLaunchKernel"), 999);  // the wildcard counts calls of every symbol together
  EXPECT_EQ(injector.Check("cuStreamSynchronize"), 999);
}

TEST(Check, TheFirstErroringRuleEndsTheCheck) {
  Injector injector;
  Configure(injector, "cuInit:error=CUDA_ERROR_OUT_OF_MEMORY:count=1;*:error=CUDA_ERROR_UNKNOWN:count=1", 1);
  EXPECT_EQ(injector.Check("cuInit"), 2);
  EXPECT_EQ(injector.Check("cuInit"), 999);  // the '*' rule did not see the first call
  EXPECT_EQ(injector.Check("cuInit"), 0);
}

TEST(Evaluate, AGarbageHitSucceedsWithAnOutcomeOfItsOwn) {
  Injector injector;
  Configure(injector, "nvmlDeviceGetIndex:garbage:after=1:count=2", 5, kNvml);
  std::vector<Outcome> outcomes;
  for (int i = 0; i < 4; ++i) outcomes.push_back(injector.Evaluate("nvmlDeviceGetIndex"));
  EXPECT_FALSE(outcomes[0].garbage);
  EXPECT_TRUE(outcomes[1].garbage);
  EXPECT_TRUE(outcomes[2].garbage);
  EXPECT_FALSE(outcomes[3].garbage);
  for (const Outcome& outcome : outcomes) EXPECT_EQ(outcome.error, 0);
  EXPECT_NE(outcomes[1].garbage_seed, outcomes[2].garbage_seed);  // each hit its own values
  EXPECT_NE(GarbageValue(outcomes[1], 1), GarbageValue(outcomes[1], 2));
  EXPECT_EQ(injector.Check("nvmlDeviceGetMemoryInfo"), 0);  // another getter: not this rule's
  EXPECT_EQ(injector.injected(), 2u);
}

TEST(Evaluate, GarbageRepeatsFromTheSeed) {
  auto seeds = [](std::uint64_t seed) {
    Injector injector;
    Configure(injector, "nvmlDeviceGetMemoryInfo:garbage:prob=0.5", seed, kNvml);
    std::vector<std::uint64_t> values;
    for (int i = 0; i < 200; ++i) {
      const Outcome outcome = injector.Evaluate("nvmlDeviceGetMemoryInfo");
      values.push_back(outcome.garbage ? GarbageValue(outcome, 1) : 0);
    }
    return values;
  };
  EXPECT_EQ(seeds(9), seeds(9));
  EXPECT_NE(seeds(9), seeds(10));
}

TEST(Evaluate, AnErrorOfALaterRuleWinsOverGarbage) {
  Injector injector;
  Configure(injector, "nvmlDeviceGetIndex:garbage;nvmlDeviceGetIndex:error=NVML_ERROR_TIMEOUT:count=1", 1, kNvml);
  const Outcome first = injector.Evaluate("nvmlDeviceGetIndex");
  EXPECT_EQ(first.error, 10);
  EXPECT_FALSE(first.garbage);
  const Outcome second = injector.Evaluate("nvmlDeviceGetIndex");
  EXPECT_EQ(second.error, 0);
  EXPECT_TRUE(second.garbage);
}

TEST(Evaluate, AWildcardGarbageRuleCountsOnlyTheGetters) {
  Injector injector;
  Configure(injector, "*:garbage:after=1", 1, kNvml);
  EXPECT_FALSE(injector.Evaluate("nvmlInit_v2").garbage);         // not a getter: not counted
  EXPECT_FALSE(injector.Evaluate("nvmlDeviceGetIndex").garbage);  // the first getter call: left alone
  EXPECT_FALSE(injector.Evaluate("nvmlShutdown").garbage);
  EXPECT_TRUE(injector.Evaluate("nvmlDeviceGetMemoryInfo").garbage);
}

std::vector<std::string> g_recorded;
void RecordForTest(const Hit& hit) {
  g_recorded.push_back(std::string(hit.symbol) + " rule " + std::to_string(hit.rule) + " call " +
                       std::to_string(hit.call) + " error '" + hit.error + "' delay " + std::to_string(hit.delay_us) +
                       (hit.garbage ? " garbage" : ""));
}

TEST(Evaluate, EveryHitIsReportedWithItsRuleAndCallNumber) {
  g_recorded.clear();
  Injector injector;
  Configure(injector, "cuInit:delay_us=1:after=1:count=1;cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:after=2", 1);
  injector.set_on_hit(&RecordForTest);
  for (int i = 0; i < 3; ++i) {
    injector.Check("cuInit");
    injector.Check("cuMemAlloc_v2");
  }
  EXPECT_EQ(g_recorded,
            (std::vector<std::string>{"cuInit rule 1 call 2 error '' delay 1",
                                      "cuMemAlloc_v2 rule 2 call 3 error 'CUDA_ERROR_OUT_OF_MEMORY' delay 0"}));
}

TEST(Check, ProbabilityZeroNeverHits) {
  const auto hits = HitSequence("cuInit:error=CUDA_ERROR_UNKNOWN:prob=0", 1, "cuInit", 10000);
  EXPECT_EQ(std::count(hits.begin(), hits.end(), true), 0);
}

// ---- the process-wide injector (each test in a child process: the environment is read once) ------------

TEST(ProcessWide, NoEnvironmentMeansNoFaults) {
  EXPECT_EXIT(
      {
        unsetenv("FAKECUDA_FAULTS");
        unsetenv("FAKECUDA_SEED");
        std::string error;
        bool ok = Configured(kCuda, error) && error.empty();
        for (int i = 0; i < 1000; ++i) ok = ok && Check("cuMemAlloc_v2", kCuda) == 0;
        exit(ok && InjectedCount() == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(ProcessWide, ReadsRulesAndSeedAndPrintsTheSeed) {
  EXPECT_EXIT(
      {
        setenv("FAKECUDA_FAULTS", "cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:after=1:count=1", 1);
        setenv("FAKECUDA_SEED", "77", 1);
        const bool first_ok = Check("cuMemAlloc_v2", kCuda) == 0;  // the first call reads the environment
        std::string error;
        const bool configured = Configured(kCuda, error);
        const bool second_fails = Check("cuMemAlloc_v2", kCuda) == 2;
        const bool third_ok = Check("cuMemAlloc_v2", kCuda) == 0;
        exit(first_ok && configured && second_fails && third_ok && InjectedCount() == 1 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "libcuda.so.1: fault injection on: 1 rule\\(s\\), FAKECUDA_SEED=77");
}

TEST(ProcessWide, ABadRuleFailsConfiguredAndIsPrinted) {
  EXPECT_EXIT(
      {
        setenv("FAKECUDA_FAULTS", "cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:prob=2", 1);
        std::string error;
        const bool configured = Configured(kCuda, error);
        const bool named = error.find("prob='2'") != std::string::npos;
        exit(!configured && named && Check("cuMemAlloc_v2", kCuda) == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "prob='2' is not a probability.*will not initialize");
}

TEST(ProcessWide, ABadSeedFailsConfigured) {
  EXPECT_EXIT(
      {
        setenv("FAKECUDA_FAULTS", "cuInit:error=CUDA_ERROR_UNKNOWN", 1);
        setenv("FAKECUDA_SEED", "seven", 1);
        std::string error;
        exit(!Configured(kCuda, error) && error.find("FAKECUDA_SEED='seven'") != std::string::npos ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "FAKECUDA_SEED='seven'");
}

TEST(ProcessWide, TheFaultLogHasOneLinePerHit) {
  const std::string path = ::testing::TempDir() + "faults_test_log_" + std::to_string(getpid()) + ".jsonl";
  std::remove(path.c_str());
  EXPECT_EXIT(
      {
        setenv("FAKECUDA_FAULTS", "cuMemAlloc_v2:error=CUDA_ERROR_OUT_OF_MEMORY:after=1:count=2", 1);
        setenv("FAKECUDA_FAULT_LOG", path.c_str(), 1);
        for (int i = 0; i < 5; ++i) Check("cuMemAlloc_v2", kCuda);
        exit(InjectedCount() == 2 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  std::FILE* file = std::fopen(path.c_str(), "r");
  ASSERT_NE(file, nullptr) << path;
  std::vector<std::string> lines;
  char buffer[1024];
  while (std::fgets(buffer, sizeof buffer, file) != nullptr) lines.emplace_back(buffer);
  std::fclose(file);
  std::remove(path.c_str());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("\"library\":\"libcuda.so.1\",\"call\":\"cuMemAlloc_v2\",\"rule\":1,\"n\":2,"
                          "\"error\":\"CUDA_ERROR_OUT_OF_MEMORY\",\"delay_us\":0,\"garbage\":false}"),
            std::string::npos)
      << lines[0];
  EXPECT_NE(lines[1].find("\"n\":3,"), std::string::npos) << lines[1];
  EXPECT_EQ(lines[0].rfind("{\"pid\":", 0), 0u) << lines[0];
}

TEST(ProcessWide, CountersContinueInAForkChild) {
  EXPECT_EXIT(
      {
        setenv("FAKECUDA_FAULTS", "cuInit:error=CUDA_ERROR_UNKNOWN:after=2:count=1", 1);
        const bool first_two_ok = Check("cuInit", kCuda) == 0 && Check("cuInit", kCuda) == 0;
        const pid_t child = fork();
        if (child == 0) _exit(Check("cuInit", kCuda) == 999 ? 0 : 1);  // the child's third call is hit too
        int status = 0;
        waitpid(child, &status, 0);
        const bool parent_hit = Check("cuInit", kCuda) == 999;
        exit(first_two_ok && WIFEXITED(status) && WEXITSTATUS(status) == 0 && parent_hit ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace fakecuda::faults
