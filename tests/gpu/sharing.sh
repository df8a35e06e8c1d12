#!/usr/bin/env bash
# Issue 20 on real GPUs (docs/compute-sharing.md): containers sharing a GPU, and a job spanning two, under time
# division (VGPU_COMPUTE_SHARING=time-division) and under the event-pair limiter, in one command on a GPU machine.
#
#   VGPU_COMMIT=$(git rev-parse HEAD) OUT=out bash tests/gpu/sharing.sh STAGE[,STAGE...]
#
# Stages:
#   ddp     (two GPUs, torchrun) tests/gpu/repro/nccl_ddp_nosync.py: one container on both GPUs, all_reduce 256 MiB x50
#           and 20 DDP steps: uncapped, 50 % under the limiter, 50 % under time division (VGPU_DDP_RUNS runs, default
#           10), and 50 % under time division beside a second container at 50 % on GPU 0 (a bf16 matmul loop;
#           VGPU_DDP_BESIDE_RUNS runs, default 3); VGPU_DDP_TD_ONLY=1 leaves the uncapped and limiter runs out
#   pairs   tests/gpu/repro/mm_loop.py: a bf16 8192 matmul loop alone, then two containers on GPU 0: no shim, 50/50 and
#           30/70 under time division, 30/70 under the limiter (VGPU_PAIRS_TD_ONLY=1: the time-division pairs only;
#           MM_LOOP_PROFILE=1: each loop also says the share of the GPU's time its kernels held, by CUPTI; and with
#           VGPU_INTERVALS=1 the pair's timeline: where the time nobody ran falls, tests/gpu/handovers.py)
#   tenant  vgpu-tenant pairs under time division: 30/70 with 1 ms kernels, 30/70 and 50/50 with one-wave 20 ms ones
#   caps    one container's matmul loop at 10, 30, 50, 70, 90 % under time division (VGPU_CAPS: others)
#   default a `default` container at 40 % under time division alone, then beside a `force` one at 50 %
#   four    four containers' matmul loops at 10/20/30/40 %, the 40 % one of two processes: no shim, time division,
#           the limiter
#   four-mixed  the same with vgpu-tenant's spin kernel at sizes 5 us .. 20 ms under one function (132 blocks, each
#           size drawn at random; VGPU_FOUR_MIXED_SECONDS, default 30): no shim and time division
#   alone-mixed one container alone at 30 %, vgpu-tenant's spin kernel at sizes 5 us .. 20 ms under one function
#           (VGPU_ALONE_MIXED_SECONDS, default 20): under the limiter and under time division, and, where
#           VGPU_SHIM_BEFORE names another build's libvgpu.so, under time division with that one too
#   mixed-beside that container at 30 % beside a steady one at 70 % (vgpu-tenant, one-wave 1 ms kernels), under time
#           division (VGPU_ALONE_MIXED_SECONDS), and with VGPU_SHIM_BEFORE's build too where it is set
#   light   prompt service (docs/compute-sharing.md): a light service at 30 % (mm_loop.py with MM_LOOP_PAUSE_MS=20: one
#           bf16 8192 matmul, a synchronize, a 10-30 ms pause) alone without the shim, then beside a busy loop at 70 %:
#           no shim, the limiter, time division, and time division with VGPU_SHIM_BEFORE's build where it is set
#           (VGPU_LIGHT_SECONDS, default 15)
# Builds the shim and vgpu-tenant (Release) first (VGPU_SHARING_BUILD_DIR: use that build folder as it is). Each case appends one JSON line per process to $OUT/sharing.jsonl
# ({"case":..,"run":..,"result":{...}}); the log is $OUT/sharing.log. Skips (exit 0) where no GPU answers.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
stages=${1:-ddp,pairs,tenant,caps}
out=${OUT:-$repo/gpu-sharing}
mkdir -p "$out"
if ! timeout 60 nvidia-smi -L >/dev/null 2>&1; then
  echo "sharing: skipped, no NVIDIA GPU answers here"
  exit 0
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset LD_PRELOAD
work=$(mktemp -d /tmp/vgpu-sharing.XXXXXX)
# VGPU_SCHEDULE_TOOL=PROGRAM VGPU_SCHEDULE_BASE_MS=N: PROGRAM PATH N first makes the containers' schedule file with a
# base cycle of N ms (an experiment on the cycle's length; the shims otherwise make it with 20 ms).
if [[ -n ${VGPU_SCHEDULE_TOOL:-} ]]; then "$VGPU_SCHEDULE_TOOL" "$work/vgpu-schedule" "${VGPU_SCHEDULE_BASE_MS:?}" || exit 1; fi
log=$out/sharing.log
results=$out/sharing.jsonl
note() { echo "[$(date -u +%T)] $*" | tee -a "$log"; }
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit ${VGPU_COMMIT:-$(git -C "$repo" rev-parse HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit --format=csv
  python3 -c 'import torch; print("torch", torch.__version__)' 2>&1
} >"$out/machine.txt" 2>&1

build=${VGPU_SHARING_BUILD_DIR:-$repo/build/gpu-sharing}
headers=()
[[ -f $repo/build/gpu-deps/nvml-include/nvml.h ]] && headers=(-DNVML_INCLUDE_DIR="$repo/build/gpu-deps/nvml-include")
note "build (Release: the shim and vgpu-tenant)"
[[ -n ${VGPU_SHARING_BUILD_DIR:-} ]] || { cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DVGPU_WERROR=OFF -DVGPU_BUILD_BENCH=OFF -DVGPU_PYTHON=OFF \
    -DVGPU_BUILD_TESTS=OFF "${headers[@]}" && cmake --build "$build" -j"$(nproc)" --target vgpu vgpu-tenant; } \
  >"$out/build.log" 2>&1 || { note "build failed: see build.log"; exit 1; }
shim=$build/lib/libvgpu.so
tenant_bin=$build/bin/vgpu-tenant

# The environment of a container: capped at $2 % under $3 (time-division or limiter), its own region ($1), policy
# $4 (default: force).
container() {
  local name=$1 cap=$2 sharing=$3 policy=${4:-force}
  echo "LD_PRELOAD=$shim CUDA_DEVICE_MEMORY_SHARED_CACHE=$work/$name.cache CUDA_DEVICE_SM_LIMIT=$cap" \
       "GPU_CORE_UTILIZATION_POLICY=$policy VGPU_COMPUTE_SHARING=$sharing VGPU_SCHEDULE_FILE=$work/vgpu-schedule"
}
# record CASE RUN FILE: each RESULT line of FILE as a line of sharing.jsonl.
# (Two ranks' lines may interleave on one line: each "RESULT {...}" is decoded where it starts.)
record() {
  python3 - "$1" "$2" "$3" "$results" <<'PY'
import json, sys
case, run, path, results = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
text, found = open(path, errors="replace").read(), []
for chunk in text.split("RESULT ")[1:]:
    try:
        found.append(json.JSONDecoder().raw_decode(chunk)[0])
    except ValueError:
        pass
with open(results, "a") as out:
    for result in found or [None]:
        out.write(json.dumps({"case": case, "run": run, "result": result}) + "\n")
PY
  grep -q 'RESULT {' "$3" || tail -5 "$3" >>"$log"
}

ddp_run() {  # ddp_run CASE RUN ENV...
  local case=$1 run=$2; shift 2
  local file=$work/$case.$run.log
  # shellcheck disable=SC2068
  timeout -k 5 120 env $@ python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
    "$repo/tests/gpu/repro/nccl_ddp_nosync.py" >"$file" 2>&1
  record "$case" "$run" "$file"
  note "$case #$run: $(python3 -c 'import sys, json
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r["case"] == sys.argv[2] and r["run"] == int(sys.argv[3]) and r["result"]:
        print("rank", r["result"]["rank"], "step", r["result"]["ddp"]["ms_per_step"], "ms, all_reduce",
              r["result"]["allreduce"]["ms_per_op"], "ms;", end=" ")' "$results" "$case" "$run")"
}

mm_pair() {  # mm_pair CASE "ENV_A" ["ENV_B" [MEASURE_S]]   (no ENV_B: A alone; "" is no shim)
  local case=$1 ea=$2 eb=${3:-} meas=${4:-10} two=$(( $# >= 3 ))
  local start; start=$(python3 -c 'import time; print(round(time.time() + 12, 3))')
  # VGPU_PAIR_LOG=1: the first container of a pair says each wait (LIBCUDA_LOG_LEVEL=4) in its log (logs.tgz).
  [[ ${VGPU_PAIR_LOG:-} == 1 && -n $ea ]] && ((two)) && ea="$ea LIBCUDA_LOG_LEVEL=4"
  # VGPU_INTERVALS=1 (with MM_LOOP_PROFILE=1): each loop writes its kernels' intervals on CUPTI's clock, and the pair's
  # timeline (tests/gpu/handovers.py: handover gaps, time run together) is recorded as case "$case-timeline".
  local ka=() kb=()
  if [[ ${VGPU_INTERVALS:-} == 1 ]] && ((two)); then
    ka=(MM_LOOP_INTERVALS="$work/$case.A.kernels"); kb=(MM_LOOP_INTERVALS="$work/$case.B.kernels")
  fi
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((meas + 40)) env $ea "${ka[@]}" python3 "$repo/tests/gpu/repro/mm_loop.py" \
    "$start" 2 "$meas" >"$work/$case.A.log" 2>&1 &
  local pa=$!
  if ((two)); then
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((meas + 40)) env $eb "${kb[@]}" python3 "$repo/tests/gpu/repro/mm_loop.py" \
      "$start" 2 "$meas" >"$work/$case.B.log" 2>&1 &
    wait $!
  fi
  wait $pa
  record "$case" 0 "$work/$case.A.log"
  ((two)) && record "$case" 1 "$work/$case.B.log"
  note "$case: $(grep -h -o '"TFLOPs": [0-9.]*' "$work/$case".*.log | tr '\n' ' ')"
  if ((${#ka[@]})) && [[ -s $work/$case.A.kernels && -s $work/$case.B.kernels ]]; then
    { printf 'RESULT '; python3 "$repo/tests/gpu/handovers.py" "$work/$case.A.kernels" "$work/$case.B.kernels"; } \
      >"$work/$case.timeline" 2>&1
    record "$case-timeline" 0 "$work/$case.timeline"
    note "$case timeline: $(cat "$work/$case.timeline")"
  fi
}

# light_pair CASE "ENV_LIGHT" ["ENV_BUSY"|none [SECONDS]]: the light service (ENV_LIGHT sets MM_LOOP_PAUSE_MS) with a
# busy matmul loop beside it (ENV_BUSY, "" for one without the shim; none: alone, 10 s); each says its result.
light_pair() {
  local case=$1 el=$2 eb=${3-none} meas=${4:-15}
  if [[ $eb == none ]]; then mm_pair "$case" "$el"; else mm_pair "$case" "$el" "$eb" "$meas"; fi
  note "$case: $(grep -h -o '"request_ms": {[^}]*}' "$work/$case".A.log | tr '\n' ' ')"
}

# mm_four CASE SHARING: four containers' bf16 loops on GPU 0 at 10/20/30/40 %, the 40 % one of two processes sharing
# its region (issue 20, item 2, with one kernel size); SHARING none: no shim.
mm_four() {
  local case=$1 sharing=$2 meas=10 i=0 start
  start=$(python3 -c 'import time; print(round(time.time() + 15, 3))')
  local pids=()
  for spec in a:10 b:20 c:30 d:40 d:40; do
    local name=${spec%%:*} cap=${spec##*:} env=""
    [[ $sharing != none ]] && env=$(container "$case-$name" "$cap" "$sharing")
    # VGPU_FOUR_LOG=NAME: that container's shim says each wait (LIBCUDA_LOG_LEVEL=4) in its log (logs.tgz).
    [[ $sharing != none && ${VGPU_FOUR_LOG:-} == "$name" ]] && env="$env LIBCUDA_LOG_LEVEL=4"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((meas + 45)) env $env python3 "$repo/tests/gpu/repro/mm_loop.py" "$start" 2 \
      "$meas" >"$work/$case.$i.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  wait "${pids[@]}"
  for ((i = 0; i < 5; i++)); do record "$case" "$i" "$work/$case.$i.log"; done
  note "$case: $(grep -h -o '"TFLOPs": [0-9.]*' "$work/$case".?.log | tr '\n' ' ')"
}

# tenant_four_mixed CASE SHARING: as mm_four, with vgpu-tenant's kernels of 5 us .. 20 ms under one function; a
# container's share is the sum of its processes' busy_fraction.
tenant_four_mixed() {
  local case=$1 sharing=$2 seconds=${VGPU_FOUR_MIXED_SECONDS:-30} i=0
  local pids=()
  for spec in a:10 b:20 c:30 d:40 d:40; do
    local name=${spec%%:*} cap=${spec##*:} env=""
    [[ $sharing != none ]] && env=$(container "$case-$name" "$cap" "$sharing")
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((seconds + 60)) env $env "$tenant_bin" --blocks 132 --seconds "$seconds" \
      --seed $((i + 1)) --phase 'kernels=5us|50us|500us|5ms|20ms' >"$work/$case.$i.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  wait "${pids[@]}"
  for ((i = 0; i < 5; i++)); do
    sed -n 's/^{"pid"/RESULT {"pid"/p' "$work/$case.$i.log" >"$work/$case.$i.result"
    record "$case" "$i" "$work/$case.$i.result"
  done
  note "$case: $(grep -h -o '"busy_fraction":[0-9.]*' "$work/$case".?.log | tr '\n' ' ')"
}

# tenant_alone_mixed CASE SHARING [SHIM]: one container at 30 %, alone on GPU 0, sizes 5 us .. 20 ms under one function.
tenant_alone_mixed() {
  local case=$1 sharing=$2 seconds=${VGPU_ALONE_MIXED_SECONDS:-20} env
  env=$(container "$case" 30 "$sharing")
  [[ -n ${3:-} ]] && env=${env/LD_PRELOAD=$shim/LD_PRELOAD=$3}
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((seconds + 60)) env $env "$tenant_bin" --blocks 132 --seconds "$seconds" \
    --seed 1 --phase 'kernels=5us|50us|500us|5ms|20ms' >"$work/$case.0.log" 2>&1
  sed -n 's/^{"pid"/RESULT {"pid"/p' "$work/$case.0.log" >"$work/$case.0.result"
  record "$case" 0 "$work/$case.0.result"
  note "$case: $(grep -h -o '"busy_fraction":[0-9.]*' "$work/$case.0.log" | tr '\n' ' ')"
}

# record_tenant_pair CASE: vgpu-tenant's results of sides a and b ($work/CASE.{a,b}.log) as runs 0 and 1, then said.
record_tenant_pair() {
  local case=$1 side
  for side in a b; do
    sed -n 's/^{"pid"/RESULT {"pid"/p' "$work/$case.$side.log" >"$work/$case.$side.result"
    record "$case" "$([[ $side == a ]] && echo 0 || echo 1)" "$work/$case.$side.result"
  done
  note "$case: $(grep -h -o '"busy_fraction":[0-9.]*' "$work/$case".?.log | tr '\n' ' ')"
}

# tenant_mixed_beside CASE [SHIM]: a at 30 %, sizes 5 us .. 20 ms under one function, beside b at 70 %, 1 ms
# kernels, both under time division on GPU 0.
tenant_mixed_beside() {
  local case=$1 seconds=${VGPU_ALONE_MIXED_SECONDS:-20} a b
  a=$(container "$case-a" 30 time-division)
  b=$(container "$case-b" 70 time-division)
  [[ -n ${2:-} ]] && { a=${a/LD_PRELOAD=$shim/LD_PRELOAD=$2}; b=${b/LD_PRELOAD=$shim/LD_PRELOAD=$2}; }
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((seconds + 60)) env $a "$tenant_bin" --blocks 132 --seconds "$seconds" \
    --seed 1 --phase 'kernels=5us|50us|500us|5ms|20ms' >"$work/$case.a.log" 2>&1 &
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 $((seconds + 60)) env $b "$tenant_bin" --blocks 132 --seconds "$seconds" \
    --kernel-us 1000 >"$work/$case.b.log" 2>&1 &
  wait
  record_tenant_pair "$case"
}

IFS=, read -r -a wanted <<<"$stages"
for stage in "${wanted[@]}"; do
  case $stage in
    ddp)
      note "ddp: $(nvidia-smi -L | wc -l) GPUs"
      if [[ -z ${VGPU_DDP_TD_ONLY:-} ]]; then  # (VGPU_DDP_TD_ONLY=1: time division's cases only)
        for r in 1 2; do ddp_run ddp-uncapped "$r"; done
        for r in 1 2; do ddp_run ddp-limiter-50 "$r" $(container ddp 50 limiter); done
      fi
      for ((r = 1; r <= ${VGPU_DDP_RUNS:-10}; r++)); do ddp_run ddp-td-50 "$r" $(container ddp 50 time-division); done
      # Beside a second container at 50 % on GPU 0 for the whole of three runs.
      start=$(python3 -c 'import time; print(round(time.time() + 12, 3))')
      # shellcheck disable=SC2046
      CUDA_VISIBLE_DEVICES=0 timeout -k 5 150 env $(container neighbour 50 time-division) python3 \
        "$repo/tests/gpu/repro/mm_loop.py" "$start" 2 60 >"$work/ddp-neighbour.log" 2>&1 &
      neighbour=$!
      sleep 14
      for ((r = 1; r <= ${VGPU_DDP_BESIDE_RUNS:-3}; r++)); do
        ddp_run ddp-td-50-beside "$r" $(container ddp 50 time-division)
      done
      wait $neighbour
      record ddp-neighbour 0 "$work/ddp-neighbour.log"
      note "ddp neighbour: $(grep -h -o '"TFLOPs": [0-9.]*' "$work/ddp-neighbour.log")"
      ;;
    pairs)
      [[ ${VGPU_PAIRS_TD_ONLY:-} == 1 ]] || { mm_pair mm-alone ""; mm_pair mm-none-none "" ""; }
      mm_pair mm-td-50-50 "$(container td5050a 50 time-division)" "$(container td5050b 50 time-division)"
      mm_pair mm-td-30-70 "$(container td3070a 30 time-division)" "$(container td3070b 70 time-division)"
      [[ ${VGPU_PAIRS_TD_ONLY:-} == 1 ]] || mm_pair mm-limiter-30-70 "$(container l3070a 30 limiter)" "$(container l3070b 70 limiter)"
      ;;
    tenant)
      for spec in "30 70 1000" "30 70 20000" "50 50 20000"; do
        read -r ca cb us <<<"$spec"
        case=tenant-td-$ca-$cb-${us}us
        for side in a b; do
          cap=$ca; [[ $side == b ]] && cap=$cb
          # shellcheck disable=SC2046
          CUDA_VISIBLE_DEVICES=0 env $(container "$case-$side" "$cap" time-division) "$tenant_bin" --kernel-us "$us" \
            --blocks 132 --seconds 8 >"$work/$case.$side.log" 2>&1 &
        done
        wait
        record_tenant_pair "$case"
      done
      ;;
    caps)
      for cap in ${VGPU_CAPS:-10 30 50 70 90}; do mm_pair "mm-td-alone-$cap" "$(container alone-$cap "$cap" time-division)"; done
      ;;
    default)
      mm_pair mm-alone ""
      mm_pair mm-td-default-40-alone "$(container d40alone 40 time-division default)"
      mm_pair mm-td-default-40-beside-50 "$(container d40 40 time-division default)" "$(container f50 50 time-division)"
      ;;
    four)
      mm_pair mm-alone ""
      for sharing in ${VGPU_FOUR_SHARING:-none time-division limiter}; do mm_four "mm-four-$sharing" "$sharing"; done
      ;;
    four-mixed)
      for sharing in ${VGPU_FOUR_SHARING:-none time-division}; do tenant_four_mixed "tenant-four-mixed-$sharing" "$sharing"; done
      ;;
    alone-mixed)
      tenant_alone_mixed tenant-alone-mixed-30-limiter limiter
      tenant_alone_mixed tenant-alone-mixed-30-td time-division
      [[ -n ${VGPU_SHIM_BEFORE:-} ]] && tenant_alone_mixed tenant-alone-mixed-30-td-before time-division "$VGPU_SHIM_BEFORE"
      ;;
    light)
      secs=${VGPU_LIGHT_SECONDS:-15}
      light_pair light-alone "MM_LOOP_PAUSE_MS=20" none
      light_pair light-noshim-beside "MM_LOOP_PAUSE_MS=20" "" "$secs"
      light_pair light-limiter-30-70 "$(container light-lim-a 30 limiter) MM_LOOP_PAUSE_MS=20" \
        "$(container light-lim-b 70 limiter)" "$secs"
      light_pair light-td-30-70 "$(container light-td-a 30 time-division) MM_LOOP_PAUSE_MS=20" \
        "$(container light-td-b 70 time-division)" "$secs"
      if [[ -n ${VGPU_SHIM_BEFORE:-} ]]; then
        before_a=$(container light-before-a 30 time-division | sed "s|LD_PRELOAD=[^ ]*|LD_PRELOAD=$VGPU_SHIM_BEFORE|")
        before_b=$(container light-before-b 70 time-division | sed "s|LD_PRELOAD=[^ ]*|LD_PRELOAD=$VGPU_SHIM_BEFORE|")
        light_pair light-td-before-30-70 "$before_a MM_LOOP_PAUSE_MS=20" "$before_b" "$secs"
      fi
      ;;
    mixed-beside)
      tenant_mixed_beside tenant-mixed-beside-30-70
      [[ -n ${VGPU_SHIM_BEFORE:-} ]] && tenant_mixed_beside tenant-mixed-beside-30-70-before "$VGPU_SHIM_BEFORE"
      ;;
    *) note "unknown stage '$stage' (accepted: ddp, pairs, tenant, caps, default, four, four-mixed, alone-mixed, mixed-beside, light)" ;;
  esac
done
tar czf "$out/logs.tgz" -C "$work" . 2>/dev/null
note "done"
