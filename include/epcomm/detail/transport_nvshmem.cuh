// The NVSHMEM transport (transport.cuh): a rank of another node. It has no window pointer here:
// what goes there is staged in this rank's outbox (OutboxLayout) and put into the peer's window
// at the same offset, which in NVSHMEM's terms is the symmetric address of this rank's own
// window at that offset. A put is non-blocking, so a signal goes after its data by the network's
// own ordering: put-with-signal, or puts, then nvshmem_fence (ordered) or nvshmem_quiet
// (completed), then the signal. Only in the build with the NVSHMEM component (EPCOMM_NVSHMEM).
#pragma once

#if !EPCOMM_NVSHMEM
#error "transport_nvshmem.cuh belongs to the build with EPCOMM_NVSHMEM"
#endif

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "epcomm/detail/device.cuh"

namespace epcomm {
namespace detail {
namespace shmem {

__device__ __forceinline__ uint64_t* symmetric_word(const GroupView& g, int64_t offset) {
  return reinterpret_cast<uint64_t*>(g.window_of(g.rank) + offset);
}

// Whole warp: puts `bytes` from `src` into peer's window at `offset`; with sig_offset >= 0,
// then sets the word there to `value` once the data has landed (put-with-signal).
__device__ inline void warp_put(const GroupView& g, int32_t peer, int64_t offset, const void* src,
                                int64_t bytes, int64_t sig_offset = -1,
                                unsigned long long value = 0) {
  void* dst = g.window_of(g.rank) + offset;
  // Counted for Group::network_bytes_put (the benchmark sets it beside the byte model): one
  // atomic per put, against a put of a whole message or more.
  if (bytes > 0 && threadIdx.x % kWarpSize == 0)
    atomicAdd(&g.state->network_bytes, static_cast<unsigned long long>(bytes));
  if (sig_offset >= 0 && bytes > 0) {
    nvshmemx_putmem_signal_nbi_warp(dst, src, size_t(bytes), symmetric_word(g, sig_offset),
                                    uint64_t(value), NVSHMEM_SIGNAL_SET, peer);
    return;
  }
  if (bytes > 0) nvshmemx_putmem_nbi_warp(dst, src, size_t(bytes), peer);
  if (sig_offset >= 0 && threadIdx.x % kWarpSize == 0)
    nvshmemx_signal_op(symmetric_word(g, sig_offset), uint64_t(value), NVSHMEM_SIGNAL_SET, peer);
  __syncwarp();
}
// One thread: sets (or adds to) the u64 word at `offset` of peer's window, after every put
// this thread issued before (the caller fences or quiets first where other threads put).
__device__ inline void signal(const GroupView& g, int32_t peer, int64_t offset,
                              unsigned long long value, bool add) {
  nvshmemx_signal_op(symmetric_word(g, offset), uint64_t(value),
                     add ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET, peer);
}
// Orders this thread's puts to each peer before its later ones; completes them.
__device__ __forceinline__ void fence() { nvshmem_fence(); }
__device__ __forceinline__ void quiet() { nvshmem_quiet(); }

}  // namespace shmem
}  // namespace detail
}  // namespace epcomm
