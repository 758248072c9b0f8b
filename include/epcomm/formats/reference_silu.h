// The CPU reference of each output of the fused SiLU / SwiGLU kernels of docs/design.md "Fused SiLU / SwiGLU", and for checks
// the kernels' z evaluated on the device (the epcomm_reference library). The pointwise
// activation the kernels and this reference share is in silu_math.h.
//
// Rows. The input is the first grouped GEMM's output, one row per dispatch output row: rows
// [row_offsets[g], row_offsets[g + 1]) are group g, row_offsets being the dispatch's (after a
// blockwise FP8 dispatch they include its padding rows). The kernels read the row count,
// row_offsets[G], on the device; rows past it are neither read nor written. Output row r is input
// row r in every variant — rows never move, so the second GEMM's output stays in the dispatch
// order that combine's src_info indexes. Output buffers have room for `max_rows` rows: the
// dispatch output's rows (QuantOutputShape::rows of dispatch_output_shape). The padding rows of
// an FP8 dispatch are ordinary rows to every variant but silu_fp8 given src_info: the first GEMM
// turns their zero codes and scales into zero rows, and gate = up = +0 gives z = +0, which every
// format stores as zero bytes (bf16 0; NVFP4 scale 0; MXFP4 scale code 0, i.e. 2^-127).
//
// Values. gate and up are bf16 (widened to fp32 exactly), z is computed in fp32 by silu_mul or
// swiglu_clamped (silu_math.h), and the quantised outputs encode z itself (not z rounded to bf16).
// Each element's z uses only its own gate and up, so the kernels may split rows among threads
// freely; a scale block's amax is a fold of abs_max over its z values in any order.
//
// expf is the one operation not correctly rounded (silu_math.h says how the host's and the
// device's may differ).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/formats/silu_math.h"
#include "epcomm/layout.h"  // SrcInfo

namespace epcomm {

// ---- the CPU reference of the kernels (host only) -------------------------------------------

namespace reference {

// Where gate and up sit in an input row of 2I bf16 values.
enum class GateUpLayout : int32_t {
  kSplit = 0,        // gate in columns [0, I), up in [I, 2I)
  kInterleaved = 1,  // [g0, u0, g1, u1, ...]: gate j at 2j, up j at 2j + 1
};

// Every function below reads `input` as [rows, 2 * inter] bf16 bit patterns, rows =
// row_offsets[G] (more rows may follow; they are ignored), and throws Error(kInvalidArgument)
// when row_offsets is malformed (grouped_rows), inter is not a positive multiple of the output
// format's group (1 for bf16 / fp32), input holds fewer than rows * 2 * inter values, or a
// clamp has a negative or non-finite limit or a non-finite alpha.

// z for every element: [rows, inter] fp32, row-major. clamp == nullptr: silu_mul; else
// swiglu_clamped with *clamp.
std::vector<float> silu_values(const std::vector<uint16_t>& input, int32_t inter,
                               const std::vector<uint32_t>& row_offsets,
                               GateUpLayout layout = GateUpLayout::kSplit,
                               const SwigluClamp* clamp = nullptr);

// (a) bf16 output: [rows, inter] bf16 bits, z rounded to nearest even (float_to_bf16).
std::vector<uint16_t> silu_bf16(const std::vector<uint16_t>& input, int32_t inter,
                                const std::vector<uint32_t>& row_offsets);

// (b) blockwise FP8 output, shape {kFp8Blockwise, inter, G, max_rows}: codes [max_rows, inter]
// e4m3; fp32 scales, one per 128 values of z, transposed as Fp8ScaleLayout{inter, max_rows}
// (scale k of row r at k * max_rows + r). As in the FP8 dispatch output each group's row count
// and max_rows must be multiples of 4 (true when the dispatch was blockwise FP8); rows are not
// moved to make them so. Padding rows — src_info[r].rank < 0, src_info being the dispatch's
// [rows] (nullptr: none) — are not read; their codes and scales are zero. Without src_info a
// padding row is an ordinary row: its zero input gives zero codes and the 1e-4 / 448 floor scale.
QuantizedRows silu_fp8(const std::vector<uint16_t>& input, int32_t inter,
                       const std::vector<uint32_t>& row_offsets, int64_t max_rows,
                       const SrcInfo* src_info = nullptr);

// (c) NVFP4 output and (d) the same from interleaved input (layout = kInterleaved), shape
// {kNvfp4, inter, G, max_rows}: packed [max_rows, inter / 2]; e4m3 scales, one per 16 values,
// row r of group g encoded with the group's global scale global_scales[g] (G entries, positive
// and finite); scales in the 128x4 swizzled layout SwizzledScaleLayout::make(inter, 16,
// max_rows, G), every group starting a fresh 128-row tile (its rows padded to a multiple of 128
// in the scale array, with zero scales), and scales_offsets [G] = swizzled_scales_offsets
// (row_offsets): the same values the dispatch output gives for these row_offsets. Slots of no
// row are zero. Decode: (e2m1 * sf) / global_scales[g].
QuantizedRows silu_nvfp4(const std::vector<uint16_t>& input, int32_t inter,
                         const std::vector<uint32_t>& row_offsets, int64_t max_rows,
                         const std::vector<float>& global_scales,
                         GateUpLayout layout = GateUpLayout::kSplit);

// (e) MXFP4 output, shape {kMxfp4, inter, G, max_rows}: packed [max_rows, inter / 2]; e8m0
// scales ("even" rounding), one per 32 values, row-major [max_rows, inter / 32]
// (Mxfp4ScaleLayout). clamp == nullptr: z = silu(gate) * up; else the clamped SwiGLU.
QuantizedRows silu_mxfp4(const std::vector<uint16_t>& input, int32_t inter,
                         const std::vector<uint32_t>& row_offsets, int64_t max_rows,
                         const SwigluClamp* clamp = nullptr);

// For checks (tests/gpu/test_silu.cu, bench/silu_bench.cpp): z of x rows [0, rows) — silu_mul,
// or swiglu_clamped of *clamp — evaluated on the device, with the device's expf, into z
// [rows, intermediate] fp32 (device memory), on `stream`. The kernels quantise exactly these
// values: quantize_grouped_rows of them (float_to_bf16 for bf16) is each kernel's output bit for
// bit. A failed launch throws Error(kCuda).
void silu_values_device(const void* x, int64_t rows, int32_t intermediate, GateUpLayout layout,
                        const SwigluClamp* clamp, float* z, cudaStream_t stream);

}  // namespace reference
}  // namespace epcomm
