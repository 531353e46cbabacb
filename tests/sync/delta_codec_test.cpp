// Delta weight sync's bucket encoding (src/sync/delta_codec.h) on real training deltas: a tiny
// model trained with AdamW for 10 steps, its bf16 weights synced after each one as one bucket.
// Every decoded bucket must equal the trainer's bytes, bit for bit; a damaged payload or a copy
// that is not the delta's base must be refused with the copy left as it was, and a full resend
// must then restore it.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "sync/delta_codec.h"
#include "tiller/model/model_config.h"
#include "tiller/model/transformer.h"
#include "tiller/model/weights.h"

namespace tiller::sync {
namespace {

// The model's parameters, cast to bf16 and laid end to end: what one sync bucket holds.
std::vector<uint8_t> bf16_bytes(const model::NamedTensors& named) {
  std::vector<uint8_t> out;
  for (const auto& [name, t] : named) {
    const at::Tensor b = t.detach().to(at::kBFloat16).contiguous();
    const auto* p = static_cast<const uint8_t*>(b.data_ptr());
    out.insert(out.end(), p, p + b.numel() * 2);
  }
  return out;
}

// Tiny Qwen2 trained by AdamW (`lr`) on a next-token loss over random sequences.
struct Trainer {
  double lr = 1e-3;
  model::ModelConfig cfg = model::preset("tiny-qwen2");
  model::NamedTensors named;
  model::ModelWeights w;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> moments;
  int64_t t = 0;

  explicit Trainer(double learning_rate = 1e-3) : lr(learning_rate) {
    named = model::init_weights(cfg, model::Head::kLm, 4, at::kFloat);
    for (auto& [name, p] : named) p.requires_grad_(true);
    w = model::bind_weights(cfg, named, model::Head::kLm, "tiny");
  }

  void step() {
    at::manual_seed(100 + t);
    std::vector<std::vector<int64_t>> seqs;
    for (int s = 0; s < 4; ++s) {
      const at::Tensor ids = at::randint(cfg.vocab_size, {24}, at::kLong);
      seqs.emplace_back(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + 24);
    }
    const model::PackedBatch batch = model::PackedBatch::pack(seqs, at::kCPU);
    const at::Tensor h = model::forward_hidden(cfg, w, batch);
    const at::Tensor targets = at::roll(batch.tokens, -1);
    const at::Tensor loss = -model::token_logprobs(h, w.lm_head, targets).mean();
    loss.backward();
    ++t;
    c10::AutoGradMode no_grad(false);
    for (auto& [name, p] : named) {
      if (!p.grad().defined()) continue;
      auto& [m, v] = moments[name];
      if (!m.defined()) {
        m = at::zeros_like(p);
        v = at::zeros_like(p);
      }
      const at::Tensor g = p.grad();
      m.mul_(0.9).add_(g, 0.1);
      v.mul_(0.999).addcmul_(g, g, 0.001);
      const double c1 = 1 - std::pow(0.9, t), c2 = 1 - std::pow(0.999, t);
      p.mul_(1 - lr * 0.01).sub_(lr * (m / c1) / ((v / c2).sqrt() + 1e-8));
      p.grad().zero_();
    }
  }
};

// `lr` 1e-3 moves nearly every bf16 weight of the tiny model (initialised at std 0.02) each step;
// 1e-6, an RL learning rate, moves few: a weight's bf16 changes when its fp32 master has drifted a
// rounding step, so the deltas are sparse and small.
void ten_syncs(double lr, double most_changed, double largest_payload) {
  Trainer tr(lr);
  std::vector<uint8_t> engine = bf16_bytes(tr.named);  // the engine's copy: the first sync, in full
  {
    const EncodedBucket full = encode_bucket(engine.data(), nullptr, engine.size());
    std::vector<uint8_t> fresh(engine.size(), 0xAB);
    decode_bucket(full, fresh.data(), fresh.size(), 2);
    ASSERT_EQ(fresh, engine);
    EXPECT_EQ(full.form, DeltaForm::kFull);
  }
  std::vector<uint8_t> base = engine;
  for (int s = 0; s < 10; ++s) {
    tr.step();
    const std::vector<uint8_t> next = bf16_bytes(tr.named);
    const EncodedBucket e = encode_bucket(next.data(), base.data(), next.size());
    decode_bucket(e, engine.data(), engine.size(), 2);
    ASSERT_EQ(engine, next) << "sync " << s + 1;
    const EncodedBucket full = encode_bucket(next.data(), nullptr, next.size());
    EXPECT_LE(static_cast<double>(e.changed), most_changed * static_cast<double>(next.size() / 2)) << "sync " << s + 1;
    EXPECT_LT(static_cast<double>(e.payload.size()), largest_payload * static_cast<double>(next.size()))
        << "sync " << s + 1;
    EXPECT_LT(e.payload.size(), full.payload.size());
    std::printf("lr %g, sync %d: %llu of %zu elements changed; %s %zu bytes, full %zu, raw %zu\n", lr, s + 1,
                static_cast<unsigned long long>(e.changed), next.size() / 2, delta_form_name(e.form),
                e.payload.size(), full.payload.size(), next.size());
    base = next;
  }
}

TEST(DeltaCodec, TenSyncsOfTrainingDeltasDecodeToTheTrainersBytes) {
  ten_syncs(1e-3, 1.0, 0.75);
  ten_syncs(1e-6, 0.05, 0.1);
}

// The smaller form is sent: with a few scattered changes (frozen layers, a tiny step), the index
// list beats the XOR's zero runs; a bucket that did not change costs a few bytes.
TEST(DeltaCodec, FewChangesTakeTheSparseFormAndNoneTakeAlmostNothing) {
  at::manual_seed(7);
  const at::Tensor w = at::randn({1 << 15}).to(at::kBFloat16);
  const auto* p = static_cast<const uint8_t*>(w.data_ptr());
  const std::vector<uint8_t> base(p, p + w.numel() * 2);
  for (const double share : {0.001, 0.01, 0.3}) {
    std::vector<uint8_t> next = base;
    const at::Tensor picks = at::randperm(w.numel(), at::kLong).slice(0, 0, static_cast<int64_t>(share * w.numel()));
    for (int64_t k = 0; k < picks.numel(); ++k) next[static_cast<size_t>(picks[k].item<int64_t>()) * 2] ^= 0x5;
    const EncodedBucket e = encode_bucket(next.data(), base.data(), next.size());
    DeltaOptions xor_only;
    xor_only.sparse_below = 0;
    const EncodedBucket x = encode_bucket(next.data(), base.data(), next.size(), xor_only);
    EXPECT_EQ(e.changed, static_cast<uint64_t>(picks.numel()));
    EXPECT_EQ(x.form, DeltaForm::kXor);
    EXPECT_LE(e.payload.size(), x.payload.size()) << share;
    if (share < 0.01) EXPECT_EQ(e.form, DeltaForm::kSparse) << share;
    if (share > 0.25) EXPECT_EQ(e.form, DeltaForm::kXor) << share;  // not tried past sparse_below
    std::vector<uint8_t> copy = base;
    decode_bucket(e, copy.data(), copy.size(), 2);
    EXPECT_EQ(copy, next) << share;
    std::printf("%.3f of the elements changed: xor %zu bytes, sparse form %s, %zu bytes of %zu\n", share,
                x.payload.size(), delta_form_name(e.form), e.payload.size(), next.size());
  }
  const EncodedBucket same = encode_bucket(base.data(), base.data(), base.size());
  EXPECT_EQ(same.changed, 0u);
  EXPECT_LT(same.payload.size(), 64u);
  std::vector<uint8_t> copy = base;
  decode_bucket(same, copy.data(), copy.size(), 2);
  EXPECT_EQ(copy, base);
}

TEST(DeltaCodec, ADamagedPayloadOrAnotherBaseIsRefusedAndAFullResendRestores) {
  Trainer tr;
  const std::vector<uint8_t> base = bf16_bytes(tr.named);
  tr.step();
  const std::vector<uint8_t> next = bf16_bytes(tr.named);
  EncodedBucket e = encode_bucket(next.data(), base.data(), next.size());
  // A byte flipped in the compressed payload.
  std::vector<uint8_t> copy = base;
  EncodedBucket bad = e;
  bad.payload[bad.payload.size() / 2] ^= 0x40;
  EXPECT_THROW(decode_bucket(bad, copy.data(), copy.size(), 2), DeltaMismatch);
  EXPECT_EQ(copy, base);
  // The hash the sender claims for the result is not what the delta gives.
  bad = e;
  bad.hash ^= 1;
  EXPECT_THROW(decode_bucket(bad, copy.data(), copy.size(), 2), DeltaMismatch);
  EXPECT_EQ(copy, base);
  // A copy that drifted from the base (one weight of the engine's differs).
  std::vector<uint8_t> drifted = base;
  drifted[10] ^= 0x2;
  const std::vector<uint8_t> before = drifted;
  try {
    decode_bucket(e, drifted.data(), drifted.size(), 2);
    FAIL() << "a delta applied to a copy that is not its base";
  } catch (const DeltaMismatch& m) {
    EXPECT_NE(std::string(m.what()).find("is not the one the delta was made against"), std::string::npos) << m.what();
  }
  EXPECT_EQ(drifted, before);
  // The sender's answer to a mismatch: the bucket in full.
  decode_bucket(encode_bucket(next.data(), nullptr, next.size()), drifted.data(), drifted.size(), 2);
  EXPECT_EQ(drifted, next);
  // An encoding for a bucket of another size.
  std::vector<uint8_t> small(64, 0), small_next(64, 0);
  small_next[62] = 1;
  const EncodedBucket sp = encode_bucket(small_next.data(), small.data(), small.size());
  ASSERT_EQ(sp.form, DeltaForm::kSparse);
  std::vector<uint8_t> tiny(32, 0);
  EXPECT_THROW(decode_bucket(sp, tiny.data(), tiny.size(), 2), DeltaMismatch);  // a bucket of another size
}

TEST(DeltaCodec, SizesAndOptionsOutOfBoundsAreRefused) {
  std::vector<uint8_t> b(6);
  EXPECT_THROW(encode_bucket(b.data(), nullptr, 5), ConfigError);  // not whole bf16 elements
  DeltaOptions o;
  o.element_bytes = 3;
  EXPECT_THROW(encode_bucket(b.data(), nullptr, 6, o), ConfigError);
  o = {};
  o.zstd_level = 0;
  EXPECT_THROW(encode_bucket(b.data(), nullptr, 6, o), ConfigError);
  EncodedBucket e = encode_bucket(b.data(), nullptr, 6);
  e.form = static_cast<DeltaForm>(7);
  EXPECT_THROW(decode_bucket(e, b.data(), 6, 2), DeltaMismatch);
  // FP8 and fp32 buckets round-trip with their element sizes.
  for (int size : {1, 4}) {
    o = {};
    o.element_bytes = size;
    std::vector<uint8_t> x(48), y(48);
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<uint8_t>(i * 7);
      y[i] = static_cast<uint8_t>(i * 7 + (i % 5 == 0));
    }
    const EncodedBucket d = encode_bucket(y.data(), x.data(), x.size(), o);
    decode_bucket(d, x.data(), x.size(), size);
    EXPECT_EQ(x, y) << size << "-byte elements";
  }
}

}  // namespace
}  // namespace tiller::sync
