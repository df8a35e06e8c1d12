// The shared state file: atomic creation, mapping, robust locking, slots with OFD-lock liveness, reaping.
#include "fakecuda/state/state.h"
#include "vgpu/base/clock.h"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define FAKECUDA_TSAN 1
#endif

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <new>

namespace fakecuda::state {
namespace {

using model::Machine;
static_assert(sizeof(pthread_mutex_t) <= sizeof(Machine::lock_storage));

constexpr std::uint64_t kReapIntervalNs = 100'000'000;

pthread_mutex_t* MutexOf(Machine& m) { return reinterpret_cast<pthread_mutex_t*>(m.lock_storage); }

// Process-local attachments, one per flavour. Constant-initialized; guarded by g_attach_mutex.
std::mutex g_attach_mutex;
Attachment* g_attachments[2] = {nullptr, nullptr};

off_t LivenessByte(std::uint32_t slot) {
  // Past the end of the mapped data: OFD locks beyond EOF are allowed and never touch the data.
  return static_cast<off_t>(sizeof(Machine)) + 4096 + slot;
}

bool LockByte(int fd, off_t offset, bool wait) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = offset;
  lock.l_len = 1;
  return fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &lock) == 0;
}

// True if some other open file description holds the byte: its owner is alive.
bool ByteHeldByOther(int fd, off_t offset) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = offset;
  lock.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &lock) != 0) return true;  // cannot tell: assume alive, never reap wrongly
  return lock.l_type != F_UNLCK;
}

std::string DefaultPath() {
  return "/dev/shm/fakecuda-" + std::to_string(static_cast<unsigned long>(getuid())) + ".state";
}

bool ReadConfig(model::MachineConfig& config, std::string& error) {
  config = model::DefaultConfig();
  if (const char* devices = std::getenv("FAKECUDA_DEVICES"); devices != nullptr && *devices != '\0') {
    if (!model::ParseDevices(devices, config, error)) return false;
  }
  if (const char* slice = std::getenv("FAKECUDA_TIMESLICE_US"); slice != nullptr && *slice != '\0') {
    char* end = nullptr;
    errno = 0;
    const unsigned long long us = std::strtoull(slice, &end, 10);
    if (errno != 0 || end == slice || *end != '\0' || us < 10 || us > 1'000'000 || slice[0] == '-') {
      error = std::string("FAKECUDA_TIMESLICE_US='") + slice +
              "' is not a whole number of microseconds in "
              "10..1000000 (e.g. 2000)";
      return false;
    }
    config.timeslice_ns = us * 1000;
  }
  if (const char* handover = std::getenv("FAKECUDA_SWITCH_US"); handover != nullptr && *handover != '\0') {
    char* end = nullptr;
    errno = 0;
    const unsigned long long us = std::strtoull(handover, &end, 10);
    if (errno != 0 || end == handover || *end != '\0' || us > 100'000 || handover[0] == '-') {
      error = std::string("FAKECUDA_SWITCH_US='") + handover +
              "' is not a whole number of microseconds in "
              "0..100000 (e.g. 160; 0 makes a handover between processes free)";
      return false;
    }
    config.switch_ns = us * 1000;
  }
  if (const char* mode = std::getenv("FAKECUDA_MODE"); mode != nullptr && *mode != '\0') {
    if (std::strcmp(mode, "timeslice") == 0)
      config.mode = model::SchedulingMode::timeslice;
    else if (std::strcmp(mode, "mps") == 0)
      config.mode = model::SchedulingMode::mps;
    else {
      error = std::string("FAKECUDA_MODE='") + mode + "' is not one of: timeslice, mps";
      return false;
    }
  }
  return true;
}

bool InitMutex(Machine& m) {
  pthread_mutexattr_t attr;
  if (pthread_mutexattr_init(&attr) != 0) return false;
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const bool ok = pthread_mutex_init(MutexOf(m), &attr) == 0;
  pthread_mutexattr_destroy(&attr);
  return ok;
}

Machine* MapFile(int fd) {
  void* p = mmap(nullptr, sizeof(Machine), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Machine*>(p);
}

// Writes a complete machine under a temporary name and links it into place. Returns the fd of the file
// now at `path` (ours or the winner's), or -1.
int CreateOrOpen(const std::string& path, const model::MachineConfig& config, std::string& error) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0) return fd;
    if (errno != ENOENT) {
      error = "cannot open FAKECUDA_STATE='" + path + "': " + std::strerror(errno);
      return -1;
    }
    const std::string temporary = path + ".tmp." + std::to_string(getpid());
    fd = open(temporary.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) {
      error = "cannot create FAKECUDA_STATE='" + path + "' (" + temporary + "): " + std::strerror(errno);
      return -1;
    }
    // Readable and writable by every user of the fake machine, whatever the umask.
    fchmod(fd, 0666);
    if (ftruncate(fd, static_cast<off_t>(sizeof(Machine))) != 0) {
      error = "cannot size FAKECUDA_STATE='" + path + "': " + std::strerror(errno);
      close(fd);
      unlink(temporary.c_str());
      return -1;
    }
    Machine* m = MapFile(fd);
    if (m == nullptr || !InitMutex(*m)) {
      error = "cannot map FAKECUDA_STATE='" + path + "': " + std::strerror(errno);
      if (m != nullptr) munmap(m, sizeof(Machine));
      close(fd);
      unlink(temporary.c_str());
      return -1;
    }
    struct timespec real {};
    const std::uint64_t mono_ns = MonotonicNs();
    clock_gettime(CLOCK_REALTIME, &real);
    const std::int64_t offset_us = static_cast<std::int64_t>(real.tv_sec) * 1'000'000 + real.tv_nsec / 1000 -
                                   static_cast<std::int64_t>(mono_ns / 1000);
    model::InitMachine(*m, config, mono_ns, offset_us);
    munmap(m, sizeof(Machine));
    const int linked = link(temporary.c_str(), path.c_str());
    const int link_errno = errno;
    unlink(temporary.c_str());
    if (linked == 0) return fd;
    close(fd);
    if (link_errno != EEXIST) {
      error = "cannot publish FAKECUDA_STATE='" + path + "': " + std::strerror(link_errno);
      return -1;
    }
    // Another process won the race: loop and open its file.
  }
  error = "FAKECUDA_STATE='" + path + "' keeps disappearing while being opened";
  return -1;
}

bool Validate(const Machine& m, const std::string& path, std::string& error) {
  if (m.magic != model::kMagic) {
    error = "FAKECUDA_STATE='" + path + "' is not a fakecuda state file (bad magic); remove it or choose another path";
    return false;
  }
  if (m.layout_version != model::kLayoutVersion || m.machine_bytes != sizeof(Machine)) {
    error = "FAKECUDA_STATE='" + path + "' has layout version " + std::to_string(m.layout_version) + " (" +
            std::to_string(m.machine_bytes) + " bytes); this library uses version " +
            std::to_string(model::kLayoutVersion) + " (" + std::to_string(sizeof(Machine)) +
            " bytes); remove the file or choose another path";
    return false;
  }
  const char* devices = std::getenv("FAKECUDA_DEVICES");
  if (devices != nullptr && *devices != '\0' && std::strcmp(devices, m.config.devices_spec) != 0) {
    error = std::string("FAKECUDA_DEVICES='") + devices + "' differs from the devices of FAKECUDA_STATE='" + path +
            "' ('" + m.config.devices_spec + "'); one state file is one machine: use another path";
    return false;
  }
  return true;
}

void ClaimSlot(Attachment& a) {
  MachineLock lock(a);
  Machine& m = lock.machine();
  const std::uint64_t now = MonotonicNs();
  ReapDeadProcesses(a, now, true);
  for (std::uint32_t tries = 0; tries < model::kMaxProcesses; ++tries) {
    const std::uint32_t slot = model::ClaimSlot(m, a.pid, now);
    if (slot == model::kNoSlot) return;
    if (LockByte(a.fd, LivenessByte(slot), false)) {
      a.slot = slot;
      a.slot_generation = m.slots[slot].generation;
      return;
    }
    // The byte is still held: a process we consider gone is alive. Leave the slot to it.
    m.slots[slot].state = model::SlotState::live;
    m.slots[slot].pid = -1;
  }
}

}  // namespace

namespace {}  // namespace

// The host's clock: the fake GPU, as a real one, has one clock for all its processes, whatever their time namespace.
std::uint64_t MonotonicNs() { return vgpu::base::HostMonotonicNs(); }

void SleepNs(std::uint64_t ns) {
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000ull);
  ts.tv_nsec = static_cast<long>(ns % 1'000'000'000ull);
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

Attachment* Attach(bool claim_slot, std::string& error) {
  std::lock_guard<std::mutex> guard(g_attach_mutex);
  Attachment*& existing = g_attachments[claim_slot ? 1 : 0];
  if (existing != nullptr) return existing;
  model::MachineConfig config{};
  if (!ReadConfig(config, error)) return nullptr;
  const char* env_path = std::getenv("FAKECUDA_STATE");
  const std::string path = env_path != nullptr && *env_path != '\0' ? env_path : DefaultPath();
  const int fd = CreateOrOpen(path, config, error);
  if (fd < 0) return nullptr;
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(Machine))) {
    error = "FAKECUDA_STATE='" + path + "' is truncated (" + std::to_string(st.st_size) + " bytes, need " +
            std::to_string(sizeof(Machine)) + "); remove it or choose another path";
    close(fd);
    return nullptr;
  }
  Machine* m = MapFile(fd);
  if (m == nullptr) {
    error = "cannot map FAKECUDA_STATE='" + path + "': " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  if (!Validate(*m, path, error)) {
    munmap(m, sizeof(Machine));
    close(fd);
    return nullptr;
  }
  auto* a = new (std::nothrow) Attachment{};
  if (a == nullptr) {
    error = "out of host memory";
    munmap(m, sizeof(Machine));
    close(fd);
    return nullptr;
  }
  a->machine = m;
  a->fd = fd;
  a->pid = static_cast<std::int32_t>(getpid());
  a->path = path;
  if (claim_slot) {
    ClaimSlot(*a);
    if (a->slot == model::kNoSlot) {
      error =
          "FAKECUDA_STATE='" + path + "': all " + std::to_string(model::kMaxProcesses) + " process slots are in use";
      munmap(m, sizeof(Machine));
      close(fd);
      delete a;
      return nullptr;
    }
  }
  existing = a;
  return a;
}

void ForgetAfterFork() {
  // Runs in the child with one thread. The mapping stays valid (MAP_SHARED is inherited) but the
  // parent's slot is the parent's: close the inherited description so the parent's liveness lock is not
  // kept alive by the child, and start again on the next call.
  new (&g_attach_mutex) std::mutex();
  for (Attachment*& a : g_attachments) {
    if (a == nullptr) continue;
    munmap(a->machine, sizeof(Machine));
    close(a->fd);
    delete a;
    a = nullptr;
  }
}

void EnsureOwnSlot(Attachment& a) {
  if (a.slot == model::kNoSlot) return;
  {
    MachineLock lock(a);
    const model::ProcessSlot& slot = lock.machine().slots[a.slot];
    if (slot.state == model::SlotState::live && slot.generation == a.slot_generation && slot.pid == a.pid) return;
  }
  LogError(
      "this process lost its slot in FAKECUDA_STATE='%s' (its descriptors were closed?); taking a new one: "
      "memory allocated before is no longer counted",
      a.path.c_str());
  const int fd = open(a.path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return;
  // The old number may now be one of the application's own files: never close it, just stop using it.
  a.fd = fd;
  a.slot = model::kNoSlot;
  ClaimSlot(a);
}

MachineLock::MachineLock(Attachment& attachment) : attachment_(attachment) {
  pthread_mutex_t* mutex = MutexOf(*attachment_.machine);
  // Not a plain pthread_mutex_lock: glibc's robust mutex can lose a wake-up when a woken waiter is killed before
  // it re-takes the lock (seen in the region's kill storms: survivors asleep in futex_wait forever). Waiting in
  // 10 ms slices re-checks the lock word, so a lost wake-up costs 10 ms, never a wedge.
  int r = pthread_mutex_trylock(mutex);
  while (r == EBUSY || r == ETIMEDOUT) {
    struct timespec deadline {};
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += 10'000'000;
    if (deadline.tv_nsec >= 1'000'000'000) {
      deadline.tv_nsec -= 1'000'000'000;
      ++deadline.tv_sec;
    }
    r = pthread_mutex_timedlock(mutex, &deadline);
#if defined(FAKECUDA_TSAN)
    // ThreadSanitizer's timedlock interceptor records an acquisition only on 0, but EOWNERDEAD acquires too.
    if (r == EOWNERDEAD) {
      __tsan_mutex_pre_lock(mutex, __tsan_mutex_try_lock);
      __tsan_mutex_post_lock(mutex, __tsan_mutex_try_lock, 0);
    }
#endif
  }
  if (r == EOWNERDEAD) {
    const std::uint32_t fixes = model::RepairMachine(*attachment_.machine);
    pthread_mutex_consistent(mutex);
    if (LogLevel() >= 1) {
      LogError("a process died holding the fake machine's lock; repaired %u field(s)", fixes);
    }
  }
}

MachineLock::~MachineLock() { pthread_mutex_unlock(MutexOf(*attachment_.machine)); }

std::uint32_t ReapDeadProcesses(Attachment& a, std::uint64_t now_ns, bool force) {
  Machine& m = *a.machine;
  if (!force && now_ns < m.last_reap_ns + kReapIntervalNs) return 0;
  m.last_reap_ns = now_ns;
  std::uint32_t reaped = 0;
  for (std::uint32_t i = 0; i < model::kMaxProcesses; ++i) {
    const model::ProcessSlot& slot = m.slots[i];
    if (slot.state != model::SlotState::live) continue;
    if (i == a.slot) continue;  // our own lock never conflicts with our own description
    if (ByteHeldByOther(a.fd, LivenessByte(i))) continue;
    const std::int32_t pid = slot.pid;
    // Bring the devices up to now first (with the trace: live processes' kernels complete in this step too).
    for (std::uint32_t dev = 0; dev < m.config.device_count; ++dev) AdvanceToNow(a, dev, now_ns);
    std::uint64_t returned[model::kMaxDevices] = {};
    model::ReleaseSlot(m, i, returned);
    ++reaped;
    if (TraceEnabled()) {
      for (std::uint32_t dev = 0; dev < m.config.device_count; ++dev) {
        if (returned[dev] == 0) continue;
        char line[200];
        std::snprintf(line, sizeof line,
                      "{\"ev\":\"reap\",\"pid\":%d,\"device\":%u,\"bytes\":%" PRIu64 ",\"t_ns\":%" PRIu64 "}", pid, dev,
                      returned[dev], now_ns);
        TraceLine(line);
      }
    }
  }
  return reaped;
}

namespace {

class TraceListener final : public model::TimelineListener {
 public:
  void OnKernelComplete(const Machine& m, std::uint32_t device, std::uint32_t stream, const model::Op& op) override {
    char name[model::kKernelNameBytes * 2 + 1];
    std::size_t n = 0;
    for (std::size_t i = 0; i < model::kKernelNameBytes && op.name[i] != '\0'; ++i) {
      const char c = op.name[i];
      if (c == '"' || c == '\\') name[n++] = '\\';
      name[n++] = (static_cast<unsigned char>(c) < 0x20) ? '?' : c;
    }
    name[n] = '\0';
    char line[512];
    std::snprintf(line, sizeof line,
                  "{\"ev\":\"kernel\",\"pid\":%d,\"device\":%u,\"stream\":%u,\"name\":\"%s\",\"grid\":[%u,%u,%u],"
                  "\"block\":[%u,%u,%u],\"queued_ns\":%" PRIu64 ",\"start_ns\":%" PRIu64 ",\"end_ns\":%" PRIu64
                  ",\"ran_ns\":%" PRIu64 "}",
                  m.slots[m.streams[stream].slot].pid, device, stream, name, op.grid[0], op.grid[1], op.grid[2],
                  op.block[0], op.block[1], op.block[2], op.queued_ns, op.start_ns, op.end_ns, op.ran_ns);
    TraceLine(line);
  }
};

int g_trace_fd = -2;  // -2: not opened yet; -1: disabled
std::mutex g_trace_mutex;

}  // namespace

void AdvanceToNow(Attachment& a, std::uint32_t device, std::uint64_t now_ns) {
  static TraceListener listener;
  model::Advance(*a.machine, device, now_ns, TraceEnabled() ? &listener : nullptr);
}

bool TraceEnabled() {
  if (g_trace_fd == -2) {
    std::lock_guard<std::mutex> guard(g_trace_mutex);
    if (g_trace_fd == -2) {
      const char* path = std::getenv("FAKECUDA_TRACE");
      int fd = -1;
      if (path != nullptr && *path != '\0') {
        fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0) LogError("cannot open FAKECUDA_TRACE='%s': %s; tracing is off", path, std::strerror(errno));
      }
      __atomic_store_n(&g_trace_fd, fd, __ATOMIC_RELEASE);
    }
  }
  return __atomic_load_n(&g_trace_fd, __ATOMIC_ACQUIRE) >= 0;
}

void TraceLine(const std::string& line) {
  if (!TraceEnabled()) return;
  std::string whole = line;
  whole.push_back('\n');
  // O_APPEND makes each write land whole at the end, whoever else is writing.
  const ssize_t written = write(g_trace_fd, whole.data(), whole.size());
  (void)written;
}

int LogLevel() {
  static const int level = [] {
    const char* value = std::getenv("FAKECUDA_LOG");
    return value != nullptr && value[0] >= '0' && value[0] <= '3' ? value[0] - '0' : 0;
  }();
  return level;
}

void LogError(const char* format, ...) {
  char message[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof message, format, args);
  va_end(args);
  std::fprintf(stderr, "fakecuda: %s\n", message);
}

}  // namespace fakecuda::state
