#!/usr/bin/env bash
# DeepEP's own test programs, tests/legacy/test_intranode.py and test_low_latency.py, run
# unchanged against epcomm.deep_ep with NPROCS processes (default "1 2 4"; they share the GPUs
# there are), after installing this tree's Python package (INSTALL=0: already installed).
#   DEEPEP   a DeepEP source tree holding tests/legacy and deep_ep/utils (default .deepep/src).
#            It is never committed: export it into an ignored folder and carry it, e.g.
#            git --git-dir=<DeepEP clone>/.git archive HEAD tests/legacy deep_ep/utils |
#              tar -x -C .deepep/src
#   TESTS    which programs (default "test_intranode test_low_latency")
# The tests import `deep_ep`; they get a shim package: deep_ep is epcomm.deep_ep,
# deep_ep.utils.math and .testing are DeepEP's own files, deep_ep.utils.envs is
# scripts/deepep_envs.py (init_dist for processes sharing a GPU; it says what differs).
# Logs under $OUT; prints each run's status and last lines.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
DEEPEP=${DEEPEP:-.deepep/src}
NPROCS=${NPROCS:-"1 2 4"}
TESTS=${TESTS:-"test_intranode test_low_latency"}
[ -f "$DEEPEP/tests/legacy/test_intranode.py" ] && [ -f "$DEEPEP/deep_ep/utils/testing.py" ] ||
  { echo "no DeepEP tree at $DEEPEP (tests/legacy, deep_ep/utils)"; exit 1; }
shim=$(mktemp -d)
mkdir -p "$shim/deep_ep/utils"
echo "from epcomm.deep_ep import *  # noqa: F401,F403" >"$shim/deep_ep/__init__.py"
: >"$shim/deep_ep/utils/__init__.py"
cp "$DEEPEP/deep_ep/utils/math.py" "$DEEPEP/deep_ep/utils/testing.py" "$shim/deep_ep/utils/"
cp "$(dirname "$0")/deepep_envs.py" "$shim/deep_ep/utils/envs.py"
if [ "${INSTALL:-1}" = 1 ]; then
  pip_install || exit 1
fi
status=0 port=8361
for t in $TESTS; do
  for n in $NPROCS; do
    log=$OUT/deepep_${t}_$n.log
    port=$((port + 1))  # a fresh port per run: the last one may still be in TIME_WAIT
    (cd "$DEEPEP/tests/legacy" && PYTHONPATH="$shim:.${PYTHONPATH:+:$PYTHONPATH}" MASTER_PORT=$port PYTHONUNBUFFERED=1 \
      timeout "${TEST_TIMEOUT:-200}" python3 "$t.py" --num-processes "$n") >"$log" 2>&1
    rc=$?; echo "== $t, $n processes: rc=$rc"; [ $rc -eq 0 ] || status=1
    # test_intranode prints a line per passed case; test_low_latency prints none (its checks are
    # asserts, so rc 0 is its verdict).
    cases=$(grep -cE "\.\.\. passed" "$log")
    [ "$cases" -gt 0 ] && echo "   cases passed: $cases" || echo "   (no per-case lines: rc is the verdict)"
    grep -vE "^\s*$|\[tuning\]" "$log" | tail -"${TAIL:-3}"
  done
done
exit $status
