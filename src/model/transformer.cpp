#include "tiller/model/transformer.h"

#include <array>
#include <atomic>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#ifdef TILLER_HAVE_CUDA_KERNELS
#include <cuda_runtime_api.h>
#endif

#include "model/batch_invariant.h"
#include "model/block_parts.h"
#include "model/fp8_rows.h"
#include "model/fp8_train.h"
#include "model/host_upload.h"
#include "tiller/core/error.h"
#include "tiller/model/numerics.h"

namespace tiller::model {

// ATen's rms_norm: one fused kernel each way on CUDA, statistics in fp32 for half types (as HF;
// the weight is applied before rounding to the input type rather than after).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (batch_invariant()) return invariant::rms_norm(x, weight, eps);
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
}

at::Tensor embed(const at::Tensor& embedding, const at::Tensor& tokens) { return at::embedding(embedding, tokens); }

namespace {

// x's projection by w (and bias b), or by its FP8 form when the engine quantized it, or in FP8
// training's GEMMs when `ctx` asks for them.
// `shared`: x's FP8 codes for the training linears that take x (shared_fp8_input).
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {},
                   const fp8::QuantizedWeight* q = nullptr, const BlockContext* ctx = nullptr,
                   const fp8::TrainInput& shared = {}) {
  if (q && q->defined()) return fp8::linear(x, *q, b);
  if (ctx && ctx->fp8_training)
    return fp8::train_linear(x, w, b, *ctx->fp8_training, shared, ctx->fp8_fast_accumulation);
  if (batch_invariant()) return invariant::linear(x, w, b);
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

// x quantized once for FP8 training's projections of it by `ws` (q/k/v, gate/up: tensor scaling on
// tensor cores; fp8_train.h), with x^T's codes where one of their gradients will be taken; empty
// where each projection quantizes x itself.
fp8::TrainInput shared_fp8_input(const at::Tensor& x, const BlockContext& ctx,
                                 std::initializer_list<const at::Tensor*> ws) {
  if (!ctx.fp8_training) return {};
  bool weight_gradients = false;
  for (const at::Tensor* w : ws) weight_gradients = weight_gradients || w->requires_grad();
  return fp8::train_input(x, *ctx.fp8_training, weight_gradients && c10::GradMode::is_enabled());
}

// splitmix64's finaliser on int64 lanes (wrapping multiplies; logical shifts as arithmetic ones masked).
at::Tensor mix64(at::Tensor h) {
  auto shr = [](const at::Tensor& x, int s) {
    return at::bitwise_and(at::bitwise_right_shift(x, s), static_cast<int64_t>((~0ull) >> s));
  };
  h = at::bitwise_xor(h, shr(h, 30)) * static_cast<int64_t>(0xbf58476d1ce4e5b9ull);
  h = at::bitwise_xor(h, shr(h, 27)) * static_cast<int64_t>(0x94d049bb133111ebull);
  return at::bitwise_xor(h, shr(h, 31));
}

// LoRA's dropout of an adapter's input x [T, in] (BlockContext::lora_dropout): each element kept
// with probability 1 - p, by a hash of (seed, layer, module, row from lora_first_row, column), and
// scaled by 1 / (1 - p).
at::Tensor lora_dropout(const at::Tensor& x, const BlockContext& ctx, int64_t layer, size_t module) {
  const double p = ctx.lora_dropout;
  const int64_t rows = x.size(0), cols = x.size(1);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(x.device());
  uint64_t key = static_cast<uint64_t>(ctx.lora_dropout_seed) * 0x9e3779b97f4a7c15ull +
                 static_cast<uint64_t>(layer * kLoraModules + static_cast<int64_t>(module) + 1) * 0xd1b54a32d192ed03ull;
  key ^= key >> 29;
  const at::Tensor at_ = (at::arange(rows, opts) + ctx.lora_first_row).unsqueeze(1) * cols + at::arange(cols, opts);
  const at::Tensor h = mix64(at::bitwise_xor(at_, static_cast<int64_t>(key)));
  const at::Tensor u = at::bitwise_and(h, static_cast<int64_t>((1ull << 53) - 1)).to(at::kDouble) * std::ldexp(1.0, -53);
  return x * (u >= p).to(x.scalar_type()) * (1.0 / (1.0 - p));
}

// y (x's projection by the base weight of `module`) with the layer's LoRA adapter of it added, as
// PEFT adds it: scale * B(A(dropout(x))) in the adapters' dtype, the sum rounded to y's dtype.
at::Tensor with_lora(const at::Tensor& y, const at::Tensor& x, const LayerWeights& w, LoraModule module,
                     const BlockContext& ctx, int64_t layer) {
  const auto m = static_cast<size_t>(module);
  const LoraAdapters& l = w.lora;
  if (ctx.lora_off || !l.a[m].defined()) return y;
  at::Tensor in = x.scalar_type() == l.a[m].scalar_type() ? x : x.to(l.a[m].scalar_type());
  if (ctx.lora_dropout > 0) in = lora_dropout(in, ctx, layer, m);
  const at::Tensor d = project(project(in, l.a[m]), l.b[m]) * l.scale;
  return y.scalar_type() == d.scalar_type() ? y + d : (y.to(d.scalar_type()) + d).to(y.scalar_type());
}

bool has_lora(const LayerWeights& w, const BlockContext& ctx, std::initializer_list<LoraModule> modules) {
  if (ctx.lora_off) return false;
  for (LoraModule m : modules)
    if (w.lora.a[static_cast<size_t>(m)].defined()) return true;
  return false;
}

// x in the adapters' dtype, cast once for the projections of `modules` that share it as input
// (q/k/v, gate/up): autograd keeps one copy for their A gradients instead of one each. x itself
// when none is adapted or the dtypes agree; with_lora casts what it is given no further.
at::Tensor lora_input(const at::Tensor& x, const LayerWeights& w, const BlockContext& ctx,
                      std::initializer_list<LoraModule> modules) {
  if (!has_lora(w, ctx, modules)) return x;
  for (LoraModule m : modules)
    if (const at::Tensor& a = w.lora.a[static_cast<size_t>(m)]; a.defined())
      return x.scalar_type() == a.scalar_type() ? x : x.to(a.scalar_type());
  return x;
}

}  // namespace

namespace {

// Attention over q, k and v ([T, q_size], [T, kv_size] each, or [T, heads, head_dim]): their views
// as heads, the q/k norms and RoPE unless `rotated` says attend_qkv has rotated them, then the
// cache's attention or the varlen one: [T, q_size].
at::Tensor attend(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, at::Tensor q, at::Tensor k,
                  const at::Tensor& v, bool rotated, BlockContext& ctx) {
  const int64_t t = q.size(0);
  const bool rotate = !(ctx.cache && ctx.cache->applies_rope());  // else the cache's attention rotates
  if (!rotated) {
    q = q.view({t, cfg.num_heads, cfg.head_dim});
    k = k.view({t, cfg.num_kv_heads, cfg.head_dim});
    if (cfg.qk_norm) {
      q = rms_norm(q, w.q_norm, cfg.rms_norm_eps);
      k = rms_norm(k, w.k_norm, cfg.rms_norm_eps);
    }
    if (rotate) {
      q = apply_rope(q, ctx.cos, ctx.sin);
      k = apply_rope(k, ctx.cos, ctx.sin);
    }
  }
  VarlenSpec spec = ctx.attn;
  spec.window = cfg.layer_window[layer];
  const double scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
  at::Tensor attn = ctx.cache       ? ctx.cache->attend(layer, q, k, v, spec, scale, ctx.backend)
                   : ctx.attention ? ctx.attention(q, k, v, spec, scale, ctx.backend)
                                   : varlen_attention(q, k, v, spec, scale, ctx.backend);
  return attn.reshape({t, cfg.q_size()});
}

}  // namespace

at::Tensor attend_qkv(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& qkv,
                      BlockContext& ctx) {
  const int64_t t = qkv.size(0);
  const bool rotate = !(ctx.cache && ctx.cache->applies_rope());
  const at::Tensor v = qkv.narrow(1, cfg.q_size() + cfg.kv_size(), cfg.kv_size()).view({t, cfg.num_kv_heads, cfg.head_dim});
  if (!cfg.qk_norm && rotate) {
    // q and k are side by side in each row: one RoPE over [T, heads + kv_heads, head_dim].
    const at::Tensor qk = apply_rope(
        qkv.narrow(1, 0, cfg.q_size() + cfg.kv_size()).view({t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim}),
        ctx.cos, ctx.sin);
    return attend(cfg, layer, w, qk.narrow(1, 0, cfg.num_heads), qk.narrow(1, cfg.num_heads, cfg.num_kv_heads), v,
                  /*rotated=*/true, ctx);
  }
  return attend(cfg, layer, w, qkv.narrow(1, 0, cfg.q_size()), qkv.narrow(1, cfg.q_size(), cfg.kv_size()), v,
                /*rotated=*/false, ctx);
}

namespace {

// The attention sublayer's output projection for normed input h [T, hidden] (before the residual add).
at::Tensor attention_out(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& h,
                         BlockContext& ctx) {
  const int64_t t = h.size(0);
  const at::Tensor hl = lora_input(h, w, ctx, {LoraModule::kQ, LoraModule::kK, LoraModule::kV});
  at::Tensor flat;
  if (w.qkv_proj.defined()) {
    at::Tensor qkv = project(h, w.qkv_proj, w.qkv_bias, &w.qkv_fp8, &ctx);
    if (has_lora(w, ctx, {LoraModule::kQ, LoraModule::kK, LoraModule::kV}))
      qkv = at::cat({with_lora(qkv.narrow(1, 0, cfg.q_size()), hl, w, LoraModule::kQ, ctx, layer),
                     with_lora(qkv.narrow(1, cfg.q_size(), cfg.kv_size()), hl, w, LoraModule::kK, ctx, layer),
                     with_lora(qkv.narrow(1, cfg.q_size() + cfg.kv_size(), cfg.kv_size()), hl, w, LoraModule::kV,
                               ctx, layer)},
                    1);
    flat = attend_qkv(cfg, layer, w, qkv, ctx);
  } else {
    const fp8::TrainInput in = shared_fp8_input(h, ctx, {&w.q_proj, &w.k_proj, &w.v_proj});
    const at::Tensor q = with_lora(project(h, w.q_proj, w.q_bias, nullptr, &ctx, in), hl, w, LoraModule::kQ, ctx, layer);
    const at::Tensor k = with_lora(project(h, w.k_proj, w.k_bias, nullptr, &ctx, in), hl, w, LoraModule::kK, ctx, layer);
    const at::Tensor v = with_lora(project(h, w.v_proj, w.v_bias, nullptr, &ctx, in), hl, w, LoraModule::kV, ctx, layer)
                             .view({t, cfg.num_kv_heads, cfg.head_dim});
    flat = attend(cfg, layer, w, q, k, v, /*rotated=*/false, ctx);
  }
  at::Tensor o = with_lora(project(flat, w.o_proj, {}, &w.o_fp8, &ctx), flat, w, LoraModule::kO, ctx, layer);
  if (ctx.reduce_partial_sums) ctx.reduce_partial_sums(o);
  return o;
}

// The dense SwiGLU MLP of w's gate/up/down projections (a dense layer's, or the shared expert's),
// with its LoRA adapters.
at::Tensor dense_mlp(const LayerWeights& w, const at::Tensor& h, const BlockContext& ctx, int64_t layer) {
  at::Tensor act;
  fp8::TrainInput act_in;  // act's FP8 codes where train_swiglu made them
  if (w.gate_up_proj.defined() && !has_lora(w, ctx, {LoraModule::kGate, LoraModule::kUp})) {
    act = swiglu_packed(project(h, w.gate_up_proj, {}, &w.gate_up_fp8, &ctx));
  } else if (w.gate_up_proj.defined()) {
    const at::Tensor gu = project(h, w.gate_up_proj, {}, &w.gate_up_fp8, &ctx);
    const int64_t i = gu.size(1) / 2;
    const at::Tensor hl = lora_input(h, w, ctx, {LoraModule::kGate, LoraModule::kUp});
    act = swiglu(with_lora(gu.narrow(1, 0, i), hl, w, LoraModule::kGate, ctx, layer),
                 with_lora(gu.narrow(1, i, i), hl, w, LoraModule::kUp, ctx, layer));
  } else {
    const at::Tensor hl = lora_input(h, w, ctx, {LoraModule::kGate, LoraModule::kUp});
    const fp8::TrainInput in = shared_fp8_input(h, ctx, {&w.gate_proj, &w.up_proj});
    if (in.defined() && !has_lora(w, ctx, {LoraModule::kGate, LoraModule::kUp}))
      act = fp8::train_swiglu(h, w.gate_proj, w.up_proj, in, act_in,
                              c10::GradMode::is_enabled() && w.down_proj.requires_grad(), ctx.fp8_fast_accumulation);
    if (!act.defined())
      act = swiglu(with_lora(project(h, w.gate_proj, {}, nullptr, &ctx, in), hl, w, LoraModule::kGate, ctx, layer),
                   with_lora(project(h, w.up_proj, {}, nullptr, &ctx, in), hl, w, LoraModule::kUp, ctx, layer));
  }
  return with_lora(project(act, w.down_proj, {}, &w.down_fp8, &ctx, act_in), act, w, LoraModule::kDown, ctx, layer);
}

// RouterLoss's two losses of one sparse layer over its first `rows` rows; `routed`: each expert's
// routes among them ([experts], on any device).
void add_router_loss(RouterLoss& rl, const at::Tensor& logits, const at::Tensor& probs, const at::Tensor& routed,
                     int64_t rows) {
  if (rows == 0) {
    rl.layer = at::zeros({}, probs.options());
    return;
  }
  const int64_t e = routed.numel();
  // f_e: the share of the rows' routes (they sum to k)
  const at::Tensor f = (routed.to(at::kDouble) / static_cast<double>(rows)).to(probs.device(), at::kFloat);
  const at::Tensor aux = (f * probs.narrow(0, 0, rows).mean(0)).sum() * static_cast<double>(e);
  const at::Tensor z = at::logsumexp(logits.narrow(0, 0, rows).to(at::kFloat), -1).pow(2).mean();
  rl.layer = aux * rl.aux_coef + z * rl.z_coef;
  rl.aux_sum = rl.aux_sum.defined() ? rl.aux_sum + aux.detach() : aux.detach();
  rl.z_sum = rl.z_sum.defined() ? rl.z_sum + z.detach() : z.detach();
}

// The replayed experts of sparse layer `layer` (ctx.replay_routes, checked here) written over the
// rows of `ix` ([t, k] int64 on the host) that the engine computed; whether there was one.
bool take_replayed_routes(const ModelConfig& cfg, int64_t layer, const BlockContext& ctx, int64_t t, int64_t k,
                          int64_t e_count, int64_t* ix) {
  if (!ctx.replay_routes.defined()) return false;
  const at::Tensor& r = ctx.replay_routes;
  const int64_t s = sparse_index(cfg, layer);
  TILLER_CHECK(r.dim() == 3 && r.size(0) == t && r.size(1) > s && r.size(2) == k && r.scalar_type() == at::kShort &&
                   r.device().is_cpu() && r.is_contiguous(),
               "replayed routes (int16 [rows, sparse layers, k] on the host; got {} dims of {}) do not fit {} rows "
               "of {} experts in sparse layer {}",
               r.dim(), r.numel(), t, k, s);
  const int16_t* rp = r.data_ptr<int16_t>();
  const int64_t row_stride = r.size(1) * k;
  bool replayed = false;
  for (int64_t i = 0; i < t; ++i) {
    const int16_t* e = rp + i * row_stride + s * k;
    if (e[0] < 0) continue;  // a token the engine never computed: its own routes
    for (int64_t j = 0; j < k; ++j) {
      TILLER_CHECK(e[j] >= 0 && e[j] < e_count, "replayed route {} of row {} in sparse layer {}: expert {} of {}", j,
                   i, s, e[j], e_count);
      ix[i * k + j] = e[j];
    }
    replayed = true;
  }
  return replayed;
}

// Adds one sparse layer's routes per expert (`routed`, [experts]) to ctx.expert_load, which is
// created on `routed`'s device at the first sparse layer.
void add_expert_load(const ModelConfig& cfg, int64_t layer, BlockContext& ctx, const at::Tensor& routed) {
  at::Tensor& load = *ctx.expert_load;
  const int64_t e_count = routed.numel();
  if (!load.defined()) load = at::zeros({sparse_layers(cfg), e_count}, routed.options().dtype(at::kDouble));
  TILLER_CHECK(load.dim() == 2 && load.size(0) == sparse_layers(cfg) && load.size(1) == e_count,
               "expert_load holds {} numbers, the model has {} sparse layers of {} experts", load.numel(),
               sparse_layers(cfg), e_count);
  load.select(0, sparse_index(cfg, layer)).add_(routed.to(load.device(), at::kDouble));
}

// What a sparse layer reports of its routes ([T, k] int64): the expert load and the router losses
// over the first `counted` rows (`routed`: each expert's routes among them; needed only when
// either is asked for), and the routes themselves.
void report_routes(const ModelConfig& cfg, int64_t layer, BlockContext& ctx, const at::Tensor& logits,
                   const at::Tensor& probs, const at::Tensor& routed, int64_t counted, const at::Tensor& routes) {
  if (ctx.expert_load) add_expert_load(cfg, layer, ctx, routed);
  if (ctx.router_loss) add_router_loss(*ctx.router_loss, logits, probs, routed, counted);
  if (ctx.recorded_routes) {
    TILLER_CHECK(static_cast<int64_t>(ctx.recorded_routes->size()) > layer, "recorded_routes has {} entries, layer {}",
                 ctx.recorded_routes->size(), layer);
    (*ctx.recorded_routes)[static_cast<size_t>(layer)] = routes;
  }
}

// The experts' combining weights from the router's probabilities at the experts taken [T, k]:
// renormalised with norm_topk_prob, rounded to the compute dtype except in mixtral.
at::Tensor expert_weights(const ModelConfig& cfg, at::Tensor top, at::ScalarType dtype) {
  if (cfg.norm_topk_prob) top = top / top.sum(-1, true);
  if (cfg.family != Family::kMixtral) top = top.to(dtype);
  return top;
}

// The grouped path of moe_mlp (grouped_experts()): the routes stay on the device. The token slots
// are sorted by expert (stable: token order within each expert), each expert's end offset found
// by a binary search, the gate/up and down projections run as grouped GEMMs over the sorted slots
// (at::_grouped_mm: one kernel for all experts, no host sync, so a CUDA graph can capture it),
// and each token sums its k outputs times their weights (in fp32 for bf16 outputs: a reduction,
// so no atomics and the same order every run).
at::Tensor grouped_moe(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& h,
                       BlockContext& ctx, const at::Tensor& logits, const at::Tensor& probs, at::Tensor top,
                       at::Tensor index) {
  const int64_t t = h.size(0), k = cfg.experts_per_token, e_count = static_cast<int64_t>(w.experts.size());
  if (ctx.replay_routes.defined()) {
    std::vector<int64_t> replay(static_cast<size_t>(t * k), -1);
    if (take_replayed_routes(cfg, layer, ctx, t, k, e_count, replay.data())) {
      const at::Tensor r = upload(replay, h.device()).view({t, k});
      index = at::where(r >= 0, r, index);
      top = probs.gather(1, index);
    }
  }
  const int64_t counted = ctx.routed_rows < 0 ? t : std::min(t, ctx.routed_rows);
  at::Tensor routed;
  if (ctx.expert_load || ctx.router_loss) {
    const at::Tensor slots = index.narrow(0, 0, counted).reshape({counted * k});
    routed = at::zeros({e_count}, probs.options().dtype(at::kDouble))
                 .index_add_(0, slots, at::ones({counted * k}, probs.options().dtype(at::kDouble)));
  }
  report_routes(cfg, layer, ctx, logits, probs, routed, counted, index);
  const at::Tensor flat = index.reshape({t * k});
  const auto sorted = at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& experts = std::get<0>(sorted);
  const at::Tensor& order = std::get<1>(sorted);  // the slots (token * k + j), grouped by expert
  // Each expert's end in the sorted slots (int32, as _grouped_mm takes them).
  const at::Tensor ends = at::searchsorted(experts, at::arange(e_count, flat.options()), /*out_int32=*/true,
                                           /*right=*/true);
  const at::Tensor x = h.index_select(0, at::div(order, k, "trunc"));
  at::Tensor act;
  if (w.experts_gate_up.defined() && !c10::GradMode::is_enabled()) {  // the engine's stacked weights
    act = swiglu_packed(at::_grouped_mm(x, w.experts_gate_up.transpose(1, 2), ends));
  } else {
    std::vector<at::Tensor> gate, up;
    for (const ExpertWeights& e : w.experts) {
      gate.push_back(e.gate_proj);
      up.push_back(e.up_proj);
    }
    act = swiglu(at::_grouped_mm(x, at::stack(gate).transpose(1, 2), ends),
                 at::_grouped_mm(x, at::stack(up).transpose(1, 2), ends));
  }
  at::Tensor down = w.experts_down;
  if (!down.defined() || c10::GradMode::is_enabled()) {
    std::vector<at::Tensor> d;
    for (const ExpertWeights& e : w.experts) d.push_back(e.down_proj);
    down = at::stack(d);
  }
  const at::Tensor y = at::_grouped_mm(act, down.transpose(1, 2), ends);  // [T k, hidden], sorted slots
  // Back to slot order: slot i's output is row inverse[i] of y.
  const at::Tensor inverse = at::empty_like(order).scatter_(0, order, at::arange(t * k, order.options()));
  const at::Tensor weights = expert_weights(cfg, top, h.scalar_type());
  const at::Tensor per_slot = y.index_select(0, inverse).view({t, k, h.size(1)}) * weights.unsqueeze(-1);
  const bool half = per_slot.scalar_type() == at::kBFloat16 || per_slot.scalar_type() == at::kHalf;
  at::Tensor out = (half ? per_slot.sum(at::IntArrayRef{1}, false, at::kFloat) : per_slot.sum(1)).to(h.scalar_type());
  if (w.shared_expert_gate.defined()) out = out + at::sigmoid(project(h, w.shared_expert_gate)) * dense_mlp(w, h, ctx, layer);
  return out;
}

// A sparse layer's MLP, as transformers computes it: the router's softmax (fp32) picks each token's
// top-k experts (weights renormalised with norm_topk_prob; rounded to the compute dtype except in
// mixtral); each expert runs on its tokens, scaled by their weights, and the experts' outputs are
// added in expert order; qwen2_moe adds the shared expert behind its sigmoid gate. With
// ctx.replay_routes the experts are the replayed ones (BlockContext); ctx.recorded_routes gets them;
// ctx.expert_load counts them and ctx.router_loss gets the layer's router losses. The experts run
// grouped (grouped_moe) where grouped_experts() says so, else in the loop below.
at::Tensor moe_mlp(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& h,
                   BlockContext& ctx) {
  const int64_t t = h.size(0), k = cfg.experts_per_token, e_count = static_cast<int64_t>(w.experts.size());
  const at::Tensor logits = project(h, w.router);
  const at::Tensor probs =
      batch_invariant() ? invariant::softmax(logits.to(at::kFloat)) : at::softmax(logits.to(at::kFloat), -1);
  auto [top, index] = probs.topk(k, -1);  // [T, k]
  if (t > 0 && grouped_experts(cfg, h.scalar_type(), h.device()))
    return grouped_moe(cfg, layer, w, h, ctx, logits, probs, top, index);
  // The loop: the routes on the host (one copy down), grouped there with the replayed routes, and
  // up again once.
  at::Tensor host = index.to(at::kCPU, at::kLong).contiguous();
  int64_t* ix = host.data_ptr<int64_t>();
  // Then the router's probabilities at the replayed experts weight them.
  const bool replayed = take_replayed_routes(cfg, layer, ctx, t, k, e_count, ix);
  // Each expert's routes among the counted rows (the expert load's and the router losses').
  const int64_t counted = ctx.routed_rows < 0 ? t : std::min(t, ctx.routed_rows);
  at::Tensor routed;
  if (ctx.expert_load || ctx.router_loss) {
    routed = at::zeros({e_count}, at::kDouble);
    double* r = routed.data_ptr<double>();
    for (int64_t i = 0; i < counted * k; ++i) {
      TILLER_CHECK(ix[i] >= 0 && ix[i] < e_count, "router chose expert {} of {}", ix[i], e_count);
      r[ix[i]] += 1;
    }
  }
  report_routes(cfg, layer, ctx, logits, probs, routed, counted, host);
  // Each expert's tokens (rows of h) and their slots in `top`, grouped by expert.
  std::vector<int64_t> count(static_cast<size_t>(e_count) + 1, 0);
  for (int64_t i = 0; i < t * k; ++i) {
    TILLER_CHECK(ix[i] >= 0 && ix[i] < e_count, "router chose expert {} of {}", ix[i], e_count);
    ++count[static_cast<size_t>(ix[i]) + 1];
  }
  for (size_t e = 1; e < count.size(); ++e) count[e] += count[e - 1];  // each expert's first position
  // [rows | slots] by expert, then (replay) the routes taken
  std::vector<int64_t> grouped(static_cast<size_t>((replayed ? 3 : 2) * t * k));
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < t * k; ++i) {  // token order within each expert, as transformers
    const auto at = static_cast<size_t>(next[static_cast<size_t>(ix[i])]++);
    grouped[at] = i / k;
    grouped[at + static_cast<size_t>(t * k)] = i;
  }
  if (replayed) std::copy(ix, ix + t * k, grouped.begin() + 2 * t * k);
  const at::Tensor dev = upload(grouped, h.device());
  // The router's probabilities at the experts taken (the gradient reaches the router through them).
  if (replayed) top = probs.gather(1, dev.narrow(0, 2 * t * k, t * k).view({t, k}));
  const at::Tensor weights = expert_weights(cfg, top, h.scalar_type()).reshape({t * k});
  at::Tensor out = at::zeros_like(h);
  for (int64_t e = 0; e < e_count; ++e) {
    const int64_t first = count[static_cast<size_t>(e)], n = count[static_cast<size_t>(e) + 1] - first;
    if (n == 0) continue;
    const ExpertWeights& ex = w.experts[static_cast<size_t>(e)];
    const at::Tensor r = dev.narrow(0, first, n);
    const at::Tensor x = h.index_select(0, r);
    // The routed experts stay in the weights' dtype with FP8 training too, as on the grouped path.
    at::Tensor y = project(swiglu(project(x, ex.gate_proj), project(x, ex.up_proj)), ex.down_proj);
    y = y * weights.index_select(0, dev.narrow(0, t * k + first, n)).unsqueeze(1);
    out = out.index_add(0, r, y.to(h.scalar_type()));
  }
  if (w.shared_expert_gate.defined()) out = out + at::sigmoid(project(h, w.shared_expert_gate)) * dense_mlp(w, h, ctx, layer);
  return out;
}

// The MLP's output for normed input h (before the residual add).
at::Tensor mlp_out(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& h,
                   BlockContext& ctx) {
  at::Tensor mlp = w.router.defined() ? moe_mlp(cfg, layer, w, h, ctx) : dense_mlp(w, h, ctx, layer);
  if (ctx.reduce_partial_sums) ctx.reduce_partial_sums(mlp);
  return mlp;
}

}  // namespace

at::Tensor block_forward(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& x,
                         BlockContext& ctx) {
  if (!ctx.fuse_residual) return mlp_residual(cfg, layer, w, attention_residual(cfg, layer, w, x, ctx), ctx);
  if (x.size(0) > 0 && fp8_fused_block(w, ctx)) return fp8_block_forward(cfg, layer, w, x, ctx);
  at::Tensor stream = x;  // the residual stream, updated in place
  at::Tensor h;
  if (ctx.deferred.defined()) {
    h = add_rms_norm(stream, take_deferred(ctx), w.input_norm, cfg.rms_norm_eps);
  } else {
    h = rms_norm(x, w.input_norm, cfg.rms_norm_eps);
  }
  const at::Tensor o = attention_out(cfg, layer, w, h, ctx);
  h = add_rms_norm(stream, o, w.post_attn_norm, cfg.rms_norm_eps);
  ctx.deferred = mlp_out(cfg, layer, w, h, ctx);
  return stream;
}

at::Tensor attention_residual(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& x,
                              BlockContext& ctx) {
  TILLER_CHECK(!ctx.fuse_residual && !ctx.deferred.defined(), "attention_residual: not with fuse_residual");
  return x + attention_out(cfg, layer, w, rms_norm(x, w.input_norm, cfg.rms_norm_eps), ctx);
}

at::Tensor mlp_residual(const ModelConfig& cfg, int64_t layer, const LayerWeights& w, const at::Tensor& y,
                        BlockContext& ctx) {
  TILLER_CHECK(!ctx.fuse_residual, "mlp_residual: not with fuse_residual");
  return y + mlp_out(cfg, layer, w, rms_norm(y, w.post_attn_norm, cfg.rms_norm_eps), ctx);
}

namespace {
std::atomic<ExpertKernels> g_expert_kernels{ExpertKernels::kAuto};
}  // namespace

void set_expert_kernels(ExpertKernels k) { g_expert_kernels.store(k, std::memory_order_relaxed); }
ExpertKernels expert_kernels() { return g_expert_kernels.load(std::memory_order_relaxed); }

bool grouped_experts(const ModelConfig& cfg, at::ScalarType dtype, const at::Device& device) {
  const ExpertKernels k = expert_kernels();
  if (!cfg.moe() || batch_invariant() || k == ExpertKernels::kLoop) return false;
  if (device.is_cpu()) return k == ExpertKernels::kGrouped;
  // CUTLASS's grouped GEMM in ATen: bf16, rows of 16-byte multiples, on Hopper or newer (older
  // GPUs get ATen's fallback, a loop that reads the offsets on the host).
  if (!device.is_cuda() || dtype != at::kBFloat16 || cfg.hidden_size % 8 || cfg.moe_intermediate_size % 8) return false;
#ifdef TILLER_HAVE_CUDA_KERNELS
  int index = device.index();
  if (index < 0) TILLER_CHECK(cudaGetDevice(&index) == cudaSuccess, "cudaGetDevice failed");
  static std::array<std::atomic<int>, 64> majors{};  // each GPU's compute capability, once read (0: not yet)
  TILLER_CHECK(index >= 0 && index < static_cast<int>(majors.size()), "GPU index {} out of range", index);
  int major = majors[static_cast<size_t>(index)].load(std::memory_order_relaxed);
  if (major == 0) {
    TILLER_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) == cudaSuccess,
                 "cudaDeviceGetAttribute(compute capability) failed for GPU {}", index);
    majors[static_cast<size_t>(index)].store(major, std::memory_order_relaxed);
  }
  return major >= 9;
#else
  return false;
#endif
}

int64_t sparse_index(const ModelConfig& cfg, int64_t layer) {
  int64_t n = 0;
  for (int64_t i = 0; i < layer; ++i) n += cfg.sparse_layer(i) ? 1 : 0;
  return n;
}

int64_t sparse_layers(const ModelConfig& cfg) { return sparse_index(cfg, cfg.num_layers); }

void add_deferred(at::Tensor& x, BlockContext& ctx) {
  if (ctx.deferred.defined()) x.add_(take_deferred(ctx));
}

at::Tensor take_deferred(BlockContext& ctx) {
  at::Tensor d = std::move(ctx.deferred);
  ctx.deferred = at::Tensor();
  if (ctx.deferred_scale.defined()) {
    fp8::scale_rows_(d, ctx.deferred_scale);
    ctx.deferred_scale = at::Tensor();
  }
  return d;
}

at::Tensor final_norm(const ModelConfig& cfg, const at::Tensor& weight, const at::Tensor& x) {
  return rms_norm(x, weight, cfg.rms_norm_eps);
}

at::Tensor forward_hidden(const ModelConfig& cfg, const ModelWeights& w, const PackedBatch& batch, DenseKvCache* cache,
                          AttentionBackend backend, std::optional<fp8::Scaling> fp8_training,
                          bool fp8_fast_accumulation) {
  TILLER_CHECK(static_cast<int64_t>(w.layers.size()) == cfg.num_layers, "weights have {} layers, config {}",
               w.layers.size(), cfg.num_layers);
  const Rope rope(cfg);
  BlockContext ctx = make_block_context(cfg, rope, batch, w.embed.scalar_type(), cache, backend);
  ctx.fp8_training = fp8_training;
  ctx.fp8_fast_accumulation = fp8_fast_accumulation;
  at::Tensor x = embed(w.embed, batch.tokens);
  for (int64_t i = 0; i < cfg.num_layers; ++i) x = block_forward(cfg, i, w.layers[i], x, ctx);
  return final_norm(cfg, w.final_norm, x);
}

at::Tensor logits(const at::Tensor& hidden, const at::Tensor& lm_head) {
  return at::matmul(hidden, lm_head.t()).to(at::kFloat);
}

at::Tensor lm_logits(const at::Tensor& hidden, const at::Tensor& lm_head) {
  if (batch_invariant()) return invariant::linear(hidden, lm_head);
  return at::matmul(hidden, lm_head.t());
}

at::Tensor values(const at::Tensor& hidden, const at::Tensor& score) {
  // algo.logprob_match = bitwise: each value one dot product in one order whatever the batch, so
  // that a critic's values (and the returns and advantages made from them) do not depend on how its
  // scoring packed the samples; the ordinary CPU matmul's rows change with M (31 of 37 rows of a
  // [37, 72] x [72, 1] product against one row at a time). On CUDA one thread block a row
  // (invariant_row_dot).
  if (batch_invariant()) return invariant::linear(hidden, score).squeeze(-1).to(at::kFloat);
  return at::matmul(hidden, score.t()).squeeze(-1).to(at::kFloat);
}

}  // namespace tiller::model
