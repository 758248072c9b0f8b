#!/usr/bin/env bash
# The examples on a device machine over RANKS ranks (default 8; they share the GPUs where there
# are fewer): examples/moe_layer (C++, one process, after scripts/device_suite.sh built
# build-device) in bf16, fp8 with the shared expert, and nvfp4; then the Python package
# (pip install --no-build-isolation: the machine has no network) and examples/torch_moe.py under
# torchrun with RANKS processes, bf16 and fp8-blockwise. Each checks itself against the layer
# computed without epcomm. Logs under $OUT.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
BUILD=${BUILD:-build-device}
RANKS=${RANKS:-8}
status=0
run() {  # run NAME COMMAND...: logged, bounded, its last lines shown
  local name=$1; shift
  timeout ${EXAMPLE_TIMEOUT:-150} "$@" >"$OUT/$name.log" 2>&1
  local rc=$?; echo "== $name rc=$rc"; [ $rc -eq 0 ] || status=1
  tail -${TAIL:-4} "$OUT/$name.log"
}
[ -x $BUILD/examples/moe_layer ] || timeout 200 cmake --build $BUILD -j --target moe_layer >/dev/null
run moe_layer_bf16 $BUILD/examples/moe_layer --ranks $RANKS --format bf16
run moe_layer_fp8_shared $BUILD/examples/moe_layer --ranks $RANKS --format fp8 --shared
run moe_layer_nvfp4 $BUILD/examples/moe_layer --ranks $RANKS --format nvfp4
pip_install || status=1
for fmt in bf16 fp8-blockwise; do
  run torch_moe_$fmt torchrun --nproc-per-node $RANKS examples/torch_moe.py --format $fmt
done
exit $status
