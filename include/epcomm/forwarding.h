// Forwarding inside the node (docs/multinode.md "Forwarding inside the node (design)"): in a group
// that spans nodes, one network copy per (token, destination node), sent to one rank of that
// node, the relay, which forwards it over NVLink to the node's ranks that own the token's
// experts; combine in reverse. This header holds the plan (which rank relays), the forwarded
// message (its header's layout, written by the sender and rebuilt into direct headers by the
// relay), the forwarding region of the window (RelayLayout), and the set-up decision between
// forwarding and the direct path (one network copy per (token, destination rank)). All but the
// decision are usable from host and device code; the decision is made on the host at set-up.
// No kernel forwards yet. Unit-tested on the CPU
// (tests/cpu/test_forwarding.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "epcomm/detail/window_layout.h"
#include "epcomm/hd.h"
#include "epcomm/layout.h"

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
  EPCOMM_HD int32_t n_nodes() const { return nodes.n_nodes(); }
  EPCOMM_HD int32_t local_of(int32_t r) const { return nodes.local_of(r); }
  // The rank of node `node` that receives what `sender` sends there (its own node: itself).
  EPCOMM_HD int32_t relay(int32_t sender, int32_t node) const {
    return node * nodes.ranks_per_node + nodes.local_of(sender);
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
// and scales as quantised by the sender, never re-quantised); the header (ForwardHeaderLayout)
// is
//   at 0: int32 token, int16 n_dests, int16 first_rank_slot (rank_slot_of the node's first
//   destination; the j-th has first_rank_slot + j, since a node's ranks are consecutive);
//   at 8: n_dests x ForwardDest {int16 local rank, int16 n_entries, int32 stream index (the
//   message's index in that destination's stream from this source)}, local rank ascending;
//   at entries_offset() (fixed: after room for every destination there can be, so a relay's
//   lanes read records and entries in one round trip): the entries (MessageEntry) of every
//   destination, destination by destination, top-k slot ascending within each; the relay
//   copies destination j's run as its header's entries.
// n_dests <= min(top_k, ranks_per_node). Padded to MessageLayout::kAlign like the direct header.
struct alignas(8) ForwardDest {  // one 8-byte load
  int16_t local_rank;
  int16_t n_entries;
  int32_t stream_index;
};
static_assert(sizeof(ForwardDest) == 8, "a destination's record is 8 bytes");

struct ForwardHeaderLayout {
  int32_t top_k;
  int32_t ranks_per_node;
  static constexpr int64_t kDestsOffset = 8;

  EPCOMM_HD int32_t max_dests() const { return top_k < ranks_per_node ? top_k : ranks_per_node; }
  EPCOMM_HD int64_t entries_offset() const {
    return kDestsOffset + int64_t(sizeof(ForwardDest)) * max_dests();
  }
  EPCOMM_HD int64_t bytes() const {
    return align_up(entries_offset() + int64_t(sizeof(MessageEntry)) * top_k,
                    MessageLayout::kAlign);
  }
};
EPCOMM_HD int64_t forward_header_bytes(int32_t top_k, int32_t ranks_per_node) {
  return ForwardHeaderLayout{top_k, ranks_per_node}.bytes();
}
// The whole forwarded message: its header, then the direct message's payload.
EPCOMM_HD int64_t forward_message_bytes(const MessageLayout& m, int32_t ranks_per_node) {
  return align_up(forward_header_bytes(m.top_k, ranks_per_node) + m.payload_bytes(),
                  MessageLayout::kAlign);
}

// The forwarded header's fields at `h` (ForwardHeaderLayout), written by the sender and read by
// the relay. One thread's view: the CPU reference and tests use it as it is, a kernel the same
// offsets with its lanes sharing the records and entries.
struct ForwardHeaderView {
  char* h;
  ForwardHeaderLayout l;

  EPCOMM_HD int32_t& token() const { return *reinterpret_cast<int32_t*>(h); }
  EPCOMM_HD int16_t& n_dests() const { return *reinterpret_cast<int16_t*>(h + 4); }
  EPCOMM_HD int16_t& first_rank_slot() const { return *reinterpret_cast<int16_t*>(h + 6); }
  EPCOMM_HD ForwardDest& dest(int32_t j) const {
    return reinterpret_cast<ForwardDest*>(h + ForwardHeaderLayout::kDestsOffset)[j];
  }
  // The i-th entry of the header, counting every destination's run in order.
  EPCOMM_HD MessageEntry& entry(int32_t i) const {
    return reinterpret_cast<MessageEntry*>(h + l.entries_offset())[i];
  }
  // Where destination j's run of entries starts: the entries of destinations 0 .. j-1.
  EPCOMM_HD int32_t first_entry(int32_t j) const {
    int32_t i = 0;
    for (int32_t q = 0; q < j; ++q)
      i += dest(q).n_entries;
    return i;
  }
  // Destination j's direct-path header (MessageHeader: token, n_entries, rank_slot, entries),
  // written at `direct` (MessageLayout::header_bytes() of room).
  EPCOMM_HD void rebuild_direct(int32_t j, char* direct) const {
    MessageHeader* m = reinterpret_cast<MessageHeader*>(direct);
    const ForwardDest d = dest(j);
    m->token = token();
    m->n_entries = d.n_entries;
    m->rank_slot = int16_t(first_rank_slot() + j);
    const int32_t first = first_entry(j);
    for (int32_t i = 0; i < d.n_entries; ++i)
      m->entries[i] = entry(first + i);
  }
};

// A rank's forwarding region, a part of its window's allocation (placed by set-up after the
// outbox, which sits at WindowLayout::bytes()) where the group forwards: what it holds as the
// relay of `relayed` senders (ForwardPlan::relayed_source i, one per other node), and, as a
// sender, one acknowledgement word per other node's relay.
//   flags (zeroed at set-up, monotonic like the window's):
//     ack[i]          u64: the last call whose forwarded messages the relay of the i-th other
//                     node (nodes ascending, this rank's own skipped: ForwardPlan::relayed_index
//                     order) has finished forwarding; the sender waits on it before it
//                     overwrites that relay's region, as it waits on kDispatchAck today;
//     chunk[i][c]     u64: the last call whose forwarded chunk c from relayed source i is here
//                     (the sender's put-with-signal), chunks of kChunkTokens tokens as today;
//     part[i][m][p]   u64 (low-latency path only): forwarded message m's part p, likewise;
//   meta[i]           the relayed source's forward record, a MetaLayout without groups or ranks:
//                     seq, the number of forwarded messages, the number of chunks and where each
//                     chunk's messages start (forwarded messages are in token order);
//   messages[i][m]    max_tokens forwarded messages (forward_message_bytes) per relayed source.
// A relay writes destination d's stream (d of its own node) only once d has finished reading
// the previous call. That needs no new signal: d raises its kDispatchAck word in every rank's
// window when its receive is done, the relay's included, and the relay already waits on those
// words before its own send (dispatch stage 2). The message headers d keeps for its
// expert-side combine are safe for the same reason as on the direct path: the relay's next
// dispatch comes after its own combine, which waits for every block of every rank's combine.
struct RelayLayout {
  int32_t relayed;  // ForwardPlan::relayed_sources() where the group forwards; the caller
                    // passes 0 where it does not (decide_forwarding: direct)
  int32_t max_tokens;
  int32_t ranks_per_node;
  MessageLayout msg;
  int32_t low_latency;  // the part flags are allocated

  EPCOMM_HD MetaLayout meta() const { return MetaLayout{0, num_chunks(max_tokens), 0}; }
  EPCOMM_HD int64_t message_bytes() const { return forward_message_bytes(msg, ranks_per_node); }

  EPCOMM_HD int64_t ack_offset(int32_t i) const { return int64_t(i) * 8; }
  EPCOMM_HD int64_t chunk_flag_offset(int32_t i, int32_t c) const {
    return align_up(ack_offset(relayed), 256) + (int64_t(i) * num_chunks(max_tokens) + c) * 8;
  }
  EPCOMM_HD int64_t part_flag_offset(int32_t i, int32_t m, int32_t p) const {
    return align_up(chunk_flag_offset(relayed, 0), 256) +
           ((int64_t(i) * max_tokens + m) * num_parts(msg.hidden) + p) * 8;
  }
  EPCOMM_HD int64_t flags_end() const {
    return low_latency ? align_up(part_flag_offset(relayed, 0, 0), 256)
                       : align_up(chunk_flag_offset(relayed, 0), 256);
  }
  EPCOMM_HD int64_t meta_offset(int32_t i) const { return flags_end() + i * meta().bytes(); }
  // Forwarded messages start on a line, as the direct path's do.
  EPCOMM_HD int64_t message_offset(int32_t i, int32_t m) const {
    return align_up(meta_offset(relayed), MessageLayout::kAlign) +
           (int64_t(i) * max_tokens + m) * message_bytes();
  }
  EPCOMM_HD int64_t bytes() const {
    return relayed == 0 ? 0 : align_up(message_offset(relayed, 0), 256);
  }
  // Bytes that must be zero before first use: the flags and the meta records' seq words.
  EPCOMM_HD int64_t zeroed_bytes() const { return relayed == 0 ? 0 : message_offset(0, 0); }
};

// The sender's outbox where the group forwards, in place of OutboxLayout's (which it leaves as
// the direct path has it): each remote rank's meta record (meta records are not forwarded; the
// messages are), then one forwarded stream per other node j (nodes ascending, this rank's own
// skipped; relay.relayed of them): the forward record for that node's relay, then max_tokens
// forwarded messages with the relay's stride (RelayLayout::message_offset), so chunk c's
// messages are one put of the same bytes at both ends; then the combine rows.
struct ForwardOutboxLayout {
  OutboxLayout direct;  // the meta records' and combine rows' sizes (window, n_remote, rows)
  RelayLayout relay;    // the forwarded records' and messages' sizes; relayed = other nodes

  EPCOMM_HD int64_t peer_bytes() const { return align_up(direct.meta_bytes(), 256); }
  EPCOMM_HD int64_t meta_offset(int32_t i) const { return i * peer_bytes(); }
  EPCOMM_HD int64_t record_bytes() const {
    return align_up(relay.meta().bytes(), MessageLayout::kAlign);
  }
  EPCOMM_HD int64_t stream_bytes() const {
    return align_up(record_bytes() + int64_t(relay.max_tokens) * relay.message_bytes(), 256);
  }
  EPCOMM_HD int64_t forward_record_offset(int32_t j) const {
    return direct.n_remote * peer_bytes() + j * stream_bytes();
  }
  EPCOMM_HD int64_t forward_message_offset(int32_t j, int32_t m) const {
    return forward_record_offset(j) + record_bytes() + int64_t(m) * relay.message_bytes();
  }
  EPCOMM_HD int64_t combine_offset(int64_t row) const {
    return forward_record_offset(relay.relayed) + row * direct.window.combine_recv().row_bytes();
  }
  EPCOMM_HD int64_t bytes() const {
    return direct.n_remote == 0 ? 0 : align_up(combine_offset(direct.combine_rows), 256);
  }
};

// The sender's forwarded header of one token for node `node` of `nodes` (not its own), at v:
// the token's destinations there are the ranks of that node owning one of its top-k experts
// (ids[k] >= 0), ascending; each destination's entries are its top-k slots k, ascending, as
// MessageEntry::make(local expert, k, pos[k], weight[k]) (weight null: 0), exactly what the
// direct path's header to that rank holds; stream_index(rank) is the message's index in that
// rank's stream from this sender, and first_rank_slot the first destination's rank_slot_of
// among all the ranks the token goes to. Returns n_dests (0: the token does not reach the node,
// and nothing is written). ids, pos, weight and em are the group view's, as the direct path
// uses them (scratch.topk over the view's top_k slots, the view's weights, GroupView::experts()):
// with a shared expert the view has one slot more than the caller's rows.

template <class StreamIndex>
EPCOMM_HD int32_t write_forward_header(const ForwardHeaderView& v, const ExpertMap& em,
                                       const NodeMap& nodes, int32_t node, int32_t token,
                                       const int32_t* ids, const int32_t* pos, const float* weight,
                                       StreamIndex stream_index) {
  const int32_t K = v.l.top_k;
  unsigned long long mask = 0;  // every rank the token goes to (at most 64)
  for (int32_t k = 0; k < K; ++k)
    if (ids[k] >= 0) mask |= 1ull << em.rank_of(ids[k]);
  int32_t n = 0, e = 0;
  for (int32_t local = 0; local < nodes.ranks_per_node; ++local) {
    const int32_t rank = node * nodes.ranks_per_node + local;
    if (!(mask >> rank & 1ull)) continue;
    if (n == 0) v.first_rank_slot() = int16_t(rank_slot_of(mask, rank));
    int32_t entries = 0;
    for (int32_t k = 0; k < K; ++k)
      if (ids[k] >= 0 && em.rank_of(ids[k]) == rank)
        v.entry(e + entries++) =
            MessageEntry::make(em.local_of(ids[k]), k, pos[k], weight ? weight[k] : 0.0f);
    v.dest(n) = ForwardDest{int16_t(local), int16_t(entries), int32_t(stream_index(rank))};
    e += entries;
    ++n;
  }
  if (n > 0) {
    v.token() = token;
    v.n_dests() = int16_t(n);
  }
  return n;
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
