// Forwarding inside the node (docs/multinode.md "Forwarding inside the node (design)"): in a group
// that spans nodes, one network copy per (token, destination node), sent to one rank of that
// node, the relay, which forwards it over NVLink to the node's ranks that own the token's
// experts; combine in reverse. This header holds the plan (which rank relays), the size of a
// forwarded message, and the set-up decision between forwarding and the direct path (one network
// copy per (token, destination rank)). The plan and the sizes are usable from host and device
// code; the decision is made on the host at set-up. Unit-tested on the CPU
// (tests/cpu/test_forwarding.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "epcomm/detail/window_layout.h"
#include "epcomm/hd.h"

namespace epcomm {

// Who relays in a group of n_ranks ranks as nodes of ranks_per_node consecutive ranks
// (detail::NodeMap). Rank r is local rank r % ranks_per_node of node r / ranks_per_node.
// What sender s sends to node n goes to the rank of n with s's local index: each rank of a node
// then relays for the senders of its own local index, one per other node, so every rank (and
// its NIC) takes an equal share of the node's incoming traffic, and in a rail-optimised
// cluster (the NICs of one local index on one switch) every network copy stays on its rail.
struct ForwardPlan {
  detail::NodeMap nodes;

  EPCOMM_HD static ForwardPlan make(int32_t n_ranks, int32_t ranks_per_node) {
    return ForwardPlan{detail::NodeMap{n_ranks, ranks_per_node}};
  }
  EPCOMM_HD int32_t n_nodes() const { return nodes.n_ranks / nodes.ranks_per_node; }
  EPCOMM_HD int32_t local_of(int32_t r) const { return r % nodes.ranks_per_node; }
  // The rank of node `node` that receives what `sender` sends there (its own node: itself).
  EPCOMM_HD int32_t relay(int32_t sender, int32_t node) const {
    return node * nodes.ranks_per_node + local_of(sender);
  }
  // The relay of the node of destination rank `dst`, for `sender`.
  EPCOMM_HD int32_t relay_for(int32_t sender, int32_t dst) const {
    return relay(sender, nodes.node_of(dst));
  }
  // The senders rank `r` relays for: one per other node, with r's local index. Source i
  // (0 <= i < n_nodes() - 1) is that rank of the i-th other node, in node order.
  EPCOMM_HD int32_t relayed_sources() const { return n_nodes() - 1; }
  EPCOMM_HD int32_t relayed_source(int32_t r, int32_t i) const {
    const int32_t node = i < nodes.node_of(r) ? i : i + 1;
    return relay(r, node);
  }
  // The inverse: i of sender s (another node's rank with r's local index) at relay r.
  EPCOMM_HD int32_t relayed_index(int32_t r, int32_t s) const {
    const int32_t n = nodes.node_of(s);
    return n < nodes.node_of(r) ? n : n - 1;
  }
};

namespace detail {
// A forwarded message: what the relay needs to write the direct-path message (MessageLayout) of
// every destination rank of its node. The payload is the direct message's, byte for byte (codes
// and scales as quantised by the sender, never re-quantised); the header is
//   int32 token, int16 n_dests, int16 first_rank_slot (rank_slot_of the node's first
//   destination; the j-th has first_rank_slot + j, since a node's ranks are consecutive),
//   n_dests x {int16 local rank, int16 n_entries, int32 stream index (the message's index in
//   that destination's stream from this source)}, local rank ascending,
//   then the entries (MessageEntry) of every destination, destination by destination, top-k
//   slot ascending within each: the relay copies destination j's run as its header's entries.
// n_dests <= min(top_k, ranks_per_node). Padded to MessageLayout::kAlign like the direct header.
EPCOMM_HD int64_t forward_header_bytes(int32_t top_k, int32_t ranks_per_node) {
  const int32_t dests = top_k < ranks_per_node ? top_k : ranks_per_node;
  return align_up(8 + 8 * int64_t(dests) + int64_t(sizeof(MessageEntry)) * top_k,
                  MessageLayout::kAlign);
}
// The whole forwarded message: its header, then the direct message's payload.
EPCOMM_HD int64_t forward_message_bytes(const MessageLayout& m, int32_t ranks_per_node) {
  return align_up(forward_header_bytes(m.top_k, ranks_per_node) + m.payload_bytes(),
                  MessageLayout::kAlign);
}
}  // namespace detail

// Uniform routing (K distinct experts of n_experts, experts split evenly over `parts` equal
// parts: ranks or nodes): the chance that a token reaches a given part,
// p = 1 - C(n_experts - n_experts / parts, K) / C(n_experts, K) (docs/multinode.md).
double reach_probability(int32_t n_experts, int32_t top_k, int32_t parts);

// How a group sends to ranks of other nodes.
enum class CrossNodeRoute : int32_t {
  kDirect = 0,   // one network copy per (token, destination rank)
  kForward = 1,  // one per (token, destination node), forwarded inside the node
};
const char* cross_node_route_name(CrossNodeRoute r);  // "direct", "forward"

// The shape the decision looks at: a Config's fields and the group's size.
struct ForwardShape {
  int32_t n_ranks = 0;
  int32_t ranks_per_node = 0;  // the group's resolved nodes (NodeMap); n_ranks: one node
  int32_t n_experts = 0;
  int32_t top_k = 0;
  bool skip_a2a = false;  // no traffic between ranks
};

// Forwarding saves network bytes only where a token that reaches a node is expected to meet
// more than one of its ranks: by symmetry, the ratio of network copies direct / forwarded is
// that number, ranks_per_node * p(n_ranks) / p(nodes) under uniform routing, for dispatch and
// for the expert-side combine alike. It costs a hop through the relay (latency, NVLink bytes),
// so set-up forwards only where the ratio reaches kForwardMinSaving. Exactly 1 (forwarding can
// save nothing): one node, one rank per node, top-1 routing; skip_a2a moves nothing at all.
// The threshold is a guess, not a measurement: to be set from network timings.
constexpr double kForwardMinSaving = 1.1;
struct ForwardDecision {
  CrossNodeRoute route = CrossNodeRoute::kDirect;
  double expected_saving = 1.0;  // network copies direct / forwarded, uniform routing
  std::string reason;            // one line for set-up to report
};
// Throws Error(kInvalidArgument) for a shape no group has (ranks_per_node not dividing n_ranks,
// n_experts not a multiple of n_ranks, top_k outside [1, n_experts]).
ForwardDecision decide_forwarding(const ForwardShape& s);

}  // namespace epcomm
