#!/usr/bin/env bash
# The benchmark on a device machine (after scripts/device_suite.sh built build-device): every
# workload with the NCCL baseline at the default 24 SMs, then `prefill` against the number of SMs
# (SMS_CURVE) and `decode` and `decode-bf16` against the number of SMs (DECODE_SMS_CURVE) on each
# dispatch path (the SM count from which the low-latency path wins decides what `auto` takes:
# kLowLatencyMinSms, epcomm/config.h), then the plot. BENCH_ARGS go to every run (e.g. "--ranks 8": 8 ranks
# sharing the GPUs there are; no NCCL baseline then, and the timings measure the protocol's fixed
# costs, not links). Results under $OUT.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BENCH=${BENCH:-build-device/bench/epcomm_bench}
ARGS=${BENCH_ARGS:-}
timeout ${BENCH_TIMEOUT:-200} $BENCH $ARGS --json "$OUT/bench.json" >"$OUT/bench.txt" 2>"$OUT/bench.err"
echo "bench rc=$?"
grep -vE "^\s*$" "$OUT/bench.txt" | tail -40
curve() {  # curve WORKLOAD PATH SMS...: one run per SM count, no baseline, no check (checked above)
  local w=$1 path=$2; shift 2
  for s in "$@"; do
    timeout ${CURVE_TIMEOUT:-60} $BENCH $ARGS --workload "$w" --path "$path" --sms "$s" --no-nccl \
      --no-check --json "$OUT/curves/${w}_${path}_sms$s.json" 2>>"$OUT/curve.err" | grep -E "^$w " |
      sed "s/^/sms=$s $path /"
  done
}
mkdir -p "$OUT/curves"
# The curves' lines also go to curves.txt (a caller's output tail may cut them).
{
  curve prefill auto ${SMS_CURVE:-8 16 32 64}
  for w in decode decode-bf16; do
    for path in throughput low-latency; do curve $w $path ${DECODE_SMS_CURVE:-16 24 32 64 132}; done
  done
} | tee "$OUT/curves.txt"
python3 bench/plot.py "$OUT/bench.png" "$OUT/bench.json" >/dev/null 2>>"$OUT/bench.err" &&
  echo "plot: bench.png" || echo "plot failed: $(tail -1 "$OUT/bench.err")"
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
# The curves' JSON and the error logs in one file: the device tool brings back at most 8 (this
# leaves bench.txt, bench.json, bench.png, curves.txt, silu.txt, silu.json and logs.tgz).
(cd "$OUT" && tar czf logs.tgz curves $(ls bench.err curve.err silu.err 2>/dev/null) &&
  rm -rf curves bench.err curve.err silu.err)
