"""Where the built pieces are: the install dir (lib/ and bin/) the runner needs, and the native module.

The install dir, in this order:
1. $VGPU_INSTALL_DIR;
2. the package's own `_install/` folder (a pip-installed wheel puts lib/ and bin/ there);
3. $VGPU_BUILD_DIR (development: build/default of a source tree);
4. the source tree's build/default, when this package is imported from <repo>/python/vgpu and it was built.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _source_tree() -> Path | None:
    """The repository root when the package is imported from <repo>/python/vgpu, else None."""
    root = PACKAGE_DIR.parent.parent
    if PACKAGE_DIR.parent.name == "python" and (root / "CMakeLists.txt").is_file() and (root / "python" / "native").is_dir():
        return root
    return None


def build_dir() -> Path | None:
    """The development build folder: $VGPU_BUILD_DIR, else <repo>/build/default when it exists."""
    value = os.environ.get("VGPU_BUILD_DIR")
    if value:
        return Path(value).resolve()
    root = _source_tree()
    if root is not None and (root / "build" / "default").is_dir():
        return root / "build" / "default"
    return None


def candidates() -> list[tuple[str, Path]]:
    """Every place looked at for the install dir, in order, with where it came from."""
    found: list[tuple[str, Path]] = []
    value = os.environ.get("VGPU_INSTALL_DIR")
    if value:
        found.append(("VGPU_INSTALL_DIR", Path(value).resolve()))
    found.append(("the package's _install/", PACKAGE_DIR / "_install"))
    value = os.environ.get("VGPU_BUILD_DIR")
    if value:
        found.append(("VGPU_BUILD_DIR", Path(value).resolve()))
    root = _source_tree()
    if root is not None:
        found.append(("the source tree's build/default", root / "build" / "default"))
    return found


def install_dir() -> Path | None:
    """The first candidate with lib/ and bin/ (VGPU_INSTALL_DIR is taken as given, even if incomplete)."""
    for origin, path in candidates():
        if origin == "VGPU_INSTALL_DIR" or ((path / "lib").is_dir() and (path / "bin").is_dir()):
            return path
    return None


def find_built(relative: str) -> tuple[Path | None, list[Path]]:
    """The first <candidate>/`relative` that is a file, in install_dir()'s order, and every path tried.

    As in install_dir(), $VGPU_INSTALL_DIR, when set, is the only place looked at.
    """
    tried: list[Path] = []
    for origin, path in candidates():
        tried.append(path / relative)
        if tried[-1].is_file():
            return tried[-1], tried
        if origin == "VGPU_INSTALL_DIR":
            break
    return None, tried


def native_dirs() -> list[Path]:
    """Folders that may hold the development build of vgpu._native (<build>/python/vgpu)."""
    dirs = []
    build = build_dir()
    if build is not None:
        dirs.append(build / "python" / "vgpu")
    return [d for d in dirs if d.is_dir()]


def describe() -> str:
    """One line per place looked at, for error messages."""
    lines = [f"  {origin}: {path}{'' if path.exists() else ' (missing)'}" for origin, path in candidates()]
    return "\n".join(lines)
