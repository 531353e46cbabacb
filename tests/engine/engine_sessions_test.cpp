// The engine's multi-turn sessions (parked, resumed, given way) and weight updates mid-sample, on
// CPU; and the GPU engine (paged decode, CUDA graphs, sessions, updates, RoPE in attention, bf16)
// against the CPU engine and the trainer.
#include "engine_fixture.h"

namespace tiller::engine {
namespace {

TEST(Engine, AResumedSessionComputesOnlyItsNewTokensAndEqualsAFreshRequest) { check_sessions("cpu", 1e-4); }

// A resume that finds every seat taken (max_num_seqs) keeps its session and takes the first seat
// that frees, before waiting prompts: its prefix is not computed again, and its tokens equal a
// fresh request's. A weight update while it waits turns it into a miss with the same output.
TEST(Engine, AResumeWaitsForASeatWithoutLosingItsSession) {
  TinyModel m = tiny("tiny-qwen2");
  EngineOptions o = small_options(256);
  o.limits.max_num_seqs = 2;
  Engine e(m.cfg, m.weights, o);
  Engine fresh(m.cfg, m.weights, o);
  const auto ps = prompts(3, 21, m.cfg.vocab_size, 10);
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 5;
  p.max_new_tokens = 5;
  Request first{1, ps[0], p, 1};
  first.keep_session = true;
  e.add(first);
  auto out = run_all(e);
  std::vector<int64_t> turn = ps[0];
  turn.insert(turn.end(), out.at({1, 0}).tokens.begin(), out.at({1, 0}).tokens.end());
  turn.push_back(13);
  turn.push_back(14);
  for (int round = 0; round < 2; ++round) {
    // Two long requests take both seats; the resume and a new prompt arrive behind them.
    SamplingParams longp = p;
    longp.max_new_tokens = 12;
    const uint64_t base = 100 * static_cast<uint64_t>(round + 1);
    e.add({base, ps[1], longp, 1});
    e.add({base + 1, ps[2], longp, 1});
    e.step();
    Request r{base + 2, turn, p, 1};
    r.params.seed = 77;
    r.resume = true;
    r.keep_session = true;
    r.session = round == 0 ? SessionKey{1, 0} : SessionKey{102, 0};
    const EngineStats before = e.stats();
    e.add(r);
    e.add({base + 3, ps[1], p, 1});
    EXPECT_EQ(e.stats().waiting, 2);
    if (round == 1) {  // drops the claimed session: the resume is a miss
      EXPECT_TRUE(e.drain().empty());
      e.weights_updated(1);
    }
    auto got = run_all(e);
    Request f = r;
    f.resume = f.keep_session = false;
    fresh.add(f);
    auto want = run_all(fresh);
    const EngineStats after = e.stats();
    if (round == 0) {
      EXPECT_EQ(after.session_resumes - before.session_resumes, 1);
      EXPECT_EQ(after.session_misses, 0);
      EXPECT_EQ(after.session_tokens_reused - before.session_tokens_reused,
                static_cast<int64_t>(ps[0].size()) + 5 - 1);
    } else {
      EXPECT_EQ(after.session_resumes, before.session_resumes);
      EXPECT_EQ(after.session_misses, 1);
    }
    EXPECT_EQ(got.at({base + 2, 0}).tokens, want.at({base + 2, 0}).tokens) << "round " << round;
    turn.insert(turn.end(), got.at({base + 2, 0}).tokens.begin(), got.at({base + 2, 0}).tokens.end());
    turn.push_back(15);
  }
  // Aborting a resume that waits for a seat leaves its session parked for a later one.
  e.add({300, ps[1], p, 2});
  e.step();
  Request r{301, turn, p, 1};
  r.resume = true;
  r.session = {202, 0};
  e.add(r);
  EXPECT_TRUE(e.abort(301));
  run_all(e);
  EXPECT_EQ(e.stats().sessions_parked, 1);
  EXPECT_TRUE(e.release_session({202, 0}));
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
}

// Parked sessions hold blocks only while nobody needs them: new requests evict them (the oldest
// first) instead of waiting or preempting; a resume of an evicted session is a miss with the same
// output; a weight update and the session limit drop them too.
TEST(Engine, ParkedSessionsGiveWayToRequestsThatNeedTheirBlocks) {
  TinyModel m = tiny("tiny-qwen2");
  EngineOptions o = small_options(20);  // 80 token slots
  o.max_sessions = 3;
  Engine e(m.cfg, m.weights, o);
  SamplingParams p;
  p.max_new_tokens = 8;
  const auto ps = prompts(4, 8, m.cfg.vocab_size, 10);
  for (uint64_t i = 0; i < 4; ++i) {
    Request r{i, ps[i], p, 1};
    r.keep_session = true;
    e.add(r);
    run_all(e);
  }
  EXPECT_EQ(e.stats().sessions_parked, 3);  // the limit dropped the oldest
  EXPECT_EQ(e.stats().session_evictions, 1);
  // 60 tokens need 15 blocks: the sessions' blocks are needed.
  std::vector<int64_t> big(52, 5);
  e.add({9, big, p, 1});
  auto out = run_all(e);
  EXPECT_EQ(out.at({9, 0}).tokens.size(), 8u);
  EXPECT_EQ(e.stats().preemptions, 0);
  EXPECT_GT(e.stats().session_evictions, 1);
  // Resuming session 3 (evicted or not): the same tokens as a fresh engine.
  Request r{10, ps[3], p, 1};
  r.prompt.push_back(3);
  r.resume = true;
  r.session = {3, 0};
  e.add(r);
  Engine fresh(m.cfg, m.weights, o);
  Request f{10, r.prompt, p, 1};
  fresh.add(f);
  EXPECT_EQ(run_all(e).at({10, 0}).tokens, run_all(fresh).at({10, 0}).tokens);
  Request again{11, ps[0], p, 1};
  again.keep_session = true;
  e.add(again);
  run_all(e);
  EXPECT_GE(e.stats().sessions_parked, 1);
  e.weights_updated(1);
  EXPECT_EQ(e.stats().sessions_parked, 0);
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
}


// A weight update in the middle of two samples (a partial rollout): they keep their tokens and
// log-probs, recompute their KV cache with the new weights and continue; each token's log-prob is
// the one of the weights that drew it (teacher-forced with the whole prefix), and the samples say
// which version drew which tokens.
TEST(Engine, AWeightUpdateMidSampleRecomputesTheCacheAndRecordsTheVersions) {
  TinyModel a = tiny("tiny-qwen2", 1), b = tiny("tiny-qwen2", 2);
  TinyModel served = tiny("tiny-qwen2", 1);  // the engine's own storage, overwritten by the update
  Engine e(served.cfg, served.weights, small_options());
  const auto ps = prompts(1, 21, served.cfg.vocab_size, 10);
  SamplingParams p;
  p.temperature = 0.9;
  p.seed = 77;
  p.max_new_tokens = 12;
  e.add({5, ps[0], p, 2});
  std::map<std::pair<uint64_t, int64_t>, SampleOutput> out;
  while (e.stats().generated_tokens < 8)
    for (auto& o : e.step()) out[{o.request_id, o.sample}] = std::move(o);
  for (auto& o : e.drain()) out[{o.request_id, o.sample}] = std::move(o);
  ASSERT_TRUE(out.empty()) << "the samples finished before the update";
  const int64_t before = e.stats().generated_tokens / 2;  // both samples decode in lockstep after the fork
  {
    c10::InferenceMode inference;  // the engine's weights are inference tensors
    for (auto& [name, t] : e.parameters()) t.copy_(b.named.at(name));
  }
  e.weights_updated(1);
  EXPECT_EQ(e.weight_version(), 1u);
  EXPECT_EQ(e.stats().kv_rebuilds, 2);
  for (auto& [k, o] : run_all(e)) out[k] = std::move(o);
  ASSERT_EQ(out.size(), 2u);
  for (const auto& [key, o] : out) {
    ASSERT_EQ(o.tokens.size(), 12u);
    EXPECT_EQ(o.versions, (std::vector<uint64_t>{0, 1})) << "sample " << key.second;
    EXPECT_EQ(o.version_starts, (std::vector<int64_t>{0, before})) << "sample " << key.second;
    const at::Tensor lp_a = trainer_logprobs(a, ps[0], o.tokens, 0.9);
    const at::Tensor lp_b = trainer_logprobs(b, ps[0], o.tokens, 0.9);
    for (int64_t j = 0; j < 12; ++j) {
      const double want = (j < before ? lp_a : lp_b)[j].item<double>();
      EXPECT_NEAR(o.logprobs[static_cast<size_t>(j)], want, 2e-5) << "sample " << key.second << " token " << j;
    }
    // The two weights disagree, so the check above tells them apart.
    EXPECT_GT(std::abs(lp_a[before].item<double>() - lp_b[before].item<double>()), 1e-3);
  }
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
}

TEST(Engine, AWeightUpdateUnderLoadKeepsEveryLogprobOfItsVersion) { check_weight_update_under_load("cpu", 2e-5); }

// Decode steps on a GPU (the paged decode kernel, with and without CUDA graphs), fp32, against
// the CPU: greedy tokens equal the CPU engine's, and the log-probs of every generated token (greedy
// and sampled) equal the CPU trainer's forward of the same tokens within 1e-4. (Sampled tokens
// are not compared with the CPU engine's: where u falls within rounding of a CDF boundary the two
// draw neighbouring ids, and the sequences part.) The shapes cover every head size the kernel has
// (16 to 256), query-head groups of 1, 2, 4, 7 and 16 (two and four thread blocks per KV head),
// biases, q/k norms and a sliding window; the mix of greedy and sampled requests with n = 2 and
// a small cache brings forks (copy-on-write) and preemption into decode steps of many batch sizes.
struct GpuShape {
  std::string name, preset;
  int64_t hidden, heads, kv_heads;  // 0: the preset's
};

class EngineGpuShape : public ::testing::TestWithParam<GpuShape> {};

TEST_P(EngineGpuShape, PagedDecodeAndGraphsEqualTheCpuEngine) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  // The CPU side is tiny; many OpenMP threads per process only contend when ctest runs several
  // of these at once on the GPU host (measured: 0.4 s alone, 80 s at -j 2 with 16 threads each).
  at::set_num_threads(std::min(at::get_num_threads(), 4));
  const GpuShape& shape = GetParam();
  TinyModel m;
  m.cfg = model::preset(shape.preset);
  if (shape.hidden > 0) {
    m.cfg.hidden_size = shape.hidden;
    m.cfg.num_heads = shape.heads;
    m.cfg.num_kv_heads = shape.kv_heads;
    m.cfg.head_dim = shape.hidden / shape.heads;
  }
  if (shape.preset == "tiny-mistral") m.cfg.layer_window = {0, 6};
  // As wide as tiny()'s logits at hidden 64, without growing the activations with the width
  // (scores in the thousands would make fp32 summation order visible).
  m.cfg.initializer_range = 0.25 * std::sqrt(64.0 / static_cast<double>(m.cfg.hidden_size));
  m.named = model::init_weights(m.cfg, model::Head::kLm, 3, at::kFloat);
  m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, shape.name);
  model::NamedTensors on_gpu;
  for (const auto& [name, t] : m.named) on_gpu[name] = t.to(at::Device("cuda:0"));
  const model::ModelWeights gpu_weights = model::bind_weights(m.cfg, on_gpu, model::Head::kLm, shape.name);

  const auto ps = prompts(20, 17, m.cfg.vocab_size, 50);
  auto add_all = [&](Engine& e) {
    for (size_t i = 0; i < ps.size(); ++i) {
      SamplingParams p;
      p.max_new_tokens = 8 + static_cast<int64_t>(i % 5) * 6;
      p.greedy = i % 3 == 0;
      p.temperature = 0.9;
      p.top_k = i % 2 ? 50 : 0;
      p.seed = 100 + i;
      e.add({i, ps[i], p, 1 + static_cast<int64_t>(i % 2)});
    }
  };
  EngineOptions o = small_options(120);
  o.limits.max_num_seqs = 24;
  o.limits.max_batched_tokens = 64;
  Engine cpu(m.cfg, m.weights, o);
  add_all(cpu);
  const auto want = run_all(cpu);
  for (bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "CUDA graphs" : "eager decode");
    EngineOptions og = o;
    og.device = "cuda:0";
    og.cuda_graphs = graphs;
    Engine gpu(m.cfg, gpu_weights, og);
    add_all(gpu);
    const auto got = run_all(gpu);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [key, w] : want) {
      const SampleOutput& g = got.at(key);
      const bool greedy = key.first % 3 == 0;
      if (greedy) EXPECT_EQ(g.tokens, w.tokens) << "request " << key.first << " sample " << key.second;
      ASSERT_EQ(g.logprobs.size(), g.tokens.size());
      const at::Tensor lp = trainer_logprobs(m, ps[key.first], g.tokens, greedy ? 1.0 : 0.9);
      for (size_t j = 0; j < g.tokens.size(); ++j)
        EXPECT_NEAR(g.logprobs[j], lp[static_cast<int64_t>(j)].item<double>(), 1e-4)
            << "request " << key.first << " sample " << key.second << " token " << j;
    }
    EXPECT_EQ(gpu.stats().kv_blocks_free, gpu.stats().kv_blocks_total);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, EngineGpuShape,
    ::testing::Values(GpuShape{"qwen2_d16_g2", "tiny-qwen2", 0, 0, 0}, GpuShape{"qwen3_d32_g2", "tiny-qwen3", 0, 0, 0},
                      GpuShape{"mistral_d16_g4_window", "tiny-mistral", 0, 0, 0},
                      GpuShape{"llama_d128_g7", "tiny-llama", 896, 7, 1},
                      GpuShape{"qwen2_d64_g16", "tiny-qwen2", 1024, 16, 1},
                      GpuShape{"llama_d256_g1", "tiny-llama", 512, 2, 2}),
    [](const ::testing::TestParamInfo<GpuShape>& info) { return info.param.name; });

// The same on a GPU in fp32: the step launched ahead reads its tokens on the device, through the
// CUDA graph's inputs and through the eager decode path.
// Sessions on the GPU path: the paged decode kernel and CUDA graphs over resumed block tables.
TEST(EngineGpu, AResumedSessionEqualsAFreshRequest) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  check_sessions("cuda:0", 1e-4);
}

TEST(EngineGpu, AsynchronousSchedulingChangesNoOutput) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  TinyModel m = tiny("tiny-qwen2");
  model::NamedTensors on_gpu;
  for (const auto& [name, t] : m.named) on_gpu[name] = t.to(at::Device("cuda:0"));
  const model::ModelWeights w = model::bind_weights(m.cfg, on_gpu, model::Head::kLm, "tiny-qwen2");
  expect_async_equals_sync(m, w, "cuda:0", 1e-4);
}

// A weight update in the middle of samples on a GPU in fp32 (CUDA graphs for decode, the paged
// kernel): every token's log-prob is the one of the weights that drew it, against the trainer's
// forward on the CPU.
TEST(EngineGpu, AWeightUpdateMidSampleKeepsEachLogprobOfItsVersion) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  check_weight_update_under_load("cuda:0", 1e-4);
}

// On a GPU in bf16 (flash attention for prefill, the paged cache for decode): the engine's
// log-probs of its sampled tokens against the trainer's forward of the same tokens, also in bf16.
// Reports the distribution of the differences.
// RoPE inside the decode kernel (EngineOptions::rope_in_attention) against the separate RoPE
// kernel, through the whole engine in bf16: the same tokens and bit for bit the same log-probs,
// with CUDA graphs and eagerly. Qwen2-0.5B's attention (head size 64, groups of 7, q/k biases)
// and the same with q/k norms before RoPE (Qwen3's attention). The separate kernel runs twice: its
// two runs must agree too, or the comparison would say nothing.
TEST(EngineGpu, RopeInAttentionChangesNoOutput) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const bool qk_norm : {false, true}) {
    const std::string preset = qk_norm ? "qwen2-0.5b with q/k norms" : "qwen2-0.5b";
    model::ModelConfig cfg = model::preset("qwen2-0.5b");
    cfg.num_layers = 3;
    cfg.qk_norm = qk_norm;
    const model::NamedTensors named = model::init_weights(cfg, model::Head::kLm, 4, at::kBFloat16, at::Device("cuda:0"));
    const model::ModelWeights w = model::bind_weights(cfg, named, model::Head::kLm, preset);
    const auto ps = prompts(12, 23, cfg.vocab_size, 40);
    for (bool graphs : {true, false}) {
      SCOPED_TRACE(::testing::Message() << preset << (graphs ? ", CUDA graphs" : ", eager decode"));
      std::map<std::pair<uint64_t, int64_t>, SampleOutput> outs[3];
      for (int fused = 0; fused < 3; ++fused) {
        EngineOptions o;
        o.device = "cuda:0";
        o.num_blocks = 512;
        o.cuda_graphs = graphs;
        o.rope_in_attention = fused == 1;  // runs 0 and 2: the separate kernel, twice
        Engine e(cfg, w, o);
        for (size_t i = 0; i < ps.size(); ++i) {
          SamplingParams p;
          p.greedy = i % 3 == 0;
          p.temperature = 1.0;
          p.seed = 40 + i;
          p.max_new_tokens = 24;
          e.add({i, ps[i], p, 2});
        }
        outs[fused] = run_all(e);
      }
      ASSERT_EQ(outs[0].size(), 2 * ps.size());
      ASSERT_EQ(outs[1].size(), outs[0].size());
      for (const auto& [key, want] : outs[0]) {
        const SampleOutput& again = outs[2].at(key);
        EXPECT_EQ(again.tokens, want.tokens) << "unfused twice: request " << key.first << " sample " << key.second;
        EXPECT_EQ(again.logprobs, want.logprobs) << "unfused twice: request " << key.first << " sample " << key.second;
        const SampleOutput& got = outs[1].at(key);
        EXPECT_EQ(got.tokens, want.tokens) << "request " << key.first << " sample " << key.second;
        EXPECT_EQ(got.logprobs, want.logprobs) << "request " << key.first << " sample " << key.second;
      }
    }
  }
}

TEST(EngineGpu, SampledLogprobsAgainstTheTrainerInBf16) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  model::ModelConfig cfg = model::preset("qwen2-0.5b");
  cfg.num_layers = 4;  // the real widths, fewer layers
  model::NamedTensors named = model::init_weights(cfg, model::Head::kLm, 2, at::kBFloat16, at::Device("cuda:0"));
  const model::ModelWeights w = model::bind_weights(cfg, named, model::Head::kLm, "qwen2-0.5b/4");
  EngineOptions o;
  o.device = "cuda:0";
  o.num_blocks = 2048;
  o.limits.max_batched_tokens = 512;
  Engine e(cfg, w, o);
  const auto ps = prompts(16, 31, cfg.vocab_size, 200);
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 5;
  p.max_new_tokens = 64;
  for (size_t i = 0; i < ps.size(); ++i) e.add({i, ps[i], p, 2});
  auto out = run_all(e);
  ASSERT_EQ(out.size(), 2 * ps.size());
  std::vector<double> diffs;
  c10::AutoGradMode no_grad(false);
  for (const auto& [key, o2] : out) {
    std::vector<int64_t> seq = ps[key.first];
    seq.insert(seq.end(), o2.tokens.begin(), o2.tokens.end());
    at::Tensor h = model::forward_hidden(cfg, w, model::PackedBatch::pack({seq}, at::Device("cuda:0")));
    const auto np = static_cast<int64_t>(ps[key.first].size()), ng = static_cast<int64_t>(o2.tokens.size());
    at::Tensor lp = model::token_logprobs(h.narrow(0, np - 1, ng), w.lm_head,
                                          at::tensor(o2.tokens, at::kLong).to(at::Device("cuda:0")), 1.0).cpu();
    for (int64_t j = 0; j < ng; ++j) diffs.push_back(std::abs(o2.logprobs[j] - lp[j].item<double>()));
  }
  std::sort(diffs.begin(), diffs.end());
  double mean = 0;
  for (double d : diffs) mean += d / static_cast<double>(diffs.size());
  auto q = [&](double f) { return diffs[static_cast<size_t>(f * static_cast<double>(diffs.size() - 1))]; };
  std::printf("engine vs trainer log-probs, bf16, %zu tokens: mean %.4f, p50 %.4f, p90 %.4f, p99 %.4f, max %.4f\n",
              diffs.size(), mean, q(0.5), q(0.9), q(0.99), diffs.back());
  EXPECT_LT(q(0.99), 0.1);
  EXPECT_LT(mean, 0.02);
}

}  // namespace
}  // namespace tiller::engine
