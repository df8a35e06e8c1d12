"""cuda-python's cuda.bindings.driver, a real Driver API client no one here wrote, against fakecuda's libcuda.so.1."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from fakegpu_harness import CLIENTS_DIR

MIB = 1 << 20
GIB = 1 << 30
H100_CUDA_TOTAL_BYTES = 81079 * MIB


def test_spin_kernel_ptx_is_valid_for_sm_90(tmp_path):
    """The PTX the clients load must be PTX a real H100 driver accepts, not just what fakecuda parses."""
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if not os.access(ptxas, os.X_OK):
        pytest.skip("ptxas (CUDA toolkit) is not installed")
    completed = subprocess.run([ptxas, "-arch=sm_90", str(CLIENTS_DIR / "vgpu_spin.ptx"),
                                "-o", str(tmp_path / "vgpu_spin.cubin")], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_clients_load_fakecuda_from_build(fake_gpu):
    report = fake_gpu.run_py("""
        import os
        from cuda.bindings import driver
        import cuda.pathfinder
        import pynvml
        from clientlib import check, emit
        check("cuInit", driver.cuInit(0))
        pynvml.nvmlInit()
        with open("/proc/self/maps") as maps:
            mapped = sorted({line.split()[-1] for line in maps
                             if "libcuda.so" in line or "libnvidia-ml.so" in line})
        emit({"mapped": mapped, "pathfinder": cuda.pathfinder.load_nvidia_dynamic_lib("cuda").abs_path})
    """).json
    library_dir = os.path.realpath(fake_gpu.library_dir)
    expected = {os.path.realpath(fake_gpu.library_dir / "libcuda.so.1"),
                os.path.realpath(fake_gpu.library_dir / "libnvidia-ml.so.1")}
    assert set(map(os.path.realpath, report["mapped"])) == expected, (
        f"the clients must map fakecuda's libraries from {library_dir} and no others: {report['mapped']}")
    assert os.path.realpath(report["pathfinder"]) == os.path.realpath(fake_gpu.library_dir / "libcuda.so.1")


DEVICE_REPORT = """
from cuda.bindings import driver
from clientlib import check, emit
attribute = driver.CUdevice_attribute
check("cuInit", driver.cuInit(0))
devices = []
for ordinal in range(check("cuDeviceGetCount", driver.cuDeviceGetCount())):
    device = check("cuDeviceGet", driver.cuDeviceGet(ordinal))
    def get(name):
        return check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(getattr(attribute, name), device))
    devices.append({
        "name": check("cuDeviceGetName", driver.cuDeviceGetName(256, device)).split(b"\\0")[0].decode(),
        "total_mem": check("cuDeviceTotalMem", driver.cuDeviceTotalMem(device)),
        "cc": [get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
               get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")],
        "sms": get("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
    })
emit({"driver_version": check("cuDriverGetVersion", driver.cuDriverGetVersion()), "devices": devices})
"""


def test_init_and_device_properties(fake_gpu):
    report = fake_gpu.run_py(DEVICE_REPORT).json
    assert report["driver_version"] == 13000
    assert len(report["devices"]) == 1
    device = report["devices"][0]
    assert device["name"] == "NVIDIA H100 80GB HBM3"
    assert device["total_mem"] == H100_CUDA_TOTAL_BYTES
    assert device["cc"] == [9, 0]
    assert device["sms"] == 132


def test_device_count_follows_fakecuda_devices(fake_gpu):
    fake_gpu.env["FAKECUDA_DEVICES"] = "2*h100-80gb"
    devices = fake_gpu.run_py(DEVICE_REPORT).json["devices"]
    assert len(devices) == 2
    assert all(device["name"] == "NVIDIA H100 80GB HBM3" for device in devices)


def test_alloc_free_and_mem_get_info(fake_gpu):
    report = fake_gpu.run_py("""
        from cuda.bindings import driver
        from clientlib import GIB, check, cuda_context, emit
        cuda_context(0)
        free_start, total = check("cuMemGetInfo", driver.cuMemGetInfo())
        pointer = check("cuMemAlloc", driver.cuMemAlloc(GIB))
        free_held, _ = check("cuMemGetInfo", driver.cuMemGetInfo())
        check("cuMemFree", driver.cuMemFree(pointer))
        free_end, _ = check("cuMemGetInfo", driver.cuMemGetInfo())
        emit({"total": total, "free_start": free_start, "free_held": free_held, "free_end": free_end,
              "pointer": int(pointer)})
    """).json
    assert report["pointer"] != 0
    assert report["total"] == H100_CUDA_TOTAL_BYTES
    # This process's own context takes ~518 MiB on an H100 (driver 580).
    context_bytes = report["total"] - report["free_start"]
    assert 400 * MIB <= context_bytes <= 700 * MIB, f"context overhead {context_bytes / MIB:.0f} MiB"
    allocated = report["free_start"] - report["free_held"]
    assert GIB <= allocated <= GIB + 2 * MIB, f"a 1 GiB allocation took {allocated} bytes of free memory"
    assert report["free_end"] == report["free_start"], "cuMemFree must give the memory back"


def test_memcpy_round_trip(fake_gpu):
    report = fake_gpu.run_py("""
        import numpy as np
        from cuda.bindings import driver
        from clientlib import MIB, check, cuda_context, emit
        cuda_context(0)
        size = 4 * MIB + 3   # not a multiple of anything, so a partial last chunk is copied too
        source = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        pointer = check("cuMemAlloc", driver.cuMemAlloc(size))
        check("cuMemcpyHtoD", driver.cuMemcpyHtoD(pointer, source, size))
        back = np.zeros(size, dtype=np.uint8)
        check("cuMemcpyDtoH", driver.cuMemcpyDtoH(back, pointer, size))
        payload = b"fakecuda keeps bytes"
        small = check("cuMemAlloc", driver.cuMemAlloc(len(payload)))
        check("cuMemcpyHtoD", driver.cuMemcpyHtoD(small, payload, len(payload)))
        small_back = bytearray(len(payload))
        check("cuMemcpyDtoH", driver.cuMemcpyDtoH(small_back, small, len(payload)))
        check("cuMemFree", driver.cuMemFree(pointer))
        check("cuMemFree", driver.cuMemFree(small))
        emit({"equal": bool(np.array_equal(source, back)), "nonzero": int(np.count_nonzero(back)),
              "bytes_back": bytes(small_back).decode(errors="replace")})
    """).json
    assert report["equal"], "cuMemcpyDtoH did not return what cuMemcpyHtoD wrote"
    assert report["nonzero"] > 0
    assert report["bytes_back"] == "fakecuda keeps bytes"


@pytest.mark.parametrize("style", ["pointer-array", "values-and-types"])
def test_ptx_kernel_launch_and_event_timing(fake_gpu, style):
    report = fake_gpu.run_py("""
        import sys, time
        from cuda.bindings import driver
        from clientlib import check, cuda_context, emit, launch_spin, load_spin_kernel
        style = sys.argv[1]
        cuda_context(0)
        module, function = load_spin_kernel()
        start = check("cuEventCreate", driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT))
        stop = check("cuEventCreate", driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT))
        check("cuEventRecord", driver.cuEventRecord(start, 0))
        wall_start = time.monotonic()
        launch_spin(function, 20_000_000, grid_x=1, block_x=32, style=style)
        check("cuEventRecord", driver.cuEventRecord(stop, 0))
        check("cuCtxSynchronize", driver.cuCtxSynchronize())
        wall_s = time.monotonic() - wall_start
        elapsed_ms = check("cuEventElapsedTime", driver.cuEventElapsedTime(start, stop))
        check("cuEventDestroy", driver.cuEventDestroy(start))
        check("cuEventDestroy", driver.cuEventDestroy(stop))
        check("cuModuleUnload", driver.cuModuleUnload(module))
        emit({"elapsed_ms": elapsed_ms, "wall_s": wall_s})
    """, style).json
    assert report["elapsed_ms"] >= 18.0, f"a 20 ms kernel measured {report['elapsed_ms']} ms between events"
    assert report["elapsed_ms"] < 1000.0
    assert report["wall_s"] >= 0.018, "cuCtxSynchronize returned before the kernel could have finished"


def test_module_get_function_of_unknown_name_fails(fake_gpu):
    report = fake_gpu.run_py("""
        from cuda.bindings import driver
        from clientlib import cuda_context, cuda_error_name, emit, load_spin_kernel
        cuda_context(0)
        module, _ = load_spin_kernel()
        error, _ = driver.cuModuleGetFunction(module, b"no_such_kernel")
        emit({"error": cuda_error_name(error)})
    """).json
    assert report["error"] == "CUDA_ERROR_NOT_FOUND"
