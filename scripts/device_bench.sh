#!/usr/bin/env bash
# The benchmark on a device machine (after scripts/device_suite.sh built build-device): every
# workload with the NCCL baseline, then prefill against the number of SMs. Results under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
BENCH=${BENCH:-build-device/bench/epcomm_bench}
export EPCOMM_COMMIT=${EPCOMM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
timeout ${BENCH_TIMEOUT:-200} $BENCH --json "$OUT/bench.json" >"$OUT/bench.txt" 2>"$OUT/bench.err"
echo "bench rc=$?"
grep -vE "^\s*$" "$OUT/bench.txt" | tail -40
for s in ${SMS_CURVE:-8 16 32 64}; do
  timeout 45 $BENCH --workload prefill --sms "$s" --no-nccl --no-check \
    --json "$OUT/prefill_sms$s.json" 2>/dev/null | grep -E "^prefill" | sed "s/^/sms=$s /"
done
# The fused SiLU kernels on GPU 0 against their memory floor (bench/silu_bench.cpp).
SILU_BENCH=${SILU_BENCH:-$(dirname "$BENCH")/epcomm_silu_bench}
if [ -x "$SILU_BENCH" ]; then
  timeout 60 $SILU_BENCH --json "$OUT/silu.json" >"$OUT/silu.txt" 2>"$OUT/silu.err"
  rc=$?; echo "silu bench rc=$rc"
  cat "$OUT/silu.txt"
  [ $rc -eq 0 ] || tail -5 "$OUT/silu.err"
else
  echo "silu bench: $SILU_BENCH not built"
fi
