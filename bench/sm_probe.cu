// epcomm_sm_probe: what a given number of SMs can store and load, on one GPU, with no epcomm kernel.
// prefill's shape (4096 tokens of 7168 bf16 values, 8 rows each), L2 flushed by a 256 MB memset
// before each launch, median of 10. A kernel either runs on exactly `pin` SMs (blocks on other
// SMs, by %smid, do nothing; the working ones take tokens from a counter) or is a plain grid of
// `grid` blocks; either way it records which SMs did work, and the figures are per SM that did.
// Modes: copy (one row read, 8 rows written), store-only (8 rows written), load8-only (8 rows
// read, one written), copy1 (one row read, one written at a byte stride and offset: dispatch's
// send to one destination, whose messages are a header, 112 bytes at top-8, and the row; added
// after the f9e9acc run, not yet run). What it showed on an H100 (docs/results/2026-11-25_h100_sm_pinning_f9e9acc.md):
// a grid of 2 S blocks runs on 2 S SMs, not on S; one SM stores about 63 GB/s and loads about
// 168 GB/s, whatever the launch shape.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#include "common.h"                  // CHECK_CUDA
#include "epcomm/detail/device.cuh"  // ld_nc_v4, sm_id
using epcomm::detail::sm_id;
#define CK(x) CHECK_CUDA(x)
__device__ __forceinline__ uint4 ldnc(const uint4* p) { return epcomm::detail::ld_nc_v4(p); }
constexpr int RV = 896, K = 8; constexpr int64_t T = 4096;
struct Args { const uint4* src; uint4* dst; unsigned* mask; unsigned long long* ctr; int pin; int64_t stride = 0, offset = 0; };
// MODE 0 copy (1 row read, K rows written), 1 store only, 2 load only (K rows read, 1 written),
// 3 copy1 (1 row read, written once at byte t * stride + offset)
template <int MODE, int U, bool CS>
__device__ void item(const Args& a, int64_t t, int lane) {
  for (int v0 = 0; v0 < RV; v0 += 32 * U) {
    uint4 buf[U];
    if (MODE == 0) {
#pragma unroll
      for (int u = 0; u < U; ++u) { int v = v0 + u * 32 + lane; if (v < RV) buf[u] = ldnc(a.src + t * RV + v); }
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int u = 0; u < U; ++u) { int v = v0 + u * 32 + lane; if (v < RV) { uint4* d = a.dst + (t * K + k) * RV + v; if (CS) __stcs(d, buf[u]); else *d = buf[u]; } }
    } else if (MODE == 3) {
#pragma unroll
      for (int u = 0; u < U; ++u) { int v = v0 + u * 32 + lane; if (v < RV) buf[u] = ldnc(a.src + t * RV + v); }
#pragma unroll
      for (int u = 0; u < U; ++u) { int v = v0 + u * 32 + lane; if (v < RV) { uint4* d = reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.dst) + t * a.stride + a.offset) + v; if (CS) __stcs(d, buf[u]); else *d = buf[u]; } }
    } else if (MODE == 1) {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int u = 0; u < U; ++u) { int v = v0 + u * 32 + lane; if (v < RV) { uint4* d = a.dst + (t * K + k) * RV + v; uint4 x = make_uint4(v, k, t, 1); if (CS) __stcs(d, x); else *d = x; } }
    } else {
      uint4 acc[U] = {};
#pragma unroll
      for (int k = 0; k < K; ++k) {
        uint4 r[U];
#pragma unroll
        for (int u = 0; u < U; ++u) { int v = v0 + u * 32 + lane; r[u] = v < RV ? ldnc(a.dst + (t * K + k) * RV + v) : make_uint4(0,0,0,0); }
#pragma unroll
        for (int u = 0; u < U; ++u) { acc[u].x ^= r[u].x; acc[u].y += r[u].y; acc[u].z ^= r[u].z; acc[u].w += r[u].w; }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) { int v = v0 + u * 32 + lane; if (v < RV) ((uint4*)a.src)[t * RV + v] = acc[u]; }
    }
  }
}
template <int TH, int BPS, int MODE, int U, bool CS>
__global__ void __launch_bounds__(TH, BPS) kern(Args a) {
  const int lane = threadIdx.x % 32;
  const uint32_t sm = sm_id();
  bool work = a.pin == 0 || sm < uint32_t(a.pin);
  if (work && lane == 0 && threadIdx.x == 0) atomicOr(&a.mask[sm / 32], 1u << (sm % 32));
  if (a.pin == 0) {
    const int64_t warps = int64_t(gridDim.x) * (TH / 32);
    for (int64_t t = blockIdx.x * (TH / 32) + threadIdx.x / 32; t < T; t += warps) item<MODE, U, CS>(a, t, lane);
  } else if (work) {
    unsigned long long next = lane == 0 ? atomicAdd(&a.ctr[0], 1ull) : 0; next = __shfl_sync(~0u, next, 0);
    while (int64_t(next) < T) { unsigned long long after = lane == 0 ? atomicAdd(&a.ctr[0], 1ull) : 0; item<MODE, U, CS>(a, next, lane); next = __shfl_sync(~0u, after, 0); }
  }
}
template <int TH, int BPS, int MODE, int U, bool CS>
void run(const char* name, Args a, int pin, int grid_or_0, void* flush) {
  auto k = kern<TH, BPS, MODE, U, CS>;
  int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  int grid = grid_or_0 ? grid_or_0 : nsm * BPS;
  a.pin = pin;
  std::vector<float> ts;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  unsigned hm[5];
  for (int it = 0; it < 11; ++it) {
    CK(cudaMemset(flush, it, 256 << 20));
    CK(cudaMemset(a.mask, 0, 5 * 4)); CK(cudaMemset(a.ctr, 0, 8));
    CK(cudaEventRecord(e0)); k<<<grid, TH>>>(a); CK(cudaGetLastError()); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (it) ts.push_back(ms * 1000);
  }
  CK(cudaMemcpy(hm, a.mask, 20, cudaMemcpyDeviceToHost));
  int used = 0; for (int i = 0; i < 5; ++i) used += __builtin_popcount(hm[i]);
  std::sort(ts.begin(), ts.end());
  double mb = MODE == 3 ? 2.0 * T * RV * 16 / 1e6 : MODE == 0 ? (T * RV * 16 * (K + 1)) / 1e6 : MODE == 1 ? T * RV * 16 * K / 1e6 : T * RV * 16 * (K + 1) / 1e6;
  double us = ts[ts.size() / 2];
  printf("%-34s pin=%2d grid=%4d SMs-used=%3d  %8.1f us  %7.0f GB/s  %6.1f GB/s per used SM\n", name, pin, grid, used, us, mb * 1e3 / us, mb * 1e3 / us / used);
}
int main() {
  Args a{};
  void* flush;
  CK(cudaMalloc((void**)&a.src, T * RV * 16)); CK(cudaMalloc(&a.dst, T * K * RV * 16)); CK(cudaMalloc(&a.mask, 64)); CK(cudaMalloc(&a.ctr, 64)); CK(cudaMalloc(&flush, 256 << 20));
  CK(cudaMemset((void*)a.src, 1, T * RV * 16)); CK(cudaMemset(a.dst, 2, T * K * RV * 16));
  for (int s : {8, 32}) {
    printf("--- %d SMs: the issue's plain kernel (unpinned grid of 2*S blocks) vs pinned\n", s);
    run<1024, 2, 0, 4, true>("copy plain 1024x2 u4 cs (2S blocks)", a, 0, 2 * s, flush);
    run<1024, 2, 0, 4, true>("copy plain 1024x2 u4 cs (S blocks)", a, 0, s, flush);
    run<1024, 2, 0, 4, true>("copy pinned 1024x2 u4 cs", a, s, 0, flush);
    run<1024, 2, 0, 4, false>("copy pinned 1024x2 u4 wb", a, s, 0, flush);
    run<512, 4, 0, 4, true>("copy pinned 512x4 u4 cs", a, s, 0, flush);
    run<1024, 1, 0, 8, true>("copy pinned 1024x1 u8 cs", a, s, 0, flush);
    run<1024, 2, 1, 4, true>("store-only pinned 1024x2 u4 cs", a, s, 0, flush);
    run<1024, 2, 1, 4, false>("store-only pinned 1024x2 u4 wb", a, s, 0, flush);
    run<1024, 2, 2, 2, false>("load8-only pinned 1024x2 u2", a, s, 0, flush);
    run<512, 2, 2, 2, false>("load8-only plain 512x2 u2 (2S blocks)", a, 0, 2 * s, flush);
    run<512, 2, 2, 2, false>("load8-only pinned 512x2 u2", a, s, 0, flush);
  }
  for (int s : {8, 32}) {
    printf("--- %d SMs, copy1: one row read, one written (a send to one destination)\n", s);
    Args m = a;
    for (int64_t off : {0, 112, 128}) {
      m.offset = off;
      m.stride = RV * 16 + off;  // a header of `off` bytes before each row
      printf("message stride %lld, row at +%lld\n", (long long)m.stride, (long long)off);
      run<512, 1, 3, 8, false>("copy1 pinned 512x1 u8 wb", m, s, 0, flush);
      run<1024, 1, 3, 8, false>("copy1 pinned 1024x1 u8 wb", m, s, 0, flush);
      run<1024, 2, 3, 4, false>("copy1 pinned 1024x2 u4 wb", m, s, 0, flush);
    }
  }
  printf("--- 1 and 132 SMs\n");
  run<1024, 2, 1, 4, true>("store-only pinned 1024x2 u4 cs", a, 1, 0, flush);
  run<1024, 2, 2, 2, false>("load8-only pinned 1024x2 u2", a, 1, 0, flush);
  run<1024, 2, 0, 4, true>("copy pinned 1024x2 u4 cs", a, 1, 0, flush);
  run<1024, 2, 0, 4, true>("copy all 1024x2 u4 cs", a, 0, 0, flush);
  run<1024, 2, 1, 4, true>("store-only all 1024x2 u4 cs", a, 0, 0, flush);
  run<1024, 2, 2, 2, false>("load8-only all 1024x2 u2", a, 0, 0, flush);
  return 0;
}
