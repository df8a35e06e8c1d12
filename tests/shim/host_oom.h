// Host memory that runs out inside the shim, for the shim tests' worker: the program's own malloc (which interposes
// every library's) returns null to callers inside libvgpu.so while armed -- the shim's operator new then throws
// std::bad_alloc, as it would with the host out of memory -- and allocates as usual otherwise.
#pragma once

#include <cstdint>

namespace vgpu::shimtest {

// From now on, each allocation made by the shim fails with probability `percent` / 100 (0: none, 100: all), drawn
// per thread from `seed`. False if libvgpu.so is not loaded (then nothing can be armed).
bool ArmHostOom(unsigned percent, std::uint64_t seed);
void DisarmHostOom();
// Allocations made to fail so far, and the shim's allocations seen while armed.
std::uint64_t HostOomInjected();
std::uint64_t HostOomSeen();

}  // namespace vgpu::shimtest
