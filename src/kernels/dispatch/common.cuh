// Dispatch's shape, shared by its stages (src/kernels/dispatch/*.cuh). The stages are headers of
// one translation unit, dispatch.cu, in its anonymous namespace: the compiler sees the kernel
// whole, as before the split, and inlines across stages as it did.
//
// One block of kThreads threads per SM. A unit of kUnitTokens tokens (one per thread) is what
// one block ranks in shared memory, so a low-latency call (at most one unit) is ranked by every
// block on its own, with no grid-wide step; a part (kPartUnits 16-byte units) is one step of
// the quantiser, so the low-latency path's pieces and the throughput path's rows quantise alike.
#pragma once

#include "epcomm/detail/device.cuh"
#include "epcomm/layout.h"
#include "kernels/quant_unit.cuh"

namespace epcomm {
namespace detail {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kUnitTokens = kWarps * kWarpSize;  // tokens ranked together by one block
constexpr int kUnroll = 4;                       // 16-byte vectors in flight per lane
constexpr int32_t kPartUnits = kPartValues / kLaneValues;  // 16-byte bf16 units per part
static_assert(kPartUnits == kWarpSize * kUnroll, "a part is one step of quantize_to");
static_assert(kUnitTokens >= kLowLatencyMaxTokens, "one block ranks a low-latency call");

// The whole warp: v[0] + ... + v[n - 1], in every lane (lanes read strided, then a butterfly),
// so a sum over a rank's groups costs n / 32 loads per lane, not n dependent ones in one thread.
__device__ __forceinline__ int64_t warp_sum(const int32_t* v, int32_t n) {
  int64_t sum = 0;
  for (int32_t i = threadIdx.x % kWarpSize; i < n; i += kWarpSize) sum += v[i];
  for (int m = kWarpSize / 2; m > 0; m /= 2) sum += __shfl_xor_sync(kFullMask, sum, m);
  return sum;
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
