// Every route to a driver function leads to the hook: direct linking (the exported hooks themselves), dlsym on a
// libcuda/libnvidia-ml handle or RTLD_NEXT/RTLD_DEFAULT (the exported dlsym below), and cuGetProcAddress(_v2)
// for any version and flags (the real answer, swapped for the hook standing in for it).
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string_view>

#include "shim.h"

namespace vgpu::hooks {
namespace {

using DlsymFunction = void* (*)(void*, const char*);

// Code on the dlsym path may run inside a sanitizer runtime's start-up: keep it uninstrumented. (Sanitizer builds
// do not export dlsym at all, see VGPU_SHIM_EXPORT_DLSYM: ASan calls dlsym before it can serve the dlopen its
// interceptor stands for.)
#define VGPU_UNINSTRUMENTED __attribute__((no_sanitize("address", "thread", "undefined")))

struct NamedHook {
  const char* name;
  void* hook;
};

// Sorted by name at first use; built from the one table.
NamedHook g_named_hooks[] = {
#define VGPU_NAMED_HOOK(name) {#name, reinterpret_cast<void*>(&::name)},
    VGPU_CUDA_HOOKS(VGPU_NAMED_HOOK) VGPU_NVML_HOOKS(VGPU_NAMED_HOOK)
#undef VGPU_NAMED_HOOK
};
constexpr std::size_t kHookCount = sizeof g_named_hooks / sizeof g_named_hooks[0];

struct RealToHook {
  const void* real;
  void* hook;
};
RealToHook g_real_to_hook[kHookCount];
std::atomic<std::size_t> g_real_to_hook_count{0};

std::once_flag g_sort_once;
std::mutex g_resolve_mutex;
std::atomic<bool> g_cuda_resolved{false};
std::atomic<bool> g_nvml_resolved{false};

// glibc's own dlsym, never ours: from the next object that defines it (libc.so.6 since glibc 2.34, libdl before).
// No lambdas or guarded statics here: they would be instrumented code. Every thread computes the same value, so a
// racing first call is harmless; the atomics make that explicit.
VGPU_UNINSTRUMENTED DlsymFunction RealDlsym() {
  static DlsymFunction real = nullptr;
  DlsymFunction found = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
  if (found == nullptr) {
    // glibc's own: the next object after this library that defines it (libc.so.6 since glibc 2.34, libdl before).
    found = reinterpret_cast<DlsymFunction>(dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34"));
    if (found == nullptr) found = reinterpret_cast<DlsymFunction>(dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5"));
    if (found != nullptr) __atomic_store_n(&real, found, __ATOMIC_RELEASE);  // a failure is retried next time
  }
  return found;
}

// The base address of this library, to reject a "real" function that is one of our own hooks.
VGPU_UNINSTRUMENTED const void* OwnBase() {
  static const void* base = nullptr;
  const void* found = __atomic_load_n(&base, __ATOMIC_ACQUIRE);
  if (found == nullptr) {
    Dl_info info;
    if (dladdr(reinterpret_cast<const void*>(&RealDlsym), &info) != 0) found = info.dli_fbase;
    __atomic_store_n(&base, found, __ATOMIC_RELEASE);
  }
  return found;
}

void* Resolve(void* handle, const char* name) {
  DlsymFunction real = RealDlsym();
  if (real == nullptr || handle == nullptr) return nullptr;
  void* address = real(handle, name);
  if (address == nullptr) return nullptr;
  Dl_info info{};
  if (dladdr(address, &info) != 0 && info.dli_fbase == OwnBase()) return nullptr;  // ourselves: not the driver
  return address;
}

void* OpenLibrary(const char* soname) {
  void* handle = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
  return handle != nullptr ? handle : dlopen(soname, RTLD_LAZY);
}

VGPU_UNINSTRUMENTED bool IsDriverName(const char* symbol) {
  return symbol != nullptr && ((symbol[0] == 'c' && symbol[1] == 'u') || std::strncmp(symbol, "nvml", 4) == 0);
}

// dlsym(RTLD_NEXT, ...) forwarded through us would mean "next after libvgpu"; the caller meant "next after
// itself": search the objects loaded after the caller's, in order.
[[maybe_unused]] VGPU_UNINSTRUMENTED void* NextAfter(const void* caller, const char* symbol) {
  Dl_info info{};
  struct link_map* map = nullptr;
  if (dladdr1(caller, &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) == 0 || map == nullptr) return nullptr;
  DlsymFunction real = RealDlsym();
  for (struct link_map* next = map->l_next; next != nullptr; next = next->l_next) {
    // A link_map is not a handle for every object (a preloaded one has no search list): take a real handle of
    // the loaded object by name, without loading anything.
    if (next->l_name == nullptr || next->l_name[0] == '\0' || next->l_addr == reinterpret_cast<ElfW(Addr)>(OwnBase())) {
      continue;
    }
    void* handle = dlopen(next->l_name, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    void* found = real(handle, symbol);
    dlclose(handle);
    if (found != nullptr) return found;
  }
  return nullptr;
}

}  // namespace

bool ResolveReal() {
  if (g_cuda_resolved.load(std::memory_order_acquire)) return Real::cuInit != nullptr;
  std::lock_guard<std::mutex> guard(g_resolve_mutex);
  if (!g_cuda_resolved.load(std::memory_order_relaxed)) {
    void* cuda = OpenLibrary("libcuda.so.1");
#define VGPU_RESOLVE(name) Real::name = reinterpret_cast<decltype(&::name)>(Resolve(cuda, #name));
    VGPU_CUDA_HOOKS(VGPU_RESOLVE)
    VGPU_CUDA_HELPERS(VGPU_RESOLVE)
#undef VGPU_RESOLVE
    std::size_t count = g_real_to_hook_count.load(std::memory_order_relaxed);
#define VGPU_MAP_REAL(name)  \
  if (Real::name != nullptr) \
    g_real_to_hook[count++] = {reinterpret_cast<const void*>(Real::name), reinterpret_cast<void*>(&::name)};
    VGPU_CUDA_HOOKS(VGPU_MAP_REAL)
#undef VGPU_MAP_REAL
    g_real_to_hook_count.store(count, std::memory_order_release);
    g_cuda_resolved.store(true, std::memory_order_release);
  }
  return Real::cuInit != nullptr;
}

bool ResolveRealNvml() {
  if (g_nvml_resolved.load(std::memory_order_acquire)) return Real::nvmlInit_v2 != nullptr;
  std::lock_guard<std::mutex> guard(g_resolve_mutex);
  if (!g_nvml_resolved.load(std::memory_order_relaxed)) {
    void* nvml = OpenLibrary("libnvidia-ml.so.1");
#define VGPU_RESOLVE(name) Real::name = reinterpret_cast<decltype(&::name)>(Resolve(nvml, #name));
    VGPU_NVML_HOOKS(VGPU_RESOLVE)
    VGPU_NVML_HELPERS(VGPU_RESOLVE)
#undef VGPU_RESOLVE
    g_nvml_resolved.store(true, std::memory_order_release);
  }
  return Real::nvmlInit_v2 != nullptr;
}

void* HookFor(const char* symbol) {
  if (!IsDriverName(symbol)) return nullptr;
  std::call_once(g_sort_once, [] {
    std::sort(std::begin(g_named_hooks), std::end(g_named_hooks),
              [](const NamedHook& a, const NamedHook& b) { return std::strcmp(a.name, b.name) < 0; });
  });
  const auto it =
      std::lower_bound(std::begin(g_named_hooks), std::end(g_named_hooks), symbol,
                       [](const NamedHook& hook, const char* name) { return std::strcmp(hook.name, name) < 0; });
  return it != std::end(g_named_hooks) && std::strcmp(it->name, symbol) == 0 ? it->hook : nullptr;
}

void* HookForRealAddress(const void* real_address) {
  ResolveReal();
  const std::size_t count = g_real_to_hook_count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < count; ++i) {
    if (g_real_to_hook[i].real == real_address) return g_real_to_hook[i].hook;
  }
  return nullptr;
}

}  // namespace vgpu::hooks

using namespace vgpu::hooks;

#if VGPU_SHIM_EXPORT_DLSYM
// The dlsym route: an application (or cuda-python, or PyTorch's lazy loader) that looks a hooked CUDA or NVML
// symbol up on any handle gets the hook; every other lookup is glibc's answer.
extern "C" VGPU_EXPORT VGPU_UNINSTRUMENTED void* dlsym(void* handle, const char* symbol) noexcept {
  void* found = nullptr;
  if (handle == RTLD_NEXT) {
    found = NextAfter(__builtin_return_address(0), symbol);
  } else if (DlsymFunction real = RealDlsym(); real != nullptr) {
    found = real(handle, symbol);
  }
  if (found != nullptr && IsDriverName(symbol)) {
    if (void* hook = HookFor(symbol); hook != nullptr) return hook;
  }
  return found;
}
#endif  // VGPU_SHIM_EXPORT_DLSYM

// The cuGetProcAddress route: ask the driver (so versions and flags are resolved exactly as it does), then hand
// out our hook for the function it chose.
extern "C" VGPU_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                                                    CUdriverProcAddressQueryResult* status) try {
  if (!ResolveReal() || Real::cuGetProcAddress_v2 == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult result = Real::cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, status);
  if (result == CUDA_SUCCESS && pfn != nullptr && *pfn != nullptr) {
    if (void* hook = HookForRealAddress(*pfn); hook != nullptr) *pfn = hook;
  }
  return result;
}
VGPU_CUDA_CATCH

extern "C" VGPU_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version,
                                                 cuuint64_t flags) try {
  if (!ResolveReal() || Real::cuGetProcAddress == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult result = Real::cuGetProcAddress(symbol, pfn, cuda_version, flags);
  if (result == CUDA_SUCCESS && pfn != nullptr && *pfn != nullptr) {
    if (void* hook = HookForRealAddress(*pfn); hook != nullptr) *pfn = hook;
  }
  return result;
}
VGPU_CUDA_CATCH
