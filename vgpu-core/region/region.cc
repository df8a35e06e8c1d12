// The container region's OS side: atomic creation, validation, the robust lock and its repair, OFD-lock
// liveness, reaping, and reserve/release accounting (docs/region.md).
#include "vgpu/base/clock.h"
#include "vgpu/region/region.h"

#include "vgpu/region/hami_v1.h"
#include "vgpu/region/shared_file.h"
#include "replace.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_THREAD__)
#define VGPU_REGION_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define VGPU_REGION_TSAN 1
#endif
#endif
#if defined(VGPU_REGION_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>

namespace vgpu::region {

void (*Attachment::test_hook_)(TestPoint) = nullptr;

namespace {

static_assert(sizeof(pthread_mutex_t) <= sizeof(Region::lock_storage));
#if defined(__GLIBC__)
static_assert(offsetof(pthread_mutex_t, __data.__lock) == 0, "ReadSnapshot reads the futex word first");
#endif
static_assert(alignof(pthread_mutex_t) <= alignof(Region));

constexpr std::uint64_t kReapIntervalNs = 100'000'000;
// Waiting for the lock goes in slices: glibc's robust mutex can lose a wake-up when a woken waiter is killed
// before it re-takes the lock while a newcomer takes it without the waiters bit (the kernel re-wakes only if the
// word is 0 at the death). A slice bounds what such a loss costs; the whole wait is bounded too, after which the
// operation fails closed (a holder stopped or hung that long is not coming back soon).
constexpr std::uint64_t kLockSliceNs = 10'000'000;
constexpr std::uint64_t kLockWaitMaxNs = 10'000'000'000;
constexpr const char* kDefaultFolder = "/tmp/vgpu";
constexpr const char* kPathVariable = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
// What validation reads before mapping anything: magic, version, region_bytes.
constexpr std::size_t kPrefixBytes = offsetof(Region, created_ns);
static_assert(kPrefixBytes == 16);

pthread_mutex_t* MutexOf(Region& region) { return reinterpret_cast<pthread_mutex_t*>(region.lock_storage); }

// Counters other processes read without the lock go through 8-byte atomics, so a reader never sees a torn value.
std::uint64_t Load(std::uint64_t& field) {
  return std::atomic_ref<std::uint64_t>(field).load(std::memory_order_acquire);
}
void Store(std::uint64_t& field, std::uint64_t value) {
  std::atomic_ref<std::uint64_t>(field).store(value, std::memory_order_release);
}
std::uint64_t SaturatingAdd(std::uint64_t a, std::uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

using base::ClockNs;
using base::MonotonicNs;

bool ValidDevice(int device) { return device >= 0 && device < static_cast<int>(kMaxDevices); }

// Liveness: one byte per slot far past the file's end (kLivenessBase, the same in every version from 5 on). OFD locks
// past the end of a file are allowed, never change its size, and belong to the open file description, so the kernel
// drops them when the process dies whatever pid namespace it lived in.
off_t LivenessByte(int slot) { return static_cast<off_t>(kLivenessBase) + slot; }

int LockByte(int fd, int slot, short type) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = LivenessByte(slot);
  lock.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &lock) == 0 ? 0 : errno;
}

// True if another open file description holds the slot's byte: its owner lives. Our own description never
// conflicts with itself, so the caller skips its own slot.
bool HeldByAnother(int fd, int slot) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = LivenessByte(slot);
  lock.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &lock) != 0) return true;  // cannot tell: assume alive, never reap wrongly
  return lock.l_type != F_UNLCK;
}

// A new open file description of the file behind `fd` (even if its path now names another file), through
// /proc/self/fd. Allocates nothing and makes only async-signal-safe calls: usable in a fork child. -1 without /proc.
int ReopenDescription(int fd) {
  char proc_path[32] = "/proc/self/fd/";
  std::size_t length = std::strlen(proc_path);
  char digits[12];
  std::size_t count = 0;
  for (unsigned value = static_cast<unsigned>(fd); count == 0 || value != 0; value /= 10) {
    digits[count++] = static_cast<char>('0' + value % 10);
  }
  while (count > 0) proc_path[length++] = digits[--count];
  proc_path[length] = '\0';
  return open(proc_path, O_RDWR | O_CLOEXEC | O_NOCTTY);
}

void ClearSlot(Slot& slot) {
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    Store(slot.used_bytes[d], 0);
    Store(slot.peak_bytes[d], 0);
  }
  slot.pid = 0;
}

// HAMi's part written again from the slots (docs/hami-cache.md: the repair's truth is the slots).
void MirrorSlots(hami::SharedRegion& mirror, const Region& region) {
  for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
    const Slot& slot = region.slots[i];
    if (slot.state != SlotState::live || slot.pid <= 0) {
      hami::MirrorSlotFree(mirror, i);
      continue;
    }
    hami::MirrorSlotLive(mirror, i, slot.pid);
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) hami::MirrorUsed(mirror, i, d, slot.used_bytes[d]);
  }
}

// Runs with the lock just inherited from a dead owner (EOWNERDEAD). The slots are the truth: a slot in
// `claiming` was the dead owner's unfinished claim; every device total is recomputed from the live slots, so a
// reservation cut off between its slot write and its device write counts fully, or not at all; HAMi's part too.
void RepairAfterOwnerDeath(Region& region, hami::SharedRegion& mirror) {
  if (region.device_count > kMaxDevices) region.device_count = kMaxDevices;
  std::uint64_t sums[kMaxDevices] = {};
  for (Slot& slot : region.slots) {
    if (slot.state == SlotState::claiming) {
      ClearSlot(slot);
      slot.state = SlotState::free;
    } else if (slot.state == SlotState::live) {
      for (std::uint32_t d = 0; d < kMaxDevices; ++d) sums[d] = SaturatingAdd(sums[d], Load(slot.used_bytes[d]));
    }
  }
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) Store(region.devices[d].used_bytes, sums[d]);
  MirrorSlots(mirror, region);
}

std::string Quoted(const std::string& path) { return "region file '" + path + "'"; }
std::string Remedy() {
  return std::string("; remove it once no process uses it, or set ") + kPathVariable + " to another path";
}

bool DefaultPath(std::string& path, std::string& error) {
  // 0700 asks for no more than the umask allows, so the umask (which we never touch) can only narrow it.
  if (mkdir(kDefaultFolder, 0700) != 0 && errno != EEXIST) {
    error = std::string("cannot create the region folder '") + kDefaultFolder + "': " + std::strerror(errno) +
            "; set " + kPathVariable + " to a file in a writable folder";
    return false;
  }
  struct stat st {};
  if (lstat(kDefaultFolder, &st) != 0 || !S_ISDIR(st.st_mode)) {
    error = std::string("'") + kDefaultFolder + "' is not a folder (a file or a symbolic link is there); set " +
            kPathVariable + " to a file in a folder of your own";
    return false;
  }
  path = std::string(kDefaultFolder) + "/region." + std::to_string(static_cast<unsigned long>(getuid()));
  return true;
}

// A new file's zeroed mapping made a fresh file: HAMi-core's part first (hami_v1.h), then the region at
// kRegionOffset, every slot free, no device.
bool InitializeFile(void* mapped, const void* /*context*/, std::string& error) {
  hami::Initialize(*static_cast<hami::SharedRegion*>(mapped));
  auto* region = reinterpret_cast<Region*>(static_cast<char*>(mapped) + kRegionOffset);
  if (const int r = InitRobustMutex(region->lock_storage); r != 0) {
    error = std::string("cannot initialise its lock: ") + std::strerror(r);
    return false;
  }
  region->magic = kRegionMagic;
  region->version = kRegionVersion;
  region->region_bytes = static_cast<std::uint32_t>(sizeof(Region));
  region->created_ns = ClockNs(CLOCK_REALTIME);
  return true;
}

// Returns the fd of the complete region now at `path` (ours, or the winner's of a creation race), or -1.
int CreateOrOpen(const std::string& path, std::string& error) {
  return CreateOrOpenShared(path, kFileBytes, InitializeFile, nullptr, "region file", kPathVariable, error);
}

template <typename T>
T FieldAt(const unsigned char* bytes, std::size_t offset) {
  T value{};
  std::memcpy(&value, bytes + offset, sizeof value);
  return value;
}

// The file's first bytes (`head`): HAMi-core's magic and major version (docs/hami-cache.md); an older region of ours
// began with "VGPUREGN" instead. False and `error` otherwise.
bool HamiPartOk(const unsigned char* head, const std::string& path, std::string& error) {
  const auto word = FieldAt<std::uint64_t>(head, 0);
  if (word == kRegionMagic) {
    error = Quoted(path) + " is an older vgpu region (layout version " +
            std::to_string(FieldAt<std::uint32_t>(head, offsetof(Region, version))) + "); this library reads version " +
            std::to_string(kRegionVersion) +
            ", which begins with HAMi-core's part; every process of a container must use one vgpu build" + Remedy();
    return false;
  }
  if (FieldAt<std::int32_t>(head, offsetof(hami::SharedRegion, initialized_flag)) != hami::kMagic ||
      FieldAt<std::uint32_t>(head, offsetof(hami::SharedRegion, major_version)) != hami::kMajorVersion) {
    char found[64];
    std::snprintf(found, sizeof found, "0x%016" PRIx64, word);
    error = Quoted(path) + " is not a vgpu region (it begins " + found + ", expected HAMi-core's magic " +
            std::to_string(hami::kMagic) + " and major version 1, then \"VGPUREGN\" at byte " +
            std::to_string(kRegionOffset) + ")" + Remedy();
    return false;
  }
  return true;
}

// The region's own first bytes (`prefix`, read at kRegionOffset): this build's version and size. False and `error`
// otherwise.
bool RegionPrefixOk(const unsigned char* prefix, const std::string& path, std::string& error) {
  const auto version = FieldAt<std::uint32_t>(prefix, offsetof(Region, version));
  const auto region_bytes = FieldAt<std::uint32_t>(prefix, offsetof(Region, region_bytes));
  if (version != kRegionVersion) {
    error = Quoted(path) + " has layout version " + std::to_string(version) + ", this library reads version " +
            std::to_string(kRegionVersion) + "; every process of a container must use one vgpu build" + Remedy();
    return false;
  }
  if (region_bytes != sizeof(Region)) {
    error = Quoted(path) + " declares " + std::to_string(region_bytes) + " bytes of region, but this build's is " +
            std::to_string(sizeof(Region)) + "; it was written by an incompatible build" + Remedy();
    return false;
  }
  return true;
}

// Reads the headers through pread before anything is mapped: a short or foreign file is refused without ever
// touching a page that does not exist (SIGBUS). Never repairs a file it does not recognise.
bool Validate(int fd, const std::string& path, struct stat& st, std::string& error) {
  if (fstat(fd, &st) != 0) {
    error = "cannot stat " + Quoted(path) + ": " + std::strerror(errno);
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    error = Quoted(path) + " is not a regular file" + Remedy();
    return false;
  }
  const std::string expected_size =
      "a version " + std::to_string(kRegionVersion) + " region file is " + std::to_string(kFileBytes) + " bytes";
  const auto truncated = [&] {
    error = Quoted(path) + " is truncated (" + std::to_string(st.st_size) + " bytes; " + expected_size + ")" + Remedy();
    return false;
  };
  unsigned char head[kPrefixBytes];
  if (st.st_size < static_cast<off_t>(kPrefixBytes) ||
      pread(fd, head, kPrefixBytes, 0) != static_cast<ssize_t>(kPrefixBytes)) {
    return truncated();
  }
  if (!HamiPartOk(head, path, error)) return false;
  unsigned char prefix[kPrefixBytes] = {};
  const bool has_region =
      st.st_size >= static_cast<off_t>(kRegionOffset + kPrefixBytes) &&
      pread(fd, prefix, kPrefixBytes, static_cast<off_t>(kRegionOffset)) == static_cast<ssize_t>(kPrefixBytes);
  if (!has_region || FieldAt<std::uint64_t>(prefix, offsetof(Region, magic)) != kRegionMagic) {
    error = Quoted(path) + " is a HAMi-core cache file (v" +
            std::to_string(FieldAt<std::uint32_t>(head, offsetof(hami::SharedRegion, major_version))) + "." +
            std::to_string(FieldAt<std::uint32_t>(head, offsetof(hami::SharedRegion, minor_version))) + ", " +
            std::to_string(st.st_size) + " bytes), not libvgpu's (no \"VGPUREGN\" at byte " +
            std::to_string(kRegionOffset) + "; " + expected_size + ")" + Remedy();
    return false;
  }
  if (!RegionPrefixOk(prefix, path, error)) return false;
  if (st.st_size < static_cast<off_t>(kFileBytes)) return truncated();
  return true;
}

// Whether the owner of `slot` lives, for a reader that holds no slot: 1 its liveness byte is held by some
// description (ours holds none), 0 it is not, -1 the probe failed.
int ProbeLiveness(int fd, int slot) {
  struct flock lock {};
  lock.l_type = F_WRLCK;  // a test, not a claim: F_OFD_GETLK needs no write access to the file
  lock.l_whence = SEEK_SET;
  lock.l_start = LivenessByte(slot);
  lock.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &lock) != 0) return -1;
  return lock.l_type != F_UNLCK ? 1 : 0;
}

// The fd of a valid region at `path` (created if absent). A file Validate refuses is replaced once unused
// (replace.h), looked at again every 10 ms for up to a second while in use; `note` says what was replaced. -1 and
// `error` (Validate's reason, and why the file was not replaced) otherwise.
int OpenValid(const std::string& path, struct stat& st, std::string& note, std::string& error) {
  constexpr int kLooks = 100;
  constexpr timespec kLookAgain{0, 10'000'000};
  for (int look = 0; look < kLooks; ++look) {
    const int fd = CreateOrOpen(path, error);
    if (fd < 0) return -1;
    if (Validate(fd, path, st, error)) return fd;
    std::string why_not;
    const Replaced replaced = ReplaceIfUnused(path, fd, kFileBytes, InitializeFile, note, why_not);
    close(fd);
    if (replaced == Replaced::yes) continue;
    error += " (" + why_not + ")";
    if (replaced == Replaced::never) return -1;
    nanosleep(&kLookAgain, nullptr);
  }
  return -1;
}

}  // namespace

bool ReadSnapshot(const std::string& path, Snapshot& out, std::string& error) {
  // O_NONBLOCK: a FIFO planted at the path must not hang the monitor in open() (found by tests/fuzz/fuzz_region);
  // Validate then refuses it. It changes nothing for a regular file's pread.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    error = "cannot open " + Quoted(path) + " for reading: " + std::strerror(errno);
    return false;
  }
  struct stat st {};
  if (!Validate(fd, path, st, error)) {
    close(fd);
    return false;
  }
  // A copy, read with pread, not a mapping: the file is writable by every container user, and a mapping of a file
  // truncated under the reader faults (SIGBUS) and kills the monitor. Writers change the region under its lock,
  // which a reader never takes, so the copy may be a moment apart between fields: fine for monitoring.
  const auto copy = std::make_unique<Region>();
  auto* bytes = reinterpret_cast<char*>(copy.get());
  std::size_t have = 0;
  while (have < sizeof(Region)) {
    const ssize_t got = pread(fd, bytes + have, sizeof(Region) - have, static_cast<off_t>(kRegionOffset + have));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      error = "cannot read " + Quoted(path) + ": " +
              (got < 0 ? std::string(std::strerror(errno)) : "the file was truncated while being read");
      close(fd);
      return false;
    }
    have += static_cast<std::size_t>(got);
  }
  auto& region = *copy;
  const auto load32 = [](auto& field) { return std::atomic_ref(field).load(std::memory_order_relaxed); };
  const auto load64 = [](std::uint64_t& field) {
    return std::atomic_ref<std::uint64_t>(field).load(std::memory_order_relaxed);
  };
  Snapshot snapshot;
  snapshot.version = region.version;
  snapshot.lock_repairs = load32(region.lock_repairs);
  // A robust mutex's word is the kernel's robust-futex ABI (the kernel reads it when a holder dies): the holder's tid
  // in the low 30 bits, FUTEX_WAITERS and FUTEX_OWNER_DIED above. glibc keeps it first in pthread_mutex_t.
  std::uint32_t lock_word = 0;
  std::memcpy(&lock_word, region.lock_storage, sizeof lock_word);
  snapshot.lock_holder_tid = static_cast<std::int32_t>(lock_word & FUTEX_TID_MASK);
  const std::uint32_t device_count = std::min(load32(region.device_count), kMaxDevices);
  std::uint32_t used_devices[kMaxDevices] = {};  // region index of each snapshot device
  for (std::uint32_t d = 0; d < device_count; ++d) {
    Device& device = region.devices[d];
    if (load32(device.in_use) == 0) continue;
    DeviceSnapshot view{};
    std::memcpy(view.uuid, device.uuid, sizeof view.uuid);  // written before device_count counted it
    view.used_bytes = 0;
    view.cached_used_bytes = load64(device.used_bytes);
    view.limit_bytes = load64(device.limit_bytes);
    view.context_bytes = load64(device.context_bytes);
    view.held_ns = load64(device.held_ns);
    view.refused_allocations = load64(device.refused_allocations);
    view.compute.resize(sizeof device.compute);
    static_assert(sizeof device.compute % 8 == 0 && offsetof(Device, compute) % 8 == 0);
    for (std::size_t word = 0; word < sizeof device.compute / 8; ++word) {
      // The cell is updated with 8-byte atomics by its writers: copy it the same way, word by word.
      auto* cell = reinterpret_cast<std::uint64_t*>(device.compute) + word;
      const std::uint64_t value = load64(*cell);
      std::memcpy(view.compute.data() + word * 8, &value, 8);
    }
    used_devices[snapshot.devices.size()] = d;
    snapshot.devices.push_back(std::move(view));
  }
  for (int i = 0; i < static_cast<int>(kMaxSlots); ++i) {
    Slot& slot = region.slots[i];
    if (load32(slot.state) != SlotState::live) continue;
    const std::int32_t pid = load32(slot.pid);
    const int probed = ProbeLiveness(fd, i);
    // The byte is the region's own liveness truth; kill(pid, 0) only where it cannot be probed. A pid of -1 is a
    // holder the claimant could not name: never kill() it (that would signal every process we may).
    const bool alive = probed >= 0 ? probed == 1 : pid <= 0 || kill(pid, 0) == 0 || errno == EPERM;
    if (!alive) continue;
    SlotSnapshot view;
    view.pid = pid;
    view.generation = load64(slot.generation);
    view.used_bytes.resize(snapshot.devices.size());
    for (std::size_t d = 0; d < snapshot.devices.size(); ++d) {
      const std::uint64_t used = load64(slot.used_bytes[used_devices[d]]);
      view.used_bytes[d] = used;
      snapshot.devices[d].used_bytes = SaturatingAdd(snapshot.devices[d].used_bytes, used);
    }
    snapshot.live.push_back(std::move(view));
  }
  close(fd);
  out = std::move(snapshot);
  return true;
}

// Holds the region's robust lock for a scope. A lock inherited from a dead owner is repaired before use. Waits
// go in slices (kLockSliceNs) and are bounded (kLockWaitMaxNs). The calling thread cannot be cancelled inside
// (fcntl is a cancellation point), so it never leaves half-done work.
class Attachment::Lock {
 public:
  explicit Lock(Attachment& attachment) : attachment_(attachment) {
    pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel_state_);
    pthread_mutex_t* mutex = MutexOf(*attachment_.region_);
    error_ = pthread_mutex_trylock(mutex);  // uncontended: one compare-and-swap, no clock, no system call
    if (error_ == EBUSY) error_ = WaitInSlices(mutex);
    if (error_ == EOWNERDEAD) {
      // Counted first: if we die during the repair, the next owner counts our death too.
      std::atomic_ref<std::uint32_t> repairs(attachment_.region_->lock_repairs);
      repairs.store(repairs.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      // If we die here too, the next owner gets EOWNERDEAD again and repeats: the repair is idempotent.
      RepairAfterOwnerDeath(*attachment_.region_, *attachment_.hami_);
      // EOWNERDEAD means we hold the lock: whatever consistent() says (it can only fail on a lock that is not
      // inconsistent, i.e. usable), we own it now and must unlock it later.
      pthread_mutex_consistent(mutex);
      error_ = 0;
      // Whoever died holding the lock is probably not the only one gone: return everything now.
      attachment_.ReapLocked(MonotonicNs(), true);
    }
  }
  ~Lock() {
    if (error_ == 0) pthread_mutex_unlock(MutexOf(*attachment_.region_));
    pthread_setcancelstate(cancel_state_, nullptr);
  }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

  bool held() const { return error_ == 0; }
  // ETIMEDOUT: held by someone for kLockWaitMaxNs.
  // ENOTRECOVERABLE: someone unlocked a repaired lock without marking it consistent; nothing can fix that
  // while other processes use the file.
  int error() const { return error_; }

 private:
  static int WaitInSlices(pthread_mutex_t* mutex) {
    const std::uint64_t started = MonotonicNs();
    for (;;) {
      // timedlock takes CLOCK_REALTIME; a clock step only stretches or shortens one slice (the total is counted
      // on the monotonic clock).
      const std::uint64_t slice_end = ClockNs(CLOCK_REALTIME) + kLockSliceNs;
      struct timespec deadline {};
      deadline.tv_sec = static_cast<time_t>(slice_end / 1'000'000'000ull);
      deadline.tv_nsec = static_cast<long>(slice_end % 1'000'000'000ull);
      const int r = pthread_mutex_timedlock(mutex, &deadline);
#if defined(VGPU_REGION_TSAN)
      // ThreadSanitizer's timedlock interceptor records an acquisition only on 0, but EOWNERDEAD acquires too
      // (its lock and trylock interceptors know); without this it reports our unlock as one of an unlocked mutex.
      if (r == EOWNERDEAD) {
        __tsan_mutex_pre_lock(mutex, __tsan_mutex_try_lock);
        __tsan_mutex_post_lock(mutex, __tsan_mutex_try_lock, 0);
      }
#endif
      if (r != ETIMEDOUT) return r;
      if (MonotonicNs() - started >= kLockWaitMaxNs) return ETIMEDOUT;
    }
  }

  Attachment& attachment_;
  int cancel_state_ = 0;
  int error_ = 0;
};

Attachment* Attachment::Open(const std::string& requested_path, std::string& error, std::string* note) {
  std::string path = requested_path;
  if (path.empty() && !DefaultPath(path, error)) return nullptr;
  struct stat st {};
  std::string replaced;
  const int fd = OpenValid(path, st, replaced, error);
  if (fd < 0) return nullptr;
  if (note != nullptr) *note = replaced;
  void* mapped = mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) {
    error = "cannot map " + Quoted(path) + ": " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  // The liveness lock goes on a description of its own, never the mapped one. OFD locks last until the last
  // reference to their description is gone, and a mapping is such a reference: a fork child inherits the
  // mapping, so a lock on the mapped description would keep a dead parent "alive" for the child's whole life.
  int liveness_fd = ReopenDescription(fd);
  if (liveness_fd < 0) liveness_fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY);  // no /proc
  struct stat liveness_st {};
  if (liveness_fd < 0 || fstat(liveness_fd, &liveness_st) != 0 || liveness_st.st_dev != st.st_dev ||
      liveness_st.st_ino != st.st_ino) {
    error = "cannot open " + Quoted(path) + " a second time" +
            (liveness_fd < 0 ? std::string(": ") + std::strerror(errno) : std::string(": it was replaced meanwhile"));
    if (liveness_fd >= 0) close(liveness_fd);
    munmap(mapped, kFileBytes);
    close(fd);
    return nullptr;
  }
  close(fd);  // the mapping keeps what it needs
  auto* attachment = new (std::nothrow) Attachment();
  if (attachment == nullptr) {
    error = "out of host memory attaching to " + Quoted(path);
    munmap(mapped, kFileBytes);
    close(liveness_fd);
    return nullptr;
  }
  attachment->mapped_ = mapped;
  attachment->hami_ = static_cast<hami::SharedRegion*>(mapped);
  attachment->region_ = reinterpret_cast<Region*>(static_cast<char*>(mapped) + kRegionOffset);
  attachment->fd_ = liveness_fd;
  attachment->file_device_ = static_cast<std::uint64_t>(st.st_dev);
  attachment->file_inode_ = static_cast<std::uint64_t>(st.st_ino);
  attachment->path_ = path;
  bool claimed = false;
  {
    Lock lock(*attachment);
    if (!lock.held()) {
      error = "cannot take the lock of " + Quoted(path) + ": " +
              (lock.error() == ETIMEDOUT ? std::string("held by another process for over 10 s (stopped or hung?)")
                                         : std::strerror(lock.error())) +
              Remedy();
    } else {
      // Reap first, unconditionally: a process reusing the region after others exited sees only live usage.
      const std::uint64_t now = MonotonicNs();
      attachment->ReapLocked(now, true);
      claimed = attachment->EnsureSlotLocked(now, &error);
    }
  }
  if (!claimed) {
    delete attachment;
    return nullptr;
  }
  return attachment;
}

Attachment::~Attachment() {
  if (region_ == nullptr) return;
  {
    Lock lock(*this);
    if (lock.held() && SlotIsOursLocked()) {
      const int mine = slot_.load(std::memory_order_relaxed);
      Slot& slot = region_->slots[mine];
      for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
        const std::uint64_t own = Load(slot.used_bytes[d]);
        const std::uint64_t used = Load(region_->devices[d].used_bytes);
        Store(region_->devices[d].used_bytes, used - std::min(used, own));
      }
      hami::MirrorSlotFree(*hami_, static_cast<std::uint32_t>(mine));
      ClearSlot(slot);
      // Let the byte go before the slot is free, so the next claimant does not find it still held.
      LockByte(fd_, mine, F_UNLCK);
      slot.state = SlotState::free;
      slot_.store(-1, std::memory_order_release);
    }
  }
  if (fd_ >= 0) close(fd_);
  munmap(mapped_, kFileBytes);
}

bool Attachment::SlotIsOursLocked() const {
  const int mine = slot_.load(std::memory_order_relaxed);
  if (mine < 0) return false;
  const Slot& slot = region_->slots[mine];
  return slot.state == SlotState::live && slot.generation == generation_;
}

// Our slot holds what this process reserved; if it says otherwise, someone rewrote it: put our figure back, and
// move the container's total by the same difference (saturating: a total rewritten too can only be raised).
// Requires the lock and our slot.
void Attachment::RestoreOwnLocked(int device) {
  Slot& slot = region_->slots[slot_.load(std::memory_order_relaxed)];
  const std::uint64_t written = Load(slot.used_bytes[device]);
  if (written == own_[device]) return;
  ++tampered_;
  Store(slot.used_bytes[device], own_[device]);
  hami::MirrorUsed(*hami_, static_cast<std::uint32_t>(slot_.load(std::memory_order_relaxed)),
                   static_cast<std::uint32_t>(device), own_[device]);
  Device& totals = region_->devices[device];
  const std::uint64_t total = Load(totals.used_bytes);
  Store(totals.used_bytes, own_[device] >= written ? SaturatingAdd(total, own_[device] - written)
                                                   : total - std::min(total, written - own_[device]));
}

bool Attachment::EnsureSlotLocked(std::uint64_t now_ns, std::string* error) {
  if (SlotIsOursLocked()) return true;
  ReapLocked(now_ns, false);
  if (ClaimLocked(error)) return true;
  if (ReapLocked(now_ns, true) == 0) return false;
  return ClaimLocked(error);
}

bool Attachment::ReopenLocked(std::string* error) {
  // Normally ForgetAfterFork already opened a description of our own; this is the fallback without /proc.
  const int fd = open(path_.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY);
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || static_cast<std::uint64_t>(st.st_dev) != file_device_ ||
      static_cast<std::uint64_t>(st.st_ino) != file_inode_) {
    if (error != nullptr) {
      *error = "cannot reopen " + Quoted(path_) + " after fork" +
               (fd < 0 ? std::string(": ") + std::strerror(errno) : std::string(": another file is there now"));
    }
    if (fd >= 0) close(fd);
    return false;
  }
  fd_ = fd;
  return true;
}

bool Attachment::ClaimLocked(std::string* error) {
  if (fd_ < 0 && !ReopenLocked(error)) return false;
  Region& region = *region_;
  // A slot we held but lost (someone rewrote the table): let its byte go, or it would look alive forever.
  if (const int lost = slot_.exchange(-1, std::memory_order_acq_rel); lost >= 0) LockByte(fd_, lost, F_UNLCK);
  for (std::uint32_t attempt = 0; attempt < kMaxSlots; ++attempt) {
    int found = -1;
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      if (region.slots[i].state == SlotState::free) {
        found = static_cast<int>(i);
        break;
      }
    }
    if (found < 0) break;
    Slot& slot = region.slots[found];
    ClearSlot(slot);
    slot.pid = static_cast<std::int32_t>(getpid());
    slot.generation = ++region.next_generation;
    slot.started_ns = ClockNs(CLOCK_REALTIME);
    slot.state = SlotState::claiming;  // if we die before `live`, the repair frees it
    if (test_hook_ != nullptr) test_hook_(TestPoint::claiming);
    const int lock_error = LockByte(fd_, found, F_WRLCK);
    if (lock_error == 0) {
      hami::MirrorSlotLive(*hami_, static_cast<std::uint32_t>(found), slot.pid);
      slot.state = SlotState::live;
      generation_ = slot.generation;
      slot_.store(found, std::memory_order_release);
      return true;
    }
    if (lock_error != EAGAIN && lock_error != EACCES) {
      slot.state = SlotState::free;
      if (error != nullptr) {
        *error = "cannot take a liveness lock (F_OFD_SETLK) on " + Quoted(path_) + ": " + std::strerror(lock_error) +
                 "; the folder's file system must support open file description locks, or set " + kPathVariable +
                 " to a file on another (e.g. /tmp or /dev/shm)";
      }
      return false;
    }
    // Free in the table, yet another description holds its byte: a live process whose slot was overwritten.
    // Leave the slot to it (unknown pid); the reaper frees it once that process is gone.
    slot.pid = -1;
    slot.state = SlotState::live;
  }
  if (error != nullptr) {
    *error = Quoted(path_) + ": all " + std::to_string(kMaxSlots) +
             " process slots are held by live processes; no GPU memory can be accounted for a new process";
  }
  return false;
}

std::uint32_t Attachment::ReapLocked(std::uint64_t now_ns, bool force) {
  Region& region = *region_;
  if (!force) {
    const std::uint64_t last = region.last_reap_ns;
    // A `last` in the future (another boot's clock, a scribbled file) does not postpone reaping forever.
    if (now_ns >= last && now_ns - last < kReapIntervalNs) return 0;
  }
  region.last_reap_ns = now_ns;
  if (fd_ < 0) return 0;  // a fork child that could not get a description of its own cannot probe
  const int mine = slot_.load(std::memory_order_relaxed);
  std::uint32_t reaped = 0;
  for (int i = 0; i < static_cast<int>(kMaxSlots); ++i) {
    Slot& slot = region.slots[i];
    if (slot.state == SlotState::free || i == mine) continue;
    if (HeldByAnother(fd_, i)) continue;
    // Only a live slot was counted in the device totals; anything else (a stray `claiming`, a scribbled state)
    // is cleared without touching them.
    if (slot.state == SlotState::live) {
      for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
        const std::uint64_t own = Load(slot.used_bytes[d]);
        if (own == 0) continue;
        const std::uint64_t used = Load(region.devices[d].used_bytes);
        Store(region.devices[d].used_bytes, used - std::min(used, own));
      }
    }
    if (test_hook_ != nullptr) test_hook_(TestPoint::reap_between_writes);
    hami::MirrorSlotFree(*hami_, static_cast<std::uint32_t>(i));
    ClearSlot(slot);
    slot.state = SlotState::free;
    ++reaped;
  }
  return reaped;
}

std::uint32_t Attachment::ReapDead(bool force) {
  const std::uint64_t now = MonotonicNs();
  Lock lock(*this);
  if (!lock.held()) return 0;
  return ReapLocked(now, force);
}

int Attachment::DeviceIndex(const std::uint8_t uuid[16]) {
  Lock lock(*this);
  if (!lock.held()) return -1;
  Region& region = *region_;
  const std::uint32_t count = std::min(region.device_count, kMaxDevices);
  for (std::uint32_t i = 0; i < count; ++i) {
    if (std::memcmp(region.devices[i].uuid, uuid, sizeof region.devices[i].uuid) == 0) return static_cast<int>(i);
  }
  if (count == kMaxDevices) return -1;
  // An entry past the count may hold leftovers of an add cut short by a crash: start it clean.
  Device& device = region.devices[count];
  std::memcpy(device.uuid, uuid, sizeof device.uuid);
  Store(device.used_bytes, 0);
  Store(device.context_bytes, 0);
  Store(device.limit_bytes, 0);
  device.in_use = 1;
  hami::MirrorDevice(*hami_, count, uuid, count + 1);
  // Last, with release order: the entry is complete before anyone who reads the count with acquire finds it.
  std::atomic_ref<std::uint32_t>(region.device_count).store(count + 1, std::memory_order_release);
  return static_cast<int>(count);
}

bool Attachment::Reserve(int device, std::uint64_t bytes, std::uint64_t limit_bytes) {
  if (!ValidDevice(device)) return false;
  if (bytes == 0) return true;
  const std::uint64_t now = MonotonicNs();  // read before the lock: keeps the clock out of the critical section
  Lock lock(*this);
  if (!lock.held() || !EnsureSlotLocked(now, nullptr)) return false;
  ReapLocked(now, false);
  Device& totals = region_->devices[device];
  const auto fits = [&] {
    const std::uint64_t used = Load(totals.used_bytes);
    return bytes <= limit_bytes && used <= limit_bytes - bytes;  // never `used + bytes`: it could wrap
  };
  RestoreOwnLocked(device);
  // This process alone, by its own count: no rewrite of the file can let it pass the limit.
  if (bytes > limit_bytes || own_[device] > limit_bytes - bytes) return false;
  if (!fits() && (ReapLocked(now, true) == 0 || !fits())) return false;
  Slot& slot = region_->slots[slot_.load(std::memory_order_relaxed)];
  const std::uint64_t own = SaturatingAdd(own_[device], bytes);
  own_[device] = own;
  // Slot first: it is the truth the repair recomputes the total from, so a death between the two writes
  // leaves a reservation that counts fully (and is reaped with its dead owner).
  Store(slot.used_bytes[device], own);
  hami::MirrorUsed(*hami_, static_cast<std::uint32_t>(slot_.load(std::memory_order_relaxed)),
                   static_cast<std::uint32_t>(device), own);
  if (test_hook_ != nullptr) test_hook_(TestPoint::reserve_between_writes);
  Store(totals.used_bytes, Load(totals.used_bytes) + bytes);
  if (own > Load(slot.peak_bytes[device])) Store(slot.peak_bytes[device], own);
  return true;
}

void Attachment::Release(int device, std::uint64_t bytes) {
  if (!ValidDevice(device) || bytes == 0) return;
  Lock lock(*this);
  // Without a slot of our own we hold nothing (a fork child before its first Reserve): nothing to give back.
  if (!lock.held() || !SlotIsOursLocked()) return;
  RestoreOwnLocked(device);
  Slot& slot = region_->slots[slot_.load(std::memory_order_relaxed)];
  const std::uint64_t own = own_[device];
  const std::uint64_t returned = std::min(bytes, own);
  if (returned == 0) return;
  own_[device] = own - returned;
  Store(slot.used_bytes[device], own - returned);
  hami::MirrorUsed(*hami_, static_cast<std::uint32_t>(slot_.load(std::memory_order_relaxed)),
                   static_cast<std::uint32_t>(device), own - returned);
  if (test_hook_ != nullptr) test_hook_(TestPoint::release_between_writes);
  Device& totals = region_->devices[device];
  const std::uint64_t used = Load(totals.used_bytes);
  Store(totals.used_bytes, used - std::min(used, returned));
}

std::uint64_t Attachment::Used(int device) const {
  return ValidDevice(device) ? Load(region_->devices[device].used_bytes) : 0;
}

std::uint64_t Attachment::OwnUsed(int device) const {
  const int mine = slot_.load(std::memory_order_acquire);
  if (!ValidDevice(device) || mine < 0) return 0;
  return Load(region_->slots[mine].used_bytes[device]);
}

std::uint64_t Attachment::ContextBytes(int device) const {
  return ValidDevice(device) ? Load(region_->devices[device].context_bytes) : 0;
}

void Attachment::SetContextBytes(int device, std::uint64_t bytes) {
  if (ValidDevice(device)) Store(region_->devices[device].context_bytes, bytes);
}

void Attachment::SetLimitForMonitoring(int device, std::uint64_t bytes) {
  if (!ValidDevice(device)) return;
  Store(region_->devices[device].limit_bytes, bytes);
  hami::MirrorLimit(*hami_, static_cast<std::uint32_t>(device), bytes);
}

// Monitoring counters: relaxed adds, no lock (docs/region.md, "Monitoring counters"). They only grow; a reader
// wants each figure whole, not in step with anything else.
void Attachment::AddHeldNs(int device, std::uint64_t ns) {
  if (!ValidDevice(device)) return;
  std::atomic_ref<std::uint64_t>(region_->devices[device].held_ns).fetch_add(ns, std::memory_order_relaxed);
}

void Attachment::CountRefusedAllocation(int device) {
  if (!ValidDevice(device)) return;
  std::atomic_ref<std::uint64_t>(region_->devices[device].refused_allocations).fetch_add(1, std::memory_order_relaxed);
}

void Attachment::MarkLaunch(std::int64_t unix_s) { hami::MirrorLaunch(*hami_, unix_s); }

void Attachment::SetPriorityForMonitoring(int priority) { hami::MirrorPriority(*hami_, priority); }

void Attachment::SetSmLimitForMonitoring(int device, std::uint32_t percent) {
  if (ValidDevice(device)) hami::MirrorSmLimit(*hami_, static_cast<std::uint32_t>(device), percent);
}

void Attachment::SetBreakdownForMonitoring(int device, std::uint64_t context, std::uint64_t module) {
  const int mine = slot_.load(std::memory_order_acquire);
  if (ValidDevice(device) && mine >= 0) {
    hami::MirrorBreakdown(*hami_, static_cast<std::uint32_t>(mine), static_cast<std::uint32_t>(device), context,
                          module);
  }
}

void Attachment::SetUtilizationForMonitoring(int device, std::uint32_t percent) {
  const int mine = slot_.load(std::memory_order_acquire);
  if (ValidDevice(device) && mine >= 0) {
    hami::MirrorUtilization(*hami_, static_cast<std::uint32_t>(mine), static_cast<std::uint32_t>(device), percent);
  }
}

void* Attachment::ComputeArea(int device) {
  return ValidDevice(device) ? static_cast<void*>(region_->devices[device].compute) : nullptr;
}

void Attachment::LeaveMirror() {
  const int mine = slot_.load(std::memory_order_acquire);
  if (mine >= 0) hami::MirrorSlotFree(*hami_, static_cast<std::uint32_t>(mine));
}

void Attachment::ForgetAfterFork() {
  // One thread, in a fork child: no locks (their owners may be gone with the parent), no allocation, only
  // async-signal-safe calls. The shared mapping stays valid (MAP_SHARED is inherited) and holds no lock: Open
  // mapped the file through a description of its own, so only the liveness descriptor ties us to the parent.
  slot_.store(-1, std::memory_order_relaxed);
  generation_ = 0;
  for (std::uint64_t& own : own_) own = 0;  // the parent's usage stays the parent's
  const int inherited = fd_;
  fd_ = -1;
  if (inherited < 0) return;
  // A description of our own for the same file. Closing the inherited descriptor matters: while any process
  // holds the parent's description, the parent's liveness lock lives on and its slot can never be reaped.
  fd_ = ReopenDescription(inherited);  // -1 without /proc: ReopenLocked tries the path at the next claim
  close(inherited);
}

}  // namespace vgpu::region
