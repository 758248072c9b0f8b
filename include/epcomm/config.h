// The configuration of a group: fixed at set-up, identical on every rank (compared at set-up).
#pragma once

#include <cstdint>
#include <string>

#include "epcomm/token_format.h"

namespace epcomm {

// Hard limits of this build (SPEC §9).
constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 1024;
constexpr int kMaxRanks = 8;  // GPUs of one NVLink node

struct Config {
  int32_t hidden = 0;               // H: a multiple of format_hidden_multiple(format)
  int32_t top_k = 0;                // K: 1..kMaxTopK
  int32_t n_experts = 0;            // global experts; a multiple of n_ranks, at most kMaxExperts
  int32_t max_tokens_per_rank = 0;  // upper bound on T of any call
  TokenFormat format = TokenFormat::kBF16;  // the dispatch output's format (inputs are bf16)
  float nvfp4_global_scale = 1.0f;  // NVFP4's global input scale gs (positive, finite)
  int32_t num_sms = 24;             // blocks per dispatch/combine kernel (one per SM)
  double timeout_seconds = 5.0;     // bound on every wait for a peer
  bool trace = false;               // stamp each stage of every kernel (trace.h; profiling)

  // Throws Error(kInvalidArgument) naming the first bad field. n_ranks is the group size.
  void validate(int n_ranks) const;
};

// Compares the configs gathered from every rank; throws Error(kConfigMismatch) naming the field
// and the two ranks that disagree. `configs` holds n_ranks entries in rank order.
void check_configs_match(const Config* configs, int n_ranks);

// Sizes every caller needs to allocate its outputs.
struct Sizes {
  int32_t n_ranks = 0;
  int32_t n_local_experts = 0;    // experts per rank
  int32_t num_groups = 0;         // G = n_local_experts
  int64_t max_routed_rows = 0;    // rows that can arrive: max_tokens * n_ranks * min(K, G)
  int64_t max_recv_rows = 0;      // rows of the dispatch output, format padding included
  int64_t token_bytes = 0;        // bytes of one dispatched row's codes (format_row_bytes)
  int64_t scales_bytes = 0;       // bytes of the dispatch scales output (0 for bf16)
  int32_t num_scales_offsets = 0; // entries of scales_offsets: G for NVFP4 / MXFP8, else 0
};

Sizes compute_sizes(const Config& cfg, int n_ranks);

}  // namespace epcomm
