#include <gtest/gtest.h>

#include "epcomm/config.h"
#include "epcomm/error.h"

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
  expect_bad(good(), 9, "n_ranks");
  expect_bad(good(), 0, "n_ranks");
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

TEST(Config, SizesCoverTheWorstCase) {
  const Sizes s = compute_sizes(good(), 8);
  EXPECT_EQ(s.n_local_experts, 32);
  EXPECT_EQ(s.num_groups, 32);
  EXPECT_EQ(s.max_recv_rows, 128 * 8 * 8);
  Config c = good();
  c.n_experts = 16;  // 2 local experts: a token lands in at most 2 rows of a rank
  EXPECT_EQ(compute_sizes(c, 8).max_recv_rows, 128 * 8 * 2);
}
