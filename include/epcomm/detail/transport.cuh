// The transport seam: every write a kernel makes into a peer's window, and every signal it
// sends or waits for, goes through the functions below, whoever the peer is. Who takes part is
// in the name: a warp_ function is called by the whole warp (converged), a block_ function by
// every thread of the block, any other by one thread (or each thread, for itself).
//
// A peer's window is reached by one of two transports, chosen per peer by remote(g, peer):
//  - NVLink (transport_nvlink.cuh), a rank of this node: the window is mapped here; data are
//    stores through the peer pointer, signals release stores at system scope, and a put, fence
//    or quiet has nothing left to do;
//  - NVSHMEM (transport_nvshmem.cuh, only with EPCOMM_NVSHMEM), a rank of another node: data are
//    staged in this rank's outbox and put; signals are NVSHMEM signal operations.
// Without EPCOMM_NVSHMEM, remote() is false at compile time: every function below is the NVLink
// one, with no branch. Another transport is one more implementation file and one more case in
// the functions here; the kernels' store sites do not change.
//
// The protocol the kernels build on it: data first (put_buffer, then the lanes' stores, then
// warp_put), then a signal that orders after them (warp_put_signal; or the caller's barrier, a
// system fence and signal<kSetFenced>; or put_quiet, a barrier and signal<kSet / kAdd>). The
// receiver polls a word of its own window (signal_load, the block_wait family), where every
// transport's signals land, and reads the data after the acquire.
#pragma once

#include <cstdint>

#include "epcomm/detail/device.cuh"
#include "epcomm/detail/transport_nvlink.cuh"
#if EPCOMM_NVSHMEM
#include "epcomm/detail/transport_nvshmem.cuh"
#endif

namespace epcomm {
namespace detail {

// ---- which transport ------------------------------------------------------------------------

// Thread: whether any peer of the group is on another node (false at compile time without
// EPCOMM_NVSHMEM), and whether `peer` is.
__device__ __forceinline__ bool any_remote(const GroupView& g) {
#if EPCOMM_NVSHMEM
  return g.multi_node();
#else
  return false;
#endif
}
__device__ __forceinline__ bool remote(const GroupView& g, int32_t peer) {
  return any_remote(g) && g.nodes().remote(g.rank, peer);
}
// This rank's outbox at `offset` (OutboxLayout): where data bound for another node are staged.
__device__ __forceinline__ char* outbox_at(const GroupView& g, int64_t offset) {
  return g.outbox + offset;
}

// ---- data -----------------------------------------------------------------------------------

// Thread: where this rank writes bytes bound for `offset` of peer's window: the window itself
// (NVLink), or staging() (NVSHMEM: the slice of the outbox that warp_put puts from; not called,
// and not computed, for a peer of this node).
template <class Staging>
__device__ __forceinline__ char* put_buffer(const GroupView& g, int32_t peer, int64_t offset,
                                            Staging staging) {
  if (remote(g, peer)) return staging();
  return nvlink::put_buffer(g, peer, offset);
}

// Whole warp, after its lanes wrote [buf, buf + bytes) (from put_buffer): delivers them to
// peer's window at `offset`. NVLink: nothing (the stores went there). NVSHMEM: a non-blocking
// put, ordered by put_fence, completed by put_quiet.
__device__ __forceinline__ void warp_put(const GroupView& g, int32_t peer, int64_t offset,
                                         const void* buf, int64_t bytes) {
#if EPCOMM_NVSHMEM
  if (remote(g, peer)) {
    __syncwarp();
    shmem::warp_put(g, peer, offset, buf, bytes);
  }
#endif
}

// Whole warp, after its lanes' writes to `buf` (from put_buffer for `offset`) and a
// __syncwarp(): warp_put, then sets the u64 word at sig_offset of peer's window to `value` once
// the data are there (release).
__device__ __forceinline__ void warp_put_signal(const GroupView& g, int32_t peer, int64_t offset,
                                                const void* buf, int64_t bytes,
                                                int64_t sig_offset, unsigned long long value) {
#if EPCOMM_NVSHMEM
  if (remote(g, peer)) {
    __syncwarp();
    shmem::warp_put(g, peer, offset, buf, bytes, sig_offset, value);
    return;
  }
#endif
  nvlink::warp_signal_after_stores(buf, offset, sig_offset, value);
}

// ---- signals --------------------------------------------------------------------------------

// Thread: sets or adds to (SignalOp) the u64 word at `offset` of peer's window. kSet and kAdd
// release: they follow this thread's earlier stores (NVLink) or completed puts (NVSHMEM:
// put_quiet first; other threads' data: a barrier and a system fence first). kSetFenced and
// kAddFenced follow the thread's own system fence, a release together with it: one fence for
// many signals (NVLink: a relaxed store or reduction).
template <SignalOp kOp>
__device__ __forceinline__ void signal(const GroupView& g, int32_t peer, int64_t offset,
                                       unsigned long long value) {
#if EPCOMM_NVSHMEM
  if (remote(g, peer)) return shmem::signal(g, peer, offset, value, signal_adds(kOp));
#endif
  nvlink::signal<kOp>(g, peer, offset, value);
}
// Thread: sets (kSetFenced) or adds to (kAddFenced) signal s[my rank] in every rank's window,
// after this thread's earlier stores and everything it acquired (a barrier's worth of other
// threads' work included): one system fence, then a relaxed store or reduction per rank, so the
// signals go out together instead of each waiting for the one before it to cross its link.
// NVSHMEM: a remote rank's signal is a signal operation after the caller's put_quiet, as before.
template <SignalOp kOp>
__device__ __forceinline__ void signal_all(const GroupView& g, WindowLayout::Signal s,
                                           unsigned long long value) {
  static_assert(kOp == SignalOp::kSetFenced || kOp == SignalOp::kAddFenced, "fenced signals");
  fence_acq_rel_sys();
  const int64_t offset = g.layout().signal_offset(s, g.rank);
  for (int32_t peer = 0; peer < g.n_ranks; ++peer)
    signal<kOp>(g, peer, offset, value);
}

// ---- order and completion -------------------------------------------------------------------

// Thread: orders this thread's puts to each peer before its later ones (put_fence), or
// completes them (put_quiet), so that a signal that follows is seen after their data. No-ops
// where no peer is remote (the NVLink build: the stores are made and ordered by the fences of
// the signal's side).
__device__ __forceinline__ void put_fence(const GroupView& g) {
#if EPCOMM_NVSHMEM
  if (any_remote(g)) shmem::fence();
#endif
}
__device__ __forceinline__ void put_quiet(const GroupView& g) {
#if EPCOMM_NVSHMEM
  if (any_remote(g)) shmem::quiet();
#endif
}

// Every thread of the block, after its stores (and puts) to every peer: adds 1 to signal
// s[my rank] in every peer's window. Every thread completes its own puts first, so the signal
// of a rank of another node follows all of the block's data.
__device__ __forceinline__ void block_signal_all(const GroupView& g, WindowLayout::Signal s) {
  put_quiet(g);
  __syncthreads();
  if (threadIdx.x == 0) {
    signal_all<SignalOp::kAddFenced>(g, s, 1ull);
    put_quiet(g);
  }
}

// ---- waits ----------------------------------------------------------------------------------

// Thread: the value of a u64 word of this rank's own window (acquire), where every transport's
// signals to this rank land; the data it announces may be read after it.
__device__ __forceinline__ unsigned long long signal_load(const unsigned long long* word) {
  return ld_acquire_sys(word);
}

// The block waits until word(peer) >= target(peer) for every peer in `mask` (words of this
// rank's window, acquire), for at most the group's timeout; returns false for every thread if
// the wait failed (recorded, naming the peers missing; warp_wait_peers).
template <class Word, class Target>
__device__ __noinline__ bool block_wait(const GroupView& g, RankMask mask, Op op, WaitWhat what,
                                        Word word, Target target) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x < kWarpSize) {
    const bool r = warp_wait_peers(
        g, mask, op, what,
        [&](int32_t peer) { return signal_load(word(peer)) >= target(peer); });
    if (threadIdx.x == 0) ok = r;
  }
  __syncthreads();
  return ok != 0;
}

// The block waits until signal s[peer] of this rank's window reaches target(peer), for every
// peer in `mask`.
template <class Target>
__device__ bool block_wait_signal(const GroupView& g, RankMask mask, WindowLayout::Signal s, Op op,
                                  WaitWhat what, Target target) {
  return block_wait(
      g, mask, op, what, [&](int32_t peer) { return signal_word(g, g.rank, s, peer); }, target);
}

}  // namespace detail
}  // namespace epcomm
