// Tests cuGetProcAddress resolution: the lookup rules on a small hand-built table, then the table generated from
// cudaTypedefs.h, against answers of the real driver (580.159.04, CUDA 13.0) recorded on an H100.
//
// tests/unit/CMakeLists.txt:
//   add_executable(proc_address_test proc_address_test.cc)
//   target_link_libraries(proc_address_test PRIVATE fakecuda_symbol_tables fakecuda_test_stand_ins
//                         GTest::gtest_main vgpu_warnings)
//   gtest_discover_tests(proc_address_test)
// (fakecuda_symbol_tables and fakecuda_test_stand_ins come from fakecuda/driver/symbols.cmake.)
#include "proc_address.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace fakecuda {
namespace {

constexpr int kDriverVersion = 13000;

// Distinct functions for the hand-built table; only their addresses matter.
void AllocFirst() {}
void AllocSecond() {}
void LaunchLegacy() {}
void LaunchPerThread() {}
void CaptureInfoLegacyFirst() {}
void CaptureInfoLegacySecond() {}
void CaptureInfoPerThreadFirst() {}
void CaptureInfoPerThreadSecond() {}

// Sorted by base name, as ResolveProcAddress requires.
constexpr ProcEntry kSmallTable[] = {
    {"cuLaunchKernel", 4000, StreamFlavour::kLegacy, &LaunchLegacy, "cuLaunchKernel"},
    {"cuLaunchKernel", 7000, StreamFlavour::kPerThread, &LaunchPerThread, "cuLaunchKernel_ptsz"},
    {"cuMemAlloc", 2000, StreamFlavour::kAny, &AllocFirst, "cuMemAlloc"},
    {"cuMemAlloc", 3020, StreamFlavour::kAny, &AllocSecond, "cuMemAlloc_v2"},
    {"cuStreamGetCaptureInfo", 10010, StreamFlavour::kLegacy, &CaptureInfoLegacyFirst, "cuStreamGetCaptureInfo"},
    {"cuStreamGetCaptureInfo", 11030, StreamFlavour::kLegacy, &CaptureInfoLegacySecond, "cuStreamGetCaptureInfo_v2"},
    {"cuStreamGetCaptureInfo", 10010, StreamFlavour::kPerThread, &CaptureInfoPerThreadFirst,
     "cuStreamGetCaptureInfo_ptsz"},
    {"cuStreamGetCaptureInfo", 11030, StreamFlavour::kPerThread, &CaptureInfoPerThreadSecond,
     "cuStreamGetCaptureInfo_v2_ptsz"},
};

constexpr std::uint64_t kDefault = CU_GET_PROC_ADDRESS_DEFAULT;
constexpr std::uint64_t kLegacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
constexpr std::uint64_t kPerThread = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

// The exported symbol a lookup found, "" when it found none, "INVALID_VALUE" when the request was refused.
std::string Found(std::string_view symbol, int cuda_version, std::uint64_t flags,
                  std::span<const ProcEntry> table = kSmallTable) {
  const ProcLookup lookup = ResolveProcAddress(symbol, cuda_version, flags, kDriverVersion, table);
  if (lookup.result == CUDA_ERROR_INVALID_VALUE) return "INVALID_VALUE";
  EXPECT_EQ(lookup.result, CUDA_SUCCESS);
  if (lookup.entry == nullptr) return "";
  EXPECT_EQ(lookup.status, CU_GET_PROC_ADDRESS_SUCCESS);
  return lookup.entry->symbol_name;
}

CUdriverProcAddressQueryResult StatusOf(std::string_view symbol, int cuda_version, std::uint64_t flags,
                                        std::span<const ProcEntry> table = kSmallTable) {
  return ResolveProcAddress(symbol, cuda_version, flags, kDriverVersion, table).status;
}

TEST(ResolveProcAddress, PicksTheNewestVariantNotNewerThanTheRequestedVersion) {
  EXPECT_EQ(Found("cuMemAlloc", 12000, kDefault), "cuMemAlloc_v2");
  EXPECT_EQ(Found("cuMemAlloc", 3020, kDefault), "cuMemAlloc_v2");
  EXPECT_EQ(Found("cuMemAlloc", 3010, kDefault), "cuMemAlloc");
  EXPECT_EQ(Found("cuMemAlloc", 2000, kDefault), "cuMemAlloc");
  EXPECT_EQ(Found("cuStreamGetCaptureInfo", 11020, kDefault), "cuStreamGetCaptureInfo");
}

TEST(ResolveProcAddress, ReturnsTheAddressOfTheRowFound) {
  const ProcLookup lookup = ResolveProcAddress("cuMemAlloc", 12000, kDefault, kDriverVersion, kSmallTable);
  ASSERT_NE(lookup.entry, nullptr);
  EXPECT_EQ(lookup.entry->address, &AllocSecond);
}

TEST(ResolveProcAddress, VersionOlderThanEveryVariantIsNotSufficient) {
  EXPECT_EQ(Found("cuMemAlloc", 1990, kDefault), "");
  EXPECT_EQ(StatusOf("cuMemAlloc", 1990, kDefault), CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
  EXPECT_EQ(StatusOf("cuMemAlloc", 0, kDefault), CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
}

TEST(ResolveProcAddress, UnknownNamesAreNotFoundAndNamesMatchExactly) {
  for (std::string_view name :
       {"cuNoSuchThing", "cuMemAlloc_v2", "cuLaunchKernel_ptsz", "cumemalloc", "cuMemAlloc ", "cuMemAllo", "", "zzz"}) {
    EXPECT_EQ(Found(name, 13000, kDefault), "") << name;
    EXPECT_EQ(StatusOf(name, 13000, kDefault), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND) << name;
  }
}

TEST(ResolveProcAddress, DefaultAndLegacyFlagsPickTheLegacyVariant) {
  EXPECT_EQ(Found("cuLaunchKernel", 13000, kDefault), "cuLaunchKernel");
  EXPECT_EQ(Found("cuLaunchKernel", 13000, kLegacy), "cuLaunchKernel");
  EXPECT_EQ(Found("cuStreamGetCaptureInfo", 13000, kDefault), "cuStreamGetCaptureInfo_v2");
}

TEST(ResolveProcAddress, PerThreadFlagPicksThePerThreadVariantAndWinsOverLegacy) {
  EXPECT_EQ(Found("cuLaunchKernel", 13000, kPerThread), "cuLaunchKernel_ptsz");
  EXPECT_EQ(Found("cuLaunchKernel", 13000, kPerThread | kLegacy), "cuLaunchKernel_ptsz");
  EXPECT_EQ(Found("cuStreamGetCaptureInfo", 11030, kPerThread), "cuStreamGetCaptureInfo_v2_ptsz");
  EXPECT_EQ(Found("cuStreamGetCaptureInfo", 11020, kPerThread), "cuStreamGetCaptureInfo_ptsz");
}

TEST(ResolveProcAddress, PerThreadRequestNeverFallsBackToLegacyVariantsOfTheSameName) {
  // cuLaunchKernel (4000) exists, cuLaunchKernel_ptsz only from 7000: the real driver finds nothing.
  EXPECT_EQ(Found("cuLaunchKernel", 5000, kPerThread), "");
  EXPECT_EQ(StatusOf("cuLaunchKernel", 5000, kPerThread), CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
}

TEST(ResolveProcAddress, PerThreadRequestForANameWithoutPerThreadVariantsGetsTheOrdinaryOne) {
  EXPECT_EQ(Found("cuMemAlloc", 13000, kPerThread), "cuMemAlloc_v2");
}

TEST(ResolveProcAddress, UnknownFlagBitsAreInvalid) {
  for (std::uint64_t flags : {std::uint64_t{4}, std::uint64_t{5}, std::uint64_t{6}, std::uint64_t{7},
                              std::uint64_t{0x100}, std::uint64_t{1} << 32}) {
    EXPECT_EQ(Found("cuMemAlloc", 13000, flags), "INVALID_VALUE") << flags;
    EXPECT_EQ(Found("cuNoSuchThing", 13000, flags), "INVALID_VALUE") << flags;
  }
}

TEST(ResolveProcAddress, VersionNewerThanTheDriverIsInvalid) {
  EXPECT_EQ(Found("cuMemAlloc", kDriverVersion + 10, kDefault), "INVALID_VALUE");
  EXPECT_EQ(Found("cuNoSuchThing", kDriverVersion + 1, kDefault), "INVALID_VALUE");
  EXPECT_EQ(Found("cuMemAlloc", kDriverVersion, kDefault), "cuMemAlloc_v2");
}

TEST(ResolveProcAddress, NegativeVersionMeansTheNewestVariant) {
  EXPECT_EQ(Found("cuMemAlloc", -1, kDefault), "cuMemAlloc_v2");
  EXPECT_EQ(Found("cuMemAlloc", INT_MIN, kDefault), "cuMemAlloc_v2");
  EXPECT_EQ(Found("cuLaunchKernel", -1, kPerThread), "cuLaunchKernel_ptsz");
}

TEST(GetProcAddressV2, FoundWritesTheFunctionAndSuccess) {
  void* pfn = nullptr;
  auto status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
  EXPECT_EQ(GetProcAddressV2("cuMemAlloc", &pfn, 13000, kDefault, &status, kDriverVersion, kSmallTable), CUDA_SUCCESS);
  EXPECT_EQ(pfn, reinterpret_cast<void*>(&AllocSecond));
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(GetProcAddressV2("cuMemAlloc", &pfn, 2000, kDefault, nullptr, kDriverVersion, kSmallTable), CUDA_SUCCESS);
  EXPECT_EQ(pfn, reinterpret_cast<void*>(&AllocFirst));
}

TEST(GetProcAddressV2, NotFoundIsSuccessWithNullAndTheReason) {
  void* pfn = reinterpret_cast<void*>(&AllocFirst);
  auto status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
  EXPECT_EQ(GetProcAddressV2("cuNoSuchThing", &pfn, 13000, kDefault, &status, kDriverVersion, kSmallTable),
            CUDA_SUCCESS);
  EXPECT_EQ(pfn, nullptr);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  pfn = reinterpret_cast<void*>(&AllocFirst);
  EXPECT_EQ(GetProcAddressV2("cuLaunchKernel", &pfn, 5000, kPerThread, &status, kDriverVersion, kSmallTable),
            CUDA_SUCCESS);
  EXPECT_EQ(pfn, nullptr);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
}

TEST(GetProcAddressV2, InvalidRequestsLeaveTheOutputsUntouched) {
  void* const untouched = reinterpret_cast<void*>(&AllocFirst);
  void* pfn = untouched;
  // A valid enumerator as the sentinel (loading 77 from the enum is undefined behaviour), one the call must not
  // write here.
  auto status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
  EXPECT_EQ(GetProcAddressV2("cuMemAlloc", &pfn, 13000, 4, &status, kDriverVersion, kSmallTable),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(GetProcAddressV2("cuMemAlloc", &pfn, 13010, kDefault, &status, kDriverVersion, kSmallTable),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(pfn, untouched);
  EXPECT_EQ(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
}

TEST(GetProcAddressV2, NullSymbolOrNullPfnIsInvalidNotACrash) {
  void* pfn = nullptr;
  EXPECT_EQ(GetProcAddressV2(nullptr, &pfn, 13000, kDefault, nullptr, kDriverVersion, kSmallTable),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(GetProcAddressV2("cuMemAlloc", nullptr, 13000, kDefault, nullptr, kDriverVersion, kSmallTable),
            CUDA_ERROR_INVALID_VALUE);
}

TEST(GetProcAddressV1, NotFoundIsAnErrorAndLeavesPfnUntouched) {
  void* const untouched = reinterpret_cast<void*>(&AllocFirst);
  void* pfn = untouched;
  EXPECT_EQ(GetProcAddressV1("cuNoSuchThing", &pfn, 13000, kDefault, kDriverVersion, kSmallTable),
            CUDA_ERROR_NOT_FOUND);
  EXPECT_EQ(GetProcAddressV1("cuMemAlloc", &pfn, 1000, kDefault, kDriverVersion, kSmallTable), CUDA_ERROR_NOT_FOUND);
  EXPECT_EQ(GetProcAddressV1("cuMemAlloc", &pfn, 13000, 4, kDriverVersion, kSmallTable), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(pfn, untouched);
  EXPECT_EQ(GetProcAddressV1("cuMemAlloc", &pfn, 13000, kDefault, kDriverVersion, kSmallTable), CUDA_SUCCESS);
  EXPECT_EQ(pfn, reinterpret_cast<void*>(&AllocSecond));
}

// ---- the generated table ---------------------------------------------------------------------------------

std::string Generated(std::string_view symbol, int cuda_version, std::uint64_t flags) {
  return Found(symbol, cuda_version, flags, GeneratedProcTable());
}

TEST(GeneratedProcTable, IsSortedByBaseNameWithEveryRowFilledIn) {
  const auto table = GeneratedProcTable();
  ASSERT_GT(table.size(), 400u);
  EXPECT_TRUE(std::is_sorted(table.begin(), table.end(), [](const ProcEntry& a, const ProcEntry& b) {
    return std::string_view(a.base) < std::string_view(b.base);
  }));
  std::set<std::tuple<std::string, int, StreamFlavour>> keys;
  for (const ProcEntry& row : table) {
    EXPECT_NE(row.address, nullptr) << row.symbol_name;
    EXPECT_GE(row.version, 2000) << row.symbol_name;
    EXPECT_TRUE(std::string_view(row.symbol_name).starts_with(row.base)) << row.symbol_name;
    EXPECT_TRUE(keys.emplace(row.base, row.version, row.flavour).second)
        << "two rows for " << row.base << " " << row.version;
  }
}

TEST(GeneratedProcTable, ANameHasEitherOnlyOrdinaryRowsOrLegacyAndPerThreadRows) {
  const auto table = GeneratedProcTable();
  for (auto first = table.begin(); first != table.end();) {
    auto last = first;
    std::set<StreamFlavour> flavours;
    while (last != table.end() && std::strcmp(last->base, first->base) == 0) flavours.insert((last++)->flavour);
    if (flavours.count(StreamFlavour::kAny) != 0) {
      EXPECT_EQ(flavours.size(), 1u) << first->base;
    } else {
      EXPECT_EQ(flavours, (std::set{StreamFlavour::kLegacy, StreamFlavour::kPerThread})) << first->base;
    }
    first = last;
  }
}

// Each expectation below is what the real driver answered.
TEST(GeneratedProcTable, MatchesTheRealDriver) {
  EXPECT_EQ(Generated("cuMemAlloc", 12000, kDefault), "cuMemAlloc_v2");
  EXPECT_EQ(Generated("cuMemAlloc", 2000, kDefault), "cuMemAlloc");
  EXPECT_EQ(Generated("cuMemAlloc", 1990, kDefault), "");
  EXPECT_EQ(Generated("cuLaunchKernel", 13000, kPerThread), "cuLaunchKernel_ptsz");
  EXPECT_EQ(Generated("cuLaunchKernel", 13000, kDefault), "cuLaunchKernel");
  EXPECT_EQ(Generated("cuLaunchKernel", 6990, kPerThread), "");
  EXPECT_EQ(Generated("cuMemcpyHtoD", 13000, kPerThread), "cuMemcpyHtoD_v2_ptds");
  EXPECT_EQ(Generated("cuMemcpyHtoD", 13000, kDefault), "cuMemcpyHtoD_v2");
  EXPECT_EQ(Generated("cuMemcpyHtoD", 3010, kLegacy), "cuMemcpyHtoD");
  EXPECT_EQ(Generated("cuCtxCreate", 13000, kDefault), "cuCtxCreate_v4");
  EXPECT_EQ(Generated("cuCtxCreate", 12040, kDefault), "cuCtxCreate_v3");
  EXPECT_EQ(Generated("cuCtxCreate", 3020, kDefault), "cuCtxCreate_v2");
  EXPECT_EQ(Generated("cuCtxCreate", 2000, kDefault), "cuCtxCreate");
  EXPECT_EQ(Generated("cuStreamGetCaptureInfo", 13000, kPerThread), "cuStreamGetCaptureInfo_v3_ptsz");
  EXPECT_EQ(Generated("cuStreamGetCaptureInfo", 11030, kPerThread), "cuStreamGetCaptureInfo_v2_ptsz");
  EXPECT_EQ(Generated("cuStreamBeginCapture", 10000, kPerThread), "cuStreamBeginCapture_ptsz");
  EXPECT_EQ(Generated("cuMemPrefetchAsync", 13000, kPerThread), "cuMemPrefetchAsync_v2_ptsz");
  EXPECT_EQ(Generated("cuStreamGetCtx", 12050, kPerThread), "cuStreamGetCtx_v2_ptsz");
  EXPECT_EQ(Generated("cuTexRefSetAddress2D", 4000, kDefault), "cuTexRefSetAddress2D_v2");
  EXPECT_EQ(Generated("cuTexRefSetAddress2D", 13000, kDefault), "cuTexRefSetAddress2D_v3");
  EXPECT_EQ(Generated("cuGraphInstantiate", 13000, kDefault), "cuGraphInstantiate_v2");
  EXPECT_EQ(Generated("cuGetProcAddress", 11030, kDefault), "cuGetProcAddress");
  EXPECT_EQ(Generated("cuGetProcAddress", 13000, kDefault), "cuGetProcAddress_v2");
  EXPECT_EQ(Generated("cuGLMapBufferObject", 13000, kPerThread), "cuGLMapBufferObject_v2_ptds");
  EXPECT_EQ(Generated("cuProfilerStart", 13000, kDefault), "cuProfilerStart");
  EXPECT_EQ(Generated("cuGetExportTable", 13000, kDefault), "cuGetExportTable");
  EXPECT_EQ(Generated("cuNoSuchThing", 13000, kDefault), "");
  EXPECT_EQ(StatusOf("cuNoSuchThing", 13000, kDefault, GeneratedProcTable()), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  // Exported by the real driver, yet not resolvable through cuGetProcAddress there either.
  EXPECT_EQ(StatusOf("cuMemGetAttribute", 13000, kDefault, GeneratedProcTable()), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  EXPECT_EQ(Generated("cuMemAlloc", 13000, 4), "INVALID_VALUE");
  EXPECT_EQ(Generated("cuMemAlloc", 13010, kDefault), "INVALID_VALUE");
}

TEST(GeneratedProcTable, UnimplementedEntriesReturnNotSupported) {
  ASSERT_GT(kUnimplementedSymbolCount, 0u);
  const std::span<const char* const> names(kUnimplementedSymbolNames, kUnimplementedSymbolCount);
  EXPECT_TRUE(
      std::is_sorted(names.begin(), names.end(), [](const char* a, const char* b) { return std::strcmp(a, b) < 0; }));
  const std::set<std::string_view> unimplemented(names.begin(), names.end());
  int checked = 0;
  for (const ProcEntry& row : GeneratedProcTable()) {
    if (unimplemented.count(row.symbol_name) == 0) continue;
    // A stub is defined as `int NAME(void)`, so calling it through that type is calling it as defined.
    EXPECT_EQ(reinterpret_cast<int (*)()>(row.address)(), CUDA_ERROR_NOT_SUPPORTED) << row.symbol_name;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

}  // namespace
}  // namespace fakecuda
