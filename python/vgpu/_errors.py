"""The package's exceptions and the Problem record (pure Python: the native module raises these)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a scenario file: where (file, line, the dotted key) and what."""

    file: str
    line: int
    key: str
    message: str

    def __str__(self) -> str:
        # As vgpu::scenario::Problem::ToString: FILE:LINE: KEY: MESSAGE (no KEY part when the problem has none).
        return f"{self.file or '<scenario>'}:{self.line}: {self.key + ': ' if self.key else ''}{self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


class ScenarioError(ValueError):
    """A scenario file was refused. `problems` lists every problem found, in file order."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems) or "the scenario was refused")

    def __reduce__(self):
        return (type(self), (self.problems,))


class RegionError(OSError):
    """A container region file could not be read (missing, not a region, a newer layout)."""


class NativeUnavailable(ImportError):
    """vgpu._native is not built or not found; the message says where it was looked for."""


# Shown and pickled as vgpu.X, where users import them from.
for _class in (Problem, ScenarioError, RegionError, NativeUnavailable):
    _class.__module__ = "vgpu"
del _class
