#!/usr/bin/env bash
# Stage traces on a device machine (after scripts/device_suite.sh built build-device): each
# workload timed without the NCCL baseline, then TRACE_CALLS fused calls with Config::trace set
# (epcomm_bench --trace); when each kernel's blocks pass each stage, per rank. Results under $OUT.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BENCH=${BENCH:-build-device/bench/epcomm_bench}
for w in ${TRACE_WORKLOADS:-decode-bf16 decode small gpt-oss prefill}; do
  timeout ${TRACE_TIMEOUT:-90} $BENCH --workload "$w" --no-nccl --iters ${TRACE_ITERS:-30} \
    --trace ${TRACE_CALLS:-20} ${TRACE_ARGS:-} >"$OUT/trace_$w.txt" 2>"$OUT/trace_$w.err"
  echo "$w rc=$?"
  grep -vE "^\s*$|^(epcomm_bench|[0-9]+ timed|Times in|GB/s =|NCCL: not|workload  )" "$OUT/trace_$w.txt" |
    grep -vE "async\+wait|_wait half|ranked|routed|start  " 
done
