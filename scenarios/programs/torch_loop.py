"""A PyTorch job for scenarios: a training-like loop (a linear layer's forward and backward on a batch, an SGD step:
cuBLAS matmuls, elementwise kernels, PyTorch's caching allocator), synchronising every step, until it is stopped
(SIGTERM at its `stop`) or, given --seconds N, for N seconds. tests/python/test_pytorch.py runs it in a scenario
beside vgpu-tenant (PyTorch is not in CI: bash .ci/nightly-torch).

Run alone: python3 scenarios/programs/torch_loop.py --seconds 2 (on a GPU, or on fakecuda with LD_LIBRARY_PATH set).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default: until stopped)")
    parser.add_argument("--width", type=int, default=2048, help="the layer's width and the batch (default 2048)")
    args = parser.parse_args()
    if args.seconds < 0 or args.width < 1:
        parser.error(f"--seconds {args.seconds} / --width {args.width}: expected >= 0 / >= 1")
    import torch

    layer = torch.nn.Linear(args.width, args.width).cuda()
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    batch = torch.ones(args.width, args.width, device="cuda")
    end = time.monotonic() + args.seconds if args.seconds else None
    steps = 0
    while end is None or time.monotonic() < end:
        optimizer.zero_grad()
        loss = layer(batch).relu().mean()
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        steps += 1
    print(f"{steps} steps", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
