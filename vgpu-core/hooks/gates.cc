// Gated measurements: the word, its watchdog, and giving the word up with its context (gates.h).
#include "gates.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <new>
#include <type_traits>

#include "hook_table.h"
#include "shim.h"

namespace vgpu::hooks::gates {
namespace {

// A gate shut while the word has not moved for this long is opened by the watchdog (the launch call behind it is
// waiting for the GPU, or its thread is stalled: either way the stream must go on). Longer than a busy host keeps a
// thread off its CPU at a time (a scheduler's slice, a few milliseconds), so that a preempted launch call seldom
// looks like one that waits for the GPU; the watchdog looks this often while gates are being shut.
constexpr std::uint64_t kDeadlineNs = 5'000'000;
// The watchdog parks after this long without a gate, and is woken by the next.
constexpr std::uint64_t kParkAfterNs = 100'000'000;
// Each time the watchdog has had to open a gate, no gate is shut for a while: this long the first time, twice as long
// each time after (to kMaxPauseNs), back to this after kForgiveAfterNs without one. A launch call that waits for the
// GPU would cost kDeadlineNs or more at every gate; a thread the host left off its CPU that long costs one pause.
constexpr std::uint64_t kFirstPauseNs = 100'000'000;
constexpr std::uint64_t kMaxPauseNs = 60'000'000'000;
constexpr std::uint64_t kForgiveAfterNs = 10'000'000'000;

// (The shim's clock: Usable's `now_ns` is read from it.)
std::uint64_t NowNs() { return MonotonicNs(); }

// True when `value` is at or past `gate` on the word's cyclic count (the comparison the GPU's ">=" makes).
bool Reached(std::uint32_t value, std::uint32_t gate) { return static_cast<std::int32_t>(value - gate) >= 0; }

struct State {
  // The word, in pinned memory of `context` (null: none yet, or given up with its context). Threads announce
  // themselves in `users` before reading the pointer and writing through it; ForgetContext clears the pointer and
  // then waits for `users` to drain (both sequentially consistent: one side sees the other).
  std::atomic<std::atomic<std::uint32_t>*> word{nullptr};
  std::atomic<CUcontext> context{nullptr};
  std::atomic<std::uint32_t> users{0};
  std::mutex make_mutex;  // making the word and starting the watchdog (no GPU wait is ever made under it)
  std::atomic<bool> unusable{false};
  bool watchdog_started = false;                  // under make_mutex
  std::atomic<std::uint32_t> issued{0};           // the last value a gate waits for
  std::atomic<std::uint64_t> paused_until_ns{0};  // no gate is shut before this (see kFirstPauseNs)
  std::atomic<std::uint64_t> last_shut_ns{0};
  std::atomic<std::uint32_t> parked{0};
  std::atomic<std::uint32_t> wake{0};
};

// Constant-initialized and never destroyed (the watchdog may run while the process exits): nothing here allocates,
// so that giving a word up (on a context's destruction) cannot fail for want of host memory.
static_assert(std::is_trivially_destructible_v<State>);
constinit State g_state;

State& TheState() { return g_state; }

// Raises `word` to `value` unless it is there already; true when it was not (the caller opened the gate).
bool Raise(std::atomic<std::uint32_t>& word, std::uint32_t value) {
  std::uint32_t seen = word.load(std::memory_order_acquire);
  while (!Reached(seen, value)) {
    if (word.compare_exchange_weak(seen, value, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
  }
  return false;
}

// Runs `f(word)` if the word exists, announced in `users` (see State).
template <typename F>
void WithWord(State& s, F&& f) {
  s.users.fetch_add(1, std::memory_order_seq_cst);
  if (std::atomic<std::uint32_t>* word = s.word.load(std::memory_order_seq_cst)) f(*word);
  s.users.fetch_sub(1, std::memory_order_release);
}

void* Watch(void*) {
  State& s = TheState();
  std::uint32_t last_word = 0, last_issued = 0;
  std::uint64_t pause_ns = 0, last_forced_ns = 0, forced = 0;
  for (;;) {
    const std::uint64_t now = NowNs();
    if (now > s.last_shut_ns.load(std::memory_order_acquire) + kParkAfterNs) {
      // Park, unless a gate was shut meanwhile (Shut raises `issued`, then reads `parked`; here the reverse).
      const std::uint32_t wake = s.wake.load(std::memory_order_acquire);
      s.parked.store(1, std::memory_order_seq_cst);
      bool idle = true;
      WithWord(s, [&](std::atomic<std::uint32_t>& word) {
        idle = Reached(word.load(std::memory_order_seq_cst), s.issued.load(std::memory_order_seq_cst));
      });
      if (idle && now > s.last_shut_ns.load(std::memory_order_seq_cst) + kParkAfterNs) s.wake.wait(wake);
      s.parked.store(0, std::memory_order_relaxed);
    }
    struct timespec nap {
      0, static_cast<long>(kDeadlineNs)
    };
    nanosleep(&nap, nullptr);
    bool opened = false;
    WithWord(s, [&](std::atomic<std::uint32_t>& word) {
      const std::uint32_t seen = word.load(std::memory_order_acquire);
      const std::uint32_t issued = s.issued.load(std::memory_order_acquire);
      // A gate shut at the last look and nothing opened since: its time is up.
      opened = !Reached(seen, issued) && seen == last_word && issued == last_issued && Raise(word, issued);
      last_word = seen;
      last_issued = issued;
    });
    if (!opened) continue;
    const std::uint64_t at = NowNs();
    pause_ns =
        pause_ns == 0 || at > last_forced_ns + kForgiveAfterNs ? kFirstPauseNs : std::min(2 * pause_ns, kMaxPauseNs);
    last_forced_ns = at;
    s.paused_until_ns.store(at + pause_ns, std::memory_order_relaxed);
    // (Not while announced in `users`: a write to a stderr nobody reads could block a context's destruction.)
    if (++forced == 1 || pause_ns == kMaxPauseNs) {
      Log(1,
          "a gated measurement's launch call had not returned after %llu ms (%llu so far): the watchdog opened its "
          "gate; no gate for %llu ms (docs/compute-limit.md)",
          static_cast<unsigned long long>(kDeadlineNs / 1'000'000), static_cast<unsigned long long>(forced),
          static_cast<unsigned long long>(pause_ns / 1'000'000));
    }
  }
  return nullptr;
}

// Starts the watchdog with the process's signals blocked (it must never run the process's handlers for them), but not
// the ones a fault of its own raises: blocked, those kill the process with no word of where (a sanitizer's report
// included). The default stack size: a small one overflowed under ASan (CI: the process died of SIGSEGV, silently).
// Caller holds make_mutex.
bool StartWatchdog(State& s) {
  if (s.watchdog_started) return true;
  pthread_attr_t attributes;
  if (pthread_attr_init(&attributes) != 0) return false;
  sigset_t blocked;
  sigfillset(&blocked);
  for (const int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT}) sigdelset(&blocked, fault);
  bool started = pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED) == 0 &&
                 pthread_attr_setsigmask_np(&attributes, &blocked) == 0;
  pthread_t thread;
  started = started && pthread_create(&thread, &attributes, &Watch, nullptr) == 0;
  pthread_attr_destroy(&attributes);
  s.watchdog_started = started;
  return started;
}

}  // namespace

namespace {

// The driver exports what gates need and has not refused them (and this is not a fork child).
bool Supported() {
  return Real::cuStreamWaitValue32_v2 != nullptr && Real::cuMemHostAlloc != nullptr &&
         Real::cuMemHostGetDevicePointer_v2 != nullptr && !TheState().unusable.load(std::memory_order_relaxed);
}

}  // namespace

bool Usable(std::uint64_t now_ns) {
  return Supported() && now_ns >= TheState().paused_until_ns.load(std::memory_order_relaxed);
}

bool Shut(CUstream stream, CUcontext context, Gate& gate) {
  gate = Gate{};
  State& s = TheState();
  if (!Supported()) return false;
  if (s.word.load(std::memory_order_acquire) == nullptr) {
    std::lock_guard<std::mutex> guard(s.make_mutex);
    if (s.word.load(std::memory_order_acquire) == nullptr) {
      if (!StartWatchdog(s)) {
        s.unusable.store(true, std::memory_order_relaxed);
        return false;
      }
      void* memory = nullptr;
      if (Real::cuMemHostAlloc(&memory, 64, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) != CUDA_SUCCESS ||
          memory == nullptr) {
        s.unusable.store(true, std::memory_order_relaxed);
        return false;
      }
      auto* word = new (memory) std::atomic<std::uint32_t>(s.issued.load(std::memory_order_acquire));
      s.context.store(context, std::memory_order_relaxed);
      s.word.store(word, std::memory_order_seq_cst);
    }
  }
  // Only in the word's own context: its memory goes with that context, and so do that context's streams.
  if (s.context.load(std::memory_order_relaxed) != context) return false;
  CUdeviceptr address = 0;
  bool mapped = false;
  WithWord(s, [&](std::atomic<std::uint32_t>& word) {
    mapped = Real::cuMemHostGetDevicePointer_v2(&address, &word, 0) == CUDA_SUCCESS;
  });
  if (!mapped) return false;
  const std::uint32_t value = s.issued.fetch_add(1, std::memory_order_seq_cst) + 1;
  s.last_shut_ns.store(NowNs(), std::memory_order_seq_cst);
  const CUresult queued = Real::cuStreamWaitValue32_v2(stream, address, value, CU_STREAM_WAIT_VALUE_GEQ);
  if (queued != CUDA_SUCCESS) {
    WithWord(s, [&](std::atomic<std::uint32_t>& word) { Raise(word, value); });  // nothing waits for it
    if (queued == CUDA_ERROR_NOT_SUPPORTED || queued == CUDA_ERROR_NOT_FOUND) {
      s.unusable.store(true, std::memory_order_relaxed);
    }
    return false;
  }
  if (s.parked.load(std::memory_order_seq_cst) != 0) {
    s.wake.fetch_add(1, std::memory_order_acq_rel);
    s.wake.notify_all();
  }
  gate.value = value;
  gate.shut = true;
  return true;
}

bool Open(const Gate& gate) {
  if (!gate.shut) return false;
  bool opened = false;
  WithWord(TheState(), [&](std::atomic<std::uint32_t>& word) { opened = Raise(word, gate.value); });
  return opened;
}

void ForgetContext(CUcontext context) {
  State& s = TheState();
  if (context == nullptr || s.context.load(std::memory_order_relaxed) != context) return;
  std::lock_guard<std::mutex> guard(s.make_mutex);
  if (s.context.load(std::memory_order_relaxed) != context) return;
  s.word.store(nullptr, std::memory_order_seq_cst);
  while (s.users.load(std::memory_order_seq_cst) != 0) {
    // Those writing it finish in a few instructions (nothing under `users` waits for the GPU).
  }
  s.context.store(nullptr, std::memory_order_relaxed);
}

void ForgetAfterFork() { TheState().unusable.store(true, std::memory_order_relaxed); }

}  // namespace vgpu::hooks::gates
