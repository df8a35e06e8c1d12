// The node's schedule file: validation, the membership lock, joining and leaving (schedule.h).
#include "vgpu/base/clock.h"
#include "vgpu/schedule/schedule.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "vgpu/region/shared_file.h"

namespace vgpu::schedule {
namespace {

constexpr const char* kPathVariable = "VGPU_SCHEDULE_FILE";
// Membership changes are rare and short: a lock held longer than this belongs to a stopped process; the caller
// gives up (the shim falls back to the limiter for that launch's setup and tries again later).
constexpr std::uint64_t kLockWaitMaxNs = 1'000'000'000;
constexpr std::uint64_t kLockSliceNs = 10'000'000;

static_assert(sizeof(pthread_mutex_t) <= sizeof(Header::lock_storage));

pthread_mutex_t* MutexOf(Header& header) { return reinterpret_cast<pthread_mutex_t*>(header.lock_storage); }

std::string Named(const std::string& path) { return "schedule file '" + path + "'"; }

// The cycle's base and bound the file's creator sets (CreateOrOpenShared's context).
struct Settings {
  std::uint64_t base_cycle_ns;
  std::uint64_t cycle_max_ns;
};

bool Initialize(void* mapped, const void* context, std::string& error) {
  const auto& settings = *static_cast<const Settings*>(context);
  auto* header = static_cast<Header*>(mapped);
  if (const int r = region::InitRobustMutex(header->lock_storage); r != 0) {
    error = std::string("its lock: ") + std::strerror(r);
    return false;
  }
  header->magic = kScheduleMagic;
  header->version = kScheduleVersion;
  header->file_bytes = static_cast<std::uint32_t>(sizeof(Header));
  header->base_cycle_ns = settings.base_cycle_ns;
  header->cycle_max_ns = settings.cycle_max_ns;
  return true;
}

// Reads what identifies the file before mapping it: a foreign, truncated or newer file is refused, never repaired.
bool Validate(int fd, const std::string& path, std::string& error) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    error = Named(path) + " is not a regular file";
    return false;
  }
  Header prefix{};
  const auto want = static_cast<ssize_t>(offsetof(Header, gpu_count));
  if (st.st_size < want || pread(fd, &prefix, static_cast<std::size_t>(want), 0) != want) {
    error = Named(path) + " is truncated (" + std::to_string(st.st_size) + " bytes; a version 1 schedule file is " +
            std::to_string(sizeof(Header)) + ")";
    return false;
  }
  if (prefix.magic != kScheduleMagic) {
    char magic[24];
    std::snprintf(magic, sizeof magic, "0x%016llx", static_cast<unsigned long long>(prefix.magic));
    error = Named(path) + " is not a vgpu schedule file (magic " + magic + ", expected \"VGPUSCHD\")";
    return false;
  }
  if (prefix.version != kScheduleVersion || prefix.file_bytes != sizeof(Header) ||
      st.st_size < static_cast<off_t>(sizeof(Header))) {
    error = Named(path) + " is version " + std::to_string(prefix.version) + " of " + std::to_string(prefix.file_bytes) +
            " bytes; this shim reads version 1 of " + std::to_string(sizeof(Header)) + " bytes";
    return false;
  }
  // The cycle's base and bound, which every member's plan is built from: out of range, no plan could be built (a
  // file written by something else, or a liar), and the file is refused rather than leave every member unplanned.
  if (prefix.base_cycle_ns < policy::kCycleLeastNs || prefix.cycle_max_ns < prefix.base_cycle_ns ||
      prefix.cycle_max_ns > policy::kCycleMostNs) {
    error = Named(path) + " has a cycle of " + std::to_string(prefix.base_cycle_ns) + " ns at most " +
            std::to_string(prefix.cycle_max_ns) + " ns; accepted: a base of at least " +
            std::to_string(policy::kCycleLeastNs) + " ns and a bound from the base to " +
            std::to_string(policy::kCycleMostNs) + " ns";
    return false;
  }
  return true;
}

bool Live(const Entry& entry, std::uint64_t now_ns) {
  const std::uint64_t beat = Load(entry.heartbeat_ns);
  return Load(entry.id) != 0 && beat + kStaleNs > now_ns;
}

using base::MonotonicNs;

}  // namespace

std::uint64_t Load(const std::uint64_t& field) {
  return std::atomic_ref<std::uint64_t>(const_cast<std::uint64_t&>(field)).load(std::memory_order_acquire);
}

void Store(std::uint64_t& field, std::uint64_t value) {
  std::atomic_ref<std::uint64_t>(field).store(value, std::memory_order_release);
}

void RaiseTo(std::uint64_t& field, std::uint64_t value) {
  std::atomic_ref<std::uint64_t> ref(field);
  std::uint64_t seen = ref.load(std::memory_order_relaxed);
  while (seen < value && !ref.compare_exchange_weak(seen, value, std::memory_order_release)) {
  }
}

Members ReadMembers(const Header& header, std::uint64_t now_ns) {
  Members out;
  std::vector<std::uint32_t> live;
  for (std::uint32_t e = 0; e < kMaxEntries; ++e) {
    if (Live(header.entries[e], now_ns)) live.push_back(e);
  }
  std::sort(live.begin(), live.end(),
            [&](std::uint32_t a, std::uint32_t b) { return Load(header.entries[a].id) < Load(header.entries[b].id); });
  for (const std::uint32_t e : live) {
    const Entry& entry = header.entries[e];
    const std::uint64_t id = Load(entry.id);
    // (A share out of range, or no GPU: an entry being rewritten, or a liar; left out, as WindowPlan would refuse it.)
    const auto share = std::atomic_ref<std::uint32_t>(const_cast<std::uint32_t&>(entry.share_permille)).load();
    const std::uint64_t gpus = Load(entry.gpus) & ((1ull << kMaxGpus) - 1);
    if (id == 0 || share == 0 || share > 1000 || gpus == 0) continue;
    if (!out.members.empty() && out.members.back().id == id) continue;  // two entries of one id: the first
    out.members.push_back({id, share, gpus});
    out.longest_ns.push_back(Load(entry.longest_ns));
    out.entries.push_back(e);
  }
  return out;
}

policy::Published PublishedOf(const GpuState& state, std::uint64_t now_ns) {
  policy::Published p;
  p.in_flight = Load(state.busy_until_ns) > now_ns ? 1 : 0;
  p.waiting = Load(state.waiting_until_ns) > now_ns ? 1 : 0;
  p.repaid_until_ns = Load(state.repaid_until_ns);
  p.released_until_ns = Load(state.released_until_ns);
  p.work_end_ns = Load(state.busy_until_ns);  // (its expected end with a margin, lowered to now when seen drained)
  return p;
}

policy::Published PublishedOf(const Entry& entry, std::uint32_t g, std::uint64_t now_ns) {
  policy::Published p = PublishedOf(entry.gpu[g], now_ns);
  if (Load(entry.gpus) != (1ull << g)) return p;  // (only a member on one GPU declines or cuts in)
  const std::uint64_t declined = Load(entry.declined_until_ns);
  if (declined > now_ns) p.declined_until_ns = declined;
  const std::uint64_t cut_in = Load(entry.cut_in_until_ns);
  if (cut_in > now_ns) p.cut_in_until_ns = cut_in;
  return p;
}

// Holds the membership lock for a scope: taken in slices, at most kLockWaitMaxNs; a lock inherited from a dead
// owner needs no repair (an entry is published by its id, written last), only to be marked consistent.
class Board::Lock {
 public:
  explicit Lock(Header& header) : mutex_(MutexOf(header)) {
    error_ = pthread_mutex_trylock(mutex_);
    const std::uint64_t started = MonotonicNs();
    while (error_ == EBUSY && MonotonicNs() < started + kLockWaitMaxNs) {
      struct timespec until {};
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += static_cast<long>(kLockSliceNs);
      if (until.tv_nsec >= 1'000'000'000) {
        until.tv_sec += 1;
        until.tv_nsec -= 1'000'000'000;
      }
      error_ = pthread_mutex_timedlock(mutex_, &until);
      if (error_ == ETIMEDOUT) error_ = EBUSY;
    }
    if (error_ == EOWNERDEAD) {
      std::atomic_ref<std::uint32_t> repairs(header.lock_repairs);
      repairs.fetch_add(1, std::memory_order_relaxed);
      pthread_mutex_consistent(mutex_);
      error_ = 0;
    }
  }
  ~Lock() {
    if (error_ == 0) pthread_mutex_unlock(mutex_);
  }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
  bool held() const { return error_ == 0; }

 private:
  pthread_mutex_t* mutex_;
  int error_ = 0;
};

std::unique_ptr<Board> Board::Open(const std::string& path, std::uint64_t base_cycle_ns, std::uint64_t cycle_max_ns,
                                   std::string& error) {
  const Settings settings{base_cycle_ns, cycle_max_ns};
  const int fd =
      region::CreateOrOpenShared(path, sizeof(Header), Initialize, &settings, "schedule file", kPathVariable, error);
  if (fd < 0) return nullptr;
  if (!Validate(fd, path, error)) {
    error += "; remove it once no container uses it, or set " + std::string(kPathVariable) + " to another path";
    close(fd);
    return nullptr;
  }
  void* mapped = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) {
    error = "cannot map " + Named(path) + ": " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  std::unique_ptr<Board> board(new Board());
  board->header_ = static_cast<Header*>(mapped);
  board->fd_ = fd;
  board->path_ = path;
  return board;
}

Board::~Board() {
  if (header_ != nullptr) munmap(header_, sizeof(Header));
  if (fd_ >= 0) close(fd_);
}

int Board::GpuIndex(const std::uint8_t uuid[16]) {
  const auto find = [&]() -> int {
    const std::uint32_t count = std::min(std::atomic_ref<std::uint32_t>(header_->gpu_count).load(), kMaxGpus);
    for (std::uint32_t g = 0; g < count; ++g) {
      if (std::memcmp(header_->uuids[g], uuid, 16) == 0) return static_cast<int>(g);
    }
    return -1;
  };
  if (const int known = find(); known >= 0) return known;
  Lock lock(*header_);
  if (!lock.held()) return -1;
  if (const int known = find(); known >= 0) return known;
  std::atomic_ref<std::uint32_t> count(header_->gpu_count);
  const std::uint32_t g = count.load();
  if (g >= kMaxGpus) return -1;
  std::memcpy(header_->uuids[g], uuid, 16);
  count.store(g + 1, std::memory_order_release);  // readers see the UUID before the count that includes it
  return static_cast<int>(g);
}

int Board::Join(std::uint64_t id, std::uint32_t share_permille, std::uint64_t gpus, std::uint64_t now_ns,
                std::string& error) {
  Lock lock(*header_);
  if (!lock.held()) {
    error = Named(path_) + ": its lock has been held for over 1 s (a stopped process?)";
    return -1;
  }
  int free_entry = -1;
  for (std::uint32_t e = 0; e < kMaxEntries; ++e) {
    Entry& entry = header_->entries[e];
    if (Load(entry.id) == id) {
      // Its configuration as this process has it: a region (and its id) may outlive a container and be reused by
      // the next with other limits, and an entry left by the last is found again before it ages out.
      std::atomic_ref<std::uint32_t>(entry.share_permille).store(share_permille);
      Store(entry.gpus, gpus);
      Store(entry.heartbeat_ns, now_ns);
      return static_cast<int>(e);
    }
    if (free_entry < 0 && !Live(entry, now_ns)) free_entry = static_cast<int>(e);
  }
  if (free_entry < 0) {
    error = Named(path_) + " has " + std::to_string(kMaxEntries) + " live members: no entry for another container";
    return -1;
  }
  Entry& entry = header_->entries[free_entry];
  Store(entry.id, 0);  // a stale entry taken over: readers skip it while it is rewritten
  std::atomic_ref<std::uint32_t>(entry.share_permille).store(share_permille);
  Store(entry.gpus, gpus);
  Store(entry.longest_ns, 0);
  Store(entry.joined_ns, now_ns);
  for (GpuState& gpu : entry.gpu) {
    Store(gpu.busy_until_ns, 0);
    Store(gpu.released_until_ns, 0);
    Store(gpu.waiting_until_ns, 0);
    Store(gpu.repaid_until_ns, 0);
  }
  Store(entry.declined_until_ns, 0);
  Store(entry.cut_in_until_ns, 0);
  Store(entry.heartbeat_ns, now_ns);
  Store(entry.id, id);  // published last
  return free_entry;
}

void Board::Leave(int index, std::uint64_t id) {
  if (index < 0 || index >= static_cast<int>(kMaxEntries)) return;
  Lock lock(*header_);
  if (!lock.held()) return;  // it ages out on its own
  Entry& entry = header_->entries[index];
  if (Load(entry.id) == id) Store(entry.id, 0);
}

}  // namespace vgpu::schedule
