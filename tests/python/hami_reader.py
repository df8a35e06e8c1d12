"""HAMi's vGPU monitor's reading of a container's cache file, written from HAMi's v1 offsets
(../shared/HAMI-CONTRACT.md; HAMi's pkg/monitor/nvidia/v1/spec.go, pinned there by TestSharedRegionTLayoutMatchesCABI),
not from our headers: an independent reader for the tests (tests/python/test_hami_cache.py, test_monitor_metrics.py)
and for GPU runs (tests/gpu/hami_cache_probe.py). Standard library only.

    python3 tests/python/hami_reader.py FILE     # prints what HAMi's monitor would report, one JSON line per device
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# HAMi-core's shared_region_t v1, little endian (HAMI-CONTRACT.md).
MAGIC = 19920718
V1_BYTES = 2_008_952
OFF_NUM, OFF_UUIDS, OFF_LIMIT, OFF_SM_LIMIT, OFF_PROCS = 56, 64, 1600, 1728, 1856
OFF_PROCNUM, OFF_SWITCH, OFF_RECENT_KERNEL, OFF_PRIORITY = 2_008_896, 2_008_900, 2_008_904, 2_008_908
OFF_LAST_KERNEL_TIME = 2_008_912
PROC_BYTES, PROC_USED, USED_BYTES, PROC_STATUS = 1960, 8, 64, 1928
PROC_UTIL, UTIL_BYTES, UTIL_SM = 1160, 48, 16
USED_CONTEXT, USED_MODULE, USED_DATA, USED_TOTAL = 0, 8, 16, 32


@dataclass
class HamiView:
    """What HAMi's monitor exports for one device of a container."""
    uuid: str
    memory_bytes: int
    limit_bytes: int
    sm_limit: int
    pids: list[int]
    utilization: int  # the sum of the live slots' deviceUtil[i].sm
    context: int      # the sums of used[i].context, .module and .data (HAMi's breakdown series)
    module: int
    data: int


def read_as_hami_monitor(path) -> list[HamiView]:
    """HAMi's monitor's reading: the magic and major version, then per device i < num the UUID (first 40 bytes of its
    row), the limit, and the sums of used[i].total and deviceUtil[i].sm over the slots 0 .. procnum-1 whose status is
    not 0."""
    data = path.read_bytes()
    magic, major = struct.unpack_from("<iI", data, 0)
    assert magic == MAGIC, f"cache file magic flag not matched: {magic}"
    assert major == 1 and len(data) >= V1_BYTES, f"unknown cache file size {len(data)} (major {major})"
    (num,) = struct.unpack_from("<Q", data, OFF_NUM)
    (procnum,) = struct.unpack_from("<i", data, OFF_PROCNUM)
    views = []
    for i in range(num):
        row = data[OFF_UUIDS + 96 * i: OFF_UUIDS + 96 * i + 40]
        (limit,) = struct.unpack_from("<Q", data, OFF_LIMIT + 8 * i)
        (sm_limit,) = struct.unpack_from("<Q", data, OFF_SM_LIMIT + 8 * i)
        total, pids, utilization, context, module, data_bytes = 0, [], 0, 0, 0, 0
        for s in range(procnum):
            slot = OFF_PROCS + PROC_BYTES * s
            (status,) = struct.unpack_from("<i", data, slot + PROC_STATUS)
            if status == 0:
                continue
            (pid,) = struct.unpack_from("<i", data, slot)
            (used,) = struct.unpack_from("<Q", data, slot + PROC_USED + USED_BYTES * i + USED_TOTAL)
            (sm,) = struct.unpack_from("<Q", data, slot + PROC_UTIL + UTIL_BYTES * i + UTIL_SM)
            used_at = slot + PROC_USED + USED_BYTES * i
            context += struct.unpack_from("<Q", data, used_at + USED_CONTEXT)[0]
            module += struct.unpack_from("<Q", data, used_at + USED_MODULE)[0]
            data_bytes += struct.unpack_from("<Q", data, used_at + USED_DATA)[0]
            total += used
            utilization += sm
            pids.append(pid)
        views.append(HamiView(row.decode("ascii", "replace"), total, limit, sm_limit, pids, utilization, context, module,
                              data_bytes))
    return views


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for device in read_as_hami_monitor(Path(sys.argv[1])):
        print(json.dumps(asdict(device)))
