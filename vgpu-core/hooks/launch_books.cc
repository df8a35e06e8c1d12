// Books of launches (launch.h): the launch path's fast path. A thread's next launches of one kernel on one stream,
// admitted together by the whole path and then made with no lock and no map.
#include <algorithm>

#include "launch.h"
#include "vgpu/policy/sampling.h"

namespace vgpu::hooks::launch {

namespace {

// A book on a drained stream holds at most kBookLaunches, one into a window kWindowBookLaunches, and either at most
// kBookNs of GPU time.
constexpr std::uint32_t kBookLaunches = 128;
constexpr std::uint32_t kWindowBookLaunches = 256;
constexpr std::uint64_t kBookNs = 1'000'000;
constexpr std::uint32_t kBookWorthLaunches = 16;  // a book that served fewer before a queue ended it ...
constexpr std::uint32_t kBookBackoff = 64;        // ... keeps this many chances of a book off its stream

}  // namespace

// Books of launches: the launch path's fast path (docs/compute-limit.md, "The launch path"). Two kinds:
// - Onto a drained stream. A thread whose launch of a kernel measured before is made unmeasured on a stream with no
//   open window is given the launches of that kernel on that stream and context that the sampling would leave
//   unmeasured next (drawn now, one draw per launch as SampleThisLaunch makes them, at most kBookLaunches), admitted
//   and settled as unmeasured at once (Limiter::AdmitBook), as many as the budget holds without debt and no more than
//   kBookNs of GPU time together. Those launches check the book, the host's estimate that the stream has drained (a
//   launch that would queue takes the whole path: queues are measured by windows) and the context, and go. The launch
//   after a book's last goes through the whole path, measured where the draw that ended the book picked it.
// - Into a window. A thread whose launch of a known kernel joins its stream's open window (and does not fill it) is
//   given the launches of that kernel after it, into the same window, as many as the window has room for (at most
//   kWindowBookLaunches and kBookNs), charged now at the kernel's estimate (Limiter::AdmitWindowBook: no debt, within
//   the in-flight bound). Those launches check the book, that the window is still open and the stream still queued by
//   the host's estimate, count themselves in their book's place of the stream, and go; the window measures them with
//   its other launches. A window ends only while no launch into it is being made (`launching`, raised before the check
//   that it is open: see CloseWindow).
// Either way: no lock, no map. A thread keeps kBooks books (alternating kernels each keep theirs). What a book holds
// unused goes back when the thread takes the whole path for that kernel and stream, or evicts the book, or the book's
// context is destroyed (its stream states go: the book is returned without them); after fork the child drops what it
// inherited (its parent returns it). A thread that ends with a book open leaves it spent: at most kBooks x kBookNs of
// budget, once. (A booked launch reads and moves its stream's state: a thread that destroys a context while another
// launches into it -- undefined in CUDA -- could have it touch a stream state being freed.)
struct LaunchBook {
  const void* function;
  std::uint64_t shape;
  CUstream stream;
  CUcontext context;
  DeviceLimiter* device;  // null: no book here
  StreamState* state;     // valid while `generation` is current
  std::uint64_t generation;
  std::uint64_t fork_generation;
  std::uint64_t accounted_each_ns;
  std::uint64_t charged_ns;  // the kernel's estimate: the stream's queue grows by it per launch
  std::uint64_t last_ns;     // when the book's last launch was made
  std::uint32_t left;
  std::uint32_t granted;
  bool measure_next;  // the draw that ended the book picked the launch after it to be measured
  bool queued;        // closed because the stream had work queued (its launches then join windows)
  // A book into the stream's open window (its launches charged at the estimate, settled with the window), valid
  // while the stream's `window_seq` is this; otherwise a book onto a drained stream (settled as unmeasured).
  bool window;
  std::uint64_t window_seq;
  // Time division: the book's launches go only while they end inside the turn it was opened in (turn::Ticket).
  std::uint64_t turn_until_ns = UINT64_MAX;
};

namespace {

struct ThreadBooks {
  LaunchBook book[kBooks];
  std::uint32_t next_evicted;
};

// (Constant-initialized, initial-exec: read with no call, as a launch's first thing.)
thread_local ThreadBooks t_books __attribute__((tls_model("initial-exec"))) = {};

// Raised when a context's stream states go (books on them lose `state`) and in a fork child (the books it inherited
// are its parent's). Read by every booked launch: kept beside nothing else that is written.
struct alignas(64) BookGenerations {
  std::atomic<std::uint64_t> streams{1};
  std::atomic<std::uint64_t> forks{1};
};
BookGenerations g_book_generations;

}  // namespace

const void* ThisThread() { return &t_books; }

void ForgetBookStates() { g_book_generations.streams.fetch_add(1, std::memory_order_acq_rel); }
void ForgetBooksAfterFork() { g_book_generations.forks.fetch_add(1, std::memory_order_relaxed); }

// Time division: a book opened in a turn had its launches charged to the container's account; those never made go
// back. (A book opened with no turn, the limiter holding the cap meanwhile, charged the account nothing.)
void RefundTurn(const LaunchBook& book, std::uint64_t ns) {
  const DeviceLimiter& d = *book.device;
  if (d.scheduled && book.turn_until_ns != UINT64_MAX && ns > 0) turn::Refund(d.ordinal, ns);
}

namespace {

// Gives a book's unused launches back and clears it. Caller holds book.device->mutex.
void CloseBookLocked(LaunchBook& book) {
  if (book.device == nullptr) return;
  const policy::KernelKey key{book.function, book.shape};
  const bool state_alive = book.generation == g_book_generations.streams.load(std::memory_order_acquire);
  if (book.fork_generation != g_book_generations.forks.load(std::memory_order_relaxed)) {
    // Inherited over fork: the parent's to give back.
  } else if (book.window) {
    if (book.left > 0) book.device->limiter->Cancel(key, std::uint64_t{book.left} * book.accounted_each_ns);
    RefundTurn(book, std::uint64_t{book.left} * book.charged_ns);
    StreamState& state = *book.state;
    if (state_alive && state.window_seq.load(std::memory_order_seq_cst) == book.window_seq) {
      // Its window goes on: the launches it made join the window's own, its reservation ends. (Had the window ended,
      // its launches went with it.)
      FoldBooked(*book.device, state, static_cast<int>(&book - t_books.book));
      state.estimated_ns -= std::min(state.estimated_ns, std::uint64_t{book.left} * book.accounted_each_ns);
      state.booked_reserved -= std::min(state.booked_reserved, book.granted);
    }
  } else {
    book.device->limiter->Refund(key, book.left, book.accounted_each_ns);
    RefundTurn(book, std::uint64_t{book.left} * book.charged_ns);
    if (state_alive) {
      if (book.state->books > 0) --book.state->books;
      book.state->last_launch_ns = std::max(book.state->last_launch_ns, book.last_ns);
      // A book the stream's queue ended after a few launches (bursts of launches queued back to back): the next
      // books on this stream would each cost a grant and a return for as little; none for a while.
      if (book.queued && book.granted - book.left < kBookWorthLaunches) book.state->books_skipped = kBookBackoff;
    }
  }
  book = LaunchBook{};
}

// A free place for a book in this thread's, or null. Evicts a book of this device if there is none (one of another
// device is left alone: its mutex is not held). Caller holds d.mutex.
LaunchBook* FreeBookPlace(DeviceLimiter& d) {
  for (LaunchBook& book : t_books.book) {
    if (book.device == nullptr) return &book;
  }
  LaunchBook& victim = t_books.book[t_books.next_evicted++ % kBooks];
  if (victim.device != &d) return nullptr;
  CloseBookLocked(victim);
  return &victim;
}

// Whether a booked launch goes where its book was given. A launch into an ordinary stream runs in that stream's
// context; the null and per-thread streams are the current context's, and where the process sees several devices a
// stream handle may have been reused in another device's context: then the current context is asked.
bool BookContextCurrent(const LaunchBook& book) {
  if (reinterpret_cast<std::uintptr_t>(book.stream) > reinterpret_cast<std::uintptr_t>(CU_STREAM_PER_THREAD) &&
      OneDevice()) {
    return true;
  }
  CUcontext current = nullptr;
  return Real::cuCtxGetCurrent != nullptr && Real::cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == book.context;
}

// A launch into a window is no longer being made (see CloseWindow): the last one closes the window if asked to.
void EndLaunching(DeviceLimiter& d, CUstream stream, StreamState& state) {
  if (state.launching.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
      state.close_when_done.load(std::memory_order_seq_cst)) {
    std::lock_guard<std::mutex> guard(d.mutex);
    if (state.close_when_done.load(std::memory_order_relaxed)) CloseWindow(d, stream, state, NowNs(), false);
  }
}

// A launch through a book into its stream's window, if that window is still open and the stream still queued by the
// host's estimate: then counted in the book's place of the stream (EndIntoWindow after the driver's call). False:
// the whole path. (A launch onto a stream that has drained by the estimate does not join the window: the window
// would time the idle GPU until it came; the whole path closes the window there, idle time left out.)
bool BeginIntoWindow(LaunchBook& book) {
  StreamState& state = *book.state;
  state.launching.fetch_add(1, std::memory_order_seq_cst);
  if (state.window_seq.load(std::memory_order_seq_cst) != book.window_seq || !BookContextCurrent(book)) {
    EndLaunching(*book.device, book.stream, state);
    return false;
  }
  const std::uint64_t now = NowNs();
  const std::uint64_t busy_until = state.busy_until_ns.load(std::memory_order_relaxed);
  if (busy_until <= now + book.charged_ns / 2 || now + book.charged_ns > book.turn_until_ns) {
    EndLaunching(*book.device, book.stream, state);
    return false;
  }
  state.busy_until_ns.store(std::max(busy_until, now) + book.charged_ns, std::memory_order_relaxed);
  state.booked_last_ns.store(now, std::memory_order_relaxed);
  --book.left;
  state.booked[&book - t_books.book].made.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void EndIntoWindow(LaunchBook& book, CUresult result) {
  StreamState& state = *book.state;
  if (result != CUDA_SUCCESS) {  // nothing ran: nothing is owed
    state.booked[&book - t_books.book].made.fetch_sub(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> guard(book.device->mutex);
    book.device->limiter->Cancel(policy::KernelKey{book.function, book.shape}, book.accounted_each_ns);
    RefundTurn(book, book.charged_ns);
  }
  EndLaunching(*book.device, book.stream, state);
}

// A launch through a book onto its drained stream, if the stream has drained by the host's estimate. False: the
// whole path. A launch that would queue is not made here: a queue is measured by windows (a pair in a queue also
// times its own events: tiny kernels over-charged).
bool BeginOntoDrained(LaunchBook& book) {
  StreamState& state = *book.state;
  const std::uint64_t now = NowNs();
  const std::uint64_t busy_until = state.busy_until_ns.load(std::memory_order_relaxed);
  book.queued = busy_until > now + book.charged_ns / 2;
  if (book.queued || now + book.charged_ns > book.turn_until_ns || !BookContextCurrent(book)) return false;
  state.busy_until_ns.store(std::max(busy_until, now) + book.charged_ns, std::memory_order_relaxed);
  book.last_ns = now;
  --book.left;
  return true;
}

void EndOntoDrained(LaunchBook& book, CUresult result) {
  if (result == CUDA_SUCCESS) return;
  // Nothing ran: nothing is owed.
  std::lock_guard<std::mutex> guard(book.device->mutex);
  book.device->limiter->Refund(policy::KernelKey{book.function, book.shape}, 1, book.accounted_each_ns);
  RefundTurn(book, book.charged_ns);
}

}  // namespace

// The open book for a launch, or null. Checked before anything else on the launch path.
LaunchBook* OpenBookFor(const void* function, std::uint64_t shape, CUstream stream) {
  for (LaunchBook& book : t_books.book) {
    if (book.left > 0 && book.function == function && book.shape == shape && book.stream == stream) {
      if (g_captures.load(std::memory_order_relaxed) != 0 ||
          book.generation != g_book_generations.streams.load(std::memory_order_acquire) ||
          book.fork_generation != g_book_generations.forks.load(std::memory_order_relaxed)) {
        return nullptr;  // the whole path: it asks about captures, and closes the book
      }
      return &book;
    }
  }
  return nullptr;
}

bool BeginBooked(LaunchBook& book) {
  if (book.window) {
    const bool made = BeginIntoWindow(book);
    if (made)
      VGPU_COUNT(booked_window, 1);
    else
      VGPU_COUNT(book_refused_window, 1);
    return made;
  }
  const bool made = BeginOntoDrained(book);
  if (made)
    VGPU_COUNT(booked_drained, 1);
  else
    VGPU_COUNT(book_refused_queued, 1);
  return made;
}

void Booked(LaunchBook& book, CUresult result) {
  if (book.window) {
    EndIntoWindow(book, result);
  } else {
    EndOntoDrained(book, result);
  }
}

// The whole path for a launch of this kernel on this stream: the thread's book for them, if any, is closed first.
// Returns whether the book's last draw picked this launch to be measured.
bool CloseBookFor(const void* function, std::uint64_t shape, CUstream stream) {
  for (LaunchBook& book : t_books.book) {
    if (book.device != nullptr && book.function == function && book.shape == shape && book.stream == stream) {
      const bool measure = book.measure_next && book.left == 0;
      std::lock_guard<std::mutex> guard(book.device->mutex);
      CloseBookLocked(book);
      return measure;
    }
  }
  return false;
}

// How many of this thread's books are open on `state` (the others are other threads'). Caller holds d.mutex.
std::uint32_t OwnBooksOn(const DeviceLimiter& d, const StreamState* state) {
  std::uint32_t own = 0;
  for (const LaunchBook& book : t_books.book) {
    own += book.device == &d && !book.window && book.state == state &&
           book.generation == g_book_generations.streams.load(std::memory_order_relaxed);
  }
  return own;
}

namespace {

// A book of `granted` launches of `key` on `stream`, each accounted and charged `each_ns`, valid at the generations
// current now; not measuring, not queued, onto a drained stream (callers set what differs).
LaunchBook NewBook(DeviceLimiter& d, const policy::KernelKey& key, CUstream stream, CUcontext context,
                   StreamState& state, std::uint64_t each_ns, std::uint64_t now, std::uint32_t granted,
                   std::uint64_t turn_until_ns) {
  LaunchBook book{};
  book.function = key.function;
  book.shape = key.shape;
  book.stream = stream;
  book.context = context;
  book.device = &d;
  book.state = &state;
  book.generation = g_book_generations.streams.load(std::memory_order_acquire);
  book.fork_generation = g_book_generations.forks.load(std::memory_order_relaxed);
  book.accounted_each_ns = each_ns;
  book.charged_ns = each_ns;
  book.last_ns = now;
  book.left = granted;
  book.granted = granted;
  book.turn_until_ns = turn_until_ns;
  return book;
}

}  // namespace

// After a launch planned unmeasured on `stream` (no window open there): a book of the launches after it. Caller holds
// d.mutex. Evicts a book of this device if the thread has no free place (one of another device is left alone: its
// mutex is not held).
std::uint64_t OpenBook(DeviceLimiter& d, const policy::KernelKey& key, CUstream stream, CUcontext context,
                       std::uint64_t estimate_ns, bool steady, std::uint64_t now, std::uint64_t turn_until_ns) {
  StreamState& state = StateOf(d, stream);
  if (state.many_threads || state.start != nullptr || state.launching.load(std::memory_order_relaxed) > 0) return 0;
  if (state.books_skipped > 0) {
    --state.books_skipped;
    return 0;
  }
  LaunchBook* place = FreeBookPlace(d);
  if (place == nullptr) return 0;
  // The launches the sampling leaves unmeasured next, drawn now; the book ends before the first one it measures.
  std::uint32_t unmeasured = 0;
  bool measure_next = false;
  const std::uint64_t one_in = policy::MeasuredOneIn(estimate_ns, steady);
  if (one_in <= 1) return 0;  // every launch measured: nothing to book
  while (unmeasured < kBookLaunches && !(measure_next = DrawMeasured(one_in))) ++unmeasured;
  std::uint64_t each = 0;
  const std::uint32_t granted = d.limiter->AdmitBook(key, now, unmeasured, kBookNs, each);
  if (granted == 0) return 0;
  *place = NewBook(d, key, stream, context, state, each, now, granted, turn_until_ns);
  place->charged_ns = estimate_ns;
  place->measure_next = measure_next && granted == unmeasured;
  ++state.books;
  VGPU_COUNT(books_opened, 1);
  VGPU_COUNT(book_launches_granted, granted);
  return std::uint64_t{granted} * estimate_ns;
}

// After a launch planned into `state`'s open window that does not fill it: a book of the launches of the same kernel
// after it, into the same window, as many as it has room for. Caller holds d.mutex.
std::uint64_t OpenWindowBook(DeviceLimiter& d, const policy::KernelKey& key, CUstream stream, CUcontext context,
                             StreamState& state, std::uint64_t now, std::uint64_t turn_until_ns) {
  // (A window another thread has asked to end, waiting for the launches into it, gets no book.)
  if (state.many_threads || state.start == nullptr || state.close_when_done.load(std::memory_order_relaxed)) return 0;
  const std::size_t used = state.launches.size() + state.booked_reserved;
  if (used >= kWindowLaunches || state.estimated_ns >= kWindowNs) return 0;
  LaunchBook* place = FreeBookPlace(d);
  if (place == nullptr) return 0;
  std::uint64_t each = 0;
  const std::uint32_t granted = d.limiter->AdmitWindowBook(
      key, now, std::min<std::uint32_t>(kWindowBookLaunches, static_cast<std::uint32_t>(kWindowLaunches - used)),
      std::min(kBookNs, kWindowNs - state.estimated_ns), each);
  if (granted == 0) return 0;
  StreamState::Booked& booked = state.booked[place - t_books.book];
  booked.key = key;
  booked.charged_ns = each;
  state.booked_reserved += granted;
  state.estimated_ns += std::uint64_t{granted} * each;
  *place = NewBook(d, key, stream, context, state, each, now, granted, turn_until_ns);
  place->window = true;
  place->window_seq = state.window_seq.load(std::memory_order_seq_cst);
  VGPU_COUNT(window_books_opened, 1);
  VGPU_COUNT(book_launches_granted, granted);
  return std::uint64_t{granted} * each;
}

}  // namespace vgpu::hooks::launch
