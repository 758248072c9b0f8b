// The dispatch token formats (docs/design.md "Token formats") and the per-format facts every layer needs: the config,
// the message layout, the kernels, the CPU reference and the tests. Host and device.
//
//   format         codes per row        scale per     scale type    output scales
//   kBF16          H bf16 (2H bytes)    —             —             —
//   kFp8Blockwise  H e4m3               128 values    fp32          transposed [H/128, rows]
//   kNvfp4         H/2 (two e2m1/byte)  16 values     e4m3 (byte)   128x4 swizzled
//   kMxfp8         H e4m3               32 values     e8m0 (byte)   128x4 swizzled
//   kMxfp4         H/2 (two e2m1/byte)  32 values     e8m0 (byte)   row-major [rows, H/32]
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "epcomm/hd.h"

namespace epcomm {

enum class TokenFormat : int32_t {
  kBF16 = 0,
  kFp8Blockwise = 1,
  kNvfp4 = 2,
  kMxfp8 = 3,
  kMxfp4 = 4,
};
constexpr int32_t kNumTokenFormats = 5;

const char* token_format_name(TokenFormat f);
// The format whose token_format_name is `name`, or nullopt.
std::optional<TokenFormat> token_format_from_name(const std::string& name);
// Every format's name, quoted, comma-separated (for error messages).
std::string token_format_names();

// Values per scale (0 for bf16: no scales).
EPCOMM_HD constexpr int32_t format_scale_group(TokenFormat f) {
  switch (f) {
    case TokenFormat::kFp8Blockwise: return 128;
    case TokenFormat::kNvfp4: return 16;
    case TokenFormat::kMxfp8: return 32;
    case TokenFormat::kMxfp4: return 32;
    default: return 0;
  }
}
// Bytes of one stored scale: fp32 for blockwise FP8, one byte (e4m3 / e8m0 code) otherwise.
EPCOMM_HD constexpr int32_t format_scale_bytes(TokenFormat f) {
  return f == TokenFormat::kBF16 ? 0 : (f == TokenFormat::kFp8Blockwise ? 4 : 1);
}
// Bytes of one row's codes.
EPCOMM_HD constexpr int64_t format_row_bytes(TokenFormat f, int32_t hidden) {
  switch (f) {
    case TokenFormat::kBF16: return int64_t(hidden) * 2;
    case TokenFormat::kNvfp4:
    case TokenFormat::kMxfp4: return hidden / 2;
    default: return hidden;
  }
}
// Scales per row.
EPCOMM_HD constexpr int32_t format_scales_per_row(TokenFormat f, int32_t hidden) {
  const int32_t g = format_scale_group(f);
  return g == 0 ? 0 : hidden / g;
}
// Each group's rows are padded to a multiple of this (blockwise FP8: 4, so every group's piece
// of a transposed scale column is 16-byte aligned).
EPCOMM_HD constexpr int32_t format_row_align(TokenFormat f) {
  return f == TokenFormat::kFp8Blockwise ? 4 : 1;
}
EPCOMM_HD constexpr bool format_swizzled(TokenFormat f) {
  return f == TokenFormat::kNvfp4 || f == TokenFormat::kMxfp8;
}
// hidden must be a positive multiple of this: whole scale groups, and rows of codes that are
// whole 16-byte vectors (the kernels move codes 16 bytes at a time).
EPCOMM_HD constexpr int32_t format_hidden_multiple(TokenFormat f) {
  switch (f) {
    case TokenFormat::kFp8Blockwise: return 128;
    case TokenFormat::kNvfp4:
    case TokenFormat::kMxfp8:
    case TokenFormat::kMxfp4: return 32;
    default: return 8;
  }
}

}  // namespace epcomm
