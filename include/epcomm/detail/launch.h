// Host helpers for launching epcomm kernels: CUDA error checks and the cooperative launch every
// epcomm kernel uses (its blocks wait on each other, so all of them must be resident at once).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "epcomm/error.h"

namespace epcomm {
namespace detail {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kCuda, std::string(what) + " failed: " + cudaGetErrorName(e) + ": " +
                                      cudaGetErrorString(e));
}

// Argument checks of the launch-only entry points (SiLU, padded layout): Error(kInvalidArgument)
// "<op>: <what>".
[[noreturn]] inline void invalid(const char* op, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what);
}
inline void check_pointer(const char* op, const char* name, const void* p, size_t align) {
  if (p == nullptr) invalid(op, std::string(name) + " is null");
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    invalid(op, std::string(name) + " is not " + std::to_string(align) + "-byte aligned");
}

// The current device's SM count.
inline int64_t device_sms() {
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  return sms;
}

// Threads of a dispatch block, for tools that launch grids shaped like epcomm's (the benchmark's
// latency floor).
int dispatch_threads();

#if defined(__CUDACC__)
// Blocks of kernel K (Threads threads, at most Smem bytes of dynamic shared memory) the current
// device holds at once: one resident wave, for grid-stride kernels that need no more. The
// per-SM count depends on the kernel and the architecture, not on the call: asked once.
template <auto K, int Threads, size_t Smem>
int64_t resident_wave() {
  static const int per_sm = [] {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, K, Threads, Smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return n > 1 ? n : 1;
  }();
  return device_sms() * per_sm;
}

template <class Kernel, class... Args>
void launch_cooperative(Kernel kernel, int blocks, int threads, size_t smem, cudaStream_t stream,
                        const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, args...), "epcomm kernel launch");
}
#endif

}  // namespace detail
}  // namespace epcomm
