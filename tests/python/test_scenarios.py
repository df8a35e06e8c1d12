"""The starter scenario library (scenarios/*.yaml), run as users run it: every scenario in virtual mode, the ones
marked below also live (real vgpu-tenant processes under the real shim over fakecuda); each must keep every promise
it writes down. The plots are kept as CI artifacts in $VGPU_ARTIFACTS (default <build>/artifacts/scenarios).

Live and virtual runs of the same scenario must also agree: per-tenant mean share within 3 points (issue 5)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vgpu_fixtures import BUILD_DIR, REPO_ROOT, native_reason

SCENARIOS = sorted((REPO_ROOT / "scenarios").glob("*.yaml"))
# Live in CI: short enough, and what the issue asks for at least. four-tenants and small-kernel-storm are not here:
# live on a 2-core machine they miss (docs/scenarios.md, "Live and virtual").
LIVE = ["single-tenant-30", "thirty-sixty", "thirty-seventy", "memory-oom", "sigkill-mid-run", "noisy-neighbour-default",
        "cupy-beside-tenant"]
# Scenarios with a `program:` run live only (docs/scenarios.md, "Programs"); these need CuPy and NVRTC.
CUPY = ["cupy-beside-tenant"]
# Promises known not to hold on the calibrated device (an H100's slices and handovers), pinned as strict xfails so
# that the day they hold the test says so: docs/compute-limit.md, "What is not held".
NOT_HELD: dict[str, str] = {}
ARTIFACTS = Path(os.environ.get("VGPU_ARTIFACTS", BUILD_DIR / "artifacts" / "scenarios"))

pytestmark = pytest.mark.skipif(native_reason() is not None, reason=str(native_reason()))


def runs_in_virtual_time(path: Path) -> bool:
    """Whether the scenario is meant for virtual mode (a `program:` makes it live only); True if it cannot be read,
    so that the virtual test reports why."""
    try:
        import vgpu
        return "virtual" in vgpu.load_scenario(path).modes
    except Exception:  # noqa: BLE001 - the test itself says what is wrong with the file
        return True


def cupy_missing() -> str | None:
    """Why a CuPy program cannot run here, or None."""
    import ctypes.util
    import glob
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install cupy-cuda13x, tests/python/requirements.txt)"
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not glob.glob(f"{cuda_home}/lib*/libnvrtc.so*") and ctypes.util.find_library("nvrtc") is None:
        return f"no libnvrtc in {cuda_home}/lib64 nor on the loader's path: CuPy compiles its kernels with it"
    return None


def run_and_judge(path: Path, mode: str):
    import vgpu
    from vgpu.analysis import format_report, summarize
    from vgpu.plot import plot
    from vgpu.trace import parse_trace

    scenario = vgpu.load_scenario(path)
    outcome = vgpu.run(scenario, mode=mode)
    assert outcome.ok, f"{path.name} ({mode}): the run did not complete: {outcome.error}"
    trace = parse_trace(outcome.trace, f"<{path.name} {mode}>")
    report = summarize(trace, scenario, mode=mode)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    plot(trace, report, ARTIFACTS / f"{path.stem}-{mode}.png")
    (ARTIFACTS / f"{path.stem}-{mode}.jsonl").write_text(outcome.trace)
    text = format_report(report)
    print("\n" + text)
    return report, text


def test_the_library_covers_the_field():
    names = {path.stem for path in SCENARIOS}
    for wanted in ["single-tenant-30", "single-tenant-caps", "thirty-sixty", "thirty-seventy", "four-tenants",
                   "noisy-neighbour-default", "noisy-neighbour-force", "bursty-and-idle", "small-kernel-storm",
                   "persistent-kernels", "memory-oom", "sigkill-mid-run", "multi-process-container",
                   "two-devices-remapped", "four-mixed-sizes"]:
        assert wanted in names, f"scenarios/{wanted}.yaml is missing"


VIRTUAL = [path for path in SCENARIOS if runs_in_virtual_time(path)]


@pytest.mark.parametrize("path", [pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=NOT_HELD[path.stem]))
                                  if path.stem in NOT_HELD else path for path in VIRTUAL],
                         ids=[path.stem for path in VIRTUAL])
def test_every_scenario_keeps_its_promises_in_virtual_time(path: Path):
    report, text = run_and_judge(path, "virtual")
    assert report.finished
    assert report.passed, text
    # Every promise is written down: at least one check per tenant besides the implicit "no OOM".
    for tenant in report.tenants:
        assert any(c.tenant == tenant.name and not c.implicit for c in report.checks), tenant.name


@pytest.mark.slow
@pytest.mark.parametrize("name", LIVE)
def test_live_over_fakecuda_keeps_the_promises_and_agrees_with_virtual_time(name: str, tenant_available):
    if name in CUPY and cupy_missing():
        pytest.skip(cupy_missing())
    path = REPO_ROOT / "scenarios" / f"{name}.yaml"
    live, live_text = run_and_judge(path, "live")
    assert live.finished
    assert live.passed, live_text
    if not runs_in_virtual_time(path):
        return  # a program runs live only: nothing to agree with
    virtual, _ = run_and_judge(path, "virtual")
    for tenant in live.tenants:
        other = virtual.tenant(tenant.name)
        if tenant.mean_share_percent is None or other.mean_share_percent is None:
            continue
        assert abs(tenant.mean_share_percent - other.mean_share_percent) <= 3.0, (
            f"{name}: {tenant.name} live {tenant.mean_share_percent:.1f} % vs virtual {other.mean_share_percent:.1f} %")


def test_a_fully_booked_gpu_is_held_by_time_division_and_not_by_the_limiter(tmp_path: Path):
    """thirty-seventy books the whole GPU. Under time division (as the scenario says) each container gets its cap
    within 2 points and the two together at least 95 %; the event-pair limiter, on the same pair, under-delivers the
    large one (each container's event pairs count the other's slices, handovers take ~5 %), and never over-delivers."""
    path = REPO_ROOT / "scenarios" / "thirty-seventy.yaml"
    report, text = run_and_judge(path, "virtual")
    thirty, seventy = report.tenant("thirty"), report.tenant("seventy")
    assert abs(thirty.mean_share_percent - 30) <= 2 and abs(seventy.mean_share_percent - 70) <= 2, text
    assert thirty.mean_share_percent + seventy.mean_share_percent >= 95, text
    limiter = tmp_path / "thirty-seventy.yaml"
    limiter.write_text(path.read_text().replace("sharing: time-division", "sharing: limiter"))
    report, text = run_and_judge(limiter, "virtual")
    thirty, seventy = report.tenant("thirty"), report.tenant("seventy")
    assert abs(thirty.mean_share_percent - 30) <= 2, text
    assert 45 <= seventy.mean_share_percent <= 60, text


@pytest.mark.slow
def test_known_gap_a_cupy_job_beside_a_neighbour_is_held_by_time_division_and_not_by_the_limiter(tmp_path: Path,
                                                                                                tenant_available):
    """cupy-beside-tenant under the event-pair limiter instead of time division: the CuPy job waits for its kernels
    every step, and each wait counts the neighbour's time slices against it, so it gets about 20 % of its 30 %
    (19.9 % seen) while vgpu-tenant's deep queue keeps its 60 %. Pinned so that the day the limiter holds a real
    framework's share, this says so (time division holds it: the scenario itself, in the live test above)."""
    if cupy_missing():
        pytest.skip(cupy_missing())
    text = (REPO_ROOT / "scenarios" / "cupy-beside-tenant.yaml").read_text()
    assert "sharing: time-division" in text and "programs/cupy_loop.py" in text
    limiter = tmp_path / "cupy-beside-tenant-limiter.yaml"
    limiter.write_text(text.replace("sharing: time-division", "sharing: limiter")
                       .replace("programs/cupy_loop.py", str(REPO_ROOT / "scenarios" / "programs" / "cupy_loop.py")))
    report, text = run_and_judge(limiter, "live")
    cupy, spin = report.tenant("cupy"), report.tenant("spin")
    assert cupy.mean_share_percent < 26, text
    assert abs(spin.mean_share_percent - 60) <= 3, text
