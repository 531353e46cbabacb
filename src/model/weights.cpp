#include "tiller/model/weights.h"

#include <filesystem>
#include <functional>
#include <optional>


#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tiller/core/error.h"
#include "tiller/core/files.h"

namespace tiller::model {
namespace {

std::string layer_name(int64_t i, const char* rest) { return fmt::format("model.layers.{}.{}", i, rest); }

// One parameter of a block: its HF suffix, shape, and where LayerWeights keeps it.
struct Slot {
  std::string suffix;
  std::vector<int64_t> shape;
  bool no_decay = false;
  bool is_norm = false;
  std::function<at::Tensor&(LayerWeights&)> ref;
};

// Block `i`'s parameters in spec order: attention, then the dense MLP or the mixture of experts
// (router, experts in order, shared expert and its gate).
std::vector<Slot> layer_slots(const ModelConfig& c, int64_t i) {
  const int64_t h = c.hidden_size;
  std::vector<Slot> s;
  auto member = [](at::Tensor LayerWeights::*m) {
    return [m](LayerWeights& w) -> at::Tensor& { return w.*m; };
  };
  s.push_back({"input_layernorm.weight", {h}, true, true, member(&LayerWeights::input_norm)});
  // q, k, v weights back to back, then their biases.
  s.push_back({"self_attn.q_proj.weight", {c.q_size(), h}, false, false, member(&LayerWeights::q_proj)});
  s.push_back({"self_attn.k_proj.weight", {c.kv_size(), h}, false, false, member(&LayerWeights::k_proj)});
  s.push_back({"self_attn.v_proj.weight", {c.kv_size(), h}, false, false, member(&LayerWeights::v_proj)});
  if (c.attention_bias) {
    s.push_back({"self_attn.q_proj.bias", {c.q_size()}, true, false, member(&LayerWeights::q_bias)});
    s.push_back({"self_attn.k_proj.bias", {c.kv_size()}, true, false, member(&LayerWeights::k_bias)});
    s.push_back({"self_attn.v_proj.bias", {c.kv_size()}, true, false, member(&LayerWeights::v_bias)});
  }
  if (c.qk_norm) {
    s.push_back({"self_attn.q_norm.weight", {c.head_dim}, true, true, member(&LayerWeights::q_norm)});
    s.push_back({"self_attn.k_norm.weight", {c.head_dim}, true, true, member(&LayerWeights::k_norm)});
  }
  s.push_back({"self_attn.o_proj.weight", {h, c.q_size()}, false, false, member(&LayerWeights::o_proj)});
  s.push_back({"post_attention_layernorm.weight", {h}, true, true, member(&LayerWeights::post_attn_norm)});
  if (!c.sparse_layer(i)) {
    s.push_back({"mlp.gate_proj.weight", {c.intermediate_size, h}, false, false, member(&LayerWeights::gate_proj)});
    s.push_back({"mlp.up_proj.weight", {c.intermediate_size, h}, false, false, member(&LayerWeights::up_proj)});
    s.push_back({"mlp.down_proj.weight", {h, c.intermediate_size}, false, false, member(&LayerWeights::down_proj)});
    return s;
  }
  const bool mixtral = c.family == Family::kMixtral;
  const std::string moe = mixtral ? "block_sparse_moe." : "mlp.";
  const int64_t e_inter = c.moe_intermediate_size;
  s.push_back({moe + "gate.weight", {c.num_experts, h}, false, false, member(&LayerWeights::router)});
  for (int64_t e = 0; e < c.num_experts; ++e) {
    auto expert = [e](at::Tensor ExpertWeights::*m) {
      return [e, m](LayerWeights& w) -> at::Tensor& {
        if (static_cast<int64_t>(w.experts.size()) <= e) w.experts.resize(static_cast<size_t>(e + 1));
        return w.experts[static_cast<size_t>(e)].*m;
      };
    };
    const std::string p = fmt::format("{}experts.{}.", moe, e);
    s.push_back({p + (mixtral ? "w1.weight" : "gate_proj.weight"), {e_inter, h}, false, false,
                 expert(&ExpertWeights::gate_proj)});
    s.push_back({p + (mixtral ? "w3.weight" : "up_proj.weight"), {e_inter, h}, false, false,
                 expert(&ExpertWeights::up_proj)});
    s.push_back({p + (mixtral ? "w2.weight" : "down_proj.weight"), {h, e_inter}, false, false,
                 expert(&ExpertWeights::down_proj)});
  }
  if (c.shared_expert_intermediate_size > 0) {
    const int64_t si = c.shared_expert_intermediate_size;
    s.push_back({"mlp.shared_expert.gate_proj.weight", {si, h}, false, false, member(&LayerWeights::gate_proj)});
    s.push_back({"mlp.shared_expert.up_proj.weight", {si, h}, false, false, member(&LayerWeights::up_proj)});
    s.push_back({"mlp.shared_expert.down_proj.weight", {h, si}, false, false, member(&LayerWeights::down_proj)});
    s.push_back({"mlp.shared_expert_gate.weight", {1, h}, false, false, member(&LayerWeights::shared_expert_gate)});
  }
  return s;
}

std::string shape_text(const std::vector<int64_t>& v) { return fmt::format("{}", fmt::join(v, "x")); }

}  // namespace

std::vector<ParamSpec> parameter_specs(const ModelConfig& c, Head head) {
  const int64_t h = c.hidden_size;
  std::vector<ParamSpec> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, -1, false, false});
  for (int64_t i = 0; i < c.num_layers; ++i)
    for (Slot& slot : layer_slots(c, i))
      s.push_back({layer_name(i, slot.suffix.c_str()), std::move(slot.shape), static_cast<int>(i), slot.no_decay,
                   slot.is_norm});
  s.push_back({"model.norm.weight", {h}, -1, true, true});
  if (head == Head::kValue) s.push_back({"score.weight", {1, h}, -1, false, false});
  else if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, h}, -1, false, false});
  return s;
}

namespace {

// Looks `name` up in `named` with the spec's shape; IoError naming the tensor otherwise.
const at::Tensor& lookup(const NamedTensors& named, const std::string& name, const std::vector<int64_t>& shape,
                         const std::string& where) {
  auto it = named.find(name);
  if (it == named.end()) {
    const char* hint = name == "score.weight" ? " (a value model needs a checkpoint saved with a score head)" : "";
    throw IoError(fmt::format("{}: missing tensor '{}'{}", where, name, hint));
  }
  if (it->second.sizes().vec() != shape)
    throw IoError(fmt::format("{}: tensor '{}' has shape {} but config.json implies {}", where, name,
                              shape_text(it->second.sizes().vec()), shape_text(shape)));
  return it->second;
}

}  // namespace

ModelWeights bind_weights(const ModelConfig& c, const NamedTensors& named, Head head, const std::string& where) {
  ModelWeights w;
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (const ParamSpec& spec : parameter_specs(c, head)) {
    if (spec.layer >= 0) continue;  // below, block by block
    const at::Tensor& t = lookup(named, spec.name, spec.shape, where);
    if (spec.name == "model.embed_tokens.weight") w.embed = t;
    else if (spec.name == "model.norm.weight") w.final_norm = t;
    else if (spec.name == "lm_head.weight") w.lm_head = t;
    else if (spec.name == "score.weight") w.score = t;
  }
  for (int64_t i = 0; i < c.num_layers; ++i)
    for (Slot& slot : layer_slots(c, i))
      slot.ref(w.layers[static_cast<size_t>(i)]) = lookup(named, layer_name(i, slot.suffix.c_str()), slot.shape, where);
  if (head == Head::kLm && c.tie_word_embeddings) w.lm_head = w.embed;
  return w;
}

LayerWeights bind_layer(const ModelConfig& c, int64_t layer, const NamedTensors& named, const std::string& where) {
  TILLER_CHECK(layer >= 0 && layer < c.num_layers, "{}: layer {} outside [0, {})", where, layer, c.num_layers);
  LayerWeights w;
  for (Slot& slot : layer_slots(c, layer)) {
    const std::string name = layer_name(layer, slot.suffix.c_str());
    if (!named.count(name)) throw IoError(fmt::format("{}: layer {} lacks '{}', which its config needs", where, layer, name));
    slot.ref(w) = lookup(named, name, slot.shape, where);
  }
  return w;
}

NamedTensors named_weights(const ModelConfig& c, const ModelWeights& w, Head head) {
  NamedTensors out;
  for (const ParamSpec& spec : parameter_specs(c, head)) {
    if (spec.layer >= 0) continue;
    at::Tensor t = spec.name == "model.embed_tokens.weight" ? w.embed
                   : spec.name == "model.norm.weight"       ? w.final_norm
                   : spec.name == "lm_head.weight"          ? w.lm_head
                                                            : w.score;
    TILLER_CHECK(t.defined(), "parameter '{}' is not bound", spec.name);
    out[spec.name] = t;
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights layer = w.layers.at(static_cast<size_t>(i));  // handles; the slots' refs want it mutable
    for (Slot& slot : layer_slots(c, i)) {
      const std::string name = layer_name(i, slot.suffix.c_str());
      const at::Tensor& t = slot.ref(layer);
      TILLER_CHECK(t.defined(), "parameter '{}' is not bound", name);
      out[name] = t;
    }
  }
  return out;
}

NamedTensors init_weights(const ModelConfig& c, Head head, uint64_t seed, at::ScalarType dtype, at::Device device,
                          std::optional<at::Device> store) {
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
    out[spec.name] = store && *store != device ? t.to(*store) : t;
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

int tp_split_dim(const std::string& n) {
  const auto ends_with = [&n](const std::string& suffix) {
    return n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with(".lora_A.weight") || ends_with(".lora_B.weight")) {  // the projection's own split, on its side
    const bool a = ends_with(".lora_A.weight");
    const bool row_parallel = n.find(".o_proj.") != std::string::npos || n.find(".down_proj.") != std::string::npos;
    return a ? (row_parallel ? 1 : -1) : (row_parallel ? -1 : 0);
  }
  for (const char* s : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
                        "v_proj.bias", "gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight"})
    if (ends_with(std::string(".") + s)) return 0;  // w1/w3/w2: Mixtral's experts
  if (ends_with(".o_proj.weight") || ends_with(".down_proj.weight") || ends_with(".w2.weight")) return 1;
  return -1;
}

}  // namespace tiller::model
