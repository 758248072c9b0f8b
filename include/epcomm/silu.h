// The fused SiLU / SwiGLU kernels (docs/design.md "Fused SiLU / SwiGLU"): after the first grouped GEMM, z = silu(gate) * up
// (or the clamped SwiGLU) of every dispatch output row, in fp32, stored as bf16 or quantised for
// the second grouped GEMM, z by the functions of epcomm/formats/silu_math.h. The CPU reference
// of every output is in epcomm/formats/reference_silu.h (the epcomm_reference library); the
// kernels match it bit for bit given the same z (the device's expf may differ from the host's in
// the last bit, which silu_math.h explains).
//
// Rows. The input is [max_rows, 2I] bf16, one row per dispatch output row; group g is rows
// [row_offsets[g], row_offsets[g + 1]). The host does not know row_offsets[G]: the kernels read
// it on the device, so every call is stream-ordered, never synchronises the host and can be
// captured in a CUDA graph and replayed with other row_offsets contents. Output row r is input
// row r. Rows at or past row_offsets[G] are neither read nor written (nor past max_rows, should
// row_offsets[G] exceed it); the one exception is NVFP4's swizzled scale array, which is written
// whole on every call (see silu_nvfp4). row_offsets must be what dispatch produces (starting at
// 0, non-decreasing); other contents give unspecified values but no write outside the outputs.
//
// Arguments. Device pointers: x, codes and scales 16-byte aligned; row_offsets, scales_offsets,
// global_scales and src_info 4-byte aligned. Bad arguments throw Error(kInvalidArgument) before
// anything is launched: a null or misaligned pointer, groups outside [1, kSiluMaxGroups],
// intermediate not a positive multiple of the format's group (8 for bf16 — one 16-byte vector —,
// 128 for FP8, 16 for NVFP4, 32 for MXFP4), max_rows outside [0, 2^31), an FP8 max_rows that is not
// a multiple of 4, a clamp with a negative or non-finite limit or a non-finite alpha. A failed
// launch throws Error(kCuda).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "epcomm/formats/silu_math.h"  // SwigluClamp, silu_mul, swiglu_clamped
#include "epcomm/layout.h"              // SrcInfo

namespace epcomm {

// The most groups a call takes (NVFP4 keeps two words per group in shared memory).
constexpr int32_t kSiluMaxGroups = 4096;

struct SiluInput {
  const void* x = nullptr;                // [max_rows, 2 * intermediate] bf16: gate, then up
  const uint32_t* row_offsets = nullptr;  // [groups + 1], the dispatch's (device)
  int32_t groups = 0;                     // G
  int32_t intermediate = 0;               // I: values of gate (and of up) per row
  int64_t max_rows = 0;                   // the outputs' rows: the dispatch output's
  const SrcInfo* src_info = nullptr;      // [max_rows] or null; only silu_fp8 reads it
};

// Blockwise FP8 (group 128): codes [max_rows, I] e4m3; fp32 scales [I / 128, max_rows],
// Fp8ScaleLayout{I, max_rows}.
struct SiluFp8Output {
  uint8_t* codes = nullptr;
  float* scales = nullptr;
};

// NVFP4 (group 16): codes [max_rows, I / 2], two e2m1 per byte (element 2i in the low nibble);
// e4m3 scales in SwizzledScaleLayout::make(I, 16, max_rows, G) (its size() bytes);
// scales_offsets [G].
struct SiluNvfp4Output {
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  uint32_t* scales_offsets = nullptr;
};

// MXFP4 (group 32): codes [max_rows, I / 2]; e8m0 scales [max_rows, I / 32],
// Mxfp4ScaleLayout{I, max_rows}.
struct SiluMxfp4Output {
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
};

// out [max_rows, I] bf16: z rounded to nearest even. in.src_info is ignored.
void silu_bf16(const SiluInput& in, void* out, cudaStream_t stream);

// Blockwise FP8: s = max(amax, 1e-4) / 448 per 128 values of z, codes
// e4m3(z * (448 / max(amax, 1e-4))). With in.src_info, a row r with src_info[r].rank < 0 (a
// padding row of the FP8 dispatch) is not read; its codes and scales are written as zero.
// Without it, padding rows are ordinary rows.
void silu_fp8(const SiluInput& in, const SiluFp8Output& out, cudaStream_t stream);

// NVFP4 with a global scale per group: global_scales [G] (device, each positive and finite),
// rows of group g encoded with global_scales[g]. interleaved: x rows are [g0, u0, g1, u1, ...]
// instead of gate then up. Every group starts a fresh 128-row scale tile; scales_offsets[g] =
// swizzled_scales_offsets(row_offsets) (computed on the device). Every byte of the scale array
// is written on every call: the scales of rows [0, row_offsets[G]), zero in every other slot
// (the padding rows of each group's last tile, the columns past I / 16, the tiles no group
// uses), so a replay with fewer rows leaves nothing stale. in.src_info is ignored.
void silu_nvfp4(const SiluInput& in, const SiluNvfp4Output& out, const float* global_scales,
                bool interleaved, cudaStream_t stream);

// MXFP4 ("even" e8m0 scales, one per 32 values). clamp == nullptr: z = silu(gate) * up; else
// the clamped SwiGLU of *clamp (read on the host). in.src_info is ignored.
void silu_mxfp4(const SiluInput& in, const SiluMxfp4Output& out, const SwigluClamp* clamp,
                cudaStream_t stream);

// Loads every SiLU kernel on the current device now. Optional: the first call of each kernel
// loads it otherwise (CUDA's lazy loading); call it at set-up to keep module loading out of
// timed regions and graph captures.
void load_silu_kernels();

}  // namespace epcomm
