#!/usr/bin/env bash
# The shim's own GoogleTest suites that hold on any driver, run over the real libcuda.so.1 / libnvidia-ml.so.1 of a GPU
# machine (the ctest registrations point LD_LIBRARY_PATH at fakecuda; this does not): out of host memory inside the
# shim (shim.HostOom.*), the process state it must leave alone (shim.Process.*), threads launching into one stream
# under a cap (shim.Compute.*).
#
#   bash tests/gpu/shim_suites.sh BUILD_FOLDER [OUT_FOLDER]
#
# BUILD_FOLDER: a tree configured with VGPU_BUILD_TESTS=ON (tests/gpu/run.sh's build/gpu-suite); the targets are built
# here. Writes shim-suites.log (and a line per suite) to OUT_FOLDER (default: the build folder).
# Exit: 0 every suite passed, 1 a suite failed or did not build, 0 with a line where no GPU answers.
set -uo pipefail
build=$(cd "${1:?usage: shim_suites.sh BUILD_FOLDER [OUT_FOLDER]}" && pwd)
out=${2:-$build}
mkdir -p "$out"
log=$out/shim-suites.log
if ! timeout 60 nvidia-smi -L >/dev/null 2>&1; then
  echo "shim suites on the real driver: skipped, no NVIDIA GPU answers here" | tee "$log"
  exit 0
fi
suites=(hostoom process compute)
targets=(shim_worker)
for suite in "${suites[@]}"; do targets+=("shim_${suite}_test"); done
if ! timeout 400 cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >"$log" 2>&1; then
  echo "shim suites: the build failed (see $log)"
  tail -20 "$log"
  exit 1
fi
work=$(mktemp -d /tmp/vgpu-shim-suites.XXXXXX)
status=0
for suite in "${suites[@]}"; do
  limit=2147483648
  [[ $suite == process || $suite == compute ]] && limit=1073741824
  # The environment tests/shim/CMakeLists.txt gives each test, less fakecuda: no LD_LIBRARY_PATH to it, no
  # FAKECUDA_STATE (the tests then know they run on a real driver).
  env -u FAKECUDA_STATE LD_PRELOAD="$build/lib/libvgpu.so" CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/$suite.region" \
    CUDA_DEVICE_MEMORY_LIMIT="$limit" SHIM_LIMIT_BYTES="$limit" SHIM_TMP="$work/$suite.d" \
    SHIM_WORKER="$build/bin/shim_worker" SHIM_LIBRARY="$build/lib/libvgpu.so" \
    timeout 300 "$build/bin/shim_${suite}_test" >>"$log" 2>&1
  rc=$?
  echo "shim.$suite on the real driver: $([[ $rc == 0 ]] && echo passed || echo "FAILED (exit $rc)")" | tee -a "$log"
  [[ $rc == 0 ]] || status=1
done
rm -rf "$work"
exit "$status"
