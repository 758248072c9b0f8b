// Scalar codecs of the quantised token formats (docs/design.md "Token formats", "Fused SiLU / SwiGLU") and the per-block quantisers built
// on them. Everything here is host + device (EPCOMM_HD) and uses only integer bit manipulation
// and correctly rounded fp32 operations, so the kernels, the CPU reference
// (src/reference/formats_reference.cpp) and the tests get bit-identical results. The host build
// assumes IEEE single arithmetic without excess precision (checked below) and the device build
// no -ftz / fast-math (the project's flags).
//
//   e4m3  OCP FP8 E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinity; 0x7f and
//         0xff are NaN; largest finite 448 (0x7e); smallest subnormal 2^-9.
//   e2m1  OCP FP4 E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4,
//         6 and their negatives. No infinity, no NaN. One code per nibble (low 4 bits).
//   e8m0  OCP E8M0 scale: unsigned, 2^(e - 127) for e in [0, 254]; 0xff is NaN; no zero.
//
// The encoders round to nearest, ties to even, and saturate: a finite value beyond the largest
// finite magnitude, or an infinity, becomes that magnitude with its sign. That is PTX
// `cvt.rn.satfinite`, so the device build uses the e4m3 conversion where the GPU has one
// (tests/gpu/test_format_conversions.cu checks they agree on every fp32 input). NaN gives e4m3
// NaN (0x7f with the input's sign) and, e2m1 having none, +6 (0x7), as PTX does. Zero keeps its
// sign; so does a value that rounds to zero.
#pragma once

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cfloat>
#include <cstring>
#endif

#include "epcomm/layout.h"  // EPCOMM_HD

#if !defined(__CUDA_ARCH__) && defined(FLT_EVAL_METHOD)
static_assert(FLT_EVAL_METHOD == 0,
              "epcomm's codecs need fp32 arithmetic without excess precision");
#endif

namespace epcomm {

// ---- bit casts ------------------------------------------------------------------------------
// The device uses the intrinsics; the host the compiler's bit cast where it has one (GCC >= 11,
// Clang), else memcpy, which compilers fold to a register move.

#if !defined(__CUDA_ARCH__) && defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast)
#define EPCOMM_HAS_BUILTIN_BIT_CAST 1
#endif
#endif

EPCOMM_HD uint32_t float_as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#elif defined(EPCOMM_HAS_BUILTIN_BIT_CAST)
  return __builtin_bit_cast(uint32_t, f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

EPCOMM_HD float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(EPCOMM_HAS_BUILTIN_BIT_CAST)
  return __builtin_bit_cast(float, u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

namespace detail {

// fp32 multiply / divide rounded to nearest even, never contracted into an FMA and never
// approximated (also under -use_fast_math on the device).
EPCOMM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

EPCOMM_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The magnitude code of a finite, non-NaN fp32 magnitude `a` (bits, sign cleared) in a
// sign-magnitude minifloat with kMan mantissa bits and exponent bias kBias: rounded to nearest,
// ties to even, saturated at kMaxCode. Codes are ordered like the values they stand for, with
// the subnormals 0 .. 2^kMan - 1 first, so a carry out of the mantissa lands on the right code.
template <int kMan, int kBias, uint32_t kMaxCode>
EPCOMM_HD uint32_t minifloat_code_rne(uint32_t a) {
  constexpr int32_t kMinExp = 1 - kBias;  // exponent of the smallest normal
  const uint32_t biased = a >> 23;
  if (biased == 0) return 0;  // zero or an fp32 subnormal: far below half a target subnormal
  const int32_t exp = int32_t(biased) - 127;
  if (exp >= kMinExp) {
    // Round the fp32 pattern at the target's last mantissa bit; a carry moves the exponent.
    constexpr int32_t kShift = 23 - kMan;
    const uint32_t lsb = (a >> kShift) & 1u;
    const uint32_t rounded = (a + ((1u << (kShift - 1)) - 1u) + lsb) >> kShift;
    const uint32_t code = rounded - (uint32_t(127 - kBias) << kMan);
    return code > kMaxCode ? kMaxCode : code;
  }
  // Target subnormal: |x| = m * 2^(exp - 23) with the implicit bit in m, and the target's step
  // is 2^(kMinExp - kMan), so the code is m / 2^shift rounded to nearest even. A result of
  // 2^kMan is the smallest normal's code, as it should be.
  const int32_t shift = 23 - exp + kMinExp - kMan;  // >= 24 - kMan
  if (shift > 24) return 0;                         // below half the smallest subnormal
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u) != 0)) ? 1u : 0u);
}

// The fp32 magnitude bits of a minifloat magnitude code (not NaN). Exact: every minifloat value
// is a normal fp32 number.
template <int kMan, int kBias>
EPCOMM_HD uint32_t minifloat_magnitude_bits(uint32_t code) {
  const uint32_t exp_field = code >> kMan;
  const uint32_t man = code & ((1u << kMan) - 1u);
  if (exp_field != 0) return ((exp_field + uint32_t(127 - kBias)) << 23) | (man << (23 - kMan));
  if (man == 0) return 0;
  int32_t lead = kMan - 1;  // normalise the subnormal: its leading one becomes the implicit bit
  while (((man >> lead) & 1u) == 0)
    --lead;
  const uint32_t exp = uint32_t(lead + 1 - kBias - kMan + 127);
  return (exp << 23) | ((man ^ (1u << lead)) << (23 - lead));
}

}  // namespace detail

// ---- e4m3 -----------------------------------------------------------------------------------

constexpr float kE4m3Max = 448.0f;
constexpr float kE4m3MaxInv = 1.0f / 448.0f;  // rounded once, at compile time, on host and device
constexpr uint8_t kE4m3MaxCode = 0x7e;
constexpr uint8_t kE4m3Nan = 0x7f;

namespace detail {
// The e4m3 encoder in integer arithmetic, for the host and for GPUs without the conversion.
EPCOMM_HD uint8_t e4m3_code_portable(float x) {
  const uint32_t u = float_as_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | kE4m3Nan);
  return uint8_t(sign | minifloat_code_rne<3, 7, kE4m3MaxCode>(a));
}
}  // namespace detail

// Two values at once: lo's code in bits 0-7, hi's in bits 8-15. On sm_89 and later one
// cvt.rn.satfinite.e4m3x2.f32 does both (it rounds and saturates as above: every fp32 input
// agrees, tests/gpu/test_format_conversions.cu); only a NaN's sign is taken from the input here,
// as the conversion does not specify it (its NaN is 0x7f or 0xff, so & 0x7f leaves 0x7f).
EPCOMM_HD uint16_t float2_to_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  const uint32_t signs =
      ((float_as_bits(lo) >> 24) & 0x80u) | ((float_as_bits(hi) >> 16) & 0x8000u);
  return uint16_t((uint32_t(r) & 0x7f7fu) | signs);
#else
  return uint16_t(detail::e4m3_code_portable(lo) |
                  (uint32_t(detail::e4m3_code_portable(hi)) << 8));
#endif
}

// float2_to_e4m3x2 of two values neither of which is NaN: the conversion alone, whose sign is
// the input's for every such value (tests/gpu/test_format_conversions.cu: the conversion against
// the integer encoder on every fp32 input, and this against float2_to_e4m3x2).
EPCOMM_HD uint16_t float2_to_e4m3x2_not_nan(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return float2_to_e4m3x2(lo, hi);
#endif
}

EPCOMM_HD uint8_t float_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return uint8_t(float2_to_e4m3x2(x, 0.0f));
#else
  return detail::e4m3_code_portable(x);
#endif
}

EPCOMM_HD bool e4m3_is_nan(uint8_t c) {
  return (c & 0x7fu) == kE4m3Nan;
}

EPCOMM_HD float e4m3_to_float(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  if (e4m3_is_nan(c)) return bits_as_float(sign | 0x7fc00000u);
  return bits_as_float(sign | detail::minifloat_magnitude_bits<3, 7>(c & 0x7fu));
}

// ---- e2m1 -----------------------------------------------------------------------------------

constexpr float kE2m1Max = 6.0f;
constexpr uint8_t kE2m1MaxCode = 0x7;

// Branch-free (the quantising kernels encode every value they send with it), in two ranges:
//  |x| >= 1 (infinity and NaN too): round the fp32 pattern to one mantissa bit (fp32's bit 22),
//    ties to even; a carry moves the exponent, and 1.0 (exponent field 127) is code 2, so the
//    code is the rounded pattern >> 22 less (127 - 1) << 1, saturated at 6's code 7;
//  |x| < 1: e2m1's step is 0.5 (codes 0, 1 and 2 for 1.0); fp32's step is 0.5 between 2^22 and
//    2^23, so |x| + 2^22 rounds |x| to that step, ties to even, and the pattern's distance from
//    2^22's is the code (an fp32 subnormal gives 0, also when flushed).
// NaN gives +6 (0x7), as PTX cvt.rn.satfinite does; every other input keeps its sign.
EPCOMM_HD uint8_t float_to_e2m1(float x) {
  const uint32_t u = float_as_bits(x);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t rounded = ((a + 0x1fffffu + ((a >> 22) & 1u)) >> 22) - 252u;
  const uint32_t large = rounded < kE2m1MaxCode ? rounded : kE2m1MaxCode;
  const uint32_t small = float_as_bits(bits_as_float(a) + 0x1p22f) - 0x4a800000u;
  const uint32_t sign = a > 0x7f800000u ? 0u : (u >> 28) & 0x8u;
  return uint8_t(sign | (a < 0x3f800000u ? small : large));
}

// Decodes the low nibble of `c`.
EPCOMM_HD float e2m1_to_float(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x8u) << 28;
  return bits_as_float(sign | detail::minifloat_magnitude_bits<1, 1>(c & 0x7u));
}

// Two e2m1 codes per byte: element 2i in the low nibble of byte i, element 2i+1 in the high one.
EPCOMM_HD uint8_t pack_e2m1x2(uint8_t even, uint8_t odd) {
  return uint8_t((even & 0xfu) | ((odd & 0xfu) << 4));
}
EPCOMM_HD uint8_t e2m1_low(uint8_t packed) {
  return uint8_t(packed & 0xfu);
}
EPCOMM_HD uint8_t e2m1_high(uint8_t packed) {
  return uint8_t(packed >> 4);
}

// ---- e8m0 -----------------------------------------------------------------------------------

constexpr uint8_t kE8m0Nan = 0xff;
constexpr uint8_t kE8m0MaxCode = 0xfe;  // 2^127

// 2^(e - 127); e = 0 gives 2^-127, an fp32 subnormal.
EPCOMM_HD float e8m0_to_float(uint8_t e) {
  if (e == kE8m0Nan) return bits_as_float(0x7fc00000u);
  if (e == 0) return bits_as_float(0x00400000u);
  return bits_as_float(uint32_t(e) << 23);
}

// 2^(127 - e): the exact reciprocal of the scale. Multiplying by it divides by the scale exactly
// (both round the same real number once), and it is an fp32 normal for every e <= 253.
EPCOMM_HD float e8m0_reciprocal(uint8_t e) {
  if (e == kE8m0Nan) return bits_as_float(0x7fc00000u);
  return e8m0_to_float(uint8_t(kE8m0MaxCode - e));
}

// The smallest power of two >= |v| (2^-127 for |v| <= 2^-127); finite |v| > 2^127 saturates to
// 2^127; infinity and NaN give NaN (0xff), as no scale represents them.
EPCOMM_HD uint8_t float_to_e8m0_ceil(float v) {
  const uint32_t a = float_as_bits(v) & 0x7fffffffu;
  if (a >= 0x7f800000u) return kE8m0Nan;
  const uint32_t exp_field = a >> 23;
  if (exp_field == 0) return a > 0x00400000u ? 1 : 0;  // fp32 subnormal: 2^-127 or 2^-126
  const uint32_t code = exp_field + ((a & 0x7fffffu) != 0 ? 1u : 0u);
  return uint8_t(code > kE8m0MaxCode ? kE8m0MaxCode : code);
}

// ---- block amax -----------------------------------------------------------------------------

// max(acc, |x|), ignoring NaN (fmaxf semantics): a block's amax is a fold of this from 0, in any
// order.
// acc must be such a fold's result (never NaN, never -0); on the device that makes it one
// fmaxf with |x| (equal values have the same bits, and fmaxf(acc, NaN) is acc).
EPCOMM_HD float abs_max(float acc, float x) {
#if defined(__CUDA_ARCH__)
  return fmaxf(acc, fabsf(x));
#else
  const float a = bits_as_float(float_as_bits(x) & 0x7fffffffu);
  return a > acc ? a : acc;
#endif
}

// ---- scale rules ----------------------------------------------------------------------------

// MXFP8: sf = amax / 448 rounded up to a power of two, evaluated exactly (not as a rounded fp32
// quotient): the smallest 2^(e-127), e in [0, 254], with amax <= 448 * 2^(e-127). As
// 448 = 1.75 * 2^8, for amax = 1.f * 2^E that is e = E + 127 - 8 when 1.f <= 1.75, else one more.
// So |x| * 2^(127-e) <= 448 for every x of the block: no code saturates. It equals
// float_to_e8m0_ceil(amax / 448.0f) whenever that quotient is an fp32 normal (tested).
// amax = 0 (and any amax < 448 * 2^-127) gives e = 0; infinity or NaN give 0xff.
EPCOMM_HD uint8_t mxfp8_scale_code(float amax) {
  const uint32_t a = float_as_bits(amax) & 0x7fffffffu;
  if (a >= 0x7f800000u) return kE8m0Nan;
  const int32_t biased = int32_t(a >> 23);
  const int32_t e = biased - ((a & 0x7fffffu) <= 0x600000u ? 8 : 7);
  return uint8_t(e < 0 ? 0 : e);  // at most 254 - 7 for finite amax
}

// MXFP4, the OCP "even" rounding. OCP MX v1.0 §6.3 sets the shared exponent to
// floor(log2(amax)) - emax_elem, emax_elem = 2 for E2M1 (6 = 1.5 * 2^2), and clamps elements
// that overflow to +-6. With that floor rule amax / X lies in [4, 8), and a block maximum whose
// significand is in [1.75, 2) scales to [7, 8) and is clamped to 6: an error up to 2X. The "even"
// rule first rounds amax to the element's precision (1 mantissa bit) to nearest, ties to even —
// the significand becomes 1.0, 1.5 or 2.0 — and then applies the floor rule. Only a carry to 2.0
// changes the exponent, which happens exactly when the significand is >= 1.75; at the one tie
// that matters, 1.75 (between 1.5, odd mantissa bit, and 2.0, even), ties-to-even and ties-away
// agree, so adding half an ulp at that bit (2^21 in fp32's mantissa field) and keeping the
// exponent is exact. Hence the name (torchao's ScaleCalculationMode.EVEN; MAX's
// compute_mxfp4_even_scale). Then amax / X is in [4, 7) or [3.5, 4), and every element is within
// X of its code. The exponent is clamped to [0, 254] (finite amax never exceeds 253); amax = 0
// gives 0; infinity or NaN give 0xff (MAX would give 253 there).
EPCOMM_HD uint8_t mxfp4_scale_code(float amax) {
  const uint32_t a = float_as_bits(amax) & 0x7fffffffu;
  if (a >= 0x7f800000u) return kE8m0Nan;
  const int32_t e = int32_t((a + (1u << 21)) >> 23) - 2;
  return uint8_t(e < 0 ? 0 : e);
}

// ---- per-block quantisers -------------------------------------------------------------------
// One value per scale block, built from the block's amax (encode side) or its stored scale
// (decode side). Kernels and the reference call the same functions, so codes and scales agree
// bit for bit; the float operations in them are fixed here (and their order with them).

// Blockwise FP8, 128 values per fp32 scale: s = max(amax, 1e-4) / 448 is stored, and the codes
// are q = e4m3(x * inv), inv = 448 / max(amax, 1e-4): one multiply per value instead of an
// IEEE division (the quantising sender is bound by its arithmetic), and the convention of
// DeepEP's own FP8 cast (x * (448 / amax), scale amax / 448), whose codes it then matches.
struct Fp8BlockQuant {
  static constexpr int32_t kGroup = 128;
  static constexpr int32_t kCodeBits = 8;  // e4m3 codes
  float scale;  // s, stored as is
  float inv;    // what values are multiplied by before encoding

  // pow2 (Config::fp8_pow2_scales; DeepEP's round_scale, and what UE8M0 scale consumers need):
  // s = 2^e, e = ceil(log2(max(amax, 1e-4) * (1 / 448))), read off that fp32 product's bits (its
  // exponent, plus one when a mantissa bit is set), so host and device agree exactly; inv = 2^-e,
  // and x * inv is exact scaling. e lies in [-22, 120] for finite amax; an infinite amax gives
  // s = inf and inv = 0, as the other rule's 448 / inf.
  EPCOMM_HD static Fp8BlockQuant from_amax(float amax, bool pow2 = false) {
    if (!pow2) return Fp8BlockQuant{scale_or_inv(amax, false), scale_or_inv(amax, true)};
    const float floor_amax = amax > 1e-4f ? amax : 1e-4f;
    const float x = detail::mul_rn(floor_amax, kE4m3MaxInv);
    const uint32_t bits = float_as_bits(x);
    const int32_t biased = int32_t((bits >> 23) & 0xffu);
    if (biased == 0xff) return Fp8BlockQuant{x, 0.0f};
    const int32_t e = biased - 127 + ((bits & 0x7fffffu) != 0u ? 1 : 0);
    return Fp8BlockQuant{bits_as_float(uint32_t(e + 127) << 23),
                         bits_as_float(uint32_t(127 - e) << 23)};
  }
  // One of the two numbers of from_amax(amax, false), in one division: s (inv false) or inv
  // (the quantising sender's lanes compute one each, src/kernels/quant_unit.cuh).
  EPCOMM_HD static float scale_or_inv(float amax, bool inv) {
    const float floor_amax = amax > 1e-4f ? amax : 1e-4f;
    return detail::div_rn(inv ? kE4m3Max : floor_amax, inv ? floor_amax : kE4m3Max);
  }
  // The UE8M0 byte of a power-of-two scale s = 2^e: e + 127 (s's biased exponent).
  EPCOMM_HD static uint8_t ue8m0_of(float pow2_scale) {
    return uint8_t((float_as_bits(pow2_scale) >> 23) & 0xffu);
  }
  // Four such bytes in one word, scale s0's in the lowest byte (DeepEP's use_ue8m0 layout).
  EPCOMM_HD static uint32_t ue8m0_word(float s0, float s1, float s2, float s3) {
    return uint32_t(ue8m0_of(s0)) | uint32_t(ue8m0_of(s1)) << 8 | uint32_t(ue8m0_of(s2)) << 16 |
           uint32_t(ue8m0_of(s3)) << 24;
  }
  // Decode side (inv is 1 / s there, for completeness: nothing encodes from a stored scale).
  EPCOMM_HD static Fp8BlockQuant from_scale(float s) {
    return Fp8BlockQuant{s, s == 0.0f ? 0.0f : detail::div_rn(1.0f, s)};
  }
  EPCOMM_HD float scaled(float x) const { return detail::mul_rn(x, inv); }  // what is encoded
  EPCOMM_HD uint8_t encode(float x) const { return float_to_e4m3(scaled(x)); }
  EPCOMM_HD float decode(uint8_t q) const { return detail::mul_rn(e4m3_to_float(q), scale); }
};

// NVFP4, 16 values per e4m3 scale, with a global scale gs > 0 (finite):
//   scale code = e4m3((gs * amax) / 6); sf = its decoded value (the value divided below);
//   q = e2m1(x * (gs / sf)), each operation rounded in fp32 in that order;
//   a block whose sf is 0 (amax = 0, or gs * amax / 6 below 2^-10) stores scale 0 and all codes
//   +0 (0x0), whatever the sign of its values — gs / 0 would otherwise send them to +-6.
// Decode: (e2m1 * sf) / gs.
struct Nvfp4BlockQuant {
  static constexpr int32_t kGroup = 16;
  static constexpr int32_t kCodeBits = 4;  // e2m1 codes
  uint8_t scale_code;  // e4m3, stored
  float scale;         // sf = e4m3_to_float(scale_code)
  float global_scale;  // gs
  float inv;           // gs / sf; 0 when sf == 0

  EPCOMM_HD static Nvfp4BlockQuant from_code(uint8_t code, float gs) {
    const float sf = e4m3_to_float(code);
    return Nvfp4BlockQuant{code, sf, gs, sf == 0.0f ? 0.0f : detail::div_rn(gs, sf)};
  }
  EPCOMM_HD static Nvfp4BlockQuant from_amax(float amax, float gs) {
    return from_code(float_to_e4m3(detail::div_rn(detail::mul_rn(gs, amax), kE2m1Max)), gs);
  }
  EPCOMM_HD uint8_t encode(float x) const {
    return scale == 0.0f ? uint8_t(0) : float_to_e2m1(detail::mul_rn(x, inv));
  }
  EPCOMM_HD float decode(uint8_t q) const {
    return detail::div_rn(detail::mul_rn(e2m1_to_float(q), scale), global_scale);
  }
};

// MXFP8, 32 values per e8m0 scale X = mxfp8_scale_code(amax): q = e4m3(x / X), computed as
// x * 2^(127-e), which is the same number. Decode: e4m3 * X.
struct Mxfp8BlockQuant {
  static constexpr int32_t kGroup = 32;
  static constexpr int32_t kCodeBits = 8;  // e4m3 codes
  uint8_t scale_code;  // e8m0, stored
  float inv;           // 1 / X, exact

  EPCOMM_HD static Mxfp8BlockQuant from_code(uint8_t code) {
    return Mxfp8BlockQuant{code, e8m0_reciprocal(code)};
  }
  EPCOMM_HD static Mxfp8BlockQuant from_amax(float amax) {
    return from_code(mxfp8_scale_code(amax));
  }
  EPCOMM_HD float scaled(float x) const { return detail::mul_rn(x, inv); }  // what is encoded
  EPCOMM_HD uint8_t encode(float x) const { return float_to_e4m3(scaled(x)); }
  EPCOMM_HD float decode(uint8_t q) const {
    return detail::mul_rn(e4m3_to_float(q), e8m0_to_float(scale_code));
  }
};

// MXFP4, 32 values per e8m0 scale X = mxfp4_scale_code(amax) ("even" rounding):
// q = e2m1(x * 2^(127-e)), saturating at +-6. Decode: e2m1 * X.
struct Mxfp4BlockQuant {
  static constexpr int32_t kGroup = 32;
  static constexpr int32_t kCodeBits = 4;  // e2m1 codes
  uint8_t scale_code;  // e8m0, stored
  float inv;           // 1 / X, exact

  EPCOMM_HD static Mxfp4BlockQuant from_code(uint8_t code) {
    return Mxfp4BlockQuant{code, e8m0_reciprocal(code)};
  }
  EPCOMM_HD static Mxfp4BlockQuant from_amax(float amax) {
    return from_code(mxfp4_scale_code(amax));
  }
  EPCOMM_HD uint8_t encode(float x) const { return float_to_e2m1(detail::mul_rn(x, inv)); }
  EPCOMM_HD float decode(uint8_t q) const {
    return detail::mul_rn(e2m1_to_float(q), e8m0_to_float(scale_code));
  }
};

}  // namespace epcomm
