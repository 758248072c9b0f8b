// Dispatch over the transport seam (transport.cuh: NVLink peer stores, NVSHMEM puts);
// docs/design.md has the protocol in full.
//
// Per call `seq` (= dispatch calls completed on this rank + 1; every rank counts the same calls,
// so seq agrees across ranks without any exchange):
//  send  1. rank: every (token, key) gets its position among this rank's tokens carrying that
//           key (keys = experts and destination ranks, layout.h ExpertMap), stable by token
//           index so outputs are deterministic; units of 512 tokens are ranked by one block with
//           per-warp lane bitmaps, a grid-wide scan over units finishes. The same pass
//           validates topk_ids (a bad rank records the error and sends nothing) and records
//           where each 16-token chunk starts in each destination stream.
//        2. wait until every destination acknowledged the previous call, then write the meta
//           record (counts per group, message count, chunk starts) and release its seq word.
//        3. chunk by chunk, one message per (token, destination rank): header (token, and for
//           each of its experts on that rank: group, top-k slot, position) + payload (bf16, or
//           codes + scales quantised in registers), then the chunk's arrival flag. In the fused
//           kernel where this rank's own messages stay in place (self_in_place), none is sent
//           to itself: the receive builds them from the ranking (expand_own).
//  recv  4. wait for every source's meta; derive row_offsets (format padding included) and each
//           (source, group) base row; write padding rows and unused scale slots; then expand
//           each chunk as its flag arrives (one wire copy, many output rows).
//        5. the last block to finish releases kDispatchAck[me] = seq in every source and bumps
//           the local dispatch_seq.
// The fused kernel runs 1-2 on every block, then splits the grid: senders do 3, receivers 4.
//
// The stages live in src/kernels/dispatch/, headers of this one translation unit (each opens with
// its protocol): common.cuh (the block's shape), rank.cuh (1), meta.cuh (2, and the receiver's
// check of the records), send.cuh (3), ll_send.cuh (the low-latency path's send, 1-3 without a
// grid barrier), recv.cuh (4-5). Here: the kernel, the fused kernel's split of the grid into
// senders and receivers, and the host's launch.
#include <mutex>

#include "epcomm/config.h"
#include "kernels/dispatch/common.cuh"
#include "kernels/dispatch/ll_send.cuh"
#include "kernels/dispatch/rank.cuh"
#include "kernels/dispatch/recv.cuh"
#include "kernels/dispatch/send.cuh"
#include "kernels/kernels.h"

namespace epcomm {
namespace detail {
namespace {

// The fused kernel: every block ranks; then either the grid splits, some blocks sending while
// the rest expand chunks as they arrive (each sender joining the receivers once its chunks are
// sent), or (few blocks) every block sends and then receives.
// What the split rests on, measured on prefill over NVLink (docs/results,
// 2026-11-21_h200x8_gap_and_bounds.md and 2026-11-21_h200x4_f86df74.md): sending is bound by
// the links from about 8 blocks on (8 of 24 move it as fast as 64 do), below that by the
// blocks; receiving is bound by the blocks. With the senders joining the receive, about 10 of
// 24 sending was fastest for bf16. So:
//  - fewer than kMinSplitBlocks blocks: no split (it would starve one side: 8 blocks split
//    2 + 6 were much slower than send-then-receive);
//  - bf16: 5/12 of the blocks send, at least kLinkSenders;
//  - quantised formats: 5/6 (quantising bounds the sender: with a third sending, prefill-fp8
//    was slower than async + wait; with the join, every step from 10 to 23 senders of 24 was
//    faster, for prefill-fp8 and gpt-oss alike);
//  - never more senders than chunks (a sender takes whole chunks: decode's 128 tokens are 8),
//    and at least one receiver.
// Returns the number of senders; `blocks` means send, then receive.
constexpr int32_t kMinSplitBlocks = 16;
constexpr int32_t kLinkSenders = 8;
__host__ __device__ constexpr int32_t fused_senders(int32_t blocks, TokenFormat f,
                                                    int32_t num_tokens) {
  if (blocks < kMinSplitBlocks) return blocks;
  const int32_t share = blocks * 5 / 12;
  const int32_t want =
      f == TokenFormat::kBF16 ? (share > kLinkSenders ? share : kLinkSenders) : blocks * 5 / 6;
  const int32_t chunks = num_chunks(num_tokens) > 0 ? num_chunks(num_tokens) : 1;
  const int32_t n = want < chunks ? want : chunks;
  return n < blocks - 1 ? n : blocks - 1;
}
static_assert(fused_senders(8, TokenFormat::kBF16, 4096) == 8, "few blocks: no split");
static_assert(fused_senders(24, TokenFormat::kBF16, 4096) == 10, "bf16: 5/12");
static_assert(fused_senders(16, TokenFormat::kBF16, 4096) == 8, "bf16: at least 8");
static_assert(fused_senders(24, TokenFormat::kFp8Blockwise, 4096) == 20, "quantised: 5/6");
static_assert(fused_senders(24, TokenFormat::kFp8Blockwise, 128) == 8, "no more than chunks");
static_assert(fused_senders(24, TokenFormat::kBF16, 0) == 1, "no tokens: one sender");

// One form of dispatch: the send half, the receive half, or both (the fused form); kPadded: the
// receive writes the padded layout (GroupView::capacity > 0); kLowLatency: the group's path
// (GroupView::low_latency), so each kernel holds one path's code only; kSolo: the fused kernel of
// a solo_in_place group (one rank, a quantised format: the receive quantises its own rows).
template <bool kSend, bool kRecv, TokenFormat F, bool kPadded, bool kLowLatency, bool kSolo>
__device__ __forceinline__ void dispatch_form(const DispatchParams& p) {
  extern __shared__ __align__(16) char smem[];
  const unsigned long long seq = p.g.state->dispatch_seq + 1;  // in flight with the abort flag
  // The low-latency send reads the abort flag itself, in flight during its ranking (ll_send):
  // this check's round trip, before any work, was on the path of every block.
  if (!(kLowLatency && kSend) && block_aborted(p.g)) return;
  trace_begin(p.g, kTraceDispatch, kSend ? kTraceStart : kTraceRecvStart,
              kRecv ? kTraceMarks : kTraceRecvStart);
  const int32_t blocks = p.g.num_blocks, b = blockIdx.x;
  if constexpr (kLowLatency) {  // every block sends its pieces (if it holds any), then receives
    const int32_t sent = kSend ? ll_send<F>(p, seq, smem) : 0;
    if (sent < 0) return;
    if (!kRecv) {
      trace_mark(p.g, kTraceDispatch, kTraceDone);
      return;
    }
    // (An abort since ll_send's check is found by the receive's waits.)
    // The fused kernel: where the blocks that held no piece are at least as many as those that
    // did, they receive alone (their warps take the items, dealt by index) and the sending
    // blocks only count themselves done; otherwise every block receives. With one rank,
    // decode's senders otherwise ended the kernel: they built the layout after their round and
    // took no item (one H200: done 29.8 us, the other blocks 28.1).
    const int32_t senders = kSend ? ll_sending_blocks(p.g, sent) : 0;
    const int32_t first = blocks - senders >= senders ? senders : 0;
    if (b < first) {
      dispatch_done(p.g, seq);
      trace_mark(p.g, kTraceDispatch, kTraceDone);
      return;
    }
    if (kSend) trace_mark(p.g, kTraceDispatch, kTraceRecvStart);
    dispatch_recv<F, kPadded, true>(p, seq, smem, b - first, blocks - first, false,
                                    !kSend || first > 0);
    return;
  } else {
    if (kSend && !kRecv) {
      dispatch_send<F>(p, seq, smem, blocks, false);
      trace_mark(p.g, kTraceDispatch, kTraceDone);
      return;
    }
    if (!kSend) {
      if (!block_aborted(p.g)) dispatch_recv<F, kPadded, false>(p, seq, smem, b, blocks, false);
      return;
    }
    const bool in_place = self_in_place<F, kSolo>(p.g);
    // Where nothing is sent (sends_nothing), every block receives from the start (rb = b), so
    // the padding is spread over all of them.
    const int32_t senders =
        sends_nothing(p.g, in_place) ? blocks : fused_senders(blocks, F, p.num_tokens);
    if (!dispatch_send<F>(p, seq, smem, senders, in_place)) return;
    if (block_aborted(p.g)) return;
    // Every block receives (no split), or the blocks after the senders, joined by each sender
    // once it has sent its chunks. One call site: the receive inlined twice would double the
    // kernel's code, and instruction fetch is part of the latency here.
    trace_mark(p.g, kTraceDispatch, kTraceRecvStart);
    const int32_t first = senders == blocks ? 0 : senders;
    dispatch_recv<F, kPadded, false, kSolo>(p, seq, smem, b - first, blocks - first, in_place);
  }
}

// Two kernels per format: the fused form, and one kernel for both halves of a split call
// (dispatch_async's send, dispatch_wait's receive: `recv_half` picks). A profiler then sees one
// kernel name per operation and form; DeepEP's test programs and profiling helpers find an
// operation's kernels by name and expect one name (a hook-mode call counts two launches of it).
template <bool kFused, TokenFormat F, bool kPadded, bool kLowLatency, bool kSolo = false>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(const __grid_constant__ DispatchParams p, int32_t recv_half) {
  if constexpr (kFused)
    dispatch_form<true, true, F, kPadded, kLowLatency, kSolo>(p);
  else if (recv_half)
    dispatch_form<false, true, F, kPadded, kLowLatency, false>(p);
  else
    dispatch_form<true, false, F, kPadded, kLowLatency, false>(p);
}

// The two kernels of format F, layout (packed, or padded) and path; kSolo: a solo_in_place
// group's (its fused kernel is its own; the split form is every group's).
template <TokenFormat F, bool kPadded, bool kLowLatency, bool kSolo = false>
struct DispatchKernels {
  static constexpr void (*fused)(DispatchParams,
                                 int32_t) = dispatch_kernel<true, F, kPadded, kLowLatency, kSolo>;
  static constexpr void (*split)(DispatchParams,
                                 int32_t) = dispatch_kernel<false, F, kPadded, kLowLatency>;
};

// Calls f(DispatchKernels<F, kPadded, kLowLatency, solo>{}), solo for a solo_in_place group.
template <TokenFormat F, bool kPadded, bool kLowLatency, class Fn>
void with_kernels(const GroupView& g, Fn fn) {
  if constexpr (F != TokenFormat::kBF16 && !kLowLatency)
    if (solo_in_place(g)) return fn(DispatchKernels<F, kPadded, kLowLatency, true>{});
  fn(DispatchKernels<F, kPadded, kLowLatency>{});
}

// Calls f(DispatchKernels<F, padded, low_latency>{}) for the group's format, layout and path:
// the padded layout has kernels of its own (bf16 and fp8-blockwise, the formats Config allows
// it), so the packed ones keep none of its branches, and each path has its own, so a decode
// kernel's instructions are only the low-latency path's (instruction fetch was 17% of the
// low-latency dispatch's stall samples, docs/results/2026-11-26_h100_decode_bounds_eb2fb1e.md).
template <bool kLowLatency, class Fn>
void with_format_on(const GroupView& g, Fn fn) {
  const TokenFormat f = g.format;
  constexpr bool L = kLowLatency;
  if (g.capacity > 0) {
    if (f == TokenFormat::kBF16) return with_kernels<TokenFormat::kBF16, true, L>(g, fn);
    if (f == TokenFormat::kFp8Blockwise)
      return with_kernels<TokenFormat::kFp8Blockwise, true, L>(g, fn);
    throw Error(ErrorCode::kInvalidArgument,
                std::string("dispatch: the padded layout with format ") + token_format_name(f));
  }
  switch (f) {
    case TokenFormat::kBF16:
      return with_kernels<TokenFormat::kBF16, false, L>(g, fn);
    case TokenFormat::kFp8Blockwise:
      return with_kernels<TokenFormat::kFp8Blockwise, false, L>(g, fn);
    case TokenFormat::kNvfp4:
      return with_kernels<TokenFormat::kNvfp4, false, L>(g, fn);
    case TokenFormat::kMxfp8:
      return with_kernels<TokenFormat::kMxfp8, false, L>(g, fn);
    case TokenFormat::kMxfp4:
      return with_kernels<TokenFormat::kMxfp4, false, L>(g, fn);
  }
  throw Error(ErrorCode::kInvalidArgument, "dispatch: unknown token format");
}
template <class Fn>
void with_format(const GroupView& g, Fn fn) {
  if (g.low_latency)
    with_format_on<true>(g, fn);
  else
    with_format_on<false>(g, fn);
}

// What the send alone needs: the ranking's bitmaps (throughput path) or the low-latency path's
// shared ranking.
size_t dispatch_send_smem_bytes(const GroupView& g) {
  const size_t nk = size_t(g.experts().num_keys());
  const size_t send = g.low_latency
                          ? size_t(LocalRanks::smem_bytes(int32_t(nk), g.max_tokens, g.top_k))
                          : kWarps * nk * (sizeof(uint32_t) + sizeof(uint16_t));
  return align_up(int64_t(send), 16);
}

}  // namespace

size_t dispatch_smem_bytes(const GroupView& g) {
  const size_t send = dispatch_send_smem_bytes(g);
  const size_t recv = size_t(RecvRing::end(g));
  return align_up(int64_t(send > recv ? send : recv), 16);
}

int dispatch_threads() {
  return kThreads;
}
int dispatch_unit_tokens() {
  return kUnitTokens;
}

void launch_dispatch(const DispatchParams& p, bool send, bool recv, cudaStream_t stream) {
  // The send half needs no receive ring: less shared memory leaves more of the SM's L1 to it.
  const size_t smem = recv ? dispatch_smem_bytes(p.g) : dispatch_send_smem_bytes(p.g);
  with_format(p.g, [&](auto k) {
    using K = decltype(k);
    launch_cooperative(send && recv ? K::fused : K::split, p.g.num_blocks, kThreads, smem, stream,
                       p, int32_t(!send));
  });
}

int prepare_dispatch_kernels(const GroupView& g) {
  const int smem = int(dispatch_smem_bytes(g));
  int per_sm = 0;
  // The attribute belongs to the kernel, not to the group: several groups of one process share
  // it, so it only ever grows (a smaller group set up later must not shrink what an earlier one
  // launches with). The lock makes the read and the write one step.
  static std::mutex attribute_lock;
  std::lock_guard<std::mutex> hold(attribute_lock);
  with_format(g, [&](auto k) {
    using K = decltype(k);
    for (auto kernel : {K::fused, K::split}) {
      cudaFuncAttributes attr{};
      check_cuda(cudaFuncGetAttributes(&attr, kernel),
                 "cudaFuncGetAttributes(dispatch)");  // also loads the kernel (lazy loading)
      if (attr.maxDynamicSharedSizeBytes < smem)
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                   "cudaFuncSetAttribute(dispatch)");
    }
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, K::fused, kThreads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  });
  return per_sm;
}

}  // namespace detail
}  // namespace epcomm
