#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <type_traits>

#include "epcomm/config.h"
#include "epcomm/error.h"
#include "epcomm/trace.h"

using namespace epcomm;

namespace {
Config good() {
  Config c;
  c.hidden = 7168;
  c.top_k = 8;
  c.n_experts = 256;
  c.max_tokens_per_rank = 128;
  return c;
}

// Expects validate() to throw kInvalidArgument naming `field`.
void expect_bad(const Config& c, int n_ranks, const char* field) {
  try {
    c.validate(n_ranks);
    FAIL() << "no error for bad " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}
// Expects check_configs_match to throw naming `field`; returns the error's code.
ErrorCode expect_mismatch(const Config* cs, int n_ranks, const char* field) {
  try {
    check_configs_match(cs, n_ranks);
    ADD_FAILURE() << "no mismatch reported for " << field;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    return e.code();
  }
  return ErrorCode::kOk;
}
}  // namespace

TEST(Config, AcceptsTheWorkloads) {
  EXPECT_NO_THROW(good().validate(8));
  Config c = good();
  c.hidden = 2880;
  c.top_k = 4;
  c.n_experts = 128;
  EXPECT_NO_THROW(c.validate(8));
  c.n_experts = 1024;
  c.top_k = 16;
  EXPECT_NO_THROW(c.validate(2));
}

TEST(Config, RejectsEachBadField) {
  Config c = good();
  c.hidden = 7170;
  expect_bad(c, 8, "hidden");
  c = good();
  c.hidden = 0;
  expect_bad(c, 8, "hidden");
  c = good();
  c.top_k = 17;
  expect_bad(c, 8, "top_k");
  c = good();
  c.top_k = 0;
  expect_bad(c, 8, "top_k");
  c = good();
  c.n_experts = 100;
  expect_bad(c, 8, "n_experts");
  c = good();
  c.n_experts = 2048;
  expect_bad(c, 8, "n_experts");
  c = good();
  c.max_tokens_per_rank = 0;
  expect_bad(c, 8, "max_tokens_per_rank");
  c = good();
  c.num_sms = 0;
  expect_bad(c, 8, "num_sms");
  c = good();
  c.timeout_seconds = 0;
  expect_bad(c, 8, "timeout_seconds");
  expect_bad(good(), 65, "n_ranks");
  expect_bad(good(), 0, "n_ranks");
  c = good();
  c.format = TokenFormat(7);
  expect_bad(c, 8, "format");
  c = good();
  c.format = TokenFormat::kFp8Blockwise;
  c.hidden = 2880;  // not whole 128-value scale blocks
  expect_bad(c, 8, "hidden");
  c.format = TokenFormat::kMxfp4;
  c.hidden = 2880 + 16;  // not whole 32-value blocks
  expect_bad(c, 8, "hidden");
  c = good();
  c.format = TokenFormat::kNvfp4;
  c.nvfp4_global_scale = 0.0f;
  expect_bad(c, 8, "nvfp4_global_scale");
  c.nvfp4_global_scale = 1.0f / 0.0f;
  expect_bad(c, 8, "nvfp4_global_scale");
  c = good();
  c.fp8_pow2_scales = true;  // power-of-two scales belong to blockwise FP8 only
  expect_bad(c, 8, "fp8_pow2_scales");
  c.format = TokenFormat::kMxfp8;
  expect_bad(c, 8, "fp8_pow2_scales");
  c.format = TokenFormat::kFp8Blockwise;
  EXPECT_NO_THROW(c.validate(8));
  c = good();
  c.ranks_per_node = 3;  // does not divide 8
  expect_bad(c, 8, "ranks_per_node");
  c.ranks_per_node = -1;
  expect_bad(c, 8, "ranks_per_node");
  c.ranks_per_node = 16;
  expect_bad(c, 8, "ranks_per_node");
  for (int rpn : {0, 1, 2, 4, 8}) {
    c.ranks_per_node = rpn;
    EXPECT_NO_THROW(c.validate(8)) << rpn;
  }
}

TEST(Config, MismatchedRanksPerNodeIsNamed) {
  Config a = good(), b = good();
  b.ranks_per_node = 4;
  const Config both[2] = {a, b};
  try {
    check_configs_match(both, 2);
    FAIL() << "no mismatch reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kConfigMismatch);
    EXPECT_NE(std::string(e.what()).find("ranks_per_node"), std::string::npos) << e.what();
  }
}

TEST(Config, SpansNodesOnlyWithTheNvshmemComponent) {
  EXPECT_EQ(spans_nodes_supported(), bool(EPCOMM_TEST_BUILT_WITH_NVSHMEM));
}

TEST(Config, AcceptsEveryFormatAtItsHiddenSizes) {
  for (TokenFormat f : {TokenFormat::kFp8Blockwise, TokenFormat::kNvfp4, TokenFormat::kMxfp8,
                        TokenFormat::kMxfp4}) {
    Config c = good();
    c.format = f;
    for (int h : {2048, 7168}) {
      c.hidden = h;
      EXPECT_NO_THROW(c.validate(8)) << token_format_name(f) << " H=" << h;
    }
    c.hidden = 2880;
    if (f == TokenFormat::kFp8Blockwise) {
      EXPECT_THROW(c.validate(8), Error);
    } else {
      EXPECT_NO_THROW(c.validate(8)) << token_format_name(f);
    }
  }
}

TEST(Config, MismatchedGlobalScaleIsNamed) {
  Config cs[2] = {good(), good()};
  cs[1].nvfp4_global_scale = 2.0f;
  expect_mismatch(cs, 2, "nvfp4_global_scale");
}

TEST(Config, MismatchNamesFieldAndRanks) {
  Config cs[3] = {good(), good(), good()};
  EXPECT_NO_THROW(check_configs_match(cs, 3));
  cs[2].top_k = 4;
  try {
    check_configs_match(cs, 3);
    FAIL() << "no mismatch reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kConfigMismatch);
    const std::string w = e.what();
    EXPECT_NE(w.find("top_k"), std::string::npos) << w;
    EXPECT_NE(w.find("rank 2"), std::string::npos) << w;
    EXPECT_NE(w.find("8"), std::string::npos) << w;
  }
  cs[2] = good();
  cs[1].timeout_seconds = 2;
  EXPECT_THROW(check_configs_match(cs, 3), Error);
}

// Every field of kConfigFields is compared across ranks: another value of any one field on one
// rank is reported, naming that field (the dispatch path by the path it resolves to). And the
// table names each field once.
TEST(Config, EveryFieldIsCompared) {
  std::set<std::string> names;
  int fields = 0;
  for_each_config_field([&](const auto& field) {
    ++fields;
    names.insert(field.name);
    SCOPED_TRACE(field.name);
    using T = std::decay_t<decltype(Config().*field.member)>;
    Config cs[3] = {good(), good(), good()};
    T& v = cs[2].*field.member;
    if constexpr (std::is_same_v<T, bool>)
      v = !v;
    else if constexpr (std::is_same_v<T, DispatchPath>)  // good() resolves kAuto to kThroughput
      v = DispatchPath::kLowLatency;
    else if constexpr (std::is_enum_v<T>)
      v = T(int32_t(v) + 1);
    else
      v = T(v + 1);
    if (field.same_on_every_rank)
      EXPECT_EQ(expect_mismatch(cs, 3, field.name), ErrorCode::kConfigMismatch);
    else
      EXPECT_NO_THROW(check_configs_match(cs, 3));  // a rank's own choice (trace)
    EXPECT_EQ(std::string(config_field_name(field.member)), field.name);
  });
  EXPECT_EQ(fields, int(kNumConfigFields));
  EXPECT_EQ(names.size(), kNumConfigFields);
}

TEST(Config, SizesCoverTheWorstCase) {
  const Sizes s = compute_sizes(good(), 8);
  EXPECT_EQ(s.n_local_experts, 32);
  EXPECT_EQ(s.num_groups, 32);
  EXPECT_EQ(s.max_recv_rows, 128 * 8 * 8);
  Config c = good();
  c.n_experts = 16;  // 2 local experts: a token lands in at most 2 rows of a rank
  EXPECT_EQ(compute_sizes(c, 8).max_recv_rows, 128 * 8 * 2);
}

// Every format's output sizes: rows with FP8's per-group padding, code bytes, scale bytes.
TEST(Config, SizesOfEachFormat) {
  Config c = good();  // 128 tokens, 8 ranks, K 8, 32 groups: 8192 routed rows
  const int64_t routed = 128 * 8 * 8;
  Sizes s = compute_sizes(c, 8);
  EXPECT_EQ(s.max_routed_rows, routed);
  EXPECT_EQ(s.token_bytes, 7168 * 2);
  EXPECT_EQ(s.scales_bytes, 0);
  EXPECT_EQ(s.num_scales_offsets, 0);

  c.format = TokenFormat::kFp8Blockwise;
  s = compute_sizes(c, 8);
  const int64_t fp8_rows = (routed + 3 * 32 + 3) / 4 * 4;  // up to 3 padding rows per group
  EXPECT_EQ(s.max_recv_rows, fp8_rows);
  EXPECT_EQ(s.token_bytes, 7168);
  EXPECT_EQ(s.scales_bytes, int64_t(7168 / 128) * fp8_rows * 4);
  EXPECT_EQ(s.num_scales_offsets, 0);

  c.format = TokenFormat::kNvfp4;
  s = compute_sizes(c, 8);
  EXPECT_EQ(s.max_recv_rows, routed);
  EXPECT_EQ(s.token_bytes, 7168 / 2);
  // (routed + 128 G) / 128 tiles of 128 rows x 4 scale columns, 7168 / 16 / 4 column tiles.
  EXPECT_EQ(s.scales_bytes, (routed + 128 * 32) / 128 * (7168 / 64) * 512);
  EXPECT_EQ(s.num_scales_offsets, 32);

  c.format = TokenFormat::kMxfp8;
  c.hidden = 2880;  // 90 scales per row: 23 column tiles, the last one half padding
  s = compute_sizes(c, 8);
  EXPECT_EQ(s.token_bytes, 2880);
  EXPECT_EQ(s.scales_bytes, (routed + 128 * 32) / 128 * 23 * 512);
  EXPECT_EQ(s.num_scales_offsets, 32);

  c.format = TokenFormat::kMxfp4;
  s = compute_sizes(c, 8);
  EXPECT_EQ(s.max_recv_rows, routed);
  EXPECT_EQ(s.token_bytes, 1440);
  EXPECT_EQ(s.scales_bytes, routed * 90);
  EXPECT_EQ(s.num_scales_offsets, 0);
}

// A receive cap replaces the worst case in every output size (FP8 pads on top of it), is
// validated, and must agree between ranks.
TEST(Config, ReceiveCapSizesTheOutputs) {
  Config c = good();  // worst case 128 * 8 * 8 = 8192 routed rows
  c.max_routed_rows = 1000;
  Sizes s = compute_sizes(c, 8);
  EXPECT_EQ(s.max_routed_rows, 1000);
  EXPECT_EQ(s.max_recv_rows, 1000);
  c.format = TokenFormat::kFp8Blockwise;
  s = compute_sizes(c, 8);
  EXPECT_EQ(s.max_recv_rows, (1000 + 3 * 32 + 3) / 4 * 4);
  EXPECT_EQ(s.scales_bytes, int64_t(7168 / 128) * s.max_recv_rows * 4);
  c.max_routed_rows = 1 << 20;  // above the worst case: the worst case stands
  EXPECT_EQ(compute_sizes(c, 8).max_routed_rows, 128 * 8 * 8);
  c.max_routed_rows = -1;
  try {
    c.validate(8);
    ADD_FAILURE() << "a negative max_routed_rows was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("max_routed_rows"), std::string::npos) << e.what();
  }
  Config cs[2] = {good(), good()};
  cs[1].max_routed_rows = 500;
  expect_mismatch(cs, 2, "max_routed_rows");
  cs[1] = good();
  cs[1].share_gpus = true;
  EXPECT_THROW(check_configs_match(cs, 2), Error);
}

// kAuto takes the low-latency path up to kLowLatencyMaxTokens tokens per rank with at least
// kLowLatencyMinSms SMs; asking for it above that many tokens is an error naming the field; the
// path is compared across ranks.
TEST(Config, DispatchPathResolvesAndIsChecked) {
  Config c = good();
  EXPECT_EQ(c.num_sms, 24);
  EXPECT_EQ(c.resolved_path(), DispatchPath::kThroughput);  // decode-sized, but 24 SMs
  c.num_sms = kLowLatencyMinSms - 1;
  EXPECT_EQ(c.resolved_path(), DispatchPath::kThroughput);
  c.num_sms = kLowLatencyMinSms;
  EXPECT_EQ(c.resolved_path(), DispatchPath::kLowLatency);
  c.max_tokens_per_rank = kLowLatencyMaxTokens + 1;
  EXPECT_EQ(c.resolved_path(), DispatchPath::kThroughput);
  EXPECT_NO_THROW(c.validate(8));
  c.dispatch_path = DispatchPath::kLowLatency;
  expect_bad(c, 8, "max_tokens_per_rank");
  c.max_tokens_per_rank = kLowLatencyMaxTokens;
  EXPECT_NO_THROW(c.validate(8));
  EXPECT_EQ(c.resolved_path(), DispatchPath::kLowLatency);
  c.dispatch_path = DispatchPath::kThroughput;
  EXPECT_EQ(c.resolved_path(), DispatchPath::kThroughput);
  c.dispatch_path = DispatchPath(7);
  expect_bad(c, 8, "dispatch_path");

  Config cs[2] = {good(), good()};
  cs[1].dispatch_path = DispatchPath::kThroughput;  // what kAuto resolves to here: no mismatch
  EXPECT_NO_THROW(check_configs_match(cs, 2));
  cs[1].dispatch_path = DispatchPath::kLowLatency;
  EXPECT_EQ(expect_mismatch(cs, 2, "dispatch_path"), ErrorCode::kConfigMismatch);
}

// Every format and path is found by its name and only by it; the names list each once.
TEST(Config, NamesRoundTrip) {
  for (int32_t f = 0; f < kNumTokenFormats; ++f) {
    const char* name = token_format_name(TokenFormat(f));
    ASSERT_EQ(token_format_from_name(name), std::optional<TokenFormat>(TokenFormat(f))) << name;
    EXPECT_NE(token_format_names().find(std::string("'") + name + "'"), std::string::npos);
  }
  for (int32_t p = 0; p < kNumDispatchPaths; ++p) {
    const char* name = dispatch_path_name(DispatchPath(p));
    ASSERT_EQ(dispatch_path_from_name(name), std::optional<DispatchPath>(DispatchPath(p))) << name;
    EXPECT_NE(dispatch_path_names().find(std::string("'") + name + "'"), std::string::npos);
  }
  EXPECT_EQ(token_format_names(), "'bf16', 'fp8-blockwise', 'nvfp4', 'mxfp8', 'mxfp4'");
  EXPECT_EQ(dispatch_path_names(), "'auto', 'throughput', 'low-latency'");
  for (const char* bad : {"", "BF16", "fp8", "bf16 ", "unknown"}) {
    EXPECT_FALSE(token_format_from_name(bad).has_value()) << bad;
    EXPECT_FALSE(dispatch_path_from_name(bad).has_value()) << bad;
  }
}

// The modes of docs/design.md "Modes": the shared expert takes a top-k slot; allreduce_world_size is at most
// the group; every mode field must agree between ranks; the sizes count the shared group and
// skip_a2a's single source.
TEST(Config, ModesAreCheckedAndSized) {
  Config c = good();
  c.shared_expert = true;
  EXPECT_NO_THROW(c.validate(8));
  c.top_k = 16;
  expect_bad(c, 8, "top_k");
  c.top_k = 15;
  EXPECT_NO_THROW(c.validate(8));
  c.n_experts = 1024;  // 1025 groups on one rank: more than a dispatch scans
  expect_bad(c, 1, "n_experts");
  EXPECT_NO_THROW(c.validate(2));
  c = good();
  c.skip_a2a = true;
  c.allreduce_world_size = 9;
  expect_bad(c, 8, "allreduce_world_size");
  c.allreduce_world_size = -1;
  expect_bad(c, 8, "allreduce_world_size");
  c.allreduce_world_size = 4;
  EXPECT_NO_THROW(c.validate(8));

  Config cs[2] = {good(), good()};
  cs[1].shared_expert = true;
  EXPECT_EQ(expect_mismatch(cs, 2, "shared_expert"), ErrorCode::kConfigMismatch);
  cs[1] = good();
  cs[1].skip_a2a = true;
  EXPECT_EQ(expect_mismatch(cs, 2, "skip_a2a"), ErrorCode::kConfigMismatch);
  cs[0].skip_a2a = cs[1].skip_a2a = true;
  cs[1].allreduce_world_size = 2;
  EXPECT_EQ(expect_mismatch(cs, 2, "allreduce_world_size"), ErrorCode::kConfigMismatch);

  c = good();  // 256 experts, K 8, 128 tokens
  c.shared_expert = true;
  Sizes s = compute_sizes(c, 8);
  EXPECT_EQ(s.n_local_experts, 32);
  EXPECT_EQ(s.num_groups, 33);
  EXPECT_EQ(s.max_routed_rows, 128 * 8 * 8 + 128);
  c.skip_a2a = true;
  s = compute_sizes(c, 8);
  EXPECT_EQ(s.num_groups, 33);
  EXPECT_EQ(s.max_routed_rows, 128 * 8 + 128);
  c.shared_expert = false;
  s = compute_sizes(c, 8);
  EXPECT_EQ(s.num_groups, 32);
  EXPECT_EQ(s.max_routed_rows, 128 * 8);
}

// The wait bound's default does not abort healthy jobs whose peers arrive late, and the
// environment sets it (a bad value is reported naming the variable).
TEST(Config, TimeoutDefaultAndEnvironment) {
  const char* saved = std::getenv("EPCOMM_TIMEOUT_SECONDS");
  const std::string keep = saved ? saved : "";
  unsetenv("EPCOMM_TIMEOUT_SECONDS");
  EXPECT_EQ(Config{}.timeout_seconds, kDefaultTimeoutSeconds);
  EXPECT_GE(kDefaultTimeoutSeconds, 60.0);
  setenv("EPCOMM_TIMEOUT_SECONDS", "1800", 1);
  EXPECT_EQ(Config{}.timeout_seconds, 1800.0);
  Config c = good();
  c.validate(2);
  setenv("EPCOMM_TIMEOUT_SECONDS", " 45 ", 1);
  EXPECT_EQ(Config{}.timeout_seconds, 45.0);
  for (const char* bad : {"0x1e", "inf", "30 s", "1e400"}) {
    setenv("EPCOMM_TIMEOUT_SECONDS", bad, 1);
    EXPECT_TRUE(std::isnan(Config{}.timeout_seconds)) << bad;
  }
  setenv("EPCOMM_TIMEOUT_SECONDS", "30min", 1);
  Config bad = good();
  EXPECT_TRUE(std::isnan(bad.timeout_seconds));
  try {
    bad.validate(2);
    ADD_FAILURE() << "a timeout of NaN accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("EPCOMM_TIMEOUT_SECONDS = '30min'"), std::string::npos)
        << e.what();
  }
  if (saved) setenv("EPCOMM_TIMEOUT_SECONDS", keep.c_str(), 1);
  else unsetenv("EPCOMM_TIMEOUT_SECONDS");
}

// The padded layout's fields: checked against the format, the capacity a group needs, and what
// UE8M0 words need; and the sizes they give (packed rows, no FP8 padding; G * C slots).
TEST(Config, PaddedLayoutIsCheckedAndSized) {
  Config c = good();  // 8 ranks x 128 tokens: a group receives at most 1024 rows
  c.padded_capacity = 1024;
  EXPECT_NO_THROW(c.validate(8));
  c.padded_capacity = 1023;
  expect_bad(c, 8, "padded_capacity");
  c.padded_capacity = -1;
  expect_bad(c, 8, "padded_capacity");
  c.padded_capacity = (int64_t(1) << 31) / 32;  // G * C must stay below 2^31
  expect_bad(c, 8, "padded_capacity");
  c.padded_capacity = 1024;
  c.format = TokenFormat::kNvfp4;  // swizzled scales: not in the padded layout
  expect_bad(c, 8, "format");
  c.format = TokenFormat::kMxfp4;
  expect_bad(c, 8, "format");
  c = good();
  c.skip_a2a = true;  // every token stays: a group receives at most max_tokens_per_rank rows
  c.padded_capacity = 128;
  EXPECT_NO_THROW(c.validate(8));

  c = good();
  c.format = TokenFormat::kFp8Blockwise;
  c.fp8_ue8m0_scales = true;
  expect_bad(c, 8, "fp8_ue8m0_scales");  // needs the padded layout and power-of-two scales
  c.padded_capacity = 1024;
  expect_bad(c, 8, "fp8_ue8m0_scales");
  c.fp8_pow2_scales = true;
  EXPECT_NO_THROW(c.validate(8));
  c.hidden = 7168 - 128;  // not whole 512-value words
  expect_bad(c, 8, "fp8_ue8m0_scales");

  c = good();
  c.format = TokenFormat::kFp8Blockwise;
  const Sizes packed = compute_sizes(c, 8);
  c.padded_capacity = 1024;
  const Sizes s = compute_sizes(c, 8);
  EXPECT_EQ(s.max_recv_rows, s.max_routed_rows);  // no padding rows
  EXPECT_GT(packed.max_recv_rows, packed.max_routed_rows);
  EXPECT_EQ(s.token_bytes, packed.token_bytes);
  EXPECT_EQ(s.scales_bytes, int64_t(32) * 56 * 1024 * 4);  // [G, H/128, C] fp32
  c.fp8_pow2_scales = c.fp8_ue8m0_scales = true;
  EXPECT_EQ(compute_sizes(c, 8).scales_bytes, int64_t(32) * 14 * 1024 * 4);  // [G, H/512, C]
}

// The benchmark prints each stage mark by its name and its JSON keys are those names: every mark
// has one of its own.
TEST(Trace, EveryMarkHasItsOwnName) {
  std::set<std::string> names;
  for (int m = 0; m < kTraceMarks; ++m) {
    const std::string name = trace_mark_name(TraceMark(m));
    EXPECT_NE(name, "unknown") << "mark " << m;
    EXPECT_TRUE(names.insert(name).second) << "mark " << m << " repeats '" << name << "'";
  }
  EXPECT_EQ(std::string(trace_mark_name(kTraceMarks)), "unknown");
  // The send form clears [start, recv start), the receive form [recv start, marks): each new
  // mark sits in the half whose form stamps it.
  EXPECT_LT(kTraceMetaSent, kTraceRecvStart);
  EXPECT_LT(kTraceFenced, kTraceRecvStart);
  EXPECT_GT(kTraceCountsIn, kTraceRecvStart);
  EXPECT_GT(kTraceChecked, kTraceRecvStart);
}
