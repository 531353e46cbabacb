// The memory plan (job/memory_plan.h): what it counts per rank and phase, how the hybrid KV
// cache is sized against the generate phase's footprint, and a plan that cannot fit refused with
// the rank, its roles and what to change.
#include <cstdio>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/job/memory_plan.h"
#include "tiller/model/model_config.h"

namespace tiller::controller {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// A 7B-shaped Qwen2 (the shape of Qwen2.5-7B: 7.6e9 parameters).
model::ModelConfig qwen7b() {
  model::ModelConfig c = model::preset("tiny-qwen2");
  c.vocab_size = 152064;
  c.hidden_size = 3584;
  c.intermediate_size = 18944;
  c.num_layers = 28;
  c.num_heads = 28;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.tie_word_embeddings = false;
  c.max_position_embeddings = 32768;
  return c;
}

JobConfig hybrid_job(int gpus) {
  JobConfig c;
  c.cluster.hybrid = true;
  c.roles.actor.gpus = gpus;
  c.roles.critic.colocate_with = "actor";
  c.rollout.max_prompt_tokens = 1024;
  c.rollout.max_new_tokens = 1024;
  c.engines.max_num_seqs = 4096;  // the fraction, not the cap of max_num_seqs full sequences, sizes the cache
  c.validate();
  return c;
}

dist::RankPlan plan_of(const JobConfig& c, int gpus) {
  return dist::make_rank_plan(c, dist::NodeMap::fill_by_slot({gpus}, dist::required_world_size(c)));
}

job::ModelShapes shapes() {
  return {{"actor", qwen7b()}, {"critic", qwen7b()}, {"ref", qwen7b()}};
}

int64_t item(const job::PhaseMemory& p, const std::string& name) {
  for (const auto& [n, b] : p.items)
    if (n == name) return b;
  return 0;
}

TEST(MemoryPlan, CountsShardsStateAndTheEngine) {
  JobConfig c = hybrid_job(4);
  c.train.compute_shard = ComputeShard::kKeep;
  const job::MemoryPlan m = job::plan_memory(c, plan_of(c, 4), shapes(), 0);
  ASSERT_EQ(m.ranks.size(), 4u);
  const job::RankMemory& r = m.ranks[0];
  EXPECT_EQ(r.label, "actor+critic+ref+engine0.tp0");
  ASSERT_EQ(r.phases.size(), 3u);
  const job::PhaseMemory& train = r.phases[1];
  EXPECT_EQ(train.phase, job::Phase::kTrain);
  // bf16 shards of 7.6e9 parameters over 4 ranks: ~3.8 GB; AdamW state 16 bytes/param/4: ~30 GB.
  EXPECT_NEAR(static_cast<double>(item(train, "actor weights")) / 1e9, 3.8, 0.1);
  EXPECT_NEAR(static_cast<double>(item(train, "actor state")) / 1e9, 30.5, 0.5);
  EXPECT_EQ(item(train, "ref state"), 0);  // frozen
  // sleep_level 1 (default): the engine's weights stay in training, its cache does not.
  EXPECT_NEAR(static_cast<double>(item(train, "engine weights")) / 1e9, 15.2, 0.2);
  EXPECT_EQ(item(train, "engine kv cache"), 0);
  EXPECT_EQ(m.overflow(), nullptr);  // no GPU size: no verdict
  EXPECT_TRUE(m.keep_compute_shard);
  EXPECT_EQ(item(r.phases[0], "engine FP8 weights"), 0);
  // An FP8 engine also holds its projections in e4m3: 28 layers of (2 x 3584 + 2 x 512) x 3584 +
  // 3 x 18944 x 3584 bytes, ~6.52 GB, in every phase its weights are (its re-quantization's
  // kernel takes no temporaries in the sync).
  JobConfig f = c;
  f.engines.quantization = EngineQuantization::kFp8;
  const job::RankMemory fr = job::plan_memory(f, plan_of(f, 4), shapes(), 0).ranks[0];
  for (const job::PhaseMemory& p : fr.phases)
    EXPECT_NEAR(static_cast<double>(item(p, "engine FP8 weights")) / 1e9, 6.52, 0.02) << static_cast<int>(p.phase);
  EXPECT_EQ(item(fr.phases[1], "FP8 GEMM operands"), 0);
  // FP8 training: the largest GEMM's e4m3 operands, the gate/up projections' input gradient at
  // 16384 tokens: (16384 + 3584) x 18944 bytes, 1/16 more for scales and padding (~0.40 GB);
  // in training only (the reference is not FP8 here).
  f.roles.actor.fp8 = true;
  const job::RankMemory f8 = job::plan_memory(f, plan_of(f, 4), shapes(), 0).ranks[0];
  EXPECT_EQ(item(f8.phases[1], "FP8 GEMM operands"), (16384 + 3584) * int64_t{18944} * 17 / 16);
  EXPECT_EQ(item(f8.phases[0], "FP8 GEMM operands"), 0);

  // train.compute_shard cast: the trained roles hold no bf16 shard (the frozen reference does).
  c.train.compute_shard = ComputeShard::kCast;
  const job::PhaseMemory cast = job::plan_memory(c, plan_of(c, 4), shapes(), 0).ranks[0].phases[1];
  EXPECT_EQ(item(cast, "actor weights"), 0);
  EXPECT_EQ(item(cast, "critic weights"), 0);
  EXPECT_EQ(item(cast, "ref weights"), item(train, "ref weights"));
  // The optimizer on the host: the device keeps the gradients (4 bytes/param/4: ~7.6 GB) and the
  // bf16 shard; the host the masters and moments (12 bytes/param/4: ~22.8 GB).
  c.roles.actor.optimizer_offload = OptimizerOffload::kCpu;
  const job::RankMemory host = job::plan_memory(c, plan_of(c, 4), shapes(), 0).ranks[0];
  EXPECT_NEAR(static_cast<double>(item(host.phases[1], "actor state")) / 1e9, 7.6, 0.1);
  EXPECT_NEAR(static_cast<double>(item(host.phases[1], "actor weights")) / 1e9, 3.8, 0.1);
  EXPECT_NEAR(static_cast<double>(host.host_bytes) / 1e9, 22.9, 0.2);
  EXPECT_NE(job::plan_memory(c, plan_of(c, 4), shapes(), 0).table().find("host memory"), std::string::npos);
}

// Context parallelism (roles.<r>.context_parallel): inside a block's attention each rank holds the
// row's keys and values for its heads, S x micro_batch_tokens rows of 2 x kv_size / U elements,
// and their gradient in training: at S = 4, R = 4 (U = 1), 16384 tokens, the 7B shape's 512
// KV elements per row in bf16: 2 x 4 x 16384 x 1024 x 2 bytes, ~268 MB; at R = 2 (U = 2) half.
TEST(MemoryPlan, ContextParallelCountsTheGatheredKeysAndValues) {
  JobConfig c = hybrid_job(4);
  c.roles.actor.sequence_parallel = 4;
  c.roles.critic.enabled = false;
  const job::PhaseMemory none = job::plan_memory(c, plan_of(c, 4), shapes(), 0).ranks.at(0).phases.at(1);
  EXPECT_EQ(item(none, "context-parallel keys and values"), 0);
  c.roles.actor.context_parallel = 4;
  const job::PhaseMemory all = job::plan_memory(c, plan_of(c, 4), shapes(), 0).ranks.at(0).phases.at(1);
  EXPECT_EQ(item(all, "context-parallel keys and values"), int64_t{2} * 4 * 16384 * 2 * 512 * 2);
  c.roles.actor.context_parallel = 2;
  const job::PhaseMemory half = job::plan_memory(c, plan_of(c, 4), shapes(), 0).ranks.at(0).phases.at(1);
  EXPECT_EQ(item(half, "context-parallel keys and values"), int64_t{2} * 4 * 16384 * 2 * 512 * 2 / 2);
}

// LoRA (roles.actor.lora, the offline trainers): the base costs its compute shard alone, the
// adapters 16 bytes a parameter whole on every rank (fp32 values, gradients, two moments): r 16 on
// every projection of the 7B shape is 40.4M parameters; the full run's optimizer state is gone.
TEST(MemoryPlan, ALoraActorHoldsItsBaseFrozenAndItsAdaptersWhole) {
  JobConfig c;
  c.roles.actor.gpus = 2;
  c.train.micro_batch_tokens = 4096;
  const job::PhaseMemory full = job::plan_trainer(c, qwen7b(), 2, 4096, 80 * kGiB).ranks.at(0).phases.at(0);
  c.roles.actor.lora.rank = 16;
  const job::PhaseMemory lora = job::plan_trainer(c, qwen7b(), 2, 4096, 80 * kGiB).ranks.at(0).phases.at(0);
  EXPECT_GT(item(full, "actor state"), 40 * kGiB);
  EXPECT_EQ(item(lora, "actor state"), 0);
  EXPECT_EQ(item(lora, "gradient buffers"), 0);
  EXPECT_EQ(item(lora, "actor weights"), model::num_parameters(qwen7b()) * 2 / 2);  // its bf16 shard of 2 ranks
  const int64_t adapters = item(lora, "actor LoRA adapters (fp32 values, gradients, moments)");
  EXPECT_EQ(adapters, int64_t{16} * 28 * 16 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944)));
  c.roles.actor.lora.target_modules = "q_proj,v_proj";
  const job::PhaseMemory qv = job::plan_trainer(c, qwen7b(), 2, 4096, 80 * kGiB).ranks.at(0).phases.at(0);
  EXPECT_EQ(item(qv, "actor LoRA adapters (fp32 values, gradients, moments)"),
            int64_t{16} * 28 * 16 * ((3584 + 3584) + (3584 + 512)));
}

// LoRA in tiller train: a LoRA actor's base costs its shard, its adapters 16 bytes an element;
// the reference in its processes is the actor's base with the adapters off (no ref weights, a note
// says what that saved); a LoRA critic trains its adapters and its value head; the engine holds the
// adapters (fp32) beside its weights.
TEST(MemoryPlan, LoraInTrainTakesTheReferenceFromTheActorsBase) {
  JobConfig c = hybrid_job(2);
  const job::MemoryPlan full = job::plan_memory(c, plan_of(c, 2), shapes(), 0);
  c.roles.actor.lora.rank = 16;
  c.roles.critic.lora.rank = 16;
  c.roles.critic.lora.target_modules = "q_proj,v_proj";
  const job::MemoryPlan m = job::plan_memory(c, plan_of(c, 2), shapes(), 0);
  const job::PhaseMemory& train = m.ranks.at(0).phases.at(1);
  const job::PhaseMemory& full_train = full.ranks.at(0).phases.at(1);
  EXPECT_GT(item(full_train, "ref weights"), 7 * kGiB / 2);
  EXPECT_EQ(item(train, "ref weights"), 0);
  ASSERT_EQ(m.notes.size(), 1u);
  EXPECT_NE(m.notes[0].find("ref: the actor's base with its LoRA adapters off"), std::string::npos) << m.notes[0];
  EXPECT_NE(m.table().find(m.notes[0]), std::string::npos);
  EXPECT_EQ(item(train, "actor state"), 0);
  EXPECT_EQ(item(train, "critic state"), 0);
  const int64_t actor = int64_t{16} * 28 * 16 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944));
  EXPECT_EQ(item(train, "actor LoRA adapters"), actor);
  EXPECT_EQ(item(train, "critic LoRA adapters"), int64_t{16} * (28 * 16 * ((3584 + 3584) + (3584 + 512)) + 3584));
  EXPECT_EQ(item(train, "engine LoRA adapters"), actor / 4);  // fp32 values alone (engines at TP 1)
  EXPECT_GT(item(train, "activations (train.micro_batch_tokens)"), 0) << "the adapters' backward runs through the frozen base";
  EXPECT_LT(train.total() + 40 * kGiB, full_train.total());
  // A reference with a model of its own is loaded as before.
  c.roles.ref.model = "/elsewhere";
  EXPECT_EQ(item(job::plan_memory(c, plan_of(c, 2), shapes(), 0).ranks.at(0).phases.at(1), "ref weights"),
            item(full_train, "ref weights"));
}

TEST(MemoryPlan, TheHybridKvCacheIsWhatTheGeneratePhaseLeaves) {
  JobConfig c = hybrid_job(4);
  c.roles.actor.offload = c.roles.critic.offload = true;
  c.engines.sleep_level = 2;
  const int64_t gpu = 141 * kGiB;
  const job::MemoryPlan m = job::plan_memory(c, plan_of(c, 4), shapes(), gpu);
  const job::RankMemory& r = m.ranks[0];
  const job::PhaseMemory& gen = r.phases[0];
  EXPECT_EQ(item(gen, "actor state"), 0);  // offloaded while generating
  EXPECT_GT(r.kv_cache_bytes, 20 * kGiB);
  EXPECT_EQ(gen.total(), static_cast<int64_t>(c.engines.gpu_memory_fraction * static_cast<double>(gpu - job::kReserveBytes)))
      << "the cache takes what the fraction leaves";
  // At most max_num_seqs full-length sequences: 16 x 2048 tokens x 56 KiB per token (bf16, 4 KV heads of 128, 28 layers).
  JobConfig few = c;
  few.engines.max_num_seqs = 16;
  EXPECT_EQ(job::plan_memory(few, plan_of(few, 4), shapes(), gpu).ranks[0].kv_cache_bytes, 16 * 2048 * 2 * 28 * 512 * 2);
  // An FP8 KV cache (engines.kv_cache_dtype fp8): a byte per element and a 4-byte scale per token
  // and KV head, 4 x (128 + 4) bytes where bf16 takes 4 x 256.
  few.engines.kv_cache_dtype = KvCacheDtype::kFp8;
  EXPECT_EQ(job::plan_memory(few, plan_of(few, 4), shapes(), gpu).ranks[0].kv_cache_bytes, 16 * 2048 * 2 * 28 * 4 * 132);
  EXPECT_EQ(item(r.phases[1], "engine weights"), 0);  // level 2: freed in training
  EXPECT_EQ(m.overflow(), nullptr) << m.table();
  EXPECT_NO_THROW(job::check_fits(m, c));
  // Without offload, the state stays on the GPU while generating: less cache.
  JobConfig kept = hybrid_job(4);
  EXPECT_LT(job::plan_memory(kept, plan_of(kept, 4), shapes(), gpu).ranks[0].kv_cache_bytes, r.kv_cache_bytes);
}

// Hybrid engines at TP 2 over NCCL (planned for GPUs) score after generating: the generate phase
// holds no scoring activations (a larger KV cache), and a score phase of its own holds them beside
// the engine's weights (a level-1 sleep keeps them) without its cache. Each TP rank holds half the
// engine's weights and half its KV heads.
TEST(MemoryPlan, HybridTensorParallelEnginesScoreInAPhaseOfTheirOwn) {
  JobConfig c = hybrid_job(4);
  c.roles.actor.offload = c.roles.critic.offload = true;
  c.engines.tp = 2;
  c.validate();
  const int64_t gpu = 80 * kGiB;
  const job::MemoryPlan m = job::plan_memory(c, plan_of(c, 4), shapes(), gpu);
  const job::RankMemory& r = m.ranks.at(0);
  EXPECT_EQ(r.label, "actor+critic+ref+engine0.tp0");
  ASSERT_EQ(r.phases.size(), 4u);
  EXPECT_EQ(r.phases[0].phase, job::Phase::kGenerate);
  EXPECT_EQ(r.phases[1].phase, job::Phase::kScore);
  EXPECT_EQ(r.phases[2].phase, job::Phase::kTrain);
  EXPECT_EQ(r.phases[3].phase, job::Phase::kSync);
  const job::PhaseMemory &gen = r.phases[0], &score = r.phases[1];
  EXPECT_EQ(item(gen, "activations (scoring)"), 0);
  EXPECT_GT(item(score, "activations (scoring)"), 0);
  EXPECT_EQ(item(score, "engine kv cache"), 0);
  EXPECT_EQ(item(score, "engine weights"), item(gen, "engine weights"));
  EXPECT_EQ(item(score, "ref weights"), item(gen, "ref weights"));
  EXPECT_NEAR(static_cast<double>(item(gen, "engine weights")) / 1e9, 7.6, 0.1);  // 15.2 GB over TP 2
  EXPECT_NE(m.table().find("    score "), std::string::npos) << m.table();
  // Scoring beside the cache (overlap) leaves the cache less room.
  JobConfig overlap = c;
  overlap.cluster.hybrid_scoring = HybridScoring::kOverlap;
  const job::RankMemory o = job::plan_memory(overlap, plan_of(overlap, 4), shapes(), gpu).ranks.at(0);
  ASSERT_EQ(o.phases.size(), 3u);
  EXPECT_EQ(r.kv_cache_bytes - o.kv_cache_bytes, item(o.phases[0], "activations (scoring)"));
  // Planned on the CPU's MPI, auto overlaps.
  JobConfig cpu = c;
  cpu.cluster.device = DeviceKind::kCpu;
  EXPECT_EQ(job::plan_memory(cpu, plan_of(cpu, 4), shapes(), 0).ranks.at(0).phases.size(), 3u);
  // At sleep level 0 the cache stays through the scoring.
  c.engines.sleep_level = 0;
  c.engines.kv_cache_gb = 4;
  EXPECT_EQ(item(job::plan_memory(c, plan_of(c, 4), shapes(), 0).ranks.at(0).phases[1], "engine kv cache"), 4 * kGiB);
}

TEST(MemoryPlan, APlanThatCannotFitIsRefusedNamingTheRole) {
  // 7B PPO (actor and critic) on one 80 GB GPU: the state alone is ~240 GB.
  const JobConfig c = hybrid_job(1);
  std::string msg;
  try {
    job::plan_memory(c, plan_of(c, 1), shapes(), 80 * kGiB);
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rank 1 (actor+critic+ref+engine0.tp0) has no room for a KV cache"), std::string::npos) << msg;
  EXPECT_NE(msg.find("roles.actor.offload=true"), std::string::npos) << msg;
  // With a fixed cache the plan is made, and the fit check refuses it.
  JobConfig fixed = hybrid_job(1);
  fixed.engines.kv_cache_gb = 2;
  const job::MemoryPlan m = job::plan_memory(fixed, plan_of(fixed, 1), shapes(), 80 * kGiB);
  ASSERT_NE(m.overflow(), nullptr);
  try {
    job::check_fits(m, fixed);
    ADD_FAILURE() << "a plan that cannot fit passed";
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rank 1 (actor+critic+ref+engine0.tp0) needs"), std::string::npos) << msg;
  // Training holds the most: every role's state, the engine's weights, activations and gradients.
  EXPECT_NE(msg.find("in its train phase"), std::string::npos) << msg;
  EXPECT_NE(msg.find("largest: actor state"), std::string::npos) << msg;
  EXPECT_NE(msg.find("give the role more GPUs (roles.<role>.gpus)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("roles.<role>.optimizer_offload=cpu"), std::string::npos) << msg;
  // A cache of 40 GiB makes generating the largest phase: offloading is what helps there.
  fixed.engines.kv_cache_gb = 40;
  try {
    job::check_fits(job::plan_memory(fixed, plan_of(fixed, 1), shapes(), 80 * kGiB), fixed);
    ADD_FAILURE() << "a plan that cannot fit passed";
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("in its generate phase"), std::string::npos) << msg;
  EXPECT_NE(msg.find("set roles.actor.offload=true"), std::string::npos) << msg;
  EXPECT_NE(m.table().find("DOES NOT FIT"), std::string::npos);
  // Advice the config already follows is not given again: with the actor offloaded and the engine
  // asleep at level 2, neither is suggested.
  fixed.roles.actor.offload = fixed.roles.critic.offload = true;
  fixed.engines.sleep_level = 2;
  fixed.engines.kv_cache_gb = 70;
  try {
    job::check_fits(job::plan_memory(fixed, plan_of(fixed, 1), shapes(), 80 * kGiB), fixed);
    ADD_FAILURE() << "a plan that cannot fit passed";
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg.find("offload=true"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("sleep_level=2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("memory plan: rank 1"), std::string::npos) << msg;
}

TEST(MemoryPlan, SeparatePoolsPlanTrainersAndEnginesApart) {
  JobConfig c;
  c.roles.actor.gpus = 2;
  c.engines.count = 2;
  c.algo.advantage_estimator = "group_norm";
  c.roles.critic.enabled = false;
  c.rollout.n_samples_per_prompt = 4;
  c.engines.max_num_seqs = 4096;
  c.validate();
  const job::MemoryPlan m = job::plan_memory(c, plan_of(c, 4), shapes(), 141 * kGiB);
  ASSERT_EQ(m.ranks.size(), 4u);
  EXPECT_EQ(m.ranks[0].label, "actor+ref");
  EXPECT_EQ(m.ranks[0].kv_cache_bytes, 0);
  EXPECT_EQ(m.ranks[2].label, "engine0.tp0");
  EXPECT_EQ(item(m.ranks[2].phases[0], "actor weights"), 0);
  EXPECT_GT(m.ranks[2].kv_cache_bytes, 50 * kGiB);
  EXPECT_EQ(m.overflow(), nullptr) << m.table();
}

// train.recompute: auto keeps as many activations as the GPU holds with a margin, a set mode is
// planned as set, and the activations each mode counts grow from blocks to none.
TEST(MemoryPlan, RecomputeAutoKeepsTheMostActivationsThatFit) {
  JobConfig c;
  c.roles.actor.gpus = 4;
  c.engines.count = 1;
  c.algo.advantage_estimator = "group_norm";
  c.roles.critic.enabled = false;
  c.roles.ref.enabled = false;
  c.rollout.n_samples_per_prompt = 4;
  c.train.micro_batch_tokens = 8192;
  c.validate();
  const dist::RankPlan plan = plan_of(c, 5);
  auto planned = [&](int64_t gib) { return job::plan_memory(c, plan, shapes(), gib * kGiB); };
  // The most kept activations first, then the bf16 shard if it still fits: on 141 GiB every
  // activation and the shard; on 80 GiB the MLP halves of every block; smaller GPUs keep them in
  // fewer blocks (the rest recompute whole blocks), and a small one none.
  const job::MemoryPlan big = planned(141), mid = planned(80), less = planned(60), small = planned(45);
  EXPECT_EQ(big.recompute, zero::Recompute::kNone) << big.table();
  EXPECT_TRUE(big.keep_compute_shard) << big.table();
  EXPECT_EQ(mid.recompute, zero::Recompute::kAttentionOnly) << mid.table();
  EXPECT_EQ(mid.recompute_layers, -1) << mid.table();
  EXPECT_EQ(less.recompute, zero::Recompute::kAttentionOnly) << less.table();
  EXPECT_GT(less.recompute_layers, 0) << less.table();
  EXPECT_LT(less.recompute_layers, 28) << less.table();
  EXPECT_FALSE(less.keep_compute_shard) << less.table();
  EXPECT_EQ(small.recompute, zero::Recompute::kBlocks) << small.table();
  for (const job::MemoryPlan* m : {&big, &mid, &less, &small}) EXPECT_EQ(m->overflow(), nullptr) << m->table();
  EXPECT_NE(big.table().find("train.recompute: none (auto"), std::string::npos) << big.table();
  EXPECT_NE(less.table().find(fmt::format("train.recompute: attention_only in the first {} blocks (auto",
                                          less.recompute_layers)),
            std::string::npos)
      << less.table();
  EXPECT_NE(less.table().find("train.compute_shard: cast (auto"), std::string::npos) << less.table();
  // One more block's activations would not fit, with the shard cast or kept.
  JobConfig more = c;
  more.train.recompute = RecomputeChoice::kAttentionOnly;
  more.train.recompute_layers = less.recompute_layers + 1;
  more.train.compute_shard = ComputeShard::kCast;
  const job::MemoryPlan one_more = job::plan_memory(more, plan, shapes(), 60 * kGiB);
  bool fits = true;
  for (const auto& r : one_more.ranks)
    for (const auto& p : r.phases) {
      const int64_t act = item(p, "activations (train.micro_batch_tokens)");
      fits = fits && job::activations_fit(p.total() - act, act, one_more.gpu_bytes);
    }
  EXPECT_FALSE(fits) << "a block more of activations fits: auto did not keep the most\n" << one_more.table();
  // No GPU size: the least memory.
  EXPECT_EQ(planned(0).recompute, zero::Recompute::kBlocks);
  EXPECT_FALSE(planned(0).keep_compute_shard);

  // The 7B shape at 8192 tokens: blocks keep one input per layer (1.5 GiB; 5.6 GiB with a block's
  // backward in flight and the logits' chunk), none ~32 GiB more.
  const auto act = [&](zero::Recompute r) {
    return job::train_activation_bytes(qwen7b(), 8192, 2, r);
  };
  EXPECT_LT(act(zero::Recompute::kBlocks), 6 * kGiB);
  EXPECT_GT(act(zero::Recompute::kAttentionOnly), act(zero::Recompute::kBlocks) + 25 * kGiB);
  EXPECT_GT(act(zero::Recompute::kNone), act(zero::Recompute::kAttentionOnly) + 3 * kGiB);

  c.train.recompute = RecomputeChoice::kBlocks;
  const job::MemoryPlan set = planned(141);
  EXPECT_EQ(set.recompute, zero::Recompute::kBlocks);
  EXPECT_EQ(item(set.ranks[0].phases[1], "activations (train.micro_batch_tokens)"), act(zero::Recompute::kBlocks));
  // A set mode that does not fit is refused like any plan that does not fit.
  c.train.recompute = RecomputeChoice::kNone;
  EXPECT_THROW(job::check_fits(planned(48), c), ConfigError);
}

// The ranks agree on the least kept activations with a min all-reduce of one number per choice.
// The long-sequence job that printed nothing for 200 s on 2xH100 (tiller bench train, 1.5B, 16
// samples of 8192 tokens a step cut over sequence-parallel groups of 2: 65,536 tokens a rank) is
// planned to fit either card, keeping fewer activations on the smaller: on 4xH200 (2026-11-28) its
// run peaked at 62.2 GiB with the plan for 80 GB (65.5 planned) and at 113.4 with the plan for
// 141 GB (116.7 planned). The run it once was, with every activation kept, does not fit 80 GB.
TEST(MemoryPlan, LongSequencesKeepWhatEachCardHolds) {
  JobConfig c;
  c.roles.actor.dtype = Precision::kBf16;
  const model::ModelConfig shape = model::preset("qwen2-1.5b");
  const job::MemoryPlan h100 = job::plan_trainer(c, shape, 2, 8192 * 16 / 2, 80 * kGiB);
  const job::MemoryPlan h200 = job::plan_trainer(c, shape, 2, 8192 * 16 / 2, 141 * kGiB);
  EXPECT_TRUE(h100.fits());
  EXPECT_TRUE(h200.fits());
  EXPECT_EQ(h100.recompute, zero::Recompute::kAttentionOnly);
  EXPECT_EQ(h100.recompute_layers, 10);
  EXPECT_EQ(h200.recompute, zero::Recompute::kAttentionOnly);
  EXPECT_EQ(h200.recompute_layers, 24);
  EXPECT_NEAR(static_cast<double>(h100.ranks.at(0).peak()) / kGiB, 65.5, 0.1);
  EXPECT_NEAR(static_cast<double>(h200.ranks.at(0).peak()) / kGiB, 116.7, 0.1);
  c.train.recompute = RecomputeChoice::kAttentionOnly;  // in every block, as on the larger card
  std::string msg;
  try {
    job::check_trainer_fits(job::plan_trainer(c, shape, 2, 8192 * 16 / 2, 80 * kGiB), 0, "bench train, qwen2-1.5b", "lower --seq");
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("memory plan: rank 0 (bench train, qwen2-1.5b) needs"), std::string::npos) << msg;
  EXPECT_NE(msg.find("on a 80.00 GiB GPU (train.recompute attention_only"), std::string::npos) << msg;
}

// cluster.expandable_segments: auto turns PyTorch's expandable segments on where a rank in a
// sequence group would not fit with the default allocator's holes (18 of the largest activation,
// measured) beside its peak: the 1.5B shape at 65,536 tokens a rank in a group of 2 on a 79 GiB GPU
// (it ran out of memory there on 2×H200, 2026-11-30, with 19.1-19.9 GiB held in holes), not at 8k
// tokens, not without a sequence group (the same tokens in 4k samples fitted), nor the 7B shape at
// 8,192 tokens a rank on an 80 GB H100 (it trained there with the default allocator, 2026-11-25).
TEST(MemoryPlan, ExpandableSegmentsWhereTheDefaultAllocatorsHolesWouldNotFit) {
  JobConfig c;
  c.roles.actor.dtype = Precision::kBf16;
  const model::ModelConfig shape = model::preset("qwen2-1.5b");
  const job::MemoryPlan no_group = job::plan_trainer(c, shape, 2, 65536, 79 * kGiB);
  EXPECT_FALSE(no_group.expandable_segments) << no_group.allocator_reason;
  EXPECT_NE(no_group.allocator_reason.find("auto: no sequence groups"), std::string::npos) << no_group.allocator_reason;
  c.roles.actor.sequence_parallel = 2;
  // An MLP's gate output: 65,536 tokens x 8,960 x 2 bytes.
  EXPECT_EQ(job::largest_activation_bytes(shape, 65536, 2), int64_t{65536} * 8960 * 2);
  const job::MemoryPlan long_samples = job::plan_trainer(c, shape, 2, 65536, 79 * kGiB);
  EXPECT_TRUE(long_samples.fits()) << long_samples.table();
  EXPECT_EQ(long_samples.ranks.at(0).largest_activation, int64_t{65536} * 8960 * 2);
  EXPECT_TRUE(long_samples.expandable_segments) << long_samples.allocator_reason;
  EXPECT_NE(long_samples.allocator_reason.find("auto: rank 0 (actor): peak 64.37 GiB, its largest activation 1.09 GiB, "
                                               "up to 19.69 GiB of the default allocator's holes"),
            std::string::npos)
      << long_samples.allocator_reason;
  EXPECT_NE(long_samples.table().find("cluster.expandable_segments: on (auto: rank 0"), std::string::npos);
  const job::MemoryPlan short_samples = job::plan_trainer(c, shape, 2, 8192, 79 * kGiB);
  EXPECT_FALSE(short_samples.expandable_segments) << short_samples.allocator_reason;
  EXPECT_NE(short_samples.allocator_reason.find("auto: the default allocator's holes (up to 18 times the largest "
                                                "activation, 0.14 GiB) fit"),
            std::string::npos)
      << short_samples.allocator_reason;
  const job::MemoryPlan seven = job::plan_trainer(c, qwen7b(), 2, 8192, static_cast<int64_t>(79.6 * kGiB));
  EXPECT_TRUE(seven.fits()) << seven.table();
  EXPECT_FALSE(seven.expandable_segments) << seven.allocator_reason;
  // Set: on or off whatever the plan; off where the holes would not fit says so in the plan's notes.
  c.cluster.expandable_segments = ExpandableSegments::kOn;
  EXPECT_TRUE(job::plan_trainer(c, shape, 2, 8192, 79 * kGiB).expandable_segments);
  c.cluster.expandable_segments = ExpandableSegments::kOff;
  const job::MemoryPlan off = job::plan_trainer(c, shape, 2, 65536, 79 * kGiB);
  EXPECT_FALSE(off.expandable_segments);
  EXPECT_EQ(off.allocator_reason, "set by cluster.expandable_segments");
  ASSERT_EQ(off.notes.size(), 1u) << off.table();
  EXPECT_NE(off.notes[0].find("cluster.expandable_segments = off: rank 0 (actor): peak 64.37 GiB"), std::string::npos)
      << off.notes[0];
  EXPECT_NE(off.table().find("set it to auto or on"), std::string::npos);
  EXPECT_TRUE(job::plan_trainer(c, shape, 2, 8192, 79 * kGiB).notes.empty());
  // Without a GPU size there is nothing to fit: auto leaves the default.
  c.cluster.expandable_segments = ExpandableSegments::kAuto;
  const job::MemoryPlan unsized = job::plan_trainer(c, shape, 2, 65536, 0);
  EXPECT_FALSE(unsized.expandable_segments);
  EXPECT_NE(unsized.allocator_reason.find("no GPU size"), std::string::npos) << unsized.allocator_reason;
}

// The 128k-sample hybrid GRPO (configs/gpu/qwen2.5-1.5b-grpo-long-hybrid-2gpu.yaml) on 79 GiB GPUs:
// its scoring and training micro-batches of 65,536 tokens a rank plan expandable segments on each
// actor rank; the same job at 8k samples does not.
TEST(MemoryPlan, TheLongSampleHybridJobPlansExpandableSegments) {
  JobConfig c;
  c.cluster.hybrid = true;
  c.roles.actor.gpus = 2;
  c.roles.actor.sequence_parallel = 2;
  c.roles.actor.dtype = Precision::kBf16;
  c.roles.critic.enabled = false;
  c.roles.ref.colocate_with = "actor";
  c.rollout.batch_size = 8;
  c.rollout.n_samples_per_prompt = 4;
  c.rollout.max_prompt_tokens = 2048;
  c.rollout.max_new_tokens = 129024;
  c.rollout.micro_batch_tokens = 65536;
  c.train.micro_batch_tokens = 65536;
  c.train.train_batch_size = 32;
  c.engines.max_num_seqs = 16;
  c.algo.advantage_estimator = "group_norm";
  c.validate();
  model::ModelConfig shape = model::preset("qwen2-1.5b");
  shape.max_position_embeddings = 131072;
  const job::ModelShapes s{{"actor", shape}, {"ref", shape}};
  const job::MemoryPlan m = job::plan_memory(c, plan_of(c, 2), s, 79 * kGiB);
  EXPECT_TRUE(m.fits()) << m.table();
  EXPECT_TRUE(m.expandable_segments) << m.table();
  EXPECT_NE(m.table().find("cluster.expandable_segments: on (auto: rank 1 (actor+ref+engine0.tp0)"), std::string::npos)
      << m.table();
  c.rollout.max_new_tokens = 6144;
  c.rollout.micro_batch_tokens = c.train.micro_batch_tokens = 8192;
  c.validate();
  const job::MemoryPlan short_samples = job::plan_memory(c, plan_of(c, 2), s, 79 * kGiB);
  EXPECT_FALSE(short_samples.expandable_segments) << short_samples.table();
}

TEST(MemoryPlan, RecomputeChoicesOrderByWhatTheyKeep) {
  using zero::Recompute;
  const std::vector<std::pair<Recompute, int64_t>> ascending{
      {Recompute::kBlocks, -1}, {Recompute::kAttentionOnly, 1}, {Recompute::kAttentionOnly, 27},
      {Recompute::kAttentionOnly, -1}, {Recompute::kNone, 3}, {Recompute::kNone, -1}};
  double last = -1;
  for (const auto& [mode, layers] : ascending) {
    const double o = job::recompute_order(mode, layers);
    EXPECT_GT(o, last) << zero::recompute_name(mode) << " " << layers;
    last = o;
    EXPECT_EQ(job::recompute_from_order(o), std::make_pair(mode, layers)) << zero::recompute_name(mode) << " " << layers;
    EXPECT_EQ(static_cast<double>(static_cast<float>(o)), o) << "not exact in a float";
  }
}

}  // namespace
}  // namespace tiller::controller
