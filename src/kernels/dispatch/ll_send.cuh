// Dispatch, the low-latency send (Config::dispatch_path, T <= kUnitTokens): for decode, where a
// grid barrier and a chunk's worth of waiting cost more than moving the data.
//
// No grid-wide barrier: every block ranks all of the call's tokens in shared memory (rank_local),
// so each knows every position it needs; block 0 writes the meta records (without chunk starts)
// and keeps the validated ids for combine; then the grid's warps take (token, part) pieces in
// turn, each stored to every destination and announced by its own part flag, so a receiver
// expands a part as soon as it lands. Thread 0 of each block raises its warps' flags after one
// system fence per round. Flags carry seq and only grow (nothing is reset between calls); the
// acks (stage 2) keep a sender from overwriting messages and flags a destination has not read.
#pragma once

#include "epcomm/detail/transport.cuh"
#include "kernels/dispatch/meta.cuh"
#include "kernels/dispatch/rank.cuh"
#include "kernels/dispatch/send.cuh"

namespace epcomm {
namespace detail {
namespace {

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
  put_fence(g);
  warp_put_signal(g, d, at + ml.part_scales_offset(part), src + ml.part_scales_offset(part),
                  ml.part_scales_bytes(part), wl.part_flag_offset(g.rank, slot, part), seq);
}

// The blocks of a low-latency send that hold pieces: num_tokens * parts pieces, one per warp,
// dealt from block 0 up (ll_send), at most the grid.
__device__ __forceinline__ int32_t ll_sending_blocks(const GroupView& g, int32_t num_tokens) {
  const int64_t pieces = int64_t(num_tokens) * g.n_parts_div.d;  // num_parts(g.hidden)
  const int64_t blocks = (pieces + kWarps - 1) / kWarps;
  return int32_t(blocks < g.num_blocks ? blocks : g.num_blocks);
}

// Returns the tokens this call sends (0 for a call with a bad id: empty meta records only), or
// -1 if the block gave up (a wait timed out or the group aborted).
template <TokenFormat F>
__device__ __noinline__ int32_t ll_send(const DispatchParams& p, unsigned long long seq,
                                        char* smem) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t K = g.top_k;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  // The destinations must have finished reading the previous call's messages: their acks are
  // loaded now, in flight during the ranking, and waited for only if one was not in yet.
  // So is the abort flag (a group that gave up sends nothing): read here and tested after the
  // ranking, which writes nothing a later call or the host reads but the validated ids, rather
  // than awaited before it.
  unsigned long long ack = seq - 1;
  if (threadIdx.x < g.n_ranks)
    ack = signal_load(signal_word(g, g.rank, WindowLayout::kDispatchAck, threadIdx.x));
  const bool abort_seen = threadIdx.x == 0 && aborted(g);
  LocalRanks lr;
  const bool bad = rank_local(p, seq, smem, lr);
  trace_mark(g, kTraceDispatch, kTraceRanked);
  if (!__syncthreads_and(ack >= seq - 1 && !abort_seen) &&
      (block_aborted(g) ||
       !block_wait_signal(g, all_ranks_mask(g), WindowLayout::kDispatchAck, kOpDispatchSend,
                          kWaitAck, [&](int32_t) { return seq - 1; })))
    return -1;
  const int32_t num_tokens = bad ? 0 : p.num_tokens;
  if (blockIdx.x == 0 && threadIdx.x == 0) g.state->num_tokens = num_tokens;
  trace_mark(g, kTraceDispatch, kTraceAcked);
  if (blockIdx.x == 0) {
    const int32_t* rows_to = block_rows_to(g, bad ? nullptr : lr.totals);
    for (int32_t d = warp; d < g.n_ranks; d += kWarps)
      write_meta(g, seq, d, bad ? nullptr : lr.totals, rows_to, 0, [](int32_t) { return 0; });
    trace_mark(g, kTraceDispatch, kTraceMetaSent);
  }

  const WindowLayout wl = g.layout();
  const int32_t n_parts = num_parts(g.hidden);
  const int64_t items = int64_t(num_tokens) * n_parts;
  // Rounds of one piece per warp. After each, one system fence per block, and thread 0 raises
  // the flags of the block's pieces: a fence per piece cost more than the pieces' stores
  // (measured on decode; docs/results/2026-11-24_h100_decode_lowlatency_e8c6601.md).
  __shared__ int32_t n_flags[kWarps], flag_part[kWarps];
  __shared__ int32_t flag_rank[kWarps][kMaxDests];
  __shared__ int32_t flag_slot[kWarps][kMaxDests];
  // Pieces are dealt from the first warp of the grid up; the receive deals its items from the
  // last warp down. (Dealing pieces round-robin over the blocks, so that every SM stores a
  // share, was slower on decode: every block then built its layout only after its own round.)
  for (int64_t round = int64_t(blockIdx.x) * kWarps; round < items;
       round += int64_t(uint32_t(g.num_blocks)) * kWarps) {
    const int64_t i = round + warp;
    if (i < items) {
      // 32-bit: a call's pieces are at most kUnitTokens * num_parts, and a 64-bit division is
      // a called routine (dozens of dependent instructions) on the round's path.
      const int32_t t = g.n_parts_div.div(int32_t(i)), part = int32_t(i) - t * n_parts;
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
                        for (int32_t j = 0; j < d.n; ++j) {
                          const int32_t rank = d.rank_of(j), slot = d.slot_of(j);
                          if (remote(g, rank)) put_part(g, rank, slot, part, seq);
                        }
                      }
                      // Lane j < d.n holds destination j (Dests).
                      __syncwarp();  // lane 0's n_flags
                      const int32_t n0 = n_flags[warp];
                      if (lane < d.n) {
                        flag_rank[warp][n0 + lane] = d.rank;
                        flag_slot[warp][n0 + lane] = d.slot;
                      }
                      __syncwarp();
                      if (lane == 0) n_flags[warp] = n0 + d.n;
                    });
    } else if (lane == 0) {
      n_flags[warp] = 0;
    }
    // Ordering: every warp's stores -> __syncthreads -> warp 0's system fence (acq_rel, each
    // lane's) -> lane w's relaxed stores of warp w's flags (a release pattern): a destination
    // that acquires a flag sees the piece. (A rank of another node had its flag with the put,
    // put_part.) The lanes raise the warps' flags side by side: thread 0 raising all of them in
    // turn, each behind the loads of its list, took the sending blocks about 3 us from their
    // fence to their end of the round (one H200, one-rank decode, 2026-11-27 stage marks).
    static_assert(kWarps <= kWarpSize, "a lane of warp 0 per warp");
    __syncthreads();
    trace_mark(g, kTraceDispatch, kTraceStored);
    if (warp == 0) {
      fence_acq_rel_sys();
      trace_mark(g, kTraceDispatch, kTraceFenced);
      if (lane < kWarps)
        for (int32_t j = 0; j < n_flags[lane]; ++j)
          if (!remote(g, flag_rank[lane][j]))
            signal<SignalOp::kSetFenced>(
                g, flag_rank[lane][j],
                wl.part_flag_offset(g.rank, flag_slot[lane][j], flag_part[lane]), seq);
    }
    __syncthreads();  // the flag lists are refilled next round
  }
  // Every put and signal of this call completed before the kernel ends: a receiver may
  // acknowledge without waiting for them (a call it rejects), and the next call reuses the
  // outbox and the flags.
  put_quiet(g);
  trace_mark(g, kTraceDispatch, kTraceSent);
  return num_tokens;
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
