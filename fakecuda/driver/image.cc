// Fatbins, cubins and their compression (image.h). Layouts: docs/fakecuda-runtime.md, "Modules from fatbins".
#include "image.h"

#include <algorithm>
#include <cstring>

namespace fakecuda::image {
namespace {

template <typename T>
T Load(const std::uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof value);
  return value;
}

// ---- fatbins ---------------------------------------------------------------------------------------------------

constexpr std::size_t kContainerHeaderBytes = 16;  // magic, version, header size, size of the entries
constexpr std::size_t kEntryHeaderBytes = 64;
constexpr std::uint64_t kMaxFatbinBytes = 1ull << 32;  // far past any real one: a bound on a corrupt size
constexpr std::uint64_t kFlagLz4 = 0x2000;
constexpr std::uint64_t kFlagZstd = 0x8000;
constexpr std::uint64_t kFlagOldCompression = 0x1000;

FatbinEntry::Compression CompressionOf(std::uint64_t flags) {
  if ((flags & kFlagZstd) != 0) return FatbinEntry::Compression::zstd;
  if ((flags & kFlagLz4) != 0) return FatbinEntry::Compression::lz4;
  if ((flags & kFlagOldCompression) != 0) return FatbinEntry::Compression::unknown;
  return FatbinEntry::Compression::none;
}

bool ReadContainer(const std::uint8_t* header, std::vector<FatbinEntry>& entries, std::string& error) {
  if (Load<std::uint32_t>(header) != kFatbinContainerMagic) {
    error = "no fatbin container (magic 0xba55ed50) where the wrapper points";
    return false;
  }
  const auto header_bytes = Load<std::uint16_t>(header + 6);
  const auto body_bytes = Load<std::uint64_t>(header + 8);
  if (header_bytes < kContainerHeaderBytes || body_bytes > kMaxFatbinBytes) {
    error = "a fatbin container with header size " + std::to_string(header_bytes) + " and size " +
            std::to_string(body_bytes) + "; expected a header of at least 16 bytes and a size below 4 GiB";
    return false;
  }
  const std::uint8_t* at = header + header_bytes;
  const std::uint8_t* const end = at + body_bytes;
  while (at + kEntryHeaderBytes <= end) {
    const auto kind = Load<std::uint16_t>(at);
    const auto entry_header = Load<std::uint32_t>(at + 4);
    const auto stored = Load<std::uint64_t>(at + 8);
    if (entry_header < kEntryHeaderBytes || entry_header > body_bytes || stored > body_bytes ||
        at + entry_header + stored > end) {
      error = "a fatbin entry overruns its container (header " + std::to_string(entry_header) + " bytes, payload " +
              std::to_string(stored) + " bytes)";
      return false;
    }
    FatbinEntry entry;
    entry.kind = kind == 1 ? FatbinEntry::Kind::ptx : kind == 2 ? FatbinEntry::Kind::cubin : FatbinEntry::Kind::other;
    entry.arch = Load<std::uint32_t>(at + 28);
    entry.compression = CompressionOf(Load<std::uint64_t>(at + 40));
    const auto compressed = Load<std::uint32_t>(at + 16);
    const std::uint64_t payload = entry.compression != FatbinEntry::Compression::none && compressed != 0
                                      ? std::min<std::uint64_t>(compressed, stored)
                                      : stored;
    entry.payload = {at + entry_header, static_cast<std::size_t>(payload)};
    if (entry.compression != FatbinEntry::Compression::none) entry.inflated_bytes = Load<std::uint64_t>(at + 56);
    entries.push_back(entry);
    at += entry_header + stored;
  }
  return true;
}

// ---- cubins ------------------------------------------------------------------------------------------------------

struct Section {
  std::string_view name;
  std::uint32_t type = 0;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
  std::uint32_t link = 0;  // for the symbol table: its names' section
  std::uint32_t info = 0;  // for .nv.info.<kernel>: the kernel's .text section
};

constexpr std::uint32_t kNoBits = 8;      // SHT_NOBITS: takes memory, not file bytes
constexpr std::uint8_t kFormatValue = 4;  // EIFMT_SVAL: a u16 size, then that many bytes
constexpr std::uint8_t kFormatHalf = 3;   // EIFMT_HVAL: a u16 value
constexpr std::uint8_t kKernelParamInfo = 0x17;
constexpr std::uint8_t kParamBankSize = 0x19;
constexpr std::uint8_t kFrameSize = 0x11;

// The section table, names resolved; false if the header or a section lies outside `elf`.
bool Sections(std::span<const std::uint8_t> elf, std::vector<Section>& sections, std::string& error) {
  if (elf.size() < 64 || Load<std::uint32_t>(elf.data()) != 0x464c457f || elf[4] != 2) {
    error = "not a 64-bit ELF file";
    return false;
  }
  const auto table = Load<std::uint64_t>(elf.data() + 0x28);
  const auto entry_bytes = Load<std::uint16_t>(elf.data() + 0x3a);
  const auto count = Load<std::uint16_t>(elf.data() + 0x3c);
  const auto names = Load<std::uint16_t>(elf.data() + 0x3e);
  if (entry_bytes < 64 || names >= count || table > elf.size() ||
      std::uint64_t{count} * entry_bytes > elf.size() - table) {
    error = "the ELF section table lies outside the file";
    return false;
  }
  std::vector<std::uint32_t> name_offsets;
  for (std::uint16_t i = 0; i < count; ++i) {
    const std::uint8_t* s = elf.data() + table + std::uint64_t{i} * entry_bytes;
    Section section;
    name_offsets.push_back(Load<std::uint32_t>(s));
    section.type = Load<std::uint32_t>(s + 4);
    section.offset = Load<std::uint64_t>(s + 24);
    section.size = Load<std::uint64_t>(s + 32);
    section.link = Load<std::uint32_t>(s + 40);
    section.info = Load<std::uint32_t>(s + 44);
    if (section.type != kNoBits && (section.offset > elf.size() || section.size > elf.size() - section.offset)) {
      error = "ELF section " + std::to_string(i) + " lies outside the file";
      return false;
    }
    sections.push_back(section);
  }
  const Section& strings = sections[names];
  for (std::size_t i = 0; i < sections.size(); ++i) {
    if (strings.type == kNoBits || name_offsets[i] >= strings.size) {
      error = "an ELF section name lies outside the string table";
      return false;
    }
    const char* name = reinterpret_cast<const char*>(elf.data() + strings.offset + name_offsets[i]);
    sections[i].name = std::string_view(name, strnlen(name, strings.size - name_offsets[i]));
  }
  return true;
}

struct Symbol {
  std::string_view name;
  std::uint8_t type = 0;      // st_info's low bits: 1 an object, 2 a function
  std::uint16_t section = 0;  // st_shndx
  std::uint64_t value = 0;    // the offset in its section
  std::uint64_t size = 0;
};

// The symbol table (.symtab, names from the section it links to), by symbol index; empty where it is malformed.
std::vector<Symbol> Symbols(std::span<const std::uint8_t> elf, const std::vector<Section>& sections) {
  constexpr std::uint32_t kSymbolTable = 2;  // SHT_SYMTAB
  constexpr std::size_t kSymbolBytes = 24;
  std::vector<Symbol> out;
  for (const Section& s : sections) {
    if (s.type != kSymbolTable || s.link >= sections.size()) continue;
    const Section& names = sections[s.link];
    for (std::uint64_t at = 0; at + kSymbolBytes <= s.size; at += kSymbolBytes) {
      const std::uint8_t* entry = elf.data() + s.offset + at;
      Symbol symbol;
      const auto name_at = Load<std::uint32_t>(entry);
      if (names.type != kNoBits && name_at < names.size) {
        const char* name = reinterpret_cast<const char*>(elf.data() + names.offset + name_at);
        symbol.name = std::string_view(name, strnlen(name, names.size - name_at));
      }
      symbol.type = entry[4] & 0x0f;
      symbol.section = Load<std::uint16_t>(entry + 6);
      symbol.value = Load<std::uint64_t>(entry + 8);
      symbol.size = Load<std::uint64_t>(entry + 16);
      out.push_back(symbol);
    }
  }
  return out;
}

// Module-scope variables: object symbols in .nv.global, .nv.global.init (with their initial bytes) or .nv.constant3.
void ReadGlobals(std::span<const std::uint8_t> elf, const std::vector<Section>& sections,
                 const std::vector<Symbol>& symbols, ptx::Module& module) {
  constexpr std::uint8_t kObject = 1;
  for (const Symbol& symbol : symbols) {
    if (symbol.type != kObject || symbol.section >= sections.size() || symbol.name.empty() || symbol.size == 0) {
      continue;
    }
    const Section& in = sections[symbol.section];
    if (in.name != ".nv.global" && in.name != ".nv.global.init" && in.name != ".nv.constant3") continue;
    ptx::Global global{std::string(symbol.name), symbol.size, {}};
    if (in.type != kNoBits && symbol.value <= in.size && symbol.size <= in.size - symbol.value) {
      const std::uint8_t* first = elf.data() + in.offset + symbol.value;
      global.initial.assign(first, first + symbol.size);
    }
    module.globals.push_back(std::move(global));
  }
}

// One kernel's attributes (.nv.info.<kernel>): its parameters and the size of their bank.
bool ReadKernelInfo(std::span<const std::uint8_t> info, ptx::Entry& entry, std::string& error) {
  std::size_t at = 0;
  while (at + 4 <= info.size()) {
    const std::uint8_t format = info[at];
    const std::uint8_t attribute = info[at + 1];
    if (format == kFormatHalf) {
      if (attribute == kParamBankSize) entry.param_bytes = Load<std::uint16_t>(info.data() + at + 2);
      at += 4;
      continue;
    }
    if (format != kFormatValue) {
      at += 4;  // EIFMT_NVAL / EIFMT_BVAL: no payload past the word
      continue;
    }
    const auto bytes = Load<std::uint16_t>(info.data() + at + 2);
    if (at + 4 + bytes > info.size()) {
      error = "a kernel attribute overruns " + std::string(entry.name) + "'s .nv.info section";
      return false;
    }
    if (attribute == kKernelParamInfo && bytes >= 12) {
      const std::uint8_t* p = info.data() + at + 4;
      const auto ordinal = Load<std::uint16_t>(p + 4);
      const auto offset = Load<std::uint16_t>(p + 6);
      const auto size = (Load<std::uint32_t>(p + 8) >> 18) & 0x3fff;
      if (entry.params.size() <= ordinal) entry.params.resize(ordinal + 1u, ptx::Param{0, 0});
      entry.params[ordinal] = ptx::Param{offset, size};
    }
    at += 4 + bytes;
  }
  return true;
}

// Per-kernel frame sizes from the module-wide .nv.info (symbol index -> bytes of local memory per thread).
void ReadFrameSizes(std::span<const std::uint8_t> info, std::vector<std::pair<std::uint32_t, std::uint32_t>>& out) {
  std::size_t at = 0;
  while (at + 4 <= info.size()) {
    const std::uint8_t format = info[at];
    const std::uint8_t attribute = info[at + 1];
    if (format != kFormatValue) {
      at += 4;
      continue;
    }
    const auto bytes = Load<std::uint16_t>(info.data() + at + 2);
    if (at + 4 + bytes > info.size()) return;
    if (attribute == kFrameSize && bytes >= 8) {
      out.emplace_back(Load<std::uint32_t>(info.data() + at + 4), Load<std::uint32_t>(info.data() + at + 8));
    }
    at += 4 + bytes;
  }
}

// ---- LZ4 ---------------------------------------------------------------------------------------------------------

// A length continued in 255s (LZ4's encoding); false if the block ends first.
bool ReadLength(std::span<const std::uint8_t> block, std::size_t& at, std::size_t& length) {
  std::uint8_t more = 255;
  while (more == 255) {
    if (at >= block.size()) return false;
    more = block[at++];
    length += more;
  }
  return true;
}

bool Inflate(const FatbinEntry& entry, const ZstdInflate& zstd, std::vector<std::uint8_t>& out, std::string& error) {
  switch (entry.compression) {
    case FatbinEntry::Compression::none:
      out.assign(entry.payload.begin(), entry.payload.end());
      return true;
    case FatbinEntry::Compression::lz4:
      if (InflateLz4Block(entry.payload, entry.inflated_bytes, out)) return true;
      error = "an LZ4-compressed fatbin entry does not inflate to its stated " + std::to_string(entry.inflated_bytes) +
              " bytes";
      return false;
    case FatbinEntry::Compression::zstd:
      if (zstd && zstd(entry.payload, entry.inflated_bytes, out)) return true;
      error = zstd ? "a zstd-compressed fatbin entry does not inflate"
                   : "a zstd-compressed fatbin entry, and no libzstd.so.1 to inflate it";
      return false;
    default:
      error = "a fatbin entry compressed in a format fakecuda does not read (flag 0x1000)";
      return false;
  }
}

// The newest cubin the device runs (same major, minor at most the device's), else null.
const FatbinEntry* PickCubin(const std::vector<FatbinEntry>& entries, int device_sm) {
  const FatbinEntry* best = nullptr;
  for (const FatbinEntry& e : entries) {
    const int arch = static_cast<int>(e.arch);
    if (e.kind != FatbinEntry::Kind::cubin || arch / 10 != device_sm / 10 || arch > device_sm) continue;
    if (best == nullptr || e.arch > best->arch) best = &e;
  }
  return best;
}

const FatbinEntry* PickPtx(const std::vector<FatbinEntry>& entries, int device_sm) {
  const FatbinEntry* best = nullptr;
  for (const FatbinEntry& e : entries) {
    if (e.kind != FatbinEntry::Kind::ptx || static_cast<int>(e.arch) > device_sm) continue;
    if (best == nullptr || e.arch > best->arch) best = &e;
  }
  return best;
}

std::string Listing(const std::vector<FatbinEntry>& entries) {
  std::string text;
  for (const FatbinEntry& e : entries) {
    if (!text.empty()) text += ", ";
    text += e.kind == FatbinEntry::Kind::ptx ? "PTX " : e.kind == FatbinEntry::Kind::cubin ? "cubin " : "other ";
    text += "sm_" + std::to_string(e.arch);
  }
  return text.empty() ? "no entries" : text;
}

// The bytes of an ELF image at `image` whose size nobody gave: up to the end of its section table.
std::span<const std::uint8_t> ElfExtent(const void* image) {
  const auto* bytes = static_cast<const std::uint8_t*>(image);
  const auto table = Load<std::uint64_t>(bytes + 0x28);
  const auto entry_bytes = Load<std::uint16_t>(bytes + 0x3a);
  const auto count = Load<std::uint16_t>(bytes + 0x3c);
  const std::uint64_t end = table + std::uint64_t{entry_bytes} * count;
  return {bytes, static_cast<std::size_t>(std::min(end, kMaxFatbinBytes))};
}

}  // namespace

bool ReadFatbin(const void* image, std::vector<FatbinEntry>& entries, std::string& error) {
  entries.clear();
  const auto* bytes = static_cast<const std::uint8_t*>(image);
  if (Load<std::uint32_t>(bytes) == kFatbinContainerMagic) return ReadContainer(bytes, entries, error);
  if (Load<std::uint32_t>(bytes) != kFatbinWrapperMagic) {
    error = "not a fatbin (neither magic 0x466243b1 nor 0xba55ed50)";
    return false;
  }
  const auto version = Load<std::uint32_t>(bytes + 4);
  const auto* data = Load<const std::uint8_t*>(bytes + 8);
  if (version == 2) {  // a relocatable (-rdc) wrapper: a null-terminated list of containers
    for (auto* const* list = Load<const std::uint8_t* const*>(bytes + 16); list != nullptr && *list != nullptr;
         ++list) {
      if (!ReadContainer(*list, entries, error)) return false;
    }
    return true;
  }
  if (version != 1 || data == nullptr) {
    error = "a fatbin wrapper of version " + std::to_string(version) + "; expected 1 or 2 with its data";
    return false;
  }
  return ReadContainer(data, entries, error);
}

bool ReadCubin(std::span<const std::uint8_t> elf, ptx::Module& module, std::string& error) {
  module = ptx::Module{};
  std::vector<Section> sections;
  if (!Sections(elf, sections, error)) return false;
  // e_flags: the SM in bits 8..15 (CUDA 12 and later), in bits 0..7 before.
  const auto flags = Load<std::uint32_t>(elf.data() + 0x30);
  module.target_sm = static_cast<int>((flags >> 8) & 0xff) != 0 ? static_cast<int>((flags >> 8) & 0xff)
                                                                : static_cast<int>(flags & 0xff);
  std::vector<std::pair<std::uint32_t, std::uint32_t>> frames;  // symbol -> local bytes per thread
  for (const Section& s : sections) {
    if (s.name == ".nv.info") ReadFrameSizes(elf.subspan(s.offset, s.size), frames);
    if (s.name == ".nv.global" || s.name == ".nv.global.init" || s.name == ".nv.constant3") {
      module.data_bytes += s.size;
    }
  }
  const std::vector<Symbol> symbols = Symbols(elf, sections);
  ReadGlobals(elf, sections, symbols, module);
  for (std::size_t i = 0; i < sections.size(); ++i) {
    constexpr std::string_view kText = ".text.";
    if (!sections[i].name.starts_with(kText)) continue;
    ptx::Entry entry;
    entry.name = std::string(sections[i].name.substr(kText.size()));
    const std::string info_name = ".nv.info." + entry.name;
    for (const Section& s : sections) {
      if (s.name == info_name && !ReadKernelInfo(elf.subspan(s.offset, s.size), entry, error)) return false;
    }
    for (const auto& [symbol, bytes] : frames) {
      if (symbol < symbols.size() && symbols[symbol].section == i) entry.local_bytes = bytes;
    }
    module.entries.push_back(std::move(entry));
  }
  return true;
}

bool InflateLz4Block(std::span<const std::uint8_t> block, std::size_t inflated_bytes, std::vector<std::uint8_t>& out) {
  out.clear();
  out.reserve(inflated_bytes);
  std::size_t at = 0;
  while (at < block.size()) {
    const std::uint8_t token = block[at++];
    std::size_t literals = token >> 4;
    if (literals == 15 && !ReadLength(block, at, literals)) return false;
    if (literals > block.size() - at || out.size() + literals > inflated_bytes) return false;
    out.insert(out.end(), block.begin() + static_cast<std::ptrdiff_t>(at),
               block.begin() + static_cast<std::ptrdiff_t>(at + literals));
    at += literals;
    if (at == block.size()) break;  // the last sequence has literals only
    if (at + 2 > block.size()) return false;
    const std::size_t distance = Load<std::uint16_t>(block.data() + at);
    at += 2;
    std::size_t match = token & 0x0f;
    if (match == 15 && !ReadLength(block, at, match)) return false;
    match += 4;
    if (distance == 0 || distance > out.size() || out.size() + match > inflated_bytes) return false;
    for (std::size_t i = 0; i < match; ++i) out.push_back(out[out.size() - distance]);  // may overlap itself
  }
  return out.size() == inflated_bytes;
}

Format Sniff(const void* image) {
  // Byte by byte, stopping at a NUL: a short PTX text is not read past its end.
  const auto* bytes = static_cast<const std::uint8_t*>(image);
  const auto starts = [bytes](std::uint32_t magic) {
    for (int i = 0; i < 4; ++i) {
      if (bytes[i] != static_cast<std::uint8_t>(magic >> (8 * i))) return false;
    }
    return true;
  };
  if (starts(kFatbinWrapperMagic) || starts(kFatbinContainerMagic)) return Format::fatbin;
  if (starts(0x464c457f)) return Format::cubin;
  return ptx::LooksLikePtx(static_cast<const char*>(image)) ? Format::ptx : Format::unknown;
}

bool Describe(const void* image, int device_sm, const ZstdInflate& zstd, ptx::Module& module, bool& from_ptx,
              std::string& error) {
  from_ptx = false;
  switch (Sniff(image)) {
    case Format::ptx:
      from_ptx = true;
      return ptx::Parse(static_cast<const char*>(image), module, error);
    case Format::cubin:
      return ReadCubin(ElfExtent(image), module, error);
    case Format::unknown:
      error = "neither PTX text, a cubin nor a fatbin";
      return false;
    case Format::fatbin:
      break;
  }
  std::vector<FatbinEntry> entries;
  if (!ReadFatbin(image, entries, error)) return false;
  const FatbinEntry* chosen = PickCubin(entries, device_sm);
  if (chosen == nullptr) chosen = PickPtx(entries, device_sm);
  if (chosen == nullptr) {
    error = "the fatbin holds " + Listing(entries) + ": nothing an sm_" + std::to_string(device_sm) + " device runs";
    return false;
  }
  std::vector<std::uint8_t> bytes;
  if (!Inflate(*chosen, zstd, bytes, error)) return false;
  if (chosen->kind == FatbinEntry::Kind::cubin) return ReadCubin(bytes, module, error);
  from_ptx = true;
  const auto* text = reinterpret_cast<const char*>(bytes.data());
  return ptx::Parse(std::string_view(text, strnlen(text, bytes.size())), module, error);
}

}  // namespace fakecuda::image
