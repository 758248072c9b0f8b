// reference::routing_layout: the CPU model of epcomm::routing_layout (epcomm/routing_layout.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "epcomm/reference.h"

namespace epcomm {
namespace reference {

void routing_layout(const RoutingLayout& a) {
  check_routing_layout(a);
  const int32_t E = a.num_experts, R = a.n_ranks, per_rank = E / R;
  std::vector<int32_t> experts(size_t(E), 0), ranks(size_t(R), 0);
  std::vector<char> in(static_cast<size_t>(R));
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    std::fill(in.begin(), in.end(), 0);
    if (a.rank_mask != nullptr)
      for (int32_t r = 0; r < R; ++r)
        in[size_t(r)] = reinterpret_cast<const uint8_t*>(a.rank_mask)[t * R + r] != 0 ? 1 : 0;
    for (int32_t k = 0; k < a.top_k; ++k) {
      const int64_t i = t * a.ids_stride + k;
      const int64_t e = a.id_bytes == 8 ? static_cast<const int64_t*>(a.topk_ids)[i]
                                        : static_cast<const int32_t*>(a.topk_ids)[i];
      if (e < 0 || e >= E) continue;
      ++experts[size_t(e)];
      in[size_t(e / per_rank)] = 1;
    }
    for (int32_t r = 0; r < R; ++r) {
      if (a.token_in_rank != nullptr) a.token_in_rank[t * R + r] = in[size_t(r)] != 0;
      if (a.rank_ids != nullptr) a.rank_ids[t * R + r] = in[size_t(r)] ? r : -1;
      ranks[size_t(r)] += in[size_t(r)];
    }
  }
  if (a.tokens_per_expert != nullptr)
    std::memcpy(a.tokens_per_expert, experts.data(), experts.size() * sizeof(int32_t));
  if (a.tokens_per_rank != nullptr)
    std::memcpy(a.tokens_per_rank, ranks.data(), ranks.size() * sizeof(int32_t));
}

void received_topk(const ReceivedTopk& a) {
  check_received_topk(a);
  const int64_t rows = std::min<int64_t>(int64_t(*a.num_rows), a.max_rows);
  std::vector<int32_t> local(size_t(a.n_local), 0);
  for (int64_t i = 0; i < a.max_rows; ++i) {
    const char* row = reinterpret_cast<const char*>(a.ids) + i * a.row_bytes;
    const char* wrow = reinterpret_cast<const char*>(a.weights) + i * a.row_bytes;
    for (int32_t k = 0; k < a.top_k; ++k) {
      int64_t id = -1;
      float w = 0.f;
      if (i < rows) {
        int64_t e;
        std::memcpy(&e, row + 8 * k, 8);
        if (e >= a.first_expert && e - a.first_expert < a.n_local) {
          id = e - a.first_expert;
          std::memcpy(&w, wrow + 4 * k, 4);
          ++local[size_t(id)];
        }
      }
      a.local_ids[i * a.top_k + k] = id;
      a.local_weights[i * a.top_k + k] = w;
    }
  }
  a.counts[0] = int32_t(rows);
  std::memcpy(a.counts + 1, local.data(), local.size() * sizeof(int32_t));
}

}  // namespace reference
}  // namespace epcomm
