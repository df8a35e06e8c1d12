// The simulator's one source of randomness: SplitMix64, written out so that every standard library and platform
// draws the same numbers from the same seed (std::*_distribution do not).
#pragma once

#include <cstdint>

namespace vgpu::sim {

class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}

  std::uint64_t Next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // Uniform in [0, bound) (bound > 0), by multiply-shift: integer arithmetic only, so the same everywhere.
  std::uint64_t Below(std::uint64_t bound) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(Next()) * bound) >> 64);
  }

  // A generator for one member of a family (a process of a run), independent of the others' draws.
  static SplitMix64 Derive(std::uint64_t seed, std::uint64_t member) {
    SplitMix64 mixer(seed ^ (member * 0xd1b54a32d192ed03ull));
    return SplitMix64(mixer.Next());
  }

 private:
  std::uint64_t state_;
};

}  // namespace vgpu::sim
