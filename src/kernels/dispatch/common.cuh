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

}  // namespace
}  // namespace detail
}  // namespace epcomm
