// Units: exact integer arithmetic for durations (a decimal of seconds must not become 1499999999 ns), the device
// model's size parser for sizes, so that a scenario reads "4g" exactly as the shim reads CUDA_DEVICE_MEMORY_LIMIT.
#include "values.h"

#include <charconv>
#include <cstdio>
#include <limits>

#include "fakecuda/model/model.h"

namespace vgpu::scenario::values {
namespace {

constexpr std::size_t kMaxNumberChars = 32;  // far past any sensible value; keeps from_chars' work bounded

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

std::size_t CountDigits(std::string_view text, std::size_t from) {
  std::size_t end = from;
  while (end < text.size() && IsDigit(text[end])) ++end;
  return end - from;
}

// digits ('.' digits)?
bool IsDecimal(std::string_view text) {
  const std::size_t whole = CountDigits(text, 0);
  if (whole == 0) return false;
  if (whole == text.size()) return true;
  if (text[whole] != '.') return false;
  const std::size_t fraction = CountDigits(text, whole + 1);
  return fraction > 0 && whole + 1 + fraction == text.size();
}

struct Unit {
  const char* suffix;
  std::uint64_t ns;
  int digits;  // log10(ns): the decimals a fraction of this unit may have
};

constexpr Unit kUnits[] = {{"s", 1'000'000'000, 9}, {"ms", 1'000'000, 6}, {"us", 1'000, 3}, {"ns", 1, 0}};

}  // namespace

bool ParseWhole(std::string_view text, std::uint64_t& value) {
  if (text.empty() || CountDigits(text, 0) != text.size()) return false;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  return result.ec == std::errc() && result.ptr == text.data() + text.size();
}

bool ParseDecimal(std::string_view text, double& value) {
  if (text.size() > kMaxNumberChars || !IsDecimal(text)) return false;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value, std::chars_format::fixed);
  return result.ec == std::errc() && result.ptr == text.data() + text.size();
}

DurationStatus ParseDuration(std::string_view text, std::uint64_t& ns) {
  std::size_t number_end = 0;
  while (number_end < text.size() && (IsDigit(text[number_end]) || text[number_end] == '.')) ++number_end;
  const std::string_view number = text.substr(0, number_end);
  const std::string_view suffix = text.substr(number_end);
  if (!IsDecimal(number)) return DurationStatus::malformed;
  const Unit* unit = nullptr;
  for (const Unit& candidate : kUnits) {
    if (suffix == candidate.suffix) unit = &candidate;
  }
  if (unit == nullptr) return suffix.empty() ? DurationStatus::no_unit : DurationStatus::malformed;
  const std::size_t dot = number.find('.');
  std::uint64_t whole = 0;
  if (!ParseWhole(number.substr(0, dot), whole)) return DurationStatus::too_large;
  std::string_view fraction = dot == std::string_view::npos ? std::string_view{} : number.substr(dot + 1);
  while (!fraction.empty() && fraction.back() == '0') fraction.remove_suffix(1);
  if (fraction.size() > static_cast<std::size_t>(unit->digits)) return DurationStatus::finer_than_ns;
  std::uint64_t fraction_ns = 0;
  if (!fraction.empty()) {
    ParseWhole(fraction, fraction_ns);  // at most 9 digits: cannot fail
    for (std::size_t i = fraction.size(); i < static_cast<std::size_t>(unit->digits); ++i) fraction_ns *= 10;
  }
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  if (whole > (kMax - fraction_ns) / unit->ns) return DurationStatus::too_large;
  ns = whole * unit->ns + fraction_ns;
  return DurationStatus::ok;
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

std::string FormatDuration(std::uint64_t ns) {
  if (ns == 0) return "0s";
  for (const Unit& unit : kUnits) {
    if (ns < unit.ns) continue;
    std::string text = std::to_string(ns / unit.ns);
    if (const std::uint64_t rest = ns % unit.ns; rest != 0) {
      char fraction[16];
      std::snprintf(fraction, sizeof fraction, "%0*llu", unit.digits, static_cast<unsigned long long>(rest));
      std::string digits = fraction;
      while (!digits.empty() && digits.back() == '0') digits.pop_back();
      text += "." + digits;
    }
    return text + unit.suffix;
  }
  return std::to_string(ns) + "ns";
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
