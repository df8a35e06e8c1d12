// Module images as programs hand them to the driver (docs/fakecuda-runtime.md, "Modules from fatbins"): PTX text, a
// cubin (an ELF file of one GPU architecture), or a fatbin holding several of either, as nvcc embeds it and the CUDA
// runtime registers it. Each becomes the description fakecuda runs on (ptx::Module: the kernels, their parameter
// layouts and local memory, the module's data). Kernels do not compute, so the machine code itself is not read.
// Pure: no CUDA, no OS calls (a zstd-compressed PTX is inflated through a function the caller passes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ptx.h"

namespace fakecuda::image {

inline constexpr std::uint32_t kFatbinWrapperMagic = 0x466243b1;    // __fatBinC_Wrapper_t, what nvcc registers
inline constexpr std::uint32_t kFatbinContainerMagic = 0xba55ed50;  // the fatbin itself

// One entry of a fatbin: a cubin or PTX for one architecture, compressed or not.
struct FatbinEntry {
  enum class Kind { ptx, cubin, other };
  Kind kind = Kind::other;
  std::uint32_t arch = 0;  // 90 for sm_90
  enum class Compression { none, lz4, zstd, unknown };
  Compression compression = Compression::none;
  std::span<const std::uint8_t> payload;  // as stored (compressed or not; PTX NUL-padded)
  std::uint64_t inflated_bytes = 0;       // the payload's size once inflated (0: not compressed)
};

// The entries of the fatbin(s) at `image` (a wrapper or a container); false with a message naming what is wrong.
// A container states its own size; nothing past it is read.
bool ReadFatbin(const void* image, std::vector<FatbinEntry>& entries, std::string& error);

// The kernels of a cubin: names from its .text.<name> sections, parameters from .nv.info.<name>
// (EIATTR_KPARAM_INFO, EIATTR_CBANK_PARAM_SIZE), local memory per thread from EIATTR_FRAME_SIZE, the module's data from
// .nv.global, .nv.global.init and .nv.constant3. `module.target_sm` is the cubin's architecture.
bool ReadCubin(std::span<const std::uint8_t> elf, ptx::Module& module, std::string& error);

// An LZ4 block (no frame) into exactly `inflated_bytes`; false if it is malformed or of another size.
bool InflateLz4Block(std::span<const std::uint8_t> block, std::size_t inflated_bytes, std::vector<std::uint8_t>& out);

// A zstd frame into at most `inflated_bytes`, or false (the caller's libzstd, loaded at run time).
using ZstdInflate = std::function<bool(std::span<const std::uint8_t>, std::size_t, std::vector<std::uint8_t>&)>;

enum class Format { ptx, cubin, fatbin, unknown };
Format Sniff(const void* image);

// What a device of architecture `device_sm` (90 for sm_90) runs from `image`: a cubin of its architecture, or of its
// major version and a lower minor one (the newest such), else the newest PTX at or below it, as the driver picks.
// False with a message naming what was there and why none fits. `from_ptx` says which kind was chosen.
bool Describe(const void* image, int device_sm, const ZstdInflate& zstd, ptx::Module& module, bool& from_ptx,
              std::string& error);

}  // namespace fakecuda::image
