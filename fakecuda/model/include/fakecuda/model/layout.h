// The fake machine's shared layout: every struct that lives in the state file that all processes map.
//
// This header is an ABI between processes (possibly built at different commits). Bump kLayoutVersion
// whenever any field here changes meaning, size or position; a process refuses a file whose version or
// size differs from its own. Only fixed-size, trivially copyable types; no pointers (addresses differ
// between processes); indices instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace fakecuda::model {

inline constexpr std::uint64_t kMagic = 0x4144554345'4b4146ULL;  // "FAKECUDA" little-endian
inline constexpr std::uint32_t kLayoutVersion = 5;  // 5: Machine::departed (4: collective kernels, Machine::groups)

inline constexpr std::uint32_t kMaxDevices = 8;
inline constexpr std::uint32_t kMaxProcesses = 256;
inline constexpr std::uint32_t kMaxStreams = 1024;
inline constexpr std::uint32_t kStreamDepth = 128;  // queued operations per stream (the launch queue)
inline constexpr std::uint32_t kKernelNameBytes = 48;
inline constexpr std::uint32_t kWindowHistory = 16;  // NVML utilization windows kept per device
inline constexpr std::uint32_t kNoSlot = 0xffffffffu;
inline constexpr std::uint32_t kMaxGroups = 16;     // collective groups in use at once
inline constexpr std::uint32_t kGroupRounds = 128;  // rounds of one group tracked at once (a ring)

struct DeviceSpec {
  char preset[32];
  char name[96];
  std::uint32_t sm_count;
  std::uint32_t cc_major;
  std::uint32_t cc_minor;
  std::uint32_t max_threads_per_block;
  std::uint32_t max_threads_per_sm;
  std::uint32_t max_blocks_per_sm;
  std::uint32_t warp_size;
  std::uint32_t shared_bytes_per_block;
  std::uint32_t shared_bytes_per_sm;
  std::uint32_t registers_per_sm;
  std::uint32_t clock_khz;
  std::uint32_t memory_clock_khz;
  std::uint32_t memory_bus_bits;
  std::uint32_t l2_bytes;
  std::uint32_t pci_bus;
  std::uint32_t power_limit_mw;
  std::uint64_t memory_bytes;    // physical size, NVML's total
  std::uint64_t reserved_bytes;  // NVML total minus cuMemGetInfo's total
  std::uint64_t context_bytes;   // device memory one context costs
  std::uint8_t uuid[16];
};

enum class SchedulingMode : std::uint32_t { timeslice = 0, mps = 1 };

struct MachineConfig {
  std::uint32_t device_count;
  SchedulingMode mode;
  std::uint64_t timeslice_ns;
  std::uint64_t switch_ns;            // time-slicing: a handover between processes, during which nobody runs
  std::uint64_t nvml_window_ns;       // NVML sample period
  std::uint64_t nvml_publish_lag_ns;  // a window's value is visible this long after it closes
  char devices_spec[256];             // FAKECUDA_DEVICES as given, to refuse a mismatching process
  DeviceSpec devices[kMaxDevices];
};

enum class OpKind : std::uint32_t { kernel = 0, marker = 1, gate = 2, wait = 3 };

// One queued operation in a stream's ring. Written completely before the ring's tail is bumped.
struct Op {
  std::uint64_t seq;  // position in the stream, == the tail value when queued
  OpKind kind;
  std::uint32_t gate_open;  // gate: set when the host function returned
  // kernel
  double remaining_ns;     // work left, in nanoseconds at full speed
  std::uint64_t alone_ns;  // duration with the device to itself
  double sm_fraction;      // share of the device's SMs it occupies, (0, 1]
  std::uint64_t queued_ns;
  std::uint64_t start_ns;  // valid once `started`
  std::uint64_t end_ns;    // set when completed (markers too: event timestamps)
  std::uint64_t ran_ns;    // kernel: time it ran (its span less the time other processes held the device)
  std::uint32_t grid[3];
  std::uint32_t block[3];
  char name[kKernelNameBytes];
  // wait: complete when stream `wait_stream` (generation `wait_generation`) has passed `wait_seq`
  std::uint32_t wait_stream;
  // kernel: 1 once it has run at least once (start_ns is then valid, even 0); a collective kernel 2 once the work
  // it missed before its release was known has been caught up (kStartedCaughtUp)
  std::uint32_t started;
  std::uint64_t wait_generation;
  std::uint64_t wait_seq;
  // kernel, collective (group_entry != 0): it holds the device from its start but does no work until every member of
  // its round has started (or left), as a collective kernel waits for its peers on the other devices.
  std::uint32_t group_entry;  // 1 + its group's index in Machine::groups; 0: not a collective
  std::uint32_t round;        // this member's launches of its group before this one
};

inline constexpr std::uint32_t kStartedCaughtUp = 2;

enum class StreamState : std::uint32_t { free = 0, live = 1, draining = 2 };  // draining: destroyed, work left

struct Stream {
  StreamState state;
  std::uint32_t slot;  // owning process slot
  std::uint32_t device;
  std::uint32_t flags;       // CU_STREAM_NON_BLOCKING etc., as given
  std::uint64_t generation;  // bumped on every reuse, so stale references are detectable
  std::int32_t priority;
  std::uint32_t reserved0;
  std::uint64_t head;  // ops [head, tail) are pending
  std::uint64_t tail;
  std::uint64_t last_end_ns;  // when the most recent op completed
  Op ring[kStreamDepth];
};

enum class SlotState : std::uint32_t { free = 0, claiming = 1, live = 2 };

struct NvmlSample {
  std::uint64_t timestamp_us;  // CLOCK_REALTIME microseconds, as NVML reports
  std::uint32_t sm_percent;
  std::uint32_t valid;
};

struct ProcessSlot {
  SlotState state;
  std::int32_t pid;  // as seen by the process itself
  std::uint64_t generation;
  std::uint64_t started_ns;
  std::uint32_t mps_sm_count[kMaxDevices];  // 0 = whole device
  std::uint32_t contexts[kMaxDevices];
  std::uint64_t memory_bytes[kMaxDevices];    // allocations and contexts charged to this process
  std::uint64_t window_busy_ns[kMaxDevices];  // device time in the current NVML window
  std::uint64_t busy_total_ns[kMaxDevices];
  NvmlSample latest_sample[kMaxDevices];
};

// What a process that has gone did on the GPU, kept after its slot is freed (ReleaseSlot), so that its GPU time
// can still be read once it has exited (the scenario runner's `program:` processes, docs/scenarios.md).
struct DepartedProcess {
  std::int32_t pid;  // 0: an unused entry
  std::uint32_t reserved0;
  std::uint64_t started_ns;  // CLOCK_MONOTONIC: its slot's claim
  std::uint64_t ended_ns;    // the latest time any device had been advanced to when the slot was freed
  std::uint64_t busy_total_ns[kMaxDevices];
};
inline constexpr std::uint32_t kDepartedHistory = kMaxProcesses;  // the last this many, a ring

struct UtilWindow {
  std::uint64_t end_ns;
  std::uint32_t percent;
  std::uint32_t reserved0;
};

struct DeviceTimeline {
  std::uint64_t advanced_to_ns;     // the timeline is exact up to here
  std::uint32_t active_slot;        // time-slicing: the process that owns the device now
  std::uint32_t stream_high_water;  // streams [0, high_water) may belong to this device
  std::uint64_t slice_end_ns;
  std::uint64_t switch_until_ns;  // a handover to active_slot is in progress until then
  std::uint64_t window_start_ns;
  std::uint64_t window_busy_ns;
  std::uint64_t busy_total_ns;
  std::uint64_t kernels_completed;
  std::uint64_t memory_used_bytes;  // derived: sum of slots' memory_bytes; repaired after a crash
  std::uint32_t window_count;       // windows closed so far (history index = count % kWindowHistory)
  std::uint32_t last_sample_slot;   // the process the latest per-process sample named (ties rotate past it)
  UtilWindow windows[kWindowHistory];
};

// One collective group: its members (one per device, each the launching process's slot) and its recent rounds.
struct GroupRound {
  std::uint64_t round;
  std::uint32_t started;  // members whose kernel of this round has started
  std::uint32_t reserved0;
  std::uint64_t last_start_ns;  // when the last of them started: the round is released then
};

struct CollectiveGroup {
  std::uint64_t id;                         // 0: a free entry
  std::uint32_t size;                       // members the group has (the launch says)
  std::uint32_t left;                       // members whose process has gone: their rounds never start
  std::uint64_t left_at_ns;                 // when the latest of them went
  std::uint32_t member_slots[kMaxDevices];  // by device: the process launching there (kNoSlot: none yet)
  std::uint64_t next_round[kMaxDevices];    // by device: the round of the next launch there
  GroupRound rounds[kGroupRounds];          // round r at r % kGroupRounds
};

struct Machine {
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t machine_bytes;
  std::uint64_t created_ns;         // CLOCK_MONOTONIC at creation: the NVML window grid's origin
  std::int64_t realtime_offset_us;  // CLOCK_REALTIME - CLOCK_MONOTONIC at creation, in us
  std::uint64_t last_reap_ns;
  std::uint64_t next_generation;
  alignas(64) unsigned char lock_storage[64];  // the state layer's robust pthread mutex
  MachineConfig config;
  DeviceTimeline devices[kMaxDevices];
  ProcessSlot slots[kMaxProcesses];
  Stream streams[kMaxStreams];
  std::uint32_t groups_in_use;  // entries of `groups` with an id: 0 keeps Advance off the lockstep path
  std::uint32_t reserved1;
  CollectiveGroup groups[kMaxGroups];
  std::uint64_t departed_count;                // processes departed so far; entry = count % kDepartedHistory
  DepartedProcess departed[kDepartedHistory];  // the latest processes to have gone
};

static_assert(std::is_trivially_copyable_v<Machine>);
static_assert(std::is_standard_layout_v<Machine>);
static_assert(sizeof(Machine) < (1ull << 32), "machine_bytes is 32-bit");

}  // namespace fakecuda::model
