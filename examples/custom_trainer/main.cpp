// A trainer of your own: tiller's launcher with a reward function, an advantage estimator, a
// policy loss and a step hook that tiller does not ship.
//
//   mpirun -np 4 build-trainer/custom_trainer train -c configs/quickstart.yaml \
//       --set reward.rule=label_digits --set algo.advantage_estimator=clipped_gae \
//       --set algo.policy_loss=cispo --set train.step_hooks=best_reward
//
// Every rank registers them before run_main (the controller calls the reward, the estimator and
// the hook; the actor's ranks call the loss).
// Everything else - the rank plan, the engines, ZeRO-3, the weight sync, checkpoints, metrics -
// is the stock `tiller train`; the other subcommands (plan, config, bench, ...) work too.
#include <algorithm>
#include <fstream>
#include <iomanip>
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <tiller/tiller.h>

namespace {

// The share of the label's distinct digits that the response contains: the quickstart's labels
// are two-digit numbers, so "74" earns 0.5 for a response with a 7 and no 4. A random model
// rarely writes digits (about 0.05); it learns to.
double label_digits(const tiller::reward::Sample& s) {
  std::set<char> want;
  for (char c : s.label)
    if (c >= '0' && c <= '9') want.insert(c);
  if (want.empty()) return 0.0;
  int found = 0;
  for (char c : want) found += s.response_text.find(c) != std::string::npos ? 1 : 0;
  return static_cast<double>(found) / static_cast<double>(want.size());
}

// GAE whose advantages are clipped to [-2, 2] before whitening: a young critic's values are far
// off, and a few tokens with huge advantages would otherwise dominate the step. Like GAE it needs
// the critic, whose targets (the returns) stay unclipped.
tiller::algo::AdvantageOutputs clipped_gae(const tiller::algo::AdvantageInputs& in) {
  const tiller::algo::AdvantagesReturns ar = tiller::algo::gae(in.rewards, in.values, in.cu, in.gamma, in.lambda);
  return {at::clamp(ar.advantages, -2.0, 2.0), ar.returns};
}

// CISPO (MiniMax-M1, 2025): the policy gradient weighted by the importance ratio clipped and
// detached, -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp, so that no token's gradient is
// cut off as PPO's clip cuts it (rare tokens with large ratios keep contributing).
tiller::algo::PolicyLoss cispo(const tiller::algo::PolicyLossInputs& in) {
  const at::Tensor ratio = (in.logp.detach() - in.old_logp).exp();
  const at::Tensor weight = ratio.clamp(1.0 - in.clip.clip_low, 1.0 + in.clip.clip_high);
  at::Tensor per_token = -weight * in.advantages * in.logp;
  if (in.is_weights.defined()) per_token = per_token * in.is_weights;
  tiller::algo::PolicyLoss out;
  out.loss = per_token.sum() / in.normalizer;
  out.tokens = in.logp.numel();
  out.clipped_tokens = (weight != ratio).to(at::kDouble).sum();  // tokens whose weight was clipped
  out.kl_sum = (in.old_logp - in.logp.detach()).to(at::kDouble).sum();
  return out;
}

// A step hook: the best mean reward so far, logged with every step (custom/best_reward_mean) and
// written beside each checkpoint (custom_trainer.json), so a run's best is known without reading
// its metrics.
double best_reward = -1e300;

void best_reward_at_step_end(tiller::rollout::StepEnd& e) {
  for (const auto& [name, value] : *e.metrics)
    if (name == "reward/mean") best_reward = std::max(best_reward, value);
  e.add->emplace_back("custom/best_reward_mean", best_reward);
}

void best_reward_at_checkpoint(const tiller::rollout::CheckpointSaved& c) {
  std::ofstream f(c.dir + "/custom_trainer.json");
  f << std::setprecision(17) << "{\"step\": " << c.step << ", \"best_reward_mean\": " << best_reward << "}\n";
  if (!f) throw tiller::IoError("cannot write " + c.dir + "/custom_trainer.json");
}

}  // namespace

int main(int argc, char** argv) {
  tiller::reward::register_fn("label_digits", label_digits);
  tiller::algo::AdvantageEstimatorDef est;
  est.compute = clipped_gae;
  est.needs_critic = true;
  est.summary = "GAE with advantages clipped to [-2, 2]";
  tiller::algo::register_advantage_estimator("clipped_gae", est);
  tiller::algo::register_policy_loss("cispo", {cispo, "CISPO: -sg(clip(ratio)) * A * logp"});
  tiller::rollout::StepHookDef hook;
  hook.step_end = best_reward_at_step_end;
  hook.checkpoint = best_reward_at_checkpoint;
  hook.summary = "the best reward/mean so far, as a metric and beside each checkpoint";
  tiller::rollout::register_step_hook("best_reward", hook);
  return tiller::run_main(argc, argv);
}
