#!/usr/bin/env bash
# The CUDA runtime programs of tests/runtime on a real GPU, alone and under the shim, as
# tests/python/test_runtime_programs.py runs them on fakecuda (issue 23). Run after tests/gpu/run.sh has built
# build/gpu-suite (the shim); needs nvcc. One JSON line per run in $OUT/runtime.jsonl, a summary on stdout.
#
#   OUT=/tmp/out bash tests/gpu/runtime.sh
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$repo/gpu-report}
shim=${VGPU_SHIM:-$repo/build/gpu-suite/lib/libvgpu.so}
bin=$(mktemp -d)
mkdir -p "$out"
results=$out/runtime.jsonl
: >"$results"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
for name in basics fill hami; do
  for runtime in static shared; do
    "$nvcc" -O2 -arch=sm_90 -cudart=$runtime -I "$repo/tests/runtime" -o "$bin/$name-$runtime" \
      "$repo/tests/runtime/$name.cu" || { echo "nvcc failed for $name ($runtime)"; exit 1; }
  done
done
# run LABEL ENV... -- PROGRAM ARGS...: one line {"label", "rc", "out"} (the program's JSON line, or its stderr's end).
run() {
  local label=$1 envs=() rc line
  shift
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout 120 "$@" >"$bin/out" 2>"$bin/err"
  rc=$?
  line=$(tail -1 "$bin/out")
  [[ -n $line ]] || line=$(tail -1 "$bin/err" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')
  printf '{"label": "%s", "rc": %d, "out": %s}\n' "$label" "$rc" "$line" | tee -a "$results"
}
limit=(LD_PRELOAD="$shim" CUDA_DEVICE_MEMORY_LIMIT=4g CUDA_DEVICE_MEMORY_SHARED_CACHE="$bin/region")
for runtime in static shared; do
  run "basics $runtime alone" -- "$bin/basics-$runtime"
  run "basics $runtime under a 4 GiB limit" "${limit[@]}" -- "$bin/basics-$runtime"
  for kind in device managed pooled; do
    rm -f "$bin/region"
    run "fill $kind $runtime under a 4 GiB limit" "${limit[@]}" -- "$bin/fill-$runtime" "$kind" 256
  done
done
for kind in device managed host hostalloc register; do
  rm -f "$bin/region"
  run "hami alloc $kind alone" -- "$bin/hami-static" alloc "$kind"
  run "hami alloc $kind under a 2 GiB limit" LD_PRELOAD="$shim" CUDA_DEVICE_MEMORY_LIMIT=2g \
    CUDA_DEVICE_MEMORY_SHARED_CACHE="$bin/region" -- "$bin/hami-static" alloc "$kind"
done
run "hami launch under a 2 GiB limit" LD_PRELOAD="$shim" CUDA_DEVICE_MEMORY_LIMIT=2g \
  CUDA_DEVICE_MEMORY_SHARED_CACHE="$bin/region2" -- "$bin/hami-shared" launch
rm -rf "$bin"
