#include "tiller/job/memory_plan.h"

#include <algorithm>
#include <array>
#include <functional>
#include <utility>

#include <fmt/format.h>

#include "job/activation_memory.h"
#include "tiller/core/checked_math.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/model/lora.h"
#include "tiller/model/weights.h"
#include "tiller/zero/sequence_parallel.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::job {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

int64_t dtype_bytes(Precision dtype) { return dtype == Precision::kFp32 ? 4 : 2; }

struct Shape {
  int64_t params = 0, largest_unit = 0, largest_block = 0, embed = 0, head = 0;
  int64_t layer_experts = 0;  // a sparse layer's routed experts (elements): what the grouped GEMMs stack
  const model::ModelConfig* cfg = nullptr;
};

Shape shape_of(const model::ModelConfig& cfg, model::Head head) {
  Shape s;
  s.cfg = &cfg;
  std::vector<int64_t> layers(static_cast<size_t>(cfg.num_layers), 0);
  for (const auto& p : model::parameter_specs(cfg, head)) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    s.params += n;
    if (p.layer >= 0) layers[static_cast<size_t>(p.layer)] += n;
    else if (p.name == "model.embed_tokens.weight") s.embed += n;
    else s.head += n;
  }
  for (int64_t l : layers) s.largest_block = std::max(s.largest_block, l);
  s.largest_unit = std::max({s.embed, s.head, s.largest_block});
  if (cfg.moe()) s.layer_experts = cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size;
  return s;
}

// One role as one rank of its group holds it (zero::ShardedModel).
struct RoleSpec {
  Shape shape;
  int64_t ranks = 1;        // N: 1 when replicated
  int64_t dtype_bytes = 2;  // compute dtype
  bool trainable = false;
  bool host_optimizer = false;  // roles.<r>.optimizer_offload: cpu
  bool offload = false;         // roles.<r>.offload (hybrid: state off the GPU while generating)
  int64_t reduce_bytes = 4;     // train.reduce_dtype
  // roles.<r>.lora: the base frozen (trainable false), the adapters (and a value head's score)
  // trained in fp32, whole on every rank: values, gradients and two moments.
  bool lora = false;
  int64_t lora_elements = 0;
  model::LoraSpec lora_spec;
};

// The elements a LoRA role trains (`ls`, zero::lora_spec; 0 without LoRA): its adapters, and a
// value head's score beside them.
int64_t lora_elements(const model::LoraSpec& ls, const model::ModelConfig& mc, model::Head head) {
  if (!ls.enabled()) return 0;
  int64_t n = head == model::Head::kValue ? mc.hidden_size : 0;
  for (const model::ParamSpec& p : model::lora_parameter_specs(mc, ls)) {
    int64_t e = 1;
    for (int64_t d : p.shape) e *= d;
    n += e;
  }
  return n;
}

// Host AdamW's pinned staging (zero/host_adamw.cpp: 3 slots of 4M elements, in and out).
constexpr int64_t kHostStagingBytes = int64_t{3} * (int64_t{1} << 22) * (4 + 2);

struct RoleFootprint {
  int64_t weights_train = 0;     // the compute shard while training (0: cast per gather)
  int64_t weights_generate = 0;  // ... while the engines generate
  int64_t state = 0;             // on the device: master, gradient accumulator, moments
  int64_t state_generate = 0;
  int64_t host = 0;              // on the host: a host optimizer's masters, moments and staging,
                                 // and what roles.<r>.offload moves there while generating
  int64_t gathers = 0;           // two gathered units (and their cast inputs)
  int64_t grad_buffers = 0;      // training: the gradient buffers at the backward's peak
};

RoleFootprint footprint(const RoleSpec& r, bool keep_compute_shard) {
  RoleFootprint f;
  const int64_t c = r.dtype_bytes, n = r.ranks, p = r.shape.params;
  const bool cast = r.trainable && c != 4 && !keep_compute_shard && !r.host_optimizer;
  const int64_t shard = p * c / n;
  f.weights_train = cast ? 0 : shard;
  // Offloaded for generation, a casting role makes its compute shards for the scoring meanwhile.
  f.weights_generate = cast && !r.offload ? 0 : shard;
  if (r.trainable) {
    if (r.host_optimizer) {
      f.state = p * 4 / n;  // the gradient accumulators
      f.host = p * 12 / n + kHostStagingBytes;
    } else {
      f.state = p * (c == 4 ? 12 : 16) / n;
    }
    f.state_generate = r.offload ? 0 : f.state;
    // Offloaded, the masters and moments wait in pinned host memory (the gradient accumulators are
    // freed, not moved; a host optimizer's state is on the host already).
    if (r.offload && !r.host_optimizer) f.host += f.state - p * 4 / n;
  }
  // The unit computing and the one prefetched: at most the largest unit beside a block (the
  // embedding's and the head's neighbours are blocks), and the cast shards they were gathered from.
  const int64_t pair = r.shape.largest_unit + r.shape.largest_block;
  if (r.ranks > 1 || cast) f.gathers = pair * c + (cast ? pair * c / n : 0);
  // A mixture of experts' grouped GEMMs (model::grouped_experts, the GPU's default) run on the
  // gathered experts stacked into one tensor per projection: a copy of a sparse layer's experts
  // while it computes, and in training its stacked gradient beside it.
  f.gathers += (r.trainable ? 2 : 1) * r.shape.layer_experts * c;
  if (r.trainable) {
    const int64_t rb = r.reduce_bytes, block = r.shape.largest_block, big = std::max(r.shape.embed, r.shape.head);
    // A block: autograd's gradients in the compute dtype, its flat buffer and the one before it in
    // flight. With an fp32 reduction the LM head's and the embedding's gradients accumulate in their
    // flat buffer (beside a block's in flight); with bf16 the head's gradient is fp32 first.
    const int64_t blocks = block * (c + 2 * rb);
    const int64_t head = rb == 4 ? big * rb + block * (c + rb) : big * (4 + 2 * rb);
    f.grad_buffers = std::max(blocks, head);
  }
  return f;
}



const model::ModelConfig* find_shape(const ModelShapes& shapes, const std::string& key) {
  auto it = shapes.find(key);
  return it == shapes.end() ? nullptr : &it->second;
}

void add(PhaseMemory& p, std::string name, int64_t bytes) {
  if (bytes > 0) p.items.emplace_back(std::move(name), bytes);
}

std::string gib(int64_t b) { return fmt::format("{:.2f}", static_cast<double>(b) / kGiB); }

}  // namespace

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kGenerate: return "generate";
    case Phase::kScore: return "score";
    case Phase::kTrain: return "train";
    case Phase::kSync: return "sync";
  }
  return "?";
}

int64_t PhaseMemory::total() const {
  int64_t n = 0;
  for (const auto& [name, b] : items) n += b;
  return n;
}

const PhaseMemory* RankMemory::peak_phase() const {
  const PhaseMemory* best = nullptr;
  for (const auto& p : phases)
    if (!best || p.total() > best->total()) best = &p;
  return best;
}

int64_t RankMemory::peak() const {
  const PhaseMemory* p = peak_phase();
  return p ? p->total() : 0;
}

int64_t largest_activation_bytes(const model::ModelConfig& c, int64_t tokens, int64_t dtype_bytes) {
  const int64_t routed = c.moe() ? c.moe_intermediate_size * std::max<int64_t>(c.experts_per_token, 1) : 0;
  const int64_t widest =
      std::max({c.intermediate_size, c.shared_expert_intermediate_size, routed, c.q_size() + 2 * c.kv_size()});
  return checked_mul(checked_mul(tokens, widest, "micro-batch tokens x widest activation"), dtype_bytes,
                     "largest activation bytes");
}

namespace {

constexpr const char* kTrainActivations = "activations (train.micro_batch_tokens)";

RoleSpec role_spec(const JobConfig& cfg, Role r, const model::ModelConfig& mc, const dist::RoleGroup* g) {
  const RoleConfig& rc = role_config(cfg, r);
  RoleSpec s;
  s.shape = shape_of(mc, r == Role::kActor || r == Role::kRef ? model::Head::kLm : model::Head::kValue);
  s.ranks = rc.replicate || !g ? 1 : static_cast<int64_t>(g->ranks.size());
  s.dtype_bytes = dtype_bytes(rc.dtype);
  s.trainable = role_trains(r);
  if (s.trainable && rc.lora.rank > 0) {
    s.lora = true;
    s.trainable = false;  // the base
    s.lora_spec = zero::lora_spec(rc.lora, mc, fmt::format("roles.{}.lora.target_modules", role_name(r)));
    s.lora_elements = lora_elements(s.lora_spec, mc, r == Role::kActor ? model::Head::kLm : model::Head::kValue);
  }
  s.host_optimizer = s.trainable && rc.optimizer_offload == OptimizerOffload::kCpu;
  s.offload = s.trainable && rc.offload;
  s.reduce_bytes = cfg.train.reduce_dtype == Precision::kBf16 ? 2 : 4;
  return s;
}

// An FP8 engine's copies of its linear layers (engines.quantization: fp8; engine/model_runner.h):
// one byte per element of q/k/v, o and the dense MLP (a sparse layer's shared expert; the routed
// experts stay in the weights' dtype), and their fp32 scales (one per 128x128 block, one per row
// with channel scaling, one a matrix with tensor scaling), on each of t TP ranks.
int64_t fp8_copy_bytes(const model::ModelConfig& mc, int64_t t, Fp8Scaling scaling) {
  int64_t elements = 0, rows = 0;
  for (int64_t i = 0; i < mc.num_layers; ++i) {
    const int64_t mlp = mc.sparse_layer(i) ? mc.shared_expert_intermediate_size : mc.intermediate_size;
    elements += (2 * mc.q_size() + 2 * mc.kv_size()) * mc.hidden_size + 3 * mlp * mc.hidden_size;
    rows += mc.q_size() + 2 * mc.kv_size() + mc.hidden_size + (mlp > 0 ? 2 * mlp + mc.hidden_size : 0);
  }
  const int64_t scales = scaling == Fp8Scaling::kChannel  ? rows
                         : scaling == Fp8Scaling::kTensor ? 7 * mc.num_layers  // one a matrix
                                                          : elements / (128 * 128);
  return (elements + 4 * scales) / t;
}

// FP8 training's transient GEMM operands (roles.<r>.fp8; model/fp8.h train_linear): the e4m3
// codes of both operands of the largest of a projection's three GEMMs for `tokens` rows -
// forward (M + N) K, input gradient (M + K) N, weight gradient M (N + K) for M tokens, N outputs
// and K inputs - with their scales and the padding to whole tiles (1/16 more).
int64_t fp8_operand_bytes(const model::ModelConfig& mc, int64_t tokens) {
  const int64_t mlp = std::max(mc.intermediate_size, mc.shared_expert_intermediate_size);
  const std::pair<int64_t, int64_t> projections[] = {{mc.q_size() + 2 * mc.kv_size(), mc.hidden_size},
                                                     {mc.hidden_size, mc.q_size()},
                                                     {mlp, mc.hidden_size},
                                                     {mc.hidden_size, mlp}};
  int64_t most = 0;
  for (const auto& [n, k] : projections)
    most = std::max({most, (tokens + n) * k, (tokens + k) * n, tokens * (n + k)});
  return most + most / 16;
}

MemoryPlan plan_with(const JobConfig& cfg, const dist::RankPlan& plan, const ModelShapes& shapes, int64_t gpu_bytes,
                     zero::Recompute recompute, int64_t layers, bool keep_compute_shard) {
  MemoryPlan out;
  out.recompute = recompute;
  out.recompute_layers = layers;
  out.keep_compute_shard = keep_compute_shard;
  out.gpu_bytes = gpu_bytes;
  out.shared_gpus = cfg.cluster.ranks_per_gpu > 1;
  out.host_memory_bytes = static_cast<int64_t>(cfg.cluster.host_memory_gb * kGiB);
  const bool hybrid = plan.hybrid;
  const bool score_after = cfg.hybrid_scores_after_generate(planned_backend(cfg.cluster));
  const int64_t kv_fixed = static_cast<int64_t>(cfg.engines.kv_cache_gb * kGiB);
  for (const auto& a : plan.ranks) {
    if (a.rank == plan.controller) continue;
    RankMemory rm;
    rm.rank = a.rank;
    rm.node = a.node;
    rm.label = a.label();
    PhaseMemory gen{Phase::kGenerate, {}}, train{Phase::kTrain, {}}, sync{Phase::kSync, {}};
    int64_t act_train = 0, act_score = 0, gathers = 0, grad_buffers = 0, fp8_train = 0, fp8_score = 0;
    int64_t cp_train = 0, cp_score = 0;  // context parallelism's gathered keys and values
    for (Role r : kRoles) {
      if (!a.trainer_roles.has(r)) continue;
      const std::string name(role_name(r));
      const model::ModelConfig* mc = find_shape(shapes, name);
      if (!mc) throw ConfigError(fmt::format("memory plan: no model shape for roles.{}", name));
      const dist::RoleGroup* g = plan.group(r);
      if (r == Role::kRef && cfg.ref_is_actor_base()) {  // LoRA: no second model
        const int64_t saved = footprint(role_spec(cfg, r, *mc, g), keep_compute_shard).weights_train;
        const std::string note = fmt::format("ref: the actor's base with its LoRA adapters off, no reference model "
                                             "loaded ({} GiB per rank not held)",
                                             gib(saved));
        if (std::find(out.notes.begin(), out.notes.end(), note) == out.notes.end()) out.notes.push_back(note);
        continue;
      }
      // Sequence parallelism: the role's heads must split S ways (the ranks check again at load).
      if (g && g->sequence_parallel > 1) {
        rm.sequence_group = true;
        zero::check_sequence_parallel(*mc, g->sequence_parallel, "roles." + name + ".sequence_parallel",
                                      static_cast<int>(role_config(cfg, r).context_parallel));
      }
      const RoleSpec spec = role_spec(cfg, r, *mc, g);
      const RoleFootprint f = footprint(spec, keep_compute_shard);
      add(gen, name + " weights", f.weights_generate);
      add(train, name + " weights", f.weights_train);
      add(sync, name + " weights", f.weights_train);
      add(train, name + " state", f.state);
      add(sync, name + " state", f.state);
      add(gen, name + " state", f.state_generate);
      rm.host_bytes += f.host;
      gathers = std::max(gathers, f.gathers);
      if (spec.lora) {  // the adapters stay on the device in every phase
        const int64_t adapters = spec.lora_elements * 16;
        add(gen, name + " LoRA adapters", adapters);
        add(train, name + " LoRA adapters", adapters);
        add(sync, name + " LoRA adapters", adapters);
      }
      if (spec.trainable || spec.lora) {
        act_train = std::max(act_train,
                             train_activation_bytes(*mc, cfg.train.micro_batch_tokens, spec.dtype_bytes, recompute, layers,
                                                    spec.lora ? &spec.lora_spec : nullptr));
        grad_buffers = std::max(grad_buffers, f.grad_buffers);
      }
      act_score = std::max(act_score, score_activation_bytes(*mc, cfg.rollout.micro_batch_tokens, spec.dtype_bytes));
      if (spec.trainable || spec.lora)
        rm.largest_activation = std::max(
            rm.largest_activation, largest_activation_bytes(*mc, cfg.train.micro_batch_tokens, spec.dtype_bytes));
      rm.largest_activation = std::max(
          rm.largest_activation, largest_activation_bytes(*mc, cfg.rollout.micro_batch_tokens, spec.dtype_bytes));
      // Context parallelism: inside one block's attention a rank holds the whole row's keys and
      // values for its heads (R x its own), and in the backward their gradient as well.
      if (const int64_t cp = role_config(cfg, r).context_parallel; g && cp > 1 && g->sequence_parallel > 1) {
        const int64_t s = g->sequence_parallel, u = s / cp;
        auto gathered = [&](int64_t tokens) { return s * tokens * 2 * mc->kv_size() / u * spec.dtype_bytes; };
        if (spec.trainable || spec.lora) cp_train = std::max(cp_train, 2 * gathered(cfg.train.micro_batch_tokens));
        cp_score = std::max(cp_score, gathered(cfg.rollout.micro_batch_tokens));
      }
      if (role_config(cfg, r).fp8) {
        if (spec.trainable || spec.lora) fp8_train = std::max(fp8_train, fp8_operand_bytes(*mc, cfg.train.micro_batch_tokens));
        fp8_score = std::max(fp8_score, fp8_operand_bytes(*mc, cfg.rollout.micro_batch_tokens));
      }
    }
    add(train, "gathered units", gathers);
    add(gen, "gathered units", gathers);
    add(train, kTrainActivations, act_train);
    add(train, "gradient buffers", grad_buffers);
    // After the generation the trainers score beside the sleeping engine: what they hold while it
    // generates, their scoring's activations, and its weights (a level-1 sleep keeps them).
    const bool score_phase = score_after && a.engine >= 0;
    PhaseMemory score{Phase::kScore, score_phase ? gen.items : std::vector<std::pair<std::string, int64_t>>{}};
    add(score_phase ? score : gen, "activations (scoring)", act_score);
    if (fp8_train > 0) add(train, "FP8 GEMM operands", fp8_train);
    if (cp_train > 0) add(train, "context-parallel keys and values", cp_train);
    if (cp_score > 0) add(score_phase ? score : gen, "context-parallel keys and values (scoring)", cp_score);
    if (fp8_score > 0) add(score_phase ? score : gen, "FP8 GEMM operands (scoring)", fp8_score);
    if (a.engine >= 0) {
      const model::ModelConfig* mc = find_shape(shapes, "engine");
      if (!mc) mc = find_shape(shapes, "actor");
      if (!mc) throw ConfigError("memory plan: no model shape for the engines");
      const int64_t t = plan.engine_tp(), c = dtype_bytes(cfg.roles.actor.dtype);
      const int64_t weights = shape_of(*mc, model::Head::kLm).params * c / t;
      // An FP8 KV cache: a byte per element and a 4-byte scale per (token, KV head).
      const int64_t per_token = cfg.engines.kv_cache_dtype == KvCacheDtype::kFp8
                                    ? 2 * mc->num_layers * mc->num_kv_heads * (mc->head_dim + 4) / t
                                    : 2 * mc->num_layers * mc->kv_size() * c / t;
      // A LoRA actor's adapters, fp32 beside the base (about 1/t of them on each rank).
      const int64_t adapters =
          lora_elements(zero::lora_spec(cfg.roles.actor.lora, *mc, "roles.actor.lora.target_modules"), *mc,
                        model::Head::kLm) * 4 / t;
      const int64_t fp8 =
          cfg.engines.quantization == EngineQuantization::kFp8 ? fp8_copy_bytes(*mc, t, cfg.engines.fp8_scaling) : 0;
      add(gen, "engine weights", weights);
      add(gen, "engine FP8 weights", fp8);
      add(gen, "engine LoRA adapters", adapters);
      add(score, "engine weights", weights);
      add(score, "engine FP8 weights", fp8);
      add(score, "engine LoRA adapters", adapters);
      if (!hybrid || cfg.engines.sleep_level < 2) {
        add(train, "engine weights", weights);
        add(train, "engine FP8 weights", fp8);
        add(train, "engine LoRA adapters", adapters);
      }
      add(sync, "engine weights", weights);
      add(sync, "engine FP8 weights", fp8);
      // The re-quantization after the sync needs no temporaries on a GPU (one kernel pass per
      // weight, model/fp8.h quantize_weight_into); the CPU's chunks are not planned for.
      add(sync, "engine LoRA adapters", adapters);
      if (hybrid) {
        // Two staging buffers of the plan's largest bucket; a LoRA actor's handoff keeps two for
        // its fp32 adapters, and at sleep level 2 two more for its base (sent after each sleep).
        const int64_t limit = cfg.engines.sync_bucket_mb << 20;
        const int64_t base = 2 * std::min<int64_t>(limit, weights * t);
        const int64_t bucket = adapters == 0 ? base
                                             : 2 * std::min<int64_t>(limit, adapters * t) +
                                                   (cfg.engines.sleep_level >= 2 ? base : 0);
        add(sync, "sync buckets", bucket);
      }
      int64_t kv = kv_fixed;
      if (kv == 0 && gpu_bytes > 0) {
        const double usable = cfg.engines.gpu_memory_fraction * static_cast<double>(gpu_bytes - kReserveBytes);
        kv = static_cast<int64_t>(usable) - gen.total();
        const int64_t len = cfg.rollout.max_prompt_tokens + cfg.response_limit();
        const int64_t blocks = (len + cfg.engines.kv_block_size - 1) / cfg.engines.kv_block_size;
        const int64_t need = blocks * cfg.engines.kv_block_size * per_token;
        if (kv < need)
          throw ConfigError(fmt::format(
              "memory plan: rank {} ({}) has no room for a KV cache: on a {} GiB GPU, engines.gpu_memory_fraction = {} "
              "leaves {} GiB after the {} GiB it holds while generating, and one sequence of {} tokens needs {} GiB; "
              "{}lower rollout.micro_batch_tokens, or give the actor more GPUs",
              a.rank, rm.label, gib(gpu_bytes), cfg.engines.gpu_memory_fraction, gib(std::max<int64_t>(kv, 0)),
              gib(gen.total()), len, gib(need),
              !hybrid                  ? ""
              : cfg.roles.actor.offload ? "raise engines.gpu_memory_fraction, "
                                        : "set roles.actor.offload=true (and the critic's), raise engines.gpu_memory_fraction, "));
        // More than every sequence the engine may hold at full length is never used (and a hybrid
        // engine allocates it at every wake).
        // (Compared by division: max_num_seqs x need can pass int64 at the keys' bounds.)
        if (cfg.engines.max_num_seqs <= kv / need) kv = cfg.engines.max_num_seqs * need;
      }
      rm.kv_cache_bytes = kv;
      add(gen, "engine kv cache", kv);
      if (!hybrid || cfg.engines.sleep_level == 0) {
        add(train, "engine kv cache", kv);
        add(sync, "engine kv cache", kv);
        add(score, "engine kv cache", kv);
      }
    }
    rm.phases.push_back(std::move(gen));
    if (score_phase) rm.phases.push_back(std::move(score));
    rm.phases.push_back(std::move(train));
    if (hybrid && a.engine >= 0) rm.phases.push_back(std::move(sync));
    out.ranks.push_back(std::move(rm));
  }
  return out;
}

// Every phase fits (activations_fit: the train phase's activations with the margin).
bool fits_with_margin(const MemoryPlan& m) {
  for (const auto& r : m.ranks)
    for (const auto& p : r.phases) {
      int64_t act = 0;
      if (p.phase == Phase::kTrain)
        for (const auto& [name, b] : p.items)
          if (name == kTrainActivations) act = b;
      if (!activations_fit(p.total() - act, act, m.gpu_bytes)) return false;
    }
  return true;
}



// train.recompute (with train.recompute_layers) and train.compute_shard: what they set, or for
// `auto` the first choice in this order whose plan fits every rank with the activations' margin:
// none in every block, attention_only in every block, attention_only in the first L - 1, L - 2,
// ..., 1 blocks (the others recompute whole blocks), blocks; for each, the compute shard kept, then
// cast. The least memory when no GPU size is known or ranks share GPUs (no fit to check), and also
// when nothing fits (the fit check then refuses the plan). `layers`: the trained models' most blocks.
MemoryPlan choose(const TrainConfig& t, int64_t layers, int64_t gpu_bytes, bool shared_gpus,
                  const std::function<MemoryPlan(zero::Recompute, int64_t, bool)>& make) {
  const bool auto_mode = t.recompute == RecomputeChoice::kAuto, auto_shard = t.compute_shard == ComputeShard::kAuto;
  struct Mode {
    zero::Recompute mode;
    int64_t layers;
  };
  std::vector<Mode> modes;
  if (auto_mode) {
    modes.push_back({zero::Recompute::kNone, -1});
    modes.push_back({zero::Recompute::kAttentionOnly, -1});
    for (int64_t k = layers - 1; k >= 1; --k) modes.push_back({zero::Recompute::kAttentionOnly, k});
    modes.push_back({zero::Recompute::kBlocks, -1});
  } else {
    modes.push_back({zero::recompute_of(t.recompute), t.recompute_layers});
  }
  std::vector<bool> keeps{true, false};
  if (!auto_shard) keeps = {t.compute_shard == ComputeShard::kKeep};
  auto reasons = [&](MemoryPlan m, const char* mode_why, const char* shard_why) {
    m.recompute_reason = auto_mode ? mode_why : "set by train.recompute";
    m.compute_shard_reason = auto_shard ? shard_why : "set by train.compute_shard";
    return m;
  };
  if (gpu_bytes <= 0 || shared_gpus) {
    const char* why = gpu_bytes <= 0 ? "auto: no GPU size to plan with; tiller train plans with its GPU's"
                                     : "auto: ranks share GPUs";
    return reasons(make(modes.back().mode, modes.back().layers, keeps.back()), why, why);
  }
  // Every choice holds at least what the last (least memory) does: when that does not fit, none does
  // (and the search for a layout that fits, smallest_fitting_layout, tries many that do not).
  MemoryPlan least = make(modes.back().mode, modes.back().layers, keeps.back());
  if (!fits_with_margin(least))
    return reasons(std::move(least), "auto: keeping more activations does not fit", "auto: keeping it does not fit");
  for (const Mode& m : modes)
    for (bool keep : keeps) {
      MemoryPlan p = make(m.mode, m.layers, keep);
      if (fits_with_margin(p))
        return reasons(std::move(p), "auto: the most kept activations that fit",
                       keep ? "auto: it fits beside the activations" : "auto: keeping it does not fit; cast per gather");
    }
  return reasons(std::move(least), "auto: keeping more activations does not fit", "auto: keeping it does not fit");
}

// cluster.expandable_segments: what it sets, or for `auto` whether the default allocator's holes
// (default_allocator_slack) fit beside every rank's peak; with `off` a note when they do not.
void choose_allocator(MemoryPlan& m, ExpandableSegments choice) {
  const RankMemory* over = nullptr;
  int64_t largest = 0;
  bool any_group = false;
  for (const RankMemory& r : m.ranks) {
    largest = std::max(largest, r.largest_activation);
    const int64_t need = r.peak() + kReserveBytes + default_allocator_slack(r.peak(), r.largest_activation);
    if (!over && r.sequence_group && m.gpu_bytes > 0 && !m.shared_gpus && !m.on_cpu && need > m.gpu_bytes) over = &r;
    any_group = any_group || r.sequence_group;
  }
  auto holes = [&](const RankMemory& r) {
    return fmt::format("rank {} ({}): peak {} GiB, its largest activation {} GiB, up to {} GiB of the default "
                       "allocator's holes beside it, {} GiB held back: over {} GiB",
                       r.rank, r.label, gib(r.peak()), gib(r.largest_activation),
                       gib(default_allocator_slack(r.peak(), r.largest_activation)), gib(kReserveBytes),
                       gib(m.gpu_bytes));
  };
  switch (choice) {
    case ExpandableSegments::kOn:
      m.expandable_segments = true;
      m.allocator_reason = "set by cluster.expandable_segments";
      return;
    case ExpandableSegments::kOff:
      m.expandable_segments = false;
      m.allocator_reason = "set by cluster.expandable_segments";
      if (over)
        m.notes.push_back("cluster.expandable_segments = off: " + holes(*over) +
                          " (set it to auto or on, or lower the micro-batch tokens)");
      return;
    case ExpandableSegments::kAuto: break;
  }
  m.expandable_segments = over != nullptr;
  if (m.on_cpu) m.allocator_reason = "auto: the ranks compute on CPUs";
  else if (m.shared_gpus) m.allocator_reason = "auto: ranks share GPUs";
  else if (m.gpu_bytes <= 0) m.allocator_reason = "auto: no GPU size to plan with; tiller train plans with its GPU's";
  else if (over) m.allocator_reason = "auto: " + holes(*over);
  else if (!any_group) m.allocator_reason = "auto: no sequence groups (their long samples are where the default's holes grew)";
  else
    m.allocator_reason = fmt::format("auto: the default allocator's holes (up to {} times the largest activation, "
                                     "{} GiB) fit",
                                     kFragmentationPerLargestTensor, gib(largest));
}

}  // namespace

MemoryPlan plan_memory(const JobConfig& cfg, const dist::RankPlan& plan, const ModelShapes& shapes, int64_t gpu_bytes) {
  // Distillation scores the student's sampled tokens with the teacher (the reference): every id
  // the student can draw must be one of the teacher's.
  if (cfg.algo.distill_coef > 0)
    if (const model::ModelConfig* s = find_shape(shapes, "actor"))
      if (const model::ModelConfig* t = find_shape(shapes, "ref"); t && t->vocab_size < s->vocab_size)
        throw ConfigError(fmt::format(
            "algo.distill_coef: the teacher (roles.ref.model) has {} token ids, the student (roles.actor.model) {}; the "
            "teacher scores the student's tokens, so it needs the student's tokenizer and at least its vocabulary",
            t->vocab_size, s->vocab_size));
  int64_t layers = 1;
  for (Role r : {Role::kActor, Role::kCritic})
    if (role_trains(r) && plan.group(r))
      if (const model::ModelConfig* mc = find_shape(shapes, std::string(role_name(r)))) layers = std::max(layers, mc->num_layers);
  MemoryPlan p = choose(cfg.train, layers, gpu_bytes, cfg.cluster.ranks_per_gpu > 1,
                        [&](zero::Recompute mode, int64_t kept, bool keep) {
                          return plan_with(cfg, plan, shapes, gpu_bytes, mode, kept, keep);
                        });
  p.on_cpu = cfg.cluster.device == DeviceKind::kCpu;
  choose_allocator(p, cfg.cluster.expandable_segments);
  return p;
}

MemoryPlan plan_trainer(const JobConfig& cfg, const model::ModelConfig& shape, int64_t ranks, int64_t tokens,
                        int64_t gpu_bytes) {
  TILLER_CHECK(ranks >= 1 && tokens >= 0, "plan_trainer: {} ranks, {} tokens", ranks, tokens);
  RoleSpec spec;
  spec.shape = shape_of(shape, model::Head::kLm);
  spec.ranks = ranks;
  spec.dtype_bytes = dtype_bytes(cfg.roles.actor.dtype);
  // A LoRA actor's base is held as a frozen role's; its adapters are fp32 values, gradients and
  // two AdamW moments, whole on every rank (docs/zero.md).
  const LoraConfig& lora = cfg.roles.actor.lora;
  const model::LoraSpec ls_plan = zero::lora_spec(lora, shape, "roles.actor.lora.target_modules");
  const int64_t adapter_bytes = 16 * lora_elements(ls_plan, shape, model::Head::kLm);
  spec.trainable = lora.rank <= 0;
  spec.host_optimizer = cfg.roles.actor.optimizer_offload == OptimizerOffload::kCpu;
  spec.reduce_bytes = cfg.train.reduce_dtype == Precision::kBf16 ? 2 : 4;
  MemoryPlan planned = choose(cfg.train, shape.num_layers, gpu_bytes, false, [&](zero::Recompute mode, int64_t kept, bool keep) {
    MemoryPlan out;
    out.recompute = mode;
    out.recompute_layers = kept;
    // An optimizer on the host, or fp32 compute, keeps the shard whatever the choice.
    out.keep_compute_shard = keep || spec.host_optimizer || spec.dtype_bytes == 4;
    out.gpu_bytes = gpu_bytes;
    const RoleFootprint f = footprint(spec, keep);
    RankMemory rm;
    rm.label = "actor";
    rm.host_bytes = f.host;
    rm.largest_activation = largest_activation_bytes(shape, tokens, spec.dtype_bytes);
    rm.sequence_group = cfg.roles.actor.sequence_parallel > 1;
    PhaseMemory train{Phase::kTrain, {}};
    add(train, "actor weights", f.weights_train);
    add(train, "actor state", f.state);
    add(train, "gathered units", f.gathers);
    add(train, kTrainActivations,
        train_activation_bytes(shape, tokens, spec.dtype_bytes, mode, kept, lora.rank > 0 ? &ls_plan : nullptr));
    add(train, "gradient buffers", f.grad_buffers);
    if (adapter_bytes > 0) add(train, "actor LoRA adapters (fp32 values, gradients, moments)", adapter_bytes);
    if (cfg.roles.actor.fp8) add(train, "FP8 GEMM operands", fp8_operand_bytes(shape, tokens));
    rm.phases.push_back(std::move(train));
    out.ranks.push_back(std::move(rm));
    return out;
  });
  choose_allocator(planned, cfg.cluster.expandable_segments);
  return planned;
}

}  // namespace tiller::job
