// epcomm_nvlink_probe: how fast can one GPU move bytes to (or from) its NVLink peers while every
// other GPU does the same, and by which transport? The question behind the prefill floors in
// docs/performance.md: the dispatch's send half moves its bytes with 16-byte SM stores at about
// 285 GB/s per GPU, and the bars need more.
//
// Every visible GPU takes part (one process, peer access between all). Each GPU holds, for each
// peer, `msgs` messages of `bytes` bytes; a configuration moves all of them at once, all GPUs
// started together by a gate in host memory, and is timed by device events (median of --iters).
// Transports:
//   st-push   warps load 16-byte vectors (8 in flight per lane) and store them into the peer
//   st-pull   warps load from the peer and store locally
//   tma-push  one lane per warp drives a ring of shared-memory slots: bulk copy global -> shared
//             (completing on an mbarrier), then bulk copy shared -> the peer's memory
//   tma-pull  the same ring, loading from the peer and storing locally
// Messages go to the peers interleaved (message i to peer rank + 1 + i % (n - 1)), as the
// dispatch's senders do. Every configuration's result is checked byte for byte.
//
// Usage: epcomm_nvlink_probe [--msgs N] [--bytes B] [--iters N] [--blocks 8,16,24]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "common.h"
#include "epcomm/detail/bulk.cuh"

using epbench::DeviceArray;

namespace {

constexpr int kMaxGpus = 8;

struct Args {
  const char* src[kMaxGpus];  // rank r's source: region d (msgs messages) is for rank d
  char* dst[kMaxGpus];        // rank r's destination: region s came from rank s
  int rank, n;
  long long msgs;  // messages per (source, destination) pair
  int bytes;       // per message, a multiple of 16
  int pull;        // 0: read local, write the peer; 1: read the peer, write local
  int slots;       // tma: ring slots per driving warp
};

// Message i of this rank: its source and destination addresses.
__device__ __forceinline__ void message(const Args& a, long long i, const char*& from, char*& to) {
  const int j = int(i % (a.n - 1));
  const long long k = i / (a.n - 1);
  const int peer = (a.rank + 1 + j) % a.n;
  const long long b = a.bytes;
  if (a.pull) {
    from = a.src[peer] + (a.rank * a.msgs + k) * b;
    to = a.dst[a.rank] + (peer * a.msgs + k) * b;
  } else {
    from = a.src[a.rank] + (peer * a.msgs + k) * b;
    to = a.dst[peer] + (a.rank * a.msgs + k) * b;
  }
}

__global__ void gate_kernel(const volatile int* flag) {
  while (*flag == 0) {
  }
}

__global__ void st_kernel(Args a) {
  const int lane = threadIdx.x % 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  const long long total = a.msgs * (a.n - 1);
  const int n_vec = a.bytes / 16;
  for (long long i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < total; i += warps) {
    const char* from;
    char* to;
    message(a, i, from, to);
    for (int v0 = 0; v0 < n_vec; v0 += 32 * 8) {
      uint4 buf[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int v = v0 + u * 32 + lane;
        if (v < n_vec) {
          const uint4* p = reinterpret_cast<const uint4*>(from) + v;
          if (a.pull)  // the peer's memory: a plain load
            asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(buf[u].x), "=r"(buf[u].y), "=r"(buf[u].z), "=r"(buf[u].w)
                         : "l"(p));
          else
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(buf[u].x), "=r"(buf[u].y), "=r"(buf[u].z), "=r"(buf[u].w)
                         : "l"(p));
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int v = v0 + u * 32 + lane;
        if (v < n_vec) reinterpret_cast<uint4*>(to)[v] = buf[u];
      }
    }
  }
}

__global__ void tma_kernel(Args a) {
  using namespace epcomm::detail;
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bar[64];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int S = a.slots;
  char* ring = smem + size_t(warp) * S * a.bytes;
  uint64_t* mb = bar + warp * S;
  if (lane == 0)
    for (int s = 0; s < S; ++s)
      mbar_init(mb + s);
  __syncthreads();
  if (lane != 0) return;

  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  const long long first = blockIdx.x * (blockDim.x / 32) + warp;
  const long long total = a.msgs * (a.n - 1);
  const long long mine = first < total ? (total - first + warps - 1) / warps : 0;
  bulk_ring_copy(
      ring, mb, S, a.bytes, mine,
      [&](int64_t q, char* slot, uint64_t* b) {
        const char* from;
        char* to;
        message(a, first + q * warps, from, to);
        mbar_expect(b, uint32_t(a.bytes));
        bulk_load(slot, from, uint32_t(a.bytes), b);
      },
      [&](int64_t q, const char* slot) {
        const char* from;
        char* to;
        message(a, first + q * warps, from, to);
        bulk_store(to, slot, uint32_t(a.bytes));
      });
}

uint32_t pattern(int rank, long long word) {
  uint64_t x = uint64_t(rank) * 0x9E3779B97F4A7C15ull + uint64_t(word) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return uint32_t(x * 0x94D049BB133111EBull >> 32);
}

// The pieces of one run: every GPU's buffers, streams and events, and the start gate.
struct Rig {
  int n = 0;
  size_t region = 0;  // bytes per (source, destination) pair
  std::vector<DeviceArray<char>> src, dst;
  std::vector<cudaStream_t> stream;
  std::vector<cudaEvent_t> ev0, ev1;
  int* gate = nullptr;  // mapped host memory: the gate kernels spin until it is 1
};

struct Transport {
  const char* name;
  bool tma, pull;
  int warps, slots;
};

// Median and min of `iters` runs (after 2 warm-up ones) of transport c on `blocks` blocks per
// GPU, each the slowest GPU's event time; then whether every destination holds its sources' bytes.
bool run(Rig& r, const Transport& c, int blocks, long long msgs, int bytes, int iters,
         double* median_us, double* min_us) {
  std::vector<float> times;
  for (int it = 0; it < iters + 2; ++it) {
    *reinterpret_cast<volatile int*>(r.gate) = 0;
    for (int d = 0; d < r.n; ++d) {
      epbench::set_device(d);
      if (it == 0) CHECK_CUDA(cudaMemsetAsync(r.dst[d].get(), 0xEE, r.dst[d].size(), r.stream[d]));
      gate_kernel<<<1, 1, 0, r.stream[d]>>>(r.gate);  // mapped, portable: valid on every GPU
      CHECK_CUDA(cudaEventRecord(r.ev0[d], r.stream[d]));
      Args a{};
      for (int q = 0; q < r.n; ++q) a.src[q] = r.src[q].get(), a.dst[q] = r.dst[q].get();
      a.rank = d, a.n = r.n, a.msgs = msgs, a.bytes = bytes, a.pull = c.pull, a.slots = c.slots;
      if (c.tma)
        tma_kernel<<<blocks, 32 * c.warps, size_t(c.warps) * c.slots * bytes, r.stream[d]>>>(a);
      else
        st_kernel<<<blocks, 32 * c.warps, 0, r.stream[d]>>>(a);
      CHECK_CUDA(cudaGetLastError());
      CHECK_CUDA(cudaEventRecord(r.ev1[d], r.stream[d]));
    }
    *reinterpret_cast<volatile int*>(r.gate) = 1;
    float worst = 0;
    for (int d = 0; d < r.n; ++d) {
      CHECK_CUDA(cudaEventSynchronize(r.ev1[d]));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, r.ev0[d], r.ev1[d]));
      worst = std::max(worst, ms);
    }
    if (it >= 2) times.push_back(worst * 1000.0f);
  }
  std::sort(times.begin(), times.end());
  *median_us = times[times.size() / 2];
  *min_us = times.front();
  // Rank d's region s must hold rank s's region d.
  for (int d = 0; d < r.n; ++d)
    for (int s = 0; s < r.n; ++s) {
      if (s == d) continue;
      const std::vector<uint32_t> h =
          epbench::download(reinterpret_cast<const uint32_t*>(r.dst[d].get() + s * r.region),
                            r.region / 4);
      const long long base = (long long)(d * r.region / 4);
      for (size_t w = 0; w < h.size(); ++w)
        if (h[w] != pattern(s, base + (long long)w)) return false;
    }
  return true;
}

int probe(int argc, char** argv) {
  long long msgs = 2048;
  int bytes = 14336, iters = 20;
  std::vector<int> blocks_list = {8, 16, 24, 32};
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc || (k != "--msgs" && k != "--bytes" && k != "--iters" && k != "--blocks")) {
      std::fprintf(stderr, "usage: %s [--msgs N] [--bytes B] [--iters N] [--blocks a,b,c]\n",
                   argv[0]);
      return 2;
    }
    const std::string v = argv[++i];
    if (k == "--msgs") msgs = epbench::parse_int(k, v, 1);
    if (k == "--bytes") bytes = epbench::parse_int(k, v, 16);
    if (k == "--iters") iters = epbench::parse_int(k, v, 1);
    if (k == "--blocks") {
      std::vector<std::string> items;
      epbench::split_list(v, &items);
      blocks_list.clear();
      for (const std::string& b : items) blocks_list.push_back(epbench::parse_int(k, b, 1));
    }
  }
  if (bytes % 16 != 0) {
    std::fprintf(stderr, "nvlink_probe: --bytes must be a multiple of 16\n");
    return 2;
  }
  Rig r;
  CHECK_CUDA(cudaGetDeviceCount(&r.n));
  if (r.n < 2) {
    std::printf("nvlink_probe: %d GPU(s) visible; needs at least 2\n", r.n);
    return 0;
  }
  r.n = std::min(r.n, kMaxGpus);
  r.region = size_t(msgs) * bytes;
  const size_t buf_bytes = r.region * r.n;
  r.stream.resize(r.n), r.ev0.resize(r.n), r.ev1.resize(r.n);
  for (int d = 0; d < r.n; ++d) {
    epbench::set_device(d);
    for (int q = 0; q < r.n; ++q)
      if (q != d) {
        const cudaError_t e = cudaDeviceEnablePeerAccess(q, 0);
        if (e != cudaErrorPeerAccessAlreadyEnabled) CHECK_CUDA(e);
      }
    std::vector<uint32_t> h(buf_bytes / 4);
    for (size_t w = 0; w < h.size(); ++w) h[w] = pattern(d, (long long)w);
    r.src.emplace_back(d, buf_bytes);
    CHECK_CUDA(cudaMemcpy(r.src[d].get(), h.data(), buf_bytes, cudaMemcpyHostToDevice));
    r.dst.emplace_back(d, buf_bytes);
    CHECK_CUDA(cudaStreamCreateWithFlags(&r.stream[d], cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventCreate(&r.ev0[d]));
    CHECK_CUDA(cudaEventCreate(&r.ev1[d]));
    CHECK_CUDA(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    220 * 1024));
  }
  CHECK_CUDA(cudaHostAlloc(&r.gate, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));

  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("nvlink_probe: %d x %s, %lld messages of %d B per (source, destination) pair, "
              "%.1f MB over NVLink per GPU per run, median of %d runs\n",
              r.n, prop.name, msgs, bytes, double(r.region) * (r.n - 1) / 1e6, iters);
  std::printf("%-9s %6s %6s %6s %10s %10s %10s  %s\n", "transport", "blocks", "warps", "slots",
              "median_us", "min_us", "GB/s/GPU", "check");

  std::vector<Transport> transports;
  const int max_slots_bytes = 200 * 1024;
  for (bool pull : {false, true}) {
    transports.push_back({pull ? "st-pull" : "st-push", false, pull, 16, 0});
    for (int w : {1, 2, 4}) {
      const int s = std::min(max_slots_bytes / (w * bytes), 64 / w);
      if (s >= 2) transports.push_back({pull ? "tma-pull" : "tma-push", true, pull, w, s});
    }
  }
  bool all_ok = true;
  for (const Transport& c : transports)
    for (int blocks : blocks_list) {
      double med = 0, lo = 0;
      const bool ok = run(r, c, blocks, msgs, bytes, iters, &med, &lo);
      all_ok = all_ok && ok;
      std::printf("%-9s %6d %6d %6d %10.1f %10.1f %10.1f  %s\n", c.name, blocks, c.warps,
                  c.slots, med, lo, double(r.region) * (r.n - 1) / (med * 1e3),
                  ok ? "ok" : "WRONG");
      std::fflush(stdout);
    }
  std::printf(all_ok ? "all checks passed\n" : "CHECK FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return probe(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nvlink_probe: %s\n", e.what());
    return 1;
  }
}
