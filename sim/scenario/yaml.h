// The YAML subset of scenario files (docs/scenarios.md, "The YAML subset"), read into a tree of nodes that keep
// their line numbers, so that the schema can say where a value is wrong. Private to sim/scenario.
//
// Accepted: block mappings and sequences indented with spaces (a sequence may sit at its key's indentation, and
// `- key: value` starts a mapping inside an item), flow sequences and mappings ([0, 1], {kernels: 1ms, for: 2s})
// that close on the line they open, plain, single- and double-quoted scalars, `#` comments, one leading `---`.
// Refused, with the line and a message: tabs in indentation, anchors and aliases, tags, directives, a second
// document, block scalars (| and >), values continued on the next line, non-scalar and `?` keys, control
// characters. Duplicate keys are reported but do not stop the reading (the first one is kept).
//
// Every scalar stays text: `30`, "30" and '30' are the same to the schema, which gives them their types. The
// plain scalars null, Null, NULL and ~ are null, as in YAML.
//
// Safety: the reader never recurses deeper than kMaxDepth, allocates in proportion to its input, and stops at the
// first structural error. It does not throw; Read() catches what the standard library may throw (bad_alloc).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/scenario/scenario.h"

namespace vgpu::scenario::yaml {

inline constexpr std::uint32_t kMaxDepth = 64;

struct Node {
  enum class Kind { null, scalar, sequence, mapping };
  enum class Style { plain, single_quoted, double_quoted };
  Kind kind = Kind::null;
  Style style = Style::plain;  // scalars: how the value was written (to echo it back the same way)
  std::string text;            // scalars: the value, quotes removed and escapes resolved
  std::uint32_t line = 0;      // where the value starts; for a null value, the line of its key or dash
  std::string key;             // an entry of a mapping: its key
  std::uint32_t key_line = 0;  // ... and the key's line
  std::vector<Node> children;  // sequence items, or mapping entries in file order

  bool is_scalar() const { return kind == Kind::scalar; }
  // The entry of a mapping with this key, or null.
  const Node* Find(std::string_view name) const;
};

struct Document {
  Node root;                      // null for a file with nothing but comments
  std::vector<Problem> problems;  // structural errors (then `complete` is false) and duplicate keys
  bool complete = false;          // the whole text was read; the tree may be checked against the schema
};

// Reads `text`; `file` names it in problems.
Document Read(std::string_view text, const std::string& file);

// A scalar as it was written, for messages: plain ones bare, others (and any with spaces or control characters)
// double-quoted with escapes, shortened past 60 characters.
std::string Shown(const Node& node);

}  // namespace vgpu::scenario::yaml
