// The autograd segments of a ShardedModel (sharded_model_impl.h): one torch::autograd::Function
// per unit (embedding, each block, the LM or value head), so that the backward gathers each unit
// again, recomputes what the recompute mode did not keep, and reduce-scatters its gradient.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "zero/sharded_model_impl.h"

namespace tiller::zero {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Impl = ShardedModel::Impl;

// The model travels with the autograd node as an integer (the model must outlive its graphs),
// beside the tensors the segment's backward reads.
void remember(AutogradContext* ctx, Impl* m, const variable_list& saved) {
  ctx->saved_data["impl"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(m));
  ctx->save_for_backward(saved);
}
Impl* impl_of(AutogradContext* ctx) {
  return reinterpret_cast<Impl*>(static_cast<intptr_t>(ctx->saved_data["impl"].toInt()));
}

// Leaves sharing storage with `views`, for recomputation under autograd.
std::vector<at::Tensor> leaves(const std::vector<at::Tensor>& views) {
  std::vector<at::Tensor> out;
  out.reserve(views.size());
  for (const auto& v : views) out.push_back(v.detach().requires_grad_(true));
  return out;
}
NamedTensors named(const FlatLayout& layout, const std::vector<at::Tensor>& ts) {
  NamedTensors out;
  for (size_t i = 0; i < ts.size(); ++i) out.emplace(layout.params()[i].spec.name, ts[i]);
  return out;
}
// Gradients of `out` (with incoming gradient `grad_out`) w.r.t. `inputs`; undefined where unused.
variable_list grads_of(const at::Tensor& out, const variable_list& inputs, const at::Tensor& grad_out) {
  if (!out.requires_grad()) return variable_list(inputs.size());
  return torch::autograd::grad({out}, inputs, {grad_out}, /*retain_graph=*/false, /*create_graph=*/false,
                               /*allow_unused=*/true);
}
// The same for a block's output and, when the block has one, its router loss (`loss`, a scalar,
// with incoming gradient `grad_loss`): one backward through both.
variable_list grads_of(const at::Tensor& out, const at::Tensor& loss, const variable_list& inputs,
                       const at::Tensor& grad_out, const at::Tensor& grad_loss) {
  if (!loss.defined() || !loss.requires_grad() || !grad_loss.defined()) return grads_of(out, inputs, grad_out);
  if (!out.requires_grad()) return torch::autograd::grad({loss}, inputs, {grad_loss}, false, false, true);
  return torch::autograd::grad({out, loss}, inputs, {grad_out, grad_loss}, /*retain_graph=*/false,
                               /*create_graph=*/false, /*allow_unused=*/true);
}

// Segment 0: token ids -> embeddings.
struct EmbedSegment : public torch::autograd::Function<EmbedSegment> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& anchor, Impl* m, const at::Tensor& tokens) {
    remember(ctx, m, {tokens});
    return m->embed_forward(tokens);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Impl* m = impl_of(ctx);
    const at::Tensor tokens = ctx->get_saved_variables()[0];
    m->begin_backward(0);
    if (!m->embed_backward_reads_weights()) {
      // Each token's row of the output gradient added to its row of the fp32 buffer (as autograd's
      // embedding backward adds them on the CPU), with no [vocab, hidden] gradient in between.
      Impl::GradBuffer b = m->grad_buffer(0);
      at::Tensor g = m->accumulate_into(b, m->param_index(0, "model.embed_tokens.weight"));
      if (grads[0].defined() && tokens.numel() > 0)
        g.index_add_(0, tokens.reshape({-1}), grads[0].reshape({-1, g.size(1)}).to(at::kFloat));
      m->submit(std::move(b));
      return {at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto views = m->units[0].layout.views(m->acquire(0));
    auto params = leaves(views);
    at::Tensor y;
    {
      at::AutoGradMode on(true);
      y = model::embed(params[0], tokens);
    }
    m->reduce(0, grads_of(y, params, grads[0]));
    m->release_segment(0);
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Frees the memory of a gathered unit whose views an autograd graph keeps (the kept activations
// of Recompute::kAttentionOnly / kNone): the storage object stays, its bytes go back to the
// allocator. On CUDA the allocator orders their reuse after the kernels already queued that read
// them (same stream), and after the gather's stream (recorded by the communicator).
void park(const at::Tensor& full) {
  c10::Storage st = full.storage();
  st.set_data_ptr_noswap(at::DataPtr(nullptr, full.device()));
  st.set_nbytes(0);
}
// Gives a parked unit's storage the bytes of a fresh gather of the same unit.
void unpark(const at::Tensor& parked, const at::Tensor& fresh) {
  c10::Storage from = fresh.storage();
  c10::Storage to = parked.storage();
  const size_t n = from.nbytes();
  TILLER_CHECK(to.nbytes() == 0, "a parked unit that still holds memory");
  to.set_data_ptr_noswap(from.set_data_ptr(at::DataPtr(nullptr, fresh.device())));
  to.set_nbytes(n);
  from.set_nbytes(0);
}

// The context a block's backward recomputes it in: RoPE tables, the packing, and what the forward
// saved of the replayed routes, the router losses' rows and the adapters' switch and dropout.
model::BlockContext recompute_context(Impl* m, AutogradContext* ctx, const variable_list& saved,
                                      const std::vector<int64_t>& lens) {
  model::BlockContext bctx = m->block_context(saved[1], saved[2], saved[3], lens);
  bctx.replay_routes = ctx->saved_data["routes"].toTensor();
  bctx.routed_rows = ctx->saved_data["routed_rows"].toInt();
  bctx.lora_off = ctx->saved_data["lora_off"].toBool();
  bctx.lora_dropout = ctx->saved_data["lora_dropout"].toDouble();
  bctx.lora_dropout_seed = ctx->saved_data["lora_seed"].toInt();
  bctx.lora_first_row = ctx->saved_data["lora_first_row"].toInt();
  return bctx;
}

// Segment 1 + layer: one transformer block. With Recompute::kBlocks only its input is saved and
// the backward recomputes the whole block; with kNone the forward records the block's graph and
// the backward runs it; with kAttentionOnly the forward runs the attention half without autograd
// and records the MLP half's graph, and the backward runs that graph, then recomputes the
// attention half. A sparse layer with router losses on (block->router_loss) has a second output,
// its router loss (a scalar), and the backward takes both outputs' gradients in one pass.
struct BlockSegment : public torch::autograd::Function<BlockSegment> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& anchor, Impl* m, int64_t layer,
                               const at::Tensor& x, const model::BlockContext* block) {
    remember(ctx, m, {x, block->cos, block->sin, block->attn.cu_q});
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["lens"] = block->attn.lens_q;
    ctx->saved_data["routes"] = block->replay_routes;  // routing replay: the recomputation routes alike
    ctx->saved_data["routed_rows"] = block->routed_rows;  // the recomputed router loss counts the same rows
    // LoRA: the recomputation runs the adapters (off or on) with the same dropout masks.
    ctx->saved_data["lora_off"] = block->lora_off;
    ctx->saved_data["lora_dropout"] = block->lora_dropout;
    ctx->saved_data["lora_seed"] = block->lora_dropout_seed;
    ctx->saved_data["lora_first_row"] = block->lora_first_row;
    const bool router = block->router_loss != nullptr && m->cfg.sparse_layer(layer);
    ctx->saved_data["router"] = router;
    model::BlockContext bctx = *block;
    if (router) block->router_loss->layer = at::Tensor();
    // The layer's router loss (detached: the output), a zero when the block computed none (no rows).
    auto outputs = [&](const at::Tensor& y) -> variable_list {
      if (!router) return {y};
      const at::Tensor l = block->router_loss->layer;
      return {y, l.defined() ? l.detach() : at::zeros({}, y.options().dtype(at::kFloat))};
    };
    const int64_t kept = m->opts.recompute_layers;
    const Recompute mode = kept < 0 || layer < kept ? m->opts.recompute : Recompute::kBlocks;
    if (mode == Recompute::kBlocks || x.size(0) == 0) return outputs(m->block_forward(layer, x, bctx));
    const size_t s = static_cast<size_t>(layer) + 1;
    m->prefetch_segment(s);
    m->prefetch_segment(s + 1);
    const at::Tensor full = m->acquire(s);
    // A LoRA model's graph takes the adapters as its leaves; the frozen base's views take none.
    std::vector<at::Tensor> params = m->lora ? m->units[s].layout.views(full) : leaves(m->units[s].layout.views(full));
    const std::vector<at::Tensor> adapters = m->lora ? m->layer_adapters(layer, true) : std::vector<at::Tensor>{};
    const model::LayerWeights w = m->layer_weights(layer, s, params, m->lora ? &adapters : nullptr);
    at::Tensor y, kept_in;  // the recorded graph's output and input
    {
      at::AutoGradMode on(true);
      if (mode == Recompute::kNone) {
        kept_in = x.detach().requires_grad_(true);
        y = model::block_forward(m->cfg, layer, w, kept_in, bctx);
      } else {
        at::Tensor a;
        {
          at::AutoGradMode off(false);
          a = model::attention_residual(m->cfg, layer, w, x, bctx);
        }
        kept_in = a.requires_grad_(true);
        y = model::mlp_residual(m->cfg, layer, w, kept_in, bctx);
      }
    }
    ctx->saved_data["attention_half"] = mode == Recompute::kAttentionOnly;  // recomputed in the backward
    ctx->saved_data["kept_out"] = y;
    ctx->saved_data["kept_in"] = kept_in;
    ctx->saved_data["params"] = params;
    ctx->saved_data["adapters"] = adapters;
    if (router) ctx->saved_data["kept_loss"] = block->router_loss->layer;  // in the recorded graph
    if (m->transient(s)) park(full);
    m->release_segment(s);
    return outputs(y.detach());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Impl* m = impl_of(ctx);
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const auto lens = ctx->saved_data["lens"].toIntVector();
    const auto saved = ctx->get_saved_variables();
    const size_t s = static_cast<size_t>(layer) + 1;
    m->begin_backward(s);
    const at::Tensor full = m->acquire(s);
    at::Tensor x = saved[0].detach().requires_grad_(true);
    variable_list g;
    at::Tensor gx;
    const bool router = ctx->saved_data["router"].toBool();
    const at::Tensor grad_loss = router ? grads[1] : at::Tensor();
    if (ctx->saved_data.count("kept_out")) {
      const at::Tensor y = ctx->saved_data["kept_out"].toTensor();
      const at::Tensor kept_in = ctx->saved_data["kept_in"].toTensor();
      variable_list params = ctx->saved_data["params"].toTensorVector();
      const variable_list adapters = ctx->saved_data["adapters"].toTensorVector();
      const at::Tensor loss = router ? ctx->saved_data["kept_loss"].toTensor() : at::Tensor();
      ctx->saved_data.erase("kept_out");
      ctx->saved_data.erase("kept_in");
      ctx->saved_data.erase("params");
      ctx->saved_data.erase("adapters");
      ctx->saved_data.erase("kept_loss");
      if (m->transient(s)) unpark(params.front(), full);
      variable_list inputs = m->lora ? adapters : params;  // what trains: the adapters, or the block
      inputs.push_back(kept_in);
      g = grads_of(y, loss, inputs, grads[0], grad_loss);
      at::Tensor g_in = g.back();
      g.pop_back();
      if (!ctx->saved_data["attention_half"].toBool()) {
        gx = g_in;
      } else if (g_in.defined()) {  // kAttentionOnly: through the attention half, recomputed
        at::Tensor a;
        {
          at::AutoGradMode on(true);
          auto bctx = recompute_context(m, ctx, saved, lens);
          a = model::attention_residual(m->cfg, layer, m->layer_weights(layer, s, params, m->lora ? &adapters : nullptr),
                                        x, bctx);
        }
        inputs = m->lora ? adapters : params;
        inputs.push_back(x);
        variable_list ga = grads_of(a, inputs, g_in);
        gx = ga.back();
        for (size_t i = 0; i < g.size(); ++i)
          if (ga[i].defined()) g[i] = g[i].defined() ? g[i] + ga[i] : ga[i];
      }
    } else {
      auto params = m->lora ? m->units[s].layout.views(full) : leaves(m->units[s].layout.views(full));
      const std::vector<at::Tensor> adapters = m->lora ? m->layer_adapters(layer, true) : std::vector<at::Tensor>{};
      at::Tensor y;
      // The recomputed router loss; its statistics were counted by the forward.
      model::RouterLoss recomputed{m->opts.router_aux_coef, m->opts.router_z_coef, {}, {}, {}};
      {
        at::AutoGradMode on(true);
        auto bctx = recompute_context(m, ctx, saved, lens);
        if (router) bctx.router_loss = &recomputed;
        y = m->run_block(layer, params, x, bctx, m->lora ? &adapters : nullptr);
      }
      variable_list inputs = m->lora ? adapters : params;
      inputs.push_back(x);
      g = grads_of(y, recomputed.layer, inputs, grads[0], grad_loss);
      gx = g.back();
      g.pop_back();
    }
    if (m->lora) m->accumulate_adapters(layer, g);  // the frozen base has no gradient
    else m->reduce(s, g);
    m->release_segment(s);
    if (!gx.defined()) gx = at::zeros_like(saved[0]);
    return {at::Tensor(), at::Tensor(), at::Tensor(), gx, at::Tensor()};
  }
};

// The last segment, LM head: final norm -> log-probs of the targets. Its backward does not
// re-run the chunked log-prob forward: token_logprobs_backward recomputes the logits itself.
// Outputs the log-probs and, when asked for, the entropies; both differentiable.
struct LmHeadSegment : public torch::autograd::Function<LmHeadSegment> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& anchor, Impl* m, const at::Tensor& x,
                               const at::Tensor& targets, double temperature, bool want_entropy) {
    remember(ctx, m, {x, targets});
    ctx->set_materialize_grads(false);
    ctx->saved_data["temperature"] = temperature;
    at::Tensor entropy;
    at::Tensor logp = m->lm_head_forward(x, targets, temperature, want_entropy ? &entropy : nullptr);
    if (want_entropy) return {logp, entropy};
    return {logp};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Impl* m = impl_of(ctx);
    const auto saved = ctx->get_saved_variables();
    const size_t s = m->head_unit();
    m->begin_backward(s);
    if (m->lora) return lora_backward(m, ctx, saved, grads);
    const FlatLayout& hl = m->units[s].layout;
    auto head = leaves(hl.views(m->acquire(s)));
    const NamedTensors embed = m->tied_lm() ? m->named_views(0, m->acquire(0)) : NamedTensors{};
    const NamedTensors head_named = named(hl, head);
    at::Tensor x = saved[0].detach().requires_grad_(true);
    at::Tensor norm_w = head_named.at("model.norm.weight");
    at::Tensor h;
    {
      at::AutoGradMode on(true);
      h = model::final_norm(m->cfg, norm_w, x);
    }
    const at::Tensor w = m->lm_weight(head_named, embed).detach();
    // With an fp32 reduction the [vocab, hidden] weight gradient accumulates straight into its
    // slot of the reduction buffer (the embedding's, when tied).
    const bool into = m->opts.reduce_dtype == at::kFloat;
    Impl::GradBuffer hb = m->grad_buffer(s);
    std::optional<Impl::GradBuffer> eb;
    at::Tensor gw_into;
    if (into && m->tied_lm()) {
      eb = m->grad_buffer(0);
      gw_into = m->accumulate_into(*eb, m->param_index(0, "model.embed_tokens.weight"));
    } else if (into) {
      gw_into = m->accumulate_into(hb, m->param_index(s, "lm_head.weight"));
    }
    auto [gh, gw] = model::token_logprobs_backward(h.detach(), w, saved[1], grads[0],
                                                   ctx->saved_data["temperature"].toDouble(),
                                                   m->opts.logprob_chunk_rows, true, true, /*fp32_weight_grad=*/true,
                                                   grads.size() > 1 ? grads[1] : at::Tensor(), gw_into);
    variable_list g = grads_of(h, {x, norm_w}, gh);
    std::vector<at::Tensor> head_grads(head.size());
    for (size_t i = 0; i < head.size(); ++i) {
      const std::string& name = hl.params()[i].spec.name;
      if (name == "model.norm.weight") head_grads[i] = g[1];
      else if (name == "lm_head.weight" && !into) head_grads[i] = gw;
    }
    m->set_grads(hb, head_grads);
    m->submit(std::move(hb));
    if (eb) m->submit(std::move(*eb));
    else if (m->tied_lm()) m->reduce(0, {gw});
    m->release_segment(s);
    at::Tensor gx = g[0].defined() ? g[0] : at::zeros_like(saved[0]);
    return {at::Tensor(), at::Tensor(), gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
  // A LoRA model's frozen head: the gradient of its input alone, no weight gradient computed.
  static variable_list lora_backward(Impl* m, AutogradContext* ctx, const variable_list& saved,
                                     const variable_list& grads) {
    const size_t s = m->head_unit();
    const NamedTensors head = m->named_views(s, m->acquire(s));
    const NamedTensors embed = m->tied_lm() ? m->named_views(0, m->acquire(0)) : NamedTensors{};
    at::Tensor x = saved[0].detach().requires_grad_(true);
    at::Tensor h;
    {
      at::AutoGradMode on(true);
      h = model::final_norm(m->cfg, head.at("model.norm.weight"), x);
    }
    auto [gh, unused] = model::token_logprobs_backward(
        h.detach(), m->lm_weight(head, embed), saved[1], grads[0], ctx->saved_data["temperature"].toDouble(),
        m->opts.logprob_chunk_rows, /*need_hidden=*/true, /*need_weight=*/false, /*fp32_weight_grad=*/true,
        grads.size() > 1 ? grads[1] : at::Tensor());
    const variable_list g = grads_of(h, {x}, gh);
    m->release_segment(s);
    at::Tensor gx = g[0].defined() ? g[0] : at::zeros_like(saved[0]);
    return {at::Tensor(), at::Tensor(), gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The last segment, value head: final norm -> score.
struct ValueHeadSegment : public torch::autograd::Function<ValueHeadSegment> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& anchor, Impl* m, const at::Tensor& x) {
    remember(ctx, m, {x});
    return m->value_head_forward(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Impl* m = impl_of(ctx);
    const at::Tensor x0 = ctx->get_saved_variables()[0];
    const size_t s = m->head_unit();
    m->begin_backward(s);
    if (m->lora) return lora_backward(m, x0, grads[0]);
    const FlatLayout& hl = m->units[s].layout;
    auto head = leaves(hl.views(m->acquire(s)));
    const NamedTensors hn = named(hl, head);
    at::Tensor x = x0.detach().requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode on(true);
      y = model::values(model::final_norm(m->cfg, hn.at("model.norm.weight"), x), hn.at("score.weight"));
    }
    variable_list inputs = head;
    inputs.push_back(x);
    variable_list g = grads_of(y, inputs, grads[0]);
    at::Tensor gx = g.back();
    g.pop_back();
    m->reduce(s, g);
    m->release_segment(s);
    return {at::Tensor(), at::Tensor(), gx.defined() ? gx : at::zeros_like(x0)};
  }
  // A LoRA model's value head: the base's final norm frozen, the score trained in fp32 beside the
  // adapters (its gradient accumulates into theirs, all-reduced with them at the step).
  static variable_list lora_backward(Impl* m, const at::Tensor& x0, const at::Tensor& grad) {
    const size_t s = m->head_unit();
    const NamedTensors head = m->named_views(s, m->acquire(s));
    at::Tensor x = x0.detach().requires_grad_(true);
    const size_t k = static_cast<size_t>(m->lora_score);
    at::Tensor score = m->lora_views[k].detach().requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode on(true);
      y = model::values(model::final_norm(m->cfg, head.at("model.norm.weight"), x), score.to(m->opts.compute_dtype));
    }
    const variable_list g = grads_of(y, {x, score}, grad);
    if (g[1].defined()) m->lora_grad_views[k].add_(g[1]);
    m->release_segment(s);
    return {at::Tensor(), at::Tensor(), g[0].defined() ? g[0] : at::zeros_like(x0)};
  }
};

}  // namespace

at::Tensor run_trunk(Impl& m, const at::Tensor& tokens, model::BlockContext& bctx, bool graph) {
  if (graph) {
    // A LoRA model's embedding is frozen and first: no graph before the blocks (the anchor starts it).
    at::Tensor x = m.lora ? m.embed_forward(tokens) : EmbedSegment::apply(m.anchor, &m, tokens);
    for (int64_t i = 0; i < m.cfg.num_layers; ++i) {
      const variable_list out = BlockSegment::apply(m.anchor, &m, i, x, &bctx);
      x = out[0];
      if (out.size() > 1) m.router_terms.push_back(out[1]);  // router_loss() sums them
    }
    return x;
  }
  at::Tensor x = m.embed_forward(tokens);
  for (int64_t i = 0; i < m.cfg.num_layers; ++i) x = m.block_forward(i, x, bctx);
  return x;
}

at::Tensor run_lm_head(Impl& m, const at::Tensor& x, const at::Tensor& targets, double temperature, at::Tensor* entropy,
                       bool graph) {
  if (!graph) return m.lm_head_forward(x, targets, temperature, entropy);
  variable_list out = LmHeadSegment::apply(m.anchor, &m, x, targets, temperature, entropy != nullptr);
  if (entropy) *entropy = out[1];
  return out[0];
}

at::Tensor run_value_head(Impl& m, const at::Tensor& x, bool graph) {
  return graph ? ValueHeadSegment::apply(m.anchor, &m, x) : m.value_head_forward(x);
}

}  // namespace tiller::zero
