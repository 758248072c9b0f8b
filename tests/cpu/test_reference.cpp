// The CPU reference model: worked examples by hand, then properties on random problems.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "epcomm/bf16.h"
#include "epcomm/reference.h"

using namespace epcomm;
using namespace epcomm::reference;

namespace {
// 2 ranks, 4 experts (2 per rank), K = 2, H = 8. Token t of rank s has every value s*100+t+1.
Problem tiny() {
  Problem p;
  p.n_ranks = 2;
  p.hidden = 8;
  p.top_k = 2;
  p.n_experts = 4;
  const std::vector<std::vector<int32_t>> ids = {{1, 2, 3, -1, 0, 1},  // rank 0: 3 tokens
                                                 {2, 3, 1, 0}};        // rank 1: 2 tokens
  for (int s = 0; s < 2; ++s) {
    RankInput in;
    in.num_tokens = int32_t(ids[size_t(s)].size() / 2);
    in.topk_ids = ids[size_t(s)];
    for (int t = 0; t < in.num_tokens; ++t)
      for (int h = 0; h < 8; ++h) in.tokens.push_back(float_to_bf16(float(s * 100 + t + 1)));
    for (int i = 0; i < in.num_tokens * 2; ++i) in.weights.push_back(0.25f * float(i + 1));
    p.ranks.push_back(in);
  }
  return p;
}

// Expert outputs of tiny(): row value = 10 * (expert rank + 1) + row index (exact in bf16).
std::vector<std::vector<uint16_t>> tiny_expert_outputs(const std::vector<DispatchResult>& l) {
  std::vector<std::vector<uint16_t>> y(l.size());
  for (size_t d = 0; d < l.size(); ++d)
    for (int64_t r = 0; r < l[d].rows(); ++r)
      for (int h = 0; h < 8; ++h) y[d].push_back(float_to_bf16(float(10 * int64_t(d + 1) + r)));
  return y;
}
}  // namespace

TEST(Reference, DispatchRowOrderIsGroupThenSourceThenToken) {
  const Problem p = tiny();
  const DispatchResult r0 = dispatch(p, 0);
  // rank 0 owns experts 0, 1. Expert 0: (s0,t2,k0), (s1,t1,k1). Expert 1: (s0,t0,k0),
  // (s0,t2,k1), (s1,t1,k0).
  ASSERT_EQ(r0.row_offsets, (std::vector<uint32_t>{0, 2, 5}));
  EXPECT_EQ(r0.expert_ids, (std::vector<int32_t>{0, 1}));
  const std::vector<std::tuple<int, int, int>> want = {
      {0, 2, 0}, {1, 1, 1}, {0, 0, 0}, {0, 2, 1}, {1, 1, 0}};
  ASSERT_EQ(r0.rows(), 5);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(r0.src_info[i].rank, std::get<0>(want[i])) << i;
    EXPECT_EQ(r0.src_info[i].token, std::get<1>(want[i])) << i;
    EXPECT_EQ(r0.src_info[i].slot, std::get<2>(want[i])) << i;
    const float v = float(std::get<0>(want[i]) * 100 + std::get<1>(want[i]) + 1);
    for (int h = 0; h < 8; ++h) EXPECT_EQ(bf16_to_float(r0.tokens[i * 8 + h]), v);
  }
  const DispatchResult r1 = dispatch(p, 1);
  // rank 1 owns experts 2, 3. Expert 2: (s0,t0,k1), (s1,t0,k0). Expert 3: (s0,t1,k0), (s1,t0,k1)
  EXPECT_EQ(r1.row_offsets, (std::vector<uint32_t>{0, 2, 4}));
  EXPECT_EQ(r1.src_info[1].rank, 1);
  EXPECT_EQ(r1.src_info[1].token, 0);
  EXPECT_EQ(r1.src_info[3].slot, 1);
}

TEST(Reference, CombineWeightsMasksAndUnreduced) {
  const Problem p = tiny();
  const std::vector<DispatchResult> l = {dispatch(p, 0), dispatch(p, 1)};
  const std::vector<std::vector<uint16_t>> y = tiny_expert_outputs(l);
  const std::vector<double> out = combine(p, l, y, 0, true);
  ASSERT_EQ(out.size(), 3u * 8);
  // rank 0 token 0: k0 -> expert 1 (rank 0, row 2), k1 -> expert 2 (rank 1, row 0)
  EXPECT_DOUBLE_EQ(out[0], 0.25 * 12 + 0.5 * 20);
  // token 1: k0 -> expert 3 (rank 1 row 2), k1 masked
  EXPECT_DOUBLE_EQ(out[8], 0.75 * 22);
  const std::vector<double> un = combine(p, l, y, 0, false);
  ASSERT_EQ(un.size(), 3u * 2 * 8);
  EXPECT_DOUBLE_EQ(un[(1 * 2 + 0) * 8], 22);
  EXPECT_DOUBLE_EQ(un[(1 * 2 + 1) * 8], 0);  // masked slot is zero
}

TEST(Reference, ValidateFindsFirstProblem) {
  const std::vector<int32_t> ok = {0, 1, -1, -1, 3, 2};
  EXPECT_EQ(validate_topk(ok.data(), 3, 2, 4).code, ErrorCode::kOk);
  const std::vector<int32_t> out_of_range = {0, 1, 4, 0};
  const TopkError e = validate_topk(out_of_range.data(), 2, 2, 4);
  EXPECT_EQ(e.code, ErrorCode::kBadExpertId);
  EXPECT_EQ(e.token, 1);
  EXPECT_EQ(e.slot, 0);
  EXPECT_EQ(e.value, 4);
  const std::vector<int32_t> below = {-2, 0};
  EXPECT_EQ(validate_topk(below.data(), 1, 2, 4).code, ErrorCode::kBadExpertId);
  const std::vector<int32_t> dup = {0, 1, 2, 2};
  const TopkError d = validate_topk(dup.data(), 2, 2, 4);
  EXPECT_EQ(d.code, ErrorCode::kDuplicateExpert);
  EXPECT_EQ(d.token, 1);
  EXPECT_EQ(d.slot, 1);
}

TEST(Reference, BadRankSendsNothing) {
  Problem p = tiny();
  p.ranks[1].topk_ids[0] = 7;  // out of range on rank 1
  const DispatchResult r0 = dispatch(p, 0);
  for (const SrcInfo& s : r0.src_info) EXPECT_EQ(s.rank, 0);
  EXPECT_EQ(r0.row_offsets.back(), 3u);
}

// Expert-side reduction: each rank's slots summed with fma (slot ascending) and rounded to bf16,
// then the ranks' sums added in rank order.
TEST(Reference, CombineExpertSideSumsPerRankThenAcrossRanks) {
  const Problem p = tiny();
  const std::vector<DispatchResult> l = {dispatch(p, 0), dispatch(p, 1)};
  const std::vector<std::vector<uint16_t>> y = tiny_expert_outputs(l);
  const std::vector<float> out = combine_expert_side(p, l, y, 0);
  ASSERT_EQ(out.size(), 3u * 8);
  EXPECT_EQ(out[0], 0.25f * 12 + 0.5f * 20);  // token 0: one slot on each rank
  EXPECT_EQ(out[8], 0.75f * 22);              // token 1: k1 masked
  // token 2: experts 0 (row 0) and 1 (row 3), both on rank 0: one partial sum
  EXPECT_EQ(out[16], 1.25f * 10 + 1.5f * 13);
  // The partial sum is rounded to bf16 before the token side adds it: 1 + 2^-9 rounds to 1.
  Problem q = tiny();
  q.ranks[0].weights[0] = 1.0f + std::ldexp(1.0f, -9);  // token 0, k0 -> rank 0, y = 12
  const std::vector<float> r = combine_expert_side(q, l, y, 0);
  EXPECT_EQ(r[0], bf16_to_float(float_to_bf16(12.0f * (1.0f + std::ldexp(1.0f, -9)))) + 10.0f);
  EXPECT_NE(r[0], 12.0f * (1.0f + std::ldexp(1.0f, -9)) + 10.0f);
}

// On random problems the expert-side result stays within the bf16 rounding of each rank's
// partial sum of the float64 reduction.
TEST(Reference, CombineExpertSideTracksFloat64Reduction) {
  const Problem p = make_problem(4, 64, 8, 32, {50, 0, 33, 17}, 11, 0.0, 0.1);
  std::vector<DispatchResult> l;
  for (int r = 0; r < 4; ++r) l.push_back(dispatch(p, r));
  std::vector<std::vector<uint16_t>> y;
  std::mt19937_64 rng(5);
  for (auto& d : l) y.push_back(make_tokens(d.rows() * 64, rng));
  for (int rank = 0; rank < 4; ++rank) {
    const std::vector<double> ref = combine(p, l, y, rank, true);
    const std::vector<float> es = combine_expert_side(p, l, y, rank);
    ASSERT_EQ(ref.size(), es.size());
    const RankInput& in = p.ranks[size_t(rank)];
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      double sum_w = 0;  // |y| < 2, so every partial sum is below 2 * sum_w
      for (int k = 0; k < 8; ++k)
        if (in.topk_ids[size_t(t * 8 + k)] >= 0) sum_w += in.weights[size_t(t * 8 + k)];
      for (int h = 0; h < 64; ++h) {
        const size_t i = size_t(t) * 64 + size_t(h);
        EXPECT_LE(std::fabs(double(es[i]) - ref[i]), std::ldexp(2.0 * sum_w, -8)) << t << " " << h;
      }
    }
  }
}

TEST(Reference, RandomProblemsConserveRows) {
  const Problem p = make_problem(4, 64, 8, 32, {100, 0, 1, 57}, 7, 0.0, 0.1);
  int64_t routed = 0;
  for (const RankInput& in : p.ranks) {
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      std::set<int32_t> seen;
      for (int k = 0; k < 8; ++k) {
        const int32_t id = in.topk_ids[size_t(t * 8 + k)];
        EXPECT_GE(id, -1);
        EXPECT_LT(id, 32);
        if (id >= 0) {
          EXPECT_TRUE(seen.insert(id).second) << "duplicate expert";
          ++routed;
        }
      }
    }
    for (uint16_t x : in.tokens) EXPECT_NE(bf16_to_float(x), 0.0f);
  }
  int64_t rows = 0;
  std::vector<DispatchResult> l;
  for (int r = 0; r < 4; ++r) {
    l.push_back(dispatch(p, r));
    rows += l.back().rows();
    const auto& ro = l.back().row_offsets;
    for (size_t g = 1; g < ro.size(); ++g) EXPECT_LE(ro[g - 1], ro[g]);
  }
  EXPECT_EQ(rows, routed);
  // Combining the dispatched tokens themselves with weight 1 and no masks gives back
  // (number of unmasked slots) x token.
  std::vector<std::vector<uint16_t>> y;
  for (auto& d : l) y.push_back(d.tokens);
  const std::vector<double> un = combine(p, l, y, 3, false);
  const RankInput& in = p.ranks[3];
  for (int32_t t = 0; t < in.num_tokens; ++t)
    for (int k = 0; k < 8; ++k) {
      const double expect =
          in.topk_ids[size_t(t * 8 + k)] >= 0 ? bf16_to_float(in.tokens[size_t(t * 64)]) : 0.0;
      EXPECT_EQ(un[size_t((t * 8 + k) * 64)], expect);
    }
}

TEST(Reference, ZipfRoutingIsSkewed) {
  std::mt19937_64 rng(3);
  const std::vector<int32_t> ids = make_topk(4000, 8, 256, rng, 1.2);
  std::map<int32_t, int> hist;
  for (int32_t id : ids) ++hist[id];
  int most = 0;
  for (auto& [e, c] : hist) most = std::max(most, c);
  // Uniform would give ~125 per expert; the most popular expert gets several times that.
  EXPECT_GT(most, 3 * 125);
}

TEST(Reference, ComparisonsCatchErrors) {
  const std::vector<double> ref = {1.0, -2.0, 3.5};
  const uint16_t good[3] = {float_to_bf16(1.0f), float_to_bf16(-2.0f), float_to_bf16(3.5f)};
  EXPECT_EQ(compare_combine_bf16(ref, good, 3), "");
  EXPECT_EQ(compare_exact_bf16(ref, good, 3), "");
  const uint16_t bad[3] = {float_to_bf16(1.0f), float_to_bf16(-2.1f), float_to_bf16(3.5f)};
  EXPECT_NE(compare_combine_bf16(ref, bad, 3), "");
  EXPECT_NE(compare_exact_bf16(ref, bad, 3), "");
  const float f[3] = {1.0f, -2.0f, 3.5f + 1e-3f};
  EXPECT_NE(compare_combine_f32(ref, f, 3, 1e-5), "");
  const float g[3] = {1.0f, -2.0f, 3.5f};
  EXPECT_EQ(compare_combine_f32(ref, g, 3, 1e-5), "");
  // Expert side: bit-exact against the reference rounded to bf16; one ulp off fails.
  const std::vector<float> es = {1.0f, -2.0f, 3.5f + std::ldexp(1.0f, -10)};
  EXPECT_EQ(compare_combine_expert_side(es, good, 3), "");
  const uint16_t ulp[3] = {good[0], uint16_t(good[1] + 1), good[2]};
  EXPECT_NE(compare_combine_expert_side(es, ulp, 3), "");
  EXPECT_NE(compare_combine_expert_side(es, good, 2), "");
}

TEST(Bf16, RoundTripAndRounding) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: rounds to even (1.0)
  EXPECT_EQ(float_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  for (uint32_t b = 0; b < 0x10000; b += 7) {
    const float f = bf16_to_float(uint16_t(b));
    if (f == f) {
      EXPECT_EQ(float_to_bf16(f), b);
    }
  }
}

// Arguments no group could run are refused with a message naming them, never a crash or
// garbage (each call here crashed, returned garbage or answered "no mismatch" before).
TEST(Reference, RejectsBadArguments) {
  const auto refuses = [](auto&& call, const char* needle) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refuses([] { make_problem(2, 256, 8, 4, {4, 4}, 1); }, "top_k");        // K > experts
  refuses([] { make_problem(3, 256, 2, 8, {1, 1, 1}, 1); }, "n_experts");  // 8 over 3 ranks
  refuses([] { make_problem(2, 256, 2, 8, {1}, 1); }, "num_tokens");       // one count, 2 ranks
  refuses([] { make_problem(2, 256, 2, 8, {-4, 4}, 1); }, "negative");
  refuses([] { make_replicated_problem(3, 256, 2, 8, 4, 1); }, "n_experts");
  const Problem p = make_problem(2, 256, 2, 8, {5, 3}, 1);
  refuses([&] { dispatch(p, 5); }, "rank 5");
  refuses([&] { dispatch(p, -1); }, "rank -1");
  const std::vector<DispatchResult> layouts = {dispatch(p, 0), dispatch(p, 1)};
  std::vector<std::vector<uint16_t>> ys;
  for (const auto& l : layouts) ys.push_back(std::vector<uint16_t>(size_t(l.rows() * 256), 0x3f80));
  refuses([&] { combine(p, {layouts[0]}, ys, 0, true); }, "1 layouts");
  refuses([&] { combine(p, layouts, {ys[0]}, 0, true); }, "1 expert outputs");
  refuses([&] { combine_expert_side(p, layouts, ys, 2); }, "rank 2");
  auto short_ys = ys;
  short_ys[1].resize(short_ys[1].size() / 2);
  refuses([&] { combine(p, layouts, short_ys, 0, false); }, "expert output 1");
  refuses([&] { combine(p, {layouts[1], layouts[0]}, ys, 0, true); }, "expert output 0");
  auto foreign = layouts;
  foreign[0].src_info[0].token = 99;  // rank 0's input has 5 tokens
  refuses([&] { combine(p, foreign, ys, 0, true); }, "not a dispatch result");
  refuses([&] {
    compare_dispatch(layouts[0], layouts[0].row_offsets.data(), layouts[0].expert_ids.data(),
                     layouts[0].src_info.data(), layouts[0].tokens.data(), 128);
  }, "hidden = 128");
  Problem bad = p;
  bad.ranks[1].topk_ids.pop_back();
  refuses([&] { dispatch(bad, 0); }, "topk_ids");
  EXPECT_EQ(combine(p, layouts, ys, 0, true).size(), size_t(5 * 256));  // the good call works
  auto padded = layouts;  // a padded format's layout: padding rows (src_info -1) are read by nobody
  padded[1].src_info.push_back(SrcInfo{-1, -1, -1});
  padded[1].row_offsets.back() += 1;
  ys[1].resize(ys[1].size() + 256, 0x3f80);
  EXPECT_EQ(combine(p, padded, ys, 0, true), combine(p, layouts, ys, 0, true));
}

// The network messages of a dispatch across nodes, by hand: 4 ranks as 2 nodes of 2, 8 experts
// (2 per rank). Rank 0's tokens: {0, 2, 4, 6} reaches ranks 0-3 (2 remote ranks, 1 remote
// node); {4, 5, -1, 7} ranks 2, 3 (2 remote ranks, 1 node); {1, 3, -1, -1} ranks 0, 1 (none).
TEST(Reference, CrossNodeMessagesByHand) {
  Problem p = make_problem(4, 8, 4, 8, {3, 1, 1, 1}, 5);
  p.ranks[0].topk_ids = {0, 2, 4, 6, 4, 5, -1, 7, 1, 3, -1, -1};
  EXPECT_EQ(destination_ranks(p, 0, 0), 0xfu);
  EXPECT_EQ(destination_ranks(p, 0, 1), 0xcu);
  EXPECT_EQ(destination_ranks(p, 0, 2), 0x3u);
  // Rank 0's dispatch messages: direct (one per remote rank) and forwarded (one per remote node).
  const auto messages = [&p](int32_t ranks_per_node) {
    const CrossNodeTraffic t = cross_node_traffic(p, ranks_per_node, {})[0];
    return std::make_pair(t.direct.dispatch_messages, t.forwarded.dispatch_messages);
  };
  EXPECT_EQ(messages(2), std::make_pair(int64_t(4), int64_t(2)));
  EXPECT_EQ(messages(1), std::make_pair(int64_t(6), int64_t(6)));  // every rank a node: 3 + 2 + 1
  EXPECT_EQ(messages(4), std::make_pair(int64_t(0), int64_t(0)));
  EXPECT_THROW(messages(3), Error);  // 3 does not divide 4
  p.ranks[0].topk_ids[1] = 0;  // a duplicate: the device sends nothing from rank 0
  EXPECT_EQ(messages(2).first, 0);
}
