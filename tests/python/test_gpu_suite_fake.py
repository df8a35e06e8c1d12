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
