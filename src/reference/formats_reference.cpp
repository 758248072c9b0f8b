// CPU reference encoders/decoders of the quantised token formats: loops over rows and scale
// blocks around the block quantisers of codecs.h, which the kernels use too.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "epcomm/error.h"
#include "epcomm/formats/reference_codecs.h"

namespace epcomm {
namespace reference {
namespace {

void check_hidden(const char* what, int32_t hidden, int32_t group) {
  if (hidden <= 0 || hidden % group != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": hidden " + std::to_string(hidden) +
                    " is not a positive multiple of " + std::to_string(group));
  }
}

void check_global_scale(const char* what, float gs) {
  if (!(gs > 0.0f) || !std::isfinite(gs)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": global scale must be positive and finite, got " +
                    std::to_string(gs));
  }
}

// Encodes a matrix block by block: Quant::from_amax on each block of kGroup values, then one
// code per value. `make` builds the quantiser from the amax; `put` stores one code.
template <typename Quant, typename Make, typename StoreScale, typename Put>
void encode_blocks(const float* x, int64_t rows, int32_t hidden, Make make, StoreScale store_scale,
                   Put put) {
  const int32_t blocks = hidden / Quant::kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t b = 0; b < blocks; ++b) {
      const int64_t base = r * hidden + int64_t(b) * Quant::kGroup;
      const Quant q = make(block_amax(x + base, Quant::kGroup));
      store_scale(r * blocks + b, q);
      for (int32_t i = 0; i < Quant::kGroup; ++i)
        put(base + i, q.encode(x[base + i]));
    }
  }
}

template <typename Quant, typename Make, typename Get>
void decode_blocks(int64_t rows, int32_t hidden, Make make, Get get, float* out) {
  const int32_t blocks = hidden / Quant::kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t b = 0; b < blocks; ++b) {
      const Quant q = make(r * blocks + b);
      const int64_t base = r * hidden + int64_t(b) * Quant::kGroup;
      for (int32_t i = 0; i < Quant::kGroup; ++i)
        out[base + i] = q.decode(get(base + i));
    }
  }
}

// Two e2m1 codes per byte, element 2i low. Values are stored in order, so the even element
// starts the byte and the odd one completes it.
void put_nibble(uint8_t* packed, int64_t i, uint8_t code) {
  uint8_t& byte = packed[i / 2];
  byte = (i % 2 == 0) ? pack_e2m1x2(code, 0) : pack_e2m1x2(e2m1_low(byte), code);
}
uint8_t get_nibble(const uint8_t* packed, int64_t i) {
  return i % 2 == 0 ? e2m1_low(packed[i / 2]) : e2m1_high(packed[i / 2]);
}

// Largest |v - e4m3(v)| over |v| <= y, y in (0, 448]: half the spacing of e4m3 in y's binade
// (2^-10 below the smallest normal).
double e4m3_half_spacing(double y) {
  if (y < 0x1p-6) return 0x1p-10;
  int exp = 0;
  std::frexp(y, &exp);  // y = f * 2^exp, f in [0.5, 1): binade 2^(exp-1)
  return std::ldexp(1.0, exp - 1 - 4);
}

// The same for e2m1 over |v| <= y, y in [0, 6]: spacings 0.5 up to 2, 1 up to 4, 2 up to 6.
double e2m1_half_spacing(double y) {
  return y <= 2.0 ? 0.25 : (y <= 4.0 ? 0.5 : 1.0);
}

// The slack for the fp32 roundings around the element rounding: scaling, dequantising.
double rounding_slack(float amax) {
  return double(amax) * 0x1p-20 + double(std::numeric_limits<float>::denorm_min());
}

}  // namespace

float block_amax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i)
    amax = abs_max(amax, x[i]);
  return amax;
}

// ---- blockwise FP8 --------------------------------------------------------------------------

void encode_fp8_blockwise(const float* x, int64_t rows, int32_t hidden, uint8_t* codes,
                          float* scales, bool pow2) {
  check_hidden("encode_fp8_blockwise", hidden, Fp8BlockQuant::kGroup);
  encode_blocks<Fp8BlockQuant>(
      x, rows, hidden, [&](float amax) { return Fp8BlockQuant::from_amax(amax, pow2); },
      [&](int64_t i, const Fp8BlockQuant& q) { scales[i] = q.scale; },
      [&](int64_t i, uint8_t c) { codes[i] = c; });
}

void decode_fp8_blockwise(const uint8_t* codes, const float* scales, int64_t rows, int32_t hidden,
                          float* out) {
  check_hidden("decode_fp8_blockwise", hidden, Fp8BlockQuant::kGroup);
  decode_blocks<Fp8BlockQuant>(
      rows, hidden, [&](int64_t i) { return Fp8BlockQuant::from_scale(scales[i]); },
      [&](int64_t i) { return codes[i]; }, out);
}

// ---- NVFP4 ----------------------------------------------------------------------------------

void encode_nvfp4(const float* x, int64_t rows, int32_t hidden, float global_scale, uint8_t* packed,
                  uint8_t* scales) {
  check_hidden("encode_nvfp4", hidden, Nvfp4BlockQuant::kGroup);
  check_global_scale("encode_nvfp4", global_scale);
  encode_blocks<Nvfp4BlockQuant>(
      x, rows, hidden, [&](float amax) { return Nvfp4BlockQuant::from_amax(amax, global_scale); },
      [&](int64_t i, const Nvfp4BlockQuant& q) { scales[i] = q.scale_code; },
      [&](int64_t i, uint8_t c) { put_nibble(packed, i, c); });
}

void decode_nvfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int32_t hidden,
                  float global_scale, float* out) {
  check_hidden("decode_nvfp4", hidden, Nvfp4BlockQuant::kGroup);
  check_global_scale("decode_nvfp4", global_scale);
  decode_blocks<Nvfp4BlockQuant>(
      rows, hidden, [&](int64_t i) { return Nvfp4BlockQuant::from_code(scales[i], global_scale); },
      [&](int64_t i) { return get_nibble(packed, i); }, out);
}

// ---- MXFP8 ----------------------------------------------------------------------------------

void encode_mxfp8(const float* x, int64_t rows, int32_t hidden, uint8_t* codes, uint8_t* scales) {
  check_hidden("encode_mxfp8", hidden, Mxfp8BlockQuant::kGroup);
  encode_blocks<Mxfp8BlockQuant>(
      x, rows, hidden, [](float amax) { return Mxfp8BlockQuant::from_amax(amax); },
      [&](int64_t i, const Mxfp8BlockQuant& q) { scales[i] = q.scale_code; },
      [&](int64_t i, uint8_t c) { codes[i] = c; });
}

void decode_mxfp8(const uint8_t* codes, const uint8_t* scales, int64_t rows, int32_t hidden,
                  float* out) {
  check_hidden("decode_mxfp8", hidden, Mxfp8BlockQuant::kGroup);
  decode_blocks<Mxfp8BlockQuant>(
      rows, hidden, [&](int64_t i) { return Mxfp8BlockQuant::from_code(scales[i]); },
      [&](int64_t i) { return codes[i]; }, out);
}

// ---- MXFP4 ----------------------------------------------------------------------------------

void encode_mxfp4(const float* x, int64_t rows, int32_t hidden, uint8_t* packed, uint8_t* scales) {
  check_hidden("encode_mxfp4", hidden, Mxfp4BlockQuant::kGroup);
  encode_blocks<Mxfp4BlockQuant>(
      x, rows, hidden, [](float amax) { return Mxfp4BlockQuant::from_amax(amax); },
      [&](int64_t i, const Mxfp4BlockQuant& q) { scales[i] = q.scale_code; },
      [&](int64_t i, uint8_t c) { put_nibble(packed, i, c); });
}

void decode_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int32_t hidden,
                  float* out) {
  check_hidden("decode_mxfp4", hidden, Mxfp4BlockQuant::kGroup);
  decode_blocks<Mxfp4BlockQuant>(
      rows, hidden, [&](int64_t i) { return Mxfp4BlockQuant::from_code(scales[i]); },
      [&](int64_t i) { return get_nibble(packed, i); }, out);
}

// ---- error bounds ---------------------------------------------------------------------------

double fp8_blockwise_error_bound(float amax) {
  if (!std::isfinite(amax)) return std::numeric_limits<double>::infinity();
  const double s = Fp8BlockQuant::from_amax(amax).scale;
  const double y = double(amax) / s;  // the block's largest scaled magnitude, ~448 or less
  const double element = y > 0.0 ? e4m3_half_spacing(std::fmin(y, 448.0)) : 0.0;
  const double saturation = std::fmax(0.0, y - 448.0);
  return s * (element + saturation) + rounding_slack(amax);
}

double nvfp4_error_bound(float amax, float global_scale) {
  if (!std::isfinite(amax)) return std::numeric_limits<double>::infinity();
  const Nvfp4BlockQuant q = Nvfp4BlockQuant::from_amax(amax, global_scale);
  if (q.scale == 0.0f) return double(amax);  // every code is 0
  // The scale is an e4m3 rounding of gs * amax / 6, so the largest scaled value can exceed 6
  // (by 1/15 for a normal scale, more for a subnormal one) and saturate.
  const double y = double(amax) * double(global_scale) / double(q.scale);
  const double element = e2m1_half_spacing(std::fmin(y, 6.0)) + std::fmax(0.0, y - 6.0);
  return element * double(q.scale) / double(global_scale) + rounding_slack(amax);
}

double mxfp8_error_bound(float amax) {
  if (!std::isfinite(amax)) return std::numeric_limits<double>::infinity();
  const double scale = e8m0_to_float(mxfp8_scale_code(amax));
  const double y = double(amax) / scale;  // <= 448 by construction
  const double element = y > 0.0 ? e4m3_half_spacing(y) : 0.0;
  return scale * element + rounding_slack(amax);
}

double mxfp4_error_bound(float amax) {
  if (!std::isfinite(amax)) return std::numeric_limits<double>::infinity();
  const double scale = e8m0_to_float(mxfp4_scale_code(amax));
  const double y = double(amax) / scale;  // < 7 by construction
  const double element = e2m1_half_spacing(std::fmin(y, 6.0)) + std::fmax(0.0, y - 6.0);
  return scale * element + rounding_slack(amax);
}

// ---- output scale layouts -------------------------------------------------------------------

void place_fp8_scales(const float* row_scales, int64_t rows, const Fp8ScaleLayout& layout,
                      float* out) {
  check_hidden("place_fp8_scales", layout.hidden, Fp8ScaleLayout::kGroup);
  if (rows > layout.ld) {
    throw Error(ErrorCode::kInvalidArgument, "place_fp8_scales: " + std::to_string(rows) +
                                                 " rows exceed ld " + std::to_string(layout.ld));
  }
  const int32_t cols = layout.cols();
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t k = 0; k < cols; ++k)
      out[layout.offset(r, k)] = row_scales[r * cols + k];
  }
}

void place_swizzled_scales(const uint8_t* row_scales, const uint32_t* row_offsets, int32_t groups,
                           const SwizzledScaleLayout& layout, uint8_t* out,
                           uint32_t* scales_offsets) {
  std::memset(out, 0, size_t(layout.size()));
  swizzled_scales_offsets(row_offsets, groups, scales_offsets);
  for (int32_t g = 0; g < groups; ++g) {
    const SwizzledGroup group{row_offsets[g], scales_offsets[g]};
    const int64_t rows = int64_t(row_offsets[g + 1]) - row_offsets[g];
    const int64_t tiles_end = group.tile_start() + (rows + SwizzledScaleLayout::kTileRows - 1) /
                                                       SwizzledScaleLayout::kTileRows;
    if (tiles_end > layout.row_tiles) {
      throw Error(ErrorCode::kInvalidArgument, "place_swizzled_scales: group " + std::to_string(g) +
                                                   " needs " + std::to_string(tiles_end) +
                                                   " row tiles, the layout has " +
                                                   std::to_string(layout.row_tiles));
    }
    for (int64_t r = row_offsets[g]; r < int64_t(row_offsets[g + 1]); ++r) {
      const int64_t scale_row = group.scale_row(r);
      for (int32_t c = 0; c < layout.scale_cols; ++c) {
        out[layout.offset(scale_row, c)] = row_scales[r * layout.scale_cols + c];
      }
    }
  }
}

}  // namespace reference
}  // namespace epcomm
