// ShardedModel's state and its per-unit work (private to src/zero): the gathers with prefetch,
// the gradient reductions, the host optimizer's hand-off, the forward of each segment. Shared by
// sharded_model.cpp (the public methods) and sharded_segments.cpp (the autograd segments).
#pragma once

#include <chrono>
#include <cmath>
#include <map>
#include <optional>

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
#include "tiller/zero/sharded_model.h"

namespace tiller::zero {

using model::NamedTensors;

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
  SequenceGroups sequence_groups;                 // its Ulysses and context-parallel communicators
  std::unique_ptr<dist::Communicator> heads_group, keys_group;  // owned (context_parallel > 1)
  model::Rope rope;
  at::Tensor anchor;  // requires grad: makes every segment's output part of the graph
  std::map<size_t, Gathered> gathered;
  std::vector<Reduction> reducing_prev, reducing_cur;
  std::string source;  // HF directory loaded from
  std::vector<std::pair<c10::Event, c10::Event>> waits;  // measure_waits on GPU: around each stream wait
  double host_wait_s = 0;
  at::Tensor expert_load;  // take_expert_load(): the training forwards' tokens per expert
  // Router losses (router_loss()): the training forward's context points at `router`; run_trunk
  // keeps each sparse layer's loss (BlockSegment's second output) in router_terms.
  model::RouterLoss router;
  std::vector<at::Tensor> router_terms;
  int64_t router_rows = 0;  // the counted rows of the forward the terms are from
  at::Tensor router_stats;  // fp64 [2] (weighted aux, z) since take_router_stats()

  // LoRA (options.lora): the adapters' fp32 values and gradients, each one flat buffer held whole
  // on every rank, with a view per adapter tensor (lora_specs' order: per layer, A and B of each
  // adapted projection); lora_of_layer[l]: layer l's indices into them.
  bool lora = false;
  int64_t lora_score = -1;  // a value head's: the index of its trained score.weight in lora_specs, else -1
  std::vector<model::ParamSpec> lora_specs;
  at::Tensor lora_master, lora_grad;
  std::vector<at::Tensor> lora_views, lora_grad_views;
  std::vector<std::vector<size_t>> lora_of_layer;
  bool adapters_off = false;  // set_adapters_enabled(false): the base alone
  int64_t lora_forwards = 0;  // training forwards so far: each draws its own dropout masks

  // Layer `layer`'s adapter tensors: views of the values, or leaves over them (a graph's inputs).
  std::vector<at::Tensor> layer_adapters(int64_t layer, bool as_leaves) const {
    std::vector<at::Tensor> out;
    for (size_t i : lora_of_layer[static_cast<size_t>(layer)])
      out.push_back(as_leaves ? lora_views[i].detach().requires_grad_(true) : lora_views[i]);
    return out;
  }
  // Binds them into `w` (A and B of each adapted projection, in order).
  void bind_adapters(model::LayerWeights& w, const std::vector<at::Tensor>& a) const {
    size_t k = 0;
    for (size_t m = 0; m < opts.lora.targets.size(); ++m) {
      if (!opts.lora.targets[m]) continue;
      w.lora.a[m] = a.at(k++);
      w.lora.b[m] = a.at(k++);
    }
    w.lora.scale = opts.lora.scale();
  }
  // Adds a layer's adapter gradients (layer_adapters' order; undefined ones skipped).
  void accumulate_adapters(int64_t layer, const std::vector<at::Tensor>& grads) {
    const auto& idx = lora_of_layer[static_cast<size_t>(layer)];
    TILLER_CHECK(grads.size() == idx.size(), "layer {}: {} adapter gradients for {} adapters", layer, grads.size(),
                 idx.size());
    for (size_t k = 0; k < idx.size(); ++k)
      if (grads[k].defined()) lora_grad_views[idx[k]].add_(grads[k]);
  }
  // The LoRA fields of a forward's block context: the switch, and in a training forward the
  // dropout's seed for this forward and the rows' offset in the packed row.
  void lora_context(model::BlockContext& ctx, bool training, int64_t first_row) {
    if (!lora) return;
    ctx.lora_off = adapters_off;
    if (!training || opts.lora_dropout <= 0) return;
    ctx.lora_dropout = opts.lora_dropout;
    ctx.lora_dropout_seed = static_cast<int64_t>(opts.lora_seed * 1000003ull + static_cast<uint64_t>(++lora_forwards));
    ctx.lora_first_row = first_row;
  }

  bool router_losses_on() const {
    return opts.trainable && cfg.moe() && (opts.router_aux_coef > 0 || opts.router_z_coef > 0);
  }
  // A training forward's routing (a mixture of experts): the expert load and the router losses
  // count its first `rows` rows.
  void training_routing(model::BlockContext& ctx, int64_t rows) {
    if (!cfg.moe()) return;
    ctx.expert_load = &expert_load;
    ctx.routed_rows = rows;
    if (!router_losses_on()) return;
    router = model::RouterLoss{opts.router_aux_coef, opts.router_z_coef, {}, {}, {}};
    router_terms.clear();
    router_rows = rows;
    ctx.router_loss = &router;
  }

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
  // The layer's weights from per-parameter tensors (views of a gathered unit, or leaves over them),
  // with a LoRA model's adapters: `adapters` (layer_adapters' tensors), or else views of them.
  model::LayerWeights layer_weights(int64_t layer, size_t u, const std::vector<at::Tensor>& ts,
                                    const std::vector<at::Tensor>* adapters = nullptr) const {
    NamedTensors named;
    const auto& ps = units[u].layout.params();
    for (size_t k = 0; k < ts.size(); ++k) named.emplace(ps[k].spec.name, ts[k]);
    model::LayerWeights w = model::bind_layer(cfg, layer, named, "unit layers." + std::to_string(layer));
    if (lora) bind_adapters(w, adapters ? *adapters : layer_adapters(layer, false));
    return w;
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
  bool embed_backward_reads_weights() const { return !lora && opts.reduce_dtype != at::kFloat; }  // LoRA: no embedding backward
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
  // FP8 training's fields of a block context, as opts say (every forward and recomputation).
  void fp8_context(model::BlockContext& ctx) const {
    ctx.fp8_training = opts.fp8;
    ctx.fp8_fast_accumulation = opts.fp8_fast_accumulation;
  }
  // The context of a block from the tensors BlockSegment saves: RoPE tables and the packing.
  model::BlockContext block_context(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cu,
                                    const std::vector<int64_t>& lens) const {
    model::BlockContext ctx;
    ctx.cos = cos;
    ctx.sin = sin;
    ctx.attn = model::VarlenSpec::self(cu, lens);
    ctx.backend = opts.attention;
    fp8_context(ctx);
    use_sequence_groups(ctx, sequence_groups);  // the recomputation exchanges as its forward did
    return ctx;
  }
  at::Tensor run_block(int64_t layer, const std::vector<at::Tensor>& params, const at::Tensor& x,
                       model::BlockContext& ctx, const std::vector<at::Tensor>* adapters = nullptr) const {
    if (x.size(0) == 0) return x.clone();
    return model::block_forward(cfg, layer, layer_weights(layer, static_cast<size_t>(layer) + 1, params, adapters), x,
                                ctx);
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
    at::Tensor out = model::values(model::final_norm(cfg, head.at("model.norm.weight"), x), score_weight(head));
    release_segment(s);
    return out;
  }
  // The value head's score: with LoRA the trained fp32 copy, in the compute dtype; else the unit's.
  at::Tensor score_weight(const NamedTensors& head) const {
    if (lora_score < 0) return head.at("score.weight");
    return lora_views[static_cast<size_t>(lora_score)].to(opts.compute_dtype);
  }
};

// The autograd segments (sharded_segments.cpp). Embedding and blocks: [T, hidden]; as autograd
// segments when `graph`.
at::Tensor run_trunk(ShardedModel::Impl& m, const at::Tensor& tokens, model::BlockContext& bctx, bool graph);
// The LM head's log-probs (and entropies) of `x`'s rows, through the autograd segment when `graph`.
at::Tensor run_lm_head(ShardedModel::Impl& m, const at::Tensor& x, const at::Tensor& targets, double temperature,
                       at::Tensor* entropy, bool graph);
// The value head's scores of `x`'s rows, likewise.
at::Tensor run_value_head(ShardedModel::Impl& m, const at::Tensor& x, bool graph);

}  // namespace tiller::zero
