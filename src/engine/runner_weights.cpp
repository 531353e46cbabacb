// The forms a model runner gives its weights (runner_weights.h).
#include "engine/runner_weights.h"

#include <ATen/ATen.h>

#include "tiller/core/error.h"

namespace tiller::engine {

model::ModelConfig config_for_rank(const model::ModelConfig& cfg, int tp) {
  model::ModelConfig local = cfg;
  local.num_heads /= tp;
  local.num_kv_heads /= tp;
  local.intermediate_size /= tp;
  local.moe_intermediate_size /= tp;  // each rank: every expert's slice (engine_weights.h)
  local.shared_expert_intermediate_size /= tp;
  return local;
}

std::vector<std::pair<const at::Tensor*, model::fp8::QuantizedWeight*>> fp8_pairs(model::LayerWeights& w) {
  std::vector<std::pair<const at::Tensor*, model::fp8::QuantizedWeight*>> out;
  if (w.qkv_proj.defined()) out.emplace_back(&w.qkv_proj, &w.qkv_fp8);
  if (w.o_proj.defined()) out.emplace_back(&w.o_proj, &w.o_fp8);
  if (w.gate_up_proj.defined()) out.emplace_back(&w.gate_up_proj, &w.gate_up_fp8);
  if (w.down_proj.defined()) out.emplace_back(&w.down_proj, &w.down_fp8);
  return out;
}

void quantize_layer(model::LayerWeights& w, model::fp8::Scaling scaling) {
  for (auto [src, dst] : fp8_pairs(w)) *dst = model::fp8::quantize_weight(*src, scaling);
}

void requantize_layer(model::LayerWeights& w) {
  for (auto [src, dst] : fp8_pairs(w)) model::fp8::quantize_weight_into(*src, *dst);
}

void fuse_projections(model::LayerWeights& w) {
  auto split = [](const at::Tensor& fused, std::initializer_list<at::Tensor*> parts) {
    int64_t at_row = 0;
    for (at::Tensor* p : parts) {
      const int64_t rows = p->size(0);
      *p = fused.narrow(0, at_row, rows);
      at_row += rows;
    }
  };
  w.qkv_proj = at::cat({w.q_proj, w.k_proj, w.v_proj}, 0);
  split(w.qkv_proj, {&w.q_proj, &w.k_proj, &w.v_proj});
  if (w.q_bias.defined()) {
    w.qkv_bias = at::cat({w.q_bias, w.k_bias, w.v_bias}, 0);
    split(w.qkv_bias, {&w.q_bias, &w.k_bias, &w.v_bias});
  }
  if (!w.experts.empty()) {
    // The experts stacked for the grouped GEMMs (model::grouped_experts), each expert's gate and
    // up rows together; the weight sync then writes into the stacks through the views.
    const auto n = static_cast<int64_t>(w.experts.size());
    const at::Tensor& g0 = w.experts[0].gate_proj;
    const int64_t inner = g0.size(0), hidden = g0.size(1);
    w.experts_gate_up = at::empty({n, 2 * inner, hidden}, g0.options());
    w.experts_down = at::empty({n, hidden, inner}, g0.options());
    for (int64_t e = 0; e < n; ++e) {
      model::ExpertWeights& x = w.experts[static_cast<size_t>(e)];
      TILLER_CHECK(x.gate_proj.sizes() == g0.sizes() && x.up_proj.sizes() == g0.sizes() &&
                       x.down_proj.size(0) == hidden && x.down_proj.size(1) == inner,
                   "expert {} of a sparse layer differs in shape from expert 0", e);
      const at::Tensor gu = w.experts_gate_up.select(0, e);
      gu.narrow(0, 0, inner).copy_(x.gate_proj);
      gu.narrow(0, inner, inner).copy_(x.up_proj);
      w.experts_down.select(0, e).copy_(x.down_proj);
      x.gate_proj = gu.narrow(0, 0, inner);
      x.up_proj = gu.narrow(0, inner, inner);
      x.down_proj = w.experts_down.select(0, e);
    }
  }
  if (!w.gate_proj.defined()) return;  // a sparse layer without a shared expert
  w.gate_up_proj = at::cat({w.gate_proj, w.up_proj}, 0);
  split(w.gate_up_proj, {&w.gate_proj, &w.up_proj});
}

}  // namespace tiller::engine
