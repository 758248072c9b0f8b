// Host helpers for launching epcomm kernels: CUDA error checks and the cooperative launch every
// epcomm kernel uses (its blocks wait on each other, so all of them must be resident at once).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "epcomm/error.h"

namespace epcomm {
namespace detail {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kCuda,
                std::string(what) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

#if defined(__CUDACC__)
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
