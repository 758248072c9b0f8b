// reference::routing_layout (the CPU model of epcomm/routing_layout.h): a worked example by hand
// (masked and out-of-range slots, a token with two experts on one rank, int32 and int64 ids, a
// row stride past top_k), a group of more than 64 ranks, and the refusals.
#include <gtest/gtest.h>

#include <cstdint>
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

}  // namespace
}  // namespace epcomm
