// reference::silu_values_device (epcomm/formats/reference_silu.h): the SiLU kernels' z evaluated
// on the device, for checks. One thread per element and nothing shared with silu.cu but the
// pointwise functions of silu_math.h, so a check built on it does not share the kernels' indexing.
#include <algorithm>

#include "epcomm/detail/launch.h"
#include "epcomm/formats/codecs.h"
#include "epcomm/formats/reference_silu.h"

namespace epcomm {
namespace reference {
namespace {

__global__ void silu_values_kernel(const uint16_t* x, int64_t n, int32_t inter, bool interleaved,
                                   bool clamped, SwigluClamp clamp, float* z) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, j = i % inter;
    const uint16_t* row = x + r * 2 * inter;
    const float gate = bits_as_float(uint32_t(row[interleaved ? 2 * j : j]) << 16);
    const float up = bits_as_float(uint32_t(row[interleaved ? 2 * j + 1 : inter + j]) << 16);
    z[i] = clamped ? swiglu_clamped(gate, up, clamp) : silu_mul(gate, up);
  }
}

}  // namespace

void silu_values_device(const void* x, int64_t rows, int32_t intermediate, GateUpLayout layout,
                        const SwigluClamp* clamp, float* z, cudaStream_t stream) {
  const int64_t n = rows * intermediate;
  if (n <= 0) return;
  const int blocks = int(std::min<int64_t>((n + 255) / 256, 4096));
  silu_values_kernel<<<blocks, 256, 0, stream>>>(
      static_cast<const uint16_t*>(x), n, intermediate, layout == GateUpLayout::kInterleaved,
      clamp != nullptr, clamp ? *clamp : SwigluClamp{0.0f, 0.0f}, z);
  detail::check_cuda(cudaGetLastError(), "silu_values_device");
}

}  // namespace reference
}  // namespace epcomm
