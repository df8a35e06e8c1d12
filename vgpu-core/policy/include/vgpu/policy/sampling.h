// Which launches the shim measures (docs/compute-limit.md, "Measurement windows"): a kernel is measured about once
// per stretch of its run time, drawn at random. Pure and seeded: the draws come from a generator the caller seeds,
// never from the clock, so a run can be replayed.
#pragma once

#include <cstdint>

namespace vgpu::policy {

// A kernel that usually runs `estimate_ns` is measured one launch in this many: about once per 250 us of its run
// time (at least one in 64), or, steady (Admission::steady), once per 1 ms (at least one in 256).
std::uint64_t MeasuredOneIn(std::uint64_t estimate_ns, bool steady);

// A seed for thread `thread_index` of a process seeded `process_seed`: distinct streams for distinct inputs.
std::uint64_t SamplerSeed(std::uint64_t process_seed, std::uint64_t thread_index);

// The draws (xorshift64): is this launch, of a kernel measured one time in `one_in`, measured? Unseeded until Seed
// (constant-initialized: a thread-local one costs no guard).
class Sampler {
 public:
  constexpr Sampler() = default;
  explicit Sampler(std::uint64_t seed) { Seed(seed); }
  void Seed(std::uint64_t seed) { state_ = seed | 1; }
  bool seeded() const { return state_ != 0; }
  bool Draw(std::uint64_t one_in) {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return ((state_ >> 32) * one_in) >> 32 == 0;  // uniform in [0, one_in): a multiply, not a division
  }

 private:
  std::uint64_t state_ = 0;
};

}  // namespace vgpu::policy
