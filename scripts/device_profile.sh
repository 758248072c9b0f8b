#!/usr/bin/env bash
# Nsight Compute on one rank's prefill kernels and the floor kernels with few SMs: builds
# epcomm_bench (unless NO_BUILD=1) into $BUILD, then profiles dispatch, combine and the --floor
# kernels for each reduction. Text reports under $OUT. Ungated (--no-gate): ncu serialises launches.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BUILD=${BUILD:-build-device}
WORKLOAD=${WORKLOAD:-prefill}
SMS=${SMS:-8}
KERNELS=${KERNELS:-combine_kernel|dispatch_kernel|floor}
if [ -z "${NO_BUILD:-}" ]; then
  cmake_build $BUILD "" --target epcomm_bench -- -DEPCOMM_BUILD_TESTS=OFF \
    -DEPCOMM_BUILD_EXAMPLES=OFF || exit 1
fi
for reduce in ${REDUCE:-expert token}; do
  f="$OUT/ncu_${WORKLOAD}_${reduce}_sms$SMS.txt"
  timeout ${RUN_TIMEOUT:-240} ncu --kernel-name "regex:$KERNELS" --launch-count ${COUNT:-12} \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section LaunchStats --section Occupancy --section SchedulerStats \
    --metrics l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read.sum \
    $BUILD/bench/epcomm_bench --workload "$WORKLOAD" --sms $SMS --no-nccl --no-check --no-gate \
    --iters 1 --warmup 0 --floor --reduce $reduce >"$f" 2>&1
  echo "== reduce=$reduce rc=$?"
  grep -E "^  [a-z_]*(kernel|floor)|Duration|DRAM Throughput|Memory Throughput|Registers Per|Local Memory|local_op|dram__bytes|Warp Cycles Per Issued|Issued Warp|No Eligible" "$f" | head -150
done
