// Host entry points of the library's kernels (src/kernels/*.cu), called by the runtime.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "epcomm/detail/launch.h"
#include "epcomm/detail/params.h"

namespace epcomm {
namespace detail {

// Dispatch: send (async), receive (wait) or both (fused) in one cooperative launch.
void launch_dispatch(const DispatchParams& p, bool send, bool recv, cudaStream_t stream);
// Sets the kernels' shared-memory limits on the current device (which loads them) and returns
// how many blocks of the fused kernel one SM holds.
int prepare_dispatch_kernels(const GroupView& g);
size_t dispatch_smem_bytes(const GroupView& g);
int dispatch_unit_tokens();  // tokens ranked per block-unit (sizes the ranking scratch)

// Loads the library's combine kernels now (see load_combine_kernels in combine_kernel.cuh) and
// returns how many blocks of them one SM holds.
int load_combine_kernels_default();
// Combine with the plain bf16 store (or the un-reduced [T, K, H] copy when weights are null).
void launch_combine_default(const CombineParams& p, bool send, bool recv, cudaStream_t stream);

}  // namespace detail
}  // namespace epcomm
