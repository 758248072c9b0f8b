// The MPI bootstrap: ranks are the processes of an MPI communicator (mpirun -np N ...).
// Built when CMake finds MPI (target epcomm::epcomm_mpi); MPI must be initialised by the caller.
#pragma once

#include <mpi.h>

#include "epcomm/bootstrap.h"

namespace epcomm {

class MpiBootstrap : public Bootstrap {
 public:
  explicit MpiBootstrap(MPI_Comm comm = MPI_COMM_WORLD);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* send, void* recv, size_t bytes) override;

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 0;
};

}  // namespace epcomm
