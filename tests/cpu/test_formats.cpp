// The token-format layer on the CPU: the scalar codecs (e4m3, e2m1, e8m0) against brute-force
// oracles written independently here (nearest representable value in double arithmetic, ties to
// the even code), the scale rules, the reference encoders/decoders of every format, their error
// bounds, and the scale layouts on hand-worked examples.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/formats/scale_layouts.h"

namespace epcomm {
namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::string hex(uint32_t u) {
  std::ostringstream s;
  s << "0x" << std::hex << u;
  return s.str();
}
std::string describe(float x) {
  std::ostringstream s;
  s.precision(9);
  s << x << " (" << hex(bits(x)) << ")";
  return s.str();
}

// ---- oracles --------------------------------------------------------------------------------

// Values straight from the format definitions.
double e4m3_value(uint32_t code) {
  const int e = int(code >> 3) & 0xf;
  const int m = int(code) & 7;
  if (e == 15 && m == 7) return NAN;
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(double(8 + m), e - 10);
  return (code & 0x80) ? -mag : mag;
}
double e2m1_value(uint32_t code) {
  static const double kMag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const double mag = kMag[code & 7];
  return (code & 8) ? -mag : mag;
}

// The magnitude code nearest to ax >= 0 among codes 0..max_code (values increasing with the
// code), ties to the even code, saturating at max_code.
template <typename ValueOf>
uint32_t nearest_even_code(double ax, uint32_t max_code, ValueOf value_of) {
  if (ax >= value_of(max_code)) return max_code;
  uint32_t lo = 0, hi = max_code;  // value_of(lo) <= ax < value_of(hi)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (value_of(mid) <= ax) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const double below = ax - value_of(lo), above = value_of(hi) - ax;
  if (below != above) return below < above ? lo : hi;
  return lo % 2 == 0 ? lo : hi;
}

uint8_t oracle_e4m3(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const uint32_t sign = std::signbit(x) ? 0x80 : 0;
  return uint8_t(sign | nearest_even_code(std::fabs(double(x)), 0x7e, e4m3_value));
}
uint8_t oracle_e2m1(float x) {
  if (std::isnan(x)) return 0x7;
  const uint32_t sign = std::signbit(x) ? 0x8 : 0;
  return uint8_t(sign | nearest_even_code(std::fabs(double(x)), 0x7, e2m1_value));
}

// e8m0 scale oracles: the smallest e in [0, 254] whose 2^(e-127), times `times`, reaches v (254
// if none does). The exact comparisons decide; the ilogb estimate only shortens the walk.
uint8_t smallest_e8m0_reaching(double v, double times) {
  auto reaches = [&](int e) { return times * std::ldexp(1.0, e - 127) >= v; };
  int e = v > 0 ? std::ilogb(v / times) + 127 - 2 : 0;
  e = e < 0 ? 0 : (e > 254 ? 254 : e);
  while (e > 0 && reaches(e - 1))
    --e;
  while (e < 254 && !reaches(e))
    ++e;
  return uint8_t(e);
}
uint8_t oracle_e8m0_ceil(float v) {
  if (!std::isfinite(v)) return 0xff;
  return smallest_e8m0_reaching(std::fabs(double(v)), 1.0);
}
uint8_t oracle_mxfp8_scale(float amax) {
  if (!std::isfinite(amax)) return 0xff;
  return smallest_e8m0_reaching(double(amax), 448.0);
}
// OCP floor rule applied to amax rounded to 1 mantissa bit, to nearest, ties to even.
uint8_t oracle_mxfp4_scale(float amax) {
  if (!std::isfinite(amax)) return 0xff;
  if (amax == 0.0f) return 0;
  int exp = 0;
  const double f = std::frexp(double(amax), &exp);  // amax = f * 2^exp, f in [0.5, 1)
  int floor_log2 = exp - 1;                         // significand 2f in [1, 2)
  const double halves = std::nearbyint(4.0 * f);    // 2f to 1 bit: {2, 3, 4} halves
  if (halves == 4.0) ++floor_log2;
  const int e = floor_log2 - 2 + 127;
  return uint8_t(e < 0 ? 0 : (e > 254 ? 254 : e));
}

// ---- probe sets -----------------------------------------------------------------------------

std::mt19937_64& rng() {
  static std::mt19937_64 r(0x5eed);
  return r;
}

// fp32 patterns of both signs over exponent fields [exp_lo, exp_hi]: every value of the top 11
// mantissa bits with the low 12 bits all zero (exact ties of short formats), 1 (just above), a
// half and a half minus one, all ones, and random.
std::vector<float> mantissa_sweep(uint32_t exp_lo, uint32_t exp_hi) {
  std::vector<float> out;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t e = exp_lo; e <= exp_hi; ++e) {
      for (uint32_t top = 0; top < 2048; ++top) {
        const uint32_t lows[] = {0u, 1u, 0x800u, 0x7ffu, 0xfffu, uint32_t(rng()() & 0xfff)};
        for (uint32_t low : lows)
          out.push_back(from_bits(sign << 31 | e << 23 | top << 12 | low));
      }
    }
  }
  return out;
}

// Both signs, every exponent field, the mantissas around the boundaries the scale rules care
// about (0, 1.25, 1.5, 1.75 and the ends) and a few random ones.
std::vector<float> exponent_sweep() {
  std::vector<float> out;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t e = 0; e < 256; ++e) {
      std::vector<uint32_t> mants = {0u,        1u,        0x1fffffu, 0x200000u, 0x200001u,
                                     0x3fffffu, 0x400000u, 0x400001u, 0x5fffffu, 0x600000u,
                                     0x600001u, 0x7ffffeu, 0x7fffffu};
      for (int i = 0; i < 8; ++i)
        mants.push_back(uint32_t(rng()() & 0x7fffff));
      for (uint32_t m : mants)
        out.push_back(from_bits(sign << 31 | e << 23 | m));
    }
  }
  return out;
}

std::vector<float> random_floats(size_t n) {
  std::vector<float> out(n);
  for (float& f : out)
    f = from_bits(uint32_t(rng()()));
  return out;
}

// Every representable value (both signs) of a format, the midpoints of neighbours and the fp32
// numbers next to all of them.
template <typename ValueOf>
std::vector<float> around_values(uint32_t max_code, ValueOf value_of) {
  std::vector<double> mags;
  for (uint32_t c = 0; c <= max_code; ++c)
    mags.push_back(value_of(c));
  std::vector<float> pts;
  for (size_t i = 0; i < mags.size(); ++i) {
    pts.push_back(float(mags[i]));
    if (i + 1 < mags.size()) pts.push_back(float((mags[i] + mags[i + 1]) / 2));  // exact
  }
  // Beyond the largest value: where the next step would be, its midpoint, far out.
  const double top = mags.back(), step = mags.back() - mags[mags.size() - 2];
  pts.push_back(float(top + step / 2));
  pts.push_back(float(top + step));
  pts.push_back(float(top * 2));
  pts.push_back(1e30f);
  pts.push_back(FLT_MAX);
  pts.push_back(INFINITY);
  std::vector<float> out;
  for (float p : pts) {
    for (float q : {p, std::nextafter(p, 0.0f), std::nextafter(p, INFINITY)}) {
      out.push_back(q);
      out.push_back(-q);
    }
  }
  return out;
}

// Runs `check` over `inputs`, failing with the first mismatch and the number of them.
template <typename In, typename Check>
void expect_all(const std::vector<In>& inputs, Check check, const char* what) {
  size_t bad = 0;
  std::string first;
  for (const In& x : inputs) {
    std::string why;
    if (!check(x, &why)) {
      if (bad++ == 0) first = why;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << inputs.size()
                     << " mismatch; first: " << first;
}

// A check for expect_all: encode(x) equals oracle(x); show prints a code in the message.
template <typename Encode, typename Oracle, typename Show>
auto matches_oracle(Encode encode, Oracle oracle, Show show) {
  return [=](float x, std::string* why) {
    const uint8_t got = encode(x), want = oracle(x);
    if (got == want) return true;
    *why = describe(x) + " -> " + show(got) + ", want " + show(want);
    return false;
  };
}
std::string decimal(uint8_t c) { return std::to_string(c); }

// ---- e4m3 -----------------------------------------------------------------------------------

TEST(FormatsE4m3, DecodesEveryCodeToItsDefinedValue) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float f = e4m3_to_float(uint8_t(c));
    const double want = e4m3_value(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << "code " << hex(c);
      EXPECT_TRUE(e4m3_is_nan(uint8_t(c)));
      EXPECT_EQ(std::signbit(f), (c & 0x80) != 0) << "NaN keeps the sign, code " << hex(c);
    } else {
      EXPECT_EQ(double(f), want) << "code " << hex(c);
      EXPECT_EQ(std::signbit(f), (c & 0x80) != 0) << "code " << hex(c);
      EXPECT_FALSE(e4m3_is_nan(uint8_t(c)));
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_float(0x08), 0x1p-6f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
}

TEST(FormatsE4m3, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 256; ++c) {
    const uint8_t back = float_to_e4m3(e4m3_to_float(uint8_t(c)));
    EXPECT_EQ(back, c) << "code " << hex(c);  // NaN codes too: NaN keeps its sign
  }
}

TEST(FormatsE4m3, MatchesNearestEvenOracle) {
  const auto check = matches_oracle([](float x) { return float_to_e4m3(x); }, oracle_e4m3, hex);
  expect_all(around_values(0x7e, e4m3_value), check, "representable values and midpoints");
  expect_all(mantissa_sweep(100, 145), check, "mantissa sweep 2^-27 .. 2^18");
  expect_all(random_floats(1 << 20), check, "random fp32 patterns");
}

TEST(FormatsE4m3, TiesGoToEven) {
  // Normal range: 1 + 1/16 is halfway between 1 (mantissa 000) and 1.125 (001).
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(float_to_e4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
  // 1.1875 is halfway between 1.125 (001) and 1.25 (010).
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(float_to_e4m3(std::nextafter(1.1875f, 0.0f)), 0x39);
  // Top binade, steps of 32: 400 is halfway between 384 (0x7c) and 416 (0x7d), 432 between
  // 416 and 448 (0x7e).
  EXPECT_EQ(float_to_e4m3(400.0f), 0x7c);
  EXPECT_EQ(float_to_e4m3(432.0f), 0x7e);
  // Subnormals: steps of 2^-9; 2^-10 is halfway between 0 and 2^-9 and goes to 0.
  EXPECT_EQ(float_to_e4m3(0x1p-10f), 0x00);
  EXPECT_EQ(float_to_e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(3 * 0x1p-10f), 0x02);   // between 1 and 2 steps: to 2
  EXPECT_EQ(float_to_e4m3(5 * 0x1p-10f), 0x02);   // between 2 and 3 steps: to 2
  EXPECT_EQ(float_to_e4m3(15 * 0x1p-10f), 0x08);  // between 7 steps and 2^-6: to 2^-6
  EXPECT_EQ(float_to_e4m3(-3 * 0x1p-10f), 0x82);
}

TEST(FormatsE4m3, SaturatesFiniteAndInfinite) {
  for (float x :
       {448.0f, 449.0f, 463.99f, 464.0f, 465.0f, 480.0f, 1e4f, 1e30f, FLT_MAX, float(INFINITY)}) {
    EXPECT_EQ(float_to_e4m3(x), 0x7e) << x;
    EXPECT_EQ(float_to_e4m3(-x), 0xfe) << -x;
  }
  EXPECT_EQ(float_to_e4m3(447.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(415.0f), 0x7d);
}

TEST(FormatsE4m3, SignedZeroAndUnderflow) {
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(-1e-30f), 0x80);
  EXPECT_EQ(float_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(float_to_e4m3(-FLT_TRUE_MIN), 0x80);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_to_float(0x80), 0.0f);
}

TEST(FormatsE4m3, NanKeepsItsSign) {
  EXPECT_EQ(float_to_e4m3(NAN), 0x7f);
  EXPECT_EQ(float_to_e4m3(-NAN), 0xff);
  EXPECT_EQ(float_to_e4m3(from_bits(0x7f800001u)), 0x7f);  // signalling NaN
  EXPECT_EQ(float_to_e4m3(from_bits(0xffc12345u)), 0xff);
}

// ---- e2m1 -----------------------------------------------------------------------------------

TEST(FormatsE2m1, DecodesEveryCode) {
  const float want[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(bits(e2m1_to_float(uint8_t(c))), bits(want[c])) << "code " << c;
    // Only the low nibble counts.
    EXPECT_EQ(bits(e2m1_to_float(uint8_t(c | 0xa0))), bits(want[c])) << "code " << c;
  }
}

TEST(FormatsE2m1, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(float_to_e2m1(e2m1_to_float(uint8_t(c))), c) << "code " << c;
  }
}

TEST(FormatsE2m1, MatchesNearestEvenOracle) {
  const auto check = matches_oracle([](float x) { return float_to_e2m1(x); }, oracle_e2m1, hex);
  expect_all(around_values(0x7, e2m1_value), check, "representable values and midpoints");
  expect_all(mantissa_sweep(118, 136), check, "mantissa sweep 2^-9 .. 2^9");
  expect_all(random_floats(1 << 20), check, "random fp32 patterns");
}

TEST(FormatsE2m1, TiesGoToEven) {
  EXPECT_EQ(float_to_e2m1(0.25f), 0x0);  // 0 | 0.5
  EXPECT_EQ(float_to_e2m1(std::nextafter(0.25f, 1.0f)), 0x1);
  EXPECT_EQ(float_to_e2m1(0.75f), 0x2);  // 0.5 (1) | 1.0 (2)
  EXPECT_EQ(float_to_e2m1(1.25f), 0x2);  // 1.0 (2) | 1.5 (3)
  EXPECT_EQ(float_to_e2m1(1.75f), 0x4);  // 1.5 (3) | 2.0 (4)
  EXPECT_EQ(float_to_e2m1(2.5f), 0x4);   // 2 (4) | 3 (5)
  EXPECT_EQ(float_to_e2m1(3.5f), 0x6);   // 3 (5) | 4 (6)
  EXPECT_EQ(float_to_e2m1(5.0f), 0x6);   // 4 (6) | 6 (7)
  EXPECT_EQ(float_to_e2m1(std::nextafter(5.0f, 6.0f)), 0x7);
  EXPECT_EQ(float_to_e2m1(-5.0f), 0xe);
  EXPECT_EQ(float_to_e2m1(-0.75f), 0xa);
}

TEST(FormatsE2m1, SaturatesSignedZeroAndNan) {
  for (float x : {6.0f, 6.5f, 7.0f, 8.0f, 100.0f, FLT_MAX, float(INFINITY)}) {
    EXPECT_EQ(float_to_e2m1(x), 0x7) << x;
    EXPECT_EQ(float_to_e2m1(-x), 0xf) << -x;
  }
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);
  EXPECT_EQ(float_to_e2m1(0.1f), 0x0);
  // No NaN in e2m1: +6 for any NaN, as PTX cvt.rn.satfinite.e2m1x2 gives.
  EXPECT_EQ(float_to_e2m1(NAN), 0x7);
  EXPECT_EQ(float_to_e2m1(-NAN), 0x7);
}

TEST(FormatsE2m1, PacksLowNibbleFirst) {
  EXPECT_EQ(pack_e2m1x2(0x7, 0x2), 0x27);
  EXPECT_EQ(pack_e2m1x2(0xf, 0x0), 0x0f);
  EXPECT_EQ(pack_e2m1x2(0x1a, 0x23), 0x3a);  // only the low nibbles count
  EXPECT_EQ(e2m1_low(0x27), 0x7);
  EXPECT_EQ(e2m1_high(0x27), 0x2);
}

// ---- e8m0 -----------------------------------------------------------------------------------

TEST(FormatsE8m0, DecodesEveryCode) {
  for (uint32_t e = 0; e < 255; ++e) {
    EXPECT_EQ(double(e8m0_to_float(uint8_t(e))), std::ldexp(1.0, int(e) - 127)) << e;
    // The reciprocal is exact.
    EXPECT_EQ(double(e8m0_reciprocal(uint8_t(e))), std::ldexp(1.0, 127 - int(e))) << e;
  }
  EXPECT_EQ(bits(e8m0_to_float(0)), 0x00400000u);  // 2^-127 is an fp32 subnormal
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xff)));
  EXPECT_TRUE(std::isnan(e8m0_reciprocal(0xff)));
}

TEST(FormatsE8m0, CeilRoundTripsAndRoundsUp) {
  for (uint32_t e = 0; e < 255; ++e) {
    const float p = e8m0_to_float(uint8_t(e));
    EXPECT_EQ(float_to_e8m0_ceil(p), e) << "2^" << int(e) - 127;
    EXPECT_EQ(float_to_e8m0_ceil(-p), e) << "magnitude is used";
    if (e < 254) {
      EXPECT_EQ(float_to_e8m0_ceil(std::nextafter(p, INFINITY)), e + 1) << e;
    }
    if (e > 0) {
      EXPECT_EQ(float_to_e8m0_ceil(std::nextafter(p, 0.0f)), e) << e;
    }
  }
  EXPECT_EQ(float_to_e8m0_ceil(0.0f), 0);
  EXPECT_EQ(float_to_e8m0_ceil(FLT_TRUE_MIN), 0);
  EXPECT_EQ(float_to_e8m0_ceil(from_bits(0x00400000u)), 0);  // 2^-127, an fp32 subnormal
  EXPECT_EQ(float_to_e8m0_ceil(from_bits(0x00400001u)), 1);  // just above it
  EXPECT_EQ(float_to_e8m0_ceil(3.0f), 129);
  EXPECT_EQ(float_to_e8m0_ceil(0.3f), 126);
  EXPECT_EQ(float_to_e8m0_ceil(FLT_MAX), 254);  // finite saturates to 2^127
  EXPECT_EQ(float_to_e8m0_ceil(INFINITY), 0xff);
  EXPECT_EQ(float_to_e8m0_ceil(NAN), 0xff);
}

TEST(FormatsE8m0, CeilMatchesOracle) {
  const auto check =
      matches_oracle([](float x) { return float_to_e8m0_ceil(x); }, oracle_e8m0_ceil, decimal);
  expect_all(exponent_sweep(), check, "every exponent");
  expect_all(random_floats(1 << 18), check, "random fp32 patterns");
}

// ---- scale rules ----------------------------------------------------------------------------

std::vector<float> amax_probes() {
  std::vector<float> out;
  for (float x : exponent_sweep()) {
    if (!std::signbit(x) && std::isfinite(x)) out.push_back(x);
  }
  for (int k = -140; k < 128; ++k) {
    for (double sig : {1.0, 1.25, 1.5, 1.75, 448.0 / 256.0, 6.0 / 4.0}) {
      const float p = float(std::ldexp(sig, k));
      if (!std::isfinite(p)) continue;
      out.push_back(p);
      out.push_back(std::nextafter(p, 0.0f));
      out.push_back(std::nextafter(p, INFINITY));
    }
  }
  for (float x : random_floats(1 << 18)) {
    if (std::isfinite(x)) out.push_back(std::fabs(x));
  }
  out.push_back(0.0f);
  out.push_back(FLT_MAX);
  return out;
}

TEST(FormatsScaleRules, Mxfp8IsAmaxOver448RoundedUpToAPowerOfTwo) {
  const std::vector<float> probes = amax_probes();
  expect_all(
      probes,
      [](float amax, std::string* why) {
        const uint8_t got = mxfp8_scale_code(amax), want = oracle_mxfp8_scale(amax);
        // No element of the block can saturate.
        const double scaled = double(amax) * std::ldexp(1.0, 127 - int(got));
        if (got == want && scaled <= 448.0) return true;
        *why = describe(amax) + " -> " + std::to_string(got) + ", want " + std::to_string(want);
        return false;
      },
      "exact rule");
  // Where amax / 448 is an fp32 normal, rounding the fp32 quotient up gives the same scale.
  expect_all(
      probes,
      [](float amax, std::string* why) {
        const float quotient = amax / 448.0f;
        if (quotient < FLT_MIN) return true;
        const uint8_t got = mxfp8_scale_code(amax), via = float_to_e8m0_ceil(quotient);
        if (got == via) return true;
        *why =
            describe(amax) + " -> " + std::to_string(got) + ", via quotient " + std::to_string(via);
        return false;
      },
      "fp32 quotient");
  EXPECT_EQ(mxfp8_scale_code(448.0f), 127);
  EXPECT_EQ(mxfp8_scale_code(std::nextafter(448.0f, 1e9f)), 128);
  EXPECT_EQ(mxfp8_scale_code(896.0f), 128);
  EXPECT_EQ(mxfp8_scale_code(1e4f), 132);  // 1e4 / 448 = 22.3 -> 32
  EXPECT_EQ(mxfp8_scale_code(0.0f), 0);
  EXPECT_EQ(mxfp8_scale_code(-448.0f), 127);
  EXPECT_EQ(mxfp8_scale_code(INFINITY), 0xff);
  EXPECT_EQ(mxfp8_scale_code(NAN), 0xff);
}

TEST(FormatsScaleRules, Mxfp4IsOcpFloorOfAmaxRoundedToOneMantissaBit) {
  const std::vector<float> probes = amax_probes();
  expect_all(
      probes,
      [](float amax, std::string* why) {
        const uint8_t got = mxfp4_scale_code(amax), want = oracle_mxfp4_scale(amax);
        if (got != want) {
          *why = describe(amax) + " -> " + std::to_string(got) + ", want " + std::to_string(want);
          return false;
        }
        // Differs from OCP's plain floor(log2(amax)) - 2 exactly when the significand >= 1.75.
        if (amax >= 0x1p-124f) {
          int exp = 0;
          const double f = std::frexp(double(amax), &exp);
          const int floor_rule = exp - 1 - 2 + 127;
          const int want_even = floor_rule + (2 * f >= 1.75 ? 1 : 0);
          if (int(got) != want_even) {
            *why = describe(amax) + ": " + std::to_string(got) + " vs floor rule " +
                   std::to_string(floor_rule);
            return false;
          }
          // The block maximum scales into [3.5, 7).
          const double scaled = double(amax) * std::ldexp(1.0, 127 - int(got));
          if (scaled < 3.5 || scaled >= 7.0) {
            *why = describe(amax) + " scales to " + std::to_string(scaled);
            return false;
          }
        }
        return true;
      },
      "even rule");
  EXPECT_EQ(mxfp4_scale_code(6.0f), 127);                        // 1.5 * 2^2: X = 1
  EXPECT_EQ(mxfp4_scale_code(7.0f), 128);                        // 1.75 * 2^2 ties up: X = 2
  EXPECT_EQ(mxfp4_scale_code(std::nextafter(7.0f, 0.0f)), 127);  // just below: X = 1
  EXPECT_EQ(mxfp4_scale_code(5.0f), 127);                        // 1.25 * 2^2 stays: X = 1
  EXPECT_EQ(mxfp4_scale_code(1.6f), 125);                        // X = 0.25 (MAX's example)
  EXPECT_EQ(mxfp4_scale_code(0.0f), 0);
  EXPECT_EQ(mxfp4_scale_code(FLT_MAX), 253);
  EXPECT_EQ(mxfp4_scale_code(INFINITY), 0xff);
  EXPECT_EQ(mxfp4_scale_code(NAN), 0xff);
}

TEST(FormatsScaleRules, AbsMaxIgnoresNanAndSign) {
  float acc = 0.0f;
  for (float x : {1.0f, -3.0f, float(NAN), 2.0f, -0.0f})
    acc = abs_max(acc, x);
  EXPECT_EQ(acc, 3.0f);
  EXPECT_EQ(abs_max(0.0f, -INFINITY), INFINITY);
  EXPECT_FALSE(std::signbit(abs_max(0.0f, -0.0f)));
  const float row[4] = {0.5f, -7.25f, NAN, 7.0f};
  EXPECT_EQ(reference::block_amax(row, 4), 7.25f);
}

// ---- formats: reference encoders and decoders -----------------------------------------------

// Rows of blocks of `group` values with a mix of kinds: zero, negative zero, tiny, a single
// 1e4 spike, constant, and random normals times 10^U(-3, 4) (up to ~1e5).
std::vector<float> make_rows(int64_t rows, int32_t hidden, int32_t group, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> decade(-3.0, 4.0);
  std::vector<float> x(size_t(rows * hidden));
  const int64_t blocks = rows * hidden / group;
  for (int64_t b = 0; b < blocks; ++b) {
    float* blk = x.data() + b * group;
    const double mag = std::pow(10.0, decade(gen));
    for (int32_t i = 0; i < group; ++i) {
      switch (b % 9) {
        case 0:
          blk[i] = 0.0f;
          break;
        case 1:
          blk[i] = -0.0f;
          break;
        case 2:
          blk[i] = normal(gen) * 1e-7f;
          break;
        case 3:
          blk[i] = (i == group / 3) ? -1e4f : 0.0f;
          break;
        case 4:
          blk[i] = 3.3f;
          break;
        default:
          blk[i] = float(normal(gen) * mag);
          break;
      }
    }
  }
  return x;
}

// Checks decode(encode(x)) against the bound block by block; returns the largest error/bound
// ratio over blocks with a non-zero bound.
double check_errors(const std::vector<float>& x, const std::vector<float>& dq, int32_t group,
                    const std::function<double(float)>& bound_of, const char* what) {
  double worst = 0.0;
  size_t bad = 0;
  std::string first;
  for (size_t b = 0; b < x.size() / size_t(group); ++b) {
    const float amax = reference::block_amax(&x[b * group], group);
    const double bound = bound_of(amax);
    for (int32_t i = 0; i < group; ++i) {
      const size_t k = b * group + size_t(i);
      const double err = std::fabs(double(x[k]) - double(dq[k]));
      if (!(err <= bound)) {
        if (bad++ == 0) {
          first = "x " + describe(x[k]) + " dq " + describe(dq[k]) + " err " + std::to_string(err) +
                  " bound " + std::to_string(bound);
        }
      }
      if (bound > 0) worst = std::fmax(worst, err / bound);
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": first " << first;
  return worst;
}

TEST(FormatsFp8Blockwise, EncodesRandomRowsExactly) {
  const int64_t rows = 40;
  const int32_t hidden = 1024, group = 128, blocks = hidden / group;
  const std::vector<float> x = make_rows(rows, hidden, group, 1);
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scales(size_t(rows * blocks)), dq(x.size());
  reference::encode_fp8_blockwise(x.data(), rows, hidden, codes.data(), scales.data());
  reference::decode_fp8_blockwise(codes.data(), scales.data(), rows, hidden, dq.data());
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* blk = &x[size_t(b * group)];
    float amax = 0.0f;
    for (int32_t i = 0; i < group; ++i)
      amax = std::fmax(amax, std::fabs(blk[i]));
    const float s = std::fmax(amax, 1e-4f) / 448.0f;
    ASSERT_EQ(bits(scales[size_t(b)]), bits(s)) << "block " << b;
    for (int32_t i = 0; i < group; ++i) {
      const size_t k = size_t(b * group + i);
      ASSERT_EQ(codes[k], oracle_e4m3(blk[i] / s)) << "block " << b << " x " << describe(blk[i]);
      ASSERT_EQ(bits(dq[k]), bits(float(e4m3_value(codes[k]) * double(s)))) << "block " << b;
      // The block maximum lands on +-448 once amax >= 1e-4.
      if (amax >= 1e-4f && std::fabs(blk[i]) == amax) {
        ASSERT_EQ(codes[k] & 0x7f, 0x7e);
      }
    }
  }
  // Zero blocks: the 1e-4 floor keeps the scale finite, the codes are signed zeros.
  EXPECT_EQ(scales[0], 1e-4f / 448.0f);
  EXPECT_EQ(codes[0], 0x00);
  EXPECT_EQ(codes[size_t(group)], 0x80);
  const double worst = check_errors(x, dq, group, reference::fp8_blockwise_error_bound, "fp8");
  EXPECT_GT(worst, 0.5) << "the bound should be tight";
}

TEST(FormatsFp8Blockwise, ExactValuesSurviveTheRoundTrip) {
  // amax = 448 * 2^-3: s = 2^-3 exactly, so values on the e4m3 grid times s come back exactly.
  std::vector<float> x(128);
  for (int i = 0; i < 128; ++i)
    x[size_t(i)] = float(e4m3_value(uint32_t(i * 2 % 127)) / 8.0);
  x[5] = -56.0f;  // 448 / 8
  std::vector<uint8_t> codes(128);
  float scale = 0;
  std::vector<float> dq(128);
  reference::encode_fp8_blockwise(x.data(), 1, 128, codes.data(), &scale);
  reference::decode_fp8_blockwise(codes.data(), &scale, 1, 128, dq.data());
  EXPECT_EQ(scale, 0.125f);
  for (int i = 0; i < 128; ++i)
    EXPECT_EQ(dq[size_t(i)], x[size_t(i)]) << i;
  EXPECT_EQ(codes[5], 0xfe);
}

// `x` moved by k fp32 ulps.
float step_ulps(float x, int k) {
  for (; k > 0; --k)
    x = std::nextafter(x, INFINITY);
  for (; k < 0; ++k)
    x = std::nextafter(x, -INFINITY);
  return x;
}

// x / s and x * (1 / s) differ in the last bit now and then, and next to an e4m3 tie that changes
// the code. Find such values (x within a few ulps of midpoint * s) and check the encoder divides,
// as docs/design.md's q = x / s says.
// Blockwise FP8 multiplies by 448 / amax (DeepEP's cast: x * (448 / amax), scale amax / 448),
// which differs from dividing by the stored scale near code boundaries: the test finds such
// values and checks the reference takes the multiply.
TEST(FormatsFp8Blockwise, MultipliesByTheReciprocal) {
  std::mt19937_64 gen(11);
  int found = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const float amax =
        float(std::ldexp(1.0 + double(gen() % (1u << 23)) / double(1u << 23), int(gen() % 24) - 8));
    const float s = amax / 448.0f;
    const float inv = 448.0f / amax;
    for (uint32_t c = 0; c + 1 < 0x7e; ++c) {
      const float mid = float((e4m3_value(c) + e4m3_value(c + 1)) / 2);
      for (int k = -3; k <= 3; ++k) {
        const float x = step_ulps(mid * s, k);
        const uint8_t by_div = oracle_e4m3(x / s), by_mul = oracle_e4m3(x * inv);
        if (by_div == by_mul || !(x < amax)) continue;
        ++found;
        std::vector<float> block(128, 0.0f);
        block[0] = amax;
        block[1] = -x;
        std::vector<uint8_t> codes(128);
        float scale = 0;
        reference::encode_fp8_blockwise(block.data(), 1, 128, codes.data(), &scale);
        ASSERT_EQ(scale, s);
        ASSERT_EQ(codes[1], by_mul | 0x80) << "amax " << describe(amax) << " x " << describe(x);
        ASSERT_EQ(float_to_e4m3(-x * inv), by_mul | 0x80);
      }
    }
  }
  EXPECT_GT(found, 20) << "the search should find values that tell the two apart";
}

// Power-of-two scales (Config::fp8_pow2_scales): s is the least power of two not below
// x = max(amax, 1e-4) * fl(1 / 448) (an independent frexp oracle), codes are e4m3(v / s) exactly
// (no block saturates: |v| / s <= 448), and the UE8M0 byte is s's biased exponent.
TEST(FormatsFp8Blockwise, PowerOfTwoScales) {
  std::mt19937_64 gen(13);
  const float inv448 = 1.0f / 448.0f;
  auto expected_scale = [&](float amax) {
    const float x = (amax > 1e-4f ? amax : 1e-4f) * inv448;
    int e = 0;
    const double m = std::frexp(double(x), &e);  // x = m 2^e, m in [0.5, 1)
    return float(m == 0.5 ? double(x) : std::ldexp(1.0, e));
  };
  std::vector<float> amaxes = {0.0f, 1e-4f, 448.0f, 224.0f, 896.0f, 1.0f, 3.0e38f};
  for (int i = 0; i < 300; ++i)  // random, and just above / below powers of two times 448
    amaxes.push_back(float(std::ldexp(1.0 + double(gen() % (1u << 23)) / double(1u << 23),
                                      int(gen() % 60) - 30)));
  for (int k = -20; k <= 20; ++k) {
    const float p = float(std::ldexp(448.0, k));
    amaxes.insert(amaxes.end(), {p, std::nextafter(p, 0.0f), std::nextafter(p, 1e38f)});
  }
  int rounded_up = 0;
  for (const float amax : amaxes) {
    std::vector<float> block(128);
    for (int i = 0; i < 128; ++i)
      block[size_t(i)] = amax * (float(int(gen() % 2001) - 1000) / 1000.0f);
    block[size_t(gen() % 128)] = (gen() & 1) ? amax : -amax;
    std::vector<uint8_t> codes(128);
    float s = 0.0f;
    reference::encode_fp8_blockwise(block.data(), 1, 128, codes.data(), &s, true);
    ASSERT_EQ(s, expected_scale(amax)) << "amax " << describe(amax);
    int e = 0;
    ASSERT_EQ(std::frexp(double(s), &e), 0.5) << "a power of two";
    ASSERT_EQ(int(Fp8BlockQuant::ue8m0_of(s)), e - 1 + 127);
    if (s > (amax > 1e-4f ? amax : 1e-4f) * inv448) ++rounded_up;
    for (int i = 0; i < 128; ++i) {
      const double scaled = double(block[size_t(i)]) / double(s);  // exact: s is 2^k
      ASSERT_LE(std::fabs(scaled), 448.0);
      ASSERT_EQ(codes[size_t(i)], oracle_e4m3(float(scaled))) << "amax " << describe(amax);
    }
    // The fp32 rule is unchanged by the flag's default.
    float s32 = 0.0f;
    reference::encode_fp8_blockwise(block.data(), 1, 128, codes.data(), &s32);
    ASSERT_EQ(s32, Fp8BlockQuant::from_amax(amax).scale);
  }
  EXPECT_GT(rounded_up, 100) << "most scales are rounded up, not already powers of two";
  const Fp8BlockQuant inf = Fp8BlockQuant::from_amax(INFINITY, true);
  EXPECT_TRUE(std::isinf(inf.scale));
  EXPECT_EQ(inf.inv, 0.0f);
}

// NVFP4 fixes the order of its fp32 operations: scale code e4m3((gs * amax) / 6), then
// e2m1(x * (gs / sf)) with sf the decoded scale. The other orders round differently now and then;
// search for inputs next to the e4m3 / e2m1 ties where they change the result and check the
// defined order wins.
TEST(FormatsNvfp4, OrderOfOperationsIsPinned) {
  std::mt19937_64 gen(12);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  int scale_cases = 0, value_cases = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const float gs = float(448.0 * 6.0 / std::pow(10.0, 4.0 * unit(gen)));  // global amax 1..1e4
    // The scale: amax near 6 / gs times an e4m3 midpoint (subnormal ones included).
    const uint32_t c = uint32_t(gen() % 0x7d);
    const float mid = float((e4m3_value(c) + e4m3_value(c + 1)) / 2);
    for (int k = -3; k <= 3; ++k) {
      const float amax = step_ulps(mid * 6.0f / gs, k);
      const uint8_t defined = oracle_e4m3(gs * amax / 6.0f);
      const uint8_t other = oracle_e4m3(gs * (amax / 6.0f));
      const uint8_t other2 = oracle_e4m3(amax / 6.0f * gs);
      if (defined == other && defined == other2) continue;
      ++scale_cases;
      ASSERT_EQ(Nvfp4BlockQuant::from_amax(amax, gs).scale_code, defined)
          << "gs " << describe(gs) << " amax " << describe(amax);
    }
    // The values: a block with a random amax, x near sf / gs times an e2m1 midpoint.
    const float amax = float(std::pow(10.0, 6.0 * unit(gen) - 3.0));
    const Nvfp4BlockQuant q = Nvfp4BlockQuant::from_amax(amax, gs);
    if (q.scale == 0.0f) continue;
    const float sf = q.scale;
    for (double m : {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0}) {
      for (int k = -3; k <= 3; ++k) {
        const float x = step_ulps(float(m) * sf / gs, k);
        if (!(x < amax)) continue;
        const uint8_t defined = oracle_e2m1(x * (gs / sf));
        const uint8_t alt1 = oracle_e2m1(x / (sf / gs));
        const uint8_t alt2 = oracle_e2m1(x * gs / sf);
        if (defined == alt1 && defined == alt2) continue;
        ++value_cases;
        std::vector<float> block(16, 0.0f);
        block[0] = amax;
        block[3] = x;
        uint8_t packed[8], scale = 0;
        reference::encode_nvfp4(block.data(), 1, 16, gs, packed, &scale);
        ASSERT_EQ(scale, q.scale_code);
        ASSERT_EQ(e2m1_high(packed[1]), defined)
            << "gs " << describe(gs) << " amax " << describe(amax) << " x " << describe(x);
      }
    }
  }
  EXPECT_GT(scale_cases, 5) << "the search should find amax values that tell the orders apart";
  EXPECT_GT(value_cases, 20) << "the search should find values that tell the orders apart";
}

void run_nvfp4(float gs, uint64_t seed) {
  const int64_t rows = 24;
  const int32_t hidden = 1024, group = 16, blocks = hidden / group;
  const std::vector<float> x = make_rows(rows, hidden, group, seed);
  std::vector<uint8_t> packed(x.size() / 2), scales(size_t(rows * blocks));
  std::vector<float> dq(x.size());
  reference::encode_nvfp4(x.data(), rows, hidden, gs, packed.data(), scales.data());
  reference::decode_nvfp4(packed.data(), scales.data(), rows, hidden, gs, dq.data());
  int zero_scale_blocks = 0;
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* blk = &x[size_t(b * group)];
    float amax = 0.0f;
    for (int32_t i = 0; i < group; ++i)
      amax = std::fmax(amax, std::fabs(blk[i]));
    const uint8_t want_scale = oracle_e4m3(gs * amax / 6.0f);
    ASSERT_EQ(scales[size_t(b)], want_scale) << "block " << b << " amax " << amax;
    const float sf = float(e4m3_value(want_scale));
    zero_scale_blocks += sf == 0.0f;
    for (int32_t i = 0; i < group; ++i) {
      const size_t k = size_t(b * group + i);
      const uint8_t code = (k % 2 == 0) ? (packed[k / 2] & 0xf) : (packed[k / 2] >> 4);
      const uint8_t want = sf == 0.0f ? 0 : oracle_e2m1(blk[i] * (gs / sf));
      ASSERT_EQ(code, want) << "block " << b << " x " << describe(blk[i]);
      const float want_dq = float(e2m1_value(code) * sf / double(gs));
      ASSERT_EQ(bits(dq[k]), bits(want_dq)) << "block " << b;
    }
  }
  EXPECT_GT(zero_scale_blocks, 0);  // the zero blocks at least
  const double worst = check_errors(
      x, dq, group, [gs](float amax) { return reference::nvfp4_error_bound(amax, gs); }, "nvfp4");
  EXPECT_GT(worst, 0.5) << "the bound should be tight";
}

TEST(FormatsNvfp4, EncodesRandomRowsExactly) {
  run_nvfp4(1.0f, 2);
  run_nvfp4(448.0f * 6.0f / 2e5f, 3);  // the usual gs = 448 * 6 / global amax
  run_nvfp4(0.37f, 4);
}

TEST(FormatsNvfp4, ZeroScaleBlocksGiveZeroCodes) {
  // All-zero, all negative zero, and a block whose gs * amax / 6 is below 2^-10 (scale rounds to
  // 0): scale 0 and every code +0, not +-6 from gs / 0.
  std::vector<float> x(48, 0.0f);
  for (int i = 16; i < 32; ++i)
    x[size_t(i)] = -0.0f;
  for (int i = 32; i < 48; ++i)
    x[size_t(i)] = (i % 2 ? -1.0f : 1.0f) * 1e-5f;
  std::vector<uint8_t> packed(24, 0xaa), scales(3, 0xaa);
  std::vector<float> dq(48, 1.0f);
  reference::encode_nvfp4(x.data(), 1, 48, 1.0f, packed.data(), scales.data());
  reference::decode_nvfp4(packed.data(), scales.data(), 1, 48, 1.0f, dq.data());
  for (uint8_t s : scales)
    EXPECT_EQ(s, 0);
  for (uint8_t p : packed)
    EXPECT_EQ(p, 0);
  for (float v : dq)
    EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(reference::nvfp4_error_bound(1e-5f, 1.0f), double(1e-5f));
}

TEST(FormatsNvfp4, HandWorkedBlock) {
  // gs = 1, amax 6: sf = e4m3(1) = 1 (0x38); values map to e2m1 directly, two per byte.
  float x[16] = {6.0f, 1.0f, -0.5f, 2.9f, 5.1f, -6.0f, 0.2f, 0.3f,
                 0.0f, 0.0f, 0.0f,  0.0f, 0.0f, 0.0f,  0.0f, 4.0f};
  uint8_t packed[8], scale;
  reference::encode_nvfp4(x, 1, 16, 1.0f, packed, &scale);
  EXPECT_EQ(scale, 0x38);
  EXPECT_EQ(packed[0], 0x27);  // 6 (7) low, 1 (2) high
  EXPECT_EQ(packed[1], 0x59);  // -0.5 (9), 2.9 -> 3 (5)
  EXPECT_EQ(packed[2], 0xf7);  // 5.1 -> 6 (7), -6 (f)
  EXPECT_EQ(packed[3], 0x10);  // 0.2 -> 0, 0.3 -> 0.5 (1)
  EXPECT_EQ(packed[7], 0x60);  // 0, 4 (6)
  // gs = 2, amax 3: sf = e4m3(1) again, values scaled by gs / sf = 2; decode halves them.
  float y[16] = {3.0f, 0.25f, -1.5f};
  float dq[16];
  reference::encode_nvfp4(y, 1, 16, 2.0f, packed, &scale);
  reference::decode_nvfp4(packed, &scale, 1, 16, 2.0f, dq);
  EXPECT_EQ(scale, 0x38);
  EXPECT_EQ(packed[0], 0x17);  // 6 (7), 0.5 (1)
  EXPECT_EQ(packed[1], 0x0d);  // -3 (d), 0
  EXPECT_EQ(dq[0], 3.0f);
  EXPECT_EQ(dq[1], 0.25f);
  EXPECT_EQ(dq[2], -1.5f);
}

TEST(FormatsMxfp8, EncodesRandomRowsExactly) {
  const int64_t rows = 40;
  const int32_t hidden = 1024, group = 32, blocks = hidden / group;
  const std::vector<float> x = make_rows(rows, hidden, group, 5);
  std::vector<uint8_t> codes(x.size()), scales(size_t(rows * blocks));
  std::vector<float> dq(x.size());
  reference::encode_mxfp8(x.data(), rows, hidden, codes.data(), scales.data());
  reference::decode_mxfp8(codes.data(), scales.data(), rows, hidden, dq.data());
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* blk = &x[size_t(b * group)];
    float amax = 0.0f;
    for (int32_t i = 0; i < group; ++i)
      amax = std::fmax(amax, std::fabs(blk[i]));
    const uint8_t e = scales[size_t(b)];
    ASSERT_EQ(e, oracle_mxfp8_scale(amax)) << "block " << b;
    for (int32_t i = 0; i < group; ++i) {
      const size_t k = size_t(b * group + i);
      const float scaled = float(std::ldexp(double(blk[i]), 127 - int(e)));  // exact
      ASSERT_EQ(codes[k], oracle_e4m3(scaled)) << "block " << b << " x " << describe(blk[i]);
      ASSERT_NE(codes[k] & 0x7f, 0x7f) << "never NaN for finite input";
      ASSERT_EQ(bits(dq[k]), bits(float(std::ldexp(e4m3_value(codes[k]), int(e) - 127))));
    }
  }
  EXPECT_EQ(scales[0], 0);  // zero block: the smallest scale
  const double worst = check_errors(x, dq, group, reference::mxfp8_error_bound, "mxfp8");
  EXPECT_GT(worst, 0.5) << "the bound should be tight";
}

TEST(FormatsMxfp8, ExactValuesSurviveTheRoundTrip) {
  // amax = 448 * 2^5: scale 2^5 (code 132); grid values times 2^5 come back exactly.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i)
    x[size_t(i)] = float(std::ldexp(e4m3_value(uint32_t(i * 9 % 127)), 5));
  x[7] = 448.0f * 32;
  x[8] = -0.0f;
  std::vector<uint8_t> codes(32);
  uint8_t scale = 0;
  std::vector<float> dq(32);
  reference::encode_mxfp8(x.data(), 1, 32, codes.data(), &scale);
  reference::decode_mxfp8(codes.data(), &scale, 1, 32, dq.data());
  EXPECT_EQ(scale, 132);
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(bits(dq[size_t(i)]), bits(x[size_t(i)])) << i;
  EXPECT_EQ(codes[7], 0x7e);
  EXPECT_EQ(codes[8], 0x80);
}

TEST(FormatsMxfp4, EncodesRandomRowsExactly) {
  const int64_t rows = 40;
  const int32_t hidden = 1024, group = 32, blocks = hidden / group;
  const std::vector<float> x = make_rows(rows, hidden, group, 6);
  std::vector<uint8_t> packed(x.size() / 2), scales(size_t(rows * blocks));
  std::vector<float> dq(x.size());
  reference::encode_mxfp4(x.data(), rows, hidden, packed.data(), scales.data());
  reference::decode_mxfp4(packed.data(), scales.data(), rows, hidden, dq.data());
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* blk = &x[size_t(b * group)];
    float amax = 0.0f;
    for (int32_t i = 0; i < group; ++i)
      amax = std::fmax(amax, std::fabs(blk[i]));
    const uint8_t e = scales[size_t(b)];
    ASSERT_EQ(e, oracle_mxfp4_scale(amax)) << "block " << b;
    for (int32_t i = 0; i < group; ++i) {
      const size_t k = size_t(b * group + i);
      const uint8_t code = (k % 2 == 0) ? (packed[k / 2] & 0xf) : (packed[k / 2] >> 4);
      const float scaled = float(std::ldexp(double(blk[i]), 127 - int(e)));
      ASSERT_EQ(code, oracle_e2m1(scaled)) << "block " << b << " x " << describe(blk[i]);
      ASSERT_EQ(bits(dq[k]), bits(float(std::ldexp(e2m1_value(code), int(e) - 127))));
    }
  }
  const double worst = check_errors(x, dq, group, reference::mxfp4_error_bound, "mxfp4");
  EXPECT_GT(worst, 0.5) << "the bound should be tight";
}

TEST(FormatsMxfp4, HandWorkedBlocks) {
  // MAX's example: [1.6, 0.4, 0...] -> X = 0.25, codes 6 (0x7) and 1.5 (0x3).
  float x[32] = {1.6f, 0.4f};
  uint8_t packed[16], scale;
  float dq[32];
  reference::encode_mxfp4(x, 1, 32, packed, &scale);
  reference::decode_mxfp4(packed, &scale, 1, 32, dq);
  EXPECT_EQ(scale, 125);
  EXPECT_EQ(packed[0], 0x37);
  EXPECT_EQ(dq[0], 1.5f);
  EXPECT_EQ(dq[1], 0.375f);
  // Grid values times 2^-4 with amax 6 * 2^-4 come back exactly.
  float y[32];
  for (int i = 0; i < 32; ++i)
    y[i] = float(e2m1_value(uint32_t(i % 16)) / 16.0);
  reference::encode_mxfp4(y, 1, 32, packed, &scale);
  reference::decode_mxfp4(packed, &scale, 1, 32, dq);
  EXPECT_EQ(scale, 123);
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(bits(dq[i]), bits(y[i])) << i;
  for (int i = 0; i < 16; ++i)
    EXPECT_EQ(packed[i], (2 * i % 16) | ((2 * i + 1) % 16) << 4) << i;
}

TEST(FormatsErrorBounds, HandWorkedValues) {
  // FP8: amax 448 -> s = 1, top binade [256, 448] has steps of 32.
  EXPECT_NEAR(reference::fp8_blockwise_error_bound(448.0f), 16.0, 1e-3);
  EXPECT_NEAR(reference::fp8_blockwise_error_bound(4480.0f), 160.0, 1e-2);
  EXPECT_LT(reference::fp8_blockwise_error_bound(0.0f), 1e-40);
  // MXFP8: 448 -> X = 1, 16; 449 -> X = 2, y = 224.5 (steps of 16): 8 * 2.
  EXPECT_NEAR(reference::mxfp8_error_bound(448.0f), 16.0, 1e-3);
  EXPECT_NEAR(reference::mxfp8_error_bound(449.0f), 16.0, 1e-3);
  EXPECT_NEAR(reference::mxfp8_error_bound(200.0f), 8.0, 1e-3);  // X = 0.5, y = 400: steps of 32
  // MXFP4: 6 -> X = 1, steps of 2 in [4, 6]; 7 -> X = 2, y = 3.5 (steps of 1); 3 -> X = 0.5.
  EXPECT_NEAR(reference::mxfp4_error_bound(6.0f), 1.0, 1e-5);
  EXPECT_NEAR(reference::mxfp4_error_bound(7.0f), 1.0, 1e-5);
  EXPECT_NEAR(reference::mxfp4_error_bound(3.0f), 0.5, 1e-5);
  // NVFP4: gs 1, amax 6 -> sf 1 -> 1; amax 6.5 -> sf = e4m3(1.0833) = 1.125, y = 5.78 -> 1.125.
  EXPECT_NEAR(reference::nvfp4_error_bound(6.0f, 1.0f), 1.0, 1e-5);
  EXPECT_NEAR(reference::nvfp4_error_bound(6.5f, 1.0f), 1.125, 1e-5);
  EXPECT_EQ(reference::nvfp4_error_bound(INFINITY, 1.0f), INFINITY);
  EXPECT_EQ(reference::mxfp4_error_bound(NAN), INFINITY);
}

TEST(FormatsReference, RejectsBadShapesAndScales) {
  float x[256] = {};
  uint8_t codes[256], scales8[16];
  float scales[2];
  EXPECT_THROW(reference::encode_fp8_blockwise(x, 1, 64, codes, scales), Error);
  EXPECT_THROW(reference::encode_nvfp4(x, 1, 24, 1.0f, codes, scales8), Error);
  EXPECT_THROW(reference::encode_nvfp4(x, 1, 32, 0.0f, codes, scales8), Error);
  EXPECT_THROW(reference::encode_nvfp4(x, 1, 32, INFINITY, codes, scales8), Error);
  EXPECT_THROW(reference::encode_mxfp8(x, 1, 48, codes, scales8), Error);
  EXPECT_THROW(reference::decode_mxfp4(codes, scales8, 1, 0, x), Error);
}

// ---- scale layouts --------------------------------------------------------------------------

TEST(FormatsScaleLayouts, Fp8PaddingAndOffsets) {
  const int32_t counts[4] = {5, 0, 4, 7};
  uint32_t row_offsets[5];
  padded_row_offsets(counts, 4, Fp8ScaleLayout::kRowAlign, row_offsets);
  const uint32_t want[5] = {0, 8, 8, 12, 20};
  for (int g = 0; g < 5; ++g)
    EXPECT_EQ(row_offsets[g], want[g]) << g;
  EXPECT_EQ(Fp8ScaleLayout::padded_rows(5), 8);
  EXPECT_EQ(Fp8ScaleLayout::padded_rows(0), 0);
  EXPECT_EQ(Fp8ScaleLayout::padded_rows(12), 12);
  // 16 routed rows over 4 groups need at most 16 + 4 * 3 = 28 rows.
  EXPECT_EQ(Fp8ScaleLayout::max_rows(16, 4), 28);
  EXPECT_EQ(Fp8ScaleLayout::max_rows(17, 4), 32);
  EXPECT_GE(Fp8ScaleLayout::max_rows(16, 4), int64_t(row_offsets[4]));

  const Fp8ScaleLayout layout{384, 28};  // H = 384: 3 scale columns of 28 rows
  EXPECT_EQ(layout.cols(), 3);
  EXPECT_EQ(layout.size(), 84);
  EXPECT_EQ(layout.offset(0, 0), 0);
  EXPECT_EQ(layout.offset(5, 0), 5);
  EXPECT_EQ(layout.offset(0, 1), 28);
  EXPECT_EQ(layout.offset(13, 2), 69);
  // Every group's column piece starts 16-byte aligned.
  for (int g = 0; g < 4; ++g) {
    for (int k = 0; k < 3; ++k)
      EXPECT_EQ(layout.offset(row_offsets[g], k) * 4 % 16, 0);
  }
  // place_fp8_scales transposes.
  std::vector<float> row_scales(20 * 3), out(size_t(layout.size()), -1.0f);
  for (size_t i = 0; i < row_scales.size(); ++i)
    row_scales[i] = float(i);
  reference::place_fp8_scales(row_scales.data(), 20, layout, out.data());
  EXPECT_EQ(out[size_t(layout.offset(13, 2))], float(13 * 3 + 2));
  EXPECT_EQ(out[size_t(layout.offset(20, 0))], -1.0f);  // rows past 20 untouched
  EXPECT_THROW(reference::place_fp8_scales(row_scales.data(), 29, layout, out.data()), Error);
  // Unpadded formats use align 1.
  padded_row_offsets(counts, 4, 1, row_offsets);
  EXPECT_EQ(row_offsets[4], 16u);
  EXPECT_EQ(row_offsets[3], 9u);
}

TEST(FormatsScaleLayouts, SwizzledIndexOnHandWorkedElements) {
  // NVFP4, H = 128: 8 scale columns -> 2 column tiles; 3 row tiles.
  const SwizzledScaleLayout l = SwizzledScaleLayout::make(128, 16, 128, 1);
  EXPECT_EQ(l.scale_cols, 8);
  EXPECT_EQ(l.col_tiles(), 2);
  EXPECT_EQ(l.row_tiles, 2);  // (128 + 1 * 128) / 128
  EXPECT_EQ(l.size(), 2 * 2 * 512);
  EXPECT_EQ(l.offset(0, 0), 0);
  EXPECT_EQ(l.offset(0, 1), 1);
  EXPECT_EQ(l.offset(0, 3), 3);
  EXPECT_EQ(l.offset(32, 0), 4);    // (row % 128) / 32 = 1
  EXPECT_EQ(l.offset(96, 2), 14);   // 3 * 4 + 2
  EXPECT_EQ(l.offset(1, 0), 16);    // row % 32 = 1
  EXPECT_EQ(l.offset(31, 3), 499);  // 31 * 16 + 3
  EXPECT_EQ(l.offset(127, 3), 511);
  EXPECT_EQ(l.offset(0, 4), 512);  // next column tile
  EXPECT_EQ(l.offset(33, 5), 512 + 16 + 4 + 1);
  EXPECT_EQ(l.offset(128, 0), 1024);  // next row tile
  // row 200, col 7: tile (1, 1), row % 32 = 8, (200 % 128) / 32 = 2, col % 4 = 3.
  EXPECT_EQ(l.offset(200, 7), ((1 * 2 + 1) * 32 + 8) * 16 + 2 * 4 + 3);
  const SwizzledScaleLayout::Index i = SwizzledScaleLayout::index(200, 7);
  EXPECT_EQ(i.tile_row, 1);
  EXPECT_EQ(i.tile_col, 1);
  EXPECT_EQ(i.sub_row, 8);
  EXPECT_EQ(i.sub_block, 2);
  EXPECT_EQ(i.sub_col, 3);
  EXPECT_EQ(l.tile_offset(1, 1), 1536);
  // MXFP8 uses one scale per 32: H = 7168 -> 224 scale columns, 56 column tiles, like NVFP4's
  // H = 3584.
  EXPECT_EQ(SwizzledScaleLayout::make(7168, 32, 1000, 8).col_tiles(), 56);
  EXPECT_EQ(SwizzledScaleLayout::make(7168, 16, 1000, 8).col_tiles(), 112);
  EXPECT_EQ(SwizzledScaleLayout::make(7168, 16, 1000, 8).row_tiles, (1000 + 8 * 128) / 128);
  // MXFP8, H = 2880: 90 scale columns -> 23 tiles, the last one half padding.
  EXPECT_EQ(SwizzledScaleLayout::make(2880, 32, 1, 1).col_tiles(), 23);
}

TEST(FormatsScaleLayouts, SwizzledIsABijection) {
  for (int32_t scale_cols : {8, 6}) {  // 6: two padding columns in the second column tile
    const SwizzledScaleLayout l{scale_cols, 3};
    std::vector<int> hits(size_t(l.size()), 0);
    for (int64_t r = 0; r < 3 * 128; ++r) {
      for (int32_t c = 0; c < scale_cols; ++c) {
        const int64_t o = l.offset(r, c);
        ASSERT_GE(o, 0);
        ASSERT_LT(o, l.size());
        ++hits[size_t(o)];
        // offset() is the row-major linearisation of index().
        const SwizzledScaleLayout::Index i = SwizzledScaleLayout::index(r, c);
        ASSERT_EQ(
            o,
            ((((i.tile_row * l.col_tiles()) + i.tile_col) * 32 + i.sub_row) * 4 + i.sub_block) * 4 +
                i.sub_col);
      }
    }
    int64_t once = 0;
    for (int64_t o = 0; o < l.size(); ++o) {
      ASSERT_LE(hits[size_t(o)], 1) << "offset " << o << " hit twice";
      once += hits[size_t(o)];
      // The slots nobody maps to are exactly the padding columns (col % 4 >= scale_cols % 4 in
      // the last column tile).
      const bool last_tile = (o / 512) % l.col_tiles() == l.col_tiles() - 1;
      const bool padding = scale_cols % 4 != 0 && last_tile && o % 4 >= scale_cols % 4;
      ASSERT_EQ(hits[size_t(o)] == 0, padding) << "offset " << o;
    }
    EXPECT_EQ(once, 3 * 128 * scale_cols);
  }
}

TEST(FormatsScaleLayouts, ScalesOffsetsOnWorkedExamples) {
  {
    // m = [100, 0, 300]: row_offsets [0, 100, 100, 400]; tiles [1, 0, 3] start at [0, 1, 1];
    // row_offsets / 128 = [0, 0, 0] -> scales_offsets [0, 1, 1].
    const uint32_t row_offsets[4] = {0, 100, 100, 400};
    uint32_t so[3];
    swizzled_scales_offsets(row_offsets, 3, so);
    EXPECT_EQ(so[0], 0u);
    EXPECT_EQ(so[1], 1u);
    EXPECT_EQ(so[2], 1u);
    const SwizzledGroup g2{row_offsets[2], so[2]};
    EXPECT_EQ(g2.tile_start(), 1);
    EXPECT_EQ(g2.scale_row(100), 128);  // group 2's first row starts tile 1
    EXPECT_EQ(g2.scale_row(399), 427);  // its last row is row 43 of tile 3
    EXPECT_EQ((SwizzledGroup{row_offsets[0], so[0]}.scale_row(99)), 99);
  }
  {
    // m = [200, 130, 5, 0, 128]: row_offsets [0, 200, 330, 335, 335, 463];
    // ceil(m / 128) = [2, 2, 1, 0, 1] -> tile starts [0, 2, 4, 5, 5];
    // row_offsets / 128 = [0, 1, 2, 2, 2] -> scales_offsets [0, 1, 2, 3, 3].
    const uint32_t row_offsets[6] = {0, 200, 330, 335, 335, 463};
    uint32_t so[5];
    swizzled_scales_offsets(row_offsets, 5, so);
    const uint32_t want[5] = {0, 1, 2, 3, 3};
    const int64_t starts[5] = {0, 2, 4, 5, 5};
    for (int g = 0; g < 5; ++g) {
      EXPECT_EQ(so[g], want[g]) << g;
      EXPECT_EQ((SwizzledGroup{row_offsets[g], so[g]}.tile_start()), starts[g]) << g;
    }
    // The GEMM's view: the t-th tile of group g starts at row row_offsets[g] + 128 t and reads
    // scale tile (that row) / 128 + scales_offsets[g].
    EXPECT_EQ((row_offsets[1] + 128) / 128 + so[1], 3u);
    EXPECT_EQ((SwizzledGroup{row_offsets[1], so[1]}.scale_row(200 + 129)), 3 * 128 + 1);
  }
}

TEST(FormatsScaleLayouts, SwizzledGroupsAreDisjointAndFit) {
  std::mt19937_64 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t groups = int32_t(gen() % 9) + 1;
    std::vector<int32_t> counts(static_cast<size_t>(groups));
    int64_t total = 0;
    for (int32_t& c : counts) {
      c = (gen() % 4 == 0) ? 0 : int32_t(gen() % 400);
      total += c;
    }
    std::vector<uint32_t> row_offsets(static_cast<size_t>(groups) + 1);
    std::vector<uint32_t> so(static_cast<size_t>(groups));
    padded_row_offsets(counts.data(), groups, 1, row_offsets.data());
    swizzled_scales_offsets(row_offsets.data(), groups, so.data());
    const int64_t row_tiles = SwizzledScaleLayout::row_tiles_for(total, groups);
    std::set<int64_t> used;
    for (int32_t g = 0; g < groups; ++g) {
      const SwizzledGroup grp{row_offsets[size_t(g)], so[size_t(g)]};
      for (int64_t r = row_offsets[size_t(g)]; r < int64_t(row_offsets[size_t(g) + 1]); ++r) {
        const int64_t sr = grp.scale_row(r);
        ASSERT_LT(sr / 128, row_tiles);
        ASSERT_TRUE(used.insert(sr).second) << "scale row " << sr << " used twice";
        if (r == int64_t(row_offsets[size_t(g)])) {
          ASSERT_EQ(sr % 128, 0) << "fresh tile";
        }
      }
    }
  }
}

TEST(FormatsScaleLayouts, PlaceSwizzledScales) {
  // Two groups, NVFP4 H = 64 (4 scale columns): m = [130, 3].
  const uint32_t row_offsets[3] = {0, 130, 133};
  const SwizzledScaleLayout l = SwizzledScaleLayout::make(64, 16, 133, 2);
  EXPECT_EQ(l.row_tiles, (133 + 256) / 128);
  std::vector<uint8_t> row_scales(133 * 4);
  for (size_t i = 0; i < row_scales.size(); ++i)
    row_scales[i] = uint8_t(1 + i % 250);
  std::vector<uint8_t> out(size_t(l.size()), 0xee);
  uint32_t so[2];
  reference::place_swizzled_scales(row_scales.data(), row_offsets, 2, l, out.data(), so);
  EXPECT_EQ(so[0], 0u);
  EXPECT_EQ(so[1], 1u);  // tile 2 - 130 / 128
  // Row 129 (group 0, tile 1, row 1), column 2.
  EXPECT_EQ(out[size_t(l.offset(129, 2))], row_scales[129 * 4 + 2]);
  // Row 131 is group 1's second row: scale row 2 * 128 + 1.
  EXPECT_EQ(out[size_t(l.offset(257, 3))], row_scales[131 * 4 + 3]);
  // Group 0's tile 1 past its 2 rows, and group 1's tile past 3 rows, are zero.
  EXPECT_EQ(out[size_t(l.offset(130, 0))], 0);
  EXPECT_EQ(out[size_t(l.offset(259, 1))], 0);
  size_t nonzero = 0;
  for (uint8_t b : out)
    nonzero += b != 0;
  EXPECT_EQ(nonzero, row_scales.size());
  // Too few tiles for the groups.
  const SwizzledScaleLayout small{4, 2};
  std::vector<uint8_t> small_out(size_t(small.size()));
  EXPECT_THROW(reference::place_swizzled_scales(row_scales.data(), row_offsets, 2, small,
                                                small_out.data(), so),
               Error);
}

TEST(FormatsScaleLayouts, Mxfp4RowMajor) {
  const Mxfp4ScaleLayout l{2880, 10};
  EXPECT_EQ(l.cols(), 90);
  EXPECT_EQ(l.offset(0, 0), 0);
  EXPECT_EQ(l.offset(3, 7), 3 * 90 + 7);
  EXPECT_EQ(l.size(), 900);
}

}  // namespace
}  // namespace epcomm
