// The node's schedule file (docs/compute-sharing.md, "Shared state"): what each container with a compute limit
// publishes to the others on the node, so that every shim computes the same windows (policy::WindowPlan) and sees
// whose work holds a GPU. One file per node, in the folder HAMi mounts read-write into every GPU container.
//
// The layout is an ABI between processes of different containers, possibly built at different commits: bump
// kScheduleVersion whenever a field changes meaning, size or position. Never calls exit().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "vgpu/policy/time_division.h"

namespace vgpu::schedule {

inline constexpr std::uint64_t kScheduleMagic = 0x4448435355504756ULL;  // "VGPUSCHD" little-endian
inline constexpr std::uint32_t kScheduleVersion = 1;
inline constexpr std::uint32_t kMaxGpus = 8;      // the node's GPUs, by UUID
inline constexpr std::uint32_t kMaxEntries = 64;  // containers with a compute limit on the node
// An entry whose heartbeat is older than this is not a member: its windows go to the others.
inline constexpr std::uint64_t kStaleNs = 1'000'000'000;

// What a member publishes about itself on one GPU, written lock-free by its own processes (each field an aligned
// 64-bit atomic; a reader may see one field newer than another). Times on the host's CLOCK_MONOTONIC.
struct GpuState {
  std::uint64_t busy_until_ns;      // its released work is expected done by here, margin included (0: none)
  std::uint64_t released_until_ns;  // the end of the window its latest work was released into
  std::uint64_t waiting_until_ns;   // a launch of it waits for a window at least until here
  std::uint64_t repaid_until_ns;    // in debt: its window time before here is lent to the others
};

struct Entry {
  std::uint64_t id;              // the container's (drawn when its region was made); 0: the entry is free
  std::uint32_t share_permille;  // of each GPU it spans
  std::uint32_t reserved0;
  std::uint64_t gpus;          // bit i: the GPU at uuids[i]
  std::uint64_t heartbeat_ns;  // refreshed by its launching processes
  std::uint64_t longest_ns;    // its longest kernel's expected time (policy::CycleFor)
  std::uint64_t joined_ns;
  // A member on one GPU: the rest of its window up to here is declined (policy::DeclinedUntil). Reserved (0) in
  // files of shims before 63c1e82 (2026-11-28): 0 means none, so a shim that never writes it reads the file right.
  std::uint64_t declined_until_ns;
  // A member on one GPU: a launch of it waits to cut in at the next boundary of the window owner's work; the others
  // on that GPU release nothing until here (policy::Published::cut_in_until_ns, prompt service). Reserved (0) in files
  // of earlier shims: 0 means none.
  std::uint64_t cut_in_until_ns;
  GpuState gpu[kMaxGpus];
};

struct Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t file_bytes;
  std::uint64_t base_cycle_ns;  // policy::CycleFor's base and bound, fixed by the file's creator
  std::uint64_t cycle_max_ns;
  std::uint32_t gpu_count;     // entries of `uuids` in use
  std::uint32_t lock_repairs;  // lockers that inherited the lock from a dead owner
  std::uint8_t uuids[kMaxGpus][16];
  alignas(64) unsigned char lock_storage[64];  // robust, process-shared pthread mutex: membership changes only
  Entry entries[kMaxEntries];
};

static_assert(std::is_trivially_copyable_v<Header> && std::is_standard_layout_v<Header>);
static_assert(sizeof(Entry) % 64 == 0 && offsetof(Header, entries) % 64 == 0);

// ---- pure: what a shim reads from the file, given the time ----

// The members as every shim sees them: the live entries (heartbeat within kStaleNs of `now_ns`), ordered by id.
struct Members {
  std::vector<policy::Member> members;
  std::vector<std::uint64_t> longest_ns;  // per member
  std::vector<std::uint32_t> entries;     // per member: its entry's index
};
Members ReadMembers(const Header& header, std::uint64_t now_ns);

// What the policy reads of a member on one GPU: work in flight while `busy_until_ns` is ahead, a launch waiting
// while `waiting_until_ns` is.
policy::Published PublishedOf(const GpuState& state, std::uint64_t now_ns);
// The same for an entry on GPU `g`, with the rest of its window it declines (a member on that GPU only).
policy::Published PublishedOf(const Entry& entry, std::uint32_t g, std::uint64_t now_ns);

// ---- this process's attachment ----

class Board {
 public:
  // Opens the schedule file at `path`, creating it (with the given cycle base and bound) if absent. Null, with
  // `error` one line naming the file, what was found and what to do, when it cannot be opened or is not a version
  // 1 schedule file (the caller falls back to the limiter: never uncapped).
  static std::unique_ptr<Board> Open(const std::string& path, std::uint64_t base_cycle_ns, std::uint64_t cycle_max_ns,
                                     std::string& error);
  ~Board();
  Board(const Board&) = delete;
  Board& operator=(const Board&) = delete;

  // The index of the GPU with this UUID in the file's table, adding it if new; -1 when the table is full or the
  // lock cannot be had.
  int GpuIndex(const std::uint8_t uuid[16]);
  // The entry of container `id` (its own if another of its processes made it, its share and GPUs set to those
  // given), else a free or stale one claimed for it; -1 with `error` when all are taken by live members.
  int Join(std::uint64_t id, std::uint32_t share_permille, std::uint64_t gpus, std::uint64_t now_ns,
           std::string& error);
  // Frees the entry if it is still `id`'s (the container's last process leaving).
  void Leave(int entry, std::uint64_t id);

  const Header& header() const { return *header_; }
  Entry& entry(int index) { return header_->entries[index]; }
  const std::string& path() const { return path_; }

 private:
  class Lock;
  Board() = default;
  Header* header_ = nullptr;
  int fd_ = -1;
  std::string path_;
};

// Lock-free writes of a member's own entry (its processes race each other; each keeps the larger value).
void RaiseTo(std::uint64_t& field, std::uint64_t value);
void Store(std::uint64_t& field, std::uint64_t value);
std::uint64_t Load(const std::uint64_t& field);

}  // namespace vgpu::schedule
