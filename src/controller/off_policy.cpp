#include "controller/off_policy.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tiller::rollout {

OffPolicySpec OffPolicySpec::from_job(const JobConfig& job) {
  return {job.algo.importance_correction, job.algo.tis_cap, job.algo.seq_mask_ratio};
}

OffPolicy off_policy(const Rollout& ro, const OffPolicySpec& spec, uint64_t proximal_version) {
  OffPolicy out;
  const int64_t tokens = ro.response_tokens();
  const bool weighted = spec.correction != ImportanceCorrection::kNone;
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
  double weight_sum = 0;
  int64_t masked_tokens = 0, truncated_tokens = 0;
  // Multi-turn samples: observation tokens were not sampled; they count nowhere here (weight 1).
  const bool masked = ro.layout.turns;
  int64_t counted = 0, compared = 0, differing = 0;
  for (int64_t s = 0; s < ro.size(); ++s) {
    double d_sum = 0;
    int64_t n_s = 0;
    int64_t run = ro.run_offset[s];  // the engine's run of weight versions that token t falls in
    for (int64_t t = ro.resp_offset[s]; t < ro.resp_offset[s] + ro.response_len[s]; ++t) {
      if (masked && !ro.loss_mask[static_cast<size_t>(t)]) {
        if (weighted) out.weights[static_cast<size_t>(t)] = 1.f;
        continue;
      }
      ++n_s;
      while (run + 1 < ro.run_offset[s + 1] && t - ro.resp_offset[s] >= ro.run_start[static_cast<size_t>(run + 1)]) ++run;
      const bool proximal = ro.run_version[static_cast<size_t>(run)] == proximal_version;
      if (proximal) {
        ++compared;
        differing += std::memcmp(&ro.logp[static_cast<size_t>(t)], &ro.engine_logp[static_cast<size_t>(t)],
                                 sizeof(float)) != 0;
      }
      const double d = static_cast<double>(ro.logp[static_cast<size_t>(t)]) - ro.engine_logp[static_cast<size_t>(t)];
      const double w = std::exp(d);
      d_sum += d;
      (proximal ? same : older).add(d, w);
      weight_sum += w;
      if (!weighted) continue;
      double applied = w;
      if (spec.correction == ImportanceCorrection::kTis && w > spec.cap) {
        applied = spec.cap;
        ++truncated_tokens;
      } else if (spec.correction == ImportanceCorrection::kDecoupled && spec.cap > 0 && w > spec.cap) {
        applied = 0;
        ++masked_tokens;
      }
      out.weights[static_cast<size_t>(t)] = static_cast<float>(applied);
    }
    counted += n_s;
    if (spec.seq_mask_ratio > 0 && n_s > 0) {
      const double g = std::exp(d_sum / static_cast<double>(n_s));
      if (g > spec.seq_mask_ratio || g < 1.0 / spec.seq_mask_ratio) {
        out.masked[static_cast<size_t>(s)] = 1;
        ++out.masked_samples;
      }
    }
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
  if (spec.correction == ImportanceCorrection::kTis) out.metrics.emplace_back("off_policy/truncated_tokens", truncated_tokens);
  if (spec.correction == ImportanceCorrection::kDecoupled)
    out.metrics.emplace_back("off_policy/masked_tokens", masked_tokens);
  if (spec.seq_mask_ratio > 0) out.metrics.emplace_back("off_policy/masked_samples", out.masked_samples);
  return out;
}

}  // namespace tiller::rollout
