// Batched token sampling: one row of logits per sequence, each row with its own parameters.
//
// The one sampler of tiller: the engine calls it once per step for every sequence that samples,
// and the reference generator (generate.h) calls it too, so both follow the same rules and, for
// equal logits, pick the same tokens.
//
// Rules, per row:
//  - greedy: the argmax of the logits; its log-prob under softmax(logits) (temperature 1).
//  - otherwise p = softmax(logits / temperature); the kept set is cut by top_k (the k most
//    likely), then min_p (p >= min_p * max p), then top_p (the most likely tokens, in order,
//    while the mass before them is < top_p of the kept mass). The token is the first in
//    vocabulary order whose cumulative kept mass exceeds u * (kept mass): inverse-CDF sampling
//    with one uniform u per row. The reported log-prob is log p of the token under the full,
//    untruncated distribution at that temperature (what the trainer computes for it).
//  - u comes from sampling_uniform(seed, index): a counter-based draw, so a sequence's tokens
//    depend on its seed and position only, never on what else shares the batch.
//
// Device work only: no host synchronisation (the caller fetches the tokens when it needs them).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tiller::model {

// A uniform draw in [0, 1) for (seed, index): splitmix64 of both, 24 bits (exact in fp32).
float sampling_uniform(uint64_t seed, int64_t index);

// Per-row parameters, host side; every vector has one entry per row.
struct SamplingRows {
  std::vector<float> temperature;  // 0: greedy
  std::vector<float> top_p;        // (0, 1]; 1: off
  std::vector<int64_t> top_k;      // 0: off
  std::vector<float> min_p;        // [0, 1); 0: off
  std::vector<float> uniform;      // [0, 1)

  int64_t size() const { return static_cast<int64_t>(temperature.size()); }
  void add(float temperature, float top_p, int64_t top_k, float min_p, float uniform);
  void clear();
};

struct SampledTokens {
  at::Tensor tokens;    // int64 [B], on the logits' device
  at::Tensor logprobs;  // fp32 [B]
};

// logits: fp32, bf16 or fp16 [B, vocab] (math in fp32). On a GPU of the CUDA build, a batch with
// no top-k or top-p row is sampled by one kernel (model/cuda/sampler.cu); otherwise ATen ops, where
// rows whose filters are all off skip the filtering kernels and the sort that top_p needs runs
// only when some row asks for it. The two paths draw the same tokens up to fp32 rounding.
SampledTokens sample_tokens(const at::Tensor& logits, const SamplingRows& rows);

}  // namespace tiller::model
