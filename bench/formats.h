// The dispatch formats as the benchmark sees them (docs/design.md "Token formats"):
// - MessageFormat: one (token, destination rank) message of a format, codes then the token's
//   scales. Its size is what logical GB/s counts per message, and its rows (padded to 16 bytes)
//   are what the NCCL baseline quantises into and moves.
// - quantize_messages: the NCCL baseline's sender-side quantiser, built on the block quantisers of
//   epcomm/formats/codecs.h, so its codes and scales are the reference encoders' bit for bit.
// - synthetic_expert_value: the expert outputs combine reduces in the quantised workloads (their
//   dispatch output is not bf16, so it cannot serve as the expert output the way bf16's does).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "epcomm/layout.h"  // EPCOMM_HD, align_up
#include "epcomm/token_format.h"

namespace epbench {

struct MessageFormat {
  epcomm::TokenFormat format = epcomm::TokenFormat::kBF16;
  int32_t hidden = 0;
  float nvfp4_global_scale = 1.0f;  // NVFP4's gs (Config::nvfp4_global_scale)

  bool quantized() const { return format != epcomm::TokenFormat::kBF16; }
  // Codes of one token: bf16 2H; e4m3 H; two e2m1 per byte H / 2.
  int64_t codes_bytes() const { return epcomm::format_row_bytes(format, hidden); }
  // The token's scales in message order: fp32 per 128 values (blockwise FP8), one byte per 16
  // (NVFP4) or 32 (MXFP8, MXFP4) values; none for bf16.
  int64_t scales_bytes() const {
    return int64_t(epcomm::format_scales_per_row(format, hidden)) *
           epcomm::format_scale_bytes(format);
  }
  // One message: codes + scales (e.g. blockwise FP8: H + 4 H / 128). Logical GB/s counts this.
  int64_t bytes() const { return codes_bytes() + scales_bytes(); }
  // A row of the NCCL baseline's buffers: the message, zero-padded to 16 bytes (bf16: 2H).
  int64_t row_bytes() const { return epcomm::align_up(bytes(), 16); }
};

// Quantises `rows` bf16 tokens ([rows, hidden], 16-byte aligned) into messages of `m`, one row of
// m.row_bytes() bytes each at `out` (16-byte aligned): codes, then scales, in the layout
// reference::encode_* writes for one row. The padding bytes are not written (the caller zeroes
// them once). m must be a quantised format.
void quantize_messages(const MessageFormat& m, const void* tokens, int32_t rows, uint8_t* out,
                       cudaStream_t stream);

// bf16 bits of the synthetic expert output at (row, col) of rank `rank`'s dispatch output rows:
// |x| in [0.5, 2), random sign, from an integer hash, so host and device agree exactly. Never
// zero, so a padding row that combine failed to skip would show.
EPCOMM_HD uint16_t synthetic_expert_value(int32_t rank, int64_t row, int32_t col) {
  uint64_t z = uint64_t(rank) * 0x9e3779b97f4a7c15ull + uint64_t(row) * 0xd1b54a32d192ed03ull +
               uint64_t(uint32_t(col)) + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64's finaliser
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const uint32_t sign = uint32_t(z & 1u);
  const uint32_t exponent = 126u + uint32_t((z >> 1) & 1u);  // [0.5, 1) or [1, 2)
  const uint32_t mantissa = uint32_t((z >> 2) & 0x7fu);
  return uint16_t((sign << 15) | (exponent << 7) | mantissa);
}

// out[row * hidden + col] = synthetic_expert_value(rank, row, col) for rows [0, rows).
void fill_synthetic_expert_out(uint16_t* out, int32_t rank, int64_t rows, int32_t hidden,
                               cudaStream_t stream);

}  // namespace epbench
