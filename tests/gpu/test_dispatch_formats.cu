// Dispatch in the quantised token formats (docs/design.md "Token formats": blockwise FP8, NVFP4, MXFP8, MXFP4) on real
// GPUs, one process driving 2, 4 or 8 of them. Inputs stay bf16; the sending GPU quantises.
//
// Every dispatch output is poisoned (0xff) before the run and compared bit for bit with
// reference::dispatch_quantized (RankIO::check_dispatch_quantized, through run_round): row_offsets,
// expert_ids, src_info (FP8 padding rows {-1, -1, -1} included), the codes of rows
// [0, row_offsets[G]), FP8 scales of those rows in every column, the whole swizzled scale array
// with scales_offsets (NVFP4, MXFP8; unused slots zero), MXFP4 scales of those rows.
//
// Inputs exercise the quantisers (stressed_problem): bf16 tokens of magnitude ~1e3, tokens whose
// 16-value blocks differ in magnitude by up to 2^28, blocks with one large outlier, whole tokens
// of zeros, and aligned all-zero 16-, 32- and 128-value blocks (some of them -0), so every scale
// block size sees zero blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/bf16.h"
#include "epcomm/formats/reference_codecs.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

const TokenFormat kQuantFormats[] = {TokenFormat::kFp8Blockwise, TokenFormat::kNvfp4,
                                     TokenFormat::kMxfp8, TokenFormat::kMxfp4};

// NVFP4's global scale where the test does not pick one: a power of two below 448 * 6 / 2^15,
// so that no block of stressed_problem (|x| < 2^15) saturates its e4m3 scale.
constexpr float kNvfp4Gs = 0.0625f;

// Format names usable in test names.
const char* short_name(TokenFormat f) {
  switch (f) {
    case TokenFormat::kFp8Blockwise: return "fp8";
    case TokenFormat::kNvfp4: return "nvfp4";
    case TokenFormat::kMxfp8: return "mxfp8";
    case TokenFormat::kMxfp4: return "mxfp4";
    default: return "bf16";
  }
}

const char* form_name(Form f) { return f == Form::kFused ? "fused" : "async+wait"; }

// The hidden sizes of the issue that suit format f (2880 is not a multiple of 128: not FP8).
std::vector<int32_t> hidden_sizes(TokenFormat f) {
  std::vector<int32_t> h;
  for (int32_t x : {2048, 2880, 7168})
    if (x % format_hidden_multiple(f) == 0) h.push_back(x);
  return h;
}

// make_cfg in format f with NVFP4 global scale gs.
Config quant_cfg(TokenFormat f, int hidden, int top_k, int n_experts, int max_tokens,
                 float gs = kNvfp4Gs) {
  Config c = make_cfg(hidden, top_k, n_experts, max_tokens);
  c.format = f;
  c.nvfp4_global_scale = gs;
  return c;
}

// reference::make_problem's routing and weights, with tokens that stress the quantisers. Each
// token is one of:
//   - plain (9/16): make_tokens at scale 1e3, |x| in [500, 2000);
//   - wild (4/16): each 16-value block times 2^e, e in [-24, 4] (so blocks of one 32- or
//     128-value scale block differ in magnitude by up to 2^28, |x| < 2^15);
//   - outliers (2/16): one value of each 16-value block times 16, the rest as plain;
//   - zero (1/16): every value +0 or -0;
// and then each aligned 128-, 32- and 16-value block is zeroed (all +0 or all -0) with
// probability 1/16 (about a fifth of all 16-value blocks end up zero).
reference::Problem stressed_problem(int n, int32_t H, int32_t K, int32_t E,
                                    const std::vector<int32_t>& counts, uint64_t seed,
                                    double zipf_s = 0.0, double mask_prob = 0.0) {
  reference::Problem p = reference::make_problem(n, H, K, E, counts, seed, zipf_s, mask_prob);
  std::mt19937_64 rng(seed * 7717u + 12345u);
  auto scale = [](uint16_t& v, int e) { v = float_to_bf16(std::ldexp(bf16_to_float(v), e)); };
  for (reference::RankInput& in : p.ranks) {
    in.tokens = reference::make_tokens(int64_t(in.num_tokens) * H, rng, 1e3f);
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      uint16_t* row = in.tokens.data() + int64_t(t) * H;
      switch (rng() % 16) {
        case 0:
        case 1:
        case 2:
        case 3:  // wild
          for (int32_t b = 0; b < H; b += 16) {
            const int e = int(rng() % 29) - 24;
            for (int32_t i = b; i < b + 16; ++i) scale(row[i], e);
          }
          break;
        case 4:
        case 5:  // outliers
          for (int32_t b = 0; b < H; b += 16) scale(row[b + int32_t(rng() % 16)], 4);
          break;
        case 6:  // zero token
          for (int32_t i = 0; i < H; ++i) row[i] = (rng() & 1) ? 0x8000 : 0;
          break;
        default:  // plain
          break;
      }
      for (int32_t size : {128, 32, 16})
        for (int32_t b = 0; b + size <= H; b += size)
          if (rng() % 16 == 0) {
            const uint16_t zero = (rng() & 1) ? 0x8000 : 0;
            std::fill(row + b, row + b + size, zero);
          }
    }
  }
  return p;
}

// The largest |decode(encode(x)) - x| in a block of format f with this amax.
double error_bound(TokenFormat f, float amax, float gs) {
  switch (f) {
    case TokenFormat::kFp8Blockwise: return reference::fp8_blockwise_error_bound(amax);
    case TokenFormat::kNvfp4: return reference::nvfp4_error_bound(amax, gs);
    case TokenFormat::kMxfp8: return reference::mxfp8_error_bound(amax);
    case TokenFormat::kMxfp4: return reference::mxfp4_error_bound(amax);
    default: return 0.0;
  }
}

// Dequantises a rank's downloaded dispatch output the way the grouped GEMM reads it and checks
// every value of every row against the bf16 value it came from (src_info names the source rank
// and token): within the format's bound for its scale block's amax. Padding rows decode to 0.
// Call only after the output matched the reference's rows (row_offsets, src_info).
std::string check_dequantized(const reference::Problem& p,
                              const reference::QuantDispatchResult& got, float gs) {
  const int32_t H = p.hidden;
  const TokenFormat f = reference::token_format(got.out.shape.format);
  const int32_t group = format_scale_group(f);
  const std::vector<float> deq = reference::dequantize_grouped_rows(
      got.out, got.row_offsets, std::vector<float>(got.expert_ids.size(), gs));
  std::vector<float> x(static_cast<size_t>(group));
  for (int64_t r = 0; r < got.rows(); ++r) {
    const SrcInfo si = got.src_info[size_t(r)];
    const float* y = deq.data() + r * H;
    if (si.rank < 0) {
      for (int32_t h = 0; h < H; ++h)
        if (y[h] != 0.0f) {
          std::ostringstream os;
          os << "padding row " << r << " column " << h << " decodes to " << y[h];
          return os.str();
        }
      continue;
    }
    const uint16_t* src = p.ranks[size_t(si.rank)].tokens.data() + int64_t(si.token) * H;
    for (int32_t b = 0; b < H; b += group) {
      for (int32_t i = 0; i < group; ++i) x[size_t(i)] = bf16_to_float(src[b + i]);
      const float amax = reference::block_amax(x.data(), group);
      const double bound = error_bound(f, amax, gs);
      for (int32_t i = 0; i < group; ++i) {
        const double err = std::fabs(double(y[b + i]) - double(x[size_t(i)]));
        if (!(err <= bound)) {
          std::ostringstream os;
          os << "row " << r << " (rank " << si.rank << " token " << si.token << " slot "
             << si.slot << ") column " << b + i << ": decodes to " << y[b + i] << ", token value "
             << x[size_t(i)] << ", error " << err << " > bound " << bound << " (block amax "
             << amax << ")";
          return os.str();
        }
      }
    }
  }
  return "";
}

// ---- 1. the sweep ---------------------------------------------------------------------------

struct SweepCase {
  TokenFormat format;
  int n_ranks, hidden, top_k, n_experts, max_tokens;
  double mask_prob, zipf_s;
  float gs;  // NVFP4 global scale
  std::string name;
  bool pow2 = false;  // blockwise FP8: Config::fp8_pow2_scales
};

// Every quantised format x its hidden sizes x 1, 2, 4, 8 ranks; K, experts, token counts, masking,
// skew and (NVFP4) the global scale vary from case to case. gs = 1 lets wild blocks (amax up to
// 2^15) saturate NVFP4's e4m3 scale, which the GPU must do exactly as the reference does.
std::vector<SweepCase> sweep_cases() {
  std::vector<SweepCase> v;
  int i = 0;
  for (TokenFormat f : kQuantFormats) {
    for (int32_t H : hidden_sizes(f)) {
      for (int n : {1, 2, 4, 8}) {
        static const int kExperts[] = {32, 64, 128, 256};
        SweepCase c;
        c.format = f;
        c.n_ranks = n;
        c.hidden = H;
        c.top_k = i % 2 == 0 ? 8 : 4;
        c.n_experts = kExperts[i % 4];
        c.max_tokens = i % 3 == 2 ? 128 : 64;
        c.mask_prob = i % 3 == 1 ? 0.2 : 0.0;
        c.zipf_s = i % 5 == 3 ? 1.2 : 0.0;
        c.gs = f == TokenFormat::kNvfp4 && i % 2 == 1 ? 1.0f : kNvfp4Gs;
        std::ostringstream os;
        os << short_name(f) << "_h" << H << "_r" << n << "_k" << c.top_k << "_e" << c.n_experts
           << "_t" << c.max_tokens << (c.mask_prob > 0 ? "_masked" : "")
           << (c.zipf_s > 0 ? "_zipf" : "")
           << (f == TokenFormat::kNvfp4 ? (c.gs == 1.0f ? "_gs1" : "_gs1of16") : "");
        c.name = os.str();
        v.push_back(c);
        ++i;
      }
    }
  }
  // Blockwise FP8 with power-of-two scales (Config::fp8_pow2_scales), on 1, 2 and 8 ranks (one
  // rank: the fused kernel quantises its own rows in the receive).
  for (int32_t H : hidden_sizes(TokenFormat::kFp8Blockwise)) {
    for (int n : {1, 2, 8}) {
      SweepCase c;
      c.format = TokenFormat::kFp8Blockwise;
      c.n_ranks = n;
      c.hidden = H;
      c.top_k = n == 8 ? 4 : 8;
      c.n_experts = n == 8 ? 256 : 64;
      c.max_tokens = 64;
      c.mask_prob = n == 8 ? 0.0 : 0.2;
      c.zipf_s = 0.0;
      c.gs = kNvfp4Gs;
      c.pow2 = true;
      c.name = std::string(short_name(c.format)) + "_h" + std::to_string(H) + "_r" +
               std::to_string(n) + "_pow2";
      v.push_back(c);
    }
  }
  // Blockwise FP8 with H = 1152: 9 scale columns (an odd count), and the low-latency path's last
  // part is short (128 of 1024 values); up to 100 tokens a rank.
  SweepCase c;
  c.format = TokenFormat::kFp8Blockwise;
  c.n_ranks = 2;
  c.hidden = 1152;
  c.top_k = 8;
  c.n_experts = 64;
  c.max_tokens = 100;
  c.mask_prob = 0.2;
  c.zipf_s = 0.0;
  c.gs = kNvfp4Gs;
  c.name = "fp8_h1152_r2_partial_scale_tile";
  v.push_back(c);
  // The same on one rank (fused form, throughput path: the solo kernel, which places its rows'
  // scales after a grid barrier, 32 columns a round: 9 columns are one partial round).
  c.n_ranks = 1;
  c.name = "fp8_h1152_r1_partial_scale_tile";
  v.push_back(c);
  c.n_ranks = 2;
  // Blockwise FP8 with H = 16384: 16 slots of its messages (16.5 KB each) do not fit the
  // receive's ring, so the throughput receive copies through registers.
  c.hidden = 16384;
  c.max_tokens = 48;
  c.name = "fp8_h16384_r2_no_ring";
  v.push_back(c);
  return v;
}

std::string sweep_name(const ::testing::TestParamInfo<SweepCase>& info) {
  return info.param.name;
}
void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.name; }

class FormatSweep : public ::testing::TestWithParam<SweepCase> {};

// Poisoned outputs, dispatch in the fused and in the async + wait form, every output compared
// with reference::dispatch_quantized exactly (the first mismatch names rank, row and column).
TEST_P(FormatSweep, MatchesReference) {
  const SweepCase c = GetParam();
  EPCOMM_REQUIRE_GPU();
  for (DispatchPath path : kBothPaths) {
    Config cfg = quant_cfg(c.format, c.hidden, c.top_k, c.n_experts, c.max_tokens, c.gs);
    cfg.fp8_pow2_scales = c.pow2;
    LocalGroup lg(with_path(cfg, path), c.n_ranks);
    uint64_t seed = 100;
    for (Form form : {Form::kFused, Form::kAsyncWait}) {
      const auto p = stressed_problem(c.n_ranks, c.hidden, c.top_k, c.n_experts,
                                      random_counts(c.n_ranks, c.max_tokens, seed), seed, c.zipf_s,
                                      c.mask_prob);
      ++seed;
      RoundOptions o;
      o.form = form;
      o.weighted = false;  // dispatch only: FormatBehaviour.CombineAfterDispatch combines
      EXPECT_EQ(run_round(lg, p, o), "") << form_name(form) << ", " << dispatch_path_name(path);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(QuantizedDispatch, FormatSweep, ::testing::ValuesIn(sweep_cases()),
                         sweep_name);

// One rank, blockwise FP8, the fused throughput kernel of a group of one rank (the solo kernel):
// it stashes each token's scales in the token's message and places them after a grid barrier,
// 32 adjacent rows a column at a time. T past two ranking units of 512 tokens (a token's stream
// slot is its unit's prefix plus its place in the unit), just past one, and within one; every
// 7th token with all its slots masked, so from the first of them on a token's slot is not its
// index; 9 scale columns (a partial 16-byte load) and 56; 8 SMs, so the grid's 128 warps take
// the rows' tiles in several rounds. Poisoned outputs, compared bit for bit with the reference.
TEST(FormatSolo, ScalesPlacedAfterTheBarrier) {
  EPCOMM_REQUIRE_GPU();
  constexpr int K = 8;
  for (int32_t H : {1152, 7168}) {
    Config cfg =
        with_path(quant_cfg(TokenFormat::kFp8Blockwise, H, K, 64, 1100), DispatchPath::kThroughput);
    cfg.num_sms = 8;
    LocalGroup lg(cfg, 1);
    uint64_t seed = 700 + uint64_t(H);
    for (int32_t T : {1100, 513, 300}) {
      auto p = stressed_problem(1, H, K, 64, {T}, seed++, 0.0, 0.2);
      for (int32_t t = 3; t < T; t += 7)
        for (int k = 0; k < K; ++k)
          p.ranks[0].topk_ids[size_t(t * K + k)] = -1;
      RoundOptions o;
      o.form = Form::kFused;
      o.weighted = false;
      EXPECT_EQ(run_round(lg, p, o), "") << "H = " << H << ", T = " << T;
    }
  }
}

// ---- 2-4. per format, on every GPU (up to 8) -------------------------------------------------

class FormatBehaviour : public ::testing::TestWithParam<TokenFormat> {};

std::string format_name(const ::testing::TestParamInfo<TokenFormat>& info) {
  return short_name(info.param);
}

// 2. The GPU's codes and scales, dequantised where the grouped GEMM reads them, are within the
// format's error bound of the bf16 values the rows came from.
TEST_P(FormatBehaviour, DequantizedWithinErrorBound) {
  EPCOMM_REQUIRE_GPU();
  const TokenFormat f = GetParam();
  const int n = suite_ranks();
  const int K = 8, E = 16 * n, T = 96;
  for (int32_t H : hidden_sizes(f)) {
    LocalGroup lg(quant_cfg(f, H, K, E, T), n);
    const uint64_t seed = 200 + uint64_t(H);
    const auto p = stressed_problem(n, H, K, E, random_counts(n, T, seed), seed, 0.0, 0.1);
    RoundOptions o;
    o.weighted = false;
    ASSERT_EQ(run_round(lg, p, o), "") << "H = " << H;
    for (int r = 0; r < n; ++r) {
      const reference::QuantDispatchResult got = lg.io[size_t(r)]->download_dispatch_quantized();
      EXPECT_EQ(check_dequantized(p, got, lg.io[size_t(r)]->nvfp4_global_scale), "")
          << "rank " << r << ", H = " << H;
    }
  }
}

// 3. Combine after a quantised dispatch: the expert outputs cover every output row up to
// row_offsets[G], FP8's padding rows included, with random non-zero values there (make_tokens
// never draws 0), so a combine that sent a padding row home would add it to some token. The
// reference combine reads the quantised row order (combine_layout), where a padding row's rank
// -1 matches no token. Weighted (bf16 tolerance), un-reduced (exact) and the expert-side
// reduction (exact; weights carried by the quantised dispatch), both forms, masked slots.
TEST_P(FormatBehaviour, CombineAfterDispatch) {
  EPCOMM_REQUIRE_GPU();
  const TokenFormat f = GetParam();
  const int n = suite_ranks();
  const int K = 8, E = 32 * n, T = 100;  // ~25 rows per group: most FP8 groups get padding
  for (int32_t H : hidden_sizes(f)) {
    LocalGroup lg(quant_cfg(f, H, K, E, T), n);
    uint64_t seed = 300 + uint64_t(H);
    for (Form form : {Form::kFused, Form::kAsyncWait}) {
      const auto p = stressed_problem(n, H, K, E, random_counts(n, T, seed), seed, 0.0, 0.15);
      ++seed;
      RoundOptions o;
      o.form = form;
      o.weighted = true;
      o.unreduced = true;
      EXPECT_EQ(run_round(lg, p, o), "") << form_name(form) << ", H = " << H;
      o.expert_side = true;
      EXPECT_EQ(run_round(lg, p, o), "") << form_name(form) << ", H = " << H << ", expert side";
    }
  }
}

// 4. Dispatches with different routing on the same group and the same output buffers, poisoned
// only before the first: a large skewed one (groups of several 128-row tiles), then fewer
// tokens, then one token, then none, then a masked one. Each must match the reference exactly,
// so scales, swizzled tiles, FP8 padding rows and scales_offsets left by an earlier call must
// not survive into a later one (the whole swizzled array is compared). Combine follows each.
TEST_P(FormatBehaviour, SmallerDispatchLeavesNothingStale) {
  EPCOMM_REQUIRE_GPU();
  const TokenFormat f = GetParam();
  const int n = suite_ranks();
  const int32_t H = f == TokenFormat::kFp8Blockwise ? 2048 : 2880;
  const int K = 8, E = 16 * n, T = 256;
  LocalGroup lg(quant_cfg(f, H, K, E, T), n);
  struct Step {
    std::vector<int32_t> counts;
    double zipf_s, mask_prob;
    Form form;
  };
  std::vector<int32_t> one(static_cast<size_t>(n), 0);
  one[0] = 1;
  const std::vector<Step> steps = {
      {std::vector<int32_t>(static_cast<size_t>(n), T), 1.2, 0.0, Form::kFused},
      {random_counts(n, T / 4, 401), 0.0, 0.0, Form::kAsyncWait},
      {one, 0.0, 0.0, Form::kFused},
      {std::vector<int32_t>(static_cast<size_t>(n), 0), 0.0, 0.0, Form::kAsyncWait},
      {random_counts(n, T, 402), 0.0, 0.3, Form::kFused},
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    const uint64_t seed = 410 + i;
    const auto p = stressed_problem(n, H, K, E, s.counts, seed, s.zipf_s, s.mask_prob);
    RoundOptions o;
    o.form = s.form;
    o.poison = i == 0;
    EXPECT_EQ(run_round(lg, p, o), "") << "step " << i << " (" << form_name(s.form) << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(QuantizedDispatch, FormatBehaviour, ::testing::ValuesIn(kQuantFormats),
                         format_name);

}  // namespace
