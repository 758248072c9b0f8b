// CPU reference of the quantised dispatch outputs (docs/design.md "Token formats"): the bf16 dispatch rows of
// reference::dispatch, padded per group where the format pads, encoded by the row encoders of
// formats_reference.cpp and laid out by the scale layouts of scale_layouts.h; and the comparison
// of a dispatch output with it.
#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

#include <unistd.h>

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

DispatchOutputLayout QuantOutputShape::layout() const {
  return DispatchOutputLayout{token_format(format), hidden, groups, rows, rows, 0, false};
}

int64_t QuantOutputShape::scales_size() const {
  const TokenFormat f = token_format(format);
  return layout().scales_bytes() / format_scale_bytes(f);
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
      encode_fp8_blockwise(x, rows, H, codes, row_scales.data(), shape.fp8_pow2);
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
                                       float global_scale, int64_t max_routed_rows,
                                       bool fp8_pow2) {
  const DispatchResult bf16 = dispatch(p, rank);
  const int32_t groups = int32_t(bf16.expert_ids.size());
  const int32_t H = p.hidden;
  if (max_routed_rows < 0) max_routed_rows = bf16.rows();
  if (bf16.rows() > max_routed_rows) {
    invalid("dispatch_quantized: rank " + std::to_string(rank) + " receives " +
            std::to_string(bf16.rows()) + " rows, more than max_routed_rows " +
            std::to_string(max_routed_rows));
  }
  QuantOutputShape shape = dispatch_output_shape(format, H, max_routed_rows, groups);
  shape.fp8_pow2 = fp8_pow2;
  {
    // The output is sized by the caller's capacity: one larger than this host's memory is bad
    // input, refused before anything is allocated.
    const DispatchOutputLayout layout =
        DispatchOutputLayout::make(token_format(format), H, max_routed_rows, groups);
    const double bytes =
        double(layout.rows) * double(layout.row_bytes()) + double(layout.scales_bytes());
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0 && bytes > double(pages) * double(page)) {
      invalid("dispatch_quantized: max_routed_rows " + std::to_string(max_routed_rows) +
              " asks for an output of " + std::to_string(layout.rows) +
              " rows, more than this host's memory");
    }
  }

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

// ---- comparing a dispatch output with the reference -----------------------------------------

QuantizedDispatchView QuantDispatchResult::view() const {
  const QuantOutputShape& shape = out.shape;
  const bool fp8 = shape.format == QuantFormat::kFp8Blockwise;
  const size_t groups = size_t(std::max(shape.groups, 0));
  QuantizedDispatchView v{
      shape.groups,
      shape.rows,
      shape.row_bytes(),
      fp8 ? int64_t(out.fp8_scales.size() * sizeof(float)) : int64_t(out.scales.size()),
      int32_t(out.scales_offsets.size()),
      row_offsets.data(),
      expert_ids.data(),
      src_info.data(),
      out.codes.data(),
      fp8 ? static_cast<const void*>(out.fp8_scales.data()) : out.scales.data(),
      out.scales_offsets.data()};
  if (row_offsets.size() != groups + 1 || expert_ids.size() != groups) {
    invalid("QuantDispatchResult::view: " + std::to_string(row_offsets.size()) +
            " row_offsets and " + std::to_string(expert_ids.size()) + " expert_ids for " +
            std::to_string(groups) + " groups");
  }
  const int64_t n = std::min(int64_t(row_offsets.back()), shape.rows);
  if (int64_t(src_info.size()) < n || int64_t(out.codes.size()) < n * v.row_bytes) {
    invalid("QuantDispatchResult::view: src_info and codes need " + std::to_string(n) +
            " rows, hold " + std::to_string(src_info.size()) + " and " +
            std::to_string(out.codes.size()) + " bytes");
  }
  return v;
}

namespace {

std::string hex(uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

// The first of n bytes where a and b differ, or -1.
int64_t first_difference(const void* a, const void* b, int64_t n) {
  if (n <= 0 || std::memcmp(a, b, size_t(n)) == 0) return -1;
  const uint8_t* x = static_cast<const uint8_t*>(a);
  const uint8_t* y = static_cast<const uint8_t*>(b);
  int64_t i = 0;
  while (x[i] == y[i])
    ++i;
  return i;
}

// The group of output row r (the last g with row_offsets[g] <= r).
int64_t group_of(const QuantDispatchResult& ref, int64_t r) {
  const auto next = std::upper_bound(ref.row_offsets.begin(), ref.row_offsets.end(), uint32_t(r));
  return int64_t(next - ref.row_offsets.begin()) - 1;
}

// "row r (group g, rank s token t slot k)", or "row r (group g, padding)", from the reference.
std::string describe_row(const QuantDispatchResult& ref, int64_t r) {
  std::ostringstream os;
  os << "row " << r << " (group " << group_of(ref, r);
  const SrcInfo si = ref.src_info[size_t(r)];
  if (si.rank < 0)
    os << ", padding)";
  else
    os << ", rank " << si.rank << " token " << si.token << " slot " << si.slot << ")";
  return os.str();
}

// Where byte `o` of a swizzled scale array lands: its 5-d index, the scale row and column, and
// the output row whose scale it holds or which kind of unused slot it is (from ref's groups).
std::string describe_swizzled(const QuantDispatchResult& ref, const SwizzledScaleLayout& layout,
                              int64_t o) {
  using L = SwizzledScaleLayout;
  const int64_t tile = o / L::kTileElems, within = o % L::kTileElems;
  const int64_t tile_row = tile / layout.col_tiles();
  const int32_t tile_col = int32_t(tile % layout.col_tiles());
  const int64_t sub_row = within / 16, sub_block = (within % 16) / L::kTileCols;
  const int64_t sub_col = within % L::kTileCols;
  const int64_t scale_row = tile_row * L::kTileRows + sub_block * L::kSubRows + sub_row;
  const int32_t col = tile_col * L::kTileCols + int32_t(sub_col);
  std::ostringstream os;
  os << "byte " << o << " = [tile row " << tile_row << ", tile col " << tile_col << ", " << sub_row
     << ", " << sub_block << ", " << sub_col << "] (scale row " << scale_row << ", scale column "
     << col << "): ";
  for (size_t g = 0; g + 1 < ref.row_offsets.size(); ++g) {
    const SwizzledGroup sg{ref.row_offsets[g], ref.out.scales_offsets[g]};
    const int64_t m = int64_t(ref.row_offsets[g + 1]) - sg.row_offset;
    const int64_t first = sg.tile_start() * L::kTileRows;
    if (scale_row < first || scale_row >= first + align_up(m, int64_t(L::kTileRows))) continue;
    const int64_t r = int64_t(sg.row_offset) + (scale_row - first);
    if (scale_row - first >= m)
      os << "an unused slot of group " << g << "'s last tile";
    else if (col >= layout.scale_cols)
      os << "column padding of " << describe_row(ref, r);
    else
      os << describe_row(ref, r) << " column " << col;
    return os.str();
  }
  os << "a tile no group uses";
  return os.str();
}

// "" when v's sizes are those of `shape`, else "(v's sizes) differ from ... (shape's)".
std::string size_mismatch(const QuantOutputShape& shape, const QuantizedDispatchView& v) {
  const int64_t scales_bytes =
      shape.scales_size() * (shape.format == QuantFormat::kFp8Blockwise ? 4 : 1);
  const int32_t offsets = shape.swizzled() ? shape.groups : 0;
  if (v.groups == shape.groups && v.rows == shape.rows && v.row_bytes == shape.row_bytes() &&
      v.scales_bytes == scales_bytes && v.num_scales_offsets == offsets)
    return "";
  std::ostringstream os;
  os << "(groups " << v.groups << ", rows " << v.rows << ", row bytes " << v.row_bytes
     << ", scale bytes " << v.scales_bytes << ", scales_offsets " << v.num_scales_offsets
     << ") differ from the reference's " << token_format_name(token_format(shape.format))
     << " output of hidden " << shape.hidden << " (groups " << shape.groups << ", rows "
     << shape.rows << ", row bytes " << shape.row_bytes() << ", scale bytes " << scales_bytes
     << ", scales_offsets " << offsets << ")";
  return os.str();
}

}  // namespace

std::string compare_dispatch_quantized(const QuantDispatchResult& ref,
                                       const QuantizedDispatchView& got) {
  const QuantOutputShape& shape = ref.out.shape;
  const QuantizedDispatchView want = ref.view();
  const int64_t rows = grouped_rows("compare_dispatch_quantized", ref.row_offsets);
  if (ref.rows() != rows || rows > shape.rows || !size_mismatch(shape, want).empty()) {
    invalid("compare_dispatch_quantized: the reference does not fit its shape: " +
            std::to_string(ref.rows()) + " rows of src_info for row_offsets[G] = " +
            std::to_string(rows) + "; its arrays' sizes " + size_mismatch(shape, want));
  }
  std::ostringstream os;
  const std::string sizes = size_mismatch(shape, got);
  if (!sizes.empty()) return "the output's sizes " + sizes;

  const size_t G = size_t(shape.groups);
  for (size_t g = 0; g <= G; ++g)
    if (got.row_offsets[g] != want.row_offsets[g]) {
      os << "row_offsets[" << g << "] = " << got.row_offsets[g] << ", expected "
         << want.row_offsets[g];
      return os.str();
    }
  for (size_t g = 0; g < G; ++g)
    if (got.expert_ids[g] != want.expert_ids[g]) {
      os << "expert_ids[" << g << "] = " << got.expert_ids[g] << ", expected "
         << want.expert_ids[g];
      return os.str();
    }
  // row_offsets agree, so got holds rows [0, rows) of src_info and codes.
  for (int64_t r = 0; r < rows; ++r) {
    const SrcInfo a = got.src_info[r], b = want.src_info[r];
    if (a.token != b.token || a.rank != b.rank || a.slot != b.slot) {
      os << "src_info[" << r << "] (group " << group_of(ref, r) << ") = (rank " << a.rank
         << ", token " << a.token << ", slot " << a.slot << "), expected "
         << (b.rank < 0 ? "padding " : "") << "(rank " << b.rank << ", token " << b.token
         << ", slot " << b.slot << ")";
      return os.str();
    }
  }

  // Codes: e4m3 byte b is value b; packed e2m1 byte b holds values 2b (low nibble) and 2b + 1.
  const int64_t row_bytes = shape.row_bytes();
  const int64_t code = first_difference(got.codes, want.codes, rows * row_bytes);
  if (code >= 0) {
    const int64_t r = code / row_bytes, b = code % row_bytes;
    const bool packed = row_bytes != shape.hidden;
    os << "codes of " << describe_row(ref, r) << " byte " << b << " (value column "
       << (packed ? 2 * b : b) << (packed ? " and the next" : "") << ") = " << hex(got.codes[code])
       << ", expected " << hex(want.codes[code]);
    return os.str();
  }

  const int32_t cols = shape.hidden / shape.group();
  const int32_t group = shape.group();
  const uint8_t* got_scales = static_cast<const uint8_t*>(got.scales);
  const uint8_t* want_scales = static_cast<const uint8_t*>(want.scales);
  switch (shape.format) {
    case QuantFormat::kFp8Blockwise: {  // fp32, column k's rows [0, rows) at k * ld
      const Fp8ScaleLayout layout = shape.fp8_layout();
      for (int32_t k = 0; k < cols; ++k) {
        const int64_t at = layout.offset(0, k) * 4;
        const int64_t diff = first_difference(got_scales + at, want_scales + at, rows * 4);
        if (diff < 0) continue;
        const int64_t r = diff / 4, i = layout.offset(r, k);
        float x, y;
        uint32_t xb, yb;
        std::memcpy(&x, got_scales + i * 4, 4);
        std::memcpy(&y, want_scales + i * 4, 4);
        std::memcpy(&xb, &x, 4);
        std::memcpy(&yb, &y, 4);
        os << "FP8 scale of " << describe_row(ref, r) << " column " << k << " (values ["
           << k * group << ", " << (k + 1) * group << "), scales[" << i << "]) = " << x << " ("
           << hex(xb) << "), expected " << y << " (" << hex(yb) << ")";
        return os.str();
      }
      break;
    }
    case QuantFormat::kNvfp4:
    case QuantFormat::kMxfp8: {
      for (size_t g = 0; g < G; ++g)
        if (got.scales_offsets[g] != want.scales_offsets[g]) {
          os << "scales_offsets[" << g << "] = " << got.scales_offsets[g] << ", expected "
             << want.scales_offsets[g];
          return os.str();
        }
      const int64_t o = first_difference(got_scales, want_scales, want.scales_bytes);
      if (o >= 0) {
        os << "swizzled scale " << describe_swizzled(ref, shape.swizzled_layout(), o) << " = "
           << hex(got_scales[o]) << ", expected " << hex(want_scales[o]);
        return os.str();
      }
      break;
    }
    case QuantFormat::kMxfp4: {  // row-major [rows, cols]: rows [0, rows) are one run
      const int64_t i = first_difference(got_scales, want_scales, rows * cols);
      if (i >= 0) {
        const int64_t r = i / cols, c = i % cols;
        os << "MXFP4 scale of " << describe_row(ref, r) << " column " << c << " (values ["
           << c * group << ", " << (c + 1) * group << "), scales[" << i
           << "]) = " << hex(got_scales[i]) << ", expected " << hex(want_scales[i]);
        return os.str();
      }
      break;
    }
  }
  return "";
}

}  // namespace reference
}  // namespace epcomm
