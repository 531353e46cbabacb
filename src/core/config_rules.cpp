// The config's rules (tiller/core/config.h): JobConfig::validate and the checks and derived values
// it answers with, each rule checked here once; config.cpp reads and writes the YAML.
#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "core/bitwise_rules.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"

namespace tiller {
namespace {

std::string format_double(double v) { return fmt::format("{}", v); }

bool is_trainer_role(const std::string& name) {
  return name == "actor" || name == "critic" || name == "ref" || name == "reward";
}

const RoleConfig& role_by_name(const JobConfig& c, const std::string& name) {
  return role_config(c, parse_role(name).value_or(Role::kReward));
}

}  // namespace

const RoleConfig& role_config(const JobConfig& c, Role r) {
  switch (r) {
    case Role::kActor: return c.roles.actor;
    case Role::kCritic: return c.roles.critic;
    case Role::kRef: return c.roles.ref;
    case Role::kReward: return c.roles.reward;
  }
  return c.roles.actor;
}

RoleConfig& role_config(JobConfig& c, Role r) { return const_cast<RoleConfig&>(role_config(std::as_const(c), r)); }

void JobConfig::validate() const {
  if (!roles.actor.enabled) throw ConfigError("roles.actor.enabled: the actor cannot be disabled");
  if (!roles.actor.colocate_with.empty()) {
    throw ConfigError("roles.actor.colocate_with: the actor owns its ranks; colocate the other roles with it instead");
  }
  for (const char* name : {"critic", "ref", "reward"}) {
    const RoleConfig& r = role_by_name(*this, name);
    if (!r.enabled || r.colocate_with.empty()) continue;
    const std::string& target = r.colocate_with;
    if (target == name) throw ConfigError(fmt::format("roles.{}.colocate_with: a role cannot be colocated with itself", name));
    if (!is_trainer_role(target) || !role_by_name(*this, target).enabled) {
      throw ConfigError(fmt::format("roles.{}.colocate_with = '{}': that role is disabled; enable it or colocate with 'actor'",
                                    name, target));
    }
    if (!role_by_name(*this, target).colocate_with.empty()) {
      throw ConfigError(fmt::format(
          "roles.{}.colocate_with = '{}': '{}' is itself colocated with '{}'; colocate with '{}' directly", name, target,
          target, role_by_name(*this, target).colocate_with, role_by_name(*this, target).colocate_with));
    }
  }
  if (engines.standalone()) {
    if (engines.count != 0)
      throw ConfigError(fmt::format("engines.addresses / engines.rendezvous_dir name standalone engines, and "
                                    "engines.count = {} asks for engine ranks too: a job's engines are one or the "
                                    "other; set engines.count=0",
                                    engines.count));
    if (cluster.hybrid)
      throw ConfigError("cluster.hybrid puts the engines in the actor's ranks; standalone engines "
                        "(engines.addresses, engines.rendezvous_dir) need cluster.hybrid=false");
    if (roles.actor.lora.rank > 0)
      throw ConfigError("roles.actor.lora with standalone engines: their push sends the full weights; LoRA's "
                        "adapter-only sync runs over the job's own engine ranks (engines.count)");
  }
  if (reward.type == RewardType::kModel && !roles.reward.enabled) {
    throw ConfigError("reward.type = model needs the reward role; set roles.reward.enabled=true and roles.reward.model");
  }
  if (reward.type != RewardType::kModel && roles.reward.enabled) {
    throw ConfigError(fmt::format("reward.type = {} does not use a reward model; set roles.reward.enabled=false "
                                  "or reward.type=model", enum_name(reward.type)));
  }
  if (eval.enabled()) {
    if (eval.every_steps == 0 && !eval.before_train)
      throw ConfigError("eval.prompts is set but nothing evaluates it: set eval.every_steps (after every N steps) "
                        "and/or eval.before_train: true");
    if (!eval.greedy && eval.n_samples == 0)
      throw ConfigError("eval: eval.greedy is false and eval.n_samples is 0: no sample to evaluate; set one");
    if (multi_turn())
      throw ConfigError(fmt::format("eval.prompts with {}: evaluation samples single-turn completions, not the {}; "
                                    "leave eval.prompts empty in multi-turn jobs",
                                    agent_loop() ? "rollout.loop openai_agent" : "env.type set",
                                    agent_loop() ? "harness's conversations" : "environment's episodes"));
    if (eval.reward_rule.empty() && (reward.type == RewardType::kModel || reward.type == RewardType::kEnv))
      throw ConfigError(fmt::format("eval with reward.type = {}: evaluation scores with a rule or the job's remote, "
                                    "Python or scorer reward; set eval.reward_rule (e.g. math_answer)",
                                    enum_name(reward.type)));
  }
  if (engines.tls_cert.empty() != engines.tls_key.empty())
    throw ConfigError("engines.tls_cert and engines.tls_key go together; give both (TLS) or neither");
  if (engines.tls_cert.empty() && (!engines.tls_ca.empty() || !engines.tls_server_name.empty()))
    throw ConfigError("engines.tls_ca and engines.tls_server_name need engines.tls_cert and engines.tls_key");
  if (reward.remote_tls_ca.empty() && !reward.remote_tls_server_name.empty())
    throw ConfigError("reward.remote_tls_server_name needs reward.remote_tls_ca (TLS)");
  if (reward.type == RewardType::kRemote && reward.remote_address.empty()) {
    throw ConfigError("reward.type = remote needs reward.remote_address (host:port)");
  }
  if (reward.type == RewardType::kScorer && reward.scorer.empty())
    throw ConfigError("reward.type = scorer needs reward.scorer: the name of a batch scorer a trainer of your own registers");
  if (reward.type == RewardType::kPython && reward.python.empty()) {
    throw ConfigError("reward.type = python needs reward.python (FILE.py:FUNCTION, e.g. rewards/gsm8k.py:compute_score)");
  }
  if (env.type == EnvType::kRemote && env.address.empty())
    throw ConfigError("env.type = remote needs env.address (host:port of the environment service)");
  if (env.type == EnvType::kInprocess && env.name.empty())
    throw ConfigError("env.type = inprocess needs env.name (the name given to tiller::env::register_env)");
  if (env.tls_ca.empty() && !env.tls_server_name.empty())
    throw ConfigError("env.tls_server_name needs env.tls_ca (TLS)");
  if (agent_loop()) {
    if (agent.harness.empty())
      throw ConfigError("rollout.loop = openai_agent needs agent.harness (FILE.py:FUNCTION, or a harness registered "
                        "in C++)");
    if (env.type != EnvType::kNone)
      throw ConfigError("rollout.loop = openai_agent with env.type set: the harness drives the conversation; set "
                        "env.type = none (or use the multi_turn loop)");
    if (!agent.command.empty() && agent.harness != "command")
      throw ConfigError(fmt::format("agent.command is set but agent.harness is '{}'; set agent.harness = command to "
                                    "run it", agent.harness));
  } else if (!agent.harness.empty()) {
    throw ConfigError("agent.harness is set but rollout.loop is not openai_agent; set rollout.loop = openai_agent");
  }
  if (!multi_turn()) {
    if (reward.type == RewardType::kEnv)
      throw ConfigError("reward.type = env takes the environment's (or an agent harness's) rewards; set env.type "
                        "(remote or inprocess), or rollout.loop = openai_agent");
    if (rollout.max_turns != 1)
      throw ConfigError(fmt::format("rollout.max_turns = {} needs an environment to answer the turns; set env.type "
                                    "(remote or inprocess) or leave max_turns at 1",
                                    rollout.max_turns));
    if (rollout.max_response_tokens != 0)
      throw ConfigError("rollout.max_response_tokens limits multi-turn samples; set env.type, or use "
                        "rollout.max_new_tokens");
  } else if (rollout.max_response_tokens != 0 && rollout.max_response_tokens < rollout.max_new_tokens) {
    throw ConfigError(fmt::format("rollout.max_response_tokens = {} is below rollout.max_new_tokens = {}; a turn "
                                  "could never use its whole budget: raise it or lower max_new_tokens",
                                  rollout.max_response_tokens, rollout.max_new_tokens));
  }
  if (response_limit() > (int64_t{1} << 24))
    throw ConfigError(fmt::format("rollout.max_new_tokens x rollout.max_turns = {} tokens per sample is over the "
                                  "limit of 16777216; set rollout.max_response_tokens",
                                  response_limit()));
  if (rollout.mode == RolloutMode::kSync) {
    if (rollout.max_staleness > 0)
      throw ConfigError(fmt::format("rollout.max_staleness = {} needs rollout.mode=async (sync mode is on-policy)",
                                    rollout.max_staleness));
    if (rollout.partial) throw ConfigError("rollout.partial needs rollout.mode=async (in sync mode no sample spans a sync)");
    if (rollout.stale_policy != StalePolicy::kWait)
      throw ConfigError("rollout.stale_policy = drop needs rollout.mode=async (in sync mode no sample is stale)");
  }
  if (rollout.filter_groups) {
    if (rollout.n_samples_per_prompt < 2)
      throw ConfigError("rollout.filter_groups compares the rewards of a prompt's samples; set "
                        "rollout.n_samples_per_prompt >= 2");
    if (reward.type == RewardType::kModel)
      throw ConfigError("rollout.filter_groups needs each group's rewards before it is scored; it works with "
                        "reward.type = rule, remote, python, scorer or env, not model");
  }
  if (algo.importance_correction == ImportanceCorrection::kTis && algo.tis_cap <= 0)
    throw ConfigError("algo.importance_correction = tis truncates the weights at algo.tis_cap; set it > 0 (e.g. 2)");
  if (algo.importance_correction == ImportanceCorrection::kMis && algo.tis_cap <= 1)
    throw ConfigError("algo.importance_correction = mis masks the weights outside [algo.is_cap_lower, algo.tis_cap]; "
                      "set algo.tis_cap > 1 (e.g. 2)");
  const bool leveled = algo.importance_correction == ImportanceCorrection::kTis ||
                       algo.importance_correction == ImportanceCorrection::kMis;
  if (algo.is_level != IsLevel::kToken && !leveled)
    throw ConfigError(fmt::format("algo.is_level = {} applies to algo.importance_correction tis or mis; set one",
                                  enum_name(algo.is_level)));
  if (algo.is_cap_lower != 0 && algo.importance_correction != ImportanceCorrection::kMis)
    throw ConfigError("algo.is_cap_lower is the lower bound of algo.importance_correction = mis; set mis or drop it");
  if (algo.importance_correction == ImportanceCorrection::kMis && algo.is_cap_lower >= algo.tis_cap)
    throw ConfigError(fmt::format("algo.is_cap_lower = {} must be below algo.tis_cap = {}",
                                  format_double(algo.is_cap_lower), format_double(algo.tis_cap)));
  if (algo.importance_correction == ImportanceCorrection::kNone && algo.tis_cap > 0)
    throw ConfigError(fmt::format("algo.tis_cap = {} has no effect with algo.importance_correction = none; set "
                                  "algo.importance_correction=tis (truncated importance sampling) or decoupled",
                                  format_double(algo.tis_cap)));
  if (algo.distill_coef > 0 && !roles.ref.enabled)
    throw ConfigError(fmt::format("algo.distill_coef = {} distills from the reference role, which is disabled: set "
                                  "roles.ref.enabled=true and roles.ref.model to the teacher",
                                  format_double(algo.distill_coef)));
  if (algo.logprob_match == LogprobMatch::kBitwise) {
    if (const std::string conflict = bitwise_engine_conflict(engines.quantization != EngineQuantization::kNone,
                                                             engines.kv_cache_dtype != KvCacheDtype::kAuto, engines.tp);
        !conflict.empty())
      throw ConfigError(conflict);
    for (const char* name : {"actor", "ref"})
      if (role_by_name(*this, name).enabled && role_by_name(*this, name).fp8)
        throw ConfigError(fmt::format("algo.logprob_match = bitwise needs roles.{}.fp8 = false: FP8 GEMMs are not the "
                                      "engine's bf16 products",
                                      name));
  }
  if (algo.seq_mask_ratio != 0.0 && algo.seq_mask_ratio <= 1.0)
    throw ConfigError(fmt::format("algo.seq_mask_ratio = {} must be 0 (off) or > 1", format_double(algo.seq_mask_ratio)));
  if (reward.overlong_buffer > response_limit())
    throw ConfigError(fmt::format("reward.overlong_buffer = {} exceeds the response limit {} ({})",
                                  reward.overlong_buffer, response_limit(),
                                  multi_turn() ? "rollout.max_response_tokens" : "rollout.max_new_tokens"));
  const std::int64_t samples = rollout.batch_size * rollout.n_samples_per_prompt;
  if (train.old_logprobs == OldLogprobs::kForward) {
    // The first training forward is the policy that sampled only if nothing trains in between and
    // nothing before training needs the actor's log-probs.
    const char* why = rollout.mode != RolloutMode::kSync ? "rollout.mode is async (samples may lag the weights)"
                      : algo.ppo_epochs != 1               ? "algo.ppo_epochs > 1 (later epochs train off-policy)"
                      : train.train_batch_size != samples  ? "train.train_batch_size < rollout.batch_size x "
                                                             "rollout.n_samples_per_prompt (later mini-batches train "
                                                             "off-policy)"
                      : algo.distill_coef > 0
                          ? "algo.distill_coef compares the student's log-probs with the teacher's before training"
                      : algo.kl_in_reward && algo.kl_coef > 0 && roles.ref.enabled
                          ? "algo.kl_in_reward needs the actor's log-probs before training (set algo.kl_in_reward=false "
                            "for the KL loss)"
                      : algo.importance_correction != ImportanceCorrection::kNone || algo.is_veto > 0
                          ? "algo.importance_correction (or algo.is_veto) compares the actor's log-probs with the "
                            "engine's before training"
                          : nullptr;
    if (why)
      throw ConfigError(fmt::format("train.old_logprobs = forward is for strictly on-policy runs, and {}; use "
                                    "train.old_logprobs=recompute",
                                    why));
  }
  if (algo.dual_clip != 0.0 && algo.dual_clip <= 1.0) {
    throw ConfigError(fmt::format("algo.dual_clip = {} must be 0 (off) or > 1", format_double(algo.dual_clip)));
  }
  for (const char* name : {"actor", "critic", "ref", "reward"}) {
    const RoleConfig& r = role_by_name(*this, name);
    if (r.enabled && r.fp8 && r.dtype != Precision::kBf16)
      throw ConfigError(fmt::format("roles.{}.fp8 keeps bf16 activations around its FP8 GEMMs; set roles.{}.dtype = "
                                    "bf16 or roles.{}.fp8 = false",
                                    name, name, name));
  }
  validate_hybrid();
  validate_sequence_parallel();
}

void JobConfig::validate_sequence_parallel() const {
  for (const char* name : {"actor", "critic", "ref", "reward"}) {
    const RoleConfig& r = role_by_name(*this, name);
    if (!r.enabled) continue;
    if (!r.colocate_with.empty()) {
      const RoleConfig& host = role_by_name(*this, r.colocate_with);
      if (host.sequence_parallel % r.context_parallel != 0)
        throw ConfigError(fmt::format("roles.{}.context_parallel = {} must divide the sequence_parallel = {} of '{}', "
                                      "whose ranks it shares",
                                      name, r.context_parallel, host.sequence_parallel, r.colocate_with));
      if (r.sequence_parallel != 1 && r.sequence_parallel != host.sequence_parallel)
        throw ConfigError(fmt::format("roles.{}.sequence_parallel = {}: the role shares the ranks of '{}', whose "
                                      "micro-batches are cut {} ways; leave it out or set it to {}",
                                      name, r.sequence_parallel, r.colocate_with, host.sequence_parallel,
                                      host.sequence_parallel));
      continue;
    }
    if (r.gpus % r.sequence_parallel != 0)
      throw ConfigError(fmt::format("roles.{}.sequence_parallel = {} must divide roles.{}.gpus = {} (the role's ranks "
                                    "form gpus / sequence_parallel groups that share a micro-batch)",
                                    name, r.sequence_parallel, name, r.gpus));
    if (r.sequence_parallel % r.context_parallel != 0)
      throw ConfigError(fmt::format("roles.{}.context_parallel = {} must divide roles.{}.sequence_parallel = {} (of the "
                                    "ranks sharing a micro-batch, that many groups split the keys)",
                                    name, r.context_parallel, name, r.sequence_parallel));
  }
}

void JobConfig::validate_hybrid() const {
  for (const char* name : {"ref", "reward"}) {
    const RoleConfig& r = role_by_name(*this, name);
    if (r.enabled && r.optimizer_offload != OptimizerOffload::kNone)
      throw ConfigError(fmt::format("roles.{}.optimizer_offload = {}: a frozen role has no optimizer; set it to none",
                                    name, enum_name(r.optimizer_offload)));
    if (r.enabled && (r.router_aux_loss_coef > 0 || r.router_z_loss_coef > 0))
      throw ConfigError(fmt::format("roles.{}.router_aux_loss_coef / router_z_loss_coef: a frozen role trains no "
                                    "router; set them to 0",
                                    name));
  }
  for (const char* name : {"actor", "critic", "ref", "reward"}) {
    const RoleConfig& r = role_by_name(*this, name);
    if (!r.enabled || !r.offload) continue;
    if (!cluster.hybrid)
      throw ConfigError(fmt::format("roles.{}.offload moves the trainer's state off the GPU while engines generate "
                                    "on it; it needs cluster.hybrid=true",
                                    name));
    if (std::string_view(name) == "ref" || std::string_view(name) == "reward")
      throw ConfigError(fmt::format("roles.{}.offload: a frozen role has no optimizer state to offload (its "
                                    "weights score during generation); set it to false",
                                    name));
  }
  if (!cluster.hybrid && cluster.hybrid_scoring != HybridScoring::kAuto)
    throw ConfigError(fmt::format("cluster.hybrid_scoring = {} chooses when a hybrid job's trainers score; it needs "
                                  "cluster.hybrid=true (leave it at auto)",
                                  enum_name(cluster.hybrid_scoring)));
  if (!cluster.hybrid) return;
  if (rollout.mode != RolloutMode::kSync)
    throw ConfigError("cluster.hybrid runs generation and training in turn on every GPU; rollout.mode=async needs "
                      "engines on GPUs of their own (cluster.hybrid=false)");
  if (cluster.ranks_per_gpu != 1)
    throw ConfigError(fmt::format("cluster.hybrid puts the engine in the actor rank's process; set "
                                  "cluster.ranks_per_gpu=1 (it is {})",
                                  cluster.ranks_per_gpu));
  if (roles.actor.gpus % engines.tp != 0)
    throw ConfigError(fmt::format("cluster.hybrid makes each engines.tp actor GPUs one engine: engines.tp = {} must "
                                  "divide roles.actor.gpus = {}",
                                  engines.tp, roles.actor.gpus));
  if (engines.count != 1 && engines.count != engine_count())
    throw ConfigError(fmt::format("engines.count = {}: with cluster.hybrid the engines are roles.actor.gpus / "
                                  "engines.tp = {}; leave engines.count out or set it to {}",
                                  engines.count, engine_count(), engine_count()));
}

std::int64_t JobConfig::response_limit() const {
  if (!multi_turn()) return rollout.max_new_tokens;
  if (rollout.max_response_tokens > 0) return rollout.max_response_tokens;
  return rollout.max_new_tokens * rollout.max_turns;  // both bounded (1 << 24, 1024): no overflow
}

BackendKind planned_backend(const ClusterConfig& cluster) {
  if (cluster.backend != BackendKind::kAuto) return cluster.backend;
  return cluster.device == DeviceKind::kCpu ? BackendKind::kMpi : BackendKind::kNccl;
}

bool JobConfig::hybrid_scores_after_generate(BackendKind backend) const {
  if (!cluster.hybrid) return false;
  switch (cluster.hybrid_scoring) {
    case HybridScoring::kOverlap: return false;
    case HybridScoring::kAfterGenerate: return true;
    case HybridScoring::kAuto: break;
  }
  return engines.tp > 1 && backend == BackendKind::kNccl;
}

bool JobConfig::ref_is_actor_base() const {
  return roles.actor.lora.rank > 0 && roles.ref.enabled && roles.ref.colocate_with == "actor" &&
         (roles.ref.model.empty() || roles.ref.model == roles.actor.model);
}

std::int64_t JobConfig::engine_count() const {
  return cluster.hybrid ? roles.actor.gpus / std::max<std::int64_t>(engines.tp, 1) : engines.count;
}

}  // namespace tiller
