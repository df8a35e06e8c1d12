// See host_oom.h.
#include "host_oom.h"

#include <link.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace vgpu::shimtest {
namespace {

std::atomic<unsigned> g_percent{0};
std::atomic<std::uint64_t> g_seed{1};
std::atomic<std::uint64_t> g_generation{0};  // a new arming restarts every thread's draws
std::atomic<std::uint64_t> g_injected{0};
std::atomic<std::uint64_t> g_seen{0};
std::uintptr_t g_shim_begin = 0, g_shim_end = 0;  // libvgpu.so's executable segments (one range: first to last)

int FindShim(dl_phdr_info* info, std::size_t, void*) {
  if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, "libvgpu.so") == nullptr) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& segment = info->dlpi_phdr[i];
    if (segment.p_type != PT_LOAD || (segment.p_flags & PF_X) == 0) continue;
    const std::uintptr_t begin = info->dlpi_addr + segment.p_vaddr;
    const std::uintptr_t end = begin + segment.p_memsz;
    if (g_shim_begin == 0 || begin < g_shim_begin) g_shim_begin = begin;
    if (end > g_shim_end) g_shim_end = end;
  }
  return 1;
}

bool FailThisOne(const void* caller) {
  const unsigned percent = g_percent.load(std::memory_order_relaxed);
  if (percent == 0) return false;
  const auto address = reinterpret_cast<std::uintptr_t>(caller);
  if (address < g_shim_begin || address >= g_shim_end) return false;
  g_seen.fetch_add(1, std::memory_order_relaxed);
  thread_local std::uint64_t state = 0, generation = ~std::uint64_t{0};
  if (generation != g_generation.load(std::memory_order_relaxed)) {
    generation = g_generation.load(std::memory_order_relaxed);
    state = g_seed.load(std::memory_order_relaxed) ^ (reinterpret_cast<std::uintptr_t>(&state) * 0x9e3779b97f4a7c15ull);
  }
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  if (z % 100 >= percent) return false;
  g_injected.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace

bool ArmHostOom(unsigned percent, std::uint64_t seed) {
  if (g_shim_end == 0) dl_iterate_phdr(&FindShim, nullptr);
  if (g_shim_end == 0) return false;
  g_seed.store(seed, std::memory_order_relaxed);
  g_generation.fetch_add(1, std::memory_order_relaxed);
  g_percent.store(percent > 100 ? 100 : percent, std::memory_order_release);
  return true;
}

void DisarmHostOom() { g_percent.store(0, std::memory_order_release); }
std::uint64_t HostOomInjected() { return g_injected.load(); }
std::uint64_t HostOomSeen() { return g_seen.load(); }

}  // namespace vgpu::shimtest

// libvgpu.so carries its own libstdc++ (linked statically, hidden): its operator new is its own, and calls malloc, the
// process's. So the process's malloc is where the shim's allocations can be made to fail: this one, the executable's,
// interposes every library's (the worker exports it). It hands the rest to the allocator that would have served
// them: a sanitizer's where one is loaded (its interceptor), glibc's otherwise.
extern "C" void* __libc_malloc(std::size_t size);
extern "C" void* __interceptor_malloc(std::size_t size) __attribute__((weak));

extern "C" void* malloc(std::size_t size) {
  if (vgpu::shimtest::FailThisOne(__builtin_return_address(0))) {
    errno = ENOMEM;
    return nullptr;
  }
  return __interceptor_malloc != nullptr ? __interceptor_malloc(size) : __libc_malloc(size);
}
