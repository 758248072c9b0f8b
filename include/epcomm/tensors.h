// Every tensor a caller allocates for a group, described once: its name, element type, shape and
// strides, per format and scale layout. The Python package allocates from these descriptions
// (epcomm.Group.dispatch_output_descs()), and so do the benchmark and the examples; group.h's
// DispatchOutput / CombineOutput point here instead of restating the shapes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/config.h"

namespace epcomm {

// Element types of the tensors epcomm writes and reads.
enum class DType : int32_t {
  kBF16 = 0,        // bfloat16 (uint16 bit patterns in a framework without bfloat16)
  kF32 = 1,         // float32
  kI32 = 2,         // int32
  kU8 = 3,          // bytes: pairs of e2m1 codes, e4m3 / e8m0 scale codes
  kFloat8E4M3 = 4,  // e4m3 codes (uint8 in a framework without float8_e4m3fn)
  kI64 = 5,         // int64
};
// PyTorch's name of the type: "bfloat16", "float32", "int32", "uint8", "float8_e4m3fn", "int64".
const char* dtype_name(DType t);
// Bytes of one element.
int64_t dtype_bytes(DType t);

struct TensorDesc {
  const char* name = "";  // the member of DispatchOutput / CombineOutput it is
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements; every tensor here is row-major (contiguous)

  int64_t numel() const;
  int64_t bytes() const { return numel() * dtype_bytes(dtype); }
};

// The dispatch outputs of a group with this configuration and these sizes (compute_sizes,
// Group::sizes()), in DispatchOutput's order. With R = Sizes::max_recv_rows (the rows, padding
// included), H = Config::hidden and G = Sizes::num_groups:
//   tokens          bf16: bf16 [R, H]; blockwise FP8, MXFP8: e4m3 [R, H]; NVFP4, MXFP4: uint8
//                   [R, H / 2], two e2m1 codes a byte (element 2i in the low nibble)
//   row_offsets     int32 [G + 1] (uint32 values): group g is rows [row_offsets[g],
//                   row_offsets[g + 1]), by source rank, then source token
//   expert_ids      int32 [G]: the local expert of each group, kSharedExpertId for the shared one
//   src_info        int32 [R, 2] (SrcInfo): the source token, then rank | slot << 16
//   scales          blockwise FP8: fp32 [H / 128, R] (Fp8ScaleLayout, ld = R); NVFP4, MXFP8:
//                   uint8 [SwizzledScaleLayout::make(H, group, Sizes::max_routed_rows, G).size()]
//                   (e4m3 / e8m0 codes, the 128x4 swizzled layout); MXFP4: e8m0 uint8
//                   [R, H / 32] (Mxfp4ScaleLayout); bf16: none
//   scales_offsets  NVFP4, MXFP8: int32 [G] (uint32 values); others: none
//   counts, slot_token, layout_range
//                   the padded layout's (below); otherwise shapes [0], [0, 0], [0, n_ranks]
// With Config::padded_capacity = C > 0 (the padded per-expert layout; bf16, blockwise FP8) the
// rows have no format padding (R = Sizes::max_routed_rows) and:
//   tokens          [G, C, H] (bf16) or [G, C, H] e4m3: row row_offsets[g] + j at slot (g, j)
//   scales          blockwise FP8: fp32 [G, H / 128, C]; with Config::fp8_ue8m0_scales, int32
//                   [G, H / 512, C] UE8M0 words (Ue8m0ScaleLayout)
//   counts          int32 [G]: each group's rows
//   slot_token      int32 [G, C]: each used slot's source token
//   layout_range    int64 [G, n_ranks]: (first slot << 32) | rows from each source rank
// An output the format does not have is described with shape [0]: nothing to allocate (pass
// null). bytes() of each equals what Sizes says (token_bytes * R, or * G * C in the padded
// layout; scales_bytes, ...).
std::vector<TensorDesc> dispatch_output_descs(const Config& cfg, const Sizes& sizes);

// The combine output for num_tokens tokens: reduced (router weights given to dispatch or to
// combine) bf16 [T, H]; un-reduced bf16 [T, K, H] (row k of token t: its top-k slot k). H is
// `hidden` where given (> 0: a combine of fewer columns, CombineInput::hidden), else the
// config's.
TensorDesc combine_output_desc(const Config& cfg, int32_t num_tokens, bool reduced,
                               int32_t hidden = 0);

// What combine reads on the expert side: bf16 [R, H], the expert output of each row of a
// dispatch output (rows past row_offsets[G] are not read).
TensorDesc expert_out_desc(const Config& cfg, const Sizes& sizes);

// The description named `name` in `descs`, or null.
const TensorDesc* find_desc(const std::vector<TensorDesc>& descs, const std::string& name);
// Bytes of the description named `name` in `descs`; 0 when there is none.
int64_t desc_bytes(const std::vector<TensorDesc>& descs, const std::string& name);

}  // namespace epcomm
