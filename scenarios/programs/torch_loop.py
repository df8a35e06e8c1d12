"""A PyTorch job for scenarios: an inference loop (a two-layer MLP's forward on a batch under torch.no_grad():
cuBLAS matmuls, elementwise kernels, PyTorch's caching allocator), synchronising every few steps, until it is stopped
(SIGTERM at its `stop`) or, given --seconds N, for N seconds. tests/python/test_pytorch.py runs it in a scenario
beside vgpu-tenant (PyTorch is not in CI: bash .ci/nightly-torch). Inference, not training: on fakecuda cuBLAS's
sgemm with a transposed first operand fails (docs/fakecuda-runtime.md, "Known limits"), and backward needs it.

Run alone: python3 scenarios/programs/torch_loop.py --seconds 2 (on a GPU, or on fakecuda with LD_LIBRARY_PATH set).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (default: until stopped)")
    parser.add_argument("--width", type=int, default=2048, help="the layers' width (default 2048)")
    parser.add_argument("--batch", type=int, default=32768, help="rows per step (default 32768)")
    parser.add_argument("--sync-every", type=int, default=8, help="steps between synchronisations (default 8)")
    args = parser.parse_args()
    if args.seconds < 0 or min(args.width, args.batch, args.sync_every) < 1:
        parser.error(f"--seconds {args.seconds} / --width {args.width} / --batch {args.batch} / --sync-every "
                     f"{args.sync_every}: expected >= 0 / >= 1 / >= 1 / >= 1")
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                torch.nn.Linear(args.width, args.width)).cuda()
    batch = torch.ones(args.batch, args.width, device="cuda")
    end = time.monotonic() + args.seconds if args.seconds else None
    steps = 0
    with torch.no_grad():
        while end is None or time.monotonic() < end:
            scores = model(batch).softmax(dim=1)
            steps += 1
            if steps % args.sync_every == 0:
                torch.cuda.synchronize()
    print(f"{steps} steps, last score sum {float(scores.sum()):.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
