#include "epcomm/bootstrap.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "epcomm/error.h"

namespace epcomm {

void Bootstrap::barrier() {
  char token = 0;
  std::vector<char> all(static_cast<size_t>(size()));
  all_gather(&token, all.data(), 1);
}

// ---- threads of one process -------------------------------------------------------------------

namespace {

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
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(rv.timeout_s);
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

FileBootstrap::FileBootstrap(std::string dir, int rank, int size, double timeout_seconds)
    : dir_(std::move(dir)), rank_(rank), size_(size), timeout_(timeout_seconds) {
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
  return std::make_unique<FileBootstrap>(d, std::atoi(r), std::atoi(n), timeout_seconds);
}

FileBootstrap::~FileBootstrap() = default;

void FileBootstrap::all_gather(const void* send, void* recv, size_t bytes) {
  const long gen = generation_++;
  auto path = [&](int r) {
    return dir_ + "/g" + std::to_string(gen) + "_r" + std::to_string(r);
  };
  {  // write then rename: readers never see a partial file
    const std::string tmp = path(rank_) + ".tmp";
    std::ofstream f(tmp, std::ios::binary);
    f.write(static_cast<const char*>(send), std::streamsize(bytes));
    f.close();
    if (!f || std::rename(tmp.c_str(), path(rank_).c_str()) != 0)
      throw Error(ErrorCode::kBootstrap, "FileBootstrap: cannot write " + path(rank_));
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_);
  for (int r = 0; r < size_; ++r) {
    for (;;) {
      std::ifstream f(path(r), std::ios::binary);
      if (f) {
        f.read(static_cast<char*>(recv) + bytes * size_t(r), std::streamsize(bytes));
        if (f.gcount() != std::streamsize(bytes))
          throw Error(ErrorCode::kBootstrap, "FileBootstrap: rank " + std::to_string(r) +
                                                 " contributed a different size");
        break;
      }
      if (std::chrono::steady_clock::now() > deadline)
        throw Error(ErrorCode::kBootstrap, "FileBootstrap (rank " + std::to_string(rank_) +
                                               "): rank " + std::to_string(r) +
                                               " did not join all-gather " + std::to_string(gen));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  // Every rank has read generation gen-1 once it writes generation gen: remove our old file.
  if (gen > 0) ::unlink((dir_ + "/g" + std::to_string(gen - 1) + "_r" + std::to_string(rank_)).c_str());
}

}  // namespace epcomm
