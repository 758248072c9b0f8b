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
  const int lane = threadIdx.x % kWarpSize;
  const int32_t n_vec = g.hidden / 8;
  const int64_t row_limit = g.output().rows;  // padding rows included
  int64_t rows = int64_t(p.row_offsets[g.n_local()]);
  if (rows > row_limit) rows = row_limit;
  const char* in = static_cast<const char*>(p.expert_out);
  constexpr int kUnroll = 4;

  for (int64_t r = blockIdx.x * kCombineWarps + threadIdx.x / kWarpSize; r < rows;
       r += int64_t(gridDim.x) * kCombineWarps) {
    const SrcInfo info = p.src_info[r];
    if (info.rank < 0 || info.rank >= g.n_ranks || info.token < 0 ||
        info.token >= g.max_tokens || info.slot < 0 || info.slot >= g.top_k)
      continue;  // never write outside a peer's buffer
    char* dst = window_at(g, info.rank, wl.combine_recv_offset() + cl.offset(info.token, info.slot));
    const char* src = in + r * g.hidden * 2;
    for (int32_t v0 = 0; v0 < n_vec; v0 += kWarpSize * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int32_t v = v0 + i * kWarpSize + lane;
        if (v < n_vec) buf[i] = ld_nc_v4(src + int64_t(v) * 16);
      }
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int32_t v = v0 + i * kWarpSize + lane;
        if (v < n_vec) st_v4(dst + int64_t(v) * 16, buf[i]);
      }
    }
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

  for (int32_t t = blockIdx.x * kCombineWarps + threadIdx.x / kWarpSize; t < num_tokens;
       t += gridDim.x * kCombineWarps) {
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
    if (p.weights != nullptr) {
      for (int32_t c = lane * 8; c < H; c += kWarpSize * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < kMaxTopK; ++k) {
          if (k >= K || ids[k] < 0) continue;
          float y[8];
          unpack_bf16x8(ld_v4(slots + k * cl.row_bytes() + int64_t(c) * 2), y);
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
        for (int32_t c = lane * 8; c < H; c += kWarpSize * 8) {
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
