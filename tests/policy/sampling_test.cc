// Which launches are measured (vgpu-core/policy/sampling.h): how often, and that the draws are seeded, not clocked.
#include "vgpu/policy/sampling.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>

namespace vgpu::policy {
namespace {

TEST(MeasuredOneIn, AboutOncePerSpacingOfRunTimeWithinItsBounds) {
  EXPECT_EQ(MeasuredOneIn(1'000'000, false), 1u);  // a 1 ms kernel: every launch
  EXPECT_EQ(MeasuredOneIn(25'000, false), 10u);    // 25 us: one in 10 (250 us apart)
  EXPECT_EQ(MeasuredOneIn(1'000, false), 64u);     // at least one in 64
  EXPECT_EQ(MeasuredOneIn(0, false), 64u);         // unknown: as the shortest
  EXPECT_EQ(MeasuredOneIn(100'000, true), 10u);    // steady: 1 ms apart
  EXPECT_EQ(MeasuredOneIn(1'000, true), 256u);     // at least one in 256
}

TEST(Sampler, DrawsOneInNOnAverage) {
  for (const std::uint64_t one_in : {1ull, 2ull, 10ull, 64ull, 256ull}) {
    Sampler sampler(SamplerSeed(1234, 0));
    constexpr int kDraws = 1'000'000;
    int drawn = 0;
    for (int i = 0; i < kDraws; ++i) drawn += sampler.Draw(one_in) ? 1 : 0;
    const double expected = static_cast<double>(kDraws) / static_cast<double>(one_in);
    EXPECT_NEAR(drawn, expected, expected * 0.05 + 1) << "one in " << one_in;
  }
}

TEST(Sampler, TheSameSeedGivesTheSameDrawsAndThreadsGetDistinctSeeds) {
  Sampler a(SamplerSeed(42, 3));
  Sampler b(SamplerSeed(42, 3));
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a.Draw(7), b.Draw(7)) << "draw " << i;
  std::set<std::uint64_t> seeds;
  for (std::uint64_t process = 1; process <= 64; ++process) {
    for (std::uint64_t thread = 0; thread < 64; ++thread) seeds.insert(SamplerSeed(process, thread));
  }
  EXPECT_EQ(seeds.size(), 64u * 64u);
  Sampler unseeded;
  EXPECT_FALSE(unseeded.seeded());
  unseeded.Seed(0);  // (a zero seed still draws: xorshift's state must not be 0)
  EXPECT_TRUE(unseeded.seeded());
}

}  // namespace
}  // namespace vgpu::policy
