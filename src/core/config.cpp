#include "tiller/core/config.h"

#include <algorithm>
#include <utility>
#include <cmath>
#include <map>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "config_schema.h"
#include "core/bitwise_rules.h"
#include "tiller/core/error.h"
#include "tiller/core/hub.h"
#include "tiller/core/files.h"
#include "tiller/core/spelling.h"

namespace tiller {
namespace {

using config_schema::Field;
using config_schema::Kind;

const Field* find_field(const std::string& path) {
  for (const Field& f : config_schema::fields()) {
    if (f.path == path) return &f;
  }
  return nullptr;
}

bool is_section(const std::string& path) {
  const std::string prefix = path + ".";
  for (const Field& f : config_schema::fields()) {
    if (f.path.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
  return parts;
}

// The valid key (or section) closest to `path` among those of the same depth and parent; if the
// parent itself is valid only its children are considered, so "roles.actor.gpu" suggests
// "roles.actor.gpus" and not "roles.critic.gpus".
std::string closest_key(const std::string& path) {
  const auto parts = split_path(path);
  const std::size_t depth = parts.size();
  std::string parent;
  for (std::size_t i = 0; i + 1 < depth; ++i) parent += (i ? "." : "") + parts[i];
  const bool parent_valid = parent.empty() || is_section(parent);
  std::string best;
  std::size_t best_d = SIZE_MAX;
  for (const Field& f : config_schema::fields()) {
    auto fp = split_path(f.path);
    if (fp.size() < depth) continue;
    std::string candidate;
    for (std::size_t i = 0; i < depth; ++i) candidate += (i ? "." : "") + fp[i];
    if (parent_valid && candidate.compare(0, parent.size(), parent) != 0) continue;
    std::size_t d = edit_distance(path, candidate);
    if (d < best_d) {
      best_d = d;
      best = candidate;
    }
  }
  return best;
}

std::string format_double(double v) { return fmt::format("{}", v); }

std::string range_text(const Field& f) {
  if (f.min && f.max) return fmt::format("[{}, {}]", format_double(*f.min), format_double(*f.max));
  if (f.min) return fmt::format(">= {}", format_double(*f.min));
  if (f.max) return fmt::format("<= {}", format_double(*f.max));
  return "";
}

std::string choices_text(const Field& f) {
  std::string out;
  for (const auto& c : f.choices) out += (out.empty() ? "" : ", ") + (c.empty() ? std::string("\"\"") : c);
  return out;
}

// A YAML node as JSON text: mappings and sequences as objects and arrays; a plain scalar as a
// bool (true/false), null (null, ~), or a number when it reads as one, else a string; a quoted
// scalar always a string.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += fmt::format("\\u{:04x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string yaml_to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    std::string out = "{";
    for (const auto& kv : n) out += (out.size() > 1 ? ", " : "") + json_string(kv.first.Scalar()) + ": " + yaml_to_json(kv.second);
    return out + "}";
  }
  if (n.IsSequence()) {
    std::string out = "[";
    for (const auto& item : n) out += (out.size() > 1 ? ", " : "") + yaml_to_json(item);
    return out + "]";
  }
  if (n.IsNull()) return "null";
  const std::string& v = n.Scalar();
  if (n.Tag() == "!") return json_string(v);  // quoted
  if (v == "true" || v == "True" || v == "TRUE") return "true";
  if (v == "false" || v == "False" || v == "FALSE") return "false";
  if (v == "null" || v == "~" || v == "Null" || v == "NULL") return "null";
  long long i;
  double d;
  if (YAML::convert<long long>::decode(n, i)) return std::to_string(i);
  if (YAML::convert<double>::decode(n, d) && std::isfinite(d)) return fmt::format("{}", d);
  return json_string(v);
}

// Sets field `f` of `config` from a YAML scalar. `where` is "file:line" or "--set".
void assign(JobConfig& config, const Field& f, const YAML::Node& value, const std::string& where) {
  const std::string shown = value.IsScalar() ? value.Scalar() : std::string();
  auto fail = [&](const std::string& why) {
    throw ConfigError(fmt::format("{}: {} {}", where, f.path, why));
  };
  if (value.IsNull() && f.kind != Kind::kString) fail("needs a value (" + std::string(kind_name(f.kind)) + ")");
  if (f.json_map) {  // a mapping, or its text ({"a": 1}: JSON is YAML), kept as a JSON object's text
    YAML::Node map = value;
    if (value.IsScalar() && !value.Scalar().empty()) {
      try {
        map = YAML::Load(value.Scalar());
      } catch (const YAML::Exception& e) {
        fail(fmt::format("= '{}' is not a mapping: {}", shown, e.msg));
      }
    }
    if (map.IsNull() || (map.IsScalar() && map.Scalar().empty())) {
      *static_cast<std::string*>(f.get(config)) = "";
      return;
    }
    if (!map.IsMap()) fail("must be a mapping of names to values ({enable_thinking: false})");
    *static_cast<std::string*>(f.get(config)) = yaml_to_json(map);
    return;
  }
  if (f.list && value.IsSequence()) {  // [a, b] is "a,b"
    std::string joined;
    for (const auto& item : value) {
      if (!item.IsScalar() || item.Scalar().empty() || item.Scalar().find(',') != std::string::npos)
        fail("must be a list of names");
      joined += (joined.empty() ? "" : ",") + item.Scalar();
    }
    *static_cast<std::string*>(f.get(config)) = joined;
    return;
  }
  if (!value.IsNull() && !value.IsScalar()) fail(fmt::format("must be a {}, not a list or mapping", kind_name(f.kind)));
  void* target = f.kind == Kind::kEnum ? nullptr : f.get(config);
  auto check_range = [&](double v) {
    if ((f.min && v < *f.min) || (f.max && v > *f.max)) {
      fail(fmt::format("= {} is out of range: must be in {}", shown, range_text(f)));
    }
  };
  switch (f.kind) {
    case Kind::kBool: {
      bool v;
      if (!YAML::convert<bool>::decode(value, v)) fail(fmt::format("= '{}' is not a bool (true or false)", shown));
      *static_cast<bool*>(target) = v;
      break;
    }
    case Kind::kInt: {
      long long v;
      if (!YAML::convert<long long>::decode(value, v)) fail(fmt::format("= '{}' is not an integer", shown));
      check_range(static_cast<double>(v));
      *static_cast<std::int64_t*>(target) = v;
      break;
    }
    case Kind::kDouble: {
      double v;
      if (!YAML::convert<double>::decode(value, v) || !std::isfinite(v)) {
        fail(fmt::format("= '{}' is not a number", shown));
      }
      check_range(v);
      *static_cast<double*>(target) = v;
      break;
    }
    case Kind::kString: {
      std::string v = value.IsNull() ? std::string() : value.Scalar();
      if (!f.choices.empty() && std::find(f.choices.begin(), f.choices.end(), v) == f.choices.end()) {
        fail(fmt::format("= '{}' is not one of {}", v, choices_text(f)));
      }
      *static_cast<std::string*>(target) = v;
      break;
    }
    case Kind::kEnum: {
      const std::string v = value.Scalar();
      const auto it = std::find(f.choices.begin(), f.choices.end(), v);
      if (it == f.choices.end()) fail(fmt::format("= '{}' is not one of {}", v, choices_text(f)));
      f.set_enum(config, static_cast<int>(it - f.choices.begin()));
      break;
    }
  }
}

// The value of `f` in `c` as text (YAML scalar without quotes).
std::string field_text(const JobConfig& config, const Field& f) {
  JobConfig& c = const_cast<JobConfig&>(config);  // Field::get is non-const; nothing is written
  switch (f.kind) {
    case Kind::kBool: return *static_cast<bool*>(f.get(c)) ? "true" : "false";
    case Kind::kInt: return std::to_string(*static_cast<std::int64_t*>(f.get(c)));
    case Kind::kDouble: return format_double(*static_cast<double*>(f.get(c)));
    case Kind::kString: return *static_cast<std::string*>(f.get(c));
    case Kind::kEnum: return f.choices.at(static_cast<size_t>(f.get_enum(config)));
  }
  return "";
}

// Keys that once existed: an error that says what replaced them (not a spelling suggestion).
void refuse_retired(const std::string& path, const std::string& where) {
  const std::string suffix = ".gradient_checkpointing";
  if (path.rfind("roles.", 0) == 0 && path.size() > suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0)
    throw ConfigError(fmt::format("{}: '{}' was replaced by train.recompute (auto, blocks, attention_only or none; "
                                  "blocks is what gradient_checkpointing: true did)",
                                  where, path));
}

void load_map(JobConfig& config, const YAML::Node& map, const std::string& prefix, const std::string& origin) {
  // YAML leaves a repeated key to the reader and yaml-cpp keeps both (the last one would win):
  // a repeated key or section is almost always an edit that went to the wrong place.
  std::map<std::string, int> seen;  // key -> its first line
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node& key = it->first;
    const int line = key.Mark().line + 1;
    const std::string where = fmt::format("{}:{}", origin, line);
    if (!key.IsScalar()) throw ConfigError(fmt::format("{}: keys must be plain names", where));
    const std::string path = prefix.empty() ? key.Scalar() : prefix + "." + key.Scalar();
    if (const auto [first, fresh] = seen.emplace(key.Scalar(), line); !fresh)
      throw ConfigError(fmt::format("{}: '{}' is given twice in this mapping (first at line {}); keep one", where, path,
                                    first->second));
    if (const Field* f = find_field(path)) {
      assign(config, *f, it->second, where);
    } else if (is_section(path)) {
      if (it->second.IsNull()) continue;  // "critic:" with nothing under it
      if (!it->second.IsMap()) {
        throw ConfigError(fmt::format("{}: '{}' is a section and must be a mapping of keys", where, path));
      }
      load_map(config, it->second, path, origin);
    } else {
      refuse_retired(path, where);
      throw ConfigError(fmt::format("{}: unknown key '{}'; did you mean '{}'?", where, path, closest_key(path)));
    }
  }
}

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
    if (r.enabled && r.fp8 && r.fp8_scaling == Fp8Scaling::kTensor)
      throw ConfigError(fmt::format("roles.{}.fp8_scaling = tensor is the engines' (engines.fp8_scaling); FP8 "
                                    "training takes block or channel",
                                    name));
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

void apply_override(JobConfig& config, const std::string& assignment) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ConfigError(fmt::format("--set '{}': expected key=value, e.g. --set rollout.batch_size=512", assignment));
  }
  const std::string path = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  const Field* f = find_field(path);
  if (f == nullptr) {
    if (is_section(path)) {
      throw ConfigError(fmt::format("--set {}: '{}' is a section; set one of its keys, e.g. {}", path, path,
                                    closest_key(path + ".x")));
    }
    refuse_retired(path, "--set " + path);
    throw ConfigError(fmt::format("--set {}: unknown key '{}'; did you mean '{}'?", path, path, closest_key(path)));
  }
  YAML::Node value;
  try {
    value = text.empty() ? YAML::Node(YAML::NodeType::Null) : YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("--set {}: cannot parse value '{}': {}", path, text, e.msg));
  }
  if ((f->kind == Kind::kString || f->kind == Kind::kEnum) && value.IsScalar()) value = YAML::Node(text);  // "007" as written
  assign(config, *f, value, "--set");
}

JobConfig parse_config(const std::string& yaml_text, const std::string& origin,
                       const std::vector<std::string>& overrides) {
  JobConfig config;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}:{}: invalid YAML: {}", origin, e.mark.line + 1, e.msg));
  }
  if (root.IsDefined() && !root.IsNull()) {
    if (!root.IsMap()) throw ConfigError(fmt::format("{}: the config must be a mapping of sections", origin));
    load_map(config, root, "", origin);
  }
  for (const auto& o : overrides) apply_override(config, o);
  resolve_hub_models(config, /*strict=*/false);  // hub ids in the local cache become their folders
  config.validate();
  return config;
}

JobConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  const auto text = read_file(path);
  if (!text) throw ConfigError(fmt::format("{}: cannot open the config file (does it exist?)", path));
  return parse_config(*text, path, overrides);
}

std::string to_yaml(const JobConfig& config) {
  JobConfig& c = const_cast<JobConfig&>(config);  // Field::get is non-const; nothing is written
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // sections currently open
  for (const Field& f : config_schema::fields()) {
    auto parts = split_path(f.path);
    std::vector<std::string> sec(parts.begin(), parts.end() - 1);
    std::size_t common = 0;
    while (common < open.size() && common < sec.size() && open[common] == sec[common]) ++common;
    while (open.size() > common) {
      out << YAML::EndMap;
      open.pop_back();
    }
    while (open.size() < sec.size()) {
      out << YAML::Key << sec[open.size()] << YAML::Value << YAML::BeginMap;
      open.push_back(sec[open.size()]);
    }
    out << YAML::Key << parts.back() << YAML::Value;
    switch (f.kind) {
      case Kind::kBool: out << *static_cast<bool*>(f.get(c)); break;
      case Kind::kInt: out << static_cast<long long>(*static_cast<std::int64_t*>(f.get(c))); break;
      case Kind::kDouble: out << field_text(c, f); break;
      case Kind::kString:
      case Kind::kEnum: out << YAML::DoubleQuoted << field_text(c, f); break;
    }
  }
  while (!open.empty()) {
    out << YAML::EndMap;
    open.pop_back();
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string config_reference_markdown() {
  JobConfig defaults;
  std::string md =
      "# Configuration reference\n\n"
      "A tiller job is one YAML file with the sections below. Every key is optional; the default is\n"
      "shown. `--set a.b=c` on the command line overrides any key (the value in YAML syntax), and\n"
      "`tiller config -c FILE [--set ...]` prints the effective config.\n\n"
      "An unknown key is an error that names the key path, file and line and the closest valid key;\n"
      "a value of the wrong type or out of range names the key, the value and what is allowed.\n\n"
      "**Relative paths** (models, data, eval prompts, output and checkpoint folders, Python files)\n"
      "are relative to the directory tiller is started in, not to the config file: the bundled\n"
      "configs are written to run from the repository's root (`mpirun ... tiller train -c\n"
      "configs/quickstart.yaml`). From elsewhere, give absolute paths or `--set` them.\n\n"
      "This page is generated from the schema in `src/core/config_schema.cpp` by\n"
      "`tiller config --reference`; a unit test fails when it is out of date.\n";
  for (const auto& s : config_schema::sections()) {
    std::string rows;
    for (const Field& f : config_schema::fields()) {
      auto parts = split_path(f.path);
      std::string sec;
      for (std::size_t i = 0; i + 1 < parts.size(); ++i) sec += (i ? "." : "") + parts[i];
      if (sec != s.path) continue;
      std::string def = field_text(defaults, f);
      if (f.kind == Kind::kString || f.kind == Kind::kEnum) def = "\"" + def + "\"";
      std::string allowed = f.choices.empty() ? range_text(f) : "one of " + choices_text(f);
      rows += fmt::format("| `{}` | {} | `{}` | {} | {} |\n", f.path, kind_name(f.kind), def, allowed, f.doc);
    }
    md += fmt::format("\n## `{}`\n\n{}\n", s.path, s.doc);
    if (!rows.empty()) {
      md += "\n| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n" + rows;
    }
  }
  md +=
      "\n## Checks across keys\n\n"
      "- The actor is always enabled and never colocated; a colocated role names an enabled role that is not\n"
      "  itself colocated.\n"
      "- `algo.advantage_estimator` is a registered estimator; one that needs a critic (gae) needs the critic\n"
      "  enabled, the others need it disabled; group baselines (rloo, reinforce_baseline, group_norm,\n"
      "  dr_grpo) need `rollout.n_samples_per_prompt >= 2`; `algo.kl_estimator` is a registered KL estimator\n"
      "  (checked by `algo::check_config`, after loading).\n"
      "- `reward.type: model` needs the reward role enabled, and the other types need it disabled;\n"
      "  `reward.type: remote` needs `reward.remote_address`, `python` `reward.python`, `scorer` `reward.scorer`\n"
      "  (a registered batch scorer, checked when the job starts).\n"
      "- `tiller train`: `train.train_batch_size` divides `rollout.batch_size x rollout.n_samples_per_prompt`\n"
      "  (checked by `algo::check_config`; for sft, train-rm and dpo it is the records per step, free).\n"
      "- `algo.dual_clip` is 0 (off) or greater than 1; `algo.seq_mask_ratio` is 0 (off) or greater than 1.\n"
      "- `algo.importance_correction: tis` needs `algo.tis_cap > 0`, `mis` needs `algo.tis_cap > 1`; `algo.tis_cap > 0` "
      "needs a correction; `algo.is_level` other than token needs tis or mis, `algo.is_cap_lower` needs mis and lies "
      "below the cap.\n"
      "- `rollout.mode: sync` takes no `max_staleness > 0`, `partial` or `stale_policy: drop` (they are async's).\n"
      "- `rollout.filter_groups` needs `n_samples_per_prompt >= 2` and a reward other than `model`.\n"
      "- `reward.overlong_buffer` is at most `rollout.max_new_tokens` (with an environment, the sample's\n"
      "  response limit).\n"
      "- `env.type: remote` needs `env.address`, `inprocess` needs `env.name`; `reward.type: env`,\n"
      "  `rollout.max_turns > 1` and `rollout.max_response_tokens` need an environment;\n"
      "  `max_response_tokens` is 0 or at least `max_new_tokens`.\n"
      "- The rank plan (`tiller plan`) checks that the roles and engines fit the nodes; see docs/architecture.md.\n";
  return md;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const Field& f : config_schema::fields()) keys.push_back(f.path);
  return keys;
}

}  // namespace tiller
