// Combine with a device epilogue instead of the plain store (compile with nvcc).
//
// The epilogue is a copyable functor with
//     __device__ void operator()(int32_t token, int32_t column, float value);
// called once per output element with the fp32 weighted sum (before any rounding), in place of
// storing out[token, column]. Router weights are required.
//
//   struct AddResidual { const float* res; float* out; int H;
//     __device__ void operator()(int t, int c, float v) { out[t * H + c] = v + res[t * H + c]; } };
//   epcomm::combine(group, in, weights, AddResidual{res, out, H}, stream);
#pragma once

#include "epcomm/detail/combine_kernel.cuh"
#include "epcomm/group.h"

namespace epcomm {

// Fused combine (send + receive) with an epilogue.
template <class Epilogue>
void combine(Group& group, const CombineInput& in, const float* weights, const Epilogue& epi,
             cudaStream_t stream) {
  const CombineOutput out{nullptr, weights};
  const detail::CombineParams p = group.prepare_combine(&in, &out);
  detail::launch_combine(p, epi, true, true, stream);
  group.after_launch("combine");
}

// The receive half with an epilogue, after group.combine_async(in, stream).
template <class Epilogue>
void combine_wait(Group& group, const float* weights, const Epilogue& epi, cudaStream_t stream) {
  const CombineOutput out{nullptr, weights};
  const detail::CombineParams p = group.prepare_combine(nullptr, &out);
  detail::launch_combine(p, epi, false, true, stream);
  group.after_launch("combine_wait");
}

}  // namespace epcomm
