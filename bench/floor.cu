// The memory-floor kernels of --floor (floor.h has what they count).
#include "floor.h"

#include <algorithm>
#include <stdexcept>

#include "common.h"
#include "epcomm/config.h"
#include "epcomm/detail/bulk.cuh"
#include "epcomm/detail/device.cuh"

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

// One warp per message: load the bf16 row (kDispatchUnroll vectors per lane in flight), store
// the codes' and scales' share of it to every row.
template <bool kPrefetch>
__global__ void __launch_bounds__(kRegsThreads, 1) dispatch_floor_regs(DispatchFloorArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int32_t n_in = a.in_bytes / 16, n_code = a.code_bytes / 16;
  const int32_t n_out = n_code + a.scale_bytes / 16;
  for (int64_t i = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; i < a.messages;
       i += warps) {
    const char* src = reinterpret_cast<const char*>(a.src[i]);
    if (kPrefetch && lane == 0) prefetch_l2(src, uint32_t(a.in_bytes));  // the whole row at once
    const int32_t r0 = a.first[i], r1 = a.first[i + 1];
    for (int32_t v0 = 0; v0 < n_in; v0 += 32 * kDispatchUnroll) {
      uint4 buf[kDispatchUnroll];
#pragma unroll
      for (int u = 0; u < kDispatchUnroll; ++u) {
        const int32_t v = v0 + u * 32 + lane;
        if (v < n_in) buf[u] = ld_nc_v4(src + int64_t(v) * 16);
      }
      for (int32_t r = r0; r < r1; ++r) {
        const int64_t row = a.rows[r];
#pragma unroll
        for (int u = 0; u < kDispatchUnroll; ++u) {
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
constexpr int kCombineRows = 8;  // rows' loads in flight together
constexpr int kCombineU = 2;     // 256-column steps per pass

// One warp per token: per pass, kCombineRows rows x kCombineU vectors per lane in flight, summed
// in fp32 in k order, stored as bf16.
template <bool kPrefetch>
__global__ void __launch_bounds__(kCombineRegsThreads, 1) combine_floor_regs(CombineFloorArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int32_t K = a.top_k, H = a.hidden;
  for (int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < a.tokens;
       t += warps) {
    const uint16_t* mine = lane < K ? a.src[t * K + lane] : nullptr;
    if (kPrefetch && mine != nullptr) prefetch_l2(mine, uint32_t(H) * 2);  // whole rows at once
    const float wmine = lane < K ? a.weights[t * K + lane] : 0.0f;
    for (int32_t base = lane * 8; base < H; base += 32 * 8 * kCombineU) {
      float acc[kCombineU][8] = {};
      for (int32_t k0 = 0; k0 < K; k0 += kCombineRows) {
        const uint16_t* src[kCombineRows];
        float w[kCombineRows];
        uint4 raw[kCombineRows][kCombineU];
#pragma unroll
        for (int j = 0; j < kCombineRows; ++j) {
          src[j] = reinterpret_cast<const uint16_t*>(
              __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(mine), (k0 + j) % 32));
          w[j] = __shfl_sync(0xffffffffu, wmine, (k0 + j) % 32);
          if (k0 + j >= K) src[j] = nullptr;
        }
#pragma unroll
        for (int j = 0; j < kCombineRows; ++j)
#pragma unroll
          for (int u = 0; u < kCombineU; ++u)
            if (src[j] != nullptr && base + u * 256 < H)
              raw[j][u] = ld_nc_v4(src[j] + base + u * 256);
#pragma unroll
        for (int j = 0; j < kCombineRows; ++j)
#pragma unroll
          for (int u = 0; u < kCombineU; ++u)
            if (src[j] != nullptr && base + u * 256 < H) fma8(w[j], raw[j][u], acc[u]);
      }
#pragma unroll
      for (int u = 0; u < kCombineU; ++u)
        if (base + u * 256 < H)
          *reinterpret_cast<uint4*>(a.out + t * H + base + u * 256) = pack_bf16x8(acc[u]);
    }
  }
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

}  // namespace

const char* floor_variant_name(FloorVariant v) {
  return v == FloorVariant::kRegs ? "regs" : (v == FloorVariant::kRegsL2 ? "regs-l2" : "tma");
}

void prepare_floor_kernels(int top_k, int hidden) {
  cudaFuncAttributes attr;
  for (bool l2 : {false, true}) {
    CHECK_CUDA(
        cudaFuncGetAttributes(&attr, l2 ? dispatch_floor_regs<true> : dispatch_floor_regs<false>));
    CHECK_CUDA(
        cudaFuncGetAttributes(&attr, l2 ? combine_floor_regs<true> : combine_floor_regs<false>));
  }
  CHECK_CUDA(cudaFuncSetAttribute(dispatch_floor_tma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kDispatchTmaWarps * dispatch_tma_slots(2 * hidden) * 2 * hidden));
  CHECK_CUDA(cudaFuncSetAttribute(combine_floor_tma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  combine_tma_warps(top_k) * kCombineSlots * top_k * kPiece));
}

void launch_dispatch_floor(const DispatchFloorArgs& a, FloorVariant v, int blocks,
                           cudaStream_t stream) {
  if (v == FloorVariant::kRegs) {
    dispatch_floor_regs<false><<<blocks, kRegsThreads, 0, stream>>>(a);
  } else if (v == FloorVariant::kRegsL2) {
    dispatch_floor_regs<true><<<blocks, kRegsThreads, 0, stream>>>(a);
  } else {
    const int slots = dispatch_tma_slots(a.in_bytes);
    dispatch_floor_tma<<<blocks, 32 * kDispatchTmaWarps, kDispatchTmaWarps * slots * a.in_bytes,
                         stream>>>(a, slots);
  }
  CHECK_CUDA(cudaGetLastError());
}

void launch_combine_floor(const CombineFloorArgs& a, FloorVariant v, int blocks,
                          cudaStream_t stream) {
  if (v == FloorVariant::kRegs) {
    combine_floor_regs<false><<<blocks, kCombineRegsThreads, 0, stream>>>(a);
  } else if (v == FloorVariant::kRegsL2) {
    combine_floor_regs<true><<<blocks, kCombineRegsThreads, 0, stream>>>(a);
  } else {
    const int warps = combine_tma_warps(a.top_k);
    combine_floor_tma<<<blocks, 32 * warps, warps * kCombineSlots * a.top_k * kPiece, stream>>>(
        a, kCombineSlots);
  }
  CHECK_CUDA(cudaGetLastError());
}

}  // namespace epbench
