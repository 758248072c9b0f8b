// Bulk copies between global and shared memory by the copy engine of each SM (TMA, sm_90+):
// one thread issues a copy of up to a whole row; the SM keeps many in flight without holding
// registers for them. A load completes on an mbarrier in shared memory (the issuer announces
// the bytes it expects, every reader waits for the barrier's phase to flip); stores from shared
// memory are tracked per thread in bulk groups (commit, then wait until their reads of shared
// memory are done before the slot is refilled).
// Addresses and sizes are multiples of 16 bytes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epcomm {
namespace detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// One thread initialises, then __syncthreads() (or __syncwarp() for a warp's own barriers).
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The issuing thread: expect `bytes` on `bar` (its one arrival), then issue the loads that
// deliver them.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// Waits until the barrier's phase `parity` (0, 1, 0, ... for its uses in turn) completes.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, "
        "p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
}

// Starts moving [gmem, gmem + bytes) into L2, with nothing to wait for and no register or shared
// memory held: a warp that will read whole rows soon can put them all in flight at once, so its
// loads hit L2 (a register-bound loop keeps only a few KB per warp in flight from HBM).
__device__ __forceinline__ void prefetch_l2(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
}

// Stores from shared memory. Writes of other threads to the slot must be ordered before (a
// fence.proxy.async after generic-proxy writes to shared memory).
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem),
               "r"(smem_addr(smem)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Until at most N of this thread's committed groups still read shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Until at most N of this thread's committed groups are incomplete (their writes performed).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy accesses to shared memory before later bulk copies.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// The same for global memory: what this thread's generic accesses saw (for example bytes of
// another GPU's stores, acquired through a flag) before its later bulk copies read them.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// One thread moves its items q = 0 .. n-1 through a ring of `slots` slots of slot_bytes at
// `ring` (barriers bars[0 .. slots), initialised): load(q, slot, bar) expects the item's bytes on
// bar and issues its bulk loads into slot; once they have landed, store(q, slot) issues its bulk
// stores (committed here as one group). A slot is refilled once its stores have read it; one
// item's stores stay in flight while the next is stored. Returns after every store completed.
template <class Load, class Store>
__device__ void bulk_ring_copy(char* ring, uint64_t* bars, int slots, int64_t slot_bytes, int64_t n,
                               Load load, Store store) {
  for (int64_t q = 0; q < slots && q < n; ++q)
    load(q, ring + q * slot_bytes, bars + q);
  for (int64_t q = 0; q < n; ++q) {
    const int64_t s = q % slots;
    mbar_wait(bars + s, uint32_t((q / slots) & 1));
    store(q, ring + s * slot_bytes);
    bulk_commit();
    if (q >= 1 && q - 1 + slots < n) {  // refill the previous item's slot
      bulk_wait_read<1>();
      const int64_t r = (q - 1) % slots;
      load(q - 1 + slots, ring + r * slot_bytes, bars + r);
    }
  }
  bulk_wait<0>();
}

}  // namespace detail
}  // namespace epcomm
