// What the engine's tests share (engine_test.cpp, engine_sessions_test.cpp): tiny models of each
// family made with transformers' layouts, small engine options, prompts, and running an engine dry.
#pragma once

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
#include "tiller/model/lora.h"
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

// LoRA adapters of rank 4 (alpha 8) on every projection, drawn with seed 3, their B given weight
// (PEFT starts B at zero, which would change nothing).
struct TestLora {
  model::LoraSpec spec;
  model::NamedTensors adapters;
};
TestLora test_lora(const model::ModelConfig& cfg) {
  TestLora l;
  l.spec.rank = 4;
  l.spec.alpha = 8;
  l.spec.targets = model::lora_targets("all-linear", cfg, "test");
  l.adapters = model::init_lora(cfg, l.spec, 3);
  at::Generator gen = at::detail::createCPUGenerator(4);
  for (auto& [n, t] : l.adapters)
    if (n.find("lora_B") != std::string::npos) t = at::randn(t.sizes(), gen, at::kFloat) * 0.3;
  return l;
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

}  // namespace
}  // namespace tiller::engine
