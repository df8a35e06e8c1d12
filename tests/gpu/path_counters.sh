#!/usr/bin/env bash
# Where launches go on a real GPU: lib/libvgpu-path-counters.so (the shim counting its launch paths; it writes one
# "vgpu-path-counters {...}" line to stderr at exit) under the overhead and compute workloads, beside the same shim
# without counters (lib/libvgpu.so of the same build) and no shim.
#
#   OUT=dir COUNTERS_SHIM=path/libvgpu.so SHIM=path/libvgpu.so TENANT=path/vgpu-tenant bash tests/gpu/path_counters.sh
#
# Writes $OUT/path-counters.jsonl: one object per run, {"run", "config", "result": <the workload's result line>,
# "counters": <the shim's counts or null>}. Skips (exit 0) where no GPU answers.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$repo/path-counters}
mkdir -p "$out"
if ! timeout 60 nvidia-smi -L >/dev/null 2>&1; then
  echo "path_counters: skipped, no NVIDIA GPU answers here"
  exit 0
fi
: "${COUNTERS_SHIM:?libvgpu-path-counters.so}" "${SHIM:?the same shim without counters}"
tenant=${TENANT:-}
rounds=${PATH_COUNTERS_ROUNDS:-3}
jsonl=$out/path-counters.jsonl
: >"$jsonl"
workloads=$repo/tests/gpu/torch_workloads.py
tmp=$(mktemp -d)
cpu=$(( $(nproc) > 2 ? 2 : 0 ))  # pinned, as calibrate.sh pins its loops

# one RUN CONFIG -- command...: CONFIG is none, shim or counters, followed by KEY=VALUE limits.
one() {
  local run=$1 config=$2
  shift 2
  local env=(env -u LD_PRELOAD CUDA_DEVICE_MEMORY_SHARED_CACHE="$tmp/$run-$config.region")
  case $config in
    none) env=(env -u LD_PRELOAD) ;;
    shim*) env+=(LD_PRELOAD="$SHIM") ;;
    counters*) env+=(LD_PRELOAD="$COUNTERS_SHIM") ;;
  esac
  local limits=()
  while [[ $# -gt 0 && $1 != -- ]]; do limits+=("$1"); shift; done
  shift
  [[ $config == none ]] && limits=()
  "${env[@]}" "${limits[@]}" timeout 120 taskset -c "$cpu" "$@" >"$tmp/stdout" 2>"$tmp/stderr"
  local rc=$?
  python3 - "$run" "$config ${limits[*]}" "$rc" "$tmp/stdout" "$tmp/stderr" >>"$jsonl" <<'EOF'
import json, sys
run, config, rc, stdout, stderr = sys.argv[1], sys.argv[2].strip(), int(sys.argv[3]), sys.argv[4], sys.argv[5]
result = None
for line in open(stdout, errors="replace"):
    line = line.strip()
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event", "result") == "result":
            result = obj
counters = None
for line in open(stderr, errors="replace"):
    if line.startswith("vgpu-path-counters "):
        counters = json.loads(line[len("vgpu-path-counters "):])
print(json.dumps({"run": run, "config": config, "rc": rc, "result": result, "counters": counters}))
EOF
}

limits99=(CUDA_DEVICE_MEMORY_LIMIT=70g CUDA_DEVICE_SM_LIMIT=99 GPU_CORE_UTILIZATION_POLICY=force)
limits30=(CUDA_DEVICE_SM_LIMIT=30 GPU_CORE_UTILIZATION_POLICY=force)
memonly=(CUDA_DEVICE_MEMORY_LIMIT=70g)
for ((r = 0; r < rounds; r++)); do
  echo "== round $r"
  configs=(none shim counters shim-mem)
  # rotate the order per round, so a slow minute of the host hits every configuration
  for ((i = 0; i < ${#configs[@]}; i++)); do
    c=${configs[(i + r) % ${#configs[@]}]}
    case $c in
      shim-mem) one "overhead" "shim" "${memonly[@]}" -- python3 "$workloads" overhead ;;
      *) one "overhead" "$c" "${limits99[@]}" -- python3 "$workloads" overhead ;;
    esac
  done
done
echo "== x.add_ 1M"
for config in none counters; do
  one "add-99" "$config" "${limits99[@]}" -- python3 "$workloads" compute --which add --seconds 3
  one "add-30" "$config" "${limits30[@]}" -- python3 "$workloads" compute --which add --seconds 3
done
one "add-30" "shim" "${limits30[@]}" -- python3 "$workloads" compute --which add --seconds 3
if [[ -n $tenant ]]; then
  echo "== vgpu-tenant"
  for config in none shim counters; do
    one "tenant-1us-depth64" "$config" "${limits99[@]}" -- "$tenant" --kernel-us 1 --depth 64 --seconds 1.5
    one "tenant-1us-depth1" "$config" "${limits99[@]}" -- "$tenant" --kernel-us 1 --depth 1 --seconds 1.5
  done
  one "tenant-5us-depth8-30" "counters" "${limits30[@]}" -- "$tenant" --kernel-us 5 --depth 8 --seconds 2
fi
rm -rf "$tmp"
echo "path_counters: $(wc -l <"$jsonl") runs in $jsonl"
