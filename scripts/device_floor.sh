#!/usr/bin/env bash
# The memory-floor matrix on a device machine: builds epcomm_bench (unless NO_BUILD=1), then for
# each SM count and reduction runs WORKLOADS with --floor (one rank), and FLOOR_SHARED (8 ranks
# sharing the GPU, 16 SMs each) if set. Results (text and JSON) under $OUT, packed into
# floor_all.tar.gz unless PACK=0.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BUILD=${BUILD:-build-device}
WORKLOADS=${WORKLOADS:-prefill,prefill-fp8,skewed}
ITERS=${ITERS:-30}
if [ -z "${NO_BUILD:-}" ]; then
  cmake_build $BUILD "" --target epcomm_bench -- -DEPCOMM_BUILD_TESTS=OFF || exit 1
fi
BENCH=$BUILD/bench/epcomm_bench
for reduce in ${REDUCE:-expert token}; do
  for s in ${SMS:-8 16 24 32}; do
    f="$OUT/floor_${reduce}_sms$s"
    timeout ${RUN_TIMEOUT:-120} $BENCH --workload "$WORKLOADS" --sms "$s" --reduce $reduce --no-nccl \
      --iters $ITERS --floor --json "$f.json" >"$f.txt" 2>"$f.err"
    echo "== reduce=$reduce sms=$s rc=$?"
    grep -E "^(prefill|skewed)|floor|check:" "$f.txt" | grep -v "async\|half"
  done
done
if [ -n "${FLOOR_SHARED:-}" ]; then
  f="$OUT/floor_shared8_sms16"
  timeout ${RUN_TIMEOUT:-200} $BENCH --workload "$FLOOR_SHARED" --ranks 8 --sms 16 --no-nccl \
    --iters $ITERS --floor --json "$f.json" >"$f.txt" 2>"$f.err"
  echo "== 8 ranks sharing, 16 SMs each, rc=$?"
  grep -E "^(prefill|skewed)|floor|check:" "$f.txt" | grep -v "async\|half"
  tail -3 "$f.err"
fi
# (The archive itself is not among them, should $OUT hold one from an earlier run.)
pack_out floor_all.tar.gz $(cd "$OUT" && ls floor_* 2>/dev/null | grep -vx floor_all.tar.gz)
