// Reads what fakecuda needs from PTX text: version, target, each .entry's name, parameter layout and local memory, and
// the module's own data (what the driver takes for it when the module loads).
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
  std::uint64_t local_bytes = 0;  // per thread: the largest .local array in its body (ptxas's __local_depot)
  bool uses_malloc = false;       // its body calls the device-side malloc (the driver then sets up the heap)
};

// A module-scope variable (__device__, __constant__): what cuModuleGetGlobal finds.
struct Global {
  std::string name;
  std::uint64_t bytes = 0;
  std::vector<std::uint8_t> initial;  // its first bytes' initial value (a cubin's .nv.global.init, PTX's "= ..."); the
                                      // rest is zero
};

struct Module {
  int version = 0;    // 88 for ".version 8.8"
  int target_sm = 0;  // 90 for ".target sm_90" or "sm_90a"
  std::vector<Entry> entries;
  std::uint64_t data_bytes = 0;  // module-scope .global and .const variables: loaded with the module's code
  std::vector<Global> globals;   // those variables by name, with their initial values
};

// Returns false with a message naming the line and what was expected when the text is not PTX fakecuda
// can read.
// True if the image is meant as PTX (a failure to read it is then CUDA_ERROR_INVALID_PTX, not INVALID_IMAGE).
bool LooksLikePtx(std::string_view text);

bool Parse(std::string_view text, Module& out, std::string& error);

}  // namespace fakecuda::ptx
