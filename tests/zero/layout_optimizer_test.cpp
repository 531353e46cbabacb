#include <cmath>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/zero/flat_layout.h"
#include "tiller/zero/optimizer.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::zero {
namespace {

TEST(FlatLayout, ShardsCoverEveryParameterOnceAndAlign) {
  const model::ModelConfig cfg = model::preset("tiny-qwen2");
  for (int world : {1, 2, 3, 4, 7}) {
    auto units = model_layouts(cfg, model::Head::kLm, world);
    ASSERT_EQ(units.size(), static_cast<size_t>(cfg.num_layers + 2));
    int64_t total = 0;
    for (const auto& u : units) {
      EXPECT_EQ(u.padded_numel() % (world * kAlignElements), 0) << u.name();
      for (const auto& p : u.params()) EXPECT_EQ(p.offset % kAlignElements, 0) << p.spec.name;
      // Every element of every parameter lies in exactly one rank's shard.
      std::vector<int64_t> covered(u.params().size(), 0);
      for (int r = 0; r < world; ++r)
        for (const auto& piece : u.pieces(r)) covered[piece.param] += piece.numel;
      for (size_t i = 0; i < covered.size(); ++i) EXPECT_EQ(covered[i], u.params()[i].numel) << u.params()[i].spec.name;
      total += u.numel();
    }
    EXPECT_EQ(total, model::num_parameters(cfg)) << world;
  }
}

TEST(FlatLayout, ShardsReassembleTheParameters) {
  const model::ModelConfig cfg = model::preset("tiny-qwen3");
  const model::NamedTensors named = model::init_weights(cfg, model::Head::kLm, 4, at::kFloat);
  const int world = 3;
  for (const auto& u : model_layouts(cfg, model::Head::kLm, world)) {
    std::vector<at::Tensor> shards;
    for (int r = 0; r < world; ++r) {
      at::Tensor s = at::empty({u.shard_numel()});
      u.fill_shard(r, named, s, "init");
      shards.push_back(s);
    }
    at::Tensor full = at::cat(shards);  // what an all_gather produces
    auto views = u.views(full);
    for (size_t i = 0; i < views.size(); ++i) EXPECT_TRUE(at::equal(views[i], named.at(u.params()[i].spec.name)));
    // Decay masks: no decay on norms and biases; padding zero.
    at::Tensor mask = at::cat({u.decay_mask(0, at::kFloat), u.decay_mask(1, at::kFloat), u.decay_mask(2, at::kFloat)});
    for (size_t i = 0; i < views.size(); ++i) {
      const auto& p = u.params()[i];
      EXPECT_EQ(mask.narrow(0, p.offset, p.numel).sum().item<int64_t>(), p.spec.no_decay ? 0 : p.numel) << p.spec.name;
    }
  }
}

// PyTorch's AdamW, written out for one tensor.
void reference_adamw(at::Tensor& p, at::Tensor& m, at::Tensor& v, const at::Tensor& g, int64_t t, double lr,
                     const AdamWConfig& c, bool decay) {
  if (decay) p.mul_(1 - lr * c.weight_decay);
  m.mul_(c.beta1).add_(g, 1 - c.beta1);
  v.mul_(c.beta2).add_(g * g, 1 - c.beta2);
  const double bc1 = 1 - std::pow(c.beta1, t), bc2 = 1 - std::pow(c.beta2, t);
  p.sub_(lr / bc1 * m / (v.sqrt() / std::sqrt(bc2) + c.eps));
}

TEST(ShardAdamW, ShardedStepsEqualUnshardedAdamW) {
  at::manual_seed(0);
  AdamWConfig c{0.9, 0.95, 1e-8, 0.1};
  at::Tensor full = at::randn({1000});
  at::Tensor mask = (at::arange(1000) % 3 != 0).to(at::kFloat);
  at::Tensor ref = full.clone(), m = at::zeros({1000}), v = at::zeros({1000});
  // Four "ranks", each with its own optimizer over its quarter, two shards per rank (uneven).
  std::vector<at::Tensor> masters, grads;
  std::vector<ShardAdamW> opts;
  for (int r = 0; r < 4; ++r) {
    opts.emplace_back(c);
    for (auto [b, n] : {std::pair<int64_t, int64_t>{r * 250, 101}, {r * 250 + 101, 149}}) {
      masters.push_back(full.narrow(0, b, n).clone());
      grads.push_back(at::zeros({n}));
      opts[r].add(masters.back(), mask.narrow(0, b, n), grads.back());
    }
  }
  for (int t = 1; t <= 5; ++t) {
    at::Tensor g = at::randn({1000});
    const double lr = 1e-2 * t;
    const double clip = t == 3 ? 0.5 : 1.0;  // a clipped step: the optimizer scales the gradients
    int64_t at_ = 0;
    for (auto& gr : grads) {
      gr.copy_(g.narrow(0, at_, gr.numel()));
      at_ += gr.numel();
    }
    for (auto& o : opts) o.step(lr, clip);
    g = g * clip;
    // Decayed and undecayed elements follow the reference separately.
    at::Tensor rd = ref.clone(), md = m.clone(), vd = v.clone();
    reference_adamw(rd, md, vd, g, t, lr, c, true);
    reference_adamw(ref, m, v, g, t, lr, c, false);
    ref = at::where(mask.to(at::kBool), rd, ref);
    at::Tensor sharded = at::cat(masters);
    EXPECT_LT((sharded - ref).abs().max().item<double>(), 1e-6) << "step " << t;
  }
  EXPECT_EQ(opts[0].steps(), 5);
}

TEST(LrSchedule, WarmupThenDecayToTheMinimum) {
  LrSchedule s{"cosine", 4, 14, 0.1};
  EXPECT_DOUBLE_EQ(s.factor(0), 0.25);
  EXPECT_DOUBLE_EQ(s.factor(3), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(4), 1.0);
  EXPECT_NEAR(s.factor(9), 0.55, 1e-12);  // halfway: 0.1 + 0.9 * 0.5
  EXPECT_NEAR(s.factor(14), 0.1, 1e-12);
  EXPECT_NEAR(s.factor(100), 0.1, 1e-12);
  LrSchedule l{"linear", 0, 10, 0.0};
  EXPECT_DOUBLE_EQ(l.factor(0), 1.0);
  EXPECT_DOUBLE_EQ(l.factor(5), 0.5);
  EXPECT_DOUBLE_EQ(l.factor(10), 0.0);
  LrSchedule k{"constant", 2, 10, 0.0};
  EXPECT_DOUBLE_EQ(k.factor(0), 0.5);
  EXPECT_DOUBLE_EQ(k.factor(7), 1.0);
  TrainConfig t;
  t.lr_schedule = "step";
  EXPECT_THROW(LrSchedule::from_config(t), ConfigError);
  EXPECT_DOUBLE_EQ(clip_coefficient(10.0, 1.0), 1.0 / (10.0 + 1e-6));
  EXPECT_DOUBLE_EQ(clip_coefficient(0.5, 1.0), 1.0);
}

TEST(RoleOptions, FromTheJobConfig) {
  RoleConfig role;
  TrainConfig train;
  train.weight_decay = 0.1;
  train.adam_beta2 = 0.999;
  train.max_grad_norm = 0.5;
  const auto o = role_options("actor", role, train, true, model::Head::kLm, at::kCPU);
  EXPECT_EQ(o.compute_dtype, at::kBFloat16);
  EXPECT_DOUBLE_EQ(o.adamw.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(o.adamw.beta2, 0.999);
  EXPECT_DOUBLE_EQ(o.max_grad_norm, 0.5);
  role.replicate = true;
  EXPECT_TRUE(role_options("ref", role, train, false, model::Head::kLm, at::kCPU).replicate);
  try {
    role_options("actor", role, train, true, model::Head::kLm, at::kCPU);
    ADD_FAILURE() << "a trained role was replicated";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("roles.actor.replicate"), std::string::npos) << e.what();
  }
  role.replicate = false;
  role.dtype = "fp8";
  EXPECT_THROW(role_options("critic", role, train, true, model::Head::kValue, at::kCPU), ConfigError);
}

}  // namespace
}  // namespace tiller::zero
