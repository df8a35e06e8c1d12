// What the two modes of the runner share: the scenario checks a run needs, the expanded process list, the device
// list of a `gpu:` spec, and the trace's JSON lines. Private to sim/runner.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "vgpu/base/json_line.h"
#include "vgpu/runner/runner.h"
#include "vgpu/scenario/check.h"
#include "vgpu/scenario/scenario.h"

namespace vgpu::runner::internal {

inline constexpr std::uint32_t kTraceVersion = 1;
// Exit codes the trace gives to a status the runner decided itself.
inline constexpr int kKilledCode = 9;  // SIGKILL
inline constexpr int kOomCode = 3;     // vgpu-tenant's exit status for a CUDA failure, out of memory included

// One OS process of the scenario: a replica of a ProcessSpec.
struct ProcessRun {
  std::uint32_t tenant = 0;
  std::uint32_t index = 0;   // within its tenant, replicas in order: the trace's "process"
  std::uint32_t global = 0;  // across the scenario: the live --seed offset
  const scenario::ProcessSpec* spec = nullptr;
  std::uint32_t device = 0;  // physical device: the tenant's devices[spec->device]
  std::uint64_t end_ns = 0;  // crash_at if any, else stop
};

// The modes' rules (a virtual run has no real GPU and no faults; a live one samples in whole milliseconds), then the
// scenario's own (scenario::Check): "" or one line naming the field, its value and what is accepted.
std::string Check(const scenario::Scenario& scenario, Mode mode);

std::vector<ProcessRun> Expand(const scenario::Scenario& scenario);

// One trace line, fields in the order they are added: Line("exit").Number("t_ns", t).Done(). Control characters in
// strings are written \u00XX, as the trace always had them.
inline base::JsonLine Line(const char* event) { return base::JsonLine(event, base::Controls::unicode); }

// Where the trace goes: a file written line by line as the run goes, or a string for Outcome::trace.
class TraceSink {
 public:
  TraceSink() = default;
  ~TraceSink();
  TraceSink(const TraceSink&) = delete;
  TraceSink& operator=(const TraceSink&) = delete;

  bool Open(const std::string& path, std::string& error);  // "" keeps it in memory
  void Write(const std::string& line);
  // False if a write failed (the message says which file and why).
  bool Close(std::string& error);
  std::string TakeText() { return std::move(text_); }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
  std::string text_;
  int write_errno_ = 0;
};

// The "run" and "tenant" lines that open every trace.
void WriteHeader(const scenario::Scenario& scenario, Mode mode, std::uint32_t device_count, TraceSink& trace);

// The simple scalars of the JSON lines our own programs print (vgpu-tenant, vgpu-sampler): the value of `key` at
// the top level or in the first object that has it. Not a JSON parser; enough for lines we format ourselves.
bool FindNumber(std::string_view line, std::string_view key, std::uint64_t& value);
bool FindText(std::string_view line, std::string_view key, std::string& value);

Outcome RunVirtual(const scenario::Scenario& scenario, const Options& options, TraceSink& trace);
Outcome RunLive(const scenario::Scenario& scenario, const Options& options, TraceSink& trace);

}  // namespace vgpu::runner::internal
