// The MPI bootstrap: ranks are the processes of an MPI communicator (mpirun -np N ...).
// Built when CMake finds MPI (target epcomm::epcomm_mpi); MPI must be initialised by the caller.
//
// all_gather is bounded, as every epcomm wait is: it is built from non-blocking point-to-point
// messages, and a rank that does not join within timeout_seconds is named in the
// Error(kBootstrap) the others throw ("MPI bootstrap (rank 0): rank(s) 3 did not join all-gather
// 5 within 10 s"). An MPI collective (MPI_Allgather) could not give up on a missing process.
// After such a failure the ranks are out of step (some counted an all-gather the others never
// made), so every later all_gather of this bootstrap throws: make a new one. (The failed one
// keeps its communicator until MPI_Finalize, so that messages still in flight to it can never
// reach a later one.)
//
// The constructor duplicates `comm`, so the bootstrap's messages never mix with the caller's
// (wildcard receives included). That makes the constructor collective over `comm` and, like any
// MPI collective, unbounded: construct the bootstrap where every process is sure to arrive (right
// after MPI_Init, say), and let the bounded all_gather (Group::create) catch a process that stops
// later. Destroy it before MPI_Finalize.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"

namespace epcomm {

class MpiBootstrap : public Bootstrap {
 public:
  explicit MpiBootstrap(MPI_Comm comm = MPI_COMM_WORLD, double timeout_seconds = 60);
  ~MpiBootstrap() override;
  MpiBootstrap(const MpiBootstrap&) = delete;
  MpiBootstrap& operator=(const MpiBootstrap&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* send, void* recv, size_t bytes) override;

 private:
  // The sends of an all-gather that gave up before every peer took its data, with the copy of
  // the data they read: MPI may read it until the send completes.
  struct PendingSends {
    std::vector<MPI_Request> requests;
    std::unique_ptr<char[]> data;
  };
  std::string prefix() const;
  void check(int rc, const char* what) const;
  void reap_pending_sends();
  [[noreturn]] void give_up(std::vector<MPI_Request>& recvs, std::vector<MPI_Request>& sends,
                            std::unique_ptr<char[]> data, const std::string& why);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1;
  int size_ = 0;
  double timeout_;
  int tag_limit_ = 32767;  // MPI_TAG_UB of the communicator: tags cycle through [0, tag_limit_]
  long generation_ = 0;    // all-gathers started
  std::string failure_;    // why the first failed all-gather failed; later ones throw it
  std::vector<PendingSends> pending_;
};

}  // namespace epcomm
