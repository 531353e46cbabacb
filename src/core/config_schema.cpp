// The config schema (config_schema.h): the outputs' and deadlines' keys, the schema's assembly
// from its parts (config_schema_builder.h) and its lookups.
#include "config_schema.h"

#include "config_schema_builder.h"
#include "tiller/core/error.h"

namespace tiller::config_schema {
namespace {

using detail::Builder;
using detail::kMaxBatchTokens;
using detail::kMaxCount;
using detail::kMaxSampleTokens;
using detail::kMaxSeconds;

std::vector<Field> build() {
  Builder b;
  detail::add_layout_fields(b);
  detail::add_rl_fields(b);
  b.add("eval.prompts", TILLER_FIELD(eval.prompts),
        "Held-out prompts evaluated on the job's engines between steps (JSONL or parquet, with data.*'s keys, "
        "templates and data sources; never trained on). Empty: no evaluation.");
  b.add("eval.every_steps", TILLER_FIELD(eval.every_steps),
        "Evaluate after every N steps and after the last (0: not during the run).")
      .range(0, kMaxCount);
  b.add("eval.before_train", TILLER_FIELD(eval.before_train),
        "Evaluate the starting weights first (a step-0 row in metrics.jsonl), the baseline to compare with.");
  b.add("eval.greedy", TILLER_FIELD(eval.greedy),
        "One greedy sample a prompt: eval/<source>/greedy_accuracy and greedy_reward.");
  b.add("eval.n_samples", TILLER_FIELD(eval.n_samples),
        "k samples a prompt at eval.temperature: eval/<source>/pass@k (a prompt with any correct sample), mean@k "
        "(correct samples) and reward_mean. 0: none.")
      .range(0, 1024);
  b.add("eval.temperature", TILLER_FIELD(eval.temperature), "Temperature of the k samples.").range(0.001, 100.0);
  b.add("eval.top_p", TILLER_FIELD(eval.top_p), "Nucleus mass of the k samples.").range(0.001, 1.0);
  b.add("eval.max_new_tokens", TILLER_FIELD(eval.max_new_tokens),
        "Tokens an eval sample may generate (0: rollout.max_new_tokens).")
      .range(0, kMaxSampleTokens);
  b.add("eval.max_prompts", TILLER_FIELD(eval.max_prompts),
        "Prompts of the file evaluated, its first ones (0: all); prompts x (greedy + n_samples) is at most 4,194,304.")
      .range(0, 10000000);
  b.add("eval.correct_reward", TILLER_FIELD(eval.correct_reward),
        "A sample counts as correct (accuracy, pass@k) when its reward is at least this.")
      .range(-1e9, 1e9);
  b.add("eval.reward_rule", TILLER_FIELD(eval.reward_rule),
        "Score eval samples with this rule (math_answer, exact_match, ...) instead of the job's reward; needed "
        "when reward.type is model or env.");
  b.add("eval.samples_per_source", TILLER_FIELD(eval.samples_per_source),
        "Decoded eval samples kept per data source in run.output_dir/eval/step_<N>.jsonl (-1: every one).")
      .range(-1, 1000000);

  b.add("checkpoint.dir", TILLER_FIELD(checkpoint.dir), "Checkpoint directory (empty: no checkpoints).");
  b.add("checkpoint.every_steps", TILLER_FIELD(checkpoint.every_steps), "Save every N steps (0: only at the end).")
      .range(0, kMaxCount);
  b.add("checkpoint.keep_last", TILLER_FIELD(checkpoint.keep_last), "Checkpoints kept; older ones are deleted.")
      .range(1, 1000000);
  b.add("checkpoint.resume", TILLER_FIELD(checkpoint.resume), "Resume from the newest checkpoint in dir, if any.");
  b.add("checkpoint.save_hf", TILLER_FIELD(checkpoint.save_hf), "Also export the actor as an HF directory at each save: <step dir>/actor_hf (loads as roles.actor.model).");

  b.add("logging.level", TILLER_FIELD(logging.level), "Log level; the TILLER_LOG_LEVEL environment variable wins.")
      .one_of({"trace", "debug", "info", "warn", "error", "off"});
  b.add("logging.every_steps", TILLER_FIELD(logging.every_steps), "Log metrics every N steps.").range(1, kMaxCount);
  b.add("logging.metrics_jsonl", TILLER_FIELD(logging.metrics_jsonl),
        "Append per-step metrics to this JSONL file. Empty: run.output_dir/metrics.jsonl.");
  b.add("logging.tensorboard_dir", TILLER_FIELD(logging.tensorboard_dir),
        "TensorBoard event files (tensorboard --logdir). Empty: run.output_dir/tensorboard.");
  b.add("logging.chrome_trace", TILLER_FIELD(logging.chrome_trace),
        "Chrome trace of every rank's phases in the profiled steps. Empty: run.output_dir/trace.json.");
  b.add("logging.profile_steps", TILLER_FIELD(logging.profile_steps),
        "Steps to trace: \"3\", \"3,5\" or \"3-5\" (empty: none; tiller train --profile sets it).");
  b.add("logging.rollout_records", TILLER_FIELD(logging.rollout_records),
        "JSONL file with one line per trained or dropped sample: step, prompt line, weight versions of its "
        "tokens, lag, reward, length (empty: none).");
  b.add("logging.rollout_records_tokens", TILLER_FIELD(logging.rollout_records_tokens),
        "The rollout records also carry each sample's token ids, the engine's log-probs and the actor's scored "
        "log-probs (actor_logprobs).");
  b.add("logging.rollout_records_text", TILLER_FIELD(logging.rollout_records_text),
        "The rollout records also carry each sample's decoded prompt and response (special tokens kept).");
  b.add("logging.samples_per_step", TILLER_FIELD(logging.samples_per_step),
        "Decoded samples each step writes to logging.samples_jsonl and TensorBoard's text tab: prompt, response, "
        "reward, advantage (and each turn in multi-turn runs); the step's first prompt groups' samples. 0: none.")
      .range(0, 100000);
  b.add("logging.samples_jsonl", TILLER_FIELD(logging.samples_jsonl),
        "Where the decoded samples go. Empty: run.output_dir/samples.jsonl.");
  b.add("logging.wandb.project", TILLER_FIELD(logging.wandb.project),
        "Log to Weights & Biases (the wandb package in the embedded Python): the project. Empty: off.");
  b.add("logging.wandb.entity", TILLER_FIELD(logging.wandb.entity), "W&B entity (team or user; empty: yours).");
  b.add("logging.wandb.name", TILLER_FIELD(logging.wandb.name), "W&B run name (empty: run.name).");
  b.add("logging.wandb.tags", TILLER_FIELD(logging.wandb.tags), "W&B tags, comma-separated.");
  b.add("logging.wandb.mode", TILLER_FIELD(logging.wandb.mode),
        "online, offline (the run directory keeps everything for `wandb sync`) or disabled.")
      .one_of({"online", "offline", "disabled"});
  b.add("logging.wandb.dir", TILLER_FIELD(logging.wandb.dir), "Where W&B's run directory goes (empty: run.output_dir).");
  b.add("logging.mlflow.experiment", TILLER_FIELD(logging.mlflow.experiment),
        "Log to MLflow (the mlflow or mlflow-skinny package in the embedded Python): the experiment. Empty: off.");
  b.add("logging.mlflow.tracking_uri", TILLER_FIELD(logging.mlflow.tracking_uri),
        "MLflow tracking URI (http://..., databricks, sqlite:///...; empty: $MLFLOW_TRACKING_URI, else ./mlruns).");
  b.add("logging.mlflow.run_name", TILLER_FIELD(logging.mlflow.run_name), "MLflow run name (empty: run.name).");
  b.add("logging.efficiency", TILLER_FIELD(logging.efficiency),
        "Report each phase's rate beside its benchmark at the job's shapes (efficiency/*, and a line in the log): "
        "every trainer rank times a training micro-batch and a scoring forward of the job's sizes once (at its "
        "first request of each), every engine a decode at its batch and lengths (at its first generation); "
        "docs/training.md, 'Reading the efficiency metrics'.");

  b.add("offline.data", TILLER_FIELD(offline.data),
        "tiller sft / train-rm / dpo: the training data, JSONL or parquet (docs/offline.md): conversations under "
        "offline.messages_key, or prompt/response (sft), or prompt/chosen/rejected (train-rm, dpo).");
  b.add("offline.eval_data", TILLER_FIELD(offline.eval_data),
        "A held-out file in the same format. Empty: offline.eval_samples records of offline.data are held out.");
  b.add("offline.eval_samples", TILLER_FIELD(offline.eval_samples),
        "Records of offline.data held out for evaluation (drawn with run.seed) when offline.eval_data is empty.")
      .range(0, kMaxCount);
  b.add("offline.eval_every", TILLER_FIELD(offline.eval_every),
        "Evaluate on the held-out split every N optimizer steps (0: after the last step only).")
      .range(0, kMaxCount);
  b.add("offline.epochs", TILLER_FIELD(offline.epochs), "Passes over the training data.").range(1, 100000);
  b.add("offline.max_steps", TILLER_FIELD(offline.max_steps),
        "Stop after this many optimizer steps (0: when offline.epochs are done). The LR schedule spans the steps run.")
      .range(0, kMaxCount);
  b.add("offline.max_tokens", TILLER_FIELD(offline.max_tokens),
        "Longest sample in tokens (a preference pair: each side, prompt included).")
      .range(2, 1 << 22);
  b.add_enum("offline.long_samples", TILLER_FIELD(offline.long_samples),
        "A sample over offline.max_tokens: skip (counted), truncate (keep its first max_tokens tokens), or error.");
  b.add("offline.messages_key", TILLER_FIELD(offline.messages_key),
        "Key of a conversation: a list of {role, content}; every assistant turn is trained (data.apply_chat_template).");
  b.add("offline.tools_key", TILLER_FIELD(offline.tools_key),
        "sft: key of a record's tool schemas (a list, as an OpenAI request's tools), given to the chat template as its "
        "tools (Qwen2.5's, Llama-3.1's write them into the prompt); absent or null: none.");
  b.add("offline.prompt_key", TILLER_FIELD(offline.prompt_key), "Key of a record's prompt (text or messages).");
  b.add("offline.response_key", TILLER_FIELD(offline.response_key), "sft: key of the response to a prompt (text).");
  b.add("offline.chosen_key", TILLER_FIELD(offline.chosen_key),
        "train-rm / dpo: key of the preferred response (text, or the assistant messages after the prompt).");
  b.add("offline.rejected_key", TILLER_FIELD(offline.rejected_key), "train-rm / dpo: key of the other response.");
  b.add("offline.margin_key", TILLER_FIELD(offline.margin_key),
        "train-rm: key of an optional per-pair margin (a number; absent: 0).");
  b.add_enum("offline.loss_mean", TILLER_FIELD(offline.loss_mean),
        "sft: token (the mean over the step's trained tokens, as transformers' causal-LM loss) or sequence (each "
        "sample's own mean, then their mean).");
  b.add("offline.dpo_beta", TILLER_FIELD(offline.dpo_beta),
        "dpo: beta, the strength of the KL tie to the reference (the implicit reward is beta x the log-ratio).")
      .range(1e-6, 1e6);
  b.add("offline.dpo_label_smoothing", TILLER_FIELD(offline.dpo_label_smoothing),
        "dpo: cDPO's chance that a pair's label is flipped, in [0, 0.5) (sigmoid loss only).")
      .range(0.0, 0.499);
  b.add_enum("offline.dpo_loss", TILLER_FIELD(offline.dpo_loss),
        "dpo: sigmoid (DPO, with offline.dpo_label_smoothing: cDPO) or ipo (IPO, on the responses' mean log-probs).");
  b.add_enum("offline.dpo_reference", TILLER_FIELD(offline.dpo_reference),
        "dpo: precompute (the reference's log-probs of every pair once, then the reference is freed) or on_the_fly "
        "(the frozen reference, ZeRO-3 sharded, scores each micro-batch beside the policy).");
  b.add("offline.export_dir", TILLER_FIELD(offline.export_dir),
        "Where the trained model is exported as an HF checkpoint at the end. Empty: run.output_dir/model.");

  b.add("timeouts.collective_s", TILLER_FIELD(timeouts.collective_s),
        "Deadline of one collective (all-gather, reduce-scatter, ...); a miss aborts the communicator.")
      .range(0.001, kMaxSeconds);
  b.add("timeouts.startup_s", TILLER_FIELD(timeouts.startup_s),
        "Deadline for communicator creation and engine start-up.").range(0.001, kMaxSeconds);
  b.add("timeouts.generate_s", TILLER_FIELD(timeouts.generate_s),
        "Longest an engine with samples in flight may go without returning one (the error names the engine "
        "and what it still owes).")
      .range(0.001, kMaxSeconds);
  b.add("timeouts.weight_sync_s", TILLER_FIELD(timeouts.weight_sync_s), "Deadline of one weight sync to the engines.")
      .range(0.001, kMaxSeconds);
  b.add("timeouts.train_s", TILLER_FIELD(timeouts.train_s),
        "Deadline of one optimizer step's micro-batches on the actor or critic ranks.")
      .range(0.001, kMaxSeconds);
  b.add("timeouts.rpc_s", TILLER_FIELD(timeouts.rpc_s), "Deadline of one control RPC (health, stats, abort).")
      .range(0.001, kMaxSeconds);
  b.add("timeouts.download_s", TILLER_FIELD(timeouts.download_s),
        "Deadline of the download of the job's hub models (roles.*.model given as hub ids that are not in the "
        "Hugging Face cache): the lowest rank of each node downloads, the others wait this long.")
      .range(0.001, kMaxSeconds);
  b.add("timeouts.step_s", TILLER_FIELD(timeouts.step_s),
        "Deadline of one whole step, generation to weight sync, on the controller's watchdog: a step still running "
        "then ends the job with one line from every rank saying where it waits (docs/cluster.md). 0: none; the calls "
        "inside a step keep their own deadlines.")
      .range(0.0, kMaxSeconds);
  return b.take();
}

}  // namespace

const std::vector<Field>& fields() {
  static const std::vector<Field> kFields = [] {
    std::vector<Field> f = build();
    for (const Field& x : f)
      TILLER_CHECK(!(x.kind == Kind::kInt || x.kind == Kind::kDouble) || (x.min && x.max),
                   "config key {} has no upper or lower bound; every number in the schema needs both", x.path);
    return f;
  }();
  return kFields;
}

const std::vector<Section>& sections() {
  static const std::vector<Section> kSections = {
      {"run", "Identity of the run."},
      {"cluster", "The machines: GPUs per node, device and communicator backend."},
      {"roles", "The trainer roles. Each is a ZeRO-3 group of ranks, or colocated with another role."},
      {"roles.actor", "The policy being trained; source of the weight sync."},
      {"roles.actor.lora", "LoRA adapters of the actor: a frozen base, adapters trained (docs/training.md)."},
      {"roles.critic", "The value model (PPO with GAE only)."},
      {"roles.critic.lora", "LoRA adapters of the critic."},
      {"roles.ref", "The frozen reference policy for the KL penalty."},
      {"roles.reward", "The reward model (when reward.type is model)."},
      {"engines", "The inference-engine pool. Each engine is a TP group inside one node."},
      {"rollout", "Generation: prompts per step, samples per prompt, sampling."},
      {"algo", "The RL algorithm: advantages, losses, KL."},
      {"data", "The prompt dataset."},
      {"reward", "Where rewards come from."},
      {"env", "The environment of multi-turn rollouts (docs/training.md, \"Environments (multi-turn)\")."},
      {"agent", "Agent harnesses behind an OpenAI-compatible endpoint (rollout.loop: openai_agent; docs/agents.md)."},
      {"train", "Optimisation of the actor and critic."},
      {"checkpoint", "Sharded checkpoints and HF export."},
      {"logging", "Logs, metrics and traces."},
      {"offline", "tiller sft, train-rm and dpo: the data and the schedule (docs/offline.md)."},
      {"timeouts", "Deadlines of blocking calls, in seconds. None waits forever."},
  };
  return kSections;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kDouble: return "float";
    case Kind::kString: return "string";
    case Kind::kEnum: return "string";
  }
  return "?";
}

}  // namespace tiller::config_schema
