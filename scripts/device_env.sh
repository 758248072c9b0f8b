# Sourced by every scripts/device_*.sh: the settings the device machines keep (NVLink multicast
# off), $OUT (the folder whose files come back), and the one build step.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"

# cmake_build DIR LOG_PREFIX [BUILD_ARG ...] [-- CMAKE_ARG ...]: configures DIR (Release, Ninja)
# and builds it under a timeout (BUILD_TIMEOUT, default 400 s), logged to
# $OUT/{LOG_PREFIX}configure.log and {LOG_PREFIX}build.log; on failure prints the errors and
# returns 1.
cmake_build() {
  local dir=$1 log=$OUT/$2
  shift 2
  local build_args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    build_args+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >"${log}configure.log" 2>&1 ||
    { tail -20 "${log}configure.log"; return 1; }
  timeout "${BUILD_TIMEOUT:-400}" cmake --build "$dir" -j "${build_args[@]}" >"${log}build.log" 2>&1 ||
    { grep -E "error|FAILED" "${log}build.log" | head -30; return 1; }
}

# pip_install: this tree's Python package into the machine's environment (no build isolation:
# the machine has no network), under a timeout, logged to $OUT/pip_install.log; prints its
# status and, on failure, the log's tail; returns pip's status.
pip_install() {
  timeout 400 python3 -m pip install --no-build-isolation -q . >"$OUT/pip_install.log" 2>&1
  local rc=$?
  echo "== pip install rc=$rc"
  [ $rc -eq 0 ] || tail -10 "$OUT/pip_install.log"
  return $rc
}

# pack_out ARCHIVE NAME...: the named files of $OUT into $OUT/ARCHIVE (tar.gz), then removed, so
# one file comes back where the device tool brings back only a few per call; with PACK=0 they
# stay apart. Names missing are skipped; the files are removed only once the archive is written.
pack_out() {
  local archive=$1
  shift
  [ "${PACK:-1}" = 1 ] || return 0
  (cd "$OUT" && { tar czf "$archive" "$@" 2>/dev/null; [ -s "$archive" ]; } && rm -f "$@" &&
    echo "== packed into $OUT/$archive")
}

gpu_count() { nvidia-smi -L 2>/dev/null | grep -c "^GPU"; }
# Whether GPU_SHARDS asks for one ctest per GPU and there is more than one GPU.
use_shards() { [ -n "${GPU_SHARDS:-}" ] && [ "$(gpu_count)" -gt 1 ]; }
# ctest_ran LOG...: how many tests the ctest logs ran, summed over them.
ctest_ran() {
  grep -hoE "tests passed, [0-9]+ tests failed out of [0-9]+|tests passed out of [0-9]+" "$@" |
    grep -oE "[0-9]+$" | awk '{ s += $1 } END { print s + 0 }'
}

# sharded_ctest BUILD_DIR LOG_PREFIX CTEST_ARG...: the tests ctest selects with CTEST_ARGs, as
# one ctest per GPU (each seeing only its GPU: ranks share it, as on a one-GPU machine; shard k
# takes every n-th test, -I k,,n), side by side; logs $OUT/{LOG_PREFIX}_k.log and, together,
# $OUT/{LOG_PREFIX}.log. Returns 1 if a shard failed or the shards' totals do not add up to the
# listing's count.
#  - One listing first: GoogleTest's PRE_TEST discovery writes each test executable's list on
#    the first ctest after a build, and shards starting together raced on it (one read a
#    half-written list and ran nothing, 4 x H200, 2026-11-26). The listing alone did not stop
#    it (a shard ran the discovery again and read an empty list, later that day), so each
#    shard also starts only once the one before has built its list.
#  - --no-tests=error, and the count: a shard that finds no test exits 0 by default.
sharded_ctest() {
  local dir=$1 log=$2
  shift 2
  local gpus want ran k r rc=0 pids=()
  gpus=$(gpu_count)
  want=$(cd "$dir" && timeout 120 ctest -N "$@" | grep -oE "Total Tests: [0-9]+" | grep -oE "[0-9]+")
  for ((k = 0; k < gpus; k++)); do
    (cd "$dir" && CUDA_VISIBLE_DEVICES=$k timeout "${SHARD_TIMEOUT:-540}" ctest "$@" \
       -I $((k + 1)),,"$gpus" -j1 --no-tests=error -V) >"$OUT/${log}_$k.log" 2>&1 &
    pids+=($!)
    # The next shard starts once this one has its test list: a shard's ctest may run the
    # discovery again, and CMake 4.4.0's discovery writes every executable's list to one JSON
    # file (CMake issue 27972), which a neighbour truncated (4 x H200, 2026-11-26: one shard
    # read an empty list and ran nothing). At most 120 s each.
    for ((w = 0; w < 240; w++)); do
      grep -q "Done constructing a list of tests" "$OUT/${log}_$k.log" 2>/dev/null && break
      kill -0 "${pids[$k]}" 2>/dev/null || break
      sleep 0.5
    done
  done
  for k in "${!pids[@]}"; do
    wait "${pids[$k]}"; r=$?; echo "shard $k (GPU $k) rc=$r"; [ $r -eq 0 ] || rc=1
    # A failed shard names its failures here: its log may not come back (the device tool
    # returns few files).
    [ $r -eq 0 ] || grep -E "\*\*\*(Failed|Timeout|Exception)|tests failed out of|No tests were found" \
      "$OUT/${log}_$k.log" | head -8 | sed "s/^/  shard $k: /"
  done
  cat "$OUT/${log}"_*.log >"$OUT/$log.log"
  ran=$(ctest_ran "$OUT/${log}"_*.log)
  echo "shards ran $ran of ${want:-?} tests"
  [ "$ran" = "${want:-x}" ] || rc=1
  return $rc
}
