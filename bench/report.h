// What a run reports: the table on stdout, the progress line on stderr, the JSON file.
#pragma once

#include <string>
#include <vector>

#include "epcomm/trace.h"
#include "timing.h"
#include "workloads.h"

namespace epbench {

// One operation of one implementation, over every rank.
struct OpResult {
  std::string op;  // "dispatch", "combine", "dispatch+combine" (per iteration, the two summed),
                   // each with " async+wait" for that form; and the async+wait halves
  std::string impl;           // "epcomm" or "nccl"
  std::vector<Stats> ranks;   // per rank, in rank order
  double bytes_per_rank = 0;  // logical bytes received per rank (mean over ranks and input sets)

  double median_us() const;  // max over ranks of the per-rank median
  double min_us() const;     // over every rank and iteration
  double max_us() const;
  double gbps() const;  // bytes_per_rank / median_us()
};

struct CheckResult {
  std::string what;  // "epcomm fused", "epcomm async+wait", "nccl"
  bool pass = false;
  std::string detail;  // e.g. the failing ranks
};

// The stage marks (epcomm/trace.h) of --trace's calls: for each rank, kernel and mark, the median
// over the calls of when the blocks passed it, µs after the rank's kernel start, at each of
// kBlockQuantiles of the blocks that passed (the first block, the median block, the 90th
// percentile, the last), and how many blocks passed it.
struct StageSummary {
  static constexpr int kQuantiles = 4;
  static constexpr double kBlockQuantiles[kQuantiles] = {0.0, 0.5, 0.9, 1.0};
  static constexpr const char* kQuantileNames[kQuantiles] = {"first", "median", "p90", "last"};
  int calls = 0;
  int blocks = 0;
  std::vector<double> at_us[kQuantiles];  // [quantile][rank][kernel][mark]
  std::vector<double> passed;             // [rank][kernel][mark]
  int ranks() const;
  size_t at(int rank, int kernel, int mark) const;
  // One field's values of (kernel, mark), in rank order.
  std::vector<double> per_rank(const std::vector<double>& field, int kernel, int mark) const;
};

struct WorkloadResult {
  Workload workload;  // with the overrides applied
  int num_sms = 0;
  std::string path;     // the dispatch path the group ran (Config::resolved_path)
  std::string skipped;  // why it did not run; empty if it ran
  std::string floor_skipped;  // --floor: why the floor did not run
  // Logical bytes: one message per (token, destination rank), of these sizes.
  double dispatch_message_bytes = 0;  // the dispatch format's codes + scales of one token
  double combine_message_bytes = 0;   // bf16: 2H
  std::vector<double> messages;       // per rank: messages received (mean over input sets)
  // Declared nodes (--ranks-per-node below the ranks): per rank, the dispatch messages sent to
  // ranks of other nodes, one per (token, remote rank) as now and one per (token, remote node)
  // as with forwarding inside the node (reference::cross_node_traffic; mean over input sets).
  int ranks_per_node = 0;
  std::vector<double> cross_node_direct, cross_node_per_node;
  // Declared nodes, after the timed runs: bytes each rank put through NVSHMEM in one fused
  // dispatch and the combine after it (Group::network_bytes_put), and the byte model's count for
  // the same calls (reference::cross_node_traffic, direct path); means over this process's
  // ranks and the input sets. Negative: not measured.
  double network_dispatch_bytes = -1, network_combine_bytes = -1;
  double model_dispatch_bytes = 0, model_combine_bytes = 0;
  std::vector<OpResult> ops;
  std::vector<CheckResult> checks;
  StageSummary stages;  // --trace
  // Device memory per rank, measured with cudaMemGetInfo around the allocations (mean over
  // ranks): the group's own buffers (Group::create), and the dispatch + combine outputs a caller
  // allocates from Group::sizes().
  double group_bytes = 0, output_bytes = 0;

  const OpResult* find(const std::string& op, const std::string& impl) const;
  // --floor: the variants of a series ("floor", or the "contiguous" diagnostic) of "dispatch"
  // or "combine", fastest first (empty without --floor), and the fastest floor (or null).
  std::vector<const OpResult*> series(const std::string& op, const std::string& name) const;
  const OpResult* best_floor(const std::string& op) const;
  // Logical bytes received per rank, mean over ranks, by an op named "dispatch..." or "combine...".
  double bytes_per_rank(const std::string& op) const;
  bool failed() const;
};

struct RunInfo {
  std::string hostname, gpu_name, commit, date, command_line, mode, nccl_version;
  int gpu_count = 0;
  int n_ranks = 0;
  int iters = 0, warmup = 0, input_sets = 0;
  size_t l2_flush_bytes = 0;
};

RunInfo describe_run(const std::string& command_line, bool multi_process, int n_ranks, int device,
                     const std::string& nccl_version);
void print_preamble(const RunInfo& info);
void print_table_header();
void print_workload(const WorkloadResult& r);
void write_json(const std::string& path, const RunInfo& info,
                const std::vector<WorkloadResult>& results);

// The progress line on stderr (rank 0 only): rewritten in place on a terminal, one line per
// phase otherwise.
class Progress {
 public:
  explicit Progress(bool enabled);
  void phase(const std::string& what);
  void tick(int done, int total);
  void done();

 private:
  bool enabled_, tty_;
  std::string phase_;
};

}  // namespace epbench
