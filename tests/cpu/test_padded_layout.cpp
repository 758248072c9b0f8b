// The CPU reference of the padded per-expert layout (reference::pad_expert_rows /
// unpad_expert_rows, the model the GPU kernels are checked against in
// tests/gpu/test_padded_layout.cu): a worked example, the UE8M0 words, the round trip, and the
// argument checks, which write nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/reference.h"
#include "padded_case.h"

namespace epcomm {
namespace {

using testing::kPaddedPoison;
using testing::PaddedCase;
using testing::PaddedOut;

// Two groups, two sources. Group 0: (rank 0, token 5), (rank 0, token 7), (rank 1, token 2), one
// padding row; group 1: (rank 1, token 3); then one spare row. Row i's 16 code bytes are i + 1;
// its scale k is 2^(i - k).
PaddedCase worked_example(int64_t capacity) {
  PaddedCase c;
  c.groups = 2;
  c.n_ranks = 2;
  c.capacity = capacity;
  c.row_bytes = 16;
  c.scale_cols = 4;
  c.row_offsets = {0, 4, 5};
  c.src_info = {{5, 0, 0}, {7, 0, 1}, {2, 1, 0}, {-1, -1, -1}, {3, 1, 2}, {9, 0, 0}};
  c.max_rows = 6;
  c.codes.resize(6 * 16);
  c.scales.resize(4 * 6);
  for (int i = 0; i < 6; ++i) {
    std::memset(c.codes.data() + i * 16, i + 1, 16);
    for (int k = 0; k < 4; ++k)
      c.scales[size_t(k * 6 + i)] = std::ldexp(1.0f, i - k);
  }
  return c;
}

int64_t range(int64_t first, int64_t n) {
  return (first << 32) | n;
}

TEST(PaddedLayoutReference, WorkedExample) {
  const PaddedCase c = worked_example(3);
  PaddedOut o(c);
  reference::pad_expert_rows(testing::pad_args(c, testing::host_pointers(c, o)));
  EXPECT_EQ(o.counts, (std::vector<int32_t>{3, 1}));
  // Slots (g, j) <- rows: (0,0) <- 0, (0,1) <- 1, (0,2) <- 2, (1,0) <- 4; (1,1) and (1,2) kept.
  const int row_of_slot[6] = {0, 1, 2, 4, -1, -1};
  for (int slot = 0; slot < 6; ++slot) {
    const int i = row_of_slot[slot];
    for (int b = 0; b < 16; ++b)
      ASSERT_EQ(o.codes[size_t(slot * 16 + b)], i < 0 ? kPaddedPoison : uint8_t(i + 1))
          << "slot " << slot;
    const int g = slot / 3, j = slot % 3;
    const uint32_t word = o.ue8m0[size_t(g * 3 + j)];
    if (i < 0) {
      EXPECT_EQ(word, 0xa5a5a5a5u) << "slot " << slot;
      continue;
    }
    EXPECT_EQ(o.src_token[size_t(slot)], c.src_info[size_t(i)].token);
    for (int k = 0; k < 4; ++k) {
      EXPECT_EQ(o.scales[size_t((g * 4 + k) * 3 + j)], std::ldexp(1.0f, i - k));
      // UE8M0 byte k: the biased exponent 127 + i - k.
      EXPECT_EQ((word >> (8 * k)) & 0xffu, uint32_t(127 + i - k)) << "slot " << slot;
    }
  }
  EXPECT_EQ(o.layout_range, (std::vector<int64_t>{range(0, 2), range(2, 1), 0, range(0, 1)}));
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
  EXPECT_EQ(o.counts, untouched.counts);
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
