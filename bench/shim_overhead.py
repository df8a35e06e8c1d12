#!/usr/bin/env python3
"""Prints what libvgpu.so adds to driver calls over fakecuda: the same Google Benchmark binary run three times,
without the shim, with the shim and no limit, and with a limit that does not bind; medians and ratios.

    python3 bench/shim_overhead.py [--build build/default] [--repetitions 5] [--shim path/to/libvgpu.so]

--shim measures another libvgpu.so over the same fakecuda and benchmark binary (an older commit's, to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCHMARKS = "DriverLaunchKernel|DriverMemAllocFree|DriverMemGetInfo"


def run(binary: Path, env: dict[str, str], repetitions: int) -> dict[str, float]:
    command = [str(binary), f"--benchmark_filter={BENCHMARKS}", f"--benchmark_repetitions={repetitions}",
               "--benchmark_report_aggregates_only=true", "--benchmark_format=json"]
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    medians = {}
    for row in json.loads(output)["benchmarks"]:
        if row.get("aggregate_name") == "median":
            medians[row["run_name"]] = row["real_time"]
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build/default", help="CMake build folder (default: build/default)")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--shim", help="the libvgpu.so to measure (default: the build's)")
    args = parser.parse_args()
    build = Path(args.build).resolve()
    binary = build / "bin" / "fakecuda_bench"
    shim = Path(args.shim).resolve() if args.shim else build / "lib" / "libvgpu.so"
    for needed in (binary, shim):
        if not needed.exists():
            print(f"shim_overhead: {needed} is missing; build the default preset first", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as scratch:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_DEVICE_", "FAKECUDA_", "LD_PRELOAD"))}
        base["LD_LIBRARY_PATH"] = str(build / "lib")
        configurations = {
            "no shim": base,
            "shim, no limit": {**base, "LD_PRELOAD": str(shim)},
            "shim, 70Gi limit": {**base, "LD_PRELOAD": str(shim), "CUDA_DEVICE_MEMORY_LIMIT": "70Gi",
                                 "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{scratch}/region"},
            # What the compute launch path adds (admission, measurement windows, settlement) when it never holds a
            # launch back: the `disable` policy measures and publishes but never waits. (A 99 % `force` cap binds in
            # this benchmark: its back-to-back 1 us launches keep the fake GPU's stream busy all the time, and the
            # figure would be the cap's waits, not the path's cost.)
            "shim, compute measured": {**base, "LD_PRELOAD": str(shim), "CUDA_DEVICE_SM_LIMIT": "99",
                                       "GPU_CORE_UTILIZATION_POLICY": "disable",
                                       "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{scratch}/region-compute"},
        }
        results = {name: run(binary, env, args.repetitions) for name, env in configurations.items()}
    names = sorted(results["no shim"])
    print(f"{'benchmark (median ns)':<22}" + "".join(f"{name:>23}" for name in configurations)
          + f"{'ratio mem':>11}{'ratio compute':>15}")
    for bench in names:
        row = [results[name].get(bench, float("nan")) for name in configurations]
        print(f"{bench:<22}" + "".join(f"{value:>23.1f}" for value in row) + f"{row[2] / row[0]:>11.3f}{row[3] / row[0]:>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
