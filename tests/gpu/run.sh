#!/usr/bin/env bash
# The GPU suite (issue 6): the same shim on a real GPU, in one command on a GPU machine.
#
#   VGPU_COMMIT=$(git rev-parse HEAD) bash tests/gpu/run.sh
#
# Builds what it needs (Release: the shim, vgpu-tenant, vgpu-sampler, fakecuda, the conformance tests registered
# for the real driver, vgpu._native), then runs tests/gpu/suite.py: conformance on the real driver and on fakecuda,
# memory caps (vgpu-tenant, PyTorch's two allocators, the host's view), compute caps 10..90 % (PyTorch matmuls and
# small ops, vgpu-tenant), two containers side by side, the shim's overhead, two scenarios on the GPU and on
# fakecuda. Writes report.md, report.json, suite.log and build.log (and a few traces) to $OUT (default
# ./gpu-report), the report after every stage, so a run cut short still reports what it measured.
# Where no GPU answers (nvidia-smi -L fails) it prints one line and exits 0.
#
# Environment:
#   OUT                   report folder (default <repo>/gpu-report)
#   VGPU_COMMIT           the commit the tree is (a copied tree's .git may be stale); default: git rev-parse HEAD
#   VGPU_GPU_BUILD_DIR    use this build folder as it is (no build)
#   VGPU_GPU_STAGES       stages to run, comma-separated (default conformance,memory,compute,overhead,fidelity,monitor)
#   VGPU_GPU_BUDGET_S     seconds the whole command may take; stages that would not fit are skipped (default 520)
#   VGPU_GPU_POINT_S      seconds per measured point of the compute sweep (default 3)
#   VGPU_GPU_FAKE=1       plumbing test without a GPU: run everything over fakecuda (LD_LIBRARY_PATH must point at
#                         a build's lib/ and FAKECUDA_STATE at a state file); the figures then mean nothing
# Through the session's device tool (the GPU machine has no nvidia-nvml-dev wheel, and its CUDA 13.0 nvml.h is too old
# for fakecuda's NVML), prepare here once, then name build/gpu-deps in the call's carry:
#   mkdir -p build/gpu-deps/nvml-include && cp "$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))')"/nvidia/cu13/include/nvml.h build/gpu-deps/nvml-include/
#   cp -rL /usr/src/googletest build/gpu-deps/    # only where the GPU machine has no GoogleTest
# Exit: 0 the suite ran (its findings are in the report, pass or not) or no GPU; 1 the build or the suite broke.
set -uo pipefail
start_s=$(date +%s)
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo" || exit 1
if [[ -z ${VGPU_GPU_FAKE:-} ]] && ! timeout 60 nvidia-smi -L >/dev/null 2>&1; then
  echo "vgpu GPU suite: skipped, no NVIDIA GPU answers here (nvidia-smi -L failed)"
  exit 0
fi
out=${OUT:-$repo/gpu-report}
mkdir -p "$out"
log=$out/build.log
: >"$log"
note() { echo "[$(date -u +%T)] $*" | tee -a "$out/suite.log"; }

build_info=""
build_tree() {
  local build=$1 gen=() keep=(-- -k) py headers=()
  py=$(command -v python3)
  command -v ninja >/dev/null 2>&1 && { gen=(-G Ninja); keep=(-- -k 0); }
  # nvml.h as the tree is developed against (pip nvidia-nvml-dev 13.4): a CUDA 13.0 toolkit's nvml.h lacks names
  # fakecuda's NVML uses (NVML_INIT_FLAG_FORCE_INIT, NVML_TEMPERATURE_GPU_MAX). Copy it to build/gpu-deps/nvml-include
  # (and carry that folder) where the GPU machine has no such wheel.
  if [[ -f $repo/build/gpu-deps/nvml-include/nvml.h ]]; then
    headers=(-DNVML_INCLUDE_DIR="$repo/build/gpu-deps/nvml-include")
    build_info+="nvml.h from build/gpu-deps/nvml-include; "
  fi
  configure() {
    rm -rf "$build"
    # VGPU_WERROR=OFF: warnings stay warnings with a compiler and optimization level the tree was not tried with
    # (GCC 12 at -O3 flags sim/scenario/yaml.cc with -Wrestrict).
    timeout 240 cmake -S "$repo" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DVGPU_WERROR=OFF \
      -DVGPU_BUILD_BENCH=OFF -DVGPU_CONFORMANCE_ON_REAL_DRIVER=ON -DPython3_EXECUTABLE="$py" "${headers[@]}" "$@" \
      >>"$log" 2>&1
  }
  local tests=ON
  if ! configure -DVGPU_BUILD_TESTS=ON; then
    local src=""
    for d in "$repo/build/gpu-deps/googletest" /usr/src/googletest; do
      [[ -f $d/CMakeLists.txt ]] && { src=$d; break; }
    done
    if grep -qi gtest "$log" && [[ -n $src ]]; then
      note "GoogleTest not installed: building it from $src"
      build_info+="googletest built from ${src#"$repo/"}; "
      rm -rf /tmp/vgpu-gtest-build /tmp/vgpu-gtest
      { timeout 240 cmake -S "$src" -B /tmp/vgpu-gtest-build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_INSTALL_PREFIX=/tmp/vgpu-gtest -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
        && timeout 300 cmake --build /tmp/vgpu-gtest-build -j"$(nproc)" \
        && cmake --install /tmp/vgpu-gtest-build; } >>"$log" 2>&1
    fi
    if ! configure -DVGPU_BUILD_TESTS=ON -DCMAKE_PREFIX_PATH=/tmp/vgpu-gtest; then
      note "configure with the tests failed (see build.log): building without the conformance tests"
      build_info+="conformance tests NOT built (configure failed with them); "
      tests=OFF
      configure -DVGPU_BUILD_TESTS=OFF || return 1
    fi
  fi
  # What every stage needs; then fakecuda (the conformance tests link it; the fakecuda runs need it), then the
  # scenario runner (vgpu._native, else the static libraries for run_scenario.cc). Only the first is required.
  timeout 400 cmake --build "$build" -j"$(nproc)" --target vgpu vgpu-tenant vgpu-sampler vgpu-monitor >>"$log" 2>&1 || return 1
  timeout 400 cmake --build "$build" -j"$(nproc)" --target fakecuda_cuda fakecuda_nvml "${keep[@]}" >>"$log" 2>&1 \
    || build_info+="fakecuda did NOT build (see build.log): no fakecuda runs; "
  local native=0
  if grep -q "vgpu._native: pybind11" "$log" \
      && timeout 400 cmake --build "$build" -j"$(nproc)" --target vgpu_native >>"$log" 2>&1; then
    native=1
  fi
  if [[ $native == 0 ]]; then
    build_info+="vgpu._native not built (see build.log): scenarios through tests/gpu/run_scenario.cc; "
    local b=$build/lib
    { timeout 400 cmake --build "$build" -j"$(nproc)" --target vgpu_runner vgpu_scenario vgpu_sim vgpu_region \
        vgpu_policy fakecuda_model fakecuda_state \
      && timeout 200 g++ -std=c++20 -O2 -I sim/runner/include -I sim/scenario/include tests/gpu/run_scenario.cc \
        -o "$build/bin/run_scenario" -Wl,--start-group "$b/libvgpu_runner.a" "$b/libvgpu_scenario.a" \
        "$b/libvgpu_sim.a" "$b/libvgpu_region.a" "$b/libvgpu_policy.a" "$b/libfakecuda_model.a" \
        "$b/libfakecuda_state.a" -Wl,--end-group -lpthread -ldl; } >>"$log" 2>&1 \
      || build_info+="run_scenario did not build either: no scenarios; "
  fi
  if [[ $tests == ON ]]; then
    local conformance
    conformance=$(cmake --build "$build" --target help 2>/dev/null | grep -o 'conformance_[a-z_]*_test' | sort -u)
    # shellcheck disable=SC2086 # one target per word
    timeout 400 cmake --build "$build" -j"$(nproc)" --target $conformance "${keep[@]}" >>"$log" 2>&1 \
      || build_info+="some conformance tests did not build (see build.log); "
  fi
  return 0
}

build=${VGPU_GPU_BUILD_DIR:-}
if [[ -z $build ]]; then
  build=$repo/build/gpu-suite
  note "building into $build (log: $log)"
  if ! build_tree "$build"; then
    note "build FAILED; the end of build.log:"
    tail -40 "$log" | tee -a "$out/suite.log"
    printf '# vgpu GPU suite\n\nThe build failed; see build.log.\n' >"$out/report.md"
    exit 1
  fi
  note "built in $(( $(date +%s) - start_s )) s"
else
  build=$(cd "$build" && pwd)
  build_info+="prebuilt tree $build; "
fi
export VGPU_GPU_BUILD_INFO=$build_info VGPU_GPU_STARTED_S=$start_s
export VGPU_GPU_COMMAND=${VGPU_GPU_COMMAND:-"VGPU_COMMIT=${VGPU_COMMIT:-<sha>} bash tests/gpu/run.sh"}
PYTHONUNBUFFERED=1 python3 "$repo/tests/gpu/suite.py" --build "$build" --out "$out" 2>&1 | tee -a "$out/suite.log"
exit "${PIPESTATUS[0]}"
