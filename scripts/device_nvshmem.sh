#!/usr/bin/env bash
# The NVSHMEM build on a device machine and the emulated node splits. Stages (STAGES, default
# all, in this order):
#   build   configure and build build-nv (-DEPCOMM_WITH_NVSHMEM=ON; GoogleTest from .deps)
#   tests   ctest -R TESTS (default the 8-process splits gpu_nvshmem_2x4 and gpu_nvshmem_4x2;
#           "-L nvshmem" style regexes work too); GPU_SHARDS=1: one shard per GPU (device_env.sh
#           sharded_ctest)
#   bench   for each NODESxRANKS in SPLITS (default "1x8 2x4 4x2"; 1x8 is one node, no remote
#           peer), NODES*RANKS processes under epcomm_launch run each of the benchmark's
#           WORKLOADS (default "decode-bf16 prefill"; WORKLOAD:ARG:ARG adds arguments, e.g.
#           prefill:--tokens:2048) declared as nodes of RANKS ranks, NV_BENCH_ARGS to every run
#           (default --no-nccl); results checked
# Processes share the GPUs where there are fewer than them: NVSHMEM's puts are then copies inside
# one GPU, and the processes are time-sliced on it, so the figures show what the cross-node
# protocol costs on the GPU, not a network. Logs and JSON under $OUT.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BUILD=${BUILD:-build-nv}
STAGES=${STAGES:-build tests bench}
has() { [[ " $STAGES " == *" $1 "* ]]; }
status=0

if has build; then
  cmake_build $BUILD nv_ -- -DEPCOMM_WITH_NVSHMEM=ON -DEPCOMM_BUILD_EXAMPLES=OFF \
    -DEPCOMM_GTEST_SOURCE_DIR=$PWD/.deps/googletest || exit 1
  echo "nvshmem build ok"
fi

if has tests; then
  if use_shards; then
    # One shard per GPU, processes sharing it (device_env.sh): the 7 NVSHMEM tests in 71 s on
    # 4 x H200, against about 250 s one after another.
    SHARD_TIMEOUT=${TESTS_TIMEOUT:-560} sharded_ctest $BUILD nv_ctest -R "${TESTS:-gpu_nvshmem_(2x4|4x2)}"
  else
    (cd $BUILD && timeout ${TESTS_TIMEOUT:-560} ctest -R "${TESTS:-gpu_nvshmem_(2x4|4x2)}" -j1 -V) \
      >"$OUT/nv_ctest.log" 2>&1
  fi
  rc=$?; echo "nvshmem ctest rc=$rc"; [ $rc -eq 0 ] || status=1
  grep -E "tests passed|Test +#[0-9]+: .*(Passed|Failed|Timeout|Skipped)|\*\*\*" "$OUT/nv_ctest.log" | head -20
fi

if has bench; then
  for split in ${SPLITS:-1x8 2x4 4x2}; do
    nodes=${split%x*}; rpn=${split#*x}; n=$((nodes * rpn))
    echo "== $split ($nodes nodes of $rpn ranks)"
    for spec in ${WORKLOADS:-decode-bf16 prefill}; do  # WORKLOAD[:ARG:ARG...], one launch each
      w=${spec%%:*}; wargs=""; [ "$spec" != "$w" ] && wargs=${spec#*:} && wargs=${wargs//:/ }
      f="$OUT/nv_bench_${split}_$w"
      timeout ${BENCH_TIMEOUT:-240} $BUILD/tests/epcomm_launch -n $n -t ${BENCH_TIMEOUT:-240} -- \
        $BUILD/bench/epcomm_bench --workload $w $wargs --ranks-per-node $rpn --iters ${ITERS:-20} \
        --warmup 3 ${NV_BENCH_ARGS---no-nccl} --json "$f.json" >"$f.txt" 2>"$f.err"
      rc=$?; [ $rc -eq 0 ] || { status=1; echo "$w rc=$rc"; grep -m3 "error" "$f.err"; }
      grep -E "^$w |check" "$f.txt"
    done
  done
fi
exit $status
