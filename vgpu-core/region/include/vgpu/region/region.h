// The container region: shared per-device memory usage and per-process slots, crash-safe (docs/region.md).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "vgpu/region/hami_v1.h"
#include "vgpu/region/layout.h"

namespace vgpu::region {

// This process's attachment to a region file. Thread-safe. Never calls exit(); failures are reported as a
// message the caller prints once.
class Attachment {
 public:
  // Opens (creating atomically if needed) the region at `path`, validates it, reaps dead slots and claims a slot
  // for this process. An empty `path` means the default, /tmp/vgpu/region.<uid> (the folder is created 0700).
  // A file of another layout at the path (HAMi-core's own, an older region of ours, a short or foreign file) is
  // replaced by a fresh region once no process uses it (docs/hami-cache.md, "Bad input"); `note`, when given, then
  // says what was replaced (else it is left empty). A newer region of ours is never replaced.
  // Returns null and sets `error` (one line: the path, what is wrong, what to do) on failure.
  static Attachment* Open(const std::string& path, std::string& error, std::string* note = nullptr);

  // Detaches: gives back this process's usage, frees its slot, unmaps and closes. Owners normally keep the
  // attachment for the life of the process (the kernel drops the liveness lock at exit and the next reap
  // returns the usage); deleting it is for tests and tools.
  ~Attachment();
  Attachment(const Attachment&) = delete;
  Attachment& operator=(const Attachment&) = delete;

  // The index of the device with this UUID, adding it if new; -1 if the table is full.
  int DeviceIndex(const std::uint8_t uuid[16]);

  // Reserves `bytes` on `device` for this process if the container's usage stays within `limit_bytes`
  // (one atomic step under the robust lock). On refusal, reaps dead processes and tries once more.
  // This process's own usage is also kept in its own memory: a slot found rewritten (by a container process
  // writing the region file, docs/threat-model.md) is put back first, the container's total with it, and this
  // process alone never passes `limit_bytes` whatever the file says.
  // `limit_bytes` is a hard cap: pass UINT64_MAX for "no limit" (0 admits nothing but zero-byte requests).
  // False also when `device` is out of range, no slot can be had, or the lock stays held by another process for
  // 10 s (fail closed).
  bool Reserve(int device, std::uint64_t bytes, std::uint64_t limit_bytes);
  // Gives back what Reserve took (clamped at what this process holds: never wraps).
  void Release(int device, std::uint64_t bytes);

  // HAMi-core's part of the file says this process's slot is free (status 0, no usage), the region's own slot left
  // as it is, for the reaper: for the process's exit, so that HAMi's monitor stops counting a process that ended
  // (docs/hami-cache.md). Lock-free (atomic stores); another thread's Reserve meanwhile only writes a figure that no
  // longer counts.
  void LeaveMirror();

  // Times this process found its slot rewritten by someone else and put it back (docs/threat-model.md).
  std::uint64_t TamperedCount() const { return tampered_; }
  // The container's usage on `device` (lock-free read) and this process's own.
  std::uint64_t Used(int device) const;
  std::uint64_t OwnUsed(int device) const;

  std::uint64_t ContextBytes(int device) const;
  void SetContextBytes(int device, std::uint64_t bytes);
  void SetLimitForMonitoring(int device, std::uint64_t bytes);
  // The monitoring counters of `device` (Device::held_ns, refused_allocations; docs/metrics.md): one relaxed atomic
  // add each, no lock, nothing for a bad index. `ns`: how long a launch waited for the compute limiter.
  void AddHeldNs(int device, std::uint64_t ns);
  void CountRefusedAllocation(int device);
  // CUDA_TASK_PRIORITY, for HAMi's monitor only (HAMi-core's `priority`: a lower number is a higher priority).
  void SetPriorityForMonitoring(int priority);
  // A launch, for HAMi's monitor (hami::MirrorLaunch): at most once a second is enough (it looks every 5 s).
  void MarkLaunch(std::int64_t unix_s);
  // The compute cap in percent (0: none), for HAMi's monitor only (HAMi-core's part: docs/hami-cache.md).
  void SetSmLimitForMonitoring(int device, std::uint32_t percent);
  // This process's share of `device`'s time over the last second in percent, for HAMi's monitor only (its slot's
  // device_util[].sm; nothing while the process holds no slot).
  void SetUtilizationForMonitoring(int device, std::uint32_t percent);
  // Of this process's usage on `device`, its contexts' and the driver's own memory, for HAMi's monitor only (its
  // slot's used[].context and .module; .data is the rest).
  void SetBreakdownForMonitoring(int device, std::uint64_t context, std::uint64_t module);
  // HAMi's monitor's feedback (docs/hami-cache.md, "The feedback"): recent_kernel is -1 while a container of a higher
  // priority is active (launches are held), utilization_switch 1 while another container is active on our GPUs.
  bool HamiHoldsLaunches() const { return hami::RecentKernel(*hami_) == -1; }
  bool HamiSaysShared() const { return hami::UtilizationSwitch(*hami_) == 1; }
  // The device's compute area (Device::compute, 88 bytes, zero in a new region), or null for a bad index.
  void* ComputeArea(int device);

  // Frees the slots of processes that have died and returns their usage. Rate-limited to once per 100 ms
  // unless `force`. Returns the number of slots reaped.
  std::uint32_t ReapDead(bool force);

  // In a fork child: forget the parent's slot (and its liveness lock) without touching it; the next call
  // claims a fresh slot for the child. Meant for a pthread_atfork child handler, so it takes no lock (a
  // parent thread that no longer exists may have held one), allocates nothing and makes only
  // async-signal-safe calls: open() of /proc/self/fd/N for a description of its own, close() of the inherited
  // one. Calling it anywhere but in a fork child gives up this process's slot and its usage record.
  void ForgetAfterFork();

  const Region& region() const { return *region_; }
  int slot() const { return slot_.load(std::memory_order_acquire); }
  const std::string& path() const { return path_; }

 private:
  friend struct AttachmentTestPeer;  // tests/region: stops a process at the points below to kill it there
  enum class TestPoint : int { claiming, reserve_between_writes, release_between_writes, reap_between_writes };
  static void (*test_hook_)(TestPoint point);  // null outside tests; called with the region lock held

  class Lock;

  Attachment() = default;
  // The following require the region lock. `error`, when not null, receives a one-line reason on failure.
  bool EnsureSlotLocked(std::uint64_t now_ns, std::string* error);
  bool ClaimLocked(std::string* error);
  bool SlotIsOursLocked() const;
  void RestoreOwnLocked(int device);
  std::uint32_t ReapLocked(std::uint64_t now_ns, bool force);
  bool ReopenLocked(std::string* error);

  void* mapped_ = nullptr;  // the whole file (kFileBytes): HAMi-core's part, then the region
  hami::SharedRegion* hami_ = nullptr;
  Region* region_ = nullptr;
  int fd_ = -1;                // our own open file description, never the mapped one: it holds our liveness lock
  std::atomic<int> slot_{-1};  // read without the lock by OwnUsed and slot()
  std::uint64_t own_[kMaxDevices] = {};  // this process's usage per device, as it reserved and released it
  std::uint64_t tampered_ = 0;           // times our slot was found rewritten and put back
  std::uint64_t generation_ = 0;         // the slot's generation when we claimed it
  std::uint64_t file_device_ = 0;        // st_dev and st_ino of the mapped file, to reopen the same file after fork
  std::uint64_t file_inode_ = 0;
  std::string path_;
};

// A read-only view of a region for monitoring (the scenario runner, tools): what each device and each live
// process holds, read without the lock and without a slot of its own, so a monitor never changes what it watches.
struct DeviceSnapshot {
  std::uint8_t uuid[16];
  std::uint64_t used_bytes;           // sum of the live processes' slots (not the cached Device::used_bytes)
  std::uint64_t cached_used_bytes;    // Device::used_bytes, what limits are enforced against: it also counts
                                      // dead processes' slots not yet reaped (equal to used_bytes once reaped)
  std::uint64_t limit_bytes;          // as the last process that attached configured it
  std::uint64_t context_bytes;        // measured context overhead, 0 = not yet known
  std::uint64_t held_ns;              // Device::held_ns: launches' waits for the compute limiter, in all
  std::uint64_t refused_allocations;  // Device::refused_allocations: allocations refused at the memory limit
  std::vector<std::uint8_t> compute;  // a raw copy of Device::compute (the policy code reads it)
};

struct SlotSnapshot {
  std::int32_t pid;
  std::uint64_t generation;
  std::vector<std::uint64_t> used_bytes;  // per device, indexed as Snapshot::devices
};

struct Snapshot {
  std::uint32_t version = 0;
  std::uint32_t lock_repairs = 0;       // Region::lock_repairs: processes that died holding the lock
  std::int32_t lock_holder_tid = 0;     // the thread (host tid) holding the lock as it was read, 0 if free
  std::vector<DeviceSnapshot> devices;  // the devices in use, in the region's order
  std::vector<SlotSnapshot> live;       // slots whose process still lives
};

// Reads the region at `path` (O_RDONLY, PROT_READ: a monitor needs no write access). A slot counts as live only
// while its process lives: its liveness byte is held (the same probe the reaper uses, immune to pid reuse,
// zombies and pid namespaces), or, where that probe cannot be made, kill(pid, 0) finds the process. So a
// process killed a moment ago is not reported as holding memory even before anyone reaps its slot. False and
// `error` (one line: the path and what is wrong) for a missing, truncated or foreign file.
bool ReadSnapshot(const std::string& path, Snapshot& out, std::string& error);

}  // namespace vgpu::region
