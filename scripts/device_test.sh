#!/usr/bin/env bash
# Builds epcomm on a GPU machine and runs the GPU tests (used through the device tool).
#   scripts/device_test.sh [ctest-regex]        logs go to $OUT (or ./out)
# Needs .deps/googletest (a copy of /usr/src/googletest carried along: the GPU machines have no
# GoogleTest and no network).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
BUILD=${BUILD:-build-device}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DEPCOMM_GTEST_SOURCE_DIR="$PWD/.deps/googletest" ${EPCOMM_CMAKE_ARGS:-} >"$OUT/configure.log" 2>&1 \
  || { tail -30 "$OUT/configure.log"; exit 1; }
timeout 400 cmake --build "$BUILD" -j "$(nproc)" ${BUILD_TARGETS:+--target $BUILD_TARGETS} >"$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
echo "build ok"
cd "$BUILD"
FILTER=${1:-}
timeout ${CTEST_TIMEOUT:-480} ctest -L gpu ${FILTER:+-R "$FILTER"} --output-on-failure \
  --timeout 300 >"$OUT/ctest_gpu.log" 2>&1
rc=$?
grep -E "Test +#|tests passed|FAILED|Failed|Skipped" "$OUT/ctest_gpu.log" | tail -80
exit $rc
