// The fused SiLU / SwiGLU kernels (epcomm/silu.h) on one GPU against the CPU reference
// (epcomm/formats/reference_silu.h). Inputs mix large magnitudes (up to 1e3 in gate and up),
// all-zero blocks, signed zeros, tiny values and gates where the fp32 sigmoid underflows; groups
// of 0, 1, odd and many rows, row counts that are not multiples of 4 or 128, and more rows than
// one wave of warps takes. Every output is poisoned (0xff) before each run and followed by
// poisoned guard bytes.
//
// How results are compared. The device's expf may differ from the host's in the last bit, so
// the kernels' z (and a code next to a rounding tie, or an FP8 scale, which is amax / 448) can
// differ from the reference's. So that no real bug can hide behind that allowance, every run is
// checked three ways:
//  1. Exact. The test evaluates z on the device (device_z: reference::silu_values_device, by
//     silu_mul / swiglu_clamped, the functions the kernels call) and encodes it with the
//     reference's own encoder (quantize_grouped_rows; float_to_bf16 for bf16). The
//     kernel's output must equal that bit for bit in every code, scale and scales_offsets entry:
//     any error of indexing, layout, scale block, rounding or padding shows here, with no
//     tolerance at all.
//  2. The device z is the reference's z (silu_values, host expf) within what expf's last bits
//     explain (z_tolerance). A wrong pick of gate or up, or a wrong activation, is off by far
//     more.
//  3. Against the reference outputs themselves (reference::silu_*): a scale block (for bf16, an
//     element) may differ from the reference only where the device z and the host z differ in
//     it — so at least every block whose z agree is exact — and at most 0.1% of the codes may
//     differ (a z that moved by an ulp changes a code only next to a rounding tie).
// And what the reference leaves alone: codes and row-indexed scales of rows at or past
// row_offsets[G] keep their poison, and so does every guard byte. NVFP4's scale array is
// defined whole (zero where no row's scale lands), so it is compared whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "epcomm/bf16.h"
#include "epcomm/error.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/formats/reference_silu.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/silu.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

using reference::GateUpLayout;
using reference::QuantFormat;
using reference::QuantizedRows;

constexpr int kDevice = 0;
constexpr size_t kGuardBytes = 256;  // poisoned bytes after every output
constexpr uint8_t kPoison = 0xff;
constexpr double kMaxCodeMismatch = 1e-3;  // check 3: fraction of codes

// ---- small helpers --------------------------------------------------------------------------

// Where gate j and up j sit in an input row (GateUpLayout).
int64_t gate_col(int64_t j, int32_t inter, bool interleaved) {
  return interleaved ? 2 * j : j;
}
int64_t up_col(int64_t j, int32_t inter, bool interleaved) {
  return interleaved ? 2 * j + 1 : inter + j;
}

// How far the device z may be from the host's. Device expf is within 2 ulps of exp (CUDA's
// bound), the host's within about half an ulp; 1 + e, the division and the product add an
// half-ulp rounding each, so z can move by up to about 11 * 2^-24 relative: 2^-20 covers it.
// Where the clamped SwiGLU's sigmoid 1 / (1 + e) is an fp32 subnormal (alpha * g near -88),
// one ulp of it is 2^-149 absolute, many ulps of z: the second term, times what multiplies it
// (|g| (|u| + 1) bounds that for both activations). A real bug is off by far more.
double z_tolerance(float z_host, float gate, float up) {
  return std::ldexp(std::fabs(double(z_host)), -20) +
         std::ldexp(std::fabs(double(gate)) * (std::fabs(double(up)) + 1.0), -147);
}

// The distance between two floats in ulps (+0 and -0 are the same point).
int64_t ulp_distance(float a, float b) {
  auto key = [](float f) {
    const uint32_t u = float_as_bits(f);
    return (u & 0x80000000u) ? -int64_t(u & 0x7fffffffu) : int64_t(u);
  };
  return std::llabs(key(a) - key(b));
}

// Counts failures and keeps the first one's description.
struct Failures {
  size_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ == 0) first = what;
  }
};

void expect_none(const Failures& f, const std::string& what) {
  EXPECT_EQ(f.count, 0u) << what << ": " << f.count << " failures; first: " << f.first;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string at(int64_t row, int64_t col) {
  return "row " + std::to_string(row) + " col " + std::to_string(col);
}

std::vector<int32_t> random_counts(int32_t groups, int32_t max_count, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<int32_t> counts(size_t(groups), 0);
  for (int32_t& c : counts)
    c = int32_t(gen() % uint64_t(max_count + 1));
  return counts;
}

int64_t padded_total(const std::vector<int32_t>& counts, int32_t align) {
  int64_t total = 0;
  for (int32_t c : counts)
    total += align_up(c, align);
  return total;
}

// ---- device buffers -------------------------------------------------------------------------

// A device output of `bytes` bytes followed by kGuardBytes that no kernel may write.
class Output {
 public:
  explicit Output(size_t bytes) : bytes_(bytes), buf_(kDevice, bytes + kGuardBytes) {}
  template <class T>
  T* get() const {
    return buf_.get<T>();
  }
  void poison(cudaStream_t s) { buf_.fill(kPoison, s); }
  // The output's bytes as T; EXPECTs the guard bytes to be intact.
  template <class T>
  std::vector<T> download(const std::string& what) const {
    std::vector<uint8_t> all(bytes_ + kGuardBytes);
    buf_.download(all.data(), all.size());
    const size_t touched = size_t(std::count_if(all.begin() + int64_t(bytes_), all.end(),
                                                [](uint8_t b) { return b != kPoison; }));
    EXPECT_EQ(touched, 0u) << what << ": " << touched << " guard bytes past the end written";
    std::vector<T> out(bytes_ / sizeof(T));
    std::memcpy(out.data(), all.data(), out.size() * sizeof(T));
    return out;
  }

 private:
  size_t bytes_;
  DeviceBuffer buf_;
};

template <class T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer d(kDevice, host.size() * sizeof(T));
  d.upload(host.data(), host.size() * sizeof(T));
  return d;
}

// ---- the problem ----------------------------------------------------------------------------

// One SiLU input on the device: x [max_rows, 2I] (every row filled, also those past the row
// count, which must never be read into any output), row_offsets and src_info.
struct Problem {
  int32_t inter;
  int64_t max_rows;
  bool interleaved;
  std::vector<uint16_t> x;
  std::vector<uint32_t> row_offsets;
  std::vector<SrcInfo> src_info;  // rank -1 on the padding rows of each group and past the rows
  DeviceBuffer d_x, d_offsets, d_src_info;

  Problem(int32_t inter_, int64_t max_rows_, bool interleaved_, uint64_t seed)
      : inter(inter_), max_rows(max_rows_), interleaved(interleaved_) {
    fill_x(seed);
    d_x = upload(x);
    d_src_info = DeviceBuffer(kDevice, size_t(max_rows) * sizeof(SrcInfo));
  }

  int32_t groups() const { return int32_t(row_offsets.size()) - 1; }
  int64_t rows() const { return int64_t(row_offsets.back()); }
  GateUpLayout layout() const {
    return interleaved ? GateUpLayout::kInterleaved : GateUpLayout::kSplit;
  }

  // Groups of counts[g] rows, each padded to a multiple of `align` (the FP8 dispatch's 4) with
  // padding rows; uploads row_offsets and src_info. The group count may change between calls.
  void set_counts(const std::vector<int32_t>& counts, int32_t align) {
    const int32_t G = int32_t(counts.size());
    row_offsets.assign(size_t(G) + 1, 0);
    padded_row_offsets(counts.data(), G, align, row_offsets.data());
    ASSERT_LE(rows(), max_rows);
    src_info.assign(size_t(max_rows), SrcInfo{-1, -1, -1});
    for (int32_t g = 0; g < G; ++g) {
      for (int32_t i = 0; i < counts[size_t(g)]; ++i) {
        const int64_t r = row_offsets[size_t(g)] + uint32_t(i);
        src_info[size_t(r)] = SrcInfo{int32_t(r), int16_t(g % 8), int16_t(i % 4)};
      }
    }
    // In place when the size allows: a captured graph keeps reading the same buffer.
    const size_t offsets_bytes = row_offsets.size() * sizeof(uint32_t);
    if (d_offsets.bytes() != offsets_bytes) d_offsets = DeviceBuffer(kDevice, offsets_bytes);
    d_offsets.upload(row_offsets.data(), offsets_bytes);
    d_src_info.upload(src_info.data(), src_info.size() * sizeof(SrcInfo));
  }

  SiluInput input(bool with_src_info) const {
    SiluInput in;
    in.x = d_x.get();
    in.row_offsets = d_offsets.get<uint32_t>();
    in.groups = groups();
    in.intermediate = inter;
    in.max_rows = max_rows;
    in.src_info = with_src_info ? d_src_info.get<SrcInfo>() : nullptr;
    return in;
  }

 private:
  // Each block of 16 z values (the smallest scale block) is of one kind; each 128 values are all
  // zero with probability 1/5, so FP8 sees zero blocks too.
  void fill_x(uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    x.assign(size_t(max_rows * 2 * inter), 0);
    for (int64_t r = 0; r < max_rows; ++r) {
      uint16_t* row = x.data() + r * 2 * inter;
      bool zero128 = false;
      int kind = 0;
      for (int32_t j = 0; j < inter; ++j) {
        if (j % 128 == 0) zero128 = gen() % 5 == 0;
        if (j % 16 == 0) kind = zero128 ? 0 : int(gen() % 7);
        float g = 0.0f, u = 0.0f;
        switch (kind) {
          case 0:  // zero block: z = +0
            break;
          case 1:  // large magnitudes: silu(g) is g or -0
            g = 1e3f * uni(gen);
            u = 1e3f * uni(gen);
            break;
          case 2:  // gates where silu is curved, large ups
            g = 4.0f * normal(gen);
            u = 1e3f * uni(gen);
            break;
          case 3:  // the fp32 sigmoid underflows near g = -88.7: z tiny or a signed zero
            g = -80.0f - 20.0f * std::fabs(uni(gen));
            u = 1e3f * uni(gen);
            break;
          case 4:  // zero gates: z = +0 or -0 by the sign of up
            u = 10.0f * uni(gen);
            break;
          case 5:  // tiny values
            g = 1e-3f * normal(gen);
            u = 1e-3f * normal(gen);
            break;
          default:  // one spike in small values
            g = j % 16 == 7 ? 500.0f : uni(gen);
            u = j % 16 == 7 ? -1e3f : 0.01f * uni(gen);
            break;
        }
        row[gate_col(j, inter, interleaved)] = float_to_bf16(g);
        row[up_col(j, inter, interleaved)] = float_to_bf16(u);
      }
    }
  }
};

// z on the device, by the functions the kernels use (silu_values_device), for rows [0, rows).
std::vector<float> device_z(const Problem& p, const SwigluClamp* clamp) {
  std::vector<float> z(size_t(p.rows() * p.inter));
  if (z.empty()) return z;
  DeviceBuffer d_z(kDevice, z.size() * sizeof(float));
  reference::silu_values_device(p.d_x.get(), p.rows(), p.inter, p.layout(), clamp, d_z.get<float>(),
                                nullptr);
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  d_z.download(z.data(), z.size() * sizeof(float));
  return z;
}

// Check 2: the device z against the reference's.
void expect_z_close(const Problem& p, const std::vector<float>& z_dev,
                    const std::vector<float>& z_host, const std::string& what) {
  ASSERT_EQ(z_dev.size(), z_host.size()) << what;
  Failures f;
  for (size_t i = 0; i < z_dev.size(); ++i) {
    const int64_t r = int64_t(i) / p.inter, j = int64_t(i) % p.inter;
    const uint16_t* row = p.x.data() + r * 2 * p.inter;
    const float g = bf16_to_float(row[gate_col(j, p.inter, p.interleaved)]);
    const float u = bf16_to_float(row[up_col(j, p.inter, p.interleaved)]);
    if (!(std::fabs(double(z_dev[i]) - double(z_host[i])) <= z_tolerance(z_host[i], g, u))) {
      f.add(at(r, j) + ": gate " + num(g) + " up " + num(u) + ": device z " + num(z_dev[i]) +
            ", host z " + num(z_host[i]));
    }
  }
  expect_none(f, what + ": device z unlike the reference's");
}

bool same_bits(float a, float b) {
  return float_as_bits(a) == float_as_bits(b);
}

// ---- comparing quantised outputs ------------------------------------------------------------

// Where scale b of output row r (r < row_offsets[G]) is stored, as the grouped GEMM reads it.
int64_t scale_slot(const QuantizedRows& q, const std::vector<uint32_t>& offsets, int64_t r,
                   int32_t b) {
  switch (q.shape.format) {
    case QuantFormat::kFp8Blockwise:
      return q.shape.fp8_layout().offset(r, b);
    case QuantFormat::kMxfp4:
      return q.shape.mxfp4_layout().offset(r, b);
    default: {
      const size_t g =
          size_t(std::upper_bound(offsets.begin(), offsets.end(), uint32_t(r)) - offsets.begin()) -
          1;
      const SwizzledGroup group{offsets[g], q.scales_offsets[g]};
      return q.shape.swizzled_layout().offset(group.scale_row(r), b);
    }
  }
}

// A scale's bits: fp32 for FP8, the byte otherwise.
uint32_t scale_bits(const QuantizedRows& q, int64_t slot) {
  return q.shape.format == QuantFormat::kFp8Blockwise ? float_as_bits(q.fp8_scales[size_t(slot)])
                                                      : q.scales[size_t(slot)];
}

// got: the kernel's output; exact: quantize_grouped_rows of the device z; ref: the reference
// (host z). Checks 1 and 3 and the poison.
void expect_quantized(const QuantizedRows& got, const QuantizedRows& exact,
                      const QuantizedRows& ref, const std::vector<float>& z_dev,
                      const std::vector<float>& z_host, const std::vector<uint32_t>& offsets,
                      const std::string& what) {
  const reference::QuantOutputShape& shape = ref.shape;
  const int64_t rows = int64_t(offsets.back());
  const int64_t row_bytes = shape.row_bytes();
  const int32_t cols = shape.hidden / shape.group();
  const int64_t block_bytes = row_bytes / cols;
  const bool fp8 = shape.format == QuantFormat::kFp8Blockwise;
  const uint32_t scale_poison = fp8 ? 0xffffffffu : kPoison;

  // 1. Codes: exact in rows [0, rows), poison after.
  Failures codes;
  for (int64_t i = 0; i < shape.codes_size(); ++i) {
    const bool valid = i / row_bytes < rows;
    const uint8_t want = valid ? exact.codes[size_t(i)] : kPoison;
    if (got.codes[size_t(i)] != want) {
      codes.add(at(i / row_bytes, i % row_bytes) + " (byte): got " +
                std::to_string(got.codes[size_t(i)]) + ", want " + std::to_string(want) +
                (valid ? "" : " (poison: past the rows)"));
    }
  }
  expect_none(codes, what + ": codes");

  // 1. Scales: exact in every slot of a row (NVFP4: every slot), poison elsewhere.
  std::vector<bool> row_slot(size_t(shape.scales_size()), false);
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t b = 0; b < cols; ++b)
      row_slot[size_t(scale_slot(exact, offsets, r, b))] = true;
  }
  Failures scales;
  for (int64_t s = 0; s < shape.scales_size(); ++s) {
    const bool defined = shape.swizzled() || row_slot[size_t(s)];
    const uint32_t want = defined ? scale_bits(exact, s) : scale_poison;
    if (scale_bits(got, s) != want) {
      scales.add("slot " + std::to_string(s) + ": got " + std::to_string(scale_bits(got, s)) +
                 ", want " + std::to_string(want) + (row_slot[size_t(s)] ? "" : " (no row)"));
    }
  }
  expect_none(scales, what + ": scales");
  EXPECT_EQ(got.scales_offsets, exact.scales_offsets) << what << ": scales_offsets";

  // 3. Against the reference: a block may differ only where z differs in it.
  Failures unexplained;
  int64_t code_mismatch = 0, block_mismatch = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t b = 0; b < cols; ++b) {
      const int64_t c0 = r * row_bytes + b * block_bytes;
      int64_t differ = 0;
      for (int64_t i = c0; i < c0 + block_bytes; ++i)
        differ += got.codes[size_t(i)] != ref.codes[size_t(i)];
      const int64_t slot = scale_slot(ref, offsets, r, b);
      if (differ == 0 && scale_bits(got, slot) == scale_bits(ref, slot)) continue;
      code_mismatch += differ;
      ++block_mismatch;
      bool z_differs = false;
      for (int32_t i = 0; i < shape.group(); ++i) {
        const size_t k = size_t(r * shape.hidden + b * shape.group() + i);
        z_differs = z_differs || !same_bits(z_dev[k], z_host[k]);
      }
      if (!z_differs) unexplained.add(at(r, b * shape.group()) + ": block differs, z equal");
    }
  }
  expect_none(unexplained, what + ": blocks unlike the reference with the same z");
  EXPECT_LE(double(code_mismatch), kMaxCodeMismatch * double(rows * row_bytes))
      << what << ": " << code_mismatch << " code bytes unlike the reference (" << block_mismatch
      << " blocks)";
}

// ---- the variants ---------------------------------------------------------------------------

// One variant's outputs for a problem: poison, launch (capturable), check against the reference.
class Variant {
 public:
  virtual ~Variant() = default;
  virtual void poison(cudaStream_t s) = 0;
  virtual void launch(const Problem& p, cudaStream_t s) = 0;
  virtual void check(const Problem& p) const = 0;
};

class Bf16Variant : public Variant {
 public:
  explicit Bf16Variant(const Problem& p) : out_(size_t(p.max_rows * p.inter) * 2) {}
  void poison(cudaStream_t s) override { out_.poison(s); }
  void launch(const Problem& p, cudaStream_t s) override {
    silu_bf16(p.input(false), out_.get<void>(), s);
  }
  void check(const Problem& p) const override {
    const std::string what = "bf16";
    const std::vector<uint16_t> got = out_.download<uint16_t>(what);
    const std::vector<float> z_dev = device_z(p, nullptr);
    const std::vector<float> z_host = reference::silu_values(p.x, p.inter, p.row_offsets);
    expect_z_close(p, z_dev, z_host, what);
    const std::vector<uint16_t> ref = reference::silu_bf16(p.x, p.inter, p.row_offsets);
    const int64_t valid = p.rows() * p.inter;
    Failures exact, unexplained;
    int64_t mismatch = 0;
    for (int64_t i = 0; i < int64_t(got.size()); ++i) {
      const int64_t r = i / p.inter, c = i % p.inter;
      if (i >= valid) {
        if (got[size_t(i)] != 0xffff) exact.add(at(r, c) + ": past the rows, poison written");
        continue;
      }
      if (got[size_t(i)] != float_to_bf16(z_dev[size_t(i)]))
        exact.add(at(r, c) + ": got " + std::to_string(got[size_t(i)]));
      if (got[size_t(i)] == ref[size_t(i)]) continue;
      ++mismatch;
      // Widened bf16 values are fp32 with 16 zero low bits: 2^16 fp32 ulps per bf16 step.
      const int64_t steps =
          ulp_distance(bf16_to_float(got[size_t(i)]), bf16_to_float(ref[size_t(i)])) >> 16;
      if (same_bits(z_dev[size_t(i)], z_host[size_t(i)]) || steps > 1) {
        unexplained.add(at(r, c) + ": got " + std::to_string(got[size_t(i)]) + ", reference " +
                        std::to_string(ref[size_t(i)]));
      }
    }
    expect_none(exact, what + ": exact (device z)");
    expect_none(unexplained, what + ": unlike the reference beyond one bf16 ulp of a moved z");
    EXPECT_LE(double(mismatch), kMaxCodeMismatch * double(valid)) << what;
  }

 private:
  Output out_;
};

// The parts every quantised variant shares: codes, scales, the download into a QuantizedRows.
class QuantVariant : public Variant {
 public:
  QuantVariant(const Problem& p, QuantFormat format)
      : shape_{format, p.inter, p.groups(), p.max_rows},
        codes_(size_t(shape_.codes_size())),
        scales_(size_t(shape_.scales_size()) * (format == QuantFormat::kFp8Blockwise ? 4 : 1)) {}
  void poison(cudaStream_t s) override {
    codes_.poison(s);
    scales_.poison(s);
  }

 protected:
  // Downloads the outputs, computes the two references and compares (checks 1 to 3).
  void compare(const Problem& p, const std::vector<float>& z_dev, const std::vector<float>& z_host,
               const QuantizedRows& ref, const std::vector<float>& global_scales,
               const SrcInfo* src_info, const std::vector<uint32_t>& scales_offsets,
               const std::string& what) const {
    expect_z_close(p, z_dev, z_host, what);
    QuantizedRows got;
    got.shape = shape_;
    got.codes = codes_.download<uint8_t>(what + " codes");
    if (shape_.format == QuantFormat::kFp8Blockwise) {
      got.fp8_scales = scales_.download<float>(what + " scales");
    } else {
      got.scales = scales_.download<uint8_t>(what + " scales");
    }
    got.scales_offsets = scales_offsets;
    const QuantizedRows exact = reference::quantize_grouped_rows(
        shape_, z_dev.data(), p.row_offsets, global_scales, src_info);
    expect_quantized(got, exact, ref, z_dev, z_host, p.row_offsets, what);
  }

  reference::QuantOutputShape shape_;
  Output codes_, scales_;
};

class Fp8Variant : public QuantVariant {
 public:
  Fp8Variant(const Problem& p, bool with_src_info)
      : QuantVariant(p, QuantFormat::kFp8Blockwise), with_src_info_(with_src_info) {}
  void launch(const Problem& p, cudaStream_t s) override {
    silu_fp8(p.input(with_src_info_), SiluFp8Output{codes_.get<uint8_t>(), scales_.get<float>()},
             s);
  }
  void check(const Problem& p) const override {
    const std::string what = with_src_info_ ? "fp8 (src_info)" : "fp8";
    const SrcInfo* src = with_src_info_ ? p.src_info.data() : nullptr;
    compare(p, device_z(p, nullptr), reference::silu_values(p.x, p.inter, p.row_offsets),
            reference::silu_fp8(p.x, p.inter, p.row_offsets, p.max_rows, src), {}, src, {}, what);
  }

 private:
  bool with_src_info_;
};

class Nvfp4Variant : public QuantVariant {
 public:
  // Global scales 2^-12 .. 2^0: some blocks saturate, some get a zero scale.
  explicit Nvfp4Variant(const Problem& p)
      : QuantVariant(p, QuantFormat::kNvfp4), offsets_(size_t(p.groups()) * sizeof(uint32_t)) {
    for (int32_t g = 0; g < p.groups(); ++g)
      global_scales_.push_back(std::ldexp(1.0f + 0.37f * float(g % 5), -12 + 4 * (g % 4)));
    d_global_scales_ = upload(global_scales_);
  }
  void poison(cudaStream_t s) override {
    QuantVariant::poison(s);
    offsets_.poison(s);
  }
  void launch(const Problem& p, cudaStream_t s) override {
    silu_nvfp4(
        p.input(false),
        SiluNvfp4Output{codes_.get<uint8_t>(), scales_.get<uint8_t>(), offsets_.get<uint32_t>()},
        d_global_scales_.get<float>(), p.interleaved, s);
  }
  void check(const Problem& p) const override {
    const std::string what = p.interleaved ? "nvfp4 (interleaved)" : "nvfp4";
    compare(
        p, device_z(p, nullptr), reference::silu_values(p.x, p.inter, p.row_offsets, p.layout()),
        reference::silu_nvfp4(p.x, p.inter, p.row_offsets, p.max_rows, global_scales_, p.layout()),
        global_scales_, nullptr, offsets_.download<uint32_t>(what + " scales_offsets"), what);
  }

 private:
  std::vector<float> global_scales_;
  DeviceBuffer d_global_scales_;
  Output offsets_;
};

class Mxfp4Variant : public QuantVariant {
 public:
  Mxfp4Variant(const Problem& p, const SwigluClamp* clamp)
      : QuantVariant(p, QuantFormat::kMxfp4),
        clamped_(clamp != nullptr),
        clamp_(clamp ? *clamp : SwigluClamp{}) {}
  void launch(const Problem& p, cudaStream_t s) override {
    silu_mxfp4(p.input(false), SiluMxfp4Output{codes_.get<uint8_t>(), scales_.get<uint8_t>()},
               clamped_ ? &clamp_ : nullptr, s);
  }
  void check(const Problem& p) const override {
    const std::string what = clamped_ ? "mxfp4 (clamped swiglu)" : "mxfp4";
    const SwigluClamp* c = clamped_ ? &clamp_ : nullptr;
    compare(p, device_z(p, c),
            reference::silu_values(p.x, p.inter, p.row_offsets, GateUpLayout::kSplit, c),
            reference::silu_mxfp4(p.x, p.inter, p.row_offsets, p.max_rows, c), {}, nullptr, {},
            what);
  }

 private:
  bool clamped_;
  SwigluClamp clamp_;
};

// ---- running the cases ----------------------------------------------------------------------

// Groups and their row counts: no rows at all, one row, odd counts, empty groups between full
// ones, counts around 128 (NVFP4 tiles), random groups.
std::vector<std::vector<int32_t>> count_sets() {
  return {
      {0}, {0, 0, 0}, {1}, {37}, {5, 0, 130, 3}, {129, 0, 0, 255, 1, 64}, random_counts(8, 150, 7)};
}

// More rows than one wave of warps (at most 64 per SM; 132 SMs on H100 / H200, 148 on B200): the
// grid-stride loops go round more than once.
const std::vector<int32_t> kManyRows = {6000, 0, 7003, 1};

std::unique_ptr<Variant> make_variant(const std::string& name, const Problem& p) {
  static const SwigluClamp kGptOss{7.0f, 1.702f};
  if (name == "bf16") return std::make_unique<Bf16Variant>(p);
  if (name == "fp8") return std::make_unique<Fp8Variant>(p, false);
  if (name == "fp8_src_info") return std::make_unique<Fp8Variant>(p, true);
  if (name == "nvfp4" || name == "nvfp4_interleaved") return std::make_unique<Nvfp4Variant>(p);
  if (name == "mxfp4") return std::make_unique<Mxfp4Variant>(p, nullptr);
  return std::make_unique<Mxfp4Variant>(p, &kGptOss);  // "mxfp4_clamped"
}

// One run of `variant` per (I, count set) on fresh poisoned outputs; max_rows leaves spare rows
// (and is a multiple of 4 where FP8 needs it).
void run_cases(const std::string& variant, const std::vector<int32_t>& inters) {
  const bool fp8 = variant.rfind("fp8", 0) == 0;
  const int32_t align = fp8 ? Fp8ScaleLayout::kRowAlign : 1;
  cudaStream_t stream = nullptr;
  EPCOMM_CUDA_OK(cudaSetDevice(kDevice));
  EPCOMM_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t seed = 100;
  for (int32_t inter : inters) {
    if (::testing::Test::HasFailure()) break;  // one failing case's report is enough
    std::vector<std::vector<int32_t>> sets = count_sets();
    if (inter <= 128) sets.push_back(kManyRows);
    for (const std::vector<int32_t>& counts : sets) {
      int64_t max_rows = padded_total(counts, align) + 13;
      if (fp8) max_rows = align_up(max_rows, Fp8ScaleLayout::kRowAlign);
      SCOPED_TRACE(variant + " I " + std::to_string(inter) + ", " + std::to_string(counts.size()) +
                   " groups, " + std::to_string(max_rows) + " max rows, seed " +
                   std::to_string(seed));
      Problem p(inter, max_rows, variant == "nvfp4_interleaved", seed++);
      p.set_counts(counts, align);
      std::unique_ptr<Variant> v = make_variant(variant, p);
      v->poison(stream);
      v->launch(p, stream);
      EPCOMM_CUDA_OK(cudaStreamSynchronize(stream));
      v->check(p);
      if (::testing::Test::HasFailure()) break;
    }
  }
  EPCOMM_CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace

TEST(Silu, Bf16MatchesReference) {
  EPCOMM_REQUIRE_GPU();
  run_cases("bf16", {8, 128, 1024, 1536, 1440});
}

TEST(Silu, Fp8MatchesReference) {
  EPCOMM_REQUIRE_GPU();
  run_cases("fp8", {128, 1024, 1536});
}

// Padding rows (src_info rank -1) hold random input that must not be read: zero codes and
// scales.
TEST(Silu, Fp8PaddingRowsFromSrcInfo) {
  EPCOMM_REQUIRE_GPU();
  run_cases("fp8_src_info", {128, 1024, 1536});
}

// I = 16 and 48 fill only part of a 4-column scale word; 1440 (2880 / 2) leaves a partial last
// column tile too.
TEST(Silu, Nvfp4MatchesReference) {
  EPCOMM_REQUIRE_GPU();
  run_cases("nvfp4", {16, 48, 128, 1024, 1536, 1440});
}

TEST(Silu, Nvfp4InterleavedMatchesReference) {
  EPCOMM_REQUIRE_GPU();
  run_cases("nvfp4_interleaved", {16, 128, 1024, 1536, 1440});
}

TEST(Silu, Mxfp4MatchesReference) {
  EPCOMM_REQUIRE_GPU();
  run_cases("mxfp4", {32, 128, 1024, 1536, 1440});
}

TEST(Silu, Mxfp4ClampedSwigluMatchesReference) {
  EPCOMM_REQUIRE_GPU();
  run_cases("mxfp4_clamped", {32, 128, 1024, 1536, 1440});
}

// Every variant captured once in one CUDA graph, then replayed with other row_offsets (and
// src_info) contents: growing, shrinking to a few rows, to none, and growing again. Each replay
// must give the reference's result for the counts it finds on the device — and NVFP4's scale
// tiles that an earlier replay used must come back zero.
TEST(Silu, GraphReplayReadsRowCountOnDevice) {
  EPCOMM_REQUIRE_GPU();
  EPCOMM_CUDA_OK(cudaSetDevice(kDevice));
  load_silu_kernels();
  const int32_t inter = 512, groups = 4;
  const std::vector<std::vector<int32_t>> replays = {
      {300, 0, 411, 2}, {3, 0, 0, 1}, {0, 0, 0, 0}, {128, 128, 0, 700}};
  Problem p(inter, 1200, false, 77);
  p.set_counts(std::vector<int32_t>(size_t(groups), 0), Fp8ScaleLayout::kRowAlign);
  static const SwigluClamp kClamp{7.0f, 1.702f};
  std::vector<std::unique_ptr<Variant>> variants;
  variants.push_back(std::make_unique<Bf16Variant>(p));
  variants.push_back(std::make_unique<Fp8Variant>(p, true));
  variants.push_back(std::make_unique<Nvfp4Variant>(p));
  variants.push_back(std::make_unique<Mxfp4Variant>(p, &kClamp));

  cudaStream_t stream = nullptr;
  EPCOMM_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPCOMM_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (auto& v : variants)
    v->launch(p, stream);
  EPCOMM_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  EPCOMM_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (size_t i = 0; i < replays.size(); ++i) {
    SCOPED_TRACE("replay " + std::to_string(i));
    const uint32_t* captured = p.d_offsets.get<uint32_t>();
    p.set_counts(replays[i], Fp8ScaleLayout::kRowAlign);  // new contents, same buffers
    ASSERT_EQ(p.d_offsets.get<uint32_t>(), captured);
    for (auto& v : variants)
      v->poison(stream);
    EPCOMM_CUDA_OK(cudaGraphLaunch(exec, stream));
    EPCOMM_CUDA_OK(cudaStreamSynchronize(stream));
    for (auto& v : variants)
      v->check(p);
  }
  EPCOMM_CUDA_OK(cudaGraphExecDestroy(exec));
  EPCOMM_CUDA_OK(cudaGraphDestroy(graph));
  EPCOMM_CUDA_OK(cudaStreamDestroy(stream));
}

// Host-side argument checks: each bad argument throws kInvalidArgument before any launch.
TEST(Silu, RejectsBadArguments) {
  EPCOMM_REQUIRE_GPU();
  EPCOMM_CUDA_OK(cudaSetDevice(kDevice));
  DeviceBuffer mem(kDevice, 1 << 20);
  mem.fill(0, nullptr);  // row_offsets all 0: should a check be missing, its launch writes nothing
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  char* base = mem.get<char>();
  SiluInput in;
  in.x = base;
  in.row_offsets = reinterpret_cast<const uint32_t*>(base + 4096);
  in.groups = 2;
  in.intermediate = 256;
  in.max_rows = 8;
  uint8_t* codes = reinterpret_cast<uint8_t*>(base + 8192);
  uint8_t* scales = reinterpret_cast<uint8_t*>(base + 65536);
  uint32_t* offsets = reinterpret_cast<uint32_t*>(base + 98304);
  const float* gs = reinterpret_cast<const float*>(base + 98304 + 64);

  auto expect_invalid = [](const char* what, auto&& call) {
    try {
      call();
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << what << ": " << e.what();
    }
  };
  auto with = [&](auto change) {
    SiluInput c = in;
    change(c);
    return c;
  };
  // The baseline is valid (and has no rows): each case below breaks one thing.
  EXPECT_NO_THROW(silu_bf16(in, codes, nullptr));
  EXPECT_NO_THROW(silu_fp8(in, SiluFp8Output{codes, reinterpret_cast<float*>(scales)}, nullptr));
  EXPECT_NO_THROW(silu_nvfp4(in, SiluNvfp4Output{codes, scales, offsets}, gs, true, nullptr));
  EXPECT_NO_THROW(silu_mxfp4(in, SiluMxfp4Output{codes, scales}, nullptr, nullptr));
  EPCOMM_CUDA_OK(cudaDeviceSynchronize());
  expect_invalid("null x",
                 [&] { silu_bf16(with([](SiluInput& c) { c.x = nullptr; }), codes, nullptr); });
  expect_invalid("misaligned x",
                 [&] { silu_bf16(with([&](SiluInput& c) { c.x = base + 2; }), codes, nullptr); });
  expect_invalid("null row_offsets", [&] {
    silu_bf16(with([](SiluInput& c) { c.row_offsets = nullptr; }), codes, nullptr);
  });
  expect_invalid("no groups",
                 [&] { silu_bf16(with([](SiluInput& c) { c.groups = 0; }), codes, nullptr); });
  expect_invalid("negative max_rows",
                 [&] { silu_bf16(with([](SiluInput& c) { c.max_rows = -1; }), codes, nullptr); });
  expect_invalid("bf16 I % 8", [&] {
    silu_bf16(with([](SiluInput& c) { c.intermediate = 12; }), codes, nullptr);
  });
  expect_invalid("null out", [&] { silu_bf16(in, nullptr, nullptr); });
  expect_invalid("misaligned out", [&] { silu_bf16(in, codes + 4, nullptr); });
  const SiluFp8Output fp8{codes, reinterpret_cast<float*>(scales)};
  expect_invalid("fp8 I % 128",
                 [&] { silu_fp8(with([](SiluInput& c) { c.intermediate = 192; }), fp8, nullptr); });
  expect_invalid("fp8 max_rows % 4",
                 [&] { silu_fp8(with([](SiluInput& c) { c.max_rows = 6; }), fp8, nullptr); });
  expect_invalid("fp8 null scales", [&] { silu_fp8(in, SiluFp8Output{codes, nullptr}, nullptr); });
  const SiluNvfp4Output nv{codes, scales, offsets};
  expect_invalid("nvfp4 I % 16", [&] {
    silu_nvfp4(with([](SiluInput& c) { c.intermediate = 40; }), nv, gs, false, nullptr);
  });
  expect_invalid("nvfp4 null global_scales", [&] { silu_nvfp4(in, nv, nullptr, false, nullptr); });
  expect_invalid("nvfp4 null scales_offsets", [&] {
    silu_nvfp4(in, SiluNvfp4Output{codes, scales, nullptr}, gs, false, nullptr);
  });
  expect_invalid("nvfp4 too many groups", [&] {
    silu_nvfp4(with([](SiluInput& c) { c.groups = kSiluMaxGroups + 1; }), nv, gs, false, nullptr);
  });
  const SiluMxfp4Output mx{codes, scales};
  expect_invalid("mxfp4 I % 32", [&] {
    silu_mxfp4(with([](SiluInput& c) { c.intermediate = 48; }), mx, nullptr, nullptr);
  });
  const SwigluClamp negative{-1.0f, 1.0f}, nan_alpha{7.0f, NAN};
  expect_invalid("negative clamp limit", [&] { silu_mxfp4(in, mx, &negative, nullptr); });
  expect_invalid("NaN alpha", [&] { silu_mxfp4(in, mx, &nan_alpha, nullptr); });
}
