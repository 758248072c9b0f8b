#include "epcomm/mpi_bootstrap.h"

#include <string>

#include "epcomm/error.h"

namespace epcomm {

namespace {
void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw Error(ErrorCode::kBootstrap, std::string("MPI bootstrap: ") + what + ": " + msg);
  }
}
}  // namespace

MpiBootstrap::MpiBootstrap(MPI_Comm comm) : comm_(comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw Error(ErrorCode::kBootstrap, "MPI bootstrap: MPI is not initialised");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

void MpiBootstrap::all_gather(const void* send, void* recv, size_t bytes) {
  check_mpi(MPI_Allgather(send, int(bytes), MPI_BYTE, recv, int(bytes), MPI_BYTE, comm_),
            "MPI_Allgather");
}

}  // namespace epcomm
