"""The cache file as HAMi's vGPU monitor reads it (issue 21, docs/hami-cache.md): a live container's
CUDA_DEVICE_MEMORY_SHARED_CACHE file read by a reader written from HAMi's v1 offsets (../shared/HAMI-CONTRACT.md,
HAMi's pkg/monitor/nvidia/v1/spec.go), not from our headers: what HAMi's monitor would report for the container must
match what the shim counts and what the process holds."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import pytest

from vgpu_fixtures import requires_native, vgpu

GIB = 1 << 30
MIB = 1 << 20

# HAMi-core's shared_region_t v1, little endian (HAMI-CONTRACT.md).
MAGIC = 19920718
V1_BYTES = 2_008_952
OFF_NUM, OFF_UUIDS, OFF_LIMIT, OFF_SM_LIMIT, OFF_PROCS = 56, 64, 1600, 1728, 1856
OFF_PROCNUM, OFF_RECENT_KERNEL, OFF_PRIORITY, OFF_LAST_KERNEL_TIME = 2_008_896, 2_008_904, 2_008_908, 2_008_912
PROC_BYTES, PROC_USED, USED_BYTES, PROC_STATUS = 1960, 8, 64, 1928
USED_CONTEXT, USED_MODULE, USED_DATA, USED_TOTAL = 0, 8, 16, 32


@dataclass
class HamiView:
    """What HAMi's monitor exports for one device of a container."""
    uuid: str
    memory_bytes: int
    limit_bytes: int
    sm_limit: int
    pids: list[int]


def read_as_hami_monitor(path) -> list[HamiView]:
    """HAMi's monitor's reading: the magic and major version, then per device i < num the UUID (first 40 bytes of its
    row), the limit, and the sum of used[i].total over the slots 0 .. procnum-1 whose status is not 0."""
    data = path.read_bytes()
    magic, major = struct.unpack_from("<iI", data, 0)
    assert magic == MAGIC, f"cache file magic flag not matched: {magic}"
    assert major == 1 and len(data) >= V1_BYTES, f"unknown cache file size {len(data)} (major {major})"
    (num,) = struct.unpack_from("<Q", data, OFF_NUM)
    (procnum,) = struct.unpack_from("<i", data, OFF_PROCNUM)
    views = []
    for i in range(num):
        row = data[OFF_UUIDS + 96 * i: OFF_UUIDS + 96 * i + 40]
        (limit,) = struct.unpack_from("<Q", data, OFF_LIMIT + 8 * i)
        (sm_limit,) = struct.unpack_from("<Q", data, OFF_SM_LIMIT + 8 * i)
        total, pids = 0, []
        for s in range(procnum):
            slot = OFF_PROCS + PROC_BYTES * s
            (status,) = struct.unpack_from("<i", data, slot + PROC_STATUS)
            if status == 0:
                continue
            (pid,) = struct.unpack_from("<i", data, slot)
            (used,) = struct.unpack_from("<Q", data, slot + PROC_USED + USED_BYTES * i + USED_TOTAL)
            total += used
            pids.append(pid)
        views.append(HamiView(row.decode("ascii", "replace"), total, limit, sm_limit, pids))
    return views


@pytest.fixture
def container(fake_gpu, shim_path):
    """The next processes of `fake_gpu` are one container under the shim: 4 GiB of memory, 40 % of the GPU, HAMi's
    high priority (0)."""
    cache = fake_gpu.work_dir / "container.cache"
    fake_gpu.env.update({"LD_PRELOAD": str(shim_path), "CUDA_DEVICE_MEMORY_LIMIT": "4096m",
                         "CUDA_DEVICE_SM_LIMIT": "40", "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CUDA_TASK_PRIORITY": "0",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(cache)})
    return cache


@requires_native
def test_hamis_monitor_reads_a_live_containers_memory_limit_uuid_and_processes(fake_gpu, container):
    holders = [fake_gpu.start_py("hold_memory.py", str(size)) for size in (GIB, 256 * MIB)]
    held = [holder.next_json(timeout=60) for holder in holders]
    views = read_as_hami_monitor(container)
    assert len(views) == 1, views
    view = views[0]
    assert view.uuid.startswith("GPU-") and len(view.uuid) == 40 and view.uuid[12] == "-", view.uuid
    assert view.limit_bytes == 4 * GIB
    assert view.sm_limit == 40
    assert struct.unpack_from("<i", container.read_bytes(), OFF_PRIORITY)[0] == 0, "CUDA_TASK_PRIORITY"
    assert sorted(view.pids) == sorted(h["pid"] for h in held), "a container pid namespace is the host's here"
    # What the shim counts (its region, read by our own reader): the allocations and each process's context.
    region = vgpu.scenario.read_region(container)
    assert view.uuid == region["devices"][0]["uuid"]
    assert view.memory_bytes == region["devices"][0]["used_bytes"], (view.memory_bytes, region["devices"])
    assert GIB + 256 * MIB <= view.memory_bytes <= GIB + 256 * MIB + 2 * GIB, view.memory_bytes
    assert held[0]["total"] == 4 * GIB, "the shim's view of the device: the limit"
    for holder in holders:
        assert holder.finish(timeout=30).returncode == 0
    after = read_as_hami_monitor(container)[0]
    assert after.memory_bytes == 0 and after.pids == [], after


def test_a_launching_container_reads_as_active_and_a_block_written_by_hamis_monitor_is_kept(fake_gpu, container,
                                                                                          tenant_available):
    """recent_kernel: the shim sets 2 while the container launches (HAMi's monitor decrements it every 5 s and counts
    the container active while above 0), and last_kernel_time to the launch's unix second; a -1 the monitor wrote (a
    higher-priority container is active) is never overwritten."""
    started = int(time.time())
    result = fake_gpu.tenant("--kernel-us", "1000", "--seconds", "1", timeout=60)
    assert result.returncode == 0, result.describe()
    data = container.read_bytes()
    (recent,) = struct.unpack_from("<i", data, OFF_RECENT_KERNEL)
    (last,) = struct.unpack_from("<q", data, OFF_LAST_KERNEL_TIME)
    assert recent == 2
    assert started - 1 <= last <= int(time.time()) + 1, (started, last)
    with open(container, "r+b") as f:  # as HAMi's monitor does: the whole file mapped, one word written
        f.seek(OFF_RECENT_KERNEL)
        f.write(struct.pack("<i", -1))
    result = fake_gpu.tenant("--kernel-us", "1000", "--seconds", "1", timeout=60)
    assert result.returncode == 0, result.describe()
    (recent,) = struct.unpack_from("<i", container.read_bytes(), OFF_RECENT_KERNEL)
    assert recent == -1, "the shim overwrote the block HAMi's monitor wrote"
