#include "tiller/model/weights.h"

#include <filesystem>
#include <optional>


#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller::model {
namespace {

std::string layer_name(int64_t i, const char* rest) { return fmt::format("model.layers.{}.{}", i, rest); }

// The per-layer members in spec order, with the HF suffix of each.
struct LayerField {
  const char* suffix;
  at::Tensor LayerWeights::*member;
};
constexpr LayerField kLayerFields[] = {
    {"input_layernorm.weight", &LayerWeights::input_norm},
    {"self_attn.q_proj.weight", &LayerWeights::q_proj},
    {"self_attn.q_proj.bias", &LayerWeights::q_bias},
    {"self_attn.k_proj.weight", &LayerWeights::k_proj},
    {"self_attn.k_proj.bias", &LayerWeights::k_bias},
    {"self_attn.v_proj.weight", &LayerWeights::v_proj},
    {"self_attn.v_proj.bias", &LayerWeights::v_bias},
    {"self_attn.q_norm.weight", &LayerWeights::q_norm},
    {"self_attn.k_norm.weight", &LayerWeights::k_norm},
    {"self_attn.o_proj.weight", &LayerWeights::o_proj},
    {"post_attention_layernorm.weight", &LayerWeights::post_attn_norm},
    {"mlp.gate_proj.weight", &LayerWeights::gate_proj},
    {"mlp.up_proj.weight", &LayerWeights::up_proj},
    {"mlp.down_proj.weight", &LayerWeights::down_proj},
};

}  // namespace

std::vector<ParamSpec> parameter_specs(const ModelConfig& c, Head head) {
  const int64_t h = c.hidden_size;
  std::vector<ParamSpec> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, -1, false, false});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const int l = static_cast<int>(i);
    s.push_back({layer_name(i, "input_layernorm.weight"), {h}, l, true, true});
    // q, k, v weights back to back, then their biases.
    s.push_back({layer_name(i, "self_attn.q_proj.weight"), {c.q_size(), h}, l, false, false});
    s.push_back({layer_name(i, "self_attn.k_proj.weight"), {c.kv_size(), h}, l, false, false});
    s.push_back({layer_name(i, "self_attn.v_proj.weight"), {c.kv_size(), h}, l, false, false});
    if (c.attention_bias) {
      s.push_back({layer_name(i, "self_attn.q_proj.bias"), {c.q_size()}, l, true, false});
      s.push_back({layer_name(i, "self_attn.k_proj.bias"), {c.kv_size()}, l, true, false});
      s.push_back({layer_name(i, "self_attn.v_proj.bias"), {c.kv_size()}, l, true, false});
    }
    if (c.qk_norm) {
      s.push_back({layer_name(i, "self_attn.q_norm.weight"), {c.head_dim}, l, true, true});
      s.push_back({layer_name(i, "self_attn.k_norm.weight"), {c.head_dim}, l, true, true});
    }
    s.push_back({layer_name(i, "self_attn.o_proj.weight"), {h, c.q_size()}, l, false, false});
    s.push_back({layer_name(i, "post_attention_layernorm.weight"), {h}, l, true, true});
    s.push_back({layer_name(i, "mlp.gate_proj.weight"), {c.intermediate_size, h}, l, false, false});
    s.push_back({layer_name(i, "mlp.up_proj.weight"), {c.intermediate_size, h}, l, false, false});
    s.push_back({layer_name(i, "mlp.down_proj.weight"), {h, c.intermediate_size}, l, false, false});
  }
  s.push_back({"model.norm.weight", {h}, -1, true, true});
  if (head == Head::kValue) s.push_back({"score.weight", {1, h}, -1, false, false});
  else if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, h}, -1, false, false});
  return s;
}

ModelWeights bind_weights(const ModelConfig& c, const NamedTensors& named, Head head, const std::string& where) {
  auto get = [&](const ParamSpec& spec) {
    auto it = named.find(spec.name);
    if (it == named.end()) {
      const char* hint = spec.name == "score.weight"
                             ? " (a value model needs a checkpoint saved with a score head)"
                             : "";
      throw IoError(fmt::format("{}: missing tensor '{}'{}", where, spec.name, hint));
    }
    if (it->second.sizes().vec() != spec.shape)
      throw IoError(fmt::format("{}: tensor '{}' has shape {} but config.json implies {}", where, spec.name,
                                fmt::format("{}", fmt::join(it->second.sizes().vec(), "x")),
                                fmt::format("{}", fmt::join(spec.shape, "x"))));
    return it->second;
  };
  ModelWeights w;
  w.layers.resize(c.num_layers);
  for (const ParamSpec& spec : parameter_specs(c, head)) {
    at::Tensor t = get(spec);
    if (spec.layer >= 0) {
      const std::string prefix = layer_name(spec.layer, "");
      const std::string suffix = spec.name.substr(prefix.size());
      for (const auto& f : kLayerFields)
        if (suffix == f.suffix) w.layers[spec.layer].*(f.member) = t;
    } else if (spec.name == "model.embed_tokens.weight") {
      w.embed = t;
    } else if (spec.name == "model.norm.weight") {
      w.final_norm = t;
    } else if (spec.name == "lm_head.weight") {
      w.lm_head = t;
    } else if (spec.name == "score.weight") {
      w.score = t;
    }
  }
  if (head == Head::kLm && c.tie_word_embeddings) w.lm_head = w.embed;
  return w;
}

LayerWeights bind_layer(const ModelConfig& c, int64_t layer, const NamedTensors& named, const std::string& where) {
  TILLER_CHECK(layer >= 0 && layer < c.num_layers, "{}: layer {} outside [0, {})", where, layer, c.num_layers);
  LayerWeights w;
  const std::string prefix = layer_name(layer, "");
  for (const auto& f : kLayerFields) {
    auto it = named.find(prefix + f.suffix);
    if (it != named.end()) w.*(f.member) = it->second;
  }
  const bool complete = w.input_norm.defined() && w.q_proj.defined() && w.k_proj.defined() && w.v_proj.defined() &&
                        w.o_proj.defined() && w.post_attn_norm.defined() && w.gate_proj.defined() &&
                        w.up_proj.defined() && w.down_proj.defined() &&
                        (!c.attention_bias || (w.q_bias.defined() && w.k_bias.defined() && w.v_bias.defined())) &&
                        (!c.qk_norm || (w.q_norm.defined() && w.k_norm.defined()));
  if (!complete) throw IoError(fmt::format("{}: layer {} lacks parameters its config needs", where, layer));
  return w;
}

NamedTensors named_weights(const ModelConfig& c, const ModelWeights& w, Head head) {
  NamedTensors out;
  for (const ParamSpec& spec : parameter_specs(c, head)) {
    at::Tensor t;
    if (spec.layer >= 0) {
      const std::string suffix = spec.name.substr(layer_name(spec.layer, "").size());
      for (const auto& f : kLayerFields)
        if (suffix == f.suffix) t = w.layers[spec.layer].*(f.member);
    } else if (spec.name == "model.embed_tokens.weight") {
      t = w.embed;
    } else if (spec.name == "model.norm.weight") {
      t = w.final_norm;
    } else if (spec.name == "lm_head.weight") {
      t = w.lm_head;
    } else if (spec.name == "score.weight") {
      t = w.score;
    }
    TILLER_CHECK(t.defined(), "parameter '{}' is not bound", spec.name);
    out[spec.name] = t;
  }
  return out;
}

NamedTensors init_weights(const ModelConfig& c, Head head, uint64_t seed, at::ScalarType dtype, at::Device device) {
  std::optional<at::Generator> gen;
  if (device.is_cpu()) gen = at::detail::createCPUGenerator(seed);
  else at::manual_seed(seed);  // the device's default generator
  const auto opts = at::TensorOptions().device(device);
  NamedTensors out;
  for (const ParamSpec& spec : parameter_specs(c, head)) {
    at::Tensor t;
    if (spec.is_norm) t = at::ones(spec.shape, opts.dtype(dtype));
    else if (spec.no_decay) t = at::zeros(spec.shape, opts.dtype(dtype));  // biases
    else t = at::normal(0.0, c.initializer_range, spec.shape, gen, opts.dtype(at::kFloat)).to(dtype);
    out[spec.name] = t;
  }
  return out;
}

LoadedModel load_model(const std::string& dir, Head head, at::ScalarType dtype, at::Device device) {
  LoadedModel m;
  m.config = load_model_config(dir);
  CheckpointReader reader(dir);
  for (const ParamSpec& spec : parameter_specs(m.config, head)) {
    if (!reader.contains(spec.name)) continue;  // bind_weights names what is missing
    at::Tensor t = reader.tensor(spec.name);
    if (t.scalar_type() != dtype || t.device() != device) t = t.to(device, dtype);
    m.tensors[spec.name] = t;
  }
  m.weights = bind_weights(m.config, m.tensors, head, dir);
  return m;
}

void save_model(const std::string& dir, const ModelConfig& c, const ModelWeights& w, Head head, uint64_t max_shard_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("{}: cannot create the directory: {}", dir, ec.message()));
  NamedTensors named = named_weights(c, w, head);
  ModelConfig out = c;
  const at::ScalarType st = named.begin()->second.scalar_type();
  out.torch_dtype = st == at::kBFloat16 ? "bfloat16" : st == at::kHalf ? "float16" : "float32";
  write_checkpoint(dir, named, max_shard_bytes);
  write_file_atomic(dir + "/config.json", to_hf_config_json(out, head == Head::kValue));
}

}  // namespace tiller::model
