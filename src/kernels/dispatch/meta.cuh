// Dispatch stage 2, meta records: before any message, each sender tells each destination how
// many of its messages go to each local group, how many in all, and where each chunk starts in
// its stream. With them the receiver lays out every output row (row_offsets, each (source,
// group) base) before a single token arrives, and can expand chunks in whatever order they land.
//
// Who writes what: a sender writes its record into its slot of the destination's window once
// that destination has acknowledged the previous call (kDispatchAck >= seq - 1: the slot and the
// receive buffer are free), then releases the record's seq word. Who waits: every receiving
// block acquires every source's seq word (>= seq), reads the records into RecvGroups and checks
// them (check_sources) before using them: a peer's record is never trusted to index the buffers,
// and a bad one leaves empty groups, so the call still completes and the group stays usable.
// The seq words only grow (seq = this call), so nothing is reset between calls.
#pragma once

#include "kernels/dispatch/rank.cuh"
#include "epcomm/detail/transport.cuh"

namespace epcomm {
namespace detail {
namespace {

// Where chunk c (< num_chunks(T)) starts in destination d's stream from this rank, from the
// ranking scratch.
__device__ __forceinline__ int32_t stream_chunk_start(const DispatchParams& p, int32_t c,
                                                      int32_t d) {
  const ExpertMap em = p.g.experts();
  const int32_t nk = em.num_keys();
  const int32_t unit = c * kChunkTokens / kUnitTokens;
  return p.scratch.unit_prefix[int64_t(unit) * nk + em.rank_key(d)] +
         p.scratch.chunk_pos[int64_t(c) * p.g.n_ranks + d];
}

// Destination d's meta record of this call, written by one whole warp: count(j) tokens for
// local group j, stream_count messages, n_chunks chunks starting at chunk_start(c) (c <=
// n_chunks), then the release of its seq word.
template <class Count, class ChunkStart>
__device__ void write_meta(const GroupView& g, unsigned long long seq, int32_t d, Count count,
                           int32_t stream_count, int32_t n_chunks, ChunkStart chunk_start) {
  const int lane = threadIdx.x % kWarpSize;
  const MetaLayout ml = g.layout().meta();
  const int64_t at = g.layout().meta_offset(g.rank);
  char* meta = put_buffer(g, d, at, [&] {
    return outbox_at(g, g.outbox_layout().meta_offset(g.nodes().remote_index(g.rank, d)));
  });
  int32_t* counts = reinterpret_cast<int32_t*>(meta + ml.counts_offset());
  for (int32_t j = lane; j < g.n_local(); j += kWarpSize)
    counts[j] = count(j);
  if (lane == 0) {
    *reinterpret_cast<int32_t*>(meta + ml.stream_count_offset()) = stream_count;
    *reinterpret_cast<int32_t*>(meta + ml.n_chunks_offset()) = n_chunks;
  }
  int32_t* starts = reinterpret_cast<int32_t*>(meta + ml.chunk_start_offset());
  for (int32_t c = lane; c <= n_chunks; c += kWarpSize)
    starts[c] = c == n_chunks ? stream_count : chunk_start(c);
  __syncwarp();
  // The record after its seq word, then seq as the signal.
  warp_put_signal(g, d, at + ml.stream_count_offset(), meta + ml.stream_count_offset(),
                  ml.bytes() - ml.stream_count_offset(), at + ml.seq_offset(), seq);
}

__device__ void send_meta(const DispatchParams& p, unsigned long long seq, bool bad) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  const int32_t nk = em.num_keys(), n_local = g.n_local();
  const int warp = threadIdx.x / kWarpSize;
  const int32_t n_units = (p.num_tokens + kUnitTokens - 1) / kUnitTokens;
  const int32_t* totals = p.scratch.unit_prefix + int64_t(n_units) * nk;
  for (int32_t d = warp; d < g.n_ranks; d += kWarps) {
    write_meta(
        g, seq, d, [&](int32_t j) { return bad ? 0 : totals[d * n_local + j]; },
        bad ? 0 : totals[em.rank_key(d)], bad ? 0 : num_chunks(p.num_tokens),
        [&](int32_t c) { return stream_chunk_start(p, c, d); });
  }
}

// ---- the receiver's side -------------------------------------------------------------------

// The receiver's view of this call's groups, in shared memory (filled by dispatch_recv).
struct RecvGroups {
  int32_t* counts;        // [n_ranks][n_local]: tokens source s sends to group g
  int32_t* base;          // [n_ranks][n_local]: first output row of source s in group g
  int32_t* stream_count;  // [n_ranks]: messages from source s
  int32_t* row_offset;    // [n_local + 1]: row_offsets (FP8: padded group counts)
  int32_t* rows;          // [n_local]: rows that arrive in group g (m_g, unpadded)
  int32_t* tile_start;    // [n_local + 1]: swizzled formats: first scale tile of group g
  int32_t* n_chunks;      // [n_ranks]: chunks source s sends

  __host__ __device__ static int64_t smem_words(int32_t n_ranks, int32_t n_local) {
    return 3 * int64_t(n_ranks) * n_local + 2 * int64_t(n_ranks) + 3 * int64_t(n_local) + 2;
  }
  __device__ static RecvGroups carve(char* smem, int32_t n_ranks, int32_t n_local) {
    int32_t* w = reinterpret_cast<int32_t*>(smem);
    RecvGroups r;
    r.counts = w;
    r.base = r.counts + n_ranks * n_local;
    r.stream_count = r.base + n_ranks * n_local;
    r.row_offset = r.stream_count + n_ranks;
    r.rows = r.row_offset + n_local + 1;
    r.tile_start = r.rows + n_local;
    r.n_chunks = r.tile_start + n_local + 1;
    return r;
  }
};

// Checks what the sources announced before anything is written: every count, message count and
// chunk start in range (a peer's record is never trusted to stay inside the buffers), and the
// rows routed here within the receive capacity (Config::max_routed_rows). Every receiving block
// finds the same verdict; block rb == 0 records the error. Returns 0, kBadPeerData or
// kRecvCapacity.
template <class MetaAt>
__device__ int32_t check_sources(const DispatchParams& p, const RecvGroups& rg, const MetaLayout& ml,
                                 MetaAt meta_at, int32_t rb) {
  const GroupView& g = p.g;
  const int32_t n_local = g.n_local(), n_ranks = g.n_ranks;
  __shared__ int32_t bad_field, bad_src, bad_value;
  __shared__ unsigned long long routed_rows;  // rows routed here, over every source
  if (threadIdx.x == 0) {
    bad_field = 0;
    routed_rows = 0;
  }
  __syncthreads();
  auto flag = [&](int32_t field, int32_t s, int32_t v) {
    if (atomicCAS(&bad_field, 0, field) == 0) {
      bad_src = s;
      bad_value = v;
    }
  };
  if (threadIdx.x < n_ranks) {
    const int32_t s = threadIdx.x;
    if (rg.stream_count[s] < 0 || rg.stream_count[s] > g.max_tokens)
      flag(kFieldStreamCount, s, rg.stream_count[s]);
    else if (rg.n_chunks[s] < 0 || rg.n_chunks[s] > (g.low_latency ? 0 : ml.max_chunks))
      flag(kFieldChunks, s, rg.n_chunks[s]);  // the low-latency path sends no chunk starts
  }
  // Each thread sums its counts, each warp its threads', one shared atomic per warp (an atomic
  // per count on one word serialised 256 adds per block, a large share of a decode's time).
  unsigned long long mine = 0;
  for (int32_t i = threadIdx.x; i < n_ranks * n_local; i += kThreads) {
    const int32_t s = i / n_local, c = rg.counts[i];
    if (c < 0 || c > rg.stream_count[s])
      flag(kFieldGroupCount, s, c);
    else
      mine += (unsigned long long)c;
  }
  for (int off = kWarpSize / 2; off > 0; off /= 2)
    mine += __shfl_xor_sync(0xffffffffu, mine, off);
  if (threadIdx.x % kWarpSize == 0 && mine != 0) atomicAdd(&routed_rows, mine);
  int32_t most_chunks = g.low_latency ? -1 : 0;  // -1: no chunk starts to check
  for (int32_t s = 0; s < n_ranks && !g.low_latency; ++s)
    most_chunks = max(most_chunks, min(max(rg.n_chunks[s], 0), ml.max_chunks));
  for (int32_t i = threadIdx.x; i < n_ranks * (most_chunks + 1); i += kThreads) {
    const int32_t s = i / (most_chunks + 1), c = i % (most_chunks + 1);
    if (c > rg.n_chunks[s] || rg.n_chunks[s] > ml.max_chunks) continue;
    const volatile int32_t* starts =
        reinterpret_cast<const volatile int32_t*>(meta_at(s) + ml.chunk_start_offset());
    const int32_t v = starts[c];
    if (v < 0 || v > rg.stream_count[s] || (c > 0 && starts[c - 1] > v))
      flag(kFieldChunkStart, s, v);
  }
  __syncthreads();
  int32_t code = bad_field != 0 ? int32_t(ErrorCode::kBadPeerData) : 0;
  const unsigned long long routed = routed_rows;
  if (code == 0 && routed > (unsigned long long)g.max_routed_rows())
    code = int32_t(ErrorCode::kRecvCapacity);
  if (code != 0 && rb == 0 && threadIdx.x == 0) {
    if (code == int32_t(ErrorCode::kBadPeerData)) {
      record_error(g, ErrorCode::kBadPeerData, kOpDispatchRecv, rank_bit(bad_src), -1, -1,
                   bad_value, WaitWhat(bad_field));
    } else {
      RankMask senders = 0;  // the sources with rows for this rank
      for (int32_t i = 0; i < n_ranks * n_local; ++i)
        if (rg.counts[i] > 0) senders |= rank_bit(i / n_local);
      record_error(g, ErrorCode::kRecvCapacity, kOpDispatchRecv, senders, -1, -1,
                   int32_t(min(routed, 0x7fffffffull)), kWaitNone);
    }
  }
  __syncthreads();  // bad_field is read again by the next call of this block
  return code;
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
