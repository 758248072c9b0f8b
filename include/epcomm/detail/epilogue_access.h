// How the header-only combine with a custom epilogue (epcomm/combine_epilogue.cuh), compiled in
// the user's translation unit, reaches a Group: the argument checks and the kernel parameters
// before its launch, and the launch check after it. Not for users: they call epcomm::combine
// and epcomm::combine_wait of combine_epilogue.cuh.
#pragma once

#include "epcomm/detail/params.h"
#include "epcomm/group.h"

namespace epcomm {
namespace detail {

struct EpilogueAccess {
  // Checks the arguments of a combine (in and out), combine_async (in only) or combine_wait (out
  // only), tracks the async / wait pairing, and returns the kernels' parameters. Throws
  // epcomm::Error as Group::combine does. Then launch, then after_launch().
  static CombineParams prepare_combine(Group& group, const CombineInput* in,
                                       const CombineOutput* out);
  // Throws Error(kCuda) when the launch failed; `op` names the operation.
  static void after_launch(const char* op);
};

}  // namespace detail
}  // namespace epcomm
