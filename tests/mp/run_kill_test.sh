#!/usr/bin/env bash
# The kill test's checker (ctest gpu_kill_4ranks; tests/mp/kill_test.cpp). Runs epcomm_kill_test
# on 4 ranks under epcomm_launch --keep-going and passes only if the launcher reports rank 2
# killed by SIGKILL and each of the 3 survivors printed its "detected" verdict and exited with 3.
# Any time limit that fires is a failure: something waited without a bound.
#   usage: run_kill_test.sh EPCOMM_LAUNCH EPCOMM_KILL_TEST [ARGS...]   (ARGS: to every rank)
# Exit status: 0 passed, 1 failed, 77 skipped (no GPU).
set -u -o pipefail

usage="usage: run_kill_test.sh EPCOMM_LAUNCH EPCOMM_KILL_TEST"
launch=${1:?$usage}
prog=${2:?$usage}
n=4
victim=2
detected=3

log=$(mktemp "${TMPDIR:-/tmp}/epcomm_kill_test.XXXXXX") || exit 1
trap 'rm -f "$log"' EXIT

fail() {
  echo "run_kill_test: FAIL: $*"
  exit 1
}

# The launcher kills every rank at its own limit (-t 90); this outer one only catches a launcher
# that hangs itself (on SIGTERM it kills the ranks too). Both give status 124.
timeout 105 "$launch" -n "$n" -t 90 --keep-going -- "$prog" "${@:3}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}

if [ "$rc" -eq 124 ] || grep -q "^epcomm_launch: time limit" "$log"; then
  fail "a time limit fired (status $rc): a rank waited without a bound"
fi
if [ "$rc" -eq 77 ]; then
  reason=$(grep -m1 "SKIPPED" "$log")
  echo "run_kill_test: SKIPPED: ${reason:-every rank reported skipped}"
  exit 77
fi
if ! grep -Eq "^epcomm_launch: rank $victim \(pid [0-9]+\) was killed by signal 9 \(SIGKILL\)$" \
    "$log"; then
  fail "the launcher did not report rank $victim killed by SIGKILL (launcher status $rc)"
fi
for ((r = 0; r < n; ++r)); do
  [ "$r" -eq "$victim" ] && continue
  if ! grep -Eq "^\[rank $r\] VERDICT detected: " "$log"; then
    why=$(grep -m1 -E "^\[rank $r\] VERDICT" "$log")
    fail "rank $r printed no 'detected' verdict${why:+ ($why)}"
  fi
  if ! grep -Eq "^epcomm_launch: rank $r \(pid [0-9]+\): exited with $detected$" "$log"; then
    how=$(grep -m1 -E "^epcomm_launch: rank $r \(pid [0-9]+\): " "$log")
    fail "rank $r did not exit with $detected${how:+ ($how)}"
  fi
done
echo "run_kill_test: PASS: rank $victim died by SIGKILL; the $((n - 1)) survivors detected it" \
  "(kTimeout naming it within the bound, poisoned, kPoisoned, bounded teardown) and exited" \
  "with $detected"
