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
// gets in. Two runs at once in one directory are not supported: give each concurrent job its
// own directory.
class FileBootstrap : public Bootstrap {
 public:
  FileBootstrap(std::string dir, int rank, int size, double timeout_seconds = 60);
  // Reads EPCOMM_RANK, EPCOMM_WORLD_SIZE and EPCOMM_BOOTSTRAP_DIR; throws if any is missing.
  static std::unique_ptr<FileBootstrap> from_env(double timeout_seconds = 60);
  ~FileBootstrap() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* send, void* recv, size_t bytes) override;
  // The run id the ranks agreed on (empty before the first all-gather).
  const std::string& run_id() const { return run_; }

 private:
  void join_run();  // the run-id agreement; sets run_
  std::string file(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
  int rank_;
  int size_;
  double timeout_;
  std::string run_;  // hex run id; names every all-gather file of this run
  long generation_ = 0;
};

}  // namespace epcomm
