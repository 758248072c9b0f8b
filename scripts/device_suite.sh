#!/usr/bin/env bash
# The GPU suite on a device machine: build, every GPU test (single- and multi-process), then
# compute-sanitizer memcheck and racecheck on a small 2-GPU case (SANITIZE=1). Logs under $OUT.
# BUILD_ONLY=1 stops after the build.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
BUILD=build-device
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release ${EPCOMM_CMAKE_ARGS:-} \
  -DEPCOMM_GTEST_SOURCE_DIR=$PWD/.deps/googletest >"$OUT/configure.log" 2>&1 || exit 1
timeout 300 cmake --build $BUILD -j >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }
echo "build ok"
[ -n "${BUILD_ONLY:-}" ] && exit 0
(cd $BUILD && timeout ${SUITE_TIMEOUT:-420} ctest -L gpu -j1 --timeout 150 --output-on-failure) >"$OUT/ctest_gpu.log" 2>&1
echo "ctest rc=$?"
grep -E "tests passed|\*\*\*|Failed|Timeout|Not Run" "$OUT/ctest_gpu.log" | head -30
if [ -n "${SANITIZE:-}" ]; then
  small='Shapes/Sweep.MatchesReference/r2_h2048_k1_e8'
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 \
      $BUILD/tests/epcomm_gpu_tests --gtest_filter=$small >"$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$? : $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
  done
fi
