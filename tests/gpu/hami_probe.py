"""Issue 21 on a GPU: what HAMi's vGPU monitor would read from a capped PyTorch job's cache file, sampled every half
second beside the host's view (nvidia-smi), and HAMi's block (recent_kernel = -1) written as its monitor writes it.

    python3 tests/gpu/hami_probe.py --shim LIBVGPU --out DIR [--seconds 14] [--block-at 5] [--block-for 3]

Starts `torch_workloads.py compute --which mm8192` under the shim (16 GiB, 40 %, force, a cache file of its own),
samples, writes -1 at --block-at seconds and 0 again --block-for seconds later, and prints one JSON line per sample
(also to DIR/hami_samples.jsonl): HAMi's reading (tests/python/hami_reader.py), recent_kernel, the job's memory by
nvidia-smi and the GPU's utilization by nvidia-smi.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "python"))
from hami_reader import OFF_RECENT_KERNEL, read_as_hami_monitor  # noqa: E402


def smi(query: str, *extra: str) -> list[list[str]]:
    done = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits", *extra],
                          capture_output=True, text=True, timeout=30)
    return [[part.strip() for part in line.split(",")] for line in done.stdout.strip().splitlines() if line.strip()]


def write_recent_kernel(cache: Path, value: int) -> None:
    with open(cache, "r+b") as f:  # as HAMi's monitor: one int32 stored into the file, no lock
        f.seek(OFF_RECENT_KERNEL)
        f.write(struct.pack("<i", value))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shim", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=14)
    parser.add_argument("--block-at", type=float, default=5)
    parser.add_argument("--block-for", type=float, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path("/tmp/vgpu-hami-probe/job.cache")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.unlink(missing_ok=True)
    env = dict(os.environ, LD_PRELOAD=args.shim, CUDA_DEVICE_MEMORY_LIMIT="16384m", CUDA_DEVICE_SM_LIMIT="40",
               GPU_CORE_UTILIZATION_POLICY="force", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBCUDA_LOG_LEVEL="2")
    job_out = open(out / "hami_job.jsonl", "w")
    job_err = open(out / "hami_job.stderr", "w")
    job = subprocess.Popen([sys.executable, str(REPO / "tests" / "gpu" / "torch_workloads.py"), "compute", "--which",
                            "mm8192", "--seconds", str(args.seconds)], env=env, stdout=job_out, stderr=job_err)
    start, blocked, lifted = time.time(), False, False
    samples = open(out / "hami_samples.jsonl", "w")
    while job.poll() is None:
        time.sleep(0.5)
        t = time.time() - start
        if not blocked and t >= args.block_at and cache.exists():
            write_recent_kernel(cache, -1)
            blocked = True
        if blocked and not lifted and t >= args.block_at + args.block_for:
            write_recent_kernel(cache, 0)
            lifted = True
        sample: dict = {"t": round(t, 2), "blocked": blocked and not lifted}
        if cache.exists():
            try:
                sample["hami"] = [asdict(view) for view in read_as_hami_monitor(cache)]
                sample["recent_kernel"] = struct.unpack_from("<i", cache.read_bytes(), OFF_RECENT_KERNEL)[0]
            except (AssertionError, OSError, struct.error) as failure:
                sample["hami_error"] = repr(failure)
        apps = smi("compute-apps=pid,used_memory")
        sample["smi_job_mib"] = [int(row[1]) for row in apps if len(row) == 2 and row[0] == str(job.pid)]
        sample["smi_gpu_util"] = [int(row[0]) for row in smi("gpu=utilization.gpu")]
        line = json.dumps(sample)
        print(line, flush=True)
        samples.write(line + "\n")
    print(json.dumps({"job_exit": job.returncode}), flush=True)
    return 0 if job.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
