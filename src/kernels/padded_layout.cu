// pad_expert_rows / unpad_expert_rows (epcomm/padded_layout.h).
//
// One warp a row: warps walk the rows [0, n), n = min(row_offsets[G], max_rows) read on the
// device, in a grid-stride loop over at most one resident wave of blocks. A row finds its group
// by a binary search of row_offsets, and its slot j = row - row_offsets[g]; lanes move its bytes
// 16 at a time (and, for blockwise FP8, one scale each, or one UE8M0 word of four scales each).
// The per-group counts go to the first G threads of the grid (a group's padding rows, rank -1,
// are at its end); layout_range is zeroed before the launch and each row adds 1 to its source's
// entry, the first row of a source's run also its slot << 32 (rows of a group are sorted by
// source rank, so each source has one run). A row outside its group's slots (j < 0, row_offsets
// not starting at 0; or j >= capacity) is not copied (unpad: zeroed).
#include <algorithm>
#include <string>

#include "epcomm/detail/device.cuh"
#include "epcomm/detail/launch.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/padded_layout.h"

namespace epcomm {
namespace detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;

__device__ __forceinline__ int64_t used_rows(const DispatchRows& r) {
  return min(int64_t(r.row_offsets[r.groups]), r.max_rows);
}

__device__ __forceinline__ GroupSlots slots_of(const DispatchRows& r, int64_t capacity) {
  return GroupSlots{r.row_offsets, r.groups, capacity};
}

__device__ __forceinline__ void copy_row(uint4* dst, const uint4* src, int64_t units, int lane) {
  for (int64_t u = lane; u < units; u += kWarpSize)
    dst[u] = src[u];
}

__global__ void __launch_bounds__(kThreads) pad_kernel(PadExpertRows a) {
  const DispatchRows& r = a.rows;
  const int64_t thread = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t g = thread; g < r.groups; g += int64_t(gridDim.x) * kThreads) {
    int64_t n = min(int64_t(r.row_offsets[g + 1]), r.max_rows) - r.row_offsets[g];
    while (n > 0 && r.src_info[r.row_offsets[g] + n - 1].rank < 0)
      --n;
    a.counts[g] = int32_t(max(int64_t(0), min(n, a.capacity)));
  }
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t n = used_rows(r);
  const int64_t units = a.row_bytes / 16;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; i < n;
       i += int64_t(gridDim.x) * kWarps) {
    const SrcInfo s = r.src_info[i];
    if (s.rank < 0) continue;  // FP8 padding
    const GroupSlots gs = slots_of(r, a.capacity);
    const int32_t g = gs.group_of(i);
    const int64_t j = gs.slot_in(g, i);
    if (j < 0 || j >= a.capacity) continue;
    const int64_t slot = gs.slot_row(g, i);
    copy_row(static_cast<uint4*>(a.padded_codes) + slot * units,
             static_cast<const uint4*>(a.codes) + i * units, units, lane);
    if (a.padded_scales != nullptr)
      for (int32_t k = lane; k < a.scale_cols; k += kWarpSize)
        a.padded_scales[(int64_t(g) * a.scale_cols + k) * a.capacity + j] =
            a.scales[int64_t(k) * r.max_rows + i];
    if (a.padded_ue8m0 != nullptr)
      for (int32_t q = lane; q < a.scale_cols / 4; q += kWarpSize) {
        const float* s4 = a.scales + int64_t(4 * q) * r.max_rows + i;
        a.padded_ue8m0[(int64_t(g) * (a.scale_cols / 4) + q) * a.capacity + j] =
            Fp8BlockQuant::ue8m0_word(s4[0], s4[r.max_rows], s4[2 * r.max_rows],
                                      s4[3 * r.max_rows]);
      }
    if (lane == 0) {
      if (a.src_token != nullptr) a.src_token[slot] = s.token;
      if (a.layout_range != nullptr && s.rank < a.n_ranks) {
        const bool first = j == 0 || r.src_info[i - 1].rank != s.rank;
        atomicAdd(
            reinterpret_cast<unsigned long long*>(a.layout_range) + int64_t(g) * a.n_ranks + s.rank,
            (first ? (static_cast<unsigned long long>(j) << 32) : 0ull) + 1ull);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) unpad_kernel(UnpadExpertRows a) {
  const DispatchRows& r = a.rows;
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t n = used_rows(r);
  const int64_t units = a.row_bytes / 16;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; i < n;
       i += int64_t(gridDim.x) * kWarps) {
    uint4* dst = static_cast<uint4*>(a.out) + i * units;
    const GroupSlots gs = slots_of(r, a.capacity);
    const int32_t g = gs.group_of(i);
    const int64_t j = gs.slot_in(g, i);
    if (r.src_info[i].rank < 0 || j < 0 || j >= a.capacity) {
      for (int64_t u = lane; u < units; u += kWarpSize)
        dst[u] = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    copy_row(dst, static_cast<const uint4*>(a.padded) + gs.slot_row(g, i) * units, units, lane);
  }
}

// A pointer to an array of no elements may be null (an empty tensor's data pointer is); else
// check_pointer.
void check_array(const char* op, const char* name, const void* p, size_t align, int64_t elements) {
  if (p == nullptr && elements == 0) return;
  check_pointer(op, name, p, align);
}

void check_rows(const char* op, const DispatchRows& r, int64_t row_bytes, int64_t capacity) {
  check_pointer(op, "row_offsets", r.row_offsets, 4);
  check_array(op, "src_info", r.src_info, alignof(SrcInfo), r.max_rows);
  if (r.groups < 1) invalid(op, "groups = " + std::to_string(r.groups) + " must be at least 1");
  if (r.max_rows < 0 || r.max_rows >= (int64_t(1) << 31))
    invalid(op, "max_rows = " + std::to_string(r.max_rows) + " is outside [0, 2^31)");
  if (row_bytes <= 0 || row_bytes % 16 != 0)
    invalid(op, "row_bytes = " + std::to_string(row_bytes) + " is not a positive multiple of 16");
  if (capacity < 0 || capacity >= (int64_t(1) << 31))
    invalid(op, "capacity = " + std::to_string(capacity) + " is outside [0, 2^31)");
}

// At most one resident wave of blocks, and no more than the rows (and min_threads) need.
template <auto K, class Args>
void launch_rows(const char* op, int64_t rows, int64_t min_threads, Args args,
                 cudaStream_t stream) {
  const int64_t need =
      std::max((rows + kWarps - 1) / kWarps, (min_threads + kThreads - 1) / kThreads);
  const int64_t blocks = std::max<int64_t>(1, std::min(need, resident_wave<K, kThreads, 0>()));
  K<<<unsigned(blocks), kThreads, 0, stream>>>(args);
  check_cuda(cudaGetLastError(), op);
}

}  // namespace
}  // namespace detail

void check_pad_expert_rows(const PadExpertRows& a) {
  using namespace detail;
  const char* op = "pad_expert_rows";
  check_rows(op, a.rows, a.row_bytes, a.capacity);
  const int64_t rows = a.rows.max_rows, slots = int64_t(a.rows.groups) * a.capacity;
  check_array(op, "codes", a.codes, 16, rows);
  check_array(op, "padded_codes", a.padded_codes, 16, slots);
  check_pointer(op, "counts", a.counts, 4);
  if (a.scales != nullptr) {
    check_pointer(op, "scales", a.scales, 4);
    if (a.padded_scales == nullptr && a.padded_ue8m0 == nullptr)
      invalid(op, "scales without padded_scales or padded_ue8m0");
    if (a.padded_scales != nullptr) check_pointer(op, "padded_scales", a.padded_scales, 4);
    if (a.scale_cols < 1)
      invalid(op, "scale_cols = " + std::to_string(a.scale_cols) + " with scales");
    if (a.padded_ue8m0 != nullptr) {
      check_pointer(op, "padded_ue8m0", a.padded_ue8m0, 4);
      if (a.scale_cols % 4 != 0)
        invalid(op, "scale_cols = " + std::to_string(a.scale_cols) +
                        " is not a multiple of 4 (four UE8M0 scales a word)");
    }
  } else if (a.padded_scales != nullptr || a.padded_ue8m0 != nullptr) {
    invalid(op, "padded_scales or padded_ue8m0 without scales");
  }
  if (a.src_token != nullptr) check_pointer(op, "src_token", a.src_token, 4);
  if (a.layout_range != nullptr) {
    check_pointer(op, "layout_range", a.layout_range, 8);
    if (a.n_ranks < 1) invalid(op, "n_ranks = " + std::to_string(a.n_ranks) + " with layout_range");
  }
}

void pad_expert_rows(const PadExpertRows& a, cudaStream_t stream) {
  using namespace detail;
  const char* op = "pad_expert_rows";
  check_pad_expert_rows(a);
  if (a.layout_range != nullptr) {
    check_cuda(
        cudaMemsetAsync(a.layout_range, 0, size_t(a.rows.groups) * size_t(a.n_ranks) * 8, stream),
        "cudaMemsetAsync");
  }
  launch_rows<pad_kernel>(op, a.rows.max_rows, a.rows.groups, a, stream);
}

void check_unpad_expert_rows(const UnpadExpertRows& a) {
  using namespace detail;
  const char* op = "unpad_expert_rows";
  check_rows(op, a.rows, a.row_bytes, a.capacity);
  check_array(op, "padded", a.padded, 16, int64_t(a.rows.groups) * a.capacity);
  check_array(op, "out", a.out, 16, a.rows.max_rows);
}

void unpad_expert_rows(const UnpadExpertRows& a, cudaStream_t stream) {
  check_unpad_expert_rows(a);
  detail::launch_rows<detail::unpad_kernel>("unpad_expert_rows", a.rows.max_rows, 0, a, stream);
}

}  // namespace epcomm
