#include "tiller/zero/sharded_model.h"

#include <chrono>
#include <cmath>
#include <map>
#include <optional>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/Event.h>
#include <fmt/format.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/dist/communicator.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/storage_swap.h"
#include "tiller/zero/flat_layout.h"

namespace tiller::zero {

using model::NamedTensors;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {
constexpr int64_t kF32 = sizeof(float);
}

// Units and segments share indices: 0 is the embedding, 1 + i is block i, L + 1 is the head
// (final norm and lm_head or score). The head segment of a tied LM also uses unit 0.
struct ShardedModel::Impl {
  struct Unit {
    FlatLayout layout;
    at::Tensor shard;   // compute dtype: what all-gathers read; undefined when the model casts while gathering
    at::Tensor master;  // fp32; the shard itself in fp32 compute; on the host with a host optimizer; undefined when frozen
    at::Tensor grad;    // fp32 accumulator; undefined when frozen
    bool grad_fresh = true;  // nothing accumulated since zero_grad: the next reduce-scatter writes
  };
  struct Gathered {
    at::Tensor full;
    dist::WorkPtr work;  // null once waited for
  };
  struct Reduction {
    dist::WorkPtr work;
    at::Tensor out;  // the reduced shard: the accumulator itself, or a buffer added (or copied) into it
    size_t unit = 0;
    bool overwrite = false;  // the accumulator was fresh: `out` replaces its contents
  };
  // A unit's gradient in one flat buffer of the reduction dtype, filled parameter by parameter
  // (or accumulated straight into, for the LM head's and the embedding's: no second copy of a
  // [vocab, hidden] gradient), then reduce-scattered by submit().
  struct GradBuffer {
    size_t unit = 0;
    at::Tensor flat;
    std::vector<at::Tensor> views;  // per parameter, in layout order
    std::vector<bool> written;
  };

  model::ModelConfig cfg;
  dist::Communicator& comm;
  ShardedModelOptions opts;
  int rank = 0, world = 1;
  bool local = true;  // one shard per unit: no collectives
  std::vector<Unit> units;
  std::unique_ptr<ShardAdamW> adam;          // AdamW on the device
  std::unique_ptr<HostAdamW> host_adam;      // or on the host (options.optimizer_on_host)
  bool cast = false;                         // no persistent compute shards: gathers cast the masters
  bool offloaded = false;                    // offload_state() ... reload_state()
  std::unique_ptr<model::StorageSwap> moved;          // what offload_state() moved to the host
  std::unique_ptr<model::StorageSwap> dropped_grads;  // the accumulators freed with it (nothing pending)
  dist::Communicator* sequence = nullptr;         // the sequence group, when S > 1
  model::Rope rope;
  at::Tensor anchor;  // requires grad: makes every segment's output part of the graph
  std::map<size_t, Gathered> gathered;
  std::vector<Reduction> reducing_prev, reducing_cur;
  std::string source;  // HF directory loaded from
  std::vector<std::pair<c10::Event, c10::Event>> waits;  // measure_waits on GPU: around each stream wait
  double host_wait_s = 0;                                 // measure_waits on CPU

  // Orders the compute stream after `w` (measuring how long it stands, when asked to).
  void wait_for(dist::Work& w) {
    if (!opts.measure_waits) return w.wait_on_stream();
    if (opts.device.is_cpu()) {
      const auto t0 = std::chrono::steady_clock::now();
      w.wait_on_stream();
      host_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return;
    }
    const c10::Stream stream = at::accelerator::getCurrentStream(opts.device.index());
    c10::Event before(opts.device.type(), c10::EventFlag::BACKEND_DEFAULT);
    c10::Event after(opts.device.type(), c10::EventFlag::BACKEND_DEFAULT);
    before.record(stream);
    w.wait_on_stream();
    after.record(stream);
    waits.emplace_back(std::move(before), std::move(after));
  }

  Impl(const model::ModelConfig& c, dist::Communicator& cm, ShardedModelOptions o)
      : cfg(c), comm(cm), opts(o), rope(c) {}

  size_t head_unit() const { return units.size() - 1; }
  bool tied_lm() const { return opts.head == model::Head::kLm && cfg.tie_word_embeddings; }
  std::vector<size_t> segment_units(size_t s) const {
    if (s == head_unit() && tied_lm()) return {s, 0};
    return {s};
  }
  at::TensorOptions f32() const { return at::TensorOptions().dtype(at::kFloat).device(opts.device); }

  // --- gathering ---
  // Whether using unit u makes a transient full buffer (a gather, or a cast of the master), which
  // is released after use; otherwise the persistent shard of a one-rank model is used as it is.
  bool transient(size_t u) const { return !local || !units[u].shard.defined(); }
  // What a gather of unit u reads: the compute shard, or the master cast to the compute dtype
  // (the communicator keeps it alive until the gather has run).
  at::Tensor gather_input(size_t u) const {
    const Unit& unit = units[u];
    return unit.shard.defined() ? unit.shard : unit.master.to(opts.compute_dtype);
  }
  void prefetch(size_t u) {
    if (!transient(u) || gathered.count(u)) return;
    Gathered g;
    const at::Tensor in = gather_input(u);
    if (local) {
      g.full = in;
    } else {
      g.full = at::empty({units[u].layout.padded_numel()}, in.options());
      g.work = comm.all_gather(in, g.full);
    }
    gathered.emplace(u, std::move(g));
  }
  void prefetch_segment(size_t s) {
    for (size_t u : segment_units(s)) prefetch(u);
  }
  at::Tensor acquire(size_t u) {
    if (!transient(u)) return units[u].shard;
    prefetch(u);
    Gathered& g = gathered.at(u);
    if (g.work) {
      wait_for(*g.work);
      g.work.reset();
    }
    return g.full;
  }
  void release_segment(size_t s) {
    for (size_t u : segment_units(s)) gathered.erase(u);
  }
  // The layer's weights from per-parameter tensors (views of a gathered unit, or leaves over them).
  model::LayerWeights layer_weights(int64_t layer, size_t u, const std::vector<at::Tensor>& ts) const {
    NamedTensors named;
    const auto& ps = units[u].layout.params();
    for (size_t k = 0; k < ts.size(); ++k) named.emplace(ps[k].spec.name, ts[k]);
    return model::bind_layer(cfg, layer, named, "unit layers." + std::to_string(layer));
  }
  NamedTensors named_views(size_t u, const at::Tensor& full) const {
    NamedTensors out;
    const auto views = units[u].layout.views(full);
    for (size_t i = 0; i < views.size(); ++i) out.emplace(units[u].layout.params()[i].spec.name, views[i]);
    return out;
  }

  // --- gradient reduction ---
  void finish(std::vector<Reduction>& rs) {
    for (auto& r : rs) {
      wait_for(*r.work);
      if (r.out.is_same(units[r.unit].grad)) continue;
      if (r.overwrite)
        units[r.unit].grad.copy_(r.out);
      else
        units[r.unit].grad.add_(r.out);
    }
    rs.clear();
  }
  // The embedding's gradient goes straight into the fp32 reduction buffer, row by row, without
  // its weights; a bf16 reduction takes autograd's gradient (which needs them).
  bool embed_backward_reads_weights() const { return opts.reduce_dtype != at::kFloat; }
  // Called when segment s's backward starts: its units and the next segment to backpropagate
  // (s - 1) are gathered, and the reductions two segments back must be done.
  void begin_backward(size_t s) {
    if (s > 0 || embed_backward_reads_weights()) prefetch_segment(s);
    if (s > 1 || (s == 1 && embed_backward_reads_weights())) prefetch_segment(s - 1);
    rotate_reductions();
  }
  void rotate_reductions() {
    finish(reducing_prev);
    std::swap(reducing_prev, reducing_cur);
  }
  GradBuffer grad_buffer(size_t u) {
    TILLER_CHECK(!offloaded, "a backward pass while the optimizer state is offloaded: reload_state() first");
    const FlatLayout& layout = units[u].layout;
    GradBuffer b;
    b.unit = u;
    b.flat = at::empty({layout.padded_numel()}, f32().dtype(opts.reduce_dtype));
    layout.zero_padding(b.flat);
    b.views = layout.views(b.flat);
    b.written.assign(b.views.size(), false);
    return b;
  }
  size_t param_index(size_t u, const std::string& name) const {
    const auto& ps = units[u].layout.params();
    for (size_t i = 0; i < ps.size(); ++i)
      if (ps[i].spec.name == name) return i;
    TILLER_CHECK(false, "unit {} has no parameter '{}'", units[u].layout.name(), name);
    return 0;
  }
  // Parameter k's slot of `b`, zeroed, for a gradient accumulated into it (fp32 reductions only).
  at::Tensor accumulate_into(GradBuffer& b, size_t k) {
    TILLER_CHECK(b.flat.scalar_type() == at::kFloat, "accumulating a gradient into a {} buffer",
                 c10::toString(b.flat.scalar_type()));
    b.written[k] = true;
    return b.views[k].zero_();
  }
  // `grads` per parameter of the unit, in layout order; undefined entries are left for submit().
  void set_grads(GradBuffer& b, const std::vector<at::Tensor>& grads) {
    TILLER_CHECK(grads.size() == b.views.size(), "unit {}: {} gradients for {} parameters",
                 units[b.unit].layout.name(), grads.size(), b.views.size());
    // One multi-tensor launch converts every gradient to the reduction dtype into the flat buffer.
    std::vector<at::Tensor> dst, src;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      dst.push_back(b.views[i]);
      src.push_back(grads[i]);
      b.written[i] = true;
    }
    if (!dst.empty()) at::_foreach_copy_(dst, src);
  }
  void reduce(size_t u, const std::vector<at::Tensor>& grads) {
    GradBuffer b = grad_buffer(u);
    set_grads(b, grads);
    submit(std::move(b));
  }
  // Zeroes what no gradient reached, then reduce-scatters the buffer into the unit's accumulator
  // (or adds it in, with one rank).
  void submit(GradBuffer&& b) {
    for (size_t i = 0; i < b.views.size(); ++i)
      if (!b.written[i]) b.views[i].zero_();
    const size_t u = b.unit;
    Unit& unit = units[u];
    at::Tensor flat = std::move(b.flat);
    b.views.clear();
    if (local) {
      if (unit.grad_fresh) unit.grad.copy_(flat);
      else unit.grad.add_(flat);
      unit.grad_fresh = false;
      return;
    }
    Reduction r;
    r.unit = u;
    r.out = unit.grad_fresh && opts.reduce_dtype == at::kFloat
                ? unit.grad
                : at::empty({unit.layout.shard_numel()}, f32().dtype(opts.reduce_dtype));
    r.overwrite = unit.grad_fresh;
    unit.grad_fresh = false;
    r.work = comm.reduce_scatter(flat, r.out, dist::ReduceOp::kSum);
    reducing_cur.push_back(std::move(r));
  }

  // --- the segments' computations ---
  // The context of a block from the tensors BlockSegment saves: RoPE tables and the packing.
  model::BlockContext block_context(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cu,
                                    const std::vector<int64_t>& lens) const {
    model::BlockContext ctx;
    ctx.cos = cos;
    ctx.sin = sin;
    ctx.attn = model::VarlenSpec::self(cu, lens);
    ctx.backend = opts.attention;
    if (sequence) use_ulysses(ctx, *sequence);  // the recomputation exchanges heads as its forward did
    return ctx;
  }
  at::Tensor run_block(int64_t layer, const std::vector<at::Tensor>& params, const at::Tensor& x,
                       model::BlockContext& ctx) const {
    if (x.size(0) == 0) return x.clone();
    return model::block_forward(cfg, layer, layer_weights(layer, static_cast<size_t>(layer) + 1, params), x, ctx);
  }
  at::Tensor lm_weight(const NamedTensors& head, const NamedTensors& embed) const {
    return tied_lm() ? embed.at("model.embed_tokens.weight") : head.at("lm_head.weight");
  }

  // Forward of each segment, without autograd: gather (and prefetch the next), compute, release.
  at::Tensor embed_forward(const at::Tensor& tokens) {
    prefetch_segment(0);
    prefetch_segment(1);
    at::Tensor x = model::embed(named_views(0, acquire(0)).at("model.embed_tokens.weight"), tokens);
    release_segment(0);
    return x;
  }
  at::Tensor block_forward(int64_t layer, const at::Tensor& x, model::BlockContext& ctx) {
    const size_t s = static_cast<size_t>(layer) + 1;
    prefetch_segment(s);
    prefetch_segment(s + 1);
    at::Tensor y = run_block(layer, units[s].layout.views(acquire(s)), x, ctx);
    release_segment(s);
    return y;
  }
  at::Tensor lm_head_forward(const at::Tensor& x, const at::Tensor& targets, double temperature, at::Tensor* entropy) {
    const size_t s = head_unit();
    prefetch_segment(s);
    const NamedTensors head = named_views(s, acquire(s));
    const NamedTensors embed = tied_lm() ? named_views(0, acquire(0)) : NamedTensors{};
    at::Tensor h = model::final_norm(cfg, head.at("model.norm.weight"), x);
    at::Tensor out = model::token_logprobs(h, lm_weight(head, embed), targets, temperature, opts.logprob_chunk_rows, entropy);
    release_segment(s);
    return out;
  }
  at::Tensor value_head_forward(const at::Tensor& x) {
    const size_t s = head_unit();
    const NamedTensors head = named_views(s, acquire(s));
    at::Tensor out = model::values(model::final_norm(cfg, head.at("model.norm.weight"), x), head.at("score.weight"));
    release_segment(s);
    return out;
  }
};

namespace {

using Impl = ShardedModel::Impl;

// The model travels with the autograd node as an integer (the model must outlive its graphs).
void remember(AutogradContext* ctx, Impl* m) {
  ctx->saved_data["impl"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(m));
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

// Segment 0: token ids -> embeddings.
struct EmbedSegment : public torch::autograd::Function<EmbedSegment> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& anchor, Impl* m, const at::Tensor& tokens) {
    remember(ctx, m);
    ctx->save_for_backward({tokens});
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

// Segment 1 + layer: one transformer block. With Recompute::kBlocks only its input is saved and
// the backward recomputes the whole block; with kNone the forward records the block's graph and
// the backward runs it; with kAttentionOnly the forward runs the attention half without autograd
// and records the MLP half's graph, and the backward runs that graph, then recomputes the
// attention half.
struct BlockSegment : public torch::autograd::Function<BlockSegment> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& anchor, Impl* m, int64_t layer,
                            const at::Tensor& x, const model::BlockContext* block) {
    remember(ctx, m);
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["lens"] = block->attn.lens_q;
    ctx->save_for_backward({x, block->cos, block->sin, block->attn.cu_q});
    model::BlockContext bctx = *block;
    const int64_t kept = m->opts.recompute_layers;
    const Recompute mode = kept < 0 || layer < kept ? m->opts.recompute : Recompute::kBlocks;
    if (mode == Recompute::kBlocks || x.size(0) == 0) return m->block_forward(layer, x, bctx);
    const size_t s = static_cast<size_t>(layer) + 1;
    m->prefetch_segment(s);
    m->prefetch_segment(s + 1);
    const at::Tensor full = m->acquire(s);
    std::vector<at::Tensor> params = leaves(m->units[s].layout.views(full));
    const model::LayerWeights w = m->layer_weights(layer, s, params);
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
        y = model::mlp_residual(m->cfg, w, kept_in, bctx);
      }
    }
    ctx->saved_data["attention_half"] = mode == Recompute::kAttentionOnly;  // recomputed in the backward
    ctx->saved_data["kept_out"] = y;
    ctx->saved_data["kept_in"] = kept_in;
    ctx->saved_data["params"] = params;
    if (m->transient(s)) park(full);
    m->release_segment(s);
    return y.detach();
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
    if (ctx->saved_data.count("kept_out")) {
      const at::Tensor y = ctx->saved_data["kept_out"].toTensor();
      const at::Tensor kept_in = ctx->saved_data["kept_in"].toTensor();
      variable_list params = ctx->saved_data["params"].toTensorVector();
      ctx->saved_data.erase("kept_out");
      ctx->saved_data.erase("kept_in");
      ctx->saved_data.erase("params");
      if (m->transient(s)) unpark(params.front(), full);
      variable_list inputs = params;
      inputs.push_back(kept_in);
      g = grads_of(y, inputs, grads[0]);
      at::Tensor g_in = g.back();
      g.pop_back();
      if (!ctx->saved_data["attention_half"].toBool()) {
        gx = g_in;
      } else if (g_in.defined()) {  // kAttentionOnly: through the attention half, recomputed
        at::Tensor a;
        {
          at::AutoGradMode on(true);
          auto bctx = m->block_context(saved[1], saved[2], saved[3], lens);
          a = model::attention_residual(m->cfg, layer, m->layer_weights(layer, s, params), x, bctx);
        }
        inputs = params;
        inputs.push_back(x);
        variable_list ga = grads_of(a, inputs, g_in);
        gx = ga.back();
        for (size_t i = 0; i < g.size(); ++i)
          if (ga[i].defined()) g[i] = g[i].defined() ? g[i] + ga[i] : ga[i];
      }
    } else {
      auto params = leaves(m->units[s].layout.views(full));
      at::Tensor y;
      {
        at::AutoGradMode on(true);
        auto bctx = m->block_context(saved[1], saved[2], saved[3], lens);
        y = m->run_block(layer, params, x, bctx);
      }
      variable_list inputs = params;
      inputs.push_back(x);
      g = grads_of(y, inputs, grads[0]);
      gx = g.back();
      g.pop_back();
    }
    m->reduce(s, g);
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
    remember(ctx, m);
    ctx->set_materialize_grads(false);
    ctx->saved_data["temperature"] = temperature;
    ctx->save_for_backward({x, targets});
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
};

// The last segment, value head: final norm -> score.
struct ValueHeadSegment : public torch::autograd::Function<ValueHeadSegment> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& anchor, Impl* m, const at::Tensor& x) {
    remember(ctx, m);
    ctx->save_for_backward({x});
    return m->value_head_forward(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Impl* m = impl_of(ctx);
    const at::Tensor x0 = ctx->get_saved_variables()[0];
    const size_t s = m->head_unit();
    m->begin_backward(s);
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
};

// Embedding and blocks: [T, hidden]; as autograd segments when `graph`.
at::Tensor run_trunk(Impl& m, const at::Tensor& tokens, model::BlockContext& bctx, bool graph) {
  if (graph) {
    at::Tensor x = EmbedSegment::apply(m.anchor, &m, tokens);
    for (int64_t i = 0; i < m.cfg.num_layers; ++i) x = BlockSegment::apply(m.anchor, &m, i, x, &bctx);
    return x;
  }
  at::Tensor x = m.embed_forward(tokens);
  for (int64_t i = 0; i < m.cfg.num_layers; ++i) x = m.block_forward(i, x, bctx);
  return x;
}

}  // namespace

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kBlocks: return "blocks";
    case Recompute::kAttentionOnly: return "attention_only";
    case Recompute::kNone: return "none";
  }
  return "?";
}

Recompute parse_recompute(const std::string& text, const std::string& key) {
  for (Recompute r : {Recompute::kBlocks, Recompute::kAttentionOnly, Recompute::kNone})
    if (text == recompute_name(r)) return r;
  throw ConfigError(fmt::format("{} = '{}': use blocks, attention_only or none", key, text));
}

ShardedModelOptions role_options(const std::string& name, const RoleConfig& role, const TrainConfig& train,
                                 bool trainable, model::Head head, at::Device device) {
  ShardedModelOptions o;
  o.head = head;
  o.device = device;
  o.trainable = trainable;
  if (role.dtype == "bf16") o.compute_dtype = at::kBFloat16;
  else if (role.dtype == "fp32") o.compute_dtype = at::kFloat;
  else throw ConfigError(fmt::format("roles.{}.dtype '{}': use bf16 or fp32", name, role.dtype));
  if (role.replicate && trainable)
    throw ConfigError(fmt::format("roles.{}.replicate: only frozen roles (ref, reward) can be replicated; a trained "
                                  "role is always sharded", name));
  o.replicate = role.replicate;
  o.adamw = {train.adam_beta1, train.adam_beta2, train.adam_eps, train.weight_decay};
  o.max_grad_norm = train.max_grad_norm;
  // `auto` is resolved by the memory plan before the ranks build their models (tiller train);
  // unresolved it means the least memory.
  if (train.reduce_dtype == "bf16") o.reduce_dtype = at::kBFloat16;
  else if (train.reduce_dtype != "fp32")
    throw ConfigError(fmt::format("train.reduce_dtype '{}': use fp32 or bf16", train.reduce_dtype));
  if (trainable && train.recompute != "auto") o.recompute = parse_recompute(train.recompute, "train.recompute");
  o.recompute_layers = train.recompute_layers;
  // compute_shard `auto` is resolved by the memory plan like recompute; unresolved, the least memory.
  if (train.compute_shard != "auto" && train.compute_shard != "keep" && train.compute_shard != "cast")
    throw ConfigError(fmt::format("train.compute_shard '{}': use auto, keep or cast", train.compute_shard));
  o.keep_compute_shard = train.compute_shard == "keep";
  if (role.optimizer_offload != "none" && role.optimizer_offload != "cpu")
    throw ConfigError(fmt::format("roles.{}.optimizer_offload '{}': use none or cpu", name, role.optimizer_offload));
  if (role.optimizer_offload == "cpu" && !trainable)
    throw ConfigError(fmt::format("roles.{}.optimizer_offload = cpu: a frozen role has no optimizer", name));
  o.optimizer_on_host = role.optimizer_offload == "cpu";
  o.optimizer_threads = static_cast<int>(train.optimizer_threads);
  return o;
}

ShardedModel::ShardedModel(const model::ModelConfig& cfg, dist::Communicator& comm, ShardedModelOptions opts)
    : impl_(std::make_unique<Impl>(cfg, comm, opts)) {
  Impl& m = *impl_;
  TILLER_CHECK(!(opts.replicate && opts.trainable), "replicate is for frozen roles (reference, reward) only");
  TILLER_CHECK(opts.device.is_cpu() || opts.device.has_index(), "ShardedModel needs a device with an index (cuda:N)");
  TILLER_CHECK(opts.compute_dtype == at::kFloat || opts.compute_dtype == at::kBFloat16 || opts.compute_dtype == at::kHalf,
               "compute dtype {} is not supported: use bf16 or fp32", c10::toString(opts.compute_dtype));
  TILLER_CHECK(opts.trainable || !opts.optimizer_on_host, "optimizer_on_host for a frozen model: it has no optimizer");
  m.world = opts.replicate ? 1 : comm.size();
  m.rank = opts.replicate ? 0 : comm.rank();
  m.local = m.world == 1;
  m.cast = opts.trainable && opts.compute_dtype != at::kFloat && !opts.keep_compute_shard && !opts.optimizer_on_host;
  const auto shard_options = at::TensorOptions().dtype(opts.compute_dtype).device(opts.device);
  if (opts.trainable && opts.optimizer_on_host)
    m.host_adam = std::make_unique<HostAdamW>(
        opts.adamw, opts.device, opts.optimizer_threads > 0 ? opts.optimizer_threads : default_optimizer_threads());
  else if (opts.trainable)
    m.adam = std::make_unique<ShardAdamW>(opts.adamw);
  for (auto& layout : model_layouts(cfg, opts.head, m.world)) {
    Impl::Unit u{std::move(layout), {}, {}, {}, true};
    const int64_t n = u.layout.shard_numel();
    if (!m.cast) u.shard = at::zeros({n}, shard_options);
    if (opts.trainable) {
      u.grad = at::zeros({n}, m.f32());
      if (m.host_adam) {
        u.master = m.host_adam->master(m.host_adam->add(n, u.layout.decay_mask(m.rank, at::TensorOptions())));
      } else {
        u.master = opts.compute_dtype == at::kFloat ? u.shard : at::zeros({n}, m.f32());
        m.adam->add(u.master, u.layout.decay_mask(m.rank, m.f32()), u.grad);
      }
    }
    m.units.push_back(std::move(u));
  }
  m.anchor = at::zeros({}, m.f32()).requires_grad_(true);
}

ShardedModel::~ShardedModel() = default;

void ShardedModel::load(const NamedTensors& named, const std::string& where) {
  Impl& m = *impl_;
  for (auto& u : m.units) {
    at::Tensor& dst = u.master.defined() ? u.master : u.shard;
    u.layout.fill_shard(m.rank, named, dst, where);
    if (u.shard.defined() && !dst.is_same(u.shard)) u.shard.copy_(dst);
  }
}

void ShardedModel::load_hf(const std::string& dir) {
  model::CheckpointReader reader(dir);
  load(reader.all(), dir);
  impl_->source = dir;
}

namespace {

// The LM head's log-probs (and entropies) of `x`'s rows, through the autograd segments when `graph`.
at::Tensor lm_outputs(Impl& m, const at::Tensor& x, const at::Tensor& targets, double temperature, at::Tensor* entropy,
                      bool graph) {
  if (!graph) return m.lm_head_forward(x, targets, temperature, entropy);
  variable_list out = LmHeadSegment::apply(m.anchor, &m, x, targets, temperature, entropy != nullptr);
  if (entropy) *entropy = out[1];
  return out[0];
}

void check_lm(const Impl& m, const at::Tensor& targets, int64_t rows, double temperature) {
  TILLER_CHECK(m.opts.head == model::Head::kLm, "token_logprobs needs the LM head; this model has a value head");
  TILLER_CHECK(targets.dim() == 1 && targets.size(0) == rows, "{} targets for {} tokens", targets.numel(), rows);
  TILLER_CHECK(temperature > 0, "temperature must be > 0, got {}", temperature);
}

}  // namespace

at::Tensor ShardedModel::token_logprobs(const model::PackedBatch& batch, const at::Tensor& targets, double temperature,
                                        at::Tensor* entropy) {
  Impl& m = *impl_;
  check_lm(m, targets, batch.num_tokens(), temperature);
  TILLER_CHECK(m.sequence == nullptr, "a sequence-parallel model takes slices (SequenceSlice), not whole batches");
  model::BlockContext bctx =
      model::make_block_context(m.cfg, m.rope, batch, m.opts.compute_dtype, nullptr, m.opts.attention);
  const bool graph = m.opts.trainable && at::GradMode::is_enabled();
  c10::AutoGradMode grad_mode(graph);  // a frozen model records no graph even under autograd
  at::Tensor x = run_trunk(m, batch.tokens, bctx, graph);
  return lm_outputs(m, x, targets.to(at::kLong), temperature, entropy, graph);
}

at::Tensor ShardedModel::values(const model::PackedBatch& batch) {
  Impl& m = *impl_;
  TILLER_CHECK(m.opts.head == model::Head::kValue, "values needs the value head; this model has an LM head");
  TILLER_CHECK(m.sequence == nullptr, "a sequence-parallel model takes slices (SequenceSlice), not whole batches");
  model::BlockContext bctx =
      model::make_block_context(m.cfg, m.rope, batch, m.opts.compute_dtype, nullptr, m.opts.attention);
  const bool graph = m.opts.trainable && at::GradMode::is_enabled();
  c10::AutoGradMode grad_mode(graph);  // a frozen model records no graph even under autograd
  at::Tensor x = run_trunk(m, batch.tokens, bctx, graph);
  return graph ? ValueHeadSegment::apply(m.anchor, &m, x) : m.value_head_forward(x);
}

void ShardedModel::set_sequence_group(dist::Communicator& group) {
  Impl& m = *impl_;
  check_sequence_parallel(m.cfg, group.size(), "sequence_parallel");
  TILLER_CHECK(group.size() == 1 || m.world % group.size() == 0 || m.opts.replicate,
               "a sequence group of {} ranks in a model group of {}", group.size(), m.world);
  m.sequence = group.size() > 1 ? &group : nullptr;
}

void ShardedModel::set_recompute(Recompute mode, int64_t layers) {
  impl_->opts.recompute = mode;
  impl_->opts.recompute_layers = layers;
}

int ShardedModel::sequence_parallel() const { return impl_->sequence ? impl_->sequence->size() : 1; }

at::Tensor ShardedModel::token_logprobs(const SequenceSlice& slice, const at::Tensor& targets, double temperature,
                                        at::Tensor* entropy) {
  Impl& m = *impl_;
  SliceInput in = prepare_slice(m.rope, slice, m.sequence, m.opts.compute_dtype, m.opts.device, m.opts.attention);
  check_lm(m, targets, in.rows, temperature);
  at::Tensor tgt = targets.to(m.opts.device, at::kLong);
  if (in.padded > in.rows) tgt = at::cat({tgt, at::zeros({in.padded - in.rows}, tgt.options())});
  const bool graph = m.opts.trainable && at::GradMode::is_enabled();
  c10::AutoGradMode grad_mode(graph);
  at::Tensor x = run_trunk(m, in.tokens, in.ctx, graph);
  at::Tensor lp = lm_outputs(m, x, tgt, temperature, entropy, graph);
  if (entropy) *entropy = entropy->narrow(0, 0, in.rows);
  return lp.narrow(0, 0, in.rows);
}

at::Tensor ShardedModel::values(const SequenceSlice& slice) {
  Impl& m = *impl_;
  TILLER_CHECK(m.opts.head == model::Head::kValue, "values needs the value head; this model has an LM head");
  SliceInput in = prepare_slice(m.rope, slice, m.sequence, m.opts.compute_dtype, m.opts.device, m.opts.attention);
  const bool graph = m.opts.trainable && at::GradMode::is_enabled();
  c10::AutoGradMode grad_mode(graph);
  at::Tensor x = run_trunk(m, in.tokens, in.ctx, graph);
  at::Tensor v = graph ? ValueHeadSegment::apply(m.anchor, &m, x) : m.value_head_forward(x);
  return v.narrow(0, 0, in.rows);
}

StepResult ShardedModel::step(double lr) {
  Impl& m = *impl_;
  TILLER_CHECK(m.opts.trainable, "step() on a frozen model");
  TILLER_CHECK(!m.offloaded, "step() while the optimizer state is offloaded: reload_state() first");
  m.finish(m.reducing_prev);
  m.finish(m.reducing_cur);
  std::vector<at::Tensor> grads;
  for (auto& u : m.units) {
    if (u.grad_fresh) u.grad.zero_();  // no gradient since zero_grad (see there)
    grads.push_back(u.grad);
  }
  at::Tensor sq = at::stack(at::_foreach_norm(grads)).pow(2).sum().reshape({1}).to(at::kDouble);
  if (!m.local) m.comm.all_reduce(sq, dist::ReduceOp::kSum)->wait();
  StepResult r;
  r.grad_norm = std::sqrt(sq.item<double>());
  if (!std::isfinite(r.grad_norm)) {
    r.skipped = true;
    r.clip_factor = 0;
    log::warn("step {} skipped: the gradient norm is {}", steps() + 1, r.grad_norm);
    zero_grad();
    return r;
  }
  r.clip_factor = clip_coefficient(r.grad_norm, m.opts.max_grad_norm);
  if (m.host_adam) {
    std::vector<at::Tensor> compute;
    for (auto& u : m.units) compute.push_back(u.shard);
    m.host_adam->step(lr, r.clip_factor, grads, compute);
  } else {
    m.adam->step(lr, r.clip_factor);
    for (auto& u : m.units)
      if (u.shard.defined() && !u.master.is_same(u.shard)) u.shard.copy_(u.master);
  }
  zero_grad();
  return r;
}

void ShardedModel::zero_grad() {
  Impl& m = *impl_;
  if (!m.opts.trainable) return;
  m.finish(m.reducing_prev);
  m.finish(m.reducing_cur);
  // Lazily: the next reduce-scatter into a fresh accumulator overwrites it, and step() zeroes one
  // that received nothing, so no pass over the accumulators runs here.
  for (auto& u : m.units) u.grad_fresh = true;
}

double ShardedModel::take_wait_seconds() {
  Impl& m = *impl_;
  double s = m.host_wait_s;
  for (auto& [before, after] : m.waits) {
    after.synchronize();
    s += before.elapsedTime(after) / 1e3;
  }
  m.waits.clear();
  m.host_wait_s = 0;
  return s;
}

int64_t ShardedModel::steps() const {
  if (impl_->adam) return impl_->adam->steps();
  return impl_->host_adam ? impl_->host_adam->steps() : 0;
}

const HostAdamW* ShardedModel::host_optimizer() const { return impl_->host_adam.get(); }

NamedTensors ShardedModel::gather_parameters() {
  Impl& m = *impl_;
  NamedTensors out;
  for (auto& u : m.units) {
    at::Tensor src = u.master.defined() ? u.master : u.shard;
    if (src.device() != m.opts.device) src = src.to(m.opts.device);  // a host optimizer's master
    at::Tensor full = src;
    if (!m.local) {
      full = at::empty({u.layout.padded_numel()}, src.options());
      m.comm.all_gather(src, full)->wait();
    }
    const auto views = u.layout.views(full);
    for (size_t i = 0; i < views.size(); ++i) out.emplace(u.layout.params()[i].spec.name, views[i].clone());
  }
  return out;
}

std::vector<ShardedModel::UnitShard> ShardedModel::shards() const {
  std::vector<UnitShard> out;
  for (const auto& u : impl_->units) out.push_back({u.layout.name(), u.shard, u.master, u.layout.shard_numel()});
  return out;
}

std::vector<ShardedModel::UnitState> ShardedModel::unit_states() const {
  const Impl& m = *impl_;
  TILLER_CHECK(!m.offloaded, "the state of a model whose optimizer state is offloaded: reload_state() first");
  std::vector<UnitState> out;
  for (size_t i = 0; i < m.units.size(); ++i) {
    const auto& u = m.units[i];
    UnitState s{u.layout.name(), u.master.defined() ? u.master : u.shard, {}, {}};
    if (m.adam) {
      s.exp_avg = m.adam->exp_avg(i);
      s.exp_avg_sq = m.adam->exp_avg_sq(i);
    } else if (m.host_adam) {
      s.exp_avg = m.host_adam->exp_avg(i);
      s.exp_avg_sq = m.host_adam->exp_avg_sq(i);
    }
    out.push_back(std::move(s));
  }
  return out;
}

void ShardedModel::load_unit_state(size_t i, const at::Tensor& master, const at::Tensor& exp_avg,
                                   const at::Tensor& exp_avg_sq) {
  Impl& m = *impl_;
  TILLER_CHECK(!m.offloaded, "load_unit_state() while the optimizer state is offloaded: reload_state() first");
  TILLER_CHECK(i < m.units.size(), "no unit {}", i);
  auto& u = m.units[i];
  at::Tensor& dst = u.master.defined() ? u.master : u.shard;
  TILLER_CHECK(master.numel() == dst.numel(), "unit {}: {} saved elements for a shard of {}", u.layout.name(),
               master.numel(), dst.numel());
  dst.copy_(master.reshape({-1}));
  if (u.shard.defined() && !dst.is_same(u.shard)) u.shard.copy_(dst);
  if (m.adam) m.adam->load_state(i, exp_avg, exp_avg_sq);
  if (m.host_adam) m.host_adam->load_state(i, exp_avg, exp_avg_sq);
}

void ShardedModel::set_steps(int64_t steps) {
  if (impl_->adam) impl_->adam->set_steps(steps);
  if (impl_->host_adam) impl_->host_adam->set_steps(steps);
}

const model::ModelConfig& ShardedModel::config() const { return impl_->cfg; }
dist::Communicator& ShardedModel::communicator() const { return impl_->comm; }
const std::string& ShardedModel::source_model() const { return impl_->source; }
const ShardedModelOptions& ShardedModel::options() const { return impl_->opts; }
int ShardedModel::rank() const { return impl_->rank; }
int ShardedModel::world() const { return impl_->world; }

int64_t ShardedModel::offload_state() {
  Impl& m = *impl_;
  TILLER_CHECK(m.opts.trainable, "offload_state() of a frozen model: it has no optimizer state");
  if (m.offloaded) return 0;
  // A backward's last reductions may still be in flight into the accumulators: land them first.
  m.finish(m.reducing_prev);
  m.finish(m.reducing_cur);
  // Between optimizer steps every accumulator is fresh (its contents unused: the next backward
  // overwrites it), so its memory is freed without a copy; a pending gradient moves with the rest.
  bool pending = false;
  for (const auto& u : m.units) pending = pending || (u.grad.defined() && !u.grad_fresh);
  std::vector<at::Tensor> state, grads;
  for (auto& u : m.units) {
    // A model that casts while gathering keeps compute shards while its masters are away, so that
    // forwards (scoring) still run; reload_state() drops them again.
    if (!u.shard.defined()) u.shard = u.master.to(m.opts.compute_dtype);
    if (u.master.defined() && !u.master.is_same(u.shard) && !m.host_adam) state.push_back(u.master);
    if (u.grad.defined()) (pending ? state : grads).push_back(u.grad);
  }
  if (m.adam) {
    const std::vector<at::Tensor> s = m.adam->state_tensors();
    state.insert(state.end(), s.begin(), s.end());
  }
  int64_t moved = 0;
  if (!state.empty()) {
    m.moved = std::make_unique<model::StorageSwap>(state);
    m.moved->offload();
    moved = m.moved->bytes();
  }
  if (!grads.empty()) {
    m.dropped_grads = std::make_unique<model::StorageSwap>(grads);
    m.dropped_grads->drop();
  }
  m.offloaded = true;
  return moved;
}

int64_t ShardedModel::reload_state() {
  Impl& m = *impl_;
  if (!m.offloaded) return 0;
  int64_t n = 0;
  if (m.moved) {
    m.moved->reload();
    n = m.moved->bytes();
    m.moved.reset();
  }
  if (m.dropped_grads) {  // memory back, contents undefined: every accumulator is still fresh
    m.dropped_grads->reload();
    m.dropped_grads.reset();
  }
  if (m.cast)
    for (auto& u : m.units) u.shard = at::Tensor();
  m.offloaded = false;
  return n;
}

bool ShardedModel::state_offloaded() const { return impl_->offloaded; }

ShardMemory ShardedModel::memory() const {
  const Impl& m = *impl_;
  ShardMemory r;
  for (const auto& u : m.units) {
    if (u.shard.defined()) r.parameters += u.shard.numel() * u.shard.element_size();
    if (u.master.defined() && !u.master.is_same(u.shard) && !m.host_adam) r.parameters += u.master.numel() * kF32;
    if (u.grad.defined()) r.gradients += u.grad.numel() * kF32;
  }
  if (m.adam) r.optimizer = m.adam->state_bytes();
  if (m.host_adam) r.host = m.host_adam->host_bytes();
  return r;
}

}  // namespace tiller::zero
