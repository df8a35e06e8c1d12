"""The harness's own trace arithmetic (per-process device time over the common window), on hand-made traces."""

from __future__ import annotations

import json

import pytest

from fakegpu_harness import kernel_shares, read_trace


def kernel(pid: int, start_ns: int, end_ns: int, device: int = 0) -> dict:
    return {"ev": "kernel", "pid": pid, "device": device, "stream": 0, "name": "vgpu_spin",
            "grid": [1, 1, 1], "block": [32, 1, 1], "start_ns": start_ns, "end_ns": end_ns}


def test_alternating_processes_share_the_common_window():
    events = [kernel(1, 0, 10), kernel(1, 10, 20)]          # pid 1 alone first
    events += [kernel(2, 20, 30), kernel(1, 30, 40), kernel(2, 40, 50), kernel(1, 50, 60)]
    events += [{"ev": "alloc", "pid": 2, "device": 0, "bytes": 4096, "ptr": 1}]
    shares = kernel_shares(events, [1, 2])
    assert (shares.window_start_ns, shares.window_end_ns) == (20, 50)
    assert shares.busy_ns_by_pid == {1: 10, 2: 20}
    assert shares.device_busy_fraction == 1.0


def test_kernels_are_clipped_to_the_window_and_other_devices_ignored():
    events = [kernel(1, 0, 100), kernel(2, 50, 70), kernel(2, 90, 150), kernel(2, 0, 200, device=1)]
    shares = kernel_shares(events, [1, 2])
    assert (shares.window_start_ns, shares.window_end_ns) == (50, 100)
    assert shares.busy_ns_by_pid == {1: 50, 2: 30}


def test_a_process_without_kernels_is_an_error():
    with pytest.raises(AssertionError, match="no kernel events of pid 3"):
        kernel_shares([kernel(1, 0, 10)], [1, 3])


def test_read_trace_names_the_bad_line(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(kernel(1, 0, 1)) + "\n\nnot json\n")
    with pytest.raises(AssertionError, match=r"trace.jsonl:3 is not a JSON object"):
        read_trace(trace)
