"""vgpu: GPU slicing for containers, and the fake GPU it is proven on.

    vgpu.load_scenario(path)            a validated scenario file (vgpu.ScenarioError lists what is wrong)
    vgpu.check(path)                    the problems of a scenario file, [] if none
    vgpu.run(scenario, mode="virtual")  runs it; vgpu.trace / vgpu.analysis read and judge the trace
    python -m vgpu --help               the command line (vgpu run | check | smi)

The native parts (vgpu._native, the runner's programs and libraries) come from a wheel (pip install .) or, in a
source tree, from the build: PYTHONPATH=python VGPU_BUILD_DIR=build/default (see vgpu._paths).
"""

from __future__ import annotations

from ._errors import NativeUnavailable, Problem, RegionError, ScenarioError
from . import _paths

__version__ = "0.1.0"

# Development layout: the module is built into $VGPU_BUILD_DIR/python/vgpu, not next to these files.
for _folder in _paths.native_dirs():
    if str(_folder) not in __path__:
        __path__.append(str(_folder))


def native():
    """The native module, or NativeUnavailable saying where it was looked for and how to get it."""
    try:
        from . import _native
    except ImportError as error:
        looked = [str(_paths.PACKAGE_DIR)] + [str(d) for d in _paths.native_dirs()]
        raise NativeUnavailable(
            f"vgpu._native is not available ({error}); looked in: {', '.join(looked)}. Build it "
            f"(cmake --preset default && cmake --build --preset default, with pybind11 installed) and set "
            f"VGPU_BUILD_DIR=build/default, or pip install the package") from None
    return _native


_SUBMODULES = ("analysis", "cli", "plot", "scenario", "smi", "trace")


def __getattr__(name: str):
    # The scenario API and the submodules on demand: importing vgpu stays cheap (no numpy, pandas, matplotlib) and
    # works without the native module.
    if name in ("load_scenario", "load_scenario_text", "check", "check_text", "run"):
        from . import scenario
        return getattr(scenario, name)
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'vgpu' has no attribute {name!r}")


__all__ = ["NativeUnavailable", "Problem", "RegionError", "ScenarioError", "check", "check_text", "load_scenario",
           "load_scenario_text", "native", "run", *_SUBMODULES]
