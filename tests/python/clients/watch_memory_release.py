"""Client that watches, through cuMemGetInfo and NVML, for device memory coming back (after another process dies).

usage: watch_memory_release.py EXPECTED_BYTES TIMEOUT_S
Prints {"ready": true, "free", "nvml_used"} with its baselines, then
{"cuda_released_t", "nvml_released_t", ...}: the CLOCK_MONOTONIC time at which each view first showed
at least EXPECTED_BYTES more free (null if it never did before the timeout).
"""

import sys
import time

import pynvml
from cuda.bindings import driver

from clientlib import check, cuda_context, emit


def main() -> None:
    expected_bytes = int(sys.argv[1])
    timeout_s = float(sys.argv[2])
    cuda_context(0)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    free_baseline, _ = check("cuMemGetInfo", driver.cuMemGetInfo())
    used_baseline = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    emit({"ready": True, "free": free_baseline, "nvml_used": used_baseline})
    cuda_released_t = nvml_released_t = None
    free_now = free_baseline
    used_now = used_baseline
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (cuda_released_t is None or nvml_released_t is None):
        now = time.monotonic()
        if cuda_released_t is None:
            free_now, _ = check("cuMemGetInfo", driver.cuMemGetInfo())
            if free_now - free_baseline >= expected_bytes:
                cuda_released_t = now
        if nvml_released_t is None:
            used_now = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            if used_baseline - used_now >= expected_bytes:
                nvml_released_t = now
        time.sleep(0.01)
    emit({"cuda_released_t": cuda_released_t, "nvml_released_t": nvml_released_t,
          "free_baseline": free_baseline, "free_last": free_now,
          "nvml_used_baseline": used_baseline, "nvml_used_last": used_now})


if __name__ == "__main__":
    main()
