// ZeRO-3 equivalence: N optimizer steps of ShardedModel training over the group equal the same
// steps of plain, unsharded training (model functions + autograd + a written-out AdamW) on the
// union of every rank's data, computed in-process on each rank. Also: memory per rank, frozen and
// replicated roles, checkpoints (resume equality, atomicity, refusals) and HF export.
// MPI backend on CPU in fp32 (tight tolerances); NCCL on GPUs in bf16 (tolerances for bf16).
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../core/faulty_file_system.h"
#include "mpi_env_for_tests.h"
#include "tiller/core/error.h"
#include "tiller/core/file_system.h"
#include "tiller/core/files.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"
#include "tiller/zero/checkpoint.h"
#include "tiller/zero/flat_layout.h"
#include "tiller/zero/optimizer.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::test {
namespace {

namespace fs = std::filesystem;
using model::Head;
using model::ModelConfig;
using model::NamedTensors;
using zero::ShardedModel;

dist::Communicator& comm() { return *mpi_test_env().comm; }
at::Device device() { return mpi_test_env().device.device(); }
bool on_gpu() { return device().is_cuda(); }
at::ScalarType compute_dtype() { return on_gpu() ? at::kBFloat16 : at::kFloat; }

// A directory every rank names the same (one host: the tests run under one mpirun).
std::string scratch(const std::string& what) {
  return fmt::format("{}/zero_{}_{}_np{}", TILLER_TEST_SCRATCH, what, comm().backend(), comm().size());
}

ModelConfig config(const std::string& preset) {
  ModelConfig c = model::preset(preset);
  c.initializer_range = 0.1;  // larger weights: log-probs and gradients far from uniform
  return c;
}

struct MicroBatch {
  std::vector<std::vector<int64_t>> seqs;
  std::vector<int64_t> targets;
  std::vector<float> weights;  // per token: the "advantages" of the loss
};

// Deterministic data for (step, rank, index): 1-3 sequences of 1-12 tokens; rank `empty_rank`
// gets an empty micro-batch at index 1 of step 1 (the lockstep rule: every rank takes part).
MicroBatch micro_batch(const ModelConfig& c, int step, int rank, int index, int world) {
  MicroBatch mb;
  if (step == 1 && index == 1 && rank == world - 1) return mb;
  std::mt19937_64 rng(1000003ull * step + 1009ull * rank + index);
  const int n = 1 + static_cast<int>(rng() % 3);
  for (int s = 0; s < n; ++s) {
    std::vector<int64_t> seq(1 + rng() % 12);
    for (auto& t : seq) {
      t = static_cast<int64_t>(rng() % c.vocab_size);
      mb.targets.push_back(static_cast<int64_t>(rng() % c.vocab_size));
      mb.weights.push_back(static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 1000.0f);
    }
    mb.seqs.push_back(std::move(seq));
  }
  return mb;
}

// The loss of one micro-batch, given the model output [T] (log-probs or values): nonlinear in the
// output so the head's gradient is not constant.
at::Tensor loss_of(const at::Tensor& out, const MicroBatch& mb, int64_t total_tokens) {
  at::Tensor w = at::tensor(mb.weights, at::kFloat).to(out.device());
  if (mb.weights.empty()) return out.sum() * 0;
  return ((w * out).sum() + 0.1 * out.pow(2).sum()) / static_cast<double>(total_tokens);
}

int64_t tokens_in(const MicroBatch& mb) { return static_cast<int64_t>(mb.targets.size()); }

at::Tensor forward(ShardedModel& m, const MicroBatch& mb) {
  const auto batch = model::PackedBatch::pack(mb.seqs, device());
  if (m.options().head == Head::kValue) return m.values(batch);
  // The entropy joins the loss (the entropy bonus), so its gradient is checked too.
  at::Tensor entropy;
  at::Tensor lp = m.token_logprobs(batch, at::tensor(mb.targets, at::kLong).to(device()), 1.0, &entropy);
  return lp + 0.3 * entropy;
}

// Plain training of the whole model in fp32 with autograd (no recomputation, no sharding) and
// PyTorch's AdamW written out per parameter.
struct Reference {
  ModelConfig cfg;
  Head head;
  NamedTensors params, exp_avg, exp_avg_sq;
  zero::AdamWConfig adam;
  int64_t t = 0;

  Reference(const ModelConfig& c, Head h, const NamedTensors& init, zero::AdamWConfig a) : cfg(c), head(h), adam(a) {
    for (const auto& [n, p] : init) {
      params[n] = p.detach().to(device(), at::kFloat).clone().requires_grad_(true);
      exp_avg[n] = at::zeros_like(params[n]);
      exp_avg_sq[n] = at::zeros_like(params[n]);
    }
  }
  at::Tensor forward(const MicroBatch& mb) {
    const auto w = model::bind_weights(cfg, params, head, "reference");
    const auto batch = model::PackedBatch::pack(mb.seqs, device());
    at::Tensor h = model::forward_hidden(cfg, w, batch);
    if (head == Head::kValue) return model::values(h, w.score);
    at::Tensor entropy;
    at::Tensor lp = model::token_logprobs(h, w.lm_head, at::tensor(mb.targets, at::kLong).to(device()), 1.0, 1024,
                                          &entropy);
    return lp + 0.3 * entropy;
  }
  // Returns the gradient norm before clipping.
  double step(const std::vector<MicroBatch>& all, int64_t total_tokens, double lr, double max_norm) {
    at::Tensor loss = at::zeros({}, params.begin()->second.options());
    for (const auto& mb : all)
      if (!mb.seqs.empty()) loss = loss + loss_of(forward(mb), mb, total_tokens);
    for (auto& [n, p] : params) p.mutable_grad() = at::Tensor();
    loss.backward();
    double sq = 0;
    for (auto& [n, p] : params)
      if (p.grad().defined()) sq += p.grad().pow(2).sum().item<double>();
    const double norm = std::sqrt(sq);
    const double clip = zero::clip_coefficient(norm, max_norm);
    ++t;
    const double bc1 = 1 - std::pow(adam.beta1, t), bc2 = 1 - std::pow(adam.beta2, t);
    c10::AutoGradMode no_grad(false);
    for (const auto& spec : model::parameter_specs(cfg, head)) {
      at::Tensor& p = params.at(spec.name);
      at::Tensor g = p.grad().defined() ? p.grad() * clip : at::zeros_like(p);
      if (!spec.no_decay) p.mul_(1 - lr * adam.weight_decay);
      exp_avg[spec.name].mul_(adam.beta1).add_(g, 1 - adam.beta1);
      exp_avg_sq[spec.name].mul_(adam.beta2).addcmul_(g, g, 1 - adam.beta2);
      p.sub_(lr / bc1 * exp_avg[spec.name] / (exp_avg_sq[spec.name].sqrt() / std::sqrt(bc2) + adam.eps));
    }
    return norm;
  }
};

zero::ShardedModelOptions options(Head head, zero::AdamWConfig adam, double max_norm) {
  zero::ShardedModelOptions o;
  o.head = head;
  o.compute_dtype = compute_dtype();
  o.device = device();
  o.adamw = adam;
  o.max_grad_norm = max_norm;
  o.logprob_chunk_rows = 5;  // several chunks per micro-batch
  return o;
}

struct Diff {
  double max_abs = 0;      // over every parameter
  double update_rel = 0;   // |(got - init) - (want - init)| / |want - init|, Frobenius over the model
};
Diff compare(const NamedTensors& got, const NamedTensors& want, const NamedTensors& init) {
  Diff d;
  double num = 0, den = 0;
  for (const auto& [n, w] : want) {
    at::Tensor g = got.at(n).to(at::kCPU, at::kDouble), wd = w.detach().to(at::kCPU, at::kDouble);
    at::Tensor i0 = init.at(n).to(at::kCPU, at::kDouble);
    d.max_abs = std::max(d.max_abs, (g - wd).abs().max().item<double>());
    num += (g - wd).pow(2).sum().item<double>();
    den += (wd - i0).pow(2).sum().item<double>();
  }
  d.update_rel = std::sqrt(num / std::max(den, 1e-30));
  return d;
}

// This rank's part of micro-batch `mb` when `sp` ranks share it (the whole of it when sp == 1):
// the model's outputs for its rows, and the loss terms of those rows.
struct SliceRun {
  at::Tensor out;  // [n]
  int64_t first = 0;
};
SliceRun forward_slice(ShardedModel& m, const MicroBatch& mb, int sp, int j) {
  if (sp == 1) return {forward(m, mb), 0};
  const auto whole = model::PackedBatch::pack(mb.seqs, device());
  const auto slice = zero::SequenceSlice::of(whole, sp, j);
  const int64_t n = slice.tokens.numel();
  if (m.options().head == Head::kValue) return {m.values(slice), slice.first_row};
  at::Tensor entropy;
  const at::Tensor targets = at::tensor(mb.targets, at::kLong).narrow(0, slice.first_row, n).to(device());
  at::Tensor lp = m.token_logprobs(slice, targets, 1.0, &entropy);
  return {lp + 0.3 * entropy, slice.first_row};
}
at::Tensor slice_loss(const SliceRun& r, const MicroBatch& mb, int64_t total_tokens) {
  const int64_t n = r.out.size(0);
  if (n == 0 || mb.weights.empty()) return r.out.sum() * 0;
  at::Tensor w = at::tensor(mb.weights, at::kFloat).narrow(0, r.first, n).to(r.out.device());
  return ((w * r.out).sum() + 0.1 * r.out.pow(2).sum()) / static_cast<double>(total_tokens);
}

// Trains `steps` steps on both sides and checks after each one. With `sp` > 1 the group's ranks
// form world / sp sequence groups; each takes the rows of one micro-batch that its slice holds,
// and its outputs are checked row by row against the reference's before each step.
void expect_sharded_equals_unsharded(const std::string& preset, Head head, int sp = 1, int64_t window = 0,
                                     bool dynamic_rope = false, zero::Recompute recompute = zero::Recompute::kBlocks,
                                     at::ScalarType reduce = at::kFloat,
                                     const std::function<void(zero::ShardedModelOptions&)>& tweak = {}) {
  const int world = comm().size(), me = comm().rank();
  if (world % sp != 0) GTEST_SKIP() << sp << " does not divide " << world << " ranks";
  ModelConfig cfg = config(preset);
  if (window > 0) cfg.layer_window.assign(static_cast<size_t>(cfg.num_layers), window);
  if (dynamic_rope) {  // dynamic NTK past 6 positions: each row's table depends on its whole sequence
    cfg.max_position_embeddings = 6;
    cfg.rope_scaling.type = "dynamic";
    cfg.rope_scaling.factor = 2.0;
  }
  // eps well above the rounding noise of gradients that are zero in exact arithmetic (k_proj's
  // bias: softmax ignores a constant added to every key), where Adam's m / sqrt(v) would turn
  // noise into full-size updates of random sign. The update formula itself is checked
  // elementwise in tests/zero/layout_optimizer_test.cpp.
  const zero::AdamWConfig adam{0.9, 0.95, 1e-4, 0.1};
  const double max_norm = 0.3;  // clips some steps
  const NamedTensors init = model::init_weights(cfg, head, 5, at::kFloat);
  zero::ShardedModelOptions opts = options(head, adam, max_norm);
  opts.recompute = recompute;
  opts.reduce_dtype = reduce;
  if (tweak) tweak(opts);
  // bf16 reduction rounds each reduced gradient to ~3 significant digits.
  const bool rounded = on_gpu() || reduce != at::kFloat;
  ShardedModel m(cfg, comm(), opts);
  std::unique_ptr<dist::Communicator> seq_group;
  if (sp > 1) {
    seq_group = comm().split(me / sp, me, "sequence");
    m.set_sequence_group(*seq_group);
  }
  m.load(init, "init");
  Reference ref(cfg, head, init, adam);
  const zero::LrSchedule sched{LrScheduleKind::kCosine, 1, 4, 0.1};
  const int groups = world / sp, group = me / sp, j = me % sp;
  const double base_lr = on_gpu() ? 3e-3 : 1e-2;
  const std::string what = fmt::format("{} sp {} recompute {} reduce {}{}", preset, sp, zero::recompute_name(recompute),
                                       c10::toString(reduce), opts.optimizer_on_host ? " host optimizer" : "");
  bool clipped = false;
  double worst_out = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<MicroBatch> all;
    int64_t total = 0;
    for (int r = 0; r < groups; ++r)
      for (int i = 0; i < 2; ++i) {
        all.push_back(micro_batch(cfg, step, r, i, groups));
        total += tokens_in(all.back());
      }
    for (int i = 0; i < 2; ++i) {
      const MicroBatch& mb = all[static_cast<size_t>(group * 2 + i)];
      const SliceRun run = forward_slice(m, mb, sp, j);
      if (sp > 1 && run.out.size(0) > 0) {
        at::Tensor whole;
        {
          c10::AutoGradMode no_grad(false);
          whole = ref.forward(mb).to(at::kDouble).cpu();
        }
        // Relative to the micro-batch's largest output: a slice of a few rows near zero would make
        // bf16's absolute rounding look large relative to itself.
        const at::Tensor want = whole.narrow(0, run.first, run.out.size(0));
        const at::Tensor got = run.out.detach().to(at::kDouble).cpu();
        const double rel = ((got - want).abs().max() / whole.abs().max().clamp_min(1e-30)).item<double>();
        worst_out = std::max(worst_out, rel);
        // bf16 on the GPU: the first step's outputs are rounding apart; later ones also carry the
        // drift of bf16 training from the fp32 reference (the update's few % above).
        EXPECT_LT(rel, !on_gpu() ? 1e-5 : step == 0 ? 3e-2 : 6e-2) << what << " step " << step << " micro-batch " << i;
      }
      slice_loss(run, mb, total).backward();
    }
    const double lr = base_lr * sched.factor(step);
    const zero::StepResult r = m.step(lr);
    const double ref_norm = ref.step(all, total, lr, max_norm);
    clipped |= r.clip_factor < 1;
    EXPECT_FALSE(r.skipped);
    EXPECT_NEAR(r.grad_norm, ref_norm, ref_norm * (on_gpu() ? 3e-2 : rounded ? 3e-3 : 1e-5)) << what << " step " << step;
    const Diff d = compare(m.gather_parameters(), ref.params, init);
    if (rounded) {
      EXPECT_LT(d.update_rel, on_gpu() ? 0.15 : 2e-2) << what << " step " << step << " (max abs " << d.max_abs << ")";
      // fp32 compute with a bf16 reduction: the rounding shows (the option took effect), and
      // stays at bf16's size.
      if (!on_gpu() && step == 2) EXPECT_GT(d.update_rel, 1e-5) << what;
    } else {
      EXPECT_LT(d.max_abs, 2e-6) << what << " step " << step;
      EXPECT_LT(d.update_rel, 1e-4) << what << " step " << step;
    }
    if (me == 0)
      std::printf("[zero] %s %s step %d: grad norm %.6g (reference %.6g), update rel err %.3g, max |diff| %.3g, "
                  "outputs rel err %.3g\n",
                  what.c_str(), head == Head::kLm ? "lm" : "value", step, r.grad_norm, ref_norm, d.update_rel,
                  d.max_abs, worst_out);
  }
  EXPECT_TRUE(clipped) << "no step clipped: the test does not cover clipping";
  EXPECT_EQ(m.steps(), 3);
}

TEST(Zero, ShardedTrainingEqualsUnshardedTiedLm) { expect_sharded_equals_unsharded("tiny-qwen2", Head::kLm); }
TEST(Zero, ShardedTrainingEqualsUnshardedUntiedLm) { expect_sharded_equals_unsharded("tiny-qwen3", Head::kLm); }
TEST(Zero, ShardedTrainingEqualsUnshardedValueHead) { expect_sharded_equals_unsharded("tiny-llama", Head::kValue); }

// Sequence parallelism: S = 2 and 4 against the unsharded reference (which S = 1 equals, above).
// Micro-batches of 0-36 tokens in 1-3 sequences: shorter than S, divisible by S and not.
class SequenceParallel : public ::testing::TestWithParam<int> {};
TEST_P(SequenceParallel, LlamaLogProbsEntropyAndTrainingEqualNoSp) {
  expect_sharded_equals_unsharded("tiny-llama", Head::kLm, GetParam());
}
TEST_P(SequenceParallel, Qwen2BiasTiedHeadEqualsNoSp) {
  expect_sharded_equals_unsharded("tiny-qwen2", Head::kLm, GetParam());
}
TEST_P(SequenceParallel, MistralSlidingWindowOneKvHeadEqualsNoSp) {
  expect_sharded_equals_unsharded("tiny-mistral", Head::kLm, GetParam(), /*window=*/4);
}
TEST_P(SequenceParallel, DynamicRopeScalingEqualsNoSp) {
  expect_sharded_equals_unsharded("tiny-llama", Head::kLm, GetParam(), 0, /*dynamic_rope=*/true);
}
TEST_P(SequenceParallel, ValueHeadEqualsNoSp) {
  expect_sharded_equals_unsharded("tiny-llama", Head::kValue, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Zero, SequenceParallel, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& i) { return "sp" + std::to_string(i.param); });

// Gradients reduce-scattered in bf16 (train.reduce_dtype) into the fp32 accumulators: training
// still follows the fp32 reference within bf16 rounding, with several micro-batches per step.
TEST(Zero, Bf16ReductionTrainsWithinBf16Rounding) {
  expect_sharded_equals_unsharded("tiny-qwen2", Head::kLm, 1, 0, false, zero::Recompute::kBlocks, at::kBFloat16);
  expect_sharded_equals_unsharded("tiny-llama", Head::kValue, 1, 0, false, zero::Recompute::kNone, at::kBFloat16);
}

// Keeping activations (train.recompute attention_only / none) trains exactly as the unsharded
// reference, as recomputing whole blocks does: Qwen3 (qk_norm, untied head), a value head, and
// sequence parallelism, whose exchanges then run once per direction instead of being recomputed.
class KeptActivations : public ::testing::TestWithParam<zero::Recompute> {};
TEST_P(KeptActivations, UntiedQkNormLmEqualsUnsharded) {
  expect_sharded_equals_unsharded("tiny-qwen3", Head::kLm, 1, 0, false, GetParam());
}
TEST_P(KeptActivations, ValueHeadEqualsUnsharded) {
  expect_sharded_equals_unsharded("tiny-llama", Head::kValue, 1, 0, false, GetParam());
}
TEST_P(KeptActivations, SequenceParallelEqualsUnsharded) {
  expect_sharded_equals_unsharded("tiny-qwen2", Head::kLm, 2, 0, false, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Zero, KeptActivations,
                         ::testing::Values(zero::Recompute::kAttentionOnly, zero::Recompute::kNone),
                         [](const ::testing::TestParamInfo<zero::Recompute>& i) {
                           return std::string(zero::recompute_name(i.param));
                         });

// roles.<r>.optimizer_offload: cpu. The masters and moments on the host, updated by the CPU AdamW
// (its kernel equals ATen's fused AdamW to fp32 rounding: tests/zero/layout_optimizer_test.cpp):
// training follows the unsharded reference within the bounds of the on-device optimizer, with
// clipping, weight decay and an empty micro-batch; an LM (tied head) and a value head, one block's
// activations kept (kNone: the graph's path) and recomputed.
TEST(Zero, OptimizerOnTheHostTrainsAsTheReference) {
  const auto host = [](zero::ShardedModelOptions& o) {
    o.optimizer_on_host = true;
    o.optimizer_threads = 2;
  };
  expect_sharded_equals_unsharded("tiny-qwen2", Head::kLm, 1, 0, false, zero::Recompute::kBlocks, at::kFloat, host);
  expect_sharded_equals_unsharded("tiny-llama", Head::kValue, 1, 0, false, zero::Recompute::kNone, at::kFloat, host);
}

// train.recompute_layers: the first block keeps what the mode keeps, the others recompute whole
// blocks; training still equals the unsharded reference exactly.
TEST(Zero, KeptActivationsInTheFirstBlocksOnly) {
  const auto first = [](zero::ShardedModelOptions& o) { o.recompute_layers = 1; };
  expect_sharded_equals_unsharded("tiny-qwen3", Head::kLm, 1, 0, false, zero::Recompute::kAttentionOnly, at::kFloat,
                                  first);
  expect_sharded_equals_unsharded("tiny-llama", Head::kValue, 1, 0, false, zero::Recompute::kNone, at::kFloat, first);
}

TEST(Zero, MemoryPerRankIsOneNth) {
  const ModelConfig cfg = config("tiny-llama");
  const int n = comm().size();
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  const zero::ShardMemory mem = m.memory();
  // The whole model's bytes: compute copy (+ fp32 master unless fp32), gradient, two moments.
  const int64_t params = model::num_parameters(cfg);
  const int64_t per_param = (compute_dtype() == at::kFloat ? 4 : 2 + 4) + 4 + 8;
  const int64_t units = cfg.num_layers + 2;
  const double full = static_cast<double>(params * per_param);
  // Padding: each parameter starts on a 64-element boundary, each unit rounds up to 64 x N.
  const double slack = static_cast<double>((static_cast<int64_t>(model::parameter_specs(cfg).size()) * 64 + units * 64 * n) * per_param) / n;
  EXPECT_GE(static_cast<double>(mem.total()), full / n);
  EXPECT_LE(static_cast<double>(mem.total()), full / n + slack);
  EXPECT_EQ(mem.gradients, mem.optimizer / 2);
  if (comm().rank() == 0)
    std::printf("[zero] %d ranks: %lld bytes per rank for a model of %lld bytes (x N = %.4f of it)\n", n,
                static_cast<long long>(mem.total()), static_cast<long long>(full),
                static_cast<double>(mem.total()) * n / full);

  zero::ShardedModelOptions frozen = options(Head::kLm, {}, 1.0);
  frozen.trainable = false;
  ShardedModel f(cfg, comm(), frozen);
  EXPECT_EQ(f.memory().gradients + f.memory().optimizer, 0);
  EXPECT_LE(static_cast<double>(f.memory().parameters),
            static_cast<double>(params * at::elementSize(compute_dtype())) / n + slack);
}

TEST(Zero, FrozenShardedAndReplicatedForwardEqualTheReference) {
  const ModelConfig cfg = config("tiny-qwen2");
  const NamedTensors init = model::init_weights(cfg, Head::kLm, 9, at::kFloat);
  zero::ShardedModelOptions o = options(Head::kLm, {}, 1.0);
  o.trainable = false;
  ShardedModel sharded(cfg, comm(), o);
  o.replicate = true;
  ShardedModel replicated(cfg, comm(), o);
  sharded.load(init, "init");
  replicated.load(init, "init");
  EXPECT_EQ(replicated.world(), 1);
  const MicroBatch mb = micro_batch(cfg, 7, comm().rank(), 0, comm().size());
  at::Tensor entropy;
  const auto batch = model::PackedBatch::pack(mb.seqs, device());
  const at::Tensor targets = at::tensor(mb.targets, at::kLong).to(device());
  at::Tensor a = sharded.token_logprobs(batch, targets, 0.7, &entropy);
  at::Tensor b = replicated.token_logprobs(batch, targets, 0.7);
  EXPECT_FALSE(a.requires_grad());
  EXPECT_TRUE(at::equal(a, b)) << "sharded and replicated frozen models differ";
  // The unsharded model in the same compute dtype.
  NamedTensors cast;
  for (const auto& [n, t] : init) cast[n] = t.to(device(), compute_dtype());
  const auto w = model::bind_weights(cfg, cast, Head::kLm, "reference");
  at::Tensor want_entropy;
  at::Tensor want = model::token_logprobs(model::forward_hidden(cfg, w, batch), w.lm_head, targets, 0.7, 1024, &want_entropy);
  EXPECT_LT((a - want).abs().max().item<double>(), on_gpu() ? 1e-2 : 1e-5);
  EXPECT_LT((entropy - want_entropy).abs().max().item<double>(), on_gpu() ? 1e-2 : 1e-5);
}

// Trains `steps` steps of fixed data, starting at `first`.
void train(ShardedModel& m, const ModelConfig& cfg, int first, int steps) {
  for (int s = first; s < first + steps; ++s) {
    const MicroBatch mb = micro_batch(cfg, 10 + s, comm().rank(), 0, comm().size());
    loss_of(forward(m, mb), mb, 20).backward();
    m.step(1e-2);
  }
}

void expect_same_parameters(const NamedTensors& a, const NamedTensors& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [n, t] : a) {
    if (on_gpu()) {  // flash attention's backward accumulates with atomics: not bitwise repeatable
      EXPECT_LT((t - b.at(n)).abs().max().item<double>(), 1e-3) << what << ": " << n;
    } else {
      EXPECT_TRUE(at::equal(t, b.at(n))) << what << ": " << n;
    }
  }
}

TEST(Zero, ResumeContinuesAsIfNeverStopped) {
  const ModelConfig cfg = config("tiny-qwen2");
  const std::string dir = scratch("resume");
  const auto o = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
  ShardedModel a(cfg, comm(), o);
  a.load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
  train(a, cfg, 0, 2);
  zero::save_checkpoint(a, dir);
  EXPECT_EQ(zero::checkpoint_steps(dir), 2);
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  train(a, cfg, 2, 2);

  ShardedModel b(cfg, comm(), o);
  b.load(model::init_weights(cfg, Head::kLm, 99, at::kFloat), "other init");
  zero::load_checkpoint(b, dir);
  EXPECT_EQ(b.steps(), 2);
  train(b, cfg, 2, 2);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "resumed vs uninterrupted");
  EXPECT_EQ(b.steps(), 4);
}

// roles.<r>.offload: the state leaves the device and comes back bit for bit; a forward (scoring)
// runs meanwhile from the compute shards; the next step is the one without offload.
TEST(Zero, OffloadThenReloadIsBitExactAndTheNextStepEqualsOneWithout) {
  const ModelConfig cfg = config("tiny-qwen2");
  const auto o = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
  ShardedModel a(cfg, comm(), o), b(cfg, comm(), o);
  for (ShardedModel* m : {&a, &b}) {
    m->load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
    train(*m, cfg, 0, 2);
  }
  const zero::ShardMemory before = b.memory();
  // Moments, the fp32 masters unless they are the compute shards, and the step counts (a few fp32
  // scalars). The gradient accumulators hold nothing between steps: freed, not moved.
  const int64_t state = before.optimizer + (o.compute_dtype == at::kFloat ? 0 : before.parameters * 4 / 6);
  const int64_t moved = b.offload_state();
  EXPECT_GE(moved, state);
  EXPECT_LT(moved, state + 4096);
  EXPECT_TRUE(b.state_offloaded());
  EXPECT_EQ(b.offload_state(), 0);  // already off
  const MicroBatch mb = micro_batch(cfg, 7, comm().rank(), 0, comm().size());
  {
    c10::AutoGradMode no_grad(false);
    EXPECT_TRUE(at::equal(forward(b, mb), forward(a, mb))) << "scoring while offloaded";
  }
  EXPECT_THROW(b.step(1e-2), Error);
  EXPECT_THROW(b.unit_states(), Error);
  EXPECT_GT(b.reload_state(), 0);
  EXPECT_FALSE(b.state_offloaded());
  const auto sa = a.unit_states(), sb = b.unit_states();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t u = 0; u < sa.size(); ++u) {
    EXPECT_TRUE(at::equal(sa[u].master.cpu(), sb[u].master.cpu())) << sa[u].name;
    EXPECT_TRUE(at::equal(sa[u].exp_avg.cpu(), sb[u].exp_avg.cpu())) << sa[u].name;
    EXPECT_TRUE(at::equal(sa[u].exp_avg_sq.cpu(), sb[u].exp_avg_sq.cpu())) << sa[u].name;
  }
  train(a, cfg, 2, 1);
  train(b, cfg, 2, 1);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "offloaded and reloaded vs never");

  // With a gradient pending (a backward, no step yet) the accumulators move too, and the step
  // after the reload is the one without offload.
  for (ShardedModel* m : {&a, &b}) {
    const MicroBatch pending = micro_batch(cfg, 31, comm().rank(), 0, comm().size());
    loss_of(forward(*m, pending), pending, 20).backward();
  }
  const int64_t with_grads = b.offload_state();
  EXPECT_GE(with_grads, state + before.gradients);
  EXPECT_LT(with_grads, state + before.gradients + 4096);
  b.reload_state();
  a.step(1e-2);
  b.step(1e-2);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "offloaded with a pending gradient");
}

// The state a host optimizer keeps: the device holds the compute shard and the gradient
// accumulator only; checkpoints written by either optimizer load into the other and training goes
// on as if never stopped; an offload for the hybrid engine moves nothing (the state is on the
// host already) and frees the accumulators; the next step equals one without it.
TEST(Zero, OptimizerOnTheHostCheckpointsResumesAndOffloads) {
  const ModelConfig cfg = config("tiny-qwen2");
  const std::string dir = scratch("host_adamw");
  // eps above the rounding noise of gradients that are zero in exact arithmetic (see
  // expect_sharded_equals_unsharded): the two optimizers' last-bit differences stay that small.
  auto o = options(Head::kLm, {0.9, 0.95, 1e-4, 0.05}, 0.5);
  o.optimizer_on_host = true;
  o.optimizer_threads = 3;
  ShardedModel a(cfg, comm(), o);
  a.load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
  const zero::ShardMemory mem = a.memory();
  EXPECT_EQ(mem.optimizer, 0);
  EXPECT_EQ(mem.parameters, mem.gradients * at::elementSize(compute_dtype()) / 4);
  EXPECT_GE(mem.host, 3 * mem.gradients);  // masters and two moments
  ASSERT_NE(a.host_optimizer(), nullptr);
  EXPECT_EQ(a.host_optimizer()->threads(), 3);
  train(a, cfg, 0, 2);
  zero::save_checkpoint(a, dir);
  train(a, cfg, 2, 2);

  // Resumed with the host optimizer, and with the device's: the same parameters as uninterrupted
  // (the device's AdamW within fp32 rounding of the host's over 2 steps).
  ShardedModel b(cfg, comm(), o);
  zero::load_checkpoint(b, dir);
  EXPECT_EQ(b.steps(), 2);
  train(b, cfg, 2, 2);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "host optimizer resumed vs uninterrupted");
  auto on_device = o;
  on_device.optimizer_on_host = false;
  ShardedModel c(cfg, comm(), on_device);
  zero::load_checkpoint(c, dir);
  train(c, cfg, 2, 2);
  const NamedTensors pa = a.gather_parameters(), pc = c.gather_parameters();
  for (const auto& [n, t] : pa)
    EXPECT_LT((t - pc.at(n)).abs().max().item<double>(), on_gpu() ? 2e-2 : 1e-5) << "device optimizer resumed: " << n;

  // The hybrid engine's offload: nothing moves, the accumulators are freed, scoring still runs.
  const int64_t before = b.memory().gradients;
  EXPECT_EQ(b.offload_state(), 0);
  EXPECT_TRUE(b.state_offloaded());
  const MicroBatch mb = micro_batch(cfg, 7, comm().rank(), 0, comm().size());
  {
    c10::AutoGradMode no_grad(false);
    EXPECT_TRUE(at::equal(forward(b, mb), forward(a, mb))) << "scoring while offloaded";
  }
  EXPECT_THROW(b.step(1e-2), Error);
  b.reload_state();
  EXPECT_EQ(b.memory().gradients, before);
  train(a, cfg, 4, 1);
  train(b, cfg, 4, 1);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "after an offload");
}

// train.compute_shard cast: no persistent compute-dtype shard; each gather casts the fp32 master
// first. In bf16 (on the CPU too) the gathered weights are the same bits as the persistent shard's,
// so training, scoring, an offload for generation and a checkpoint round trip equal the kept
// shard's bit for bit, with blocks recomputed and with activations kept (the graph's parked
// units), on 1, 2 and 4 ranks. The memory saved is the shard's.
TEST(Zero, CastWhileGatheringEqualsThePersistentShardBitForBit) {
  const ModelConfig cfg = config("tiny-qwen3");  // untied head: the LM head's own unit
  for (zero::Recompute mode : {zero::Recompute::kBlocks, zero::Recompute::kNone}) {
    auto keep = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
    keep.compute_dtype = at::kBFloat16;
    keep.recompute = mode;
    auto cast = keep;
    cast.keep_compute_shard = false;
    ShardedModel a(cfg, comm(), keep), b(cfg, comm(), cast);
    for (ShardedModel* m : {&a, &b}) m->load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
    EXPECT_EQ(a.memory().parameters - b.memory().parameters, a.memory().gradients / 2) << "the bf16 shard";
    for (const auto& u : b.shards()) EXPECT_FALSE(u.compute.defined()) << u.name;
    for (int s = 0; s < 3; ++s) {
      train(a, cfg, s, 1);
      train(b, cfg, s, 1);
      expect_same_parameters(b.gather_parameters(), a.gather_parameters(),
                             fmt::format("cast vs kept, {} step {}", zero::recompute_name(mode), s));
    }
    const MicroBatch mb = micro_batch(cfg, 9, comm().rank(), 0, comm().size());
    c10::AutoGradMode no_grad(false);
    const at::Tensor want = forward(a, mb);
    EXPECT_TRUE(on_gpu() || at::equal(forward(b, mb), want)) << "scoring";
    b.offload_state();  // compute shards made for the scoring meanwhile
    for (const auto& u : b.shards()) EXPECT_TRUE(u.compute.defined()) << u.name;
    EXPECT_TRUE(on_gpu() || at::equal(forward(b, mb), want)) << "scoring while offloaded";
    b.reload_state();
    for (const auto& u : b.shards()) EXPECT_FALSE(u.compute.defined()) << u.name;
  }
}

// zero_grad() leaves the accumulators as they are (the next backward overwrites them): a step with
// no backward since then must see zero gradients, not the last step's, also after an offload
// freed their memory.
TEST(Zero, AStepWithNoBackwardSinceZeroGradSeesNoGradient) {
  const ModelConfig cfg = config("tiny-qwen2");
  const auto o = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
  ShardedModel m(cfg, comm(), o);
  m.load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
  const MicroBatch mb = micro_batch(cfg, 12, comm().rank(), 0, comm().size());
  loss_of(forward(m, mb), mb, 20).backward();
  EXPECT_GT(m.step(1e-2).grad_norm, 0);
  EXPECT_EQ(m.step(1e-2).grad_norm, 0) << "the step before's gradients";
  loss_of(forward(m, mb), mb, 20).backward();
  m.zero_grad();
  EXPECT_EQ(m.step(1e-2).grad_norm, 0) << "a gradient from before zero_grad";
  loss_of(forward(m, mb), mb, 20).backward();
  EXPECT_GT(m.step(1e-2).grad_norm, 0);
  m.offload_state();
  m.reload_state();
  EXPECT_EQ(m.step(1e-2).grad_norm, 0) << "the reloaded accumulators' contents";
}

TEST(Zero, FailedSaveLeavesThePreviousCheckpoint) {
  const ModelConfig cfg = config("tiny-llama");
  const std::string dir = scratch("atomic");
  const int last = comm().size() - 1;
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  m.load(model::init_weights(cfg, Head::kLm, 4, at::kFloat), "init");
  train(m, cfg, 0, 1);
  zero::save_checkpoint(m, dir);
  const NamedTensors saved = m.gather_parameters();
  train(m, cfg, 1, 1);
  zero::SaveOptions fail;
  fail.after_write = [&](int rank) {
    if (rank == last) throw IoError("disk full (injected)");
  };
  try {
    zero::save_checkpoint(m, dir, fail);
    ADD_FAILURE() << "the save did not fail";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(fmt::format("rank {} failed to write its shard", last)), std::string::npos) << msg;
    EXPECT_NE(msg.find("previous checkpoint is untouched"), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  EXPECT_EQ(zero::checkpoint_steps(dir), 1);
  ShardedModel back(cfg, comm(), options(Head::kLm, {}, 1.0));
  zero::load_checkpoint(back, dir);
  expect_same_parameters(back.gather_parameters(), saved, "after a failed save");
}

// The file system failing under a save: a full disk part-way through the last rank's shard, a
// failed fsync of meta.json, a failed rename of the new directory into place (after the old one
// was moved aside). Each save fails with IoError and the checkpoint that loads is the previous
// one, bit for bit. A failed fsync of the parent after the rename also fails the save (so the
// controller does not commit the step), with a whole checkpoint in place.
TEST(Zero, FileSystemFaultsNeverHalfCommitASave) {
  const ModelConfig cfg = config("tiny-llama");
  const std::string dir = scratch("fs_faults");
  const int last = comm().size() - 1;
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  m.load(model::init_weights(cfg, Head::kLm, 5, at::kFloat), "init");
  train(m, cfg, 0, 1);
  zero::save_checkpoint(m, dir);
  const NamedTensors saved = m.gather_parameters();
  train(m, cfg, 1, 1);
  const std::vector<std::pair<std::string, std::function<void(test::FaultyFileSystem&)>>> faults = {
      {"full disk", [&](auto& f) { f.full_disk_in = fmt::format("rank_{:05d}.safetensors", last); f.disk_left = 1000; }},
      {"meta.json fsync", [](auto& f) { f.fail_sync_in = "meta.json"; }},
      {"rename into place", [&](auto& f) { f.fail_rename_exact_to = dir; }},
  };
  for (const auto& [name, arm] : faults) {
    test::FaultyFileSystem faulty;
    if (comm().rank() == 0 || name == "full disk") arm(faulty);
    {
      FileSystem::Override use(faulty);
      EXPECT_THROW(zero::save_checkpoint(m, dir), IoError) << name;
    }
    EXPECT_EQ(zero::checkpoint_steps(dir), 1) << name;
    ShardedModel back(cfg, comm(), options(Head::kLm, {}, 1.0));
    zero::load_checkpoint(back, dir);
    expect_same_parameters(back.gather_parameters(), saved, "after a save that met: " + name);
  }
  test::FaultyFileSystem parent;
  if (comm().rank() == 0) parent.fail_sync_dir_exact = parent_dir(dir);
  {
    FileSystem::Override use(parent);
    EXPECT_THROW(zero::save_checkpoint(m, dir), IoError);
  }
  EXPECT_EQ(zero::checkpoint_steps(dir), 2);
  const NamedTensors now = m.gather_parameters();
  ShardedModel back(cfg, comm(), options(Head::kLm, {}, 1.0));
  zero::load_checkpoint(back, dir);
  expect_same_parameters(back.gather_parameters(), now, "after a failed fsync of the parent");
  zero::save_checkpoint(m, dir);  // and without faults a save succeeds
  EXPECT_FALSE(fs::exists(dir + ".old"));
}

TEST(Zero, LoadRefusesWhatDoesNotFit) {
  const ModelConfig cfg = config("tiny-llama");
  const std::string dir = scratch("refuse");
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  zero::save_checkpoint(m, dir);
  auto expect_error = [&](ShardedModel& into, const std::string& needle) {
    try {
      zero::load_checkpoint(into, dir);
      ADD_FAILURE() << "loaded; expected: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ShardedModel other(config("tiny-qwen3"), comm(), options(Head::kLm, {}, 1.0));
  expect_error(other, "is it the same model shape?");
  ShardedModel critic(cfg, comm(), options(Head::kValue, {}, 1.0));
  expect_error(critic, "with the lm head, this role needs the value head");
  comm().all_reduce(at::zeros({1}, mpi_test_env().device.dtype(at::kFloat)))->wait();  // every rank has read
  if (comm().rank() == 0) {
    auto meta = nlohmann::json::parse(*read_file(dir + "/meta.json"));
    meta["world"] = comm().size() + 1;
    write_file_atomic(dir + "/meta.json", meta.dump());
  }
  comm().all_reduce(at::zeros({1}, mpi_test_env().device.dtype(at::kFloat)))->wait();
  expect_error(m, fmt::format("saved by a group of {} ranks, this group has {}", comm().size() + 1, comm().size()));
}

TEST(Zero, ExportRoundTripsBothHeads) {
  for (Head head : {Head::kLm, Head::kValue}) {
    const ModelConfig cfg = config("tiny-qwen2");
    const std::string dir = scratch(head == Head::kLm ? "export_lm" : "export_value");
    ShardedModel m(cfg, comm(), options(head, {}, 1.0));
    m.load(model::init_weights(cfg, head, 6, at::kFloat), "init");
    train(m, cfg, 0, 1);
    zero::save_checkpoint(m, dir + "/ckpt");
    const NamedTensors params = m.gather_parameters();
    if (comm().rank() != 0) continue;  // export is one process
    zero::export_hf(dir + "/ckpt", dir + "/hf", at::kFloat);
    const auto loaded = model::load_model(dir + "/hf", head, at::kFloat, at::kCPU);
    ASSERT_EQ(loaded.tensors.size(), params.size());
    for (const auto& [n, t] : params) EXPECT_TRUE(at::equal(loaded.tensors.at(n), t.cpu().to(at::kFloat))) << n;
  }
}

// Writes a trained, exported model and the logits tiller computes for it; tests/zero/export_check.sh
// then checks them with transformers. Runs only when TILLER_ZERO_EXPORT_DIR is set.
TEST(ZeroExport, CheckpointForTransformers) {
  const char* out = std::getenv("TILLER_ZERO_EXPORT_DIR");
  if (!out) GTEST_SKIP() << "TILLER_ZERO_EXPORT_DIR is not set";
  const ModelConfig cfg = config("tiny-qwen2");
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  m.load(model::init_weights(cfg, Head::kLm, 8, at::kFloat), "init");
  train(m, cfg, 0, 2);
  zero::save_checkpoint(m, std::string(out) + "/ckpt");
  const NamedTensors params = m.gather_parameters();
  if (comm().rank() != 0) return;
  const std::vector<std::vector<int64_t>> inputs{{1, 5, 9, 200, 31}, {7, 7, 7, 400, 2, 3, 11, 12}};
  NamedTensors fp32;
  for (const auto& [n, t] : params) fp32[n] = t.cpu().to(at::kFloat);
  const auto w = model::bind_weights(cfg, fp32, Head::kLm, "trained");
  NamedTensors logits;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto batch = model::PackedBatch::pack({inputs[i]}, at::kCPU);
    logits["logits_" + std::to_string(i)] = model::logits(model::forward_hidden(cfg, w, batch), w.lm_head);
  }
  model::write_safetensors(std::string(out) + "/reference_logits.safetensors", logits);
  nlohmann::json manifest;
  manifest["inputs"] = inputs;
  manifest["models"] = {"hf"};
  write_file_atomic(std::string(out) + "/manifest.json", manifest.dump());
}

}  // namespace
}  // namespace tiller::test
