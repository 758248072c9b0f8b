// routing_layout (epcomm/routing_layout.h) on the GPU against reference::routing_layout: random
// top-k ids (masked and out-of-range slots among them), int32 and int64, a row stride past top_k,
// one block and many (a call past one block's tokens clears the counts and adds into them),
// more than 64 ranks, no tokens; every output poisoned first, compared element for element; the
// routing given as a rank mask. received_topk against reference::received_topk likewise. And bad
// arguments refused before anything is written. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/reference.h"
#include "harness.h"

namespace epcomm {
namespace {

using testing::DeviceBuffer;

struct Case {
  int64_t tokens;
  int32_t top_k, experts, ranks, extra_cols, id_bytes;
};

std::string name(const Case& c) {
  return "T " + std::to_string(c.tokens) + ", K " + std::to_string(c.top_k) + ", E " +
         std::to_string(c.experts) + ", R " + std::to_string(c.ranks) + ", int" +
         std::to_string(8 * c.id_bytes);
}

// outputs: which of the four the call is given (bit 0 tokens_per_rank, 1 tokens_per_expert,
// 2 rank_ids, 3 token_in_rank); the others must stay poisoned.
template <class Id>
void check_case(const Case& c, uint64_t seed, unsigned outputs = 15u) {
  std::mt19937_64 rng(seed);
  const int64_t stride = c.top_k + c.extra_cols;
  std::vector<Id> ids(size_t(std::max<int64_t>(1, c.tokens * stride)));
  // Mostly real experts; some slots masked (-1) and some out of range (ignored alike).
  std::uniform_int_distribution<int32_t> expert(0, c.experts - 1), pick(0, 19);
  for (auto& v : ids) {
    const int32_t p = pick(rng);
    v = Id(p == 0 ? -1 : p == 1 ? c.experts + p : expert(rng));
  }
  const int64_t cells = c.tokens * c.ranks;
  std::vector<int32_t> want_rank(static_cast<size_t>(c.ranks)),
      want_expert(static_cast<size_t>(c.experts)), want_ids(static_cast<size_t>(cells));
  std::vector<char> want_in(static_cast<size_t>(cells));
  RoutingLayout a;
  a.topk_ids = ids.data();
  a.id_bytes = int32_t(sizeof(Id));
  a.ids_stride = stride;
  a.num_tokens = c.tokens;
  a.top_k = c.top_k;
  a.num_experts = c.experts;
  a.n_ranks = c.ranks;
  a.tokens_per_rank = want_rank.data();
  a.tokens_per_expert = want_expert.data();
  a.rank_ids = want_ids.data();
  a.token_in_rank = reinterpret_cast<bool*>(want_in.data());
  reference::routing_layout(a);

  DeviceBuffer d_ids(0, ids.size() * sizeof(Id)), d_rank(0, want_rank.size() * 4),
      d_expert(0, want_expert.size() * 4), d_rank_ids(0, std::max<size_t>(4, want_ids.size() * 4)),
      d_in(0, std::max<size_t>(1, want_in.size()));
  d_ids.upload(ids.data(), ids.size() * sizeof(Id));
  for (DeviceBuffer* b : {&d_rank, &d_expert, &d_rank_ids, &d_in})
    b->fill(0x5a, nullptr);
  a.topk_ids = d_ids.get();
  a.tokens_per_rank = d_rank.get<int32_t>();
  a.tokens_per_expert = d_expert.get<int32_t>();
  a.rank_ids = d_rank_ids.get<int32_t>();
  a.token_in_rank = d_in.get<bool>();
  if (!(outputs & 1u)) a.tokens_per_rank = nullptr;
  if (!(outputs & 2u)) a.tokens_per_expert = nullptr;
  if (!(outputs & 4u)) a.rank_ids = nullptr;
  if (!(outputs & 8u)) a.token_in_rank = nullptr;
  routing_layout(a, nullptr);
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  std::vector<int32_t> got_rank(want_rank.size()), got_expert(want_expert.size()),
      got_ids(want_ids.size());
  std::vector<char> got_in(want_in.size());
  d_rank.download(got_rank.data(), got_rank.size() * 4);
  d_expert.download(got_expert.data(), got_expert.size() * 4);
  d_rank_ids.download(got_ids.data(), got_ids.size() * 4);
  d_in.download(got_in.data(), got_in.size());
  // An output not given keeps its poison (0x5a in every byte).
  const auto poisoned = [](size_t n, auto v) { return std::vector<decltype(v)>(n, v); };
  const int32_t p32 = 0x5a5a5a5a;
  EXPECT_EQ(got_rank, outputs & 1u ? want_rank : poisoned(want_rank.size(), p32)) << name(c);
  EXPECT_EQ(got_expert, outputs & 2u ? want_expert : poisoned(want_expert.size(), p32)) << name(c);
  EXPECT_EQ(got_ids, outputs & 4u ? want_ids : poisoned(want_ids.size(), p32)) << name(c);
  EXPECT_EQ(got_in, outputs & 8u ? want_in : poisoned(want_in.size(), char(0x5a))) << name(c);
}

TEST(RoutingLayout, MatchesTheReference) {
  EPCOMM_REQUIRE_GPU();
  const Case cases[] = {
      {4096, 8, 256, 8, 0, 8},    // DeepSeek-V3 prefill on 8 ranks: one block
      {4096, 8, 256, 8, 3, 4},    // int32 ids, a row stride past top_k
      {5, 8, 256, 1, 0, 8},       // few tokens, one rank
      {50000, 8, 256, 8, 0, 8},   // many blocks: counts cleared, then added into
      {20000, 4, 140, 70, 1, 4},  // more than 64 ranks
      {9000, 1, 12, 3, 0, 8},     // top-1
      {0, 8, 256, 8, 0, 8},       // no tokens: the counts written as zero
  };
  uint64_t seed = 300;
  for (const Case& c : cases) {
    if (c.id_bytes == 8)
      check_case<int64_t>(c, seed++);
    else
      check_case<int32_t>(c, seed++);
  }
  // Some outputs alone, one block and many (what the DeepEP layer asks for: no rank_ids).
  for (unsigned outputs : {2u, 11u, 4u}) {
    check_case<int64_t>(cases[0], seed++, outputs);
    check_case<int64_t>(cases[3], seed++, outputs);
  }
}

// A rank mask in (DeepEP's is_token_in_rank): rank ids and per-rank counts, one block and many.
TEST(RoutingLayout, RankMaskMatchesTheReference) {
  EPCOMM_REQUIRE_GPU();
  uint64_t seed = 400;
  for (const auto& [T, R] : {std::pair<int64_t, int32_t>{4096, 8},
                             {50000, 8},
                             {9000, 70},
                             {3, 1},
                             {100, 6144}}) {  // the last: E + R at the 12288 limit
    std::mt19937_64 rng(seed++);
    std::vector<char> mask(size_t(T * R));
    for (auto& m : mask)  // 0, 1 and 2: any byte other than 0 is true
      m = char(rng() % 3 == 0 ? 1 + rng() % 2 : 0);
    std::vector<int32_t> want_rank(static_cast<size_t>(R)), want_ids(static_cast<size_t>(T * R));
    RoutingLayout a;
    a.rank_mask = reinterpret_cast<const bool*>(mask.data());
    a.top_k = 0;
    a.num_tokens = T;
    a.num_experts = a.n_ranks = R;
    a.tokens_per_rank = want_rank.data();
    a.rank_ids = want_ids.data();
    reference::routing_layout(a);
    DeviceBuffer d_mask(0, mask.size()), d_rank(0, want_rank.size() * 4),
        d_ids(0, want_ids.size() * 4);
    d_mask.upload(mask.data(), mask.size());
    d_rank.fill(0x5a, nullptr);
    d_ids.fill(0x5a, nullptr);
    a.rank_mask = d_mask.get<bool>();
    a.tokens_per_rank = d_rank.get<int32_t>();
    a.rank_ids = d_ids.get<int32_t>();
    routing_layout(a, nullptr);
    EPCOMM_CUDA_OK(cudaDeviceSynchronize());
    std::vector<int32_t> got_rank(want_rank.size()), got_ids(want_ids.size());
    d_rank.download(got_rank.data(), got_rank.size() * 4);
    d_ids.download(got_ids.data(), got_ids.size() * 4);
    EXPECT_EQ(got_rank, want_rank) << "T " << T << ", R " << R;
    EXPECT_EQ(got_ids, want_ids) << "T " << T << ", R " << R;
  }
}

// received_topk on random received rows (ids of this rank's experts, of others', masked and past
// the int32 range; padding between the ids and the weights, as DeepEP's normal rows have the
// scales there), some rows not received; one block and many; outputs poisoned.
TEST(RoutingLayout, ReceivedTopkMatchesTheReference) {
  EPCOMM_REQUIRE_GPU();
  struct RCase {
    int64_t max_rows;
    uint32_t num_rows;
    int32_t top_k, n_local, rank;
  };
  uint64_t seed = 500;
  for (const RCase& c :
       {RCase{32768, 30000, 8, 32, 3}, RCase{256, 256, 8, 256, 0}, RCase{1000, 0, 4, 16, 1},
        RCase{5000, 7000, 1, 12, 2}, RCase{0, 0, 8, 32, 0},
        RCase{3000, 2500, 8, 12288, 1}}) {  // the last: 48 KB of counts
    std::mt19937_64 rng(seed++);
    const int64_t ids_bytes = 8 * c.top_k, pad = 56,
                  row_bytes = (ids_bytes + pad + 4 * c.top_k + 7) / 8 * 8;
    std::vector<char> rows(size_t(std::max<int64_t>(1, c.max_rows * row_bytes)));
    for (auto& b : rows)
      b = char(rng());
    const int64_t E = int64_t(c.n_local) * 8, first = int64_t(c.rank) * c.n_local;
    for (int64_t i = 0; i < c.max_rows; ++i)
      for (int32_t k = 0; k < c.top_k; ++k) {
        const uint64_t p = rng() % 20;
        const int64_t id = p == 0   ? -1
                           : p == 1 ? (int64_t(1) << 32) + first + 1
                                    : int64_t(rng() % E);
        const float w = float(rng() % 1000) / 7.f;
        std::memcpy(&rows[size_t(i * row_bytes + 8 * k)], &id, 8);
        std::memcpy(&rows[size_t(i * row_bytes + ids_bytes + pad + 4 * k)], &w, 4);
      }
    const size_t slots = size_t(c.max_rows * c.top_k);
    std::vector<int64_t> want_ids(slots);
    std::vector<float> want_w(slots);
    std::vector<int32_t> want_counts(size_t(1 + c.n_local));
    uint32_t num_rows = c.num_rows;
    ReceivedTopk a;
    a.ids = reinterpret_cast<const int64_t*>(rows.data());
    a.weights = reinterpret_cast<const float*>(rows.data() + ids_bytes + pad);
    a.row_bytes = row_bytes;
    a.max_rows = c.max_rows;
    a.num_rows = &num_rows;
    a.top_k = c.top_k;
    a.first_expert = first;
    a.n_local = c.n_local;
    a.local_ids = want_ids.data();
    a.local_weights = want_w.data();
    a.counts = want_counts.data();
    reference::received_topk(a);
    DeviceBuffer d_rows(0, rows.size()), d_n(0, 4), d_ids(0, std::max<size_t>(8, slots * 8)),
        d_w(0, std::max<size_t>(4, slots * 4)), d_counts(0, want_counts.size() * 4);
    d_rows.upload(rows.data(), rows.size());
    d_n.upload(&num_rows, 4);
    for (DeviceBuffer* b : {&d_ids, &d_w, &d_counts})
      b->fill(0x5a, nullptr);
    a.ids = d_rows.get<const int64_t>();
    a.weights = reinterpret_cast<const float*>(d_rows.get<char>() + ids_bytes + pad);
    a.num_rows = d_n.get<uint32_t>();
    a.local_ids = d_ids.get<int64_t>();
    a.local_weights = d_w.get<float>();
    a.counts = d_counts.get<int32_t>();
    received_topk(a, nullptr);
    EPCOMM_CUDA_OK(cudaDeviceSynchronize());
    std::vector<int64_t> got_ids(slots);
    std::vector<float> got_w(slots);
    std::vector<int32_t> got_counts(want_counts.size());
    d_ids.download(got_ids.data(), slots * 8);
    d_w.download(got_w.data(), slots * 4);
    d_counts.download(got_counts.data(), got_counts.size() * 4);
    const std::string what = "max_rows " + std::to_string(c.max_rows) + ", received " +
                             std::to_string(c.num_rows) + ", K " + std::to_string(c.top_k);
    EXPECT_EQ(got_ids, want_ids) << what;
    EXPECT_EQ(got_w, want_w) << what;  // exact: copied or zero
    EXPECT_EQ(got_counts, want_counts) << what;
    int64_t kept = 0;
    for (int64_t id : want_ids)
      kept += id >= 0;
    if (c.num_rows > 0 && c.max_rows > 0) EXPECT_GT(kept, 0) << what << ": nothing kept";
  }
}

TEST(RoutingLayout, RefusesBadArgumentsBeforeLaunching) {
  EPCOMM_REQUIRE_GPU();
  DeviceBuffer d_ids(0, 64), d_rank(0, 64);
  d_rank.fill(0x5a, nullptr);
  RoutingLayout a;
  a.topk_ids = d_ids.get();
  a.ids_stride = 2;
  a.num_tokens = 4;
  a.top_k = 2;
  a.num_experts = 6;
  a.n_ranks = 4;  // 6 experts do not split over 4 ranks
  a.tokens_per_rank = d_rank.get<int32_t>();
  EXPECT_THROW(routing_layout(a, nullptr), Error);
  a.n_ranks = 3;
  a.tokens_per_rank = reinterpret_cast<int32_t*>(d_rank.get<char>() + 2);
  EXPECT_THROW(routing_layout(a, nullptr), Error) << "a misaligned output";
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(64);
  d_rank.download(got.data(), got.size());
  for (uint8_t b : got)
    ASSERT_EQ(b, 0x5a) << "written before the refusal";
}

}  // namespace
}  // namespace epcomm
