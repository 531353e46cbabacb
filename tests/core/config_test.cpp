#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "core/config_schema.h"
#include "tiller/algo/advantage_estimator.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/hub.h"
#include "tiller/model/model_config.h"
#include "tiller/zero/sequence_parallel.h"

namespace tiller {
namespace {

// The message of the ConfigError that `f` throws ("" if none).
template <typename F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// Models by hub id, from a Hugging Face cache laid out here as huggingface_hub lays it out
// (models--org--name/refs/<revision>, snapshots/<commit>/): a revision's ref or a commit; a local
// folder of the same name wins; an id not in the cache stays as it is for tiller plan and config,
// and is an error naming the key and the download command for the commands that load it.
TEST(Config, HubModelIdsResolveThroughTheHuggingFaceCache) {
  namespace fs = std::filesystem;
  const fs::path cache = fs::path(TILLER_TEST_SCRATCH) / "hf_cache";
  fs::remove_all(cache);
  const std::string main_commit(40, 'a'), pinned(40, 'b');
  for (const std::string& c : {main_commit, pinned}) {
    fs::create_directories(cache / "models--Org--Tiny-Chat" / "snapshots" / c);
    std::ofstream(cache / "models--Org--Tiny-Chat" / "snapshots" / c / "config.json") << "{}";
  }
  fs::create_directories(cache / "models--Org--Tiny-Chat" / "refs");
  std::ofstream(cache / "models--Org--Tiny-Chat" / "refs" / "main") << main_commit << "\n";
  const char* old = std::getenv("HF_HUB_CACHE");
  const std::string saved = old ? old : "";
  setenv("HF_HUB_CACHE", cache.c_str(), 1);
  const std::string snap = (cache / "models--Org--Tiny-Chat" / "snapshots").string() + "/";
  JobConfig c = parse_config("roles: {actor: {model: Org/Tiny-Chat}, critic: {model: 'Org/Tiny-Chat@" + pinned + "'}}\n",
                             "hub.yaml", {});
  EXPECT_EQ(c.roles.actor.model, snap + main_commit);
  EXPECT_EQ(c.roles.critic.model, snap + pinned);
  ASSERT_TRUE(parse_hub_id("Org/Tiny-Chat@v2"));
  EXPECT_EQ(parse_hub_id("Org/Tiny-Chat@v2")->revision, "v2");
  EXPECT_FALSE(parse_hub_id("models/tiny-qwen2/x"));  // a path
  EXPECT_FALSE(parse_hub_id("./Org/Tiny-Chat"));
  EXPECT_FALSE(parse_hub_id("/abs/path"));
  // Not in the cache: kept by the reader, refused with the command to run when it must load.
  c = parse_config("roles: {actor: {model: Org/Missing}}\n", "hub.yaml", {});
  EXPECT_EQ(c.roles.actor.model, "Org/Missing");
  try {
    resolve_hub_models(c, true);
    FAIL() << "a hub id that is not in the cache";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("roles.actor.model = 'Org/Missing': no such folder"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("huggingface-cli download Org/Missing --revision main"), std::string::npos) << e.what();
  }
  // A revision the cache does not have.
  c = parse_config("roles: {actor: {model: 'Org/Tiny-Chat@v9'}}\n", "hub.yaml", {});
  EXPECT_THROW(resolve_hub_models(c, true), ConfigError);
  // HF_HOME's hub folder when HF_HUB_CACHE is not set.
  unsetenv("HF_HUB_CACHE");
  setenv("HF_HOME", cache.parent_path().c_str(), 1);
  EXPECT_EQ(hub_cache_dir(), cache.parent_path().string() + "/hub");
  unsetenv("HF_HOME");
  if (old) setenv("HF_HUB_CACHE", saved.c_str(), 1);
}

TEST(Config, EmptyFileGivesDefaults) {
  JobConfig c = parse_config("", "empty.yaml");
  EXPECT_EQ(c.run.name, "tiller");
  EXPECT_EQ(c.roles.actor.gpus, 1);
  EXPECT_EQ(c.roles.ref.colocate_with, "actor");
  EXPECT_FALSE(c.roles.reward.enabled);
  EXPECT_DOUBLE_EQ(c.timeouts.collective_s, 600.0);
}

TEST(Config, ReadsEveryKind) {
  JobConfig c = parse_config(R"(
run: {name: exp1, seed: 7}
roles:
  actor: {model: /m/qwen, gpus: 4, dtype: fp32}
  critic: {enabled: false}
algo: {advantage_estimator: group_norm, kl_coef: 0.05}
rollout: {batch_size: 8, n_samples_per_prompt: 4}
train: {train_batch_size: 16}
timeouts: {collective_s: 1.5}
)",
                             "t.yaml");
  EXPECT_EQ(c.run.name, "exp1");
  EXPECT_EQ(c.run.seed, 7);
  EXPECT_EQ(c.roles.actor.model, "/m/qwen");
  EXPECT_EQ(c.roles.actor.gpus, 4);
  EXPECT_EQ(c.roles.actor.dtype, Precision::kFp32);
  EXPECT_FALSE(c.roles.critic.enabled);
  EXPECT_EQ(c.algo.advantage_estimator, "group_norm");
  EXPECT_DOUBLE_EQ(c.algo.kl_coef, 0.05);
  EXPECT_DOUBLE_EQ(c.timeouts.collective_s, 1.5);
}

TEST(Config, UnknownKeyNamesPathFileLineAndClosestKey) {
  auto msg = config_error([] { parse_config("run:\n  name: x\nroles:\n  actor:\n    gpu: 4\n", "job.yaml"); });
  EXPECT_EQ(msg, "job.yaml:5: unknown key 'roles.actor.gpu'; did you mean 'roles.actor.gpus'?");
  msg = config_error([] { parse_config("rollut:\n  batch_size: 4\n", "job.yaml"); });
  EXPECT_EQ(msg, "job.yaml:1: unknown key 'rollut'; did you mean 'rollout'?");
  msg = config_error([] { parse_config("roles:\n  actr:\n    gpus: 4\n", "job.yaml"); });
  EXPECT_EQ(msg, "job.yaml:2: unknown key 'roles.actr'; did you mean 'roles.actor'?");
  // A retired key says what replaced it.
  msg = config_error([] { parse_config("roles:\n  critic:\n    gradient_checkpointing: false\n", "job.yaml"); });
  EXPECT_EQ(msg, "job.yaml:3: 'roles.critic.gradient_checkpointing' was replaced by train.recompute (auto, blocks, "
                 "attention_only or none; blocks is what gradient_checkpointing: true did)");
  msg = config_error([] { parse_config("", "j.yaml", {"roles.actor.gradient_checkpointing=true"}); });
  EXPECT_NE(msg.find("--set roles.actor.gradient_checkpointing: 'roles.actor.gradient_checkpointing' was replaced by "
                     "train.recompute"),
            std::string::npos)
      << msg;
  msg = config_error([] { parse_config("train:\n  old_logprobs: forward\n", "job.yaml"); });
  EXPECT_NE(msg.find("train.old_logprobs = forward is for strictly on-policy runs, and algo.kl_in_reward needs"),
            std::string::npos)
      << msg;
  msg = config_error([] {
    parse_config("train:\n  old_logprobs: forward\n  train_batch_size: 2\nalgo:\n  kl_in_reward: false\n", "job.yaml");
  });
  EXPECT_NE(msg.find("and train.train_batch_size < rollout.batch_size x rollout.n_samples_per_prompt"), std::string::npos)
      << msg;
  msg = config_error([] { parse_config("train:\n  recompute: some\n", "job.yaml"); });
  EXPECT_NE(msg.find("train.recompute"), std::string::npos) << msg;
}

TEST(Config, WrongTypeNamesKeyAndValue) {
  auto msg = config_error([] { parse_config("roles:\n  actor:\n    gpus: four\n", "j.yaml"); });
  EXPECT_EQ(msg, "j.yaml:3: roles.actor.gpus = 'four' is not an integer");
  msg = config_error([] { parse_config("data:\n  shuffle: maybe\n", "j.yaml"); });
  EXPECT_EQ(msg, "j.yaml:2: data.shuffle = 'maybe' is not a bool (true or false)");
  msg = config_error([] { parse_config("rollout:\n  temperature: hot\n", "j.yaml"); });
  EXPECT_EQ(msg, "j.yaml:2: rollout.temperature = 'hot' is not a number");
  msg = config_error([] { parse_config("roles:\n  actor:\n    gpus: [1, 2]\n", "j.yaml"); });
  EXPECT_EQ(msg, "j.yaml:3: roles.actor.gpus must be a int, not a list or mapping");
  msg = config_error([] { parse_config("roles: 3\n", "j.yaml"); });
  EXPECT_EQ(msg, "j.yaml:1: 'roles' is a section and must be a mapping of keys");
}

// data.chat_template_kwargs: a YAML mapping (or its text, from --set or a printed config) becomes a
// JSON object's text, values typed as YAML reads them; anything else names the key.
TEST(Config, ChatTemplateKwargsAreAMappingKeptAsJson) {
  JobConfig c = parse_config("data:\n  chat_template_kwargs: {enable_thinking: false, n: 3, x: 0.5, s: '1', t: hi}\n",
                             "j.yaml");
  EXPECT_EQ(c.data.chat_template_kwargs, R"({"enable_thinking": false, "n": 3, "x": 0.5, "s": "1", "t": "hi"})");
  c = parse_config("", "j.yaml", {"data.chat_template_kwargs={enable_thinking: true, tags: [a, b]}"});
  EXPECT_EQ(c.data.chat_template_kwargs, R"({"enable_thinking": true, "tags": ["a", "b"]})");
  c = parse_config("data:\n  chat_template_kwargs: '{\"enable_thinking\": false}'\n", "j.yaml");  // as text
  EXPECT_EQ(c.data.chat_template_kwargs, R"({"enable_thinking": false})");
  JobConfig printed = parse_config(to_yaml(c), "printed.yaml");
  EXPECT_EQ(printed.data.chat_template_kwargs, c.data.chat_template_kwargs);
  EXPECT_EQ(parse_config("data:\n  chat_template_kwargs:\n", "j.yaml").data.chat_template_kwargs, "");
  EXPECT_EQ(config_error([] { parse_config("data:\n  chat_template_kwargs: [1, 2]\n", "j.yaml"); }),
            "j.yaml:2: data.chat_template_kwargs must be a mapping of names to values ({enable_thinking: false})");
}

TEST(Config, OutOfRangeAndChoices) {
  // Sizes that are multiplied together (the filter cap, the staleness gate) have bounds.
  EXPECT_EQ(config_error([] { parse_config("rollout:\n  batch_size: 99999999999\n", "j.yaml"); }),
            "j.yaml:2: rollout.batch_size = 99999999999 is out of range: must be in [1, 16777216]");
  EXPECT_EQ(config_error([] { parse_config("rollout:\n  max_staleness: 9\n", "j.yaml"); }),
            "j.yaml:2: rollout.max_staleness = 9 is out of range: must be in [-1, 8]");
  EXPECT_EQ(config_error([] { parse_config("rollout:\n  mode: later\n", "j.yaml"); }),
            "j.yaml:2: rollout.mode = 'later' is not one of sync, async");
  auto msg = config_error([] { parse_config("engines:\n  tp: 0\n", "j.yaml"); });
  EXPECT_EQ(msg, "j.yaml:2: engines.tp = 0 is out of range: must be in [1, 64]");
  msg = config_error([] { parse_config("rollout:\n  top_p: 1.5\n", "j.yaml"); });
  EXPECT_EQ(msg, "j.yaml:2: rollout.top_p = 1.5 is out of range: must be in [0, 1]");
}

// Every number a user gives has an upper bound, so no sum or product of a few of them wraps and
// no size becomes an allocation that kills a rank (a max_new_tokens of 2^62 once did).
TEST(Config, EveryNumberHasBounds) {
  EXPECT_EQ(config_error([] { parse_config("rollout:\n  max_new_tokens: 4611686018427387904\n", "j.yaml"); }),
            "j.yaml:2: rollout.max_new_tokens = 4611686018427387904 is out of range: must be in [1, 16777216]");
  int numbers = 0;
  for (const config_schema::Field& f : config_schema::fields()) {
    if (f.kind != config_schema::Kind::kInt && f.kind != config_schema::Kind::kDouble) continue;
    ++numbers;
    for (const char* huge : {"9223372036854775807", "1e300"}) {
      if (f.kind == config_schema::Kind::kInt && std::string(huge) == "1e300") continue;
      JobConfig c;
      const std::string msg = config_error([&] { apply_override(c, f.path + "=" + huge); });
      EXPECT_NE(msg.find(f.path + " = " + huge + " is out of range"), std::string::npos) << f.path << ": " << msg;
    }
  }
  EXPECT_GT(numbers, 60);
}

TEST(Config, RepeatedKeysAreRefusedWithBothLines) {
  EXPECT_EQ(config_error([] { parse_config("rollout:\n  batch_size: 4\n  batch_size: 8\n", "j.yaml"); }),
            "j.yaml:3: 'rollout.batch_size' is given twice in this mapping (first at line 2); keep one");
  EXPECT_EQ(config_error([] { parse_config("rollout:\n  batch_size: 4\nalgo:\n  gamma: 1\nrollout:\n  top_p: 0.5\n",
                                           "j.yaml"); }),
            "j.yaml:5: 'rollout' is given twice in this mapping (first at line 1); keep one");
  // The same key in two sections is not a repeat.
  EXPECT_EQ(config_error([] { parse_config("roles:\n  actor: {gpus: 2}\n  critic: {gpus: 2}\n", "j.yaml"); }), "");
}

TEST(Config, InvalidYamlNamesLine) {
  auto msg = config_error([] { parse_config("run:\n  name: [unclosed\n", "j.yaml"); });
  EXPECT_NE(msg.find("j.yaml:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("invalid YAML"), std::string::npos) << msg;
}

TEST(Config, SetOverridesAnyKey) {
  JobConfig c = parse_config("rollout:\n  batch_size: 4\n", "j.yaml",
                             {"rollout.batch_size=512", "roles.actor.model=/x/y", "run.name=007", "data.shuffle=false",
                              "algo.gamma=0.5", "checkpoint.dir="});
  EXPECT_EQ(c.rollout.batch_size, 512);
  EXPECT_EQ(c.roles.actor.model, "/x/y");
  EXPECT_EQ(c.run.name, "007");  // a string stays as written
  EXPECT_FALSE(c.data.shuffle);
  EXPECT_DOUBLE_EQ(c.algo.gamma, 0.5);
  EXPECT_EQ(c.checkpoint.dir, "");
}

TEST(Config, SetErrors) {
  EXPECT_EQ(config_error([] { parse_config("", "j.yaml", {"roles.actor.gpu=3"}); }),
            "--set roles.actor.gpu: unknown key 'roles.actor.gpu'; did you mean 'roles.actor.gpus'?");
  EXPECT_EQ(config_error([] { parse_config("", "j.yaml", {"rollout.batch_size"}); }),
            "--set 'rollout.batch_size': expected key=value, e.g. --set rollout.batch_size=512");
  EXPECT_EQ(config_error([] { parse_config("", "j.yaml", {"engines.tp=-2"}); }),
            "--set: engines.tp = -2 is out of range: must be in [1, 64]");
  auto msg = config_error([] { parse_config("", "j.yaml", {"roles.actor=3"}); });
  EXPECT_NE(msg.find("'roles.actor' is a section"), std::string::npos) << msg;
}

TEST(Config, CrossKeyChecks) {
  EXPECT_NE(config_error([] { parse_config("reward: {type: model}", "j"); }).find("needs the reward role"),
            std::string::npos);
  EXPECT_NE(config_error([] { parse_config("roles: {critic: {colocate_with: critic}}", "j"); }).find("itself"),
            std::string::npos);
  EXPECT_NE(config_error([] { parse_config("roles: {critic: {colocate_with: ref}}", "j"); })
                .find("'ref' is itself colocated with 'actor'"),
            std::string::npos);
  // An RL job's rule (algo::check_config); the offline trainers read train_batch_size as records
  // per step, so the config alone accepts it.
  const char* odd = "rollout: {batch_size: 3}\ntrain: {train_batch_size: 2}";
  EXPECT_NO_THROW(parse_config(odd, "j"));
  EXPECT_NE(config_error([&] { algo::check_config(parse_config(odd, "j")); }).find("must divide"), std::string::npos);
  // Distillation needs its teacher, the reference role.
  EXPECT_NE(config_error([] { parse_config("algo: {distill_coef: 1}\nroles: {ref: {enabled: false}}", "j"); })
                .find("algo.distill_coef = 1 distills from the reference role, which is disabled"),
            std::string::npos);
  EXPECT_NO_THROW(parse_config("algo: {distill_coef: 1, kl_coef: 0}", "j"));
  // The bitwise mode needs the engine's K/V as the trainer's: no FP8 KV cache.
  EXPECT_NO_THROW(parse_config("engines: {kv_cache_dtype: fp8}", "j"));
  EXPECT_NE(config_error([] { parse_config("algo: {logprob_match: bitwise}\nengines: {kv_cache_dtype: fp8}", "j"); })
                .find("needs engines.kv_cache_dtype = auto"),
            std::string::npos);
  // Tensor scaling for the engines and for FP8 training; an unknown scaling names its key.
  EXPECT_NO_THROW(parse_config("engines: {quantization: fp8, fp8_scaling: tensor}", "j"));
  EXPECT_EQ(parse_config("roles: {actor: {fp8: true, fp8_scaling: tensor}}", "j").roles.actor.fp8_scaling,
            Fp8Scaling::kTensor);
  EXPECT_NE(config_error([] { parse_config("roles: {actor: {fp8: true, fp8_scaling: rows}}", "j"); })
                .find("roles.actor.fp8_scaling"),
            std::string::npos);
  // The forward's fast accumulation: on unless the role says otherwise, for each role.
  EXPECT_TRUE(parse_config("roles: {actor: {fp8: true}}", "j").roles.actor.fp8_fast_accumulation);
  EXPECT_FALSE(
      parse_config("roles: {ref: {fp8: true, fp8_fast_accumulation: false}}", "j").roles.ref.fp8_fast_accumulation);
  EXPECT_NE(config_error([] { parse_config("roles: {actor: {fp8_fast_accumulation: sometimes}}", "j"); })
                .find("roles.actor.fp8_fast_accumulation"),
            std::string::npos);
}

TEST(Config, HybridRules) {
  auto err = [](const std::string& yaml) { return config_error([&] { parse_config(yaml, "j"); }); };
  EXPECT_NE(err("cluster: {hybrid: true}\nrollout: {mode: async}").find("rollout.mode=async needs engines on GPUs"),
            std::string::npos);
  EXPECT_NE(err("cluster: {hybrid: true}\nroles: {actor: {gpus: 3}}\nengines: {tp: 2}")
                .find("engines.tp = 2 must divide roles.actor.gpus = 3"),
            std::string::npos);
  EXPECT_NE(err("cluster: {hybrid: true}\nroles: {actor: {gpus: 4}}\nengines: {count: 3}")
                .find("engines.count = 3: with cluster.hybrid the engines are roles.actor.gpus / engines.tp = 4"),
            std::string::npos);
  EXPECT_NE(err("roles: {actor: {offload: true}}").find("roles.actor.offload"), std::string::npos);
  EXPECT_NE(err("cluster: {hybrid: true}\nroles: {ref: {offload: true}}").find("a frozen role has no optimizer"),
            std::string::npos);
  EXPECT_NE(err("cluster: {hybrid: true, ranks_per_gpu: 2}").find("cluster.ranks_per_gpu=1"), std::string::npos);
  const JobConfig ok = parse_config("cluster: {hybrid: true}\nroles: {actor: {gpus: 8, offload: true}}\n"
                                    "engines: {tp: 2, sleep_level: 2}", "j");
  EXPECT_EQ(ok.engine_count(), 4);
}

// Router losses train a router: a frozen role has none to train; the coefficients are bounded.
TEST(Config, RouterLossRules) {
  auto err = [](const std::string& yaml) { return config_error([&] { parse_config(yaml, "j"); }); };
  EXPECT_NE(err("roles: {ref: {router_aux_loss_coef: 0.01}}")
                .find("roles.ref.router_aux_loss_coef / router_z_loss_coef: a frozen role trains no router"),
            std::string::npos);
  EXPECT_NE(err("reward: {type: model}\nroles: {reward: {enabled: true, model: m, router_z_loss_coef: 0.01}}")
                .find("roles.reward.router_aux_loss_coef / router_z_loss_coef: a frozen role"),
            std::string::npos);
  EXPECT_NE(err("roles: {actor: {router_aux_loss_coef: -1}}").find("roles.actor.router_aux_loss_coef"),
            std::string::npos);
  EXPECT_NE(err("roles: {critic: {router_z_loss_coef: 1000}}").find("roles.critic.router_z_loss_coef"),
            std::string::npos);
  const JobConfig ok = parse_config("roles: {actor: {router_aux_loss_coef: 0.001, router_z_loss_coef: 0.0001}}", "j");
  EXPECT_DOUBLE_EQ(ok.roles.actor.router_aux_loss_coef, 0.001);
  EXPECT_DOUBLE_EQ(ok.roles.actor.router_z_loss_coef, 0.0001);
}

TEST(Config, SequenceParallelRules) {
  auto err = [](const std::string& yaml) { return config_error([&] { parse_config(yaml, "j"); }); };
  EXPECT_NE(err("roles: {actor: {gpus: 3, sequence_parallel: 2}}")
                .find("roles.actor.sequence_parallel = 2 must divide roles.actor.gpus = 3"),
            std::string::npos);
  EXPECT_NE(err("roles: {actor: {gpus: 4, sequence_parallel: 2}, ref: {sequence_parallel: 4}}")
                .find("roles.ref.sequence_parallel = 4: the role shares the ranks of 'actor', whose micro-batches are "
                      "cut 2 ways"),
            std::string::npos);
  EXPECT_NE(err("roles: {actor: {sequence_parallel: 0}}").find("roles.actor.sequence_parallel"), std::string::npos);
  EXPECT_NO_THROW(parse_config("roles: {actor: {gpus: 4, sequence_parallel: 4}, critic: {gpus: 2, "
                               "sequence_parallel: 2}, ref: {sequence_parallel: 4}}", "j"));
  // The model's heads (Qwen2-7B: 28 heads, 4 KV heads): S = 2 and 4; not 8 (28 heads), not 7
  // (each rank's 4 query heads would straddle two KV heads).
  const model::ModelConfig qwen7b = model::preset("qwen2-7b");
  EXPECT_NO_THROW(zero::check_sequence_parallel(qwen7b, 2, "roles.actor.sequence_parallel"));
  EXPECT_NO_THROW(zero::check_sequence_parallel(qwen7b, 4, "roles.actor.sequence_parallel"));
  EXPECT_NE(config_error([&] { zero::check_sequence_parallel(qwen7b, 8, "roles.actor.sequence_parallel"); })
                .find("roles.actor.sequence_parallel = 8: the model has 28 attention heads"),
            std::string::npos);
  EXPECT_NE(config_error([&] { zero::check_sequence_parallel(qwen7b, 7, "k"); }).find("the model has 4 KV heads"),
            std::string::npos);
  // Context parallelism: only S / context_parallel ranks split the heads. S = 8 runs with 2 key
  // groups (heads split 4 ways), 4 (2 ways) or 8 (not split), and S = 7 with 7; S = 16 with 2
  // would split 28 heads 8 ways. context_parallel must divide S.
  EXPECT_NO_THROW(zero::check_sequence_parallel(qwen7b, 8, "k", 4));
  EXPECT_NO_THROW(zero::check_sequence_parallel(qwen7b, 8, "k", 8));
  EXPECT_NO_THROW(zero::check_sequence_parallel(qwen7b, 8, "k", 2));
  EXPECT_NO_THROW(zero::check_sequence_parallel(qwen7b, 7, "k", 7));
  EXPECT_NE(config_error([&] { zero::check_sequence_parallel(qwen7b, 16, "k", 2); })
                .find("k = 16 with context_parallel = 2 (heads split 8 ways): the model has 28 attention heads"),
            std::string::npos);
  EXPECT_NE(config_error([&] { zero::check_sequence_parallel(qwen7b, 8, "k", 3); }).find("must divide it"),
            std::string::npos);
  EXPECT_NE(err("roles: {actor: {gpus: 4, sequence_parallel: 4, context_parallel: 3}}")
                .find("roles.actor.context_parallel = 3 must divide roles.actor.sequence_parallel = 4"),
            std::string::npos);
  EXPECT_NE(err("roles: {actor: {gpus: 4, sequence_parallel: 2}, ref: {context_parallel: 4}}")
                .find("roles.ref.context_parallel = 4 must divide the sequence_parallel = 2 of 'actor'"),
            std::string::npos);
  EXPECT_NO_THROW(parse_config("roles: {actor: {gpus: 4, sequence_parallel: 4, context_parallel: 2}, "
                               "ref: {context_parallel: 4}}", "j"));
}

TEST(Config, EffectiveYamlRoundTrips) {
  JobConfig a = parse_config("run: {name: \"a: b\"}\nroles: {actor: {gpus: 3}}\nalgo: {kl_coef: 0.125}", "j.yaml",
                             {"rollout.temperature=0.7"});
  std::string text = to_yaml(a);
  JobConfig b = parse_config(text, "printed.yaml");
  EXPECT_EQ(text, to_yaml(b));
  EXPECT_EQ(b.run.name, "a: b");
  EXPECT_EQ(b.roles.actor.gpus, 3);
  EXPECT_DOUBLE_EQ(b.rollout.temperature, 0.7);
  // Every key appears in the printed config.
  for (const auto& key : config_keys()) {
    auto last = key.substr(key.rfind('.') + 1);
    EXPECT_NE(text.find(last + ":"), std::string::npos) << key;
  }
}

TEST(Config, ReferenceDocIsUpToDate) {
  std::ifstream in(std::string(TILLER_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), config_reference_markdown())
      << "docs/config.md is stale: regenerate it with `build/bin/tiller config --reference > docs/config.md`";
}

TEST(Config, EveryShippedConfigLoads) {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(TILLER_SOURCE_DIR) + "/configs")) {
    if (entry.path().extension() != ".yaml") continue;
    EXPECT_NO_THROW(load_config(entry.path().string())) << entry.path();
    ++n;
  }
  EXPECT_GE(n, 2);
}

TEST(Config, MissingFile) {
  EXPECT_EQ(config_error([] { load_config("/nonexistent/x.yaml"); }),
            "/nonexistent/x.yaml: cannot open the config file (does it exist?)");
}

}  // namespace
}  // namespace tiller
