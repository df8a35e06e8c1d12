// The launch path's "release" stage under time division (docs/compute-sharing.md): a launch of a container with a
// compute cap waits for the container's turn on its GPU, decided by policy::Decide from the node's schedule file,
// and what it released is published there for the others. VGPU_COMPUTE_SHARING=time-division turns it on.
#pragma once

#include <cstdint>

#include "vgpu/policy/time_division.h"

namespace vgpu::hooks::turn {

// Whether this process holds its cap on `ordinal` by time division: sharing configured, the device capped (not
// `disable`), the schedule file usable and the container a member. Set up on first use. False: the limiter holds
// the cap (a schedule file that cannot be used is said once, on stderr, naming it).
bool Scheduled(int ordinal);

// A launch's turn: the window it goes into (its container's own, one lent, or an idle one borrowed for free).
struct Ticket {
  bool scheduled = false;
  policy::Interval window;
  bool free = false;
  std::uint64_t waited_ns = 0;
  // Launches booked with this one (the shim's fast path) may go while they end by this time: the end of the
  // container's own window; 0 in a window lent or borrowed (each launch there takes its turn). Unscheduled: no end.
  std::uint64_t turn_until_ns = UINT64_MAX;
};

// What the launch path gives the stage: its measurements' longest kernel (asked when the schedule is re-read; it
// sizes the cycle) and what to do before a launch waits (end the measurements the wait would otherwise hold).
struct Caller {
  void* self = nullptr;
  std::uint64_t (*longest_ns)(void* self) = nullptr;
  void (*before_wait)(void* self) = nullptr;
  // Whether the process's work on the device has completed (its streams idle). While a launch waits, it asks, so
  // that the container's published expected end drops to the true one and the next owner starts at once.
  bool (*drained)(void* self) = nullptr;
};

// Waits until a launch expected to take `estimate_ns` on `ordinal` may go. With LIBCUDA_LOG_LEVEL=4 a wait says
// why and how long.
Ticket Take(int ordinal, std::uint64_t estimate_ns, const Caller& caller, const void* function);

// The launch taken with `ticket` was made (and a book of launches after it opened): their expected end and the
// window are published, and the container's account is charged (not in a free borrow): their estimate, or, for a
// container alone on its one GPU (policy::ChargesWhatRan), what the process's launches have cost since its last
// charge by the limiter's accounting (`spent_ns`, Limiter::spent_ns read after this launch was admitted). Nothing
// to do for an estimate of 0.
void Released(int ordinal, const Ticket& ticket, std::uint64_t estimate_ns, std::int64_t spent_ns);
// A thread of the process is about to wait inside the driver for the GPU (a synchronize call). While it waits the
// process cannot look at its streams, and the end it published (projected from estimates: a kernel's usual run) may
// pass while its work still runs, letting a sibling release beside it, which the driver then time-slices with it.
// So on each device where the process has work it has not seen complete, the end its siblings see is raised a cycle
// ahead if it holds their turn, and so is the end the other containers see where it keeps them off
// (policy::KeepsOthersOffWhileUndrained: a member on one GPU beside others; for a member spanning GPUs it stays the
// projection). Returns those devices (bit per CUDA ordinal) for EndBlocking; 0, with nothing done (three atomic
// loads), unless time division holds a device of the process's, it has released work there, and it has met a sibling
// in the container's turn there or keeps other members off it.
std::uint64_t BeginBlocking();
// The wait returned: on each device of `devices` (once no other thread of the process is still waiting there) the
// end drops to now if `drained(ordinal)` says the process's streams there are idle, else to what is left projected
// from its estimates, at least policy::kUndrainedLeadNs ahead.
void EndBlocking(std::uint64_t devices, bool (*drained)(int ordinal));

// Launches charged by Released that were never made (a book's unused ones) go back to the account (unless it is
// charged what ran: the limiter's accounting gave them back). Lock-free: the caller may hold its own locks.
void Refund(int ordinal, std::uint64_t estimate_ns);

}  // namespace vgpu::hooks::turn
