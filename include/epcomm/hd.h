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

}  // namespace epcomm
