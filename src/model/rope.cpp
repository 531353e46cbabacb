// RoPE inverse frequencies, computed as transformers' modeling_rope_utils does (fp32 tensors,
// the same formulas), so positions rotate identically.
#include <cmath>

#include <ATen/ATen.h>

#include "model/batch_invariant.h"
#include "tiller/core/error.h"
#include "tiller/model/numerics.h"
#include "tiller/model/transformer.h"

namespace tiller::model {
namespace {

at::Tensor default_inv_freq(double base, int64_t dim) {
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  return at::pow(base, exponent).reciprocal();
}

int64_t original_max(const ModelConfig& c) {
  return c.rope_scaling.original_max_position_embeddings > 0 ? c.rope_scaling.original_max_position_embeddings
                                                             : c.max_position_embeddings;
}

at::Tensor llama3_inv_freq(const ModelConfig& c) {
  const RopeScaling& r = c.rope_scaling;
  at::Tensor inv = default_inv_freq(c.rope_theta, c.head_dim);
  const double old_len = static_cast<double>(original_max(c));
  const double low_wavelen = old_len / r.low_freq_factor;
  const double high_wavelen = old_len / r.high_freq_factor;
  at::Tensor wavelen = 2 * M_PI / inv;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

double yarn_correction_dim(double rotations, int64_t dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (rotations * 2 * M_PI))) / (2 * std::log(base));
}

at::Tensor yarn_inv_freq(const ModelConfig& c, double* attention_scaling) {
  const RopeScaling& r = c.rope_scaling;
  const int64_t dim = c.head_dim;
  const double base = c.rope_theta;
  const double factor = r.factor;
  *attention_scaling = r.attention_factor > 0 ? r.attention_factor
                                              : (factor <= 1 ? 1.0 : 0.1 * std::log(factor) + 1.0);
  const double orig = static_cast<double>(original_max(c));
  at::Tensor pos_freqs = at::pow(base, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim));
  at::Tensor extrapolation = 1.0 / pos_freqs;
  at::Tensor interpolation = 1.0 / (factor * pos_freqs);
  double low = yarn_correction_dim(r.beta_fast, dim, base, orig);
  double high = yarn_correction_dim(r.beta_slow, dim, base, orig);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  at::Tensor ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  at::Tensor extrapolation_factor = 1 - ramp;
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

}  // namespace

Rope::Rope(const ModelConfig& cfg) : cfg_(cfg) {
  const std::string& type = cfg.rope_scaling.type;
  if (type == "default" || type == "dynamic") {
    inv_freq_ = default_inv_freq(cfg.rope_theta, cfg.head_dim);
  } else if (type == "linear") {
    inv_freq_ = default_inv_freq(cfg.rope_theta, cfg.head_dim) / cfg.rope_scaling.factor;
  } else if (type == "llama3") {
    inv_freq_ = llama3_inv_freq(cfg);
  } else if (type == "yarn") {
    inv_freq_ = yarn_inv_freq(cfg, &attention_scaling_);
  } else {
    throw ConfigError("rope type '" + type + "' is not supported");
  }
}

std::pair<at::Tensor, at::Tensor> Rope::tables(const at::Tensor& positions, at::ScalarType dtype,
                                               const std::vector<int64_t>& seq_lens) const {
  at::Tensor freqs;  // [T, D/2]
  const int64_t orig = cfg_.max_position_embeddings;
  if (cfg_.rope_scaling.type == "dynamic" && positions.numel() > 0 && positions.max().item<int64_t>() >= orig) {
    // Dynamic NTK: past the original context the base grows with the sequence's longest
    // position. Per sequence, so that packing never changes a sequence's result.
    const std::vector<int64_t> lens = seq_lens.empty() ? std::vector<int64_t>{positions.size(0)} : seq_lens;
    std::vector<at::Tensor> parts;
    int64_t start = 0;
    for (int64_t n : lens) {
      at::Tensor pos = positions.narrow(0, start, n);
      start += n;
      at::Tensor inv = inv_freq_;
      const int64_t seq_len = n > 0 ? pos.max().item<int64_t>() + 1 : 0;
      if (seq_len > orig) {
        const double f = cfg_.rope_scaling.factor;
        const double dim = static_cast<double>(cfg_.head_dim);
        inv = default_inv_freq(cfg_.rope_theta * std::pow(f * seq_len / orig - (f - 1), dim / (dim - 2)), cfg_.head_dim);
      }
      parts.push_back(pos.to(at::kFloat).unsqueeze(1) * inv.to(positions.device()).unsqueeze(0));
    }
    freqs = at::cat(parts, 0);
  } else {
    freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq_.to(positions.device()).unsqueeze(0);
  }
  at::Tensor emb = at::cat({freqs, freqs}, 1);
  if (batch_invariant()) {
    auto [c, s] = invariant::rope_tables(emb, attention_scaling_);
    return {c.to(dtype), s.to(dtype)};
  }
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (attention_scaling_ != 1.0) {
    cos = cos * attention_scaling_;
    sin = sin * attention_scaling_;
  }
  return {cos.to(dtype), sin.to(dtype)};
}

}  // namespace tiller::model
