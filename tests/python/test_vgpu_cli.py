"""The `vgpu` command: --help and --version everywhere, `vgpu check`, `vgpu run` in virtual mode (summary, JSON,
plot, exit codes), `vgpu smi --region` on a live container region."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from vgpu_fixtures import BAD_SCENARIO, GIB, PYTHON_DIR, SMALL_SCENARIO, cli_env, requires_native, run_cli

import vgpu
from vgpu.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", [[], ["run"], ["check"], ["smi"]], ids=["vgpu", "run", "check", "smi"])
def test_help_for_every_command(command):
    result = run_cli(*command, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: vgpu {' '.join(command)}".rstrip())
    assert "--help" in result.stdout


def test_version():
    result = run_cli("--version", timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"vgpu {vgpu.__version__}"


def test_no_command_is_a_usage_error():
    result = run_cli(timeout=60)
    assert result.returncode == 2 and "usage: vgpu" in result.stderr


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_SCENARIO)
    return path


@pytest.fixture
def bad(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_SCENARIO)
    return path


@requires_native
def test_check_a_bad_file_names_file_line_and_key(bad, small, capsys):
    assert main(["check", str(bad), str(small)]) == 2
    captured = capsys.readouterr()
    # nvidia.com/gpucores: -5 is on line 6.
    assert re.search(rf"^{re.escape(str(bad))}:6: tenants\[0\]\.limits\.nvidia\.com/gpucores: .*-5",
                     captured.err, re.MULTILINE), captured.err
    assert f"{small}: ok (small-30-60: 2 tenants, 3 s, virtual, live)" in captured.out
    # The same through the real entry point.
    result = run_cli("check", str(bad), timeout=60)
    assert result.returncode == 2 and f"{bad}:6: tenants[0].limits.nvidia.com/gpucores: " in result.stderr


@requires_native
def test_check_json_and_the_python_api(bad, small, capsys):
    assert main(["check", "--json", str(bad), str(small)]) == 2
    output = json.loads(capsys.readouterr().out)
    assert output["ok"] is False
    first, second = output["files"]
    assert first["ok"] is False and first["problems"][0]["line"] == 6
    assert first["problems"][0]["key"] == "tenants[0].limits.nvidia.com/gpucores"
    assert first["problems"][0]["text"].startswith(f"{bad}:6: ")
    assert second == {"file": str(small), "ok": True, "name": "small-30-60", "problems": []}
    assert main(["check", "--quiet", str(small)]) == 0 and capsys.readouterr().out == ""

    problems = vgpu.check(bad)
    assert [(p.file, p.line, p.key) for p in problems] == [(str(bad), 6, "tenants[0].limits.nvidia.com/gpucores")]
    assert str(problems[0]) == f"{bad}:6: tenants[0].limits.nvidia.com/gpucores: {problems[0].message}"
    with pytest.raises(vgpu.ScenarioError) as error:
        vgpu.load_scenario(bad)
    assert error.value.problems == problems
    assert vgpu.check(small) == []


@requires_native
def test_check_a_missing_file(tmp_path, capsys):
    missing = tmp_path / "nowhere.yaml"
    assert main(["check", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"{missing}:0: ")


@requires_native
def test_scenario_object_is_read_only_and_converts_to_a_dict(small):
    scenario = vgpu.load_scenario(small)
    assert scenario.name == "small-30-60" and scenario.duration_ns == 3_000_000_000
    assert scenario.modes == ["virtual", "live"]
    a = scenario.tenants[0]
    assert (a.name, a.cores_percent, a.memory_limit_bytes, a.policy) == ("a", 30, 2 * GIB, "force")
    assert a.processes[0].alloc_bytes == GIB // 2 and a.processes[0].work[0].sizes_ns == [1_000_000]
    assert a.expect[0].kind == "share" and a.expect[0].percent == 30 and a.expect[0].tolerance_points is None
    with pytest.raises(AttributeError):
        scenario.name = "other"
    tree = scenario.to_dict()
    assert tree["tenants"][1]["expect"][0] == {"kind": "share", "percent": 60.0, "tolerance_points": None,
                                               "worst_window_points": None, "from_ns": 1_000_000_000,
                                               "to_ns": 3_000_000_000, "oom": False,
                                               "line": tree["tenants"][1]["expect"][0]["line"]}
    json.dumps(tree)  # plain data all the way down


@requires_native
def test_run_virtual_writes_summary_trace_and_plot(small, tmp_path):
    plot_path, trace_path = tmp_path / "run.png", tmp_path / "run.jsonl"
    result = run_cli("run", str(small), "--mode", "virtual", "--plot", str(plot_path), "--trace", str(trace_path))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert result.stdout.startswith(f"small-30-60 ({small}), virtual, 3 s: PASS")
    data = plot_path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 20_000
    trace = vgpu.trace.read_trace(trace_path)
    assert trace.tenant_names == ["a", "b"] and trace.end is not None
    assert trace.run["mode"] == "virtual"


@requires_native
def test_run_json_parses_and_a_broken_promise_exits_1(small, tmp_path):
    result = run_cli("run", str(small), "--json", "--quiet")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] is True and report["mode"] == "virtual" and report["ok"] is True
    shares = {t["name"]: t["mean_share_percent"] for t in report["tenants"]}
    assert abs(shares["a"] - 30) <= 2 and abs(shares["b"] - 60) <= 2
    assert {(c["tenant"], c["kind"]) for c in report["checks"]} >= {("a", "share"), ("b", "share"),
                                                                      (None, "leaked_bytes")}

    broken = tmp_path / "broken.yaml"
    broken.write_text(SMALL_SCENARIO.replace("- share: 60", "- share: 90"))
    result = run_cli("run", str(broken), "--json", "--quiet")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    failed = [c for c in report["checks"] if not c["passed"]]
    assert [(c["tenant"], c["kind"]) for c in failed] == [("b", "share")]


@requires_native
def test_run_refuses_a_bad_scenario_and_a_mode_it_is_not_meant_for(bad, tmp_path, capsys):
    assert main(["run", str(bad)]) == 2
    assert f"{bad}:6: tenants[0].limits.nvidia.com/gpucores: " in capsys.readouterr().err
    virtual_only = tmp_path / "virtual-only.yaml"
    virtual_only.write_text(SMALL_SCENARIO.replace("mode: [virtual, live]", "mode: [virtual]"))
    assert main(["run", "--mode", "live", "--json", str(virtual_only)]) == 2
    captured = capsys.readouterr()
    assert "meant for virtual mode, not live" in captured.err
    assert json.loads(captured.out)["ok"] is False


@requires_native
def test_smi_region_of_a_missing_file(tmp_path, capsys):
    assert main(["smi", "--region", str(tmp_path / "none.region")]) == 2
    assert "cannot read the region" in capsys.readouterr().err
    with pytest.raises(vgpu.RegionError):
        vgpu.scenario.read_region(tmp_path / "none.region")


@requires_native
def test_smi_region_shows_a_live_containers_memory_and_share(fake_gpu, tenant_available, shim_path, capsys):
    region = fake_gpu.work_dir / "box.region"
    fake_gpu.env.update({"LD_PRELOAD": str(shim_path), "CUDA_DEVICE_SM_LIMIT": "30",
                         "CUDA_DEVICE_MEMORY_LIMIT": "4Gi", "GPU_CORE_UTILIZATION_POLICY": "force",
                         "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(region)})
    tenant = fake_gpu.start_tenant("--seconds", "4", "--kernel-us", "1000", "--alloc", str(GIB))
    time.sleep(2.0)
    assert main(["smi", "--json", "--region", str(region)]) == 0
    state = json.loads(capsys.readouterr().out)["regions"][0]
    assert tenant.finish(timeout=60).returncode == 0
    device = state["devices"][0]
    assert device["uuid"].startswith("GPU-")
    assert device["limit_bytes"] == 4 * GIB
    assert device["used_bytes"] >= GIB
    assert device["cap_percent"] == 30
    assert abs(device["share_percent"] - 30) <= 5, device
    assert [p["pid"] for p in state["live"]] == [tenant.pid]
    assert state["live"][0]["used_bytes"][0] == device["used_bytes"]
    # The text view.
    assert main(["smi", "--region", str(region)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"region {region} (layout version ") and "0 live processes" in text


LONG_LIVE = SMALL_SCENARIO.replace("duration: 3s", "duration: 30s").replace("name: small-30-60", "name: long-live")


@requires_native
def test_progress_reaches_python_and_an_exception_in_it_stops_the_run(small, tenant_available, tmp_path):
    calls = []
    outcome = vgpu.run(vgpu.load_scenario(small), mode="virtual", progress=lambda f, what: calls.append((f, what)))
    assert outcome.ok and calls and calls[-1][0] == 1.0
    assert all(isinstance(what, str) for _, what in calls)

    long_live = tmp_path / "long-live.yaml"
    long_live.write_text(LONG_LIVE)

    def stop(fraction, what):
        raise RuntimeError("stop here")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="stop here"):
        vgpu.run(long_live, mode="live", work_dir=tmp_path / "work", progress=stop)
    assert time.monotonic() - started < 10


@requires_native
def test_ctrl_c_stops_a_live_run(tenant_available, tmp_path):
    long_live = tmp_path / "long-live.yaml"
    long_live.write_text(LONG_LIVE)
    process = subprocess.Popen([sys.executable, "-m", "vgpu", "run", str(long_live), "--mode", "live"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        time.sleep(3)
        assert process.poll() is None, process.communicate()
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, stderr
    assert time.monotonic() - interrupted < 5
    assert "interrupted" in stderr


# The three mistakes issue 5 names: an invalid key, a negative limit, a bad unit. Each is refused by `vgpu check`
# with exit 2 and a line naming the file, the line and the key.
MISTAKES = {
    "invalid-key": ("      nvidia.com/gpucores: 30\n    polcy: force\n", 6, "tenants[0].polcy", "unknown key"),
    "negative-limit": ("      nvidia.com/gpucores: -30\n", 5, "tenants[0].limits.nvidia.com/gpucores", "-30"),
    "bad-unit": ("      nvidia.com/gpumem: 4Gb\n", 5, "tenants[0].limits.nvidia.com/gpumem", "4Gb"),
}


@requires_native
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_check_names_file_line_and_key_of_each_mistake(mistake, tmp_path):
    limits, line, key, fragment = MISTAKES[mistake]
    path = tmp_path / f"{mistake}.yaml"
    path.write_text("duration: 3s\ntenants:\n  - name: a\n    limits:\n" + limits +
                    "    processes:\n      - work:\n          - kernels: 1ms\n")
    result = run_cli("check", str(path), timeout=60)
    assert result.returncode == 2, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"{path}:{line}: {key}: "), first
    assert fragment in first, first


@requires_native
def test_a_live_run_in_a_process_that_ignores_sigchld_ends(tenant_available, tmp_path):
    """Regression: with SIGCHLD ignored the kernel reaps the tenants itself and waitpid says ECHILD; the runner
    waited for an exit it could never see, forever. It now ends, reporting the exit as unknown."""
    script = tmp_path / "ignore_sigchld.py"
    script.write_text(
        "import signal\n"
        "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        "import vgpu\n"
        "text = 'duration: 1s\\nsettle: 0s\\ntenants:\\n  - name: a\\n    processes:\\n      - work:\\n"
        "          - kernels: 1ms\\n'\n"
        "outcome = vgpu.run(vgpu.load_scenario_text(text, 't.yaml'), mode='live')\n"
        "exits = [line for line in outcome.trace.splitlines() if '\"ev\":\"exit\"' in line]\n"
        "print(outcome.ok, len(exits), exits[0] if exits else '')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(PYTHON_DIR)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("True 1 "), result.stdout
    assert "taken by someone else" in result.stdout, result.stdout
