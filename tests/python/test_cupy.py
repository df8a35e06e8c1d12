"""CuPy on fakecuda, with and without the shim (issue 23, stage 2; docs/fakecuda-runtime.md).

CuPy is a runtime program: its arrays live in its memory pool, its elementwise and reduction kernels are compiled at
run time by NVRTC and loaded as cubins, its matmul is cuBLAS's. Each test runs CuPy in a process of its own on a fake
machine of its own. Kernels do not compute on fakecuda, so the tests check what a platform engineer relies on: the
calls succeed, copies keep their bytes, and the shim's limits hold. Skipped, naming what is missing, without CuPy or
without the CUDA toolkit's NVRTC.
"""

from __future__ import annotations

import ctypes.util
import glob
import os

import pytest

from fakegpu_harness import rate_ratio

pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x, tests/python/requirements.txt)")

CONTEXT_MIB = 518  # the h100-80gb preset's context, charged to the container under the shim


@pytest.fixture(autouse=True)
def toolkit_libraries(fake_gpu):
    """CuPy finds NVRTC and cuBLAS through the CUDA toolkit; skip where there is none."""
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not glob.glob(f"{cuda_home}/lib*/libnvrtc.so*") and ctypes.util.find_library("nvrtc") is None:
        pytest.skip(f"no libnvrtc in {cuda_home}/lib64 nor on the loader's path: CuPy compiles its kernels with it")
    fake_gpu.env.setdefault("CUDA_HOME", cuda_home)



EVERYDAY = """
import json, numpy as np, cupy as cp
host = np.arange(1 << 20, dtype=np.float32)
a = cp.asarray(host)                                   # a copy in
kept = bool((a.get() == host).all())                   # and back out: the bytes are real
b = a * 2 + 1                                          # an elementwise kernel, NVRTC-compiled
s = b.sum()                                            # a reduction
r = cp.RawKernel(r'extern "C" __global__ void twice(float* x, int n) {'
                 r' int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2; }', "twice")
r(((1 << 20) // 256,), (256,), (a, cp.int32(1 << 20)))
m = cp.ones((256, 256), dtype=cp.float32) @ cp.ones((256, 256), dtype=cp.float32)   # cuBLAS
cp.cuda.Device().synchronize()
free, total = cp.cuda.runtime.memGetInfo()
print(json.dumps({"kept": kept, "shape": list(b.shape), "sum_shape": list(s.shape), "matmul": list(m.shape),
                  "free_mib": free >> 20, "total_mib": total >> 20,
                  "pool_mib": cp.get_default_memory_pool().total_bytes() >> 20}))
"""


def test_cupy_runs_arrays_kernels_and_a_matmul_on_fakecuda(fake_gpu):
    seen = fake_gpu.run_py(EVERYDAY, timeout=120).json
    print(f"\n{seen}")
    assert seen["kept"], "a host-to-device copy and its copy back kept the bytes"
    assert seen["shape"] == [1 << 20] and seen["sum_shape"] == [] and seen["matmul"] == [256, 256], seen
    assert seen["total_mib"] == 81079 and seen["pool_mib"] >= 8, seen


def test_cupy_sees_its_slice_under_the_shim(fake_gpu, shim_path):
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
    seen = fake_gpu.run_py(EVERYDAY, timeout=120).json
    assert seen["total_mib"] == 4096, seen
    assert seen["free_mib"] <= 4096 - CONTEXT_MIB - seen["pool_mib"], seen
    assert seen["kept"], seen


POOL_TO_OOM = """
import json, cupy as cp
pool = cp.get_default_memory_pool()
held, error = [], None
try:
    while True:
        held.append(cp.empty(256 << 20, dtype=cp.uint8))
except cp.cuda.memory.OutOfMemoryError as e:
    error = type(e).__name__
full_free, _ = cp.cuda.runtime.memGetInfo()
count = len(held)
del held
pool.free_all_blocks()                                  # the pool gives its blocks back to the driver
free, total = cp.cuda.runtime.memGetInfo()
print(json.dumps({"held_mib": count * 256, "error": error, "full_free_mib": full_free >> 20,
                  "free_after_release_mib": free >> 20, "total_mib": total >> 20}))
"""


def test_cupys_memory_pool_is_held_to_the_memory_limit(fake_gpu, shim_path):
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
    seen = fake_gpu.run_py(POOL_TO_OOM, timeout=120).json
    print(f"\n{seen}")
    assert seen["error"] == "OutOfMemoryError", seen
    # The context's 518 MiB and as many 256 MiB blocks as fit beside it: 13, not a 14th.
    assert seen["held_mib"] == (4096 - CONTEXT_MIB) // 256 * 256, seen
    assert seen["full_free_mib"] < 256, seen
    assert seen["free_after_release_mib"] >= 4096 - CONTEXT_MIB - 16, "the released pool is free again"


BURN = """
import json, sys, time, cupy as cp
k = cp.RawKernel(r'extern "C" __global__ void burn(float* x) { x[threadIdx.x] += 1.0f; }', "burn")
x = cp.zeros(32, dtype=cp.float32)
k((1,), (32,), (x,)); cp.cuda.Device().synchronize()   # compiled and loaded before the clock starts
seconds, launched, start = float(sys.argv[1]), 0, time.monotonic()
while time.monotonic() - start < seconds:
    for _ in range(4):
        k((1,), (32,), (x,))
    cp.cuda.Device().synchronize()
    launched += 4
print(json.dumps({"kernels": launched, "seconds": time.monotonic() - start}))
"""


def test_cupys_kernels_are_held_to_the_compute_cap(fake_gpu, shim_path):
    fake_gpu.env["FAKECUDA_KERNEL_COSTS"] = "burn=1000000"  # 1 ms a launch
    free = fake_gpu.run_py(BURN, "2", timeout=120).json
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_SM_LIMIT="30", GPU_CORE_UTILIZATION_POLICY="force")
    capped = fake_gpu.run_py(BURN, "3", timeout=120).json
    free_rate, ratio = rate_ratio(free, capped)
    print(f"\nCuPy: {free_rate:.0f} kernels/s free, {ratio:.3f} of that at a 30 % cap")
    assert free_rate > 600, f"1 ms kernels in groups of four ran at {free_rate:.0f}/s"
    assert 0.20 <= ratio <= 0.36, f"at a 30 % cap CuPy ran {ratio:.3f} of its free rate"
