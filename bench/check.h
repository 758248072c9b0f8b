// Checks against the CPU reference model (epcomm/reference.h, epcomm/formats/reference_codecs.h),
// and the logical byte counts.
//
// Expert outputs (what combine reduces): for bf16 the dispatched tokens themselves; for a
// quantised format, whose dispatch output is not bf16, synthetic_expert_value (formats.h) at the
// row of the dispatch output that holds them (epcomm's rows, padding rows included, or the NCCL
// baseline's own unpadded rows), the same on the host and on every device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "epcomm/config.h"
#include "epcomm/formats/reference_codecs.h"
#include "epcomm/group.h"
#include "epcomm/reference.h"
#include "formats.h"

namespace epbench {

struct Reference {
  MessageFormat message;
  // Every rank: reference::dispatch, bf16 rows without padding, which is the NCCL baseline's
  // layout (combine needs every rank's). For a quantised format its bf16 tokens are dropped once
  // used.
  std::vector<epcomm::reference::DispatchResult> dispatch;
  // Quantised formats, per local rank: what epcomm's dispatch must produce,
  // reference::dispatch_quantized, its codes cut to the rows in use [0, row_offsets[G]) (all
  // that reference::compare_dispatch_quantized reads of them).
  std::vector<epcomm::reference::QuantDispatchResult> quant;
  // Per local rank, weighted [T, H], token side: epcomm's combine (built when the run reduces on
  // the token side, or for bf16 with the NCCL baseline), and the NCCL baseline's (quantised
  // formats only: its expert outputs sit at other rows; for bf16 it is `combine`).
  std::vector<std::vector<double>> combine;
  std::vector<std::vector<double>> nccl_combine;
  // Per local rank, with the expert-side reduction: epcomm's combine as
  // reference::combine_expert_side gives it (empty when the run reduces on the token side).
  std::vector<std::vector<float>> combine_expert_side;
  // Quantised formats with the NCCL baseline, per source rank: its tokens' messages as the
  // reference encoders give them, [T, message.row_bytes()].
  std::vector<std::vector<uint8_t>> messages;
};
// Sizes are those of epcomm's group (max_routed_rows sizes the quantised output's layout).
// with_nccl: also build what the NCCL baseline's checks need; expert_side: epcomm's combine
// reduces on the expert side.
Reference build_reference(const epcomm::reference::Problem& problem, const Team& team,
                          const MessageFormat& message, const epcomm::Sizes& sizes, bool with_nccl,
                          bool expert_side);

// Each returns "" when the output matches, else the first mismatch.
// epcomm's dispatch output of local rank `local_index` (rank `rank`), on the device: bf16,
// row_offsets, expert_ids, src_info and the tokens of rows [0, row_offsets[G]) exactly
// (reference::compare_dispatch); a quantised format, downloaded and compared by
// reference::compare_dispatch_quantized (its sizes, row_offsets, expert_ids, src_info, codes,
// scales where defined and scales_offsets).
std::string check_dispatch(const Reference& ref, size_t local_index, int32_t rank,
                           const epcomm::DispatchOutput& out, const epcomm::Sizes& sizes);
// An expert-major output without src_info (the NCCL baseline, rows of message.row_bytes() bytes):
// reference::dispatch's row_offsets, and its rows in the same order byte for byte, each row being
// its source token's bf16 row or, for a quantised format, its reference-encoded message.
std::string check_expert_major(const Reference& ref, int32_t rank,
                               const std::vector<uint32_t>& row_offsets,
                               const std::vector<uint8_t>& rows);
// A weighted combine output [T, H] bf16 (host copy): token side, and expert side (bit-exact).
std::string check_combine(const std::vector<double>& ref, const std::vector<uint16_t>& out);
std::string check_combine_expert_side(const std::vector<float>& ref,
                                      const std::vector<uint16_t>& out);

// Per rank: (source token, this rank) messages received, local ones included, one per distinct
// destination rank of a token. Logical bytes are these times the bytes of one message.
std::vector<double> messages_received(const epcomm::reference::Problem& problem);

}  // namespace epbench
