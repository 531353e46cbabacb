// The engine against the reference generator and the trainer's forward (fp32 on CPU), and under
// load: shared prompts, preemption, concurrency, aborts and bad requests.
#include "engine_fixture.h"

#include <fmt/format.h>

#include "engine/kv_sizing.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/model/lora.h"
#include "tiller/model/storage_swap.h"

namespace tiller::engine {
namespace {

class EngineFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineFamily, GreedyEqualsReferenceAndTrainerArgmax) {
  TinyModel m = tiny(GetParam());
  if (GetParam() == "tiny-mistral") m.cfg.layer_window = {0, 6};  // a sliding window shorter than the sequences
  Engine e(m.cfg, m.weights, small_options());
  const auto ps = prompts(10, 5, m.cfg.vocab_size);
  SamplingParams g;
  g.greedy = true;
  g.max_new_tokens = 12;
  for (size_t i = 0; i < ps.size(); ++i) e.add({i, ps[i], g, 1});
  auto out = run_all(e);
  const auto ref = model::generate(m.cfg, m.weights, ps, g, /*batch_size=*/3);
  ASSERT_EQ(out.size(), ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const SampleOutput& o = out.at({i, 0});
    EXPECT_EQ(o.tokens, ref[i].tokens) << "prompt " << i;
    EXPECT_EQ(o.finish_reason, "length");
    at::Tensor argmax;
    at::Tensor lp = trainer_logprobs(m, ps[i], o.tokens, 1.0, &argmax);
    for (size_t j = 0; j < o.tokens.size(); ++j) {
      EXPECT_EQ(o.tokens[j], argmax[j].item<int64_t>()) << "prompt " << i << " token " << j;
      EXPECT_NEAR(o.logprobs[j], lp[j].item<double>(), 2e-5) << "prompt " << i << " token " << j;
    }
  }
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
}

INSTANTIATE_TEST_SUITE_P(Tiny, EngineFamily,
                         ::testing::Values("tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-mistral", "tiny-qwen3-moe",
                                           "tiny-qwen2-moe", "tiny-mixtral"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(Engine, SampledTokensEqualReferenceAndLogprobsEqualTrainer) {
  TinyModel m = tiny("tiny-qwen2");
  Engine e(m.cfg, m.weights, small_options());
  const auto ps = prompts(8, 9, m.cfg.vocab_size);
  SamplingParams p;
  p.temperature = 0.8;
  p.top_p = 0.9;
  p.top_k = 40;
  p.min_p = 0.02;
  p.seed = 1234;
  p.max_new_tokens = 10;
  for (size_t i = 0; i < ps.size(); ++i) {
    SamplingParams pi = p;
    pi.seed = p.seed + i;  // the reference gives prompt i seed + i
    e.add({100 + i, ps[i], pi, 1});
  }
  auto out = run_all(e);
  const auto ref = model::generate(m.cfg, m.weights, ps, p, 4);
  for (size_t i = 0; i < ps.size(); ++i) {
    const SampleOutput& o = out.at({100 + i, 0});
    EXPECT_EQ(o.tokens, ref[i].tokens) << "prompt " << i;
    at::Tensor lp = trainer_logprobs(m, ps[i], o.tokens, 0.8);
    for (size_t j = 0; j < o.tokens.size(); ++j)
      EXPECT_NEAR(o.logprobs[j], lp[j].item<double>(), 2e-5) << "prompt " << i << " token " << j;
  }
}

// A context past max_position_embeddings only when the config's RoPE scaling covers it.
TEST(Engine, MaxModelLenPastTheModelsContextNeedsRopeScaling) {
  TinyModel m = tiny("tiny-llama", 1);  // max_position_embeddings 2048
  EngineOptions o = small_options();
  o.max_model_len = 4096;
  try {
    Engine e(m.cfg, m.weights, o);
    ADD_FAILURE() << "max_model_len 4096 on a 2048-token model was accepted";
  } catch (const ConfigError& err) {
    EXPECT_NE(std::string(err.what()).find("max_model_len = 4096 exceeds the model's context of 2048 tokens"),
              std::string::npos)
        << err.what();
  }
  m.cfg.rope_scaling.type = "linear";
  m.cfg.rope_scaling.factor = 2.0;
  Engine e(m.cfg, m.weights, o);
  EXPECT_EQ(e.max_model_len(), 4096);
}

// decode_pack_keys is bounded (the decode kernel's threshold for one-warp items).
TEST(Engine, DecodePackKeysOutOfRangeIsRefused) {
  TinyModel m = tiny("tiny-llama", 1);
  for (int64_t bad : {int64_t{-1}, (int64_t{1} << 20) + 1}) {
    EngineOptions o = small_options();
    o.decode_pack_keys = bad;
    try {
      Engine e(m.cfg, m.weights, o);
      ADD_FAILURE() << "decode_pack_keys " << bad << " was accepted";
    } catch (const ConfigError& err) {
      EXPECT_NE(std::string(err.what()).find(fmt::format("decode_pack_keys = {} is out of range", bad)),
                std::string::npos)
          << err.what();
    }
  }
  EngineOptions o = small_options();
  o.decode_pack_keys = 0;
  Engine e(m.cfg, m.weights, o);
}

TEST(Engine, SamplesOfAPromptShareItsBlocksAndSurvivePreemption) {
  TinyModel m = tiny("tiny-llama");
  // 14 blocks of 4 tokens: four 30-token samples of one prompt cannot all be cached at once.
  EngineOptions o = small_options(14);
  Engine e(m.cfg, m.weights, o);
  const std::vector<int64_t> prompt = prompts(1, 3, m.cfg.vocab_size, 1)[0];
  std::vector<int64_t> long_prompt(10);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = 7 + static_cast<int64_t>(i);
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 77;
  p.max_new_tokens = 20;
  e.add({1, long_prompt, p, 4});
  auto out = run_all(e);
  EXPECT_GT(e.stats().preemptions, 0) << "the cache was meant to be too small for all samples at once";
  // Sample j draws with seed + j: the reference with the prompt repeated gives prompt j seed + j.
  const auto ref = model::generate(m.cfg, m.weights, std::vector<std::vector<int64_t>>(4, long_prompt), p, 4);
  std::set<std::vector<int64_t>> distinct;
  for (int64_t j = 0; j < 4; ++j) {
    const SampleOutput& s = out.at({1, j});
    EXPECT_EQ(s.tokens, ref[static_cast<size_t>(j)].tokens) << "sample " << j;
    EXPECT_EQ(s.tokens.size(), 20u);
    EXPECT_EQ(s.prompt_tokens, 10);
    distinct.insert(s.tokens);
  }
  EXPECT_GT(distinct.size(), 1u) << "samples with different seeds came out identical";
  EXPECT_EQ(e.stats().kv_blocks_free, 14);
  (void)prompt;
}

TEST(Engine, ManyConcurrentRequestsOfMixedLengthsAllComplete) {
  TinyModel m = tiny("tiny-qwen3");
  EngineOptions o = small_options(60);
  o.limits.max_num_seqs = 12;
  o.limits.max_batched_tokens = 32;
  Engine e(m.cfg, m.weights, o);
  std::mt19937_64 rng(21);
  const auto ps = prompts(50, 22, m.cfg.vocab_size, 60);
  std::map<uint64_t, std::pair<int64_t, SamplingParams>> asked;
  int64_t added = 0;
  std::map<std::pair<uint64_t, int64_t>, SampleOutput> out;
  // Requests keep arriving while the engine runs.
  for (size_t i = 0; i < ps.size() || e.has_work();) {
    for (int k = 0; k < 3 && i < ps.size(); ++k, ++i) {
      SamplingParams p;
      p.greedy = rng() % 4 == 0;
      p.temperature = 0.5 + static_cast<double>(rng() % 100) / 100;
      p.top_k = static_cast<int64_t>(rng() % 3) * 20;
      p.seed = rng();
      p.max_new_tokens = 1 + static_cast<int64_t>(rng() % 40);
      if (rng() % 3 == 0) p.stop_token_ids = {static_cast<int64_t>(rng() % 512), static_cast<int64_t>(rng() % 512)};
      const int64_t n = 1 + static_cast<int64_t>(rng() % 3);
      e.add({i, ps[i], p, n});
      asked[i] = {n, p};
      added += n;
    }
    for (auto& r : e.step()) out[{r.request_id, r.sample}] = std::move(r);
  }
  ASSERT_EQ(static_cast<int64_t>(out.size()), added);
  for (const auto& [key, r] : out) {
    const auto& [n, p] = asked.at(key.first);
    EXPECT_LT(key.second, n);
    EXPECT_EQ(r.tokens.size(), r.logprobs.size());
    EXPECT_EQ(r.prompt_tokens, static_cast<int64_t>(ps[key.first].size()));
    const bool stopped = !r.tokens.empty() && std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(),
                                                        r.tokens.back()) != p.stop_token_ids.end();
    if (r.finish_reason == "stop") EXPECT_TRUE(stopped) << key.first;
    else EXPECT_EQ(static_cast<int64_t>(r.tokens.size()), p.max_new_tokens) << key.first;
    for (size_t j = 0; j + 1 < r.tokens.size(); ++j)  // no stop token before the end
      EXPECT_EQ(std::count(p.stop_token_ids.begin(), p.stop_token_ids.end(), r.tokens[j]), 0) << key.first;
  }
  const EngineStats s = e.stats();
  EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total);
  EXPECT_EQ(s.running + s.waiting, 0);
  EXPECT_EQ(s.requests_finished, 50);
  int64_t prompt_tokens = 0;
  for (const auto& p : ps) prompt_tokens += static_cast<int64_t>(p.size());
  EXPECT_EQ(s.prompt_tokens, prompt_tokens);
  int64_t generated = 0;
  for (const auto& [key, r] : out) generated += static_cast<int64_t>(r.tokens.size());
  EXPECT_EQ(s.generated_tokens, generated);
}

TEST(Engine, AbortEndsEverySampleOfTheRequest) {
  TinyModel m = tiny("tiny-qwen2");
  Engine e(m.cfg, m.weights, small_options());
  SamplingParams p;
  p.max_new_tokens = 50;
  e.add({1, {1, 2, 3}, p, 3});
  e.add({2, {4, 5}, p, 1});
  e.step();
  e.step();
  EXPECT_TRUE(e.abort(1));
  EXPECT_FALSE(e.abort(1));
  auto out = run_all(e);
  for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(out.at({1, j}).finish_reason, "abort");
  EXPECT_EQ(out.at({2, 0}).tokens.size(), 50u);
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
}

// Request::stream: after every step an unfinished sample's new token comes back as a partial
// output (finish_reason ""), in order, one per drawn token; the finished sample still comes back
// whole and equals the same request without streaming. Forks stream too; other requests do not.
TEST(Engine, StreamedRequestsReturnEachNewTokenAndTheWholeSampleAtTheEnd) {
  TinyModel m = tiny("tiny-qwen2");
  auto run = [&](bool stream) {
    Engine e(m.cfg, m.weights, small_options());
    SamplingParams p;
    p.seed = 5;
    p.max_new_tokens = 9;
    Request r{1, {1, 2, 3, 4, 5}, p, 3};
    r.stream = stream;
    e.add(r);
    e.add({2, {6, 7}, p, 1});  // not streamed
    std::map<int64_t, std::vector<int64_t>> partial;
    std::map<std::pair<uint64_t, int64_t>, SampleOutput> whole;
    for (int steps = 0; e.has_work() && steps < 1000; ++steps)
      for (auto& o : e.step()) {
        if (!o.finish_reason.empty()) {
          whole[{o.request_id, o.sample}] = o;
          continue;
        }
        EXPECT_EQ(o.request_id, 1u);
        EXPECT_EQ(o.tokens.size(), 1u);
        EXPECT_EQ(o.logprobs.size(), 1u);
        EXPECT_FALSE(whole.count({o.request_id, o.sample})) << "a partial after its sample finished";
        partial[o.sample].push_back(o.tokens[0]);
      }
    return std::make_pair(partial, whole);
  };
  const auto [partial, whole] = run(true);
  const auto [none, plain] = run(false);
  EXPECT_TRUE(none.empty());
  ASSERT_EQ(whole.size(), 4u);
  for (int64_t j = 0; j < 3; ++j) {
    const std::vector<int64_t>& all = whole.at({1, j}).tokens;
    EXPECT_EQ(all, plain.at({1, j}).tokens) << "sample " << j;
    ASSERT_EQ(partial.count(j), 1u) << "sample " << j;
    // Every token but the last (which finished the sample) came first as a partial.
    EXPECT_EQ(partial.at(j), std::vector<int64_t>(all.begin(), all.end() - 1)) << "sample " << j;
  }
}

// logging.efficiency's engine benchmark: it runs once, leaves the engine idle with every block
// free and its counters as they were, records a positive rate, and a budget of 0 seconds cuts
// the timed run after one step (its requests aborted) yet still yields a rate.
TEST(Engine, CalibrationRunsOnceLeavesTheCountersAndKeepsToItsBudget) {
  TinyModel m = tiny("tiny-qwen2");
  for (double budget : {60.0, 0.0}) {
    EngineOptions o = small_options();
    o.bench_batch = 4;
    o.bench_prompt = 8;
    o.bench_new_tokens = 40;
    o.bench_max_seconds = budget;
    Engine e(m.cfg, m.weights, o);
    const EngineStats before = e.stats();
    ASSERT_TRUE(e.calibrate_if_due()) << budget;
    EXPECT_FALSE(e.calibrate_if_due()) << "a second calibration";
    const EngineStats after = e.stats();
    EXPECT_GT(after.bench_tokens_per_s, 0) << budget;
    EXPECT_FALSE(e.has_work());
    EXPECT_EQ(after.kv_blocks_free, after.kv_blocks_total);
    EXPECT_EQ(after.generated_tokens, before.generated_tokens);
    EXPECT_EQ(after.steps, before.steps);
    // A request after it runs as on a fresh engine.
    SamplingParams p;
    p.max_new_tokens = 5;
    e.add({7, {1, 2, 3}, p, 1});
    EXPECT_EQ(run_all(e).at({7, 0}).tokens.size(), 5u);
  }
  EngineOptions none = small_options();
  Engine e(m.cfg, m.weights, none);
  EXPECT_FALSE(e.calibrate_if_due()) << "no bench_* shapes: no calibration";
  EXPECT_EQ(e.stats().bench_tokens_per_s, 0);
}

TEST(Engine, AsynchronousSchedulingChangesNoOutput) {
  TinyModel m = tiny("tiny-qwen2");
  expect_async_equals_sync(m, m.weights, "cpu", 1e-5);
}

TEST(Engine, InvalidRequestsAreRefusedAndTheEngineKeepsServing) {
  TinyModel m = tiny("tiny-qwen2");
  Engine e(m.cfg, m.weights, small_options(32));
  SamplingParams ok;
  ok.max_new_tokens = 4;
  auto refused = [&](Request r, const std::string& says) {
    try {
      e.add(std::move(r));
      ADD_FAILURE() << "accepted; expected: " << says;
    } catch (const InvalidRequest& err) {
      EXPECT_NE(std::string(err.what()).find(says), std::string::npos) << err.what();
    }
  };
  refused({1, {}, ok, 1}, "prompt is empty");
  refused({1, {1, 512}, ok, 1}, "outside the vocabulary");
  refused({1, {1, -3}, ok, 1}, "outside the vocabulary");
  SamplingParams p = ok;
  p.temperature = -1;
  refused({1, {1}, p, 1}, "temperature");
  p = ok;
  p.top_p = 1.5;
  refused({1, {1}, p, 1}, "top_p");
  p = ok;
  p.max_new_tokens = 0;
  refused({1, {1}, p, 1}, "max_new_tokens");
  p = ok;
  p.stop_token_ids = {9999};
  refused({1, {1}, p, 1}, "stop token id");
  refused({1, {1}, ok, 0}, "samples");
  refused({1, {1}, ok, 9}, "samples");
  p = ok;
  p.max_new_tokens = 200;  // 32 blocks of 4 tokens hold 128
  refused({1, {1}, p, 1}, "KV blocks");
  p.max_new_tokens = 5000;
  refused({1, {1}, p, 1}, "max_model_len");
  // Sizes whose sum once wrapped past the checks and killed the engine loop.
  p.max_new_tokens = std::numeric_limits<int64_t>::max() - 1;
  refused({1, {1, 2}, p, 1}, "max_new_tokens must be in [1, 16777216]");
  p.max_new_tokens = model::kMaxNewTokens;
  refused({1, {1, 2}, p, 1}, "max_model_len");
  refused({1, std::vector<int64_t>(5000, 1), ok, 1}, "the prompt has 5000 tokens; max_model_len is");
  e.add({1, {1, 2}, ok, 1});
  refused({1, {3}, ok, 1}, "already in use");
  auto out = run_all(e);
  EXPECT_EQ(out.at({1, 0}).tokens.size(), 4u);
}

// LoRA adapters served unmerged (tiller engine --lora; engine_weights.h: bind_lora_for_tp): the
// engine's greedy tokens and log-probs are the trainer's forward with the same adapters (PEFT's
// arithmetic, fp32 adapters), on the CPU in fp32 and (gpu label) on CUDA in bf16 with the decode
// steps in CUDA graphs; and the adapters matter (the base alone answers otherwise).
void expect_engine_runs_lora(const std::string& device, at::ScalarType dtype, double tol) {
  TinyModel m = tiny("tiny-qwen2", 9);
  for (auto& [name, t] : m.named) t = t.to(at::Device(device), dtype);
  m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, "tiny-qwen2");
  const auto [spec, adapters] = test_lora(m.cfg);
  model::ModelWeights served = m.weights;
  bind_lora_for_tp(m.cfg, spec, adapters, served, 0, 1, device, "test adapters");
  EngineOptions o = small_options(64);
  o.device = device;
  Engine e(m.cfg, served, o);
  Engine base(m.cfg, m.weights, o);
  EXPECT_EQ(e.parameters().count("model.layers.1.mlp.down_proj.lora_A.weight"), 1u);
  if (device != "cpu") EXPECT_TRUE(e.cuda_graphs());
  const auto ps = prompts(6, 8, m.cfg.vocab_size, 20);
  for (Engine* which : {&e, &base}) {
    for (size_t i = 0; i < ps.size(); ++i) {
      SamplingParams p;
      p.greedy = true;
      p.max_new_tokens = 10;
      which->add({i, ps[i], p, 1});
    }
  }
  const auto with = run_all(e), without = run_all(base);
  // The device's peak (this process's allocator): what the engines' weights, caches and steps held.
  if (device == "cpu") EXPECT_EQ(e.stats().device_peak_gb, 0.0);
  else EXPECT_GT(e.stats().device_peak_gb, 0.0);
  // The trainer's side: the same weights with the adapters bound, one packed forward per sample.
  model::ModelWeights trainer = m.weights;
  model::NamedTensors on_device;
  for (const auto& [n, t] : adapters) on_device[n] = t.to(at::Device(device));
  model::bind_lora(m.cfg, spec, on_device, trainer, "test adapters");
  c10::AutoGradMode no_grad(false);
  int64_t changed = 0;
  for (const auto& [key, s] : with) {
    std::vector<int64_t> seq = ps[key.first];
    seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
    const at::Tensor h =
        model::forward_hidden(m.cfg, trainer, model::PackedBatch::pack({seq}, at::Device(device)));
    const auto p = static_cast<int64_t>(ps[key.first].size()), g = static_cast<int64_t>(s.tokens.size());
    const at::Tensor rows = h.narrow(0, p - 1, g);
    const at::Tensor lp =
        model::token_logprobs(rows, trainer.lm_head, at::tensor(s.tokens, at::kLong).to(at::Device(device)), 1.0).cpu();
    const at::Tensor argmax = model::logits(rows, trainer.lm_head).argmax(1).cpu();
    for (int64_t j = 0; j < g; ++j) {
      EXPECT_NEAR(s.logprobs[j], lp[j].item<double>(), tol) << "request " << key.first << " token " << j;
      if (dtype == at::kFloat) EXPECT_EQ(s.tokens[j], argmax[j].item<int64_t>()) << "request " << key.first;
    }
    changed += s.tokens != without.at(key).tokens;
  }
  EXPECT_GT(changed, 0) << "the adapters changed no answer";
}

TEST(EngineLora, AdaptersRunUnmergedAsTheTrainersForward) { expect_engine_runs_lora("cpu", at::kFloat, 1e-4); }

TEST(EngineGpu, LoraAdaptersRunUnmergedUnderCudaGraphs) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  expect_engine_runs_lora("cuda:0", at::kBFloat16, 0.1);
}

// Sized from free memory, the KV cache leaves a step of max_batched_tokens the room its
// activations may take (kv_sizing.h), though the fraction would give it almost everything.
TEST(EngineGpu, TheKvCacheLeavesAStepsActivationsTheirRoom) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no GPU";
  const at::Device dev("cuda:0");
  TinyModel m = tiny("tiny-qwen2", 1);
  for (auto& [name, t] : m.named) t = t.to(dev, at::kBFloat16);
  m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, "tiny-qwen2");
  EngineOptions o;
  o.device = "cuda:0";
  o.cuda_graphs = false;
  o.gpu_memory_fraction = 0.99;
  o.limits.max_batched_tokens = int64_t{1} << 24;
  model::release_cached_device_memory(dev);
  const int64_t free_before = model::device_free_bytes(dev);
  const int64_t reserve = step_activation_bytes(m.cfg, o.limits.max_batched_tokens, 2, 1, o.limits.max_num_seqs);
  ASSERT_GT(reserve, free_before / 50) << "the step must need more than the 1% the fraction leaves";
  Engine e(m.cfg, m.weights, o);
  const int64_t block_bytes = 2 * m.cfg.num_layers * o.block_size * m.cfg.num_kv_heads * m.cfg.head_dim * 2;
  const int64_t cache = e.stats().kv_blocks_total * block_bytes;
  EXPECT_LE(cache + reserve, free_before);
  EXPECT_GT(cache, (free_before - reserve) * 9 / 10);
  SamplingParams g;
  g.greedy = true;
  g.max_new_tokens = 4;
  e.add({0, {1, 2, 3}, g, 1});
  EXPECT_EQ(run_all(e).at({0, 0}).tokens.size(), 4u);
}

}  // namespace
}  // namespace tiller::engine
