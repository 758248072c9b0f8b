#include <stdexcept>
#include <string>

#include "common.h"
#include "epcomm/formats/codecs.h"
#include "formats.h"

namespace epbench {
namespace {

constexpr int kThreads = 256;

// What differs between the formats: the block quantiser, how a block's quantiser is made from
// its amax, whether codes are packed two per byte, and how the scale is stored.
struct Fp8Blockwise {
  using Quant = epcomm::Fp8BlockQuant;
  static constexpr bool kPacked = false;
  __host__ __device__ static Quant make(float amax, float) { return Quant::from_amax(amax); }
  __host__ __device__ static void store_scale(uint8_t* scales, int32_t block, const Quant& q) {
    reinterpret_cast<float*>(scales)[block] = q.scale;
  }
};

struct Nvfp4 {
  using Quant = epcomm::Nvfp4BlockQuant;
  static constexpr bool kPacked = true;
  __host__ __device__ static Quant make(float amax, float gs) { return Quant::from_amax(amax, gs); }
  __host__ __device__ static void store_scale(uint8_t* scales, int32_t block, const Quant& q) {
    scales[block] = q.scale_code;
  }
};

// MXFP8, MXFP4: an e8m0 scale byte from the block's amax alone.
template <class BlockQuant, bool kPackedCodes>
struct E8m0Scaled {
  using Quant = BlockQuant;
  static constexpr bool kPacked = kPackedCodes;
  __host__ __device__ static Quant make(float amax, float) { return Quant::from_amax(amax); }
  __host__ __device__ static void store_scale(uint8_t* scales, int32_t block, const Quant& q) {
    scales[block] = q.scale_code;
  }
};
using Mxfp8 = E8m0Scaled<epcomm::Mxfp8BlockQuant, false>;
using Mxfp4 = E8m0Scaled<epcomm::Mxfp4BlockQuant, true>;

// The kernel's steps, one 16-byte vector (8 values) per thread; host + device, so the host can
// replay them against the reference encoders.

// 8 bf16 (one 16-byte vector) widened to fp32, exactly; element 2w is word w's low half.
__host__ __device__ inline void widen_bf16x8(const uint4& in, float (&x)[8]) {
  const uint32_t words[4] = {in.x, in.y, in.z, in.w};
  for (int w = 0; w < 4; ++w) {
    x[2 * w] = epcomm::bits_as_float(words[w] << 16);
    x[2 * w + 1] = epcomm::bits_as_float(words[w] & 0xffff0000u);
  }
}

__host__ __device__ inline float amax8(const float (&x)[8]) {
  float amax = 0.0f;
  for (int e = 0; e < 8; ++e)
    amax = epcomm::abs_max(amax, x[e]);
  return amax;
}

// Vector v of a message row: the codes of values [8v, 8v + 8) quantised with their scale block's
// quantiser (block_amax: the amax of the whole block), and the block's scale if v is its first
// vector. `row` is the message's first byte; its scales start at codes_bytes.
template <class Format>
__host__ __device__ inline void store_vector(const float (&x)[8], float block_amax, float gs,
                                             int32_t v, int64_t codes_bytes, uint8_t* row) {
  using Quant = typename Format::Quant;
  constexpr int kLanes = Quant::kGroup / 8;  // vectors per scale block
  const Quant q = Format::make(block_amax, gs);
  if constexpr (Format::kPacked) {  // 8 values -> 4 bytes, element 2i in the low nibble of byte i
    uint32_t packed = 0;
    for (int b = 0; b < 4; ++b)
      packed |= uint32_t(epcomm::pack_e2m1x2(q.encode(x[2 * b]), q.encode(x[2 * b + 1])))
                << (8 * b);
    reinterpret_cast<uint32_t*>(row)[v] = packed;
  } else {  // 8 values -> 8 bytes
    uint32_t lo = 0, hi = 0;
    for (int b = 0; b < 4; ++b) {
      lo |= uint32_t(q.encode(x[b])) << (8 * b);
      hi |= uint32_t(q.encode(x[4 + b])) << (8 * b);
    }
    reinterpret_cast<uint2*>(row)[v] = make_uint2(lo, hi);
  }
  if (v % kLanes == 0) Format::store_scale(row + codes_bytes, v / kLanes, q);
}

// Thread i quantises the 16-byte vector i of the tokens: row i / (H / 8), vector v = i % (H / 8).
// The kLanes = group / 8 consecutive threads of one scale block (16, 2, 4 or 4: aligned within a
// warp, as H / 8 is a multiple of kLanes) reduce the block's amax with shuffles among themselves.
// A block is either wholly inside [0, rows * H / 8) or wholly outside, so the early return keeps
// every shuffle's lanes present.
template <class Format>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const uint4* tokens, int64_t vectors, int32_t row_vectors, int64_t codes_bytes,
                    int64_t row_bytes, float gs, uint8_t* out) {
  constexpr int kLanes = Format::Quant::kGroup / 8;
  static_assert(kLanes >= 1 && kLanes <= 16 && (kLanes & (kLanes - 1)) == 0, "lanes per block");
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vectors) return;
  float x[8];
  widen_bf16x8(tokens[i], x);
  float amax = amax8(x);
  const unsigned lane = threadIdx.x % 32u;
  const unsigned mask = ((1u << kLanes) - 1u) << (lane & ~unsigned(kLanes - 1));
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    amax = epcomm::abs_max(amax, __shfl_xor_sync(mask, amax, offset));
  store_vector<Format>(x, amax, gs, int32_t(i % row_vectors), codes_bytes,
                       out + (i / row_vectors) * row_bytes);
}

template <class Format>
void launch_quantize(const MessageFormat& m, const void* tokens, int32_t rows, uint8_t* out,
                     cudaStream_t stream) {
  const int32_t row_vectors = m.hidden / 8;
  const int64_t vectors = int64_t(rows) * row_vectors;
  const int64_t blocks = (vectors + kThreads - 1) / kThreads;
  quantize_kernel<Format><<<unsigned(blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(tokens), vectors, row_vectors, m.codes_bytes(), m.row_bytes(),
      m.nvfp4_global_scale, out);
  CHECK_CUDA(cudaGetLastError());
}

__global__ void fill_synthetic_kernel(uint16_t* out, int32_t rank, int64_t rows, int32_t hidden) {
  const int64_t n = rows * hidden;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = synthetic_expert_value(rank, i / hidden, int32_t(i % hidden));
}

}  // namespace

void quantize_messages(const MessageFormat& m, const void* tokens, int32_t rows, uint8_t* out,
                       cudaStream_t stream) {
  const int32_t group = epcomm::format_scale_group(m.format);
  if (group == 0 || m.hidden <= 0 || m.hidden % group != 0 || m.hidden % 8 != 0)
    throw std::invalid_argument(
        "quantize_messages: " + std::string(epcomm::token_format_name(m.format)) + " with hidden " +
        std::to_string(m.hidden));
  if (rows <= 0) return;
  switch (m.format) {
    case epcomm::TokenFormat::kFp8Blockwise:
      return launch_quantize<Fp8Blockwise>(m, tokens, rows, out, stream);
    case epcomm::TokenFormat::kNvfp4:
      return launch_quantize<Nvfp4>(m, tokens, rows, out, stream);
    case epcomm::TokenFormat::kMxfp8:
      return launch_quantize<Mxfp8>(m, tokens, rows, out, stream);
    case epcomm::TokenFormat::kMxfp4:
      return launch_quantize<Mxfp4>(m, tokens, rows, out, stream);
    default:
      break;
  }
  throw std::logic_error("quantize_messages: not a quantised format");
}

void fill_synthetic_expert_out(uint16_t* out, int32_t rank, int64_t rows, int32_t hidden,
                               cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return;
  fill_synthetic_kernel<<<2048, kThreads, 0, stream>>>(out, rank, rows, hidden);
  CHECK_CUDA(cudaGetLastError());
}

}  // namespace epbench
