"""Throughput and per-kernel GPU time of a bf16 matmul, with the SM clock NVML reports: tells a cap that holds GPU
time apart from a kernel that runs faster when the GPU is less loaded (boost clocks). Prints one JSON line."""
import json
import sys
import time

import pynvml
import torch

size = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
for _ in range(5):
    a @ b
torch.cuda.synchronize()
timed = []
clocks = []
start = time.time()
n = 0
while time.time() - start < seconds:
    if n % 16 == 0:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        a @ b
        end.record()
        timed.append((begin, end))
        clocks.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    else:
        a @ b
    n += 1
torch.cuda.synchronize()
elapsed = time.time() - start
kernel_ms = sorted(begin.elapsed_time(end) for begin, end in timed)
print(json.dumps({"size": size, "matmuls_per_s": n / elapsed, "median_kernel_ms": kernel_ms[len(kernel_ms) // 2],
                  "median_sm_clock_mhz": sorted(clocks)[len(clocks) // 2],
                  "busy_fraction": n * kernel_ms[len(kernel_ms) // 2] / 1000 / elapsed}))
