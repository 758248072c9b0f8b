// GPU test support: device buffers, one rank's inputs and outputs (poisoned before every run),
// and the comparison of a rank's results with the CPU reference model. Used by the one-process
// GPU tests (all ranks in one process) and the multi-process tests (one rank per process).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/formats/reference_codecs.h"
#include "epcomm/group.h"
#include "epcomm/reference.h"

namespace epcomm {
namespace testing {

#define EPCOMM_CUDA_OK(call)                                                        \
  do {                                                                              \
    const cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess)                                                          \
      throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
  } while (0)

// Visible GPUs (0 when the CUDA runtime finds none or no driver).
int gpu_count();
// Skips the calling test, with the reason, when no GPU is visible. Multi-rank tests need no more
// than one: their ranks share the GPUs there are (placed()).
#define EPCOMM_REQUIRE_GPU()                                                      \
  do {                                                                            \
    if (::epcomm::testing::gpu_count() < 1) GTEST_SKIP() << "needs a GPU, found none"; \
  } while (0)

// Where the suite's ranks run: rank r of a group on GPU r % gpu_count().
int device_of_rank(int rank);
// Ranks per GPU of an n-rank group placed that way (1 when every rank has its own GPU).
int ranks_per_gpu(int n_ranks);
// The group's ranks for tests that use "as many as the machine has": every GPU, at least 4
// ranks (sharing GPUs where there are fewer), at most 8.
int suite_ranks();
// `cfg` for an n-rank group placed as device_of_rank() says: where ranks share a GPU,
// share_gpus is set and num_sms lowered (if needed) to max_resident_blocks / ranks_per_gpu, so
// every rank's blocks are resident together. Notes the running test as one that shares GPUs.
// ranks_per_node > 0: sets Config::ranks_per_node (declared nodes of that many ranks).
Config placed(Config cfg, int n_ranks, int ranks_per_node = 0);
// Tests of this process that ran with ranks sharing a GPU (placed() with ranks_per_gpu > 1).
int shared_gpu_tests();

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(int device, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  template <class T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  void upload(const void* src, size_t bytes, cudaStream_t s = nullptr);
  void download(void* dst, size_t bytes) const;
  // Poison: a memset on stream s, not waited for. Name the stream the buffer's next user runs
  // on (a rank's stream is non-blocking: not ordered after the legacy default stream, nullptr).
  void fill(int byte, cudaStream_t s);

 private:
  int device_ = 0;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// One rank's buffers, sized for the group's worst case (Group::sizes(), in the group's format).
struct RankIO {
  RankIO(const Group& g, uint64_t expert_seed = 99);
  ~RankIO();

  int rank, device;
  int32_t hidden, top_k, max_tokens;
  int64_t max_rows;  // sizes().max_recv_rows
  int32_t n_groups;
  TokenFormat format;        // config().format
  float nvfp4_global_scale;  // config().nvfp4_global_scale
  int64_t max_routed_rows;   // sizes().max_routed_rows
  int64_t token_bytes;       // sizes().token_bytes
  cudaStream_t stream = nullptr;
  DeviceBuffer tokens, topk, weights;                           // inputs
  // topk's element: 8 uploads the ids widened to int64 and gives them as
  // DispatchInput::topk_ids64; wide_ids then replaces the ids at these [T * K] indices (values
  // no int32 holds: bad-input tests).
  int32_t id_bytes = 4;
  std::vector<std::pair<size_t, int64_t>> wide_ids;
  DeviceBuffer out_tokens, row_offsets, expert_ids, src_info;   // dispatch outputs
  DeviceBuffer scales, scales_offsets;  // dispatch outputs of the quantised formats, else empty
  // Config::padded_capacity > 0: tokens and scales are in the padded layout, and dispatch also
  // writes these ([G], [G, C], [G, n_ranks]); else empty.
  int64_t padded_capacity = 0;
  int32_t n_ranks = 0;
  DeviceBuffer counts, slot_token, layout_range;
  DeviceBuffer expert_out;                                      // combine input
  // The same expert outputs in the padded per-expert layout, [G, expert_capacity, H], read by
  // combine in its place while expert_capacity > 0 (set_padded_expert_out).
  DeviceBuffer padded_expert_out;
  int64_t expert_capacity = 0;
  DeviceBuffer combine_out;                                     // [T, K, H] bf16 (fits [T, H])
  int32_t num_tokens = 0;
  std::vector<uint16_t> expert_out_host;  // what expert_out holds (rows of the reference)
  uint64_t expert_seed;
  // The columns combine brings back (CombineInput::hidden; RoundOptions::combine_hidden): the
  // expert outputs' and the combine output's row width. 0: hidden.
  int32_t combine_hidden = 0;
  int32_t combine_cols() const { return combine_hidden > 0 ? combine_hidden : hidden; }

  void upload(const reference::RankInput& in);
  // Every output byte 0xff: bf16 / e4m3 / e8m0 / fp32 NaN, src_info rank -1, row_offsets 2^32-1.
  void poison();
  DispatchInput dispatch_input(bool with_weights = false) const;  // weights: expert-side combine
  DispatchOutput dispatch_output() const;  // scales / scales_offsets null where the format has none
  CombineInput combine_input() const;
  CombineOutput combine_output(bool weighted) const;
  // Random expert outputs for `rows` rows (fresh per call), uploaded to expert_out.
  void make_expert_out(int64_t rows);
  // These expert outputs ([rows, H] bf16 bits), uploaded to expert_out.
  void set_expert_out(std::vector<uint16_t> rows);
  // Lays expert_out_host (rows of `ref`, the dispatch) out in the padded per-expert layout of
  // `capacity` slots a group (reference::pad_expert_rows), slots no row reaches poisoned, and
  // makes combine_input() read it there (CombineInput::expert_out_capacity); 0 goes back to
  // dispatch row order.
  void set_padded_expert_out(const reference::DispatchResult& ref, int64_t capacity);
  // bf16: downloads the dispatch outputs and compares them with the reference ("" = equal).
  std::string check_dispatch(const reference::DispatchResult& ref) const;
  // Quantised formats. The dispatch outputs as the reference holds them: row_offsets, expert_ids,
  // src_info of rows [0, min(row_offsets[G], max_rows)), and the whole codes and scales buffers
  // (shape = dispatch_output_shape for this group) and scales_offsets.
  reference::QuantDispatchResult download_dispatch_quantized() const;
  // Downloads the dispatch outputs and compares them with reference::dispatch_quantized by
  // reference::compare_dispatch_quantized, this rank's buffer sizes (Group::sizes()) included:
  // "" = equal, else the first mismatch.
  std::string check_dispatch_quantized(const reference::QuantDispatchResult& ref) const;
  // The padded layout (padded_capacity > 0): downloads every dispatch output and compares it
  // byte for byte with reference::dispatch_padded (the packed row_offsets, expert_ids and
  // src_info; the padded arrays, untouched slots included: poisoned outputs must stay 0xff).
  std::string check_dispatch_padded(const reference::PaddedDispatchResult& want) const;
  // Downloads the combine output and compares it: weighted -> bf16 tolerance, else exact.
  std::string check_combine(const std::vector<double>& ref, bool weighted) const;
  // With combine_hidden, that nothing was written past the narrower output ("" = nothing).
  std::string check_combine_tail(bool weighted) const;
  // Downloads the [T, H] combine output and compares it bit for bit with the expert-side
  // reduction's reference (reference::combine_expert_side).
  std::string check_combine_expert_side(const std::vector<float>& ref) const;
  // Raw downloads, for bit-identity checks (dispatch tokens: bf16).
  std::vector<uint16_t> download_dispatch_tokens(int64_t rows) const;
  std::vector<uint16_t> download_combine(bool weighted) const;
};

// A test configuration (bf16).
Config make_cfg(int hidden, int top_k, int n_experts, int max_tokens, int num_sms = 24,
                double timeout_seconds = 10.0);
// cfg on the given dispatch path.
inline Config with_path(Config cfg, DispatchPath path) {
  cfg.dispatch_path = path;
  return cfg;
}
// Both dispatch paths, for tests that run each.
constexpr DispatchPath kBothPaths[] = {DispatchPath::kThroughput, DispatchPath::kLowLatency};
// Random token counts in [0, max_tokens] for n ranks.
std::vector<int32_t> random_counts(int n, int max_tokens, uint64_t seed);

// The random expert outputs RankIO::make_expert_out gives rank `rank` for `seed`: any process
// can recompute every rank's.
std::vector<uint16_t> expert_outputs(int rank, uint64_t seed, int64_t rows, int32_t hidden);

// Expert outputs that are a function of (expert, token, column) alone: the row of group g of
// rank `rank`'s dispatch `d` holding source token t gets expert_value(expert, t, h), where the
// expert is rank * n_local + expert_ids[g] (the shared expert: kSharedExpertId, the same on
// every rank). A token held by every rank (skip_a2a) then has the same expert outputs wherever
// it is computed, and the layer's output follows from the routing alone (layer_output).
// Padding rows (src_info rank -1) get zeros: no token reads them. [rows, H] bf16 bits.
float expert_value(int32_t expert, int32_t token, int32_t column);
std::vector<uint16_t> function_expert_outputs(const reference::DispatchResult& d, int32_t rank,
                                              int32_t n_local, int32_t hidden);
// The whole layer's output of input `in` (one rank's tokens) in float64, from its routing:
// out[t] = sum over unmasked k of w[t,k] * expert_value(topk_ids[t,k], t, h), plus
// expert_value(kSharedExpertId, t, h) with the shared expert. [T, H].
std::vector<double> layer_output(const reference::RankInput& in, int32_t top_k, int32_t hidden,
                                 bool shared_expert);

// The reference's view of every rank's dispatch, and the combine reference of one rank.
std::vector<reference::DispatchResult> reference_dispatch_all(const reference::Problem& p);
// The same for a quantised group: reference::dispatch_quantized of every rank in cfg's format,
// with the group's max_routed_rows (so the scale arrays have the device outputs' shape).
std::vector<reference::QuantDispatchResult> reference_dispatch_quantized_all(
    const reference::Problem& p, const Config& cfg, const Sizes& sizes);
// The rows of a quantised dispatch as reference::combine reads them (row_offsets, expert_ids,
// src_info; no tokens): combine walks src_info row by row, and a padding row's rank -1 matches
// no rank, so padding rows contribute nothing while the expert outputs stay indexed by the
// quantised output's rows.
reference::DispatchResult combine_layout(const reference::QuantDispatchResult& q);

// A one-process group of n ranks with per-rank buffers, rank r on device_of_rank(r), the
// config placed() for them.
struct LocalGroup {
  LocalGroup(const Config& cfg, int n_ranks);
  // Rank r on devices[r], with cfg as given (no placement).
  LocalGroup(const Config& cfg, const std::vector<int>& devices);
  ~LocalGroup();
  std::vector<std::unique_ptr<Group>> groups;
  std::vector<std::unique_ptr<RankIO>> io;
  int n() const { return int(groups.size()); }
  // Issues f(rank) for every rank (each on its device), then synchronizes every rank and runs
  // check() on it. Never synchronizes before every rank's call was issued.
  void all(const std::function<void(int)>& f);
  void sync_all();
  // Uploads every rank's input of `p`, poisons its outputs and issues the fused dispatch on every
  // rank but `absent` (a rank that never calls: the failure tests), without synchronising: for
  // tests that then look at each rank's result or error.
  void issue_dispatch(const reference::Problem& p, int absent = -1);
};

enum class Form { kFused, kAsyncWait };

// One full round on a LocalGroup: upload a problem, poison, dispatch, check exactly (in the
// group's format: reference::dispatch for bf16, reference::dispatch_quantized otherwise), make
// expert outputs for every output row (padding rows included), combine (weighted and/or
// un-reduced), check. The problem is taken in the group's modes (Config::shared_expert,
// skip_a2a, allreduce_world_size). Returns "" or the first failure.
struct RoundOptions {
  Form form = Form::kFused;
  bool weighted = true;
  bool unreduced = false;
  bool busy_work_between = false;  // launch unrelated GPU work between async and wait
  bool poison = true;  // false: dispatch over whatever the previous round left in the outputs
  // The router weights go to dispatch and combine reduces on the expert side (checked bit for
  // bit); weighted / unreduced are then ignored.
  bool expert_side = false;
  // Expert outputs from function_expert_outputs (a function of expert and token) instead of
  // random rows, so that the layer's output follows from the routing alone.
  bool function_outputs = false;
  // If set, receives every rank's reduced [T, H] combine output of the round (bf16 bits).
  std::vector<std::vector<uint16_t>>* reduced_out = nullptr;
  // Combine reads the expert outputs in the padded per-expert layout (RankIO::
  // set_padded_expert_out) with n_ranks * max_tokens + this many slots a group; < 0: in dispatch
  // row order.
  int64_t padded_extra_slots = -1;
  // > 0: combine brings back only this many columns (CombineInput::hidden, fewer than the
  // dispatched rows'): expert outputs and the output are that wide.
  int32_t combine_hidden = 0;
  // The top-k ids go to dispatch as int64 (DispatchInput::topk_ids64), as torch.topk gives them.
  bool ids64 = false;
};
std::string run_round(LocalGroup& lg, const reference::Problem& p, const RoundOptions& o);
// A round in `form` that checks every combine of its dispatch: the expert side's (expert_side),
// or the token side's weighted and un-reduced ones.
inline RoundOptions every_combine(Form form, bool expert_side) {
  RoundOptions o;
  o.form = form;
  o.unreduced = true;
  o.expert_side = expert_side;
  return o;
}

}  // namespace testing
}  // namespace epcomm
