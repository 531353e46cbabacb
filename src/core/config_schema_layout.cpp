// The config schema's keys of where a job's ranks go and what they hold: run, cluster, roles
// (each role's keys, LoRA included) and engines (config_schema_builder.h).
#include "config_schema_builder.h"

namespace tiller::config_schema::detail {
namespace {

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
             "weights in 128x128 blocks: DeepSeek-V3's recipe), channel (one scale per row of every operand) or "
             "tensor (one scale per operand of each GEMM: the fastest GEMMs, the coarsest scales; docs/training.md "
             "says what each costs).");
  b.add(p + "fp8_fast_accumulation", [get](JobConfig& c) { return &get(c).fp8_fast_accumulation; },
        "roles.<role>.fp8 with fp8_scaling tensor on GPUs: the forward GEMMs accumulate on the tensor cores without "
        "promoting their partial sums to fp32 every few steps of the contraction, as Transformer Engine's forward "
        "does (a 7B training step 1.30x bf16's against 1.28x without; docs/training.md gives the loss curves). The "
        "gradients' GEMMs always promote. false: every GEMM promotes.");
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
}  // namespace

void add_layout_fields(Builder& b) {
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
  b.add_enum("cluster.expandable_segments", TILLER_FIELD(cluster.expandable_segments),
        "GPU ranks: PyTorch's caching allocator with expandable segments (on; PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True) or as PyTorch sets it (off). The default allocator cuts its cached blocks "
        "for smaller tensors; with long samples in sequence groups (roles.<r>.sequence_parallel) the holes it "
        "left ran to 18x the largest activation: out of memory, or ranks stuck in a collective while one "
        "frees. Expandable segments leave none but trained 7% slower at 32k-token samples (19% at 7B, 8k "
        "tokens). auto: on where a rank in a sequence group would not fit its peak plus those holes, off "
        "otherwise (tiller plan says which and why). A PYTORCH_CUDA_ALLOC_CONF that names "
        "expandable_segments wins.");
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
             "scale per weight and one per token, the token's applied after cuBLASLt's tensor-wise GEMM; the norms "
             "and SwiGLU quantize in the same kernel). tensor is the fastest engine on Hopper (7B decode 1.33x bf16 "
             "at batch 256 on an H200); block's finer scales keep the engine nearest the trainer (docs/engine.md, "
             "docs/benchmarks.md).");
  b.add_enum("engines.kv_cache_dtype", TILLER_FIELD(engines.kv_cache_dtype),
             "The engines' KV cache: auto (the compute dtype) or fp8 (e4m3 with one fp32 scale per cached token "
             "and KV head, amax / 448: about half the bytes, so nearly twice the tokens fit; attention reads the "
             "keys and values dequantized to the compute dtype). Independent of engines.quantization; pair it with "
             "algo.importance_correction (docs/engine.md, FP8 KV cache).");
  b.add("engines.sync_bucket_mb", TILLER_FIELD(engines.sync_bucket_mb),
        "Largest bucket of the weight broadcast from the actor to the engines, in MiB.")
      .range(1, 65536);
  b.add("engines.addresses", TILLER_FIELD(engines.addresses),
        "Standalone engines (tiller engine, started on their own: not ranks of this job), as host:port, "
        "comma-separated. With them (or engines.rendezvous_dir) engines.count must be 0; the actor ranks push each "
        "weight sync to them over gRPC as deltas (docs/cluster.md, docs/sync.md).");
  b.add("engines.rendezvous_dir", TILLER_FIELD(engines.rendezvous_dir),
        "A folder every standalone engine of the job can write and the controller read: an engine started with "
        "tiller engine --join DIR announces itself there, and the controller takes it into the job at the next "
        "weight sync (full weights first, then deltas).");
  b.add("engines.min_count", TILLER_FIELD(engines.min_count),
        "Standalone engines: how many the job waits for at its start (within timeouts.startup_s), and the fewest it "
        "goes on with: when engines leave (die, stall) and fewer remain, the job ends.")
      .range(1, 4096);
  b.add("engines.token_file", TILLER_FIELD(engines.token_file),
        "Standalone engines: a file whose first line is their shared secret (tiller engine --token-file); every "
        "actor rank and the controller read it. Empty: $TILLER_ENGINE_TOKEN.");
  b.add("engines.delta_sync", TILLER_FIELD(engines.delta_sync),
        "Standalone engines: push what changed since the engine's copy (XOR or sparse, zstd, checked by hashes); "
        "false: every push in full.");
  b.add("engines.push_chunk_mb", TILLER_FIELD(engines.push_chunk_mb),
        "Standalone engines: the size of a pushed chunk, MiB (each is encoded and checked on its own).")
      .range(1, 32);
  b.add("engines.push_threads", TILLER_FIELD(engines.push_threads),
        "Standalone engines: each actor rank's encoding threads (0: the hardware's, at most 16).")
      .range(0, 256);
}

}  // namespace tiller::config_schema::detail
