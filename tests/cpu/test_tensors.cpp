// The tensor descriptions (epcomm/tensors.h) of every format against Sizes and the scale layouts.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epcomm/config.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/layout.h"
#include "epcomm/tensors.h"

using namespace epcomm;

namespace {

using Shape = std::vector<int64_t>;

Config config_of(TokenFormat f, int32_t hidden) {
  Config c;
  c.hidden = hidden;
  c.top_k = 8;
  c.n_experts = 256;
  c.max_tokens_per_rank = 128;
  c.format = f;
  return c;
}

// The description named `name`; fails the test when there is none.
TensorDesc desc(const std::vector<TensorDesc>& descs, const char* name) {
  const TensorDesc* d = find_desc(descs, name);
  EXPECT_NE(d, nullptr) << name;
  return d ? *d : TensorDesc{};
}

// Row-major strides of every description.
void expect_contiguous(const TensorDesc& d) {
  ASSERT_EQ(d.strides.size(), d.shape.size()) << d.name;
  int64_t stride = 1;
  for (size_t i = d.shape.size(); i-- > 0;) {
    EXPECT_EQ(d.strides[i], stride) << d.name << " dimension " << i;
    stride *= d.shape[i];
  }
}

// The output layout the kernels see for this configuration.
DispatchOutputLayout output_layout(const Config& c, const Sizes& s) {
  return DispatchOutputLayout::make(c.format, c.hidden, s.max_routed_rows, s.num_groups,
                                    c.padded_capacity, c.fp8_ue8m0_scales);
}

// One configuration: every output against Sizes and the format's scale layout.
void check_dispatch_descs(const Config& c, int n_ranks) {
  SCOPED_TRACE(std::string(token_format_name(c.format)) + " H " + std::to_string(c.hidden));
  const Sizes s = compute_sizes(c, n_ranks);
  const std::vector<TensorDesc> d = dispatch_output_descs(c, s);
  ASSERT_EQ(d.size(), 9u);
  const char* order[] = {"tokens",         "row_offsets", "expert_ids", "src_info",    "scales",
                         "scales_offsets", "counts",      "slot_token", "layout_range"};
  // (DispatchOutput's members, in order)
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_EQ(std::string(d[i].name), order[i]);
    expect_contiguous(d[i]);
  }
  const int64_t R = s.max_recv_rows, H = c.hidden, G = s.num_groups;

  const TensorDesc tokens = desc(d, "tokens");
  EXPECT_EQ(tokens.bytes(), R * s.token_bytes);
  // What the dispatch's input-overlap check takes as the tokens output's extent.
  EXPECT_EQ(output_layout(c, s).tokens_bytes(), tokens.bytes());
  EXPECT_EQ(tokens.shape[0], R);
  switch (c.format) {
    case TokenFormat::kBF16:
      EXPECT_EQ(tokens.dtype, DType::kBF16);
      EXPECT_EQ(tokens.shape, (Shape{R, H}));
      break;
    case TokenFormat::kFp8Blockwise:
    case TokenFormat::kMxfp8:
      EXPECT_EQ(tokens.dtype, DType::kFloat8E4M3);
      EXPECT_EQ(tokens.shape, (Shape{R, H}));
      break;
    case TokenFormat::kNvfp4:
    case TokenFormat::kMxfp4:
      EXPECT_EQ(tokens.dtype, DType::kU8);
      EXPECT_EQ(tokens.shape, (Shape{R, H / 2}));
      break;
  }

  EXPECT_EQ(desc(d, "row_offsets").shape, (Shape{G + 1}));
  EXPECT_EQ(desc(d, "row_offsets").dtype, DType::kI32);
  EXPECT_EQ(desc(d, "expert_ids").shape, (Shape{G}));
  EXPECT_EQ(desc(d, "expert_ids").dtype, DType::kI32);
  EXPECT_EQ(desc(d, "src_info").shape, (Shape{R, 2}));
  EXPECT_EQ(desc(d, "src_info").bytes(), R * int64_t(sizeof(SrcInfo)));

  const TensorDesc scales = desc(d, "scales");
  EXPECT_EQ(scales.bytes(), s.scales_bytes);
  switch (c.format) {
    case TokenFormat::kBF16:
      EXPECT_EQ(scales.shape, (Shape{0}));
      break;
    case TokenFormat::kFp8Blockwise: {
      const Fp8ScaleLayout l{c.hidden, R};
      EXPECT_EQ(scales.dtype, DType::kF32);
      EXPECT_EQ(scales.shape, (Shape{H / 128, R}));
      EXPECT_EQ(scales.numel(), l.size());
      EXPECT_EQ(scales.strides[0], l.offset(0, 1));  // scale k of row r at k * ld + r
      EXPECT_EQ(R, Fp8ScaleLayout::max_rows(s.max_routed_rows, s.num_groups));
      break;
    }
    case TokenFormat::kNvfp4:
    case TokenFormat::kMxfp8: {
      const SwizzledScaleLayout l = SwizzledScaleLayout::make(
          c.hidden, format_scale_group(c.format), s.max_routed_rows, s.num_groups);
      EXPECT_EQ(scales.dtype, DType::kU8);
      EXPECT_EQ(scales.shape, (Shape{l.size()}));
      EXPECT_EQ(R, s.max_routed_rows);  // the swizzled formats pad scale tiles, not rows
      break;
    }
    case TokenFormat::kMxfp4: {
      const Mxfp4ScaleLayout l{c.hidden, R};
      EXPECT_EQ(scales.dtype, DType::kU8);
      EXPECT_EQ(scales.shape, (Shape{R, H / 32}));
      EXPECT_EQ(scales.numel(), l.size());
      EXPECT_EQ(scales.strides[0], l.offset(1, 0));
      break;
    }
  }

  const TensorDesc offsets = desc(d, "scales_offsets");
  EXPECT_EQ(offsets.dtype, DType::kI32);
  EXPECT_EQ(offsets.shape, (Shape{s.num_scales_offsets}));
  EXPECT_EQ(offsets.shape, (Shape{format_swizzled(c.format) ? G : 0}));

  EXPECT_EQ(expert_out_desc(c, s).shape, (Shape{R, H}));
  EXPECT_EQ(expert_out_desc(c, s).dtype, DType::kBF16);
}

}  // namespace

TEST(Tensors, DispatchOutputsOfEveryFormat) {
  for (int32_t f = 0; f < kNumTokenFormats; ++f) {
    const TokenFormat format = TokenFormat(f);
    for (int32_t hidden : {7168, 2880, 2048}) {
      if (hidden % format_hidden_multiple(format) != 0) continue;
      Config c = config_of(format, hidden);
      check_dispatch_descs(c, 8);
      c.shared_expert = true;  // one more group, T more rows
      check_dispatch_descs(c, 8);
      c.max_routed_rows = 1000;  // a cap: FP8 pads on top of it
      check_dispatch_descs(c, 8);
    }
  }
}

TEST(Tensors, CombineOutput) {
  const Config c = config_of(TokenFormat::kBF16, 7168);
  const TensorDesc reduced = combine_output_desc(c, 100, true);
  EXPECT_EQ(reduced.shape, (Shape{100, 7168}));
  EXPECT_EQ(reduced.dtype, DType::kBF16);
  EXPECT_EQ(reduced.bytes(), 100 * 7168 * 2);
  const TensorDesc unreduced = combine_output_desc(c, 100, false);
  EXPECT_EQ(unreduced.shape, (Shape{100, 8, 7168}));
  EXPECT_EQ(unreduced.strides, (Shape{8 * 7168, 7168, 1}));
  EXPECT_EQ(combine_output_desc(c, 0, true).bytes(), 0);
  // A combine of fewer columns (CombineInput::hidden) gives rows that wide.
  EXPECT_EQ(combine_output_desc(c, 100, true, 1024).shape, (Shape{100, 1024}));
  EXPECT_EQ(combine_output_desc(c, 100, false, 16).strides, (Shape{8 * 16, 16, 1}));
}

TEST(Tensors, NamesAndLookup) {
  EXPECT_STREQ(dtype_name(DType::kBF16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kFloat8E4M3), "float8_e4m3fn");
  EXPECT_EQ(dtype_bytes(DType::kF32), 4);
  const Config c = config_of(TokenFormat::kBF16, 7168);
  const std::vector<TensorDesc> d = dispatch_output_descs(c, compute_sizes(c, 8));
  EXPECT_EQ(find_desc(d, "nothing"), nullptr);
  EXPECT_EQ(desc_bytes(d, "nothing"), 0);
  EXPECT_EQ(desc_bytes(d, "scales"), 0);  // bf16 has no scales
  EXPECT_EQ(desc_bytes(d, "expert_ids"), 32 * 4);
}

// The padded layout's outputs: tokens [G, C, row], scales [G, H/128, C] fp32 or [G, H/512, C]
// UE8M0 words, counts [G], slot_token [G, C], layout_range [G, n_ranks] int64; src_info stays
// packed; the three are empty when packed.
TEST(Tensors, PaddedLayoutOutputs) {
  Config c = config_of(TokenFormat::kFp8Blockwise, 7168);
  const Sizes packed = compute_sizes(c, 8);
  const auto pd = dispatch_output_descs(c, packed);
  for (const char* name : {"counts", "slot_token", "layout_range"})
    EXPECT_EQ(desc(pd, name).numel(), 0) << name;
  c.padded_capacity = int64_t(8) * c.max_tokens_per_rank + 5;
  const int64_t C = c.padded_capacity;
  const Sizes s = compute_sizes(c, 8);
  const int64_t G = s.num_groups;
  const auto d = dispatch_output_descs(c, s);
  EXPECT_EQ(desc(d, "tokens").shape, (Shape{G, C, 7168}));
  EXPECT_EQ(desc(d, "tokens").dtype, DType::kFloat8E4M3);
  EXPECT_EQ(output_layout(c, s).tokens_bytes(), desc(d, "tokens").bytes());
  EXPECT_EQ(desc(d, "scales").shape, (Shape{G, 56, C}));
  EXPECT_EQ(desc(d, "scales").dtype, DType::kF32);
  EXPECT_EQ(desc(d, "scales").bytes(), s.scales_bytes);
  EXPECT_EQ(desc(d, "src_info").shape[0], s.max_routed_rows);
  EXPECT_EQ(desc(d, "counts").shape, (Shape{G}));
  EXPECT_EQ(desc(d, "slot_token").shape, (Shape{G, C}));
  EXPECT_EQ(desc(d, "layout_range").shape, (Shape{G, 8}));
  EXPECT_EQ(desc(d, "layout_range").dtype, DType::kI64);
  EXPECT_STREQ(dtype_name(DType::kI64), "int64");
  EXPECT_EQ(dtype_bytes(DType::kI64), 8);
  c.fp8_pow2_scales = c.fp8_ue8m0_scales = true;
  const Sizes u = compute_sizes(c, 8);
  const auto w = dispatch_output_descs(c, u);
  EXPECT_EQ(desc(w, "scales").shape, (Shape{G, 14, C}));
  EXPECT_EQ(desc(w, "scales").dtype, DType::kI32);
  EXPECT_EQ(desc(w, "scales").bytes(), u.scales_bytes);
  c = config_of(TokenFormat::kBF16, 2048);
  c.padded_capacity = int64_t(8) * c.max_tokens_per_rank;
  const auto b = dispatch_output_descs(c, compute_sizes(c, 8));
  EXPECT_EQ(desc(b, "tokens").shape, (Shape{G, c.padded_capacity, 2048}));
  EXPECT_EQ(desc(b, "scales").numel(), 0);
}
