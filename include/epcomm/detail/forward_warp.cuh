// The forwarded message's header (epcomm/forwarding.h, ForwardHeaderLayout) written and read by
// a warp, as the kernels will: the sender's write_forward_header_warp in the lane layout
// send_token writes the direct header with (lane k holds top-k slot k), and the relay's
// rebuild_direct_warp, each lane one entry. Byte for byte what the scalar write_forward_header
// and ForwardHeaderView::rebuild_direct write (tests/gpu/test_forwarding.cu checks it on random
// routings). No kernel forwards yet (docs/multinode.md).
#pragma once

#include <cstdint>

#include "epcomm/config.h"
#include "epcomm/detail/device.cuh"
#include "epcomm/forwarding.h"

namespace epcomm {
namespace detail {

// A lane per top-k slot (the shared expert's included) and per destination of a node.
static_assert(kMaxTopK + 1 <= kWarpSize, "a warp holds every top-k slot");

// Whole warp. Lane k < v.l.top_k holds top-k slot k of the group view: id (expert, -1 masked),
// pos (the token's position among this rank's tokens for that expert) and weight (0 where the
// dispatch carries none); other lanes' values are ignored. dest_mask: every rank the token goes
// to, which must be the ranks of the valid slots' experts (send_token's LaneRoute::dests(): a
// mask that disagreed would give a record without entries or entries without a record).
// slot_of(rank): a whole-warp call (LaneRoute::slot_of) giving the message's index in that
// rank's stream from this rank. Writes the header for node `node` and returns its number of
// destinations (every lane); 0: the token does not reach the node, and nothing is written.
template <class SlotOf>
__device__ int32_t write_forward_header_warp(const ForwardHeaderView& v, const ExpertMap& em,
                                             const NodeMap& nodes, int32_t node, int32_t token,
                                             int32_t id, int32_t pos, float weight,
                                             unsigned long long dest_mask, SlotOf slot_of) {
  const int lane = threadIdx.x % kWarpSize;
  const int32_t rpn = nodes.ranks_per_node, first = node * rpn;
  const unsigned long long here_ranks = nodes.local_ranks(dest_mask, node);
  const int32_t n = __popcll(here_ranks);
  if (n == 0) return 0;
  const int32_t dest = lane < v.l.top_k && id >= 0 ? em.rank_of(id) : -1;
  const bool here = dest >= first && dest < first + rpn;
  // Lane j < n stands for the node's j-th destination, rank ascending.
  int32_t j_rank = first;
  if (lane < n) {
    unsigned long long m = here_ranks;
    for (int i = 0; i < lane; ++i)
      m &= m - 1ull;
    j_rank = first + __ffsll(static_cast<long long>(m)) - 1;
  }
  // Entries run destination by destination, top-k slot ascending within each: a lane's entry
  // comes after every entry of a lower rank of the node and the earlier slots of its own.
  int32_t at = 0, j_entries = 0;
  for (uint32_t left = __ballot_sync(0xffffffffu, here); left; left &= left - 1u) {
    const int q = __ffs(left) - 1;
    const int32_t q_rank = __shfl_sync(0xffffffffu, dest, q);
    at += q_rank < dest || (q_rank == dest && q < lane);
    j_entries += q_rank == j_rank;
  }
  if (here) v.entry(at) = MessageEntry::make(em.local_of(id), lane, pos, weight);
  const int32_t s = slot_of(j_rank);  // every lane: a shuffle
  if (lane < n) v.dest(lane) = ForwardDest{int16_t(j_rank - first), int16_t(j_entries), s};
  if (lane == 0) {
    v.token() = token;
    v.n_dests() = int16_t(n);
    v.first_rank_slot() =
        int16_t(rank_slot_of(dest_mask, first + __ffsll(static_cast<long long>(here_ranks)) - 1));
  }
  return n;
}

// Whole warp: destination j's direct-path header (MessageHeader), at `direct`, from the
// forwarded header v (the relay's side); lane i writes entry i.
__device__ __forceinline__ void rebuild_direct_warp(const ForwardHeaderView& v, int32_t j,
                                                    char* direct) {
  const int lane = threadIdx.x % kWarpSize;
  const int32_t before = __reduce_add_sync(0xffffffffu, lane < j ? v.dest(lane).n_entries : 0);
  const ForwardDest d = v.dest(j);
  MessageHeader* m = reinterpret_cast<MessageHeader*>(direct);
  if (lane < d.n_entries) m->entries[lane] = v.entry(before + lane);
  if (lane == 0) {
    m->token = v.token();
    m->n_entries = d.n_entries;
    m->rank_slot = int16_t(v.first_rank_slot() + j);
  }
}

}  // namespace detail
}  // namespace epcomm
