// Durations as people write them: a decimal number and one of ns, us, ms, s ("1.5s", "200ms", "5us"), read exactly
// (integer arithmetic: "1.5s" is 1500000000 ns, never 1499999999), and written back in the shortest such form. One
// grammar for every reader: scenario files (sim/scenario) and vgpu-tenant's command line (sim/tenant), so that a
// value the runner writes for a tenant reads back as it was meant.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>

namespace vgpu::base {

enum class DurationStatus { ok, malformed, no_unit, finer_than_ns, too_large };

namespace duration_internal {

struct Unit {
  const char* suffix;
  std::uint64_t ns;
  int digits;  // log10(ns): the decimals a fraction of this unit may have
};
inline constexpr Unit kUnits[] = {{"s", 1'000'000'000, 9}, {"ms", 1'000'000, 6}, {"us", 1'000, 3}, {"ns", 1, 0}};

inline bool IsDigit(char c) { return c >= '0' && c <= '9'; }

inline std::size_t CountDigits(std::string_view text, std::size_t from) {
  std::size_t end = from;
  while (end < text.size() && IsDigit(text[end])) ++end;
  return end - from;
}

}  // namespace duration_internal

// digits ('.' digits)?: no sign, no exponent, no "inf", no blanks.
inline bool IsPlainDecimal(std::string_view text) {
  using duration_internal::CountDigits;
  const std::size_t whole = CountDigits(text, 0);
  if (whole == 0) return false;
  if (whole == text.size()) return true;
  if (text[whole] != '.') return false;
  const std::size_t fraction = CountDigits(text, whole + 1);
  return fraction > 0 && whole + 1 + fraction == text.size();
}

// Decimal digits only ("010" is ten). False on anything else or on overflow.
inline bool ParsePlainWhole(std::string_view text, std::uint64_t& value) {
  if (text.empty() || duration_internal::CountDigits(text, 0) != text.size()) return false;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  return result.ec == std::errc() && result.ptr == text.data() + text.size();
}

// A plain decimal and a unit, exact to the nanosecond. `ns` is written only on ok.
inline DurationStatus ParseDuration(std::string_view text, std::uint64_t& ns) {
  using duration_internal::kUnits;
  std::size_t number_end = 0;
  while (number_end < text.size() && (duration_internal::IsDigit(text[number_end]) || text[number_end] == '.')) {
    ++number_end;
  }
  const std::string_view number = text.substr(0, number_end);
  const std::string_view suffix = text.substr(number_end);
  if (!IsPlainDecimal(number)) return DurationStatus::malformed;
  const duration_internal::Unit* unit = nullptr;
  for (const duration_internal::Unit& candidate : kUnits) {
    if (suffix == candidate.suffix) unit = &candidate;
  }
  if (unit == nullptr) return suffix.empty() ? DurationStatus::no_unit : DurationStatus::malformed;
  const std::size_t dot = number.find('.');
  std::uint64_t whole = 0;
  if (!ParsePlainWhole(number.substr(0, dot), whole)) return DurationStatus::too_large;
  std::string_view fraction = dot == std::string_view::npos ? std::string_view{} : number.substr(dot + 1);
  while (!fraction.empty() && fraction.back() == '0') fraction.remove_suffix(1);
  if (fraction.size() > static_cast<std::size_t>(unit->digits)) return DurationStatus::finer_than_ns;
  std::uint64_t fraction_ns = 0;
  if (!fraction.empty()) {
    ParsePlainWhole(fraction, fraction_ns);  // at most 9 digits: cannot fail
    for (std::size_t i = fraction.size(); i < static_cast<std::size_t>(unit->digits); ++i) fraction_ns *= 10;
  }
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  if (whole > (kMax - fraction_ns) / unit->ns) return DurationStatus::too_large;
  ns = whole * unit->ns + fraction_ns;
  return DurationStatus::ok;
}

// "6s", "1.5s", "200ms", "7ns", "0s": the largest unit not above the value, its fraction without trailing zeros.
// ParseDuration reads it back to the same value.
inline std::string FormatDuration(std::uint64_t ns) {
  if (ns == 0) return "0s";
  for (const duration_internal::Unit& unit : duration_internal::kUnits) {
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

}  // namespace vgpu::base
