// Dispatch stage 1, ranking: every (token, key) gets its position among this rank's tokens that
// carry the key (keys: experts, then destination ranks; ExpertMap). Positions fixed by token
// order make the output deterministic, and let every sender write each message straight into
// its final slot with no exchange between senders.
//
// Who writes what: on the throughput path block b ranks units b, b + blocks, ... with per-warp
// lane bitmaps in shared memory and writes each unit's histogram and its tokens' unit-local
// positions to RankScratch; after a grid barrier scan_units turns the histograms into per-unit
// prefixes (last row: the totals), published by a second barrier. Nothing needs resetting
// between calls: each lane clears the bitmap words it set, and every scratch word a call reads
// it first wrote. The low-latency path (rank_local) ranks the call's few tokens in every block's
// shared memory instead, so no block waits for another. A bad id is recorded once (by the
// ranking block, or block 0) and marks the call bad (LocalState::bad_input = seq): it sends
// nothing but empty meta records, so every destination still completes the call.
#pragma once

#include "kernels/dispatch/common.cuh"

namespace epcomm {
namespace detail {
namespace {

// ---- the throughput path ------------------------------------------------------------------

// An int64 id (DispatchInput::topk_ids64) as int32: one outside int32 is clamped into it, so it
// stays outside [-1, n_experts) and the ranking refuses it as a bad id, where truncation could
// have made it a real expert's.
__device__ __forceinline__ int32_t narrow_id(int64_t v) {
  return int32_t(v < INT32_MIN ? INT32_MIN : (v > INT32_MAX ? INT32_MAX : v));
}

// Element i of the caller's topk_ids, int32 or int64 (DispatchParams::id_bytes).
__device__ __forceinline__ int32_t caller_id(const DispatchParams& p, int64_t i) {
  return p.id_bytes == 8 ? narrow_id(static_cast<const int64_t*>(p.topk_ids)[i])
                         : static_cast<const int32_t*>(p.topk_ids)[i];
}

// Token t's row of topk_ids (the caller's K columns), every load in flight together. One branch
// on the ids' width for the row, so the int32 path runs the same straight-line loads as before
// int64 ids were taken (the ranking's code is fetched cold after an L2 flush).
__device__ __forceinline__ void load_ids(const DispatchParams& p, int32_t t,
                                         int32_t (&ids)[kMaxTopK]) {
  const int32_t K = p.g.route.top_k;
  const int64_t row = int64_t(t) * K;
  if (p.id_bytes == 8) {
    const int64_t* ids64 = static_cast<const int64_t*>(p.topk_ids) + row;
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k)
      if (k < K) ids[k] = narrow_id(ids64[k]);
    return;
  }
  const int32_t* ids32 = static_cast<const int32_t*>(p.topk_ids) + row;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k)
    if (k < K) ids[k] = ids32[k];
}

// The view's expert and router weight of slot k of token t (RouteMap), from the caller's
// topk_ids (valid: the call's ids passed the ranking) and weights.
__device__ __forceinline__ int32_t view_expert(const DispatchParams& p, int32_t t, int32_t k) {
  const RouteMap& rm = p.g.route;
  const int32_t id = k < rm.top_k ? caller_id(p, int64_t(t) * rm.top_k + k) : -1;
  return rm.slot_expert(id, k, t, p.num_tokens);
}
__device__ __forceinline__ float view_weight(const DispatchParams& p, int32_t t, int32_t k) {
  return p.weights != nullptr ? p.g.route.slot_weight(p.weights, t, k) : 0.0f;
}

// Enters token t's ids (from load_ids; on return, the view's ids of its slots, RouteMap) in its
// warp's bitmaps (bm) and returns its destination ranks. A bad id is recorded and masked (-1 in
// ids and scratch.topk); a duplicate shows as the lane's own bit already set in the expert's
// word (with skip_a2a, among this rank's experts only: the others' ids are dropped). The slot loops
// are not unrolled: unrolled over kMaxTopK, with a pairwise duplicate check, the ranking was about
// 60 KB of straight-line code, and fetching it after an L2 flush dominated each 512-token unit
// (stage trace, docs/results/2026-11-21_h200x4_96383ca_stage_trace.md). `record`: this block
// reports bad ids and keeps the validated copy for combine (the throughput path's ranking block;
// the low-latency path has rank_local).
__device__ RankMask enter_ids(const DispatchParams& p, int32_t t, unsigned long long seq,
                              uint32_t* bm, int32_t (&ids)[kMaxTopK], bool record, bool& bad) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t K = g.top_k;
  const uint32_t bit = 1u << (threadIdx.x % kWarpSize);
  RankMask rank_mask = 0;
#pragma unroll 1
  for (int k = 0; k < K; ++k) {
    int32_t id = k < g.route.top_k ? ids[k] : -1;
    if (id < -1 || id >= g.route.n_experts) {
      if (record) record_error(g, ErrorCode::kBadExpertId, kOpDispatchSend, 0, t, k, id, kWaitNone);
      bad = true;
      id = -1;
    }
    const int32_t shown_id = id;  // errors name the caller's expert id
    id = g.route.slot_expert(id, k, t, p.num_tokens);
    ids[k] = id;
    if (record) p.scratch.topk[int64_t(t) * K + k] = id;
    if (id < 0) continue;
    if (atomicOr(&bm[id], bit) & bit) {
      if (record)
        record_error(g, ErrorCode::kDuplicateExpert, kOpDispatchSend, 0, t, k, shown_id, kWaitNone);
      bad = true;
    }
    rank_mask |= rank_bit(em.rank_of(id));
  }
  for (RankMask m = rank_mask; m; m &= m - 1)
    atomicOr(&bm[em.rank_key(__ffsll(m) - 1)], bit);
  if (bad && record) atomicMax(&g.state->bad_input, seq);
  return rank_mask;
}

// A block's ranking of up to kUnitTokens tokens (a unit, or a low-latency call), in shared
// memory.
struct LocalRanks {
  const uint32_t* bitmap;       // [warp][key]: bit l set = token warp * 32 + l carries key
  const uint16_t* warp_prefix;  // [warp][key]: tokens of earlier warps carrying key
  const int32_t* totals;        // [key]: tokens carrying key
  int32_t nk;

  // Token t's position among the call's tokens carrying `key` (token order: deterministic).
  __device__ int32_t pos(int32_t t, int32_t key) const {
    const int32_t w = t / kWarpSize, below = (1u << (t % kWarpSize)) - 1u;
    return warp_prefix[w * nk + key] + __popc(bitmap[w * nk + key] & below);
  }
  // Shared memory: the bitmaps and warp prefixes (as the throughput path's ranking), then totals;
  // then what rank_local keeps while it ranks a call of `tokens` tokens: each token's first bad
  // slot, and each (token, slot) pair's id.
  __host__ __device__ static int64_t totals_offset(int32_t nk) {
    return align_up(int64_t(kWarps) * nk * (sizeof(uint32_t) + sizeof(uint16_t)), 16);
  }
  __host__ __device__ static int64_t first_bad_offset(int32_t nk) {
    return totals_offset(nk) + 4 * int64_t(nk);
  }
  __host__ __device__ static int64_t pair_ids_offset(int32_t nk, int32_t tokens) {
    return first_bad_offset(nk) + 4 * int64_t(tokens);
  }
  // For calls of up to max_tokens tokens of K slots (the view's).
  __host__ __device__ static int64_t smem_bytes(int32_t nk, int32_t max_tokens, int32_t K) {
    return pair_ids_offset(nk, max_tokens) + 4 * int64_t(max_tokens) * K;
  }
};

// Per key: the tokens of earlier warps (warp_prefix[w][key]) and of all `warps` warps
// (totals[key]), from the per-warp bitmaps. Every thread of the block.
__device__ __forceinline__ void prefix_keys(const uint32_t* bitmap, uint16_t* warp_prefix,
                                            int32_t nk, int32_t warps, int32_t* totals) {
  for (int32_t key = threadIdx.x; key < nk; key += kThreads) {
    int32_t run = 0;
    for (int32_t w = 0; w < warps; ++w) {
      warp_prefix[w * nk + key] = uint16_t(run);
      run += __popc(bitmap[w * nk + key]);
    }
    totals[key] = run;
  }
}

__device__ void rank_units(const DispatchParams& p, unsigned long long seq, uint32_t* bitmap,
                           uint16_t* warp_prefix) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t nk = em.num_keys();
  const int32_t K = g.top_k;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int32_t n_units = (p.num_tokens + kUnitTokens - 1) / kUnitTokens;
  uint32_t* bm = bitmap + warp * nk;

  for (int32_t u = blockIdx.x; u < n_units; u += g.num_blocks) {
    const int32_t t = u * kUnitTokens + warp * kWarpSize + lane;
    const bool valid = t < p.num_tokens;
    int32_t ids[kMaxTopK];
    RankMask rank_mask = 0;
    bool bad = false;
    if (valid) {
      load_ids(p, t, ids);
      rank_mask = enter_ids(p, t, seq, bm, ids, true, bad);
    }
    __syncthreads();
    prefix_keys(bitmap, warp_prefix, nk, kWarps, p.scratch.unit_hist + int64_t(u) * nk);
    __syncthreads();
    if (valid) {
      const LocalRanks lr{bitmap, warp_prefix, nullptr, nk};
      const int32_t tu = t - u * kUnitTokens;  // the token's index in the unit
#pragma unroll 1
      for (int k = 0; k < K; ++k) {
        if (ids[k] < 0) continue;
        p.scratch.expert_pos[int64_t(t) * K + k] = lr.pos(tu, ids[k]);
      }
      for (int32_t r = 0; r < g.n_ranks; ++r) {
        p.scratch.dest_pos[int64_t(t) * g.n_ranks + r] =
            (rank_mask >> r) & 1ull ? lr.pos(tu, em.rank_key(r)) : -1;
      }
    }
    // Each chunk's first position in each destination stream, relative to the unit: the tokens
    // of earlier warps, plus the first half of this warp's for a chunk in its second half.
    constexpr int32_t kChunksPerUnit = kUnitTokens / kChunkTokens;
    static_assert(kWarpSize % kChunkTokens == 0, "a chunk lies inside one warp's tokens");
    for (int32_t i = threadIdx.x; i < kChunksPerUnit * g.n_ranks; i += kThreads) {
      const int32_t h = i / g.n_ranks, r = i % g.n_ranks;
      const int32_t chunk = u * kChunksPerUnit + h;
      if (chunk * kChunkTokens >= p.num_tokens) continue;
      const int32_t w = h * kChunkTokens / kWarpSize, lane0 = h * kChunkTokens % kWarpSize;
      const int32_t key = em.rank_key(r);
      const uint32_t below = lane0 == 0 ? 0u : (1u << lane0) - 1u;
      p.scratch.chunk_pos[int64_t(chunk) * g.n_ranks + r] =
          warp_prefix[w * nk + key] + __popc(bitmap[w * nk + key] & below);
    }
    __syncthreads();
    if (valid) {  // clear only the words this lane set
#pragma unroll 1
      for (int k = 0; k < K; ++k)
        if (ids[k] >= 0) bm[ids[k]] = 0;
      for (RankMask m = rank_mask; m; m &= m - 1)
        bm[em.rank_key(__ffsll(m) - 1)] = 0;
    }
    __syncwarp();
  }
}

// Exclusive prefix of the unit histograms over units; row n_units holds the totals.
__device__ void scan_units(const DispatchParams& p) {
  const int32_t nk = p.g.experts().num_keys();
  const int32_t n_units = (p.num_tokens + kUnitTokens - 1) / kUnitTokens;
  for (int32_t key = blockIdx.x * kThreads + threadIdx.x; key < nk;
       key += p.g.num_blocks * kThreads) {
    int32_t run = 0;
    for (int32_t u = 0; u < n_units; ++u) {
      p.scratch.unit_prefix[int64_t(u) * nk + key] = run;
      run += p.scratch.unit_hist[int64_t(u) * nk + key];
    }
    p.scratch.unit_prefix[int64_t(n_units) * nk + key] = run;
  }
}

// ---- the low-latency path -----------------------------------------------------------------

// The low-latency path ranks (token, slot) pairs, not tokens: pair i = t * K + k (K: the view's
// slots) goes to thread i % kThreads, so every warp takes a share. With one token per thread,
// decode's 128 tokens were 4 warps entering 8 slots each in turn while the other 12 waited at
// the barrier (Nsight Compute on one H100: the kernel's largest stall). A thread's pairs are
// i, i + kThreads, ...; t and k follow i with no division per pair.
struct PairWalk {
  int32_t i, t, k;
  int32_t K, dt, dk;  // kThreads = dt * K + dk

  __device__ explicit PairWalk(int32_t slots)
      : i(threadIdx.x),
        t(int32_t(threadIdx.x) / slots),
        k(int32_t(threadIdx.x) % slots),
        K(slots),
        dt(kThreads / slots),
        dk(kThreads % slots) {}
  __device__ void next() {
    i += kThreads;
    t += dt;
    k += dk;
    if (k >= K) {
      k -= K;
      ++t;
    }
  }
};

// A pair's id in shared memory when the caller's id was bad (the view's ids are >= -1).
constexpr int32_t kBadPairId = -2;

// Pairs whose ids a thread loads together: decode's 2 pairs a thread in one round, 512 tokens of
// 9 slots in 3. Unrolled over more, the loads' code grows for calls that seldom come (the
// ranking's code is fetched cold after an L2 flush).
constexpr int kPairLoads = 4;

// The caller's ids (Id: int32, or int64 narrowed as caller_id does) of the next kPairLoads of
// this thread's pairs from w on, into ids; -1 for the shared expert's slot (RouteMap). The loads
// are in flight together, with no branch on the ids' width per id (load_ids).
template <class Id>
__device__ __forceinline__ void stage_pair_ids(const void* topk_ids, const RouteMap& rm,
                                               PairWalk& w, int32_t n, int32_t* ids) {
  const int32_t i0 = w.i;
  int32_t v[kPairLoads];
#pragma unroll
  for (int u = 0; u < kPairLoads; ++u, w.next()) {
    v[u] = -1;
    if (w.i < n && w.k < rm.top_k) {  // topk_ids[t][k], of the caller's K columns
      const Id id = static_cast<const Id*>(topk_ids)[w.i - w.t * rm.shared];
      if constexpr (sizeof(Id) == 8)
        v[u] = narrow_id(id);
      else
        v[u] = id;
    }
  }
#pragma unroll
  for (int u = 0; u < kPairLoads; ++u)
    if (i0 + u * kThreads < n) ids[i0 + u * kThreads] = v[u];
}

// Ranks the call's tokens in shared memory, the (token, slot) pairs spread over the block's
// threads; true if any id is bad (block 0 has recorded it). Every block finds the same. The
// bitmaps and the error match a walk of each token's slots in order (enter_ids): a token's bit
// is set in the word of each expert and destination rank it reaches, and the error recorded for
// a token is its first bad slot's: a bad id, or a duplicate (an id an earlier slot of the token
// holds in the view: with skip_a2a, among this rank's experts only), named by the caller's id.
__device__ bool rank_local(const DispatchParams& p, unsigned long long seq, char* smem,
                           LocalRanks& lr) {
  const GroupView& g = p.g;
  // A copy: in registers, so its derived values (RouteMap::slot_expert's divisions) are worked
  // out once, not reloaded around each of the loops' shared-memory stores.
  const RouteMap rm = g.route;
  const ExpertMap em = g.experts();
  const int32_t nk = em.num_keys(), n_local = em.n_local();
  const int32_t K = g.top_k, T = p.num_tokens, n = T * K;
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(smem);
  uint16_t* warp_prefix = reinterpret_cast<uint16_t*>(bitmap + kWarps * nk);
  int32_t* totals = reinterpret_cast<int32_t*>(smem + LocalRanks::totals_offset(nk));
  int32_t* first_bad = reinterpret_cast<int32_t*>(smem + LocalRanks::first_bad_offset(nk));
  int32_t* ids = reinterpret_cast<int32_t*>(smem + LocalRanks::pair_ids_offset(nk, T));
  const int32_t used = (T + kWarpSize - 1) / kWarpSize;  // warps with tokens
  const PairWalk mine(K);
  for (PairWalk w = mine; w.i < n;) {
    if (p.id_bytes == 8)
      stage_pair_ids<int64_t>(p.topk_ids, rm, w, n, ids);
    else
      stage_pair_ids<int32_t>(p.topk_ids, rm, w, n, ids);
  }
  for (int32_t i = threadIdx.x; i < used * nk; i += kThreads)
    bitmap[i] = 0;
  if (threadIdx.x < T) first_bad[threadIdx.x] = K;  // no bad slot yet
#pragma unroll 1
  for (PairWalk w = mine; w.i < n; w.next()) {
    // Each pair's id becomes the view's (kBadPairId for a bad one: masked), in place: every
    // pair then compares its id with its token's earlier slots' in the view, as enter_ids'
    // bitmap does.
    const int32_t id = ids[w.i];
    ids[w.i] = id < -1 || id >= rm.n_experts ? kBadPairId : rm.slot_expert(id, w.k, w.t, T);
  }
  __syncthreads();
  // Block 0 keeps the validated ids for combine (its own loop: inside the one above, the
  // compiler made that loop twice over, with and without the store).
  const bool record = blockIdx.x == 0;
  if (record) {
    int32_t* topk = p.scratch.topk;
    for (int32_t i = threadIdx.x; i < n; i += kThreads)
      topk[i] = ids[i] < 0 ? -1 : ids[i];
  }
  // A pair sets its token's bit in its expert's word, and in its rank's unless an earlier slot
  // of the token reached that rank (the one bit, set once). A bad id or a duplicate offers its
  // slot as the token's first bad one.
  bool bad = false;
#pragma unroll 1
  for (PairWalk w = mine; w.i < n; w.next()) {
    const int32_t id = ids[w.i];
    bool wrong = id == kBadPairId;
    if (id >= 0) {
      const int32_t r = em.rank_of(id), lo = r * n_local, hi = lo + n_local;
      bool rank_seen = false;
      for (int32_t j = w.i - w.k; j < w.i; ++j) {
        wrong |= ids[j] == id;
        rank_seen |= ids[j] >= lo && ids[j] < hi;
      }
      uint32_t* bm = bitmap + (w.t / kWarpSize) * nk;
      const uint32_t bit = 1u << (w.t % kWarpSize);
      atomicOr(&bm[id], bit);
      if (!rank_seen) atomicOr(&bm[em.rank_key(r)], bit);
    }
    if (wrong) {
      atomicMin(&first_bad[w.t], w.k);
      bad = true;
    }
  }
  bad = __syncthreads_or(bad);
  // Block 0 reports each bad token's first bad slot (record_error keeps the first report of
  // all, so a token's later slots could never have shown), naming the caller's id.
  if (bad && record && threadIdx.x < T && first_bad[threadIdx.x] < K) {
    const int32_t t = threadIdx.x, k = first_bad[t];
    const int32_t id = k < rm.top_k ? caller_id(p, int64_t(t) * rm.top_k + k) : -1;
    const bool outside = id < -1 || id >= rm.n_experts;
    record_error(g, outside ? ErrorCode::kBadExpertId : ErrorCode::kDuplicateExpert,
                 kOpDispatchSend, 0, t, k, id, kWaitNone);
    atomicMax(&g.state->bad_input, seq);
  }
  prefix_keys(bitmap, warp_prefix, nk, used, totals);
  __syncthreads();
  lr = LocalRanks{bitmap, warp_prefix, totals, nk};
  return bad;
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
