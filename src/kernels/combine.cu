// The library's instantiation of combine: the plain bf16 store (or the un-reduced copy).
#include "epcomm/detail/combine_kernel.cuh"
#include "kernels/kernels.h"

namespace epcomm {
namespace detail {

void load_combine_kernels_default() { load_combine_kernels<StoreBf16>(); }

void launch_combine_default(const CombineParams& p, bool send, bool recv, cudaStream_t stream) {
  const StoreBf16 store{static_cast<uint16_t*>(p.out), p.g.hidden};
  launch_combine(p, store, send, recv, stream);
}

}  // namespace detail
}  // namespace epcomm
