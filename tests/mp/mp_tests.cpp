// Multi-process tests: one process per rank, joined by the file bootstrap (under epcomm_launch)
// or by MPI (under mpirun, when built with EPCOMM_TEST_WITH_MPI). The ranks share the GPUs there
// are: rank r runs on GPU device_of_rank(local rank), and every configuration goes through
// placed(). Every rank checks its own results against the CPU reference; the verdicts are
// gathered so every rank prints the same summary. Exit 0: all passed; 77: skipped (no GPU);
// 1: a failure.
//   --bootstrap-only      only the bootstrap (CPU): all-gathers, and a rank that skips one
//   --ranks-per-node N    every group declared n / N nodes of N ranks (Config::ranks_per_node):
//                         with N < n, traffic between the nodes goes through NVSHMEM
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/bootstrap.h"
#include "epcomm/detail/epilogue_access.h"
#include "harness.h"
#if EPCOMM_TEST_WITH_MPI
#include "epcomm/mpi_bootstrap.h"
#endif

using namespace epcomm;
using namespace epcomm::testing;

namespace {

// A new bootstrap over the same processes, with its own timeout. Every rank calls it at the same
// point (the MPI one duplicates the communicator, a collective).
using MakeBootstrap = std::function<std::unique_ptr<Bootstrap>(double timeout_seconds)>;

// The bound of the bootstrap in the "missing rank" checks, and how long the missing rank stays
// away before it meets the others on the main bootstrap: past their bound, so that it comes back
// to ranks that already gave up, as a late process would.
constexpr double kMissingBound = 5.0;
constexpr double kMissingAway = kMissingBound + 2.0;

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
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The ranks a message lists right after `marker` ("rank(s) 1, 2 did ..." -> {1, 2}); empty when
// the marker is absent.
std::vector<int> ranks_after(const std::string& msg, const std::string& marker) {
  std::vector<int> out;
  size_t i = msg.find(marker);
  if (i == std::string::npos) return out;
  i += marker.size();
  for (;;) {
    size_t j = i;
    while (j < msg.size() && std::isdigit(static_cast<unsigned char>(msg[j]))) ++j;
    if (j == i) break;
    out.push_back(std::atoi(msg.substr(i, j - i).c_str()));
    if (msg.compare(j, 2, ", ") != 0) break;
    i = j + 2;
  }
  return out;
}

// The ranks a bootstrap error says did not join: the file bootstrap names one ("...): rank 2 did
// not join all-gather 1"), the MPI one lists them ("...): rank(s) 2, 3 did not join ...").
std::vector<int> bootstrap_missing(const std::string& msg) {
  if (msg.find("did not join") == std::string::npos) return {};
  for (const char* marker : {"): rank(s) ", "): rank "}) {
    std::vector<int> r = ranks_after(msg, marker);
    if (!r.empty()) return r;
  }
  return {};
}

// Rank n-1 stays away from one collective of a fresh bootstrap bounded by kMissingBound, which
// every other rank makes through `join`. They must throw kBootstrap naming rank n-1, after the
// bound and before bound + margin. The absent rank comes back after kMissingAway; the caller's
// next collective on the main bootstrap brings every rank together again.
std::string expect_missing_rank(Bootstrap& bs, const MakeBootstrap& make, double margin,
                                const std::function<void(Bootstrap&)>& join) {
  const int missing = bs.size() - 1;
  std::unique_ptr<Bootstrap> sub = make(kMissingBound);
  // Every rank makes one all-gather first: it starts the ranks together, and the one that fails
  // is then not the bootstrap's first.
  sub->barrier();
  if (bs.rank() == missing) {
    std::this_thread::sleep_for(std::chrono::duration<double>(kMissingAway));
    return "";
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    join(*sub);
    return "no error although rank " + std::to_string(missing) + " never joined";
  } catch (const Error& e) {
    const double s = seconds_since(t0);
    const std::string w = e.what();
    if (e.code() != ErrorCode::kBootstrap)
      return std::string("wrong error (") + error_code_name(e.code()) + "): " + w;
    if (bootstrap_missing(w) != std::vector<int>{missing})
      return "rank " + std::to_string(missing) + " is not the one named: " + w;
    if (s > kMissingBound + margin)
      return "the error came after " + std::to_string(s) + " s, past the bound of " +
             std::to_string(kMissingBound) + " s + " + std::to_string(margin) + " s: " + w;
    // A bootstrap that gave up early would fail ranks that are merely slow.
    if (s < kMissingBound - 0.25)
      return "the error came after " + std::to_string(s) + " s, before the bound of " +
             std::to_string(kMissingBound) + " s: " + w;
    std::printf("[rank %d] after %.2f s (bound %.0f s): %s\n", bs.rank(), s, kMissingBound,
                w.c_str());
    return "";
  }
}

// One dispatch + combine round on this rank, checked against the reference (the problem taken
// in the group's modes; the un-reduced combine only without the shared expert), in the group's
// format: exactly against reference::dispatch (bf16) or reference::dispatch_quantized. With
// expert_side, the router weights travel with the dispatch and the combine is the expert-side
// reduction (checked bit for bit against reference::combine_expert_side).
std::string round(Group& g, RankIO& io, const reference::Problem& problem, bool async,
                  uint64_t expert_seed, bool expert_side = false) {
  const int rank = g.rank();
  reference::Problem p = problem;
  p.shared_expert = g.config().shared_expert;
  p.skip_a2a = g.config().skip_a2a;
  p.allreduce_world_size = g.config().allreduce_world_size;
  io.upload(p.ranks[size_t(rank)]);
  io.poison();
  if (async) {
    g.dispatch_async(io.dispatch_input(expert_side), io.stream);
    g.dispatch_wait(io.dispatch_output(), io.stream);
  } else {
    g.dispatch(io.dispatch_input(expert_side), io.dispatch_output(), io.stream);
  }
  g.synchronize(io.stream);
  std::vector<reference::DispatchResult> refs;
  std::string e;
  if (g.config().format == TokenFormat::kBF16) {
    refs = reference_dispatch_all(p);
    e = io.check_dispatch(refs[size_t(rank)]);
  } else {
    const auto qrefs = reference_dispatch_quantized_all(p, g.config(), g.sizes());
    e = io.check_dispatch_quantized(qrefs[size_t(rank)]);
    for (const auto& q : qrefs)
      refs.push_back(combine_layout(q));
  }
  if (!e.empty()) return e;
  std::vector<std::vector<uint16_t>> y;
  for (int r = 0; r < p.n_ranks; ++r)
    y.push_back(expert_outputs(r, expert_seed, refs[size_t(r)].rows(), p.hidden));
  io.expert_seed = expert_seed;
  io.make_expert_out(refs[size_t(rank)].rows());
  for (bool weighted : {true, false}) {
    if (!weighted && (p.shared_expert || expert_side)) continue;
    io.combine_out.fill(0xff, io.stream);
    const CombineOutput out = io.combine_output(weighted && !expert_side);
    if (async) {
      g.combine_async(io.combine_input(), io.stream);
      g.combine_wait(out, io.stream);
    } else {
      g.combine(io.combine_input(), out, io.stream);
    }
    g.synchronize(io.stream);
    e = expert_side ? io.check_combine_expert_side(reference::combine_expert_side(p, refs, y, rank))
                    : io.check_combine(reference::combine(p, refs, y, rank, weighted), weighted);
    if (!e.empty()) return e;
  }
  return "";
}

// Config::ranks_per_node of every group (--ranks-per-node; 0: the hosts decide): with fewer than
// the ranks, every transfer between the declared nodes goes through NVSHMEM.
int g_ranks_per_node = 0;
Config node_placed(Config cfg, int n) {
  return placed(cfg, n, g_ranks_per_node);
}

int run_gpu_tests(Bootstrap& bs, const MakeBootstrap& make) {
  const int n = bs.size(), rank = bs.rank();
  int local_gpus = gpu_count();
  std::vector<int> all(static_cast<size_t>(n));
  bs.all_gather(&local_gpus, all.data(), sizeof(int));
  std::string without;
  for (int r = 0; r < n; ++r)
    if (all[size_t(r)] < 1) without += (without.empty() ? "" : ", ") + std::to_string(r);
  if (!without.empty()) {
    if (rank == 0)
      std::printf("[  SKIPPED ] multi-process GPU tests: no GPU visible to rank(s) %s\n",
                  without.c_str());
    return 77;
  }
  const char* lr = std::getenv("EPCOMM_LOCAL_RANK");
  const int device = device_of_rank(lr ? std::atoi(lr) : rank);
  // n_experts must be a multiple of n: 8 where it is (the shape these tests always had), else
  // the next multiple (9 for 3 ranks).
  const int e_small = (8 + n - 1) / n * n;
  Runner run{bs};

  run.check("random rounds, fused and async+wait, several shapes", [&]() -> std::string {
    struct Shape {
      int H, K, E, T;
      DispatchPath path;
    };
    for (Shape s : {Shape{7168, 8, 32 * n, 128, DispatchPath::kLowLatency},
                    Shape{2880, 4, 16 * n, 300, DispatchPath::kThroughput},
                    Shape{2048, 1, e_small, 64, DispatchPath::kLowLatency},
                    Shape{2048, 8, 8 * n, 96, DispatchPath::kThroughput}}) {
      auto g = Group::create(node_placed(with_path(make_cfg(s.H, s.K, s.E, s.T), s.path), n), bs,
                             device);
      RankIO io(*g);
      for (int it = 0; it < 6; ++it) {
        const uint64_t seed = 100 + uint64_t(it) + uint64_t(s.H);
        const auto p = reference::make_problem(n, s.H, s.K, s.E, random_counts(n, s.T, seed),
                                               seed, 0.0, it % 2 ? 0.2 : 0.0);
        const std::string e = round(*g, io, p, it % 2 == 1, seed);
        if (!e.empty())
          return "H " + std::to_string(s.H) + " iteration " + std::to_string(it) + ": " + e;
      }
    }
    return "";
  });

  run.check("a custom combine epilogue is refused on a group that spans nodes, only there",
            [&]() -> std::string {
    auto g = Group::create(node_placed(make_cfg(2048, 4, 8 * n, 64), n), bs, device);
    const bool spans = g_ranks_per_node > 0 && g_ranks_per_node < n;
    CombineInput in{};
    CombineOutput out{};
    std::string what;
    try {
      detail::EpilogueAccess::prepare_combine(*g, &in, &out);  // what combine_epilogue.cuh calls
      return "prepare_combine accepted a combine before any dispatch";
    } catch (const Error& e) {
      what = e.what();
      if (e.code() != ErrorCode::kInvalidArgument) return "unexpected error: " + what;
    }
    const bool refused = what.find("spans nodes") != std::string::npos;
    if (refused != spans)
      return std::string(spans ? "not refused" : "refused") + " on a group that " +
             (spans ? "spans" : "does not span") + " nodes: " + what;
    return "";
  });

  run.check("modes: the shared expert, skip_a2a (no peer mapped), both", [&]() -> std::string {
    for (int mode = 0; mode < 3; ++mode) {
      Config c = make_cfg(2048, 4, 8 * n, 64);
      c.shared_expert = mode != 1;
      c.skip_a2a = mode != 0;
      auto g = Group::create(node_placed(c, n), bs, device);
      RankIO io(*g);
      for (int it = 0; it < 4; ++it) {
        const uint64_t seed = 500 + uint64_t(it) + 10 * uint64_t(mode);
        const auto p = c.skip_a2a
                           ? reference::make_replicated_problem(n, 2048, 4, 8 * n, 64 - 21 * it,
                                                                seed, 0.0, 0.1)
                           : reference::make_problem(n, 2048, 4, 8 * n, random_counts(n, 64, seed),
                                                     seed, 0.0, 0.1);
        const std::string e = round(*g, io, p, it % 2 == 1, seed);
        if (!e.empty())
          return std::string(c.shared_expert ? "shared expert " : "") +
                 (c.skip_a2a ? "skip_a2a " : "") + "iteration " + std::to_string(it) + ": " + e;
      }
    }
    return "";
  });

  run.check("every token format, both paths, token- and expert-side combine", [&]() -> std::string {
    for (TokenFormat f : {TokenFormat::kFp8Blockwise, TokenFormat::kNvfp4, TokenFormat::kMxfp8,
                          TokenFormat::kMxfp4, TokenFormat::kBF16}) {
      for (DispatchPath path : {DispatchPath::kLowLatency, DispatchPath::kThroughput}) {
        Config c = with_path(make_cfg(2048, 4, 8 * n, 96), path);
        c.format = f;
        c.nvfp4_global_scale = 0.75f;
        auto g = Group::create(node_placed(c, n), bs, device);
        RankIO io(*g);
        for (int it = 0; it < 4; ++it) {
          const uint64_t seed = 700 + uint64_t(it) + 10 * uint64_t(f) + 100 * uint64_t(path);
          const auto p = reference::make_problem(n, 2048, 4, 8 * n, random_counts(n, 96, seed),
                                                 seed, 0.0, it % 2 ? 0.15 : 0.0);
          const std::string e = round(*g, io, p, it % 2 == 1, seed, it >= 2);
          if (!e.empty())
            return std::string(token_format_name(f)) + " " + dispatch_path_name(path) +
                   " iteration " + std::to_string(it) + ": " + e;
        }
      }
    }
    return "";
  });

  run.check("configuration mismatch names the field", [&]() -> std::string {
    Config c = node_placed(make_cfg(2048, rank == n - 1 ? 4 : 8, 8 * n, 64), n);
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
    bool poisoned = false;
    {
      auto g = Group::create(node_placed(make_cfg(2048, 4, 8 * n, 64, 24, 1.0), n), bs, device);
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
      poisoned = g->poisoned();
    }  // teardown on every rank
    // A poisoned group is torn down without the bootstrap barrier (a peer may be dead); the
    // missing rank's healthy group made one. A barrier here for each one skipped keeps every
    // rank's bootstrap at the same all-gather.
    if (poisoned) bs.barrier();
    auto g = Group::create(node_placed(make_cfg(2048, 4, 8 * n, 64), n), bs, device);
    RankIO io(*g);
    const auto p = reference::make_problem(n, 2048, 4, 8 * n, random_counts(n, 64, 8), 8);
    return round(*g, io, p, false, 8);
  });

  run.check("a rank that never reaches set-up: Group::create fails naming it, within the bound",
            [&]() -> std::string {
    // The others' window allocation and kernel loading come before the all-gather.
    const double margin = 5.0;
    const Config cfg = node_placed(make_cfg(2048, 4, 8 * n, 64), n);
    return expect_missing_rank(bs, make, margin, [&](Bootstrap& sub) {
      auto g = Group::create(cfg, sub, device);
    });
  });

  run.check("after a set-up that failed, a new group works", [&]() -> std::string {
    auto g = Group::create(node_placed(make_cfg(2048, 4, 8 * n, 64), n), bs, device);
    RankIO io(*g);
    const auto p = reference::make_problem(n, 2048, 4, 8 * n, random_counts(n, 64, 9), 9);
    return round(*g, io, p, true, 9);
  });

  if (rank == 0)
    std::printf("multi-process (%d ranks): %d passed, %d failed\n", n, run.passed, run.failed);
  return run.failed == 0 ? 0 : 1;
}

int run_bootstrap_tests(Bootstrap& bs, const MakeBootstrap& make) {
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
  if (bs.size() < 2) return bad ? 1 : 0;

  Runner run{bs};
  run.check("a rank that skips an all-gather: the others throw kBootstrap naming it, within "
            "the bound",
            [&]() -> std::string {
    // Polling, and a loaded CI machine.
    const double margin = 3.0;
    return expect_missing_rank(bs, make, margin, [&](Bootstrap& sub) {
      std::vector<char> got(size_t(sub.size()) * 8);
      sub.all_gather("contrib", got.data(), 8);
    });
  });
  run.check("the main bootstrap still works after the missing rank came back",
            [&]() -> std::string {
    int mine = 1000 + bs.rank();
    std::vector<int> all(size_t(bs.size()));
    bs.all_gather(&mine, all.data(), sizeof(int));
    for (int r = 0; r < bs.size(); ++r)
      if (all[size_t(r)] != 1000 + r)
        return "rank " + std::to_string(r) + " contributed " + std::to_string(all[size_t(r)]);
    return "";
  });
  return bad == 0 && run.failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  bool bootstrap_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--bootstrap-only") == 0) {
      bootstrap_only = true;
    } else if (std::strcmp(argv[i], "--ranks-per-node") == 0 && i + 1 < argc) {
      g_ranks_per_node = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--bootstrap-only] [--ranks-per-node N]\n", argv[0]);
      return 2;
    }
  }
  int rc = 1;
#if EPCOMM_TEST_WITH_MPI
  MPI_Init(&argc, &argv);
  try {
    MpiBootstrap bs(MPI_COMM_WORLD, 120);
    char lr[16];
    std::snprintf(lr, sizeof(lr), "%d", bs.rank());
    if (!std::getenv("EPCOMM_LOCAL_RANK")) setenv("EPCOMM_LOCAL_RANK", lr, 1);
    const MakeBootstrap make = [](double timeout) -> std::unique_ptr<Bootstrap> {
      return std::make_unique<MpiBootstrap>(MPI_COMM_WORLD, timeout);
    };
    rc = bootstrap_only ? run_bootstrap_tests(bs, make) : run_gpu_tests(bs, make);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epcomm_mpi_tests: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
#else
  try {
    auto bs = FileBootstrap::from_env(120);
    // Each new bootstrap gets a directory of its own, so its files never meet the main one's.
    const std::string dir = std::getenv("EPCOMM_BOOTSTRAP_DIR");
    int made = 0;
    const MakeBootstrap make = [&](double timeout) -> std::unique_ptr<Bootstrap> {
      return std::make_unique<FileBootstrap>(dir + "/sub" + std::to_string(made++), bs->rank(),
                                             bs->size(), timeout);
    };
    rc = bootstrap_only ? run_bootstrap_tests(*bs, make) : run_gpu_tests(*bs, make);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epcomm_mp_tests: %s\n", e.what());
    rc = 1;
  }
#endif
  return rc;
}
