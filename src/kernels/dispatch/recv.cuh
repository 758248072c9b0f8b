// Dispatch stage 4, receive: wait for every source's meta record, lay out the output (row_offsets
// with the format's padding, each (source, group) base row; padding rows and unused scale slots
// written before any data), then expand each chunk (or, on the low-latency path, each part) as
// its flag arrives: one read of the message, up to K output rows.
//
// Who waits on what: a warp waits on one chunk flag of one source (or a part's flag and part
// 0's, which carries the header), so rows are expanded while later chunks are still in flight;
// where this rank's own messages stay in place (self_in_place), its own items wait on nothing
// (expand_own: the route comes from the ranking, the row from the caller's input).
// The throughput path's warps take items from a per-call counter (recv_item[seq & 1]) rather than
// by index, so senders that are done join and a warp that waited long holds no items others
// could take; receiver block 0 zeroes the next call's counter (no two receives of a group
// overlap), the one reset of the protocol. The last block to finish releases kDispatchAck = seq
// in every source: its receive buffer here is free for the next call (stage 2 waits on it).
#pragma once

#include <cub/block/block_scan.cuh>

#include "epcomm/detail/bulk.cuh"
#include "epcomm/detail/transport.cuh"
#include "kernels/dispatch/common.cuh"
#include "kernels/dispatch/meta.cuh"
#include "kernels/dispatch/send.cuh"

namespace epcomm {
namespace detail {
namespace {

// The scales of one message part (scale columns [c_begin, c_end); c_end = the row's scale count:
// the rest of the row too) and where they go in the format's output layout. A part's scales are
// units of one 32-bit word: FP8 one float scale (in the padded layout with UE8M0, one word of four
// exponents), MXFP4 one byte, the swizzled formats one word of four byte columns (columns past
// the row's count are zero). The warp loads each unit once and stores it to each of the message's
// rows: one load's latency a part, not one a row. kPadded: the padded layout (GroupView::capacity >
// 0), a template argument so the packed kernels carry none of it.
template <TokenFormat F, bool kPadded>
struct PartScales {
  // A low-latency part (kPartValues values) starts on a word of 4 scale columns: the UE8M0 and
  // swizzled units are such words.
  static_assert(kPartValues % (4 * format_scale_group(F)) == 0, "a part starts on a scale word");
  const RecvGroups& rg;
  const char* src;  // the message's scales
  void* dst;        // the scales output
  DispatchOutputLayout out;
  int32_t cols;        // scale columns of a row
  int32_t begin, end;  // units

  __device__ PartScales(const DispatchParams& params, const RecvGroups& groups, const char* scales,
                        int32_t c_begin, int32_t c_end)
      : rg(groups),
        src(scales),
        dst(params.out_scales),
        out(params.g.output()),
        cols(format_scales_per_row(F, params.g.hidden)) {
    if constexpr (F == TokenFormat::kFp8Blockwise) {
      // UE8M0 words of 4 scales: c_begin and c_end are multiples of 4 (H % 512)
      const bool words = kPadded && out.ue8m0;
      begin = words ? c_begin / 4 : c_begin;
      end = words ? c_end / 4 : c_end;
    } else if constexpr (F == TokenFormat::kMxfp4) {
      begin = c_begin;
      end = c_end;
    } else {
      constexpr int32_t kCols = SwizzledScaleLayout::kTileCols;
      begin = c_begin / kCols;
      end = c_end >= cols ? out.swizzled().col_tiles() : c_end / kCols;
    }
  }

  __device__ uint32_t load(int32_t u) const {
    if constexpr (F == TokenFormat::kFp8Blockwise) {
      const float* s = reinterpret_cast<const float*>(src);
      if (kPadded && out.ue8m0)
        return Fp8BlockQuant::ue8m0_word(s[4 * u], s[4 * u + 1], s[4 * u + 2], s[4 * u + 3]);
      return __float_as_uint(s[u]);
    } else if constexpr (F == TokenFormat::kMxfp4) {
      return reinterpret_cast<const uint8_t*>(src)[u];
    } else {
      const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < SwizzledScaleLayout::kTileCols; ++i) {
        const int32_t c = u * SwizzledScaleLayout::kTileCols + i;
        if (c < cols) word |= uint32_t(s[c]) << (8 * i);
      }
      return word;
    }
  }

  // Unit u of output row `row` (the tokens output's row: in the padded layout, the slot's) of
  // group grp.
  __device__ void store(uint32_t v, int64_t row, int32_t grp, int32_t u) const {
    if constexpr (F == TokenFormat::kFp8Blockwise) {
      uint32_t* d = static_cast<uint32_t*>(dst);
      if constexpr (kPadded) {  // `row` is the slot's: slot j of group grp
        const int64_t j = row - int64_t(grp) * out.capacity;
        if (out.ue8m0) {
          const Ue8m0ScaleLayout w = out.ue8m0_words();
          d[int64_t(grp) * w.size() + w.offset(j, u)] = v;
        } else {
          const Fp8ScaleLayout l = out.fp8();
          d[int64_t(grp) * l.size() + l.offset(j, u)] = v;
        }
      } else {
        d[out.fp8().offset(row, u)] = v;
      }
    } else if constexpr (F == TokenFormat::kMxfp4) {
      static_cast<uint8_t*>(dst)[out.mxfp4().offset(row, u)] = uint8_t(v);
    } else {
      const int64_t scale_row =
          int64_t(rg.tile_start[grp]) * SwizzledScaleLayout::kTileRows + (row - rg.row_offset[grp]);
      *reinterpret_cast<uint32_t*>(
          static_cast<uint8_t*>(dst) +
          out.swizzled().offset(scale_row, u * SwizzledScaleLayout::kTileCols)) = v;
    }
  }

  // Every unit to each of the n rows lane j < n names (`at`, `grp`; at < 0: no row). Called by
  // the whole warp.
  __device__ void place(int32_t n, int64_t at, int32_t grp) const {
    const int lane = threadIdx.x % kWarpSize;
    for (int32_t u0 = begin; u0 < end; u0 += kWarpSize) {
      const int32_t u = u0 + lane;
      const uint32_t v = u < end ? load(u) : 0u;
      for (int32_t j = 0; j < n; ++j) {
        const int64_t r = __shfl_sync(0xffffffffu, at, j);
        const int32_t gj = __shfl_sync(0xffffffffu, grp, j);
        if (r >= 0 && u < end) store(v, r, gj, u);
      }
    }
  }
};

// The throughput receive's bulk-copy ring, for the quantised formats: one shared-memory slot per
// warp that holds a message's payload (codes, then scales). The warp's lane 0 loads the payload
// with one bulk copy, issued before the header is read, and stores the codes to each of the
// message's rows with one bulk copy a row; the lanes store the scales from the slot. The copy
// engine keeps a message's K rows in flight with no register held, where a register copy holds
// 8 loads a lane and issues K stores per load. Laid out after the receive's RecvGroups (the send's
// shared memory is free once a block receives): kWarps mbarriers, then kWarps slots on 128-byte
// lines. Used only where every slot fits kMaxBytes; where they do not (bf16 rows of H 7168; FP8
// from H of about 12 K) the receive keeps the register copy.
struct RecvRing {
  static constexpr int64_t kMaxBytes = 192 * 1024;
  static constexpr int64_t kBarBytes = (kWarps * 8 + 127) / 128 * 128;  // the mbarriers' lines
  // The receive's RecvGroups, which the ring follows.
  __host__ __device__ static int64_t groups_bytes(const GroupView& g) {
    return int64_t(sizeof(int32_t)) * RecvGroups::smem_words(g.n_ranks, g.n_local());
  }
  __host__ __device__ static int64_t offset(const GroupView& g) {
    return align_up(groups_bytes(g), 128);
  }
  __host__ __device__ static int64_t slot_bytes(const GroupView& g) {
    return align_up(g.layout().msg().payload_bytes(), 128);
  }
  __host__ __device__ static int64_t bytes(const GroupView& g) {
    return kBarBytes + int64_t(kWarps) * slot_bytes(g);
  }
  __host__ __device__ static bool used(const GroupView& g) {
    return !g.low_latency && g.format != TokenFormat::kBF16 && offset(g) + bytes(g) <= kMaxBytes;
  }
  // The end of the receive's shared memory.
  __host__ __device__ static int64_t end(const GroupView& g) {
    return used(g) ? offset(g) + bytes(g) : groups_bytes(g);
  }
};

// Whether this rank's own messages carry no payload: in the fused kernel (send and receive one
// launch, so the caller's input is there throughout) of the throughput path, a message to this
// rank is not sent at all: the receive takes the token's route from the ranking, writes the
// header itself (expand_own) and reads the row from p.tokens. bf16 copies it: that
// saves the send a read and a write of every own row (all of them with one rank, 1 / R of them
// with R), which the send, bound by its warps' loads in flight, took longer over than the
// receive's K-row expansion per byte. The quantised formats do it in a group of one rank (a
// skip_a2a group's view among them) where the ring is used (solo_in_place): the receive
// quantises the row into its ring slot and stores it from there as it stores a received payload,
// and the send writes nothing but the meta record. That group has fused kernels of its own (kSolo),
// so the quantiser's registers (the receive spilled 8-72 B with it) stay out of every other kernel:
// with it compiled into all of them, 2-rank FP8 prefill dispatch was 0.8% slower and one-rank
// async + wait 0.7% (2 x H200, 2026-11-27). With more ranks most tokens also go to another rank,
// so their row would be quantised twice (by the sender for the others, by the receive for this
// rank): that took 2-rank gpt-oss dispatch from 99 to 122 us and decode from 74 to 81. The split
// form keeps the copy: between dispatch_async and dispatch_wait the caller may reuse its input;
// the low-latency path keeps it too.
__host__ __device__ inline bool solo_in_place(const GroupView& g) {
  return !g.low_latency && g.format != TokenFormat::kBF16 && g.n_ranks == 1 && RecvRing::used(g);
}
// In the fused kernel of format F (kSolo: the kernel of a solo_in_place group).
template <TokenFormat F, bool kSolo>
__device__ __forceinline__ bool self_in_place(const GroupView& g) {
  return F == TokenFormat::kBF16 ? !g.low_latency : kSolo && RecvRing::used(g);
}

// Whether the kernel stashes its rows' scales and places them after a grid barrier
// (place_stashed_scales): the solo kernel of blockwise FP8 in the packed layout. There the
// output's scales are column-major (scale c of row r at c * ld + r), and a token's rows sit in K
// groups, so storing a token's scales to its rows is a 4-byte store to its own 32-byte sector
// for each (scale, row): 448 sectors a token at H 7168, K 8, where its codes take 1,792. Nsight
// Compute had the solo kernel's L1/TEX unit over 90 % busy, as the floor kernel's, at 1.6x the
// floor's time (one H100, 8 SMs, docs/results/2026-11-27_h100_floor_matrix_df53c6c.md). Rows
// of one group come from tokens about N / K apart, so no warp that quantises a token can gather
// a sector of one column; after the barrier a warp takes 32 adjacent rows and stores each column
// of them in one 128-byte run (4 or 5 sectors: ld is a multiple of 4 floats, not of 32). Every
// call of that kernel does it, decode-sized ones too (their barrier costs a few µs; a gate on the
// token count kept both ways of placing scales live in the expansion and spilled it 36 B).
template <TokenFormat F, bool kPadded, bool kSolo>
__host__ __device__ constexpr bool stash_scales() {
  return kSolo && F == TokenFormat::kFp8Blockwise && !kPadded;
}

// This warp's slot of the ring (data == nullptr: no ring) and the phase its barrier is in.
struct RingSlot {
  char* data = nullptr;
  uint64_t* bar = nullptr;
  uint32_t phase = 0;

  // Whole warp, once per kernel (shared memory starts undefined).
  __device__ static RingSlot carve(const GroupView& g, char* smem) {
    RingSlot r;
    if (!RecvRing::used(g)) return r;
    const int32_t w = int32_t(threadIdx.x / kWarpSize);
    char* base = smem + RecvRing::offset(g);
    r.bar = reinterpret_cast<uint64_t*>(base) + w;
    r.data = base + RecvRing::kBarBytes + int64_t(w) * RecvRing::slot_bytes(g);
    if (threadIdx.x % kWarpSize == 0) mbar_init(r.bar);
    __syncwarp();
    return r;
  }
  // Lane 0: bring `bytes` at src into the slot, once the previous message's stores have read it.
  __device__ void load(const char* src, uint32_t bytes) {
    bulk_wait_read<0>();
    fence_proxy_async_smem();    // the lanes' reads of the previous scales, before the refill
    fence_proxy_async_global();  // the chunk's bytes, acquired through its flag
    mbar_expect(bar, bytes);
    bulk_load(data, src, bytes, bar);
  }
  // Whole warp: until the load has landed.
  __device__ void wait() {
    mbar_wait(bar, phase);
    phase ^= 1u;
  }
  // Lane 0: every store issued, until they are complete.
  __device__ void drain() const {
    if (data != nullptr && threadIdx.x % kWarpSize == 0) bulk_wait<0>();
    __syncwarp();
  }
};

// The whole warp: quantises this rank's bf16 row into a ring slot, laid out as a message's
// payload.
template <TokenFormat F>
__device__ __forceinline__ void quantize_into_slot(const GroupView& g, const uint16_t* row,
                                                char* slot) {
  Dests d;
  d.add(g.rank, 0, slot);
  quantize_to<F, true>(row, g.hidden, g.nvfp4_global_scale, g.fp8_pow2 != 0, g.layout().msg(), d, 0,
                       g.hidden / kLaneValues);
}

// This rank's own message as the receive built it from the token's route (expand_own), not
// read from a header: the token, its entry count, and lane i's entry i.
struct OwnEntries {
  int32_t token;
  int32_t n;
  MessageEntry e;
};

// Expands units [unit_begin, unit_end) of message m of source src (8 values each: the whole
// message, or one part) into its rows: one wire copy, up to K output rows; the part at unit 0
// also writes the rows' src_info. `in_place` (self_in_place): this rank's own messages were not
// sent, their rows are read from p.tokens (the quantised formats quantise them into the ring's
// slot) and `own` gives their entries. `ring`: this warp's slot of the bulk-copy ring (quantised
// formats, whole messages; see RecvRing), or none. Called by the whole warp.
template <TokenFormat F, bool kPadded, bool kSolo = false>
__device__ void expand_message(const DispatchParams& p, const RecvGroups& rg, int32_t src,
                               int32_t m, int32_t unit_begin, int32_t unit_end,
                               bool in_place = false, RingSlot* ring = nullptr,
                               const OwnEntries* own = nullptr) {
  const GroupView& g = p.g;
  const WindowLayout wl = g.layout();
  const MessageLayout ml = wl.msg();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t n_local = g.n_local();
  const int64_t row_bytes = format_row_bytes(F, g.hidden);  // a multiple of 16 (Config)
  const DispatchOutputLayout layout = g.output();
  const int64_t row_limit = layout.rows;
  // In the padded layout the tokens output's row of a dispatch row is its slot's (GroupSlots,
  // over this call's row_offsets in shared memory).
  const GroupSlots slots{reinterpret_cast<const uint32_t*>(rg.row_offset), n_local,
                         layout.capacity};
  char* out = static_cast<char*>(p.out_tokens);

  const char* msg = window_at(g, g.rank, wl.dispatch_recv_offset() + wl.dispatch_recv().offset(src, m));
  const int32_t units = g.hidden / kLaneValues;
  // The ring takes whole messages of the quantised formats.
  const bool bulk = F != TokenFormat::kBF16 && ring != nullptr && ring->data != nullptr &&
                    unit_begin == 0 && unit_end >= units;
  in_place = (F == TokenFormat::kBF16 || (kSolo && bulk)) && in_place && src == g.rank;
  // A whole message: its payload into the slot (or into L2) at once, while the header is read.
  if (lane == 0 && bulk && !in_place)
    ring->load(msg + ml.payload_offset(), uint32_t(ml.payload_bytes()));
  else if (lane == 0 && unit_begin == 0 && unit_end >= units && !in_place)
    prefetch_l2(msg + ml.payload_offset(), uint32_t(align_up(ml.payload_bytes(), 16)));
  const MessageHeader* h = reinterpret_cast<const MessageHeader*>(msg);
  MessageEntry e{};
  int32_t token, n;
  if (own != nullptr) {
    e = own->e;
    token = own->token;
    n = own->n;
  } else {
    if (lane < g.top_k) e = h->entries[lane];  // with the header's words: one round trip
    token = h->token;
    n = min(int32_t(h->n_entries), g.top_k);
  }
  // The row's bytes: the message's payload, or (in place) the caller's row, which `own` names
  // (a token out of range writes no row). An own message is never sent: without in_place its
  // payload would be unwritten bytes.
  if (own != nullptr && !in_place) return;
  const char* payload = msg + ml.payload_offset();
  if (in_place) {
    const bool ok = token >= 0 && token < p.num_tokens;
    payload = ok ? static_cast<const char*>(p.tokens) + int64_t(token) * g.hidden * 2 : nullptr;
    if (lane == 0 && ok && unit_begin == 0 && unit_end >= units)
      prefetch_l2(payload, uint32_t(g.hidden) * 2);
  }
  int64_t row = -1;  // the dispatch row (src_info, self_row: packed)
  int64_t at = -1;   // the tokens output's row: `row`, or in the padded layout its slot's
  int32_t grp = -1;
  if (lane < n && payload != nullptr) {
    grp = e.group();
    if (grp < n_local) row = int64_t(rg.base[src * n_local + grp]) + e.pos;
    if (row >= row_limit) row = -1;  // never write outside the output
    if constexpr (kPadded) {
      if (row >= 0) at = slots.slot_row(grp, row);
    } else {
      at = row;
    }
    if (row >= 0 && unit_begin == 0) {
      p.src_info[row] = SrcInfo{token, int16_t(g.route.caller_rank(src)), int16_t(e.slot())};
      if constexpr (kPadded)
        if (p.slot_token != nullptr && at >= 0) p.slot_token[at] = token;
    }
    // This rank's own token: where its slot's row went, for the fused combine.
    if (src == g.rank && unit_begin == 0 && token >= 0 && token < g.max_tokens && e.slot() >= 0 &&
        e.slot() < g.top_k)
      p.scratch.self_row[int64_t(token) * g.top_k + e.slot()] = int32_t(row);
  }
  unit_end = unit_end < units ? unit_end : units;
  const int64_t unit_bytes = format_row_bytes(F, kLaneValues);  // 16, 8 or 4
  const int64_t first = unit_begin * unit_bytes;  // a multiple of 16: parts are whole vectors
  // The shuffles below sit in loops every lane runs the same number of times (n and the vector
  // count are the warp's).
  if (payload == nullptr) return;
  if (bulk) {  // the codes from the slot, one bulk copy a row
    if (in_place) {  // this rank's own row, quantised into the slot
      if constexpr (F != TokenFormat::kBF16 && kSolo) {
        if (lane == 0) bulk_wait_read<0>();  // the previous message's stores have read the slot
        __syncwarp();
        quantize_into_slot<F>(g, reinterpret_cast<const uint16_t*>(payload), ring->data);
        fence_proxy_async_smem();  // each lane's stores to the slot, before bulk stores read it
        __syncwarp();
      }
    } else {
      ring->wait();
    }
    for (int32_t j = 0; j < n; ++j) {
      const int64_t r = __shfl_sync(0xffffffffu, at, j);
      if (lane == 0 && r >= 0) bulk_store(out + r * row_bytes, ring->data, uint32_t(row_bytes));
    }
    if (lane == 0) bulk_commit();
  } else {
    copy_vectors(payload + first, int32_t((unit_end - unit_begin) * unit_bytes / 16), n,
                 LoadCoherent{}, [&](int32_t j) {
                   const int64_t r = __shfl_sync(0xffffffffu, at, j);
                   return r < 0 ? nullptr : out + r * row_bytes + first;
                 });
  }
  if constexpr (F != TokenFormat::kBF16) {
    constexpr int32_t kUnitsPerScale = format_scale_group(F) / kLaneValues;
    // With the ring, the scales are read from the slot.
    const char* scales =
        bulk ? ring->data + (ml.scales_offset() - ml.payload_offset()) : msg + ml.scales_offset();
    if (stash_scales<F, kPadded, kSolo>() && in_place) {
      // Into the message's own scale bytes (own messages are never sent, and the combine reads
      // only their headers): place_stashed_scales finds them from the row's token.
      const uint4* from = reinterpret_cast<const uint4*>(scales);
      uint4* to = reinterpret_cast<uint4*>(const_cast<char*>(msg) + ml.scales_offset());
      for (int32_t i = lane; i < int32_t(ml.scales_bytes() / 16); i += kWarpSize)
        to[i] = from[i];
    } else {
      PartScales<F, kPadded>(p, rg, scales, unit_begin / kUnitsPerScale, unit_end / kUnitsPerScale)
          .place(n, at, grp);
    }
    if (bulk) __syncwarp();  // the lanes' reads of the slot, before lane 0 refills it
  }
}

// This rank's own message for token t, in the fused kernel where it stays in place (in_place):
// the route from the ranking (every block has passed its grid barriers), the header written
// where the message would have been (the expert-side combine reads it), then its rows. No flag
// to wait for: the sender writes nothing for it. Whole warp.
template <TokenFormat F, bool kPadded, bool kSolo>
__device__ void expand_own(const DispatchParams& p, const RecvGroups& rg, int32_t t,
                           RingSlot* ring) {
  const GroupView& g = p.g;
  const ExpertMap em = g.experts();
  // With more ranks, most tokens skip here on one read, not the route's two rounds of them.
  if (g.n_ranks > 1 && p.scratch.dest_pos[int64_t(t) * g.n_ranks + g.rank] < 0) return;
  const LaneRoute r = route_from_scratch(p, t);
  const RankMask dests = r.dests();
  if (!(dests & rank_bit(g.rank))) return;  // not routed here
  const int32_t m = r.slot_of(g.rank);
  if (m < 0 || m >= rg.stream_count[g.rank]) return;  // never outside the stream
  const WindowLayout wl = g.layout();
  MessageHeader* h = reinterpret_cast<MessageHeader*>(
      window_at(g, g.rank, wl.dispatch_recv_offset() + wl.dispatch_recv().offset(g.rank, m)));
  const int32_t dest = r.id >= 0 ? em.rank_of(r.id) : -1;
  const int32_t k = write_header(h, em, r, dest, dests, g.rank, t);  // lane i: entry i's slot
  const int32_t from = k >= 0 ? k : 0;
  const int32_t id = __shfl_sync(0xffffffffu, r.id, from);
  const int32_t pos = __shfl_sync(0xffffffffu, r.pos, from);
  const float w = __shfl_sync(0xffffffffu, r.weight, from);
  OwnEntries own{t, __popc(__ballot_sync(0xffffffffu, k >= 0)), MessageEntry{}};
  if (k >= 0) own.e = MessageEntry::make(em.local_of(id), k, pos, w);
  expand_message<F, kPadded, kSolo>(p, rg, g.rank, m, 0, g.hidden / kLaneValues, true, ring, &own);
}

// Output slots no message fills, written before any data arrives (they depend only on the
// counts): FP8's padding rows (src_info {-1,-1,-1}, zero codes, zero scales), and the swizzled
// layouts' unused scale slots (the rest of each group's last tile, and the tiles no group uses).
// Spread over every warp of the grid.
template <TokenFormat F, bool kPadded>
__device__ void fill_padding(const DispatchParams& p, const RecvGroups& rg, int32_t rb,
                             int32_t n_rb) {
  const GroupView& g = p.g;
  const DispatchOutputLayout out = g.output();
  const int32_t n_local = g.n_local();
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warp = int64_t(rb) * kWarps + threadIdx.x / kWarpSize;
  const int64_t warps = int64_t(n_rb) * kWarps;
  if constexpr (F == TokenFormat::kFp8Blockwise) {
    if constexpr (kPadded) return;  // no padding rows; unused slots keep what they held
    constexpr int32_t kPad = Fp8ScaleLayout::kRowAlign - 1;  // padding rows per group, at most
    const Fp8ScaleLayout l = out.fp8();
    const int64_t row_bytes = out.row_bytes();
    for (int64_t i = warp; i < int64_t(n_local) * kPad; i += warps) {
      const int32_t grp = int32_t(i / kPad);
      const int64_t row = int64_t(rg.row_offset[grp]) + rg.rows[grp] + i % kPad;
      if (row >= rg.row_offset[grp + 1]) continue;
      if (lane == 0) p.src_info[row] = SrcInfo{-1, -1, -1};
      char* codes = static_cast<char*>(p.out_tokens) + row * row_bytes;
      for (int64_t v = lane; v < row_bytes / 16; v += kWarpSize)
        st_v4(codes + v * 16, make_uint4(0, 0, 0, 0));
      for (int32_t c = lane; c < l.cols(); c += kWarpSize)
        static_cast<float*>(p.out_scales)[l.offset(row, c)] = 0.0f;
    }
  } else if constexpr (format_swizzled(F)) {
    constexpr int64_t kTileRows = SwizzledScaleLayout::kTileRows;
    const SwizzledScaleLayout l = out.swizzled();
    uint8_t* scales = static_cast<uint8_t*>(p.out_scales);
    // The rest of every group's last tile: scale rows past its m_g rows.
    for (int64_t i = warp; i < int64_t(n_local) * kTileRows; i += warps) {
      const int32_t grp = int32_t(i / kTileRows);
      const int64_t r = i % kTileRows;  // row inside the group's last tile
      const int64_t tiles = rg.tile_start[grp + 1] - rg.tile_start[grp];
      if (tiles == 0 || (tiles - 1) * kTileRows + r < rg.rows[grp]) continue;
      const int64_t scale_row = (rg.tile_start[grp] + tiles - 1) * kTileRows + r;
      for (int32_t w = lane; w < l.col_tiles(); w += kWarpSize)
        *reinterpret_cast<uint32_t*>(scales + l.offset(scale_row, w * SwizzledScaleLayout::kTileCols)) =
            0u;
    }
    // Whole tiles past the last group's.
    const int64_t used = rg.tile_start[n_local] < l.row_tiles ? rg.tile_start[n_local] : l.row_tiles;
    const int64_t begin = l.tile_offset(used, 0) / 16, end = l.size() / 16;
    for (int64_t v = begin + int64_t(rb) * kThreads + threadIdx.x; v < end;
         v += int64_t(n_rb) * kThreads)
      st_v4(scales + v * 16, make_uint4(0, 0, 0, 0));
  }
}

// Every block of a fused or receive kernel arrives here once; the last one to arrive releases
// kDispatchAck[me] = seq in every source (its receive buffer is free again) and bumps the local
// dispatch_seq. Not inlined: its callers (the receive's two ends, and on the low-latency path
// the sending blocks that skip the receive) share one copy of its code, fetched once.
__device__ __noinline__ void dispatch_done(const GroupView& g, unsigned long long seq) {
  if (last_block_done(g, &g.state->dispatch_done) && threadIdx.x == 0) {
    signal_all<SignalOp::kSetFenced>(g, WindowLayout::kDispatchAck, seq);
    put_quiet(g);
    g.state->dispatch_seq = seq;
  }
}

// The warp waits until chunk `chunk` of source src has arrived; false after a timeout (recorded,
// naming src) or an abort.
__device__ inline bool warp_wait_chunk(const GroupView& g, int32_t src, int32_t chunk,
                                       unsigned long long seq) {
  const unsigned long long* flag = reinterpret_cast<const unsigned long long*>(
      window_at(g, g.rank, g.layout().chunk_flag_offset(src, chunk)));
  const bool ok = warp_wait_peers(g, rank_bit(src), kOpDispatchRecv, kWaitData,
                                  [&](int32_t) { return signal_load(flag) >= seq; });
  __syncwarp();  // the other lanes read the chunk after lane src's acquire
  return ok;
}

// The low-latency path's twin: the warp waits until part `part` of message m of source src,
// and part 0 (the header), have arrived.
__device__ inline bool warp_wait_part(const GroupView& g, int32_t src, int32_t m, int32_t part,
                                      unsigned long long seq) {
  const WindowLayout wl = g.layout();
  const auto* head = reinterpret_cast<const unsigned long long*>(
      window_at(g, g.rank, wl.part_flag_offset(src, m, 0)));
  const auto* flag = reinterpret_cast<const unsigned long long*>(
      window_at(g, g.rank, wl.part_flag_offset(src, m, part)));
  const bool ok = warp_wait_peers(g, rank_bit(src), kOpDispatchRecv, kWaitData, [&](int32_t) {
    return signal_load(flag) >= seq && signal_load(head) >= seq;
  });
  __syncwarp();  // the other lanes read the part after lane src's acquire
  return ok;
}

// The low-latency path's receive: items (message, source, part), message-major, dealt to the
// grid's warps in turn; a warp waits for its part's flag (and part 0's, which carries the
// header), then expands it.
template <TokenFormat F, bool kPadded>
__device__ bool expand_parts(const DispatchParams& p, const RecvGroups& rg, unsigned long long seq,
                             int32_t rb, int32_t n_rb, bool spread) {
  const GroupView& g = p.g;
  const int32_t n_ranks = g.n_ranks;
  const int32_t n_parts = num_parts(g.hidden);
  int32_t most = 0;
  for (int32_t s = 0; s < n_ranks; ++s)
    most = max(most, rg.stream_count[s]);
  const int64_t items = int64_t(most) * n_ranks * n_parts;
  // Dealt from the last warp of the grid backwards: the send dealt its pieces from the first,
  // so the blocks that had none (and built the layout first) take the first items. Dealt from
  // the first warp too, a decode's items all went to the blocks that were still sending, and
  // the receive finished measurably later. `spread` (every receiving block built its layout at
  // about the same time: the split receive, or the fused kernel's non-senders receiving alone):
  // warp 0 of every block first, then warp 1, ..., so each SM stores an even share. Dealt warp
  // by warp, one-rank decode's 896 parts filled 56 of the 76 receiving blocks (16 parts, 256 KB
  // of row stores each) and left 20 idle.
  const int64_t warps = int64_t(n_rb) * kWarps;
  const int32_t warp = int32_t(threadIdx.x / kWarpSize);
  const int64_t first =
      spread ? int64_t(warp) * n_rb + (n_rb - 1 - rb) : warps - 1 - (int64_t(rb) * kWarps + warp);
  for (int64_t i = first; i < items; i += warps) {
    // 32-bit: items are at most kUnitTokens * kMaxPeers * num_parts (a 64-bit division is a
    // called routine, three of them on each item's path).
    const int32_t j = int32_t(i), q = g.n_parts_div.div(j), m = g.n_ranks_div.div(q);
    const int32_t part = j - q * n_parts, s = q - m * n_ranks;
    if (m >= rg.stream_count[s]) continue;
    if (!warp_wait_part(g, s, m, part, seq)) return false;
    expand_message<F, kPadded>(p, rg, s, m, part * kPartUnits, (part + 1) * kPartUnits);
  }
  return true;
}

// The throughput path's receive: work items (chunk, source, message slot) of the chunks'
// messages.
template <TokenFormat F, bool kPadded, bool kSolo>
__device__ bool expand_chunks(const DispatchParams& p, const RecvGroups& rg, unsigned long long seq,
                              bool in_place, char* smem) {
  const GroupView& g = p.g;
  const int32_t n_ranks = g.n_ranks;
  const MetaLayout ml = g.layout().meta();
  const int lane = threadIdx.x % kWarpSize;
  // Work items (chunk, source, message slot), chunk-major so they come due in the order the
  // chunks arrive: a warp takes the next item from the call's counter, waits for the chunk's
  // flag, then expands that one message. A chunk holds up to 16 messages per source; a slot past
  // the chunk's messages costs one counter step and no wait. One message per item keeps the
  // grid's tail short: a message expands into up to K rows (prefill: 8 rows, 115 KB of stores,
  // some 30 us for one warp at its share of an SM's store rate), and items of 4 messages left
  // their last warps storing for about 4 times that while the rest of the grid had nothing to
  // take. Taking items from a counter (not by warp index) lets senders that are done join, and
  // keeps a warp that waited long from holding items others could take.
  int32_t max_chunks = 0;
  for (int32_t s = 0; s < n_ranks; ++s)
    max_chunks = max(max_chunks, rg.n_chunks[s]);
  const int64_t cells = max(int64_t(1), int64_t(max_chunks) * n_ranks);
  const int64_t items = cells * kChunkTokens;
  RingSlot ring = F == TokenFormat::kBF16 ? RingSlot{} : RingSlot::carve(g, smem);
  unsigned long long* counter = &g.state->recv_item[seq & 1];
  unsigned long long taken = lane == 0 ? atomicAdd(counter, 1ull) : 0ull;
  for (;;) {
    const int64_t i = int64_t(__shfl_sync(0xffffffffu, taken, 0));
    if (i >= items) break;
    if (lane == 0) taken = atomicAdd(counter, 1ull);  // the next item, in flight meanwhile
    const int32_t slot = int32_t(i % kChunkTokens);
    const int32_t s = int32_t((i / kChunkTokens) % n_ranks);
    const int32_t c = int32_t(i / (int64_t(kChunkTokens) * n_ranks));
    if (c >= rg.n_chunks[s]) continue;
    if (in_place && s == g.rank) {  // item (chunk, own, slot): the chunk's token `slot`
      const int32_t t = c * kChunkTokens + slot;
      if (t < p.num_tokens) expand_own<F, kPadded, kSolo>(p, rg, t, &ring);
      continue;
    }
    const int32_t* starts = reinterpret_cast<const int32_t*>(
        window_at(g, g.rank, g.layout().meta_offset(s)) + ml.chunk_start_offset());
    const int32_t end = min(starts[c + 1], rg.stream_count[s]);
    const int32_t m = starts[c] + slot;
    if (m >= end) continue;  // no message in this slot: nothing to wait for
    if (!warp_wait_chunk(g, s, c, seq)) {
      ring.drain();
      return false;
    }
    expand_message<F, kPadded, kSolo>(p, rg, s, m, 0, g.hidden / kLaneValues, in_place, &ring);
  }
  ring.drain();
  return true;
}

// The stashed scales (stash_scales) to the output, once every block's rows are out: the grid's
// warps take tiles of 32 adjacent output rows (dealt warp-major, so a small call's tiles spread
// over the blocks); lane l takes row 32 i + l, finds its token (src_info) and the token's message
// (its own stream slot, from the ranking scratch), loads the scales the token's warp stashed
// there (32 columns at a time, so 8 loads a lane are in flight) and stores them one column at a
// time, 32 rows to a run of 128 bytes. Padding rows
// (token -1) keep the zeros fill_padding gave them. Whole warp; the reads skip L1 (other blocks
// wrote what they read, in this kernel).
template <TokenFormat F>
__device__ void place_stashed_scales(const DispatchParams& p, const RecvGroups& rg, int32_t rb,
                                     int32_t n_rb) {
  const GroupView& g = p.g;
  const WindowLayout wl = g.layout();
  const MessageLayout ml = wl.msg();
  const Fp8ScaleLayout l = g.output().fp8();
  const int32_t cols = l.cols();
  const int lane = threadIdx.x % kWarpSize;
  const int64_t rows = rg.row_offset[g.n_local()];
  const int32_t messages = rg.stream_count[g.rank];
  const char* stream =
      window_at(g, g.rank, wl.dispatch_recv_offset() + wl.dispatch_recv().offset(g.rank, 0));
  float* out = static_cast<float*>(p.out_scales);
  constexpr int32_t kQuads = 8;  // 16-byte loads in flight a lane: 32 columns a round
  const int64_t warps = int64_t(n_rb) * kWarps;
  for (int64_t tile = int64_t(threadIdx.x / kWarpSize) * n_rb + rb; tile * kWarpSize < rows;
       tile += warps) {
    const int64_t r = tile * kWarpSize + lane;
    const int32_t t = r < rows ? __ldcg(&p.src_info[r].token) : -1;
    const int32_t m =
        t >= 0 && t < p.num_tokens ? stream_slot(p, unit_prefix_of(p, t), t, g.rank) : -1;
    const bool mine = m >= 0 && m < messages;
    const float4* from = reinterpret_cast<const float4*>(
        stream + (mine ? int64_t(m) * ml.bytes() + ml.scales_offset() : 0));
    for (int32_t c0 = 0; c0 < cols; c0 += 4 * kQuads) {
      float4 v[kQuads];
#pragma unroll
      for (int q = 0; q < kQuads; ++q)
        v[q] = mine && c0 + 4 * q < cols ? __ldcg(from + c0 / 4 + q) : make_float4(0, 0, 0, 0);
      if (!mine) continue;
      // Column c0 + j of row r, a column (ld floats) at a time.
      float* at = out + l.offset(r, c0);
      const int32_t n = cols - c0 < 4 * kQuads ? cols - c0 : 4 * kQuads;
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const float f[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (4 * q + i < n) *at = f[i];
          at += l.ld;
        }
      }
    }
  }
}

// What a receiving block's layout came to: the wait for the records failed (recorded, the
// abort flag set), or check_sources' verdict (0: good).
constexpr int32_t kLayoutFailed = -1;

// The whole block: waits for every source's meta record and builds the receive's layout in
// shared memory (rg): counts, checks (check_sources), row offsets, bases. `writer`: this block
// also writes the call's layout outputs (row_offsets, expert_ids, the padded layout's counts and
// ranges, the combine's bases and message counts; on a bad verdict, empty groups), once per
// call. Returns the verdict, or kLayoutFailed.
template <TokenFormat F, bool kPadded>
__device__ int32_t build_layout(const DispatchParams& p, unsigned long long seq,
                                const RecvGroups& rg, bool writer) {
  const GroupView& g = p.g;
  const WindowLayout wl = g.layout();
  const MetaLayout ml = wl.meta();
  const int32_t n_local = g.n_local(), n_ranks = g.n_ranks;
  auto meta_at = [&](int32_t s) { return window_at(g, g.rank, wl.meta_offset(s)); };
  if (!block_wait(
          g, all_ranks_mask(g), kOpDispatchRecv, kWaitMeta,
          [&](int32_t s) {
            return reinterpret_cast<const unsigned long long*>(meta_at(s) + ml.seq_offset());
          },
          [&](int32_t) { return seq; }))
    return kLayoutFailed;
  for (int32_t i = threadIdx.x; i < n_ranks * n_local; i += kThreads) {
    const int32_t s = g.n_local_div.div(i), j = i - s * n_local;
    rg.counts[i] = reinterpret_cast<const volatile int32_t*>(meta_at(s) + ml.counts_offset())[j];
  }
  if (threadIdx.x < n_ranks) {
    rg.stream_count[threadIdx.x] =
        *reinterpret_cast<const volatile int32_t*>(meta_at(threadIdx.x) + ml.stream_count_offset());
    rg.n_chunks[threadIdx.x] =
        *reinterpret_cast<const volatile int32_t*>(meta_at(threadIdx.x) + ml.n_chunks_offset());
  }
  __syncthreads();
  trace_mark(g, kTraceDispatch, kTraceCountsIn);
  const int32_t verdict = check_sources(p, rg, ml, meta_at, writer ? 0 : 1);
  trace_mark(g, kTraceDispatch, kTraceChecked);
  if (verdict != 0) {
    // Nothing is written but empty groups (row_offsets all 0, so combine sends nothing back
    // from here); the call still completes, so the group stays usable.
    if (writer) {
      for (int32_t grp = threadIdx.x; grp <= n_local; grp += kThreads) {
        p.row_offsets[grp] = 0;
        if (grp < n_local) p.expert_ids[grp] = g.route.group_expert(grp);
        if (format_swizzled(F) && grp < n_local) p.scales_offsets[grp] = 0;
        if (kPadded && grp < n_local) p.counts[grp] = 0;  // no stale counts for a GEMM
      }
      if (kPadded && p.layout_range != nullptr)
        for (int32_t i = threadIdx.x; i < n_local * g.route.n_ranks; i += kThreads)
          p.layout_range[i] = 0;
      if (threadIdx.x < n_ranks) p.scratch.recv_count[threadIdx.x] = 0;
    }
    return verdict;
  }

  // row_offsets: exclusive scan of the group totals, each padded to the format's row alignment;
  // the swizzled formats also scan each group's scale tiles (n_local <= 1024 = 2 per thread).
  const GroupRows rows{rg.counts, n_ranks, n_local};
  constexpr int32_t kAlign = kPadded ? 1 : format_row_align(F);  // the padded layout: none
  constexpr int32_t kTileRows = SwizzledScaleLayout::kTileRows;
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int32_t item[2], tiles[2], total = 0, total_tiles = 0;
  for (int i = 0; i < 2; ++i) {
    const int32_t grp = threadIdx.x * 2 + i;
    const int32_t m = grp < n_local ? rows.group_total(grp) : 0;
    if (grp < n_local) rg.rows[grp] = m;
    item[i] = int32_t(align_up(m, kAlign));
    tiles[i] = (m + kTileRows - 1) / kTileRows;
  }
  Scan(scan_tmp).ExclusiveSum(item, item, total);
  if constexpr (format_swizzled(F)) {
    __syncthreads();  // scan_tmp is reused
    Scan(scan_tmp).ExclusiveSum(tiles, tiles, total_tiles);
  }
  for (int i = 0; i < 2; ++i) {
    const int32_t grp = threadIdx.x * 2 + i;
    if (grp < n_local) {
      rg.row_offset[grp] = item[i];
      rg.tile_start[grp] = tiles[i];
    }
  }
  if (threadIdx.x == 0) {
    rg.row_offset[n_local] = total;
    rg.tile_start[n_local] = total_tiles;
  }
  __syncthreads();
  // The writer also keeps the bases and message counts for the expert-side combine.
  for (int32_t grp = threadIdx.x; grp < n_local; grp += kThreads) {
    for (int32_t s = 0; s < n_ranks; ++s) {
      const int32_t base = rg.row_offset[grp] + rows.source_offset(s, grp);
      rg.base[s * n_local + grp] = base;
      if (writer) p.scratch.recv_base[s * n_local + grp] = base;
    }
  }
  if (writer) {
    if (threadIdx.x < n_ranks) p.scratch.recv_count[threadIdx.x] = rg.stream_count[threadIdx.x];
    for (int32_t grp = threadIdx.x; grp <= n_local; grp += kThreads) {
      p.row_offsets[grp] = uint32_t(rg.row_offset[grp]);
      if (grp < n_local) p.expert_ids[grp] = g.route.group_expert(grp);
      if (format_swizzled(F) && grp < n_local)
        p.scales_offsets[grp] = uint32_t(rg.tile_start[grp] - rg.row_offset[grp] / kTileRows);
    }
  }
  __syncthreads();
  // The padded layout's per-group outputs (the writer, after every base is known): counts, and
  // layout_range by caller rank, (first slot << 32) | rows, 0 for a source that sent none.
  if (kPadded && writer) {
    for (int32_t grp = threadIdx.x; grp < n_local; grp += kThreads)
      p.counts[grp] = rg.rows[grp];
    if (p.layout_range != nullptr) {
      const int32_t callers = g.route.n_ranks;
      for (int32_t i = threadIdx.x; i < n_local * callers; i += kThreads) {
        const int32_t grp = i / callers, s = g.route.view_rank_of(i % callers);
        const int32_t c = s >= 0 ? rg.counts[s * n_local + grp] : 0;
        const int64_t first = c > 0 ? rg.base[s * n_local + grp] - rg.row_offset[grp] : 0;
        p.layout_range[i] = c > 0 ? int64_t(uint64_t(first) << 32 | uint32_t(c)) : 0;
      }
    }
  }
  return 0;
}

// Receiver block rb of n_rb (all blocks of dispatch_wait; the non-senders of the fused kernel),
// or a sender of the fused kernel that has sent its chunks and joins in (rb < 0: it takes work
// items only; the receivers write the padding and the combine's bookkeeping). kLowLatency: the
// group's path (GroupView::low_latency), which picks how rows are expanded; `spread` (the
// low-latency path): deal the parts over the blocks first (expand_parts).
template <TokenFormat F, bool kPadded, bool kLowLatency, bool kSolo = false>
__device__ __noinline__ void dispatch_recv(const DispatchParams& p, unsigned long long seq,
                                           char* smem, int32_t rb, int32_t n_rb, bool in_place,
                                           bool spread = false) {
  const GroupView& g = p.g;
  if (rb == 0 && threadIdx.x == 0) g.state->recv_item[(seq + 1) & 1] = 0;  // the next call's
  const RecvGroups rg = RecvGroups::carve(smem, g.n_ranks, g.n_local());
  const int32_t verdict = build_layout<F, kPadded>(p, seq, rg, rb == 0);
  if (verdict == kLayoutFailed) return;
  if (verdict != 0) {
    dispatch_done(g, seq);
    return;
  }
  if (rb >= 0) fill_padding<F, kPadded>(p, rg, rb, n_rb);
  trace_mark(g, kTraceDispatch, kTraceReady);
  bool expanded;
  if constexpr (kLowLatency)
    expanded = expand_parts<F, kPadded>(p, rg, seq, rb, n_rb, spread);
  else
    expanded = expand_chunks<F, kPadded, kSolo>(p, rg, seq, in_place, smem);
  // A warp that gave up has set the abort flag (or found it set): the block stops here. Its
  // own warps' word, not the flag's: a read of the flag was a round trip at the end of every
  // receiving block, and a block whose items all arrived may finish as if no wait had failed.
  if (__syncthreads_or(!expanded)) return;
  if constexpr (stash_scales<F, kPadded, kSolo>()) {
    // Every block of a solo kernel receives (it sends nothing: senders == blocks), so every
    // block comes here, or has found the abort flag that ends the barrier's wait.
    if (!grid_barrier(g)) return;
    place_stashed_scales<F>(p, rg, rb, n_rb);
  }
  dispatch_done(g, seq);
  trace_mark(g, kTraceDispatch, kTraceDone);
}

}  // namespace
}  // namespace detail
}  // namespace epcomm
