#include "report.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>

#include "common.h"
#include "json.h"

namespace epbench {

double OpResult::median_us() const {
  double v = 0;
  for (const Stats& s : ranks)
    v = std::max(v, s.median_us);
  return v;
}

double OpResult::min_us() const {
  double v = ranks.empty() ? 0 : ranks.front().min_us;
  for (const Stats& s : ranks)
    v = std::min(v, s.min_us);
  return v;
}

double OpResult::max_us() const {
  double v = 0;
  for (const Stats& s : ranks)
    v = std::max(v, s.max_us);
  return v;
}

double OpResult::gbps() const {
  const double t = median_us();
  return t > 0 ? bytes_per_rank / t * 1e-3 : 0;  // bytes/us = 1e6 B/s; GB/s = 1e9 B/s
}

const OpResult* WorkloadResult::find(const std::string& op, const std::string& impl) const {
  for (const OpResult& r : ops)
    if (r.op == op && r.impl == impl) return &r;
  return nullptr;
}

std::vector<const OpResult*> WorkloadResult::series(const std::string& op,
                                                    const std::string& name) const {
  std::vector<const OpResult*> out;
  for (const OpResult& f : ops)
    if (f.impl == name && f.op.rfind(op + " " + name, 0) == 0) out.push_back(&f);
  std::sort(out.begin(), out.end(),
            [](const OpResult* a, const OpResult* b) { return a->median_us() < b->median_us(); });
  return out;
}

const OpResult* WorkloadResult::best_floor(const std::string& op) const {
  const std::vector<const OpResult*> floors = series(op, "floor");
  return floors.empty() ? nullptr : floors.front();
}

double WorkloadResult::bytes_per_rank(const std::string& op) const {
  double mean = 0;
  for (double m : messages)
    mean += m / double(messages.size());
  // "dispatch+combine": the round trip's messages, one of each.
  if (op.rfind("dispatch+combine", 0) == 0)
    return mean * (dispatch_message_bytes + combine_message_bytes);
  return mean * (op.rfind("dispatch", 0) == 0 ? dispatch_message_bytes : combine_message_bytes);
}

bool WorkloadResult::failed() const {
  for (const CheckResult& c : checks)
    if (!c.pass) return true;
  return false;
}

namespace {

void write_op(JsonWriter& j, const OpResult& r) {
  j.begin_object();
  j.value("op", r.op);
  j.value("impl", r.impl);
  j.value("median_us", r.median_us());
  j.value("min_us", r.min_us());
  j.value("max_us", r.max_us());
  j.value("gbps", r.gbps());
  j.value("bytes_per_rank", r.bytes_per_rank);
  std::vector<double> med, lo, hi;
  for (const Stats& s : r.ranks) {
    med.push_back(s.median_us);
    lo.push_back(s.min_us);
    hi.push_back(s.max_us);
  }
  j.numbers("rank_median_us", med);
  j.numbers("rank_min_us", lo);
  j.numbers("rank_max_us", hi);
  j.end_object();
}

void write_workload(JsonWriter& j, const WorkloadResult& r) {
  const Workload& w = r.workload;
  j.begin_object();
  j.value("name", w.name);
  j.value("tokens", w.tokens);
  j.value("hidden", w.hidden);
  j.value("top_k", w.top_k);
  j.value("experts", w.experts);
  j.value("format", w.format);
  j.value("zipf_s", w.zipf_s);
  j.value("num_sms", r.num_sms);
  j.value("dispatch_path", r.path);
  j.value("group_bytes_per_rank", r.group_bytes);
  j.value("output_bytes_per_rank", r.output_bytes);
  j.value("ran", r.skipped.empty());
  if (!r.skipped.empty()) j.value("skipped", r.skipped);
  // Logical bytes count one message per (token, destination rank) of these sizes: dispatch, the
  // format's codes + scales of one token (bf16 2H; blockwise FP8 H + 4 H/128; MXFP4 H/2 + H/32);
  // combine, bf16 (2H). Each result's bytes_per_rank is the one its GB/s uses.
  j.value("dispatch_message_bytes", r.dispatch_message_bytes);
  j.value("combine_message_bytes", r.combine_message_bytes);
  j.numbers("messages_per_rank", r.messages);
  if (r.ranks_per_node > 0) {
    j.value("ranks_per_node", r.ranks_per_node);
    j.numbers("cross_node_messages_direct", r.cross_node_direct);
    j.numbers("cross_node_messages_per_node", r.cross_node_per_node);
    if (r.network_dispatch_bytes >= 0) {
      j.value("nvshmem_dispatch_bytes", r.network_dispatch_bytes);
      j.value("nvshmem_combine_bytes", r.network_combine_bytes);
      j.value("model_dispatch_bytes", r.model_dispatch_bytes);
      j.value("model_combine_bytes", r.model_combine_bytes);
    }
  }
  std::vector<double> dispatch_bytes;
  for (double m : r.messages)
    dispatch_bytes.push_back(m * r.dispatch_message_bytes);
  j.numbers("logical_bytes_per_rank", dispatch_bytes);  // dispatch's
  j.begin_array("checks");
  for (const CheckResult& c : r.checks) {
    j.begin_object();
    j.value("what", c.what);
    j.value("pass", c.pass);
    j.value("detail", c.detail);
    j.end_object();
  }
  j.end_array();
  j.begin_array("results");
  for (const OpResult& op : r.ops)
    write_op(j, op);
  j.end_array();
  j.begin_object("speedup_over_nccl");
  for (const OpResult& op : r.ops) {
    const OpResult* base =
        op.impl == "epcomm" ? r.find(op.op.substr(0, op.op.find(' ')), "nccl") : nullptr;
    if (base && op.median_us() > 0) j.value(op.op.c_str(), base->median_us() / op.median_us());
  }
  j.end_object();
  if (r.best_floor("dispatch")) {  // --floor: epcomm's fused time over the fastest floor's
    j.begin_object("ratio_to_floor");
    for (const char* op : {"dispatch", "combine"}) {
      const OpResult* best = r.best_floor(op);
      const OpResult* mine = r.find(op, "epcomm");
      if (best && mine && best->median_us() > 0) j.value(op, mine->median_us() / best->median_us());
    }
    j.end_object();
  }
  if (!r.floor_skipped.empty()) j.value("floor_skipped", r.floor_skipped);
  const StageSummary& s = r.stages;
  if (s.calls > 0) {  // --trace: per kernel and mark, per rank in rank order (-1: not passed)
    j.begin_object("stages");
    j.value("calls", s.calls);
    j.value("blocks", s.blocks);
    const char* kernels[epcomm::kTraceKernels] = {"dispatch", "combine"};
    for (int k = 0; k < epcomm::kTraceKernels; ++k) {
      j.begin_object(kernels[k]);
      for (int m = 0; m < epcomm::kTraceMarks; ++m) {
        j.begin_object(epcomm::trace_mark_name(epcomm::TraceMark(m)));
        for (int q = 0; q < StageSummary::kQuantiles; ++q)
          j.numbers((std::string(StageSummary::kQuantileNames[q]) + "_us").c_str(),
                    s.per_rank(s.at_us[q], k, m));
        j.numbers("blocks", s.per_rank(s.passed, k, m));
        j.end_object();
      }
      j.end_object();
    }
    j.end_object();
  }
  j.end_object();
}

}  // namespace

RunInfo describe_run(const std::string& command_line, bool multi_process, int n_ranks, int device,
                     const std::string& nccl_version) {
  RunInfo info;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  info.hostname = host;
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  info.gpu_name = prop.name;
  CHECK_CUDA(cudaGetDeviceCount(&info.gpu_count));
  info.commit = git_commit();
  info.date = utc_now();
  info.command_line = command_line;
  info.mode = multi_process ? "multi-process" : "one-process";
  info.n_ranks = n_ranks;
  info.nccl_version = nccl_version;
  return info;
}

void print_preamble(const RunInfo& info) {
  std::printf("epcomm_bench  %s  %s x%d  %d ranks (%s)  commit %s  %s\n", info.hostname.c_str(),
              info.gpu_name.c_str(), info.gpu_count, info.n_ranks, info.mode.c_str(),
              info.commit.c_str(), info.date.c_str());
  if (info.l2_flush_bytes > 0)
    std::printf(
        "%d timed iterations after %d warm-up; L2 flushed by a %.0f MiB memset before every "
        "timed call; %d input sets (different routing) rotated.\n",
        info.iters, info.warmup, double(info.l2_flush_bytes) / (1 << 20), info.input_sets);
  else
    std::printf(
        "%d timed iterations after %d warm-up; L2 NOT flushed (--no-flush: warm caches, a "
        "diagnosis, not the standard method); %d input sets (different routing) rotated.\n",
        info.iters, info.warmup, info.input_sets);
  std::printf(
      "Times in us: median = max over ranks of the per-rank median, min/max over all ranks and "
      "iterations.\nGB/s = logical bytes received per rank / median, one message per (token, "
      "rank), local ones included: a dispatch message is the format's codes + scales of one token "
      "(bf16 2H, FP8 blockwise H + 4H/128, MXFP4 H/2 + H/32), a combine message bf16 (2H).\n"
      "dispatch+combine: per rank and iteration the two times summed (ranks are not re-aligned "
      "between them, so skew moves time from one to the other, not out of the sum).\n"
      "NCCL: %s%s.\n\n",
      info.nccl_version.empty() ? "not run" : "send/recv baseline, NCCL ",
      info.nccl_version.c_str());
  std::fflush(stdout);
}

void print_table_header() {
  std::printf("%-12s %-27s %9s %9s %9s %8s  %9s %8s  %8s\n", "workload", "op", "median", "min",
              "max", "GB/s", "NCCL med", "GB/s", "speed-up");
  std::fflush(stdout);
}

int StageSummary::ranks() const {
  return int(passed.size() / (size_t(epcomm::kTraceKernels) * epcomm::kTraceMarks));
}

size_t StageSummary::at(int rank, int kernel, int mark) const {
  return (size_t(rank) * epcomm::kTraceKernels + size_t(kernel)) * epcomm::kTraceMarks + size_t(mark);
}

std::vector<double> StageSummary::per_rank(const std::vector<double>& field, int kernel,
                                           int mark) const {
  std::vector<double> v;
  for (int q = 0; q < ranks(); ++q) v.push_back(field[at(q, kernel, mark)]);
  return v;
}

namespace {

// --trace: per kernel and mark, when the first, the median, the 90th-percentile and the last
// block passed it (the worst rank's median over the calls), then the last block's time on each
// rank.
void print_stages(const WorkloadResult& r) {
  const StageSummary& s = r.stages;
  const int n = s.ranks();
  if (s.calls == 0 || n == 0) return;
  std::printf(
      "%-12s stage marks of %d fused calls, %d blocks (µs after the rank's kernel start; "
      "median over the calls; first/median/p90/last: when that share of the blocks had "
      "passed, worst rank)\n",
      "", s.calls, s.blocks);
  const char* kernels[epcomm::kTraceKernels] = {"dispatch", "combine"};
  auto worst = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  for (int k = 0; k < epcomm::kTraceKernels; ++k) {
    std::printf("%-12s %-9s %-11s %6s", "", kernels[k], "mark", "blocks");
    for (const char* q : StageSummary::kQuantileNames)
      std::printf(" %7s", q);
    std::printf("   last, rank 0..%d\n", n - 1);
    for (int m = 0; m < epcomm::kTraceMarks; ++m) {
      const std::vector<double> passed = s.per_rank(s.passed, k, m);
      if (worst(passed) == 0) continue;
      std::printf("%-12s %-9s %-11s %6.0f", "", "", epcomm::trace_mark_name(epcomm::TraceMark(m)),
                  worst(passed));
      for (const std::vector<double>& field : s.at_us)
        std::printf(" %7.1f", worst(s.per_rank(field, k, m)));
      std::printf("  ");
      for (double v : s.per_rank(s.at_us[StageSummary::kQuantiles - 1], k, m))
        std::printf(" %6.1f", v);
      std::printf("\n");
    }
  }
}

}  // namespace

// --floor: the three fastest variants' time and HBM rate (per SM too; every variant is in the
// JSON), and the fused op's ratio to the fastest.
void print_floor(const WorkloadResult& r) {
  if (!r.floor_skipped.empty()) std::printf("%-12s floor: %s\n", "", r.floor_skipped.c_str());
  const OpResult* empty = r.find("launch empty", "latency");
  const OpResult* trip = r.find("launch roundtrip", "latency");
  if (empty && trip)
    std::printf("%-12s latency floor (%d blocks, as epcomm launches them): empty launch %.1f us, "
                "with one flag round trip %.1f us\n",
                "", r.num_sms, empty->median_us(), trip->median_us());
  for (const char* op : {"dispatch", "combine"}) {
    const OpResult* best = r.best_floor(op);
    const OpResult* mine = r.find(op, "epcomm");
    if (!best || !mine) continue;
    const std::vector<const OpResult*> floors = r.series(op, "floor");
    std::string variants;
    for (size_t i = 0; i < floors.size() && i < 3; ++i) {
      const OpResult& f = *floors[i];
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s%s %.1f us %.0f GB/s (%.1f per SM)",
                    variants.empty() ? "" : ", ", f.op.substr(f.op.rfind(' ') + 1).c_str(),
                    f.median_us(), f.gbps(), f.gbps() / r.num_sms);
      variants += buf;
    }
    std::printf("%-12s %s floor (%.0f MB of HBM traffic per rank; fastest of %zu shapes): %s; "
                "epcomm %.1f us = %.2fx\n",
                "", op, best->bytes_per_rank / 1e6, floors.size(), variants.c_str(),
                mine->median_us(), mine->median_us() / best->median_us());
    const std::vector<const OpResult*> contiguous = r.series(op, "contiguous");  // a diagnostic
    if (!contiguous.empty()) {
      const OpResult* contig = contiguous.front();
      std::printf("%-12s %s with contiguous rows (diagnostic, not a floor): %s %.1f us %.0f GB/s "
                  "(%.1f per SM) = %.2fx faster than the floor\n",
                  "", op, contig->op.substr(contig->op.rfind(' ') + 1).c_str(),
                  contig->median_us(), contig->gbps(), contig->gbps() / r.num_sms,
                  best->median_us() / contig->median_us());
    }
  }
}

void print_workload(const WorkloadResult& r) {
  if (!r.skipped.empty()) {
    std::printf("%-12s %s\n", r.workload.name.c_str(), r.skipped.c_str());
    std::fflush(stdout);
    return;
  }
  for (const OpResult& op : r.ops) {
    if (op.impl != "epcomm") continue;
    std::printf("%-12s %-27s %9.1f %9.1f %9.1f %8.1f", r.workload.name.c_str(), op.op.c_str(),
                op.median_us(), op.min_us(), op.max_us(), op.gbps());
    const OpResult* base = r.find(op.op.substr(0, op.op.find(' ')), "nccl");
    if (base && op.median_us() > 0)
      std::printf("  %9.1f %8.1f  %7.2fx\n", base->median_us(), base->gbps(),
                  base->median_us() / op.median_us());
    else
      std::printf("  %9s %8s  %8s\n", "-", "-", "-");
  }
  print_floor(r);
  std::string line;
  for (const CheckResult& c : r.checks)
    line += "  " + c.what + ": " + (c.pass ? "PASS" : "FAIL") +
            (c.detail.empty() ? "" : " (" + c.detail + ")");
  std::printf("%-12s %s dispatch, %.0f B per (token, rank) message; check:%s\n", "",
              r.workload.format.c_str(), r.dispatch_message_bytes,
              line.empty() ? "  skipped (--no-check)" : line.c_str());
  std::printf(
      "%-12s memory per rank (cudaMemGetInfo): group buffers %.3f GB, outputs %.3f GB; "
      "%d blocks, %s dispatch path\n",
      "", r.group_bytes / 1e9, r.output_bytes / 1e9, r.num_sms, r.path.c_str());
  if (r.ranks_per_node > 0 && !r.cross_node_direct.empty()) {
    double direct = 0, per_node = 0;  // mean over ranks
    for (size_t i = 0; i < r.cross_node_direct.size(); ++i) {
      direct += r.cross_node_direct[i] / double(r.cross_node_direct.size());
      per_node += r.cross_node_per_node[i] / double(r.cross_node_per_node.size());
    }
    std::printf("%-12s across nodes of %d ranks (model, per rank and dispatch): %.1f MB to ranks "
                "of other nodes, one message per (token, remote rank); %.1f MB with one per "
                "(token, remote node) forwarded inside it: %.2fx fewer\n",
                "", r.ranks_per_node, direct * r.dispatch_message_bytes / 1e6,
                per_node * r.dispatch_message_bytes / 1e6, per_node > 0 ? direct / per_node : 1.0);
    if (r.network_dispatch_bytes >= 0)
      std::printf("%-12s through NVSHMEM per call (measured / model, mean over this process's "
                  "ranks): dispatch %.6f / %.6f MB, combine %.6f / %.6f MB\n",
                  "", r.network_dispatch_bytes / 1e6, r.model_dispatch_bytes / 1e6,
                  r.network_combine_bytes / 1e6, r.model_combine_bytes / 1e6);
  }
  print_stages(r);
  std::fflush(stdout);
}

void write_json(const std::string& path, const RunInfo& info,
                const std::vector<WorkloadResult>& results) {
  std::ofstream os(path);
  if (!os) throw std::runtime_error("cannot write " + path);
  JsonWriter j(os);
  j.begin_object();
  j.begin_object("machine");
  j.value("hostname", info.hostname);
  j.value("gpu", info.gpu_name);
  j.value("gpu_count", info.gpu_count);
  j.end_object();
  j.value("commit", info.commit);
  j.value("date", info.date);
  j.value("command", info.command_line);
  j.value("mode", info.mode);
  j.value("n_ranks", info.n_ranks);
  j.value("nccl_version", info.nccl_version);
  j.value("iters", info.iters);
  j.value("warmup", info.warmup);
  j.value("l2_flush_bytes", double(info.l2_flush_bytes));
  j.value("input_sets", info.input_sets);
  j.value("median_definition", "max over ranks of the per-rank median");
  j.begin_array("workloads");
  for (const WorkloadResult& r : results)
    write_workload(j, r);
  j.end_array();
  j.end_object();
  os << '\n';
  if (!os) throw std::runtime_error("error writing " + path);
}

Progress::Progress(bool enabled) : enabled_(enabled), tty_(isatty(2) != 0) {}

void Progress::phase(const std::string& what) {
  phase_ = what;
  if (!enabled_) return;
  std::fprintf(stderr, tty_ ? "\r\033[K[epcomm_bench] %s" : "[epcomm_bench] %s\n", what.c_str());
  std::fflush(stderr);
}

void Progress::tick(int done, int total) {
  if (!enabled_ || !tty_) return;
  std::fprintf(stderr, "\r\033[K[epcomm_bench] %s %d/%d", phase_.c_str(), done, total);
  std::fflush(stderr);
}

void Progress::done() {
  if (enabled_ && tty_) std::fputs("\r\033[K", stderr);
}

}  // namespace epbench
