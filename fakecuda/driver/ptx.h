// Reads what fakecuda needs from PTX text: version, target, and each .entry's name and parameter layout.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fakecuda::ptx {

struct Param {
  std::uint32_t offset;
  std::uint32_t size;
};

struct Entry {
  std::string name;
  std::vector<Param> params;
  std::uint32_t param_bytes = 0;
};

struct Module {
  int version = 0;       // 88 for ".version 8.8"
  int target_sm = 0;     // 90 for ".target sm_90" or "sm_90a"
  std::vector<Entry> entries;
};

// Returns false with a message naming the line and what was expected when the text is not PTX fakecuda
// can read.
// True if the image is meant as PTX (a failure to read it is then CUDA_ERROR_INVALID_PTX, not INVALID_IMAGE).
bool LooksLikePtx(std::string_view text);

bool Parse(std::string_view text, Module& out, std::string& error);

}  // namespace fakecuda::ptx
