// The CPU reference model's modes (docs/design.md "Modes"): the fused shared expert and skip_a2a, by hand on a
// small problem and as properties on random ones (the skip_a2a partial sums, added over the
// ranks, give the whole layer's output).
#include <gtest/gtest.h>

#include <cmath>

#include "epcomm/bf16.h"
#include "epcomm/reference.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::reference;

namespace {
// 2 ranks, 4 experts, K = 2, H = 8; rank 0 has 3 tokens, rank 1 has 2.
Problem tiny_shared() {
  Problem p = make_problem(2, 8, 2, 4, {3, 2}, 5);
  p.ranks[0].topk_ids = {1, 2, 3, -1, 0, 1};
  p.ranks[1].topk_ids = {2, 3, 1, 0};
  p.shared_expert = true;
  return p;
}
}  // namespace

// Group 0 is the shared expert: the rank's own tokens, rows [0, T), slot K; the local experts
// follow as groups 1..n_local with expert_ids 0..n_local-1.
TEST(ReferenceModes, SharedExpertIsGroupZeroOfOwnTokens) {
  const Problem p = tiny_shared();
  const DispatchResult r0 = dispatch(p, 0);
  ASSERT_EQ(r0.expert_ids, (std::vector<int32_t>{kSharedExpertId, 0, 1}));
  // shared: 3 own tokens; expert 0: rank 0 token 2, rank 1 token 1; expert 1: rank 0 tokens 0, 2
  // and rank 1 token 1.
  EXPECT_EQ(r0.row_offsets, (std::vector<uint32_t>{0, 3, 5, 8}));
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(r0.src_info[size_t(t)].token, t);
    EXPECT_EQ(r0.src_info[size_t(t)].rank, 0);
    EXPECT_EQ(r0.src_info[size_t(t)].slot, 2);
    EXPECT_EQ(r0.tokens[size_t(t) * 8], p.ranks[0].tokens[size_t(t) * 8]);
  }
  EXPECT_EQ(dispatch(p, 1).row_offsets, (std::vector<uint32_t>{0, 2, 4, 6}));

  // Combine adds the shared row (weight 1) to the weighted sum; the un-reduced output has none.
  std::vector<DispatchResult> l = {r0, dispatch(p, 1)};
  std::vector<std::vector<uint16_t>> y;
  for (const auto& d : l) {
    std::vector<uint16_t> v;
    for (int64_t r = 0; r < d.rows(); ++r)
      for (int h = 0; h < 8; ++h) v.push_back(float_to_bf16(float(r + 1)));
    y.push_back(v);
  }
  const std::vector<double> out = combine(p, l, y, 1, true);
  const std::vector<float>& w = p.ranks[1].weights;
  // Rank 1's token 0 goes to experts 2 and 3 (both on rank 1); its rows found from the layout.
  double want = 0;
  for (int k = 0; k < 2; ++k) {
    const int32_t e = p.ranks[1].topk_ids[size_t(k)];
    const DispatchResult& d = l[size_t(e / 2)];
    for (int64_t r = 0; r < d.rows(); ++r)
      if (d.src_info[size_t(r)].rank == 1 && d.src_info[size_t(r)].token == 0 &&
          d.src_info[size_t(r)].slot == k)
        want += double(w[size_t(k)]) * double(r + 1);
  }
  want += 1.0;  // the shared row of token 0 is row 0 of rank 1: value 1
  EXPECT_EQ(out[0], want);
  EXPECT_EQ(combine(p, l, y, 1, false).size(), size_t(2 * 2 * 8));
}

// skip_a2a: each rank keeps its own experts of its own (replicated) tokens; duplicates are
// looked for among its own experts only.
TEST(ReferenceModes, SkipA2aKeepsOwnExpertsOfOwnTokens) {
  Problem p = make_replicated_problem(2, 8, 2, 4, 3, 9);
  for (auto& r : p.ranks) r.topk_ids = {1, 2, 3, -1, 0, 1};
  p.skip_a2a = true;
  const DispatchResult r0 = dispatch(p, 0), r1 = dispatch(p, 1);
  EXPECT_EQ(r0.row_offsets, (std::vector<uint32_t>{0, 1, 3}));  // expert 0: t2; expert 1: t0, t2
  EXPECT_EQ(r1.row_offsets, (std::vector<uint32_t>{0, 1, 2}));  // expert 2: t0; expert 3: t1
  for (const SrcInfo& s : r0.src_info) EXPECT_EQ(s.rank, 0);
  for (const SrcInfo& s : r1.src_info) EXPECT_EQ(s.rank, 1);
  // A duplicate of rank 1's expert: rank 1 rejects its tokens, rank 0 does not see it.
  for (auto& r : p.ranks) r.topk_ids = {1, 0, 3, 3, 0, 1};
  EXPECT_EQ(dispatch(p, 0).rows(), 4);
  EXPECT_EQ(dispatch(p, 1).rows(), 0);
}

// skip_a2a (with and without the shared expert, the shared tokens split over W ranks): the
// partial sums of every rank, added up, are the whole layer's output of the tokens.
TEST(ReferenceModes, SkipA2aPartialSumsAddUpToTheLayer) {
  for (bool shared : {false, true}) {
    for (int n : {1, 2, 3, 8}) {
      for (int T : {0, 1, 37}) {
        Problem p = make_replicated_problem(n, 64, 4, 4 * n, T, 100 + uint64_t(n), 0.0, 0.1);
        p.skip_a2a = true;
        p.shared_expert = shared;
        std::vector<DispatchResult> l;
        std::vector<std::vector<uint16_t>> y;
        int64_t shared_rows = 0;
        for (int r = 0; r < n; ++r) {
          l.push_back(dispatch(p, r));
          y.push_back(epcomm::testing::function_expert_outputs(l.back(), r, 4, 64));
          if (shared) shared_rows += l.back().row_offsets[1];
        }
        EXPECT_EQ(shared_rows, shared ? T : 0);  // each token's shared row on exactly one rank
        std::vector<double> sum(size_t(T) * 64, 0.0);
        for (int r = 0; r < n; ++r) {
          const std::vector<double> part = combine(p, l, y, r, true);
          for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
        }
        const std::vector<double> want = epcomm::testing::layer_output(p.ranks[0], 4, 64, shared);
        ASSERT_EQ(want.size(), sum.size());
        for (size_t i = 0; i < sum.size(); ++i)
          ASSERT_NEAR(sum[i], want[i], 1e-9 * (1 + std::fabs(want[i])))
              << "shared " << shared << " n " << n << " T " << T << " at " << i;
      }
    }
  }
}

// The expert-side reduction with the shared expert: the shared row joins the rank's own partial
// sum, last (weight 1), before the rounding to bf16.
TEST(ReferenceModes, ExpertSideAddsSharedRowToOwnPartialSum) {
  Problem p = make_problem(2, 8, 2, 4, {1, 1}, 3);
  p.shared_expert = true;
  p.ranks[0].topk_ids = {0, 2};  // rank 0 token 0: expert 0 (rank 0), expert 2 (rank 1)
  p.ranks[0].weights = {0.5f, 0.25f};
  std::vector<DispatchResult> l = {dispatch(p, 0), dispatch(p, 1)};
  std::vector<std::vector<uint16_t>> y;
  for (int d = 0; d < 2; ++d) {
    std::vector<uint16_t> v;
    for (int64_t r = 0; r < l[size_t(d)].rows(); ++r)
      for (int h = 0; h < 8; ++h) v.push_back(float_to_bf16(float(10 * (d + 1) + r)));
    y.push_back(v);
  }
  // Rank 0's rows: shared token 0 (row 0 = 10), expert 0 of its token 0 (row 1 = 11), then
  // rank 1's token 0 if routed to expert 0/1. Rank 1's expert 2 row of rank 0 token 0.
  int64_t row2 = -1;
  for (int64_t r = 0; r < l[1].rows(); ++r)
    if (l[1].src_info[size_t(r)].rank == 0 && l[1].src_info[size_t(r)].slot == 1) row2 = r;
  ASSERT_GE(row2, 0);
  const float own = bf16_to_float(float_to_bf16(std::fma(1.0f, 10.0f, 0.5f * 11.0f)));
  const float other = bf16_to_float(float_to_bf16(0.25f * float(20 + row2)));
  EXPECT_EQ(combine_expert_side(p, l, y, 0)[0], own + other);
}
