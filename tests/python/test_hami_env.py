"""HAMi's environment contract (issue 21, docs/hami-env.md): tenants run under the shim with the variables exactly as
HAMi's device plugin and admission webhook write them (Project-HAMi/HAMi pkg/device-plugin/nvidiadevice/nvinternal/
plugin/server.go, Allocate; pkg/device/nvidia/device.go, MutateAdmission), over fakecuda, and each variable's
observable effect is asserted: what CUDA and NVML report, what an allocation gets, what share of the GPU a tenant
gets, what the shim prints."""

from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path

import pytest

MIB = 1 << 20
GIB = 1 << 30

# HAMi-core's cache file (v1) at the offsets HAMi's monitor reads (../shared/HAMI-CONTRACT.md, test_hami_cache.py).
CACHE_MAGIC = 19920718
OFF_SM_LIMIT, OFF_PRIORITY = 1728, 2_008_908

# One client for every case: per CUDA device, the driver's and NVML's view of memory and what an allocation of the
# asked size returns; whether the shim is mapped and whether LD_PRELOAD is set (test_ld_so_preload.py uses it too).
# argv[1]: JSON {"<ordinal>": bytes to allocate}.
PROBE = """
import json, os, sys
import pynvml
from cuda.bindings import driver
from clientlib import check, cuda_context, cuda_error_name, emit

sizes = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
with open("/proc/self/maps") as maps:
    shim = sorted({line.split()[-1] for line in maps if "libvgpu" in line})
report = {"pid": os.getpid(), "ld_preload": os.environ.get("LD_PRELOAD"), "shim_mapped": shim, "devices": []}
error, = driver.cuInit(0)
if error != driver.CUresult.CUDA_SUCCESS:
    report["cuInit"] = cuda_error_name(error)
    emit(report)
    sys.exit(0)
pynvml.nvmlInit()
for ordinal in range(check("cuDeviceGetCount", driver.cuDeviceGetCount())):
    cuda_context(ordinal)
    free, total = check("cuMemGetInfo", driver.cuMemGetInfo())
    handle = pynvml.nvmlDeviceGetHandleByIndex(ordinal)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    device = {"uuid": uuid.decode() if isinstance(uuid, bytes) else uuid, "total": total, "free": free,
              "nvml_total": pynvml.nvmlDeviceGetMemoryInfo(handle).total}
    size = sizes.get(str(ordinal))
    if size:
        error, pointer = driver.cuMemAlloc(size)
        device["alloc"] = cuda_error_name(error)
        if error == driver.CUresult.CUDA_SUCCESS:
            check("cuMemFree", driver.cuMemFree(pointer))
    report["devices"].append(device)
emit(report)
"""


def probe(fake_gpu, sizes: dict[int, int] | None = None):
    """Runs PROBE in the machine's current environment; returns (its report, its stderr)."""
    result = fake_gpu.run_py(PROBE, json.dumps({str(k): v for k, v in (sizes or {}).items()}), timeout=60)
    return result.json, result.stderr


def hami_environment(container_folder: Path, memory_mib: list[int], cores: int) -> dict[str, str]:
    """What HAMi's device plugin writes for a container given len(memory_mib) devices (non-MIG Allocate):
    CUDA_DEVICE_MEMORY_LIMIT_<i>=<MiB>m in allocation order, one CUDA_DEVICE_SM_LIMIT (the first device's cores) for
    all of them, and a cache file of a random UUID in the container's folder (HAMi: /usr/local/vgpu, mounted from
    the host's /usr/local/vgpu/containers/<podUID>_<container>; here the test's own folder)."""
    container_folder.mkdir(parents=True, exist_ok=True)
    env = {f"CUDA_DEVICE_MEMORY_LIMIT_{i}": f"{mib}m" for i, mib in enumerate(memory_mib)}
    env["CUDA_DEVICE_SM_LIMIT"] = str(cores)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(container_folder / f"{uuid.uuid4()}.cache")
    return env


@pytest.fixture
def two_devices(fake_gpu):
    """A machine of two H100s; returns the physical view (no shim) the capped views are compared with."""
    fake_gpu.env["FAKECUDA_DEVICES"] = "2*h100-80gb"
    report, _ = probe(fake_gpu)
    assert report["shim_mapped"] == [] and len(report["devices"]) == 2, report
    return report["devices"]


def under_shim(fake_gpu, shim_path, env: dict[str, str]) -> None:
    fake_gpu.env.update({"LD_PRELOAD": str(shim_path), **env})


def vgpu_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vgpu")]


def test_memory_limits_in_mib_cap_each_device_in_allocation_order(fake_gpu, shim_path, two_devices):
    """CUDA_DEVICE_MEMORY_LIMIT_<i>=<MiB>m: "m" is MiB (1024m is 2^30 bytes, not 10^9), device i is the i-th CUDA
    device; CUDA and NVML both show the slice and an allocation past it is refused."""
    under_shim(fake_gpu, shim_path, hami_environment(fake_gpu.work_dir / "vgpu", [1024, 3000], 100))
    report, stderr = probe(fake_gpu, {0: GIB, 1: 2 * GIB})
    assert report["shim_mapped"], report
    device0, device1 = report["devices"]
    assert device0["total"] == device0["nvml_total"] == 1024 * MIB, device0
    assert device1["total"] == device1["nvml_total"] == 3000 * MIB, device1
    # 1 GiB on device 0 is the whole slice, and the context already holds part of it; device 1 has room for 2 GiB.
    assert device0["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY", device0
    assert device1["alloc"] == "CUDA_SUCCESS", device1
    assert vgpu_lines(stderr) == [], stderr


def test_one_sm_limit_caps_every_device(fake_gpu, shim_path, two_devices, tenant_available):
    """HAMi writes one CUDA_DEVICE_SM_LIMIT (the first device's cores) for all the container's devices: a tenant on
    device 1 is held to it as one on device 0 is, and HAMi's monitor reads it for both devices in the cache file.
    The policy is the pod's `force` (HAMi's webhook writes GPU_CORE_UTILIZATION_POLICY when it is not `default`)."""
    env = hami_environment(fake_gpu.work_dir / "vgpu", [8192, 8192], 30)
    env["GPU_CORE_UTILIZATION_POLICY"] = "force"
    under_shim(fake_gpu, shim_path, env)
    tenants = [fake_gpu.start_tenant("--device", str(device), "--seconds", "3", "--kernel-us", "1000")
               for device in (0, 1)]
    lines = []
    for tenant in tenants:
        result = tenant.finish(timeout=60)
        assert result.returncode == 0, result.describe()
        lines.append(result.json)
    for device, line in enumerate(lines):
        assert abs(line["busy_fraction"] - 0.30) <= 0.05, (device, line)
    data = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).read_bytes()
    assert struct.unpack_from("<i", data, 0)[0] == CACHE_MAGIC
    assert struct.unpack_from("<2Q", data, OFF_SM_LIMIT) == (30, 30)


def test_disable_control_true_leaves_the_container_as_if_the_shim_were_not_there(fake_gpu, shim_path, two_devices,
                                                                                 tenant_available):
    """CUDA_DISABLE_CONTROL=true beside HAMi's limits (HAMi then mounts no /etc/ld.so.preload; here the shim is
    preloaded all the same): the whole devices, allocations past the limits, the whole GPU's time, no cache file."""
    env = hami_environment(fake_gpu.work_dir / "vgpu", [1024, 1024], 30)
    env.update({"GPU_CORE_UTILIZATION_POLICY": "force", "CUDA_DISABLE_CONTROL": "true"})
    under_shim(fake_gpu, shim_path, env)
    report, stderr = probe(fake_gpu, {0: 2 * GIB, 1: 2 * GIB})
    assert report["shim_mapped"], report
    for physical, seen in zip(two_devices, report["devices"]):
        assert (seen["total"], seen["nvml_total"]) == (physical["total"], physical["nvml_total"]), seen
        assert seen["alloc"] == "CUDA_SUCCESS", seen
    line = fake_gpu.tenant("--seconds", "2", "--kernel-us", "1000", timeout=60).json
    assert line["busy_fraction"] >= 0.9, line
    assert not Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).exists()
    assert vgpu_lines(stderr) == [], stderr


@pytest.mark.parametrize("value", ["false", "0"])
def test_disable_control_false_keeps_every_limit(fake_gpu, shim_path, value):
    env = hami_environment(fake_gpu.work_dir / "vgpu", [1024], 100)
    env["CUDA_DISABLE_CONTROL"] = value
    under_shim(fake_gpu, shim_path, env)
    report, _ = probe(fake_gpu, {0: GIB})
    assert report["devices"][0]["total"] == 1024 * MIB, report
    assert report["devices"][0]["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY", report


@pytest.mark.parametrize("value", ["yes", "", "enabled"])
def test_disable_control_with_any_other_value_fails_closed_with_one_line(fake_gpu, shim_path, value):
    """A value HAMi's device plugin does not read as a boolean (it then mounts the preload): no GPU rather than a guess,
    and one line naming the variable, the value and what is accepted. The process goes on (no exit())."""
    env = hami_environment(fake_gpu.work_dir / "vgpu", [1024], 100)
    env["CUDA_DISABLE_CONTROL"] = value
    under_shim(fake_gpu, shim_path, env)
    report, stderr = probe(fake_gpu)
    assert report["cuInit"] == "CUDA_ERROR_NO_DEVICE", report
    lines = vgpu_lines(stderr)
    assert len(lines) == 1, stderr
    assert f"CUDA_DISABLE_CONTROL='{value}' from environment is not true or false" in lines[0], lines
    assert "e.g. CUDA_DISABLE_CONTROL=true" in lines[0] and "fail closed" in lines[0], lines


def test_oversubscribe_true_is_said_once_and_the_limit_holds_as_given(fake_gpu, shim_path):
    """CUDA_OVERSUBSCRIBE=true (HAMi: the node's memory scaling is above 1): nothing is swapped to host memory, the cap
    is the limit HAMi wrote, and the shim says so once per process at LIBCUDA_LOG_LEVEL 2 (silent at HAMi's default
    1)."""
    env = hami_environment(fake_gpu.work_dir / "vgpu", [1024], 100)
    env.update({"CUDA_OVERSUBSCRIBE": "true", "LIBCUDA_LOG_LEVEL": "2"})
    under_shim(fake_gpu, shim_path, env)
    report, stderr = probe(fake_gpu, {0: GIB})
    assert report["devices"][0]["total"] == report["devices"][0]["nvml_total"] == 1024 * MIB, report
    assert report["devices"][0]["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY", report
    said = [line for line in vgpu_lines(stderr) if "CUDA_OVERSUBSCRIBE=true" in line]
    assert len(said) == 1 and "not supported" in said[0] and "hold as given" in said[0], stderr
    fake_gpu.env["LIBCUDA_LOG_LEVEL"] = "1"
    _, stderr = probe(fake_gpu)
    assert vgpu_lines(stderr) == [], stderr


def test_oversubscribe_never_shows_more_than_the_device_has(fake_gpu, shim_path):
    """With memory scaling, HAMi can give a container a limit above the device's memory: the views stop at the
    device's total and an allocation past the device fails, as it would without the shim."""
    fake_gpu.env["FAKECUDA_DEVICES"] = "h100-80gb:memory=4g"
    physical, _ = probe(fake_gpu)
    env = hami_environment(fake_gpu.work_dir / "vgpu", [8192], 100)
    env["CUDA_OVERSUBSCRIBE"] = "true"
    under_shim(fake_gpu, shim_path, env)
    report, _ = probe(fake_gpu, {0: 5 * GIB})
    seen = report["devices"][0]
    assert (seen["total"], seen["nvml_total"]) == (physical["devices"][0]["total"],
                                                   physical["devices"][0]["nvml_total"]), (seen, physical)
    assert seen["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY", seen


def test_core_policy_disable_and_task_priority_as_hami_writes_them(fake_gpu, shim_path, tenant_available):
    """GPU_CORE_UTILIZATION_POLICY=disable (HAMi's --disable-core-limit) measures but never throttles, whatever the SM
    limit; CUDA_TASK_PRIORITY (from nvidia.com/priority) lands where HAMi's monitor reads it."""
    env = hami_environment(fake_gpu.work_dir / "vgpu", [8192], 30)
    env.update({"GPU_CORE_UTILIZATION_POLICY": "disable", "CUDA_TASK_PRIORITY": "0"})
    under_shim(fake_gpu, shim_path, env)
    line = fake_gpu.tenant("--seconds", "2", "--kernel-us", "1000", timeout=60).json
    assert line["busy_fraction"] >= 0.9, line
    data = Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]).read_bytes()
    assert struct.unpack_from("<i", data, OFF_PRIORITY)[0] == 0
    assert struct.unpack_from("<Q", data, OFF_SM_LIMIT)[0] == 30, "the limit is still published for the monitor"


@pytest.mark.parametrize(("level", "says_limits"), [("0", False), ("1", False), ("3", True), ("4", True)])
def test_log_level_as_hami_writes_it(fake_gpu, shim_path, level, says_limits):
    """HAMi writes LIBCUDA_LOG_LEVEL 0, 1, 3 or 4 (pkg/device/nvidia/device.go): 3 and up say where the limits came
    from; 0 and 1 keep the shim quiet while it enforces."""
    env = hami_environment(fake_gpu.work_dir / "vgpu", [1024], 100)
    env["LIBCUDA_LOG_LEVEL"] = level
    under_shim(fake_gpu, shim_path, env)
    report, stderr = probe(fake_gpu, {0: GIB})
    assert report["devices"][0]["alloc"] == "CUDA_ERROR_OUT_OF_MEMORY", report
    said = any("limits from environment, region " + env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] in line
               for line in vgpu_lines(stderr))
    assert said == says_limits, stderr
    if level in ("0", "1"):
        assert vgpu_lines(stderr) == [], stderr


def test_nvidia_visible_devices_is_the_container_runtimes_not_the_shims(fake_gpu, shim_path, two_devices):
    """NVIDIA_VISIBLE_DEVICES names the allocated GPUs for the container runtime, which mounts only those; inside the
    container the shim does not read it. Set to device 1's UUID alone on a process that still sees both devices,
    nothing changes: no device hidden, the limits still by CUDA ordinal."""
    env = hami_environment(fake_gpu.work_dir / "vgpu", [1024, 3000], 100)
    env["NVIDIA_VISIBLE_DEVICES"] = two_devices[1]["uuid"]
    under_shim(fake_gpu, shim_path, env)
    report, stderr = probe(fake_gpu)
    assert [device["uuid"] for device in report["devices"]] == [device["uuid"] for device in two_devices], report
    assert [device["total"] for device in report["devices"]] == [1024 * MIB, 3000 * MIB], report
    assert vgpu_lines(stderr) == [], stderr
