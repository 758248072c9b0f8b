// Bootstraps over threads (the process version runs under epcomm_launch / mpirun: tests/mp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "epcomm/bootstrap.h"
#include "epcomm/error.h"

using namespace epcomm;

namespace {
// Every rank contributes (round, rank, bytes) patterns; checks every byte of every round.
void exercise(Bootstrap& b, int rounds, std::atomic<int>& failures) {
  for (int round = 0; round < rounds; ++round) {
    const size_t bytes = size_t(1 + (round * 37) % 300);
    std::vector<unsigned char> mine(bytes), all(bytes * size_t(b.size()), 0xee);
    for (size_t i = 0; i < bytes; ++i) mine[i] = (unsigned char)(round * 31 + b.rank() * 7 + i);
    b.all_gather(mine.data(), all.data(), bytes);
    for (int r = 0; r < b.size(); ++r)
      for (size_t i = 0; i < bytes; ++i)
        if (all[size_t(r) * bytes + i] != (unsigned char)(round * 31 + r * 7 + i)) ++failures;
  }
  b.barrier();
}
}  // namespace

TEST(Bootstrap, ThreadsAllGatherManyRounds) {
  for (int n : {1, 2, 5, 8}) {
    auto eps = make_thread_bootstraps(n);
    std::atomic<int> failures{0};
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r) ts.emplace_back([&, r] { exercise(*eps[size_t(r)], 50, failures); });
    for (auto& t : ts) t.join();
    EXPECT_EQ(failures.load(), 0) << n << " ranks";
  }
}

TEST(Bootstrap, ThreadsMissingRankTimesOut) {
  auto eps = make_thread_bootstraps(3, 0.3);
  std::atomic<int> errors{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)  // rank 2 never arrives
    ts.emplace_back([&, r] {
      int x = r, all[3];
      try {
        eps[size_t(r)]->all_gather(&x, all, sizeof(int));
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kBootstrap) ++errors;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors.load(), 2);
}

TEST(Bootstrap, ThreadsRankLeavingWakesOthers) {
  auto eps = make_thread_bootstraps(2, 30);
  std::atomic<bool> threw{false};
  std::thread t([&] {
    int x = 0, all[2];
    try {
      eps[0]->all_gather(&x, all, sizeof(int));
    } catch (const Error&) {
      threw = true;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  eps[1].reset();  // rank 1 goes away instead of joining
  t.join();
  EXPECT_TRUE(threw.load());
}

TEST(Bootstrap, FilesAllGatherAcrossThreads) {
  char tmpl[] = "/tmp/epcomm_fb_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const int n = 4;
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      FileBootstrap b(tmpl, r, n, 30);
      exercise(b, 20, failures);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(std::system((std::string("rm -rf ") + tmpl).c_str()), 0);
}

TEST(Bootstrap, FileMissingRankTimesOut) {
  char tmpl[] = "/tmp/epcomm_fb_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  FileBootstrap b(tmpl, 0, 2, 0.2);
  int x = 1, all[2];
  try {
    b.all_gather(&x, all, sizeof(int));
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(FileBootstrap(tmpl, 2, 2), Error);
  EXPECT_EQ(std::system((std::string("rm -rf ") + tmpl).c_str()), 0);
}
