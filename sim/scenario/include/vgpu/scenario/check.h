// The rules a Scenario keeps, however it was built: by the loader from a file (scenario.h), or in code (tests, the
// Python binding). The runner applies them before it runs anything; the loader's own checks, which quote the file's
// text and line, accept nothing these refuse (tests/fuzz/fuzz_scenario.cc holds it to that). The figures are
// limits.h's. Pure: no CUDA, no OS calls.
#pragma once

#include <string>
#include <vector>

#include "vgpu/scenario/scenario.h"

namespace vgpu::scenario {

// "" when every rule holds, else the first broken one on one line: "KEY = VALUE; accepted: WHAT", KEY the struct's
// path (tenants[0].processes[1].work[0].depth). Modes are the runner's business (it knows which one it runs).
std::string Check(const Scenario& scenario);

// The device specs of a fake `gpu:` value, one per physical device: "2*h100-80gb,a100-40gb" (FAKECUDA_DEVICES'
// syntax; "2xh100-80gb", the scenario file's, too) gives {"h100-80gb", "h100-80gb", "a100-40gb"}. False with a
// message naming the value when it is malformed or names more than limits::kMaxFakeDevices devices.
bool DeviceItems(const std::string& gpu, std::vector<std::string>& items, std::string& error);

}  // namespace vgpu::scenario
