// The NVLink transport (transport.cuh): a peer of this node, whose window is mapped into this
// process (GroupView::window_of). Data go as plain stores through the peer pointer, made by the
// sending threads themselves, so a put has nothing left to do and completes as it is issued;
// a signal is a system-scope release store or reduction on the peer's word, ordered after the
// data by the caller (its threads' stores -> __syncthreads/__syncwarp -> the signalling
// thread's fence or release), so fence and quiet have nothing to do here.
#pragma once

#include <cstdint>

#include "epcomm/detail/device.cuh"

namespace epcomm {
namespace detail {

// How a signal changes its word (transport.cuh's signal): set or add, each a release of its
// own; or set or add after the signalling thread's own system fence (one fence, many signals).
// A release is a fence of its own: on NVLink it waits for this thread's earlier writes to reach
// their GPUs, the previous signals among them, so signals to n ranks released one by one take n
// link round trips, and fenced ones one.
enum class SignalOp { kSet, kAdd, kSetFenced, kAddFenced };

__host__ __device__ constexpr bool signal_adds(SignalOp op) {
  return op == SignalOp::kAdd || op == SignalOp::kAddFenced;
}

namespace nvlink {

__device__ __forceinline__ unsigned long long* word_at(const GroupView& g, int32_t peer,
                                                       int64_t offset) {
  return reinterpret_cast<unsigned long long*>(window_at(g, peer, offset));
}

// Thread: where bytes bound for `offset` of peer's window are written: the window itself.
__device__ __forceinline__ char* put_buffer(const GroupView& g, int32_t peer, int64_t offset) {
  return window_at(g, peer, offset);
}

// Whole warp, after its lanes' stores to `buf` (put_buffer's pointer for `offset` of the peer's
// window) and a __syncwarp(): lane 0 releases the word at sig_offset of the same window (a
// fence, then a release store: the other lanes' stores, ordered before lane 0's fence by the
// __syncwarp, are visible to whoever acquires the word). The word is found from `buf`, which
// the caller holds already, rather than from the window pointer again.
__device__ __forceinline__ void warp_signal_after_stores(const void* buf, int64_t offset,
                                                         int64_t sig_offset,
                                                         unsigned long long value) {
  if (threadIdx.x % kWarpSize == 0) {
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<unsigned long long*>(
                       const_cast<char*>(static_cast<const char*>(buf)) + (sig_offset - offset)),
                   value);
  }
}

// Thread: a signal (SignalOp): a release store or reduction, or after the caller's fence a
// relaxed store or reduction.
template <SignalOp kOp>
__device__ __forceinline__ void signal(const GroupView& g, int32_t peer, int64_t offset,
                                       unsigned long long value) {
  unsigned long long* word = word_at(g, peer, offset);
  if constexpr (kOp == SignalOp::kSet)
    st_release_sys(word, value);
  else if constexpr (kOp == SignalOp::kAdd)
    red_release_sys_add(word, value);
  else if constexpr (kOp == SignalOp::kSetFenced)
    st_relaxed_sys(word, value);
  else
    red_relaxed_sys_add(word, value);
}

}  // namespace nvlink
}  // namespace detail
}  // namespace epcomm
