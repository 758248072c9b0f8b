// epcomm_soak: many dispatch + combine rounds on groups that live for the whole run, every
// result checked against the CPU reference model. It is after the thousands of calls a unit
// test never makes that a flag, counter or buffer carried from one call to the next would show
// up as wrong data, a hang or a timeout.
//
//   epcomm_soak [--iterations N] [--ranks R] [--processes] [--seed S] [--report-every K]
//               [--first I] [--hidden H] [--max-tokens T] [--format NAME|all]
//
// One process (default): R ranks (default 4) in one process through LocalGroup, rank r on GPU
// r % gpus, ranks sharing a GPU where there are fewer (placed()). --processes: one rank per
// process, under `epcomm_launch -n R -- epcomm_soak --processes ...` (FileBootstrap::from_env).
//
// The groups. One group per token format (bf16, fp8-blockwise, nvfp4, mxfp8, mxfp4; --format
// keeps one) is set up at the start and kept to the end; iteration i runs on format i % 5, so
// five groups with their own buffers stay alive and interleave, and each sees every fifth call.
//
// Shapes: hidden 384 (a multiple of every format's, FP8's 128), top_k 8, 8 experts per rank, T
// max 64 by default. The CPU reference of every rank runs each iteration on one core and sets the
// pace: ~14 ms an iteration for 4 ranks on a slow 2-core VM, so 10^4 iterations in ~2.5 min.
//
// An iteration is a function of (--seed, i) alone (make_plan; with the same --ranks, --hidden,
// --max-tokens and --format), so a failure is run again alone with `--seed S --first i
// --iterations 1` (printed with it). It varies, per format visit, with coprime periods so
// that every format meets every combination: a fresh problem (reference::make_problem, seed
// (S << 32) + i); random T per rank in [0, T max], with one rank forced to 0 every 7th
// iteration, one to T max every 11th, every rank to 0 every 13th and every rank to T max every
// 17th; uniform and Zipf(1.2) routing alternating; masked slots (none, 20 %, 60 %); the fused
// and the async + wait form (with unrelated GPU work between the halves one time in four); the
// token-side weighted combine, the expert-side reduction (weights given to dispatch), or the
// token-side weighted plus the un-reduced [T, K, H] combine; and one round in seven without
// poisoning the outputs first, so a value left by this group's previous call must not survive.
//
// What is checked, every round, every rank (the harness's RankIO checks; outputs poisoned with
// 0xff first except as above):
//   - dispatch, bf16: row_offsets, expert_ids, src_info and the tokens of every row equal
//     reference::dispatch exactly;
//   - dispatch, quantised formats: row_offsets, expert_ids, src_info (FP8 padding rows
//     included), the codes and the scales (the whole swizzled array and scales_offsets for
//     NVFP4 and MXFP8) equal reference::dispatch_quantized bit for bit;
//   - combine, weights given to combine: within the bf16 tolerance of the float64
//     reference::combine (compare_combine_bf16: half a bf16 ulp plus 2^-20 max|ref| per
//     element, 2^-8 in the norm);
//   - combine, weights given to dispatch (expert side): bit for bit, reference::
//     combine_expert_side rounded to bf16;
//   - un-reduced combine: bit for bit.
// Combine after a quantised dispatch reads the quantised output's row order (combine_layout):
// the expert outputs cover FP8's padding rows too, with non-zero values that must not reach any
// token. One process checks every rank (run_round); with --processes each process checks its
// own rank, recomputing every rank's reference (make_problem and expert_outputs are
// deterministic) because its combine reads every rank's rows.
//
// A mismatch prints the iteration, its seed, the plan and the first mismatch, and the run goes
// on. Mismatches are counted per round (one process: run_round's first, which ends that round)
// or, with --processes, per rank and round (each process its own). The run stops after 10 (with
// --processes, at the next all-gather of the counts, every 64 iterations). An exception (an
// epcomm::Error, a CUDA error) ends the run: a timeout leaves the group poisoned. Exit status: 0
// when every iteration ran with no mismatch and no error, 1 otherwise, 2 for bad arguments, 77 when
// there is no GPU (CTest: skipped).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

constexpr int kMaxMismatches = 10;
// With --processes the ranks agree on the counts only at an all-gather (the file bootstrap
// polls, ~2 ms a call); gathering every iteration would also keep the ranks' hosts in lock step,
// which a soak should not do.
constexpr int64_t kGatherEvery = 64;
constexpr int kBusyElems = 1 << 20;

const TokenFormat kAllFormats[] = {TokenFormat::kBF16, TokenFormat::kFp8Blockwise,
                                   TokenFormat::kNvfp4, TokenFormat::kMxfp8, TokenFormat::kMxfp4};

struct Args {
  int64_t iterations = 100000;
  int64_t first = 0;
  int ranks = 4;
  bool ranks_given = false;
  bool processes = false;
  uint64_t seed = 1;
  int64_t report_every = 1000;
  // Small shapes: the CPU reference of every rank runs each iteration and sets the pace. 384 is
  // a multiple of every format's hidden multiple (FP8: 128) and not a power of two, so rows are
  // not whole warps of 16-byte vectors.
  int hidden = 384;
  int top_k = 8;
  int max_tokens = 64;
  std::vector<TokenFormat> formats{std::begin(kAllFormats), std::end(kAllFormats)};
  // The options an iteration's plan depends on besides --seed and the iteration, as given: a
  // failing iteration is run again alone with them.
  std::string plan_options;
};

void usage() {
  std::fprintf(stderr,
               "usage: epcomm_soak [--iterations N] [--ranks R] [--processes] [--seed S]\n"
               "                   [--report-every K] [--first I] [--hidden H] [--max-tokens T]\n"
               "                   [--format bf16|fp8-blockwise|nvfp4|mxfp8|mxfp4|all]\n");
}

bool parse_int(const char* s, int64_t lo, int64_t hi, int64_t* out) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool parse_args(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    if (opt == "--processes") {
      a->processes = true;
      continue;
    }
    if (opt == "--help" || opt == "-h" || i + 1 >= argc) return false;
    const char* val = argv[++i];
    int64_t v = 0;
    if (opt == "--ranks" || opt == "--hidden" || opt == "--max-tokens" || opt == "--format")
      a->plan_options += " " + opt + " " + val;
    if (opt == "--format") {
      if (std::strcmp(val, "all") == 0) {
        a->formats.assign(std::begin(kAllFormats), std::end(kAllFormats));
        continue;
      }
      const std::optional<TokenFormat> f = token_format_from_name(val);
      if (!f) return false;
      a->formats.assign(1, *f);
    } else if (opt == "--iterations" && parse_int(val, 1, int64_t(1) << 40, &v)) {
      a->iterations = v;
    } else if (opt == "--first" && parse_int(val, 0, int64_t(1) << 40, &v)) {
      a->first = v;
    } else if (opt == "--ranks" && parse_int(val, 1, kMaxRanks, &v)) {
      a->ranks = int(v);
      a->ranks_given = true;
    } else if (opt == "--seed" && parse_int(val, 0, 0xffffffffll, &v)) {
      a->seed = uint64_t(v);
    } else if (opt == "--report-every" && parse_int(val, 1, int64_t(1) << 40, &v)) {
      a->report_every = v;
    } else if (opt == "--hidden" && parse_int(val, 128, 1 << 16, &v) && v % 128 == 0) {
      a->hidden = int(v);
    } else if (opt == "--max-tokens" && parse_int(val, 1, 1 << 16, &v)) {
      a->max_tokens = int(v);
    } else {
      return false;
    }
  }
  return true;
}

// One iteration's round, a function of (seed, iteration) only.
struct Plan {
  int64_t iteration = 0;
  uint64_t seed = 0;
  size_t format_index = 0;
  TokenFormat format = TokenFormat::kBF16;
  std::vector<int32_t> counts;
  double zipf_s = 0.0, mask_prob = 0.0;
  RoundOptions o;
};

Plan make_plan(const Args& a, int n_ranks, int64_t it) {
  Plan p;
  p.iteration = it;
  p.seed = (a.seed << 32) + uint64_t(it);
  const int64_t nf = int64_t(a.formats.size());
  p.format_index = size_t(it % nf);
  p.format = a.formats[p.format_index];
  // The options below cycle with this format's visit number, not with i: with i they would
  // move in step with the format and some formats would never meet some options.
  const int64_t v = it / nf;
  // A seed of its own: random_counts and make_problem would otherwise draw from one stream.
  p.counts = random_counts(n_ranks, a.max_tokens, p.seed ^ 0x9e3779b97f4a7c15ull);
  const int64_t n = n_ranks;
  if (it % 7 == 0) p.counts[size_t((it / 7) % n)] = 0;
  if (it % 11 == 0) p.counts[size_t((it / 11 + 1) % n)] = a.max_tokens;
  if (it % 13 == 0) p.counts.assign(size_t(n), 0);
  if (it % 17 == 0) p.counts.assign(size_t(n), a.max_tokens);
  p.zipf_s = v % 2 ? 1.2 : 0.0;
  p.mask_prob = v % 5 == 2 ? 0.2 : (v % 5 == 4 ? 0.6 : 0.0);
  p.o.form = (v / 2) % 2 ? Form::kAsyncWait : Form::kFused;
  p.o.busy_work_between = p.o.form == Form::kAsyncWait && v % 8 == 6;
  p.o.expert_side = v % 3 == 1;
  p.o.weighted = true;
  p.o.unreduced = v % 3 == 2;
  p.o.poison = v % 7 != 3;
  return p;
}

std::string describe(const Plan& p) {
  std::ostringstream os;
  os << token_format_name(p.format) << ", T [";
  for (size_t r = 0; r < p.counts.size(); ++r)
    os << (r ? " " : "") << p.counts[r];
  os << "], " << (p.zipf_s > 0 ? "zipf 1.2" : "uniform") << ", mask " << p.mask_prob << ", "
     << (p.o.form == Form::kFused ? "fused" : "async+wait")
     << (p.o.busy_work_between ? " with work between" : "") << ", "
     << (p.o.expert_side ? "expert-side"
                         : (p.o.unreduced ? "token-side + un-reduced" : "token-side"))
     << (p.o.poison ? "" : ", not poisoned");
  return os.str();
}

reference::Problem make_problem(const Args& a, int n_ranks, const Plan& p) {
  return reference::make_problem(n_ranks, a.hidden, a.top_k, 8 * n_ranks, p.counts, p.seed,
                                 p.zipf_s, p.mask_prob);
}

// The formats alternate between the dispatch paths (bf16 low-latency, FP8 throughput, ...).
Config soak_cfg(const Args& a, int n_ranks, TokenFormat f) {
  Config c = make_cfg(a.hidden, a.top_k, 8 * n_ranks, a.max_tokens);
  c.format = f;
  c.dispatch_path = int(f) % 2 == 0 ? DispatchPath::kLowLatency : DispatchPath::kThroughput;
  return c;
}

// ---- the round of one rank in its own process -------------------------------------------------
// run_round (harness.cu) does this for a LocalGroup. The helpers below have no counterpart in
// the harness yet; they could move there.

__global__ void busy_kernel(float* x, int n, int iters) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  float v = x[i];
  for (int k = 0; k < iters; ++k)
    v = v * 0.999f + 0.001f;
  x[i] = v;
}

void busy_work(float* scratch, cudaStream_t s) {
  busy_kernel<<<kBusyElems / 256, 256, 0, s>>>(scratch, kBusyElems, 2000);
  EPCOMM_CUDA_OK(cudaGetLastError());
}

// Every rank's reference dispatch in the group's format: the quantised outputs (empty for
// bf16) and the rows as combine reads them, FP8 padding rows included.
struct RoundReference {
  std::vector<reference::QuantDispatchResult> quant;
  std::vector<reference::DispatchResult> rows;
};

RoundReference round_reference(const reference::Problem& p, const Group& g) {
  RoundReference ref;
  if (g.config().format == TokenFormat::kBF16) {
    ref.rows = reference_dispatch_all(p);
    return ref;
  }
  ref.quant = reference_dispatch_quantized_all(p, g.config(), g.sizes());
  for (const auto& q : ref.quant)
    ref.rows.push_back(combine_layout(q));
  return ref;
}

// The combines of a round, in run_round's order: `weighted` per combine call. With the weights
// dispatched only the expert-side one can run (combine must not be given weights again).
std::vector<bool> combines(const RoundOptions& o) {
  if (o.expert_side) return {true};
  std::vector<bool> w;
  if (o.weighted) w.push_back(true);
  if (o.unreduced) w.push_back(false);
  return w;
}

// Keeps the first failure but never returns early: every rank must make every collective call
// of the round, whatever its own checks found, or the others would wait for it and time out.
std::string process_round(Group& g, RankIO& io, const reference::Problem& p, const RoundOptions& o,
                          uint64_t expert_seed, float* scratch) {
  const int rank = g.rank();
  std::string first;
  auto note = [&first](const std::string& e) {
    if (first.empty()) first = e;
  };
  EPCOMM_CUDA_OK(cudaSetDevice(io.device));
  io.upload(p.ranks[size_t(rank)]);
  if (o.poison) io.poison();
  if (o.form == Form::kFused) {
    g.dispatch(io.dispatch_input(o.expert_side), io.dispatch_output(), io.stream);
  } else {
    g.dispatch_async(io.dispatch_input(o.expert_side), io.stream);
    if (o.busy_work_between) busy_work(scratch, io.stream);
    g.dispatch_wait(io.dispatch_output(), io.stream);
  }
  g.synchronize(io.stream);
  const RoundReference ref = round_reference(p, g);
  note(ref.quant.empty() ? io.check_dispatch(ref.rows[size_t(rank)])
                         : io.check_dispatch_quantized(ref.quant[size_t(rank)]));
  std::vector<std::vector<uint16_t>> y;
  for (int r = 0; r < p.n_ranks; ++r)
    y.push_back(expert_outputs(r, expert_seed, ref.rows[size_t(r)].rows(), p.hidden));
  io.expert_out_host = y[size_t(rank)];
  io.expert_out.upload(io.expert_out_host.data(), io.expert_out_host.size() * 2, io.stream);
  for (bool weighted : combines(o)) {
    const CombineOutput out = io.combine_output(weighted && !o.expert_side);
    io.combine_out.fill(0xff, io.stream);
    if (o.form == Form::kFused) {
      g.combine(io.combine_input(), out, io.stream);
    } else {
      g.combine_async(io.combine_input(), io.stream);
      if (o.busy_work_between) busy_work(scratch, io.stream);
      g.combine_wait(out, io.stream);
    }
    g.synchronize(io.stream);
    if (o.expert_side) {
      note(io.check_combine_expert_side(reference::combine_expert_side(p, ref.rows, y, rank)));
    } else {
      const std::string e =
          io.check_combine(reference::combine(p, ref.rows, y, rank, weighted), weighted);
      if (!e.empty()) note(std::string(weighted ? "weighted " : "un-reduced ") + e);
    }
  }
  return first;
}

// ---- the loop, common to both modes -----------------------------------------------------------

struct Tally {
  int64_t iterations = 0, mismatches = 0, errors = 0;
};

// Which of the rare cases the run met, so a summary shows they were not left to chance.
struct Coverage {
  std::vector<int64_t> per_format;
  int64_t some_zero = 0, some_max = 0, all_zero = 0, all_max = 0;
  void add(const Plan& p, int max_tokens) {
    if (per_format.size() <= p.format_index) per_format.resize(p.format_index + 1, 0);
    ++per_format[p.format_index];
    int zeros = 0, maxes = 0;
    for (int32_t t : p.counts) {
      zeros += t == 0;
      maxes += t == max_tokens;
    }
    const int n = int(p.counts.size());
    some_zero += zeros > 0;
    some_max += maxes > 0;
    all_zero += zeros == n;
    all_max += maxes == n;
  }
};

using RoundFn = std::function<std::string(const Plan&, const reference::Problem&)>;
using GatherFn = std::function<Tally(const Tally&)>;

// Runs the iterations; `gather` sums the ranks' tallies (identity in one process) and is called
// at the same iterations on every rank. `speaker`: this process prints progress and summary.
int soak(const Args& a, int n_ranks, const std::string& where, const RoundFn& round,
         const GatherFn& gather, int64_t gather_every, bool speaker, const char* who) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto seconds = [&t0] { return std::chrono::duration<double>(clock::now() - t0).count(); };
  Tally mine, total;
  Coverage cov;
  const std::string again =
      (a.processes ? "epcomm_launch -n " + std::to_string(n_ranks) + " -- " : std::string()) +
      "epcomm_soak" + (a.processes ? " --processes" : "") + a.plan_options;
  bool error = false, stopped = false;
  for (int64_t i = 0; i < a.iterations && !error && !stopped; ++i) {
    const Plan plan = make_plan(a, n_ranks, a.first + i);
    std::string err;
    try {
      err = round(plan, make_problem(a, n_ranks, plan));
    } catch (const std::exception& e) {
      error = true;
      err = std::string("exception: ") + e.what();
    }
    ++mine.iterations;
    cov.add(plan, a.max_tokens);
    if (!err.empty()) {
      ++(error ? mine.errors : mine.mismatches);
      if (error || mine.mismatches <= kMaxMismatches) {
        std::fprintf(stderr, "%s%s at iteration %lld (seed %llu; %s): %s\n", who,
                     error ? "ERROR" : "MISMATCH", (long long)plan.iteration,
                     (unsigned long long)plan.seed, describe(plan).c_str(), err.c_str());
        std::fprintf(stderr, "%s  again alone: %s --seed %llu --first %lld --iterations 1\n", who,
                     again.c_str(), (unsigned long long)a.seed, (long long)plan.iteration);
      }
    }
    // An error may leave this rank out of step with the others (or the group poisoned): no
    // more collective calls, not even the gather.
    if (error) break;
    const bool report = (i + 1) % a.report_every == 0;
    if (report || (i + 1) % gather_every == 0) {
      total = gather(mine);
      stopped = total.mismatches >= kMaxMismatches;
      if (report && speaker) {
        std::printf("soak: %lld/%lld iterations, %.1f iterations/s, mismatches %lld\n",
                    (long long)(i + 1), (long long)a.iterations, double(i + 1) / seconds(),
                    (long long)total.mismatches);
        std::fflush(stdout);
      }
    }
  }
  total = error ? mine : gather(mine);
  const double s = seconds();
  if (speaker || error) {
    std::ostringstream fmts;
    for (size_t f = 0; f < cov.per_format.size(); ++f)
      fmts << (f ? ", " : "") << token_format_name(a.formats[f]) << " " << cov.per_format[f];
    std::printf("soak: %s; hidden %d, top_k %d, %d experts, T max %d, seed %llu, first %lld\n",
                where.c_str(), a.hidden, a.top_k, 8 * n_ranks, a.max_tokens,
                (unsigned long long)a.seed, (long long)a.first);
    std::printf(
        "soak: rounds per format: %s; with a rank at T = 0: %lld, at T max: %lld, every "
        "rank at 0: %lld, every rank at max: %lld\n",
        fmts.str().c_str(), (long long)cov.some_zero, (long long)cov.some_max,
        (long long)cov.all_zero, (long long)cov.all_max);
    if (stopped) std::printf("soak: stopped after %d mismatches\n", kMaxMismatches);
    const bool ok = total.mismatches == 0 && total.errors == 0 && !stopped;
    std::printf(
        "%ssoak %s: %lld iterations in %.1f s, %.1f iterations/s, mismatches %lld, "
        "errors %lld\n",
        who, ok ? "PASSED" : "FAILED", (long long)total.iterations, s, double(total.iterations) / s,
        (long long)total.mismatches, (long long)total.errors);
    std::fflush(stdout);
  }
  if (error && a.processes) {
    // The groups' destructors would wait at a bootstrap barrier for peers that are stuck or
    // gone (up to its timeout, per group). Exiting now lets epcomm_launch stop the others at
    // once.
    std::fflush(stderr);
    std::_Exit(1);
  }
  return total.mismatches == 0 && total.errors == 0 ? 0 : 1;
}

int run_one_process(const Args& a) {
  const int n = a.ranks;
  std::vector<std::unique_ptr<LocalGroup>> groups;
  for (TokenFormat f : a.formats)
    groups.push_back(std::make_unique<LocalGroup>(soak_cfg(a, n, f), n));
  const std::string where = std::to_string(n) + " ranks in one process on " +
                            std::to_string(std::min(n, gpu_count())) + " GPU(s), num_sms " +
                            std::to_string(groups[0]->groups[0]->config().num_sms);
  return soak(
      a, n, where,
      [&](const Plan& plan, const reference::Problem& p) {
        LocalGroup& lg = *groups[plan.format_index];
        // The expert outputs from the iteration's seed, not from how many rounds this group ran
        // before: an iteration run again alone sees the same values.
        for (auto& io : lg.io)
          io->expert_seed = plan.seed;
        return run_round(lg, p, plan.o);
      },
      [](const Tally& t) { return t; }, 1, true, "");
}

int run_processes(const Args& a) {
  auto bs = FileBootstrap::from_env(120);
  const int n = bs->size(), rank = bs->rank();
  if (a.ranks_given && a.ranks != n) {
    std::fprintf(stderr, "epcomm_soak: --ranks %d, but %d processes were launched\n", a.ranks, n);
    return 2;
  }
  const int device = device_of_rank(rank);
  std::vector<std::unique_ptr<Group>> groups;
  std::vector<std::unique_ptr<RankIO>> io;
  for (TokenFormat f : a.formats) {
    groups.push_back(Group::create(placed(soak_cfg(a, n, f), n), *bs, device));
    io.push_back(std::make_unique<RankIO>(*groups.back()));
  }
  DeviceBuffer scratch(device, size_t(kBusyElems) * sizeof(float));
  scratch.fill(0, nullptr);  // then waited for: every rank's stream may use it
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  const std::string where = std::to_string(n) + " processes, one rank each, on " +
                            std::to_string(std::min(n, gpu_count())) + " GPU(s), num_sms " +
                            std::to_string(groups[0]->config().num_sms);
  const std::string who = "[rank " + std::to_string(rank) + "] ";
  return soak(
      a, n, where,
      [&](const Plan& plan, const reference::Problem& p) {
        return process_round(*groups[plan.format_index], *io[plan.format_index], p, plan.o,
                             plan.seed, scratch.get<float>());
      },
      [&](const Tally& t) {
        std::vector<Tally> all(static_cast<size_t>(n));
        bs->all_gather(&t, all.data(), sizeof(Tally));
        Tally sum;
        sum.iterations = t.iterations;
        for (const Tally& x : all) {
          sum.mismatches += x.mismatches;
          sum.errors += x.errors;
        }
        return sum;
      },
      kGatherEvery, rank == 0, who.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse_args(argc, argv, &a)) {
    usage();
    return 2;
  }
  if (gpu_count() < 1) {
    std::printf("epcomm_soak: skipped: needs a GPU, the CUDA runtime finds none\n");
    return 77;
  }
  try {
    return a.processes ? run_processes(a) : run_one_process(a);
  } catch (const std::exception& e) {
    // Set-up failed (a bad shape, the bootstrap, memory): nothing was soaked.
    std::fprintf(stderr, "epcomm_soak: %s\n", e.what());
    return 1;
  }
}
