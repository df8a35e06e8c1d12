"""Shared helpers of the vgpu package tests (test_vgpu_*.py): the dev layout on the path, the native module's
availability, synthetic traces with known numbers.

The package is imported from the source tree (<repo>/python) and its native module from the build under test
($VGPU_BUILD_DIR, else <repo>/build/default; see conftest.py), as `PYTHONPATH=python VGPU_BUILD_DIR=...` would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO_ROOT / "python"
BUILD_DIR = Path(os.environ.get("VGPU_BUILD_DIR", REPO_ROOT / "build" / "default")).resolve()

if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))
os.environ.setdefault("VGPU_BUILD_DIR", str(BUILD_DIR))

import vgpu  # noqa: E402  (after the path is set)

MS = 1_000_000
SECOND = 1_000_000_000
GIB = 1024 ** 3


def native_reason() -> str | None:
    """None if vgpu._native imports, else why not (for skip reasons)."""
    try:
        vgpu.native()
    except vgpu.NativeUnavailable as error:
        return str(error)
    return None


requires_native = pytest.mark.skipif(native_reason() is not None, reason=str(native_reason()))


def cli_env() -> dict[str, str]:
    """The environment of a `python -m vgpu` subprocess in the dev layout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["VGPU_BUILD_DIR"] = str(BUILD_DIR)
    env.setdefault("MPLBACKEND", "Agg")
    return env


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m vgpu ARGS` in a subprocess (the real entry point), text output captured."""
    return subprocess.run([sys.executable, "-m", "vgpu", *args], capture_output=True, text=True, timeout=timeout,
                          env=cli_env(), cwd=cwd or REPO_ROOT)


class TraceWriter:
    """Builds a trace in the format of docs/scenarios.md with chosen numbers.

    shares: per tenant, the share (percent) of each window; every sample period of a window gets the same busy time,
    so a window's share and each of its sample periods' shares are exact.
    """

    def __init__(self, duration_ns: int = 6 * SECOND, settle_ns: int = SECOND, window_ns: int = SECOND,
                 sample_ns: int = 100 * MS, mode: str = "virtual", scenario: str = "synthetic"):
        self.duration_ns, self.settle_ns, self.window_ns, self.sample_ns = duration_ns, settle_ns, window_ns, sample_ns
        self.mode = mode
        self.lines: list[dict] = [{"ev": "run", "scenario": scenario, "file": f"scenarios/{scenario}.yaml",
                                   "mode": mode, "gpu": "h100-80gb", "devices": 1, "seed": 1,
                                   "duration_ns": duration_ns, "settle_ns": settle_ns, "window_ns": window_ns,
                                   "sample_ns": sample_ns, "version": 1}]
        self.tenant_count = 0

    def tenant(self, name: str, cores: int = 0, memory_limit: int = 0, policy: str = "force",
               devices: tuple[int, ...] = (0,), processes: int = 1) -> "TraceWriter":
        self.lines.append({"ev": "tenant", "tenant": name, "index": self.tenant_count, "devices": list(devices),
                           "cores_percent": cores, "memory_limit_bytes": memory_limit, "policy": policy,
                           "priority": 1, "processes": processes})
        self.tenant_count += 1
        return self

    def process(self, tenant: str, process: int = 0, t_ns: int = 0, device: int = 0, pid: int = 0) -> "TraceWriter":
        self.lines.append({"ev": "process", "tenant": tenant, "process": process, "pid": pid, "device": device,
                           "t_ns": t_ns})
        return self

    def window_shares(self, tenant: str, shares_percent: list[float], device: int = 0,
                      memory_bytes: int | list[int] = 0, until_ns: int | None = None) -> "TraceWriter":
        """Samples at sample_ns, 2 sample_ns, ... up to until_ns (default: the duration)."""
        per_window = self.window_ns // self.sample_ns
        busy = 0
        t = 0
        end = self.duration_ns if until_ns is None else until_ns
        step = 0
        for share in shares_percent:
            for _ in range(per_window):
                t += self.sample_ns
                if t > end:
                    return self
                busy += round(share * self.sample_ns / 100)
                memory = memory_bytes[step] if isinstance(memory_bytes, list) else memory_bytes
                self.lines.append({"ev": "sample", "t_ns": t, "tenant": tenant, "device": device, "busy_ns": busy,
                                   "memory_bytes": memory})
                step += 1
        return self

    def event(self, **fields) -> "TraceWriter":
        self.lines.append(fields)
        return self

    def end(self, leaked_bytes: int = 0) -> "TraceWriter":
        self.lines.append({"ev": "end", "t_ns": self.duration_ns, "leaked_bytes": leaked_bytes,
                           "seconds_wall": 1})
        return self

    def text(self) -> str:
        return "".join(json.dumps(line) + "\n" for line in self.lines)

    def write(self, path: Path) -> Path:
        path.write_text(self.text(), encoding="utf-8")
        return path


SMALL_SCENARIO = """\
name: small-30-60
description: two capped tenants, a short virtual run for the command's tests
mode: [virtual, live]
duration: 3s
settle: 1s
tenants:
  - name: a
    limits:
      nvidia.com/gpucores: 30
      nvidia.com/gpumem: 2048
    processes:
      - alloc: 512Mi
        work:
          - kernels: 1ms
    expect:
      - share: 30
  - name: b
    limits:
      nvidia.com/gpucores: 60
    processes:
      - work:
          - kernels: 1ms
    expect:
      - share: 60
"""

BAD_SCENARIO = """\
name: bad
duration: 3s
tenants:
  - name: a
    limits:
      nvidia.com/gpucores: -5
    processes:
      - work:
          - kernels: 1ms
"""
