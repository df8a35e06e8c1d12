// Units: durations from vgpu/base/duration.h (exact integer arithmetic: a decimal of seconds must not become
// 1499999999 ns), the device model's size parser for sizes, so that a scenario reads "4g" exactly as the shim reads CUDA_DEVICE_MEMORY_LIMIT.
#include "values.h"

#include <charconv>
#include <cstdio>
#include <limits>

#include "fakecuda/model/model.h"

namespace vgpu::scenario::values {
namespace {

constexpr std::size_t kMaxNumberChars = 32;  // far past any sensible value; keeps from_chars' work bounded

}  // namespace

bool ParseWhole(std::string_view text, std::uint64_t& value) { return base::ParsePlainWhole(text, value); }

bool ParseDecimal(std::string_view text, double& value) {
  if (text.size() > kMaxNumberChars || !base::IsPlainDecimal(text)) return false;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value, std::chars_format::fixed);
  return result.ec == std::errc() && result.ptr == text.data() + text.size();
}

bool ParseSize(std::string_view text, std::uint64_t& bytes) {
  // ParseBytes trims blanks; a size written "4 Gi" is refused here, as it would be in CUDA_DEVICE_MEMORY_LIMIT.
  if (text.empty() || text.size() > kMaxNumberChars || text.find_first_of(" \t") != std::string_view::npos) {
    return false;
  }
  return fakecuda::model::ParseBytes(text, bytes);
}

bool ParsePercent(std::string_view text, double& percent) {
  if (!text.empty() && text.back() == '%') text.remove_suffix(1);
  return ParseDecimal(text, percent);
}

std::string FormatBytes(std::uint64_t bytes) {
  static constexpr struct {
    const char* suffix;
    int shift;
  } kSuffixes[] = {{"Ti", 40}, {"Gi", 30}, {"Mi", 20}, {"Ki", 10}};
  if (bytes == 0) return "0";
  for (const auto& s : kSuffixes) {
    const std::uint64_t unit = 1ull << s.shift;
    if (bytes % unit == 0) return std::to_string(bytes / unit) + s.suffix;
  }
  return std::to_string(bytes) + " bytes";
}

std::string FormatNumber(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.15g", value);
  return text;
}

}  // namespace vgpu::scenario::values
