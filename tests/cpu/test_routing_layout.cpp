// reference::routing_layout (the CPU model of epcomm/routing_layout.h): a worked example by hand
// (masked and out-of-range slots, a token with two experts on one rank, int32 and int64 ids, a
// row stride past top_k), a group of more than 64 ranks, a routing given as a rank mask, and the
// refusals; reference::received_topk by hand.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/reference.h"

namespace epcomm {
namespace {

struct Out {
  std::vector<int32_t> per_rank, per_expert, rank_ids;
  std::vector<char> in_rank;  // bool storage
  Out(int64_t T, int32_t R, int32_t E)
      : per_rank(size_t(R), 77),
        per_expert(size_t(E), 77),
        rank_ids(size_t(T * R), 77),
        in_rank(size_t(T * R), 2) {}
  void point(RoutingLayout& a) {
    a.tokens_per_rank = per_rank.data();
    a.tokens_per_expert = per_expert.data();
    a.rank_ids = rank_ids.data();
    a.token_in_rank = reinterpret_cast<bool*>(in_rank.data());
  }
};

template <class Id>
RoutingLayout layout_of(const std::vector<Id>& ids, int64_t stride, int64_t T, int32_t K, int32_t E,
                        int32_t R, Out& o) {
  RoutingLayout a;
  a.topk_ids = ids.data();
  a.id_bytes = int32_t(sizeof(Id));
  a.ids_stride = stride;
  a.num_tokens = T;
  a.top_k = K;
  a.num_experts = E;
  a.n_ranks = R;
  o.point(a);
  return a;
}

// 3 tokens, top-3 (stride 4: the fourth column is not read), 8 experts on 4 ranks (2 each).
// Token 0: experts 0, 1 (both rank 0) and 6 (rank 3). Token 1: a masked slot, 9 (out of range),
// 3 (rank 1). Token 2: every slot masked.
template <class Id>
void worked_example() {
  const std::vector<Id> ids = {0, 1, 6, 5, -1, 9, 3, 5, -1, -1, -1, 5};
  Out o(3, 4, 8);
  reference::routing_layout(layout_of(ids, 4, 3, 3, 8, 4, o));
  EXPECT_EQ(o.per_rank, (std::vector<int32_t>{1, 1, 0, 1}));
  EXPECT_EQ(o.per_expert, (std::vector<int32_t>{1, 1, 0, 1, 0, 0, 1, 0}));
  EXPECT_EQ(o.in_rank, (std::vector<char>{1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(o.rank_ids, (std::vector<int32_t>{0, -1, -1, 3, -1, 1, -1, -1, -1, -1, -1, -1}));
}

TEST(RoutingLayoutReference, WorkedExample) {
  worked_example<int64_t>();
  worked_example<int32_t>();
}

// 70 ranks, one expert each: a token's ranks span two 64-rank blocks in the kernel's masks.
TEST(RoutingLayoutReference, MoreThan64Ranks) {
  const std::vector<int32_t> ids = {3, 69, 64, 3};  // token 0: ranks 3, 69; token 1: 64, 3
  Out o(2, 70, 70);
  reference::routing_layout(layout_of(ids, 2, 2, 2, 70, 70, o));
  for (int32_t r = 0; r < 70; ++r) {
    const int want = r == 3 ? 2 : (r == 69 || r == 64) ? 1 : 0;
    EXPECT_EQ(o.per_rank[size_t(r)], want) << "rank " << r;
    EXPECT_EQ(o.per_expert[size_t(r)], want) << "expert " << r;
    EXPECT_EQ(o.rank_ids[size_t(r)], (r == 3 || r == 69) ? r : -1) << "token 0, rank " << r;
    EXPECT_EQ(o.rank_ids[size_t(70 + r)], (r == 3 || r == 64) ? r : -1) << "token 1, rank " << r;
  }
}

// Refused before anything is written; outputs may be left out one by one.
TEST(RoutingLayoutReference, RefusesBadArgumentsAndTakesAnyOutputs) {
  const std::vector<int64_t> ids = {0, 1};
  auto make = [&](Out& o) { return layout_of(ids, 2, 1, 2, 4, 2, o); };
  Out o(1, 2, 4);
  const auto refused = [&](RoutingLayout a) {
    EXPECT_THROW(reference::routing_layout(a), Error);
    EXPECT_EQ(o.per_rank, (std::vector<int32_t>{77, 77})) << "written before the refusal";
  };
  RoutingLayout a = make(o);
  a.id_bytes = 2;
  refused(a);
  a = make(o);
  a.num_experts = 5;
  refused(a);
  a = make(o);
  a.ids_stride = 1;
  refused(a);
  a = make(o);
  a.num_tokens = -1;
  refused(a);
  a = make(o);
  a.topk_ids = nullptr;
  refused(a);
  a = make(o);
  a.num_experts = 12288;
  refused(a);
  a = make(o);  // 2^31 slots: an expert's int32 count could overflow
  a.num_tokens = int64_t(1) << 21;
  a.top_k = a.ids_stride = 1024;
  refused(a);
  a = make(o);
  a.tokens_per_rank = nullptr;
  a.tokens_per_expert = nullptr;
  a.rank_ids = nullptr;
  a.token_in_rank = nullptr;
  refused(a);
  // One output alone.
  a.tokens_per_rank = o.per_rank.data();
  reference::routing_layout(a);
  EXPECT_EQ(o.per_rank, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(o.per_expert, (std::vector<int32_t>{77, 77, 77, 77})) << "an output not given";
  // No tokens: the counts are written as zero.
  a = make(o);
  a.num_tokens = 0;
  a.topk_ids = nullptr;
  reference::routing_layout(a);
  EXPECT_EQ(o.per_expert, (std::vector<int32_t>{0, 0, 0, 0}));
}

// A routing over ranks given as a mask (DeepEP's is_token_in_rank): rank ids and per-rank counts.
TEST(RoutingLayoutReference, TakesARankMask) {
  const int64_t T = 3;
  const int32_t R = 3;
  // Any byte other than 0 is true (a mask of another 1-byte type).
  const uint8_t mask[T * R] = {1, 0, 2, 0, 0, 0, 255, 1, 1};
  Out o(T, R, R);
  RoutingLayout a;
  a.rank_mask = reinterpret_cast<const bool*>(mask);
  a.top_k = 0;
  a.num_tokens = T;
  a.num_experts = a.n_ranks = R;
  a.tokens_per_rank = o.per_rank.data();
  a.rank_ids = o.rank_ids.data();
  reference::routing_layout(a);
  EXPECT_EQ(o.per_rank, (std::vector<int32_t>{2, 1, 2}));
  EXPECT_EQ(o.rank_ids, (std::vector<int32_t>{0, -1, 2, -1, -1, -1, 0, 1, 2}));
  // Refused: top-k ids too, experts other than the ranks, outputs a mask cannot give.
  const std::vector<int64_t> ids(T * 2, 0);
  RoutingLayout b = a;
  b.topk_ids = ids.data();
  b.top_k = b.ids_stride = 2;
  EXPECT_THROW(reference::routing_layout(b), Error);
  b = a;
  b.num_experts = 2 * R;
  EXPECT_THROW(reference::routing_layout(b), Error);
  b = a;
  b.tokens_per_expert = o.per_expert.data();
  EXPECT_THROW(reference::routing_layout(b), Error);
  b = a;
  b.token_in_rank = reinterpret_cast<bool*>(o.in_rank.data());
  EXPECT_THROW(reference::routing_layout(b), Error);
}

// Received rows of 40 bytes: 3 int64 ids at 0, 3 fp32 weights at 24, 4 bytes of padding. Rank 1 of
// 2, 8 experts each (first_expert 8). 5 rows, of which 4 arrived.
struct Received {
  static constexpr int32_t K = 3, kLocal = 8;
  static constexpr int64_t kRowBytes = 40, kRows = 5;
  std::vector<uint64_t> words = std::vector<uint64_t>(kRows * kRowBytes / 8, 0xdeadbeefdeadbeefull);
  std::vector<int64_t> ids = std::vector<int64_t>(kRows * K, 77);
  std::vector<float> weights = std::vector<float>(kRows * K, 77.f);
  std::vector<int32_t> counts = std::vector<int32_t>(1 + kLocal, 77);
  uint32_t num_rows = 4;
  Received(const std::vector<int64_t>& in_ids, const std::vector<float>& in_w) {
    char* base = reinterpret_cast<char*>(words.data());
    for (int64_t i = 0; i < kRows; ++i)
      for (int32_t k = 0; k < K; ++k) {
        std::memcpy(base + i * kRowBytes + 8 * k, &in_ids[size_t(i * K + k)], 8);
        std::memcpy(base + i * kRowBytes + 24 + 4 * k, &in_w[size_t(i * K + k)], 4);
      }
  }
  ReceivedTopk args() {
    ReceivedTopk a;
    const char* base = reinterpret_cast<const char*>(words.data());
    a.ids = reinterpret_cast<const int64_t*>(base);
    a.weights = reinterpret_cast<const float*>(base + 24);
    a.row_bytes = kRowBytes;
    a.max_rows = kRows;
    a.num_rows = &num_rows;
    a.top_k = K;
    a.first_expert = 8;
    a.n_local = kLocal;
    a.local_ids = ids.data();
    a.local_weights = weights.data();
    a.counts = counts.data();
    return a;
  }
};

TEST(RoutingLayoutReference, ReceivedTopkKeepsThisRanksExperts) {
  // Row 1's 2^32 + 9 would be this rank's expert 1 if truncated to int32; INT64_MIN must not
  // overflow the subtraction; row 4 did not arrive (its ids would count).
  const std::vector<int64_t> in_ids = {
      9, 3, -1, (int64_t(1) << 32) + 9, 15, 8, INT64_MIN, 16, 2, 10, -1, 11, 12, 13, 14};
  std::vector<float> in_w(in_ids.size());
  for (size_t i = 0; i < in_w.size(); ++i)
    in_w[i] = 0.5f + float(i);
  Received r(in_ids, in_w);
  reference::received_topk(r.args());
  EXPECT_EQ(r.ids, (std::vector<int64_t>{1, -1, -1, -1, 7, 0, -1, -1, -1, 2, -1, 3, -1, -1, -1}));
  for (size_t i = 0; i < r.ids.size(); ++i)
    EXPECT_EQ(r.weights[i], r.ids[i] >= 0 ? in_w[i] : 0.f) << "slot " << i;
  EXPECT_EQ(r.counts, (std::vector<int32_t>{4, 1, 1, 1, 1, 0, 0, 0, 1}));
  // A count past max_rows reads max_rows.
  r.num_rows = 9;
  reference::received_topk(r.args());
  EXPECT_EQ(r.counts[0], 5);
  EXPECT_EQ(r.ids[12], 4);
}

TEST(RoutingLayoutReference, ReceivedTopkRefusesBadArguments) {
  Received r(std::vector<int64_t>(15, 8), std::vector<float>(15, 1.f));
  // Each case changes one thing (two for the wrapping product) in otherwise good arguments.
  using Change = void (*)(ReceivedTopk&);
  const Change bad[] = {
      [](ReceivedTopk& a) { a.row_bytes = 20; },  // not a multiple of 8
      [](ReceivedTopk& a) { a.row_bytes = 16; },  // holds 2 ids, not 3
      [](ReceivedTopk& a) { a.n_local = 0; },
      [](ReceivedTopk& a) { a.first_expert = -8; },
      [](ReceivedTopk& a) { a.num_rows = nullptr; },
      [](ReceivedTopk& a) {
        a.ids = reinterpret_cast<const int64_t*>(reinterpret_cast<const char*>(a.ids) + 4);
      },
      [](ReceivedTopk& a) { a.max_rows = int64_t(1) << 30; },
      [](ReceivedTopk& a) {  // max_rows * top_k would wrap to 0
        a.max_rows = int64_t(1) << 61;
        a.top_k = 8;
        a.row_bytes = 64;
      },
      [](ReceivedTopk& a) { a.row_bytes = -40; },
      [](ReceivedTopk& a) { a.row_bytes = int64_t(1) << 32; },
  };
  for (size_t c = 0; c < sizeof(bad) / sizeof(bad[0]); ++c) {
    ReceivedTopk a = r.args();
    bad[c](a);
    EXPECT_THROW(reference::received_topk(a), Error) << "case " << c;
    EXPECT_EQ(r.counts, std::vector<int32_t>(1 + Received::kLocal, 77))
        << "written before, case " << c;
  }
}

}  // namespace
}  // namespace epcomm
