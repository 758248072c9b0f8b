// Dispatch and combine on real GPUs, one process driving 2, 4 or 8 of them, every result
// checked against the CPU reference model with outputs poisoned before each run.
#include <gtest/gtest.h>

#include <initializer_list>
#include <random>

#include "epcomm/bf16.h"
#include "epcomm/combine_epilogue.cuh"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

struct Case {
  int n_ranks, hidden, top_k, n_experts, max_tokens;
  double mask_prob;
  const char* name;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.name;
}

class Sweep : public ::testing::TestWithParam<Case> {};

// Rounds of every combine case (bf16 and blockwise FP8 on both paths; fused and async + wait;
// token and expert side, un-reduced too) for each of `variants`, which `vary` sets in the round's
// options; `what` names the variant in a failure.
template <class Vary>
void combine_cases(uint64_t seed, const char* what, std::initializer_list<int64_t> variants,
                   Vary vary) {
  const int n = suite_ranks();
  for (TokenFormat format : {TokenFormat::kBF16, TokenFormat::kFp8Blockwise}) {
    for (DispatchPath path : kBothPaths) {
      Config cfg = with_path(make_cfg(2048, 8, 8 * n, 96), path);
      cfg.format = format;
      LocalGroup lg(cfg, n);
      for (int64_t v : variants)
        for (Form form : {Form::kFused, Form::kAsyncWait})
          for (bool expert_side : {false, true}) {
            const auto p = reference::make_problem(n, 2048, 8, 8 * n, random_counts(n, 96, seed),
                                                   seed, 0.0, 0.1);
            RoundOptions o = every_combine(form, expert_side);
            vary(o, v);
            EXPECT_EQ(run_round(lg, p, o), "")
                << token_format_name(format) << ", " << dispatch_path_name(path) << ", "
                << (form == Form::kFused ? "fused" : "async+wait")
                << (expert_side ? ", expert side, " : ", token side, ") << what << " " << v;
            ++seed;
          }
    }
  }
}

// Expects rank 0's combine of `in` (the last round's input with one field made bad) to be
// refused before anything is launched: kInvalidArgument naming `field`.
void expect_combine_refused(LocalGroup& lg, const CombineInput& in, const char* field,
                            int64_t value) {
  RankIO& io = *lg.io[0];
  try {
    lg.groups[0]->combine(in, io.combine_output(true), io.stream);
    ADD_FAILURE() << field << " = " << value << " accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

}  // namespace

// Random routing over the shapes of the issue: 1/2/3/4/8/16/40/64 ranks (sharing GPUs where there
// are fewer), hidden 1024-16384, K = 1/4/8/16, 8..256 experts, fused and async+wait forms; weighted
// (token side) and un-reduced combine, and the expert-side reduction (weights given to dispatch).
TEST_P(Sweep, MatchesReference) {
  const Case c = GetParam();
  EPCOMM_REQUIRE_GPU();
  for (DispatchPath path : kBothPaths) {
    LocalGroup lg(with_path(make_cfg(c.hidden, c.top_k, c.n_experts, c.max_tokens), path),
                  c.n_ranks);
    uint64_t seed = 1;
    for (Form form : {Form::kFused, Form::kAsyncWait}) {
      for (bool expert_side : {false, true}) {
        const auto p = reference::make_problem(c.n_ranks, c.hidden, c.top_k, c.n_experts,
                                               random_counts(c.n_ranks, c.max_tokens, seed), seed,
                                               0.0, c.mask_prob);
        ++seed;
        RoundOptions o;
        o.form = form;
        o.unreduced = true;
        o.expert_side = expert_side;
        EXPECT_EQ(run_round(lg, p, o), "")
            << dispatch_path_name(path) << ", " << (form == Form::kFused ? "fused" : "async+wait")
            << (expert_side ? ", expert side" : ", token side");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Sweep,
    ::testing::Values(Case{1, 7168, 8, 256, 128, 0.0, "r1_h7168_k8_e256"},
                      Case{2, 7168, 8, 256, 128, 0.0, "r2_h7168_k8_e256"},
                      Case{2, 2048, 1, 8, 200, 0.0, "r2_h2048_k1_e8"},
                      // Wide rows: 10 KB and 32 KB of bf16.
                      Case{1, 5120, 8, 64, 64, 0.0, "r1_h5120_k8_e64"},
                      // One rank, a quarter of the tokens with every slot masked: the fused
                      // expert-side combine writes the others' rows from its send, these from
                      // its receive.
                      Case{1, 2880, 2, 16, 128, 0.5, "r1_h2880_k2_e16_masked"},
                      Case{2, 16384, 8, 64, 48, 0.1, "r2_h16384_k8_e64_masked"},
                      Case{2, 2880, 4, 128, 96, 0.2, "r2_h2880_k4_e128_masked"},
                      Case{3, 7168, 8, 96, 128, 0.0, "r3_h7168_k8_e96"},
                      Case{3, 2048, 4, 12, 150, 0.1, "r3_h2048_k4_e12_masked"},
                      Case{4, 2880, 4, 128, 128, 0.0, "r4_h2880_k4_e128"},
                      Case{4, 7168, 8, 32, 64, 0.1, "r4_h7168_k8_e32_masked"},
                      Case{4, 2048, 8, 8, 100, 0.0, "r4_h2048_k8_e8"},
                      Case{8, 7168, 8, 256, 128, 0.0, "r8_h7168_k8_e256"},
                      Case{8, 2048, 1, 64, 300, 0.0, "r8_h2048_k1_e64"},
                      Case{8, 2880, 4, 128, 256, 0.3, "r8_h2880_k4_e128_masked"},
                      Case{8, 2048, 8, 8, 64, 0.0, "r8_h2048_k8_e8"},
                      Case{8, 1024, 16, 1024, 40, 0.0, "r8_h1024_k16_e1024"},
                      // Past 8 and 32 ranks (EP64's masks: a lane polls ranks l and l + 32),
                      // up to 16 destination ranks per token.
                      Case{16, 2048, 8, 256, 64, 0.1, "r16_h2048_k8_e256_masked"},
                      Case{40, 2048, 8, 320, 32, 0.0, "r40_h2048_k8_e320"},
                      Case{64, 1024, 16, 1024, 24, 0.1, "r64_h1024_k16_e1024_masked"}),
    case_name);

namespace {
// T = 0, 1 and max_t on every rank, and random T per rank, on a group of the given path.
void check_token_counts(DispatchPath path, int hidden, int max_t, uint64_t seed) {
  const int n = suite_ranks();
  LocalGroup lg(with_path(make_cfg(hidden, 8, 8 * n, max_t), path), n);
  const std::vector<std::vector<int32_t>> counts = {
      std::vector<int32_t>(static_cast<size_t>(n), 0),
      std::vector<int32_t>(static_cast<size_t>(n), 1),
      std::vector<int32_t>(static_cast<size_t>(n), max_t), random_counts(n, max_t, seed)};
  for (const auto& t : counts) {
    const auto p = reference::make_problem(n, hidden, 8, 8 * n, t, ++seed);
    RoundOptions o;
    o.unreduced = true;
    EXPECT_EQ(run_round(lg, p, o), "") << "T[0] = " << t[0];
    o.expert_side = true;
    EXPECT_EQ(run_round(lg, p, o), "") << "T[0] = " << t[0] << ", expert side";
  }
}
}  // namespace

// T = 0, 1 and max on every rank, and ranks with different T: the throughput path past two
// ranking units of 512 tokens, the low-latency path up to its most tokens per call.
TEST(Edge, TokenCounts) {
  EPCOMM_REQUIRE_GPU();
  check_token_counts(DispatchPath::kThroughput, 2048, 1100, 10);
}
TEST(Edge, TokenCountsLowLatency) {
  EPCOMM_REQUIRE_GPU();
  check_token_counts(DispatchPath::kLowLatency, 7168, kLowLatencyMaxTokens, 30);
}

// Every token of every rank routed to one expert (the most skewed load), with K = 1 and with one
// live slot of 8.
TEST(Edge, EveryTokenToOneExpert) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  for (int K : {1, 8}) {
    for (DispatchPath path : kBothPaths) {
      LocalGroup lg(with_path(make_cfg(2880, K, 4 * n, 256), path), n);
      auto p = reference::make_problem(n, 2880, K, 4 * n,
                                       std::vector<int32_t>(static_cast<size_t>(n), 256), 3);
      for (auto& r : p.ranks)
        for (int32_t t = 0; t < r.num_tokens; ++t)
          for (int k = 0; k < K; ++k)
            r.topk_ids[size_t(t * K + k)] = k == 0 ? 4 * n - 1 : -1;
      RoundOptions o;
      o.unreduced = true;
      EXPECT_EQ(run_round(lg, p, o), "") << "K = " << K << ", " << dispatch_path_name(path);
      o.expert_side = true;
      EXPECT_EQ(run_round(lg, p, o), "")
          << "K = " << K << ", expert side, " << dispatch_path_name(path);
      // The one expert's group is full: the padded layout of the least capacity, every slot
      // used, read by both reductions.
      o.padded_extra_slots = 0;
      EXPECT_EQ(run_round(lg, p, o), "")
          << "K = " << K << ", expert side, padded, " << dispatch_path_name(path);
      o.expert_side = false;
      EXPECT_EQ(run_round(lg, p, o), "")
          << "K = " << K << ", token side, padded, " << dispatch_path_name(path);
    }
  }
}

// Combine reading the expert outputs in the padded per-expert layout (CombineInput::
// expert_out_capacity), as a masked grouped GEMM leaves them: both paths and forms, both
// reductions and the un-reduced combine, bf16 and blockwise FP8 (whose groups end in padding
// rows), the least capacity allowed and more; slots no row reaches hold NaN, so a stray read
// shows. Then the capacity's checks.
TEST(Combine, ReadsThePaddedLayout) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  combine_cases(700, "capacity +", {0, 5},
                [](RoundOptions& o, int64_t extra) { o.padded_extra_slots = extra; });
  // A capacity below n_ranks * max_tokens_per_rank (a group could overflow it) is refused
  // before anything is launched, and the group goes on.
  LocalGroup lg(make_cfg(2048, 8, 8 * n, 96), n);
  const auto p = reference::make_problem(n, 2048, 8, 8 * n, random_counts(n, 96, 1), 1);
  ASSERT_EQ(run_round(lg, p, RoundOptions{}), "");
  RankIO& io = *lg.io[0];
  for (int64_t bad : {int64_t(n) * 96 - 1, int64_t(-1), int64_t(1) << 40, int64_t(1) << 61}) {
    CombineInput in = io.combine_input();
    in.expert_out_capacity = bad;
    expect_combine_refused(lg, in, "expert_out_capacity", bad);
  }
  EXPECT_EQ(run_round(lg, p, RoundOptions{}), "");
}

// Combine brings back fewer columns than the dispatch carried (CombineInput::hidden below the
// group's): the expert outputs and the output are that wide, and each equals the reference's
// combine of a problem that wide, on both paths, in both forms and reductions, un-reduced too,
// in dispatch row order and in the padded layout; with 8 columns, with a width that ends a
// 256-column step early, and with half. Widths that are not a positive multiple of 8 at most
// the group's are refused before anything is launched, and the group goes on.
TEST(Combine, FewerColumnsThanDispatched) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  combine_cases(900, "columns", {1024, 2048 - 8, 8}, [](RoundOptions& o, int64_t cols) {
    o.combine_hidden = int32_t(cols);
    o.padded_extra_slots = cols == 1024 ? 0 : -1;  // one width in the padded layout too
  });
  LocalGroup lg(make_cfg(2048, 8, 8 * n, 96), n);
  const auto p = reference::make_problem(n, 2048, 8, 8 * n, random_counts(n, 96, 3), 3);
  ASSERT_EQ(run_round(lg, p, RoundOptions{}), "");
  RankIO& io = *lg.io[0];
  for (int32_t bad : {0, -8, 12, 2048 + 8}) {
    CombineInput in = io.combine_input();
    in.hidden = bad;
    expect_combine_refused(lg, in, "hidden", bad);
  }
  EXPECT_EQ(run_round(lg, p, RoundOptions{}), "");
}

// Async and wait with other GPU work between them on the same stream.
TEST(Forms, AsyncWaitWithWorkBetween) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  LocalGroup lg(make_cfg(7168, 8, 32 * n, 128), n);
  for (uint64_t seed = 20; seed < 23; ++seed) {
    const auto p = reference::make_problem(n, 7168, 8, 32 * n, random_counts(n, 128, seed), seed);
    RoundOptions o;
    o.form = Form::kAsyncWait;
    o.busy_work_between = true;
    EXPECT_EQ(run_round(lg, p, o), "");
  }
}

// Block counts from 1 to more than the ranking needs, on the same data.
TEST(Forms, AnyNumberOfBlocks) {
  EPCOMM_REQUIRE_GPU();
  const int n = 2;
  for (int sms : {1, 3, 64, 132}) {
    LocalGroup lg(make_cfg(2048, 8, 64, 700, sms), n);
    const auto p = reference::make_problem(n, 2048, 8, 64, {700, 333}, 40 + uint64_t(sms));
    EXPECT_EQ(run_round(lg, p, RoundOptions{}), "") << sms << " blocks";
    RoundOptions o;
    o.expert_side = true;
    EXPECT_EQ(run_round(lg, p, o), "") << sms << " blocks, expert side";
  }
  for (int sms : {1, 3, 64, 132}) {  // the low-latency path: every block ranks, sends, receives
    LocalGroup lg(with_path(make_cfg(7168, 8, 64, 300, sms), DispatchPath::kLowLatency), n);
    const auto p = reference::make_problem(n, 7168, 8, 64, {300, 177}, 50 + uint64_t(sms));
    EXPECT_EQ(run_round(lg, p, RoundOptions{}), "") << sms << " blocks, low-latency";
    RoundOptions o;
    o.expert_side = true;
    EXPECT_EQ(run_round(lg, p, o), "") << sms << " blocks, expert side, low-latency";
  }
}

// 1000 back-to-back iterations with changing routing and T; every result checked.
TEST(Stress, ThousandIterations) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  const int H = 512, K = 4, E = 8 * n, max_t = 96;
  LocalGroup groups[2] = {LocalGroup(with_path(make_cfg(H, K, E, max_t), kBothPaths[0]), n),
                          LocalGroup(with_path(make_cfg(H, K, E, max_t), kBothPaths[1]), n)};
  for (int it = 0; it < 1000; ++it) {
    LocalGroup& lg = groups[(it / 2) % 2];  // each path in both forms
    const auto p =
        reference::make_problem(n, H, K, E, random_counts(n, max_t, 1000 + it), 1000 + uint64_t(it),
                                it % 3 == 0 ? 1.2 : 0.0, it % 5 == 0 ? 0.25 : 0.0);
    RoundOptions o;
    o.form = it % 2 ? Form::kAsyncWait : Form::kFused;
    o.unreduced = it % 7 == 0;
    o.expert_side = it % 3 == 1;
    const std::string e = run_round(lg, p, o);
    ASSERT_EQ(e, "") << "iteration " << it;
  }
}

// The same inputs twice give bit-identical outputs (row order and reduction order are fixed).
TEST(Determinism, SameInputsSameBits) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  for (DispatchPath path : kBothPaths) {
    SCOPED_TRACE(dispatch_path_name(path));
    LocalGroup lg(with_path(make_cfg(7168, 8, 256, 256), path), n);
    const auto p = reference::make_problem(n, 7168, 8, 256, random_counts(n, 256, 77), 77);
    std::vector<std::vector<uint16_t>> first_d(static_cast<size_t>(n)),
        first_c(static_cast<size_t>(n));
    for (int rep = 0; rep < 2; ++rep) {
      ASSERT_EQ(run_round(lg, p, RoundOptions{}), "");
      for (int r = 0; r < n; ++r) {
        RankIO& io = *lg.io[size_t(r)];
        // make_expert_out draws fresh values each round: restore the first round's.
        auto d = io.download_dispatch_tokens(io.max_rows);
        auto c = io.download_combine(true);
        if (rep == 0) {
          first_d[size_t(r)] = d;
          first_c[size_t(r)] = c;
          io.expert_seed -= 1;
        } else {
          EXPECT_TRUE(d == first_d[size_t(r)]) << "dispatch output of rank " << r << " changed";
          EXPECT_TRUE(c == first_c[size_t(r)]) << "combine output of rank " << r << " changed";
        }
      }
    }
  }
}

namespace {
struct StoreF32 {
  float* out;
  int32_t hidden;
  __device__ void operator()(int32_t t, int32_t c, float v) { out[int64_t(t) * hidden + c] = v; }
};
}  // namespace

// A device epilogue receives the fp32 sums: within 1e-5 of the float64 reference. With one rank
// too, where the fused expert-side kernel hands the sums to the epilogue from its send.
TEST(Combine, EpilogueGetsFp32Sums) {
  EPCOMM_REQUIRE_GPU();
  for (const int n : {1, suite_ranks()}) {
    SCOPED_TRACE(std::to_string(n) + " ranks");
    const int H = 2880, K = 8, E = 16 * n, max_t = 200;
    LocalGroup lg(make_cfg(H, K, E, max_t), n);
    for (int r = 0; r < n; ++r) {
      EPCOMM_CUDA_OK(cudaSetDevice(lg.io[size_t(r)]->device));
      epcomm::load_combine_kernels<StoreF32>();
    }
    std::vector<DeviceBuffer> f32;
    for (int r = 0; r < n; ++r)
      f32.emplace_back(lg.io[size_t(r)]->device, size_t(max_t) * H * 4);
    // The last round's combine again, into the poisoned fp32 outputs through the epilogue
    // (token-side weights, or none: the expert side); returns every rank's expert outputs. The
    // poison goes on the rank's stream, ahead of its combine (a non-blocking stream: a memset on
    // the default stream was not ordered before it).
    const auto combine_f32 = [&](bool token_side) {
      for (int r = 0; r < n; ++r)
        f32[size_t(r)].fill(0xff, lg.io[size_t(r)]->stream);
      lg.all([&](int r) {
        RankIO& io = *lg.io[size_t(r)];
        epcomm::combine(*lg.groups[size_t(r)], io.combine_input(),
                        token_side ? io.weights.get<float>() : nullptr,
                        StoreF32{f32[size_t(r)].get<float>(), H}, io.stream);
      });
      std::vector<std::vector<uint16_t>> y;
      for (int r = 0; r < n; ++r)
        y.push_back(lg.io[size_t(r)]->expert_out_host);
      return y;
    };
    const auto p = reference::make_problem(n, H, K, E, random_counts(n, max_t, 9), 9, 0.0, 0.1);
    ASSERT_EQ(run_round(lg, p, RoundOptions{}), "");  // leaves dispatch state and expert outputs
    const auto y = combine_f32(true);
    const auto refs = reference_dispatch_all(p);
    for (int r = 0; r < n; ++r) {
      const std::vector<double> ref = reference::combine(p, refs, y, r, true);
      std::vector<float> out(ref.size());
      f32[size_t(r)].download(out.data(), out.size() * 4);
      EXPECT_EQ(reference::compare_combine_f32(ref, out.data(), int64_t(out.size()), 1e-5), "")
          << "rank " << r;
    }
    // The expert-side reduction (weights given to dispatch, none here): the epilogue gets exactly
    // the reference's fp32 sums of the bf16 partial sums.
    RoundOptions o;
    o.expert_side = true;
    const auto p2 = reference::make_problem(n, H, K, E, random_counts(n, max_t, 19), 19, 0.0, 0.1);
    ASSERT_EQ(run_round(lg, p2, o), "");
    const auto y2 = combine_f32(false);
    const auto refs2 = reference_dispatch_all(p2);
    for (int r = 0; r < n; ++r) {
      const std::vector<float> ref = reference::combine_expert_side(p2, refs2, y2, r);
      std::vector<float> out(ref.size());
      f32[size_t(r)].download(out.data(), out.size() * 4);
      int64_t diff = 0;
      for (size_t i = 0; i < ref.size(); ++i)
        diff += out[i] != ref[i];
      EXPECT_EQ(diff, 0) << "rank " << r << ": fp32 sums differ from the expert-side reference";
    }
  }
}

// Dispatch + combine captured in a CUDA graph, replayed with new inputs in the same buffers;
// with the token-side and with the expert-side reduction.
TEST(Graph, CapturedRoundReplaysWithNewInputs) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  const int H = 2048, K = 8, E = 8 * n, T = 160;
  for (DispatchPath path : kBothPaths) {
    SCOPED_TRACE(dispatch_path_name(path));
    LocalGroup lg(with_path(make_cfg(H, K, E, T), path), n);
    // Warm-up round (outside the graph), then capture.
    auto p0 =
        reference::make_problem(n, H, K, E, std::vector<int32_t>(static_cast<size_t>(n), T), 500);
    ASSERT_EQ(run_round(lg, p0, RoundOptions{}), "");
    for (bool expert_side : {false, true}) {
      std::vector<cudaGraphExec_t> execs(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) {
        RankIO& io = *lg.io[size_t(r)];
        EPCOMM_CUDA_OK(cudaSetDevice(io.device));
        cudaGraph_t graph;
        EPCOMM_CUDA_OK(cudaStreamBeginCapture(io.stream, cudaStreamCaptureModeRelaxed));
        lg.groups[size_t(r)]->dispatch(io.dispatch_input(expert_side), io.dispatch_output(),
                                       io.stream);
        lg.groups[size_t(r)]->combine(io.combine_input(), io.combine_output(!expert_side),
                                      io.stream);
        EPCOMM_CUDA_OK(cudaStreamEndCapture(io.stream, &graph));
        EPCOMM_CUDA_OK(cudaGraphInstantiate(&execs[size_t(r)], graph, 0));
        EPCOMM_CUDA_OK(cudaGraphDestroy(graph));
      }
      for (int rep = 0; rep < 5; ++rep) {
        const auto p = reference::make_problem(
            n, H, K, E, std::vector<int32_t>(static_cast<size_t>(n), T), 600 + uint64_t(rep));
        const auto refs = reference_dispatch_all(p);
        std::vector<std::vector<uint16_t>> y(static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) {
          RankIO& io = *lg.io[size_t(r)];
          io.upload(p.ranks[size_t(r)]);
          io.poison();
          // Expert outputs must exist before the graph runs: use the dispatched rows' reference
          // count and fresh values (the graph's combine reads expert_out).
          io.make_expert_out(refs[size_t(r)].rows());
          y[size_t(r)] = io.expert_out_host;
        }
        lg.all([&](int r) {
          EPCOMM_CUDA_OK(cudaGraphLaunch(execs[size_t(r)], lg.io[size_t(r)]->stream));
        });
        for (int r = 0; r < n; ++r) {
          RankIO& io = *lg.io[size_t(r)];
          EXPECT_EQ(io.check_dispatch(refs[size_t(r)]), "") << "replay " << rep;
          if (expert_side)
            EXPECT_EQ(io.check_combine_expert_side(reference::combine_expert_side(p, refs, y, r)),
                      "")
                << "replay " << rep;
          else
            EXPECT_EQ(io.check_combine(reference::combine(p, refs, y, r, true), true), "")
                << "replay " << rep;
        }
      }
      for (int r = 0; r < n; ++r) {
        EPCOMM_CUDA_OK(cudaSetDevice(lg.io[size_t(r)]->device));
        EPCOMM_CUDA_OK(cudaGraphExecDestroy(execs[size_t(r)]));
      }
    }
  }
}

// Rank r's group is poisoned: it says so, and its next call throws kPoisoned without launching.
static void expect_poisoned(LocalGroup& lg, int r) {
  RankIO& io = *lg.io[size_t(r)];
  EXPECT_TRUE(lg.groups[size_t(r)]->poisoned()) << "rank " << r;
  try {
    lg.groups[size_t(r)]->dispatch(io.dispatch_input(), io.dispatch_output(), io.stream);
    ADD_FAILURE() << "rank " << r << ": a poisoned group accepted a call";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPoisoned) << e.what();
  }
}

// A rank that never launches: the others stop within the timeout with an error naming it, the
// group is poisoned, and a new group in the same process works.
TEST(Failure, MissingRankTimesOutNamingIt) {
  EPCOMM_REQUIRE_GPU();
  const int n = 4;
  const int missing = 1;
  for (DispatchPath path : kBothPaths) {
    SCOPED_TRACE(dispatch_path_name(path));
    LocalGroup lg(with_path(make_cfg(2048, 4, 8 * n, 64, 24, 1.0), path), n);
    const auto p = reference::make_problem(n, 2048, 4, 8 * n,
                                           std::vector<int32_t>(static_cast<size_t>(n), 64), 8);
    const auto start = std::chrono::steady_clock::now();
    lg.issue_dispatch(p, missing);
    for (int r = 0; r < n; ++r) {
      if (r == missing) continue;
      try {
        lg.groups[size_t(r)]->synchronize(lg.io[size_t(r)]->stream);
        ADD_FAILURE() << "rank " << r << " reported no timeout";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
        const std::string w = e.what();
        EXPECT_NE(w.find("rank(s) 1"), std::string::npos) << w;
        EXPECT_NE(w.find("dispatch"), std::string::npos) << w;
        EXPECT_NE(w.find("raise Config::timeout_seconds or set EPCOMM_TIMEOUT_SECONDS"),
                  std::string::npos) << w;  // says what to raise for a peer that is only late
      }
      expect_poisoned(lg, r);
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(secs, 30.0) << "the timeout took far longer than configured";
  }
  LocalGroup again(make_cfg(2048, 4, 8 * n, 64), n);
  const auto p = reference::make_problem(n, 2048, 4, 8 * n,
                                         std::vector<int32_t>(static_cast<size_t>(n), 64), 9);
  EXPECT_EQ(run_round(again, p, RoundOptions{}), "");
}

// A bad id and a missing rank in one call: the rank with the bad id records it first, then times
// out waiting for the missing rank. The record keeps one error, so the timeout's is not kept,
// but the abort flag it set makes every later kernel return at once: reporting the bad id must
// therefore poison the group too, or later calls would write nothing and report nothing.
TEST(Failure, BadIdThenTimeoutPoisons) {
  EPCOMM_REQUIRE_GPU();
  const int n = 4, missing = 1, bad_rank = 0;
  const int H = 2048, K = 4, E = 8 * n, T = 64;
  for (DispatchPath path : kBothPaths) {
    SCOPED_TRACE(dispatch_path_name(path));
    LocalGroup lg(with_path(make_cfg(H, K, E, T, 24, 1.0), path), n);
    auto p =
        reference::make_problem(n, H, K, E, std::vector<int32_t>(static_cast<size_t>(n), T), 12);
    p.ranks[size_t(bad_rank)].topk_ids[size_t(5 * K + 2)] = E;  // outside [-1, E)
    lg.issue_dispatch(p, missing);
    for (int r = 0; r < n; ++r) {
      if (r == missing) continue;
      try {
        lg.groups[size_t(r)]->synchronize(lg.io[size_t(r)]->stream);
        ADD_FAILURE() << "rank " << r << " reported no error";
      } catch (const Error& e) {
        const std::string w = e.what();
        if (r == bad_rank) {
          EXPECT_EQ(e.code(), ErrorCode::kBadExpertId) << w;
          EXPECT_NE(w.find("topk_ids[5][2]"), std::string::npos) << w;
          EXPECT_NE(w.find("also timed out"), std::string::npos) << w;
        } else {
          EXPECT_EQ(e.code(), ErrorCode::kTimeout) << w;
        }
      }
      expect_poisoned(lg, r);
    }
  }
}

// Set-up, teardown and set-up again in the same process.
TEST(Setup, SecondInitWorks) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  for (int i = 0; i < 3; ++i) {
    LocalGroup lg(make_cfg(2048, 8, 16 * n, 64), n);
    const auto p =
        reference::make_problem(n, 2048, 8, 16 * n, random_counts(n, 64, 30 + i), 30 + i);
    EXPECT_EQ(run_round(lg, p, RoundOptions{}), "") << "set-up " << i;
  }
}

// Groups of one process share the kernels: one set up later with a smaller configuration (less
// dispatch shared memory) leaves an earlier, larger one working, on both paths.
TEST(Setup, LaterSmallerGroupLeavesEarlierOnesWorking) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  for (DispatchPath path : kBothPaths) {
    SCOPED_TRACE(dispatch_path_name(path));
    const int32_t max_t = path == DispatchPath::kLowLatency ? 256 : 1024;
    LocalGroup big(with_path(make_cfg(2048, 8, 256, max_t), path), n);
    LocalGroup small(with_path(make_cfg(2048, 2, 2 * n, max_t), path), n);
    const auto p = reference::make_problem(n, 2048, 8, 256, random_counts(n, max_t, 41), 41);
    EXPECT_EQ(run_round(big, p, RoundOptions{}), "");
    const auto q = reference::make_problem(n, 2048, 2, 2 * n, random_counts(n, max_t, 42), 42);
    EXPECT_EQ(run_round(small, q, RoundOptions{}), "");
  }
}

// Host-checked bad input: a clear error before anything is launched, and the next call works.
TEST(BadInput, HostChecks) {
  EPCOMM_REQUIRE_GPU();
  const int n = 2;
  LocalGroup lg(make_cfg(2048, 4, 16, 64), n);
  RankIO& io = *lg.io[0];
  Group& g = *lg.groups[0];
  auto expect_invalid = [&](DispatchInput in, DispatchOutput out, const char* needle) {
    try {
      g.dispatch(in, out, io.stream);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const auto p = reference::make_problem(n, 2048, 4, 16, {64, 64}, 50);
  io.upload(p.ranks[0]);
  DispatchInput in = io.dispatch_input();
  const DispatchOutput out = io.dispatch_output();
  DispatchInput bad = in;
  bad.num_tokens = 65;
  expect_invalid(bad, out, "max_tokens_per_rank");
  bad = in;
  bad.num_tokens = -1;
  expect_invalid(bad, out, "num_tokens");
  bad = in;
  bad.hidden = 4096;
  expect_invalid(bad, out, "hidden");
  bad = in;
  bad.tokens = nullptr;
  expect_invalid(bad, out, "tokens is null");
  bad = in;
  bad.tokens = static_cast<const char*>(in.tokens) + 2;
  expect_invalid(bad, out, "16-byte aligned");
  bad = in;
  bad.topk_ids = nullptr;
  expect_invalid(bad, out, "topk_ids (or topk_ids64) is null");
  bad = in;
  bad.topk_ids64 = reinterpret_cast<const int64_t*>(in.topk_ids);
  expect_invalid(bad, out, "both topk_ids (int32) and topk_ids64 (int64)");
  bad = in;
  bad.topk_ids = nullptr;  // int64 ids on a 4-byte boundary
  bad.topk_ids64 = reinterpret_cast<const int64_t*>(in.topk_ids + 1);
  expect_invalid(bad, out, "topk_ids64 is not 8-byte aligned");
  DispatchOutput bad_out = out;
  bad_out.row_offsets = nullptr;
  expect_invalid(in, bad_out, "row_offsets is null");
  bad_out = out;
  bad_out.tokens = static_cast<char*>(out.tokens) + 8;
  expect_invalid(in, bad_out, "16-byte aligned");
  // The input inside the output (the fused kernel would overwrite it while reading it), at its
  // start, and ending one row into it: input and output carved from one buffer, so that a
  // check that failed to refuse would still read and write inside it.
  bad = in;
  bad.tokens = out.tokens;
  expect_invalid(bad, out, "overlap");
  {
    const int64_t row = 2048 * 2, in_bytes = int64_t(in.num_tokens) * row;
    const int64_t out_bytes = g.sizes().max_recv_rows * g.sizes().token_bytes;
    DeviceBuffer both(io.device, size_t(in_bytes - row + out_bytes));
    bad = in;
    bad.tokens = both.get();
    bad_out = out;
    bad_out.tokens = both.get<char>() + (in_bytes - row);
    expect_invalid(bad, bad_out, "overlap");
  }
  // combine before any dispatch
  try {
    g.combine(io.combine_input(), io.combine_output(true), io.stream);
    ADD_FAILURE() << "combine before dispatch accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  // wait without async
  EXPECT_THROW(g.dispatch_wait(out, io.stream), Error);
  EXPECT_EQ(run_round(lg, p, RoundOptions{}), "");
  // Weights given to dispatch and to combine: refused (they go to one of the two), and the
  // group goes on (the combine with weights = nullptr completes the round on every rank).
  RoundOptions es;
  es.expert_side = true;
  ASSERT_EQ(run_round(lg, p, es), "");
  try {
    g.combine(io.combine_input(), io.combine_output(true), io.stream);
    ADD_FAILURE() << "combine with weights after a dispatch with weights accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("expert side"), std::string::npos) << e.what();
  }
  EXPECT_EQ(run_round(lg, p, RoundOptions{}), "");
}

// Device-checked bad input on one rank: that rank reports the token and slot, sends nothing,
// the others' outputs match the reference without it, and the next valid round works. The ids
// go as int64 (topk_ids64) for the values no int32 holds: truncated to 32 bits, 2^32 + 3 and
// 5 - 2^32 would name experts 3 and 5; they are reported clamped to int32's range. The reference
// refuses the rank for an id of -3 there, which the int64 upload replaces (were it not, the
// device would report -3, and the test would fail on the message). Then tokens with more than
// one bad slot: the first in slot order is reported (reference::validate_topk), whichever
// threads the device spreads the slots over.
TEST(BadInput, DeviceChecks) {
  EPCOMM_REQUIRE_GPU();
  const int n = 4;
  const int H = 2048, K = 4, E = 8 * n, T = 100;
  const int bad_rank = 1, bad_token = 37;
  for (DispatchPath path : kBothPaths) {
    SCOPED_TRACE(dispatch_path_name(path));
    LocalGroup lg(with_path(make_cfg(H, K, E, T), path), n);
    uint64_t seed = 60;
    // Issues p (bad on bad_rank only); bad_rank reports `code` with a message holding each of
    // `shown`, the others complete; then a valid round.
    auto expect_refused = [&](const reference::Problem& p, ErrorCode code,
                              const std::vector<std::string>& shown) {
      lg.issue_dispatch(p);
      lg.io[size_t(bad_rank)]->wide_ids.clear();
      for (int r = 0; r < n; ++r) {
        if (r != bad_rank) {
          EXPECT_NO_THROW(lg.groups[size_t(r)]->synchronize(lg.io[size_t(r)]->stream));
          continue;
        }
        try {
          lg.groups[size_t(r)]->synchronize(lg.io[size_t(r)]->stream);
          ADD_FAILURE() << "no error for " << shown.front();
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), code) << e.what();
          const std::string w = e.what();
          EXPECT_NE(w.find("topk_ids[37]"), std::string::npos) << w;
          for (const std::string& part : shown)
            EXPECT_NE(w.find(part), std::string::npos) << w;
          EXPECT_NE(w.find("rank 1"), std::string::npos) << w;
        }
        EXPECT_FALSE(lg.groups[size_t(r)]->poisoned());
      }
      const auto refs = reference_dispatch_all(p);
      for (int r = 0; r < n; ++r)
        EXPECT_EQ(lg.io[size_t(r)]->check_dispatch(refs[size_t(r)]), "");
      // The next valid round works on every rank.
      const auto good = reference::make_problem(n, H, K, E, random_counts(n, T, seed), seed);
      ++seed;
      EXPECT_EQ(run_round(lg, good, RoundOptions{}), "");
    };
    auto bad_problem = [&] {
      return reference::make_problem(n, H, K, E, std::vector<int32_t>(static_cast<size_t>(n), T),
                                     seed++);
    };

    struct Bad {
      int64_t value;
      int slot_from;  // duplicate: copy this slot's id
      ErrorCode code;
      const char* shown;  // how the error names the value
    };
    const int64_t two32 = int64_t(1) << 32;
    const Bad bads[] = {{E, -1, ErrorCode::kBadExpertId, "= 32 "},
                        {E + 1000, -1, ErrorCode::kBadExpertId, "= 1032 "},
                        {-2, -1, ErrorCode::kBadExpertId, "= -2 "},
                        {0, 0, ErrorCode::kDuplicateExpert, " twice "},
                        {two32 + 3, -1, ErrorCode::kBadExpertId, "= 2147483647 is outside"},
                        {5 - two32, -1, ErrorCode::kBadExpertId, "= -2147483648 is outside"},
                        {INT64_MIN, -1, ErrorCode::kBadExpertId, "= -2147483648 is outside"}};
    for (const Bad& b : bads) {
      auto p = bad_problem();
      const int bad_slot = 2;
      int32_t* ids = p.ranks[bad_rank].topk_ids.data() + bad_token * K;
      const bool wide = b.value != int64_t(int32_t(b.value));
      ids[bad_slot] = b.slot_from >= 0 ? ids[b.slot_from] : (wide ? -3 : int32_t(b.value));
      for (auto& io : lg.io)
        io->id_bytes = wide ? 8 : 4;
      if (wide) lg.io[size_t(bad_rank)]->wide_ids = {{size_t(bad_token * K + bad_slot), b.value}};
      std::vector<std::string> shown = {b.shown};
      if (wide) shown.push_back("(an int64 id beyond");
      expect_refused(p, b.code, shown);
    }

    // Edits of bad_token's slots, in turn: ids[slot] = ids[from], or `value` where from < 0.
    struct Edit {
      int slot, from;
      int32_t value;
    };
    struct Order {
      std::vector<Edit> edits;
      ErrorCode code;
      int slot;  // the slot reported: the token's first bad one
    };
    const ErrorCode kBadId = ErrorCode::kBadExpertId, kDup = ErrorCode::kDuplicateExpert;
    const Order orders[] = {
        {{{3, 1, 0}}, kDup, 3},                            // the later of two slots
        {{{2, 0, 0}, {3, 0, 0}}, kDup, 2},                 // three slots with one expert
        {{{0, -1, -1}, {2, -1, -1}, {3, 1, 0}}, kDup, 3},  // masked slots are no duplicates
        {{{1, -1, E}, {3, 2, 0}}, kBadId, 1},              // a bad id, then a duplicate
        {{{1, 0, 0}, {3, -1, -2}}, kDup, 1}};              // a duplicate, then a bad id
    for (auto& io : lg.io)
      io->id_bytes = 4;
    for (const Order& o : orders) {
      auto p = bad_problem();
      int32_t* ids = p.ranks[bad_rank].topk_ids.data() + bad_token * K;
      for (const Edit& e : o.edits)
        ids[e.slot] = e.from >= 0 ? ids[e.from] : e.value;
      const auto want = reference::validate_topk(p.ranks[bad_rank].topk_ids.data(), T, K, E);
      ASSERT_EQ(want.token, bad_token);
      ASSERT_EQ(want.code, o.code);
      ASSERT_EQ(want.slot, o.slot);
      const std::string v = std::to_string(want.value), k = std::to_string(want.slot);
      expect_refused(p, o.code,
                     {o.code == kBadId ? "topk_ids[37][" + k + "] = " + v + " is outside"
                                       : "names expert " + v + " twice (again at slot " + k + ")"});
    }
  }
}

// Top-k ids as int64 (DispatchInput::topk_ids64, torch.topk's dtype): the same rows, combines
// and checks as int32 ids, on both paths and forms, with masked slots (-1 as int64), and with
// the last rank holding no token (its ids pointer is never read).
TEST(Forms, Int64TopkIds) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  for (DispatchPath path : kBothPaths) {
    SCOPED_TRACE(dispatch_path_name(path));
    LocalGroup lg(with_path(make_cfg(2048, 8, 16 * n, 128), path), n);
    for (Form form : {Form::kFused, Form::kAsyncWait}) {
      for (bool expert_side : {false, true}) {
        const uint64_t seed = 70 + 2 * uint64_t(form == Form::kFused) + uint64_t(expert_side);
        std::vector<int32_t> counts = random_counts(n, 128, seed);
        counts.back() = 0;
        const auto p = reference::make_problem(n, 2048, 8, 16 * n, counts, seed, 0.0, 0.2);
        RoundOptions o = every_combine(form, expert_side);
        o.ids64 = true;
        EXPECT_EQ(run_round(lg, p, o), "") << "expert side " << expert_side;
      }
    }
  }
}

// Two ranks on one GPU only when the config says so; with it, a round works.
TEST(Setup, SharingAGpuNeedsTheOptIn) {
  EPCOMM_REQUIRE_GPU();
  Config cfg = make_cfg(2048, 4, 16, 64, 8);
  try {
    Group::create_local(cfg, {0, 0});
    ADD_FAILURE() << "two ranks on GPU 0 were accepted without share_gpus";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSetup) << e.what();
    EXPECT_NE(std::string(e.what()).find("use the same GPU"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("share_gpus"), std::string::npos) << e.what();
  }
  cfg.share_gpus = true;
  LocalGroup lg(cfg, std::vector<int>{0, 0});
  const auto p = reference::make_problem(2, 2048, 4, 16, {64, 37}, 71);
  EXPECT_EQ(run_round(lg, p, RoundOptions{}), "");
}

// More blocks than fit when every sharing rank's grid must be resident: refused at set-up with
// the count needed, the count that fits and the num_sms that would; that num_sms works.
TEST(Setup, ResidencyIsCheckedBeforeAnyLaunch) {
  EPCOMM_REQUIRE_GPU();
  const int n = 4;
  Config cfg = make_cfg(2048, 4, 16, 64);
  cfg.share_gpus = true;
  const int fit = max_resident_blocks(cfg, n, 0);
  ASSERT_GE(fit, n);
  cfg.num_sms = fit / n + 1;
  const std::vector<int> devices(static_cast<size_t>(n), 0);
  try {
    Group::create_local(cfg, devices);
    ADD_FAILURE() << n << " x " << cfg.num_sms << " blocks on one GPU holding " << fit
                  << " were accepted";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << w;
    EXPECT_NE(w.find(std::to_string(n * cfg.num_sms) + " blocks must be resident"),
              std::string::npos)
        << w;
    EXPECT_NE(w.find("holds " + std::to_string(fit)), std::string::npos) << w;
    EXPECT_NE(w.find("num_sms <= " + std::to_string(fit / n)), std::string::npos) << w;
  }
  cfg.num_sms = fit / n;
  LocalGroup lg(cfg, devices);
  const auto p = reference::make_problem(n, 2048, 4, 16, random_counts(n, 64, 72), 72);
  EXPECT_EQ(run_round(lg, p, RoundOptions{}), "");
}

// Config::max_routed_rows: at the cap a round works; one row past it, every rank of the call
// reports kRecvCapacity naming the ranks that would overflow and the cap, and no rank writes a
// row (every output keeps its poison, row_offsets all 0); the next call works. 2, 3, 4 and 8
// ranks (sharing the GPUs there are).
TEST(BadInput, ReceiveCapacity) {
  EPCOMM_REQUIRE_GPU();
  for (int n : {2, 3, 4, 8}) {
    SCOPED_TRACE(std::to_string(n) + " ranks");
    const int H = 2048, K = 4, E = 8 * n, T = 64;
    const auto p =
        reference::make_problem(n, H, K, E, std::vector<int32_t>(static_cast<size_t>(n), T), 73);
    const auto refs = reference_dispatch_all(p);
    int64_t most = 0;
    for (const auto& r : refs) most = std::max(most, r.rows());
    std::string over;  // the ranks past a cap of most - 1, as the error lists them
    for (int r = 0; r < n; ++r)
      if (refs[size_t(r)].rows() > most - 1) over += (over.empty() ? "" : ", ") + std::to_string(r);
    for (DispatchPath path : kBothPaths) {
      SCOPED_TRACE(dispatch_path_name(path));
      {
        Config cfg = with_path(make_cfg(H, K, E, T), path);
        cfg.max_routed_rows = most;
        LocalGroup lg(cfg, n);
        EXPECT_EQ(lg.groups[0]->sizes().max_recv_rows, most);
        EXPECT_EQ(run_round(lg, p, RoundOptions{}), "") << "at the cap";
      }
      Config cfg = with_path(make_cfg(H, K, E, T), path);
      cfg.max_routed_rows = most - 1;
      LocalGroup lg(cfg, n);
      lg.issue_dispatch(p);
      for (int r = 0; r < n; ++r) {
        RankIO& io = *lg.io[size_t(r)];
        try {
          lg.groups[size_t(r)]->synchronize(io.stream);
          ADD_FAILURE() << "rank " << r << " reported nothing; rank(s) " << over
                        << " were routed past a cap of " << most - 1;
        } catch (const Error& e) {
          const std::string w = e.what();
          EXPECT_EQ(e.code(), ErrorCode::kRecvCapacity) << w;
          EXPECT_NE(w.find("rank(s) " + over + " would receive"), std::string::npos) << w;
          EXPECT_NE(w.find("capacity of " + std::to_string(most - 1)), std::string::npos) << w;
          EXPECT_NE(w.find("the most: " + std::to_string(most)), std::string::npos) << w;
        }
        EXPECT_FALSE(lg.groups[size_t(r)]->poisoned());
        std::vector<uint8_t> bytes(io.out_tokens.bytes());
        io.out_tokens.download(bytes.data(), bytes.size());
        EXPECT_EQ(std::count(bytes.begin(), bytes.end(), uint8_t(0xff)), int64_t(bytes.size()))
            << "rank " << r << ": rows were written";
        bytes.resize(io.src_info.bytes());
        io.src_info.download(bytes.data(), bytes.size());
        EXPECT_EQ(std::count(bytes.begin(), bytes.end(), uint8_t(0xff)), int64_t(bytes.size()))
            << "rank " << r << ": src_info was written";
        std::vector<uint32_t> offsets(size_t(io.n_groups + 1));
        io.row_offsets.download(offsets.data(), offsets.size() * 4);
        for (uint32_t o : offsets)
          EXPECT_EQ(o, 0u) << "rank " << r;
      }
      // A round whose every rank stays under the cap works on the same group.
      const auto small = reference::make_problem(n, H, K, E, random_counts(n, T / 4, 74), 74);
      EXPECT_EQ(run_round(lg, small, RoundOptions{}), "");
    }
  }
}
