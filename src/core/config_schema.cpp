#include "config_schema.h"

#include <type_traits>

#include "tiller/core/error.h"

namespace tiller::config_schema {
namespace {

// Upper bounds of user-given sizes. Every number in the schema has both bounds (fields() checks),
// so a sum or product of a few of them cannot overflow 64 bits and no count is absurd enough to
// become an allocation that kills a rank.
constexpr double kMaxSampleTokens = 1 << 24;  // tokens of one prompt or one completion
constexpr double kMaxBatchTokens = 1 << 30;   // tokens of one packed micro-batch
constexpr double kMaxCount = 1e9;             // steps, samples, prompts
constexpr double kMaxSeconds = 1e7;           // a deadline (~116 days)
constexpr double kMaxSeed = 9.2e18;           // below 2^63

template <typename T>
constexpr Kind kind_of() {
  if constexpr (std::is_same_v<T, bool>) return Kind::kBool;
  else if constexpr (std::is_same_v<T, std::int64_t>) return Kind::kInt;
  else if constexpr (std::is_same_v<T, double>) return Kind::kDouble;
  else {
    static_assert(std::is_same_v<T, std::string>, "config fields are bool, int64, double or string");
    return Kind::kString;
  }
}

class Builder {
 public:
  template <typename Get>
  Field& add(std::string path, Get get, std::string doc) {
    using T = std::remove_pointer_t<decltype(get(std::declval<JobConfig&>()))>;
    fields_.push_back(Field{std::move(path), kind_of<T>(),
                            [get](JobConfig& c) -> void* { return get(c); }, {}, {}, std::move(doc),
                            std::nullopt, std::nullopt, {}});
    return fields_.back();
  }
  // A config enum: its choices are EnumNames<E>::names.
  template <typename Get>
  Field& add_enum(std::string path, Get get, std::string doc) {
    using E = std::remove_pointer_t<decltype(get(std::declval<JobConfig&>()))>;
    std::vector<std::string> names;
    for (std::string_view n : EnumNames<E>::names) names.emplace_back(n);
    fields_.push_back(Field{std::move(path), Kind::kEnum, {},
                            [get](const JobConfig& c) { return static_cast<int>(*get(const_cast<JobConfig&>(c))); },
                            [get](JobConfig& c, int v) { *get(c) = static_cast<E>(v); }, std::move(doc),
                            std::nullopt, std::nullopt, std::move(names)});
    return fields_.back();
  }
  std::vector<Field> take() { return std::move(fields_); }

 private:
  std::vector<Field> fields_;
};

#define TILLER_FIELD(expr) [](JobConfig& c) { return &c.expr; }

void add_role(Builder& b, const std::string& name, RoleConfig& (*get)(JobConfig&)) {
  const std::string p = "roles." + name + ".";
  b.add(p + "enabled", [get](JobConfig& c) { return &get(c).enabled; },
        "Whether the " + name + " role runs at all (the actor always does; the critic only for GAE).");
  b.add(p + "model", [get](JobConfig& c) { return &get(c).model; },
        "Hugging Face model directory, or a hub id (Qwen/Qwen2.5-7B-Instruct[@revision]) found in the Hugging "
        "Face cache (HF_HUB_CACHE / HF_HOME), or downloaded into it through huggingface_hub by one rank per node "
        "unless HF_HUB_OFFLINE is set. Empty: the actor's model (ref), or none.");
  b.add(p + "gpus", [get](JobConfig& c) { return &get(c).gpus; },
        "Ranks (one GPU each) in this role's ZeRO-3 group. Ignored when colocated.")
      .range(1, 4096);
  b.add(p + "colocate_with", [get](JobConfig& c) { return &get(c).colocate_with; },
        "Empty, or another role (actor, critic, ref, reward) whose ranks this role shares; "
        "colocated roles run one after the other on the same GPUs.")
      .one_of({"", "actor", "critic", "ref", "reward"});
  b.add_enum(p + "dtype", [get](JobConfig& c) { return &get(c).dtype; },
        "Compute dtype of the role's forward and backward passes.")
      ;
  b.add(p + "replicate", [get](JobConfig& c) { return &get(c).replicate; },
        "Frozen roles (ref, reward) only: hold a full replica on every rank instead of ZeRO-3 shards.");
  b.add(p + "offload", [get](JobConfig& c) { return &get(c).offload; },
        "Trainable roles with cluster.hybrid: move the fp32 masters and AdamW moments to pinned host memory while "
        "the engines generate, and back before training, and free the gradient accumulators meanwhile (they hold "
        "nothing between steps); the compute shards stay for scoring.");
  b.add_enum(p + "optimizer_offload", [get](JobConfig& c) { return &get(c).optimizer_offload; },
        "Trainable roles: none, or cpu: the fp32 master weights and AdamW moments live in host memory for the whole "
        "run and a multithreaded CPU AdamW updates them (docs/zero.md). The GPU keeps the bf16 shard and the fp32 "
        "gradients, 6 bytes per parameter / N instead of 18; each step streams the gradients to the host and the new "
        "bf16 shard back, overlapped with the update (train.optimizer_threads).")
      ;
  b.add(p + "sequence_parallel", [get](JobConfig& c) { return &get(c).sequence_parallel; },
        "Sequence parallelism: this many consecutive ranks of the role share each micro-batch, each holding and "
        "computing 1/S of its tokens (Ulysses attention; docs/zero.md). Must divide gpus and the model's attention "
        "heads; a colocated role takes its host's value. train.micro_batch_tokens stays per rank.")
      .range(1, 256);
  b.add(p + "context_parallel", [get](JobConfig& c) { return &get(c).context_parallel; },
        "Context parallelism within the sequence group: of its S ranks, this many groups split attention's keys "
        "(each all-gathers the row's keys and values and attends its own query rows) and S / context_parallel "
        "ranks within each split the heads (Ulysses). Must divide the role's sequence_parallel (its host's when "
        "colocated); only S / context_parallel must divide the heads, so S may pass the head count "
        "(docs/zero.md).")
      .range(1, 256);
  b.add(p + "router_aux_loss_coef", [get](JobConfig& c) { return &get(c).router_aux_loss_coef; },
        "Trained mixture-of-experts roles: the coefficient of the load-balancing loss added to the training loss "
        "(transformers' formula per sparse layer, E * sum_e f_e * P_e, averaged over the layers; the model's "
        "config.json calls its value router_aux_loss_coef, e.g. 0.001 for Qwen3-MoE). 0: off. Metric "
        "moe/<role>/router_aux_loss (docs/training.md).")
      .range(0.0, 100.0);
  b.add(p + "router_z_loss_coef", [get](JobConfig& c) { return &get(c).router_z_loss_coef; },
        "Trained mixture-of-experts roles: the coefficient of the router z-loss (ST-MoE: the mean squared "
        "logsumexp of the router's logits, averaged over the sparse layers; 0.001 is usual). 0: off. Metric "
        "moe/<role>/router_z_loss.")
      .range(0.0, 100.0);
  b.add(p + "fp8", [get](JobConfig& c) { return &get(c).fp8; },
        "FP8 training (docs/training.md): the blocks' attention and MLP projections run their forward and both "
        "backward GEMMs in e4m3 on Hopper's tensor cores, quantized per GEMM with current scaling "
        "(roles.<role>.fp8_scaling); emulated on the CPU. The embedding, the router, a mixture's routed experts, the "
        "LM or value head, LoRA adapters, the norms, the masters, the optimizer and the gradient reductions keep "
        "their precision. Needs "
        "dtype bf16 and, on GPUs, compute capability 9.x. A frozen role (ref, reward) then scores in FP8 too.");
  b.add_enum(p + "fp8_scaling", [get](JobConfig& c) { return &get(c).fp8_scaling; },
             "roles.<role>.fp8: block (activations and gradients in groups of 128 along each GEMM's inner axis, "
             "weights in 128x128 blocks: DeepSeek-V3's recipe) or channel (one scale per row of every operand: "
             "faster GEMMs, coarser scales). tensor is the engines' only (engines.fp8_scaling).");
  if (name != "actor" && name != "critic") return;  // frozen roles train no adapters
  const std::string l = p + "lora.";
  b.add(l + "rank", [get](JobConfig& c) { return &get(c).lora.rank; },
        "LoRA: the adapters' rank r. 0: full fine-tuning. With r > 0 the base weights are frozen (sharded, no "
        "optimizer state) and only the adapters train, in fp32 (a critic's value head trains whole beside them). "
        "The actor's: its engines hold the adapters unmerged and each weight sync sends them alone, and a "
        "reference colocated with it (no roles.ref.model of its own) is its base with the adapters off, no second "
        "model loaded (docs/training.md, LoRA).")
      .range(0, 4096);
  b.add(l + "alpha", [get](JobConfig& c) { return &get(c).lora.alpha; },
        "LoRA: alpha; the adapters' output is scaled by alpha / r (alpha / sqrt(r) with use_rslora).")
      .range(1e-6, 1e6);
  b.add(l + "target_modules", [get](JobConfig& c) { return &get(c).lora.target_modules; },
        "LoRA: the projections that get adapters, PEFT's names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj; a list or comma-separated), or all-linear (all of them; a mixture of experts' attention only).")
      .as_list();
  b.add(l + "dropout", [get](JobConfig& c) { return &get(c).lora.dropout; },
        "LoRA: dropout of the adapters' inputs in training (PEFT's lora_dropout).")
      .range(0.0, 0.9);
  b.add(l + "use_rslora", [get](JobConfig& c) { return &get(c).lora.use_rslora; },
        "LoRA: rank-stabilised scaling, alpha / sqrt(r) (PEFT's use_rslora).");
  b.add(l + "init_from", [get](JobConfig& c) { return &get(c).lora.init_from; },
        "LoRA: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from; its r, "
        "alpha and target modules must match these keys. Empty: PEFT's initialisation (A random, B zero).");
}

std::vector<Field> build() {
  Builder b;
  b.add("run.name", TILLER_FIELD(run.name), "Name of the run, used in logs and output paths.");
  b.add("run.seed", TILLER_FIELD(run.seed), "Seed for data shuffling, sampling and initialisation.")
      .range(0, kMaxSeed);
  b.add("run.output_dir", TILLER_FIELD(run.output_dir), "Directory for metrics, traces and exports.");

  b.add("cluster.gpus_per_node", TILLER_FIELD(cluster.gpus_per_node),
        "GPUs on each node. 0: detect with the CUDA device count (on CPU: one slot per rank).")
      .range(0, 1024);
  b.add_enum("cluster.device", TILLER_FIELD(cluster.device),
        "Where roles compute. auto: CUDA when this build and the node have it, else CPU.")
      ;
  b.add_enum("cluster.backend", TILLER_FIELD(cluster.backend),
        "Communicator backend. auto: NCCL on CUDA, MPI on CPU.")
      ;
  b.add("cluster.ranks_per_gpu", TILLER_FIELD(cluster.ranks_per_gpu),
        "Worker ranks per GPU. 2 lets the engines share the trainers' GPUs (a one-GPU job: the actor and "
        "an engine on GPU 0). Worker rank i of a node gets GPU i mod gpus_per_node. A group with two "
        "ranks on one GPU communicates through the host (MPI) instead of NCCL; set "
        "engines.kv_cache_gb (or gpu_memory_fraction) so the engine leaves the trainers room.")
      .range(1, 8);
  b.add("cluster.hybrid", TILLER_FIELD(cluster.hybrid),
        "Hybrid engine: every actor GPU also runs an engine (engines.tp consecutive actor ranks per engine), in the "
        "actor rank's own process. Phases alternate on each GPU: generate, then score and train with the engine "
        "asleep (engines.sleep_level); the weights reach the engine by a copy on the GPU. engines.count is derived.");
  b.add_enum("cluster.hybrid_scoring", TILLER_FIELD(cluster.hybrid_scoring),
        "cluster.hybrid: when the trainers score a step's samples (log-probs, values, rewards of a model). overlap: "
        "as they arrive, while the engines generate the rest; after_generate: once all are in, with the engines' KV "
        "caches asleep (no scoring activations beside the cache). auto: after_generate for engines.tp > 1 over NCCL, "
        "whose all-reduces must not run beside the trainers' collectives on the same GPUs (overlap is refused "
        "there), overlap otherwise (docs/training.md).")
      ;
  b.add("cluster.gpu_memory_gb", TILLER_FIELD(cluster.gpu_memory_gb),
        "GPU memory per GPU in GiB for the memory plan (tiller plan checks the fit with it); 0: tiller train "
        "asks the device, tiller plan prints the estimates without a fit check. On a larger GPU tiller train also "
        "caps each rank's caching allocator at it, so the job allocates as it would on a GPU of that size.")
      .range(0.0, 65536.0);
  b.add("cluster.host_memory_gb", TILLER_FIELD(cluster.host_memory_gb),
        "Host memory per node in GiB for the memory plan: what optimizers on the host (roles.<r>.optimizer_offload) "
        "and hybrid offload (roles.<r>.offload) keep there must fit 9/10 of it. 0: tiller train reads the node's, "
        "tiller plan checks no host fit.")
      .range(0.0, 1048576.0);

  add_role(b, "actor", +[](JobConfig& c) -> RoleConfig& { return c.roles.actor; });
  add_role(b, "critic", +[](JobConfig& c) -> RoleConfig& { return c.roles.critic; });
  add_role(b, "ref", +[](JobConfig& c) -> RoleConfig& { return c.roles.ref; });
  add_role(b, "reward", +[](JobConfig& c) -> RoleConfig& { return c.roles.reward; });

  b.add("engines.count", TILLER_FIELD(engines.count), "Number of inference engines.").range(0, 4096);
  b.add("engines.tp", TILLER_FIELD(engines.tp),
        "Tensor-parallel size of each engine: its ranks always sit on one node.")
      .range(1, 64);
  b.add("engines.model", TILLER_FIELD(engines.model),
        "Model the engines start from (a folder or a hub id in the cache). Empty: the actor's.");
  b.add("engines.max_num_seqs", TILLER_FIELD(engines.max_num_seqs),
        "Most sequences one engine decodes at once.").range(1, 1 << 20);
  b.add("engines.max_batched_tokens", TILLER_FIELD(engines.max_batched_tokens),
        "Most tokens one engine step processes (prefill chunks + decodes).").range(16, 1 << 24);
  b.add("engines.kv_block_size", TILLER_FIELD(engines.kv_block_size), "Tokens per paged KV-cache block.")
      .range(1, 1024);
  b.add("engines.gpu_memory_fraction", TILLER_FIELD(engines.gpu_memory_fraction),
        "Fraction of the GPU memory still free once an engine has loaded its weights that its KV cache "
        "takes (measured at its start, after PyTorch's cached but unused blocks are handed back, so trainers "
        "sharing the GPU keep the rest), or less where a step of engines.max_batched_tokens needs more room for "
        "its activations than the rest (docs/engine.md).")
      .range(0.05, 1.0);
  b.add("engines.kv_cache_gb", TILLER_FIELD(engines.kv_cache_gb),
        "KV cache of each engine rank in GiB; 0: engines.gpu_memory_fraction. A fixed size does not depend on "
        "what trainers sharing the GPU have allocated when the engine starts (cluster.ranks_per_gpu > 1).")
      .range(0.0, 65536.0);
  b.add("engines.sleep_level", TILLER_FIELD(engines.sleep_level),
        "cluster.hybrid: what an engine frees while the trainers score and train: 0 nothing, 1 its KV cache and "
        "decode graphs, 2 its weights too (refilled by the next weight sync).")
      .range(0, 2);
  b.add("engines.session_timeout_s", TILLER_FIELD(engines.session_timeout_s),
        "Multi-turn rollouts: how long a finished turn's KV cache stays on its engine waiting for the sample's next "
        "turn (it is evicted sooner when the memory is needed).")
      .range(0.001, kMaxSeconds);
  b.add("engines.max_sessions", TILLER_FIELD(engines.max_sessions),
        "Multi-turn rollouts: most finished turns whose KV cache an engine keeps for their next turn (0: 4 x "
        "engines.max_num_seqs); the oldest go first.")
      .range(0, 1 << 24);
  b.add("engines.port", TILLER_FIELD(engines.port),
        "First gRPC port; engine i listens on port + i. 0: each engine picks a free port.")
      .range(0, 65535);
  b.add("engines.host", TILLER_FIELD(engines.host),
        "Address the engines bind (the controller reaches them by their node's host name).");
  b.add("engines.tls_cert", TILLER_FIELD(engines.tls_cert),
        "PEM certificate the engines serve TLS with (with engines.tls_key); empty: plaintext gRPC. The engines "
        "always require the job's random token; TLS also hides the traffic when engines and controller are on "
        "different hosts.");
  b.add("engines.tls_key", TILLER_FIELD(engines.tls_key), "PEM private key of engines.tls_cert.");
  b.add("engines.tls_ca", TILLER_FIELD(engines.tls_ca),
        "PEM roots the controller verifies the engines' certificate with; empty: engines.tls_cert itself "
        "(a self-signed certificate).");
  b.add("engines.tls_server_name", TILLER_FIELD(engines.tls_server_name),
        "The name the engines' certificate must carry; empty: the engine's host name.");
  b.add_enum("engines.quantization", TILLER_FIELD(engines.quantization),
        "fp8: the engines hold their linear layers' weights also in e4m3 (scaled as engines.fp8_scaling says; "
        "quantized at load and after every weight sync) and run those GEMMs in FP8 on Hopper's tensor cores "
        "(emulated elsewhere), with the activations quantized to match. The trainers stay bf16: pair it with "
        "algo.importance_correction (docs/engine.md, FP8 engines).");
  b.add_enum("engines.fp8_scaling", TILLER_FIELD(engines.fp8_scaling),
             "engines.quantization fp8: block (128x128 weight blocks and activation groups of 128, DeepSeek-V3's "
             "layout), channel (one scale per weight row and per token, vLLM's FP8-dynamic scheme) or tensor (one "
             "scale per weight and one for a GEMM's activations, computed from them each time: vLLM's online "
             "--quantization fp8). tensor has the fastest GEMMs at decode's batch sizes on Hopper; block's finer "
             "scales keep the engine nearest the trainer (docs/engine.md, docs/benchmarks.md).");
  b.add_enum("engines.kv_cache_dtype", TILLER_FIELD(engines.kv_cache_dtype),
             "The engines' KV cache: auto (the compute dtype) or fp8 (e4m3 with one fp32 scale per cached token "
             "and KV head, amax / 448: about half the bytes, so nearly twice the tokens fit; attention reads the "
             "keys and values dequantized to the compute dtype). Independent of engines.quantization; pair it with "
             "algo.importance_correction (docs/engine.md, FP8 KV cache).");
  b.add("engines.sync_bucket_mb", TILLER_FIELD(engines.sync_bucket_mb),
        "Largest bucket of the weight broadcast from the actor to the engines, in MiB.")
      .range(1, 65536);

  b.add("rollout.batch_size", TILLER_FIELD(rollout.batch_size), "Prompts per PPO step.").range(1, 1 << 24);
  b.add("rollout.n_samples_per_prompt", TILLER_FIELD(rollout.n_samples_per_prompt),
        "Completions sampled for each prompt.").range(1, 1024);
  b.add("rollout.max_prompt_tokens", TILLER_FIELD(rollout.max_prompt_tokens),
        "Longest prompt in tokens; longer ones follow data.long_prompt_policy.").range(1, kMaxSampleTokens);
  b.add("rollout.max_new_tokens", TILLER_FIELD(rollout.max_new_tokens), "Most tokens generated per completion.")
      .range(1, kMaxSampleTokens);
  b.add("rollout.temperature", TILLER_FIELD(rollout.temperature), "Sampling temperature (0: greedy).")
      .range(0.0, 100.0);
  b.add("rollout.top_p", TILLER_FIELD(rollout.top_p), "Nucleus sampling threshold (1: off).").range(0.0, 1.0);
  b.add("rollout.top_k", TILLER_FIELD(rollout.top_k), "Top-k sampling (-1: off).").range(-1, kMaxSampleTokens);
  b.add("rollout.micro_batch_tokens", TILLER_FIELD(rollout.micro_batch_tokens),
        "Token budget of one packed scoring micro-batch (log-probs, values, rewards).")
      .range(1, kMaxBatchTokens);
  b.add_enum("rollout.mode", TILLER_FIELD(rollout.mode),
             "sync: each step generates, scores, trains, then syncs the weights. async: the engines keep "
             "generating the next steps' samples while the trainers score and train, within "
             "rollout.max_staleness (docs/training.md).");
  b.add("rollout.max_staleness", TILLER_FIELD(rollout.max_staleness),
        "async: weight versions a sample's oldest token may lag the weights it is trained from (-1: 1). "
        "0 is the on-policy loop of sync mode. Sync mode needs -1 or 0.")
      .range(-1, 8);
  b.add_enum("rollout.stale_policy", TILLER_FIELD(rollout.stale_policy),
             "async: wait (a step trains the prompts in the order they were sent, waiting for stragglers; no "
             "sample is ever too stale) or drop (a step trains the groups that finished first; a group that "
             "would lag more than max_staleness is dropped and counted in rollout/stale_dropped_groups).");
  b.add("rollout.partial", TILLER_FIELD(rollout.partial),
        "async: at a weight sync the engines keep their in-flight samples (tokens and log-probs), recompute "
        "their KV cache with the new weights and continue, instead of finishing them before the sync.");
  b.add("rollout.filter_groups", TILLER_FIELD(rollout.filter_groups),
        "DAPO dynamic sampling: drop prompt groups whose n rewards are all equal (no learning signal) and "
        "sample more prompts until the step has rollout.batch_size informative groups.");
  b.add("rollout.filter_max_extra_batches", TILLER_FIELD(rollout.filter_max_extra_batches),
        "With filter_groups: at most this many x rollout.batch_size prompts beyond the batch per step; when "
        "they run out the step trains the informative groups it has (logged).")
      .range(0, 64);

  b.add("rollout.loop", TILLER_FIELD(rollout.loop),
        "How a prompt's samples are made: a registered sample loop. Built in: single_turn (one engine request of "
        "n samples) and multi_turn (episodes with the environment, env.*); unset: multi_turn with an "
        "environment, single_turn without. A trainer of your own registers its agent loops (docs/library.md).");
  b.add("rollout.loop_args", TILLER_FIELD(rollout.loop_args),
        "A registered sample loop's settings, a string in a format of its own.");
  b.add("rollout.max_turns", TILLER_FIELD(rollout.max_turns),
        "With an environment (env.type): most model turns of one sample; the episode ends at its environment's "
        "done, at this many turns, or at rollout.max_response_tokens. With an agent harness (openai_agent): the "
        "requests one sample may send (more are refused).")
      .range(1, 1024);
  b.add("rollout.max_response_tokens", TILLER_FIELD(rollout.max_response_tokens),
        "With an environment or an agent harness: most tokens after the prompt of one sample, the model's turns "
        "and the observations (or the harness's text) together (0: max_new_tokens x max_turns). Each turn generates at most max_new_tokens, and fewer when "
        "this limit is near.")
      .range(0, kMaxSampleTokens);

  b.add("algo.advantage_estimator", TILLER_FIELD(algo.advantage_estimator),
        "A registered advantage estimator. Built in: gae (PPO with a critic), reinforce (REINFORCE++), rloo, "
        "reinforce_baseline, group_norm (GRPO), dr_grpo; a trainer of your own registers more "
        "(docs/library.md).");
  b.add("algo.policy_loss", TILLER_FIELD(algo.policy_loss),
        "A registered policy loss. Built in: ppo (the clipped surrogate, with clip_eps_low/high and dual_clip), pg "
        "(-A * logp, no ratio or clipping: GPG); a trainer of your own registers more (docs/library.md). The KL loss "
        "and the entropy bonus are added to it.");
  b.add("algo.gamma", TILLER_FIELD(algo.gamma), "Discount factor.").range(0.0, 1.0);
  b.add("algo.lambd", TILLER_FIELD(algo.lambd), "GAE lambda.").range(0.0, 1.0);
  b.add("algo.clip_eps_low", TILLER_FIELD(algo.clip_eps_low), "PPO ratio clip below 1.").range(0.0, 1.0);
  b.add("algo.clip_eps_high", TILLER_FIELD(algo.clip_eps_high), "PPO ratio clip above 1 (asymmetric clip).")
      .range(0.0, 10.0);
  b.add("algo.dual_clip", TILLER_FIELD(algo.dual_clip), "Dual-clip constant c > 1 for negative advantages (0: off).")
      .range(0.0, 100.0);
  b.add("algo.value_loss", TILLER_FIELD(algo.value_loss),
        "A registered value loss (the critic's). Built in: clipped (PPO's, clipped around the old values by "
        "algo.value_clip); a trainer of your own registers more (docs/library.md).");
  b.add("algo.value_clip", TILLER_FIELD(algo.value_clip), "Value-loss clip range (0: off).").range(0.0, 100.0);
  b.add("algo.kl_coef", TILLER_FIELD(algo.kl_coef), "Initial KL coefficient against the reference model.")
      .range(0.0, 100.0);
  b.add("algo.distill_coef", TILLER_FIELD(algo.distill_coef),
        "On-policy distillation (0: off): the reference role is the teacher (roles.ref.model: a larger or better "
        "model with the same tokenizer, frozen, sharded, colocatable) and every sampled token's advantage gains "
        "distill_coef x (log p_teacher - log p_student), the per-token reverse KL, beside the task reward's "
        "advantage (docs/training.md, Distillation). Usually with algo.kl_coef 0.")
      .range(0.0, 1000.0);
  b.add("algo.kl_estimator", TILLER_FIELD(algo.kl_estimator),
        "A registered KL estimator. Built in: k1 (logp - ref), k2 (its square over 2), k3 (exp(-d) - 1 + d); a "
        "trainer of your own registers more (docs/library.md).");
  b.add("algo.kl_in_reward", TILLER_FIELD(algo.kl_in_reward),
        "true: KL penalty in the per-token reward (PPO); false: KL as a loss term (GRPO).");
  b.add("algo.target_kl", TILLER_FIELD(algo.target_kl), "Adaptive KL controller target (0: fixed kl_coef).")
      .range(0.0, 100.0);
  b.add("algo.kl_horizon", TILLER_FIELD(algo.kl_horizon), "Horizon of the adaptive KL controller, in samples.")
      .range(1.0, 1e12);
  b.add_enum("algo.importance_correction", TILLER_FIELD(algo.importance_correction),
             "Off-policy correction of the policy loss against the engine's log-probs (the behaviour policy; the "
             "PPO ratio is taken against the actor's recomputed log-probs, the proximal policy). none; tis: each "
             "token's loss weighted by w = exp(proximal - behaviour) truncated at algo.tis_cap; mis: weighted by w "
             "where it lies in [algo.is_cap_lower, algo.tis_cap], masked out elsewhere; decoupled: decoupled PPO, "
             "weighted by w, tokens with w > algo.tis_cap masked out (0: none masked). tis and mis take w at "
             "algo.is_level.");
  b.add("algo.tis_cap", TILLER_FIELD(algo.tis_cap),
        "Cap of the importance weights: truncation (tis), upper mask bound (mis) or mask threshold (decoupled; 0: "
        "no mask).")
      .range(0.0, 1000.0);
  b.add_enum("algo.is_level", TILLER_FIELD(algo.is_level),
             "tis and mis: the weight w of each token. token: its own exp(d); sequence: its sample's product of "
             "ratios exp(sum d); geometric: their geometric mean exp(mean d). A sample-level weight is truncated "
             "or masked as a whole.");
  b.add("algo.is_cap_lower", TILLER_FIELD(algo.is_cap_lower),
        "mis: the lower mask bound of the weights (0: 1 / algo.tis_cap).")
      .range(0.0, 1.0);
  b.add("algo.is_veto", TILLER_FIELD(algo.is_veto),
        "Rejection: a sample with any token whose weight exp(proximal - behaviour) is below this is left out of the "
        "policy loss (a token the engine drew and the trainer finds near impossible; e.g. 1e-4). 0: off. Counted "
        "in off_policy/rejected_samples.")
      .range(0.0, 1.0);
  b.add_enum("algo.logprob_match", TILLER_FIELD(algo.logprob_match),
             "off: the fastest kernels, and the engine's log-probs differ from the trainer's in their last bits "
             "(mismatch/*). bitwise: every rank runs batch-invariant forward kernels (one reduction order whatever "
             "the batch), so each sampled token's engine log-prob equals the trainer's bit for bit "
             "(mismatch/tokens_differing is 0) and the first mini-batch's PPO ratio is exactly 1. CPU and CUDA; "
             "needs engines.tp = 1 (docs/training.md).");
  b.add("algo.routing_replay", TILLER_FIELD(algo.routing_replay),
        "Routing replay (mixture-of-experts actors): the engine records the experts that routed every prompt and "
        "generated token, the controller ships them with the micro-batches, and the actor's scoring and training "
        "forwards take those experts (the router's probabilities at them still weight them and get the gradient). "
        "Dense actors are refused (docs/training.md).");
  b.add("algo.seq_mask_ratio", TILLER_FIELD(algo.seq_mask_ratio),
        "Sequence-level mask: a sample whose geometric-mean importance weight exp(mean(proximal - behaviour)) "
        "is outside [1/r, r] is left out of the policy loss (r > 1; 0: off). Counted in off_policy/masked_samples.")
      .range(0.0, 1000.0);
  b.add("algo.entropy_coef", TILLER_FIELD(algo.entropy_coef), "Entropy bonus coefficient.").range(0.0, 10.0);
  b.add("algo.whiten_advantages", TILLER_FIELD(algo.whiten_advantages), "Normalise advantages over the batch.");
  b.add("algo.ppo_epochs", TILLER_FIELD(algo.ppo_epochs), "Passes over each rollout batch.").range(1, 100);

  b.add("data.source", TILLER_FIELD(data.source),
        "Where prompts come from: a registered prompt source. Built in: file (data.prompts); a trainer of your "
        "own registers more, e.g. a generator of tasks (docs/library.md).");
  b.add("data.source_args", TILLER_FIELD(data.source_args),
        "data.source other than file: the source's settings, a string in a format of its own.");
  b.add("data.prompts", TILLER_FIELD(data.prompts),
        "File of prompts: JSONL, or parquet (a name ending in .parquet or .pq; read with the embedded Python's "
        "pyarrow).");
  b.add("data.input_key", TILLER_FIELD(data.input_key),
        "Key of the prompt: text, or a list of chat messages ({role, content}; needs data.apply_chat_template). "
        "A dotted path reaches into nested objects.");
  b.add("data.label_key", TILLER_FIELD(data.label_key),
        "Key of the label given to rewards (verl: reward_model.ground_truth); a value that is not text is kept as "
        "its JSON.");
  b.add("data.data_source_key", TILLER_FIELD(data.data_source_key),
        "Key of the sample's data source, passed to Python rewards as data_source.");
  b.add("data.extra_info_key", TILLER_FIELD(data.extra_info_key),
        "Key of the record's extra information (any JSON), passed to Python rewards as extra_info.");
  b.add("data.input_template", TILLER_FIELD(data.input_template),
        "Template with one {} where the prompt goes (empty: the prompt as is).");
  b.add("data.apply_chat_template", TILLER_FIELD(data.apply_chat_template),
        "Wrap each prompt (and SFT conversation, preference pair, multi-turn observation) in the model's chat "
        "template (data.chat_template).");
  b.add("data.chat_template", TILLER_FIELD(data.chat_template),
        "Which chat template: auto (the model's own Jinja template, tokenizer_config.json's chat_template or "
        "chat_template.jinja, rendered as transformers' apply_chat_template; else ChatML or Llama-3 by the "
        "tokenizer's special tokens), model (its own; an error when it has none), chatml, llama3, none, or a path "
        "to a .jinja file.");
  b.add("data.chat_template_kwargs", TILLER_FIELD(data.chat_template_kwargs),
        "Extra variables for a Jinja chat template, as transformers' apply_chat_template(**kwargs) passes them: a "
        "mapping, e.g. {enable_thinking: false} for Qwen3's thinking switch (they override the special tokens' "
        "names; messages, tools, documents and add_generation_prompt are tiller's). Empty: none.")
      .as_json_map();
  b.add("data.tools_key", TILLER_FIELD(data.tools_key),
        "Key of a prompt's tool schemas (a JSON list, as transformers' apply_chat_template takes them), given to "
        "the chat template as `tools`; a prompt without it has none.");
  b.add("data.shuffle", TILLER_FIELD(data.shuffle), "Shuffle prompts each epoch with run.seed.");
  b.add_enum("data.long_prompt_policy", TILLER_FIELD(data.long_prompt_policy),
        "Prompts over rollout.max_prompt_tokens: skip them (counted in the log), keep their last tokens "
        "(truncate_left), or stop with an error naming the line.")
      ;
  b.add("data.max_samples", TILLER_FIELD(data.max_samples), "Use at most this many prompts (0: all).")
      .range(0, kMaxCount);

  b.add_enum("reward.type", TILLER_FIELD(reward.type),
             "model (the reward role scores), rule (a registered function), remote (a gRPC reward service), "
             "python (a Python function run in-process: reward.python), env (the environment's rewards only), scorer (a batch scorer a trainer of your own "
             "registers: reward.scorer). With "
             "an environment, the other types score the whole response and the environment's rewards add to it.");
  b.add("reward.rule", TILLER_FIELD(reward.rule), "Registered rule reward used when reward.type is rule.");
  b.add("reward.remote_address", TILLER_FIELD(reward.remote_address),
        "host:port of the remote reward service (proto/tiller/reward.proto) when reward.type is remote.");
  b.add("reward.remote_timeout_s", TILLER_FIELD(reward.remote_timeout_s), "Deadline of one Score call to the remote reward service.")
      .range(0.001, kMaxSeconds);
  b.add("reward.remote_retries", TILLER_FIELD(reward.remote_retries),
        "Retries of a Score call that failed with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED "
        "(backoff doubling from 0.5 s); other errors end the job at once.")
      .range(0, 100);
  b.add("reward.remote_batch_size", TILLER_FIELD(reward.remote_batch_size),
        "Samples per Score call; a call leaves as soon as this many samples have finished generating.")
      .range(1, 1000000);
  b.add("reward.remote_concurrency", TILLER_FIELD(reward.remote_concurrency), "Score calls in flight at once.")
      .range(1, 1024);
  b.add("reward.remote_token_file", TILLER_FIELD(reward.remote_token_file),
        "File whose first line is the token sent to the remote reward service as x-tiller-token (empty: none; "
        "examples/reward_server/server.py --token-file checks it).");
  b.add("reward.remote_tls_ca", TILLER_FIELD(reward.remote_tls_ca),
        "PEM roots to verify the remote reward service's certificate with; set, the call goes over TLS.");
  b.add("reward.remote_tls_server_name", TILLER_FIELD(reward.remote_tls_server_name),
        "The name the reward service's certificate must carry; empty: the host of reward.remote_address.");
  b.add("reward.python", TILLER_FIELD(reward.python),
        "FILE.py:FUNCTION run in the controller's embedded Python when reward.type is python; verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info) works as is (docs/training.md).");
  b.add("reward.python_batched", TILLER_FIELD(reward.python_batched),
        "The function takes lists (data_sources, solution_strs, ground_truths, extra_infos) and returns a list: "
        "one call per batch.");
  b.add("reward.python_batch_size", TILLER_FIELD(reward.python_batch_size),
        "Samples per batch handed to a Python worker; a batch leaves as soon as this many samples have finished.")
      .range(1, 4096);
  b.add("reward.python_workers", TILLER_FIELD(reward.python_workers),
        "Threads calling the Python function. Pure Python runs one at a time (the GIL); more threads help "
        "functions that wait on I/O or release the GIL.")
      .range(1, 64);
  b.add("reward.python_timeout_s", TILLER_FIELD(reward.python_timeout_s),
        "Deadline of one call (a sample; a batch when batched): a call past it is interrupted and the job ends.")
      .range(0.001, 86400.0);
  b.add("reward.scorer", TILLER_FIELD(reward.scorer),
        "reward.type scorer: a batch scorer that a trainer of your own registers by this name "
        "(tiller::reward::register_batch_scorer; docs/library.md).");
  b.add("reward.scorer_args", TILLER_FIELD(reward.scorer_args),
        "reward.type scorer: the scorer's settings, a string in a format of its own (a path, JSON, key=value).");
  b.add("reward.scorer_batch_size", TILLER_FIELD(reward.scorer_batch_size),
        "reward.type scorer: samples per batch (a scorer's factory may choose otherwise).").range(1, 4096);
  b.add("reward.scorer_concurrency", TILLER_FIELD(reward.scorer_concurrency),
        "reward.type scorer: batches scored at once, each on a worker thread.").range(1, 256);
  b.add("reward.clip", TILLER_FIELD(reward.clip), "Rewards are clipped to [-clip, clip] (0: off).")
      .range(0.0, 1e9);
  b.add("reward.normalize", TILLER_FIELD(reward.normalize), "Normalise rewards with running mean and std.");
  b.add("reward.overlong_buffer", TILLER_FIELD(reward.overlong_buffer),
        "DAPO's soft overlong penalty: a response longer than rollout.max_new_tokens - this many tokens loses "
        "reward.overlong_penalty x (its excess / this), the full penalty at max_new_tokens (0: off).")
      .range(0, 1 << 24);
  b.add("reward.overlong_penalty", TILLER_FIELD(reward.overlong_penalty),
        "The overlong penalty at rollout.max_new_tokens (see reward.overlong_buffer).")
      .range(0.0, 1000.0);

  b.add_enum("env.type", TILLER_FIELD(env.type),
        "Multi-turn rollouts: none (single-turn samples), remote (a gRPC environment service, "
        "proto/tiller/env.proto; examples/envs/), or inprocess (a C++ environment registered with "
        "tiller::env::register_env under env.name).")
      ;
  b.add("env.name", TILLER_FIELD(env.name), "env.type inprocess: the name the environment was registered under.");
  b.add("env.address", TILLER_FIELD(env.address), "env.type remote: host:port of the environment service.");
  b.add("env.observation_role", TILLER_FIELD(env.observation_role),
        "The chat template's role of an environment's answer: tool (Qwen2.5 writes it as a <tool_response> user "
        "turn, Llama-3 as ipython) or user (for templates without a tool role, such as Gemma's).")
      .one_of({"tool", "user"});
  b.add("env.timeout_s", TILLER_FIELD(env.timeout_s),
        "Deadline of one Start, Step or Close call, retries included; a call past it ends the job.")
      .range(0.001, kMaxSeconds);
  b.add("env.retries", TILLER_FIELD(env.retries),
        "Retries of a remote call that failed with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED "
        "(backoff doubling from 0.5 s; the service's calls must be idempotent); other errors end the job at once.")
      .range(0, 100);
  b.add("env.concurrency", TILLER_FIELD(env.concurrency), "Environment calls in flight at once (threads).")
      .range(1, 4096);
  b.add("env.token_file", TILLER_FIELD(env.token_file),
        "File whose first line is the token sent to the environment service as x-tiller-token (empty: none).");
  b.add("env.tls_ca", TILLER_FIELD(env.tls_ca),
        "PEM roots to verify the environment service's certificate with; set, the calls go over TLS.");
  b.add("env.tls_server_name", TILLER_FIELD(env.tls_server_name),
        "The name the environment service's certificate must carry; empty: the host of env.address.");

  b.add("agent.harness", TILLER_FIELD(agent.harness),
        "rollout.loop openai_agent: the agent harness run for each sample, FILE.py:FUNCTION (called with the "
        "sample's base_url and api_key for the openai client; docs/agents.md), command (agent.command), or the "
        "name of one registered in C++.");
  b.add("agent.command", TILLER_FIELD(agent.command),
        "agent.harness command: the shell command run for each sample, with OPENAI_BASE_URL, OPENAI_API_KEY and "
        "TILLER_AGENT_* (the prompt, label, ...) in its environment; the last line it prints is the reward "
        "(docs/agents.md).");
  b.add_enum("agent.drift", TILLER_FIELD(agent.drift),
        "What a harness request whose prompt does not extend the sample's tokens so far (retokenization drift) "
        "does: error (the job ends naming the sample and the first differing token), split (the sample goes on as "
        "a new segment from that prompt; what came before is not trained), or drop (none of the sample is trained).");
  b.add("agent.concurrency", TILLER_FIELD(agent.concurrency), "Harness calls at once (threads).").range(1, 4096);
  b.add("agent.timeout_s", TILLER_FIELD(agent.timeout_s),
        "Deadline of one harness call (a whole sample); past it the job ends naming the sample.")
      .range(0.001, kMaxSeconds);
  b.add("agent.host", TILLER_FIELD(agent.host),
        "Address the agent endpoint listens on (the harnesses run in the controller's process: 127.0.0.1).");
  b.add("agent.port", TILLER_FIELD(agent.port), "Port of the agent endpoint; 0: a free one.").range(0, 65535);
  b.add("agent.tool_call_parser", TILLER_FIELD(agent.tool_call_parser),
        "How chat replies' tool calls are read out of their text when a request gives tools: none, or hermes "
        "(Qwen2.5's <tool_call> blocks).")
      .one_of({"none", "hermes"});

  b.add("train.num_steps", TILLER_FIELD(train.num_steps), "PPO steps to run.").range(1, kMaxCount);
  b.add("train.train_batch_size", TILLER_FIELD(train.train_batch_size), "Samples per optimizer step.")
      .range(1, kMaxCount);
  b.add("train.micro_batch_tokens", TILLER_FIELD(train.micro_batch_tokens),
        "Token budget of one packed training micro-batch per rank.").range(1, kMaxBatchTokens);
  b.add_enum("train.recompute", TILLER_FIELD(train.recompute),
        "What the trained roles recompute in the backward pass instead of keeping: blocks (keep each block's input, "
        "recompute the block: least memory), attention_only (also keep the MLP's activations, recompute the attention "
        "half), none (keep everything), or auto: the most kept that the memory plan fits on the GPU (tiller plan prints "
        "the choice; blocks on CPU).")
      ;
  b.add("train.recompute_layers", TILLER_FIELD(train.recompute_layers),
        "How many blocks, from the first, keep what train.recompute keeps; the others recompute whole blocks. -1: "
        "every block. With train.recompute auto the memory plan sets it: attention_only for as many blocks as fit "
        "when not all of them do.")
      .range(-1, 1 << 20);
  b.add_enum("train.compute_shard", TILLER_FIELD(train.compute_shard),
        "Whether the trained roles keep a persistent bf16 copy of their fp32 master shards: keep (2 bytes per "
        "parameter / N more, no cast per gather), cast (each all-gather casts the master shard first, as FSDP2 does), "
        "or auto: keep when the memory plan fits it beside the activations train.recompute keeps (tiller plan prints "
        "the choice; cast when no GPU size is known). Moot with fp32 compute or optimizer_offload: cpu.")
      ;
  b.add("train.optimizer_threads", TILLER_FIELD(train.optimizer_threads),
        "Threads of each rank's CPU AdamW (roles.<role>.optimizer_offload: cpu). 0: the host's cores divided by the "
        "ranks on it.")
      .range(0, 4096);
  b.add("train.step_hooks", TILLER_FIELD(train.step_hooks),
        "Step hooks of a trainer of your own, by registered name, comma-separated, run in that order on the "
        "controller: after each step is scored (filter or reweight), at its end (metrics, stop), after each "
        "checkpoint (docs/library.md). Empty: none.");
  b.add_enum("train.reduce_dtype", TILLER_FIELD(train.reduce_dtype),
        "The dtype gradients are reduce-scattered in across a role's ranks: fp32, or bf16 (half the traffic; the "
        "ranks' sum is rounded to bf16 before it joins the fp32 accumulator, as FSDP2's reduce_dtype=bf16).")
      ;
  b.add_enum("train.old_logprobs", TILLER_FIELD(train.old_logprobs),
        "Where the policy loss's old log-probs come from: recompute (the actor scores every sample before training, "
        "a forward pass per token) or forward (strictly on-policy runs only: sync mode, one PPO epoch, one mini-batch, "
        "no KL in the reward, no importance correction; the training forward's own log-probs, detached, so the ratio "
        "is 1 and the actor's scoring pass is skipped).")
      ;
  b.add("train.actor_lr", TILLER_FIELD(train.actor_lr), "Actor learning rate.").range(0.0, 1.0);
  b.add("train.critic_lr", TILLER_FIELD(train.critic_lr), "Critic learning rate.").range(0.0, 1.0);
  b.add("train.weight_decay", TILLER_FIELD(train.weight_decay), "AdamW weight decay (not on norms and biases).")
      .range(0.0, 1.0);
  b.add("train.adam_beta1", TILLER_FIELD(train.adam_beta1), "AdamW beta1.").range(0.0, 1.0);
  b.add("train.adam_beta2", TILLER_FIELD(train.adam_beta2), "AdamW beta2.").range(0.0, 1.0);
  b.add("train.adam_eps", TILLER_FIELD(train.adam_eps), "AdamW epsilon.").range(0.0, 1.0);
  b.add("train.max_grad_norm", TILLER_FIELD(train.max_grad_norm), "Global gradient-norm clip (0: off).")
      .range(0.0, 1e9);
  b.add_enum("train.lr_schedule", TILLER_FIELD(train.lr_schedule), "constant, linear or cosine, after the warmup.")
      ;
  b.add("train.warmup_steps", TILLER_FIELD(train.warmup_steps), "Linear warmup in optimizer steps.")
      .range(0, kMaxCount);
  b.add("train.min_lr_ratio", TILLER_FIELD(train.min_lr_ratio), "Floor of linear/cosine decay, as a fraction of the LR.")
      .range(0.0, 1.0);

  b.add("train.critic_warmup_steps", TILLER_FIELD(train.critic_warmup_steps),
        "First steps that train only the critic: no actor update and no weight sync.")
      .range(0, kMaxCount);

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

#undef TILLER_FIELD

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
