// FP8 (e4m3) block and group quantization (model/fp8.h) against e4m3's rounding worked out by hand
// and the documented scales.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>

#include "model/fp8_quotient.h"
#include "model/fp8_rows.h"
#include "model/fp8_train.h"
#include "tiller/core/error.h"
#include "tiller/model/fp8.h"
#include "tiller/model/transformer.h"

namespace tiller::model::fp8 {
namespace {

std::vector<float> values(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous().view(-1);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// The quantization kernels divide by a group's scale through its reciprocal (fp8_quotient.h):
// equal to the division bit for bit, with one correction (what two-byte inputs take) and with two
// (fp32), for every bf16 value and every fp16 value against every 61st amax of its type it fits
// under (the GPU probe, scripts/gpu/fp8_quantize_probe.cu, and a one-off run here went over all of
// them); where the claim does not hold, both quotients are below 2^-12 with the value's sign, an
// e4m3 zero. (Without the corrections, this fails.)
TEST(Fp8, TheReciprocalQuotientEqualsTheDivision) {
  const auto from_bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  const auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  const auto bf16 = [&](uint32_t b) { return from_bits(b << 16); };
  const auto fp16 = [](uint32_t b) {
    return static_cast<float>(c10::Half(static_cast<uint16_t>(b), c10::Half::from_bits()));
  };
  for (const bool half : {false, true}) {
    const uint32_t finite_end = half ? 0x7c00 : 0x7f80;  // the first infinity's bits
    int64_t pairs = 0, exact = 0;
    for (uint32_t a = 1; a < finite_end; a += 61) {
      const float amax = half ? fp16(a) : bf16(a);
      const float s = amax / 448.f;
      if (!(s >= kQuotientMinScale && s <= kQuotientMaxScale)) continue;
      const float r = 1.f / s;
      for (uint32_t vb = 0; vb < 0x10000; vb += 1) {
        const float v = half ? fp16(vb) : bf16(vb);
        if (!(std::fabs(v) <= amax)) continue;
        ++pairs;
        const float want = v / s;
        for (const float got : {quotient_by_reciprocal<1>(v, s, r), quotient_by_reciprocal<2>(v, s, r)}) {
          if (bits(got) == bits(want)) {
            ++exact;
            continue;
          }
          ASSERT_FALSE(std::fabs(v) >= 0x1p-100f && std::fabs(want) >= 0x1p-100f) << "v " << v << " s " << s;
          ASSERT_LT(std::fabs(got), 0x1p-12f) << "v " << v << " s " << s;
          ASSERT_LT(std::fabs(want), 0x1p-12f) << "v " << v << " s " << s;
          ASSERT_EQ(std::signbit(got), std::signbit(v));
        }
      }
    }
    EXPECT_GT(pairs, half ? 5000000 : 10000000);
    EXPECT_GT(exact, 2 * pairs * 99 / 100);
  }
}

// A block whose largest magnitude is 448 has scale 1, so its values are e4m3's own: round to
// nearest, ties to even (3 mantissa bits), subnormals in steps of 2^-9, and 448 the largest.
TEST(Fp8, ABlockOfScaleOneRoundsAsE4m3) {
  const std::vector<float> in = {448.0f, 1.0f, 1.0625f, 1.1875f, 1.125f, -3.3f, 0.0f, std::ldexp(1.0f, -9),
                                 std::ldexp(1.0f, -10), 3 * std::ldexp(1.0f, -10), 17.0f, 19.0f, -240.0f, 232.0f};
  // 1.0625 lies halfway between 1 and 1.125 (to 1: even mantissa); 1.1875 between 1.125 and 1.25
  // (to 1.25); -3.3 between -3.25 and -3.5 (nearer -3.25); 2^-10 halfway to 0 (to 0); 3*2^-10
  // between 2^-9 and 2^-8 (to 2^-8, even); 17 between 16 and 18 (to 16), 19 to 20; 232 between
  // 224 and 240 (to 224, even).
  const std::vector<float> want = {448.0f, 1.0f, 1.0f, 1.25f, 1.125f, -3.25f, 0.0f, std::ldexp(1.0f, -9),
                                   0.0f, std::ldexp(1.0f, -8), 16.0f, 20.0f, -240.0f, 224.0f};
  const QuantizedWeight b = quantize_blocks(at::tensor(in).view({1, -1}));
  EXPECT_EQ(b.q.scalar_type(), at::kFloat8_e4m3fn);
  ASSERT_EQ(b.scale.sizes(), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(b.scale.item<float>(), 1.0f);
  EXPECT_EQ(values(b.q), want);
  EXPECT_EQ(values(dequantize_weight(b, at::kFloat)), want);
}

// Each 128x128 block gets its own scale, amax / 448, so its largest magnitude quantizes to 448
// exactly and every value keeps 3 mantissa bits of its own (relative error at most 2^-4, or 2^-10
// of the scale below e4m3's normal range); edge blocks cover what is left.
TEST(Fp8, EachBlockHasItsOwnScale) {
  at::manual_seed(3);
  const int64_t n = 300, k = 200;  // 3 x 2 blocks, the last row and column partial
  at::Tensor w = at::randn({n, k});
  w.narrow(0, 0, 128).narrow(1, 0, 128).mul_(1000);  // blocks of very different magnitudes
  w.narrow(0, 256, 44).narrow(1, 128, 72).mul_(1e-3);
  w.narrow(0, 128, 128).narrow(1, 128, 72).zero_();  // a block of zeros
  const QuantizedWeight b = quantize_blocks(w);
  ASSERT_EQ(b.scale.sizes(), (std::vector<int64_t>{3, 2}));
  ASSERT_EQ(b.q.sizes(), w.sizes());
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t rows = std::min<int64_t>(128, n - i * 128), cols = std::min<int64_t>(128, k - j * 128);
      const at::Tensor block = w.narrow(0, i * 128, rows).narrow(1, j * 128, cols);
      const float amax = block.abs().max().item<float>();
      const float scale = b.scale[i][j].item<float>();
      if (amax == 0) {
        EXPECT_EQ(scale, 1.0f);
        EXPECT_EQ(b.q.narrow(0, i * 128, rows).narrow(1, j * 128, cols).to(at::kFloat).abs().max().item<float>(), 0);
        continue;
      }
      EXPECT_FLOAT_EQ(scale, amax / 448.0f) << i << "," << j;
      EXPECT_EQ(b.q.narrow(0, i * 128, rows).narrow(1, j * 128, cols).to(at::kFloat).abs().max().item<float>(), 448.0f);
    }
  const at::Tensor d = dequantize_weight(b, at::kFloat);
  const at::Tensor scale_per_value = b.scale.repeat_interleave(128, 0).repeat_interleave(128, 1).narrow(0, 0, n).narrow(1, 0, k);
  const at::Tensor bound = at::maximum(w.abs() * std::ldexp(1.0, -4), scale_per_value * std::ldexp(1.0, -10));
  EXPECT_TRUE(((d - w).abs() <= bound * 1.0001).all().item<bool>());
  EXPECT_EQ(dequantize_weight(b, at::kBFloat16).scalar_type(), at::kBFloat16);
}

// Activations: one scale per token and group of 128 features.
TEST(Fp8, GroupsScaleEachTokensFeaturesApart) {
  at::manual_seed(5);
  at::Tensor x = at::randn({2, 3, 300});
  x[1][2].mul_(100);
  const GroupQuantized g = quantize_groups(x);
  ASSERT_EQ(g.scale.sizes(), (std::vector<int64_t>{2, 3, 3}));
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t j = 0; j < 3; ++j) {
      const int64_t width = std::min<int64_t>(128, 300 - j * 128);
      EXPECT_FLOAT_EQ(g.scale[1][t][j].item<float>(),
                      x[1][t].narrow(0, j * 128, width).abs().max().item<float>() / 448.0f);
    }
  const at::Tensor d = dequantize_groups(g, at::kFloat);
  const at::Tensor s = g.scale.repeat_interleave(128, -1).narrow(-1, 0, 300);
  EXPECT_TRUE(((d - x).abs() <= at::maximum(x.abs() * std::ldexp(1.0, -4), s * std::ldexp(1.0, -10)) * 1.0001)
                  .all()
                  .item<bool>());
}

// Channel scaling: one scale per weight row and per token, amax / 448, each value within e4m3's
// rounding of its row's scale; the emulated GEMM is the product of the dequantized operands.
TEST(Fp8, ChannelScalingScalesEachRowAndEachToken) {
  at::manual_seed(9);
  at::Tensor w = at::randn({40, 300});
  w[3].mul_(1000);
  w[7].zero_();
  const QuantizedWeight b = quantize_channels(w);
  EXPECT_EQ(b.scaling, Scaling::kChannel);
  ASSERT_EQ(b.scale.sizes(), (std::vector<int64_t>{40}));
  ASSERT_EQ(b.q.sizes(), w.sizes());
  EXPECT_EQ(b.q_storage.size(0) % 16, 0);
  EXPECT_EQ(b.q_storage.size(1) % 16, 0);
  for (int64_t r : {0, 3, 39}) EXPECT_FLOAT_EQ(b.scale[r].item<float>(), w[r].abs().max().item<float>() / 448.0f);
  EXPECT_EQ(b.scale[7].item<float>(), 1.0f);
  const at::Tensor d = dequantize_weight(b, at::kFloat);
  const at::Tensor bound = at::maximum(w.abs() * std::ldexp(1.0, -4), b.scale.unsqueeze(1) * std::ldexp(1.0, -10));
  EXPECT_TRUE(((d - w).abs() <= bound * 1.0001).all().item<bool>());
  const at::Tensor x = at::randn({2, 5, 300});
  const GroupQuantized g = quantize_rows(x);
  ASSERT_EQ(g.scale.sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_FLOAT_EQ(g.scale[1][4].item<float>(), x[1][4].abs().max().item<float>() / 448.0f);
  const at::Tensor y = linear_emulated(x, b);
  const at::Tensor want = at::matmul(dequantize_rows(g, at::kFloat), d.t());
  EXPECT_TRUE(at::allclose(y, want, 1e-6, 1e-5));
  // In place, from other values: what a fresh quantization gives.
  QuantizedWeight again = quantize_channels(at::randn({40, 300}));
  quantize_weight_into(w, again);
  EXPECT_TRUE(at::equal(again.scale, b.scale));
  EXPECT_TRUE(at::equal(again.q_storage.view(at::kByte), b.q_storage.view(at::kByte)));
  EXPECT_EQ(parse_scaling("block", "x"), Scaling::kBlock);
  EXPECT_THROW(parse_scaling("row", "x"), ConfigError);
}

// Tensor scaling: one scale for the weight and one per token, amax / 448, every value within
// e4m3's rounding of its scale; the emulated GEMM is the product of the token's codes and the
// dequantized weight, rounded, then times the token's scale plus the bias (rounded again); FP8
// training refuses it.
TEST(Fp8, TensorScalingHasOneScaleForTheWeightAndOneForEachToken) {
  at::manual_seed(13);
  at::Tensor w = at::randn({40, 300});
  w[3][5] = 700.f;
  const QuantizedWeight b = quantize_weight(w, Scaling::kTensor);
  EXPECT_EQ(b.scaling, Scaling::kTensor);
  EXPECT_EQ(b.scale.dim(), 0);
  EXPECT_EQ(b.scale_storage.numel(), 1);
  ASSERT_EQ(b.q.sizes(), w.sizes());
  EXPECT_EQ(b.q_storage.size(0) % 16, 0);
  EXPECT_EQ(b.q_storage.size(1) % 16, 0);
  EXPECT_FLOAT_EQ(b.scale.item<float>(), 700.f / 448.0f);
  EXPECT_EQ(b.q[3][5].to(at::kFloat).item<float>(), 448.0f);
  const at::Tensor d = dequantize_weight(b, at::kFloat);
  const at::Tensor bound = at::maximum(w.abs() * std::ldexp(1.0, -4), b.scale * std::ldexp(1.0, -10));
  EXPECT_TRUE(((d - w).abs() <= bound * 1.0001).all().item<bool>());
  EXPECT_EQ(quantize_weight(at::zeros({4, 16}), Scaling::kTensor).scale.item<float>(), 1.0f);
  // A whole tensor's one scale (what the weight's quantization computes).
  at::Tensor x = at::randn({2, 5, 300});
  x[1][2][9] = -50.f;
  const GroupQuantized whole = quantize_tensor(x);
  EXPECT_EQ(whole.scale.dim(), 0);
  EXPECT_FLOAT_EQ(whole.scale.item<float>(), 50.f / 448.0f);
  // The activations: one scale per token.
  const at::Tensor bias = at::randn({40}).to(at::kBFloat16);
  for (const at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    const at::Tensor xt = x.to(t);
    const GroupQuantized g = quantize_rows(xt);
    EXPECT_FLOAT_EQ(g.scale[1][2].item<float>(), 50.f / 448.0f);
    const at::Tensor y = linear_emulated(xt, b, bias);
    ASSERT_EQ(y.scalar_type(), t);
    const at::Tensor unscaled = at::matmul(g.q.to(at::kFloat), d.t()).to(t);
    const at::Tensor want = (unscaled.to(at::kFloat) * g.scale.unsqueeze(-1) + bias.to(at::kFloat)).to(t);
    EXPECT_TRUE(at::allclose(y.to(at::kFloat), want.to(at::kFloat), t == at::kFloat ? 1e-6 : 8e-3, 1e-5)) << t;
  }
  // A token far larger than the rest no longer coarsens the others: each row is its own.
  const at::Tensor alone = linear_emulated(x[0], b), beside = linear_emulated(x, b)[0];
  EXPECT_TRUE(at::allclose(alone, beside, 1e-6, 1e-6));
  // In place, from other values: what a fresh quantization gives.
  QuantizedWeight again = quantize_weight(at::randn({40, 300}), Scaling::kTensor);
  quantize_weight_into(w, again);
  EXPECT_TRUE(at::equal(again.scale_storage, b.scale_storage));
  EXPECT_TRUE(at::equal(again.q_storage.view(at::kByte), b.q_storage.view(at::kByte)));
  EXPECT_EQ(parse_scaling("tensor", "x"), Scaling::kTensor);
  EXPECT_STREQ(scaling_name(Scaling::kTensor), "tensor");
  EXPECT_THROW(parse_scaling("rows", "x"), ConfigError);
}

// Tensor scaling's pieces (model/fp8_rows.h): the padded row codes, the unscaled product, the
// rows' scales with the bias, each what it says it computes; and the fused norm and SwiGLU equal
// the unfused sequences they name, bit for bit. On the CPU the fused forms are those sequences,
// so here that checks their interface (the scales applied or not, the input left alone); the
// kernels are checked by ModelGpu.Fp8TensorScalingsFusedKernelsEqualTheUnfusedOnesBitForBit.
TEST(Fp8, TensorScalingsFusedPiecesEqualTheirUnfusedSequences) {
  at::manual_seed(21);
  for (const at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(t);
    const int64_t rows = 5, k = 40, n = 24;
    const at::Tensor x = at::randn({rows, k}).to(t);
    const RowCodes c = quantize_row_codes(x);
    ASSERT_EQ(c.q.sizes(), (std::vector<int64_t>{16, 48}));
    ASSERT_EQ(c.scale.sizes(), (std::vector<int64_t>{16}));
    EXPECT_EQ(c.rows, rows);
    EXPECT_EQ(c.k, k);
    const GroupQuantized g = quantize_rows(x);
    EXPECT_TRUE(at::equal(c.q.narrow(0, 0, rows).narrow(1, 0, k).view(at::kByte), g.q.view(at::kByte)));
    EXPECT_EQ(c.q.narrow(1, k, 8).to(at::kFloat).abs().sum().item<float>(), 0.f);
    EXPECT_EQ(c.q.narrow(0, rows, 11).to(at::kFloat).abs().sum().item<float>(), 0.f);
    EXPECT_TRUE(at::equal(c.scale.narrow(0, 0, rows), g.scale));
    EXPECT_TRUE(at::equal(c.scale.narrow(0, rows, 11), at::ones({11})));
    // The unscaled product: the codes times the dequantized weight, once rounded.
    const QuantizedWeight w = quantize_weight(at::randn({n, k}), Scaling::kTensor);
    const at::Tensor y = unscaled_product(c, w, t);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{rows, n}));
    EXPECT_TRUE(at::equal(y, at::matmul(g.q.to(at::kFloat), dequantize_weight(w, at::kFloat).t()).to(t)));
    // The rows' scales and the bias: fp32 product, fp32 sum, one rounding to y's dtype.
    const at::Tensor bias = at::randn({n}).to(t);
    const at::Tensor z = y.clone();
    scale_rows_(z, c.scale, bias);
    EXPECT_TRUE(at::equal(z, (y.to(at::kFloat) * g.scale.unsqueeze(1) + bias.to(at::kFloat)).to(t)));
    // The fused norm against scale_rows_, add_rms_norm, quantize_row_codes; with and without scales.
    const at::Tensor weight = (at::rand({k}) + 0.5).to(t);
    for (const bool scaled : {true, false}) {
      at::Tensor s1 = at::randn({rows, k}).to(t), s2 = s1.clone();
      const at::Tensor add = (at::randn({rows, k}) * 30).to(t), add_scale = at::rand({rows}) * 0.1;
      const RowCodes fused = add_rms_norm_codes(s1, add, scaled ? add_scale : at::Tensor(), weight, 1e-6);
      at::Tensor a = add.clone();
      if (scaled) scale_rows_(a, add_scale);
      const RowCodes want = quantize_row_codes(add_rms_norm(s2, a, weight, 1e-6));
      EXPECT_TRUE(at::equal(s1, s2)) << scaled;
      EXPECT_TRUE(at::equal(fused.q.view(at::kByte), want.q.view(at::kByte))) << scaled;
      EXPECT_TRUE(at::equal(fused.scale, want.scale)) << scaled;
    }
    // The fused SwiGLU against scale_rows_, swiglu_packed, quantize_row_codes; its input kept.
    const at::Tensor gu = (at::randn({rows, 2 * k}) * 20).to(t), before = gu.clone();
    const RowCodes act = swiglu_codes(gu, c.scale);
    const at::Tensor scaled_gu = gu.clone();
    scale_rows_(scaled_gu, c.scale);
    const RowCodes want = quantize_row_codes(swiglu_packed(scaled_gu));
    EXPECT_TRUE(at::equal(gu, before));
    EXPECT_TRUE(at::equal(act.q.view(at::kByte), want.q.view(at::kByte)));
    EXPECT_TRUE(at::equal(act.scale, want.scale));
    // tensor_scaled_linear is the three in a row, for any leading shape.
    const at::Tensor x3 = x.view({1, rows, k});
    EXPECT_TRUE(at::equal(linear(x3, w, bias), z.view({1, rows, n})));
    EXPECT_EQ(linear(at::randn({0, k}).to(t), w).sizes(), (std::vector<int64_t>{0, n}));
  }
  EXPECT_THROW(unscaled_product(quantize_row_codes(at::randn({2, 8})), quantize_weight(at::randn({4, 16}), Scaling::kTensor),
                                at::kFloat),
               ConfigError);
  EXPECT_THROW(unscaled_product(quantize_row_codes(at::randn({2, 16})), quantize_blocks(at::randn({4, 16})), at::kFloat),
               Error);
}

// The emulated FP8 GEMM is the product of the two dequantized operands in fp32, near the exact one.
TEST(Fp8, TheEmulatedLinearIsTheProductOfTheDequantizedOperands) {
  at::manual_seed(7);
  const at::Tensor x = at::randn({5, 256}), w = at::randn({96, 256});
  const QuantizedWeight b = quantize_blocks(w);
  const at::Tensor y = linear_emulated(x, b);
  const at::Tensor want = at::matmul(dequantize_groups(quantize_groups(x), at::kFloat), dequantize_weight(b, at::kFloat).t());
  EXPECT_TRUE(at::allclose(y, want, 1e-6, 1e-5));
  // Against the unquantized product: each operand's relative error is at most 2^-4.
  const at::Tensor exact = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
  const double rel = ((y.to(at::kDouble) - exact).norm() / exact.norm()).item<double>();
  EXPECT_LT(rel, 0.06);
  EXPECT_GT(rel, 1e-4);  // it is quantized
  EXPECT_EQ(linear_emulated(x.to(at::kBFloat16), b).scalar_type(), at::kBFloat16);
  EXPECT_THROW(linear_emulated(at::randn({2, 100}), b), ConfigError);
  EXPECT_THROW(quantize_blocks(at::randn({2, 3, 4})), ConfigError);
  EXPECT_THROW(quantize_blocks(w, 0), ConfigError);
}

// FP8 training's linear (train_linear): its output and both gradients are the scaled products of
// the recipe's operands (block: x in groups, w in blocks; gy in groups, w^T in blocks; gy^T and
// x^T in groups of tokens; channel: rows everywhere; tensor: one scale per operand), each near the
// exact product, and the bias gradient is the output gradient's sum.
TEST(Fp8, TrainLinearsGemmsAreTheRecipesScaledProducts) {
  at::manual_seed(11);
  const at::Tensor x0 = at::randn({37, 200}), w0 = at::randn({96, 200}) * 0.05, b0 = at::randn({96});
  const at::Tensor gy = at::randn({37, 96});
  for (const Scaling s : {Scaling::kBlock, Scaling::kChannel, Scaling::kTensor}) {
    const bool block = s == Scaling::kBlock;
    const Operand act = block ? Operand::kGroups : s == Scaling::kTensor ? Operand::kTensor : Operand::kRows;
    const Operand wt = block ? Operand::kBlocks : act;
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
               b = b0.clone().requires_grad_(true);
    const at::Tensor y = train_linear(x, w, b, s);
    y.backward(gy);
    EXPECT_TRUE(at::equal(y.detach(), scaled_product(x0, w0, act, wt, at::kFloat, b0)));
    EXPECT_TRUE(at::equal(x.grad(), scaled_product(gy, w0.t(), act, wt, at::kFloat)));
    EXPECT_TRUE(at::equal(w.grad(), scaled_product(gy.t(), x0.t(), act, act, at::kFloat)));
    EXPECT_TRUE(at::allclose(b.grad(), gy.sum(0), 1e-6, 1e-5));
    // Each within FP8's error of the exact product (two operands of relative error <= 2^-4 each),
    // and quantized (not the exact product itself).
    auto rel = [](const at::Tensor& got, const at::Tensor& want) {
      return ((got.to(at::kDouble) - want.to(at::kDouble)).norm() / want.to(at::kDouble).norm()).item<double>();
    };
    for (const auto& [got, want] : {std::pair{y.detach(), at::addmm(b0, x0, w0.t())},
                                    std::pair{x.grad(), at::matmul(gy, w0)}, std::pair{w.grad(), at::matmul(gy.t(), x0)}}) {
      EXPECT_LT(rel(got, want), 0.06) << scaling_name(s);
      EXPECT_GT(rel(got, want), 1e-4) << scaling_name(s);
    }
  }
  // A frozen weight (a LoRA base) gets no gradient; the input still does.
  at::Tensor x = x0.clone().requires_grad_(true);
  train_linear(x, w0, {}, Scaling::kBlock).backward(gy);
  EXPECT_TRUE(at::equal(x.grad(), scaled_product(gy, w0.t(), Operand::kGroups, Operand::kBlocks, at::kFloat)));
  EXPECT_THROW(train_linear(at::randn({2, 100}), w0, {}, Scaling::kBlock), ConfigError);
  // Shared codes are the GPU's (model/fp8_train.h): on the CPU train_input is empty, train_swiglu
  // declines, and train_linear quantizes x itself, as without them.
  const at::Tensor xb = x0.to(at::kBFloat16), wb = w0.to(at::kBFloat16);
  const TrainInput none = train_input(xb, Scaling::kTensor, true);
  EXPECT_FALSE(none.defined());
  TrainInput act_in;
  EXPECT_FALSE(train_swiglu(xb, wb, wb, none, act_in, true).defined());
  EXPECT_FALSE(act_in.defined());
  at::Tensor xs = xb.clone().requires_grad_(true), xp = xb.clone().requires_grad_(true);
  train_linear(xs, wb, {}, Scaling::kTensor, none).backward(gy.to(at::kBFloat16));
  train_linear(xp, wb, {}, Scaling::kTensor).backward(gy.to(at::kBFloat16));
  EXPECT_TRUE(at::equal(xs.grad(), xp.grad()));
}

// scaled_product's operands: a transposed view is quantized as its contiguous copy; the recipe's
// combinations only; an empty contraction gives zeros (and the bias).
TEST(Fp8, ScaledProductTakesTransposedViewsAndRefusesOtherCombinations) {
  at::manual_seed(12);
  const at::Tensor a = at::randn({300, 20}), b = at::randn({300, 48});
  EXPECT_TRUE(at::equal(scaled_product(a.t(), b.t(), Operand::kGroups, Operand::kGroups, at::kFloat),
                        scaled_product(a.t().contiguous(), b.t().contiguous(), Operand::kGroups, Operand::kGroups,
                                       at::kFloat)));
  const at::Tensor q = scaled_product(a.t(), b.t(), Operand::kGroups, Operand::kBlocks, at::kBFloat16);
  EXPECT_EQ(q.scalar_type(), at::kBFloat16);
  EXPECT_EQ(q.sizes(), (std::vector<int64_t>{20, 48}));
  EXPECT_THROW(scaled_product(a, a, Operand::kBlocks, Operand::kGroups, at::kFloat), Error);
  EXPECT_THROW(scaled_product(a, a, Operand::kRows, Operand::kGroups, at::kFloat), Error);
  EXPECT_THROW(scaled_product(a, b, Operand::kRows, Operand::kRows, at::kFloat), Error);
  EXPECT_THROW(scaled_product(a, a, Operand::kTensor, Operand::kGroups, at::kFloat), Error);
  EXPECT_THROW(scaled_product(a, a, Operand::kRows, Operand::kTensor, at::kFloat), Error);
  // Tensor scaling: one scale over the operand, whatever its layout; the product of the two
  // dequantized operands.
  const at::Tensor tt = scaled_product(a.t(), b.t(), Operand::kTensor, Operand::kTensor, at::kFloat);
  EXPECT_TRUE(at::equal(tt, scaled_product(a.t().contiguous(), b.t().contiguous(), Operand::kTensor, Operand::kTensor,
                                           at::kFloat)));
  EXPECT_TRUE(at::equal(tt, at::matmul(dequantize_tensor(quantize_tensor(a.t()), at::kFloat),
                                       dequantize_tensor(quantize_tensor(b.t()), at::kFloat).t())));
  // Its scales given (what train_linear passes on): the same product; tensor_scale is
  // quantize_tensor's scale; a given scale is one value, for a tensor-scaled operand.
  EXPECT_TRUE(at::equal(tensor_scale(a), quantize_tensor(a).scale));
  EXPECT_TRUE(at::equal(tt, scaled_product(a.t(), b.t(), Operand::kTensor, Operand::kTensor, at::kFloat, {}, false,
                                           tensor_scale(a), tensor_scale(b))));
  EXPECT_THROW(scaled_product(a, a, Operand::kGroups, Operand::kGroups, at::kFloat, {}, false, tensor_scale(a)), Error);
  EXPECT_THROW(scaled_product(a, a, Operand::kTensor, Operand::kTensor, at::kFloat, {}, false, at::ones({2})), Error);
  EXPECT_EQ(tensor_scale(at::zeros({0, 4})).item<float>(), 1.f);
  const at::Tensor bias = at::randn({48});
  EXPECT_TRUE(at::equal(scaled_product(at::zeros({3, 0}), at::zeros({48, 0}), Operand::kGroups, Operand::kBlocks,
                                       at::kFloat, bias),
                        bias.expand({3, 48})));
}

}  // namespace
}  // namespace tiller::model::fp8
