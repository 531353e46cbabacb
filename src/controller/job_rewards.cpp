#include "controller/job_rewards.h"

#include "tiller/reward/rule_reward.h"
#include "tiller/reward/scorer_registry.h"

namespace tiller::controller {

JobRewards make_job_rewards(const JobConfig& cfg, std::function<std::string(const std::vector<int64_t>&)> decode) {
  JobRewards out;
  out.sources.decode = decode;
  if (cfg.reward.type == RewardType::kRule) {
    reward::RewardFn rule = reward::rule_reward_for(cfg.reward.rule);
    out.sources.rule = [rule, decode](const data::Prompt& p, const engine::SampleOutput& s) {
      return rule(reward::Sample{p.text, decode(s.tokens), p.label});
    };
  }
  if (!reward::job_batch_scorer(cfg).empty()) {
    const reward::ScorerSetup s = reward::make_job_batch_scorer(cfg);
    out.batched = std::make_unique<reward::BatchedReward>(s.scorer, s.batch_size, s.concurrency);
    out.batched->begin_step(1);
    out.sources.batched = out.batched.get();
  }
  return out;
}

}  // namespace tiller::controller
