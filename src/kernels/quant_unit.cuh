// A warp's view of a row being quantised (shared by the fused SiLU kernels and the quantising
// dispatch): lane l takes the 8-value units l, l + 32, ... of the row (one 16-byte vector of bf16
// each), and a scale block is a set of kGroup / 8 adjacent lanes whose amax is an abs_max fold
// over shuffles. Every value goes through the block quantisers of epcomm/formats/codecs.h, so
// the codes and scales are the CPU reference's bit for bit.
#pragma once

#include <cstdint>

#include "epcomm/detail/device.cuh"
#include "epcomm/formats/codecs.h"
#include "epcomm/token_format.h"

namespace epcomm {
namespace detail {

constexpr int kLaneValues = 8;  // values per lane per step: one 16-byte vector of bf16
constexpr uint32_t kFullMask = 0xffffffffu;

// This lane's part of its unit's block amax: the fold over the unit's own values.
__device__ __forceinline__ float lane_amax(const float (&z)[kLaneValues]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i)
    amax = abs_max(amax, z[i]);
  return amax;
}
// The largest of a unit's 8 bf16 magnitudes, as bits (bf16, sign cleared): a NaN's exceed
// kBf16Inf, an infinity's are kBf16Inf. Where none is NaN, the bits of lane_amax of the unit's
// values, shifted right by 16 (fp32 and bf16 order non-negative numbers like their bits).
constexpr uint32_t kBf16Inf = 0x7f80u;
__device__ __forceinline__ uint32_t unit_abs_bits_max(uint4 v) {
  constexpr uint32_t kAbs = 0x7fff7fffu;
  const uint32_t m = __vmaxu2(__vmaxu2(v.x & kAbs, v.y & kAbs), __vmaxu2(v.z & kAbs, v.w & kAbs));
  return __vmaxu2(m, m >> 16) & 0xffffu;
}
// The amax of the scale block this lane's unit belongs to: kLanes adjacent lanes (aligned).
template <int kLanes>
__device__ __forceinline__ float lanes_amax(const float (&z)[kLaneValues]) {
  float amax = lane_amax(z);
#pragma unroll
  for (int m = 1; m < kLanes; m *= 2)
    amax = abs_max(amax, __shfl_xor_sync(kFullMask, amax, m));
  return amax;
}

template <class Quant>
__device__ __forceinline__ Quant unit_quant(const float (&z)[kLaneValues]) {
  return Quant::from_amax(lanes_amax<Quant::kGroup / kLaneValues>(z));
}

// One unit's codes: 8 e4m3 bytes (FP8, MXFP8), two values per conversion, or 8 e2m1 nibbles
// (NVFP4, MXFP4). kNotNaN (e4m3 only): no scaled value is NaN (q.scaled of a value that is
// neither NaN nor infinite, as inv is finite), so the bare conversion serves, whose sign is then
// the value's.
template <bool kNotNaN = false, class Quant>
__device__ __forceinline__ auto encode_unit(const Quant& q, const float (&z)[kLaneValues]) {
  static_assert(!kNotNaN || Quant::kCodeBits == 8, "the bare conversion is e4m3's");
  if constexpr (Quant::kCodeBits == 8) {
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < kLaneValues; i += 2) {  // q.encode of each value
      const float lo = q.scaled(z[i]), hi = q.scaled(z[i + 1]);
      const uint16_t codes = kNotNaN ? float2_to_e4m3x2_not_nan(lo, hi) : float2_to_e4m3x2(lo, hi);
      w[i / 4] |= uint32_t(codes) << (8 * (i % 4));
    }
    return make_uint2(w[0], w[1]);
  } else {
    static_assert(Quant::kCodeBits == 4, "e4m3 bytes or e2m1 nibbles");
    uint32_t w = 0u;
#pragma unroll
    for (int i = 0; i < kLaneValues / 2; ++i)
      w |= uint32_t(pack_e2m1x2(q.encode(z[2 * i]), q.encode(z[2 * i + 1]))) << (8 * i);
    return w;
  }
}

// Blockwise FP8's quantisers of one step of kUnroll = 4 units per lane (unit k of lane l is
// the step's unit 32 k + l), 16 adjacent lanes per scale block: the same quantisers as
// make_block_quant of each unit's lanes_amax, with an eighth of the divisions. The block amaxes
// are reduced and scattered: the exchange over lane bit 0 halves the four partial amaxes a lane
// carries to two, the one over bit 1 to one (lane l keeps unit 2 (l & 1) + (l >> 1 & 1)), and
// bits 2 and 3 complete it. Then each lane computes one number of its unit's quantiser, s where
// lane bit 2 is clear and inv where it is set (one division: Fp8BlockQuant::scale_or_inv), and
// every lane reads the eight it needs from its block's lanes. abs_max is a max ignoring NaN, so
// the amax is the same number in any order of the fold (codecs.h).
__device__ __forceinline__ void fp8_step_quants(const float (&part)[4], bool pow2,
                                                Fp8BlockQuant (&q)[4]) {
  const int lane = threadIdx.x % 32;
  const bool b0 = (lane & 1) != 0, b1 = (lane & 2) != 0, b2 = (lane & 4) != 0;
  const float r0 =
      abs_max(b0 ? part[2] : part[0], __shfl_xor_sync(kFullMask, b0 ? part[0] : part[2], 1));
  const float r1 =
      abs_max(b0 ? part[3] : part[1], __shfl_xor_sync(kFullMask, b0 ? part[1] : part[3], 1));
  float amax = abs_max(b1 ? r1 : r0, __shfl_xor_sync(kFullMask, b1 ? r0 : r1, 2));
  amax = abs_max(amax, __shfl_xor_sync(kFullMask, amax, 4));
  amax = abs_max(amax, __shfl_xor_sync(kFullMask, amax, 8));
  float mine;
  if (pow2) {
    const Fp8BlockQuant both = Fp8BlockQuant::from_amax(amax, true);
    mine = b2 ? both.inv : both.scale;
  } else {
    mine = Fp8BlockQuant::scale_or_inv(amax, b2);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int src = (lane & ~15) | (k >> 1) | ((k & 1) << 1);  // holds s of unit k; + 4: inv
    q[k] = Fp8BlockQuant{__shfl_sync(kFullMask, mine, src), __shfl_sync(kFullMask, mine, src | 4)};
  }
}

// The scale a block stores: FP8's fp32 s, the others' code.
__device__ __forceinline__ float stored_scale(const Fp8BlockQuant& q) {
  return q.scale;
}
template <class Quant>
__device__ __forceinline__ uint8_t stored_scale(const Quant& q) {
  return q.scale_code;
}

// The block quantiser of a quantised TokenFormat.
template <TokenFormat F>
struct BlockQuantOf;
template <>
struct BlockQuantOf<TokenFormat::kFp8Blockwise> {
  using type = Fp8BlockQuant;
};
template <>
struct BlockQuantOf<TokenFormat::kNvfp4> {
  using type = Nvfp4BlockQuant;
};
template <>
struct BlockQuantOf<TokenFormat::kMxfp8> {
  using type = Mxfp8BlockQuant;
};
template <>
struct BlockQuantOf<TokenFormat::kMxfp4> {
  using type = Mxfp4BlockQuant;
};

// Format F's quantiser of a block with this amax (gs: NVFP4's global scale; pow2: blockwise
// FP8's power-of-two scales, Config::fp8_pow2_scales; each unused by the other formats).
template <TokenFormat F>
__device__ __forceinline__ typename BlockQuantOf<F>::type make_block_quant(float amax, float gs,
                                                                          bool pow2 = false) {
  if constexpr (F == TokenFormat::kNvfp4) {
    return Nvfp4BlockQuant::from_amax(amax, gs);
  } else if constexpr (F == TokenFormat::kFp8Blockwise) {
    return Fp8BlockQuant::from_amax(amax, pow2);
  } else {
    return BlockQuantOf<F>::type::from_amax(amax);
  }
}

}  // namespace detail
}  // namespace epcomm
