#include "epcomm/bootstrap.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "epcomm/error.h"

namespace epcomm {

void Bootstrap::barrier() {
  char token = 0;
  std::vector<char> all(static_cast<size_t>(size()));
  all_gather(&token, all.data(), 1);
}

// ---- threads of one process -------------------------------------------------------------------

namespace {

// A bound from now: waited on (at) or polled every 2 ms (pause).
struct Deadline {
  explicit Deadline(double seconds)
      : at(std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(seconds))) {}
  bool expired() const { return std::chrono::steady_clock::now() > at; }
  static void pause() { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }
  std::chrono::steady_clock::time_point at;
};

struct Rendezvous {
  explicit Rendezvous(int n, double timeout) : size(n), timeout_s(timeout) {}
  std::mutex mu;
  std::condition_variable cv;
  const int size;
  const double timeout_s;
  long generation = 0;  // completed all-gathers
  int arrived = 0;
  int collected = 0;    // members that copied out the finished result
  size_t bytes = 0;
  std::vector<char> data;
  bool failed = false;
  std::string failure;
};

class ThreadBootstrap : public Bootstrap {
 public:
  ThreadBootstrap(std::shared_ptr<Rendezvous> rv, int rank) : rv_(std::move(rv)), rank_(rank) {}
  ~ThreadBootstrap() override { fail("rank " + std::to_string(rank_) + " left the group"); }
  int rank() const override { return rank_; }
  int size() const override { return rv_->size; }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    Rendezvous& rv = *rv_;
    std::unique_lock<std::mutex> lock(rv.mu);
    const auto deadline = Deadline(rv.timeout_s).at;
    // Wait until the previous round has been copied out by everyone.
    if (!rv.cv.wait_until(lock, deadline, [&] { return rv.failed || rv.collected == 0; }))
      throw_failure(lock, "timed out waiting for the previous all-gather");
    if (rv.failed) throw_failure(lock, rv.failure);
    if (rv.arrived == 0) {
      rv.bytes = bytes;
      rv.data.assign(bytes * size_t(rv.size), 0);
    } else if (rv.bytes != bytes) {
      throw_failure(lock, "ranks disagree on the all-gather size");
    }
    std::memcpy(rv.data.data() + bytes * size_t(rank_), send, bytes);
    const long gen = rv.generation;
    if (++rv.arrived == rv.size) {
      rv.arrived = 0;
      rv.collected = rv.size;
      ++rv.generation;
      rv.cv.notify_all();
    } else if (!rv.cv.wait_until(lock, deadline,
                                 [&] { return rv.failed || rv.generation != gen; })) {
      throw_failure(lock, "timed out: not every rank joined the all-gather");
    }
    if (rv.failed && rv.generation == gen) throw_failure(lock, rv.failure);
    std::memcpy(recv, rv.data.data(), bytes * size_t(rv.size));
    if (--rv.collected == 0) rv.cv.notify_all();
  }

 private:
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(rv_->mu);
    if (!rv_->failed && rv_->arrived > 0) {  // someone is waiting on us
      rv_->failed = true;
      rv_->failure = why;
    }
    rv_->cv.notify_all();
  }
  [[noreturn]] void throw_failure(std::unique_lock<std::mutex>& lock, const std::string& why) {
    rv_->failed = true;
    if (rv_->failure.empty()) rv_->failure = why;
    rv_->cv.notify_all();
    lock.unlock();
    throw Error(ErrorCode::kBootstrap,
                "epcomm thread bootstrap (rank " + std::to_string(rank_) + "): " + why);
  }

  std::shared_ptr<Rendezvous> rv_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Bootstrap>> make_thread_bootstraps(int n, double timeout_seconds) {
  if (n < 1) throw Error(ErrorCode::kInvalidArgument, "make_thread_bootstraps: n must be >= 1");
  auto rv = std::make_shared<Rendezvous>(n, timeout_seconds);
  std::vector<std::unique_ptr<Bootstrap>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<ThreadBootstrap>(rv, r));
  return out;
}

// ---- processes sharing a file system ---------------------------------------------------------

FileBootstrap::FileBootstrap(std::string dir, int rank, int size, double timeout_seconds,
                             std::string job)
    : dir_(std::move(dir)), job_(std::move(job)), rank_(rank), size_(size),
      timeout_(timeout_seconds) {
  for (char& c : job_)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') c = '_';
  if (size < 1 || rank < 0 || rank >= size)
    throw Error(ErrorCode::kInvalidArgument, "FileBootstrap: rank " + std::to_string(rank) +
                                                 " is outside a group of " + std::to_string(size));
  ::mkdir(dir_.c_str(), 0700);
}

std::unique_ptr<FileBootstrap> FileBootstrap::from_env(double timeout_seconds) {
  const char* r = std::getenv("EPCOMM_RANK");
  const char* n = std::getenv("EPCOMM_WORLD_SIZE");
  const char* d = std::getenv("EPCOMM_BOOTSTRAP_DIR");
  if (!r || !n || !d)
    throw Error(ErrorCode::kBootstrap,
                "FileBootstrap::from_env: EPCOMM_RANK, EPCOMM_WORLD_SIZE and "
                "EPCOMM_BOOTSTRAP_DIR must all be set");
  // The launch's name: ours, else the launcher's (restarts of one torchrun job share its run
  // id, so the restart count is part of it; one Slurm job runs several steps).
  const auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  std::string job = env("EPCOMM_BOOTSTRAP_JOB");
  if (job.empty() && !env("TORCHELASTIC_RUN_ID").empty())
    job = "torch_" + env("TORCHELASTIC_RUN_ID") + "_" + env("TORCHELASTIC_RESTART_COUNT");
  if (job.empty() && !env("SLURM_JOB_ID").empty())
    job = "slurm_" + env("SLURM_JOB_ID") + "_" + env("SLURM_STEP_ID");
  if (job.empty() && !env("OMPI_MCA_ess_base_jobid").empty())
    job = "ompi_" + env("OMPI_MCA_ess_base_jobid");
  if (job.empty() && !env("PMIX_NAMESPACE").empty()) job = "pmix_" + env("PMIX_NAMESPACE");
  return std::make_unique<FileBootstrap>(d, std::atoi(r), std::atoi(n), timeout_seconds, job);
}

FileBootstrap::~FileBootstrap() = default;

namespace {

// 64 random bits as 16 hex digits: a run id or a rank's nonce.
std::string fresh_hex_id() {
  std::random_device rd;
  uint64_t v = (uint64_t(rd()) << 32) ^ uint64_t(rd());
  v ^= uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  v ^= uint64_t(::getpid()) << 20;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Write then rename (a temporary name of its own per writer): readers see the whole file or none.
bool write_file(const std::string& path, const void* data, size_t bytes) {
  const std::string tmp = path + ".tmp" + fresh_hex_id();
  std::ofstream f(tmp, std::ios::binary);
  f.write(static_cast<const char*>(data), std::streamsize(bytes));
  f.close();
  if (f && std::rename(tmp.c_str(), path.c_str()) == 0) return true;
  ::unlink(tmp.c_str());
  return false;
}
bool write_text(const std::string& path, const std::string& text) {
  return write_file(path, text.data(), text.size());
}
std::string seconds_text(double s) {
  std::ostringstream o;
  o << s << " s";
  return o.str();
}
bool read_text(const std::string& path, std::string* text) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream s;
  s << f.rdbuf();
  *text = s.str();
  return true;
}

}  // namespace

void FileBootstrap::join_run() {
  const Deadline deadline(timeout_);
  const auto fail = [&](const std::string& why) {
    throw Error(ErrorCode::kBootstrap, "FileBootstrap (rank " + std::to_string(rank_) + " of " +
                                           std::to_string(size_) + ", " + dir_ +
                                           (job_.empty() ? "" : ", job " + job_) + "): " + why);
  };
  if (size_ == 1) {
    run_ = fresh_hex_id();
    return;
  }
  if (rank_ != 0) {
    // Publish a nonce, wait for rank 0's announcement that lists it, confirm.
    const std::string nonce = fresh_hex_id();
    if (!write_text(member_file("join", rank_), nonce)) fail("cannot write " + member_file("join", rank_));
    for (;;) {
      std::string text;
      if (read_text(file("run"), &text)) {  // "<run id> <nonce of rank 1> ... <nonce of rank n-1>"
        std::istringstream in(text);
        std::string id, seen;
        in >> id;
        for (int r = 1; r <= rank_ && in; ++r) in >> seen;
        if (in && seen == nonce) {
          if (!write_text(member_file("ack", rank_), id + " " + nonce))
            fail("cannot write " + member_file("ack", rank_));
          run_ = id;
          return;
        }
      }
      if (deadline.expired())
        fail("rank 0 did not start a run within " + seconds_text(timeout_) +
             " (is rank 0 running, with this directory and this world size?)");
      Deadline::pause();
    }
  }
  // Rank 0: announce a fresh run id with the nonces the join files hold (re-announced whenever
  // one changes: a late rank replaces an earlier run's join file), until every rank confirmed.
  const std::string id = fresh_hex_id();
  std::vector<std::string> nonce(size_t(size_), "-");
  for (;;) {
    bool changed = false;
    for (int r = 1; r < size_; ++r) {
      std::string n;
      if (read_text(member_file("join", r), &n) && !n.empty() && n != nonce[size_t(r)]) {
        nonce[size_t(r)] = n;
        changed = true;
      }
    }
    if (changed) {
      std::string text = id;
      for (int r = 1; r < size_; ++r) text += " " + nonce[size_t(r)];
      if (!write_text(file("run"), text)) fail("cannot write " + file("run"));
    }
    std::string missing;
    int num_missing = 0;
    for (int r = 1; r < size_; ++r) {
      std::string ack;
      if (!read_text(member_file("ack", r), &ack) || ack != id + " " + nonce[size_t(r)])
        missing += (num_missing++ ? ", " : "") + std::to_string(r);
    }
    if (num_missing == 0) break;
    if (deadline.expired())
      fail((num_missing == 1 ? "rank " : "ranks ") + missing + " did not join the run within " +
           seconds_text(timeout_));
    Deadline::pause();
  }
  // Every rank has read the announcement: the next run starts from a clean slate.
  ::unlink(file("run").c_str());
  for (int r = 1; r < size_; ++r) {
    ::unlink(member_file("join", r).c_str());
    ::unlink(member_file("ack", r).c_str());
  }
  run_ = id;
}

void FileBootstrap::all_gather(const void* send, void* recv, size_t bytes) {
  if (run_.empty()) join_run();
  const long gen = generation_++;
  auto path = [&](long g, int r) { return member_file(run_ + ".g" + std::to_string(g), r); };
  if (!write_file(path(gen, rank_), send, bytes))
    throw Error(ErrorCode::kBootstrap, "FileBootstrap: cannot write " + path(gen, rank_));
  const Deadline deadline(timeout_);
  for (int r = 0; r < size_; ++r) {
    for (;;) {
      std::ifstream f(path(gen, r), std::ios::binary);
      if (f) {
        f.read(static_cast<char*>(recv) + bytes * size_t(r), std::streamsize(bytes));
        if (f.gcount() != std::streamsize(bytes) || f.peek() != std::ifstream::traits_type::eof())
          throw Error(ErrorCode::kBootstrap, "FileBootstrap: rank " + std::to_string(r) +
                                                 " contributed a different size");
        break;
      }
      if (deadline.expired())
        throw Error(ErrorCode::kBootstrap, "FileBootstrap (rank " + std::to_string(rank_) +
                                               "): rank " + std::to_string(r) +
                                               " did not join all-gather " + std::to_string(gen) +
                                               " within " + seconds_text(timeout_));
      Deadline::pause();
    }
  }
  // Every rank has read generation gen-1 once it writes generation gen: remove our old file.
  if (gen > 0) ::unlink(path(gen - 1, rank_).c_str());
}

}  // namespace epcomm
