#include "epcomm/forwarding.h"

#include <cstdio>

#include "epcomm/error.h"

namespace epcomm {

double reach_probability(int32_t n_experts, int32_t top_k, int32_t parts) {
  // C(E - E/g, K) / C(E, K) as a product of K ratios: no factorial overflows.
  const int32_t outside = n_experts - n_experts / parts;
  double miss = 1.0;
  for (int32_t i = 0; i < top_k; ++i)
    miss *= outside - i <= 0 ? 0.0 : double(outside - i) / double(n_experts - i);
  return 1.0 - miss;
}

const char* cross_node_route_name(CrossNodeRoute r) {
  return r == CrossNodeRoute::kForward ? "forward" : "direct";
}

ForwardDecision decide_forwarding(const ForwardShape& s) {
  auto bad = [&](const char* what) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("decide_forwarding: ") + what +
                    " (n_ranks = " + std::to_string(s.n_ranks) +
                    ", ranks_per_node = " + std::to_string(s.ranks_per_node) + ", n_experts = " +
                    std::to_string(s.n_experts) + ", top_k = " + std::to_string(s.top_k) + ")");
  };
  if (s.n_ranks < 1 || s.ranks_per_node < 1 || s.n_ranks % s.ranks_per_node != 0)
    bad("ranks_per_node must divide n_ranks");
  if (s.n_experts < s.n_ranks || s.n_experts % s.n_ranks != 0)
    bad("n_experts must be a positive multiple of n_ranks");
  if (s.top_k < 1 || s.top_k > s.n_experts) bad("top_k must lie in [1, n_experts]");

  const int32_t nodes = s.n_ranks / s.ranks_per_node;
  ForwardDecision d;
  char line[256];
  if (s.skip_a2a) {
    d.reason = "direct: skip_a2a moves no data between ranks";
    return d;
  }
  if (nodes == 1) {
    d.reason = "direct: the group is one node";
    return d;
  }
  d.expected_saving = s.ranks_per_node * reach_probability(s.n_experts, s.top_k, s.n_ranks) /
                      reach_probability(s.n_experts, s.top_k, nodes);
  if (d.expected_saving >= kForwardMinSaving) {
    d.route = CrossNodeRoute::kForward;
    std::snprintf(line, sizeof line,
                  "forward: %d nodes x %d ranks, top-%d of %d experts: a token meets %.2f ranks "
                  "of each other node it reaches (uniform routing), so one copy per node cuts "
                  "network copies %.2fx",
                  nodes, s.ranks_per_node, s.top_k, s.n_experts, d.expected_saving,
                  d.expected_saving);
  } else {
    std::snprintf(line, sizeof line,
                  "direct: %d nodes x %d ranks, top-%d of %d experts: a token meets %.2f ranks "
                  "of each other node it reaches (uniform routing), below the %.2f forwarding "
                  "needs to pay for its hop",
                  nodes, s.ranks_per_node, s.top_k, s.n_experts, d.expected_saving,
                  kForwardMinSaving);
  }
  d.reason = line;
  return d;
}

}  // namespace epcomm
