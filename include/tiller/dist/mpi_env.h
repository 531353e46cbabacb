// The MPI bootstrap: MPI_Init_thread, the node map, and communicators over MPI ranks.
//
// One MpiEnv per process, created first thing in main (MPI is initialised once per process;
// creating a second MpiEnv while one lives is an error). Its destructor finalizes MPI, except
// while an exception unwinds: then the process exits unfinalized and mpirun ends the job.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tiller/dist/communicator.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::dist {

class MpiEnv {
 public:
  // Initialises MPI (asks for MPI_THREAD_MULTIPLE; needs at least FUNNELED).
  MpiEnv(int* argc, char*** argv);
  ~MpiEnv();
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& hostname() const { return hostname_; }

  // Collective over the world: which ranks share a node (MPI_Comm_split_type shared), with each
  // node's GPU count: gpus_per_node if > 0, else the CUDA device count, or -1 on a CPU run.
  NodeMap node_map(int gpus_per_node, bool cpu_run, double timeout_s) const;

  // Collective over the world: on each node its lowest rank runs `work` (a download into the
  // node's cache, say) while the node's other ranks wait, until every node's `work` is done, at
  // most `timeout_s`. A `work` that throws ends this call on its rank only (the caller ends the
  // job, as for any error: fail_job, whose abort ends the waiting ranks too). A wait past
  // `timeout_s` is a CommError naming `what` ("the download of the job's hub models
  // (timeouts.download_s)").
  void once_per_node(const std::function<void()>& work, const std::string& what, double timeout_s) const;

  // The world as an MPI-backend communicator (CPU tensors).
  std::unique_ptr<Communicator> world(double timeout_s) const;

  // An NCCL communicator over the ranks of `over` (which every rank of it calls with the same
  // name), on CUDA device `device`. Throws CommError in a build without NCCL.
  static std::unique_ptr<Communicator> nccl(Communicator& over, int device, const std::string& name,
                                            double timeout_s);
  static bool have_nccl();

  // Aborts every process of the job (MPI_Abort) with `code`: for errors that leave a
  // collective pending, so no rank stays behind waiting.
  [[noreturn]] static void abort_job(int code);

  // Prints "tiller: error: rank R: <what>" and ends the job at once (abort_job with exit_code_for(e)),
  // without unwinding: a rank that fails while a peer waits in a collective with it would otherwise
  // block in its communicators' teardown until their deadline, and its error with it. With the
  // watchdog running (watchdog.h), every rank prints where it was first (Watchdog::end_job).
  [[noreturn]] static void fail_job(int rank, const std::exception& e);

 private:
  int rank_ = 0;
  int size_ = 1;
  std::string hostname_;
};

}  // namespace tiller::dist
