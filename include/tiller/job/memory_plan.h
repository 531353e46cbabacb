// The memory plan: each rank's expected device memory in each phase of a step, from the config,
// the rank plan and the models' shapes, before anything is loaded (`tiller plan` prints it;
// `tiller train` checks it on the GPU and sizes the hybrid engines' KV caches with it).
//
// What it counts, per rank (bytes; ZeRO-3 shards are 1/N of each model, N the role's group):
//   weights     each role's compute shard (dtype bytes x params / N); a trained role that casts
//               while gathering (train.compute_shard) has none, but while its state is offloaded
//               (hybrid generation); the engine's TP slice
//   state       trainable roles: the fp32 master (unless the compute dtype is fp32), the fp32
//               gradient accumulator, the two AdamW moments: 16 bytes / param / N (12 in fp32);
//               with roles.<r>.optimizer_offload: cpu only the accumulator (4), the rest on the
//               host (RankMemory::host_bytes)
//   gathers     two full units in the compute dtype (the one computing and the prefetch), and the
//               cast shards they gather from when the role casts; a mixture of experts' sparse
//               layer's experts stacked for the grouped GEMMs (and in training their stacked
//               gradient)
//   gradients   training: a block's gradients in the compute dtype and two flat buffers of it in
//               train.reduce_dtype (the reduce-scatter being filled and the one in flight); the LM
//               head's or the embedding's flat buffer (their gradient accumulates in it) beside a
//               block's in flight
//   activations training at train.micro_batch_tokens: what every block keeps under the
//               recompute mode (train_activation_bytes), one block's backward in flight, and the
//               LM head's fp32 chunk of logits (with LoRA, the kept blocks' adapted projections'
//               inputs in fp32 for the A gradients, in place of the frozen base's copies, and their
//               rank-r intermediates); scoring (no autograd) one block's internals at
//               rollout.micro_batch_tokens
//   kv cache    the engine's (engines.kv_cache_gb, or what the fraction leaves: see below)
// Phases: train (the trainers' state, gathers and activations; a hybrid engine's weights unless
// sleep_level 2, its cache at sleep_level 0), generate (the engine's weights and cache, the
// trainers' weights and unoffloaded state, scoring activations), and for hybrid ranks sync
// (trainer resident + engine weights + two sync buckets). A hybrid rank whose trainers score after
// the generation (JobConfig::hybrid_scores_after_generate) has a score phase instead of the
// scoring in generate: the generate phase's trainer items and engine weights, the scoring
// activations, and the cache only at sleep_level 0. Each TP rank of an engine holds 1/tp of its
// weights, of its KV cache's heads and of each sync bucket it places.
//
// The hybrid KV cache: engines.kv_cache_gb when set, else engines.gpu_memory_fraction of the GPU
// minus everything else the rank holds while generating (the awake trainer's footprint in that
// phase), not what happened to be free at start-up; at most engines.max_num_seqs sequences of
// full length (more is never used). The estimates are deliberately simple (no
// allocator fragmentation, no CUDA context, which `kReserveBytes` stands for); docs/training.md
// compares them with measured peaks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tiller/core/roles.h"
#include "tiller/model/model_config.h"
#include "tiller/zero/recompute.h"

namespace tiller::model {
struct LoraSpec;
}

namespace tiller {
struct JobConfig;
}
namespace tiller::dist {
struct RankPlan;
}

namespace tiller::job {

// Held back on every GPU for the CUDA context, NCCL buffers and the allocator's slack.
inline constexpr int64_t kReserveBytes = int64_t{3} << 30;
// What the caching allocator holds beyond what it hands out (fragmentation between segments),
// as a share of a rank's peak: 1/16. Measured on 2×H100 (2026-11-25): a 7B ZeRO-3 job whose
// tensors needed ~70 GiB failed to allocate on a 79.6 GiB GPU (docs/benchmarks.md).
inline constexpr int64_t kAllocatorSlackDivisor = 16;
// kReserveBytes and the allocator's slack for a rank whose tensors peak at `peak` bytes.
inline int64_t reserve_bytes(int64_t peak) { return kReserveBytes + peak / kAllocatorSlackDivisor; }
// PyTorch's caching allocator, without expandable segments, cuts a cached block for a smaller
// tensor, and the holes between the pieces still in use cannot take a tensor of the block's size.
// Measured (2×H200 capped at 79 GiB, 2026-11-30): a 1.5B model at 65,536 tokens a rank in a
// sequence group of 2 (samples of 32k and 128k; 1.09 GiB MLP outputs) held 19.1-19.9 GiB
// unallocated when it ran out of memory, 17.5-18.2 times its largest tensor; with expandable
// segments the same step peaked at 60.7 GiB allocated and fitted. The same tokens in 4k samples
// without a sequence group fitted with the default allocator, as 7B hybrid jobs at 16k tokens a
// rank did on 80 GB H100s: the plan counts this many of the largest tensor for ranks in sequence
// groups (at least the peak's 1/16 it holds back anyway).
inline constexpr int64_t kFragmentationPerLargestTensor = 18;
// What the default allocator holds unallocated beside `peak` bytes of tensors whose largest is
// `largest`: the peak's 1/16 (reserve_bytes) or kFragmentationPerLargestTensor of the largest.
inline int64_t default_allocator_slack(int64_t peak, int64_t largest) {
  return std::max(peak / kAllocatorSlackDivisor, kFragmentationPerLargestTensor * largest);
}

enum class Phase { kGenerate, kScore, kTrain, kSync };
const char* phase_name(Phase p);

// One rank's estimate in one phase, by item ("actor weights", "actor state", "activations",
// "engine kv cache", ...), in bytes.
struct PhaseMemory {
  Phase phase = Phase::kTrain;
  std::vector<std::pair<std::string, int64_t>> items;
  int64_t total() const;
};

struct RankMemory {
  int rank = 0;
  int node = 0;
  std::string label;             // the rank plan's ("actor+ref+engine0.tp0")
  std::vector<PhaseMemory> phases;
  int64_t kv_cache_bytes = 0;    // the engine's KV cache on this rank (0 without an engine)
  // Host memory: the optimizer on the host (optimizer_offload: cpu: fp32 masters, moments,
  // staging) and the state a hybrid trainer moves there while generating (roles.<r>.offload).
  int64_t host_bytes = 0;
  // The largest single activation tensor of its training or scoring micro-batches (an MLP's gate or
  // up output, or the q/k/v projection's, at the most tokens a micro-batch gives this rank).
  int64_t largest_activation = 0;
  // A role on this rank splits its samples over a sequence group (roles.<r>.sequence_parallel > 1).
  bool sequence_group = false;
  int64_t peak() const;
  const PhaseMemory* peak_phase() const;
};

struct MemoryPlan {
  int64_t gpu_bytes = 0;         // per GPU; 0: unknown (no fit check)
  // The trained roles' recompute mode: train.recompute, or what `auto` chose (the most kept
  // activations whose train phase fits every rank with an eighth of the activations to spare;
  // kBlocks when the GPU size is unknown or ranks share GPUs), and why.
  zero::Recompute recompute = zero::Recompute::kBlocks;
  int64_t recompute_layers = -1;  // blocks that keep what `recompute` keeps (train.recompute_layers); -1: all
  std::string recompute_reason;
  // The trained roles' train.compute_shard: keep a persistent compute-dtype shard, or cast while
  // gathering; `auto` keeps it when it fits beside the activations of the recompute mode chosen
  // (the mode first: kept activations buy more time per byte than the cast does).
  bool keep_compute_shard = false;
  std::string compute_shard_reason;
  // PyTorch's caching allocator with expandable segments (cluster.expandable_segments): set, or for
  // `auto` on when some rank in a sequence group would not fit its GPU with its peak, the default
  // allocator's holes (default_allocator_slack) and kReserveBytes; and why.
  bool expandable_segments = false;
  std::string allocator_reason;
  bool shared_gpus = false;      // cluster.ranks_per_gpu > 1: ranks share GPUs; no fit check
  bool on_cpu = false;           // cluster.device = cpu: the estimates are host memory
  // Per node (cluster.host_memory_gb); 0: unknown (no host fit check). A node fits when its ranks'
  // host_bytes take at most 9/10 of it (the rest: the OS, the page cache, the processes themselves).
  int64_t host_memory_bytes = 0;
  std::vector<RankMemory> ranks; // every worker rank with a GPU role, in rank order
  std::vector<std::string> notes;  // what the plan leaves out and why (LoRA's reference from the actor's base)
  // Human-readable: one line per rank and phase, in GiB, with the fit.
  std::string table() const;
  // The first rank whose peak does not fit (peak + reserve_bytes(peak) > gpu_bytes), or nullptr.
  const RankMemory* overflow() const;
  // Host bytes of each node's ranks, by node index.
  std::vector<int64_t> host_by_node() const;
  // The first node whose host memory does not fit, or -1.
  int host_overflow() const;
  bool fits() const { return overflow() == nullptr && host_overflow() < 0; }
};

// The models' shapes by role (those the plan runs; the engine's is the actor's unless
// engines.model is set: pass it as "engine").
using ModelShapes = std::map<std::string, model::ModelConfig>;

// The largest single activation tensor of a micro-batch of `tokens` tokens: the widest of an MLP's
// gate/up outputs (a mixture of experts' routed tokens counted top-k times), the shared expert's
// and the q/k/v projection's output, in the compute dtype.
int64_t largest_activation_bytes(const model::ModelConfig& c, int64_t tokens, int64_t dtype_bytes);

// Bytes of activations one training micro-batch of `tokens` holds at its peak under `mode` in its
// first `layers` blocks (< 0: all) and kBlocks in the others (`dtype_bytes` per element of the
// compute dtype).
int64_t train_activation_bytes(const model::ModelConfig& c, int64_t tokens, int64_t dtype_bytes, zero::Recompute mode,
                               int64_t layers = -1, const model::LoraSpec* lora = nullptr);

// A recompute choice (mode, kept layers; < 0: all) as one number that grows with the activations
// kept, so ranks agree on the least with a min all-reduce; and back. Exact in a float.
double recompute_order(zero::Recompute mode, int64_t layers);
std::pair<zero::Recompute, int64_t> recompute_from_order(double order);

// Whether activations of `activations` bytes fit beside `others` on a GPU of `gpu_bytes` with
// reserve_bytes() held back and an eighth of the activations as margin (what train.recompute = auto
// asks of a mode).
bool activations_fit(int64_t others, int64_t activations, int64_t gpu_bytes);

// Throws ConfigError when a hybrid engine has no room for a KV cache of one max-length sequence,
// naming the rank and what to change. `gpu_bytes` 0: estimates only, KV caches from
// engines.kv_cache_gb (else 0).
MemoryPlan plan_memory(const JobConfig& cfg, const dist::RankPlan& plan, const ModelShapes& shapes, int64_t gpu_bytes);

// Throws ConfigError when `m` has a rank that cannot fit, naming the rank, its roles, the phase,
// its largest items and what to change; or a node whose host memory cannot hold its ranks' share.
void check_fits(const MemoryPlan& m, const JobConfig& cfg);

// The smallest layout that fits when `cfg` does not (tiller plan): every trainer role's
// roles.<r>.gpus (those not colocated) and, with separate pools, engines.count times k = 2, 3, ...
// (up to kMaxSuggestedScale, and a world of kMaxSuggestedRanks), on nodes of `gpus_per_node` GPUs of `gpu_bytes`
// and cluster.host_memory_gb each; at each k as configured, then with the trained roles' optimizer
// on the host (optimizer_offload: cpu), then in a hybrid job their state offloaded while the engines
// generate (roles.<r>.offload) too, each when not so already. nullopt when none fits.
struct LayoutSuggestion {
  int nodes = 0;
  int gpus = 0;  // in all
  std::vector<std::string> overrides;  // "roles.actor.gpus=16", ...
};
inline constexpr int kMaxSuggestedRanks = 4096;
inline constexpr int64_t kMaxSuggestedScale = 32;
std::optional<LayoutSuggestion> smallest_fitting_layout(const JobConfig& cfg, const ModelShapes& shapes,
                                                        int gpus_per_node, int64_t gpu_bytes);

// One trained role alone, one rank of its group (tiller bench train): the train phase of the role
// `name` of `shape` (LM head) over `ranks` ranks at `tokens` tokens per micro-batch and rank, with
// `cfg`'s train.* keys and roles.actor's dtype and optimizer_offload; recompute and compute_shard
// `auto` chosen as plan_memory chooses. `gpu_bytes` 0: no choice by size (the least memory).
MemoryPlan plan_trainer(const JobConfig& cfg, const model::ModelConfig& shape, int64_t ranks, int64_t tokens,
                        int64_t gpu_bytes);
// Throws ConfigError when plan_trainer's rank cannot fit: the rank, the role, the phase, its
// largest items and what to change, in the words of `knobs` (the command's flags).
void check_trainer_fits(const MemoryPlan& m, int rank, const std::string& role, const std::string& knobs);

// Throws ConfigError when the engines' model (`engine`, of directory `dir`: engines.model, else the
// actor's) cannot hold a sample: rollout.max_prompt_tokens + the response limit over its context
// (max_position_embeddings with its RoPE scaling). tiller train checks it on each engine rank
// before the weights load, tiller plan with the other checks. Returns the longest sample (the
// engines' max_model_len).
int64_t check_engine_context(const JobConfig& cfg, const model::ModelConfig& engine, const std::string& dir);

// The shapes of the job's models, read from their config.json files; a role whose model cannot
// be read is left out (and `missing` says which, when given).
ModelShapes load_model_shapes(const JobConfig& cfg, std::string* missing = nullptr);

}  // namespace tiller::job
