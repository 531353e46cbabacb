#include "controller/training_dispatch.h"

#include <algorithm>
#include <numeric>
#include <random>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "controller/batch.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/checked_math.h"
#include "tiller/core/error.h"

namespace tiller::controller {

TrainingConfig TrainingConfig::from_job(const JobConfig& job, bool have_ref) {
  TrainingConfig c;
  c.train_batch_size = job.train.train_batch_size;
  c.ppo_epochs = job.algo.ppo_epochs;
  c.micro_batch_tokens = job.train.micro_batch_tokens;
  c.max_new_tokens = job.response_limit();
  c.constant_normalizer =
      algo::find_advantage_estimator(job.algo.advantage_estimator).loss_normalizer == algo::LossNormalizer::kConstant;
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

TrainingDispatch::TrainingDispatch(const TrainingConfig& cfg, wire::TrainerLink& link, const wire::TrainerGroup* actor,
                                   const wire::TrainerGroup* critic)
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
        int64_t tokens = 0, rows = 0;
        for (int64_t s : samples) {
          tokens += ro.model_tokens(s);  // multi-turn: observations count nowhere
          rows += lens[static_cast<size_t>(s)];
        }
        p.step_rows.push_back(static_cast<double>(std::max<int64_t>(rows, 1)));
        p.normalizers.push_back(cfg_.constant_normalizer ? static_cast<double>(samples.size() * cfg_.max_new_tokens)
                                             : static_cast<double>(std::max<int64_t>(tokens, 1)));
        const int sp = p.group->sequence_parallel;
        p.steps.push_back(plan_rounds(samples, lens, p.group->data_parallel(),
                                      checked_mul(cfg_.micro_batch_tokens, int64_t{sp}, "train.micro_batch_tokens x S"),
                                      cfg_.attention_tokens));
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
      const int sp = p.group->sequence_parallel;
      std::vector<double> rank_tokens;
      for (size_t k = 0; k < p.steps[i][r].size(); ++k) {
        const std::vector<int64_t>& mb = p.steps[i][r][k];
        const wire::PackedSequences whole = pack_sequences(ro, mb);
        rank_tokens.push_back(static_cast<double>(whole.rows()) / sp);
        (*acc_)[p.role].rows += static_cast<double>(whole.rows());
        // Each rank of the sequence group gets its rows, and its part of each per-token array.
        const std::vector<wire::PackedSequences> slices = whole.cut(sp);
        auto part = [](const at::Tensor& t, const wire::PackedSequences& s) {
          return t.narrow(0, s.response_before(), s.response_tokens()).contiguous();
        };
        // The micro-batch's per-token arrays, once; each slice takes its range.
        const bool actor = p.role == Role::kActor;
        auto tokens_of = [&](const std::vector<float>& v, bool want) { return want ? gather_tokens(ro, v, mb) : at::Tensor(); };
        const at::Tensor old_logp = tokens_of(ro.logp, actor), advantages = tokens_of(ro.advantages, actor);
        const at::Tensor ref_logp = tokens_of(ro.ref_logp, actor && cfg_.kl_loss && kl_coef_ > 0);
        const at::Tensor is_weights = tokens_of(off_policy_->weights, actor && !off_policy_->weights.empty());
        const at::Tensor old_values = tokens_of(ro.values, !actor), returns = tokens_of(ro.returns, !actor);
        const at::Tensor loss_mask = ro.layout.turns ? gather_mask(ro, mb) : at::Tensor();
        for (int j = 0; j < sp; ++j) {
          const wire::PackedSequences& slice = slices[static_cast<size_t>(j)];
          const int rank = p.group->ranks[k * static_cast<size_t>(sp) + static_cast<size_t>(j)];
          if (actor) {
            wire::TrainActorRequest m;
            m.batch = slice;
            m.old_logp = part(old_logp, slice);
            m.advantages = part(advantages, slice);
            if (ref_logp.defined()) m.ref_logp = part(ref_logp, slice);
            if (is_weights.defined()) m.is_weights = part(is_weights, slice);
            if (loss_mask.defined()) m.loss_mask = part(loss_mask, slice);
            m.normalizer = p.normalizers[i];
            m.step_rows = p.step_rows[i];
            m.kl_coef = cfg_.kl_loss ? kl_coef_ : 0.0;
            link_.send(rank, m.encode());
          } else {
            wire::TrainCriticRequest m;
            m.batch = slice;
            m.old_values = part(old_values, slice);
            m.returns = part(returns, slice);
            if (loss_mask.defined()) m.loss_mask = part(loss_mask, slice);
            m.normalizer = p.normalizers[i];
            m.step_rows = p.step_rows[i];
            link_.send(rank, m.encode());
          }
        }
      }
      Totals& t = (*acc_)[p.role];
      t.ranks = static_cast<double>(p.group->ranks.size());
      t.rank_ids = p.group->ranks;
      t.round_max_tokens += *std::max_element(rank_tokens.begin(), rank_tokens.end());
      t.round_mean_tokens += std::accumulate(rank_tokens.begin(), rank_tokens.end(), 0.0) / rank_tokens.size();
      t.rounds += 1;
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
      link_.call(rank, wire::StepRequest{p.role, lr}.encode(), cfg_.timeout_s,
                 actor ? "the actor's update" : "the critic's update",
                 [acc = acc_, left = answers_left_, i, role = p.role, ranks](wire::Frame&& f) {
                   const wire::StepStats s = wire::StepReply::decode(std::move(f)).stats;
                   Totals& t = (*acc)[role];
                   t.loss += s.loss;
                   t.clip_tokens += s.clip_tokens;
                   t.approx_kl_tokens += s.approx_kl_tokens;
                   t.tokens += s.tokens;
                   for (const auto& [name, v] : s.loss_metrics) t.loss_metrics[name] += v;
                   t.router_aux += s.router_aux;
                   t.router_z += s.router_z;
                   if (s.expert_load.defined()) {  // flattened [sparse layers, experts]
                     TILLER_CHECK(s.expert_load_experts >= 1 && s.expert_load_experts <= 65536,
                                  "a step reply's expert load names {} experts a layer", s.expert_load_experts);
                     const auto e = static_cast<int64_t>(s.expert_load_experts);
                     TILLER_CHECK(s.expert_load.numel() % e == 0,
                                  "a step reply's expert load of {} numbers is not rows of {} experts",
                                  s.expert_load.numel(), e);
                     const at::Tensor load = s.expert_load.view({-1, e});
                     TILLER_CHECK(!t.expert_load.defined() || t.expert_load.sizes() == load.sizes(),
                                  "the ranks' expert loads differ in shape");
                     t.expert_load = t.expert_load.defined() ? t.expert_load + load : load.clone();
                   }
                   t.train_s += s.train_seconds / ranks;
                   t.step_s += s.step_seconds / ranks;
                   t.grad_norm = s.grad_norm;
                   t.skipped += (s.skipped ? 1.0 : 0.0) / ranks;
                   t.peak_mb = std::max(t.peak_mb, s.peak_host_mb);
                   t.peak_device_gb = std::max(t.peak_device_gb, s.peak_device_gb);
                   if (s.bench_tokens_per_s > 0) {
                     t.bench_sum += s.bench_tokens_per_s;
                     t.bench_n += 1;
                   }
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
    for (const auto& [name, sum] : t.loss_metrics)  // per trained token of the step
      m.emplace_back(r + "/policy_loss/" + name, t.tokens > 0 ? sum / t.tokens : 0.0);
    if (t.expert_load.defined() && t.expert_load.numel() > 0) {
      // Each sparse layer's busiest expert: its tokens, and their ratio to the mean (1: balanced).
      const at::Tensor max = std::get<0>(t.expert_load.max(1)), mean = t.expert_load.mean(1);
      double worst = 0;
      for (int64_t i = 0; i < t.expert_load.size(0); ++i) {
        const double mx = max[i].item<double>(), mn = mean[i].item<double>(), ratio = mn > 0 ? mx / mn : 0.0;
        m.emplace_back(fmt::format("moe/{}/sparse_layer_{}/load_max", r, i), mx);
        m.emplace_back(fmt::format("moe/{}/sparse_layer_{}/load_max_over_mean", r, i), ratio);
        worst = std::max(worst, ratio);
      }
      m.emplace_back("moe/" + r + "/load_max_over_mean", worst);
    }
    if (t.router_aux > 0 || t.router_z > 0) {  // the router losses (on: the load-balancing loss is > 0)
      m.emplace_back("moe/" + r + "/router_aux_loss", t.router_aux / updates);
      m.emplace_back("moe/" + r + "/router_z_loss", t.router_z / updates);
    }
    m.emplace_back(r + "/grad_norm", t.grad_norm);
    m.emplace_back(r + "/skipped_steps", t.skipped);
    m.emplace_back(r + "/lr", t.lr);
    m.emplace_back("memory/" + r + "_host_peak_mb", t.peak_mb);
    // Its busiest rank's device peak (GPU roles only): since the start, or the train phase's in a hybrid job.
    if (t.peak_device_gb > 0) m.emplace_back("memory/" + r + "_device_peak_gb", t.peak_device_gb);
    m.emplace_back("time/train." + r, t.train_s + t.step_s);
    m.emplace_back("time/optimizer." + r, t.step_s);  // of it: the optimizer steps (clipping, AdamW)
    // Per-rank tokens of a lockstep round (S-way slices count 1/S): the busiest rank's, the mean,
    // and their ratio (1: balanced; every rank waits for the busiest).
    const double rounds = std::max(1.0, t.rounds);
    m.emplace_back("balance/" + r + "_round_tokens_max", t.round_max_tokens / rounds);
    m.emplace_back("balance/" + r + "_round_tokens_mean", t.round_mean_tokens / rounds);
    m.emplace_back("balance/" + r + "_imbalance", t.round_mean_tokens > 0 ? t.round_max_tokens / t.round_mean_tokens : 1.0);
  }
  return m;
}

Metrics TrainingDispatch::efficiency(double phase_s) const {
  Metrics m;
  if (!acc_ || phase_s <= 0) return m;
  std::map<int, double> busy_s;  // world rank -> its roles' work at their benchmark rates
  bool every_bench = true;
  for (const auto& [role, t] : *acc_) {
    const std::string r(role_name(role));
    const double rate = t.rows / (std::max(1.0, t.ranks) * phase_s);
    m.emplace_back("throughput/train_tokens_per_s_per_gpu." + r, rate);
    if (t.bench_n <= 0) {
      every_bench = false;
      continue;
    }
    const double bench = t.bench_sum / t.bench_n;
    m.emplace_back("throughput/train_bench_tokens_per_s." + r, bench);
    m.emplace_back("efficiency/train." + r, rate / bench);
    for (int rank : t.rank_ids) busy_s[rank] += t.rows / (std::max(1.0, t.ranks) * bench);
  }
  if (every_bench && !busy_s.empty()) {
    double busiest = 0;
    for (const auto& [rank, s] : busy_s) busiest = std::max(busiest, s);
    m.emplace_back("efficiency/train", busiest / phase_s);
  }
  return m;
}

}  // namespace tiller::controller
