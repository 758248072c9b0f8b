// epcomm._epcomm: the nanobind module under the Python package (python/epcomm). It binds the
// C++ API one to one and checks every array argument (dtype, shape, device, contiguity) with a
// message that names the call, the rank and the argument; python/epcomm/__init__.py adds the
// framework side (current streams, output tensors of the caller's framework, torch.distributed).
//
// Arrays cross as DLPack (nb::ndarray<>), so any framework's tensors are accepted. Streams cross
// as integers (cudaStream_t). Every call that launches work restores the caller's current device.
//
// The bindings live in one file per concern (bindings.h lists them); this file assembles them.
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "epcomm/config.h"

namespace nb = nanobind;
using namespace epcomm_py;

NB_MODULE(_epcomm, m) {
  m.doc() = "epcomm: expert-parallel dispatch and combine (the C++ library's bindings)";

  bind_errors(m);
  bind_config(m);
  bind_bootstrap(m);
  bind_group(m);
  bind_silu(m);
  m.def("spans_nodes_supported", &epcomm::spans_nodes_supported,
        "Whether this build has the NVSHMEM component (built with -DEPCOMM_WITH_NVSHMEM=ON), "
        "without which a group must be one node (ranks_per_node).");
  bind_reference(m);
}
