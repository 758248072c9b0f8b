#include "harness.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <string>

#include "epcomm/bf16.h"
#include "epcomm/padded_layout.h"

namespace epcomm {
namespace testing {

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int device_of_rank(int rank) { return rank % std::max(gpu_count(), 1); }

int ranks_per_gpu(int n_ranks) {
  const int gpus = std::max(gpu_count(), 1);
  return (n_ranks + gpus - 1) / gpus;
}

int suite_ranks() { return std::min(std::max(gpu_count(), 4), 8); }

namespace {
std::mutex shared_mu;
std::set<std::string>& shared_tests() {
  static std::set<std::string> names;
  return names;
}
}  // namespace

Config placed(Config cfg, int n_ranks, int ranks_per_node) {
  if (ranks_per_node > 0) cfg.ranks_per_node = ranks_per_node;
  const int per_gpu = ranks_per_gpu(n_ranks);
  if (per_gpu <= 1) return cfg;
  cfg.share_gpus = true;
  const int fit = max_resident_blocks(cfg, n_ranks, 0) / per_gpu;
  cfg.num_sms = std::max(1, std::min(cfg.num_sms, fit));
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::lock_guard<std::mutex> lock(shared_mu);
  const bool first = shared_tests().insert(info ? std::string(info->test_suite_name()) + "." + info->name()
                                                : std::string("(outside a test)")).second;
  if (first)
    std::printf("[epcomm] %d ranks share %d GPU(s) (%d per GPU, num_sms %d each)\n", n_ranks,
                std::max(gpu_count(), 1), per_gpu, cfg.num_sms);
  return cfg;
}

int shared_gpu_tests() {
  std::lock_guard<std::mutex> lock(shared_mu);
  return int(shared_tests().size());
}

DeviceBuffer::DeviceBuffer(int device, size_t bytes) : device_(device), bytes_(bytes) {
  EPCOMM_CUDA_OK(cudaSetDevice(device));
  EPCOMM_CUDA_OK(cudaMalloc(&ptr_, bytes ? bytes : 16));
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) {
    (void)cudaSetDevice(device_);
    (void)cudaFree(ptr_);
  }
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  std::swap(device_, o.device_);
  std::swap(ptr_, o.ptr_);
  std::swap(bytes_, o.bytes_);
  return *this;
}
void DeviceBuffer::upload(const void* src, size_t bytes, cudaStream_t s) {
  if (bytes == 0) return;
  EPCOMM_CUDA_OK(cudaSetDevice(device_));
  EPCOMM_CUDA_OK(cudaMemcpyAsync(ptr_, src, bytes, cudaMemcpyHostToDevice, s));
  EPCOMM_CUDA_OK(cudaStreamSynchronize(s));
}
void DeviceBuffer::download(void* dst, size_t bytes) const {
  if (bytes == 0) return;
  EPCOMM_CUDA_OK(cudaSetDevice(device_));
  EPCOMM_CUDA_OK(cudaMemcpy(dst, ptr_, bytes, cudaMemcpyDeviceToHost));
}
void DeviceBuffer::fill(int byte, cudaStream_t s) {
  EPCOMM_CUDA_OK(cudaSetDevice(device_));
  EPCOMM_CUDA_OK(cudaMemsetAsync(ptr_, byte, bytes_, s));
}

RankIO::RankIO(const Group& g, uint64_t seed)
    : rank(g.rank()),
      device(g.device()),
      hidden(g.config().hidden),
      top_k(g.config().top_k),
      max_tokens(g.config().max_tokens_per_rank),
      max_rows(g.sizes().max_recv_rows),
      n_groups(g.sizes().num_groups),
      format(g.config().format),
      nvfp4_global_scale(g.config().nvfp4_global_scale),
      max_routed_rows(g.sizes().max_routed_rows),
      token_bytes(g.sizes().token_bytes),
      padded_capacity(g.config().padded_capacity),
      n_ranks(g.n_ranks()),
      expert_seed(seed) {
  EPCOMM_CUDA_OK(cudaSetDevice(device));
  EPCOMM_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t T = size_t(max_tokens), H = size_t(hidden), K = size_t(top_k);
  tokens = DeviceBuffer(device, T * H * 2);
  topk = DeviceBuffer(device, T * K * 8);  // int32 or int64 ids (id_bytes)
  weights = DeviceBuffer(device, T * K * 4);
  const size_t token_rows =
      padded_capacity > 0 ? size_t(n_groups) * size_t(padded_capacity) : size_t(max_rows);
  out_tokens = DeviceBuffer(device, token_rows * size_t(token_bytes));
  if (padded_capacity > 0) {
    counts = DeviceBuffer(device, size_t(n_groups) * 4);
    slot_token = DeviceBuffer(device, token_rows * 4);
    layout_range = DeviceBuffer(device, size_t(n_groups) * size_t(n_ranks) * 8);
  }
  row_offsets = DeviceBuffer(device, size_t(n_groups + 1) * 4);
  expert_ids = DeviceBuffer(device, size_t(n_groups) * 4);
  src_info = DeviceBuffer(device, size_t(max_rows) * sizeof(SrcInfo));
  if (g.sizes().scales_bytes > 0) scales = DeviceBuffer(device, size_t(g.sizes().scales_bytes));
  if (g.sizes().num_scales_offsets > 0)
    scales_offsets = DeviceBuffer(device, size_t(g.sizes().num_scales_offsets) * 4);
  expert_out = DeviceBuffer(device, size_t(max_rows) * H * 2);
  combine_out = DeviceBuffer(device, T * K * H * 2);
}
RankIO::~RankIO() {
  if (stream) {
    (void)cudaSetDevice(device);
    (void)cudaStreamDestroy(stream);
  }
}

void RankIO::upload(const reference::RankInput& in) {
  num_tokens = in.num_tokens;
  tokens.upload(in.tokens.data(), in.tokens.size() * 2, stream);
  if (id_bytes == 8) {
    std::vector<int64_t> wide(in.topk_ids.begin(), in.topk_ids.end());
    for (const auto& [i, v] : wide_ids)
      wide.at(i) = v;
    topk.upload(wide.data(), wide.size() * 8, stream);  // synchronous: `wide` may go
  } else {
    topk.upload(in.topk_ids.data(), in.topk_ids.size() * 4, stream);
  }
  weights.upload(in.weights.data(), in.weights.size() * 4, stream);
}

void RankIO::poison() {
  for (DeviceBuffer* b : {&out_tokens, &row_offsets, &expert_ids, &src_info, &scales,
                          &scales_offsets, &counts, &slot_token, &layout_range, &combine_out})
    if (b->get() != nullptr) b->fill(0xff, stream);
  EPCOMM_CUDA_OK(cudaStreamSynchronize(stream));
}

DispatchInput RankIO::dispatch_input(bool with_weights) const {
  DispatchInput in{tokens.get(), topk.get<int32_t>(), num_tokens, hidden,
                   with_weights ? weights.get<float>() : nullptr};
  if (id_bytes == 8) {
    in.topk_ids = nullptr;
    in.topk_ids64 = topk.get<int64_t>();
  }
  return in;
}
DispatchOutput RankIO::dispatch_output() const {
  DispatchOutput o{out_tokens.get(),
                   row_offsets.get<uint32_t>(),
                   expert_ids.get<int32_t>(),
                   src_info.get<SrcInfo>(),
                   scales.get(),
                   scales_offsets.get<uint32_t>()};
  o.counts = counts.get<int32_t>();
  o.slot_token = slot_token.get<int32_t>();
  o.layout_range = layout_range.get<int64_t>();
  return o;
}
CombineInput RankIO::combine_input() const {
  if (expert_capacity > 0)
    return CombineInput{padded_expert_out.get(), row_offsets.get<uint32_t>(),
                        src_info.get<SrcInfo>(), combine_cols(), expert_capacity};
  return CombineInput{expert_out.get(), row_offsets.get<uint32_t>(), src_info.get<SrcInfo>(),
                      combine_cols()};
}
CombineOutput RankIO::combine_output(bool weighted) const {
  return CombineOutput{combine_out.get(), weighted ? weights.get<float>() : nullptr};
}

Config make_cfg(int hidden, int top_k, int n_experts, int max_tokens, int num_sms,
                double timeout_seconds) {
  Config c;
  c.hidden = hidden;
  c.top_k = top_k;
  c.n_experts = n_experts;
  c.max_tokens_per_rank = max_tokens;
  c.num_sms = num_sms;
  c.timeout_seconds = timeout_seconds;
  return c;
}

std::vector<int32_t> random_counts(int n, int max_tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint64_t(max_tokens + 1));
  return t;
}

std::vector<uint16_t> expert_outputs(int rank, uint64_t seed, int64_t rows, int32_t hidden) {
  std::mt19937_64 rng(seed * 7919u + uint64_t(rank));
  return reference::make_tokens(rows * hidden, rng);
}

float expert_value(int32_t expert, int32_t token, int32_t column) {
  // A hash of the three to a bf16 value of magnitude in [0.5, 2), never zero.
  uint64_t x = (uint64_t(uint32_t(expert)) << 42) ^ (uint64_t(uint32_t(token)) << 20) ^
               uint64_t(uint32_t(column));
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  const float mag = 0.5f + 1.5f * float(x & 0xffff) / 65536.0f;
  return bf16_to_float(float_to_bf16((x >> 16) & 1 ? -mag : mag));
}

std::vector<uint16_t> function_expert_outputs(const reference::DispatchResult& d, int32_t rank,
                                              int32_t n_local, int32_t hidden) {
  std::vector<uint16_t> y(static_cast<size_t>(d.rows()) * size_t(hidden), 0);
  const int32_t G = int32_t(d.expert_ids.size());
  for (int32_t g = 0; g < G; ++g) {
    const int32_t local = d.expert_ids[size_t(g)];
    const int32_t expert = local == kSharedExpertId ? kSharedExpertId : rank * n_local + local;
    for (int64_t r = d.row_offsets[size_t(g)]; r < int64_t(d.row_offsets[size_t(g) + 1]); ++r) {
      const SrcInfo& si = d.src_info[size_t(r)];
      if (si.rank < 0) continue;  // padding
      for (int32_t h = 0; h < hidden; ++h)
        y[size_t(r) * size_t(hidden) + size_t(h)] =
            float_to_bf16(expert_value(expert, si.token, h));
    }
  }
  return y;
}

std::vector<double> layer_output(const reference::RankInput& in, int32_t top_k, int32_t hidden,
                                 bool shared_expert) {
  std::vector<double> out(static_cast<size_t>(in.num_tokens) * size_t(hidden), 0.0);
  for (int32_t t = 0; t < in.num_tokens; ++t) {
    double* o = out.data() + size_t(t) * size_t(hidden);
    for (int32_t k = 0; k < top_k; ++k) {
      const int32_t e = in.topk_ids[size_t(t) * size_t(top_k) + size_t(k)];
      if (e < 0) continue;
      const double w = in.weights[size_t(t) * size_t(top_k) + size_t(k)];
      for (int32_t h = 0; h < hidden; ++h)
        o[h] += w * double(expert_value(e, t, h));
    }
    if (shared_expert)
      for (int32_t h = 0; h < hidden; ++h)
        o[h] += double(expert_value(kSharedExpertId, t, h));
  }
  return out;
}

void RankIO::make_expert_out(int64_t rows) {
  set_expert_out(expert_outputs(rank, expert_seed++, rows, combine_cols()));
}

void RankIO::set_padded_expert_out(const reference::DispatchResult& ref, int64_t capacity) {
  expert_capacity = capacity;
  if (capacity == 0) return;
  const int32_t groups = int32_t(ref.row_offsets.size()) - 1;
  const size_t slots = size_t(groups) * size_t(capacity);
  std::vector<uint16_t> padded(slots * size_t(combine_cols()), 0xffff);  // NaN: a stray read shows
  std::vector<int32_t> counts(static_cast<size_t>(groups));
  PadExpertRows a;
  a.rows = DispatchRows{ref.row_offsets.data(), ref.src_info.data(), groups, ref.rows()};
  a.codes = expert_out_host.data();
  a.row_bytes = int64_t(combine_cols()) * 2;
  a.capacity = capacity;
  a.padded_codes = padded.data();
  a.counts = counts.data();
  reference::pad_expert_rows(a);
  padded_expert_out = DeviceBuffer(device, padded.size() * 2);
  padded_expert_out.upload(padded.data(), padded.size() * 2, stream);
  EPCOMM_CUDA_OK(cudaStreamSynchronize(stream));
}

void RankIO::set_expert_out(std::vector<uint16_t> rows) {
  expert_out_host = std::move(rows);
  expert_out.upload(expert_out_host.data(), expert_out_host.size() * 2, stream);
}

namespace {
// The first index where two arrays differ, as " at i: got vs want", or "".
template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return " has " + std::to_string(got.size()) + " elements, want " + std::to_string(want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i]))
      return " at " + std::to_string(i) + ": " + std::to_string(got[i]) + ", want " +
             std::to_string(want[i]);
  return "";
}
}  // namespace

std::string RankIO::check_dispatch_padded(const reference::PaddedDispatchResult& want) const {
  const reference::DispatchResult& meta = want.meta;
  const std::string at = "rank " + std::to_string(rank) + " padded dispatch: ";
  std::vector<uint32_t> ro(static_cast<size_t>(n_groups) + 1);
  std::vector<int32_t> eid(static_cast<size_t>(n_groups));
  row_offsets.download(ro.data(), ro.size() * 4);
  expert_ids.download(eid.data(), eid.size() * 4);
  std::string e = first_difference(ro, meta.row_offsets);
  if (!e.empty()) return at + "row_offsets" + e;
  e = first_difference(eid, meta.expert_ids);
  if (!e.empty()) return at + "expert_ids" + e;
  std::vector<SrcInfo> si(static_cast<size_t>(meta.rows()));
  src_info.download(si.data(), si.size() * sizeof(SrcInfo));
  for (size_t i = 0; i < si.size(); ++i)
    if (std::memcmp(&si[i], &meta.src_info[i], sizeof(SrcInfo)) != 0)
      return at + "src_info of row " + std::to_string(i) + " differs";
  std::vector<uint8_t> codes(want.codes.size());
  out_tokens.download(codes.data(), codes.size());
  e = first_difference(codes, want.codes);
  if (!e.empty()) return at + "tokens (byte index; slot = index / row bytes)" + e;
  std::vector<uint32_t> sc(want.scales.size());
  if (!sc.empty()) scales.download(sc.data(), sc.size() * 4);
  e = first_difference(sc, want.scales);
  if (!e.empty()) return at + "scales (word bits)" + e;
  std::vector<int32_t> cnt(want.counts.size()), tok(want.slot_token.size());
  counts.download(cnt.data(), cnt.size() * 4);
  slot_token.download(tok.data(), tok.size() * 4);
  e = first_difference(cnt, want.counts);
  if (!e.empty()) return at + "counts" + e;
  e = first_difference(tok, want.slot_token);
  if (!e.empty()) return at + "slot_token" + e;
  std::vector<int64_t> lr(want.layout_range.size());
  layout_range.download(lr.data(), lr.size() * 8);
  e = first_difference(lr, want.layout_range);
  if (!e.empty()) return at + "layout_range" + e;
  return "";
}

std::string RankIO::check_dispatch(const reference::DispatchResult& ref) const {
  std::vector<uint32_t> ro(static_cast<size_t>(n_groups) + 1);
  std::vector<int32_t> eid(static_cast<size_t>(n_groups));
  std::vector<SrcInfo> si(static_cast<size_t>(ref.rows()));
  row_offsets.download(ro.data(), ro.size() * 4);
  expert_ids.download(eid.data(), eid.size() * 4);
  src_info.download(si.data(), si.size() * sizeof(SrcInfo));
  const std::vector<uint16_t> tok = download_dispatch_tokens(ref.rows());
  const std::string err =
      reference::compare_dispatch(ref, ro.data(), eid.data(), si.data(), tok.data(), hidden);
  return err.empty() ? err : "rank " + std::to_string(rank) + " dispatch: " + err;
}

reference::QuantDispatchResult RankIO::download_dispatch_quantized() const {
  reference::QuantDispatchResult q;
  q.row_offsets.resize(size_t(n_groups) + 1);
  q.expert_ids.resize(size_t(n_groups));
  row_offsets.download(q.row_offsets.data(), q.row_offsets.size() * 4);
  expert_ids.download(q.expert_ids.data(), q.expert_ids.size() * 4);
  const int64_t rows = std::min<int64_t>(int64_t(q.row_offsets.back()), max_rows);
  q.src_info.resize(size_t(rows));
  src_info.download(q.src_info.data(), q.src_info.size() * sizeof(SrcInfo));
  const reference::QuantFormat qf = reference::quant_format(format);
  q.out.shape = reference::dispatch_output_shape(qf, hidden, max_routed_rows, n_groups);
  q.out.codes.resize(out_tokens.bytes());
  out_tokens.download(q.out.codes.data(), q.out.codes.size());
  if (qf == reference::QuantFormat::kFp8Blockwise) {
    q.out.fp8_scales.resize(scales.bytes() / 4);
    scales.download(q.out.fp8_scales.data(), q.out.fp8_scales.size() * 4);
  } else {
    q.out.scales.resize(scales.bytes());
    scales.download(q.out.scales.data(), q.out.scales.size());
  }
  if (q.out.shape.swizzled()) {
    q.out.scales_offsets.resize(scales_offsets.bytes() / 4);
    scales_offsets.download(q.out.scales_offsets.data(), q.out.scales_offsets.size() * 4);
  }
  return q;
}

std::string RankIO::check_dispatch_quantized(const reference::QuantDispatchResult& ref) const {
  const reference::QuantDispatchResult got = download_dispatch_quantized();
  // The sizes are this rank's buffers' (Group::sizes()): the comparison checks them against the
  // reference's output shape before reading anything else.
  const reference::QuantizedDispatchView view{n_groups,
                                              max_rows,
                                              token_bytes,
                                              int64_t(scales.bytes()),
                                              int32_t(scales_offsets.bytes() / 4),
                                              got.row_offsets.data(),
                                              got.expert_ids.data(),
                                              got.src_info.data(),
                                              got.out.codes.data(),
                                              got.out.fp8_scales.empty()
                                                  ? static_cast<const void*>(got.out.scales.data())
                                                  : got.out.fp8_scales.data(),
                                              got.out.scales_offsets.data()};
  const std::string err = reference::compare_dispatch_quantized(ref, view);
  return err.empty() ? err
                     : "rank " + std::to_string(rank) + " dispatch (" + token_format_name(format) +
                           "): " + err;
}

std::vector<uint16_t> RankIO::download_dispatch_tokens(int64_t rows) const {
  std::vector<uint16_t> tok(static_cast<size_t>(rows) * size_t(hidden));
  out_tokens.download(tok.data(), tok.size() * 2);
  return tok;
}

std::vector<uint16_t> RankIO::download_combine(bool weighted) const {
  std::vector<uint16_t> out(static_cast<size_t>(num_tokens) * size_t(combine_cols()) *
                            (weighted ? 1 : size_t(top_k)));
  combine_out.download(out.data(), out.size() * 2);
  return out;
}

// A combine of fewer columns than the group's (combine_hidden) writes nothing past its output:
// the rest of what a full-width one would write still holds run_round's poison.
std::string RankIO::check_combine_tail(bool weighted) const {
  if (combine_cols() == hidden) return "";
  const size_t per = weighted ? 1 : size_t(top_k);
  std::vector<uint16_t> all(static_cast<size_t>(num_tokens) * size_t(hidden) * per);
  combine_out.download(all.data(), all.size() * 2);
  for (size_t i = size_t(num_tokens) * size_t(combine_cols()) * per; i < all.size(); ++i)
    if (all[i] != 0xffff)
      return "rank " + std::to_string(rank) + " combine of " + std::to_string(combine_cols()) +
             " columns wrote past its output, at value " + std::to_string(i);
  return "";
}

std::string RankIO::check_combine(const std::vector<double>& ref, bool weighted) const {
  if (std::string e = check_combine_tail(weighted); !e.empty()) return e;
  const std::vector<uint16_t> out = download_combine(weighted);
  if (ref.size() != out.size())
    return "rank " + std::to_string(rank) + " combine: reference has " +
           std::to_string(ref.size()) + " values, output " + std::to_string(out.size());
  const std::string err =
      weighted ? reference::compare_combine_bf16(ref, out.data(), int64_t(out.size()))
               : reference::compare_exact_bf16(ref, out.data(), int64_t(out.size()));
  return err.empty() ? err : "rank " + std::to_string(rank) + " combine: " + err;
}

std::string RankIO::check_combine_expert_side(const std::vector<float>& ref) const {
  if (std::string e = check_combine_tail(true); !e.empty()) return e;
  const std::vector<uint16_t> out = download_combine(true);
  const std::string err =
      reference::compare_combine_expert_side(ref, out.data(), int64_t(out.size()));
  return err.empty() ? err : "rank " + std::to_string(rank) + " expert-side combine: " + err;
}

std::vector<reference::DispatchResult> reference_dispatch_all(const reference::Problem& p) {
  std::vector<reference::DispatchResult> r;
  for (int d = 0; d < p.n_ranks; ++d) r.push_back(reference::dispatch(p, d));
  return r;
}

std::vector<reference::QuantDispatchResult> reference_dispatch_quantized_all(
    const reference::Problem& p, const Config& cfg, const Sizes& sizes) {
  std::vector<reference::QuantDispatchResult> r;
  for (int d = 0; d < p.n_ranks; ++d)
    r.push_back(reference::dispatch_quantized(p, d, reference::quant_format(cfg.format),
                                              cfg.nvfp4_global_scale, sizes.max_routed_rows,
                                              cfg.fp8_pow2_scales));
  return r;
}

reference::DispatchResult combine_layout(const reference::QuantDispatchResult& q) {
  reference::DispatchResult d;
  d.row_offsets = q.row_offsets;
  d.expert_ids = q.expert_ids;
  d.src_info = q.src_info;
  return d;
}

LocalGroup::LocalGroup(const Config& cfg, int n_ranks) {
  std::vector<int> devs;
  for (int r = 0; r < n_ranks; ++r) devs.push_back(device_of_rank(r));
  groups = Group::create_local(placed(cfg, n_ranks), devs);
  for (auto& g : groups) io.push_back(std::make_unique<RankIO>(*g));
}
LocalGroup::LocalGroup(const Config& cfg, const std::vector<int>& devices) {
  groups = Group::create_local(cfg, devices);
  for (auto& g : groups) io.push_back(std::make_unique<RankIO>(*g));
}
LocalGroup::~LocalGroup() {
  io.clear();
  groups.clear();
}

void LocalGroup::all(const std::function<void(int)>& f) {
  for (int r = 0; r < n(); ++r) {
    EPCOMM_CUDA_OK(cudaSetDevice(io[size_t(r)]->device));
    f(r);
  }
  sync_all();
}

void LocalGroup::issue_dispatch(const reference::Problem& p, int absent) {
  for (int r = 0; r < n(); ++r) {
    io[size_t(r)]->upload(p.ranks[size_t(r)]);
    io[size_t(r)]->poison();
  }
  for (int r = 0; r < n(); ++r) {
    if (r == absent) continue;
    RankIO& x = *io[size_t(r)];
    EPCOMM_CUDA_OK(cudaSetDevice(x.device));
    groups[size_t(r)]->dispatch(x.dispatch_input(), x.dispatch_output(), x.stream);
  }
}

void LocalGroup::sync_all() {
  for (int r = 0; r < n(); ++r) groups[size_t(r)]->synchronize(io[size_t(r)]->stream);
}

namespace {
__global__ void busy_kernel(float* x, int n, int iters) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = x[i];
  for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
  x[i] = v;
}
}  // namespace

namespace {
void trace(const char* what) {
  static const bool on = std::getenv("EPCOMM_TEST_TRACE") != nullptr;
  if (on) std::fprintf(stderr, "[trace] %s\n", what);
}
}  // namespace

std::string run_round(LocalGroup& lg, const reference::Problem& problem, const RoundOptions& o) {
  const int n = lg.n();
  reference::Problem p = problem;  // in the group's modes
  p.shared_expert = lg.groups[0]->config().shared_expert;
  p.skip_a2a = lg.groups[0]->config().skip_a2a;
  p.allreduce_world_size = lg.groups[0]->config().allreduce_world_size;
  trace("round: upload");
  for (int r = 0; r < n; ++r) {
    lg.io[size_t(r)]->id_bytes = o.ids64 ? 8 : 4;
    lg.io[size_t(r)]->upload(p.ranks[size_t(r)]);
    if (o.poison) lg.io[size_t(r)]->poison();
  }
  std::vector<DeviceBuffer> scratch;
  if (o.busy_work_between)
    for (int r = 0; r < n; ++r) scratch.emplace_back(lg.io[size_t(r)]->device, 1 << 22);
  if (o.form == Form::kFused) {
    lg.all([&](int r) {
      lg.groups[size_t(r)]->dispatch(lg.io[size_t(r)]->dispatch_input(o.expert_side),
                                     lg.io[size_t(r)]->dispatch_output(), lg.io[size_t(r)]->stream);
    });
  } else {
    for (int r = 0; r < n; ++r) {
      RankIO& io = *lg.io[size_t(r)];
      EPCOMM_CUDA_OK(cudaSetDevice(io.device));
      lg.groups[size_t(r)]->dispatch_async(io.dispatch_input(o.expert_side), io.stream);
      if (o.busy_work_between) {
        busy_kernel<<<(1 << 20) / 256, 256, 0, io.stream>>>(scratch[size_t(r)].get<float>(),
                                                            1 << 20, 2000);
        EPCOMM_CUDA_OK(cudaGetLastError());
        // The async half has read its inputs once it has run (README): work after it may
        // overwrite them, and the outputs must not change. (Not the weights: the token-side
        // combine of this round takes the same buffer.)
        io.tokens.fill(0xff, io.stream);
        io.topk.fill(0xff, io.stream);
      }
    }
    lg.all([&](int r) {
      lg.groups[size_t(r)]->dispatch_wait(lg.io[size_t(r)]->dispatch_output(),
                                          lg.io[size_t(r)]->stream);
    });
  }
  trace("round: dispatched");
  for (int r = 0; r < n; ++r) {
    const DispatchRecord last = lg.groups[size_t(r)]->last_dispatch();
    const bool weighted = lg.io[size_t(r)]->dispatch_input(o.expert_side).weights != nullptr;
    if (last.num_tokens != p.ranks[size_t(r)].num_tokens || last.weights != weighted)
      return "rank " + std::to_string(r) + ": last_dispatch() is {" +
             std::to_string(last.num_tokens) + ", " + std::to_string(last.weights) +
             "}; the dispatch had T = " + std::to_string(p.ranks[size_t(r)].num_tokens) +
             (weighted ? " with weights" : " without weights");
  }
  // refs: the rows combine reads, in each rank's dispatch output order (padding rows included).
  std::vector<reference::DispatchResult> refs;
  const Config& cfg = lg.groups[0]->config();
  if (cfg.padded_capacity > 0) {
    // The padded layout: packed rows with no format padding (the bf16 reference's, for every
    // format), the data in the slots; combine reads the packed rows.
    if (!o.poison) return "run_round: the padded layout's check needs poisoned outputs";
    refs = reference_dispatch_all(p);
    for (int r = 0; r < n; ++r) {
      const std::string e = lg.io[size_t(r)]->check_dispatch_padded(
          reference::dispatch_padded(p, r, cfg.format, cfg.padded_capacity, cfg.fp8_pow2_scales,
                                     cfg.fp8_ue8m0_scales, lg.groups[0]->sizes().max_routed_rows));
      if (!e.empty()) return e;
    }
  } else if (cfg.format == TokenFormat::kBF16) {
    refs = reference_dispatch_all(p);
    for (int r = 0; r < n; ++r) {
      const std::string e = lg.io[size_t(r)]->check_dispatch(refs[size_t(r)]);
      if (!e.empty()) return e;
    }
  } else {
    const std::vector<reference::QuantDispatchResult> qrefs =
        reference_dispatch_quantized_all(p, cfg, lg.groups[0]->sizes());
    for (int r = 0; r < n; ++r) {
      const std::string e = lg.io[size_t(r)]->check_dispatch_quantized(qrefs[size_t(r)]);
      if (!e.empty()) return e;
    }
    for (const auto& q : qrefs) refs.push_back(combine_layout(q));
  }
  // The combine's problem: the dispatch's, or as wide as the columns combine brings back.
  reference::Problem pc = p;
  if (o.combine_hidden > 0) {
    pc.hidden = o.combine_hidden;
    for (reference::RankInput& in : pc.ranks)  // (combine's reference reads no token)
      in.tokens.resize(size_t(in.num_tokens) * size_t(pc.hidden));
  }
  std::vector<std::vector<uint16_t>> y(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    RankIO& io = *lg.io[size_t(r)];
    io.combine_hidden = o.combine_hidden;
    if (o.function_outputs)
      io.set_expert_out(
          function_expert_outputs(refs[size_t(r)], r, p.n_experts / p.n_ranks, pc.hidden));
    else
      io.make_expert_out(refs[size_t(r)].rows());
    y[size_t(r)] = lg.io[size_t(r)]->expert_out_host;
    io.set_padded_expert_out(
        refs[size_t(r)],
        o.padded_extra_slots < 0 ? 0 : int64_t(n) * io.max_tokens + o.padded_extra_slots);
  }
  // The combines this round runs: with the weights dispatched, only the expert-side one (its
  // output has the weighted [T, H] shape); else the token-side weighted and / or un-reduced.
  for (bool weighted : {true, false}) {
    if (o.expert_side ? !weighted
                      : ((weighted && !o.weighted) || (!weighted && !o.unreduced)))
      continue;
    for (int r = 0; r < n; ++r) lg.io[size_t(r)]->combine_out.fill(0xff, lg.io[size_t(r)]->stream);
    if (o.form == Form::kFused) {
      lg.all([&](int r) {
        RankIO& io = *lg.io[size_t(r)];
        lg.groups[size_t(r)]->combine(io.combine_input(),
                                      io.combine_output(weighted && !o.expert_side), io.stream);
      });
    } else {
      for (int r = 0; r < n; ++r) {
        RankIO& io = *lg.io[size_t(r)];
        EPCOMM_CUDA_OK(cudaSetDevice(io.device));
        lg.groups[size_t(r)]->combine_async(io.combine_input(), io.stream);
        if (o.busy_work_between) {
          busy_kernel<<<(1 << 20) / 256, 256, 0, io.stream>>>(scratch[size_t(r)].get<float>(),
                                                              1 << 20, 2000);
          EPCOMM_CUDA_OK(cudaGetLastError());
        }
      }
      lg.all([&](int r) {
        RankIO& io = *lg.io[size_t(r)];
        lg.groups[size_t(r)]->combine_wait(io.combine_output(weighted && !o.expert_side),
                                           io.stream);
      });
    }
    trace("round: combined");
    if (o.reduced_out != nullptr && (weighted || o.expert_side)) {
      o.reduced_out->clear();
      for (int r = 0; r < n; ++r)
        o.reduced_out->push_back(lg.io[size_t(r)]->download_combine(true));
    }
    for (int r = 0; r < n; ++r) {
      if (o.expert_side) {
        const std::string e = lg.io[size_t(r)]->check_combine_expert_side(
            reference::combine_expert_side(pc, refs, y, r));
        if (!e.empty()) return e;
        continue;
      }
      const std::vector<double> ref = reference::combine(pc, refs, y, r, weighted);
      const std::string e = lg.io[size_t(r)]->check_combine(ref, weighted);
      if (!e.empty()) return std::string(weighted ? "weighted " : "un-reduced ") + e;
    }
  }
  return "";
}

}  // namespace testing
}  // namespace epcomm
