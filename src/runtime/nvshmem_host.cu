// NVSHMEM on the host (nvshmem_host.h). A .cu file: NVSHMEM's initialisation is inline in its
// headers and sets up the device library linked into this module's kernels.
#include "runtime/nvshmem_host.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/error.h"

#if EPCOMM_NVSHMEM
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace epcomm {
namespace detail {

std::string rank_prefix(int rank);

#if EPCOMM_NVSHMEM

namespace {
std::mutex g_mutex;
bool g_started = false;
int g_rank = -1, g_size = 0;
}  // namespace

bool nvshmem_built() {
  return true;
}

void nvshmem_start(Bootstrap& bs, size_t heap_bytes) {
  // Every rank says whether it has started; all must agree, so none waits in a collective
  // that another skips.
  std::lock_guard<std::mutex> lock(g_mutex);
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  struct Offer {
    int32_t started, rank, size, pad;
    nvshmemx_uniqueid_t id;
  } mine{g_started ? 1 : 0, g_rank, g_size, 0, id};
  if (!g_started && bs.rank() == 0 && nvshmemx_get_uniqueid(&mine.id) != 0)
    throw Error(ErrorCode::kSetup, rank_prefix(bs.rank()) + "nvshmemx_get_uniqueid failed");
  std::vector<Offer> all(static_cast<size_t>(bs.size()));
  bs.all_gather(&mine, all.data(), sizeof(Offer));
  for (int r = 0; r < bs.size(); ++r)
    if (all[size_t(r)].started != all[0].started)
      throw Error(ErrorCode::kSetup,
                  rank_prefix(bs.rank()) + "NVSHMEM is started on rank " +
                      std::to_string(all[0].started ? 0 : r) + " but not on rank " +
                      std::to_string(all[0].started ? r : 0) +
                      ": every process of a group that spans nodes starts it with the group");
  if (g_started) {
    if (g_rank != bs.rank() || g_size != bs.size())
      throw Error(ErrorCode::kSetup,
                  rank_prefix(bs.rank()) + "NVSHMEM runs here as PE " + std::to_string(g_rank) +
                      " of " + std::to_string(g_size) +
                      "; a group that spans nodes must use the same ranks (PE = group rank)");
    return;
  }
  if (std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr)
    ::setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap_bytes).c_str(), 0);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(bs.rank(), bs.size(), &all[0].id, &attr) != 0)
    throw Error(ErrorCode::kSetup,
                rank_prefix(bs.rank()) + "nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
    throw Error(ErrorCode::kSetup, rank_prefix(bs.rank()) + "nvshmemx_init_attr failed");
  if (nvshmem_my_pe() != bs.rank() || nvshmem_n_pes() != bs.size())
    throw Error(ErrorCode::kSetup, rank_prefix(bs.rank()) + "NVSHMEM started as PE " +
                                       std::to_string(nvshmem_my_pe()) + " of " +
                                       std::to_string(nvshmem_n_pes()));
  g_started = true;
  g_rank = bs.rank();
  g_size = bs.size();
}

// Windows of groups that are gone, by size. nvshmem_malloc and nvshmem_free are collective:
// after a timeout some ranks' groups are poisoned and a peer may be dead or elsewhere, so a
// window is never freed but kept for the next group of the same size. Every rank sets up and
// tears down the same groups in the same order, so every rank takes from its pool, or calls
// nvshmem_malloc, at the same time as the others.
namespace {
std::vector<std::pair<size_t, char*>> g_pool;
}  // namespace

char* nvshmem_alloc(size_t bytes, int rank) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (size_t i = 0; i < g_pool.size(); ++i) {
    if (g_pool[i].first != bytes) continue;
    char* p = g_pool[i].second;
    g_pool.erase(g_pool.begin() + long(i));
    if (cudaMemset(p, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
      throw Error(ErrorCode::kCuda, rank_prefix(rank) + "zeroing the NVSHMEM window failed");
    return p;
  }
  void* p = nvshmem_malloc(bytes);
  if (p == nullptr)
    throw Error(ErrorCode::kSetup,
                rank_prefix(rank) + "nvshmem_malloc of " + std::to_string(bytes) +
                    " bytes failed: the symmetric heap is too small (raise NVSHMEM_SYMMETRIC_SIZE, "
                    "read when NVSHMEM starts)");
  if (cudaMemset(p, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    throw Error(ErrorCode::kCuda, rank_prefix(rank) + "zeroing the NVSHMEM window failed");
  return static_cast<char*>(p);
}

void nvshmem_release(char* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_pool.emplace_back(bytes, p);
}

char* nvshmem_peer(char* p, int pe) {
  return static_cast<char*>(nvshmem_ptr(p, pe));
}

#else  // no NVSHMEM component

namespace {
[[noreturn]] void not_built(int rank) {
  throw Error(ErrorCode::kSetup,
              rank_prefix(rank) +
                  "this group spans nodes, and this build connects the GPUs of one node only "
                  "(build with -DEPCOMM_WITH_NVSHMEM=ON)");
}
}  // namespace

bool nvshmem_built() {
  return false;
}
void nvshmem_start(Bootstrap& bs, size_t) {
  not_built(bs.rank());
}
char* nvshmem_alloc(size_t, int rank) {
  not_built(rank);
}
void nvshmem_release(char*, size_t) {}
char* nvshmem_peer(char*, int) {
  return nullptr;
}

#endif

}  // namespace detail
}  // namespace epcomm
