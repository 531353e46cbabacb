// ShardedModel: one role's model (actor, critic, reference, reward) held ZeRO-3 style over the
// role's communicator.
//
// Storage. The model is cut into units (flat_layout.h: the embedding, each block, the final norm
// and head). Each rank holds 1/N of every unit: the compute-dtype shard that all-gathers feed
// (bf16 on GPU), and, when trainable, the fp32 master shard, the fp32 gradient accumulator and
// the two AdamW moments. In fp32 compute the master shard is the compute shard. A trainable model
// may hold no compute shard (options.keep_compute_shard false): each gather then casts the master
// shard into a transient buffer first, as FSDP2 does, and the model holds 16 bytes per parameter
// / N instead of 18. With the optimizer on the host (options.optimizer_on_host) the masters and
// moments live in host memory (host_adamw.h) and the device holds the compute shard and the
// gradient accumulator: 6 bytes per parameter / N.
//
// Forward. A unit is all-gathered into a transient full buffer right before it is used, the
// next unit's gather is issued on the communication stream before the current unit computes,
// and each buffer is released after use: the whole model is never gathered, the extra memory is
// about two units. Under autograd each unit runs inside a custom autograd function that keeps
// only its input (block-level activation checkpointing), or more of its activations as
// options.recompute says (then the graph's references to the gathered weights stay, but their
// memory is freed after the forward and refilled by the backward's gather). Its backward
// re-gathers the unit (the next unit to backpropagate is prefetched meanwhile), recomputes what
// was not kept, backpropagates, and reduce-scatters the gradient (in fp32, or in
// options.reduce_dtype) into this rank's fp32 accumulator; the reduce-scatter of unit i completes while unit i-1 backpropagates. Gradients accumulate over micro-batches until step().
// A tied LM head reuses the embedding unit: its gradient reaches the embedding shard twice.
//
// Collective contract: every rank of the group calls forward functions, backward (through
// autograd) and step() the same number of times in the same order, each with its own batch (an
// empty batch is allowed). Frozen roles with `replicate` hold the whole model on every rank and
// communicate nothing in forward.
//
// Lifetime: a graph built by a forward refers to the model; backpropagate or drop it before the
// model is destroyed.
//
// Threading: one thread at a time; autograd's backward may run on its device thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "tiller/model/lora.h"
#include "tiller/model/model_config.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"
#include "tiller/zero/host_adamw.h"
#include "tiller/zero/optimizer.h"
#include "tiller/zero/recompute.h"
#include "tiller/zero/sequence_parallel.h"

namespace tiller {
struct LoraConfig;
struct RoleConfig;
struct TrainConfig;
}  // namespace tiller

namespace tiller::dist {
class Communicator;
}

namespace tiller::zero {

struct ShardedModelOptions {
  model::Head head = model::Head::kLm;
  at::ScalarType compute_dtype = at::kBFloat16;
  at::Device device = at::kCPU;
  bool trainable = true;    // false: a frozen role; no master, gradients or optimizer state
  bool replicate = false;   // frozen only: every rank holds the whole model (small models)
  AdamWConfig adamw;
  double max_grad_norm = 1.0;  // <= 0: no clipping
  // The dtype gradients travel and are summed in by the reduce-scatter (train.reduce_dtype): fp32,
  // or bf16 (half the traffic; the ranks' sum is rounded to bf16, then added into the fp32
  // accumulator, so micro-batches still accumulate in fp32).
  at::ScalarType reduce_dtype = at::kFloat;
  int64_t logprob_chunk_rows = 1024;
  Recompute recompute = Recompute::kBlocks;
  // How many blocks, from the first, keep what `recompute` keeps; the others recompute whole
  // blocks (train.recompute_layers; < 0: every block). Lets a mode's activations fill the memory
  // there is, block by block.
  int64_t recompute_layers = -1;
  model::AttentionBackend attention = model::AttentionBackend::kAuto;
  // Benchmarks: record how long compute waits for gathers and reductions (CUDA events on the
  // compute stream; host time on CPU); read with take_wait_seconds().
  bool measure_waits = false;
  // Trainable models: keep a persistent compute-dtype copy of the master shard (train.compute_shard
  // keep), or cast the master into each gather's input (cast: 2 bytes per parameter / N less, one
  // small cast kernel per gather). Moot in fp32 compute (the master is the shard) and with the
  // optimizer on the host (the device needs the shard).
  bool keep_compute_shard = true;
  // AdamW on the host (roles.<r>.optimizer_offload: cpu): fp32 masters and moments in host
  // memory, updated by HostAdamW with `optimizer_threads` threads (0: default_optimizer_threads()).
  bool optimizer_on_host = false;
  int optimizer_threads = 0;
  // A mixture of experts' router losses in training (roles.<role>.router_aux_loss_coef and
  // router_z_loss_coef; router_loss()). ConfigError at construction for a model without experts.
  double router_aux_coef = 0;
  double router_z_coef = 0;
  std::string role = "actor";  // the role's name, for error messages
  // LoRA (model/lora.h): with lora.rank > 0 the base is frozen (its compute-dtype shards, no
  // master, gradients or optimizer state) and the adapters train: fp32, held whole on every rank
  // (megabytes), their gradients all-reduced over the model's ranks at step(), AdamW on them.
  // Language-model heads only; checkpoints and offload refuse a LoRA model for now.
  model::LoraSpec lora;
  double lora_dropout = 0;  // PEFT's lora_dropout in the training forwards
  uint64_t lora_seed = 0;   // PEFT's initialisation when load() finds no adapters, and the dropout's masks
  // FP8 training (roles.<role>.fp8): the blocks' linear layers in FP8 with current scaling
  // (model::BlockContext::fp8_training), forward and backward; masters, optimizer and reductions
  // as without. On CUDA it needs Hopper's FP8 tensor cores and bf16 compute (ConfigError at
  // construction otherwise); on the CPU it is emulated.
  std::optional<model::fp8::Scaling> fp8;
  // Tensor scaling's forward GEMMs on tensor cores without the fp32 promotion of the partial sums
  // (roles.<role>.fp8_fast_accumulation; model::BlockContext::fp8_fast_accumulation).
  bool fp8_fast_accumulation = true;
};

// What opts.fp8 runs, for the log: "FP8 GEMMs in the blocks' projections (block scales) on tensor
// cores" (or "emulated (no FP8 tensor cores here)"); empty without FP8.
std::string fp8_summary(const ShardedModelOptions& opts);

// The options of role `name` from the job config: roles.<name>.dtype and .replicate, and train.*
// for AdamW and clipping (the learning rate is given to step()). ConfigError names the key when
// replicate is asked of a trainable role or the dtype is unknown.
ShardedModelOptions role_options(const std::string& name, const RoleConfig& role, const TrainConfig& train,
                                 bool trainable, model::Head head, at::Device device);
// roles.<role>.lora's spec for the model `cfg` (rank 0: none): its targets checked against the
// model, ConfigError naming `key` (roles.<role>.lora.target_modules) otherwise.
model::LoraSpec lora_spec(const LoraConfig& lora, const model::ModelConfig& cfg, const std::string& key);
// roles.<role>.lora into `opts` for the model `cfg`: the spec (its targets checked against the
// model; ConfigError naming the key), the dropout, and `seed` for PEFT's initialisation.
void apply_lora(ShardedModelOptions& opts, const LoraConfig& lora, const model::ModelConfig& cfg, uint64_t seed);
// The adapters a LoRA role starts from (`opts` after apply_lora): roles.<role>.lora.init_from's PEFT
// adapter when given (ConfigError naming the key when its r, alpha, rsLoRA or targets differ from
// the spec), else PEFT's initialisation drawn from opts.lora_seed, as load() draws it; fp32 on the
// CPU. The trainer and the engines start from the same adapters this way.
model::NamedTensors initial_adapters(const ShardedModelOptions& opts, const LoraConfig& lora,
                                     const model::ModelConfig& cfg);

struct StepResult {
  double grad_norm = 0;     // global L2 norm before clipping
  double clip_factor = 1;   // what gradients were scaled by
  bool skipped = false;     // non-finite gradient norm: no update (agreed by every rank)
};

// Bytes this rank holds for the model between steps (not counting transient gathered units).
struct ShardMemory {
  int64_t parameters = 0;  // on the device: compute shard + fp32 master (when either is there)
  int64_t gradients = 0;
  int64_t optimizer = 0;   // on the device
  int64_t host = 0;        // host memory of an optimizer on the host (masters, moments, staging)
  int64_t total() const { return parameters + gradients + optimizer; }  // the device's
};

class ShardedModel {
 public:
  // Not collective. `comm` must outlive the model (unused when replicated).
  ShardedModel(const model::ModelConfig& cfg, dist::Communicator& comm, ShardedModelOptions opts);
  ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  // Fills this rank's shards from full named tensors (HF names; any device and dtype; only this
  // rank's pieces are read, so views of a memory-mapped checkpoint cost no copy). IoError names
  // `where` and the tensor when one is missing or misshapen. Not collective.
  void load(const model::NamedTensors& named, const std::string& where);
  // load() from an HF checkpoint directory, memory-mapped.
  void load_hf(const std::string& dir);

  // Per-token log-probs of `targets` ([T], targets[t] follows token t) under softmax(logits / T),
  // fp32 [T]; differentiable when autograd is on and the model trainable. `entropy`, if given,
  // receives each row's entropy, differentiable in the same way (the entropy bonus). Collective.
  at::Tensor token_logprobs(const model::PackedBatch& batch, const at::Tensor& targets, double temperature = 1.0,
                            at::Tensor* entropy = nullptr);
  // Value-head outputs, fp32 [T] (Head::kValue). Collective.
  at::Tensor values(const model::PackedBatch& batch);

  // Sequence parallelism (sequence_parallel.h): `group` is this rank's sequence group, S
  // consecutive ranks of the model's communicator that share each micro-batch from now on, of
  // which `context_parallel` groups (dividing S) split attention's keys rather than its heads.
  // ConfigError when the model's heads do not allow it. Collective over `group` when
  // context_parallel > 1 (it splits the group's communicators); `group` must outlive the model.
  void set_sequence_group(dist::Communicator& group, int context_parallel = 1);
  int context_parallel() const;   // R (1 without context parallelism)
  int sequence_parallel() const;  // S (1 without a group)
  // options().recompute from now on (no forward's graph pending). A sequence group's ranks must
  // use one mode. Not collective.
  void set_recompute(Recompute mode, int64_t layers = -1);
  // FP8 training on or off from the next forward (ShardedModelOptions::fp8, checked as at
  // construction): benchmarks time both on the same weights. `fast_accumulation`:
  // ShardedModelOptions::fp8_fast_accumulation.
  void set_fp8(std::optional<model::fp8::Scaling> scaling, bool fast_accumulation = true);
  // token_logprobs / values of this rank's rows of a packed row ([n] for the slice's n rows;
  // `targets` [n]: each row's next token). With S = 1 the slice is the whole row. Collective over
  // the model's communicator and the sequence group.
  at::Tensor token_logprobs(const SequenceSlice& slice, const at::Tensor& targets, double temperature = 1.0,
                            at::Tensor* entropy = nullptr);
  at::Tensor values(const SequenceSlice& slice);

  // Waits for every gradient, clips by the global norm (one all-reduce), runs AdamW with `lr`,
  // refreshes the compute shards and zeroes the gradients. Collective.
  StepResult step(double lr);
  void zero_grad();
  int64_t steps() const;
  // Exposed communication since the last call (measure_waits): seconds the compute stream stood
  // waiting for a gather or reduce-scatter. Synchronises the device.
  double take_wait_seconds();
  // A mixture of experts: the tokens its training forwards (token_logprobs / values with a graph)
  // routed to each expert since the last call, double [sparse layers, experts] on the host
  // (this rank's rows only); undefined for a dense model or when nothing trained.
  at::Tensor take_expert_load();
  // Router losses (a mixture of experts with options.router_aux_coef or router_z_coef > 0;
  // model::RouterLoss): the last training forward's, to add to the loss before its backward:
  // the mean over the sparse layers of aux_coef * aux + z_coef * z, times this rank's rows of that
  // forward / `step_rows` (the rows of every micro-batch of the optimizer step, over every rank),
  // so that an optimizer step's terms add up to the rows' weighted mean. Differentiable; the
  // gradient reaches the routers through each block's backward. Undefined when the losses are off
  // or no training forward ran since the last call. Not collective.
  at::Tensor router_loss(double step_rows);
  // loss + router_loss(step_rows), or `loss` when that is undefined: what a trainer backpropagates.
  at::Tensor add_router_loss(const at::Tensor& loss, double step_rows);
  // The weighted aux and z (as router_loss weighs them, without the coefficients) summed since
  // the last call: fp64 [2] on the host; zeros when none. Synchronises the device.
  at::Tensor take_router_stats();
  // LoRA: whether the model trains adapters on a frozen base; the adapters (fp32 copies on the
  // host, PEFT's names without its prefix), empty without LoRA; and the forwards' switch: with the
  // adapters off they run the base alone (a LoRA actor's reference). Not collective.
  bool lora() const;
  // LoRA: every adapter's fp32 values as one flat buffer on the device (lora_parameters()' specs in
  // model::lora_parameter_specs order, no gaps), the same on every rank: what the adapter-only
  // weight sync sends (sync/bucket_plan.h). Undefined without LoRA.
  at::Tensor lora_flat() const;
  model::NamedTensors lora_parameters() const;
  void set_adapters_enabled(bool on);
  // The host optimizer (optimizer_on_host), for its timings; nullptr otherwise.
  const HostAdamW* host_optimizer() const;

  // The full parameters (HF names, fp32 masters when trainable), gathered on every rank; for
  // tests, small models and export. Collective.
  model::NamedTensors gather_parameters();

  // This rank's shard of every unit, in model_layouts order: the compute-dtype shard (undefined
  // when the model casts while gathering), and the fp32 master when trainable (the same tensor in
  // fp32 compute; in host memory with the optimizer on the host). Views: read, do not write (the
  // weight sync reads them). numel is the shard's elements either way.
  struct UnitShard {
    std::string name;
    at::Tensor compute, master;
    int64_t numel = 0;
  };
  std::vector<UnitShard> shards() const;

  // Checkpoints: see checkpoint.h.
  struct UnitState {
    std::string name;
    at::Tensor master;          // fp32 (trainable) or the compute shard (frozen)
    at::Tensor exp_avg, exp_avg_sq;  // undefined when frozen
  };
  std::vector<UnitState> unit_states() const;  // a LoRA model's units: the frozen base's shards
  void load_unit_state(size_t unit, const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq);
  void set_steps(int64_t steps);
  // LoRA: the adapters (lora_parameters()) and their AdamW moments, flat fp32 on the host, the same
  // on every rank; and back.
  struct LoraState {
    model::NamedTensors adapters;
    at::Tensor exp_avg, exp_avg_sq;
  };
  LoraState lora_state() const;
  void load_lora_state(const model::NamedTensors& adapters, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq);

  const model::ModelConfig& config() const;
  dist::Communicator& communicator() const;
  // The HF directory load_hf() read, "" otherwise (recorded in checkpoints).
  const std::string& source_model() const;
  const ShardedModelOptions& options() const;
  int rank() const;   // in the layout (0 when replicated)
  int world() const;  // shards per unit (1 when replicated)
  ShardMemory memory() const;

  // Trainable models (roles.<r>.offload): moves the fp32 masters (when they are not the compute
  // shards) and the AdamW state to host memory (pinned on CUDA) and frees their device memory; the
  // compute shards stay (a model that casts while gathering makes them for the while), so forwards
  // (scoring) still run. With the optimizer on the host only the accumulators leave the device. The gradient accumulators, which hold
  // nothing between optimizer steps, are freed without a copy; a gradient still pending (a backward
  // without its step: its reductions are waited for first) moves with the rest. reload_state()
  // brings the moved state back bit for bit (and the freed accumulators' memory), with
  // asynchronous copies ordered before the next kernels of the calling thread's stream; training
  // and step() must not run while offloaded. Not collective. Returns the bytes moved. A LoRA model moves
  // nothing (0): its optimizer state is megabytes, and its frozen base scores while the engines generate.
  int64_t offload_state();
  int64_t reload_state();
  bool state_offloaded() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::zero
