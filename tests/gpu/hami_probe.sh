#!/usr/bin/env bash
# Issue 21 on a GPU, in one command (docs/gpu-runs/2026-11-29-hami.md):
#   1. what HAMi's monitor would read from a capped PyTorch job's cache file, beside nvidia-smi, and HAMi's block
#      (recent_kernel = -1) obeyed (tests/gpu/hami_probe.py);
#   2. what the HAMi side of a launch costs (hami_feedback.cc: one shared word read per launch, the clock every 64th):
#      launch_ab (tests/gpu/launch_ab.cc) under libvgpu.so as built, and under the same tree with BeforeLaunch
#      returning at once, alternated three times, uncapped (a memory limit only) and capped (99 %).
#
#   OUT=dir bash tests/gpu/hami_probe.sh      (carry build/gpu-deps through the device tool: see tests/gpu/run.sh)
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$repo/gpu-report}
mkdir -p "$out"
headers=()
[[ -f $repo/build/gpu-deps/nvml-include/nvml.h ]] && headers=(-DNVML_INCLUDE_DIR="$repo/build/gpu-deps/nvml-include")

build_shim() {  # build_shim SOURCE_TREE BUILD_DIR
  cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -DVGPU_WERROR=OFF -DVGPU_BUILD_TESTS=OFF -DVGPU_BUILD_BENCH=OFF \
    -DVGPU_PYTHON=OFF "${headers[@]}" >>"$out/build.log" 2>&1 &&
    cmake --build "$2" -j"$(nproc)" --target vgpu >>"$out/build.log" 2>&1
}

# The B tree: the same sources, BeforeLaunch returning at once.
rm -rf /tmp/vgpu-b && mkdir -p /tmp/vgpu-b
tar -C "$repo" --exclude=./build --exclude=./.git -cf - . | tar -C /tmp/vgpu-b -xf -
python3 - <<'EOF' || exit 1
from pathlib import Path
p = Path("/tmp/vgpu-b/vgpu-core/hooks/hami_feedback.cc")
s = p.read_text()
old = "void BeforeLaunch() {\n"
assert old in s
p.write_text(s.replace(old, old + "  return;  // B: the HAMi side of a launch left out\n", 1))
EOF
build_shim "$repo" /tmp/vgpu-a-build || { echo "build A failed"; tail -30 "$out/build.log"; exit 1; }
build_shim /tmp/vgpu-b /tmp/vgpu-b-build || { echo "build B failed"; tail -30 "$out/build.log"; exit 1; }
a=/tmp/vgpu-a-build/lib/libvgpu.so b=/tmp/vgpu-b-build/lib/libvgpu.so
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/machine.txt"

echo "== 1. HAMi's reading of a capped PyTorch job, and its block"
timeout 120 python3 "$repo/tests/gpu/hami_probe.py" --shim "$a" --out "$out" | tail -n 40

echo "== 2. launch cost A/B"
g++ -O2 -std=c++20 -I/usr/local/cuda/include "$repo/tests/gpu/launch_ab.cc" -o /tmp/launch_ab -lcuda \
  -L/usr/local/cuda/lib64/stubs 2>>"$out/build.log" || { echo "launch_ab build failed"; exit 1; }
cpu=$(( $(nproc) > 3 ? 3 : 0 ))  # one CPU, as tests/gpu/calibrate.sh pins it
for round in 1 2 3; do
  for mode in uncapped capped; do
    for variant in a b; do
      lib=$a; [[ $variant == b ]] && lib=$b
      extra=(); [[ $mode == capped ]] && extra=(CUDA_DEVICE_SM_LIMIT=99 GPU_CORE_UTILIZATION_POLICY=force)
      rm -f /tmp/vgpu-ab.cache
      env LD_PRELOAD="$lib" CUDA_DEVICE_MEMORY_LIMIT=8g CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/vgpu-ab.cache "${extra[@]}" \
        timeout 120 taskset -c "$cpu" /tmp/launch_ab "$repo/sim/tenant/spin.ptx" 2>>"$out/launch_ab.stderr" |
        python3 -c 'import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        print(json.dumps({"variant": sys.argv[1], "mode": sys.argv[2], "round": int(sys.argv[3]), **json.loads(line)}))' \
          "$variant" "$mode" "$round" >>"$out/launch_ab.jsonl"
    done
  done
done
python3 - "$out/launch_ab.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"added"' in line]
for mode in ("uncapped", "capped"):
    for pattern in ("16 deep", "launch+sync"):
        for variant in ("a", "b"):
            got = [r for r in rows if r["mode"] == mode and r["variant"] == variant and r["pattern"] == pattern]
            print(f"{mode:9} {pattern:12} {variant}: hooked_ns {[r['hooked_ns'] for r in got]} "
                  f"driver_ns {[r['driver_ns'] for r in got]} added {[r['added'] for r in got]}")
EOF
