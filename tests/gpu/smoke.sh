#!/usr/bin/env bash
# First real-GPU check of libvgpu.so (the full GPU suite is issue 6): builds the shim and vgpu-tenant on a GPU
# machine and runs memory and compute caps over the real driver, writing a report to $OUT (or ./gpu-smoke).
# Usage: bash tests/gpu/smoke.sh [extra cmake args]   (exits 0 with a note when no GPU is present)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-$PWD/gpu-smoke}
mkdir -p "$out"
if ! nvidia-smi -L >/dev/null 2>&1; then echo "no GPU: skipped" | tee "$out/report.md"; exit 0; fi
build=$PWD/build/gpu
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVGPU_BUILD_TESTS=OFF -DVGPU_BUILD_BENCH=OFF "$@" >"$out/cmake.log" 2>&1 \
  && cmake --build "$build" -j"$(nproc)" --target vgpu vgpu-tenant >>"$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
shim=$build/lib/libvgpu.so
tenant=$build/bin/vgpu-tenant
{
  echo "# vgpu GPU smoke report"
  echo "date: $(date -u +%FT%TZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} >"$out/report.md"
run() { echo "\$ $*" >>"$out/report.md"; "$@" >>"$out/report.md" 2>&1; echo "exit $?" >>"$out/report.md"; }
region() { echo "CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/vgpu-smoke-$1.region"; }
rm -f /tmp/vgpu-smoke-*.region
echo "## memory cap 4Gi (vgpu-tenant)" >>"$out/report.md"
run env LD_PRELOAD=$shim CUDA_DEVICE_MEMORY_LIMIT=4Gi $(region m1) $tenant --alloc 3Gi --kernels 10
run env LD_PRELOAD=$shim CUDA_DEVICE_MEMORY_LIMIT=4Gi $(region m2) $tenant --alloc 4Gi --kernels 10
echo "## memory cap 4Gi (PyTorch)" >>"$out/report.md"
for conf in "" "expandable_segments:True"; do
  run env LD_PRELOAD=$shim CUDA_DEVICE_MEMORY_LIMIT=4Gi $(region "t$RANDOM") PYTORCH_CUDA_ALLOC_CONF=$conf python3 -c "
import torch, subprocess, os
free, total = torch.cuda.mem_get_info()
print('alloc_conf', repr(os.environ.get('PYTORCH_CUDA_ALLOC_CONF')), 'mem_get_info free/total MiB', free >> 20, total >> 20)
blocks = []
try:
    while True:
        blocks.append(torch.empty(256 << 20, dtype=torch.uint8, device='cuda'))
except torch.OutOfMemoryError:
    pass
print('allocated before OOM MiB', len(blocks) * 256)
smi = subprocess.run(['nvidia-smi', '--query-compute-apps=pid,used_memory', '--format=csv,noheader'], capture_output=True, text=True).stdout
print('host view (nvidia-smi):', smi.strip())
"
done
echo "## compute caps (vgpu-tenant, force)" >>"$out/report.md"
for args in "--kernel-us 1000" "--kernel-us 20000 --blocks 132" "--kernel-us 5 --depth 8"; do
  run env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=30 GPU_CORE_UTILIZATION_POLICY=force $(region "c$RANDOM") $tenant --seconds 4 $args
done
echo "## 30/70 side by side (1 ms kernels)" >>"$out/report.md"
env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=30 GPU_CORE_UTILIZATION_POLICY=force $(region p30) $tenant --seconds 5 --kernel-us 1000 >"$out/p30.json" 2>&1 &
env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=70 GPU_CORE_UTILIZATION_POLICY=force $(region p70) $tenant --seconds 5 --kernel-us 1000 >"$out/p70.json" 2>&1
wait
cat "$out/p30.json" "$out/p70.json" >>"$out/report.md"
echo "## 30/70 side by side (20 ms persistent kernels, 132 blocks)" >>"$out/report.md"
env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=30 GPU_CORE_UTILIZATION_POLICY=force $(region q30) $tenant --seconds 5 --kernel-us 20000 --blocks 132 >"$out/q30.json" 2>&1 &
env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=70 GPU_CORE_UTILIZATION_POLICY=force $(region q70) $tenant --seconds 5 --kernel-us 20000 --blocks 132 >"$out/q70.json" 2>&1
wait
cat "$out/q30.json" "$out/q70.json" >>"$out/report.md"
echo "## default policy: a lone container capped at 30 % (1 ms kernels), then another arrives (force 70 %)" >>"$out/report.md"
run env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=30 GPU_CORE_UTILIZATION_POLICY=default $(region d1) $tenant --seconds 4 --kernel-us 1000
env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=30 GPU_CORE_UTILIZATION_POLICY=default $(region d30) $tenant --seconds 6 --kernel-us 1000 >"$out/d30.json" 2>&1 &
sleep 2
env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=70 GPU_CORE_UTILIZATION_POLICY=force $(region d70) $tenant --seconds 4 --kernel-us 1000 >"$out/d70.json" 2>&1
wait
echo "(the lender ran 6 s, the first 2 alone; the arrival ran 4 s beside it)" >>"$out/report.md"
cat "$out/d30.json" "$out/d70.json" >>"$out/report.md"
echo "## NVML utilization samples while a 1 ms-kernel tenant runs at 50 % (nvmlDeviceGetSamples)" >>"$out/report.md"
env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=50 GPU_CORE_UTILIZATION_POLICY=force $(region s50) $tenant --seconds 3 --kernel-us 1000 >"$out/s50.json" 2>&1 &
sleep 2.5
run python3 -c "
import pynvml as n, time
n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
kind, samples = n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, 0)
now = int(time.time() * 1e6)
print('value type', kind, 'count', len(samples))
for s in samples[-12:]: print('age_ms', (now - s.timeStamp) / 1000, 'value', s.sampleValue.uiVal)
"
wait
cat "$out/s50.json" >>"$out/report.md"
echo "## PyTorch bf16 matmul 8192 (throughput vs uncapped)" >>"$out/report.md"
matmul='
import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(5): a @ b
torch.cuda.synchronize(); start = time.time(); n = 0
while time.time() - start < 4:
    a @ b; n += 1
torch.cuda.synchronize(); print("matmuls/s", n / (time.time() - start))
'
run python3 -c "$matmul"
for share in 30 70; do run env LD_PRELOAD=$shim CUDA_DEVICE_SM_LIMIT=$share GPU_CORE_UTILIZATION_POLICY=force $(region "mm$share") python3 -c "$matmul"; done
cat "$out/report.md"
