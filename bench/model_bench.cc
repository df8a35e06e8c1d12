// Benchmarks of the pure device model: what one launch costs the timeline (Advance + EnqueueKernel), the
// work every fake cuLaunchKernel does under the machine's lock. No state file, no clock: time is simulated.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fakecuda/model/layout.h"
#include "fakecuda/model/model.h"

namespace fakecuda::bench {
namespace {

using model::Machine;

constexpr std::uint64_t kStartNs = 1'000'000'000;

model::KernelLaunch OneBlockLaunch(std::uint64_t per_wave_ns) {
  model::KernelLaunch launch{};
  launch.shape.grid[0] = launch.shape.grid[1] = launch.shape.grid[2] = 1;
  launch.shape.block[0] = 32;
  launch.shape.block[1] = launch.shape.block[2] = 1;
  launch.per_wave_ns = per_wave_ns;
  launch.name = "vgpu_spin";
  return launch;
}

std::unique_ptr<Machine> NewMachine(model::SchedulingMode mode) {
  auto machine = std::make_unique<Machine>();  // ~27 MB, zeroed like a fresh state file
  model::MachineConfig config = model::DefaultConfig();
  config.mode = mode;
  model::InitMachine(*machine, config, kStartNs, 0);
  return machine;
}

// One process launching 1 us kernels, one every simulated microsecond, round robin over `streams` streams
// (Arg): the device keeps up, so queues stay short and the cost is the scan over the streams in use.
void ModelLaunchOneProcess(benchmark::State& state) {
  const auto stream_count = static_cast<std::uint32_t>(state.range(0));
  auto machine = NewMachine(model::SchedulingMode::timeslice);
  const std::uint32_t slot = model::ClaimSlot(*machine, 100, kStartNs);
  std::vector<std::uint32_t> streams;
  for (std::uint32_t i = 0; i < stream_count; ++i) streams.push_back(model::CreateStream(*machine, slot, 0, 0, 0));
  const model::KernelLaunch launch = OneBlockLaunch(1'000);
  std::uint64_t now_ns = kStartNs;
  std::uint64_t launches = 0;
  for (auto _ : state) {
    now_ns += 1'000;
    model::Advance(*machine, 0, now_ns, nullptr);
    const auto result = model::EnqueueKernel(*machine, streams[launches % stream_count], launch, now_ns, nullptr);
    if (result != model::EnqueueResult::ok) {
      state.SkipWithError("a stream's queue filled: the simulated device fell behind");
      break;
    }
    ++launches;
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(launches));
  // Close to 1 when the simulated device keeps up, as this benchmark intends.
  state.counters["completed_per_launch"] =
      launches == 0 ? 0.0 : static_cast<double>(machine->devices[0].kernels_completed) / static_cast<double>(launches);
}
BENCHMARK(ModelLaunchOneProcess)->Arg(1)->Arg(16)->Arg(256)->Unit(benchmark::kNanosecond);

// Two time-sliced processes taking turns to launch 300 ns kernels, one launch every simulated microsecond:
// each process runs out of work between launches, so the device changes hands at nearly every launch.
void ModelLaunchTwoProcesses(benchmark::State& state) {
  auto machine = NewMachine(model::SchedulingMode::timeslice);
  const std::uint32_t streams[2] = {model::CreateStream(*machine, model::ClaimSlot(*machine, 100, kStartNs), 0, 0, 0),
                                    model::CreateStream(*machine, model::ClaimSlot(*machine, 200, kStartNs), 0, 0, 0)};
  const model::KernelLaunch launch = OneBlockLaunch(300);
  std::uint64_t now_ns = kStartNs;
  std::uint64_t launches = 0;
  for (auto _ : state) {
    now_ns += 1'000;
    model::Advance(*machine, 0, now_ns, nullptr);
    if (model::EnqueueKernel(*machine, streams[launches % 2], launch, now_ns, nullptr) != model::EnqueueResult::ok) {
      state.SkipWithError("a stream's queue filled: the simulated device fell behind");
      break;
    }
    ++launches;
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(launches));
}
BENCHMARK(ModelLaunchTwoProcesses)->Unit(benchmark::kNanosecond);

// Advance alone over an idle device, one simulated millisecond a call: the floor of every fake call.
void ModelAdvanceIdle(benchmark::State& state) {
  auto machine = NewMachine(model::SchedulingMode::timeslice);
  model::CreateStream(*machine, model::ClaimSlot(*machine, 100, kStartNs), 0, 0, 0);
  std::uint64_t now_ns = kStartNs;
  for (auto _ : state) {
    now_ns += 1'000'000;
    model::Advance(*machine, 0, now_ns, nullptr);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(ModelAdvanceIdle)->Unit(benchmark::kNanosecond);

}  // namespace
}  // namespace fakecuda::bench
