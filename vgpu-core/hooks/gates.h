// Gated measurements (docs/compute-limit.md, "Launches on an idle stream"). A measured launch on an idle stream has
// its start event written as soon as the GPU sees it, while the kernel cannot start before the host's launch call has
// submitted it: the pair also times that call (~3 us on an H100). A gate holds the stream, on the GPU, until the host
// says the launch call has returned: a stream wait (cuStreamWaitValue32, ">=") on a word of this process's pinned
// memory, queued before the start event, and the word written after the launch call. The pair then times the GPU's
// part of the launch alone.
//
// A launch call that itself waits for the GPU (a push buffer shared with the stalled stream) would wait forever for a
// word it has not written yet: a watchdog thread (started with the first gate, every signal but a fault's blocked,
// parked after 100 ms without gates) writes the word once it has not moved for 5-10 ms while a gate is shut, and then
// pauses gates for 100 ms, twice as long at each such opening in a row (to a minute). Whoever opens a gate first, its
// owner learns whether it was still shut: if not, the pair was not gated.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace vgpu::hooks::gates {

struct Gate {
  std::uint32_t value = 0;
  bool shut = false;  // a wait was queued: Open must be called
};

// Whether a gate may be shut at `now_ns` (CLOCK_MONOTONIC): the driver exports what gates need and has not refused
// them, and the watchdog has not paused them.
bool Usable(std::uint64_t now_ns);

// Queues, on `stream` of the current context `context`, a wait until the word reaches a new value. False, with
// nothing queued: no gate (the driver lacks stream waits or pinned memory, the word belongs to another context, or
// the host cannot start the watchdog).
bool Shut(CUstream stream, CUcontext context, Gate& gate);

// Writes the word past the gate's value (and every earlier one). True when this gate was still shut: the work behind
// it waited for this call. Call once for every gate Shut.
bool Open(const Gate& gate);

// Before `context` is destroyed: a word in its pinned memory is given up (the driver frees it with the context), once
// no thread is writing it; the next gate makes another.
void ForgetContext(CUcontext context);

// In a fork child: the watchdog thread does not exist there; gates are never shut again.
void ForgetAfterFork();

}  // namespace vgpu::hooks::gates
