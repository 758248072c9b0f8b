// CPU reference of the fused SiLU / SwiGLU kernels (docs/design.md "Fused SiLU / SwiGLU"): z for every element by the
// pointwise functions the kernels use, then the grouped quantisers of the dispatch outputs.
#include <algorithm>
#include <cmath>
#include <string>

#include "epcomm/bf16.h"
#include "epcomm/error.h"
#include "epcomm/formats/reference_silu.h"

namespace epcomm {
namespace reference {
namespace {

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}

// The input's rows (row_offsets[G]) after checking its shape against inter and `group`.
int64_t checked_rows(const char* what, const std::vector<uint16_t>& input, int32_t inter,
                     const std::vector<uint32_t>& row_offsets, int32_t group) {
  const int64_t rows = grouped_rows(what, row_offsets);
  if (inter <= 0 || inter % group != 0) {
    invalid(std::string(what) + ": inter " + std::to_string(inter) +
            " is not a positive multiple of " + std::to_string(group));
  }
  if (int64_t(input.size()) < rows * 2 * inter) {
    invalid(std::string(what) + ": input holds " + std::to_string(input.size()) +
            " values, fewer than " + std::to_string(rows) + " rows of 2 * " +
            std::to_string(inter));
  }
  return rows;
}

std::vector<float> values(const char* what, const std::vector<uint16_t>& input, int32_t inter,
                          const std::vector<uint32_t>& row_offsets, int32_t group,
                          GateUpLayout layout, const SwigluClamp* clamp) {
  const int64_t rows = checked_rows(what, input, inter, row_offsets, group);
  if (clamp != nullptr &&
      !(clamp->limit >= 0.0f && std::isfinite(clamp->limit) && std::isfinite(clamp->alpha))) {
    invalid(std::string(what) + ": the SwiGLU clamp needs a finite limit >= 0 and a finite alpha");
  }
  // Column of gate j and of up j in a row of 2 * inter values.
  const bool split = layout == GateUpLayout::kSplit;
  const int64_t stride = split ? 1 : 2, up_base = split ? inter : 1;
  std::vector<float> z(size_t(rows * inter));
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* in = input.data() + r * 2 * inter;
    for (int64_t j = 0; j < inter; ++j) {
      const float g = bf16_to_float(in[j * stride]);
      const float u = bf16_to_float(in[up_base + j * stride]);
      z[size_t(r * inter + j)] = clamp == nullptr ? silu_mul(g, u) : swiglu_clamped(g, u, *clamp);
    }
  }
  return z;
}

QuantizedRows quantized(const char* what, QuantFormat format, const std::vector<uint16_t>& input,
                        int32_t inter, const std::vector<uint32_t>& row_offsets, int64_t max_rows,
                        const std::vector<float>& global_scales, GateUpLayout layout,
                        const SwigluClamp* clamp, const SrcInfo* src_info) {
  const QuantOutputShape shape{format, inter, int32_t(row_offsets.size()) - 1, max_rows};
  const std::vector<float> z =
      values(what, input, inter, row_offsets, shape.group(), layout, clamp);
  return quantize_grouped_rows(shape, z.data(), row_offsets, global_scales, src_info);
}

}  // namespace

std::vector<float> silu_values(const std::vector<uint16_t>& input, int32_t inter,
                               const std::vector<uint32_t>& row_offsets, GateUpLayout layout,
                               const SwigluClamp* clamp) {
  return values("silu_values", input, inter, row_offsets, 1, layout, clamp);
}

std::vector<uint16_t> silu_bf16(const std::vector<uint16_t>& input, int32_t inter,
                                const std::vector<uint32_t>& row_offsets) {
  const std::vector<float> z =
      values("silu_bf16", input, inter, row_offsets, 1, GateUpLayout::kSplit, nullptr);
  std::vector<uint16_t> out(z.size());
  std::transform(z.begin(), z.end(), out.begin(), float_to_bf16);
  return out;
}

QuantizedRows silu_fp8(const std::vector<uint16_t>& input, int32_t inter,
                       const std::vector<uint32_t>& row_offsets, int64_t max_rows,
                       const SrcInfo* src_info) {
  return quantized("silu_fp8", QuantFormat::kFp8Blockwise, input, inter, row_offsets, max_rows, {},
                   GateUpLayout::kSplit, nullptr, src_info);
}

QuantizedRows silu_nvfp4(const std::vector<uint16_t>& input, int32_t inter,
                         const std::vector<uint32_t>& row_offsets, int64_t max_rows,
                         const std::vector<float>& global_scales, GateUpLayout layout) {
  return quantized("silu_nvfp4", QuantFormat::kNvfp4, input, inter, row_offsets, max_rows,
                   global_scales, layout, nullptr, nullptr);
}

QuantizedRows silu_mxfp4(const std::vector<uint16_t>& input, int32_t inter,
                         const std::vector<uint32_t>& row_offsets, int64_t max_rows,
                         const SwigluClamp* clamp) {
  return quantized("silu_mxfp4", QuantFormat::kMxfp4, input, inter, row_offsets, max_rows, {},
                   GateUpLayout::kSplit, clamp, nullptr);
}

}  // namespace reference
}  // namespace epcomm
