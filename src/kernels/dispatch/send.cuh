// Dispatch stage 3, the throughput send: one message per (token, destination rank), a header
// (the token; per expert of that rank its group, top-k slot and position) and the payload (bf16
// copied, the other formats quantised in registers), written straight into its slot of the
// destination's receive buffer (the slot is the token's position from the ranking). Where this
// rank's own messages stay in place (self_in_place), none goes to itself (recv.cuh, expand_own).
//
// Messages are announced per chunk of kChunkTokens tokens: a flag per message would cost a
// system fence per message, one per call would make the receiver wait for the whole send. Who
// writes what: sender block b takes chunks b, b + senders, ...; warp w writes the chunk's token
// w; the last of the block's warps to finish a chunk fences and stores seq into the chunk's flag
// in every destination (ChunkSignals), while the other warps go on. Who waits: a receiving warp
// acquires one chunk flag of one source (recv.cuh). Flags carry seq and only grow, so nothing is
// reset; the wait for kDispatchAck (stage 2) keeps a sender from overwriting messages a
// destination has not read.
#pragma once

#include <type_traits>
#include <utility>

#include "epcomm/detail/bulk.cuh"
#include "epcomm/detail/transport.cuh"
#include "kernels/dispatch/meta.cuh"
#include "kernels/dispatch/rank.cuh"
#include "kernels/quant_unit.cuh"

namespace epcomm {
namespace detail {
namespace {

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

// A token's destinations go at most one per top-k slot (kMaxDests), taken kDestBatch at a
// time in rank order: a batch's messages are written in one pass over the token (each value
// loaded once per batch). Up to 8 destinations (every group of up to 8 ranks, every K <= 8) is
// one batch. Destination j of a batch is held by lane j (an array indexed by the copy's loop
// variable lived in local memory: a load before every round of stores, the most-sampled stall
// of the send, docs/results/2026-11-25_h100_sm_pinning_f9e9acc.md); the *_of accessors are
// whole-warp calls.
constexpr int32_t kMaxDests =
    kMaxTopK < WindowLayout::kMaxPeers ? kMaxTopK : WindowLayout::kMaxPeers;
constexpr int32_t kDestBatch = 8;
static_assert(kDestBatch <= kWarpSize, "a lane per destination of a batch");
struct Dests {
  int32_t n = 0;                    // the warp's: destinations in this batch
  int32_t rank = -1, slot = -1;     // lane j < n: destination j's rank and message slot
  char* payload = nullptr;          // lane j < n: destination j's payload

  __device__ int32_t rank_of(int32_t j) const { return __shfl_sync(kFullMask, rank, j); }
  __device__ int32_t slot_of(int32_t j) const { return __shfl_sync(kFullMask, slot, j); }
  __device__ char* payload_of(int32_t j) const {
    return reinterpret_cast<char*>(
        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(payload), j));
  }
  // Whole warp: destination (r, s, at) becomes the batch's next.
  __device__ void add(int32_t r, int32_t s, char* at) {
    if (threadIdx.x % kWarpSize == n) {
      rank = r;
      slot = s;
      payload = at;
    }
    ++n;
  }
};

// Quantises one bf16 row of `hidden` values into the payload of each of the messages of
// `dests`: codes
// (unit u's 8 codes at byte u * 8 or u * 4, stored 16 bytes at a time), then the row's scales
// (scale b at scales_offset + b * scale bytes). All 32 lanes step together (lanes past the row's
// end carry zeros), so the shuffles of a block's amax never sit in a loop whose trip count
// differs by lane. Each step quantises kUnroll units per lane before it stores any: they are
// independent, and a sender warp is bound by its own instruction latency (one block per SM, 4
// warps per scheduler), so the overlap is what keeps the SM issuing.
// Units [unit_begin, unit_end) of the row (the low-latency path quantises one part per warp).
// kShared: the payloads are in shared memory (the receive's ring slot), stored through generic
// stores (st_v4 stores to global memory).
template <TokenFormat F, bool kShared = false>
__device__ void quantize_to(const uint16_t* row, int32_t hidden, float gs, bool pow2,
                            const MessageLayout& ml, const Dests& dests, int32_t unit_begin,
                            int32_t unit_end) {
  using Quant = typename BlockQuantOf<F>::type;
  constexpr int32_t kLanes = Quant::kGroup / kLaneValues;  // lanes per scale block
  // Units per 16-byte store: a unit's 8 codes take kCodeBits bytes, so 2 (e4m3) or 4 (e2m1).
  constexpr int kPack = 16 / Quant::kCodeBits;
  using Scale = decltype(stored_scale(std::declval<const Quant&>()));
  const int lane = threadIdx.x % kWarpSize;
  const int32_t units = unit_end < hidden / kLaneValues ? unit_end : hidden / kLaneValues;
  const int64_t scales_at = ml.scales_offset() - ml.payload_offset();
  // The codes of kPack adjacent units go out as one 16-byte store by the first lane of each
  // pack (units per row are a multiple of 4).
  const auto quantise = [&](const uint4(&raw)[kUnroll], uint4(&packed)[kUnroll],
                            Scale(&scale)[kUnroll]) {
    if constexpr (F == TokenFormat::kFp8Blockwise && kUnroll == 4 && kLanes == 16) {
      // This lane's part of each unit's amax, from the bf16 bits; the fold itself where a value
      // is NaN (it ignores NaN). `worst`: the largest magnitude's bits of the lane's values.
      float part[kUnroll];
      uint32_t worst = 0u;
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t bits = unit_abs_bits_max(raw[k]);
        worst = worst > bits ? worst : bits;
        part[k] = __uint_as_float(bits << 16);
      }
      if (worst > kBf16Inf) {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          float z[kLaneValues];
          unpack_bf16x8(raw[k], z);
          part[k] = lane_amax(z);
        }
      }
      Quant q[kUnroll];
      fp8_step_quants(part, pow2, q);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        float z[kLaneValues];
        unpack_bf16x8(raw[k], z);
        // No scaled value is NaN unless a value is NaN or infinite (inv is finite).
        uint2 codes = encode_unit<true>(q[k], z);
        if (worst >= kBf16Inf) codes = encode_unit(q[k], z);
        packed[k] = pack_codes16(codes);
        scale[k] = stored_scale(q[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        float z[kLaneValues];
        unpack_bf16x8(raw[k], z);
        const Quant q = make_block_quant<F>(lanes_amax<kLanes>(z), gs, pow2);
        packed[k] = pack_codes16(encode_unit(q, z));
        scale[k] = stored_scale(q);
      }
    }
  };
  // One step of kUnroll units per lane from `base`; kFull: every unit of it is in the row, so no
  // load or store is bounded (the row's steps but its last, partial one). Units are never
  // negative (unit_begin >= 0): unsigned division is a shift.
  const auto step = [&](int32_t base, auto full) {
    constexpr bool kFull = decltype(full)::value;
    uint4 raw[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int32_t unit = base + k * kWarpSize + lane;
      raw[k] = kFull || unit < units ? ld_nc_v4(row + int64_t(unit) * kLaneValues)
                                     : make_uint4(0, 0, 0, 0);
    }
    uint4 packed[kUnroll];
    Scale scale[kUnroll];
    quantise(raw, packed, scale);
    for (int32_t j = 0; j < dests.n; ++j) {
      char* const payload = dests.payload_of(j);  // every lane: a shuffle
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int32_t unit = base + k * kWarpSize + lane;
        if (!kFull && unit >= units) break;  // so are this lane's later units
        const uint32_t u = uint32_t(unit);
        if (lane % kPack == 0) {
          char* const at = payload + int64_t(u / kPack) * 16;
          if constexpr (kShared)
            *reinterpret_cast<uint4*>(at) = packed[k];
          else
            st_v4(at, packed[k]);
        }
        if (u % kLanes == 0) reinterpret_cast<Scale*>(payload + scales_at)[u / kLanes] = scale[k];
      }
    }
  };
  int32_t base = unit_begin;
  for (; base + kWarpSize * kUnroll <= units; base += kWarpSize * kUnroll)
    step(base, std::true_type{});
  if (base < units) step(base, std::false_type{});  // the row's last, partial step
}

// Chunk arrival flags, raised by the last of a sender block's warps to finish its token of the
// chunk, while the other warps go on to their next tokens: a block-wide barrier per chunk left
// the block's stores draining with nothing new issued while thread 0 fenced (8 senders then
// moved well under what the plain store kernel moves with 8 blocks: docs/results,
// 2026-11-21_h200x4_dfa4a0a.md).
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
            signal<SignalOp::kSetFenced>(g, d, wl.chunk_flag_offset(g.rank, chunk), seq);
      }
    }
    __syncwarp();
    // Ranks of other nodes: every warp put (and completed) its messages before it arrived, so
    // the flag goes as a signal alone.
    if (any_remote(g) && threadIdx.x % kWarpSize == 0 && last)
      for (int32_t d = 0; d < g.n_ranks; ++d)
        if (remote(g, d)) signal<SignalOp::kSet>(g, d, wl.chunk_flag_offset(g.rank, chunk), seq);
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
  return put_buffer(g, d, message_offset(g, slot), [&] {
    return outbox_at(g, g.outbox_layout().stream_offset(g.nodes().remote_index(g.rank, d)) +
                            int64_t(slot) * g.layout().msg().bytes());
  });
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

// Token t's row of the ranking's unit prefixes (the stream and group positions before its unit).
__device__ __forceinline__ const int32_t* unit_prefix_of(const DispatchParams& p, int32_t t) {
  return p.scratch.unit_prefix + int64_t(t / kUnitTokens) * p.g.experts().num_keys();
}
// Token t's slot in destination rank d's stream: its place among its unit's tokens going to d,
// plus the unit's prefix (`prefix`: unit_prefix_of(p, t)); -1 where t does not go to d.
__device__ __forceinline__ int32_t stream_slot(const DispatchParams& p, const int32_t* prefix,
                                               int32_t t, int32_t d) {
  int32_t s = p.scratch.dest_pos[int64_t(t) * p.g.n_ranks + d];
  if (s >= 0) s += prefix[p.g.experts().rank_key(d)];
  return s;
}

// The throughput path's route: positions from the grid-wide ranking scratch.
__device__ LaneRoute route_from_scratch(const DispatchParams& p, int32_t t) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t K = g.top_k;
  const int lane = threadIdx.x % kWarpSize;
  const int32_t* prefix = unit_prefix_of(p, t);
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
    (i == 0 ? r.slot : r.slot_hi) = stream_slot(p, prefix, t, d);
  }
  return r;
}

// Whole warp: token t's header for destination `rank`, written at h (lane k holds top-k slot k of
// r, `dest` the rank of its expert, `dest_mask` the token's destinations): entry i is the i-th
// slot, ascending, whose expert is on `rank`. Returns that slot in lane i (-1 past the entries):
// what a reader of the header finds in entries[i].slot().
__device__ __forceinline__ int32_t write_header(MessageHeader* h, const ExpertMap& em,
                                                const LaneRoute& r, int32_t dest,
                                                RankMask dest_mask, int32_t rank, int32_t t) {
  const int lane = threadIdx.x % kWarpSize;
  const uint32_t mine = __ballot_sync(0xffffffffu, dest == rank);
  if (dest == rank)
    h->entries[__popc(mine & lanemask_lt())] =
        MessageEntry::make(em.local_of(r.id), lane, r.pos, r.weight);
  if (lane == 0) {
    h->token = t;
    h->n_entries = int16_t(__popc(mine));
    h->rank_slot = int16_t(rank_slot_of(dest_mask, rank));
  }
  return lane < __popc(mine) ? int32_t(__fns(mine, 0, lane + 1)) : -1;
}

// Token t's message to every destination rank it goes to: the header when `headers`, and the
// payload's units [unit_begin, unit_end) (8 values each: bf16 copied, the other formats
// quantised in registers). Whole warp. Calls sent(batch) after each batch of destinations.
// `self_in_place` (self_in_place(): the fused throughput kernel): this rank's own message is not
// written at all; the receive takes the token's route from the ranking, writes the header itself
// (the expert-side combine reads it) and reads the row where it is, in p.tokens.
template <TokenFormat F, class Sent>
__device__ void send_token(const DispatchParams& p, int32_t t, const LaneRoute& r,
                           int32_t unit_begin, int32_t unit_end, bool headers, Sent sent,
                           bool self_in_place = false) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const MessageLayout ml = g.layout().msg();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t dest = r.id >= 0 ? em.rank_of(r.id) : -1;
  const RankMask dest_mask = r.dests();
  const char* src = static_cast<const char*>(p.tokens) + int64_t(t) * g.hidden * 2;
  const int32_t units = g.hidden / kLaneValues;
  // The ranks whose payload this warp writes.
  const RankMask copied = self_in_place ? dest_mask & ~rank_bit(g.rank) : dest_mask;
  if (lane == 0 && unit_begin == 0 && unit_end >= units && copied != 0)
    prefetch_l2(src, uint32_t(g.hidden) * 2);
  unit_end = unit_end < units ? unit_end : units;
  for (RankMask left = dest_mask; left;) {
    Dests d;
    for (; left && d.n < kDestBatch; left &= left - 1) {
      const int32_t rank = __ffsll(left) - 1;
      if (!(copied & rank_bit(rank))) continue;  // this rank's own, in place
      const int32_t s = r.slot_of(rank);
      char* msg = message_at(g, rank, s);
      if (headers)
        write_header(reinterpret_cast<MessageHeader*>(msg), em, r, dest, dest_mask, rank, t);
      d.add(rank, s, msg + ml.payload_offset());
    }
    if constexpr (F == TokenFormat::kBF16) {  // a unit is one 16-byte vector
      if (d.n > 0)
        copy_vectors(src + int64_t(unit_begin) * 16, unit_end - unit_begin, d.n, LoadNc{},
                     [&](int32_t j) { return d.payload_of(j) + int64_t(unit_begin) * 16; });
    } else if (d.n > 0) {
      quantize_to<F>(reinterpret_cast<const uint16_t*>(src), g.hidden, g.nvfp4_global_scale,
                     g.fp8_pow2 != 0, ml, d, unit_begin, unit_end);
    }
    sent(d);
  }
}

// Sender block `sender` of n_senders takes chunks sender, sender + n_senders, ...: warp w sends
// the chunk's token w; the last warp to finish the chunk raises its flag.
// A group of one rank whose own messages stay in place (self_in_place) sends nothing but its
// meta record: the receive takes each token's route from the ranking (expand_own).
__device__ __forceinline__ bool sends_nothing(const GroupView& g, bool self_in_place) {
  return self_in_place && g.n_ranks == 1;
}

template <TokenFormat F>
__device__ void send_messages(const DispatchParams& p, int32_t num_tokens, int32_t sender,
                              int32_t n_senders, unsigned long long seq, bool self_in_place) {
  static_assert(kChunkTokens == kWarps, "one token of a chunk per warp");
  if (sends_nothing(p.g, self_in_place)) return;
  __shared__ int32_t arrivals[kSignalRing];
  const ChunkSignals signals{arrivals};
  signals.init();
  int32_t it = 0;
  for (int32_t chunk = sender; chunk < num_chunks(num_tokens); chunk += n_senders, ++it) {
    const int32_t t = chunk * kChunkTokens + threadIdx.x / kWarpSize;
    if (t < num_tokens) {
      send_token<F>(
          p, t, route_from_scratch(p, t), 0, p.g.hidden / kLaneValues, true,
          [&](const Dests& d) {
            if (!any_remote(p.g)) return;
            // The messages staged for ranks of other nodes: put (nothing to do for
            // the ranks of this node).
            const MessageLayout ml = p.g.layout().msg();
            for (int32_t j = 0; j < d.n; ++j)
              warp_put(p.g, d.rank_of(j), message_offset(p.g, d.slot_of(j)),
                       d.payload_of(j) - ml.payload_offset(), ml.bytes());
          },
          self_in_place);
      put_quiet(p.g);  // completed before this warp arrives on the chunk
    }
    signals.arrive(p.g, chunk, it, seq);
  }
  put_quiet(p.g);  // the chunk flags' signals too, before the next call
}

// Ranking uses every block; then blocks [0, n_senders) send (the others go on to receive, in
// the fused kernel).
template <TokenFormat F>
__device__ __noinline__ bool dispatch_send(const DispatchParams& p, unsigned long long seq,
                                           char* smem, int32_t n_senders, bool self_in_place) {
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
  if (int32_t(blockIdx.x) == n_senders - 1) {
    send_meta(p, seq, bad);
    trace_mark(g, kTraceDispatch, kTraceMetaSent);
  }
  send_messages<F>(p, num_tokens, blockIdx.x, n_senders, seq, self_in_place);
  trace_mark(g, kTraceDispatch, kTraceSent);
  return true;
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
