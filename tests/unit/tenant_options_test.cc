// vgpu-tenant's numbers and durations (sim/tenant/options.h): what each accepts, and the message for what it refuses.
#include "options.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "vgpu/base/duration.h"

namespace vgpu::tenant {
namespace {

// A duration reads on vgpu-tenant's command line as in a scenario file (one grammar, vgpu/base/duration.h). Before
// it did, the tenant read through a double: it took "1e3us" and "1.0000000005s" (rounded) and refused "010ms",
// which a scenario file reads as ten milliseconds.
TEST(TenantOptions, DurationsReadAsAScenarioFileReadsThem) {
  for (const char* text : {"1.5s", "200ms", "5us", "7ns", "010ms", "0.000000001s", "18446744073709551615ns", "1e3us",
                           "1.0000000005s", "1.s", ".5s", "18446744073709551616ns", "2m"}) {
    std::uint64_t expected = 0;
    const bool valid = base::ParseDuration(text, expected) == base::DurationStatus::ok;
    std::string problem;
    const std::optional<std::uint64_t> ns = ParseDurationNs(text, &problem);
    EXPECT_EQ(ns.has_value(), valid) << text << ": " << problem;
    EXPECT_EQ(ns.value_or(0), valid ? expected : 0) << text;
    EXPECT_EQ(problem.empty(), ns.has_value()) << text;
  }
  std::string problem;
  EXPECT_EQ(ParseDurationNs("010ms", &problem), 10'000'000u);
  EXPECT_EQ(ParseDurationNs("1.5s", &problem), 1'500'000'000u);
}

TEST(TenantOptions, EachRefusedDurationSaysWhy) {
  const struct {
    const char* text;
    const char* says;
  } cases[] = {
      {"", "is empty"},
      {"5", "has no unit"},
      {"5xs", "has an unknown unit \"xs\""},
      {"-1ms", "is negative"},
      {"1e3us", "is not a decimal number"},
      {"1.0000000005s", "is not a whole number of nanoseconds"},
      {"18446744073709551616ns", "is too long"},
  };
  for (const auto& c : cases) {
    std::string problem;
    EXPECT_FALSE(ParseDurationNs(c.text, &problem).has_value()) << c.text;
    EXPECT_NE(problem.find(c.says), std::string::npos) << c.text << ": " << problem;
  }
}

TEST(TenantOptions, WholeNumbersAndDecimalsSayWhyTheyAreRefused) {
  const struct {
    const char* text;
    const char* whole;
    const char* decimal;
  } cases[] = {
      {"", "is empty", "is empty"},
      {"-1", "is negative", "is negative"},
      {"012", "has a leading zero", "has a leading zero"},
      {"12x", "has trailing characters \"x\"", "has trailing characters \"x\""},
      {"x", "is not a whole number", "is not a number"},
      {"18446744073709551616", "is too large", nullptr},
      {"1e999", "has trailing characters", "is out of the range of a double"},
  };
  for (const auto& c : cases) {
    std::string problem;
    EXPECT_FALSE(ParseWholeNumber(c.text, &problem).has_value()) << c.text;
    EXPECT_NE(problem.find(c.whole), std::string::npos) << c.text << ": " << problem;
    if (c.decimal == nullptr) continue;
    problem.clear();
    EXPECT_FALSE(ParseDecimal(c.text, &problem).has_value()) << c.text;
    EXPECT_NE(problem.find(c.decimal), std::string::npos) << c.text << ": " << problem;
  }
  std::string problem;
  EXPECT_EQ(ParseWholeNumber("18446744073709551615", &problem), 18446744073709551615u);
  EXPECT_EQ(ParseDecimal("0.25", &problem), 0.25);
}

}  // namespace
}  // namespace vgpu::tenant
