// Step hooks: code of a trainer of one's own that runs on the controller (rank 0) at three points
// of every step of `tiller train`, chosen by name (train.step_hooks: "a,b", run in that order):
//   after_scoring  the step's samples are generated and scored (rewards, the reference's and the
//                  critic's passes), the advantages not yet computed: a filter (drop prompt groups)
//                  or a reweighting (change the scores the advantage estimator reads);
//   step_end       the step is trained and its metrics are in: log them elsewhere, add metrics of
//                  its own, or stop the run (the step's checkpoint is saved first);
//   checkpoint     a checkpoint was saved and committed (copy it elsewhere, evaluate it).
// Register with register_step_hook before tiller::run_main (docs/library.md); a name that is not
// registered is refused when the config is loaded. A hook that throws ends the job with an Error
// naming the hook and the point. Hooks run on the controller's thread: what they take, the step
// waits for.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tiller/controller/experience.h"
#include "tiller/controller/metrics.h"
#include "tiller/core/registry_api.h"
#include "tiller/data/prompt_dataset.h"

namespace tiller::controller {

struct ScoredStep {
  int64_t step = 0;           // 1-based
  int64_t n_samples = 1;      // samples per prompt group (rollout.n_samples_per_prompt)
  Rollout* rollout = nullptr;  // the samples (rollout->prompt[s]: sample s's group); change only `score`
  // Per prompt group, 1: train on it. Set 0 to drop the group: its samples are not trained and it
  // is counted in rollout/filtered_groups (the step trains on fewer groups; none is drawn in its
  // place). Whole groups only, so group baselines always see all n samples of a prompt.
  std::vector<uint8_t>* keep_group = nullptr;
  std::function<const data::Prompt&(int64_t group)> prompt;            // the group's prompt record
  std::function<std::string(int64_t sample)> response_text;      // decoded ("" without a tokenizer)
};

struct StepEnd {
  int64_t step = 0;
  const Metrics* metrics = nullptr;  // everything the step logs (metrics.jsonl's line, less these)
  Metrics* add = nullptr;            // metrics of the hook's own, logged with the step's
  bool* stop = nullptr;              // set true to end the run after this step (checkpoint saved)
};

struct CheckpointSaved {
  int64_t step = 0;
  std::string dir;  // the committed checkpoint's directory
};

struct StepHookDef {
  std::function<void(ScoredStep&)> after_scoring;      // each may be empty
  std::function<void(StepEnd&)> step_end;
  std::function<void(const CheckpointSaved&)> checkpoint;
  std::string summary;  // one line
};

// A ConfigError for an invalid name, one registered already, or a hook with no function.
// find_step_hook: the hook registered as `name`; a ConfigError naming train.step_hooks, the registered names and
// the closest one otherwise.
TILLER_REGISTRY_API(step_hook, StepHookDef);
// The lookup's old name, for one release.
inline const StepHookDef& step_hook(const std::string& name) { return find_step_hook(name); }
// The hooks of a train.step_hooks value ("", or names separated by commas, spaces allowed), in
// order; a ConfigError for an unknown name, an empty one or one given twice.
std::vector<std::pair<std::string, const StepHookDef*>> parse_step_hooks(const std::string& list);

}  // namespace tiller::controller
