// Combine over NVLink peer stores. Header-only so that a caller's epilogue functor can be
// compiled into the kernel (epcomm/combine_epilogue.cuh); the library instantiates the plain
// bf16 store.
//
// Protocol, per call `seq` (= combine calls completed on this rank + 1):
//  send  wait until every token owner acknowledged the previous call (its combine buffer is
//        free); store every expert-output row r to its owner's slot (src_info[r].token,
//        src_info[r].slot); each block then adds 1 to kCombineArrived[me] in every owner.
//  recv  wait until kCombineArrived[s] reaches seq * num_blocks for every source s, then reduce
//        each token's K slots in fp32, top-k slot ascending (a fixed order: deterministic),
//        skipping masked slots; the last block to finish releases kCombineAck[me] = seq in
//        every source and bumps the local combine_seq.
#pragma once

#include "epcomm/config.h"
#include "epcomm/detail/device.cuh"
#include "epcomm/detail/launch.h"

namespace epcomm {
namespace detail {

constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / kWarpSize;

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
  for (int i = 0; i < 8; ++i) epi(token, col + i, v[i]);
}
__device__ __forceinline__ void emit8(StoreBf16& epi, int32_t token, int32_t col,
                                      const float (&v)[8]) {
  st_v4(epi.out + int64_t(token) * epi.hidden + col, pack_bf16x8(v));
}

__device__ inline void combine_send(const CombineParams& p, unsigned long long seq) {
  const GroupView& g = p.g;
  if (!block_wait_signal(g, all_ranks_mask(g), WindowLayout::kCombineAck, kOpCombineSend,
                         kWaitAck, [&](int32_t) { return seq - 1; }))
    return;
  const WindowLayout wl = g.layout();
  const CombineRecvLayout cl = wl.combine_recv();
  const int32_t n_vec = g.hidden / 8;
  const int64_t row_limit = g.output().rows;  // padding rows included
  int64_t rows = int64_t(p.row_offsets[g.n_local()]);
  if (rows > row_limit) rows = row_limit;
  const char* in = static_cast<const char*>(p.expert_out);

  for (int64_t r = blockIdx.x * kCombineWarps + threadIdx.x / kWarpSize; r < rows;
       r += int64_t(gridDim.x) * kCombineWarps) {
    const SrcInfo info = p.src_info[r];
    if (info.rank < 0 || info.rank >= g.n_ranks || info.token < 0 ||
        info.token >= g.max_tokens || info.slot < 0 || info.slot >= g.top_k)
      continue;  // padding rows, and never a write outside a peer's buffer
    char* dst = window_at(g, info.rank, wl.combine_recv_offset() + cl.offset(info.token, info.slot));
    copy_vectors(in + r * g.hidden * 2, n_vec, 1, LoadNc{}, [&](int32_t) { return dst; });
  }
  block_signal_all(g, WindowLayout::kCombineArrived);
}

template <class Epilogue>
__device__ void combine_recv(const CombineParams& p, unsigned long long seq, Epilogue& epi) {
  const GroupView& g = p.g;
  if (!block_wait_signal(g, all_ranks_mask(g), WindowLayout::kCombineArrived, kOpCombineRecv,
                         kWaitData,
                         [&](int32_t) { return seq * (unsigned long long)g.num_blocks; }))
    return;
  const WindowLayout wl = g.layout();
  const CombineRecvLayout cl = wl.combine_recv();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t K = g.top_k, H = g.hidden;
  const int32_t num_tokens = *reinterpret_cast<volatile int32_t*>(&g.state->num_tokens);
  const char* recv = window_at(g, g.rank, wl.combine_recv_offset());

  // Work items are (token, part): a token's columns are split into `split` interleaved parts of
  // 256-column steps when there are too few tokens to keep every warp busy (decode), so more
  // loads are in flight; with many tokens split = 1 and a warp takes whole tokens.
  const int32_t warps = gridDim.x * kCombineWarps;
  const int32_t steps = (H + kWarpSize * 8 - 1) / (kWarpSize * 8);
  const int32_t want = num_tokens > 0 ? (2 * warps + num_tokens - 1) / num_tokens : 1;
  const int32_t split = want < steps ? want : steps;
  const int64_t items = int64_t(num_tokens) * split;
  for (int64_t item = blockIdx.x * kCombineWarps + threadIdx.x / kWarpSize; item < items;
       item += warps) {
    const int32_t t = int32_t(item / split), part = int32_t(item % split);
    // Every lane gets the token's ids and weights before the column loops: lanes run those
    // loops a different number of times when H / 8 is not a multiple of 32, so no shuffle may
    // sit inside them.
    const int32_t id = lane < K ? p.topk[int64_t(t) * K + lane] : -1;
    const float w = (lane < K && p.weights != nullptr) ? p.weights[int64_t(t) * K + lane] : 0.f;
    int32_t ids[kMaxTopK];
    float ws[kMaxTopK];
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      ids[k] = __shfl_sync(0xffffffffu, id, k);
      ws[k] = __shfl_sync(0xffffffffu, w, k);
    }
    const char* slots = recv + cl.offset(t, 0);
    const int32_t first = (part * kWarpSize + lane) * 8, stride = split * kWarpSize * 8;
    if (p.weights != nullptr) {
      for (int32_t c = first; c < H; c += stride) {
        // All K loads first (predicated, no branch between them, so they are in flight
        // together), then the sums in k order over the unmasked slots.
        uint4 raw[kMaxTopK];
#pragma unroll
        for (int k = 0; k < kMaxTopK; ++k)
          if (k < K) raw[k] = ld_plain_v4(slots + k * cl.row_bytes() + int64_t(c) * 2);
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < kMaxTopK; ++k) {
          if (k >= K || ids[k] < 0) continue;
          float y[8];
          unpack_bf16x8(raw[k], y);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = fmaf(ws[k], y[i], acc[i]);
        }
        emit8(epi, t, c, acc);
      }
    } else {
      char* out = static_cast<char*>(p.out) + int64_t(t) * K * H * 2;
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        if (k >= K) continue;
        for (int32_t c = first; c < H; c += stride) {
          const uint4 v = ids[k] >= 0 ? ld_v4(slots + k * cl.row_bytes() + int64_t(c) * 2)
                                      : make_uint4(0, 0, 0, 0);
          st_v4(out + (int64_t(k) * H + c) * 2, v);
        }
      }
    }
  }

  if (last_block_done(g, &g.state->combine_done) && threadIdx.x == 0) {
    for (int32_t s = 0; s < g.n_ranks; ++s)
      st_release_sys(signal_word(g, s, WindowLayout::kCombineAck, g.rank), seq);
    g.state->combine_seq = seq;
  }
}

template <class Epilogue, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(CombineParams p,
                                                                     Epilogue epi) {
  if (block_aborted(p.g)) return;
  const unsigned long long seq = p.g.state->combine_seq + 1;
  if (kSend) combine_send(p, seq);
  if (kRecv && !block_aborted(p.g)) combine_recv(p, seq, epi);
}

// Loads the three combine kernels for `Epilogue` on the current device. CUDA loads a kernel
// lazily at its first launch, and loading waits for the device to go idle: a first launch
// queued behind a kernel that is waiting for peers would stall the host until that wait times
// out. Set-up therefore loads every kernel before the first operation.
template <class Epilogue>
void load_combine_kernels() {
  cudaFuncAttributes a;
  check_cuda(cudaFuncGetAttributes(&a, combine_kernel<Epilogue, true, true>), "load combine");
  check_cuda(cudaFuncGetAttributes(&a, combine_kernel<Epilogue, true, false>), "load combine");
  check_cuda(cudaFuncGetAttributes(&a, combine_kernel<Epilogue, false, true>), "load combine");
}

template <class Epilogue>
void launch_combine(const CombineParams& p, const Epilogue& epi, bool send, bool recv,
                    cudaStream_t stream) {
  const int blocks = p.g.num_blocks;
  if (send && recv)
    launch_cooperative(combine_kernel<Epilogue, true, true>, blocks, kCombineThreads, 0, stream,
                       p, epi);
  else if (send)
    launch_cooperative(combine_kernel<Epilogue, true, false>, blocks, kCombineThreads, 0, stream,
                       p, epi);
  else
    launch_cooperative(combine_kernel<Epilogue, false, true>, blocks, kCombineThreads, 0, stream,
                       p, epi);
}

}  // namespace detail
}  // namespace epcomm
