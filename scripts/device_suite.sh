#!/usr/bin/env bash
# The GPU suite on a device machine, in stages (STAGES, default all of them, in this order):
#   build     configure and build (GoogleTest from .deps/googletest)
#   gpu       every GPU test, one-process and multi-process, the kill test among them; ranks
#             share the GPUs where there are fewer than a test's ranks. GPU_SHARDS=1 on a
#             machine of several GPUs: one ctest per GPU, each seeing only its GPU (ranks share
#             it, as on a one-GPU machine) and taking every n-th test (-I k,,n): the whole
#             suite in about 3 minutes on 4 GPUs, against 9 for one ctest (no test then
#             crosses a link: run the plain stage for that). SUITE_PARTS="1 2" (of SUITE_NPARTS,
#             default 4): only those parts (ctest -I k,,n), to split the one-GPU suite over
#             two calls on a warm machine
#   sanitize  compute-sanitizer memcheck and racecheck on SANITIZE_CASE (default the 8-rank
#             r8_h2048_k8_e8; ranks share the GPUs where there are fewer than 8), and memcheck on
#             the bad-input tests
#   soak      epcomm_soak, one process and 4 processes (SOAK_MODES="one multi"), SOAK_ITERS
#             iterations each (default 10^4; 4 processes on one GPU run ~23 iterations/s)
# Logs under $OUT. Every command runs under a timeout. BUILD_ONLY=1 is STAGES=build.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BUILD=build-device
STAGES=${STAGES:-build gpu sanitize soak}
[ -n "${BUILD_ONLY:-}" ] && STAGES=build
has() { [[ " $STAGES " == *" $1 "* ]]; }
status=0

if has build; then
  cmake_build $BUILD "" -- ${EPCOMM_CMAKE_ARGS:-} -DEPCOMM_GTEST_SOURCE_DIR=$PWD/.deps/googletest ||
    exit 1
  echo "build ok"
fi

if has gpu; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sed 's/^/gpu: /'
  if use_shards; then
    SHARD_TIMEOUT=${SUITE_TIMEOUT:-540} sharded_ctest $BUILD ctest_gpu -L gpu -E nvshmem --timeout 240
    rc=$?
    echo "(the NVSHMEM tests are not among them: scripts/device_nvshmem.sh runs those)"
  elif [ -n "${SUITE_PARTS:-}" ]; then
    # Part k of n (-I k,,n: every n-th test) for each k in SUITE_PARTS, one after another, in
    # the time the call has left: the one-GPU suite (about 8 minutes on one H200) in two device
    # calls, the build kept between them (run the second while the machine is warm).
    n=${SUITE_NPARTS:-4}; rc=0
    : >"$OUT/ctest_gpu.log"
    for k in $SUITE_PARTS; do
      (cd $BUILD && timeout ${SUITE_TIMEOUT:-540} ctest -L gpu -E nvshmem -I "$k,,$n" -j1 \
         --no-tests=error --timeout 240 -V) >"$OUT/ctest_gpu_$k.log" 2>&1
      r=$?; [ $r -eq 0 ] || rc=1
      echo "part $k of $n rc=$r: $(grep -hE "tests passed" "$OUT/ctest_gpu_$k.log" | tail -1)"
      # Stopped by the bound (SUITE_TIMEOUT applies to each part: one part took about 135 s on
      # an H100, 2026-11-26): say how far it got, so a cut part is not read as a failed one.
      [ $r -eq 124 ] && echo "  part $k stopped after ${SUITE_TIMEOUT:-540} s:" \
        "$(grep -cE "Test +#[0-9]+: .* Passed" "$OUT/ctest_gpu_$k.log") passed," \
        "$(grep -cE "Test +#[0-9]+: .*(Failed|Timeout|Exception)" "$OUT/ctest_gpu_$k.log") failed," \
        "the rest not run"
      cat "$OUT/ctest_gpu_$k.log" >>"$OUT/ctest_gpu.log"
    done
    echo "(parts $SUITE_PARTS of $n; the NVSHMEM tests are not among them)"
  else
    (cd $BUILD && timeout ${SUITE_TIMEOUT:-540} ctest -L gpu -j1 --timeout 240 -V) >"$OUT/ctest_gpu.log" 2>&1
    rc=$?
  fi
  echo "ctest rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "tests passed|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception|\(Skipped\)|Not Run" "$OUT/ctest_gpu.log" | head -40
  total=$(ctest_ran "$OUT/ctest_gpu.log")  # every shard's
  shared=$(grep -E '^[0-9]+: \[epcomm\] [0-9]+ ranks share' "$OUT/ctest_gpu.log" | cut -d: -f1 | sort -u | wc -l)
  skipped=$(grep -c "(Skipped)" "$OUT/ctest_gpu.log")
  echo "tests that ran with ranks sharing a GPU: $shared of ${total:-?}; skipped: $skipped"
  grep -E "epcomm_launch: rank [0-9]+ .*killed|KILL-TEST|kill test" "$OUT/ctest_gpu.log" | head -12
fi

if has sanitize; then
  case=Shapes/Sweep.MatchesReference/${SANITIZE_CASE:-r8_h2048_k8_e8}
  for spec in "memcheck:$case" "racecheck:$case" "memcheck:BadInput.*"; do
    tool=${spec%%:*}; filter=${spec#*:}; log="$OUT/sanitizer_${tool}_${filter//[^A-Za-z0-9]/_}.log"
    # API errors are not reported: the set-up expects and clears some (cudaDeviceEnablePeerAccess
    # answers cudaErrorPeerAccessAlreadyEnabled to every rank of a process after the first that
    # maps a peer GPU; cudaDeviceGetByPCIBusId fails for a peer GPU the process cannot see), and
    # any other failed CUDA call throws (check_cuda) and fails its test. Memory errors and races
    # still fail the run.
    timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 3 \
      --report-api-errors no \
      $BUILD/tests/epcomm_gpu_tests --gtest_filter="$filter" >"$log" 2>&1
    rc=$?; [ $rc -eq 0 ] || status=1
    echo "compute-sanitizer $tool $filter rc=$rc : $(grep -E 'tests? ran|PASSED|FAILED' "$log" | tail -2 | tr '\n' ' ')$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  done
fi

if has soak; then
  it=${SOAK_ITERS:-10000}
  if [[ " ${SOAK_MODES:-one multi} " == *" one "* ]]; then
    timeout ${SOAK_TIMEOUT:-280} $BUILD/tests/epcomm_soak --iterations $it >"$OUT/soak_one_process.log" 2>&1
    rc=$?; echo "soak (one process) rc=$rc"; [ $rc -eq 0 ] || status=1
    tail -3 "$OUT/soak_one_process.log"
  fi
  if [[ " ${SOAK_MODES:-one multi} " == *" multi "* ]]; then
    timeout ${SOAK_TIMEOUT:-280} $BUILD/tests/epcomm_launch -n 4 -t ${SOAK_TIMEOUT:-280} -- \
      $BUILD/tests/epcomm_soak --processes --iterations $it >"$OUT/soak_multi_process.log" 2>&1
    rc=$?; echo "soak (4 processes) rc=$rc"; [ $rc -eq 0 ] || status=1
    tail -3 "$OUT/soak_multi_process.log"
  fi
fi

exit $status
