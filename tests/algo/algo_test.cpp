// The RL algorithms against values computed by hand (the arithmetic is in the comments).
#include <cmath>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "../common/error_of.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/algo/algo.h"
#include "tiller/core/registry.h"
#include "tiller/core/error.h"

namespace tiller::algo {
namespace {

at::Tensor t(std::vector<double> v) { return at::tensor(v, at::kDouble).to(at::kFloat); }
at::Tensor cu(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

void expect_values(const at::Tensor& got, std::vector<double> want, double tol = 1e-5) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  const at::Tensor g = got.detach().to(at::kDouble).contiguous().view({-1});
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(g[i].item<double>(), want[i], tol) << "element " << i;
}

TEST(Algo, KlEstimators) {
  // d = logp - ref = [0.5, -1]
  const at::Tensor logp = t({-1.0, -2.0}), ref = t({-1.5, -1.0});
  expect_values(kl_estimate(logp, ref, "k1"), {0.5, -1.0});
  expect_values(kl_estimate(logp, ref, "k2"), {0.125, 0.5});
  // exp(-0.5) - 1 + 0.5; exp(1) - 1 - 1
  expect_values(kl_estimate(logp, ref, "k3"), {std::exp(-0.5) - 0.5, std::exp(1.0) - 2.0});
  EXPECT_EQ(error_of([&] { kl_estimate(logp, ref, "k4"); }),
            "algo.kl_estimator = 'k4': not a registered KL estimator (registered: k1, k2, k3); did you mean 'k1'?");
  EXPECT_THROW(kl_estimate(logp, ref, "k4"), ConfigError);
  // As a loss: coef 2 * (k1 sum = 1 + 0) / 2.
  expect_values(kl_loss(t({0.0, -1.0}), t({-1.0, -1.0}), "k1", 2.0, 2.0), {1.0});
}

// A user's KL estimator, registered by name, is the one the estimate, the loss (and its gradient)
// and the config checks use; a wrong-sized result is an error naming it.
TEST(Algo, ARegisteredKlEstimatorIsTheOneUsed) {
  static const bool registered = [] {
    // |d|, as verl's "abs"
    register_kl_estimator("test_abs", {[](const at::Tensor& logp, const at::Tensor& ref) { return (logp - ref).abs(); },
                                       "|logp - ref|"});
    register_kl_estimator("test_short", {[](const at::Tensor& logp, const at::Tensor&) { return logp.narrow(0, 0, 1); },
                                         "one value short"});
    return true;
  }();
  ASSERT_TRUE(registered);
  const at::Tensor ref = t({-1.5, -1.0});
  expect_values(kl_estimate(t({-1.0, -2.0}), ref, "test_abs"), {0.5, 1.0});
  // d(coef * sum|logp - ref| / normalizer)/dlogp = coef * sign(d) / normalizer = [1, -1] * 3 / 2.
  at::Tensor logp = t({-1.0, -2.0}).requires_grad_(true);
  kl_loss(logp, ref, "test_abs", 3.0, 2.0).backward();
  expect_values(logp.grad(), {1.5, -1.5});
  EXPECT_EQ(error_of([&] { kl_estimate(t({-1.0, -2.0}), ref, "test_short"); }),
            "KL estimator test_short: it returned 1 values for 2 log-probs; return one value per token");
  JobConfig job;
  job.algo.kl_estimator = "test_abs";
  EXPECT_NO_THROW(check_config(job));
  job.algo.kl_estimator = "k5";
  EXPECT_NE(error_of([&] { check_config(job); }).find("algo.kl_estimator = 'k5': not a registered KL estimator"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { register_kl_estimator("k1", {[](const at::Tensor& a, const at::Tensor&) { return a; }, ""}); }),
            "KL estimator 'k1' is registered already; register each name once");
  EXPECT_EQ(error_of([&] { register_kl_estimator("test_none", {}); }), "KL estimator 'test_none': no estimate function");
}

TEST(Algo, TokenRewardsAndShaping) {
  // -0.5 * kl everywhere, the score on each sample's last token: samples [0, 2) and [2, 5).
  expect_values(token_rewards(t({1.0, 2.0}), t({0.1, 0.2, 0.3, 0.4, 0.5}), cu({0, 2, 5}), 0.5),
                {-0.05, 0.9, -0.15, -0.2, 1.75});
  EXPECT_THROW(token_rewards(t({1.0}), t({0.1, 0.2}), cu({0, 1, 2}), 0.5), Error);  // 1 score, 2 samples
  expect_values(clip_rewards(t({-3.0, 0.5, 7.0}), 2.0), {-2.0, 0.5, 2.0});
  RunningMoments m;
  m.update(t({1, 2, 3}));
  m.update(t({4, 5}));
  EXPECT_NEAR(m.mean(), 3.0, 1e-12);
  EXPECT_NEAR(m.std(), std::sqrt(2.5), 1e-12);  // unbiased variance of 1..5
  expect_values(m.normalize(t({5.0})), {2.0 / std::sqrt(2.5)});
  expect_values(per_token(t({10, 20}), cu({0, 2, 3})), {10, 10, 20});
}

TEST(Algo, GaeAndReturns) {
  // Sample 0: r = [0, 0, 1], v = [0.5, 0.6, 0.7], gamma 0.9, lambda 0.8 (gamma * lambda = 0.72):
  //   t2: delta = 1 - 0.7 = 0.3                    A = 0.3      R = 1.0
  //   t1: delta = 0.9 * 0.7 - 0.6 = 0.03           A = 0.03 + 0.72 * 0.3 = 0.246      R = 0.846
  //   t0: delta = 0.9 * 0.6 - 0.5 = 0.04           A = 0.04 + 0.72 * 0.246 = 0.21712  R = 0.71712
  // Sample 1 is empty; sample 2: r = [2], v = [1.5]: A = 0.5, R = 2.
  const auto g = gae(t({0, 0, 1, 2}), t({0.5, 0.6, 0.7, 1.5}), cu({0, 3, 3, 4}), 0.9, 0.8);
  expect_values(g.advantages, {0.21712, 0.246, 0.3, 0.5});
  expect_values(g.returns, {0.71712, 0.846, 1.0, 2.0});
  // gamma 0.5: [1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2]
  expect_values(discounted_returns(t({1, 0, 2}), cu({0, 3}), 0.5), {1.5, 1.0, 2.0});
  EXPECT_THROW(gae(t({0, 0}), t({0, 0}), cu({0, 3}), 1, 1), Error);  // cu does not match
}

TEST(Algo, GroupBaselines) {
  // Groups (1, 2) and (3, 6).
  expect_values(group_advantages(t({1, 2, 3, 6}), 2, GroupBaseline::kRloo), {-1, 1, -3, 3});
  expect_values(group_advantages(t({1, 2, 3, 6}), 2, GroupBaseline::kMean), {-0.5, 0.5, -1.5, 1.5});
  // std (Bessel) of (1, 2) is 1/sqrt(2), of (3, 6) is 3/sqrt(2): both groups give -+1/sqrt(2).
  const double h = 1 / std::sqrt(2.0);
  expect_values(group_advantages(t({1, 2, 3, 6}), 2, GroupBaseline::kMeanStd), {-h, h, -h, h}, 1e-5);
  // RLOO with n = 3 on (1, 2, 6): each minus the mean of the other two.
  expect_values(group_advantages(t({1, 2, 6}), 3, GroupBaseline::kRloo), {-3, -1.5, 4.5});
  // A group whose scores are all equal has no signal (GRPO's eps keeps it finite).
  expect_values(group_advantages(t({4, 4}), 2, GroupBaseline::kMeanStd), {0, 0});
  EXPECT_THROW(group_advantages(t({1, 2, 3}), 2, GroupBaseline::kMean), Error);
  EXPECT_THROW(group_advantages(t({1, 2}), 1, GroupBaseline::kRloo), Error);
}

TEST(Algo, Whitening) {
  // mean 2.5, population variance 1.25.
  const double s = std::sqrt(1.25);
  expect_values(whiten(t({1, 2, 3, 4})), {-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s});
  expect_values(whiten(t({1, 2, 3, 4}), false), {2.5 - 1.5 / s, 2.5 - 0.5 / s, 2.5 + 0.5 / s, 2.5 + 1.5 / s});
}

TEST(Algo, PpoClipAsymmetricDualAndImportanceWeights) {
  // ratio = [1.5, 0.5, 1, 0.5] (old log-probs 0), advantages [1, 1, -1, -2], clip 0.2:
  //   t0: -1.5 vs clipped -1.2 -> -1.2 (clipped)     t1: -0.5 vs -0.8 -> -0.5
  //   t2: 1 vs 1 -> 1                                t3: 1 vs 1.6 -> 1.6 (clipped)
  // sum 0.9, over 4 tokens: 0.225; 2 of 4 clipped.
  const at::Tensor logp = at::log(t({1.5, 0.5, 1.0, 0.5})).requires_grad_(true);
  const at::Tensor old = at::zeros({4}), adv = t({1, 1, -1, -2});
  PolicyLoss l = policy_loss(logp, old, adv, {}, 4.0);
  expect_values(l.loss, {0.225});
  EXPECT_NEAR(l.clip_fraction(), 0.5, 1e-12);
  l.loss.backward();
  // Clipped tokens get no gradient; t1's is -A * ratio / 4 = -0.125.
  const at::Tensor g = logp.grad();
  EXPECT_NEAR(g[0].item<double>(), 0.0, 1e-7);
  EXPECT_NEAR(g[1].item<double>(), -0.125, 1e-6);
  EXPECT_NEAR(g[3].item<double>(), 0.0, 1e-7);
  // Clip-higher 0.6: t0 is no longer clipped (-1.5): sum 0.6 -> 0.15, 1 of 4 clipped.
  PolicyLossConfig high;
  high.clip_high = 0.6;
  l = policy_loss(logp, old, adv, high, 4.0);
  expect_values(l.loss, {0.15});
  EXPECT_NEAR(l.clip_fraction(), 0.25, 1e-12);
  // Importance weights [1, 2, 1, 0.5]: -1.2 - 1.0 + 1.0 + 0.8 = -0.4 -> -0.1.
  expect_values(policy_loss(logp, old, adv, {}, 4.0, t({1, 2, 1, 0.5})).loss, {-0.1});
  // Dual clip: ratio 3, A = -1: plain PPO gives max(3, 1.2) = 3; dual clip 1.5 caps it at 1.5.
  const at::Tensor big = at::log(t({3.0}));
  expect_values(policy_loss(big, at::zeros({1}), t({-1}), {}, 1.0).loss, {3.0});
  PolicyLossConfig dual;
  dual.dual_clip = 1.5;
  expect_values(policy_loss(big, at::zeros({1}), t({-1}), dual, 1.0).loss, {1.5});
  // The normaliser makes micro-batch losses add up to the step's token mean.
  const auto a = policy_loss(logp.narrow(0, 0, 2), old.narrow(0, 0, 2), adv.narrow(0, 0, 2), {}, 4.0);
  const auto b = policy_loss(logp.narrow(0, 2, 2), old.narrow(0, 2, 2), adv.narrow(0, 2, 2), {}, 4.0);
  expect_values(a.loss + b.loss, {0.225});
}

// The plain policy gradient: -A * logp summed / normalizer, weighted; its gradient is -A * w / n.
TEST(Algo, PlainPolicyGradientLoss) {
  at::Tensor logp = t({-1.0, -2.0, -0.5}).requires_grad_(true);
  const at::Tensor old = t({-1.5, -2.0, -0.5}), adv = t({1.0, -2.0, 0.5}), w = t({1.0, 0.5, 2.0});
  // -(1 * -1 * 1 + -2 * -2 * 0.5 + 0.5 * -0.5 * 2) / 2 = -(-1 + 2 - 0.5) / 2 = -0.25
  const PolicyLoss pl = pg_loss(logp, old, adv, 2.0, w);
  expect_values(pl.loss, {-0.25});
  pl.loss.backward();
  expect_values(logp.grad(), {-0.5, 0.5, -0.5});
  EXPECT_EQ(pl.clip_fraction(), 0.0);
  EXPECT_NEAR(pl.approx_kl(), (-1.5 + 1.0) / 3, 1e-6);  // mean of old - new
  // Through the registry, by name; ppo by name is policy_loss.
  PolicyLossInputs in;
  in.logp = t({-1.0, -2.0, -0.5});
  in.old_logp = old;
  in.advantages = adv;
  in.is_weights = w;
  in.normalizer = 2.0;
  expect_values(find_policy_loss("pg").compute(in).loss, {-0.25});
  expect_values(find_policy_loss("ppo").compute(in).loss,
                {policy_loss(in.logp, old, adv, in.clip, 2.0, w).loss.item<double>()});
  EXPECT_EQ(error_of([] { find_policy_loss("ppo2"); }),
            "algo.policy_loss = 'ppo2': not a registered policy loss (registered: pg, ppo); did you mean 'ppo'?");
  EXPECT_EQ(error_of([] { register_policy_loss("ppo", {}); }), "policy loss 'ppo': no compute function");
}

TEST(Algo, ValueLossEntropyAndImportanceCap) {
  // t0: (1 - 2)^2 = 1 vs (0.5 + 0.2 - 2)^2 = 1.69 -> 1.69; t1: 1 vs 1 -> 1. 0.5 * 2.69 / 2 = 0.6725.
  const auto v = value_loss(t({1.0, 2.0}), t({0.5, 2.0}), t({2.0, 1.0}), 0.2, 2.0);
  expect_values(v.loss, {0.6725});
  EXPECT_NEAR(v.clip_fraction(), 0.5, 1e-12);
  expect_values(value_loss(t({1.0, 2.0}), t({0.5, 2.0}), t({2.0, 1.0}), 0, 2.0).loss, {0.5});
  // The built-in through the registry (algo.value_loss: clipped): the same numbers.
  ValueLossInputs in{t({1.0, 2.0}), t({0.5, 2.0}), t({2.0, 1.0}), 0.2, 2.0};
  const ValueLoss r = find_value_loss("clipped").compute(in);
  expect_values(r.loss, {0.6725});
  EXPECT_NEAR(r.clip_fraction(), 0.5, 1e-12);
  const std::vector<std::string> names = value_loss_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "clipped"), names.end());
  EXPECT_NE(error_of([] { find_value_loss("cliped"); })
                .find("algo.value_loss = 'cliped': not a registered value loss (registered: clipped"),
            std::string::npos);
  EXPECT_NE(error_of([] { find_value_loss("cliped"); }).find("did you mean 'clipped'?"), std::string::npos);
  expect_values(entropy_bonus(t({1, 2, 3}), 0.01, 3.0), {-0.02});
  // exp(0 - -1) = e capped at 2; exp(-1 - 0).
  expect_values(truncated_is_weights(t({0, -1}), t({-1, 0}), 2.0), {2.0, std::exp(-1.0)});
}

TEST(Algo, KlController) {
  KlController fixed(0.1);
  fixed.update(100.0, 256);
  EXPECT_DOUBLE_EQ(fixed.value(), 0.1);
  // KL 9 against target 6: error 0.5, clamped to 0.2: x (1 + 0.2 * 256 / 10000).
  KlController adaptive(0.1, 6.0, 10000);
  adaptive.update(9.0, 256);
  EXPECT_NEAR(adaptive.value(), 0.1 * 1.00512, 1e-12);
  adaptive.update(3.0, 256);  // error -0.5 -> -0.2
  EXPECT_NEAR(adaptive.value(), 0.1 * 1.00512 * (1 - 0.00512), 1e-12);
}

// --- the advantage-estimator registry (algo/advantage_estimator.h) ---

TEST(AdvantageEstimators, BuiltInsAreRegisteredWithTheirRecords) {
  // Other tests register their own (test_*): the built-ins are among the names, sorted.
  std::vector<std::string> builtin;
  for (const std::string& n : advantage_estimator_names())
    if (n.rfind("test_", 0) != 0) builtin.push_back(n);
  EXPECT_EQ(builtin,
            (std::vector<std::string>{"dr_grpo", "gae", "group_norm", "reinforce", "reinforce_baseline", "rloo"}));
  EXPECT_TRUE(find_advantage_estimator("gae").needs_critic);
  EXPECT_FALSE(find_advantage_estimator("gae").group_baseline);
  for (const char* g : {"rloo", "reinforce_baseline", "group_norm", "dr_grpo"}) {
    EXPECT_TRUE(find_advantage_estimator(g).group_baseline) << g;
    EXPECT_FALSE(find_advantage_estimator(g).needs_critic) << g;
  }
  EXPECT_TRUE(find_advantage_estimator("group_norm").normalized);
  EXPECT_TRUE(find_advantage_estimator("dr_grpo").normalized);
  EXPECT_FALSE(find_advantage_estimator("rloo").normalized);
  EXPECT_EQ(find_advantage_estimator("dr_grpo").loss_normalizer, LossNormalizer::kConstant);
  EXPECT_EQ(find_advantage_estimator("group_norm").loss_normalizer, LossNormalizer::kTokenMean);
}

TEST(AdvantageEstimators, AnUnknownNameIsRefusedWithTheRegisteredOnesAndTheClosest) {
  JobConfig job;
  job.roles.critic.enabled = false;
  job.rollout.n_samples_per_prompt = 4;
  job.algo.advantage_estimator = "group_nrom";
  const std::string msg = error_of([&] { check_config(job); });
  EXPECT_EQ(msg.rfind("algo.advantage_estimator = 'group_nrom': not a registered advantage estimator (registered: ", 0),
            0u)
      << msg;
  EXPECT_NE(msg.find("gae, group_norm,"), std::string::npos) << msg;
  EXPECT_NE(msg.find("; did you mean 'group_norm'?"), std::string::npos) << msg;
  EXPECT_THROW(check_config(job), ConfigError);
  job.algo.advantage_estimator = "group_norm";
  EXPECT_NO_THROW(check_config(job));
}

// check_config asks the record, for built-ins and a user's alike.
TEST(AdvantageEstimators, TheConfigChecksAskTheRecord) {
  JobConfig job;
  job.roles.critic.enabled = false;
  job.algo.advantage_estimator = "gae";
  EXPECT_NE(error_of([&] { check_config(job); }).find("gae needs a critic; set roles.critic.enabled=true or choose "
                                                      "one without: dr_grpo, group_norm, reinforce"),
            std::string::npos);
  job.algo.advantage_estimator = "rloo";
  job.rollout.n_samples_per_prompt = 1;
  EXPECT_NE(error_of([&] { check_config(job); }).find("rloo compares samples of one prompt; set "
                                                      "rollout.n_samples_per_prompt >= 2 (it is 1)"),
            std::string::npos);
  job.roles.critic.enabled = true;
  job.algo.advantage_estimator = "reinforce";
  EXPECT_NE(error_of([&] { check_config(job); }).find("reinforce does not use a critic"), std::string::npos);

  static const bool registered = [] {
    AdvantageEstimatorDef d;
    d.needs_critic = true;
    d.compute = [](const AdvantageInputs& in) { return AdvantageOutputs{in.rewards - in.values, in.rewards}; };
    register_advantage_estimator("test_td0", d);
    return true;
  }();
  ASSERT_TRUE(registered);
  job.algo.advantage_estimator = "test_td0";
  EXPECT_NO_THROW(check_config(job));
  job.roles.critic.enabled = false;
  EXPECT_NE(error_of([&] { check_config(job); }).find("test_td0 needs a critic"), std::string::npos);
}

TEST(AdvantageEstimators, RegistrationRefusesDuplicatesBadNamesAndNoFunction) {
  AdvantageEstimatorDef d;
  d.compute = [](const AdvantageInputs& in) { return AdvantageOutputs{in.rewards, in.rewards}; };
  EXPECT_EQ(error_of([&] { register_advantage_estimator("gae", d); }),
            "advantage estimator 'gae' is registered already; register each name once");
  EXPECT_EQ(error_of([&] { register_advantage_estimator("My Estimator", d); }),
            "advantage estimator name 'My Estimator': use 1 to 64 of a-z, 0-9, '_', '.', '-'");
  EXPECT_EQ(error_of([&] { register_advantage_estimator("test_no_function", AdvantageEstimatorDef{}); }),
            "advantage estimator 'test_no_function': no compute function");
  EXPECT_FALSE(advantage_estimator_names().empty());
  for (const std::string& n : advantage_estimator_names()) EXPECT_NE(n, "test_no_function");
}

// The mechanism itself, on a registry of its own.
TEST(Registry, FindsAtAndNames) {
  Registry<int> r("widget");
  r.add("b", 2);
  r.add("a", 1);
  EXPECT_EQ(r.names(), (std::vector<std::string>{"a", "b"}));
  ASSERT_NE(r.find("a"), nullptr);
  EXPECT_EQ(*r.find("a"), 1);
  EXPECT_EQ(r.find("c"), nullptr);
  EXPECT_EQ(r.at("b", "x.widget"), 2);
  EXPECT_EQ(error_of([&] { r.at("bb", "x.widget"); }),
            "x.widget = 'bb': not a registered widget (registered: a, b); did you mean 'b'?");
  EXPECT_EQ(error_of([&] { r.at("zzzz", "x.widget"); }), "x.widget = 'zzzz': not a registered widget (registered: a, b)");
  // An entry the registry's check finds wrong is refused, naming it, and not added.
  Registry<int> positive("count", [](const int& n) { return n > 0 ? "" : "must be positive"; });
  positive.add("one", 1);
  EXPECT_EQ(error_of([&] { positive.add("zero", 0); }), "count 'zero': must be positive");
  EXPECT_EQ(positive.names(), (std::vector<std::string>{"one"}));
}

}  // namespace
}  // namespace tiller::algo

// A registry of one's own through the two macros: one declaration, one definition, the three
// functions every registry has; and the lookups' old names find what find_x finds.
namespace tiller::widgets {
struct WidgetDef {
  int size = 0;
};
TILLER_REGISTRY_API(widget, WidgetDef);
namespace {
Registry<WidgetDef>& widgets() {
  static auto* r = [] {
    auto* reg = new Registry<WidgetDef>("widget", [](const WidgetDef& d) { return d.size > 0 ? "" : "no size"; });
    reg->add("builtin", WidgetDef{3});
    return reg;
  }();
  return *r;
}
}  // namespace
TILLER_REGISTRY_DEFINE(widget, WidgetDef, widgets, "x.widget")

namespace {
TEST(Registry, TheMacrosGiveARegistryItsThreeFunctions) {
  register_widget("mine", WidgetDef{5});
  EXPECT_EQ(find_widget("mine").size, 5);
  EXPECT_EQ(find_widget("builtin").size, 3);
  EXPECT_EQ(widget_names(), (std::vector<std::string>{"builtin", "mine"}));
  EXPECT_EQ(tiller::error_of([] { find_widget("mne"); }),
            "x.widget = 'mne': not a registered widget (registered: builtin, mine); did you mean 'mine'?");
  EXPECT_EQ(tiller::error_of([] { register_widget("empty", WidgetDef{}); }), "widget 'empty': no size");
  // The old lookup names forward to find_x.
  EXPECT_EQ(&algo::policy_loss_def("ppo"), &algo::find_policy_loss("ppo"));
  EXPECT_EQ(&algo::advantage_estimator("gae"), &algo::find_advantage_estimator("gae"));
}
}  // namespace
}  // namespace tiller::widgets
