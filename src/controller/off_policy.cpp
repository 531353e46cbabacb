#include "controller/off_policy.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tiller::controller {

OffPolicySpec OffPolicySpec::from_job(const JobConfig& job) {
  return {job.algo.importance_correction, job.algo.tis_cap,     job.algo.seq_mask_ratio,
          job.algo.is_level,              job.algo.is_cap_lower, job.algo.is_veto};
}

namespace {

// Quantiles of weights w = exp(d) from a histogram of d over [-kRange, kRange] in steps of
// kStep (1% in w), the ends catching what lies past them: bounded memory for any rollout.
class LogWeightHistogram {
 public:
  void add(double d) {
    const double c = std::clamp(d, -kRange, kRange);
    ++bins_[static_cast<size_t>(std::lround((c + kRange) / kStep))];
    ++n_;
  }
  int64_t count() const { return n_; }
  // The weight at quantile q in [0, 1] (1 when empty).
  double quantile(double q) const {
    if (n_ == 0) return 1.0;
    const auto rank = static_cast<int64_t>(std::ceil(q * static_cast<double>(n_ - 1)));
    int64_t seen = 0;
    for (size_t i = 0; i < bins_.size(); ++i) {
      seen += bins_[i];
      if (seen > rank) return std::exp(static_cast<double>(i) * kStep - kRange);
    }
    return std::exp(kRange);
  }

 private:
  static constexpr double kRange = 20.0, kStep = 0.01;
  std::vector<int64_t> bins_ = std::vector<int64_t>(static_cast<size_t>(2 * kRange / kStep) + 1, 0);
  int64_t n_ = 0;
};

// exp(x) kept finite: a sequence's product of ratios can overflow a double.
double bounded_exp(double x) { return std::exp(std::clamp(x, -700.0, 700.0)); }

}  // namespace

OffPolicy off_policy(const Rollout& ro, const OffPolicySpec& spec, uint64_t proximal_version) {
  OffPolicy out;
  const int64_t tokens = ro.response_tokens();
  const bool weighted = spec.correction != ImportanceCorrection::kNone;
  const bool leveled = spec.correction == ImportanceCorrection::kTis || spec.correction == ImportanceCorrection::kMis;
  const IsLevel level = leveled ? spec.level : IsLevel::kToken;
  const double lower = spec.cap_lower > 0 ? spec.cap_lower : (spec.cap > 0 ? 1.0 / spec.cap : 0.0);
  if (weighted) out.weights.resize(static_cast<size_t>(tokens));
  out.masked.assign(static_cast<size_t>(ro.size()), 0);
  // Tokens the engine drew with the proximal weights (numeric mismatch, mismatch/*) and with older
  // weights (asynchronous rollouts: policy lag and numerics, lag/*), apart.
  struct Gap {
    double kl = 0, max_diff = 0, weight_sum = 0;
    int64_t tokens = 0;
    void add(double d, double w) {
      kl += w - 1 - d;
      max_diff = std::max(max_diff, std::abs(d));
      weight_sum += w;
      ++tokens;
    }
  } same, older;
  double weight_sum = 0, k1_sum = 0;
  double level_sum = 0, level_sq = 0;  // the level's weights (per token, or per sample)
  LogWeightHistogram hist;
  int64_t masked_tokens = 0, truncated_tokens = 0, rejected = 0, seq_masked = 0;
  // Multi-turn samples: observation tokens were not sampled; they count nowhere here (weight 1).
  const bool masked = ro.layout.turns;
  int64_t counted = 0, compared = 0, differing = 0;
  // The weight a correction applies to level weight w, counting what it truncated or masked
  // (`n` tokens at once for a sample-level weight).
  auto apply = [&](double w, int64_t n) {
    if (spec.correction == ImportanceCorrection::kTis && w > spec.cap) {
      truncated_tokens += n;
      return spec.cap;
    }
    if (spec.correction == ImportanceCorrection::kMis && (w > spec.cap || w < lower)) {
      masked_tokens += n;
      return 0.0;
    }
    if (spec.correction == ImportanceCorrection::kDecoupled && spec.cap > 0 && w > spec.cap) {
      masked_tokens += n;
      return 0.0;
    }
    return w;
  };
  for (int64_t s = 0; s < ro.size(); ++s) {
    double d_sum = 0;
    int64_t n_s = 0;
    bool vetoed = false;
    int64_t run = ro.run_offset[s];  // the engine's run of weight versions that token t falls in
    const int64_t first = ro.resp_offset[s], end = first + ro.response_len[s];
    for (int64_t t = first; t < end; ++t) {
      if (masked && !ro.loss_mask[static_cast<size_t>(t)]) {
        if (weighted) out.weights[static_cast<size_t>(t)] = 1.f;
        continue;
      }
      ++n_s;
      while (run + 1 < ro.run_offset[s + 1] && t - first >= ro.run_start[static_cast<size_t>(run + 1)]) ++run;
      const bool proximal = ro.run_version[static_cast<size_t>(run)] == proximal_version;
      if (proximal) {
        ++compared;
        differing += std::memcmp(&ro.logp[static_cast<size_t>(t)], &ro.engine_logp[static_cast<size_t>(t)],
                                 sizeof(float)) != 0;
      }
      const double d = static_cast<double>(ro.logp[static_cast<size_t>(t)]) - ro.engine_logp[static_cast<size_t>(t)];
      const double w = std::exp(d);
      d_sum += d;
      k1_sum -= d;
      (proximal ? same : older).add(d, w);
      weight_sum += w;
      vetoed = vetoed || (spec.veto > 0 && w < spec.veto);
      if (level == IsLevel::kToken) {
        hist.add(d);
        level_sum += w;
        level_sq += w * w;
      }
      if (weighted && level == IsLevel::kToken) out.weights[static_cast<size_t>(t)] = static_cast<float>(apply(w, 1));
    }
    counted += n_s;
    if (level != IsLevel::kToken && n_s > 0) {
      // One weight for the whole sample: the product of its ratios, or their geometric mean.
      const double log_w = level == IsLevel::kSequence ? d_sum : d_sum / static_cast<double>(n_s);
      const double w = bounded_exp(log_w);
      hist.add(log_w);
      level_sum += w;
      level_sq += w * w;
      const auto applied = static_cast<float>(apply(w, n_s));
      for (int64_t t = first; t < end; ++t)
        if (!(masked && !ro.loss_mask[static_cast<size_t>(t)])) out.weights[static_cast<size_t>(t)] = applied;
    }
    if (spec.seq_mask_ratio > 0 && n_s > 0) {
      const double g = std::exp(d_sum / static_cast<double>(n_s));
      if (g > spec.seq_mask_ratio || g < 1.0 / spec.seq_mask_ratio) {
        out.masked[static_cast<size_t>(s)] = 1;
        ++seq_masked;
      }
    }
    if (vetoed) {
      rejected += out.masked[static_cast<size_t>(s)] == 0;
      out.masked[static_cast<size_t>(s)] = 1;
    }
    out.masked_samples += out.masked[static_cast<size_t>(s)];
  }
  const auto mean = [](double sum, int64_t n, double none) { return n > 0 ? sum / static_cast<double>(n) : none; };
  out.metrics.emplace_back("mismatch/kl", mean(same.kl, same.tokens, 0.0));
  out.metrics.emplace_back("mismatch/max_abs_logp_diff", same.max_diff);
  out.metrics.emplace_back("mismatch/is_weight_mean", mean(same.weight_sum, same.tokens, 1.0));
  out.metrics.emplace_back("mismatch/tokens_compared", compared);
  out.metrics.emplace_back("mismatch/tokens_differing", differing);
  if (older.tokens > 0) {
    out.metrics.emplace_back("lag/kl", mean(older.kl, older.tokens, 0.0));
    out.metrics.emplace_back("lag/max_abs_logp_diff", older.max_diff);
    out.metrics.emplace_back("lag/is_weight_mean", mean(older.weight_sum, older.tokens, 1.0));
    out.metrics.emplace_back("lag/tokens", older.tokens);
  }
  out.metrics.emplace_back("off_policy/is_weight_mean", mean(weight_sum, counted, 1.0));
  out.metrics.emplace_back("off_policy/mismatch_k1", mean(k1_sum, counted, 0.0));
  out.metrics.emplace_back("off_policy/is_weight_min", hist.quantile(0));
  out.metrics.emplace_back("off_policy/is_weight_p05", hist.quantile(0.05));
  out.metrics.emplace_back("off_policy/is_weight_p50", hist.quantile(0.5));
  out.metrics.emplace_back("off_policy/is_weight_p95", hist.quantile(0.95));
  out.metrics.emplace_back("off_policy/is_weight_max", hist.quantile(1));
  out.metrics.emplace_back("off_policy/is_ess",
                           level_sq > 0 ? level_sum * level_sum / (static_cast<double>(hist.count()) * level_sq) : 1.0);
  if (spec.correction == ImportanceCorrection::kTis) {
    out.metrics.emplace_back("off_policy/truncated_tokens", truncated_tokens);
    out.metrics.emplace_back("off_policy/truncated_share", mean(static_cast<double>(truncated_tokens), counted, 0.0));
  }
  if (spec.correction == ImportanceCorrection::kDecoupled || spec.correction == ImportanceCorrection::kMis) {
    out.metrics.emplace_back("off_policy/masked_tokens", masked_tokens);
    out.metrics.emplace_back("off_policy/masked_share", mean(static_cast<double>(masked_tokens), counted, 0.0));
  }
  if (spec.seq_mask_ratio > 0 || spec.veto > 0) {
    out.metrics.emplace_back("off_policy/masked_samples", out.masked_samples);
    out.metrics.emplace_back("off_policy/masked_sample_share",
                             mean(static_cast<double>(out.masked_samples), ro.size(), 0.0));
  }
  if (spec.seq_mask_ratio > 0) out.metrics.emplace_back("off_policy/seq_masked_samples", seq_masked);
  if (spec.veto > 0) out.metrics.emplace_back("off_policy/rejected_samples", rejected);
  return out;
}

}  // namespace tiller::controller
