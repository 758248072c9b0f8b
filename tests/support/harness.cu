#include "harness.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

#include "epcomm/formats/scale_layouts.h"

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
      expert_seed(seed) {
  EPCOMM_CUDA_OK(cudaSetDevice(device));
  EPCOMM_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t T = size_t(max_tokens), H = size_t(hidden), K = size_t(top_k);
  tokens = DeviceBuffer(device, T * H * 2);
  topk = DeviceBuffer(device, T * K * 4);
  weights = DeviceBuffer(device, T * K * 4);
  out_tokens = DeviceBuffer(device, size_t(max_rows) * size_t(token_bytes));
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
  topk.upload(in.topk_ids.data(), in.topk_ids.size() * 4, stream);
  weights.upload(in.weights.data(), in.weights.size() * 4, stream);
}

void RankIO::poison() {
  for (DeviceBuffer* b : {&out_tokens, &row_offsets, &expert_ids, &src_info, &scales,
                          &scales_offsets, &combine_out})
    if (b->get() != nullptr) b->fill(0xff, stream);
  EPCOMM_CUDA_OK(cudaStreamSynchronize(stream));
}

DispatchInput RankIO::dispatch_input() const {
  return DispatchInput{tokens.get(), topk.get<int32_t>(), num_tokens, hidden};
}
DispatchOutput RankIO::dispatch_output() const {
  return DispatchOutput{out_tokens.get(), row_offsets.get<uint32_t>(), expert_ids.get<int32_t>(),
                        src_info.get<SrcInfo>(), scales.get(), scales_offsets.get<uint32_t>()};
}
CombineInput RankIO::combine_input() const {
  return CombineInput{expert_out.get(), row_offsets.get<uint32_t>(), src_info.get<SrcInfo>(),
                      hidden};
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

void RankIO::make_expert_out(int64_t rows) {
  expert_out_host = expert_outputs(rank, expert_seed++, rows, hidden);
  expert_out.upload(expert_out_host.data(), expert_out_host.size() * 2, stream);
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

namespace {

std::string hex(uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// "row r (group g, rank s token t slot k)", or "(group g, padding)", from the reference's rows.
std::string describe_row(const reference::QuantDispatchResult& ref, int64_t r) {
  std::ostringstream os;
  os << "row " << r;
  const auto next = std::upper_bound(ref.row_offsets.begin(), ref.row_offsets.end(), uint32_t(r));
  const int64_t g = int64_t(next - ref.row_offsets.begin()) - 1;
  const SrcInfo si = ref.src_info[size_t(r)];
  os << " (group " << g;
  if (si.rank < 0)
    os << ", padding)";
  else
    os << ", rank " << si.rank << " token " << si.token << " slot " << si.slot << ")";
  return os.str();
}

// Where byte `o` of a swizzled scale array lands: the output row and scale column whose scale
// it holds, or which kind of unused slot it is (ref gives the groups' tiles).
std::string describe_swizzled(const reference::QuantDispatchResult& ref,
                              const SwizzledScaleLayout& layout, int64_t o) {
  const int64_t tile = o / SwizzledScaleLayout::kTileElems;
  const int64_t within = o % SwizzledScaleLayout::kTileElems;
  const int64_t tile_row = tile / layout.col_tiles();
  const int32_t tile_col = int32_t(tile % layout.col_tiles());
  const int64_t sub_row = within / 16, sub_block = (within % 16) / SwizzledScaleLayout::kTileCols;
  const int64_t scale_row = tile_row * SwizzledScaleLayout::kTileRows +
                            sub_block * SwizzledScaleLayout::kSubRows + sub_row;
  const int32_t col = tile_col * SwizzledScaleLayout::kTileCols +
                      int32_t(within % SwizzledScaleLayout::kTileCols);
  std::ostringstream os;
  os << "byte " << o << " = [tile row " << tile_row << ", tile col " << tile_col << ", "
     << sub_row << ", " << sub_block << ", " << (within % SwizzledScaleLayout::kTileCols)
     << "] (scale row " << scale_row << ", scale column " << col << "): ";
  const int32_t G = int32_t(ref.expert_ids.size());
  for (int32_t g = 0; g < G; ++g) {
    const SwizzledGroup sg{ref.row_offsets[size_t(g)], ref.out.scales_offsets[size_t(g)]};
    const int64_t m = int64_t(ref.row_offsets[size_t(g) + 1]) - sg.row_offset;
    const int64_t first = sg.tile_start() * SwizzledScaleLayout::kTileRows;
    if (scale_row < first || scale_row >= first + align_up(m, SwizzledScaleLayout::kTileRows))
      continue;
    const int64_t r = int64_t(sg.row_offset) + (scale_row - first);
    if (scale_row - first >= m) {
      os << "an unused slot of group " << g << "'s last tile";
    } else if (col >= layout.scale_cols) {
      os << "column padding of " << describe_row(ref, r);
    } else {
      os << describe_row(ref, r) << " column " << col;
    }
    return os.str();
  }
  os << "a tile no group uses";
  return os.str();
}

}  // namespace

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
  const std::string where =
      "rank " + std::to_string(rank) + " dispatch (" + token_format_name(format) + "): ";
  const reference::QuantOutputShape& shape = ref.out.shape;
  const int64_t ref_scales_bytes = shape.scales_size() * format_scale_bytes(format);
  if (shape.rows != max_rows || shape.row_bytes() != token_bytes ||
      ref_scales_bytes != int64_t(scales.bytes()) ||
      int64_t(ref.out.scales_offsets.size()) != int64_t(scales_offsets.bytes() / 4) ||
      int64_t(ref.expert_ids.size()) != n_groups) {
    std::ostringstream os;
    os << where << "the reference's output shape (groups " << ref.expert_ids.size() << ", rows "
       << shape.rows << ", row bytes " << shape.row_bytes() << ", scale bytes "
       << ref_scales_bytes << ", scales_offsets " << ref.out.scales_offsets.size()
       << ") differs from Group::sizes() (groups " << n_groups << ", max_recv_rows " << max_rows
       << ", token_bytes " << token_bytes << ", scales_bytes " << scales.bytes()
       << ", num_scales_offsets " << scales_offsets.bytes() / 4 << ")";
    return os.str();
  }
  const std::string err = compare_dispatch_quantized(ref, download_dispatch_quantized());
  return err.empty() ? err : where + err;
}

std::string compare_dispatch_quantized(const reference::QuantDispatchResult& ref,
                                       const reference::QuantDispatchResult& got) {
  const reference::QuantOutputShape& shape = ref.out.shape;
  const TokenFormat format = reference::token_format(shape.format);
  const int32_t hidden = shape.hidden;
  const size_t n_groups = ref.expert_ids.size();
  std::ostringstream os;
  if (got.row_offsets.size() != n_groups + 1 || got.expert_ids.size() != n_groups ||
      got.out.codes.size() != ref.out.codes.size() ||
      got.out.fp8_scales.size() != ref.out.fp8_scales.size() ||
      got.out.scales.size() != ref.out.scales.size() ||
      got.out.scales_offsets.size() != ref.out.scales_offsets.size()) {
    os << "the output's sizes differ from the reference's";
    return os.str();
  }
  for (size_t g = 0; g <= n_groups; ++g)
    if (got.row_offsets[g] != ref.row_offsets[g]) {
      os << "row_offsets[" << g << "] = " << got.row_offsets[g] << ", expected "
         << ref.row_offsets[g];
      return os.str();
    }
  for (size_t g = 0; g < n_groups; ++g)
    if (got.expert_ids[g] != ref.expert_ids[g]) {
      os << "expert_ids[" << g << "] = " << got.expert_ids[g] << ", expected "
         << ref.expert_ids[g];
      return os.str();
    }
  const int64_t rows = ref.rows();
  if (got.rows() < rows) {  // row_offsets agree, so only a clamped download can be short
    os << "only " << got.rows() << " rows of src_info, expected " << rows;
    return os.str();
  }
  for (int64_t r = 0; r < rows; ++r) {
    const SrcInfo a = got.src_info[size_t(r)], b = ref.src_info[size_t(r)];
    if (a.token != b.token || a.rank != b.rank || a.slot != b.slot) {
      os << "src_info[" << r << "] = (rank " << a.rank << ", token " << a.token << ", slot "
         << a.slot << "), expected (rank " << b.rank << ", token " << b.token << ", slot "
         << b.slot << ")";
      return os.str();
    }
  }
  // Codes of rows [0, rows): e4m3 byte b is value b; packed e2m1 byte b holds values 2b, 2b + 1.
  const int64_t row_bytes = shape.row_bytes();
  const bool packed = row_bytes != hidden;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < row_bytes; ++b) {
      const uint8_t x = got.out.codes[size_t(r * row_bytes + b)];
      const uint8_t y = ref.out.codes[size_t(r * row_bytes + b)];
      if (x != y) {
        os << "codes of " << describe_row(ref, r) << " byte " << b << " (value column "
           << (packed ? 2 * b : b) << (packed ? " and the next" : "") << ") = " << hex(x)
           << ", expected " << hex(y);
        return os.str();
      }
    }
  }
  const int32_t cols = format_scales_per_row(format, hidden);
  const int32_t group = format_scale_group(format);
  switch (shape.format) {
    case reference::QuantFormat::kFp8Blockwise: {
      const Fp8ScaleLayout layout = shape.fp8_layout();
      for (int32_t k = 0; k < cols; ++k)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = layout.offset(r, k);
          const float x = got.out.fp8_scales[size_t(i)], y = ref.out.fp8_scales[size_t(i)];
          if (f32_bits(x) != f32_bits(y)) {
            os << "FP8 scale of " << describe_row(ref, r) << " column " << k << " (values ["
               << k * group << ", " << (k + 1) * group << "), scales[" << i << "]) = " << x
               << " (" << hex(f32_bits(x)) << "), expected " << y << " (" << hex(f32_bits(y))
               << ")";
            return os.str();
          }
        }
      break;
    }
    case reference::QuantFormat::kNvfp4:
    case reference::QuantFormat::kMxfp8: {
      const SwizzledScaleLayout layout = shape.swizzled_layout();
      for (int64_t o = 0; o < layout.size(); ++o) {
        const uint8_t x = got.out.scales[size_t(o)], y = ref.out.scales[size_t(o)];
        if (x != y) {
          os << "swizzled scale " << describe_swizzled(ref, layout, o) << " = " << hex(x)
             << ", expected " << hex(y);
          return os.str();
        }
      }
      for (size_t g = 0; g < n_groups; ++g)
        if (got.out.scales_offsets[g] != ref.out.scales_offsets[g]) {
          os << "scales_offsets[" << g << "] = " << got.out.scales_offsets[g] << ", expected "
             << ref.out.scales_offsets[g];
          return os.str();
        }
      break;
    }
    case reference::QuantFormat::kMxfp4: {
      const Mxfp4ScaleLayout layout = shape.mxfp4_layout();
      for (int64_t r = 0; r < rows; ++r)
        for (int32_t c = 0; c < cols; ++c) {
          const int64_t i = layout.offset(r, c);
          const uint8_t x = got.out.scales[size_t(i)], y = ref.out.scales[size_t(i)];
          if (x != y) {
            os << "MXFP4 scale of " << describe_row(ref, r) << " column " << c << " (values ["
               << c * group << ", " << (c + 1) * group << ")) = " << hex(x) << ", expected "
               << hex(y);
            return os.str();
          }
        }
      break;
    }
  }
  return "";
}

std::vector<uint16_t> RankIO::download_dispatch_tokens(int64_t rows) const {
  std::vector<uint16_t> tok(static_cast<size_t>(rows) * size_t(hidden));
  out_tokens.download(tok.data(), tok.size() * 2);
  return tok;
}

std::vector<uint16_t> RankIO::download_combine(bool weighted) const {
  std::vector<uint16_t> out(static_cast<size_t>(num_tokens) * size_t(hidden) * (weighted ? 1 : size_t(top_k)));
  combine_out.download(out.data(), out.size() * 2);
  return out;
}

std::string RankIO::check_combine(const std::vector<double>& ref, bool weighted) const {
  const std::vector<uint16_t> out = download_combine(weighted);
  if (ref.size() != out.size())
    return "rank " + std::to_string(rank) + " combine: reference has " +
           std::to_string(ref.size()) + " values, output " + std::to_string(out.size());
  const std::string err =
      weighted ? reference::compare_combine_bf16(ref, out.data(), int64_t(out.size()))
               : reference::compare_exact_bf16(ref, out.data(), int64_t(out.size()));
  return err.empty() ? err : "rank " + std::to_string(rank) + " combine: " + err;
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
                                              cfg.nvfp4_global_scale, sizes.max_routed_rows));
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
  for (int d = 0; d < n_ranks; ++d) devs.push_back(d);
  groups = Group::create_local(cfg, devs);
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

std::string run_round(LocalGroup& lg, const reference::Problem& p, const RoundOptions& o) {
  const int n = lg.n();
  trace("round: upload");
  for (int r = 0; r < n; ++r) {
    lg.io[size_t(r)]->upload(p.ranks[size_t(r)]);
    if (o.poison) lg.io[size_t(r)]->poison();
  }
  std::vector<DeviceBuffer> scratch;
  if (o.busy_work_between)
    for (int r = 0; r < n; ++r) scratch.emplace_back(lg.io[size_t(r)]->device, 1 << 22);
  if (o.form == Form::kFused) {
    lg.all([&](int r) {
      lg.groups[size_t(r)]->dispatch(lg.io[size_t(r)]->dispatch_input(),
                                     lg.io[size_t(r)]->dispatch_output(), lg.io[size_t(r)]->stream);
    });
  } else {
    for (int r = 0; r < n; ++r) {
      RankIO& io = *lg.io[size_t(r)];
      EPCOMM_CUDA_OK(cudaSetDevice(io.device));
      lg.groups[size_t(r)]->dispatch_async(io.dispatch_input(), io.stream);
      if (o.busy_work_between) {
        busy_kernel<<<(1 << 20) / 256, 256, 0, io.stream>>>(scratch[size_t(r)].get<float>(),
                                                            1 << 20, 2000);
        EPCOMM_CUDA_OK(cudaGetLastError());
      }
    }
    lg.all([&](int r) {
      lg.groups[size_t(r)]->dispatch_wait(lg.io[size_t(r)]->dispatch_output(),
                                          lg.io[size_t(r)]->stream);
    });
  }
  trace("round: dispatched");
  // refs: the rows combine reads, in each rank's dispatch output order (padding rows included).
  std::vector<reference::DispatchResult> refs;
  const Config& cfg = lg.groups[0]->config();
  if (cfg.format == TokenFormat::kBF16) {
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
  std::vector<std::vector<uint16_t>> y(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    lg.io[size_t(r)]->make_expert_out(refs[size_t(r)].rows());
    y[size_t(r)] = lg.io[size_t(r)]->expert_out_host;
  }
  for (bool weighted : {true, false}) {
    if ((weighted && !o.weighted) || (!weighted && !o.unreduced)) continue;
    for (int r = 0; r < n; ++r) lg.io[size_t(r)]->combine_out.fill(0xff, lg.io[size_t(r)]->stream);
    if (o.form == Form::kFused) {
      lg.all([&](int r) {
        RankIO& io = *lg.io[size_t(r)];
        lg.groups[size_t(r)]->combine(io.combine_input(), io.combine_output(weighted), io.stream);
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
        lg.groups[size_t(r)]->combine_wait(io.combine_output(weighted), io.stream);
      });
    }
    trace("round: combined");
    for (int r = 0; r < n; ++r) {
      const std::vector<double> ref = reference::combine(p, refs, y, r, weighted);
      const std::string e = lg.io[size_t(r)]->check_combine(ref, weighted);
      if (!e.empty()) return std::string(weighted ? "weighted " : "un-reduced ") + e;
    }
  }
  return "";
}

}  // namespace testing
}  // namespace epcomm
