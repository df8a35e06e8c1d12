"""The cache file as HAMi's vGPU monitor reads it (issue 21, docs/hami-cache.md): a live container's
CUDA_DEVICE_MEMORY_SHARED_CACHE file read by a reader written from HAMi's v1 offsets (../shared/HAMI-CONTRACT.md,
HAMi's pkg/monitor/nvidia/v1/spec.go), not from our headers: what HAMi's monitor would report for the container must
match what the shim counts and what the process holds."""

from __future__ import annotations

import json
import struct
import time

import pytest

from hami_reader import OFF_LAST_KERNEL_TIME, OFF_PRIORITY, OFF_RECENT_KERNEL, OFF_SWITCH, read_as_hami_monitor
from vgpu_fixtures import requires_native, vgpu

GIB = 1 << 30
MIB = 1 << 20

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
    # HAMi's breakdown: the allocations (data), each process's context, the driver's own memory (module): they add up.
    assert view.data == GIB + 256 * MIB, view
    assert view.context > 0 and view.context + view.module + view.data == view.memory_bytes, view
    assert held[0]["total"] == 4 * GIB, "the shim's view of the device: the limit"
    for holder in holders:
        assert holder.finish(timeout=30).returncode == 0
    after = read_as_hami_monitor(container)[0]
    assert after.memory_bytes == 0 and after.pids == [], after


def write_word(path, offset: int, value: int) -> None:
    """As HAMi's monitor writes its feedback: the file mapped read-write, one int32 stored, no lock."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<i", value))


def read_word(path, offset: int) -> int:
    return struct.unpack_from("<i", path.read_bytes(), offset)[0]


@requires_native
def test_a_launching_container_reads_as_active_with_its_share_and_as_idle_once_it_stops(fake_gpu, container,
                                                                                      tenant_available):
    """recent_kernel: 2 while the container launches (HAMi's monitor decrements it every 5 s and counts the container
    active while above 0), last_kernel_time the launch's unix second, and deviceUtil[0].sm the process's share of the
    GPU (capped at 40 %: its limiter's accounting); once the process stops launching (alive, idle), its share reads 0
    within a few seconds rather than its last busy second for ever."""
    started = int(time.time())
    tenant = fake_gpu.start_tenant("--phase", "kernels=1ms,for=3s,depth=4", "--phase", "idle=6s", "--seconds", "9")
    time.sleep(2.6)
    busy = read_as_hami_monitor(container)[0]
    data = container.read_bytes()
    assert read_word(container, OFF_RECENT_KERNEL) == 2
    (last,) = struct.unpack_from("<q", data, OFF_LAST_KERNEL_TIME)
    assert started - 1 <= last <= int(time.time()) + 1, (started, last)
    assert busy.pids == [tenant.pid]
    assert 25 <= busy.utilization <= 55, f"a process capped at 40 % reads {busy.utilization} % to HAMi's monitor"
    time.sleep(4.0)  # idle since ~3 s: two seconds to be called idle, one for the watcher to look
    idle = read_as_hami_monitor(container)[0]
    assert idle.pids == [tenant.pid], "still alive, so still counted"
    assert idle.utilization == 0, f"an idle process reads {idle.utilization} %"
    assert tenant.finish(timeout=30).returncode == 0


def write_verdict(path, uuid: str, pid: int, sm_permille: int) -> None:
    """The node monitor's verdict (docs/node-monitor.md), fresh now: the container's device, and one process."""
    now = time.time_ns()
    text = (f"vgpu-verdict 1\nseq {now}\nstamp_ns {now}\n"
            f"device {uuid} memory_limit=0 memory_used=0 sm_limit=0 sm_used={sm_permille}\n"
            f"process {pid} device={uuid} memory_used=0 sm_used={sm_permille}\n")
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(path)


@requires_native
def test_an_uncapped_process_reads_its_share_from_the_node_monitors_verdict(fake_gpu, container, tenant_available):
    """Without a compute cap the shim measures nothing (HAMi#1864: utilization then reads 0); where vgpu-monitor runs,
    its verdict has each process's NVML samples, and that is what HAMi's monitor reads."""
    del fake_gpu.env["CUDA_DEVICE_SM_LIMIT"]
    verdict = fake_gpu.work_dir / "verdict"
    fake_gpu.env["VGPU_VERDICT_FILE"] = str(verdict)
    tenant = fake_gpu.start_tenant("--kernel-us", "1000", "--seconds", "4", "--report-ms", "100")
    tenant.next_json(timeout=30)  # launching: the device is named in the cache file
    uuid = read_as_hami_monitor(container)[0].uuid
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        write_verdict(verdict, uuid, tenant.pid, 623)
        time.sleep(0.2)
    view = read_as_hami_monitor(container)[0]
    assert view.sm_limit == 0
    assert view.utilization == 62, f"the verdict says 62.3 %, HAMi's monitor reads {view.utilization} %"
    assert tenant.finish(timeout=30).returncode == 0


@requires_native
def test_a_block_written_by_hamis_monitor_holds_launches_until_it_is_lifted(fake_gpu, container, tenant_available):
    """recent_kernel = -1 (a container of a higher priority is active on the GPU): the launches wait, as under
    HAMi-core; the shim never overwrites the -1; HAMi's monitor's 0 lets them go on."""
    first = fake_gpu.tenant("--kernel-us", "1000", "--seconds", "0.5", timeout=60)
    assert first.returncode == 0, first.describe()
    write_word(container, OFF_RECENT_KERNEL, -1)
    fake_gpu.env["LIBCUDA_LOG_LEVEL"] = "2"
    tenant = fake_gpu.start_tenant("--kernel-us", "1000", "--seconds", "3", "--report-ms", "100")
    held = lines_within(tenant, 1.5)
    assert tenant.popen.poll() is None, "the tenant ended while held"
    assert all(line["kernels"] == 0 for line in held if line.get("ev") == "report"), held
    assert read_word(container, OFF_RECENT_KERNEL) == -1, "the shim overwrote the block HAMi's monitor wrote"
    write_word(container, OFF_RECENT_KERNEL, 0)
    result = tenant.finish(timeout=30)
    assert result.returncode == 0, result.describe()
    assert result.json["kernels"] > 100, result.stdout
    assert read_word(container, OFF_RECENT_KERNEL) == 2
    assert "launches held: HAMi's monitor says a container of a higher priority is active" in result.stderr


def lines_within(process, seconds: float) -> list[dict]:
    """The JSON lines a background process prints within `seconds` (it may print none)."""
    lines, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            lines.append(process.next_json(timeout=left))
        except AssertionError:  # nothing more within the time (or the process ended: the caller checks)
            break
    return lines


def busy_fraction(reports: list[dict], start_s: float, end_s: float) -> float:
    """The tenant's completed kernel time over [start_s, end_s) of its run, from its progress lines."""
    inside = [r for r in reports if start_s * 1e9 <= r["t_ns"] <= end_s * 1e9]
    assert len(inside) >= 2, reports
    return (inside[-1]["busy_ns"] - inside[0]["busy_ns"]) / (inside[-1]["t_ns"] - inside[0]["t_ns"])


@requires_native
def test_under_default_hamis_utilization_switch_holds_a_lone_container_to_its_cap(fake_gpu, container,
                                                                                  tenant_available):
    """`default` lends the GPU's idle time: alone on the fake GPU, a container capped at 40 % runs at nearly all of it.
    HAMi's monitor's utilization_switch = 1 (another container active on the GPU) holds it to its cap, as HAMi-core's
    `default` does; 0 again, and it lends again."""
    fake_gpu.env["GPU_CORE_UTILIZATION_POLICY"] = "default"
    tenant = fake_gpu.start_tenant("--kernel-us", "1000", "--depth", "4", "--seconds", "10", "--report-ms", "100")
    reports = [tenant.next_json(timeout=30)]
    time.sleep(3.0)
    write_word(container, OFF_SWITCH, 1)
    time.sleep(3.0)
    write_word(container, OFF_SWITCH, 0)
    result = tenant.finish(timeout=30)
    assert result.returncode == 0, result.describe()
    reports += [json.loads(line) for line in result.stdout.splitlines() if '"report"' in line]
    first_s = reports[0]["t_ns"] / 1e9  # the switch was written 3 and 6 s after this report
    lent, held, lent_again = (busy_fraction(reports, first_s + a, first_s + b) for a, b in ((1, 3), (4, 6), (7.5, 9.5)))
    assert lent > 0.7, f"alone under default: {lent:.2f} of the GPU"
    assert held < 0.5, f"with utilization_switch 1: {held:.2f} of the GPU against a cap of 0.40"
    assert lent_again > 0.7, f"utilization_switch 0 again: {lent_again:.2f} of the GPU"
