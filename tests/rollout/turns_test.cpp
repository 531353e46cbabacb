// Multi-turn samples on the controller's and the ranks' side, without a model: the host arrays'
// loss mask and turn rewards, the advantages over the model's tokens only, the off-policy weights,
// the losses a trainer rank computes (observation tokens never reach the gradient), and a rollout
// put in (prompt, sample) order with all of its arrays.
#include <gtest/gtest.h>

#include <cmath>

#include <ATen/ATen.h>

#include "controller/advantages.h"
#include "controller/off_policy.h"
#include "tiller/controller/experience.h"
#include "tiller/core/error.h"
#include "trainer/losses.h"

namespace tiller::controller {
namespace {

RolloutLayout turns_layout(bool critic = false) {
  RolloutLayout l;
  l.critic = critic;
  l.turns = true;
  return l;
}

// Sample (g, s): two model turns of 2 tokens with a 3-token observation between them:
// response [m m o o o m m], turn ends at 1 and 6, turn rewards r1 and r2, outcome score.
int64_t add_two_turns(Rollout& ro, int64_t g, int64_t s, float r1, float r2, float score) {
  TurnInfo t;
  t.loss_mask = {1, 1, 0, 0, 0, 1, 1};
  t.ends = {1, 6};
  t.rewards = {r1, r2};
  const int64_t id = ro.add(g, s, {1, 2}, {7, 8, 20, 21, 22, 9, 10}, {-1, -1, 0, 0, 0, -1, -1}, false, {}, {}, 0, &t);
  ro.score[static_cast<size_t>(id)] = score;
  return id;
}

// The same sample with the observation left out: one turn of its 4 model tokens.
int64_t add_model_only(Rollout& ro, int64_t g, int64_t s, float total) {
  const int64_t id = ro.add(g, s, {1, 2}, {7, 8, 9, 10}, {-1, -1, -1, -1}, false, {}, {}, 0);
  ro.score[static_cast<size_t>(id)] = total;
  return id;
}

std::vector<float> model_part(const std::vector<float>& v, size_t offset) {
  return {v[offset], v[offset + 1], v[offset + 5], v[offset + 6]};
}

TEST(Turns, TheHostArraysKeepTheMaskAndTurnRewards) {
  Rollout ro(turns_layout());
  const int64_t a = add_two_turns(ro, 0, 0, 0.25f, 0.5f, 1.f);
  EXPECT_EQ(ro.model_tokens(a), 4);
  EXPECT_EQ(ro.turns(a), 2);
  EXPECT_DOUBLE_EQ(ro.total_reward(a), 1.75);
  // A single-turn sample in a turns layout: every token the model's.
  const int64_t b = ro.add(0, 1, {1}, {5, 6, 7}, {-1, -1, -1}, false, {}, {}, 0);
  EXPECT_EQ(ro.model_tokens(b), 3);
  EXPECT_EQ(ro.turns(b), 0);
  Rollout copy(turns_layout());
  copy.add_from(ro, a, 3);
  EXPECT_EQ(copy.loss_mask, std::vector<uint8_t>({1, 1, 0, 0, 0, 1, 1}));
  EXPECT_EQ(copy.turn_end, std::vector<int64_t>({1, 6}));
  EXPECT_DOUBLE_EQ(copy.total_reward(0), 1.75);
  // Turn ends must be on model tokens, in order, inside the response.
  TurnInfo bad;
  bad.loss_mask = {1, 0, 1};
  bad.ends = {1};
  bad.rewards = {0};
  EXPECT_THROW(ro.add(1, 0, {1}, {5, 6, 7}, {0, 0, 0}, false, {}, {}, 0, &bad), Error);
  bad.ends = {2, 0};
  bad.rewards = {0, 0};
  EXPECT_THROW(ro.add(1, 0, {1}, {5, 6, 7}, {0, 0, 0}, false, {}, {}, 0, &bad), Error);
  Rollout plain;
  EXPECT_THROW(plain.add(0, 0, {1}, {5, 6, 7}, {0, 0, 0}, false, {}, {}, 0, &bad), Error);
}

// The estimators see the model's tokens back to back: a multi-turn sample's advantages on them
// equal those of the same sample without its observation (its total reward at its end), and the
// observation gets 0. Group baselines compare totals (outcome + turns).
TEST(Turns, AdvantagesAreThoseOfTheModelTokensAlone) {
  for (auto e : {"group_norm", "rloo", "reinforce"}) {
    Rollout turns(turns_layout()), flat;
    add_two_turns(turns, 0, 0, 0.f, 0.f, 1.f);
    add_two_turns(turns, 0, 1, 0.f, 0.f, 0.f);
    add_model_only(flat, 0, 0, 1.f);
    add_model_only(flat, 0, 1, 0.f);
    AdvantageSpec s;
    s.estimator = e;
    s.n = 2;
    s.whiten = true;
    const auto a = compute_advantages(turns, s, {}).advantages;
    const auto f = compute_advantages(flat, s, {}).advantages;
    ASSERT_EQ(a.size(), 14u);
    for (size_t k : {2, 3, 4, 9, 10, 11}) EXPECT_EQ(a[k], 0.f) << "observation token " << k;
    for (size_t j = 0; j < 2; ++j) {
      const auto m = model_part(a, 7 * j);
      for (size_t k = 0; k < 4; ++k) EXPECT_NEAR(m[k], f[4 * j + k], 1e-6) << e << " sample " << j;
    }
  }
  // Group baselines take the turns' rewards into the total.
  Rollout r(turns_layout());
  add_two_turns(r, 0, 0, 0.5f, 0.5f, 0.f);
  add_two_turns(r, 0, 1, 0.f, 0.f, 0.f);
  AdvantageSpec s;
  s.estimator = "rloo";
  s.n = 2;
  s.whiten = false;
  const AdvantageResult res = compute_advantages(r, s, {});
  EXPECT_NEAR(res.advantages[0], 1.0, 1e-6);  // 1 - 0
  EXPECT_NEAR(res.advantages[7], -1.0, 1e-6);
  EXPECT_NEAR([&] { for (const auto& [k, v] : res.metrics) if (k == "reward/mean") return v; return -1.0; }(), 0.5, 1e-9);
}

// On-policy distillation (algo.distill_coef): each model token's advantage is the task's
// (normalised as before) plus coef x (log p_teacher - log p_student), the reference being the
// teacher; observation tokens get nothing; the metrics report the per-token reverse KL.
TEST(Turns, DistillationAddsTheTeachersPerTokenGap) {
  RolloutLayout l = turns_layout();
  l.ref = true;
  Rollout ro(l);
  const int64_t a = add_two_turns(ro, 0, 0, 0.f, 0.f, 1.f);
  const int64_t b = add_two_turns(ro, 0, 1, 0.f, 0.f, 0.f);
  ASSERT_EQ(a, 0);
  ASSERT_EQ(b, 1);
  // The student's (old) log-probs and the teacher's, per response token (observations too, unused).
  ro.logp = {-1.0f, -2.0f, 0, 0, 0, -0.5f, -3.0f, -2.0f, -1.0f, 0, 0, 0, -4.0f, -0.25f};
  ro.ref_logp = {-0.5f, -2.5f, 9, 9, 9, -0.5f, -1.0f, -1.0f, -1.5f, 9, 9, 9, -2.0f, -0.75f};
  AdvantageSpec s;
  s.estimator = "rloo";
  s.n = 2;
  s.whiten = false;
  s.have_ref = true;
  const std::vector<float> task = compute_advantages(ro, s, {}).advantages;
  s.distill_coef = 0.5;
  const AdvantageResult d = compute_advantages(ro, s, {});
  ASSERT_EQ(d.advantages.size(), task.size());
  double gap_sum = 0;
  int64_t model_tokens = 0;
  for (size_t k = 0; k < task.size(); ++k) {
    const bool observation = k % 7 >= 2 && k % 7 <= 4;
    const double gap = observation ? 0.0 : ro.ref_logp[k] - ro.logp[k];
    EXPECT_NEAR(d.advantages[k], task[k] + 0.5 * gap, 1e-6) << "token " << k;
    if (!observation) {
      gap_sum += gap;
      ++model_tokens;
    }
  }
  EXPECT_NEAR(task[0], 1.0, 1e-6);  // rloo: 1 - 0, every model token of the first sample
  auto metric = [&](const std::string& key) {
    for (const auto& [k, v] : d.metrics)
      if (k == key) return v;
    return std::nan("");
  };
  EXPECT_NEAR(metric("distill/reverse_kl"), -gap_sum / model_tokens, 1e-6);
  EXPECT_NEAR(metric("distill/teacher_logprob"), (-0.5 - 2.5 - 0.5 - 1.0 - 1.0 - 1.5 - 2.0 - 0.75) / 8, 1e-6);
  // Without the teacher's log-probs it refuses rather than distilling from nothing.
  s.have_ref = false;
  EXPECT_THROW(compute_advantages(ro, s, {}), Error);
}

// Per-turn rewards sit at their turn's last token: REINFORCE++'s discounted returns over the model
// tokens [m1 m2 | m3 m4] with turn rewards 1 (at m2) and 2 (at m4), outcome 4, gamma 0.5:
// rewards [0, 1, 0, 6] -> returns [0.5 * 2.5, 1 + 0.5 * 3, 0.5 * 6, 6] = [1.25, 2.5, 3, 6].
TEST(Turns, TurnRewardsReachTheirTurn) {
  Rollout ro(turns_layout());
  add_two_turns(ro, 0, 0, 1.f, 2.f, 4.f);
  AdvantageSpec s;
  s.estimator = "reinforce";
  s.gamma = 0.5;
  s.whiten = false;
  s.reward_clip = 0;
  const auto a = compute_advantages(ro, s, {}).advantages;
  const std::vector<float> want{1.25f, 2.5f, 0, 0, 0, 3.f, 6.f};
  ASSERT_EQ(a.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) EXPECT_NEAR(a[k], want[k], 1e-6) << "token " << k;
  // GAE with a critic: observation tokens get neither advantage nor return; the model tokens' are
  // those of the same rewards without the observation (values 0, lambda 1: returns).
  Rollout c(turns_layout(true));
  add_two_turns(c, 0, 0, 1.f, 2.f, 4.f);
  s.estimator = "gae";
  s.lambda = 1.0;
  const AdvantageResult g = compute_advantages(c, s, {});
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_NEAR(g.advantages[k], want[k], 1e-6) << "token " << k;
    EXPECT_NEAR(g.returns[k], want[k], 1e-6) << "token " << k;
  }
}

TEST(Turns, OffPolicyWeightsIgnoreObservations) {
  Rollout ro(turns_layout());
  add_two_turns(ro, 0, 0, 0.f, 0.f, 0.f);
  ro.logp = {-1, -1, -9, -9, -9, -1, -1};  // observations: the engine gave them 0, the actor did not
  const OffPolicy o = off_policy(ro, {ImportanceCorrection::kTis, 2.0, 1.5}, 0);
  for (float w : o.weights) EXPECT_FLOAT_EQ(w, 1.f);
  EXPECT_EQ(o.masked_samples, 0);
  for (const auto& [k, v] : o.metrics)
    if (k == "mismatch/max_abs_logp_diff" || k == "mismatch/kl") EXPECT_NEAR(v, 0.0, 1e-12) << k;
}

// The losses a rank computes: perturbing everything the controller sends for observation tokens
// (advantages, old and reference log-probs, importance weights) changes neither the loss nor the
// gradient, which is exactly 0 at those rows; the model tokens' loss equals the unmasked loss of
// the model tokens alone.
TEST(Turns, MaskedTokensNeverReachTheGradient) {
  const std::vector<uint8_t> mask{1, 1, 0, 0, 0, 1, 1};
  const at::Tensor m = at::tensor(mask, at::kByte);
  const at::Tensor obs = m.logical_not();
  auto request = [&](double perturb) {
    wire::TrainActorRequest r;
    r.old_logp = at::tensor(std::vector<float>{-1.1f, -0.9f, -2, -2, -2, -1.3f, -0.7f});
    r.advantages = at::tensor(std::vector<float>{0.5f, 0.5f, 0, 0, 0, -1.f, -1.f});
    r.ref_logp = at::tensor(std::vector<float>{-1.f, -1.f, -1, -1, -1, -1.2f, -0.8f});
    r.is_weights = at::tensor(std::vector<float>{1, 1, 1, 1, 1, 0.8f, 1.2f});
    for (at::Tensor* t : {&r.old_logp, &r.advantages, &r.ref_logp, &r.is_weights})
      *t = *t + obs.to(at::kFloat) * perturb;
    r.loss_mask = m;
    r.normalizer = 4;
    r.kl_coef = 0.1;
    return r;
  };
  trainer::ActorLossSpec spec;
  spec.entropy_coef = 0.01;
  spec.kl_estimator = "k3";
  const std::vector<float> lp{-1.f, -1.f, -5.f, -4.f, -3.f, -1.2f, -0.9f};
  const std::vector<float> ent{2.f, 2.f, 9.f, 9.f, 9.f, 1.f, 1.f};
  std::vector<at::Tensor> grads;
  std::vector<double> losses;
  for (double perturb : {0.0, 3.0, -7.0}) {
    at::Tensor logp = at::tensor(lp).set_requires_grad(true);
    const trainer::MicroBatchLoss l = trainer::actor_loss(logp, at::tensor(ent), request(perturb), spec);
    EXPECT_EQ(l.tokens, 4);
    l.loss.backward();
    losses.push_back(l.loss.item<double>());
    grads.push_back(logp.grad().clone());
    EXPECT_TRUE(at::equal(grads.back().masked_select(obs), at::zeros({3}))) << "perturbation " << perturb;
    EXPECT_NEAR(l.stats[3].item<double>(), 6.0, 1e-6);  // the entropies of the model's tokens
    EXPECT_EQ(l.stats[0].item<double>(), l.loss.item<double>());
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[0], losses[2]);
  EXPECT_TRUE(at::equal(grads[0], grads[1]));
  EXPECT_TRUE(at::equal(grads[0], grads[2]));
  EXPECT_GT(grads[0].abs().sum().item<double>(), 0);
  // The model tokens alone, unmasked: the same loss.
  const at::Tensor keep = at::nonzero(m).reshape({-1});
  wire::TrainActorRequest alone = request(0);
  for (at::Tensor* t : {&alone.old_logp, &alone.advantages, &alone.ref_logp, &alone.is_weights})
    *t = t->index_select(0, keep);
  alone.loss_mask = at::Tensor();
  const trainer::MicroBatchLoss l = trainer::actor_loss(at::tensor(lp).index_select(0, keep), at::tensor(ent).index_select(0, keep), alone, spec);
  EXPECT_NEAR(l.loss.item<double>(), losses[0], 1e-6);
  // The critic likewise.
  for (double perturb : {0.0, 5.0}) {
    wire::TrainCriticRequest c;
    c.old_values = at::tensor(std::vector<float>{0.1f, 0.2f, 0, 0, 0, 0.3f, 0.4f}) + obs.to(at::kFloat) * perturb;
    c.returns = at::tensor(std::vector<float>{1, 1, 0, 0, 0, 0.5f, 0.5f}) - obs.to(at::kFloat) * perturb;
    c.loss_mask = m;
    c.normalizer = 4;
    at::Tensor v = at::tensor(std::vector<float>{0.2f, 0.2f, 3, 3, 3, 0.2f, 0.2f}).set_requires_grad(true);
    const trainer::MicroBatchLoss cl = trainer::critic_loss(v, c, {"clipped", 0.2});
    cl.loss.backward();
    EXPECT_EQ(cl.tokens, 4);
    EXPECT_TRUE(at::equal(v.grad().masked_select(obs), at::zeros({3})));
    losses.push_back(cl.loss.item<double>());
  }
  EXPECT_EQ(losses[3], losses[4]);
  // A micro-batch of observation tokens only trains nothing (the rank still runs its collectives).
  wire::TrainActorRequest none = request(0);
  none.loss_mask = at::zeros({7}, at::kByte);
  EXPECT_FALSE(trainer::actor_loss(at::tensor(lp), at::tensor(ent), none, spec).loss.defined());

  // A registered policy loss is the one the rank uses (algo.policy_loss), on the trained tokens
  // only, with the KL loss and the entropy bonus added by the rank; its statistics, left undefined,
  // count as 0.
  static const bool registered = [] {
    algo::PolicyLossDef d;
    d.compute = [](const algo::PolicyLossInputs& in) {
      algo::PolicyLoss out;
      out.loss = (in.logp * in.logp).sum() / in.normalizer;  // sum(logp^2) / n: no built-in's
      out.tokens = in.logp.numel();
      out.metrics.emplace_back("logp_sum", in.logp.detach().to(at::kDouble).sum());
      return out;
    };
    algo::register_policy_loss("test_square", d);
    return true;
  }();
  ASSERT_TRUE(registered);
  trainer::ActorLossSpec plain;  // no KL loss (kl_coef 0 below), no entropy bonus
  plain.policy_loss = "test_square";
  wire::TrainActorRequest r = request(0);
  r.kl_coef = 0;
  at::Tensor logp = at::tensor(lp).set_requires_grad(true);
  const trainer::MicroBatchLoss sq = trainer::actor_loss(logp, at::tensor(ent), r, plain);
  // (1 + 1 + 1.44 + 0.81) / 4
  EXPECT_NEAR(sq.loss.item<double>(), 4.25 / 4, 1e-6);
  sq.loss.backward();
  EXPECT_TRUE(at::allclose(logp.grad(), at::tensor(std::vector<float>{-0.5f, -0.5f, 0, 0, 0, -0.6f, -0.45f})));
  EXPECT_EQ(sq.stats[1].item<double>(), 0.0);
  EXPECT_EQ(sq.stats[2].item<double>(), 0.0);
  // Its named metric rides after the four statistics, over the trained tokens only.
  EXPECT_EQ(sq.metric_names, std::vector<std::string>{"logp_sum"});
  ASSERT_EQ(sq.stats.numel(), 5);
  EXPECT_NEAR(sq.stats[4].item<double>(), -1 - 1 - 1.2 - 0.9, 1e-6);

  // A registered value loss likewise (algo.value_loss), on the model's tokens only.
  static const bool registered_value = [] {
    algo::ValueLossDef d;
    d.compute = [](const algo::ValueLossInputs& in) {
      algo::ValueLoss out;
      out.loss = (in.values - in.returns).abs().sum() / in.normalizer;  // L1: no built-in's
      out.tokens = in.values.numel();
      return out;
    };
    algo::register_value_loss("test_l1", d);
    return true;
  }();
  ASSERT_TRUE(registered_value);
  wire::TrainCriticRequest c;
  c.old_values = at::tensor(std::vector<float>{0.1f, 0.2f, 0, 0, 0, 0.3f, 0.4f});
  c.returns = at::tensor(std::vector<float>{1, 1, 9, 9, 9, 0.5f, -0.5f});
  c.loss_mask = m;
  c.normalizer = 4;
  at::Tensor v = at::tensor(std::vector<float>{0.2f, 0.2f, 3, 3, 3, 0.2f, 0.2f}).set_requires_grad(true);
  const trainer::MicroBatchLoss l1 = trainer::critic_loss(v, c, {"test_l1", 0.2});
  EXPECT_NEAR(l1.loss.item<double>(), (0.8 + 0.8 + 0.3 + 0.7) / 4, 1e-6);
  l1.loss.backward();
  EXPECT_TRUE(at::allclose(v.grad(), at::tensor(std::vector<float>{-0.25f, -0.25f, 0, 0, 0, -0.25f, 0.25f})));
  EXPECT_EQ(l1.stats[1].item<double>(), 0.0);  // no clipped tokens given: 0
  EXPECT_THROW(trainer::critic_loss(v, c, {"test_l2", 0.2}), ConfigError);
}

// Samples are appended as they arrive; canonicalize() puts them in (prompt, sample) order with
// every array that belongs to them: the same rollout as one filled in that order.
TEST(Turns, CanonicalizeGivesTheRolloutFilledInPromptSampleOrder) {
  RolloutLayout layout = turns_layout(/*critic=*/true);
  layout.ref = true;
  auto add = [](Rollout& ro, int64_t g, int64_t s) {
    const int64_t k = g * 10 + s;
    const int64_t len = 3 + (k * 7) % 5;  // responses of 3 to 7 tokens
    std::vector<int64_t> prompt_ids(static_cast<size_t>(1 + g), 100 + k), response;
    std::vector<float> logprobs;
    TurnInfo t;
    for (int64_t i = 0; i < len; ++i) {
      response.push_back(200 + k * 10 + i);
      logprobs.push_back(-0.01f * static_cast<float>(k * 10 + i));
      t.loss_mask.push_back(i == 1 && s == 1 ? 0 : 1);
    }
    t.ends = {len - 1};
    t.rewards = {0.5f * static_cast<float>(k)};
    // Two weight versions in the odd samples' tokens.
    const std::vector<int64_t> starts = s % 2 ? std::vector<int64_t>{0, 2} : std::vector<int64_t>{};
    const std::vector<uint64_t> versions = s % 2 ? std::vector<uint64_t>{3, 4} : std::vector<uint64_t>{};
    const int64_t id = ro.add(g, s, prompt_ids, response, logprobs, k % 3 == 0, starts, versions, 5, &t);
    std::vector<int16_t> routes(static_cast<size_t>(2 * (1 + g)), static_cast<int16_t>(k));
    ro.set_routes(routes, 2);
    ro.score[static_cast<size_t>(id)] = static_cast<float>(k);
    for (int64_t i = 0; i < len; ++i) {
      const auto at = static_cast<size_t>(ro.resp_offset[static_cast<size_t>(id)] + i);
      const auto v = static_cast<float>(k * 10 + i);
      ro.logp[at] = v + 0.1f;
      ro.ref_logp[at] = v + 0.2f;
      ro.values[at] = v + 0.3f;
      ro.returns[at] = v + 0.4f;
      ro.advantages[at] = v + 0.5f;
    }
  };
  const std::vector<std::pair<int64_t, int64_t>> arrival = {{2, 1}, {0, 1}, {1, 0}, {2, 0}, {0, 0}, {1, 1}};
  Rollout ro(layout), want(layout);
  for (const auto& [g, s] : arrival) add(ro, g, s);
  for (int64_t g = 0; g < 3; ++g)
    for (int64_t s = 0; s < 2; ++s) add(want, g, s);
  EXPECT_TRUE(ro.canonicalize());
  EXPECT_EQ(ro.prompt, want.prompt);
  EXPECT_EQ(ro.sample, want.sample);
  EXPECT_EQ(ro.seq_offset, want.seq_offset);
  EXPECT_EQ(ro.prompt_len, want.prompt_len);
  EXPECT_EQ(ro.response_len, want.response_len);
  EXPECT_EQ(ro.resp_offset, want.resp_offset);
  EXPECT_EQ(ro.truncated, want.truncated);
  EXPECT_EQ(ro.score, want.score);
  EXPECT_EQ(ro.run_offset, want.run_offset);
  EXPECT_EQ(ro.run_start, want.run_start);
  EXPECT_EQ(ro.run_version, want.run_version);
  EXPECT_EQ(ro.tokens, want.tokens);
  EXPECT_EQ(ro.engine_logp, want.engine_logp);
  EXPECT_EQ(ro.logp, want.logp);
  EXPECT_EQ(ro.advantages, want.advantages);
  EXPECT_EQ(ro.ref_logp, want.ref_logp);
  EXPECT_EQ(ro.values, want.values);
  EXPECT_EQ(ro.returns, want.returns);
  EXPECT_EQ(ro.loss_mask, want.loss_mask);
  EXPECT_EQ(ro.turn_offset, want.turn_offset);
  EXPECT_EQ(ro.turn_end, want.turn_end);
  EXPECT_EQ(ro.turn_reward, want.turn_reward);
  EXPECT_EQ(ro.routes, want.routes);
  EXPECT_EQ(ro.route_offset, want.route_offset);
  EXPECT_EQ(ro.route_width, want.route_width);
  EXPECT_FALSE(ro.canonicalize());  // already in order: nothing moves
  EXPECT_EQ(ro.tokens, want.tokens);
}

}  // namespace
}  // namespace tiller::controller
