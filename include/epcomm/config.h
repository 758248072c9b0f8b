// The configuration of a group: fixed at set-up, identical on every rank (compared at set-up).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "epcomm/layout.h"
#include "epcomm/token_format.h"

namespace epcomm {

// Hard limits of this build (docs/design.md "Limits").
constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 1024;
constexpr int kMaxRanks = 64;  // EP64: 8 nodes of 8 GPUs (WindowLayout::kMaxPeers)

// Which dispatch kernels a group runs (docs/design.md "Modes"). Both give the same outputs, bit for bit.
enum class DispatchPath : int32_t {
  // kLowLatency where max_tokens_per_rank <= kLowLatencyMaxTokens and num_sms >=
  // kLowLatencyMinSms, else kThroughput.
  kAuto = 0,
  // Prefill: tokens ranked over the whole grid (two grid barriers), sent in 16-token chunks by
  // a share of the blocks while the others expand the chunks that have arrived.
  kThroughput = 1,
  // Decode: no grid-wide barrier anywhere. Every block ranks the call's tokens itself in shared
  // memory (so T <= kLowLatencyMaxTokens), sends its share of (token, 1024-value part) pieces,
  // each with its own sequence-numbered arrival flag, then expands the pieces it is given as
  // their flags arrive. Give it every SM (num_sms) the GPU can spare.
  kLowLatency = 2,
};
constexpr int32_t kLowLatencyMaxTokens = 512;
// The fewest SMs with which kAuto takes the low-latency path. Across real links it wins only
// when given nearly the whole GPU: on 4 x H200 over NVLink (4 ranks, 128 tokens a rank,
// 2026-11-26, docs/performance.md) its dispatch took 120.9 / 99.0 / 73.6 / 63.9 us at 24 / 32 /
// 64 / 132 SMs against the throughput path's 78.3 / 77.7 / 70.2 / 68.1 (FP8 `decode`; bf16 and
// `small` alike, level at 132). Each of its blocks fences and flags its pieces round by round,
// and with few blocks those rounds queue behind the link. With no link it was the faster one
// at 24 SMs too (one H100, one rank, 2026-11-24: 72.4 against 101.2 us): ask for it there.
constexpr int32_t kLowLatencyMinSms = 128;
constexpr int32_t kNumDispatchPaths = 3;
// "auto", "throughput", "low-latency".
const char* dispatch_path_name(DispatchPath p);
// The path whose dispatch_path_name is `name`, or nullopt.
std::optional<DispatchPath> dispatch_path_from_name(const std::string& name);
// Every path's name, quoted, comma-separated (for error messages).
std::string dispatch_path_names();

// Config::timeout_seconds's default: EPCOMM_TIMEOUT_SECONDS from the environment when set (a
// number of seconds; a value that is not one is kept as NaN, which validation reports naming
// the variable), else kDefaultTimeoutSeconds.
constexpr double kDefaultTimeoutSeconds = 300.0;
constexpr double kMaxTimeoutSeconds = 3600.0;
double default_timeout_seconds();

struct Config {
  int32_t hidden = 0;               // H: a multiple of format_hidden_multiple(format)
  int32_t top_k = 0;                // K: 1..kMaxTopK
  int32_t n_experts = 0;            // global experts; a multiple of n_ranks, at most kMaxExperts
  int32_t max_tokens_per_rank = 0;  // upper bound on T of any call
  TokenFormat format = TokenFormat::kBF16;  // the dispatch output's format (inputs are bf16)
  float nvfp4_global_scale = 1.0f;  // NVFP4's global input scale gs (positive, finite)
  // Blockwise FP8 only: each block's scale rounded up to a power of two (Fp8BlockQuant, pow2),
  // still stored as fp32; a consumer that wants UE8M0 bytes takes the scale's exponent byte.
  // DeepEP's round_scale; GEMMs with UE8M0 scales (DeepGEMM on Blackwell) need it.
  bool fp8_pow2_scales = false;
  // Blockwise FP8 with fp8_pow2_scales and padded_capacity: the scales output holds DeepEP's
  // UE8M0 words, [G, H / 512, padded_capacity] int32 (Ue8m0ScaleLayout: each power-of-two
  // scale's biased exponent byte, four to a word), instead of fp32 scales. H a multiple of 512.
  bool fp8_ue8m0_scales = false;
  int32_t num_sms = 24;             // SMs the dispatch/combine kernels may occupy; today one
                                    // block per SM
  // The bound on every wait for a peer (seconds). The default, default_timeout_seconds(), is
  // long enough for healthy peers that arrive late (a first call compiling, a rank still
  // loading weights, processes time-sliced on one GPU); a peer that is really gone is named
  // when it expires. An expired wait poisons the group (group.h).
  double timeout_seconds = default_timeout_seconds();
  bool trace = false;               // stamp each stage of every kernel (trace.h; profiling)
  // Several ranks may run on one GPU: ranks of one process (Group::create_local(cfg, {0, 0}))
  // or processes sharing a device (their windows are mapped through CUDA IPC). Off (the
  // default), two ranks on one GPU is a set-up error. For tests and CI on machines with fewer
  // GPUs than ranks; the ranks then share the GPU's SMs and memory bandwidth. Every rank's
  // blocks must be resident at once: set-up checks that ranks_on_gpu * num_sms fits
  // (max_resident_blocks) and names the num_sms that would.
  bool share_gpus = false;
  // A cap on Sizes::max_routed_rows, the rows that may be routed to this rank (its dispatch
  // output's rows before format padding; Sizes::max_recv_rows adds the padding). 0: the worst
  // case, max_tokens_per_rank * n_ranks * min(top_k, n_local). A smaller cap shrinks every
  // output a caller allocates; a dispatch that routes more rows than the cap to any rank writes
  // no row on any rank and reports ErrorCode::kRecvCapacity on every rank, naming the ranks
  // that would overflow (group.h).
  int64_t max_routed_rows = 0;
  // The tokens and scales outputs' layout. 0: packed, group g's rows at [row_offsets[g],
  // row_offsets[g + 1]). C > 0: the padded per-expert layout a masked grouped GEMM and DeepEP's
  // low-latency mode read (epcomm/padded_layout.h): tokens [G, C, row], row row_offsets[g] + j
  // at slot (g, j); FP8 scales [G, H / 128, C] fp32 (or UE8M0 words, fp8_ue8m0_scales); and
  // dispatch also writes counts, slot_token and layout_range (DispatchOutput). row_offsets,
  // expert_ids and src_info stay packed (what combine reads), with no format padding rows;
  // slots at or past a group's count keep what they held. At least the most rows a group can
  // receive, n_ranks * max_tokens_per_rank (max_tokens_per_rank with skip_a2a), with groups * C
  // below 2^31; bf16 and blockwise FP8 only.
  int64_t padded_capacity = 0;
  // The dispatch kernels (DispatchPath). kLowLatency needs max_tokens_per_rank <=
  // kLowLatencyMaxTokens.
  DispatchPath dispatch_path = DispatchPath::kAuto;

  // Nodes. Ranks of one node reach each other's memory with loads and stores (NVLink); traffic
  // between ranks of different nodes goes through NVSHMEM (a build with the NVSHMEM component,
  // -DEPCOMM_WITH_NVSHMEM=ON). 0: the hardware decides: ranks whose processes run on one host
  // form a node (they must be consecutive ranks, the same number on every host). n > 0 declares
  // the group to be n_ranks / n nodes of n consecutive ranks whatever the hardware, so that
  // every transfer between those "nodes" goes through NVSHMEM: for tests and benchmarks of the
  // cross-node path on one machine (e.g. 4 processes on one GPU as 2 nodes x 2 ranks). Must
  // divide n_ranks. Ranks of one node must be able to map each other's memory.
  int32_t ranks_per_node = 0;

  // Modes (docs/design.md "Modes").
  // Fused shared expert: group 0 of every rank's dispatch output holds this rank's own tokens
  // (rows [0, T), token order, in the dispatch format; expert_ids[0] = kSharedExpertId), the
  // local experts are groups 1..n_local, and combine adds the shared expert's output row of
  // token t into out[t] (weight 1, after the routed experts). Needs router weights (at dispatch
  // or at combine), top_k < kMaxTopK (the shared expert takes a slot) and
  // n_experts / n_ranks < kMaxExperts (it is one more group).
  bool shared_expert = false;
  // Tensor-parallel attention: every rank holds the same tokens (the same T, topk_ids, weights
  // and tokens on every rank). Dispatch keeps only this rank's experts, with no traffic between
  // ranks; combine returns the partial weighted sum over them, for the caller to all-reduce.
  // With shared_expert, the shared expert's tokens are split over allreduce_world_size ranks:
  // share r = rank % W takes (T + W - r - 1) / W tokens from r * (T / W) + min(r, T % W), so
  // that after the all-reduce every token has its shared-expert output once.
  bool skip_a2a = false;
  // skip_a2a + shared_expert: W, the ranks the caller all-reduces over (0: n_ranks); at most
  // n_ranks.
  int32_t allreduce_world_size = 0;

  // How rank `rank` of an n_ranks group routes (layout.h RouteMap).
  RouteMap route(int n_ranks, int rank) const;

  // Whether a combine may take `columns` columns (CombineInput::hidden): the group's hidden, or
  // fewer, a positive multiple of 8.
  bool combine_columns_ok(int64_t columns) const {
    return columns > 0 && columns <= hidden && columns % 8 == 0;
  }

  // The path the group runs: dispatch_path with kAuto resolved.
  DispatchPath resolved_path() const {
    if (dispatch_path != DispatchPath::kAuto) return dispatch_path;
    return max_tokens_per_rank <= kLowLatencyMaxTokens && num_sms >= kLowLatencyMinSms
               ? DispatchPath::kLowLatency
               : DispatchPath::kThroughput;
  }

  // Throws Error(kInvalidArgument) naming the first bad field. n_ranks is the group size.
  void validate(int n_ranks) const;
};

// Config's fields, each listed once: its name and member, in declaration order. The cross-rank
// comparison (check_configs_match), validation's messages, and the Python bindings' properties
// and field names are driven from this table; a static_assert in config.cpp fails the build
// when a field is added to Config but not here.
template <class T>
struct ConfigField {
  using Member = T Config::*;
  const char* name;
  Member member;
  // Compared across ranks at set-up. Off for what a rank may choose alone (trace: stamping one
  // rank's stages changes nothing its peers see).
  bool same_on_every_rank = true;
};
inline constexpr auto kConfigFields = std::make_tuple(
    ConfigField<int32_t>{"hidden", &Config::hidden}, ConfigField<int32_t>{"top_k", &Config::top_k},
    ConfigField<int32_t>{"n_experts", &Config::n_experts},
    ConfigField<int32_t>{"max_tokens_per_rank", &Config::max_tokens_per_rank},
    ConfigField<TokenFormat>{"format", &Config::format},
    ConfigField<float>{"nvfp4_global_scale", &Config::nvfp4_global_scale},
    ConfigField<bool>{"fp8_pow2_scales", &Config::fp8_pow2_scales},
    ConfigField<bool>{"fp8_ue8m0_scales", &Config::fp8_ue8m0_scales},
    ConfigField<int32_t>{"num_sms", &Config::num_sms},
    ConfigField<double>{"timeout_seconds", &Config::timeout_seconds},
    ConfigField<bool>{"trace", &Config::trace, false},
    ConfigField<bool>{"share_gpus", &Config::share_gpus},
    ConfigField<int64_t>{"max_routed_rows", &Config::max_routed_rows},
    ConfigField<int64_t>{"padded_capacity", &Config::padded_capacity},
    ConfigField<DispatchPath>{"dispatch_path", &Config::dispatch_path},
    ConfigField<int32_t>{"ranks_per_node", &Config::ranks_per_node},
    ConfigField<bool>{"shared_expert", &Config::shared_expert},
    ConfigField<bool>{"skip_a2a", &Config::skip_a2a},
    ConfigField<int32_t>{"allreduce_world_size", &Config::allreduce_world_size});
constexpr size_t kNumConfigFields = std::tuple_size_v<decltype(kConfigFields)>;

// Calls f(field) for each ConfigField of kConfigFields, in order.
template <class F>
constexpr void for_each_config_field(F&& f) {
  std::apply([&](const auto&... field) { (f(field), ...); }, kConfigFields);
}

// The table's name of a Config member (&Config::hidden -> "hidden").
template <class T>
constexpr const char* config_field_name(T Config::*member) {
  const char* name = "?";
  for_each_config_field([&](const auto& field) {
    if constexpr (std::is_same_v<decltype(field.member), T Config::*>)
      if (field.member == member) name = field.name;
  });
  return name;
}

// Compares the configs gathered from every rank; throws Error(kConfigMismatch) naming the field
// and the two ranks that disagree. `configs` holds n_ranks entries in rank order.
void check_configs_match(const Config* configs, int n_ranks);

// Sizes every caller needs to allocate its outputs.
struct Sizes {
  int32_t n_ranks = 0;
  int32_t n_local_experts = 0;    // experts per rank
  int32_t num_groups = 0;         // G = n_local_experts (+ 1 with the shared expert)
  int64_t max_routed_rows = 0;    // rows that can arrive: max_tokens * n_ranks * min(K,
                                  // n_local) (n_ranks 1 with skip_a2a), + max_tokens with the
                                  // shared expert; or Config::max_routed_rows where smaller
  int64_t max_recv_rows = 0;      // rows of the dispatch output, format padding included
  int64_t token_bytes = 0;        // bytes of one dispatched row's codes (format_row_bytes)
  int64_t scales_bytes = 0;       // bytes of the dispatch scales output (0 for bf16)
  int32_t num_scales_offsets = 0; // entries of scales_offsets: G for NVFP4 / MXFP8, else 0
};

Sizes compute_sizes(const Config& cfg, int n_ranks);

// Blocks of epcomm's kernels that GPU `device` can hold at once for a group of n_ranks ranks
// with this configuration (from the occupancy API and the SM count; the smallest over the
// dispatch and combine kernels). Ranks that share the GPU must keep
// ranks_on_gpu * num_sms <= this: their kernels wait on each other, so all their blocks must be
// resident together. Loads the kernels on `device` (and leaves it the current device).
int max_resident_blocks(const Config& cfg, int n_ranks, int device);

// Whether this build has the NVSHMEM component (-DEPCOMM_WITH_NVSHMEM=ON), without which a group
// must be one node (Config::ranks_per_node).
bool spans_nodes_supported();

}  // namespace epcomm
