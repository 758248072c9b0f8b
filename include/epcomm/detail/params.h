// Plain structs handed to the kernels by value. Everything a kernel needs is here, fixed at
// set-up or at the call, so a captured graph replays with the same arguments.
#pragma once

#include <cstdint>

#include "epcomm/detail/window_layout.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/hd.h"
#include "epcomm/layout.h"

namespace epcomm {
namespace detail {

// Which operation a device error or a wait belongs to.
enum Op : int32_t {
  kOpNone = 0,
  kOpDispatchSend = 1,
  kOpDispatchRecv = 2,
  kOpCombineSend = 3,
  kOpCombineRecv = 4,
  kOpGridBarrier = 5,
};

// Written by the first failing thread of a kernel, read by the host (host-mapped memory).
struct DeviceErrorRecord {
  int32_t code;       // ErrorCode
  int32_t op;         // Op
  int32_t rank;       // the rank that recorded it
  int32_t peer_mask;  // timeouts: bit p set = rank p did not arrive (ranks 0-31; peer_mask_hi:
                      // ranks 32-63)
  int32_t token;      // bad input: the token
  int32_t slot;       // bad input: the top-k slot
  int32_t value;      // bad input: the offending expert id; kRecvCapacity: the rows routed
                      // here; kBadPeerData: the value out of range
  int32_t wait_what;  // timeouts: which signal was awaited (see WaitWhat); kBadPeerData: which
                      // field of the peer's record (PeerField)
  int32_t epoch;      // records the host has cleared (written by the host only)
  int32_t peer_mask_hi;
  int32_t pad_;
};

// A set of ranks of a group (bit r = rank r), up to WindowLayout::kMaxPeers.
using RankMask = unsigned long long;
EPCOMM_HD RankMask rank_bit(int32_t r) {
  return RankMask(1) << r;
}

// kBadPeerData: the field of a source's meta record that was out of range.
enum PeerField : int32_t {
  kFieldStreamCount = 1,  // messages sent here: [0, max_tokens]
  kFieldChunks = 2,       // chunks: [0, num_chunks(max_tokens)]
  kFieldGroupCount = 3,   // tokens for one group: [0, messages]
  kFieldChunkStart = 4,   // chunk starts: ascending inside [0, messages]
  kFieldRowsTo = 5,       // rows routed to a rank: [0, max_tokens x K], here = the counts' sum
};

enum WaitWhat : int32_t {
  kWaitNone = 0,
  kWaitAck = 1,      // a destination to release its receive buffer from the previous call
  kWaitMeta = 2,     // a source's counts
  kWaitData = 3,     // a source's tokens
  kWaitBarrier = 4,  // the other blocks of this kernel
};

// Local (not peer-visible) device state of a rank. Counters only grow, except recv_item: the
// receiving kernel of dispatch call seq zeroes call seq + 1's at its start (no two receiving
// kernels of a group run at once), so graph replay and back-to-back calls stay safe.
struct LocalState {
  unsigned long long dispatch_seq;  // calls of dispatch completed on this rank
  unsigned long long combine_seq;   // calls of combine completed on this rank
  unsigned long long barrier;        // grid barrier arrivals (cumulative)
  unsigned long long dispatch_done;  // blocks that finished a dispatch receive (cumulative)
  unsigned long long combine_done;   // blocks that finished a combine receive (cumulative)
  unsigned long long bad_input;      // seq of the last dispatch whose topk_ids were rejected
  unsigned long long recv_item[2];   // dispatch receive work items taken, by seq parity
  unsigned long long network_bytes;  // bytes put through NVSHMEM to ranks of other nodes
                                     // (cumulative; data puts, not signal words)
  unsigned int errors_claimed;       // errors recorded: one may be while it equals the record's
                                     // epoch (the host cleared every earlier one)
  int32_t num_tokens;                // T of the last dispatch (0 when its input was rejected)
  int32_t abort;                     // set after a timeout: every wait gives up at once
};

// What every kernel knows about the group. rank, n_ranks, top_k and n_experts are those of the
// routing view (RouteMap: the caller's, unless a mode of docs/design.md "Modes" is on); `route` maps the
// caller's topk_ids and weights into it.
struct GroupView {
  int32_t rank;
  int32_t n_ranks;
  int32_t hidden;
  int32_t top_k;
  int32_t n_experts;
  // n_experts / n_ranks (n_local), n_ranks and num_parts(hidden) as divisors (hd.h): the
  // kernels' indices split by them without a division routine.
  Divisor n_local_div, n_ranks_div, n_parts_div;
  // The window's layout, of the fields above (make_view builds both on the host).
  WindowLayout window_layout;
  RouteMap route;
  int32_t max_tokens;
  int32_t num_blocks;     // blocks of the grid; today one per SM, Config::num_sms
  TokenFormat format;     // the dispatch output's format
  float nvfp4_global_scale;
  int32_t low_latency;    // DispatchPath::kLowLatency (Config::resolved_path)
  int32_t fp8_pow2;       // Config::fp8_pow2_scales
  int64_t routed_rows;    // rows a dispatch may deliver here (Sizes::max_routed_rows: the cap)
  int64_t capacity;       // Config::padded_capacity: 0 packed, else the padded layout's slots
  unsigned long long timeout_ns;
  // Every rank's symmetric window, as seen from here; null for ranks of other nodes, which are
  // reached through NVSHMEM at the same offsets of this rank's own window (its symmetric
  // address; transport.cuh).
  // Ranks 0..kInlineWindows-1 here; ranks from kInlineWindows on in window_rest, a device
  // array: GroupView travels by value in every kernel's parameters, and a kernel that hands it
  // to an out-of-line function copies it to local memory, so it stays small (64 window pointers
  // inline made decode dispatch a third slower: docs/results/2026-11-25_h100_64ranks_ab_ea3a73e.md).
  static constexpr int32_t kInlineWindows = 8;
  char* window[kInlineWindows];
  char* const* window_rest;  // [n_ranks - kInlineWindows], or null
  int32_t ranks_per_node;  // NodeMap: n_ranks when the group is one node
  int32_t ue8m0;           // Config::fp8_ue8m0_scales
  char* outbox;  // OutboxLayout: what goes to other nodes is staged here (null: one node)
  LocalState* state;
  DeviceErrorRecord* error;  // host-mapped
  unsigned long long* trace;  // Config::trace: [trace_words(num_blocks)] stamps (trace.h), else null

  EPCOMM_HD const WindowLayout& layout() const { return window_layout; }
  // Rows a dispatch can deliver here, and the output's rows and scale layouts.
  EPCOMM_HD int64_t max_routed_rows() const { return routed_rows; }
  EPCOMM_HD DispatchOutputLayout output() const {
    return DispatchOutputLayout::make(format, hidden, max_routed_rows(), n_local(), capacity,
                                      ue8m0 != 0);
  }
  EPCOMM_HD char* window_of(int32_t r) const {
    return r < kInlineWindows ? window[r] : window_rest[r - kInlineWindows];
  }
  EPCOMM_HD ExpertMap experts() const { return ExpertMap{n_experts, n_ranks, n_local_div}; }
  EPCOMM_HD NodeMap nodes() const { return NodeMap{n_ranks, ranks_per_node}; }
  EPCOMM_HD bool multi_node() const { return ranks_per_node < n_ranks; }
  EPCOMM_HD OutboxLayout outbox_layout() const {
    const int32_t n_remote = nodes().n_remote();
    const int64_t staged = int64_t(n_remote) * max_tokens;
    return OutboxLayout{layout(), n_remote, output().rows > staged ? output().rows : staged};
  }
  EPCOMM_HD int32_t n_local() const { return n_local_div.d; }
};

// Scratch of the dispatch ranking pass (local device memory).
struct RankScratch {
  int32_t* topk;         // [max_tokens, K] validated copy of this call's topk_ids (kept for combine)
  int32_t* expert_pos;   // [max_tokens, K] position in its expert's stream (unit-local, then global)
  int32_t* dest_pos;     // [max_tokens, n_ranks] slot in that destination's stream, -1 = not sent
  int32_t* unit_hist;    // [n_units, num_keys] per-unit key counts
  int32_t* unit_prefix;  // [n_units + 1, num_keys] exclusive prefix over units; last row = totals
  int32_t* chunk_pos;    // [num_chunks(max_tokens), n_ranks] messages to rank r from the chunk's
                         // unit before the chunk (add unit_prefix for the stream position)
  // What the last dispatch's receive side found, for the expert-side combine (which walks the
  // received messages): written by the receiver's block 0.
  int32_t* recv_base;   // [n_ranks, n_local]: first output row of source s in group g
  int32_t* recv_count;  // [n_ranks]: messages received from source s
  // [max_tokens, K]: for this rank's own token t and a slot k whose expert is local, the output
  // row the last dispatch wrote it to (-1: none), written by the receiver as it expands this
  // rank's own messages. The fused combine reads those rows in place (no copy through the
  // combine buffer).
  int32_t* self_row;
};

struct DispatchParams {
  GroupView g;
  RankScratch scratch;
  const void* tokens;
  const void* topk_ids;  // DispatchInput::topk_ids (id_bytes 4) or topk_ids64 (8)
  const float* weights;  // [T, K] router weights carried in the headers, or null
  int32_t num_tokens;
  int32_t id_bytes;
  // outputs (wait / fused)
  void* out_tokens;
  uint32_t* row_offsets;
  int32_t* expert_ids;
  SrcInfo* src_info;
  void* out_scales;          // quantised formats: the output scales (DispatchOutputLayout)
  uint32_t* scales_offsets;  // NVFP4, MXFP8: [G]
  // The padded layout (GroupView::capacity > 0; DispatchOutput): counts [G], and where given,
  // slot_token [G, C] and layout_range [G, caller ranks].
  int32_t* counts;
  int32_t* slot_token;
  int64_t* layout_range;
};

// The combine kernels' work split (the host picks the kernel with it, the kernels split their
// items with it): `rows` rows of `hidden` columns over `warps` warps, each row cut into `split`
// interleaved parts of 256-column steps when there are fewer than about twice as many rows as
// warps (decode: 128 rows on 2,112 warps take 16 parts, 460 on 384 take 3), so more loads are
// in flight; with many rows split = 1.
constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int32_t kCombineStep = 256;  // columns: 32 lanes x 8
// The split is the one of least cost, the busiest warp's items times (an item's steps + 1: its
// first round trip, a header or the top-k ids, costs about a step). For each k, the most parts
// that give no warp more than k items is the cheapest split of k items a warp; k runs to
// kCombineSplitItems, and split 1 is always a candidate. (Cutting rows into as many parts as
// kept every warp busy twice over lost where it gave most warps two items of one round trip
// each: one H200, one rank, decode combine at 132 SMs 23.1 -> 21.8 us and at 24 SMs 31.6 ->
// 27.6 with one item a warp; but four ranks at 24 SMs, 460 messages on 384 warps, took 47.8 ->
// 51.7 us with split 1, where two warps in ten took two whole rows.)
constexpr int32_t kCombineSplitItems = 4;
static_assert(kCombineSplitItems < 32, "WorkSplit::make costs a candidate in each lane 1..k");
constexpr int32_t kCombineSplitMaxRows = 1 << 20;  // the cost's products stay in 32 bits
// Never split (split 1): more rows than kCombineSplitMaxRows, rows of more than 1024 steps, or
// warps outside [1, kCombineSplitMaxRows].
EPCOMM_HD bool combine_split_in_range(int64_t rows, int32_t steps, int64_t warps) {
  return rows >= 0 && rows <= kCombineSplitMaxRows && warps >= 1 && warps <= kCombineSplitMaxRows &&
         steps >= 1 && steps <= 1024;
}
EPCOMM_HD int32_t combine_split_cost(int32_t rows, int32_t steps, int32_t warps, int32_t split) {
  const int32_t per_warp = (rows * split + warps - 1) / warps;
  return per_warp * ((steps + split - 1) / split + 1);
}
// Candidate k >= 1: the most parts (at most `steps`) that give no warp more than k items; 0 if
// even one part a row gives some warp more.
EPCOMM_HD int32_t combine_split_candidate(int32_t rows, int32_t steps, int32_t warps, int32_t k) {
  const int32_t s = rows > 0 ? k * warps / rows : steps;
  return s < steps ? s : steps;
}
EPCOMM_HD int32_t combine_split(int64_t rows, int32_t hidden, int64_t warps) {
  const int32_t steps = (hidden + kCombineStep - 1) / kCombineStep;
  if (!combine_split_in_range(rows, steps, warps)) return 1;
  const int32_t r = int32_t(rows), w = int32_t(warps);
  int32_t best = 1, best_cost = combine_split_cost(r, steps, w, 1);
  for (int32_t k = 1; k <= kCombineSplitItems; ++k) {
    const int32_t s = combine_split_candidate(r, steps, w, k);
    if (s < 1) continue;
    const int32_t c = combine_split_cost(r, steps, w, s);
    if (c < best_cost) best = s, best_cost = c;
  }
  return best;
}
// Items of more than one step: the receive of `tokens` tokens on `blocks` blocks.
EPCOMM_HD bool combine_whole_rows(int64_t tokens, int32_t hidden, int32_t blocks) {
  return int64_t(combine_split(tokens, hidden, int64_t(blocks) * kCombineWarps)) * kCombineStep <
         hidden;
}

struct CombineParams {
  GroupView g;
  const int32_t* topk;  // this rank's validated topk_ids of the last dispatch (scratch.topk)
  // The last dispatch carried router weights: the expert side sums each received token's rows
  // with them and returns one row per (token, rank); the token side adds those rows.
  int32_t expert_side;
  // 1: the kernel whose sums load several 256-column steps of a few rows at once, for items of
  // whole rows; 0: one step of up to 8 rows (combine_whole_rows; speed only, both are exact).
  int32_t whole_rows;
  // The call's columns (CombineInput::hidden, at most g.hidden): expert_out's and the output's
  // rows; the combine buffer keeps the group's layout (slots of g.hidden columns).
  int32_t hidden;
  const int32_t* recv_base;   // scratch.recv_base
  const int32_t* recv_count;  // scratch.recv_count
  const int32_t* self_row;    // scratch.self_row
  // send side
  const void* expert_out;
  const uint32_t* row_offsets;
  const SrcInfo* src_info;
  int64_t expert_capacity;  // CombineInput::expert_out_capacity (0: dispatch row order)
  // receive side
  void* out;
  const float* weights;
};

}  // namespace detail
}  // namespace epcomm
