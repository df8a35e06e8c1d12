"""What a PyTorch workload's kernels really ran, from the driver's own records (CUPTI, through torch.profiler),
beside NVML's utilization over the same seconds (issue 6: what NVML counts for microsecond kernels is the open
question behind the `x.add_` and bf16 figures in docs/results-gpu.md).

Run it under libvgpu.so with a cap, or without. It warms the workload up, then, profiled, runs it for --seconds and
synchronizes; it prints one JSON line:

  kernels, kernel_us_median/mean   the kernels CUPTI recorded and their durations
  busy_s, busy_fraction            the union of their intervals, over the span from the first kernel's start to the
                                   last one's end (the device time the workload's kernels held, exactly)
  wall_s, ops, ops_per_s           the host's view of the same run
  nvml_util_mean, nvml_samples     nvmlDeviceGetUtilizationRates over the run, sampled by a child process that runs
                                   without LD_PRELOAD (the host's own NVML, not the shim's view);
  nvml_util_mean_after_1s          the same without the first second's samples

  python3 tests/gpu/kernel_time_probe.py --which add --seconds 3
  LD_PRELOAD=build/lib/libvgpu.so CUDA_DEVICE_SM_LIMIT=30 GPU_CORE_UTILIZATION_POLICY=force \\
      python3 tests/gpu/kernel_time_probe.py --which add --seconds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SAMPLER = r"""
import sys, time, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
period = float(sys.argv[1])
while True:
    t = time.time()
    try:
        util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
    except pynvml.NVMLError:
        util = None
    print(f"{t:.6f} {util}", flush=True)
    time.sleep(period)
"""


def start_sampler(period_s: float) -> subprocess.Popen | None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    try:
        return subprocess.Popen([sys.executable, "-c", SAMPLER, str(period_s)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def stop_sampler(sampler: subprocess.Popen | None) -> list[tuple[float, float]]:
    """The (time, utilization %) samples the child took."""
    if sampler is None:
        return []
    sampler.terminate()
    out, _ = sampler.communicate(timeout=10)
    samples = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] != "None":
            samples.append((float(parts[0]), float(parts[1])))
    return samples


def mean_between(samples: list[tuple[float, float]], t0: float, t1: float) -> tuple[float | None, int]:
    chosen = [util for t, util in samples if t0 <= t <= t1]
    return (round(statistics.fmean(chosen), 2) if chosen else None), len(chosen)


def make_step(which: str, torch):
    if which == "add":
        x = torch.zeros(1 << 20, device="cuda", dtype=torch.float32)
        return lambda: x.add_(1), 64
    if which == "mm8192":
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b, c = torch.randn_like(a), torch.empty_like(a)
        return lambda: torch.matmul(a, b, out=c), 1
    if which == "mm2048":
        torch.backends.cuda.matmul.allow_tf32 = False
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.float32)
        b, c = torch.randn_like(a), torch.empty_like(a)
        return lambda: torch.matmul(a, b, out=c), 4
    raise SystemExit(f"kernel_time_probe: --which {which!r}: expected add, mm8192 or mm2048")


def kernel_intervals(profile) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU kernel the profiler recorded."""
    intervals = []
    for event in profile.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA") and event.time_range.end > event.time_range.start:
            intervals.append((float(event.time_range.start), float(event.time_range.end)))
    return sorted(intervals)


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, open_start, open_end = 0.0, None, None
    for start, end in intervals:
        if open_end is None or start > open_end:
            if open_end is not None:
                total += open_end - open_start
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_end is not None:
        total += open_end - open_start
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--which", default="add", help="add, mm8192 or mm2048 (as tests/gpu/torch_workloads.py)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--nvml-period", type=float, default=0.02, help="seconds between NVML samples")
    args = parser.parse_args()
    if not 0.1 <= args.seconds <= 60:
        print(f"kernel_time_probe: --seconds {args.seconds}: expected 0.1 to 60", file=sys.stderr)
        return 2

    import torch
    from torch.profiler import ProfilerActivity, profile

    step, batch = make_step(args.which, torch)
    for _ in range(4 * batch):
        step()
    torch.cuda.synchronize()
    sampler = start_sampler(args.nvml_period)
    time.sleep(1.5)  # NVML's first samples cover the time before the run: let it start sampling, idle
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.time()
        ops = 0
        while time.time() - t0 < args.seconds:
            for _ in range(batch):
                step()
            ops += batch
        torch.cuda.synchronize()
        t1 = time.time()
    samples = stop_sampler(sampler)
    # A sample covers NVML's own period before it (up to a second): those in the first second may reach back
    # into the idle time before the run, so the mean is also given without them.
    nvml_mean, nvml_samples = mean_between(samples, t0, t1)
    nvml_late, _ = mean_between(samples, t0 + 1.0, t1)
    intervals = kernel_intervals(prof)
    durations = [end - start for start, end in intervals]
    span_us = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    busy_us = union_us(intervals)
    print(json.dumps({
        "which": args.which, "sm_limit": os.environ.get("CUDA_DEVICE_SM_LIMIT"),
        "preload": os.environ.get("LD_PRELOAD", ""), "ops": ops, "wall_s": round(t1 - t0, 4),
        "ops_per_s": round(ops / (t1 - t0), 1), "kernels": len(intervals),
        "kernel_us_median": round(statistics.median(durations), 3) if durations else None,
        "kernel_us_mean": round(statistics.fmean(durations), 3) if durations else None,
        "span_s": round(span_us / 1e6, 4), "busy_s": round(busy_us / 1e6, 4),
        "busy_fraction": round(busy_us / span_us, 4) if span_us else None,
        "nvml_util_mean": nvml_mean, "nvml_util_mean_after_1s": nvml_late, "nvml_samples": nvml_samples}),
          flush=True)
    return 0 if intervals else 1


if __name__ == "__main__":
    sys.exit(main())
