// Hand-written JSON for vgpu-tenant's result line: one flat object of numbers and short strings.
#include "result_line.h"

#include <array>
#include <charconv>
#include <cmath>
#include <system_error>

namespace vgpu::tenant {
namespace {

// Nine significant digits: microseconds of a run of up to 999 s, and no
// locale (printf's %g would write a decimal comma under some locales).
// JSON has no NaN or infinity, so a non-finite value is written as 0.
std::string JsonNumber(double value) {
  if (!std::isfinite(value)) {
    value = 0;
  }
  std::array<char, 64> buffer{};
  const auto [end, error] =
      std::to_chars(buffer.data(), buffer.data() + buffer.size(), value, std::chars_format::general, 9);
  return error == std::errc{} ? std::string(buffer.data(), end) : std::string("0");
}

template <typename Integer>
std::string JsonInteger(Integer value) {
  std::array<char, 32> buffer{};
  const auto [end, error] = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  return error == std::errc{} ? std::string(buffer.data(), end) : std::string("0");
}

}  // namespace

std::string JsonString(std::string_view text) {
  std::string quoted = "\"";
  for (const char character : text) {
    const auto byte = static_cast<unsigned char>(character);
    switch (character) {
      case '"':
        quoted += "\\\"";
        break;
      case '\\':
        quoted += "\\\\";
        break;
      case '\n':
        quoted += "\\n";
        break;
      case '\r':
        quoted += "\\r";
        break;
      case '\t':
        quoted += "\\t";
        break;
      default:
        if (byte < 0x20 || byte == 0x7f) {
          constexpr std::string_view kHexDigits = "0123456789abcdef";
          quoted += "\\u00";
          quoted += kHexDigits[byte >> 4];
          quoted += kHexDigits[byte & 0xf];
        } else {
          quoted += character;  // UTF-8 passes through: JSON text is UTF-8
        }
    }
  }
  quoted += '"';
  return quoted;
}

std::string FormatResultLine(const ResultLine& result) {
  const bool elapsed = result.elapsed_s > 0 && std::isfinite(result.elapsed_s);
  const double kernels = static_cast<double>(result.kernels);
  const double kernels_per_s = elapsed ? kernels / result.elapsed_s : 0;
  const double busy_s = result.busy_from_busy_ns ? static_cast<double>(result.busy_ns) * 1e-9
                                                 : kernels * static_cast<double>(result.kernel_us) * 1e-6;
  const double busy_fraction = elapsed ? busy_s / result.elapsed_s : 0;

  std::string line = "{\"pid\":" + JsonInteger(result.pid);
  line += ",\"device\":" + JsonInteger(result.device);
  line += ",\"kernels\":" + JsonInteger(result.kernels);
  line += ",\"kernel_us\":" + JsonInteger(result.kernel_us);
  line += ",\"blocks\":" + JsonInteger(result.blocks);
  line += ",\"elapsed_s\":" + JsonNumber(result.elapsed_s);
  line += ",\"kernels_per_s\":" + JsonNumber(kernels_per_s);
  line += ",\"busy_fraction\":" + JsonNumber(busy_fraction);
  line += ",\"busy_ns\":" + JsonInteger(result.busy_ns);
  line += ",\"alloc_bytes\":" + JsonInteger(result.alloc_bytes);
  if (result.error.empty()) {
    line += ",\"status\":\"ok\"}";
  } else {
    line += std::string(",\"status\":") + (result.out_of_memory ? "\"oom\"" : "\"error\"") +
            ",\"error\":" + JsonString(result.error);
    line += ",\"call\":" + JsonString(result.call) + "}";
  }
  return line;
}

}  // namespace vgpu::tenant
