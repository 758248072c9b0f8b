// Dispatch over NVLink peer stores (docs/design.md has the protocol in full).
//
// Per call `seq` (= dispatch calls completed on this rank + 1; every rank counts the same calls,
// so seq agrees across ranks without any exchange):
//  send  1. rank: every (token, key) gets its position among this rank's tokens carrying that
//           key (keys = experts and destination ranks, layout.h ExpertMap), stable by token
//           index so outputs are deterministic; units of 512 tokens are ranked by one block with
//           per-warp lane bitmaps, a grid-wide scan over units finishes. The same pass
//           validates topk_ids (a bad rank records the error and sends nothing) and records
//           where each 16-token chunk starts in each destination stream.
//        2. wait until every destination acknowledged the previous call, then write the meta
//           record (counts per group, message count, chunk starts) and release its seq word.
//        3. chunk by chunk, one message per (token, destination rank): header (token, and for
//           each of its experts on that rank: group, top-k slot, position) + payload (bf16, or
//           codes + scales quantised in registers), then the chunk's arrival flag.
//  recv  4. wait for every source's meta; derive row_offsets (format padding included) and each
//           (source, group) base row; write padding rows and unused scale slots; then expand
//           each chunk as its flag arrives (one wire copy, many output rows).
//        5. the last block to finish releases kDispatchAck[me] = seq in every source and bumps
//           the local dispatch_seq.
// The fused kernel runs 1-2 on every block, then splits the grid: senders do 3, receivers 4.
#include <cub/block/block_scan.cuh>

#include <mutex>
#include <utility>

#include "epcomm/config.h"
#include "epcomm/detail/bulk.cuh"
#include "epcomm/detail/device.cuh"
#include "kernels/kernels.h"
#include "kernels/quant_unit.cuh"

namespace epcomm {
namespace detail {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kUnitTokens = kWarps * kWarpSize;  // tokens ranked together by one block
constexpr int kUnroll = 4;                       // 16-byte vectors in flight per lane

// ---- 1. ranking -----------------------------------------------------------------------------

// Token t's row of topk_ids (the caller's K columns), every load in flight together.
__device__ __forceinline__ void load_ids(const DispatchParams& p, int32_t t,
                                         int32_t (&ids)[kMaxTopK]) {
  const int32_t K = p.g.route.top_k;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k)
    if (k < K) ids[k] = p.topk_ids[int64_t(t) * K + k];
}

// The view's expert and router weight of slot k of token t (RouteMap), from the caller's
// topk_ids (valid: the call's ids passed enter_ids) and weights.
__device__ __forceinline__ int32_t view_expert(const DispatchParams& p, int32_t t, int32_t k) {
  const RouteMap& rm = p.g.route;
  const int32_t id = k < rm.top_k ? p.topk_ids[int64_t(t) * rm.top_k + k] : -1;
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
// 60 KB of straight-line code, and fetching it after an L2 flush took 14 us per 512-token unit (x4
// H200, stage trace). `record`: this block reports bad ids and keeps the validated copy for combine
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
    const int32_t caller_id = id;  // errors name the caller's expert id
    id = g.route.slot_expert(id, k, t, p.num_tokens);
    ids[k] = id;
    if (record) p.scratch.topk[int64_t(t) * K + k] = id;
    if (id < 0) continue;
    if (atomicOr(&bm[id], bit) & bit) {
      if (record)
        record_error(g, ErrorCode::kDuplicateExpert, kOpDispatchSend, 0, t, k, caller_id,
                     kWaitNone);
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

  for (int32_t u = blockIdx.x; u < n_units; u += gridDim.x) {
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
  for (int32_t key = blockIdx.x * kThreads + threadIdx.x; key < nk; key += gridDim.x * kThreads) {
    int32_t run = 0;
    for (int32_t u = 0; u < n_units; ++u) {
      p.scratch.unit_prefix[int64_t(u) * nk + key] = run;
      run += p.scratch.unit_hist[int64_t(u) * nk + key];
    }
    p.scratch.unit_prefix[int64_t(n_units) * nk + key] = run;
  }
}

// ---- 2. meta records --------------------------------------------------------------------------

// Where chunk c (< num_chunks(T)) starts in destination d's stream from this rank, from the
// ranking scratch.
__device__ __forceinline__ int32_t stream_chunk_start(const DispatchParams& p, int32_t c,
                                                      int32_t d) {
  const ExpertMap em = p.g.experts();
  const int32_t nk = em.num_keys();
  const int32_t unit = c * kChunkTokens / kUnitTokens;
  return p.scratch.unit_prefix[int64_t(unit) * nk + em.rank_key(d)] +
         p.scratch.chunk_pos[int64_t(c) * p.g.n_ranks + d];
}

// Destination d's meta record of this call, written by one whole warp: count(j) tokens for
// local group j, stream_count messages, n_chunks chunks starting at chunk_start(c) (c <=
// n_chunks), then the release of its seq word.
template <class Count, class ChunkStart>
__device__ void write_meta(const GroupView& g, unsigned long long seq, int32_t d, Count count,
                           int32_t stream_count, int32_t n_chunks, ChunkStart chunk_start) {
  const int lane = threadIdx.x % kWarpSize;
  const MetaLayout ml = g.layout().meta();
  const bool far = remote(g, d);  // staged in the outbox, then put
  char* meta = far ? outbox_at(g, g.outbox_layout().meta_offset(g.nodes().remote_index(g.rank, d)))
                   : window_at(g, d, g.layout().meta_offset(g.rank));
  int32_t* counts = reinterpret_cast<int32_t*>(meta + ml.counts_offset());
  for (int32_t j = lane; j < g.n_local(); j += kWarpSize)
    counts[j] = count(j);
  if (lane == 0) {
    *reinterpret_cast<int32_t*>(meta + ml.stream_count_offset()) = stream_count;
    *reinterpret_cast<int32_t*>(meta + ml.n_chunks_offset()) = n_chunks;
  }
  int32_t* starts = reinterpret_cast<int32_t*>(meta + ml.chunk_start_offset());
  for (int32_t c = lane; c <= n_chunks; c += kWarpSize)
    starts[c] = c == n_chunks ? stream_count : chunk_start(c);
  __syncwarp();
  if (far) {  // the record after its seq word, then seq as the put's signal
    const int64_t at = g.layout().meta_offset(g.rank);
    warp_put(g, d, at + ml.stream_count_offset(), meta + ml.stream_count_offset(),
             ml.bytes() - ml.stream_count_offset(), at + ml.seq_offset(), seq);
  } else if (lane == 0) {
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<unsigned long long*>(meta + ml.seq_offset()), seq);
  }
}

__device__ void send_meta(const DispatchParams& p, unsigned long long seq, bool bad) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t nk = em.num_keys(), n_local = g.n_local();
  const int warp = threadIdx.x / kWarpSize;
  const int32_t n_units = (p.num_tokens + kUnitTokens - 1) / kUnitTokens;
  const int32_t* totals = p.scratch.unit_prefix + int64_t(n_units) * nk;
  for (int32_t d = warp; d < g.n_ranks; d += kWarps) {
    write_meta(
        g, seq, d, [&](int32_t j) { return bad ? 0 : totals[d * n_local + j]; },
        bad ? 0 : totals[em.rank_key(d)], bad ? 0 : num_chunks(p.num_tokens),
        [&](int32_t c) { return stream_chunk_start(p, c, d); });
  }
}

// ---- 3. messages ------------------------------------------------------------------------------

// The codes of this lane's unit and the next ones, gathered into the 16 bytes the first lane of
// each pack stores (the other lanes' results are unused). Called by all 32 lanes.
__device__ __forceinline__ uint4 pack_codes16(uint2 c) {  // e4m3: 2 units
  return make_uint4(c.x, c.y, __shfl_down_sync(0xffffffffu, c.x, 1),
                    __shfl_down_sync(0xffffffffu, c.y, 1));
}
__device__ __forceinline__ uint4 pack_codes16(uint32_t c) {  // e2m1: 4 units
  return make_uint4(c, __shfl_down_sync(0xffffffffu, c, 1), __shfl_down_sync(0xffffffffu, c, 2),
                    __shfl_down_sync(0xffffffffu, c, 3));
}

// Quantises one bf16 row of `hidden` values into the payload of each of n_dest messages: codes
// (unit u's 8 codes at byte u * 8 or u * 4, stored 16 bytes at a time), then the row's scales
// (scale b at scales_offset + b * scale bytes). All 32 lanes step together (lanes past the row's
// end carry zeros), so the shuffles of a block's amax never sit in a loop whose trip count
// differs by lane. Each step quantises kUnroll units per lane before it stores any: they are
// independent, and a sender warp is bound by its own instruction latency (one block per SM, 4
// warps per scheduler), so the overlap is what keeps the SM issuing.
// Units [unit_begin, unit_end) of the row (the low-latency path quantises one part per warp).
template <TokenFormat F>
__device__ void quantize_to(const uint16_t* row, int32_t hidden, float gs, const MessageLayout& ml,
                            char* const* payload, int32_t n_dest, int32_t unit_begin,
                            int32_t unit_end) {
  using Quant = typename BlockQuantOf<F>::type;
  constexpr int32_t kLanes = Quant::kGroup / kLaneValues;  // lanes per scale block
  // Units per 16-byte store: a unit's 8 codes take kCodeBits bytes, so 2 (e4m3) or 4 (e2m1).
  constexpr int kPack = 16 / Quant::kCodeBits;
  using Scale = decltype(stored_scale(std::declval<const Quant&>()));
  const int lane = threadIdx.x % kWarpSize;
  const int32_t units = unit_end < hidden / kLaneValues ? unit_end : hidden / kLaneValues;
  const int64_t scales_at = ml.scales_offset() - ml.payload_offset();
  for (int32_t base = unit_begin; base < units; base += kWarpSize * kUnroll) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int32_t unit = base + k * kWarpSize + lane;
      raw[k] = unit < units ? ld_nc_v4(row + int64_t(unit) * kLaneValues) : make_uint4(0, 0, 0, 0);
    }
    // The codes of kPack adjacent units go out as one 16-byte store by the first lane of each
    // pack (units per row are a multiple of 4).
    uint4 packed[kUnroll];
    Scale scale[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      float z[kLaneValues];
      unpack_bf16x8(raw[k], z);
      const Quant q = make_block_quant<F>(lanes_amax<kLanes>(z), gs);
      packed[k] = pack_codes16(encode_unit(q, z));
      scale[k] = stored_scale(q);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int32_t unit = base + k * kWarpSize + lane;
      if (unit >= units) break;  // so are this lane's later units
      for (int32_t j = 0; j < n_dest; ++j) {
        if (lane % kPack == 0) st_v4(payload[j] + int64_t(unit / kPack) * 16, packed[k]);
        if (unit % kLanes == 0)
          reinterpret_cast<Scale*>(payload[j] + scales_at)[unit / kLanes] = scale[k];
      }
    }
  }
}

// Chunk arrival flags, raised by the last of a sender block's warps to finish its token of the
// chunk, while the other warps go on to their next tokens: a block-wide barrier per chunk left
// the block's stores draining with nothing new issued while thread 0 fenced (8 senders moved
// ~200 GB/s on 4 x H200 where the plain store kernel moves 326 GB/s with 8 blocks, nvlink_probe).
// Each warp counts its arrival in the ring slot of its chunk iteration; a warp up to
// kSignalRing iterations ahead waits (on shared memory only) for the slot's previous round.
constexpr int32_t kSignalRing = 4;
struct ChunkSignals {
  int32_t* arrivals;  // [kSignalRing] in shared memory, cumulative per slot

  __device__ void init() const {
    if (threadIdx.x < kSignalRing) arrivals[threadIdx.x] = 0;
    __syncthreads();
  }
  // Called by a whole warp after its stores for chunk `chunk`, its iteration `it` of the
  // block's loop. Ordering: the lanes' stores -> __syncwarp -> lane 0's CTA-scope release of its
  // arrival -> the last warp's read of it -> that warp's system fence -> the flags (relaxed
  // stores after the fence: a release pattern), so each destination that acquires a flag sees
  // every warp's stores of the chunk.
  __device__ void arrive(const GroupView& g, int32_t chunk, int32_t it,
                         unsigned long long seq) const {
    const WindowLayout wl = g.layout();
    __syncwarp();
    int32_t last = 0;
    if (threadIdx.x % kWarpSize == 0) {
      volatile int32_t* slot = arrivals + it % kSignalRing;
      const int32_t round = it / kSignalRing;
      while (*slot < round * kWarps) {  // the slot's previous chunk is not complete yet
      }
      __threadfence_block();
      if (atomicAdd(const_cast<int32_t*>(slot), 1) == (round + 1) * kWarps - 1) {
        last = 1;
        __threadfence_system();
        for (int32_t d = 0; d < g.n_ranks; ++d)
          if (!remote(g, d))
            st_relaxed_sys(reinterpret_cast<unsigned long long*>(
                               window_at(g, d, wl.chunk_flag_offset(g.rank, chunk))),
                           seq);
      }
    }
    __syncwarp();
    // Ranks of other nodes: every warp put (and completed) its messages before it arrived, so
    // the flag goes as a signal alone.
    if (any_remote(g) && threadIdx.x % kWarpSize == 0 && last)
      for (int32_t d = 0; d < g.n_ranks; ++d)
        if (remote(g, d)) remote_signal(g, d, wl.chunk_flag_offset(g.rank, chunk), seq, false);
    __syncwarp();
  }
};

// Message `slot` of this rank's stream to rank d: its offset in d's window, and where this rank
// writes it (d's window; for a rank of another node, the outbox slice that mirrors it, put
// from there).
__device__ __forceinline__ int64_t message_offset(const GroupView& g, int32_t slot) {
  return g.layout().dispatch_recv_offset() + g.layout().dispatch_recv().offset(g.rank, slot);
}
__device__ __forceinline__ char* message_at(const GroupView& g, int32_t d, int32_t slot) {
  if (!remote(g, d)) return window_at(g, d, message_offset(g, slot));
  return outbox_at(g, g.outbox_layout().stream_offset(g.nodes().remote_index(g.rank, d)) +
                          int64_t(slot) * g.layout().msg().bytes());
}

// Where one token goes, one value per lane: lane k < K holds top-k slot k (its expert id, -1 if
// masked; its position among this rank's tokens for that expert; its router weight), lane l the
// token's message slot in the streams of destinations l (`slot`) and l + 32 (`slot_hi`) (-1: not
// sent there).
struct LaneRoute {
  int32_t id = -1, pos = 0, slot = -1, slot_hi = -1;
  float weight = 0.0f;
  // Whole warp: the destinations (bit r: rank r), and the slot in rank r's stream.
  __device__ RankMask dests() const {
    return RankMask(__ballot_sync(0xffffffffu, slot >= 0)) |
           (RankMask(__ballot_sync(0xffffffffu, slot_hi >= 0)) << 32);
  }
  __device__ int32_t slot_of(int32_t r) const {
    const int32_t lo = __shfl_sync(0xffffffffu, slot, r % kWarpSize);
    const int32_t hi = __shfl_sync(0xffffffffu, slot_hi, r % kWarpSize);
    return r < kWarpSize ? lo : hi;
  }
};

// The throughput path's route: positions from the grid-wide ranking scratch.
__device__ LaneRoute route_from_scratch(const DispatchParams& p, int32_t t) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t K = g.top_k;
  const int lane = threadIdx.x % kWarpSize;
  const int32_t* prefix = p.scratch.unit_prefix + int64_t(t / kUnitTokens) * em.num_keys();
  LaneRoute r;
  if (lane < K) {
    r.id = p.scratch.topk[int64_t(t) * K + lane];
    if (r.id >= 0) {
      r.pos = prefix[r.id] + p.scratch.expert_pos[int64_t(t) * K + lane];
      r.weight = view_weight(p, t, lane);
    }
  }
  for (int32_t d = lane, i = 0; i < 2; d += kWarpSize, ++i) {
    if (d >= g.n_ranks) break;
    int32_t s = p.scratch.dest_pos[int64_t(t) * g.n_ranks + d];
    if (s >= 0) s += prefix[em.rank_key(d)];
    (i == 0 ? r.slot : r.slot_hi) = s;
  }
  return r;
}

// A token's destinations go at most one per top-k slot (kMaxDests), taken kDestBatch at a
// time in rank order: a batch's messages are written in one pass over the token (each value
// loaded once per batch). Up to 8 destinations (every group of up to 8 ranks, every K <= 8) is
// one batch; a larger Dests array cost decode-bf16 dispatch 42.8 -> 49.5 us (one H100, 132
// blocks; it lives in local memory).
constexpr int32_t kMaxDests =
    kMaxTopK < WindowLayout::kMaxPeers ? kMaxTopK : WindowLayout::kMaxPeers;
constexpr int32_t kDestBatch = 8;
struct Dests {
  int32_t n = 0;
  int32_t rank[kDestBatch];
  int32_t slot[kDestBatch];
  char* payload[kDestBatch];
};

// Token t's message to every destination rank it goes to: the header when `headers`, and the
// payload's units [unit_begin, unit_end) (8 values each: bf16 copied, the other formats
// quantised in registers). Whole warp. Calls sent(batch) after each batch of destinations.
template <TokenFormat F, class Sent>
__device__ void send_token(const DispatchParams& p, int32_t t, const LaneRoute& r,
                           int32_t unit_begin, int32_t unit_end, bool headers, Sent sent) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const MessageLayout ml = g.layout().msg();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t dest = r.id >= 0 ? em.rank_of(r.id) : -1;
  const RankMask dest_mask = r.dests();
  const char* src = static_cast<const char*>(p.tokens) + int64_t(t) * g.hidden * 2;
  const int32_t units = g.hidden / kLaneValues;
  if (lane == 0 && unit_begin == 0 && unit_end >= units) prefetch_l2(src, uint32_t(g.hidden) * 2);
  unit_end = unit_end < units ? unit_end : units;
  for (RankMask left = dest_mask; left;) {
    Dests d;
    for (; left && d.n < kDestBatch; left &= left - 1) {
      const int32_t rank = __ffsll(left) - 1;
      const int32_t s = r.slot_of(rank);
      char* msg = message_at(g, rank, s);
      const uint32_t mine = __ballot_sync(0xffffffffu, dest == rank);
      if (headers) {
        MessageHeader* h = reinterpret_cast<MessageHeader*>(msg);
        if (dest == rank)
          h->entries[__popc(mine & lanemask_lt())] =
              MessageEntry::make(em.local_of(r.id), lane, r.pos, r.weight);
        if (lane == 0) {
          h->token = t;
          h->n_entries = int16_t(__popc(mine));
          h->rank_slot = int16_t(rank_slot_of(dest_mask, rank));
        }
      }
      d.rank[d.n] = rank;
      d.slot[d.n] = s;
      d.payload[d.n++] = msg + ml.payload_offset();
    }
    if constexpr (F == TokenFormat::kBF16) {  // a unit is one 16-byte vector
      copy_vectors(src + int64_t(unit_begin) * 16, unit_end - unit_begin, d.n, LoadNc{},
                   [&](int32_t j) { return d.payload[j] + int64_t(unit_begin) * 16; });
    } else {
      quantize_to<F>(reinterpret_cast<const uint16_t*>(src), g.hidden, g.nvfp4_global_scale, ml,
                     d.payload, d.n, unit_begin, unit_end);
    }
    sent(d);
  }
}

// Sender block `sender` of n_senders takes chunks sender, sender + n_senders, ...: warp w sends
// the chunk's token w; the last warp to finish the chunk raises its flag.
template <TokenFormat F>
__device__ void send_messages(const DispatchParams& p, int32_t num_tokens, int32_t sender,
                              int32_t n_senders, unsigned long long seq) {
  static_assert(kChunkTokens == kWarps, "one token of a chunk per warp");
  __shared__ int32_t arrivals[kSignalRing];
  const ChunkSignals signals{arrivals};
  signals.init();
  int32_t it = 0;
  for (int32_t chunk = sender; chunk < num_chunks(num_tokens); chunk += n_senders, ++it) {
    const int32_t t = chunk * kChunkTokens + threadIdx.x / kWarpSize;
    if (t < num_tokens) {
      send_token<F>(p, t, route_from_scratch(p, t), 0, p.g.hidden / kLaneValues, true,
                    [&](const Dests& d) {
                      if (!any_remote(p.g)) return;
                      // The messages staged for ranks of other nodes: put.
                      __syncwarp();
                      const MessageLayout ml = p.g.layout().msg();
                      for (int32_t j = 0; j < d.n; ++j)
                        if (remote(p.g, d.rank[j]))
                          warp_put(p.g, d.rank[j], message_offset(p.g, d.slot[j]),
                                   d.payload[j] - ml.payload_offset(), ml.bytes());
                    });
      if (any_remote(p.g)) put_quiet();  // completed before this warp arrives on the chunk
    }
    signals.arrive(p.g, chunk, it, seq);
  }
  if (any_remote(p.g)) put_quiet();  // the chunk flags' signals too, before the next call
}

// Ranking uses every block; then blocks [0, n_senders) send (the others go on to receive, in
// the fused kernel).
template <TokenFormat F>
__device__ __noinline__ bool dispatch_send(const DispatchParams& p, unsigned long long seq, char* smem,
                              int32_t n_senders) {
  const GroupView& g = p.g;
  const int32_t nk = g.experts().num_keys();
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(smem);
  uint16_t* warp_prefix = reinterpret_cast<uint16_t*>(bitmap + kWarps * nk);
  for (int32_t i = threadIdx.x; i < kWarps * nk; i += kThreads) bitmap[i] = 0;
  __syncthreads();

  rank_units(p, seq, bitmap, warp_prefix);
  trace_mark(g, kTraceDispatch, kTraceRanked);
  if (!grid_barrier(g)) return false;
  scan_units(p);
  if (!grid_barrier(g)) return false;
  trace_mark(g, kTraceDispatch, kTraceRouted);
  if (int32_t(blockIdx.x) >= n_senders) return true;

  const bool bad = *reinterpret_cast<volatile unsigned long long*>(&g.state->bad_input) == seq;
  const int32_t num_tokens = bad ? 0 : p.num_tokens;
  if (blockIdx.x == 0 && threadIdx.x == 0) g.state->num_tokens = num_tokens;

  // The destinations must have finished reading the previous call's messages.
  if (!block_wait_signal(g, all_ranks_mask(g), WindowLayout::kDispatchAck, kOpDispatchSend,
                         kWaitAck, [&](int32_t) { return seq - 1; }))
    return false;
  trace_mark(g, kTraceDispatch, kTraceAcked);
  if (int32_t(blockIdx.x) == n_senders - 1) send_meta(p, seq, bad);
  send_messages<F>(p, num_tokens, blockIdx.x, n_senders, seq);
  trace_mark(g, kTraceDispatch, kTraceSent);
  return true;
}

// ---- the low-latency path: send ------------------------------------------------------------
// (Config::dispatch_path, T <= kUnitTokens.) No grid-wide barrier: every block ranks all of the
// call's tokens in shared memory, so each knows every position it needs; block 0 writes the
// meta records and keeps the validated ids for combine; then the grid's warps take (token,
// part) pieces in turn, each stored to every destination and announced by its own part flag
// (seq: nothing is reset between calls).

constexpr int32_t kPartUnits = kPartValues / kLaneValues;  // 16-byte bf16 units per part
static_assert(kPartUnits == kWarpSize * kUnroll, "a part is one step of quantize_to");
static_assert(kUnitTokens >= kLowLatencyMaxTokens, "one block ranks a low-latency call");

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

// Whole warp: part `part` of message `slot` of this rank's stream to `d`, a rank of another
// node, from the outbox into d's receive buffer; then its part flag.
__device__ void put_part(const GroupView& g, int32_t d, int32_t slot, int32_t part,
                         unsigned long long seq) {
  const WindowLayout wl = g.layout();
  const MessageLayout ml = wl.msg();
  const int64_t at = message_offset(g, slot);
  const char* src = message_at(g, d, slot);
  if (part == 0) warp_put(g, d, at, src, ml.header_bytes());
  warp_put(g, d, at + ml.part_codes_offset(part), src + ml.part_codes_offset(part),
           ml.part_codes_bytes(part));
  put_fence();
  warp_put(g, d, at + ml.part_scales_offset(part), src + ml.part_scales_offset(part),
           ml.part_scales_bytes(part), wl.part_flag_offset(g.rank, slot, part), seq);
}

template <TokenFormat F>
__device__ __noinline__ bool ll_send(const DispatchParams& p, unsigned long long seq, char* smem) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t K = g.top_k, n_local = g.n_local();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  // The destinations must have finished reading the previous call's messages: their acks are
  // loaded now, in flight during the ranking, and waited for only if one was not in yet.
  unsigned long long ack = seq - 1;
  if (threadIdx.x < g.n_ranks)
    ack = ld_acquire_sys(signal_word(g, g.rank, WindowLayout::kDispatchAck, threadIdx.x));
  LocalRanks lr;
  const bool bad = rank_local(p, seq, smem, lr);
  trace_mark(g, kTraceDispatch, kTraceRanked);
  const int32_t num_tokens = bad ? 0 : p.num_tokens;
  if (blockIdx.x == 0 && threadIdx.x == 0) g.state->num_tokens = num_tokens;
  if (!__syncthreads_and(ack >= seq - 1) &&
      !block_wait_signal(g, all_ranks_mask(g), WindowLayout::kDispatchAck, kOpDispatchSend,
                         kWaitAck, [&](int32_t) { return seq - 1; }))
    return false;
  trace_mark(g, kTraceDispatch, kTraceAcked);
  if (blockIdx.x == 0)
    for (int32_t d = warp; d < g.n_ranks; d += kWarps)
      write_meta(
          g, seq, d, [&](int32_t j) { return bad ? 0 : lr.totals[d * n_local + j]; },
          bad ? 0 : lr.totals[em.rank_key(d)], 0, [](int32_t) { return 0; });

  const WindowLayout wl = g.layout();
  const int32_t n_parts = num_parts(g.hidden);
  const int64_t items = int64_t(num_tokens) * n_parts;
  // Rounds of one piece per warp. After each, one system fence per block, and thread 0 raises
  // the flags of the block's pieces: a fence per piece cost more than the pieces' stores (one
  // H100, decode-bf16, 896 pieces on 132 blocks: the last piece was flagged 10 us after the
  // first).
  __shared__ int32_t n_flags[kWarps], flag_part[kWarps];
  __shared__ int32_t flag_rank[kWarps][kMaxDests];
  __shared__ int32_t flag_slot[kWarps][kMaxDests];
  // Pieces are dealt from the first warp of the grid up; the receive deals its items from the
  // last warp down. (Dealing pieces round-robin over the blocks, so that every SM stores a
  // share, was slower: one H100, decode-bf16, 132 blocks, 41.2 against 38.0 us; every block
  // then built its layout only after its own round.)
  for (int64_t round = int64_t(blockIdx.x) * kWarps; round < items;
       round += int64_t(gridDim.x) * kWarps) {
    const int64_t i = round + warp;
    if (i < items) {
      const int32_t t = int32_t(i / n_parts), part = int32_t(i % n_parts);
      LaneRoute r;
      if (lane < K) {
        r.id = view_expert(p, t, lane);  // valid: the call is not bad
        if (r.id >= 0) {
          r.pos = lr.pos(t, r.id);
          r.weight = view_weight(p, t, lane);
        }
      }
      const int32_t dr = r.id >= 0 ? em.rank_of(r.id) : -1;
      const uint32_t lo = __reduce_or_sync(0xffffffffu, dr >= 0 && dr < kWarpSize ? 1u << dr : 0u);
      const uint32_t hi =
          __reduce_or_sync(0xffffffffu, dr >= kWarpSize ? 1u << (dr - kWarpSize) : 0u);
      if ((lo >> lane) & 1u) r.slot = lr.pos(t, em.rank_key(lane));
      if ((hi >> lane) & 1u) r.slot_hi = lr.pos(t, em.rank_key(lane + kWarpSize));
      if (lane == 0) {
        n_flags[warp] = 0;
        flag_part[warp] = part;
      }
      send_token<F>(p, t, r, part * kPartUnits, (part + 1) * kPartUnits, part == 0,
                    [&](const Dests& d) {
                      // Ranks of other nodes: this warp puts the piece it staged, with its flag
                      // as the signal.
                      if (any_remote(g)) {
                        __syncwarp();
                        for (int32_t j = 0; j < d.n; ++j)
                          if (remote(g, d.rank[j])) put_part(g, d.rank[j], d.slot[j], part, seq);
                      }
                      if (lane == 0) {
                        const int32_t n0 = n_flags[warp];
                        for (int32_t j = 0; j < d.n; ++j) {
                          flag_rank[warp][n0 + j] = d.rank[j];
                          flag_slot[warp][n0 + j] = d.slot[j];
                        }
                        n_flags[warp] = n0 + d.n;
                      }
                    });
    } else if (lane == 0) {
      n_flags[warp] = 0;
    }
    // Ordering: every warp's stores -> __syncthreads -> thread 0's system fence (acq_rel) -> its
    // relaxed flag stores (a release pattern): a destination that acquires a flag sees the
    // piece.
    __syncthreads();
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      for (int32_t w = 0; w < kWarps; ++w)
        for (int32_t j = 0; j < n_flags[w]; ++j)
          if (!remote(g, flag_rank[w][j]))
            st_relaxed_sys(reinterpret_cast<unsigned long long*>(window_at(
                               g, flag_rank[w][j],
                               wl.part_flag_offset(g.rank, flag_slot[w][j], flag_part[w]))),
                           seq);
    }
    __syncthreads();  // the flag lists are refilled next round
  }
  // Every put and signal of this call completed before the kernel ends: a receiver may
  // acknowledge without waiting for them (a call it rejects), and the next call reuses the
  // outbox and the flags.
  if (any_remote(g)) put_quiet();
  trace_mark(g, kTraceDispatch, kTraceSent);
  return true;
}

// ---- 4. receive -------------------------------------------------------------------------------

// The receiver's view of this call's groups, in shared memory (filled by dispatch_recv).
struct RecvGroups {
  int32_t* counts;        // [n_ranks][n_local]: tokens source s sends to group g
  int32_t* base;          // [n_ranks][n_local]: first output row of source s in group g
  int32_t* stream_count;  // [n_ranks]: messages from source s
  int32_t* row_offset;    // [n_local + 1]: row_offsets (FP8: padded group counts)
  int32_t* rows;          // [n_local]: rows that arrive in group g (m_g, unpadded)
  int32_t* tile_start;    // [n_local + 1]: swizzled formats: first scale tile of group g
  int32_t* n_chunks;      // [n_ranks]: chunks source s sends

  __host__ __device__ static int64_t smem_words(int32_t n_ranks, int32_t n_local) {
    return 3 * int64_t(n_ranks) * n_local + 2 * int64_t(n_ranks) + 3 * int64_t(n_local) + 2;
  }
  __device__ static RecvGroups carve(char* smem, int32_t n_ranks, int32_t n_local) {
    int32_t* w = reinterpret_cast<int32_t*>(smem);
    RecvGroups r;
    r.counts = w;
    r.base = r.counts + n_ranks * n_local;
    r.stream_count = r.base + n_ranks * n_local;
    r.row_offset = r.stream_count + n_ranks;
    r.rows = r.row_offset + n_local + 1;
    r.tile_start = r.rows + n_local;
    r.n_chunks = r.tile_start + n_local + 1;
    return r;
  }
};

// Writes scale columns [c_begin, c_end) of one message into output row `row` of group `grp`, in
// the format's output layout (c_end = the row's scale count: the rest of the row too). Called
// by the whole warp.
template <TokenFormat F>
__device__ void place_scales(const DispatchParams& p, const RecvGroups& rg, const char* scales,
                             int32_t grp, int64_t row, int32_t c_begin, int32_t c_end) {
  const GroupView& g = p.g;
  const DispatchOutputLayout out = g.output();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t cols = format_scales_per_row(F, g.hidden);
  if constexpr (F == TokenFormat::kFp8Blockwise) {
    const Fp8ScaleLayout l = out.fp8();
    float* dst = static_cast<float*>(p.out_scales);
    for (int32_t c = c_begin + lane; c < c_end; c += kWarpSize)
      dst[l.offset(row, c)] = reinterpret_cast<const float*>(scales)[c];
  } else if constexpr (F == TokenFormat::kMxfp4) {
    const Mxfp4ScaleLayout l = out.mxfp4();
    uint8_t* dst = static_cast<uint8_t*>(p.out_scales);
    for (int32_t c = c_begin + lane; c < c_end; c += kWarpSize)
      dst[l.offset(row, c)] = reinterpret_cast<const uint8_t*>(scales)[c];
  } else {  // swizzled: four scale columns per aligned 32-bit word; columns past cols are zero
    const SwizzledScaleLayout l = out.swizzled();
    const int64_t scale_row = int64_t(rg.tile_start[grp]) * SwizzledScaleLayout::kTileRows +
                              (row - rg.row_offset[grp]);
    uint8_t* dst = static_cast<uint8_t*>(p.out_scales);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(scales);
    const int32_t w_end = c_end >= cols ? l.col_tiles() : c_end / SwizzledScaleLayout::kTileCols;
    for (int32_t w = c_begin / SwizzledScaleLayout::kTileCols + lane; w < w_end; w += kWarpSize) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < SwizzledScaleLayout::kTileCols; ++i) {
        const int32_t c = w * SwizzledScaleLayout::kTileCols + i;
        if (c < cols) word |= uint32_t(src[c]) << (8 * i);
      }
      *reinterpret_cast<uint32_t*>(dst + l.offset(scale_row, w * SwizzledScaleLayout::kTileCols)) =
          word;
    }
  }
}

// Expands units [unit_begin, unit_end) of message m of source src (8 values each: the whole
// message, or one part) into its rows: one wire copy, up to K output rows; the part at unit 0
// also writes the rows' src_info. Called by the whole warp.
template <TokenFormat F>
__device__ void expand_message(const DispatchParams& p, const RecvGroups& rg, int32_t src,
                               int32_t m, int32_t unit_begin, int32_t unit_end) {
  const GroupView& g = p.g;
  const WindowLayout wl = g.layout();
  const MessageLayout ml = wl.msg();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t n_local = g.n_local();
  const int64_t row_bytes = format_row_bytes(F, g.hidden);  // a multiple of 16 (Config)
  const int64_t row_limit = g.output().rows;
  char* out = static_cast<char*>(p.out_tokens);

  const char* msg = window_at(g, g.rank, wl.dispatch_recv_offset() + wl.dispatch_recv().offset(src, m));
  const int32_t units = g.hidden / kLaneValues;
  // A whole message: its payload into L2 at once, while the header is read.
  if (lane == 0 && unit_begin == 0 && unit_end >= units)
    prefetch_l2(msg + ml.payload_offset(), uint32_t(align_up(ml.payload_bytes(), 16)));
  const MessageHeader* h = reinterpret_cast<const MessageHeader*>(msg);
  MessageEntry e{};
  if (lane < g.top_k) e = h->entries[lane];  // with the header's words: one round trip
  const int32_t token = h->token;
  const int32_t n = min(int32_t(h->n_entries), g.top_k);
  int64_t row = -1;
  int32_t grp = -1;
  if (lane < n) {
    grp = e.group();
    if (grp < n_local) row = int64_t(rg.base[src * n_local + grp]) + e.pos;
    if (row >= row_limit) row = -1;  // never write outside the output
    if (row >= 0 && unit_begin == 0)
      p.src_info[row] = SrcInfo{token, int16_t(g.route.caller_rank(src)), int16_t(e.slot())};
    // This rank's own token: where its slot's row went, for the fused combine.
    if (src == g.rank && unit_begin == 0 && token >= 0 && token < g.max_tokens && e.slot() >= 0 &&
        e.slot() < g.top_k)
      p.scratch.self_row[int64_t(token) * g.top_k + e.slot()] = int32_t(row);
  }
  unit_end = unit_end < units ? unit_end : units;
  const int64_t unit_bytes = format_row_bytes(F, kLaneValues);  // 16, 8 or 4
  const int64_t first = unit_begin * unit_bytes;  // a multiple of 16: parts are whole vectors
  // The shuffles below sit in loops every lane runs the same number of times (n and the vector
  // count are the warp's).
  copy_vectors(msg + ml.payload_offset() + first,
               int32_t((unit_end - unit_begin) * unit_bytes / 16), n, LoadCoherent{},
               [&](int32_t j) {
                 const int64_t r = __shfl_sync(0xffffffffu, row, j);
                 return r < 0 ? nullptr : out + r * row_bytes + first;
               });
  if constexpr (F != TokenFormat::kBF16) {
    constexpr int32_t kUnitsPerScale = format_scale_group(F) / kLaneValues;
    for (int32_t j = 0; j < n; ++j) {
      const int64_t r = __shfl_sync(0xffffffffu, row, j);
      const int32_t gj = __shfl_sync(0xffffffffu, grp, j);
      if (r >= 0)
        place_scales<F>(p, rg, msg + ml.scales_offset(), gj, r, unit_begin / kUnitsPerScale,
                        unit_end / kUnitsPerScale);
    }
  }
}

// Output slots no message fills, written before any data arrives (they depend only on the
// counts): FP8's padding rows (src_info {-1,-1,-1}, zero codes, zero scales), and the swizzled
// layouts' unused scale slots (the rest of each group's last tile, and the tiles no group uses).
// Spread over every warp of the grid.
template <TokenFormat F>
__device__ void fill_padding(const DispatchParams& p, const RecvGroups& rg, int32_t rb,
                             int32_t n_rb) {
  const GroupView& g = p.g;
  const DispatchOutputLayout out = g.output();
  const int32_t n_local = g.n_local();
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warp = int64_t(rb) * kWarps + threadIdx.x / kWarpSize;
  const int64_t warps = int64_t(n_rb) * kWarps;
  if constexpr (F == TokenFormat::kFp8Blockwise) {
    constexpr int32_t kPad = Fp8ScaleLayout::kRowAlign - 1;  // padding rows per group, at most
    const Fp8ScaleLayout l = out.fp8();
    const int64_t row_bytes = out.row_bytes();
    for (int64_t i = warp; i < int64_t(n_local) * kPad; i += warps) {
      const int32_t grp = int32_t(i / kPad);
      const int64_t row = int64_t(rg.row_offset[grp]) + rg.rows[grp] + i % kPad;
      if (row >= rg.row_offset[grp + 1]) continue;
      if (lane == 0) p.src_info[row] = SrcInfo{-1, -1, -1};
      char* codes = static_cast<char*>(p.out_tokens) + row * row_bytes;
      for (int64_t v = lane; v < row_bytes / 16; v += kWarpSize)
        st_v4(codes + v * 16, make_uint4(0, 0, 0, 0));
      for (int32_t c = lane; c < l.cols(); c += kWarpSize)
        static_cast<float*>(p.out_scales)[l.offset(row, c)] = 0.0f;
    }
  } else if constexpr (format_swizzled(F)) {
    constexpr int64_t kTileRows = SwizzledScaleLayout::kTileRows;
    const SwizzledScaleLayout l = out.swizzled();
    uint8_t* scales = static_cast<uint8_t*>(p.out_scales);
    // The rest of every group's last tile: scale rows past its m_g rows.
    for (int64_t i = warp; i < int64_t(n_local) * kTileRows; i += warps) {
      const int32_t grp = int32_t(i / kTileRows);
      const int64_t r = i % kTileRows;  // row inside the group's last tile
      const int64_t tiles = rg.tile_start[grp + 1] - rg.tile_start[grp];
      if (tiles == 0 || (tiles - 1) * kTileRows + r < rg.rows[grp]) continue;
      const int64_t scale_row = (rg.tile_start[grp] + tiles - 1) * kTileRows + r;
      for (int32_t w = lane; w < l.col_tiles(); w += kWarpSize)
        *reinterpret_cast<uint32_t*>(scales + l.offset(scale_row, w * SwizzledScaleLayout::kTileCols)) =
            0u;
    }
    // Whole tiles past the last group's.
    const int64_t used = rg.tile_start[n_local] < l.row_tiles ? rg.tile_start[n_local] : l.row_tiles;
    const int64_t begin = l.tile_offset(used, 0) / 16, end = l.size() / 16;
    for (int64_t v = begin + int64_t(rb) * kThreads + threadIdx.x; v < end;
         v += int64_t(n_rb) * kThreads)
      st_v4(scales + v * 16, make_uint4(0, 0, 0, 0));
  }
}

// Every block of a fused or receive kernel arrives here once; the last one to arrive releases
// kDispatchAck[me] = seq in every source (its receive buffer is free again) and bumps the local
// dispatch_seq.
__device__ inline void dispatch_done(const GroupView& g, unsigned long long seq) {
  if (last_block_done(g, &g.state->dispatch_done) && threadIdx.x == 0) {
    for (int32_t s = 0; s < g.n_ranks; ++s)
      set_signal(g, s, WindowLayout::kDispatchAck, g.rank, seq);
    if (any_remote(g)) put_quiet();
    g.state->dispatch_seq = seq;
  }
}

// The warp waits until chunk `chunk` of source src has arrived; false after a timeout (recorded,
// naming src) or an abort.
__device__ inline bool warp_wait_chunk(const GroupView& g, int32_t src, int32_t chunk,
                                       unsigned long long seq) {
  const unsigned long long* flag = reinterpret_cast<const unsigned long long*>(
      window_at(g, g.rank, g.layout().chunk_flag_offset(src, chunk)));
  const bool ok = warp_wait_peers(g, rank_bit(src), kOpDispatchRecv, kWaitData,
                                  [&](int32_t) { return ld_acquire_sys(flag) >= seq; });
  __syncwarp();  // the other lanes read the chunk after lane src's acquire
  return ok;
}

// The low-latency path's twin: the warp waits until part `part` of message m of source src,
// and part 0 (the header), have arrived.
__device__ inline bool warp_wait_part(const GroupView& g, int32_t src, int32_t m, int32_t part,
                                      unsigned long long seq) {
  const WindowLayout wl = g.layout();
  const auto* head = reinterpret_cast<const unsigned long long*>(
      window_at(g, g.rank, wl.part_flag_offset(src, m, 0)));
  const auto* flag = reinterpret_cast<const unsigned long long*>(
      window_at(g, g.rank, wl.part_flag_offset(src, m, part)));
  const bool ok = warp_wait_peers(g, rank_bit(src), kOpDispatchRecv, kWaitData, [&](int32_t) {
    return ld_acquire_sys(flag) >= seq && ld_acquire_sys(head) >= seq;
  });
  __syncwarp();  // the other lanes read the part after lane src's acquire
  return ok;
}

// Checks what the sources announced before anything is written: every count, message count and
// chunk start in range (a peer's record is never trusted to stay inside the buffers), and the
// rows routed here within the receive capacity (Config::max_recv_rows). Every receiving block
// finds the same verdict; block rb == 0 records the error. Returns 0, kBadPeerData or
// kRecvCapacity.
template <class MetaAt>
__device__ int32_t check_sources(const DispatchParams& p, const RecvGroups& rg, const MetaLayout& ml,
                                 MetaAt meta_at, int32_t rb) {
  const GroupView& g = p.g;
  const int32_t n_local = g.n_local(), n_ranks = g.n_ranks;
  __shared__ int32_t bad_field, bad_src, bad_value;
  __shared__ unsigned long long routed_rows;  // rows routed here, over every source
  if (threadIdx.x == 0) {
    bad_field = 0;
    routed_rows = 0;
  }
  __syncthreads();
  auto flag = [&](int32_t field, int32_t s, int32_t v) {
    if (atomicCAS(&bad_field, 0, field) == 0) {
      bad_src = s;
      bad_value = v;
    }
  };
  if (threadIdx.x < n_ranks) {
    const int32_t s = threadIdx.x;
    if (rg.stream_count[s] < 0 || rg.stream_count[s] > g.max_tokens)
      flag(kFieldStreamCount, s, rg.stream_count[s]);
    else if (rg.n_chunks[s] < 0 || rg.n_chunks[s] > (g.low_latency ? 0 : ml.max_chunks))
      flag(kFieldChunks, s, rg.n_chunks[s]);  // the low-latency path sends no chunk starts
  }
  // Each thread sums its counts, each warp its threads', one shared atomic per warp (an atomic
  // per count on one word serialised 256 adds per block: +28 us on decode, one H100).
  unsigned long long mine = 0;
  for (int32_t i = threadIdx.x; i < n_ranks * n_local; i += kThreads) {
    const int32_t s = i / n_local, c = rg.counts[i];
    if (c < 0 || c > rg.stream_count[s])
      flag(kFieldGroupCount, s, c);
    else
      mine += (unsigned long long)c;
  }
  for (int off = kWarpSize / 2; off > 0; off /= 2)
    mine += __shfl_xor_sync(0xffffffffu, mine, off);
  if (threadIdx.x % kWarpSize == 0 && mine != 0) atomicAdd(&routed_rows, mine);
  int32_t most_chunks = g.low_latency ? -1 : 0;  // -1: no chunk starts to check
  for (int32_t s = 0; s < n_ranks && !g.low_latency; ++s)
    most_chunks = max(most_chunks, min(max(rg.n_chunks[s], 0), ml.max_chunks));
  for (int32_t i = threadIdx.x; i < n_ranks * (most_chunks + 1); i += kThreads) {
    const int32_t s = i / (most_chunks + 1), c = i % (most_chunks + 1);
    if (c > rg.n_chunks[s] || rg.n_chunks[s] > ml.max_chunks) continue;
    const volatile int32_t* starts =
        reinterpret_cast<const volatile int32_t*>(meta_at(s) + ml.chunk_start_offset());
    const int32_t v = starts[c];
    if (v < 0 || v > rg.stream_count[s] || (c > 0 && starts[c - 1] > v))
      flag(kFieldChunkStart, s, v);
  }
  __syncthreads();
  int32_t code = bad_field != 0 ? int32_t(ErrorCode::kBadPeerData) : 0;
  const unsigned long long routed = routed_rows;
  if (code == 0 && routed > (unsigned long long)g.max_routed_rows())
    code = int32_t(ErrorCode::kRecvCapacity);
  if (code != 0 && rb == 0 && threadIdx.x == 0) {
    if (code == int32_t(ErrorCode::kBadPeerData)) {
      record_error(g, ErrorCode::kBadPeerData, kOpDispatchRecv, rank_bit(bad_src), -1, -1,
                   bad_value, WaitWhat(bad_field));
    } else {
      RankMask senders = 0;  // the sources with rows for this rank
      for (int32_t i = 0; i < n_ranks * n_local; ++i)
        if (rg.counts[i] > 0) senders |= rank_bit(i / n_local);
      record_error(g, ErrorCode::kRecvCapacity, kOpDispatchRecv, senders, -1, -1,
                   int32_t(min(routed, 0x7fffffffull)), kWaitNone);
    }
  }
  __syncthreads();  // bad_field is read again by the next call of this block
  return code;
}

// The low-latency path's receive: items (message, source, part), message-major, dealt to the
// grid's warps in turn; a warp waits for its part's flag (and part 0's, which carries the
// header), then expands it.
template <TokenFormat F>
__device__ void expand_parts(const DispatchParams& p, const RecvGroups& rg, unsigned long long seq,
                             int32_t rb, int32_t n_rb) {
  const GroupView& g = p.g;
  const int32_t n_ranks = g.n_ranks;
  const int32_t n_parts = num_parts(g.hidden);
  int32_t most = 0;
  for (int32_t s = 0; s < n_ranks; ++s)
    most = max(most, rg.stream_count[s]);
  const int64_t items = int64_t(most) * n_ranks * n_parts;
  // Dealt from the last warp of the grid backwards: the send dealt its pieces from the first,
  // so the blocks that had none (and built the layout first) take the first items. Dealt from
  // the first warp too, a decode's 896 items all went to the 56 blocks that were still
  // sending (one H100, decode-bf16, 132 blocks: 44.5 us; from the last warp: 38.0 us).
  const int64_t warps = int64_t(n_rb) * kWarps;
  for (int64_t i = warps - 1 - (int64_t(rb) * kWarps + threadIdx.x / kWarpSize); i < items;
       i += warps) {
    const int32_t part = int32_t(i % n_parts);
    const int32_t s = int32_t((i / n_parts) % n_ranks);
    const int32_t m = int32_t(i / (int64_t(n_parts) * n_ranks));
    if (m >= rg.stream_count[s]) continue;
    if (!warp_wait_part(g, s, m, part, seq)) break;
    expand_message<F>(p, rg, s, m, part * kPartUnits, (part + 1) * kPartUnits);
  }
}

// The throughput path's receive: work items (chunk, source, part) of the chunks' messages.
template <TokenFormat F>
__device__ void expand_chunks(const DispatchParams& p, const RecvGroups& rg, unsigned long long seq,
                              int32_t n_rb) {
  const GroupView& g = p.g;
  const int32_t n_ranks = g.n_ranks;
  const MetaLayout ml = g.layout().meta();
  const int lane = threadIdx.x % kWarpSize;
  // Work items (chunk, source, part), chunk-major so they come due in the order the chunks
  // arrive: a warp takes the next item from the call's counter, waits for the chunk's flag, then
  // expands messages part, part + parts, ... of it. A chunk holds up to 16 messages per source;
  // parts spread them over more warps, at least 4 and up to one message per item when there are
  // few chunks (decode: 8 per source), so that every warp of the grid has items. Taking items
  // from a counter (not by warp index) lets senders that are done join, and keeps a warp that
  // waited long from holding items others could take.
  int32_t max_chunks = 0;
  for (int32_t s = 0; s < n_ranks; ++s)
    max_chunks = max(max_chunks, rg.n_chunks[s]);
  const int64_t cells = max(int64_t(1), int64_t(max_chunks) * n_ranks);
  const int64_t want = (2 * int64_t(n_rb) * kWarps + cells - 1) / cells;
  const int32_t parts = int32_t(min(int64_t(kChunkTokens), max(int64_t(4), want)));
  const int64_t items = cells * parts;
  unsigned long long* counter = &g.state->recv_item[seq & 1];
  unsigned long long taken = lane == 0 ? atomicAdd(counter, 1ull) : 0ull;
  for (;;) {
    const int64_t i = int64_t(__shfl_sync(0xffffffffu, taken, 0));
    if (i >= items) break;
    if (lane == 0) taken = atomicAdd(counter, 1ull);  // the next item, in flight meanwhile
    const int32_t part = int32_t(i % parts);
    const int32_t s = int32_t((i / parts) % n_ranks);
    const int32_t c = int32_t(i / (int64_t(parts) * n_ranks));
    if (c >= rg.n_chunks[s]) continue;
    const int32_t* starts = reinterpret_cast<const int32_t*>(
        window_at(g, g.rank, g.layout().meta_offset(s)) + ml.chunk_start_offset());
    const int32_t end = min(starts[c + 1], rg.stream_count[s]);
    if (starts[c] + part >= end) continue;  // no message of this part: nothing to wait for
    if (!warp_wait_chunk(g, s, c, seq)) break;
    for (int32_t m = starts[c] + part; m < end; m += parts)
      expand_message<F>(p, rg, s, m, 0, g.hidden / kLaneValues);
  }
}

// Receiver block rb of n_rb (all blocks of dispatch_wait; the non-senders of the fused kernel),
// or a sender of the fused kernel that has sent its chunks and joins in (rb < 0: it takes work
// items only; the receivers write the padding and the combine's bookkeeping).
template <TokenFormat F>
__device__ __noinline__ void dispatch_recv(const DispatchParams& p, unsigned long long seq, char* smem,
                              int32_t rb, int32_t n_rb) {
  const GroupView& g = p.g;
  if (rb == 0 && threadIdx.x == 0) g.state->recv_item[(seq + 1) & 1] = 0;  // the next call's
  const WindowLayout wl = g.layout();
  const MetaLayout ml = wl.meta();
  const int32_t n_local = g.n_local(), n_ranks = g.n_ranks;
  const RecvGroups rg = RecvGroups::carve(smem, n_ranks, n_local);

  auto meta_at = [&](int32_t s) { return window_at(g, g.rank, wl.meta_offset(s)); };
  if (!block_wait(
          g, all_ranks_mask(g), kOpDispatchRecv, kWaitMeta,
          [&](int32_t s) {
            return reinterpret_cast<const unsigned long long*>(meta_at(s) + ml.seq_offset());
          },
          [&](int32_t) { return seq; }))
    return;
  for (int32_t i = threadIdx.x; i < n_ranks * n_local; i += kThreads) {
    const int32_t s = i / n_local, j = i % n_local;
    rg.counts[i] = reinterpret_cast<const volatile int32_t*>(meta_at(s) + ml.counts_offset())[j];
  }
  if (threadIdx.x < n_ranks) {
    rg.stream_count[threadIdx.x] =
        *reinterpret_cast<const volatile int32_t*>(meta_at(threadIdx.x) + ml.stream_count_offset());
    rg.n_chunks[threadIdx.x] =
        *reinterpret_cast<const volatile int32_t*>(meta_at(threadIdx.x) + ml.n_chunks_offset());
  }
  __syncthreads();
  if (check_sources(p, rg, ml, meta_at, rb) != 0) {
    // Nothing is written but empty groups (row_offsets all 0, so combine sends nothing back
    // from here); the call still completes, so the group stays usable.
    if (rb == 0) {
      for (int32_t grp = threadIdx.x; grp <= n_local; grp += kThreads) {
        p.row_offsets[grp] = 0;
        if (grp < n_local) p.expert_ids[grp] = g.route.group_expert(grp);
        if (format_swizzled(F) && grp < n_local) p.scales_offsets[grp] = 0;
      }
      if (threadIdx.x < n_ranks) p.scratch.recv_count[threadIdx.x] = 0;
    }
    dispatch_done(g, seq);
    return;
  }

  // row_offsets: exclusive scan of the group totals, each padded to the format's row alignment;
  // the swizzled formats also scan each group's scale tiles (n_local <= 1024 = 2 per thread).
  const GroupRows rows{rg.counts, n_ranks, n_local};
  constexpr int32_t kAlign = format_row_align(F);
  constexpr int32_t kTileRows = SwizzledScaleLayout::kTileRows;
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int32_t item[2], tiles[2], total = 0, total_tiles = 0;
  for (int i = 0; i < 2; ++i) {
    const int32_t grp = threadIdx.x * 2 + i;
    const int32_t m = grp < n_local ? rows.group_total(grp) : 0;
    if (grp < n_local) rg.rows[grp] = m;
    item[i] = int32_t(align_up(m, kAlign));
    tiles[i] = (m + kTileRows - 1) / kTileRows;
  }
  Scan(scan_tmp).ExclusiveSum(item, item, total);
  if constexpr (format_swizzled(F)) {
    __syncthreads();  // scan_tmp is reused
    Scan(scan_tmp).ExclusiveSum(tiles, tiles, total_tiles);
  }
  for (int i = 0; i < 2; ++i) {
    const int32_t grp = threadIdx.x * 2 + i;
    if (grp < n_local) {
      rg.row_offset[grp] = item[i];
      rg.tile_start[grp] = tiles[i];
    }
  }
  if (threadIdx.x == 0) {
    rg.row_offset[n_local] = total;
    rg.tile_start[n_local] = total_tiles;
  }
  __syncthreads();
  // Block 0 also keeps the bases and message counts for the expert-side combine.
  for (int32_t grp = threadIdx.x; grp < n_local; grp += kThreads) {
    for (int32_t s = 0; s < n_ranks; ++s) {
      const int32_t base = rg.row_offset[grp] + rows.source_offset(s, grp);
      rg.base[s * n_local + grp] = base;
      if (rb == 0) p.scratch.recv_base[s * n_local + grp] = base;
    }
  }
  if (rb == 0) {
    if (threadIdx.x < n_ranks) p.scratch.recv_count[threadIdx.x] = rg.stream_count[threadIdx.x];
    for (int32_t grp = threadIdx.x; grp <= n_local; grp += kThreads) {
      p.row_offsets[grp] = uint32_t(rg.row_offset[grp]);
      if (grp < n_local) p.expert_ids[grp] = g.route.group_expert(grp);
      if (format_swizzled(F) && grp < n_local)
        p.scales_offsets[grp] = uint32_t(rg.tile_start[grp] - rg.row_offset[grp] / kTileRows);
    }
  }
  __syncthreads();
  if (rb >= 0) fill_padding<F>(p, rg, rb, n_rb);
  trace_mark(g, kTraceDispatch, kTraceReady);
  if (g.low_latency)
    expand_parts<F>(p, rg, seq, rb, n_rb);
  else
    expand_chunks<F>(p, rg, seq, n_rb);
  // A warp that gave up has set the abort flag (or found it set): the block stops here.
  if (block_aborted(g)) return;
  dispatch_done(g, seq);
  trace_mark(g, kTraceDispatch, kTraceDone);
}

// The fused kernel: every block ranks; then either the grid splits, some blocks sending while
// the rest expand chunks as they arrive (each sender joining the receivers once its chunks are
// sent), or (few blocks) every block sends and then receives.
// What the split rests on, measured on prefill (8 x H200, bf16): sending is bound by the links
// from about 8 blocks on (8 of 24 move it as fast as 64 do), below that by the blocks (2
// senders took 3.9 ms); receiving is bound by the blocks (8 took 1.45 ms, 24 0.49 ms). With the
// senders joining the receive (4 x H200, prefill, 24 blocks, one build per count): 8 senders
// 787 µs, 10: 690, 12: 704, 16: 748. So:
//  - fewer than kMinSplitBlocks blocks: no split (it would starve one side; 8 blocks split
//    2 + 6 took 3.9 ms against 2.4 ms for send-then-receive);
//  - bf16: 5/12 of the blocks send, at least kLinkSenders;
//  - quantised formats: 5/6 (quantising bounds the sender: before the join, prefill-fp8 with a
//    third sending took 1995 µs against 1161 µs for async + wait on 24 blocks; with the join,
//    4 x H200, 24 blocks, prefill-fp8 / gpt-oss: 10 senders 1333 / 172 µs, 12: 1133 / 153,
//    16: 883 / 126, 20: 865 / 116, 23: 862 / 113);
//  - never more senders than chunks (a sender takes whole chunks: decode's 128 tokens are 8),
//    and at least one receiver.
// Returns the number of senders; `blocks` means send, then receive.
constexpr int32_t kMinSplitBlocks = 16;
constexpr int32_t kLinkSenders = 8;
__host__ __device__ constexpr int32_t fused_senders(int32_t blocks, TokenFormat f,
                                                    int32_t num_tokens) {
  if (blocks < kMinSplitBlocks) return blocks;
  const int32_t share = blocks * 5 / 12;
  const int32_t want = f == TokenFormat::kBF16 ? (share > kLinkSenders ? share : kLinkSenders)
                                               : blocks * 5 / 6;
  const int32_t chunks = num_chunks(num_tokens) > 0 ? num_chunks(num_tokens) : 1;
  const int32_t n = want < chunks ? want : chunks;
  return n < blocks - 1 ? n : blocks - 1;
}
static_assert(fused_senders(8, TokenFormat::kBF16, 4096) == 8, "few blocks: no split");
static_assert(fused_senders(24, TokenFormat::kBF16, 4096) == 10, "bf16: 5/12");
static_assert(fused_senders(16, TokenFormat::kBF16, 4096) == 8, "bf16: at least 8");
static_assert(fused_senders(24, TokenFormat::kFp8Blockwise, 4096) == 20, "quantised: 5/6");
static_assert(fused_senders(24, TokenFormat::kFp8Blockwise, 128) == 8, "no more than chunks");
static_assert(fused_senders(24, TokenFormat::kBF16, 0) == 1, "no tokens: one sender");

template <bool kSend, bool kRecv, TokenFormat F>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
  extern __shared__ __align__(16) char smem[];
  const unsigned long long seq = p.g.state->dispatch_seq + 1;  // in flight with the abort flag
  if (block_aborted(p.g)) return;
  trace_begin(p.g, kTraceDispatch, kSend ? kTraceStart : kTraceRecvStart,
              kRecv ? kTraceMarks : kTraceRecvStart);
  const int32_t blocks = gridDim.x, b = blockIdx.x;
  if (p.g.low_latency) {  // every block sends its pieces, then receives
    if (kSend && !ll_send<F>(p, seq, smem)) return;
    if (!kRecv) {
      trace_mark(p.g, kTraceDispatch, kTraceDone);
      return;
    }
    if (block_aborted(p.g)) return;
    if (kSend) trace_mark(p.g, kTraceDispatch, kTraceRecvStart);
    dispatch_recv<F>(p, seq, smem, b, blocks);
    return;
  }
  if (kSend && !kRecv) {
    dispatch_send<F>(p, seq, smem, blocks);
    trace_mark(p.g, kTraceDispatch, kTraceDone);
    return;
  }
  if (!kSend) {
    if (!block_aborted(p.g)) dispatch_recv<F>(p, seq, smem, b, blocks);
    return;
  }
  const int32_t senders = fused_senders(blocks, F, p.num_tokens);
  if (!dispatch_send<F>(p, seq, smem, senders)) return;
  if (block_aborted(p.g)) return;
  // Every block receives (no split), or the blocks after the senders, joined by each sender
  // once it has sent its chunks. One call site: the receive inlined twice would double the
  // kernel's code, and instruction fetch is part of the latency here.
  trace_mark(p.g, kTraceDispatch, kTraceRecvStart);
  const int32_t first = senders == blocks ? 0 : senders;
  dispatch_recv<F>(p, seq, smem, b - first, blocks - first);
}

// The three forms (fused, send, receive) of format F.
template <TokenFormat F>
struct DispatchKernels {
  static constexpr void (*fused)(DispatchParams) = dispatch_kernel<true, true, F>;
  static constexpr void (*send)(DispatchParams) = dispatch_kernel<true, false, F>;
  static constexpr void (*recv)(DispatchParams) = dispatch_kernel<false, true, F>;
};

// Calls f(DispatchKernels<F>{}) for the group's format.
template <class Fn>
void with_format(TokenFormat f, Fn fn) {
  switch (f) {
    case TokenFormat::kBF16: return fn(DispatchKernels<TokenFormat::kBF16>{});
    case TokenFormat::kFp8Blockwise: return fn(DispatchKernels<TokenFormat::kFp8Blockwise>{});
    case TokenFormat::kNvfp4: return fn(DispatchKernels<TokenFormat::kNvfp4>{});
    case TokenFormat::kMxfp8: return fn(DispatchKernels<TokenFormat::kMxfp8>{});
    case TokenFormat::kMxfp4: return fn(DispatchKernels<TokenFormat::kMxfp4>{});
  }
  throw Error(ErrorCode::kInvalidArgument, "dispatch: unknown token format");
}

}  // namespace

size_t dispatch_smem_bytes(const GroupView& g) {
  const size_t nk = size_t(g.experts().num_keys());
  const size_t send = g.low_latency ? size_t(LocalRanks::smem_bytes(int32_t(nk)))
                                    : kWarps * nk * (sizeof(uint32_t) + sizeof(uint16_t));
  const size_t recv = sizeof(int32_t) * size_t(RecvGroups::smem_words(g.n_ranks, g.n_local()));
  return align_up(int64_t(send > recv ? send : recv), 16);
}

int dispatch_threads() { return kThreads; }
int dispatch_unit_tokens() { return kUnitTokens; }

void launch_dispatch(const DispatchParams& p, bool send, bool recv, cudaStream_t stream) {
  const size_t smem = dispatch_smem_bytes(p.g);
  with_format(p.g.format, [&](auto k) {
    using K = decltype(k);
    auto kernel = send && recv ? K::fused : (send ? K::send : K::recv);
    launch_cooperative(kernel, p.g.num_blocks, kThreads, smem, stream, p);
  });
}

int prepare_dispatch_kernels(const GroupView& g) {
  const int smem = int(dispatch_smem_bytes(g));
  int per_sm = 0;
  // The attribute belongs to the kernel, not to the group: several groups of one process share
  // it, so it only ever grows (a smaller group set up later must not shrink what an earlier one
  // launches with). The lock makes the read and the write one step.
  static std::mutex attribute_lock;
  std::lock_guard<std::mutex> hold(attribute_lock);
  with_format(g.format, [&](auto k) {
    using K = decltype(k);
    for (auto kernel : {K::fused, K::send, K::recv}) {
      cudaFuncAttributes attr{};
      check_cuda(cudaFuncGetAttributes(&attr, kernel),
                 "cudaFuncGetAttributes(dispatch)");  // also loads the kernel (lazy loading)
      if (attr.maxDynamicSharedSizeBytes < smem)
        check_cuda(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
            "cudaFuncSetAttribute(dispatch)");
    }
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, K::fused, kThreads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  });
  return per_sm;
}

}  // namespace detail
}  // namespace epcomm
