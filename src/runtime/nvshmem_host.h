// NVSHMEM on the host: started once per process over epcomm's own Bootstrap (its unique id
// carried by one all-gather), the symmetric windows of groups that span nodes, and their peers'
// pointers. Built only with the NVSHMEM component (EPCOMM_NVSHMEM); without it every entry
// point throws Error(kSetup) saying so. Defines epcomm::spans_nodes_supported() (config.h).
#pragma once

#include <cstddef>

#include "epcomm/bootstrap.h"

namespace epcomm {
namespace detail {

// Starts NVSHMEM over the bootstrap's ranks (PE = bootstrap rank) on the current device, unless
// this process started it already, in which case the bootstrap must have the same rank and size.
// Collective over the bootstrap. `heap_bytes`: the symmetric heap to ask for where the
// environment does not set NVSHMEM_SYMMETRIC_SIZE.
void nvshmem_start(Bootstrap& bs, size_t heap_bytes);
// A symmetric allocation of `bytes` on every PE (collective: every PE calls it, in the same
// order, with the same size); throws Error(kSetup) if the heap is too small. A released one of
// the same size is taken first, so it is not zeroed: the caller zeroes it after a barrier that
// every peer reaches only after its earlier groups' kernels are done (a peer of a timed-out
// group may still have been writing into it).
char* nvshmem_alloc(size_t bytes, int rank);
// Gives one back for a later nvshmem_alloc of the same size (never nvshmem_free: that is
// collective, and after a timeout a peer may never call it).
void nvshmem_release(char* p, size_t bytes);
// PE `pe`'s copy of the symmetric object at `p`, mapped here; null where loads and stores
// cannot reach it.
char* nvshmem_peer(char* p, int pe);

}  // namespace detail
}  // namespace epcomm
