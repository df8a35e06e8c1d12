"""A hostile process of a container: keeps the region's compute budget cell (docs/region.md, BudgetCell) full, at a
lending rate, every millisecond, for SECONDS. The cell is found in CUDA_DEVICE_MEMORY_SHARED_CACHE by its configured
share (permille) and a refill time, as a container process could find it. Prints {"cell": offset or null} once found
(or given up), then {"writes": n}.

    python3 cell_writer.py SHARE_PERMILLE SECONDS

Used by tests/reliability/test_bypass.py (fakecuda) and tests/gpu/suite.py's monitor stage (a GPU)."""

import json
import mmap
import os
import struct
import sys
import time

share, seconds = int(sys.argv[1]), float(sys.argv[2])
deadline = time.monotonic() + seconds
cell, region = None, None
while cell is None and time.monotonic() < deadline:
    try:
        with open(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"], "r+b") as f:
            region = mmap.mmap(f.fileno(), 0)
    except (OSError, ValueError):  # not there yet, or still empty
        time.sleep(0.01)
        continue
    for offset in range(0, len(region) - 24, 8):
        rate, configured = struct.unpack_from("<II", region, offset + 16)
        if configured == share and rate in (share, 1000) and struct.unpack_from("<Q", region, offset + 8)[0] > 10**9:
            cell = offset
            break
    if cell is None:
        region.close()
        time.sleep(0.01)
print(json.dumps({"cell": cell}), flush=True)
writes = 0
while cell is not None and time.monotonic() < deadline:
    struct.pack_into("<q", region, cell, 1 << 40)  # budget_ns
    struct.pack_into("<I", region, cell + 16, 1000)  # rate_permille: lending
    writes += 1
    time.sleep(0.001)
print(json.dumps({"writes": writes}), flush=True)
