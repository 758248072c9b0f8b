// The modes of docs/design.md "Modes" on real GPUs (ranks sharing one where there are fewer): the fused shared
// expert, skip_a2a, and both together, with 1, 2, 3 and 8 ranks, both dispatch paths, fused and
// async + wait forms, token- and expert-side reduction, every token format. Every round is
// checked against the CPU reference with outputs poisoned first (run_round); the skip_a2a
// rounds also all-reduce every rank's partial sum here and compare it with the whole layer's
// output computed from the routing alone (expert outputs a function of expert and token).
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/bf16.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

enum class Mode { kShared, kSkip, kSkipShared };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kShared: return "shared";
    case Mode::kSkip: return "skip_a2a";
    case Mode::kSkipShared: return "skip_a2a_shared";
  }
  return "?";
}

Config in_mode(Config c, Mode m) {
  c.shared_expert = m != Mode::kSkip;
  c.skip_a2a = m != Mode::kShared;
  return c;
}

bool skips(Mode m) { return m != Mode::kShared; }

// The caller's all-reduce of every rank's partial [T, H] sum (bf16 bits), in float64, against the
// layer's output: each element within 2^-7 of the sum of the partials' magnitudes (each partial
// is rounded to bf16, twice with the expert-side reduction) plus 2^-16 max|want|, and
// ||sum - want|| / ||want|| <= 2^-8.
std::string check_all_reduced(const std::vector<std::vector<uint16_t>>& parts,
                              const std::vector<double>& want) {
  double max_want = 0, err2 = 0, want2 = 0;
  for (double w : want) max_want = std::max(max_want, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i) {
    double sum = 0, mag = 0;
    for (const auto& p : parts) {
      if (p.size() != want.size())
        return "a partial sum has " + std::to_string(p.size()) + " values, the layer " +
               std::to_string(want.size());
      const double v = bf16_to_float(p[i]);
      sum += v;
      mag += std::fabs(v);
    }
    const double err = std::fabs(sum - want[i]);
    if (!(err <= std::ldexp(mag, -7) + std::ldexp(max_want, -16))) {
      std::ostringstream os;
      os << "all-reduced element " << i << " = " << sum << ", the layer gives " << want[i];
      return os.str();
    }
    err2 += err * err;
    want2 += want[i] * want[i];
  }
  if (want2 > 0 && std::sqrt(err2 / want2) > std::ldexp(1.0, -8))
    return "all-reduced relative error " + std::to_string(std::sqrt(err2 / want2));
  return "";
}

// A problem for the mode: skip_a2a needs every rank to hold the same tokens (T of them), the
// shared expert alone takes any T per rank (counts).
reference::Problem mode_problem(Mode m, int n, int32_t H, int32_t K, int32_t E,
                                const std::vector<int32_t>& counts, uint64_t seed,
                                double zipf_s = 0.0, double mask_prob = 0.0) {
  if (skips(m)) return reference::make_replicated_problem(n, H, K, E, counts[0], seed, zipf_s, mask_prob);
  return reference::make_problem(n, H, K, E, counts, seed, zipf_s, mask_prob);
}

// One round of the mode on lg, checked against the reference; for skip_a2a also all-reduced and
// compared with the layer's output.
std::string mode_round(LocalGroup& lg, Mode m, const reference::Problem& p, RoundOptions o) {
  std::vector<std::vector<uint16_t>> reduced;
  if (skips(m)) {
    o.function_outputs = true;
    o.reduced_out = &reduced;
  }
  const std::string e = run_round(lg, p, o);
  if (!e.empty() || !skips(m)) return e;
  const std::string a = check_all_reduced(
      reduced, layer_output(p.ranks[0], p.top_k, p.hidden, m == Mode::kSkipShared));
  return a.empty() ? a : "skip_a2a all-reduce: " + a;
}

struct ModeCase {
  Mode mode;
  int n_ranks;
};

std::string case_name(const ::testing::TestParamInfo<ModeCase>& info) {
  return std::string(mode_name(info.param.mode)) + "_r" + std::to_string(info.param.n_ranks);
}

class ModeSweep : public ::testing::TestWithParam<ModeCase> {};

}  // namespace

// Token counts T = 0 everywhere, the maximum everywhere, one rank with none while the others
// have the maximum (not skip_a2a, whose ranks hold the same tokens), and random; fused and
// async + wait forms; the token-side (weighted, and un-reduced without the shared expert) and the
// expert-side reduction; both dispatch paths.
TEST_P(ModeSweep, MatchesReference) {
  const ModeCase c = GetParam();
  EPCOMM_REQUIRE_GPU();
  const int n = c.n_ranks, H = 2048, K = 6, E = 8 * n, T = 96;
  std::vector<std::vector<int32_t>> counts = {std::vector<int32_t>(size_t(n), 0),
                                              std::vector<int32_t>(size_t(n), T),
                                              random_counts(n, T, 7 + uint64_t(n))};
  if (!skips(c.mode) && n > 1) {
    counts.push_back(std::vector<int32_t>(size_t(n), T));
    counts.back()[size_t(n / 2)] = 0;
  }
  for (DispatchPath path : kBothPaths) {
    LocalGroup lg(in_mode(with_path(make_cfg(H, K, E, T), path), c.mode), n);
    uint64_t seed = 100;
    for (const auto& t : counts) {
      for (Form form : {Form::kFused, Form::kAsyncWait}) {
        for (bool expert_side : {false, true}) {
          const auto p = mode_problem(c.mode, n, H, K, E, t, ++seed, 0.0, 0.1);
          RoundOptions o;
          o.form = form;
          o.expert_side = expert_side;
          o.unreduced = c.mode == Mode::kSkip;  // the shared expert needs the weights
          EXPECT_EQ(mode_round(lg, c.mode, p, o), "")
              << dispatch_path_name(path) << ", " << (form == Form::kFused ? "fused" : "async+wait")
              << (expert_side ? ", expert side" : ", token side") << ", T[0] = " << t[0];
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ModeSweep,
                         ::testing::Values(ModeCase{Mode::kShared, 1}, ModeCase{Mode::kShared, 2},
                                           ModeCase{Mode::kShared, 3}, ModeCase{Mode::kShared, 8},
                                           ModeCase{Mode::kSkip, 1}, ModeCase{Mode::kSkip, 2},
                                           ModeCase{Mode::kSkip, 3}, ModeCase{Mode::kSkip, 8},
                                           ModeCase{Mode::kSkipShared, 1},
                                           ModeCase{Mode::kSkipShared, 2},
                                           ModeCase{Mode::kSkipShared, 3},
                                           ModeCase{Mode::kSkipShared, 8}),
                         case_name);

// Every quantised format in each mode: the shared expert's rows (group 0) and the local groups
// bit for bit as reference::dispatch_quantized gives them (padding and swizzled tiles included),
// and combine after it.
TEST(Modes, EveryFormat) {
  EPCOMM_REQUIRE_GPU();
  const int n = 3, H = 2048, K = 4, E = 12, T = 70;
  for (TokenFormat f : {TokenFormat::kFp8Blockwise, TokenFormat::kNvfp4, TokenFormat::kMxfp8,
                        TokenFormat::kMxfp4}) {
    for (Mode m : {Mode::kShared, Mode::kSkip, Mode::kSkipShared}) {
      Config cfg = in_mode(make_cfg(H, K, E, T), m);
      cfg.format = f;
      cfg.nvfp4_global_scale = 0.5f;
      LocalGroup lg(cfg, n);
      uint64_t seed = 300;
      for (Form form : {Form::kFused, Form::kAsyncWait}) {
        for (bool expert_side : {false, true}) {
          ++seed;
          const auto p = mode_problem(m, n, H, K, E, random_counts(n, T, seed), seed, 0.0, 0.1);
          RoundOptions o;
          o.form = form;
          o.expert_side = expert_side;
          EXPECT_EQ(mode_round(lg, m, p, o), "")
              << token_format_name(f) << ", " << mode_name(m) << ", "
              << (form == Form::kFused ? "fused" : "async+wait")
              << (expert_side ? ", expert side" : ", token side");
        }
      }
    }
  }
}

// The shared expert under skewed (Zipf 1.5) routing with random T, for many iterations on 8
// ranks, every one checked; the forms and reductions alternate. And skip_a2a with the shared
// expert split over W = 4 of 8 ranks' all-reduce group (rank r takes share r % 4): the ranks
// r and r + 4 hold the same share, so each share is counted twice in the sum over all 8.
TEST(Modes, SharedExpertSkewedManyIterations) {
  EPCOMM_REQUIRE_GPU();
  const int n = 8, H = 2048, K = 8, E = 64, T = 128;
  LocalGroup lg(in_mode(make_cfg(H, K, E, T), Mode::kShared), n);
  for (int it = 0; it < 60; ++it) {
    const auto p = reference::make_problem(n, H, K, E, random_counts(n, T, 900 + uint64_t(it)),
                                           1000 + uint64_t(it), 1.5);
    RoundOptions o;
    o.form = it % 2 ? Form::kAsyncWait : Form::kFused;
    o.expert_side = (it / 2) % 2 == 1;
    ASSERT_EQ(run_round(lg, p, o), "") << "iteration " << it;
  }
}

TEST(Modes, SkipA2aSharedSplitOverPartOfTheGroup) {
  EPCOMM_REQUIRE_GPU();
  const int n = 8, H = 2048, K = 8, E = 64, T = 101;
  Config cfg = in_mode(make_cfg(H, K, E, T), Mode::kSkipShared);
  cfg.allreduce_world_size = 4;
  LocalGroup lg(cfg, n);
  const auto p = reference::make_replicated_problem(n, H, K, E, T, 77);
  std::vector<std::vector<uint16_t>> reduced;
  RoundOptions o;
  o.function_outputs = true;
  o.reduced_out = &reduced;
  ASSERT_EQ(run_round(lg, p, o), "");
  // The sum over one copy of each share (ranks 0..3 for the shared expert, all 8 for the
  // routed experts) is the layer: subtract ranks 4..7's shared rows, i.e. compare
  // sum(all) - layer(routed only) - 2 * shared = 0 through the layer with the shared expert
  // counted twice.
  std::vector<double> want = layer_output(p.ranks[0], K, H, false);
  const std::vector<double> with_shared = layer_output(p.ranks[0], K, H, true);
  for (size_t i = 0; i < want.size(); ++i) want[i] += 2 * (with_shared[i] - want[i]);
  EXPECT_EQ(check_all_reduced(reduced, want), "");
}

// Bad input in the modes: combine without router weights is rejected with the shared expert;
// skip_a2a reports a duplicate of a rank's own expert on that rank only (the others drop the
// slot and go on), and an id out of range on every rank.
TEST(Modes, BadInput) {
  EPCOMM_REQUIRE_GPU();
  const int n = 2, H = 2048, K = 4, E = 8, T = 16;
  {
    LocalGroup lg(in_mode(make_cfg(H, K, E, T), Mode::kShared), n);
    const auto p = reference::make_problem(n, H, K, E, {T, T}, 5);
    lg.issue_dispatch(p);
    lg.sync_all();
    RankIO& io = *lg.io[0];
    try {
      lg.groups[0]->combine(io.combine_input(), io.combine_output(false), io.stream);
      FAIL() << "combine without weights accepted with the shared expert";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("shared_expert"), std::string::npos) << e.what();
    }
    // A duplicate expert with the shared expert: reported with the caller's id; the group
    // stays usable.
    auto dup = p;
    dup.ranks[1].topk_ids[2 * K + 0] = 6;
    dup.ranks[1].topk_ids[2 * K + 3] = 6;
    dup.ranks[1].topk_ids[2 * K + 1] = 0;
    dup.ranks[1].topk_ids[2 * K + 2] = 1;
    lg.issue_dispatch(dup);
    for (int r = 0; r < n; ++r) {
      RankIO& q = *lg.io[size_t(r)];
      EPCOMM_CUDA_OK(cudaSetDevice(q.device));
      EPCOMM_CUDA_OK(cudaStreamSynchronize(q.stream));
      if (r == 0) {
        EXPECT_NO_THROW(lg.groups[0]->check());
        continue;
      }
      try {
        lg.groups[1]->check();
        ADD_FAILURE() << "rank 1 did not report its duplicate expert";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kDuplicateExpert);
        EXPECT_NE(std::string(e.what()).find("names expert 6 twice"), std::string::npos)
            << e.what();
      }
    }
    RoundOptions o;
    EXPECT_EQ(run_round(lg, reference::make_problem(n, H, K, E, {T, 3}, 9), o), "");
  }
  LocalGroup lg(in_mode(make_cfg(H, K, E, T), Mode::kSkip), n);
  auto p = reference::make_replicated_problem(n, H, K, E, T, 6);
  for (auto& r : p.ranks) {  // token 3: rank 1's expert 5 twice
    r.topk_ids[3 * K + 0] = 5;
    r.topk_ids[3 * K + 1] = 5;
    r.topk_ids[3 * K + 2] = 0;
    r.topk_ids[3 * K + 3] = -1;
  }
  lg.issue_dispatch(p);
  for (int r = 0; r < n; ++r) {
    RankIO& io = *lg.io[size_t(r)];
    EPCOMM_CUDA_OK(cudaSetDevice(io.device));
    EPCOMM_CUDA_OK(cudaStreamSynchronize(io.stream));
    if (r == 0) {
      EXPECT_NO_THROW(lg.groups[0]->check());
      reference::Problem pm = p;
      pm.skip_a2a = true;
      EXPECT_EQ(io.check_dispatch(reference::dispatch(pm, 0)), "");
    } else {
      try {
        lg.groups[size_t(r)]->check();
        ADD_FAILURE() << "rank 1 did not report its duplicate expert";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kDuplicateExpert);
        EXPECT_NE(std::string(e.what()).find("epcomm rank 1"), std::string::npos) << e.what();
        // The caller's expert id, not the view's.
        EXPECT_NE(std::string(e.what()).find("names expert 5 twice"), std::string::npos)
            << e.what();
      }
    }
  }
  for (auto& r : p.ranks) r.topk_ids[3 * K + 1] = E;  // out of range: every rank
  lg.issue_dispatch(p);
  for (int r = 0; r < n; ++r) {
    RankIO& io = *lg.io[size_t(r)];
    EPCOMM_CUDA_OK(cudaSetDevice(io.device));
    EPCOMM_CUDA_OK(cudaStreamSynchronize(io.stream));
    try {
      lg.groups[size_t(r)]->check();
      ADD_FAILURE() << "rank " << r << " did not report the bad id";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kBadExpertId);
    }
  }
  // The group stays usable.
  const auto good = reference::make_replicated_problem(n, H, K, E, T, 8);
  RoundOptions o;
  o.function_outputs = true;
  EXPECT_EQ(run_round(lg, good, o), "");
}
