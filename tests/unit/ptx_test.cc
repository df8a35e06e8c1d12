// Tests the PTX reader: entries and parameter layouts from real nvcc output, and rejection of what is not PTX.
#include "ptx.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <vector>

namespace fakecuda::ptx {
namespace {

TEST(PtxTest, ReadsTheTenantSpinAndCollectiveKernels) {
  std::ifstream file(VGPU_SOURCE_DIR "/sim/tenant/spin.ptx");
  ASSERT_TRUE(file) << "spin.ptx missing";
  std::stringstream text;
  text << file.rdbuf();
  Module module;
  std::string error;
  ASSERT_TRUE(Parse(text.str(), module, error)) << error;
  EXPECT_EQ(module.target_sm, 75);
  ASSERT_EQ(module.entries.size(), 2u);
  EXPECT_EQ(module.entries[0].name, "vgpu_spin");
  ASSERT_EQ(module.entries[0].params.size(), 1u);
  EXPECT_EQ(module.entries[0].params[0].size, 8u);
  EXPECT_EQ(module.entries[1].name, "vgpu_collective");  // ns_per_block, group, size
  ASSERT_EQ(module.entries[1].params.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(module.entries[1].params[i].size, 8u);
    EXPECT_EQ(module.entries[1].params[i].offset, 8 * i);
  }
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
  EXPECT_FALSE(
      Parse("\x7f"
            "ELF binary",
            module, error));
  EXPECT_FALSE(LooksLikePtx("garbage"));
  EXPECT_FALSE(Parse(".version 7.0\n.target sm_70\n.entry broken( { not ptx }\n", module, error));
  EXPECT_TRUE(LooksLikePtx(".version 7.0\n"));
  EXPECT_NE(error.find("broken"), std::string::npos) << error;
}

// What the driver takes for a module and its kernels (docs/fakecuda.md, "Memory the driver takes by itself"): the
// module's own variables, each entry's local arrays and whether it calls the device-side malloc. Pointer qualifiers
// in parameter lists and extern declarations are not data of the module.
TEST(PtxTest, ReadsModuleDataLocalMemoryAndMalloc) {
  const std::string text = R"(.version 8.0
.target sm_90
.address_size 64
.extern .global .align 4 .b8 elsewhere[1048576];
.global .align 4 .b8 table[4096];
.global .align 8 .u64 counters[16] = {0};
.const .align 4 .f32 weights[256];
.extern .func (.param .b64 func_retval0) malloc (.param .b64 malloc_param_0);
.func helper(.param .u64 .ptr .global .align 4 helper_p) { .local .align 4 .b8 __local_depot9[65536]; ret; }
.visible .entry plain(.param .u64 .ptr .global .align 4 plain_out) { ret; }
.visible .entry deep(.param .u64 deep_out)
{
  .local .align 8 .b8 __local_depot0[2048];
  .local .align 4 .b8 __local_depot1[16384];
  ret;
}
.visible .entry allocating(.param .u64 allocating_out)
{
  .reg .b64 %rd<3>;
  {
  .param .b64 param0;
  st.param.b64 [param0], %rd1;
  .param .b64 retval0;
  call.uni (retval0), malloc, (param0);
  ld.param.b64 %rd2, [retval0];
  }
  ret;
}
)";
  Module module;
  std::string error;
  ASSERT_TRUE(Parse(text, module, error)) << error;
  EXPECT_EQ(module.data_bytes, 4096u + 16 * 8 + 256 * 4);
  ASSERT_EQ(module.entries.size(), 3u);
  EXPECT_EQ(module.entries[0].local_bytes, 0u) << "a .func's local arrays are not the entry's";
  EXPECT_FALSE(module.entries[0].uses_malloc);
  EXPECT_EQ(module.entries[1].local_bytes, 16384u) << "the largest local array of the body";
  EXPECT_FALSE(module.entries[1].uses_malloc);
  EXPECT_TRUE(module.entries[2].uses_malloc);
  EXPECT_EQ(module.entries[2].local_bytes, 0u);
}

// Module variables as nvcc writes them: byte arrays with trailing zeros left out, a float's bits, a negative value.
TEST(PtxTest, ReadsModuleVariablesAndTheirInitialValues) {
  const char* text = R"(.version 9.0
.target sm_90
.address_size 64
.global .align 4 .b8 counter[16] = {7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0, 10};
.global .align 4 .f32 scale_f = 0f3FC00000;
.global .align 4 .u32 offset = -2;
.const .align 4 .b8 coeffs[32];
.extern .global .align 4 .u32 elsewhere;
.visible .entry k(.param .u64 p) { ret; }
)";
  Module module;
  std::string error;
  ASSERT_TRUE(Parse(text, module, error)) << error;
  ASSERT_EQ(module.globals.size(), 4u);
  EXPECT_EQ(module.globals[0].name, "counter");
  EXPECT_EQ(module.globals[0].bytes, 16u);
  EXPECT_EQ(module.globals[0].initial, (std::vector<std::uint8_t>{7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0, 10}));
  EXPECT_EQ(module.globals[1].name, "scale_f");
  EXPECT_EQ(module.globals[1].initial, (std::vector<std::uint8_t>{0x00, 0x00, 0xc0, 0x3f}));  // 1.5f
  EXPECT_EQ(module.globals[2].initial, (std::vector<std::uint8_t>{0xfe, 0xff, 0xff, 0xff}));
  EXPECT_EQ(module.globals[3].name, "coeffs");
  EXPECT_TRUE(module.globals[3].initial.empty());
  EXPECT_EQ(module.data_bytes, 16u + 4 + 4 + 32);
}

}  // namespace
}  // namespace fakecuda::ptx
