// The YAML subset reader: lines first (indentation, comments, document markers, characters), then a recursive
// descent over them. A `- ` item is read by rewriting its line in place to start after the dash, at that column,
// so that `- key: value` and the keys below it form one mapping exactly as YAML's indentation rules say.
#include "yaml.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <optional>
#include <unordered_map>
#include <utility>

namespace vgpu::scenario::yaml {
namespace {

constexpr std::size_t kMaxTextBytes = 1 << 20;  // scenario files are a few KiB; this bounds every allocation
constexpr std::size_t kMaxShownBytes = 60;
constexpr std::size_t kMaxKeyBytes = 256;         // keys end up in every problem's path; the schema's are short
constexpr std::size_t kMaxValues = 100'000;       // nodes are ~100 bytes: a 1 MiB "[1,1,1,...]" stays small
constexpr std::size_t kMaxDuplicateReports = 50;  // Loaded keeps at most 50 problems anyway

// A structural error. Thrown inside the reader only; Read() turns it into the one problem that ends reading.
struct SyntaxError {
  std::uint32_t line;
  std::string key;
  std::string message;
};

bool IsBlank(char c) { return c == ' ' || c == '\t'; }

bool IsFlowIndicator(char c) { return c == ',' || c == '[' || c == ']' || c == '{' || c == '}'; }

std::string Column(std::size_t zero_based) { return "column " + std::to_string(zero_based + 1); }

// Text from the file echoed in a message: short, quoted, control characters escaped.
std::string Quote(std::string_view text) {
  Node node;
  node.kind = Node::Kind::scalar;
  node.style = Node::Style::double_quoted;
  node.text = std::string(text.substr(0, kMaxShownBytes + 4));
  return Shown(node);
}

// Length of the UTF-8 sequence at `text[i]`, or 0 if it is not valid UTF-8 (overlong forms, surrogates and code
// points past U+10FFFF included): the text ends up in Python strings, which refuse such bytes.
std::size_t Utf8Length(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t at) { return static_cast<unsigned char>(text[at]); };
  const unsigned char lead = byte(i);
  std::size_t length = 0;
  std::uint32_t low = 0;
  std::uint32_t code = 0;
  if (lead < 0x80) return 1;
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2, low = 0x80, code = lead & 0x1f;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3, low = 0x800, code = lead & 0x0f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4, low = 0x10000, code = lead & 0x07;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  for (std::size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    code = (code << 6) | (byte(i + k) & 0x3f);
  }
  if (code < low || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return 0;
  return length;
}

void AppendUtf8(std::string& out, std::uint32_t code) {
  if (code < 0x80) {
    out += static_cast<char>(code);
  } else if (code < 0x800) {
    out += static_cast<char>(0xc0 | (code >> 6));
    out += static_cast<char>(0x80 | (code & 0x3f));
  } else if (code < 0x10000) {
    out += static_cast<char>(0xe0 | (code >> 12));
    out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (code >> 18));
    out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (code & 0x3f));
  }
}

// A physical line with content: its indentation (spaces) and what follows, trailing blanks removed.
struct Line {
  std::uint32_t number = 0;
  std::uint32_t indent = 0;
  std::string_view text;
};

// A position inside one line's text.
struct Cursor {
  std::string_view text;
  std::size_t pos = 0;
  std::uint32_t line = 0;

  bool AtEnd() const { return pos >= text.size(); }
  char Peek(std::size_t ahead = 0) const { return pos + ahead < text.size() ? text[pos + ahead] : '\0'; }
  // True when the character after the current one is a blank or the end (`- `, `: `, `? `).
  bool BlankAfter() const { return pos + 1 >= text.size() || IsBlank(text[pos + 1]); }
  void SkipBlanks() {
    while (!AtEnd() && IsBlank(text[pos])) ++pos;
  }
  // A comment starts with '#' at the start of the content or after a blank.
  bool AtComment() const { return !AtEnd() && text[pos] == '#' && (pos == 0 || IsBlank(text[pos - 1])); }
  bool AtEndOrComment() const { return AtEnd() || AtComment(); }
};

struct Key {
  std::string text;
  std::size_t after_colon = 0;  // where the value starts in the line's text
};

class Reader {
 public:
  Reader(const std::string& file, std::vector<Problem>& problems) : file_(file), problems_(problems) {}

  Node ReadAll(std::string_view text) {
    SplitLines(text);
    if (lines_.empty()) return Node{};
    const Line first = lines_[0];
    Node root = ParseBlock(0);
    if (next_ < lines_.size()) {
      const Line& line = lines_[next_];
      if (line.indent < first.indent) {
        Fail(line.number, "this line is indented less than the first line of the document (line " +
                              std::to_string(first.number) + ")");
      }
      // A mapping or a list has taken every line at its indentation, so the document was a single value.
      Fail(line.number, "unexpected line: the document is the single value on line " + std::to_string(first.number) +
                            "; a scenario is 'key: value' lines, and a value must fit on one line");
    }
    return root;
  }

 private:
  [[noreturn]] void Fail(std::uint32_t line, std::string message) const {
    throw SyntaxError{line, Path(), std::move(message)};
  }

  // ---- where the reader is: the dotted key of problems ------------------------------------------------------------

  // One step of the path: a key, or an index when `key` is null. Paths are built only for problems, so a long
  // file costs no more than its length.
  struct Step {
    const std::string* key;
    std::size_t index;
  };

  // Enters a key or an item for the lifetime of the guard.
  class Enter {
   public:
    Enter(Reader& reader, const std::string& key) : reader_(reader) { reader_.path_.push_back(Step{&key, 0}); }
    Enter(Reader& reader, std::size_t index) : reader_(reader) { reader_.path_.push_back(Step{nullptr, index}); }
    ~Enter() { reader_.path_.pop_back(); }
    Enter(const Enter&) = delete;
    Enter& operator=(const Enter&) = delete;

   private:
    Reader& reader_;
  };

  std::string Path() const {
    std::string path;
    for (const Step& step : path_) {
      // Appended piece by piece: GCC 12 at -O3 warns (-Wrestrict, a false positive) on "[" + std::to_string(..).
      if (step.key == nullptr) {
        path += '[';
        path += std::to_string(step.index);
        path += ']';
      } else {
        if (!path.empty()) path += '.';
        path += *step.key;
      }
    }
    return path;
  }

  // ---- lines ------------------------------------------------------------------------------------------------------

  void SplitLines(std::string_view text) {
    if (text.size() > kMaxTextBytes) {
      Fail(0, "the text is " + std::to_string(text.size()) + " bytes; a scenario file is at most " +
                  std::to_string(kMaxTextBytes) + " bytes");
    }
    if (text.substr(0, 3) == "\xef\xbb\xbf") text.remove_prefix(3);  // a UTF-8 byte order mark
    std::uint32_t number = 0;
    std::uint32_t marker_line = 0;  // a `---` seen
    std::uint32_t end_line = 0;     // a `...` seen
    std::size_t start = 0;
    while (start <= text.size()) {
      const std::size_t newline = text.find('\n', start);
      std::string_view raw =
          text.substr(start, newline == std::string_view::npos ? text.size() - start : newline - start);
      ++number;
      if (!raw.empty() && raw.back() == '\r') raw.remove_suffix(1);
      CheckCharacters(raw, number);
      AddLine(raw, number, marker_line, end_line);
      if (newline == std::string_view::npos) break;
      start = newline + 1;
    }
  }

  void CheckCharacters(std::string_view raw, std::uint32_t number) {
    for (std::size_t i = 0; i < raw.size();) {
      const auto byte = static_cast<unsigned char>(raw[i]);
      if ((byte < 0x20 && byte != '\t') || byte == 0x7f) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", byte);
        Fail(number, "control character " + std::string(hex) + " at " + Column(i) + "; a scenario file is plain text");
      }
      const std::size_t length = Utf8Length(raw, i);
      if (length == 0) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", byte);
        Fail(number, "byte " + std::string(hex) + " at " + Column(i) + " is not UTF-8; save the file as UTF-8");
      }
      i += length;
    }
  }

  void AddLine(std::string_view raw, std::uint32_t number, std::uint32_t& marker_line, std::uint32_t& end_line) {
    std::size_t indent = 0;
    while (indent < raw.size() && raw[indent] == ' ') ++indent;
    std::string_view text = raw.substr(indent);
    while (!text.empty() && IsBlank(text.back())) text.remove_suffix(1);
    if (text.empty() || text.front() == '#') return;
    if (text.front() == '\t') {
      Fail(number, "a tab in the indentation at " + Column(indent) + "; indent with spaces only");
    }
    if (indent == 0 && IsMarker(text, "---")) {
      if (marker_line != 0 || !lines_.empty() || end_line != 0) {
        Fail(number, "a second document ('---'); a scenario file holds one document");
      }
      if (!IsBareMarker(text)) Fail(number, "put the document on the lines after '---', not on its line");
      marker_line = number;
      return;
    }
    if (indent == 0 && IsMarker(text, "...")) {
      if (!IsBareMarker(text)) Fail(number, "nothing may follow '...' on its line");
      if (end_line == 0) end_line = number;
      return;
    }
    if (end_line != 0) {
      Fail(number, "text after the end of the document ('...' on line " + std::to_string(end_line) +
                       "); a scenario file holds one document");
    }
    if (indent == 0 && text.front() == '%') {
      Fail(number, "directives (" + Quote(text) + ") are not supported; remove the line");
    }
    lines_.push_back(Line{number, static_cast<std::uint32_t>(indent), text});
  }

  static bool IsMarker(std::string_view text, std::string_view marker) {
    return text.substr(0, 3) == marker && (text.size() == 3 || IsBlank(text[3]));
  }

  // A marker followed by nothing but a comment.
  static bool IsBareMarker(std::string_view text) {
    Cursor rest{text, 3, 0};
    rest.SkipBlanks();
    return rest.AtEndOrComment();
  }

  // ---- block structure --------------------------------------------------------------------------------------------

  static bool IsItem(const Line& line) {
    return line.text.front() == '-' && (line.text.size() == 1 || IsBlank(line.text[1]));
  }

  // The node that starts at the current line, at that line's indentation.
  Node ParseBlock(std::uint32_t depth) {
    const Line& line = lines_[next_];
    if (depth > kMaxDepth) {
      Fail(line.number, "nested more than " + std::to_string(kMaxDepth) + " levels deep");
    }
    if (IsItem(line)) return ParseSequence(line.indent, depth, false);
    if (ScanKey(line, depth)) return ParseMapping(line.indent, depth);
    // A value alone on its line (under a key, or the whole document).
    Cursor cursor{line.text, 0, line.number};
    std::optional<Node> value = ParseInlineValue(cursor, depth, false);
    ++next_;
    return value ? std::move(*value) : Node{};
  }

  Node ParseMapping(std::uint32_t indent, std::uint32_t depth) {
    Node mapping;
    mapping.kind = Node::Kind::mapping;
    mapping.line = lines_[next_].number;
    std::unordered_map<std::string, std::uint32_t> first_line;
    const Node* inline_value = nullptr;  // the last entry, when its value was on its key's line
    while (next_ < lines_.size()) {
      const Line& line = lines_[next_];
      if (line.indent < indent) break;
      if (line.indent > indent) Misindented(line, indent, mapping.line, inline_value);
      if (IsItem(line)) {
        Fail(line.number, "a list item ('- ') where 'key: value' was expected (the mapping starts on line " +
                              std::to_string(mapping.line) + ")");
      }
      const std::optional<Key> key = ScanKey(line, depth);
      if (!key) {
        Fail(line.number, "expected 'key: value' (the mapping starts on line " + std::to_string(mapping.line) +
                              "), found " + Quote(line.text));
      }
      const Enter entered(*this, key->text);
      Cursor cursor{line.text, key->after_colon, line.number};
      std::optional<Node> value = ParseInlineValue(cursor, depth + 1, true);
      const std::uint32_t key_line = line.number;
      ++next_;
      const bool has_inline = value.has_value();
      Node entry = has_inline ? std::move(*value) : ParseNested(indent, key_line, depth);
      entry.key = key->text;
      entry.key_line = key_line;
      inline_value = nullptr;
      if (AddEntry(mapping, std::move(entry), first_line) && has_inline) {
        inline_value = &mapping.children.back();
      }
    }
    return mapping;
  }

  // The value of a key with nothing after its colon: the more indented lines below it, a list at the key's own
  // indentation, or null.
  Node ParseNested(std::uint32_t indent, std::uint32_t key_line, std::uint32_t depth) {
    if (next_ < lines_.size()) {
      const Line& below = lines_[next_];
      if (below.indent > indent) return ParseBlock(depth + 1);
      if (below.indent == indent && IsItem(below)) return ParseSequence(indent, depth + 1, true);
    }
    Node null;
    null.line = key_line;
    return null;
  }

  [[noreturn]] void Misindented(const Line& line, std::uint32_t indent, std::uint32_t start_line,
                                const Node* inline_value) {
    if (inline_value != nullptr) {
      Fail(line.number, "unexpected indentation: '" + inline_value->key + "' on line " +
                            std::to_string(inline_value->key_line) +
                            " already has a value (a value must fit on one line)");
    }
    Fail(line.number, "unexpected indentation: " + std::to_string(line.indent) +
                          " spaces, where the entries of the mapping starting on line " + std::to_string(start_line) +
                          " have " + std::to_string(indent));
  }

  // Adds an entry unless its key is already there (reported, the first one kept). True if it was added.
  bool AddEntry(Node& mapping, Node entry, std::unordered_map<std::string, std::uint32_t>& first_line) {
    const auto [it, inserted] = first_line.emplace(entry.key, entry.key_line);
    if (!inserted) {
      if (problems_.size() < kMaxDuplicateReports) {
        problems_.push_back(Problem{file_, entry.key_line, Path(),
                                    "duplicate key '" + entry.key + "' (first on line " + std::to_string(it->second) +
                                        "); each key may appear once"});
      }
      return false;
    }
    CountValue(entry.line);
    mapping.children.push_back(std::move(entry));
    return true;
  }

  // `compact`: the list is the value of a key at the same indentation, which continues after the list.
  Node ParseSequence(std::uint32_t indent, std::uint32_t depth, bool compact) {
    Node sequence;
    sequence.kind = Node::Kind::sequence;
    sequence.line = lines_[next_].number;
    while (next_ < lines_.size()) {
      Line& line = lines_[next_];
      if (line.indent < indent) break;
      if (line.indent > indent) {
        Fail(line.number, "unexpected indentation: " + std::to_string(line.indent) +
                              " spaces, where the items of the list starting on line " + std::to_string(sequence.line) +
                              " have " + std::to_string(indent));
      }
      if (!IsItem(line)) {
        if (compact) break;
        Fail(line.number, "expected a list item ('- ...') like line " + std::to_string(sequence.line) + ", found " +
                              Quote(line.text));
      }
      if (depth + 1 > kMaxDepth) {
        Fail(line.number, "nested more than " + std::to_string(kMaxDepth) + " levels deep");
      }
      const Enter entered(*this, sequence.children.size());
      CountValue(line.number);
      sequence.children.push_back(ParseItem(line, indent, depth));
    }
    return sequence;
  }

  Node ParseItem(Line& line, std::uint32_t indent, std::uint32_t depth) {
    std::size_t after = 1;
    while (after < line.text.size() && line.text[after] == ' ') ++after;
    if (after < line.text.size() && line.text[after] == '\t') {
      Fail(line.number, "a tab after '-' at " + Column(line.indent + after) + "; use spaces");
    }
    const Cursor rest{line.text, after, line.number};
    if (rest.AtEndOrComment()) {
      const std::uint32_t dash_line = line.number;
      ++next_;
      if (next_ < lines_.size() && lines_[next_].indent > indent) return ParseBlock(depth + 1);
      Node null;
      null.line = dash_line;
      return null;
    }
    // The item's content as a line of its own, at its column: `- a: 1` then `  b: 2` is one mapping.
    line.indent += static_cast<std::uint32_t>(after);
    line.text.remove_prefix(after);
    return ParseBlock(depth + 1);
  }

  // ---- keys -------------------------------------------------------------------------------------------------------

  // The key of a `key: value` line, or nothing if the line is not one. Refuses keys that are not scalars.
  std::optional<Key> ScanKey(const Line& line, std::uint32_t depth) {
    Cursor cursor{line.text, 0, line.number};
    const char first = cursor.Peek();
    if (first == '?' && cursor.BlankAfter()) {
      Fail(line.number, "complex keys ('? ') are not supported; write 'key: value'");
    }
    if (first == '[' || first == '{') {
      ParseFlow(cursor, depth);
      cursor.SkipBlanks();
      if (cursor.Peek() == ':' && cursor.BlankAfter()) {
        Fail(line.number, "a key must be a plain or quoted name, not a flow collection");
      }
      return std::nullopt;
    }
    if (first == '"' || first == '\'') {
      Node quoted = ParseQuoted(cursor);
      cursor.SkipBlanks();
      if (cursor.Peek() != ':' || !cursor.BlankAfter()) return std::nullopt;
      CheckKey(quoted.text, line.number);
      return Key{std::move(quoted.text), cursor.pos + 1};
    }
    for (std::size_t i = 0; i < line.text.size(); ++i) {
      if (Cursor{line.text, i, line.number}.AtComment()) return std::nullopt;
      if (line.text[i] == ':' && (i + 1 == line.text.size() || IsBlank(line.text[i + 1]))) {
        std::string_view text = line.text.substr(0, i);
        while (!text.empty() && IsBlank(text.back())) text.remove_suffix(1);
        if (text.empty()) Fail(line.number, "a key is missing before ':'");
        CheckPlainStart(Cursor{line.text, 0, line.number}, false);
        CheckKey(text, line.number);
        return Key{std::string(text), i + 1};
      }
    }
    return std::nullopt;
  }

  void CountValue(std::uint32_t line) {
    if (++values_ > kMaxValues) {
      Fail(line, "more than " + std::to_string(kMaxValues) + " values; a scenario file is far smaller");
    }
  }

  void CheckKey(std::string_view key, std::uint32_t line) const {
    if (key.size() > kMaxKeyBytes) {
      Fail(line, "a key of " + std::to_string(key.size()) + " bytes, " + Quote(key) + "; keys are at most " +
                     std::to_string(kMaxKeyBytes) + " bytes");
    }
    // A quoted key's escapes ("a\nb") can make control characters the file itself may not hold. Keys are echoed in
    // every problem's key path and message, which must stay one line (found by tests/fuzz/fuzz_scenario).
    for (const char c : key) {
      const auto byte = static_cast<unsigned char>(c);
      if ((byte < 0x20 && byte != '\t') || byte == 0x7f) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", byte);
        Fail(line, "control character " + std::string(hex) + " in the key " + Quote(key) + "; keys are names");
      }
    }
  }

  // ---- values on one line -----------------------------------------------------------------------------------------

  // The value from the cursor to the end of the line, or nothing if only blanks or a comment are left.
  std::optional<Node> ParseInlineValue(Cursor& cursor, std::uint32_t depth, bool after_key) {
    cursor.SkipBlanks();
    if (cursor.AtEndOrComment()) return std::nullopt;
    const char first = cursor.Peek();
    Node value;
    const char* what = "value";
    if (first == '[' || first == '{') {
      value = ParseFlow(cursor, depth);
      what = first == '[' ? "']'" : "'}'";
    } else if (first == '"' || first == '\'') {
      value = ParseQuoted(cursor);
      what = "the closing quote";
    } else if (first == '-' && cursor.BlankAfter() && after_key) {
      Fail(cursor.line, "a list cannot start on its key's line; put its '- ' items on the lines below");
    } else {
      value = ParsePlain(cursor, false);
    }
    cursor.SkipBlanks();
    if (!cursor.AtEndOrComment()) {
      Fail(cursor.line, std::string("unexpected text after ") + what + " at " + Column(cursor.pos) + ": " +
                            Quote(cursor.text.substr(cursor.pos)));
    }
    return value;
  }

  // Refuses what YAML gives a meaning this subset does not support, or that cannot start a plain scalar.
  void CheckPlainStart(const Cursor& cursor, bool in_flow) {
    const char first = cursor.Peek();
    const std::uint32_t line = cursor.line;
    switch (first) {
      case '&':
      case '*':
        Fail(line, "anchors (&name) and aliases (*name) are not supported; write the value out");
      case '!':
        Fail(line, "tags (!name) are not supported; write the value without one");
      case '|':
      case '>':
        Fail(line, std::string("block scalars ('") + first +
                       "') are not supported; put the value on one line, in quotes if needed");
      case '%':
      case '@':
      case '`':
      case '#':
      case ',':
      case '[':
      case ']':
      case '{':
      case '}':
        Fail(line, std::string("a value cannot start with '") + first + "'; put it in quotes");
      default:
        break;
    }
    if ((first == '?' || first == ':' || (first == '-' && in_flow)) && cursor.BlankAfter()) {
      Fail(line, std::string("a value cannot be '") + first + "' followed by a blank; put it in quotes");
    }
  }

  // A plain scalar: up to a comment or the end of the line (block), or up to , ] } or ': ' (flow).
  Node ParsePlain(Cursor& cursor, bool in_flow) {
    CheckPlainStart(cursor, in_flow);
    const std::size_t start = cursor.pos;
    while (!cursor.AtEnd() && !cursor.AtComment()) {
      const char c = cursor.Peek();
      if (c == ':') {
        const char after = cursor.Peek(1);
        const bool separator = after == '\0' || IsBlank(after) || (in_flow && IsFlowIndicator(after));
        if (separator && in_flow) break;
        if (separator) {
          Fail(cursor.line, "': ' inside a plain value at " + Column(cursor.pos) +
                                "; put the value in quotes, or its entries on the lines below");
        }
      }
      if (in_flow && (c == ',' || c == ']' || c == '}')) break;
      if (in_flow && (c == '[' || c == '{')) {
        Fail(cursor.line,
             std::string("'") + c + "' inside a value at " + Column(cursor.pos) + "; put the value in quotes");
      }
      ++cursor.pos;
    }
    std::string_view text = cursor.text.substr(start, cursor.pos - start);
    while (!text.empty() && IsBlank(text.back())) text.remove_suffix(1);
    Node node;
    node.kind =
        (text == "null" || text == "Null" || text == "NULL" || text == "~") ? Node::Kind::null : Node::Kind::scalar;
    node.text = std::string(text);
    node.line = cursor.line;
    return node;
  }

  Node ParseQuoted(Cursor& cursor) {
    Node node;
    node.kind = Node::Kind::scalar;
    node.line = cursor.line;
    const char quote = cursor.Peek();
    node.style = quote == '"' ? Node::Style::double_quoted : Node::Style::single_quoted;
    const std::size_t open = cursor.pos++;
    while (true) {
      if (cursor.AtEnd()) {
        Fail(cursor.line, std::string("the quoted value opened at ") + Column(open) +
                              " does not end on this line (a value must fit on one line; close it with " + quote + ")");
      }
      const char c = cursor.text[cursor.pos];
      if (c == quote && quote == '\'' && cursor.Peek(1) == '\'') {  // '' is a quote inside single quotes
        node.text += '\'';
        cursor.pos += 2;
      } else if (c == quote) {
        ++cursor.pos;
        return node;
      } else if (c == '\\' && quote == '"') {
        ParseEscape(cursor, node.text);
      } else {
        node.text += c;
        ++cursor.pos;
      }
    }
  }

  // One escape of a double-quoted scalar, the cursor at its backslash.
  void ParseEscape(Cursor& cursor, std::string& out) {
    const std::size_t at = cursor.pos;
    const char code = cursor.Peek(1);
    cursor.pos += 2;
    switch (code) {
      case '0':
        out += '\0';
        return;
      case 'a':
        out += '\a';
        return;
      case 'b':
        out += '\b';
        return;
      case 't':
      case '\t':
        out += '\t';
        return;
      case 'n':
        out += '\n';
        return;
      case 'v':
        out += '\v';
        return;
      case 'f':
        out += '\f';
        return;
      case 'r':
        out += '\r';
        return;
      case 'e':
        out += '\x1b';
        return;
      case ' ':
        out += ' ';
        return;
      case '"':
        out += '"';
        return;
      case '/':
        out += '/';
        return;
      case '\\':
        out += '\\';
        return;
      case 'N':
        AppendUtf8(out, 0x85);
        return;
      case '_':
        AppendUtf8(out, 0xa0);
        return;
      case 'L':
        AppendUtf8(out, 0x2028);
        return;
      case 'P':
        AppendUtf8(out, 0x2029);
        return;
      case 'x':
        AppendUtf8(out, ParseHex(cursor, 2, at));
        return;
      case 'u':
        AppendUtf8(out, ParseHex(cursor, 4, at));
        return;
      case 'U':
        AppendUtf8(out, ParseHex(cursor, 8, at));
        return;
      default:
        break;
    }
    if (code == '\0') {
      Fail(cursor.line, "a '\\' at the end of the line (a value must fit on one line)");
    }
    // The whole character after the backslash, not its first byte: a message must stay valid UTF-8 (it becomes a
    // Python string; found by tests/fuzz/fuzz_scenario). The line is valid UTF-8, so the length is at least 1.
    const std::size_t length = std::max<std::size_t>(1, Utf8Length(cursor.text, at + 1));
    const std::string_view character = cursor.text.substr(at + 1, length);
    Fail(cursor.line, "unknown escape '\\" + std::string(character) + "' at " + Column(at) +
                          "; accepted: \\\\ \\\" \\n \\t \\r \\0 \\xHH \\uHHHH \\UHHHHHHHH (and YAML's others)");
  }

  std::uint32_t ParseHex(Cursor& cursor, std::size_t digits, std::size_t at) {
    std::uint32_t code = 0;
    for (std::size_t i = 0; i < digits; ++i) {
      const char c = cursor.Peek();
      std::uint32_t digit = 0;
      if (c >= '0' && c <= '9') {
        digit = static_cast<std::uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        digit = static_cast<std::uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        digit = static_cast<std::uint32_t>(c - 'A' + 10);
      } else {
        Fail(cursor.line, "the escape at " + Column(at) + " needs " + std::to_string(digits) + " hexadecimal digits");
      }
      code = code * 16 + digit;
      ++cursor.pos;
    }
    if (code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) {
      Fail(cursor.line, "the escape at " + Column(at) + " is not a Unicode character");
    }
    return code;
  }

  // ---- flow collections -------------------------------------------------------------------------------------------

  // [a, b] or {k: v, k2: v2}, on one line, the cursor at the opening bracket.
  Node ParseFlow(Cursor& cursor, std::uint32_t depth) {
    if (depth > kMaxDepth) {
      Fail(cursor.line, "nested more than " + std::to_string(kMaxDepth) + " levels deep");
    }
    const std::size_t open = cursor.pos;
    const char close = cursor.Peek() == '[' ? ']' : '}';
    Node node;
    node.kind = close == ']' ? Node::Kind::sequence : Node::Kind::mapping;
    node.line = cursor.line;
    std::unordered_map<std::string, std::uint32_t> first_line;
    ++cursor.pos;
    while (true) {
      cursor.SkipBlanks();
      if (cursor.AtEndOrComment()) {
        Fail(cursor.line, std::string("the '") + cursor.text[open] + "' at " + Column(open) +
                              " is not closed on this line (a flow collection must fit on one line)");
      }
      if (cursor.Peek() == close) {
        ++cursor.pos;
        return node;
      }
      if (close == ']') {
        const Enter entered(*this, node.children.size());
        CountValue(cursor.line);
        node.children.push_back(ParseFlowValue(cursor, depth + 1));
        cursor.SkipBlanks();
        if (cursor.Peek() == ':') {
          Fail(cursor.line, "'key: value' inside a flow list; write a mapping as {key: value}");
        }
      } else {
        ParseFlowEntry(cursor, depth, node, first_line);
      }
      cursor.SkipBlanks();
      if (cursor.Peek() == ',') {
        ++cursor.pos;
      } else if (cursor.Peek() != close && !cursor.AtEndOrComment()) {
        Fail(cursor.line, std::string("expected ',' or '") + close + "' at " + Column(cursor.pos) + ", found " +
                              Quote(cursor.text.substr(cursor.pos)));
      }
    }
  }

  void ParseFlowEntry(Cursor& cursor, std::uint32_t depth, Node& mapping,
                      std::unordered_map<std::string, std::uint32_t>& first_line) {
    const char first = cursor.Peek();
    if (first == '[' || first == '{') {
      Fail(cursor.line, "a key must be a plain or quoted name, not a flow collection");
    }
    if (first == '?' && cursor.BlankAfter()) {
      Fail(cursor.line, "complex keys ('? ') are not supported; write 'key: value'");
    }
    if (first == ',') Fail(cursor.line, "an empty entry at " + Column(cursor.pos) + " in a flow mapping");
    Node key = (first == '"' || first == '\'') ? ParseQuoted(cursor) : ParsePlain(cursor, true);
    CheckKey(key.text, cursor.line);
    const Enter entered(*this, key.text);
    cursor.SkipBlanks();
    if (cursor.Peek() != ':') {
      Fail(cursor.line, "expected ':' after the key '" + key.text + "' in a flow mapping ({key: value})");
    }
    ++cursor.pos;
    cursor.SkipBlanks();
    Node value;
    value.line = cursor.line;
    const char next = cursor.Peek();
    if (next != ',' && next != '}' && !cursor.AtEndOrComment()) value = ParseFlowValue(cursor, depth + 1);
    value.key = key.text;
    value.key_line = cursor.line;
    AddEntry(mapping, std::move(value), first_line);
  }

  Node ParseFlowValue(Cursor& cursor, std::uint32_t depth) {
    const char first = cursor.Peek();
    if (first == ',') Fail(cursor.line, "an empty item at " + Column(cursor.pos) + " in a flow list");
    if (first == '[' || first == '{') return ParseFlow(cursor, depth);
    if (first == '"' || first == '\'') return ParseQuoted(cursor);
    return ParsePlain(cursor, true);
  }

  const std::string& file_;
  std::vector<Problem>& problems_;
  std::vector<Line> lines_;
  std::size_t next_ = 0;
  std::vector<Step> path_;
  std::size_t values_ = 0;
};

}  // namespace

const Node* Node::Find(std::string_view name) const {
  for (const Node& child : children) {
    if (child.key == name) return &child;
  }
  return nullptr;
}

std::string Shown(const Node& node) {
  if (node.kind == Node::Kind::null) return node.text.empty() ? "an empty value" : node.text;
  if (node.kind == Node::Kind::sequence) return "a list";
  if (node.kind == Node::Kind::mapping) return "a mapping";
  const std::string& text = node.text;
  bool bare = node.style == Node::Style::plain && !text.empty() && text.size() <= kMaxShownBytes;
  for (const char c : text) {
    if (static_cast<unsigned char>(c) <= ' ' || c == '"' || c == '\\' || c == 0x7f) bare = false;
  }
  if (bare) return text;
  std::string out = "\"";
  std::size_t i = 0;
  for (; i < text.size() && i < kMaxShownBytes; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte == '"' || byte == '\\') {
      out += '\\';
      out += static_cast<char>(byte);
    } else if (byte == '\n') {
      out += "\\n";
    } else if (byte == '\t') {
      out += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += static_cast<char>(byte);
    }
  }
  // Never cut a UTF-8 sequence in two: the message must stay valid UTF-8.
  while (i < text.size() && (static_cast<unsigned char>(text[i]) & 0xc0) == 0x80) out += text[i++];
  if (i < text.size()) out += "...";
  return out + "\"";
}

Document Read(std::string_view text, const std::string& file) {
  Document document;
  try {
    Reader reader(file, document.problems);
    document.root = reader.ReadAll(text);
    document.complete = true;
  } catch (const SyntaxError& error) {
    document.problems.push_back(Problem{file, error.line, error.key, error.message});
  } catch (const std::bad_alloc&) {
    document.problems.push_back(Problem{file, 0, "", "out of memory while reading the file"});
  } catch (const std::exception& error) {
    document.problems.push_back(Problem{file, 0, "", std::string("internal error while reading: ") + error.what()});
  }
  return document;
}

}  // namespace vgpu::scenario::yaml
