// The pointwise activation of the fused SiLU / SwiGLU kernels (docs/design.md "Fused SiLU / SwiGLU"), host + device: the
// kernels (epcomm/silu.h) and their CPU reference (reference_silu.h) both call these, so they
// evaluate the same fp32 operations in the same order.
//
// expf is the one operation not correctly rounded: the host uses the C library's expf, the
// device CUDA's expf (never __expf: no fast-math). They may differ in the last bit for some
// inputs, so a kernel's z can differ from the reference's by an ulp or so there, and a code next
// to a rounding tie with it; everything after expf is fixed here.
#pragma once

#include <cmath>

#include "epcomm/formats/codecs.h"  // EPCOMM_HD, mul_rn, div_rn

namespace epcomm {

namespace detail {
// fp32 add rounded to nearest even, never contracted into an FMA (codecs.h has mul_rn, div_rn).
EPCOMM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
}  // namespace detail

// ---- the pointwise activation (host + device) -----------------------------------------------

// silu(gate) * up, in fp32, in this order:
//   e = expf(-gate); d = 1 + e; s = gate / d; z = s * up.
// gate -> -inf or below about -88.7 gives e = +inf and s = -0 (z a signed zero, or NaN for an
// infinite up); NaN propagates.
EPCOMM_HD float silu_mul(float gate, float up) {
  const float e = expf(-gate);
  const float s = detail::div_rn(gate, detail::add_rn(1.0f, e));
  return detail::mul_rn(s, up);
}

// The clamped SwiGLU (gpt-oss): limit L >= 0 and alpha, both finite.
//   g' = min(g, L)        — clamped from above only, as docs/design.md says: a very negative gate is
//                           already sent to zero by the sigmoid;
//   u' = clamp(u, -L, L);
//   z  = (u' + 1) * g' * sigmoid(alpha * g'), in fp32, in this order:
//   a = alpha * g'; e = expf(-a); sig = 1 / (1 + e); t = u' + 1; z = (t * g') * sig.
// The clamps are comparisons (g > L ? L : g), so a NaN input passes through as NaN (fminf would
// drop it).
struct SwigluClamp {
  float limit;
  float alpha;
};

EPCOMM_HD float swiglu_clamped(float gate, float up, SwigluClamp c) {
  const float g = gate > c.limit ? c.limit : gate;
  const float u = up > c.limit ? c.limit : (up < -c.limit ? -c.limit : up);
  const float e = expf(-detail::mul_rn(c.alpha, g));
  const float sig = detail::div_rn(1.0f, detail::add_rn(1.0f, e));
  return detail::mul_rn(detail::mul_rn(detail::add_rn(u, 1.0f), g), sig);
}

}  // namespace epcomm
