// A process that dies with work in flight. Run under epcomm_launch --keep-going (file bootstrap),
// normally with 4 ranks (tests/mp/run_kill_test.sh): every rank sets up one group and runs
// dispatch + combine in a loop, synchronising after each; rank 2 kills itself (SIGKILL) right
// after launching its dispatch of iteration 20. Each survivor must, on its own (the dead rank
// cannot answer, so no survivor touches the bootstrap after the kill):
//   - get epcomm::Error(kTimeout) naming rank 2, within the timeout (+ a margin) of the end of
//     its last complete iteration;
//   - see poisoned(), and kPoisoned from its next call;
//   - tear the group and its buffers down within a bound, and still be able to use its GPU.
// It prints one line "[rank R] VERDICT detected: ..." or "[rank R] VERDICT FAIL: ...".
// Exit status: kDetected (3) = a survivor that saw all of that; 1 = a deviation (or a hang, cut
// short by a watchdog); 2 = bad environment; 77 = skipped (no GPU). The victim dies by SIGKILL.
#include <signal.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/bootstrap.h"
#include "harness.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

constexpr int kDetected = 3;
constexpr int kVictim = 2;
constexpr int kKillAt = 20;       // the iteration whose dispatch the victim leaves in flight
constexpr int kIterations = 40;   // a survivor that gets this far saw no error
constexpr double kTimeout = 3.0;  // Config::timeout_seconds
// What the bound may be exceeded by: the rest of the iteration the error arrives in (a dispatch
// that completed before its combine timed out), the dead process's context teardown, and ranks
// time-sliced on one GPU.
constexpr double kMargin = 5.0;
constexpr double kTeardownBound = 10.0;

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Ends the process with a FAIL verdict when a phase outlives its bound: a hang must fail this
// rank with a reason, not wait for the launcher's time limit.
class Watchdog {
 public:
  explicit Watchdog(int rank) : rank_(rank), thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm(const std::string& what, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    what_ = what;
    bound_ = seconds;
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(seconds));
    armed_ = true;
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
    cv_.notify_all();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (!armed_) {
        cv_.wait(lock);
        continue;
      }
      const auto deadline = deadline_;
      cv_.wait_until(lock, deadline);
      if (!stop_ && armed_ && deadline_ == deadline &&
          std::chrono::steady_clock::now() >= deadline) {
        std::printf("[rank %d] VERDICT FAIL: %s did not finish within %.1f s\n", rank_,
                    what_.c_str(), bound_);
        std::fflush(stdout);
        std::_Exit(1);
      }
    }
  }

  const int rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, armed_ = false;
  std::string what_;
  double bound_ = 0;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;  // last: it starts once every other member is ready
};

// True if the message lists `rank` after "rank(s) " ("... rank(s) 1, 2 to send ...").
bool names_rank(const std::string& msg, int rank) {
  const std::string marker = "rank(s) ";
  size_t i = msg.find(marker);
  if (i == std::string::npos) return false;
  i += marker.size();
  for (;;) {
    size_t j = i;
    while (j < msg.size() && msg[j] >= '0' && msg[j] <= '9')
      ++j;
    if (j == i) return false;
    if (std::atoi(msg.substr(i, j - i).c_str()) == rank) return true;
    if (msg.compare(j, 2, ", ") != 0) return false;
    i = j + 2;
  }
}

// No teardown after a deviation: the verdict is known, and a group that is not poisoned would
// wait in its teardown barrier for the dead rank.
[[noreturn]] void verdict_fail(int rank, const std::string& why) {
  std::printf("[rank %d] VERDICT FAIL: %s\n", rank, why.c_str());
  std::fflush(stdout);
  std::_Exit(1);
}

int run(FileBootstrap& bs, int device, int ranks_per_node) {
  const int n = bs.size(), rank = bs.rank();
  Watchdog dog(rank);
  dog.arm("set-up", 120);
  // ranks_per_node < n: the dead rank is reached through NVSHMEM.
  auto g = Group::create(placed(make_cfg(2048, 4, 8 * n, 128, 24, kTimeout), n, ranks_per_node), bs,
                         device);
  auto io = std::make_unique<RankIO>(*g);
  const uint64_t seed = 2024;
  const auto p = reference::make_problem(n, 2048, 4, 8 * n, random_counts(n, 128, seed), seed);
  const auto refs = reference_dispatch_all(p);
  std::vector<std::vector<uint16_t>> y;
  for (int r = 0; r < n; ++r)
    y.push_back(expert_outputs(r, seed, refs[size_t(r)].rows(), 2048));
  io->upload(p.ranks[size_t(rank)]);
  io->expert_seed = seed;
  io->make_expert_out(refs[size_t(rank)].rows());
  dog.disarm();

  auto last_ok = std::chrono::steady_clock::now();  // the end of the last complete iteration
  int it = 0;
  try {
    for (; it < kIterations; ++it) {
      dog.arm("iteration " + std::to_string(it), 2 * kTimeout + kMargin);
      g->dispatch(io->dispatch_input(), io->dispatch_output(), io->stream);
      if (rank == kVictim && it == kKillAt) {
        std::printf("[rank %d] iteration %d: dispatch launched; killing this process (SIGKILL)\n",
                    rank, it);
        std::fflush(stdout);
        raise(SIGKILL);
      }
      g->synchronize(io->stream);
      g->combine(io->combine_input(), io->combine_output(true), io->stream);
      g->synchronize(io->stream);
      if (it == 0) {  // the group works before anyone dies
        std::string e = io->check_dispatch(refs[size_t(rank)]);
        if (e.empty()) e = io->check_combine(reference::combine(p, refs, y, rank, true), true);
        if (!e.empty()) verdict_fail(rank, "iteration 0 is wrong: " + e);
      }
      last_ok = std::chrono::steady_clock::now();
    }
    verdict_fail(rank, std::to_string(kIterations) + " iterations and no error, although rank " +
                           std::to_string(kVictim) + " died at iteration " +
                           std::to_string(kKillAt));
  } catch (const Error& e) {
    dog.disarm();
    const double waited = since(last_ok);
    const std::string w = e.what();
    if (e.code() != ErrorCode::kTimeout)
      verdict_fail(rank, "iteration " + std::to_string(it) + ": error '" +
                             error_code_name(e.code()) + "' instead of a timeout: " + w);
    if (!names_rank(w, kVictim))
      verdict_fail(rank, "the timeout does not name rank " + std::to_string(kVictim) + ": " + w);
    if (it != kKillAt)
      verdict_fail(rank, "the timeout came at iteration " + std::to_string(it) + ", not " +
                             std::to_string(kKillAt) + ": " + w);
    if (waited > kTimeout + kMargin)
      verdict_fail(rank, "the timeout came " + std::to_string(waited) +
                             " s after the last complete iteration, past " +
                             std::to_string(kTimeout) + " + " + std::to_string(kMargin) +
                             " s: " + w);
    if (!g->poisoned()) verdict_fail(rank, "not poisoned after: " + w);
    try {
      g->dispatch(io->dispatch_input(), io->dispatch_output(), io->stream);
      verdict_fail(rank, "the call after the timeout did not throw");
    } catch (const Error& e2) {
      if (e2.code() != ErrorCode::kPoisoned)
        verdict_fail(rank, std::string("the call after the timeout threw '") +
                               error_code_name(e2.code()) + "', not kPoisoned: " + e2.what());
    }
    dog.arm("teardown", kTeardownBound);
    const auto t0 = std::chrono::steady_clock::now();
    io.reset();
    g.reset();
    const double teardown = since(t0);
    dog.disarm();
    // A survivor's GPU must still work: its kernels wrote to the dead rank's window.
    void* probe = nullptr;
    cudaError_t se = cudaSetDevice(device);
    if (se == cudaSuccess) se = cudaMalloc(&probe, 1 << 20);
    if (se == cudaSuccess) se = cudaDeviceSynchronize();
    if (probe) (void)cudaFree(probe);
    if (se != cudaSuccess)
      verdict_fail(
          rank, std::string("the GPU is unusable after the teardown: ") + cudaGetErrorString(se));
    std::ostringstream os;
    os << "[rank " << rank << "] VERDICT detected: kTimeout at iteration " << it << ", " << waited
       << " s after the last complete one (bound " << kTimeout << " + " << kMargin
       << " s); poisoned; kPoisoned on the next call; teardown in " << teardown
       << " s; GPU usable. Error: " << w;
    std::printf("%s\n", os.str().c_str());
    std::fflush(stdout);
    return kDetected;
  } catch (const std::exception& e) {
    verdict_fail(rank, std::string("iteration ") + std::to_string(it) + ": " + e.what());
  }
}

}  // namespace

// --ranks-per-node N: the group declared n / N nodes (Config::ranks_per_node).
int main(int argc, char** argv) {
  int ranks_per_node = 0;
  if (argc == 3 && std::strcmp(argv[1], "--ranks-per-node") == 0) {
    ranks_per_node = std::atoi(argv[2]);
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: %s [--ranks-per-node N]\n", argv[0]);
    return 2;
  }
  std::unique_ptr<FileBootstrap> bs;
  try {
    bs = FileBootstrap::from_env(30);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epcomm_kill_test: run it under epcomm_launch: %s\n", e.what());
    return 2;
  }
  const int rank = bs->rank();
  if (bs->size() <= kVictim) {
    std::fprintf(stderr, "epcomm_kill_test: needs more than %d ranks (rank %d dies), got %d\n",
                 kVictim, kVictim, bs->size());
    return 2;
  }
  if (gpu_count() < 1) {
    std::printf("[rank %d] SKIPPED: the kill test needs a GPU, found none\n", rank);
    return 77;
  }
  const char* lr = std::getenv("EPCOMM_LOCAL_RANK");
  try {
    return run(*bs, device_of_rank(lr ? std::atoi(lr) : rank), ranks_per_node);
  } catch (const std::exception& e) {
    verdict_fail(rank, std::string("set-up: ") + e.what());
  }
}
