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
// ids_stride elements (top_k for a contiguous array). A routing already over ranks may be given as
// a mask instead (rank_mask [num_tokens, n_ranks] bool, contiguous, topk_ids null, top_k 0,
// num_experts = n_ranks): then only tokens_per_rank and rank_ids are written (DeepEP's dispatch
// takes is_token_in_rank, and its rows go to ranks as experts). A mask byte other than 0 counts
// as true. With no tokens the mask may be null (an empty array's address): the call then reads as
// top_k 0 and writes the same zero counts. Outputs are written in full: the
// counts are zeroed on the stream first, so the outputs need no clearing by the caller. Bad
// arguments throw Error(kInvalidArgument) before anything is launched; a failed launch throws
// Error(kCuda).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace epcomm {

// The bounds every routing launch checks: top-k columns, and the int32 counters one block
// gathers in shared memory (48 KB without opting in): num_experts + n_ranks for routing_layout,
// n_local for received_topk.
constexpr int32_t kRoutingMaxTopK = 1024;
constexpr int32_t kRoutingMaxCounters = 12288;

struct RoutingLayout {
  const void* topk_ids = nullptr;  // [num_tokens, top_k], row stride ids_stride elements
  const bool* rank_mask = nullptr;  // or [num_tokens, n_ranks]: the ranks each token goes to
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

// The receiving side of a dispatch over ranks (one row per (token, rank), DeepEP's normal mode),
// where each row carries its token's global top-k ids (int64) and weights (fp32) beside the data:
// the slots naming this rank's experts as local ids, their weights, and how many slots each local
// expert has, in one launch, so a caller learns the received rows and the per-expert counts with
// one copy to the host. ids and weights are [max_rows, top_k] with row stride row_bytes (both in
// the received rows, 8- and 4-byte aligned); only the first *num_rows rows are read (num_rows
// is a device word, the dispatch's row count; a count past max_rows reads max_rows). Every row of
// the outputs is written: row i slot k holds ids - first_expert where that is in [0, n_local)
// and i < *num_rows, else -1 (an id of another rank's expert, a masked or bad id, or a row not
// received), and the weight there, else 0. counts[0] = the rows read, counts[1 + e] = the kept
// slots of local expert e. Bad arguments throw Error(kInvalidArgument) before anything is
// launched.
struct ReceivedTopk {
  const int64_t* ids = nullptr;    // [max_rows, top_k], row stride row_bytes
  const float* weights = nullptr;  // [max_rows, top_k], row stride row_bytes
  int64_t row_bytes = 0;           // bytes between rows (a multiple of 8)
  int64_t max_rows = 0;
  const uint32_t* num_rows = nullptr;  // device: the rows received
  int32_t top_k = 0;
  int64_t first_expert = 0;  // this rank's first expert (global id)
  int32_t n_local = 0;       // its experts
  // Outputs.
  int64_t* local_ids = nullptr;    // [max_rows, top_k], contiguous
  float* local_weights = nullptr;  // [max_rows, top_k], contiguous
  int32_t* counts = nullptr;       // [1 + n_local]
};

void received_topk(const ReceivedTopk& a, cudaStream_t stream);
void check_received_topk(const ReceivedTopk& a);

}  // namespace epcomm
