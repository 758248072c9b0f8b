// The NCCL baseline: dispatch and combine the way users do them without an EP library (docs/performance.md),
// one row per (token, k), no deduplication per destination rank. A row is the token's message in
// the dispatch format (MessageFormat: bf16, or codes then scales, zero-padded to 16 bytes). Per
// rank:
//
// dispatch
//   0. quantised formats: quantise every token once into its message (quantize_messages, the same
//      block quantisers as epcomm's dispatch and the reference encoders);
//   1. rank every (token, k) row within its expert, stably in token order (one block per expert),
//      and gather the rows into a send buffer sorted by expert, hence by destination rank;
//   2. exchange the per-expert counts (grouped ncclSend/ncclRecv), copy them to the host and wait
//      for them: the host needs the split sizes (users do the same);
//   3. grouped ncclSend/ncclRecv of the rows (sources land one after the other, each sorted by
//      local expert, then token);
//   4. permute into expert-major order: group g, by source rank, then by source token, i.e. the
//      order of epcomm's dispatch output, so both compare exactly with the CPU reference.
// combine
//   the inverse permutation, grouped ncclSend/ncclRecv of the rows back to their source, then the
//   weighted sum of each token's rows in fp32 (k ascending) into [T, H] bf16. No host wait: the
//   split sizes are those of the dispatch. Rows are bf16 expert outputs in every format: the
//   dispatch output itself for bf16, synthetic_expert_value at the dispatch output's rows for a
//   quantised format (filled once at set-up).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "formats.h"

namespace epbench {

[[noreturn]] inline void throw_nccl_error(ncclResult_t res, const char* expr, const char* file,
                                          int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + expr +
                           " failed: " + ncclGetErrorString(res));
}

#define CHECK_NCCL(expr)                                                       \
  do {                                                                         \
    ncclResult_t check_nccl_res_ = (expr);                                     \
    if (check_nccl_res_ != ncclSuccess)                                        \
      ::epbench::throw_nccl_error(check_nccl_res_, #expr, __FILE__, __LINE__); \
  } while (0)

std::string nccl_version_string();

// One communicator per local rank. One process: ncclCommInitAll over every GPU; multi-process:
// rank 0's unique id shared through the bootstrap's all_gather.
class NcclComms {
 public:
  explicit NcclComms(const Team& team);
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;
  ~NcclComms();
  ncclComm_t operator[](size_t local_index) const { return comms_[local_index]; }

 private:
  std::vector<ncclComm_t> comms_;
};

struct BaselineShape {
  int32_t tokens = 0;  // T (every rank)
  int32_t hidden = 0;
  int32_t top_k = 0;
  int32_t n_experts = 0;
  int64_t capacity_rows = 0;  // rows a rank can receive (worst case)
  MessageFormat message;      // the dispatch rows' format (message.hidden == hidden)
};

// Where the benchmark puts its gate and events inside an operation.
struct TimingHooks {
  std::function<void(size_t)> begin;  // per local rank (device current), before the first GPU work
  std::function<void()> issued;       // once, when every rank's work up to a host wait is issued
  std::function<void(size_t)> end;    // per local rank, after the last GPU work
};

class NcclBaseline {
 public:
  NcclBaseline(const Team& team, const NcclComms& comms, const BaselineShape& shape);
  ~NcclBaseline();

  // `inputs[i]`: local rank i's inputs. combine uses the weights of the same inputs as the last
  // dispatch and the dispatch output as the expert outputs. Each returns after every rank's work
  // is issued (dispatch has waited on the host for the counts in between).
  void dispatch(const std::vector<DeviceInputs>& inputs, const TimingHooks& hooks);
  void combine(const std::vector<DeviceInputs>& inputs, const TimingHooks& hooks);

  // Results of local rank i (its stream synchronised).
  std::vector<uint32_t> row_offsets(size_t i) const;  // [G + 1]
  // The first `rows` expert-major dispatch rows, message.row_bytes() bytes each.
  std::vector<uint8_t> dispatch_rows(size_t i, int64_t rows) const;
  std::vector<uint16_t> combine_out(size_t i) const;  // [T, H]

 private:
  struct RankState;
  void exchange_rows(bool to_experts, int64_t row_bytes);

  const Team& team_;
  const NcclComms& comms_;
  BaselineShape shape_;
  int32_t n_local_experts_;
  std::vector<std::unique_ptr<RankState>> ranks_;
};

}  // namespace epbench
