"""Bypass routes (issue 7, docs/threat-model.md): a tenant tries to raise its own limit from inside its process;
each test fails if the route works. (The dlsym / RTLD_NEXT / cuGetProcAddress / _ptsz routes are covered by
tests/shim/routes_test.cc.)

Run by the reliability suite (tests/reliability/conftest.py): fixtures fake_gpu, figures."""

from __future__ import annotations

import pytest

RAISE_THEN_ALLOCATE = """
import json, os
os.environ["CUDA_DEVICE_MEMORY_LIMIT"] = "70Gi"     # after start, before the first CUDA call
os.environ.pop("CUDA_DEVICE_MEMORY_SHARED_CACHE", None)
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
err, ptr = cu.cuMemAlloc(2 * 1024 ** 3)
_, free, total = cu.cuMemGetInfo()
print(json.dumps({"alloc": int(err), "total": int(total)}))
"""


def contain(fake_gpu, memory_limit: str) -> None:
    """The processes started next run under the shim, one container with this memory limit (skips without a shim)."""
    shim = fake_gpu.library_dir / "libvgpu.so"
    if not shim.exists():
        pytest.skip(f"{shim} is not built")
    fake_gpu.env.update({"LD_PRELOAD": str(shim), "CUDA_DEVICE_MEMORY_LIMIT": memory_limit,
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "box.region")})


def test_resetting_the_environment_after_start_does_not_raise_the_limit(fake_gpu, figures):
    """Regression: the shim read its configuration at the first CUDA call, so a program that set
    CUDA_DEVICE_MEMORY_LIMIT=70Gi in its own environment before cuInit got 70 GiB under a 1 GiB limit. The
    configuration is now read when the process starts, before the program's code runs."""
    contain(fake_gpu, memory_limit="1Gi")
    result = fake_gpu.run_py(RAISE_THEN_ALLOCATE).json
    assert result["total"] == 1024 ** 3, result
    figures.record("bypass", environment_reset="held" if result["alloc"] == 2 else "RAISED")
    assert result["alloc"] == 2, f"CUDA_ERROR_OUT_OF_MEMORY expected, got {result['alloc']}"


ALLOCATE_REWRITE_ALLOCATE = """
import json, mmap, os, struct
from cuda.bindings import driver as cu
GIB = 1024 ** 3
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
first, _ = cu.cuMemAlloc(GIB)
_, free, total = cu.cuMemGetInfo()
used = int(total) - int(free)
# A hostile process of the container zeroes every figure of its usage in the region file (its own slot and the
# container's total: the only 8-byte words that hold exactly `used`).
zeroed = 0
with open(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"], "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
    for offset in range(0, len(m) - 7, 8):
        if struct.unpack_from("<Q", m, offset)[0] == used:
            struct.pack_into("<Q", m, offset, 0)
            zeroed += 1
    m.close()
second, _ = cu.cuMemAlloc(GIB)
_, free_after, _ = cu.cuMemGetInfo()
print(json.dumps({"first": int(first), "used": used, "zeroed": zeroed, "second": int(second),
                  "used_after": int(total) - int(free_after)}))
"""


def test_writing_the_region_file_does_not_raise_the_limit(fake_gpu, figures):
    """A process that zeroes its usage in the region file (which every process of the container can write) and
    allocates again stays under its limit: the shim keeps its own count and puts the file's figures back.
    (Two processes colluding still can, for a moment: tests/region RegionTamper, docs/threat-model.md.)"""
    contain(fake_gpu, memory_limit="2Gi")
    result = fake_gpu.run_py(ALLOCATE_REWRITE_ALLOCATE).json
    assert result["first"] == 0, result
    assert result["zeroed"] >= 2, f"the route was not tried: the file held its usage {result['zeroed']} times"
    figures.record("bypass", region_rewrite="held" if result["second"] == 2 else "RAISED",
                   region_words_zeroed=result["zeroed"])
    assert result["second"] == 2, f"CUDA_ERROR_OUT_OF_MEMORY expected after the rewrite: {result}"
    assert result["used_after"] == result["used"], f"the shim's view did not come back: {result}"
