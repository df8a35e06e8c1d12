// The shim tests' main: removes what an earlier run of this test left behind (fake machine, region, child files)
// before anything touches CUDA, so every run starts on a fresh machine and a fresh container region.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace {

void RemoveStaleFiles() {
  std::error_code ignored;
  for (const char* variable : {"FAKECUDA_STATE", "CUDA_DEVICE_MEMORY_SHARED_CACHE"}) {
    const char* path = std::getenv(variable);
    if (path != nullptr && *path != '\0' && !std::filesystem::is_directory(path, ignored)) {
      std::filesystem::remove(path, ignored);
    }
  }
  if (const char* folder = std::getenv("SHIM_TMP"); folder != nullptr && *folder != '\0') {
    std::filesystem::remove_all(folder, ignored);
    std::filesystem::create_directories(folder, ignored);
  }
}

}  // namespace

int main(int argc, char** argv) {
  RemoveStaleFiles();
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
