"""Does a CUDA graph capture survive the shim's work on other threads? (issue 6, PyTorch CUDA graphs.)

One thread captures a graph of matmuls with torch.cuda.graph (capture_error_mode "global", PyTorch's default) while
another thread keeps launching matmuls on its own stream. Under the shim with a compute cap, the launching thread's
launches go through the limiter, which queries and records events: in global capture mode a "potentially unsafe"
call from any thread fails and invalidates the capture. Prints one JSON line: whether each capture succeeded, the
error if not, and how many launches the other thread made meanwhile.

    python3 tests/gpu/capture_probe.py [--captures 20]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--captures", type=int, default=20)
    parser.add_argument("--mode", default="global", choices=["global", "thread_local", "relaxed"])
    parser.add_argument("--sync-every", type=int, default=0,
                        help="the other thread synchronizes its stream every N launches (0: never; a synchronize is "
                             "itself an unsafe call in global mode, which invalidates a capture without any shim)")
    args = parser.parse_args()
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn_like(a)
    stop = threading.Event()
    launched = [0]

    def busy() -> None:
        stream = torch.cuda.Stream()
        x = torch.randn(512, 512, device="cuda")
        with torch.cuda.stream(stream):
            while not stop.is_set():
                torch.mm(x, x)
                launched[0] += 1
                if args.sync_every and launched[0] % args.sync_every == 0:
                    stream.synchronize()

    worker = threading.Thread(target=busy)
    # Warm up on a side stream, as torch.cuda.graph wants.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.mm(a, b)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    worker.start()
    time.sleep(0.2)
    ok, errors = 0, []
    for _ in range(args.captures):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode=args.mode):
                c = torch.mm(a, b)
                for _ in range(8):
                    c = torch.mm(c, b)
            graph.replay()
            torch.cuda.synchronize()
            ok += 1
        except Exception as error:  # noqa: BLE001  (the probe reports whatever failed)
            errors.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            torch.cuda.synchronize()
        time.sleep(0.01)
    stop.set()
    worker.join()
    print(json.dumps({"mode": args.mode, "sync_every": args.sync_every, "captures": args.captures, "ok": ok, "errors": errors[:3],
                      "failed": len(errors), "other_thread_launches": launched[0]}), flush=True)


if __name__ == "__main__":
    main()
