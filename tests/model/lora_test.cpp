// LoRA adapters (model/lora.h) against PEFT (fixtures made by make_hf_fixtures.py with the peft
// package): the unmerged forward's logits, the merged weights and the adapters' gradients; the
// PEFT files read and written; the targets and the errors.
#include <filesystem>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "fixtures.h"
#include "tiller/core/error.h"
#include "tiller/model/lora.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"

namespace tiller::model {
namespace {

namespace fs = std::filesystem;

using test::max_diff;
using test::model_dir;
nlohmann::json reference() { return test::model_reference(); }

at::Tensor logits_of(const ModelConfig& cfg, const ModelWeights& w, const std::vector<int64_t>& ids,
                     bool lora_off = false) {
  const PackedBatch batch = PackedBatch::pack({ids}, at::kCPU);
  const Rope rope(cfg);
  BlockContext ctx = make_block_context(cfg, rope, batch, at::kFloat);
  ctx.lora_off = lora_off;
  at::Tensor x = embed(w.embed, batch.tokens);
  for (int64_t i = 0; i < cfg.num_layers; ++i) x = block_forward(cfg, i, w.layers[static_cast<size_t>(i)], x, ctx);
  return logits(final_norm(cfg, w.final_norm, x), w.lm_head);
}

class LoraPeft : public ::testing::TestWithParam<std::string> {};

// PEFT's adapters (random A and B) on llama (all-linear) and qwen2 (three projections, rsLoRA):
// tiller's unmerged forward gives PEFT's logits, with the adapters off the base's; the merge
// equals PEFT's merge_and_unload; the adapters' gradients of a log-prob sum equal PEFT's.
TEST_P(LoraPeft, ForwardMergeAndGradientsEqualPeft) {
  const std::string name = GetParam();
  LoadedModel m = load_model(model_dir(name), Head::kLm, at::kFloat, at::kCPU);
  const PeftAdapter adapter = read_peft_adapter(model_dir(name + "-lora"), m.config);
  const nlohmann::json ref = reference()[name + "-lora"];
  EXPECT_EQ(adapter.spec.rank, ref["r"].get<int64_t>());
  EXPECT_EQ(adapter.spec.use_rslora, ref["use_rslora"].get<bool>());
  EXPECT_NEAR(adapter.spec.scale(), ref["scaling"].get<double>(), 1e-12);
  int targeted = 0;
  for (bool t : adapter.spec.targets) targeted += t;
  EXPECT_EQ(targeted, ref["targets"].get<int>());
  bind_lora(m.config, adapter.spec, adapter.tensors, m.weights, "adapter");
  c10::AutoGradMode no_grad(false);
  SafetensorsFile want(model_dir(name + "-lora") + "/reference_logits.safetensors");
  SafetensorsFile base(model_dir(name) + "/reference_logits.safetensors");
  const auto inputs = reference()[name]["inputs"].get<std::vector<std::vector<int64_t>>>();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor expect = want.tensor("logits_" + std::to_string(i));
    EXPECT_LT(max_diff(logits_of(m.config, m.weights, inputs[i]), expect), 2e-4) << name << " input " << i;
    // The adapters change the logits (well beyond the bound), and off they leave the base's.
    EXPECT_GT(max_diff(base.tensor("logits_" + std::to_string(i)), expect), 1e-2) << name;
    EXPECT_LT(max_diff(logits_of(m.config, m.weights, inputs[i], /*lora_off=*/true),
                       base.tensor("logits_" + std::to_string(i))),
              2e-4)
        << name << " adapters off, input " << i;
  }
  // The merge: PEFT's merge_and_unload, weight by weight.
  const NamedTensors merged = merge_lora(m.config, adapter.spec, m.tensors, adapter.tensors);
  CheckpointReader peft_merged(model_dir(name + "-lora-merged"));
  int compared = 0;
  for (const auto& [n, t] : merged) {
    ASSERT_TRUE(peft_merged.contains(n)) << n;
    EXPECT_LT(max_diff(t, peft_merged.tensor(n)), 1e-6) << n;
    compared += max_diff(t, m.tensors.at(n)) > 0 ? 1 : 0;
  }
  EXPECT_EQ(compared, targeted * m.config.num_layers) << "every adapted projection (and nothing else) changes";
  // Gradients: the sum of input 2's next-token log-probs, through the adapters only.
  c10::AutoGradMode grad(true);
  NamedTensors leaves;
  for (const auto& [n, t] : adapter.tensors) leaves[n] = t.detach().clone().requires_grad_(true);
  LoadedModel g = load_model(model_dir(name), Head::kLm, at::kFloat, at::kCPU);
  bind_lora(g.config, adapter.spec, leaves, g.weights, "leaves");
  const std::vector<int64_t>& ids = inputs[2];
  const at::Tensor lp = at::log_softmax(logits_of(g.config, g.weights, ids).narrow(0, 0, ids.size() - 1), -1);
  const at::Tensor next = at::tensor(std::vector<int64_t>(ids.begin() + 1, ids.end()), at::kLong);
  lp.gather(1, next.unsqueeze(1)).sum().backward();
  SafetensorsFile grads(model_dir(name + "-lora") + "/reference_grads.safetensors");
  ASSERT_EQ(grads.entries().size(), leaves.size());
  for (const auto& [n, t] : leaves) {
    ASSERT_TRUE(t.grad().defined()) << n;
    const at::Tensor w = grads.tensor(n);
    EXPECT_LT(max_diff(t.grad(), w), 1e-4 * std::max(1.0, w.abs().max().item<double>())) << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Model, LoraPeft, ::testing::Values("llama", "qwen2"));

// Written and read back: PEFT's files (the fixture's adapter is PEFT's own), the spec and every
// tensor bit for bit; PEFT's initialisation starts at the base (B zero) with A in +-1/sqrt(in).
TEST(Lora, PeftFilesRoundTripAndTheInitialisation) {
  const ModelConfig cfg = load_model_config(model_dir("llama"));
  const PeftAdapter a = read_peft_adapter(model_dir("llama-lora"), cfg);
  const std::string out = test::scratch_dir() + "/lora_round_trip";
  fs::remove_all(out);
  write_peft_adapter(out, cfg, a.spec, 0.05, a.tensors, model_dir("llama"));
  const PeftAdapter b = read_peft_adapter(out, cfg);
  EXPECT_TRUE(a.spec == b.spec);
  EXPECT_DOUBLE_EQ(b.dropout, 0.05);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [n, t] : a.tensors) EXPECT_TRUE(at::equal(t, b.tensors.at(n))) << n;
  SafetensorsFile file(out + "/adapter_model.safetensors");
  EXPECT_TRUE(file.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  const NamedTensors init = init_lora(cfg, a.spec, 7);
  ASSERT_EQ(init.size(), a.tensors.size());
  for (const auto& [n, t] : init) {
    EXPECT_EQ(t.sizes(), a.tensors.at(n).sizes()) << n;
    if (n.find("lora_B") != std::string::npos) {
      EXPECT_EQ(t.abs().max().item<double>(), 0.0) << n;
    } else {
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.size(1)));
      EXPECT_LE(t.abs().max().item<double>(), bound) << n;
      EXPECT_GT(t.abs().max().item<double>(), 0.5 * bound) << n;
    }
  }
  EXPECT_TRUE(at::equal(init.begin()->second, init_lora(cfg, a.spec, 7).begin()->second)) << "seeded";
}

// Targets: names, all-linear, a YAML-style list; unknown names, an empty list and MLP targets on
// a mixture of experts are refused with the key named.
TEST(Lora, TargetsAndTheirErrors) {
  const ModelConfig dense = preset("tiny-llama"), moe = preset("tiny-qwen3-moe");
  auto on = [](const std::array<bool, kLoraModules>& t) {
    int n = 0;
    for (bool b : t) n += b;
    return n;
  };
  EXPECT_EQ(on(lora_targets("all-linear", dense, "k")), 7);
  EXPECT_EQ(on(lora_targets("q_proj, v_proj", dense, "k")), 2);
  EXPECT_TRUE(lora_targets("down_proj", dense, "k")[static_cast<size_t>(LoraModule::kDown)]);
  EXPECT_EQ(on(lora_targets("all-linear", moe, "k")), 4);  // the attention of a mixture of experts
  auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error([&] { lora_targets("q_proj,lm_head", dense, "roles.actor.lora.target_modules"); })
                .find("roles.actor.lora.target_modules = 'q_proj,lm_head': 'lm_head' is not a projection"),
            std::string::npos);
  EXPECT_NE(error([&] { lora_targets(" , ", dense, "key"); }).find("key is empty"), std::string::npos);
  EXPECT_NE(error([&] { lora_targets("q_proj,gate_proj", moe, "key"); }).find("its experts' MLPs take none"),
            std::string::npos);
}

// LoRA's dropout (training): a mask from a hash of the seed and each element's place, so the same
// seed gives the same block output (as a recomputed block must), another seed another, the
// adapters off none at all, and the mean over seeds tends to the output without dropout (the kept
// inputs are scaled by 1 / (1 - p)).
TEST(Lora, DropoutIsASeededHashMask) {
  LoadedModel m = load_model(model_dir("llama"), Head::kLm, at::kFloat, at::kCPU);
  const PeftAdapter adapter = read_peft_adapter(model_dir("llama-lora"), m.config);
  bind_lora(m.config, adapter.spec, adapter.tensors, m.weights, "adapter");
  c10::AutoGradMode no_grad(false);
  const auto ids = reference()["llama"]["inputs"][2].get<std::vector<int64_t>>();
  const PackedBatch batch = PackedBatch::pack({ids}, at::kCPU);
  const Rope rope(m.config);
  auto block = [&](double p, int64_t seed, bool off = false) {
    BlockContext ctx = make_block_context(m.config, rope, batch, at::kFloat);
    ctx.lora_dropout = p;
    ctx.lora_dropout_seed = seed;
    ctx.lora_off = off;
    return block_forward(m.config, 0, m.weights.layers[0], embed(m.weights.embed, batch.tokens), ctx);
  };
  const at::Tensor plain = block(0, 0), one = block(0.5, 11);
  EXPECT_TRUE(at::equal(one, block(0.5, 11)));
  EXPECT_FALSE(at::equal(one, block(0.5, 12)));
  EXPECT_TRUE(at::equal(block(0.5, 11, true), block(0, 0, true)));
  at::Tensor mean = at::zeros_like(plain);
  const int draws = 64;
  for (int s = 0; s < draws; ++s) mean += block(0.5, 100 + s) / draws;
  EXPECT_LT(max_diff(mean, plain), 0.3 * max_diff(one, plain));
}

// A PEFT adapter tiller cannot run is refused by file and key.
TEST(Lora, UnsupportedPeftAdaptersAreNamed) {
  const ModelConfig cfg = load_model_config(model_dir("llama"));
  const std::string dir = test::scratch_dir() + "/lora_bad";
  auto with_config = [&](const std::function<void(nlohmann::json&)>& edit) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy_file(model_dir("llama-lora") + "/adapter_model.safetensors", dir + "/adapter_model.safetensors");
    nlohmann::json j = test::read_json(model_dir("llama-lora") + "/adapter_config.json");
    edit(j);
    test::write_text(dir + "/adapter_config.json", j.dump());
    try {
      read_peft_adapter(dir, cfg);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(with_config([](nlohmann::json& j) { j["use_dora"] = true; }).find("use_dora is true"), std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& j) { j["bias"] = "all"; }).find("bias 'all'"), std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& j) { j["layers_to_transform"] = {0}; }).find("layers_to_transform is set"),
            std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& j) { j["r"] = 5; }).find("rank 5 need"), std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& j) { j["target_modules"] = {"q_proj"}; }).find("the adapter holds"),
            std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& j) { j["peft_type"] = "IA3"; }).find("peft_type IA3 is not LORA"),
            std::string::npos);
  fs::remove(dir + "/adapter_config.json");
  EXPECT_THROW(read_peft_adapter(dir, cfg), IoError);
}

}  // namespace
}  // namespace tiller::model
