// The library's instantiation of combine: the plain bf16 store (or the un-reduced copy).
#include "epcomm/detail/combine_kernel.cuh"
#include "kernels/kernels.h"

namespace epcomm {
namespace detail {

int load_combine_kernels_default() {
  load_combine_kernels<StoreBf16>();
  int per_sm = 0, fewest = 1 << 30;
  for (bool alone : {false, true})
    for (bool expert_side : {false, true})
      for (bool whole_rows : {false, true}) {
        auto kernel = combine_kernel_of<StoreBf16>(expert_side, whole_rows, true, alone);
        check_cuda(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCombineThreads, 0),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor(combine)");
        fewest = per_sm < fewest ? per_sm : fewest;
      }
  return fewest;
}

void launch_combine_default(const CombineParams& p, bool send, bool recv, cudaStream_t stream) {
  const StoreBf16 store{static_cast<uint16_t*>(p.out), p.hidden};
  launch_combine(p, store, send, recv, stream);
}

}  // namespace detail
}  // namespace epcomm
