"""A CuPy job for scenarios (scenarios/cupy-beside-tenant.yaml): a training-like loop of elementwise kernels and a
reduction on a 64 MiB array, synchronising every step, until it is stopped (SIGTERM at its `stop`) or, given
--seconds N, for N seconds. It allocates through CuPy's memory pool, so the container's memory shows the pool.

Run alone: python3 scenarios/programs/cupy_loop.py --seconds 2 (on a GPU, or on fakecuda with LD_LIBRARY_PATH set).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default: until stopped)")
    parser.add_argument("--elements", type=int, default=1 << 24, help="array length, float32 (default 2^24)")
    args = parser.parse_args()
    if args.seconds < 0 or args.elements < 1:
        parser.error(f"--seconds {args.seconds} / --elements {args.elements}: expected >= 0 / >= 1")
    import cupy as cp

    x = cp.ones(args.elements, dtype=cp.float32)
    end = time.monotonic() + args.seconds if args.seconds else None
    steps = 0
    while end is None or time.monotonic() < end:
        for _ in range(4):
            x = x * 0.5 + 1.0          # elementwise kernels, compiled by NVRTC on first use
        total = x.sum()                # a reduction
        cp.cuda.Device().synchronize()
        steps += 1
    print(f"{steps} steps, sum {float(total):.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
