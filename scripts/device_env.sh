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
