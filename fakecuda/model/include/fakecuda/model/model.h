// The fake GPU's device model: presets, kernel cost, the shared timeline and NVML windows. Pure: no
// syscalls, no clock reads; the caller passes the time and holds the machine's lock.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "fakecuda/model/layout.h"

namespace fakecuda::model {

// ---- configuration -------------------------------------------------------------------------------

// Parses a FAKECUDA_DEVICES value ("h100-80gb", "2*a100-40gb,tesla-t4", "h100-80gb:memory=16g:sms=20")
// into config.devices/device_count. On failure returns false and sets `error` to a one-line message
// naming the value and what is accepted.
bool ParseDevices(std::string_view spec, MachineConfig& config, std::string& error);

// Parses a byte size: decimal digits with an optional k/m/g/t or Ki/Mi/Gi/Ti suffix, both powers of 1024 as
// HAMi reads them; "010g" is ten GiB, not octal. Rejects signs, overflow, trailing garbage.
bool ParseBytes(std::string_view text, std::uint64_t& bytes);

// The names of the built-in presets, comma separated (for error messages).
const char* PresetNames();

MachineConfig DefaultConfig();

// Fills a freshly zeroed machine. `now_ns` is CLOCK_MONOTONIC (or virtual) time.
void InitMachine(Machine& machine, const MachineConfig& config, std::uint64_t now_ns, std::int64_t realtime_offset_us);

// ---- kernel cost -----------------------------------------------------------------------------------

struct LaunchShape {
  std::uint32_t grid[3];
  std::uint32_t block[3];
  std::uint32_t shared_bytes;
};

// Blocks of this shape that fit on one SM at once (>= 1 for a launchable shape, 0 if it cannot run).
std::uint32_t ResidentBlocksPerSm(const DeviceSpec& spec, const LaunchShape& shape);

struct KernelCost {
  std::uint64_t alone_ns;  // duration with `sm_count` SMs to itself
  double sm_fraction;      // share of the whole device it occupies
};

// `sm_count` is the SMs this process may use (the device's, or fewer under MPS).
KernelCost CostKernel(const DeviceSpec& spec, std::uint32_t sm_count, const LaunchShape& shape,
                      std::uint64_t per_wave_ns);

// ---- the timeline ----------------------------------------------------------------------------------

class TimelineListener {
 public:
  virtual ~TimelineListener() = default;
  virtual void OnKernelComplete(const Machine& machine, std::uint32_t device, std::uint32_t stream, const Op& op) = 0;
};

// Brings `device` up to `now_ns`: schedules kernels (time slices or MPS sharing), completes operations,
// closes NVML windows. Linear in the events since the last call.
void Advance(Machine& machine, std::uint32_t device, std::uint64_t now_ns, TimelineListener* listener);

// ---- processes -----------------------------------------------------------------------------------------

// Takes a free slot for `pid`. Returns kNoSlot if none is free.
std::uint32_t ClaimSlot(Machine& machine, std::int32_t pid, std::uint64_t now_ns);

// Returns a slot's memory to its devices, drops its streams and queued work, frees it. Returns the bytes
// returned per device in `returned_bytes` (may be null).
void ReleaseSlot(Machine& machine, std::uint32_t slot, std::uint64_t returned_bytes[kMaxDevices]);

// ---- streams and operations -------------------------------------------------------------------------

std::uint32_t CreateStream(Machine& machine, std::uint32_t slot, std::uint32_t device, std::uint32_t flags,
                           std::int32_t priority);
// Work already queued still runs; the stream is freed once empty (as cuStreamDestroy promises).
void DestroyStream(Machine& machine, std::uint32_t stream);

// queue_full: the stream holds kStreamDepth operations. bad_group: a collective launch whose group size is outside
// 2 .. kMaxDevices or differs from the group's, or whose device already has another process in the group.
// no_group: kMaxGroups groups are in use.
enum class EnqueueResult { ok, queue_full, bad_group, no_group };

struct KernelLaunch {
  LaunchShape shape;
  std::uint64_t per_wave_ns;
  const char* name;
  // A collective kernel (vgpu_collective): the group it belongs to (0: none) and how many members the group has
  // (one per device, 2 .. kMaxDevices). Its k-th launch on a device joins round k of the group.
  std::uint64_t group = 0;
  std::uint32_t group_size = 0;
};

EnqueueResult EnqueueKernel(Machine& machine, std::uint32_t stream, const KernelLaunch& launch, std::uint64_t now_ns,
                            std::uint64_t* seq_out);
EnqueueResult EnqueueMarker(Machine& machine, std::uint32_t stream, std::uint64_t now_ns, std::uint64_t* seq_out);
EnqueueResult EnqueueGate(Machine& machine, std::uint32_t stream, std::uint64_t now_ns, std::uint64_t* seq_out);
EnqueueResult EnqueueWait(Machine& machine, std::uint32_t stream, std::uint32_t target_stream,
                          std::uint64_t target_generation, std::uint64_t target_seq, std::uint64_t now_ns);
void OpenGate(Machine& machine, std::uint32_t stream, std::uint64_t seq);

// True once the operation `seq` of `stream` (of generation `generation`) has completed, or the stream
// has since been freed.
bool OpDone(const Machine& machine, std::uint32_t stream, std::uint64_t generation, std::uint64_t seq);

// End time of a completed marker/kernel still held in its ring, or 0 if it has been overwritten.
std::uint64_t OpEndNs(const Machine& machine, std::uint32_t stream, std::uint64_t seq);

// A lower bound on the time until op `seq` completes: the full-speed work queued up to and including it.
std::uint64_t LowerBoundRemainingNs(const Machine& machine, std::uint32_t stream, std::uint64_t seq);

// ---- memory ---------------------------------------------------------------------------------------------

std::uint64_t CudaTotalBytes(const DeviceSpec& spec);  // what cuMemGetInfo calls total
std::uint64_t CudaFreeBytes(const Machine& machine, std::uint32_t device);
// Charges `bytes` to `slot` on `device` if they fit under cuMemGetInfo's total. False = out of memory.
bool Charge(Machine& machine, std::uint32_t device, std::uint32_t slot, std::uint64_t bytes);
void Uncharge(Machine& machine, std::uint32_t device, std::uint32_t slot, std::uint64_t bytes);

// ---- NVML ------------------------------------------------------------------------------------------------

// Device utilization as NVML reports it at `now_ns`: the latest window published by then.
std::uint32_t PublishedUtilizationPercent(const Machine& machine, std::uint32_t device, std::uint64_t now_ns);

// ---- recovery ----------------------------------------------------------------------------------------------

// Makes the machine consistent after a process died holding the lock: clamps indices and counters, frees
// half-claimed slots, recomputes derived totals. Returns the number of fields it had to fix.
std::uint32_t RepairMachine(Machine& machine);

}  // namespace fakecuda::model
