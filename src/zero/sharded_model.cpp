#include "tiller/zero/sharded_model.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "zero/sharded_model_impl.h"

namespace tiller::zero {

namespace {
constexpr int64_t kF32 = sizeof(float);
}  // namespace

using Impl = ShardedModel::Impl;

namespace {
void check_fp8(const ShardedModelOptions& opts) {
  if (opts.fp8 && opts.device.is_cuda() && (opts.compute_dtype != at::kBFloat16 || !model::fp8::tensor_cores(opts.device)))
    throw ConfigError(fmt::format("roles.{}.fp8 needs bf16 compute on a GPU with FP8 tensor cores (compute capability "
                                  "9.x, in the GPU build); {} has none or the dtype is not bf16: set roles.{}.fp8 = false",
                                  opts.role, opts.device.str(), opts.role));
}
}  // namespace

ShardedModel::ShardedModel(const model::ModelConfig& cfg, dist::Communicator& comm, ShardedModelOptions opts)
    : impl_(std::make_unique<Impl>(cfg, comm, opts)) {
  Impl& m = *impl_;
  TILLER_CHECK(!(opts.replicate && opts.trainable), "replicate is for frozen roles (reference, reward) only");
  TILLER_CHECK(opts.device.is_cpu() || opts.device.has_index(), "ShardedModel needs a device with an index (cuda:N)");
  TILLER_CHECK(opts.compute_dtype == at::kFloat || opts.compute_dtype == at::kBFloat16 || opts.compute_dtype == at::kHalf,
               "compute dtype {} is not supported: use bf16 or fp32", c10::toString(opts.compute_dtype));
  TILLER_CHECK(opts.trainable || !opts.optimizer_on_host, "optimizer_on_host for a frozen model: it has no optimizer");
  check_fp8(opts);
  if ((opts.router_aux_coef > 0 || opts.router_z_coef > 0) && !cfg.moe())
    throw ConfigError(fmt::format("roles.{}.router_aux_loss_coef / router_z_loss_coef: the {} model has no experts "
                                  "(no router to balance); set them to 0",
                                  opts.role, opts.role));
  TILLER_CHECK(opts.trainable || (opts.router_aux_coef == 0 && opts.router_z_coef == 0),
               "router losses for a frozen model: it trains no router");
  m.world = opts.replicate ? 1 : comm.size();
  m.rank = opts.replicate ? 0 : comm.rank();
  m.local = m.world == 1;
  m.lora = opts.lora.enabled();
  if (m.lora) {
    if (!opts.trainable)
      throw ConfigError(fmt::format("roles.{}.lora: LoRA trains adapters; the {} is frozen", opts.role, opts.role));
    if (opts.optimizer_on_host)
      throw ConfigError(fmt::format("roles.{}.lora with optimizer_offload cpu: the adapters' optimizer state is "
                                    "megabytes; set optimizer_offload to none",
                                    opts.role));
  }
  const bool trains_base = opts.trainable && !m.lora;  // a LoRA model's base is frozen
  m.cast = trains_base && opts.compute_dtype != at::kFloat && !opts.keep_compute_shard && !opts.optimizer_on_host;
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
    if (trains_base) {
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
  if (m.lora) {  // the adapters: one fp32 buffer and its gradient, whole on every rank, under AdamW
    m.lora_specs = model::lora_parameter_specs(cfg, opts.lora);
    // A value head trains whole beside the adapters (PEFT's modules_to_save for a sequence
    // classifier's score), last in the buffer.
    if (opts.head == model::Head::kValue) {
      m.lora_score = static_cast<int64_t>(m.lora_specs.size());
      m.lora_specs.push_back({"score.weight", {1, cfg.hidden_size}, -1, false, false});
    }
    auto numel = [](const model::ParamSpec& p) {
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      return n;
    };
    int64_t total = 0;
    for (const auto& p : m.lora_specs) total += numel(p);
    m.lora_master = at::zeros({total}, m.f32());
    m.lora_grad = at::zeros({total}, m.f32());
    m.lora_of_layer.resize(static_cast<size_t>(cfg.num_layers));
    int64_t at = 0;
    for (size_t i = 0; i < m.lora_specs.size(); ++i) {
      const int64_t n = numel(m.lora_specs[i]);
      m.lora_views.push_back(m.lora_master.narrow(0, at, n).view(m.lora_specs[i].shape));
      m.lora_grad_views.push_back(m.lora_grad.narrow(0, at, n).view(m.lora_specs[i].shape));
      if (m.lora_specs[i].layer >= 0) m.lora_of_layer[static_cast<size_t>(m.lora_specs[i].layer)].push_back(i);
      at += n;
    }
    m.adam->add(m.lora_master, at::ones({total}, m.f32()), m.lora_grad);  // decay on every adapter, as PEFT's
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
  if (!m.lora) return;
  // The adapters: `named`'s when it has them (every rank the same), else PEFT's initialisation.
  const bool given = named.count(m.lora_specs.front().name) > 0;
  const NamedTensors init = given ? NamedTensors{} : model::init_lora(m.cfg, m.opts.lora, m.opts.lora_seed);
  const NamedTensors& src = given ? named : init;
  model::ModelWeights probe;
  probe.layers.resize(static_cast<size_t>(m.cfg.num_layers));
  model::bind_lora(m.cfg, m.opts.lora, src, probe, where);  // every adapter present, with its shape
  for (size_t i = 0; i < m.lora_specs.size(); ++i) {
    if (static_cast<int64_t>(i) == m.lora_score) continue;
    m.lora_views[i].copy_(src.at(m.lora_specs[i].name));
  }
  // A value head's trained copy starts as the checkpoint's (fill_shard above has checked it).
  if (m.lora_score >= 0) m.lora_views[static_cast<size_t>(m.lora_score)].copy_(named.at("score.weight"));
}

void ShardedModel::load_hf(const std::string& dir) {
  model::CheckpointReader reader(dir);
  load(reader.all(), dir);
  impl_->source = dir;
}

namespace {

void check_lm(const Impl& m, const at::Tensor& targets, int64_t rows, double temperature) {
  TILLER_CHECK(m.opts.head == model::Head::kLm, "token_logprobs needs the LM head; this model has a value head");
  TILLER_CHECK(targets.dim() == 1 && targets.size(0) == rows, "{} targets for {} tokens", targets.numel(), rows);
  TILLER_CHECK(temperature > 0, "temperature must be > 0, got {}", temperature);
}

}  // namespace

namespace {

// A whole batch (no sequence parallelism) through the embedding and the blocks, then `head`
// (given the trunk's output and whether a graph is recorded).
template <typename Head>
at::Tensor whole_batch(Impl& m, const model::PackedBatch& batch, Head&& head) {
  TILLER_CHECK(m.sequence == nullptr, "a sequence-parallel model takes slices (SequenceSlice), not whole batches");
  model::BlockContext bctx =
      model::make_block_context(m.cfg, m.rope, batch, m.opts.compute_dtype, nullptr, m.opts.attention);
  m.fp8_context(bctx);
  const bool graph = m.opts.trainable && at::GradMode::is_enabled();
  if (graph) m.training_routing(bctx, batch.num_tokens());
  m.lora_context(bctx, graph, 0);
  c10::AutoGradMode grad_mode(graph);  // a frozen model records no graph even under autograd
  return head(run_trunk(m, batch.tokens, bctx, graph), graph);
}

}  // namespace

at::Tensor ShardedModel::token_logprobs(const model::PackedBatch& batch, const at::Tensor& targets, double temperature,
                                        at::Tensor* entropy) {
  Impl& m = *impl_;
  check_lm(m, targets, batch.num_tokens(), temperature);
  return whole_batch(m, batch, [&](const at::Tensor& x, bool graph) {
    return run_lm_head(m, x, targets.to(at::kLong), temperature, entropy, graph);
  });
}

at::Tensor ShardedModel::values(const model::PackedBatch& batch) {
  Impl& m = *impl_;
  TILLER_CHECK(m.opts.head == model::Head::kValue, "values needs the value head; this model has an LM head");
  return whole_batch(m, batch, [&](const at::Tensor& x, bool graph) { return run_value_head(m, x, graph); });
}

void ShardedModel::set_sequence_group(dist::Communicator& group, int context_parallel) {
  Impl& m = *impl_;
  check_sequence_parallel(m.cfg, group.size(), "sequence_parallel", context_parallel);
  TILLER_CHECK(group.size() == 1 || m.world % group.size() == 0 || m.opts.replicate,
               "a sequence group of {} ranks in a model group of {}", group.size(), m.world);
  m.sequence = group.size() > 1 ? &group : nullptr;
  m.heads_group.reset();
  m.keys_group.reset();
  m.sequence_groups = SequenceGroups{};
  if (!m.sequence) return;
  m.sequence_groups.whole = &group;
  if (context_parallel == 1) {
    m.sequence_groups.heads = &group;
    return;
  }
  // R groups of U consecutive ranks (Ulysses within), and the R ranks at the same place in them.
  const int u = group.size() / context_parallel, j = group.rank();
  m.heads_group = group.split(j / u, j, group.name() + ".heads");
  m.keys_group = group.split(j % u, j, group.name() + ".keys");
  TILLER_CHECK(m.heads_group && m.keys_group, "rank {} of sequence group {}: no head or key group", j, group.name());
  m.heads_group->set_timeout(group.timeout());
  m.keys_group->set_timeout(group.timeout());
  if (u > 1) m.sequence_groups.heads = m.heads_group.get();
  m.sequence_groups.keys = m.keys_group.get();
}

int ShardedModel::context_parallel() const {
  return impl_->sequence_groups.keys ? impl_->sequence_groups.keys->size() : 1;
}

void ShardedModel::set_fp8(std::optional<model::fp8::Scaling> scaling, bool fast_accumulation) {
  ShardedModelOptions o = impl_->opts;
  o.fp8 = scaling;
  check_fp8(o);
  impl_->opts.fp8 = scaling;
  impl_->opts.fp8_fast_accumulation = fast_accumulation;
}

void ShardedModel::set_recompute(Recompute mode, int64_t layers) {
  impl_->opts.recompute = mode;
  impl_->opts.recompute_layers = layers;
}

int ShardedModel::sequence_parallel() const { return impl_->sequence ? impl_->sequence->size() : 1; }

namespace {
// Routing replay: the slice's routes [n, width] as [n, sparse layers, k] for this model, checked.
SequenceSlice shaped_routes(const SequenceSlice& slice, const model::ModelConfig& cfg) {
  if (!slice.routes.defined() || slice.routes.dim() == 3) return slice;
  const int64_t layers = model::sparse_layers(cfg), k = cfg.experts_per_token;
  if (layers == 0)
    throw ConfigError("algo.routing_replay: the batch carries the engine's experts, but the actor is not a mixture of "
                      "experts");
  TILLER_CHECK(slice.routes.dim() == 2 && slice.routes.size(1) == layers * k,
               "routing replay: the engine's routes have {} experts a token, the model routes {} sparse layers x {}",
               slice.routes.dim() == 2 ? slice.routes.size(1) : -1, layers, k);
  SequenceSlice s = slice;
  s.routes = slice.routes.contiguous().view({slice.routes.size(0), layers, k});
  return s;
}
}  // namespace

at::Tensor ShardedModel::token_logprobs(const SequenceSlice& slice, const at::Tensor& targets, double temperature,
                                        at::Tensor* entropy) {
  Impl& m = *impl_;
  SliceInput in = prepare_slice(m.rope, shaped_routes(slice, m.cfg), m.sequence_groups, m.opts.compute_dtype, m.opts.device,
                                m.opts.attention);
  check_lm(m, targets, in.rows, temperature);
  at::Tensor tgt = targets.to(m.opts.device, at::kLong);
  if (in.padded > in.rows) tgt = at::cat({tgt, at::zeros({in.padded - in.rows}, tgt.options())});
  const bool graph = m.opts.trainable && at::GradMode::is_enabled();
  if (graph) m.training_routing(in.ctx, in.rows);  // this rank's real rows
  m.lora_context(in.ctx, graph, slice.first_row);
  m.fp8_context(in.ctx);
  c10::AutoGradMode grad_mode(graph);
  at::Tensor x = run_trunk(m, in.tokens, in.ctx, graph);
  at::Tensor lp = run_lm_head(m, x, tgt, temperature, entropy, graph);
  if (entropy) *entropy = entropy->narrow(0, 0, in.rows);
  return lp.narrow(0, 0, in.rows);
}

at::Tensor ShardedModel::values(const SequenceSlice& slice) {
  Impl& m = *impl_;
  TILLER_CHECK(m.opts.head == model::Head::kValue, "values needs the value head; this model has an LM head");
  SliceInput in = prepare_slice(m.rope, shaped_routes(slice, m.cfg), m.sequence_groups, m.opts.compute_dtype, m.opts.device,
                                m.opts.attention);
  const bool graph = m.opts.trainable && at::GradMode::is_enabled();
  if (graph) m.training_routing(in.ctx, in.rows);
  m.lora_context(in.ctx, graph, slice.first_row);
  m.fp8_context(in.ctx);
  c10::AutoGradMode grad_mode(graph);
  at::Tensor x = run_trunk(m, in.tokens, in.ctx, graph);
  at::Tensor v = run_value_head(m, x, graph);
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
    if (!u.grad.defined()) continue;  // a LoRA model's frozen base
    if (u.grad_fresh) u.grad.zero_();  // no gradient since zero_grad (see there)
    grads.push_back(u.grad);
  }
  at::Tensor sq;
  if (m.lora) {  // the adapters' gradients, whole on every rank: their sum over the ranks
    if (!m.local) m.comm.all_reduce(m.lora_grad, dist::ReduceOp::kSum)->wait();
    sq = m.lora_grad.pow(2).sum().reshape({1}).to(at::kDouble);
  } else {
    sq = at::stack(at::_foreach_norm(grads)).pow(2).sum().reshape({1}).to(at::kDouble);
    if (!m.local) m.comm.all_reduce(sq, dist::ReduceOp::kSum)->wait();
  }
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
      if (u.shard.defined() && u.master.defined() && !u.master.is_same(u.shard)) u.shard.copy_(u.master);
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
  if (m.lora) m.lora_grad.zero_();  // the adapters' (megabytes) accumulate in place
}

bool ShardedModel::lora() const { return impl_->lora; }

at::Tensor ShardedModel::lora_flat() const { return impl_->lora_master; }

NamedTensors ShardedModel::lora_parameters() const {
  const Impl& m = *impl_;
  NamedTensors out;
  for (size_t i = 0; i < m.lora_specs.size(); ++i) out.emplace(m.lora_specs[i].name, m.lora_views[i].to(at::kCPU).clone());
  return out;
}

void ShardedModel::set_adapters_enabled(bool on) {
  TILLER_CHECK(impl_->lora || on, "set_adapters_enabled(false) on a model without LoRA adapters");
  impl_->adapters_off = !on;
}

at::Tensor ShardedModel::take_expert_load() {
  at::Tensor out = impl_->expert_load;  // on the device when the experts ran grouped
  impl_->expert_load = at::Tensor();
  if (out.defined()) out = out.to(at::kCPU);
  return out;
}

at::Tensor ShardedModel::router_loss(double step_rows) {
  Impl& m = *impl_;
  if (m.router_terms.empty()) return at::Tensor();
  TILLER_CHECK(step_rows >= static_cast<double>(m.router_rows) && step_rows > 0,
               "router_loss: the optimizer step's rows ({}) are fewer than this forward's ({})", step_rows,
               m.router_rows);
  const double weight = static_cast<double>(m.router_rows) / step_rows;
  const double layers = static_cast<double>(m.router_terms.size());
  at::Tensor loss = m.router_terms.front();
  for (size_t i = 1; i < m.router_terms.size(); ++i) loss = loss + m.router_terms[i];
  m.router_terms.clear();
  const auto dev = at::TensorOptions().dtype(at::kDouble).device(loss.device());
  const at::Tensor aux = m.router.aux_sum.defined() ? m.router.aux_sum.to(at::kDouble) : at::zeros({}, dev);
  const at::Tensor z = m.router.z_sum.defined() ? m.router.z_sum.to(at::kDouble) : at::zeros({}, dev);
  const at::Tensor stats = at::stack({aux, z}) * (weight / layers);
  m.router_stats = m.router_stats.defined() ? m.router_stats + stats : stats;
  m.router = model::RouterLoss{m.opts.router_aux_coef, m.opts.router_z_coef, {}, {}, {}};
  return loss * (weight / layers);
}

at::Tensor ShardedModel::add_router_loss(const at::Tensor& loss, double step_rows) {
  const at::Tensor r = router_loss(step_rows);
  return r.defined() ? loss + r.to(loss.scalar_type()) : loss;
}

at::Tensor ShardedModel::take_router_stats() {
  Impl& m = *impl_;
  at::Tensor out = m.router_stats.defined() ? m.router_stats.to(at::kCPU) : at::zeros({2}, at::kDouble);
  m.router_stats = at::Tensor();
  return out;
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
    if (m.lora) {  // a frozen base: its moments are the adapters' (lora_state)
    } else if (m.adam) {
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

ShardedModel::LoraState ShardedModel::lora_state() const {
  const Impl& m = *impl_;
  TILLER_CHECK(m.lora, "lora_state() of a model without LoRA adapters");
  return {lora_parameters(), m.adam->exp_avg(0).to(at::kCPU), m.adam->exp_avg_sq(0).to(at::kCPU)};
}

void ShardedModel::load_lora_state(const NamedTensors& adapters, const at::Tensor& exp_avg,
                                   const at::Tensor& exp_avg_sq) {
  Impl& m = *impl_;
  TILLER_CHECK(m.lora, "load_lora_state() of a model without LoRA adapters");
  TILLER_CHECK(exp_avg.numel() == m.lora_master.numel() && exp_avg_sq.numel() == m.lora_master.numel(),
               "the adapters' moments hold {} and {} elements, the adapters {}", exp_avg.numel(), exp_avg_sq.numel(),
               m.lora_master.numel());
  for (size_t i = 0; i < m.lora_specs.size(); ++i) {
    const auto it = adapters.find(m.lora_specs[i].name);
    TILLER_CHECK(it != adapters.end() && it->second.sizes() == m.lora_views[i].sizes(), "the adapter '{}' is {}",
                 m.lora_specs[i].name, it == adapters.end() ? "missing" : "misshapen");
    m.lora_views[i].copy_(it->second);
  }
  m.adam->load_state(0, exp_avg.reshape({-1}).to(m.opts.device), exp_avg_sq.reshape({-1}).to(m.opts.device));
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
  // A LoRA model keeps everything: its optimizer state is the adapters' (megabytes), and its frozen
  // base scores the rollouts while the engines generate.
  if (m.lora || m.offloaded) return 0;
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
  if (m.lora) {  // the adapters: values and gradients in fp32 (their moments count in the optimizer's)
    r.parameters += m.lora_master.numel() * kF32;
    r.gradients += m.lora_grad.numel() * kF32;
  }
  if (m.adam) r.optimizer = m.adam->state_bytes();
  if (m.host_adam) r.host = m.host_adam->host_bytes();
  return r;
}

}  // namespace tiller::zero
