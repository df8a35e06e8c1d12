#!/usr/bin/env bash
# Issue 19 on real GPUs: the host's view of a capped container (nvidia-smi's per-process memory, sampled every ~0.1 s
# from outside the shim) against its cap, for the frameworks and fill patterns users run; what each program could
# use of its slice; the shim's price per allocation; a DDP step with a memory limit only.
#
#   SHIM=path/to/libvgpu.so PROBE=path/to/driver_memory_probe STAGE=one|two OUT=folder bash tests/gpu/driver_memory.sh
#
# STAGE=one needs one GPU; STAGE=two needs two (CUDA_VISIBLE_DEVICES remaps, torchrun NCCL + DDP, DDP timing);
# STAGE=attribution two (the shim's log of what each stage made the driver take; DDP steps, 1000 a run).
# Each case prints its RESULT line(s) and the sampler's peaks (repro/lib.sh: case_run). Results are read in
# docs/gpu-runs/2026-11-27-driver-memory.md.
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
export T=$here/repro
export SHIM=${SHIM:?SHIM=libvgpu.so}
PROBE=${PROBE:?PROBE=driver_memory_probe}
export W=${W:-/tmp/w} OUT=${OUT:-/tmp/out}
export BUDGET=${BUDGET:-560}
# shellcheck source=repro/lib.sh
source "$T/lib.sh"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
region() { echo "CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/vgpu/$1.region"; }
cap() { echo "LD_PRELOAD=$SHIM CUDA_DEVICE_MEMORY_LIMIT=$1 $(region "$2")"; }

if [[ ${STAGE:-one} == one ]]; then
  # shellcheck disable=SC2046
  {
    # The shim's own account of the driver's memory as PyTorch warms up (LIBCUDA_LOG_LEVEL=3: each change logged).
    case_run torch_log 60 $(cap 4g tlog) LIBCUDA_LOG_LEVEL=3 -- python3 "$T/ctx_probe.py"
    case_run torch_2MiB_4g 60 $(cap 4g t2) -- python3 "$T/ctx_probe.py" fill
    case_run torch_2MiB_4g_expandable 60 $(cap 4g t2e) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- python3 "$T/ctx_probe.py" fill
    case_run torch_64MiB_4g 60 $(cap 4g t64) -- python3 "$T/alloc_torch.py" 0
    case_run torch_64MiB_4g_expandable 60 $(cap 4g t64e) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- python3 "$T/alloc_torch.py" 0
    case_run torch_64MiB_2g 60 $(cap 2g t64_2) -- python3 "$T/alloc_torch.py" 0
    case_run torch_64MiB_6g 60 $(cap 6g t64_6) -- python3 "$T/alloc_torch.py" 0
    case_run torch_2MiB_2g 60 $(cap 2g t2_2) -- python3 "$T/ctx_probe.py" fill
    case_run torch_2MiB_6g_expandable 60 $(cap 6g t2_6e) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- python3 "$T/ctx_probe.py" fill
    case_run jax_4g 60 $(cap 4g jax) -- python3 "$T/fw_jax.py"
    case_run cupy_4g 60 $(cap 4g cupy) -- python3 "$T/fw_cupy.py"
    case_run numba_4g 60 $(cap 4g numba) -- python3 "$T/fw_numba.py"
    case_run limits_fill_2g 30 $(cap 2g limits) -- "$PROBE" limits-fill
    SMI=0 case_run alloc_loop_none 30 -- "$PROBE" alloc-loop 20000
    SMI=0 case_run alloc_loop_shim_nolimit 30 LD_PRELOAD="$SHIM" -- "$PROBE" alloc-loop 20000
    SMI=0 case_run alloc_loop_shim_limit 30 $(cap 70g loop) -- "$PROBE" alloc-loop 20000
  }
elif [[ ${STAGE} == attribution ]]; then
  # Which calls made the driver take memory by itself, as the shim's reconciliation logged it (LIBCUDA_LOG_LEVEL=3):
  # PyTorch stage by stage (cuBLAS, cuDNN), NCCL + DDP on two GPUs; then the DDP step, 1000 steps a run.
  # shellcheck disable=SC2046
  {
    case_run torch_stages_log 90 $(cap 4g tstages) LIBCUDA_LOG_LEVEL=3 -- python3 "$here/driver_memory_torch.py"
    case_run ddp_8g_log 120 $(cap 8g ddplog) LIBCUDA_LOG_LEVEL=3 -- torchrun --standalone --nproc_per_node=2 "$T/nccl_ddp_nosync.py"
    for round in 1 2 3; do
      SMI=0 case_run "ddp1000_none_$round" 90 DDP_STEPS=1000 -- torchrun --standalone --nproc_per_node=2 "$T/nccl_ddp.py"
      SMI=0 case_run "ddp1000_memlimit_$round" 90 DDP_STEPS=1000 $(cap 70g "ddpk$round") -- torchrun --standalone --nproc_per_node=2 "$T/nccl_ddp.py"
    done
  }
else
  # shellcheck disable=SC2046
  {
    case_run torch_64MiB_cvd1_4g 60 $(cap 4g cvd1) CUDA_VISIBLE_DEVICES=1 -- python3 "$T/alloc_torch.py" 0
    case_run torch_64MiB_cvd10 90 LD_PRELOAD="$SHIM" $(region cvd10) CUDA_VISIBLE_DEVICES=1,0 CUDA_DEVICE_MEMORY_LIMIT_0=2g CUDA_DEVICE_MEMORY_LIMIT_1=4g -- python3 "$T/alloc_torch.py" 0,1
    case_run torch_2MiB_cvd1_expandable 60 $(cap 4g cvd1e) CUDA_VISIBLE_DEVICES=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- python3 "$T/ctx_probe.py" fill
    case_run ddp_8g 120 $(cap 8g ddp) -- torchrun --standalone --nproc_per_node=2 "$T/nccl_ddp_nosync.py"
    # A DDP step with a synchronize after each, memory limit only vs no shim, alternating (issue 19, item 6).
    for round in 1 2 3; do
      SMI=0 case_run "ddp_step_none_$round" 90 DDP_STEPS=100 -- torchrun --standalone --nproc_per_node=2 "$T/nccl_ddp.py"
      SMI=0 case_run "ddp_step_memlimit_$round" 90 DDP_STEPS=100 $(cap 70g "ddpm$round") -- torchrun --standalone --nproc_per_node=2 "$T/nccl_ddp.py"
    done
  }
fi
pack
