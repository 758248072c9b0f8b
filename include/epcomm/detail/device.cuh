// Device primitives shared by every epcomm kernel: system-scope signals, bounded waits that
// report which peer is missing, the grid barrier and the last-block election, 16-byte copies.
// What goes to a peer's window (data, signals) and the waits on this rank's own window go
// through the transport seam, transport.cuh.
//
// Memory ordering. A sender's data stores are made visible to a peer before the signal that
// announces them: the block's threads store, __syncthreads(), then one thread issues a
// system-scope fence and a release store/add on the peer's signal word. The receiver's waiting
// thread does an acquire load of that word, then __syncthreads() publishes the observation to
// the rest of its block before anyone reads the data.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "epcomm/detail/params.h"
#include "epcomm/error.h"
#include "epcomm/trace.h"

namespace epcomm {
namespace detail {

constexpr int kWarpSize = 32;

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long ld_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A strong store with no ordering of its own: a release only after a fence (fence; store).
__device__ __forceinline__ void st_relaxed_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// An acquire-release fence at system scope: followed by relaxed stores of the same thread, a
// release pattern (PTX memory model), lighter than __threadfence_system()'s sequentially
// consistent fence.
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ void red_release_sys_add(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A reduction with no ordering of its own: a release only after a fence (fence; red).
__device__ __forceinline__ void red_relaxed_sys_add(unsigned long long* p, unsigned long long v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The SM this thread runs on (the benchmark's kernels pinned to N SMs use it).
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// 16-byte loads and stores. Inputs the kernel never writes use the non-coherent path.
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// Data written by peers during this kernel: a plain (coherent) load.
__device__ __forceinline__ uint4 ld_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
// Data written by peers during this kernel, behind an acquire, and read once: a coherent load
// that does not allocate in L1 (a warp's rows pass through once; caching them would only evict
// what other warps need).
__device__ __forceinline__ uint4 ld_once_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_v4(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Copies n_vec 16-byte vectors from `src` to each of the n_dst rows dst(j) (null: skipped),
// loading each vector once: lane l takes vectors l, l + 32, ..., kCopyUnroll loads in flight.
// `load` is ld_nc_v4 for inputs nothing writes during the kernel, ld_v4 for peers' data. Every
// lane runs every loop the same number of times, so dst may shuffle.
constexpr int kCopyUnroll = 8;
template <class Load, class Dst>
__device__ __forceinline__ void copy_vectors(const char* src, int32_t n_vec, int32_t n_dst,
                                             Load load, Dst dst) {
  const int lane = threadIdx.x % 32;
  for (int32_t v0 = 0; v0 < n_vec; v0 += 32 * kCopyUnroll) {
    uint4 buf[kCopyUnroll];
#pragma unroll
    for (int i = 0; i < kCopyUnroll; ++i) {
      const int32_t v = v0 + i * 32 + lane;
      if (v < n_vec) buf[i] = load(src + int64_t(v) * 16);
    }
    for (int32_t j = 0; j < n_dst; ++j) {
      char* d = dst(j);
      if (d == nullptr) continue;
#pragma unroll
      for (int i = 0; i < kCopyUnroll; ++i) {
        const int32_t v = v0 + i * 32 + lane;
        if (v < n_vec) st_v4(d + int64_t(v) * 16, buf[i]);
      }
    }
  }
}
struct LoadNc {
  __device__ uint4 operator()(const char* p) const { return ld_nc_v4(p); }
};
struct LoadOnce {
  __device__ uint4 operator()(const char* p) const { return ld_once_v4(p); }
};
struct LoadCoherent {
  __device__ uint4 operator()(const char* p) const { return ld_v4(p); }
};

__device__ __forceinline__ char* window_at(const GroupView& g, int32_t peer, int64_t offset) {
  return g.window_of(peer) + offset;
}
__device__ __forceinline__ unsigned long long* signal_word(const GroupView& g, int32_t owner,
                                                           WindowLayout::Signal s,
                                                           int32_t peer) {
  return reinterpret_cast<unsigned long long*>(
      window_at(g, owner, g.layout().signal_offset(s, peer)));
}

// The first error since the host's last clear wins; later ones are dropped. The record lives in
// host-mapped memory, which takes no atomics from the GPU where the host has no native atomics
// (PCIe; compute-sanitizer reports them as invalid): the claim is an atomic on a device-memory
// counter, the record plain stores with its code last.
static __device__ __noinline__ void record_error(const GroupView& g, ErrorCode code, Op op,
                                                 RankMask peer_mask, int32_t token, int32_t slot,
                                                 int32_t value, WaitWhat what) {
  DeviceErrorRecord* e = g.error;
  const unsigned int cleared = unsigned(*reinterpret_cast<volatile int32_t*>(&e->epoch));
  if (atomicCAS(&g.state->errors_claimed, cleared, cleared + 1u) != cleared) return;
  e->op = op;
  // The caller's ranks (the view of a skip_a2a group is this rank alone, as its rank 0).
  e->rank = g.route.rank;
  if (g.route.skip_a2a && peer_mask != 0) peer_mask = rank_bit(g.route.rank);
  e->peer_mask = int32_t(uint32_t(peer_mask));
  e->peer_mask_hi = int32_t(uint32_t(peer_mask >> 32));
  e->token = token;
  e->slot = slot;
  e->value = value;
  e->wait_what = what;
  __threadfence_system();
  *reinterpret_cast<volatile int32_t*>(&e->code) = int32_t(code);
}

__device__ __forceinline__ bool aborted(const GroupView& g) {
  return *reinterpret_cast<volatile int32_t*>(&g.state->abort) != 0;
}

// The abort flag as one value for the whole block (a flag read per thread could differ between
// threads and split the block at its next __syncthreads).
__device__ inline bool block_aborted(const GroupView& g) {
  __shared__ int flag;
  __syncthreads();
  if (threadIdx.x == 0) flag = aborted(g);
  __syncthreads();
  return flag != 0;
}

// Waits until `ready(peer)` holds for every peer whose bit is set in `mask`, for at most the
// group's timeout. Called by a whole warp: lane l polls peers l and l + 32, so the peers' words
// are read in parallel. On expiry records a timeout naming the peers still missing, sets the
// abort flag (so every other wait of this rank gives up at once) and returns false; the result
// is the warp's.
template <class Ready>
__device__ bool warp_wait_peers(const GroupView& g, RankMask mask, Op op, WaitWhat what,
                                Ready ready) {
  static_assert(WindowLayout::kMaxPeers <= 2 * kWarpSize, "two peers per lane");
  const int lane = threadIdx.x % kWarpSize;
  bool done = ((mask >> lane) & 1ull) == 0;
  bool done_hi = ((mask >> (lane + kWarpSize)) & 1ull) == 0;
  const unsigned long long start = globaltimer_ns();
  for (uint32_t spins = 1;; ++spins) {
    if (!done) done = ready(lane);
    if (!done_hi) done_hi = ready(lane + kWarpSize);
    const RankMask missing = RankMask(__ballot_sync(0xffffffffu, !done)) |
                             (RankMask(__ballot_sync(0xffffffffu, !done_hi)) << 32);
    if (missing == 0) return true;
    if ((spins & 63) == 0) {
      int give_up = 0;  // lane 0 decides for the warp
      if (lane == 0) {
        if (aborted(g)) {
          give_up = 1;
        } else if (globaltimer_ns() - start > g.timeout_ns) {
          record_error(g, ErrorCode::kTimeout, op, missing, -1, -1, 0, what);
          atomicExch(&g.state->abort, 1);
          give_up = 1;
        }
      }
      if (__shfl_sync(0xffffffffu, give_up, 0)) return false;
    }
  }
}

__device__ __forceinline__ RankMask all_ranks_mask(const GroupView& g) {
  return g.n_ranks >= 64 ? ~RankMask(0) : rank_bit(g.n_ranks) - 1;
}

// Grid-wide barrier over the kernel's blocks (launched cooperatively, so all are resident).
// The counter only grows: barrier n completes when it reaches (n + 1) * num_blocks.
static __device__ __noinline__ bool grid_barrier(const GroupView& g) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x < kWarpSize) {
    unsigned long long target = 0;
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned long long old = atomicAdd(&g.state->barrier, 1ull);
      target = (old / g.num_blocks + 1) * g.num_blocks;
    }
    target = __shfl_sync(0xffffffffu, target, 0);
    const bool r = warp_wait_peers(g, 1u, kOpGridBarrier, kWaitBarrier, [&](int32_t) {
      return ld_acquire_gpu(&g.state->barrier) >= target;
    });
    if (threadIdx.x == 0) ok = r;
  }
  __syncthreads();
  return ok != 0;
}

// True in exactly one block per call: the last to arrive on the cumulative counter.
__device__ inline bool last_block_done(const GroupView& g, unsigned long long* counter) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long old = atomicAdd(counter, 1ull);
    last = (old % g.num_blocks) == (unsigned long long)(g.num_blocks - 1);
    if (last) __threadfence();
  }
  __syncthreads();
  return last != 0;
}

// Stage trace (Config::trace, trace.h): thread 0 stamps the block's pass of mark m.
__device__ __forceinline__ void trace_mark(const GroupView& g, TraceKernel k, TraceMark m) {
  if (g.trace != nullptr && threadIdx.x == 0)
    g.trace[trace_index(k, m, blockIdx.x, g.num_blocks)] = globaltimer_ns();
}
// A kernel's first mark: clears the marks [first, last) this form may set, then stamps `first`.
__device__ inline void trace_begin(const GroupView& g, TraceKernel k, TraceMark first,
                                   TraceMark last) {
  if (g.trace == nullptr || threadIdx.x != 0) return;
  for (int32_t m = first + 1; m < last; ++m)
    g.trace[trace_index(k, m, blockIdx.x, g.num_blocks)] = 0;
  trace_mark(g, k, first);
}

// bf16x8 <-> float x8.
__device__ __forceinline__ void unpack_bf16x8(uint4 v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

}  // namespace detail
}  // namespace epcomm
