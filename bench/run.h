// One workload end to end: inputs, epcomm (fused, then async + wait) and the NCCL baseline, each
// timed and then checked against the CPU reference.
#pragma once

#include "common.h"
#include "nccl_baseline.h"
#include "report.h"
#include "timing.h"
#include "workloads.h"

namespace epbench {

constexpr int kInputSets = 2;  // rotated between iterations: different tokens and routing

struct BenchEnv {
  const Team& team;
  Gate& gate;
  L2Flush& flush;
  const NcclComms* comms;  // null with --no-nccl
  Progress& progress;
};

WorkloadResult run_workload(const BenchEnv& env, const Workload& workload, const Options& opt);

}  // namespace epbench
