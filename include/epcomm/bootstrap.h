// Bootstrap: how the ranks of a group find each other at set-up. One collective is enough, an
// all-gather of bytes; epcomm uses it to compare configurations and exchange memory handles.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace epcomm {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank contributes `bytes` bytes from `send`; `recv` receives size()*bytes bytes, rank
  // r's contribution at offset r*bytes. Collective: every rank calls it with the same `bytes`.
  // Throws Error(kBootstrap) on failure or after `timeout_seconds` without all ranks.
  virtual void all_gather(const void* send, void* recv, size_t bytes) = 0;
  // A barrier, built on all_gather.
  void barrier();
};

// Ranks that are threads of one process (used by the one-process, all-GPUs mode and by tests).
// make_thread_bootstraps(n) returns n endpoints sharing one rendezvous; give endpoint r to the
// thread acting as rank r. If any endpoint is destroyed or fails mid-collective, the others
// throw instead of waiting forever.
std::vector<std::unique_ptr<Bootstrap>> make_thread_bootstraps(int n, double timeout_seconds = 60);

// Ranks that are processes sharing a file system (any launcher): an all-gather through files in
// `dir`. Rank, size and dir usually come from the environment: see from_env().
//
// The directory may hold files of an earlier run (a restarted job that reuses its rendezvous
// directory, a process of the old run still writing): they are never read. Before the first
// all-gather the ranks agree on a run id: rank 0 draws one and announces it together with the
// fresh nonce each other rank published (join file), and each rank confirms it saw its own
// nonce (ack file); every later file names the run id. Rank 0 rewrites the announcement when
// a nonce changes, so a rank that arrives late, after an old run's join file was read, still
// gets in.
//
// `job` names the launch (a launcher's job id, the same on every rank): every file of this
// bootstrap carries it, so jobs with different names never see each other's files, even
// running at once in one directory. Without one, an earlier run's rank 0 that is still
// waiting in its own handshake (its peers gone) could take in a new run's rank: give each job
// its own directory or a name. from_env() takes the launcher's id where there is one.
class FileBootstrap : public Bootstrap {
 public:
  FileBootstrap(std::string dir, int rank, int size, double timeout_seconds = 60,
                std::string job = "");
  // Reads EPCOMM_RANK, EPCOMM_WORLD_SIZE and EPCOMM_BOOTSTRAP_DIR (throws if any is missing),
  // and the job name from EPCOMM_BOOTSTRAP_JOB, else the launcher's: torchrun's
  // TORCHELASTIC_RUN_ID with TORCHELASTIC_RESTART_COUNT, Slurm's SLURM_JOB_ID with
  // SLURM_STEP_ID, Open MPI's OMPI_MCA_ess_base_jobid, PMIx's PMIX_NAMESPACE (else none).
  static std::unique_ptr<FileBootstrap> from_env(double timeout_seconds = 60);
  // The job name as the file names carry it (letters, digits, '_' and '-'; others become '_').
  const std::string& job() const { return job_; }
  ~FileBootstrap() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* send, void* recv, size_t bytes) override;
  // The run id the ranks agreed on (empty before the first all-gather).
  const std::string& run_id() const { return run_; }

 private:
  void join_run();  // the run-id agreement; sets run_
  std::string file(const std::string& name) const {
    return dir_ + "/" + (job_.empty() ? name : job_ + "." + name);
  }
  // Rank r's file of a kind: "<kind>_r<r>".
  std::string member_file(const std::string& kind, int r) const {
    return file(kind + "_r" + std::to_string(r));
  }

  std::string dir_;
  std::string job_;
  int rank_;
  int size_;
  double timeout_;
  std::string run_;  // hex run id; names every all-gather file of this run
  long generation_ = 0;
};

}  // namespace epcomm
