"""The GPU suite's measures that can be checked without a GPU: NVML utilization taken over a span leaves out the
samples that reach back before it (tests/gpu/suite.py, Sampler.between), and the kernel-time probe's arithmetic and
input checks (tests/gpu/kernel_time_probe.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import REPO_ROOT

GPU_DIR = REPO_ROOT / "tests" / "gpu"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nvml_utilization_over_a_span_leaves_out_the_samples_that_reach_back_before_it():
    suite = load("suite")
    sampler = suite.Sampler(nvml=None)
    # An idle GPU until t=10, then a workload holding it 50 % of the time: NVML's samples in the first second still
    # average in the idle time before (as the H100's did: 46.3 % over all samples, 49.4 % from 1 s in).
    sampler.samples = [{"t": 10 + i * 0.05, "util": 50.0 * min(1.0, i * 0.05), "sm_mhz": 1980, "power_w": 300.0}
                       for i in range(0, 61)]
    view = sampler.between(10.0, 13.0)
    assert view["util_mean"] == 50.0, view
    assert view["util_mean_all"] < 45.0, view
    assert view["nvml_samples"] == 61
    # A span too short to drop a second from keeps every sample.
    short = sampler.between(10.0, 11.5)
    assert short["util_mean"] == short["util_mean_all"], short


def test_the_kernel_time_probe_merges_overlapping_kernels_and_refuses_a_bad_duration():
    probe = load("kernel_time_probe")
    assert probe.union_us([(0, 10), (5, 12), (20, 25), (25, 30)]) == 22.0
    assert probe.union_us([]) == 0.0
    assert probe.union_us([(0, 100), (10, 20)]) == 100.0
    done = subprocess.run([sys.executable, str(GPU_DIR / "kernel_time_probe.py"), "--seconds", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "--seconds 0.0" in done.stderr and "expected 0.1 to 60" in done.stderr, done.stderr
