"""PyTorch on fakecuda, with and without the shim (issue 23, stage 3; docs/fakecuda-runtime.md).

PyTorch's CUDA wheels weigh 4.6 GB installed (torch 2.11.0 and its nvidia-* libraries), so CI does not install
them: `bash .ci/nightly-torch` does, then runs this file. Everywhere else it is skipped, saying so. Each test runs
PyTorch in a process of its own on a fake machine of its own; kernels do not compute there, so the tests check what
a platform engineer relies on: the calls succeed, copies keep their bytes, the slice shows and the limits hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fakegpu_harness import rate_ratio
from vgpu_fixtures import REPO_ROOT

pytest.importorskip("torch", reason="PyTorch is not installed: bash .ci/nightly-torch installs it and runs these")

CONTEXT_MIB = 518  # the h100-80gb preset's context, charged to the container under the shim



EVERYDAY = """
import json, torch
out = {"available": torch.cuda.is_available(), "devices": torch.cuda.device_count()}
free_start, total = torch.cuda.mem_get_info()
x = torch.arange(1 << 20, dtype=torch.float32)
d = x.cuda()
out["copy_kept"] = bool(torch.equal(d.cpu(), x))               # the bytes are real
out["elementwise"] = list((d * 2 + 1).shape)
a = torch.ones(512, 512, device="cuda")
out["matmul"] = list((a @ a).shape)                             # cuBLAS
out["linear"] = list(torch.relu(torch.nn.Linear(512, 512).cuda()(a)).shape)
static = torch.zeros(1024, device="cuda")
side = torch.cuda.Stream()
with torch.cuda.stream(side):                                   # warm-up off the capture stream, as PyTorch asks
    static.add_(1)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static.mul_(2)
graph.replay()
torch.cuda.synchronize()
out["graph"] = True
held, error = [], None
try:
    while True:
        held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError:
    error = "OutOfMemoryError"
out.update(held_mib=len(held) * 256, oom=error, total_mib=total >> 20, free_start_mib=free_start >> 20)
del held
torch.cuda.empty_cache()
out["free_after_release_mib"] = torch.cuda.mem_get_info()[0] >> 20
print(json.dumps(out))
"""


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable-segments"])
def test_pytorch_runs_tensors_a_matmul_and_a_graph_on_fakecuda(fake_gpu, expandable):
    fake_gpu.env["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{expandable}"
    seen = fake_gpu.run_py(EVERYDAY, timeout=300).json
    print(f"\n{seen}")
    assert seen["available"] and seen["devices"] == 1, seen
    assert seen["copy_kept"] and seen["graph"], seen
    assert seen["matmul"] == [512, 512] and seen["linear"] == [512, 512], seen
    assert seen["total_mib"] == 81079 and seen["oom"] == "OutOfMemoryError", seen


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable-segments"])
def test_pytorch_is_held_to_its_memory_limit(fake_gpu, shim_path, expandable):
    fake_gpu.env["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{expandable}"
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_MEMORY_LIMIT="4g")
    seen = fake_gpu.run_py(EVERYDAY, timeout=300).json
    print(f"\n{seen}")
    assert seen["total_mib"] == 4096 and seen["free_start_mib"] == 4096 - CONTEXT_MIB, seen
    assert seen["oom"] == "OutOfMemoryError", seen
    # The context, the tensors made before, the modules loaded, and as many 256 MiB blocks as fit beside them.
    assert 3072 <= seen["held_mib"] <= (4096 - CONTEXT_MIB) // 256 * 256, seen
    assert seen["free_after_release_mib"] >= seen["held_mib"], "empty_cache gave the blocks back"


BURN = """
import json, sys, time, torch
x = torch.zeros(32, device="cuda")
x.add_(1); torch.cuda.synchronize()                 # its kernel loaded before the clock starts
seconds, launched, start = float(sys.argv[1]), 0, time.monotonic()
while time.monotonic() - start < seconds:
    for _ in range(4):
        x.add_(1)
    torch.cuda.synchronize()
    launched += 4
print(json.dumps({"kernels": launched, "seconds": time.monotonic() - start}))
"""


def test_pytorchs_kernels_are_held_to_the_compute_cap(fake_gpu, shim_path):
    fake_gpu.env["FAKECUDA_DEFAULT_KERNEL_NS"] = "1000000"  # every kernel 1 ms a wave; x.add_ is one wave
    free = fake_gpu.run_py(BURN, "2", timeout=300).json
    fake_gpu.use_shim(shim_path, CUDA_DEVICE_SM_LIMIT="30", GPU_CORE_UTILIZATION_POLICY="force")
    capped = fake_gpu.run_py(BURN, "3", timeout=300).json
    free_rate, ratio = rate_ratio(free, capped)
    print(f"\nPyTorch: {free_rate:.0f} kernels/s free, {ratio:.3f} of that at a 30 % cap")
    assert free_rate > 600, f"1 ms kernels in groups of four ran at {free_rate:.0f}/s"
    assert 0.20 <= ratio <= 0.36, f"at a 30 % cap PyTorch ran {ratio:.3f} of its free rate"


def _python_with_vgpus_dependencies() -> str:
    """A Python that can run `vgpu` (numpy, pandas, matplotlib): this one if it can, else $VGPU_PYTHON
    (.ci/nightly-torch sets it to the python3 .ci/setup installed them for: its virtual environment has PyTorch only),
    else python3 on PATH."""
    import importlib.util
    import shutil

    if all(importlib.util.find_spec(name) is not None for name in ("numpy", "pandas", "matplotlib")):
        return sys.executable
    return os.environ.get("VGPU_PYTHON") or shutil.which("python3") or "python3"


def test_a_pytorch_job_in_a_scenario_keeps_its_share_beside_vgpu_tenant(tmp_path):
    """Stage 4 with PyTorch: an inference loop (scenarios/programs/torch_loop.py) as a scenario's `program:`, capped at
    30 % and 4 GiB, beside a vgpu-tenant container at 60 %, under time division; `vgpu run` judges both shares (the
    job's GPU time read from the fake GPU) and that the job ended ok, and exits 0 only if all held."""
    program = REPO_ROOT / "scenarios" / "programs" / "torch_loop.py"
    scenario = tmp_path / "torch-beside-tenant.yaml"
    scenario.write_text(f"""name: torch-beside-tenant
gpu: h100-80gb
duration: 10s
settle: 4s
sharing: time-division
tenants:
  - name: torch
    limits: {{nvidia.com/gpucores: 30, nvidia.com/gpumem: 4Gi}}
    processes:
      - program: [{json.dumps(sys.executable)}, {json.dumps(str(program))}]
    expect:
      - share: 30
  - name: spin
    limits: {{nvidia.com/gpucores: 60}}
    processes:
      - work: [{{kernels: 1ms}}]
    expect:
      - share: 60
""")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "python"))
    result = subprocess.run([_python_with_vgpus_dependencies(), "-m", "vgpu", "run", str(scenario), "--quiet",
                             "--plot", str(tmp_path / "torch-beside-tenant.png")],
                            capture_output=True, text=True, env=env, timeout=180)
    print(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
