// epcomm::Group: one rank's handle on an expert-parallel group. It owns every communication
// buffer and exposes dispatch and combine in three forms each (fused, async + wait).
//
// Every operation is collective (every rank calls it, in the same order), stream-ordered, and
// free of host synchronisation, so a dispatch + combine can be captured in a CUDA graph and
// replayed. Only one operation of a group may be in flight at a time: issue them on one stream
// (or order the streams).
//
// Two sets of dispatch kernels give the same outputs bit for bit (Config::dispatch_path): the
// throughput path for prefill, and the low-latency path for decode (up to kLowLatencyMaxTokens
// tokens per rank, taken by default there), which has no grid-wide barrier and announces each
// 1024-value piece of a message with its own sequence-numbered flag. Combine is the same for
// both. Give the low-latency path many SMs (Config::num_sms).
//
// Errors. Host-side checks (shapes, pointers, alignment) throw epcomm::Error before anything is
// launched. Errors only the device can see (expert id out of range, duplicate expert in a token,
// a peer that does not arrive within Config::timeout_seconds) are written by the kernel to an
// error record in host-mapped memory; the host learns of them from check() or synchronize(), and
// every later call checks the record before it launches. A device-detected bad input sends no
// token from the offending rank, corrupts nothing, and the group stays usable. Every rank
// checks what its sources announce. Routing that gives any rank more rows than the receive
// capacity (Config::max_routed_rows) is kRecvCapacity on every rank, naming the ranks that
// would overflow and the cap: every source tells every rank how many rows it routes to each
// rank, so all judge alike, and no rank writes a row (row_offsets all 0); with skip_a2a (no
// traffic between ranks) only the rank that would overflow reports it. A count or offset out
// of range is kBadPeerData, naming the source; that rank writes no row, and the other ranks'
// combine results for tokens routed there lack its experts, so treat the call as failed on
// every rank. Either way the call completes on every rank and the group stays usable. A
// timeout leaves
// the ranks out of step: the group is poisoned, every later call throws kPoisoned, and it must
// be destroyed and set up again.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "epcomm/bootstrap.h"
#include "epcomm/config.h"
#include "epcomm/error.h"
#include "epcomm/layout.h"
#include "epcomm/tensors.h"
#include "epcomm/trace.h"

namespace epcomm {

// Inputs of dispatch on this rank. All device pointers, 16-byte aligned.
//
// Router weights are given once, to dispatch or to combine (docs/design.md "Combine"):
//   to dispatch (weights here): each message carries its slots' weights; combine then reduces on
//     the expert side: a rank sums w * y over its own experts of a token (fp32, top-k slot
//     ascending), rounds that to bf16 and sends one row per (token, rank) back instead of one
//     per (token, k) — up to K / (distinct ranks) fewer bytes on the wire; the token side adds
//     the rows in fp32, rank ascending. CombineOutput::weights must then be null.
//   to combine (CombineOutput::weights): every (token, k) row crosses back and the token side
//     sums w * y in fp32, top-k slot ascending.
//   to neither: combine gives the un-reduced [T, K, H].
// Both reductions are deterministic; they round differently (the expert side rounds each
// rank's partial sum to bf16), so their results may differ in the last bits.
struct DispatchInput {
  const void* tokens = nullptr;       // [T, H] bf16; must not overlap the output's tokens or
                                      // scales (refused: the kernel reads it while writing them)
  const int32_t* topk_ids = nullptr;  // [T, K] global expert ids, -1 = masked slot
  int32_t num_tokens = 0;             // T, 0 <= T <= max_tokens_per_rank
  int32_t hidden = 0;                 // must equal Config::hidden
  const float* weights = nullptr;     // [T, K] router weights for the expert-side reduction, or null
  // The same ids as int64 (torch.topk's indices, DeepEP's topk_idx), instead of topk_ids: read
  // as they are, with no conversion launch. Give one of the two. An int64 id outside int32 is a
  // bad id (kBadExpertId shows it clamped to int32's range).
  const int64_t* topk_ids64 = nullptr;
};

// Outputs of dispatch on this rank. Device pointers; each tensor's dtype, shape and strides for
// this format: dispatch_output_descs(config(), sizes()) (epcomm/tensors.h describes them once).
//
// Rows are expert-major: group g is rows [row_offsets[g], row_offsets[g + 1]), and within a group
// by source rank, then source token. The quantised formats (Config::format, docs/design.md "Token
// formats"):
//   kFp8Blockwise: every group's row count is padded to a multiple of 4 and row_offsets include
//     the padding. A padding row has src_info {-1, -1, -1}, zero codes and zero scales.
//   kNvfp4, kMxfp8: scales in the 128x4 swizzled layout, every group starting a fresh 128-row
//     tile; every byte is written on every call, zero where no row's scale lands.
//     scales_offsets[g] = tile_start[g] - row_offsets[g] / 128.
// Codes and scales are those of reference::dispatch_quantized, bit for bit.
// With Config::padded_capacity = C > 0 (bf16, blockwise FP8) no group has padding rows, and the
// codes and scales go to the padded per-expert layout (DispatchOutputLayout): row
// row_offsets[g] + j at slot (g, j) of tokens [G, C, row] and scales [G, H / 128, C] (or the
// UE8M0 words [G, H / 512, C], Config::fp8_ue8m0_scales); counts[g] = its rows. row_offsets,
// expert_ids and src_info stay packed, for combine. Slots at or past counts[g] keep what they
// held (DeepEP's low-latency contract): a consumer reads [0, counts[g]) of each group.
struct DispatchOutput {
  void* tokens = nullptr;              // the codes, expert-major
  uint32_t* row_offsets = nullptr;
  int32_t* expert_ids = nullptr;
  SrcInfo* src_info = nullptr;
  void* scales = nullptr;              // quantised formats; 16-byte aligned
  uint32_t* scales_offsets = nullptr;  // NVFP4, MXFP8
  // Config::padded_capacity > 0 (the padded per-expert layout; null otherwise):
  int32_t* counts = nullptr;        // [G]: rows of each group (required)
  int32_t* slot_token = nullptr;    // [G, C] (optional): each used slot's source token
  int64_t* layout_range = nullptr;  // [G, n_ranks] (optional): (first slot << 32) | rows from
                                    // each caller rank, 0 where it sent none
};

// Inputs of combine on the expert side: the expert outputs, in dispatch row order or in the
// padded per-expert layout, and the dispatch outputs that describe those rows.
struct CombineInput {
  const void* expert_out = nullptr;        // expert_out_desc(); rows past row_offsets[G] unread
  const uint32_t* row_offsets = nullptr;   // from dispatch
  const SrcInfo* src_info = nullptr;       // from dispatch
  // The columns combined: Config::hidden, or fewer (a multiple of 8): expert_out's rows and
  // the output then hold `hidden` columns, e.g. when the dispatched rows carried data of the
  // caller's after the values the experts transform (the DeepEP layer's top-k ids and weights).
  int32_t hidden = 0;
  // 0: expert_out is [max_recv_rows, H] in dispatch row order. > 0: expert_out is the padded
  // per-expert layout [G, capacity, H] (epcomm/padded_layout.h; what a masked grouped GEMM
  // writes): row i of group g is read at slot (g, i - row_offsets[g]), and no unpad copy is
  // needed. At least n_ranks * max_tokens_per_rank (max_tokens_per_rank with skip_a2a), the
  // most rows a group can receive; slots a group's rows do not reach are not read.
  int64_t expert_out_capacity = 0;
};

// Outputs of combine on the token side, for the T tokens of the last dispatch.
struct CombineOutput {
  // Reduced (weights here or at dispatch) or not: combine_output_desc(config, T, reduced).
  void* out = nullptr;
  const float* weights = nullptr;  // [T, K] router weights (token-side reduction), or null
};

// The last completed dispatch of a group, which combine reduces for: its token count T (-1
// before any dispatch) and whether it carried router weights (combine then reduces on the
// expert side and takes no weights).
struct DispatchRecord {
  int32_t num_tokens = -1;
  bool weights = false;
};

namespace detail {
struct GroupState;
struct EpilogueAccess;
}  // namespace detail

class Group {
 public:
  // One process per GPU: every rank calls create() with its bootstrap endpoint and its device.
  static std::unique_ptr<Group> create(const Config& cfg, Bootstrap& bootstrap, int device);
  // One process, all GPUs: rank r drives devices[r] (default: every visible device).
  static std::vector<std::unique_ptr<Group>> create_local(const Config& cfg,
                                                          std::vector<int> devices = {});
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const;
  int n_ranks() const;
  int device() const;
  const Config& config() const;
  const Sizes& sizes() const;

  void dispatch(const DispatchInput& in, const DispatchOutput& out, cudaStream_t stream);
  void dispatch_async(const DispatchInput& in, cudaStream_t stream);
  void dispatch_wait(const DispatchOutput& out, cudaStream_t stream);

  void combine(const CombineInput& in, const CombineOutput& out, cudaStream_t stream);
  void combine_async(const CombineInput& in, cudaStream_t stream);
  void combine_wait(const CombineOutput& out, cudaStream_t stream);

  // Throws the device-reported error recorded since the last check, if any, and clears it
  // (a timeout is not cleared: the group stays poisoned). The record holds one error: where a
  // wait of the same rank timed out after the reported error, the message says so and the group
  // is poisoned as by a recorded timeout.
  void check();
  // cudaStreamSynchronize(stream), then check().
  void synchronize(cudaStream_t stream);
  bool poisoned() const;
  // The last completed dispatch (a dispatch_async counts once its dispatch_wait is issued).
  DispatchRecord last_dispatch() const;
  // The columns (CombineInput::hidden) of the combine_async awaiting its combine_wait, whose
  // output has that many; 0 where none is pending.
  int32_t pending_combine_columns() const;

  // The stage marks of this rank's last dispatch and last combine (Config::trace must be set;
  // throws kInvalidArgument otherwise). Synchronises the device.
  StageTrace stage_trace() const;

  // Bytes this rank has put through NVSHMEM to ranks of other nodes since set-up: dispatch
  // messages, meta records and combine rows, not the 8-byte signal words. 0 in a group within
  // one node (and in a build without NVSHMEM). Synchronises the device.
  uint64_t network_bytes_put() const;

 private:
  // The header-only combine with a custom epilogue (epcomm/combine_epilogue.cuh).
  friend struct detail::EpilogueAccess;
  explicit Group(std::unique_ptr<detail::GroupState> state);
  std::unique_ptr<detail::GroupState> s_;
};

}  // namespace epcomm
