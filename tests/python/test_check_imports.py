"""vgpu-core/hooks/check_imports.py, the check behind `shim.imports_nothing_that_changes_the_process`: it must fail
on what it exists to catch (a call that ends the process, a signal sent, a forbidden import), or the ctest that runs
it proves nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECK = REPO_ROOT / "vgpu-core" / "hooks" / "check_imports.py"


def run_check(library: Path, sources: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(library), str(sources)], capture_output=True, text=True)


@pytest.fixture
def shim(build_dir: Path) -> Path:
    path = build_dir / "lib" / "libvgpu.so"
    if not path.exists():
        pytest.skip(f"{path} is not built")
    return path


@pytest.mark.parametrize("line", ["std::exit(1);", "exit(3);", "::abort();", "_exit(0);", "quick_exit(2);",
                                  "kill(pid, SIGTERM);", "kill(holder, 9);", "prctl(PR_SET_NAME, name, 0, 0, 0);",
                                  "prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);"])
def test_a_call_that_ends_or_signals_a_process_fails_the_check(shim, tmp_path, line):
    (tmp_path / "bad.cc").write_text(f"void f(int pid, int holder) {{\n  {line}\n}}\n")
    result = run_check(shim, tmp_path)
    assert result.returncode == 1, result.stdout
    assert "bad.cc:2" in result.stdout


@pytest.mark.parametrize("line", ["kill(pid, 0);", "// exit(1) in a comment", "worker.exit(1);", "p->abort();",
                                  "Limiter::exit(1);", "prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0);",
                                  "prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);"])
def test_what_changes_nothing_passes_the_check(shim, tmp_path, line):
    (tmp_path / "fine.cc").write_text(f"void f(int pid) {{\n  {line}\n}}\n")
    result = run_check(shim, tmp_path)
    assert result.returncode == 0, result.stdout


def test_a_library_that_imports_exit_fails_the_check(tmp_path):
    """A small library that calls exit() stands in for a shim that would: its import is reported by name."""
    source = tmp_path / "exits.c"
    source.write_text("#include <stdlib.h>\nvoid leave(void) { exit(1); }\n")
    shared = tmp_path / "libexits.so"
    built = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shared), str(source)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no C compiler to build the sample library: {built.stderr[-300:]}")
    empty = tmp_path / "sources"
    empty.mkdir()
    result = run_check(shared, empty)
    assert result.returncode == 1
    assert "imports exit" in result.stdout
