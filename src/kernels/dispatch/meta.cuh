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

// The whole block: the rows this rank routes to every rank, from the ranking's totals
// ([q * n_local + j]: tokens for rank q's local group j; null: this rank sends nothing), into
// shared memory, once per call for every record write_meta writes.
__device__ const int32_t* block_rows_to(const GroupView& g, const int32_t* totals) {
  __shared__ int32_t rows_to[WindowLayout::kMaxPeers];
  const int32_t n_local = g.n_local();
  for (int32_t q = threadIdx.x / kWarpSize; q < g.n_ranks; q += kWarps) {
    const int32_t rows = totals ? int32_t(warp_sum(totals + int64_t(q) * n_local, n_local)) : 0;
    if (threadIdx.x % kWarpSize == 0) rows_to[q] = rows;
  }
  __syncthreads();
  return rows_to;
}

// Destination d's meta record of this call, written by one whole warp, from the ranking's
// totals (as block_rows_to takes them; at ExpertMap::rank_key(q): the messages to rank q):
// d's group counts, its message count, n_chunks chunks starting at chunk_start(c) (c <=
// n_chunks), the rows routed to every rank (rows_to, from block_rows_to), then the release of
// its seq word.
template <class ChunkStart>
__device__ void write_meta(const GroupView& g, unsigned long long seq, int32_t d,
                           const int32_t* totals, const int32_t* rows_to, int32_t n_chunks,
                           ChunkStart chunk_start) {
  const int lane = threadIdx.x % kWarpSize;
  const int32_t n_local = g.n_local();
  const MetaLayout ml = g.layout().meta();
  const int64_t at = g.layout().meta_offset(g.rank);
  char* meta = put_buffer(g, d, at, [&] {
    return outbox_at(g, g.outbox_layout().meta_offset(g.nodes().remote_index(g.rank, d)));
  });
  const int32_t stream_count = totals ? totals[g.experts().rank_key(d)] : 0;
  int32_t* counts = reinterpret_cast<int32_t*>(meta + ml.counts_offset());
  for (int32_t j = lane; j < n_local; j += kWarpSize)
    counts[j] = totals ? totals[d * n_local + j] : 0;
  int32_t* rows_out = reinterpret_cast<int32_t*>(meta + ml.rows_to_offset());
  for (int32_t q = lane; q < g.n_ranks; q += kWarpSize) rows_out[q] = rows_to[q];
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
                  ml.payload_bytes(), at + ml.seq_offset(), seq);
}

__device__ void send_meta(const DispatchParams& p, unsigned long long seq, bool bad) {
  const GroupView& g = p.g;
  const int32_t nk = g.experts().num_keys();
  const int warp = threadIdx.x / kWarpSize;
  const int32_t n_units = (p.num_tokens + kUnitTokens - 1) / kUnitTokens;
  const int32_t* totals = p.scratch.unit_prefix + int64_t(n_units) * nk;
  const int32_t* rows_to = block_rows_to(g, bad ? nullptr : totals);
  for (int32_t d = warp; d < g.n_ranks; d += kWarps)
    write_meta(g, seq, d, bad ? nullptr : totals, rows_to, bad ? 0 : num_chunks(p.num_tokens),
               [&](int32_t c) { return stream_chunk_start(p, c, d); });
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
// rows routed to every rank within the receive capacity (Config::max_routed_rows), summed from
// the rows_to of every source's record: every rank reads the same records, so when one rank
// would receive too many rows, every rank finds it and writes no row. Every receiving block
// finds the same verdict; block rb == 0 records the error. Returns 0, kBadPeerData or
// kRecvCapacity.
template <class MetaAt>
__device__ int32_t check_sources(const DispatchParams& p, const RecvGroups& rg, const MetaLayout& ml,
                                 MetaAt meta_at, int32_t rb) {
  const GroupView& g = p.g;
  const int32_t n_local = g.n_local(), n_ranks = g.n_ranks;
  __shared__ int32_t bad_field, bad_src, bad_value;
  __shared__ unsigned long long routed_to[WindowLayout::kMaxPeers];  // to each rank, announced
  if (threadIdx.x == 0) bad_field = 0;
  if (threadIdx.x < n_ranks) routed_to[threadIdx.x] = 0;
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
  for (int32_t i = threadIdx.x; i < n_ranks * n_local; i += kThreads) {
    const int32_t s = g.n_local_div.div(i), c = rg.counts[i];
    if (c < 0 || c > rg.stream_count[s]) flag(kFieldGroupCount, s, c);
  }
  // Every source's rows to every rank, one warp per source and one shared add per (source,
  // rank) with rows (an add per count on one word serialised a block's adds, a large share of a
  // decode's time); for this rank they must be what the source's counts add up to.
  for (int32_t s = threadIdx.x / kWarpSize; s < n_ranks; s += kWarps) {
    const int64_t here = warp_sum(rg.counts + s * n_local, n_local);
    const volatile int32_t* rows_to =
        reinterpret_cast<const volatile int32_t*>(meta_at(s) + ml.rows_to_offset());
    for (int32_t q = threadIdx.x % kWarpSize; q < n_ranks; q += kWarpSize) {
      const int32_t v = rows_to[q];
      // (A source routes at most max_tokens x K rows to any rank; its stream_count is only
      // what it sends here.)
      if (v < 0 || int64_t(v) > int64_t(g.max_tokens) * g.top_k || (q == g.rank && v != here))
        flag(kFieldRowsTo, s, v);
      else if (v != 0)
        atomicAdd(&routed_to[q], (unsigned long long)v);
    }
  }
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
  RankMask over = 0;  // the ranks routed more rows than their capacity
  unsigned long long most = 0;
  for (int32_t q = 0; q < n_ranks; ++q)
    if (routed_to[q] > (unsigned long long)g.max_routed_rows()) {
      over |= rank_bit(q);
      most = max(most, routed_to[q]);
    }
  if (code == 0 && over != 0) code = int32_t(ErrorCode::kRecvCapacity);
  if (code != 0 && rb == 0 && threadIdx.x == 0) {
    if (code == int32_t(ErrorCode::kBadPeerData)) {
      record_error(g, ErrorCode::kBadPeerData, kOpDispatchRecv, rank_bit(bad_src), -1, -1,
                   bad_value, WaitWhat(bad_field));
    } else {
      record_error(g, ErrorCode::kRecvCapacity, kOpDispatchRecv, over, -1, -1,
                   int32_t(min(most, 0x7fffffffull)), kWaitNone);
    }
  }
  __syncthreads();  // bad_field is read again by the next call of this block
  return code;
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
