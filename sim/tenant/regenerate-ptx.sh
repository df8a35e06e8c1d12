#!/bin/sh
# Regenerates spin.ptx from spin.cu and checks that it assembles for a T4 (sm_75), an A100 (sm_80) and an H100 (sm_90).
set -eu
cd "$(dirname "$0")"
cuda="${CUDA_HOME:-/usr/local/cuda}"
"$cuda/bin/nvcc" -ptx -arch=compute_75 spin.cu -o spin.ptx
# nvcc stamps the PTX with its own ISA version (9.0 for CUDA 13), and a driver
# refuses PTX newer than itself (CUDA_ERROR_UNSUPPORTED_PTX_VERSION). The kernel
# uses nothing newer than ISA 7.0 (CUDA 11.0), so claim that, and the same
# text loads on any driver from 450 on. ptxas below proves the claim holds.
sed -i 's/^\.version [0-9.]*$/.version 7.0/' spin.ptx
for arch in sm_75 sm_80 sm_90; do
    "$cuda/bin/ptxas" -arch=$arch spin.ptx -o /dev/null
done
echo "spin.ptx regenerated (PTX ISA 7.0, target sm_75) and checked for sm_75, sm_80, sm_90"
