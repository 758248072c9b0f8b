#include "epcomm/mpi_bootstrap.h"

#include <chrono>
#include <climits>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>

#include "epcomm/error.h"

namespace epcomm {

namespace {

std::string mpi_error_text(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(msg, size_t(len));
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

std::string MpiBootstrap::prefix() const {
  return rank_ < 0 ? std::string("MPI bootstrap: ")
                   : "MPI bootstrap (rank " + std::to_string(rank_) + "): ";
}

void MpiBootstrap::check(int rc, const char* what) const {
  if (rc != MPI_SUCCESS)
    throw Error(ErrorCode::kBootstrap, prefix() + what + " failed: " + mpi_error_text(rc));
}

MpiBootstrap::MpiBootstrap(MPI_Comm comm, double timeout_seconds) : timeout_(timeout_seconds) {
  if (!(timeout_seconds > 0))
    throw Error(ErrorCode::kInvalidArgument, "MPI bootstrap: timeout_seconds must be positive");
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) throw Error(ErrorCode::kBootstrap, "MPI bootstrap: MPI is not initialised");
  check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  try {
    // Failures of our own calls come back as return codes and become epcomm::Errors, instead of
    // the communicator's default handler aborting the job.
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    void* attr = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &attr, &found), "MPI_Comm_get_attr(MPI_TAG_UB)");
    if (found && attr != nullptr && *static_cast<int*>(attr) > 0)
      tag_limit_ = *static_cast<int*>(attr);
  } catch (...) {
    (void)MPI_Comm_free(&comm_);
    throw;
  }
}

MpiBootstrap::~MpiBootstrap() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;  // MPI may not be called
  reap_pending_sends();
  for (PendingSends& p : pending_) {
    for (MPI_Request& r : p.requests)
      if (r != MPI_REQUEST_NULL) (void)MPI_Request_free(&r);
    // A peer that joins late may still match these sends, and MPI then reads the data: it must
    // outlive us. Only a failed all-gather leaves any, and MPI usually sends a small
    // contribution at once (eagerly), so in practice only a large one is still pending.
    (void)p.data.release();
  }
  // After a failure some of our messages may never be received (by a rank that stayed away, or
  // one we stopped listening to). Freed, the communicator's context could be given to a later
  // one, which would then receive them as its own; kept, it is never reused.
  if (comm_ != MPI_COMM_NULL && failure_.empty()) (void)MPI_Comm_free(&comm_);
}

void MpiBootstrap::reap_pending_sends() {
  for (size_t i = 0; i < pending_.size();) {
    bool all_done = true;
    for (MPI_Request& r : pending_[i].requests) {
      int done = 0;
      if (r != MPI_REQUEST_NULL && MPI_Test(&r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
          !done)
        all_done = false;
    }
    if (all_done) {
      pending_.erase(pending_.begin() + long(i));
    } else {
      ++i;
    }
  }
}

void MpiBootstrap::give_up(std::vector<MPI_Request>& recvs, std::vector<MPI_Request>& sends,
                           std::unique_ptr<char[]> data, const std::string& why) {
  // A cancelled receive completes locally, so the wait cannot block; after it MPI no longer
  // writes to the caller's buffer.
  for (MPI_Request& r : recvs) {
    if (r == MPI_REQUEST_NULL) continue;
    (void)MPI_Cancel(&r);
    (void)MPI_Wait(&r, MPI_STATUS_IGNORE);
  }
  // Sends cannot be taken back reliably (MPI_Cancel of a send is deprecated): keep them and
  // their data until they complete.
  PendingSends p;
  for (MPI_Request r : sends)
    if (r != MPI_REQUEST_NULL) p.requests.push_back(r);
  if (!p.requests.empty()) {
    p.data = std::move(data);
    pending_.push_back(std::move(p));
  }
  failure_ = why;
  throw Error(ErrorCode::kBootstrap, prefix() + why);
}

void MpiBootstrap::all_gather(const void* send, void* recv, size_t bytes) {
  if (!failure_.empty())
    throw Error(ErrorCode::kBootstrap,
                prefix() + "an earlier all-gather failed (" + failure_ +
                    "); the ranks are out of step: set up a new MpiBootstrap");
  if (bytes > size_t(INT_MAX))
    throw Error(ErrorCode::kBootstrap, prefix() + "an all-gather of " + std::to_string(bytes) +
                                           " bytes exceeds MPI's int count");
  const long gen = generation_++;
  // A message of another all-gather never matches: each has its own tag (the communicator is
  // ours alone, and after a failure no later all-gather runs).
  const int tag = int(gen % (long(tag_limit_) + 1));
  char* out = static_cast<char*>(recv);
  if (bytes > 0) std::memcpy(out + bytes * size_t(rank_), send, bytes);
  if (size_ == 1) return;

  // Our own copy of the contribution: if we give up, a pending send still reads it after the
  // caller's buffer is gone.
  auto data = std::make_unique<char[]>(bytes > 0 ? bytes : 1);
  if (bytes > 0) std::memcpy(data.get(), send, bytes);
  std::vector<MPI_Request> recvs(size_t(size_), MPI_REQUEST_NULL);
  std::vector<MPI_Request> sends(size_t(size_), MPI_REQUEST_NULL);
  auto fail_call = [&](int rc, const char* what, int peer) {
    give_up(recvs, sends, std::move(data),
            std::string(what) + " (rank " + std::to_string(peer) + ", all-gather " +
                std::to_string(gen) + ") failed: " + mpi_error_text(rc));
  };
  // Every receive is posted before any send, so no send waits on a receive we have not posted.
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const int rc = MPI_Irecv(out + bytes * size_t(p), int(bytes), MPI_BYTE, p, tag, comm_,
                             &recvs[size_t(p)]);
    if (rc != MPI_SUCCESS) fail_call(rc, "MPI_Irecv", p);
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const int rc = MPI_Isend(data.get(), int(bytes), MPI_BYTE, p, tag, comm_, &sends[size_t(p)]);
    if (rc != MPI_SUCCESS) fail_call(rc, "MPI_Isend", p);
  }

  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_);
  for (;;) {
    bool pending = false, progressed = false;
    for (int p = 0; p < size_; ++p) {
      MPI_Request& r = recvs[size_t(p)];
      if (r == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Status st;
      const int rc = MPI_Test(&r, &done, &st);
      if (rc != MPI_SUCCESS) {
        int cls = 0;
        if (MPI_Error_class(rc, &cls) == MPI_SUCCESS && cls == MPI_ERR_TRUNCATE)
          give_up(recvs, sends, std::move(data),
                  "rank " + std::to_string(p) + " contributed more than " +
                      std::to_string(bytes) + " bytes to all-gather " + std::to_string(gen));
        fail_call(rc, "MPI_Test(receive)", p);
      }
      if (!done) {
        pending = true;
        continue;
      }
      progressed = true;
      int count = 0;
      const int crc = MPI_Get_count(&st, MPI_BYTE, &count);
      if (crc != MPI_SUCCESS) fail_call(crc, "MPI_Get_count", p);
      if (count != int(bytes))
        give_up(recvs, sends, std::move(data),
                "rank " + std::to_string(p) + " contributed " + std::to_string(count) +
                    " bytes to all-gather " + std::to_string(gen) + ", not " +
                    std::to_string(bytes));
    }
    for (int p = 0; p < size_; ++p) {
      MPI_Request& r = sends[size_t(p)];
      if (r == MPI_REQUEST_NULL) continue;
      int done = 0;
      const int rc = MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) fail_call(rc, "MPI_Test(send)", p);
      pending = pending || !done;
      progressed = progressed || done;
    }
    if (!pending) return;
    if (std::chrono::steady_clock::now() > deadline) {
      // A peer we heard nothing from did not join. One that sent but has not taken our data
      // yet did join; name it only when no one is missing outright.
      std::vector<int> absent, not_taken;
      for (int p = 0; p < size_; ++p) {
        if (recvs[size_t(p)] != MPI_REQUEST_NULL) absent.push_back(p);
        if (sends[size_t(p)] != MPI_REQUEST_NULL) not_taken.push_back(p);
      }
      std::ostringstream os;
      os << "rank(s) " << rank_list(absent.empty() ? not_taken : absent)
         << (absent.empty() ? " did not take this rank's contribution to all-gather "
                            : " did not join all-gather ")
         << gen << " within " << timeout_ << " s";
      give_up(recvs, sends, std::move(data), os.str());
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace epcomm
