// EPCOMM_HD: a function usable from host and device code (inline on the host-only build), and
// the integer helpers the layouts share.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EPCOMM_HD __host__ __device__ __forceinline__
#else
#define EPCOMM_HD inline
#endif

namespace epcomm {

EPCOMM_HD constexpr int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// total / ranks: each rank's share (experts per rank); 0 for a group of no ranks, a
// configuration that validation refuses but whose sizes are still worked out.
EPCOMM_HD constexpr int32_t per_rank_count(int32_t total, int32_t ranks) {
  return ranks > 0 ? total / ranks : 0;
}

// Division of values in [0, 2^31) by a divisor d in [1, 2^31) fixed at set-up (experts per rank),
// as one multiply and one shift: the GPU has no integer divider, and each `/` or `%` by a
// value known only at run time was about 20 instructions inline, of which decode's dispatch ran
// dozens per thread before its first byte moved (Nsight Compute's source page, 2026-11-27).
// With l = ceil(log2 d) and m = floor(2^(31+l) / d) + 1, m * d lies in (2^(31+l), 2^(31+l) +
// 2^l], so floor(x / d) = floor(x * m / 2^(31+l)) for every x < 2^31 (Granlund and Montgomery,
// "Division by invariant integers using multiplication", 1994, theorem 4.2); m < 2^32.
// Build one on the host, where the constructor's 64-bit division is cheap, and hand it to the
// kernels in their parameters (GroupView, RouteMap). A divisor below 1 (a configuration that
// validation refuses, whose sizes are still worked out to name what is wrong) is kept in d,
// and div() of it means nothing; the constructor never divides by it.
struct Divisor {
  int32_t d = 1;
  uint32_t mul = (1u << 31) + 1;
  uint32_t shift = 31;  // 31 + l

  Divisor() = default;
  EPCOMM_HD explicit Divisor(int32_t divisor) : d(divisor) {
    if (divisor < 1) {
      mul = 0;
      shift = 0;
      return;
    }
    uint32_t l = 0;
    while (l < 31 && (int64_t(1) << l) < divisor)
      ++l;
    shift = 31 + l;
    mul = uint32_t((uint64_t(1) << shift) / uint64_t(divisor) + 1);
  }
  EPCOMM_HD int32_t div(int32_t x) const { return int32_t((uint64_t(uint32_t(x)) * mul) >> shift); }
  EPCOMM_HD int32_t mod(int32_t x) const { return x - div(x) * d; }
};

}  // namespace epcomm
