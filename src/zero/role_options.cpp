// A role's ZeRO-3 options from its config (tiller/zero/sharded_model.h, recompute.h): the
// recompute modes' names, role_options, FP8, and the LoRA adapters a role starts from.
#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::zero {

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

Recompute recompute_of(RecomputeChoice c) {
  switch (c) {
    case RecomputeChoice::kAuto:
    case RecomputeChoice::kBlocks: return Recompute::kBlocks;
    case RecomputeChoice::kAttentionOnly: return Recompute::kAttentionOnly;
    case RecomputeChoice::kNone: return Recompute::kNone;
  }
  return Recompute::kBlocks;
}

RecomputeChoice recompute_choice(Recompute r) {
  switch (r) {
    case Recompute::kBlocks: return RecomputeChoice::kBlocks;
    case Recompute::kAttentionOnly: return RecomputeChoice::kAttentionOnly;
    case Recompute::kNone: return RecomputeChoice::kNone;
  }
  return RecomputeChoice::kBlocks;
}

ShardedModelOptions role_options(const std::string& name, const RoleConfig& role, const TrainConfig& train,
                                 bool trainable, model::Head head, at::Device device) {
  ShardedModelOptions o;
  o.head = head;
  o.device = device;
  o.trainable = trainable;
  o.compute_dtype = role.dtype == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
  if (role.replicate && trainable)
    throw ConfigError(fmt::format("roles.{}.replicate: only frozen roles (ref, reward) can be replicated; a trained "
                                  "role is always sharded", name));
  o.replicate = role.replicate;
  o.adamw = {train.adam_beta1, train.adam_beta2, train.adam_eps, train.weight_decay};
  o.max_grad_norm = train.max_grad_norm;
  // `auto` is resolved by the memory plan before the ranks build their models (tiller train);
  // unresolved it means the least memory.
  o.reduce_dtype = train.reduce_dtype == Precision::kBf16 ? at::kBFloat16 : at::kFloat;
  if (trainable) o.recompute = recompute_of(train.recompute);
  o.recompute_layers = train.recompute_layers;
  // compute_shard `auto` is resolved by the memory plan like recompute; unresolved, the least memory.
  o.keep_compute_shard = train.compute_shard == ComputeShard::kKeep;
  const bool on_host = role.optimizer_offload == OptimizerOffload::kCpu;
  if (on_host && !trainable)
    throw ConfigError(fmt::format("roles.{}.optimizer_offload = cpu: a frozen role has no optimizer", name));
  o.optimizer_on_host = on_host;
  o.optimizer_threads = static_cast<int>(train.optimizer_threads);
  o.role = name;
  if (!trainable && (role.router_aux_loss_coef > 0 || role.router_z_loss_coef > 0))
    throw ConfigError(fmt::format("roles.{}.router_aux_loss_coef / router_z_loss_coef: a frozen role trains no "
                                  "router; set them to 0",
                                  name));
  o.router_aux_coef = role.router_aux_loss_coef;
  o.router_z_coef = role.router_z_loss_coef;
  if (role.fp8)
    o.fp8 = role.fp8_scaling == Fp8Scaling::kChannel  ? model::fp8::Scaling::kChannel
            : role.fp8_scaling == Fp8Scaling::kTensor ? model::fp8::Scaling::kTensor
                                                      : model::fp8::Scaling::kBlock;
  o.fp8_fast_accumulation = role.fp8_fast_accumulation;
  return o;
}

std::string fp8_summary(const ShardedModelOptions& opts) {
  if (!opts.fp8) return "";
  const bool cores = model::fp8::tensor_cores(opts.device);
  return fmt::format("FP8 GEMMs in the blocks' projections ({} scales) {}{}", model::fp8::scaling_name(*opts.fp8),
                     cores ? "on tensor cores" : "emulated (no FP8 tensor cores here)",
                     cores && *opts.fp8 == model::fp8::Scaling::kTensor && opts.fp8_fast_accumulation
                         ? ", the forward's with fast accumulation"
                         : "");
}

model::LoraSpec lora_spec(const LoraConfig& lora, const model::ModelConfig& cfg, const std::string& key) {
  model::LoraSpec s;
  if (lora.rank <= 0) return s;
  s.rank = lora.rank;
  s.alpha = lora.alpha;
  s.use_rslora = lora.use_rslora;
  s.targets = model::lora_targets(lora.target_modules, cfg, key);
  return s;
}

void apply_lora(ShardedModelOptions& opts, const LoraConfig& lora, const model::ModelConfig& cfg, uint64_t seed) {
  if (lora.rank <= 0) return;
  opts.lora = lora_spec(lora, cfg, "roles." + opts.role + ".lora.target_modules");
  opts.lora_dropout = lora.dropout;
  opts.lora_seed = seed;
}

model::NamedTensors initial_adapters(const ShardedModelOptions& opts, const LoraConfig& lora,
                                     const model::ModelConfig& cfg) {
  TILLER_CHECK(opts.lora.enabled(), "initial_adapters: roles.{}.lora has no rank", opts.role);
  if (lora.init_from.empty()) return model::init_lora(cfg, opts.lora, opts.lora_seed);
  const model::PeftAdapter a = model::read_peft_adapter(lora.init_from, cfg);
  if (!(a.spec == opts.lora))
    throw ConfigError(fmt::format("roles.{}.lora.init_from = {}: its r {}, lora_alpha {}, use_rslora {} or target "
                                  "modules differ from roles.{}.lora's (rank {}, alpha {}); make them equal",
                                  opts.role, lora.init_from, a.spec.rank, a.spec.alpha, a.spec.use_rslora, opts.role,
                                  opts.lora.rank, opts.lora.alpha));
  return a.tensors;
}

}  // namespace tiller::zero
