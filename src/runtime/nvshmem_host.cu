// NVSHMEM on the host (nvshmem_host.h). A .cu file: NVSHMEM's initialisation is inline in its
// headers and sets up the device library linked into this module's kernels.
#include "runtime/nvshmem_host.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/config.h"
#include "epcomm/error.h"

#if EPCOMM_NVSHMEM
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace epcomm {

bool spans_nodes_supported() {
#if EPCOMM_NVSHMEM
  return true;
#else
  return false;
#endif
}

namespace detail {

std::string rank_prefix(int rank);

#if EPCOMM_NVSHMEM

namespace {
std::mutex g_mutex;
bool g_started = false;
int g_rank = -1, g_size = 0;
unsigned long long g_world = 0;
}  // namespace

void nvshmem_start(Bootstrap& bs, size_t heap_bytes) {
  // Every rank offers what it knows, and every rank judges the same gathered offers, so that
  // all of them go on into NVSHMEM's collectives or all of them throw (none is left waiting).
  std::lock_guard<std::mutex> lock(g_mutex);
  struct Offer {
    int32_t started, rank, size, id_ok;
    unsigned long long world;  // the NVSHMEM world this process joined (rank 0's pid and time)
    nvshmemx_uniqueid_t id;
  } mine{g_started ? 1 : 0, g_rank, g_size, 1, g_world, NVSHMEMX_UNIQUEID_INITIALIZER};
  if (!g_started && bs.rank() == 0) {
    mine.id_ok = nvshmemx_get_uniqueid(&mine.id) == 0;
    mine.world = (static_cast<unsigned long long>(::getpid()) << 32) ^
                 static_cast<unsigned long long>(std::time(nullptr));
  }
  std::vector<Offer> all(static_cast<size_t>(bs.size()));
  bs.all_gather(&mine, all.data(), sizeof(Offer));
  auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::kSetup, rank_prefix(bs.rank()) + why);
  };
  if (!all[0].id_ok) fail("nvshmemx_get_uniqueid failed on rank 0");
  for (int r = 0; r < bs.size(); ++r) {
    const Offer& o = all[size_t(r)];
    if (o.started != all[0].started)
      fail("NVSHMEM is started on rank " + std::to_string(all[0].started ? 0 : r) +
           " but not on rank " + std::to_string(all[0].started ? r : 0) +
           ": every process of a group that spans nodes starts it with the group");
    if (o.started && (o.rank != r || o.size != bs.size() || o.world != all[0].world))
      fail("rank " + std::to_string(r) + " runs NVSHMEM as PE " + std::to_string(o.rank) + " of " +
           std::to_string(o.size) + (o.world != all[0].world ? " of another NVSHMEM world" : "") +
           "; a group that spans nodes must have the ranks NVSHMEM started with (PE = rank)");
  }
  if (g_started) return;
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
  g_world = all[0].world;
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
    return p;
  }
  void* p = nvshmem_malloc(bytes);
  if (p == nullptr)
    throw Error(ErrorCode::kSetup,
                rank_prefix(rank) + "nvshmem_malloc of " + std::to_string(bytes) +
                    " bytes failed: the symmetric heap is too small (raise NVSHMEM_SYMMETRIC_SIZE, "
                    "read when NVSHMEM starts)");
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
