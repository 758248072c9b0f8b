// The memory-floor kernels of --floor (floor.h has what they count).
#include "floor.h"

#include <algorithm>
#include <stdexcept>
#include <type_traits>

#include "common.h"
#include "epcomm/config.h"
#include "epcomm/detail/bulk.cuh"
#include "epcomm/detail/device.cuh"
#include "epcomm/detail/launch.h"

namespace epbench {
namespace {

using namespace epcomm::detail;

__device__ __forceinline__ void fma8(float w, const uint4& v, float (&acc)[8]) {
  float y[8];
  unpack_bf16x8(v, y);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    acc[i] = fmaf(w, y[i], acc[i]);
}
// ---- dispatch -------------------------------------------------------------------------------

constexpr int kRegsThreads = 1024;
constexpr int kDispatchUnroll = 8;

// One warp moves message i: loads the bf16 row (kUnroll vectors per lane in flight), stores the
// codes' and scales' share of it to every row.
template <int kUnroll, bool kPrefetch>
__device__ __forceinline__ void dispatch_message(const DispatchFloorArgs& a, int64_t i, int lane) {
  const int32_t n_in = a.in_bytes / 16, n_code = a.code_bytes / 16;
  const int32_t n_out = n_code + a.scale_bytes / 16;
  const char* src = reinterpret_cast<const char*>(a.src[i]);
  if (kPrefetch && lane == 0) prefetch_l2(src, uint32_t(a.in_bytes));  // the whole row at once
  const int32_t r0 = a.first[i], r1 = a.first[i + 1];
  for (int32_t v0 = 0; v0 < n_in; v0 += 32 * kUnroll) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t v = v0 + u * 32 + lane;
      if (v < n_in) buf[u] = ld_nc_v4(src + int64_t(v) * 16);
    }
    for (int32_t r = r0; r < r1; ++r) {
      const int64_t row = a.rows[r];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t v = v0 + u * 32 + lane;
        if (v < n_code)
          *reinterpret_cast<uint4*>(a.out + row * a.code_bytes + int64_t(v) * 16) = buf[u];
        else if (v < n_out)
          *reinterpret_cast<uint4*>(a.scales + row * a.scale_bytes + int64_t(v - n_code) * 16) =
              buf[u];
      }
    }
  }
}

// Items [0, n) dealt out statically over the grid's warps, one at a time: body(item, lane).
template <class Body>
__device__ __forceinline__ void static_items(int64_t n, Body body) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; i < n; i += warps)
    body(i, int(threadIdx.x % 32));
}

// One warp per message.
template <bool kPrefetch>
__global__ void __launch_bounds__(kRegsThreads, 1) dispatch_floor_regs(DispatchFloorArgs a) {
  static_items(a.messages, [&](int64_t i, int lane) {
    dispatch_message<kDispatchUnroll, kPrefetch>(a, i, lane);
  });
}

// ---- pinned launch shapes: several blocks per SM on exactly `sms` SMs -----------------------

// The warps of blocks on SMs [first_sm, first_sm + sms) take items [0, n) one at a time from
// counters[0] (the next grab issued before the current item's work, so its latency hides behind
// it); blocks on other SMs take none. Every block then counts itself out on counters[1], and the grid's last
// one zeroes both for the next launch (stream-ordered after this one).
template <class Body>
__device__ void pinned_items(unsigned long long* counters, int first_sm, int sms, int64_t n,
                             Body body) {
  if (sm_id() - uint32_t(first_sm) < uint32_t(sms)) {
    const int lane = threadIdx.x % 32;
    unsigned long long next = lane == 0 ? atomicAdd(&counters[0], 1ull) : 0ull;
    next = __shfl_sync(0xffffffffu, next, 0);
    while (int64_t(next) < n) {
      const unsigned long long after = lane == 0 ? atomicAdd(&counters[0], 1ull) : 0ull;
      body(int64_t(next), lane);
      next = __shfl_sync(0xffffffffu, after, 0);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&counters[1], 1ull) == gridDim.x - 1) {
      counters[0] = 0;
      counters[1] = 0;
      __threadfence();
    }
  }
}

template <int kThreads, int kBlocksPerSm, int kUnroll>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    dispatch_floor_pinned(DispatchFloorArgs a, int sms) {
  pinned_items(a.pinned, a.first_sm, sms, a.messages, [&](int64_t i, int lane) {
    dispatch_message<kUnroll, false>(a, i, lane);
  });
}

constexpr int kTmaMaxBarriers = 64;

// One lane per warp drives a ring of `slots` rows in shared memory: bulk load of the message's
// bf16 row, then bulk stores of its codes' and scales' share to every row; a slot is refilled
// once its stores have read it (one message's stores may stay in flight).
__global__ void dispatch_floor_tma(DispatchFloorArgs a, int slots) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bar[kTmaMaxBarriers];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  char* ring = smem + int64_t(warp) * slots * a.in_bytes;
  uint64_t* mb = bar + warp * slots;
  if (lane == 0)
    for (int s = 0; s < slots; ++s)
      mbar_init(mb + s);
  __syncthreads();
  if (lane != 0) return;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t first = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  const int64_t mine = first < a.messages ? (a.messages - first + warps - 1) / warps : 0;
  bulk_ring_copy(
      ring, mb, slots, a.in_bytes, mine,
      [&](int64_t q, char* slot, uint64_t* b) {
        mbar_expect(b, uint32_t(a.in_bytes));
        bulk_load(slot, a.src[first + q * warps], uint32_t(a.in_bytes), b);
      },
      [&](int64_t q, const char* slot) {
        const int64_t i = first + q * warps;
        for (int32_t r = a.first[i]; r < a.first[i + 1]; ++r) {
          const int64_t row = a.rows[r];
          bulk_store(a.out + row * a.code_bytes, slot, uint32_t(a.code_bytes));
          if (a.scale_bytes > 0)
            bulk_store(a.scales + row * a.scale_bytes, slot + a.code_bytes,
                       uint32_t(a.scale_bytes));
        }
      });
}

// ---- combine --------------------------------------------------------------------------------

constexpr int kCombineRegsThreads = 512;
constexpr int kCombineRows = 8;  // rows' loads in flight together (the fixed variants)
constexpr int kCombineU = 2;     // 256-column steps per pass

// One warp reduces token t: per pass, kRows rows x kU vectors per lane in flight, summed
// in fp32 in k order, stored as bf16. Row addresses and weights are taken from the lanes that
// hold them when needed (no per-row arrays: they spilled under the smaller shapes' register
// budgets); a masked row loads nothing and adds 0.
template <int kU, int kRows, bool kPrefetch>
__device__ __forceinline__ void combine_token(const CombineFloorArgs& a, int64_t t, int lane) {
  const int32_t K = a.top_k, H = a.hidden;
  const uint16_t* mine = lane < K ? a.src[t * K + lane] : nullptr;
  if (kPrefetch && mine != nullptr) prefetch_l2(mine, uint32_t(H) * 2);  // whole rows at once
  const float wmine = mine != nullptr ? a.weights[t * K + lane] : 0.0f;
  // One pass of kU steps from column b0 (lane's columns b0 + lane * 8 + u * 256); kInside: every
  // lane's columns lie inside H, so no column is tested (as epcomm's sum_rows_by does).
  auto pass = [&](int32_t b0, auto inside) {
    constexpr bool kInside = decltype(inside)::value;
    const int32_t base = b0 + lane * 8;
    float acc[kU][8] = {};
    for (int32_t k0 = 0; k0 < K; k0 += kRows) {
      uint4 raw[kRows][kU];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(mine), (k0 + j) % 32));
        const bool live = k0 + j < K && src != nullptr;
#pragma unroll
        for (int u = 0; u < kU; ++u)
          raw[j][u] = live && (kInside || base + u * 256 < H) ? ld_nc_v4(src + base + u * 256)
                                                              : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const float w = k0 + j < K ? __shfl_sync(0xffffffffu, wmine, (k0 + j) % 32) : 0.0f;
#pragma unroll
        for (int u = 0; u < kU; ++u)
          fma8(w, raw[j][u], acc[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (kInside || base + u * 256 < H)
        *reinterpret_cast<uint4*>(a.out + t * H + base + u * 256) = pack_bf16x8(acc[u]);
  };
  // Passes every lane runs (the shuffles sit inside).
  for (int32_t b0 = 0; b0 < H; b0 += 32 * 8 * kU) {
    if (b0 + (kU - 1) * 256 + 256 <= H)
      pass(b0, std::true_type{});
    else
      pass(b0, std::false_type{});
  }
}

// One warp per token.
template <bool kPrefetch>
__global__ void __launch_bounds__(kCombineRegsThreads, 1) combine_floor_regs(CombineFloorArgs a) {
  static_items(a.tokens, [&](int64_t t, int lane) {
    combine_token<kCombineU, kCombineRows, kPrefetch>(a, t, lane);
  });
}

template <int kThreads, int kBlocksPerSm, int kU, int kRows = kCombineRows>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    combine_floor_pinned(CombineFloorArgs a, int sms) {
  pinned_items(a.pinned, a.first_sm, sms, a.tokens,
               [&](int64_t t, int lane) { combine_token<kU, kRows, false>(a, t, lane); });
}

constexpr int kPiece = 1024;  // bytes of each row per ring slot
constexpr int kMaxK = epcomm::kMaxTopK;

// One lane per warp loads (token, piece) items into a ring of slots (K rows x kPiece bytes each,
// one barrier per slot); the whole warp sums the K pieces from shared memory and stores the bf16
// result; the driving lane then refills the slot.
__global__ void combine_floor_tma(CombineFloorArgs a, int slots) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bar[kTmaMaxBarriers];
  __shared__ float wbuf[kTmaMaxBarriers * kMaxK];  // per slot: its rows' weights
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t K = a.top_k;
  const int64_t slot_bytes = int64_t(K) * kPiece;
  char* ring = smem + int64_t(warp) * slots * slot_bytes;
  uint64_t* mb = bar + warp * slots;
  if (lane == 0)
    for (int s = 0; s < slots; ++s)
      mbar_init(mb + s);
  __syncthreads();
  const int32_t row_bytes = 2 * a.hidden;
  const int32_t pieces = (row_bytes + kPiece - 1) / kPiece;
  const int64_t items = int64_t(a.tokens) * pieces;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t first = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  const int64_t mine = first < items ? (items - first + warps - 1) / warps : 0;
  // The whole warp: lane k fetches row k's address and weight (kept beside the slot for the
  // consumer) and issues its bulk load after lane 0 announced the bytes.
  float* wslot = wbuf + (warp * slots) * kMaxK;
  auto load = [&](int64_t q) {
    const int64_t item = first + q * warps;
    const int64_t t = item / pieces;
    const int32_t off = int32_t(item % pieces) * kPiece;
    const uint32_t bytes = uint32_t(min(kPiece, row_bytes - off));
    uint64_t* b = mb + q % slots;
    const uint16_t* src = lane < K ? a.src[t * K + lane] : nullptr;
    if (lane < K) wslot[(q % slots) * kMaxK + lane] = src ? a.weights[t * K + lane] : 0.0f;
    const uint32_t live = __ballot_sync(0xffffffffu, src != nullptr);
    if (lane == 0) mbar_expect(b, __popc(live) * bytes);
    __syncwarp();
    if (src != nullptr)
      bulk_load(ring + (q % slots) * slot_bytes + lane * kPiece,
                reinterpret_cast<const char*>(src) + off, bytes, b);
  };
  for (int64_t q = 0; q < slots && q < mine; ++q)
    load(q);
  for (int64_t q = 0; q < mine; ++q) {
    const int64_t item = first + q * warps;
    const int64_t t = item / pieces;
    const int32_t off = int32_t(item % pieces) * kPiece;
    const int32_t n_vec = min(kPiece, row_bytes - off) / 16;
    mbar_wait(mb + q % slots, uint32_t((q / slots) & 1));
    const char* slot = ring + (q % slots) * slot_bytes;
    const float* w = wslot + (q % slots) * kMaxK;
    for (int32_t v = lane; v < n_vec; v += 32) {
      float acc[8] = {};
      for (int32_t k = 0; k < K; ++k)  // a masked row's weight is 0 and its slot unread
        if (w[k] != 0.0f)
          fma8(w[k], *reinterpret_cast<const uint4*>(slot + k * kPiece + v * 16), acc);
      *reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.out) + t * row_bytes + off + v * 16) =
          pack_bf16x8(acc);
    }
    __syncwarp();
    if (q + slots < mine) {
      fence_proxy_async_smem();
      load(q + slots);
    }
  }
}

constexpr int kTmaSmem = 200 * 1024;
constexpr int kDispatchTmaWarps = 4;  // as epcomm_nvlink_probe found best for 14 KB rows
constexpr int kCombineSlots = 3;

int dispatch_tma_slots(int in_bytes) {
  const int slots =
      std::min(kTmaSmem / (kDispatchTmaWarps * in_bytes), kTmaMaxBarriers / kDispatchTmaWarps);
  if (slots < 2) throw std::runtime_error("--floor: rows too large for the bulk-copy ring");
  return slots;
}
int combine_tma_warps(int top_k) {
  const int warps = std::min(16, kTmaSmem / (kCombineSlots * top_k * kPiece));
  if (warps < 1) throw std::runtime_error("--floor: K too large for the bulk-copy ring");
  return warps;
}


// The pinned sweep's launch shapes and their kernels.
template <class Args>
struct PinnedKernel {
  int threads, blocks_per_sm, depth;
  void (*kernel)(Args, int);
  int rows = 0;  // combine: 4 for the r4 shapes, else 0 (kCombineRows)
};
const PinnedKernel<DispatchFloorArgs> kPinnedDispatch[] = {
    {512, 1, 8, dispatch_floor_pinned<512, 1, 8>},   {1024, 1, 8, dispatch_floor_pinned<1024, 1, 8>},
    {1024, 1, 4, dispatch_floor_pinned<1024, 1, 4>}, {512, 2, 8, dispatch_floor_pinned<512, 2, 8>},
    {512, 2, 4, dispatch_floor_pinned<512, 2, 4>},   {1024, 2, 4, dispatch_floor_pinned<1024, 2, 4>},
    {1024, 2, 2, dispatch_floor_pinned<1024, 2, 2>}, {256, 4, 8, dispatch_floor_pinned<256, 4, 8>},
    {512, 4, 4, dispatch_floor_pinned<512, 4, 4>},
};
const PinnedKernel<CombineFloorArgs> kPinnedCombine[] = {
    {512, 1, 2, combine_floor_pinned<512, 1, 2>},
    {1024, 1, 1, combine_floor_pinned<1024, 1, 1>},
    {1024, 1, 2, combine_floor_pinned<1024, 1, 2>},
    {512, 2, 1, combine_floor_pinned<512, 2, 1>},
    {512, 2, 2, combine_floor_pinned<512, 2, 2>},
    {256, 4, 1, combine_floor_pinned<256, 4, 1>},
    {256, 2, 2, combine_floor_pinned<256, 2, 2>},
    {512, 3, 1, combine_floor_pinned<512, 3, 1>},
    // 4 rows x 4 steps, the shape of epcomm's prefill sum (sum_rows)
    {512, 1, 4, combine_floor_pinned<512, 1, 4, 4>, 4},
    {256, 2, 4, combine_floor_pinned<256, 2, 4, 4>, 4},
    {512, 2, 2, combine_floor_pinned<512, 2, 2, 4>, 4},
};

template <class Args, size_t N>
const PinnedKernel<Args>& pinned_kernel(const PinnedKernel<Args> (&table)[N], const FloorVariant& v) {
  for (const PinnedKernel<Args>& k : table)
    if (k.threads == v.threads && k.blocks_per_sm == v.blocks_per_sm && k.depth == v.depth &&
        k.rows == v.rows)
      return k;
  throw std::runtime_error("--floor: no pinned kernel of shape " + floor_variant_name(v));
}

// The shapes of `table` whose blocks_per_sm blocks an SM of the current device holds (the
// others would not be the shape they are named for).
template <class Args, size_t N>
void add_pinned(const PinnedKernel<Args> (&table)[N], std::vector<FloorVariant>* out) {
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  for (const PinnedKernel<Args>& k : table) {
    int fit = 0;
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k.kernel, k.threads, 0));
    if (fit >= k.blocks_per_sm)
      out->push_back(
          FloorVariant{FloorVariant::kPinned, k.threads, k.blocks_per_sm, k.depth, k.rows});
  }
}

template <class Args, size_t N>
void launch_pinned(const PinnedKernel<Args> (&table)[N], const Args& a, const FloorVariant& v,
                   int sms, cudaStream_t stream) {
  if (a.pinned == nullptr) throw std::runtime_error("--floor: the pinned variants need counters");
  int device = 0, sm_count = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const PinnedKernel<Args>& k = pinned_kernel(table, v);
  k.kernel<<<k.blocks_per_sm * sm_count, k.threads, 0, stream>>>(a, sms);
}

// ---- the latency floor ------------------------------------------------------------------------

__global__ void empty_kernel() {}

constexpr unsigned long long kRoundTripBoundNs = 1000000000ull;  // 1 s

__global__ void roundtrip_kernel(RoundTripArgs a) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const unsigned long long seq = *a.calls + 1;
  st_release_sys(a.next, seq);
  const unsigned long long start = globaltimer_ns();
  while (ld_acquire_sys(a.mine) < seq)
    if (globaltimer_ns() - start > kRoundTripBoundNs) {
      atomicExch(a.failed, 1);
      break;
    }
  *a.calls = seq;
}

}  // namespace

std::string floor_variant_name(const FloorVariant& v) {
  switch (v.kind) {
    case FloorVariant::kRegs: return "regs";
    case FloorVariant::kRegsL2: return "regs-l2";
    case FloorVariant::kTma: return "tma";
    case FloorVariant::kPinned: break;
  }
  return "pin" + std::to_string(v.threads) + "x" + std::to_string(v.blocks_per_sm) + "u" +
         std::to_string(v.depth) + (v.rows == 4 ? "r4" : "");
}

std::vector<FloorVariant> floor_variants(bool dispatch, bool pinned) {
  std::vector<FloorVariant> v = {{FloorVariant::kRegs}, {FloorVariant::kRegsL2},
                                 {FloorVariant::kTma}};
  if (!pinned) return v;
  if (dispatch)
    add_pinned(kPinnedDispatch, &v);
  else
    add_pinned(kPinnedCombine, &v);
  return v;
}

void prepare_floor_kernels(int top_k, int hidden) {
  cudaFuncAttributes attr;
  CHECK_CUDA(cudaFuncGetAttributes(&attr, empty_kernel));
  CHECK_CUDA(cudaFuncGetAttributes(&attr, roundtrip_kernel));
  for (bool l2 : {false, true}) {
    CHECK_CUDA(
        cudaFuncGetAttributes(&attr, l2 ? dispatch_floor_regs<true> : dispatch_floor_regs<false>));
    CHECK_CUDA(
        cudaFuncGetAttributes(&attr, l2 ? combine_floor_regs<true> : combine_floor_regs<false>));
  }
  for (const auto& k : kPinnedDispatch) CHECK_CUDA(cudaFuncGetAttributes(&attr, k.kernel));
  for (const auto& k : kPinnedCombine) CHECK_CUDA(cudaFuncGetAttributes(&attr, k.kernel));
  CHECK_CUDA(cudaFuncSetAttribute(dispatch_floor_tma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kDispatchTmaWarps * dispatch_tma_slots(2 * hidden) * 2 * hidden));
  CHECK_CUDA(cudaFuncSetAttribute(combine_floor_tma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  combine_tma_warps(top_k) * kCombineSlots * top_k * kPiece));
}

void launch_dispatch_floor(const DispatchFloorArgs& a, const FloorVariant& v, int sms,
                           cudaStream_t stream) {
  if (v.kind == FloorVariant::kRegs) {
    dispatch_floor_regs<false><<<sms, kRegsThreads, 0, stream>>>(a);
  } else if (v.kind == FloorVariant::kRegsL2) {
    dispatch_floor_regs<true><<<sms, kRegsThreads, 0, stream>>>(a);
  } else if (v.kind == FloorVariant::kTma) {
    const int slots = dispatch_tma_slots(a.in_bytes);
    dispatch_floor_tma<<<sms, 32 * kDispatchTmaWarps, kDispatchTmaWarps * slots * a.in_bytes,
                         stream>>>(a, slots);
  } else {
    launch_pinned(kPinnedDispatch, a, v, sms, stream);
  }
  CHECK_CUDA(cudaGetLastError());
}

void launch_combine_floor(const CombineFloorArgs& a, const FloorVariant& v, int sms,
                          cudaStream_t stream) {
  if (v.kind == FloorVariant::kRegs) {
    combine_floor_regs<false><<<sms, kCombineRegsThreads, 0, stream>>>(a);
  } else if (v.kind == FloorVariant::kRegsL2) {
    combine_floor_regs<true><<<sms, kCombineRegsThreads, 0, stream>>>(a);
  } else if (v.kind == FloorVariant::kTma) {
    const int warps = combine_tma_warps(a.top_k);
    combine_floor_tma<<<sms, 32 * warps, warps * kCombineSlots * a.top_k * kPiece, stream>>>(
        a, kCombineSlots);
  } else {
    launch_pinned(kPinnedCombine, a, v, sms, stream);
  }
  CHECK_CUDA(cudaGetLastError());
}

void launch_empty(int blocks, int threads, cudaStream_t stream) {
  launch_cooperative(empty_kernel, blocks, threads, 0, stream);
}

void launch_roundtrip(const RoundTripArgs& a, int blocks, int threads, cudaStream_t stream) {
  launch_cooperative(roundtrip_kernel, blocks, threads, 0, stream, a);
}

}  // namespace epbench
