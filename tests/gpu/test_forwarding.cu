// The forwarded header written and read by warps (detail/forward_warp.cuh) against the scalar
// functions the CPU tests check against the direct path (write_forward_header,
// ForwardHeaderView::rebuild_direct; tests/cpu/test_forwarding.cpp): for random routings on the
// declared splits, 2 x 8 and 64 ranks as 8 x 8, 2 x 32 and 1 x 64, top-1 to top-16 and 17 (the
// shared expert's slot), masked slots, lanes past top-k holding values to ignore, with and
// without weights, every byte of every forwarded header and every rebuilt
// direct header equal, the buffers poisoned alike first so a stray or missing write shows.
// Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/detail/forward_warp.cuh"
#include "harness.h"

namespace epcomm {
namespace {

using testing::DeviceBuffer;

struct Routed {  // per token: K slots, then the stream index of every rank
  const int32_t* ids;
  const int32_t* pos;
  const float* weight;
  const int32_t* slots;  // [T, R]
};

// One warp a token: every node's forwarded header, then every destination's rebuilt header.
__global__ void forward_headers(Routed in, ExpertMap em, detail::NodeMap nodes,
                                detail::ForwardHeaderLayout fl, int64_t direct_bytes, char* fwd,
                                char* direct) {
  const int32_t t = blockIdx.x, K = fl.top_k, lane = threadIdx.x;
  // Lanes past top_k hold valid-looking values, which the functions must ignore.
  const int32_t id = lane < K ? in.ids[t * K + lane] : (lane * 7 + t) % em.n_experts;
  const int32_t pos = lane < K ? in.pos[t * K + lane] : 1234;
  const float w = lane < K ? in.weight[t * K + lane] : 5.f;
  const int32_t rank = lane < K && id >= 0 ? em.rank_of(id) : -1;
  unsigned long long mask = 0;
  for (int q = 0; q < detail::kWarpSize; ++q) {
    const int32_t r = __shfl_sync(0xffffffffu, rank, q);
    if (r >= 0) mask |= 1ull << r;
  }
  // As LaneRoute::slot_of: lane l holds rank l's stream index and rank l + 32's, and a
  // destination's comes by shuffle (every lane calls it).
  const int32_t* slots = in.slots + int64_t(t) * nodes.n_ranks;
  const int32_t lo = lane < nodes.n_ranks ? slots[lane] : -1;
  const int32_t hi = lane + 32 < nodes.n_ranks ? slots[lane + 32] : -1;
  auto slot_of = [&](int32_t r) {
    const int32_t a = __shfl_sync(0xffffffffu, lo, r % detail::kWarpSize);
    const int32_t b = __shfl_sync(0xffffffffu, hi, r % detail::kWarpSize);
    return r < detail::kWarpSize ? a : b;
  };
  const int32_t max_d = fl.max_dests();
  for (int32_t node = 0; node < nodes.n_nodes(); ++node) {
    const int64_t at = int64_t(t) * nodes.n_nodes() + node;
    const detail::ForwardHeaderView v{fwd + at * fl.bytes(), fl};
    const int32_t n =
        detail::write_forward_header_warp(v, em, nodes, node, t, id, pos, w, mask, slot_of);
    __syncwarp();
    for (int32_t j = 0; j < n; ++j)
      detail::rebuild_direct_warp(v, j, direct + (at * max_d + j) * direct_bytes);
  }
}

TEST(ForwardWarp, MatchesTheScalarHeaders) {
  EPCOMM_REQUIRE_GPU();
  std::mt19937 rng(11);
  // The declared splits, 8 ranks a node, and 64 ranks three ways (the mask's high bits; a node
  // of 64 ranks).
  const std::vector<std::pair<int32_t, int32_t>> splits = {
      {1, 4}, {2, 2}, {4, 1}, {2, 4}, {4, 2}, {4, 4}, {2, 8}, {8, 8}, {2, 32}, {1, 64}};
  const int32_t T = 96;
  int64_t headers_checked = 0;
  for (const auto& [n_nodes, rpn] : splits) {
    for (int32_t K : {1, 2, 3, 4, 6, 8, 16, 17}) {  // 17: top-16 and the shared expert
      const int32_t R = n_nodes * rpn, E = 8 * R;
      const std::string what =
          std::to_string(n_nodes) + "x" + std::to_string(rpn) + " top-" + std::to_string(K);
      const ExpertMap em{E, R};
      const detail::NodeMap nm{R, rpn};
      const detail::ForwardHeaderLayout fl{K, rpn};
      const detail::MessageLayout ml{64, K, TokenFormat::kBF16};
      const int64_t hb = ml.header_bytes();
      // K distinct experts a token, a fifth of the slots masked; every fourth token unweighted.
      std::vector<int32_t> ids(size_t(T * K)), pos(ids.size()), slots(size_t(T * R)),
          all(static_cast<size_t>(E));
      std::vector<float> w(ids.size());
      for (int32_t t = 0; t < T; ++t) {
        for (int32_t e = 0; e < E; ++e)
          all[size_t(e)] = e;
        std::shuffle(all.begin(), all.end(), rng);
        for (int32_t k = 0; k < K; ++k) {
          const size_t i = size_t(t * K + k);
          ids[i] = rng() % 5 == 0 ? -1 : all[size_t(k)];
          pos[i] = int32_t(rng() % 100000);
          w[i] = t % 4 == 0 ? 0.f : float(rng() % 1000) / 997.0f;
        }
        for (int32_t r = 0; r < R; ++r)
          slots[size_t(t * R + r)] = int32_t(rng() % 4096);
      }
      const size_t fwd_bytes = size_t(int64_t(T) * n_nodes * fl.bytes());
      const size_t direct_bytes = size_t(int64_t(T) * n_nodes * fl.max_dests() * hb);
      std::vector<char> want_fwd(fwd_bytes, char(0x5a)), want_direct(direct_bytes, char(0x5a));
      for (int32_t t = 0; t < T; ++t) {
        const int32_t* tid = ids.data() + t * K;
        unsigned long long mask = 0;
        for (int32_t k = 0; k < K; ++k)
          if (tid[k] >= 0) mask |= 1ull << em.rank_of(tid[k]);
        for (int32_t node = 0; node < n_nodes; ++node) {
          const int64_t at = int64_t(t) * n_nodes + node;
          const detail::ForwardHeaderView v{want_fwd.data() + at * fl.bytes(), fl};
          const int32_t n = detail::write_forward_header(
              v, em, nm, node, t, tid, pos.data() + t * K, w.data() + t * K,
              [&](int32_t r) { return slots[size_t(t * R + r)]; });
          for (int32_t j = 0; j < n; ++j)
            v.rebuild_direct(j, want_direct.data() + (at * fl.max_dests() + j) * hb);
          headers_checked += n;
        }
      }
      DeviceBuffer d_ids(0, ids.size() * 4), d_pos(0, pos.size() * 4), d_w(0, w.size() * 4),
          d_slots(0, slots.size() * 4), d_fwd(0, fwd_bytes), d_direct(0, direct_bytes);
      d_ids.upload(ids.data(), ids.size() * 4);
      d_pos.upload(pos.data(), pos.size() * 4);
      d_w.upload(w.data(), w.size() * 4);
      d_slots.upload(slots.data(), slots.size() * 4);
      d_fwd.fill(0x5a, nullptr);
      d_direct.fill(0x5a, nullptr);
      const Routed in{d_ids.get<int32_t>(), d_pos.get<int32_t>(), d_w.get<float>(),
                      d_slots.get<int32_t>()};
      forward_headers<<<T, detail::kWarpSize>>>(in, em, nm, fl, hb, d_fwd.get<char>(),
                                                d_direct.get<char>());
      EPCOMM_CUDA_OK(cudaGetLastError());
      EPCOMM_CUDA_OK(cudaDeviceSynchronize());
      std::vector<char> got_fwd(fwd_bytes), got_direct(direct_bytes);
      d_fwd.download(got_fwd.data(), fwd_bytes);
      d_direct.download(got_direct.data(), direct_bytes);
      for (size_t b = 0; b < fwd_bytes; ++b)
        ASSERT_EQ(got_fwd[b], want_fwd[b])
            << what << ": forwarded header byte " << b % size_t(fl.bytes()) << " of token "
            << b / size_t(fl.bytes()) / size_t(n_nodes) << ", node "
            << b / size_t(fl.bytes()) % size_t(n_nodes);
      for (size_t b = 0; b < direct_bytes; ++b)
        ASSERT_EQ(got_direct[b], want_direct[b])
            << what << ": rebuilt header byte " << b % size_t(hb) << " of (token, node, j) "
            << b / size_t(hb);
    }
  }
  EXPECT_GT(headers_checked, 6000) << "the routings reached too few destinations";
}

}  // namespace
}  // namespace epcomm
