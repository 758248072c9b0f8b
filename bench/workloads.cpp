#include "workloads.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "common.h"  // parse_int

namespace epbench {
namespace {

const char* kUsage = R"(usage: epcomm_bench [options]
Runs the standard workloads: epcomm dispatch/combine (fused, async + wait) and the NCCL
send/recv baseline, timed and checked against the CPU reference.

  --workload NAME[,NAME]  workloads to run (repeatable); default: every one this build supports
  --list                  print the workload table and exit
  --tokens N  --hidden N  --topk N  --experts N
                          override the workload's T, H, K and expert count
  --format NAME           override the dispatch format: bf16, fp8-blockwise, nvfp4, mxfp8,
                          mxfp4 (H must suit it: a multiple of 128 for fp8-blockwise, of 32
                          for the others)
  --sms N                 Config::num_sms (default 24; with ranks sharing a GPU, at most what
                          fits: max_resident_blocks / ranks per GPU)
  --path auto|throughput|low-latency
                          Config::dispatch_path (default auto: low-latency up to 512 tokens
                          per rank with --sms 128 or more, throughput otherwise)
  --ranks N               one process, N ranks, rank r on GPU r % GPUs; more ranks than GPUs
                          share them (Config::share_gpus; no NCCL baseline: it needs a GPU per
                          rank). Timings then measure the protocol's fixed costs, not links
  --ranks-per-node N      Config::ranks_per_node: the group as nodes of N consecutive ranks
                          whatever the hardware; traffic between them goes through NVSHMEM
                          (a build with -DEPCOMM_WITH_NVSHMEM=ON, one process per rank)
  --timeout S             Config::timeout_seconds: the bound on every wait for a peer (default
                          300, or EPCOMM_TIMEOUT_SECONDS)
  --iters N               timed iterations (default 100)
  --warmup N              warm-up iterations (default 10)
  --json FILE             write every figure, with the machine and commit, to FILE
  --no-nccl               skip the NCCL baseline
  --no-check              skip the checks against the CPU reference
  --no-flush              do not flush L2 before each timed call: warm caches (inputs, the
                          kernels' code), to see what the cold misses cost; not the standard
                          method, never quote such figures as the benchmark's
  --no-gate               launch timed calls as they are issued, without holding the streams
                          at a gate first: for profilers (ncu serialises launches, so a gate
                          would wait out its 10 s limit); the timings include launch gaps
  --reduce expert|token   where epcomm's weighted combine sums a token's expert rows: on the
                          expert side (weights given to dispatch; one row per (token, rank)
                          back; default) or on the token side (one row per (token, k) back)
  --floor                 also time kernels that move exactly the HBM bytes each rank's dispatch
                          and combine must move (read each message once, write its rows; read
                          each expert row once, write one row per token), on the same SMs, in
                          a sweep of launch shapes (up to 1024 threads and several blocks per
                          SM, loads in flight per lane, bulk copies), and print each
                          operation's ratio to the fastest (one process, every rank on one GPU);
                          and a latency floor (any ranks; a process's own ranks take part): the
                          same grid launched empty, and with one flag round trip around the
                          ranks, each flag on its rank's GPU
  --graph                 also time dispatch and combine replayed from a CUDA graph (captured
                          once per input set), as serving engines run decode
  --trace N               after the timing, N more fused calls with Config::trace set: print
                          when each kernel's blocks pass each stage (epcomm/trace.h), µs after
                          the rank's kernel start, median over the N calls (the timed calls of
                          such a run also pay the marks' stores)

One process drives every visible GPU, unless EPCOMM_RANK, EPCOMM_WORLD_SIZE and
EPCOMM_BOOTSTRAP_DIR are set (one process per GPU, e.g. under epcomm_launch).
)";

}  // namespace

const std::vector<Workload>& all_workloads() {
  static const std::vector<Workload> table = {
      {"decode", 128, 7168, 8, 256, "fp8-blockwise", 0.0},
      {"decode-bf16", 128, 7168, 8, 256, "bf16", 0.0},
      {"prefill", 4096, 7168, 8, 256, "bf16", 0.0},
      {"prefill-fp8", 4096, 7168, 8, 256, "fp8-blockwise", 0.0},
      {"small", 512, 2048, 8, 128, "bf16", 0.0},
      {"gpt-oss", 1024, 2880, 4, 128, "mxfp4", 0.0},
      {"skewed", 4096, 7168, 8, 256, "bf16", 1.2},
  };
  return table;
}

Options parse_options(int argc, char** argv) {
  Options opt;
  for (int i = 0; i < argc; ++i)
    opt.command_line += (i ? " " : "") + std::string(argv[i]);
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    const size_t eq = flag.find('=');
    const bool inline_value = flag.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    auto next = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (flag == "--workload") {
      split_list(next(), &opt.workloads);
    } else if (flag == "--tokens") {
      opt.tokens = parse_int(flag, next(), 1);
    } else if (flag == "--hidden") {
      opt.hidden = parse_int(flag, next(), 8);
    } else if (flag == "--topk") {
      opt.top_k = parse_int(flag, next(), 1);
    } else if (flag == "--experts") {
      opt.experts = parse_int(flag, next(), 1);
    } else if (flag == "--format") {
      opt.format = next();
      if (!epcomm::token_format_from_name(*opt.format))
        throw std::invalid_argument("--format: unknown format '" + *opt.format + "' (one of " +
                                    epcomm::token_format_names() + ")");
    } else if (flag == "--ranks") {
      opt.ranks = parse_int(flag, next(), 1);
    } else if (flag == "--ranks-per-node") {
      opt.ranks_per_node = parse_int(flag, next(), 1);
    } else if (flag == "--timeout") {
      opt.timeout_seconds = parse_int(flag, next(), 1);
    } else if (flag == "--sms") {
      opt.num_sms = parse_int(flag, next(), 1);
    } else if (flag == "--iters") {
      opt.iters = parse_int(flag, next(), 1);
    } else if (flag == "--warmup") {
      opt.warmup = parse_int(flag, next(), 0);
    } else if (flag == "--json") {
      opt.json_path = next();
    } else if (flag == "--no-nccl") {
      opt.nccl = false;
    } else if (flag == "--no-flush") {
      opt.flush = false;
    } else if (flag == "--no-gate") {
      opt.gate = false;
    } else if (flag == "--no-check") {
      opt.check = false;
    } else if (flag == "--reduce") {
      const std::string where = next();
      if (where != "expert" && where != "token")
        throw std::invalid_argument("--reduce: '" + where + "' is neither expert nor token");
      opt.expert_side = where == "expert";
    } else if (flag == "--path") {
      const std::string v = next();
      const std::optional<epcomm::DispatchPath> path = epcomm::dispatch_path_from_name(v);
      if (!path)
        throw std::invalid_argument("--path: '" + v + "' is none of " +
                                    epcomm::dispatch_path_names());
      opt.path = *path;
    } else if (flag == "--floor") {
      opt.floor = true;
    } else if (flag == "--graph") {
      opt.graph = true;
    } else if (flag == "--trace") {
      opt.trace = parse_int(flag, next(), 1);
    } else if (flag == "--list") {
      opt.list = true;
    } else {
      throw std::invalid_argument("unknown option '" + flag + "' (see --help)");
    }
  }
  return opt;
}

void print_workload_table() {
  std::printf("%-12s %6s %6s %3s %7s %-14s %-10s %s\n", "workload", "T", "H", "K", "experts",
              "dispatch", "popularity", "this build");
  for (const Workload& w : all_workloads()) {
    const std::string popularity =
        w.zipf_s > 0 ? "zipf " + std::to_string(w.zipf_s).substr(0, 3) : std::string("uniform");
    std::printf("%-12s %6d %6d %3d %7d %-14s %-10s %s\n", w.name.c_str(), w.tokens, w.hidden,
                w.top_k, w.experts, w.format.c_str(), popularity.c_str(),
                epcomm::token_format_from_name(w.format) ? "supported" : "not supported");
  }
}

std::vector<Workload> select_workloads(const Options& opt) {
  std::vector<Workload> selected;
  if (opt.workloads.empty()) {
    for (const Workload& w : all_workloads())
      if (epcomm::token_format_from_name(w.format)) selected.push_back(w);
  }
  for (const std::string& name : opt.workloads) {
    const Workload* found = nullptr;
    for (const Workload& w : all_workloads())
      if (w.name == name) found = &w;
    if (!found) throw std::invalid_argument("unknown workload '" + name + "' (see --list)");
    selected.push_back(*found);
  }
  for (Workload& w : selected) {
    w.tokens = opt.tokens.value_or(w.tokens);
    w.hidden = opt.hidden.value_or(w.hidden);
    w.top_k = opt.top_k.value_or(w.top_k);
    w.experts = opt.experts.value_or(w.experts);
    w.format = opt.format.value_or(w.format);
  }
  return selected;
}

}  // namespace epbench
