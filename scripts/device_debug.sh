#!/usr/bin/env bash
# Build, then run one GPU test verbosely with a short limit (debugging through the device tool).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
BUILD=build-device
cmake -S . -B $BUILD -G Ninja -DEPCOMM_BUILD_BENCH=OFF -DEPCOMM_GTEST_SOURCE_DIR=$PWD/.deps/googletest >"$OUT/configure.log" 2>&1 || exit 1
timeout 300 cmake --build $BUILD -j --target epcomm_gpu_tests >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head; exit 1; }
EPCOMM_TEST_TRACE=1 timeout ${T1:-60} $BUILD/tests/epcomm_gpu_tests --gtest_filter="$1" 2>&1 | tail -40
echo "rc=$?"
