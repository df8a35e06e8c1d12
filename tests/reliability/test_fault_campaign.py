"""Fault campaign (issue 7): fakecuda injects errors, slow calls, NVML failures and NVML garbage into every driver
and NVML call the shim makes, one call at a time, under real client processes; each run shows that the shim does not
crash, does not hang, hands the client the injected error where the call is the client's own, and keeps enforcing
its limits afterwards.

How it knows:
- CALLS below is every function the shim reaches the driver or NVML with. Two checks keep it honest: it must equal
  the shim's one table (vgpu-core/hooks/hook_table.h), and the shim's sources must reach no driver or NVML function
  except through that table (Real::name). A new call the campaign does not cover fails them.
- Faults are counted from what fakecuda did, not from the plan: FAKECUDA_FAULT_LOG has one line per injected fault
  (call, rule, the call's number). The test predicts which calls a rule hits from FAKECUDA_SEED with the documented
  generator (SplitMix64 from seed ^ FNV-1a(CALL)) and checks the record against it.
- Propagation: for the client's own calls (the hooks), the calls the record says were hit are exactly the calls the
  client saw fail, with the injected code.
- Enforcement, memory: after the faults, an allocation past the limit is refused, and the client fills up to the
  refusal while a shim-less observer reads the process's real device memory from fakecuda's NVML: at most the limit.
- Enforcement, compute: with faults on the calls the shim measures kernels with (events) and admits launches with,
  the share of GPU time the fakecuda trace shows stays at or under the cap; with NVML failing or lying, a `default`
  container still gives the GPU back when another container arrives.

Deterministic (each run's FAKECUDA_SEED is chosen here) and bounded: about 115 short processes, 0.2-3.5 s each;
`pytest -s tests/reliability/test_fault_campaign.py` takes about 75 s on 2 cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fakegpu_harness import CLIENTS_DIR, FakeGpu, read_trace

REPO_ROOT = Path(__file__).resolve().parents[2]
HOOK_TABLE = REPO_ROOT / "vgpu-core" / "hooks" / "hook_table.h"
SHIM_SOURCES = [REPO_ROOT / "vgpu-core" / folder for folder in ("hooks", "region", "policy")]
MIB = 1 << 20
GIB = 1 << 30

CUDA_ERROR = "CUDA_ERROR_ECC_UNCORRECTABLE"   # never one the shim makes up itself
CUDA_ERROR_CODE = 214
NVML_ERROR = "NVML_ERROR_GPU_IS_LOST"
NVML_ERROR_CODE = 15
OUT_OF_MEMORY = 2
NVML_UNKNOWN = 999


# ---- the calls -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """One function the shim calls in the driver (libcuda.so.1) or NVML (libnvidia-ml.so.1).

    role: "hook"   the client's own call, forwarded by the shim's hook of the same name (its error must reach the
                   client unchanged);
          "helper" a call the shim makes on its own (to name a device, measure a context or a kernel, read NVML);
          "legacy" a CUDA 2.x/3.0 entry point: refused under a limit without reaching the driver, forwarded without;
          "resolved" looked up with the table, called nowhere (checked: no Real::name in the shim's sources).
    scenario: the client program that makes the shim reach it (CLIENT_SOURCE's scenarios)."""

    library: str
    role: str
    scenario: str


def _cuda(role: str, scenario: str) -> Call:
    return Call("libcuda.so.1", role, scenario)


def _nvml(role: str, scenario: str) -> Call:
    return Call("libnvidia-ml.so.1", role, scenario)


CALLS: dict[str, Call] = {
    # hooks: the client's own calls
    "cuInit": _cuda("hook", "memory"),
    "cuGetProcAddress": _cuda("hook", "proc-address"),
    "cuGetProcAddress_v2": _cuda("hook", "proc-address"),
    "cuDevicePrimaryCtxRetain": _cuda("hook", "memory"),
    "cuDevicePrimaryCtxRelease": _cuda("hook", "memory"),
    "cuDevicePrimaryCtxRelease_v2": _cuda("hook", "memory"),
    "cuDevicePrimaryCtxReset": _cuda("hook", "memory"),
    "cuDevicePrimaryCtxReset_v2": _cuda("hook", "memory"),
    "cuCtxCreate_v2": _cuda("hook", "memory"),
    "cuCtxCreate_v3": _cuda("hook", "memory"),
    "cuCtxCreate_v4": _cuda("hook", "memory"),
    "cuCtxDestroy": _cuda("hook", "memory"),
    "cuCtxDestroy_v2": _cuda("hook", "memory"),
    "cuMemAlloc_v2": _cuda("hook", "memory"),
    "cuMemAllocPitch_v2": _cuda("hook", "memory"),
    "cuMemAllocManaged": _cuda("hook", "memory"),
    "cuMemFree_v2": _cuda("hook", "memory"),
    "cuMemAllocAsync": _cuda("hook", "memory"),
    "cuMemAllocAsync_ptsz": _cuda("hook", "memory"),
    "cuMemAllocFromPoolAsync": _cuda("hook", "memory"),
    "cuMemAllocFromPoolAsync_ptsz": _cuda("hook", "memory"),
    "cuMemFreeAsync": _cuda("hook", "memory"),
    "cuMemFreeAsync_ptsz": _cuda("hook", "memory"),
    "cuMemPoolTrimTo": _cuda("hook", "memory"),
    "cuMemPoolDestroy": _cuda("hook", "memory"),
    "cuMemCreate": _cuda("hook", "memory"),
    "cuMemRelease": _cuda("hook", "memory"),
    "cuMemMap": _cuda("hook", "memory"),
    "cuMemUnmap": _cuda("hook", "memory"),
    "cuMemRetainAllocationHandle": _cuda("hook", "memory"),
    "cuArrayCreate_v2": _cuda("hook", "memory"),
    "cuArray3DCreate_v2": _cuda("hook", "memory"),
    "cuArrayDestroy": _cuda("hook", "memory"),
    "cuMipmappedArrayCreate": _cuda("hook", "memory"),
    "cuMipmappedArrayDestroy": _cuda("hook", "memory"),
    "cuCtxSetLimit": _cuda("hook", "memory"),                     # a larger stack is local memory for every thread
    "cuMemGetInfo_v2": _cuda("hook", "memory"),
    "cuDeviceTotalMem_v2": _cuda("hook", "memory"),
    "cuLaunchKernel": _cuda("hook", "launch"),
    "cuLaunchKernel_ptsz": _cuda("hook", "launch"),
    "cuLaunchKernelEx": _cuda("hook", "launch"),
    "cuLaunchKernelEx_ptsz": _cuda("hook", "launch"),
    "cuLaunchCooperativeKernel": _cuda("hook", "launch"),
    "cuLaunchCooperativeKernel_ptsz": _cuda("hook", "launch"),
    "cuGraphLaunch": _cuda("hook", "launch"),
    "cuGraphLaunch_ptsz": _cuda("hook", "launch"),
    # stream captures: counted, so that launches ask nothing while none is in progress
    "cuStreamBeginCapture": _cuda("hook", "launch"),
    "cuStreamBeginCapture_ptsz": _cuda("hook", "launch"),
    "cuStreamBeginCapture_v2": _cuda("hook", "launch"),
    "cuStreamBeginCapture_v2_ptsz": _cuda("hook", "launch"),
    "cuStreamBeginCaptureToGraph": _cuda("hook", "launch"),
    "cuStreamBeginCaptureToGraph_ptsz": _cuda("hook", "launch"),
    "cuStreamEndCapture": _cuda("hook", "launch"),
    "cuStreamEndCapture_ptsz": _cuda("hook", "launch"),
    # synchronize calls: time division keeps the process's work published while a thread waits in one
    "cuCtxSynchronize": _cuda("hook", "memory"),
    "cuCtxSynchronize_v2": _cuda("hook", "memory"),
    "cuStreamSynchronize": _cuda("hook", "memory"),
    "cuStreamSynchronize_ptsz": _cuda("hook", "memory"),
    "cuEventSynchronize": _cuda("hook", "memory"),
    "cuMemAlloc": _cuda("legacy", "legacy"),
    "cuMemAllocPitch": _cuda("legacy", "legacy"),
    "cuMemGetInfo": _cuda("legacy", "legacy"),
    "cuDeviceTotalMem": _cuda("legacy", "legacy"),
    "cuCtxCreate": _cuda("legacy", "legacy"),
    "nvmlInit_v2": _nvml("hook", "nvml-view"),
    "nvmlInitWithFlags": _nvml("hook", "nvml-view"),
    "nvmlDeviceGetMemoryInfo": _nvml("hook", "nvml-view"),
    "nvmlDeviceGetMemoryInfo_v2": _nvml("hook", "nvml-view"),
    # helpers: the shim's own calls
    "cuCtxGetDevice": _cuda("helper", "memory"),                  # which device a charge goes to
    "cuCtxGetCurrent": _cuda("helper", "memory"),                 # the context an allocation dies with
    "cuDevicePrimaryCtxGetState": _cuda("helper", "memory"),      # does a retain create the context
    "cuDeviceGetCount": _cuda("helper", "nvml-view"),             # NVML device -> CUDA ordinal
    "cuDeviceGet": _cuda("helper", "memory"),                     # the device's UUID names it in the region
    "cuDeviceGetUuid_v2": _cuda("helper", "memory"),
    "cuDeviceGetMemPool": _cuda("helper", "memory"),              # the pool a stream-ordered allocation comes from
    "cuMemPoolGetAttribute": _cuda("helper", "memory"),           # the pool's reserved memory, charged
    "cuStreamGetCtx": _cuda("helper", "memory"),                  # a stream's device
    "cuCtxPushCurrent_v2": _cuda("helper", "memory"),
    "cuCtxPopCurrent_v2": _cuda("helper", "memory"),
    "cuArrayGetMemoryRequirements": _cuda("resolved", "-"),
    "cuFuncGetAttribute": _cuda("helper", "launch"),              # a first launch: the kernel's local memory
    "cuCtxGetLimit": _cuda("helper", "memory"),                   # the stack the context reserves now
    "cuDeviceGetAttribute": _cuda("helper", "memory"),            # the threads local memory is reserved for
    "cuEventCreate": _cuda("helper", "compute"),                  # kernels measured with events
    "cuStreamIsCapturing": _cuda("helper", "compute"),
    "cuStreamQuery": _cuda("helper", "compute"),                  # a window opens only on a busy stream
    "cuThreadExchangeStreamCaptureMode": _cuda("helper", "compute"),  # the shim's queries in relaxed capture mode
    "cuEventRecord": _cuda("helper", "compute"),
    "cuEventQuery": _cuda("helper", "compute"),
    "cuEventElapsedTime_v2": _cuda("helper", "compute"),
    "cuMemHostAlloc": _cuda("helper", "compute"),                 # the gate's word (gated measurements)
    "cuMemHostGetDevicePointer_v2": _cuda("helper", "compute"),
    "cuStreamWaitValue32_v2": _cuda("helper", "compute"),         # a measured launch's stream held for the word
    "nvmlDeviceGetUUID": _nvml("helper", "nvml-view"),
    "nvmlDeviceGetIndex": _nvml("helper", "nvml-view"),           # without CUDA in the process
    "nvmlDeviceGetHandleByUUID": _nvml("helper", "memory"),       # a context measured from NVML
    "nvmlDeviceGetUtilizationRates": _nvml("helper", "default-policy"),
    "nvmlDeviceGetSamples": _nvml("helper", "default-policy"),
    "nvmlDeviceGetComputeRunningProcesses_v3": _nvml("helper", "memory"),
}

# Helpers the compute-limited launch path calls on every launch (or on the first): faulted under a compute cap too.
LAUNCH_HELPERS = ["cuStreamIsCapturing", "cuStreamQuery", "cuThreadExchangeStreamCaptureMode", "cuCtxGetDevice", "cuCtxGetCurrent", "cuDeviceGet", "cuDeviceGetUuid_v2",
                  "cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventElapsedTime_v2", "cuMemHostAlloc",
                  "cuMemHostGetDevicePointer_v2", "cuStreamWaitValue32_v2"]
# NVML getters fakecuda can spoil with garbage, as the shim reaches them (scenario of each).
GARBAGE_GETTERS = {"nvmlDeviceGetMemoryInfo": "nvml-view", "nvmlDeviceGetMemoryInfo_v2": "nvml-view",
                   "nvmlDeviceGetUUID": "nvml-view", "nvmlDeviceGetIndex": "nvml-view",
                   "nvmlDeviceGetHandleByUUID": "memory", "nvmlDeviceGetComputeRunningProcesses_v3": "memory",
                   "nvmlDeviceGetUtilizationRates": "default-policy", "nvmlDeviceGetSamples": "default-policy"}
# Hooks the shim also calls on its own, or the client's limit probe calls unrecorded after its recorded calls: the
# record may show hits beyond the client's recorded calls.
ALSO_CALLED_AFTER = {"nvmlInit_v2", "cuMemAlloc_v2", "cuMemFree_v2"}


# ---- the client program (runs under the shim; `python -c CLIENT_SOURCE SCENARIO ROUNDS`) ---------------------

CLIENT_SOURCE = r'''"""The campaign's client: every driver and NVML call the shim hooks, called by a program under the shim, each result
recorded; then (memory) the limit probed while a shim-less observer reads the process's real device memory.

argv[1]: the scenario (memory, nvml-view, launch, compute, legacy, proc-address, pool-destroyed, async-held); argv[2]:
rounds. Prints JSON lines: a {"phase": "filled", ...} line per limit probe, each followed by a wait for a line on stdin
(the last one for end of input) while the test reads the process's real device memory, then {"phase": "done", ...}
with every call's results.
No driver helper the shim calls itself (cuDeviceGet, cuCtxGetCurrent, cuEventQuery, ...) is called here directly,
so that every injected fault the record shows on a helper is one the shim met."""

import ctypes
import json
import os
import sys

MIB = 1 << 20
scenario = sys.argv[1]
rounds = int(sys.argv[2])
limit = int(os.environ.get("CUDA_DEVICE_MEMORY_LIMIT", "0") or 0)
results = {}
views = []  # nvml-view: [total, used, free] of every NVML memory view the client got


def emit(line):
    print(json.dumps(line), flush=True)


def note(api, code):
    results.setdefault(api, []).append(int(code))
    return int(code) == 0


def call(api, result):
    """cuda.bindings' (CUresult, values...): records the code, returns (ok, value)."""
    if not isinstance(result, tuple):
        result = (result,)
    ok = note(api, result[0])
    values = result[1:]
    return ok, (values[0] if len(values) == 1 else values)


libcuda = ctypes.CDLL("libcuda.so.1")  # dlsym through the shim: the hooks, as any C program gets them
c_ptr = ctypes.c_uint64


def raw(api, *args):
    """A call by name (the dlsym route): records the code, returns ok."""
    function = getattr(libcuda, api)
    function.restype = ctypes.c_int
    return note(api, function(*args))


def retain_primary(cu):
    """The primary context made current; retried (a fault the shim meets while charging it refuses it)."""
    for _ in range(4):
        ok, context = call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(cu.CUdevice(0)))
        if ok:
            cu.cuCtxSetCurrent(context)
            return True
    return False


def memory_scenario():
    from cuda.bindings import driver as cu

    device = cu.CUdevice(0)
    state = {"context": None}

    def ensure_context():
        if state["context"] is not None:
            return True
        for _ in range(4):
            ok, context = call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))
            if ok:
                state["context"] = context
                cu.cuCtxSetCurrent(context)
                return True
        return False

    for _ in range(4):
        if call("cuInit", cu.cuInit(0))[0]:
            break
    held = []  # one allocation of each kind per round, kept until the first probe: one counted wrongly shows there
    for _ in range(rounds):
        if not ensure_context():
            continue
        hold(cu, held)
        # A larger stack is charged (local memory for every thread the device holds), then given back.
        if call("cuCtxSetLimit", cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, 2048))[0]:
            call("cuCtxSetLimit", cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, 1024))
        ok, values = call("cuMemGetInfo_v2", cu.cuMemGetInfo())
        if ok:
            views.append([values[1], values[1] - values[0], values[0]])
        ok, total = call("cuDeviceTotalMem_v2", cu.cuDeviceTotalMem(device))
        if ok:
            views.append([total, 0, 0])
        ok, pointer = call("cuMemAlloc_v2", cu.cuMemAlloc(MIB))
        if ok:
            call("cuMemFree_v2", cu.cuMemFree(pointer))
        ok, values = call("cuMemAllocPitch_v2", cu.cuMemAllocPitch(1000, 64, 4))
        if ok:
            call("cuMemFree_v2", cu.cuMemFree(values[0]))
        ok, pointer = call("cuMemAllocManaged", cu.cuMemAllocManaged(MIB, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value))
        if ok:
            call("cuMemFree_v2", cu.cuMemFree(pointer))
        # Stream-ordered: on a stream of its own (the shim asks the stream for its context) and on the default pool.
        ok, stream = call("cuStreamCreate", cu.cuStreamCreate(0))
        stream = stream if ok else cu.CUstream(0)
        ok, pointer = call("cuMemAllocAsync", cu.cuMemAllocAsync(MIB, stream))
        if ok:
            call("cuMemFreeAsync", cu.cuMemFreeAsync(pointer, stream))
        props = cu.CUmemPoolProps()
        props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        ok, pool = call("cuMemPoolCreate", cu.cuMemPoolCreate(props))
        if ok:
            ok, pointer = call("cuMemAllocFromPoolAsync", cu.cuMemAllocFromPoolAsync(MIB, pool, stream))
            if ok:
                call("cuMemFreeAsync", cu.cuMemFreeAsync(pointer, stream))
            # The per-thread-default-stream flavours, by name.
            value = c_ptr()
            if raw("cuMemAllocAsync_ptsz", ctypes.byref(value), ctypes.c_size_t(MIB), ctypes.c_void_p(None)):
                raw("cuMemFreeAsync_ptsz", value, ctypes.c_void_p(None))
            value = c_ptr()
            if raw("cuMemAllocFromPoolAsync_ptsz", ctypes.byref(value), ctypes.c_size_t(MIB),
                   ctypes.c_void_p(int(pool)), ctypes.c_void_p(None)):
                raw("cuMemFreeAsync_ptsz", value, ctypes.c_void_p(None))
            call("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
            raw("cuStreamSynchronize_ptsz", ctypes.c_void_p(None))
            # An event to wait for, made and recorded unrecorded (the shim makes its own events with these calls).
            made, event = cu.cuEventCreate(0)
            if made == cu.CUresult.CUDA_SUCCESS:
                cu.cuEventRecord(event, stream)
                call("cuEventSynchronize", cu.cuEventSynchronize(event))
                cu.cuEventDestroy(event)
            call("cuCtxSynchronize", cu.cuCtxSynchronize())
            raw("cuCtxSynchronize_v2", ctypes.c_void_p(None))
            call("cuMemPoolTrimTo", cu.cuMemPoolTrimTo(pool, 0))
            call("cuMemPoolDestroy", cu.cuMemPoolDestroy(pool))
        if int(stream) != 0:
            cu.cuStreamDestroy(stream)
        # VMM: create, reserve, map, retain, unmap, release.
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        ok, granularity = call("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        granularity = granularity if ok else 2 * MIB
        ok, handle = call("cuMemCreate", cu.cuMemCreate(granularity, prop, 0))
        if ok:
            ok, address = call("cuMemAddressReserve", cu.cuMemAddressReserve(granularity, 0, 0, 0))
            if ok:
                if call("cuMemMap", cu.cuMemMap(address, granularity, 0, handle, 0))[0]:
                    ok, again = call("cuMemRetainAllocationHandle", cu.cuMemRetainAllocationHandle(address))
                    if ok:
                        call("cuMemRelease", cu.cuMemRelease(again))
                    call("cuMemUnmap", cu.cuMemUnmap(address, granularity))
                cu.cuMemAddressFree(address, granularity)
            call("cuMemRelease", cu.cuMemRelease(handle))
        # Arrays.
        desc = cu.CUDA_ARRAY_DESCRIPTOR()
        desc.Width, desc.Height, desc.NumChannels = 256, 256, 1
        desc.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
        ok, array = call("cuArrayCreate_v2", cu.cuArrayCreate(desc))
        if ok:
            call("cuArrayDestroy", cu.cuArrayDestroy(array))
        desc3 = cu.CUDA_ARRAY3D_DESCRIPTOR()
        desc3.Width, desc3.Height, desc3.Depth, desc3.NumChannels = 64, 64, 4, 1
        desc3.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
        ok, array = call("cuArray3DCreate_v2", cu.cuArray3DCreate(desc3))
        if ok:
            call("cuArrayDestroy", cu.cuArrayDestroy(array))
        ok, mipmapped = call("cuMipmappedArrayCreate", cu.cuMipmappedArrayCreate(desc3, 3))
        if ok:
            call("cuMipmappedArrayDestroy", cu.cuMipmappedArrayDestroy(mipmapped))
        # Explicit contexts: v4 through cuda.bindings, v2 and v3 and the destroys by name; the primary stays current.
        ok, context = call("cuCtxCreate_v4", cu.cuCtxCreate(None, 0, device))
        if ok:
            call("cuCtxDestroy_v2", cu.cuCtxDestroy(context))
        for api, args in (("cuCtxCreate_v2", (0, 0)), ("cuCtxCreate_v3", (None, 0, 0, 0))):
            context = ctypes.c_void_p()
            if raw(api, ctypes.byref(context), *args):
                # cuCtxDestroy (v1) is a stub in fakecuda: the context is then destroyed with _v2.
                if api == "cuCtxCreate_v3" or not raw("cuCtxDestroy", context):
                    raw("cuCtxDestroy_v2", context)
        cu.cuCtxSetCurrent(state["context"])
        # An extra retain and its release (v2, then v1 by name): the primary context stays.
        if call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))[0]:
            call("cuDevicePrimaryCtxRelease_v2", cu.cuDevicePrimaryCtxRelease(device))
        if call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(device))[0]:
            raw("cuDevicePrimaryCtxRelease", 0)
    # The limit with the context the rounds ran in (made while faults struck) and what they hold, then resets and
    # the limit again.
    probe_limit(cu, ensure_context, "rounds")
    for release in reversed(held):
        release()
    # A reset destroys the primary context (v2, then v1 by name); a new one is retained for the limit probe.
    if ensure_context():
        call("cuDevicePrimaryCtxReset_v2", cu.cuDevicePrimaryCtxReset(device))
        call("cuDevicePrimaryCtxRelease_v2", cu.cuDevicePrimaryCtxRelease(device))
        state["context"] = None
    if ensure_context():
        raw("cuDevicePrimaryCtxReset", 0)
        call("cuDevicePrimaryCtxRelease_v2", cu.cuDevicePrimaryCtxRelease(device))
        state["context"] = None
    probe_limit(cu, ensure_context, "after-resets", last=True)


def hold(cu, held):
    """8 MiB through each allocation API, kept (with how to give it back): what a fault let through uncounted would
    show as device memory past the limit at the probe."""
    size = 8 * MIB
    ok, pointer = call("cuMemAlloc_v2", cu.cuMemAlloc(size))
    if ok:
        held.append(lambda p=pointer: cu.cuMemFree(p))
    ok, values = call("cuMemAllocPitch_v2", cu.cuMemAllocPitch(2048, size // 2048, 4))
    if ok:
        held.append(lambda p=values[0]: cu.cuMemFree(p))
    ok, pointer = call("cuMemAllocManaged", cu.cuMemAllocManaged(size, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value))
    if ok:
        held.append(lambda p=pointer: cu.cuMemFree(p))
    ok, stream = call("cuStreamCreate", cu.cuStreamCreate(0))
    if ok:
        ok, pointer = call("cuMemAllocAsync", cu.cuMemAllocAsync(size, stream))
        call("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
        if ok:
            held.append(lambda p=pointer, s=stream: (cu.cuMemFreeAsync(p, s),
                                                     call("cuStreamSynchronize", cu.cuStreamSynchronize(s))))
    desc = cu.CUDA_ARRAY_DESCRIPTOR()
    desc.Width, desc.Height, desc.NumChannels = 1024, 2048, 1
    desc.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    ok, array = call("cuArrayCreate_v2", cu.cuArrayCreate(desc))
    if ok:
        held.append(lambda a=array: cu.cuArrayDestroy(a))


def probe_limit(cu, ensure_context, name="probe", last=False):
    """The limit after the faults: an allocation past it is refused, and the container cannot fill past it. Holds
    the fill while the test reads the real device memory (one line on stdin; the last probe waits for its end)."""
    probe = {"context": ensure_context(), "probe": name}
    over = None
    for _ in range(8):  # a fault rule may still fire: only its own error is retried
        result = cu.cuMemAlloc(limit + MIB)
        over = int(result[0])
        if over == 0:
            cu.cuMemFree(result[1])
        if over != INJECTED:
            break
    probe["over_limit"] = over
    held = []
    filled = 0
    for chunk in (64 * MIB, 4 * MIB, 256 << 10):  # up to the refusal, to within 256 KiB of the limit
        refusals = 0
        for _ in range(400):
            result = cu.cuMemAlloc(chunk)
            if int(result[0]) == 0:
                held.append(result[1])
                filled += chunk
            elif int(result[0]) == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                refusals += 1
                if refusals >= 2:
                    break
    probe["filled"] = filled
    probe["pid"] = os.getpid()
    emit({"phase": "filled", **probe})
    if last:
        sys.stdin.read()  # the observer reads this process's real device memory now
    else:
        sys.stdin.readline()
    for pointer in held:
        cu.cuMemFree(pointer)


class NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class NvmlMemoryV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def nvml_view_scenario():
    """NVML first (no CUDA in the process: the device is named from NVML), then with a context and memory held."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")

    def nvml_call(api, *args):
        function = getattr(nvml, api)
        function.restype = ctypes.c_int
        return note(api, function(*args))

    def read_views(handle):
        memory = NvmlMemory()
        if nvml_call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(memory)):
            views.append([memory.total, memory.used, memory.free])
        memory2 = NvmlMemoryV2()
        memory2.version = ctypes.sizeof(NvmlMemoryV2) | (2 << 24)
        if nvml_call("nvmlDeviceGetMemoryInfo_v2", handle, ctypes.byref(memory2)):
            views.append([memory2.total, memory2.used, memory2.free])

    initialized = False
    for _ in range(4):
        if nvml_call("nvmlInit_v2"):
            initialized = True
            break
    for _ in range(2):
        if nvml_call("nvmlInitWithFlags", 0):
            initialized = True
    handle = ctypes.c_void_p()
    if initialized and nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0:
        for _ in range(rounds):
            read_views(handle)
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    ok = retain_primary(cu)
    if ok:
        cu.cuMemAlloc(256 * MIB)
    if handle:
        for _ in range(rounds):
            read_views(handle)
    probe_limit(cu, lambda: ok, "nvml-view", last=True)


def launch_scenario():
    """Every launch path under a compute cap, a short kernel each, rounds times."""
    from cuda.bindings import driver as cu

    sys.path.insert(0, os.environ["VGPU_CLIENTS_DIR"])
    from clientlib import load_spin_kernel

    cu.cuInit(0)
    retain_primary(cu)
    _, function = load_spin_kernel()
    ns = ctypes.c_uint64(20_000)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(ns))
    argument = ctypes.addressof(params)
    ok, stream = call("cuStreamCreate", cu.cuStreamCreate(0))
    # A graph of one kernel, captured from the stream.
    executable = None
    if call("cuStreamBeginCapture_v2",
            cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))[0]:
        call("cuLaunchKernel", cu.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, argument, 0))
        ok, graph = call("cuStreamEndCapture", cu.cuStreamEndCapture(stream))
        executable = cu.cuGraphInstantiate(graph, 0)[1] if ok else None
    # Every other capture entry point, each on a stream of its own holding one launch (fakecuda does not capture into
    # an existing graph: the ToGraph ones answer 801).
    for begin, end, extra in (("cuStreamBeginCapture", "cuStreamEndCapture", ()),
                              ("cuStreamBeginCapture_ptsz", "cuStreamEndCapture_ptsz", ()),
                              ("cuStreamBeginCapture_v2_ptsz", "cuStreamEndCapture_ptsz", (ctypes.c_int(2),)),
                              ("cuStreamBeginCaptureToGraph", "cuStreamEndCapture", "graph"),
                              ("cuStreamBeginCaptureToGraph_ptsz", "cuStreamEndCapture_ptsz", "graph")):
        ok_stream, other = cu.cuStreamCreate(0)
        if extra == "graph":
            target = cu.cuGraphCreate(0)[1]
            extra = (ctypes.c_void_p(int(target)), ctypes.c_void_p(None), ctypes.c_void_p(None), ctypes.c_size_t(0),
                     ctypes.c_int(2))
        if raw(begin, ctypes.c_void_p(int(other)), *extra):
            call("cuLaunchKernel", cu.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, other, argument, 0))
            captured = ctypes.c_void_p()
            raw(end, ctypes.c_void_p(int(other)), ctypes.byref(captured))
        cu.cuStreamDestroy(other)
    config = cu.CUlaunchConfig()
    config.gridDimX = config.gridDimY = config.gridDimZ = 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 32, 1, 1
    config.hStream = stream
    function_pointer = ctypes.c_void_p(int(function))
    for _ in range(rounds):
        call("cuLaunchKernel", cu.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, argument, 0))
        raw("cuLaunchKernel_ptsz", function_pointer, 1, 1, 1, 32, 1, 1, 0, ctypes.c_void_p(None),
            ctypes.c_void_p(argument), ctypes.c_void_p(None))
        call("cuLaunchKernelEx", cu.cuLaunchKernelEx(config, function, argument, 0))
        raw("cuLaunchKernelEx_ptsz", ctypes.c_void_p(config.getPtr()), function_pointer, ctypes.c_void_p(argument),
            ctypes.c_void_p(None))
        call("cuLaunchCooperativeKernel", cu.cuLaunchCooperativeKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, argument))
        raw("cuLaunchCooperativeKernel_ptsz", function_pointer, 1, 1, 1, 32, 1, 1, 0, ctypes.c_void_p(None),
            ctypes.c_void_p(argument))
        if executable is not None:
            call("cuGraphLaunch", cu.cuGraphLaunch(executable, stream))
            raw("cuGraphLaunch_ptsz", ctypes.c_void_p(int(executable)), ctypes.c_void_p(None))
    cu.cuCtxSynchronize()
    emit({"phase": "done", "results": results})


def async_held_scenario():
    """256 MiB from the device's pool on a stream of its own, kept, then the limit probed."""
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    retain_primary(cu)
    ok, stream = call("cuStreamCreate", cu.cuStreamCreate(0))
    call("cuMemAllocAsync", cu.cuMemAllocAsync(256 * MIB, stream))
    call("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
    probe_limit(cu, lambda: True, "async-held", last=True)
    emit({"phase": "done", "results": results})


def pool_destroyed_scenario():
    """512 MiB allocated from a pool of its own, the pool destroyed with the block still allocated (the driver keeps
    the memory until the block is freed), then the limit probed."""
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    retain_primary(cu)
    props = cu.CUmemPoolProps()
    props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = 0
    ok, pool = call("cuMemPoolCreate", cu.cuMemPoolCreate(props))
    ok, stream = call("cuStreamCreate", cu.cuStreamCreate(0))
    ok, pointer = call("cuMemAllocFromPoolAsync", cu.cuMemAllocFromPoolAsync(512 * MIB, pool, stream))
    call("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
    call("cuMemPoolDestroy", cu.cuMemPoolDestroy(pool))
    probe_limit(cu, lambda: True, "pool-destroyed")
    call("cuMemFreeAsync", cu.cuMemFreeAsync(pointer, stream))  # the last block: the pool's memory goes now
    call("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
    probe_limit(cu, lambda: True, "block-freed", last=True)
    emit({"phase": "done", "results": results})


def legacy_scenario():
    """The CUDA 2.x/3.0 entry points, by name (32-bit sizes): refused under a limit, forwarded without one."""
    for _ in range(4):
        if raw("cuInit", 0):
            break
    context = ctypes.c_void_p()
    if not raw("cuCtxCreate", ctypes.byref(context), 0, 0):
        # Under a limit the legacy create is refused: take a current context the usual way.
        raw("cuCtxCreate_v2", ctypes.byref(context), 0, 0)
    for _ in range(rounds):
        pointer, pitch, free, total = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        raw("cuMemAlloc", ctypes.byref(pointer), ctypes.c_uint(MIB))
        raw("cuMemAllocPitch", ctypes.byref(pointer), ctypes.byref(pitch), 1000, 64, 4)
        raw("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total))
        raw("cuDeviceTotalMem", ctypes.byref(total), 0)
    emit({"phase": "done", "results": results})


def proc_address_scenario():
    """cuGetProcAddress(_v2) by name, then the allocation it hands out, past the limit."""
    for _ in range(4):
        if raw("cuInit", 0):
            break
    context = ctypes.c_void_p()
    raw("cuCtxCreate_v2", ctypes.byref(context), 0, 0)
    found = []
    for _ in range(rounds):
        for api in ("cuGetProcAddress_v2", "cuGetProcAddress"):
            pfn = ctypes.c_void_p()
            status = ctypes.c_int()
            args = (b"cuMemAlloc", ctypes.byref(pfn), 12000, ctypes.c_uint64(0))
            if raw(api, *args, *((ctypes.byref(status),) if api.endswith("_v2") else ())) and pfn.value:
                found.append(pfn.value)
    over = None
    if found:
        allocate = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)(found[-1])
        pointer = ctypes.c_uint64()
        over = allocate(ctypes.byref(pointer), limit + MIB)
    emit({"phase": "done", "results": results, "over_limit": over, "resolved": len(found)})


def compute_scenario():
    """1 ms kernels (CAMPAIGN_KERNEL_NS), 4 in flight, for CAMPAIGN_SECONDS: the share of GPU time is read from the
    trace. Only launches and stream synchronizations are called here: the events are the shim's."""
    import time

    from cuda.bindings import driver as cu

    sys.path.insert(0, os.environ["VGPU_CLIENTS_DIR"])
    from clientlib import load_spin_kernel

    cu.cuInit(0)
    retain_primary(cu)
    _, function = load_spin_kernel()
    ns = ctypes.c_uint64(int(os.environ.get("CAMPAIGN_KERNEL_NS", "1000000")))
    params = (ctypes.c_void_p * 1)(ctypes.addressof(ns))
    argument = ctypes.addressof(params)
    ok, stream = call("cuStreamCreate", cu.cuStreamCreate(0))
    # A capture in progress on another stream (relaxed: nothing here may invalidate it) for the whole run: the shim
    # then asks, on every launch, whether the launch's stream is capturing (while none is, it asks nothing).
    capture_stream = None
    if os.environ.get("CAMPAIGN_CAPTURE"):
        capture_stream = cu.cuStreamCreate(0)[1]
        cu.cuStreamBeginCapture(capture_stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    start_ns = time.monotonic_ns()  # CLOCK_MONOTONIC, as fakecuda's trace
    end_ns = start_ns + int(float(os.environ.get("CAMPAIGN_SECONDS", "1.2")) * 1e9)
    launched = refused_in_a_row = 0
    while time.monotonic_ns() < end_ns and refused_in_a_row < 100:  # a launch path that refuses everything: done
        for _ in range(4):
            if call("cuLaunchKernel", cu.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, argument, 0))[0]:
                launched += 1
                refused_in_a_row = 0
            else:
                refused_in_a_row += 1
        call("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
    end_ns = time.monotonic_ns()
    if capture_stream is not None:
        cu.cuStreamEndCapture(capture_stream)
    emit({"phase": "done", "results": results, "launched": launched, "start_ns": start_ns, "end_ns": end_ns})


INJECTED = int(os.environ.get("CAMPAIGN_INJECTED_CODE", "-1"))
{"memory": memory_scenario, "nvml-view": nvml_view_scenario, "launch": launch_scenario, "compute": compute_scenario,
 "pool-destroyed": pool_destroyed_scenario, "async-held": async_held_scenario,
 "legacy": legacy_scenario, "proc-address": proc_address_scenario}[scenario]()
if scenario in ("memory", "nvml-view"):
    emit({"phase": "done", "results": results, "views": views})
'''


# ---- the generator (docs/fakecuda.md, "Fault injection"), to predict which calls a rule hits ---------------------

MASK = (1 << 64) - 1


def fnv1a64(text: str) -> int:
    value = 0xcbf29ce484222325
    for byte in text.encode():
        value = ((value ^ byte) * 0x100000001b3) & MASK
    return value


def splitmix64_at(state: int, index: int) -> int:
    z = (state + index * 0x9e3779b97f4a7c15) & MASK
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK
    return z ^ (z >> 31)


def predicted_hits(call: str, seed: int, prob: float, after: int, count: int, calls: int) -> list[int]:
    """The call numbers (1-based, among the calls the rule matches) that the rule hits, of the first `calls`."""
    hits = []
    for number in range(after + 1, calls + 1):
        if len(hits) >= count:
            break
        if (splitmix64_at(seed ^ fnv1a64(call), number) >> 11) * 2.0 ** -53 < prob:
            hits.append(number)
    return hits


def garbage_value(call: str, seed: int, number: int, index: int) -> int:
    """The `index`-th garbage value of a garbage rule's hit on its `number`-th call (faults.h: GarbageValue)."""
    garbage_seed = splitmix64_at(seed ^ fnv1a64(call) ^ 0x6761726261676521, 0) ^ number
    return splitmix64_at(garbage_seed, index)


def seed_hitting_first_call(call: str, prob: float, after: int = 0) -> int:
    """The smallest seed whose rule on `call` hits its first eligible call: every run injects at least once."""
    seed = 1
    while predicted_hits(call, seed, prob, after, 1, after + 1) != [after + 1]:
        seed += 1
    return seed


# ---- what the campaign measured ------------------------------------------------------------------------------------

TALLY = {"calls_covered": set(), "faults_injected": 0, "processes": 0, "crashes": 0, "hangs": 0,
         "enforcement_lost": 0}


def record_figures(figures) -> None:
    figures.record("faults", calls=sum(1 for call in CALLS.values() if call.role != "resolved"),
                   calls_covered=len(TALLY["calls_covered"]), faults_injected=TALLY["faults_injected"],
                   processes=TALLY["processes"], crashes=TALLY["crashes"], hangs=TALLY["hangs"],
                   enforcement_lost=TALLY["enforcement_lost"])


def read_fault_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hits_by_call(log: list[dict], pid: int | None = None) -> dict[str, list[int]]:
    hits: dict[str, list[int]] = {}
    for line in log:
        if pid is None or line["pid"] == pid:
            hits.setdefault(line["call"], []).append(int(line["n"]))
    return hits


def exited_cleanly(returncode: int, what: str) -> None:
    """A signal death is a crash; anything but 0 is a client that broke."""
    if returncode < 0:
        TALLY["crashes"] += 1
        raise AssertionError(f"{what} died of signal {-returncode}")
    assert returncode == 0, f"{what} exited with {returncode}"


# ---- running a client under the shim with faults ---------------------------------------------------------------------

OBSERVER = """
import ctypes, json
nvml = ctypes.CDLL("libnvidia-ml.so.1")
class Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]
assert nvml.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
infos = (Info * 64)()
count = ctypes.c_uint(64)
assert nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), infos) == 0
print(json.dumps({str(info.pid): info.usedGpuMemory for info in infos[:count.value]}))
"""


class Campaign:
    """One fake machine, a container on it (memory limit, compute cap), and the processes run with fault rules."""

    def __init__(self, fake_gpu: FakeGpu, shim_path: Path, figures, limit: int = 2 * GIB):
        self.gpu = fake_gpu
        self.figures = figures
        self.limit = limit
        self.log_path = fake_gpu.work_dir / "faults.jsonl"
        fake_gpu.env.update({
            "LD_PRELOAD": str(shim_path),
            "CUDA_DEVICE_MEMORY_LIMIT": str(limit),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "container.region"),
            "FAKECUDA_FAULT_LOG": str(self.log_path),
            "VGPU_CLIENTS_DIR": str(CLIENTS_DIR),
        })

    def faults(self, rules: str, seed: int, injected: int = CUDA_ERROR_CODE) -> None:
        self.gpu.env.update({"FAKECUDA_FAULTS": rules, "FAKECUDA_SEED": str(seed),
                             "CAMPAIGN_INJECTED_CODE": str(injected)})

    def log(self, pid: int | None = None) -> list[dict]:
        return [line for line in read_fault_log(self.log_path) if pid is None or line["pid"] == pid]

    def count(self, pids: list[int], covered: set[str] | None = None) -> list[dict]:
        """Adds this run's processes and faults to the figures; returns its record."""
        lines = [line for line in self.log() if line["pid"] in pids]
        TALLY["processes"] += len(pids)
        TALLY["faults_injected"] += len(lines)
        for line in lines:
            if covered is None or line["call"] in covered:
                TALLY["calls_covered"].add(line["call"])
        record_figures(self.figures)
        return lines

    def observer_env(self) -> dict[str, str]:
        env = dict(self.gpu.env)
        for name in ("LD_PRELOAD", "FAKECUDA_FAULTS", "FAKECUDA_FAULT_LOG", "FAKECUDA_TRACE"):
            env.pop(name, None)
        return env

    def real_usage(self, pid: int) -> int:
        """The process's device memory as fakecuda holds it (contexts included), read without the shim."""
        out = subprocess.run([sys.executable, "-c", OBSERVER], env=self.observer_env(), capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return int(json.loads(out.stdout.strip().splitlines()[-1]).get(str(pid), 0))

    def run_client(self, scenario: str, rounds: int = 3, timeout: float = 60) -> tuple[dict, list[dict], int]:
        """Runs the exerciser; for memory and nvml-view, reads the process's real device memory while it holds each
        fill. Returns the client's last line, its "filled" lines (with "real_used") and its pid. A client that does
        not finish is a hang."""
        process = self.gpu.start_py(CLIENT_SOURCE, scenario, str(rounds))
        probes = {"memory": 2, "nvml-view": 1, "pool-destroyed": 2, "async-held": 1}.get(scenario, 0)
        filled = []
        try:
            while len(filled) < probes:
                line = process.next_json(timeout=timeout)
                if line.get("phase") == "filled":
                    line["real_used"] = self.real_usage(process.pid)
                    filled.append(line)
                    if len(filled) < probes:
                        process.popen.stdin.write("\n")
                        process.popen.stdin.flush()
            result = process.finish(timeout=timeout)
        except AssertionError as error:
            if "did not exit" in str(error) or "printed no JSON line within" in str(error):
                TALLY["hangs"] += 1
                record_figures(self.figures)
            elif process.popen.returncode is not None and process.popen.returncode < 0:
                TALLY["crashes"] += 1
                record_figures(self.figures)
            raise
        exited_cleanly(result.returncode, f"{scenario} client under FAKECUDA_FAULTS={self.gpu.env.get('FAKECUDA_FAULTS')}"
                                          f"\n{result.stderr[-3000:]}")
        return result.json, filled, process.pid

    def check_memory_enforced(self, probes: list[dict], what: str) -> None:
        """After the faults: past the limit is refused, and the real device memory never exceeds the limit."""
        for filled in probes:
            lost = filled["over_limit"] != OUT_OF_MEMORY or filled["real_used"] > self.limit
            if lost:
                TALLY["enforcement_lost"] += 1
                record_figures(self.figures)
            assert filled["over_limit"] == OUT_OF_MEMORY, f"{what}: an allocation past the limit returned {filled}"
            assert filled["real_used"] <= self.limit, (
                f"{what}: the process holds {filled['real_used'] / MIB:.0f} MiB of device memory, over its "
                f"{self.limit / MIB:.0f} MiB limit: {filled}")


# ---- the list is the shim's whole list ---------------------------------------------------------------------------

def table_names() -> dict[str, list[str]]:
    text = HOOK_TABLE.read_text()
    tables = {}
    for table in ("VGPU_CUDA_HOOKS", "VGPU_NVML_HOOKS", "VGPU_CUDA_HELPERS", "VGPU_NVML_HELPERS"):
        match = re.search(r"#define " + table + r"\(X\)(.*?)(?:\n[ \t]*\n|\n(?://|namespace))", text, re.S)
        assert match, f"{HOOK_TABLE} no longer defines {table}"
        tables[table] = re.findall(r"\bX\((\w+)\)", match.group(1))
    return tables


def shim_source_text(keep_strings: bool = False) -> str:
    """The shim's C++ with comments (and string literals, unless kept) blanked: a name in a comment is not a call."""
    texts = []
    for folder in SHIM_SOURCES:
        for path in sorted(folder.rglob("*")):
            if path.suffix in (".cc", ".h"):
                text = path.read_text()
                text = re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"',
                              lambda m: m.group(0) if keep_strings and m.group(0).startswith('"') else " ",
                              text, flags=re.S)
                texts.append(text)
    return "\n".join(texts)


# The hooks' forwarding macros take the real function's name as their first argument.
FORWARDING_MACROS = ("VGPU_PASSTHROUGH_UNLESS_LIMITED", "VGPU_LEGACY_REFUSED_UNDER_A_LIMIT", "VGPU_LAUNCH_FUNCTION_CHECK")


def test_the_call_list_is_the_shims_table():
    tables = table_names()
    listed = {name for names in tables.values() for name in names}
    assert listed == set(CALLS), (f"the shim's table and the campaign's CALLS differ: only in the table "
                                  f"{sorted(listed - set(CALLS))}, only in CALLS {sorted(set(CALLS) - listed)}")
    for name in tables["VGPU_NVML_HOOKS"] + tables["VGPU_NVML_HELPERS"]:
        assert CALLS[name].library == "libnvidia-ml.so.1", name
    for name in tables["VGPU_CUDA_HOOKS"]:
        assert CALLS[name].role in ("hook", "legacy"), name


def test_the_shim_reaches_the_driver_only_through_its_table():
    """Every driver or NVML function the shim calls goes through Real::NAME (resolved from the table): a direct call,
    or a lookup by a name of its own (dlsym(handle, "cu...")), would be a call the campaign does not cover. And the
    "resolved" entries are called nowhere."""
    text = shim_source_text()
    referenced = set(re.findall(r"\bReal::((?:cu|nvml)\w+)", text))
    for macro in FORWARDING_MACROS:
        referenced |= set(re.findall(macro + r"\(\s*((?:cu|nvml)\w+)", text))
    unknown = referenced - set(CALLS)
    assert not unknown, f"the shim calls {sorted(unknown)} through Real:: but the campaign does not list them"
    for name, call in CALLS.items():
        if call.role == "resolved":
            assert name not in referenced, f"{name} is called now: give it a scenario in CALLS"
        else:
            assert name in referenced, f"{name} is listed as called but the shim never calls Real::{name}"
    # Any other call of a driver-looking name must be one of the shim's own exported hooks (Bsymbolic: never the
    # driver) or a definition.
    hooks = {name for name, call in CALLS.items() if call.role in ("hook", "legacy")}
    stray = set()
    for match in re.finditer(r"(?<![\w:.>])((?:cu|nvml)[A-Z]\w*)\s*\(", text):
        name = match.group(1)
        if name not in hooks:
            stray.add(name)
    assert not stray, f"the shim names {sorted(stray)} outside Real::: a driver call the campaign would miss"
    # No lookup by a name of its own: a driver name in a string literal could only be one (the table's lookups
    # stringify its macro argument, #name).
    literals = re.findall(r'"((?:cu|nvml)[A-Z]\w*)"', shim_source_text(keep_strings=True))
    assert not literals, f"the shim spells driver names {sorted(set(literals))} in strings: a lookup outside the table?"


# ---- errors: every call, one at a time -------------------------------------------------------------------------------

ERROR_RUNS = [name for name, call in CALLS.items()
              if call.role in ("hook", "helper") and call.scenario in ("memory", "nvml-view", "launch", "proc-address")]


def error_rule(name: str, prob: float = 0.6, count: int = 3) -> tuple[str, int, str, int]:
    nvml = CALLS[name].library == "libnvidia-ml.so.1"
    error, code = (NVML_ERROR, NVML_ERROR_CODE) if nvml else (CUDA_ERROR, CUDA_ERROR_CODE)
    seed = seed_hitting_first_call(name, prob)
    return f"{name}:error={error}:prob={prob}:count={count}", seed, error, code


@pytest.mark.parametrize("name", ERROR_RUNS)
def test_an_injected_error_is_propagated_and_the_limits_hold(fake_gpu, shim_path, figures, name):
    """NAME fails (an error the shim never makes up, probability 0.6, at most 3 times, the seed chosen so that its
    first call is hit) while the client runs its scenario: the process lives and exits; the record matches the
    generator; a hook's error reaches the client on exactly the calls that were hit; nothing else the client sees is
    other than a refusal; every memory view is the slice; and afterwards the limit holds (real device memory)."""
    call = CALLS[name]
    campaign = Campaign(fake_gpu, shim_path, figures)
    if call.scenario == "launch":
        fake_gpu.env.update({"CUDA_DEVICE_SM_LIMIT": "50", "GPU_CORE_UTILIZATION_POLICY": "force"})
    rules, seed, error, code = error_rule(name)
    campaign.faults(rules, seed, code)
    line, filled, pid = campaign.run_client(call.scenario)
    log = campaign.count([pid], covered={name})
    hits = hits_by_call(log).get(name, [])
    assert hits, f"{rules} (seed {seed}) injected nothing: the {call.scenario} scenario never made the shim call {name}"
    assert hits == predicted_hits(name, seed, 0.6, 0, 3, max(hits)), (f"the record disagrees with the generator: "
                                                                     f"{hits} (seed {seed})")
    results = line["results"]
    if call.role == "hook":
        # The client's k-th call of NAME is the rule's k-th matching call: it failed, with the injected code, exactly
        # when the record says it was hit.
        mine = results.get(name, [])
        failed = [number for number, result in enumerate(mine, start=1) if result == code]
        expected = [number for number in hits if number <= len(mine)]
        assert failed == expected, (f"{name}: the record hit calls {hits}, the client saw {error} ({code}) on calls "
                                    f"{failed} of {mine}")
        if name not in ALSO_CALLED_AFTER:
            assert max(hits) <= len(mine), f"{name}: hits {hits} beyond the client's {len(mine)} calls"
    # Besides the injected error, a client may see a refusal: out of memory (a device the shim could not name is one
    # no limit can be enforced on), NVML_ERROR_UNKNOWN for an NVML view of a device a failing CUDA call kept the shim
    # from telling (never the whole GPU instead); and fakecuda's own answer 801 (cuCtxDestroy v1 is a stub).
    for api, codes in results.items():
        allowed = {0, code, NVML_UNKNOWN} if api.startswith("nvml") else {0, code, OUT_OF_MEMORY, 801}
        assert set(codes) <= allowed, f"{name}: the client's {api} returned {codes}"
    check_views(line, campaign, name)
    if filled:
        campaign.check_memory_enforced(filled, f"errors on {name}")
    if call.scenario == "proc-address":
        assert line["over_limit"] == OUT_OF_MEMORY, line


@pytest.mark.parametrize("limited", [True, False], ids=["limited", "passthrough"])
def test_the_legacy_entry_points(fake_gpu, shim_path, figures, limited):
    """CUDA 2.x/3.0 calls: refused under a limit without reaching the driver (a fault there is never met); forwarded
    without a limit, the injected error reaching the client."""
    campaign = Campaign(fake_gpu, shim_path, figures)
    if not limited:
        del fake_gpu.env["CUDA_DEVICE_MEMORY_LIMIT"]
    legacy = [name for name, call in CALLS.items() if call.role == "legacy"]
    rules = ";".join(f"{name}:error={CUDA_ERROR}:count=1" for name in legacy)
    campaign.faults(rules, 1)
    line, _, pid = campaign.run_client("legacy", rounds=2)
    log = campaign.count([pid], covered=set(legacy) if not limited else set())
    hits = hits_by_call(log)
    for name in legacy:
        mine = line["results"][name]
        if limited:
            assert name not in hits, f"{name} reached the driver under a limit: {hits}"
            assert set(mine) == {801}, f"{name} under a limit: {mine}"
        else:
            assert hits.get(name) == [1], (name, hits)
            assert mine[0] == CUDA_ERROR_CODE, f"{name}: the injected error did not reach the client: {mine}"


def test_a_pool_destroyed_with_a_block_still_allocated_stays_counted(fake_gpu, shim_path, figures):
    """Regression (found by the campaign: a cuMemFreeAsync that failed left a block in a pool then destroyed): the
    driver keeps a destroyed pool's memory until its last block is freed, and the shim gave the pool's whole charge
    back at the destroy, so the container could fill past its limit by what was still allocated. No faults here."""
    campaign = Campaign(fake_gpu, shim_path, figures)
    line, probes, _ = campaign.run_client("pool-destroyed")
    assert set(code for codes in line["results"].values() for code in codes) == {0}, line["results"]
    campaign.check_memory_enforced(probes, "a pool destroyed with a block allocated")
    # Once the block is freed, the pool's memory is given back: the container can use its whole slice again.
    assert probes[1]["filled"] >= probes[0]["filled"] + 448 * MIB, probes


def test_a_stream_ordered_allocation_whose_pool_cannot_be_found_is_refused(fake_gpu, shim_path, figures):
    """Regression: when cuDeviceGetMemPool failed, cuMemAllocAsync went to the driver uncounted (the next successful
    pool allocation would catch up; a last one never did). It now fails with that error."""
    campaign = Campaign(fake_gpu, shim_path, figures)
    campaign.faults(f"cuDeviceGetMemPool:error={CUDA_ERROR}:count=1", 1)
    line, probes, pid = campaign.run_client("async-held")
    campaign.count([pid], covered={"cuDeviceGetMemPool"})
    assert line["results"]["cuMemAllocAsync"] == [CUDA_ERROR_CODE], line["results"]
    campaign.check_memory_enforced(probes, "cuDeviceGetMemPool failing")


# ---- slow calls -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", ["memory", "nvml-view", "launch"])
def test_slow_calls_change_nothing_but_time(fake_gpu, shim_path, figures, scenario):
    """Every driver and NVML call slowed (2 ms, one call in four, 300 at most): every result the same as without
    faults, and the limits hold."""
    campaign = Campaign(fake_gpu, shim_path, figures)
    if scenario == "launch":
        fake_gpu.env.update({"CUDA_DEVICE_SM_LIMIT": "50", "GPU_CORE_UTILIZATION_POLICY": "force"})
    names = [name for name, call in CALLS.items() if call.scenario == scenario and call.role in ("hook", "helper")]
    if scenario == "launch":
        names += [name for name in LAUNCH_HELPERS if name not in names]
    baseline, _, _ = campaign.run_client(scenario, rounds=2)
    campaign.faults("*:delay_us=2000:prob=0.25:count=300", 3)
    line, filled, pid = campaign.run_client(scenario, rounds=2)
    log = campaign.count([pid], covered=set(names))
    slowed = set(hits_by_call(log)) & set(names)
    assert len(slowed) >= len(names) // 3, f"only {sorted(slowed)} of {names} were slowed"
    assert line["results"] == baseline["results"], "slow calls changed results"
    if filled:
        campaign.check_memory_enforced(filled, f"slow {scenario}")


# ---- NVML garbage ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [name for name, scenario in GARBAGE_GETTERS.items() if scenario != "default-policy"])
def test_nvml_garbage_never_crashes_the_shim_nor_loosens_the_limit(fake_gpu, shim_path, figures, name):
    """The getter succeeds with absurd outputs (used > total, counts above the buffer, unterminated strings, any
    index): the process lives, the NVML view the client gets still shows no more than its slice, and the limit
    holds."""
    campaign = Campaign(fake_gpu, shim_path, figures)
    scenario = GARBAGE_GETTERS[name]
    seed = seed_hitting_first_call(name, 0.7)
    campaign.faults(f"{name}:garbage:prob=0.7:count=6", seed)
    line, filled, pid = campaign.run_client(scenario)
    log = campaign.count([pid], covered={name})
    assert hits_by_call(log).get(name), f"no garbage was served: the {scenario} scenario never reached {name}"
    check_views(line, campaign, name)
    campaign.check_memory_enforced(filled, f"garbage from {name}")


def check_views(line: dict, campaign: Campaign, name: str) -> None:
    """Every memory view the client got (cuMemGetInfo, cuDeviceTotalMem, nvmlDeviceGetMemoryInfo and _v2) shows the
    slice, whatever failed or lied underneath: never the whole GPU."""
    for total, used, free in line.get("views") or []:
        if total > campaign.limit or used > total or free > total - used:
            TALLY["enforcement_lost"] += 1
            record_figures(campaign.figures)
        assert total <= campaign.limit and used <= total and free <= total - used, (
            f"{name}: a view [total, used, free] = {[total, used, free]} is not the slice: {line['views']}")


# ---- compute: faults on the calls that admit and measure launches -------------------------------------------------

CAP = 0.30
SHARE_TOLERANCE = 0.03


GATE_CALLS = ("cuMemHostAlloc", "cuMemHostGetDevicePointer_v2", "cuStreamWaitValue32_v2")
COMPUTE_RUNS = [(name, "sporadic") for name in LAUNCH_HELPERS] + [(name, "persistent") for name in LAUNCH_HELPERS] + [
    ("cuEventQuery", "never-ready"), ("cuEventQuery", "never-ready-sporadic")]


@pytest.mark.parametrize("name,kind", COMPUTE_RUNS, ids=[f"{name}-{kind}" for name, kind in COMPUTE_RUNS])
def test_the_compute_cap_holds_with_faults_on_admission_and_measurement(fake_gpu, shim_path, figures, name, kind):
    """1 ms kernels capped at 30 %: whatever fails among the calls the shim admits and measures launches with
    (sporadically: one call in three, at most 40; persistently: every call), the share of the client's run in which
    its kernels held the GPU (fakecuda's trace) stays at or under the cap; a launch the shim cannot admit, or cannot
    measure while the kernel's cost is unknown, fails with the injected error rather than running unadmitted."""
    campaign = Campaign(fake_gpu, shim_path, figures)
    trace_path = fake_gpu.enable_trace()
    # Compute only: the device is then first named in the region by the launch path (without a memory limit a
    # context it could not name is let through, counted nowhere).
    del fake_gpu.env["CUDA_DEVICE_MEMORY_LIMIT"]
    fake_gpu.env.update({"CUDA_DEVICE_SM_LIMIT": "30", "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CAMPAIGN_SECONDS": "1.2"})
    # The launch path asks whether a stream is capturing only while a capture is in progress, and which device a
    # context is on only where the process sees several.
    if name == "cuStreamIsCapturing":
        fake_gpu.env["CAMPAIGN_CAPTURE"] = "1"
    if name == "cuCtxGetDevice":
        fake_gpu.env["FAKECUDA_DEVICES"] = "2*h100-80gb"
    # A measured launch is gated only for a kernel under 250 us (gates.h; kGateBelowNs).
    if name in GATE_CALLS:
        fake_gpu.env["CAMPAIGN_KERNEL_NS"] = "50000"
    error, code = CUDA_ERROR, CUDA_ERROR_CODE
    if kind.startswith("never-ready"):
        error, code = "CUDA_ERROR_NOT_READY", 600
    if kind in ("sporadic", "never-ready-sporadic"):
        rule, seed = f"{name}:error={error}:prob=0.34:count=40", seed_hitting_first_call(name, 0.34)
    else:
        rule, seed = f"{name}:error={error}", 1
    campaign.faults(rule, seed, code)
    line, _, pid = campaign.run_client("compute")
    log = campaign.count([pid], covered={name})
    assert hits_by_call(log).get(name), f"{rule}: the shim never called {name} under a compute cap"
    launches = line["results"]["cuLaunchKernel"]
    assert set(launches) <= {0, code}, f"launches failed with {sorted(set(launches))}"
    events = read_trace(trace_path) if trace_path.exists() else []  # no kernel ran: no trace
    share = busy_between(events, pid, line["start_ns"], line["end_ns"])
    print(f"\n{rule}: {line['launched']} kernels ran, {launches.count(code)} launches refused with {error}, "
          f"share {100 * share:.1f} % (cap {100 * CAP:.0f} %)")
    if share > CAP + SHARE_TOLERANCE:
        TALLY["enforcement_lost"] += 1
        record_figures(figures)
    assert share <= CAP + SHARE_TOLERANCE, f"{rule}: the container's kernels held the GPU {100 * share:.1f} % of the time"


# ---- `default` policy: NVML failing or lying must not keep a container running free ------------------------------

NVML_POLICY_RUNS = [
    ("nvmlInit_v2", "error", "count=1"),                                  # NVML never starts: no lending at all
    ("nvmlDeviceGetHandleByUUID", "error", "after=3"),
    ("nvmlDeviceGetHandleByUUID", "garbage", "after=3"),
    ("nvmlDeviceGetSamples", "error", "after=5"),
    ("nvmlDeviceGetSamples", "garbage", "after=5:count=4"),               # a few lies, then the truth again
    ("nvmlDeviceGetSamples", "garbage", "after=5"),
    ("nvmlDeviceGetUtilizationRates", "garbage", "after=2"),              # with samples unsupported: the fallback
    ("nvmlDeviceGetUtilizationRates", "error", "after=2"),
    ("cuDeviceGetUuid_v2", "error", "after=4"),                           # the device's UUID, asked per reading
]


@pytest.mark.parametrize("name,kind,when", NVML_POLICY_RUNS,
                         ids=[f"{name}-{kind}-{when}" for name, kind, when in NVML_POLICY_RUNS])
def test_a_default_container_gives_the_gpu_back_whatever_nvml_says(fake_gpu, shim_path, figures, name, kind, when):
    """`default` at 30 % runs free while alone; its NVML readings then fail or turn to garbage; a 70 % container
    arrives: within a second the first is back at or under 30 % (it must not keep lending on readings it no longer
    gets)."""
    fault = NVML_ERROR if name.startswith("nvml") else CUDA_ERROR
    rules = f"{name}:{'garbage' if kind == 'garbage' else 'error=' + fault}:{when}"
    if name == "nvmlDeviceGetUtilizationRates":
        rules = f"nvmlDeviceGetSamples:error=NVML_ERROR_NOT_SUPPORTED;{rules}"  # the fallback is then what is read
    run_default_policy_case(fake_gpu, shim_path, figures, name, rules, 11)


def run_default_policy_case(fake_gpu, shim_path, figures, name: str, rules: str, seed: int) -> None:
    if not (fake_gpu.build_dir / "bin" / "vgpu-tenant").exists():
        pytest.skip("vgpu-tenant is not built")
    campaign = Campaign(fake_gpu, shim_path, figures)
    trace_path = fake_gpu.enable_trace()
    del fake_gpu.env["CUDA_DEVICE_MEMORY_LIMIT"]
    fake_gpu.env.update({"CUDA_DEVICE_SM_LIMIT": "30", "GPU_CORE_UTILIZATION_POLICY": "default"})
    campaign.faults(rules, seed)
    lender = fake_gpu.start_tenant("--seconds", "3.4", "--kernel-us", "1000")
    time.sleep(1.2)
    fake_gpu.env.update({"CUDA_DEVICE_SM_LIMIT": "70", "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "arrival.region"),
                         "FAKECUDA_FAULTS": ""})
    arrival = fake_gpu.start_tenant("--seconds", "2.0", "--kernel-us", "1000")
    results = []
    for process in (arrival, lender):
        try:
            results.append(process.finish(timeout=30))
        except AssertionError:
            TALLY["hangs"] += 1
            record_figures(figures)
            raise
    for result in results:
        exited_cleanly(result.returncode, result.describe())
    log = campaign.count([lender.pid, arrival.pid], covered={name})
    assert hits_by_call(log, lender.pid).get(name), f"{rules}: the lender's shim never called {name}"
    events = read_trace(trace_path)
    start = min(int(e["start_ns"]) for e in events if e.get("ev") == "kernel" and e.get("pid") == arrival.pid)
    end = max(int(e["end_ns"]) for e in events if e.get("ev") == "kernel" and e.get("pid") == arrival.pid)
    lender_share = busy_between(events, lender.pid, start + 1_000_000_000, end)
    print(f"\n{rules}: the lender had {100 * lender_share:.1f} % from 1 s after the arrival")
    if lender_share > CAP + 0.05:
        TALLY["enforcement_lost"] += 1
        record_figures(figures)
    assert lender_share <= CAP + 0.05, (f"{rules}: the `default` container kept {100 * lender_share:.1f} % of the GPU "
                                         f"after another container arrived")


def test_one_sample_from_the_future_does_not_blind_a_default_container(fake_gpu, shim_path, figures):
    """Regression: a single NVML utilization sample stamped far in the future moved the shim's cursor past every real
    sample to come; NVML then had nothing newer, the `default` container kept the rate of its last reading -- free --
    and never gave the GPU back. The seed is chosen so that the one garbage answer is of the "future" kind."""
    name = "nvmlDeviceGetSamples"
    # The 10th reading (about 1 s in: lending, before the arrival at 1.2 s) is the garbage one.
    seed = next(s for s in range(1, 10_000) if garbage_value(name, s, 10, 1) % 4 == 1)
    run_default_policy_case(fake_gpu, shim_path, figures, name, f"{name}:garbage:after=9:count=1", seed)


def busy_between(events: list[dict], pid: int, start_ns: int, end_ns: int) -> float:
    intervals = sorted((max(int(e["start_ns"]), start_ns), min(int(e["end_ns"]), end_ns)) for e in events
                       if e.get("ev") == "kernel" and e.get("pid") == pid and int(e["end_ns"]) > start_ns
                       and int(e["start_ns"]) < end_ns)
    busy, reach = 0, start_ns
    for begin, finish in intervals:
        if finish > reach:
            busy += finish - max(begin, reach)
            reach = finish
    return busy / max(end_ns - start_ns, 1)


def test_every_call_met_a_fault(figures):
    """Runs last (file order): every call the shim makes had at least one fault injected on it by the runs above, as
    fakecuda's record shows (a call no scenario reaches would be a hole in the campaign)."""
    if TALLY["processes"] == 0:
        pytest.skip("no campaign run in this session (run the whole file)")
    expected = {name for name, call in CALLS.items() if call.role in ("hook", "helper", "legacy")}
    missing = expected - TALLY["calls_covered"]
    record_figures(figures)
    assert not missing, f"no fault was injected on {sorted(missing)}"
    assert TALLY["crashes"] == 0 and TALLY["hangs"] == 0 and TALLY["enforcement_lost"] == 0, TALLY
