#include "epcomm/tensors.h"

#include <cstddef>
#include <utility>

#include "epcomm/formats/scale_layouts.h"
#include "epcomm/layout.h"

namespace epcomm {

namespace {

struct DTypeInfo {
  const char* name;
  int64_t bytes;
};
// In DType's order.
constexpr DTypeInfo kDTypes[] = {{"bfloat16", 2}, {"float32", 4},       {"int32", 4},
                                 {"uint8", 1},    {"float8_e4m3fn", 1}, {"int64", 8}};
constexpr DTypeInfo kUnknown = {"unknown", 0};

const DTypeInfo& info(DType t) {
  const auto i = size_t(t);
  return i < sizeof(kDTypes) / sizeof(kDTypes[0]) ? kDTypes[i] : kUnknown;
}

// A row-major tensor.
TensorDesc contiguous(const char* name, DType dtype, std::vector<int64_t> shape) {
  TensorDesc d;
  d.name = name;
  d.dtype = dtype;
  d.strides.assign(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;)
    d.strides[i - 1] = d.strides[i] * shape[i];
  d.shape = std::move(shape);
  return d;
}

}  // namespace

const char* dtype_name(DType t) {
  return info(t).name;
}
int64_t dtype_bytes(DType t) {
  return info(t).bytes;
}

int64_t TensorDesc::numel() const {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

std::vector<TensorDesc> dispatch_output_descs(const Config& cfg, const Sizes& sizes) {
  const TokenFormat f = cfg.format;
  const int64_t H = cfg.hidden, G = sizes.num_groups;
  const int64_t R = sizes.max_recv_rows;
  // The scales' layouts (the row count and bytes are in Sizes already).
  const DispatchOutputLayout out =
      DispatchOutputLayout::make(f, cfg.hidden, sizes.max_routed_rows, sizes.num_groups,
                                 cfg.padded_capacity, cfg.fp8_ue8m0_scales);
  const int64_t C = out.capacity;  // > 0: the tokens and scales in the padded layout
  // Tokens: [rows, row] packed, [G, C, row] padded.
  auto token_shape = [&](int64_t row) {
    return C > 0 ? std::vector<int64_t>{G, C, row} : std::vector<int64_t>{R, row};
  };
  std::vector<TensorDesc> d;
  if (f == TokenFormat::kBF16)
    d.push_back(contiguous("tokens", DType::kBF16, token_shape(H)));
  else
    d.push_back(contiguous("tokens",
                           f == TokenFormat::kFp8Blockwise || f == TokenFormat::kMxfp8
                               ? DType::kFloat8E4M3  // one e4m3 code a byte
                               : DType::kU8,         // two e2m1 codes a byte
                           token_shape(sizes.token_bytes)));
  d.push_back(contiguous("row_offsets", DType::kI32, {G + 1}));
  d.push_back(contiguous("expert_ids", DType::kI32, {G}));
  d.push_back(contiguous("src_info", DType::kI32, {R, int64_t(sizeof(SrcInfo) / 4)}));
  switch (f) {
    case TokenFormat::kFp8Blockwise:
      if (C > 0 && out.ue8m0)
        d.push_back(contiguous("scales", DType::kI32, {G, out.ue8m0_words().cols(), C}));
      else if (C > 0)
        d.push_back(contiguous("scales", DType::kF32, {G, out.fp8().cols(), C}));
      else
        d.push_back(contiguous("scales", DType::kF32, {out.fp8().cols(), out.fp8().ld}));
      break;
    case TokenFormat::kNvfp4:
    case TokenFormat::kMxfp8:
      d.push_back(contiguous("scales", DType::kU8, {out.swizzled().size()}));
      break;
    case TokenFormat::kMxfp4:
      d.push_back(contiguous("scales", DType::kU8, {out.mxfp4().rows, out.mxfp4().cols()}));
      break;
    default:
      d.push_back(contiguous("scales", DType::kU8, {0}));
      break;
  }
  d.push_back(contiguous("scales_offsets", DType::kI32, {sizes.num_scales_offsets}));
  // The padded layout's own outputs (DispatchOutput): empty when packed.
  d.push_back(contiguous("counts", DType::kI32, {C > 0 ? G : 0}));
  d.push_back(contiguous("slot_token", DType::kI32, {C > 0 ? G : 0, C}));
  d.push_back(contiguous("layout_range", DType::kI64, {C > 0 ? G : 0, sizes.n_ranks}));
  return d;
}

TensorDesc combine_output_desc(const Config& cfg, int32_t num_tokens, bool reduced,
                               int32_t hidden) {
  const int64_t H = hidden > 0 ? hidden : cfg.hidden;
  if (reduced) return contiguous("out", DType::kBF16, {num_tokens, H});
  return contiguous("out", DType::kBF16, {num_tokens, cfg.top_k, H});
}

TensorDesc expert_out_desc(const Config& cfg, const Sizes& sizes) {
  return contiguous("expert_out", DType::kBF16, {sizes.max_recv_rows, cfg.hidden});
}

const TensorDesc* find_desc(const std::vector<TensorDesc>& descs, const std::string& name) {
  for (const TensorDesc& d : descs)
    if (name == d.name) return &d;
  return nullptr;
}

int64_t desc_bytes(const std::vector<TensorDesc>& descs, const std::string& name) {
  const TensorDesc* d = find_desc(descs, name);
  return d ? d->bytes() : 0;
}

}  // namespace epcomm
