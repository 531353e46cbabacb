#include "tiller/algo/algo.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tiller/core/error.h"
#include "tiller/core/registry.h"

namespace tiller::algo {
namespace {

// Sample boundaries on the host, checked against a token count.
std::vector<int64_t> boundaries(const at::Tensor& cu, int64_t tokens) {
  const at::Tensor c = cu.to(at::kCPU, at::kLong).contiguous();
  TILLER_CHECK(c.dim() == 1 && c.numel() >= 1, "cu must be [B + 1]");
  std::vector<int64_t> b(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  TILLER_CHECK(b.front() == 0 && b.back() == tokens, "cu spans [{}, {}] but there are {} tokens", b.front(), b.back(),
               tokens);
  for (size_t i = 1; i < b.size(); ++i) TILLER_CHECK(b[i] >= b[i - 1], "cu must not decrease (at {})", i);
  return b;
}

std::vector<double> host(const at::Tensor& x) {
  const at::Tensor c = x.detach().to(at::kCPU, at::kDouble).contiguous().view({-1});
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

// The per-token scans read their inputs and write their outputs in place, computing in double:
// a rollout's arrays are large (hundreds of MB at scale), and a double copy of each would double
// the controller's memory traffic. The results equal a computation on double copies bit for bit.

// `x`'s values as doubles: its own storage when it is contiguous float or double on the CPU.
class HostView {
 public:
  explicit HostView(const at::Tensor& x) {
    at::Tensor d = x.detach().view({-1});
    if (!d.device().is_cpu() || !d.is_contiguous() || (d.scalar_type() != at::kFloat && d.scalar_type() != at::kDouble))
      d = d.to(at::kCPU, at::kDouble).contiguous();
    keep_ = d;
    if (d.scalar_type() == at::kFloat) f_ = d.data_ptr<float>();
    else d_ = d.data_ptr<double>();
  }
  double operator[](int64_t i) const { return f_ ? static_cast<double>(f_[i]) : d_[i]; }

 private:
  at::Tensor keep_;
  const float* f_ = nullptr;
  const double* d_ = nullptr;
};

// An output of n values with `as`'s floating dtype and device (float when `as` is not floating),
// written as doubles on the host.
class HostOut {
 public:
  HostOut(int64_t n, const at::Tensor& as)
      : dtype_(at::isFloatingType(as.scalar_type()) ? as.scalar_type() : at::kFloat), device_(as.device()) {
    t_ = at::empty({n}, dtype_ == at::kFloat ? at::kFloat : at::kDouble);
    if (dtype_ == at::kFloat) f_ = t_.data_ptr<float>();
    else d_ = t_.data_ptr<double>();
  }
  void set(int64_t i, double v) {
    if (f_) f_[i] = static_cast<float>(v);
    else d_[i] = v;
  }
  at::Tensor done() const { return t_.to(device_, dtype_); }

 private:
  at::ScalarType dtype_;
  at::Device device_;
  at::Tensor t_;
  float* f_ = nullptr;
  double* d_ = nullptr;
};


void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TILLER_CHECK(a.sizes() == b.sizes(), "{}: shapes {} and {} differ", what, fmt::join(a.sizes().vec(), "x"),
               fmt::join(b.sizes().vec(), "x"));
}

}  // namespace

namespace {

// The registry, the built-ins added on first use (through the same call as a user's).
Registry<KlEstimatorDef>& kl_registry() {
  static Registry<KlEstimatorDef>* r = [] {
    auto* reg = new Registry<KlEstimatorDef>(
        "KL estimator", [](const KlEstimatorDef& d) { return d.estimate ? "" : "no estimate function"; });
    reg->add("k1", {[](const at::Tensor& logp, const at::Tensor& ref) { return logp - ref; }, "d = logp - ref"});
    reg->add("k2",
           {[](const at::Tensor& logp, const at::Tensor& ref) {
              const at::Tensor d = logp - ref;
              return 0.5 * d * d;
            },
            "d^2 / 2"});
    reg->add("k3",
           {[](const at::Tensor& logp, const at::Tensor& ref) {
              const at::Tensor d = logp - ref;
              return at::exp(-d) - 1 + d;
            },
            "exp(-d) - 1 + d (unbiased, never negative)"});
    return reg;
  }();
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(kl_estimator, KlEstimatorDef, kl_registry, "algo.kl_estimator")

at::Tensor kl_estimate(const at::Tensor& logp, const at::Tensor& ref_logp, const std::string& estimator) {
  check_same(logp, ref_logp, "kl_estimate");
  at::Tensor kl = find_kl_estimator(estimator).estimate(logp, ref_logp);
  if (!kl.defined() || kl.sizes() != logp.sizes())
    throw Error(fmt::format("KL estimator {}: it returned {} for {} log-probs; return one value per token", estimator,
                            kl.defined() ? fmt::format("{} values", kl.numel()) : "nothing", logp.numel()));
  return kl;
}

at::Tensor token_rewards(const at::Tensor& scores, const at::Tensor& kl, const at::Tensor& cu, double kl_coef) {
  const auto b = boundaries(cu, kl.numel());
  TILLER_CHECK(scores.numel() + 1 == static_cast<int64_t>(b.size()), "{} scores for {} samples", scores.numel(),
               b.size() - 1);
  const HostView k(kl), s(scores);
  HostOut out(kl.numel(), kl);
  for (int64_t t = 0; t < kl.numel(); ++t) out.set(t, k[t] * -kl_coef);
  for (size_t i = 0; i + 1 < b.size(); ++i)
    if (b[i + 1] > b[i]) out.set(b[i + 1] - 1, k[b[i + 1] - 1] * -kl_coef + s[static_cast<int64_t>(i)]);
  return out.done();
}

at::Tensor clip_rewards(const at::Tensor& scores, double clip) {
  return clip > 0 ? scores.clamp(-clip, clip) : scores;
}

void RunningMoments::update(const at::Tensor& x) {
  const std::vector<double> v = host(x);
  if (v.empty()) return;
  double mean = 0;
  for (double a : v) mean += a;
  mean /= static_cast<double>(v.size());
  double m2 = 0;
  for (double a : v) m2 += (a - mean) * (a - mean);
  const auto n = static_cast<int64_t>(v.size());
  const double delta = mean - mean_;
  const int64_t total = count_ + n;
  mean_ += delta * static_cast<double>(n) / static_cast<double>(total);
  m2_ += m2 + delta * delta * static_cast<double>(count_) * static_cast<double>(n) / static_cast<double>(total);
  count_ = total;
}

double RunningMoments::std() const { return count_ > 1 ? std::sqrt(m2_ / static_cast<double>(count_ - 1)) : 1.0; }

at::Tensor RunningMoments::normalize(const at::Tensor& x, double eps) const { return (x - mean_) / (std() + eps); }

AdvantagesReturns gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& cu, double gamma,
                      double lambda) {
  check_same(rewards, values, "gae");
  const auto b = boundaries(cu, rewards.numel());
  const HostView r(rewards), v(values);
  HostOut adv(rewards.numel(), rewards), ret(rewards.numel(), rewards);
  for (size_t s = 0; s + 1 < b.size(); ++s) {
    double last = 0;
    for (int64_t t = b[s + 1] - 1; t >= b[s]; --t) {
      const double next = t + 1 < b[s + 1] ? v[t + 1] : 0.0;
      const double delta = r[t] + gamma * next - v[t];
      last = delta + gamma * lambda * last;
      adv.set(t, last);
      ret.set(t, last + v[t]);
    }
  }
  return {adv.done(), ret.done()};
}

at::Tensor discounted_returns(const at::Tensor& rewards, const at::Tensor& cu, double gamma) {
  const auto b = boundaries(cu, rewards.numel());
  const HostView r(rewards);
  HostOut out(rewards.numel(), rewards);
  for (size_t s = 0; s + 1 < b.size(); ++s) {
    double acc = 0;
    for (int64_t t = b[s + 1] - 1; t >= b[s]; --t) out.set(t, acc = r[t] + gamma * acc);
  }
  return out.done();
}

at::Tensor group_advantages(const at::Tensor& scores, int64_t n, GroupBaseline kind, double eps) {
  TILLER_CHECK(n >= 1 && scores.numel() % n == 0, "{} scores do not form groups of {}", scores.numel(), n);
  if (kind == GroupBaseline::kRloo)
    TILLER_CHECK(n >= 2, "RLOO needs at least 2 samples per prompt (rollout.n_samples_per_prompt)");
  const at::Tensor g = scores.to(at::kDouble).view({-1, n});
  const at::Tensor sum = g.sum(1, true), mean = sum / static_cast<double>(n);
  at::Tensor a;
  switch (kind) {
    case GroupBaseline::kRloo: a = g - (sum - g) / static_cast<double>(n - 1); break;
    case GroupBaseline::kMean: a = g - mean; break;
    case GroupBaseline::kMeanStd:
      a = (g - mean) / ((n > 1 ? g.std(1, /*unbiased=*/true, true) : at::zeros_like(mean)) + eps);
      break;
  }
  return a.view({-1}).to(at::isFloatingType(scores.scalar_type()) ? scores.scalar_type() : at::kFloat);
}

at::Tensor per_token(const at::Tensor& per_sample, const at::Tensor& cu) {
  const at::Tensor c = cu.to(per_sample.device(), at::kLong);
  TILLER_CHECK(c.numel() == per_sample.numel() + 1, "{} values for {} samples", per_sample.numel(), c.numel() - 1);
  return per_sample.repeat_interleave(c.narrow(0, 1, per_sample.numel()) - c.narrow(0, 0, per_sample.numel()));
}

at::Tensor whiten(const at::Tensor& x, bool shift_mean, double eps) {
  if (x.numel() < 2) return x;
  const at::Tensor mean = x.mean(), var = x.var(/*unbiased=*/false);
  at::Tensor w = (x - mean) * at::rsqrt(var + eps);
  return shift_mean ? w : w + mean;
}

PolicyLoss policy_loss(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                       const PolicyLossConfig& cfg, double normalizer, const at::Tensor& is_weights) {
  check_same(logp, old_logp, "policy_loss");
  check_same(logp, advantages, "policy_loss");
  TILLER_CHECK(normalizer > 0, "policy_loss: normalizer must be > 0");
  PolicyLoss out;
  const at::Tensor adv = advantages.detach().to(logp.scalar_type());
  const at::Tensor ratio = at::exp(logp - old_logp.detach());
  const at::Tensor unclipped = -adv * ratio;
  const at::Tensor clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
  at::Tensor loss = at::maximum(unclipped, clipped);
  at::Tensor took = clipped > unclipped;
  if (cfg.dual_clip > 1) {
    // For negative advantages the loss is at most -dual_clip * A (= dual_clip * |A|).
    const at::Tensor cap = -adv * cfg.dual_clip;
    const at::Tensor neg = adv < 0;
    took = at::where(neg & (loss > cap), at::ones_like(took), took);
    loss = at::where(neg, at::minimum(loss, cap), loss);
  }
  if (is_weights.defined()) {
    check_same(logp, is_weights, "policy_loss is_weights");
    loss = loss * is_weights.detach().to(loss.scalar_type());
  }
  out.loss = loss.sum() / normalizer;
  out.tokens = logp.numel();
  out.clipped_tokens = took.to(at::kDouble).sum();
  out.kl_sum = (old_logp.detach() - logp.detach()).to(at::kDouble).sum();
  return out;
}

PolicyLoss pg_loss(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                   double normalizer, const at::Tensor& is_weights) {
  check_same(logp, old_logp, "pg_loss");
  check_same(logp, advantages, "pg_loss");
  TILLER_CHECK(normalizer > 0, "pg_loss: normalizer must be > 0");
  at::Tensor loss = -advantages.detach().to(logp.scalar_type()) * logp;
  if (is_weights.defined()) {
    check_same(logp, is_weights, "pg_loss is_weights");
    loss = loss * is_weights.detach().to(loss.scalar_type());
  }
  PolicyLoss out;
  out.loss = loss.sum() / normalizer;
  out.tokens = logp.numel();
  out.clipped_tokens = at::zeros({}, logp.options().dtype(at::kDouble));
  out.kl_sum = (old_logp.detach() - logp.detach()).to(at::kDouble).sum();
  return out;
}

namespace {

Registry<PolicyLossDef>& policy_loss_registry() {
  static Registry<PolicyLossDef>* r = [] {
    auto* reg = new Registry<PolicyLossDef>(
        "policy loss", [](const PolicyLossDef& d) { return d.compute ? "" : "no compute function"; });
    reg->add("ppo",
                    {[](const PolicyLossInputs& in) {
                       return policy_loss(in.logp, in.old_logp, in.advantages, in.clip, in.normalizer, in.is_weights);
                     },
                     "PPO's clipped surrogate (clip-higher, dual clip)"});
    reg->add("pg",
                    {[](const PolicyLossInputs& in) {
                       return pg_loss(in.logp, in.old_logp, in.advantages, in.normalizer, in.is_weights);
                     },
                     "-A * logp, no ratio or clipping (GPG)"});
    return reg;
  }();
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(policy_loss, PolicyLossDef, policy_loss_registry, "algo.policy_loss")

namespace {
double per_token(const at::Tensor& sum, int64_t tokens) {
  return tokens > 0 && sum.defined() ? sum.item<double>() / static_cast<double>(tokens) : 0.0;
}
}  // namespace

double PolicyLoss::clip_fraction() const { return per_token(clipped_tokens, tokens); }
double PolicyLoss::approx_kl() const { return per_token(kl_sum, tokens); }
double ValueLoss::clip_fraction() const { return per_token(clipped_tokens, tokens); }

ValueLoss value_loss(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, double clip,
                     double normalizer) {
  check_same(values, old_values, "value_loss");
  check_same(values, returns, "value_loss");
  TILLER_CHECK(normalizer > 0, "value_loss: normalizer must be > 0");
  ValueLoss out;
  out.tokens = values.numel();
  const at::Tensor ret = returns.detach().to(values.scalar_type());
  const at::Tensor plain = (values - ret).pow(2);
  if (clip <= 0) {
    out.loss = 0.5 * plain.sum() / normalizer;
    out.clipped_tokens = at::zeros({}, values.options().dtype(at::kDouble));
    return out;
  }
  const at::Tensor old = old_values.detach().to(values.scalar_type());
  const at::Tensor clipped = (old + (values - old).clamp(-clip, clip) - ret).pow(2);
  out.loss = 0.5 * at::maximum(plain, clipped).sum() / normalizer;
  out.clipped_tokens = (clipped > plain).to(at::kDouble).sum();
  return out;
}

namespace {

Registry<ValueLossDef>& value_loss_registry() {
  static Registry<ValueLossDef>* r = [] {
    auto* reg = new Registry<ValueLossDef>(
        "value loss", [](const ValueLossDef& d) { return d.compute ? "" : "no compute function"; });
    reg->add("clipped",
             {[](const ValueLossInputs& in) {
                return value_loss(in.values, in.old_values, in.returns, in.clip, in.normalizer);
              },
              "0.5 max((v - R)^2, (clipped v - R)^2), clipped around the old values by algo.value_clip"});
    return reg;
  }();
  return *r;
}

}  // namespace

TILLER_REGISTRY_DEFINE(value_loss, ValueLossDef, value_loss_registry, "algo.value_loss")

at::Tensor entropy_bonus(const at::Tensor& entropy, double coef, double normalizer) {
  TILLER_CHECK(normalizer > 0, "entropy_bonus: normalizer must be > 0");
  return -coef * entropy.sum() / normalizer;
}

at::Tensor kl_loss(const at::Tensor& logp, const at::Tensor& ref_logp, const std::string& estimator, double coef,
                   double normalizer) {
  TILLER_CHECK(normalizer > 0, "kl_loss: normalizer must be > 0");
  return coef * kl_estimate(logp, ref_logp.detach(), estimator).sum() / normalizer;
}

at::Tensor truncated_is_weights(const at::Tensor& trainer_logp, const at::Tensor& engine_logp, double cap) {
  check_same(trainer_logp, engine_logp, "truncated_is_weights");
  TILLER_CHECK(cap > 0, "truncated_is_weights: cap must be > 0");
  return at::exp(trainer_logp.detach() - engine_logp.detach()).clamp_max(cap);
}

KlController::KlController(double init_coef, double target, double horizon)
    : coef_(init_coef), target_(target), horizon_(horizon) {
  TILLER_CHECK(init_coef >= 0 && horizon > 0, "KL controller: coefficient {} and horizon {}", init_coef, horizon);
}

void KlController::update(double current_kl, int64_t steps) {
  if (target_ <= 0) return;
  const double error = std::clamp(current_kl / target_ - 1.0, -0.2, 0.2);
  coef_ *= 1.0 + error * static_cast<double>(steps) / horizon_;
}

}  // namespace tiller::algo
