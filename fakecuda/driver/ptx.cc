// PTX reader: strips comments, then scans directives. Not a validator: ptxas is the judge of real PTX.
#include "ptx.h"

#include <algorithm>
#include <cctype>
#include <charconv>

namespace fakecuda::ptx {
namespace {

std::string StripComments(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i < text.size() && text[i] != '\n') ++i;
      if (i < text.size()) out.push_back('\n');
    } else if (text[i] == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      i += 2;
      while (i + 1 < text.size() && !(text[i] == '*' && text[i + 1] == '/')) {
        if (text[i] == '\n') out.push_back('\n');
        ++i;
      }
      ++i;
    } else {
      out.push_back(text[i]);
    }
  }
  return out;
}

bool IsIdentifierChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '$' || c == '.' || c == '%';
}

// Splits into tokens: identifiers/directives, numbers, and single punctuation characters.
std::vector<std::string_view> Tokenize(std::string_view s) {
  std::vector<std::string_view> tokens;
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c)) != 0) {
      ++i;
    } else if (IsIdentifierChar(c)) {
      std::size_t j = i;
      // A directive like ".param" starts with '.', but ".u64" must stay separate from a following name.
      if (c == '.') ++j;
      while (j < s.size() && IsIdentifierChar(s[j]) && !(j > i && s[j] == '.' && s[i] == '.')) ++j;
      if (j == i) ++j;
      tokens.push_back(s.substr(i, j - i));
      i = j;
    } else {
      tokens.push_back(s.substr(i, 1));
      ++i;
    }
  }
  return tokens;
}

std::uint32_t TypeSize(std::string_view type) {
  if (type == ".pred") return 1;
  if (type.size() < 3) return 0;
  const char kind = type[1];
  if (kind != 'u' && kind != 's' && kind != 'b' && kind != 'f') return 0;
  std::uint32_t bits = 0;
  const auto r = std::from_chars(type.data() + 2, type.data() + type.size(), bits);
  if (r.ptr != type.data() + type.size() || bits % 8 != 0 || bits == 0 || bits > 128) return 0;
  return bits / 8;
}

// The bytes of a variable declared from tokens[i] (a state space) to the next ';': its element type's size times the
// product of its [N] dimensions (0 when no type fakecuda understands is named, or a dimension is empty).
std::uint64_t VariableBytes(const std::vector<std::string_view>& tokens, std::size_t i) {
  std::uint64_t element = 0, count = 1;
  for (std::size_t j = i + 1; j < tokens.size() && tokens[j] != ";" && tokens[j] != "="; ++j) {
    if (const std::uint32_t s = TypeSize(tokens[j]); s != 0 && element == 0) element = s;
    if (tokens[j] == "[" && j + 1 < tokens.size()) {
      std::uint64_t n = 0;
      const std::string_view number = tokens[j + 1];
      if (std::from_chars(number.data(), number.data() + number.size(), n).ptr != number.data() + number.size())
        return 0;
      if (n != 0 && count > (std::uint64_t{1} << 40) / n) return 0;  // absurd: not a size a device could hold
      count *= n;
    }
  }
  return element * count;
}

// The name a variable declared from tokens[i] is given: the last identifier before its '[', '=' or ';'.
std::string_view VariableName(const std::vector<std::string_view>& tokens, std::size_t i) {
  std::string_view name;
  for (std::size_t j = i + 1; j < tokens.size() && tokens[j] != ";" && tokens[j] != "=" && tokens[j] != "["; ++j) {
    const char c = tokens[j].front();
    if (std::isalpha(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '$') name = tokens[j];
  }
  return name;
}

// One initializer value onto `bytes`, little endian in `size` bytes: decimal, 0x hex, or a float's (0fXXXXXXXX) or
// double's (0dXXXXXXXXXXXXXXXX) bits, which set their own size. False if it is none of these.
bool AppendValue(std::string_view value, std::uint32_t size, bool negative, std::vector<std::uint8_t>& bytes) {
  int base = 10;
  const bool float_bits = value.size() == 10 && (value.starts_with("0f") || value.starts_with("0F"));
  const bool double_bits = value.size() == 18 && (value.starts_with("0d") || value.starts_with("0D"));
  if (float_bits || double_bits) {
    value.remove_prefix(2), base = 16, size = float_bits ? 4 : 8;
  } else if (value.starts_with("0x") || value.starts_with("0X")) {
    value.remove_prefix(2), base = 16;
  }
  std::uint64_t number = 0;
  if (std::from_chars(value.data(), value.data() + value.size(), number, base).ptr != value.data() + value.size()) {
    return false;
  }
  if (negative) number = ~number + 1;
  for (std::uint32_t b = 0; b < size; ++b) bytes.push_back(static_cast<std::uint8_t>(number >> (8 * b)));
  return true;
}

// The initial bytes of a variable declared from tokens[i] ("= {7, 0, 8}", "= 0f3FC00000"), each value in the element's
// size. Empty without an initializer or with one fakecuda does not read (addresses of other variables, say).
std::vector<std::uint8_t> VariableInitial(const std::vector<std::string_view>& tokens, std::size_t i) {
  std::uint32_t element = 0;
  std::size_t j = i + 1;
  for (; j < tokens.size() && tokens[j] != ";" && tokens[j] != "="; ++j) {
    if (const std::uint32_t s = TypeSize(tokens[j]); s != 0 && element == 0) element = s;
  }
  std::vector<std::uint8_t> bytes;
  if (j >= tokens.size() || tokens[j] != "=" || element == 0) return bytes;
  bool negative = false;
  for (++j; j < tokens.size() && tokens[j] != ";"; ++j) {
    const std::string_view t = tokens[j];
    if (t == "{" || t == "}" || t == ",") continue;
    if (t == "-") {
      negative = true;
      continue;
    }
    if (!AppendValue(t, element, negative, bytes)) return {};
    negative = false;
  }
  return bytes;
}

// What the driver takes for the module and its kernels, in a pass of its own over the tokens (`out.entries` already
// read, in order): module-scope .global/.const variables (not parameter qualifiers, not .extern), and in each .entry's
// body its largest .local array and whether it calls malloc (a .func's body belongs to no entry).
void ReadFootprints(const std::vector<std::string_view>& tokens, Module& out) {
  int depth = 0, parens = 0;     // braces and parentheses open
  std::size_t entries_seen = 0;  // .entry directives passed
  Entry* pending = nullptr;      // the .entry whose body the next '{' at depth 0 opens
  Entry* body = nullptr;         // the .entry whose body is open
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::string_view t = tokens[i];
    if (t == ".entry" && entries_seen < out.entries.size()) {
      pending = &out.entries[entries_seen++];
    } else if (t == ".func") {
      pending = nullptr;
    } else if (t == "{") {
      if (depth++ == 0) body = pending;
      pending = nullptr;
    } else if (t == "}") {
      if (depth > 0 && --depth == 0) body = nullptr;
    } else if (t == "(") {
      ++parens;
    } else if (t == ")") {
      if (parens > 0) --parens;
    } else if (t == ".local" && body != nullptr) {
      body->local_bytes = std::max(body->local_bytes, VariableBytes(tokens, i));
    } else if (t == "malloc" && body != nullptr) {
      body->uses_malloc = true;
    } else if ((t == ".global" || t == ".const") && depth == 0 && parens == 0 &&
               (i == 0 || tokens[i - 1] != ".extern")) {
      const std::uint64_t bytes = VariableBytes(tokens, i);
      out.data_bytes += bytes;
      if (const std::string_view name = VariableName(tokens, i); !name.empty() && bytes > 0) {
        out.globals.push_back(Global{std::string(name), bytes, VariableInitial(tokens, i)});
      }
    }
  }
}

}  // namespace

bool LooksLikePtx(std::string_view text) { return text.find(".version") != std::string_view::npos; }

bool Parse(std::string_view text, Module& out, std::string& error) {
  out = Module{};
  if (text.size() >= 4 && static_cast<unsigned char>(text[0]) == 0x7f && text.substr(1, 3) == "ELF") {
    error = "the image is an ELF cubin; fakecuda loads PTX text only";
    return false;
  }
  const std::string clean = StripComments(text);
  const std::vector<std::string_view> tokens = Tokenize(clean);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::string_view t = tokens[i];
    if (t == ".version" && i + 1 < tokens.size()) {
      // ".version 8.8" tokenizes as "8" "." "8" or "8" ".8".
      std::string number;
      for (std::size_t j = i + 1; j < tokens.size() && j < i + 4; ++j) {
        const std::string_view part = tokens[j];
        if (!part.empty() && (std::isdigit(static_cast<unsigned char>(part[0])) != 0 || part[0] == '.'))
          number += part;
        else
          break;
      }
      const auto dot = number.find('.');
      int major = 0, minor = 0;
      if (dot == std::string::npos || std::from_chars(number.data(), number.data() + dot, major).ec != std::errc() ||
          std::from_chars(number.data() + dot + 1, number.data() + number.size(), minor).ec != std::errc()) {
        error = ".version is not followed by MAJOR.MINOR";
        return false;
      }
      out.version = major * 10 + minor;
    } else if (t == ".target" && i + 1 < tokens.size()) {
      const std::string_view target = tokens[i + 1];
      if (target.substr(0, 3) == "sm_") {
        int sm = 0;
        std::from_chars(target.data() + 3, target.data() + target.size(), sm);
        out.target_sm = sm;
      }
    } else if (t == ".entry" && i + 1 < tokens.size()) {
      Entry entry;
      entry.name = std::string(tokens[i + 1]);
      std::size_t j = i + 2;
      if (j < tokens.size() && tokens[j] == "(") {
        ++j;
        while (j < tokens.size() && tokens[j] != ")") {
          if (tokens[j] != ".param") {
            error = "unexpected '" + std::string(tokens[j]) + "' in the parameter list of .entry " + entry.name;
            return false;
          }
          ++j;
          std::uint32_t align = 0, size = 0, count = 1;
          bool pointer = false;  // after .ptr, an .align describes the pointee, not the parameter
          // Qualifiers in any order: .align N, a type, .ptr, state spaces; then the name and maybe [N].
          while (j < tokens.size() && tokens[j] != "," && tokens[j] != ")") {
            const std::string_view q = tokens[j];
            if (q == ".ptr") pointer = true;
            if (q == ".align" && j + 1 < tokens.size()) {
              if (!pointer) std::from_chars(tokens[j + 1].data(), tokens[j + 1].data() + tokens[j + 1].size(), align);
              j += 2;
              continue;
            }
            if (q == "[" && j + 1 < tokens.size()) {
              std::from_chars(tokens[j + 1].data(), tokens[j + 1].data() + tokens[j + 1].size(), count);
              j += 2;
              continue;
            }
            if (const std::uint32_t s = TypeSize(q); s != 0 && size == 0) size = s;
            ++j;
          }
          if (size == 0) {
            error = "parameter of .entry " + entry.name + " has no type fakecuda understands";
            return false;
          }
          if (align == 0) align = size;
          const std::uint32_t offset = (entry.param_bytes + align - 1) / align * align;
          const std::uint32_t bytes = size * std::max<std::uint32_t>(count, 1);
          entry.params.push_back({offset, bytes});
          entry.param_bytes = offset + bytes;
          if (j < tokens.size() && tokens[j] == ",") ++j;
        }
        if (j >= tokens.size()) {
          error = "the parameter list of .entry " + entry.name + " is not closed";
          return false;
        }
      }
      out.entries.push_back(std::move(entry));
      i = j;
    }
  }
  if (out.version == 0) {
    error = "no .version directive: not PTX text";
    return false;
  }
  if (out.target_sm == 0) {
    error = "no .target sm_XX directive";
    return false;
  }
  ReadFootprints(tokens, out);
  return true;
}

}  // namespace fakecuda::ptx
