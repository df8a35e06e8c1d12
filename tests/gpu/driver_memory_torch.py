"""Where a PyTorch process's device memory goes that no allocation call asked for (issue 19): NVML's figure for this
process after each stage, beside the caching allocator's reserved bytes. CUDA_MODULE_LOADING decides lazy or eager.
usage: driver_memory_torch.py   (prints STAGE lines as JSON, then a RESULT line)"""
import json
import os
import time

import pynvml
import torch

MiB = 2**20
pynvml.nvmlInit()
torch.cuda.init()
handle = None


def own_mib():
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == os.getpid():
            return p.usedGpuMemory / MiB
    return 0.0


stages = []


def stage(name):
    torch.cuda.synchronize()
    own = own_mib()
    reserved = torch.cuda.memory_reserved(0) / MiB
    last = stages[-1]["nvml_MiB"] if stages else 0.0
    stages.append({"stage": name, "nvml_MiB": own, "delta_MiB": own - last, "torch_reserved_MiB": reserved,
                   "driver_own_MiB": own - reserved})
    print("STAGE " + json.dumps(stages[-1]), flush=True)


torch.cuda.set_device(0)
torch.cuda.current_blas_handle  # noqa (attribute only)
handle = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + str(torch.cuda.get_device_properties(0).uuid))
torch.cuda.mem_get_info(0)
stage("context")
a = torch.empty(1024 * 1024, device="cuda")
stage("torch.empty 4 MiB (no kernel)")
z = torch.zeros(1, device="cuda")
stage("first kernel: torch.zeros(1)")
b = a + 1.0
stage("elementwise add")
c = torch.sin(a) * torch.exp(a)
stage("sin, exp, mul")
m = torch.randn(1024, 1024, device="cuda")
stage("randn")
mm = m @ m
stage("fp32 matmul 1024 (cuBLAS)")
h = m.half() @ m.half()
stage("fp16 matmul 1024")
bf = m.bfloat16() @ m.bfloat16()
stage("bf16 matmul 1024")
x = torch.randn(8, 64, 56, 56, device="cuda")
conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
y = conv(x)
stage("conv2d (cuDNN)")
s = torch.softmax(m, dim=1).sum() + torch.nn.functional.layer_norm(m, (1024,)).sum()
stage("softmax, layer_norm, sum")
for fn in (torch.tanh, torch.sigmoid, torch.relu, torch.log1p, torch.sqrt, torch.cumsum, torch.sort, torch.topk,
           torch.argmax, torch.unique):
    try:
        if fn in (torch.cumsum,):
            fn(m, 0)
        elif fn is torch.topk:
            fn(m, 5)
        else:
            fn(m.abs())
    except Exception as e:  # noqa
        print("skip", fn.__name__, e)
stage("ten more ops (tanh .. unique)")
t0 = time.perf_counter()
for _ in range(200):
    own_mib()
read_us = (time.perf_counter() - t0) / 200 * 1e6
print("RESULT " + json.dumps({"loading": os.environ.get("CUDA_MODULE_LOADING", "(unset: lazy)"),
                              "pynvml_read_us": round(read_us, 1), "stages": stages}), flush=True)
