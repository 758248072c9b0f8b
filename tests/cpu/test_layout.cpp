// The layouts of layout.h and detail/window_layout.h: index arithmetic that sender, receiver and
// reference must agree on.
#include <gtest/gtest.h>

#include <set>

#include "epcomm/detail/params.h"
#include "epcomm/detail/window_layout.h"
#include "epcomm/layout.h"

using namespace epcomm;
using namespace epcomm::detail;

TEST(Layout, ExpertMapOwnershipAndKeys) {
  const ExpertMap em{256, 8};
  EXPECT_EQ(em.n_local(), 32);
  EXPECT_EQ(em.rank_of(0), 0);
  EXPECT_EQ(em.rank_of(31), 0);
  EXPECT_EQ(em.rank_of(32), 1);
  EXPECT_EQ(em.rank_of(255), 7);
  EXPECT_EQ(em.local_of(33), 1);
  EXPECT_EQ(em.rank_key(0), 256);
  EXPECT_EQ(em.rank_key(7), 263);
  EXPECT_EQ(em.num_keys(), 264);
  for (int e = 0; e < 256; ++e) EXPECT_EQ(em.rank_of(e) * em.n_local() + em.local_of(e), e);
}

TEST(Layout, MessageIsAlignedAndHoldsHeader) {
  for (int K : {1, 4, 8, 16}) {
    for (int H : {8, 2048, 2880, 7168}) {
      const MessageLayout m{H, K, TokenFormat::kBF16};
      EXPECT_EQ(m.header_bytes() % 128, 0);
      EXPECT_GE(m.header_bytes(), 8 + 12 * K);
      EXPECT_LT(m.header_bytes(), 8 + 12 * K + 128);
      EXPECT_EQ(m.payload_offset() % 128, 0);
      EXPECT_EQ(m.payload_bytes(), H * 2);
      EXPECT_EQ(m.bytes() % 128, 0);  // so every message of a stream starts on a line
      EXPECT_GE(m.bytes(), m.header_bytes() + H * 2);
      EXPECT_LT(m.bytes(), m.header_bytes() + H * 2 + 128);
    }
  }
  // Quantised payloads: codes, then the row's scales, each part 16-byte aligned.
  const MessageLayout fp8{7168, 8, TokenFormat::kFp8Blockwise};
  EXPECT_EQ(fp8.codes_bytes(), 7168);
  EXPECT_EQ(fp8.scales_bytes(), 56 * 4);
  EXPECT_EQ(fp8.scales_offset(), fp8.header_bytes() + 7168);
  EXPECT_EQ(fp8.bytes(), fp8.header_bytes() + 7424);  // 7168 + 224, padded to a line
  const MessageLayout mxfp4{2880, 4, TokenFormat::kMxfp4};
  EXPECT_EQ(mxfp4.codes_bytes(), 1440);
  EXPECT_EQ(mxfp4.scales_bytes(), 96);  // 90 e8m0 bytes, padded to 16
  EXPECT_EQ(mxfp4.scales_offset() % 16, 0);
  const MessageLayout nvfp4{2048, 8, TokenFormat::kNvfp4};
  EXPECT_EQ(nvfp4.codes_bytes(), 1024);
  EXPECT_EQ(nvfp4.scales_bytes(), 128);
  const MessageLayout mxfp8{2880, 8, TokenFormat::kMxfp8};
  EXPECT_EQ(mxfp8.codes_bytes(), 2880);
  EXPECT_EQ(mxfp8.scales_bytes(), 96);
  const MessageEntry e = MessageEntry::make(511, 15, 123456, 0.25f);
  EXPECT_EQ(e.group(), 511);
  EXPECT_EQ(e.slot(), 15);
  EXPECT_EQ(e.pos, 123456);
  EXPECT_EQ(e.weight, 0.25f);
}

// A token's destinations, numbered in rank order: the slots are 0..n-1 without gaps, so the
// expert-side combine's rows of a token fit in its first min(K, n_ranks) combine rows.
TEST(Layout, RankSlotsNumberDestinationsInOrder) {
  EXPECT_EQ(rank_slot_of(0b10110101u, 0), 0);
  EXPECT_EQ(rank_slot_of(0b10110101u, 2), 1);
  EXPECT_EQ(rank_slot_of(0b10110101u, 4), 2);
  EXPECT_EQ(rank_slot_of(0b10110101u, 5), 3);
  EXPECT_EQ(rank_slot_of(0b10110101u, 7), 4);
  for (uint32_t mask = 1; mask < 256; ++mask) {
    int32_t next = 0;
    for (int32_t d = 0; d < 8; ++d)
      if ((mask >> d) & 1u) {
        EXPECT_EQ(rank_slot_of(mask, d), next++) << mask << " " << d;
      }
  }
}

TEST(Layout, DispatchRecvSlotsAreDisjoint) {
  const DispatchRecvLayout l{MessageLayout{2880, 4, TokenFormat::kBF16}, 5};
  std::set<int64_t> seen;
  for (int s = 0; s < 3; ++s)
    for (int i = 0; i < 5; ++i) {
      const int64_t off = l.offset(s, i);
      EXPECT_EQ(off % 16, 0);
      EXPECT_LE(off + l.msg.bytes(), l.bytes(3));
      EXPECT_TRUE(seen.insert(off / l.msg.bytes()).second);
    }
  EXPECT_EQ(int64_t(seen.size()), 15);
}

TEST(Layout, CombineRecvSlotsCoverBuffer) {
  const CombineRecvLayout l{7168, 8, 16};
  EXPECT_EQ(l.row_bytes(), 7168 * 2);
  EXPECT_EQ(l.offset(0, 1), l.row_bytes());
  EXPECT_EQ(l.offset(1, 0), 8 * l.row_bytes());
  EXPECT_EQ(l.offset(15, 7) + l.row_bytes(), l.bytes());
}

TEST(Layout, WindowRegionsDoNotOverlap) {
  const WindowLayout w{8, 7168, 8, 256, 4096, TokenFormat::kBF16, 0};
  // signals < meta < dispatch recv < combine recv, each 256-aligned
  EXPECT_EQ(w.signal_offset(WindowLayout::kDispatchAck, 0), 0);
  EXPECT_EQ(w.signal_offset(WindowLayout::kCombineAck, WindowLayout::kMaxPeers - 1) + 8,
            int64_t(WindowLayout::kNumSignals) * WindowLayout::kMaxPeers * 8);
  EXPECT_LE(int64_t(WindowLayout::kNumSignals) * 8 * 8, w.signals_bytes());
  // chunk flags after the signals: one u64 per (source, chunk of 16 tokens)
  EXPECT_EQ(w.chunk_flag_offset(0, 0), w.signals_bytes());
  EXPECT_EQ(w.chunk_flag_offset(1, 0) - w.chunk_flag_offset(0, 0), 8 * (4096 / kChunkTokens));
  EXPECT_LE(w.chunk_flag_offset(7, 4096 / kChunkTokens - 1) + 8, w.chunk_flags_end());
  EXPECT_EQ(w.meta_offset(0), w.chunk_flags_end());
  EXPECT_LE(w.meta_offset(7) + w.meta().bytes(), w.dispatch_recv_offset());
  EXPECT_LE(w.dispatch_recv_offset() + w.dispatch_recv().bytes(8), w.combine_recv_offset());
  EXPECT_LE(w.combine_recv_offset() + w.combine_recv().bytes(), w.bytes());
  EXPECT_EQ(w.dispatch_recv_offset() % 256, 0);
  EXPECT_EQ(w.combine_recv_offset() % 256, 0);
  EXPECT_EQ(w.zeroed_bytes(), w.dispatch_recv_offset());
  // Memory target (docs/results/method.md): buffers within 2 x n_ranks x max_tokens x message bytes.
  EXPECT_LE(w.bytes(), 2 * 8 * int64_t(4096) * w.msg().bytes());
  // meta: seq, stream count, chunk count, counts[n_local], chunk starts[max_chunks + 1],
  // rows_to[n_ranks]
  EXPECT_EQ(w.meta().chunk_start_offset(), 16 + 4 * 32);
  EXPECT_EQ(w.meta().rows_to_offset(), 16 + 4 * 32 + 4 * (4096 / 16 + 1));
  EXPECT_EQ(w.meta().bytes(), align_up(16 + 4 * 32 + 4 * (4096 / 16 + 1) + 4 * 8, 16));
  EXPECT_EQ(num_chunks(0), 0);
  EXPECT_EQ(num_chunks(1), 1);
  EXPECT_EQ(num_chunks(16), 1);
  EXPECT_EQ(num_chunks(17), 2);
}

// The low-latency path's part flags sit between the chunk flags and the meta records, one u64
// per (source, message, part), inside the zeroed prefix; without the path they take no bytes.
TEST(Layout, PartFlagsOfTheLowLatencyPath) {
  const WindowLayout off{8, 7168, 8, 256, 128, TokenFormat::kBF16, 0};
  const WindowLayout on{8, 7168, 8, 256, 128, TokenFormat::kBF16, 1};
  EXPECT_EQ(off.part_flags_end(), off.chunk_flags_end());
  EXPECT_EQ(num_parts(7168), 7);
  EXPECT_EQ(num_parts(2880), 3);
  EXPECT_EQ(num_parts(1024), 1);
  EXPECT_EQ(on.part_flag_offset(0, 0, 0), on.chunk_flags_end());
  EXPECT_EQ(on.part_flag_offset(0, 0, 1) - on.part_flag_offset(0, 0, 0), 8);
  EXPECT_EQ(on.part_flag_offset(0, 1, 0) - on.part_flag_offset(0, 0, 0), 8 * 7);
  EXPECT_EQ(on.part_flag_offset(1, 0, 0) - on.part_flag_offset(0, 0, 0), 8 * 7 * 128);
  EXPECT_LE(on.part_flag_offset(7, 127, 6) + 8, on.part_flags_end());
  EXPECT_EQ(on.meta_offset(0), on.part_flags_end());
  EXPECT_EQ(on.part_flags_end() % 256, 0);
  EXPECT_EQ(on.zeroed_bytes(), on.dispatch_recv_offset());
  EXPECT_LT(on.part_flag_offset(7, 127, 6), on.zeroed_bytes());
  EXPECT_EQ(on.bytes() - off.bytes(), on.dispatch_recv_offset() - off.dispatch_recv_offset());
}

TEST(Layout, GroupRowsPrefixesBySourceThenGroup) {
  // counts[s][g] for 3 sources, 2 groups
  const int32_t counts[6] = {2, 0, 1, 3, 4, 1};
  const GroupRows r{counts, 3, 2};
  EXPECT_EQ(r.group_total(0), 7);
  EXPECT_EQ(r.group_total(1), 4);
  EXPECT_EQ(r.source_offset(0, 0), 0);
  EXPECT_EQ(r.source_offset(1, 0), 2);
  EXPECT_EQ(r.source_offset(2, 0), 3);
  EXPECT_EQ(r.source_offset(2, 1), 3);
}

TEST(Layout, AlignUp) {
  EXPECT_EQ(align_up(0, 16), 0);
  EXPECT_EQ(align_up(1, 16), 16);
  EXPECT_EQ(align_up(16, 16), 16);
  EXPECT_EQ(align_up(17, 256), 256);
}

// Divisor against `/` and `%`: every divisor up to 1100 (each experts-per-rank, rank count and
// parts-per-token the group allows) over a dense range and the values near each multiple and
// near 2^31, then divisors up to 2^31 - 1 at random values.
TEST(Layout, DivisorMatchesDivision) {
  const auto check = [](int32_t d, int32_t x) {
    const Divisor v(d);
    ASSERT_EQ(v.div(x), x / d) << x << " / " << d;
    ASSERT_EQ(v.mod(x), x % d) << x << " % " << d;
  };
  constexpr int32_t kMax = 0x7fffffff;
  for (int32_t d = 1; d <= 1100; ++d) {
    for (int32_t x = 0; x < 4 * d + 70; ++x)
      check(d, x);
    for (int32_t x : {kMax, kMax - 1, kMax - d, kMax / d * d, kMax / d * d - 1, (1 << 30) - 1})
      check(d, x);
  }
  uint64_t s = 0x9e3779b97f4a7c15ull;
  const auto next = [&s] {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return uint32_t(s);
  };
  for (int i = 0; i < 200000; ++i) {
    const int32_t d = int32_t(next() % uint32_t(kMax)) + 1;
    check(d, int32_t(next() & uint32_t(kMax)));
    check(d, d);
    check(d, d - 1);
  }
  for (int l = 0; l <= 30; ++l) {
    const int32_t d = int32_t(1) << l;
    check(d, kMax);
    check(d, d + 1);
    if (d > 2) check(d - 1, kMax);
    check(d + 1, kMax);
  }
  // Built once on the host, the maps divide as before.
  const ExpertMap em(264, 8, Divisor(33));
  EXPECT_EQ(em.rank_of(263), 7);
  EXPECT_EQ(em.local_of(263), 32);
}

// A configuration that validation refuses still has its sizes worked out (to name what is
// wrong, and on every rank alike): none of the maps may divide by its zero. A group of 0 ranks,
// or hidden = -1 (0 parts), once stopped a process with SIGFPE (Python's fuzz test on a GPU).
TEST(Layout, RefusedSizesNeverDivideByZero) {
  EXPECT_EQ(Divisor(0).d, 0);
  EXPECT_EQ(Divisor(-3).d, -3);
  EXPECT_EQ(Divisor(num_parts(-1)).d, 0);
  EXPECT_EQ(RouteMap::make(8, 2, 0, 0, false, false, 0).n_local(), 0);
  EXPECT_EQ((ExpertMap{8, 0}).n_local(), 0);
  EXPECT_EQ((ExpertMap{2, 3}).n_local(), 0);
  const WindowLayout wl{0, -1, 2, 8, 4, TokenFormat::kBF16, 1};
  EXPECT_EQ(wl.meta().n_local, 0);
}

// RouteMap with no mode: the view is the caller's group and every id maps to itself.
TEST(Layout, RouteMapWithoutModesIsTheIdentity) {
  const RouteMap m{256, 8, 8, 3, 0, 0, 8, 3};
  EXPECT_EQ(m.view_ranks(), 8);
  EXPECT_EQ(m.view_rank(), 3);
  EXPECT_EQ(m.slots(), 8);
  EXPECT_EQ(m.groups(), 32);
  EXPECT_EQ(m.view_experts(), 256);
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(m.slot_expert(e, 5, 0, 10), e);
  EXPECT_EQ(m.slot_expert(-1, 0, 0, 10), -1);
  EXPECT_EQ(m.group_expert(7), 7);
  EXPECT_EQ(m.shared_count(100), 0);
  EXPECT_EQ(m.max_routed_rows(128), 128 * 8 * 8);
  for (int r = -1; r < 8; ++r)
    EXPECT_EQ(m.view_rank_of(r), r);
  EXPECT_EQ(m.caller_rank(5), 5);
  const float w[16] = {0.5f, 0.25f, 1, 1, 1, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  EXPECT_EQ(m.slot_weight(w, 1, 2), 4.0f);
}

// The shared expert: local expert 0 of every rank in the view, the caller's local expert l is
// group l + 1, and slot K of each of this rank's tokens goes to its own shared expert.
TEST(Layout, RouteMapSharedExpert) {
  const RouteMap m{64, 4, 4, 2, 1, 0, 4, 2};
  EXPECT_EQ(m.n_local(), 16);
  EXPECT_EQ(m.groups(), 17);
  EXPECT_EQ(m.slots(), 5);
  EXPECT_EQ(m.view_experts(), 68);
  const ExpertMap em{m.view_experts(), m.view_ranks()};
  for (int e = 0; e < 64; ++e) {
    const int32_t v = m.slot_expert(e, 0, 0, 1);
    EXPECT_EQ(em.rank_of(v), e / 16) << e;
    EXPECT_EQ(em.local_of(v), e % 16 + 1) << e;
  }
  EXPECT_EQ(m.shared_expert(), 2 * 17);
  for (int t = 0; t < 9; ++t)
    EXPECT_EQ(m.slot_expert(-1, 4, t, 9), 34);
  EXPECT_EQ(m.group_expert(0), kSharedExpertId);
  EXPECT_EQ(m.group_expert(1), 0);
  EXPECT_EQ(m.group_expert(16), 15);
  EXPECT_EQ(m.shared_begin(9), 0);
  EXPECT_EQ(m.shared_count(9), 9);
  const float w[8] = {0.5f, 0.25f, 0.125f, 2, 3, 4, 5, 6};
  EXPECT_EQ(m.slot_weight(w, 1, 3), 6.0f);
  EXPECT_EQ(m.slot_weight(w, 1, 4), 1.0f);  // the shared slot
  EXPECT_EQ(m.max_routed_rows(100), 100 * 4 * 4 + 100);
}

// skip_a2a: a group of one rank whose experts are its own; the others' ids are dropped.
TEST(Layout, RouteMapSkipA2a) {
  const RouteMap m{32, 8, 4, 1, 0, 1, 4, 1};
  EXPECT_EQ(m.view_ranks(), 1);
  EXPECT_EQ(m.view_rank(), 0);
  EXPECT_EQ(m.view_experts(), 8);
  for (int e = 0; e < 32; ++e)
    EXPECT_EQ(m.slot_expert(e, 2, 0, 1), e / 8 == 1 ? e % 8 : -1) << e;
  EXPECT_EQ(m.max_routed_rows(50), 50 * 8);
  EXPECT_EQ(m.caller_rank(0), 1);  // src_info names the caller's rank
  EXPECT_EQ(m.view_rank_of(1), 0);
  EXPECT_EQ(m.view_rank_of(0), -1);
  EXPECT_EQ(m.view_rank_of(-1), -1);
  const RouteMap s{32, 8, 4, 1, 1, 1, 4, 1};
  EXPECT_EQ(s.view_experts(), 9);
  EXPECT_EQ(s.slot_expert(9, 0, 0, 1), 2);  // rank 1's local expert 1 -> group 2
  EXPECT_EQ(s.max_routed_rows(50), 50 * 8 + 50);
}

// skip_a2a + shared expert: the W shares tile the tokens in order, sizes within one of each
// other, share r of (T + W - r - 1) / W tokens (docs/design.md "Modes"); a token is shared on exactly one share.
TEST(Layout, RouteMapSharedSplitTilesTheTokens) {
  for (int W = 1; W <= 8; ++W) {
    for (int T = 0; T <= 40; ++T) {
      int next = 0;
      for (int r = 0; r < W; ++r) {
        const RouteMap m{8 * W, 4, W, r, 1, 1, W, r};
        EXPECT_EQ(m.shared_begin(T), next) << W << " " << T << " " << r;
        EXPECT_EQ(m.shared_count(T), (T + W - r - 1) / W);
        EXPECT_LE(m.shared_count(T), T / W + 1);
        EXPECT_GE(m.shared_count(T), T / W);
        for (int t = 0; t < T; ++t) {
          const bool mine = t >= next && t < next + m.shared_count(T);
          EXPECT_EQ(m.slot_expert(-1, 4, t, T), mine ? 0 : -1);
        }
        next += m.shared_count(T);
      }
      EXPECT_EQ(next, T);
    }
  }
}

// Nodes: rank r of node r / ranks_per_node; ranks of other nodes numbered densely, in rank
// order, from every rank's point of view.
TEST(Layout, NodeMapNumbersTheRanksOfOtherNodes) {
  for (int32_t rpn : {1, 2, 4}) {
    const NodeMap nm{8, rpn};
    EXPECT_EQ(nm.n_remote(), 8 - rpn);
    for (int32_t me = 0; me < 8; ++me) {
      std::set<int32_t> seen;
      int32_t last = -1;
      for (int32_t peer = 0; peer < 8; ++peer) {
        EXPECT_EQ(nm.remote(me, peer), me / rpn != peer / rpn);
        if (!nm.remote(me, peer)) continue;
        const int32_t i = nm.remote_index(me, peer);
        EXPECT_GT(i, last) << "rank order";
        last = i;
        seen.insert(i);
      }
      EXPECT_EQ(int32_t(seen.size()), nm.n_remote());
      if (!seen.empty()) {
        EXPECT_EQ(*seen.begin(), 0);
        EXPECT_EQ(*seen.rbegin(), nm.n_remote() - 1);
      }
    }
  }
  EXPECT_FALSE((NodeMap{4, 4}).remote(0, 3));
}

// The outbox: each remote rank's meta record and stream slice, then the combine rows, disjoint
// and inside bytes(); a stream slice holds max_tokens messages, as the receive buffer's slice of
// one source does.
TEST(Layout, OutboxRegionsDoNotOverlap) {
  for (TokenFormat f : {TokenFormat::kBF16, TokenFormat::kFp8Blockwise, TokenFormat::kNvfp4}) {
    const WindowLayout wl{8, 7168, 8, 256, 100, f, 1};
    const OutboxLayout ob{wl, 6, 5000};
    const int64_t msgs = wl.dispatch_recv().offset(1, 0) - wl.dispatch_recv().offset(0, 0);
    for (int32_t i = 0; i < 6; ++i) {
      EXPECT_GE(ob.stream_offset(i), ob.meta_offset(i) + wl.meta().bytes());
      EXPECT_LT(ob.stream_offset(i), ob.meta_offset(i) + wl.meta().bytes() + 128);
      EXPECT_LE(ob.stream_offset(i) + msgs, ob.meta_offset(i + 1));
      EXPECT_EQ(ob.stream_offset(i) % 128, 0);  // staged messages start on a line
    }
    EXPECT_LE(ob.meta_offset(6), ob.combine_offset(0));
    EXPECT_LE(ob.combine_offset(5000), ob.bytes());
    EXPECT_EQ(ob.combine_offset(1) - ob.combine_offset(0), wl.combine_recv().row_bytes());
  }
  EXPECT_EQ((OutboxLayout{WindowLayout{4, 2048, 4, 32, 64, TokenFormat::kBF16, 0}, 0, 0}).bytes(),
            0);
}

// The low-latency path's parts, as byte ranges of a message: codes and scales of consecutive
// parts tile the payload's codes and scales exactly.
TEST(Layout, PartRangesTileThePayload) {
  for (TokenFormat f : {TokenFormat::kBF16, TokenFormat::kFp8Blockwise, TokenFormat::kNvfp4,
                        TokenFormat::kMxfp8, TokenFormat::kMxfp4}) {
    for (int32_t H : {2048, 2560, 7168}) {
      if (H % format_hidden_multiple(f) != 0) continue;
      const MessageLayout ml{H, 8, f};
      int64_t codes = ml.payload_offset(), scales = ml.scales_offset();
      for (int32_t p = 0; p < num_parts(H); ++p) {
        EXPECT_EQ(ml.part_codes_offset(p), codes) << token_format_name(f) << " H " << H;
        EXPECT_EQ(ml.part_scales_offset(p), scales) << token_format_name(f) << " H " << H;
        codes += ml.part_codes_bytes(p);
        scales += ml.part_scales_bytes(p);
      }
      EXPECT_EQ(codes, ml.payload_offset() + format_row_bytes(f, H));
      EXPECT_EQ(scales - ml.scales_offset(),
                int64_t(format_scales_per_row(f, H)) * format_scale_bytes(f));
      EXPECT_LE(scales, ml.bytes());
    }
  }
}

// The combine work split: rows cut into parts only when there are fewer than about twice as many
// as warps, never into more parts than 256-column steps, at the least cost (combine_split_cost);
// the host picks the kernel whose loads span several steps when a part does.
TEST(Layout, CombineSplitAndLoadShape) {
  const int64_t warps_8 = 8 * detail::kCombineWarps, warps_132 = 132 * detail::kCombineWarps;
  const int64_t warps_24 = 24 * detail::kCombineWarps;
  // The cost: the busiest warp's items x (steps an item + 1).
  EXPECT_EQ(detail::combine_split_cost(128, 28, 2112, 16), 3);  // 1 item of 2 steps
  EXPECT_EQ(detail::combine_split_cost(128, 28, 2112, 28), 4);  // 2 items of 1 step
  EXPECT_EQ(detail::combine_split_cost(460, 28, 384, 1), 58);   // 2 items of 28 steps
  EXPECT_EQ(detail::combine_split_cost(460, 28, 384, 3), 44);   // 4 items of 10 steps
  EXPECT_EQ(detail::combine_split(4096, 7168, warps_8), 1);
  // 4096 rows on 2112 warps: 2 whole rows a warp (cost 2 x 29) beat 4 halves (4 x 15).
  EXPECT_EQ(detail::combine_split(4096, 7168, warps_132), 1);
  // Decode's 128 tokens on 132 SMs: one item of 2 steps a warp (16 parts), not two of one.
  EXPECT_EQ(detail::combine_split(128, 7168, warps_132), 16);
  EXPECT_EQ(detail::combine_split(128, 7168, warps_24), 3);  // one item of 10 steps a warp
  // 460 messages on 384 warps: 3 parts (at most 4 items of 10 steps), not whole rows (2 of 28).
  EXPECT_EQ(detail::combine_split(460, 7168, warps_24), 3);
  EXPECT_EQ(detail::combine_split(64, 7168, warps_132), 28);  // capped at the 28 steps
  EXPECT_EQ(detail::combine_split(0, 7168, warps_8), 1);
  EXPECT_EQ(detail::combine_split(1, 100, warps_8), 1);  // one step, however few rows
  EXPECT_EQ(detail::combine_split(int64_t(1) << 30, 7168, warps_8), 1);  // too many to split
  EXPECT_TRUE(detail::combine_whole_rows(4096, 7168, 8));
  EXPECT_TRUE(detail::combine_whole_rows(4096, 7168, 132));
  EXPECT_TRUE(detail::combine_whole_rows(128, 7168, 132));   // parts of 1 or 2 steps
  EXPECT_FALSE(detail::combine_whole_rows(64, 7168, 132));   // one step per part
  EXPECT_FALSE(detail::combine_whole_rows(4096, 256, 8));    // one step is the whole row
}

// combine_split is the cheapest of every split that gives no warp more than
// kCombineSplitItems items (and split 1), found by trying each.
TEST(Layout, CombineSplitIsTheCheapest) {
  for (int32_t hidden : {256, 2880, 4096, 7168, 7200})
    for (int32_t blocks : {1, 8, 24, 32, 132})
      for (int64_t rows : {0, 1, 7, 64, 100, 128, 129, 460, 1000, 2048, 4096, 8192, 32768}) {
        const int32_t steps = (hidden + detail::kCombineStep - 1) / detail::kCombineStep;
        const int32_t warps = blocks * detail::kCombineWarps;
        const int32_t r = int32_t(rows);
        int32_t best = 1, best_cost = detail::combine_split_cost(r, steps, warps, 1);
        for (int32_t s = 2; s <= steps; ++s) {
          if ((rows * s + warps - 1) / warps > detail::kCombineSplitItems) continue;
          const int32_t c = detail::combine_split_cost(r, steps, warps, s);
          if (c < best_cost) best = s, best_cost = c;
        }
        const int32_t got = detail::combine_split(rows, hidden, warps);
        ASSERT_GE(got, 1);
        ASSERT_LE(got, steps);
        // As cheap as the cheapest (of equally cheap splits it may take more parts: for k items
        // a warp it takes the most parts that keep k, e.g. 16 of 28 steps where 14 cost as much).
        EXPECT_EQ(detail::combine_split_cost(r, steps, warps, got), best_cost)
            << "rows " << rows << " hidden " << hidden << " blocks " << blocks << ": split " << got
            << " against " << best;
      }
}

// GroupSlots: the group of a row (empty groups skipped: the last group starting at or before
// it), its slot, and its row in the padded layout; capacity 0 leaves rows where they are.
TEST(GroupSlots, FindsGroupsAndSlots) {
  const uint32_t offsets[] = {0, 0, 3, 3, 5};  // groups 0 and 2 empty
  const GroupSlots padded{offsets, 4, 4};
  const int32_t group[] = {1, 1, 1, 3, 3};
  const int64_t row[] = {4, 5, 6, 12, 13};
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(padded.group_of(i), group[i]) << "row " << i;
    EXPECT_EQ(padded.slot_row(i), row[i]) << "row " << i;
  }
  EXPECT_EQ(padded.slot_in(3, 4), 1);
  const GroupSlots in_place{offsets, 4, 0};
  for (int64_t i = 0; i < 5; ++i)
    EXPECT_EQ(in_place.slot_row(i), i);
}
