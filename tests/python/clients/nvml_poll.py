"""Client that polls NVML device and per-process utilization (pynvml) for a while, then reports every sample.

usage: nvml_poll.py SECONDS [INTERVAL_MS] [DEVICE]
Prints {"ready": true, "t": monotonic} after nvmlInit, then one result line:
  "samples": [[monotonic_s, gpu_percent, memory_percent], ...]
  "process_samples": [{"pid", "sm_util", "timestamp_us", "t"}, ...]  (each distinct sample once)
  "newer_than_latest": after each poll that returned samples, the same query again with
      lastSeenTimeStamp = the newest timestamp just returned: {"not_found": n, "returned": n,
      "wrong": [samples not newer than the timestamp asked for], "errors": [other NVML errors]}
time.monotonic() is CLOCK_MONOTONIC, so the test can compare these times with its own.
"""

import sys
import time

import pynvml

from clientlib import emit


def process_samples(handle, since_us: int):
    """None where NVML has no sample newer than since_us (NVML_ERROR_NOT_FOUND)."""
    try:
        return pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except pynvml.NVMLError_NotFound:
        return None


def check_newer_than_latest(handle, latest_us: int, newer: dict) -> None:
    """NVML returns only samples newer than lastSeenTimeStamp, and NVML_ERROR_NOT_FOUND when there are none.

    A new 200 ms sample may land between the two calls; then it must be newer than latest_us.
    """
    try:
        returned = pynvml.nvmlDeviceGetProcessUtilization(handle, latest_us)
    except pynvml.NVMLError_NotFound:
        newer["not_found"] += 1
        return
    except pynvml.NVMLError as error:
        newer["errors"].append(f"{type(error).__name__}: {error}")
        return
    newer["returned"] += 1
    newer["wrong"] += [{"pid": sample.pid, "timestamp_us": sample.timeStamp, "asked_after_us": latest_us}
                       for sample in returned if sample.timeStamp <= latest_us]


def main() -> None:
    seconds = float(sys.argv[1])
    interval_s = (float(sys.argv[2]) if len(sys.argv) > 2 else 50.0) / 1000.0
    device_index = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    start = time.monotonic()
    emit({"ready": True, "t": start})
    samples = []
    seen = {}
    newer = {"not_found": 0, "returned": 0, "wrong": [], "errors": []}
    next_tick = start
    while time.monotonic() < start + seconds:
        now = time.monotonic()
        utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
        samples.append([now, utilization.gpu, utilization.memory])
        current = process_samples(handle, 0) or []
        for sample in current:
            key = (sample.pid, sample.timeStamp)
            if key not in seen:
                seen[key] = {"pid": sample.pid, "sm_util": sample.smUtil, "timestamp_us": sample.timeStamp, "t": now}
        if current:
            check_newer_than_latest(handle, max(sample.timeStamp for sample in current), newer)
        next_tick += interval_s
        time.sleep(max(0.0, next_tick - time.monotonic()))

    pynvml.nvmlShutdown()
    emit({"samples": samples, "process_samples": list(seen.values()), "newer_than_latest": newer})


if __name__ == "__main__":
    main()
