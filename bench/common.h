// Shared pieces of the benchmarks: error checks, integer options, device and pinned arrays, and
// the team of ranks this process drives (every visible GPU in the one-process mode, one GPU per
// process otherwise).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"

namespace epbench {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file,
                                          int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + expr +
                           " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

#define CHECK_CUDA(expr)                                                       \
  do {                                                                         \
    cudaError_t check_cuda_err_ = (expr);                                      \
    if (check_cuda_err_ != cudaSuccess)                                        \
      ::epbench::throw_cuda_error(check_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// The value of an integer command-line option: throws std::invalid_argument unless it is in
// [min_value, 2^30].
inline int32_t parse_int(const std::string& flag, const std::string& value, int32_t min_value) {
  char* end = nullptr;
  const long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || v < min_value || v > (1l << 30))
    throw std::invalid_argument(flag + ": expected an integer >= " + std::to_string(min_value) +
                                ", got '" + value + "'");
  return int32_t(v);
}

// Appends the non-empty comma-separated items of `list` to *out.
inline void split_list(const std::string& list, std::vector<std::string>* out) {
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    if (comma > start) out->push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
}

inline void set_device(int device) {
  CHECK_CUDA(cudaSetDevice(device));
}

// Synchronous copy of `count` elements from device memory.
template <class T>
std::vector<T> download(const T* device_ptr, size_t count) {
  std::vector<T> host(count);
  if (count > 0)
    CHECK_CUDA(cudaMemcpy(host.data(), device_ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// cudaMalloc'd array on one device; freed on that device.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(int device, size_t count) : device_(device), count_(count) {
    set_device(device);
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    ptr_ = static_cast<T*>(p);
  }
  DeviceArray(int device, const std::vector<T>& host) : DeviceArray(device, host.size()) {
    if (!host.empty())
      CHECK_CUDA(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  DeviceArray(DeviceArray&& other) noexcept { *this = std::move(other); }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(device_, other.device_);
    std::swap(count_, other.count_);
    std::swap(ptr_, other.ptr_);
    return *this;
  }
  ~DeviceArray() {
    if (ptr_) {
      cudaSetDevice(device_);  // no throw in a destructor
      cudaFree(ptr_);
    }
  }
  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  std::vector<T> download(size_t count) const {
    if (count > count_) throw std::runtime_error("download past the end of a device array");
    return epbench::download(ptr_, count);
  }

 private:
  int device_ = 0;
  size_t count_ = 0;
  T* ptr_ = nullptr;
};

// Page-locked host array (the NCCL baseline's counts, read by the host after a stream sync).
template <class T>
class PinnedArray {
 public:
  explicit PinnedArray(size_t count) {
    void* p = nullptr;
    CHECK_CUDA(cudaHostAlloc(&p, std::max<size_t>(count, 1) * sizeof(T), cudaHostAllocPortable));
    ptr_ = static_cast<T*>(p);
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  ~PinnedArray() { cudaFreeHost(ptr_); }
  T* get() const { return ptr_; }
  T& operator[](size_t i) const { return ptr_[i]; }

 private:
  T* ptr_ = nullptr;
};

// One rank's inputs on its device (one of the rotated input sets).
struct DeviceInputs {
  const void* tokens = nullptr;       // [T, H] bf16
  const int32_t* topk_ids = nullptr;  // [T, K]
  const float* weights = nullptr;     // [T, K]
};

struct LocalRank {
  int rank = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
};

// The ranks this process drives. One-process mode: rank r = device r, every visible GPU.
// Multi-process mode (EPCOMM_RANK, EPCOMM_WORLD_SIZE, EPCOMM_BOOTSTRAP_DIR set): one rank, on
// device EPCOMM_LOCAL_RANK if set, else rank % (visible devices).
class Team {
 public:
  // One process: `ranks` ranks (0: one per visible GPU), rank r on GPU r % GPUs.
  static std::unique_ptr<Team> create(int ranks = 0);
  // More ranks than GPUs: ranks share GPUs (Config::share_gpus).
  int ranks_per_gpu() const { return ranks_per_gpu_; }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;
  ~Team();

  int n_ranks() const { return n_ranks_; }
  const std::vector<LocalRank>& local() const { return local_; }
  size_t n_local() const { return local_.size(); }
  bool multi_process() const { return bootstrap_ != nullptr; }
  bool root() const { return local_.front().rank == 0; }
  epcomm::Bootstrap* bootstrap() const { return bootstrap_.get(); }

  // Every rank's `per_rank` values in rank order; `local_values` holds n_local() * per_rank.
  std::vector<double> gather(const std::vector<double>& local_values, size_t per_rank) const;

 private:
  Team() = default;
  int n_ranks_ = 0;
  int ranks_per_gpu_ = 1;
  std::vector<LocalRank> local_;
  std::unique_ptr<epcomm::Bootstrap> bootstrap_;
};

// Calls f(i, local_rank) for every local rank with its device current.
template <class F>
void for_each_rank(const Team& team, F&& f) {
  for (size_t i = 0; i < team.n_local(); ++i) {
    set_device(team.local()[i].device);
    f(i, team.local()[i]);
  }
}

}  // namespace epbench
