"""The GPU suite's measures that can be checked without a GPU: NVML utilization taken over a span leaves out the
samples that reach back before it (tests/gpu/suite.py, Sampler.between), the kernel-time probe's arithmetic and
input checks (tests/gpu/kernel_time_probe.py), and the caps plot's reading of an H100 run (tests/gpu/plot_caps.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import REPO_ROOT

GPU_DIR = REPO_ROOT / "tests" / "gpu"


def load(name: str, monkeypatch=None):
    spec = importlib.util.spec_from_file_location(name, GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:  # a dataclass looks its module up in sys.modules while it is defined
        monkeypatch.setitem(sys.modules, name, module)
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


def plot_caps(*args, out):
    return subprocess.run([sys.executable, str(GPU_DIR / "plot_caps.py"), *map(str, args), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def test_the_caps_plot_draws_each_workload_by_every_measure_of_the_h100_run(tmp_path, monkeypatch):
    caps = load("plot_caps", monkeypatch)
    series = caps.series_of(caps.read_report(str(H100_RUN)), caps.read_kernel_time(str(H100_KERNEL_TIME)))
    points = {(s.label, s.measure): {p[0]: p[1:] for p in s.points} for s in series}
    tenant = points[("vgpu-tenant 1 ms", "busy time")]
    assert sorted(tenant) == [10.0, 30.0, 50.0, 70.0, 90.0]
    assert round(tenant[30.0][0], 2) == 29.65 and tenant[30.0][1]
    # The 5 us kernels by both measures: throughput counts each kernel's dispatch, their own spin time does not.
    assert round(points[("5 us kernels, depth 8", "% of uncapped throughput")][30.0][0], 1) == 28.7
    assert round(points[("5 us kernels, depth 8", "own spin time, dispatch left out")][30.0][0], 1) == 20.4
    assert round(points[("pair 30/70", "busy time, side by side")][70.0][0], 1) == 58.8
    # x.add_ is launch-bound at ~13 % of the GPU's time uncapped: a 10 % cap binds, 30 and 50 do not (not judged).
    add = points[("x.add_ 1M", "CUPTI kernel time, dispatch left out")]
    assert round(add[10.0][0], 1) == 4.4 and add[10.0][1]
    assert not add[30.0][1] and not add[50.0][1]
    assert round(points[("x.add_ 1M", caps.NVML_FROM_1S)][10.0][0], 2) == 7.99
    # The suite-26 report predates NVML's first second being left out: its own NVML figures for PyTorch are not used
    # (the probe's are).
    assert len([s for s in series if (s.label, s.measure) == ("bf16 matmul 8192", caps.NVML_FROM_1S)]) == 1
    text = caps.table(series)
    assert "not judged: the cap is above the uncapped use" in text and "-5.58  NO" in text, text
    out = tmp_path / "caps.png"
    done = plot_caps(H100_RUN, "--kernel-time", H100_KERNEL_TIME, out=out)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_workload_over_its_cap_is_judged_and_drawn_even_where_the_cap_does_not_bind(tmp_path, monkeypatch):
    caps = load("plot_caps", monkeypatch)
    # Uses 13 % uncapped: a 30 % cap does not bind; reading 20 % there is not judged, reading 45 % is (over the cap).
    report = {"stages": {"compute": {"caps": [10, 30, 50], "tenant": {
        "0": {"busy_fraction": 0.13}, "10": {"busy_fraction": 0.20}, "30": {"busy_fraction": 0.20},
        "50": {"busy_fraction": 0.45}}}}}
    (series,) = caps.series_of(report)
    assert series.points == [(10.0, 20.0, True), (30.0, 20.0, False), (50.0, 45.0, False)]
    report["stages"]["compute"]["tenant"]["30"]["busy_fraction"] = 0.45
    (series,) = caps.series_of(report)
    assert series.points[1] == (30.0, 45.0, True)
    assert "+15.00  NO" in caps.table([series]) and "+10.00  NO" in caps.table([series])
    figure = caps.plot([series], str(tmp_path / "over.png"), "over")
    off_axes = figure.axes[1]
    assert off_axes.get_ylim()[1] >= 16.0, off_axes.get_ylim()  # the +15 point is inside the panel


def test_a_compute_stage_cut_short_draws_what_it_has(monkeypatch):
    caps = load("plot_caps", monkeypatch)
    report = {"stages": {"compute": {"caps": [10, 30], "torch": None, "tenant": {"0": None, "10": "skipped",
              "30": {"busy_fraction": 0.298}}, "tenant_5us": {"30": None}, "pair_tenant": None}}}
    (series,) = caps.series_of(report)
    assert series.label == "vgpu-tenant 1 ms" and len(series.points) == 1, series
    cap, achieved, judged = series.points[0]
    assert cap == 30.0 and abs(achieved - 29.8) < 1e-9 and judged
    report["stages"]["compute"]["tenant"]["30"]["busy_fraction"] = 0.0
    assert caps.series_of(report)[0].points == [(30.0, 0.0, True)]


def test_the_caps_plot_refuses_input_that_is_not_a_suite_report(tmp_path):
    out = tmp_path / "x.png"
    no_compute = tmp_path / "memory-only.json"
    no_compute.write_text('{"stages": {"memory": {"status": "done"}}}')
    done = plot_caps(no_compute, out=out)
    assert done.returncode == 2, done
    assert str(no_compute) in done.stderr and "stages: memory" in done.stderr and "compute" in done.stderr, done.stderr
    no_stages = tmp_path / "no-stages.json"
    no_stages.write_text('{"stages": null}')
    done = plot_caps(no_stages, out=out)
    assert done.returncode == 2 and "stages: none" in done.stderr, done.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    done = plot_caps(broken, out=out)
    assert done.returncode == 2 and str(broken) in done.stderr and "not JSON" in done.stderr, done.stderr
    done = plot_caps(tmp_path / "missing.json", out=out)
    assert done.returncode == 2 and "cannot be read" in done.stderr, done.stderr
    bad_caps = tmp_path / "bad-caps.json"
    bad_caps.write_text('{"stages": {"compute": {"caps": [10, 300]}}}')
    done = plot_caps(bad_caps, out=out)
    assert done.returncode == 2 and "300 is not a cap" in done.stderr and "1 to 100" in done.stderr, done.stderr
    bad_value = tmp_path / "bad-value.json"
    bad_value.write_text('{"stages": {"compute": {"caps": [30], "tenant": {"30": {"busy_fraction": "high"}}}}}')
    done = plot_caps(bad_value, out=out)
    assert done.returncode == 2, done
    assert f"{bad_value}: stages.compute.tenant.30: busy_fraction 'high'; expected a number from 0 to 1.1" in \
        done.stderr, done.stderr
    lines = tmp_path / "kernel-time.jsonl"
    lines.write_text('{"which": "add", "cap": 0, "rc": 0, "busy_fraction": 0.13}\n{"which": "add"}\n')
    done = plot_caps(H100_RUN, "--kernel-time", lines, out=out)
    assert done.returncode == 2 and f"{lines}:2" in done.stderr and "'which' and 'cap'" in done.stderr, done.stderr
    lines.write_text('{"which": "add", "cap": "ten", "rc": 0}\n')
    done = plot_caps(H100_RUN, "--kernel-time", lines, out=out)
    assert done.returncode == 2 and f"{lines}:1: cap 'ten'" in done.stderr and "0 (no shim) to 100" in done.stderr, \
        done.stderr
    lines.write_text('{"which": "add", "cap": 10, "rc": 0, "nvml_util_mean_after_1s": 150}\n')
    done = plot_caps(H100_RUN, "--kernel-time", lines, out=out)
    assert done.returncode == 2 and f"{lines}:1: nvml_util_mean_after_1s 150" in done.stderr, done.stderr
    assert not out.exists()
