"""`vgpu smi` where NVML is missing or does not start (what it looked for, the ways on) and `vgpu smi --fake`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vgpu_fixtures import BUILD_DIR, cli_env, run_cli

pytest.importorskip("pynvml", reason="vgpu smi reads NVML through nvidia-ml-py (tests/python/requirements.txt)")

FAKE_NVML = BUILD_DIR / "lib" / "libnvidia-ml.so.1"
requires_fake_nvml = pytest.mark.skipif(not FAKE_NVML.is_file(), reason=f"fakecuda is not built: {FAKE_NVML} is "
                                                                        "missing (cmake --build --preset default)")
# Every variable that would choose another NVML or another fake machine than the test's.
CHOOSERS = ("LD_LIBRARY_PATH", "LD_PRELOAD", "FAKECUDA_STATE", "FAKECUDA_DEVICES", "FAKECUDA_FAULTS",
            "VGPU_INSTALL_DIR")


def smi(*args: str, **variables: str) -> subprocess.CompletedProcess:
    """`python -m vgpu smi ARGS` with none of CHOOSERS inherited, then `variables` set."""
    environment = {k: v for k, v in cli_env().items() if k not in CHOOSERS} | variables
    return subprocess.run([sys.executable, "-m", "vgpu", "smi", *args], capture_output=True, text=True, timeout=120,
                          env=environment)


def system_has_nvml() -> bool:
    """Whether the loader finds a libnvidia-ml.so.1 with LD_LIBRARY_PATH unset (a machine with the NVIDIA driver)."""
    environment = {k: v for k, v in cli_env().items() if k not in CHOOSERS}
    return subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"], env=environment,
                          capture_output=True, timeout=60).returncode == 0


def assert_ways_on(stderr: str) -> None:
    assert f"    vgpu smi --fake          the fake machine of fakecuda ({FAKE_NVML})" in stderr, stderr
    assert "    vgpu smi --region PATH   a container's region file (its CUDA_DEVICE_MEMORY_SHARED_CACHE)" in stderr


@requires_fake_nvml
def test_without_nvml_it_says_what_it_looked_for_and_the_ways_on():
    if system_has_nvml():
        pytest.skip("this machine's loader finds an NVIDIA driver's libnvidia-ml.so.1; NVML cannot be made missing")
    result = smi()
    assert result.returncode == 1 and result.stdout == "", result
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == ("vgpu smi: NVML is not available: libnvidia-ml.so.1 did not load: libnvidia-ml.so.1: "
                        "cannot open shared object file: No such file or directory"), result.stderr
    assert lines[1] == ("  looked for libnvidia-ml.so.1 (the NVIDIA driver's) through the dynamic loader, as pynvml "
                        "does: LD_LIBRARY_PATH=(unset), then /etc/ld.so.cache and the system library folders")
    assert_ways_on(result.stderr)
    assert len(lines) == 5, result.stderr  # one short block


@requires_fake_nvml
def test_an_nvml_whose_init_fails_is_named_with_the_file_that_was_loaded(tmp_path):
    # fakecuda's NVML, found first through LD_LIBRARY_PATH on any machine, refusing nvmlInit as a driver-less one does.
    result = smi(LD_LIBRARY_PATH=str(FAKE_NVML.parent), FAKECUDA_STATE=str(tmp_path / "machine.state"),
                 FAKECUDA_FAULTS="nvmlInitWithFlags:error=NVML_ERROR_DRIVER_NOT_LOADED")
    assert result.returncode == 1 and result.stdout == "", result
    assert "Traceback" not in result.stderr
    assert "vgpu smi: NVML is not available: nvmlInit failed: Driver Not Loaded\n" in result.stderr
    assert (f"  looked for libnvidia-ml.so.1 through the dynamic loader (LD_LIBRARY_PATH={FAKE_NVML.parent}): "
            f"loaded {FAKE_NVML}, whose nvmlInit failed\n") in result.stderr
    assert_ways_on(result.stderr)


def fake_machine_line(stdout: str) -> str:
    first = stdout.splitlines()[0]
    assert first.startswith("fakecuda: ") and first.endswith(f"; NVML from {FAKE_NVML}"), stdout
    return first


def device_rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"^\|\s+\d+\s+\S", line)]


@requires_fake_nvml
def test_fake_shows_a_fresh_fake_h100_and_removes_its_state():
    result = smi("--fake")
    assert result.returncode == 0, result.stderr
    line = fake_machine_line(result.stdout)
    state = re.search(r"FAKECUDA_STATE=(\S+), removed afterwards", line)
    assert line.startswith("fakecuda: a fresh machine of h100-80gb ") and state, line
    assert not Path(state.group(1)).exists()
    rows = device_rows(result.stdout)
    assert len(rows) == 1, result.stdout
    assert "NVIDIA H100 80GB HBM3" in rows[0] and "/ 81559MiB" in rows[0], rows
    assert "No running processes found" in result.stdout


@requires_fake_nvml
def test_fake_takes_the_devices_and_the_state_file_from_the_environment(tmp_path):
    state = tmp_path / "machine.state"
    result = smi("--fake", FAKECUDA_DEVICES="tesla-t4,h100-80gb:memory=16g", FAKECUDA_STATE=str(state))
    assert result.returncode == 0, result.stderr
    assert fake_machine_line(result.stdout) == f"fakecuda: FAKECUDA_STATE={state}; NVML from {FAKE_NVML}"
    rows = device_rows(result.stdout)
    assert len(rows) == 2, result.stdout
    assert "Tesla T4" in rows[0] and "/ 15360MiB" in rows[0], rows
    assert "NVIDIA H100 80GB HBM3" in rows[1] and "/ 16384MiB" in rows[1], rows
    assert state.is_file()  # a machine the user named is left for them


@requires_fake_nvml
def test_fake_machine_that_does_not_start(tmp_path):
    result = smi("--fake", FAKECUDA_DEVICES="h200")
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    assert "unknown preset 'h200'" in result.stderr  # fakecuda's own line
    assert f"vgpu smi --fake: fakecuda's NVML ({FAKE_NVML}) did not start: " in result.stderr


def test_fake_without_fakecuda_names_the_paths_tried_and_how_to_build(tmp_path):
    result = smi("--fake", VGPU_INSTALL_DIR=str(tmp_path / "nothing"))
    assert result.returncode == 1 and result.stdout == "", result
    assert result.stderr.splitlines()[0] == ("vgpu smi --fake: fakecuda's libnvidia-ml.so.1 is not built here; tried "
                                             f"{tmp_path / 'nothing' / 'lib' / 'libnvidia-ml.so.1'}")
    assert "`bash .ci/setup`, or `cmake --preset default && cmake --build --preset default`" in result.stderr


def test_fake_region_and_trace_summary_are_one_view_at_a_time(tmp_path):
    result = run_cli("smi", "--fake", "--region", str(tmp_path / "a.region"), timeout=60)
    assert result.returncode == 2 and "not allowed with argument --fake" in result.stderr
