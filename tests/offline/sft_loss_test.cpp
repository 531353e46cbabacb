// Supervised fine-tuning's loss (tiller/algo/sft_loss.h): by hand, and against transformers'
// causal-LM loss with the prompt tokens labelled -100 on a padded batch (make_hf_fixtures.py), from
// tiller's packed forward on tiny Qwen2 and Llama models: the loss, its gradient in the final norm,
// and the sequence mean.
#include <gtest/gtest.h>

#include <fstream>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "../model/fixtures.h"
#include "tiller/algo/sft_loss.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"

namespace tiller::algo {
namespace {

TEST(SftLoss, TokenAndSequenceMeansByHand) {
  // Two sequences: log-probs -1 -2 | -3 -4 -5, the first token of each untrained.
  const at::Tensor logp = at::tensor({-1.0, -2.0, -3.0, -4.0, -5.0}, at::kDouble).requires_grad_(true);
  const at::Tensor mask = at::tensor({0, 1, 0, 1, 1}, at::kByte);
  const at::Tensor cu = at::tensor({0, 2, 5}, at::kLong);
  SftLoss t = sft_loss(logp, mask, cu, SftMean::kToken, 3);
  EXPECT_DOUBLE_EQ(t.loss.item<double>(), (2.0 + 4.0 + 5.0) / 3);
  EXPECT_DOUBLE_EQ(t.nll.item<double>(), 11.0);
  EXPECT_DOUBLE_EQ(t.tokens.item<double>(), 3);
  SftLoss s = sft_loss(logp, mask, cu, SftMean::kSequence, 2);
  EXPECT_DOUBLE_EQ(s.loss.item<double>(), (2.0 + (4.0 + 5.0) / 2) / 2);
  s.loss.backward();
  const at::Tensor g = logp.grad();
  const std::vector<double> want{0, -0.5, 0, -0.25, -0.25};  // -1 / (tokens of its sequence x sequences)
  for (int64_t i = 0; i < 5; ++i) EXPECT_DOUBLE_EQ(g[i].item<double>(), want[static_cast<size_t>(i)]) << i;
}

TEST(SftLoss, WeightedRowsEqualTheSequenceMeanAcrossSlices) {
  // The sequence mean from per-row weights, the rows cut into two slices (as two sequence-parallel
  // ranks hold them): the slices' losses and gradients add up to sft_loss over whole sequences.
  const at::Tensor logp = at::tensor({-1.0, -2.0, -3.0, -4.0, -5.0}, at::kDouble);
  const at::Tensor mask = at::tensor({0, 1, 0, 1, 1}, at::kByte);
  const at::Tensor weight = at::tensor({1.0, 1.0, 0.5, 0.5, 0.5}, at::kDouble);  // 1 / trained tokens of the sequence
  const at::Tensor whole_lp = logp.clone().requires_grad_(true);
  SftLoss whole = sft_loss(whole_lp, mask, at::tensor({0, 2, 5}, at::kLong), SftMean::kSequence, 2);
  whole.loss.backward();
  double sum = 0, nll = 0, tokens = 0;
  std::vector<double> grad;
  for (const auto& [lo, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 2}}) {
    const at::Tensor lp = logp.narrow(0, lo, n).clone().requires_grad_(true);
    SftLoss part = sft_loss_weighted(lp, mask.narrow(0, lo, n), weight.narrow(0, lo, n), 2);
    part.loss.backward();
    sum += part.loss.item<double>();
    nll += part.nll.item<double>();
    tokens += part.tokens.item<double>();
    for (int64_t i = 0; i < n; ++i) grad.push_back(lp.grad()[i].item<double>());
  }
  EXPECT_DOUBLE_EQ(sum, whole.loss.item<double>());
  EXPECT_DOUBLE_EQ(nll, 11.0);
  EXPECT_DOUBLE_EQ(tokens, 3);
  for (int64_t i = 0; i < 5; ++i) EXPECT_DOUBLE_EQ(grad[static_cast<size_t>(i)], whole_lp.grad()[i].item<double>()) << i;
  // Unit weights: the token mean.
  const SftLoss t = sft_loss_weighted(logp, mask, at::ones({5}, at::kDouble), 3);
  EXPECT_DOUBLE_EQ(t.loss.item<double>(), sft_loss(logp, mask, at::tensor({0, 2, 5}, at::kLong), SftMean::kToken, 3).loss.item<double>());
}

TEST(SftLoss, EqualsTransformersCausalLmLossWithThePromptIgnored) {
  nlohmann::json ref;
  std::ifstream(test::hf_fixtures() + "/models/reference.json") >> ref;
  for (const char* key : {"sft", "sft_llama"}) {  // tiny Qwen2 and Llama
    SCOPED_TRACE(key);
    const auto& r = ref[key];
    const std::string dir = test::hf_fixtures() + "/models/" + r["model"].get<std::string>();
    model::LoadedModel m = model::load_model(dir, model::Head::kLm, at::kFloat, at::kCPU);
    const auto seqs = r["seqs"].get<std::vector<std::vector<int64_t>>>();
    const auto prompt_lens = r["prompt_lens"].get<std::vector<int64_t>>();
    // Packed rows: each row's target is the next token; trained where that token is the response's.
    std::vector<int64_t> targets, mask, cu{0};
    for (size_t i = 0; i < seqs.size(); ++i) {
      const auto n = static_cast<int64_t>(seqs[i].size());
      for (int64_t t = 0; t < n; ++t) {
        targets.push_back(t + 1 < n ? seqs[i][static_cast<size_t>(t + 1)] : 0);
        mask.push_back(t + 1 < n && t + 1 >= prompt_lens[i] ? 1 : 0);
      }
      cu.push_back(cu.back() + n);
    }
    const at::Tensor mask_t = at::tensor(mask, at::kLong).to(at::kByte);
    m.weights.final_norm.requires_grad_(true);
    const model::PackedBatch batch = model::PackedBatch::pack(seqs, at::kCPU);
    const at::Tensor logp = model::token_logprobs(model::forward_hidden(m.config, m.weights, batch), m.weights.lm_head,
                                                  at::tensor(targets, at::kLong));
    const int64_t trained = mask_t.sum().item<int64_t>();
    SftLoss l = sft_loss(logp, mask_t, at::tensor(cu, at::kLong), SftMean::kToken, static_cast<double>(trained));
    EXPECT_NEAR(l.loss.item<double>(), r["loss"].get<double>(), 1e-5);
    l.loss.backward();
    model::SafetensorsFile g(dir + "/sft_reference.safetensors");
    const at::Tensor want = g.tensor("norm_grad");
    const double scale = want.abs().max().item<double>();
    EXPECT_LT((m.weights.final_norm.grad() - want).abs().max().item<double>(), 1e-4 * scale + 1e-7);
    // The sequence mean: the mean of each sequence's own transformers loss.
    const auto per_seq = r["per_sequence"].get<std::vector<double>>();
    double want_seq = 0;
    for (double x : per_seq) want_seq += x / static_cast<double>(per_seq.size());
    c10::AutoGradMode no_grad(false);
    SftLoss s = sft_loss(logp.detach(), mask_t, at::tensor(cu, at::kLong), SftMean::kSequence,
                         static_cast<double>(seqs.size()));
    EXPECT_NEAR(s.loss.item<double>(), want_seq, 1e-5);
  }
}

}  // namespace
}  // namespace tiller::algo
