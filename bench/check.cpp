#include "check.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <future>

namespace epbench {

namespace ref = epcomm::reference;

namespace {
std::string hex16(uint16_t v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%04x", unsigned(v));
  return buf;
}
}  // namespace

Reference build_reference(const ref::Problem& problem, const Team& team) {
  Reference r;
  const int n = problem.n_ranks;
  r.dispatch.resize(size_t(n));
  std::vector<std::future<void>> jobs;
  for (int rank = 0; rank < n; ++rank)
    jobs.push_back(std::async(std::launch::async, [&, rank] {
      r.dispatch[size_t(rank)] = ref::dispatch(problem, rank);
    }));
  for (auto& j : jobs)
    j.get();

  std::vector<std::vector<uint16_t>> expert_out;
  for (const ref::DispatchResult& d : r.dispatch)
    expert_out.push_back(d.tokens);
  r.combine.resize(team.n_local());
  jobs.clear();
  for (size_t i = 0; i < team.n_local(); ++i)
    jobs.push_back(std::async(std::launch::async, [&, i] {
      r.combine[i] = ref::combine(problem, r.dispatch, expert_out, team.local()[i].rank, true);
    }));
  for (auto& j : jobs)
    j.get();
  return r;
}

std::string check_dispatch(const ref::DispatchResult& ref, const epcomm::DispatchOutput& out,
                           int32_t num_groups, int64_t max_recv_rows, int32_t hidden) {
  const std::vector<uint32_t> row_offsets = download(out.row_offsets, size_t(num_groups) + 1);
  const int64_t gpu_rows = row_offsets[size_t(num_groups)];
  if (gpu_rows > max_recv_rows)
    return "row_offsets[G] = " + std::to_string(gpu_rows) +
           " exceeds max_recv_rows = " + std::to_string(max_recv_rows);
  // Download enough rows for whichever of the two has more, so the comparison stays in bounds.
  const size_t rows = size_t(std::max(gpu_rows, ref.rows()));
  const std::vector<int32_t> expert_ids = download(out.expert_ids, size_t(num_groups));
  const std::vector<epcomm::SrcInfo> src_info = download(out.src_info, rows);
  const std::vector<uint16_t> tokens =
      download(static_cast<const uint16_t*>(out.tokens), rows * size_t(hidden));
  return ref::compare_dispatch(ref, row_offsets.data(), expert_ids.data(), src_info.data(),
                               tokens.data(), hidden);
}

std::string check_expert_major(const ref::DispatchResult& ref,
                               const std::vector<uint32_t>& row_offsets,
                               const std::vector<uint16_t>& tokens, int32_t hidden) {
  for (size_t g = 0; g < ref.row_offsets.size(); ++g)
    if (g >= row_offsets.size() || row_offsets[g] != ref.row_offsets[g])
      return "row_offsets[" + std::to_string(g) +
             "] = " + (g < row_offsets.size() ? std::to_string(row_offsets[g]) : "missing") +
             ", reference " + std::to_string(ref.row_offsets[g]);
  const size_t h = size_t(hidden);
  if (tokens.size() < size_t(ref.rows()) * h) return "too few rows downloaded";
  for (int64_t row = 0; row < ref.rows(); ++row) {
    const uint16_t* got = tokens.data() + size_t(row) * h;
    const uint16_t* want = ref.tokens.data() + size_t(row) * h;
    if (std::memcmp(got, want, h * sizeof(uint16_t)) == 0) continue;
    size_t col = 0;
    while (got[col] == want[col])
      ++col;
    const epcomm::SrcInfo& s = ref.src_info[size_t(row)];
    return "row " + std::to_string(row) + " (from rank " + std::to_string(s.rank) + " token " +
           std::to_string(s.token) + " slot " + std::to_string(s.slot) + "), column " +
           std::to_string(col) + ": got bf16 " + hex16(got[col]) + ", reference " +
           hex16(want[col]);
  }
  return "";
}

std::string check_combine(const std::vector<double>& ref, const std::vector<uint16_t>& out) {
  if (out.size() != ref.size())
    return "size " + std::to_string(out.size()) + ", reference " + std::to_string(ref.size());
  return ref::compare_combine_bf16(ref, out.data(), int64_t(out.size()));
}

std::vector<double> logical_bytes(const ref::Problem& problem) {
  const int32_t n_local = problem.n_experts / problem.n_ranks;
  std::vector<double> bytes(size_t(problem.n_ranks), 0.0);
  std::vector<char> hit(size_t(problem.n_ranks));
  for (const ref::RankInput& in : problem.ranks)
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      std::fill(hit.begin(), hit.end(), 0);
      for (int32_t k = 0; k < problem.top_k; ++k) {
        const int32_t e = in.topk_ids[size_t(t) * problem.top_k + k];
        if (e >= 0) hit[size_t(e / n_local)] = 1;
      }
      for (size_t r = 0; r < hit.size(); ++r)
        if (hit[r]) bytes[r] += 2.0 * problem.hidden;
    }
  return bytes;
}

}  // namespace epbench
