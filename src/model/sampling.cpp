#include "tiller/model/sampling.h"

#include <algorithm>

#include <ATen/ATen.h>

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/kernels.h"
#endif
#include "model/batch_invariant.h"
#include "model/host_upload.h"
#include "tiller/core/error.h"
#include "tiller/model/numerics.h"

namespace tiller::model {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

float sampling_uniform(uint64_t seed, int64_t index) {
  const uint64_t x = splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(index));
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
}

void SamplingRows::add(float t, float p, int64_t k, float m, float u) {
  temperature.push_back(t);
  top_p.push_back(p);
  top_k.push_back(k);
  min_p.push_back(m);
  uniform.push_back(u);
}

void SamplingRows::clear() {
  temperature.clear();
  top_p.clear();
  top_k.clear();
  min_p.clear();
  uniform.clear();
}

#ifdef TILLER_HAVE_CUDA_KERNELS
namespace {

// The one-kernel path on a GPU (no row with top-k or top-p): the same draws as the ATen path
// below, but one launch instead of ~20 and no [B, vocab] temporaries.
SampledTokens sample_on_gpu(const at::Tensor& logits, const SamplingRows& rows) {
  const int64_t b = logits.size(0);
  std::vector<float> host(static_cast<size_t>(3 * b));
  for (int64_t i = 0; i < b; ++i) {
    const bool sample = rows.temperature[i] > 0;
    host[3 * i] = sample ? rows.temperature[i] : 0.0f;
    host[3 * i + 1] = sample ? rows.min_p[i] : 0.0f;
    host[3 * i + 2] = rows.uniform[i];
  }
  const at::Tensor params = upload(host, logits.device());
  SampledTokens out;
  out.tokens = at::empty({b}, logits.options().dtype(at::kLong));
  out.logprobs = at::empty({b}, logits.options().dtype(at::kFloat));
  const auto dtype = logits.scalar_type() == at::kBFloat16 ? cuda::DType::kBFloat16
                     : logits.scalar_type() == at::kHalf   ? cuda::DType::kHalf
                                                           : cuda::DType::kFloat;
  cuda::sample_rows(dtype, logits.data_ptr(), b, logits.size(1), logits.stride(0), params.data_ptr<float>(),
                    out.tokens.data_ptr<int64_t>(), out.logprobs.data_ptr<float>(),
                    c10::cuda::getCurrentCUDAStream(logits.device().index()).stream());
  return out;
}

}  // namespace
#endif

namespace {
// `one_kernel`: set when the GPU's one-kernel sampler drew (its log-probs are invariant::logprobs').
SampledTokens draw(const at::Tensor& logits_in, const SamplingRows& rows, bool* one_kernel);
}  // namespace

SampledTokens sample_tokens(const at::Tensor& logits_in, const SamplingRows& rows) {
  bool one_kernel = false;
  SampledTokens out = draw(logits_in, rows, &one_kernel);
  // The bitwise mode reports the log-prob the trainer's head computes (numerics.h), at the row's
  // temperature (1 for greedy rows, as the rules say). The GPU's one-kernel sampler computes it
  // already: invariant::logprobs on CUDA is its pass 1 (sampler.cu), so only the other paths
  // (top-k, top-p, the CPU) compute it a second time.
  if (batch_invariant() && !one_kernel && out.tokens.numel() > 0) {
    std::vector<float> t(rows.temperature.size());
    for (size_t i = 0; i < t.size(); ++i) t[i] = rows.temperature[i] > 0 ? rows.temperature[i] : 1.0f;
    out.logprobs = invariant::logprobs(logits_in, out.tokens, t).to(at::kFloat);
  }
  return out;
}

namespace {

SampledTokens draw(const at::Tensor& logits_in, const SamplingRows& rows, bool* one_kernel) {
  TILLER_CHECK(logits_in.dim() == 2 && (logits_in.scalar_type() == at::kFloat ||
                                        logits_in.scalar_type() == at::kBFloat16 ||
                                        logits_in.scalar_type() == at::kHalf),
               "sample_tokens takes fp32, bf16 or fp16 [B, vocab] logits");
  const int64_t b = logits_in.size(0), vocab = logits_in.size(1);
  TILLER_CHECK(rows.size() == b && rows.top_p.size() == rows.temperature.size() &&
                   rows.top_k.size() == rows.temperature.size() && rows.min_p.size() == rows.temperature.size() &&
                   rows.uniform.size() == rows.temperature.size(),
               "{} sampling rows for {} logit rows", rows.size(), b);
  SampledTokens out;
  if (b == 0) {
    out.tokens = at::empty({0}, logits_in.options().dtype(at::kLong));
    out.logprobs = at::empty({0}, logits_in.options().dtype(at::kFloat));
    return out;
  }
  bool any_sample = false, any_top_p = false, any_min_p = false;
  int64_t max_k = 0;
  // Rows of the parameter table: temperature (1 for greedy), greedy flag, top_p, min_p, u, k.
  std::vector<float> host(static_cast<size_t>(6 * b));
  for (int64_t i = 0; i < b; ++i) {
    const bool sample = rows.temperature[i] > 0;
    const bool top_k = sample && rows.top_k[i] > 0 && rows.top_k[i] < vocab;
    any_sample |= sample;
    any_top_p |= sample && rows.top_p[i] < 1;
    any_min_p |= sample && rows.min_p[i] > 0;
    if (top_k) max_k = std::max(max_k, rows.top_k[i]);
    host[i] = sample ? rows.temperature[i] : 1.0f;
    host[b + i] = sample ? 0.0f : 1.0f;
    host[2 * b + i] = sample ? rows.top_p[i] : 1.0f;
    host[3 * b + i] = sample ? rows.min_p[i] : 0.0f;
    host[4 * b + i] = rows.uniform[i];
    host[5 * b + i] = top_k ? static_cast<float>(rows.top_k[i]) : 0.0f;
  }
#ifdef TILLER_HAVE_CUDA_KERNELS
  if (logits_in.is_cuda() && max_k == 0 && !any_top_p && logits_in.stride(1) == 1) {
    *one_kernel = true;
    return sample_on_gpu(logits_in, rows);
  }
#endif
  const at::Tensor logits = logits_in.to(at::kFloat);
  at::Tensor greedy_tokens = logits.argmax(1);
  if (!any_sample) {
    out.tokens = greedy_tokens;
    out.logprobs = logits.gather(1, greedy_tokens.unsqueeze(1)).squeeze(1) - at::logsumexp(logits, {1});
    return out;
  }
  at::Tensor params = upload(host, logits.device()).view({6, b});
  at::Tensor z = logits / params[0].unsqueeze(1);
  at::Tensor logp = at::log_softmax(z, 1);
  at::Tensor probs = logp.exp();
  at::Tensor kept = probs;
  if (max_k > 0) {
    at::Tensor k = params[5].unsqueeze(1);
    at::Tensor top = std::get<0>(probs.topk(max_k, 1));  // descending
    at::Tensor kth = top.gather(1, (k.clamp(1, static_cast<double>(max_k)) - 1).to(at::kLong));
    kept = kept.masked_fill(probs < at::where(k > 0, kth, at::zeros_like(kth)), 0);
  }
  if (any_min_p) kept = kept.masked_fill(probs < params[3].unsqueeze(1) * std::get<0>(probs.max(1, true)), 0);
  if (any_top_p) {
    at::Tensor top_p = params[2].unsqueeze(1);
    auto [sorted, order] = kept.sort(1, /*descending=*/true);
    at::Tensor before = sorted.cumsum(1) - sorted;  // kept mass strictly above each token
    at::Tensor drop = (before >= top_p * sorted.sum(1, true)).logical_and_(top_p < 1);
    kept = kept.masked_fill(at::zeros_like(drop).scatter_(1, order, drop), 0);
  }
  at::Tensor cum = kept.cumsum(1);
  at::Tensor target = params[4].unsqueeze(1) * cum.narrow(1, vocab - 1, 1);
  at::Tensor drawn = (cum <= target).sum(1).clamp_max(vocab - 1);
  out.tokens = at::where(params[1] > 0, greedy_tokens, drawn);
  out.logprobs = logp.gather(1, out.tokens.unsqueeze(1)).squeeze(1);
  return out;
}

}  // namespace

}  // namespace tiller::model
