// NVTX ranges (the nvtx3 headers that ship with CUDA) around every dispatch and combine call, in
// the "epcomm" domain, so they show by name in Nsight Systems and the PyTorch profiler. A range
// costs a few nanoseconds when no tool is attached.
#pragma once

#include <nvtx3/nvtx3.hpp>

namespace epcomm {
namespace detail {

struct NvtxDomain {
  static constexpr const char* name{"epcomm"};
};

// EPCOMM_NVTX_RANGE("epcomm::dispatch"): a range named after the operation for the rest of the
// scope.
#define EPCOMM_NVTX_RANGE(op)                                                            \
  static const nvtx3::registered_string_in<::epcomm::detail::NvtxDomain> nvtx_name_{op}; \
  const nvtx3::scoped_range_in<::epcomm::detail::NvtxDomain> nvtx_range_ {               \
    nvtx_name_                                                                           \
  }

}  // namespace detail
}  // namespace epcomm
