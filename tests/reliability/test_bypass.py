"""Bypass routes (issue 7, docs/threat-model.md): a tenant tries to raise its own limit from inside its process;
each test fails if the route works. (The dlsym / RTLD_NEXT / cuGetProcAddress / _ptsz routes are covered by
tests/shim/routes_test.cc.)

Run by the reliability suite (tests/reliability/conftest.py): fixtures fake_gpu, figures."""

from __future__ import annotations

import signal
import time

import pytest
from fakegpu_harness import read_trace

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
import json
from clientlib import zero_region_words
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
zeroed = zero_region_words({used})
second, _ = cu.cuMemAlloc(GIB)
_, free_after, _ = cu.cuMemGetInfo()
print(json.dumps({"first": int(first), "used": used, "zeroed": zeroed, "second": int(second),
                  "used_after": int(total) - int(free_after)}))
"""


def test_writing_the_region_file_does_not_raise_the_limit(fake_gpu, figures):
    """A process that zeroes its usage in the region file (which every process of the container can write) and
    allocates again stays under its limit: the shim keeps its own count and puts the file's figures back. (Two
    processes colluding are held by the node monitor: test_two_colluding_processes_do_not_raise_the_limit.)"""
    contain(fake_gpu, memory_limit="2Gi")
    result = fake_gpu.run_py(ALLOCATE_REWRITE_ALLOCATE).json
    assert result["first"] == 0, result
    assert result["zeroed"] >= 2, f"the route was not tried: the file held its usage {result['zeroed']} times"
    figures.record("bypass", region_rewrite="held" if result["second"] == 2 else "RAISED",
                   region_words_zeroed=result["zeroed"])
    assert result["second"] == 2, f"CUDA_ERROR_OUT_OF_MEMORY expected after the rewrite: {result}"
    assert result["used_after"] == result["used"], f"the shim's view did not come back: {result}"


# ---- routes only the node sees (docs/node-monitor.md) -------------------------------------------------------------

HOLD = """
import json, sys
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
err, ptr = cu.cuMemAlloc(int(sys.argv[1]))
_, free, total = cu.cuMemGetInfo()
print(json.dumps({"alloc": int(err), "used": int(total) - int(free)}), flush=True)
sys.stdin.readline()  # quiet (no CUDA call) until told to end
"""

# The second of two colluding processes: zeroes the first one's figures in the region (its slot and the container's
# total), allocates what the region then lets through, and keeps asking for 1 MiB more, timing the first refusal.
COLLUDE = """
import json, sys, time
from clientlib import zero_region_words
from cuda.bindings import driver as cu
first_used = int(sys.argv[1])
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
_, free, total = cu.cuMemGetInfo()
container_used = int(total) - int(free)
zeroed = zero_region_words({first_used, container_used})
second, _ = cu.cuMemAlloc(int(sys.argv[2]))
start = time.monotonic()
refused_after = None
while time.monotonic() - start < 5:
    err, p = cu.cuMemAlloc(1 << 20)
    if err != cu.CUresult.CUDA_SUCCESS:
        refused_after = time.monotonic() - start
        break
    cu.cuMemFree(p)
    time.sleep(0.005)
print(json.dumps({"zeroed": zeroed, "second": int(second), "refused_after": refused_after}))
"""

GIB = 1024 ** 3


def test_two_colluding_processes_do_not_raise_the_limit(fake_gpu, node_monitor, figures):
    """Two processes of one container: the second zeroes the first's figures in the region and allocates what the
    region then lets through, past the container's limit (the region alone cannot hold this: tests/region
    RegionTamper.KnownGapTwoProcessesCannotPassTheLimitTogetherByRewritingTheFile). The node monitor sees the
    driver's figures; once they show the container over, no allocation through the hooks succeeds. Fails if the
    colluders can still allocate a second after going over."""
    contain(fake_gpu, memory_limit="4Gi")
    node_monitor.contain(memory_limit="4Gi")
    node_monitor.start(action="report", period_ms=50)
    first = fake_gpu.start_py(HOLD, str(2 * GIB))
    held = first.next_json(timeout=30)
    assert held["alloc"] == 0, held
    result = fake_gpu.run_py(COLLUDE, str(held["used"]), str(2 * GIB)).json
    first.finish(timeout=30)
    assert result["zeroed"] >= 2, f"the route was not tried: {result}"
    # The route works at the hooks: the region let the second 2 GiB through, past the 4 GiB limit.
    assert result["second"] == 0, f"the region refused the colluders' allocation: the test tried nothing: {result}"
    figures.record("bypass", collusion="held" if result["refused_after"] is not None else "RAISED",
                   collusion_refused_after_ms=None if result["refused_after"] is None
                   else round(result["refused_after"] * 1000))
    assert result["refused_after"] is not None, f"the colluders kept allocating for 5 s: {result}"
    # One period to see it (50 ms), the shim's 10 ms cache, and slack for a loaded machine.
    assert result["refused_after"] < 1.0, result
    assert "over its memory limit" in node_monitor.log()


PRIVATE_ALLOCATE = """
import ctypes, json, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
table = ctypes.c_void_p()
found = cuda.cuGetExportTable(ctypes.byref(table), ctypes.create_string_buffer(b"fakecuda-private", 16))
class Table(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]
alloc = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)(
    Table.from_address(table.value).alloc)
pointer = ctypes.c_uint64()
private = alloc(ctypes.byref(pointer), int(sys.argv[1]))
print(json.dumps({"table": found, "private": private}), flush=True)
start = time.monotonic()
refused_after = None
while time.monotonic() - start < 5:
    if cuda.cuMemAlloc_v2(ctypes.byref(pointer), 1 << 20) != 0:
        refused_after = time.monotonic() - start
        break
    cuda.cuMemFree_v2(pointer)
    time.sleep(0.005)
print(json.dumps({"refused_after": refused_after}), flush=True)
time.sleep(float(sys.argv[2]))
print(json.dumps({"survived": True}), flush=True)
"""


def test_memory_taken_through_a_private_export_table_does_not_raise_the_limit(fake_gpu, node_monitor, figures):
    """A process allocates 3 GiB under a 1 GiB limit through a private export table (cuGetExportTable: the route
    the CUDA runtime takes, which no hook sees; fakecuda's stands in for the driver's). With --action kill the node
    monitor ends it within about two periods; before that, nothing more is allocated through the hooks. Fails if
    the process keeps its 3 GiB for 2 s."""
    contain(fake_gpu, memory_limit="1Gi")
    node_monitor.contain(memory_limit="1Gi")
    node_monitor.start(action="kill", period_ms=50)
    client = fake_gpu.start_py(PRIVATE_ALLOCATE, str(3 * GIB), "2")
    took = client.next_json(timeout=30)
    allocated_at = time.monotonic()
    assert took == {"table": 0, "private": 0}, f"the route was not tried (fakecuda's private table): {took}"
    result = client.finish(timeout=30)
    held_for = time.monotonic() - allocated_at
    figures.record("bypass", export_table="held" if result.returncode == -signal.SIGKILL else "RAISED",
                   export_table_held_ms=round(held_for * 1000))
    assert '"survived"' not in result.stdout, f"the process kept 3 GiB under a 1 GiB limit: {result.describe()}"
    assert result.returncode == -signal.SIGKILL, result.describe()
    assert held_for < 1.5, f"killed only after {held_for:.2f} s"
    assert "killed process" in node_monitor.log()


def test_with_report_only_a_private_allocation_stops_every_hooked_one(fake_gpu, node_monitor):
    """--action report kills nothing, but once the driver shows the container over, its hooked allocations fail."""
    contain(fake_gpu, memory_limit="1Gi")
    node_monitor.contain(memory_limit="1Gi")
    node_monitor.start(action="report", period_ms=50)
    client = fake_gpu.start_py(PRIVATE_ALLOCATE, str(3 * GIB), "0")
    assert client.next_json(timeout=30) == {"table": 0, "private": 0}
    refused = client.next_json(timeout=30)
    result = client.finish(timeout=30)
    assert result.returncode == 0, result.describe()
    assert refused["refused_after"] is not None and refused["refused_after"] < 1.0, refused


def busy_share(events: list[dict], pids: list[int], from_ns: int, to_ns: int) -> float:
    """The fraction of [from_ns, to_ns) in which the device ran a kernel of one of `pids` (by the trace)."""
    spans = [(max(int(e["start_ns"]), from_ns), min(int(e["end_ns"]), to_ns)) for e in events
             if e.get("ev") == "kernel" and e.get("pid") in pids and int(e["end_ns"]) > from_ns
             and int(e["start_ns"]) < to_ns]
    spans.sort()
    busy, end = 0, from_ns
    for start, stop in spans:
        start = max(start, end)
        if stop > start:
            busy += stop - start
            end = stop
    return busy / (to_ns - from_ns)


def test_processes_that_rewrite_the_compute_budget_together_are_held_to_the_share(fake_gpu, node_monitor, figures,
                                                                                    shim_path):
    """Two processes of a container capped at 30 %, and a third that keeps the region's budget cell full at a
    lending rate: each process is still held to 30 % by its own count, so together they take ~60 %. The node
    monitor's verdict shows the container's NVML use; each process scales its own rate by limit / use, and the
    container is held to its share. Fails if the two take more than 36 % over the run's last 4 s."""
    trace = fake_gpu.enable_trace()
    fake_gpu.env.update({"LD_PRELOAD": str(shim_path), "CUDA_DEVICE_SM_LIMIT": "30",
                         "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "box.region")})
    node_monitor.contain(memory_limit="0", sm_limit=30)
    node_monitor.start(action="report", period_ms=50)
    tenants = [fake_gpu.start_tenant("--seconds", "9", "--kernel-us", "1000") for _ in range(2)]
    writer = fake_gpu.start_py("cell_writer.py", "300", "9")
    found = writer.next_json(timeout=30)
    assert found["cell"] is not None, "the budget cell was not found: the route was not tried"
    for tenant in tenants:
        result = tenant.finish(timeout=60)
        assert result.returncode == 0, result.describe()
    writer.finish(timeout=30)
    events = read_trace(trace)
    pids = [tenant.pid for tenant in tenants]
    kernels = [e for e in events if e.get("ev") == "kernel" and e.get("pid") in pids]
    end = max(int(e["end_ns"]) for e in kernels)
    start = min(int(e["start_ns"]) for e in kernels)
    first = busy_share(events, pids, start, start + 1_000_000_000)
    last = busy_share(events, pids, end - 4_000_000_000, end)
    figures.record("bypass", compute_collusion="held" if last <= 0.36 else "RAISED",
                   compute_collusion_first_s=round(100 * first, 1), compute_collusion_last_4s=round(100 * last, 1))
    assert last <= 0.36, (f"two colluders took {100 * last:.1f} % of the device over the last 4 s under a 30 % cap "
                          f"(first second: {100 * first:.1f} %); monitor log: {node_monitor.log()}")
    assert last >= 0.20, f"held far under the cap: {100 * last:.1f} %"
