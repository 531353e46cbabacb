// The functional transformer against Hugging Face transformers (fixtures made by
// make_hf_fixtures.py): logits, greedy continuations, value heads; plus the pieces that the
// trainer and engine build on (packing, KV cache, chunked log-probs, attention).
#include <cstdlib>
#include <filesystem>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "fixtures.h"
#include "tiller/core/error.h"
#include "tiller/model/attention.h"
#include "tiller/model/generate.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"

namespace tiller::model {
namespace {

namespace fs = std::filesystem;

using test::max_diff;
using test::model_dir;
nlohmann::json reference() { return test::model_reference(); }

at::Tensor full_logits(const LoadedModel& m, const std::vector<std::vector<int64_t>>& seqs) {
  c10::AutoGradMode no_grad(false);
  PackedBatch batch = PackedBatch::pack(seqs, at::kCPU);
  return logits(forward_hidden(m.config, m.weights, batch), m.weights.lm_head);
}

class HfModel : public ::testing::TestWithParam<std::string> {};

// A real libtorch error reports as one line: its message, without the C++ stack it carries.
TEST(ErrorLine, OfALibtorchError) {
  try {
    (void)at::ones({2}).view({3});
    FAIL() << "view did not throw";
  } catch (const std::exception& e) {
    const std::string line = error_line(e);
    EXPECT_NE(line.find("is invalid for input of size 2"), std::string::npos) << line;
    EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  }
}

TEST_P(HfModel, LogitsEqualTransformers) {
  const std::string name = GetParam();
  LoadedModel m = load_model(model_dir(name), Head::kLm, at::kFloat, at::kCPU);
  SafetensorsFile ref(model_dir(name) + "/reference_logits.safetensors");
  const auto inputs = reference()[name]["inputs"].get<std::vector<std::vector<int64_t>>>();
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor expect = ref.tensor("logits_" + std::to_string(i));
    at::Tensor got = full_logits(m, {inputs[i]});
    ASSERT_EQ(got.sizes(), expect.sizes());
    EXPECT_LT(max_diff(got, expect), 2e-4) << name << " input " << i;
  }
  // All inputs packed into one batch give each sequence's own logits.
  at::Tensor packed = full_logits(m, inputs);
  int64_t row = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t n = static_cast<int64_t>(inputs[i].size());
    EXPECT_LT(max_diff(packed.narrow(0, row, n), ref.tensor("logits_" + std::to_string(i))), 2e-4) << name << " packed " << i;
    row += n;
  }
}

TEST_P(HfModel, GreedyContinuationsEqualTransformers) {
  const std::string name = GetParam();
  LoadedModel m = load_model(model_dir(name), Head::kLm, at::kFloat, at::kCPU);
  const auto r = reference()[name];
  const auto inputs = r["inputs"].get<std::vector<std::vector<int64_t>>>();
  const auto greedy = r["greedy"].get<std::vector<std::vector<int64_t>>>();
  SamplingParams p;
  p.greedy = true;
  p.max_new_tokens = static_cast<int64_t>(greedy[0].size());
  const std::vector<std::vector<int64_t>> prompts(inputs.begin(), inputs.begin() + greedy.size());
  const auto out = generate(m.config, m.weights, prompts, p, /*batch_size=*/2);
  for (size_t i = 0; i < greedy.size(); ++i) {
    EXPECT_EQ(out[i].tokens, greedy[i]) << name << " prompt " << i;
    EXPECT_EQ(out[i].finish_reason, "length");
  }
}

INSTANTIATE_TEST_SUITE_P(Families, HfModel,
                         ::testing::Values("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral"));

TEST(HfModelValue, ScoreHeadEqualsTransformers) {
  LoadedModel m = load_model(model_dir("qwen2-value"), Head::kValue, at::kFloat, at::kCPU);
  ASSERT_TRUE(m.weights.score.defined());
  EXPECT_FALSE(m.weights.lm_head.defined());
  const auto r = reference()["qwen2-value"];
  const auto inputs = r["inputs"].get<std::vector<std::vector<int64_t>>>();
  const auto scores = r["scores"].get<std::vector<double>>();
  c10::AutoGradMode no_grad(false);
  at::Tensor v = values(forward_hidden(m.config, m.weights, PackedBatch::pack(inputs, at::kCPU)), m.weights.score);
  int64_t end = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    end += static_cast<int64_t>(inputs[i].size());
    EXPECT_NEAR(v[end - 1].item<double>(), scores[i], 2e-4) << "input " << i;
  }
  // A causal-LM checkpoint has no score head; loading it as a value model says so.
  try {
    load_model(model_dir("qwen2"), Head::kValue, at::kFloat, at::kCPU);
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("missing tensor 'score.weight'"), std::string::npos) << e.what();
  }
}

TEST(Model, CachedDecodingEqualsFullForward) {
  LoadedModel m = load_model(model_dir("qwen3"), Head::kLm, at::kFloat, at::kCPU);
  m.config.layer_window = {0, 8, 5};  // and sliding windows shorter than the sequences
  const auto inputs = reference()["qwen3"]["inputs"].get<std::vector<std::vector<int64_t>>>();
  c10::AutoGradMode no_grad(false);
  const std::vector<std::vector<int64_t>> seqs{inputs[1], inputs[2]};
  at::Tensor full = full_logits(m, seqs);
  // Prefill all but the last 3 tokens, then one token at a time against the cache.
  DenseKvCache cache(m.config.num_layers, 2);
  std::vector<std::vector<int64_t>> prefix;
  for (const auto& s : seqs) prefix.emplace_back(s.begin(), s.end() - 3);
  forward_hidden(m.config, m.weights, PackedBatch::pack(prefix, at::kCPU), &cache);
  for (int step = 3; step >= 1; --step) {
    std::vector<std::vector<int64_t>> next;
    std::vector<int64_t> starts;
    for (size_t i = 0; i < seqs.size(); ++i) {
      next.push_back({seqs[i][seqs[i].size() - step]});
      starts.push_back(cache.lens[i]);
    }
    at::Tensor h = forward_hidden(m.config, m.weights, PackedBatch::pack(next, at::kCPU, starts), &cache);
    at::Tensor got = logits(h, m.weights.lm_head);
    const int64_t row0 = static_cast<int64_t>(seqs[0].size()) - step;
    const int64_t row1 = static_cast<int64_t>(seqs[0].size() + seqs[1].size()) - step;
    EXPECT_LT(max_diff(got[0], full[row0]), 1e-4) << "step " << step;
    EXPECT_LT(max_diff(got[1], full[row1]), 1e-4) << "step " << step;
  }
}

TEST(Model, ChunkedLogProbsEqualFullSoftmaxWithGradients) {
  at::manual_seed(1);
  at::Tensor hidden = at::randn({37, 16}, at::kDouble).requires_grad_();
  at::Tensor head = at::randn({53, 16}, at::kDouble).requires_grad_();
  at::Tensor targets = at::randint(0, 53, {37}, at::kLong);
  at::Tensor weights = at::randn({37}, at::kDouble);
  // Reference: the whole softmax at once.
  at::Tensor ref = at::log_softmax(at::matmul(hidden, head.t()) / 0.7, -1).gather(1, targets.unsqueeze(1)).squeeze(1);
  (ref * weights).sum().backward();
  at::Tensor gh = hidden.grad().clone(), gw = head.grad().clone();
  for (int64_t chunk : {1, 5, 37, 1000}) {
    hidden.mutable_grad().reset();
    head.mutable_grad().reset();
    at::Tensor ent;
    at::Tensor lp = token_logprobs(hidden, head, targets, 0.7, chunk, &ent);
    EXPECT_LT(max_diff(lp.to(at::kDouble), ref), 1e-5) << chunk;
    (lp.to(at::kDouble) * weights).sum().backward();
    EXPECT_LT(max_diff(hidden.grad(), gh), 1e-5) << chunk;
    EXPECT_LT(max_diff(head.grad(), gw), 1e-5) << chunk;
    at::Tensor logp = at::log_softmax(at::matmul(hidden, head.t()) / 0.7, -1);
    EXPECT_LT(max_diff(ent.to(at::kDouble), -(logp.exp() * logp).sum(-1)), 1e-5) << chunk;
  }
}

TEST(Model, ChunkedEntropyGradientEqualsFullSoftmax) {
  at::manual_seed(4);
  at::Tensor hidden = at::randn({23, 16}, at::kDouble).requires_grad_();
  at::Tensor head = at::randn({41, 16}, at::kDouble).requires_grad_();
  at::Tensor targets = at::randint(0, 41, {23}, at::kLong);
  at::Tensor wl = at::randn({23}, at::kDouble), we = at::randn({23}, at::kDouble);
  auto reference = [&](bool with_logp) {
    hidden.mutable_grad().reset();
    head.mutable_grad().reset();
    at::Tensor logp = at::log_softmax(at::matmul(hidden, head.t()) / 0.7, -1);
    at::Tensor ent = -(logp.exp() * logp).sum(-1);
    at::Tensor loss = (ent * we).sum();
    if (with_logp) loss = loss + (logp.gather(1, targets.unsqueeze(1)).squeeze(1) * wl).sum();
    loss.backward();
    return std::make_pair(hidden.grad().clone(), head.grad().clone());
  };
  for (bool with_logp : {false, true}) {
    const auto [gh, gw] = reference(with_logp);
    for (int64_t chunk : {1, 6, 1000}) {
      hidden.mutable_grad().reset();
      head.mutable_grad().reset();
      at::Tensor ent;
      at::Tensor lp = token_logprobs(hidden, head, targets, 0.7, chunk, &ent);
      at::Tensor loss = (ent.to(at::kDouble) * we).sum();
      if (with_logp) loss = loss + (lp.to(at::kDouble) * wl).sum();
      loss.backward();
      EXPECT_LT(max_diff(hidden.grad(), gh), 1e-9) << chunk << " with_logp=" << with_logp;
      EXPECT_LT(max_diff(head.grad(), gw), 1e-9) << chunk << " with_logp=" << with_logp;
    }
  }
  // The same through the backward outside autograd.
  const auto [gh, gw] = reference(true);
  auto [h2, w2] = token_logprobs_backward(hidden.detach(), head.detach(), targets, wl, 0.7, 5, true, true, false, we);
  EXPECT_LT(max_diff(h2, gh), 1e-9);
  EXPECT_LT(max_diff(w2, gw), 1e-9);
}

TEST(Model, BackwardThroughTheModelMatchesFiniteDifferences) {
  ModelConfig cfg = preset("tiny-qwen3");
  cfg.num_layers = 1;
  cfg.layer_window = {0};
  NamedTensors named = init_weights(cfg, Head::kLm, 3, at::kDouble);
  ModelWeights w = bind_weights(cfg, named, Head::kLm, "init");
  at::Tensor target = w.layers[0].k_norm;
  target.requires_grad_();
  PackedBatch batch = PackedBatch::pack({{1, 2, 3, 4}, {5, 6, 7}}, at::kCPU);
  auto loss = [&] {
    at::Tensor h = forward_hidden(cfg, w, batch);
    return token_logprobs(h, w.lm_head, at::tensor({2, 3, 4, 0, 6, 7, 0}, at::kLong)).sum();
  };
  loss().backward();
  at::Tensor analytic = target.grad().clone();
  c10::AutoGradMode no_grad(false);
  for (int64_t i : {0, 7, 31}) {
    const double eps = 1e-6;
    const double orig = target[i].item<double>();
    target[i].fill_(orig + eps);
    const double up = loss().item<double>();
    target[i].fill_(orig - eps);
    const double down = loss().item<double>();
    target[i].fill_(orig);
    EXPECT_NEAR(analytic[i].item<double>(), (up - down) / (2 * eps), 1e-5) << "k_norm[" << i << "]";
  }
}

TEST(Attention, ReferenceEqualsPerSequenceSdpa) {
  at::manual_seed(2);
  const std::vector<int64_t> lens{5, 1, 9};
  at::Tensor q = at::randn({15, 4, 8}), k = at::randn({15, 2, 8}), v = at::randn({15, 2, 8});
  at::Tensor cu = at::tensor({0, 5, 6, 15}, at::kInt);
  at::Tensor out = varlen_attention(q, k, v, VarlenSpec::self(cu, lens), 0.3, AttentionBackend::kReference);
  int64_t s = 0;
  for (int64_t n : lens) {
    auto t = [&](const at::Tensor& x) { return x.narrow(0, s, n).transpose(0, 1).repeat_interleave(4 / x.size(1), 0); };
    at::Tensor expect = at::scaled_dot_product_attention(t(q), t(k), t(v), {}, 0.0, true, 0.3).transpose(0, 1);
    EXPECT_LT(max_diff(out.narrow(0, s, n), expect), 1e-5);
    s += n;
  }
}

TEST(Config, ErrorsNameTheKey) {
  auto error = [](const std::string& json) {
    try {
      parse_model_config(json, "m/config.json");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string base = R"("vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2)";
  EXPECT_EQ(error("{\"model_type\":\"llama\"," + base + "}"), "(no error)");
  EXPECT_NE(error("{\"model_type\":\"gpt_neox\"," + base + "}").find("model_type 'gpt_neox' is not supported"), std::string::npos);
  EXPECT_NE(error(R"({"model_type":"llama"})").find("m/config.json: required key 'vocab_size' is missing"), std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"llama\"," + base + ",\"num_key_value_heads\":3}").find("not a multiple"), std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"llama\"," + base + ",\"hidden_act\":\"gelu\"}").find("hidden_act 'gelu'"), std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"llama\"," + base + ",\"rope_scaling\":{\"type\":\"longrope\",\"factor\":2}}").find("'longrope' is not supported"), std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"llama\"," + base + ",\"hidden_size\":\"8\"}").find("key 'hidden_size' has the wrong type"), std::string::npos);
  // Mixtures of experts: the routing keys are required and checked.
  const std::string moe = base + R"(,"num_experts":4,"moe_intermediate_size":8)";
  EXPECT_EQ(error("{\"model_type\":\"qwen3_moe\"," + moe + ",\"num_experts_per_tok\":2}"), "(no error)");
  EXPECT_NE(error("{\"model_type\":\"qwen3_moe\"," + moe + "}").find("required key 'num_experts_per_tok' is missing"),
            std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"qwen3_moe\"," + moe + ",\"num_experts_per_tok\":5}")
                .find("num_experts_per_tok 5 exceeds the 4 experts"),
            std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"qwen2_moe\"," + moe + ",\"num_experts_per_tok\":2}")
                .find("required key 'shared_expert_intermediate_size' is missing"),
            std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"mixtral\"," + base + ",\"num_experts_per_tok\":2}").find("num_local_experts"),
            std::string::npos);
  EXPECT_NE(error("{\"model_type\":\"mixtral\"," + base +
                  ",\"num_local_experts\":4,\"num_experts_per_tok\":2,\"router_jitter_noise\":0.1}")
                .find("router_jitter_noise"),
            std::string::npos);
}

TEST(Config, PresetsHaveThePublishedParameterCounts) {
  EXPECT_EQ(num_parameters(preset("qwen2-0.5b")), 494032768);
  EXPECT_EQ(num_parameters(preset("qwen2-1.5b")), 1543714304);
  EXPECT_EQ(num_parameters(preset("qwen2-7b")), 7615616512);
  EXPECT_EQ(num_parameters(preset("qwen2-32b")), 32763876352);  // Qwen2.5-32B's safetensors
  EXPECT_EQ(num_parameters(preset("qwen2-72b")), 72706203648);  // Qwen2.5-72B's safetensors
  int64_t n = 0;
  for (const auto& s : parameter_specs(preset("qwen2-7b"))) {
    int64_t k = 1;
    for (int64_t d : s.shape) k *= d;
    n += k;
  }
  EXPECT_EQ(n, 7615616512);
  // Qwen3-30B-A3B: transformers' count of Qwen3MoeForCausalLM with the published config; 3.3B active.
  EXPECT_EQ(num_parameters(preset("qwen3-30b-a3b")), 30532122624);
  EXPECT_NEAR(static_cast<double>(active_parameters(preset("qwen3-30b-a3b"))), 3.35e9, 0.01e9);
  n = 0;
  for (const auto& s : parameter_specs(preset("tiny-qwen2-moe"))) {
    int64_t k = 1;
    for (int64_t d : s.shape) k *= d;
    n += k;
  }
  EXPECT_EQ(n, num_parameters(preset("tiny-qwen2-moe")));
  EXPECT_LT(active_parameters(preset("tiny-qwen2-moe")), n);
  EXPECT_THROW(preset("gpt-5"), ConfigError);
}

TEST(Weights, ShapeMismatchIsNamed) {
  ModelConfig cfg = preset("tiny-llama");
  NamedTensors named = init_weights(cfg, Head::kLm, 1, at::kFloat);
  named["model.layers.1.mlp.up_proj.weight"] = at::zeros({3, 3});
  try {
    bind_weights(cfg, named, Head::kLm, "ckpt");
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt: tensor 'model.layers.1.mlp.up_proj.weight' has shape 3x3 but config.json implies 176x64"),
              std::string::npos) << e.what();
  }
}

// A checkpoint that lacks one expert is refused with that tensor's name.
TEST(Weights, AMissingExpertIsNamed) {
  const ModelConfig cfg = preset("tiny-qwen3-moe");
  NamedTensors named = init_weights(cfg, Head::kLm, 1, at::kFloat);
  EXPECT_NO_THROW(bind_weights(cfg, named, Head::kLm, "ckpt"));
  named.erase("model.layers.1.mlp.experts.5.up_proj.weight");
  try {
    bind_weights(cfg, named, Head::kLm, "ckpt");
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt: missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight'"),
              std::string::npos)
        << e.what();
  }
}

// Writes checkpoints for check_hf_load.py (run by ctest after this test): a fixture re-saved by
// tiller in other shards, and a fresh random model with tiller's own logits of fixed inputs.
TEST(HfWrite, CheckpointsForTransformers) {
  // Its own directory per caller: ctest runs this test twice, possibly at the same time.
  const char* env = std::getenv("TILLER_HF_WRITE_DIR");
  const std::string out = env ? env : test::scratch_dir() + "/hf_written_unit";
  fs::remove_all(out);
  LoadedModel m = load_model(model_dir("qwen3"), Head::kLm, at::kFloat, at::kCPU);
  save_model(out + "/qwen3", m.config, m.weights, Head::kLm, /*max_shard_bytes=*/100000);
  fs::copy_file(model_dir("qwen3") + "/reference_logits.safetensors", out + "/qwen3/reference_logits.safetensors");
  // Read back by tiller: bit-identical.
  LoadedModel back = load_model(out + "/qwen3", Head::kLm, at::kFloat, at::kCPU);
  for (const auto& [name, t] : m.tensors) EXPECT_TRUE(at::equal(back.tensors.at(name), t)) << name;

  const auto inputs = reference()["qwen3"]["inputs"].get<std::vector<std::vector<int64_t>>>();
  for (const std::string preset_name :
       {"tiny-qwen2", "tiny-llama", "tiny-mistral", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"}) {
    ModelConfig cfg = preset(preset_name);
    cfg.initializer_range = 0.1;
    LoadedModel fresh;
    fresh.config = cfg;
    fresh.tensors = init_weights(cfg, Head::kLm, 7, at::kFloat);
    fresh.weights = bind_weights(cfg, fresh.tensors, Head::kLm, preset_name);
    save_model(out + "/" + preset_name, cfg, fresh.weights, Head::kLm);
    NamedTensors ref;
    for (size_t i = 0; i < inputs.size(); ++i) ref["logits_" + std::to_string(i)] = full_logits(fresh, {inputs[i]});
    write_safetensors(out + "/" + preset_name + "/reference_logits.safetensors", ref);
  }
  nlohmann::json manifest;
  manifest["inputs"] = inputs;
  manifest["models"] = {"qwen3", "tiny-qwen2", "tiny-llama", "tiny-mistral", "tiny-qwen3-moe", "tiny-qwen2-moe",
                        "tiny-mixtral"};
  test::write_text(out + "/manifest.json", manifest.dump());
}

TEST(Sampling, SeedsTemperatureAndTruncation) {
  LoadedModel m = load_model(model_dir("llama"), Head::kLm, at::kFloat, at::kCPU);
  const std::vector<std::vector<int64_t>> prompts{{5, 6, 7}, {9, 10}};
  SamplingParams p;
  p.temperature = 0.8;
  p.top_p = 0.9;
  p.seed = 11;
  p.max_new_tokens = 6;
  auto a = generate(m.config, m.weights, prompts, p);
  auto b = generate(m.config, m.weights, prompts, p);
  EXPECT_EQ(a[0].tokens, b[0].tokens);
  EXPECT_EQ(a[1].tokens, b[1].tokens);
  // Reported log-probs are those of softmax(logits / T) for the sampled tokens.
  std::vector<int64_t> seq = prompts[0];
  seq.insert(seq.end(), a[0].tokens.begin(), a[0].tokens.end());
  c10::AutoGradMode no_grad(false);
  at::Tensor h = forward_hidden(m.config, m.weights, PackedBatch::pack({seq}, at::kCPU));
  at::Tensor targets = at::tensor(std::vector<int64_t>(seq.begin() + 1, seq.end()), at::kLong);
  at::Tensor lp = token_logprobs(h.narrow(0, 0, h.size(0) - 1), m.weights.lm_head, targets, 0.8);
  for (size_t i = 0; i < a[0].tokens.size(); ++i)
    EXPECT_NEAR(a[0].logprobs[i], lp[prompts[0].size() - 1 + i].item<double>(), 1e-4) << i;
  // top_k = 1 is greedy; a stop token ends the sequence and is kept.
  SamplingParams k1 = p;
  k1.top_k = 1;
  SamplingParams g;
  g.greedy = true;
  g.max_new_tokens = 6;
  EXPECT_EQ(generate(m.config, m.weights, prompts, k1)[1].tokens, generate(m.config, m.weights, prompts, g)[1].tokens);
  SamplingParams stop = g;
  const int64_t first = generate(m.config, m.weights, {prompts[0]}, g)[0].tokens[0];
  stop.stop_token_ids = {first};
  auto s = generate(m.config, m.weights, {prompts[0]}, stop);
  EXPECT_EQ(s[0].tokens, std::vector<int64_t>{first});
  EXPECT_EQ(s[0].finish_reason, "stop");
  EXPECT_THROW(generate(m.config, m.weights, {{5, 300}}, g), ConfigError);  // outside the vocabulary
  SamplingParams bad = p;
  bad.top_p = 0;
  EXPECT_THROW(bad.validate(), ConfigError);
}

}  // namespace
}  // namespace tiller::model
