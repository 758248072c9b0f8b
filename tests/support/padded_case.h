// Inputs and poisoned outputs of pad_expert_rows / unpad_expert_rows (epcomm/padded_layout.h) for
// the CPU and GPU tests: a dispatch output's shape (groups of rows sorted by source rank, then
// token, each group ending in up to three padding rows of rank -1, as the FP8 formats pad), with
// random codes and scales, and outputs filled with a poison byte so that what is not written
// shows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "epcomm/layout.h"
#include "epcomm/padded_layout.h"

namespace epcomm {
namespace testing {

constexpr uint8_t kPaddedPoison = 0xa5;

struct PaddedCase {
  int32_t groups = 0;
  int32_t n_ranks = 0;
  int64_t capacity = 0;
  int64_t row_bytes = 0;
  int32_t scale_cols = 0;  // 0: no scales
  int64_t max_rows = 0;    // rows of the dispatch output (row_offsets[groups] of them in use)
  std::vector<uint32_t> row_offsets;
  std::vector<SrcInfo> src_info;
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // [scale_cols, max_rows]

  int64_t padded_rows() const { return int64_t(groups) * capacity; }
};

// Group g holds up to max_group real rows (from random sources, each sending a token at most
// once) and 0-3 padding rows; `spare` rows past the last group are in the output but not in use
// (their src_info names a real rank, so a read of them shows). A negative `spare` cuts that many
// rows off the end instead: max_rows < row_offsets[groups], as a dispatch output too small for
// its rows would be. pow2: scales are powers of two
// (what UE8M0 holds exactly), else any positive normal floats.
inline PaddedCase random_padded_case(int32_t groups, int32_t n_ranks, int64_t capacity,
                                     int64_t row_bytes, int32_t scale_cols, int32_t max_group,
                                     int64_t spare, bool pow2, uint64_t seed) {
  std::mt19937_64 rng(seed);
  PaddedCase c;
  c.groups = groups;
  c.n_ranks = n_ranks;
  c.capacity = capacity;
  c.row_bytes = row_bytes;
  c.scale_cols = scale_cols;
  c.row_offsets.push_back(0);
  for (int32_t g = 0; g < groups; ++g) {
    const int32_t n = int32_t(rng() % uint64_t(max_group + 1));
    std::vector<SrcInfo> rows;
    for (int32_t i = 0; i < n; ++i)
      rows.push_back(
          SrcInfo{int32_t(rng() % 1000), int16_t(rng() % uint64_t(n_ranks)), int16_t(rng() % 8)});
    std::sort(rows.begin(), rows.end(), [](const SrcInfo& a, const SrcInfo& b) {
      return a.rank != b.rank ? a.rank < b.rank : a.token < b.token;
    });
    const int32_t pad = int32_t(rng() % 4);
    for (int32_t i = 0; i < pad; ++i)
      rows.push_back(SrcInfo{-1, -1, -1});
    c.src_info.insert(c.src_info.end(), rows.begin(), rows.end());
    c.row_offsets.push_back(uint32_t(c.src_info.size()));
  }
  for (int64_t i = 0; i < spare; ++i)
    c.src_info.push_back(SrcInfo{int32_t(i), int16_t(rng() % uint64_t(n_ranks)), 0});
  if (spare < 0)
    c.src_info.resize(size_t(std::max<int64_t>(0, int64_t(c.src_info.size()) + spare)));
  c.max_rows = int64_t(c.src_info.size());
  c.codes.resize(size_t(c.max_rows * row_bytes));
  for (auto& b : c.codes)
    b = uint8_t(rng());
  c.scales.resize(size_t(int64_t(scale_cols) * c.max_rows));
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (auto& s : c.scales) {
    const int e = int(rng() % 60) - 40;
    s = std::ldexp(pow2 ? 1.0f : mantissa(rng), e);
  }
  return c;
}

// pad_expert_rows' outputs, poisoned.
struct PaddedOut {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<uint32_t> ue8m0;
  std::vector<int32_t> counts;
  std::vector<int32_t> src_token;
  std::vector<int64_t> layout_range;

  explicit PaddedOut(const PaddedCase& c)
      : codes(size_t(c.padded_rows() * c.row_bytes)),
        scales(size_t(c.padded_rows() * c.scale_cols)),
        ue8m0(size_t(c.padded_rows() * (c.scale_cols / 4))),
        counts(size_t(c.groups)),
        src_token(size_t(c.padded_rows())),
        layout_range(size_t(c.groups) * size_t(c.n_ranks)) {
    poison();
  }
  template <class T>
  static void poison(std::vector<T>& v) {
    std::memset(v.data(), kPaddedPoison, v.size() * sizeof(T));
  }
  void poison() {
    poison(codes), poison(scales), poison(ue8m0), poison(counts), poison(src_token),
        poison(layout_range);
  }
};

// The arguments over the given memory (host or device alike): the case's inputs, then the
// outputs; an output pointer left null is not asked for.
struct PaddedPointers {
  const uint32_t* row_offsets;
  const SrcInfo* src_info;
  const void* codes;
  const float* scales;  // null: no scales
  void* padded_codes;
  float* padded_scales;
  uint32_t* padded_ue8m0;
  int32_t* counts;
  int32_t* src_token;
  int64_t* layout_range;
};
inline PadExpertRows pad_args(const PaddedCase& c, const PaddedPointers& p) {
  PadExpertRows a;
  a.rows = DispatchRows{p.row_offsets, p.src_info, c.groups, c.max_rows};
  a.codes = p.codes;
  a.row_bytes = c.row_bytes;
  a.scales = p.scales;
  a.scale_cols = c.scale_cols;
  a.n_ranks = c.n_ranks;
  a.capacity = c.capacity;
  a.padded_codes = p.padded_codes;
  a.padded_scales = p.padded_scales;
  a.padded_ue8m0 = p.padded_ue8m0;
  a.counts = p.counts;
  a.src_token = p.src_token;
  a.layout_range = p.layout_range;
  return a;
}
// unpad_expert_rows' arguments over the case's rows (row_offsets / src_info: host or device
// copies of the case's), from `padded` into `out`.
inline UnpadExpertRows unpad_args(const PaddedCase& c, const uint32_t* row_offsets,
                                  const SrcInfo* src_info, const void* padded, void* out) {
  UnpadExpertRows u;
  u.rows = DispatchRows{row_offsets, src_info, c.groups, c.max_rows};
  u.padded = padded;
  u.row_bytes = c.row_bytes;
  u.capacity = c.capacity;
  u.out = out;
  return u;
}
// Every output of `o`, host memory.
inline PaddedPointers host_pointers(const PaddedCase& c, PaddedOut& o) {
  const bool s = c.scale_cols > 0;
  return PaddedPointers{c.row_offsets.data(),
                        c.src_info.data(),
                        c.codes.data(),
                        s ? c.scales.data() : nullptr,
                        o.codes.data(),
                        s ? o.scales.data() : nullptr,
                        s && c.scale_cols % 4 == 0 ? o.ue8m0.data() : nullptr,
                        o.counts.data(),
                        o.src_token.data(),
                        o.layout_range.data()};
}

}  // namespace testing
}  // namespace epcomm
