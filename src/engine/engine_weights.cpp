#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tiller/core/error.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"

namespace tiller::engine {
namespace {

// Rows (dim 0) or columns (dim 1) [rank * n / size, (rank + 1) * n / size) of a matrix or bias.
at::Tensor part(const at::Tensor& t, int64_t dim, int rank, int size) {
  if (!t.defined() || size == 1) return t;
  const int64_t n = t.size(dim) / size;
  return t.narrow(dim, rank * n, n).contiguous();
}

at::Tensor place(const at::Tensor& t, at::ScalarType dtype, at::Device device) {
  return t.defined() ? t.to(device, dtype) : t;
}

at::ScalarType engine_dtype(const std::string& name, const at::Device& device) {
  if (name == "auto") return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  if (name == "fp32") return at::kFloat;
  throw ConfigError(fmt::format("engine dtype '{}': use auto, bf16, fp16 or fp32", name));
}

}  // namespace

model::ModelWeights slice_for_tp(const model::ModelConfig& cfg, const model::ModelWeights& full, int rank, int size) {
  // A mixture of experts: every rank holds every expert's slice of its inner dimension (and of the
  // shared expert's), the router whole; each rank routes alike, and the partial sums of the
  // experts' down projections add up over the group like a dense MLP's (docs/engine.md).
  if (cfg.moe() && (cfg.moe_intermediate_size % size || cfg.shared_expert_intermediate_size % size))
    throw ConfigError(fmt::format("tensor parallel size {} must divide the experts' width ({}) and the shared "
                                  "expert's ({})",
                                  size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size));
  if (cfg.num_heads % size || cfg.num_kv_heads % size || cfg.intermediate_size % size)
    throw ConfigError(fmt::format("tensor parallel size {} must divide the attention heads ({}), the KV heads ({}) "
                                  "and the MLP width ({})",
                                  size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size));
  TILLER_CHECK(rank >= 0 && rank < size, "tp rank {} of {}", rank, size);
  model::ModelWeights w;
  w.embed = full.embed;
  w.final_norm = full.final_norm;
  w.lm_head = full.lm_head;
  // Each field by its HF name's split (model::tp_split_dim, the weight sync's rule too).
  const auto cut = [&](const at::Tensor& t, const char* hf_suffix) {
    const int dim = model::tp_split_dim(std::string("x.") + hf_suffix);
    TILLER_CHECK(dim >= 0, "tensor parallelism does not split '{}'", hf_suffix);
    return part(t, dim, rank, size);
  };
  for (const auto& l : full.layers) {
    model::LayerWeights s = l;
    s.q_proj = cut(l.q_proj, "q_proj.weight");
    s.k_proj = cut(l.k_proj, "k_proj.weight");
    s.v_proj = cut(l.v_proj, "v_proj.weight");
    s.q_bias = cut(l.q_bias, "q_proj.bias");
    s.k_bias = cut(l.k_bias, "k_proj.bias");
    s.v_bias = cut(l.v_bias, "v_proj.bias");
    s.o_proj = cut(l.o_proj, "o_proj.weight");
    s.gate_proj = cut(l.gate_proj, "gate_proj.weight");
    s.up_proj = cut(l.up_proj, "up_proj.weight");
    s.down_proj = cut(l.down_proj, "down_proj.weight");
    for (auto& e : s.experts) {
      e.gate_proj = cut(e.gate_proj, "gate_proj.weight");
      e.up_proj = cut(e.up_proj, "up_proj.weight");
      e.down_proj = cut(e.down_proj, "down_proj.weight");
    }
    w.layers.push_back(std::move(s));
  }
  return w;
}

void bind_lora_for_tp(const model::ModelConfig& cfg, const model::LoraSpec& spec, const model::NamedTensors& adapters,
                      model::ModelWeights& weights, int tp_rank, int tp_size, const std::string& device,
                      const std::string& where) {
  if (!spec.enabled()) return;
  TILLER_CHECK(tp_rank >= 0 && tp_rank < tp_size, "tp rank {} of {}", tp_rank, tp_size);
  model::NamedTensors local;
  for (const model::ParamSpec& p : model::lora_parameter_specs(cfg, spec)) {
    const auto it = adapters.find(p.name);
    if (it == adapters.end()) throw IoError(fmt::format("{}: the adapter lacks '{}'", where, p.name));
    if (it->second.sizes().vec() != p.shape)
      throw IoError(fmt::format("{}: '{}' is {}, the model and rank {} need {}", where, p.name,
                                fmt::join(it->second.sizes(), "x"), spec.rank, fmt::join(p.shape, "x")));
    at::Tensor t = it->second;
    if (const int dim = model::tp_split_dim(p.name); dim >= 0) t = part(t, dim, tp_rank, tp_size);
    local[p.name] = t.to(at::Device(device), at::kFloat).contiguous();
  }
  // The rank's own shapes: its heads and MLP width (as its base slices have).
  model::ModelConfig rank_cfg = cfg;
  rank_cfg.num_heads /= tp_size;
  rank_cfg.num_kv_heads /= tp_size;
  rank_cfg.intermediate_size /= tp_size;
  model::bind_lora(rank_cfg, spec, local, weights, where);
}

EngineWeights load_engine_weights(const std::string& dir, int tp_rank, int tp_size, const std::string& dtype,
                                  const std::string& device_name) {
  const at::Device device(device_name);
  const at::ScalarType dt = engine_dtype(dtype, device);
  // On the host first (views of the mapped files when the dtype matches), so that only this
  // rank's slices reach the device.
  model::LoadedModel m = model::load_model(dir, model::Head::kLm, dt, at::kCPU);
  const model::ModelWeights sliced = slice_for_tp(m.config, m.weights, tp_rank, tp_size);
  EngineWeights out;
  out.config = m.config;
  model::ModelWeights& w = out.weights;
  w.embed = place(sliced.embed, dt, device);
  w.final_norm = place(sliced.final_norm, dt, device);
  w.lm_head = m.config.tie_word_embeddings ? w.embed : place(sliced.lm_head, dt, device);
  for (const auto& l : sliced.layers) {
    model::LayerWeights d;
    d.input_norm = place(l.input_norm, dt, device);
    d.q_proj = place(l.q_proj, dt, device);
    d.k_proj = place(l.k_proj, dt, device);
    d.v_proj = place(l.v_proj, dt, device);
    d.q_bias = place(l.q_bias, dt, device);
    d.k_bias = place(l.k_bias, dt, device);
    d.v_bias = place(l.v_bias, dt, device);
    d.q_norm = place(l.q_norm, dt, device);
    d.k_norm = place(l.k_norm, dt, device);
    d.o_proj = place(l.o_proj, dt, device);
    d.post_attn_norm = place(l.post_attn_norm, dt, device);
    d.gate_proj = place(l.gate_proj, dt, device);
    d.up_proj = place(l.up_proj, dt, device);
    d.down_proj = place(l.down_proj, dt, device);
    d.router = place(l.router, dt, device);
    d.shared_expert_gate = place(l.shared_expert_gate, dt, device);
    for (const auto& e : l.experts)
      d.experts.push_back({place(e.gate_proj, dt, device), place(e.up_proj, dt, device), place(e.down_proj, dt, device)});
    w.layers.push_back(std::move(d));
  }
  return out;
}

}  // namespace tiller::engine
