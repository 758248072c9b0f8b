// The CPU reference of the padded per-expert layout (reference::pad_expert_rows /
// unpad_expert_rows, the model the GPU kernels are checked against in
// tests/gpu/test_padded_layout.cu): a worked example, the UE8M0 words, the round trip, and the
// argument checks, which write nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/reference.h"
#include "padded_case.h"

namespace epcomm {
namespace {

using testing::kPaddedPoison;
using testing::PaddedCase;
using testing::PaddedOut;

// Two groups, two sources. Group 0: (rank 0, token 5), (rank 0, token 7), (rank 1, token 2), one
// padding row; group 1: (rank 1, token 3); then one spare row. Row i's 16 code bytes are i + 1;
// its scale k (of 8) is 2^(i - k).
PaddedCase worked_example(int64_t capacity) {
  PaddedCase c;
  c.groups = 2;
  c.n_ranks = 2;
  c.capacity = capacity;
  c.row_bytes = 16;
  c.scale_cols = 8;
  c.row_offsets = {0, 4, 5};
  c.src_info = {{5, 0, 0}, {7, 0, 1}, {2, 1, 0}, {-1, -1, -1}, {3, 1, 2}, {9, 0, 0}};
  c.max_rows = 6;
  c.codes.resize(6 * 16);
  c.scales.resize(8 * 6);
  for (int i = 0; i < 6; ++i) {
    std::memset(c.codes.data() + i * 16, i + 1, 16);
    for (int k = 0; k < 8; ++k)
      c.scales[size_t(k * 6 + i)] = std::ldexp(1.0f, i - k);
  }
  return c;
}

int64_t range(int64_t first, int64_t n) {
  return (first << 32) | n;
}

// Every slot of the worked example at `capacity` (3: group 0 fills it; 4: its padding row's slot
// stays unwritten), checked from the rows' values, not from the layout code.
void check_worked_example(int64_t capacity) {
  const PaddedCase c = worked_example(capacity);
  PaddedOut o(c);
  reference::pad_expert_rows(testing::pad_args(c, testing::host_pointers(c, o)));
  EXPECT_EQ(o.counts, (std::vector<int32_t>{3, 1}));
  // Slot (g, j) <- row: (0,0) <- 0, (0,1) <- 1, (0,2) <- 2, (1,0) <- 4; the others kept.
  auto row_of = [](int g, int64_t j) { return g == 0 ? (j < 3 ? int(j) : -1) : (j == 0 ? 4 : -1); };
  for (int g = 0; g < 2; ++g)
    for (int64_t j = 0; j < capacity; ++j) {
      const int i = row_of(g, j);
      const size_t slot = size_t(g * capacity + j);
      const std::string at = "slot (" + std::to_string(g) + ", " + std::to_string(j) + ")";
      for (int b = 0; b < 16; ++b)
        ASSERT_EQ(o.codes[slot * 16 + size_t(b)], i < 0 ? kPaddedPoison : uint8_t(i + 1)) << at;
      if (i < 0) {
        EXPECT_EQ(o.src_token[slot], int32_t(0xa5a5a5a5)) << at;
        for (int q = 0; q < 2; ++q)
          EXPECT_EQ(o.ue8m0[size_t((g * 2 + q) * capacity + j)], 0xa5a5a5a5u) << at;
        continue;
      }
      EXPECT_EQ(o.src_token[slot], c.src_info[size_t(i)].token) << at;
      for (int k = 0; k < 8; ++k) {
        // [G, 8, capacity]: scale k of the slot.
        EXPECT_EQ(o.scales[size_t((g * 8 + k) * capacity + j)], std::ldexp(1.0f, i - k)) << at;
        // [G, 2, capacity]: word q = k / 4 of the slot, byte k % 4 the biased exponent.
        const uint32_t word = o.ue8m0[size_t((g * 2 + k / 4) * capacity + j)];
        EXPECT_EQ((word >> (8 * (k % 4))) & 0xffu, uint32_t(127 + i - k)) << at << " scale " << k;
      }
    }
  EXPECT_EQ(o.layout_range, (std::vector<int64_t>{range(0, 2), range(2, 1), 0, range(0, 1)}));
}

TEST(PaddedLayoutReference, WorkedExample) {
  check_worked_example(3);
  check_worked_example(4);
}

TEST(PaddedLayoutReference, RowsPastCapacityAreLeftOut) {
  const PaddedCase c = worked_example(2);
  PaddedOut o(c);
  reference::pad_expert_rows(testing::pad_args(c, testing::host_pointers(c, o)));
  EXPECT_EQ(o.counts, (std::vector<int32_t>{2, 1}));  // group 0's third row does not fit
  EXPECT_EQ(o.layout_range, (std::vector<int64_t>{range(0, 2), 0, 0, range(0, 1)}));
  for (int b = 0; b < 16; ++b)
    EXPECT_EQ(o.codes[size_t(2 * 16 + b)], 5);  // slot (1, 0) <- row 4
}

// A dispatch output cut short (max_rows = 4 < row_offsets[2] = 5): group 1's row is past it, so
// group 1 counts 0 rows and none of its slots is written; nothing past row 3 is read (the case's
// arrays end there).
TEST(PaddedLayoutReference, RowsPastMaxRowsAreNotRead) {
  const PaddedCase full = worked_example(3);
  PaddedCase c = full;
  c.max_rows = 4;
  c.src_info.resize(4);
  c.codes.resize(4 * 16);
  c.scales.assign(8 * 4, 0.0f);
  for (int k = 0; k < 8; ++k)
    for (int i = 0; i < 4; ++i)
      c.scales[size_t(k * 4 + i)] = full.scales[size_t(k * 6 + i)];
  PaddedOut o(c);
  reference::pad_expert_rows(testing::pad_args(c, testing::host_pointers(c, o)));
  EXPECT_EQ(o.counts, (std::vector<int32_t>{3, 0}));
  for (size_t b = 3 * 16; b < o.codes.size(); ++b)
    ASSERT_EQ(o.codes[b], kPaddedPoison) << "group 1 written at byte " << b;
  EXPECT_EQ(o.scales[size_t(7 * 3 + 2)], std::ldexp(1.0f, 2 - 7)) << "group 0, slot 2, scale 7";
  EXPECT_EQ(o.layout_range, (std::vector<int64_t>{range(0, 2), range(2, 1), 0, 0}));
}

TEST(PaddedLayoutReference, Ue8m0WordPacksTheLowestScaleFirst) {
  EXPECT_EQ(Fp8BlockQuant::ue8m0_word(1.0f, 2.0f, 0.5f, std::ldexp(1.0f, -20)),
            uint32_t(127) | uint32_t(128) << 8 | uint32_t(126) << 16 | uint32_t(107) << 24);
}

TEST(PaddedLayoutReference, UnpadUndoesPadAndZeroesWhatHasNoSlot) {
  for (const int64_t capacity : {int64_t(1), int64_t(2), int64_t(6)}) {
    const PaddedCase c =
        testing::random_padded_case(5, 3, capacity, 32, 0, 6, 4, true, 11 + uint64_t(capacity));
    PaddedOut o(c);
    reference::pad_expert_rows(testing::pad_args(c, testing::host_pointers(c, o)));
    std::vector<uint8_t> back(c.codes.size(), kPaddedPoison);
    reference::unpad_expert_rows(testing::unpad_args(c, c.row_offsets.data(), c.src_info.data(),
                                                     o.codes.data(), back.data()));
    const int64_t used = c.row_offsets.back();
    for (int32_t g = 0; g < c.groups; ++g)
      for (int64_t i = c.row_offsets[size_t(g)]; i < c.row_offsets[size_t(g) + 1]; ++i) {
        const bool kept =
            c.src_info[size_t(i)].rank >= 0 && i - c.row_offsets[size_t(g)] < capacity;
        for (int64_t b = 0; b < c.row_bytes; ++b)
          ASSERT_EQ(back[size_t(i * c.row_bytes + b)],
                    kept ? c.codes[size_t(i * c.row_bytes + b)] : 0)
              << "capacity " << capacity << " row " << i;
      }
    for (size_t b = size_t(used * c.row_bytes); b < back.size(); ++b)
      ASSERT_EQ(back[b], kPaddedPoison) << "a spare row was written";
  }
}

// A rank that received no rows (max_rows 0): its row arrays may be null, as an empty tensor's
// data pointer is; every group counts 0 and no slot is written. A null array that has rows is
// still refused.
TEST(PaddedLayoutReference, NoRowsMayComeAsNullArrays) {
  const std::vector<uint32_t> offsets = {0, 0, 0};
  std::vector<uint8_t> padded(2 * 3 * 16, kPaddedPoison);
  std::vector<int32_t> counts = {7, 7};
  PadExpertRows a;
  a.rows = DispatchRows{offsets.data(), nullptr, 2, 0};
  a.row_bytes = 16;
  a.capacity = 3;
  a.padded_codes = padded.data();
  a.counts = counts.data();
  reference::pad_expert_rows(a);
  EXPECT_EQ(counts, (std::vector<int32_t>{0, 0}));
  for (uint8_t b : padded)
    ASSERT_EQ(b, kPaddedPoison);
  UnpadExpertRows u;
  u.rows = a.rows;
  u.padded = padded.data();
  u.row_bytes = 16;
  u.capacity = 3;
  EXPECT_NO_THROW(reference::unpad_expert_rows(u));  // out null: no row to write
  for (int k = 0; k < 3; ++k) {
    PadExpertRows bad = a;
    bad.rows.max_rows = 1;  // one row: its arrays must be there
    std::vector<SrcInfo> src(1, SrcInfo{0, 0, 0});
    if (k != 0) bad.rows.src_info = src.data();
    if (k == 2) bad.padded_codes = nullptr, bad.codes = padded.data();
    EXPECT_THROW(reference::pad_expert_rows(bad), Error) << "case " << k;
  }
}

// Each bad argument throws InvalidArgument and leaves every output as it was.
TEST(PaddedLayoutReference, BadArgumentsWriteNothing) {
  const PaddedCase c = worked_example(3);
  PaddedOut o(c);
  const PadExpertRows good = testing::pad_args(c, testing::host_pointers(c, o));
  std::vector<PadExpertRows> bad(6, good);
  bad[0].padded_scales = nullptr, bad[0].padded_ue8m0 = nullptr;  // scales with nowhere to go
  bad[1].scales = nullptr;                                        // padded scales from nothing
  bad[2].scale_cols = 3, bad[2].padded_scales = nullptr;          // UE8M0 needs 4 | scale_cols
  bad[3].capacity = -1;
  bad[4].row_bytes = 24;
  bad[5].n_ranks = 0;  // with layout_range
  for (size_t k = 0; k < bad.size(); ++k) {
    try {
      reference::pad_expert_rows(bad[k]);
      ADD_FAILURE() << "case " << k << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << "case " << k << ": " << e.what();
    }
  }
  PaddedOut untouched(c);
  EXPECT_EQ(o.codes, untouched.codes);
  EXPECT_EQ(0, std::memcmp(o.scales.data(), untouched.scales.data(), o.scales.size() * 4));
  EXPECT_EQ(o.ue8m0, untouched.ue8m0);
  EXPECT_EQ(o.counts, untouched.counts);
  EXPECT_EQ(o.src_token, untouched.src_token);
  EXPECT_EQ(o.layout_range, untouched.layout_range);
  // Without padded_scales, UE8M0 words alone are a valid request.
  PadExpertRows words_only = good;
  words_only.padded_scales = nullptr;
  EXPECT_NO_THROW(reference::pad_expert_rows(words_only));
  EXPECT_EQ(o.scales, untouched.scales);
  EXPECT_NE(o.ue8m0, untouched.ue8m0);
}

}  // namespace
}  // namespace epcomm

namespace epcomm {
namespace {

// reference::dispatch_padded, what a padded-capacity group writes, against the packed reference
// it comes from: each group's count, each used slot's codes and source token, untouched slots
// left as given, the (first slot, rows) of each source, and UE8M0 words against the pow2
// scales' exponents; refusals.
TEST(PaddedLayoutReference, DispatchPaddedFollowsThePackedDispatch) {
  const reference::Problem p = reference::make_problem(3, 1024, 4, 6, {5, 0, 7}, 17, 0.0, 0.2);
  const int64_t C = 3 * 7;
  for (int32_t rank = 0; rank < 3; ++rank) {
    const reference::DispatchResult packed = reference::dispatch(p, rank);
    const reference::PaddedDispatchResult d =
        reference::dispatch_padded(p, rank, TokenFormat::kBF16, C, false, false, -1, 0xab);
    EXPECT_EQ(d.meta.row_offsets, packed.row_offsets);
    const int32_t G = int32_t(packed.row_offsets.size()) - 1;
    const int64_t row_bytes = 1024 * 2;
    for (int32_t g = 0; g < G; ++g) {
      const int64_t first = packed.row_offsets[size_t(g)];
      const int64_t n = packed.row_offsets[size_t(g) + 1] - first;
      ASSERT_EQ(d.counts[size_t(g)], n) << "group " << g;
      for (int64_t j = 0; j < C; ++j) {
        const uint8_t* slot = d.codes.data() + (g * C + j) * row_bytes;
        if (j >= n) {
          ASSERT_EQ(slot[0], 0xab) << "an unused slot was written";
          ASSERT_EQ(d.slot_token[size_t(g * C + j)], int32_t(0xabababab));
          continue;
        }
        ASSERT_EQ(0, std::memcmp(slot, packed.tokens.data() + (first + j) * 1024, row_bytes))
            << "group " << g << " slot " << j;
        ASSERT_EQ(d.slot_token[size_t(g * C + j)], packed.src_info[size_t(first + j)].token);
      }
      for (int32_t s = 0; s < 3; ++s) {  // rows of source s: a run, at its first slot
        int64_t begin = -1, rows = 0;
        for (int64_t j = 0; j < n; ++j)
          if (packed.src_info[size_t(first + j)].rank == s) {
            if (begin < 0) begin = j;
            ++rows;
          }
        EXPECT_EQ(d.layout_range[size_t(g * 3 + s)], rows ? (begin << 32 | rows) : 0)
            << "group " << g << " source " << s;
      }
    }
  }
  // UE8M0 words: byte t of word q of a slot is the biased exponent of its row's scale 4q + t.
  const reference::QuantDispatchResult q =
      reference::dispatch_quantized(p, 2, reference::QuantFormat::kFp8Blockwise, 1.0f, -1, true);
  const reference::PaddedDispatchResult u =
      reference::dispatch_padded(p, 2, TokenFormat::kFp8Blockwise, C, true, true, -1);
  const int64_t ld = q.out.shape.rows, words = 1024 / 512;
  for (int32_t g = 0; g < int32_t(q.row_offsets.size()) - 1; ++g)
    for (int64_t j = 0; j < u.counts[size_t(g)]; ++j)
      for (int64_t w = 0; w < words; ++w)
        for (int t = 0; t < 4; ++t) {
          const float scale =
              q.out.fp8_scales[size_t((4 * w + t) * ld + q.row_offsets[size_t(g)] + j)];
          ASSERT_EQ((u.scales[size_t((g * words + w) * C + j)] >> (8 * t)) & 0xffu,
                    uint32_t(std::ilogb(scale) + 127))
              << "group " << g << " slot " << j << " scale " << 4 * w + t;
        }
  // A rank that receives nothing (a GPU run found this refused in fp8): every count 0, every
  // slot left as given.
  const reference::Problem none = reference::make_problem(3, 1024, 4, 6, {0, 0, 0}, 18);
  for (bool ue8m0 : {false, true}) {
    const reference::PaddedDispatchResult e = reference::dispatch_padded(
        none, 1, TokenFormat::kFp8Blockwise, C, true, ue8m0, 3 * 7, 0xab);
    EXPECT_EQ(e.counts, std::vector<int32_t>(e.counts.size(), 0));
    for (uint8_t b : e.codes)
      ASSERT_EQ(b, 0xab);
  }
  EXPECT_THROW(reference::dispatch_padded(p, 0, TokenFormat::kNvfp4, C, false, false, -1), Error);
  EXPECT_THROW(reference::dispatch_padded(p, 2, TokenFormat::kBF16, 2, false, false, -1), Error);
  EXPECT_THROW(reference::dispatch_padded(p, 0, TokenFormat::kFp8Blockwise, C, false, true, -1),
               Error);
}

}  // namespace
}  // namespace epcomm
