// The job configuration: one YAML file, read into typed structs. Every key, its type, default,
// allowed range and documentation are declared once (src/core/config_schema.cpp); loading, the
// `--set a.b=c` overrides, `tiller config` printing and docs/config.md all come from that one list.
//
// Errors (all ConfigError, one line): an unknown key names its path, file, line and the closest
// valid key; a value of the wrong type or out of range names the key, the value and what is allowed.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tiller/core/roles.h"

namespace tiller {

// Keys with a fixed set of values are enums, parsed once when the config is loaded; the YAML
// spelling of each value is EnumNames<E>::names[value], in declaration order.
template <typename E>
struct EnumNames;

enum class RolloutMode { kSync, kAsync };
enum class StalePolicy { kWait, kDrop };
enum class ImportanceCorrection { kNone, kTis, kDecoupled, kMis };
enum class IsLevel { kToken, kSequence, kGeometric };             // algo.is_level
enum class RewardType { kModel, kRule, kRemote, kPython, kEnv, kScorer };
enum class EnvType { kNone, kRemote, kInprocess };
enum class AgentDrift { kError, kSplit, kDrop };                 // agent.drift
enum class DeviceKind { kAuto, kCuda, kCpu };                    // cluster.device
enum class BackendKind { kAuto, kNccl, kMpi };                   // cluster.backend
enum class HybridScoring { kAuto, kOverlap, kAfterGenerate };     // cluster.hybrid_scoring
enum class ExpandableSegments { kAuto, kOn, kOff };               // cluster.expandable_segments
enum class Precision { kBf16, kFp32 };                           // roles.*.dtype, train.reduce_dtype
enum class OptimizerOffload { kNone, kCpu };
enum class LongPromptPolicy { kSkip, kTruncateLeft, kError };    // data.long_prompt_policy
enum class RecomputeChoice { kAuto, kBlocks, kAttentionOnly, kNone };  // train.recompute (zero/recompute.h)
enum class ComputeShard { kAuto, kKeep, kCast };
enum class OldLogprobs { kRecompute, kForward };
enum class LrScheduleKind { kConstant, kLinear, kCosine };
enum class OfflineLossMean { kToken, kSequence };               // offline.loss_mean
enum class LongSamplePolicy { kSkip, kTruncate, kError };       // offline.long_samples
enum class DpoLossKind { kSigmoid, kIpo };                      // offline.dpo_loss
enum class DpoReference { kPrecompute, kOnTheFly };             // offline.dpo_reference
enum class LogprobMatch { kOff, kBitwise };                     // algo.logprob_match (model/numerics.h)
enum class EngineQuantization { kNone, kFp8 };                  // engines.quantization (model/fp8.h)
enum class Fp8Scaling { kBlock, kChannel, kTensor };            // engines.fp8_scaling, roles.<r>.fp8_scaling
enum class KvCacheDtype { kAuto, kFp8 };                        // engines.kv_cache_dtype

template <>
struct EnumNames<RolloutMode> {
  static constexpr std::array<std::string_view, 2> names = {"sync", "async"};
};
template <>
struct EnumNames<StalePolicy> {
  static constexpr std::array<std::string_view, 2> names = {"wait", "drop"};
};
template <>
struct EnumNames<ImportanceCorrection> {
  static constexpr std::array<std::string_view, 4> names = {"none", "tis", "decoupled", "mis"};
};
template <>
struct EnumNames<IsLevel> {
  static constexpr std::array<std::string_view, 3> names = {"token", "sequence", "geometric"};
};
template <>
struct EnumNames<RewardType> {
  static constexpr std::array<std::string_view, 6> names = {"model", "rule", "remote", "python", "env", "scorer"};
};
template <>
struct EnumNames<EnvType> {
  static constexpr std::array<std::string_view, 3> names = {"none", "remote", "inprocess"};
};
template <>
struct EnumNames<DeviceKind> {
  static constexpr std::array<std::string_view, 3> names = {"auto", "cuda", "cpu"};
};
template <>
struct EnumNames<BackendKind> {
  static constexpr std::array<std::string_view, 3> names = {"auto", "nccl", "mpi"};
};
template <>
struct EnumNames<HybridScoring> {
  static constexpr std::array<std::string_view, 3> names = {"auto", "overlap", "after_generate"};
};
template <>
struct EnumNames<ExpandableSegments> {
  static constexpr std::array<std::string_view, 3> names = {"auto", "on", "off"};
};
template <>
struct EnumNames<Precision> {
  static constexpr std::array<std::string_view, 2> names = {"bf16", "fp32"};
};
template <>
struct EnumNames<OptimizerOffload> {
  static constexpr std::array<std::string_view, 2> names = {"none", "cpu"};
};
template <>
struct EnumNames<LongPromptPolicy> {
  static constexpr std::array<std::string_view, 3> names = {"skip", "truncate_left", "error"};
};
template <>
struct EnumNames<RecomputeChoice> {
  static constexpr std::array<std::string_view, 4> names = {"auto", "blocks", "attention_only", "none"};
};
template <>
struct EnumNames<ComputeShard> {
  static constexpr std::array<std::string_view, 3> names = {"auto", "keep", "cast"};
};
template <>
struct EnumNames<OldLogprobs> {
  static constexpr std::array<std::string_view, 2> names = {"recompute", "forward"};
};
template <>
struct EnumNames<LrScheduleKind> {
  static constexpr std::array<std::string_view, 3> names = {"constant", "linear", "cosine"};
};

template <>
struct EnumNames<OfflineLossMean> {
  static constexpr std::array<std::string_view, 2> names = {"token", "sequence"};
};
template <>
struct EnumNames<LongSamplePolicy> {
  static constexpr std::array<std::string_view, 3> names = {"skip", "truncate", "error"};
};

template <>
struct EnumNames<DpoLossKind> {
  static constexpr std::array<std::string_view, 2> names = {"sigmoid", "ipo"};
};
template <>
struct EnumNames<DpoReference> {
  static constexpr std::array<std::string_view, 2> names = {"precompute", "on_the_fly"};
};
template <>
struct EnumNames<LogprobMatch> {
  static constexpr std::array<std::string_view, 2> names = {"off", "bitwise"};
};
template <>
struct EnumNames<EngineQuantization> {
  static constexpr std::array<std::string_view, 2> names = {"none", "fp8"};
};
template <>
struct EnumNames<Fp8Scaling> {
  static constexpr std::array<std::string_view, 3> names = {"block", "channel", "tensor"};
};
template <>
struct EnumNames<KvCacheDtype> {
  static constexpr std::array<std::string_view, 2> names = {"auto", "fp8"};
};
template <>
struct EnumNames<AgentDrift> {
  static constexpr std::array<std::string_view, 3> names = {"error", "split", "drop"};
};

// The YAML spelling of `e`.
template <typename E>
constexpr std::string_view enum_name(E e) {
  return EnumNames<E>::names[static_cast<size_t>(e)];
}
// The value spelt `name`, or nullopt.
template <typename E>
constexpr std::optional<E> parse_enum(std::string_view name) {
  for (size_t i = 0; i < EnumNames<E>::names.size(); ++i)
    if (EnumNames<E>::names[i] == name) return static_cast<E>(i);
  return std::nullopt;
}

struct RunConfig {
  std::string name = "tiller";
  std::int64_t seed = 42;
  std::string output_dir = "out";
};

struct ClusterConfig {
  std::int64_t gpus_per_node = 0;  // 0: detect (CUDA device count)
  DeviceKind device = DeviceKind::kAuto;
  BackendKind backend = BackendKind::kAuto;
  std::int64_t ranks_per_gpu = 1;  // worker ranks that share one GPU (2: engines beside trainers)
  // Every actor GPU also runs an engine, in the actor rank's process (docs/training.md, hybrid).
  bool hybrid = false;
  // When the trainers score a hybrid step's samples: while the engines generate them (overlap), or
  // once every sample is in and the engines sleep (after_generate). auto: after_generate for TP > 1
  // engines over NCCL (JobConfig::hybrid_scores_after_generate says why), overlap otherwise.
  HybridScoring hybrid_scoring = HybridScoring::kAuto;
  double gpu_memory_gb = 0;        // per GPU, for the memory plan; 0: the device's (tiller train)
  double host_memory_gb = 0;       // per node, for the memory plan; 0: the node's (tiller train)
  // PyTorch's caching allocator on the GPUs: expandable segments (on), its default (off), or what
  // the memory plan chooses (auto: on where the default's fragmentation would not fit; job/memory_plan.h).
  ExpandableSegments expandable_segments = ExpandableSegments::kAuto;
};

// One trainer role (actor, critic, ref, reward): a ZeRO-3 group of `gpus` ranks, or colocated in
// the processes of another role.
// LoRA adapters of a trained role (roles.<role>.lora; model/lora.h). rank 0: full fine-tuning.
struct LoraConfig {
  std::int64_t rank = 0;
  double alpha = 16;
  std::string target_modules = "all-linear";  // PEFT's names, comma-separated (a YAML list too), or all-linear
  double dropout = 0;
  bool use_rslora = false;
  std::string init_from;  // a PEFT adapter directory to start from; "": PEFT's initialisation
};

struct RoleConfig {
  bool enabled = true;
  std::string model;            // HF directory; "" means the actor's model (ref) or none
  std::int64_t gpus = 1;        // ranks in the role's group (ignored when colocated)
  std::string colocate_with;    // "" or the name of another role whose ranks this role shares
  Precision dtype = Precision::kBf16;  // compute dtype
  bool replicate = false;       // frozen roles only: replicate instead of ZeRO-3 sharding
  bool offload = false;         // hybrid: masters, gradients, moments in pinned host memory while engines generate
  OptimizerOffload optimizer_offload = OptimizerOffload::kNone;  // cpu: fp32 masters and AdamW moments in host memory, AdamW on the CPU
  std::int64_t sequence_parallel = 1;  // ranks that share each micro-batch's tokens (Ulysses); divides gpus
  // Of those S ranks, R groups split attention's keys (all-gathered K/V) instead of its heads;
  // S / R ranks within each split heads (zero/sequence_parallel.h). Divides the role's S.
  std::int64_t context_parallel = 1;
  // A mixture of experts' router losses in training (zero::ShardedModel::router_loss): 0 is off.
  double router_aux_loss_coef = 0;  // load balancing
  double router_z_loss_coef = 0;    // ST-MoE's z-loss
  LoraConfig lora;
  // FP8 training (docs/training.md): the blocks' linear layers' GEMMs in FP8, current scaling by
  // fp8_scaling (block: 1x128 activations, 128x128 weights; channel: one scale per row).
  bool fp8 = false;
  Fp8Scaling fp8_scaling = Fp8Scaling::kBlock;
  // Tensor scaling's forward GEMMs without the fp32 promotion of the partial sums (Transformer
  // Engine's forward); the gradients' GEMMs always promote.
  bool fp8_fast_accumulation = true;
};

struct RolesConfig {
  RoleConfig actor;
  RoleConfig critic;
  // By default the reference model lives in the actor's processes, and no reward model runs
  // (reward.type is a rule).
  RoleConfig ref = [] {
    RoleConfig r;
    r.colocate_with = "actor";
    return r;
  }();
  RoleConfig reward = [] {
    RoleConfig r;
    r.enabled = false;
    return r;
  }();
};

struct EnginesConfig {
  std::int64_t count = 1;
  std::int64_t tp = 1;
  std::string model;  // "" = the actor's model
  std::int64_t max_num_seqs = 256;
  std::int64_t max_batched_tokens = 8192;
  std::int64_t kv_block_size = 16;
  double gpu_memory_fraction = 0.85;
  double kv_cache_gb = 0;  // > 0: the KV cache size in GiB, instead of gpu_memory_fraction
  std::int64_t port = 50051;
  std::string host = "0.0.0.0";
  std::int64_t sync_bucket_mb = 256;
  // Hybrid: what an engine frees while the trainers score and train. 0: nothing; 1: its KV cache
  // and decode graphs; 2: its weights too (the next sync refills them).
  std::int64_t sleep_level = 1;
  // Multi-turn sessions: how long a finished turn's KV cache waits for the next turn, and how many
  // may wait (0: 4 x max_num_seqs).
  double session_timeout_s = 300;
  std::int64_t max_sessions = 0;
  // fp8: the engines' linear layers in FP8 blocks, quantized at load and at every sync.
  EngineQuantization quantization = EngineQuantization::kNone;
  Fp8Scaling fp8_scaling = Fp8Scaling::kBlock;
  // fp8: the KV cache in e4m3, one scale per cached (token, KV head) row.
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  // TLS of the engines' gRPC services (the controller dials them by host name).
  std::string tls_cert, tls_key, tls_ca, tls_server_name;
  // Standalone engines (`tiller engine`, not ranks of the job; docs/cluster.md): their host:port
  // (comma-separated) at the start, and/or a folder where engines that join later announce
  // themselves (`tiller engine --join DIR`). The actor ranks push them each sync as deltas.
  std::string addresses;
  std::string rendezvous_dir;
  std::int64_t min_count = 1;       // standalone engines the job waits for at its start
  std::string token_file;           // their shared secret (first line); empty: $TILLER_ENGINE_TOKEN
  bool delta_sync = true;           // false: every push in full
  std::int64_t push_chunk_mb = 8;   // the pushed chunks
  std::int64_t push_threads = 0;    // each actor rank's encoding threads (0: the hardware's, at most 16)
  bool standalone() const { return !addresses.empty() || !rendezvous_dir.empty(); }
};

struct RolloutConfig {
  std::int64_t batch_size = 128;  // prompts per step
  std::int64_t n_samples_per_prompt = 1;
  std::int64_t max_prompt_tokens = 1024;
  std::int64_t max_new_tokens = 1024;
  double temperature = 1.0;
  double top_p = 1.0;
  std::int64_t top_k = -1;
  std::int64_t micro_batch_tokens = 16384;
  // How a prompt's samples are made: a registered sample loop (tiller/controller/sample_loop.h); ""
  // picks multi_turn with an environment (env.type), single_turn without.
  std::string loop;
  std::string loop_args;  // its settings, in a format of its own
  // The pipeline (docs/training.md): sync is generate, score, train, sync, one step after the
  // other; async keeps the engines generating the next steps while the trainers train.
  RolloutMode mode = RolloutMode::kSync;
  std::int64_t max_staleness = -1;  // async: versions a sample may lag the weights it trains (-1: 1); sync: 0
  StalePolicy stale_policy = StalePolicy::kWait;
  bool partial = false;             // async: in-flight samples continue across a weight sync
  bool filter_groups = false;       // DAPO dynamic sampling: drop groups whose rewards are all equal
  std::int64_t filter_max_extra_batches = 3;  // at most this many x batch_size extra prompts per step
  // Multi-turn samples (env.type set): model turns per sample, and the tokens after the prompt, the
  // model's and the observations' (0: max_new_tokens x max_turns).
  std::int64_t max_turns = 1;
  std::int64_t max_response_tokens = 0;

  // The staleness bound in effect: 0 in sync mode, max_staleness (default 1) in async mode.
  std::int64_t staleness() const {
    return mode == RolloutMode::kSync ? 0 : (max_staleness < 0 ? 1 : max_staleness);
  }
};

struct AlgoConfig {
  // A name in the advantage-estimator registry (tiller/algo/advantage_estimator.h; checked by
  // algo::check_config, which knows what a trainer of one's own registered).
  std::string advantage_estimator = "gae";
  std::string policy_loss = "ppo";  // a name in the policy-loss registry (tiller/algo/algo.h)
  std::string value_loss = "clipped";  // a name in the value-loss registry (tiller/algo/algo.h)
  double gamma = 1.0;
  double lambd = 0.95;
  double clip_eps_low = 0.2;
  double clip_eps_high = 0.2;
  double dual_clip = 0.0;
  double value_clip = 0.2;
  double kl_coef = 0.01;
  std::string kl_estimator = "k1";  // a name in the KL-estimator registry (tiller/algo/algo.h)
  // On-policy distillation: each response token's advantage gains distill_coef x (log p_teacher -
  // log p_student), the teacher being the reference role (roles.ref.model). 0: off.
  double distill_coef = 0.0;
  bool kl_in_reward = true;
  double target_kl = 0.0;
  double kl_horizon = 10000.0;
  double entropy_coef = 0.0;
  // Off-policy correction of the policy loss against the engine's (behaviour) log-probs.
  ImportanceCorrection importance_correction = ImportanceCorrection::kNone;
  double tis_cap = 0.0;         // tis: weights truncated here; decoupled: tokens over it masked (0: no mask)
  double seq_mask_ratio = 0.0;  // > 1: mask samples whose geometric-mean weight is outside [1/r, r]
  // tis and mis: the weight each token's is (its own, its sample's product, or their geometric
  // mean); mis keeps weights in [is_cap_lower (0: 1 / tis_cap), tis_cap] and masks the rest.
  IsLevel is_level = IsLevel::kToken;
  double is_cap_lower = 0.0;
  double is_veto = 0.0;  // > 0: a sample with a token weight below it is rejected (left out of the loss)
  // bitwise: the engine's and the trainer's forward kernels are batch-invariant, so a sampled
  // token's engine log-prob equals the trainer's bit for bit (tiller/model/numerics.h).
  LogprobMatch logprob_match = LogprobMatch::kOff;
  // Mixture-of-experts actors: the engine records each token's experts and the actor's scoring and
  // training forwards route by them (model::BlockContext::replay_routes).
  bool routing_replay = false;
  bool whiten_advantages = true;
  std::int64_t ppo_epochs = 1;
};

struct DataConfig {
  std::string source = "file";  // a registered prompt source (tiller/controller/prompt_source.h)
  std::string source_args;      // its settings, in a format of its own
  std::string prompts;
  std::string input_key = "input";
  std::string label_key = "label";
  std::string data_source_key = "data_source";
  std::string extra_info_key = "extra_info";
  std::string input_template;
  bool apply_chat_template = false;
  std::string chat_template = "auto";  // auto | model | chatml | llama3 | none | a .jinja file
  std::string chat_template_kwargs;     // a JSON object's text: the Jinja template's extra variables ("": none)
  std::string tools_key = "tools";     // a prompt's tool schemas for the chat template
  bool shuffle = true;
  std::int64_t max_samples = 0;
  LongPromptPolicy long_prompt_policy = LongPromptPolicy::kSkip;
};

struct RewardConfig {
  RewardType type = RewardType::kRule;
  std::string rule = "math_answer";
  std::string remote_address;
  double remote_timeout_s = 60;
  std::int64_t remote_retries = 3;
  std::int64_t remote_batch_size = 64;
  std::int64_t remote_concurrency = 4;
  std::string remote_token_file;       // first line: the token sent as x-tiller-token
  std::string remote_tls_ca, remote_tls_server_name;
  std::string python;                  // FILE.py:FUNCTION (reward.type python)
  bool python_batched = false;         // the function takes lists (one call per batch)
  std::int64_t python_batch_size = 64;
  std::int64_t python_workers = 1;     // threads calling the function (the GIL serialises pure Python)
  double python_timeout_s = 300;
  std::string scorer;                  // a registered batch scorer (reward.type scorer; tiller/reward/scorer_registry.h)
  std::string scorer_args;             // its settings, in a format of its own
  std::int64_t scorer_batch_size = 16;
  std::int64_t scorer_concurrency = 1;
  double clip = 10.0;
  bool normalize = false;
  std::int64_t overlong_buffer = 0;  // DAPO's soft overlong penalty over the last this many tokens (0: off)
  double overlong_penalty = 1.0;     // the penalty at rollout.max_new_tokens
};

struct TrainConfig {
  std::int64_t num_steps = 100;
  std::int64_t train_batch_size = 128;
  std::int64_t micro_batch_tokens = 16384;
  double actor_lr = 1e-6;
  double critic_lr = 9e-6;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  double max_grad_norm = 1.0;
  LrScheduleKind lr_schedule = LrScheduleKind::kConstant;
  std::int64_t warmup_steps = 0;
  double min_lr_ratio = 0.1;
  std::int64_t critic_warmup_steps = 0;  // steps that train only the critic (no actor update, no sync)
  RecomputeChoice recompute = RecomputeChoice::kAuto;  // zero/recompute.h
  std::int64_t recompute_layers = -1;  // blocks (from the first) that keep what recompute keeps; -1: all
  ComputeShard compute_shard = ComputeShard::kAuto;  // a persistent bf16 copy of the trained shards, or cast per gather
  std::int64_t optimizer_threads = 0;  // host AdamW's threads per rank (optimizer_offload: cpu); 0: cores / local ranks
  Precision reduce_dtype = Precision::kFp32;  // what gradients are reduce-scattered in
  OldLogprobs old_logprobs = OldLogprobs::kRecompute;  // where the PPO ratio's old log-probs come from
  std::string step_hooks;  // registered step hooks, by name, comma-separated (tiller/controller/step_hooks.h)
};

// Evaluation during RL (docs/training.md, "Evaluation"): held-out prompts on the job's engines.
struct EvalConfig {
  std::string prompts;             // JSONL or parquet, data.*'s keys and templates ("": off)
  std::int64_t every_steps = 0;    // evaluate after every N steps (and after the last); 0: not during the run
  bool before_train = false;       // evaluate the starting weights (step 0)
  bool greedy = true;              // one greedy sample a prompt: eval/<source>/greedy_accuracy
  std::int64_t n_samples = 0;      // k samples a prompt at `temperature`: pass@k, mean@k (0: none)
  double temperature = 1.0;
  double top_p = 1.0;
  std::int64_t max_new_tokens = 0;  // 0: rollout.max_new_tokens
  std::int64_t max_prompts = 0;     // 0: every prompt of the file
  double correct_reward = 1.0;      // a sample is correct when its reward is at least this
  std::string reward_rule;          // "": the job's reward (reward.*); else this rule
  std::int64_t samples_per_source = 4;  // decoded samples kept per data source in eval/step_<N>.jsonl, and all with -1
  bool enabled() const { return !prompts.empty(); }
};

struct CheckpointConfig {
  std::string dir;
  std::int64_t every_steps = 0;
  std::int64_t keep_last = 2;
  bool resume = true;
  bool save_hf = false;
};

// Experiment tracking through the trackers' own Python packages (docs/training.md, "Metrics").
struct WandbConfig {
  std::string project;          // "": off
  std::string entity, name;     // name "": run.name
  std::string tags;             // comma-separated
  std::string mode = "online";  // online | offline | disabled
  std::string dir;              // "": run.output_dir
};
struct MlflowConfig {
  std::string experiment;    // "": off
  std::string tracking_uri;  // "": MLflow's default ($MLFLOW_TRACKING_URI, else ./mlruns)
  std::string run_name;      // "": run.name
};

struct LoggingConfig {
  std::string level = "info";
  std::int64_t every_steps = 1;
  std::string metrics_jsonl;    // "": <output_dir>/metrics.jsonl
  std::string tensorboard_dir;  // "": <output_dir>/tensorboard
  std::string chrome_trace;     // "": <output_dir>/trace.json (written when profile_steps is set)
  std::string profile_steps;    // "3" or "3,5" or "3-5": steps whose phases go into the Chrome trace
  std::string rollout_records;  // "": none; else a JSONL file with one line per trained or dropped sample
  bool rollout_records_tokens = false;  // the records also carry token ids and engine log-probs
  bool rollout_records_text = false;    // the records also carry the decoded prompt and response
  std::int64_t samples_per_step = 4;    // decoded samples a step writes to samples_jsonl and TensorBoard (0: none)
  std::string samples_jsonl;            // "": <output_dir>/samples.jsonl
  bool efficiency = true;  // each phase's rate against its benchmark at the job's shapes (efficiency/*)
  WandbConfig wandb;
  MlflowConfig mlflow;
};

// The environment of multi-turn rollouts (docs/training.md, "Environments").
struct EnvConfig {
  EnvType type = EnvType::kNone;
  std::string name;           // inprocess: the name it was registered under (tiller::env::register_env)
  std::string address;        // remote: host:port
  double timeout_s = 60;      // deadline of one call
  std::int64_t retries = 3;
  std::int64_t concurrency = 64;  // calls in flight at once
  std::string observation_role = "tool";  // the chat template's role of an observation: tool | user
  std::string token_file;
  std::string tls_ca, tls_server_name;
};

// Agent harnesses behind an OpenAI-compatible endpoint (rollout.loop: openai_agent; docs/agents.md).
struct AgentConfig {
  std::string harness;            // FILE.py:FUNCTION, command (agent.command), or a harness registered in C++
  std::string command;            // agent.harness command: the shell command run for each sample
  AgentDrift drift = AgentDrift::kError;  // a request that does not extend the sample's tokens
  std::int64_t concurrency = 16;  // harness calls at once (threads)
  double timeout_s = 600;         // deadline of one harness call (a whole sample)
  std::string host = "127.0.0.1"; // where the endpoint listens
  std::int64_t port = 0;          // 0: a free port
  std::string tool_call_parser = "none";  // none | hermes (openai_server.h)
};

// The offline trainers (tiller sft, train-rm, dpo; docs/offline.md): their data and schedule. They
// train roles.actor.model with train.* (actor_lr, schedule, clipping, micro_batch_tokens, and
// train_batch_size samples or pairs per optimizer step); dpo's reference is roles.ref.model (or
// the actor's).
struct OfflineConfig {
  std::string data;                 // JSONL or parquet
  std::string eval_data;            // a held-out file; "" holds out eval_samples of `data`
  std::int64_t eval_samples = 0;
  std::int64_t eval_every = 0;      // steps between evaluations (0: only after the last step)
  std::int64_t epochs = 1;
  std::int64_t max_steps = 0;       // > 0: stop after this many steps
  std::int64_t max_tokens = 2048;   // per sample (per pair side for preferences)
  LongSamplePolicy long_samples = LongSamplePolicy::kSkip;
  std::string messages_key = "messages";
  std::string tools_key = "tools";
  std::string prompt_key = "prompt";
  std::string response_key = "response";
  std::string chosen_key = "chosen";
  std::string rejected_key = "rejected";
  std::string margin_key = "margin";
  OfflineLossMean loss_mean = OfflineLossMean::kToken;
  double dpo_beta = 0.1;
  double dpo_label_smoothing = 0.0;  // cDPO
  DpoLossKind dpo_loss = DpoLossKind::kSigmoid;
  DpoReference dpo_reference = DpoReference::kPrecompute;
  std::string export_dir;           // HF export of the result; "": <output_dir>/model
};

struct TimeoutsConfig {
  double collective_s = 600.0;
  double startup_s = 300.0;
  double generate_s = 1800.0;
  double weight_sync_s = 300.0;
  double train_s = 1800.0;
  double rpc_s = 60.0;
  double download_s = 7200.0;  // the job's hub models, when they are not in the cache
  double step_s = 0.0;  // one whole step; 0: none (each call in it still has its own)
};

struct JobConfig {
  RunConfig run;
  ClusterConfig cluster;
  RolesConfig roles;
  EnginesConfig engines;
  RolloutConfig rollout;
  AlgoConfig algo;
  DataConfig data;
  RewardConfig reward;
  EnvConfig env;
  AgentConfig agent;
  TrainConfig train;
  CheckpointConfig checkpoint;
  EvalConfig eval;
  LoggingConfig logging;
  OfflineConfig offline;
  TimeoutsConfig timeouts;

  // Cross-key checks that no single key's range can express (e.g. ref colocated with itself).
  void validate() const;
  void validate_hybrid() const;  // the cluster.hybrid and roles.*.offload rules (part of validate)
  void validate_sequence_parallel() const;  // roles.*.sequence_parallel against gpus and colocation (part of validate)
  // The engines the job runs: engines.count, or with cluster.hybrid one per engines.tp actor GPUs.
  std::int64_t engine_count() const;
  // Samples of several model turns with tokens of another origin between them (a loss mask): an
  // environment's episodes, or an agent harness's conversations.
  bool multi_turn() const { return env.type != EnvType::kNone || agent_loop(); }
  bool agent_loop() const { return rollout.loop == "openai_agent"; }
  // Tokens after the prompt of one sample: max_new_tokens, or with an environment
  // rollout.max_response_tokens (0: max_new_tokens x max_turns).
  std::int64_t response_limit() const;
  // LoRA's reference for free: the actor trains adapters (roles.actor.lora), the reference is in
  // its processes (roles.ref.colocate_with: actor) and loads no model of its own (roles.ref.model
  // empty or the actor's): the reference log-probs are the actor's with its adapters off, and no
  // second model is loaded.
  bool ref_is_actor_base() const;
  // cluster.hybrid_scoring resolved for a job over `backend`: whether the trainers score a hybrid
  // step only once its generation is over, with the engines asleep. auto picks that for engines at
  // TP > 1 over NCCL: their forward's all-reduces and the trainers' collectives would otherwise run
  // at once on the same GPUs, where any device-wide synchronisation (the caching allocator
  // returning memory near a full GPU) on one rank can wait for a kernel whose peer waits for it
  // (docs/training.md, the hybrid engine). False outside hybrid jobs.
  bool hybrid_scores_after_generate(BackendKind backend) const;
};

// A role's settings by its Role: roles.actor, roles.critic, roles.ref or roles.reward.
const RoleConfig& role_config(const JobConfig& c, Role r);
RoleConfig& role_config(JobConfig& c, Role r);

// The backend a plan made without the ranks assumes (tiller plan, the memory plan): cluster.backend,
// or for auto MPI when cluster.device is cpu and NCCL otherwise, as a GPU run chooses
// (dist::choose_device decides on each rank).
BackendKind planned_backend(const ClusterConfig& cluster);

// Loads `path`, then applies `overrides` ("a.b=c", values in YAML syntax) in order, then validates.
JobConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text; `origin` names it in errors (a file name or "<string>").
JobConfig parse_config(const std::string& yaml_text, const std::string& origin,
                       const std::vector<std::string>& overrides = {});
// Applies one "a.b=c" override to `config` (no validate()).
void apply_override(JobConfig& config, const std::string& assignment);

// The effective config as YAML (every key, including defaults).
std::string to_yaml(const JobConfig& config);
// docs/config.md, generated from the schema.
std::string config_reference_markdown();
// Every valid key path ("roles.actor.gpus", ...), in schema order.
std::vector<std::string> config_keys();

}  // namespace tiller
