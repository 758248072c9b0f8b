// Where the dispatch output's scales live, per format (docs/design.md "Token formats"): small value types shared by the
// kernels, the CPU reference and the tests (tests/cpu/test_formats.cpp works them through on
// small examples). Host and device.
//
//   blockwise FP8  fp32, transposed [H/128, ld]; groups' rows padded to a multiple of 4
//   NVFP4, MXFP8   e4m3 / e8m0, the 128x4 tiled ("swizzled") layout; each group starts a tile
//   MXFP4          e8m0, row-major [max_recv_rows, H/32]
#pragma once

#include <cstdint>

#include "epcomm/layout.h"  // EPCOMM_HD, align_up
#include "epcomm/token_format.h"

namespace epcomm {

// row_offsets[0..groups] from the groups' raw row counts, each group's rows padded up to a
// multiple of `align` (4 for blockwise FP8, 1 for the others): row_offsets[g+1] - row_offsets[g]
// = align_up(counts[g], align).
EPCOMM_HD void padded_row_offsets(const int32_t* counts, int32_t groups, int32_t align,
                                  uint32_t* row_offsets) {
  uint32_t total = 0;
  row_offsets[0] = 0;
  for (int32_t g = 0; g < groups; ++g) {
    total += uint32_t(align_up(counts[g], align));
    row_offsets[g + 1] = total;
  }
}

// ---- blockwise FP8 --------------------------------------------------------------------------
// Scale k (values [128k, 128k+128)) of output row r at k * ld + r: the scales of one K block are
// a contiguous column over all rows, which is how the grouped GEMM reads them. Each group's row
// count is padded to a multiple of 4 (4 fp32 = 16 bytes) and row_offsets include the padding, so
// with ld a multiple of 4 too, every group's piece of every column starts 16-byte aligned.
struct Fp8ScaleLayout {
  static constexpr int32_t kGroup = 128;  // values per scale
  static constexpr int32_t kRowAlign = 4;

  int32_t hidden;  // H, a multiple of kGroup
  int64_t ld;      // the output's rows (max_recv_rows), a multiple of kRowAlign

  EPCOMM_HD int32_t cols() const { return hidden / kGroup; }
  EPCOMM_HD int64_t offset(int64_t row, int32_t col) const { return int64_t(col) * ld + row; }
  EPCOMM_HD int64_t size() const { return int64_t(cols()) * ld; }

  EPCOMM_HD static int64_t padded_rows(int64_t rows) { return align_up(rows, kRowAlign); }
  // The output rows needed when at most `routed_rows` rows arrive, spread over `groups` groups:
  // padding adds at most kRowAlign - 1 rows per group (docs/design.md design rule 3). A multiple of kRowAlign.
  EPCOMM_HD static int64_t max_rows(int64_t routed_rows, int32_t groups) {
    return align_up(routed_rows + int64_t(kRowAlign - 1) * groups, kRowAlign);
  }
};

// DeepEP's UE8M0 scale words in the padded per-expert layout (Config::fp8_ue8m0_scales): word q
// of a row holds the biased exponents of its power-of-two scales 4q .. 4q + 3 (scale 4q in the
// lowest byte: Fp8BlockQuant::ue8m0_word), and word q of slot j of a group sits at
// q * capacity + j within the group's block of size() words ([G, H / 512, capacity] int32).
struct Ue8m0ScaleLayout {
  static constexpr int32_t kValuesPerWord = 4 * Fp8ScaleLayout::kGroup;  // 512

  int32_t hidden;    // H, a multiple of kValuesPerWord
  int64_t capacity;  // slots a group

  EPCOMM_HD int32_t cols() const { return hidden / kValuesPerWord; }
  EPCOMM_HD int64_t offset(int64_t slot, int32_t word) const {
    return int64_t(word) * capacity + slot;
  }
  EPCOMM_HD int64_t size() const { return int64_t(cols()) * capacity; }
};

// ---- the 128x4 swizzled layout (NVFP4, MXFP8) ----------------------------------------------
// A scale is addressed by (row, col): `col` is the scale column — scale `col` of a row covers
// its values [col * group, (col + 1) * group), group = 16 for NVFP4 and 32 for MXFP8. Rows are
// cut into tiles of 128 and columns into tiles of 4; one tile is 512 bytes shaped [32][4][4]. The
// whole array is [row_tiles, col_tiles, 32, 4, 4] and (row, col) sits at
//   [row / 128, col / 4, row % 32, (row % 128) / 32, col % 4].
// For NVFP4 (H a multiple of 64) col_tiles = H / 64. For MXFP8 col_tiles = ceil(H / 128): when
// H / 32 is not a multiple of 4 the last tile's missing columns are padding, and stay zero.
struct SwizzledScaleLayout {
  static constexpr int32_t kTileRows = 128;
  static constexpr int32_t kTileCols = 4;
  static constexpr int32_t kSubRows = 32;
  static constexpr int32_t kTileElems = kTileRows * kTileCols;  // 512

  int32_t scale_cols;  // scales per row: H / group
  int64_t row_tiles;   // 128-row tiles in the array

  // The array of a dispatch output with room for `routed_rows` routed rows
  // (Sizes::max_routed_rows; the swizzled formats pad no rows) in `groups` groups, each group
  // starting a fresh tile: at most sum ceil(m_g / 128) <= (routed_rows + 127 G) / 128 tiles,
  // so docs/design.md's (routed_rows + G * 128) / 128 is enough.
  EPCOMM_HD static int64_t row_tiles_for(int64_t routed_rows, int32_t groups) {
    return (routed_rows + int64_t(groups) * kTileRows) / kTileRows;
  }
  EPCOMM_HD static SwizzledScaleLayout make(int32_t hidden, int32_t group, int64_t routed_rows,
                                            int32_t groups) {
    return SwizzledScaleLayout{hidden / group, row_tiles_for(routed_rows, groups)};
  }

  EPCOMM_HD int32_t col_tiles() const { return (scale_cols + kTileCols - 1) / kTileCols; }

  struct Index {  // the 5-d index [tile_row, tile_col, row % 32, (row % 128) / 32, col % 4]
    int64_t tile_row;
    int32_t tile_col;
    int32_t sub_row;    // row % 32
    int32_t sub_block;  // (row % 128) / 32
    int32_t sub_col;    // col % 4
  };
  EPCOMM_HD static Index index(int64_t row, int32_t col) {
    return Index{row / kTileRows, col / kTileCols, int32_t(row % kSubRows),
                 int32_t((row % kTileRows) / kSubRows), col % kTileCols};
  }
  // Row-major linearisation of index() over [row_tiles, col_tiles, 32, 4, 4].
  EPCOMM_HD int64_t offset(int64_t row, int32_t col) const {
    const Index i = index(row, col);
    return ((i.tile_row * col_tiles() + i.tile_col) * kSubRows + i.sub_row) * 16 +
           i.sub_block * kTileCols + i.sub_col;
  }
  // Offset of a tile's first byte (its [0, 0, 0] element).
  EPCOMM_HD int64_t tile_offset(int64_t tile_row, int32_t tile_col) const {
    return (tile_row * col_tiles() + tile_col) * kTileElems;
  }
  EPCOMM_HD int64_t size() const { return row_tiles * col_tiles() * kTileElems; }
};

// Groups in the swizzled layout. Group g's scale rows start at tile
//   tile_start[g] = sum over h < g of ceil(m_h / 128),   m_h = row_offsets[h+1] - row_offsets[h]
// (rows themselves are not padded). The grouped GEMM is handed
//   scales_offsets[g] = tile_start[g] - row_offsets[g] / 128      (>= 0)
// because it finds the scale tile of its t-th 128-row tile of group g, which starts at output row
// row_offsets[g] + 128 t, as (row_offsets[g] + 128 t) / 128 + scales_offsets[g] = tile_start[g]+t.
// Slots of a group's last tile past its m_g rows are zero.
EPCOMM_HD void swizzled_scales_offsets(const uint32_t* row_offsets, int32_t groups,
                                       uint32_t* scales_offsets) {
  uint32_t tile_start = 0;
  for (int32_t g = 0; g < groups; ++g) {
    const uint32_t rows = row_offsets[g + 1] - row_offsets[g];
    scales_offsets[g] = tile_start - row_offsets[g] / SwizzledScaleLayout::kTileRows;
    tile_start += (rows + SwizzledScaleLayout::kTileRows - 1) / SwizzledScaleLayout::kTileRows;
  }
}

// One group's place in the swizzled layout, from its row_offsets[g] and scales_offsets[g].
struct SwizzledGroup {
  uint32_t row_offset;     // row_offsets[g]
  uint32_t scales_offset;  // scales_offsets[g]

  EPCOMM_HD int64_t tile_start() const {
    return int64_t(row_offset / SwizzledScaleLayout::kTileRows) + scales_offset;
  }
  // The scale row (the `row` of SwizzledScaleLayout::offset) of output row `row` of this group.
  EPCOMM_HD int64_t scale_row(int64_t row) const {
    return tile_start() * SwizzledScaleLayout::kTileRows + (row - row_offset);
  }
};

// ---- MXFP4 ----------------------------------------------------------------------------------
// e8m0 scales row-major [rows, H/32]: scale c of output row r at r * cols + c.
struct Mxfp4ScaleLayout {
  static constexpr int32_t kGroup = 32;

  int32_t hidden;  // H, a multiple of kGroup
  int64_t rows;    // max_recv_rows

  EPCOMM_HD int32_t cols() const { return hidden / kGroup; }
  EPCOMM_HD int64_t offset(int64_t row, int32_t col) const { return row * cols() + col; }
  EPCOMM_HD int64_t size() const { return rows * cols(); }
};

// ---- the dispatch output of a format --------------------------------------------------------
// Rows, codes and scales of a dispatch output with room for `routed_rows` routed rows in `groups`
// groups: rows adds blockwise FP8's per-group padding (Fp8ScaleLayout::max_rows); the swizzled
// layouts pad scale tiles, not rows. The kernels, Sizes and the tests all size from this.
struct DispatchOutputLayout {
  TokenFormat format;
  int32_t hidden;
  int32_t groups;
  int64_t routed_rows;  // Sizes::max_routed_rows
  int64_t rows;         // Sizes::max_recv_rows: routed_rows and the format's padding rows; the
                        // rows of src_info (packed in either mode)
  // Config::padded_capacity: 0, the tokens and scales are packed like the rows; C > 0, they sit
  // in the padded per-expert layout, slot j of group g for row row_offsets[g] + j, and no group
  // has format padding rows (bf16 and blockwise FP8 only).
  int64_t capacity;
  bool ue8m0;  // Config::fp8_ue8m0_scales (with capacity): UE8M0 words, not fp32 scales

  EPCOMM_HD static DispatchOutputLayout make(TokenFormat f, int32_t hidden, int64_t routed_rows,
                                             int32_t groups, int64_t capacity = 0,
                                             bool ue8m0 = false) {
    const int64_t rows = f == TokenFormat::kFp8Blockwise && capacity == 0
                             ? Fp8ScaleLayout::max_rows(routed_rows, groups)
                             : routed_rows;
    return DispatchOutputLayout{f, hidden, groups, routed_rows, rows, capacity, ue8m0};
  }
  EPCOMM_HD int64_t row_bytes() const { return format_row_bytes(format, hidden); }
  // The tokens output's bytes: [rows, row] packed, [groups, C, row] padded.
  EPCOMM_HD int64_t tokens_bytes() const {
    return (capacity > 0 ? int64_t(groups) * capacity : rows) * row_bytes();
  }
  // Blockwise FP8's fp32 scales. Packed: [H/128, rows], scale k of row r at offset(r, k).
  // Padded: group g's block [H/128, C] at g * fp8().size(), slot j's scale k at offset(j, k)
  // in it.
  EPCOMM_HD Fp8ScaleLayout fp8() const {
    return Fp8ScaleLayout{hidden, capacity > 0 ? capacity : rows};
  }
  EPCOMM_HD Ue8m0ScaleLayout ue8m0_words() const { return Ue8m0ScaleLayout{hidden, capacity}; }
  EPCOMM_HD SwizzledScaleLayout swizzled() const {
    return SwizzledScaleLayout::make(hidden, format_scale_group(format), routed_rows, groups);
  }
  EPCOMM_HD Mxfp4ScaleLayout mxfp4() const { return Mxfp4ScaleLayout{hidden, rows}; }
  EPCOMM_HD int64_t scales_bytes() const {
    switch (format) {
      case TokenFormat::kFp8Blockwise:
        if (capacity == 0) return fp8().size() * 4;
        return groups * (ue8m0 ? ue8m0_words().size() : fp8().size()) * 4;
      case TokenFormat::kNvfp4:
      case TokenFormat::kMxfp8: return swizzled().size();
      case TokenFormat::kMxfp4: return mxfp4().size();
      default: return 0;
    }
  }
};

}  // namespace epcomm
