// Combine with a device epilogue instead of the plain store (compile with nvcc).
//
// The epilogue is a copyable functor with
//     __device__ void operator()(int32_t token, int32_t column, float value);
// called once per output element with the fp32 weighted sum (before any rounding), in place of
// storing out[token, column]. Router weights are required: given here (token-side reduction), or
// given to dispatch (expert-side reduction, group.h) with weights = nullptr here.
//
//   struct AddResidual { const float* res; float* out; int H;
//     __device__ void operator()(int t, int c, float v) { out[t * H + c] = v + res[t * H + c]; } };
//   epcomm::combine(group, in, weights, AddResidual{res, out, H}, stream);
#pragma once

#include "epcomm/detail/combine_kernel.cuh"
#include "epcomm/detail/epilogue_access.h"
#include "epcomm/detail/nvtx.h"
#include "epcomm/group.h"

namespace epcomm {

// Loads the combine kernels for `Epilogue` on the current device. Call it once per device after
// set-up and before the first dispatch: CUDA otherwise loads a kernel at its first launch, and
// that load waits for the device to go idle, which a dispatch waiting on peers may not do until
// it times out (one host thread driving several GPUs is the case that bites).
template <class Epilogue>
void load_combine_kernels() {
  detail::load_combine_kernels<Epilogue>();
}

// Fused combine (send + receive) with an epilogue.
template <class Epilogue>
void combine(Group& group, const CombineInput& in, const float* weights, const Epilogue& epi,
             cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::combine");
  const CombineOutput out{nullptr, weights};
  const detail::CombineParams p = detail::EpilogueAccess::prepare_combine(group, &in, &out);
  detail::launch_combine(p, epi, true, true, stream);
  detail::EpilogueAccess::after_launch("combine");
}

// The receive half with an epilogue, after group.combine_async(in, stream). Its kernel is this
// epilogue's split combine kernel, so a profiler sees it under another name than the library's
// combine_async kernel (with the library's own store, both halves are one kernel).
template <class Epilogue>
void combine_wait(Group& group, const float* weights, const Epilogue& epi, cudaStream_t stream) {
  EPCOMM_NVTX_RANGE("epcomm::combine_wait");
  const CombineOutput out{nullptr, weights};
  const detail::CombineParams p = detail::EpilogueAccess::prepare_combine(group, nullptr, &out);
  detail::launch_combine(p, epi, false, true, stream);
  detail::EpilogueAccess::after_launch("combine_wait");
}

}  // namespace epcomm
