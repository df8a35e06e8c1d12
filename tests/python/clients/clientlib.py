"""Shared pieces of the python client processes: result printing, CUDA error checks, the PTX spin kernel."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

SPIN_PTX_PATH = Path(__file__).resolve().parent / "vgpu_spin.ptx"
SPIN_KERNEL_NAME = b"vgpu_spin"
MIB = 1 << 20
GIB = 1 << 30


def emit(result: dict) -> None:
    """Prints one JSON line: the tests read clients' results (and 'ready' signals) from stdout."""
    print(json.dumps(result), flush=True)


def wait_for_end_of_input() -> None:
    """Clients holding GPU resources keep them until the test closes their stdin."""
    sys.stdin.read()


class CudaCallError(RuntimeError):
    def __init__(self, call: str, name: str):
        super().__init__(f"{call} returned {name}")
        self.call = call
        self.name = name


def cuda_error_name(error) -> str:
    from cuda.bindings import driver

    status, name = driver.cuGetErrorName(error)
    if status == driver.CUresult.CUDA_SUCCESS and name:
        return name.decode()
    return getattr(error, "name", str(error))


def check(call: str, result):
    """cuda.bindings returns (CUresult, *values): raise on an error, return the value(s)."""
    from cuda.bindings import driver

    if not isinstance(result, tuple):
        result = (result,)
    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        raise CudaCallError(call, cuda_error_name(error))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def cuda_context(device_ordinal: int = 0):
    """cuInit and the device's primary context made current: what the CUDA runtime (and PyTorch) do."""
    from cuda.bindings import driver

    check("cuInit", driver.cuInit(0))
    device = check("cuDeviceGet", driver.cuDeviceGet(device_ordinal))
    context = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(device))
    check("cuCtxSetCurrent", driver.cuCtxSetCurrent(context))
    return device, context


def load_spin_kernel():
    """cuModuleLoadData on the PTX text (NUL-terminated, as the driver wants) and the vgpu_spin function."""
    from cuda.bindings import driver

    image = SPIN_PTX_PATH.read_bytes() + b"\0"
    module = check("cuModuleLoadData", driver.cuModuleLoadData(image))
    function = check("cuModuleGetFunction", driver.cuModuleGetFunction(module, SPIN_KERNEL_NAME))
    return module, function


class _KernelParams:
    """Keeps the argument storage alive until the launch has copied it."""

    def __init__(self, ns_per_block: int, style: str):
        self.style = style
        if style == "pointer-array":
            # The C way: void* kernelParams[] whose entries point at each argument's storage.
            self.value = ctypes.c_uint64(ns_per_block)
            self.pointers = (ctypes.c_void_p * 1)(ctypes.addressof(self.value))
            self.argument = ctypes.addressof(self.pointers)
        elif style == "values-and-types":
            # cuda.bindings' own form: ((values...), (ctypes types...)).
            self.argument = ((ns_per_block,), (ctypes.c_uint64,))
        else:
            raise ValueError(f"kernel parameter style {style!r} is not one of 'pointer-array', 'values-and-types'")


def launch_spin(function, ns_per_block: int, grid_x: int = 1, block_x: int = 32, stream=0,
                style: str = "pointer-array") -> None:
    from cuda.bindings import driver

    params = _KernelParams(ns_per_block, style)
    check("cuLaunchKernel", driver.cuLaunchKernel(function, grid_x, 1, 1, block_x, 1, 1, 0, stream,
                                                  params.argument, 0))


def zero_region_words(values) -> int:
    """What a hostile process of a container can do to its region file (CUDA_DEVICE_MEMORY_SHARED_CACHE): every
    aligned 8-byte word holding one of `values` is set to 0. Returns how many were."""
    import mmap
    import os
    import struct

    zeroed = 0
    with open(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"], "r+b") as f:
        region = mmap.mmap(f.fileno(), 0)
        for offset in range(0, len(region) - 7, 8):
            if struct.unpack_from("<Q", region, offset)[0] in values:
                struct.pack_into("<Q", region, offset, 0)
                zeroed += 1
        region.close()
    return zeroed
