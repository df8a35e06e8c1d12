// The OS side of the fake machine: the shared state file, its robust lock, process slots and liveness,
// reclamation of dead processes, the clock, and the trace file. See docs/fakecuda.md.
#pragma once

#include <cstdint>
#include <string>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"

namespace fakecuda::state {

// The host's CLOCK_MONOTONIC in ns (a time namespace's offset taken out): the fake GPU's clock, one for every process.
std::uint64_t MonotonicNs();
void SleepNs(std::uint64_t ns);

// This process's view of the fake machine. One per library per process (libcuda claims a slot; NVML
// only observes).
struct Attachment {
  model::Machine* machine = nullptr;
  int fd = -1;
  std::uint32_t slot = model::kNoSlot;
  std::uint64_t slot_generation = 0;
  std::int32_t pid = 0;
  std::string path;
};

// Opens (creating atomically if needed) and maps the state file named by FAKECUDA_STATE, checking its
// layout and device configuration against this process's environment. With `claim_slot`, also takes a
// process slot and its liveness lock. Returns null and sets `error` to a one-line message on failure.
// Thread-safe; repeated calls return the same attachment (per `claim_slot` flavour).
Attachment* Attach(bool claim_slot, std::string& error);

// Checks that this process still owns its slot (a process that closed every descriptor — a daemon does — lost
// its liveness lock and may have been reaped, its slot handed to another process). If not, claims a new slot and
// says so once on stderr: what the old slot held was already returned to the device.
void EnsureOwnSlot(Attachment& attachment);

// Called in a fork child: forgets the parent's attachments (without touching the shared state the
// parent still owns) so the next Attach starts afresh.
void ForgetAfterFork();

// Holds the machine's robust mutex; repairs the machine if the previous owner died holding it.
class MachineLock {
 public:
  explicit MachineLock(Attachment& attachment);
  ~MachineLock();
  MachineLock(const MachineLock&) = delete;
  MachineLock& operator=(const MachineLock&) = delete;
  model::Machine& machine() { return *attachment_.machine; }

 private:
  Attachment& attachment_;
};

// Frees the slots of processes that have died (their liveness lock is gone), returning their memory to
// the devices. Rate-limited to once per 100 ms unless `force`. Caller holds the MachineLock.
std::uint32_t ReapDeadProcesses(Attachment& attachment, std::uint64_t now_ns, bool force);

// Advances `device` to now, writing completed kernels to the trace. Caller holds the MachineLock.
void AdvanceToNow(Attachment& attachment, std::uint32_t device, std::uint64_t now_ns);

// Appends one line (without the newline) to FAKECUDA_TRACE if set. Atomic with respect to other writers.
void TraceLine(const std::string& line);
bool TraceEnabled();

// Verbosity from FAKECUDA_LOG (0 = errors only).
int LogLevel();
void LogError(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace fakecuda::state
