// Multi-process tests: one process per GPU, joined by the file bootstrap (under epcomm_launch)
// or by MPI (under mpirun, when built with EPCOMM_TEST_WITH_MPI). Every rank checks its own
// results against the CPU reference; the verdicts are gathered so every rank prints the same
// summary. Exit 0: all passed; 77: skipped (too few GPUs); 1: a failure.
//   --bootstrap-only   only the bootstrap's all-gather (CPU)
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"
#include "harness.h"
#if EPCOMM_TEST_WITH_MPI
#include "epcomm/mpi_bootstrap.h"
#endif

using namespace epcomm;
using namespace epcomm::testing;

namespace {

struct Runner {
  Bootstrap& bs;
  int passed = 0, failed = 0;

  // Runs one named check on every rank; the check returns "" or a failure description.
  void check(const char* name, const std::function<std::string()>& body) {
    std::string err;
    try {
      err = body();
    } catch (const std::exception& e) {
      err = std::string("exception: ") + e.what();
    }
    int mine = err.empty() ? 0 : 1;
    std::vector<int> all(static_cast<size_t>(bs.size()));
    bs.all_gather(&mine, all.data(), sizeof(int));
    bool ok = true;
    for (int v : all) ok = ok && v == 0;
    if (!err.empty()) std::fprintf(stderr, "[rank %d] %s: %s\n", bs.rank(), name, err.c_str());
    if (bs.rank() == 0) std::printf("[%s] %s\n", ok ? "  PASSED  " : "  FAILED  ", name);
    (ok ? passed : failed)++;
  }
};

// One dispatch + combine round on this rank, checked against the reference.
std::string round(Group& g, RankIO& io, const reference::Problem& p, bool async,
                  uint64_t expert_seed) {
  const int rank = g.rank();
  io.upload(p.ranks[size_t(rank)]);
  io.poison();
  if (async) {
    g.dispatch_async(io.dispatch_input(), io.stream);
    g.dispatch_wait(io.dispatch_output(), io.stream);
  } else {
    g.dispatch(io.dispatch_input(), io.dispatch_output(), io.stream);
  }
  g.synchronize(io.stream);
  const auto refs = reference_dispatch_all(p);
  std::string e = io.check_dispatch(refs[size_t(rank)]);
  if (!e.empty()) return e;
  std::vector<std::vector<uint16_t>> y;
  for (int r = 0; r < p.n_ranks; ++r)
    y.push_back(expert_outputs(r, expert_seed, refs[size_t(r)].rows(), p.hidden));
  io.expert_seed = expert_seed;
  io.make_expert_out(refs[size_t(rank)].rows());
  for (bool weighted : {true, false}) {
    io.combine_out.fill(0xff, io.stream);
    if (async) {
      g.combine_async(io.combine_input(), io.stream);
      g.combine_wait(io.combine_output(weighted), io.stream);
    } else {
      g.combine(io.combine_input(), io.combine_output(weighted), io.stream);
    }
    g.synchronize(io.stream);
    e = io.check_combine(reference::combine(p, refs, y, rank, weighted), weighted);
    if (!e.empty()) return e;
  }
  return "";
}

int run_gpu_tests(Bootstrap& bs) {
  const int n = bs.size(), rank = bs.rank();
  int local_gpus = gpu_count();
  std::vector<int> all(static_cast<size_t>(n));
  bs.all_gather(&local_gpus, all.data(), sizeof(int));
  for (int v : all)
    if (v < n) {
      if (rank == 0)
        std::printf("[  SKIPPED ] multi-process GPU tests: need %d GPUs, found %d\n", n, v);
      return 77;
    }
  const char* lr = std::getenv("EPCOMM_LOCAL_RANK");
  const int device = lr ? std::atoi(lr) : rank % local_gpus;
  Runner run{bs};

  run.check("random rounds, fused and async+wait, several shapes", [&]() -> std::string {
    struct Shape { int H, K, E, T; };
    for (Shape s : {Shape{7168, 8, 32 * n, 128}, Shape{2880, 4, 16 * n, 300}, Shape{2048, 1, 8, 64}}) {
      auto g = Group::create(make_cfg(s.H, s.K, s.E, s.T), bs, device);
      RankIO io(*g);
      for (int it = 0; it < 6; ++it) {
        const uint64_t seed = 100 + uint64_t(it) + uint64_t(s.H);
        const auto p = reference::make_problem(n, s.H, s.K, s.E, random_counts(n, s.T, seed), seed, 0.0,
                                               it % 2 ? 0.2 : 0.0);
        const std::string e = round(*g, io, p, it % 2 == 1, seed);
        if (!e.empty()) return "H " + std::to_string(s.H) + " iteration " + std::to_string(it) + ": " + e;
      }
    }
    return "";
  });

  run.check("configuration mismatch names the field", [&]() -> std::string {
    Config c = make_cfg(2048, rank == n - 1 ? 4 : 8, 8 * n, 64);
    try {
      auto g = Group::create(c, bs, device);
      return "no error";
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kConfigMismatch) return std::string("wrong error: ") + e.what();
      if (std::string(e.what()).find("top_k") == std::string::npos)
        return std::string("field not named: ") + e.what();
    }
    return "";
  });

  run.check("a rank that never launches: timeout naming it, then a new group works",
            [&]() -> std::string {
    const int missing = n - 1;
    {
      auto g = Group::create(make_cfg(2048, 4, 8 * n, 64, 24, 1.0), bs, device);
      RankIO io(*g);
      const auto p = reference::make_problem(n, 2048, 4, 8 * n, random_counts(n, 64, 7), 7);
      io.upload(p.ranks[size_t(rank)]);
      if (rank != missing) {
        g->dispatch(io.dispatch_input(), io.dispatch_output(), io.stream);
        try {
          g->synchronize(io.stream);
          return "no timeout reported";
        } catch (const Error& e) {
          const std::string w = e.what();
          if (e.code() != ErrorCode::kTimeout) return "wrong error: " + w;
          if (w.find("rank(s) " + std::to_string(missing)) == std::string::npos)
            return "missing rank not named: " + w;
        }
      }
    }  // teardown on every rank
    auto g = Group::create(make_cfg(2048, 4, 8 * n, 64), bs, device);
    RankIO io(*g);
    const auto p = reference::make_problem(n, 2048, 4, 8 * n, random_counts(n, 64, 8), 8);
    return round(*g, io, p, false, 8);
  });

  if (rank == 0) std::printf("multi-process (%d ranks): %d passed, %d failed\n", n, run.passed, run.failed);
  return run.failed == 0 ? 0 : 1;
}

int run_bootstrap_tests(Bootstrap& bs) {
  int bad = 0;
  for (int round = 0; round < 30; ++round) {
    const size_t bytes = size_t(1 + (round * 53) % 500);
    std::vector<unsigned char> mine(bytes), all(bytes * size_t(bs.size()));
    for (size_t i = 0; i < bytes; ++i) mine[i] = (unsigned char)(round + bs.rank() * 13 + i);
    bs.all_gather(mine.data(), all.data(), bytes);
    for (int r = 0; r < bs.size(); ++r)
      for (size_t i = 0; i < bytes; ++i)
        if (all[size_t(r) * bytes + i] != (unsigned char)(round + r * 13 + i)) ++bad;
  }
  bs.barrier();
  std::printf("[rank %d] bootstrap all-gather over %d processes: %s\n", bs.rank(), bs.size(),
              bad ? "FAILED" : "passed");
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool bootstrap_only = argc > 1 && std::strcmp(argv[1], "--bootstrap-only") == 0;
#if EPCOMM_TEST_WITH_MPI
  MPI_Init(&argc, &argv);
  int rc = 1;
  {
    MpiBootstrap bs;
    char lr[16];
    std::snprintf(lr, sizeof(lr), "%d", bs.rank());
    if (!std::getenv("EPCOMM_LOCAL_RANK")) setenv("EPCOMM_LOCAL_RANK", lr, 1);
    rc = bootstrap_only ? run_bootstrap_tests(bs) : run_gpu_tests(bs);
  }
  MPI_Finalize();
  return rc;
#else
  auto bs = FileBootstrap::from_env(120);
  return bootstrap_only ? run_bootstrap_tests(*bs) : run_gpu_tests(*bs);
#endif
}
