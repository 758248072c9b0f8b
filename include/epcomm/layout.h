// The index types of the public API, shared by the kernels, the CPU reference model and the
// tests: the routing view of the modes (RouteMap), a dispatch output row's origin (SrcInfo) and
// the expert -> rank map. Each is a small value type whose index arithmetic is written once here
// and unit-tested on the CPU (tests/cpu/test_layout.cpp). Everything is usable from host and
// device code. The byte layout of the communication window is internal:
// epcomm/detail/window_layout.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epcomm/hd.h"
#include "epcomm/token_format.h"

namespace epcomm {

// Rows a dispatch can deliver to one rank: max_tokens tokens from each of n_ranks sources, each
// expanded into at most min(K, n_local) of the rank's groups (without format padding).
EPCOMM_HD constexpr int64_t max_routed_rows(int32_t max_tokens, int32_t n_ranks, int32_t top_k,
                                            int32_t n_local) {
  return int64_t(max_tokens) * n_ranks * (top_k < n_local ? top_k : n_local);
}

// expert_ids[g] of the shared expert's group (group 0 with Config::shared_expert).
constexpr int32_t kSharedExpertId = -1;

// How the caller's routing becomes the routing the kernels run (docs/design.md "Modes" modes). The kernels see
// a "view" of the group: its ranks, experts and top-k slots, which equal the caller's unless
//  - shared_expert: every rank gets one more expert, its local expert 0 (group 0), to which it
//    routes its own tokens only, through one more top-k slot (slot K, weight 1, last); the
//    caller's local expert l is group l + 1.
//  - skip_a2a: every rank holds the same tokens and keeps only its own experts: the view is a
//    group of one rank (itself) whose experts are its local ones; the caller's ids of other
//    ranks' experts become masked slots. With shared_expert, the shared expert takes only this
//    rank's share of the tokens (shared_begin / shared_count), split over allreduce_world ranks.
// With neither, the view is the caller's group and every id maps to itself.
struct RouteMap {
  int32_t n_experts;  // the caller's experts (the range of topk_ids)
  int32_t top_k;      // the caller's K: the columns of topk_ids and of the router weights
  int32_t n_ranks;    // the group's ranks
  int32_t rank;       // this rank
  int32_t shared;     // 1: fused shared expert
  int32_t skip_a2a;   // 1: no traffic between ranks
  int32_t ar_world;   // skip_a2a + shared: ranks the shared expert's tokens are split over
  int32_t ar_rank;    // this rank's share, in [0, ar_world)
  Divisor local;      // n_experts / n_ranks: the caller's experts per rank (n_local)

  RouteMap() = default;
  EPCOMM_HD RouteMap(int32_t experts, int32_t k, int32_t ranks, int32_t r, int32_t shared_slot,
                     int32_t skip, int32_t world, int32_t world_rank)
      : n_experts(experts),
        top_k(k),
        n_ranks(ranks),
        rank(r),
        shared(shared_slot),
        skip_a2a(skip),
        ar_world(world),
        ar_rank(world_rank),
        local(per_rank_count(experts, ranks)) {}

  // Rank `rank` of a group with these modes; allreduce_world_size 0 means n_ranks, and the
  // rank's share of the shared expert's tokens is rank % that.
  EPCOMM_HD static RouteMap make(int32_t n_experts, int32_t top_k, int32_t n_ranks, int32_t rank,
                                 bool shared_expert, bool skip_a2a, int32_t allreduce_world_size) {
    const int32_t w = allreduce_world_size > 0 ? allreduce_world_size : n_ranks;
    return RouteMap{n_experts,        top_k, n_ranks, rank, shared_expert ? 1 : 0,
                    skip_a2a ? 1 : 0, w,     rank % w};
  }
  EPCOMM_HD int32_t n_local() const { return local.d; }
  // Groups of a rank's dispatch output, and the view's experts per rank.
  EPCOMM_HD int32_t groups() const { return n_local() + shared; }
  // The view's top-k slots, ranks, this rank in it, and experts.
  EPCOMM_HD int32_t slots() const { return top_k + shared; }
  EPCOMM_HD int32_t view_ranks() const { return skip_a2a ? 1 : n_ranks; }
  EPCOMM_HD int32_t view_rank() const { return skip_a2a ? 0 : rank; }
  EPCOMM_HD int32_t view_experts() const { return view_ranks() * groups(); }
  // The view's id of the caller's expert id (0 <= id < n_experts); -1 where skip_a2a drops it.
  EPCOMM_HD int32_t expert(int32_t id) const {
    const int32_t r = local.div(id), l = id - r * local.d;
    if (skip_a2a) return r == rank ? shared + l : -1;
    return r * groups() + shared + l;
  }
  // The expert (in the view) of this rank's shared expert.
  EPCOMM_HD int32_t shared_expert() const { return view_rank() * groups(); }
  // This rank's tokens that go to its shared expert: [shared_begin, shared_begin + shared_count)
  // of the call's T. All of them, except with skip_a2a, where share ar_rank of ar_world takes
  // (T + W - r - 1) / W tokens from r * (T / W) + min(r, T % W).
  EPCOMM_HD int32_t shared_begin(int32_t T) const {
    if (!shared || !skip_a2a) return 0;
    const int32_t W = ar_world, r = ar_rank;
    return r * (T / W) + (r < T % W ? r : T % W);
  }
  EPCOMM_HD int32_t shared_count(int32_t T) const {
    if (!shared) return 0;
    if (!skip_a2a) return T;
    return (T + ar_world - ar_rank - 1) / ar_world;
  }
  // The view's expert of slot k (< slots()) of token t of a T-token call, where `id` is the
  // caller's topk_ids[t][k] for k < top_k (already checked to lie in [-1, n_experts)): -1 for a
  // masked or dropped slot.
  EPCOMM_HD int32_t slot_expert(int32_t id, int32_t k, int32_t t, int32_t T) const {
    if (k < top_k) return id < 0 ? -1 : expert(id);
    const int32_t b = shared_begin(T);
    return t >= b && t < b + shared_count(T) ? shared_expert() : -1;
  }
  // The caller's rank of the view's rank v (src_info holds the caller's), and back (-1: not in
  // the view).
  EPCOMM_HD int32_t caller_rank(int32_t v) const { return skip_a2a ? rank : v; }
  EPCOMM_HD int32_t view_rank_of(int32_t r) const { return skip_a2a ? (r == rank ? 0 : -1) : r; }
  // The router weight of slot k of token t: the caller's weights[t][k], and 1 for the shared slot.
  EPCOMM_HD float slot_weight(const float* weights, int32_t t, int32_t k) const {
    return k < top_k ? weights[int64_t(t) * top_k + k] : 1.0f;
  }
  // expert_ids[g] of the dispatch output: the rank's local expert of group g, or
  // kSharedExpertId.
  EPCOMM_HD int32_t group_expert(int32_t g) const {
    return g < shared ? kSharedExpertId : g - shared;
  }
  // Rows a dispatch can deliver to this rank before format padding: max_tokens from each source
  // the view has, in at most min(K, n_local) groups each, plus max_tokens shared-expert rows.
  EPCOMM_HD int64_t max_routed_rows(int32_t max_tokens) const {
    return epcomm::max_routed_rows(max_tokens, view_ranks(), top_k, n_local()) +
           int64_t(shared) * max_tokens;
  }
  // The most rows one group can receive: a source sends a token to an expert at most once (the
  // shared expert's group: this rank's own tokens). The least capacity of the padded layout.
  EPCOMM_HD int64_t max_group_rows(int32_t max_tokens) const {
    return int64_t(view_ranks()) * max_tokens;
  }
  // Whether a padded layout of `capacity` slots a group holds every group's rows, with its
  // groups * capacity slots below 2^31 (Config::padded_capacity, CombineInput::
  // expert_out_capacity).
  EPCOMM_HD bool padded_capacity_fits(int32_t max_tokens, int64_t capacity) const {
    return capacity >= max_group_rows(max_tokens) && capacity < (int64_t(1) << 31) / groups();
  }
};

// What combine needs to send a dispatched row home. One per dispatch output row.
struct SrcInfo {
  int32_t token;  // token index on the source rank
  int16_t rank;   // source rank
  int16_t slot;   // top-k slot k of that token
};
static_assert(sizeof(SrcInfo) == 8, "SrcInfo is 8 bytes");

// Global expert id <-> (owning rank, local expert). Rank r owns [r*n_local, (r+1)*n_local).
// The dispatch ranking pass also uses "keys": expert e is key e, destination rank r is key
// n_experts + r, so one stable ranking yields both a token's row inside each expert group and
// its slot in each destination's receive stream.
// rank_of and local_of take e >= 0.
struct ExpertMap {
  int32_t n_experts;
  int32_t n_ranks;
  Divisor per_rank;  // n_local

  EPCOMM_HD ExpertMap(int32_t experts, int32_t ranks)
      : ExpertMap(experts, ranks, Divisor(per_rank_count(experts, ranks))) {}
  // With the divisor built once on the host (GroupView::n_local_div).
  EPCOMM_HD ExpertMap(int32_t experts, int32_t ranks, Divisor n_local)
      : n_experts(experts), n_ranks(ranks), per_rank(n_local) {}
  EPCOMM_HD int32_t n_local() const { return per_rank.d; }
  EPCOMM_HD int32_t rank_of(int32_t e) const { return per_rank.div(e); }
  EPCOMM_HD int32_t local_of(int32_t e) const { return per_rank.mod(e); }
  EPCOMM_HD int32_t rank_key(int32_t r) const { return n_experts + r; }
  EPCOMM_HD int32_t num_keys() const { return n_experts + n_ranks; }
};

// Where the rows of a dispatch output, grouped by row_offsets ([groups + 1], groups sorted), sit
// in an array of `capacity` slots a group: row i of group g in slot (g, i - row_offsets[g]), at
// g * capacity + i - row_offsets[g] (the padded per-expert layout, epcomm/padded_layout.h). With
// capacity 0 the rows are where they are (dispatch row order): slot_row(i) = i.
struct GroupSlots {
  const uint32_t* row_offsets;
  int32_t groups;
  int64_t capacity;

  // The group g with row_offsets[g] <= i < row_offsets[g + 1] (the last such g where groups
  // are empty), by binary search.
  EPCOMM_HD int32_t group_of(int64_t i) const {
    int32_t lo = 0, hi = groups - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (int64_t(row_offsets[mid]) <= i)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }
  // Row i's slot within its group g.
  EPCOMM_HD int64_t slot_in(int32_t g, int64_t i) const { return i - int64_t(row_offsets[g]); }
  // Row i of group g, where the padded array holds it; -1 where its slot falls outside the
  // group's [0, capacity) (inconsistent row_offsets: never read there).
  EPCOMM_HD int64_t slot_row(int32_t g, int64_t i) const {
    if (capacity == 0) return i;
    const int64_t j = slot_in(g, i);
    return j >= 0 && j < capacity ? int64_t(g) * capacity + j : -1;
  }
  EPCOMM_HD int64_t slot_row(int64_t i) const {
    return capacity == 0 ? i : slot_row(group_of(i), i);
  }
};

}  // namespace epcomm
