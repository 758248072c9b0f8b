// routing_layout (epcomm/routing_layout.h).
//
// One thread a token, in a grid-stride loop: it reads the token's top-k ids once, counts each
// valid slot for its expert, and builds the set of ranks the token goes to as a 64-bit mask (in
// blocks of 64 ranks for larger groups), which it writes as the token's token_in_rank and
// rank_ids rows and counts once per rank. Counts gather in shared memory and go out once a
// block. A call of up to kThreads * kTokensPerThread tokens runs as one block, which writes the
// counts outright (no clearing launch before it); a larger one clears them on the stream and its
// blocks add theirs in.
#include <algorithm>
#include <string>
#include <type_traits>

#include "epcomm/detail/device.cuh"
#include "epcomm/detail/launch.h"
#include "epcomm/routing_layout.h"

namespace epcomm {
namespace detail {
namespace {

constexpr int kThreads = 1024;
constexpr int64_t kTokensPerThread = 8;
constexpr int32_t kMaskRanks = 64;

// Id: the top-k ids' type; bool: the routing is a.rank_mask.
template <class Id>
__global__ void __launch_bounds__(kThreads) routing_layout_kernel(RoutingLayout a) {
  extern __shared__ int32_t hist[];  // [num_experts] experts, then [n_ranks] ranks
  const int32_t E = a.num_experts, R = a.n_ranks, per_rank = E / R;
  int32_t* experts = hist;
  int32_t* ranks = hist + E;
  for (int32_t i = threadIdx.x; i < E + R; i += kThreads)
    hist[i] = 0;
  __syncthreads();
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < a.num_tokens;
       t += int64_t(gridDim.x) * kThreads) {
    for (int32_t base = 0; base < R; base += kMaskRanks) {
      uint64_t mask = 0;
      const int32_t n = min(kMaskRanks, R - base);
      if constexpr (std::is_same<Id, bool>::value) {
        // As bytes: a mask from a 1-byte type other than bool may hold values past 1.
        const uint8_t* in = reinterpret_cast<const uint8_t*>(a.rank_mask) + t * R + base;
        for (int32_t j = 0; j < n; ++j)
          if (in[j] != 0) mask |= uint64_t(1) << j;
      } else {
        const Id* row = static_cast<const Id*>(a.topk_ids) + t * a.ids_stride;
        for (int32_t k = 0; k < a.top_k; ++k) {
          const int64_t e = int64_t(row[k]);
          if (e < 0 || e >= E) continue;  // a masked slot
          if (base == 0) atomicAdd(&experts[e], 1);
          const int32_t r = int32_t(e / per_rank) - base;
          if (r >= 0 && r < kMaskRanks) mask |= uint64_t(1) << r;
        }
      }
      for (int32_t j = 0; j < n; ++j) {
        const bool in = ((mask >> j) & 1u) != 0;
        const int64_t at = t * R + base + j;
        if (a.token_in_rank != nullptr) a.token_in_rank[at] = in;
        if (a.rank_ids != nullptr) a.rank_ids[at] = in ? base + j : -1;
        if (in) atomicAdd(&ranks[base + j], 1);
      }
    }
  }
  __syncthreads();
  const bool one_block = gridDim.x == 1;  // else the counts were cleared before the launch
  for (int32_t i = threadIdx.x; i < E + R; i += kThreads) {
    int32_t* out = i < E ? a.tokens_per_expert : a.tokens_per_rank;
    if (out == nullptr) continue;
    const int32_t j = i < E ? i : i - E;
    if (one_block)
      out[j] = hist[i];
    else if (hist[i] != 0)
      atomicAdd(&out[j], hist[i]);
  }
}

// received_topk: one thread a (row, slot), in a grid-stride loop; the kept slots counted per local
// expert in shared memory, then once a block (outright with one block, else added into counts
// cleared on the stream).
constexpr int kTopkThreads = 512;
constexpr int64_t kSlotsPerThread = 8;

__global__ void __launch_bounds__(kTopkThreads) received_topk_kernel(ReceivedTopk a) {
  extern __shared__ int32_t local[];  // [n_local]
  for (int32_t i = threadIdx.x; i < a.n_local; i += kTopkThreads)
    local[i] = 0;
  __syncthreads();
  const int64_t rows = min(int64_t(*a.num_rows), a.max_rows);
  const int64_t slots = a.max_rows * a.top_k;
  for (int64_t s = int64_t(blockIdx.x) * kTopkThreads + threadIdx.x; s < slots;
       s += int64_t(gridDim.x) * kTopkThreads) {
    const int64_t i = s / a.top_k;
    const int64_t k = s - i * a.top_k;
    int64_t id = -1;
    float w = 0.f;
    if (i < rows) {
      const int64_t e = *reinterpret_cast<const int64_t*>(reinterpret_cast<const char*>(a.ids) +
                                                          i * a.row_bytes + k * 8);
      if (e >= a.first_expert && e - a.first_expert < a.n_local) {  // no overflow either way
        id = e - a.first_expert;
        w = *reinterpret_cast<const float*>(reinterpret_cast<const char*>(a.weights) +
                                            i * a.row_bytes + k * 4);
        atomicAdd(&local[id], 1);
      }
    }
    a.local_ids[s] = id;
    a.local_weights[s] = w;
  }
  __syncthreads();
  const bool one_block = gridDim.x == 1;
  for (int32_t e = threadIdx.x; e < a.n_local; e += kTopkThreads) {
    if (one_block)
      a.counts[1 + e] = local[e];
    else if (local[e] != 0)
      atomicAdd(&a.counts[1 + e], local[e]);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) a.counts[0] = int32_t(rows);
}

// Blocks for `items` at `per_block` a block: as many as are needed, at most one an SM (the
// launches here are small; past one block their counts are added into, cleared first).
int64_t blocks_for(int64_t items, int64_t per_block) {
  return std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block,
                                                detail::device_sms()));
}

size_t hist_bytes(const RoutingLayout& a) {
  return size_t(a.num_experts + a.n_ranks) * sizeof(int32_t);
}

}  // namespace
}  // namespace detail

void check_routing_layout(const RoutingLayout& a) {
  using namespace detail;
  const char* op = "routing_layout";
  if (a.id_bytes != 4 && a.id_bytes != 8)
    invalid(op, "id_bytes = " + std::to_string(a.id_bytes) + " (4 for int32 ids, 8 for int64)");
  if (a.num_tokens < 0 || a.num_tokens >= (int64_t(1) << 31))
    invalid(op, "num_tokens = " + std::to_string(a.num_tokens) + " is outside [0, 2^31)");
  if (a.top_k < 0 || a.top_k > kRoutingMaxTopK)
    invalid(op, "top_k = " + std::to_string(a.top_k) + " is outside [0, " +
                    std::to_string(kRoutingMaxTopK) + "]");
  if (a.num_tokens * a.top_k >= (int64_t(1) << 31))
    invalid(op, "num_tokens * top_k = " + std::to_string(a.num_tokens * a.top_k) +
                    " slots: the int32 counts could overflow");
  if (a.ids_stride < a.top_k)
    invalid(op, "ids_stride = " + std::to_string(a.ids_stride) +
                    " is less than top_k = " + std::to_string(a.top_k));
  if (a.n_ranks < 1 || a.num_experts < 1 || a.num_experts % a.n_ranks != 0)
    invalid(op, "num_experts = " + std::to_string(a.num_experts) +
                    " must be a positive multiple of n_ranks = " + std::to_string(a.n_ranks));
  // The counts gather in one block's shared memory (48 KB without opting in).
  if (int64_t(a.num_experts) + a.n_ranks > kRoutingMaxCounters)
    invalid(op, "num_experts + n_ranks = " + std::to_string(int64_t(a.num_experts) + a.n_ranks) +
                    " is more than " + std::to_string(kRoutingMaxCounters));
  if (a.rank_mask != nullptr) {
    if (a.topk_ids != nullptr || a.top_k != 0)
      invalid(op, "rank_mask is given with topk_ids or top_k = " + std::to_string(a.top_k) +
                      " (one routing: with a mask, topk_ids is null and top_k 0)");
    if (a.num_experts != a.n_ranks)
      invalid(op, "num_experts = " + std::to_string(a.num_experts) +
                      " with rank_mask: the ranks are the experts (n_ranks = " +
                      std::to_string(a.n_ranks) + ")");
    if (a.tokens_per_expert != nullptr || a.token_in_rank != nullptr)
      invalid(op, "with rank_mask only tokens_per_rank and rank_ids are written");
    if (a.num_tokens > 0) check_pointer(op, "rank_mask", a.rank_mask, 1);
  } else if (a.num_tokens > 0 && a.top_k > 0) {
    check_pointer(op, "topk_ids", a.topk_ids, size_t(a.id_bytes));
  }
  if (a.tokens_per_rank == nullptr && a.tokens_per_expert == nullptr &&
      a.token_in_rank == nullptr && a.rank_ids == nullptr)
    invalid(op, "no output given");
  if (a.tokens_per_rank != nullptr) check_pointer(op, "tokens_per_rank", a.tokens_per_rank, 4);
  if (a.tokens_per_expert != nullptr)
    check_pointer(op, "tokens_per_expert", a.tokens_per_expert, 4);
  if (a.rank_ids != nullptr) check_pointer(op, "rank_ids", a.rank_ids, 4);
}

void routing_layout(const RoutingLayout& a, cudaStream_t stream) {
  using namespace detail;
  const char* op = "routing_layout";
  check_routing_layout(a);
  const int64_t blocks = blocks_for(a.num_tokens, kThreads * kTokensPerThread);
  if (blocks > 1) {
    if (a.tokens_per_rank != nullptr)
      check_cuda(cudaMemsetAsync(a.tokens_per_rank, 0, size_t(a.n_ranks) * 4, stream),
                 "cudaMemsetAsync");
    if (a.tokens_per_expert != nullptr)
      check_cuda(cudaMemsetAsync(a.tokens_per_expert, 0, size_t(a.num_experts) * 4, stream),
                 "cudaMemsetAsync");
  }
  const size_t smem = hist_bytes(a);
  if (a.rank_mask != nullptr)
    routing_layout_kernel<bool><<<unsigned(blocks), kThreads, smem, stream>>>(a);
  else if (a.id_bytes == 8)
    routing_layout_kernel<int64_t><<<unsigned(blocks), kThreads, smem, stream>>>(a);
  else
    routing_layout_kernel<int32_t><<<unsigned(blocks), kThreads, smem, stream>>>(a);
  check_cuda(cudaGetLastError(), op);
}

void check_received_topk(const ReceivedTopk& a) {
  using namespace detail;
  const char* op = "received_topk";
  if (a.top_k < 0 || a.top_k > kRoutingMaxTopK)
    invalid(op, "top_k = " + std::to_string(a.top_k) + " is outside [0, " +
                    std::to_string(kRoutingMaxTopK) + "]");
  if (a.max_rows < 0 || a.max_rows >= (int64_t(1) << 31) ||
      a.max_rows * a.top_k >= (int64_t(1) << 31))
    invalid(op, "max_rows = " + std::to_string(a.max_rows) +
                    " with top_k = " + std::to_string(a.top_k) + ": outside [0, 2^31) slots");
  if (a.row_bytes % 8 != 0 || a.row_bytes < int64_t(8) * a.top_k ||
      a.row_bytes >= (int64_t(1) << 32))
    invalid(op, "row_bytes = " + std::to_string(a.row_bytes) +
                    " must be a multiple of 8 below 2^32 and hold top_k = " +
                    std::to_string(a.top_k) + " int64 ids");
  if (a.n_local < 1 || a.n_local > kRoutingMaxCounters)  // counts in 48 KB of shared memory
    invalid(op, "n_local = " + std::to_string(a.n_local) + " is outside [1, " +
                    std::to_string(kRoutingMaxCounters) + "]");
  if (a.first_expert < 0)
    invalid(op, "first_expert = " + std::to_string(a.first_expert) + " is negative");
  check_pointer(op, "num_rows", a.num_rows, 4);
  check_pointer(op, "counts", a.counts, 4);
  if (a.max_rows * a.top_k > 0) {
    check_pointer(op, "ids", a.ids, 8);
    check_pointer(op, "weights", a.weights, 4);
    check_pointer(op, "local_ids", a.local_ids, 8);
    check_pointer(op, "local_weights", a.local_weights, 4);
  }
}

void received_topk(const ReceivedTopk& a, cudaStream_t stream) {
  using namespace detail;
  check_received_topk(a);
  const int64_t blocks = blocks_for(a.max_rows * a.top_k, kTopkThreads * kSlotsPerThread);
  if (blocks > 1)
    check_cuda(cudaMemsetAsync(a.counts, 0, size_t(1 + a.n_local) * 4, stream), "cudaMemsetAsync");
  received_topk_kernel<<<unsigned(blocks), kTopkThreads, size_t(a.n_local) * 4, stream>>>(a);
  check_cuda(cudaGetLastError(), "received_topk");
}

}  // namespace epcomm
