"""libvgpu-path-counters.so, the diagnostic build of the shim that counts where its launches go (docs/compute-limit.md,
"Path counters"): its counts add up, and it holds the cap as libvgpu.so does. tests/gpu/path_counters.sh runs it on a
real GPU."""

from __future__ import annotations

import json

import pytest

from conftest import built_library
from fakegpu_harness import kernel_shares, read_trace

PREFIX = "vgpu-path-counters "


@pytest.fixture
def counters_shim(fake_gpu):
    return built_library(fake_gpu, "libvgpu-path-counters.so", " (sanitizer builds leave it out)")


def counts_of(stderr: str) -> dict:
    lines = [line for line in stderr.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1, f"expected one counters line at exit, got {len(lines)}:\n{stderr[-2000:]}"
    return json.loads(lines[0][len(PREFIX):])


def test_every_capped_launch_is_counted_once_on_the_path_it_took(fake_gpu, tenant_available, counters_shim):
    fake_gpu.env.update({"LD_PRELOAD": str(counters_shim), "CUDA_DEVICE_SM_LIMIT": "30",
                         "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "counted.region")})
    trace_path = fake_gpu.enable_trace()
    result = fake_gpu.tenant("--seconds", "3", "--kernel-us", "20", "--depth", "8", timeout=60)
    assert result.returncode == 0, result.describe()
    counts = counts_of(result.stderr)
    launches = result.json["kernels"]
    print(f"\n{launches} launches: {counts}")
    assert counts["booked_drained"] + counts["booked_window"] + counts["whole_path"] == launches, counts
    plans = counts["planned_unmeasured"] + counts["planned_pair"] + counts["planned_gated_pair"] + counts["planned_window"]
    assert plans == counts["whole_path"], counts
    # Books serve most launches of a queue this deep, and a 30 % cap binds on it.
    assert counts["booked_window"] + counts["booked_drained"] > launches / 2, counts
    assert counts["book_launches_granted"] >= counts["booked_window"] + counts["booked_drained"], counts
    assert counts["waited_for_budget"] > 0 and counts["waited_for_budget_ns"] > 0, counts
    # The counting build limits as the shim does.
    share = kernel_shares(read_trace(trace_path), [result.pid]).share(result.pid)
    assert 0.25 <= share <= 0.32, f"counted shim held the tenant at {share:.3f} of the device under a 30 % cap"


def test_without_a_compute_limit_nothing_is_counted(fake_gpu, tenant_available, counters_shim):
    fake_gpu.env.update({"LD_PRELOAD": str(counters_shim), "CUDA_DEVICE_MEMORY_LIMIT": "1g",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(fake_gpu.work_dir / "memory.region")})
    result = fake_gpu.tenant("--kernels", "200", "--kernel-us", "50", timeout=60)
    assert result.returncode == 0, result.describe()
    counts = counts_of(result.stderr)
    assert all(value == 0 for value in counts.values()), counts
