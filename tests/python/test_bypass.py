"""Bypass routes (issue 7, docs/threat-model.md): a tenant tries to raise its own limit from inside its process;
each test fails if the route works. (The dlsym / RTLD_NEXT / cuGetProcAddress / _ptsz routes are covered by
tests/shim/routes_test.cc.)"""

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


def test_resetting_the_environment_after_start_does_not_raise_the_limit(fake_gpu):
    """Regression: the shim read its configuration at the first CUDA call, so a program that set
    CUDA_DEVICE_MEMORY_LIMIT=70Gi in its own environment before cuInit got 70 GiB under a 1 GiB limit. The
    configuration is now read when the process starts, before the program's code runs."""
    shim = fake_gpu.library_dir / "libvgpu.so"
    if not shim.exists():
        pytest.skip(f"{shim} is not built")
    fake_gpu.env.update({"LD_PRELOAD": str(shim), "CUDA_DEVICE_MEMORY_LIMIT": "1Gi",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "box.region")})
    result = fake_gpu.run_py(RAISE_THEN_ALLOCATE).json
    assert result["total"] == 1024 ** 3, result
    assert result["alloc"] == 2, f"CUDA_ERROR_OUT_OF_MEMORY expected, got {result['alloc']}"
