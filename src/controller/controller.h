// The single controller of `tiller train` (rank 0 of the plan; no GPU), private to src/controller.
// It owns the run's state (step, weight version, optimizer-step counts, KL coefficient, reward
// moments) and drives the parts, each in its own file pair:
//   collector.h          prompts to the engines, completions, rewards, the forming step's scoring
//   advantages.h         rewards, KL and advantages (a pure function)
//   off_policy.h         importance weights and masks against the engine's log-probs
//   training_dispatch.h  the actor's and critic's mini-batches and optimizer steps
//   checkpoint_manager.h step_N directories and controller.json
//   step_trace.h         metrics, the Chrome trace, rollout records
//   evaluator.h          eval.prompts on the engines between steps
// over a Channel to the ranks (channel.h: MPI in a job, in-process in tests and benchmarks) and
// an EngineSet (engine_set.h: gRPC engines, or synthetic ones).
//
// One step: wait for the collector's batch, compute advantages, post the training; when the
// training is in, sync the weights to the engines (waiting out the samples in flight first unless
// rollout.partial), then traces, metrics and the checkpoint. In async mode the collector keeps
// generating and scoring the next steps all along, within rollout.max_staleness.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "controller/collector.h"
#include "controller/engine_set.h"
#include "wire/channel.h"

namespace tiller {
struct JobConfig;
}
namespace tiller::python {
class Tracking;
}
namespace tiller::dist {
struct RankPlan;
class Communicator;
}  // namespace tiller::dist

namespace tiller::controller {

// What the controller works with; everything outlives it.
class Evaluator;
class StandaloneEngines;

struct ControllerWiring {
  const dist::RankPlan* plan = nullptr;
  EngineSet* engines = nullptr;
  wire::Channel* channel = nullptr;
  PromptSource* prompts = nullptr;  // its cursor goes into checkpoints
  RewardSources rewards;
  LoopSources loop;                     // the sample loop's environment (null: none) and tokenizer
  std::vector<int64_t> stop_token_ids;  // end a sample (the tokenizer's EOS ids)
  double attention_tokens = 0;          // the actor model's model::attention_cost_tokens (0: balance by tokens)
  std::string sync_plan;             // the bucket plan installed on the engines ("" : none)
  bool require_resume = false;       // --resume: a checkpoint must exist
  bool print_summary = true;         // the summary line on stdout at the end
  const Clock* clock = &Clock::steady();  // of every deadline and phase time (tests: a ManualClock)
  Evaluator* evaluator = nullptr;          // eval.prompts (null: no evaluation)
  // Token ids to text, special tokens kept (the samples file, records' text); null: ids only.
  std::function<std::string(const std::vector<int64_t>&)> decode_text;
  python::Tracking* tracking = nullptr;  // logging.wandb / logging.mlflow (null: none)
  // Standalone engines (engines.addresses / engines.rendezvous_dir): who they are, who joins,
  // who each push goes to (null: the job's own engine ranks).
  StandaloneEngines* standalone = nullptr;
};

class Controller {
 public:
  Controller(const JobConfig& cfg, const ControllerWiring& wiring);
  ~Controller();
  // Runs the steps, then stops every rank. Returns the process exit code (0; a stop by signal
  // after the checkpoint is saved is also 0). Throws on failure (the caller aborts the job).
  int run();
  // The summary of the run, as printed: {"event":"done","steps":...}.
  std::string summary() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct ControllerOptions {
  std::vector<std::string> engine_addresses;  // engine i's host:port (the job's engine ranks)
  std::string engine_token;
  bool require_resume = false;
};

// The controller of a job: loads the tokenizer, the dataset and the rewards, connects to the
// engines and the ranks (MPI), then runs the Controller.
int run_controller(const JobConfig& cfg, const dist::RankPlan& plan, dist::Communicator& world,
                   const ControllerOptions& opts);

// Set by SIGINT/SIGTERM on the controller: finish the step, save, stop.
void request_stop();
bool stop_requested();

}  // namespace tiller::controller
