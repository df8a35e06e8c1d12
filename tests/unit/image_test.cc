// Module images (fakecuda/driver/image.h): fatbin containers and wrappers built here byte by byte, the choice of
// entry a device runs, LZ4 blocks, and inputs that must be refused with a message rather than read past their end.
// Real nvcc output (cubins, zstd-compressed PTX) is covered by tests/python/test_runtime_programs.py.
#include "image.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

namespace fakecuda::image {
namespace {

std::string Ptx(int sm, const std::string& kernel) {
  return ".version 8.0\n.target sm_" + std::to_string(sm) + "\n.address_size 64\n.visible .entry " + kernel +
         "(.param .u64 p, .param .u32 n)\n{\nret;\n}\n";
}

template <typename T>
void Put(std::vector<std::uint8_t>& out, T value) {
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(&value);
  out.insert(out.end(), bytes, bytes + sizeof value);
}

// One fatbin entry: a 64-byte header (kind, version, header size, payload size, sizes, arch, flags) and its payload.
void AddEntry(std::vector<std::uint8_t>& body, std::uint16_t kind, std::uint32_t arch, const std::string& payload,
              std::uint64_t flags = 0x11) {
  const std::size_t start = body.size();
  Put<std::uint16_t>(body, kind);
  Put<std::uint16_t>(body, 0x0101);
  Put<std::uint32_t>(body, 64);
  Put<std::uint64_t>(body, payload.size() + 1);
  Put<std::uint32_t>(body, 0);  // compressed size
  Put<std::uint32_t>(body, 0);  // options
  Put<std::uint16_t>(body, 0);
  Put<std::uint16_t>(body, 8);
  Put<std::uint32_t>(body, arch);
  Put<std::uint32_t>(body, 0);
  Put<std::uint32_t>(body, 0);
  Put<std::uint64_t>(body, flags);
  Put<std::uint64_t>(body, 0);
  Put<std::uint64_t>(body, 0);  // inflated size
  ASSERT_EQ(body.size() - start, 64u);
  body.insert(body.end(), payload.begin(), payload.end());
  body.push_back(0);
}

std::vector<std::uint8_t> Container(const std::vector<std::uint8_t>& body) {
  std::vector<std::uint8_t> out;
  Put<std::uint32_t>(out, kFatbinContainerMagic);
  Put<std::uint16_t>(out, 1);
  Put<std::uint16_t>(out, 16);
  Put<std::uint64_t>(out, body.size());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

TEST(Image, ADeviceRunsTheNewestPtxAtOrBelowItsArchitecture) {
  std::vector<std::uint8_t> body;
  AddEntry(body, 1, 70, Ptx(70, "old_kernel"));
  AddEntry(body, 1, 80, Ptx(80, "new_kernel"));
  const std::vector<std::uint8_t> fatbin = Container(body);
  ptx::Module module;
  bool from_ptx = false;
  std::string error;
  ASSERT_TRUE(Describe(fatbin.data(), 90, nullptr, module, from_ptx, error)) << error;
  EXPECT_TRUE(from_ptx);
  ASSERT_EQ(module.entries.size(), 1u);
  EXPECT_EQ(module.entries[0].name, "new_kernel");
  ASSERT_EQ(module.entries[0].params.size(), 2u);
  EXPECT_EQ(module.entries[0].params[1].offset, 8u);
  ASSERT_TRUE(Describe(fatbin.data(), 75, nullptr, module, from_ptx, error)) << error;
  EXPECT_EQ(module.entries[0].name, "old_kernel");
  EXPECT_FALSE(Describe(fatbin.data(), 60, nullptr, module, from_ptx, error));
  EXPECT_NE(error.find("PTX sm_70, PTX sm_80: nothing an sm_60 device runs"), std::string::npos) << error;
}

TEST(Image, AWrapperLeadsToItsContainer) {
  std::vector<std::uint8_t> body;
  AddEntry(body, 1, 90, Ptx(90, "k"));
  const std::vector<std::uint8_t> fatbin = Container(body);
  struct {
    std::uint32_t magic;
    std::uint32_t version;
    const void* data;
    const void* more;
  } wrapper{kFatbinWrapperMagic, 1, fatbin.data(), nullptr};
  EXPECT_EQ(Sniff(&wrapper), Format::fatbin);
  std::vector<FatbinEntry> entries;
  std::string error;
  ASSERT_TRUE(ReadFatbin(&wrapper, entries, error)) << error;
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].kind, FatbinEntry::Kind::ptx);
  EXPECT_EQ(entries[0].arch, 90u);
  wrapper.version = 3;
  EXPECT_FALSE(ReadFatbin(&wrapper, entries, error));
  EXPECT_NE(error.find("version 3"), std::string::npos) << error;
}

TEST(Image, AnEntryThatOverrunsItsContainerIsRefused) {
  std::vector<std::uint8_t> body;
  AddEntry(body, 1, 90, Ptx(90, "k"));
  std::vector<std::uint8_t> fatbin = Container(body);
  const std::uint64_t huge = 1u << 20;
  std::memcpy(fatbin.data() + 16 + 8, &huge, sizeof huge);  // the entry's payload size
  std::vector<FatbinEntry> entries;
  std::string error;
  EXPECT_FALSE(ReadFatbin(fatbin.data(), entries, error));
  EXPECT_NE(error.find("overruns its container"), std::string::npos) << error;
}

TEST(Image, CompressionIsReadFromTheFlags) {
  std::vector<std::uint8_t> body;
  AddEntry(body, 1, 90, Ptx(90, "k"), 0x2011);
  AddEntry(body, 2, 90, "x", 0x8011);
  AddEntry(body, 1, 90, "y", 0x1011);
  const std::vector<std::uint8_t> fatbin = Container(body);
  std::vector<FatbinEntry> entries;
  std::string error;
  ASSERT_TRUE(ReadFatbin(fatbin.data(), entries, error)) << error;
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].compression, FatbinEntry::Compression::lz4);
  EXPECT_EQ(entries[1].compression, FatbinEntry::Compression::zstd);
  EXPECT_EQ(entries[2].compression, FatbinEntry::Compression::unknown);
  ptx::Module module;
  bool from_ptx = false;
  std::vector<std::uint8_t> zstd_only;
  AddEntry(zstd_only, 1, 90, "compressed", 0x8011);
  EXPECT_FALSE(Describe(Container(zstd_only).data(), 90, nullptr, module, from_ptx, error));
  EXPECT_NE(error.find("no libzstd.so.1"), std::string::npos) << error;
}

TEST(Image, Lz4BlocksInflateExactlyOrNotAtAll) {
  // "abcd", then a match 4 back of 8 bytes (it overlaps itself), then the last literal "x".
  const std::vector<std::uint8_t> block = {0x44, 'a', 'b', 'c', 'd', 4, 0, 0x10, 'x'};
  std::vector<std::uint8_t> out;
  ASSERT_TRUE(InflateLz4Block(block, 13, out));
  EXPECT_EQ(std::string(out.begin(), out.end()), "abcdabcdabcdx");
  EXPECT_FALSE(InflateLz4Block(block, 12, out)) << "one byte more than stated";
  EXPECT_FALSE(InflateLz4Block(block, 14, out)) << "one byte less than stated";
  const std::vector<std::uint8_t> far_back = {0x44, 'a', 'b', 'c', 'd', 9, 0, 0x10, 'x'};
  EXPECT_FALSE(InflateLz4Block(far_back, 13, out)) << "a match from before the start";
  const std::vector<std::uint8_t> cut = {0xf0, 255};
  EXPECT_FALSE(InflateLz4Block(cut, 300, out)) << "a length that runs off the end";
}

TEST(Image, WhatIsNeitherPtxNorACubinNorAFatbinIsSaidSo) {
  ptx::Module module;
  bool from_ptx = false;
  std::string error;
  const char empty[] = "";
  EXPECT_EQ(Sniff(empty), Format::unknown);
  EXPECT_FALSE(Describe(empty, 90, nullptr, module, from_ptx, error));
  EXPECT_NE(error.find("neither PTX text, a cubin nor a fatbin"), std::string::npos) << error;
  const std::vector<std::uint8_t> not_elf(64, 0);
  EXPECT_FALSE(ReadCubin(not_elf, module, error));
  EXPECT_NE(error.find("not a 64-bit ELF file"), std::string::npos) << error;
  std::vector<std::uint8_t> bad_table(64, 0);
  const std::uint32_t magic = 0x464c457f;
  std::memcpy(bad_table.data(), &magic, 4);
  bad_table[4] = 2;
  const std::uint64_t far = 1u << 30;
  std::memcpy(bad_table.data() + 0x28, &far, 8);
  const std::uint16_t sizes[3] = {64, 4, 1};
  std::memcpy(bad_table.data() + 0x3a, sizes, sizeof sizes);
  EXPECT_FALSE(ReadCubin(bad_table, module, error));
  EXPECT_NE(error.find("section table lies outside"), std::string::npos) << error;
}

}  // namespace
}  // namespace fakecuda::image
