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
// topk_ids (valid: the call's ids passed enter_ids) and weights.
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
// (stage trace, docs/results/2026-11-21_h200x4_96383ca_stage_trace.md). `record`: this block reports bad ids and keeps the validated copy for combine
// (the low-latency path's blocks all rank the same tokens; block 0 records).
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
  // Shared memory: the bitmaps and warp prefixes (as the throughput path's ranking), then totals.
  __host__ __device__ static int64_t totals_offset(int32_t nk) {
    return align_up(int64_t(kWarps) * nk * (sizeof(uint32_t) + sizeof(uint16_t)), 16);
  }
  __host__ __device__ static int64_t smem_bytes(int32_t nk) {
    return totals_offset(nk) + 4 * int64_t(nk);
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

// Ranks the call's tokens (one per thread) in shared memory; true if any id is bad (block 0
// has recorded it). Every block finds the same.
__device__ bool rank_local(const DispatchParams& p, unsigned long long seq, char* smem,
                           LocalRanks& lr) {
  const int32_t nk = p.g.experts().num_keys();
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(smem);
  uint16_t* warp_prefix = reinterpret_cast<uint16_t*>(bitmap + kWarps * nk);
  int32_t* totals = reinterpret_cast<int32_t*>(smem + LocalRanks::totals_offset(nk));
  const int32_t used = (p.num_tokens + kWarpSize - 1) / kWarpSize;  // warps with tokens
  const int32_t t = threadIdx.x;
  int32_t ids[kMaxTopK];
  if (t < p.num_tokens) load_ids(p, t, ids);  // in flight while the bitmaps are cleared
  for (int32_t i = threadIdx.x; i < used * nk; i += kThreads)
    bitmap[i] = 0;
  __syncthreads();
  bool bad = false;
  if (t < p.num_tokens)
    enter_ids(p, t, seq, bitmap + (t / kWarpSize) * nk, ids, blockIdx.x == 0, bad);
  bad = __syncthreads_or(bad);
  prefix_keys(bitmap, warp_prefix, nk, used, totals);
  __syncthreads();
  lr = LocalRanks{bitmap, warp_prefix, totals, nk};
  return bad;
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
