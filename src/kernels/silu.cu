// The fused SiLU / SwiGLU kernels (docs/design.md "Fused SiLU / SwiGLU", epcomm/silu.h).
//
// Protocol. One launch per call, on the caller's stream, no host synchronisation. The host knows
// only max_rows; every thread reads the row count n = min(row_offsets[G], max_rows) on the
// device, and warps walk rows in a grid-stride loop (a grid of at most one resident wave), so a
// captured graph serves any n. A warp takes one row at a time: lane l takes the 8-value units
// l, l + 32, ... of z, each from one 16-byte load of gate and one of up (two of interleaved
// pairs). A scale block is a set of adjacent lanes — 128 values are 16 lanes, 32 are 4, 16 are
// 2 — whose amax is an abs_max fold over shuffles; every value goes through the block quantisers
// of codecs.h and every scale to its layout in scale_layouts.h, so codes and scales are the CPU
// reference's for the same z. Nothing is shared between warps but NVFP4's group table.
//   bf16   reads x rows [0, n); writes out rows [0, n).
//   fp8    reads x rows [0, n) but padding rows (src_info[r].rank < 0); writes codes rows
//          [0, n) and their Fp8ScaleLayout scales, zero for padding rows.
//   nvfp4  each block first scans row_offsets into the first 128-row scale tile of every group
//          (shared memory; block 0 also writes scales_offsets), then warps walk the scale rows
//          of the used tiles: a row of a group writes its codes and its scales, four scale
//          columns to a 32-bit word; a scale row past its group's rows writes zero words. The
//          tiles past the last group are zeroed with 16-byte stores, so every byte of the scale
//          array is written on every call.
//   mxfp4  reads x rows [0, n); writes codes rows [0, n) and their row-major e8m0 scales.
// Nothing carries over between calls: there are no counters to reset.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "epcomm/detail/device.cuh"
#include "epcomm/detail/launch.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/scale_layouts.h"
#include "epcomm/silu.h"
#include "kernels/quant_unit.cuh"

namespace epcomm {
namespace detail {
namespace {

constexpr int kSiluThreads = 256;
constexpr int kSiluWarps = kSiluThreads / kWarpSize;
constexpr int kUnroll = 2;  // steps whose loads a lane has in flight together

// What every variant reads.
struct SiluRows {
  const uint16_t* x;            // [max_rows, 2 * inter] bf16
  const uint32_t* row_offsets;  // [groups + 1]
  int32_t groups;
  int32_t inter;
  int64_t max_rows;
};

__device__ __forceinline__ int lane_id() {
  return int(threadIdx.x) % kWarpSize;
}

__device__ __forceinline__ const uint16_t* x_row(const SiluRows& in, int64_t r) {
  return in.x + r * 2 * in.inter;
}

// ---- activations ----------------------------------------------------------------------------

struct SiluAct {
  __device__ float operator()(float gate, float up) const { return silu_mul(gate, up); }
};
struct SwigluAct {
  SwigluClamp clamp;
  __device__ float operator()(float gate, float up) const {
    return swiglu_clamped(gate, up, clamp);
  }
};

// ---- walking a row --------------------------------------------------------------------------

// The 32 input bytes of one 8-value unit: 8 gates and 8 ups, or 8 (gate, up) pairs.
struct UnitBytes {
  uint4 a, b;
};

template <bool kInterleaved>
__device__ __forceinline__ UnitBytes load_unit(const uint16_t* row, int32_t inter, int32_t unit) {
  if constexpr (kInterleaved) {
    const uint16_t* p = row + 2 * kLaneValues * unit;
    return UnitBytes{ld_nc_v4(p), ld_nc_v4(p + kLaneValues)};
  } else {
    return UnitBytes{ld_nc_v4(row + kLaneValues * unit),
                     ld_nc_v4(row + inter + kLaneValues * unit)};
  }
}

template <bool kInterleaved, class Act>
__device__ __forceinline__ void activate(const UnitBytes& u, Act act, float (&z)[kLaneValues]) {
  float a[8], b[8];
  unpack_bf16x8(u.a, a);
  unpack_bf16x8(u.b, b);
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) {
    if constexpr (kInterleaved) {  // a holds pairs 0..3 of the unit, b pairs 4..7
      const float(&pairs)[8] = i < 4 ? a : b;
      z[i] = act(pairs[2 * (i % 4)], pairs[2 * (i % 4) + 1]);
    } else {
      z[i] = act(a[i], b[i]);
    }
  }
}

// Calls step(unit, active, z) for the units of one row that this lane takes (unit = lane + 32k).
// All 32 lanes call it together for every k that has an active lane, so step may shuffle; an
// inactive lane (unit >= inter / 8) has z = 0 and must not store.
template <bool kInterleaved, class Act, class Step>
__device__ __forceinline__ void for_each_unit(const uint16_t* row, int32_t inter, Act act,
                                              Step step) {
  const int32_t units = inter / kLaneValues;
  const int lane = lane_id();
  for (int32_t base = 0; base < units; base += kWarpSize * kUnroll) {
    UnitBytes bytes[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int32_t unit = base + k * kWarpSize + lane;
      bytes[k] = unit < units ? load_unit<kInterleaved>(row, inter, unit) : UnitBytes{};
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (base + k * kWarpSize >= units) break;  // the same for every lane
      const int32_t unit = base + k * kWarpSize + lane;
      const bool active = unit < units;
      float z[kLaneValues];
      activate<kInterleaved>(bytes[k], act, z);
      if (!active) {
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i)
          z[i] = 0.0f;
      }
      step(unit, active, z);
    }
  }
}

// Calls row(r) for every row r < min(row_offsets[G], max_rows), one warp per row.
template <class Row>
__device__ __forceinline__ void for_each_row(const SiluRows& in, Row row) {
  const int64_t counted = in.row_offsets[in.groups];
  const int64_t rows = counted < in.max_rows ? counted : in.max_rows;
  const int64_t warps = int64_t(gridDim.x) * kSiluWarps;
  for (int64_t r = int64_t(blockIdx.x) * kSiluWarps + int(threadIdx.x) / kWarpSize; r < rows;
       r += warps) {
    row(r);
  }
}

// Row r of a format that stores block b's scale at layout.offset(r, b) (FP8, MXFP4).
template <class Quant, class Act, class Layout, class Scale>
__device__ void quantize_row(const SiluRows& in, int64_t r, Act act, uint8_t* codes, Scale* scales,
                             const Layout& layout) {
  constexpr int32_t kUnitsPerScale = Quant::kGroup / kLaneValues;
  for_each_unit<false>(x_row(in, r), in.inter, act,
                       [&](int32_t unit, bool active, const float(&z)[kLaneValues]) {
                         const Quant q = unit_quant<Quant>(z);
                         if (!active) return;
                         const auto code = encode_unit(q, z);
                         using Code = std::remove_const_t<decltype(code)>;
                         reinterpret_cast<Code*>(codes)[r * (in.inter / kLaneValues) + unit] = code;
                         if (unit % kUnitsPerScale == 0)
                           scales[layout.offset(r, unit / kUnitsPerScale)] = stored_scale(q);
                       });
}

// ---- bf16 -----------------------------------------------------------------------------------

struct Bf16Out {
  uint16_t* out;  // [max_rows, inter]
};

__device__ void silu_bf16_row(const SiluRows& in, int64_t r, const Bf16Out& out) {
  uint16_t* dst = out.out + r * in.inter;
  for_each_unit<false>(x_row(in, r), in.inter, SiluAct{},
                       [&](int32_t unit, bool active, const float(&z)[kLaneValues]) {
                         if (active) st_v4(dst + kLaneValues * unit, pack_bf16x8(z));
                       });
}

// ---- blockwise FP8 --------------------------------------------------------------------------

struct Fp8Out {
  uint8_t* codes;           // [max_rows, inter]
  float* scales;            // layout
  const SrcInfo* src_info;  // or null
  Fp8ScaleLayout layout;
};

__device__ void zero_fp8_row(const SiluRows& in, int64_t r, const Fp8Out& out) {
  uint8_t* codes = out.codes + r * in.inter;
  for (int32_t unit = lane_id(); unit < in.inter / kLaneValues; unit += kWarpSize)
    *reinterpret_cast<uint2*>(codes + kLaneValues * unit) = make_uint2(0u, 0u);
  for (int32_t k = lane_id(); k < out.layout.cols(); k += kWarpSize)
    out.scales[out.layout.offset(r, k)] = 0.0f;
}

__device__ void silu_fp8_row(const SiluRows& in, int64_t r, const Fp8Out& out) {
  if (out.src_info != nullptr && out.src_info[r].rank < 0) return zero_fp8_row(in, r, out);
  quantize_row<Fp8BlockQuant>(in, r, SiluAct{}, out.codes, out.scales, out.layout);
}

// ---- NVFP4 ----------------------------------------------------------------------------------

struct Nvfp4Out {
  uint8_t* codes;  // [max_rows, inter / 2]
  uint8_t* scales;
  uint32_t* scales_offsets;    // [groups]
  const float* global_scales;  // [groups]
  SwizzledScaleLayout layout;
};

// A scale row's four scale columns 4w .. 4w + 3 are one aligned 32-bit word of the swizzled
// layout (the last index, col % 4, is innermost), so a row writes layout.col_tiles() words.
constexpr int32_t kScalesPerWord = SwizzledScaleLayout::kTileCols;
constexpr int32_t kUnitsPerWord = kScalesPerWord * Nvfp4BlockQuant::kGroup / kLaneValues;  // 8

// Fills offsets[0..G] with row_offsets and tile_start[0..G] with the first scale tile of each
// group, tile_start[g] = sum over h < g of ceil(m_h / 128): swizzled_scales_offsets as a block
// scan. Block 0 writes scales_offsets[g] = tile_start[g] - row_offsets[g] / 128. Called by every
// thread of the block.
__device__ void scan_group_tiles(const SiluRows& in, const Nvfp4Out& out, uint32_t* offsets,
                                 uint32_t* tile_start) {
  using Scan = cub::BlockScan<uint32_t, kSiluThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  constexpr uint32_t kTileRows = SwizzledScaleLayout::kTileRows;
  const int32_t groups = in.groups;
  for (int32_t i = int32_t(threadIdx.x); i <= groups; i += kSiluThreads)
    offsets[i] = in.row_offsets[i];
  __syncthreads();
  uint32_t carry = 0;
  for (int32_t base = 0; base < groups; base += kSiluThreads) {
    const int32_t g = base + int32_t(threadIdx.x);
    const uint32_t tiles =
        g < groups ? (offsets[g + 1] - offsets[g] + kTileRows - 1) / kTileRows : 0u;
    uint32_t start = 0, total = 0;
    Scan(scan_storage).ExclusiveSum(tiles, start, total);
    if (g < groups) {
      tile_start[g] = carry + start;
      if (blockIdx.x == 0) out.scales_offsets[g] = carry + start - offsets[g] / kTileRows;
    }
    carry += total;
    __syncthreads();  // scan_storage is reused
  }
  if (threadIdx.x == 0) tile_start[groups] = carry;
  __syncthreads();
}

// The group whose tiles hold scale tile t < tile_start[G]: the last g with tile_start[g] <= t
// (groups without rows own no tile and are passed over).
__device__ __forceinline__ int32_t group_of_tile(const uint32_t* tile_start, int32_t groups,
                                                 int64_t t) {
  int32_t lo = 0, hi = groups;  // tile_start[lo] <= t < tile_start[hi]
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (tile_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ __forceinline__ uint32_t* scale_word(const Nvfp4Out& out, int64_t scale_row,
                                                int32_t word) {
  return reinterpret_cast<uint32_t*>(out.scales +
                                     out.layout.offset(scale_row, word * kScalesPerWord));
}

// Row r, at scale row `scale_row`, encoded with global scale gs.
template <bool kInterleaved>
__device__ void silu_nvfp4_row(const SiluRows& in, int64_t r, int64_t scale_row, float gs,
                               const Nvfp4Out& out) {
  uint8_t* codes = out.codes + r * (in.inter / 2);
  const int lane = lane_id();
  for_each_unit<kInterleaved>(
      x_row(in, r), in.inter, SiluAct{},
      [&](int32_t unit, bool active, const float(&z)[kLaneValues]) {
        const Nvfp4BlockQuant q =
            Nvfp4BlockQuant::from_amax(lanes_amax<Nvfp4BlockQuant::kGroup / kLaneValues>(z), gs);
        // The even lane of each pair puts its block's scale code in its byte of the word; the
        // eight lanes of the word OR theirs together. Inactive lanes have amax 0, so code 0:
        // the columns past inter / 16 of the last word come out zero.
        uint32_t word = (lane & 1) == 0 ? uint32_t(q.scale_code) << (8 * ((lane / 2) % 4)) : 0u;
#pragma unroll
        for (int m = 1; m < kUnitsPerWord; m *= 2)
          word |= __shfl_xor_sync(kFullMask, word, m);
        if (!active) return;
        reinterpret_cast<uint32_t*>(codes)[unit] = encode_unit(q, z);
        if (unit % kUnitsPerWord == 0) *scale_word(out, scale_row, unit / kUnitsPerWord) = word;
      });
}

// A scale row of no row (the rest of a group's last tile): zero scales.
__device__ void zero_nvfp4_scale_row(const Nvfp4Out& out, int64_t scale_row) {
  for (int32_t w = lane_id(); w < out.layout.col_tiles(); w += kWarpSize)
    *scale_word(out, scale_row, w) = 0u;
}

// Zeroes the tiles [used_tiles, row_tiles): whole tiles, contiguous at the end of the array.
__device__ void zero_unused_tiles(const Nvfp4Out& out, int64_t used_tiles) {
  const int64_t begin = out.layout.tile_offset(used_tiles, 0) / int64_t(sizeof(uint4));
  const int64_t end = out.layout.size() / int64_t(sizeof(uint4));
  uint4* scales = reinterpret_cast<uint4*>(out.scales);
  for (int64_t i = begin + int64_t(blockIdx.x) * kSiluThreads + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * kSiluThreads) {
    st_v4(scales + i, make_uint4(0u, 0u, 0u, 0u));
  }
}

// ---- MXFP4 ----------------------------------------------------------------------------------

template <class Act>
struct Mxfp4Out {
  uint8_t* codes;  // [max_rows, inter / 2]
  uint8_t* scales;
  Mxfp4ScaleLayout layout;
  Act act;
};

template <class Act>
__device__ void silu_mxfp4_row(const SiluRows& in, int64_t r, const Mxfp4Out<Act>& out) {
  quantize_row<Mxfp4BlockQuant>(in, r, out.act, out.codes, out.scales, out.layout);
}

// ---- kernels --------------------------------------------------------------------------------

__global__ void __launch_bounds__(kSiluThreads) silu_bf16_kernel(SiluRows in, Bf16Out out) {
  for_each_row(in, [&](int64_t r) { silu_bf16_row(in, r, out); });
}

__global__ void __launch_bounds__(kSiluThreads) silu_fp8_kernel(SiluRows in, Fp8Out out) {
  for_each_row(in, [&](int64_t r) { silu_fp8_row(in, r, out); });
}

template <class Act>
__global__ void __launch_bounds__(kSiluThreads) silu_mxfp4_kernel(SiluRows in, Mxfp4Out<Act> out) {
  for_each_row(in, [&](int64_t r) { silu_mxfp4_row(in, r, out); });
}

// Dynamic shared memory: offsets [G + 1] and tile_start [G + 1].
template <bool kInterleaved>
__global__ void __launch_bounds__(kSiluThreads) silu_nvfp4_kernel(SiluRows in, Nvfp4Out out) {
  extern __shared__ uint32_t nvfp4_groups[];
  uint32_t* offsets = nvfp4_groups;
  uint32_t* tile_start = nvfp4_groups + in.groups + 1;
  scan_group_tiles(in, out, offsets, tile_start);

  constexpr int64_t kTileRows = SwizzledScaleLayout::kTileRows;
  const int64_t used_tiles =
      tile_start[in.groups] < out.layout.row_tiles ? tile_start[in.groups] : out.layout.row_tiles;
  const int64_t warps = int64_t(gridDim.x) * kSiluWarps;
  for (int64_t s = int64_t(blockIdx.x) * kSiluWarps + int(threadIdx.x) / kWarpSize;
       s < used_tiles * kTileRows; s += warps) {
    const int32_t g = group_of_tile(tile_start, in.groups, s / kTileRows);
    const int64_t r = offsets[g] + (s - int64_t(tile_start[g]) * kTileRows);
    const int64_t end = offsets[g + 1] < in.max_rows ? offsets[g + 1] : in.max_rows;
    if (r < end) {
      silu_nvfp4_row<kInterleaved>(in, r, s, out.global_scales[g], out);
    } else {
      zero_nvfp4_scale_row(out, s);
    }
  }
  zero_unused_tiles(out, used_tiles);
}

constexpr size_t nvfp4_smem_bytes(int32_t groups) {
  return 2 * (size_t(groups) + 1) * sizeof(uint32_t);
}

// ---- host side ------------------------------------------------------------------------------

// The checks every variant shares; `group` is the format's values per scale (8 for bf16).
SiluRows checked_rows(const char* op, const SiluInput& in, int32_t group) {
  check_pointer(op, "x", in.x, 16);
  check_pointer(op, "row_offsets", in.row_offsets, alignof(uint32_t));
  if (in.groups < 1 || in.groups > kSiluMaxGroups) {
    invalid(op, "groups " + std::to_string(in.groups) + " is outside [1, " +
                    std::to_string(kSiluMaxGroups) + "]");
  }
  if (in.intermediate <= 0 || in.intermediate % group != 0) {
    invalid(op, "intermediate " + std::to_string(in.intermediate) +
                    " is not a positive multiple of " + std::to_string(group));
  }
  if (in.max_rows < 0 || in.max_rows > INT32_MAX) {
    invalid(op, "max_rows " + std::to_string(in.max_rows) + " is outside [0, 2^31)");
  }
  return SiluRows{static_cast<const uint16_t*>(in.x), in.row_offsets, in.groups, in.intermediate,
                  in.max_rows};
}

// The most dynamic shared memory a SiLU kernel takes (NVFP4 with kSiluMaxGroups groups).
constexpr size_t kMaxSmemBytes = nvfp4_smem_bytes(kSiluMaxGroups);

// Launches K with at most one resident wave of blocks, and no more than `work_warps` warps of
// work need.
template <auto K, class Out>
void launch(const char* op, int64_t work_warps, size_t smem, cudaStream_t stream, SiluRows in,
            Out out) {
  static_assert(std::is_same<decltype(K), void (*)(SiluRows, Out)>::value,
                "the arguments must be the kernel's: cudaLaunchKernel does not check them");
  // kMaxSmemBytes: the wave is a lower bound for every call's shared memory.
  const int64_t wave = resident_wave<K, kSiluThreads, kMaxSmemBytes>();
  const int64_t blocks =
      std::max<int64_t>(1, std::min((work_warps + kSiluWarps - 1) / kSiluWarps, wave));
  void* args[] = {&in, &out};
  check_cuda(cudaLaunchKernel(reinterpret_cast<const void*>(K), dim3(unsigned(blocks)),
                              dim3(kSiluThreads), args, smem, stream),
             op);
}

template <class Out>
void load_kernel(void (*kernel)(SiluRows, Out)) {
  cudaFuncAttributes attr;
  check_cuda(cudaFuncGetAttributes(&attr, kernel), "load_silu_kernels");
}

}  // namespace
}  // namespace detail

void silu_bf16(const SiluInput& in, void* out, cudaStream_t stream) {
  using namespace detail;
  const char* op = "silu_bf16";
  const SiluRows rows = checked_rows(op, in, kLaneValues);
  check_pointer(op, "out", out, 16);
  launch<silu_bf16_kernel>(op, in.max_rows, 0, stream, rows, Bf16Out{static_cast<uint16_t*>(out)});
}

void silu_fp8(const SiluInput& in, const SiluFp8Output& out, cudaStream_t stream) {
  using namespace detail;
  const char* op = "silu_fp8";
  const SiluRows rows = checked_rows(op, in, Fp8BlockQuant::kGroup);
  check_pointer(op, "out.codes", out.codes, 16);
  check_pointer(op, "out.scales", out.scales, 16);
  if (in.src_info != nullptr) check_pointer(op, "src_info", in.src_info, alignof(SrcInfo));
  if (in.max_rows % Fp8ScaleLayout::kRowAlign != 0) {
    invalid(op, "max_rows " + std::to_string(in.max_rows) + " is not a multiple of " +
                    std::to_string(Fp8ScaleLayout::kRowAlign) + " (the FP8 scale columns)");
  }
  const Fp8Out fp8{out.codes, out.scales, in.src_info,
                   Fp8ScaleLayout{in.intermediate, in.max_rows}};
  launch<silu_fp8_kernel>(op, in.max_rows, 0, stream, rows, fp8);
}

void silu_nvfp4(const SiluInput& in, const SiluNvfp4Output& out, const float* global_scales,
                bool interleaved, cudaStream_t stream) {
  using namespace detail;
  const char* op = "silu_nvfp4";
  const SiluRows rows = checked_rows(op, in, Nvfp4BlockQuant::kGroup);
  check_pointer(op, "out.codes", out.codes, 16);
  check_pointer(op, "out.scales", out.scales, 16);
  check_pointer(op, "out.scales_offsets", out.scales_offsets, alignof(uint32_t));
  check_pointer(op, "global_scales", global_scales, alignof(float));
  const SwizzledScaleLayout layout =
      SwizzledScaleLayout::make(in.intermediate, Nvfp4BlockQuant::kGroup, in.max_rows, in.groups);
  const Nvfp4Out nvfp4{out.codes, out.scales, out.scales_offsets, global_scales, layout};
  const int64_t scale_rows = layout.row_tiles * SwizzledScaleLayout::kTileRows;
  const size_t smem = nvfp4_smem_bytes(in.groups);
  if (interleaved) {
    launch<silu_nvfp4_kernel<true>>(op, scale_rows, smem, stream, rows, nvfp4);
  } else {
    launch<silu_nvfp4_kernel<false>>(op, scale_rows, smem, stream, rows, nvfp4);
  }
}

void silu_mxfp4(const SiluInput& in, const SiluMxfp4Output& out, const SwigluClamp* clamp,
                cudaStream_t stream) {
  using namespace detail;
  const char* op = "silu_mxfp4";
  const SiluRows rows = checked_rows(op, in, Mxfp4BlockQuant::kGroup);
  check_pointer(op, "out.codes", out.codes, 16);
  check_pointer(op, "out.scales", out.scales, 16);
  const Mxfp4ScaleLayout layout{in.intermediate, in.max_rows};
  if (clamp == nullptr) {
    launch<silu_mxfp4_kernel<SiluAct>>(op, in.max_rows, 0, stream, rows,
                                       Mxfp4Out<SiluAct>{out.codes, out.scales, layout, SiluAct{}});
    return;
  }
  if (!(clamp->limit >= 0.0f && std::isfinite(clamp->limit) && std::isfinite(clamp->alpha)))
    invalid(op, "the SwiGLU clamp needs a finite limit >= 0 and a finite alpha");
  launch<silu_mxfp4_kernel<SwigluAct>>(
      op, in.max_rows, 0, stream, rows,
      Mxfp4Out<SwigluAct>{out.codes, out.scales, layout, SwigluAct{*clamp}});
}

void load_silu_kernels() {
  using namespace detail;
  load_kernel(silu_bf16_kernel);
  load_kernel(silu_fp8_kernel);
  load_kernel(silu_nvfp4_kernel<false>);
  load_kernel(silu_nvfp4_kernel<true>);
  load_kernel(silu_mxfp4_kernel<SiluAct>);
  load_kernel(silu_mxfp4_kernel<SwigluAct>);
}

}  // namespace epcomm
