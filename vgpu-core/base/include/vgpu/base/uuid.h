// A GPU's UUID as NVML and nvidia-smi write it, "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", from the 16 bytes CUDA
// gives (cuDeviceGetUuid): the tree's one formatter. The character form allocates nothing and calls nothing (the shim
// and fakecuda run inside other processes, on paths that must not allocate).
#pragma once

#include <cstddef>
#include <string>

namespace vgpu::base {

inline constexpr std::size_t kGpuUuidChars = 40;  // "GPU-" and 8-4-4-4-12 lowercase hexadecimal digits

// Writes the 40 characters and a NUL to `out`. `bytes`: 16 bytes (a CUuuid's, or a uint8_t[16]).
inline void FormatGpuUuid(const void* bytes, char (&out)[kGpuUuidChars + 1]) {
  constexpr char kHex[] = "0123456789abcdef";
  const auto* u = static_cast<const unsigned char*>(bytes);
  char* at = out;
  for (const char c : {'G', 'P', 'U', '-'}) *at++ = c;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) *at++ = '-';
    *at++ = kHex[u[i] >> 4];
    *at++ = kHex[u[i] & 15];
  }
  *at = '\0';
}

inline std::string GpuUuidText(const void* bytes) {
  char text[kGpuUuidChars + 1];
  FormatGpuUuid(bytes, text);
  return text;
}

}  // namespace vgpu::base
