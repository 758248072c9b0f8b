// Dispatch writing the padded per-expert layout itself (Config::padded_capacity): tokens and
// scales at each row's slot, counts, slot_token and layout_range, fp32 scales or UE8M0 words
// (Config::fp8_ue8m0_scales), with the packed rows (row_offsets, expert_ids, src_info) combine
// reads. Every output is poisoned first and compared byte for byte, untouched slots included,
// with the reference laid out by reference::pad_expert_rows (harness padded_want); then the
// round's combines run from those packed rows. Skips without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epcomm/error.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

struct Variant {
  TokenFormat format;
  bool pow2, ue8m0;
  const char* name;
};
constexpr Variant kVariants[] = {
    {TokenFormat::kBF16, false, false, "bf16"},
    {TokenFormat::kFp8Blockwise, false, false, "fp8"},
    {TokenFormat::kFp8Blockwise, true, false, "fp8 pow2"},
    {TokenFormat::kFp8Blockwise, true, true, "fp8 ue8m0"},
};

Config padded_cfg(const Variant& v, DispatchPath path, int n, int hidden, int max_t,
                  int64_t extra) {
  Config cfg = with_path(make_cfg(hidden, 8, 8 * n, max_t), path);
  cfg.format = v.format;
  cfg.fp8_pow2_scales = v.pow2;
  cfg.fp8_ue8m0_scales = v.ue8m0;
  cfg.padded_capacity = int64_t(n) * max_t + extra;
  return cfg;
}

}  // namespace

// Every variant on both paths, fused and async + wait, both reductions and the un-reduced
// combine, at the least capacity and 3 more, on random token counts with masked slots.
TEST(PaddedDispatch, MatchesThePaddedReference) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  uint64_t seed = 900;
  for (const Variant& v : kVariants) {
    for (DispatchPath path : kBothPaths) {
      for (int64_t extra : {0, 3}) {
        LocalGroup lg(padded_cfg(v, path, n, 2048, 96, extra), n);
        for (Form form : {Form::kFused, Form::kAsyncWait}) {
          for (bool expert_side : {false, true}) {
            const auto p = reference::make_problem(n, 2048, 8, 8 * n, random_counts(n, 96, seed),
                                                   seed, 0.0, 0.1);
            RoundOptions o = every_combine(form, expert_side);
            // The masked-GEMM flow on the expert side: combine reads the expert outputs in the
            // padded layout, at the dispatch's capacity.
            if (expert_side) o.padded_extra_slots = extra;
            EXPECT_EQ(run_round(lg, p, o), "")
                << v.name << ", " << dispatch_path_name(path) << ", capacity + " << extra
                << (form == Form::kFused ? ", fused" : ", async+wait")
                << (expert_side ? ", expert side" : ", token side");
            ++seed;
          }
        }
      }
    }
  }
}

// One rank, fused (its FP8 kernels quantise the rank's own rows in the receive and store them
// from there): every FP8 variant, at the least capacity and 3 more, both reductions.
TEST(PaddedDispatch, OneRankFused) {
  EPCOMM_REQUIRE_GPU();
  uint64_t seed = 950;
  for (const Variant& v : kVariants) {
    if (v.format == TokenFormat::kBF16) continue;
    for (int64_t extra : {0, 3}) {
      LocalGroup lg(padded_cfg(v, DispatchPath::kThroughput, 1, 2048, 96, extra), 1);
      for (bool expert_side : {false, true}) {
        const auto p =
            reference::make_problem(1, 2048, 8, 8, random_counts(1, 96, seed), seed, 0.0, 0.1);
        RoundOptions o = every_combine(Form::kFused, expert_side);
        if (expert_side) o.padded_extra_slots = extra;
        EXPECT_EQ(run_round(lg, p, o), "") << v.name << ", capacity + " << extra
                                           << (expert_side ? ", expert side" : ", token side");
        ++seed;
      }
    }
  }
}

// The edges, at H = 7168 (the low-latency path's seven parts; UE8M0 words across part
// boundaries): no tokens anywhere; every token of every rank to one expert (its group full: the
// last slot written, nothing past it); then a random round after the full one, where counts and
// layout_range of the groups and sources that sent nothing must read 0 (run_round poisons every
// output first, so an entry the kernel skipped would show).
TEST(PaddedDispatch, Edges) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  for (const Variant& v : kVariants) {
    for (DispatchPath path : kBothPaths) {
      LocalGroup lg(padded_cfg(v, path, n, 7168, 64, 0), n);
      const auto empty =
          reference::make_problem(n, 7168, 8, 8 * n, std::vector<int32_t>(size_t(n), 0), 5);
      EXPECT_EQ(run_round(lg, empty, RoundOptions{}), "") << v.name << ", no tokens";
      auto full =
          reference::make_problem(n, 7168, 8, 8 * n, std::vector<int32_t>(size_t(n), 64), 6);
      for (auto& r : full.ranks)
        for (int32_t t = 0; t < r.num_tokens; ++t)
          for (int k = 0; k < 8; ++k)
            r.topk_ids[size_t(t * 8 + k)] = k == 0 ? 8 * n - 1 : -1;
      RoundOptions o;
      o.expert_side = true;
      EXPECT_EQ(run_round(lg, full, o), "") << v.name << ", one expert's group full";
      const auto some =
          reference::make_problem(n, 7168, 8, 8 * n, random_counts(n, 64, 7), 7, 0.0, 0.2);
      EXPECT_EQ(run_round(lg, some, RoundOptions{}), "") << v.name << ", after the full round";
    }
  }
}

// The modes: the fused shared expert (group 0 holds this rank's own tokens, so its
// layout_range is this rank's alone) and skip_a2a (every rank keeps its own tokens: the least
// capacity is max_tokens_per_rank, and layout_range has an entry only at this rank).
TEST(PaddedDispatch, Modes) {
  EPCOMM_REQUIRE_GPU();
  const int n = suite_ranks();
  uint64_t seed = 950;
  for (const Variant& v : {kVariants[0], kVariants[3]}) {
    for (DispatchPath path : kBothPaths) {
      for (int mode = 0; mode < 2; ++mode) {
        Config cfg = padded_cfg(v, path, n, 2048, 64, 0);
        cfg.shared_expert = mode == 0;
        cfg.skip_a2a = mode == 1;
        if (cfg.skip_a2a) cfg.padded_capacity = 64;
        LocalGroup lg(cfg, n);
        // skip_a2a: every rank holds the same tokens and routing.
        const auto p =
            cfg.skip_a2a ? reference::make_replicated_problem(n, 2048, 8, 8 * n, 50, seed, 0.0, 0.1)
                         : reference::make_problem(n, 2048, 8, 8 * n, random_counts(n, 64, seed),
                                                   seed, 0.0, 0.1);
        for (bool expert_side : {false, true}) {
          RoundOptions o;
          o.expert_side = expert_side;
          EXPECT_EQ(run_round(lg, p, o), "")
              << v.name << ", " << dispatch_path_name(path)
              << (cfg.shared_expert ? ", shared expert" : ", skip_a2a")
              << (expert_side ? ", expert side" : ", token side");
        }
        ++seed;
      }
    }
  }
}
