#!/usr/bin/env bash
# Build (scripts/device_suite.sh), then run the GPU tests matching a gtest filter verbosely with
# a short limit: debugging through the device tool.   scripts/device_debug.sh 'Edge.*'
set -uo pipefail
BUILD_ONLY=1 EPCOMM_CMAKE_ARGS=-DEPCOMM_BUILD_BENCH=OFF "$(dirname "$0")/device_suite.sh" || exit 1
EPCOMM_TEST_TRACE=1 timeout ${T1:-60} build-device/tests/epcomm_gpu_tests --gtest_filter="$1" 2>&1 | tail -40
echo "rc=${PIPESTATUS[0]}"
