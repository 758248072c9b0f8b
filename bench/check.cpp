#include "check.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <future>
#include <stdexcept>

#include "epcomm/bf16.h"
#include "epcomm/formats/scale_layouts.h"

namespace epbench {

namespace ref = epcomm::reference;

namespace {

std::string hex(uint32_t v, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%0*x", digits, unsigned(v));
  return buf;
}

// f(0) .. f(n - 1), each on a thread of its own; rethrows the first exception.
template <class F>
void parallel_for(size_t n, const F& f) {
  std::vector<std::future<void>> jobs;
  for (size_t i = 0; i < n; ++i)
    jobs.push_back(std::async(std::launch::async, [&f, i] { f(i); }));
  for (auto& j : jobs)
    j.get();
}

// The first of n bytes where a and b differ, or -1.
int64_t first_difference(const uint8_t* a, const uint8_t* b, int64_t n) {
  if (n <= 0 || std::memcmp(a, b, size_t(n)) == 0) return -1;
  int64_t i = 0;
  while (a[i] == b[i])
    ++i;
  return i;
}

// f(rank) of every local rank, computed in parallel, in local-rank order.
template <class F>
auto per_local_rank(const Team& team, F f) {
  std::vector<decltype(f(int32_t(0)))> out(team.n_local());
  parallel_for(team.n_local(), [&](size_t i) { out[i] = f(team.local()[i].rank); });
  return out;
}

// Weighted combine of every local rank, token side; layouts[d] gives the rows of rank d's expert
// outputs.
std::vector<std::vector<double>> combine_reference(
    const ref::Problem& problem, const std::vector<ref::DispatchResult>& layouts,
    const std::vector<std::vector<uint16_t>>& expert_out, const Team& team) {
  return per_local_rank(team, [&](int32_t rank) {
    return ref::combine(problem, layouts, expert_out, rank, true);
  });
}

// The same with the expert-side reduction.
std::vector<std::vector<float>> combine_expert_side_reference(
    const ref::Problem& problem, const std::vector<ref::DispatchResult>& layouts,
    const std::vector<std::vector<uint16_t>>& expert_out, const Team& team) {
  return per_local_rank(team, [&](int32_t rank) {
    return ref::combine_expert_side(problem, layouts, expert_out, rank);
  });
}

// Every rank's synthetic expert outputs, one per row of its layout (padding rows included).
std::vector<std::vector<uint16_t>> synthetic_expert_outputs(
    const std::vector<ref::DispatchResult>& layouts, int32_t hidden) {
  std::vector<std::vector<uint16_t>> out(layouts.size());
  parallel_for(layouts.size(), [&](size_t d) {
    const int64_t rows = layouts[d].rows();
    out[d].resize(size_t(rows) * size_t(hidden));
    for (int64_t r = 0; r < rows; ++r)
      for (int32_t c = 0; c < hidden; ++c)
        out[d][size_t(r) * size_t(hidden) + size_t(c)] = synthetic_expert_value(int32_t(d), r, c);
  });
  return out;
}

// reference::dispatch's rows with every group padded to a multiple of `align` by rows
// {-1, -1, -1} at its end: the rows of a quantised dispatch output, for the ranks whose
// dispatch_quantized this process does not compute (checked equal to it on the local ranks).
ref::DispatchResult padded_layout(const ref::DispatchResult& d, int32_t align) {
  const int32_t groups = int32_t(d.expert_ids.size());
  std::vector<int32_t> counts(static_cast<size_t>(groups));
  for (int32_t g = 0; g < groups; ++g)
    counts[size_t(g)] = int32_t(d.row_offsets[size_t(g) + 1] - d.row_offsets[size_t(g)]);
  ref::DispatchResult p;
  p.row_offsets.resize(size_t(groups) + 1);
  epcomm::padded_row_offsets(counts.data(), groups, align, p.row_offsets.data());
  p.expert_ids = d.expert_ids;
  p.src_info.assign(p.row_offsets.back(), epcomm::SrcInfo{-1, -1, -1});
  for (int32_t g = 0; g < groups; ++g)
    std::copy(d.src_info.begin() + d.row_offsets[size_t(g)],
              d.src_info.begin() + d.row_offsets[size_t(g) + 1],
              p.src_info.begin() + p.row_offsets[size_t(g)]);
  return p;
}

bool same_layout(const ref::DispatchResult& a, const ref::QuantDispatchResult& b) {
  return a.row_offsets == b.row_offsets && a.expert_ids == b.expert_ids &&
         a.src_info.size() == b.src_info.size() &&
         (a.src_info.empty() || std::memcmp(a.src_info.data(), b.src_info.data(),
                                            a.src_info.size() * sizeof(epcomm::SrcInfo)) == 0);
}

// The messages of `rows` bf16 tokens as the reference encoders give them: [rows, m.row_bytes()],
// each the row's codes, then its scales, then zeros.
std::vector<uint8_t> encode_messages(const MessageFormat& m, const std::vector<uint16_t>& tokens,
                                     int32_t rows) {
  const int32_t h = m.hidden;
  const size_t codes_bytes = size_t(m.codes_bytes()), scales_bytes = size_t(m.scales_bytes());
  const size_t row_bytes = size_t(m.row_bytes());
  std::vector<float> x(size_t(rows) * size_t(h));
  std::transform(tokens.begin(), tokens.begin() + std::ptrdiff_t(x.size()), x.begin(),
                 epcomm::bf16_to_float);
  std::vector<uint8_t> codes(size_t(rows) * codes_bytes);
  std::vector<uint8_t> scales(size_t(rows) * scales_bytes);  // row-major, as the encoders write
  switch (m.format) {
    case epcomm::TokenFormat::kBF16:
      std::memcpy(codes.data(), tokens.data(), codes.size());
      break;
    case epcomm::TokenFormat::kFp8Blockwise: {
      std::vector<float> s(scales.size() / sizeof(float));
      ref::encode_fp8_blockwise(x.data(), rows, h, codes.data(), s.data());
      std::memcpy(scales.data(), s.data(), scales.size());
      break;
    }
    case epcomm::TokenFormat::kNvfp4:
      ref::encode_nvfp4(x.data(), rows, h, m.nvfp4_global_scale, codes.data(), scales.data());
      break;
    case epcomm::TokenFormat::kMxfp8:
      ref::encode_mxfp8(x.data(), rows, h, codes.data(), scales.data());
      break;
    case epcomm::TokenFormat::kMxfp4:
      ref::encode_mxfp4(x.data(), rows, h, codes.data(), scales.data());
      break;
  }
  std::vector<uint8_t> out(size_t(rows) * row_bytes, 0);
  for (size_t r = 0; r < size_t(rows); ++r) {
    std::memcpy(out.data() + r * row_bytes, codes.data() + r * codes_bytes, codes_bytes);
    if (scales_bytes > 0)
      std::memcpy(out.data() + r * row_bytes + codes_bytes, scales.data() + r * scales_bytes,
                  scales_bytes);
  }
  return out;
}

// epcomm's quantised dispatch output on the device, downloaded as far as
// reference::compare_dispatch_quantized reads it (the buffers' sizes are Sizes'), compared with it.
std::string check_dispatch_quantized(const ref::QuantDispatchResult& want,
                                     const epcomm::DispatchOutput& out,
                                     const epcomm::Sizes& sizes) {
  const size_t groups = size_t(sizes.num_groups);
  const std::vector<uint32_t> row_offsets = download(out.row_offsets, groups + 1);
  const size_t rows = size_t(std::min<int64_t>(row_offsets[groups], sizes.max_recv_rows));
  const std::vector<int32_t> expert_ids = download(out.expert_ids, groups);
  const std::vector<epcomm::SrcInfo> src_info = download(out.src_info, rows);
  const std::vector<uint8_t> codes =
      download(static_cast<const uint8_t*>(out.tokens), rows * size_t(sizes.token_bytes));
  const std::vector<uint8_t> scales =
      download(static_cast<const uint8_t*>(out.scales), size_t(sizes.scales_bytes));
  const std::vector<uint32_t> scales_offsets =
      download(out.scales_offsets, size_t(std::max(sizes.num_scales_offsets, 0)));
  return ref::compare_dispatch_quantized(
      want, ref::QuantizedDispatchView{sizes.num_groups, sizes.max_recv_rows, sizes.token_bytes,
                                       sizes.scales_bytes, sizes.num_scales_offsets,
                                       row_offsets.data(), expert_ids.data(), src_info.data(),
                                       codes.data(), scales.data(), scales_offsets.data()});
}

}  // namespace

Reference build_reference(const ref::Problem& problem, const Team& team,
                          const MessageFormat& message, const epcomm::Sizes& sizes,
                          bool with_nccl, bool expert_side) {
  Reference r;
  r.message = message;
  const size_t n = size_t(problem.n_ranks);
  r.dispatch.resize(n);
  parallel_for(n, [&](size_t rank) { r.dispatch[rank] = ref::dispatch(problem, int32_t(rank)); });
  if (!message.quantized()) {  // expert outputs = the dispatched tokens themselves
    std::vector<std::vector<uint16_t>> expert_out;
    for (const ref::DispatchResult& d : r.dispatch)
      expert_out.push_back(d.tokens);
    // epcomm's check reads one of the two; the NCCL baseline's, the token side.
    if (expert_side)
      r.combine_expert_side = combine_expert_side_reference(problem, r.dispatch, expert_out, team);
    if (!expert_side || with_nccl)
      r.combine = combine_reference(problem, r.dispatch, expert_out, team);
    return r;
  }

  const size_t n_local = team.n_local();
  r.quant.resize(n_local);
  parallel_for(n_local, [&](size_t i) {
    ref::QuantDispatchResult& q = r.quant[i];
    q = ref::dispatch_quantized(problem, team.local()[i].rank, ref::quant_format(message.format),
                                message.nvfp4_global_scale, sizes.max_routed_rows);
    q.out.codes.resize(size_t(q.rows() * q.out.shape.row_bytes()));  // the rows in use
    q.out.codes.shrink_to_fit();
  });

  // Every rank's output rows (combine reads them all); the local ranks' are dispatch_quantized's.
  std::vector<ref::DispatchResult> padded(n);
  for (size_t d = 0; d < n; ++d)
    padded[d] = padded_layout(r.dispatch[d], epcomm::format_row_align(message.format));
  for (size_t i = 0; i < n_local; ++i)
    if (!same_layout(padded[size_t(team.local()[i].rank)], r.quant[i]))
      throw std::logic_error("epcomm_bench: padding reference::dispatch's rows does not give " +
                             std::string("reference::dispatch_quantized's on rank ") +
                             std::to_string(team.local()[i].rank));
  const std::vector<std::vector<uint16_t>> padded_out =
      synthetic_expert_outputs(padded, problem.hidden);
  if (expert_side)
    r.combine_expert_side = combine_expert_side_reference(problem, padded, padded_out, team);
  else
    r.combine = combine_reference(problem, padded, padded_out, team);
  if (with_nccl) {
    r.nccl_combine = combine_reference(problem, r.dispatch,
                                       synthetic_expert_outputs(r.dispatch, problem.hidden), team);
    r.messages.resize(n);
    parallel_for(n, [&](size_t s) {
      r.messages[s] =
          encode_messages(message, problem.ranks[s].tokens, problem.ranks[s].num_tokens);
    });
  }
  for (ref::DispatchResult& d : r.dispatch)
    d.tokens = std::vector<uint16_t>();  // no longer needed: rows are checked as messages
  return r;
}

std::string check_dispatch(const Reference& ref, size_t local_index, int32_t rank,
                           const epcomm::DispatchOutput& out, const epcomm::Sizes& sizes) {
  if (ref.message.quantized()) return check_dispatch_quantized(ref.quant[local_index], out, sizes);
  const ref::DispatchResult& want = ref.dispatch[size_t(rank)];
  const int32_t groups = sizes.num_groups;
  const std::vector<uint32_t> row_offsets = download(out.row_offsets, size_t(groups) + 1);
  const int64_t gpu_rows = row_offsets[size_t(groups)];
  if (gpu_rows > sizes.max_recv_rows)
    return "row_offsets[G] = " + std::to_string(gpu_rows) +
           " exceeds max_recv_rows = " + std::to_string(sizes.max_recv_rows);
  // Download enough rows for whichever of the two has more, so the comparison stays in bounds.
  const size_t rows = size_t(std::max(gpu_rows, want.rows()));
  const std::vector<int32_t> expert_ids = download(out.expert_ids, size_t(groups));
  const std::vector<epcomm::SrcInfo> src_info = download(out.src_info, rows);
  const int32_t hidden = ref.message.hidden;
  const std::vector<uint16_t> tokens =
      download(static_cast<const uint16_t*>(out.tokens), rows * size_t(hidden));
  return ref::compare_dispatch(want, row_offsets.data(), expert_ids.data(), src_info.data(),
                               tokens.data(), hidden);
}

std::string check_expert_major(const Reference& ref, int32_t rank,
                               const std::vector<uint32_t>& row_offsets,
                               const std::vector<uint8_t>& rows) {
  const ref::DispatchResult& layout = ref.dispatch[size_t(rank)];
  for (size_t g = 0; g < layout.row_offsets.size(); ++g)
    if (g >= row_offsets.size() || row_offsets[g] != layout.row_offsets[g])
      return "row_offsets[" + std::to_string(g) +
             "] = " + (g < row_offsets.size() ? std::to_string(row_offsets[g]) : "missing") +
             ", reference " + std::to_string(layout.row_offsets[g]);
  const MessageFormat& m = ref.message;
  const size_t row_bytes = size_t(m.row_bytes());
  if (rows.size() < size_t(layout.rows()) * row_bytes) return "too few rows downloaded";
  for (int64_t row = 0; row < layout.rows(); ++row) {
    const epcomm::SrcInfo& s = layout.src_info[size_t(row)];
    const uint8_t* got = rows.data() + size_t(row) * row_bytes;
    const uint8_t* want =
        m.quantized()
            ? ref.messages[size_t(s.rank)].data() + size_t(s.token) * row_bytes
            : reinterpret_cast<const uint8_t*>(layout.tokens.data()) + size_t(row) * row_bytes;
    const int64_t b = first_difference(got, want, int64_t(row_bytes));
    if (b < 0) continue;
    std::string where;
    if (!m.quantized()) {
      uint16_t g = 0, w = 0;
      std::memcpy(&g, got + b / 2 * 2, 2);
      std::memcpy(&w, want + b / 2 * 2, 2);
      where = "column " + std::to_string(b / 2) + ": got bf16 " + hex(g, 4) + ", reference " +
              hex(w, 4);
    } else {
      where = b < m.codes_bytes() ? "codes byte " + std::to_string(b)
              : b < m.bytes()     ? "scales byte " + std::to_string(b - m.codes_bytes())
                                  : "padding byte " + std::to_string(b - m.bytes());
      where += ": got " + hex(got[b], 2) + ", reference " + hex(want[b], 2);
    }
    return "row " + std::to_string(row) + " (from rank " + std::to_string(s.rank) + " token " +
           std::to_string(s.token) + " slot " + std::to_string(s.slot) + "), " + where;
  }
  return "";
}

std::string check_combine(const std::vector<double>& ref, const std::vector<uint16_t>& out) {
  if (out.size() != ref.size())
    return "size " + std::to_string(out.size()) + ", reference " + std::to_string(ref.size());
  return ref::compare_combine_bf16(ref, out.data(), int64_t(out.size()));
}

std::string check_combine_expert_side(const std::vector<float>& ref,
                                      const std::vector<uint16_t>& out) {
  return ref::compare_combine_expert_side(ref, out.data(), int64_t(out.size()));
}

std::vector<double> messages_received(const ref::Problem& problem) {
  std::vector<double> messages(size_t(problem.n_ranks), 0.0);
  for (int32_t s = 0; s < problem.n_ranks; ++s)
    for (int32_t t = 0; t < problem.ranks[size_t(s)].num_tokens; ++t)
      for (uint64_t d = ref::destination_ranks(problem, s, t); d != 0; d &= d - 1)
        messages[size_t(__builtin_ctzll(d))] += 1.0;
  return messages;
}

}  // namespace epbench
