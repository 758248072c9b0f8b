#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#include "timing.h"

namespace epbench {
namespace {

constexpr unsigned long long kGateTimeoutNs = 10ull * 1000 * 1000 * 1000;

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until word[0] reaches `ticket` (tickets grow; the difference is taken mod 2^32).
__global__ void gate_kernel(volatile uint32_t* word, uint32_t ticket) {
  const unsigned long long start = global_timer_ns();
  while (int32_t(word[0] - ticket) < 0) {
    if (global_timer_ns() - start > kGateTimeoutNs) {
      atomicAdd_system(const_cast<uint32_t*>(word) + 1, 1u);
      return;
    }
    __nanosleep(256);
  }
}

std::vector<int> local_devices(const Team& team) {
  std::vector<int> devices;
  for (const LocalRank& r : team.local())
    devices.push_back(r.device);
  return devices;
}

}  // namespace

Gate::Gate(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  void* p = nullptr;
  CHECK_CUDA(cudaHostAlloc(&p, 2 * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable));
  word_ = static_cast<uint32_t*>(p);
  word_[0] = 0;
  word_[1] = 0;
}

Gate::~Gate() {
  if (word_) cudaFreeHost(word_);
}

void Gate::hold(cudaStream_t stream) {
  if (!enabled_) return;
  uint32_t* device_word = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_word), word_, 0));
  gate_kernel<<<1, 1, 0, stream>>>(device_word, next_ticket_);
  CHECK_CUDA(cudaGetLastError());
}

void Gate::release() {
  if (!enabled_) return;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<volatile uint32_t*>(word_)[0] = next_ticket_++;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void Gate::check() const {
  if (enabled_ && reinterpret_cast<volatile uint32_t*>(word_)[1] != 0)
    throw std::runtime_error(
        "a timing gate was not released within 10 s: the host blocked while streams were held "
        "(a host synchronisation inside a call?)");
}

L2Flush::L2Flush(const Team& team, bool enabled) : L2Flush(local_devices(team), enabled) {}

L2Flush::L2Flush(const std::vector<int>& devices, bool enabled) {
  if (!enabled) return;
  for (int device : devices) {
    int l2 = 0;
    CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    bytes_ = std::max(bytes_, 4 * size_t(std::max(l2, 16 << 20)));
  }
  for (int device : devices)
    buffers_.emplace_back(device, bytes_);
}

void L2Flush::run(size_t local_index, cudaStream_t stream) {
  if (buffers_.empty()) return;
  CHECK_CUDA(cudaMemsetAsync(buffers_[local_index].get(), 0x5a, bytes_, stream));
}

Events::Events(int device, int count) : device_(device), events_(size_t(count), nullptr) {
  set_device(device);
  for (cudaEvent_t& e : events_)
    CHECK_CUDA(cudaEventCreate(&e));
}

Events::Events(Events&& other) noexcept : device_(other.device_) {
  events_.swap(other.events_);
}

Events::~Events() {
  if (events_.empty()) return;
  cudaSetDevice(device_);
  for (cudaEvent_t e : events_)
    cudaEventDestroy(e);
}

void Events::record(int i, cudaStream_t stream) {
  CHECK_CUDA(cudaEventRecord(events_.at(size_t(i)), stream));
}

float Events::elapsed_us(int from, int to) const {
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, events_.at(size_t(from)), events_.at(size_t(to))));
  return ms * 1000.0f;
}

Stats summarize(std::vector<float> samples_us) {
  if (samples_us.empty()) return Stats{};
  std::sort(samples_us.begin(), samples_us.end());
  const size_t n = samples_us.size();
  const double median =
      n % 2 ? samples_us[n / 2] : 0.5 * (double(samples_us[n / 2 - 1]) + samples_us[n / 2]);
  return Stats{median, samples_us.front(), samples_us.back()};
}

}  // namespace epbench
