#!/usr/bin/env bash
# Calibration runs for fakecuda's device model and the shim's overhead on a real GPU (issue 6).
#
#   OUT=calib bash tests/gpu/calibrate.sh [probe|calls|inproc|overhead|all]
#
# probe: tests/gpu/slice_probe (built with nvcc, or taken from build/gpu-deps/slice_probe) alone and in pairs of
#   processes: 1 ms, 100 us and 20 ms kernels, a full tenant beside a throttled one (duty 30 %), two throttled ones
#   (70 % + 30 %). Each kernel reports the time it ran, the gaps in which its context was switched out, and what a
#   CUDA event pair around it said (tests/gpu/slice_probe.cu). Analysed by tests/gpu/calibrate.py.
# calls: the host cost of each driver call on the launch path, and of a launch, without the shim and under it with
#   a 99 % compute cap (tests/gpu/call_costs.cu; 8 rounds in alternating order, pinned to one CPU).
# inproc: the launch path's cost inside one process, batches through the hook and straight into the driver alternating
#   (tests/gpu/launch_ab.cc), with and without the shim (the latter: both paths the driver's, an A/A check).
# overhead: builds the shim and vgpu-tenant (Release), then interleaves short rounds of an empty-kernel launch loop
#   (depth 64) and a launch+synchronize loop (depth 1), pinned to one CPU, under four configurations: no shim; the
#   shim with no limits; the shim with a memory limit only; the shim with a memory limit and a 99 % compute cap.
#   16 rounds each, ABCD order rotated per round, so a slow minute of the host hits every configuration.
# Skips (exit 0) where no GPU answers.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
what=${1:-all}
out=${OUT:-$repo/calib}
mkdir -p "$out"
if ! timeout 60 nvidia-smi -L >/dev/null 2>&1; then
  echo "calibrate: skipped, no NVIDIA GPU answers here"
  exit 0
fi
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit ${VGPU_COMMIT:-$(git -C "$repo" rev-parse HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  nvidia-smi compute-policy -l 2>&1 | head -20
  nproc
} >"$out/machine.txt" 2>&1

probe=$repo/build/gpu-deps/slice_probe
if [[ ! -x $probe ]]; then
  probe=$out/slice_probe
  nvcc -O2 -arch=sm_90 -o "$probe" "$repo/tests/gpu/slice_probe.cu" || exit 1
fi

pair() {  # pair NAME "ARGS A" "ARGS B"
  local name=$1
  # shellcheck disable=SC2086
  "$probe" $2 --out "$out/$name-a.jsonl" & local a=$!
  # shellcheck disable=SC2086
  "$probe" $3 --out "$out/$name-b.jsonl" & local b=$!
  wait $a $b
}

if [[ $what == probe || $what == all ]]; then
  echo "== slice probe"
  "$probe" --kernel-us 1000 --blocks 132 --seconds 2 --out "$out/alone-1ms.jsonl"
  "$probe" --kernel-us 100 --blocks 132 --seconds 2 --out "$out/alone-100us.jsonl"
  "$probe" --kernel-us 5 --blocks 1 --seconds 2 --out "$out/alone-5us.jsonl"
  pair pair-1ms "--kernel-us 1000 --blocks 132 --seconds 3" "--kernel-us 1000 --blocks 132 --seconds 3"
  pair pair-100us "--kernel-us 100 --blocks 132 --seconds 3" "--kernel-us 100 --blocks 132 --seconds 3"
  pair pair-20ms "--kernel-us 20000 --blocks 132 --seconds 4" "--kernel-us 20000 --blocks 132 --seconds 4"
  pair pair-1ms-1block "--kernel-us 1000 --blocks 1 --seconds 3" "--kernel-us 1000 --blocks 1 --seconds 3"
  pair full-vs-30 "--kernel-us 1000 --blocks 132 --seconds 3" "--kernel-us 1000 --blocks 132 --seconds 3 --duty 0.3"
  pair 70-vs-30 "--kernel-us 1000 --blocks 132 --seconds 3 --duty 0.7" \
    "--kernel-us 1000 --blocks 132 --seconds 3 --duty 0.3"
fi

build=/tmp/vgpu-calib-build
build_shim() {  # the shim and vgpu-tenant, Release, once
  [[ -f $build/lib/libvgpu.so && -x $build/bin/vgpu-tenant ]] && return 0
  local headers=()
  [[ -f $repo/build/gpu-deps/nvml-include/nvml.h ]] && headers=(-DNVML_INCLUDE_DIR="$repo/build/gpu-deps/nvml-include")
  { cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DVGPU_WERROR=OFF -DVGPU_BUILD_BENCH=OFF -DVGPU_PYTHON=OFF \
      -DVGPU_BUILD_TESTS=OFF "${headers[@]}" && cmake --build "$build" -j"$(nproc)" --target vgpu vgpu-tenant; } \
    >"$out/overhead-build.log" 2>&1 || { echo "build failed: $out/overhead-build.log"; exit 1; }
}

# The configurations `calls` and `inproc` run: none (no shim), shim_limits (this tree's build), and the builds named in
# VGPU_CALIB_SHIMS="NAME=PATH ..." (e.g. an older commit's, built elsewhere and carried), each a configuration of its
# own with the same 99 % cap, compared in the same rounds.
read_shims() {
  declare -gA shims=([shim_limits]="$build/lib/libvgpu.so")
  names=(none shim_limits)
  # VGPU_CALIB_TD=1: also this tree's build holding the cap by time division (docs/compute-sharing.md), alone on
  # the GPU: the cost of the release stage.
  if [[ ${VGPU_CALIB_TD:-} == 1 ]]; then
    shims[shim_td]="$build/lib/libvgpu.so"
    names+=(shim_td)
  fi
  for spec in ${VGPU_CALIB_SHIMS:-}; do
    shims[${spec%%=*}]=${spec#*=}
    names+=("${spec%%=*}")
  done
}

if [[ $what == calls || $what == all ]]; then
  # What each driver call on the shim's launch path costs the host, without the shim and under it with a 99 % cap
  # (the runtime's launches then go through the shim's launch path): tests/gpu/call_costs.cu.
  echo "== calls"
  build_shim
  calls=$repo/build/gpu-deps/call_costs
  if [[ ! -x $calls ]]; then
    calls=$out/call_costs
    nvcc -O2 -arch=sm_90 -o "$calls" "$repo/tests/gpu/call_costs.cu" -lcuda || exit 1
  fi
  cpu=$(( $(nproc) > 3 ? 3 : 0 ))
  read_shims
  : >"$out/call_costs.jsonl"
  for round in 0 1 2 3 4 5 6 7; do
    order=()  # rotated per round, so that a slow minute of the host hits every configuration
    for k in "${!names[@]}"; do order+=("${names[$(( (k + round) % ${#names[@]} ))]}"); done
    for config in "${order[@]}"; do
      env=(env -u LD_PRELOAD)
      [[ $config != none ]] && env+=(LD_PRELOAD="${shims[$config]}" CUDA_DEVICE_SM_LIMIT=99
        GPU_CORE_UTILIZATION_POLICY=force CUDA_DEVICE_MEMORY_SHARED_CACHE="$out/c-$config.cache")
      [[ $config == shim_td ]] && env+=(VGPU_COMPUTE_SHARING=time-division VGPU_SCHEDULE_FILE="$out/c-schedule")
      "${env[@]}" taskset -c "$cpu" "$calls" | sed "s/^{/{\"round\":$round,\"config\":\"$config\",/" >>"$out/call_costs.jsonl"
    done
  done
  echo "call cost lines: $(wc -l <"$out/call_costs.jsonl")"
fi

if [[ $what == inproc || $what == all ]]; then
  # The launch path's cost inside one process: batches through the shim's hook and straight into the driver's own
  # cuLaunchKernel alternate (tests/gpu/launch_ab.cc). Without the shim both paths are the driver's: the A/A check.
  echo "== inproc"
  build_shim
  ab=$out/launch_ab
  g++ -O2 -std=c++20 -I/usr/local/cuda/include "$repo/tests/gpu/launch_ab.cc" -o "$ab" -L/usr/local/cuda/lib64/stubs -lcuda >"$out/launch_ab-build.log" 2>&1 \
    || { echo "launch_ab did not build: $out/launch_ab-build.log"; exit 1; }
  cpu=$(( $(nproc) > 3 ? 3 : 0 ))
  read_shims  # (VGPU_CALIB_ROUNDS rounds, default 2)
  : >"$out/launch_ab.jsonl"
  for ((round = 0; round < ${VGPU_CALIB_ROUNDS:-2}; round++)); do  # rotated per round
    for k in "${!names[@]}"; do
      config=${names[$(( (k + round) % ${#names[@]} ))]}
      env=(env -u LD_PRELOAD)
      [[ $config != none ]] && env+=(LD_PRELOAD="${shims[$config]}" CUDA_DEVICE_SM_LIMIT=99
        GPU_CORE_UTILIZATION_POLICY=force CUDA_DEVICE_MEMORY_SHARED_CACHE="$out/ab-$config.cache")
      [[ $config == shim_td ]] && env+=(VGPU_COMPUTE_SHARING=time-division VGPU_SCHEDULE_FILE="$out/ab-schedule")
      "${env[@]}" taskset -c "$cpu" "$ab" "$repo/sim/tenant/spin.ptx" \
        | sed "s/^{/{\"round\":$round,\"config\":\"$config\",/" >>"$out/launch_ab.jsonl"
    done
  done
  grep -v '"calls"' "$out/launch_ab.jsonl"
fi

if [[ $what == overhead || $what == all ]]; then
  echo "== overhead"
  build_shim
  tenant=$build/bin/vgpu-tenant
  # What a clock read costs here (the shim reads CLOCK_MONOTONIC on every limited launch).
  printf '#include <stdio.h>\n#include <time.h>\nint main(void){struct timespec a,b,t;clock_gettime(CLOCK_MONOTONIC,&a);for(int i=0;i<1000000;i++)clock_gettime(CLOCK_MONOTONIC,&t);clock_gettime(CLOCK_MONOTONIC,&b);printf("%%.1f\\n",((b.tv_sec-a.tv_sec)*1e9+(b.tv_nsec-a.tv_nsec))/1e6);return 0;}\n' \
    | cc -O2 -x c -o "$out/clockbench" - && echo "clock_gettime(CLOCK_MONOTONIC): $("$out/clockbench") ns; clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)" \
    | tee -a "$out/machine.txt"
  shim=$build/lib/libvgpu.so
  cpu=$(( $(nproc) > 3 ? 3 : 0 ))
  configs=(none shim shim_mem shim_limits)
  run_config() {  # run_config CONFIG ARGS...
    local config=$1; shift
    local -a env=(env -u LD_PRELOAD)
    case $config in
      shim) env+=(LD_PRELOAD="$shim") ;;
      shim_mem) env+=(LD_PRELOAD="$shim" CUDA_DEVICE_MEMORY_LIMIT=70g CUDA_DEVICE_MEMORY_SHARED_CACHE="$out/o-mem.cache") ;;
      shim_limits) env+=(LD_PRELOAD="$shim" CUDA_DEVICE_MEMORY_LIMIT=70g CUDA_DEVICE_SM_LIMIT=99
                         GPU_CORE_UTILIZATION_POLICY=force CUDA_DEVICE_MEMORY_SHARED_CACHE="$out/o-lim.cache") ;;
    esac
    "${env[@]}" taskset -c "$cpu" "$tenant" "$@"
  }
  : >"$out/overhead.jsonl"
  for round in $(seq 0 15); do
    for k in 0 1 2 3; do
      config=${configs[$(( (k + round) % 4 ))]}
      rate=$(run_config "$config" --seconds 1 --kernel-us 1 --depth 64 | tail -n 1)
      sync=$(run_config "$config" --seconds 1 --kernel-us 1 --depth 1 | tail -n 1)
      echo "{\"round\":$round,\"config\":\"$config\",\"depth64\":$rate,\"depth1\":$sync}" >>"$out/overhead.jsonl"
    done
  done
  echo "overhead rounds: $(wc -l <"$out/overhead.jsonl")"
fi
python3 "$repo/tests/gpu/calibrate.py" "$out" | tee "$out/summary.md"
