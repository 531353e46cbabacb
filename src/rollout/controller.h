// The single controller of `tiller train` (rank 0 of the plan; no GPU). It drives every step
// (DESIGN.md §3): prompts from the dataset to the engines (least-loaded dispatch, n samples per
// prompt), completions streamed back and packed into token-budget rounds for the scoring groups
// while generation continues, rewards and advantages on the host, training micro-batches to the
// actor and critic groups at once, then the weight sync; metrics, checkpoints and the trace.
// Private to src/rollout; run_train (train.h) builds it.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace tiller {
struct JobConfig;
}
namespace tiller::dist {
struct RankPlan;
class Communicator;
}  // namespace tiller::dist

namespace tiller::rollout {

struct ControllerOptions {
  std::vector<std::string> engine_addresses;  // engine i's host:port
  std::string engine_token;
  bool require_resume = false;                 // --resume: a checkpoint must exist
};

class Controller {
 public:
  Controller(const JobConfig& cfg, const dist::RankPlan& plan, dist::Communicator& world, ControllerOptions opts);
  ~Controller();
  // Runs the steps, then stops every rank. Returns the process exit code (0; a stop by signal
  // after the checkpoint is saved is also 0). Throws on failure (the caller aborts the job).
  int run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Set by SIGINT/SIGTERM on the controller: finish the step, save, stop.
void request_stop();
bool stop_requested();

}  // namespace tiller::rollout
