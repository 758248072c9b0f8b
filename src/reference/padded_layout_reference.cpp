// CPU reference of the padded per-expert layout (epcomm/padded_layout.h): row by row in the
// order of the dispatch output, as the kernels' warps would, one at a time.
#include <algorithm>
#include <cstring>

#include "epcomm/formats/codecs.h"
#include "epcomm/reference.h"

namespace epcomm {
namespace reference {
namespace {

int64_t used_rows(const DispatchRows& r) {
  return std::min(int64_t(r.row_offsets[r.groups]), r.max_rows);
}

GroupSlots slots_of(const DispatchRows& r, int64_t capacity) {
  return GroupSlots{r.row_offsets, r.groups, capacity};
}

}  // namespace

void pad_expert_rows(const PadExpertRows& a) {
  check_pad_expert_rows(a);
  const DispatchRows& r = a.rows;
  for (int32_t g = 0; g < r.groups; ++g) {
    const int64_t first = r.row_offsets[g];
    int64_t n = std::min(int64_t(r.row_offsets[g + 1]), r.max_rows) - first;
    while (n > 0 && r.src_info[first + n - 1].rank < 0)
      --n;
    a.counts[g] = int32_t(std::max<int64_t>(0, std::min(n, a.capacity)));
  }
  if (a.layout_range != nullptr)
    std::fill_n(a.layout_range, int64_t(r.groups) * a.n_ranks, int64_t(0));
  const int64_t n = used_rows(r);
  const int32_t words = a.scale_cols / 4;
  const GroupSlots gs = slots_of(r, a.capacity);
  for (int64_t i = 0; i < n; ++i) {
    const SrcInfo s = r.src_info[i];
    if (s.rank < 0) continue;  // FP8 padding
    const int32_t g = gs.group_of(i);
    const int64_t j = gs.slot_in(g, i);
    if (j < 0 || j >= a.capacity) continue;
    const int64_t slot = gs.slot_row(g, i);
    std::memcpy(static_cast<char*>(a.padded_codes) + slot * a.row_bytes,
                static_cast<const char*>(a.codes) + i * a.row_bytes, size_t(a.row_bytes));
    const auto scale = [&](int32_t k) { return a.scales[int64_t(k) * r.max_rows + i]; };
    if (a.padded_scales != nullptr)
      for (int32_t k = 0; k < a.scale_cols; ++k)
        a.padded_scales[(int64_t(g) * a.scale_cols + k) * a.capacity + j] = scale(k);
    if (a.padded_ue8m0 != nullptr)
      for (int32_t q = 0; q < words; ++q)
        a.padded_ue8m0[(int64_t(g) * words + q) * a.capacity + j] = Fp8BlockQuant::ue8m0_word(
            scale(4 * q), scale(4 * q + 1), scale(4 * q + 2), scale(4 * q + 3));
    if (a.src_token != nullptr) a.src_token[slot] = s.token;
    if (a.layout_range != nullptr && s.rank < a.n_ranks) {
      const bool starts = j == 0 || r.src_info[i - 1].rank != s.rank;
      int64_t& range = a.layout_range[int64_t(g) * a.n_ranks + s.rank];
      range = int64_t(uint64_t(range) + (starts ? uint64_t(j) << 32 : 0u) + 1u);
    }
  }
}

void unpad_expert_rows(const UnpadExpertRows& a) {
  check_unpad_expert_rows(a);
  const DispatchRows& r = a.rows;
  const int64_t n = used_rows(r);
  const GroupSlots gs = slots_of(r, a.capacity);
  for (int64_t i = 0; i < n; ++i) {
    char* dst = static_cast<char*>(a.out) + i * a.row_bytes;
    const int32_t g = gs.group_of(i);
    const int64_t j = gs.slot_in(g, i);
    if (r.src_info[i].rank < 0 || j < 0 || j >= a.capacity)
      std::memset(dst, 0, size_t(a.row_bytes));
    else
      std::memcpy(dst, static_cast<const char*>(a.padded) + gs.slot_row(g, i) * a.row_bytes,
                  size_t(a.row_bytes));
  }
}

}  // namespace reference
}  // namespace epcomm
