// The padded per-expert layout: group g's rows at [g * capacity, g * capacity + counts[g]) of a
// [G, capacity, ...] array, the "masked" layout a batched GEMM takes (and DeepEP's low-latency
// mode hands out). pad_expert_rows copies a dispatch output into it; unpad_expert_rows brings
// expert outputs in that layout back to dispatch row order, for combine. Within a group the rows
// keep the dispatch order: by source rank, then source token.
//
// Both are one launch on the caller's stream with no host synchronisation: the rows in use,
// row_offsets[G], are read on the device, so a captured graph serves any routing. Rows at or past
// row_offsets[G] (or max_rows) are neither read nor written; so are the slots of the padded
// array past a group's count, which keep whatever they held. Blockwise-FP8 padding rows (src_info
// rank -1) are not copied by pad_expert_rows and are written as zero by unpad_expert_rows.
//
// row_offsets should start at 0 and not decrease (a dispatch's do); a row whose slot would fall
// outside its group's [0, capacity) is neither read nor written.
//
// Arguments are device pointers: codes and rows 16-byte aligned with row_bytes a multiple of 16,
// scales and the int outputs 4-byte aligned, layout_range 8-byte aligned; an array of no elements
// (src_info, codes or out with max_rows 0, the padded arrays with capacity 0) may be null. capacity
// must hold every group's rows (n_ranks * max_tokens_per_rank always does: a source sends a token
// to an expert at most once); a row past capacity is not copied. Bad arguments throw
// Error(kInvalidArgument) before anything is launched; a failed launch throws Error(kCuda).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "epcomm/layout.h"  // SrcInfo

namespace epcomm {

// Which rows exist: the dispatch output's (Group::sizes() for max_rows and groups).
struct DispatchRows {
  const uint32_t* row_offsets = nullptr;  // [groups + 1]
  const SrcInfo* src_info = nullptr;      // [max_rows]
  int32_t groups = 0;                     // G
  int64_t max_rows = 0;                   // rows of the dispatch output
};

struct PadExpertRows {
  DispatchRows rows;
  const void* codes = nullptr;  // [max_rows, row_bytes]: the dispatch output's tokens
  int64_t row_bytes = 0;
  // Blockwise FP8 (optional): the dispatch output's scales, fp32 [scale_cols, max_rows]
  // (Fp8ScaleLayout, ld = max_rows); null for other formats.
  const float* scales = nullptr;
  int32_t scale_cols = 0;
  int32_t n_ranks = 0;   // sources: layout_range has n_ranks entries a group
  int64_t capacity = 0;  // slots a group
  // Outputs.
  void* padded_codes = nullptr;     // [G, capacity, row_bytes]
  float* padded_scales = nullptr;   // [G, scale_cols, capacity] (with scales): slot j of group
                                    // g's scale k at (g * scale_cols + k) * capacity + j
  // UE8M0 words (optional, with scales, scale_cols a multiple of 4): [G, scale_cols / 4,
  // capacity], word (g, q, j) = Fp8BlockQuant::ue8m0_word of slot j's scales 4q .. 4q + 3 (the
  // biased exponent of each, scale 4q in the lowest byte): DeepEP's use_ue8m0 scales. Exact for
  // power-of-two scales (Config::fp8_pow2_scales); of another scale it keeps the exponent only.
  // With scales, at least one of padded_scales and padded_ue8m0 is given.
  uint32_t* padded_ue8m0 = nullptr;
  int32_t* counts = nullptr;        // [G]: real (non-padding) rows of each group
  int32_t* src_token = nullptr;     // [G, capacity] (optional): each slot's source token
  int64_t* layout_range = nullptr;  // [G, n_ranks] (optional): (first slot << 32) | slots of the
                                    // rows from each source rank; 0 where it sent none
};
void pad_expert_rows(const PadExpertRows& a, cudaStream_t stream);
// Its checks (what pad_expert_rows throws before launching); the CPU reference shares them.
void check_pad_expert_rows(const PadExpertRows& a);

struct UnpadExpertRows {
  DispatchRows rows;
  const void* padded = nullptr;  // [G, capacity, row_bytes]
  int64_t row_bytes = 0;
  int64_t capacity = 0;
  void* out = nullptr;  // [max_rows, row_bytes]: row i of group g is padded slot (g, i - row_offsets[g])
};
void unpad_expert_rows(const UnpadExpertRows& a, cudaStream_t stream);
void check_unpad_expert_rows(const UnpadExpertRows& a);

}  // namespace epcomm
