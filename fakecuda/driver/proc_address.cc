// cuGetProcAddress resolution over fakecuda's entry-point table; the rules and the evidence are in proc_address.h.
#include "proc_address.h"

#include <algorithm>
#include <climits>

namespace fakecuda {
namespace {

constexpr std::uint64_t kKnownFlags = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

}  // namespace

ProcLookup ResolveProcAddress(std::string_view symbol, int cuda_version, std::uint64_t flags, int driver_version,
                              std::span<const ProcEntry> table) {
  if ((flags & ~kKnownFlags) != 0 || cuda_version > driver_version) {
    return {CUDA_ERROR_INVALID_VALUE, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, nullptr};
  }
  // The real driver reads any negative version as "the newest variant".
  const int newest_wanted = cuda_version < 0 ? INT_MAX : cuda_version;

  const auto by_base = [](const ProcEntry& entry, std::string_view name) {
    return std::string_view(entry.base) < name;
  };
  const auto first = std::lower_bound(table.begin(), table.end(), symbol, by_base);
  auto last = first;
  while (last != table.end() && std::string_view(last->base) == symbol) ++last;
  if (first == last) return {CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, nullptr};

  // A name with per-thread variants answers a per-thread request from those alone, never from its legacy ones.
  const bool per_thread_wanted = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  const bool has_per_thread =
      std::any_of(first, last, [](const ProcEntry& entry) { return entry.flavour == StreamFlavour::kPerThread; });
  const StreamFlavour wanted =
      !has_per_thread ? StreamFlavour::kAny : (per_thread_wanted ? StreamFlavour::kPerThread : StreamFlavour::kLegacy);

  const ProcEntry* best = nullptr;
  for (auto row = first; row != last; ++row) {
    if (row->flavour != wanted || row->version > newest_wanted) continue;
    if (best == nullptr || row->version > best->version) best = &*row;
  }
  if (best == nullptr) return {CUDA_SUCCESS, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, nullptr};
  return {CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS, best};
}

CUresult GetProcAddressV2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                          CUdriverProcAddressQueryResult* symbol_status, int driver_version,
                          std::span<const ProcEntry> table) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ProcLookup lookup = ResolveProcAddress(symbol, cuda_version, flags, driver_version, table);
  if (lookup.result != CUDA_SUCCESS) return lookup.result;
  *pfn = lookup.entry != nullptr ? reinterpret_cast<void*>(lookup.entry->address) : nullptr;
  if (symbol_status != nullptr) *symbol_status = lookup.status;
  return CUDA_SUCCESS;
}

CUresult GetProcAddressV1(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags, int driver_version,
                          std::span<const ProcEntry> table) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ProcLookup lookup = ResolveProcAddress(symbol, cuda_version, flags, driver_version, table);
  if (lookup.result != CUDA_SUCCESS) return lookup.result;
  if (lookup.entry == nullptr) return CUDA_ERROR_NOT_FOUND;
  *pfn = reinterpret_cast<void*>(lookup.entry->address);
  return CUDA_SUCCESS;
}

}  // namespace fakecuda
