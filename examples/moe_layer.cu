// A whole MoE layer over an epcomm group: router top-k, dispatch, grouped GEMM (cuBLAS),
// fused SiLU (epcomm), second grouped GEMM, combine, optionally the fused shared expert; checked
// against the same layer computed on one GPU without epcomm, and timed stage by stage.
//
//   moe_layer [--ranks N] [--tokens T] [--hidden H] [--inter I] [--experts E] [--topk K]
//             [--format bf16|fp8|nvfp4] [--shared] [--iters N] [--sms N]
//
// One process drives N ranks, rank r on GPU r % (visible GPUs): on a one-GPU machine the ranks
// share it (Config::share_gpus), and the stage times then include the other ranks' work on the
// same GPU. Every rank:
//   router    logits = x W_r^T (cuBLAS, fp32), then per token the K largest logits (ties: the
//             lower expert) and their softmax as router weights;
//   dispatch  epcomm, in --format (the router weights go with it: the expert-side reduction);
//   dequant   fp8 / nvfp4 only: the dispatched codes and scales back to bf16 for the bf16 GEMM
//             (this example's own kernel; a production layer feeds them to an FP8 / FP4 GEMM);
//   gemm1     h = x W1_g^T per group g, [m_g, 2I] (cublasGemmGroupedBatchedEx). cuBLAS takes the
//             problem sizes on the host, so row_offsets are copied to the host first (the only
//             host synchronisation of the layer; a device-side grouped GEMM would avoid it);
//   silu      z = silu(gate) * up (epcomm::silu_bf16; reads the row count on the device);
//   gemm2     y = z W2_g^T, [m_g, H];
//   combine   epcomm: out[t] = sum_k w[t,k] y[t,k] (+ the shared expert's row).
// The check recomputes every rank's layer on GPU 0 with plain per-expert cuBLAS GEMMs, the host
// SiLU and float64 sums, from the same weights and the same (quantised, in fp8 / nvfp4) inputs.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "epcomm/bf16.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/group.h"
#include "epcomm/silu.h"

using namespace epcomm;

#define CUDA_OK(call)                                                                     \
  do {                                                                                    \
    const cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess)                                                                \
      throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_));       \
  } while (0)
#define CUBLAS_OK(call)                                                                   \
  do {                                                                                    \
    const cublasStatus_t s_ = (call);                                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                      \
      throw std::runtime_error(std::string(#call) + ": cuBLAS status " + std::to_string(int(s_))); \
  } while (0)

namespace {

struct Options {
  int ranks = 0;  // 0: the visible GPUs, at least 4
  int tokens = 256, hidden = 2048, inter = 1024, experts = 32, topk = 4, iters = 10, sms = 0;
  TokenFormat format = TokenFormat::kBF16;
  bool shared = false;
};

// A device buffer on one GPU.
struct Buf {
  int dev = 0;
  void* p = nullptr;
  Buf() = default;
  Buf(int d, size_t bytes) : dev(d) {
    CUDA_OK(cudaSetDevice(d));
    CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  }
  Buf(Buf&& o) noexcept : dev(o.dev), p(o.p) { o.p = nullptr; }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(dev, o.dev);
    std::swap(p, o.p);
    return *this;
  }
  ~Buf() {
    if (p) {
      (void)cudaSetDevice(dev);
      (void)cudaFree(p);
    }
  }
  template <class T = void>
  T* get() const { return static_cast<T*>(p); }
};

Buf upload(int dev, const void* src, size_t bytes) {
  Buf b(dev, bytes);
  CUDA_OK(cudaMemcpy(b.p, src, bytes, cudaMemcpyHostToDevice));
  return b;
}

// Deterministic weights: expert e's W1 [2I, H] and W2 [H, I] (e = E is the shared expert) and
// the router's [E, H], scaled so every stage's values stay of order 1.
std::vector<uint16_t> random_matrix(uint64_t seed, size_t rows, size_t cols) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(float(cols)));
  std::vector<uint16_t> m(rows * cols);
  for (auto& v : m) v = float_to_bf16(n(rng));
  return m;
}
std::vector<uint16_t> w1_of(const Options& o, int e) {
  return random_matrix(1000 + uint64_t(e), size_t(2 * o.inter), size_t(o.hidden));
}
std::vector<uint16_t> w2_of(const Options& o, int e) {
  return random_matrix(5000 + uint64_t(e), size_t(o.hidden), size_t(o.inter));
}

// ---- device kernels of the example ------------------------------------------------------------

// Per token: the K largest of its E logits (ties: the lower expert), their softmax.
__global__ void topk_softmax(const float* logits, int T, int E, int K, int32_t* ids, float* w) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const float* l = logits + size_t(t) * E;
  int32_t chosen[16];
  float val[16];
  for (int k = 0; k < K; ++k) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int j = 0; j < k; ++j) taken |= chosen[j] == e;
      if (!taken && (best < 0 || l[e] > l[best])) best = e;
    }
    chosen[k] = best;
    val[k] = l[best];
  }
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum += expf(val[k] - val[0]);
  for (int k = 0; k < K; ++k) {
    ids[size_t(t) * K + k] = chosen[k];
    w[size_t(t) * K + k] = expf(val[k] - val[0]) / sum;
  }
}

// The dispatch output rows [0, row_offsets[G]) back to bf16: x = decode(code) with the row's
// scale where the grouped GEMM would read it (FP8: Fp8ScaleLayout; NVFP4: the swizzled layout of
// the row's group). One thread per 16 values.
__global__ void dequant_rows(TokenFormat f, const uint8_t* codes, const void* scales,
                             const uint32_t* row_offsets, const uint32_t* scales_offsets, int G,
                             int H, int64_t max_rows, int64_t routed_rows, float gs,
                             uint16_t* out) {
  const int64_t rows = min(int64_t(row_offsets[G]), max_rows);
  const int per_row = H / 16;
  const DispatchOutputLayout out_l = DispatchOutputLayout::make(f, H, routed_rows, G);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * per_row;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row;
    const int c0 = int(i % per_row) * 16;
    float v[16];
    if (f == TokenFormat::kFp8Blockwise) {
      const Fp8BlockQuant q = Fp8BlockQuant::from_scale(
          static_cast<const float*>(scales)[out_l.fp8().offset(r, c0 / 128)]);
      for (int j = 0; j < 16; ++j) v[j] = q.decode(codes[r * H + c0 + j]);
    } else {  // NVFP4
      int g = 0;
      while (g + 1 < G && row_offsets[g + 1] <= r) ++g;
      const SwizzledGroup sg{row_offsets[g], scales_offsets[g]};
      const uint8_t sc =
          static_cast<const uint8_t*>(scales)[out_l.swizzled().offset(sg.scale_row(r), c0 / 16)];
      const Nvfp4BlockQuant q = Nvfp4BlockQuant::from_code(sc, gs);
      for (int j = 0; j < 16; j += 2) {
        const uint8_t b = codes[r * (H / 2) + (c0 + j) / 2];
        v[j] = q.decode(e2m1_low(b));
        v[j + 1] = q.decode(e2m1_high(b));
      }
    }
    for (int j = 0; j < 16; ++j) out[r * H + c0 + j] = __bfloat16_as_ushort(__float2bfloat16_rn(v[j]));
  }
}

// The host's view of a format round trip (what dispatch delivers): x quantised and decoded.
std::vector<uint16_t> quantize_round_trip(TokenFormat f, const std::vector<uint16_t>& x, int rows,
                                          int H, float gs) {
  if (f == TokenFormat::kBF16) return x;
  std::vector<float> xf(x.size()), back(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
  if (f == TokenFormat::kFp8Blockwise) {
    std::vector<uint8_t> c(x.size());
    std::vector<float> s(size_t(rows) * (H / 128));
    reference::encode_fp8_blockwise(xf.data(), rows, H, c.data(), s.data());
    reference::decode_fp8_blockwise(c.data(), s.data(), rows, H, back.data());
  } else {
    std::vector<uint8_t> c(x.size() / 2), s(size_t(rows) * (H / 16));
    reference::encode_nvfp4(xf.data(), rows, H, gs, c.data(), s.data());
    reference::decode_nvfp4(c.data(), s.data(), rows, H, gs, back.data());
  }
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = float_to_bf16(back[i]);
  return out;
}

// Row-major Y [m, N] = X [m, Kd] W^T, W [N, Kd] row-major, bf16 in and out, fp32 compute: the
// column-major product Y^T = W X^T.
void gemm(cublasHandle_t h, const void* X, const void* W, void* Y, int m, int N, int Kd) {
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_OK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, m, Kd, &one, W, CUDA_R_16BF, Kd, X,
                         CUDA_R_16BF, Kd, &zero, Y, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
}

// One rank of the layer.
struct LayerRank {
  int rank = 0, dev = 0;
  Group* group = nullptr;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int G = 0;
  int64_t max_rows = 0;
  Buf x, wr, logits, ids, weights, w1, w2;
  Buf tokens, row_offsets, expert_ids, src_info, scales, scales_offsets;
  Buf xin, h1, z, y, out;
  uint32_t* host_offsets = nullptr;  // pinned
  std::vector<cudaEvent_t> ev;       // one per stage boundary
  Buf gemm_ptrs;                     // the grouped GEMM's device arrays of A, B, C pointers
};

// Grouped GEMM over the non-empty groups of the last dispatch: Y_g = X_g W_g^T, X rows of
// group g at row_offsets[g], W_g the g-th of G matrices [N, Kd].
void grouped_gemm(LayerRank& r, const void* X, const void* W, void* Y, int N, int Kd) {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, gsize;
  std::vector<float> alpha, beta;
  std::vector<const void*> A, B;
  std::vector<void*> C;
  for (int g = 0; g < r.G; ++g) {
    const int rows = int(r.host_offsets[g + 1] - r.host_offsets[g]);
    if (rows == 0) continue;
    ta.push_back(CUBLAS_OP_T);
    tb.push_back(CUBLAS_OP_N);
    m.push_back(N);
    n.push_back(rows);
    k.push_back(Kd);
    lda.push_back(Kd);
    ldb.push_back(Kd);
    ldc.push_back(N);
    gsize.push_back(1);
    alpha.push_back(1.0f);
    beta.push_back(0.0f);
    A.push_back(static_cast<const char*>(W) + size_t(g) * N * Kd * 2);
    B.push_back(static_cast<const char*>(X) + size_t(r.host_offsets[g]) * Kd * 2);
    C.push_back(static_cast<char*>(Y) + size_t(r.host_offsets[g]) * N * 2);
  }
  if (m.empty()) return;
  // The pointer arrays live on the device; cuBLAS reads them in stream order.
  const size_t np = A.size();
  std::vector<const void*> ptrs(3 * np);
  for (size_t i = 0; i < np; ++i) {
    ptrs[i] = A[i];
    ptrs[np + i] = B[i];
    ptrs[2 * np + i] = C[i];
  }
  // Stream-ordered: the copy for the next grouped GEMM lands after this one has read them.
  Buf& pb = r.gemm_ptrs;
  CUDA_OK(cudaMemcpyAsync(pb.p, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice,
                          r.stream));
  const void* const* dA = pb.get<const void*>();
  CUBLAS_OK(cublasGemmGroupedBatchedEx(
      r.blas, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), dA, CUDA_R_16BF,
      lda.data(), dA + np, CUDA_R_16BF, ldb.data(), beta.data(),
      reinterpret_cast<void* const*>(pb.get<void*>() + 2 * np), CUDA_R_16BF, ldc.data(),
      int(np), gsize.data(), CUBLAS_COMPUTE_32F));
}

// "sizes": row_offsets to the host for cuBLAS (and, in fp8 / nvfp4, the dequantisation).
const char* const kStages[] = {"router", "dispatch", "sizes", "gemm1", "silu", "gemm2",
                               "combine"};
constexpr int kNumStages = 7;

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--ranks") o.ranks = std::stoi(next());
    else if (a == "--tokens") o.tokens = std::stoi(next());
    else if (a == "--hidden") o.hidden = std::stoi(next());
    else if (a == "--inter") o.inter = std::stoi(next());
    else if (a == "--experts") o.experts = std::stoi(next());
    else if (a == "--topk") o.topk = std::stoi(next());
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--sms") o.sms = std::stoi(next());
    else if (a == "--shared") o.shared = true;
    else if (a == "--format") {
      const std::string f = next();
      if (f == "bf16") o.format = TokenFormat::kBF16;
      else if (f == "fp8") o.format = TokenFormat::kFp8Blockwise;
      else if (f == "nvfp4") o.format = TokenFormat::kNvfp4;
      else throw std::runtime_error("--format: bf16, fp8 or nvfp4");
    } else {
      throw std::runtime_error("unknown option " + a +
                               " (--ranks --tokens --hidden --inter --experts --topk --format "
                               "--shared --iters --sms)");
    }
  }
  if (o.topk < 1 || o.topk > 15 || o.topk > o.experts)
    throw std::runtime_error("--topk: 1..15 and at most --experts");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("moe_layer: no GPU visible; nothing to run\n");
    return 77;
  }
  const int n = o.ranks > 0 ? o.ranks : std::min(std::max(gpus, 4), 8);
  const int per_gpu = (n + gpus - 1) / gpus;
  const int T = o.tokens, H = o.hidden, I = o.inter, E = o.experts, K = o.topk;
  const float gs = 1.0f;  // NVFP4's global scale: |x| < 6 here, so no block saturates

  Config cfg;
  cfg.hidden = H;
  cfg.top_k = K;
  cfg.n_experts = E;
  cfg.max_tokens_per_rank = T;
  cfg.format = o.format;
  cfg.nvfp4_global_scale = gs;
  cfg.shared_expert = o.shared;
  cfg.share_gpus = per_gpu > 1;
  cfg.num_sms = o.sms > 0 ? o.sms : 24;
  if (o.sms == 0) cfg.num_sms = std::min(cfg.num_sms, max_resident_blocks(cfg, n, 0) / per_gpu);
  std::vector<int> devices;
  for (int r = 0; r < n; ++r) devices.push_back(r % gpus);
  auto groups = Group::create_local(cfg, devices);
  const Sizes sz = groups[0]->sizes();
  const std::vector<TensorDesc> dispatched = dispatch_output_descs(cfg, sz);  // its outputs
  const int n_local = E / n, G = sz.num_groups;
  std::printf("moe_layer: %d ranks on %d GPU(s), T %d per rank, H %d, I %d, %d experts, top-%d, "
              "%s dispatch%s, %d SMs per rank\n",
              n, gpus, T, H, I, E, K, token_format_name(o.format),
              o.shared ? ", shared expert" : "", cfg.num_sms);

  // Inputs and weights.
  const std::vector<uint16_t> wr_host = random_matrix(77, size_t(E), size_t(H));
  std::vector<std::vector<uint16_t>> x_host(static_cast<size_t>(n));
  std::vector<LayerRank> ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    LayerRank& k = ranks[size_t(r)];
    k.rank = r;
    k.dev = devices[size_t(r)];
    k.group = groups[size_t(r)].get();
    k.G = G;
    k.max_rows = sz.max_recv_rows;
    CUDA_OK(cudaSetDevice(k.dev));
    CUDA_OK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    CUBLAS_OK(cublasCreate(&k.blas));
    CUBLAS_OK(cublasSetStream(k.blas, k.stream));
    std::mt19937_64 rng(42 + uint64_t(r));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    x_host[size_t(r)].resize(size_t(T) * H);
    for (auto& v : x_host[size_t(r)]) v = float_to_bf16(std::max(-5.5f, std::min(5.5f, nd(rng))));
    k.x = upload(k.dev, x_host[size_t(r)].data(), x_host[size_t(r)].size() * 2);
    k.wr = upload(k.dev, wr_host.data(), wr_host.size() * 2);
    // Group g's weights: the shared expert (g = 0 with --shared), then local expert l.
    std::vector<uint16_t> w1, w2;
    for (int g = 0; g < G; ++g) {
      const int e = o.shared && g == 0 ? E : r * n_local + g - (o.shared ? 1 : 0);
      const auto a = w1_of(o, e), b = w2_of(o, e);
      w1.insert(w1.end(), a.begin(), a.end());
      w2.insert(w2.end(), b.begin(), b.end());
    }
    k.w1 = upload(k.dev, w1.data(), w1.size() * 2);
    k.w2 = upload(k.dev, w2.data(), w2.size() * 2);
    k.logits = Buf(k.dev, size_t(T) * E * 4);
    k.ids = Buf(k.dev, size_t(T) * K * 4);
    k.weights = Buf(k.dev, size_t(T) * K * 4);
    k.tokens = Buf(k.dev, size_t(desc_bytes(dispatched, "tokens")));
    k.row_offsets = Buf(k.dev, size_t(desc_bytes(dispatched, "row_offsets")));
    k.expert_ids = Buf(k.dev, size_t(desc_bytes(dispatched, "expert_ids")));
    k.src_info = Buf(k.dev, size_t(desc_bytes(dispatched, "src_info")));
    k.scales = Buf(k.dev, size_t(desc_bytes(dispatched, "scales")));
    k.scales_offsets = Buf(k.dev, size_t(desc_bytes(dispatched, "scales_offsets")));
    k.xin = o.format == TokenFormat::kBF16 ? Buf() : Buf(k.dev, size_t(sz.max_recv_rows) * H * 2);
    k.h1 = Buf(k.dev, size_t(sz.max_recv_rows) * 2 * I * 2);
    k.z = Buf(k.dev, size_t(sz.max_recv_rows) * I * 2);
    k.y = Buf(k.dev, size_t(expert_out_desc(cfg, sz).bytes()));
    k.out = Buf(k.dev, size_t(combine_output_desc(cfg, T, true).bytes()));
    k.gemm_ptrs = Buf(k.dev, size_t(3 * G) * sizeof(void*));
    CUDA_OK(cudaMallocHost(&k.host_offsets, size_t(G + 1) * 4));
    k.ev.resize(kNumStages + 1);
    for (auto& e : k.ev) CUDA_OK(cudaEventCreate(&e));
  }
  load_silu_kernels();

  // The layer, every rank stage by stage (a rank's stages wait on the others only inside
  // dispatch and combine).
  auto run_layer = [&]() {
    for (LayerRank& k : ranks) {  // router
      CUDA_OK(cudaSetDevice(k.dev));
      CUDA_OK(cudaEventRecord(k.ev[0], k.stream));
      const float one = 1.0f, zero = 0.0f;
      CUBLAS_OK(cublasGemmEx(k.blas, CUBLAS_OP_T, CUBLAS_OP_N, E, T, H, &one, k.wr.p, CUDA_R_16BF,
                             H, k.x.p, CUDA_R_16BF, H, &zero, k.logits.p, CUDA_R_32F, E,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      topk_softmax<<<(T + 127) / 128, 128, 0, k.stream>>>(k.logits.get<float>(), T, E, K,
                                                          k.ids.get<int32_t>(),
                                                          k.weights.get<float>());
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaEventRecord(k.ev[1], k.stream));
    }
    for (LayerRank& k : ranks) {  // dispatch (weights with it: the expert-side reduction)
      CUDA_OK(cudaSetDevice(k.dev));
      DispatchInput in{k.x.p, k.ids.get<int32_t>(), T, H, k.weights.get<float>()};
      DispatchOutput out{k.tokens.p,    k.row_offsets.get<uint32_t>(), k.expert_ids.get<int32_t>(),
                         k.src_info.get<SrcInfo>(), o.format == TokenFormat::kBF16 ? nullptr : k.scales.p,
                         format_swizzled(o.format) ? k.scales_offsets.get<uint32_t>() : nullptr};
      k.group->dispatch(in, out, k.stream);
      CUDA_OK(cudaEventRecord(k.ev[2], k.stream));
      CUDA_OK(cudaMemcpyAsync(k.host_offsets, k.row_offsets.p, size_t(G + 1) * 4,
                              cudaMemcpyDeviceToHost, k.stream));
    }
    for (LayerRank& k : ranks) {  // the problem sizes for cuBLAS; dequant
      CUDA_OK(cudaSetDevice(k.dev));
      k.group->synchronize(k.stream);
      if (o.format != TokenFormat::kBF16) {
        dequant_rows<<<264, 256, 0, k.stream>>>(
            o.format, k.tokens.get<uint8_t>(), k.scales.p, k.row_offsets.get<uint32_t>(),
            k.scales_offsets.get<uint32_t>(), G, H, sz.max_recv_rows, sz.max_routed_rows, gs,
            k.xin.get<uint16_t>());
        CUDA_OK(cudaGetLastError());
      }
      CUDA_OK(cudaEventRecord(k.ev[3], k.stream));
    }
    for (LayerRank& k : ranks) {  // gemm1, silu, gemm2
      CUDA_OK(cudaSetDevice(k.dev));
      grouped_gemm(k, o.format == TokenFormat::kBF16 ? k.tokens.p : k.xin.p, k.w1.p, k.h1.p,
                   2 * I, H);
      CUDA_OK(cudaEventRecord(k.ev[4], k.stream));
      SiluInput si;
      si.x = k.h1.p;
      si.row_offsets = k.row_offsets.get<uint32_t>();
      si.groups = G;
      si.intermediate = I;
      si.max_rows = sz.max_recv_rows;
      silu_bf16(si, k.z.p, k.stream);
      CUDA_OK(cudaEventRecord(k.ev[5], k.stream));
      grouped_gemm(k, k.z.p, k.w2.p, k.y.p, H, I);
      CUDA_OK(cudaEventRecord(k.ev[6], k.stream));
    }
    for (LayerRank& k : ranks) {  // combine
      CUDA_OK(cudaSetDevice(k.dev));
      k.group->combine(CombineInput{k.y.p, k.row_offsets.get<uint32_t>(), k.src_info.get<SrcInfo>(), H},
                       CombineOutput{k.out.p, nullptr}, k.stream);
      CUDA_OK(cudaEventRecord(k.ev[7], k.stream));
    }
    for (LayerRank& k : ranks) {
      CUDA_OK(cudaSetDevice(k.dev));
      k.group->synchronize(k.stream);
    }
  };

  // Warm-up and check.
  run_layer();
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(n));
  std::vector<std::vector<float>> wts(static_cast<size_t>(n));
  std::vector<std::vector<uint16_t>> outs(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    LayerRank& k = ranks[size_t(r)];
    ids[size_t(r)].resize(size_t(T) * K);
    wts[size_t(r)].resize(size_t(T) * K);
    outs[size_t(r)].resize(size_t(T) * H);
    CUDA_OK(cudaMemcpy(ids[size_t(r)].data(), k.ids.p, ids[size_t(r)].size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(wts[size_t(r)].data(), k.weights.p, wts[size_t(r)].size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(outs[size_t(r)].data(), k.out.p, outs[size_t(r)].size() * 2, cudaMemcpyDeviceToHost));
  }

  // The same layer on GPU 0 without epcomm: the router per rank (the same cuBLAS call on the
  // same shapes), then per expert the rows of every rank's tokens routed to it.
  CUDA_OK(cudaSetDevice(0));
  cublasHandle_t blas;
  CUBLAS_OK(cublasCreate(&blas));
  bool ok = true;
  std::vector<std::vector<uint16_t>> xq(static_cast<size_t>(n));
  {
    Buf wr0 = upload(0, wr_host.data(), wr_host.size() * 2);
    Buf lg0(0, size_t(T) * E * 4), id0(0, size_t(T) * K * 4), w0(0, size_t(T) * K * 4);
    for (int r = 0; r < n && ok; ++r) {
      Buf x0 = upload(0, x_host[size_t(r)].data(), x_host[size_t(r)].size() * 2);
      const float one = 1.0f, zero = 0.0f;
      CUBLAS_OK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, E, T, H, &one, wr0.p, CUDA_R_16BF, H,
                             x0.p, CUDA_R_16BF, H, &zero, lg0.p, CUDA_R_32F, E,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      topk_softmax<<<(T + 127) / 128, 128>>>(lg0.get<float>(), T, E, K, id0.get<int32_t>(),
                                             w0.get<float>());
      CUDA_OK(cudaGetLastError());
      std::vector<int32_t> rid(size_t(T) * K);
      std::vector<float> rw(size_t(T) * K);
      CUDA_OK(cudaMemcpy(rid.data(), id0.p, rid.size() * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(rw.data(), w0.p, rw.size() * 4, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < rid.size() && ok; ++i)
        if (rid[i] != ids[size_t(r)][i] || std::fabs(rw[i] - wts[size_t(r)][i]) > 1e-6f) {
          std::printf("CHECK FAILED: rank %d router slot %zu: %d / %g, single GPU %d / %g\n", r, i,
                      ids[size_t(r)][i], wts[size_t(r)][i], rid[i], rw[i]);
          ok = false;
        }
      xq[size_t(r)] = quantize_round_trip(o.format, x_host[size_t(r)], T, H, gs);
    }
  }
  std::vector<std::vector<double>> want(size_t(n), std::vector<double>(size_t(T) * H, 0.0));
  for (int e = 0; e <= E && ok; ++e) {  // e == E: the shared expert
    if (e == E && !o.shared) break;
    std::vector<std::pair<int, int>> rows;  // (rank, token)
    std::vector<float> rw;
    for (int r = 0; r < n; ++r)
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k)
          if (e == E ? k == 0 : ids[size_t(r)][size_t(t) * K + k] == e) {
            rows.push_back({r, t});
            rw.push_back(e == E ? 1.0f : wts[size_t(r)][size_t(t) * K + k]);
          }
    if (rows.empty()) continue;
    const int m = int(rows.size());
    std::vector<uint16_t> xe(size_t(m) * H);
    for (int i = 0; i < m; ++i)
      std::memcpy(&xe[size_t(i) * H], &xq[size_t(rows[size_t(i)].first)][size_t(rows[size_t(i)].second) * H], size_t(H) * 2);
    Buf xd = upload(0, xe.data(), xe.size() * 2), hd(0, size_t(m) * 2 * I * 2);
    Buf w1d = upload(0, w1_of(o, e).data(), size_t(2 * I) * H * 2);
    gemm(blas, xd.p, w1d.p, hd.p, m, 2 * I, H);
    std::vector<uint16_t> h(size_t(m) * 2 * I), zz(size_t(m) * I);
    CUDA_OK(cudaMemcpy(h.data(), hd.p, h.size() * 2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < m; ++i)
      for (int c = 0; c < I; ++c)
        zz[size_t(i) * I + c] = float_to_bf16(
            silu_mul(bf16_to_float(h[size_t(i) * 2 * I + c]), bf16_to_float(h[size_t(i) * 2 * I + I + c])));
    Buf zd = upload(0, zz.data(), zz.size() * 2), yd(0, size_t(m) * H * 2);
    Buf w2d = upload(0, w2_of(o, e).data(), size_t(H) * I * 2);
    gemm(blas, zd.p, w2d.p, yd.p, m, H, I);
    std::vector<uint16_t> yy(size_t(m) * H);
    CUDA_OK(cudaMemcpy(yy.data(), yd.p, yy.size() * 2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < m; ++i) {
      double* w = want[size_t(rows[size_t(i)].first)].data() + size_t(rows[size_t(i)].second) * H;
      for (int c = 0; c < H; ++c) w[c] += double(rw[size_t(i)]) * bf16_to_float(yy[size_t(i) * H + c]);
    }
  }
  // Per rank: ||out - want|| / ||want|| <= 1/64, and every element within (|want| + rms) / 16
  // (the bf16 roundings of h, z, y and the partial sums stay far below both; a wrong row, weight
  // or scale block does not).
  double worst = 0, worst_elem = 0;
  for (int r = 0; r < n && ok; ++r) {
    const std::vector<double>& w = want[size_t(r)];
    double err2 = 0, ref2 = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      const double d = bf16_to_float(outs[size_t(r)][i]) - w[i];
      err2 += std::isfinite(d) ? d * d : INFINITY;
      ref2 += w[i] * w[i];
    }
    const double rms = std::sqrt(ref2 / double(std::max<size_t>(w.size(), 1)));
    const double rel = std::sqrt(err2 / std::max(ref2, 1e-30));
    worst = std::max(worst, rel);
    if (!(rel <= 1.0 / 64)) {
      std::printf("CHECK FAILED: rank %d: ||out - single GPU|| / ||single GPU|| = %.3g\n", r, rel);
      ok = false;
    }
    for (size_t i = 0; i < w.size() && ok; ++i) {
      const double d = std::fabs(bf16_to_float(outs[size_t(r)][i]) - w[i]);
      const double ratio = d / (std::fabs(w[i]) + rms);
      if (!(ratio <= 1.0 / 16)) {
        std::printf("CHECK FAILED: rank %d token %zu column %zu: %g, single GPU %g\n", r,
                    i / size_t(H), i % size_t(H), double(bf16_to_float(outs[size_t(r)][i])), w[i]);
        ok = false;
      }
      worst_elem = std::max(worst_elem, ratio);
    }
  }
  CUBLAS_OK(cublasDestroy(blas));
  if (ok)
    std::printf(
        "check: every rank's output matches the single-GPU layer (worst relative L2 "
        "error %.2e, bound 1/64; worst element error %.2e of |ref| + rms, bound 1/16)\n",
        worst, worst_elem);

  // Timed iterations: per stage, mean over iterations and ranks.
  std::vector<double> stage_us(kNumStages, 0.0);
  for (int it = 0; it < o.iters; ++it) {
    run_layer();
    for (LayerRank& k : ranks)
      for (int s = 0; s < kNumStages; ++s) {
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, k.ev[size_t(s)], k.ev[size_t(s) + 1]));
        stage_us[size_t(s)] += 1e3 * ms / (double(o.iters) * n);
      }
  }
  double total = 0;
  for (double v : stage_us) total += v;
  std::printf("stage times (us, mean over %d iterations and %d ranks%s):\n", o.iters, n,
              per_gpu > 1 ? "; ranks share a GPU, so each stage includes the others' work" : "");
  for (int s = 0; s < kNumStages; ++s)
    std::printf("  %-9s %10.1f\n", kStages[s], stage_us[size_t(s)]);
  std::printf("  %-9s %10.1f\n", "total", total);
  std::printf("communication (dispatch + combine): %.1f%% of the layer\n",
              100.0 * (stage_us[1] + stage_us[6]) / total);
  for (LayerRank& k : ranks) {
    CUDA_OK(cudaSetDevice(k.dev));
    for (auto& e : k.ev) (void)cudaEventDestroy(e);
    (void)cublasDestroy(k.blas);
    (void)cudaStreamDestroy(k.stream);
    (void)cudaFreeHost(k.host_offsets);
  }
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "moe_layer: %s\n", e.what());
  return 2;
}
