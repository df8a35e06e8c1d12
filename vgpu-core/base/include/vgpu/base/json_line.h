// The JSON lines of ordinary programs (the simulator's and the runner's traces, vgpu-tenant's result line): one flat
// object, fields in the order they are added, appended to a std::string without allocation per field (the string
// grows as it must; a caller that reuses it allocates nothing more). Injected code (the shim, fakecuda) does not use
// this: it writes with snprintf into stack buffers.
#pragma once

#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace vgpu::base {

// How a string writes control characters (below 0x20, and 0x7f): short_forms gives \n \r \t, and \u00XX for the
// others; unicode gives \u00XX for every one (the runner's trace). Quotes and backslashes are escaped; other bytes,
// UTF-8 or not, pass through.
enum class Controls { short_forms, unicode };

inline void AppendJsonString(std::string& out, std::string_view text, Controls controls = Controls::short_forms) {
  constexpr std::string_view kHexDigits = "0123456789abcdef";
  out += '"';
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte >= 0x20 && byte != 0x7f) {
      out += c;
    } else if (controls == Controls::short_forms && (c == '\n' || c == '\r' || c == '\t')) {
      out += '\\';
      out += c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
    } else {
      out += "\\u00";
      out += kHexDigits[byte >> 4];
      out += kHexDigits[byte & 0xf];
    }
  }
  out += '"';
}

// One line on the caller's string: JsonLine(out).Begin("kernel").Text("tenant", name).Number("pid", 7).End(). Or
// on its own: JsonLine("exit").Number("t_ns", t).Done() gives the line.
class JsonLine {
 public:
  explicit JsonLine(std::string& out, Controls controls = Controls::short_forms) : out_(out), controls_(controls) {}
  explicit JsonLine(const char* event, Controls controls = Controls::short_forms) : out_(own_), controls_(controls) {
    Begin(event);
  }
  JsonLine(const JsonLine&) = delete;
  JsonLine& operator=(const JsonLine&) = delete;

  // `{"ev":"<event>"`, the traces' first field; Begin() opens a line without it.
  JsonLine& Begin(const char* event) { return Begin().Text("ev", event); }
  JsonLine& Begin() {
    out_ += '{';
    first_ = true;
    return *this;
  }
  JsonLine& Text(const char* key, std::string_view value) {
    Key(key);
    AppendJsonString(out_, value, controls_);
    return *this;
  }
  JsonLine& Number(const char* key, std::uint64_t value) { return Integer(key, value); }
  JsonLine& Signed(const char* key, std::int64_t value) { return Integer(key, value); }
  JsonLine& Numbers(const char* key, const std::vector<std::uint32_t>& values) {
    Key(key);
    out_ += '[';
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (i > 0) out_ += ',';
      AppendInteger(values[i]);
    }
    out_ += ']';
    return *this;
  }
  // Nine significant digits (std::to_chars, general form: no locale's decimal comma); JSON has no NaN or infinity,
  // so a non-finite value is written as 0.
  JsonLine& Decimal(const char* key, double value) {
    Key(key);
    std::array<char, 64> digits{};
    const auto [end, error] = std::to_chars(digits.data(), digits.data() + digits.size(),
                                            std::isfinite(value) ? value : 0.0, std::chars_format::general, 9);
    if (error == std::errc{})
      out_.append(digits.data(), end);
    else
      out_ += '0';
    return *this;
  }
  void Close() { out_ += '}'; }  // the line without its newline
  void End() { out_ += "}\n"; }
  std::string Done() {
    End();
    return out_;
  }

 private:
  void Key(const char* key) {
    out_ += first_ ? "\"" : ",\"";
    first_ = false;
    out_ += key;
    out_ += "\":";
  }
  template <typename T>
  void AppendInteger(T value) {
    std::array<char, 24> digits{};
    const auto [end, error] = std::to_chars(digits.data(), digits.data() + digits.size(), value);
    out_.append(digits.data(), end);
  }
  template <typename T>
  JsonLine& Integer(const char* key, T value) {
    Key(key);
    AppendInteger(value);
    return *this;
  }

  std::string own_;  // before out_, which may refer to it
  std::string& out_;
  Controls controls_;
  bool first_ = true;
};

}  // namespace vgpu::base
