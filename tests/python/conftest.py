"""pytest fixtures: a fresh fakecuda machine per test, on which real clients (pynvml, cuda.bindings) and vgpu-tenant run.

Which build is tested: $VGPU_BUILD_DIR, else <repo>/build/default. Tests that need the fake GPU
are skipped, with the reason, when <build>/lib/libcuda.so.1 is missing; tenant tests also
when <build>/bin/vgpu-tenant is.

How the real clients find fakecuda (checked against cuda-bindings 13.5.0, cuda-pathfinder 1.9.0
and nvidia-ml-py 13.615.71):
- nvidia-ml-py calls ctypes.CDLL("libnvidia-ml.so.1"): a plain dlopen, so LD_LIBRARY_PATH decides.
- cuda.bindings.driver loads the driver through cuda.pathfinder.load_nvidia_dynamic_lib("cuda").
  libcuda is a "driver" library there: pathfinder skips its site-packages/conda/CUDA_PATH search
  and either reuses a libcuda.so.1 already mapped into the process or calls dlopen("libcuda.so.1"),
  so LD_LIBRARY_PATH decides as well; no other variable is needed. It then dlsym()s only
  cuGetProcAddress_v2 and asks it for every other entry point by base name and CUDA version
  (e.g. "cuMemAlloc" at 3020 must give cuMemAlloc_v2), with flags CU_GET_PROC_ADDRESS_DEFAULT, or
  PER_THREAD_DEFAULT_STREAM when CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1. So fakecuda's
  cuGetProcAddress_v2 carries every cuda.bindings call made here.
The test test_cuda_bindings.py::test_clients_load_fakecuda_from_build checks both in /proc/self/maps.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fakegpu_harness import FakeGpu

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("VGPU_BUILD_DIR", REPO_ROOT / "build" / "default")).resolve()
FAKE_LIBCUDA = BUILD_DIR / "lib" / "libcuda.so.1"
FAKE_LIBNVML = BUILD_DIR / "lib" / "libnvidia-ml.so.1"
TENANT = BUILD_DIR / "bin" / "vgpu-tenant"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"vgpu build: {BUILD_DIR} (libcuda.so.1 {'found' if FAKE_LIBCUDA.exists() else 'MISSING'}, "
            f"vgpu-tenant {'found' if TENANT.exists() else 'MISSING'})"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if FAKE_LIBCUDA.exists():
        return
    skip = pytest.mark.skip(reason=f"fakecuda is not built: {FAKE_LIBCUDA} is missing (build the tree, "
                                   f"or point VGPU_BUILD_DIR at a build folder that has lib/libcuda.so.1)")
    for item in items:
        if "fake_gpu" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture
def build_dir() -> Path:
    return BUILD_DIR


def built_library(fake_gpu, name: str, why_missing: str = "") -> Path:
    """<build>/lib/`name` of this machine's build, or skips the test saying it is not built."""
    path = fake_gpu.library_dir / name
    if not path.exists():
        pytest.skip(f"{path} is not built{why_missing}")
    return path


@pytest.fixture
def shim_path(fake_gpu) -> Path:
    """The shim, libvgpu.so, of the build under test."""
    return built_library(fake_gpu, "libvgpu.so")


@pytest.fixture
def fake_gpu(tmp_path: Path, build_dir: Path):
    """A fake machine of this test's own (default: one h100-80gb); see fakegpu_harness.FakeGpu."""
    gpu = FakeGpu(build_dir=build_dir, work_dir=tmp_path)
    yield gpu
    gpu.stop_all()


@pytest.fixture
def tenant_available(build_dir: Path) -> None:
    """Skips a test that needs vgpu-tenant when the build has none yet."""
    if not (build_dir / "bin" / "vgpu-tenant").exists():
        pytest.skip(f"vgpu-tenant is not built: {build_dir / 'bin' / 'vgpu-tenant'} is missing")
