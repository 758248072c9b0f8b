// The CPU reference encoders and decoders of the quantised token formats (SPEC §5), over
// [rows, hidden] fp32 matrices (bf16 tokens widen to fp32 exactly), and the error bound of each
// format's quantise -> dequantise. The GPU path must match the encoders bit for bit on codes and
// scales; both are built on the block quantisers of codecs.h. Host only.
//
// Scales come out per row in message order ([rows, hidden / group], row-major); the place_*
// functions put them into the dispatch output's layouts (scale_layouts.h); MXFP4's output layout
// is that row-major order already. A block's amax is
// max |x| over its values, NaN ignored (abs_max). Every function throws Error(kInvalidArgument)
// when hidden is not a positive multiple of the format's group or a global scale is not a
// positive finite number.
#pragma once

#include <cstdint>

#include "epcomm/formats/codecs.h"
#include "epcomm/formats/scale_layouts.h"

namespace epcomm {
namespace reference {

// max |x[i]| over n values, NaN ignored.
float block_amax(const float* x, int64_t n);

// Blockwise FP8. codes [rows, hidden] e4m3; scales [rows, hidden / 128] fp32.
void encode_fp8_blockwise(const float* x, int64_t rows, int32_t hidden, uint8_t* codes,
                          float* scales);
void decode_fp8_blockwise(const uint8_t* codes, const float* scales, int64_t rows, int32_t hidden,
                          float* out);

// NVFP4. packed [rows, hidden / 2] (element 2i in the low nibble of byte i); scales
// [rows, hidden / 16] e4m3 codes; global_scale is gs.
void encode_nvfp4(const float* x, int64_t rows, int32_t hidden, float global_scale, uint8_t* packed,
                  uint8_t* scales);
void decode_nvfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int32_t hidden,
                  float global_scale, float* out);

// MXFP8. codes [rows, hidden] e4m3; scales [rows, hidden / 32] e8m0.
void encode_mxfp8(const float* x, int64_t rows, int32_t hidden, uint8_t* codes, uint8_t* scales);
void decode_mxfp8(const uint8_t* codes, const uint8_t* scales, int64_t rows, int32_t hidden,
                  float* out);

// MXFP4. packed [rows, hidden / 2]; scales [rows, hidden / 32] e8m0 ("even" rounding).
void encode_mxfp4(const float* x, int64_t rows, int32_t hidden, uint8_t* packed, uint8_t* scales);
void decode_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int32_t hidden,
                  float* out);

// The largest |x - decode(encode(x))| any value of a block with this amax can see (plus
// amax * 2^-20 for the fp32 roundings around the element rounding). Infinity for a non-finite
// amax. It is the half-spacing of the element format at the block's largest scaled value,
// plus any saturation, times the scale; for NVFP4 it is amax when the block's scale is 0.
double fp8_blockwise_error_bound(float amax);
double nvfp4_error_bound(float amax, float global_scale);
double mxfp8_error_bound(float amax);
double mxfp4_error_bound(float amax);

// Blockwise FP8 output scales: row r's scales (row_scales[r * cols + k]) go to
// out[layout.offset(r, k)] for r in [0, rows). `rows` counts the padding rows too (row_offsets[G]),
// whose scales the caller supplies (zero).
void place_fp8_scales(const float* row_scales, int64_t rows, const Fp8ScaleLayout& layout,
                      float* out);

// NVFP4 / MXFP8 output scales: row_scales is [row_offsets[groups], layout.scale_cols] in
// dispatch-row order; row r of group g goes to scale row SwizzledGroup::scale_row(r). Writes all
// layout.size() bytes of `out` (zero where no scale lands) and scales_offsets[groups].
// Throws Error(kInvalidArgument) if the groups need more tiles than layout.row_tiles.
void place_swizzled_scales(const uint8_t* row_scales, const uint32_t* row_offsets, int32_t groups,
                           const SwizzledScaleLayout& layout, uint8_t* out,
                           uint32_t* scales_offsets);

}  // namespace reference
}  // namespace epcomm
