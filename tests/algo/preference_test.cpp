// The preference losses (tiller/algo/preference.h) against hand-computed values: the responses'
// sequence log-probs, Bradley-Terry
// with and without margins, DPO's sigmoid loss with and without cDPO's label smoothing (TRL's
// formula), IPO, the implicit rewards and their statistics, and the gradients.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "../common/error_of.h"
#include "tiller/algo/preference.h"
#include "tiller/core/error.h"

namespace tiller::algo {
namespace {

at::Tensor doubles(std::vector<double> v, bool grad = false) {
  return at::tensor(v, at::kDouble).requires_grad_(grad);
}

void expect_values(const at::Tensor& t, std::vector<double> want) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(want.size()));
  const at::Tensor d = t.detach().to(at::kDouble);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(d[static_cast<int64_t>(i)].item<double>(), want[i], 1e-12) << i;
}

TEST(Preference, SequenceLogpsSumOrAverageTheResponse) {
  // Sequences of 3 and 2 tokens; the response is the last 2 and the last 1.
  const at::Tensor logp = doubles({-1, -2, -3, -4, -5}, true);
  const at::Tensor mask = at::tensor({0, 1, 1, 0, 1}, at::kByte);
  const at::Tensor cu = at::tensor({0, 3, 5}, at::kLong);
  at::Tensor sums = sequence_logps(logp, mask, cu, false);
  expect_values(sums, {-5, -5});
  expect_values(sequence_logps(logp, mask, cu, true), {-2.5, -5});
  sums.sum().backward();
  expect_values(logp.grad(), {0, 1, 1, 0, 1});
  EXPECT_NE(error_of([&] { sequence_logps(logp, mask, at::tensor({0, 3, 4}, at::kLong), false); }).find("does not span"),
            std::string::npos);
}

TEST(Preference, BradleyTerry) {
  // Score differences 1 and -1: -log sigmoid(+-1); the gradient in the chosen score is
  // -sigmoid(-diff), in the rejected one its opposite.
  const at::Tensor chosen = doubles({2.0, 0.5}, true), rejected = doubles({1.0, 1.5}, true);
  PreferenceLoss l = bradley_terry_loss(chosen, rejected);
  expect_values(l.losses, {0.3132616875182228, 1.3132616875182228});
  l.losses.sum().backward();
  expect_values(chosen.grad(), {-0.2689414213699951, -0.7310585786300049});
  expect_values(rejected.grad(), {0.2689414213699951, 0.7310585786300049});
  EXPECT_DOUBLE_EQ(l.chosen_reward_sum.item<double>(), 2.5);
  EXPECT_DOUBLE_EQ(l.rejected_reward_sum.item<double>(), 2.5);
  EXPECT_DOUBLE_EQ(l.correct.item<double>(), 1);
  EXPECT_DOUBLE_EQ(l.margin_sum.item<double>(), 0);
  EXPECT_EQ(l.pairs, 2);
  // A margin of 0.5 on the first pair: -log sigmoid(0.5); the statistics stay the scores'.
  const PreferenceLoss m = bradley_terry_loss(doubles({2.0, 0.5}), doubles({1.0, 1.5}), doubles({0.5, 0.0}));
  expect_values(m.losses, {0.47407698418010663, 1.3132616875182228});
  EXPECT_DOUBLE_EQ(m.margin_sum.item<double>(), 0);
  EXPECT_NE(error_of([] { bradley_terry_loss(doubles({1.0}), doubles({1.0, 2.0})); }).find("1 and 2 values"),
            std::string::npos);
}

TEST(Preference, DpoSigmoidCdpoAndIpo) {
  // h = (pc - pr) - (rc - rr): 1 and -2.
  const std::vector<double> pc{-5, -7}, pr{-6, -4}, rc{-5.5, -6}, rr{-5.5, -5};
  DpoOptions o;
  o.beta = 0.1;
  {
    const at::Tensor c = doubles(pc, true), r = doubles(pr, true), refc = doubles(rc, true);
    PreferenceLoss l = dpo_loss(c, r, refc, doubles(rr), o);
    expect_values(l.losses, {0.6443966600735709, 0.7981388693815917});  // -log sigmoid(beta h)
    l.losses.sum().backward();
    expect_values(c.grad(), {-0.047502081252106004, -0.0549833997312478});  // -beta sigmoid(-beta h)
    expect_values(r.grad(), {0.047502081252106004, 0.0549833997312478});
    EXPECT_FALSE(refc.grad().defined()) << "the reference's log-probs carry no gradient";
    // Rewards beta (policy - reference): chosen 0.05, -0.1; rejected -0.05, 0.1.
    EXPECT_NEAR(l.chosen_reward_sum.item<double>(), -0.05, 1e-12);
    EXPECT_NEAR(l.rejected_reward_sum.item<double>(), 0.05, 1e-12);
    EXPECT_DOUBLE_EQ(l.correct.item<double>(), 1);
    EXPECT_NEAR(l.margin_sum.item<double>(), -0.1, 1e-12);
  }
  {
    o.label_smoothing = 0.2;  // TRL: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    const at::Tensor c = doubles(pc, true);
    PreferenceLoss l = dpo_loss(c, doubles(pr), doubles(rc), doubles(rr), o);
    expect_values(l.losses, {0.6643966600735709, 0.7581388693815918});
    l.losses.sum().backward();
    expect_values(c.grad(), {-0.027502081252106004, -0.034983399731247804});
  }
  {
    o.label_smoothing = 0;
    o.type = DpoLossType::kIpo;  // (h - 1 / (2 beta))^2 = (h - 5)^2; its gradient 2 (h - 5)
    const at::Tensor c = doubles(pc, true);
    PreferenceLoss l = dpo_loss(c, doubles(pr), doubles(rc), doubles(rr), o);
    expect_values(l.losses, {16.0, 49.0});
    l.losses.sum().backward();
    expect_values(c.grad(), {-8.0, -14.0});
  }
  o.type = DpoLossType::kSigmoid;
  o.beta = 0;
  EXPECT_NE(error_of([&] { dpo_loss(doubles(pc), doubles(pr), doubles(rc), doubles(rr), o); }).find("beta = 0"),
            std::string::npos);
  o.beta = 0.1;
  o.label_smoothing = 0.5;
  EXPECT_NE(error_of([&] { dpo_loss(doubles(pc), doubles(pr), doubles(rc), doubles(rr), o); }).find("[0, 0.5)"),
            std::string::npos);
  o.label_smoothing = 0.1;
  o.type = DpoLossType::kIpo;
  EXPECT_NE(error_of([&] { dpo_loss(doubles(pc), doubles(pr), doubles(rc), doubles(rr), o); }).find("IPO takes none"),
            std::string::npos);
}

}  // namespace
}  // namespace tiller::algo
