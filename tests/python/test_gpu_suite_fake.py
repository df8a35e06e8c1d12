"""The GPU suite's plumbing (tests/gpu/suite.py) over fakecuda (VGPU_GPU_FAKE=1), so that the one command a GPU machine
runs does not rot where no GPU is: its overhead stage runs every configuration, writes report.json and report.md, and
says why the in-process measurement is left out over fakecuda. (PyTorch is not needed: where it is missing its
measurements are reported as errors and the rest goes on.)"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT


def test_the_gpu_suites_overhead_stage_runs_and_reports_over_fakecuda(fake_gpu, tenant_available, build_dir, tmp_path):
    out = tmp_path / "report"
    env = dict(fake_gpu.env)
    env.update({"VGPU_GPU_FAKE": "1", "VGPU_GPU_STAGES": "overhead", "VGPU_COMMIT": "test"})
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "gpu" / "suite.py"), "--build", str(build_dir),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"suite.py exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    overhead = report["stages"]["overhead"]
    assert overhead["status"] == "done", overhead
    configs = [entry["config"] for entry in overhead["rounds"]]
    assert configs == overhead["order"], configs
    for entry in overhead["rounds"]:
        assert entry["tenant_launch_rate_per_s"] and entry["tenant_launch_rate_per_s"] > 0, entry
        assert entry["tenant_sync_launch_us"] and entry["tenant_sync_launch_us"] > 0, entry
    assert set(overhead["summary"]["vs_none_percent"]) == {"shim", "shim_limits"}, overhead["summary"]
    assert overhead["inproc"]["status"] == "skipped" and "fakecuda" in overhead["inproc"]["note"], overhead["inproc"]
    text = (out / "report.md").read_text()
    assert "## 4. Overhead of the shim" in text and "Inside one process: skipped" in text, text[-2000:]


def test_the_gpu_suites_compute_stage_draws_achieved_against_the_cap_over_fakecuda(fake_gpu, tenant_available,
                                                                                      build_dir, tmp_path, monkeypatch):
    out = tmp_path / "report"
    out.mkdir()
    (out / "caps.png").write_text("an earlier run's plot")  # never left beside a new report
    env = dict(fake_gpu.env)
    env.update({"VGPU_GPU_FAKE": "1", "VGPU_GPU_STAGES": "compute", "VGPU_COMMIT": "test", "VGPU_GPU_CAPS": "30",
                "VGPU_GPU_POINT_S": "1"})
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "gpu" / "suite.py"), "--build", str(build_dir),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"suite.py exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    compute = report["stages"]["compute"]
    assert compute["status"] == "done" and compute.get("plot") == "caps.png", compute.get("notes")
    assert (out / "caps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![achieved against the cap, per workload](caps.png)" in (out / "report.md").read_text()
    # The plot's points are the report's: vgpu-tenant's busy time at the one cap, and the two pairs side by side.
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "gpu"))
    import plot_caps  # noqa: PLC0415
    # The plot reads the keys the suite writes: each workload it ran is there, at its caps.
    series = {(s.label, s.measure): [p[0] for p in s.points] for s in plot_caps.series_of(report)}
    assert series[("vgpu-tenant 1 ms", "busy time")] == [30.0], series
    assert series[("pair 30/70", "busy time, side by side")] == [30.0, 70.0], series
    assert series[("pair 30/60", "busy time, side by side")] == [30.0, 60.0], series
    assert series[("5 us kernels, depth 8", "own spin time, dispatch left out")] == [30.0], series
