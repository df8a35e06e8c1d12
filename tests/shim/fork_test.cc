// fork under the shim: while two threads allocate and free in a loop, the process forks again and again; each child
// starts CUDA afresh, is counted in the same container under the same limit (the parent's usage included, its own
// counted once), frees, and exits 0; the parent's accounting is untouched by its children.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shim_support.h"

namespace vgpu::shimtest {
namespace {

constexpr std::uint64_t kParentHoldsAtMost = 2 * 2 * 32 * kMiB;  // two threads, two allocations of <= 32 MiB each

// The child's work; returns a description of what went wrong, empty if nothing did. Runs in the forked child: no
// GoogleTest assertion may be used here.
std::string ChildWork(std::uint64_t limit, std::uint64_t parent_context) {
  std::string problems;
  auto check = [&](bool condition, const std::string& what) {
    if (!condition) problems += what + "\n";
  };
  CUresult r = cuInit(0);
  check(r == CUDA_SUCCESS, "cuInit in the child: " + DescribeCudaResult(r));
  if (r != CUDA_SUCCESS) return problems;
  CUcontext context = nullptr;
  r = cuDevicePrimaryCtxRetain(&context, 0);
  check(r == CUDA_SUCCESS, "cuDevicePrimaryCtxRetain in the child: " + DescribeCudaResult(r));
  if (r != CUDA_SUCCESS) return problems;
  cuCtxSetCurrent(context);
  std::size_t free_bytes = 0, total = 0;
  r = cuMemGetInfo_v2(&free_bytes, &total);
  check(r == CUDA_SUCCESS && total == limit, "cuMemGetInfo total in the child: " + std::to_string(total));
  // Both contexts are counted: what is free is at most the limit minus the two of them.
  const std::uint64_t own_context = parent_context;  // the same device, the same context cost
  check(free_bytes <= limit - parent_context - own_context,
        "the child's view does not count both contexts: free " + std::to_string(free_bytes));

  CUdeviceptr mine = 0;
  r = cuMemAlloc_v2(&mine, 64 * kMiB);
  check(r == CUDA_SUCCESS, "cuMemAlloc_v2(64 MiB) in the child: " + DescribeCudaResult(r));
  // Past what is left once the parent's context is counted, but within what would be left without it: refused.
  const std::uint64_t past = limit - own_context - 64 * kMiB - parent_context + kMiB;
  CUdeviceptr over = 0;
  r = cuMemAlloc_v2(&over, past);
  check(r == CUDA_ERROR_OUT_OF_MEMORY,
        "an allocation that fits only if the parent were not counted: " + DescribeCudaResult(r));
  if (r == CUDA_SUCCESS) cuMemFree_v2(over);
  // Within what is left even when the parent holds all it ever holds: granted (the child's own usage counted once).
  const std::uint64_t fits = limit - own_context - 64 * kMiB - parent_context - kParentHoldsAtMost - kMiB;
  CUdeviceptr within = 0;
  r = cuMemAlloc_v2(&within, fits);
  check(r == CUDA_SUCCESS, "an allocation that fits beside everything: " + DescribeCudaResult(r));
  if (within != 0) check(cuMemFree_v2(within) == CUDA_SUCCESS, "cuMemFree_v2 in the child");
  if (mine != 0) check(cuMemFree_v2(mine) == CUDA_SUCCESS, "cuMemFree_v2 in the child");
  cuCtxSetCurrent(nullptr);
  r = cuDevicePrimaryCtxRelease(0);
  check(r == CUDA_SUCCESS, "cuDevicePrimaryCtxRelease in the child: " + DescribeCudaResult(r));
  return problems;
}

TEST(Fork, ChildrenForkedWhileThreadsAllocateWorkAndCountCorrectly) {
  const std::uint64_t limit = ConfiguredLimit();
  ASSERT_GE(limit, 2 * kGiB);
  const std::uint64_t seed = Seed(11);
  ASSERT_CU_OK(cuInit(0));
  CUcontext context = nullptr;
  ASSERT_CU_OK(cuDevicePrimaryCtxRetain(&context, 0));
  ASSERT_CU_OK(cuCtxSetCurrent(context));
  const Views base = ReadViews();
  ExpectViewsAgree(base, limit);
  const std::uint64_t parent_context = base.used();

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> granted{0}, refused{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      cuCtxSetCurrent(context);
      std::mt19937_64 random(seed * 10 + static_cast<std::uint64_t>(t));
      std::vector<CUdeviceptr> held;
      while (!stop.load()) {
        if (held.size() < 2 && (held.empty() || random() % 2 == 0)) {
          CUdeviceptr p = 0;
          const CUresult r = cuMemAlloc_v2(&p, kMiB + random() % (31 * kMiB));
          if (r == CUDA_SUCCESS) {
            held.push_back(p);
            granted.fetch_add(1);
          } else if (r == CUDA_ERROR_OUT_OF_MEMORY) {
            refused.fetch_add(1);  // there is room for the parent's threads beside any one child: never expected
          } else {
            errors.fetch_add(1);
          }
        } else {
          if (cuMemFree_v2(held.back()) != CUDA_SUCCESS) errors.fetch_add(1);
          held.pop_back();
        }
      }
      for (CUdeviceptr p : held) cuMemFree_v2(p);
    });
  }

  constexpr int kForks = 40;
  int children_ok = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kForks; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(500 + 100 * i));  // forks land at varied moments
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string problems = ChildWork(limit, parent_context);
      if (!problems.empty()) {
        const ssize_t ignored = write(2, problems.data(), problems.size());
        (void)ignored;
      }
      _exit(problems.empty() ? 0 : 1);
    }
    int status = 0;
    pid_t waited = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((waited = waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (waited == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "child " << i << " did not finish within 10 s (deadlocked after fork?)";
      continue;
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "child " << i << " ended with status " << status << " (its problems are on stderr above)";
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) ++children_ok;
  }
  std::printf("%d of %d children worked, %.0f ms\n", children_ok, kForks, MillisecondsSince(start));
  stop.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0u) << "the parent's threads saw errors";
  EXPECT_EQ(refused.load(), 0u) << "the parent's threads were refused memory that the slice had room for";
  EXPECT_GT(granted.load(), 0u);

  // The parent's accounting: its context alone, in every view, and the host agrees.
  const Views end = ReadViews();
  ExpectViewsAgree(end, limit);
  EXPECT_EQ(end.used(), parent_context) << "the children changed the parent's accounting";
  EXPECT_CU_OK(cuDevicePrimaryCtxRelease(0));
}

}  // namespace
}  // namespace vgpu::shimtest
