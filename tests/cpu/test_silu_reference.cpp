// The CPU reference of the fused SiLU / SwiGLU kernels: hand-worked rows, then random rows with
// large magnitudes and zero blocks checked against a float64 evaluation through each output
// format's error bound, the scale layouts and the padding rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "epcomm/bf16.h"
#include "epcomm/error.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/formats/reference_silu.h"
#include "epcomm/reference.h"

namespace epcomm {
namespace {

using reference::GateUpLayout;
using reference::QuantizedRows;

// ---- float64 models -------------------------------------------------------------------------

double silu64(double g, double u) {
  return g / (1.0 + std::exp(-g)) * u;
}
double swiglu64(double g, double u, SwigluClamp c) {
  const double L = c.limit;
  g = std::fmin(g, L);
  u = std::fmax(-L, std::fmin(u, L));
  return (u + 1.0) * g / (1.0 + std::exp(-double(c.alpha) * g));
}

// How far the fp32 z may be from the float64 one: a few ulps (expf, the add, the division, the
// products) and, where the fp32 sigmoid underflows to 0 (gate below about -88), the tiny true
// value it drops, which is below 2^-115 times |up| + 1.
double compute_tolerance(double z64, double up) {
  return std::ldexp(std::fabs(z64), -20) + std::ldexp(std::fabs(up) + 1.0, -115);
}

// ---- inputs ---------------------------------------------------------------------------------

// A SiLU input [rows, 2 * inter] (split layout) with gate and up given per element.
struct GateUp {
  int64_t rows;
  int32_t inter;
  std::vector<float> gate, up;  // [rows, inter], bf16 values

  std::vector<uint16_t> split() const {
    std::vector<uint16_t> in(size_t(rows * 2 * inter));
    for (int64_t r = 0; r < rows; ++r) {
      for (int32_t j = 0; j < inter; ++j) {
        in[size_t(r * 2 * inter + j)] = float_to_bf16(gate[size_t(r * inter + j)]);
        in[size_t(r * 2 * inter + inter + j)] = float_to_bf16(up[size_t(r * inter + j)]);
      }
    }
    return in;
  }
  std::vector<uint16_t> interleaved() const {
    std::vector<uint16_t> in(size_t(rows * 2 * inter));
    for (int64_t i = 0; i < rows * inter; ++i) {
      in[size_t(2 * i)] = float_to_bf16(gate[size_t(i)]);
      in[size_t(2 * i + 1)] = float_to_bf16(up[size_t(i)]);
    }
    return in;
  }
};

GateUp zeros(int64_t rows, int32_t inter) {
  const size_t n = size_t(rows * inter);
  return GateUp{rows, inter, std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)};
}

// Random rows in blocks of `block` elements, the kind of each block chosen at random: gate and up
// both zero (z = +0), gate in N(0, 3) with up up to ~1e5 in magnitude, large gates (|g| up to
// 1e3, silu saturating to g or to -0), gates around -88 where the fp32 sigmoid underflows, tiny
// values, or a single spike. Values are rounded to bf16 as stored.
GateUp random_gate_up(int64_t rows, int32_t inter, int32_t block, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_real_distribution<double> decade(-3.0, 5.0);
  GateUp x = zeros(rows, inter);
  for (int64_t b = 0; b < rows * inter / block; ++b) {
    const int kind = int(gen() % 7);
    const float mag = float(std::pow(10.0, decade(gen)));
    for (int32_t i = 0; i < block; ++i) {
      float g = 0.0f, u = 0.0f;
      switch (kind) {
        case 0:  // zero block
          break;
        case 1:
          g = 3.0f * normal(gen);
          u = mag * normal(gen);
          break;
        case 2:
          g = 1e3f * uni(gen);
          u = mag * uni(gen);
          break;
        case 3:
          g = -88.0f + 4.0f * uni(gen);
          u = 1e4f * uni(gen);
          break;
        case 4:
          g = 1e-3f * normal(gen);
          u = 1e-3f * normal(gen);
          break;
        case 5:
          g = i == block / 2 ? 30.0f : 0.0f;
          u = i == block / 2 ? -1e5f : 0.0f;
          break;
        default:
          g = 6.0f * uni(gen);
          u = 6.0f * uni(gen);
          break;
      }
      const size_t k = size_t(b * block + i);
      x.gate[k] = bf16_to_float(float_to_bf16(g));
      x.up[k] = bf16_to_float(float_to_bf16(u));
    }
  }
  return x;
}

std::vector<uint32_t> offsets_of(const std::vector<uint32_t>& counts) {
  std::vector<uint32_t> off(1, 0);
  for (uint32_t c : counts)
    off.push_back(off.back() + c);
  return off;
}

// Checks a format's decoded values against the float64 model: for each block of `group` values
// of row r (fp32 amax of the kernel's z), |decoded - z64| <= bound(amax, r) + compute_tolerance.
// Returns the largest |decoded - z32| / bound seen (how tight the bound is).
double expect_within_bound(const GateUp& x, const std::vector<float>& z32,
                           const std::vector<float>& decoded, int32_t group,
                           const std::function<double(float, int64_t)>& bound_of,
                           const std::function<double(double, double)>& model, const char* what) {
  double worst = 0.0;
  size_t bad = 0;
  std::string first;
  const int32_t inter = x.inter;
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int32_t b = 0; b < inter / group; ++b) {
      const size_t base = size_t(r * inter + b * group);
      const double bound = bound_of(reference::block_amax(&z32[base], group), r);
      for (int32_t i = 0; i < group; ++i) {
        const size_t k = base + size_t(i);
        const double z64 = model(x.gate[k], x.up[k]);
        const double err = std::fabs(double(decoded[k]) - z64);
        if (!(err <= bound + compute_tolerance(z64, x.up[k])) && bad++ == 0) {
          first = "row " + std::to_string(r) + " col " + std::to_string(b * group + i) + ": g " +
                  std::to_string(x.gate[k]) + " u " + std::to_string(x.up[k]) + " z64 " +
                  std::to_string(z64) + " decoded " + std::to_string(decoded[k]) + " bound " +
                  std::to_string(bound);
        }
        if (bound > 0) worst = std::fmax(worst, std::fabs(double(decoded[k]) - z32[k]) / bound);
      }
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": first " << first;
  return worst;
}

// ---- the pointwise activation ---------------------------------------------------------------

TEST(SiluReference, HandWorkedRowBf16) {
  // One row, I = 128. Values worked by hand in fp32, then rounded to bf16:
  //   silu(1) * 1   = 1 / (1 + e^-1)      = 0.7310586  -> 0x3f3b (0.73046875)
  //   silu(-1) * 1  = -1 / (1 + e)        = -0.2689414 -> 0xbe8a (-0.26953125)
  //   silu(2) * -2  = -2 * 1.7615942      = -3.523188  -> 0xc061 (-3.515625)
  //   silu(0) * 5   = 0 / 2 * 5           = +0         -> 0x0000
  //   silu(64) * .5 = e^-64 vanishes next to 1 in fp32: 64 * 0.5 = 32 -> 0x4200
  //   silu(-100) * 3: e^100 overflows fp32 to inf, -100 / inf = -0, times 3 = -0 -> 0x8000
  GateUp x = zeros(1, 128);
  const float cases[6][2] = {{1, 1}, {-1, 1}, {2, -2}, {0, 5}, {64, 0.5f}, {-100, 3}};
  for (int j = 0; j < 6; ++j) {
    x.gate[size_t(j)] = cases[j][0];
    x.up[size_t(j)] = cases[j][1];
  }
  const std::vector<uint32_t> offsets = {0, 1};
  const std::vector<uint16_t> out = reference::silu_bf16(x.split(), 128, offsets);
  ASSERT_EQ(out.size(), 128u);
  const uint16_t want[6] = {0x3f3b, 0xbe8a, 0xc061, 0x0000, 0x4200, 0x8000};
  for (int j = 0; j < 6; ++j)
    EXPECT_EQ(out[size_t(j)], want[j]) << "element " << j;
  for (int j = 6; j < 128; ++j)
    EXPECT_EQ(out[size_t(j)], 0x0000) << "element " << j;  // silu(0) * 0 = +0

  const std::vector<float> z = reference::silu_values(x.split(), 128, offsets);
  EXPECT_EQ(z[4], 32.0f);
  EXPECT_TRUE(z[5] == 0.0f && std::signbit(z[5]));
  for (int j = 0; j < 3; ++j)
    EXPECT_NEAR(z[size_t(j)], silu64(cases[j][0], cases[j][1]), 2e-7) << j;
  // The pinned order: s = g / (1 + expf(-g)), z = s * u, each rounded in fp32 (volatile: the
  // library's expf at run time, not the compiler's at build time).
  volatile float two = 2.0f;
  const float s = two / (1.0f + std::exp(-two));
  EXPECT_EQ(z[2], s * -2.0f);
}

// The fp32 operations and their order are part of the contract (the kernels follow them), so
// the test evaluates them independently and searches for inputs where another order of the same
// operations rounds differently, so that a change of order cannot pass unnoticed.
TEST(SiluReference, OrderOfOperationsIsPinned) {
  const GateUp x = random_gate_up(16, 1024, 32, 21);
  const std::vector<uint32_t> offsets = {0, 16};
  const std::vector<float> z = reference::silu_values(x.split(), 1024, offsets);
  const SwigluClamp c{7.0f, 1.702f};
  const std::vector<float> zc =
      reference::silu_values(x.split(), 1024, offsets, GateUpLayout::kSplit, &c);
  size_t silu_told_apart = 0, swiglu_told_apart = 0;
  for (size_t k = 0; k < z.size(); ++k) {
    const float g = x.gate[k], u = x.up[k];
    // silu: e = expf(-g); d = 1 + e; s = g / d; z = s * u.
    const float d = 1.0f + std::exp(-g);
    const float pinned = (g / d) * u;
    ASSERT_EQ(float_as_bits(z[k]), float_as_bits(pinned)) << "g " << g << " u " << u;
    silu_told_apart +=
        pinned != g * (u / d) || pinned != (g * u) / d || pinned != g * (1.0f / d) * u;
    // clamped SwiGLU: a = alpha * g'; sig = 1 / (1 + expf(-a)); z = ((u' + 1) * g') * sig.
    const float gc = std::fmin(g, c.limit), uc = std::fmax(-c.limit, std::fmin(u, c.limit));
    const float sig = 1.0f / (1.0f + std::exp(-(c.alpha * gc)));
    const float pinned_c = ((uc + 1.0f) * gc) * sig;
    ASSERT_EQ(float_as_bits(zc[k]), float_as_bits(pinned_c)) << "g " << g << " u " << u;
    swiglu_told_apart += pinned_c != (uc + 1.0f) * (gc * sig) ||
                         pinned_c != (gc / (1.0f + std::exp(-(c.alpha * gc)))) * (uc + 1.0f);
  }
  EXPECT_GT(silu_told_apart, 100u);
  EXPECT_GT(swiglu_told_apart, 100u);
}

TEST(SiluReference, ValuesMatchFloat64OnLargeMagnitudes) {
  const GateUp x = random_gate_up(64, 256, 32, 1);
  const std::vector<uint32_t> offsets = offsets_of({20, 0, 44});
  const std::vector<float> z = reference::silu_values(x.split(), 256, offsets);
  ASSERT_EQ(z.size(), x.gate.size());
  size_t bad = 0, underflows = 0, saturated = 0;
  for (size_t k = 0; k < z.size(); ++k) {
    const double z64 = silu64(x.gate[k], x.up[k]);
    bad += !(std::fabs(double(z[k]) - z64) <= compute_tolerance(z64, x.up[k]));
    underflows += x.gate[k] < -88.8f && x.up[k] != 0.0f && z[k] == 0.0f;
    saturated += x.gate[k] > 20.0f && z[k] == x.gate[k] * x.up[k];
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_GT(underflows, 0u) << "the data should reach the fp32 sigmoid's underflow";
  EXPECT_GT(saturated, 0u);
  // The interleaved layout reads the same values.
  const std::vector<float> zi =
      reference::silu_values(x.interleaved(), 256, offsets, GateUpLayout::kInterleaved);
  EXPECT_EQ(zi, z);
  // bf16: z rounded to nearest even.
  const std::vector<uint16_t> out = reference::silu_bf16(x.split(), 256, offsets);
  for (size_t k = 0; k < z.size(); ++k)
    ASSERT_EQ(out[k], float_to_bf16(z[k])) << k;
}

TEST(SiluReference, ClampedSwigluHandWorked) {
  // L = 7, alpha = 4: for g' = 7, alpha g' = 28 and expf(-28) = 6.9e-13 vanishes next to 1, so
  // the sigmoid is exactly 1 and z = (u' + 1) * 7.
  const SwigluClamp c{7.0f, 4.0f};
  EXPECT_EQ(swiglu_clamped(10.0f, -9.0f, c), -42.0f);  // g' = 7, u' = -7
  EXPECT_EQ(swiglu_clamped(10.0f, 100.0f, c), 56.0f);  // u' = 7
  EXPECT_EQ(swiglu_clamped(7.0f, 0.0f, c), 7.0f);
  EXPECT_EQ(swiglu_clamped(10.0f, -1.0f, c), 0.0f);  // u' + 1 = 0
  // The gate is not clamped from below: g = -100 gives alpha g' = -400, expf(400) = inf, the
  // sigmoid 0 and z = (u'+1) * -100 * 0 = -0. Clamped to -7 instead it would be
  // -7 * sigmoid(-28) = -4.8e-12.
  const float low = swiglu_clamped(-100.0f, 0.0f, c);
  EXPECT_TRUE(low == 0.0f && std::signbit(low));
  // g = -3, alpha = 1.702 (gpt-oss): the float64 value within the fp32 ulps.
  const SwigluClamp gpt{7.0f, 1.702f};
  EXPECT_NEAR(swiglu_clamped(-3.0f, 2.0f, gpt), swiglu64(-3.0, 2.0, gpt), 1e-7);
  // The pinned order: t = u' + 1, z = (t * g') * sig, sig = 1 / (1 + expf(-(alpha * g'))).
  volatile float g = 2.5f, u = 1.25f;
  const float sig = 1.0f / (1.0f + std::exp(-(1.702f * g)));
  EXPECT_EQ(swiglu_clamped(g, u, gpt), ((u + 1.0f) * g) * sig);
  // NaN passes the clamps (a comparison, not fminf).
  EXPECT_TRUE(std::isnan(swiglu_clamped(NAN, 1.0f, c)));
  EXPECT_TRUE(std::isnan(swiglu_clamped(1.0f, NAN, c)));
}

// ---- blockwise FP8 --------------------------------------------------------------------------

TEST(SiluReference, Fp8HandWorked) {
  // One group of 4 rows: row 0 real, rows 1..3 padding (as a blockwise FP8 dispatch pads one
  // row); room for 8 rows. I = 256: two scale blocks.
  // Gate 64 makes z = 64 u exactly. Block 0: u = 7, 0.5, -1, 2^-7 -> z = 448, 32, -64, 0.5;
  // amax 448 -> s = 1, codes e4m3(z): 0x7e, 0x60, 0xe8, 0x30. Block 1: z = 0.25 everywhere ->
  // s = 0.25f / 448, every code 448 (0x7e).
  GateUp x = zeros(4, 256);
  const float ups[4] = {7.0f, 0.5f, -1.0f, 0.0078125f};
  for (int j = 0; j < 256; ++j) {
    x.gate[size_t(j)] = 64.0f;
    x.up[size_t(j)] = j < 4 ? ups[j] : (j < 128 ? 0.0f : 0.00390625f);
  }
  for (int64_t r = 1; r < 4; ++r) {  // padding rows hold garbage: never read
    for (int j = 0; j < 256; ++j)
      x.gate[size_t(r * 256 + j)] = x.up[size_t(r * 256 + j)] = 3.0f;
  }
  const std::vector<uint32_t> offsets = {0, 4};
  const std::vector<SrcInfo> src = {{0, 0, 0}, {-1, -1, -1}, {-1, -1, -1}, {-1, -1, -1}};
  const QuantizedRows q = reference::silu_fp8(x.split(), 256, offsets, 8, src.data());
  ASSERT_EQ(q.codes.size(), 8u * 256u);
  ASSERT_EQ(q.fp8_scales.size(), 2u * 8u);  // [I / 128, max_rows]
  const uint8_t want[4] = {0x7e, 0x60, 0xe8, 0x30};
  for (int j = 0; j < 128; ++j)
    EXPECT_EQ(q.codes[size_t(j)], j < 4 ? want[j] : 0x00) << j;
  for (int j = 128; j < 256; ++j)
    EXPECT_EQ(q.codes[size_t(j)], 0x7e) << j;
  for (size_t k = 256; k < q.codes.size(); ++k)
    ASSERT_EQ(q.codes[k], 0) << "padding and unused rows: zero codes, byte " << k;
  // Scale k of row r at k * 8 + r: only row 0's are non-zero.
  const std::vector<float> want_scales = {1.0f,           0, 0, 0, 0, 0, 0, 0,
                                          0.25f / 448.0f, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(q.fp8_scales, want_scales);

  // Without src_info the padding rows are ordinary rows: here their garbage is encoded.
  const QuantizedRows plain = reference::silu_fp8(x.split(), 256, offsets, 8);
  EXPECT_NE(plain.fp8_scales[1], 0.0f);
  EXPECT_NE(plain.codes[256], 0);
  // ... and a zero padding row gives zero codes with the 1e-4 floor scale.
  for (int j = 0; j < 256; ++j)
    x.gate[size_t(256 + j)] = x.up[size_t(256 + j)] = 0.0f;
  const QuantizedRows zero_row = reference::silu_fp8(x.split(), 256, offsets, 8);
  EXPECT_EQ(zero_row.fp8_scales[1], 1e-4f / 448.0f);
  EXPECT_EQ(zero_row.fp8_scales[8 + 1], 1e-4f / 448.0f);
  for (int j = 0; j < 256; ++j)
    EXPECT_EQ(zero_row.codes[size_t(256 + j)], 0) << j;
}

TEST(SiluReference, Fp8RandomWithinBoundAndLaidOut) {
  // Groups of 5, 0, 10 routed rows padded to 8, 0, 12 (row_offsets 0, 8, 8, 20); room for 24.
  const int32_t inter = 384, cols = 3;
  const int64_t max_rows = 24;
  const std::vector<uint32_t> offsets = {0, 8, 8, 20};
  std::vector<SrcInfo> src(20, SrcInfo{-1, -1, -1});
  std::vector<bool> padding(20, true);
  for (int r = 0; r < 5; ++r)
    padding[size_t(r)] = false;
  for (int r = 8; r < 18; ++r)
    padding[size_t(r)] = false;
  for (int r = 0; r < 20; ++r)
    if (!padding[size_t(r)]) src[size_t(r)] = SrcInfo{r, 1, 0};
  GateUp x = random_gate_up(20, inter, 128, 2);
  const std::vector<uint16_t> in = x.split();
  const QuantizedRows q = reference::silu_fp8(in, inter, offsets, max_rows, src.data());
  ASSERT_EQ(q.shape.rows, max_rows);
  ASSERT_EQ(q.fp8_scales.size(), size_t(cols * max_rows));

  const std::vector<float> z = reference::silu_values(in, inter, offsets);
  std::vector<uint8_t> codes(z.size());
  std::vector<float> row_scales(size_t(20 * cols));
  reference::encode_fp8_blockwise(z.data(), 20, inter, codes.data(), row_scales.data());
  int zero_blocks = 0;
  for (int64_t r = 0; r < max_rows; ++r) {
    const bool pad = r >= 20 || padding[size_t(r)];
    for (int32_t k = 0; k < cols; ++k) {
      const float got = q.fp8_scales[size_t(k * max_rows + r)];  // transposed, ld = max_rows
      ASSERT_EQ(got, pad ? 0.0f : row_scales[size_t(r * cols + k)]) << "row " << r << " k " << k;
      if (!pad && reference::block_amax(&z[size_t(r * inter + k * 128)], 128) == 0.0f) {
        ++zero_blocks;
        ASSERT_EQ(got, 1e-4f / 448.0f);
      }
    }
    for (int32_t j = 0; j < inter; ++j) {
      const uint8_t c = q.codes[size_t(r * inter + j)];
      ASSERT_EQ(c, pad ? 0 : codes[size_t(r * inter + j)]) << "row " << r << " col " << j;
    }
  }
  EXPECT_GT(zero_blocks, 0);
  // Each group's piece of every scale column starts 16-byte aligned.
  for (int g = 0; g < 3; ++g)
    EXPECT_EQ(q.shape.fp8_layout().offset(offsets[size_t(g)], 1) * 4 % 16, 0);

  // decode(encode) against the float64 model, padding rows excluded (they decode to zero).
  const std::vector<float> dq = reference::dequantize_grouped_rows(q, offsets, {});
  GateUp real = zeros(15, inter);
  std::vector<float> z_real, dq_real;
  int64_t n = 0;
  for (int64_t r = 0; r < 20; ++r) {
    if (padding[size_t(r)]) {
      for (int32_t j = 0; j < inter; ++j)
        ASSERT_EQ(dq[size_t(r * inter + j)], 0.0f);
      continue;
    }
    for (int32_t j = 0; j < inter; ++j) {
      const size_t from = size_t(r * inter + j), to = size_t(n * inter + j);
      real.gate[to] = x.gate[from];
      real.up[to] = x.up[from];
      z_real.push_back(z[from]);
      dq_real.push_back(dq[from]);
    }
    ++n;
  }
  const double worst = expect_within_bound(
      real, z_real, dq_real, 128,
      [](float amax, int64_t) { return reference::fp8_blockwise_error_bound(amax); }, silu64,
      "fp8");
  EXPECT_GT(worst, 0.3) << "the bound should be tight";
}

TEST(SiluReference, Fp8FollowsAnFp8Dispatch) {
  // The SiLU input rows are the FP8 dispatch's rows, padding included: silu_fp8 with the
  // dispatch's row_offsets, room and src_info gives zero padding rows and scales.
  const reference::Problem p = reference::make_problem(2, 128, 2, 8, {30, 17}, 3);
  const reference::QuantDispatchResult d =
      reference::dispatch_quantized(p, 1, reference::QuantFormat::kFp8Blockwise, 1.0f);
  const int32_t inter = 256;
  GateUp x = random_gate_up(d.rows(), inter, 128, 4);
  int padding_rows = 0;
  for (int64_t r = 0; r < d.rows(); ++r) {
    if (d.src_info[size_t(r)].rank >= 0) continue;
    ++padding_rows;
    for (int32_t j = 0; j < inter; ++j)  // the first GEMM gives zero rows for zero codes
      x.gate[size_t(r * inter + j)] = x.up[size_t(r * inter + j)] = 0.0f;
  }
  ASSERT_GT(padding_rows, 0) << "pick a problem whose groups need padding";
  const QuantizedRows q =
      reference::silu_fp8(x.split(), inter, d.row_offsets, d.out.shape.rows, d.src_info.data());
  const Fp8ScaleLayout layout = q.shape.fp8_layout();
  for (int64_t r = 0; r < d.rows(); ++r) {
    const bool pad = d.src_info[size_t(r)].rank < 0;
    for (int32_t k = 0; k < inter / 128; ++k) {
      const float s = q.fp8_scales[size_t(layout.offset(r, k))];
      if (pad) {
        ASSERT_EQ(s, 0.0f) << r;
      } else {
        ASSERT_GT(s, 0.0f) << r;
      }
    }
  }
  // Groups not padded to 4 rows are refused: rows would have to move.
  EXPECT_THROW(reference::silu_fp8(x.split(), inter, {0, 3, 8}, 12), Error);
  EXPECT_THROW(reference::silu_fp8(x.split(), inter, {0, 4, 8}, 10), Error);  // room not /4
}

// ---- NVFP4 ----------------------------------------------------------------------------------

TEST(SiluReference, Nvfp4HandWorked) {
  // Two groups of one row each, I = 64 (one column tile of 4 scales), global scales 1 and 2.
  // Gate 64: z = 64 u. Block 0 of both rows: z = 6, 1, -0.5, 3, then zeros.
  //   gs 1: sf = e4m3(1 * 6 / 6) = 1 (0x38); codes e2m1(z * 1): 6 -> 7, 1 -> 2, -0.5 -> 9, 3 -> 5
  //   gs 2: sf = e4m3(2 * 6 / 6) = 2 (0x40); codes e2m1(z * 2 / 2): the same.
  // Blocks 1..3 are zero: scale 0, codes 0. Group 1 starts a fresh tile: its row's scales sit in
  // tile 1 (bytes 512..), scales_offsets = {0, 1 - 1 / 128} = {0, 1}.
  GateUp x = zeros(2, 64);
  const float ups[4] = {6.0f / 64, 1.0f / 64, -0.5f / 64, 3.0f / 64};
  for (int r = 0; r < 2; ++r) {
    for (int j = 0; j < 64; ++j) {
      x.gate[size_t(r * 64 + j)] = 64.0f;
      x.up[size_t(r * 64 + j)] = j < 4 ? ups[j] : 0.0f;
    }
  }
  const std::vector<uint32_t> offsets = {0, 1, 2};
  const QuantizedRows q = reference::silu_nvfp4(x.split(), 64, offsets, 2, {1.0f, 2.0f});
  // row_tiles = (2 + 2 * 128) / 128 = 2, one column tile: 2 * 512 bytes.
  ASSERT_EQ(q.scales.size(), 1024u);
  ASSERT_EQ(q.codes.size(), 2u * 32u);
  EXPECT_EQ(q.scales_offsets, (std::vector<uint32_t>{0, 1}));
  for (size_t i = 0; i < q.scales.size(); ++i) {
    const uint8_t want = i == 0 ? 0x38 : (i == 512 ? 0x40 : 0);
    EXPECT_EQ(q.scales[i], want) << "scale byte " << i;
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(q.codes[size_t(r * 32)], 0x27) << r;      // 6 low, 1 high
    EXPECT_EQ(q.codes[size_t(r * 32 + 1)], 0x59) << r;  // -0.5 low, 3 high
    for (int b = 2; b < 32; ++b)
      EXPECT_EQ(q.codes[size_t(r * 32 + b)], 0) << r << " " << b;
  }
  const std::vector<float> dq = reference::dequantize_grouped_rows(q, offsets, {1.0f, 2.0f});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(dq[size_t(r * 64)], 6.0f);
    EXPECT_EQ(dq[size_t(r * 64 + 2)], -0.5f);
    EXPECT_EQ(dq[size_t(r * 64 + 3)], 3.0f);
  }
}

TEST(SiluReference, Nvfp4RandomWithinBoundAndSwizzled) {
  // Groups of 130, 0, 7 rows (two tiles, none, one), room for 140; I = 256 (16 scale columns).
  const int32_t inter = 256, cols = 16;
  const int64_t max_rows = 140;
  const std::vector<uint32_t> offsets = {0, 130, 130, 137};
  const std::vector<float> gs = {1.0f, 0.5f, 448.0f * 6.0f / 2e5f};
  const GateUp x = random_gate_up(137, inter, 16, 5);
  const std::vector<uint16_t> in = x.split();
  const QuantizedRows q = reference::silu_nvfp4(in, inter, offsets, max_rows, gs);
  const SwizzledScaleLayout layout = q.shape.swizzled_layout();
  EXPECT_EQ(layout.row_tiles, (140 + 3 * 128) / 128);
  EXPECT_EQ(layout.col_tiles(), 4);
  // scales_offsets by docs/design.md "Token formats": exclusive prefix of ceil(m / 128) = {0, 2, 2}, minus
  // row_offsets / 128 = {0, 1, 1}.
  EXPECT_EQ(q.scales_offsets, (std::vector<uint32_t>{0, 1, 1}));

  const std::vector<float> z = reference::silu_values(in, inter, offsets);
  const int64_t tile_start[3] = {0, 2, 2};
  std::vector<bool> used(q.scales.size(), false);
  int zero_scale_blocks = 0;
  for (int g = 0; g < 3; ++g) {
    const int64_t begin = offsets[size_t(g)], m = offsets[size_t(g) + 1] - begin;
    std::vector<uint8_t> packed(size_t(m * inter / 2)), row_scales(size_t(m * cols));
    reference::encode_nvfp4(&z[size_t(begin * inter)], m, inter, gs[size_t(g)], packed.data(),
                            row_scales.data());
    for (int64_t i = 0; i < m; ++i) {
      for (int32_t b = 0; b < inter / 2; ++b)
        ASSERT_EQ(q.codes[size_t((begin + i) * inter / 2 + b)], packed[size_t(i * inter / 2 + b)]);
      for (int32_t c = 0; c < cols; ++c) {
        // Scale row tile_start * 128 + i, at [row / 128, col / 4, row % 32, (row % 128) / 32,
        // col % 4] of [row_tiles, 4, 32, 4, 4].
        const int64_t sr = tile_start[g] * 128 + i;
        const int64_t at =
            (((sr / 128) * 4 + c / 4) * 32 + sr % 32) * 16 + (sr % 128) / 32 * 4 + c % 4;
        ASSERT_EQ(q.scales[size_t(at)], row_scales[size_t(i * cols + c)]) << g << " " << i;
        used[size_t(at)] = true;
        zero_scale_blocks += row_scales[size_t(i * cols + c)] == 0;
      }
    }
  }
  EXPECT_GT(zero_scale_blocks, 0);
  for (size_t i = 0; i < q.scales.size(); ++i)
    if (!used[i]) {
      ASSERT_EQ(q.scales[i], 0) << "unused scale slot " << i;
    }
  for (size_t k = size_t(137 * inter / 2); k < q.codes.size(); ++k)
    ASSERT_EQ(q.codes[k], 0);

  // Zero blocks: zero scale and every code +0.
  for (int64_t r = 0; r < 137; ++r) {
    for (int32_t b = 0; b < cols; ++b) {
      if (reference::block_amax(&z[size_t(r * inter + b * 16)], 16) != 0.0f) continue;
      for (int32_t i = 0; i < 8; ++i)
        ASSERT_EQ(q.codes[size_t(r * inter / 2 + b * 8 + i)], 0);
    }
  }

  const std::vector<float> dq = reference::dequantize_grouped_rows(q, offsets, gs);
  auto group_of = [&](int64_t r) { return r < 130 ? 0 : 2; };
  const double worst = expect_within_bound(
      x, z, dq, 16,
      [&](float amax, int64_t r) {
        return reference::nvfp4_error_bound(amax, gs[size_t(group_of(r))]);
      },
      silu64, "nvfp4");
  EXPECT_GT(worst, 0.3) << "the bound should be tight";

  // (d) interleaved input: the same outputs; read as split it is another matrix.
  const QuantizedRows qi = reference::silu_nvfp4(x.interleaved(), inter, offsets, max_rows, gs,
                                                 GateUpLayout::kInterleaved);
  EXPECT_EQ(qi.codes, q.codes);
  EXPECT_EQ(qi.scales, q.scales);
  EXPECT_EQ(qi.scales_offsets, q.scales_offsets);
  const QuantizedRows wrong = reference::silu_nvfp4(x.interleaved(), inter, offsets, max_rows, gs);
  EXPECT_NE(wrong.codes, q.codes);

  EXPECT_THROW(reference::silu_nvfp4(in, inter, offsets, max_rows, {1.0f, 1.0f}), Error);
  EXPECT_THROW(reference::silu_nvfp4(in, inter, offsets, max_rows, {1.0f, 0.0f, 1.0f}), Error);
  EXPECT_THROW(reference::silu_nvfp4(in, inter, offsets, 136, gs), Error);  // no room
}

// ---- MXFP4 ----------------------------------------------------------------------------------

TEST(SiluReference, Mxfp4HandWorked) {
  // I = 32, one row, one block. silu: gate 64, z = 64 u = 6, 1, -0.5, 3: amax 6 = 1.5 * 2^2
  // -> e = 127 (X = 1), codes 7, 2, 9, 5.
  GateUp x = zeros(1, 32);
  const float ups[4] = {6.0f / 64, 1.0f / 64, -0.5f / 64, 3.0f / 64};
  for (int j = 0; j < 32; ++j) {
    x.gate[size_t(j)] = 64.0f;
    x.up[size_t(j)] = j < 4 ? ups[j] : 0.0f;
  }
  const QuantizedRows q = reference::silu_mxfp4(x.split(), 32, {0, 1}, 2);
  ASSERT_EQ(q.scales.size(), 2u);  // [max_rows, I / 32]
  EXPECT_EQ(q.scales[0], 127);
  EXPECT_EQ(q.scales[1], 0);
  EXPECT_EQ(q.codes[0], 0x27);
  EXPECT_EQ(q.codes[1], 0x59);

  // Clamped SwiGLU, L = 7, alpha = 4 (sigmoid of 28 is 1): z = (u' + 1) * 7 for g >= 7.
  //   u = -9 -> -42, 0 -> 7, 5 -> 42, 100 -> 56. amax 56 = 1.75 * 2^5 rounds to 2^6 -> e = 131
  //   (X = 16): -42 / 16 = -2.625 -> -3 (0xd), 7 / 16 = 0.4375 -> 0.5 (1), 2.625 -> 3 (5),
  //   56 / 16 = 3.5 -> 4 (6, the tie goes to the even code).
  // Element 4: g = -100 is not clamped from below: z = -0 (code 8, the sign of zero).
  GateUp y = zeros(1, 32);
  const float gates[5] = {10, 10, 10, 10, -100}, ups2[5] = {-9, 0, 5, 100, 0};
  for (int j = 0; j < 5; ++j) {
    y.gate[size_t(j)] = gates[j];
    y.up[size_t(j)] = ups2[j];
  }
  const SwigluClamp c{7.0f, 4.0f};
  const QuantizedRows qc = reference::silu_mxfp4(y.split(), 32, {0, 1}, 1, &c);
  EXPECT_EQ(qc.scales[0], 131);
  EXPECT_EQ(qc.codes[0], 0x1d);
  EXPECT_EQ(qc.codes[1], 0x65);
  EXPECT_EQ(qc.codes[2], 0x08);
  const std::vector<float> dq = reference::dequantize_grouped_rows(qc, {0, 1}, {});
  EXPECT_EQ(dq[0], -48.0f);
  EXPECT_EQ(dq[3], 64.0f);
}

TEST(SiluReference, Mxfp4RandomWithinBound) {
  const int32_t inter = 320, cols = 10;  // 10 scales per row
  const std::vector<uint32_t> offsets = {0, 33, 33, 50};
  const int64_t max_rows = 64;
  const SwigluClamp gpt{7.0f, 1.702f};
  for (const SwigluClamp* clamp : {static_cast<const SwigluClamp*>(nullptr), &gpt}) {
    const GateUp x = random_gate_up(50, inter, 32, clamp ? 7 : 6);
    const std::vector<uint16_t> in = x.split();
    const QuantizedRows q = reference::silu_mxfp4(in, inter, offsets, max_rows, clamp);
    ASSERT_EQ(q.scales.size(), size_t(max_rows * cols));
    const std::vector<float> z =
        reference::silu_values(in, inter, offsets, GateUpLayout::kSplit, clamp);
    std::vector<uint8_t> packed(z.size() / 2), scales(size_t(50 * cols));
    reference::encode_mxfp4(z.data(), 50, inter, packed.data(), scales.data());
    for (size_t i = 0; i < packed.size(); ++i)
      ASSERT_EQ(q.codes[i], packed[i]) << i;
    for (size_t i = 0; i < q.scales.size(); ++i)  // row-major; rows past 50 zero
      ASSERT_EQ(q.scales[i], i < scales.size() ? scales[i] : 0) << i;
    const std::vector<float> dq = reference::dequantize_grouped_rows(q, offsets, {});
    auto model = [clamp](double g, double u) {
      return clamp ? swiglu64(g, u, *clamp) : silu64(g, u);
    };
    const double worst = expect_within_bound(
        x, z, dq, 32, [](float amax, int64_t) { return reference::mxfp4_error_bound(amax); }, model,
        clamp ? "mxfp4 clamped" : "mxfp4");
    EXPECT_GT(worst, 0.3) << "the bound should be tight";
    if (clamp) {
      // The clamps bind: |z| <= (L + 1) * L everywhere, and some z use a clamped gate or up.
      size_t clamped = 0;
      for (size_t k = 0; k < z.size(); ++k) {
        ASSERT_LE(std::fabs(z[k]), 56.0f);
        clamped += x.gate[k] > 7.0f || std::fabs(x.up[k]) > 7.0f;
      }
      EXPECT_GT(clamped, 0u);
    }
  }
}

TEST(SiluReference, RejectsBadShapes) {
  const GateUp x = zeros(8, 128);
  const std::vector<uint16_t> in = x.split();
  EXPECT_THROW(reference::silu_values(in, 128, {}), Error);
  EXPECT_THROW(reference::silu_values(in, 128, {1, 8}), Error);     // must start at 0
  EXPECT_THROW(reference::silu_values(in, 128, {0, 8, 4}), Error);  // decreasing
  EXPECT_THROW(reference::silu_values(in, 128, {0, 9}), Error);     // input too short
  EXPECT_THROW(reference::silu_values(in, 0, {0, 8}), Error);
  EXPECT_THROW(reference::silu_fp8(in, 64, {0, 4}, 4), Error);  // I not a multiple of 128
  EXPECT_THROW(reference::silu_nvfp4(in, 8, {0, 4}, 4, {1.0f}), Error);
  EXPECT_THROW(reference::silu_mxfp4(in, 48, {0, 4}, 4), Error);
  EXPECT_THROW(reference::silu_mxfp4(in, 128, {0, 8}, 4), Error);  // no room
  const SwigluClamp negative{-1.0f, 1.0f}, inf_alpha{7.0f, INFINITY};
  EXPECT_THROW(reference::silu_mxfp4(in, 128, {0, 8}, 8, &negative), Error);
  EXPECT_THROW(reference::silu_mxfp4(in, 128, {0, 8}, 8, &inf_alpha), Error);
  EXPECT_NO_THROW(reference::silu_mxfp4(in, 128, {0, 8}, 8));
}

}  // namespace
}  // namespace epcomm
