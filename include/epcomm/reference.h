// The CPU reference model of dispatch and combine: host code with the semantics and row order
// of the GPU path (docs/design.md "Dispatch", "Combine"). The GPU tests and the benchmark check against it.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/layout.h"
#include "epcomm/padded_layout.h"
#include "epcomm/routing_layout.h"
#include "epcomm/token_format.h"

namespace epcomm {
namespace reference {

// One rank's inputs: T tokens of H bf16 (bit patterns), topk_ids [T, K], router weights [T, K].
struct RankInput {
  int32_t num_tokens = 0;
  std::vector<uint16_t> tokens;
  std::vector<int32_t> topk_ids;
  std::vector<float> weights;
};

struct Problem {
  int32_t n_ranks = 0;
  int32_t hidden = 0;
  int32_t top_k = 0;
  int32_t n_experts = 0;
  std::vector<RankInput> ranks;  // n_ranks entries
  // Modes (docs/design.md "Modes"; Config's fields of the same names). With skip_a2a every rank's dispatch
  // reads only its own input (make_replicated_problem gives every rank the same one).
  bool shared_expert = false;
  bool skip_a2a = false;
  int32_t allreduce_world_size = 0;
  // The routing of rank `rank` (Config::route with these fields).
  RouteMap route(int32_t rank) const;
};

// Throws Error(kInvalidArgument) naming the first field of `p` that no group could run: the
// shape fields as Config::validate judges them (n_ranks, hidden, top_k, n_experts, the modes),
// ranks.size() != n_ranks, a negative num_tokens, or a rank's tokens / topk_ids / weights not
// num_tokens * hidden / top_k / top_k long. topk_ids values are not judged: a bad id is an input
// the model answers as the device does (validate_topk). Every function below that takes a
// Problem calls it first, and checks its own other arguments likewise.
void check_problem(const Problem& p);
// Rank `rank`'s input; throws Error(kInvalidArgument) naming `what` for a rank outside p.
const RankInput& rank_input(const Problem& p, int32_t rank, const char* what);
RankInput& rank_input(Problem& p, int32_t rank, const char* what);

// The first problem with a rank's topk_ids, as the device reports it.
struct TopkError {
  ErrorCode code = ErrorCode::kOk;  // kOk, kBadExpertId or kDuplicateExpert
  int32_t token = -1;
  int32_t slot = -1;
  int32_t value = 0;
};
// Duplicates are looked for among experts [dup_begin, dup_end) only (skip_a2a: a rank sees
// duplicates of its own experts); by default among all.
TopkError validate_topk(const int32_t* topk_ids, int32_t num_tokens, int32_t top_k,
                        int32_t n_experts, int32_t dup_begin = 0, int32_t dup_end = -1);

// What dispatch produces on one rank.
struct DispatchResult {
  std::vector<uint32_t> row_offsets;  // [G + 1]
  std::vector<int32_t> expert_ids;    // [G]
  std::vector<SrcInfo> src_info;      // [rows]
  std::vector<uint16_t> tokens;       // [rows, H]
  int64_t rows() const { return int64_t(src_info.size()); }
};

// Dispatch output of rank `rank`. A source whose topk_ids fail validate_topk sends nothing.
// With shared_expert, group 0 holds the rank's own share of its tokens (src_info slot = top_k)
// and expert_ids[0] = kSharedExpertId; with skip_a2a, the rank's own tokens only.
DispatchResult dispatch(const Problem& p, int32_t rank);

// Combine output of rank `rank` in float64, given every rank's dispatch result and expert
// outputs ([rows, H] bf16 bits, in that rank's dispatch row order).
//   weighted = true : [T, H], out[t] = sum over unmasked k of w[t,k] * y[t,k], k ascending,
//                     plus the shared expert's row of t (weight 1) where it has one
//   weighted = false: [T, K, H], masked slots zero
// With skip_a2a the sum is over this rank's experts only (the partial sum).
std::vector<double> combine(const Problem& p, const std::vector<DispatchResult>& layouts,
                            const std::vector<std::vector<uint16_t>>& expert_out, int32_t rank,
                            bool weighted);

// Combine of rank `rank` with the expert-side reduction (the dispatch carried the weights),
// exactly as the device computes it, in fp32 before the final bf16 rounding: per destination
// rank r ascending, p_r = bf16(fma chain over r's slots k ascending of w[t,k] * y[t,k], from 0),
// then out[t] = sum over r of p_r in fp32 from 0. [T, H].
// forward_ranks_per_node > 0: the order of a group of nodes of that many ranks that forwards
// inside the node (epcomm/forwarding.h; docs/multinode.md "Forwarding inside the node
// (design)"): the same p_r; the relay of each other node the token reaches sums that node's p_r
// in fp32 from 0, rank ascending, and rounds the sum to bf16, q_n; out[t] is the fp32 sum from
// 0, in rank order, of the p_r of the ranks of rank's own node and, at its node's place, the
// q_n of every other node. Bit-identical to the direct order (0) where every other node holds
// at most one of the token's destination ranks; elsewhere it may differ in the last bits.
std::vector<float> combine_expert_side(const Problem& p, const std::vector<DispatchResult>& layouts,
                                       const std::vector<std::vector<uint16_t>>& expert_out,
                                       int32_t rank, int32_t forward_ranks_per_node = 0);

// The ranks token t of rank `rank` is sent to (the owners of its experts), bit r for rank r;
// 0 under skip_a2a (no traffic between ranks). Ids outside [0, n_experts) count for nothing; a
// rank whose topk_ids the device refuses altogether (validate_topk) is the caller's to leave
// out. The shared expert's row stays on the rank and is not counted.
uint64_t destination_ranks(const Problem& p, int32_t rank, int32_t t);

// The byte model of a group that spans nodes (nodes of ranks_per_node consecutive ranks): what
// each rank puts through NVSHMEM, to ranks of other nodes, in one dispatch and the combine after
// it, on the direct path and when forwarding inside the node (epcomm/forwarding.h,
// docs/multinode.md "Forwarding inside the node (design)"). Counted from the routing, each put
// attributed to the rank that makes it:
//  - dispatch, direct: one message per (token, destination rank of another node), by the
//    token's rank; forwarded: one forwarded message per (token, other node it reaches), by the
//    token's rank, to that node's relay;
//  - meta records: one per (rank, rank of another node) on both paths (they stay direct);
//  - combine, expert side (weights given to dispatch): direct, one pre-summed row per (token,
//    destination rank of another node), by that destination; forwarded, one row per (token,
//    other node it reached), by that node's relay, after it summed the node's rows;
//  - combine, token side (weights given to combine, or none): one row per (token, top-k slot
//    whose expert is on another node), by the expert's rank, on both paths (without the weights
//    a relay has nothing to reduce).
// Masked slots, the shared expert's row and a rank whose topk_ids the device refuses
// (validate_topk) send nothing; skip_a2a moves nothing, meta records included. Signal words
// (chunk flags, arrival counters, acknowledgements) are not counted.
struct CrossNodeSizes {
  int64_t message = 0;          // a dispatch message's puts (detail::MessageLayout::put_bytes)
  int64_t forward_message = 0;  // a forwarded one (detail::forward_message_bytes)
  int64_t combine_row = 0;      // a combine row (detail::CombineRecvLayout::row_bytes())
  int64_t meta_record = 0;      // a meta record's put (detail::MetaLayout::payload_bytes())
  // A forward record's put (forwarding: the relay's count and chunk starts of one sender,
  // detail::RelayLayout::meta(), less its seq word like the meta record).
  int64_t forward_record = 0;
};
// The sizes of a group running `p` in `format` with max_tokens_per_rank = max_tokens, as the
// window lays them out (the modes' view: the shared expert's slot and group counted), on the
// low-latency dispatch path or the throughput path (Config::resolved_path).
CrossNodeSizes cross_node_sizes(const Problem& p, TokenFormat format, int32_t max_tokens,
                                int32_t ranks_per_node, bool low_latency);
struct CrossNodePuts {
  int64_t dispatch_messages = 0;
  int64_t meta_records = 0;
  int64_t forward_records = 0;  // forwarding: one per other node, to its relay, every call
  int64_t combine_rows_expert_side = 0;
  int64_t combine_rows_token_side = 0;
  int64_t dispatch_bytes = 0;  // messages, meta records and forward records
  int64_t combine_bytes_expert_side = 0;
  int64_t combine_bytes_token_side = 0;
};
struct CrossNodeTraffic {
  CrossNodePuts direct;
  CrossNodePuts forwarded;
  // Forwarding only, over NVLink: the messages this rank, as a relay, writes to the other ranks
  // of its node that own the tokens' experts; as many pre-summed rows come back to it in the
  // expert-side combine.
  int64_t relay_copies = 0;
};
// One entry per rank. Throws Error(kInvalidArgument) for ranks_per_node not dividing n_ranks.
std::vector<CrossNodeTraffic> cross_node_traffic(const Problem& p, int32_t ranks_per_node,
                                                 const CrossNodeSizes& sizes);

// What sender s forwards to one other node (docs/multinode.md, forwarding): its forwarded
// stream, one message per token that reaches the node, in token order, to the node's relay
// (ForwardPlan::relay); slot[t] is token t's message index in it (-1: the token does not reach
// the node), and chunk_start[c] the index of chunk c's first message (tokens of chunk c:
// [c * kChunkTokens, (c + 1) * kChunkTokens)), num_chunks(tokens) + 1 entries, the last the
// count: the forward record's fields (RelayLayout::meta()). The oracle of the sender's ranking
// by node.
struct ForwardStream {
  int32_t node = 0;
  int32_t relay = 0;
  std::vector<int32_t> slot;
  std::vector<int32_t> chunk_start;
  int32_t count() const { return chunk_start.empty() ? 0 : chunk_start.back(); }
};
// One entry per other node, nodes ascending (ForwardPlan::relayed_index order at the relay):
// what sender s's forwarded streams hold for p. A rank whose topk_ids the device refuses, and
// skip_a2a, forward nothing (empty streams: every slot -1). Throws Error(kInvalidArgument) for
// ranks_per_node not dividing n_ranks or s out of range.
std::vector<ForwardStream> forward_streams(const Problem& p, int32_t s, int32_t ranks_per_node);

// Routing generators (docs/results/method.md): for each token, K distinct experts, the top-K of |randn| + 1
// scores (uniform popularity), or with expert e's score scaled by a Zipf(s) popularity when
// zipf_s > 0. mask_prob masks each slot independently (-1).
std::vector<int32_t> make_topk(int32_t num_tokens, int32_t top_k, int32_t n_experts,
                               std::mt19937_64& rng, double zipf_s = 0.0,
                               double mask_prob = 0.0);
// Random bf16 values, never zero: |x| in [0.5, 2) * scale with a random sign.
std::vector<uint16_t> make_tokens(int64_t count, std::mt19937_64& rng, float scale = 1.0f);
// Random router weights in (0, 1].
std::vector<float> make_weights(int64_t count, std::mt19937_64& rng);

// Builds a random problem: rank r gets num_tokens[r] tokens (same seed -> same problem).
Problem make_problem(int32_t n_ranks, int32_t hidden, int32_t top_k, int32_t n_experts,
                     const std::vector<int32_t>& num_tokens, uint64_t seed, double zipf_s = 0.0,
                     double mask_prob = 0.0);
// The same, with every rank holding rank 0's input (num_tokens tokens): skip_a2a's inputs.
Problem make_replicated_problem(int32_t n_ranks, int32_t hidden, int32_t top_k, int32_t n_experts,
                                int32_t num_tokens, uint64_t seed, double zipf_s = 0.0,
                                double mask_prob = 0.0);

// Comparison helpers returning an empty string on success, else a description of the first
// mismatch (used by the tests and the benchmark).
std::string compare_dispatch(const DispatchResult& ref, const uint32_t* row_offsets,
                             const int32_t* expert_ids, const SrcInfo* src_info,
                             const uint16_t* tokens, int32_t hidden);
// Weighted combine in bf16: every element within 2^-8 |ref| (half a bf16 ulp) plus 2^-20 max|ref|
// (fp32 accumulation under cancellation) of the float64 reference, and ||out-ref||/||ref|| <= 2^-8.
std::string compare_combine_bf16(const std::vector<double>& ref, const uint16_t* out,
                                 int64_t count);
// fp32 values (an epilogue's input): ||out - ref|| / ||ref|| <= rel_tol.
std::string compare_combine_f32(const std::vector<double>& ref, const float* out, int64_t count,
                                double rel_tol = 1e-5);
// The expert-side combine in bf16: bit-exact against combine_expert_side rounded to bf16.
std::string compare_combine_expert_side(const std::vector<float>& ref, const uint16_t* out,
                                        int64_t count);
// Un-reduced combine: bit-exact.
std::string compare_exact_bf16(const std::vector<double>& ref, const uint16_t* out,
                               int64_t count);

// pad_expert_rows and unpad_expert_rows (epcomm/padded_layout.h) on host memory: the same
// arguments with host pointers, the same checks (Error(kInvalidArgument) before writing
// anything), and every byte the kernels write written alike; what they leave, left.
void pad_expert_rows(const PadExpertRows& a);
void unpad_expert_rows(const UnpadExpertRows& a);

// routing_layout (epcomm/routing_layout.h) on host memory: the same arguments, checks and
// outputs (the counts written outright).
void routing_layout(const RoutingLayout& a);
// received_topk (epcomm/routing_layout.h) on host memory (num_rows a host word too).
void received_topk(const ReceivedTopk& a);

// What a group with Config::padded_capacity = capacity writes on `rank` (the padded per-expert
// layout; bf16 or blockwise FP8): the packed rows with no format padding (`meta`: row_offsets,
// expert_ids, src_info of reference::dispatch; no tokens), and the data laid out by
// pad_expert_rows from the packed reference (bf16 rows, or dispatch_quantized's codes and
// scales, whose padding rows it skips) on arrays that start filled with `untouched`, so slots
// no row reaches keep it. Throws Error(kInvalidArgument) for another format, a capacity below a
// group's rows, or ue8m0 without fp8_pow2 and H % 512 == 0.
struct PaddedDispatchResult {
  DispatchResult meta;
  std::vector<uint8_t> codes;         // [G, C, row bytes]
  std::vector<uint32_t> scales;       // FP8: [G, H/128, C] fp32 bits, or UE8M0 [G, H/512, C]
  std::vector<int32_t> counts;        // [G]
  std::vector<int32_t> slot_token;    // [G, C]
  std::vector<int64_t> layout_range;  // [G, n_ranks]
};
PaddedDispatchResult dispatch_padded(const Problem& p, int32_t rank, TokenFormat format,
                                     int64_t capacity, bool fp8_pow2, bool ue8m0,
                                     int64_t max_routed_rows, uint8_t untouched = 0xff);

}  // namespace reference
}  // namespace epcomm
