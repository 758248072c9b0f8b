#include "epcomm/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "epcomm/bf16.h"
#include "epcomm/config.h"
#include "epcomm/detail/window_layout.h"
#include "epcomm/forwarding.h"

namespace epcomm {
namespace reference {

TopkError validate_topk(const int32_t* topk_ids, int32_t num_tokens, int32_t top_k,
                        int32_t n_experts, int32_t dup_begin, int32_t dup_end) {
  if (dup_end < 0) dup_end = n_experts;
  for (int32_t t = 0; t < num_tokens; ++t) {
    for (int32_t k = 0; k < top_k; ++k) {
      const int32_t id = topk_ids[int64_t(t) * top_k + k];
      if (id < -1 || id >= n_experts) return TopkError{ErrorCode::kBadExpertId, t, k, id};
      if (id < dup_begin || id >= dup_end) continue;
      for (int32_t j = 0; j < k; ++j)
        if (topk_ids[int64_t(t) * top_k + j] == id)
          return TopkError{ErrorCode::kDuplicateExpert, t, k, id};
    }
  }
  return TopkError{};
}

namespace {
[[noreturn]] void bad_argument(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, "epcomm reference: " + what);
}
// The shape fields as a group's configuration would carry them (the modes off).
Config shape_config(int32_t hidden, int32_t top_k, int32_t n_experts) {
  Config c;
  c.hidden = hidden;
  c.top_k = top_k;
  c.n_experts = n_experts;
  return c;
}
// One token count per rank, none negative, and the shape `c` (its max_tokens_per_rank set from
// the counts) as Config::validate judges it for n_ranks; `what` prefixes the messages.
void check_shape(Config c, int32_t n_ranks, const std::vector<int32_t>& num_tokens,
                 const std::string& what) {
  if (int64_t(num_tokens.size()) != int64_t(n_ranks))
    bad_argument(what + "num_tokens has " + std::to_string(num_tokens.size()) +
                 " entries for n_ranks = " + std::to_string(n_ranks));
  int32_t max_tokens = 0;
  for (size_t r = 0; r < num_tokens.size(); ++r) {
    if (num_tokens[r] < 0)
      bad_argument(what + "num_tokens[" + std::to_string(r) + "] = " +
                   std::to_string(num_tokens[r]) + " is negative");
    max_tokens = std::max(max_tokens, num_tokens[r]);
  }
  c.max_tokens_per_rank = std::max(1, max_tokens);
  c.validate(n_ranks);
}
void check_rank(const Problem& p, int32_t rank, const char* what) {
  if (rank < 0 || rank >= p.n_ranks)
    bad_argument(std::string(what) + ": rank " + std::to_string(rank) + " is outside a problem of " +
                 std::to_string(p.n_ranks) + " ranks");
}
void check_length(const char* what, int32_t rank, size_t have, int64_t want) {
  if (int64_t(have) != want)
    bad_argument("rank " + std::to_string(rank) + "'s " + what + " holds " + std::to_string(have) +
                 " values, expected " + std::to_string(want));
}
// A combine's layouts and expert outputs: one of each per rank, each output covering its rows.
void check_combine_args(const Problem& p, const std::vector<DispatchResult>& layouts,
                        const std::vector<std::vector<uint16_t>>& expert_out, int32_t rank) {
  check_problem(p);
  check_rank(p, rank, "combine");
  if (int64_t(layouts.size()) != p.n_ranks || int64_t(expert_out.size()) != p.n_ranks)
    bad_argument("combine: " + std::to_string(layouts.size()) + " layouts and " +
                 std::to_string(expert_out.size()) + " expert outputs for " +
                 std::to_string(p.n_ranks) + " ranks (one of each per rank)");
  for (int32_t d = 0; d < p.n_ranks; ++d) {
    const DispatchResult& l = layouts[size_t(d)];
    for (const SrcInfo& si : l.src_info) {
      if (si.rank == -1 && si.token == -1 && si.slot == -1) continue;  // a format's padding row
      if (si.rank < 0 || si.rank >= p.n_ranks || si.token < 0 || si.slot < 0 ||
          si.slot > p.top_k || si.token >= p.ranks[size_t(si.rank)].num_tokens)
        bad_argument("combine: layout " + std::to_string(d) +
                     " is not a dispatch result of this problem (a src_info entry names rank " +
                     std::to_string(si.rank) + ", token " + std::to_string(si.token) +
                     ", slot " + std::to_string(si.slot) + ")");
    }
    if (int64_t(expert_out[size_t(d)].size()) < l.rows() * p.hidden)
      bad_argument("combine: expert output " + std::to_string(d) + " holds " +
                   std::to_string(expert_out[size_t(d)].size()) + " values, its layout needs " +
                   std::to_string(l.rows() * p.hidden) + " (rows x hidden)");
  }
}
}  // namespace

void check_problem(const Problem& p) {
  Config c = shape_config(p.hidden, p.top_k, p.n_experts);
  c.shared_expert = p.shared_expert;
  c.skip_a2a = p.skip_a2a;
  c.allreduce_world_size = p.allreduce_world_size;
  std::vector<int32_t> num_tokens;
  for (const RankInput& in : p.ranks) num_tokens.push_back(in.num_tokens);
  check_shape(c, p.n_ranks, num_tokens, "the problem's ");
  for (int32_t r = 0; r < p.n_ranks; ++r) {
    const RankInput& in = p.ranks[size_t(r)];
    check_length("tokens", r, in.tokens.size(), int64_t(in.num_tokens) * p.hidden);
    check_length("topk_ids", r, in.topk_ids.size(), int64_t(in.num_tokens) * p.top_k);
    check_length("weights", r, in.weights.size(), int64_t(in.num_tokens) * p.top_k);
  }
}

const RankInput& rank_input(const Problem& p, int32_t rank, const char* what) {
  check_rank(p, rank, what);
  if (size_t(rank) >= p.ranks.size())
    bad_argument(std::string(what) + ": the problem holds " + std::to_string(p.ranks.size()) +
                 " ranks' inputs");
  return p.ranks[size_t(rank)];
}
RankInput& rank_input(Problem& p, int32_t rank, const char* what) {
  return const_cast<RankInput&>(rank_input(static_cast<const Problem&>(p), rank, what));
}

RouteMap Problem::route(int32_t rank) const {
  return RouteMap::make(n_experts, top_k, n_ranks, rank, shared_expert, skip_a2a,
                        allreduce_world_size);
}

namespace {
// Rank s's tokens go out (its topk_ids pass the checks its dispatch makes).
bool sends(const Problem& p, int32_t s) {
  const RankInput& in = p.ranks[size_t(s)];
  const int32_t n_local = p.n_experts / p.n_ranks;
  const int32_t lo = p.skip_a2a ? s * n_local : 0, hi = p.skip_a2a ? lo + n_local : p.n_experts;
  return validate_topk(in.topk_ids.data(), in.num_tokens, p.top_k, p.n_experts, lo, hi).code ==
         ErrorCode::kOk;
}

void add_row(DispatchResult& r, const Problem& p, int32_t s, int32_t t, int32_t slot) {
  const RankInput& in = p.ranks[size_t(s)];
  r.src_info.push_back(SrcInfo{t, int16_t(s), int16_t(slot)});
  const uint16_t* row = in.tokens.data() + size_t(t) * p.hidden;
  r.tokens.insert(r.tokens.end(), row, row + p.hidden);
}
}  // namespace

DispatchResult dispatch(const Problem& p, int32_t rank) {
  check_problem(p);
  check_rank(p, rank, "dispatch");
  const int32_t n_local = p.n_experts / p.n_ranks;
  const int32_t shared = p.shared_expert ? 1 : 0, G = n_local + shared;
  DispatchResult r;
  r.row_offsets.assign(size_t(G) + 1, 0);
  r.expert_ids.resize(size_t(G));
  std::vector<bool> ok(static_cast<size_t>(p.n_ranks));
  for (int32_t s = 0; s < p.n_ranks; ++s) ok[size_t(s)] = sends(p, s);
  // The shared expert: group 0, this rank's own share of its tokens in token order.
  if (shared) {
    r.expert_ids[0] = kSharedExpertId;
    if (ok[size_t(rank)]) {
      const RouteMap rm = p.route(rank);
      const int32_t T = p.ranks[size_t(rank)].num_tokens;
      const int32_t begin = rm.shared_begin(T);
      for (int32_t t = begin; t < begin + rm.shared_count(T); ++t)
        add_row(r, p, rank, t, p.top_k);
    }
    r.row_offsets[1] = uint32_t(r.src_info.size());
  }
  // The local experts: group-major, then source rank (skip_a2a: this rank only), then source
  // token index.
  for (int32_t l = 0; l < n_local; ++l) {
    const int32_t g = shared + l;
    r.expert_ids[size_t(g)] = l;
    const int32_t expert = rank * n_local + l;
    for (int32_t s = 0; s < p.n_ranks; ++s) {
      if (!ok[size_t(s)] || (p.skip_a2a && s != rank)) continue;
      const RankInput& in = p.ranks[size_t(s)];
      for (int32_t t = 0; t < in.num_tokens; ++t)
        for (int32_t k = 0; k < p.top_k; ++k)
          if (in.topk_ids[size_t(t) * p.top_k + k] == expert) add_row(r, p, s, t, k);
    }
    r.row_offsets[size_t(g) + 1] = uint32_t(r.src_info.size());
  }
  return r;
}

namespace {
// Where each of rank `rank`'s (token, slot) rows went: (expert rank, row), {-1, -1} if nowhere.
// Slots: the top_k routed ones, then the shared expert's.
std::vector<std::pair<int32_t, int64_t>> slot_rows(const Problem& p,
                                                   const std::vector<DispatchResult>& layouts,
                                                   int32_t rank, int32_t T) {
  const int64_t K = p.top_k + (p.shared_expert ? 1 : 0);
  std::vector<std::pair<int32_t, int64_t>> where(static_cast<size_t>(T * K), {-1, -1});
  for (int32_t d = 0; d < p.n_ranks; ++d) {
    const DispatchResult& l = layouts[size_t(d)];
    for (int64_t row = 0; row < l.rows(); ++row) {
      const SrcInfo& si = l.src_info[size_t(row)];
      if (si.rank == rank) where[size_t(si.token * K + si.slot)] = {d, row};
    }
  }
  return where;
}
}  // namespace

std::vector<double> combine(const Problem& p, const std::vector<DispatchResult>& layouts,
                            const std::vector<std::vector<uint16_t>>& expert_out, int32_t rank,
                            bool weighted) {
  check_combine_args(p, layouts, expert_out, rank);
  const RankInput& in = p.ranks[size_t(rank)];
  const int32_t T = sends(p, rank) ? in.num_tokens : 0;
  const int64_t H = p.hidden, K = p.top_k, slots = K + (p.shared_expert ? 1 : 0);
  const auto where = slot_rows(p, layouts, rank, T);
  std::vector<double> out(static_cast<size_t>(weighted ? T * H : T * K * H), 0.0);
  for (int32_t t = 0; t < T; ++t) {
    for (int32_t k = 0; k < (weighted ? slots : K); ++k) {  // un-reduced: no shared slot
      if (k < K && in.topk_ids[size_t(t * K + k)] < 0) continue;
      const auto [d, row] = where[size_t(t * slots + k)];
      if (d < 0) continue;  // skip_a2a: another rank's expert; the shared slot of another share
      const uint16_t* y = expert_out[size_t(d)].data() + row * H;
      const double w = !weighted || k == K ? 1.0 : double(in.weights[size_t(t * K + k)]);
      double* o = out.data() + (weighted ? t * H : (t * K + k) * H);
      for (int64_t h = 0; h < H; ++h) o[h] += w * double(bf16_to_float(y[h]));
    }
  }
  return out;
}

std::vector<float> combine_expert_side(const Problem& p, const std::vector<DispatchResult>& layouts,
                                       const std::vector<std::vector<uint16_t>>& expert_out,
                                       int32_t rank, int32_t forward_ranks_per_node) {
  check_combine_args(p, layouts, expert_out, rank);
  const int32_t rpn = forward_ranks_per_node;
  if (rpn < 0 || (rpn > 0 && p.n_ranks % rpn != 0))
    bad_argument("combine_expert_side: forward_ranks_per_node = " + std::to_string(rpn) +
                 " does not divide n_ranks = " + std::to_string(p.n_ranks));
  const detail::NodeMap nm{p.n_ranks, rpn > 0 ? rpn : p.n_ranks};  // 0: one node, all direct
  const RankInput& in = p.ranks[size_t(rank)];
  const int32_t T = sends(p, rank) ? in.num_tokens : 0;
  const int64_t H = p.hidden, K = p.top_k, slots = K + (p.shared_expert ? 1 : 0);
  const ExpertMap em{p.n_experts, p.n_ranks};
  const auto where = slot_rows(p, layouts, rank, T);
  std::vector<float> out(static_cast<size_t>(T * H), 0.0f);
  // p_r of every rank r for the token in hand, already rounded to bf16 (held as float).
  std::vector<float> partial(static_cast<size_t>(p.n_ranks * H));
  std::vector<bool> any(static_cast<size_t>(p.n_ranks));
  std::vector<float> node_sum(static_cast<size_t>(H));
  for (int32_t t = 0; t < T; ++t) {
    for (int32_t r = 0; r < p.n_ranks; ++r) {
      any[size_t(r)] = false;
      float* pr = partial.data() + r * H;
      std::fill(pr, pr + H, 0.0f);
      // The expert side: slot ascending (the shared expert's last, on this rank, weight 1),
      // fused multiply-add.
      for (int32_t k = 0; k < slots; ++k) {
        const int32_t id = k < K ? in.topk_ids[size_t(t * K + k)] : -1;
        if (k < K && (id < 0 || em.rank_of(id) != r)) continue;
        if (k == K && r != rank) continue;
        const auto [d, row] = where[size_t(t * slots + k)];
        if (d < 0) continue;  // skip_a2a: another rank's expert; the shared slot of another share
        any[size_t(r)] = true;
        const uint16_t* y = expert_out[size_t(d)].data() + row * H;
        const float w = k < K ? in.weights[size_t(t * K + k)] : 1.0f;
        for (int64_t h = 0; h < H; ++h)
          pr[h] = std::fma(w, bf16_to_float(y[h]), pr[h]);
      }
      for (int64_t h = 0; h < H; ++h)
        pr[h] = bf16_to_float(float_to_bf16(pr[h]));
    }
    float* o = out.data() + t * H;  // the token side: bf16 rows added in fp32, rank order
    for (int32_t r = 0; r < p.n_ranks; ++r) {
      if (!nm.remote(rank, r)) {
        if (!any[size_t(r)]) continue;
        const float* pr = partial.data() + r * H;
        for (int64_t h = 0; h < H; ++h)
          o[h] += pr[h];
        continue;
      }
      // Another node, forwarded: its relay's sum of the node's rows, at the node's first rank.
      if (nm.local_of(r) != 0) continue;
      bool reached = false;
      std::fill(node_sum.begin(), node_sum.end(), 0.0f);
      for (int32_t q = r; q < r + nm.ranks_per_node; ++q) {
        if (!any[size_t(q)]) continue;
        reached = true;
        const float* pq = partial.data() + q * H;
        for (int64_t h = 0; h < H; ++h)
          node_sum[size_t(h)] += pq[h];
      }
      if (!reached) continue;
      for (int64_t h = 0; h < H; ++h)
        o[h] += bf16_to_float(float_to_bf16(node_sum[size_t(h)]));
    }
  }
  return out;
}

uint64_t destination_ranks(const Problem& p, int32_t rank, int32_t t) {
  const RankInput& in = rank_input(p, rank, "destination_ranks");
  if (t < 0 || t >= in.num_tokens)
    bad_argument("destination_ranks: token " + std::to_string(t) + " of rank " +
                 std::to_string(rank) + ", which has " + std::to_string(in.num_tokens));
  if (p.skip_a2a) return 0;
  const ExpertMap em{p.n_experts, p.n_ranks};
  uint64_t mask = 0;
  for (int32_t k = 0; k < p.top_k; ++k) {
    const int32_t id = in.topk_ids[size_t(t) * p.top_k + k];
    if (id >= 0 && id < p.n_experts) mask |= uint64_t(1) << em.rank_of(id);
  }
  return mask;
}

CrossNodeSizes cross_node_sizes(const Problem& p, TokenFormat format, int32_t max_tokens,
                                int32_t ranks_per_node, bool low_latency) {
  check_problem(p);
  const RouteMap rm = p.route(0);
  // The window the group would have (its view: GroupView::layout()).
  const detail::WindowLayout w{rm.view_ranks(), p.hidden, rm.slots(), rm.view_experts(),
                               max_tokens,      format,   0};
  CrossNodeSizes s;
  s.message = w.msg().put_bytes(low_latency);
  s.forward_message = detail::forward_message_bytes(w.msg(), ranks_per_node);
  s.combine_row = w.combine_recv().row_bytes();
  s.meta_record = w.meta().payload_bytes();
  s.forward_record =
      detail::RelayLayout{1, max_tokens, ranks_per_node, w.msg(), low_latency ? 1 : 0}
          .meta()
          .payload_bytes();
  return s;
}

std::vector<CrossNodeTraffic> cross_node_traffic(const Problem& p, int32_t ranks_per_node,
                                                 const CrossNodeSizes& sizes) {
  check_problem(p);
  if (ranks_per_node < 1 || p.n_ranks % ranks_per_node != 0)
    bad_argument("cross_node_traffic: ranks_per_node = " + std::to_string(ranks_per_node) +
                 " does not divide n_ranks = " + std::to_string(p.n_ranks));
  const ForwardPlan plan = ForwardPlan::make(p.n_ranks, ranks_per_node);
  const detail::NodeMap& nm = plan.nodes;
  const ExpertMap em{p.n_experts, p.n_ranks};
  std::vector<CrossNodeTraffic> out(static_cast<size_t>(p.n_ranks));
  if (p.skip_a2a) return out;  // no traffic between ranks
  for (int32_t s = 0; s < p.n_ranks; ++s) {
    out[size_t(s)].direct.meta_records = nm.n_remote();
    out[size_t(s)].forwarded.meta_records = nm.n_remote();
    // The relay of every other node needs this call's count, zero or not.
    out[size_t(s)].forwarded.forward_records = plan.n_nodes() - 1;
    if (!sends(p, s)) continue;  // the device sends nothing for refused topk_ids
    const RankInput& in = p.ranks[size_t(s)];
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      const uint64_t dest = destination_ranks(p, s, t);
      for (uint64_t bits = dest; bits != 0; bits &= bits - 1) {  // destination ranks ascending
        const int32_t d = __builtin_ctzll(bits);
        if (!nm.remote(s, d)) continue;
        ++out[size_t(s)].direct.dispatch_messages;
        ++out[size_t(d)].direct.combine_rows_expert_side;
        const int32_t relay = plan.relay_for(s, d);
        // One forwarded message per node: counted at the node's first destination rank.
        const int32_t first = nm.node_of(d) * nm.ranks_per_node;
        if (((dest >> first) & ((uint64_t(1) << (d - first)) - 1)) == 0) {
          ++out[size_t(s)].forwarded.dispatch_messages;
          ++out[size_t(relay)].forwarded.combine_rows_expert_side;
        }
        if (d != relay) ++out[size_t(relay)].relay_copies;
      }
      for (int32_t k = 0; k < p.top_k; ++k) {
        const int32_t id = in.topk_ids[size_t(t) * p.top_k + k];
        if (id < 0 || !nm.remote(s, em.rank_of(id))) continue;
        ++out[size_t(em.rank_of(id))].direct.combine_rows_token_side;
        ++out[size_t(em.rank_of(id))].forwarded.combine_rows_token_side;
      }
    }
  }
  for (CrossNodeTraffic& c : out) {
    for (CrossNodePuts* q : {&c.direct, &c.forwarded}) {
      const int64_t msg = q == &c.direct ? sizes.message : sizes.forward_message;
      q->dispatch_bytes = q->dispatch_messages * msg + q->meta_records * sizes.meta_record +
                          q->forward_records * sizes.forward_record;
      q->combine_bytes_expert_side = q->combine_rows_expert_side * sizes.combine_row;
      q->combine_bytes_token_side = q->combine_rows_token_side * sizes.combine_row;
    }
  }
  return out;
}

std::vector<ForwardStream> forward_streams(const Problem& p, int32_t s, int32_t ranks_per_node) {
  check_problem(p);
  if (ranks_per_node < 1 || p.n_ranks % ranks_per_node != 0)
    bad_argument("forward_streams: ranks_per_node = " + std::to_string(ranks_per_node) +
                 " does not divide n_ranks = " + std::to_string(p.n_ranks));
  const RankInput& in = rank_input(p, s, "forward_streams");
  const ForwardPlan plan = ForwardPlan::make(p.n_ranks, ranks_per_node);
  const detail::NodeMap& nm = plan.nodes;
  const bool any = sends(p, s);
  const int32_t chunks = detail::num_chunks(in.num_tokens);
  std::vector<ForwardStream> out;
  for (int32_t node = 0; node < plan.n_nodes(); ++node) {
    if (node == nm.node_of(s)) continue;
    ForwardStream f;
    f.node = node;
    f.relay = plan.relay(s, node);
    f.slot.assign(static_cast<size_t>(in.num_tokens), -1);
    f.chunk_start.assign(static_cast<size_t>(chunks) + 1, 0);
    int32_t n = 0;
    for (int32_t t = 0; t < in.num_tokens; ++t) {
      if (t % detail::kChunkTokens == 0) f.chunk_start[size_t(t / detail::kChunkTokens)] = n;
      const uint64_t dest = any ? destination_ranks(p, s, t) : 0;
      if (nm.local_ranks(dest, node) != 0) f.slot[size_t(t)] = n++;
    }
    f.chunk_start[size_t(chunks)] = n;
    out.push_back(std::move(f));
  }
  return out;
}

std::vector<int32_t> make_topk(int32_t num_tokens, int32_t top_k, int32_t n_experts,
                               std::mt19937_64& rng, double zipf_s, double mask_prob) {
  if (num_tokens < 0 || top_k < 1 || n_experts < top_k)
    bad_argument("make_topk: num_tokens = " + std::to_string(num_tokens) + ", top_k = " +
                 std::to_string(top_k) + ", n_experts = " + std::to_string(n_experts) +
                 " (need num_tokens >= 0 and 1 <= top_k <= n_experts: K distinct experts)");
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::vector<double> popularity(static_cast<size_t>(n_experts), 1.0);
  if (zipf_s > 0) {
    // A random permutation of experts gets Zipf(s) popularity: rank i has weight 1/(i+1)^s.
    std::vector<int32_t> perm(static_cast<size_t>(n_experts));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int32_t i = 0; i < n_experts; ++i)
      popularity[size_t(perm[size_t(i)])] = 1.0 / std::pow(double(i + 1), zipf_s);
  }
  std::vector<int32_t> ids(static_cast<size_t>(num_tokens) * top_k);
  std::vector<std::pair<double, int32_t>> scores(static_cast<size_t>(n_experts));
  for (int32_t t = 0; t < num_tokens; ++t) {
    for (int32_t e = 0; e < n_experts; ++e) {
      double s = std::fabs(normal(rng)) + 1.0;
      if (zipf_s > 0) s = popularity[size_t(e)] * -std::log(1.0 - uni(rng));  // Gumbel-ish draw
      scores[size_t(e)] = {s, e};
    }
    std::partial_sort(scores.begin(), scores.begin() + top_k, scores.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    for (int32_t k = 0; k < top_k; ++k)
      ids[size_t(t) * top_k + k] = uni(rng) < mask_prob ? -1 : scores[size_t(k)].second;
  }
  return ids;
}

std::vector<uint16_t> make_tokens(int64_t count, std::mt19937_64& rng, float scale) {
  std::uniform_real_distribution<float> mag(0.5f, 2.0f);
  std::vector<uint16_t> v(static_cast<size_t>(count));
  for (auto& x : v) {
    const float f = mag(rng) * scale * ((rng() & 1) ? 1.f : -1.f);
    x = float_to_bf16(f);
  }
  return v;
}

std::vector<float> make_weights(int64_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  std::vector<float> v(static_cast<size_t>(count));
  for (auto& x : v) x = u(rng);
  return v;
}

Problem make_replicated_problem(int32_t n_ranks, int32_t hidden, int32_t top_k, int32_t n_experts,
                                int32_t num_tokens, uint64_t seed, double zipf_s,
                                double mask_prob) {
  Problem p = make_problem(1, hidden, top_k, n_experts, {num_tokens}, seed, zipf_s, mask_prob);
  p.n_ranks = n_ranks;
  p.ranks.resize(size_t(std::max(n_ranks, 1)), p.ranks[0]);
  check_problem(p);
  return p;
}

Problem make_problem(int32_t n_ranks, int32_t hidden, int32_t top_k, int32_t n_experts,
                     const std::vector<int32_t>& num_tokens, uint64_t seed, double zipf_s,
                     double mask_prob) {
  check_shape(shape_config(hidden, top_k, n_experts), n_ranks, num_tokens, "make_problem: ");
  Problem p;
  p.n_ranks = n_ranks;
  p.hidden = hidden;
  p.top_k = top_k;
  p.n_experts = n_experts;
  for (int32_t r = 0; r < n_ranks; ++r) {
    std::mt19937_64 rng(seed * 1000003ull + uint64_t(r));
    RankInput in;
    in.num_tokens = num_tokens[size_t(r)];
    in.tokens = make_tokens(int64_t(in.num_tokens) * hidden, rng);
    in.topk_ids = make_topk(in.num_tokens, top_k, n_experts, rng, zipf_s, mask_prob);
    in.weights = make_weights(int64_t(in.num_tokens) * top_k, rng);
    p.ranks.push_back(std::move(in));
  }
  return p;
}

std::string compare_dispatch(const DispatchResult& ref, const uint32_t* row_offsets,
                             const int32_t* expert_ids, const SrcInfo* src_info,
                             const uint16_t* tokens, int32_t hidden) {
  if (hidden < 1 || int64_t(ref.tokens.size()) != ref.rows() * hidden)
    bad_argument("compare_dispatch: hidden = " + std::to_string(hidden) + " for a reference of " +
                 std::to_string(ref.rows()) + " rows and " + std::to_string(ref.tokens.size()) +
                 " values");
  std::ostringstream os;
  const size_t G = ref.expert_ids.size();
  for (size_t g = 0; g <= G; ++g)
    if (row_offsets[g] != ref.row_offsets[g]) {
      os << "row_offsets[" << g << "] = " << row_offsets[g] << ", expected " << ref.row_offsets[g];
      return os.str();
    }
  for (size_t g = 0; g < G; ++g)
    if (expert_ids[g] != ref.expert_ids[g]) {
      os << "expert_ids[" << g << "] = " << expert_ids[g] << ", expected " << ref.expert_ids[g];
      return os.str();
    }
  for (int64_t r = 0; r < ref.rows(); ++r) {
    const SrcInfo a = src_info[r], b = ref.src_info[size_t(r)];
    if (a.token != b.token || a.rank != b.rank || a.slot != b.slot) {
      os << "src_info[" << r << "] = (rank " << a.rank << ", token " << a.token << ", slot "
         << a.slot << "), expected (rank " << b.rank << ", token " << b.token << ", slot "
         << b.slot << ")";
      return os.str();
    }
    for (int32_t h = 0; h < hidden; ++h) {
      const uint16_t x = tokens[r * hidden + h], y = ref.tokens[size_t(r * hidden + h)];
      if (x != y) {
        os << "tokens[" << r << "][" << h << "] = 0x" << std::hex << x << ", expected 0x" << y;
        return os.str();
      }
    }
  }
  return "";
}

namespace {
double norm_ratio(const std::vector<double>& ref, const double* diff_sq_sum) {
  double rn = 0;
  for (double x : ref) rn += x * x;
  return rn > 0 ? std::sqrt(*diff_sq_sum / rn) : std::sqrt(*diff_sq_sum);
}
}  // namespace

std::string compare_combine_bf16(const std::vector<double>& ref, const uint16_t* out,
                                 int64_t count) {
  double max_ref = 0;
  for (double x : ref) max_ref = std::max(max_ref, std::fabs(x));
  double d2 = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double o = bf16_to_float(out[i]), r = ref[size_t(i)];
    const double err = std::fabs(o - r);
    // Output rounding (half a bf16 ulp: 2^-9 relative) plus fp32 accumulation on cancellation.
    const double tol = std::ldexp(std::fabs(r), -8) + std::ldexp(max_ref, -20);
    if (!(err <= tol)) {
      std::ostringstream os;
      os << "out[" << i << "] = " << o << ", reference " << r << " (error " << err
         << " > tolerance " << tol << ")";
      return os.str();
    }
    d2 += err * err;
  }
  const double ratio = norm_ratio(ref, &d2);
  if (!(ratio <= std::ldexp(1.0, -8))) {
    std::ostringstream os;
    os << "||out - ref|| / ||ref|| = " << ratio << " > 2^-8";
    return os.str();
  }
  return "";
}

std::string compare_combine_f32(const std::vector<double>& ref, const float* out, int64_t count,
                                double rel_tol) {
  double d2 = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(out[i])) {
      std::ostringstream os;
      os << "out[" << i << "] = " << out[i] << " is not finite";
      return os.str();
    }
    const double e = double(out[i]) - ref[size_t(i)];
    d2 += e * e;
  }
  const double ratio = norm_ratio(ref, &d2);
  if (!(ratio <= rel_tol)) {
    std::ostringstream os;
    os << "||out - ref|| / ||ref|| = " << ratio << " > " << rel_tol;
    return os.str();
  }
  return "";
}

std::string compare_exact_bf16(const std::vector<double>& ref, const uint16_t* out,
                               int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const double o = bf16_to_float(out[i]);
    if (o != ref[size_t(i)]) {
      std::ostringstream os;
      os << "out[" << i << "] = " << o << ", expected exactly " << ref[size_t(i)];
      return os.str();
    }
  }
  return "";
}

std::string compare_combine_expert_side(const std::vector<float>& ref, const uint16_t* out,
                                        int64_t count) {
  if (int64_t(ref.size()) != count) {
    std::ostringstream os;
    os << "output has " << count << " values, the reference " << ref.size();
    return os.str();
  }
  std::vector<double> rounded(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) rounded[i] = bf16_to_float(float_to_bf16(ref[i]));
  return compare_exact_bf16(rounded, out, count);
}

}  // namespace reference
}  // namespace epcomm
