// pad_expert_rows and unpad_expert_rows (epcomm/padded_layout.h) on the GPU against the CPU
// reference (reference::pad_expert_rows / unpad_expert_rows), byte for byte, every output
// poisoned first: random dispatch-shaped rows (padding rows, spare rows, groups past capacity),
// FP8 (codes + fp32 scales, UE8M0 words with and without the fp32 copy) and bf16 row sizes; and
// bad arguments refused before anything is launched. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/reference.h"
#include "harness.h"
#include "padded_case.h"

namespace epcomm {
namespace {

using testing::DeviceBuffer;
using testing::kPaddedPoison;
using testing::PaddedCase;
using testing::PaddedOut;

template <class T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer b(0, v.size() * sizeof(T));
  b.upload(v.data(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> download(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  b.download(v.data(), n * sizeof(T));
  return v;
}

struct Shape {
  int32_t groups, n_ranks;
  int64_t capacity, row_bytes;
  int32_t scale_cols, max_group;
  int64_t spare;
  bool pow2, fp32_scales;  // fp32_scales: padded_scales asked for beside the UE8M0 words
};

std::string name(const Shape& s) {
  return std::to_string(s.groups) + "x" + std::to_string(s.capacity) + " rows " +
         std::to_string(s.row_bytes) + " B, " + std::to_string(s.scale_cols) + " scales";
}

void check_pad(const Shape& s, uint64_t seed) {
  const PaddedCase c =
      testing::random_padded_case(s.groups, s.n_ranks, s.capacity, s.row_bytes, s.scale_cols,
                                  s.max_group, s.spare, s.pow2, seed);
  const bool scales = s.scale_cols > 0, words = scales && s.scale_cols % 4 == 0;
  // The reference, on host outputs poisoned alike.
  PaddedOut want(c);
  testing::PaddedPointers hp = testing::host_pointers(c, want);
  if (!s.fp32_scales && words) hp.padded_scales = nullptr;
  reference::pad_expert_rows(testing::pad_args(c, hp));

  const PaddedOut poisoned(c);
  DeviceBuffer row_offsets = upload(c.row_offsets), src_info = upload(c.src_info),
               codes = upload(c.codes), in_scales = upload(c.scales);
  DeviceBuffer out_codes = upload(poisoned.codes), out_scales = upload(poisoned.scales),
               out_words = upload(poisoned.ue8m0), counts = upload(poisoned.counts),
               src_token = upload(poisoned.src_token), layout = upload(poisoned.layout_range);
  const testing::PaddedPointers dp{row_offsets.get<uint32_t>(),
                                   src_info.get<SrcInfo>(),
                                   codes.get(),
                                   scales ? in_scales.get<float>() : nullptr,
                                   out_codes.get(),
                                   hp.padded_scales != nullptr ? out_scales.get<float>() : nullptr,
                                   words ? out_words.get<uint32_t>() : nullptr,
                                   counts.get<int32_t>(),
                                   src_token.get<int32_t>(),
                                   layout.get<int64_t>()};
  pad_expert_rows(testing::pad_args(c, dp), nullptr);
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  const std::string at = name(s) + ", seed " + std::to_string(seed);
  EXPECT_EQ(download<uint8_t>(out_codes, want.codes.size()), want.codes) << at;
  EXPECT_EQ(download<uint32_t>(out_words, want.ue8m0.size()), want.ue8m0) << at;
  EXPECT_EQ(download<int32_t>(counts, want.counts.size()), want.counts) << at;
  EXPECT_EQ(download<int32_t>(src_token, want.src_token.size()), want.src_token) << at;
  EXPECT_EQ(download<int64_t>(layout, want.layout_range.size()), want.layout_range) << at;
  // fp32 scales by their bits.
  const std::vector<float> got = download<float>(out_scales, want.scales.size());
  EXPECT_EQ(0, std::memcmp(got.data(), want.scales.data(), got.size() * sizeof(float))) << at;
  // The words against the fp32 scales beside them (layouts [G, K, capacity] and [G, K / 4,
  // capacity]), independently of the code that packs them: byte t of word (g, q, j) is the
  // biased exponent of scale 4q + t of slot (g, j), for every slot a row reached.
  if (words && hp.padded_scales != nullptr) {
    const int32_t K = c.scale_cols, Q = K / 4;
    for (int32_t g = 0; g < c.groups; ++g)
      for (int64_t j = 0; j < want.counts[size_t(g)]; ++j)
        for (int32_t k = 0; k < K; ++k) {
          uint32_t bits;
          std::memcpy(&bits, &want.scales[size_t((int64_t(g) * K + k) * c.capacity + j)], 4);
          const uint32_t word = want.ue8m0[size_t((int64_t(g) * Q + k / 4) * c.capacity + j)];
          ASSERT_EQ((word >> (8 * (k % 4))) & 0xffu, (bits >> 23) & 0xffu)
              << at << ": slot (" << g << ", " << j << "), scale " << k;
        }
  }

  // unpad_expert_rows from the padded codes just written, into a poisoned output.
  std::vector<uint8_t> back_want(c.codes.size(), kPaddedPoison);
  reference::unpad_expert_rows(testing::unpad_args(c, c.row_offsets.data(), c.src_info.data(),
                                                   want.codes.data(), back_want.data()));
  DeviceBuffer back = upload(std::vector<uint8_t>(c.codes.size(), kPaddedPoison));
  unpad_expert_rows(testing::unpad_args(c, row_offsets.get<uint32_t>(), src_info.get<SrcInfo>(),
                                        out_codes.get(), back.get()),
                    nullptr);
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(download<uint8_t>(back, back_want.size()), back_want) << at << " (unpad)";
}

TEST(PaddedLayout, MatchesTheReference) {
  EPCOMM_REQUIRE_GPU();
  const Shape shapes[] = {
      // DeepEP's decode shapes: FP8 rows of H = 7168 (56 scales), UE8M0 words alone and with
      // the fp32 copy; bf16 rows; groups fuller than their capacity; one group.
      {32, 8, 64, 7168, 56, 60, 5, true, false},
      {32, 8, 64, 7168, 56, 80, 0, true, true},
      {8, 4, 24, 14336, 0, 30, 3, false, false},
      {1, 2, 5, 64, 4, 9, 2, false, true},
      {64, 16, 3, 512, 4, 5, 7, true, false},
      {5, 3, 40, 7168, 3, 40, 1, false, true},   // scale_cols not a multiple of 4: fp32 only
      {128, 8, 512, 16, 4, 400, 0, true, true},  // more rows than one wave of warps
      {6, 4, 32, 256, 8, 30, -17, true, true},   // max_rows below row_offsets[G]: cut short
  };
  for (const Shape& s : shapes)
    for (uint64_t seed = 1; seed <= 3; ++seed)
      check_pad(s, seed);
}

// Bad arguments throw InvalidArgument on the host, before anything is launched: the outputs keep
// their poison.
TEST(PaddedLayout, RefusesBadArgumentsBeforeLaunching) {
  EPCOMM_REQUIRE_GPU();
  const PaddedCase c = testing::random_padded_case(4, 2, 8, 64, 4, 8, 0, true, 5);
  const PaddedOut poisoned(c);
  DeviceBuffer row_offsets = upload(c.row_offsets), src_info = upload(c.src_info),
               codes = upload(c.codes), in_scales = upload(c.scales);
  DeviceBuffer out_codes = upload(poisoned.codes), out_scales = upload(poisoned.scales),
               out_words = upload(poisoned.ue8m0), counts = upload(poisoned.counts),
               layout = upload(poisoned.layout_range);
  const PadExpertRows good = testing::pad_args(
      c, {row_offsets.get<uint32_t>(), src_info.get<SrcInfo>(), codes.get(), in_scales.get<float>(),
          out_codes.get(), out_scales.get<float>(), out_words.get<uint32_t>(),
          counts.get<int32_t>(), nullptr, layout.get<int64_t>()});
  std::vector<PadExpertRows> bad(5, good);
  bad[0].padded_scales = nullptr, bad[0].padded_ue8m0 = nullptr;
  bad[1].scales = nullptr;
  bad[2].scale_cols = 3, bad[2].padded_scales = nullptr;
  bad[3].padded_codes = static_cast<char*>(out_codes.get()) + 8;  // misaligned
  bad[4].n_ranks = 0;
  for (size_t k = 0; k < bad.size(); ++k) {
    try {
      pad_expert_rows(bad[k], nullptr);
      ADD_FAILURE() << "case " << k << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << "case " << k << ": " << e.what();
    }
  }
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(download<uint8_t>(out_codes, poisoned.codes.size()), poisoned.codes);
  EXPECT_EQ(download<uint32_t>(out_words, poisoned.ue8m0.size()), poisoned.ue8m0);
  const std::vector<float> scales_now = download<float>(out_scales, poisoned.scales.size());
  EXPECT_EQ(0, std::memcmp(scales_now.data(), poisoned.scales.data(), scales_now.size() * 4));
  EXPECT_EQ(download<int32_t>(counts, poisoned.counts.size()), poisoned.counts);
  EXPECT_EQ(download<int64_t>(layout, poisoned.layout_range.size()), poisoned.layout_range);
}

}  // namespace
}  // namespace epcomm
