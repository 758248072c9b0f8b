// CPU reference of the quantised dispatch outputs (SPEC §5): the bf16 dispatch rows of
// reference::dispatch, padded per group where the format pads, encoded by the row encoders of
// formats_reference.cpp and laid out by the scale layouts of scale_layouts.h.
#include <algorithm>
#include <string>

#include "epcomm/bf16.h"
#include "epcomm/error.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/reference.h"

namespace epcomm {
namespace reference {
namespace {

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}

bool is_padding(const SrcInfo* src_info, int64_t row) {
  return src_info != nullptr && src_info[row].rank < 0;
}

// Zeroes the codes and the row-major scales ([rows, cols]) of every padding row.
template <typename Scale>
void zero_padding_rows(const SrcInfo* src_info, int64_t rows, int64_t row_bytes, int32_t cols,
                       uint8_t* codes, Scale* row_scales) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!is_padding(src_info, r)) continue;
    std::fill(codes + r * row_bytes, codes + (r + 1) * row_bytes, uint8_t(0));
    std::fill(row_scales + r * cols, row_scales + (r + 1) * cols, Scale(0));
  }
}

void check_global_scales(const char* what, const QuantOutputShape& shape,
                         const std::vector<float>& global_scales) {
  if (shape.format == QuantFormat::kNvfp4 && global_scales.size() != size_t(shape.groups)) {
    invalid(std::string(what) + ": NVFP4 needs one global scale per group, got " +
            std::to_string(global_scales.size()) + " for " + std::to_string(shape.groups));
  }
}

}  // namespace

// ---- shapes ---------------------------------------------------------------------------------

TokenFormat token_format(QuantFormat f) {
  switch (f) {
    case QuantFormat::kFp8Blockwise: return TokenFormat::kFp8Blockwise;
    case QuantFormat::kNvfp4: return TokenFormat::kNvfp4;
    case QuantFormat::kMxfp8: return TokenFormat::kMxfp8;
    case QuantFormat::kMxfp4: return TokenFormat::kMxfp4;
  }
  invalid("token_format: unknown QuantFormat " + std::to_string(int32_t(f)));
}

QuantFormat quant_format(TokenFormat f) {
  switch (f) {
    case TokenFormat::kFp8Blockwise: return QuantFormat::kFp8Blockwise;
    case TokenFormat::kNvfp4: return QuantFormat::kNvfp4;
    case TokenFormat::kMxfp8: return QuantFormat::kMxfp8;
    case TokenFormat::kMxfp4: return QuantFormat::kMxfp4;
    default: break;
  }
  invalid(std::string("quant_format: ") + token_format_name(f) + " is not a quantised format");
}

int32_t QuantOutputShape::group() const { return format_scale_group(token_format(format)); }

int32_t QuantOutputShape::row_align() const { return format_row_align(token_format(format)); }

int64_t QuantOutputShape::row_bytes() const { return format_row_bytes(token_format(format), hidden); }

int64_t QuantOutputShape::scales_size() const {
  if (format == QuantFormat::kFp8Blockwise) return fp8_layout().size();
  if (swizzled()) return swizzled_layout().size();
  return mxfp4_layout().size();
}

QuantOutputShape dispatch_output_shape(QuantFormat format, int32_t hidden, int64_t max_routed_rows,
                                       int32_t groups) {
  QuantOutputShape shape{format, hidden, groups, max_routed_rows};
  const int32_t group = shape.group();
  if (hidden <= 0 || hidden % group != 0) {
    invalid("dispatch_output_shape: hidden " + std::to_string(hidden) +
            " is not a positive multiple of " + std::to_string(group));
  }
  if (max_routed_rows < 0 || groups < 1) {
    invalid("dispatch_output_shape: max_routed_rows " + std::to_string(max_routed_rows) +
            ", groups " + std::to_string(groups));
  }
  shape.rows =
      DispatchOutputLayout::make(token_format(format), hidden, max_routed_rows, groups).rows;
  return shape;
}

int64_t grouped_rows(const char* what, const std::vector<uint32_t>& row_offsets) {
  if (row_offsets.size() < 2 || row_offsets[0] != 0) {
    invalid(std::string(what) + ": row_offsets needs G + 1 >= 2 entries starting at 0");
  }
  for (size_t g = 1; g < row_offsets.size(); ++g) {
    if (row_offsets[g] < row_offsets[g - 1]) {
      invalid(std::string(what) + ": row_offsets decreases at " + std::to_string(g));
    }
  }
  return int64_t(row_offsets.back());
}

// ---- quantise / dequantise ------------------------------------------------------------------

QuantizedRows quantize_grouped_rows(const QuantOutputShape& shape, const float* x,
                                    const std::vector<uint32_t>& row_offsets,
                                    const std::vector<float>& global_scales,
                                    const SrcInfo* src_info) {
  const char* what = "quantize_grouped_rows";
  const int64_t rows = grouped_rows(what, row_offsets);
  const int32_t groups = int32_t(row_offsets.size() - 1);
  if (groups != shape.groups || rows > shape.rows) {
    invalid(std::string(what) + ": " + std::to_string(groups) + " groups of " +
            std::to_string(rows) + " rows do not fit a shape of " + std::to_string(shape.groups) +
            " groups and " + std::to_string(shape.rows) + " rows");
  }
  const int32_t align = shape.row_align();
  if (shape.rows % align != 0) {
    invalid(std::string(what) + ": " + std::to_string(shape.rows) +
            " output rows are not a multiple of " + std::to_string(align));
  }
  for (int32_t g = 0; g < groups; ++g) {
    const uint32_t m = row_offsets[size_t(g) + 1] - row_offsets[size_t(g)];
    if (m % uint32_t(align) != 0) {
      invalid(std::string(what) + ": group " + std::to_string(g) + " has " + std::to_string(m) +
              " rows, not a multiple of " + std::to_string(align));
    }
  }
  check_global_scales(what, shape, global_scales);

  const int32_t H = shape.hidden;
  const int32_t cols = H / shape.group();
  const int64_t row_bytes = shape.row_bytes();
  QuantizedRows q;
  q.shape = shape;
  q.codes.assign(size_t(shape.codes_size()), 0);
  uint8_t* codes = q.codes.data();
  switch (shape.format) {
    case QuantFormat::kFp8Blockwise: {
      std::vector<float> row_scales(size_t(rows * cols));
      encode_fp8_blockwise(x, rows, H, codes, row_scales.data());
      zero_padding_rows(src_info, rows, row_bytes, cols, codes, row_scales.data());
      q.fp8_scales.assign(size_t(shape.scales_size()), 0.0f);
      place_fp8_scales(row_scales.data(), rows, shape.fp8_layout(), q.fp8_scales.data());
      break;
    }
    case QuantFormat::kNvfp4:
    case QuantFormat::kMxfp8: {
      std::vector<uint8_t> row_scales(size_t(rows * cols));
      if (shape.format == QuantFormat::kMxfp8) {
        encode_mxfp8(x, rows, H, codes, row_scales.data());
      } else {
        for (int32_t g = 0; g < groups; ++g) {
          const int64_t begin = row_offsets[size_t(g)];
          encode_nvfp4(x + begin * H, int64_t(row_offsets[size_t(g) + 1]) - begin, H,
                       global_scales[size_t(g)], codes + begin * row_bytes,
                       row_scales.data() + begin * cols);
        }
      }
      zero_padding_rows(src_info, rows, row_bytes, cols, codes, row_scales.data());
      q.scales.resize(size_t(shape.scales_size()));
      q.scales_offsets.resize(size_t(groups));
      place_swizzled_scales(row_scales.data(), row_offsets.data(), groups, shape.swizzled_layout(),
                            q.scales.data(), q.scales_offsets.data());
      break;
    }
    case QuantFormat::kMxfp4:
      // The output layout is the row-major order the encoder writes.
      q.scales.assign(size_t(shape.scales_size()), 0);
      encode_mxfp4(x, rows, H, codes, q.scales.data());
      zero_padding_rows(src_info, rows, row_bytes, cols, codes, q.scales.data());
      break;
  }
  return q;
}

std::vector<float> dequantize_grouped_rows(const QuantizedRows& q,
                                           const std::vector<uint32_t>& row_offsets,
                                           const std::vector<float>& global_scales) {
  const QuantOutputShape& shape = q.shape;
  const int64_t rows = grouped_rows("dequantize_grouped_rows", row_offsets);
  const int32_t groups = int32_t(row_offsets.size() - 1);
  if (groups != shape.groups || rows > shape.rows) {
    invalid("dequantize_grouped_rows: row_offsets do not fit the shape");
  }
  check_global_scales("dequantize_grouped_rows", shape, global_scales);
  const int32_t H = shape.hidden;
  const int32_t cols = H / shape.group();
  std::vector<float> out(size_t(rows * H));
  if (shape.format == QuantFormat::kFp8Blockwise) {
    const Fp8ScaleLayout layout = shape.fp8_layout();
    std::vector<float> row_scales(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int32_t c = 0; c < cols; ++c)
        row_scales[size_t(r * cols + c)] = q.fp8_scales[size_t(layout.offset(r, c))];
    }
    decode_fp8_blockwise(q.codes.data(), row_scales.data(), rows, H, out.data());
    return out;
  }
  if (shape.format == QuantFormat::kMxfp4) {
    decode_mxfp4(q.codes.data(), q.scales.data(), rows, H, out.data());
    return out;
  }
  // Swizzled: gather each row's scales from where the grouped GEMM finds them.
  const SwizzledScaleLayout layout = shape.swizzled_layout();
  std::vector<uint8_t> row_scales(size_t(rows * cols));
  for (int32_t g = 0; g < groups; ++g) {
    const SwizzledGroup group{row_offsets[size_t(g)], q.scales_offsets[size_t(g)]};
    for (int64_t r = row_offsets[size_t(g)]; r < int64_t(row_offsets[size_t(g) + 1]); ++r) {
      for (int32_t c = 0; c < cols; ++c)
        row_scales[size_t(r * cols + c)] = q.scales[size_t(layout.offset(group.scale_row(r), c))];
    }
  }
  if (shape.format == QuantFormat::kMxfp8) {
    decode_mxfp8(q.codes.data(), row_scales.data(), rows, H, out.data());
    return out;
  }
  for (int32_t g = 0; g < groups; ++g) {
    const int64_t begin = row_offsets[size_t(g)];
    decode_nvfp4(q.codes.data() + begin * shape.row_bytes(), row_scales.data() + begin * cols,
                 int64_t(row_offsets[size_t(g) + 1]) - begin, H, global_scales[size_t(g)],
                 out.data() + begin * H);
  }
  return out;
}

// ---- quantised dispatch ---------------------------------------------------------------------

QuantDispatchResult dispatch_quantized(const Problem& p, int32_t rank, QuantFormat format,
                                       float global_scale, int64_t max_routed_rows) {
  const DispatchResult bf16 = dispatch(p, rank);
  const int32_t groups = int32_t(bf16.expert_ids.size());
  const int32_t H = p.hidden;
  if (max_routed_rows < 0) max_routed_rows = bf16.rows();
  if (bf16.rows() > max_routed_rows) {
    invalid("dispatch_quantized: rank " + std::to_string(rank) + " receives " +
            std::to_string(bf16.rows()) + " rows, more than max_routed_rows " +
            std::to_string(max_routed_rows));
  }
  const QuantOutputShape shape = dispatch_output_shape(format, H, max_routed_rows, groups);

  std::vector<int32_t> counts(static_cast<size_t>(groups));
  for (int32_t g = 0; g < groups; ++g)
    counts[size_t(g)] = int32_t(bf16.row_offsets[size_t(g) + 1] - bf16.row_offsets[size_t(g)]);
  QuantDispatchResult r;
  r.row_offsets.resize(size_t(groups) + 1);
  padded_row_offsets(counts.data(), groups, shape.row_align(), r.row_offsets.data());
  r.expert_ids = bf16.expert_ids;
  const int64_t rows = r.row_offsets.back();
  r.src_info.assign(size_t(rows), SrcInfo{-1, -1, -1});
  std::vector<float> x(size_t(rows * H), 0.0f);  // bf16 widens to fp32 exactly
  for (int32_t g = 0; g < groups; ++g) {
    for (int32_t i = 0; i < counts[size_t(g)]; ++i) {
      const int64_t from = int64_t(bf16.row_offsets[size_t(g)]) + i;
      const int64_t to = int64_t(r.row_offsets[size_t(g)]) + i;
      r.src_info[size_t(to)] = bf16.src_info[size_t(from)];
      std::transform(bf16.tokens.begin() + from * H, bf16.tokens.begin() + (from + 1) * H,
                     x.begin() + to * H, bf16_to_float);
    }
  }
  r.out =
      quantize_grouped_rows(shape, x.data(), r.row_offsets,
                            std::vector<float>(size_t(groups), global_scale), r.src_info.data());
  return r;
}

}  // namespace reference
}  // namespace epcomm
