// Dispatch over NVLink peer stores.
//
// Protocol, per call `seq` (= dispatch calls completed on this rank + 1; every rank counts the
// same calls, so seq agrees across ranks without any exchange):
//  send  1. rank: every (token, key) gets its position among this rank's tokens carrying that
//           key (keys = experts and destination ranks, layout.h ExpertMap). Stable by token
//           index, so outputs are deterministic. Units of 512 tokens are ranked by one block
//           with per-warp lane bitmaps in shared memory; a grid-wide scan over units finishes.
//           The same pass validates topk_ids: a bad rank records the error and sends nothing.
//        2. wait until every destination acknowledged the previous call (its receive buffer is
//           free), then write the meta record (token count per destination group, message
//           count) into each destination's window and release its seq word.
//        3. one message per (token, destination rank): header (token, and for each of the
//           token's experts on that rank: group, top-k slot, position) + payload, stored into
//           the destination's stream slot. Each block then adds 1 to kDispatchArrived[me] in
//           every destination.
//  recv  4. wait for every source's meta record; derive row_offsets and each (source, group)
//           base row; wait for source s's kDispatchArrived to reach seq * num_blocks, then
//           expand each message into its group rows (one wire copy, many output rows).
//        5. the last block to finish releases kDispatchAck[me] = seq in every source and bumps
//           the local dispatch_seq.
#include <cub/block/block_scan.cuh>

#include "epcomm/config.h"
#include "epcomm/detail/device.cuh"
#include "kernels/kernels.h"

namespace epcomm {
namespace detail {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kUnitTokens = kWarps * kWarpSize;  // tokens ranked together by one block
constexpr int kUnroll = 4;                       // 16-byte vectors in flight per lane

__device__ __forceinline__ int64_t max_recv_rows(const GroupView& g) {
  const int32_t per_token = g.top_k < g.n_local() ? g.top_k : g.n_local();
  return int64_t(g.max_tokens) * g.n_ranks * per_token;
}

// ---- 1. ranking -----------------------------------------------------------------------------

// Validates token t's ids (recording the first problem) and returns them with bad ids masked.
__device__ void load_ids(const DispatchParams& p, int32_t t, unsigned long long seq,
                         int32_t (&ids)[kMaxTopK]) {
  const GroupView& g = p.g;
  bool bad = false;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    ids[k] = -1;
    if (k >= g.top_k) continue;
    const int32_t id = p.topk_ids[int64_t(t) * g.top_k + k];
    if (id < -1 || id >= g.n_experts) {
      record_error(g, ErrorCode::kBadExpertId, kOpDispatchSend, 0, t, k, id, kWaitNone);
      bad = true;
      continue;
    }
#pragma unroll
    for (int j = 0; j < k; ++j) {
      if (id >= 0 && ids[j] == id) {
        record_error(g, ErrorCode::kDuplicateExpert, kOpDispatchSend, 0, t, k, id, kWaitNone);
        bad = true;
      }
    }
    ids[k] = id;
  }
  if (bad) atomicMax(&g.state->bad_input, seq);
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
    uint32_t rank_mask = 0;
    if (valid) {
      load_ids(p, t, seq, ids);
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        if (k >= K) continue;
        p.scratch.topk[int64_t(t) * K + k] = ids[k];
        if (ids[k] < 0) continue;
        atomicOr(&bm[ids[k]], 1u << lane);
        rank_mask |= 1u << em.rank_of(ids[k]);
      }
      for (uint32_t m = rank_mask; m; m &= m - 1) atomicOr(&bm[em.rank_key(__ffs(m) - 1)], 1u << lane);
    }
    __syncthreads();
    // Per key: tokens of earlier warps of the unit (warp_prefix) and of the whole unit.
    for (int32_t key = threadIdx.x; key < nk; key += kThreads) {
      int32_t run = 0;
      for (int w = 0; w < kWarps; ++w) {
        warp_prefix[w * nk + key] = uint16_t(run);
        run += __popc(bitmap[w * nk + key]);
      }
      p.scratch.unit_hist[int64_t(u) * nk + key] = run;
    }
    __syncthreads();
    if (valid) {
      const uint32_t lt = lanemask_lt();
      const uint16_t* wp = warp_prefix + warp * nk;
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        if (k >= K || ids[k] < 0) continue;
        p.scratch.expert_pos[int64_t(t) * K + k] = wp[ids[k]] + __popc(bm[ids[k]] & lt);
      }
      for (int32_t r = 0; r < g.n_ranks; ++r) {
        const int32_t key = em.rank_key(r);
        p.scratch.dest_pos[int64_t(t) * g.n_ranks + r] =
            (rank_mask >> r) & 1u ? wp[key] + __popc(bm[key] & lt) : -1;
      }
    }
    __syncthreads();
    if (valid) {  // clear only the words this lane set
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k)
        if (k < K && ids[k] >= 0) bm[ids[k]] = 0;
      for (uint32_t m = rank_mask; m; m &= m - 1) bm[em.rank_key(__ffs(m) - 1)] = 0;
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

__device__ void send_meta(const DispatchParams& p, unsigned long long seq, bool bad) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t nk = em.num_keys(), n_local = g.n_local();
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int32_t n_units = (p.num_tokens + kUnitTokens - 1) / kUnitTokens;
  const int32_t* totals = p.scratch.unit_prefix + int64_t(n_units) * nk;
  const MetaLayout ml = g.layout().meta();
  for (int32_t d = warp; d < g.n_ranks; d += kWarps) {
    char* meta = window_at(g, d, g.layout().meta_offset(g.rank));
    int32_t* counts = reinterpret_cast<int32_t*>(meta + ml.counts_offset());
    for (int32_t j = lane; j < n_local; j += kWarpSize)
      counts[j] = bad ? 0 : totals[d * n_local + j];
    if (lane == 0)
      *reinterpret_cast<int32_t*>(meta + ml.stream_count_offset()) =
          bad ? 0 : totals[em.rank_key(d)];
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      st_release_sys(reinterpret_cast<unsigned long long*>(meta + ml.seq_offset()), seq);
    }
  }
}

// ---- 3. messages ------------------------------------------------------------------------------

__device__ void send_messages(const DispatchParams& p, int32_t num_tokens) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t nk = em.num_keys(), K = g.top_k;
  const WindowLayout wl = g.layout();
  const MessageLayout ml = wl.msg();
  const DispatchRecvLayout rl = wl.dispatch_recv();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t n_vec = g.hidden / 8;  // 16-byte vectors per token
  const int32_t warps_total = gridDim.x * kWarps;
  const char* tokens = static_cast<const char*>(p.tokens);

  for (int32_t t = blockIdx.x * kWarps + threadIdx.x / kWarpSize; t < num_tokens;
       t += warps_total) {
    const int32_t* prefix = p.scratch.unit_prefix + int64_t(t / kUnitTokens) * nk;
    // Lane k: top-k slot k. Lane r: destination rank r.
    int32_t id = -1, dest = -1, pos = 0;
    if (lane < K) {
      id = p.scratch.topk[int64_t(t) * K + lane];
      if (id >= 0) {
        dest = em.rank_of(id);
        pos = prefix[id] + p.scratch.expert_pos[int64_t(t) * K + lane];
      }
    }
    int32_t slot = -1;
    if (lane < g.n_ranks) {
      slot = p.scratch.dest_pos[int64_t(t) * g.n_ranks + lane];
      if (slot >= 0) slot += prefix[em.rank_key(lane)];
    }
    const uint32_t dest_mask = __ballot_sync(0xffffffffu, lane < g.n_ranks && slot >= 0);

    // Headers, then payload loaded once and stored to every destination.
    char* payload[WindowLayout::kMaxPeers];
    int32_t n_dest = 0;
    for (uint32_t m = dest_mask; m; m &= m - 1) {
      const int32_t d = __ffs(m) - 1;
      const int32_t s = __shfl_sync(0xffffffffu, slot, d);
      char* msg = window_at(g, d, wl.dispatch_recv_offset() + rl.offset(g.rank, s));
      MessageHeader* h = reinterpret_cast<MessageHeader*>(msg);
      const uint32_t mine = __ballot_sync(0xffffffffu, dest == d);
      if (dest == d)
        h->entries[__popc(mine & lanemask_lt())] = MessageEntry::make(em.local_of(id), lane, pos);
      if (lane == 0) {
        h->token = t;
        h->n_entries = __popc(mine);
      }
      payload[n_dest++] = msg + ml.payload_offset();
    }
    const char* src = tokens + int64_t(t) * g.hidden * 2;
    for (int32_t v0 = 0; v0 < n_vec; v0 += kWarpSize * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int32_t v = v0 + i * kWarpSize + lane;
        if (v < n_vec) buf[i] = ld_nc_v4(src + int64_t(v) * 16);
      }
      for (int32_t j = 0; j < n_dest; ++j) {
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          const int32_t v = v0 + i * kWarpSize + lane;
          if (v < n_vec) st_v4(payload[j] + int64_t(v) * 16, buf[i]);
        }
      }
    }
  }
}

__device__ void dispatch_send(const DispatchParams& p, unsigned long long seq, char* smem) {
  const GroupView& g = p.g;
  const int32_t nk = g.experts().num_keys();
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(smem);
  uint16_t* warp_prefix = reinterpret_cast<uint16_t*>(bitmap + kWarps * nk);
  for (int32_t i = threadIdx.x; i < kWarps * nk; i += kThreads) bitmap[i] = 0;
  __syncthreads();

  rank_units(p, seq, bitmap, warp_prefix);
  if (!grid_barrier(g)) return;
  scan_units(p);
  if (!grid_barrier(g)) return;

  const bool bad = *reinterpret_cast<volatile unsigned long long*>(&g.state->bad_input) == seq;
  const int32_t num_tokens = bad ? 0 : p.num_tokens;
  if (blockIdx.x == 0 && threadIdx.x == 0) g.state->num_tokens = num_tokens;

  // The destinations must have finished reading the previous call's messages.
  if (!block_wait_signal(g, all_ranks_mask(g), WindowLayout::kDispatchAck, kOpDispatchSend,
                         kWaitAck, [&](int32_t) { return seq - 1; }))
    return;
  if (blockIdx.x == gridDim.x - 1) send_meta(p, seq, bad);
  send_messages(p, num_tokens);
  block_signal_all(g, WindowLayout::kDispatchArrived);
}

// ---- 4. receive -------------------------------------------------------------------------------

__device__ void expand_messages(const DispatchParams& p, int32_t src, int32_t count,
                                const int32_t* base) {
  const GroupView& g = p.g;
  const WindowLayout wl = g.layout();
  const MessageLayout ml = wl.msg();
  const DispatchRecvLayout rl = wl.dispatch_recv();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t n_vec = g.hidden / 8, n_local = g.n_local();
  const int64_t row_limit = max_recv_rows(g);
  char* out = static_cast<char*>(p.out_tokens);

  for (int32_t m = blockIdx.x * kWarps + threadIdx.x / kWarpSize; m < count;
       m += gridDim.x * kWarps) {
    const char* msg = window_at(g, g.rank, wl.dispatch_recv_offset() + rl.offset(src, m));
    const MessageHeader* h = reinterpret_cast<const MessageHeader*>(msg);
    const int32_t token = h->token;
    const int32_t n = min(h->n_entries, g.top_k);
    int64_t row = -1;
    if (lane < n) {
      const MessageEntry e = h->entries[lane];
      const int32_t grp = e.group();
      if (grp < n_local) row = int64_t(base[src * n_local + grp]) + e.pos;
      if (row >= row_limit) row = -1;  // never write outside the output
      if (row >= 0) p.src_info[row] = SrcInfo{token, int16_t(src), int16_t(e.slot())};
    }
    const char* payload = msg + ml.payload_offset();
    for (int32_t v0 = 0; v0 < n_vec; v0 += kWarpSize * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int32_t v = v0 + i * kWarpSize + lane;
        if (v < n_vec) buf[i] = ld_v4(payload + int64_t(v) * 16);
      }
      for (int32_t j = 0; j < n; ++j) {
        const int64_t r = __shfl_sync(0xffffffffu, row, j);
        if (r < 0) continue;
        char* dst = out + r * g.hidden * 2;
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          const int32_t v = v0 + i * kWarpSize + lane;
          if (v < n_vec) st_v4(dst + int64_t(v) * 16, buf[i]);
        }
      }
    }
  }
}

__device__ void dispatch_recv(const DispatchParams& p, unsigned long long seq, char* smem) {
  const GroupView& g = p.g;
  const WindowLayout wl = g.layout();
  const MetaLayout ml = wl.meta();
  const int32_t n_local = g.n_local(), n_ranks = g.n_ranks;
  int32_t* counts = reinterpret_cast<int32_t*>(smem);   // [n_ranks][n_local]
  int32_t* base = counts + n_ranks * n_local;           // [n_ranks][n_local]
  int32_t* stream_count = base + n_ranks * n_local;     // [n_ranks]
  int32_t* totals = stream_count + n_ranks;             // [n_local + 1]

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
    counts[i] = reinterpret_cast<const volatile int32_t*>(meta_at(s) + ml.counts_offset())[j];
  }
  if (threadIdx.x < n_ranks)
    stream_count[threadIdx.x] =
        *reinterpret_cast<const volatile int32_t*>(meta_at(threadIdx.x) + ml.stream_count_offset());
  __syncthreads();

  // row_offsets: exclusive scan of the group totals (n_local <= 1024 = 2 per thread).
  const GroupRows rows{counts, n_ranks, n_local};
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int32_t item[2], total = 0;
  for (int i = 0; i < 2; ++i) {
    const int32_t grp = threadIdx.x * 2 + i;
    item[i] = grp < n_local ? rows.group_total(grp) : 0;
  }
  Scan(scan_tmp).ExclusiveSum(item, item, total);
  for (int i = 0; i < 2; ++i) {
    const int32_t grp = threadIdx.x * 2 + i;
    if (grp < n_local) totals[grp] = item[i];
  }
  if (threadIdx.x == 0) totals[n_local] = total;
  __syncthreads();
  for (int32_t grp = threadIdx.x; grp < n_local; grp += kThreads)
    for (int32_t s = 0; s < n_ranks; ++s)
      base[s * n_local + grp] = totals[grp] + rows.source_offset(s, grp);
  if (blockIdx.x == 0) {
    for (int32_t grp = threadIdx.x; grp <= n_local; grp += kThreads) {
      p.row_offsets[grp] = uint32_t(totals[grp]);
      if (grp < n_local) p.expert_ids[grp] = grp;
    }
  }
  __syncthreads();

  for (int32_t i = 0; i < n_ranks; ++i) {
    const int32_t s = (g.rank + i) % n_ranks;
    if (!block_wait_signal(g, 1u << s, WindowLayout::kDispatchArrived, kOpDispatchRecv,
                           kWaitData,
                           [&](int32_t) { return seq * (unsigned long long)g.num_blocks; }))
      return;
    expand_messages(p, s, stream_count[s], base);
  }

  if (last_block_done(g, &g.state->dispatch_done) && threadIdx.x == 0) {
    for (int32_t s = 0; s < n_ranks; ++s)
      st_release_sys(signal_word(g, s, WindowLayout::kDispatchAck, g.rank), seq);
    g.state->dispatch_seq = seq;
  }
}

template <bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchParams p) {
  extern __shared__ __align__(16) char smem[];
  if (block_aborted(p.g)) return;
  const unsigned long long seq = p.g.state->dispatch_seq + 1;
  if (kSend) dispatch_send(p, seq, smem);
  if (kRecv && !block_aborted(p.g)) dispatch_recv(p, seq, smem);
}

}  // namespace

size_t dispatch_smem_bytes(const GroupView& g) {
  const size_t nk = size_t(g.experts().num_keys());
  const size_t send = kWarps * nk * (sizeof(uint32_t) + sizeof(uint16_t));
  const size_t recv = sizeof(int32_t) * (2 * size_t(g.n_ranks) * g.n_local() + g.n_ranks +
                                         g.n_local() + 1);
  return align_up(int64_t(send > recv ? send : recv), 16);
}

int dispatch_threads() { return kThreads; }
int dispatch_unit_tokens() { return kUnitTokens; }

void launch_dispatch(const DispatchParams& p, bool send, bool recv, cudaStream_t stream) {
  const size_t smem = dispatch_smem_bytes(p.g);
  if (send && recv) {
    launch_cooperative(dispatch_kernel<true, true>, p.g.num_blocks, kThreads, smem, stream, p);
  } else if (send) {
    launch_cooperative(dispatch_kernel<true, false>, p.g.num_blocks, kThreads, smem, stream, p);
  } else {
    launch_cooperative(dispatch_kernel<false, true>, p.g.num_blocks, kThreads, smem, stream, p);
  }
}

void prepare_dispatch_kernels(const GroupView& g) {
  const int smem = int(dispatch_smem_bytes(g));
  check_cuda(cudaFuncSetAttribute(dispatch_kernel<true, true>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(dispatch)");
  check_cuda(cudaFuncSetAttribute(dispatch_kernel<true, false>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(dispatch_async)");
  check_cuda(cudaFuncSetAttribute(dispatch_kernel<false, true>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(dispatch_wait)");
  int per_sm = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dispatch_kernel<true, true>,
                                                           kThreads, smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  int sms = 0, dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
             "cudaDeviceGetAttribute");
  if (per_sm * sms < g.num_blocks)
    throw Error(ErrorCode::kInvalidArgument,
                "num_sms = " + std::to_string(g.num_blocks) + " exceeds the " +
                    std::to_string(per_sm * sms) + " dispatch blocks this GPU can hold at once");
}

}  // namespace detail
}  // namespace epcomm
