// How a figure is taken (docs/results/method.md): cudaEvents around each call on each rank's stream, an L2
// flush before every timed call, and a gate that makes every GPU start together.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "common.h"

namespace epbench {

// One process issues the calls of 8 GPUs one after the other, so without help rank 0 would start
// a collective call long before rank 7 and its time would include the host's issue latency.
// The gate holds streams at a point (a kernel spinning on a host-mapped word) until the host has
// issued every rank's work and calls release(). A hold gives up after 10 s (so a host error
// between hold and release cannot hang the GPUs); check() reports that. Disabled in the
// multi-process mode, where each process issues one GPU's work and the collective calls
// themselves keep the GPUs in step.
class Gate {
 public:
  explicit Gate(bool enabled);
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;
  ~Gate();
  void hold(cudaStream_t stream);  // on the current device, until the next release()
  void release();
  void check() const;

 private:
  bool enabled_;
  uint32_t* word_ = nullptr;  // host-mapped: [0] last released ticket, [1] holds that timed out
  uint32_t next_ticket_ = 1;
};

// Evicts the L2 cache by a memset of 4x its size, on each local rank's stream (or each of
// `devices`, in their order).
class L2Flush {
 public:
  // enabled = false (--no-flush): run() does nothing and bytes() is 0.
  explicit L2Flush(const Team& team, bool enabled = true);
  explicit L2Flush(const std::vector<int>& devices, bool enabled = true);
  void run(size_t local_index, cudaStream_t stream);
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
  std::vector<DeviceArray<uint8_t>> buffers_;
};

// A fixed set of timing events on one device.
class Events {
 public:
  Events(int device, int count);
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  Events(Events&& other) noexcept;
  ~Events();
  void record(int i, cudaStream_t stream);
  float elapsed_us(int from, int to) const;  // both recorded and complete

 private:
  int device_;
  std::vector<cudaEvent_t> events_;
};

struct Stats {
  double median_us = 0, min_us = 0, max_us = 0;
};
Stats summarize(std::vector<float> samples_us);

}  // namespace epbench
