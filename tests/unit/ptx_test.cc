// Tests the PTX reader: entries and parameter layouts from real nvcc output, and rejection of what is not PTX.
#include "ptx.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace fakecuda::ptx {
namespace {

TEST(PtxTest, ReadsTheTenantSpinKernel) {
  std::ifstream file(VGPU_SOURCE_DIR "/sim/tenant/spin.ptx");
  ASSERT_TRUE(file) << "spin.ptx missing";
  std::stringstream text;
  text << file.rdbuf();
  Module module;
  std::string error;
  ASSERT_TRUE(Parse(text.str(), module, error)) << error;
  EXPECT_EQ(module.target_sm, 75);
  ASSERT_EQ(module.entries.size(), 1u);
  EXPECT_EQ(module.entries[0].name, "vgpu_spin");
  ASSERT_EQ(module.entries[0].params.size(), 1u);
  EXPECT_EQ(module.entries[0].params[0].size, 8u);
}

TEST(PtxTest, LaysOutParametersWithTheirAlignment) {
  const char* ptx = R"(
.version 8.0
.target sm_90
.address_size 64
// a comment with .entry fake( in it
.visible .entry k(
  .param .u32 k_param_0,
  .param .u64 .ptr .global .align 1 k_param_1,
  .param .align 16 .b8 k_param_2[24],
  .param .u8 k_param_3
)
{ ret; }
.visible .entry empty() { ret; }
)";
  Module module;
  std::string error;
  ASSERT_TRUE(Parse(ptx, module, error)) << error;
  EXPECT_EQ(module.version, 80);
  ASSERT_EQ(module.entries.size(), 2u);
  const Entry& k = module.entries[0];
  ASSERT_EQ(k.params.size(), 4u);
  EXPECT_EQ(k.params[0].offset, 0u);
  EXPECT_EQ(k.params[1].offset, 8u);  // after .ptr, ".align 1" is the pointee's alignment: the u64 stays 8-aligned
  EXPECT_EQ(k.params[2].offset, 16u);
  EXPECT_EQ(k.params[2].size, 24u);
  EXPECT_EQ(k.params[3].offset, 40u);
  EXPECT_EQ(k.param_bytes, 41u);
  EXPECT_TRUE(module.entries[1].params.empty());
}

TEST(PtxTest, RejectsWhatIsNotPtx) {
  Module module;
  std::string error;
  EXPECT_FALSE(Parse("\x7f" "ELF binary", module, error));
  EXPECT_FALSE(LooksLikePtx("garbage"));
  EXPECT_FALSE(Parse(".version 7.0\n.target sm_70\n.entry broken( { not ptx }\n", module, error));
  EXPECT_TRUE(LooksLikePtx(".version 7.0\n"));
  EXPECT_NE(error.find("broken"), std::string::npos) << error;
}

}  // namespace
}  // namespace fakecuda::ptx
