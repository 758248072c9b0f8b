// Checks against the CPU reference model (epcomm/reference.h), and the logical byte counts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "epcomm/group.h"
#include "epcomm/reference.h"

namespace epbench {

struct Reference {
  std::vector<epcomm::reference::DispatchResult> dispatch;  // every rank (combine needs them all)
  std::vector<std::vector<double>> combine;  // per local rank: weighted [T, H], expert outputs =
                                             // the dispatched tokens themselves
};
Reference build_reference(const epcomm::reference::Problem& problem, const Team& team);

// Each returns "" when the output matches, else the first mismatch.
// epcomm's dispatch output of one rank, on the device.
std::string check_dispatch(const epcomm::reference::DispatchResult& ref,
                           const epcomm::DispatchOutput& out, int32_t num_groups,
                           int64_t max_recv_rows, int32_t hidden);
// An expert-major output without src_info (the NCCL baseline): same row_offsets, same rows in the
// same order, bit for bit.
std::string check_expert_major(const epcomm::reference::DispatchResult& ref,
                               const std::vector<uint32_t>& row_offsets,
                               const std::vector<uint16_t>& tokens, int32_t hidden);
// A weighted combine output [T, H] bf16 (host copy).
std::string check_combine(const std::vector<double>& ref, const std::vector<uint16_t>& out);

// Per rank: bytes of every (source token, this rank) message received, local ones included,
// counted once per distinct destination rank of a token: H * 2 bytes each.
std::vector<double> logical_bytes(const epcomm::reference::Problem& problem);

}  // namespace epbench
