#include "rollout/training_dispatch.h"

#include <algorithm>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "rollout/batch.h"
#include "tiller/core/error.h"

namespace tiller::rollout {

TrainingConfig TrainingConfig::from_job(const JobConfig& job, bool have_ref) {
  TrainingConfig c;
  c.train_batch_size = job.train.train_batch_size;
  c.ppo_epochs = job.algo.ppo_epochs;
  c.micro_batch_tokens = job.train.micro_batch_tokens;
  c.max_new_tokens = job.rollout.max_new_tokens;
  c.dr_grpo = job.algo.advantage_estimator == AdvantageEstimator::kDrGrpo;
  c.kl_loss = !job.algo.kl_in_reward && have_ref;
  c.seed = static_cast<uint64_t>(job.run.seed);
  c.actor_lr = job.train.actor_lr;
  c.critic_lr = job.train.critic_lr;
  const int64_t samples = job.rollout.batch_size * job.rollout.n_samples_per_prompt;
  const int64_t per_step = samples / job.train.train_batch_size * job.algo.ppo_epochs;
  c.actor_schedule = zero::LrSchedule::from_config(job.train);
  c.actor_schedule.total_steps =
      std::max<int64_t>(1, (job.train.num_steps - job.train.critic_warmup_steps) * per_step);
  c.critic_schedule = c.actor_schedule;
  c.critic_schedule.total_steps = std::max<int64_t>(1, job.train.num_steps * per_step);
  c.timeout_s = job.timeouts.train_s;
  return c;
}

TrainingDispatch::TrainingDispatch(const TrainingConfig& cfg, TrainerLink& link, const TrainerGroup* actor,
                                   const TrainerGroup* critic)
    : cfg_(cfg), link_(link), actor_(actor), critic_(critic) {
  TILLER_CHECK(actor_ != nullptr, "training dispatch: no actor group");
}

void TrainingDispatch::start(const StepBatch& batch, const OffPolicy& off_policy, bool train_actor, double kl_coef) {
  batch_ = &batch;
  off_policy_ = &off_policy;
  kl_coef_ = kl_coef;
  plans_.clear();
  acc_ = std::make_shared<std::map<Role, Totals>>();
  const Rollout& ro = batch.ro;
  const std::vector<int64_t> lens = ro.seq_lens();
  std::mt19937_64 rng(cfg_.seed * 7919ull + static_cast<uint64_t>(batch.step - 1));
  // Samples are numbered in arrival order, which timing decides; the optimizer steps take them in
  // (prompt, sample) order shuffled by the seed.
  std::vector<int64_t> canonical(static_cast<size_t>(ro.size()));
  std::iota(canonical.begin(), canonical.end(), 0);
  std::sort(canonical.begin(), canonical.end(), [&](int64_t a, int64_t b) {
    return std::make_pair(ro.prompt[a], ro.sample[a]) < std::make_pair(ro.prompt[b], ro.sample[b]);
  });
  if (train_actor) plans_.push_back({actor_, Role::kActor, {}, {}});
  if (critic_) plans_.push_back({critic_, Role::kCritic, {}, {}});
  for (int64_t epoch = 0; epoch < cfg_.ppo_epochs; ++epoch) {
    std::vector<int64_t> order = canonical;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t start = 0; start < order.size(); start += static_cast<size_t>(cfg_.train_batch_size)) {
      const std::vector<int64_t> chunk(
          order.begin() + static_cast<std::ptrdiff_t>(start),
          order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), start + cfg_.train_batch_size)));
      for (auto& p : plans_) {
        std::vector<int64_t> samples;
        for (int64_t s : chunk)
          if (p.role != Role::kActor || !off_policy.masked[static_cast<size_t>(s)]) samples.push_back(s);
        int64_t tokens = 0;
        for (int64_t s : samples) tokens += ro.response_len[s];
        p.normalizers.push_back(cfg_.dr_grpo ? static_cast<double>(samples.size() * cfg_.max_new_tokens)
                                             : static_cast<double>(std::max<int64_t>(tokens, 1)));
        p.steps.push_back(plan_rounds(samples, lens, static_cast<int>(p.group->ranks.size()), cfg_.micro_batch_tokens));
      }
    }
  }
  steps_ = plans_.empty() ? 0 : plans_.front().steps.size();
  posted_ = answered_ = 0;
  answers_left_ = std::make_shared<std::vector<int>>(steps_, 0);
  for (size_t i = 0; i < steps_; ++i)
    for (const auto& p : plans_) (*answers_left_)[i] += static_cast<int>(p.group->ranks.size());
}

void TrainingDispatch::post_step(size_t i) {
  const Rollout& ro = batch_->ro;
  size_t rounds = 0;
  for (const auto& p : plans_) rounds = std::max(rounds, p.steps[i].size());
  // Actor and critic rounds interleaved: on different ranks they compute at the same time.
  for (size_t r = 0; r < rounds; ++r)
    for (const auto& p : plans_) {
      if (r >= p.steps[i].size()) continue;
      for (size_t k = 0; k < p.steps[i][r].size(); ++k) {
        const std::vector<int64_t>& mb = p.steps[i][r][k];
        if (p.role == Role::kActor) {
          TrainActorRequest m;
          m.batch = pack_sequences(ro, mb);
          m.old_logp = gather_tokens(ro, ro.logp, mb);
          m.advantages = gather_tokens(ro, ro.advantages, mb);
          if (cfg_.kl_loss && kl_coef_ > 0) m.ref_logp = gather_tokens(ro, ro.ref_logp, mb);
          if (!off_policy_->weights.empty()) m.is_weights = gather_tokens(ro, off_policy_->weights, mb);
          m.normalizer = p.normalizers[i];
          m.kl_coef = cfg_.kl_loss ? kl_coef_ : 0.0;
          link_.send(p.group->ranks[k], m.encode());
        } else {
          TrainCriticRequest m;
          m.batch = pack_sequences(ro, mb);
          m.old_values = gather_tokens(ro, ro.values, mb);
          m.returns = gather_tokens(ro, ro.returns, mb);
          m.normalizer = p.normalizers[i];
          link_.send(p.group->ranks[k], m.encode());
        }
      }
    }
  for (const auto& p : plans_) {
    const bool actor = p.role == Role::kActor;
    int64_t& updates = actor ? actor_updates_ : critic_updates_;
    const double lr = actor ? cfg_.actor_lr * cfg_.actor_schedule.factor(updates)
                            : cfg_.critic_lr * cfg_.critic_schedule.factor(updates);
    ++updates;
    const auto ranks = static_cast<double>(p.group->ranks.size());
    (*acc_)[p.role].lr = lr;
    (*acc_)[p.role].updates += 1;
    for (int rank : p.group->ranks)
      link_.call(rank, StepRequest{p.role, lr}.encode(), cfg_.timeout_s,
                 actor ? "the actor's update" : "the critic's update",
                 [acc = acc_, left = answers_left_, i, role = p.role, ranks](Frame&& f) {
                   const StepStats s = StepReply::decode(std::move(f)).stats;
                   Totals& t = (*acc)[role];
                   t.loss += s.loss;
                   t.clip_tokens += s.clip_tokens;
                   t.approx_kl_tokens += s.approx_kl_tokens;
                   t.tokens += s.tokens;
                   t.train_s += s.train_seconds / ranks;
                   t.step_s += s.step_seconds / ranks;
                   t.grad_norm = s.grad_norm;
                   t.skipped += (s.skipped ? 1.0 : 0.0) / ranks;
                   t.peak_mb = std::max(t.peak_mb, s.peak_host_mb);
                   --(*left)[i];
                 });
  }
}

bool TrainingDispatch::pump() {
  while (answered_ < posted_ && (*answers_left_)[answered_] == 0) ++answered_;
  bool any = false;
  while (posted_ < steps_ && posted_ - answered_ < static_cast<size_t>(kStepsInFlight)) {
    post_step(posted_++);
    any = true;
  }
  return any;
}

bool TrainingDispatch::posted(Role role) const {
  if (!trains(role)) return true;
  return posted_ == steps_;
}

bool TrainingDispatch::done() const {
  if (!answers_left_) return true;  // nothing started
  if (posted_ < steps_) return false;
  return std::all_of(answers_left_->begin(), answers_left_->end(), [](int n) { return n == 0; });
}

bool TrainingDispatch::trains(Role role) const {
  return std::any_of(plans_.begin(), plans_.end(), [&](const RolePlan& p) { return p.role == role; });
}

Metrics TrainingDispatch::metrics() const {
  Metrics m;
  for (const auto& [role, t] : *acc_) {
    const std::string r(role_name(role));
    const double updates = std::max(1.0, t.updates);
    m.emplace_back(r + "/loss", t.loss / updates);
    m.emplace_back(r + "/clip_fraction", t.tokens > 0 ? t.clip_tokens / t.tokens : 0.0);
    if (role == Role::kActor) m.emplace_back("actor/approx_kl", t.tokens > 0 ? t.approx_kl_tokens / t.tokens : 0.0);
    m.emplace_back(r + "/grad_norm", t.grad_norm);
    m.emplace_back(r + "/skipped_steps", t.skipped);
    m.emplace_back(r + "/lr", t.lr);
    m.emplace_back("memory/" + r + "_host_peak_mb", t.peak_mb);
    m.emplace_back("time/train." + r, t.train_s + t.step_s);
  }
  return m;
}

}  // namespace tiller::rollout
