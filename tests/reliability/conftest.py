"""Fixtures of the reliability suite, and the figures table printed when it ends.

The suite runs real processes (vgpu-tenant, python clients, the shim) on a fakecuda machine of each test's own,
with the harness of tests/python (fakegpu_harness.FakeGpu). Each campaign records the figures it checks through
the `figures` fixture -- rounds, kills, faults injected, bytes leaked, processes stuck -- and the table of all of
them is printed at the end of the run and written to $VGPU_ARTIFACTS/reliability.json when that is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests" / "python"))

from fakegpu_harness import FakeGpu, MonitorProcess  # noqa: E402  (after the path is set)

BUILD_DIR = Path(os.environ.get("VGPU_BUILD_DIR", REPO_ROOT / "build" / "default")).resolve()
SHIM = BUILD_DIR / "lib" / "libvgpu.so"


class Figures:
    """What the campaigns measured: an ordered table of (campaign, figure) -> value."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, object]] = {}

    def record(self, campaign: str, **values: object) -> None:
        """Adds (or replaces) figures of one campaign, e.g. record("crash", rounds=40, kills=40, leaked_bytes=0)."""
        self.rows.setdefault(campaign, {}).update(values)

    def table(self) -> list[str]:
        lines = []
        for campaign, values in self.rows.items():
            lines.append(f"{campaign}: " + ", ".join(f"{name}={value}" for name, value in values.items()))
        return lines


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001 (pytest's signature)
    if not _FIGURES.rows:
        return
    terminalreporter.section("reliability figures")
    for line in _FIGURES.table():
        terminalreporter.write_line(line)
    artifacts = os.environ.get("VGPU_ARTIFACTS")
    if artifacts:
        path = Path(artifacts) / "reliability.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_FIGURES.rows, indent=2, sort_keys=False) + "\n")
        terminalreporter.write_line(f"written to {path}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [path for path in (BUILD_DIR / "lib" / "libcuda.so.1", SHIM, BUILD_DIR / "bin" / "vgpu-tenant")
               if not path.exists()]
    if not missing:
        return
    skip = pytest.mark.skip(reason=f"the build under test lacks {', '.join(map(str, missing))} (build the tree, or "
                                   f"point VGPU_BUILD_DIR at a build folder that has them)")
    for item in items:
        if "fake_gpu" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture
def build_dir() -> Path:
    return BUILD_DIR


@pytest.fixture
def shim_path() -> Path:
    return SHIM


@pytest.fixture
def fake_gpu(tmp_path: Path):
    """A fake machine of this test's own (one h100-80gb unless the test sets FAKECUDA_DEVICES)."""
    gpu = FakeGpu(build_dir=BUILD_DIR, work_dir=tmp_path)
    yield gpu
    gpu.stop_all()


MONITOR = BUILD_DIR / "bin" / "vgpu-monitor"


class NodeMonitor(MonitorProcess):
    """vgpu-monitor judging one container, `box` (MonitorProcess), its verdict where the shims of the test read it."""

    def __init__(self, fake_gpu: FakeGpu, work_dir: Path) -> None:
        super().__init__(fake_gpu, MONITOR, work_dir)

    def contain(self, memory_limit: str, sm_limit: int | None = None) -> None:
        """Describes the container to the monitor; the shims started next read its verdict."""
        super().contain(f"CUDA_DEVICE_MEMORY_LIMIT={memory_limit}",
                        *([f"CUDA_DEVICE_SM_LIMIT={sm_limit}"] if sm_limit is not None else []))
        self.fake_gpu.env["VGPU_VERDICT_FILE"] = str(self.verdict_path)

    def start(self, action: str = "report", period_ms: int = 50) -> None:
        super().start("--period-ms", str(period_ms), "--action", action, "--log-level", "2")
        self.wait_for(lambda: self.verdict_path.exists(), 10, "the first verdict")

    def verdict(self) -> str:
        return self.verdict_path.read_text()


@pytest.fixture
def node_monitor(fake_gpu, tmp_path: Path):
    monitor = NodeMonitor(fake_gpu, tmp_path)
    yield monitor
    monitor.stop()
