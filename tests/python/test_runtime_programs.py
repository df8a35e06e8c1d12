"""nvcc-built programs (the CUDA runtime, libcudart) on fakecuda, with and without the shim (issue 23, stage 1).

The programs are tests/runtime/*.cu, built here by nvcc twice: with the static runtime (nvcc's default) and with the
shared one (`-cudart shared`, libcudart.so from the toolkit). Skipped, naming what is missing, where nvcc is not.
fakecuda answers the runtime's export tables and loads the kernels from the fatbin nvcc embeds
(docs/fakecuda-runtime.md); kernels do not compute, memory contents stay real.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"
PROGRAMS = ("basics", "fill", "burn")
RUNTIMES = ("static", "shared")
CONTEXT_MIB = 518  # the h100-80gb preset's context (fakecuda/model), charged to the container under the shim


def find_nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin/nvcc")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="session")
def programs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(program, runtime) -> the built program; the whole set is skipped without nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not on PATH nor in $CUDA_HOME/bin (default /usr/local/cuda): the CUDA toolkit builds "
                    "the runtime test programs")
    out = tmp_path_factory.mktemp("runtime-programs")
    built = {}
    for runtime in RUNTIMES:
        for name in PROGRAMS:
            target = out / f"{name}-{runtime}"
            command = [nvcc, "-O2", "-arch=sm_90", f"-cudart={runtime}", "-I", str(RUNTIME_DIR), "-o", str(target),
                       str(RUNTIME_DIR / f"{name}.cu")]
            result = subprocess.run(command, capture_output=True, text=True)
            assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr}"
            built[(name, runtime)] = target
    return built


@pytest.fixture(params=RUNTIMES)
def runtime(request) -> str:
    return request.param


def with_shim(fake_gpu, shim_path: Path, **limits: str) -> None:
    fake_gpu.env["LD_PRELOAD"] = str(shim_path)
    fake_gpu.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(fake_gpu.work_dir / "region")
    fake_gpu.env.update(limits)


def test_a_runtime_program_runs_its_everyday_calls_on_fakecuda(fake_gpu, programs, runtime):
    seen = fake_gpu.run(programs[("basics", runtime)]).json
    print(f"\n{runtime} runtime: {seen}")
    assert seen["devices"] == 1 and seen["sm"] == 90 and seen["name"] == "NVIDIA H100 80GB HBM3"
    assert seen["contents_kept"], "a device-to-device copy and the copy back kept the bytes"
    assert seen["graph_nodes"] == 4, "four captured launches make four graph nodes"
    assert seen["free_mib"] - seen["free_after_alloc_mib"] >= 8, "two 4 MiB allocations show in cudaMemGetInfo"
    assert seen["kernel_ms"] > 0, "events around a launch measure its modelled run time"


def test_a_runtime_program_sees_its_slice_under_the_shim(fake_gpu, programs, runtime, shim_path):
    with_shim(fake_gpu, shim_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
    seen = fake_gpu.run(programs[("basics", runtime)]).json
    assert seen["total_mib"] == 4096, seen
    assert seen["free_mib"] == 4096 - CONTEXT_MIB, seen
    assert seen["contents_kept"] and seen["graph_nodes"] == 4, seen


@pytest.mark.parametrize("kind", ["device", "managed", "pooled"])
def test_a_runtime_program_is_held_to_its_memory_limit(fake_gpu, programs, runtime, shim_path, kind):
    with_shim(fake_gpu, shim_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
    seen = fake_gpu.run(programs[("fill", runtime)], kind, "256").json
    print(f"\n{runtime} runtime, {kind}: {seen}")
    assert seen["stopped_by"] == "cudaErrorMemoryAllocation", seen
    # The context's 518 MiB and as many 256 MiB chunks as fit beside it: 13 (3,328 MiB), not a 14th.
    assert seen["allocated_mib"] == (4096 - CONTEXT_MIB) // 256 * 256, seen


def test_without_the_shim_a_runtime_program_gets_the_whole_device(fake_gpu, programs):
    seen = fake_gpu.run(programs[("fill", "static")], "device", "4096").json
    assert seen["stopped_by"] == "cudaErrorMemoryAllocation", seen
    assert seen["allocated_mib"] >= 72 * 1024, seen


def test_a_runtime_program_is_held_to_its_compute_cap(fake_gpu, programs, runtime, shim_path):
    fake_gpu.env["FAKECUDA_KERNEL_COSTS"] = "burn=1000000"  # 1 ms a launch
    free = fake_gpu.run(programs[("burn", runtime)], "2", "4").json
    with_shim(fake_gpu, shim_path, CUDA_DEVICE_SM_LIMIT="30", GPU_CORE_UTILIZATION_POLICY="force")
    capped = fake_gpu.run(programs[("burn", runtime)], "3", "4").json
    free_rate = free["kernels"] / free["seconds"]
    ratio = capped["kernels"] / capped["seconds"] / free_rate
    print(f"\n{runtime} runtime: {free_rate:.0f} kernels/s free, {ratio:.3f} of that at a 30 % cap")
    assert free_rate > 700, f"1 ms kernels back to back ran at {free_rate:.0f}/s"
    assert 0.20 <= ratio <= 0.36, f"at a 30 % cap the program ran {ratio:.3f} of its free rate"
