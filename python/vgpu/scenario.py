"""Scenario files (docs/scenarios.md) from Python: load, check, run. Thin wrappers over vgpu._native.

    scenario = vgpu.scenario.load("scenarios/thirty-seventy.yaml")   # vgpu.ScenarioError on any problem
    vgpu.scenario.check("scenarios/bad.yaml")                         # [Problem(file, line, key, message), ...]
    outcome = vgpu.scenario.run(scenario, mode="virtual", trace_path="t.jsonl")

The Scenario object is read-only (attributes as in sim/scenario/include/vgpu/scenario/scenario.h, times in ns);
scenario.to_dict() gives the same as a plain dict tree (what vgpu.analysis reads the expectations from).
"""

from __future__ import annotations

import os
from typing import Callable

from . import _paths, native
from ._errors import Problem, ScenarioError



def load(path: str | os.PathLike[str]):
    """Reads and validates a scenario file; raises ScenarioError (with .problems) if anything is wrong."""
    return native().load_scenario(os.fspath(path))


def load_text(text: str, file: str = "<text>"):
    """The same from text; `file` names it in problems."""
    return native().load_scenario_text(text, file)


def check(path: str | os.PathLike[str]) -> list[Problem]:
    """Every problem of a scenario file (at most 50, in file order); [] if it is valid."""
    try:
        load(path)
    except ScenarioError as error:
        return error.problems
    return []


def check_text(text: str, file: str = "<text>") -> list[Problem]:
    try:
        load_text(text, file)
    except ScenarioError as error:
        return error.problems
    return []


# The names the package exports at top level (vgpu.load_scenario, ...).
load_scenario = load
load_scenario_text = load_text


def default_mode(scenario) -> str:
    """The mode a scenario runs in when none is asked for: virtual if it allows it, else live."""
    modes = list(scenario.modes)
    return "virtual" if "virtual" in modes or not modes else modes[0]


def run(scenario, mode: str | None = None, trace_path: str | os.PathLike[str] | None = None,
        install_dir: str | os.PathLike[str] | None = None, work_dir: str | os.PathLike[str] | None = None,
        progress: Callable[[float, str], None] | None = None):
    """Runs a scenario (a loaded Scenario or a path). The install dir defaults to vgpu._paths.install_dir().

    Returns the native Outcome (ok, error, trace, wall_seconds); KeyboardInterrupt if Ctrl-C stopped it.
    """
    if isinstance(scenario, (str, os.PathLike)):
        scenario = load(scenario)
    if mode is None:
        mode = default_mode(scenario)
    if install_dir is None:
        install_dir = _paths.install_dir()
    return native().run(scenario, mode=mode,
                        trace_path=None if trace_path is None else os.fspath(trace_path),
                        install_dir=None if install_dir is None else os.fspath(install_dir),
                        work_dir=None if work_dir is None else os.fspath(work_dir),
                        progress=progress)


def read_region(path: str | os.PathLike[str]) -> dict:
    """A container region's state (see vgpu._native.read_region); RegionError if it cannot be read."""
    return native().read_region(os.fspath(path))


__all__ = ["Problem", "ScenarioError", "check", "check_text", "default_mode", "load", "load_scenario",
           "load_scenario_text", "load_text", "read_region", "run"]
