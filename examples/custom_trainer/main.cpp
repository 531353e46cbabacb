// A trainer of your own: tiller's launcher with a reward function, an advantage estimator, a
// policy loss, a step hook, a prompt source and a sample loop (an agent of two turns) that tiller
// does not ship.
//
//   mpirun -np 4 build-trainer/custom_trainer train -c configs/quickstart.yaml \
//       --set reward.rule=label_digits --set algo.advantage_estimator=clipped_gae \
//       --set algo.policy_loss=cispo --set train.step_hooks=best_reward --set data.source=digit_tasks
//   (and --set rollout.loop=revise --set "rollout.loop_args= Digits:" for the two-turn agent)
//
// Every rank registers them before run_main (the controller calls the reward, the estimator and
// the hook; the actor's ranks call the loss).
// Everything else - the rank plan, the engines, ZeRO-3, the weight sync, checkpoints, metrics -
// is the stock `tiller train`; the other subcommands (plan, config, bench, ...) work too.
#include <algorithm>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

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
  out.metrics.emplace_back("weight_mean", weight.to(at::kDouble).sum());  // logged per token: actor/policy_loss/weight_mean
  return out;
}

// A step hook: the best mean reward of a step so far, taken as each step is scored (so a step's
// checkpoint counts the step), logged with every step (custom/best_reward_mean) and written beside
// each checkpoint (custom_trainer.json), so a run's best is known without reading its metrics.
double best_reward = -1e300;

void best_reward_after_scoring(tiller::controller::ScoredStep& s) {
  const auto& scores = s.rollout->score;
  if (scores.empty()) return;
  double sum = 0;
  for (float x : scores) sum += x;
  best_reward = std::max(best_reward, sum / static_cast<double>(scores.size()));
}

void best_reward_at_step_end(tiller::controller::StepEnd& e) { e.add->emplace_back("custom/best_reward_mean", best_reward); }

void best_reward_at_checkpoint(const tiller::controller::CheckpointSaved& c) {
  std::ofstream f(c.dir + "/custom_trainer.json");
  f << std::setprecision(17) << "{\"step\": " << c.step << ", \"best_reward_mean\": " << best_reward << "}\n";
  if (!f) throw tiller::IoError("cannot write " + c.dir + "/custom_trainer.json");
}

// A prompt source: the quickstart's kind of task, generated instead of read from a file. Prompt i
// is made from (run.seed, i) alone - a few of the quickstart's words and a number to say - so a
// resumed run makes the same prompts again; data.source_args "MIN-MAX" bounds the numbers.
class DigitTasks final : public tiller::controller::PromptSource {
 public:
  DigitTasks(const tiller::controller::PromptSourceContext& c) : make_(c.make_prompt), seed_(c.job->run.seed) {
    const std::string& a = c.job->data.source_args;
    if (!a.empty()) {
      const size_t dash = a.find('-');
      try {
        size_t used_lo = 0, used_hi = 0;
        lo_ = std::stoll(a.substr(0, dash), &used_lo);
        hi_ = std::stoll(a.substr(dash + 1), &used_hi);
        if (dash == std::string::npos || used_lo != dash || used_hi != a.size() - dash - 1) lo_ = -1;
      } catch (const std::exception&) {
        lo_ = -1;
      }
    }
    if (lo_ < 0 || hi_ < lo_ || hi_ > 999999)
      throw tiller::ConfigError("data.source_args = '" + a + "': give MIN-MAX with 0 <= MIN <= MAX <= 999999, e.g. 10-99");
  }
  int64_t next() override { return position_++; }
  const tiller::data::Prompt& at(int64_t i) const override {
    auto it = made_.find(i);
    if (it != made_.end()) return it->second;
    static const char* words[] = {"write", "digits", "more", "count", "list", "numbers", "some", "now", "give"};
    uint64_t h = mix(static_cast<uint64_t>(seed_) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i));
    std::string text;
    for (int w = 0, n = 2 + static_cast<int>(h % 4); w < n; ++w) {
      h = mix(h);
      text += std::string(w ? " " : "") + words[h % 9];
    }
    h = mix(h);
    const int64_t number = lo_ + static_cast<int64_t>(h % static_cast<uint64_t>(hi_ - lo_ + 1));
    tiller::data::Prompt p = make_(text + ":", std::to_string(number));
    p.line = i + 1;
    return made_.emplace(i, std::move(p)).first->second;
  }
  tiller::data::DatasetCursor cursor() const override { return {0, position_}; }
  void seek(const tiller::data::DatasetCursor& c) override { position_ = c.position; }

 private:
  static uint64_t mix(uint64_t x) {  // splitmix64's finaliser
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }
  std::function<tiller::data::Prompt(const std::string&, const std::string&)> make_;
  int64_t seed_;
  int64_t lo_ = 10, hi_ = 99;
  int64_t position_ = 0;
  mutable std::map<int64_t, tiller::data::Prompt> made_;
};


// A sample loop: each sample is a draft and a revision. The model answers the prompt (the group's
// one request of n samples), the loop appends a hint of its own (rollout.loop_args, e.g.
// '" digits please"') and the model answers once more, seeing its draft. The hint's tokens are the
// loop's, not the model's: they are masked out of the loss. The draft and the revision share the
// sample's budget (rollout.max_new_tokens) after the hint, half each.
class Revise final : public tiller::controller::SampleLoop {
 public:
  explicit Revise(const tiller::controller::SampleLoopContext& c) : host_(*c.host), ctx_(c) {
    if (c.job->rollout.loop_args.empty())
      throw tiller::ConfigError("rollout.loop = revise: give the hint as rollout.loop_args, e.g. ' Digits:'");
    hint_ = c.observation_tokens(c.job->rollout.loop_args, false, /*raw=*/true);
    half_ = (c.max_response_tokens - static_cast<int64_t>(hint_.size())) / 2;
    if (half_ < 1)
      throw tiller::ConfigError("rollout.loop = revise: the hint leaves no room for two answers in rollout.max_new_tokens");
  }
  void start(int64_t group) override {
    tiller::engine::Request r;
    r.prompt = host_.prompt(group).tokens;
    r.n = ctx_.n;
    r.params = ctx_.sampling;
    r.params.seed = host_.seed(group);
    r.params.max_new_tokens = half_;
    host_.generate(group, std::move(r), /*whole_group=*/true);
  }
  void generated(int64_t group, uint64_t request, tiller::engine::SampleOutput out) override {
    if (request == static_cast<uint64_t>(group)) {  // a draft: ask for the revision
      tiller::engine::Request r;
      r.prompt = host_.prompt(group).tokens;
      r.prompt.insert(r.prompt.end(), out.tokens.begin(), out.tokens.end());
      r.prompt.insert(r.prompt.end(), hint_.begin(), hint_.end());
      r.params = ctx_.sampling;
      r.params.seed = host_.seed(group) + 7919 * static_cast<uint64_t>(ctx_.n) + static_cast<uint64_t>(out.sample);
      r.params.max_new_tokens = half_;
      revising_.emplace(host_.generate(group, std::move(r), false), std::make_pair(group, std::move(out)));
      return;
    }
    auto it = revising_.find(request);
    tiller::engine::SampleOutput draft = std::move(it->second.second);
    revising_.erase(it);
    finish(group, std::move(draft), std::move(out));
  }
  void drop(int64_t group) override {
    host_.abort(group, static_cast<uint64_t>(group));
    for (auto it = revising_.begin(); it != revising_.end();) {
      if (it->second.first != group) {
        ++it;
        continue;
      }
      host_.abort(group, it->first);
      it = revising_.erase(it);
    }
  }

 private:
  void finish(int64_t group, tiller::engine::SampleOutput draft, tiller::engine::SampleOutput revision) {
    tiller::controller::FinishedSample f;
    f.sample = draft.sample;
    f.turns.loss_mask.assign(draft.tokens.size(), 1);
    f.turns.ends.push_back(static_cast<int64_t>(draft.tokens.size()) - 1);
    f.turns.rewards.push_back(0.f);  // the reward (reward.rule) scores the whole sample
    f.out = std::move(draft);
    if (!revision.tokens.empty()) {
      const auto base = static_cast<int64_t>(f.out.tokens.size() + hint_.size());
      f.out.tokens.insert(f.out.tokens.end(), hint_.begin(), hint_.end());
      f.out.logprobs.insert(f.out.logprobs.end(), hint_.size(), 0.f);
      f.turns.loss_mask.insert(f.turns.loss_mask.end(), hint_.size(), 0);
      f.out.tokens.insert(f.out.tokens.end(), revision.tokens.begin(), revision.tokens.end());
      f.out.logprobs.insert(f.out.logprobs.end(), revision.logprobs.begin(), revision.logprobs.end());
      f.turns.loss_mask.insert(f.turns.loss_mask.end(), revision.tokens.size(), 1);
      // The revision's weight versions continue the draft's runs.
      for (size_t i = 0; i < revision.versions.size(); ++i)
        if (f.out.versions.empty() || f.out.versions.back() != revision.versions[i]) {
          f.out.version_starts.push_back(base + revision.version_starts[i]);
          f.out.versions.push_back(revision.versions[i]);
        }
      f.turns.ends.push_back(static_cast<int64_t>(f.out.tokens.size()) - 1);
      f.turns.rewards.push_back(0.f);
      f.out.finish_reason = revision.finish_reason;
    }
    host_.finish(group, std::move(f));
  }

  tiller::controller::LoopHost& host_;
  tiller::controller::SampleLoopContext ctx_;
  std::vector<int64_t> hint_;
  int64_t half_ = 1;  // the draft's tokens, and the revision's
  std::map<uint64_t, std::pair<int64_t, tiller::engine::SampleOutput>> revising_;  // request -> (group, draft)
};

}  // namespace

int main(int argc, char** argv) {
  tiller::reward::register_rule_reward("label_digits", label_digits);
  tiller::algo::AdvantageEstimatorDef est;
  est.compute = clipped_gae;
  est.needs_critic = true;
  est.summary = "GAE with advantages clipped to [-2, 2]";
  tiller::algo::register_advantage_estimator("clipped_gae", est);
  tiller::algo::register_policy_loss("cispo", {cispo, "CISPO: -sg(clip(ratio)) * A * logp"});
  tiller::controller::StepHookDef hook;
  hook.after_scoring = best_reward_after_scoring;
  hook.step_end = best_reward_at_step_end;
  hook.checkpoint = best_reward_at_checkpoint;
  hook.summary = "the best reward/mean so far, as a metric and beside each checkpoint";
  tiller::controller::register_step_hook("best_reward", hook);
  tiller::controller::register_prompt_source(
      "digit_tasks", {[](const tiller::controller::PromptSourceContext& c) -> std::unique_ptr<tiller::controller::PromptSource> {
                        return std::make_unique<DigitTasks>(c);
                      },
                      "generated quickstart tasks: a few words and a number to say"});
  tiller::controller::SampleLoopDef revise;
  revise.make = [](const tiller::controller::SampleLoopContext& c) -> std::unique_ptr<tiller::controller::SampleLoop> {
    return std::make_unique<Revise>(c);
  };
  revise.turns = true;  // its samples carry a loss mask (the hint's tokens: 0)
  revise.summary = "a draft, the loop's hint, and a revision";
  tiller::controller::register_sample_loop("revise", revise);
  return tiller::run_main(argc, argv);
}
