// The simulator's one source of randomness: the tree's SplitMix64 (vgpu/base/random.h), so that every standard
// library and platform draws the same numbers from the same seed (std::*_distribution do not).
#pragma once

#include "vgpu/base/random.h"

namespace vgpu::sim {

using base::SplitMix64;

}  // namespace vgpu::sim
