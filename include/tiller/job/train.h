// `tiller train`: one PPO job under mpirun (docs/architecture.md, docs/training.md). Every rank of
// the job calls run_train with the same config; each computes the same rank plan and takes its part:
//   rank plan.controller   the single controller (dataset, dispatch, advantages, metrics, checkpoints)
//   trainer ranks          actor / critic / ref / reward models, serving the controller's micro-batches
//   engine ranks           inference engines behind gRPC; the TP leader serves, the others follow
// The run ends when train.num_steps are done, or after a SIGINT/SIGTERM to the controller (it
// finishes the step, saves a checkpoint, then stops every rank). Any rank's failure prints one
// line naming the rank and the cause, then aborts the whole job (MPI_Abort): no rank is left
// waiting, and checkpoints already written stay complete (they are written atomically).
#pragma once

#include <string>

namespace tiller {
struct JobConfig;
}
namespace tiller::dist {
class MpiEnv;
}

namespace tiller::job {

struct TrainOptions {
  bool require_resume = false;  // --resume: fail when checkpoint.dir holds no complete checkpoint
};

// Collective over the whole job. Returns this rank's exit code. It blocks SIGINT and SIGTERM in the
// calling thread; block them before creating the MpiEnv too (as `tiller train` does), so that no
// thread started earlier (MPI's) takes their default action.
int run_train(const JobConfig& cfg, dist::MpiEnv& env, const TrainOptions& options);

}  // namespace tiller::job
