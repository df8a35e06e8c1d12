"""vgpu-monitor's /metrics (docs/metrics.md), scraped as Prometheus scrapes it: the real monitor over fakecuda beside a
live container under the shim, the text parsed with prometheus_client's own parser. The container's memory must be
what the driver shows for its process, its limits its container file's, the device's figures NVML's; its throttled
seconds and refused allocations what the shim counted in its region; HAMi's series only with --hami-metrics, equal to
what HAMi's monitor would read from the container's cache file."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakegpu_harness import MonitorProcess
from hami_reader import read_as_hami_monitor

GIB = 1 << 30

HOST_NVML = """
import json, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
uuid = pynvml.nvmlDeviceGetUUID(h)
memory = pynvml.nvmlDeviceGetMemoryInfo(h)
processes = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
print(json.dumps({"uuid": uuid if isinstance(uuid, str) else uuid.decode(), "total": memory.total,
                  "processes": processes}))
"""


def host_nvml(fake_gpu) -> dict:
    """What the host's NVML shows for device 0 (a client outside the container: no shim)."""
    env = {name: value for name, value in fake_gpu.env.items() if name != "LD_PRELOAD"}
    run = subprocess.run([sys.executable, "-c", HOST_NVML], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


class Monitor(MonitorProcess):
    """vgpu-monitor serving metrics on a free port of 127.0.0.1, judging one container, `box`: every process this test
    starts (its cgroup is the test's own), with a 4 GiB and 40 % limit and its cache folder named."""

    def __init__(self, fake_gpu, build_dir: Path, cache_folder: Path) -> None:
        super().__init__(fake_gpu, build_dir / "bin" / "vgpu-monitor", fake_gpu.work_dir)
        self.contain("CUDA_DEVICE_MEMORY_LIMIT=4Gi", "CUDA_DEVICE_SM_LIMIT=40", f"VGPU_CACHE={cache_folder}",
                     "VGPU_POD_NAMESPACE=ml", "VGPU_POD_NAME=train-0", "VGPU_CONTAINER_NAME=main")
        self.port = 0

    def start(self, *flags: str) -> None:
        super().start("--period-ms", "50", "--metrics-port", "0", "--metrics-address", "127.0.0.1", *flags)
        found = self.wait_for(lambda: re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics", self.log()),
                              10, "the port it serves on")
        self.port = int(found.group(1))

    def scrape(self) -> dict:
        """{(sample name, frozenset of labels): value} of one scrape; {} while no period is judged (503)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
                assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = response.read().decode("utf-8")
        except urllib.error.HTTPError as error:
            assert error.code == 503, error
            return {}
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                assert key not in samples, f"{key} twice"
                samples[key] = sample.value
        return samples

    def stop(self) -> None:
        returncode = super().stop()
        assert returncode in (None, 0), self.log()


@pytest.fixture
def box(fake_gpu, shim_path, build_dir):
    """The next processes of `fake_gpu` are container `box` under the shim (its cache file in a folder, as HAMi's
    device plugin lays it out), and a monitor knows it; start it with monitor.start(flags)."""
    cache_folder = fake_gpu.work_dir / "box-folder"
    cache_folder.mkdir()
    fake_gpu.env.update({"LD_PRELOAD": str(shim_path), "CUDA_DEVICE_MEMORY_LIMIT": "4096m",
                         "CUDA_DEVICE_SM_LIMIT": "40", "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(cache_folder / "5f0c1a2b.cache")})
    monitor = Monitor(fake_gpu, build_dir, cache_folder)
    yield monitor
    monitor.stop()


def labelled(samples: dict, name: str, **labels: str) -> list[tuple[dict, float]]:
    """The samples named `name` whose labels include `labels`: [(all their labels, value)]."""
    return [(dict(key_labels), value) for (sample_name, key_labels), value in samples.items()
            if sample_name == name and labels.items() <= dict(key_labels).items()]


def one(samples: dict, name: str, **labels: str) -> float:
    found = labelled(samples, name, **labels)
    assert len(found) == 1, (name, labels, found, sorted({n for n, _ in samples}))
    return found[0][1]


def test_a_containers_memory_and_limits_are_the_drivers_and_its_files(fake_gpu, box):
    box.start()
    holder = fake_gpu.start_py("hold_memory.py", str(GIB))
    held = holder.next_json(timeout=60)
    host = host_nvml(fake_gpu)
    driver_count = host["processes"][str(held["pid"])]
    assert driver_count >= GIB
    ours = dict(container="box", vdevice_index="0", device_uuid=host["uuid"])
    samples = box.wait_for(
        lambda: (s := box.scrape()) and labelled(s, "vgpu_container_memory_used_bytes", **ours)
        and one(s, "vgpu_container_memory_used_bytes", **ours) == driver_count and s, 20,
        "the holder's memory in the container's series")
    assert one(samples, "vgpu_container_memory_limit_bytes", **ours) == 4 * GIB
    assert one(samples, "vgpu_container_sm_limit_ratio", **ours) == pytest.approx(0.4)
    assert one(samples, "vgpu_container_info", container="box", namespace="ml", pod="train-0",
               container_name="main") == 1
    device = dict(device_index="0", device_uuid=host["uuid"])
    assert one(samples, "vgpu_device_memory_total_bytes", **device) == host["total"]
    assert one(samples, "vgpu_device_memory_used_bytes", **device) >= driver_count
    assert 0 <= one(samples, "vgpu_device_utilization_ratio", **device) <= 1
    assert one(samples, "vgpu_monitor_periods_total") >= 1
    assert abs(one(samples, "vgpu_monitor_last_period_timestamp_seconds") - time.time()) < 10
    assert not [name for name, _ in samples if name.startswith("hami_") or name.startswith("vgpu_container_hami")], \
        "HAMi's series without --hami-metrics"
    assert holder.finish(timeout=30).returncode == 0
    box.wait_for(lambda: (s := box.scrape()) and one(s, "vgpu_container_memory_used_bytes", **ours) == 0, 20,
                 "the container's memory back to 0 once its process ended")


def test_hamis_series_with_the_flag_are_what_hamis_monitor_reads_from_the_cache_file(fake_gpu, box):
    box.start("--hami-metrics")
    assert one(box.wait_for(box.scrape, 10, "a first scrape"), "vgpu_container_hami_cache_valid",
               container="box") == 0, "no CUDA call yet: no cache file"
    holder = fake_gpu.start_py("hold_memory.py", str(GIB))
    holder.next_json(timeout=60)
    cache = next((fake_gpu.work_dir / "box-folder").glob("*.cache"))
    view = read_as_hami_monitor(cache)[0]  # steady while the holder holds
    hami = dict(namespace="ml", pod="train-0", container="main", vdevice_index="0", device_uuid=view.uuid,
                zone="vGPU")
    samples = box.wait_for(
        lambda: (s := box.scrape()) and labelled(s, "hami_vgpu_memory_used_bytes", **hami)
        and one(s, "hami_vgpu_memory_used_bytes", **hami) == view.memory_bytes and s, 20,
        "the cache file's memory in hami_vgpu_memory_used_bytes")
    assert GIB <= view.memory_bytes
    assert one(samples, "hami_container_device_memory_bytes", **hami) == view.memory_bytes
    assert one(samples, "hami_vgpu_memory_limit_bytes", **hami) == 4 * GIB == view.limit_bytes
    assert one(samples, "hami_vgpu_memory_buffer_bytes", **hami) >= GIB
    assert (one(samples, "hami_vgpu_memory_context_bytes", **hami) + one(samples, "hami_vgpu_memory_module_bytes",
                                                                         **hami)
            + one(samples, "hami_vgpu_memory_buffer_bytes", **hami)) == view.memory_bytes
    assert one(samples, "hami_container_device_utilization_ratio", **hami) >= 0
    assert one(samples, "vgpu_container_hami_cache_valid", container="box") == 1
    assert holder.finish(timeout=30).returncode == 0


def test_a_launching_container_shows_its_share_and_the_devices_utilization(fake_gpu, box, tenant_available):
    box.start()
    tenant = fake_gpu.start_tenant("--kernel-us", "2000", "--seconds", "4")
    uuid = host_nvml(fake_gpu)["uuid"]
    ours = dict(container="box", vdevice_index="0", device_uuid=uuid)
    samples = box.wait_for(
        lambda: (s := box.scrape()) and labelled(s, "vgpu_container_sm_used_ratio", **ours)
        and one(s, "vgpu_container_sm_used_ratio", **ours) > 0.1 and s, 20, "the container's share above 10 %")
    assert one(samples, "vgpu_container_sm_used_ratio", **ours) <= 0.6, "a 40 % cap"
    box.wait_for(lambda: (s := box.scrape()) and one(s, "vgpu_device_utilization_ratio", device_index="0",
                                                     device_uuid=uuid) > 0.1, 20, "the device's utilization")
    assert tenant.finish(timeout=60).returncode == 0


def test_a_capped_container_shows_the_time_its_launches_were_held_back_growing(fake_gpu, box, tenant_available):
    """The box's 40 % cap (force) holds a tenant that would keep the GPU busy: its launches wait for the budget, and the
    shim adds each wait to the region the monitor reads (docs/metrics.md)."""
    box.start()
    uuid = host_nvml(fake_gpu)["uuid"]
    ours = dict(container="box", vdevice_index="0", device_uuid=uuid)
    throttled = "vgpu_container_throttled_seconds_total"
    tenant = fake_gpu.start_tenant("--kernel-us", "2000", "--seconds", "5")
    samples = box.wait_for(lambda: (s := box.scrape()) and labelled(s, throttled, **ours)
                           and one(s, throttled, **ours) > 0 and s, 20, "throttled seconds above 0")
    first = one(samples, throttled, **ours)
    started = time.monotonic()
    later = box.wait_for(lambda: (s := box.scrape()) and one(s, throttled, **ours) >= first + 0.5 and s, 20,
                         "throttled seconds growing by 0.5 s")
    grown = one(later, throttled, **ours) - first
    # Held back at most the wall time that passed: the tenant launches from one thread.
    assert grown <= time.monotonic() - started + 0.2, (grown, first)
    assert one(later, "vgpu_container_refused_allocations_total", **ours) == 0
    assert tenant.finish(timeout=60).returncode == 0
    time.sleep(0.2)  # four periods: the figures are from after the tenant's end
    after = one(box.scrape(), throttled, **ours)
    assert after >= one(later, throttled, **ours), "a counter never goes back"
    time.sleep(0.3)
    assert one(box.scrape(), throttled, **ours) == after, "nothing launches: nothing more is held"


def test_under_time_division_the_waits_for_the_containers_turn_are_held_time(fake_gpu, box, tenant_available):
    """Under time division the box (40 %) and a neighbour (60 %, a region of its own) take turns on the GPU: the box's
    launches wait for its turn in the shim (turn::Take), and those waits are its throttled seconds."""
    schedule = fake_gpu.work_dir / "vgpu-schedule"
    fake_gpu.env.update({"VGPU_COMPUTE_SHARING": "time-division", "VGPU_SCHEDULE_FILE": str(schedule)})
    box.start()
    uuid = host_nvml(fake_gpu)["uuid"]
    ours = dict(container="box", vdevice_index="0", device_uuid=uuid)
    throttled = "vgpu_container_throttled_seconds_total"
    tenants = [fake_gpu.start_tenant("--kernel-us", "2000", "--seconds", "4")]
    box_env = dict(fake_gpu.env)
    fake_gpu.env.update({"CUDA_DEVICE_SM_LIMIT": "60",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "neighbour.cache")})
    tenants.append(fake_gpu.start_tenant("--kernel-us", "2000", "--seconds", "4"))
    fake_gpu.env = box_env
    samples = box.wait_for(lambda: (s := box.scrape()) and labelled(s, throttled, **ours)
                           and one(s, throttled, **ours) >= 0.3 and s, 20, "0.3 s of turn waits")
    assert one(samples, throttled, **ours) <= 5, "at most the wall time of one launching thread"
    for tenant in tenants:
        assert tenant.finish(timeout=60).returncode == 0


REFUSE_ALLOCATIONS = """
    from cuda.bindings import driver
    from clientlib import GIB, MIB, check, cuda_context, emit
    cuda_context(0)
    refused = 0
    held = [check("cuMemAlloc", driver.cuMemAlloc(3 * GIB))]  # of the box's 4 GiB
    for size in (8 * GIB, 2 * GIB, 16 * MIB, 2 * GIB):
        error, pointer = driver.cuMemAlloc(size)
        if error == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            refused += 1
        else:
            check("cuMemAlloc", (error, pointer))
            held.append(pointer)
    emit({"refused": refused, "held": len(held)})
"""


def test_allocations_refused_at_the_memory_limit_are_counted_once_each(fake_gpu, box):
    box.start()
    uuid = host_nvml(fake_gpu)["uuid"]
    ours = dict(container="box", vdevice_index="0", device_uuid=uuid)
    refused = "vgpu_container_refused_allocations_total"
    assert box.wait_for(lambda: (s := box.scrape()) and s, 10, "a first scrape")
    report = fake_gpu.run_py(REFUSE_ALLOCATIONS, timeout=60).json
    assert report == {"refused": 3, "held": 2}, report
    samples = box.wait_for(lambda: (s := box.scrape()) and labelled(s, refused, **ours) and s, 20,
                           "the refused allocations' series")
    assert one(samples, refused, **ours) == 3
    assert one(samples, "vgpu_container_throttled_seconds_total", **ours) == 0, "nothing launched"
    # A second process of the container adds to the container's figure (the region file outlives its processes).
    assert fake_gpu.run_py(REFUSE_ALLOCATIONS, timeout=60).json["refused"] == 3
    box.wait_for(lambda: (s := box.scrape()) and one(s, refused, **ours) == 6, 20, "six refusals in all")


def test_a_bad_cache_file_is_reported_once_and_the_rest_still_served(fake_gpu, box):
    folder = fake_gpu.work_dir / "box-folder"
    (folder / "x.cache").write_bytes(b"\0" * 4096)
    box.start("--hami-metrics", "--log-level", "1")
    samples = box.wait_for(lambda: (s := box.scrape()) and s, 10, "a first scrape")
    time.sleep(0.5)  # ten periods
    samples = box.scrape()
    assert one(samples, "vgpu_container_hami_cache_valid", container="box") == 0
    assert not [name for name, _ in samples if name.startswith("hami_")]
    assert labelled(samples, "vgpu_container_memory_limit_bytes", container="box")
    assert box.log().count("x.cache: magic 0 is not HAMi's 19920718") == 1, box.log()


def test_a_port_in_use_or_a_bad_flag_is_refused_naming_it(fake_gpu, box):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([str(box.binary), "--containers", str(box.containers), "--verdicts", str(box.verdicts),
                              "--metrics-address", "127.0.0.1", "--metrics-port", str(port)],
                             env=fake_gpu.env | {"LD_PRELOAD": ""}, capture_output=True, text=True, timeout=30)
    assert run.returncode == 1, run
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in run.stderr, run.stderr
    cases = {("--metrics-port", "70000"): "--metrics-port '70000' is not a port number from 0 to 65535",
             ("--metrics-address", "localhost"): "--metrics-address 'localhost' is not an IPv4 address",
             ("--hami-metrics",): "--hami-metrics needs --metrics-port"}
    for args, said in cases.items():
        run = subprocess.run([str(box.binary), "--containers", str(box.containers), "--verdicts", str(box.verdicts),
                              *args], capture_output=True, text=True, timeout=30)
        assert run.returncode == 2 and said in run.stderr, (args, run.stderr)


def test_a_silent_scraper_stalls_neither_the_judging_nor_the_next_scrape_for_long(fake_gpu, box):
    box.start()
    first = one(box.wait_for(box.scrape, 10, "a first scrape"), "vgpu_monitor_periods_total")
    verdict = box.verdicts / "box" / "verdict"
    seq = lambda: int(verdict.read_text().splitlines()[1].split()[1])  # noqa: E731
    with socket.create_connection(("127.0.0.1", box.port)) as silent:  # connects, never asks
        before = seq()
        time.sleep(1)
        assert seq() >= before + 10 * 50_000_000, "verdicts went on being written every 50 ms"
        started = time.monotonic()
        later = one(box.scrape(), "vgpu_monitor_periods_total")
        assert time.monotonic() - started < 4, "the silent connection is dropped after its 2 s read limit"
        assert later >= first + 20
        assert silent.recv(100) == b"", "closed without an answer"
