// The standard workloads (fixed names) and the command line.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "epcomm/config.h"

namespace epbench {

struct Workload {
  std::string name;
  int32_t tokens = 0;   // T, tokens per rank
  int32_t hidden = 0;   // H
  int32_t top_k = 0;    // K
  int32_t experts = 0;  // global experts
  std::string format;   // dispatch format, as docs/results/method.md names it
  double zipf_s = 0;    // expert popularity Zipf(s); 0 = uniform
};

// Every standard workload (docs/results/method.md), in its order, supported by this build or not.
const std::vector<Workload>& all_workloads();
// A workload's format is an epcomm::token_format_name where this build implements it
// (epcomm::token_format_from_name finds it), else a name the benchmark reports unsupported.

struct Options {
  std::vector<std::string> workloads;  // empty: every workload this build supports
  std::optional<int32_t> tokens, hidden, top_k, experts, num_sms;
  // One process: this many ranks, rank r on GPU r % GPUs (sharing GPUs where there are fewer:
  // Config::share_gpus, no NCCL baseline). Default: one rank per visible GPU.
  std::optional<int32_t> ranks;
  std::optional<std::string> format;  // dispatch format override (a token_format_name)
  // Config::ranks_per_node (0 or unset: from the hosts); fewer than the ranks: the group spans
  // (declared) nodes, and traffic between them goes through NVSHMEM (needs that build).
  std::optional<int32_t> ranks_per_node;
  std::optional<int32_t> timeout_seconds;  // Config::timeout_seconds (default the library's)
  int iters = 100;
  int warmup = 10;
  std::string json_path;
  bool nccl = true;
  bool check = true;
  bool flush = true;  // flush L2 before every timed call (--no-flush: warm caches, a diagnosis)
  bool gate = true;   // hold every stream at a gate before a timed batch (--no-gate: profilers)
  // epcomm's weighted combine: the router weights go to dispatch and each rank pre-sums its
  // experts' rows (true, default), or they go to combine and the token side sums (false).
  bool expert_side = true;
  epcomm::DispatchPath path = epcomm::DispatchPath::kAuto;  // Config::dispatch_path
  // Also time the memory floor (floor.h) with the same blocks; one process, every rank on one GPU.
  bool floor = false;
  // Also time the fused calls replayed from a CUDA graph (each captured once per input set).
  bool graph = false;
  int trace = 0;  // > 0: that many more fused calls with Config::trace, stage breakdown printed
  bool list = false;
  std::string command_line;
};

// Throws std::invalid_argument on a bad command line; exits 0 after --help.
Options parse_options(int argc, char** argv);
void print_workload_table();  // stdout
// The requested workloads with the overrides applied; throws on an unknown name.
std::vector<Workload> select_workloads(const Options& opt);

}  // namespace epbench
