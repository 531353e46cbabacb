// Runs the job's step hooks (tiller/controller/step_hooks.h) for the controller (private to
// src/controller): each hook's call wrapped so that what it throws names the hook and the point, and
// what it hands back checked before the step goes on.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tiller/controller/step_hooks.h"

namespace tiller::controller {

class StepHookRunner {
 public:
  // train.step_hooks (ConfigError for an unknown name).
  explicit StepHookRunner(const std::string& list);

  bool has_after_scoring() const;
  // The after_scoring hooks on a scored step: `ro`'s scores may change (they must stay finite);
  // returns one keep flag per prompt group. Error (naming the hook) when a hook throws, changes the
  // number of samples or groups, or leaves a score that is not finite.
  std::vector<uint8_t> after_scoring(int64_t step, int64_t n_samples, Rollout& ro, int64_t groups,
                                     const std::function<const data::Prompt&(int64_t group)>& prompt,
                                     const std::function<std::string(const std::vector<int64_t>&)>& decode) const;
  // The step_end hooks: their metrics are appended to `metrics` (a name tiller logs already, or
  // an empty one, is an Error); true when one asked to stop (stopped_by() names it).
  bool step_end(int64_t step, Metrics& metrics);
  void checkpoint(int64_t step, const std::string& dir) const;
  const std::string& stopped_by() const { return stopped_by_; }

 private:
  std::vector<std::pair<std::string, const StepHookDef*>> hooks_;
  std::string stopped_by_;
};

}  // namespace tiller::controller
