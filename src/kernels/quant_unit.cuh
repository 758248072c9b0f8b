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

// The amax of the scale block this lane's unit belongs to: kLanes adjacent lanes (aligned).
template <int kLanes>
__device__ __forceinline__ float lanes_amax(const float (&z)[kLaneValues]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i)
    amax = abs_max(amax, z[i]);
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
// (NVFP4, MXFP4).
template <class Quant>
__device__ __forceinline__ auto encode_unit(const Quant& q, const float (&z)[kLaneValues]) {
  if constexpr (Quant::kCodeBits == 8) {
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < kLaneValues; i += 2)  // q.encode of each value
      w[i / 4] |= uint32_t(float2_to_e4m3x2(q.scaled(z[i]), q.scaled(z[i + 1]))) << (8 * (i % 4));
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
