// The team of ranks this process drives, and the small collectives the benchmark needs on top of
// the bootstrap (results and verdicts are gathered to every process; rank 0 reports).
#include <cstdlib>

#include "common.h"

namespace epbench {
namespace {

bool multi_process_env() {
  return std::getenv("EPCOMM_RANK") && std::getenv("EPCOMM_WORLD_SIZE") &&
         std::getenv("EPCOMM_BOOTSTRAP_DIR");
}

int local_device(int rank, int device_count) {
  if (const char* s = std::getenv("EPCOMM_LOCAL_RANK")) return std::atoi(s) % device_count;
  return rank % device_count;
}

cudaStream_t make_stream(int device) {
  set_device(device);
  cudaStream_t s = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

}  // namespace

std::unique_ptr<Team> Team::create(int ranks) {
  int device_count = 0;
  CHECK_CUDA(cudaGetDeviceCount(&device_count));
  if (device_count == 0) throw std::runtime_error("no CUDA device visible");
  std::unique_ptr<Team> team(new Team());
  if (multi_process_env()) {
    team->bootstrap_ = epcomm::FileBootstrap::from_env();
    team->n_ranks_ = team->bootstrap_->size();
    const int rank = team->bootstrap_->rank();
    const int device = local_device(rank, device_count);
    team->local_.push_back(LocalRank{rank, device, make_stream(device)});
  } else {
    team->n_ranks_ = ranks > 0 ? ranks : device_count;
    for (int r = 0; r < team->n_ranks_; ++r)
      team->local_.push_back(LocalRank{r, r % device_count, make_stream(r % device_count)});
  }
  // Ranks sharing each GPU: this process's, or processes placed local rank % GPUs by the
  // launcher.
  team->ranks_per_gpu_ = (team->n_ranks_ + device_count - 1) / device_count;
  return team;
}

Team::~Team() {
  for (const LocalRank& r : local_) {
    cudaSetDevice(r.device);
    cudaStreamDestroy(r.stream);
  }
}

std::vector<double> Team::gather(const std::vector<double>& local_values, size_t per_rank) const {
  if (local_values.size() != n_local() * per_rank)
    throw std::logic_error("Team::gather: wrong number of values");
  if (!bootstrap_) return local_values;  // one process: local ranks are all ranks, in order
  std::vector<double> all(size_t(n_ranks_) * per_rank);
  bootstrap_->all_gather(local_values.data(), all.data(), per_rank * sizeof(double));
  return all;
}

}  // namespace epbench
