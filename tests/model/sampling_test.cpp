// The batched sampler against hand-computed distributions.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "tiller/model/sampling.h"

namespace tiller::model {
namespace {

// Frequencies of the tokens drawn for one row of logits over many uniforms.
std::vector<double> frequencies(const at::Tensor& row, float t, float p, int64_t k, float m, int draws) {
  SamplingRows rows;
  for (int i = 0; i < draws; ++i) rows.add(t, p, k, m, sampling_uniform(99, i));
  at::Tensor logits = row.unsqueeze(0).expand({draws, row.size(0)}).contiguous();
  at::Tensor tokens = sample_tokens(logits, rows).tokens;
  std::vector<double> f(static_cast<size_t>(row.size(0)), 0.0);
  for (int i = 0; i < draws; ++i) f[static_cast<size_t>(tokens[i].item<int64_t>())] += 1.0 / draws;
  return f;
}

TEST(Sampler, UniformDrawsAreReproducibleAndSpread) {
  EXPECT_EQ(sampling_uniform(1, 5), sampling_uniform(1, 5));
  EXPECT_NE(sampling_uniform(1, 5), sampling_uniform(2, 5));
  double sum = 0;
  for (int i = 0; i < 20000; ++i) {
    const float u = sampling_uniform(7, i);
    ASSERT_TRUE(u >= 0 && u < 1);
    sum += u;
  }
  EXPECT_NEAR(sum / 20000, 0.5, 0.01);
}

TEST(Sampler, TruncationRulesGiveTheExpectedDistributions) {
  // probs 0.4, 0.3, 0.2, 0.1 (logits are their logs)
  const at::Tensor row = at::log(at::tensor({0.4, 0.3, 0.2, 0.1}, at::kFloat));
  const int n = 20000;
  auto near = [](const std::vector<double>& got, const std::vector<double>& want) {
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.015) << "token " << i;
  };
  near(frequencies(row, 1, 1, 0, 0, n), {0.4, 0.3, 0.2, 0.1});
  near(frequencies(row, 1, 1, 2, 0, n), {0.4 / 0.7, 0.3 / 0.7, 0, 0});            // top_k 2
  near(frequencies(row, 1, 0.75, 0, 0, n), {0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0});  // top_p: 0.7 < 0.75
  near(frequencies(row, 1, 1, 0, 0.6, n), {0.4 / 0.7, 0.3 / 0.7, 0, 0});           // min_p: p >= 0.24
  // Temperature 0.5 squares and renormalises: 16, 9, 4, 1 over 30.
  near(frequencies(row, 0.5, 1, 0, 0, n), {16.0 / 30, 9.0 / 30, 4.0 / 30, 1.0 / 30});
}

TEST(Sampler, MixedRowsGreedyAndLogprobsOfTheFullDistribution) {
  at::manual_seed(3);
  at::Tensor logits = at::randn({3, 50}, at::kFloat) * 3;
  SamplingRows rows;
  rows.add(0, 1, 0, 0, 0.5f);        // greedy
  rows.add(0.7f, 0.5f, 5, 0.1f, 0.3f);
  rows.add(1.3f, 1, 0, 0, 0.9f);
  SampledTokens s = sample_tokens(logits, rows);
  EXPECT_EQ(s.tokens[0].item<int64_t>(), logits[0].argmax().item<int64_t>());
  const std::vector<double> temps{1.0, 0.7, 1.3};
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t tok = s.tokens[r].item<int64_t>();
    const double want = at::log_softmax(logits[r] / temps[r], 0)[tok].item<double>();
    EXPECT_NEAR(s.logprobs[r].item<double>(), want, 1e-5) << "row " << r;
  }
  // Row 1 keeps at most 5 tokens: the draw is one of the 5 most likely.
  const at::Tensor top5 = std::get<1>(logits[1].topk(5));
  EXPECT_TRUE(top5.eq(s.tokens[1]).any().item<bool>());
  // The same row alone gives the same token: rows do not interact.
  SamplingRows one;
  one.add(1.3f, 1, 0, 0, 0.9f);
  EXPECT_EQ(sample_tokens(logits.narrow(0, 2, 1), one).tokens[0].item<int64_t>(), s.tokens[2].item<int64_t>());
}

}  // namespace
}  // namespace tiller::model
