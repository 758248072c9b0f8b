// The communication window's byte layout (internal): the messages of dispatch, the meta records,
// the signal words and arrival flags, the receive buffers of dispatch and combine, and the outbox
// of a group that spans nodes (with NodeMap, the nodes of a group); and GroupRows, the receiving
// kernel's row bookkeeping. The kernels and the runtime use it (through epcomm/detail/params.h);
// users never need it. Each is a small value type whose index
// arithmetic is written once here and unit-tested on the CPU (tests/cpu/test_layout.cpp).
// Everything is usable from host and device code.
#pragma once

#include <cstdint>

#include "epcomm/hd.h"
#include "epcomm/token_format.h"

namespace epcomm {
namespace detail {

// One dispatch message: a routing header, then the token payload; the header and the message
// padded to multiples of 128 bytes (MessageLayout::kAlign), the payload's parts 16-byte aligned.
//   header: int32 token, int16 n_entries, int16 rank_slot, then n_entries x
//   {int32 group | slot << 16, int32 pos, float weight}, top-k slot ascending, where `pos` is
//   the token's position among the source's tokens routed to that group, `weight` the router
//   weight of that slot (0 when the dispatch carries none) and `rank_slot` the destination's
//   index among the ranks the token goes to, ascending (rank_slot_of): where the expert-side
//   combine returns the destination's pre-summed row.
struct MessageEntry {
  int32_t group_slot;
  int32_t pos;
  float weight;
  EPCOMM_HD static MessageEntry make(int32_t group, int32_t slot, int32_t pos, float weight) {
    return MessageEntry{group | (slot << 16), pos, weight};
  }
  EPCOMM_HD int32_t group() const { return group_slot & 0xffff; }
  EPCOMM_HD int32_t slot() const { return group_slot >> 16; }
};

struct MessageHeader {
  int32_t token;
  int16_t n_entries;
  int16_t rank_slot;
  MessageEntry entries[1];  // really n_entries (<= top_k)
};

// Rank d's index among the ranks of `rank_mask` (bit r set: the token goes to rank r), ascending.
EPCOMM_HD constexpr int32_t rank_slot_of(unsigned long long rank_mask, int32_t d) {
  unsigned long long below = rank_mask & ((1ull << d) - 1ull);
  int32_t n = 0;
  for (; below; below &= below - 1ull)
    ++n;
  return n;
}

//   payload: the token's codes in the format (bf16: the token itself), then for the quantised
//   formats its scales in row order (fp32 or one byte each), each part 16-byte aligned.
// A message, and its payload, start on a 128-byte line: a warp's 512 bytes of a row then touch
// 4 lines, not 5, and no 32-byte sector is split between two store instructions (with the
// header packed to 16 bytes, every payload began 16 bytes into a sector).
struct MessageLayout {
  static constexpr int64_t kAlign = 128;
  int32_t hidden;
  int32_t top_k;
  TokenFormat format;

  EPCOMM_HD int64_t header_bytes() const {
    return align_up(8 + int64_t(sizeof(MessageEntry)) * top_k, kAlign);
  }
  EPCOMM_HD int64_t codes_bytes() const { return align_up(format_row_bytes(format, hidden), 16); }
  EPCOMM_HD int64_t scales_bytes() const {
    return align_up(int64_t(format_scales_per_row(format, hidden)) * format_scale_bytes(format),
                    16);
  }
  EPCOMM_HD int64_t payload_offset() const { return header_bytes(); }
  EPCOMM_HD int64_t scales_offset() const { return header_bytes() + codes_bytes(); }
  EPCOMM_HD int64_t payload_bytes() const { return codes_bytes() + scales_bytes(); }
  EPCOMM_HD int64_t bytes() const { return align_up(header_bytes() + payload_bytes(), kAlign); }
  // What the puts of one message to a rank of another node carry: the whole message on the
  // throughput path (one put); on the low-latency path the header and each part's codes and
  // scales (one put each, so the sum of part_codes_bytes and part_scales_bytes: no padding).
  EPCOMM_HD int64_t put_bytes(bool low_latency) const {
    return low_latency
               ? header_bytes() + format_row_bytes(format, hidden) +
                     int64_t(format_scales_per_row(format, hidden)) * format_scale_bytes(format)
               : bytes();
  }
  // Byte ranges of the low-latency path's part p (values [p * kPartValues, ...), see below)
  // inside a message: its codes and its scales (empty for bf16).
  EPCOMM_HD int64_t part_codes_offset(int32_t p) const;
  EPCOMM_HD int64_t part_codes_bytes(int32_t p) const;
  EPCOMM_HD int64_t part_scales_offset(int32_t p) const;
  EPCOMM_HD int64_t part_scales_bytes(int32_t p) const;
};

// The dispatch receive buffer of one rank: a stream of messages per source rank; message i of
// source s is the i-th token of s (in token order) routed to this rank.
struct DispatchRecvLayout {
  MessageLayout msg;
  int32_t max_tokens;

  EPCOMM_HD int64_t offset(int32_t src, int32_t i) const {
    return (int64_t(src) * max_tokens + i) * msg.bytes();
  }
  EPCOMM_HD int64_t bytes(int32_t n_ranks) const { return int64_t(n_ranks) * max_tokens * msg.bytes(); }
};

// Tokens are sent in chunks of kChunkTokens consecutive tokens: chunk c is tokens
// [c * kChunkTokens, (c + 1) * kChunkTokens). A chunk's messages to one destination are
// consecutive in its stream (streams are in token order), and the sender raises the chunk's
// arrival flag in the destination once they are all stored, so the destination can expand a
// chunk while later ones are still on the way.
constexpr int32_t kChunkTokens = 16;
EPCOMM_HD constexpr int32_t num_chunks(int32_t tokens) {
  return (tokens + kChunkTokens - 1) / kChunkTokens;
}

// The low-latency path (Config::dispatch_path) sends each message in parts of kPartValues
// hidden values (the last part may be shorter): part p carries the codes of values
// [p * kPartValues, (p + 1) * kPartValues) and their scales, stored by one warp and announced by
// its own arrival flag, so a warp can take one part of one message at each end of the wire.
constexpr int32_t kPartValues = 1024;
EPCOMM_HD constexpr int32_t num_parts(int32_t hidden) {
  return (hidden + kPartValues - 1) / kPartValues;
}
EPCOMM_HD int64_t MessageLayout::part_codes_offset(int32_t p) const {
  return payload_offset() + format_row_bytes(format, p * kPartValues);
}
EPCOMM_HD int64_t MessageLayout::part_codes_bytes(int32_t p) const {
  const int32_t end = (p + 1) * kPartValues < hidden ? (p + 1) * kPartValues : hidden;
  return format_row_bytes(format, end) - format_row_bytes(format, p * kPartValues);
}
EPCOMM_HD int64_t MessageLayout::part_scales_offset(int32_t p) const {
  return scales_offset() +
         int64_t(format_scales_per_row(format, p * kPartValues)) * format_scale_bytes(format);
}
EPCOMM_HD int64_t MessageLayout::part_scales_bytes(int32_t p) const {
  const int32_t end = (p + 1) * kPartValues < hidden ? (p + 1) * kPartValues : hidden;
  return int64_t(format_scales_per_row(format, end) -
                 format_scales_per_row(format, p * kPartValues)) *
         format_scale_bytes(format);
}

// What a source tells each destination before its tokens: how many messages it sends, how many
// of them land in each local group, and where each chunk's messages start in its stream. `seq`
// is written last (release) and marks the record valid for that call.
struct MetaLayout {
  int32_t n_local;
  int32_t max_chunks;  // num_chunks(max_tokens)
  int32_t n_ranks;

  // u64 seq, i32 stream_count, i32 n_chunks, i32 counts[n_local],
  // i32 chunk_start[max_chunks + 1] (chunk_start[n_chunks] = stream_count),
  // i32 rows_to[n_ranks]: the rows the sender routes to every rank (the same in each of its
  // records), so every receiver judges every rank's receive capacity alike.
  EPCOMM_HD int64_t bytes() const {
    return align_up(rows_to_offset() + 4 * int64_t(n_ranks), 16);
  }
  // What a put to another node carries: the record after its seq word (the seq goes last, as
  // the put's signal, and is counted as a signal, not as data).
  EPCOMM_HD int64_t payload_bytes() const { return bytes() - stream_count_offset(); }
  EPCOMM_HD int64_t rows_to_offset() const {
    return 16 + 4 * int64_t(n_local) + 4 * (int64_t(max_chunks) + 1);
  }
  EPCOMM_HD static int64_t seq_offset() { return 0; }
  EPCOMM_HD static int64_t stream_count_offset() { return 8; }
  EPCOMM_HD static int64_t n_chunks_offset() { return 12; }
  EPCOMM_HD static int64_t counts_offset() { return 16; }
  EPCOMM_HD int64_t chunk_start_offset() const { return 16 + 4 * int64_t(n_local); }
};

// The combine receive buffer of one rank: one row per (token, top-k slot); with the
// expert-side reduction, one pre-summed row per (token, rank slot) (rank_slot_of; fewer than
// min(K, n_ranks) <= K per token, so the same rows serve).
struct CombineRecvLayout {
  int32_t hidden;
  int32_t top_k;
  int32_t max_tokens;

  EPCOMM_HD int64_t row_bytes() const { return align_up(int64_t(hidden) * 2, 16); }
  EPCOMM_HD int64_t offset(int32_t token, int32_t slot) const {
    return (int64_t(token) * top_k + slot) * row_bytes();
  }
  EPCOMM_HD int64_t bytes() const { return int64_t(max_tokens) * top_k * row_bytes(); }
};

// The symmetric window every rank allocates and every peer maps: the same offsets on all ranks.
// Signals and chunk flags (monotonic u64 counters, zeroed once at set-up) and the meta records
// come first so one memset clears them. The constructor works out where the regions after the
// signals begin, once: the kernels get the layout built on the host (GroupView::window), where
// each offset worked out again in device code was a chain of 64-bit arithmetic on every
// message's path (several hundred instructions a warp in decode's dispatch; Nsight Compute's
// source page, 2026-11-27).
struct WindowLayout {
  int32_t n_ranks;
  int32_t hidden;
  int32_t top_k;
  int32_t n_experts;
  int32_t max_tokens;
  TokenFormat format;
  int32_t low_latency;  // the low-latency path's part flags are allocated
  MetaLayout meta_layout;
  int64_t meta_bytes;        // meta_layout.bytes()
  int64_t part_flags_begin;  // chunk_flags_end()
  int64_t meta_begin;        // part_flags_end()
  int64_t recv_begin;        // meta_region_end()

  WindowLayout() = default;
  EPCOMM_HD WindowLayout(int32_t ranks, int32_t hidden_size, int32_t k, int32_t experts,
                         int32_t tokens, TokenFormat f, int32_t ll)
      : n_ranks(ranks),
        hidden(hidden_size),
        top_k(k),
        n_experts(experts),
        max_tokens(tokens),
        format(f),
        low_latency(ll),
        meta_layout{per_rank_count(experts, ranks), num_chunks(tokens), ranks} {
    meta_bytes = meta_layout.bytes();
    part_flags_begin = align_up(chunk_flag_offset(n_ranks, 0), 256);
    meta_begin = low_latency ? align_up(part_flag_offset(n_ranks, 0, 0), 256) : part_flags_begin;
    recv_begin = align_up(meta_begin + int64_t(n_ranks) * meta_bytes, 256);
  }

  EPCOMM_HD MessageLayout msg() const { return MessageLayout{hidden, top_k, format}; }
  EPCOMM_HD DispatchRecvLayout dispatch_recv() const { return DispatchRecvLayout{msg(), max_tokens}; }
  EPCOMM_HD MetaLayout meta() const { return meta_layout; }
  EPCOMM_HD CombineRecvLayout combine_recv() const {
    return CombineRecvLayout{hidden, top_k, max_tokens};
  }

  // Signal words, each u64 indexed by peer rank.
  // Dispatch data has no signal word: its arrival is announced per chunk (chunk_flag_offset),
  // or per part on the low-latency path (part_flag_offset).
  enum Signal : int32_t {
    kDispatchAck = 0,     // [dst]: last call whose receive buffer dst has finished reading
    kCombineArrived = 1,  // [src]: blocks of src that finished sending combine rows to me
    kCombineAck = 2,      // [dst]: last call whose combine buffer dst has finished reading
    kNumSignals = 3
  };
  EPCOMM_HD int64_t signal_offset(Signal s, int32_t peer) const {
    return (int64_t(s) * kMaxPeers + peer) * 8;
  }
  EPCOMM_HD int64_t signals_bytes() const { return align_up(int64_t(kNumSignals) * kMaxPeers * 8, 256); }
  // Chunk arrival flags: u64 [src][chunk] = the last call whose chunk of src has arrived.
  EPCOMM_HD int64_t chunk_flag_offset(int32_t src, int32_t chunk) const {
    return signals_bytes() + (int64_t(src) * num_chunks(max_tokens) + chunk) * 8;
  }
  EPCOMM_HD int64_t chunk_flags_end() const { return part_flags_begin; }
  // Low-latency path: part arrival flags, u64 [src][message][part] = the last call whose part
  // `part` of message m of src has arrived (none unless low_latency).
  EPCOMM_HD int64_t part_flag_offset(int32_t src, int32_t m, int32_t part) const {
    return part_flags_begin + ((int64_t(src) * max_tokens + m) * num_parts(hidden) + part) * 8;
  }
  EPCOMM_HD int64_t part_flags_end() const { return meta_begin; }
  EPCOMM_HD int64_t meta_offset(int32_t src) const { return meta_begin + src * meta_bytes; }
  EPCOMM_HD int64_t meta_region_end() const { return recv_begin; }
  EPCOMM_HD int64_t dispatch_recv_offset() const { return meta_region_end(); }
  EPCOMM_HD int64_t combine_recv_offset() const {
    return align_up(dispatch_recv_offset() + dispatch_recv().bytes(n_ranks), 256);
  }
  EPCOMM_HD int64_t bytes() const {
    return align_up(combine_recv_offset() + combine_recv().bytes(), 256);
  }
  // Bytes that must be zero before first use (signals and meta records).
  EPCOMM_HD int64_t zeroed_bytes() const { return meta_region_end(); }

  static constexpr int32_t kMaxPeers = 64;
};

// Nodes of a group (Config::ranks_per_node): rank r is local rank r % ranks_per_node of node
// r / ranks_per_node. Ranks of one node reach each other's windows by loads and stores; traffic
// to a rank of another node goes through NVSHMEM (puts into the peer's window, then a signal).
struct NodeMap {
  int32_t n_ranks;
  int32_t ranks_per_node;  // divides n_ranks; n_ranks: one node

  EPCOMM_HD int32_t node_of(int32_t r) const { return r / ranks_per_node; }
  EPCOMM_HD int32_t local_of(int32_t r) const { return r % ranks_per_node; }
  EPCOMM_HD int32_t n_nodes() const { return n_ranks / ranks_per_node; }
  EPCOMM_HD bool remote(int32_t me, int32_t peer) const { return node_of(me) != node_of(peer); }
  EPCOMM_HD int32_t n_remote() const { return n_ranks - ranks_per_node; }
  // The ranks of `ranks` (bit r: rank r) in node `node`, by local index (bit j: local rank j).
  EPCOMM_HD unsigned long long local_ranks(unsigned long long ranks, int32_t node) const {
    const unsigned long long all = ranks_per_node >= 64 ? ~0ull : (1ull << ranks_per_node) - 1ull;
    return (ranks >> (node * ranks_per_node)) & all;
  }
  // Index of a rank of another node among the ranks of other nodes, in rank order.
  EPCOMM_HD int32_t remote_index(int32_t me, int32_t peer) const {
    return peer < node_of(me) * ranks_per_node ? peer : peer - ranks_per_node;
  }
};

// Where a rank stages what it sends to ranks of other nodes (allocated after its window, in the
// same NVSHMEM allocation; none when the group is one node). The put's source must be memory
// NVSHMEM can read on every transport, so rows are written here, then put.
//   per remote rank i: the meta record for it, then its message stream (the same layout as the
//   slice of its receive buffer that holds this rank's messages, so a chunk is one put);
//   then combine rows (bf16, CombineRecvLayout::row_bytes each): the token side stages output
//   row r at row r, the expert side the pre-summed row of message m of remote source i at row
//   i * max_tokens + m.
struct OutboxLayout {
  WindowLayout window;
  int32_t n_remote;
  int64_t combine_rows;  // max(routed output rows, n_remote * max_tokens)

  // The meta record's share of a peer's slice, padded so that the staged messages start on a
  // line, as they do in the window (MessageLayout::kAlign).
  EPCOMM_HD int64_t meta_bytes() const {
    return align_up(window.meta().bytes(), MessageLayout::kAlign);
  }
  EPCOMM_HD int64_t peer_bytes() const {
    return align_up(meta_bytes() + window.dispatch_recv().bytes(1), 256);
  }
  EPCOMM_HD int64_t meta_offset(int32_t i) const { return i * peer_bytes(); }
  EPCOMM_HD int64_t stream_offset(int32_t i) const { return i * peer_bytes() + meta_bytes(); }
  EPCOMM_HD int64_t combine_offset(int64_t row) const {
    return n_remote * peer_bytes() + row * window.combine_recv().row_bytes();
  }
  EPCOMM_HD int64_t bytes() const {
    return n_remote == 0 ? 0 : align_up(combine_offset(combine_rows), 256);
  }
};

// Rows of the dispatch output, group by group: group g holds rows [row_offsets[g],
// row_offsets[g+1]), and within it the rows of source s start at base(s, g). `counts` is
// [n_ranks][n_local]: tokens source s sends to group g. Used by the receiving kernel (one thread
// per group).
struct GroupRows {
  const int32_t* counts;
  int32_t n_ranks;
  int32_t n_local;

  EPCOMM_HD int32_t group_total(int32_t g) const {
    int32_t total = 0;
    for (int32_t s = 0; s < n_ranks; ++s) total += counts[s * n_local + g];
    return total;
  }
  // Offset of source s's rows inside group g.
  EPCOMM_HD int32_t source_offset(int32_t s, int32_t g) const {
    int32_t off = 0;
    for (int32_t p = 0; p < s; ++p) off += counts[p * n_local + g];
    return off;
  }
};

}  // namespace detail
}  // namespace epcomm
