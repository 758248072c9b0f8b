// The quantised dispatch reference: output shapes per format (docs/design.md "Dispatch", "Token formats", design rule 3), a hand-worked
// problem, and random problems with large magnitudes and zero tokens, whose outputs are checked
// row by row against the bf16 dispatch: the row map and padding, codes and scales against the
// row encoders, scales at their layout positions, and decode(encode) within each format's bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "epcomm/bf16.h"
#include "epcomm/error.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/reference.h"

namespace epcomm {
namespace {

using reference::QuantDispatchResult;
using reference::QuantFormat;
using reference::QuantizedRows;
using reference::QuantOutputShape;

constexpr QuantFormat kFormats[] = {QuantFormat::kFp8Blockwise, QuantFormat::kNvfp4,
                                    QuantFormat::kMxfp8, QuantFormat::kMxfp4};

const char* name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kFp8Blockwise:
      return "fp8";
    case QuantFormat::kNvfp4:
      return "nvfp4";
    case QuantFormat::kMxfp8:
      return "mxfp8";
    case QuantFormat::kMxfp4:
      return "mxfp4";
  }
  return "?";
}

TEST(QuantDispatchReference, OutputShapes) {
  // H = 256, at most 16 routed rows in 4 groups.
  const QuantOutputShape fp8 =
      reference::dispatch_output_shape(QuantFormat::kFp8Blockwise, 256, 16, 4);
  EXPECT_EQ(fp8.rows, 28);  // 16 + 4 * 3 padding rows, a multiple of 4 (docs/design.md design rule 3)
  EXPECT_EQ(fp8.row_bytes(), 256);
  EXPECT_EQ(fp8.codes_size(), 28 * 256);
  EXPECT_EQ(fp8.scales_size(), 2 * 28);  // [H / 128, rows]
  EXPECT_EQ(fp8.fp8_layout().ld, 28);
  EXPECT_EQ(reference::dispatch_output_shape(QuantFormat::kFp8Blockwise, 256, 17, 4).rows, 32);

  const QuantOutputShape nv = reference::dispatch_output_shape(QuantFormat::kNvfp4, 256, 16, 4);
  EXPECT_EQ(nv.rows, 16);  // NVFP4 pads scale tiles, not rows
  EXPECT_EQ(nv.row_bytes(), 128);
  // [(16 + 4 * 128) / 128, 256 / 64, 32, 4, 4]
  EXPECT_EQ(nv.swizzled_layout().row_tiles, 4);
  EXPECT_EQ(nv.swizzled_layout().col_tiles(), 4);
  EXPECT_EQ(nv.scales_size(), 4 * 4 * 512);

  const QuantOutputShape mx8 = reference::dispatch_output_shape(QuantFormat::kMxfp8, 256, 16, 4);
  EXPECT_EQ(mx8.rows, 16);
  EXPECT_EQ(mx8.row_bytes(), 256);
  EXPECT_EQ(mx8.scales_size(), 4 * 2 * 512);  // 8 scale columns: 2 column tiles

  const QuantOutputShape mx4 = reference::dispatch_output_shape(QuantFormat::kMxfp4, 256, 16, 4);
  EXPECT_EQ(mx4.rows, 16);
  EXPECT_EQ(mx4.row_bytes(), 128);
  EXPECT_EQ(mx4.scales_size(), 16 * 8);  // row-major [rows, H / 32]

  EXPECT_THROW(reference::dispatch_output_shape(QuantFormat::kFp8Blockwise, 64, 16, 4), Error);
  EXPECT_THROW(reference::dispatch_output_shape(QuantFormat::kNvfp4, 24, 16, 4), Error);
  EXPECT_THROW(reference::dispatch_output_shape(QuantFormat::kMxfp8, 48, 16, 4), Error);
  EXPECT_THROW(reference::dispatch_output_shape(QuantFormat::kMxfp4, 256, -1, 4), Error);
  EXPECT_THROW(reference::dispatch_output_shape(QuantFormat::kMxfp4, 256, 16, 0), Error);
}

// 2 ranks, 4 experts (2 per rank), K = 2, H = 128: the routing of test_reference.cpp's tiny
// problem. Token t of rank s has every value s*100 + t + 1.
reference::Problem tiny(int32_t hidden) {
  reference::Problem p;
  p.n_ranks = 2;
  p.hidden = hidden;
  p.top_k = 2;
  p.n_experts = 4;
  const std::vector<std::vector<int32_t>> ids = {{1, 2, 3, -1, 0, 1}, {2, 3, 1, 0}};
  for (int s = 0; s < 2; ++s) {
    reference::RankInput in;
    in.num_tokens = int32_t(ids[size_t(s)].size() / 2);
    in.topk_ids = ids[size_t(s)];
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int h = 0; h < hidden; ++h)
        in.tokens.push_back(float_to_bf16(float(s * 100 + t + 1)));
    }
    in.weights.assign(size_t(in.num_tokens) * 2, 0.5f);
    p.ranks.push_back(in);
  }
  return p;
}

TEST(QuantDispatchReference, Fp8HandWorked) {
  // Rank 0 receives expert 0: (s0,t2), (s1,t1) and expert 1: (s0,t0), (s0,t2), (s1,t1): counts
  // 2 and 3, padded to 4 and 4. Room: 5 routed rows -> align_up(5 + 2 * 3, 4) = 12 rows.
  const QuantDispatchResult r =
      reference::dispatch_quantized(tiny(128), 0, QuantFormat::kFp8Blockwise, 1.0f);
  EXPECT_EQ(r.row_offsets, (std::vector<uint32_t>{0, 4, 8}));
  EXPECT_EQ(r.expert_ids, (std::vector<int32_t>{0, 1}));
  ASSERT_EQ(r.rows(), 8);
  EXPECT_EQ(r.out.shape.rows, 12);
  // Output rows: token value per row (0: padding).
  const int values[8] = {3, 102, 0, 0, 1, 3, 102, 0};
  const int ranks[8] = {0, 1, -1, -1, 0, 0, 1, -1};
  const int tokens[8] = {2, 1, -1, -1, 0, 2, 1, -1};
  const int slots[8] = {0, 1, -1, -1, 0, 1, 0, -1};
  ASSERT_EQ(r.out.fp8_scales.size(), 12u);  // one column of 12
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(r.src_info[size_t(i)].rank, ranks[i]) << i;
    EXPECT_EQ(r.src_info[size_t(i)].token, tokens[i]) << i;
    EXPECT_EQ(r.src_info[size_t(i)].slot, slots[i]) << i;
    // A constant row v: s = v / 448 and every code is +448 (0x7e); padding rows: zeros.
    const float s = values[i] == 0 ? 0.0f : float(values[i]) / 448.0f;
    EXPECT_EQ(r.out.fp8_scales[size_t(i)], s) << i;
    for (int h = 0; h < 128; ++h)
      ASSERT_EQ(r.out.codes[size_t(i * 128 + h)], values[i] == 0 ? 0 : 0x7e) << i << " " << h;
  }
  for (size_t i = 8; i < 12; ++i)
    EXPECT_EQ(r.out.fp8_scales[i], 0.0f);
}

TEST(QuantDispatchReference, Nvfp4HandWorked) {
  // Rank 0 again, H = 64, gs = 1: rows are not padded; group 1 (3 rows) starts scale tile 1.
  // A constant row v: sf = e4m3(v / 6), codes e2m1(v * (1 / sf)) ~ 6 (7).
  const QuantDispatchResult r =
      reference::dispatch_quantized(tiny(64), 0, QuantFormat::kNvfp4, 1.0f, 8);
  EXPECT_EQ(r.row_offsets, (std::vector<uint32_t>{0, 2, 5}));
  EXPECT_EQ(r.out.scales_offsets, (std::vector<uint32_t>{0, 1}));
  // (8 + 2 * 128) / 128 = 2 row tiles of one column tile.
  ASSERT_EQ(r.out.scales.size(), 1024u);
  const int values[5] = {3, 102, 1, 3, 102};
  for (int i = 0; i < 5; ++i) {
    const uint8_t sf = float_to_e4m3(float(values[i]) / 6.0f);
    // Group 0 rows 0, 1 at scale rows 0, 1; group 1 rows 2..4 at scale rows 128..130:
    // byte (row % 32) * 16 of its tile, four scales per row.
    const int64_t tile = i < 2 ? 0 : 1, sub = i < 2 ? i : i - 2;
    for (int c = 0; c < 4; ++c)
      EXPECT_EQ(r.out.scales[size_t(tile * 512 + sub * 16 + c)], sf) << i << " " << c;
    EXPECT_EQ(r.src_info[size_t(i)].rank, i == 1 || i == 4 ? 1 : 0);
  }
  size_t nonzero = 0;
  for (uint8_t b : r.out.scales)
    nonzero += b != 0;
  EXPECT_EQ(nonzero, 5u * 4u);
  // 3 / 6 = 0.5 = e4m3 0x30: 3 * 2 = 6 -> code 7 in both nibbles.
  EXPECT_EQ(r.out.codes[0], 0x77);
}

// A random problem (4 ranks, 16 experts, K = 8: groups of ~220 rows) with large magnitudes and
// zero tokens: make_problem's bf16 tokens with every 32-value chunk scaled by 1e4, 1, 1e-3, 37
// or 0 (by chunk and token) and every seventh token all zero.
reference::Problem wild_problem(int32_t hidden, uint64_t seed) {
  reference::Problem p =
      reference::make_problem(4, hidden, 8, 16, {150, 0, 97, 200}, seed, 0.0, 0.1);
  const float scales[5] = {1e4f, 1.0f, 1e-3f, 37.0f, 0.0f};
  for (reference::RankInput& in : p.ranks) {
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      for (int32_t h = 0; h < hidden; ++h) {
        uint16_t& x = in.tokens[size_t(t) * size_t(hidden) + size_t(h)];
        const float f = t % 7 == 3 ? 0.0f : bf16_to_float(x) * scales[(t + h / 32) % 5];
        x = float_to_bf16(f);
      }
    }
  }
  return p;
}

// Where the scale of block c of output row r lives in a format's output (hand formulas, written
// out rather than taken from the layout types).
int64_t scale_index(const QuantizedRows& q, const std::vector<uint32_t>& row_offsets, int64_t r,
                    int32_t c) {
  const QuantOutputShape& s = q.shape;
  switch (s.format) {
    case QuantFormat::kFp8Blockwise:
      return int64_t(c) * s.rows + r;
    case QuantFormat::kMxfp4:
      return r * (s.hidden / 32) + c;
    default: {
      // Group g's tiles start at the exclusive prefix of ceil(m / 128); element (row, col) at
      // [row / 128, col / 4, row % 32, (row % 128) / 32, col % 4].
      int64_t tile = 0;
      size_t g = 0;
      while (row_offsets[g + 1] <= r) {
        tile += (row_offsets[g + 1] - row_offsets[g] + 127) / 128;
        ++g;
      }
      const int64_t sr = tile * 128 + (r - row_offsets[g]);
      const int64_t col_tiles = (s.hidden / s.group() + 3) / 4;
      return (((sr / 128) * col_tiles + c / 4) * 32 + sr % 32) * 16 + (sr % 128) / 32 * 4 + c % 4;
    }
  }
}

// Encodes one row with the format's row encoder: codes and scales (as floats).
void encode_row(QuantFormat f, const float* x, int32_t hidden, float gs,
                std::vector<uint8_t>* codes, std::vector<float>* scales) {
  std::vector<uint8_t> byte_scales(size_t(hidden / 16));
  switch (f) {
    case QuantFormat::kFp8Blockwise:
      reference::encode_fp8_blockwise(x, 1, hidden, codes->data(), scales->data());
      return;
    case QuantFormat::kNvfp4:
      reference::encode_nvfp4(x, 1, hidden, gs, codes->data(), byte_scales.data());
      break;
    case QuantFormat::kMxfp8:
      reference::encode_mxfp8(x, 1, hidden, codes->data(), byte_scales.data());
      break;
    case QuantFormat::kMxfp4:
      reference::encode_mxfp4(x, 1, hidden, codes->data(), byte_scales.data());
      break;
  }
  for (size_t i = 0; i < scales->size(); ++i)
    (*scales)[i] = float(byte_scales[i]);
}

double error_bound(QuantFormat f, float amax, float gs) {
  switch (f) {
    case QuantFormat::kFp8Blockwise:
      return reference::fp8_blockwise_error_bound(amax);
    case QuantFormat::kNvfp4:
      return reference::nvfp4_error_bound(amax, gs);
    case QuantFormat::kMxfp8:
      return reference::mxfp8_error_bound(amax);
    case QuantFormat::kMxfp4:
      return reference::mxfp4_error_bound(amax);
  }
  return 0.0;
}

void check_rank(const reference::Problem& p, int32_t rank, QuantFormat f, float gs,
                int64_t max_routed_rows) {
  SCOPED_TRACE(std::string(name(f)) + " rank " + std::to_string(rank));
  const int32_t H = p.hidden;
  const reference::DispatchResult bf16 = reference::dispatch(p, rank);
  const QuantDispatchResult q = reference::dispatch_quantized(p, rank, f, gs, max_routed_rows);
  const QuantOutputShape& shape = q.out.shape;
  const int32_t G = int32_t(bf16.expert_ids.size());
  const int32_t group = shape.group(), cols = H / group;
  const bool fp8 = f == QuantFormat::kFp8Blockwise;
  const bool swizzled = f == QuantFormat::kNvfp4 || f == QuantFormat::kMxfp8;

  // Shape and row_offsets.
  EXPECT_EQ(shape.rows, fp8 ? Fp8ScaleLayout::max_rows(max_routed_rows, G) : max_routed_rows);
  ASSERT_EQ(q.row_offsets.size(), size_t(G) + 1);
  EXPECT_EQ(q.expert_ids, bf16.expert_ids);
  EXPECT_EQ(q.row_offsets[0], 0u);
  for (int32_t g = 0; g < G; ++g) {
    const uint32_t m = bf16.row_offsets[size_t(g) + 1] - bf16.row_offsets[size_t(g)];
    const uint32_t padded = q.row_offsets[size_t(g) + 1] - q.row_offsets[size_t(g)];
    EXPECT_EQ(padded, fp8 ? (m + 3) / 4 * 4 : m) << "group " << g;
    if (fp8) {
      EXPECT_EQ(q.row_offsets[size_t(g)] % 4, 0u);
    }
  }
  ASSERT_LE(q.rows(), shape.rows);
  ASSERT_EQ(int64_t(q.row_offsets.back()), q.rows());

  // scales_offsets by docs/design.md "Token formats": exclusive prefix of ceil(m_g / 128) minus row_offsets[g] / 128.
  if (swizzled) {
    ASSERT_EQ(q.out.scales_offsets.size(), size_t(G));
    uint32_t prefix = 0;
    for (int32_t g = 0; g < G; ++g) {
      EXPECT_EQ(q.out.scales_offsets[size_t(g)], prefix - q.row_offsets[size_t(g)] / 128) << g;
      prefix += (q.row_offsets[size_t(g) + 1] - q.row_offsets[size_t(g)] + 127) / 128;
    }
  } else {
    EXPECT_TRUE(q.out.scales_offsets.empty());
  }

  // Row by row: src_info, codes and scales against the row encoder, decode within the bound.
  const std::vector<float> dq =
      reference::dequantize_grouped_rows(q.out, q.row_offsets, std::vector<float>(size_t(G), gs));
  const bool float_scales = fp8;
  std::vector<bool> used(size_t(float_scales ? q.out.fp8_scales.size() : q.out.scales.size()));
  auto stored_scale = [&](int64_t i) {
    return float_scales ? q.out.fp8_scales[size_t(i)] : float(q.out.scales[size_t(i)]);
  };
  std::vector<uint8_t> codes(size_t(shape.row_bytes()));
  std::vector<float> scales(static_cast<size_t>(cols)), x(static_cast<size_t>(H));
  int64_t padding_rows = 0, zero_blocks = 0;
  for (int32_t g = 0; g < G; ++g) {
    const int64_t m = bf16.row_offsets[size_t(g) + 1] - bf16.row_offsets[size_t(g)];
    for (int64_t r = q.row_offsets[size_t(g)]; r < int64_t(q.row_offsets[size_t(g) + 1]); ++r) {
      const int64_t i = r - q.row_offsets[size_t(g)];
      const SrcInfo si = q.src_info[size_t(r)];
      const uint8_t* out_codes = q.out.codes.data() + r * shape.row_bytes();
      if (i >= m) {  // padding
        ++padding_rows;
        ASSERT_TRUE(si.rank == -1 && si.token == -1 && si.slot == -1) << "row " << r;
        for (int64_t b = 0; b < shape.row_bytes(); ++b)
          ASSERT_EQ(out_codes[b], 0) << "padding row " << r;
        for (int32_t c = 0; c < cols; ++c) {
          const int64_t at = scale_index(q.out, q.row_offsets, r, c);
          ASSERT_EQ(stored_scale(at), 0.0f) << "padding row " << r;
          used[size_t(at)] = true;
        }
        continue;
      }
      const int64_t from = bf16.row_offsets[size_t(g)] + i;
      const SrcInfo want = bf16.src_info[size_t(from)];
      ASSERT_TRUE(si.rank == want.rank && si.token == want.token && si.slot == want.slot)
          << "row " << r;
      std::transform(bf16.tokens.begin() + from * H, bf16.tokens.begin() + (from + 1) * H,
                     x.begin(), bf16_to_float);
      encode_row(f, x.data(), H, gs, &codes, &scales);
      for (int64_t b = 0; b < shape.row_bytes(); ++b)
        ASSERT_EQ(out_codes[b], codes[size_t(b)]) << "row " << r << " byte " << b;
      for (int32_t c = 0; c < cols; ++c) {
        const int64_t at = scale_index(q.out, q.row_offsets, r, c);
        ASSERT_EQ(stored_scale(at), scales[size_t(c)]) << "row " << r << " block " << c;
        used[size_t(at)] = true;
        const float amax = reference::block_amax(&x[size_t(c * group)], group);
        zero_blocks += amax == 0.0f;
        if (amax == 0.0f) {
          // Zero blocks (their codes are checked above): zero scales but for FP8's 1e-4 floor.
          const float zero_scale = fp8 ? 1e-4f / 448.0f : 0.0f;
          ASSERT_EQ(scales[size_t(c)], zero_scale) << "row " << r;
        }
        const double bound = error_bound(f, amax, gs);
        for (int32_t k = c * group; k < (c + 1) * group; ++k) {
          const double err = std::fabs(double(dq[size_t(r * H + k)]) - double(x[size_t(k)]));
          ASSERT_LE(err, bound) << "row " << r << " col " << k;
        }
      }
    }
  }
  EXPECT_GT(zero_blocks, 0);
  if (fp8) {
    EXPECT_GT(padding_rows, 0);
  }
  // Everything else is zero: rows past row_offsets[G] and unused scale slots.
  for (size_t b = size_t(q.rows() * shape.row_bytes()); b < q.out.codes.size(); ++b)
    ASSERT_EQ(q.out.codes[b], 0) << "byte " << b;
  for (size_t i = 0; i < used.size(); ++i)
    if (!used[i]) {
      ASSERT_EQ(stored_scale(int64_t(i)), 0.0f) << "unused scale slot " << i;
    }
}

TEST(QuantDispatchReference, RandomProblemsMatchTheBf16Dispatch) {
  const reference::Problem p = wild_problem(256, 11);
  // The worst case a rank can receive: max_tokens_per_rank * n_ranks * min(K, n_local), K = 8.
  const int64_t max_routed = 200 * 4 * 4;
  float global_amax = 0.0f;
  for (const reference::RankInput& in : p.ranks)
    for (uint16_t t : in.tokens)
      global_amax = abs_max(global_amax, bf16_to_float(t));
  const float gs = 448.0f * 6.0f / global_amax;
  bool big_group = false;
  for (int32_t rank = 0; rank < 4; ++rank) {
    const reference::DispatchResult bf16 = reference::dispatch(p, rank);
    for (size_t g = 0; g + 1 < bf16.row_offsets.size(); ++g)
      big_group |= bf16.row_offsets[g + 1] - bf16.row_offsets[g] > 128;
    for (QuantFormat f : kFormats) {
      check_rank(p, rank, f, f == QuantFormat::kNvfp4 && rank % 2 ? 1.0f : gs, max_routed);
      // The smallest room that fits: the rows this rank receives.
      check_rank(p, rank, f, gs, bf16.rows());
    }
  }
  EXPECT_TRUE(big_group) << "some group should span more than one 128-row scale tile";
}

TEST(QuantDispatchReference, Rejects) {
  const reference::Problem p = tiny(128);
  // Rank 0 receives 5 rows.
  EXPECT_THROW(reference::dispatch_quantized(p, 0, QuantFormat::kMxfp8, 1.0f, 4), Error);
  EXPECT_NO_THROW(reference::dispatch_quantized(p, 0, QuantFormat::kMxfp8, 1.0f, 5));
  EXPECT_THROW(reference::dispatch_quantized(p, 0, QuantFormat::kNvfp4, 0.0f), Error);
  EXPECT_THROW(reference::dispatch_quantized(p, 0, QuantFormat::kNvfp4, NAN), Error);
  EXPECT_THROW(reference::dispatch_quantized(tiny(64), 0, QuantFormat::kFp8Blockwise, 1.0f), Error);
  // quantize_grouped_rows: groups, room, FP8 alignment.
  const std::vector<float> x(8 * 128, 1.0f);
  const QuantOutputShape fp8{QuantFormat::kFp8Blockwise, 128, 2, 8};
  EXPECT_NO_THROW(reference::quantize_grouped_rows(fp8, x.data(), {0, 4, 8}, {}, nullptr));
  EXPECT_THROW(reference::quantize_grouped_rows(fp8, x.data(), {0, 3, 8}, {}, nullptr), Error);
  EXPECT_THROW(reference::quantize_grouped_rows(fp8, x.data(), {0, 8}, {}, nullptr), Error);
  EXPECT_THROW(reference::quantize_grouped_rows(fp8, x.data(), {0, 4, 12}, {}, nullptr), Error);
  const QuantOutputShape nv{QuantFormat::kNvfp4, 128, 2, 8};
  EXPECT_THROW(reference::quantize_grouped_rows(nv, x.data(), {0, 3, 8}, {1.0f}, nullptr), Error);
}

// ---- compare_dispatch_quantized ---------------------------------------------------------------

// XORs byte `byte` of *p with 0x5a: a one-byte change of any array element.
template <class T>
void flip(T* p, int64_t byte = 0) {
  reinterpret_cast<uint8_t*>(p)[byte] ^= 0x5a;
}

// Expects msg to be a mismatch that names every one of `parts`.
void expect_names(const std::string& msg, const std::vector<std::string>& parts) {
  EXPECT_FALSE(msg.empty());
  for (const std::string& part : parts)
    EXPECT_NE(msg.find(part), std::string::npos) << "\"" << part << "\" not in: " << msg;
}

// "row r (group g, rank s token t slot k)" or "row r (group g, padding)" as the messages write
// a row (written out here).
std::string row_name(const QuantDispatchResult& q, int64_t r) {
  size_t g = 0;
  while (q.row_offsets[g + 1] <= r)
    ++g;
  const SrcInfo si = q.src_info[size_t(r)];
  std::string s = "row " + std::to_string(r) + " (group " + std::to_string(g);
  if (si.rank < 0) return s + ", padding)";
  return s + ", rank " + std::to_string(si.rank) + " token " + std::to_string(si.token) + " slot " +
         std::to_string(si.slot) + ")";
}

TEST(QuantDispatchReference, CompareDispatchQuantized) {
  // Rank 0 of 2 ranks, 4 experts, K = 2, 10% of slots masked: 2 groups of ~200 rows (two scale
  // tiles each, the last one part used), with room for 1200 routed rows (tiles no group uses,
  // rows past row_offsets[G]). H = 2880 gives MXFP8 90 scale columns: 2 columns of padding.
  const int64_t room = 1200;
  for (QuantFormat f : kFormats) {
    SCOPED_TRACE(name(f));
    const int32_t H = f == QuantFormat::kFp8Blockwise ? 384 : 2880;
    const reference::Problem p = reference::make_problem(2, H, 2, 4, {300, 200}, 5, 0.0, 0.1);
    const QuantDispatchResult ref = reference::dispatch_quantized(p, 0, f, 1.0f, room);
    const QuantOutputShape& shape = ref.out.shape;
    const int64_t rows = ref.rows(), row_bytes = shape.row_bytes();
    const int32_t cols = H / shape.group();
    ASSERT_EQ(ref.row_offsets.size(), 3u);
    ASSERT_GT(rows, 256);
    ASSERT_LT(rows, shape.rows);
    auto compare = [&](const QuantDispatchResult& got) {
      return reference::compare_dispatch_quantized(ref, got.view());
    };

    // Equal to itself, and to itself with the codes cut to the rows in use (as the bench keeps it).
    EXPECT_EQ(compare(ref), "");
    QuantDispatchResult trimmed = ref;
    trimmed.out.codes.resize(size_t(rows * row_bytes));
    EXPECT_EQ(reference::compare_dispatch_quantized(trimmed, ref.view()), "");
    EXPECT_EQ(reference::compare_dispatch_quantized(ref, trimmed.view()), "");

    // Sizes, row_offsets, expert_ids.
    {
      reference::QuantizedDispatchView v = ref.view();
      v.rows += 4;
      expect_names(reference::compare_dispatch_quantized(ref, v),
                   {"sizes (groups 2, rows " + std::to_string(shape.rows + 4), "differ from"});
      v = ref.view();
      v.scales_bytes -= 1;
      expect_names(reference::compare_dispatch_quantized(ref, v),
                   {"sizes (", "differ from", "scale bytes"});
      QuantDispatchResult got = ref;
      flip(&got.row_offsets[1]);
      expect_names(compare(got), {"row_offsets[1] = "});
      got = ref;
      flip(&got.expert_ids[1]);
      expect_names(compare(got), {"expert_ids[1] = "});
    }

    // src_info: a routed row, and (FP8) a padding row.
    const int64_t r = ref.row_offsets[1] + 3;
    {
      QuantDispatchResult got = ref;
      flip(&got.src_info[size_t(r)], 1);  // a byte of the token index
      expect_names(compare(got), {"src_info[" + std::to_string(r) + "] (group 1) = "});
    }
    int64_t pad = -1;
    for (int64_t i = 0; i < rows && pad < 0; ++i)
      if (ref.src_info[size_t(i)].rank < 0) pad = i;
    EXPECT_EQ(pad >= 0, f == QuantFormat::kFp8Blockwise);
    if (pad >= 0) {
      QuantDispatchResult got = ref;
      flip(&got.src_info[size_t(pad)], 4);  // the rank
      expect_names(compare(got), {"src_info[" + std::to_string(pad) + "]",
                                  "expected padding (rank -1, token -1, slot -1)"});
    }

    // Codes: a byte of row r; past row_offsets[G] nothing is compared.
    {
      QuantDispatchResult got = ref;
      flip(&got.out.codes[size_t(r * row_bytes + 7)]);
      expect_names(compare(got), {"codes of " + row_name(ref, r) + " byte 7 (value column " +
                                  (row_bytes == H ? "7)" : "14 and the next)")});
      got = ref;
      flip(&got.out.codes[size_t(rows * row_bytes + 7)]);
      EXPECT_EQ(compare(got), "");
    }

    // Scales.
    switch (f) {
      case QuantFormat::kFp8Blockwise: {
        // Scale k of row r at k * shape.rows + r; a padding row's; none past row_offsets[G].
        QuantDispatchResult got = ref;
        flip(&got.out.fp8_scales[size_t(2 * shape.rows + r)], 3);
        expect_names(compare(got),
                     {"FP8 scale of " + row_name(ref, r) + " column 2 (values [256, 384)"});
        ASSERT_GE(pad, 0);
        got = ref;
        flip(&got.out.fp8_scales[size_t(1 * shape.rows + pad)], 2);
        expect_names(compare(got),
                     {"FP8 scale of " + row_name(ref, pad) + " column 1", ", padding)"});
        got = ref;
        flip(&got.out.fp8_scales[size_t(1 * shape.rows + rows)]);
        EXPECT_EQ(compare(got), "");
        break;
      }
      case QuantFormat::kNvfp4:
      case QuantFormat::kMxfp8: {
        const SwizzledScaleLayout layout = shape.swizzled_layout();
        const SwizzledGroup g1{ref.row_offsets[1], ref.out.scales_offsets[1]};
        const int64_t m1 = int64_t(ref.row_offsets[2] - ref.row_offsets[1]);
        ASSERT_NE(m1 % 128, 0);
        // A row's scale: [tile row, tile col, row % 32, (row % 128) / 32, col % 4].
        const int64_t sr = g1.scale_row(r);
        QuantDispatchResult got = ref;
        const int64_t used = layout.offset(sr, 5);
        flip(&got.out.scales[size_t(used)]);
        expect_names(compare(got),
                     {"swizzled scale byte " + std::to_string(used) + " = [tile row " +
                          std::to_string(sr / 128) + ", tile col 1, " + std::to_string(sr % 32) +
                          ", " + std::to_string(sr % 128 / 32) + ", 1]",
                      "(scale row " + std::to_string(sr) +
                          ", scale column 5): " + row_name(ref, r) + " column 5"});
        // An unused slot of group 1's last tile (the row after its last).
        got = ref;
        const int64_t unused = layout.offset(g1.scale_row(ref.row_offsets[2]), 0);
        flip(&got.out.scales[size_t(unused)]);
        expect_names(compare(got),
                     {"byte " + std::to_string(unused), "an unused slot of group 1's last tile"});
        // A tile no group uses.
        const int64_t tiles = g1.tile_start() + (m1 + 127) / 128;
        ASSERT_LT(tiles, layout.row_tiles);
        got = ref;
        flip(&got.out.scales[size_t(layout.tile_offset(tiles, 0) + 17)]);
        expect_names(compare(got), {"a tile no group uses"});
        // MXFP8 at H = 2880: scale columns 90 and 91 of the last column tile are padding.
        if (f == QuantFormat::kMxfp8) {
          ASSERT_EQ(layout.scale_cols, 90);
          got = ref;
          flip(&got.out.scales[size_t(layout.offset(sr, 91))]);
          expect_names(compare(got), {"scale column 91): column padding of " + row_name(ref, r)});
        }
        // scales_offsets.
        got = ref;
        flip(&got.out.scales_offsets[1]);
        expect_names(compare(got), {"scales_offsets[1] = "});
        break;
      }
      case QuantFormat::kMxfp4: {
        // Row-major [rows, H / 32]: scale 3 of row r; none past row_offsets[G].
        QuantDispatchResult got = ref;
        flip(&got.out.scales[size_t(r * cols + 3)]);
        expect_names(compare(got),
                     {"MXFP4 scale of " + row_name(ref, r) + " column 3 (values [96, 128)"});
        got = ref;
        flip(&got.out.scales[size_t(rows * cols + 3)]);
        EXPECT_EQ(compare(got), "");
        break;
      }
    }

    // A reference that does not fit its shape, or a view of too few rows, throws.
    QuantDispatchResult bad = ref;
    bad.src_info.pop_back();
    EXPECT_THROW(reference::compare_dispatch_quantized(bad, ref.view()), Error);
    EXPECT_THROW(bad.view(), Error);
  }
}

}  // namespace
}  // namespace epcomm
