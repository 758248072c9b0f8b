#!/usr/bin/env bash
# The whole-node run: one build, then everything on it, over RANKS ranks (default 8), in stages
# (STAGES, default all, in this order). On 8 GPUs each stage fits one 600 s device call; on 2
# the GPU tests alone took about 580 s (2 x H100, 2026-11-25), so there run the suite as
# SUITE_STAGES=build, then gpu, then sanitize, one call each (GPU_SHARDS=1 runs the GPU tests as
# one shard per GPU with ranks sharing it: 172 s on 4 x H200, but no test crosses a link):
#   suite     scripts/device_suite.sh: build, every GPU test (one- and multi-process), memcheck
#             and racecheck on an 8-rank case
#   bench     scripts/device_bench.sh: every workload with the NCCL baseline at 24 SMs, the
#             prefill and decode SM curves, the plot
#   nvshmem   scripts/device_nvshmem.sh: the NVSHMEM build, the 8-process splits 2 x 4 and 4 x 2,
#             and the benchmark's decode-bf16 and prefill as 1 x 8, 2 x 4 and 4 x 2
#   examples  scripts/device_examples.sh: moe_layer and torch_moe.py (torchrun) over RANKS ranks
#             (it installs the Python package), then the Python tests (pytest python/tests,
#             PYTEST_TIMEOUT, default 300 s)
# With fewer GPUs than RANKS the ranks share them (Config::share_gpus): the benchmark then runs
# --ranks RANKS in one process (no NCCL baseline) with SM curves of what fits, and its timings
# measure the protocol's fixed costs, not links. Logs under $OUT, one folder per stage.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
RANKS=${RANKS:-8}
STAGES=${STAGES:-suite bench nvshmem examples}
gpus=$(gpu_count)
echo "node run: $gpus GPU(s), $RANKS ranks$( [ "$gpus" -lt "$RANKS" ] && echo ", sharing")"
status=0
for stage in $STAGES; do
  mkdir -p "$OUT/$stage"; echo "==== $stage"
  case $stage in
    suite) OUT=$OUT/$stage STAGES="${SUITE_STAGES:-build gpu sanitize}" bash scripts/device_suite.sh ;;
    bench)
      if [ "$gpus" -lt "$RANKS" ]; then
        OUT=$OUT/$stage BENCH_ARGS="--ranks $RANKS" SMS_CURVE="${SMS_CURVE:-4 8 16}" \
          DECODE_SMS_CURVE="${DECODE_SMS_CURVE:-4 8 16}" bash scripts/device_bench.sh
      else
        OUT=$OUT/$stage bash scripts/device_bench.sh
      fi ;;
    nvshmem)
      # Sharing: 8 processes, each with its own NVSHMEM heap, do not fit prefill's 4096 tokens
      # in 80 GB, and time-slicing stretches every wait, hence 2048 tokens and a 60 s bound.
      if [ "$gpus" -ge "$RANKS" ]; then nv_args="" nv_w="decode-bf16 prefill"
      else nv_args="--no-nccl --timeout 60" nv_w="decode-bf16 prefill:--tokens:2048"; fi
      # The splits of RANKS ranks into nodes: one node, then every split into 2 or more nodes
      # of 2 or more ranks, and nodes of one rank (2 ranks: 1x2 2x1; 8: 1x8 2x4 4x2 8x1).
      splits="1x$RANKS"
      for ((n = 2; n <= RANKS; n++)); do
        [ $((RANKS % n)) -eq 0 ] && splits="$splits ${n}x$((RANKS / n))"
      done
      OUT=$OUT/$stage NV_BENCH_ARGS="${NV_BENCH_ARGS-$nv_args}" WORKLOADS="${WORKLOADS:-$nv_w}" \
        SPLITS="${SPLITS:-$splits}" \
        STAGES="${NV_STAGES:-build tests bench}" bash scripts/device_nvshmem.sh ;;
    examples)
      OUT=$OUT/$stage RANKS=$RANKS bash scripts/device_examples.sh || status=1
      # The Python tests, on the package device_examples.sh installed (from outside the tree,
      # so the installed package is the one imported).
      (cd /tmp && PYTHONUNBUFFERED=1 timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -rs \
        "$OLDPWD/python/tests" -p no:cacheprovider) >"$OUT/$stage/pytest.log" 2>&1
      py_rc=$?; echo "== pytest rc=$py_rc: $(grep -E "passed|failed" "$OUT/$stage/pytest.log" | tail -1)"
      [ $py_rc -eq 0 ] ;;
    *) echo "unknown stage $stage"; false ;;
  esac
  rc=$?; echo "==== $stage rc=$rc"; [ $rc -eq 0 ] || status=1
done
exit $status
