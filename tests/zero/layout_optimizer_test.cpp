#include <cmath>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/model/fp8.h"
#include "tiller/zero/flat_layout.h"
#include "tiller/zero/host_adamw.h"
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

// The host AdamW (optimizer offload) against ATen's fused AdamW, the kernel ShardAdamW runs on the
// device: 4 steps (one clipped, one of tiny gradients), weight decay masked per element, two
// shards cut in uneven chunks and updated by 3 threads, so chunk and thread boundaries cross decay
// runs. The stated tolerance: every element of the parameters and moments within 2e-6 of the
// tensor's largest value (a few fp32 roundings: ATen's CPU kernel forms the first moment as a lerp
// with fused multiply-adds, CUDA's and this one as b1 m + (1 - b1) g).
TEST(HostAdamW, EqualsAtenFusedAdamWWithinFp32Rounding) {
  at::manual_seed(1);
  const AdamWConfig c{0.9, 0.95, 1e-8, 0.1};
  const std::vector<int64_t> sizes{1000, 613};
  HostAdamW host(c, at::kCPU, 3, /*chunk_elements=*/96);
  ShardAdamW device(c);
  std::vector<at::Tensor> masters, grads, compute, host_grads;
  for (int64_t n : sizes) {
    const at::Tensor init = at::randn({n});
    const at::Tensor mask = (at::arange(n) % 7 < 4).to(at::kFloat);  // runs of 4 decayed, 3 not
    masters.push_back(init.clone());
    grads.push_back(at::zeros({n}));
    device.add(masters.back(), mask, grads.back());
    host.master(host.add(n, mask)).copy_(init);
    host_grads.push_back(at::zeros({n}));
    compute.push_back(at::zeros({n}, at::kBFloat16));
  }
  EXPECT_EQ(host.threads(), 3);
  double worst = 0;
  for (int t = 1; t <= 4; ++t) {
    const double lr = 3e-3 * t, clip = t == 2 ? 0.37 : 1.0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      grads[i].copy_(at::randn({sizes[i]}) * (t == 3 ? 1e-6 : 1.0));  // tiny gradients: eps matters
      host_grads[i].copy_(grads[i]);
    }
    device.step(lr, clip);
    host.step(lr, clip, host_grads, compute);
    for (size_t i = 0; i < sizes.size(); ++i) {
      auto rel = [](const at::Tensor& a, const at::Tensor& b) {
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
      };
      EXPECT_LT(rel(host.master(i), masters[i]), 2e-6) << "step " << t << " shard " << i;
      EXPECT_LT(rel(host.exp_avg(i), device.exp_avg(i)), 2e-6) << "step " << t << " shard " << i;
      EXPECT_LT(rel(host.exp_avg_sq(i), device.exp_avg_sq(i)), 2e-6) << "step " << t << " shard " << i;
      worst = std::max({worst, rel(host.master(i), masters[i]), rel(host.exp_avg(i), device.exp_avg(i)),
                        rel(host.exp_avg_sq(i), device.exp_avg_sq(i))});
      // The bf16 copy is the master rounded as Tensor::copy_ rounds it, bit for bit.
      EXPECT_TRUE(at::equal(compute[i], host.master(i).to(at::kBFloat16))) << "step " << t << " shard " << i;
    }
  }
  EXPECT_EQ(host.steps(), 4);
  EXPECT_GT(host.last_timing().total_s, 0);
  std::printf("[host adamw] largest difference from ATen's fused AdamW: %.3g of the largest value\n", worst);
}

// The rounding of the vectorised bf16 store: ties to even, NaN and infinities, as c10::BFloat16.
TEST(HostAdamW, Bf16RoundingMatchesTensorCopy) {
  std::vector<float> values{1.0f, 1.00390625f, 1.01171875f, -2.5f, 65504.0f, 3.0e38f, 1e-40f, -0.0f};
  for (uint32_t bits : {0x3F808000u, 0x3F818000u, 0x7F7FFFFFu, 0x7F800000u, 0xFF800000u, 0x7FC00001u, 0x00008000u})
    values.push_back(*reinterpret_cast<const float*>(&bits));
  const int64_t n = static_cast<int64_t>(values.size());
  // An update that leaves the parameters as they are: zero gradients, zero moments, no decay.
  at::Tensor p = at::tensor(values), g = at::zeros({n}), m = at::zeros({n}), v = at::zeros({n});
  at::Tensor out = at::empty({n}, at::kBFloat16);
  AdamWScalars s = AdamWScalars::make({0.9, 0.95, 1.0, 0.0}, 0.0, 1, 1.0, false);
  adamw_update(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, s,
               out.data_ptr(), RoundedOut::kBFloat16);
  const at::Tensor want = at::tensor(values).to(at::kBFloat16);
  for (int64_t i = 0; i < n; ++i) {
    const float got = out[i].item<float>(), expect = want[i].item<float>();
    if (std::isnan(expect)) EXPECT_TRUE(std::isnan(got)) << i;
    else EXPECT_EQ(got, expect) << i << ": " << values[static_cast<size_t>(i)];
  }
}

// The update is elementwise: how its elements are spread over threads and chunks does not change a
// bit. The reference is adamw_update called once per decay run of each shard; against it, one
// thread with one chunk a shard, and 4 threads sharing chunks of 4 blocks (the threads take
// 64Ki-element blocks as they come), over decay runs of uneven length, 3 steps (one clipped).
TEST(HostAdamW, ThreadsAndChunksDoNotChangeTheResult) {
  at::manual_seed(3);
  const AdamWConfig c{0.9, 0.95, 1e-8, 0.1};
  const std::vector<int64_t> sizes{700001, 262144 + 77};
  const int64_t run = 100003, decayed_len = 60000;  // in each run of 100003: 60000 decayed, then not
  HostAdamW one(c, at::kCPU, 1, /*chunk_elements=*/int64_t{1} << 22);
  HostAdamW four(c, at::kCPU, 4, /*chunk_elements=*/int64_t{1} << 18);
  struct Ref {
    at::Tensor p, m, v, out;
  };
  std::vector<Ref> ref;
  std::vector<at::Tensor> grads, out_one, out_four;
  for (int64_t n : sizes) {
    const at::Tensor init = at::randn({n});
    const at::Tensor mask = (at::arange(n) % run < decayed_len).to(at::kFloat);
    one.master(one.add(n, mask)).copy_(init);
    four.master(four.add(n, mask)).copy_(init);
    ref.push_back({init.clone(), at::zeros({n}), at::zeros({n}), at::zeros({n}, at::kBFloat16)});
    grads.push_back(at::zeros({n}));
    out_one.push_back(at::zeros({n}, at::kBFloat16));
    out_four.push_back(at::zeros({n}, at::kBFloat16));
  }
  for (int t = 1; t <= 3; ++t) {
    const double lr = 1e-3, clip = t == 2 ? 0.5 : 1.0;
    for (auto& g : grads) g.normal_();
    one.step(lr, clip, grads, out_one);
    four.step(lr, clip, grads, out_four);
    for (size_t i = 0; i < sizes.size(); ++i) {
      Ref& r = ref[i];
      for (int64_t b = 0; b < sizes[i]; b += run) {
        for (int part = 0; part < 2; ++part) {
          const int64_t x = b + (part ? decayed_len : 0), y = std::min(sizes[i], part ? b + run : b + decayed_len);
          if (x >= y) continue;
          adamw_update(r.p.data_ptr<float>() + x, grads[i].data_ptr<float>() + x, r.m.data_ptr<float>() + x,
                       r.v.data_ptr<float>() + x, y - x, AdamWScalars::make(c, lr, t, clip, part == 0),
                       static_cast<c10::BFloat16*>(r.out.data_ptr()) + x, RoundedOut::kBFloat16);
        }
      }
    }
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (const HostAdamW* h : {&one, &four}) {
      EXPECT_TRUE(at::equal(h->master(i), ref[i].p)) << h->threads() << " threads, shard " << i;
      EXPECT_TRUE(at::equal(h->exp_avg(i), ref[i].m)) << h->threads() << " threads, shard " << i;
      EXPECT_TRUE(at::equal(h->exp_avg_sq(i), ref[i].v)) << h->threads() << " threads, shard " << i;
    }
    EXPECT_TRUE(at::equal(out_one[i], ref[i].out)) << "shard " << i;
    EXPECT_TRUE(at::equal(out_four[i], ref[i].out)) << "shard " << i;
  }
}

TEST(HostAdamW, RefusesMismatchedShards) {
  HostAdamW host({}, at::kCPU, 1, 64);
  host.add(100, at::ones({100}));
  std::vector<at::Tensor> g{at::zeros({99})}, c{at::zeros({100}, at::kBFloat16)};
  EXPECT_THROW(host.step(1e-3, 1.0, g, c), Error);
  EXPECT_THROW(HostAdamW({}, at::kCPU, 1, 50), Error);  // chunks must be multiples of 32 elements
  EXPECT_GE(default_optimizer_threads(), 1);
}

TEST(LrSchedule, WarmupThenDecayToTheMinimum) {
  LrSchedule s{LrScheduleKind::kCosine, 4, 14, 0.1};
  EXPECT_DOUBLE_EQ(s.factor(0), 0.25);
  EXPECT_DOUBLE_EQ(s.factor(3), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(4), 1.0);
  EXPECT_NEAR(s.factor(9), 0.55, 1e-12);  // halfway: 0.1 + 0.9 * 0.5
  EXPECT_NEAR(s.factor(14), 0.1, 1e-12);
  EXPECT_NEAR(s.factor(100), 0.1, 1e-12);
  LrSchedule l{LrScheduleKind::kLinear, 0, 10, 0.0};
  EXPECT_DOUBLE_EQ(l.factor(0), 1.0);
  EXPECT_DOUBLE_EQ(l.factor(5), 0.5);
  EXPECT_DOUBLE_EQ(l.factor(10), 0.0);
  LrSchedule k{LrScheduleKind::kConstant, 2, 10, 0.0};
  EXPECT_DOUBLE_EQ(k.factor(0), 0.5);
  EXPECT_DOUBLE_EQ(k.factor(7), 1.0);
  TrainConfig t;
  t.lr_schedule = LrScheduleKind::kLinear;
  t.num_steps = 10;
  EXPECT_DOUBLE_EQ(LrSchedule::from_config(t).factor(5), 1.0 - 0.9 * 0.5);  // min_lr_ratio 0.1
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
  // roles.<r>.fp8 and its scaling, each to the model's own.
  EXPECT_FALSE(role_options("actor", role, train, true, model::Head::kLm, at::kCPU).fp8.has_value());
  role.fp8 = true;
  using model::fp8::Scaling;
  for (const auto& [key, scaling] : {std::pair{Fp8Scaling::kBlock, Scaling::kBlock},
                                     std::pair{Fp8Scaling::kChannel, Scaling::kChannel},
                                     std::pair{Fp8Scaling::kTensor, Scaling::kTensor}}) {
    role.fp8_scaling = key;
    EXPECT_EQ(role_options("actor", role, train, true, model::Head::kLm, at::kCPU).fp8, scaling);
  }
  // roles.<r>.fp8_fast_accumulation (the forward's fast accumulation, on by default).
  EXPECT_TRUE(role_options("actor", role, train, true, model::Head::kLm, at::kCPU).fp8_fast_accumulation);
  role.fp8_fast_accumulation = false;
  EXPECT_FALSE(role_options("actor", role, train, true, model::Head::kLm, at::kCPU).fp8_fast_accumulation);
  role.fp8 = false;
  role.dtype = Precision::kFp32;
  EXPECT_EQ(role_options("critic", role, train, true, model::Head::kValue, at::kCPU).compute_dtype, at::kFloat);
  role.optimizer_offload = OptimizerOffload::kCpu;
  EXPECT_THROW(role_options("ref", role, train, false, model::Head::kLm, at::kCPU), ConfigError);
}

}  // namespace
}  // namespace tiller::zero
