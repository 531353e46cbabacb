// What the ZeRO-3 tests share (zero_test.cpp, zero_checkpoint_test.cpp): small models, the
// micro-batches every rank draws, the plain unsharded reference with its written-out AdamW, and the
// comparisons.
#pragma once

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <algorithm>
#include <numeric>
#include <optional>
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
#include "tiller/model/lora.h"
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
inline std::string scratch(const std::string& what) {
  return fmt::format("{}/zero_{}_{}_np{}", TILLER_TEST_SCRATCH, what, comm().backend(), comm().size());
}

inline ModelConfig config(const std::string& preset) {
  ModelConfig c = model::preset(preset);
  c.initializer_range = 0.1;  // larger weights: log-probs and gradients far from uniform
  return c;
}

struct MicroBatch {
  std::vector<std::vector<int64_t>> seqs;
  std::vector<int64_t> targets;
  std::vector<float> weights;  // per token: the "advantages" of the loss
  at::Tensor routes;           // routing replay: int16 [tokens, sparse layers, k], or undefined
};

// Deterministic data for (step, rank, index): 1-3 sequences of 1-12 tokens; rank `empty_rank`
// gets an empty micro-batch at index 1 of step 1 (the lockstep rule: every rank takes part).
inline MicroBatch micro_batch(const ModelConfig& c, int step, int rank, int index, int world, bool routes = false) {
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
  if (routes) {  // routing replay: random distinct experts per row, every fourth row left to the router
    const int64_t t = static_cast<int64_t>(mb.targets.size()), layers = model::sparse_layers(c),
                  k = c.experts_per_token;
    mb.routes = at::full({t, layers, k}, -1, at::kShort);
    int16_t* r = mb.routes.data_ptr<int16_t>();
    std::vector<int16_t> experts(static_cast<size_t>(c.num_experts));
    for (int64_t i = 0; i < t; ++i) {
      if (rng() % 4 == 0) continue;
      for (int64_t l = 0; l < layers; ++l) {
        std::iota(experts.begin(), experts.end(), int16_t{0});
        std::shuffle(experts.begin(), experts.end(), rng);
        std::copy(experts.begin(), experts.begin() + k, r + (i * layers + l) * k);
      }
    }
  }
  return mb;
}

// The loss of one micro-batch, given the model output [T] (log-probs or values): nonlinear in the
// output so the head's gradient is not constant.
inline at::Tensor loss_of(const at::Tensor& out, const MicroBatch& mb, int64_t total_tokens) {
  at::Tensor w = at::tensor(mb.weights, at::kFloat).to(out.device());
  if (mb.weights.empty()) return out.sum() * 0;
  return ((w * out).sum() + 0.1 * out.pow(2).sum()) / static_cast<double>(total_tokens);
}

int64_t tokens_in(const MicroBatch& mb) { return static_cast<int64_t>(mb.targets.size()); }

inline at::Tensor forward(ShardedModel& m, const MicroBatch& mb) {
  auto batch = model::PackedBatch::pack(mb.seqs, device());
  batch.routes = mb.routes;
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
  model::LoraSpec lora;  // LoRA: the adapters (in params) train, the base stays
  std::optional<model::fp8::Scaling> fp8;  // FP8 training: the blocks' GEMMs as ShardedModelOptions::fp8
  at::Tensor forward(const MicroBatch& mb) {
    auto w = model::bind_weights(cfg, params, head, "reference");
    if (lora.enabled()) model::bind_lora(cfg, lora, params, w, "reference");
    auto batch = model::PackedBatch::pack(mb.seqs, device());
    batch.routes = mb.routes;
    at::Tensor h = model::forward_hidden(cfg, w, batch, nullptr, model::AttentionBackend::kAuto, fp8);
    if (head == Head::kValue) return model::values(h, w.score);
    at::Tensor entropy;
    at::Tensor lp = model::token_logprobs(h, w.lm_head, at::tensor(mb.targets, at::kLong).to(device()), 1.0, 1024,
                                          &entropy);
    return lp + 0.3 * entropy;
  }
  // Router losses (a mixture of experts; ShardedModel::router_loss), written out apart from the
  // model's code: the hidden state entering each sparse layer's MLP, its router's softmax and
  // top-k, and per slice [first, first + n) of the micro-batch (a sequence-parallel rank's rows,
  // `sp` of them): aux = E * sum_e f_e * P_e (f_e: the slice's routes to e / n, P_e: its mean
  // probability of e), z = mean over rows of logsumexp(logits)^2; each slice weighted n / total,
  // averaged over the sparse layers. `stats` gets the weighted aux and z (without coefficients).
  double aux_coef = 0, z_coef = 0;
  int sp = 1;
  at::Tensor router_loss(const MicroBatch& mb, int64_t total_tokens, at::Tensor* stats) {
    const auto w = model::bind_weights(cfg, params, head, "reference");
    auto batch = model::PackedBatch::pack(mb.seqs, device());
    const model::Rope rope(cfg);
    model::BlockContext ctx = model::make_block_context(cfg, rope, batch, at::kFloat);
    at::Tensor x = model::embed(w.embed, batch.tokens);
    at::Tensor loss = at::zeros({}, x.options());
    at::Tensor sums = at::zeros({2}, x.options().dtype(at::kDouble));
    const int64_t layers = model::sparse_layers(cfg), e = cfg.num_experts;
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const model::LayerWeights& lw = w.layers[static_cast<size_t>(l)];
      const at::Tensor a = model::attention_residual(cfg, l, lw, x, ctx);
      if (cfg.sparse_layer(l)) {
        const at::Tensor h = model::rms_norm(a, lw.post_attn_norm, cfg.rms_norm_eps);
        const at::Tensor logits = at::matmul(h, lw.router.t()).to(at::kFloat);
        const at::Tensor probs = at::softmax(logits, -1);
        const at::Tensor chosen = std::get<1>(probs.topk(cfg.experts_per_token, -1));
        for (int j = 0; j < sp; ++j) {
          const zero::SequenceSlice slice = zero::SequenceSlice::of(batch, sp, j);
          const int64_t n = slice.tokens.numel(), first = slice.first_row;
          if (n == 0) continue;
          const at::Tensor f = at::one_hot(chosen.narrow(0, first, n), e).sum(at::IntArrayRef({0, 1})).to(at::kFloat) / n;
          const at::Tensor aux = (f * probs.narrow(0, first, n).mean(0)).sum() * static_cast<double>(e);
          const at::Tensor z = at::logsumexp(logits.narrow(0, first, n), -1).pow(2).mean();
          const double weight = static_cast<double>(n) / static_cast<double>(total_tokens * layers);
          loss = loss + (aux * aux_coef + z * z_coef) * weight;
          sums = sums + at::stack({aux.detach(), z.detach()}).to(at::kDouble) * weight;
        }
      }
      x = model::mlp_residual(cfg, l, lw, a, ctx);
    }
    if (stats) *stats = *stats + sums.cpu();
    return loss;
  }
  // Returns the gradient norm before clipping. `router_stats`, when given, gets router_loss()'s.
  double step(const std::vector<MicroBatch>& all, int64_t total_tokens, double lr, double max_norm,
              at::Tensor* router_stats = nullptr) {
    at::Tensor loss = at::zeros({}, params.begin()->second.options());
    for (const auto& mb : all) {
      if (!mb.seqs.empty()) loss = loss + loss_of(forward(mb), mb, total_tokens);
      if (!mb.seqs.empty() && (aux_coef > 0 || z_coef > 0)) loss = loss + router_loss(mb, total_tokens, router_stats);
    }
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
    std::vector<model::ParamSpec> trained = lora.enabled() ? model::lora_parameter_specs(cfg, lora)
                                                           : model::parameter_specs(cfg, head);
    if (lora.enabled() && head == Head::kValue)  // the value head's score trains whole
      trained.push_back({"score.weight", {1, cfg.hidden_size}, -1, false, false});
    for (const auto& spec : trained) {
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

inline zero::ShardedModelOptions options(Head head, zero::AdamWConfig adam, double max_norm) {
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
inline Diff compare(const NamedTensors& got, const NamedTensors& want, const NamedTensors& init) {
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
inline SliceRun forward_slice(ShardedModel& m, const MicroBatch& mb, int sp, int j) {
  if (sp == 1) return {forward(m, mb), 0};
  auto whole = model::PackedBatch::pack(mb.seqs, device());
  whole.routes = mb.routes;
  const auto slice = zero::SequenceSlice::of(whole, sp, j);
  const int64_t n = slice.tokens.numel();
  if (m.options().head == Head::kValue) return {m.values(slice), slice.first_row};
  at::Tensor entropy;
  const at::Tensor targets = at::tensor(mb.targets, at::kLong).narrow(0, slice.first_row, n).to(device());
  at::Tensor lp = m.token_logprobs(slice, targets, 1.0, &entropy);
  return {lp + 0.3 * entropy, slice.first_row};
}
inline at::Tensor slice_loss(const SliceRun& r, const MicroBatch& mb, int64_t total_tokens) {
  const int64_t n = r.out.size(0);
  if (n == 0 || mb.weights.empty()) return r.out.sum() * 0;
  at::Tensor w = at::tensor(mb.weights, at::kFloat).narrow(0, r.first, n).to(r.out.device());
  return ((w * r.out).sum() + 0.1 * r.out.pow(2).sum()) / static_cast<double>(total_tokens);
}

// Trains `steps` steps on both sides and checks after each one. With `sp` > 1 the group's ranks
// form world / sp sequence groups; each takes the rows of one micro-batch that its slice holds,
// and its outputs are checked row by row against the reference's before each step.
inline void expect_sharded_equals_unsharded(const std::string& preset, Head head, int sp = 1, int64_t window = 0,
                                     bool dynamic_rope = false, zero::Recompute recompute = zero::Recompute::kBlocks,
                                     at::ScalarType reduce = at::kFloat,
                                     const std::function<void(zero::ShardedModelOptions&)>& tweak = {},
                                     bool replay_routes = false, int context_parallel = 1) {
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
  NamedTensors init = model::init_weights(cfg, head, 5, at::kFloat);
  zero::ShardedModelOptions opts = options(head, adam, max_norm);
  opts.recompute = recompute;
  opts.reduce_dtype = reduce;
  if (tweak) tweak(opts);
  if (opts.lora.enabled()) {  // adapters with B not zero (PEFT starts it at zero), so A trains from step 1
    at::Generator gen = at::detail::createCPUGenerator(17);
    for (auto& [name, t] : model::init_lora(cfg, opts.lora, 3))
      init[name] = name.find("lora_B") != std::string::npos ? at::normal(0.0, 0.05, t.sizes(), gen) : t;
  }
  // bf16 reduction rounds each reduced gradient to ~3 significant digits.
  // FP8 GEMMs: a rank's gradient sums in another order move a weight by a rounding, which can
  // move its e4m3 code by one step at the next quantization.
  const bool rounded = on_gpu() || reduce != at::kFloat || opts.fp8.has_value();
  // FP8 over sequence slices: the weight gradient's operands are quantized in groups of a rank's
  // own tokens, not the whole micro-batch's as the reference groups them - FP8's own noise, bounded
  // as bf16's on the GPU.
  const bool coarse = on_gpu() || (opts.fp8.has_value() && sp > 1);
  ShardedModel m(cfg, comm(), opts);
  std::unique_ptr<dist::Communicator> seq_group;
  if (sp > 1) {
    seq_group = comm().split(me / sp, me, "sequence");
    m.set_sequence_group(*seq_group, context_parallel);
  }
  m.load(init, "init");
  Reference ref(cfg, head, init, adam);
  ref.lora = opts.lora;
  ref.fp8 = opts.fp8;
  if (opts.lora.enabled())  // the base is frozen (a value head's score trains beside the adapters)
    for (auto& [name, p] : ref.params)
      if (name.find(".lora_") == std::string::npos && !(head == Head::kValue && name == "score.weight"))
        p.requires_grad_(false);
  ref.aux_coef = opts.router_aux_coef;
  ref.z_coef = opts.router_z_coef;
  ref.sp = sp;
  const bool router = opts.router_aux_coef > 0 || opts.router_z_coef > 0;
  const zero::LrSchedule sched{LrScheduleKind::kCosine, 1, 4, 0.1};
  const int groups = world / sp, group = me / sp, j = me % sp;
  const double base_lr = on_gpu() ? 3e-3 : 1e-2;
  const std::string what = fmt::format("{} sp {} recompute {} reduce {}{}{}{}{}", preset, sp,
                                       zero::recompute_name(recompute), c10::toString(reduce),
                                       opts.optimizer_on_host ? " host optimizer" : "",
                                       opts.router_aux_coef > 0 || opts.router_z_coef > 0 ? " router losses" : "",
                                       opts.lora.enabled() ? " lora" : "", opts.fp8 ? " fp8" : "");
  bool clipped = false;
  double worst_out = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<MicroBatch> all;
    int64_t total = 0;
    for (int r = 0; r < groups; ++r)
      for (int i = 0; i < 2; ++i) {
        all.push_back(micro_batch(cfg, step, r, i, groups, replay_routes));
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
        EXPECT_LT(rel, !coarse ? 1e-5 : step == 0 ? 3e-2 : 6e-2) << what << " step " << step << " micro-batch " << i;
      }
      // With the router losses, when on: this rank's rows of the step weigh them.
      m.add_router_loss(slice_loss(run, mb, total), static_cast<double>(total)).backward();
    }
    const double lr = base_lr * sched.factor(step);
    const zero::StepResult r = m.step(lr);
    at::Tensor want_router = at::zeros({2}, at::kDouble);
    const double ref_norm = ref.step(all, total, lr, max_norm, &want_router);
    if (router) {  // the ranks' weighted losses add up to the reference's: each slice counted once
      at::Tensor got = m.take_router_stats().to(device());
      comm().all_reduce(got, dist::ReduceOp::kSum)->wait();
      got = got.cpu();
      EXPECT_GT(want_router[0].item<double>(), 0.5) << what;  // k when balanced: the losses ran
      for (int i = 0; i < 2; ++i)
        EXPECT_NEAR(got[i].item<double>(), want_router[i].item<double>(),
                    (on_gpu() ? 3e-2 : 1e-5) * want_router[i].item<double>())
            << what << " step " << step << (i == 0 ? " aux" : " z");
    }
    clipped |= r.clip_factor < 1;
    EXPECT_FALSE(r.skipped);
    EXPECT_NEAR(r.grad_norm, ref_norm, ref_norm * (coarse ? 3e-2 : rounded ? 3e-3 : 1e-5)) << what << " step " << step;
    NamedTensors got = m.gather_parameters();
    for (auto& [name, t] : m.lora_parameters()) got[name] = t;  // a LoRA value head's trained score too
    const Diff d = compare(got, ref.params, init);
    if (opts.lora.enabled())  // the base did not move
      for (const auto& spec : model::parameter_specs(cfg, head))
        if (spec.name != "score.weight") EXPECT_TRUE(at::equal(got.at(spec.name).cpu(), init.at(spec.name).to(got.at(spec.name).scalar_type())))
            << what << " " << spec.name;
    if (rounded) {
      // FP8 on the GPU: the bf16 activations and gradients, rounded before they are quantized,
      // land on other e4m3 codes than the fp32 reference's (measured 0.17-0.23 on H200).
      EXPECT_LT(d.update_rel, on_gpu() && opts.fp8 ? 0.35 : coarse ? 0.15 : 2e-2) << what << " step " << step << " (max abs " << d.max_abs << ")";
      // fp32 compute with a bf16 reduction: the rounding shows (the option took effect), and
      // stays at bf16's size.
      if (!on_gpu() && step == 2 && reduce != at::kFloat) EXPECT_GT(d.update_rel, 1e-5) << what;
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

}  // namespace
}  // namespace tiller::test
