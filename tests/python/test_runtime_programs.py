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

from fakegpu_harness import rate_ratio

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"
PROGRAMS = ("basics", "fill", "burn", "hami")
RUNTIMES = ("static", "shared")
# Other ways nvcc can build `basics`: PTX only (zstd-compressed in the fatbin, inflated by libzstd at load), and a
# cubin for sm_80 only (an A100 runs it, an H100 does not).
VARIANTS = {"ptx": ["-gencode", "arch=compute_90,code=compute_90"], "sm80": ["-gencode", "arch=compute_80,code=sm_80"]}
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
    builds = [(name, runtime, ["-arch=sm_90", f"-cudart={runtime}"]) for runtime in RUNTIMES for name in PROGRAMS]
    builds += [("basics", variant, flags) for variant, flags in VARIANTS.items()]
    built = {}
    for name, variant, flags in builds:
        target = out / f"{name}-{variant}"
        command = [nvcc, "-O2", *flags, "-I", str(RUNTIME_DIR), "-o", str(target), str(RUNTIME_DIR / f"{name}.cu")]
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr}"
        built[(name, variant)] = target
    return built


@pytest.fixture(params=RUNTIMES)
def runtime(request) -> str:
    return request.param



def test_a_runtime_program_runs_its_everyday_calls_on_fakecuda(fake_gpu, programs, runtime):
    seen = fake_gpu.run(programs[("basics", runtime)]).json
    print(f"\n{runtime} runtime: {seen}")
    assert seen["devices"] == 1 and seen["sm"] == 90 and seen["name"] == "NVIDIA H100 80GB HBM3"
    assert seen["contents_kept"], "a device-to-device copy and the copy back kept the bytes"
    assert seen["graph_nodes"] == 4, "four captured launches make four graph nodes"
    assert seen["free_mib"] - seen["free_after_alloc_mib"] >= 8, "two 4 MiB allocations show in cudaMemGetInfo"
    assert seen["kernel_ms"] > 0, "events around a launch measure its modelled run time"
    assert seen["variables_ok"], "__device__ initial values read back; a __constant__ written and read back"


def test_a_runtime_program_sees_its_slice_under_the_shim(fake_gpu, programs, runtime, shim_path):
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
    seen = fake_gpu.run(programs[("basics", runtime)]).json
    assert seen["total_mib"] == 4096, seen
    assert seen["free_mib"] == 4096 - CONTEXT_MIB, seen
    assert seen["contents_kept"] and seen["graph_nodes"] == 4, seen


@pytest.mark.parametrize("kind", ["device", "managed", "pooled"])
def test_a_runtime_program_is_held_to_its_memory_limit(fake_gpu, programs, runtime, shim_path, kind):
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
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
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_SM_LIMIT="30", GPU_CORE_UTILIZATION_POLICY="force")
    capped = fake_gpu.run(programs[("burn", runtime)], "3", "4").json
    free_rate, ratio = rate_ratio(free, capped)
    print(f"\n{runtime} runtime: {free_rate:.0f} kernels/s free, {ratio:.3f} of that at a 30 % cap")
    assert free_rate > 700, f"1 ms kernels back to back ran at {free_rate:.0f}/s"
    assert 0.20 <= ratio <= 0.36, f"at a 30 % cap the program ran {ratio:.3f} of its free rate"


def test_a_ptx_only_program_runs_from_its_compressed_ptx(fake_gpu, programs):
    seen = fake_gpu.run(programs[("basics", "ptx")]).json
    assert seen["contents_kept"] and seen["graph_nodes"] == 4 and seen["variables_ok"], seen


def test_a_cubin_runs_only_on_its_architecture_as_on_the_real_driver(fake_gpu, programs):
    refused = fake_gpu.run(programs[("basics", "sm80")], check=False)
    assert refused.returncode == 1, refused.describe()
    assert "cudaErrorNoKernelImageForDevice" in refused.stderr, refused.describe()


def test_an_sm80_cubin_runs_on_an_a100(fake_gpu, programs):
    fake_gpu.env["FAKECUDA_DEVICES"] = "a100-40gb"
    seen = fake_gpu.run(programs[("basics", "sm80")]).json
    assert seen["sm"] == 80 and seen["name"] == "NVIDIA A100-SXM4-40GB", seen


@pytest.mark.parametrize("shimmed", [False, True], ids=["alone", "under-the-shim"])
@pytest.mark.parametrize("kind", ["device", "managed", "host", "hostalloc", "register"])
def test_hami_cores_allocation_scenarios(fake_gpu, programs, shim_path, kind, shimmed):
    """HAMi-core's test_runtime_alloc*.c: 84 sizes around powers of two; device memory shows, host memory does not."""
    if shimmed:
        fake_gpu.use_shim(shim_path, CUDA_DEVICE_MEMORY_LIMIT="2g")
    seen = fake_gpu.run(programs[("hami", "static")], "alloc", kind).json
    assert seen == {"kind": kind, "checked": 84, "failure": ""}


@pytest.mark.parametrize("shimmed", [False, True], ids=["alone", "under-the-shim"])
def test_hami_cores_launch_scenario(fake_gpu, programs, shim_path, shimmed):
    """HAMi-core's test_runtime_launch.cu: a 1024-thread kernel, then 100 synchronized launches over 2^27 doubles."""
    if shimmed:
        fake_gpu.use_shim(shim_path, CUDA_DEVICE_MEMORY_LIMIT="2g", CUDA_DEVICE_SM_LIMIT="50")
    assert fake_gpu.run(programs[("hami", "shared")], "launch").json == {"launches": 101}
