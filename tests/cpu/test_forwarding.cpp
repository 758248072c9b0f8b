// Forwarding inside the node (epcomm/forwarding.h, docs/multinode.md "Forwarding inside the node
// (design)"): the relay plan for every declared split, the set-up decision, the size and layout of
// a forwarded message, the byte model (reference::cross_node_traffic) against a brute-force count
// and against docs/multinode.md's closed form, and the forwarded combine order of the reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "epcomm/bf16.h"
#include "epcomm/detail/window_layout.h"
#include "epcomm/forwarding.h"
#include "epcomm/reference.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::reference;

namespace {
// The splits the issue names, nodes x ranks per node.
const std::vector<std::pair<int32_t, int32_t>> kSplits = {{1, 4}, {2, 2}, {4, 1},
                                                          {2, 4}, {4, 2}, {4, 4}};

// What every rank puts to ranks of other nodes, counted the slow way from the definitions
// (docs/multinode.md): sets of destination ranks and nodes per token.
struct Count {
  int64_t direct_msgs = 0, fwd_msgs = 0, direct_rows = 0, fwd_rows = 0, slot_rows = 0,
          relay_copies = 0;
};
std::vector<Count> brute_force(const Problem& p, int32_t rpn) {
  std::vector<Count> c(size_t(p.n_ranks));
  const int32_t n_local = p.n_experts / p.n_ranks;
  for (int32_t s = 0; s < p.n_ranks; ++s) {
    const RankInput& in = p.ranks[size_t(s)];
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      std::set<int32_t> ranks;
      std::map<int32_t, std::set<int32_t>> by_node;  // other node -> its destination ranks
      for (int32_t k = 0; k < p.top_k; ++k) {
        const int32_t id = in.topk_ids[size_t(t * p.top_k + k)];
        if (id < 0) continue;
        const int32_t d = id / n_local;
        if (d / rpn == s / rpn) continue;
        ++c[size_t(d)].slot_rows;
        ranks.insert(d);
        by_node[d / rpn].insert(d);
      }
      c[size_t(s)].direct_msgs += int64_t(ranks.size());
      for (int32_t d : ranks)
        ++c[size_t(d)].direct_rows;
      c[size_t(s)].fwd_msgs += int64_t(by_node.size());
      for (const auto& [node, dests] : by_node) {
        const int32_t relay = node * rpn + s % rpn;  // the same local index as the sender
        ++c[size_t(relay)].fwd_rows;
        c[size_t(relay)].relay_copies += int64_t(dests.size()) - int64_t(dests.count(relay));
      }
    }
  }
  return c;
}

void expect_model_matches(const Problem& p, int32_t rpn, const char* what) {
  const CrossNodeSizes sz{1000, 1100, 300, 7, 5};
  const std::vector<CrossNodeTraffic> m = cross_node_traffic(p, rpn, sz);
  const std::vector<Count> b = brute_force(p, rpn);
  const int64_t remote = p.n_ranks - rpn, remote_nodes = p.n_ranks / rpn - 1;
  for (int32_t r = 0; r < p.n_ranks; ++r) {
    SCOPED_TRACE(std::string(what) + ", ranks_per_node " + std::to_string(rpn) + ", rank " +
                 std::to_string(r));
    const CrossNodeTraffic& x = m[size_t(r)];
    const Count& y = b[size_t(r)];
    EXPECT_EQ(x.direct.dispatch_messages, y.direct_msgs);
    EXPECT_EQ(x.forwarded.dispatch_messages, y.fwd_msgs);
    EXPECT_EQ(x.direct.combine_rows_expert_side, y.direct_rows);
    EXPECT_EQ(x.forwarded.combine_rows_expert_side, y.fwd_rows);
    EXPECT_EQ(x.direct.combine_rows_token_side, y.slot_rows);
    EXPECT_EQ(x.forwarded.combine_rows_token_side, y.slot_rows);
    EXPECT_EQ(x.relay_copies, y.relay_copies);
    EXPECT_EQ(x.direct.meta_records, remote);
    EXPECT_EQ(x.forwarded.meta_records, remote);
    EXPECT_EQ(x.direct.forward_records, 0);
    EXPECT_EQ(x.forwarded.forward_records, remote_nodes);
    EXPECT_EQ(x.direct.dispatch_bytes, y.direct_msgs * 1000 + remote * 7);
    EXPECT_EQ(x.forwarded.dispatch_bytes, y.fwd_msgs * 1100 + remote * 7 + remote_nodes * 5);
    EXPECT_EQ(x.direct.combine_bytes_expert_side, y.direct_rows * 300);
    EXPECT_EQ(x.forwarded.combine_bytes_expert_side, y.fwd_rows * 300);
    EXPECT_EQ(x.forwarded.combine_bytes_token_side, y.slot_rows * 300);
  }
}

// Expert outputs that are the dispatched tokens themselves (any bf16 rows would do).
std::vector<std::vector<uint16_t>> identity_outputs(const std::vector<DispatchResult>& l) {
  std::vector<std::vector<uint16_t>> y;
  for (const DispatchResult& d : l)
    y.push_back(d.tokens);
  return y;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return false;
  return true;
}
}  // namespace

TEST(Forwarding, RelayHasTheSendersLocalIndexInEverySplit) {
  for (const auto& [nodes, rpn] : kSplits) {
    SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(rpn));
    const int32_t R = nodes * rpn;
    const ForwardPlan plan = ForwardPlan::make(R, rpn);
    EXPECT_EQ(plan.n_nodes(), nodes);
    EXPECT_EQ(plan.relayed_sources(), nodes - 1);
    std::vector<int32_t> relayed(size_t(R), 0);
    for (int32_t s = 0; s < R; ++s) {
      for (int32_t n = 0; n < nodes; ++n) {
        const int32_t relay = plan.relay(s, n);
        EXPECT_EQ(relay / rpn, n);
        EXPECT_EQ(relay % rpn, s % rpn);
        for (int32_t d = n * rpn; d < (n + 1) * rpn; ++d)
          EXPECT_EQ(plan.relay_for(s, d), relay);
        if (n == s / rpn) {
          EXPECT_EQ(relay, s);  // its own node: no relay
        } else {
          ++relayed[size_t(relay)];
          const int32_t i = plan.relayed_index(relay, s);
          ASSERT_GE(i, 0);
          ASSERT_LT(i, nodes - 1);
          EXPECT_EQ(plan.relayed_source(relay, i), s);
        }
      }
    }
    // Balance: every rank relays for one sender of each other node.
    for (int32_t r = 0; r < R; ++r)
      EXPECT_EQ(relayed[size_t(r)], nodes - 1) << r;
    // relayed_source lists other nodes in node order, never r's own.
    for (int32_t r = 0; r < R; ++r)
      for (int32_t i = 0; i + 1 < nodes - 1; ++i)
        EXPECT_LT(plan.relayed_source(r, i), plan.relayed_source(r, i + 1));
  }
}

TEST(Forwarding, ForwardedMessageKeepsThePayloadAndGrowsTheHeader) {
  // Prefill and decode of docs/multinode.md: bf16 and blockwise FP8, hidden 7168, top-8.
  const detail::MessageLayout bf16{7168, 8, TokenFormat::kBF16};
  const detail::MessageLayout fp8{7168, 8, TokenFormat::kFp8Blockwise};
  EXPECT_EQ(bf16.bytes(), 14464);
  EXPECT_EQ(fp8.bytes(), 7552);
  // 8 + 8 per destination + 12 per entry: 8 + 16 + 96 = 120 fits one line at 2 ranks per node,
  // 8 + 64 + 96 = 168 needs two at 8.
  EXPECT_EQ(detail::forward_header_bytes(8, 2), 128);
  EXPECT_EQ(detail::forward_header_bytes(8, 8), 256);
  EXPECT_EQ(detail::forward_header_bytes(8, 64), 256);  // at most top_k destinations
  EXPECT_EQ(detail::forward_header_bytes(1, 8), 128);
  EXPECT_EQ(detail::forward_message_bytes(bf16, 2), bf16.bytes());
  EXPECT_EQ(detail::forward_message_bytes(bf16, 8), bf16.bytes() + 128);
  EXPECT_EQ(detail::forward_message_bytes(fp8, 8), fp8.bytes() + 128);
  for (TokenFormat f : {TokenFormat::kBF16, TokenFormat::kFp8Blockwise, TokenFormat::kNvfp4,
                        TokenFormat::kMxfp8, TokenFormat::kMxfp4}) {
    for (int32_t k : {1, 4, 8, 16}) {
      for (int32_t rpn : {1, 2, 4, 8}) {
        const detail::MessageLayout m{1024, k, f};
        const int64_t fh = detail::forward_header_bytes(k, rpn);
        EXPECT_EQ(fh % detail::MessageLayout::kAlign, 0);
        EXPECT_GE(fh, 8 + 8 * std::min(k, rpn) + 12 * k);
        EXPECT_GE(fh, m.header_bytes());  // a forwarded header holds a direct one's entries
        EXPECT_EQ(detail::forward_message_bytes(m, rpn) - fh, m.bytes() - m.header_bytes())
            << "the payload is the direct message's, byte for byte";
      }
    }
  }
}

TEST(Forwarding, ReachProbabilityMatchesTheDocsTable) {
  // docs/multinode.md "Where a token goes": top-8 of 256.
  EXPECT_NEAR(reach_probability(256, 8, 8), 0.662, 5e-4);
  EXPECT_NEAR(reach_probability(256, 8, 16), 0.408, 5e-4);
  EXPECT_NEAR(reach_probability(256, 8, 32), 0.227, 5e-4);
  EXPECT_NEAR(reach_probability(256, 8, 64), 0.120, 5e-4);
  EXPECT_DOUBLE_EQ(reach_probability(8, 2, 4), 1.0 - 15.0 / 28.0);  // 1 - C(6,2)/C(8,2)
  EXPECT_DOUBLE_EQ(reach_probability(256, 8, 1), 1.0);
  EXPECT_DOUBLE_EQ(reach_probability(256, 1, 16), 1.0 / 16);
}

TEST(Forwarding, DecisionForwardsOnlyWhereATokenMeetsSeveralRanksOfANode) {
  auto decide = [](int32_t nodes, int32_t rpn, int32_t experts, int32_t k, bool skip = false) {
    return decide_forwarding(ForwardShape{nodes * rpn, rpn, experts, k, skip});
  };
  // docs/multinode.md's per-node saving: 3.3x at EP16, 2.0x at EP32, 1.45x at EP64.
  const ForwardDecision ep16 = decide(2, 8, 256, 8), ep32 = decide(4, 8, 256, 8),
                        ep64 = decide(8, 8, 256, 8);
  EXPECT_EQ(ep16.route, CrossNodeRoute::kForward);
  EXPECT_EQ(ep32.route, CrossNodeRoute::kForward);
  EXPECT_EQ(ep64.route, CrossNodeRoute::kForward);
  EXPECT_NEAR(ep16.expected_saving, 3.26 / 1.00, 0.02);
  EXPECT_NEAR(ep32.expected_saving, 5.45 / 2.71, 0.02);
  EXPECT_NEAR(ep64.expected_saving, 6.72 / 4.63, 0.02);
  EXPECT_NE(ep16.reason.find("forward"), std::string::npos) << ep16.reason;
  // The line docs/multinode.md quotes.
  EXPECT_EQ(ep16.reason,
            "forward: 2 nodes x 8 ranks, top-8 of 256 experts: a token meets 3.27 ranks of each "
            "other node it reaches (uniform routing), so one copy per node cuts network copies "
            "3.27x");
  // The declared splits with top-8 of 64 experts: forwarding wherever a node has two ranks or
  // more and there are two nodes or more.
  for (const auto& [nodes, rpn] : kSplits) {
    const ForwardDecision d = decide(nodes, rpn, 64, 8);
    SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(rpn) + ": " + d.reason);
    const bool pays = nodes > 1 && rpn > 1;
    EXPECT_EQ(d.route, pays ? CrossNodeRoute::kForward : CrossNodeRoute::kDirect);
    EXPECT_EQ(d.reason.rfind(pays ? "forward" : "direct", 0), 0u);
    if (nodes > 1) {
      EXPECT_GE(d.expected_saving, 1.0);
    }
  }
  // Where forwarding cannot pay: one node, one rank per node, top-1, skip_a2a.
  EXPECT_EQ(decide(1, 8, 256, 8).reason, "direct: the group is one node");
  EXPECT_DOUBLE_EQ(decide(8, 1, 256, 8).expected_saving, 1.0);
  EXPECT_EQ(decide(8, 1, 256, 8).route, CrossNodeRoute::kDirect);
  EXPECT_NEAR(decide(2, 8, 256, 1).expected_saving, 1.0, 1e-12);
  EXPECT_EQ(decide(2, 8, 256, 1).route, CrossNodeRoute::kDirect);
  EXPECT_EQ(decide(2, 8, 256, 8, true).route, CrossNodeRoute::kDirect);
  EXPECT_NE(decide(2, 8, 256, 1).reason.find("below"), std::string::npos);
  EXPECT_STREQ(cross_node_route_name(CrossNodeRoute::kForward), "forward");
  EXPECT_STREQ(cross_node_route_name(CrossNodeRoute::kDirect), "direct");
  // Shapes no group has.
  EXPECT_THROW(decide_forwarding(ForwardShape{8, 3, 64, 8, false}), Error);
  EXPECT_THROW(decide_forwarding(ForwardShape{8, 4, 60, 8, false}), Error);
  EXPECT_THROW(decide_forwarding(ForwardShape{8, 4, 64, 0, false}), Error);
  EXPECT_THROW(decide_forwarding(ForwardShape{8, 4, 64, 65, false}), Error);
}

TEST(Forwarding, ByteModelMatchesABruteForceCountOnRandomRoutings) {
  for (const auto& [nodes, rpn] : kSplits) {
    const int32_t R = nodes * rpn;
    std::vector<int32_t> tokens;
    for (int32_t r = 0; r < R; ++r)
      tokens.push_back(37 + 11 * r);
    EXPECT_NO_FATAL_FAILURE(
        expect_model_matches(make_problem(R, 8, 8, 64, tokens, 3), rpn, "uniform"));
    EXPECT_NO_FATAL_FAILURE(
        expect_model_matches(make_problem(R, 8, 4, 16, tokens, 4, 0.0, 0.3), rpn, "masked"));
    EXPECT_NO_FATAL_FAILURE(
        expect_model_matches(make_problem(R, 8, 6, 32, tokens, 5, 1.5), rpn, "zipf 1.5"));
    Problem shared = make_problem(R, 8, 3, 8 * R, tokens, 6);
    shared.shared_expert = true;  // its row stays home: not counted
    EXPECT_NO_FATAL_FAILURE(expect_model_matches(shared, rpn, "shared expert"));
  }
}

// The forwarded streams (reference::forward_streams), the oracle of the sender's ranking by node:
// by hand on 2 nodes x 2 ranks, then on random routings of every split against their definition
// and against the byte model's forwarded message count.
TEST(Forwarding, ForwardStreamsByHand) {
  // 4 ranks of 2 experts each (8 experts), top-2, 20 tokens on rank 0 (chunks of 16: 0-15,
  // 16-19). Node 1 is ranks 2 and 3 (experts 4-7). Tokens 1, 2, 17 and 19 reach node 1 (token 2
  // at both of its ranks: one message still).
  Problem p = make_problem(4, 8, 2, 8, {20, 0, 0, 0}, 1);
  std::vector<int32_t>& ids = p.ranks[0].topk_ids;
  for (int32_t t = 0; t < 20; ++t) {
    ids[size_t(2 * t)] = 0;
    ids[size_t(2 * t + 1)] = t % 2 == 0 ? 2 : -1;  // node 0 only
  }
  ids[2 * 1 + 1] = 5;
  ids[2 * 2] = 4;
  ids[2 * 2 + 1] = 7;
  ids[2 * 17 + 1] = 6;
  ids[2 * 19] = 1;
  ids[2 * 19 + 1] = 4;
  const std::vector<reference::ForwardStream> f = reference::forward_streams(p, 0, 2);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].node, 1);
  EXPECT_EQ(f[0].relay, 2);  // rank 0's local index in node 1
  std::vector<int32_t> want(20, -1);
  want[1] = 0;
  want[2] = 1;
  want[17] = 2;
  want[19] = 3;
  EXPECT_EQ(f[0].slot, want);
  EXPECT_EQ(f[0].chunk_start, (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(f[0].count(), 4);
  // Rank 3 (node 1, local 1) has no tokens: one empty stream to node 0's relay, rank 1.
  const std::vector<reference::ForwardStream> g = reference::forward_streams(p, 3, 2);
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].relay, 1);
  EXPECT_EQ(g[0].chunk_start, (std::vector<int32_t>{0}));
  // A refused routing forwards nothing; a split that does not divide the group is refused.
  ids[1] = ids[0];
  EXPECT_EQ(reference::forward_streams(p, 0, 2)[0].count(), 0);
  EXPECT_THROW(reference::forward_streams(p, 0, 3), Error);
  EXPECT_THROW(reference::forward_streams(p, 4, 2), Error);
}

TEST(Forwarding, ForwardStreamsMatchTheirDefinitionAndTheByteModel) {
  for (const auto& [nodes, rpn] : kSplits) {
    SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(rpn));
    const int32_t R = nodes * rpn;
    std::vector<int32_t> tokens(static_cast<size_t>(R));
    for (int32_t r = 0; r < R; ++r)
      tokens[size_t(r)] = 37 + 29 * r;  // partial last chunks
    const Problem p = make_problem(R, 8, 4, 8 * R, tokens, 21, 0.0, 0.2);
    const std::vector<CrossNodeTraffic> m = cross_node_traffic(p, rpn, CrossNodeSizes{});
    for (int32_t s = 0; s < R; ++s) {
      const std::vector<reference::ForwardStream> f = reference::forward_streams(p, s, rpn);
      ASSERT_EQ(int32_t(f.size()), nodes - 1);
      int64_t messages = 0;
      for (const reference::ForwardStream& st : f) {
        EXPECT_NE(st.node, s / rpn);
        EXPECT_EQ(st.relay, st.node * rpn + s % rpn);
        int32_t n = 0;
        for (int32_t t = 0; t < tokens[size_t(s)]; ++t) {
          if (t % detail::kChunkTokens == 0) {
            EXPECT_EQ(st.chunk_start[size_t(t / detail::kChunkTokens)], n) << "token " << t;
          }
          const uint64_t dest = reference::destination_ranks(p, s, t);
          const bool reaches = ((dest >> (st.node * rpn)) & ((uint64_t(1) << rpn) - 1)) != 0;
          EXPECT_EQ(st.slot[size_t(t)], reaches ? n : -1) << "token " << t;
          n += reaches;
        }
        EXPECT_EQ(st.count(), n);
        EXPECT_EQ(int32_t(st.chunk_start.size()), detail::num_chunks(tokens[size_t(s)]) + 1);
        messages += n;
      }
      EXPECT_EQ(messages, m[size_t(s)].forwarded.dispatch_messages) << "sender " << s;
      if (nodes > 1) {
        EXPECT_GT(messages, 0) << "sender " << s << " forwards nothing";
      }
    }
  }
}

TEST(Forwarding, ByteModelOnAHotNode) {
  // 2 nodes x 4 ranks, 32 experts (4 per rank): every token of every rank picks 8 of node 1's
  // 16 experts, spread over its 4 ranks. Direct: node 0's tokens cross 4 times each (one per
  // rank of node 1); forwarded: once, to the relay with the sender's local index, which forwards
  // 3 copies over NVLink. Node 1's tokens cross nothing.
  Problem p = make_problem(8, 8, 8, 32, {5, 5, 5, 5, 5, 5, 5, 5}, 9);
  for (RankInput& in : p.ranks)
    for (int32_t t = 0; t < in.num_tokens; ++t)
      for (int32_t k = 0; k < 8; ++k)
        in.topk_ids[size_t(t * 8 + k)] = 16 + (k % 4) * 4 + (k / 4 + t) % 4;  // rank 4 + k % 4
  const std::vector<CrossNodeTraffic> m = cross_node_traffic(p, 4, CrossNodeSizes{10, 20, 3, 0});
  for (int32_t r = 0; r < 8; ++r) {
    SCOPED_TRACE(r);
    const bool node0 = r < 4;
    EXPECT_EQ(m[size_t(r)].direct.dispatch_messages, node0 ? 5 * 4 : 0);
    EXPECT_EQ(m[size_t(r)].forwarded.dispatch_messages, node0 ? 5 : 0);
    EXPECT_EQ(m[size_t(r)].forwarded.dispatch_bytes, node0 ? 5 * 20 : 0);
    // Node 1's rank r: direct, a row back for every token of node 0 (4 senders x 5);
    // forwarded, the relay of sender r - 4 only, one row per token, after 3 NVLink copies each.
    EXPECT_EQ(m[size_t(r)].direct.combine_rows_expert_side, node0 ? 0 : 20);
    EXPECT_EQ(m[size_t(r)].forwarded.combine_rows_expert_side, node0 ? 0 : 5);
    EXPECT_EQ(m[size_t(r)].relay_copies, node0 ? 0 : 5 * 3);
    EXPECT_EQ(m[size_t(r)].direct.combine_rows_token_side, node0 ? 0 : 4 * 5 * 2);
  }
  EXPECT_NO_FATAL_FAILURE(expect_model_matches(p, 4, "hot node"));
  // A rank whose ids the device refuses sends nothing, but its meta records still go out.
  p.ranks[0].topk_ids[1] = p.ranks[0].topk_ids[0];
  const std::vector<CrossNodeTraffic> refused = cross_node_traffic(p, 4, CrossNodeSizes{});
  EXPECT_EQ(refused[0].direct.dispatch_messages, 0);
  EXPECT_EQ(refused[0].forwarded.dispatch_messages, 0);
  EXPECT_EQ(refused[0].direct.meta_records, 4);
  EXPECT_EQ(refused[0].forwarded.forward_records, 1);  // the relay still learns the count
  EXPECT_EQ(refused[4].forwarded.combine_rows_expert_side, 0);
  // skip_a2a moves nothing; a split that does not divide the group is refused.
  Problem skip = make_replicated_problem(8, 8, 8, 32, 5, 10);
  skip.skip_a2a = true;
  for (const CrossNodeTraffic& c : cross_node_traffic(skip, 4, CrossNodeSizes{1, 1, 1, 1})) {
    EXPECT_EQ(c.direct.dispatch_bytes, 0);
    EXPECT_EQ(c.forwarded.dispatch_bytes, 0);
    EXPECT_EQ(c.direct.combine_rows_token_side, 0);
  }
  EXPECT_THROW(cross_node_traffic(p, 3, CrossNodeSizes{}), Error);
}

TEST(Forwarding, ByteModelMatchesTheClosedFormOnLargeUniformRoutings) {
  // docs/multinode.md: top-8 of 256, nodes of 8. Per token, on average: remote destination
  // ranks (R - 8) p(R), remote nodes (N - 1) p(N), remote top-k slots 8 (R - 8) / R. The mean
  // over n tokens must lie within 5 standard errors (from the sample) of the closed form.
  for (const int32_t R : {16, 32, 64}) {
    SCOPED_TRACE("EP" + std::to_string(R));
    const int32_t N = R / 8, per_rank = 8192 / R;
    const Problem p =
        make_problem(R, 8, 8, 256, std::vector<int32_t>(size_t(R), per_rank), uint64_t(100 + R));
    const int64_t n = int64_t(R) * per_rank;
    const double want_direct = (R - 8) * reach_probability(256, 8, R);
    const double want_nodes = (N - 1) * reach_probability(256, 8, N);
    const double want_slots = 8.0 * (R - 8) / R;
    // Per-token samples for the standard errors, from the brute force's definitions.
    double s_d = 0, s2_d = 0, s_n = 0, s2_n = 0;
    for (int32_t s = 0; s < R; ++s) {
      for (int32_t t = 0; t < per_rank; ++t) {
        std::set<int32_t> ranks, nodes;
        for (int32_t k = 0; k < 8; ++k) {
          const int32_t d = p.ranks[size_t(s)].topk_ids[size_t(t * 8 + k)] / (256 / R);
          if (d / 8 != s / 8) ranks.insert(d), nodes.insert(d / 8);
        }
        s_d += double(ranks.size()), s2_d += double(ranks.size() * ranks.size());
        s_n += double(nodes.size()), s2_n += double(nodes.size() * nodes.size());
      }
    }
    const double se_d = std::sqrt((s2_d / n - (s_d / n) * (s_d / n)) / n);
    const double se_n = std::sqrt((s2_n / n - (s_n / n) * (s_n / n)) / n);
    int64_t direct = 0, fwd = 0, rows_d = 0, rows_f = 0, slots = 0;
    for (const CrossNodeTraffic& c : cross_node_traffic(p, 8, CrossNodeSizes{})) {
      direct += c.direct.dispatch_messages;
      fwd += c.forwarded.dispatch_messages;
      rows_d += c.direct.combine_rows_expert_side;
      rows_f += c.forwarded.combine_rows_expert_side;
      slots += c.direct.combine_rows_token_side;
    }
    EXPECT_DOUBLE_EQ(double(direct), s_d);  // the model and the sample count alike
    EXPECT_DOUBLE_EQ(double(fwd), s_n);
    EXPECT_EQ(rows_d, direct);  // by symmetry, a row back per message
    EXPECT_EQ(rows_f, fwd);
    EXPECT_NEAR(double(direct) / n, want_direct, 5 * se_d);
    EXPECT_NEAR(double(fwd) / n, want_nodes, 5 * se_n + 1e-12);
    EXPECT_NEAR(double(slots) / n, want_slots, 0.05);  // remote slots: binomial-like, small SE
    // The table's rounded figures: 3.26 -> 1.00, 5.45 -> 2.71, 6.72 -> 4.63.
    const std::map<int32_t, std::pair<double, double>> table = {
        {16, {3.26, 1.00}}, {32, {5.45, 2.71}}, {64, {6.72, 4.63}}};
    EXPECT_NEAR(want_direct, table.at(R).first, 0.005);
    EXPECT_NEAR(want_nodes, table.at(R).second, 0.005);
  }
}

TEST(Forwarding, SizesAreTheWindowsOwn) {
  const Problem p = make_problem(16, 7168, 8, 256, std::vector<int32_t>(16, 1), 1);
  for (bool ll : {false, true}) {
    SCOPED_TRACE(ll ? "low-latency path" : "throughput path");
    const CrossNodeSizes bf16 = cross_node_sizes(p, TokenFormat::kBF16, 4096, 8, ll);
    EXPECT_EQ(bf16.message, 14464);  // 128-byte header + 2 H: no padding on either path
    EXPECT_EQ(bf16.forward_message, 14592);
    EXPECT_EQ(bf16.combine_row, 14336);
    // A meta record's put carries the record less its 8-byte seq word, which goes as the put's
    // signal (signal words are not data).
    EXPECT_EQ(bf16.meta_record, (detail::MetaLayout{16, detail::num_chunks(4096), 16}.bytes()) - 8);
    // A forward record: seq, count, chunks, then 257 chunk starts; its put is all but the seq.
    EXPECT_EQ(bf16.forward_record, align_up(16 + 4 * (detail::num_chunks(4096) + 1), 16) - 8);
  }
  // FP8: the throughput path puts the whole message (header 128 + codes 7168 + scales 224,
  // padded to 128 bytes); the low-latency path puts the header and each part's codes and
  // scales, without the padding.
  EXPECT_EQ(cross_node_sizes(p, TokenFormat::kFp8Blockwise, 128, 8, false).message, 7552);
  EXPECT_EQ(cross_node_sizes(p, TokenFormat::kFp8Blockwise, 128, 8, true).message, 7520);
  EXPECT_EQ(cross_node_sizes(p, TokenFormat::kFp8Blockwise, 128, 8, false).forward_message, 7680);
}

// The low-latency path's puts of one message (ll_send.cuh put_part: the header with part 0,
// then each part's codes and scales) add up to MessageLayout::put_bytes(true), for every format
// and hiddens that end a part early.
TEST(Forwarding, LowLatencyPutsAddUp) {
  for (int32_t f = 0; f < kNumTokenFormats; ++f) {
    const TokenFormat format = TokenFormat(f);
    for (int32_t hidden : {2048, 2880, 7168}) {
      if (hidden % format_hidden_multiple(format)) continue;
      SCOPED_TRACE(std::string(token_format_name(format)) + ", H = " + std::to_string(hidden));
      const detail::MessageLayout ml{hidden, 8, format};
      int64_t sum = ml.header_bytes();
      for (int32_t part = 0; part < detail::num_parts(hidden); ++part)
        sum += ml.part_codes_bytes(part) + ml.part_scales_bytes(part);
      EXPECT_EQ(ml.put_bytes(true), sum);
      EXPECT_EQ(ml.put_bytes(false), ml.bytes());
      EXPECT_LE(ml.put_bytes(true), ml.bytes());
    }
  }
}

// The forwarded combine order, by hand: 4 ranks as 2 nodes of 2, one expert per rank; rank 0's
// one token goes to experts 0, 2, 3 with weight 1, whose rows are 2^-8, 1 and 2^-9. Direct:
// ((0 + 2^-8) + 1) + 2^-9 = 1 + 3 * 2^-9 in fp32, bf16 1 + 2^-7. Forwarded: node 1's relay sums
// 1 + 2^-9 and rounds it to bf16, 1 (2^-9 is under half a bf16 ulp); then 2^-8 + 1, a tie in
// bf16 that rounds to even, 1. The node's partial sum changes the output.
TEST(Forwarding, ForwardedCombineOrderDiffersFromTheDirectOneByHand) {
  Problem p = make_problem(4, 8, 3, 4, {1, 0, 0, 0}, 2);
  p.ranks[0].topk_ids = {0, 2, 3};
  p.ranks[0].weights = {1.0f, 1.0f, 1.0f};
  const std::vector<DispatchResult> l = epcomm::testing::reference_dispatch_all(p);
  const float value[4] = {std::ldexp(1.0f, -8), 0.0f, 1.0f, std::ldexp(1.0f, -9)};
  std::vector<std::vector<uint16_t>> y(4);
  for (int32_t d = 0; d < 4; ++d)
    y[size_t(d)].assign(size_t(l[size_t(d)].rows() * 8), float_to_bf16(value[d]));
  const std::vector<float> direct = combine_expert_side(p, l, y, 0);
  const std::vector<float> fwd = combine_expert_side(p, l, y, 0, 2);
  ASSERT_EQ(direct.size(), 8u);
  ASSERT_EQ(fwd.size(), 8u);
  for (int h = 0; h < 8; ++h) {
    EXPECT_EQ(direct[size_t(h)], 1.0f + 3 * std::ldexp(1.0f, -9));
    EXPECT_EQ(fwd[size_t(h)], 1.0f + std::ldexp(1.0f, -8));
    EXPECT_EQ(bf16_to_float(float_to_bf16(direct[size_t(h)])), 1.0f + std::ldexp(1.0f, -7));
    EXPECT_EQ(bf16_to_float(float_to_bf16(fwd[size_t(h)])), 1.0f);
  }
  // Seen from rank 2 (node 1), rank 0's token is not its own: nothing to combine there.
  EXPECT_TRUE(combine_expert_side(p, l, y, 2, 2).empty());
  EXPECT_THROW(combine_expert_side(p, l, y, 0, 3), Error);
  EXPECT_THROW(combine_expert_side(p, l, y, 0, -1), Error);
}

TEST(Forwarding, ForwardedCombineOrderIsTheDirectOneWhereNothingIsForwarded) {
  // One node, one rank per node, or every token meeting at most one rank of each other node:
  // the forwarded order is the direct one, bit for bit.
  Problem p = make_problem(8, 64, 4, 32, {9, 7, 8, 5, 6, 9, 3, 8}, 21, 0.0, 0.2);
  p.shared_expert = true;
  const std::vector<DispatchResult> l = epcomm::testing::reference_dispatch_all(p);
  const auto y = identity_outputs(l);
  for (int32_t r = 0; r < 8; ++r) {
    const std::vector<float> direct = combine_expert_side(p, l, y, r);
    EXPECT_TRUE(same_bits(combine_expert_side(p, l, y, r, 8), direct)) << r;
    EXPECT_TRUE(same_bits(combine_expert_side(p, l, y, r, 1), direct)) << r;
  }
  // 4 nodes of 2 ranks, 8 experts per rank; every token picks at most one expert of each other
  // node's ranks, by construction.
  Problem q = make_problem(8, 64, 4, 64, {6, 6, 6, 6, 6, 6, 6, 6}, 22);
  for (int32_t s = 0; s < 8; ++s)
    for (int32_t t = 0; t < 6; ++t)
      for (int32_t k = 0; k < 4; ++k)  // node k, rank (t + s) % 2 of it, expert t
        q.ranks[size_t(s)].topk_ids[size_t(t * 4 + k)] = (2 * k + (t + s) % 2) * 8 + t;
  const std::vector<DispatchResult> lq = epcomm::testing::reference_dispatch_all(q);
  const auto yq = identity_outputs(lq);
  for (int32_t r = 0; r < 8; ++r)
    EXPECT_TRUE(same_bits(combine_expert_side(q, lq, yq, r, 2), combine_expert_side(q, lq, yq, r)))
        << r;
}

// The node's extra bf16 rounding costs accuracy like the direct path's per-rank rounding does:
// both within the bf16 norm bound of the float64 reference (2^-8 of ||ref||; element by element
// the extra rounding can exceed compare_combine_bf16's per-element bound under cancellation,
// and so can the direct order's).
TEST(Forwarding, ForwardedCombineOrderStaysWithinTheReferenceTolerance) {
  for (const auto& [nodes, rpn] : kSplits) {
    SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(rpn));
    const int32_t R = nodes * rpn;
    Problem p =
        make_problem(R, 128, 8, 64, std::vector<int32_t>(size_t(R), 24), uint64_t(30 + R + nodes));
    const std::vector<DispatchResult> l = epcomm::testing::reference_dispatch_all(p);
    const auto y = identity_outputs(l);
    for (int32_t r = 0; r < R; ++r) {
      const std::vector<double> ref = combine(p, l, y, r, true);
      for (int32_t order : {0, rpn}) {
        const std::vector<float> got = combine_expert_side(p, l, y, r, order);
        std::vector<float> out(got.size());
        for (size_t i = 0; i < got.size(); ++i)
          out[i] = bf16_to_float(float_to_bf16(got[i]));
        EXPECT_EQ(compare_combine_f32(ref, out.data(), int64_t(out.size()), std::ldexp(1.0, -8)),
                  "")
            << "rank " << r << (order ? ", forwarded order" : ", direct order");
      }
    }
  }
}

// The forwarded header: for random routings on every declared split (and 2 x 8, 8 x 8), top-1 to
// top-16, with and without weights, the relay's rebuild of each
// destination's header from the sender's forwarded header is byte for byte the header the direct
// path writes to that rank (modelled here as send_token writes it: token, the entries of the
// token's slots on that rank in slot order, rank_slot_of among all its ranks), the destinations'
// records name their local rank and stream index, and everything fits forward_header_bytes.
TEST(Forwarding, RelayRebuildsTheDirectHeaders) {
  std::mt19937 rng(7);
  // The declared splits, and 8 ranks a node (2 x 8) and 64 ranks (8 x 8: the mask's high bits).
  std::vector<std::pair<int32_t, int32_t>> splits = kSplits;
  splits.insert(splits.end(), {{2, 8}, {8, 8}});
  for (const auto& [nodes, rpn] : splits) {
    for (int32_t K : {1, 2, 4, 8, 16}) {
      const int32_t R = nodes * rpn, E = 8 * R;
      if (K > E) continue;
      SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(rpn) + " top-" + std::to_string(K));
      const ExpertMap em{E, R};
      const detail::NodeMap nm{R, rpn};
      const detail::ForwardHeaderLayout fl{K, rpn};
      const detail::MessageLayout ml{64, K, TokenFormat::kBF16};
      for (int trial = 0; trial < 200; ++trial) {
        // K distinct experts, some slots masked; positions and weights at random.
        const size_t nk = static_cast<size_t>(K);
        std::vector<int32_t> ids(nk), pos(nk), all(static_cast<size_t>(E));
        std::vector<float> w(nk);
        for (int32_t e = 0; e < E; ++e)
          all[size_t(e)] = e;
        std::shuffle(all.begin(), all.end(), rng);
        for (int32_t k = 0; k < K; ++k) {
          ids[size_t(k)] = rng() % 5 == 0 ? -1 : all[size_t(k)];
          pos[size_t(k)] = int32_t(rng() % 100000);
          w[size_t(k)] = float(rng() % 1000) / 997.0f;
        }
        const int32_t token = int32_t(rng() % 4096);
        auto stream_index = [&](int32_t rank) { return rank * 1000 + token % 997; };
        unsigned long long mask = 0;
        for (int32_t k = 0; k < K; ++k)
          if (ids[size_t(k)] >= 0) mask |= 1ull << em.rank_of(ids[size_t(k)]);
        for (int32_t node = 0; node < nodes; ++node) {
          std::vector<char> fwd(size_t(fl.bytes()), char(0x5a));
          const detail::ForwardHeaderView v{fwd.data(), fl};
          const bool weighted = trial % 4 != 0;  // a dispatch without weights: zeros
          const int32_t n =
              detail::write_forward_header(v, em, nm, node, token, ids.data(), pos.data(),
                                           weighted ? w.data() : nullptr, stream_index);
          // The node's destinations, ascending.
          std::vector<int32_t> dests;
          for (int32_t r = node * rpn; r < (node + 1) * rpn; ++r)
            if (mask >> r & 1ull) dests.push_back(r);
          ASSERT_EQ(n, int32_t(dests.size()));
          if (n == 0) continue;
          EXPECT_EQ(v.token(), token);
          EXPECT_EQ(v.n_dests(), n);
          ASSERT_LE(n, fl.max_dests());
          EXPECT_LE(fl.entries_offset() + int64_t(sizeof(detail::MessageEntry)) * v.first_entry(n),
                    fl.bytes());
          for (int32_t j = 0; j < n; ++j) {
            const int32_t d = dests[size_t(j)];
            EXPECT_EQ(v.dest(j).local_rank, d % rpn);
            EXPECT_EQ(v.dest(j).stream_index, stream_index(d));
            // A node's ranks are consecutive, so their rank slots are too.
            EXPECT_EQ(detail::rank_slot_of(mask, d), v.first_rank_slot() + j);
            // The direct path's header to rank d.
            std::vector<char> want(size_t(ml.header_bytes()), 0), got(want.size(), 0);
            auto* h = reinterpret_cast<detail::MessageHeader*>(want.data());
            h->token = token;
            h->rank_slot = int16_t(detail::rank_slot_of(mask, d));
            int16_t m = 0;
            for (int32_t k = 0; k < K; ++k)
              if (ids[size_t(k)] >= 0 && em.rank_of(ids[size_t(k)]) == d)
                h->entries[m++] = detail::MessageEntry::make(
                    em.local_of(ids[size_t(k)]), k, pos[size_t(k)], weighted ? w[size_t(k)] : 0.0f);
            h->n_entries = m;
            v.rebuild_direct(j, got.data());
            EXPECT_EQ(std::memcmp(got.data(), want.data(),
                                  size_t(8 + int64_t(sizeof(detail::MessageEntry)) * m)),
                      0)
                << "destination " << d;
          }
        }
      }
    }
  }
}

// The forwarding region: every field of every relayed source and message has a place of its
// own, flags and meta records before the messages (zeroed together), messages on a line, the
// part flags only on the low-latency path, and nothing where the group does not forward.
// The sender's outbox where the group forwards (ForwardOutboxLayout): remote ranks' meta
// records, then one forwarded stream per other node (its forward record, then max_tokens
// forwarded messages laid out as the relay's slice of this sender, so chunk c's messages are one
// contiguous put of the same bytes at both ends), then the combine rows; all disjoint, messages
// on a line.
TEST(Forwarding, OutboxStagesOneStreamPerOtherNode) {
  for (const auto& [nodes, rpn] : kSplits) {
    if (nodes == 1) continue;
    const int32_t R = nodes * rpn;
    for (TokenFormat f : {TokenFormat::kBF16, TokenFormat::kFp8Blockwise}) {
      SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(rpn) + " " + token_format_name(f));
      const int32_t T = 100, H = 7168, K = 8;
      const detail::WindowLayout wl{R, H, K, 8 * R, T, f, 0};
      const detail::RelayLayout rl{nodes - 1, T, rpn, wl.msg(), 0};
      const int32_t n_remote = R - rpn;
      const int64_t combine_rows = int64_t(n_remote) * T;
      const detail::OutboxLayout direct{wl, n_remote, combine_rows};
      const detail::ForwardOutboxLayout fwd{direct, rl};
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (int32_t i = 0; i < n_remote; ++i)
        ranges.push_back({fwd.meta_offset(i), wl.meta().bytes()});
      for (int32_t j = 0; j < nodes - 1; ++j) {
        ranges.push_back({fwd.forward_record_offset(j), rl.meta().bytes()});
        for (int32_t m = 0; m < T; ++m) {
          ranges.push_back({fwd.forward_message_offset(j, m), rl.message_bytes()});
          EXPECT_EQ(fwd.forward_message_offset(j, m) % detail::MessageLayout::kAlign, 0);
          // The same stride as the relay's slice: messages [a, b) are one run at both ends.
          EXPECT_EQ(fwd.forward_message_offset(j, m) - fwd.forward_message_offset(j, 0),
                    rl.message_offset(0, m) - rl.message_offset(0, 0));
        }
      }
      ranges.push_back({fwd.combine_offset(0), combine_rows * wl.combine_recv().row_bytes()});
      std::sort(ranges.begin(), ranges.end());
      for (size_t r = 1; r < ranges.size(); ++r)
        EXPECT_LE(ranges[r - 1].first + ranges[r - 1].second, ranges[r].first) << "range " << r;
      EXPECT_LE(ranges.back().first + ranges.back().second, fwd.bytes());
      // Each remote rank's meta record, padded as the direct outbox pads it.
      EXPECT_GE(fwd.peer_bytes(), wl.meta().bytes());
      EXPECT_EQ(fwd.record_bytes() % detail::MessageLayout::kAlign, 0);
      // Forwarding stages nodes - 1 streams instead of n_remote: less with two ranks a node or
      // more (a forwarded message is a little longer than a direct one).
      if (rpn >= 2) {
        EXPECT_LT(fwd.bytes(), direct.bytes());
      }
    }
  }
}

TEST(Forwarding, RelayRegionsDoNotOverlap) {
  for (const auto& [nodes, rpn] : kSplits) {
    const int32_t relayed = ForwardPlan::make(nodes * rpn, rpn).relayed_sources();
    for (TokenFormat f : {TokenFormat::kBF16, TokenFormat::kFp8Blockwise}) {
      for (int32_t ll : {0, 1}) {
        SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(rpn) + " " +
                     token_format_name(f) + (ll ? " low-latency" : ""));
        const int32_t T = 100, H = 7168, K = 8;
        const detail::RelayLayout rl{relayed, T, rpn, detail::MessageLayout{H, K, f}, ll};
        // Where the group does not forward (one node here; elsewhere decide_forwarding's
        // direct route, for which the caller passes 0): no region.
        const detail::RelayLayout none{0, T, rpn, rl.msg, ll};
        EXPECT_EQ(none.bytes(), 0);
        EXPECT_EQ(none.zeroed_bytes(), 0);
        if (relayed == 0) continue;
        // Every byte range, collected and checked for overlap once sorted.
        std::vector<std::pair<int64_t, int64_t>> ranges;
        const int32_t chunks = detail::num_chunks(T), parts = detail::num_parts(H);
        for (int32_t i = 0; i < relayed; ++i) {
          ranges.push_back({rl.ack_offset(i), 8});
          for (int32_t c = 0; c < chunks; ++c)
            ranges.push_back({rl.chunk_flag_offset(i, c), 8});
          if (ll)
            for (int32_t m = 0; m < T; ++m)
              for (int32_t p = 0; p < parts; ++p)
                ranges.push_back({rl.part_flag_offset(i, m, p), 8});
          ranges.push_back({rl.meta_offset(i), rl.meta().bytes()});
          for (int32_t m = 0; m < T; ++m) {
            ranges.push_back({rl.message_offset(i, m), rl.message_bytes()});
            EXPECT_EQ(rl.message_offset(i, m) % detail::MessageLayout::kAlign, 0);
            EXPECT_GE(rl.message_offset(i, m), rl.zeroed_bytes());  // messages are not zeroed
          }
          // The flags and meta records lie in the zeroed bytes; records on 16 bytes.
          EXPECT_LE(rl.meta_offset(i) + rl.meta().bytes(), rl.zeroed_bytes());
          EXPECT_EQ(rl.meta_offset(i) % 16, 0);
          EXPECT_LE(rl.ack_offset(i) + 8, rl.zeroed_bytes());
          EXPECT_LE(rl.chunk_flag_offset(i, chunks - 1) + 8, rl.zeroed_bytes());
          if (ll) {
            EXPECT_LE(rl.part_flag_offset(i, T - 1, parts - 1) + 8, rl.zeroed_bytes());
          }
        }
        // Without the low-latency path no part flags are allocated: the records follow the
        // chunk flags.
        if (!ll) {
          EXPECT_EQ(rl.meta_offset(0), align_up(rl.chunk_flag_offset(relayed, 0), 256));
        }
        std::sort(ranges.begin(), ranges.end());
        for (size_t j = 1; j < ranges.size(); ++j)
          ASSERT_LE(ranges[j - 1].first + ranges[j - 1].second, ranges[j].first) << j;
        EXPECT_LE(ranges.back().first + ranges.back().second, rl.bytes());
        EXPECT_EQ(rl.bytes() % 256, 0);
        // The forward record is the meta record of no groups and no ranks: seq, count, chunks,
        // then the chunk starts.
        EXPECT_EQ(rl.meta().n_local, 0);
        EXPECT_EQ(rl.meta().n_ranks, 0);
        EXPECT_EQ(rl.meta().max_chunks, chunks);
        EXPECT_EQ(rl.meta().chunk_start_offset(), 16);
        EXPECT_EQ(rl.meta().bytes(), align_up(16 + 4 * int64_t(chunks + 1), 16));
        // A forwarded message: its header, then the direct message's payload, on lines.
        EXPECT_EQ(rl.message_bytes(),
                  align_up(detail::forward_header_bytes(K, rpn) + rl.msg.payload_bytes(), 128));
      }
    }
  }
}
