// CPU reference of the padded per-expert layout (epcomm/padded_layout.h): row by row in the
// order of the dispatch output, as the kernels' warps would, one at a time.
#include <algorithm>
#include <cstring>

#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
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

[[noreturn]] void invalid(const std::string& msg) {
  throw Error(ErrorCode::kInvalidArgument, msg);
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

PaddedDispatchResult dispatch_padded(const Problem& p, int32_t rank, TokenFormat format,
                                     int64_t capacity, bool fp8_pow2, bool ue8m0,
                                     int64_t max_routed_rows, uint8_t untouched) {
  const bool fp8 = format == TokenFormat::kFp8Blockwise;
  if (format != TokenFormat::kBF16 && !fp8)
    invalid(std::string("dispatch_padded: format ") + token_format_name(format) +
            " (the padded layout takes bf16 and fp8-blockwise)");
  if (ue8m0 && !(fp8 && fp8_pow2 && p.hidden % Ue8m0ScaleLayout::kValuesPerWord == 0))
    invalid("dispatch_padded: ue8m0 needs fp8-blockwise, fp8_pow2 and hidden % 512 == 0");
  PaddedDispatchResult r;
  r.meta = dispatch(p, rank);
  const int32_t G = int32_t(r.meta.row_offsets.size()) - 1;
  for (int32_t g = 0; g < G; ++g)
    if (r.meta.row_offsets[size_t(g) + 1] - r.meta.row_offsets[size_t(g)] > capacity)
      invalid("dispatch_padded: group " + std::to_string(g) + " of rank " + std::to_string(rank) +
              " has more rows than capacity " + std::to_string(capacity));
  const int64_t row_bytes = format_row_bytes(format, p.hidden);
  const size_t slots = size_t(G) * size_t(capacity);
  const uint32_t word = uint32_t(untouched) * 0x01010101u;
  r.codes.assign(slots * size_t(row_bytes), untouched);
  r.counts.assign(size_t(G), int32_t(word));
  r.slot_token.assign(slots, int32_t(word));
  r.layout_range.assign(size_t(G) * size_t(p.n_ranks), int64_t(uint64_t(word) << 32 | word));
  PadExpertRows a;
  a.row_bytes = row_bytes;
  a.n_ranks = p.n_ranks;
  a.capacity = capacity;
  a.padded_codes = r.codes.data();
  a.counts = r.counts.data();
  a.src_token = r.slot_token.data();
  a.layout_range = r.layout_range.data();
  QuantDispatchResult q;
  if (!fp8) {
    a.rows = DispatchRows{r.meta.row_offsets.data(), r.meta.src_info.data(), G, r.meta.rows()};
    a.codes = r.meta.tokens.data();
  } else {
    q = dispatch_quantized(p, rank, QuantFormat::kFp8Blockwise, 1.0f, max_routed_rows, fp8_pow2);
    // src_info as the device holds it: max_rows entries (the scales' leading dimension), not
    // only the used rows, so a rank that receives nothing has an array, not a null pointer.
    q.src_info.resize(size_t(q.out.shape.rows), SrcInfo{-1, -1, -1});
    a.rows = DispatchRows{q.row_offsets.data(), q.src_info.data(), G, q.out.shape.rows};
    a.codes = q.out.codes.data();
    a.scales = q.out.fp8_scales.data();
    a.scale_cols = p.hidden / Fp8ScaleLayout::kGroup;
    const int64_t cols = ue8m0 ? p.hidden / Ue8m0ScaleLayout::kValuesPerWord : a.scale_cols;
    r.scales.assign(size_t(G) * size_t(cols) * size_t(capacity), word);
    if (ue8m0)
      a.padded_ue8m0 = r.scales.data();
    else
      a.padded_scales = reinterpret_cast<float*>(r.scales.data());
  }
  pad_expert_rows(a);
  r.meta.tokens.clear();  // the packed rows' data is not the layout's
  return r;
}

}  // namespace reference
}  // namespace epcomm
