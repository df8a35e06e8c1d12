#!/usr/bin/env bash
# What PyTorch's kernels really ran under each cap (CUPTI through torch.profiler: tests/gpu/kernel_time_probe.py),
# beside the host's NVML utilization over the same seconds: x.add_ on 1M elements (launch-bound, ~4 us kernels) and
# the bf16 8192 matmul (1.6 ms kernels), uncapped and capped.
#
#   OUT=dir SHIM=path/libvgpu.so bash tests/gpu/kernel_time.sh
#
# Writes $OUT/kernel-time.jsonl, one probe line per run (with "cap"; "rc" and "stderr" where it failed). Environment:
# KERNEL_TIME_SECONDS (default 3), KERNEL_TIME_RUNS ("workload:cap ..."; cap 0 = no shim), KERNEL_TIME_SHARING
# (time-division: the capped runs hold their cap by time division, docs/compute-sharing.md; default the limiter).
# Skips (exit 0) where no GPU answers.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$repo/kernel-time}
mkdir -p "$out"
if ! timeout 60 nvidia-smi -L >/dev/null 2>&1; then
  echo "kernel_time: skipped, no NVIDIA GPU answers here"
  exit 0
fi
: "${SHIM:?the shim to preload (libvgpu.so)}"
seconds=${KERNEL_TIME_SECONDS:-3}
runs=${KERNEL_TIME_RUNS:-"add:0 add:10 add:30 add:50 mm8192:0 mm8192:50 mm8192:90 add:0"}
jsonl=$out/kernel-time.jsonl
: >"$jsonl"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for run in $runs; do
  which=${run%%:*} cap=${run##*:}
  env=(env -u LD_PRELOAD)
  if [[ $cap != 0 ]]; then
    env=(env LD_PRELOAD="$SHIM" CUDA_DEVICE_SM_LIMIT="$cap" GPU_CORE_UTILIZATION_POLICY=force
         CUDA_DEVICE_MEMORY_SHARED_CACHE="$tmp/$which-$cap.region")
    [[ ${KERNEL_TIME_SHARING:-} == time-division ]] && env+=(VGPU_COMPUTE_SHARING=time-division
      VGPU_SCHEDULE_FILE="$tmp/schedule")
  fi
  "${env[@]}" timeout 180 python3 "$repo/tests/gpu/kernel_time_probe.py" --which "$which" --seconds "$seconds" \
    >"$tmp/stdout" 2>"$tmp/stderr"
  rc=$?
  python3 - "$cap" "$rc" "$tmp/stdout" "$tmp/stderr" >>"$jsonl" <<'PY'
import json, os, sys
cap, rc, stdout, stderr = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
lines = [l for l in open(stdout, errors="replace") if l.startswith("{")]
row = json.loads(lines[-1]) if lines else {}
row.update(cap=cap, rc=rc)
if rc != 0 or not lines:
    row["stderr"] = open(stderr, errors="replace").read()[-800:]
row["sharing"] = os.environ.get("KERNEL_TIME_SHARING") or "limiter"
print(json.dumps(row))
PY
  echo "kernel_time: $which at cap $cap: $(tail -1 "$jsonl" | cut -c1-400)"
done
