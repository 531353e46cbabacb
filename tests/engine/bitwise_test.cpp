// algo.logprob_match = bitwise (Numerics::kBatchInvariant): every log-prob the engine reports
// equals, bit for bit, the trainer's forward of the same tokens with the same weights, whatever
// the batch on either side; and the batch-invariant kernels themselves. The trainer's sharded side
// (ZeRO-3 at np 1/2/4, SP 2, recompute modes) is tests/mpi/zero_test.cpp's
// BitwiseLogprobsEqualTheEnginesAtAnyWorldSpAndPacking.
#include "engine_fixture.h"

#include <torch/csrc/autograd/autograd.h>

#include "model/batch_invariant.h"
#include "tiller/model/sampling.h"
#include "tiller/model/numerics.h"

#ifdef TILLER_HAVE_CUDA_KERNELS
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/paged_attention.h"
#endif

namespace tiller::engine {
namespace {

using model::Numerics;
using model::ScopedNumerics;

TinyModel in_dtype(const std::string& preset, at::ScalarType dtype, uint64_t seed = 1, const std::string& device = "cpu",
                   int64_t layers = 0) {
  TinyModel m;
  if (layers > 0) {  // a real model's shapes with fewer blocks
    m.cfg = model::preset(preset);
    m.cfg.num_layers = layers;
    m.cfg.initializer_range = 0.25;
    m.named = model::init_weights(m.cfg, model::Head::kLm, seed, at::kFloat);
  } else {
    m = tiny(preset, seed);
  }
  for (auto& [name, t] : m.named) t = t.to(at::Device(device), dtype);
  m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, preset);
  return m;
}

struct EngineRun {
  std::map<std::pair<uint64_t, int64_t>, SampleOutput> out;
  std::vector<std::vector<int64_t>> prompts;
  std::map<uint64_t, float> temperature;  // of each request's reported log-probs
  EngineStats stats;
};

// A busy engine: prompts of 1-40 tokens with 1-3 samples each, greedy and sampled rows (top-k,
// top-p) in one batch, chunked prefills (24 tokens a step), a cache too small for everything
// (preemption and recompute), and asynchronous scheduling.
EngineRun busy_engine(const TinyModel& m, bool async, const std::string& device = "cpu") {
  EngineRun r;
  r.prompts = prompts(14, 5, m.cfg.vocab_size, 40);
  EngineOptions o = small_options(20);
  o.limits.max_num_seqs = 6;
  o.async_scheduling = async;
  o.device = device;
  Engine e(m.cfg, m.weights, o);
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    SamplingParams p;
    p.greedy = i % 4 == 0;
    p.temperature = 0.8f;
    p.top_k = i % 4 == 1 ? 30 : 0;
    p.top_p = i % 4 == 2 ? 0.9f : 1.0f;
    p.seed = 11 * i + 3;
    p.max_new_tokens = 4 + static_cast<int64_t>(i % 5) * 5;
    r.temperature[i] = p.greedy ? 1.0f : 0.8f;
    e.add({i, r.prompts[i], p, 1 + static_cast<int64_t>(i % 3)});
  }
  r.out = run_all(e);
  r.stats = e.stats();
  return r;
}

// The trainer's log-probs of every sample's generated tokens with the samples packed `per_batch`
// at a time (0: all in one batch) in a shuffled order, the head computed `chunk_rows` rows at a
// time. Keyed like the engine's outputs.
std::map<std::pair<uint64_t, int64_t>, std::vector<float>> trainer_side(const TinyModel& m, const EngineRun& r,
                                                                        size_t per_batch, int64_t chunk_rows,
                                                                        uint64_t shuffle,
                                                                        const std::string& device = "cpu") {
  const at::Device dev(device);
  c10::AutoGradMode no_grad(false);
  std::vector<std::pair<uint64_t, int64_t>> keys;
  for (const auto& [key, o] : r.out) keys.push_back(key);
  std::shuffle(keys.begin(), keys.end(), std::mt19937_64(shuffle));
  if (per_batch == 0) per_batch = keys.size();
  std::map<std::pair<uint64_t, int64_t>, std::vector<float>> got;
  for (size_t b = 0; b < keys.size(); b += per_batch) {
    const size_t end = std::min(keys.size(), b + per_batch);
    std::vector<std::vector<int64_t>> seqs;
    std::vector<int64_t> rows, targets;
    std::vector<float> temps;
    int64_t offset = 0;
    for (size_t i = b; i < end; ++i) {
      const auto& prompt = r.prompts[keys[i].first];
      const auto& gen = r.out.at(keys[i]).tokens;
      std::vector<int64_t> seq = prompt;
      seq.insert(seq.end(), gen.begin(), gen.end());
      for (size_t j = 0; j < gen.size(); ++j) {
        rows.push_back(offset + static_cast<int64_t>(prompt.size() + j) - 1);
        targets.push_back(gen[j]);
      }
      offset += static_cast<int64_t>(seq.size());
      seqs.push_back(std::move(seq));
    }
    const at::Tensor h = model::forward_hidden(m.cfg, m.weights, model::PackedBatch::pack(seqs, dev))
                             .index_select(0, at::tensor(rows, at::kLong).to(dev));
    // One head pass per temperature the batch holds (greedy rows report temperature 1).
    const at::Tensor tgt = at::tensor(targets, at::kLong).to(dev);
    const at::Tensor at08 = model::token_logprobs(h, m.weights.lm_head, tgt, 0.8, chunk_rows).cpu();
    const at::Tensor at1 = model::token_logprobs(h, m.weights.lm_head, tgt, 1.0, chunk_rows).cpu();
    int64_t row = 0;
    for (size_t i = b; i < end; ++i) {
      const at::Tensor& lp = r.temperature.at(keys[i].first) == 1.0f ? at1 : at08;
      auto& v = got[keys[i]];
      for (size_t j = 0; j < r.out.at(keys[i]).tokens.size(); ++j, ++row) v.push_back(lp[row].item<float>());
    }
  }
  return got;
}

// Tokens whose engine log-prob differs from the trainer's in any bit.
int64_t differing(const EngineRun& r, const std::map<std::pair<uint64_t, int64_t>, std::vector<float>>& trainer,
                  int64_t* total = nullptr) {
  int64_t n = 0, all = 0;
  for (const auto& [key, o] : r.out) {
    const auto& t = trainer.at(key);
    EXPECT_EQ(t.size(), o.logprobs.size());
    for (size_t j = 0; j < std::min(t.size(), o.logprobs.size()); ++j, ++all)
      n += std::memcmp(&t[j], &o.logprobs[j], sizeof(float)) != 0;
  }
  if (total) *total = all;
  return n;
}

struct Case {
  const char* preset;
  at::ScalarType dtype;
  const char* name;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Bitwise : public ::testing::TestWithParam<Case> {};

TEST_P(Bitwise, EngineLogprobsEqualTheTrainersForEveryBatchAndPacking) {
  ScopedNumerics bitwise(Numerics::kBatchInvariant);
  const TinyModel m = in_dtype(GetParam().preset, GetParam().dtype);
  for (const bool async : {false, true}) {
    const EngineRun r = busy_engine(m, async);
    EXPECT_GT(r.stats.preemptions, 0) << "the cache was meant to be too small";
    int64_t total = 0;
    EXPECT_EQ(differing(r, trainer_side(m, r, 1, 1024, 1), &total), 0) << "each sample alone, async " << async;
    EXPECT_EQ(differing(r, trainer_side(m, r, 0, 7, 2)), 0) << "all packed, 7-row head chunks, async " << async;
    EXPECT_EQ(differing(r, trainer_side(m, r, 5, 3, 3)), 0) << "5 a batch, async " << async;
    EXPECT_GT(total, 150);
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, Bitwise,
                         ::testing::Values(Case{"tiny-qwen2", at::kBFloat16, "qwen2_bf16"},
                                           Case{"tiny-qwen2", at::kFloat, "qwen2_fp32"},
                                           Case{"tiny-qwen3", at::kBFloat16, "qwen3_qk_norm_bf16"},
                                           Case{"tiny-llama", at::kBFloat16, "llama_bf16"},
                                           Case{"tiny-mistral", at::kBFloat16, "mistral_window_bf16"},
                                           Case{"tiny-qwen3-moe", at::kBFloat16, "qwen3_moe_bf16"},
                                           Case{"tiny-qwen2-moe", at::kBFloat16, "qwen2_moe_shared_bf16"}),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// Without the mode the same comparison finds differences (bf16): what the mode is for.
TEST(Bitwise, TheDefaultKernelsDifferInBf16) {
  const TinyModel m = in_dtype("tiny-qwen2", at::kBFloat16);
  const EngineRun r = busy_engine(m, false);
  int64_t total = 0;
  const int64_t n = differing(r, trainer_side(m, r, 0, 7, 2), &total);
  std::printf("[bitwise] default kernels, bf16: %lld of %lld log-probs differ\n", static_cast<long long>(n),
              static_cast<long long>(total));
  EXPECT_GT(n, 0);
}

// The engine's other paths in the mode, to the bit: a session resumed for the next turn equals a
// fresh request, asynchronous scheduling equals synchronous, and after a weight update mid-sample
// each token's log-prob is its version's trainer log-prob.
TEST(Bitwise, SessionsAsyncSchedulingAndWeightUpdatesAreExact) {
  ScopedNumerics bitwise(Numerics::kBatchInvariant);
  check_sessions("cpu", 0.0);
  const TinyModel m = tiny("tiny-qwen2");
  expect_async_equals_sync(m, m.weights, "cpu", 0.0);
  check_weight_update_under_load("cpu", 0.0);
}

// The kernels: a row's result does not depend on the rows beside it, and stays within rounding of
// the ordinary kernel; the gradients are the ordinary ones.
TEST(Bitwise, KernelRowsDoNotDependOnTheirNeighbours) {
  at::manual_seed(3);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = at::randn({37, 72}).to(dtype), w = at::randn({45, 72}).to(dtype), b = at::randn({45}).to(dtype);
    const at::Tensor all = model::invariant::linear(x, w, b);
    for (const int64_t r : {0, 5, 36}) {
      EXPECT_TRUE(at::equal(all[r], model::invariant::linear(x.narrow(0, r, 1), w, b)[0])) << "row " << r;
      EXPECT_TRUE(at::equal(all.narrow(0, r, 1), model::invariant::linear(x.narrow(0, 0, r + 1), w, b).narrow(0, r, 1)));
    }
    const double tol = dtype == at::kFloat ? 1e-4 : 0.1;
    EXPECT_LT((all.to(at::kFloat) - at::linear(x, w, b).to(at::kFloat)).abs().max().item<double>(), tol);
    const at::Tensor nw = at::rand({72}).to(dtype);
    const at::Tensor n = model::invariant::rms_norm(x, nw, 1e-6);
    EXPECT_TRUE(at::equal(n[4], model::invariant::rms_norm(x.narrow(0, 4, 1), nw, 1e-6)[0]));
    EXPECT_LT((n.to(at::kFloat) - at::rms_norm(x, {72}, nw, 1e-6).to(at::kFloat)).abs().max().item<double>(),
              dtype == at::kFloat ? 1e-5 : 0.05);
  }
  // The value head in the mode (a critic's, a reward model's): each row's value alone, where the
  // ordinary matmul's rows change with the number of rows.
  {
    ScopedNumerics bitwise(Numerics::kBatchInvariant);
    const at::Tensor h = at::randn({37, 72}), score = at::randn({1, 72});
    const at::Tensor all = model::values(h, score);
    for (const int64_t r : {0, 5, 17, 36})
      EXPECT_TRUE(at::equal(all[r], model::values(h.narrow(0, r, 1), score)[0])) << "value row " << r;
    EXPECT_LT((all - at::matmul(h, score.t()).squeeze(-1)).abs().max().item<double>(), 1e-4);
  }
  // Gradients in fp64: the ordinary formulas.
  const at::Tensor x = at::randn({6, 8}, at::kDouble).requires_grad_(),
                   w = at::randn({5, 8}, at::kDouble).requires_grad_(), b = at::randn({5}, at::kDouble).requires_grad_();
  const at::Tensor g = at::randn({6, 5}, at::kDouble);
  auto grads = [&](const at::Tensor& y) { return torch::autograd::grad({y}, {x, w, b}, {g}); };
  const auto got = grads(model::invariant::linear(x, w, b)), want = grads(at::linear(x, w, b));
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(at::allclose(got[i], want[i], 1e-10, 1e-12)) << "gradient " << i;
  // Attention over the keys in order: the last query of a sequence equals a decode step over the
  // same keys (one query, the rest as cache).
  const at::Tensor q = at::randn({9, 4, 8}), k = at::randn({9, 2, 8}), v = at::randn({9, 2, 8});
  const auto cu = at::tensor(std::vector<int32_t>{0, 9}, at::kInt);
  const at::Tensor full = model::invariant::attention_forward(q, k, v, model::VarlenSpec::self(cu, {9}), 0.3);
  model::VarlenSpec decode;
  decode.lens_q = {1};
  decode.lens_k = {9};
  const at::Tensor step = model::invariant::attention_forward(q.narrow(0, 8, 1), k, v, decode, 0.3);
  EXPECT_TRUE(at::equal(full[8], step[0]));
}

// --- CUDA (gpu label; the GPU build): the same properties with the CUDA kernels ---

// The CUDA kernels: a row's result does not depend on the rows beside it (the matmul at M from 1
// to 3000 and over a subset of the weight's rows; RMSNorm; the router softmax; the log-prob head
// at per-row temperatures), stays within rounding of the ordinary kernel, and a prefill's queries
// equal decode steps over the same keys.
TEST(EngineGpu, BitwiseKernelRowsDoNotDependOnTheirNeighbours) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  ScopedNumerics bitwise(Numerics::kBatchInvariant);
  at::manual_seed(3);
  const at::Device cuda(at::kCUDA, 0);
  for (const auto dtype : {at::kBFloat16, at::kFloat}) {
    for (const int64_t k : {64, 896, 4864}) {
      const at::Tensor x = at::randn({3000, k}, cuda).to(dtype), w = at::randn({200, k}, cuda).to(dtype);
      const at::Tensor b = at::randn({200}, cuda).to(dtype);
      const at::Tensor all = model::invariant::linear(x, w, b);
      for (const int64_t m : {1, 2, 7, 64, 256, 1000}) {
        EXPECT_TRUE(at::equal(all.narrow(0, 0, m), model::invariant::linear(x.narrow(0, 0, m), w, b)))
            << "k " << k << " m " << m;
        EXPECT_TRUE(at::equal(all.narrow(0, 3000 - m, m), model::invariant::linear(x.narrow(0, 3000 - m, m), w, b)))
            << "k " << k << " last " << m;
      }
      EXPECT_TRUE(at::equal(all.narrow(1, 8, 40), model::invariant::linear(x, w.narrow(0, 8, 40), b.narrow(0, 8, 40))))
          << "k " << k << ": a subset of the outputs";
      // Within rounding of the ordinary matmul, relative to the outputs' size (bf16: 2^-8).
      const at::Tensor ref = at::linear(x, w, b).to(at::kFloat);
      const double rel = (all.to(at::kFloat) - ref).abs().max().item<double>() / ref.abs().max().item<double>();
      EXPECT_LT(rel, dtype == at::kFloat ? 1e-5 : 1e-2) << k;
      // The ordinary matmul fails the same check (cuBLAS picks its kernel, split-K included, by M).
      if (dtype == at::kBFloat16 && k == 4864) {
        const at::Tensor plain = at::linear(x, w, b);
        int64_t differ = 0;
        for (const int64_t m : {1, 2, 7, 64, 256, 1000})
          differ += !at::equal(plain.narrow(0, 0, m), at::linear(x.narrow(0, 0, m), w, b));
        EXPECT_GT(differ, 0) << "the ordinary matmul's rows did not change with M here";
      }
    }
    // The value head (one output column): each row's value alone, off a vector boundary too, and
    // within rounding of the ordinary matmul; its gradients the ordinary ones.
    {
      const at::Tensor h = at::randn({1000, 1536}, cuda).to(dtype), score = at::randn({1, 1536}, cuda).to(dtype);
      const at::Tensor all = model::values(h, score);
      for (const int64_t m : {1, 3, 64, 999})
        EXPECT_TRUE(at::equal(all.narrow(0, 1000 - m, m), model::values(h.narrow(0, 1000 - m, m), score)))
            << "value rows, the last " << m;
      at::Tensor flat = at::empty({h.numel() + 1}, h.options());
      at::Tensor off = flat.narrow(0, 1, h.numel()).view(h.sizes());
      off.copy_(h);
      EXPECT_TRUE(at::equal(all, model::values(off, score)));
      const at::Tensor ref = at::matmul(h, score.t()).squeeze(-1).to(at::kFloat);
      EXPECT_LT((all - ref).abs().max().item<double>() / ref.abs().max().item<double>(), dtype == at::kFloat ? 1e-5 : 1e-2);
      const at::Tensor hg = h.to(at::kFloat).requires_grad_(), sg = score.to(at::kFloat).requires_grad_();
      model::values(hg, sg).sum().backward();
      EXPECT_TRUE(at::allclose(hg.grad(), sg.detach().expand({1000, 1536}), 1e-6, 1e-6));
      EXPECT_TRUE(at::allclose(sg.grad(), hg.detach().sum(0, true), 1e-3, 1e-3));
    }
    const at::Tensor x = at::randn({300, 896}, cuda).to(dtype), nw = at::rand({896}, cuda).to(dtype);
    const at::Tensor n = model::invariant::rms_norm(x, nw, 1e-6);
    EXPECT_TRUE(at::equal(n.narrow(0, 17, 3), model::invariant::rms_norm(x.narrow(0, 17, 3), nw, 1e-6)));
    EXPECT_LT((n.to(at::kFloat) - at::rms_norm(x, {896}, nw, 1e-6).to(at::kFloat)).abs().max().item<double>(),
              dtype == at::kFloat ? 1e-4 : 0.1);
    // Rows that start off a vector boundary take the same order (element loads instead of vectors).
    auto shifted = [&](const at::Tensor& t) {
      at::Tensor flat = at::empty({t.numel() + 1}, t.options());
      at::Tensor view = flat.narrow(0, 1, t.numel()).view(t.sizes());
      view.copy_(t);
      return view;
    };
    EXPECT_TRUE(at::equal(n, model::invariant::rms_norm(shifted(x), nw, 1e-6)));
    // The residual add fused: the same bits as the add, then the norm.
    at::Tensor x1 = x.clone(), x2 = x.clone();
    const at::Tensor addend = at::randn_like(x);
    const at::Tensor fused = model::invariant::add_rms_norm(x1, addend, nw, 1e-6);
    x2.add_(addend);
    EXPECT_TRUE(at::equal(x1, x2));
    EXPECT_TRUE(at::equal(fused, model::invariant::rms_norm(x2, nw, 1e-6)));
    const at::Tensor logits = at::randn({40, 60}, cuda).to(dtype);
    const at::Tensor p = model::invariant::softmax(logits);
    EXPECT_TRUE(at::equal(p.narrow(0, 3, 1), model::invariant::softmax(logits.narrow(0, 3, 1))));
    EXPECT_LT((p - at::softmax(logits.to(at::kFloat), -1)).abs().max().item<double>(), 1e-6);
    const at::Tensor z = at::randn({9, 151936}, cuda).to(dtype) * 4;
    const at::Tensor tgt = at::randint(0, 151936, {9}, at::TensorOptions().dtype(at::kLong).device(cuda));
    const std::vector<float> temps{0.7f, 1.f, 1.3f, 0.7f, 1.f, 1.3f, 0.7f, 1.f, 1.3f};
    const at::Tensor lp = model::invariant::logprobs(z, tgt, temps);
    EXPECT_TRUE(at::equal(lp.narrow(0, 4, 1), model::invariant::logprobs(z.narrow(0, 4, 1), tgt.narrow(0, 4, 1), {1.f})));
    EXPECT_TRUE(at::equal(lp, model::invariant::logprobs(shifted(z), tgt, temps)));
    const at::Tensor want =
        at::log_softmax(z.to(at::kDouble) / at::tensor(std::vector<double>(temps.begin(), temps.end()), at::kDouble)
                                                .to(cuda)
                                                .unsqueeze(1),
                        -1)
            .gather(1, tgt.unsqueeze(1))
            .squeeze(1);
    EXPECT_LT((lp.to(at::kDouble) - want).abs().max().item<double>(), 1e-4);
    // The sampler's log-prob of its draw is this kernel's, bit for bit (so the engine reports it
    // without a second pass): greedy rows (at temperature 1) and sampled ones, a vocabulary that
    // is not a multiple of 8 and rows off the 16-byte boundary too. The entropy from the same pass.
    for (const at::Tensor& logits : {z, shifted(at::randn({9, 1001}, cuda).to(dtype) * 3)}) {
      model::SamplingRows rows;
      std::vector<float> t;
      for (int64_t r = 0; r < 9; ++r) {
        const float temp = r % 3 == 0 ? 0.f : temps[static_cast<size_t>(r)];
        rows.add(temp, 1.f, 0, 0.f, model::sampling_uniform(7, r));
        t.push_back(temp > 0 ? temp : 1.f);
      }
      const model::SampledTokens drawn = model::sample_tokens(logits, rows);
      at::Tensor ent;
      const at::Tensor again = model::invariant::logprobs(logits, drawn.tokens, t, &ent);
      EXPECT_TRUE(at::equal(drawn.logprobs, again)) << "the sampler's log-probs against the kernel's, vocab "
                                                    << logits.size(1);
      EXPECT_TRUE(at::equal(again, model::invariant::logprobs(logits, drawn.tokens, t))) << "with and without entropy";
      const at::Tensor y = logits.to(at::kDouble) /
                           at::tensor(std::vector<double>(t.begin(), t.end()), at::kDouble).to(cuda).unsqueeze(1);
      const at::Tensor h = -(at::softmax(y, -1) * at::log_softmax(y, -1)).sum(-1);
      EXPECT_LT((ent.to(at::kDouble) - h).abs().max().item<double>(), 1e-3) << "entropy, vocab " << logits.size(1);
    }
  }
  // RoPE tables on the GPU (no trip through the host): a row's values do not depend on the rows
  // beside it, and agree with the C library's to float rounding.
  {
    const at::Tensor freqs = at::arange(0, 4000, at::kFloat).to(cuda).unsqueeze(1) *
                             at::rand({64}, at::kFloat).to(cuda).unsqueeze(0);
    const auto [c, s] = model::invariant::rope_tables(freqs, 1.25);
    EXPECT_TRUE(c.is_cuda() && s.is_cuda());
    const auto [c1, s1] = model::invariant::rope_tables(freqs.narrow(0, 1234, 7), 1.25);
    EXPECT_TRUE(at::equal(c.narrow(0, 1234, 7), c1) && at::equal(s.narrow(0, 1234, 7), s1));
    const auto [hc, hs] = model::invariant::rope_tables(freqs.cpu(), 1.25);
    EXPECT_LT((c.cpu() - hc).abs().max().item<double>(), 1e-5);
    EXPECT_LT((s.cpu() - hs).abs().max().item<double>(), 1e-5);
  }
  // Attention (bf16; head sizes of the tensor-core and the CUDA-core kernels): every query of a
  // packed prefill equals a decode step over its keys, and the ordinary kernel to rounding. The
  // third sequence gives each of the decode kernel's 4 parts several tiles (230 keys: 15 tiles).
  for (const auto& [heads, kv_heads, dim] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{14, 2, 64}, {12, 2, 128}, {4, 2, 16}}) {
    const at::Tensor q = at::randn({300, heads, dim}, cuda).to(at::kBFloat16);
    const at::Tensor k = at::randn({300, kv_heads, dim}, cuda).to(at::kBFloat16);
    const at::Tensor v = at::randn({300, kv_heads, dim}, cuda).to(at::kBFloat16);
    const auto cu = at::tensor(std::vector<int32_t>{0, 33, 70, 300}, at::kInt).to(cuda);
    const model::VarlenSpec spec = model::VarlenSpec::self(cu, {33, 37, 230});
    const at::Tensor full = model::invariant::attention_forward(q, k, v, spec, 0.125);
    for (const auto& [start, pos] : std::vector<std::pair<int64_t, int64_t>>{
             {33, 0}, {33, 15}, {33, 16}, {33, 36}, {70, 63}, {70, 64}, {70, 130}, {70, 229}}) {
      model::VarlenSpec step;
      step.lens_q = {1};
      step.lens_k = {pos + 1};
      const at::Tensor one = model::invariant::attention_forward(q.narrow(0, start + pos, 1), k.narrow(0, start, pos + 1),
                                                                 v.narrow(0, start, pos + 1), step, 0.125);
      EXPECT_TRUE(at::equal(full[start + pos], one[0])) << "head size " << dim << " position " << pos << " of the sequence at " << start;
    }
#ifdef TILLER_HAVE_CUDA_KERNELS
    // The engine's decode kernel itself (one split; the cache's block list the sequence's rows,
    // blocks of one slot) for the same queries: the same bits.
    const std::vector<std::pair<int64_t, int64_t>> positions{{33, 0},  {33, 5},  {33, 15}, {33, 16},  {33, 17},
                                                             {33, 31}, {33, 36}, {70, 47}, {70, 200}, {70, 229}};
    std::vector<int32_t> lens, offsets, ids;
    for (const auto& [start, pos] : positions) {
      lens.push_back(static_cast<int32_t>(pos + 1));
      offsets.push_back(static_cast<int32_t>(ids.size()));
      for (int64_t t = 0; t <= pos; ++t) ids.push_back(static_cast<int32_t>(start + t));
    }
    auto dev_ints = [&](const std::vector<int32_t>& v) { return at::tensor(v, at::kInt).to(cuda); };
    const at::Tensor d_lens = dev_ints(lens), d_offsets = dev_ints(offsets), d_ids = dev_ints(ids);
    std::vector<int64_t> rows;
    for (const auto& [start, pos] : positions) rows.push_back(start + pos);
    const at::Tensor qd = q.index_select(0, at::tensor(rows, at::kLong).to(cuda)).contiguous();
    at::Tensor decoded = at::empty_like(qd);
    model::cuda::PagedDecode a;
    a.dtype = model::cuda::DType::kBFloat16;
    a.q = qd.data_ptr();
    a.q_token_stride = heads * dim;
    a.k_cache = k.data_ptr();
    a.v_cache = v.data_ptr();
    a.out = decoded.data_ptr();
    a.seq_lens = d_lens.data_ptr<int32_t>();
    a.offsets = d_offsets.data_ptr<int32_t>();
    a.blocks = d_ids.data_ptr<int32_t>();
    a.batch = static_cast<int64_t>(positions.size());
    a.heads = heads;
    a.kv_heads = kv_heads;
    a.head_dim = dim;
    a.block_size = 1;
    a.scale = 0.125f;
    a.splits = 1;
    model::cuda::paged_decode_attention(a, c10::cuda::getCurrentCUDAStream(0).stream());
    for (size_t i = 0; i < positions.size(); ++i)
      EXPECT_TRUE(at::equal(full[rows[i]], decoded[static_cast<int64_t>(i)]))
          << "head size " << dim << ": the decode kernel at row " << rows[i];
#endif
    const at::Tensor ref = model::varlen_attention(q, k, v, spec, 0.125, model::AttentionBackend::kReference);
    EXPECT_LT((full.to(at::kFloat) - ref.to(at::kFloat)).abs().max().item<double>(), 0.05) << dim;
  }
}

struct GpuCase {
  const char* preset;
  int64_t layers;  // 0: the preset's
  const char* name;
};

// The engine on CUDA (CUDA graphs for its decode steps, chunked prefill, preemption, n > 1,
// asynchronous scheduling) against the trainer's packed forwards on CUDA, bf16: tiny models of
// each family and a model of Qwen2-0.5B's shapes (2 of its blocks: head size 64, 14 query heads
// per 2 KV heads, its vocabulary).
TEST(EngineGpu, BitwiseEngineLogprobsEqualTheTrainers) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  ScopedNumerics bitwise(Numerics::kBatchInvariant);
  for (const GpuCase& c : {GpuCase{"tiny-qwen2", 0, "qwen2"}, GpuCase{"tiny-qwen3", 0, "qwen3_qk_norm"},
                           GpuCase{"tiny-llama", 0, "llama"}, GpuCase{"tiny-mistral", 0, "mistral_window"},
                           GpuCase{"tiny-qwen3-moe", 0, "qwen3_moe"}, GpuCase{"qwen2-0.5b", 2, "qwen2_0.5b_shaped"}}) {
    const TinyModel m = in_dtype(c.preset, at::kBFloat16, 1, "cuda:0", c.layers);
    for (const bool async : {false, true}) {
      const EngineRun r = busy_engine(m, async, "cuda:0");
      EXPECT_GT(r.stats.preemptions, 0) << c.name;
      int64_t total = 0;
      EXPECT_EQ(differing(r, trainer_side(m, r, 1, 1024, 1, "cuda:0"), &total), 0) << c.name << " alone, async " << async;
      EXPECT_EQ(differing(r, trainer_side(m, r, 0, 7, 2, "cuda:0")), 0) << c.name << " all packed, async " << async;
      EXPECT_EQ(differing(r, trainer_side(m, r, 5, 3, 3, "cuda:0")), 0) << c.name << " 5 a batch, async " << async;
      EXPECT_GT(total, 150) << c.name;
    }
  }
}

// Without the mode the same comparison on CUDA finds differences: what the mode is for.
TEST(EngineGpu, BitwiseTheDefaultKernelsDiffer) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  const TinyModel m = in_dtype("qwen2-0.5b", at::kBFloat16, 1, "cuda:0", 2);
  const EngineRun r = busy_engine(m, false, "cuda:0");
  int64_t total = 0;
  const int64_t n = differing(r, trainer_side(m, r, 0, 7, 2, "cuda:0"), &total);
  std::printf("[bitwise] default CUDA kernels, bf16, 0.5B-shaped: %lld of %lld log-probs differ\n",
              static_cast<long long>(n), static_cast<long long>(total));
  EXPECT_GT(n, 0);
}

// Asynchronous scheduling equals synchronous on CUDA to the bit, log-probs included (with the
// default kernels they differ in their last bits: tests/engine/engine_test.cpp allows for it).
TEST(EngineGpu, BitwiseAsyncSchedulingEqualsSync) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  ScopedNumerics bitwise(Numerics::kBatchInvariant);
  const TinyModel m = in_dtype("tiny-qwen2", at::kBFloat16, 1, "cuda:0");
  expect_async_equals_sync(m, m.weights, "cuda:0", 0.0);
}

}  // namespace
}  // namespace tiller::engine
