// The rewards of a job (private to src/controller): the rule function, or the batch scorer made
// through the registry (tiller/reward/scorer_registry.h), that reward.type names, in the form the
// collector takes them. Model and environment rewards come from elsewhere (the reward role, the
// environment): for them both are empty.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "controller/collector.h"
#include "tiller/core/config.h"
#include "tiller/reward/batched_reward.h"

namespace tiller::controller {

struct JobRewards {
  RewardSources sources;                            // sources.batched points into `batched`
  std::unique_ptr<reward::BatchedReward> batched;
};

// `decode`: a response's text from its ids (the tokenizer's, special tokens skipped).
JobRewards make_job_rewards(const JobConfig& cfg, std::function<std::string(const std::vector<int64_t>&)> decode);

}  // namespace tiller::controller
