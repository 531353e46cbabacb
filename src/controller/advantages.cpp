#include "controller/advantages.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::controller {
namespace {

at::Tensor floats(const std::vector<float>& v) {
  return at::from_blob(const_cast<float*>(v.data()), {static_cast<int64_t>(v.size())}, at::kFloat);
}

struct Moments {
  double mean = 0, std = 0, min = 0, max = 0;
};
// Mean, unbiased std, min and max in double, in two passes over the values (no copy).
template <typename T>
Moments moments(const T* p, int64_t n) {
  if (n == 0) return {};
  Moments m{0, 0, static_cast<double>(p[0]), static_cast<double>(p[0])};
  for (int64_t i = 0; i < n; ++i) {
    const auto x = static_cast<double>(p[i]);
    m.mean += x;
    m.min = std::min(m.min, x);
    m.max = std::max(m.max, x);
  }
  m.mean /= static_cast<double>(n);
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += (static_cast<double>(p[i]) - m.mean) * (static_cast<double>(p[i]) - m.mean);
  m.std = n > 1 ? std::sqrt(ss / static_cast<double>(n - 1)) : 0.0;
  return m;
}
template <typename T>
Moments moments(const std::vector<T>& v) {
  return moments(v.data(), static_cast<int64_t>(v.size()));
}
Moments moments(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  return moments(c.data_ptr<float>(), c.numel());
}

std::vector<float> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

}  // namespace

AdvantageSpec AdvantageSpec::from_job(const JobConfig& job, bool have_ref) {
  AdvantageSpec s;
  s.estimator = job.algo.advantage_estimator;
  s.kl_estimator = job.algo.kl_estimator;
  s.kl_in_reward = job.algo.kl_in_reward;
  s.have_ref = have_ref;
  s.gamma = job.algo.gamma;
  s.lambda = job.algo.lambd;
  s.whiten = job.algo.whiten_advantages;
  s.reward_clip = job.reward.clip;
  s.normalize_rewards = job.reward.normalize;
  s.n = job.rollout.n_samples_per_prompt;
  s.overlong_buffer = job.reward.overlong_buffer;
  s.overlong_penalty = job.reward.overlong_penalty;
  s.max_new_tokens = job.response_limit();
  s.distill_coef = job.algo.distill_coef;
  return s;
}

bool AdvantageSpec::skips_whitening() const { return algo::find_advantage_estimator(estimator).normalized; }

double overlong_penalty(int64_t length, int64_t max_new_tokens, int64_t buffer, double penalty) {
  if (buffer <= 0) return 0;
  const int64_t free = max_new_tokens - buffer;
  if (length <= free) return 0;
  if (length >= max_new_tokens) return -penalty;
  return -penalty * static_cast<double>(length - free) / static_cast<double>(buffer);
}

AdvantageResult compute_advantages(const Rollout& ro, const AdvantageSpec& spec, const AdvantageState& state) {
  AdvantageResult out;
  out.state = state;
  const int64_t b = ro.size();
  // Multi-turn samples: the estimators see the model's tokens only, back to back (an observation
  // is part of the state the next turn starts from, not an action); `keep` are their positions,
  // and the results go back to them (observation tokens get advantage and return 0).
  const bool masked = ro.layout.turns;
  std::vector<int64_t> cu_v, keep;
  std::vector<int64_t> turn_pos;  // with turns: each turn's last token among the kept ones
  if (masked) {
    cu_v.reserve(static_cast<size_t>(b) + 1);
    for (int64_t s = 0; s < b; ++s) {
      cu_v.push_back(static_cast<int64_t>(keep.size()));
      int64_t next_turn = ro.turn_offset[s];
      for (int64_t t = 0; t < ro.response_len[s]; ++t) {
        if (!ro.loss_mask[static_cast<size_t>(ro.resp_offset[s] + t)]) continue;
        if (next_turn < ro.turn_offset[s + 1] && ro.turn_end[static_cast<size_t>(next_turn)] == t) {
          turn_pos.push_back(static_cast<int64_t>(keep.size()));
          ++next_turn;
        }
        keep.push_back(ro.resp_offset[s] + t);
      }
      // A sample its loop discarded (no model token: agent.drift = drop) has no place for its turns.
      if (static_cast<int64_t>(keep.size()) == cu_v.back())
        for (; next_turn < ro.turn_offset[s + 1]; ++next_turn) turn_pos.push_back(-1);
      TILLER_CHECK(next_turn == ro.turn_offset[s + 1], "sample {}: a turn ends on an observation token", s);
    }
    cu_v.push_back(static_cast<int64_t>(keep.size()));
  } else {
    cu_v = ro.resp_offset;
    cu_v.push_back(ro.response_tokens());
  }
  const at::Tensor cu = at::tensor(cu_v, at::kLong);
  const at::Tensor kept = masked ? at::tensor(keep, at::kLong) : at::Tensor();
  auto model_part = [&](const std::vector<float>& v) { return masked ? floats(v).index_select(0, kept) : floats(v); };
  const at::Tensor logp = model_part(ro.logp);
  const at::Tensor kl =
      spec.have_ref ? algo::kl_estimate(logp, model_part(ro.ref_logp), spec.kl_estimator) : at::zeros_like(logp);

  std::vector<float> totals(ro.score);
  double turn_reward_sum = 0;
  if (masked)
    for (int64_t s = 0; s < b; ++s) {
      totals[static_cast<size_t>(s)] = static_cast<float>(ro.total_reward(s));
      turn_reward_sum += ro.total_reward(s) - ro.score[s];
    }
  at::Tensor scores = at::tensor(totals, at::kFloat);
  const Moments raw = moments(totals);
  double penalized = 0;
  if (spec.overlong_buffer > 0) {
    std::vector<float> pen(static_cast<size_t>(b));
    for (int64_t s = 0; s < b; ++s) {
      pen[static_cast<size_t>(s)] = static_cast<float>(
          overlong_penalty(ro.response_len[s], spec.max_new_tokens, spec.overlong_buffer, spec.overlong_penalty));
      if (pen[static_cast<size_t>(s)] != 0) ++penalized;
    }
    scores = scores + at::tensor(pen, at::kFloat);
  }
  scores = algo::clip_rewards(scores, spec.reward_clip);
  if (spec.normalize_rewards) {
    out.state.reward_moments.update(scores);
    scores = out.state.reward_moments.normalize(scores);
  }
  const double kl_reward_coef = spec.kl_in_reward ? state.kl_coef : 0.0;
  // Per-token rewards: the sample's shaped total at its last token; with turns, each turn's own
  // reward moves to the turn's last token (the total stays the same).
  auto token_rewards = [&]() {
    at::Tensor r = algo::token_rewards(scores, kl, cu, kl_reward_coef);
    if (!masked || turn_pos.empty()) return r;
    r = r.to(at::kFloat).clone().contiguous();
    float* p = r.data_ptr<float>();
    for (int64_t s = 0; s < b; ++s)
      for (int64_t i = ro.turn_offset[s]; i < ro.turn_offset[s + 1]; ++i) {
        const float tr = ro.turn_reward[static_cast<size_t>(i)];
        if (turn_pos[static_cast<size_t>(i)] < 0) continue;  // a discarded sample's
        p[turn_pos[static_cast<size_t>(i)]] += tr;
        p[cu_v[static_cast<size_t>(s) + 1] - 1] -= tr;
      }
    return r;
  };
  const algo::AdvantageEstimatorDef& est = algo::find_advantage_estimator(spec.estimator);
  algo::AdvantageInputs in;
  in.scores = scores;
  in.rewards = token_rewards();
  in.kl = kl;
  in.kl_coef = kl_reward_coef;
  in.cu = cu;
  in.n = spec.n;
  in.gamma = spec.gamma;
  in.lambda = spec.lambda;
  if (est.needs_critic) {
    TILLER_CHECK(ro.values.size() == ro.logp.size(), "advantage estimator {} needs the critic's values: {} for {} tokens",
                 spec.estimator, ro.values.size(), ro.logp.size());
    in.values = model_part(ro.values);
  }
  if (est.group_baseline) {
    // The n samples of each prompt, in (prompt, sample) order.
    const int64_t n = spec.n;
    TILLER_CHECK(n >= 1 && b % n == 0, "a group baseline over {} samples in groups of {}", b, n);
    std::vector<int64_t> by_slot(static_cast<size_t>(b), -1);
    for (int64_t s = 0; s < b; ++s) {
      const int64_t slot = ro.prompt[s] * n + ro.sample[s];
      TILLER_CHECK(slot >= 0 && slot < b && by_slot[static_cast<size_t>(slot)] < 0,
                   "sample {} of group {} is out of place or twice", ro.sample[s], ro.prompt[s]);
      by_slot[static_cast<size_t>(slot)] = s;
    }
    in.group_order = at::tensor(by_slot, at::kLong);
  }
  const algo::AdvantageOutputs est_out = est.compute(in);
  const int64_t tokens = logp.numel();
  auto check_out = [&](const at::Tensor& t, const char* what) {
    if (!t.defined() || t.dim() != 1 || t.numel() != tokens)
      throw Error(fmt::format("advantage estimator {}: its {} are {} for {} tokens; return one float per token",
                              spec.estimator, what, t.defined() ? fmt::format("{} elements", t.numel()) : "undefined",
                              tokens));
  };
  check_out(est_out.advantages, "advantages");
  at::Tensor adv = est_out.advantages.to(at::kCPU, at::kFloat);
  at::Tensor ret = adv;
  if (ro.layout.critic) {
    check_out(est_out.returns, "returns");
    ret = est_out.returns.to(at::kCPU, at::kFloat);
  }
  const Moments adv_raw = moments(adv);
  if (spec.whiten && !spec.skips_whitening() && adv.numel() > 0) adv = algo::whiten(adv);
  // On-policy distillation: each model token's advantage gains the teacher's (the reference's)
  // log-prob over the student's, after the task's advantages are normalised (a per-token signal:
  // neither summed over later tokens nor normalised with them).
  at::Tensor teacher_gap;
  if (spec.distill_coef > 0) {
    TILLER_CHECK(spec.have_ref && ro.ref_logp.size() == ro.logp.size(),
                 "algo.distill_coef: the teacher's (the reference's) log-probs are missing: {} for {} tokens",
                 ro.ref_logp.size(), ro.logp.size());
    teacher_gap = model_part(ro.ref_logp) - logp;
    adv = adv + spec.distill_coef * teacher_gap;
  }
  if (masked) {
    // Back to every response token; observation tokens get 0.
    auto spread = [&](const at::Tensor& t) {
      std::vector<float> full(static_cast<size_t>(ro.response_tokens()), 0.f);
      const at::Tensor c = t.to(at::kFloat).contiguous();
      const float* p = c.data_ptr<float>();
      for (size_t i = 0; i < keep.size(); ++i) full[static_cast<size_t>(keep[i])] = p[i];
      return full;
    };
    out.advantages = spread(adv);
    if (ro.layout.critic) out.returns = spread(ret);
  } else {
    out.advantages = to_vector(adv);
    if (ro.layout.critic) out.returns = to_vector(ret);
  }

  out.kl_mean_per_sample = b > 0 && ro.response_tokens() > 0 ? kl.sum().item<double>() / static_cast<double>(b) : 0.0;
  const Moments lens = moments(ro.response_len);
  const Moments plen = moments(ro.prompt_len);
  double truncated = 0;
  for (uint8_t t : ro.truncated) truncated += t;
  Metrics& m = out.metrics;
  m.emplace_back("reward/mean", raw.mean);
  m.emplace_back("reward/std", raw.std);
  m.emplace_back("reward/min", raw.min);
  m.emplace_back("reward/max", raw.max);
  m.emplace_back("kl/mean_per_sample", out.kl_mean_per_sample);
  m.emplace_back("kl/coef", state.kl_coef);
  if (teacher_gap.defined()) {
    const double tokens_d = static_cast<double>(std::max<int64_t>(1, teacher_gap.numel()));
    m.emplace_back("distill/reverse_kl", -teacher_gap.sum().item<double>() / tokens_d);  // per token, k1
    m.emplace_back("distill/teacher_logprob", model_part(ro.ref_logp).sum().item<double>() / tokens_d);
    m.emplace_back("distill/student_logprob", logp.sum().item<double>() / tokens_d);
  }
  m.emplace_back("advantages/mean", adv_raw.mean);
  m.emplace_back("advantages/std", adv_raw.std);
  m.emplace_back("advantages/min", adv_raw.min);
  m.emplace_back("advantages/max", adv_raw.max);
  m.emplace_back("returns/mean", ro.layout.critic ? moments(ret).mean : adv_raw.mean);
  if (ro.layout.critic) m.emplace_back("values/mean", moments(ro.values).mean);
  m.emplace_back("response_length/mean", lens.mean);
  m.emplace_back("response_length/max", lens.max);
  m.emplace_back("response_length/truncated_fraction", b > 0 ? truncated / static_cast<double>(b) : 0.0);
  m.emplace_back("prompt_length/mean", plen.mean);
  if (masked) {
    // The samples' turns: how many, and the response's tokens by origin.
    std::vector<int64_t> turns(static_cast<size_t>(b));
    for (int64_t s = 0; s < b; ++s) turns[static_cast<size_t>(s)] = ro.turns(s);
    const Moments tm = moments(turns);
    const double model = static_cast<double>(keep.size());
    m.emplace_back("turns/mean", tm.mean);
    m.emplace_back("turns/max", tm.max);
    m.emplace_back("tokens/model", model);
    m.emplace_back("tokens/observation", static_cast<double>(ro.response_tokens()) - model);
    m.emplace_back("reward/env_mean", b > 0 ? turn_reward_sum / static_cast<double>(b) : 0.0);
    m.emplace_back("reward/outcome_mean", moments(ro.score).mean);
  }
  if (spec.overlong_buffer > 0) m.emplace_back("reward/overlong_penalized_fraction", b > 0 ? penalized / b : 0.0);
  return out;
}

}  // namespace tiller::controller
