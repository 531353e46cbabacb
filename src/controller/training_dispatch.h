// The training of one step (private to src/controller): mini-batches of the actor and the critic
// posted to their groups, and the answers summed into the step's metrics.
//
// For each of algo.ppo_epochs the step's samples are shuffled (from (prompt, sample) order, by
// (run.seed, step), so a run's mini-batches do not depend on which completion came first) and cut
// into optimizer steps of train.train_batch_size samples. In each, plan_rounds (packer.h)
// balances the samples over a group's ranks by tokens and packs each rank's share into
// micro-batches of train.micro_batch_tokens; the actor's and the critic's rounds are posted
// interleaved, so that on different ranks they train at the same time, then each group's
// optimizer step. At most kStepsInFlight optimizer steps are posted ahead of their answers: the
// ranks never wait for the controller between steps, and the messages waiting at the ranks stay
// bounded. Samples the off-policy sequence mask left out (off_policy.h) go to the critic only.
//
// The losses divide by the optimizer step's response tokens (the token mean over the whole step
// across micro-batches and ranks), Dr.GRPO's by samples x max_new_tokens.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <vector>

#include "controller/collector.h"
#include "controller/off_policy.h"
#include "tiller/controller/metrics.h"
#include "tiller/controller/packer.h"
#include "tiller/zero/optimizer.h"
#include "wire/channel.h"
#include "wire/trainer_groups.h"

namespace tiller::controller {

struct TrainingConfig {
  int64_t train_batch_size = 1;
  int64_t ppo_epochs = 1;
  int64_t micro_batch_tokens = 16384;  // per rank (a sequence group of S ranks takes S times as many)
  double attention_tokens = 0;         // plan_rounds' weight of long samples (0: tokens only)
  int64_t max_new_tokens = 1;
  bool constant_normalizer = false;  // the estimator's loss normaliser is constant (Dr.GRPO's)
  bool kl_loss = false;      // the KL term in the actor's loss (a reference, not in the reward)
  uint64_t seed = 0;
  double actor_lr = 0, critic_lr = 0;
  zero::LrSchedule actor_schedule, critic_schedule;
  double timeout_s = 1800;   // one optimizer step's micro-batches on a rank (timeouts.train_s)

  static TrainingConfig from_job(const JobConfig& job, bool have_ref);
};

class TrainingDispatch {
 public:
  static constexpr int kStepsInFlight = 2;

  // `actor` must not be null; `critic` is null without one. Both outlive the dispatch.
  TrainingDispatch(const TrainingConfig& cfg, wire::TrainerLink& link, const wire::TrainerGroup* actor,
                   const wire::TrainerGroup* critic);

  // Begins training `batch` (its advantages and returns filled in; it must stay put until done()):
  // the actor's optimizer steps when `train_actor`, the critic's when there is one.
  void start(const StepBatch& batch, const OffPolicy& off_policy, bool train_actor, double kl_coef);
  // Posts what the answers so far allow; true when it posted anything.
  bool pump();
  // Every message of `role`'s training is posted (the role's ranks will score after it).
  bool posted(Role role) const;
  bool done() const;
  bool trains(Role role) const;
  // The step's training metrics (actor/loss, critic/grad_norm, actor/lr, time/train.actor, ...).
  Metrics metrics() const;
  // Each trained role's rate in a training phase of `phase_s` seconds (its micro-batches' tokens
  // over its GPUs and the phase) beside its ranks' mean benchmark at the job's shapes:
  // throughput/train_tokens_per_s_per_gpu.<role>, throughput/train_bench_tokens_per_s.<role> and
  // efficiency/train.<role> (their ratio; without a benchmark, the first alone); and the phase's
  // efficiency/train: the busiest rank's work at its roles' benchmark rates over the phase, where
  // the roles colocated on a rank add up (they train there one after the other, so each role's
  // own ratio is its share of the phase, not its speed).
  Metrics efficiency(double phase_s) const;
  // Optimizer steps taken over the run, per role (the learning-rate schedules count them).
  int64_t updates(Role role) const { return role == Role::kActor ? actor_updates_ : critic_updates_; }
  void set_updates(int64_t actor, int64_t critic) {
    actor_updates_ = actor;
    critic_updates_ = critic;
  }

 private:
  struct RolePlan {
    const wire::TrainerGroup* group = nullptr;
    Role role = Role::kActor;
    std::vector<std::vector<Round>> steps;  // per optimizer step: its lockstep rounds
    std::vector<double> normalizers;        // per optimizer step
    std::vector<double> step_rows;          // per optimizer step: its micro-batches' rows, all ranks
  };
  struct Totals {
    double loss = 0, clip_tokens = 0, approx_kl_tokens = 0, tokens = 0, train_s = 0, step_s = 0, grad_norm = 0,
           skipped = 0, peak_mb = 0, peak_device_gb = 0, lr = 0, updates = 0;
    // Tokens per rank and round: the busiest rank's and the mean, summed over rounds.
    double round_max_tokens = 0, round_mean_tokens = 0, rounds = 0;
    double rows = 0;    // every token of the role's micro-batches (prompts included), over its ranks
    double ranks = 1;   // the role's GPUs
    std::vector<int> rank_ids;  // their world ranks (colocated roles share them)
    double bench_sum = 0, bench_n = 0;  // the ranks' training benchmarks (StepStats::bench_tokens_per_s)
    std::map<std::string, double> loss_metrics;  // the policy loss's named sums over ranks and steps
    at::Tensor expert_load;  // a mixture of experts: tokens per expert [sparse layers, experts], over ranks and steps
    double router_aux = 0, router_z = 0;  // router losses: each optimizer step's mean, summed over the steps
  };
  void post_step(size_t i);

  TrainingConfig cfg_;
  wire::TrainerLink& link_;
  const wire::TrainerGroup* actor_;
  const wire::TrainerGroup* critic_;
  const StepBatch* batch_ = nullptr;
  const OffPolicy* off_policy_ = nullptr;
  double kl_coef_ = 0;
  std::vector<RolePlan> plans_;
  size_t steps_ = 0, posted_ = 0;
  std::shared_ptr<std::vector<int>> answers_left_;  // per optimizer step: step replies still due
  size_t answered_ = 0;
  std::shared_ptr<std::map<Role, Totals>> acc_;
  int64_t actor_updates_ = 0, critic_updates_ = 0;
};

}  // namespace tiller::controller
