"""The GPU suite's measures that can be checked without a GPU: NVML utilization taken over a span leaves out the
samples that reach back before it (tests/gpu/suite.py, Sampler.between), the kernel-time probe's arithmetic and
input checks (tests/gpu/kernel_time_probe.py), and the caps plot's reading of an H100 run (tests/gpu/plot_caps.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import REPO_ROOT

GPU_DIR = REPO_ROOT / "tests" / "gpu"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (a dataclass looks its module up there)
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


H100_RUN = REPO_ROOT / "docs" / "gpu-runs" / "2026-11-23-suite-26-report.json"
H100_KERNEL_TIME = REPO_ROOT / "docs" / "gpu-runs" / "2026-11-23-kernel-time.jsonl"


def test_the_caps_plot_judges_each_workload_by_its_own_measure_on_the_h100_run(tmp_path):
    caps = load("plot_caps")
    series = caps.series_of(caps.read_report(str(H100_RUN)), caps.read_kernel_time(str(H100_KERNEL_TIME)))
    points = {(s.label, s.measure): {p[0]: p[1:] for p in s.points} for s in series}
    tenant = points[("vgpu-tenant 1 ms", "busy time")]
    assert sorted(tenant) == [10.0, 30.0, 50.0, 70.0, 90.0]
    assert round(tenant[30.0][0], 1) == 29.6 and tenant[30.0][1] == 30.0
    assert round(points[("5 us kernels, depth 8", "% of uncapped throughput")][30.0][0], 1) == 28.7
    assert round(points[("pair 30/70", "busy time, side by side")][70.0][0], 1) == 58.8
    # x.add_ is launch-bound at ~13 % of the GPU's time uncapped: a 10 % cap binds, 30 and 50 do not (not judged).
    add = points[("x.add_ 1M", "CUPTI kernel time")]
    assert round(add[10.0][0], 1) == 4.4 and add[10.0][1] == 10.0
    assert add[30.0][1] is None and add[50.0][1] is None
    assert round(points[("x.add_ 1M", "NVML utilization, from 1 s in")][10.0][0], 1) == 8.0
    # The suite-26 report predates NVML's first second being left out: its NVML figures for PyTorch are not used.
    assert ("bf16 matmul 8192", "NVML utilization") not in points
    text = caps.table(series)
    assert "x.add_ 1M" in text and "not judged: above the uncapped use" in text and "-5.58  NO" in text, text
    out = tmp_path / "caps.png"
    done = subprocess.run([sys.executable, str(GPU_DIR / "plot_caps.py"), str(H100_RUN), "--kernel-time",
                           str(H100_KERNEL_TIME), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_caps_plot_refuses_input_that_is_not_a_suite_report(tmp_path):
    def plot(*args):
        return subprocess.run([sys.executable, str(GPU_DIR / "plot_caps.py"), *map(str, args), "--out",
                               str(tmp_path / "x.png")], capture_output=True, text=True, timeout=60)

    no_compute = tmp_path / "memory-only.json"
    no_compute.write_text('{"stages": {"memory": {"status": "done"}}}')
    done = plot(no_compute)
    assert done.returncode == 2, done
    assert str(no_compute) in done.stderr and "stages: memory" in done.stderr and "compute" in done.stderr, done.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    done = plot(broken)
    assert done.returncode == 2 and str(broken) in done.stderr and "not JSON" in done.stderr, done.stderr
    done = plot(tmp_path / "missing.json")
    assert done.returncode == 2 and "cannot be read" in done.stderr, done.stderr
    lines = tmp_path / "kernel-time.jsonl"
    lines.write_text('{"which": "add", "cap": 0, "rc": 0, "busy_fraction": 0.13}\n{"which": "add"}\n')
    done = plot(H100_RUN, "--kernel-time", lines)
    assert done.returncode == 2 and f"{lines}:2" in done.stderr and "'which' and 'cap'" in done.stderr, done.stderr
    lines.write_text('{"which": "add", "cap": "ten", "rc": 0}\n')
    done = plot(H100_RUN, "--kernel-time", lines)
    assert done.returncode == 2 and f"{lines}:1: cap 'ten'" in done.stderr and "0 (no shim) to 100" in done.stderr, \
        done.stderr
    bad_caps = tmp_path / "bad-caps.json"
    bad_caps.write_text('{"stages": {"compute": {"caps": [10, 300]}}}')
    done = plot(bad_caps)
    assert done.returncode == 2 and "300 is not a cap" in done.stderr and "1 to 100" in done.stderr, done.stderr
    assert not (tmp_path / "x.png").exists()
