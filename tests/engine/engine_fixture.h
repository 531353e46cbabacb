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

}  // namespace
}  // namespace tiller::engine
