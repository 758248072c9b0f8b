#!/usr/bin/env bash
# Nsight Compute's per-instruction warp-stall samples for one launch of one epcomm kernel: where
# a kernel's warps wait, by SASS instruction and CUDA source line (issue- and fetch-bound
# kernels, such as decode's low-latency dispatch, whose stage marks cannot say which). Builds
# epcomm_bench with -lineinfo (unless NO_BUILD=1) into $BUILD, profiles launch SKIP + 1 of the
# kernels matching KERNEL (ncu flushes every cache before it, as the benchmark flushes the L2),
# and leaves under $OUT:
#   ncu_source.txt        the report's sections (duration, stall reasons, instruction counts)
#   ncu_source_sass.csv.gz  the source page: one row per SASS instruction (address, executed
#                         count, stall samples by reason; no_instructions: waiting on fetch)
#   cubins.tar.gz         the profiled build's cubins (cuobjdump -xelf), whose nvdisasm -g maps
#                         the page to functions and source lines: scripts/sass_profile.py does
#                         (nvdisasm ships in the nvidia-cuda-nvdisasm wheel)
#   ncu_source.ncu-rep    the report, for the Nsight Compute GUI
# all four packed into ncu_source_all.tar.gz unless PACK=0.
# Settings: WORKLOAD (decode-bf16), SMS (132), KERNEL (dispatch_kernel), SKIP (1: the first
# launch of the benchmark's warm-up is skipped), BENCH_ARGS (more epcomm_bench arguments).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BUILD=${BUILD:-build-profile}
WORKLOAD=${WORKLOAD:-decode-bf16}
SMS=${SMS:-132}
KERNEL=${KERNEL:-dispatch_kernel}
if [ -z "${NO_BUILD:-}" ]; then
  cmake_build $BUILD "" --target epcomm_bench -- -DEPCOMM_BUILD_TESTS=OFF \
    -DEPCOMM_BUILD_EXAMPLES=OFF -DCMAKE_CUDA_FLAGS=-lineinfo || exit 1
fi
rep=$OUT/ncu_source
# shellcheck disable=SC2086
timeout ${RUN_TIMEOUT:-300} ncu --kernel-name "regex:$KERNEL" --launch-skip ${SKIP:-1} \
  --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section SourceCounters --section LaunchStats \
  --metrics smsp__inst_executed.sum \
  --export "$rep" --force-overwrite \
  $BUILD/bench/epcomm_bench --workload "$WORKLOAD" --sms "$SMS" --no-nccl --no-check --no-gate \
  --iters 2 --warmup 1 ${BENCH_ARGS:-} >"$rep.txt" 2>&1
echo "== ncu rc=$?"
grep -E "$KERNEL|Duration|Issued Warp|No Eligible|Warp Cycles Per Issued|Stall|stall" "$rep.txt" |
  head -40
timeout 120 ncu --import "$rep.ncu-rep" --page source --print-source sass --csv \
  >"${rep}_sass.csv" 2>&1
echo "== source page rc=$? rows=$(wc -l <"${rep}_sass.csv")"
gzip -f "${rep}_sass.csv"
cub=$(mktemp -d) bin=$(realpath "$BUILD/bench/epcomm_bench")
(cd "$cub" && timeout 120 cuobjdump -xelf all "$bin" >/dev/null 2>&1 &&
  tar czf "$OUT/cubins.tar.gz" ./*.cubin)
echo "== cubins rc=$? ($(ls "$cub" | tr '\n' ' '))"
rm -rf "$cub"
# One file back (these four next to a floor run's outputs were left behind once, 2026-11-27).
pack_out ncu_source_all.tar.gz ncu_source.txt ncu_source_sass.csv.gz ncu_source.ncu-rep \
  cubins.tar.gz
