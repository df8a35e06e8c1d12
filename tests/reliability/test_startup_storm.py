"""Start-up storm (issue 7; FIELD-NOTES "Hundreds of processes starting at once serialize on a lock for minutes"):
300 processes start at once in one container, each loading the shim, creating a context and allocating under the
container's limit through one region. All must start and finish; the start-up times are printed (p50 / p99 / max,
from exec to a successful first allocation and exit). A hang guard, not a timing test: figures are reported, the
only time limit is one that no healthy run comes near."""

from __future__ import annotations

import statistics
import subprocess
import time

import pytest

PROCESSES = 300


@pytest.mark.slow
def test_three_hundred_processes_start_at_once_on_one_region(fake_gpu, build_dir, figures):
    shim, worker = build_dir / "lib" / "libvgpu.so", build_dir / "bin" / "shim_worker"
    for needed in (shim, worker):
        if not needed.exists():
            pytest.skip(f"{needed} is not built")
    env = dict(fake_gpu.env, LD_PRELOAD=str(shim), CUDA_DEVICE_MEMORY_LIMIT="70Gi",
               CUDA_DEVICE_MEMORY_SHARED_CACHE=str(fake_gpu.work_dir / "storm.region"))
    started, finished, processes = [], {}, []
    for _ in range(PROCESSES):
        started.append(time.monotonic())
        processes.append(subprocess.Popen([str(worker), "cycle", "bytes=1048576", "timeout_ms=60000"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    deadline = time.monotonic() + 120
    while len(finished) < PROCESSES and time.monotonic() < deadline:
        for index, process in enumerate(processes):
            if index not in finished and process.poll() is not None:
                finished[index] = time.monotonic()
        time.sleep(0.001)
    stuck = [p.pid for i, p in enumerate(processes) if i not in finished]
    for process in processes:
        if process.poll() is None:
            process.kill()
    figures.record("start-up storm", processes=PROCESSES, stuck=len(stuck))
    assert not stuck, f"{len(stuck)} processes never finished: {stuck[:10]}"
    failed = [(p.pid, p.returncode, p.stderr.read().decode(errors="replace")[-300:]) for p in processes
              if p.returncode != 0]
    for process in processes:
        process.stderr.close()
    times = sorted(finished[i] - started[i] for i in range(PROCESSES))
    p50, p99 = statistics.median(times), times[int(0.99 * (PROCESSES - 1))]
    print(f"\nstart-up storm: {PROCESSES} processes, {len(failed)} failed, 0 stuck; start-up p50 {1000 * p50:.0f} ms, "
          f"p99 {1000 * p99:.0f} ms, max {1000 * times[-1]:.0f} ms")
    figures.record("start-up storm", failed=len(failed), p50_ms=round(1000 * p50), p99_ms=round(1000 * p99),
                   max_ms=round(1000 * times[-1]))
    assert not failed, failed[:5]
