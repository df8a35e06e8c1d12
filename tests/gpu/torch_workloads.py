"""PyTorch workloads of the GPU suite (tests/gpu/suite.py starts them, under libvgpu.so or not).

Each prints JSON lines on stdout, one per measurement, flushed; wall times are time.time() (the suite slices its
NVML samples of the SM clock by them). Nothing here reads NVML: the suite samples it from outside the shim.

  mem [--hold S]                        memory views and allocation until OutOfMemoryError (run under a cap)
  compute --which W[,W..] [--seconds S] [--ready F --go F]
                                        W: mm8192 (bf16 8192x8192 matmul), mm2048 (fp32 2048x2048 matmul, TF32
                                        off: PyTorch's default), add (x.add_(1) on 1M fp32 elements)
  overhead [--samples N]                synchronous tiny-op latency and launch rate of a tiny op
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def smi_view() -> dict:
    """nvidia-smi's memory view from inside this process's environment (under the shim when LD_PRELOAD is set)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,memory.used,memory.free",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        first = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
        parts = [p.strip() for p in first.split(",")]
        if done.returncode == 0 and len(parts) == 3:
            return {"total_mib": int(parts[0]), "used_mib": int(parts[1]), "free_mib": int(parts[2])}
        return {"error": f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-300:]}"}
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as failure:
        return {"error": repr(failure)[:300]}


def pynvml_view() -> dict:
    """NVML's memory view through pynvml in this process (the shim's NVML hooks, when preloaded)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        return {"total_mib": info.total >> 20, "used_mib": info.used >> 20, "free_mib": info.free >> 20}
    except Exception as failure:  # noqa: BLE001 - a view that fails is reported, not fatal
        return {"error": repr(failure)[:300]}


def memory(args) -> None:
    free, total = torch.cuda.mem_get_info()
    emit(event="start", torch=torch.__version__, torch_cuda=torch.version.cuda,
         alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), limit=os.environ.get("CUDA_DEVICE_MEMORY_LIMIT"),
         mem_get_info_free_mib=free >> 20, mem_get_info_total_mib=total >> 20, t=time.time())
    blocks = []
    oom_message = None
    allocated = 0
    for chunk in (256 << 20, 16 << 20):  # big steps, then closer to the cap
        try:
            while True:
                blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
                allocated += chunk
        except torch.OutOfMemoryError as error:
            if oom_message is None:
                oom_message = str(error).strip().splitlines()[0][:400]
    free_full, total_full = torch.cuda.mem_get_info()
    emit(event="holding", t=time.time(), oom=oom_message is not None, oom_message=oom_message,
         allocated_mib=allocated >> 20, reserved_mib=torch.cuda.memory_reserved() >> 20,
         mem_get_info_free_mib=free_full >> 20, mem_get_info_total_mib=total_full >> 20,
         nvidia_smi_under_shim=smi_view(), pynvml_under_shim=pynvml_view())
    time.sleep(args.hold)  # the suite samples the host's view of this process meanwhile
    emit(event="released", t=time.time())
    del blocks
    torch.cuda.empty_cache()
    recovered = False
    try:
        again = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        again.fill_(1)
        torch.cuda.synchronize()
        recovered = True
        del again
    except torch.OutOfMemoryError:
        pass
    emit(event="end", recovered_1gib_after_oom=recovered, t=time.time())


def make_workload(which: str):
    """(name, step, launches per step, warm-up steps, description)."""
    if which == "mm8192":
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        c = torch.empty_like(a)
        return (lambda: torch.matmul(a, b, out=c)), 1, 5, "bf16 matmul 8192x8192x8192"
    if which == "mm2048":
        torch.backends.cuda.matmul.allow_tf32 = False
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.float32)
        b = torch.randn_like(a)
        c = torch.empty_like(a)
        return (lambda: torch.matmul(a, b, out=c)), 4, 20, "fp32 matmul 2048x2048x2048 (TF32 off)"
    if which == "add":
        x = torch.zeros(1 << 20, device="cuda", dtype=torch.float32)
        return (lambda: x.add_(1)), 64, 200, "x.add_(1), 1M fp32 elements"
    raise SystemExit(f"torch_workloads: unknown workload {which!r}; expected mm8192, mm2048 or add")


def compute(args) -> None:
    emit(event="start", torch=torch.__version__, torch_cuda=torch.version.cuda,
         sm_limit=os.environ.get("CUDA_DEVICE_SM_LIMIT"), t=time.time())
    for which in args.which.split(","):
        step, batch, warmups, description = make_workload(which)
        for _ in range(warmups):
            step()
        torch.cuda.synchronize()
        if args.ready:
            with open(args.ready, "w") as marker:
                marker.write(str(os.getpid()))
            give_up = time.time() + 120
            while not os.path.exists(args.go) and time.time() < give_up:
                time.sleep(0.002)
        start = time.time()
        n = 0
        while True:
            for _ in range(batch):
                step()
            n += batch
            if time.time() - start >= args.seconds:
                break
        launched = time.time()
        torch.cuda.synchronize()
        end = time.time()
        emit(event="result", workload=which, description=description, ops=n, t_start=start, t_launched=launched,
             t_end=end, elapsed_s=end - start, ops_per_s=n / (end - start))


def overhead(args) -> None:
    emit(event="start", torch=torch.__version__, t=time.time())
    x = torch.zeros(1, device="cuda", dtype=torch.float32)
    for _ in range(200):
        x.add_(1)
    torch.cuda.synchronize()
    latencies = []
    clock = time.perf_counter_ns
    for _ in range(args.samples):
        begin = clock()
        x.add_(1)
        torch.cuda.synchronize()
        latencies.append(clock() - begin)
    latencies.sort()
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        begin = clock()
        for _ in range(args.launches):
            x.add_(1)
        torch.cuda.synchronize()
        rates.append(args.launches / ((clock() - begin) / 1e9))
    emit(event="result", sync_op_median_us=statistics.median(latencies) / 1000,
         sync_op_p10_us=latencies[len(latencies) // 10] / 1000, sync_op_p90_us=latencies[len(latencies) * 9 // 10] / 1000,
         samples=len(latencies), launch_rate_per_s=statistics.median(rates), launch_rates=rates, launches=args.launches,
         t=time.time())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("mem")
    mem.add_argument("--hold", type=float, default=1.5)
    comp = sub.add_parser("compute")
    comp.add_argument("--which", default="mm8192,mm2048,add")
    comp.add_argument("--seconds", type=float, default=3.0)
    comp.add_argument("--ready")
    comp.add_argument("--go")
    over = sub.add_parser("overhead")
    over.add_argument("--samples", type=int, default=3000)
    over.add_argument("--launches", type=int, default=10000)
    args = parser.parse_args()
    {"mem": memory, "compute": compute, "overhead": overhead}[args.command](args)


if __name__ == "__main__":
    main()
