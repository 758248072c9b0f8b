// Bootstraps over threads (the process version runs under epcomm_launch / mpirun: tests/mp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>
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

namespace {
std::string make_dir() {
  char tmpl[] = "/tmp/epcomm_fb_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return "";
  return tmpl;
}
// Each of n ranks (threads) contributes "<tag>-r<rank>" (7 bytes for tags of 4); rank r starts
// delay_ms[r] late. Returns what each rank gathered, or the error it threw.
std::vector<std::string> gather_tags(const std::string& dir, const std::string& tag, int n,
                                     std::vector<int> delay_ms, double timeout = 10,
                                     const std::string& job = "") {
  std::vector<std::string> got(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms[size_t(r)]));
      try {
        FileBootstrap b(dir, r, n, timeout, job);
        const std::string mine = tag + "-r" + std::to_string(r);
        std::string all(mine.size() * size_t(n), '?');
        b.all_gather(mine.data(), &all[0], mine.size());
        got[size_t(r)] = all;
      } catch (const Error& e) {
        got[size_t(r)] = std::string("error: ") + e.what();
      }
    });
  for (auto& t : ts) t.join();
  return got;
}
void put_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }
}  // namespace

// A restarted job reusing its directory: the new run never reads the old run's files.
TEST(Bootstrap, FileSecondRunNeverReadsTheFirst) {
  const std::string dir = make_dir();
  ASSERT_FALSE(dir.empty());
  const std::vector<std::string> run1(2, "run1-r0run1-r1"), run2(2, "run2-r0run2-r1");
  EXPECT_EQ(gather_tags(dir, "run1", 2, {0, 0}), run1);
  {  // rank 0 of the next run alone: a timeout naming rank 1, not the old run's rank-1 bytes
    FileBootstrap b(dir, 0, 2, 0.3);
    const std::string mine = "run2-r0";
    std::string all(14, '?');
    try {
      b.all_gather(mine.data(), &all[0], mine.size());
      FAIL() << "rank 0 alone completed an all-gather: " << all;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
      EXPECT_NE(std::string(e.what()).find("rank 1 did not join"), std::string::npos)
          << e.what();
    }
  }
  // The next run, rank 1 arriving late, then rank 0 late: each time only this run's bytes.
  EXPECT_EQ(gather_tags(dir, "run2", 2, {0, 300}), run2);
  EXPECT_EQ(gather_tags(dir, "run3", 2, {300, 0}),
            (std::vector<std::string>(2, "run3-r0run3-r1")));
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// A run that died in its handshake left join, announcement and ack files behind, and a rank of
// an earlier run is still writing its all-gather files: the new run reads none of them.
TEST(Bootstrap, FileStaleFilesAndOldWriterIgnored) {
  const std::string dir = make_dir();
  ASSERT_FALSE(dir.empty());
  put_file(dir + "/join_r1", "00000000000000aa");
  put_file(dir + "/run", "00000000000000bb 00000000000000aa");
  put_file(dir + "/ack_r1", "00000000000000bb 00000000000000aa");
  put_file(dir + "/00000000000000bb.g0_r1", "old-r1!");
  std::atomic<bool> stop{false};
  std::thread old_writer([&] {  // keeps rewriting an old run's files of every generation
    for (int g = 0; !stop; g = (g + 1) % 64)
      put_file(dir + "/00000000000000bb.g" + std::to_string(g) + "_r1", "old-r1!");
  });
  EXPECT_EQ(gather_tags(dir, "newA", 2, {0, 200}),
            (std::vector<std::string>(2, "newA-r0newA-r1")));
  std::atomic<int> failures{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      FileBootstrap b(dir, r, 3, 30);
      exercise(b, 20, failures);
      EXPECT_EQ(b.run_id().size(), 16u);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  stop = true;
  old_writer.join();
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// Jobs named by their launcher never meet: two at once in one directory each gather their own
// bytes, and an earlier job's rank 0 still waiting in its handshake (its peers gone) takes in
// no rank of the next job (without names it could).
TEST(Bootstrap, FileNamedJobsAreIsolated) {
  const std::string dir = make_dir();
  ASSERT_FALSE(dir.empty());
  std::vector<std::string> a, b;
  std::thread ta([&] { a = gather_tags(dir, "jobA", 3, {0, 50, 100}, 10, "A"); });
  std::thread tb([&] { b = gather_tags(dir, "jobB", 3, {100, 0, 50}, 10, "B"); });
  ta.join();
  tb.join();
  EXPECT_EQ(a, std::vector<std::string>(3, "jobA-r0jobA-r1jobA-r2"));
  EXPECT_EQ(b, std::vector<std::string>(3, "jobB-r0jobB-r1jobB-r2"));
  std::string stale;
  std::thread old_rank0([&] {  // job "old" lost rank 1; its rank 0 waits in the handshake
    try {
      FileBootstrap o(dir, 0, 2, 1.0, "old");
      char mine = 'o', all[2];
      o.all_gather(&mine, all, 1);
      stale = "completed with rank 1's byte " + std::string(1, all[1]);
    } catch (const Error& e) {
      stale = std::string("error: ") + e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(gather_tags(dir, "newY", 2, {0, 0}, 10, "new"),
            (std::vector<std::string>(2, "newY-r0newY-r1")));
  old_rank0.join();
  EXPECT_NE(stale.find("error:"), std::string::npos) << stale;
  EXPECT_NE(stale.find("job old"), std::string::npos) << stale;
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}
