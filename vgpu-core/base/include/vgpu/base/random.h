// The tree's one generator and one hash, written out so that every platform and standard library gives the same
// numbers from the same seed (std::*_distribution and std::hash do not): SplitMix64 (Steele, Lea, Flood 2014) and
// FNV-1a 64. Header-only, no allocation, no exception: the shim and fakecuda use them too.
#pragma once

#include <cstdint>
#include <string_view>

namespace vgpu::base {

inline constexpr std::uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ull;  // SplitMix64's increment

// SplitMix64's finalizer: a bijection of 64 bits whose outputs look independent for neighbouring inputs.
constexpr std::uint64_t Mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The `index`-th output (1-based) of SplitMix64 started at `state`: what `index` calls of Next() return last.
constexpr std::uint64_t SplitMix64At(std::uint64_t state, std::uint64_t index) {
  return Mix64(state + index * kGoldenGamma);
}

class SplitMix64 {
 public:
  explicit constexpr SplitMix64(std::uint64_t seed) : state_(seed) {}

  constexpr std::uint64_t Next() { return Mix64(state_ += kGoldenGamma); }

  // Uniform in [0, bound) (bound > 0), by multiply-shift: integer arithmetic only, so the same everywhere.
  constexpr std::uint64_t Below(std::uint64_t bound) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(Next()) * bound) >> 64);
  }

  // A generator for one member of a family (a process of a run), independent of the others' draws.
  static constexpr SplitMix64 Derive(std::uint64_t seed, std::uint64_t member) {
    SplitMix64 mixer(seed ^ (member * 0xd1b54a32d192ed03ull));
    return SplitMix64(mixer.Next());
  }

 private:
  std::uint64_t state_;
};

inline constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull;
inline constexpr std::uint64_t kFnvPrime = 0x100000001b3ull;

// FNV-1a 64 of `hash` (kFnvOffset to start) and one more value: a byte, or a whole word where the words are what is
// hashed (a launch's shape).
constexpr std::uint64_t Fnv1aStep(std::uint64_t hash, std::uint64_t value) { return (hash ^ value) * kFnvPrime; }

// FNV-1a 64 of the bytes of `bytes`.
constexpr std::uint64_t Fnv1a64(std::string_view bytes) {
  std::uint64_t hash = kFnvOffset;
  for (const char c : bytes) hash = Fnv1aStep(hash, static_cast<unsigned char>(c));
  return hash;
}

}  // namespace vgpu::base
