#!/usr/bin/env bash
# A/B of source trees on one device machine, in one call: builds epcomm_bench from each tree
# (every tree but this one without .git, e.g. `git archive <commit> | tar -x -C .ab/base`,
# carried as `.ab`), side by side, then runs the same benchmark commands on all of them,
# alternating trees within each round (REPS rounds), so the spread between rounds of one tree
# is the noise a difference must beat.
#   TREES     name=path pairs, separated by spaces (default "base=$BASE head=.": the baseline
#             and this tree); e.g. "base=.ab/base send=.ab/send rounds=.ab/rounds" compares
#             several branches against one base in a single call
#   BASE      the baseline tree of the default TREES (default .ab/base)
#   RUNS      benchmark argument sets, separated by ';' (default: prefill and prefill-fp8 at 24
#             SMs; decode-bf16 and decode at 132)
#   REPS      rounds (default 2)
#   AB_CMAKE_ARGS  more CMake arguments for every tree's build, e.g. -DEPCOMM_WITH_NVSHMEM=ON to
#             time the kernels as the NVSHMEM build compiles them (relocatable device code, which
#             holds registers differently: its prefill combine once spilled where the plain build's
#             did not)
# Output: one line per (round, tree, workload, op): median and min in µs; the raw logs in
# $OUT/ab_logs.tar.gz (the device tool brings back few files).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BASE=${BASE:-.ab/base}
TREES=${TREES:-"base=$BASE head=."}
REPS=${REPS:-2}
RUNS=${RUNS:-"--workload prefill,prefill-fp8 --sms 24;--workload decode-bf16,decode --sms 132"}
ROOT=$PWD
LOGS=$OUT/ab
mkdir -p "$LOGS"
names=() paths=()
for pair in $TREES; do
  name=${pair%%=*} path=${pair#*=}
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ && -d "$path" ]] || { echo "bad tree '$pair' (name=path)"; exit 1; }
  names+=("$name") paths+=("$path")
done
for i in "${!names[@]}"; do  # side by side: each build takes the cores it gets
  (cd "${paths[$i]}" && cmake_build "$ROOT/build-ab-${names[$i]}" "ab/${names[$i]}_" \
     --target epcomm_bench -- -DEPCOMM_BUILD_TESTS=OFF -DEPCOMM_BUILD_EXAMPLES=OFF ${AB_CMAKE_ARGS:-}) ||
    { echo "build of ${paths[$i]} failed"; exit 1; } &
done
for job in $(jobs -p); do wait "$job" || exit 1; done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sed 's/^/gpu: /'
IFS=';' read -r -a runs <<<"$RUNS"
for rep in $(seq 1 "$REPS"); do
  for tree in "${names[@]}"; do
    for i in "${!runs[@]}"; do
      log="$LOGS/${tree}_r${rep}_$i.txt"
      # shellcheck disable=SC2086
      timeout ${RUN_TIMEOUT:-120} "$ROOT/build-ab-$tree/bench/epcomm_bench" ${runs[$i]} --no-nccl \
        >"$log" 2>"${log%.txt}.err"
      rc=$?
      [ $rc -eq 0 ] || echo "$tree round $rep run $i rc=$rc: $(tail -2 "${log%.txt}.err" | tr '\n' ' ')"
      # Workload rows: name, op, median, min.
      awk -v t=$tree -v r=$rep '$1 ~ /^(prefill|prefill-fp8|decode|decode-bf16|skewed|small|gpt-oss)$/ &&
        $3 ~ /^[0-9.]+$/ { printf "r%s %-8s %-12s %-20s median %8s min %8s\n", r, t, $1, $2, $3, $4 }' "$log"
      grep -E "check:" "$log" | sed "s/^/r$rep $tree /" | head -4
    done
  done
done
tar czf "$OUT/ab_logs.tar.gz" -C "$OUT" ab && rm -rf "$LOGS"
