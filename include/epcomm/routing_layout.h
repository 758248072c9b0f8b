// The routing layout of a call's top-k ids: how many tokens go to each rank and to each expert,
// and which ranks each token goes to. It is what a caller needs before a dispatch that sends one
// row per (token, rank) (DeepEP's normal mode and its get_dispatch_layout), and what a scheduler
// reads to size buffers; one launch on the caller's stream, no host synchronisation.
//
// Experts are spread over ranks in contiguous blocks: expert e lives on rank
// e / (num_experts / n_ranks). A slot whose id is outside [0, num_experts) (-1 masks a slot) goes
// nowhere. A token goes to rank r if any of its slots names an expert of r; it counts once per
// rank however many of its experts live there, and once per expert slot for tokens_per_expert.
//
// Arguments are device pointers; every output is optional (null: not written) but at least one is
// given. topk_ids is int32 or int64 (id_bytes 4 or 8), [num_tokens, top_k] with row stride
// ids_stride elements (top_k for a contiguous array). Outputs are written in full: the counts are
// zeroed on the stream first, so the outputs need no clearing by the caller. Bad arguments throw
// Error(kInvalidArgument) before anything is launched; a failed launch throws Error(kCuda).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace epcomm {

struct RoutingLayout {
  const void* topk_ids = nullptr;  // [num_tokens, top_k], row stride ids_stride elements
  int32_t id_bytes = 8;            // 4 (int32) or 8 (int64)
  int64_t ids_stride = 0;          // elements between rows (>= top_k)
  int64_t num_tokens = 0;
  int32_t top_k = 0;
  int32_t num_experts = 0;  // a positive multiple of n_ranks
  int32_t n_ranks = 0;
  // Outputs.
  int32_t* tokens_per_rank = nullptr;    // [n_ranks]: tokens with an expert on each rank
  int32_t* tokens_per_expert = nullptr;  // [num_experts]: slots naming each expert
  bool* token_in_rank = nullptr;         // [num_tokens, n_ranks]: true where the token goes
  int32_t* rank_ids = nullptr;  // [num_tokens, n_ranks]: r at (t, r) where token t goes to rank
                                // r, else -1 (the top-k ids of a dispatch over ranks)
};

void routing_layout(const RoutingLayout& a, cudaStream_t stream);
// Its checks (what routing_layout throws before launching); the CPU reference shares them.
void check_routing_layout(const RoutingLayout& a);

}  // namespace epcomm
