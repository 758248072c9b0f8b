// Combine over the transport seam (transport.cuh: NVLink peer stores, NVSHMEM puts). Header-only
// so that a caller's epilogue functor can be compiled into the kernel
// (epcomm/combine_epilogue.cuh); the library instantiates the plain bf16 store.
//
// Protocol, per call `seq` (= combine calls completed on this rank + 1):
//  send  wait until every token owner acknowledged the previous call (its combine buffer is
//        free). Token-side reduction: store every expert-output row r to its owner's slot
//        (src_info[r].token, src_info[r].slot). Expert-side reduction (the dispatch carried the
//        router weights): for every message the last dispatch received, still in this rank's
//        dispatch buffer, sum its rows w * y in fp32 (top-k slot ascending), round to bf16 and
//        store that one row to its owner's slot (token, rank_slot). Each block then adds 1 to
//        kCombineArrived[me] in every owner.
//  recv  wait until kCombineArrived[s] reaches seq * num_blocks for every source s, then reduce
//        each token's rows in fp32 in a fixed order (top-k slot, or rank slot, ascending:
//        deterministic), skipping masked slots; the last block to finish releases
//        kCombineAck[me] = seq in every source and bumps the local combine_seq.
// A message's header outlives its dispatch: a source writes this rank's dispatch buffer again
// only in its next dispatch, which comes after its combine, which waits for every block of this
// send.
#pragma once

#include <type_traits>
#include <utility>

#include "epcomm/config.h"
#include "epcomm/detail/device.cuh"
#include "epcomm/detail/launch.h"
#include "epcomm/detail/transport.cuh"

namespace epcomm {
namespace detail {

// No row is bulk-prefetched to L2 before a warp sums it. That was faster with one rank while the
// sum held 8 loads a lane, but over NVLink (4 x H200, 24 SMs) prefill combine took 754 us with it
// and 736 without (16 loads a lane, docs/results/2026-11-26_h200x4_dceca44.md), and in the
// NVSHMEM build (8 loads a lane) 750 with it and 690 without
// (docs/results/2026-11-26_h200x4_ab_061786c.md); it was removed.

// The library's epilogue: round to bf16 and store out[token, column].
struct StoreBf16 {
  uint16_t* out;
  int32_t hidden;
};

// Hands 8 consecutive columns to an epilogue: a user functor gets (token, column, value) per
// element; StoreBf16 stores them as one 16-byte vector.
template <class Epilogue>
__device__ __forceinline__ void emit8(Epilogue& epi, int32_t token, int32_t col,
                                      const float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
    epi(token, col + i, v[i]);
}
__device__ __forceinline__ void emit8(StoreBf16& epi, int32_t token, int32_t col,
                                      const float (&v)[8]) {
  st_v4(epi.out + int64_t(token) * epi.hidden + col, pack_bf16x8(v));
}

// Rows of the call's H columns (CombineParams::hidden) handed to the grid's warps as (row,
// part) items (combine_split).
struct WorkSplit {
  int32_t split;
  int64_t items;
  // combine_split, by the whole warp: lane k <= kCombineSplitItems costs candidate k (lane 0
  // split 1) at once, and the warp takes the least cost (ties: the fewer parts), as
  // combine_split's loop does.
  __device__ static WorkSplit make(const CombineParams& p, int64_t rows) {
    const GroupView& g = p.g;
    const int32_t steps = (p.hidden + kCombineStep - 1) / kCombineStep;
    const int64_t warps = stride(g);
    int32_t split = 1;
    if (combine_split_in_range(rows, steps, warps)) {
      const int32_t r = int32_t(rows), w = int32_t(warps), lane = threadIdx.x % kWarpSize;
      int32_t s = lane == 0 ? 1 : 0;
      if (lane >= 1 && lane <= kCombineSplitItems) s = combine_split_candidate(r, steps, w, lane);
      const uint32_t cost = s >= 1 ? uint32_t(combine_split_cost(r, steps, w, s)) : UINT32_MAX;
      const uint32_t least = __reduce_min_sync(0xffffffffu, cost);
      split = int32_t(__reduce_min_sync(0xffffffffu, cost == least ? uint32_t(s) : UINT32_MAX));
    }
    return WorkSplit{split, rows * split};
  }
  __device__ static int64_t first_item() {
    return int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / kWarpSize;
  }
  // The grid's warps (num_blocks taken as the unsigned count it is: the compiler then knows the
  // items' indices are never negative).
  __device__ static int64_t stride(const GroupView& g) {
    return int64_t(uint32_t(g.num_blocks)) * kCombineWarps;
  }
  // Columns between one step of a part and its next.
  __device__ int32_t column_stride() const { return split * kCombineStep; }
};

// Where the send reads expert output row i (dispatch row order): row i, or its slot in the
// padded per-expert layout (CombineInput::expert_out_capacity); -1 outside its group's slots.
// kNoSlot marks that in a shuffled row offset.
constexpr int32_t kNoSlot = INT32_MIN;
__device__ __forceinline__ GroupSlots expert_slots(const CombineParams& p) {
  return GroupSlots{p.row_offsets, p.g.n_local(), p.expert_capacity};
}

// The weighted sum of up to kMaxTopK rows, the one reduction of every combine path: lane j < n
// holds row j's address (null: skipped) and weight w_j; acc = sum over j of w_j * y_j in fp32, in
// row order (bit for bit the same however the loads are grouped; with w = 1 each step is the
// rounded add), over this item's columns (256-column steps from part * 256, every `stride`), each
// step's 8 values handed to out(column, acc). kU steps per pass and kRows rows' loads in flight
// together: kU * kRows 16-byte loads per lane per round trip.
//
// The loop is the hot one of combine (Nsight Compute, prefill with 8 SMs on one H100: 2.5
// instructions issued per cycle, 4.9 per summed value, of which the unpack and the FMA are 2),
// so it tests as little as it can: the rows to sum are first moved, in order, to lanes 0 .. m - 1
// (so a row's test is j < m, one count for the whole warp, not a pointer per row), and steps whose
// columns all lie inside H for every lane (all of them when H is a multiple of 256) take a body
// with no column test.
template <int kU, int kRows, class Load, class Out>
__device__ __forceinline__ void sum_rows_by(const char* row, float w, int32_t n, int32_t H,
                                            int32_t part, int32_t stride, Load load, Out& out) {
  const int lane = threadIdx.x % kWarpSize;
  const unsigned live = __ballot_sync(0xffffffffu, lane < n && row != nullptr);
  const int32_t m = __popc(live);
  const int src = lane < m ? int(__fns(live, 0, lane + 1)) : 0;
  const uintptr_t rows = __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(row), src);
  const float weights = __shfl_sync(0xffffffffu, w, src);
  // One pass of kU steps from `base`; kInside: every column of it lies inside H.
  auto pass = [&](int32_t base, auto inside) {
    constexpr bool kInside = decltype(inside)::value;
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        acc[u][i] = 0.0f;
#pragma unroll 1
    for (int32_t j0 = 0; j0 < m; j0 += kRows) {
      const char* r[kRows];
      float wj[kRows];
      uint4 raw[kRows][kU];
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
        r[q] = reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, rows, (j0 + q) % kWarpSize));
        wj[q] = __shfl_sync(0xffffffffu, weights, (j0 + q) % kWarpSize);
      }
#pragma unroll
      for (int q = 0; q < kRows; ++q)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int32_t c = base + u * stride + lane * 8;
          if (j0 + q < m && (kInside || c < H)) raw[q][u] = load(r[q] + int64_t(c) * 2);
        }
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
        if (j0 + q >= m) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (!kInside && base + u * stride + lane * 8 >= H) continue;
          float y[8];
          unpack_bf16x8(raw[q][u], y);
#pragma unroll
          for (int i = 0; i < 8; ++i)
            acc[u][i] = fmaf(wj[q], y[i], acc[u][i]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int32_t c = base + u * stride + lane * 8;
      if (kInside || c < H) out(c, acc[u]);
    }
  };
  // Every lane runs this loop the same number of times (the shuffles sit inside).
#pragma unroll 1
  for (int32_t base = part * kCombineStep; base < H; base += kU * stride) {
    if (__all_sync(0xffffffffu, base + (kU - 1) * stride + kCombineStep <= H))
      pass(base, std::true_type{});
    else
      pass(base, std::false_type{});
  }
}

// sum_rows_by as the kernel was chosen for (one instantiation per kernel: two inlined side by
// side made the kernels spill in these loops, 128 registers being all 512 threads may have):
// kWholeRows, items of more than one step (prefill; decode's 128 tokens since the split at least
// cost, 9541380, on 24 and 132 SMs): 4 steps of 4 rows per round trip (16 loads a lane;
// on one H100, prefill combine with 32 SMs 332 -> 315 us and the token side with 8 SMs 930 ->
// 913 against 4 steps of 2 rows; 2 steps of 8 rows lost: 870 -> 1012 us, expert side, 8 SMs);
// otherwise one step of up to 8 rows (items of one step: a row split into as many parts as it
// has steps, e.g. 64 tokens or fewer on 132 SMs). Either is exact for
// any item. Over NVLink (4 x H200, 4 ranks) 4 x 2 lost to 4 x 4 as well: prefill combine 742
// against 727 us at 24 SMs, prefill-fp8 combine 1660 against 1564 at 8 SMs.
// The build with NVSHMEM (relocatable device code: its puts are calls, which hold registers
// across them) keeps 4 steps of 2 rows: with 4 x 4 its fused expert-side kernel spilled 620
// bytes, and prefill combine over 4 x H200 (NVSHMEM benchmark, 1 x 4) took 998 us against 810
// with 4 x 2.
#if EPCOMM_NVSHMEM
constexpr int kWholeRowsPerStep = 2;
#else
constexpr int kWholeRowsPerStep = 4;
#endif
template <bool kWholeRows, class Load, class Out>
__device__ __forceinline__ void sum_rows(const char* row, float w, int32_t n, int32_t H,
                                         int32_t part, int32_t stride, Load load, Out& out) {
  if constexpr (kWholeRows)
    sum_rows_by<4, kWholeRowsPerStep>(row, w, n, H, part, stride, load, out);
  else
    sum_rows_by<1, 8>(row, w, n, H, part, stride, load, out);
}

// The fused kernel of a group of one rank (kAlone: a kernel of its own, which launch_combine
// picks where n_ranks == 1): every expert row is this rank's own, so no row need cross the
// combine buffer (the token side reads them in place, the expert side's send hands its sums to
// the epilogue). The other kernels hold none of this code: compiled into the fused kernel of
// every group (b5509d2), it cost the expert-side whole-row kernel registers it spilled, and two
// H200s over NVLink 4.6 % of prefill's combine at 24 SMs (440.9 -> 461.2 us) and 5 % at 8.
template <bool kAlone>
__device__ __forceinline__ bool fused_alone(const GroupView& g) {
  return kAlone && g.n_ranks == 1;
}

// The expert side's half of the expert-side reduction: one pre-summed row per received message.
// `bases`: p.recv_base, copied to shared memory. kAlone: the fused kernel of a group of one rank,
// whose receive would add one row per token (0 + that row): the sum goes straight to `epi`
// instead (the row's round trip through the combine buffer cost about a quarter of prefill's
// combine), and the receive writes only the tokens no message names (combine_recv).
template <bool kWholeRows, bool kAlone, class Epilogue>
__device__ inline void combine_send_expert_side(const CombineParams& p, const int32_t* bases,
                                                Epilogue& epi) {
  const GroupView& g = p.g;
  const WindowLayout wl = g.layout();
  const CombineRecvLayout cl = wl.combine_recv();
  const DispatchRecvLayout rl = wl.dispatch_recv();
  const int32_t n_local = g.n_local(), K = g.top_k, H = p.hidden;
  const int64_t row_limit = g.output().rows;
  const int lane = threadIdx.x % kWarpSize;
  const char* in = static_cast<const char*>(p.expert_out);
  const bool direct = fused_alone<kAlone>(g);
  const int32_t num_tokens =
      direct ? *reinterpret_cast<volatile int32_t*>(&g.state->num_tokens) : g.max_tokens;

  // Messages interleaved over sources, (message m, source) m-major, with each rank starting at
  // the source after itself: at any moment the grid's warps write to every owner at once. Taking
  // one source after another would make all ranks write to rank 0 first, then all to rank 1 ...
  // (measured: the prefill send then took longer than the token side's 8 rows).
  __shared__ int32_t count[WindowLayout::kMaxPeers];  // messages from source s, clamped
  if (threadIdx.x < g.n_ranks) {
    const int32_t c = p.recv_count[threadIdx.x];
    count[threadIdx.x] = c < 0 ? 0 : (c > g.max_tokens ? g.max_tokens : c);
  }
  __syncthreads();
  int32_t most = 0;
  for (int32_t s = 0; s < g.n_ranks; ++s)
    most = count[s] > most ? count[s] : most;
  // A row for a rank of another node is put whole, once summed: one item per row there.
  const WorkSplit ws = any_remote(g) ? WorkSplit{1, int64_t(most) * g.n_ranks}
                                     : WorkSplit::make(p, int64_t(most) * g.n_ranks);
  for (int64_t item = WorkSplit::first_item(); item < ws.items; item += WorkSplit::stride(g)) {
    const int64_t slot_item = item / ws.split;
    const int32_t part = int32_t(item % ws.split);
    const int32_t m = int32_t(slot_item / g.n_ranks);
    const int32_t s = int32_t((slot_item % g.n_ranks + g.rank + 1) % g.n_ranks);
    if (m >= count[s]) continue;
    const MessageHeader* h = reinterpret_cast<const MessageHeader*>(
        window_at(g, g.rank, wl.dispatch_recv_offset() + rl.offset(s, m)));
    MessageEntry e{};
    if (lane < K) e = h->entries[lane];  // with the header's words: one round trip
    const int32_t token = h->token, slot = h->rank_slot;
    const int32_t n = min(int32_t(h->n_entries), K);
    if (token < 0 || token >= num_tokens || slot < 0 || slot >= K) continue;  // stay inside
    const char* row = nullptr;
    float w = 0.0f;
    if (lane < n) {
      int64_t r = -1;
      if (e.group() < n_local) r = int64_t(bases[s * n_local + e.group()]) + e.pos;
      const int64_t at = r >= 0 && r < row_limit ? expert_slots(p).slot_row(e.group(), r) : -1;
      if (at >= 0) row = in + at * H * 2;
      w = e.weight;
    }
    const int64_t at = wl.combine_recv_offset() + cl.offset(token, slot);
    char* dst = put_buffer(g, s, at, [&] {
      return outbox_at(g, g.outbox_layout().combine_offset(
                              int64_t(g.nodes().remote_index(g.rank, s)) * g.max_tokens + m));
    });
    auto store = [&](int32_t c, const float(&acc)[8]) {
      const uint4 v = pack_bf16x8(acc);
      if (!direct) {
        st_v4(dst + int64_t(c) * 2, v);
        return;
      }
      float y[8];  // what the receive's sum of this one row gives: 0 + the rounded row
      unpack_bf16x8(v, y);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        y[i] = __fadd_rn(0.0f, y[i]);
      emit8(epi, token, c, y);
    };
    sum_rows<kWholeRows>(row, w, n, H, part, ws.column_stride(), LoadNc{}, store);
    if (!direct) warp_put(g, s, at, dst, int64_t(H) * 2);
  }
}

// kDirectSelf (the fused kernel, token side): rows of this rank's own tokens stay where they
// are; the receive reads them from expert_out (scratch.self_row).
template <bool kExpertSide, bool kWholeRows, bool kFused, bool kAlone, class Epilogue>
__device__ inline void combine_send(const CombineParams& p, unsigned long long seq, Epilogue& epi) {
  constexpr bool kDirectSelf = kFused && !kExpertSide;
  const GroupView& g = p.g;
  // Expert side: the (source, group) base rows, loaded while the acks are awaited (the view's
  // experts: one more per rank with the shared expert).
  constexpr int kMaxBases = kMaxExperts + kMaxRanks;
  constexpr int kBasesPerThread = (kMaxBases + kCombineThreads - 1) / kCombineThreads;
  int32_t base[kBasesPerThread] = {};
  if constexpr (kExpertSide)
#pragma unroll
    for (int i = 0; i < kBasesPerThread; ++i) {
      const int32_t j = threadIdx.x + i * kCombineThreads;
      if (j < g.n_experts) base[i] = p.recv_base[j];  // n_ranks * n_local = n_experts
    }
  if (!block_wait_signal(g, all_ranks_mask(g), WindowLayout::kCombineAck, kOpCombineSend, kWaitAck,
                         [&](int32_t) { return seq - 1; }))
    return;
  trace_mark(g, kTraceCombine, kTraceAcked);
  if constexpr (kExpertSide) {
    __shared__ int32_t bases[kMaxBases];
#pragma unroll
    for (int i = 0; i < kBasesPerThread; ++i) {
      const int32_t j = threadIdx.x + i * kCombineThreads;
      if (j < g.n_experts) bases[j] = base[i];
    }
    __syncthreads();
    combine_send_expert_side<kWholeRows, kAlone>(p, bases, epi);
    block_signal_all(g, WindowLayout::kCombineArrived);
    trace_mark(g, kTraceCombine, kTraceSent);
    return;
  }
  const WindowLayout wl = g.layout();
  const CombineRecvLayout cl = wl.combine_recv();
  const int32_t n_vec = p.hidden / 8;
  const int64_t row_limit = g.output().rows;  // padding rows included
  int64_t rows = int64_t(p.row_offsets[g.n_local()]);
  if (rows > row_limit) rows = row_limit;
  const char* in = static_cast<const char*>(p.expert_out);

  // Items (row, piece): a piece is one pass of copy_vectors (every lane's loads in flight at
  // once), so a decode's few rows spread over every warp of the grid instead of one warp
  // looping over a row's 28 vectors per lane (measured several times slower on decode).
  // Lane l loads the SrcInfo of the warp's item l of each 32: one round trip per 32 items, not
  // one before each (the fused kernel skips this rank's own rows at the cost of a shuffle).
  constexpr int32_t kPiece = kCopyUnroll * kWarpSize;  // vectors
  const int32_t pieces = (n_vec + kPiece - 1) / kPiece;
  // A group of one rank has no rows to send in the fused kernel: every row is its own.
  const int64_t items = kDirectSelf && fused_alone<kAlone>(g) ? 0 : rows * pieces;
  const int64_t step = WorkSplit::stride(g);
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t batch = WorkSplit::first_item(); batch < items; batch += kWarpSize * step) {
    const int64_t mine = batch + lane * step;
    const SrcInfo ahead = mine < items ? p.src_info[mine / pieces] : SrcInfo{-1, -1, -1};
    // And where its row is read (the padded layout), as an offset from the row: 0 in dispatch
    // row order (set-up keeps the padded layout's rows below 2^31). Looked up here in the split
    // kernel, per row below in the fused one: each way keeps that kernel's registers.
    int32_t ahead_delta = 0;
    if (!kDirectSelf && p.expert_capacity != 0 && mine < items) {
      const int64_t at = expert_slots(p).slot_row(mine / pieces);
      ahead_delta = at >= 0 ? int32_t(at - mine / pieces) : kNoSlot;
    }
    for (int32_t j = 0; j < kWarpSize; ++j) {
      const int64_t item = batch + j * step;
      if (item >= items) break;  // the same for every lane
      const int64_t r = item / pieces;
      const int32_t v0 = int32_t(item % pieces) * kPiece;
      const int32_t token = __shfl_sync(0xffffffffu, ahead.token, j);
      const int32_t rank = __shfl_sync(0xffffffffu, int32_t(ahead.rank), j);
      const int32_t slot = __shfl_sync(0xffffffffu, int32_t(ahead.slot), j);
      const int32_t delta = kDirectSelf ? 0 : __shfl_sync(0xffffffffu, ahead_delta, j);
      const int32_t owner = g.route.view_rank_of(rank);  // src_info holds the caller's rank
      if (owner < 0 || owner >= g.n_ranks || token < 0 || token >= g.max_tokens || slot < 0 ||
          slot >= g.top_k)
        continue;  // padding rows, and never a write outside a peer's buffer
      if (kDirectSelf && owner == g.rank) continue;  // read in place by the receive
      const int64_t src =
          kDirectSelf ? expert_slots(p).slot_row(r) : (delta == kNoSlot ? -1 : r + delta);
      if (src < 0) continue;  // outside its group's slots (bad row_offsets): never read
      const int64_t at = wl.combine_recv_offset() + cl.offset(token, slot) + int64_t(v0) * 16;
      // Staged at the row's place in the outbox for a rank of another node.
      char* dst = put_buffer(g, owner, at, [=, &g] {
        return outbox_at(g, g.outbox_layout().combine_offset(r)) + int64_t(v0) * 16;
      });
      const int32_t n = min(kPiece, n_vec - v0);
      copy_vectors(in + (src * p.hidden + int64_t(v0) * 8) * 2, n, 1, LoadNc{},
                   [&](int32_t) { return dst; });
      warp_put(g, owner, at, dst, int64_t(n) * 16);
    }
  }
  block_signal_all(g, WindowLayout::kCombineArrived);
  trace_mark(g, kTraceCombine, kTraceSent);
}

template <bool kExpertSide, bool kWholeRows, bool kFused, bool kAlone, class Epilogue>
__device__ void combine_recv(const CombineParams& p, unsigned long long seq, Epilogue& epi) {
  constexpr bool kDirectSelf = kFused && !kExpertSide;  // as combine_send
  const GroupView& g = p.g;
  if (!block_wait_signal(g, all_ranks_mask(g), WindowLayout::kCombineArrived, kOpCombineRecv,
                         kWaitData,
                         [&](int32_t) { return seq * (unsigned long long)g.num_blocks; }))
    return;
  trace_mark(g, kTraceCombine, kTraceReady);
  const WindowLayout wl = g.layout();
  const CombineRecvLayout cl = wl.combine_recv();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t K = g.top_k, H = p.hidden;
  const int32_t num_tokens = *reinterpret_cast<volatile int32_t*>(&g.state->num_tokens);
  const char* recv = window_at(g, g.rank, wl.combine_recv_offset());

  // Work items are (token, part) (WorkSplit).
  const WorkSplit ws = WorkSplit::make(p, num_tokens);
  const int32_t split = ws.split;
  const ExpertMap em = g.experts();
  // kDirectSelf: this rank's own expert rows are read in expert_out, at rows below what the
  // dispatch wrote (a stale scratch.self_row never reads past the caller's rows).
  int64_t self_rows = 0;
  if (kDirectSelf) self_rows = min(int64_t(p.row_offsets[g.n_local()]), g.output().rows);
  const char* expert_out = static_cast<const char*>(p.expert_out);
  // The fused expert-side kernel in a group of one rank: its send wrote every token a message
  // names; the others (every slot masked) get zeros here. A lane per token, so a warp finds 32
  // tokens' ids in one round trip (a warp per token took 21 us of prefill's combine at 8 SMs on
  // one H100, reading ids of tokens it then skipped).
  const bool direct = kExpertSide && fused_alone<kAlone>(g);
  if (direct) {
    for (int64_t b = WorkSplit::first_item(); b * kWarpSize < num_tokens;
         b += WorkSplit::stride(g)) {
      const int64_t t = b * kWarpSize + lane;
      bool named = false;
#pragma unroll
      for (int32_t k = 0; k < kMaxTopK; ++k)  // the view's slots, the shared expert's included
        if (k < K && t < num_tokens) named |= p.topk[t * K + k] >= 0;
      for (uint32_t z = __ballot_sync(0xffffffffu, t < num_tokens && !named); z; z &= z - 1u) {
        const int32_t tz = int32_t(b * kWarpSize + __ffs(z) - 1);
        const float zeros[8] = {};  // what a sum of no rows gives, column by column
        for (int32_t c = lane * 8; c < H; c += kCombineStep)
          emit8(epi, tz, c, zeros);
      }
    }
  }
  const int64_t items = direct ? 0 : ws.items;
  for (int64_t item = WorkSplit::first_item(); item < items; item += WorkSplit::stride(g)) {
    const int32_t t = int32_t(item / split), part = int32_t(item % split);
    // Lane k holds slot k's id and row; sum_rows shuffles them to the warp.
    const int32_t id = lane < K ? p.topk[int64_t(t) * K + lane] : -1;
    const char* slots = recv + cl.offset(t, 0);
    const int32_t stride = ws.column_stride();
    auto emit = [&](int32_t c, const float(&acc)[8]) { emit8(epi, t, c, acc); };
    if constexpr (kExpertSide) {
      // One row per rank the token went to, summed in rank order (weight 1: plain adds).
      const int32_t dr = id >= 0 ? em.rank_of(id) : -1;
      const int32_t n =
          __popc(__reduce_or_sync(0xffffffffu, dr >= 0 && dr < kWarpSize ? 1u << dr : 0u)) +
          __popc(__reduce_or_sync(0xffffffffu, dr >= kWarpSize ? 1u << (dr - kWarpSize) : 0u));
      const char* row = lane < n ? slots + lane * cl.row_bytes() : nullptr;
      sum_rows<kWholeRows>(row, 1.0f, n, H, part, stride, LoadOnce{}, emit);
      continue;
    }
    const float w =
        (lane < K && p.weights != nullptr) ? g.route.slot_weight(p.weights, t, lane) : 0.f;
    // Slot k's row: in the combine buffer, or (kDirectSelf, an expert of this rank) in
    // expert_out; null for a masked slot.
    const char* mine = nullptr;
    if (id >= 0) {
      mine = slots + int64_t(lane) * cl.row_bytes();
      if (kDirectSelf && em.rank_of(id) == g.rank) {
        const int32_t r = p.self_row[int64_t(t) * K + lane];
        const int64_t at = r >= 0 && r < self_rows ? expert_slots(p).slot_row(r) : -1;
        mine = at >= 0 ? expert_out + at * H * 2 : nullptr;
      }
    }
    if (p.weights != nullptr) {
      sum_rows<kWholeRows>(mine, w, K, H, part, stride, LoadOnce{}, emit);
    } else {
      // No weights: each slot's row as it is, zeros for a masked one.
      char* out = static_cast<char*>(p.out) + int64_t(t) * K * H * 2;
      for (int32_t k = 0; k < K; ++k) {
        const char* src = reinterpret_cast<const char*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(mine), k));
        for (int32_t c = (part * kWarpSize + lane) * 8; c < H; c += stride) {
          const uint4 v = src != nullptr ? ld_v4(src + int64_t(c) * 2) : make_uint4(0, 0, 0, 0);
          st_v4(out + (int64_t(k) * H + c) * 2, v);
        }
      }
    }
  }

  if (last_block_done(g, &g.state->combine_done) && threadIdx.x == 0) {
    signal_all<SignalOp::kSetFenced>(g, WindowLayout::kCombineAck, seq);
    put_quiet(g);
    g.state->combine_seq = seq;
  }
  trace_mark(g, kTraceCombine, kTraceDone);
}

// One form of combine: the send half, the receive half, or both (the fused form; kAlone: the
// fused form of a group of one rank).
template <class Epilogue, bool kSend, bool kRecv, bool kExpertSide, bool kWholeRows,
          bool kAlone = false>
__device__ __forceinline__ void combine_form(const CombineParams& p, Epilogue& epi) {
  if (block_aborted(p.g)) return;
  trace_begin(p.g, kTraceCombine, kSend ? kTraceStart : kTraceRecvStart,
              kRecv ? kTraceMarks : kTraceRecvStart);
  const unsigned long long seq = p.g.state->combine_seq + 1;
  // The fused kernel: the token side reads this rank's own rows in place (kDirectSelf).
  constexpr bool kFused = kSend && kRecv;
  static_assert(kFused || !kAlone, "a group of one rank's own kernel is a fused one");
  if (kSend) combine_send<kExpertSide, kWholeRows, kFused, kAlone>(p, seq, epi);
  if (!kRecv) trace_mark(p.g, kTraceCombine, kTraceDone);
  if (kRecv && !block_aborted(p.g)) {
    if (kSend) trace_mark(p.g, kTraceCombine, kTraceRecvStart);
    combine_recv<kExpertSide, kWholeRows, kFused, kAlone>(p, seq, epi);
  }
}

// kExpertSide (the last dispatch carried the weights) and kWholeRows (sum_rows) are template
// parameters so that each kernel holds one reduction's code and one shape of its loads:
// together they would not fit the registers. Per reduction and shape, two kernels: the fused
// form, and one kernel for both halves of a split call (combine_async's send, combine_wait's
// receive: `recv_half` picks), so that a profiler sees one kernel name per operation and form
// (DeepEP's test programs and profiling helpers find an operation's kernels by name).
// A half of the split kernel, out of line: each half keeps the registers it had as a kernel of
// its own (inlined side by side, the token-side whole-row half spilled).
template <class Epilogue, bool kSend, bool kExpertSide, bool kWholeRows>
static __device__ __noinline__ void combine_half(const CombineParams& p, Epilogue& epi) {
  combine_form<Epilogue, kSend, !kSend, kExpertSide, kWholeRows>(p, epi);
}
template <class Epilogue, bool kFused, bool kExpertSide, bool kWholeRows, bool kAlone = false>
__global__ void __launch_bounds__(kCombineThreads, 1)
    combine_kernel(const __grid_constant__ CombineParams p, Epilogue epi, int32_t recv_half) {
  if constexpr (kFused)
    combine_form<Epilogue, true, true, kExpertSide, kWholeRows, kAlone>(p, epi);
  else if (recv_half)
    combine_half<Epilogue, false, kExpertSide, kWholeRows>(p, epi);
  else
    combine_half<Epilogue, true, kExpertSide, kWholeRows>(p, epi);
}

// The kernel of one form (fused, a group of one rank's fused kernel where `alone`, or the split
// kernel of either half), reduction and load shape.
template <class Epilogue, bool kExpertSide, bool kWholeRows>
auto combine_kernel_of(bool fused, bool alone) {
  return !fused ? combine_kernel<Epilogue, false, kExpertSide, kWholeRows>
                : (alone ? combine_kernel<Epilogue, true, kExpertSide, kWholeRows, true>
                         : combine_kernel<Epilogue, true, kExpertSide, kWholeRows>);
}
template <class Epilogue>
auto combine_kernel_of(bool expert_side, bool whole_rows, bool fused, bool alone) {
  return expert_side ? (whole_rows ? combine_kernel_of<Epilogue, true, true>(fused, alone)
                                   : combine_kernel_of<Epilogue, true, false>(fused, alone))
                     : (whole_rows ? combine_kernel_of<Epilogue, false, true>(fused, alone)
                                   : combine_kernel_of<Epilogue, false, false>(fused, alone));
}

// Loads the combine kernels for `Epilogue` on the current device. CUDA loads a kernel lazily at
// its first launch, and loading waits for the device to go idle: a first launch queued behind a
// kernel that is waiting for peers would stall the host until that wait times out. Set-up
// therefore loads every kernel before the first operation.
template <class Epilogue>
void load_combine_kernels() {
  cudaFuncAttributes a;
  for (bool fused : {true, false})
    for (bool alone : {false, true})
      for (bool expert_side : {false, true})
        for (bool whole_rows : {false, true})
          if (fused || !alone)
            check_cuda(cudaFuncGetAttributes(
                           &a, combine_kernel_of<Epilogue>(expert_side, whole_rows, fused, alone)),
                       "load combine");
}

template <class Epilogue>
void launch_combine(const CombineParams& p, const Epilogue& epi, bool send, bool recv,
                    cudaStream_t stream) {
  auto kernel = combine_kernel_of<Epilogue>(p.expert_side != 0, p.whole_rows != 0, send && recv,
                                            p.g.n_ranks == 1);
  launch_cooperative(kernel, p.g.num_blocks, kCombineThreads, 0, stream, p, epi, int32_t(!send));
}

}  // namespace detail
}  // namespace epcomm
