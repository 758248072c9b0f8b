// The device builds of the format codecs (epcomm/formats/codecs.h) against their host builds, bit
// for bit: every code of every format, a large set of fp32 inputs (every sign/exponent/top-7
// mantissa pattern with tie, near-tie and random low bits, plus random patterns), the scale
// rules, and the per-block quantisers of every format against the CPU reference encoders and
// decoders on rows with near-tie values. Also checks the e4m3/e2m1 encoders against CUDA's own
// conversions (hardware cvt.rn.satfinite where the GPU has it) on all 2^32 fp32 inputs, so kernels
// may use either, and the kernels' e4m3 encoders (the hardware conversion on sm_89 and later)
// against the integer one on all of them. Skips without a GPU.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#if CUDART_VERSION >= 12080
#include <cuda_fp4.h>
#define EPCOMM_TEST_HAVE_CUDA_FP4 1
#endif
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"

namespace epcomm {
namespace {

#define EPCOMM_FMT_CUDA(expr)                                                          \
  do {                                                                                 \
    const cudaError_t fmt_err_ = (expr);                                               \
    ASSERT_EQ(fmt_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(fmt_err_); \
  } while (0)

// ---- device memory and launches -------------------------------------------------------------

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;

  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (ptr != nullptr) {
      const cudaError_t err = cudaFree(ptr);
      EXPECT_EQ(err, cudaSuccess) << "cudaFree: " << cudaGetErrorString(err);
    }
  }
  cudaError_t alloc(size_t n) {
    return cudaMalloc(reinterpret_cast<void**>(&ptr), (n == 0 ? 1 : n) * sizeof(T));
  }
};

template <typename T>
void to_device(const std::vector<T>& host, DeviceArray<T>* dev) {
  EPCOMM_FMT_CUDA(dev->alloc(host.size()));
  EPCOMM_FMT_CUDA(
      cudaMemcpy(dev->ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <typename T>
void from_device(const DeviceArray<T>& dev, std::vector<T>* host) {
  EPCOMM_FMT_CUDA(
      cudaMemcpy(host->data(), dev.ptr, host->size() * sizeof(T), cudaMemcpyDeviceToHost));
}

void finish_launch() {
  EPCOMM_FMT_CUDA(cudaGetLastError());
  EPCOMM_FMT_CUDA(cudaDeviceSynchronize());
}

unsigned grid_for(int64_t n, unsigned block) {
  const int64_t blocks = (n + block - 1) / block;
  return unsigned(blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks));
}

template <typename In, typename Out, typename F>
__global__ void map_kernel(const In* in, Out* out, int64_t n, F f) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = f(in[i]);
  }
}

// out[i] = f(in[i]) on the device.
template <typename Out, typename In, typename F>
void device_map(const std::vector<In>& in, F f, std::vector<Out>* out) {
  DeviceArray<In> d_in;
  DeviceArray<Out> d_out;
  ASSERT_NO_FATAL_FAILURE(to_device(in, &d_in));
  EPCOMM_FMT_CUDA(d_out.alloc(in.size()));
  map_kernel<<<grid_for(int64_t(in.size()), 256), 256>>>(d_in.ptr, d_out.ptr, int64_t(in.size()),
                                                         f);
  ASSERT_NO_FATAL_FAILURE(finish_launch());
  out->resize(in.size());
  ASSERT_NO_FATAL_FAILURE(from_device(d_out, out));
}

std::string hex(uint32_t u) {
  std::ostringstream s;
  s << "0x" << std::hex << u;
  return s.str();
}

// EXPECTs device[i] == host(in[i]) for all i, reporting the first mismatch.
template <typename In, typename Out, typename Host>
void expect_same(const std::vector<In>& in, const std::vector<Out>& device, Host host,
                 const char* what) {
  ASSERT_EQ(in.size(), device.size());
  size_t bad = 0;
  std::string first;
  for (size_t i = 0; i < in.size(); ++i) {
    const Out want = host(in[i]);
    if (device[i] != want && bad++ == 0) {
      std::ostringstream s;
      s << "input #" << i << " -> device " << hex(uint32_t(device[i])) << ", host "
        << hex(uint32_t(want));
      first = s.str();
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << in.size() << " differ; first " << first;
}

// ---- functors run on the device -------------------------------------------------------------

struct E4m3Encode {
  __device__ uint8_t operator()(uint32_t x) const { return float_to_e4m3(bits_as_float(x)); }
};
struct E2m1Encode {
  __device__ uint8_t operator()(uint32_t x) const { return float_to_e2m1(bits_as_float(x)); }
};
struct E8m0Ceil {
  __device__ uint8_t operator()(uint32_t x) const { return float_to_e8m0_ceil(bits_as_float(x)); }
};
struct Mxfp8Scale {
  __device__ uint8_t operator()(uint32_t x) const { return mxfp8_scale_code(bits_as_float(x)); }
};
struct Mxfp4Scale {
  __device__ uint8_t operator()(uint32_t x) const { return mxfp4_scale_code(bits_as_float(x)); }
};
struct AbsMaxWithOne {  // abs_max(1, x): NaN ignored, sign dropped
  __device__ uint32_t operator()(uint32_t x) const {
    return float_as_bits(abs_max(1.0f, bits_as_float(x)));
  }
};
struct E4m3Decode {
  __device__ uint32_t operator()(uint8_t c) const { return float_as_bits(e4m3_to_float(c)); }
};
struct E2m1Decode {
  __device__ uint32_t operator()(uint8_t c) const { return float_as_bits(e2m1_to_float(c)); }
};
struct E8m0Decode {
  __device__ uint32_t operator()(uint8_t c) const { return float_as_bits(e8m0_to_float(c)); }
};
struct E8m0Reciprocal {
  __device__ uint32_t operator()(uint8_t c) const { return float_as_bits(e8m0_reciprocal(c)); }
};

// ---- inputs ---------------------------------------------------------------------------------

// Every top half (sign, exponent, top 7 mantissa bits) with low halves that make exact ties of
// e4m3 and e2m1 (0 and 0x8000 with the right top bits), values next to them and random ones;
// then random patterns. Every e4m3 and e2m1 value, midpoint and neighbour is among them.
std::vector<uint32_t> probe_bits() {
  std::mt19937_64 gen(0xf0f0);
  std::vector<uint32_t> out;
  for (uint32_t top = 0; top < (1u << 16); ++top) {
    for (uint32_t low : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, uint32_t(gen() & 0xffff)}) {
      out.push_back(top << 16 | low);
    }
  }
  for (int i = 0; i < (1 << 22); ++i)
    out.push_back(uint32_t(gen()));
  return out;
}

std::vector<uint8_t> all_codes(uint32_t n) {
  std::vector<uint8_t> out(n);
  for (uint32_t c = 0; c < n; ++c)
    out[c] = uint8_t(c);
  return out;
}

class FormatConversionsGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();  // clear it, so later CUDA calls do not report it
      GTEST_SKIP() << "no CUDA device ("
                   << (err != cudaSuccess ? cudaGetErrorString(err) : "device count 0") << ")";
    }
    EPCOMM_FMT_CUDA(cudaSetDevice(0));
  }
};

// ---- scalar codecs: device == host ----------------------------------------------------------

TEST_F(FormatConversionsGpu, EncodersMatchHostOnProbeSet) {
  const std::vector<uint32_t> in = probe_bits();
  std::vector<uint8_t> dev;
  ASSERT_NO_FATAL_FAILURE(device_map(in, E4m3Encode{}, &dev));
  expect_same(
      in, dev, [](uint32_t x) { return float_to_e4m3(bits_as_float(x)); }, "e4m3");
  ASSERT_NO_FATAL_FAILURE(device_map(in, E2m1Encode{}, &dev));
  expect_same(
      in, dev, [](uint32_t x) { return float_to_e2m1(bits_as_float(x)); }, "e2m1");
  ASSERT_NO_FATAL_FAILURE(device_map(in, E8m0Ceil{}, &dev));
  expect_same(
      in, dev, [](uint32_t x) { return float_to_e8m0_ceil(bits_as_float(x)); }, "e8m0 ceil");
  ASSERT_NO_FATAL_FAILURE(device_map(in, Mxfp8Scale{}, &dev));
  expect_same(
      in, dev, [](uint32_t x) { return mxfp8_scale_code(bits_as_float(x)); }, "mxfp8 scale");
  ASSERT_NO_FATAL_FAILURE(device_map(in, Mxfp4Scale{}, &dev));
  expect_same(
      in, dev, [](uint32_t x) { return mxfp4_scale_code(bits_as_float(x)); }, "mxfp4 scale");
  std::vector<uint32_t> dev32;
  ASSERT_NO_FATAL_FAILURE(device_map(in, AbsMaxWithOne{}, &dev32));
  expect_same(
      in, dev32, [](uint32_t x) { return float_as_bits(abs_max(1.0f, bits_as_float(x))); },
      "abs_max");
}

TEST_F(FormatConversionsGpu, DecodersMatchHostOnEveryCode) {
  const std::vector<uint8_t> codes = all_codes(256);
  std::vector<uint32_t> dev;
  ASSERT_NO_FATAL_FAILURE(device_map(codes, E4m3Decode{}, &dev));
  expect_same(
      codes, dev, [](uint8_t c) { return float_as_bits(e4m3_to_float(c)); }, "e4m3");
  ASSERT_NO_FATAL_FAILURE(device_map(codes, E2m1Decode{}, &dev));  // high nibble ignored
  expect_same(
      codes, dev, [](uint8_t c) { return float_as_bits(e2m1_to_float(c)); }, "e2m1");
  ASSERT_NO_FATAL_FAILURE(device_map(codes, E8m0Decode{}, &dev));
  expect_same(
      codes, dev, [](uint8_t c) { return float_as_bits(e8m0_to_float(c)); }, "e8m0");
  ASSERT_NO_FATAL_FAILURE(device_map(codes, E8m0Reciprocal{}, &dev));
  expect_same(
      codes, dev, [](uint8_t c) { return float_as_bits(e8m0_reciprocal(c)); }, "e8m0 reciprocal");
  // Decode -> encode on the device gives every code back (NaN codes keep their sign).
  std::vector<uint32_t> decoded;
  ASSERT_NO_FATAL_FAILURE(device_map(codes, E4m3Decode{}, &decoded));
  std::vector<uint8_t> again;
  ASSERT_NO_FATAL_FAILURE(device_map(decoded, E4m3Encode{}, &again));
  for (uint32_t c = 0; c < 256; ++c)
    EXPECT_EQ(again[c], c) << "e4m3 code " << c;
}

// ---- against CUDA's own conversions, all 2^32 inputs ----------------------------------------

struct Mismatch {
  unsigned long long count;
  uint32_t first_input;
  uint32_t ours;
  uint32_t cuda;
};

__device__ void record(Mismatch* m, uint32_t input, uint32_t ours, uint32_t cuda) {
  if (atomicAdd(&m->count, 1ull) == 0) {
    m->first_input = input;
    m->ours = ours;
    m->cuda = cuda;
  }
}

// m[0]: the integer e4m3 encoder (the host's) against __nv_cvt_float_to_fp8 (satfinite); NaN
// only needs to stay NaN, as the sign of a converted NaN is not specified. m[1]: e2m1 against
// __nv_cvt_float_to_fp4 (round to nearest), exactly. m[2]: the kernels' e4m3 encoders
// (float_to_e4m3, and float2_to_e4m3x2 with x in either half: the hardware conversion on this
// GPU) against the integer one, exactly, NaN signs included; float2_to_e4m3x2_not_nan too, x not
// NaN.
__global__ void compare_with_cuda_kernel(Mismatch* m) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t u = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; u < (1ull << 32);
       u += stride) {
    const uint32_t b = uint32_t(u);
    const float x = __uint_as_float(b);
    const uint8_t ours8 = detail::e4m3_code_portable(x);
    const uint8_t cuda8 = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    const bool same8 = e4m3_is_nan(ours8) ? e4m3_is_nan(cuda8) : ours8 == cuda8;
    if (!same8) record(&m[0], b, ours8, cuda8);
    const float y = __uint_as_float(b ^ 0x80000000u);  // the other half: x's negation
    const uint32_t want = ours8 | uint32_t(detail::e4m3_code_portable(y)) << 8;
    const uint32_t pair = float2_to_e4m3x2(x, y), swapped = float2_to_e4m3x2(y, x);
    const uint32_t single = float_to_e4m3(x);
    if (pair != want || swapped != (want >> 8 | (want & 0xffu) << 8) || single != ours8)
      record(&m[2], b, pair, want);
    if (x == x && float2_to_e4m3x2_not_nan(x, y) != want) record(&m[2], b, pair, want);
#if defined(EPCOMM_TEST_HAVE_CUDA_FP4)
    const uint8_t ours4 = float_to_e2m1(x);
    const uint8_t cuda4 = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
    if (ours4 != cuda4) record(&m[1], b, ours4, cuda4);
#endif
  }
}

TEST_F(FormatConversionsGpu, EncodersMatchCudaConversionsOnEveryFloat) {
  DeviceArray<Mismatch> d_m;
  EPCOMM_FMT_CUDA(d_m.alloc(3));
  EPCOMM_FMT_CUDA(cudaMemset(d_m.ptr, 0, 3 * sizeof(Mismatch)));
  compare_with_cuda_kernel<<<2048, 256>>>(d_m.ptr);
  ASSERT_NO_FATAL_FAILURE(finish_launch());
  Mismatch m[3];
  EPCOMM_FMT_CUDA(cudaMemcpy(m, d_m.ptr, sizeof m, cudaMemcpyDeviceToHost));
  EXPECT_EQ(m[0].count, 0ull) << "e4m3: first input " << hex(m[0].first_input) << " -> ours "
                              << hex(m[0].ours) << ", CUDA " << hex(m[0].cuda);
#if defined(EPCOMM_TEST_HAVE_CUDA_FP4)
  EXPECT_EQ(m[1].count, 0ull) << "e2m1: first input " << hex(m[1].first_input) << " -> ours "
                              << hex(m[1].ours) << ", CUDA " << hex(m[1].cuda);
#endif
  EXPECT_EQ(m[2].count, 0ull) << "e4m3 kernel encoders: first input " << hex(m[2].first_input)
                              << " -> pair (x, -x) " << hex(m[2].ours) << ", want "
                              << hex(m[2].cuda);
}

// Decoded values as CUDA decodes them (through half, which holds every e4m3 and e2m1 value).
__global__ void cuda_decode_kernel(uint32_t* e4m3_bits, uint32_t* e2m1_bits) {
  const uint32_t c = threadIdx.x;
  const __half h8(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(c), __NV_E4M3));
  e4m3_bits[c] = __float_as_uint(__half2float(h8));
#if defined(EPCOMM_TEST_HAVE_CUDA_FP4)
  if (c < 16) {
    const __half h4(__nv_cvt_fp4_to_halfraw(__nv_fp4_storage_t(c), __NV_E2M1));
    e2m1_bits[c] = __float_as_uint(__half2float(h4));
  }
#endif
}

TEST_F(FormatConversionsGpu, DecodersMatchCudaConversions) {
  DeviceArray<uint32_t> d8, d4;
  EPCOMM_FMT_CUDA(d8.alloc(256));
  EPCOMM_FMT_CUDA(d4.alloc(16));
  EPCOMM_FMT_CUDA(cudaMemset(d4.ptr, 0, 16 * sizeof(uint32_t)));
  cuda_decode_kernel<<<1, 256>>>(d8.ptr, d4.ptr);
  ASSERT_NO_FATAL_FAILURE(finish_launch());
  std::vector<uint32_t> cuda8(256), cuda4(16);
  ASSERT_NO_FATAL_FAILURE(from_device(d8, &cuda8));
  ASSERT_NO_FATAL_FAILURE(from_device(d4, &cuda4));
  for (uint32_t c = 0; c < 256; ++c) {
    const float ours = e4m3_to_float(uint8_t(c)), cuda = bits_as_float(cuda8[c]);
    if (std::isnan(ours)) {
      EXPECT_TRUE(std::isnan(cuda)) << "e4m3 code " << c;
    } else {
      EXPECT_EQ(float_as_bits(ours), cuda8[c]) << "e4m3 code " << c;
    }
  }
#if defined(EPCOMM_TEST_HAVE_CUDA_FP4)
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(float_as_bits(e2m1_to_float(uint8_t(c))), cuda4[c]) << "e2m1 code " << c;
  }
#endif
}

// ---- per-block quantisers: device == CPU reference ------------------------------------------

// Rows of blocks: zero, negative zero, tiny, spike, constant, random normals times 10^U(-3, 4),
// and "tie" blocks whose values sit within an ulp or two of the midpoints between the element
// format's values, times the block's divisor (divisor_of(amax): what x is divided by).
template <typename DivisorOf>
std::vector<float> make_rows(int64_t rows, int32_t hidden, int32_t group,
                             const std::vector<double>& midpoints, DivisorOf divisor_of,
                             uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> decade(-3.0, 4.0);
  std::vector<float> x(size_t(rows * hidden));
  for (int64_t b = 0; b < rows * hidden / group; ++b) {
    float* blk = x.data() + b * group;
    const double mag = std::pow(10.0, decade(gen));
    const int kind = int(b % 10);
    for (int32_t i = 0; i < group; ++i) {
      switch (kind) {
        case 0:
          blk[i] = 0.0f;
          break;
        case 1:
          blk[i] = -0.0f;
          break;
        case 2:
          blk[i] = float(normal(gen) * 1e-7);
          break;
        case 3:
          blk[i] = i == 1 ? 1e4f : 0.0f;
          break;
        case 4:
          blk[i] = -2.75f;
          break;
        default:
          blk[i] = float(normal(gen) * mag);
          break;
      }
    }
    if (kind >= 7) {  // tie blocks
      const float amax = float(mag);
      const float divisor = divisor_of(amax);
      blk[0] = amax;
      for (int32_t i = 1; i < group; ++i) {
        float v = float(midpoints[size_t(gen() % midpoints.size())] * divisor);
        const int steps = int(gen() % 5) - 2;
        for (int s = 0; s < steps; ++s)
          v = std::nextafter(v, INFINITY);
        for (int s = 0; s > steps; --s)
          v = std::nextafter(v, -INFINITY);
        blk[i] = (gen() & 1) ? -v : v;
        if (!(std::fabs(blk[i]) < amax)) blk[i] = 0.0f;
      }
    }
  }
  return x;
}

std::vector<double> e4m3_midpoints() {
  std::vector<double> out;
  for (uint8_t c = 0; c + 1 < kE4m3MaxCode; ++c) {
    out.push_back((double(e4m3_to_float(c)) + double(e4m3_to_float(uint8_t(c + 1)))) / 2);
  }
  return out;
}
std::vector<double> e2m1_midpoints() {
  return {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0};
}

template <typename Quant>
__device__ Quant block_quant(float amax, float gs);
template <>
__device__ Fp8BlockQuant block_quant<Fp8BlockQuant>(float amax, float) {
  return Fp8BlockQuant::from_amax(amax);
}
template <>
__device__ Nvfp4BlockQuant block_quant<Nvfp4BlockQuant>(float amax, float gs) {
  return Nvfp4BlockQuant::from_amax(amax, gs);
}
template <>
__device__ Mxfp8BlockQuant block_quant<Mxfp8BlockQuant>(float amax, float) {
  return Mxfp8BlockQuant::from_amax(amax);
}
template <>
__device__ Mxfp4BlockQuant block_quant<Mxfp4BlockQuant>(float amax, float) {
  return Mxfp4BlockQuant::from_amax(amax);
}

__device__ void store_scale(const Fp8BlockQuant& q, float* scales, uint8_t*, int64_t b) {
  scales[b] = q.scale;
}
__device__ void store_scale(const Nvfp4BlockQuant& q, float*, uint8_t* scales, int64_t b) {
  scales[b] = q.scale_code;
}
template <typename MxQuant>
__device__ void store_scale(const MxQuant& q, float*, uint8_t* scales, int64_t b) {
  scales[b] = q.scale_code;
}

// One thread per block: amax, quantiser, codes (packed two per byte when kPacked), then the
// block decoded again from what was stored.
template <typename Quant, bool kPacked>
__global__ void block_codec_kernel(const float* x, int64_t n_blocks, float gs, uint8_t* codes,
                                   float* f32_scales, uint8_t* u8_scales, float* decoded) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= n_blocks) return;
  constexpr int32_t kGroup = Quant::kGroup;
  const float* blk = x + b * kGroup;
  float amax = 0.0f;
  for (int32_t i = 0; i < kGroup; ++i)
    amax = abs_max(amax, blk[i]);
  const Quant q = block_quant<Quant>(amax, gs);
  store_scale(q, f32_scales, u8_scales, b);
  for (int32_t i = 0; i < kGroup; i += 2) {
    const uint8_t c0 = q.encode(blk[i]), c1 = q.encode(blk[i + 1]);
    const int64_t k = b * kGroup + i;
    if constexpr (kPacked) {
      codes[k / 2] = pack_e2m1x2(c0, c1);
    } else {
      codes[k] = c0;
      codes[k + 1] = c1;
    }
    decoded[k] = q.decode(c0);
    decoded[k + 1] = q.decode(c1);
  }
}

struct BlockRun {
  std::vector<uint8_t> codes;
  std::vector<float> f32_scales;
  std::vector<uint8_t> u8_scales;
  std::vector<float> decoded;
};

template <typename Quant, bool kPacked>
void run_blocks(const std::vector<float>& x, float gs, BlockRun* out) {
  const int64_t n_blocks = int64_t(x.size()) / Quant::kGroup;
  const size_t code_bytes = kPacked ? x.size() / 2 : x.size();
  DeviceArray<float> d_x, d_f32, d_dec;
  DeviceArray<uint8_t> d_codes, d_u8;
  ASSERT_NO_FATAL_FAILURE(to_device(x, &d_x));
  EPCOMM_FMT_CUDA(d_codes.alloc(code_bytes));
  EPCOMM_FMT_CUDA(d_f32.alloc(size_t(n_blocks)));
  EPCOMM_FMT_CUDA(d_u8.alloc(size_t(n_blocks)));
  EPCOMM_FMT_CUDA(d_dec.alloc(x.size()));
  block_codec_kernel<Quant, kPacked><<<grid_for(n_blocks, 128), 128>>>(
      d_x.ptr, n_blocks, gs, d_codes.ptr, d_f32.ptr, d_u8.ptr, d_dec.ptr);
  ASSERT_NO_FATAL_FAILURE(finish_launch());
  out->codes.resize(code_bytes);
  out->f32_scales.resize(size_t(n_blocks));
  out->u8_scales.resize(size_t(n_blocks));
  out->decoded.resize(x.size());
  ASSERT_NO_FATAL_FAILURE(from_device(d_codes, &out->codes));
  ASSERT_NO_FATAL_FAILURE(from_device(d_f32, &out->f32_scales));
  ASSERT_NO_FATAL_FAILURE(from_device(d_u8, &out->u8_scales));
  ASSERT_NO_FATAL_FAILURE(from_device(d_dec, &out->decoded));
}

template <typename T>
size_t count_bit_differences(const std::vector<T>& a, const std::vector<T>& b, size_t* first) {
  size_t bad = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0 && bad++ == 0) *first = i;
  }
  return bad + (a.size() != b.size() ? 1 : 0);
}

#define EPCOMM_FMT_EXPECT_BITWISE(a, b)                                              \
  do {                                                                               \
    size_t first_ = 0;                                                               \
    const size_t bad_ = count_bit_differences((a), (b), &first_);                    \
    EXPECT_EQ(bad_, 0u) << #a << " vs " << #b << ": first difference at " << first_; \
  } while (0)

constexpr int64_t kRows = 64;
constexpr int32_t kHidden = 2048;

TEST_F(FormatConversionsGpu, Fp8BlockwiseMatchesReference) {
  const std::vector<float> x = make_rows(
      kRows, kHidden, Fp8BlockQuant::kGroup, e4m3_midpoints(),
      [](float amax) { return Fp8BlockQuant::from_amax(amax).scale; }, 21);
  BlockRun dev;
  ASSERT_NO_FATAL_FAILURE((run_blocks<Fp8BlockQuant, false>(x, 0.0f, &dev)));
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scales(dev.f32_scales.size()), decoded(x.size());
  reference::encode_fp8_blockwise(x.data(), kRows, kHidden, codes.data(), scales.data());
  reference::decode_fp8_blockwise(codes.data(), scales.data(), kRows, kHidden, decoded.data());
  EPCOMM_FMT_EXPECT_BITWISE(dev.codes, codes);
  EPCOMM_FMT_EXPECT_BITWISE(dev.f32_scales, scales);
  EPCOMM_FMT_EXPECT_BITWISE(dev.decoded, decoded);
}

TEST_F(FormatConversionsGpu, Nvfp4MatchesReference) {
  for (const float gs : {1.0f, 448.0f * 6.0f / 3.0e4f, 0.37f}) {
    const std::vector<float> x = make_rows(
        kRows, kHidden, Nvfp4BlockQuant::kGroup, e2m1_midpoints(),
        [gs](float amax) {
          const Nvfp4BlockQuant q = Nvfp4BlockQuant::from_amax(amax, gs);
          return q.scale / gs;
        },
        22);
    BlockRun dev;
    ASSERT_NO_FATAL_FAILURE((run_blocks<Nvfp4BlockQuant, true>(x, gs, &dev)));
    std::vector<uint8_t> packed(x.size() / 2), scales(dev.u8_scales.size());
    std::vector<float> decoded(x.size());
    reference::encode_nvfp4(x.data(), kRows, kHidden, gs, packed.data(), scales.data());
    reference::decode_nvfp4(packed.data(), scales.data(), kRows, kHidden, gs, decoded.data());
    EPCOMM_FMT_EXPECT_BITWISE(dev.codes, packed);
    EPCOMM_FMT_EXPECT_BITWISE(dev.u8_scales, scales);
    EPCOMM_FMT_EXPECT_BITWISE(dev.decoded, decoded);
  }
}

TEST_F(FormatConversionsGpu, Mxfp8MatchesReference) {
  const std::vector<float> x = make_rows(
      kRows, kHidden, Mxfp8BlockQuant::kGroup, e4m3_midpoints(),
      [](float amax) { return e8m0_to_float(mxfp8_scale_code(amax)); }, 23);
  BlockRun dev;
  ASSERT_NO_FATAL_FAILURE((run_blocks<Mxfp8BlockQuant, false>(x, 0.0f, &dev)));
  std::vector<uint8_t> codes(x.size()), scales(dev.u8_scales.size());
  std::vector<float> decoded(x.size());
  reference::encode_mxfp8(x.data(), kRows, kHidden, codes.data(), scales.data());
  reference::decode_mxfp8(codes.data(), scales.data(), kRows, kHidden, decoded.data());
  EPCOMM_FMT_EXPECT_BITWISE(dev.codes, codes);
  EPCOMM_FMT_EXPECT_BITWISE(dev.u8_scales, scales);
  EPCOMM_FMT_EXPECT_BITWISE(dev.decoded, decoded);
}

TEST_F(FormatConversionsGpu, Mxfp4MatchesReference) {
  const std::vector<float> x = make_rows(
      kRows, kHidden, Mxfp4BlockQuant::kGroup, e2m1_midpoints(),
      [](float amax) { return e8m0_to_float(mxfp4_scale_code(amax)); }, 24);
  BlockRun dev;
  ASSERT_NO_FATAL_FAILURE((run_blocks<Mxfp4BlockQuant, true>(x, 0.0f, &dev)));
  std::vector<uint8_t> packed(x.size() / 2), scales(dev.u8_scales.size());
  std::vector<float> decoded(x.size());
  reference::encode_mxfp4(x.data(), kRows, kHidden, packed.data(), scales.data());
  reference::decode_mxfp4(packed.data(), scales.data(), kRows, kHidden, decoded.data());
  EPCOMM_FMT_EXPECT_BITWISE(dev.codes, packed);
  EPCOMM_FMT_EXPECT_BITWISE(dev.u8_scales, scales);
  EPCOMM_FMT_EXPECT_BITWISE(dev.decoded, decoded);
}

}  // namespace
}  // namespace epcomm
