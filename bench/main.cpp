// epcomm_bench: the standard workloads (docs/performance.md), epcomm against the NCCL baseline in the same run.
// Exit status: 0 all checks passed, 1 a check failed, 2 an error stopped the run.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "nccl_baseline.h"
#include "report.h"
#include "run.h"

int main(int argc, char** argv) {
  using namespace epbench;
  // The shared GPU machines must not use NVLink multicast (DEVICE.md); the caller may override.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  try {
    Options opt = parse_options(argc, argv);
    if (opt.list) {
      print_workload_table();
      return 0;
    }
    const std::vector<Workload> workloads = select_workloads(opt);
    const std::unique_ptr<Team> team = Team::create(opt.ranks.value_or(0));
    if (team->ranks_per_gpu() > 1 && opt.nccl) {
      std::fprintf(stderr,
                   "[epcomm_bench] %d ranks share each GPU: no NCCL baseline (NCCL needs a GPU "
                   "per rank); timings measure the protocol's fixed costs, not links\n",
                   team->ranks_per_gpu());
      opt.nccl = false;
    }
    Progress progress(team->root());
    std::unique_ptr<NcclComms> comms;
    if (opt.nccl) {
      progress.phase("NCCL set-up");
      comms = std::make_unique<NcclComms>(*team);
    }
    Gate gate(opt.gate && !team->multi_process());
    L2Flush flush(*team, opt.flush);

    RunInfo info = describe_run(opt.command_line, team->multi_process(), team->n_ranks(),
                                team->local().front().device,
                                opt.nccl ? nccl_version_string() : std::string());
    if (team->ranks_per_gpu() > 1)
      info.mode += ", " + std::to_string(team->ranks_per_gpu()) + " ranks per GPU (shared)";
    if (opt.ranks_per_node && *opt.ranks_per_node < team->n_ranks())
      info.mode += ", declared nodes of " + std::to_string(*opt.ranks_per_node) +
                   " ranks (NVSHMEM between them)";
    info.iters = opt.iters;
    info.warmup = opt.warmup;
    info.input_sets = kInputSets;
    info.l2_flush_bytes = flush.bytes();
    if (team->root()) {
      print_preamble(info);
      print_table_header();
    }

    const BenchEnv env{*team, gate, flush, comms.get(), progress};
    std::vector<WorkloadResult> results;
    bool failed = false;
    for (const Workload& w : workloads) {
      results.push_back(run_workload(env, w, opt));
      progress.done();
      if (team->root()) print_workload(results.back());
      failed = failed || results.back().failed();
    }
    if (team->root() && opt.workloads.empty()) {
      std::string others;
      for (const Workload& w : all_workloads())
        if (!epcomm::token_format_from_name(w.format)) others += " " + w.name + " (" + w.format + ")";
      if (!others.empty()) std::printf("not supported by this build:%s\n", others.c_str());
    }
    if (team->root() && !opt.json_path.empty()) {
      write_json(opt.json_path, info, results);
      std::fprintf(stderr, "[epcomm_bench] wrote %s\n", opt.json_path.c_str());
    }
    if (team->root())
      std::printf("\n%s\n", failed      ? "FAIL: a check failed"
                            : opt.check ? "all checks passed"
                                        : "not checked (--no-check)");
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nepcomm_bench: error: %s\n", e.what());
    return 2;
  }
}
