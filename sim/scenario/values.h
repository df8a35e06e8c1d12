// The units of scenario files (docs/scenarios.md, "The file"): sizes, durations, percentages and plain numbers, as
// text to numbers and back. Pure. Private to sim/scenario (and its tests).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "vgpu/base/duration.h"

namespace vgpu::scenario::values {

// Decimal digits only: no sign, no spaces, no hex ("010" is ten). False on overflow.
bool ParseWhole(std::string_view text, std::uint64_t& value);

// Digits with an optional fraction ("30", "2.5"): no sign, no exponent, no "inf".
bool ParseDecimal(std::string_view text, double& value);

// A decimal number and one of ns, us, ms, s ("1.5s", "200ms", "5us"), exact to the nanosecond: vgpu/base/duration.h,
// the grammar vgpu-tenant's command line reads too.
using base::DurationStatus;
using base::FormatDuration;  // "6s", "1.5s", "200ms", "0s"
using base::ParseDuration;

// Bytes with an optional Ki, Mi, Gi, Ti or k, m, g, t suffix, powers of 1024 as CUDA_DEVICE_MEMORY_LIMIT reads them
// (fakecuda's ParseBytes, which also takes K, M, G, T and a b or B for bytes).
bool ParseSize(std::string_view text, std::uint64_t& bytes);

// "30" or "30%", decimals allowed ("2.5%").
bool ParsePercent(std::string_view text, double& percent);

std::string FormatBytes(std::uint64_t bytes);  // "4Gi", "518Mi", "1000 bytes"
std::string FormatNumber(double value);        // "30", "2.5"

// The accepted forms, for messages.
inline constexpr const char* kDurationForms = "a number with ns, us, ms or s (e.g. 1.5s, 200ms, 5us)";
inline constexpr const char* kSizeForms =
    "a whole number of bytes with Ki, Mi, Gi, Ti or k, m, g, t (powers of 1024; e.g. 2Gi, 512Mi)";

}  // namespace vgpu::scenario::values
