#include <cuda_bf16.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <stdexcept>

#include "nccl_baseline.h"

namespace epbench {
namespace {

constexpr int kScanThreads = 256;
constexpr int kListThreads = 1024;  // one thread per expert or local expert (<= 1024 of them)
constexpr int kCopyThreads = 256;
constexpr int kCopySplit = 4;  // blocks per (source, group) segment

// Block e: the position of every token routed to expert e among those tokens, in token order
// (a block-wide scan per chunk of tokens: stable, no atomics), and their number.
__global__ void __launch_bounds__(kScanThreads)
    rank_in_expert(const int32_t* topk_ids, int32_t num_tokens, int32_t top_k,
                   int32_t* pos_in_expert, int32_t* expert_count) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int32_t e = int32_t(blockIdx.x);
  int32_t base = 0;
  for (int32_t t0 = 0; t0 < num_tokens; t0 += kScanThreads) {
    const int32_t t = t0 + int32_t(threadIdx.x);
    int32_t slot = -1;
    if (t < num_tokens)
      for (int32_t k = 0; k < top_k; ++k)
        if (topk_ids[int64_t(t) * top_k + k] == e) slot = k;
    int32_t pos = 0, total = 0;
    Scan(scan).ExclusiveSum(slot >= 0 ? 1 : 0, pos, total);
    __syncthreads();  // `scan` is reused by the next chunk
    if (slot >= 0) pos_in_expert[int64_t(t) * top_k + slot] = base + pos;
    base += total;
  }
  if (threadIdx.x == 0) expert_count[e] = base;
}

// offset[i] = count[0] + ... + count[i-1] for i <= n (n <= kListThreads).
__global__ void __launch_bounds__(kListThreads)
    exclusive_offsets(const int32_t* count, int32_t n, int32_t* offset) {
  using Scan = cub::BlockScan<int32_t, kListThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int32_t i = int32_t(threadIdx.x);
  int32_t excl = 0, total = 0;
  Scan(scan).ExclusiveSum(i < n ? count[i] : 0, excl, total);
  if (i < n) offset[i] = excl;
  if (i == 0) offset[n] = total;
}

// One warp per (token, k) entry: its row in the expert-sorted send buffer, and the copy.
__global__ void gather_send_rows(const uint4* tokens, const int32_t* topk_ids,
                                 const int32_t* pos_in_expert, const int32_t* expert_offset,
                                 int32_t entries, int32_t top_k, int32_t row_vecs, uint4* send_rows,
                                 int32_t* entry_row) {
  const int32_t lane = int32_t(threadIdx.x % 32);
  const int32_t n_warps = int32_t(gridDim.x * blockDim.x / 32);
  for (int32_t entry = int32_t((blockIdx.x * blockDim.x + threadIdx.x) / 32); entry < entries;
       entry += n_warps) {
    const int32_t e = topk_ids[entry];
    const int32_t row = e < 0 ? -1 : expert_offset[e] + pos_in_expert[entry];
    if (lane == 0) entry_row[entry] = row;
    if (row < 0) continue;
    const uint4* src = tokens + int64_t(entry / top_k) * row_vecs;
    uint4* dst = send_rows + int64_t(row) * row_vecs;
    for (int32_t v = lane; v < row_vecs; v += 32)
      dst[v] = src[v];
  }
}

// Thread g = local expert (group). recv_count is [source][group]. Received rows are source-major
// (each source's rows sorted by group); the output is group-major (each group's rows by source).
// seg_src / seg_dst [source][group]: first row of that segment in each order.
__global__ void __launch_bounds__(kListThreads)
    segment_bases(const int32_t* recv_count, int32_t n_ranks, int32_t n_local, int32_t* seg_src,
                  int32_t* seg_dst, uint32_t* row_offsets) {
  using Scan = cub::BlockScan<int32_t, kListThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int32_t g = int32_t(threadIdx.x);
  const bool active = g < n_local;
  int32_t source_base = 0, group_total = 0;
  for (int32_t s = 0; s < n_ranks; ++s) {
    const int32_t c = active ? recv_count[s * n_local + g] : 0;
    int32_t excl = 0, total = 0;
    Scan(scan).ExclusiveSum(c, excl, total);
    __syncthreads();
    if (active) seg_src[s * n_local + g] = source_base + excl;
    source_base += total;
    group_total += c;
  }
  int32_t group_base = 0, all_rows = 0;
  Scan(scan).ExclusiveSum(group_total, group_base, all_rows);
  if (!active) return;
  row_offsets[g] = uint32_t(group_base);
  if (g == 0) row_offsets[n_local] = uint32_t(all_rows);
  for (int32_t s = 0; s < n_ranks; ++s) {
    seg_dst[s * n_local + g] = group_base;
    group_base += recv_count[s * n_local + g];
  }
}

// Block x = segment (source, group), contiguous in both orders; to_experts: source-major ->
// expert-major, else back.
__global__ void __launch_bounds__(kCopyThreads)
    copy_segments(const uint4* from, uint4* to, const int32_t* recv_count, const int32_t* seg_src,
                  const int32_t* seg_dst, int32_t row_vecs, bool to_experts) {
  const int32_t seg = int32_t(blockIdx.x);
  const int64_t n = int64_t(recv_count[seg]) * row_vecs;
  const int64_t src = int64_t(to_experts ? seg_src[seg] : seg_dst[seg]) * row_vecs;
  const int64_t dst = int64_t(to_experts ? seg_dst[seg] : seg_src[seg]) * row_vecs;
  const int64_t stride = int64_t(gridDim.y) * blockDim.x;
  for (int64_t v = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; v < n; v += stride)
    to[dst + v] = from[src + v];
}

// Block t: out[t] = sum over unmasked k (ascending) of w[t,k] * rows[entry_row[t,k]], in fp32.
__global__ void weighted_sum(const uint4* rows, const int32_t* entry_row, const float* weights,
                             int32_t top_k, int32_t row_vecs, uint4* out) {
  const int64_t t = blockIdx.x;
  for (int32_t v = int32_t(threadIdx.x); v < row_vecs; v += int32_t(blockDim.x)) {
    float acc[8] = {};
    for (int32_t k = 0; k < top_k; ++k) {
      const int32_t row = entry_row[t * top_k + k];
      if (row < 0) continue;
      const float w = weights[t * top_k + k];
      const uint4 y = rows[int64_t(row) * row_vecs + v];
      const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&y);
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(y2[j]);
        acc[2 * j] = fmaf(w, f.x, acc[2 * j]);
        acc[2 * j + 1] = fmaf(w, f.y, acc[2 * j + 1]);
      }
    }
    uint4 r;
    __nv_bfloat162* r2 = reinterpret_cast<__nv_bfloat162*>(&r);
    for (int j = 0; j < 4; ++j)
      r2[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    out[t * row_vecs + v] = r;
  }
}

// Bytes of a row of the buffers both directions use: a dispatch message or a bf16 expert output.
size_t wide_row_bytes(const BaselineShape& s) {
  return size_t(std::max<int64_t>(s.message.row_bytes(), int64_t(s.hidden) * 2));
}

}  // namespace

std::string nccl_version_string() {
  int v = 0;
  CHECK_NCCL(ncclGetVersion(&v));
  const int major = v >= 10000 ? v / 10000 : v / 1000;
  const int minor = v >= 10000 ? v % 10000 / 100 : v % 1000 / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
}

NcclComms::NcclComms(const Team& team) : comms_(team.n_local(), nullptr) {
  if (!team.multi_process()) {
    std::vector<int> devices;
    for (const LocalRank& r : team.local())
      devices.push_back(r.device);
    CHECK_NCCL(ncclCommInitAll(comms_.data(), int(devices.size()), devices.data()));
    return;
  }
  ncclUniqueId id{};
  if (team.root()) CHECK_NCCL(ncclGetUniqueId(&id));
  std::vector<ncclUniqueId> ids(size_t(team.n_ranks()));
  team.bootstrap()->all_gather(&id, ids.data(), sizeof(id));
  set_device(team.local()[0].device);
  CHECK_NCCL(ncclCommInitRank(&comms_[0], team.n_ranks(), ids[0], team.local()[0].rank));
}

NcclComms::~NcclComms() {
  for (ncclComm_t c : comms_)
    if (c) ncclCommDestroy(c);
}

struct NcclBaseline::RankState {
  RankState(int device, int rank, const BaselineShape& s, int32_t n_ranks)
      : counts(device, 2 * size_t(s.n_experts)),
        expert_offset(device, size_t(s.n_experts) + 1),
        pos_in_expert(device, size_t(s.tokens) * s.top_k),
        entry_row(device, size_t(s.tokens) * s.top_k),
        send_rows(device, size_t(s.tokens) * s.top_k * wide_row_bytes(s)),
        recv_rows(device, size_t(s.capacity_rows) * wide_row_bytes(s)),
        expert_rows(device, size_t(s.capacity_rows) * size_t(s.message.row_bytes())),
        seg_src(device, size_t(s.n_experts)),
        seg_dst(device, size_t(s.n_experts)),
        row_offsets(device, size_t(s.n_experts / n_ranks) + 1),
        out(device, size_t(s.tokens) * s.hidden),
        host_counts(2 * size_t(s.n_experts)),
        send_count(size_t(n_ranks)),
        send_offset(size_t(n_ranks)),
        recv_count(size_t(n_ranks)),
        recv_offset(size_t(n_ranks)) {
    if (!s.message.quantized()) return;
    const size_t message_bytes = size_t(s.tokens) * size_t(s.message.row_bytes());
    messages = DeviceArray<uint8_t>(device, message_bytes);
    CHECK_CUDA(cudaMemset(messages.get(), 0, message_bytes));  // padding bytes stay zero
    expert_out = DeviceArray<uint16_t>(device, size_t(s.capacity_rows) * s.hidden);
    fill_synthetic_expert_out(expert_out.get(), rank, s.capacity_rows, s.hidden, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());  // before the rank's non-blocking stream uses them
  }

  // Rows sent to / received from each peer, from the counts the host just read.
  void set_split_sizes(int32_t n_experts, int32_t n_ranks, int64_t capacity_rows) {
    const int32_t n_local = n_experts / n_ranks;
    int64_t sent = 0, received = 0;
    for (int32_t p = 0; p < n_ranks; ++p) {
      send_count[p] = recv_count[p] = 0;
      for (int32_t g = 0; g < n_local; ++g) {
        send_count[p] += host_counts[size_t(p * n_local + g)];
        recv_count[p] += host_counts[size_t(n_experts + p * n_local + g)];
      }
      send_offset[p] = sent;
      recv_offset[p] = received;
      sent += send_count[p];
      received += recv_count[p];
    }
    if (received > capacity_rows)
      throw std::runtime_error("NCCL baseline: received " + std::to_string(received) +
                               " rows, more than the " + std::to_string(capacity_rows) +
                               " allocated");
  }

  DeviceArray<int32_t> counts;         // [2E]: own tokens per expert, then received [src][group]
  DeviceArray<int32_t> expert_offset;  // [E + 1]: first send row of each expert
  DeviceArray<int32_t> pos_in_expert;  // [T * K]
  DeviceArray<int32_t> entry_row;      // [T * K]: send row of (t, k), -1 = masked
  DeviceArray<uint8_t> messages;       // quantised: [T, row_bytes], each token's message
  DeviceArray<uint8_t> send_rows;      // [T * K] wide rows sorted by expert; combine receives here
  DeviceArray<uint8_t> recv_rows;      // [capacity] wide rows, source-major; combine sends these
  DeviceArray<uint8_t> expert_rows;    // [capacity, row_bytes] expert-major: the dispatch output
  DeviceArray<uint16_t> expert_out;    // quantised: [capacity, H] bf16, the expert outputs
  DeviceArray<int32_t> seg_src;        // [n_ranks * n_local]
  DeviceArray<int32_t> seg_dst;        // [n_ranks * n_local]
  DeviceArray<uint32_t> row_offsets;   // [G + 1]
  DeviceArray<uint16_t> out;           // [T, H] combine output
  PinnedArray<int32_t> host_counts;    // copy of `counts`
  std::vector<int64_t> send_count, send_offset, recv_count, recv_offset;  // rows, per peer
};

NcclBaseline::NcclBaseline(const Team& team, const NcclComms& comms, const BaselineShape& shape)
    : team_(team), comms_(comms), shape_(shape) {
  if (shape.hidden % 8 != 0) throw std::invalid_argument("NCCL baseline: hidden % 8 != 0");
  if (shape.n_experts > kListThreads || shape.n_experts % team.n_ranks() != 0)
    throw std::invalid_argument("NCCL baseline: n_experts must divide by n_ranks and be <= 1024");
  n_local_experts_ = shape.n_experts / team.n_ranks();
  if (shape.message.hidden != shape.hidden || shape.message.row_bytes() % 16 != 0)
    throw std::invalid_argument("NCCL baseline: message format does not match the shape");
  for (const LocalRank& r : team.local()) {
    set_device(r.device);
    ranks_.push_back(std::make_unique<RankState>(r.device, r.rank, shape, team.n_ranks()));
  }
}

NcclBaseline::~NcclBaseline() = default;

// Rows of `row_bytes` bytes (a dispatch message or a bf16 expert output), sent as bytes.
void NcclBaseline::exchange_rows(bool to_experts, int64_t row_bytes) {
  const size_t h = size_t(row_bytes);
  CHECK_NCCL(ncclGroupStart());
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    RankState& st = *ranks_[i];
    // Dispatch sends the expert-sorted rows and receives source-major rows; combine the reverse.
    uint8_t* send_base = to_experts ? st.send_rows.get() : st.recv_rows.get();
    uint8_t* recv_base = to_experts ? st.recv_rows.get() : st.send_rows.get();
    const auto& send_count = to_experts ? st.send_count : st.recv_count;
    const auto& send_offset = to_experts ? st.send_offset : st.recv_offset;
    const auto& recv_count = to_experts ? st.recv_count : st.send_count;
    const auto& recv_offset = to_experts ? st.recv_offset : st.send_offset;
    for (int p = 0; p < team_.n_ranks(); ++p) {
      if (send_count[p] > 0)
        CHECK_NCCL(ncclSend(send_base + send_offset[p] * h, send_count[p] * h, ncclUint8, p,
                            comms_[i], r.stream));
      if (recv_count[p] > 0)
        CHECK_NCCL(ncclRecv(recv_base + recv_offset[p] * h, recv_count[p] * h, ncclUint8, p,
                            comms_[i], r.stream));
    }
  });
  CHECK_NCCL(ncclGroupEnd());
}

void NcclBaseline::dispatch(const std::vector<DeviceInputs>& inputs, const TimingHooks& hooks) {
  const int32_t n_experts = shape_.n_experts, top_k = shape_.top_k;
  const int64_t row_bytes = shape_.message.row_bytes();
  const int32_t entries = shape_.tokens * top_k, row_vecs = int32_t(row_bytes / 16);
  const int gather_blocks = std::max(1, std::min((entries + 7) / 8, 4096));
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    RankState& st = *ranks_[i];
    hooks.begin(i);
    const void* rows = inputs[i].tokens;  // bf16: the tokens are the messages
    if (shape_.message.quantized()) {
      quantize_messages(shape_.message, inputs[i].tokens, shape_.tokens, st.messages.get(),
                        r.stream);
      rows = st.messages.get();
    }
    rank_in_expert<<<n_experts, kScanThreads, 0, r.stream>>>(
        inputs[i].topk_ids, shape_.tokens, top_k, st.pos_in_expert.get(), st.counts.get());
    exclusive_offsets<<<1, kListThreads, 0, r.stream>>>(st.counts.get(), n_experts,
                                                        st.expert_offset.get());
    gather_send_rows<<<gather_blocks, 256, 0, r.stream>>>(
        static_cast<const uint4*>(rows), inputs[i].topk_ids, st.pos_in_expert.get(),
        st.expert_offset.get(), entries, top_k, row_vecs,
        reinterpret_cast<uint4*>(st.send_rows.get()), st.entry_row.get());
    CHECK_CUDA(cudaGetLastError());
  });

  // Per-expert counts: local expert g of peer p is global expert p * n_local + g.
  const int32_t n_local = n_local_experts_;
  CHECK_NCCL(ncclGroupStart());
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    int32_t* counts = ranks_[i]->counts.get();
    for (int p = 0; p < team_.n_ranks(); ++p) {
      CHECK_NCCL(
          ncclSend(counts + p * n_local, size_t(n_local), ncclInt32, p, comms_[i], r.stream));
      CHECK_NCCL(ncclRecv(counts + n_experts + p * n_local, size_t(n_local), ncclInt32, p,
                          comms_[i], r.stream));
    }
  });
  CHECK_NCCL(ncclGroupEnd());
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    RankState& st = *ranks_[i];
    CHECK_CUDA(cudaMemcpyAsync(st.host_counts.get(), st.counts.get(),
                               2 * size_t(n_experts) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                               r.stream));
  });
  hooks.issued();
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    CHECK_CUDA(cudaStreamSynchronize(r.stream));
    ranks_[i]->set_split_sizes(n_experts, team_.n_ranks(), shape_.capacity_rows);
  });

  exchange_rows(true, row_bytes);
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    RankState& st = *ranks_[i];
    const int32_t* recv_count = st.counts.get() + n_experts;
    segment_bases<<<1, kListThreads, 0, r.stream>>>(recv_count, team_.n_ranks(), n_local,
                                                    st.seg_src.get(), st.seg_dst.get(),
                                                    st.row_offsets.get());
    copy_segments<<<dim3(unsigned(n_experts), kCopySplit), kCopyThreads, 0, r.stream>>>(
        reinterpret_cast<const uint4*>(st.recv_rows.get()),
        reinterpret_cast<uint4*>(st.expert_rows.get()), recv_count, st.seg_src.get(),
        st.seg_dst.get(), row_vecs, true);
    CHECK_CUDA(cudaGetLastError());
    hooks.end(i);
  });
}

void NcclBaseline::combine(const std::vector<DeviceInputs>& inputs, const TimingHooks& hooks) {
  const int32_t n_experts = shape_.n_experts, row_vecs = shape_.hidden / 8;  // bf16 rows
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    RankState& st = *ranks_[i];
    hooks.begin(i);
    const void* expert_out = shape_.message.quantized()
                                 ? static_cast<const void*>(st.expert_out.get())
                                 : static_cast<const void*>(st.expert_rows.get());
    copy_segments<<<dim3(unsigned(n_experts), kCopySplit), kCopyThreads, 0, r.stream>>>(
        static_cast<const uint4*>(expert_out), reinterpret_cast<uint4*>(st.recv_rows.get()),
        st.counts.get() + n_experts, st.seg_src.get(), st.seg_dst.get(), row_vecs, false);
    CHECK_CUDA(cudaGetLastError());
  });
  exchange_rows(false, int64_t(shape_.hidden) * 2);
  for_each_rank(team_, [&](size_t i, const LocalRank& r) {
    RankState& st = *ranks_[i];
    if (shape_.tokens > 0)
      weighted_sum<<<unsigned(shape_.tokens), 128, 0, r.stream>>>(
          reinterpret_cast<const uint4*>(st.send_rows.get()), st.entry_row.get(), inputs[i].weights,
          shape_.top_k, row_vecs, reinterpret_cast<uint4*>(st.out.get()));
    CHECK_CUDA(cudaGetLastError());
    hooks.end(i);
  });
  hooks.issued();
}

std::vector<uint32_t> NcclBaseline::row_offsets(size_t i) const {
  return ranks_[i]->row_offsets.download(size_t(n_local_experts_) + 1);
}

std::vector<uint8_t> NcclBaseline::dispatch_rows(size_t i, int64_t rows) const {
  return ranks_[i]->expert_rows.download(size_t(rows) * size_t(shape_.message.row_bytes()));
}

std::vector<uint16_t> NcclBaseline::combine_out(size_t i) const {
  return ranks_[i]->out.download(size_t(shape_.tokens) * size_t(shape_.hidden));
}

}  // namespace epbench
