// The CPU reference encoders and decoders of the quantised token formats (docs/design.md "Token formats"), over
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
#include <string>
#include <vector>

#include "epcomm/formats/codecs.h"
#include "epcomm/formats/scale_layouts.h"

namespace epcomm {
namespace reference {

// max |x[i]| over n values, NaN ignored.
float block_amax(const float* x, int64_t n);

// Blockwise FP8. codes [rows, hidden] e4m3; scales [rows, hidden / 128] fp32; pow2: each scale
// a power of two (Fp8BlockQuant, Config::fp8_pow2_scales). Decoding is the same either way.
void encode_fp8_blockwise(const float* x, int64_t rows, int32_t hidden, uint8_t* codes,
                          float* scales, bool pow2 = false);
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

// ---- grouped quantised outputs (dispatch_formats_reference.cpp) -----------------------------
// A quantised matrix as the grouped GEMM reads it: rows grouped by row_offsets, codes
// row-major, scales in the format's output layout (docs/design.md "Token formats"). Used by the dispatch output
// (dispatch_quantized below) and by the fused SiLU outputs (reference_silu.h).

enum class QuantFormat : int32_t {
  kFp8Blockwise = 0,  // e4m3 codes, fp32 scale per 128, transposed scales, groups padded to 4
  kNvfp4 = 1,         // packed e2m1, e4m3 scale per 16 (global scale gs), swizzled scales
  kMxfp8 = 2,         // e4m3 codes, e8m0 scale per 32, swizzled scales
  kMxfp4 = 3,         // packed e2m1, e8m0 scale per 32 ("even"), row-major scales
};

// The library's TokenFormat of a QuantFormat (its format facts live in token_format.h).
TokenFormat token_format(QuantFormat f);
// The QuantFormat of a quantised TokenFormat; throws Error(kInvalidArgument) for kBF16.
QuantFormat quant_format(TokenFormat f);

// The shapes of one quantised output with room for `rows` rows (row padding included) in
// `groups` groups of `hidden` values per row:
//   codes   [rows, row_bytes()]: row_bytes = hidden (e4m3) or hidden / 2 (two e2m1 per byte,
//           element 2i in the low nibble of byte i)
//   scales  FP8:          fp32, fp8_layout() = Fp8ScaleLayout{hidden, rows} ([hidden/128, rows])
//           NVFP4, MXFP8: bytes, swizzled_layout() = SwizzledScaleLayout::make(hidden, group(),
//                         rows, groups): [(rows + 128 groups) / 128, col_tiles, 32, 4, 4]
//           MXFP4:        bytes, mxfp4_layout() = Mxfp4ScaleLayout{hidden, rows}:
//                         [rows, hidden/32]
//   scales_offsets [groups] for NVFP4 / MXFP8 (swizzled_scales_offsets), none otherwise.
struct QuantOutputShape {
  QuantFormat format;
  int32_t hidden;
  int32_t groups;
  int64_t rows;
  bool fp8_pow2 = false;  // blockwise FP8: power-of-two scales (Config::fp8_pow2_scales)

  int32_t group() const;      // values per scale: 128, 16, 32, 32
  int32_t row_align() const;  // each group's rows padded to a multiple of this: 4 (FP8) or 1
  int64_t row_bytes() const;
  int64_t codes_size() const { return rows * row_bytes(); }
  // The library's layout of these rows (the swizzled formats pad tiles, not rows, so their
  // routed rows are `rows`): the scale layouts below are its, written once.
  DispatchOutputLayout layout() const;
  Fp8ScaleLayout fp8_layout() const { return layout().fp8(); }
  SwizzledScaleLayout swizzled_layout() const { return layout().swizzled(); }
  Mxfp4ScaleLayout mxfp4_layout() const { return layout().mxfp4(); }
  int64_t scales_size() const;  // elements: fp32 for FP8, bytes for the others
  bool swizzled() const { return format == QuantFormat::kNvfp4 || format == QuantFormat::kMxfp8; }
};

// The dispatch output of a format when at most `max_routed_rows` rows arrive (docs/design.md "Dispatch":
// max_tokens_per_rank * n_ranks * min(K, n_local), plus max_tokens_per_rank with the shared
// expert) in `groups` groups. rows is Sizes::max_recv_rows, padding included (docs/design.md design rule 3): for FP8
// Fp8ScaleLayout::max_rows(max_routed_rows, groups) = align_up(max_routed_rows + 3 groups, 4),
// else max_routed_rows (NVFP4 / MXFP8 pad scale tiles, not rows: swizzled_layout() has
// (max_routed_rows + 128 groups) / 128 row tiles). Throws Error(kInvalidArgument) when hidden is
// not a positive multiple of group() or max_routed_rows < 0 or groups < 1.
QuantOutputShape dispatch_output_shape(QuantFormat format, int32_t hidden, int64_t max_routed_rows,
                                       int32_t groups);

// Checks row_offsets ([G + 1], G >= 1, starting at 0, non-decreasing) and returns its rows,
// row_offsets[G]. Throws Error(kInvalidArgument) naming `what` otherwise.
int64_t grouped_rows(const char* what, const std::vector<uint32_t>& row_offsets);

struct QuantizedRows {
  QuantOutputShape shape;
  std::vector<uint8_t> codes;            // [shape.codes_size()]
  std::vector<float> fp8_scales;         // FP8: [shape.scales_size()]; empty otherwise
  std::vector<uint8_t> scales;           // NVFP4 / MXFP8 / MXFP4: [shape.scales_size()]
  std::vector<uint32_t> scales_offsets;  // NVFP4 / MXFP8: [shape.groups]; empty otherwise
};

// Quantises x [row_offsets[G], shape.hidden] (fp32, rows in output order) into `shape`:
//   - row r of x is output row r; rows past row_offsets[G] stay zero (codes and scales);
//   - every scale block is encoded by the row encoders above (the block quantisers of
//     codecs.h); NVFP4 rows of group g use global_scales[g] (G entries, each positive and
//     finite; ignored by the other formats);
//   - a padding row (src_info != nullptr and src_info[r].rank < 0) is not read: its codes and
//     its scales are zero (FP8: 0.0f, not the 1e-4 floor);
//   - scales are placed by place_fp8_scales / place_swizzled_scales (which also writes
//     scales_offsets and zeroes every unused swizzled slot) or stored row-major (MXFP4).
// Throws Error(kInvalidArgument) for a bad row_offsets, G != shape.groups,
// row_offsets[G] > shape.rows, an FP8 group whose row count is not a multiple of 4 or an FP8
// shape.rows that is not, or a bad global scale.
QuantizedRows quantize_grouped_rows(const QuantOutputShape& shape, const float* x,
                                    const std::vector<uint32_t>& row_offsets,
                                    const std::vector<float>& global_scales,
                                    const SrcInfo* src_info);

// The inverse view: [row_offsets[G], hidden] fp32 values decoded from q, reading every scale
// where the grouped GEMM reads it (Fp8ScaleLayout::offset; SwizzledGroup{row_offsets[g],
// q.scales_offsets[g]}.scale_row; Mxfp4ScaleLayout::offset). Padding rows decode to zero.
std::vector<float> dequantize_grouped_rows(const QuantizedRows& q,
                                           const std::vector<uint32_t>& row_offsets,
                                           const std::vector<float>& global_scales);

// ---- quantised dispatch -------------------------------------------------------------------

struct Problem;  // reference.h

// The dispatch output of rank `rank` in a quantised format: reference::dispatch's rows, in its
// order (group, then source rank, then source token), each encoded as its format says.
//   row_offsets [G + 1]: FP8: each group's count padded to a multiple of 4 (padded_row_offsets);
//               the others: reference::dispatch's row_offsets unchanged.
//   src_info    [row_offsets[G]]: dispatch row i of group g (reference::dispatch row
//               dispatch.row_offsets[g] + i) is output row row_offsets[g] + i with the same
//               src_info; the padding rows [row_offsets[g] + m_g, row_offsets[g + 1]) carry
//               {token -1, rank -1, slot -1}, and their codes and scales are zero.
//   out         codes and scales, shape = dispatch_output_shape(format, hidden,
//               max_routed_rows, G); max_routed_rows < 0 means the rows this rank received.
// global_scale is NVFP4's gs (positive and finite; ignored by the other formats); fp8_pow2 is
// blockwise FP8's power-of-two scales (Config::fp8_pow2_scales; ignored by the others). Throws
// Error(kInvalidArgument) when the rank receives more than max_routed_rows rows or the hidden
// size does not suit the format.
struct QuantizedDispatchView;  // below
struct QuantDispatchResult {
  std::vector<uint32_t> row_offsets;
  std::vector<int32_t> expert_ids;  // [G], expert_ids[g] = g
  std::vector<SrcInfo> src_info;
  QuantizedRows out;
  int64_t rows() const { return int64_t(src_info.size()); }  // row_offsets[G]
  // Its vectors as a view (below): rows and row_bytes from out.shape, scales_bytes and
  // num_scales_offsets from the vectors' sizes. Throws Error(kInvalidArgument) when
  // row_offsets, expert_ids do not have out.shape.groups (+ 1) entries, or src_info or codes
  // hold fewer rows than the view says.
  QuantizedDispatchView view() const;
};
QuantDispatchResult dispatch_quantized(const Problem& p, int32_t rank, QuantFormat format,
                                       float global_scale, int64_t max_routed_rows = -1,
                                       bool fp8_pow2 = false);

// A quantised dispatch output in host memory (e.g. downloaded from a GPU): the caller's
// pointers and the sizes of the buffers they were copied from. Of src_info and codes only the
// rows in use, n = min(row_offsets[groups], rows), need to be there.
struct QuantizedDispatchView {
  int32_t groups;                  // G
  int64_t rows;                    // the output's rows (Sizes::max_recv_rows)
  int64_t row_bytes;               // bytes of one row of codes (Sizes::token_bytes)
  int64_t scales_bytes;            // bytes of `scales` (Sizes::scales_bytes)
  int32_t num_scales_offsets;      // entries of scales_offsets (Sizes::num_scales_offsets)
  const uint32_t* row_offsets;     // [groups + 1]
  const int32_t* expert_ids;       // [groups]
  const SrcInfo* src_info;         // [n]
  const uint8_t* codes;            // [n, row_bytes]
  const void* scales;              // [scales_bytes]: fp32 for blockwise FP8, else e4m3 / e8m0
  const uint32_t* scales_offsets;  // [num_scales_offsets]
};

// Compares a quantised dispatch output with the reference (dispatch_quantized, or any
// QuantDispatchResult whose codes hold at least rows [0, row_offsets[G])) bit for bit. Returns ""
// when they agree, else the first mismatch, naming the array, the index and both values and,
// for a row, its group and source (rank, token, slot) or that it is padding; for a swizzled
// scale byte its 5-d index, scale row and column, and what the slot holds (a row's scale,
// column padding, an unused slot of a group's last tile, a tile no group uses). In order:
//   - the sizes: groups, rows, row_bytes, scales_bytes, num_scales_offsets against ref.out.shape
//     (nothing else is read when they differ);
//   - row_offsets [G + 1], expert_ids [G], then src_info of rows [0, row_offsets[G])
//     (padding rows {-1, -1, -1}) exactly;
//   - the codes of rows [0, row_offsets[G]) (rows past them are never read);
//   - scales: blockwise FP8, scale k of every row r < row_offsets[G] (at k * rows + r);
//     NVFP4 / MXFP8, scales_offsets [G], then the whole swizzled array (unused slots are zero);
//     MXFP4, the row-major scales of rows [0, row_offsets[G]).
// Throws Error(kInvalidArgument) when ref itself does not fit its shape.
std::string compare_dispatch_quantized(const QuantDispatchResult& ref,
                                       const QuantizedDispatchView& got);

}  // namespace reference
}  // namespace epcomm
