"""The host out of memory inside the shim (docs/shim.md, "Out of host memory"): the shim tests' worker
(tests/shim/shim_worker.cc, `mixed`) runs four threads that allocate (cuMemAlloc, cuMemAllocAsync, arrays, pitched,
VMM, contexts), read NVML, free and launch under a memory and a compute cap while one in five of the shim's own allocations fails (its malloc,
tests/shim/host_oom.cc); then frees everything. Every call must answer success or out of memory, no exception may
leave the shim, and the container's count and the driver's view of the process must come back where they started.
A second part: threads allocating from one stream-ordered pool with the pool calls slowed down (the race found on
the H100, docs/results-gpu.md "Fifth run").

Run by the reliability suite (tests/reliability/conftest.py): fixtures fake_gpu, figures, build_dir."""

from __future__ import annotations

import pytest

LIMIT = 2 * 1024 ** 3


def values_of(stdout: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in stdout.splitlines():
        key, _, value = line.partition("=")
        if _ and key not in values:
            values[key] = value
    return values


def run_mixed(fake_gpu, build_dir, name: str, *args: str, faults: str | None = None) -> dict[str, str]:
    worker = build_dir / "bin" / "shim_worker"
    if not worker.exists():
        pytest.skip(f"{worker} is not built (the shim tests are part of the default build)")
    fake_gpu.env.update({"LD_PRELOAD": str(build_dir / "lib" / "libvgpu.so"), "CUDA_DEVICE_MEMORY_LIMIT": str(LIMIT),
                         "CUDA_DEVICE_SM_LIMIT": "50", "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / f"{name}.region")})
    if faults:
        fake_gpu.env["FAKECUDA_FAULTS"] = faults
    else:
        fake_gpu.env.pop("FAKECUDA_FAULTS", None)
    result = fake_gpu.run(worker, "mixed", "threads=4", f"limit={LIMIT}", *args, timeout=120)
    return values_of(result.stdout)


def test_the_shim_out_of_host_memory_answers_every_call_and_loses_nothing(fake_gpu, build_dir, figures):
    totals = {"calls": 0, "out_of_memory": 0, "shim_allocations_failed": 0, "exceptions_out": 0, "unexpected": 0,
              "leaked_bytes": 0}
    seeds = (1, 2, 3)
    for seed in seeds:
        values = run_mixed(fake_gpu, build_dir, f"oom{seed}", "rounds=3000", "oom_percent=20", f"seed={seed}")
        totals["calls"] += int(values["ok"]) + int(values["oom"]) + int(values["unexpected"])
        totals["out_of_memory"] += int(values["oom"])
        totals["shim_allocations_failed"] += int(values["injected"])
        totals["exceptions_out"] += int(values["threw"])
        totals["unexpected"] += int(values["unexpected"])
        totals["leaked_bytes"] += abs(int(values["used_after"]) - int(values["used_before"]))
        totals["leaked_bytes"] += abs(int(values["own_after"]) - int(values["own_before"]))
    figures.record("host-oom", runs=len(seeds), **totals)
    if totals["shim_allocations_failed"] == 0:
        pytest.skip("no allocation of the shim could be failed here (a sanitizer build: see tests/shim/hostoom_test.cc)")
    assert totals["exceptions_out"] == 0
    assert totals["unexpected"] == 0
    assert totals["leaked_bytes"] == 0
    assert totals["out_of_memory"] > 0 and totals["calls"] > 10_000


def test_threads_allocating_from_one_slowed_pool_keep_the_count(fake_gpu, build_dir, figures):
    leaked = 0
    seeds = (1, 2, 3, 4)
    for seed in seeds:
        values = run_mixed(fake_gpu, build_dir, f"pool{seed}", "rounds=1500", "actions=17", f"seed={seed}",
                           faults="cuMemPoolGetAttribute:delay_us=50;cuMemPoolTrimTo:delay_us=50")
        leaked += abs(int(values["used_after"]) - int(values["used_before"]))
    figures.record("pool-race", runs=len(seeds), count_lost_bytes=leaked)
    assert leaked == 0
