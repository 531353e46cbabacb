// The engine against the reference generator and the trainer's forward (fp32 on CPU), and under
// load: shared prompts, preemption, concurrency, aborts and bad requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>
#include <map>
#include <random>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include "tiller/engine/engine.h"
#include "tiller/model/generate.h"
#include "tiller/model/transformer.h"

namespace tiller::engine {
namespace {

using model::SamplingParams;

struct TinyModel {
  model::ModelConfig cfg;
  model::NamedTensors named;
  model::ModelWeights weights;
};

// Random weights, drawn wide enough that the logits have clear winners (greedy decoding is then
// not at the mercy of rounding differences between the engine's and the reference's paths).
TinyModel tiny(const std::string& preset, uint64_t seed = 1) {
  TinyModel m;
  m.cfg = model::preset(preset);
  m.cfg.initializer_range = 0.25;
  m.named = model::init_weights(m.cfg, model::Head::kLm, seed, at::kFloat);
  m.weights = model::bind_weights(m.cfg, m.named, model::Head::kLm, preset);
  return m;
}

EngineOptions small_options(int64_t num_blocks = 256) {
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = num_blocks;
  o.limits.max_num_seqs = 8;
  o.limits.max_batched_tokens = 24;  // long prompts are chunked
  return o;
}

std::vector<std::vector<int64_t>> prompts(int count, uint64_t seed, int64_t vocab, int max_len = 40) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int64_t>> out;
  for (int i = 0; i < count; ++i) {
    std::vector<int64_t> p(1 + rng() % max_len);
    for (auto& t : p) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab - 1));
    out.push_back(p);
  }
  return out;
}

// Runs the engine until every request is done; outputs by (request, sample).
std::map<std::pair<uint64_t, int64_t>, SampleOutput> run_all(Engine& e) {
  std::map<std::pair<uint64_t, int64_t>, SampleOutput> out;
  for (int steps = 0; e.has_work(); ++steps) {
    EXPECT_LT(steps, 100000) << "the engine does not finish";
    if (steps >= 100000) break;
    for (auto& o : e.step()) out[{o.request_id, o.sample}] = std::move(o);
  }
  return out;
}

// The trainer's view: log-probs at `temperature` of every generated token, from one forward of
// prompt + completion.
at::Tensor trainer_logprobs(const TinyModel& m, const std::vector<int64_t>& prompt, const std::vector<int64_t>& gen,
                            double temperature, at::Tensor* argmax = nullptr) {
  c10::AutoGradMode no_grad(false);
  std::vector<int64_t> seq = prompt;
  seq.insert(seq.end(), gen.begin(), gen.end());
  at::Tensor h = model::forward_hidden(m.cfg, m.weights, model::PackedBatch::pack({seq}, at::kCPU));
  const auto p = static_cast<int64_t>(prompt.size()), g = static_cast<int64_t>(gen.size());
  at::Tensor rows = h.narrow(0, p - 1, g);
  if (argmax) *argmax = model::logits(rows, m.weights.lm_head).argmax(1);
  return model::token_logprobs(rows, m.weights.lm_head, at::tensor(gen, at::kLong), temperature);
}

// Every token's log-prob against the trainer's forward with the weights of the version that drew it
// (version 0: `a`, version 1: `b`), at temperature 1; at least one sample spans the update.
void expect_logprobs_of_their_versions(const std::map<std::pair<uint64_t, int64_t>, SampleOutput>& out,
                                       const std::vector<std::vector<int64_t>>& ps, const TinyModel& a,
                                       const TinyModel& b, double tol) {
  int spanning = 0;
  for (const auto& [key, x] : out) {
    const at::Tensor lp_a = trainer_logprobs(a, ps[key.first], x.tokens, 1.0);
    const at::Tensor lp_b = trainer_logprobs(b, ps[key.first], x.tokens, 1.0);
    ASSERT_FALSE(x.versions.empty());
    spanning += x.versions.size() > 1;
    for (size_t j = 0; j < x.tokens.size(); ++j) {
      size_t run = 0;
      while (run + 1 < x.version_starts.size() && static_cast<int64_t>(j) >= x.version_starts[run + 1]) ++run;
      const at::Tensor& want = x.versions[run] == 0 ? lp_a : lp_b;
      EXPECT_NEAR(x.logprobs[j], want[static_cast<int64_t>(j)].item<double>(), tol)
          << "request " << key.first << " sample " << key.second << " token " << j << " version " << x.versions[run];
    }
  }
  EXPECT_GT(spanning, 0);
}

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

INSTANTIATE_TEST_SUITE_P(Tiny, EngineFamily, ::testing::Values("tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-mistral"));

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

// Multi-turn: each turn's prompt is the session's tokens plus an observation. Resuming the parked
// session computes only the new tokens (the counters), and gives what a fresh engine gives for the
// whole prompt (tokens equal, log-probs within fp32 rounding of a different prefill split); a
// prompt that diverges from the session inside it reuses the common prefix.
void check_sessions(const std::string& device, double tol) {
  TinyModel m = tiny("tiny-qwen2");
  EngineOptions o = small_options(256);
  o.device = device;
  model::NamedTensors named;
  for (const auto& [name, t] : m.named) named[name] = t.to(at::Device(device));
  const model::ModelWeights w = model::bind_weights(m.cfg, named, model::Head::kLm, "tiny-qwen2");
  Engine e(m.cfg, w, o);
  const auto ps = prompts(1, 5, m.cfg.vocab_size, 12);
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 9;
  p.max_new_tokens = 6;
  Request first{1, ps[0], p, 2};
  first.keep_session = true;
  e.add(first);
  auto out = run_all(e);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(e.stats().sessions_parked, 2);
  EXPECT_LT(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
  std::vector<std::vector<int64_t>> turn(2);
  for (int64_t j = 0; j < 2; ++j) {
    turn[static_cast<size_t>(j)] = ps[0];
    const auto& g = out.at({1, j}).tokens;
    turn[static_cast<size_t>(j)].insert(turn[static_cast<size_t>(j)].end(), g.begin(), g.end());
    for (int64_t k = 0; k < 3 + j; ++k) turn[static_cast<size_t>(j)].push_back(11 + k);  // the observation
  }
  // Turns 2 and 3 resume; the reference engine serves the same prompts from scratch.
  Engine fresh(m.cfg, w, o);
  for (int t = 0; t < 2; ++t) {
    const EngineStats before = e.stats();
    int64_t cached = 0;
    for (int64_t j = 0; j < 2; ++j) {
      Request r{static_cast<uint64_t>(10 * (t + 1) + j), turn[static_cast<size_t>(j)], p, 1};
      r.params.seed = 100 + t;
      r.keep_session = true;
      r.resume = true;
      r.session = {t == 0 ? 1 : static_cast<uint64_t>(10 * t + j), t == 0 ? j : 0};
      // The session's computed tokens: all but its last sampled one.
      const int64_t prev = t == 0 ? static_cast<int64_t>(ps[0].size()) + 6 : 0;
      cached += t == 0 ? prev - 1 : 0;
      e.add(r);
      Request f = r;
      f.resume = false;
      f.keep_session = false;
      fresh.add(f);
    }
    auto got = run_all(e), want = run_all(fresh);
    const EngineStats after = e.stats();
    EXPECT_EQ(after.session_resumes - before.session_resumes, 2);
    EXPECT_EQ(after.session_misses, 0);
    const int64_t reused = after.session_tokens_reused - before.session_tokens_reused;
    if (t == 0) EXPECT_EQ(reused, cached);
    int64_t whole = 0;
    for (int64_t j = 0; j < 2; ++j) whole += static_cast<int64_t>(turn[static_cast<size_t>(j)].size());
    EXPECT_EQ(after.prefill_tokens - before.prefill_tokens, whole - reused) << "turn " << t + 2;
    for (int64_t j = 0; j < 2; ++j) {
      const auto key = std::make_pair(static_cast<uint64_t>(10 * (t + 1) + j), int64_t{0});
      EXPECT_EQ(got.at(key).tokens, want.at(key).tokens) << "turn " << t + 2 << " sample " << j;
      ASSERT_EQ(got.at(key).logprobs.size(), want.at(key).logprobs.size());
      for (size_t k = 0; k < got.at(key).logprobs.size(); ++k)
        EXPECT_NEAR(got.at(key).logprobs[k], want.at(key).logprobs[k], tol);
      auto& next = turn[static_cast<size_t>(j)];
      next.insert(next.end(), got.at(key).tokens.begin(), got.at(key).tokens.end());
      next.push_back(17);
      next.push_back(18);
    }
  }
  // A prompt that leaves the session after its 3rd token reuses those 3.
  Request diverge{40, turn[0], p, 1};
  diverge.prompt[3] = (diverge.prompt[3] + 1) % m.cfg.vocab_size;
  diverge.resume = true;
  diverge.session = {20, 0};
  const int64_t reused_before = e.stats().session_tokens_reused;
  e.add(diverge);
  run_all(e);
  EXPECT_EQ(e.stats().session_tokens_reused - reused_before, 3);
  // A session that is gone (released) is served from the prompt: a miss.
  EXPECT_TRUE(e.release_session({21, 0}));
  EXPECT_FALSE(e.release_session({21, 0}));
  Request gone{41, turn[1], p, 1};
  gone.resume = true;
  gone.session = {21, 0};
  e.add(gone);
  run_all(e);
  EXPECT_EQ(e.stats().session_misses, 1);
  EXPECT_EQ(e.stats().sessions_parked, 0);
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
  Request many{42, turn[1], p, 2};
  many.resume = true;
  EXPECT_THROW(e.add(many), InvalidRequest);
}

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

// Asynchronous scheduling (the next decode step launched before the host has seen this one's
// draws) against the synchronous engine on the same requests: the same samples. Half the
// requests get a stop id taken from a first run's output, so their samples stop mid-way (their
// rows in the step launched ahead are dropped) and free seats for waiting requests; a small
// cache brings preemption, n > 1 brings forks, and one request is aborted while a step is in
// flight.
// `tol`: log-probs (fp32 on the GPU round differently with the batch size).
void expect_async_equals_sync(const TinyModel& m, const model::ModelWeights& w, const std::string& device,
                              double tol) {
  const auto ps = prompts(24, 41, m.cfg.vocab_size, 40);
  std::map<uint64_t, std::vector<int64_t>> stops;
  auto run = [&](bool async, bool abort) {
    EngineOptions o = small_options(60);
    o.device = device;
    o.limits.max_num_seqs = 10;
    o.async_scheduling = async;
    Engine e(m.cfg, w, o);
    for (size_t i = 0; i < ps.size(); ++i) {
      SamplingParams p;
      p.greedy = i % 3 == 0;
      p.temperature = 0.8;
      p.top_k = i % 4 == 1 ? 40 : 0;
      p.seed = 7 * i;
      p.max_new_tokens = 6 + static_cast<int64_t>(i % 5) * 6;
      if (stops.count(i)) p.stop_token_ids = stops.at(i);
      e.add({i, ps[i], p, 1 + static_cast<int64_t>(i % 3)});
    }
    std::map<std::pair<uint64_t, int64_t>, SampleOutput> out;
    for (int steps = 0; e.has_work() && steps < 10000; ++steps) {
      if (abort && steps == 6) EXPECT_TRUE(e.abort(4));
      for (auto& r : e.step()) out[{r.request_id, r.sample}] = std::move(r);
    }
    EXPECT_FALSE(e.has_work());
    EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
    EXPECT_EQ(e.stats().launched_ahead > 0, async);
    return std::make_pair(out, e.stats());
  };
  const auto first = run(false, false).first;
  for (const auto& [key, r] : first)
    if (key.first % 2 == 0 && key.second == 0) stops[key.first] = {r.tokens[r.tokens.size() / 2]};
  const auto [want, want_stats] = run(false, true);
  const auto [got, got_stats] = run(true, true);
  ASSERT_EQ(got.size(), want.size());
  int stopped = 0;
  for (const auto& [key, wr] : want) {
    const SampleOutput& g = got.at(key);
    EXPECT_EQ(g.finish_reason, wr.finish_reason) << "request " << key.first << " sample " << key.second;
    stopped += wr.finish_reason == "stop";
    if (key.first == 4) continue;  // aborted: how far it got depends on when it was admitted
    EXPECT_EQ(g.tokens, wr.tokens) << "request " << key.first << " sample " << key.second;
    ASSERT_EQ(g.logprobs.size(), wr.logprobs.size());
    for (size_t j = 0; j < g.logprobs.size(); ++j) EXPECT_NEAR(g.logprobs[j], wr.logprobs[j], tol);
  }
  EXPECT_EQ(got.at({4, 0}).finish_reason, "abort");
  EXPECT_GE(stopped, 8);
  EXPECT_GT(want_stats.preemptions + got_stats.preemptions, 0);
  EXPECT_GT(got_stats.launched_ahead, got_stats.steps / 3);
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

// A weight update at an arbitrary step under load: several prompts of four samples each decoding in
// one batch, chunked prefills. `a` is served first, then `b`; every log-prob must be its version's.
void check_weight_update_under_load(const std::string& device, double tol) {
  TinyModel a = tiny("tiny-qwen2", 1), b = tiny("tiny-qwen2", 2);
  model::NamedTensors served;  // the engine's own storage, overwritten by the update
  for (const auto& [name, t] : a.named) served[name] = t.to(at::Device(device), /*non_blocking=*/false, /*copy=*/true);
  const model::ModelWeights w = model::bind_weights(a.cfg, served, model::Head::kLm, "tiny-qwen2");
  EngineOptions o = small_options();
  o.device = device;
  o.limits.max_num_seqs = 32;
  Engine e(a.cfg, w, o);
  const auto ps = prompts(6, 33, a.cfg.vocab_size, 30);
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 5;
  p.max_new_tokens = 20;
  for (size_t i = 0; i < ps.size(); ++i) e.add({i, ps[i], p, 4});
  std::map<std::pair<uint64_t, int64_t>, SampleOutput> out;
  for (int s = 0; s < 9; ++s)
    for (auto& x : e.step()) out[{x.request_id, x.sample}] = std::move(x);
  for (auto& x : e.drain()) out[{x.request_id, x.sample}] = std::move(x);
  {
    c10::InferenceMode inference;  // the engine's weights are inference tensors
    for (auto& [name, t] : e.parameters()) t.copy_(b.named.at(name));
  }
  e.weights_updated(1);
  for (auto& [k, x] : run_all(e)) out[k] = std::move(x);
  ASSERT_EQ(out.size(), 24u);
  expect_logprobs_of_their_versions(out, ps, a, b, tol);
  EXPECT_EQ(e.stats().kv_blocks_free, e.stats().kv_blocks_total);
}

TEST(Engine, AWeightUpdateUnderLoadKeepsEveryLogprobOfItsVersion) { check_weight_update_under_load("cpu", 2e-5); }

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
